//! The leader's backward pass: next-token cross-entropy over a sequence, with every linear
//! layer's input gradient computed through the [`LinearExec`] (coded transpose steps) and every
//! weight gradient kept as factors `δW = dYᵀ·X` (DESIGN.md §1), never as full matrices.

use super::block::{Attend, Rows, Stage, linear, rms_norm, rope_table, rotate, run_block, softmax};
use super::{LeaderWeights, LinearExec, Llama, ModelError};

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

/// The gradient of the mean loss on one sequence, or on a batch of them (rows stacked).
#[derive(Debug, Clone, PartialEq)]
pub struct Gradients {
    /// Mean next-token cross-entropy (nats per predicted token).
    pub loss: f64,
    /// Positions `t` of the sequence.
    pub t: usize,
    /// Linear stages, in forward order; the LM head (the tied embedding when tied) last.
    pub stages: Vec<StageGrad>,
    /// Gradient of the embedding lookup: row `tokens[i]` of the embedding gets `embed_dx[i]`.
    pub embed_dx: Vec<f32>,
    /// The sequence's tokens (a batch's, one sequence after another).
    pub tokens: Vec<u32>,
    /// Gradients of the norm gains (replicated on every node).
    pub norms: LeaderWeights,
    /// Sequences the gradient is the mean over (1 for one request).
    pub sequences: usize,
}

/// `dx` and `dgain` of `y = rms_norm(x, gain)` given `dy`, row by row.
fn rms_norm_backward(
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

impl Llama {
    /// Mean next-token cross-entropy of `tokens` and its gradient (`tokens.len() ≥ 2`).
    pub async fn gradients<E: LinearExec>(
        &self,
        exec: &mut E,
        tokens: &[u32],
    ) -> Result<Gradients, ModelError> {
        self.gradients_batch(exec, &[tokens]).await
    }

    /// The minibatch gradient of independent sequences: the mean next-token cross-entropy over
    /// every predicted position of every sequence, all rows through one round per stage.
    pub async fn gradients_batch<E: LinearExec>(
        &self,
        exec: &mut E,
        seqs: &[&[u32]],
    ) -> Result<Gradients, ModelError> {
        self.loss_and_gradients(exec, seqs, true)
            .await?
            .1
            .ok_or_else(|| ModelError::Config("no gradients computed".into()))
    }

    /// Mean next-token cross-entropy of `tokens` (nats per predicted token), forward only.
    pub async fn sequence_loss<E: LinearExec>(
        &self,
        exec: &mut E,
        tokens: &[u32],
    ) -> Result<f64, ModelError> {
        Ok(self.loss_and_gradients(exec, &[tokens], false).await?.0)
    }

    async fn loss_and_gradients<E: LinearExec>(
        &self,
        exec: &mut E,
        seqs: &[&[u32]],
        backward: bool,
    ) -> Result<(f64, Option<Gradients>), ModelError> {
        let cfg = self.config().clone();
        if seqs.is_empty() {
            return Err(ModelError::Config(
                "training needs at least one sequence".into(),
            ));
        }
        for tokens in seqs {
            if tokens.len() < 2 {
                return Err(ModelError::Config(
                    "training needs at least two tokens per sequence".into(),
                ));
            }
            if tokens.len() > cfg.max_seq {
                return Err(ModelError::ContextFull {
                    len: tokens.len(),
                    max: cfg.max_seq,
                });
            }
            if let Some(&id) = tokens.iter().find(|&&id| id as usize >= cfg.vocab) {
                return Err(ModelError::TokenOutOfRange {
                    id,
                    vocab: cfg.vocab,
                });
            }
        }
        let (d, qd, kvd) = (cfg.hidden, cfg.q_dim(), cfg.kv_dim());
        let norms = self.norms();
        // Rows of every sequence, stacked; each sequence's positions start at 0.
        let tokens: Vec<u32> = seqs.iter().flat_map(|s| s.iter().copied()).collect();
        let t = tokens.len();
        let spans: Vec<(usize, usize)> = seqs
            .iter()
            .scan(0, |row, s| {
                let span = (*row, s.len());
                *row += s.len();
                Some(span)
            })
            .collect();
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for s in seqs {
            let (c, sn) = rope_table(self.inv_freq(), 0, s.len());
            cos.extend(c);
            sin.extend(sn);
        }
        // Forward, keeping what the backward pass needs.
        let mut x = exec.embed(&tokens).await?;
        if x.len() != t * d {
            return Err(ModelError::Config(
                "the embedding returned the wrong shape".into(),
            ));
        }
        let rows = Rows {
            t,
            cos: &cos,
            sin: &sin,
        };
        let mut within = WithinSequences {
            cfg: &cfg,
            spans: &spans,
            probs: Vec::with_capacity(cfg.layers),
        };
        let mut saved = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            let kept = run_block(&cfg, norms, l, exec, &mut within, &rows, &mut x, true).await?;
            saved
                .push(kept.ok_or_else(|| ModelError::Config("lost a block's activations".into()))?);
        }
        let mut probs = within.probs;
        let mut hf = vec![0.0f32; t * d];
        rms_norm(&x, &norms.final_norm, cfg.norm_eps, &mut hf);
        let logits = linear(exec, &cfg, Stage::LmHead, &hf, t)
            .await?
            .pop()
            .unwrap_or_default();

        // Loss and its gradient on the logits: every position but each sequence's last
        // predicts the next token of its sequence.
        let v_n = cfg.vocab;
        let predicted: f64 = spans.iter().map(|&(_, ti)| (ti - 1) as f64).sum();
        let mut dlogits = vec![0.0f32; t * v_n];
        let mut loss = 0.0f64;
        for &(start, ti) in &spans {
            for i in start..start + ti - 1 {
                let row = &logits[i * v_n..(i + 1) * v_n];
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
                let sum: f64 = row.iter().map(|&z| (z as f64 - max).exp()).sum();
                let target = tokens[i + 1] as usize;
                loss += sum.ln() + max - row[target] as f64;
                let drow = &mut dlogits[i * v_n..(i + 1) * v_n];
                for (dz, &z) in drow.iter_mut().zip(row) {
                    *dz = (((z as f64 - max).exp() / sum) / predicted) as f32;
                }
                drow[target] -= (1.0 / predicted) as f32;
            }
        }
        loss /= predicted;
        if !backward {
            return Ok((loss, None));
        }

        // Backward.
        let mut grads = LeaderWeights::zeros(&cfg);
        let mut stages = Vec::with_capacity(4 * cfg.layers + 1);
        let dhf = exec
            .linear_t(Stage::LmHead, std::slice::from_ref(&dlogits), t)
            .await?;
        stages.push(StageGrad {
            stage: Stage::LmHead,
            x: hf,
            dy: vec![dlogits],
        });
        let mut dx = vec![0.0f32; t * d];
        rms_norm_backward(
            &x,
            &norms.final_norm,
            cfg.norm_eps,
            &dhf,
            &mut dx,
            &mut grads.final_norm,
        );
        let mut tmp = vec![0.0f32; t * d];
        for l in (0..cfg.layers).rev() {
            let layer = l as u32;
            let (s, layer_probs) = saved
                .pop()
                .zip(probs.pop())
                .ok_or_else(|| ModelError::Config("lost a block's activations".into()))?;
            // Down projection.
            let dact = exec
                .linear_t(Stage::Down(layer), std::slice::from_ref(&dx), t)
                .await?;
            stages.push(StageGrad {
                stage: Stage::Down(layer),
                x: s.act,
                dy: vec![dx.clone()],
            });
            // SwiGLU.
            let mut dgate = vec![0.0f32; dact.len()];
            let mut dup = vec![0.0f32; dact.len()];
            for i in 0..dact.len() {
                let (g, u) = (s.gate[i], s.up[i]);
                let sig = 1.0 / (1.0 + (-g).exp());
                dup[i] = dact[i] * g * sig;
                dgate[i] = dact[i] * u * sig * (1.0 + g * (1.0 - sig));
            }
            let dys = vec![dgate, dup];
            let dh2 = exec.linear_t(Stage::GateUp(layer), &dys, t).await?;
            stages.push(StageGrad {
                stage: Stage::GateUp(layer),
                x: s.h2,
                dy: dys,
            });
            rms_norm_backward(
                &s.x_mid,
                &norms.ffn_norm[l],
                cfg.norm_eps,
                &dh2,
                &mut tmp,
                &mut grads.ffn_norm[l],
            );
            dx.iter_mut().zip(&tmp).for_each(|(a, &b)| *a += b);
            // Attention output projection.
            let dattn = exec
                .linear_t(Stage::AttnOut(layer), std::slice::from_ref(&dx), t)
                .await?;
            stages.push(StageGrad {
                stage: Stage::AttnOut(layer),
                x: s.attn,
                dy: vec![dx.clone()],
            });
            // Attention, within each sequence.
            let mut dq = vec![0.0f32; t * qd];
            let mut dk = vec![0.0f32; t * kvd];
            let mut dv = vec![0.0f32; t * kvd];
            let mut p_at = 0;
            for &(row, ti) in &spans {
                let p_len = ti * cfg.heads * ti;
                let (q, kv) = (row * qd..(row + ti) * qd, row * kvd..(row + ti) * kvd);
                attention_backward(
                    &cfg,
                    AttentionSaved {
                        q: &s.q[q.clone()],
                        k: &s.k[kv.clone()],
                        v: &s.v[kv.clone()],
                        probs: &layer_probs[p_at..p_at + p_len],
                    },
                    &dattn[q.clone()],
                    ti,
                    AttentionGrads {
                        dq: &mut dq[q],
                        dk: &mut dk[kv.clone()],
                        dv: &mut dv[kv],
                    },
                );
                p_at += p_len;
            }
            // RoPE is a rotation: its transpose rotates back.
            rotate(&mut dq, cfg.heads, cfg.head_dim, &cos, &sin, -1.0);
            rotate(&mut dk, cfg.kv_heads, cfg.head_dim, &cos, &sin, -1.0);
            if let (Some(qn), Some(kn)) = (norms.q_norm.get(l), norms.k_norm.get(l)) {
                // Back through the head norms to the projections' outputs.
                let back = |raw: &[f32], gain: &[f32], dy: &[f32], dgain: &mut [f32]| {
                    let mut dx = vec![0.0f32; dy.len()];
                    rms_norm_backward(raw, gain, cfg.norm_eps, dy, &mut dx, dgain);
                    dx
                };
                dq = back(&s.q_raw, qn, &dq, &mut grads.q_norm[l]);
                dk = back(&s.k_raw, kn, &dk, &mut grads.k_norm[l]);
            }
            if let Some(bias) = grads.qkv_bias.get_mut(l) {
                let (bq, rest) = bias.split_at_mut(qd);
                let (bk, bv) = rest.split_at_mut(kvd);
                for (b, dy) in [(bq, &dq), (bk, &dk), (bv, &dv)] {
                    for row in dy.chunks_exact(b.len()) {
                        b.iter_mut().zip(row).for_each(|(g, &v)| *g += v);
                    }
                }
            }
            let dys = vec![dq, dk, dv];
            let dh1 = exec.linear_t(Stage::Qkv(layer), &dys, t).await?;
            stages.push(StageGrad {
                stage: Stage::Qkv(layer),
                x: s.h1,
                dy: dys,
            });
            rms_norm_backward(
                &s.x_in,
                &norms.attn_norm[l],
                cfg.norm_eps,
                &dh1,
                &mut tmp,
                &mut grads.attn_norm[l],
            );
            dx.iter_mut().zip(&tmp).for_each(|(a, &b)| *a += b);
            drop(s.x_in);
        }
        stages.reverse();
        let grads = Gradients {
            loss,
            t,
            stages,
            embed_dx: dx,
            tokens,
            norms: grads,
            sequences: seqs.len(),
        };
        Ok((loss, Some(grads)))
    }
}

/// Training's attention: each sequence's rows over its own rows (no cache), the probabilities
/// of every block kept for the backward pass.
struct WithinSequences<'a> {
    cfg: &'a super::LlamaConfig,
    /// Each sequence's first row and rows.
    spans: &'a [(usize, usize)],
    /// Per block, each sequence's probabilities (`ti × heads × ti`), one after another.
    probs: Vec<Vec<f32>>,
}

impl Attend for WithinSequences<'_> {
    fn attend(&mut self, _layer: usize, q: &[f32], k: &[f32], v: &[f32], out: &mut [f32]) {
        let cfg = self.cfg;
        let (qd, kvd) = (cfg.q_dim(), cfg.kv_dim());
        let len: usize = self.spans.iter().map(|&(_, ti)| ti * cfg.heads * ti).sum();
        let mut probs = vec![0.0f32; len];
        let mut p_at = 0;
        for &(row, ti) in self.spans {
            let p_len = ti * cfg.heads * ti;
            attention_forward(
                cfg,
                &q[row * qd..(row + ti) * qd],
                &k[row * kvd..(row + ti) * kvd],
                &v[row * kvd..(row + ti) * kvd],
                ti,
                &mut probs[p_at..p_at + p_len],
                &mut out[row * qd..(row + ti) * qd],
            );
            p_at += p_len;
        }
        self.probs.push(probs);
    }
}

/// What the backward pass of one sequence's attention reads.
struct AttentionSaved<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    probs: &'a [f32],
}

/// Where it adds its gradients.
struct AttentionGrads<'a> {
    dq: &'a mut [f32],
    dk: &'a mut [f32],
    dv: &'a mut [f32],
}

/// Causal attention of one sequence of `t` positions (rotated `q`, `k`): keeps the
/// probabilities (`t × heads × t`) and writes the output (`t × q_dim`).
fn attention_forward(
    cfg: &super::LlamaConfig,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    t: usize,
    probs: &mut [f32],
    attn: &mut [f32],
) {
    let (hd, qd, kvd) = (cfg.head_dim, cfg.q_dim(), cfg.kv_dim());
    let group = cfg.heads / cfg.kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    for i in 0..t {
        for head in 0..cfg.heads {
            let kvh = head / group;
            let qv = &q[i * qd + head * hd..i * qd + (head + 1) * hd];
            let p = &mut probs[(i * cfg.heads + head) * t..(i * cfg.heads + head) * t + i + 1];
            for (pos, s) in p.iter_mut().enumerate() {
                *s = crate::compute::dot(qv, &k[pos * kvd + kvh * hd..pos * kvd + (kvh + 1) * hd])
                    * scale;
            }
            softmax(p);
            let o = &mut attn[i * qd + head * hd..i * qd + (head + 1) * hd];
            for (pos, &w) in p.iter().enumerate() {
                for (a, &b) in o
                    .iter_mut()
                    .zip(&v[pos * kvd + kvh * hd..pos * kvd + (kvh + 1) * hd])
                {
                    *a += w * b;
                }
            }
        }
    }
}

/// The gradients of one sequence's attention given its output's gradient `dattn`.
fn attention_backward(
    cfg: &super::LlamaConfig,
    s: AttentionSaved<'_>,
    dattn: &[f32],
    t: usize,
    g: AttentionGrads<'_>,
) {
    let (hd, qd, kvd) = (cfg.head_dim, cfg.q_dim(), cfg.kv_dim());
    let group = cfg.heads / cfg.kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut dp = vec![0.0f32; t];
    for i in 0..t {
        for head in 0..cfg.heads {
            let kvh = head / group;
            let p = &s.probs[(i * cfg.heads + head) * t..(i * cfg.heads + head) * t + i + 1];
            let dout = &dattn[i * qd + head * hd..i * qd + (head + 1) * hd];
            let mut sum = 0.0f32;
            for pos in 0..=i {
                let vv = &s.v[pos * kvd + kvh * hd..pos * kvd + (kvh + 1) * hd];
                dp[pos] = crate::compute::dot(dout, vv);
                sum += p[pos] * dp[pos];
                for (a, &b) in g.dv[pos * kvd + kvh * hd..pos * kvd + (kvh + 1) * hd]
                    .iter_mut()
                    .zip(dout)
                {
                    *a += p[pos] * b;
                }
            }
            let qv = &s.q[i * qd + head * hd..i * qd + (head + 1) * hd];
            for pos in 0..=i {
                let ds = p[pos] * (dp[pos] - sum) * scale;
                let kv = &s.k[pos * kvd + kvh * hd..pos * kvd + (kvh + 1) * hd];
                for (a, &b) in g.dq[i * qd + head * hd..i * qd + (head + 1) * hd]
                    .iter_mut()
                    .zip(kv)
                {
                    *a += ds * b;
                }
                for (a, &b) in g.dk[pos * kvd + kvh * hd..pos * kvd + (kvh + 1) * hd]
                    .iter_mut()
                    .zip(qv)
                {
                    *a += ds * b;
                }
            }
        }
    }
}
