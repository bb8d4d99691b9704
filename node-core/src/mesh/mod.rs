//! The mesh, sans I/O: heartbeats and health, who holds which row, joining, and the leader's
//! rounds over a group with spares. Every state machine here takes the current time and the
//! messages it got, and hands back what to send; the shells own sockets and clocks.

pub mod coords;
mod health;
mod manifest;
mod messages;
pub mod regions;
mod round;
pub mod rounds;
mod version;
mod view;

pub use crate::learn::{
    DEFAULT_ADAM_LR, DEFAULT_RANK, DEFAULT_SGD_LR, LearningConfig, MAX_ACCUMULATE, Optimizer,
};
pub use coords::{Coord, Vivaldi};
pub use health::{Health, HealthConfig};
pub use manifest::ModelManifest;
pub use messages::{
    BrowserBootstrap, CHUNK_BYTES, ChainPart, CompactPiece, HEARTBEAT_TOPIC, Heartbeat,
    HoldersByRow, IntSum, JoinOffer, MAX_CHUNK_BYTES, MeshInfo, MeshRequest, MeshResponse,
    NodeStatus, Notice, Piece, Reach, RowHolders, SourceRow, StepRefusal, Usage, rows_at_version,
};
pub use regions::{NEAR_MS, Region};
pub use round::{
    GroupPlan, MUCH_CLOSER, MUCH_CLOSER_MS, MemberPool, NEAR_ALIKE_MS, NEAR_MAX_CONDITION,
    RoundConfig, RoundDriver, RoundError, much_closer, pick_holders, pick_nearest, plan_group,
    plan_group_near,
};
pub use version::{
    CatchUp, FOLD_SHARE, Folded, KEEP_SHARE, LAG_KEEP_SHARE, LAG_KEEP_UPDATES, MAX_KEPT, MAX_SINCE,
    RECENT_FOLDED, SetHash, ShardVersion, VersionError, plan_catch_up,
};
pub use view::{MeshEvent, MeshView};

/// Errors of the mesh state machines.
#[derive(Debug, thiserror::Error)]
pub enum MeshError {
    /// A configuration value is out of range.
    #[error("mesh config: {0}")]
    Config(String),
    /// A peer serves another model or code.
    #[error("peer {peer} serves model {theirs}, this mesh serves {ours}")]
    OtherModel {
        /// The peer.
        peer: String,
        /// Our model digest (hex).
        ours: String,
        /// Theirs.
        theirs: String,
    },
    /// A message field is out of range.
    #[error("bad message from {peer}: {reason}")]
    BadMessage {
        /// The peer.
        peer: String,
        /// What was wrong.
        reason: String,
    },
}

/// Lower-case hex of bytes.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Parses 64 hex digits (as [`hex`] writes a digest) back into 32 bytes.
pub fn unhex32(s: &str) -> Option<[u8; 32]> {
    let s = s.as_bytes();
    if s.len() != 64 {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16);
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = (digit(s[2 * i])? * 16 + digit(s[2 * i + 1])?) as u8;
    }
    Some(out)
}
