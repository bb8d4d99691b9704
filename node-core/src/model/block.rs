//! What one block of the model does, said once ([`BLOCK`]), with its stages ([`Stage`]) and the
//! leader's arithmetic between them (RMSNorm, RoPE, SwiGLU). The model's and training's forward
//! pass (`model/layers.rs`'s `Block`) and the GPU whole token's plan (`coded/gpu/token.rs`,
//! through [`pass_steps`]) take these steps; they differ only in how a block's rows attend
//! ([`Attend`]).

use serde::{Deserialize, Serialize};

use super::{LlamaConfig, ModelError};

/// One linear round of the model: the matrices that share one input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Stage {
    /// Query, key and value projections of a block.
    Qkv(u32),
    /// Attention output projection of a block.
    AttnOut(u32),
    /// SwiGLU gate and up projections of a block.
    GateUp(u32),
    /// SwiGLU down projection of a block.
    Down(u32),
    /// The LM head (the tied embedding when tied).
    LmHead,
}

impl Stage {
    /// Every stage of a model, in forward order (the embedding lookup is not a stage).
    pub fn all(cfg: &LlamaConfig) -> Vec<Stage> {
        let mut v = Vec::with_capacity(4 * cfg.layers + 1);
        for l in 0..cfg.layers as u32 {
            v.extend([
                Stage::Qkv(l),
                Stage::AttnOut(l),
                Stage::GateUp(l),
                Stage::Down(l),
            ]);
        }
        v.push(Stage::LmHead);
        v
    }

    /// `(out, in)` of each matrix of the stage, in order.
    pub fn shapes(&self, cfg: &LlamaConfig) -> Vec<(usize, usize)> {
        let (d, f) = (cfg.hidden, cfg.ffn);
        match self {
            Stage::Qkv(_) => vec![(cfg.q_dim(), d), (cfg.kv_dim(), d), (cfg.kv_dim(), d)],
            Stage::AttnOut(_) => vec![(d, cfg.q_dim())],
            Stage::GateUp(_) => vec![(f, d), (f, d)],
            Stage::Down(_) => vec![(d, f)],
            Stage::LmHead => vec![(cfg.vocab, d)],
        }
    }

    /// The block this stage belongs to, if any.
    pub fn layer(&self) -> Option<usize> {
        match *self {
            Stage::Qkv(l) | Stage::AttnOut(l) | Stage::GateUp(l) | Stage::Down(l) => {
                Some(l as usize)
            }
            Stage::LmHead => None,
        }
    }

    /// Indices of this stage's matrices among a block's seven (q, k, v, o, gate, up, down).
    pub(crate) fn block_matrices(&self) -> &'static [usize] {
        match self {
            Stage::Qkv(_) => &[0, 1, 2],
            Stage::AttnOut(_) => &[3],
            Stage::GateUp(_) => &[4, 5],
            Stage::Down(_) => &[6],
            Stage::LmHead => &[],
        }
    }
}

/// Computes the model's linear stages: a coded group (whose rounds may wait on the network),
/// or a single uncoded member.
#[allow(
    async_fn_in_trait,
    reason = "the browser leader's futures are !Send by nature; native callers name the concrete type"
)]
pub trait LinearExec {
    /// For each matrix of `stage`, `y = x · Wᵀ` with `x` of `t` rows; returns one `t × out` per matrix.
    async fn linear(
        &mut self,
        stage: Stage,
        x: &[f32],
        t: usize,
    ) -> Result<Vec<Vec<f32>>, ModelError>;
    /// For a stage, `Σ_matrix dy_matrix · W_matrix` with one `t × out` gradient per matrix:
    /// the gradient of the stage's shared input (`t × in`), for the backward pass.
    async fn linear_t(
        &mut self,
        stage: Stage,
        dy: &[Vec<f32>],
        t: usize,
    ) -> Result<Vec<f32>, ModelError>;
    /// The embedding rows of `tokens`, `tokens.len() × hidden`.
    async fn embed(&mut self, tokens: &[u32]) -> Result<Vec<f32>, ModelError>;
}

/// One step of a block, in [`BLOCK`]'s order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockStep {
    /// `h = rms_norm(x, attn_norm)`.
    AttnNorm,
    /// `q, k, v = h·Wᵀ` ([`Stage::Qkv`]), plus the family's biases, then its head norms.
    Qkv,
    /// RoPE on `q` and `k`, each row at its own position.
    Rope,
    /// Causal attention of each row over its sequence so far: `attn`.
    Attend,
    /// `o = attn·Wᵀ` ([`Stage::AttnOut`]).
    AttnOut,
    /// `x += o`.
    AttnResidual,
    /// `h = rms_norm(x, ffn_norm)`.
    FfnNorm,
    /// `gate, up = h·Wᵀ` ([`Stage::GateUp`]).
    GateUp,
    /// `act = silu(gate)·up`.
    SwiGlu,
    /// `down = act·Wᵀ` ([`Stage::Down`]).
    Down,
    /// `x += down`.
    FfnResidual,
}

/// What every block does, in order (the steps `model/layers.rs`'s `Block::forward` takes).
pub const BLOCK: [BlockStep; 11] = [
    BlockStep::AttnNorm,
    BlockStep::Qkv,
    BlockStep::Rope,
    BlockStep::Attend,
    BlockStep::AttnOut,
    BlockStep::AttnResidual,
    BlockStep::FfnNorm,
    BlockStep::GateUp,
    BlockStep::SwiGlu,
    BlockStep::Down,
    BlockStep::FfnResidual,
];

/// One step of the whole forward pass: a block's, or the head's after the last block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PassStep {
    /// Step `.1` of block `.0`.
    Block(usize, BlockStep),
    /// `h = rms_norm(x, final_norm)`.
    FinalNorm,
    /// `logits = h·Wᵀ` ([`Stage::LmHead`]).
    LmHead,
}

impl PassStep {
    /// The linear stage this step computes, if it is one.
    pub fn stage(self) -> Option<Stage> {
        let (l, step) = match self {
            PassStep::Block(l, step) => (l as u32, step),
            PassStep::FinalNorm => return None,
            PassStep::LmHead => return Some(Stage::LmHead),
        };
        match step {
            BlockStep::Qkv => Some(Stage::Qkv(l)),
            BlockStep::AttnOut => Some(Stage::AttnOut(l)),
            BlockStep::GateUp => Some(Stage::GateUp(l)),
            BlockStep::Down => Some(Stage::Down(l)),
            _ => None,
        }
    }
}

/// The model's forward pass, step by step: every block's [`BLOCK`], then the head.
pub fn pass_steps(cfg: &LlamaConfig) -> Vec<PassStep> {
    (0..cfg.layers)
        .flat_map(|l| BLOCK.map(|step| PassStep::Block(l, step)))
        .chain([PassStep::FinalNorm, PassStep::LmHead])
        .collect()
}

/// How a block's rows attend: the model's over its sequences' KV caches, training's within
/// each sequence (keeping the probabilities for the backward pass).
pub(crate) trait Attend {
    /// Writes block `layer`'s attention output for the rotated rows `q`, `k`, `v` into `out`
    /// (`t × q_dim`, zeroed).
    fn attend(&mut self, layer: usize, q: &[f32], k: &[f32], v: &[f32], out: &mut [f32]);
}

/// Rows of a block's pass: how many, and RoPE's `cos` and `sin` for each row's position.
pub(crate) struct Rows<'a> {
    /// Rows of the residual stream.
    pub t: usize,
    /// `t × head_dim/2` each.
    pub cos: &'a [f32],
    /// As `cos`.
    pub sin: &'a [f32],
}

/// Bytes of one block stage's outputs (f32, every matrix of the stage) a round may reach: more
/// rows run in several rounds (and a served batch in several passes, each over the keys and
/// values of those before), so what a node holds for a step follows this and not the prompt.
const PASS_BYTES: usize = 8 << 20;

/// Rows one round (and one pass of a served batch) carries for a model of `cfg`:
/// [`PASS_BYTES`] of its widest block stage's outputs, 16 to 512.
pub fn pass_rows(cfg: &LlamaConfig) -> usize {
    let widest = Stage::all(cfg)
        .iter()
        .filter(|s| s.layer().is_some())
        .map(|s| s.shapes(cfg).iter().map(|&(out, _)| out).sum::<usize>())
        .max()
        .unwrap_or(1);
    (PASS_BYTES / (4 * widest).max(1)).clamp(16, 512)
}

/// `stage` of `x` (`t` rows) through `exec`, [`pass_rows`] rows a round, its outputs checked
/// against the model's shapes.
pub(crate) async fn linear<E: LinearExec>(
    exec: &mut E,
    cfg: &LlamaConfig,
    stage: Stage,
    x: &[f32],
    t: usize,
) -> Result<Vec<Vec<f32>>, ModelError> {
    let rows = pass_rows(cfg);
    if t <= rows {
        let out = exec.linear(stage, x, t).await?;
        check_outputs(&out, stage, cfg, t)?;
        return Ok(out);
    }
    let shapes = stage.shapes(cfg);
    let inp = shapes.first().map_or(0, |&(_, i)| i);
    if x.len() != t * inp {
        return Err(wrong_shape(stage, "input"));
    }
    let mut outs: Vec<Vec<f32>> = shapes
        .iter()
        .map(|&(out, _)| Vec::with_capacity(t * out))
        .collect();
    for first in (0..t).step_by(rows) {
        let n = rows.min(t - first);
        let piece = exec
            .linear(stage, &x[first * inp..(first + n) * inp], n)
            .await?;
        check_outputs(&piece, stage, cfg, n)?;
        for (o, p) in outs.iter_mut().zip(piece) {
            o.extend_from_slice(&p);
        }
    }
    Ok(outs)
}

/// `Σ_matrix dy_matrix · W_matrix` of `stage` (`t` rows) through `exec`, [`pass_rows`] rows a
/// round.
pub(crate) async fn linear_t<E: LinearExec>(
    exec: &mut E,
    cfg: &LlamaConfig,
    stage: Stage,
    dy: &[Vec<f32>],
    t: usize,
) -> Result<Vec<f32>, ModelError> {
    let rows = pass_rows(cfg);
    let shapes = stage.shapes(cfg);
    let inp = shapes.first().map_or(0, |&(_, i)| i);
    if dy.len() != shapes.len() || dy.iter().zip(&shapes).any(|(d, &(o, _))| d.len() != t * o) {
        return Err(wrong_shape(stage, "gradient"));
    }
    let checked = |got: Vec<f32>, n: usize| {
        if got.len() == n * inp {
            Ok(got)
        } else {
            Err(wrong_shape(stage, "transposed output"))
        }
    };
    if t <= rows {
        return checked(exec.linear_t(stage, dy, t).await?, t);
    }
    let mut dx = Vec::with_capacity(t * inp);
    for first in (0..t).step_by(rows) {
        let n = rows.min(t - first);
        let piece: Vec<Vec<f32>> = dy
            .iter()
            .zip(&shapes)
            .map(|(d, &(o, _))| d[first * o..(first + n) * o].to_vec())
            .collect();
        dx.extend_from_slice(&checked(exec.linear_t(stage, &piece, n).await?, n)?);
    }
    Ok(dx)
}

fn wrong_shape(stage: Stage, what: &str) -> ModelError {
    ModelError::Exec {
        stage,
        message: format!("wrong {what} shape"),
    }
}

/// Checks that a stage returned one `t × out` output per matrix.
pub(crate) fn check_outputs(
    outputs: &[Vec<f32>],
    stage: Stage,
    cfg: &LlamaConfig,
    t: usize,
) -> Result<(), ModelError> {
    let shapes = stage.shapes(cfg);
    let ok = outputs.len() == shapes.len()
        && outputs
            .iter()
            .zip(&shapes)
            .all(|(o, &(out, _))| o.len() == t * out);
    if ok {
        Ok(())
    } else {
        Err(wrong_shape(stage, "output"))
    }
}

/// `out = x / rms(x) · gain`, row by row.
pub(crate) fn rms_norm(x: &[f32], gain: &[f32], eps: f32, out: &mut [f32]) {
    let d = gain.len();
    for (row, o) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let ms = row.iter().map(|&v| (v as f64) * (v as f64)).sum::<f64>() / d as f64;
        let inv = (1.0 / (ms + eps as f64).sqrt()) as f32;
        for ((o, &v), &g) in o.iter_mut().zip(row).zip(gain) {
            *o = v * inv * g;
        }
    }
}

/// cos and sin of each (position, pair) for positions `start..start + t`.
pub(crate) fn rope_table(inv_freq: &[f64], start: usize, t: usize) -> (Vec<f32>, Vec<f32>) {
    let half = inv_freq.len();
    let mut cos = Vec::with_capacity(t * half);
    let mut sin = Vec::with_capacity(t * half);
    for p in start..start + t {
        for &f in inv_freq {
            let angle = p as f64 * f;
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    (cos, sin)
}

/// Rotates adjacent pairs `(2i, 2i+1)` of each head (GGML's normal RoPE layout) by the
/// position's angle; `direction` −1 rotates back (the transpose, for gradients).
pub(crate) fn rotate(
    x: &mut [f32],
    heads: usize,
    hd: usize,
    cos: &[f32],
    sin: &[f32],
    direction: f32,
) {
    let half = hd / 2;
    let width = heads * hd;
    for (pos, row) in x.chunks_exact_mut(width).enumerate() {
        let (c, s) = (
            &cos[pos * half..(pos + 1) * half],
            &sin[pos * half..(pos + 1) * half],
        );
        for head in row.chunks_exact_mut(hd) {
            for (i, pair) in head.as_chunks_mut::<2>().0.iter_mut().enumerate() {
                let (a, b) = (pair[0], pair[1]);
                let sn = direction * s[i];
                pair[0] = a * c[i] - b * sn;
                pair[1] = a * sn + b * c[i];
            }
        }
    }
}

pub(crate) fn softmax(v: &mut [f32]) {
    let max = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f32;
    for x in v.iter_mut() {
        *x = (*x - max).exp();
        sum += *x;
    }
    let inv = 1.0 / sum;
    for x in v.iter_mut() {
        *x *= inv;
    }
}

pub(crate) fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Adds `bias` to every row of `x`.
pub(crate) fn add_rows(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len()) {
        add_in_place(row, bias);
    }
}

pub(crate) fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A dense exec with weights `W_m[r][c] = sin(r + 3c + 7m)`, the most rows it was asked for
    /// at once, and its rounds.
    struct Dense<'c> {
        cfg: &'c LlamaConfig,
        most: usize,
        rounds: usize,
    }

    fn weight(m: usize, r: usize, c: usize) -> f32 {
        ((r + 3 * c + 7 * m) as f32).sin()
    }

    impl LinearExec for Dense<'_> {
        async fn linear(
            &mut self,
            stage: Stage,
            x: &[f32],
            t: usize,
        ) -> Result<Vec<Vec<f32>>, ModelError> {
            (self.most, self.rounds) = (self.most.max(t), self.rounds + 1);
            Ok((stage.shapes(self.cfg).iter().enumerate())
                .map(|(m, &(out, inp))| {
                    (0..t * out)
                        .map(|i| {
                            (0..inp)
                                .map(|c| weight(m, i % out, c) * x[i / out * inp + c])
                                .sum()
                        })
                        .collect()
                })
                .collect())
        }

        async fn linear_t(
            &mut self,
            stage: Stage,
            dy: &[Vec<f32>],
            t: usize,
        ) -> Result<Vec<f32>, ModelError> {
            (self.most, self.rounds) = (self.most.max(t), self.rounds + 1);
            let shapes = stage.shapes(self.cfg);
            let inp = shapes[0].1;
            Ok((0..t * inp)
                .map(|i| {
                    (shapes.iter().enumerate())
                        .map(|(m, &(out, _))| {
                            (0..out)
                                .map(|r| dy[m][i / inp * out + r] * weight(m, r, i % inp))
                                .sum::<f32>()
                        })
                        .sum()
                })
                .collect())
        }

        async fn embed(&mut self, _: &[u32]) -> Result<Vec<f32>, ModelError> {
            unreachable!("not a stage")
        }
    }

    #[test]
    fn rows_beyond_a_pass_run_in_rounds_of_pass_rows_with_the_same_products() {
        // A wide feed-forward brings a round down to 64 rows.
        let cfg = LlamaConfig {
            hidden: 8,
            ffn: 16384,
            ..LlamaConfig::small()
        };
        assert_eq!(pass_rows(&cfg), 64);
        let t = 150;
        let stage = Stage::AttnOut(0);
        let (out, inp) = stage.shapes(&cfg)[0];
        let x: Vec<f32> = (0..t * inp).map(|i| (i as f32 * 0.37).cos()).collect();
        let dy = vec![
            (0..t * out)
                .map(|i| (i as f32 * 0.11).sin())
                .collect::<Vec<f32>>(),
        ];
        let mut whole = Dense {
            cfg: &cfg,
            most: 0,
            rounds: 0,
        };
        let want = futures::executor::block_on(whole.linear(stage, &x, t)).unwrap();
        let want_t = futures::executor::block_on(whole.linear_t(stage, &dy, t)).unwrap();
        let mut split = Dense {
            cfg: &cfg,
            most: 0,
            rounds: 0,
        };
        let got = futures::executor::block_on(linear(&mut split, &cfg, stage, &x, t)).unwrap();
        let got_t = futures::executor::block_on(linear_t(&mut split, &cfg, stage, &dy, t)).unwrap();
        assert_eq!(
            (split.most, split.rounds),
            (64, 6),
            "150 rows: 64, 64 and 22, twice"
        );
        assert_eq!(got, want);
        assert_eq!(got_t, want_t);
        // A gradient of the wrong length is an error, not a panic.
        let short = vec![dy[0][..out].to_vec()];
        assert!(futures::executor::block_on(linear_t(&mut split, &cfg, stage, &short, t)).is_err());
    }

    #[test]
    fn the_pass_is_every_block_then_the_head_with_a_stage_per_linear_step() {
        let cfg = LlamaConfig::small();
        let steps = pass_steps(&cfg);
        assert_eq!(steps.len(), cfg.layers * BLOCK.len() + 2);
        let stages: Vec<Stage> = steps.iter().filter_map(|s| s.stage()).collect();
        assert_eq!(
            stages,
            Stage::all(&cfg),
            "the linear steps are the model's stages"
        );
    }
}
