//! Handing out what a leader made: a learning update, signed, to every holder, and the members
//! a group caught, reported to them.

use std::collections::BTreeMap;

use libp2p::PeerId;

use super::LeadError;
use crate::coded::Caught;
use crate::holder::Link;
use crate::learn::{Published, Update, seal};
use crate::mesh::{MeshRequest, MeshResponse};

/// An update signed by a leader, ready to hand out.
#[derive(Debug, Clone)]
pub struct Sealed {
    /// Its id (the hash of its payload).
    pub id: u64,
    /// The signed bytes a holder takes.
    pub bytes: Vec<u8>,
}

/// Signs a published update with the leader's key.
pub fn seal_update(p: &Published, key: &libp2p::identity::Keypair) -> Result<Sealed, LeadError> {
    let payload = p.update.encode();
    let id = Update::id_of(&payload);
    Ok(Sealed {
        id,
        bytes: seal(payload, key)?,
    })
}

/// Hands a sealed update to every one of `holders` at once; returns how many took it (the
/// others are logged: they catch up from those that did).
pub async fn hand_out<L: Link<Peer = PeerId>>(
    link: &L,
    holders: &[PeerId],
    update: &Sealed,
) -> usize {
    let sends = holders.iter().map(|peer| async move {
        let req = MeshRequest::Learn(update.bytes.clone());
        (peer, link.ask(peer, req).await)
    });
    let mut taken = 0;
    for (peer, answer) in futures::future::join_all(sends).await {
        match answer {
            Ok(MeshResponse::Learned { .. }) => taken += 1,
            Ok(MeshResponse::Error(e)) => tracing::warn!(%peer, "a node refused the update: {e}"),
            Ok(_) => tracing::warn!(%peer, "a node answered the update with something else"),
            Err(e) => tracing::warn!(%peer, "the update did not reach a node: {e}"),
        }
    }
    taken
}

/// What handing out an update did.
#[derive(Debug, Clone, Copy)]
pub struct Sent {
    /// Its id.
    pub id: u64,
    /// Its size, signed.
    pub bytes: usize,
    /// How many holders took it.
    pub applied_by: usize,
    /// Requests folded into it.
    pub requests: u32,
    /// Share of the gradient energy its compression kept.
    pub kept: f64,
}

/// Signs `p` and hands it to every one of `holders`.
pub async fn publish<L: Link<Peer = PeerId>>(
    link: &L,
    key: &libp2p::identity::Keypair,
    holders: &[PeerId],
    p: &Published,
) -> Result<Sent, LeadError> {
    Ok(publish_sealed(link, holders, &seal_update(p, key)?, p).await)
}

/// Hands `sealed` (the signed form of `p`) to every one of `holders`.
pub async fn publish_sealed<L: Link<Peer = PeerId>>(
    link: &L,
    holders: &[PeerId],
    sealed: &Sealed,
    p: &Published,
) -> Sent {
    let applied_by = hand_out(link, holders, sealed).await;
    Sent {
        id: sealed.id,
        bytes: sealed.bytes.len(),
        applied_by,
        requests: p.requests,
        kept: p.kept,
    }
}

/// Members a group caught, reported.
#[derive(Debug, Clone, Default)]
pub struct Reported {
    /// Each caught member: its row, its holder and the evidence.
    pub caught: Vec<(usize, PeerId, Caught)>,
    /// How many of the holders told took every report.
    pub taken_by: usize,
}

/// Tells every one of `holders` about the members in `caught` (rows of a group over `rows`),
/// with the evidence; a row with no known holder is skipped.
pub async fn report_caught<L: Link<Peer = PeerId>>(
    link: &L,
    caught: &[Caught],
    rows: &BTreeMap<usize, PeerId>,
    holders: &[PeerId],
) -> Reported {
    let caught: Vec<(usize, PeerId, Caught)> = caught
        .iter()
        .filter_map(|c| Some((c.node, *rows.get(&c.node)?, c.clone())))
        .collect();
    if caught.is_empty() {
        return Reported::default();
    }
    let sends = holders.iter().map(|to| {
        let caught = &caught;
        async move {
            for (_, peer, evidence) in caught {
                let req = MeshRequest::Report {
                    peer: peer.to_string(),
                    evidence: evidence.clone(),
                };
                match link.ask(to, req).await {
                    Ok(MeshResponse::Error(e)) => {
                        tracing::warn!(%to, "report not taken: {e}");
                        return false;
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(%to, "report not taken: {e}");
                        return false;
                    }
                }
            }
            true
        }
    });
    let taken_by = futures::future::join_all(sends)
        .await
        .into_iter()
        .filter(|&ok| ok)
        .count();
    Reported { caught, taken_by }
}
