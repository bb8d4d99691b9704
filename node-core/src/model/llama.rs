//! The model around its blocks — embedding, every [`Block`], the final norm, the LM head — said
//! once for inference and training, and the forward pass as served: sequences batched, each
//! attending over its own KV cache, every linear stage through a [`LinearExec`].

use super::block::{Attend, LinearExec, Rows, Stage, linear, pass_rows, rope_table, softmax};
use super::layers::{Block, Saved, normed};
use super::{LeaderWeights, LlamaConfig, ModelError};

/// What a pass through the blocks keeps of each block for a backward pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Keep {
    /// Nothing (inference).
    Nothing,
    /// Each block's input, to run it again on the way back.
    Inputs,
    /// Each block's activations.
    Activations,
}

/// What a pass through the blocks kept of one block.
#[derive(Debug)]
pub(crate) enum Kept {
    /// Its input ([`Keep::Inputs`]).
    Input(Vec<f32>),
    /// Its activations ([`Keep::Activations`]).
    Activations(Box<Saved>),
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
        if !norms.fits(&cfg) {
            return Err(ModelError::Config(
                "the leader's norm gains, biases or head norms do not match the model shape".into(),
            ));
        }
        let half = cfg.head_dim / 2;
        let inv_freq = (0..half)
            .map(|i| {
                let f = (cfg.rope_theta as f64).powf(-2.0 * i as f64 / cfg.head_dim as f64);
                f / cfg.rope_freq_factors.get(i).map_or(1.0, |&d| f64::from(d))
            })
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
    /// stage (in passes of at most [`pass_rows`] rows), and returns each item's logits: of its
    /// last `logits` positions, row after row. On error every cache is left as it was.
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
        let rows = pass_rows(cfg);
        let wanted: Vec<usize> = items
            .iter()
            .map(|i| i.logits.clamp(1, i.tokens.len()))
            .collect();
        if items.iter().map(|i| i.tokens.len()).sum::<usize>() <= rows {
            return self.pass(exec, items, &wanted).await;
        }
        // A longer batch runs in passes of at most `rows` rows, each sequence's next tokens in
        // turn; a sequence's last pass holds every row whose logits it wants.
        let mut fed = vec![0usize; items.len()];
        let mut out = vec![Vec::new(); items.len()];
        while let Some(first) = (0..items.len()).find(|&i| fed[i] < items[i].tokens.len()) {
            let mut left = rows;
            let mut takes = vec![0usize; items.len()];
            for (i, item) in items.iter().enumerate() {
                let rest = item.tokens.len() - fed[i];
                let mut take = rest.min(left);
                if take < rest && rest - take < wanted[i] {
                    take = rest - wanted[i];
                }
                takes[i] = take;
                left -= take;
            }
            if takes.iter().all(|&n| n == 0) {
                // Only a sequence wanting more logits than a pass holds rows: it runs whole.
                takes[first] = items[first].tokens.len() - fed[first];
            }
            let mut chosen = Vec::new();
            let mut pieces = Vec::new();
            let mut piece_wanted = Vec::new();
            for (i, item) in items.iter_mut().enumerate() {
                if takes[i] == 0 {
                    continue;
                }
                let tokens: &[u32] = item.tokens;
                let end = fed[i] + takes[i];
                let last = end == tokens.len();
                chosen.push((i, last));
                piece_wanted.push(if last { wanted[i] } else { 0 });
                pieces.push(BatchItem {
                    tokens: &tokens[fed[i]..end],
                    cache: &mut *item.cache,
                    logits: 1,
                });
                fed[i] = end;
            }
            let logits = self.pass(exec, &mut pieces, &piece_wanted).await?;
            for ((i, last), l) in chosen.into_iter().zip(logits) {
                if last {
                    out[i] = l;
                }
            }
        }
        Ok(out)
    }

    /// One pass of a batch's rows through every block, and the LM head on each item's last
    /// `wanted` rows (none where every item wants none).
    async fn pass<E: LinearExec>(
        &self,
        exec: &mut E,
        items: &mut [BatchItem<'_>],
        wanted: &[usize],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let cfg = &self.cfg;
        let d = cfg.hidden;
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
        let block_rows = Rows {
            t,
            cos: &cos,
            sin: &sin,
        };
        let mut caches = CacheAttend { model: self, items };
        let (x, _) = self
            .trunk(exec, &mut caches, &tokens, &block_rows, Keep::Nothing)
            .await?;
        let items = caches.items;
        // The last rows of each sequence go to the LM head, all in one round.
        let rows: usize = wanted.iter().sum();
        let mut last = Vec::with_capacity(rows * d);
        let mut end = 0;
        for (item, &w) in items.iter_mut().zip(wanted) {
            end += item.tokens.len();
            last.extend_from_slice(&x[(end - w) * d..end * d]);
            item.cache.len += item.tokens.len();
        }
        if rows == 0 {
            return Ok(vec![Vec::new(); n]);
        }
        let all = self.head(exec, &self.final_norm(&last), rows).await?;
        let mut out = Vec::with_capacity(n);
        let mut at = 0;
        for &w in wanted {
            out.push(all[at * cfg.vocab..(at + w) * cfg.vocab].to_vec());
            at += w;
        }
        Ok(out)
    }

    /// The norm gains.
    pub(crate) fn norms(&self) -> &LeaderWeights {
        &self.norms
    }

    /// The model's blocks, first to last.
    pub(crate) fn blocks(&self) -> impl DoubleEndedIterator<Item = Block<'_>> {
        (0..self.cfg.layers).map(|l| Block::new(&self.cfg, &self.norms, l))
    }

    /// The embedding of `tokens` through every block (`rows` says their positions; `attend`,
    /// how they attend): the residual stream after the last block, and what `keep` asks of
    /// each block, first to last.
    pub(crate) async fn trunk<E: LinearExec, A: Attend>(
        &self,
        exec: &mut E,
        attend: &mut A,
        tokens: &[u32],
        rows: &Rows<'_>,
        keep: Keep,
    ) -> Result<(Vec<f32>, Vec<Kept>), ModelError> {
        let mut x = exec.embed(tokens).await?;
        expect_len(&x, tokens.len() * self.cfg.hidden, "embedding")?;
        let mut kept = Vec::new();
        for block in self.blocks() {
            if keep == Keep::Inputs {
                kept.push(Kept::Input(x.clone()));
            }
            let saved = block
                .forward(exec, attend, rows, &mut x, keep == Keep::Activations)
                .await?;
            if let Some(saved) = saved {
                kept.push(Kept::Activations(Box::new(saved)));
            }
        }
        Ok((x, kept))
    }

    /// The final norm of rows of the residual stream.
    pub(crate) fn final_norm(&self, x: &[f32]) -> Vec<f32> {
        normed(&self.cfg, x, &self.norms.final_norm)
    }

    /// The LM head's logits (`n × vocab`) of `n` normed rows `h`.
    pub(crate) async fn head<E: LinearExec>(
        &self,
        exec: &mut E,
        h: &[f32],
        n: usize,
    ) -> Result<Vec<f32>, ModelError> {
        let mut logits = linear(exec, &self.cfg, Stage::LmHead, h, n).await?;
        Ok(logits.pop().unwrap_or_default())
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

/// The model's attention: each sequence's rows over its own KV cache, which takes the rows'
/// keys and values first.
struct CacheAttend<'m, 'i, 'c> {
    model: &'m Llama,
    items: &'i mut [BatchItem<'c>],
}

impl Attend for CacheAttend<'_, '_, '_> {
    fn attend(&mut self, layer: usize, q: &[f32], k: &[f32], v: &[f32], out: &mut [f32]) {
        let cfg = &self.model.cfg;
        let (q_dim, kv_dim) = (cfg.q_dim(), cfg.kv_dim());
        let mut row = 0;
        for item in self.items.iter_mut() {
            let ti = item.tokens.len();
            let cache = &mut *item.cache;
            cache.keys[layer].extend_from_slice(&k[row * kv_dim..(row + ti) * kv_dim]);
            cache.values[layer].extend_from_slice(&v[row * kv_dim..(row + ti) * kv_dim]);
            self.model.attention(
                &q[row * q_dim..(row + ti) * q_dim],
                &cache.keys[layer],
                &cache.values[layer],
                cache.len,
                ti,
                &mut out[row * q_dim..(row + ti) * q_dim],
            );
            row += ti;
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
