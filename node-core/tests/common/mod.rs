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
        family: node_core::model::Family::Llama,
        rope_freq_factors: Vec::new(),
    }
}

/// Largest difference between `a` and `b`, relative to the largest magnitude in `b`.
#[allow(dead_code)] // not every test crate that includes this module uses it
pub fn max_rel_diff(a: &[f32], b: &[f32]) -> f64 {
    let scale = b.iter().fold(0.0f32, |m, v| m.max(v.abs())) as f64;
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() as f64)
        .fold(0.0, f64::max)
        / scale
}
