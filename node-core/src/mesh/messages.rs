//! Messages between nodes: gossiped heartbeats and the request-response protocol.
//! All go through [`crate::protocol::encode`]/[`crate::protocol::decode`] (versioned, bounded).

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use super::Health;

/// Gossipsub topic of heartbeats (the protocol version is part of it).
pub const HEARTBEAT_TOPIC: &str = "codedmesh/heartbeat/2";

/// Bytes of a shard blob sent per chunk request.
pub const CHUNK_BYTES: u32 = 4 << 20;

/// Largest chunk a node serves or accepts.
pub const MAX_CHUNK_BYTES: u32 = 16 << 20;

/// What a node announces about itself every heartbeat interval.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Heartbeat {
    /// Digest of the model manifest it serves.
    pub model: [u8; 32],
    /// The row (generator node index) whose shard it holds, if any.
    pub row: Option<u32>,
    /// Number of updates applied to its shard.
    pub version_count: u64,
    /// Digest of the applied update set.
    pub version_digest: [u8; 32],
    /// Addresses it listens on, as multiaddr strings.
    #[serde(deserialize_with = "crate::protocol::bounded::addrs")]
    pub addrs: Vec<String>,
    /// Rows it can hand out from genesis.
    #[serde(deserialize_with = "crate::protocol::bounded::numbers")]
    pub offers: Vec<u32>,
    /// Chosen anew each time the node starts, so a restart is not mistaken for old news.
    pub incarnation: u64,
    /// Increases with every heartbeat it sends within one incarnation.
    pub seq: u64,
    /// Milliseconds since this incarnation started, when it was sent: a receiver tells a
    /// heartbeat that gossip delivers late from a fresh one.
    pub uptime_ms: u64,
    /// Where it computes: "cpu", or the GPU adapter's name and API.
    pub device: String,
    /// The requests leaders reported to it since it started.
    pub usage: Usage,
    /// How peers reach it (AutoNAT, relays, hole punching), as it finds out.
    pub reach: Reach,
    /// It trains the mesh: it serves an API, learns, and the mesh's key admits it to write.
    /// A node that may not write hands the text its users send to such a node.
    pub trains: bool,
    /// Where it is in the latency space, from the round trips it measured (checked on
    /// arrival: [`super::Coord::check`]).
    pub coord: super::Coord,
}

#[cfg(test)]
impl Heartbeat {
    /// A test's heartbeat of a node holding `row` of model `[7; 32]` at the genesis version.
    pub(crate) fn for_test(row: Option<u32>) -> Self {
        Self {
            model: [7; 32],
            row,
            version_count: 0,
            version_digest: [0; 32],
            addrs: vec![],
            offers: vec![],
            incarnation: 1,
            seq: 0,
            uptime_ms: 0,
            device: "cpu".into(),
            usage: Usage::default(),
            reach: Default::default(),
            trains: false,
            coord: Default::default(),
        }
    }
}

/// Requests finished on the mesh, as their leaders report them to a node: what the
/// dashboards chart as tokens/s, latency and loss.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Requests.
    pub requests: u64,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Generated tokens.
    pub tokens: u64,
    /// Latencies from a request's start to its last token, summed, in milliseconds.
    pub latency_ms: u64,
    /// Requests the mesh trained on.
    pub trained: u64,
    /// Their next-token losses before the update, summed, in millionths.
    pub loss_micro: u64,
    /// Updates the canary gate judged.
    pub gated: u64,
    /// Of those, the ones it refused.
    pub refused: u64,
    /// The mesh's canary loss as of each judged update (after it when published, before it
    /// when refused), summed, in millionths.
    pub canary_micro: u64,
}

impl Usage {
    /// One request: its tokens, its latency and, if it trained, its loss.
    pub fn of_request(
        prompt_tokens: usize,
        tokens: usize,
        latency: web_time::Duration,
        loss: Option<f64>,
    ) -> Self {
        Self {
            requests: 1,
            prompt_tokens: prompt_tokens as u64,
            tokens: tokens as u64,
            latency_ms: latency.as_millis().min(u64::MAX as u128) as u64,
            trained: u64::from(loss.is_some()),
            loss_micro: loss.map_or(0, micro),
            ..Self::default()
        }
    }

    /// One update the canary gate judged: the mesh's canary loss as of it, and whether it
    /// refused it.
    pub fn of_gate(canary: f64, refused: bool) -> Self {
        Self {
            gated: 1,
            refused: u64::from(refused),
            canary_micro: micro(canary),
            ..Self::default()
        }
    }

    /// Both counts added (saturating: a peer's numbers cannot overflow ours).
    pub fn add(&mut self, o: &Usage) {
        self.requests = self.requests.saturating_add(o.requests);
        self.prompt_tokens = self.prompt_tokens.saturating_add(o.prompt_tokens);
        self.tokens = self.tokens.saturating_add(o.tokens);
        self.latency_ms = self.latency_ms.saturating_add(o.latency_ms);
        self.trained = self.trained.saturating_add(o.trained);
        self.loss_micro = self.loss_micro.saturating_add(o.loss_micro);
        self.gated = self.gated.saturating_add(o.gated);
        self.refused = self.refused.saturating_add(o.refused);
        self.canary_micro = self.canary_micro.saturating_add(o.canary_micro);
    }
}

/// A loss in millionths (negative and non-finite ones as 0).
fn micro(loss: f64) -> u64 {
    if loss.is_finite() {
        (loss.max(0.0) * 1e6).min(u64::MAX as f64) as u64
    } else {
        0
    }
}

/// How peers reach a node, as the node itself finds out (carried in its heartbeats).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reach {
    /// Not known yet (or a node on this machine only, on loopback).
    #[default]
    Unknown,
    /// Peers dial it: AutoNAT confirmed one of its addresses.
    Public,
    /// Behind NAT, with at least one connection made direct by hole punching.
    Punched,
    /// Behind NAT, reached through a relay.
    Relayed,
    /// Behind NAT, with no relay reservation yet.
    Private,
}

impl Reach {
    /// Its name in status output and on the dashboard.
    pub fn label(self) -> &'static str {
        match self {
            Self::Unknown => "unknown",
            Self::Public => "public",
            Self::Punched => "direct after hole punching",
            Self::Relayed => "relayed",
            Self::Private => "behind NAT, no relay yet",
        }
    }
}

/// One node as another node sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeStatus {
    /// Its peer id.
    pub peer: String,
    /// Its row, if it holds one.
    pub row: Option<u32>,
    /// Its health.
    pub health: Health,
    /// Updates applied to its shard.
    pub version_count: u64,
    /// Digest of its update set (hex).
    pub version_digest: String,
    /// Its listen addresses.
    #[serde(deserialize_with = "crate::protocol::bounded::addrs")]
    pub addrs: Vec<String>,
    /// Seconds since it was last heard from.
    pub silent_for_s: f64,
    /// Updates it lacks compared with the mesh version (0 when it is at that version).
    pub lag: u64,
    /// Last verification result: the evidence when a leader caught it answering against the
    /// code (it is then left out of groups and its row is free to re-create), else `None`.
    #[serde(default)]
    pub caught: Option<String>,
    /// Where it computes: "cpu", or the GPU adapter's name and API.
    #[serde(default)]
    pub device: String,
    /// The requests leaders reported to it since it started.
    #[serde(default)]
    pub usage: Usage,
    /// How peers reach it, as it reports: "public", "direct after hole punching", "relayed"…
    #[serde(default)]
    pub reach: String,
    /// It trains the mesh (text to teach may go to it).
    #[serde(default)]
    pub trains: bool,
    /// Where it is in the latency space, as it announces.
    #[serde(default)]
    pub coord: super::Coord,
    /// The answering node's round trip to it in milliseconds, measured or estimated from the
    /// coordinates (`None`: not known yet).
    #[serde(default)]
    pub rtt_ms: Option<f32>,
}

/// Every live holder of each row, by row.
pub type HoldersByRow<'a> = std::collections::BTreeMap<usize, Vec<&'a NodeStatus>>;

/// One row of the code and the nodes that hold it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RowHolders {
    /// The row.
    pub row: u32,
    /// Peer ids of every known holder, whatever its health.
    #[serde(deserialize_with = "crate::protocol::bounded::names")]
    pub holders: Vec<String>,
    /// Holders that are healthy and not caught.
    pub healthy: u32,
}

impl RowHolders {
    /// A row nobody is known to hold.
    pub fn new(row: u32) -> Self {
        Self {
            row,
            holders: Vec::new(),
            healthy: 0,
        }
    }
}

/// The mesh as one node sees it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MeshInfo {
    /// Shards needed to compute.
    pub k: u32,
    /// Rows that exist: the genesis rows and every row a node holds.
    pub n: u32,
    /// Rows the code has room for: the mesh adds rows up to this, then replicas.
    #[serde(default)]
    pub n_max: u32,
    /// Every row with its holders, by row.
    #[serde(default)]
    pub rows: Vec<RowHolders>,
    /// The answering node's health timing: a browser that joins heartbeats at this pace,
    /// so the mesh does not see it fall silent between two heartbeats.
    #[serde(default)]
    pub health: super::HealthConfig,
    /// Digest of the model manifest (hex).
    pub model: String,
    /// A person-readable model name.
    pub model_name: String,
    /// Whether k healthy rows at one version can be grouped now.
    pub available: bool,
    /// Distinct healthy rows at the version most rows hold.
    pub healthy_rows: u32,
    /// Healthy rows that can still fail before the model is unavailable.
    pub tolerates: u32,
    /// Updates applied at the mesh version (the one most healthy rows hold).
    pub version_count: u64,
    /// Digest of the mesh version (hex).
    pub version_digest: String,
    /// Every node known, the answering node included.
    pub nodes: Vec<NodeStatus>,
    /// The answering node's dashboard URL, when it serves HTTP.
    #[serde(default)]
    pub dashboard: Option<String>,
    /// Every node's reported requests, summed.
    #[serde(default)]
    pub usage: Usage,
}

/// What a page needs to dial the native node that served it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BrowserBootstrap {
    /// The node's peer id.
    pub peer: String,
    /// Its addresses a browser can dial (WebSocket, WebRTC-direct), each ending in `/p2p/<peer>`.
    #[serde(deserialize_with = "crate::protocol::bounded::addrs")]
    pub addrs: Vec<String>,
}

impl BrowserBootstrap {
    /// Keeps the addresses of `addrs` a browser can dial, best first: WebSocket (it connects
    /// reliably), then WebRTC-direct.
    pub fn from_addrs(peer: String, addrs: &[String]) -> Self {
        let rank = |a: &str| {
            if a.contains("/ws/") || a.ends_with("/ws") {
                Some(0)
            } else if a.contains("/webrtc-direct/") {
                Some(1)
            } else {
                None
            }
        };
        let mut keep: Vec<(u8, String)> = addrs
            .iter()
            .filter_map(|a| rank(a).map(|r| (r, a.clone())))
            .collect();
        keep.sort();
        Self {
            peer,
            addrs: keep.into_iter().map(|(_, a)| a).collect(),
        }
    }

    /// The same addresses with WebRTC-direct ones first (the others stay as fallbacks).
    pub fn webrtc_first(mut self) -> Self {
        self.addrs.sort_by_key(|a| !a.contains("/webrtc-direct/"));
        self
    }
}

/// Rows a leader can group: those whose holders answered [`MeshRequest::Norms`] at `version`,
/// and the first of their gains that fit `cfg`. Rows that failed, answered at another
/// version or with something else are left out, and logged.
pub fn rows_at_version<P, E: std::fmt::Display>(
    answers: impl IntoIterator<Item = (usize, P, Result<MeshResponse, E>)>,
    version: [u8; 32],
    cfg: &crate::model::LlamaConfig,
) -> (
    std::collections::BTreeMap<usize, P>,
    Option<crate::model::LeaderWeights>,
) {
    let mut rows = std::collections::BTreeMap::new();
    let mut norms = None;
    for (row, peer, answer) in answers {
        match answer {
            Ok(MeshResponse::Norms {
                version: v,
                norms: n,
            }) if v == version => {
                if n.fits(cfg) {
                    norms.get_or_insert(n);
                }
                rows.insert(row, peer);
            }
            Ok(MeshResponse::Norms { .. }) => {
                tracing::info!(row, "left out: its shard is at another version")
            }
            Ok(_) => tracing::warn!(
                row,
                "left out: it answered the norm gains with something else"
            ),
            Err(e) => tracing::warn!(row, "left out: {e}"),
        }
    }
    (rows, norms)
}

/// A holder a leader may compute with: healthy, holding a row, not caught.
fn usable(n: &NodeStatus) -> bool {
    n.health == Health::Healthy && n.row.is_some() && n.caught.is_none()
}

impl MeshInfo {
    /// The version the most healthy rows share (then the most holders, then the most
    /// updates), and every healthy, uncaught holder at it, by row (each row's holders in the
    /// order the nodes are listed).
    pub fn live_holders(&self) -> Option<([u8; 32], HoldersByRow<'_>)> {
        let mut by_version: std::collections::BTreeMap<&str, (BTreeSet<u32>, usize, u64)> =
            Default::default();
        for n in self.nodes.iter().filter(|n| usable(n)) {
            let e = by_version.entry(&n.version_digest).or_default();
            e.0.extend(n.row);
            e.1 += 1;
            e.2 = e.2.max(n.version_count);
        }
        let (version, _) = by_version
            .into_iter()
            .max_by_key(|(_, (rows, holders, count))| (rows.len(), *holders, *count))?;
        let digest = super::unhex32(version)?;
        let mut rows: std::collections::BTreeMap<usize, Vec<&NodeStatus>> = Default::default();
        for n in self
            .nodes
            .iter()
            .filter(|n| usable(n))
            .filter(|n| n.version_digest == version)
        {
            if let Some(row) = n.row {
                rows.entry(row as usize).or_default().push(n);
            }
        }
        Some((digest, rows))
    }

    /// Rows with a healthy, uncaught holder at any version: more than a version's own rows
    /// while an update spreads or a holder catches up.
    pub fn healthy_row_count(&self) -> usize {
        self.nodes
            .iter()
            .filter(|n| usable(n))
            .filter_map(|n| n.row)
            .collect::<BTreeSet<u32>>()
            .len()
    }

    /// The version most healthy holders share, and one healthy holder of each row at it.
    pub fn live_rows(&self) -> Option<([u8; 32], std::collections::BTreeMap<usize, &NodeStatus>)> {
        let (version, rows) = self.live_holders()?;
        let rows = rows
            .into_iter()
            .filter_map(|(row, holders)| Some((row, *holders.first()?)))
            .collect();
        Some((version, rows))
    }

    /// The one-line summary a person reads at a glance.
    pub fn summary(&self) -> String {
        format!(
            "model available: {} — {} of {} rows healthy, k = {}, tolerates {} more failure{}; version {} ({} updates); {} holders, room for {} rows",
            if self.available { "yes" } else { "no" },
            self.healthy_rows,
            self.n,
            self.k,
            self.tolerates,
            if self.tolerates == 1 { "" } else { "s" },
            &self.version_digest[..self.version_digest.len().min(16)],
            self.version_count,
            self.rows.iter().map(|r| r.holders.len()).sum::<usize>(),
            self.n_max.max(self.n)
        )
    }
}

/// Some rows of one matrix of a row's shard set, in every sub-block: what one request of chain
/// encoding ([`crate::chain`]) builds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Piece {
    /// The matrix, in [`crate::coded::shapes`]'s order.
    pub matrix: u32,
    /// First row within each sub-block.
    pub first: u32,
    /// Rows within each sub-block.
    pub rows: u32,
}

/// A request for one piece's running sum up to and including position `at` of the chain.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChainPart {
    /// The row being built.
    pub target: u32,
    /// The k source rows in chain order, with a holder of each.
    pub chain: Vec<SourceRow>,
    /// The answering holder's position in the chain.
    pub at: u32,
    /// The shard version every source must be at (digest).
    pub version: [u8; 32],
    /// The piece.
    pub piece: Piece,
}

/// Where a joining node gets one existing row's shard.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceRow {
    /// The row.
    pub row: u32,
    /// Its holder's peer id.
    pub peer: String,
    /// Its holder's addresses.
    #[serde(deserialize_with = "crate::protocol::bounded::addrs")]
    pub addrs: Vec<String>,
}

/// The answer to a join request: which row to take and where its shard comes from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum JoinOffer {
    /// Take this row: its genesis shard is fetched from the answering node.
    Genesis {
        /// The row.
        row: u32,
    },
    /// Take this row: these k holders build it along a chain ([`crate::chain`]).
    Reencode {
        /// The row.
        row: u32,
        /// k source rows, in chain order.
        sources: Vec<SourceRow>,
    },
    /// No row can be offered now (fewer than k live rows to build one from).
    Full,
    /// Every row is held by a live node: take this row as one more holder, downloading its
    /// shard from one of these holders (at the mesh version).
    Replica {
        /// The row.
        row: u32,
        /// Its live holders, to download from.
        holders: Vec<SourceRow>,
    },
}

/// A notice of a learning update spreading ([`crate::holder::spread`]): what a holder pulls, from whom, and whom it tells next.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Notice {
    /// The signed [`crate::holder::PieceList`].
    #[serde(with = "serde_bytes")]
    pub list: Vec<u8>,
    /// Peers to pull pieces from, nearest first (the last is the nearest to the leader).
    #[serde(deserialize_with = "crate::protocol::bounded::names")]
    pub sources: Vec<String>,
    /// Holders the receiver passes the notice on to.
    #[serde(deserialize_with = "crate::protocol::bounded::names")]
    pub to: Vec<String>,
    /// The whole signed update, from a leader that serves no pieces.
    #[serde(with = "serde_bytes")]
    pub inline: Option<Vec<u8>>,
}

/// A request on the mesh protocol.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum MeshRequest {
    /// The answering node's view of the mesh.
    Info,
    /// The model manifest.
    Manifest,
    /// A row for the asking node.
    Join,
    /// A piece of a row's shard blob.
    Chunk {
        /// The row.
        row: u32,
        /// First byte.
        offset: u64,
        /// Bytes wanted (at most [`MAX_CHUNK_BYTES`]).
        len: u32,
    },
    /// A coded step: an encoded [`crate::protocol::StepRequest`], for shards at `version`.
    Step {
        /// Digest of the shard version the leader's group decodes at.
        version: [u8; 32],
        /// The encoded step.
        #[serde(with = "serde_bytes")]
        bytes: Vec<u8>,
    },
    /// The answering node's version: its snapshot's folded updates and the ids kept since.
    Versions,
    /// A piece of an update's payload (an encoded [`crate::learn::Update`]).
    UpdateChunk {
        /// The update.
        id: u64,
        /// First byte.
        offset: u64,
        /// Bytes wanted (at most [`MAX_CHUNK_BYTES`]).
        len: u32,
    },
    /// A leader hands over a learning update (an encoded [`crate::learn::Update`]).
    Learn(Vec<u8>),
    /// The replicated norm gains at the answering node's version.
    Norms,
    /// A leader caught a holder answering against the code: the report, signed by the leader
    /// ([`crate::holder::sign_report`]; acted on only when the mesh admits it to report).
    Report {
        /// The signed report.
        #[serde(with = "serde_bytes")]
        report: Vec<u8>,
        /// Holders the receiver passes the report on to ([`crate::holder::tell`]).
        #[serde(deserialize_with = "crate::protocol::bounded::names")]
        to: Vec<String>,
    },
    /// A leader finished a request: the node adds it to the usage it announces.
    Served(Usage),
    /// A piece of a row being built along a chain of holders ([`crate::chain`]).
    Chain(ChainPart),
    /// A learning update is spreading: pull it and pass the notice on
    /// ([`crate::holder::spread`]).
    Spread(Notice),
    /// A leader the mesh does not admit to write hands a trainer text its user sent (token
    /// ids): the trainer trains on it under its own budget and gate.
    Teach(#[serde(deserialize_with = "crate::protocol::bounded::numbers")] Vec<u32>),
    /// A row for the asking node, which measured round trips to some nodes of the mesh: it is
    /// offered one its region lacks ([`super::MeshView::offer_row_near`]).
    JoinNear {
        /// The nodes measured (peer ids).
        #[serde(deserialize_with = "crate::protocol::bounded::addrs")]
        peers: Vec<String>,
        /// The round trip to each, in microseconds, in the same order.
        #[serde(deserialize_with = "crate::protocol::bounded::numbers")]
        rtt_us: Vec<u32>,
    },
}

/// An answer on the mesh protocol.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum MeshResponse {
    /// The mesh view.
    Info(MeshInfo),
    /// The manifest, serialized.
    Manifest(#[serde(with = "serde_bytes")] Vec<u8>),
    /// A row offer.
    Join(JoinOffer),
    /// A piece of a shard blob (or of an update's payload).
    Chunk {
        /// Length of the whole blob.
        total: u64,
        /// Digest of the shard version the blob holds (zero for update payloads).
        version: [u8; 32],
        /// The bytes.
        #[serde(with = "serde_bytes")]
        bytes: Vec<u8>,
    },
    /// An encoded [`crate::protocol::StepResponse`] and how long computing it took.
    Step {
        /// The encoded answer.
        #[serde(with = "serde_bytes")]
        bytes: Vec<u8>,
        /// Microseconds the member spent computing.
        compute_us: u64,
    },
    /// The node's version: the updates folded into its snapshot and those kept since.
    Versions(crate::mesh::ShardVersion),
    /// A learning update was taken: its id and the node's version count after it.
    Learned {
        /// The update's id.
        id: u64,
        /// Updates the node has applied now.
        version_count: u64,
    },
    /// The norm gains at a version.
    Norms {
        /// Digest of the version they belong to.
        version: [u8; 32],
        /// The gains.
        norms: crate::model::LeaderWeights,
    },
    /// A report was taken.
    Reported,
    /// A notice of an update was taken: the node pulls it and passes the notice on.
    Spreading {
        /// The update's id.
        id: u64,
    },
    /// The request could not be served.
    Error(String),
    /// A chained piece's running sum, as f32 values ([`crate::chain`]).
    Partial(Vec<f32>),
    /// A step asked at a version this node is not at: the mesh moved on, or this node lags.
    Stale {
        /// The version this node is at.
        have: [u8; 32],
        /// Updates it has applied.
        updates: u64,
        /// The version the step asked for.
        want: [u8; 32],
    },
    /// A compact chain's running sum of a piece ([`crate::chain`]).
    IntPartial(IntSum),
    /// A finished piece of a compact row, from the last source of its chain.
    CompactPiece(CompactPiece),
    /// Text to teach was taken: the trainer trains on it with its next minibatch.
    Taught,
}

/// A compact chain's running sum of one piece: `Σ a_j·q_j` over the sources so far, where
/// `a_j / d` are the integer code's re-encoding coefficients, and the sum of their adapters.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IntSum {
    /// The integer sums, row-major.
    pub q: Vec<i32>,
    /// The adapters' sum, `rows × rank` row-major; empty while no source has learnt.
    #[serde(with = "crate::protocol::f32_bytes")]
    pub adapter: Vec<f32>,
}

/// A finished piece of a compact row: its coded integers as the row stores them, the scales
/// of its rows and its adapter rows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompactPiece {
    /// The coded integers, row-major.
    pub q: crate::coded::CodedInts,
    /// One scale per 32 values of each row.
    pub scales: Vec<half::f16>,
    /// The adapter's rows, `rows × rank` row-major; empty when the row has not learnt.
    #[serde(with = "crate::protocol::f32_bytes")]
    pub adapter: Vec<f32>,
}

/// Why a member gave no answer to a coded step.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StepRefusal {
    /// The member is at another version than the step asked for.
    #[error(
        "shard version mismatch: this node is at {} ({updates} updates), the request expects {}",
        super::hex(&have[..8]),
        super::hex(&want[..8])
    )]
    Stale {
        /// The version the member is at.
        have: [u8; 32],
        /// Updates it has applied.
        updates: u64,
        /// The version the step asked for.
        want: [u8; 32],
    },
    /// Any other reason (the member's words, or the link's).
    #[error("{0}")]
    Failed(String),
}

impl From<String> for StepRefusal {
    fn from(why: String) -> Self {
        StepRefusal::Failed(why)
    }
}

impl MeshResponse {
    /// A coded step's answer and the member's compute time in µs, or why it gave none.
    pub fn into_step(self) -> Result<(Vec<u8>, u64), StepRefusal> {
        match self {
            MeshResponse::Step { bytes, compute_us } => Ok((bytes, compute_us)),
            MeshResponse::Stale {
                have,
                updates,
                want,
            } => Err(StepRefusal::Stale {
                have,
                updates,
                want,
            }),
            MeshResponse::Error(e) => Err(StepRefusal::Failed(e)),
            _ => Err(StepRefusal::Failed(
                "answered a step with something else".into(),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{decode, encode};
    use proptest::prelude::*;

    #[test]
    fn a_refusal_at_another_version_keeps_its_type_through_the_wire() {
        let stale = MeshResponse::Stale {
            have: [0xab; 32],
            updates: 3,
            want: [0xcd; 32],
        };
        let back: MeshResponse = decode(&encode(&stale).unwrap()).unwrap();
        let refusal = back.into_step().unwrap_err();
        assert_eq!(
            refusal,
            StepRefusal::Stale {
                have: [0xab; 32],
                updates: 3,
                want: [0xcd; 32]
            }
        );
        assert_eq!(
            refusal.to_string(),
            "shard version mismatch: this node is at abababababababab (3 updates), the request expects cdcdcdcdcdcdcdcd"
        );
        assert_eq!(
            MeshResponse::Error("busy".into()).into_step().unwrap_err(),
            StepRefusal::Failed("busy".into())
        );
    }

    #[test]
    fn a_browser_gets_websocket_then_webrtc_addresses_only() {
        let p = "/p2p/12D3KooWEtyUq8sdqhwmBW54jBQPPUQLqtrFcby7Zbj2unjEijzU";
        let addrs = [
            format!("/ip4/127.0.0.1/tcp/4001{p}"),
            format!("/ip4/127.0.0.1/udp/4002/webrtc-direct/certhash/uEiB{p}"),
            format!("/ip4/127.0.0.1/udp/4003/quic-v1{p}"),
            format!("/ip4/127.0.0.1/tcp/4004/ws{p}"),
        ];
        let b = BrowserBootstrap::from_addrs("peer".into(), &addrs);
        assert_eq!(b.addrs, [addrs[3].clone(), addrs[1].clone()]);
        assert_eq!(
            b.webrtc_first().addrs,
            [addrs[1].clone(), addrs[3].clone()],
            "asked for, WebRTC-direct comes first and WebSocket stays the fallback"
        );
    }

    #[test]
    fn live_rows_keep_the_majority_version_and_drop_the_caught() {
        let node = |peer: &str, row: u32, health: Health, digest: u8, caught: bool| NodeStatus {
            peer: peer.into(),
            row: Some(row),
            health,
            version_count: 0,
            version_digest: crate::mesh::hex(&[digest; 32]),
            addrs: Vec::new(),
            silent_for_s: 0.0,
            lag: 0,
            caught: caught.then(|| "answered against the code".into()),
            device: "cpu".into(),
            usage: Usage::default(),
            reach: String::new(),
            trains: false,
            coord: Default::default(),
            rtt_ms: None,
        };
        let mut info = MeshInfo {
            k: 2,
            n: 5,
            n_max: 5,
            rows: Vec::new(),
            health: Default::default(),
            model: String::new(),
            model_name: String::new(),
            available: true,
            healthy_rows: 3,
            tolerates: 1,
            version_count: 0,
            version_digest: String::new(),
            nodes: vec![
                node("a", 0, Health::Healthy, 1, false),
                node("b", 1, Health::Healthy, 1, false),
                node("c", 2, Health::Healthy, 2, false),
                node("d", 3, Health::Dead, 1, false),
                node("e", 4, Health::Healthy, 1, true),
                node("f", 1, Health::Healthy, 1, false),
            ],
            dashboard: None,
            usage: Usage::default(),
        };
        let (digest, rows) = info.live_rows().expect("rows at version 1");
        assert_eq!(digest, [1; 32]);
        let peers: Vec<(usize, &str)> = rows.iter().map(|(&r, n)| (r, n.peer.as_str())).collect();
        assert_eq!(peers, [(0, "a"), (1, "b")]);
        info.nodes.iter_mut().for_each(|n| n.health = Health::Dead);
        assert!(info.live_rows().is_none());
    }

    #[test]
    fn digests_round_trip_through_hex() {
        let d: [u8; 32] = std::array::from_fn(|i| (i * 37 + 5) as u8);
        assert_eq!(crate::mesh::unhex32(&crate::mesh::hex(&d)), Some(d));
        assert_eq!(crate::mesh::unhex32("ab"), None);
        assert_eq!(crate::mesh::unhex32(&"zz".repeat(32)), None);
    }

    #[test]
    fn requests_round_trip() {
        for req in [
            MeshRequest::Info,
            MeshRequest::Join,
            MeshRequest::Chunk {
                row: 3,
                offset: 1 << 33,
                len: CHUNK_BYTES,
            },
            MeshRequest::Step {
                version: [4; 32],
                bytes: vec![1, 2, 3],
            },
            MeshRequest::UpdateChunk {
                id: 9,
                offset: 0,
                len: CHUNK_BYTES,
            },
        ] {
            assert_eq!(decode::<MeshRequest>(&encode(&req).unwrap()).unwrap(), req);
        }
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode::<MeshRequest>(&bytes);
            let _ = decode::<MeshResponse>(&bytes);
            let _ = decode::<Heartbeat>(&bytes);
        }
    }
}
