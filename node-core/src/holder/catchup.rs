//! Catching up: the learning updates a peer applied that this holder lacks, fetched over the
//! holder's [`Link`]; written once for the native and the browser node, which apply them their
//! own way (the native node as each arrives, the browser once no step uses its shard).

use super::join::fetch_pieces;
use super::{HolderError, Link, MAX_UPDATE_BYTES, describe, update_chunk_request};
use crate::mesh::{Heartbeat, MeshRequest, MeshResponse, ShardVersion};

/// Whether a peer announcing `theirs` holds updates of the same model that a holder announcing
/// `ours` lacks (the peer is at another version, and not behind).
pub fn worth_catching_up(ours: &Heartbeat, theirs: &Heartbeat) -> bool {
    theirs.model == ours.model
        && theirs.version_digest != ours.version_digest
        && theirs.version_count >= ours.version_count
}

/// The ids of the updates `peer` applied and `have` lacks, in `peer`'s order.
pub async fn missing_update_ids<L: Link>(
    link: &L,
    peer: &L::Peer,
    have: &ShardVersion,
) -> Result<Vec<u64>, HolderError> {
    match link.ask(peer, MeshRequest::Versions).await? {
        MeshResponse::Versions { ids } => {
            Ok(ids.into_iter().filter(|id| !have.contains(*id)).collect())
        }
        other => Err(HolderError::Download(format!(
            "asked {peer} for its versions, got a {}",
            describe(&other)
        ))),
    }
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
