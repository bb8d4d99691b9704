//! Learning on compact shards: a coded low-rank adapter beside the integers.
//!
//! A learning step far below the 8-bit grid's step cannot move the integers, and rounding it
//! there would need every weight's carry on every node. So a compact shard learns in an
//! adapter: the matrix it serves is `W + A·V`, where `V` (`rank × cols`, entries ±1, rows
//! exactly orthogonal) is the same fixed projection on every node and `A` (`rows × rank`, f32)
//! is coded like the weights (`A_i = Σ_j G[i,j]·A_j`). A step `δW = −step·dYᵀ·X` is applied
//! in `V`'s row space as `δA = −step·dYᵀ·(X·Vᵀ / rank)`, so `δW` becomes `δW·Vᵀ·V / rank`,
//! whose mean over the random signs of `V` is `δW` itself. That is linear in `dY`, so every
//! row applies its own coded share and the shards stay one codeword, exactly as f32 shards do
//! (docs/coding.md, "Learning on compact shards").

use std::sync::{Arc, OnceLock, PoisonError, RwLock};

use serde::{Deserialize, Serialize};

use super::{CodedError, Shard};
use crate::compute::matmul;
use crate::protocol::StepRequest;

/// Largest adapter rank: columns of `A`, rows of `V`.
pub const ADAPTER_RANK: usize = 16;

/// The adapter rank of a matrix with `cols` inputs: [`ADAPTER_RANK`], or the largest power of
/// two dividing `cols` when that is smaller (the rows of `V` must split the columns evenly).
pub fn adapter_rank(cols: usize) -> usize {
    if cols == 0 {
        return 1;
    }
    ADAPTER_RANK.min(1 << cols.trailing_zeros().min(16))
}

/// What a compact shard has learnt: `rows × rank` f32 values (empty until its first update),
/// each sub-block's `L × rank` stored in tiles of [`TILE`] rows ([`tiled_at`]), so that a
/// product reads them as one stream.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Adapter {
    /// `A`: per sub-block `s`, value `(r, k)` at `s·L·rank + tiled_at(L, rank, r, k)`; empty
    /// while nothing was learnt.
    #[serde(with = "a_bytes")]
    pub a: Vec<f32>,
    /// What rounding `a` to f32 left out of the updates so far (compensated summation, as
    /// [`Shard::carry`]); memory only.
    #[serde(skip)]
    pub carry: Vec<f32>,
}

/// An adapter's values on the wire: little-endian f32 bytes, as [`crate::protocol`] writes
/// them, read back as a sequence of bytes (the same bytes in postcard), so that a row read from
/// a file a group of chunks at a time needs no buffer the size of its largest adapter.
mod a_bytes {
    use serde::{Deserialize, Deserializer, Serializer, de};

    pub(super) fn serialize<S: Serializer>(v: &[f32], s: S) -> Result<S::Ok, S::Error> {
        crate::protocol::f32_bytes::serialize(v, s)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<f32>, D::Error> {
        let b = Vec::<u8>::deserialize(d)?;
        let (whole, rest) = b.as_chunks::<4>();
        if !rest.is_empty() {
            return Err(de::Error::invalid_length(b.len(), &"a multiple of 4 bytes"));
        }
        Ok(whole.iter().map(|&v| f32::from_le_bytes(v)).collect())
    }
}

impl Adapter {
    /// Whether nothing was learnt.
    pub fn is_empty(&self) -> bool {
        self.a.is_empty()
    }
}

/// The fixed projection `V` of one width: column `c` of `V` is `sign[c] · H[·][class[c]]`,
/// where `H` is the Sylvester–Hadamard matrix of order `rank` and each class holds
/// `cols / rank` columns, so `V·Vᵀ = cols · I` exactly. Classes and signs are a seeded
/// shuffle: integer arithmetic, the same on every node.
#[derive(Debug)]
pub struct Projection {
    rank: usize,
    class: Vec<u8>,
    sign: Vec<f32>,
    /// `V` itself, `rank × cols` row-major, for the f32 product kernels.
    dense: Vec<f32>,
}

/// The projections built so far, by width.
type Widths = Vec<(usize, Arc<Projection>)>;

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `H[r][j]` of the Sylvester–Hadamard matrix, ±1.
fn hadamard(r: usize, j: usize) -> f32 {
    if (r & j).count_ones().is_multiple_of(2) {
        1.0
    } else {
        -1.0
    }
}

impl Projection {
    fn new(cols: usize) -> Self {
        let rank = adapter_rank(cols);
        let mut state = 0x636f_6465_646d_6573 ^ cols as u64;
        let mut order: Vec<usize> = (0..cols).collect();
        for i in (1..cols).rev() {
            let j = (splitmix(&mut state) % (i as u64 + 1)) as usize;
            order.swap(i, j);
        }
        let class = order.iter().map(|&p| (p % rank) as u8).collect();
        let sign = (0..cols)
            .map(|_| {
                if splitmix(&mut state) & 1 == 0 {
                    1.0
                } else {
                    -1.0
                }
            })
            .collect();
        let mut p = Self {
            rank,
            class,
            sign,
            dense: Vec::new(),
        };
        p.dense = (0..rank * cols)
            .map(|i| {
                let (r, c) = (i / cols, i % cols);
                p.sign[c] * hadamard(r, usize::from(p.class[c]))
            })
            .collect();
        p
    }

    /// The projection for `cols` inputs (built once per width). Members of one process look
    /// it up side by side on every product, so lookups take a read lock only.
    pub fn of(cols: usize) -> Arc<Self> {
        let cache = Self::cache();
        if let Some(p) = Self::find(&cache.read().unwrap_or_else(PoisonError::into_inner), cols) {
            return p;
        }
        let mut widths = cache.write().unwrap_or_else(PoisonError::into_inner);
        if let Some(p) = Self::find(&widths, cols) {
            return p;
        }
        let p = Arc::new(Self::new(cols));
        widths.push((cols, p.clone()));
        p
    }

    /// The projection for `cols` inputs, as [`Projection::of`], but not kept when this process
    /// has not built it yet: for a width a peer names, which must not grow the cache.
    pub fn passing(cols: usize) -> Arc<Self> {
        Self::find(
            &Self::cache().read().unwrap_or_else(PoisonError::into_inner),
            cols,
        )
        .unwrap_or_else(|| Arc::new(Self::new(cols)))
    }

    fn cache() -> &'static RwLock<Widths> {
        static CACHE: OnceLock<RwLock<Widths>> = OnceLock::new();
        CACHE.get_or_init(RwLock::default)
    }

    fn find(widths: &Widths, cols: usize) -> Option<Arc<Self>> {
        widths
            .iter()
            .find(|(c, _)| *c == cols)
            .map(|(_, p)| p.clone())
    }

    /// `V` itself, `rank × cols` row-major (entries ±1).
    pub fn matrix(&self) -> &[f32] {
        &self.dense
    }

    /// The rank (rows of `V`).
    pub fn rank(&self) -> usize {
        self.rank
    }

    fn cols(&self) -> usize {
        self.class.len()
    }

    /// `x (t × cols) · Vᵀ`, `t × rank`, in f32 (a product's input).
    pub fn down(&self, x: &[f32], t: usize) -> Vec<f32> {
        let mut z = vec![0.0f32; t * self.rank];
        if x.len() == t * self.cols() {
            matmul(&self.dense, self.rank, self.cols(), x, t, &mut z);
        }
        z
    }

    /// `x (t × cols) · Vᵀ / rank`, `t × rank`, summed in f64 (an update's input factor, which
    /// every node must compute alike).
    pub fn down_update(&self, x: &[f32], t: usize) -> Vec<f32> {
        let (cols, rank) = (self.cols(), self.rank);
        let mut z = vec![0.0f32; t * rank];
        let mut bucket = vec![0.0f64; rank];
        for (xr, zr) in x.chunks_exact(cols).zip(z.chunks_exact_mut(rank)) {
            bucket.iter_mut().for_each(|b| *b = 0.0);
            for ((&v, &c), &s) in xr.iter().zip(&self.class).zip(&self.sign) {
                bucket[c as usize] += f64::from(s) * f64::from(v);
            }
            for (r, o) in zr.iter_mut().enumerate() {
                let sum: f64 = bucket
                    .iter()
                    .enumerate()
                    .map(|(j, &b)| f64::from(hadamard(r, j)) * b)
                    .sum();
                *o = (sum / rank as f64) as f32;
            }
        }
        z
    }

    /// `y (t × cols) += w (t × rank) · V`.
    pub fn up_add(&self, w: &[f32], y: &mut [f32]) {
        let (cols, rank) = (self.cols(), self.rank);
        let mut g = vec![0.0f32; rank];
        for (wr, yr) in w.chunks_exact(rank).zip(y.chunks_exact_mut(cols)) {
            for (j, gj) in g.iter_mut().enumerate() {
                *gj = wr
                    .iter()
                    .enumerate()
                    .map(|(r, &a)| hadamard(r, j) * a)
                    .sum();
            }
            for ((o, &c), &s) in yr.iter_mut().zip(&self.class).zip(&self.sign) {
                *o += s * g[c as usize];
            }
        }
    }
}

/// For every sub-block and every shard that learnt: where its `t × L` values lie in a member's
/// answer to a product of `t` inputs, `L`, and its adapter's rows for that sub-block.
fn parts<'a>(
    shards: &[&'a Shard],
    m: usize,
    t: usize,
) -> Vec<(std::ops::Range<usize>, usize, &'a [f32])> {
    let per_sub: usize = shards.iter().map(|s| t * s.block_len).sum();
    let mut out = Vec::new();
    for s in 0..m {
        let mut offset = s * per_sub;
        for shard in shards {
            let l = shard.block_len;
            if let Some(a) = shard.adapter_block(s) {
                out.push((offset..offset + t * l, l, a));
            }
            offset += t * l;
        }
    }
    out
}

/// Rows of an adapter's tiles: a sub-block's `L × rank` values are stored as tiles of
/// [`TILE`] rows, each tile column after column, so a run of rows is read as one stream and
/// summed over the rank in registers.
pub const TILE: usize = 16;

/// Where value `(r, k)` of a sub-block of `l` rows lies among its `l × rank` adapter values.
pub fn tiled_at(l: usize, rank: usize, r: usize, k: usize) -> usize {
    let t0 = r - r % TILE;
    t0 * rank + k * TILE.min(l - t0) + (r - t0)
}

/// `out += z · A_sᵀ` over rows `first..first + out.len()` of a sub-block of `l` rows: `a` is
/// the sub-block's adapter (tiled, [`tiled_at`]), `z` one input's `x·Vᵀ` (`rank` values). Each
/// row's sum over the rank is formed first, in the rank's order, then added.
pub(crate) fn add_rows(a: &[f32], l: usize, z: &[f32], first: usize, out: &mut [f32]) {
    let rank = z.len();
    let end = (first + out.len()).min(l);
    let mut r = first;
    while r < end {
        let t0 = r - r % TILE;
        let w = TILE.min(l - t0);
        let hi = end.min(t0 + w);
        let Some(tile) = a.get(t0 * rank..(t0 + w) * rank) else {
            return;
        };
        let o = &mut out[r - first..hi - first];
        if let Ok(o) = <&mut [f32; TILE]>::try_from(&mut *o) {
            let mut acc = [0.0f32; TILE];
            for (col, &zk) in tile.as_chunks::<TILE>().0.iter().zip(z) {
                acc.iter_mut().zip(col).for_each(|(s, &v)| *s += zk * v);
            }
            o.iter_mut().zip(&acc).for_each(|(o, &v)| *o += v);
        } else {
            for (i, o) in o.iter_mut().enumerate() {
                let row = r - t0 + i;
                let sum = z
                    .iter()
                    .enumerate()
                    .map(|(k, &zk)| zk * tile[k * w + row])
                    .fold(0.0f32, |s, v| s + v);
                *o += sum;
            }
        }
        r = hi;
    }
}

/// What a sub-block's adapter adds to a compact product as its rows are computed: `a` the
/// sub-block's tiled values, `l` its rows, `z` the inputs' `x·Vᵀ` (`t × rank`).
pub(crate) struct AddRows<'a> {
    /// The sub-block's adapter ([`tiled_at`]).
    pub a: &'a [f32],
    /// Rows of the sub-block.
    pub l: usize,
    /// `x·Vᵀ`, one run of `rank` values per input.
    pub z: &'a [f32],
    /// The adapter's rank.
    pub rank: usize,
}

impl crate::compute::q8::RowWork for AddRows<'_> {
    fn before(&self, first: usize, len: usize) {
        let from = first * self.rank;
        if let Some(v) = self.a.get(from..(from + len * self.rank).min(self.a.len())) {
            prefetch(v);
        }
    }

    fn after(&self, tok: usize, first: usize, out: &mut [f32]) {
        if let Some(z) = self.z.get(tok * self.rank..(tok + 1) * self.rank) {
            add_rows(self.a, self.l, z, first, out);
        }
    }
}

/// Asks the CPU to bring `v` into cache ahead of its use; a hint, with no effect on results.
fn prefetch(v: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    for line in v.chunks(16) {
        // SAFETY: a prefetch reads nothing architecturally and never faults, and the address
        // lies in `v`.
        unsafe {
            use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
            _mm_prefetch::<_MM_HINT_T0>(line.as_ptr().cast());
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = v;
}

/// `w (rank) += Σ_r u[r] · A_s[r]`: one input's transpose product with a sub-block's adapter
/// (tiled, [`tiled_at`]) of `l = u.len()` rows.
fn add_transposed(a: &[f32], u: &[f32], w: &mut [f32]) {
    let (l, rank) = (u.len(), w.len());
    for t0 in (0..l).step_by(TILE) {
        let width = TILE.min(l - t0);
        let Some(tile) = a.get(t0 * rank..(t0 + width) * rank) else {
            return;
        };
        for (col, wk) in tile.chunks_exact(width).zip(w.iter_mut()) {
            *wk += col
                .iter()
                .zip(&u[t0..t0 + width])
                .fold(0.0f32, |s, (&v, &x)| s + v * x);
        }
    }
}

/// `x·Vᵀ` (`t × rank`) for a product of `t` inputs `x` over `shards`, what their adapters
/// multiply; `None` when none has learnt.
pub(crate) fn inputs_down(shards: &[&Shard], x: &[f32], t: usize) -> Option<Vec<f32>> {
    let learnt = shards.iter().find(|s| !s.adapter.is_empty())?;
    Some(Projection::of(learnt.cols).down(x, t))
}

/// Adds the adapters' share to a member's answer `out` to `req` over `shards` (the stage's,
/// or the embedding for a lookup), laid out as [`super::Member::compute_cpu`] lays it out;
/// nothing when no shard has learnt.
pub(crate) fn add_products(
    shards: &[&Shard],
    m: usize,
    req: &StepRequest,
    out: &mut [f32],
) -> Result<(), CodedError> {
    if shards.iter().all(|s| s.adapter.is_empty()) {
        return Ok(());
    }
    let cols = shards.first().map_or(0, |s| s.cols);
    let proj = Projection::of(cols);
    let rank = proj.rank();
    let short = || CodedError::BadRequest("the answer does not fit the adapters".into());
    match req {
        StepRequest::Matmul { t, x, .. } => {
            let t = *t as usize;
            let z = proj.down(x, t);
            for (at, l, a) in parts(shards, m, t) {
                let y = out.get_mut(at).ok_or_else(short)?;
                for (zt, yt) in z.chunks_exact(rank).zip(y.chunks_exact_mut(l)) {
                    add_rows(a, l, zt, 0, yt);
                }
            }
        }
        StepRequest::MatmulT { t, u, .. } => {
            let t = *t as usize;
            let mut w = vec![0.0f32; t * rank];
            for (at, l, a) in parts(shards, m, t) {
                let us = u.get(at).ok_or_else(short)?;
                for (ut, wt) in us.chunks_exact(l).zip(w.chunks_exact_mut(rank)) {
                    add_transposed(a, ut, wt);
                }
            }
            proj.up_add(&w, out);
        }
        StepRequest::EmbedRows { rows } => {
            let Some(e) = shards.first() else {
                return Ok(());
            };
            let (l, mut at) = (e.block_len, 0);
            let mut a = vec![0.0f32; rank];
            for s in 0..m {
                let block = e.adapter_block(s).ok_or_else(short)?;
                for &r in rows {
                    for (k, v) in a.iter_mut().enumerate() {
                        *v = *block
                            .get(tiled_at(l, rank, r as usize, k))
                            .ok_or_else(short)?;
                    }
                    let y = out.get_mut(at..at + cols).ok_or_else(short)?;
                    proj.up_add(&a, y);
                    at += cols;
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dense(p: &Projection) -> Vec<f32> {
        let cols = p.cols();
        let mut v = vec![0.0f32; p.rank() * cols];
        for r in 0..p.rank() {
            let mut e = vec![0.0f32; p.rank()];
            e[r] = 1.0;
            p.up_add(&e, &mut v[r * cols..(r + 1) * cols]);
        }
        v
    }

    #[test]
    fn the_projection_has_orthogonal_rows_of_signs() {
        for cols in [64usize, 576, 1536, 100, 7] {
            let p = Projection::new(cols);
            let v = dense(&p);
            assert!(v.iter().all(|&x| x == 1.0 || x == -1.0), "{cols}");
            for a in 0..p.rank() {
                for b in 0..p.rank() {
                    let d: f32 = (0..cols).map(|c| v[a * cols + c] * v[b * cols + c]).sum();
                    let want = if a == b { cols as f32 } else { 0.0 };
                    assert_eq!(d, want, "cols {cols}, rows {a} and {b}");
                }
            }
        }
        assert_eq!(Projection::new(576).rank(), ADAPTER_RANK);
        assert_eq!(Projection::new(24).rank(), 8);
        assert_eq!(Projection::new(100).rank(), 4);
        assert_eq!(Projection::new(7).rank(), 1);
    }

    #[test]
    fn tiled_adapters_multiply_as_their_dense_matrix_over_any_run_of_rows() {
        let rank = 8;
        for l in [1usize, 15, 16, 17, 40, 64] {
            let dense: Vec<f32> = (0..l * rank)
                .map(|i| ((i * 31 % 17) as f32 - 8.0) / 5.0)
                .collect();
            let mut tiled = vec![f32::NAN; l * rank];
            for r in 0..l {
                for k in 0..rank {
                    let at = tiled_at(l, rank, r, k);
                    assert!(
                        tiled[at].is_nan(),
                        "l {l}: ({r}, {k}) lands on a taken place"
                    );
                    tiled[at] = dense[r * rank + k];
                }
            }
            let z: Vec<f32> = (0..rank).map(|k| k as f32 * 0.25 - 1.0).collect();
            for (first, len) in [(0, l), (l / 3, l - l / 3), (l / 2, l.div_ceil(4))] {
                let mut out = vec![1.0f32; len];
                add_rows(&tiled, l, &z, first, &mut out);
                for (i, got) in out.iter().enumerate() {
                    let row = &dense[(first + i) * rank..(first + i + 1) * rank];
                    let want: f32 = 1.0 + row.iter().zip(&z).map(|(a, b)| a * b).sum::<f32>();
                    assert!(
                        (got - want).abs() <= 1e-5,
                        "l {l}, row {}: {got} {want}",
                        first + i
                    );
                }
            }
            let u: Vec<f32> = (0..l).map(|r| (r % 7) as f32 - 3.0).collect();
            let mut w = vec![0.5f32; rank];
            add_transposed(&tiled, &u, &mut w);
            for (k, got) in w.iter().enumerate() {
                let want: f32 = 0.5 + (0..l).map(|r| u[r] * dense[r * rank + k]).sum::<f32>();
                assert!(
                    (got - want).abs() <= 1e-4,
                    "l {l}, column {k}: {got} {want}"
                );
            }
        }
    }

    #[test]
    fn down_and_up_are_the_dense_products() {
        let cols = 96;
        let p = Projection::of(cols);
        let v = dense(&p);
        let x: Vec<f32> = (0..2 * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let z = p.down(&x, 2);
        let zu = p.down_update(&x, 2);
        for tok in 0..2 {
            for r in 0..p.rank() {
                let want: f32 = (0..cols).map(|c| x[tok * cols + c] * v[r * cols + c]).sum();
                let got = z[tok * p.rank() + r];
                assert!(
                    (got - want).abs() <= 1e-3 * want.abs().max(1.0),
                    "{got} {want}"
                );
                let got = zu[tok * p.rank() + r] * p.rank() as f32;
                assert!(
                    (got - want).abs() <= 1e-3 * want.abs().max(1.0),
                    "{got} {want}"
                );
            }
        }
        // (x·Vᵀ/rank)·V is in V's row space, and V·Vᵀ = cols·I: going round again scales by
        // cols / rank.
        let mut xp = vec![0.0f32; 2 * cols];
        p.up_add(&zu, &mut xp);
        let again = p.down_update(&xp, 2);
        let gain = (cols / p.rank()) as f32;
        for (a, b) in zu.iter().zip(&again) {
            assert!((a * gain - b).abs() <= 1e-5 * b.abs().max(1e-3), "{a} {b}");
        }
    }
}
