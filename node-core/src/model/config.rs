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
    /// Which family's block this is: what the leader adds around the coded projections.
    pub family: Family,
    /// RoPE frequency divisors, one per pair of a head (Llama 3's "llama3" scaling, GGUF's
    /// `rope_freqs.weight`); empty when the frequencies are unscaled.
    pub rope_freq_factors: Vec<f32>,
}

/// The model families whose blocks the leader runs: each is a Llama block with its own extras
/// around the coded projections, which stay the same seven matrices.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum Family {
    /// Llama 1–3.x, Mistral, SmolLM: the plain block.
    #[default]
    Llama,
    /// Qwen2 and Qwen2.5: biases on the query, key and value projections.
    Qwen2,
    /// Qwen3: an RMSNorm on each query and key head before RoPE.
    Qwen3,
}

impl Family {
    /// GGUF `general.architecture` values this code runs, for error messages.
    pub const SUPPORTED: &'static str =
        "llama (Llama 1-3.x, Mistral, SmolLM), qwen2 (Qwen2, Qwen2.5), qwen3 (Qwen3 dense)";

    /// The family of a GGUF `general.architecture` or Hugging Face `model_type`.
    pub fn from_name(name: &str) -> Result<Self, ModelError> {
        match name {
            "llama" | "mistral" => Ok(Self::Llama),
            "qwen2" => Ok(Self::Qwen2),
            "qwen3" => Ok(Self::Qwen3),
            other => Err(ModelError::Unsupported(format!(
                "architecture {other:?}; supported: {}",
                Self::SUPPORTED
            ))),
        }
    }

    /// Whether the query, key and value projections carry biases.
    pub fn qkv_bias(self) -> bool {
        self == Self::Qwen2
    }

    /// Whether each query and key head is RMS-normalised before RoPE.
    pub fn qk_norm(self) -> bool {
        self == Self::Qwen3
    }

    /// Whether the file stores query and key rows in Hugging Face's half-split RoPE layout
    /// (llama.cpp's NeoX rope), which loading turns into adjacent pairs.
    pub(crate) fn half_split_rope_in_gguf(self) -> bool {
        self != Self::Llama
    }
}

impl LlamaConfig {
    /// A coded test model's shape (64 wide, three blocks, 250 tokens, untied head): large
    /// enough for every group of a small code to differ from the uncoded model, small enough
    /// for a test.
    pub fn test_model() -> Self {
        Self {
            hidden: 64,
            ffn: 160,
            layers: 3,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            vocab: 250,
            max_seq: 64,
            tied_embeddings: false,
            ..Self::small()
        }
    }

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
            family: Family::Llama,
            rope_freq_factors: Vec::new(),
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
            family: Family::Llama,
            rope_freq_factors: Vec::new(),
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
        if !self.rope_freq_factors.is_empty()
            && (self.rope_freq_factors.len() != self.head_dim / 2
                || !self
                    .rope_freq_factors
                    .iter()
                    .all(|f| f.is_finite() && *f > 0.0))
        {
            return bad("rope frequency factors must be head_dim/2 positive finite values");
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

    /// `(rows, cols)` of every coded matrix, in chain order: per block q, k, v, o, gate, up,
    /// down; the embedding; the separate LM head when there is one.
    pub fn matrix_shapes(&self) -> Vec<(usize, usize)> {
        let (d, f, q, kv) = (self.hidden, self.ffn, self.q_dim(), self.kv_dim());
        let block = [(q, d), (kv, d), (kv, d), (d, q), (f, d), (f, d), (d, f)];
        let mut out = Vec::with_capacity(self.layers * 7 + 2);
        (0..self.layers).for_each(|_| out.extend(block));
        out.push((self.vocab, d));
        if !self.tied_embeddings {
            out.push((self.vocab, d));
        }
        out
    }

    /// Reads the configuration from GGUF metadata (`{arch}.*` keys, `rope_freqs.weight`).
    pub fn from_gguf(file: &GgufFile, bytes: &[u8]) -> Result<Self, ModelError> {
        Self::from_gguf_with(file, &|name| Ok(file.tensor_f32(bytes, name)?))
    }

    /// [`Self::from_gguf`] with a tensor reader in place of the file's bytes.
    pub fn from_gguf_with(
        file: &GgufFile,
        tensor: &dyn Fn(&str) -> Result<Vec<f32>, ModelError>,
    ) -> Result<Self, ModelError> {
        let arch = file.get_str("general.architecture")?;
        let family = Family::from_name(arch)?;
        let key = |k: &str| format!("{arch}.{k}");
        let u = |k: &str| -> Result<usize, ModelError> { Ok(file.get_u32(&key(k))? as usize) };
        let hidden = u("embedding_length")?;
        let heads = u("attention.head_count")?;
        let kv_heads = u("attention.head_count_kv").unwrap_or(heads);
        // A head's width: `key_length` when the file says it (Qwen3's heads are wider than
        // hidden/heads), else the rotated width, else hidden/heads.
        let rotated = u("rope.dimension_count").ok();
        let head_dim = match u("attention.key_length").ok().or(rotated) {
            Some(v) => v,
            None if heads > 0 => hidden / heads,
            None => u("rope.dimension_count")?,
        };
        if let Some(rotated) = rotated
            && rotated != head_dim
        {
            return Err(ModelError::Unsupported(format!(
                "partial RoPE ({rotated} of {head_dim} dimensions of a head rotated)"
            )));
        }
        if let Ok(v) = u("attention.value_length")
            && v != head_dim
        {
            return Err(ModelError::Unsupported(format!(
                "value heads of {v} wide with key heads of {head_dim}"
            )));
        }
        let vocab = match u("vocab_size") {
            Ok(v) => v,
            Err(_) => file.get_str_array("tokenizer.ggml.tokens")?.len(),
        };
        let mut rope_freq_factors = match file.tensor("rope_freqs.weight") {
            Some(_) => tensor("rope_freqs.weight")?,
            None => Vec::new(),
        };
        match file.get_str(&key("rope.scaling.type")) {
            Err(_) | Ok("none") => {}
            // Linear scaling divides every frequency by the factor.
            Ok("linear") => {
                let factor = file.get_f32(&key("rope.scaling.factor"))?;
                if !(factor.is_finite() && factor >= 1.0) {
                    return Err(ModelError::Config(format!(
                        "linear RoPE scaling factor {factor}"
                    )));
                }
                if rope_freq_factors.is_empty() {
                    rope_freq_factors = vec![1.0; head_dim / 2];
                }
                rope_freq_factors.iter_mut().for_each(|f| *f *= factor);
            }
            Ok(other) => {
                return Err(ModelError::Unsupported(format!(
                    "RoPE scaling {other:?} (none, linear and Llama 3's frequency factors are supported)"
                )));
            }
        }
        let cfg = Self {
            hidden,
            ffn: u("feed_forward_length")?,
            layers: u("block_count")?,
            heads,
            kv_heads,
            head_dim,
            vocab,
            norm_eps: file.get_f32(&key("attention.layer_norm_rms_epsilon"))?,
            rope_theta: file.get_f32(&key("rope.freq_base")).unwrap_or(10_000.0),
            max_seq: u("context_length").unwrap_or(2048),
            tied_embeddings: file.tensor("output.weight").is_none(),
            family,
            rope_freq_factors,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads the configuration from a Hugging Face `config.json`.
    pub fn from_hf_json(json: &str) -> Result<Self, ModelError> {
        let hf: HfLlamaConfig =
            serde_json::from_str(json).map_err(|e| ModelError::Config(e.to_string()))?;
        let family = Family::from_name(hf.model_type.as_deref().unwrap_or("llama"))?;
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
            family,
            rope_freq_factors: Vec::new(),
        };
        let cfg = match &hf.rope_scaling {
            None => cfg,
            Some(scaling) => Self {
                rope_freq_factors: scaling.factors(&cfg)?,
                ..cfg
            },
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
    rope_scaling: Option<HfRopeScaling>,
}

/// A Hugging Face `rope_scaling` object.
#[derive(Debug, Deserialize)]
struct HfRopeScaling {
    #[serde(alias = "type")]
    rope_type: String,
    factor: f32,
    low_freq_factor: Option<f32>,
    high_freq_factor: Option<f32>,
    original_max_position_embeddings: Option<usize>,
}

impl HfRopeScaling {
    /// Each pair's frequency divisor, as llama.cpp's converter writes `rope_freqs.weight`.
    fn factors(&self, cfg: &LlamaConfig) -> Result<Vec<f32>, ModelError> {
        let half = cfg.head_dim / 2;
        let factor = f64::from(self.factor);
        match self.rope_type.as_str() {
            "linear" => Ok(vec![self.factor; half]),
            "llama3" => {
                let missing = || ModelError::Config("llama3 rope_scaling lacks a field".into());
                let low = f64::from(self.low_freq_factor.ok_or_else(missing)?);
                let high = f64::from(self.high_freq_factor.ok_or_else(missing)?);
                let old = self.original_max_position_embeddings.ok_or_else(missing)? as f64;
                if high.partial_cmp(&low) != Some(std::cmp::Ordering::Greater) {
                    return Err(ModelError::Config(
                        "llama3 rope_scaling needs high_freq_factor > low_freq_factor".into(),
                    ));
                }
                let (low_wavelen, high_wavelen) = (old / low, old / high);
                Ok((0..half)
                    .map(|i| {
                        let freq =
                            f64::from(cfg.rope_theta).powf(-2.0 * i as f64 / cfg.head_dim as f64);
                        let wavelen = 2.0 * std::f64::consts::PI / freq;
                        if wavelen < high_wavelen {
                            1.0
                        } else if wavelen > low_wavelen {
                            factor as f32
                        } else {
                            let smooth = (old / wavelen - low) / (high - low);
                            (1.0 / ((1.0 - smooth) / factor + smooth)) as f32
                        }
                    })
                    .collect())
            }
            other => Err(ModelError::Unsupported(format!(
                "rope_scaling {other:?} (linear and llama3 are supported)"
            ))),
        }
    }
}
