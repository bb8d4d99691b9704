//! The row this node holds: its shard's state, coded steps on it, and the learning updates
//! applied to it (handed over by leaders or caught up from peers), with the handle a leader
//! inside the node uses for it ([`LocalRow`]).

use std::sync::{Arc, RwLock};

use anyhow::{Result, anyhow, ensure};
use libp2p::PeerId;
use node_core::mesh::{CatchUp, MeshInfo, MeshResponse, Usage};
use node_core::model::LeaderWeights;
use node_core::protocol;
use tokio::sync::oneshot;

use node_core::holder;

use crate::hold::learning::{Rules, ShardState, UpdateStore, read, write};
use crate::hold::link::NativeLink;

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
fn apply_and_keep(
    state: &RwLock<ShardState>,
    store: &UpdateStore,
    rules: &Rules,
    bytes: &[u8],
) -> Result<(u64, bool)> {
    let checked = rules.check(bytes)?;
    let id = checked.id;
    tracing::debug!(id = format!("{id:016x}"), signer = %checked.signer, "a signed update");
    let update = checked.update;
    if read(state).version.contains(id) {
        return Ok((id, false));
    }
    store.make_room(state, bytes.len())?;
    store.save(id, bytes)?;
    let applied = write(state).apply(&update, id)?;
    Ok((id, applied))
}

/// Fetches and applies every update `peer` keeps that this node lacks, but those a notice's
/// pull already brings; the peer's version when those would not bring this node up to it (the
/// peer folded updates this node lacks: the row must be rebuilt).
pub(crate) async fn catch_up(
    node: &crate::hold::spread::Relay,
    peer: PeerId,
) -> Result<Option<[u8; 32]>> {
    let link = NativeLink::quiet(node.client.clone());
    let have = read(&node.state).version.clone();
    let ids = match holder::plan_with(&link, &peer, &have).await? {
        (CatchUp::Nothing, _) => return Ok(None),
        (CatchUp::Rebuild, theirs) => return Ok(Some(theirs.digest())),
        (CatchUp::Replay(ids), _) => ids,
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
        let (got, applied) =
            tokio::task::spawn_blocking(move || apply_and_keep(&state, &store, &rules, &bytes))
                .await
                .map_err(|e| anyhow!("{e}"))??;
        ensure!(
            got == id,
            "the peer's update {id:016x} hashes to {got:016x}"
        );
        if applied {
            node.tx
                .send(Internal::Applied(id))
                .await
                .map_err(|_| anyhow!("the node stopped"))?;
        }
    }
    Ok(None)
}

/// Computes a coded step at the leader's version; the answer carries the compute time.
pub(crate) fn step(state: &RwLock<ShardState>, version: &[u8; 32], bytes: &[u8]) -> MeshResponse {
    match protocol::decode(bytes) {
        Ok(request) => holder::step(&read(state), version, &request),
        Err(e) => MeshResponse::Error(format!("a step request: {e}")),
    }
}
