//! The leader's half of a Llama forward pass: norms, RoPE, attention with its KV cache, SwiGLU.
//! Every linear stage goes through a [`LinearExec`].

use serde::{Deserialize, Serialize};

use super::{LlamaConfig, ModelError, ModelWeights};

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

/// The small replicated parameters the leader holds itself: the norm gains.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LeaderWeights {
    /// RMSNorm gain before attention, per block.
    pub attn_norm: Vec<Vec<f32>>,
    /// RMSNorm gain before the feed-forward layer, per block.
    pub ffn_norm: Vec<Vec<f32>>,
    /// Final RMSNorm gain.
    pub final_norm: Vec<f32>,
}

impl LeaderWeights {
    /// Takes the norm gains out of full model weights.
    pub fn from_model(w: &ModelWeights) -> Self {
        Self {
            attn_norm: w.layers.iter().map(|l| l.attn_norm.clone()).collect(),
            ffn_norm: w.layers.iter().map(|l| l.ffn_norm.clone()).collect(),
            final_norm: w.final_norm.clone(),
        }
    }

    /// Every gain, block by block (attention's, then the feed-forward's), the final last.
    pub fn values(&self) -> impl Iterator<Item = &f32> {
        self.attn_norm
            .iter()
            .chain(&self.ffn_norm)
            .chain(std::iter::once(&self.final_norm))
            .flatten()
    }

    /// Whether the gains have the model's shape.
    pub fn fits(&self, cfg: &LlamaConfig) -> bool {
        self.attn_norm.len() == cfg.layers
            && self.ffn_norm.len() == cfg.layers
            && self.final_norm.len() == cfg.hidden
            && self
                .attn_norm
                .iter()
                .chain(&self.ffn_norm)
                .all(|g| g.len() == cfg.hidden)
    }
}

/// Keys and values of the tokens seen so far, per block.
#[derive(Debug, Clone)]
pub struct KvCache {
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
    len: usize,
    kv_dim: usize,
}

impl KvCache {
    /// An empty cache for a model.
    pub fn new(cfg: &LlamaConfig) -> Self {
        Self {
            keys: vec![Vec::new(); cfg.layers],
            values: vec![Vec::new(); cfg.layers],
            len: 0,
            kv_dim: cfg.kv_dim(),
        }
    }

    /// Number of positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no position is held.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Forgets everything after the first `len` positions (and any keys and values a failed
    /// pass left past the positions held).
    pub fn truncate(&mut self, len: usize) {
        let len = len.min(self.len);
        for layer in self.keys.iter_mut().chain(self.values.iter_mut()) {
            layer.truncate(len * self.kv_dim);
        }
        self.len = len;
    }
}

/// One sequence of a batched forward pass: tokens to run after what its cache holds.
#[derive(Debug)]
pub struct BatchItem<'a> {
    /// The tokens to run.
    pub tokens: &'a [u32],
    /// The sequence's keys and values so far.
    pub cache: &'a mut KvCache,
    /// How many of the last positions' logits come back (1 to the number of tokens).
    pub logits: usize,
}

impl<'a> BatchItem<'a> {
    /// `tokens` after what `cache` holds, returning the last position's logits.
    pub fn new(tokens: &'a [u32], cache: &'a mut KvCache) -> Self {
        Self {
            tokens,
            cache,
            logits: 1,
        }
    }
}

/// The leader's part of a Llama model.
#[derive(Debug, Clone)]
pub struct Llama {
    cfg: LlamaConfig,
    norms: LeaderWeights,
    /// `base^(-2i/head_dim)` for each pair `i` of a head.
    inv_freq: Vec<f64>,
}

impl Llama {
    /// A leader for a model of this shape with these norm gains.
    pub fn new(cfg: LlamaConfig, norms: LeaderWeights) -> Result<Self, ModelError> {
        cfg.validate()?;
        let ok = norms.attn_norm.len() == cfg.layers
            && norms.ffn_norm.len() == cfg.layers
            && norms
                .attn_norm
                .iter()
                .chain(&norms.ffn_norm)
                .chain(std::iter::once(&norms.final_norm))
                .all(|n| n.len() == cfg.hidden);
        if !ok {
            return Err(ModelError::Config(
                "norm gains do not match the model shape".into(),
            ));
        }
        let half = cfg.head_dim / 2;
        let inv_freq = (0..half)
            .map(|i| (cfg.rope_theta as f64).powf(-2.0 * i as f64 / cfg.head_dim as f64))
            .collect();
        Ok(Self {
            cfg,
            norms,
            inv_freq,
        })
    }

    /// The model's shape.
    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    /// Runs `tokens` after what `cache` holds and returns the logits of the last position.
    /// On error the cache is left as it was.
    pub async fn forward<E: LinearExec>(
        &self,
        exec: &mut E,
        tokens: &[u32],
        cache: &mut KvCache,
    ) -> Result<Vec<f32>, ModelError> {
        let mut items = [BatchItem::new(tokens, cache)];
        let mut logits = self.forward_batch(exec, &mut items).await?;
        logits
            .pop()
            .ok_or_else(|| ModelError::Config("no logits".into()))
    }

    /// Runs each item's tokens after its cache, the rows of every item through one round per
    /// stage, and returns each item's logits: of its last `logits` positions, row after row.
    /// On error every cache is left as it was.
    pub async fn forward_batch<E: LinearExec>(
        &self,
        exec: &mut E,
        items: &mut [BatchItem<'_>],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let starts: Vec<usize> = items.iter().map(|i| i.cache.len).collect();
        let result = self.forward_inner(exec, items).await;
        if result.is_err() {
            for (item, &start) in items.iter_mut().zip(&starts) {
                item.cache.truncate(start);
            }
        }
        result
    }

    async fn forward_inner<E: LinearExec>(
        &self,
        exec: &mut E,
        items: &mut [BatchItem<'_>],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let cfg = &self.cfg;
        if items.is_empty() {
            return Err(ModelError::Config(
                "a batch needs at least one sequence".into(),
            ));
        }
        for item in items.iter() {
            let t = item.tokens.len();
            if t == 0 {
                return Err(ModelError::Config(
                    "forward needs at least one token".into(),
                ));
            }
            if let Some(&id) = item.tokens.iter().find(|&&id| id as usize >= cfg.vocab) {
                return Err(ModelError::TokenOutOfRange {
                    id,
                    vocab: cfg.vocab,
                });
            }
            if item.cache.len + t > cfg.max_seq {
                return Err(ModelError::ContextFull {
                    len: item.cache.len + t,
                    max: cfg.max_seq,
                });
            }
        }
        let (d, q_dim, kv_dim) = (cfg.hidden, cfg.q_dim(), cfg.kv_dim());
        let n = items.len();
        let t: usize = items.iter().map(|i| i.tokens.len()).sum();
        let tokens: Vec<u32> = items
            .iter()
            .flat_map(|i| i.tokens.iter().copied())
            .collect();
        // Each row rotates by its own position: its sequence's cache length plus its index.
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for item in items.iter() {
            let (c, s) = rope_table(&self.inv_freq, item.cache.len, item.tokens.len());
            cos.extend(c);
            sin.extend(s);
        }
        let mut x = exec.embed(&tokens).await?;
        expect_len(&x, t * d, "embedding")?;
        let mut h = vec![0.0f32; t * d];
        for l in 0..cfg.layers {
            let layer = l as u32;
            rms_norm(&x, &self.norms.attn_norm[l], cfg.norm_eps, &mut h);
            let mut qkv = exec.linear(Stage::Qkv(layer), &h, t).await?;
            check_outputs(&qkv, Stage::Qkv(layer), cfg, t)?;
            let v = qkv.pop().unwrap_or_default();
            let mut k = qkv.pop().unwrap_or_default();
            let mut q = qkv.pop().unwrap_or_default();
            rotate(&mut q, cfg.heads, cfg.head_dim, &cos, &sin, 1.0);
            rotate(&mut k, cfg.kv_heads, cfg.head_dim, &cos, &sin, 1.0);
            // Attention within each sequence, over its own cache.
            let mut attn = vec![0.0f32; t * q_dim];
            let mut row = 0;
            for item in items.iter_mut() {
                let ti = item.tokens.len();
                let cache = &mut *item.cache;
                cache.keys[l].extend_from_slice(&k[row * kv_dim..(row + ti) * kv_dim]);
                cache.values[l].extend_from_slice(&v[row * kv_dim..(row + ti) * kv_dim]);
                self.attention(
                    &q[row * q_dim..(row + ti) * q_dim],
                    &cache.keys[l],
                    &cache.values[l],
                    cache.len,
                    ti,
                    &mut attn[row * q_dim..(row + ti) * q_dim],
                );
                row += ti;
            }
            let o = exec.linear(Stage::AttnOut(layer), &attn, t).await?;
            check_outputs(&o, Stage::AttnOut(layer), cfg, t)?;
            add_in_place(&mut x, &o[0]);
            rms_norm(&x, &self.norms.ffn_norm[l], cfg.norm_eps, &mut h);
            let gu = exec.linear(Stage::GateUp(layer), &h, t).await?;
            check_outputs(&gu, Stage::GateUp(layer), cfg, t)?;
            let act: Vec<f32> = gu[0]
                .iter()
                .zip(&gu[1])
                .map(|(&g, &u)| silu(g) * u)
                .collect();
            let down = exec.linear(Stage::Down(layer), &act, t).await?;
            check_outputs(&down, Stage::Down(layer), cfg, t)?;
            add_in_place(&mut x, &down[0]);
        }
        // The last rows of each sequence go to the LM head, all in one round.
        let wanted: Vec<usize> = items
            .iter()
            .map(|i| i.logits.clamp(1, i.tokens.len()))
            .collect();
        let rows: usize = wanted.iter().sum();
        let mut last = Vec::with_capacity(rows * d);
        let mut end = 0;
        for (item, &w) in items.iter_mut().zip(&wanted) {
            end += item.tokens.len();
            last.extend_from_slice(&x[(end - w) * d..end * d]);
            item.cache.len += item.tokens.len();
        }
        let mut normed = vec![0.0f32; rows * d];
        rms_norm(&last, &self.norms.final_norm, cfg.norm_eps, &mut normed);
        let mut logits = exec.linear(Stage::LmHead, &normed, rows).await?;
        check_outputs(&logits, Stage::LmHead, cfg, rows)?;
        let all = logits.pop().unwrap_or_default();
        let mut out = Vec::with_capacity(n);
        let mut at = 0;
        for w in wanted {
            out.push(all[at * cfg.vocab..(at + w) * cfg.vocab].to_vec());
            at += w;
        }
        Ok(out)
    }

    /// The norm gains.
    pub(crate) fn norms(&self) -> &LeaderWeights {
        &self.norms
    }

    /// RoPE frequencies.
    pub(crate) fn inv_freq(&self) -> &[f64] {
        &self.inv_freq
    }

    /// Causal grouped-query attention of `t` new queries over the cached keys and values,
    /// written into `out` (`t × q_dim`, zeroed).
    fn attention(
        &self,
        q: &[f32],
        keys: &[f32],
        values: &[f32],
        start: usize,
        t: usize,
        out: &mut [f32],
    ) {
        let cfg = &self.cfg;
        let (hd, kv_dim, q_dim) = (cfg.head_dim, cfg.kv_dim(), cfg.q_dim());
        let group = cfg.heads / cfg.kv_heads;
        let scale = 1.0 / (hd as f32).sqrt();
        let avx2 = wide_vectors();
        // One (token, head) pair: its slice of `out`.
        let one = |pair: usize, o: &mut [f32]| {
            let (i, head) = (pair / cfg.heads, pair % cfg.heads);
            let kvh = head / group;
            let head = Head {
                q: &q[i * q_dim + head * hd..i * q_dim + (head + 1) * hd],
                keys,
                values,
                stride: kv_dim,
                offset: kvh * hd,
                positions: start + i + 1,
                scale,
            };
            head.attend_with(avx2, o);
        };
        let out = &mut out[..t * q_dim];
        // Heads split across the kernel threads once their work outweighs handing it out: the
        // leader's attention otherwise runs on one thread while the others wait for the next
        // product (at a context of 400 it was a tenth of a decoded token).
        let work = t * (start + t) * cfg.heads * hd;
        if work >= crate::compute::cpu::PARALLEL_MIN_WEIGHTS && crate::compute::par::threads() > 1 {
            crate::compute::par::for_each_chunk(out, hd, one);
        } else {
            for (pair, o) in out.chunks_exact_mut(hd).enumerate() {
                one(pair, o);
            }
        }
    }
}

/// One query head's attention over the cached positions of its key/value head.
struct Head<'a> {
    /// The query, `head_dim` values.
    q: &'a [f32],
    /// Every cached position's keys, `stride` values a position.
    keys: &'a [f32],
    /// Every cached position's values, laid out as `keys`.
    values: &'a [f32],
    /// Values a position.
    stride: usize,
    /// Where this head's `head_dim` values start in a position.
    offset: usize,
    /// Positions attended to.
    positions: usize,
    /// `1/√head_dim`.
    scale: f32,
}

impl Head<'_> {
    /// Adds the attention-weighted values to `out` (`head_dim` values), with AVX2 when `avx2`
    /// (this CPU has it): the same operations in the same order, so the same bits.
    fn attend_with(&self, avx2: bool, out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: `avx2` comes from `wide_vectors`, which checked this CPU.
            return unsafe { self.attend_avx2(out) };
        }
        let _ = avx2;
        self.attend(out);
    }

    /// [`Self::attend`] compiled for AVX2: no fused multiply-adds, so the results are
    /// the portable build's bit for bit.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2")]
    fn attend_avx2(&self, out: &mut [f32]) {
        self.attend(out);
    }

    /// See [`Self::attend_with`].
    #[inline(always)]
    fn attend(&self, out: &mut [f32]) {
        let hd = out.len();
        let at = |p: usize| p * self.stride + self.offset..p * self.stride + self.offset + hd;
        // A loop, not a collected iterator: the iterator's code would be std's, compiled
        // without this function's target features.
        let mut scores = vec![0.0f32; self.positions];
        for (p, s) in scores.iter_mut().enumerate() {
            *s = crate::compute::dot(self.q, &self.keys[at(p)]) * self.scale;
        }
        softmax(&mut scores);
        for (p, &w) in scores.iter().enumerate() {
            for (a, &b) in out.iter_mut().zip(&self.values[at(p)]) {
                *a += w * b;
            }
        }
    }
}

/// Whether this CPU runs AVX2 (the attention's wider loops).
fn wide_vectors() -> bool {
    #[cfg(target_arch = "x86_64")]
    return std::arch::is_x86_feature_detected!("avx2");
    #[cfg(not(target_arch = "x86_64"))]
    false
}

fn expect_len(v: &[f32], len: usize, what: &str) -> Result<(), ModelError> {
    if v.len() == len {
        Ok(())
    } else {
        Err(ModelError::Config(format!(
            "{what} returned {} values, expected {len}",
            v.len()
        )))
    }
}

/// Checks that a stage returned one `t × out` output per matrix.
fn check_outputs(
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
        Err(ModelError::Exec {
            stage,
            message: "wrong output shape".into(),
        })
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

fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, &b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    #[test]
    fn attention_gives_the_same_bits_with_and_without_avx2() {
        // A hop group's members each run attention on their own: they must agree to the bit
        // whatever instructions their CPUs have.
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        let (hd, stride, positions) = (64, 192, 300);
        let mut v =
            |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-2.0..2.0)).collect() };
        let (q, keys, values) = (v(hd), v(stride * positions), v(stride * positions));
        let head = Head {
            q: &q,
            keys: &keys,
            values: &values,
            stride,
            offset: 64,
            positions,
            scale: 0.125,
        };
        let mut plain = vec![0.5f32; hd];
        head.attend_with(false, &mut plain);
        assert!(plain.iter().all(|x| x.is_finite() && *x != 0.5));
        if wide_vectors() {
            let mut wide = vec![0.5f32; hd];
            head.attend_with(true, &mut wide);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&plain), bits(&wide));
        }
    }
}
