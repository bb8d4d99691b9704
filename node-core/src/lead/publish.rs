//! Handing out what a leader made: a learning update, signed, spread through the holders
//! ([`crate::holder::spread`]), and the members a group caught, reported to every holder.

use std::collections::BTreeMap;

use libp2p::PeerId;

use super::LeadError;
use crate::coded::Caught;
use crate::holder::{Link, Passed, PieceList, pass_on, tell};
use crate::learn::{Header, Published, Signer, Update, seal};
use crate::mesh::MeshRequest;

/// An update signed by a leader, ready to hand out.
#[derive(Debug, Clone)]
pub struct Sealed {
    /// Its id (the hash of its payload).
    pub id: u64,
    /// The signed bytes a holder takes.
    pub bytes: Vec<u8>,
    /// Its signed [`PieceList`], which holders check each piece against.
    pub list: Vec<u8>,
}

/// Signs a published update as `signer`, with `header` (its time and the gate's verdict);
/// its piece list is signed with the same.
pub fn seal_update(p: &Published, signer: &Signer, header: Header) -> Result<Sealed, LeadError> {
    let payload = p.update.encode();
    let id = Update::id_of(&payload);
    let bytes = seal(payload, &signer.key, signer.cert.as_ref(), header)?;
    let list = PieceList::of(id, &bytes).seal(signer, header)?;
    Ok(Sealed { id, bytes, list })
}

/// Starts `update` spreading through `holders` (the earliest hear first): at most
/// [`crate::holder::FANOUT`] of them are told by the leader, and they pull it from `source`
/// (the leader's own node, which keeps it) or, with none, get it with the notice.
pub async fn spread_out<L: Link<Peer = PeerId>>(
    link: &L,
    holders: &[PeerId],
    update: &Sealed,
    source: Option<PeerId>,
) -> Passed {
    let passed = match source {
        Some(me) => pass_on(link, &update.list, &[me.to_string()], holders, None).await,
        None => pass_on(link, &update.list, &[], holders, Some(&update.bytes)).await,
    };
    if passed.taken == 0 && !holders.is_empty() {
        tracing::warn!(
            id = format!("{:016x}", update.id),
            "no holder took the update's notice: holders catch up when they hear of it"
        );
    }
    passed
}

/// What handing out an update did.
#[derive(Debug, Clone, Copy)]
pub struct Sent {
    /// Its id.
    pub id: u64,
    /// Its size, signed.
    pub bytes: usize,
    /// How many holders the leader told (at most [`crate::holder::FANOUT`]; they tell the rest).
    pub told: usize,
    /// Bytes of it the leader sent with its notices.
    pub sent_bytes: u64,
    /// Requests folded into it.
    pub requests: u32,
    /// Share of the gradient energy its compression kept.
    pub kept: f64,
}

/// Members a group caught, reported.
#[derive(Debug, Clone, Default)]
pub struct Reported {
    /// Each caught member: its row, its holder and the evidence.
    pub caught: Vec<(usize, PeerId, Caught)>,
    /// How many holders the leader told of every report (at most
    /// [`crate::holder::FANOUT`]; they tell the rest).
    pub taken_by: usize,
}

/// Tells `holders` about the members in `caught` (rows of a group over `rows`), with the
/// evidence, signed as `signer` at `now_ms`: at most [`crate::holder::FANOUT`] of them
/// directly, who pass it on ([`crate::holder::tell`]); a row with no known holder is skipped.
/// Holders act on it only when the mesh admits `signer` to report.
pub async fn report_caught<L: Link<Peer = PeerId>>(
    link: &L,
    signer: &Signer,
    now_ms: u64,
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
    let mut tells = Vec::new();
    for (_, peer, evidence) in &caught {
        let report = match crate::holder::sign_report(signer, *peer, evidence, now_ms) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(%peer, "a report could not be signed: {e}");
                continue;
            }
        };
        let ask = move |rest| MeshRequest::Report {
            report: report.clone(),
            to: rest,
        };
        tells.push(async move { tell(link, holders, ask, 0, "a caught member's report").await });
    }
    let taken_by = futures::future::join_all(tells)
        .await
        .into_iter()
        .map(|p| p.taken)
        .min()
        .unwrap_or(0);
    Reported { caught, taken_by }
}
