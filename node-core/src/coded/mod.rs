//! Coded execution: members hold coded shards of every linear layer and answer step requests;
//! the leader sends each stage to its group, decodes, and hands the result to the model.
//!
//! Layout of a member's answer: for a stage with matrices `M_0 … M_q` and `t` inputs, the
//! values are ordered `[sub-block s][matrix][token][local row]`, so that for the decoder each
//! sub-block is one contiguous run of `C = Σ t·L_matrix` values. An embedding lookup answers
//! `[sub-block s][token][column]` with the requested local rows.

mod adapter;
mod compact;
mod fourbit;
mod gpu;
mod group;
mod member;
pub mod packed;
mod probe;
mod shards;
pub mod stream;
mod verify;

pub use adapter::{ADAPTER_RANK, Adapter, Projection, TILE, adapter_rank, tiled_at};
pub use compact::{
    CodedInts, Q8Values, affine_grid_matrix, compact_matrix, compact_model, encode_q8, grid_matrix,
    grid_model, map_linear, through_parity_matrix, wide_row,
};
pub use fourbit::Q4Values;
pub use gpu::{GpuGroup, GpuShards};
pub use group::{CodedGroup, ExecStats, InProcess, Transport, TransportError};
pub use member::{AUTO_GPU_MIN_WORK, Member, Misbehaviour, SKEW};
pub use probe::{Fit, PROBE_MIN_FIT, PROBE_SIGMAS, UpdateProbe};
pub use shards::{MatrixShape, Shard, ShardFormat, ShardSet, ShardValues, shapes};
pub use verify::{Caught, DEFAULT_NOISE, NOISE_MARGIN, VerifyConfig, measure_noise};

/// Errors of coded execution.
#[derive(Debug, thiserror::Error)]
pub enum CodedError {
    /// The code itself refused (bad generator, singular group, wrong lengths).
    #[error("code: {0}")]
    Code(#[from] crate::code::CodeError),
    /// The model does not fit the request.
    #[error("model: {0}")]
    Model(#[from] crate::model::ModelError),
    /// A request named something the member does not hold or was malformed.
    #[error("bad step request: {0}")]
    BadRequest(String),
    /// The message layer failed.
    #[error("protocol: {0}")]
    Protocol(#[from] crate::protocol::ProtocolError),
    /// A member's transport failed.
    #[error("transport: {0}")]
    Transport(#[from] TransportError),
    /// Answers disagree with the code and the wrong member could not be found.
    #[error("verification: {0}")]
    Verification(String),
    /// The GPU backend failed.
    #[error("{0}")]
    Gpu(#[from] crate::compute::gpu::GpuError),
    /// A member answered with a failure or a wrong shape.
    #[error("member {node}: {reason}")]
    Member {
        /// The member's node index.
        node: usize,
        /// What it said or did wrong.
        reason: String,
    },
}
