//! The row this node holds: its shard's state, coded steps on it, and the learning updates
//! applied to it (handed over by leaders or caught up from peers), with the handle a leader
//! inside the node uses for it ([`LocalRow`]).

use std::sync::{Arc, RwLock};

use anyhow::Result;
use libp2p::PeerId;
use node_core::mesh::{MeshInfo, MeshResponse, Usage};
use node_core::model::LeaderWeights;
use node_core::protocol;
use tokio::sync::oneshot;

use node_core::holder;

use crate::hold::learning::{Rules, ShardState, UpdateStore, read, write};

/// Asks the node's loop for the mesh as it sees it.
#[derive(Debug)]
pub struct InfoRequest(pub oneshot::Sender<MeshInfo>);

/// What the node's helper tasks report back to its loop.
pub(crate) enum Internal {
    /// An update was applied (and its payload saved).
    Applied(u64),
    /// A catch-up with a peer ended; with the peer and its version when this node is behind
    /// what the peer keeps and must rebuild its row at that version.
    SyncDone(Option<(PeerId, [u8; 32])>),
    /// A rebuild of the row ended: how it was obtained, or why not.
    Rebuilt(Result<String>),
    /// A fold into a new snapshot ended: how many updates it folded and how long it took, or
    /// why not.
    Folded(Result<(usize, std::time::Duration)>),
    /// A request this node led finished: count it in the usage it announces.
    Served(Usage),
    /// A leader in this node caught a member answering against the code.
    Caught {
        /// The member.
        peer: PeerId,
        /// The evidence.
        evidence: String,
    },
}

/// This node's own row as a leader inside the node uses it: its coded steps are computed and
/// its learning updates applied here, without a network hop (a libp2p node cannot send a
/// request to itself).
#[derive(Clone)]
pub struct LocalRow {
    /// The row.
    pub row: usize,
    /// The node's peer id.
    pub peer: PeerId,
    pub(crate) state: Arc<RwLock<ShardState>>,
    pub(crate) store: UpdateStore,
    pub(crate) rules: Rules,
    pub(crate) internal: tokio::sync::mpsc::Sender<Internal>,
}

impl std::fmt::Debug for LocalRow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalRow").field("row", &self.row).finish()
    }
}

impl LocalRow {
    /// Computes a coded step at `version` (an error when the shard is at another).
    pub fn step(&self, version: &[u8; 32], bytes: &[u8]) -> MeshResponse {
        step(&self.state, version, bytes)
    }

    /// Checks, keeps and applies a sealed learning update, as a peer handing it over would.
    /// Blocks: call it from a blocking thread.
    pub fn learn(&self, bytes: &[u8]) -> MeshResponse {
        learn(&self.state, &self.store, &self.rules, &self.internal, bytes)
    }

    /// The shard's version (digest) and the norm gains at it.
    pub fn norms(&self) -> ([u8; 32], LeaderWeights) {
        let s = read(&self.state);
        (s.version.digest(), s.norms.clone())
    }

    /// Remembers an update this node's own canary gate refused (`why`), so it never went out.
    pub fn refused_here(&self, verdict: &node_core::learn::Verdict, why: &str) {
        self.store.record(holder::UpdateSeen {
            id: String::new(),
            version: None,
            trainer: self.peer.to_string(),
            trainer_name: String::new(),
            gate: Some(verdict.claim()),
            applied: false,
            why: Some(format!("this node's canary gate: {why}")),
            bytes: 0,
            issued_ms: 0,
            seen_ms: holder::wall_ms(),
        });
    }

    /// Counts a finished request in the usage this node announces.
    pub async fn served(&self, usage: Usage) {
        let _ = self.internal.send(Internal::Served(usage)).await;
    }

    /// Records a member caught answering against the code, as a peer's report would.
    pub async fn caught(&self, peer: PeerId, evidence: String) {
        let _ = self
            .internal
            .send(Internal::Caught { peer, evidence })
            .await;
    }
}

/// Saves and applies an update a leader hands over.
pub(crate) fn learn(
    state: &RwLock<ShardState>,
    store: &UpdateStore,
    rules: &Rules,
    tx: &tokio::sync::mpsc::Sender<Internal>,
    bytes: &[u8],
) -> MeshResponse {
    let applied = apply_and_keep(state, store, rules, bytes)
        .map(|(id, applied)| {
            if applied {
                let _ = tx.blocking_send(Internal::Applied(id));
            }
            id
        })
        .map_err(|e| format!("{e:#}"));
    holder::receipt(applied, &read(state).version)
}

/// Validates, saves the payload, then applies: `(id, applied now)`.
pub(crate) fn apply_and_keep(
    state: &RwLock<ShardState>,
    store: &UpdateStore,
    rules: &Rules,
    bytes: &[u8],
) -> Result<(u64, bool)> {
    let now = node_core::holder::wall_ms();
    let checked = rules.check(bytes, Some(now)).inspect_err(|refused| {
        store.record(holder::UpdateSeen::refused(bytes, refused, now));
    })?;
    let id = checked.id;
    tracing::debug!(
        id = format!("{id:016x}"),
        signer = %checked.signer,
        trainer = checked.trainer,
        "an admitted trainer's update"
    );
    if read(state).version.contains(id) {
        return Ok((id, false));
    }
    let mut seen = holder::UpdateSeen::checked(&checked, bytes.len(), now);
    let applied = store
        .make_room(state, bytes.len())
        .and_then(|()| store.save(id, bytes))
        .and_then(|()| Ok(write(state).apply(&checked.update, id)?));
    match &applied {
        Ok(true) => seen.version = Some(read(state).version.count()),
        // Another thread applied it meanwhile: that one records it.
        Ok(false) => return Ok((id, false)),
        Err(e) => {
            seen.applied = false;
            seen.why = Some(format!("not applied here: {e:#}"));
        }
    }
    store.record(seen);
    Ok((id, applied?))
}

/// Computes a coded step at the leader's version; the answer carries the compute time.
pub(crate) fn step(state: &RwLock<ShardState>, version: &[u8; 32], bytes: &[u8]) -> MeshResponse {
    match protocol::decode(bytes) {
        Ok(request) => holder::step(&read(state), version, &request),
        Err(e) => MeshResponse::Error(format!("a step request: {e}")),
    }
}
