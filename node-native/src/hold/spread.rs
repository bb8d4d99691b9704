//! Learning updates spreading through this node ([`node_core::holder::spread`]): it takes a
//! notice, passes it on at once, pulls the pieces and serves each to the holders it told as
//! soon as it has it, then applies the update like one handed to it.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use libp2p::PeerId;
use node_core::holder::{self, Opened, PIECE_BYTES, PieceList};
use node_core::mesh::{CatchUp, MeshResponse};
use prometheus_client::metrics::counter::Counter;
use tokio::sync::watch;

use crate::hold::learning::{Rules, ShardState, UpdateStore, read};
use crate::hold::link::NativeLink;
use crate::hold::row::{Internal, apply_and_keep, learn};
use crate::net::swarm::Client;

/// How long a leader waits, beyond an update's bytes at [`node_core::net::hop::MIN_RATE`], for
/// its group's members to apply it.
pub const PUBLISH_WAIT: Duration = Duration::from_secs(10);

/// How long a holder catching up waits for a peer to say its version.
const CATCH_UP_ASK: Duration = Duration::from_secs(10);

/// How long a holder pulling a piece from this node waits for it to arrive here.
pub const PIECE_WAIT: Duration = Duration::from_secs(30);

/// Updates this node is pulling, by id, with the pieces it has so far, and those it fetches
/// while catching up: each update is fetched once, by whichever way reached it first.
#[derive(Debug, Clone, Default)]
pub struct Spreads(Arc<Mutex<Pulls>>);

/// What [`Spreads`] guards.
#[derive(Debug, Default)]
struct Pulls {
    /// Updates pulled after a notice, served piece by piece as they arrive.
    spreading: HashMap<u64, Arc<InFlight>>,
    /// Updates fetched by a catch-up.
    fetching: HashSet<u64>,
}

impl Pulls {
    fn has(&self, id: u64) -> bool {
        self.spreading.contains_key(&id) || self.fetching.contains(&id)
    }
}

/// A catch-up's claim on fetching an update ([`Spreads::claim`]); released when dropped.
#[derive(Debug)]
pub struct Claim {
    spreads: Spreads,
    id: u64,
}

impl Drop for Claim {
    fn drop(&mut self) {
        self.spreads.lock().fetching.remove(&self.id);
    }
}

/// An update being pulled: its pieces so far, and their count, which wakes the holders waiting
/// for the next (the count's sender drops when the pull ends).
#[derive(Debug)]
struct InFlight {
    list: PieceList,
    pieces: Mutex<Vec<Vec<u8>>>,
    count: watch::Sender<usize>,
}

impl Spreads {
    fn lock(&self) -> std::sync::MutexGuard<'_, Pulls> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether no update is being pulled after a notice.
    pub fn is_empty(&self) -> bool {
        self.lock().spreading.is_empty()
    }

    /// Claims update `id` for a catch-up to fetch; `None` when a notice's pull or another
    /// catch-up already fetches it.
    pub fn claim(&self, id: u64) -> Option<Claim> {
        let mut pulls = self.lock();
        if pulls.has(id) {
            return None;
        }
        pulls.fetching.insert(id);
        Some(Claim {
            spreads: self.clone(),
            id,
        })
    }

    /// Whether a catch-up fetches update `id`.
    fn fetching(&self, id: u64) -> bool {
        self.lock().fetching.contains(&id)
    }

    /// Starts pulling `list`'s update; `None` when it is already being pulled or fetched.
    fn start(&self, list: &PieceList) -> Option<Arc<InFlight>> {
        let mut pulls = self.lock();
        if pulls.has(list.id) {
            return None;
        }
        let f = Arc::new(InFlight {
            list: list.clone(),
            pieces: Mutex::new(Vec::with_capacity(list.len())),
            count: watch::Sender::new(0),
        });
        pulls.spreading.insert(list.id, f.clone());
        Some(f)
    }

    fn end(&self, id: u64) {
        self.lock().spreading.remove(&id);
    }

    /// The answer to a request for the piece at `offset` of update `id`, once this node has
    /// it; `None` when this node is not pulling `id`.
    pub fn piece(
        &self,
        id: u64,
        offset: u64,
    ) -> Option<impl Future<Output = MeshResponse> + use<>> {
        let f = self.lock().spreading.get(&id)?.clone();
        Some(async move {
            if !offset.is_multiple_of(PIECE_BYTES as u64) {
                return MeshResponse::Error(format!(
                    "update {id:016x} is arriving here: ask for whole pieces of {PIECE_BYTES} bytes"
                ));
            }
            let i = (offset / PIECE_BYTES as u64) as usize;
            if i >= f.list.len() {
                return MeshResponse::Error(format!("update {id:016x} has no byte {offset}"));
            }
            let mut count = f.count.subscribe();
            match tokio::time::timeout(PIECE_WAIT, count.wait_for(|&n| n > i)).await {
                Ok(Ok(_)) => MeshResponse::Chunk {
                    total: f.list.total,
                    version: [0; 32],
                    bytes: f.pieces.lock().unwrap_or_else(PoisonError::into_inner)[i].clone(),
                },
                Ok(Err(_)) => MeshResponse::Error(format!(
                    "this node's pull of update {id:016x} failed: pull it from the next"
                )),
                Err(_) => MeshResponse::Error(format!(
                    "piece {i} of update {id:016x} did not arrive here within {} s",
                    PIECE_WAIT.as_secs()
                )),
            }
        })
    }
}

impl InFlight {
    fn push(&self, bytes: &[u8]) {
        let mut pieces = self.pieces.lock().unwrap_or_else(PoisonError::into_inner);
        pieces.push(bytes.to_vec());
        self.count.send_replace(pieces.len());
    }
}

/// What taking an update, by a notice or a catch-up, needs of the node.
#[derive(Clone)]
pub(crate) struct Relay {
    pub client: Client,
    pub spreads: Spreads,
    pub state: Arc<RwLock<ShardState>>,
    pub store: UpdateStore,
    pub rules: Rules,
    pub tx: tokio::sync::mpsc::Sender<Internal>,
    pub received: Counter,
    pub duplicates: Counter,
}

impl Relay {
    /// Takes a checked notice: passes it on at once, telling the next holders to pull from this
    /// node (before the ones that told it), pulls the update unless this node has it or is
    /// pulling or fetching it, and applies it.
    pub async fn take(self, notice: Opened<PeerId>) {
        let id = notice.list.id;
        let me = self.client.peer_id();
        let link = NativeLink::quiet(self.client.clone());
        let (applied, kept) = {
            let v = &read(&self.state).version;
            (v.contains(id), v.keeps(id))
        };
        let pulling = (!applied)
            .then(|| self.spreads.start(&notice.list))
            .flatten();
        // Not applied here means pulled here, by this notice or one before it, unless a
        // catch-up fetches it (its pieces are not served until it is kept).
        let serves = kept || (!applied && !self.spreads.fetching(id));
        let mut sources: Vec<String> = serves.then(|| me.to_string()).into_iter().collect();
        sources.extend(notice.sources.iter().map(ToString::to_string));
        // With no holder to pull from (a leader sent it whole), the next get it whole too.
        let inline = notice.inline.as_deref().filter(|_| sources.is_empty());
        let pass = holder::pass_on(&link, &notice.list_bytes, &sources, &notice.to, inline);
        let Some(f) = pulling else {
            if notice.inline.is_some() {
                self.duplicates.inc_by(notice.list.len() as u64);
            }
            pass.await;
            return;
        };
        let get = async {
            match &notice.inline {
                Some(bytes) => {
                    for i in 0..notice.list.len() {
                        let (start, len) = notice.list.range(i);
                        f.push(&bytes[start as usize..start as usize + len as usize]);
                    }
                    Ok(bytes.clone())
                }
                None => holder::pull(&link, &notice.list, &notice.sources, |_, b| f.push(b))
                    .await
                    .map(|(bytes, _)| bytes),
            }
        };
        let (got, passed) = futures::join!(get, pass);
        tracing::debug!(id = format!("{id:016x}"), ?passed, "passed a notice on");
        match got {
            Ok(bytes) => {
                self.received.inc_by(bytes.len() as u64);
                if read(&self.state).version.contains(id) {
                    self.duplicates.inc_by(notice.list.len() as u64);
                }
                let (state, store, rules, tx) = (self.state, self.store, self.rules, self.tx);
                let answer =
                    tokio::task::spawn_blocking(move || learn(&state, &store, &rules, &tx, &bytes))
                        .await
                        .unwrap_or_else(|e| MeshResponse::Error(e.to_string()));
                match answer {
                    MeshResponse::Learned { id: got, .. } if got == id => {}
                    MeshResponse::Learned { id: got, .. } => tracing::warn!(
                        "the notice named update {id:016x}, its pieces made update {got:016x}"
                    ),
                    other => tracing::warn!(
                        id = format!("{id:016x}"),
                        "a spread update was not applied: {other:?}"
                    ),
                }
            }
            Err(e) => tracing::warn!(
                id = format!("{id:016x}"),
                "pulling a spreading update: {e}; catching up later"
            ),
        }
        self.spreads.end(id);
    }
}

/// Fetches and applies every update `peer` keeps that this node lacks, but those a notice's
/// pull already brings; the peer's version when those would not bring this node up to it (the
/// peer folded updates this node lacks: the row must be rebuilt).
pub(crate) async fn catch_up(node: &Relay, peer: PeerId) -> anyhow::Result<Option<[u8; 32]>> {
    let link = NativeLink::quiet(node.client.clone());
    let have = read(&node.state).version.clone();
    // A peer that does not answer (a liar about its version, one gone) holds up no catch-up
    // for longer than this: the next is asked.
    let plan = tokio::time::timeout(CATCH_UP_ASK, holder::plan_with(&link, &peer, &have))
        .await
        .map_err(|_| anyhow::anyhow!("{peer} did not say its version within {CATCH_UP_ASK:?}"))?;
    let (ids, theirs) = match plan? {
        (CatchUp::Nothing, _) => return Ok(None),
        (CatchUp::Rebuild, theirs) => return Ok(Some(theirs.digest())),
        (CatchUp::Replay(ids), theirs) => (ids, theirs),
    };
    for id in ids {
        // An update that arrived, or is arriving, by a notice since the plan is not fetched
        // again.
        let Some(_claim) = node.spreads.claim(id) else {
            continue;
        };
        if read(&node.state).version.contains(id) {
            continue;
        }
        let bytes = holder::fetch_update(&link, &peer, id).await?;
        node.received.inc_by(bytes.len() as u64);
        let (state, store, rules) = (node.state.clone(), node.store.clone(), node.rules.clone());
        let taken =
            tokio::task::spawn_blocking(move || apply_and_keep(&state, &store, &rules, &bytes))
                .await
                .map_err(|e| anyhow::anyhow!("{e}"))?;
        let (got, applied) = match taken {
            // Too old to be told from a replay: this node is further behind than replaying
            // may bring it, and rebuilds its row at the peer's version instead.
            Err(e)
                if e.downcast_ref::<holder::Refused>()
                    .is_some_and(|r| r.why == holder::Refusal::OutOfTurn) =>
            {
                tracing::info!("{e:#}: rebuilding instead of replaying");
                return Ok(Some(theirs.digest()));
            }
            taken => taken?,
        };
        anyhow::ensure!(
            got == id,
            "the peer's update {id:016x} hashes to {got:016x}"
        );
        if applied {
            node.tx
                .send(Internal::Applied(id))
                .await
                .map_err(|_| anyhow::anyhow!("the node stopped"))?;
        }
    }
    Ok(None)
}

/// What handing an update out did: what spreading it passed on, and how many of the group's
/// members had applied it when the leader stopped waiting.
#[derive(Debug, Clone, Copy)]
pub struct HandedOut {
    /// What the leader's notices passed on.
    pub passed: node_core::holder::Passed,
    /// Members that applied it in time.
    pub members_at: usize,
    /// Members asked (the group's members that hold a live row).
    pub members: usize,
}

/// The one publish path of every native leader: starts `sealed` spreading through `holders`
/// with the group's `members` first (pulled from `source`, the leader's own node, when it
/// keeps the update; sent with the notices without one), then waits until the members have
/// applied it ([`PUBLISH_WAIT`] plus its bytes at the slowest rate a stream is allowed).
pub async fn hand_out(
    link: &NativeLink,
    sealed: &node_core::lead::Sealed,
    members: &[PeerId],
    holders: &[PeerId],
    source: Option<PeerId>,
) -> HandedOut {
    let order = members_first(members, holders);
    let passed = node_core::lead::spread_out(link, &order, sealed, source).await;
    let members: Vec<PeerId> = (members.iter())
        .filter(|m| holders.contains(m))
        .copied()
        .collect();
    let wait = PUBLISH_WAIT + node_core::net::hop::at_min_rate(sealed.bytes.len());
    let members_at = applied_by(link, &members, sealed.id, wait).await;
    HandedOut {
        passed,
        members_at,
        members: members.len(),
    }
}

/// `holders` with `members` first (a leader's group's members hear of an update first).
fn members_first(members: &[PeerId], holders: &[PeerId]) -> Vec<PeerId> {
    let mut order: Vec<PeerId> = members
        .iter()
        .filter(|m| holders.contains(m))
        .copied()
        .collect();
    order.extend(holders.iter().filter(|h| !members.contains(h)));
    order
}

/// How many of `members` have applied update `id` within `wait` (each asked every 50 ms).
async fn applied_by(link: &NativeLink, members: &[PeerId], id: u64, wait: Duration) -> usize {
    let deadline = tokio::time::Instant::now() + wait;
    let mut left = members.to_vec();
    while !left.is_empty() && tokio::time::Instant::now() < deadline {
        let asks = left.iter().map(|m| holder::version_of(link, m));
        let versions = futures::future::join_all(asks).await;
        left = left
            .into_iter()
            .zip(versions)
            .filter(|(_, v)| v.as_ref().map_or(true, |v| !v.contains(id)))
            .map(|(m, _)| m)
            .collect();
        if !left.is_empty() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    members.len() - left.len()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

    use super::*;

    #[test]
    fn an_update_is_fetched_once_by_a_notice_or_a_catch_up() {
        let spreads = Spreads::default();
        let list = PieceList::of(7, &[1u8; 1000]);
        // A catch-up fetching it: a notice's pull does not start, nor another catch-up.
        let claim = spreads.claim(7).unwrap();
        assert!(spreads.fetching(7));
        assert!(spreads.claim(7).is_none());
        assert!(spreads.start(&list).is_none());
        assert!(spreads.is_empty(), "a catch-up is not a spread");
        drop(claim);
        assert!(!spreads.fetching(7));
        // A notice's pull of it: a catch-up skips it until the pull ends.
        let pulling = spreads.start(&list).unwrap();
        assert!(!spreads.is_empty());
        assert!(spreads.claim(7).is_none());
        assert!(spreads.start(&list).is_none());
        assert!(spreads.claim(8).is_some(), "other updates are free");
        drop(pulling);
        spreads.end(7);
        assert!(spreads.claim(7).is_some());
    }
}
