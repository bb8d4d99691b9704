//! The model's parts, as candle names them: a [`Block`] is an [`Attention`] and an [`Mlp`], each
//! behind its RMSNorm and added back to the residual stream. Their matrices are coded rows the
//! mesh holds; these types hold the leader's part (norm gains, biases, head norms) and reach the
//! rows through a [`LinearExec`]. Inference and training run the same [`Block::forward`];
//! training walks it back with [`Block::backward`].

use super::block::{
    Attend, LinearExec, Rows, Stage, add_in_place, add_rows, linear, linear_t, rms_norm, rotate,
    silu,
};
use super::{LeaderWeights, LlamaConfig, ModelError};

/// One linear stage's gradient, as factors: for matrix `m`, `δW_m = dy[m]ᵀ · x`.
#[derive(Debug, Clone, PartialEq)]
pub struct StageGrad {
    /// The stage.
    pub stage: Stage,
    /// The stage's input, `t × in`.
    pub x: Vec<f32>,
    /// Per matrix, the gradient of its output, `t × out`.
    pub dy: Vec<Vec<f32>>,
}

/// Takes each stage's gradient as the backward pass makes it: the LM head's first, a run of
/// positions at a time, then every block's, from the last.
pub trait StageSink: Send {
    /// One stage's gradient (the LM head's: some of its rows, in order).
    fn take(&mut self, g: StageGrad);
}

/// Gradients of a block's rotated queries, keys and values: `(dq, dk, dv)`.
pub(crate) type QkvGrads = (Vec<f32>, Vec<f32>, Vec<f32>);

/// Training's attention walked back: the gradients of a block's rotated queries, keys and
/// values from its output's gradient, with what its forward pass kept.
pub(crate) trait AttendBack: Attend {
    /// `(dq, dk, dv)` of block `layer` (the last block whose forward pass kept its
    /// probabilities and has not been walked back), given `dattn` (`t × q_dim`).
    fn attend_back(
        &mut self,
        layer: usize,
        acts: &AttentionActs,
        dattn: &[f32],
    ) -> Result<QkvGrads, ModelError>;
}

/// What an [`Attention`]'s forward pass computed, for the backward pass.
#[derive(Debug, Default)]
pub(crate) struct AttentionActs {
    /// Queries before their head norm (Qwen3 only, and only when kept), `t × q_dim`.
    pub q_raw: Vec<f32>,
    /// Keys before their head norm (as `q_raw`), `t × kv_dim`.
    pub k_raw: Vec<f32>,
    /// Rotated queries, `t × q_dim`.
    pub q: Vec<f32>,
    /// Rotated keys, `t × kv_dim`.
    pub k: Vec<f32>,
    /// Values, `t × kv_dim`.
    pub v: Vec<f32>,
    /// The attention output, `t × q_dim`.
    pub attn: Vec<f32>,
}

/// What an [`Mlp`]'s forward pass computed, for the backward pass.
#[derive(Debug, Default)]
pub(crate) struct MlpActs {
    /// `t × ffn`.
    pub gate: Vec<f32>,
    /// `t × ffn`.
    pub up: Vec<f32>,
    /// `silu(gate)·up`, `t × ffn`.
    pub act: Vec<f32>,
}

/// A block's activations, for the backward pass.
#[derive(Debug, Default)]
pub(crate) struct Saved {
    /// The block's input, `t × hidden`.
    pub x_in: Vec<f32>,
    /// Its attention norm, `t × hidden`.
    pub h1: Vec<f32>,
    /// The attention's.
    pub attention: AttentionActs,
    /// The stream after attention, `t × hidden`.
    pub x_mid: Vec<f32>,
    /// Its feed-forward norm, `t × hidden`.
    pub h2: Vec<f32>,
    /// The feed-forward layer's.
    pub mlp: MlpActs,
}

/// Grouped-query self-attention: the query, key and value projections (plus the family's
/// biases and head norms), RoPE, attention as an [`Attend`] does it, the output projection.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Attention<'m> {
    cfg: &'m LlamaConfig,
    layer: usize,
    /// Query, key and value biases (Qwen2).
    bias: Option<&'m [f32]>,
    /// Query and key head norms' gains (Qwen3).
    head_norms: Option<(&'m [f32], &'m [f32])>,
}

impl Attention<'_> {
    /// The output projection of the attention of `h` (`rows.t × hidden`, normed), and what it
    /// computed on the way (the raw queries and keys only when `keep`).
    async fn forward<E: LinearExec, A: Attend>(
        &self,
        exec: &mut E,
        attend: &mut A,
        rows: &Rows<'_>,
        h: &[f32],
        keep: bool,
    ) -> Result<(Vec<f32>, AttentionActs), ModelError> {
        let (cfg, t) = (self.cfg, rows.t);
        let mut a = AttentionActs::default();
        let mut qkv = linear(exec, cfg, Stage::Qkv(self.layer as u32), h, t).await?;
        a.v = qkv.pop().unwrap_or_default();
        a.k = qkv.pop().unwrap_or_default();
        a.q = qkv.pop().unwrap_or_default();
        if let Some(bias) = self.bias {
            let (qd, kvd) = (cfg.q_dim(), cfg.kv_dim());
            add_rows(&mut a.q, &bias[..qd]);
            add_rows(&mut a.k, &bias[qd..qd + kvd]);
            add_rows(&mut a.v, &bias[qd + kvd..]);
        }
        if let Some((qn, kn)) = self.head_norms {
            if keep {
                a.q_raw = a.q.clone();
                a.k_raw = a.k.clone();
            }
            a.q = normed(cfg, &a.q, qn);
            a.k = normed(cfg, &a.k, kn);
        }
        rotate(&mut a.q, cfg.heads, cfg.head_dim, rows.cos, rows.sin, 1.0);
        rotate(
            &mut a.k,
            cfg.kv_heads,
            cfg.head_dim,
            rows.cos,
            rows.sin,
            1.0,
        );
        a.attn = vec![0.0f32; t * cfg.q_dim()];
        attend.attend(self.layer, &a.q, &a.k, &a.v, &mut a.attn);
        let mut o = linear(exec, cfg, Stage::AttnOut(self.layer as u32), &a.attn, t).await?;
        Ok((o.pop().unwrap_or_default(), a))
    }

    /// The gradient of the attention's input `h` (`t × hidden`) from its output's `dy`; each
    /// projection's gradient goes to `sink` and the biases' and head norms' to `grads`.
    #[allow(
        clippy::too_many_arguments,
        reason = "the forward pass's parts, the gradient in, and the three places gradients go"
    )]
    async fn backward<E: LinearExec, A: AttendBack, S: StageSink>(
        &self,
        exec: &mut E,
        attend: &mut A,
        rows: &Rows<'_>,
        mut a: AttentionActs,
        h: Vec<f32>,
        dy: &[f32],
        sink: &mut S,
        grads: &mut LeaderWeights,
    ) -> Result<Vec<f32>, ModelError> {
        let (cfg, t, l) = (self.cfg, rows.t, self.layer);
        let (qd, kvd) = (cfg.q_dim(), cfg.kv_dim());
        let dy = vec![dy.to_vec()];
        let dattn = linear_t(exec, cfg, Stage::AttnOut(l as u32), &dy, t).await?;
        sink.take(StageGrad {
            stage: Stage::AttnOut(l as u32),
            x: std::mem::take(&mut a.attn),
            dy,
        });
        let (mut dq, mut dk, dv) = attend.attend_back(l, &a, &dattn)?;
        // RoPE is a rotation: its transpose rotates back.
        rotate(&mut dq, cfg.heads, cfg.head_dim, rows.cos, rows.sin, -1.0);
        rotate(
            &mut dk,
            cfg.kv_heads,
            cfg.head_dim,
            rows.cos,
            rows.sin,
            -1.0,
        );
        if let Some((qn, kn)) = self.head_norms {
            // Back through the head norms to the projections' outputs.
            let back = |raw: &[f32], gain: &[f32], dy: &[f32], dgain: &mut [f32]| {
                let mut dx = vec![0.0f32; dy.len()];
                rms_norm_backward(raw, gain, cfg.norm_eps, dy, &mut dx, dgain);
                dx
            };
            dq = back(&a.q_raw, qn, &dq, &mut grads.q_norm[l]);
            dk = back(&a.k_raw, kn, &dk, &mut grads.k_norm[l]);
        }
        if let Some(bias) = grads.qkv_bias.get_mut(l) {
            let (bq, rest) = bias.split_at_mut(qd);
            let (bk, bv) = rest.split_at_mut(kvd);
            for (b, dy) in [(bq, &dq), (bk, &dk), (bv, &dv)] {
                for row in dy.chunks_exact(b.len()) {
                    add_in_place(b, row);
                }
            }
        }
        let dys = vec![dq, dk, dv];
        let dh = linear_t(exec, cfg, Stage::Qkv(l as u32), &dys, t).await?;
        sink.take(StageGrad {
            stage: Stage::Qkv(l as u32),
            x: h,
            dy: dys,
        });
        Ok(dh)
    }
}

/// The SwiGLU feed-forward layer: `down(silu(gate(h))·up(h))`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Mlp<'m> {
    cfg: &'m LlamaConfig,
    layer: u32,
}

impl Mlp<'_> {
    /// The down projection of `h` (`t × hidden`, normed), and what it computed on the way.
    async fn forward<E: LinearExec>(
        &self,
        exec: &mut E,
        h: &[f32],
        t: usize,
    ) -> Result<(Vec<f32>, MlpActs), ModelError> {
        let cfg = self.cfg;
        let mut gu = linear(exec, cfg, Stage::GateUp(self.layer), h, t).await?;
        let up = gu.pop().unwrap_or_default();
        let gate = gu.pop().unwrap_or_default();
        let act: Vec<f32> = gate.iter().zip(&up).map(|(&g, &u)| silu(g) * u).collect();
        let mut down = linear(exec, cfg, Stage::Down(self.layer), &act, t).await?;
        Ok((down.pop().unwrap_or_default(), MlpActs { gate, up, act }))
    }

    /// The gradient of the layer's input `h` (`t × hidden`) from its output's `dy`, each
    /// projection's gradient to `sink`.
    async fn backward<E: LinearExec, S: StageSink>(
        &self,
        exec: &mut E,
        a: MlpActs,
        h: Vec<f32>,
        dy: &[f32],
        t: usize,
        sink: &mut S,
    ) -> Result<Vec<f32>, ModelError> {
        let cfg = self.cfg;
        let dy = vec![dy.to_vec()];
        let dact = linear_t(exec, cfg, Stage::Down(self.layer), &dy, t).await?;
        sink.take(StageGrad {
            stage: Stage::Down(self.layer),
            x: a.act,
            dy,
        });
        let mut dgate = vec![0.0f32; dact.len()];
        let mut dup = vec![0.0f32; dact.len()];
        for i in 0..dact.len() {
            let (g, u) = (a.gate[i], a.up[i]);
            let sig = 1.0 / (1.0 + (-g).exp());
            dup[i] = dact[i] * g * sig;
            dgate[i] = dact[i] * u * sig * (1.0 + g * (1.0 - sig));
        }
        let dys = vec![dgate, dup];
        let dh = linear_t(exec, cfg, Stage::GateUp(self.layer), &dys, t).await?;
        sink.take(StageGrad {
            stage: Stage::GateUp(self.layer),
            x: h,
            dy: dys,
        });
        Ok(dh)
    }
}

/// One transformer block: `x += attention(norm(x))`, then `x += mlp(norm(x))` — the steps of
/// [`super::BLOCK`], in its order.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Block<'m> {
    cfg: &'m LlamaConfig,
    layer: usize,
    /// The gain of the norm before attention.
    attn_norm: &'m [f32],
    attention: Attention<'m>,
    /// The gain of the norm before the feed-forward layer.
    ffn_norm: &'m [f32],
    mlp: Mlp<'m>,
}

impl<'m> Block<'m> {
    /// Block `layer` of a model of `cfg` whose leader's weights (checked to fit it) are `norms`.
    pub(crate) fn new(cfg: &'m LlamaConfig, norms: &'m LeaderWeights, layer: usize) -> Self {
        let head_norms = norms.q_norm.get(layer).zip(norms.k_norm.get(layer));
        Self {
            cfg,
            layer,
            attn_norm: &norms.attn_norm[layer],
            attention: Attention {
                cfg,
                layer,
                bias: norms.qkv_bias.get(layer).map(Vec::as_slice),
                head_norms: head_norms.map(|(q, k)| (q.as_slice(), k.as_slice())),
            },
            ffn_norm: &norms.ffn_norm[layer],
            mlp: Mlp {
                cfg,
                layer: layer as u32,
            },
        }
    }

    /// Runs the block on the residual stream `x` (`rows.t × hidden`), in place; its
    /// activations come back when `keep` (training's forward pass).
    pub(crate) async fn forward<E: LinearExec, A: Attend>(
        &self,
        exec: &mut E,
        attend: &mut A,
        rows: &Rows<'_>,
        x: &mut [f32],
        keep: bool,
    ) -> Result<Option<Saved>, ModelError> {
        let x_in = if keep { x.to_vec() } else { Vec::new() };
        let h1 = normed(self.cfg, x, self.attn_norm);
        let (o, attention) = self
            .attention
            .forward(exec, attend, rows, &h1, keep)
            .await?;
        add_in_place(x, &o);
        let x_mid = if keep { x.to_vec() } else { Vec::new() };
        let h2 = normed(self.cfg, x, self.ffn_norm);
        let (down, mlp) = self.mlp.forward(exec, &h2, rows.t).await?;
        add_in_place(x, &down);
        Ok(keep.then_some(Saved {
            x_in,
            h1,
            attention,
            x_mid,
            h2,
            mlp,
        }))
    }

    /// Walks the block back: `dx` (the gradient of its output, `t × hidden`) becomes its
    /// input's; each projection's gradient goes to `sink` and the norms', biases' and head
    /// norms' to `grads`.
    #[allow(
        clippy::too_many_arguments,
        reason = "the forward pass's parts, the gradient in and out, and where gradients go"
    )]
    pub(crate) async fn backward<E: LinearExec, A: AttendBack, S: StageSink>(
        &self,
        exec: &mut E,
        attend: &mut A,
        rows: &Rows<'_>,
        s: Saved,
        dx: &mut [f32],
        sink: &mut S,
        grads: &mut LeaderWeights,
    ) -> Result<(), ModelError> {
        let (cfg, t, l) = (self.cfg, rows.t, self.layer);
        let mut tmp = vec![0.0f32; dx.len()];
        let dh2 = (self.mlp).backward(exec, s.mlp, s.h2, dx, t, sink).await?;
        rms_norm_backward(
            &s.x_mid,
            self.ffn_norm,
            cfg.norm_eps,
            &dh2,
            &mut tmp,
            &mut grads.ffn_norm[l],
        );
        add_in_place(dx, &tmp);
        let dh1 = (self.attention)
            .backward(exec, attend, rows, s.attention, s.h1, dx, sink, grads)
            .await?;
        rms_norm_backward(
            &s.x_in,
            self.attn_norm,
            cfg.norm_eps,
            &dh1,
            &mut tmp,
            &mut grads.attn_norm[l],
        );
        add_in_place(dx, &tmp);
        Ok(())
    }
}

/// `rms_norm(x, gain)` into a new vector.
pub(crate) fn normed(cfg: &LlamaConfig, x: &[f32], gain: &[f32]) -> Vec<f32> {
    let mut h = vec![0.0f32; x.len()];
    rms_norm(x, gain, cfg.norm_eps, &mut h);
    h
}

/// `dx` and `dgain` of `y = rms_norm(x, gain)` given `dy`, row by row (`dgain` added to).
pub(crate) fn rms_norm_backward(
    x: &[f32],
    gain: &[f32],
    eps: f32,
    dy: &[f32],
    dx: &mut [f32],
    dgain: &mut [f32],
) {
    let d = gain.len();
    for ((row, g_out), dx_row) in x
        .chunks_exact(d)
        .zip(dy.chunks_exact(d))
        .zip(dx.chunks_exact_mut(d))
    {
        let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / d as f64;
        let r = 1.0 / (ms + eps as f64).sqrt();
        let mut dot = 0.0f64;
        for i in 0..d {
            let a = g_out[i] as f64 * gain[i] as f64;
            dot += a * row[i] as f64;
            dgain[i] += (g_out[i] as f64 * row[i] as f64 * r) as f32;
        }
        let c = r * r * r * dot / d as f64;
        for i in 0..d {
            let a = g_out[i] as f64 * gain[i] as f64;
            dx_row[i] = (r * a - c * row[i] as f64) as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{BLOCK, BlockStep, PassStep};

    /// Records what a block asks of the mesh and of its attention, in order, answering zeros.
    struct Recording<'c> {
        cfg: &'c LlamaConfig,
        asked: Vec<String>,
    }

    impl LinearExec for Recording<'_> {
        async fn linear(
            &mut self,
            stage: Stage,
            _: &[f32],
            t: usize,
        ) -> Result<Vec<Vec<f32>>, ModelError> {
            self.asked.push(format!("{stage:?}"));
            Ok((stage.shapes(self.cfg).iter())
                .map(|&(out, _)| vec![0.0; t * out])
                .collect())
        }

        async fn linear_t(
            &mut self,
            stage: Stage,
            _: &[Vec<f32>],
            t: usize,
        ) -> Result<Vec<f32>, ModelError> {
            self.asked.push(format!("{stage:?}ᵀ"));
            Ok(vec![0.0; t * stage.shapes(self.cfg)[0].1])
        }

        async fn embed(&mut self, _: &[u32]) -> Result<Vec<f32>, ModelError> {
            unreachable!("a block embeds nothing")
        }
    }

    impl Attend for Vec<String> {
        fn attend(&mut self, layer: usize, _: &[f32], _: &[f32], _: &[f32], _: &mut [f32]) {
            self.push(format!("Attend({layer})"));
        }
    }

    impl AttendBack for Vec<String> {
        fn attend_back(
            &mut self,
            _: usize,
            a: &AttentionActs,
            _: &[f32],
        ) -> Result<QkvGrads, ModelError> {
            Ok((
                vec![0.0; a.q.len()],
                vec![0.0; a.k.len()],
                vec![0.0; a.v.len()],
            ))
        }
    }

    /// Takes gradients and keeps none.
    struct Discard;

    impl StageSink for Discard {
        fn take(&mut self, _: StageGrad) {}
    }

    #[test]
    fn a_block_takes_the_steps_block_lists_in_its_order() {
        let cfg = LlamaConfig::small();
        let norms = LeaderWeights::zeros(&cfg);
        let t = 3;
        let (cos, sin) = (
            vec![1.0; t * cfg.head_dim / 2],
            vec![0.0; t * cfg.head_dim / 2],
        );
        let rows = Rows {
            t,
            cos: &cos,
            sin: &sin,
        };
        let mut exec = Recording {
            cfg: &cfg,
            asked: Vec::new(),
        };
        let mut attended = Vec::new();
        let mut x = vec![1.0; t * cfg.hidden];
        let block = Block::new(&cfg, &norms, 0);
        let saved = futures::executor::block_on(block.forward(
            &mut exec,
            &mut attended,
            &rows,
            &mut x,
            true,
        ))
        .unwrap();
        // The stages asked of the mesh, with attention where it came between them.
        let mut asked = exec.asked.clone();
        let at = asked.iter().position(|s| s == "AttnOut(0)").unwrap();
        asked.splice(at..at, attended);
        let listed: Vec<String> = (BLOCK.iter())
            .filter_map(|&step| match step {
                BlockStep::Attend => Some("Attend(0)".to_string()),
                _ => PassStep::Block(0, step).stage().map(|s| format!("{s:?}")),
            })
            .collect();
        assert_eq!(asked, listed);
        // Zero stages add nothing to the stream; walking back asks for every stage's transpose,
        // last first.
        assert!(x.iter().all(|&v| v == 1.0));
        exec.asked.clear();
        let mut grads = LeaderWeights::zeros(&cfg);
        let mut dx = vec![0.5; t * cfg.hidden];
        futures::executor::block_on(block.backward(
            &mut exec,
            &mut Vec::new(),
            &rows,
            saved.unwrap(),
            &mut dx,
            &mut Discard,
            &mut grads,
        ))
        .unwrap();
        assert_eq!(
            exec.asked,
            ["Down(0)ᵀ", "GateUp(0)ᵀ", "AttnOut(0)ᵀ", "Qkv(0)ᵀ"]
        );
    }
}
