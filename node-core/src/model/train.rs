//! The leader's backward pass: next-token cross-entropy over a sequence, the model's own forward
//! pass ([`Llama::trunk`], [`Llama::head`]) walked back block by block (`Block::backward`), with
//! every linear layer's input gradient computed through the [`LinearExec`] (coded transpose
//! steps) and every weight gradient kept as factors `δW = dYᵀ·X` (DESIGN.md §1), never as full
//! matrices.

use super::block::{Attend, Rows, Stage, linear_t, rope_table, softmax};
use super::layers::{AttendBack, AttentionActs, QkvGrads, StageGrad, StageSink, rms_norm_backward};
use super::llama::{Keep, Kept};
use super::{LeaderWeights, LinearExec, Llama, ModelError};

/// A teacher's next-token distribution at each predicted position of one sequence (all but
/// its last): its most likely tokens with their probabilities, which a pass teaches in place of
/// the next token (distillation: the gradient on the logits is `softmax − q`).
pub type Soft = Vec<Vec<(u32, f32)>>;

/// Most tokens a [`Soft`] position may name.
pub const MAX_SOFT_TOP: usize = 64;

/// The gradient of the mean loss on one sequence, or on a batch of them (rows stacked).
#[derive(Debug, Clone, PartialEq)]
pub struct Gradients {
    /// Mean next-token cross-entropy (nats per predicted token).
    pub loss: f64,
    /// Positions `t` of the sequence.
    pub t: usize,
    /// Linear stages, in forward order; the LM head (the tied embedding when tied) last (none
    /// when they went to a [`StageSink`]).
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
    /// every predicted position of every sequence, all rows through one round per stage (the LM
    /// head's in runs of positions, [`HEAD_BYTES`] of logits at a time).
    pub async fn gradients_batch<E: LinearExec>(
        &self,
        exec: &mut E,
        seqs: &[&[u32]],
    ) -> Result<Gradients, ModelError> {
        self.gradients_soft_batch(exec, seqs, &[], 0.0).await
    }

    /// [`Self::gradients_batch`] teaching sequence `i` the distributions `soft[i]` where given,
    /// and no next token already known within `floor` nats ([`Self::gradients_soft_into`]).
    pub async fn gradients_soft_batch<E: LinearExec>(
        &self,
        exec: &mut E,
        seqs: &[&[u32]],
        soft: &[Option<&Soft>],
        floor: f64,
    ) -> Result<Gradients, ModelError> {
        let teach = Teach {
            soft,
            floor,
            tops: None,
        };
        Ok(self.collected(exec, seqs, teach, Limits::DEFAULT).await?.1)
    }

    /// [`Self::gradients_batch`] with every stage's gradient handed to `sink` as the backward
    /// pass makes it, instead of kept (the gradients returned carry no stages): a sink that
    /// sums what it needs keeps a training pass's memory to its activations.
    pub async fn gradients_into<E: LinearExec, S: StageSink>(
        &self,
        exec: &mut E,
        seqs: &[&[u32]],
        sink: &mut S,
    ) -> Result<Gradients, ModelError> {
        self.gradients_soft_into(exec, seqs, &[], 0.0, sink).await
    }

    /// [`Self::gradients_into`] where sequence `i` with `soft[i]` given is taught that
    /// distribution at each position (a missing or `None` entry: its next tokens); the loss
    /// counts such a position as the cross-entropy against it. A next token the model already
    /// gives a loss below `floor` nats is counted in the loss and not taught (0: every one is).
    pub async fn gradients_soft_into<E: LinearExec, S: StageSink>(
        &self,
        exec: &mut E,
        seqs: &[&[u32]],
        soft: &[Option<&Soft>],
        floor: f64,
        sink: &mut S,
    ) -> Result<Gradients, ModelError> {
        let teach = Teach {
            soft,
            floor,
            tops: None,
        };
        self.loss_and_gradients(exec, seqs, Some(sink), teach, Limits::DEFAULT)
            .await?
            .1
            .ok_or_else(|| ModelError::Config("no gradients computed".into()))
    }

    /// The model's next-token distribution at every position of `tokens` but the last, as its
    /// `top` most likely tokens (at most [`MAX_SOFT_TOP`]) and their probabilities: what a
    /// pass teaches with [`Self::gradients_soft_into`] to keep the model's answers there.
    pub async fn next_distributions<E: LinearExec>(
        &self,
        exec: &mut E,
        tokens: &[u32],
        top: usize,
    ) -> Result<Soft, ModelError> {
        let mut out = Soft::new();
        let teach = Teach {
            soft: &[],
            floor: 0.0,
            tops: Some((top.clamp(1, MAX_SOFT_TOP), &mut out)),
        };
        self.loss_and_gradients::<E, Collect>(exec, &[tokens], None, teach, Limits::DEFAULT)
            .await?;
        Ok(out)
    }

    /// [`Self::gradients_batch`] with every block run again from its input once the blocks'
    /// activations pass `keep` bytes, and the LM head over `head` bytes of logits at a time.
    #[cfg(test)]
    pub(crate) async fn gradients_within<E: LinearExec>(
        &self,
        exec: &mut E,
        seqs: &[&[u32]],
        keep: usize,
        head: usize,
    ) -> Result<(f64, Gradients), ModelError> {
        self.collected(exec, seqs, Teach::NEXT, Limits { keep, head })
            .await
    }

    /// The loss and gradients of `seqs` within `limits`, every stage's kept, in forward order.
    async fn collected<E: LinearExec>(
        &self,
        exec: &mut E,
        seqs: &[&[u32]],
        teach: Teach<'_>,
        limits: Limits,
    ) -> Result<(f64, Gradients), ModelError> {
        let mut kept = Collect::default();
        let (loss, g) = self
            .loss_and_gradients(exec, seqs, Some(&mut kept), teach, limits)
            .await?;
        let mut g = g.ok_or_else(|| ModelError::Config("no gradients computed".into()))?;
        kept.0.reverse();
        g.stages = kept.0;
        Ok((loss, g))
    }

    /// Mean next-token cross-entropy of `tokens` (nats per predicted token), forward only.
    pub async fn sequence_loss<E: LinearExec>(
        &self,
        exec: &mut E,
        tokens: &[u32],
    ) -> Result<f64, ModelError> {
        Ok(self
            .loss_and_gradients::<E, Collect>(exec, &[tokens], None, Teach::NEXT, Limits::DEFAULT)
            .await?
            .0)
    }

    /// The loss of `seqs` and, with a `sink` (training), its gradient, within `limits`.
    async fn loss_and_gradients<E: LinearExec, S: StageSink>(
        &self,
        exec: &mut E,
        seqs: &[&[u32]],
        mut sink: Option<&mut S>,
        mut teach: Teach<'_>,
        limits: Limits,
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
        for (tokens, soft) in seqs.iter().zip(teach.soft) {
            let Some(soft) = soft else { continue };
            if soft.len() != tokens.len() - 1 {
                return Err(ModelError::Config(format!(
                    "a taught distribution for each of {} positions, not {}",
                    tokens.len() - 1,
                    soft.len()
                )));
            }
            let bad = soft.iter().flatten().any(|&(id, q)| {
                id as usize >= cfg.vocab || !q.is_finite() || !(0.0..=1.0).contains(&q)
            });
            if bad || soft.iter().any(|p| p.len() > MAX_SOFT_TOP) {
                return Err(ModelError::Config(
                    "a taught distribution names a token outside the vocabulary, a probability outside [0, 1] or too many tokens".into(),
                ));
            }
        }
        let backward = sink.is_some();
        let d = cfg.hidden;
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
        // Forward. Every block's activations are kept for the backward pass while they fit in
        // [`KEEP_BYTES`]; beyond, only each block's input, and the backward pass runs the block
        // again when it reaches it.
        let rows = Rows {
            t,
            cos: &cos,
            sin: &sin,
        };
        let whole = backward && keeps_every_block(&cfg, &spans, limits.keep).0;
        let mut within = WithinSequences {
            cfg: &cfg,
            spans: &spans,
            probs: Vec::new(),
            keep: whole,
        };
        let keep = match (backward, whole) {
            (false, _) => Keep::Nothing,
            (true, false) => Keep::Inputs,
            (true, true) => Keep::Activations,
        };
        let (x, mut kept) = self.trunk(exec, &mut within, &tokens, &rows, keep).await?;
        let hf = self.final_norm(&x);

        // The loss and (training) its gradient on the logits, in runs of positions: every
        // position but each sequence's last predicts the next token of its sequence.
        let mut next: Vec<Option<Target>> = vec![None; t];
        for (s, &(start, ti)) in spans.iter().enumerate() {
            let soft = teach.soft.get(s).copied().flatten();
            for i in start..start + ti - 1 {
                next[i] = Some(match soft {
                    Some(q) => Target::Soft(&q[i - start]),
                    None => Target::Next(tokens[i + 1]),
                });
            }
        }
        let v_n = cfg.vocab;
        let predicted: f64 = spans.iter().map(|&(_, ti)| (ti - 1) as f64).sum();
        let run = (limits.head / (4 * v_n).max(1)).clamp(1, t);
        let mut loss = 0.0f64;
        let mut dhf = vec![0.0f32; if backward { t * d } else { 0 }];
        for first in (0..t).step_by(run) {
            let n = run.min(t - first);
            let h = &hf[first * d..(first + n) * d];
            let mut logits = self.head(exec, h, n).await?;
            for (row, target) in logits.chunks_exact_mut(v_n).zip(&next[first..]) {
                let Some(target) = *target else {
                    row.fill(0.0);
                    continue;
                };
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
                let sum: f64 = row.iter().map(|&z| (z as f64 - max).exp()).sum();
                let lse = sum.ln() + max;
                if let Some((top, out)) = teach.tops.as_mut() {
                    out.push(most_likely(row, lse, *top));
                }
                // The target's probabilities and their sum (a soft one's top tokens, scaled
                // by it to sum to 1).
                let one;
                let (q, mass) = match target {
                    Target::Next(id) => {
                        one = [(id, 1.0f32)];
                        (&one[..], 1.0)
                    }
                    Target::Soft(q) => (q, q.iter().map(|&(_, p)| f64::from(p)).sum::<f64>()),
                };
                if mass <= 0.0 {
                    row.fill(0.0);
                    continue;
                }
                let lost = q
                    .iter()
                    .map(|&(id, p)| f64::from(p) / mass * (lse - row[id as usize] as f64))
                    .sum::<f64>();
                loss += lost;
                if matches!(target, Target::Next(_)) && lost < teach.floor {
                    // Known already: taught no further.
                    row.fill(0.0);
                    continue;
                }
                if backward {
                    // The logits become their gradient in place: softmax − q.
                    for z in row.iter_mut() {
                        *z = (((*z as f64 - lse).exp()) / predicted) as f32;
                    }
                    for &(id, p) in q {
                        row[id as usize] -= (f64::from(p) / mass / predicted) as f32;
                    }
                }
            }
            if let Some(sink) = sink.as_deref_mut() {
                let dh =
                    linear_t(exec, &cfg, Stage::LmHead, std::slice::from_ref(&logits), n).await?;
                if dh.len() != n * d {
                    return Err(ModelError::Config(
                        "the LM head's transpose returned the wrong shape".into(),
                    ));
                }
                dhf[first * d..(first + n) * d].copy_from_slice(&dh);
                sink.take(StageGrad {
                    stage: Stage::LmHead,
                    x: h.to_vec(),
                    dy: vec![logits],
                });
            }
        }
        loss /= predicted;
        let Some(sink) = sink else {
            return Ok((loss, None));
        };
        drop(hf);

        // Backward.
        let mut grads = LeaderWeights::zeros(&cfg);
        let mut dx = vec![0.0f32; t * d];
        rms_norm_backward(
            &x,
            &self.norms().final_norm,
            cfg.norm_eps,
            &dhf,
            &mut dx,
            &mut grads.final_norm,
        );
        drop((x, dhf));
        for block in self.blocks().rev() {
            let saved = match kept.pop() {
                Some(Kept::Activations(saved)) => Some(*saved),
                Some(Kept::Input(mut again)) => {
                    // The block again from its input, keeping its activations this time.
                    within.keep = true;
                    block
                        .forward(exec, &mut within, &rows, &mut again, true)
                        .await?
                }
                None => None,
            };
            let saved =
                saved.ok_or_else(|| ModelError::Config("lost a block's activations".into()))?;
            block
                .backward(exec, &mut within, &rows, saved, &mut dx, sink, &mut grads)
                .await?;
        }
        let grads = Gradients {
            loss,
            t,
            stages: Vec::new(),
            embed_dx: dx,
            tokens,
            norms: grads,
            sequences: seqs.len(),
        };
        Ok((loss, Some(grads)))
    }
}

/// What a predicted position is taught: the next token, or a distribution.
#[derive(Debug, Clone, Copy)]
enum Target<'a> {
    Next(u32),
    Soft(&'a [(u32, f32)]),
}

/// What a pass teaches beyond next tokens: distributions for some sequences, and (measuring)
/// where to write each position's most likely next tokens.
struct Teach<'a> {
    soft: &'a [Option<&'a Soft>],
    /// A next token whose loss is below this many nats is not taught (0: every one is).
    floor: f64,
    tops: Option<(usize, &'a mut Soft)>,
}

impl Teach<'_> {
    /// Every position taught its next token, nothing measured.
    const NEXT: Teach<'static> = Teach {
        soft: &[],
        floor: 0.0,
        tops: None,
    };
}

/// The `top` most likely tokens of a row of logits whose log-sum-exp is `lse`, with their
/// probabilities, most likely first.
fn most_likely(row: &[f32], lse: f64, top: usize) -> Vec<(u32, f32)> {
    let mut ids: Vec<u32> = (0..row.len() as u32).collect();
    let top = top.min(ids.len());
    if top == 0 {
        return Vec::new();
    }
    ids.select_nth_unstable_by(top - 1, |&a, &b| {
        row[b as usize].total_cmp(&row[a as usize])
    });
    ids.truncate(top);
    ids.sort_by(|&a, &b| row[b as usize].total_cmp(&row[a as usize]));
    ids.into_iter()
        .map(|id| (id, (row[id as usize] as f64 - lse).exp() as f32))
        .collect()
}

/// Most bytes of logits a pass holds at once: the LM head runs over as many positions at a
/// time as fit (at least one).
pub const HEAD_BYTES: usize = 16 << 20;

/// Most bytes of activations a training pass keeps for every block at once; beyond, it keeps
/// each block's input and runs the block again on the way back.
pub const KEEP_BYTES: usize = 64 << 20;

/// What a pass may hold: activations of every block ([`KEEP_BYTES`]) and logits
/// ([`HEAD_BYTES`]).
#[derive(Debug, Clone, Copy)]
struct Limits {
    keep: usize,
    head: usize,
}

impl Limits {
    const DEFAULT: Self = Self {
        keep: KEEP_BYTES,
        head: HEAD_BYTES,
    };
}

/// Whether a pass over sequences `spans` keeps every block's activations within `keep` bytes
/// (else it runs each block again on the way back), and the bytes every block's take.
fn keeps_every_block(
    cfg: &super::LlamaConfig,
    spans: &[(usize, usize)],
    keep: usize,
) -> (bool, usize) {
    let all = cfg.layers * block_bytes(cfg, spans);
    (all <= keep, all)
}

/// Bytes one block's kept activations take for sequences `spans` (first row, rows).
fn block_bytes(cfg: &super::LlamaConfig, spans: &[(usize, usize)]) -> usize {
    let t: usize = spans.iter().map(|s| s.1).sum();
    let per_row = 4 * cfg.hidden + 3 * cfg.q_dim() + 3 * cfg.kv_dim() + 3 * cfg.ffn;
    let probs = cfg.heads * spans.iter().map(|s| s.1 * s.1).sum::<usize>();
    4 * (t * per_row + probs)
}

/// Most bytes a training pass over `positions` rows, in sequences of at most `window`, holds
/// beside what its [`StageSink`] keeps: the blocks' activations (or their inputs and one
/// block's), one block's gradients, and a run of the LM head's logits.
pub fn training_bytes(cfg: &super::LlamaConfig, positions: usize, window: usize) -> usize {
    let window = window.clamp(1, positions.max(1));
    let mut spans = vec![(0, window); positions / window];
    if !positions.is_multiple_of(window) {
        spans.push((0, positions % window));
    }
    let kept = match keeps_every_block(cfg, &spans, KEEP_BYTES) {
        (true, all) => all,
        (false, all) => 4 * positions * cfg.hidden * cfg.layers + all / cfg.layers.max(1),
    };
    let outs = cfg.q_dim() + 2 * cfg.kv_dim() + 2 * cfg.ffn + 2 * cfg.hidden;
    let grads = 4 * positions * (outs + 4 * cfg.hidden);
    kept + grads + HEAD_BYTES.max(4 * cfg.vocab)
}

/// Keeps every stage's gradient whole (a run of the LM head's rows joins the one before).
#[derive(Debug, Default)]
struct Collect(Vec<StageGrad>);

impl StageSink for Collect {
    fn take(&mut self, g: StageGrad) {
        if let Some(last) = self.0.last_mut()
            && last.stage == g.stage
        {
            last.x.extend_from_slice(&g.x);
            for (a, b) in last.dy.iter_mut().zip(&g.dy) {
                a.extend_from_slice(b);
            }
            return;
        }
        self.0.push(g);
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
    /// Whether the probabilities are kept (for the backward pass).
    keep: bool,
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
        if self.keep {
            self.probs.push(probs);
        }
    }
}

impl AttendBack for WithinSequences<'_> {
    fn attend_back(
        &mut self,
        _layer: usize,
        a: &AttentionActs,
        dattn: &[f32],
    ) -> Result<QkvGrads, ModelError> {
        let cfg = self.cfg;
        let (qd, kvd) = (cfg.q_dim(), cfg.kv_dim());
        let t: usize = self.spans.iter().map(|&(_, ti)| ti).sum();
        let probs = (self.probs.pop())
            .ok_or_else(|| ModelError::Config("lost a block's attention probabilities".into()))?;
        let mut dq = vec![0.0f32; t * qd];
        let mut dk = vec![0.0f32; t * kvd];
        let mut dv = vec![0.0f32; t * kvd];
        let mut p_at = 0;
        for &(row, ti) in self.spans {
            let p_len = ti * cfg.heads * ti;
            let (q, kv) = (row * qd..(row + ti) * qd, row * kvd..(row + ti) * kvd);
            attention_backward(
                cfg,
                AttentionSaved {
                    q: &a.q[q.clone()],
                    k: &a.k[kv.clone()],
                    v: &a.v[kv.clone()],
                    probs: &probs[p_at..p_at + p_len],
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
        Ok((dq, dk, dv))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_larger_pass_needs_more_memory_and_a_1b_pass_fits_the_budget_it_was_sized_for() {
        let cfg = crate::model::LlamaConfig {
            hidden: 2048,
            ffn: 8192,
            layers: 16,
            heads: 32,
            kv_heads: 8,
            head_dim: 64,
            vocab: 128_256,
            norm_eps: 1e-5,
            rope_theta: 500_000.0,
            max_seq: 2048,
            tied_embeddings: true,
            family: crate::model::Family::Llama,
            rope_freq_factors: Vec::new(),
        };
        let (small, large) = (
            training_bytes(&cfg, 64, 256),
            training_bytes(&cfg, 256, 256),
        );
        assert!(small < large);
        // Blocks run again at this size: their inputs, one block and the head's run.
        assert!(large < 160 << 20, "{large}");
        assert!(large > 16 * 256 * 2048 * 4 + HEAD_BYTES);
    }
}
