//! Catching up: the learning updates a peer applied that this holder lacks, fetched over the
//! holder's [`Link`]; written once for the native and the browser node, which apply them their
//! own way (the native node as each arrives, the browser once no step uses its shard). A holder
//! further behind than the peer's oldest kept update rebuilds its row instead
//! ([`crate::mesh::plan_catch_up`], [`super::rebuild`]).

use super::join::fetch_pieces;
use super::{HolderError, Link, MAX_UPDATE_BYTES, describe, update_chunk_request};
use crate::mesh::{CatchUp, Heartbeat, MeshRequest, MeshResponse, ShardVersion, plan_catch_up};

/// Whether a peer announcing `theirs` may hold updates of the same model that a holder
/// announcing `ours` lacks (the peer is at another version, and not behind).
pub fn worth_catching_up(ours: &Heartbeat, theirs: &Heartbeat) -> bool {
    theirs.model == ours.model
        && theirs.version_digest != ours.version_digest
        && theirs.version_count >= ours.version_count
}

/// `peer`'s version.
pub async fn version_of<L: Link>(link: &L, peer: &L::Peer) -> Result<ShardVersion, HolderError> {
    match link.ask(peer, MeshRequest::Versions).await? {
        MeshResponse::Versions(v) => Ok(v),
        other => Err(HolderError::Download(format!(
            "asked {peer} for its version, got a {}",
            describe(&other)
        ))),
    }
}

/// What a holder at `have` does to catch up with `peer`, and the peer's version.
pub async fn plan_with<L: Link>(
    link: &L,
    peer: &L::Peer,
    have: &ShardVersion,
) -> Result<(CatchUp, ShardVersion), HolderError> {
    let theirs = version_of(link, peer).await?;
    Ok((plan_catch_up(have, &theirs), theirs))
}

/// Update `id`'s payload from `peer`, piece by piece (at most [`MAX_UPDATE_BYTES`]).
pub async fn fetch_update<L: Link>(
    link: &L,
    peer: &L::Peer,
    id: u64,
) -> Result<Vec<u8>, HolderError> {
    let request = |offset| update_chunk_request(id, offset);
    Ok(fetch_pieces(link, peer, MAX_UPDATE_BYTES, None, request)
        .await?
        .0)
}
