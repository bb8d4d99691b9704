//! What the training tests share.

use node_core::model::LlamaConfig;

/// A model small enough for finite differences and many SGD steps in a test.
pub fn train_config(tied: bool) -> LlamaConfig {
    LlamaConfig {
        hidden: 32,
        ffn: 48,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 8,
        vocab: 64,
        norm_eps: 1e-5,
        rope_theta: 10_000.0,
        max_seq: 16,
        tied_embeddings: tied,
    }
}
