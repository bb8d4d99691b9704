//! The Llama-family transformer: configuration, weights, tokenizer, the leader's forward pass.
//!
//! The linear layers are not computed here: the forward pass hands each linear stage to a
//! [`LinearExec`], which is a coded group of members (or one uncoded member when k = 1).

mod batch;
mod block;
mod config;
mod generate;
mod gguf_model;
mod layers;
mod llama;
mod logprobs;
mod sampling;
mod sequence;
mod source;
pub mod speculate;
mod tokenizer;
mod train;
mod weights;

pub use batch::{AfterFailure, Batch, BatchLimits, Ended, Entry, MAX_PASS_FAILURES, Took};
pub use block::{BLOCK, BlockStep, LinearExec, PassStep, Stage, pass_rows, pass_steps};
pub use config::{Family, LlamaConfig};
pub use generate::{
    Forward, GenerateOptions, Generation, Pass, StopReason, logits_along, relative_error,
};
pub use gguf_model::{GgufModel, ReadAt};
pub use layers::{StageGrad, StageSink};
pub use llama::{BatchItem, KvCache, Llama};
#[cfg(test)]
pub(crate) use logprobs::tests::log_softmax;
pub use logprobs::{MAX_TOP_LOGPROBS, TokenConstraint, TokenLogprob, token_logprob};
pub use sampling::{Sampler, SamplingDefaults, SamplingParams, argmax};
pub use sequence::{Sequence, Taken};
pub use source::MatrixSource;
pub use tokenizer::{ChatMessage, TextStream, Tokenizer, TokenizerData};
pub use train::{Gradients, HEAD_BYTES, KEEP_BYTES, MAX_SOFT_TOP, Soft, training_bytes};
pub use weights::{LayerWeights, LeaderWeights, Matrix, ModelWeights};

use crate::gguf::GgufError;

/// Everything that can go wrong loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// The model file could not be parsed.
    #[error("GGUF: {0}")]
    Gguf(#[from] GgufError),
    /// A safetensors file could not be parsed.
    #[error("safetensors: {0}")]
    Safetensors(String),
    /// The configuration is missing a field or is inconsistent.
    #[error("model config: {0}")]
    Config(String),
    /// A leader has no group to run a pass on, for this reason.
    #[error("{0}")]
    NoGroup(String),
    /// The file holds a model this code does not run.
    #[error("unsupported model: {0}")]
    Unsupported(String),
    /// A tensor the model needs is absent.
    #[error("tensor {name:?} is missing")]
    MissingTensor {
        /// Tensor name in the file.
        name: String,
    },
    /// A tensor has the wrong shape.
    #[error("tensor {name:?} has shape {got:?}, expected {expected:?}")]
    TensorShape {
        /// Tensor name in the file.
        name: String,
        /// Shape found (row-major).
        got: Vec<usize>,
        /// Shape required (row-major).
        expected: Vec<usize>,
    },
    /// A tensor holds NaN or infinity.
    #[error("tensor {name:?} holds non-finite values")]
    NonFinite {
        /// Tensor name in the file.
        name: String,
    },
    /// The tokenizer could not be built or used.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A token id outside the vocabulary.
    #[error("token id {id} is outside the vocabulary of {vocab}")]
    TokenOutOfRange {
        /// The offending id.
        id: u32,
        /// Vocabulary size.
        vocab: usize,
    },
    /// The sequence no longer fits the model's context.
    #[error("sequence of {len} tokens exceeds the context of {max}")]
    ContextFull {
        /// Length requested.
        len: usize,
        /// The model's maximum.
        max: usize,
    },
    /// A linear stage failed in the group that computes it.
    #[error("linear stage {stage:?}: {message}")]
    Exec {
        /// Which stage.
        stage: Stage,
        /// What went wrong.
        message: String,
    },
    /// The embedding lookup failed in the group that computes it.
    #[error("embedding lookup: {0}")]
    Embedding(String),
    /// Sampling parameters are out of range.
    #[error("sampling: {0}")]
    Sampling(String),
}
