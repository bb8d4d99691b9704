//! Llama-family model configuration: the file formats' configs and the plain one the model uses.

use serde::Deserialize;

use super::ModelError;
use crate::gguf::GgufFile;

/// The shape of a Llama-family model, independent of the file it came from.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LlamaConfig {
    /// Width of the residual stream.
    pub hidden: usize,
    /// Width of the SwiGLU feed-forward layer.
    pub ffn: usize,
    /// Number of transformer blocks.
    pub layers: usize,
    /// Number of query heads.
    pub heads: usize,
    /// Number of key/value heads (grouped-query attention).
    pub kv_heads: usize,
    /// Width of one attention head.
    pub head_dim: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// RMSNorm epsilon.
    pub norm_eps: f32,
    /// RoPE frequency base.
    pub rope_theta: f32,
    /// Longest sequence the model accepts.
    pub max_seq: usize,
    /// Whether the LM head shares the token embedding.
    pub tied_embeddings: bool,
}

impl LlamaConfig {
    /// A small model shape (8 wide, one block, 16 tokens) for tests and the fuzz targets.
    pub fn small() -> Self {
        Self {
            hidden: 8,
            ffn: 16,
            layers: 1,
            heads: 2,
            kv_heads: 1,
            head_dim: 4,
            vocab: 16,
            norm_eps: 1e-5,
            rope_theta: 10_000.0,
            max_seq: 8,
            tied_embeddings: true,
        }
    }

    /// SmolLM2-135M's shape (the default model), for benchmarks of speed on random weights
    /// where the file is not at hand.
    pub fn smollm2_135m() -> Self {
        Self {
            hidden: 576,
            ffn: 1536,
            layers: 30,
            heads: 9,
            kv_heads: 3,
            head_dim: 64,
            vocab: 49152,
            norm_eps: 1e-5,
            rope_theta: 100_000.0,
            max_seq: 8192,
            tied_embeddings: true,
        }
    }

    /// Checks that the shape is internally consistent and of a sane size.
    pub fn validate(&self) -> Result<(), ModelError> {
        let bad = |what: &str| Err(ModelError::Config(what.to_string()));
        if self.hidden == 0 || self.ffn == 0 || self.layers == 0 || self.vocab == 0 {
            return bad("hidden, ffn, layers and vocab must be positive");
        }
        if self.heads == 0 || self.kv_heads == 0 || !self.heads.is_multiple_of(self.kv_heads) {
            return bad("heads must be a positive multiple of kv_heads");
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return bad("head_dim must be positive and even");
        }
        if self.hidden > 1 << 16 || self.ffn > 1 << 18 || self.layers > 1024 || self.vocab > 1 << 22
        {
            return bad("model dimensions are implausibly large");
        }
        if self
            .heads
            .checked_mul(self.head_dim)
            .is_none_or(|w| w > 1 << 16)
        {
            return bad("heads × head_dim is implausibly large");
        }
        if !(self.norm_eps.is_finite() && self.norm_eps > 0.0) {
            return bad("norm_eps must be positive and finite");
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0) {
            return bad("rope_theta must be finite and > 1");
        }
        if self.max_seq == 0 {
            return bad("max_seq must be positive");
        }
        Ok(())
    }

    /// Width of all query heads together.
    pub fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Width of all key (or value) heads together.
    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Reads the configuration from GGUF `llama.*` metadata.
    pub fn from_gguf(file: &GgufFile) -> Result<Self, ModelError> {
        let arch = file.get_str("general.architecture")?;
        if arch != "llama" {
            return Err(ModelError::Unsupported(format!(
                "architecture {arch:?} (only llama is supported)"
            )));
        }
        let u = |key: &str| -> Result<usize, ModelError> {
            Ok(file.get_u32(&format!("llama.{key}"))? as usize)
        };
        let hidden = u("embedding_length")?;
        let heads = u("attention.head_count")?;
        let kv_heads = file
            .get_u32("llama.attention.head_count_kv")
            .map(|v| v as usize)
            .unwrap_or(heads);
        let head_dim = match file.get_u32("llama.rope.dimension_count") {
            Ok(v) => v as usize,
            Err(_) if heads > 0 => hidden / heads,
            Err(e) => return Err(e.into()),
        };
        let vocab = match file.get_u32("llama.vocab_size") {
            Ok(v) => v as usize,
            Err(_) => file.get_str_array("tokenizer.ggml.tokens")?.len(),
        };
        let cfg = Self {
            hidden,
            ffn: u("feed_forward_length")?,
            layers: u("block_count")?,
            heads,
            kv_heads,
            head_dim,
            vocab,
            norm_eps: file.get_f32("llama.attention.layer_norm_rms_epsilon")?,
            rope_theta: file.get_f32("llama.rope.freq_base").unwrap_or(10_000.0),
            max_seq: u("context_length").unwrap_or(2048),
            tied_embeddings: file.tensor("output.weight").is_none(),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads the configuration from a Hugging Face `config.json`.
    pub fn from_hf_json(json: &str) -> Result<Self, ModelError> {
        let hf: HfLlamaConfig =
            serde_json::from_str(json).map_err(|e| ModelError::Config(e.to_string()))?;
        if let Some(arch) = hf.model_type.as_deref()
            && arch != "llama"
        {
            return Err(ModelError::Unsupported(format!(
                "model_type {arch:?} (only llama is supported)"
            )));
        }
        let heads = hf.num_attention_heads;
        let cfg = Self {
            hidden: hf.hidden_size,
            ffn: hf.intermediate_size,
            layers: hf.num_hidden_layers,
            heads,
            kv_heads: hf.num_key_value_heads.unwrap_or(heads),
            head_dim: hf
                .head_dim
                .unwrap_or(hf.hidden_size.checked_div(heads).unwrap_or(0)),
            vocab: hf.vocab_size,
            norm_eps: hf.rms_norm_eps,
            rope_theta: hf.rope_theta.unwrap_or(10_000.0),
            max_seq: hf.max_position_embeddings.unwrap_or(2048),
            tied_embeddings: hf.tie_word_embeddings.unwrap_or(false),
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

/// The fields of a Hugging Face Llama `config.json` that the model needs.
#[derive(Debug, Deserialize)]
struct HfLlamaConfig {
    model_type: Option<String>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: usize,
    rms_norm_eps: f32,
    rope_theta: Option<f32>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
}
