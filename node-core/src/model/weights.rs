//! Model weights in f32, loaded from GGUF or Hugging Face safetensors, or made up for tests.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use safetensors::SafeTensors;

use super::{LlamaConfig, ModelError};
use crate::gguf::GgufFile;
use serde::{Deserialize, Serialize};

/// A dense row-major f32 matrix.
#[derive(Debug, Clone, PartialEq)]
pub struct Matrix {
    /// Number of rows (outputs of a linear layer).
    pub rows: usize,
    /// Number of columns (inputs of a linear layer).
    pub cols: usize,
    /// `rows × cols` values, row-major.
    pub data: Vec<f32>,
}

impl Matrix {
    /// Wraps data of the given shape, checking its length.
    pub fn new(rows: usize, cols: usize, data: Vec<f32>) -> Result<Self, ModelError> {
        if rows.checked_mul(cols) != Some(data.len()) {
            return Err(ModelError::Config(format!(
                "matrix of {rows}×{cols} given {} values",
                data.len()
            )));
        }
        Ok(Self { rows, cols, data })
    }

    /// One row as a slice.
    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }
}

/// The weights of one transformer block.
#[derive(Debug, Clone)]
pub struct LayerWeights {
    /// RMSNorm gain before attention.
    pub attn_norm: Vec<f32>,
    /// Query projection, `q_dim × hidden` (GGML adjacent-pair RoPE layout).
    pub q: Matrix,
    /// Key projection, `kv_dim × hidden` (GGML adjacent-pair RoPE layout).
    pub k: Matrix,
    /// Value projection, `kv_dim × hidden`.
    pub v: Matrix,
    /// Attention output projection, `hidden × q_dim`.
    pub o: Matrix,
    /// RMSNorm gain before the feed-forward layer.
    pub ffn_norm: Vec<f32>,
    /// SwiGLU gate projection, `ffn × hidden`.
    pub gate: Matrix,
    /// SwiGLU up projection, `ffn × hidden`.
    pub up: Matrix,
    /// SwiGLU down projection, `hidden × ffn`.
    pub down: Matrix,
    /// Query, key and value biases, `q_dim + 2·kv_dim` (Qwen2; empty for other families).
    pub qkv_bias: Vec<f32>,
    /// RMSNorm gain of each query head, `head_dim` (Qwen3; empty for other families).
    pub q_norm: Vec<f32>,
    /// RMSNorm gain of each key head, `head_dim` (Qwen3; empty for other families).
    pub k_norm: Vec<f32>,
}

/// A whole model's weights, uncoded, in f32.
#[derive(Debug, Clone)]
pub struct ModelWeights {
    /// The model's shape.
    pub cfg: LlamaConfig,
    /// Token embedding, `vocab × hidden`; also the LM head when tied.
    pub embed: Matrix,
    /// The transformer blocks.
    pub layers: Vec<LayerWeights>,
    /// Final RMSNorm gain.
    pub final_norm: Vec<f32>,
    /// Separate LM head, `vocab × hidden`, when not tied to the embedding.
    pub lm_head: Option<Matrix>,
}

/// Tensor names of one file format, written once.
pub(super) struct Names {
    pub(super) embed: &'static str,
    pub(super) final_norm: &'static str,
    pub(super) lm_head: &'static str,
    pub(super) layer: fn(usize, Part) -> String,
}

/// The tensors of one block.
#[derive(Clone, Copy)]
pub(super) enum Part {
    AttnNorm,
    Q,
    K,
    V,
    O,
    FfnNorm,
    Gate,
    Up,
    Down,
    QBias,
    KBias,
    VBias,
    QNorm,
    KNorm,
}

impl Part {
    /// The tensor's name after its stem: the biases' `bias`, every other's `weight`.
    fn suffix(self) -> &'static str {
        match self {
            Part::QBias | Part::KBias | Part::VBias => "bias",
            _ => "weight",
        }
    }
}

pub(super) const GGUF_NAMES: Names = Names {
    embed: "token_embd.weight",
    final_norm: "output_norm.weight",
    lm_head: "output.weight",
    layer: |i, part| {
        let p = match part {
            Part::AttnNorm => "attn_norm",
            Part::Q | Part::QBias => "attn_q",
            Part::K | Part::KBias => "attn_k",
            Part::V | Part::VBias => "attn_v",
            Part::O => "attn_output",
            Part::FfnNorm => "ffn_norm",
            Part::Gate => "ffn_gate",
            Part::Up => "ffn_up",
            Part::Down => "ffn_down",
            Part::QNorm => "attn_q_norm",
            Part::KNorm => "attn_k_norm",
        };
        format!("blk.{i}.{p}.{}", part.suffix())
    },
};

const HF_NAMES: Names = Names {
    embed: "model.embed_tokens.weight",
    final_norm: "model.norm.weight",
    lm_head: "lm_head.weight",
    layer: |i, part| {
        let p = match part {
            Part::AttnNorm => "input_layernorm",
            Part::Q | Part::QBias => "self_attn.q_proj",
            Part::K | Part::KBias => "self_attn.k_proj",
            Part::V | Part::VBias => "self_attn.v_proj",
            Part::O => "self_attn.o_proj",
            Part::FfnNorm => "post_attention_layernorm",
            Part::Gate => "mlp.gate_proj",
            Part::Up => "mlp.up_proj",
            Part::Down => "mlp.down_proj",
            Part::QNorm => "self_attn.q_norm",
            Part::KNorm => "self_attn.k_norm",
        };
        format!("model.layers.{i}.{p}.{}", part.suffix())
    },
};

/// A source of named f32 tensors with row-major shapes.
pub(super) trait TensorSource {
    /// Shape (row-major) of a tensor, if present.
    fn shape(&self, name: &str) -> Option<Vec<usize>>;
    /// The tensor's values as f32.
    fn load(&self, name: &str) -> Result<Vec<f32>, ModelError>;
}

struct GgufSource<'a> {
    file: &'a GgufFile,
    bytes: &'a [u8],
}

impl TensorSource for GgufSource<'_> {
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.file.tensor(name).map(|t| t.shape.clone())
    }

    fn load(&self, name: &str) -> Result<Vec<f32>, ModelError> {
        Ok(self.file.tensor_f32(self.bytes, name)?)
    }
}

struct SafetensorsSource<'a> {
    st: SafeTensors<'a>,
}

impl TensorSource for SafetensorsSource<'_> {
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.st.tensor(name).ok().map(|t| t.shape().to_vec())
    }

    fn load(&self, name: &str) -> Result<Vec<f32>, ModelError> {
        let view = self
            .st
            .tensor(name)
            .map_err(|_| ModelError::MissingTensor {
                name: name.to_string(),
            })?;
        let data = view.data();
        let values = match view.dtype() {
            safetensors::Dtype::F32 => data
                .as_chunks::<4>()
                .0
                .iter()
                .map(|b| f32::from_le_bytes(*b))
                .collect(),
            safetensors::Dtype::F16 => data
                .as_chunks::<2>()
                .0
                .iter()
                .map(|b| half::f16::from_le_bytes(*b).to_f32())
                .collect(),
            safetensors::Dtype::BF16 => data
                .as_chunks::<2>()
                .0
                .iter()
                .map(|b| half::bf16::from_le_bytes(*b).to_f32())
                .collect(),
            other => {
                return Err(ModelError::Unsupported(format!(
                    "tensor {name:?} has dtype {other:?} (F32, F16, BF16 are supported)"
                )));
            }
        };
        Ok(values)
    }
}

/// Loads one tensor and checks its shape and values.
pub(super) fn load_tensor(
    src: &dyn TensorSource,
    name: &str,
    expected: &[usize],
) -> Result<Vec<f32>, ModelError> {
    let got = src.shape(name).ok_or_else(|| ModelError::MissingTensor {
        name: name.to_string(),
    })?;
    if got != expected {
        return Err(ModelError::TensorShape {
            name: name.to_string(),
            got,
            expected: expected.to_vec(),
        });
    }
    let values = src.load(name)?;
    if values.len() != expected.iter().product::<usize>() {
        return Err(ModelError::TensorShape {
            name: name.to_string(),
            got: vec![values.len()],
            expected: expected.to_vec(),
        });
    }
    if values.iter().any(|v| !v.is_finite()) {
        return Err(ModelError::NonFinite {
            name: name.to_string(),
        });
    }
    Ok(values)
}

fn load_matrix(
    src: &dyn TensorSource,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<Matrix, ModelError> {
    Matrix::new(rows, cols, load_tensor(src, name, &[rows, cols])?)
}

/// Every gain and bias of a model (the leader's parameters), as its file stores them.
pub(super) fn load_gains(
    cfg: &LlamaConfig,
    src: &dyn TensorSource,
    names: &Names,
) -> Result<LeaderWeights, ModelError> {
    let d = cfg.hidden;
    let (bias, qk_norm) = (cfg.family.qkv_bias(), cfg.family.qk_norm());
    let mut g = LeaderWeights {
        final_norm: load_tensor(src, names.final_norm, &[d])?,
        ..LeaderWeights::default()
    };
    for i in 0..cfg.layers {
        let name = |p| (names.layer)(i, p);
        g.attn_norm
            .push(load_tensor(src, &name(Part::AttnNorm), &[d])?);
        g.ffn_norm
            .push(load_tensor(src, &name(Part::FfnNorm), &[d])?);
        if bias {
            let mut b = load_tensor(src, &name(Part::QBias), &[cfg.q_dim()])?;
            b.extend(load_tensor(src, &name(Part::KBias), &[cfg.kv_dim()])?);
            b.extend(load_tensor(src, &name(Part::VBias), &[cfg.kv_dim()])?);
            g.qkv_bias.push(b);
        }
        if qk_norm {
            g.q_norm
                .push(load_tensor(src, &name(Part::QNorm), &[cfg.head_dim])?);
            g.k_norm
                .push(load_tensor(src, &name(Part::KNorm), &[cfg.head_dim])?);
        }
    }
    Ok(g)
}

/// Reorders Q/K rows (of `cols` values each) from Hugging Face's half-split RoPE layout to
/// GGML's adjacent pairs: within each head, HF row `h·(d/2) + i` becomes row `2i + h`.
fn hf_rope_to_adjacent(data: &mut [f32], cols: usize, heads: usize) {
    let head_rows = data.len() / cols / heads;
    let half = head_rows / 2;
    let original = data.to_vec();
    for head in 0..heads {
        for h in 0..2 {
            for i in 0..half {
                let from = head * head_rows + h * half + i;
                let to = head * head_rows + 2 * i + h;
                data[to * cols..(to + 1) * cols]
                    .copy_from_slice(&original[from * cols..(from + 1) * cols]);
            }
        }
    }
}

/// Reorders one block's query and key biases and head-norm gains from the half-split RoPE
/// layout to adjacent pairs (empty ones are left alone).
pub(super) fn gains_to_adjacent(
    cfg: &LlamaConfig,
    qkv_bias: &mut [f32],
    q_norm: &mut [f32],
    k_norm: &mut [f32],
) {
    let (q_dim, kv_dim) = (cfg.q_dim(), cfg.kv_dim());
    if !qkv_bias.is_empty() {
        hf_rope_to_adjacent(&mut qkv_bias[..q_dim], 1, cfg.heads);
        hf_rope_to_adjacent(&mut qkv_bias[q_dim..q_dim + kv_dim], 1, cfg.kv_heads);
    }
    for gain in [q_norm, k_norm] {
        if !gain.is_empty() {
            hf_rope_to_adjacent(gain, 1, 1);
        }
    }
}

impl LayerWeights {
    /// The block's seven linear matrices in chain order: q, k, v, o, gate, up, down.
    pub fn matrices(&self) -> [&Matrix; 7] {
        [
            &self.q, &self.k, &self.v, &self.o, &self.gate, &self.up, &self.down,
        ]
    }
}

impl ModelWeights {
    /// Loads a Llama model from the bytes of a GGUF file.
    pub fn from_gguf(file: &GgufFile, bytes: &[u8]) -> Result<Self, ModelError> {
        let cfg = LlamaConfig::from_gguf(file, bytes)?;
        let mut w = Self::load(cfg, &GgufSource { file, bytes }, &GGUF_NAMES)?;
        if w.cfg.family.half_split_rope_in_gguf() {
            w.rope_to_adjacent();
        }
        Ok(w)
    }

    /// Loads a Llama model from Hugging Face `config.json` text and `model.safetensors` bytes.
    pub fn from_safetensors(config_json: &str, safetensors: &[u8]) -> Result<Self, ModelError> {
        let cfg = LlamaConfig::from_hf_json(config_json)?;
        let st = SafeTensors::deserialize(safetensors)
            .map_err(|e| ModelError::Safetensors(e.to_string()))?;
        let src = SafetensorsSource { st };
        let mut w = Self::load(cfg, &src, &HF_NAMES)?;
        w.rope_to_adjacent();
        Ok(w)
    }

    /// Reorders every block's query and key rows, their biases and their norm gains from the
    /// half-split RoPE layout to the adjacent pairs the model rotates.
    fn rope_to_adjacent(&mut self) {
        let (heads, kv_heads) = (self.cfg.heads, self.cfg.kv_heads);
        for layer in &mut self.layers {
            let cols = layer.q.cols;
            hf_rope_to_adjacent(&mut layer.q.data, cols, heads);
            hf_rope_to_adjacent(&mut layer.k.data, cols, kv_heads);
            gains_to_adjacent(
                &self.cfg,
                &mut layer.qkv_bias,
                &mut layer.q_norm,
                &mut layer.k_norm,
            );
        }
    }

    fn load(cfg: LlamaConfig, src: &dyn TensorSource, names: &Names) -> Result<Self, ModelError> {
        let (d, f) = (cfg.hidden, cfg.ffn);
        let embed = load_matrix(src, names.embed, cfg.vocab, d)?;
        let tied = src.shape(names.lm_head).is_none();
        let lm_head = if tied {
            None
        } else {
            Some(load_matrix(src, names.lm_head, cfg.vocab, d)?)
        };
        let mut gains = load_gains(&cfg, src, names)?;
        let take = |v: &mut Vec<Vec<f32>>, i: usize| v.get_mut(i).map(std::mem::take);
        let mut layers = Vec::with_capacity(cfg.layers);
        for i in 0..cfg.layers {
            let name = |p| (names.layer)(i, p);
            layers.push(LayerWeights {
                qkv_bias: take(&mut gains.qkv_bias, i).unwrap_or_default(),
                q_norm: take(&mut gains.q_norm, i).unwrap_or_default(),
                k_norm: take(&mut gains.k_norm, i).unwrap_or_default(),
                attn_norm: take(&mut gains.attn_norm, i).unwrap_or_default(),
                q: load_matrix(src, &name(Part::Q), cfg.q_dim(), d)?,
                k: load_matrix(src, &name(Part::K), cfg.kv_dim(), d)?,
                v: load_matrix(src, &name(Part::V), cfg.kv_dim(), d)?,
                o: load_matrix(src, &name(Part::O), d, cfg.q_dim())?,
                ffn_norm: take(&mut gains.ffn_norm, i).unwrap_or_default(),
                gate: load_matrix(src, &name(Part::Gate), f, d)?,
                up: load_matrix(src, &name(Part::Up), f, d)?,
                down: load_matrix(src, &name(Part::Down), d, f)?,
            });
        }
        let cfg = LlamaConfig {
            tied_embeddings: tied,
            ..cfg
        };
        Ok(Self {
            cfg,
            embed,
            layers,
            final_norm: gains.final_norm,
            lm_head,
        })
    }

    /// A model of the given shape with seeded random weights, for tests and benchmarks.
    pub fn synthetic(cfg: LlamaConfig, seed: u64) -> Result<Self, ModelError> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        Self::random(cfg, &mut |rows, cols| {
            let scale = 1.0 / (cols as f32).sqrt();
            let data = (0..rows * cols).map(|_| draw(&mut rng, scale)).collect();
            Matrix { rows, cols, data }
        })
    }

    /// A model of the given shape with seeded random weights drawn on every kernel thread
    /// (other values than [`Self::synthetic`]'s), for benchmarks of large shapes.
    pub fn synthetic_parallel(cfg: LlamaConfig, seed: u64) -> Result<Self, ModelError> {
        /// Values drawn from one stream.
        const CHUNK: usize = 1 << 20;
        let mut matrices = 0u64;
        Self::random(cfg, &mut |rows, cols| {
            let scale = 1.0 / (cols as f32).sqrt();
            let mut data = vec![0.0f32; rows * cols];
            let matrix = matrices;
            matrices += 1;
            crate::compute::par::for_each_chunk(&mut data, CHUNK, |i, chunk| {
                let mut rng = ChaCha8Rng::seed_from_u64(seed);
                rng.set_stream((matrix << 32) | i as u64);
                chunk.iter_mut().for_each(|v| *v = draw(&mut rng, scale));
            });
            Matrix { rows, cols, data }
        })
    }

    /// A model of the given shape whose matrices `matrix(rows, cols)` draws, norms one.
    fn random(
        cfg: LlamaConfig,
        matrix: &mut dyn FnMut(usize, usize) -> Matrix,
    ) -> Result<Self, ModelError> {
        cfg.validate()?;
        let (d, f) = (cfg.hidden, cfg.ffn);
        let embed = matrix(cfg.vocab, d);
        let lm_head = (!cfg.tied_embeddings).then(|| matrix(cfg.vocab, d));
        let (bias, qk_norm) = (cfg.family.qkv_bias(), cfg.family.qk_norm());
        let bias_len = cfg.q_dim() + 2 * cfg.kv_dim();
        let head_gain = || {
            if qk_norm {
                vec![1.0; cfg.head_dim]
            } else {
                Vec::new()
            }
        };
        let layers = (0..cfg.layers)
            .map(|_| LayerWeights {
                qkv_bias: if bias {
                    matrix(bias_len, 1).data
                } else {
                    Vec::new()
                },
                q_norm: head_gain(),
                k_norm: head_gain(),
                attn_norm: vec![1.0; d],
                q: matrix(cfg.q_dim(), d),
                k: matrix(cfg.kv_dim(), d),
                v: matrix(cfg.kv_dim(), d),
                o: matrix(d, cfg.q_dim()),
                ffn_norm: vec![1.0; d],
                gate: matrix(f, d),
                up: matrix(f, d),
                down: matrix(d, f),
            })
            .collect();
        Ok(Self {
            cfg,
            embed,
            layers,
            final_norm: vec![1.0; d],
            lm_head,
        })
    }

    /// The LM head: the separate one, or the tied embedding.
    pub fn lm_head(&self) -> &Matrix {
        self.lm_head.as_ref().unwrap_or(&self.embed)
    }

    /// Every linear matrix in chain order: each block's seven, the embedding, then the
    /// separate LM head, if any.
    pub fn matrices(&self) -> Vec<&Matrix> {
        let mut matrices: Vec<&Matrix> = self
            .layers
            .iter()
            .flat_map(LayerWeights::matrices)
            .collect();
        matrices.push(&self.embed);
        matrices.extend(&self.lm_head);
        matrices
    }

    /// Number of parameters in all matrices and norms.
    pub fn parameter_count(&self) -> usize {
        let per_layer = |l: &LayerWeights| {
            l.attn_norm.len()
                + l.ffn_norm.len()
                + l.qkv_bias.len()
                + l.q_norm.len()
                + l.k_norm.len()
                + l.matrices().iter().map(|m| m.data.len()).sum::<usize>()
        };
        self.embed.data.len()
            + self.lm_head.as_ref().map_or(0, |m| m.data.len())
            + self.final_norm.len()
            + self.layers.iter().map(per_layer).sum::<usize>()
    }
}

/// One random weight, uniform in ±1.7 · `scale` (`scale` is 1/√cols).
fn draw(rng: &mut ChaCha8Rng, scale: f32) -> f32 {
    rng.random_range(-1.0f32..1.0) * scale * 1.7
}

/// The small replicated parameters the leader holds itself: the norm gains, and the family's
/// biases and head norms.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LeaderWeights {
    /// RMSNorm gain before attention, per block.
    pub attn_norm: Vec<Vec<f32>>,
    /// RMSNorm gain before the feed-forward layer, per block.
    pub ffn_norm: Vec<Vec<f32>>,
    /// Final RMSNorm gain.
    pub final_norm: Vec<f32>,
    /// Query, key and value biases per block (Qwen2); empty for other families.
    #[serde(default)]
    pub qkv_bias: Vec<Vec<f32>>,
    /// Query heads' RMSNorm gain per block (Qwen3); empty for other families.
    #[serde(default)]
    pub q_norm: Vec<Vec<f32>>,
    /// Key heads' RMSNorm gain per block (Qwen3); empty for other families.
    #[serde(default)]
    pub k_norm: Vec<Vec<f32>>,
}

impl LeaderWeights {
    /// Takes the leader's parameters out of full model weights.
    pub fn from_model(w: &ModelWeights) -> Self {
        let per_layer = |f: fn(&LayerWeights) -> &Vec<f32>| -> Vec<Vec<f32>> {
            let v: Vec<Vec<f32>> = w.layers.iter().map(|l| f(l).clone()).collect();
            if v.iter().all(Vec::is_empty) {
                Vec::new()
            } else {
                v
            }
        };
        Self {
            attn_norm: w.layers.iter().map(|l| l.attn_norm.clone()).collect(),
            ffn_norm: w.layers.iter().map(|l| l.ffn_norm.clone()).collect(),
            final_norm: w.final_norm.clone(),
            qkv_bias: per_layer(|l| &l.qkv_bias),
            q_norm: per_layer(|l| &l.q_norm),
            k_norm: per_layer(|l| &l.k_norm),
        }
    }

    /// Zeros of the model's shape: the start of a gradient.
    pub fn zeros(cfg: &LlamaConfig) -> Self {
        let per_layer = |on: bool, n: usize| {
            if on {
                vec![vec![0.0; n]; cfg.layers]
            } else {
                Vec::new()
            }
        };
        let (bias, qk_norm) = (cfg.family.qkv_bias(), cfg.family.qk_norm());
        Self {
            attn_norm: vec![vec![0.0; cfg.hidden]; cfg.layers],
            ffn_norm: vec![vec![0.0; cfg.hidden]; cfg.layers],
            final_norm: vec![0.0; cfg.hidden],
            qkv_bias: per_layer(bias, cfg.q_dim() + 2 * cfg.kv_dim()),
            q_norm: per_layer(qk_norm, cfg.head_dim),
            k_norm: per_layer(qk_norm, cfg.head_dim),
        }
    }

    /// Every vector, in one fixed order: the gains block by block (attention's, then the
    /// feed-forward's), the final, then the biases and head norms.
    pub fn vectors(&self) -> impl Iterator<Item = &Vec<f32>> {
        self.attn_norm
            .iter()
            .chain(&self.ffn_norm)
            .chain(std::iter::once(&self.final_norm))
            .chain(&self.qkv_bias)
            .chain(&self.q_norm)
            .chain(&self.k_norm)
    }

    /// [`Self::vectors`], to change.
    pub fn vectors_mut(&mut self) -> impl Iterator<Item = &mut Vec<f32>> {
        self.attn_norm
            .iter_mut()
            .chain(self.ffn_norm.iter_mut())
            .chain(std::iter::once(&mut self.final_norm))
            .chain(self.qkv_bias.iter_mut())
            .chain(self.q_norm.iter_mut())
            .chain(self.k_norm.iter_mut())
    }

    /// Every value, in [`Self::vectors`]' order.
    pub fn values(&self) -> impl Iterator<Item = &f32> {
        self.vectors().flatten()
    }

    /// Whether the parameters have the model's shape.
    pub fn fits(&self, cfg: &LlamaConfig) -> bool {
        let zeros = Self::zeros(cfg);
        self.vectors().count() == zeros.vectors().count()
            && self.qkv_bias.len() == zeros.qkv_bias.len()
            && self.q_norm.len() == zeros.q_norm.len()
            && self
                .vectors()
                .zip(zeros.vectors())
                .all(|(a, b)| a.len() == b.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parallel_random_weights_are_seeded_bounded_and_drawn_from_distinct_streams() {
        // An embedding of 2.4 M values spans three of the generator's chunks.
        let cfg = LlamaConfig {
            vocab: 300_000,
            ..LlamaConfig::small()
        };
        let a = ModelWeights::synthetic_parallel(cfg.clone(), 7).unwrap();
        let again = ModelWeights::synthetic_parallel(cfg.clone(), 7).unwrap();
        assert_eq!(
            (&a.embed, &a.layers[0].down),
            (&again.embed, &again.layers[0].down)
        );
        assert_ne!(
            a.embed,
            ModelWeights::synthetic_parallel(cfg, 8).unwrap().embed
        );
        let e = &a.embed;
        assert_eq!((e.rows, e.cols), (300_000, 8));
        let bound = 1.7 / (e.cols as f32).sqrt();
        assert!(e.data.iter().all(|v| v.abs() <= bound));
        let mean = e.data.iter().map(|&v| f64::from(v)).sum::<f64>() / e.data.len() as f64;
        assert!(mean.abs() < 1e-3, "mean {mean}");
        let chunk = 1 << 20;
        assert_ne!(e.data[..16], e.data[chunk..chunk + 16]);
        let l = &a.layers[0];
        assert_ne!(l.q.data[..8], l.k.data[..8]);
        assert_eq!(a.final_norm, vec![1.0; 8]);
    }
}
