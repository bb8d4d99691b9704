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

/// A peer ahead of a holder, as its heartbeats announce it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ahead {
    /// Updates it claims.
    pub count: u64,
    /// The digest of its version.
    pub digest: [u8; 32],
    /// Requests it led (leaders have their own work).
    pub led: u64,
    /// Whether this holder pulled from it lately without coming level.
    pub tried: bool,
}

/// Whom a holder behind pulls its missing updates from: a peer at the version the most peers
/// ahead announce (then the most updates), one not tried lately if there is one, and of those
/// the one that led the fewest requests. A count a peer announces is a claim: a liar claiming
/// a huge one is not chosen over the version the others share, and one that gave nothing is
/// tried again only when no other is left.
pub fn catch_up_source<P: Clone + Ord>(ahead: &[(P, Ahead)]) -> Option<P> {
    let mut at: std::collections::BTreeMap<[u8; 32], (usize, u64)> = Default::default();
    for (_, a) in ahead {
        let e = at.entry(a.digest).or_default();
        e.0 += 1;
        e.1 = e.1.max(a.count);
    }
    let (digest, _) = at
        .into_iter()
        .max_by_key(|&(d, (peers, count))| (peers, count, d))?;
    ahead
        .iter()
        .filter(|(_, a)| a.digest == digest)
        .min_by_key(|(p, a)| (a.tried, a.led, p.clone()))
        .map(|(p, _)| p.clone())
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

#[cfg(test)]
mod tests {
    use super::*;

    fn at(count: u64, digest: u8, led: u64, tried: bool) -> Ahead {
        Ahead {
            count,
            digest: [digest; 32],
            led,
            tried,
        }
    }

    #[test]
    fn a_liar_claiming_more_updates_is_not_the_source_the_others_outvote() {
        // Three peers at version 5 (count 6); a liar claims a billion updates.
        let ahead = [
            (1, at(6, 5, 10, false)),
            (2, at(6, 5, 3, false)),
            (3, at(6, 5, 7, false)),
            (4, at(1_000_000_000, 9, 0, false)),
        ];
        assert_eq!(
            catch_up_source(&ahead),
            Some(2),
            "the least busy at the shared version"
        );
        // Tried lately without coming level: the next one is asked.
        let mut retried = ahead;
        retried[1].1.tried = true;
        assert_eq!(catch_up_source(&retried), Some(3));
        // All tried: still one (the least busy).
        for a in &mut retried {
            a.1.tried = true;
        }
        assert_eq!(catch_up_source(&retried), Some(2));
        assert_eq!(catch_up_source::<u32>(&[]), None);
    }
}
