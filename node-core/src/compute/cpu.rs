//! CPU kernels: matrix products written so the compiler vectorises them (independent
//! accumulators, fixed-width chunks) and split across threads by output rows.

use super::par;

/// A weight element type the kernels read: f32, or f16 converted row by row.
pub trait WeightElem: Copy + Send + Sync + 'static {
    /// Calls `f` with `row` as f32 values, converting into `buf` when needed.
    fn with_row<R>(row: &[Self], buf: &mut Vec<f32>, f: impl FnOnce(&[f32]) -> R) -> R;
    /// `values` as f32, converted into `buf` when needed.
    fn as_f32<'a>(values: &'a [Self], buf: &'a mut Vec<f32>) -> &'a [f32];
}

impl WeightElem for f32 {
    #[inline(always)]
    fn with_row<R>(row: &[f32], _buf: &mut Vec<f32>, f: impl FnOnce(&[f32]) -> R) -> R {
        f(row)
    }

    fn as_f32<'a>(values: &'a [f32], _buf: &'a mut Vec<f32>) -> &'a [f32] {
        values
    }
}

impl WeightElem for half::f16 {
    #[inline(always)]
    fn with_row<R>(row: &[half::f16], buf: &mut Vec<f32>, f: impl FnOnce(&[f32]) -> R) -> R {
        buf.resize(row.len(), 0.0);
        f16_to_f32(row, buf);
        f(buf)
    }

    fn as_f32<'a>(values: &'a [half::f16], buf: &'a mut Vec<f32>) -> &'a [f32] {
        buf.resize(values.len(), 0.0);
        f16_to_f32(values, buf);
        buf
    }
}

/// Converts f16 to f32, eight at a time with F16C where the CPU has it.
fn f16_to_f32(src: &[half::f16], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("f16c") && std::arch::is_x86_feature_detected!("avx") {
        // SAFETY: F16C and AVX are present, checked just above.
        unsafe { f16c::convert(src, dst) };
        return;
    }
    for (d, s) in dst.iter_mut().zip(src) {
        *d = s.to_f32();
    }
}

/// F16C conversion (`vcvtph2ps`): `half`'s own conversion was measured at under 3 G values/s
/// here, slower than memory, which made f16 shards slower than f32 ones.
#[cfg(target_arch = "x86_64")]
mod f16c {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm256_cvtph_ps, _mm256_storeu_ps};

    /// Converts `min(src.len(), dst.len())` values.
    #[target_feature(enable = "avx,f16c")]
    pub(super) fn convert(src: &[half::f16], dst: &mut [f32]) {
        let n = src.len().min(dst.len());
        let (s8, s_tail) = src[..n].as_chunks::<8>();
        let (d8, d_tail) = dst[..n].as_chunks_mut::<8>();
        for (s, d) in s8.iter().zip(d8.iter_mut()) {
            // SAFETY: `s` is 8 f16 (16 bytes) and `d` 8 f32 (32 bytes), both in bounds;
            // the loads and stores are the unaligned kind.
            unsafe {
                let h = _mm_loadu_si128(s.as_ptr().cast::<__m128i>());
                _mm256_storeu_ps(d.as_mut_ptr(), _mm256_cvtph_ps(h));
            }
        }
        for (d, s) in d_tail.iter_mut().zip(s_tail) {
            *d = s.to_f32();
        }
    }
}

/// Lanes of independent accumulators in a dot product.
const LANES: usize = 16;

/// Below this many weights a product runs on one thread (thread hand-off costs more).
pub(crate) const PARALLEL_MIN_WEIGHTS: usize = 1 << 16;

/// `Σ a[i]·b[i]` with 16 independent accumulators.
#[inline(always)]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; LANES];
    let (ca, ra) = a.as_chunks::<LANES>();
    let (cb, rb) = b.as_chunks::<LANES>();
    for (x, y) in ca.iter().zip(cb) {
        for i in 0..LANES {
            acc[i] += x[i] * y[i];
        }
    }
    let mut tail = 0.0f32;
    for (x, y) in ra.iter().zip(rb) {
        tail += x * y;
    }
    // Pairwise reduction keeps the summation tree balanced.
    let mut width = LANES / 2;
    while width > 0 {
        for i in 0..width {
            acc[i] += acc[i + width];
        }
        width /= 2;
    }
    acc[0] + tail
}

/// `Σ a[i]·b[i]` in f64, in eight independent sums (it pipelines, in the same order on every
/// platform).
pub fn dot_f64<T: Copy + Into<f64>>(a: &[T], b: &[T]) -> f64 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above; the function is otherwise safe.
        return unsafe { avx2::dot_f64(a, b) };
    }
    dot_f64_portable(a, b)
}

/// The body of [`dot_f64`], inlined into each instruction-set variant (the same operations in
/// the same order, so every variant gives the same sum).
#[inline(always)]
fn dot_f64_portable<T: Copy + Into<f64>>(a: &[T], b: &[T]) -> f64 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f64; 8];
    let ((ca, ra), (cb, rb)) = (a.as_chunks::<8>(), b.as_chunks::<8>());
    let tail: f64 = ra.iter().zip(rb).map(|(&p, &q)| p.into() * q.into()).sum();
    for (p, q) in ca.iter().zip(cb) {
        for i in 0..8 {
            acc[i] += p[i].into() * q[i].into();
        }
    }
    ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) + tail
}

/// Four dot products of one weight row with four inputs, sharing the row's loads.
#[inline(always)]
fn dot4(w: &[f32], x: [&[f32]; 4]) -> [f32; 4] {
    const L: usize = 8;
    let mut acc = [[0.0f32; L]; 4];
    let n = w.len() / L * L;
    for start in (0..n).step_by(L) {
        let wc = &w[start..start + L];
        for (a, xi) in acc.iter_mut().zip(&x) {
            let xc = &xi[start..start + L];
            for i in 0..L {
                a[i] += wc[i] * xc[i];
            }
        }
    }
    let mut out = [0.0f32; 4];
    for (j, a) in acc.iter().enumerate() {
        let tail: f32 = w[n..].iter().zip(&x[j][n..]).map(|(p, q)| p * q).sum();
        out[j] = a.iter().sum::<f32>() + tail;
    }
    out
}

/// Rows `first..first + yt.len() / t` of `x · Wᵀ`, written row-major as `rows × t` into `yt`,
/// with the widest vector instructions this CPU has.
fn rows_times_inputs<W: WeightElem>(
    w: &[W],
    cols: usize,
    x: &[f32],
    t: usize,
    first: usize,
    yt: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above; the function is otherwise safe.
        unsafe { avx2::rows_times_inputs(w, cols, x, t, first, yt) };
        return;
    }
    rows_times_inputs_portable(w, cols, x, t, first, yt)
}

/// The same kernel compiled for AVX2 (8-wide instead of SSE2's 4-wide vectors).
#[cfg(target_arch = "x86_64")]
mod avx2 {
    /// See [`super::rows_times_inputs_portable`].
    #[target_feature(enable = "avx2")]
    pub(super) fn rows_times_inputs<W: super::WeightElem>(
        w: &[W],
        cols: usize,
        x: &[f32],
        t: usize,
        first: usize,
        yt: &mut [f32],
    ) {
        super::rows_times_inputs_portable(w, cols, x, t, first, yt)
    }

    /// See [`super::dot_f64`]: four f64 lanes a vector instead of SSE2's two (a projected
    /// check's dot products, on the leader's path between rounds).
    #[target_feature(enable = "avx2")]
    pub(super) fn dot_f64<T: Copy + Into<f64>>(a: &[T], b: &[T]) -> f64 {
        super::dot_f64_portable(a, b)
    }
}

/// The kernel body, inlined into each instruction-set variant.
#[inline(always)]
fn rows_times_inputs_portable<W: WeightElem>(
    w: &[W],
    cols: usize,
    x: &[f32],
    t: usize,
    first: usize,
    yt: &mut [f32],
) {
    let mut buf = Vec::new();
    for (i, out) in yt.chunks_exact_mut(t).enumerate() {
        let r = first + i;
        W::with_row(&w[r * cols..(r + 1) * cols], &mut buf, |row| {
            let mut tok = 0;
            while tok + 4 <= t {
                let xs = [0, 1, 2, 3].map(|j| &x[(tok + j) * cols..(tok + j + 1) * cols]);
                out[tok..tok + 4].copy_from_slice(&dot4(row, xs));
                tok += 4;
            }
            for (j, o) in out.iter_mut().enumerate().skip(tok) {
                *o = dot(row, &x[j * cols..(j + 1) * cols]);
            }
        });
    }
}

/// From this many tokens on, products go through a blocked SGEMM (`matrixmultiply`): it keeps
/// tiles of weights and inputs in cache and uses FMA, where the row kernel re-reads every
/// input for each weight row (prefill, batches of requests, training).
pub(crate) const GEMM_MIN_TOKENS: usize = 8;

/// A strided matrix for [`sgemm`]: its values, row stride and column stride.
#[derive(Debug, Clone, Copy)]
pub(crate) struct View<'a> {
    /// The values.
    pub data: &'a [f32],
    /// Distance between two rows.
    pub rs: usize,
    /// Distance between two columns.
    pub cs: usize,
}

impl<'a> View<'a> {
    /// A row-major matrix with `cols` columns.
    pub fn rows(data: &'a [f32], cols: usize) -> Self {
        Self {
            data,
            rs: cols,
            cs: 1,
        }
    }

    /// The transpose of a row-major matrix with `cols` columns.
    pub fn transposed(data: &'a [f32], cols: usize) -> Self {
        Self {
            data,
            rs: 1,
            cs: cols,
        }
    }

    /// Whether an `r × c` matrix with these strides fits in the values.
    fn holds(&self, r: usize, c: usize) -> bool {
        r == 0 || c == 0 || (r - 1) * self.rs + (c - 1) * self.cs < self.data.len()
    }
}

/// `c (m × n, row-major with row stride ldc) = a (m × k) · b (k × n)`: `matrixmultiply`'s
/// blocked SGEMM, the one place its raw pointers are used.
pub(crate) fn sgemm(
    m: usize,
    k: usize,
    n: usize,
    a: View<'_>,
    b: View<'_>,
    c: &mut [f32],
    ldc: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        a.holds(m, k) && b.holds(k, n) && (m - 1) * ldc + n <= c.len() && n <= ldc,
        "sgemm shapes out of bounds"
    );
    // SAFETY: the assertion above keeps every element the strides reach inside its slice.
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.data.as_ptr(),
            a.rs as isize,
            a.cs as isize,
            b.data.as_ptr(),
            b.rs as isize,
            b.cs as isize,
            0.0,
            c.as_mut_ptr(),
            ldc as isize,
            1,
        );
    }
}

/// [`rows_times_inputs`] through SGEMM: `yt (rows × t) = W[first..] · xᵀ`.
fn rows_times_inputs_gemm<W: WeightElem>(
    w: &[W],
    cols: usize,
    x: &[f32],
    t: usize,
    first: usize,
    yt: &mut [f32],
) {
    let rows = yt.len() / t;
    let mut buf = Vec::new();
    let block = &w[first * cols..(first + rows) * cols];
    let weights: &[f32] = W::as_f32(block, &mut buf);
    sgemm(
        rows,
        cols,
        t,
        View::rows(weights, cols),
        View::transposed(x, cols),
        yt,
        t,
    );
}

/// `y (t × rows) = x (t × cols) · Wᵀ` where `W` is `rows × cols` row-major (f32 or f16).
pub fn matmul<W: WeightElem>(
    w: &[W],
    rows: usize,
    cols: usize,
    x: &[f32],
    t: usize,
    y: &mut [f32],
) {
    debug_assert_eq!(w.len(), rows * cols);
    debug_assert_eq!(x.len(), t * cols);
    debug_assert_eq!(y.len(), t * rows);
    if rows == 0 || t == 0 {
        return;
    }
    let threads = par::threads();
    let parallel = threads > 1 && rows * cols >= PARALLEL_MIN_WEIGHTS;
    if t == 1 {
        if parallel {
            let chunk = rows.div_ceil(threads * 4).max(16);
            par::for_each_chunk(y, chunk, |i, out| {
                rows_times_inputs(w, cols, x, 1, i * chunk, out)
            });
        } else {
            rows_times_inputs(w, cols, x, 1, 0, y);
        }
        return;
    }
    // Compute rows × t, then transpose into t × rows.
    let mut yt = vec![0.0f32; rows * t];
    let kernel = |first: usize, out: &mut [f32]| {
        if t >= GEMM_MIN_TOKENS {
            rows_times_inputs_gemm(w, cols, x, t, first, out)
        } else {
            rows_times_inputs(w, cols, x, t, first, out)
        }
    };
    if parallel {
        let chunk_rows = rows.div_ceil(threads * 4).max(4);
        par::for_each_chunk(&mut yt, chunk_rows * t, |i, out| {
            kernel(i * chunk_rows, out)
        });
    } else {
        kernel(0, &mut yt);
    }
    for (r, vals) in yt.chunks_exact(t).enumerate() {
        for (tok, &v) in vals.iter().enumerate() {
            y[tok * rows + r] = v;
        }
    }
}

/// `y (t × cols) = x (t × rows) · W`: the transpose product, for the backward pass.
pub fn matmul_transpose(w: &[f32], rows: usize, cols: usize, x: &[f32], t: usize, y: &mut [f32]) {
    debug_assert_eq!(w.len(), rows * cols);
    debug_assert_eq!(x.len(), t * rows);
    debug_assert_eq!(y.len(), t * cols);
    if t >= GEMM_MIN_TOKENS && cols > 0 && rows > 0 {
        let gemm = |first: usize, out: &mut [f32]| {
            let m = out.len() / cols;
            let inputs = View::rows(&x[first * rows..], rows);
            sgemm(m, rows, cols, inputs, View::rows(w, cols), out, cols);
        };
        let threads = par::threads();
        if threads > 1 && rows * cols >= PARALLEL_MIN_WEIGHTS {
            let chunk = t.div_ceil(threads).max(1);
            par::for_each_chunk(y, chunk * cols, |i, out| gemm(i * chunk, out));
        } else {
            gemm(0, y);
        }
        return;
    }
    let work = |tok: usize, out: &mut [f32]| {
        out.fill(0.0);
        for (r, row) in w.chunks_exact(cols).enumerate() {
            let a = x[tok * rows + r];
            if a != 0.0 {
                for (o, &v) in out.iter_mut().zip(row) {
                    *o += a * v;
                }
            }
        }
    };
    if cols == 0 {
        return;
    }
    if par::threads() > 1 && t > 1 && rows * cols >= PARALLEL_MIN_WEIGHTS {
        par::for_each_chunk(y, cols, work);
    } else {
        for (tok, out) in y.chunks_exact_mut(cols).enumerate() {
            work(tok, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    fn naive(w: &[f32], rows: usize, cols: usize, x: &[f32], t: usize) -> Vec<f64> {
        let mut y = vec![0.0; t * rows];
        for tok in 0..t {
            for r in 0..rows {
                y[tok * rows + r] = (0..cols)
                    .map(|c| w[r * cols + c] as f64 * x[tok * cols + c] as f64)
                    .sum();
            }
        }
        y
    }

    /// f32 accumulation over `cols` terms of magnitude ≤ 1: error ≤ cols·ε·Σ|terms|; we
    /// check against 1e-5 · (Σ|w·x| + 1), far above that and far below a wrong index.
    fn close(got: &[f32], want: &[f64], scale: f64) {
        for (g, w) in got.iter().zip(want) {
            assert!((*g as f64 - w).abs() <= 1e-5 * scale, "got {g}, want {w}");
        }
    }

    #[test]
    fn matmul_matches_naive_on_ragged_shapes() {
        for &(rows, cols) in &[(1, 1), (3, 7), (17, 33), (64, 576), (300, 250), (513, 100)] {
            for t in (1..=9).chain([16, 37]) {
                let w = data(rows * cols, (rows * 31 + cols) as u32);
                let x = data(t * cols, t as u32);
                let mut y = vec![0.0f32; t * rows];
                matmul(&w, rows, cols, &x, t, &mut y);
                close(&y, &naive(&w, rows, cols, &x, t), cols as f64);
            }
        }
    }

    #[test]
    fn f16_conversion_matches_half_exactly() {
        let src: Vec<half::f16> = (0..1003u16)
            .map(|i| half::f16::from_bits(i.wrapping_mul(65)))
            .collect();
        let mut dst = vec![0.0f32; src.len()];
        f16_to_f32(&src, &mut dst);
        for (s, d) in src.iter().zip(&dst) {
            assert!(s.to_f32() == *d || (s.is_nan() && d.is_nan()), "{s} -> {d}");
        }
    }

    #[test]
    fn f16_weights_match_their_f32_values() {
        let (rows, cols) = (70, 130);
        for t in [1, 3, 6, 12] {
            let w = data(rows * cols, 12);
            let w16: Vec<half::f16> = w.iter().map(|&v| half::f16::from_f32(v)).collect();
            let w32: Vec<f32> = w16.iter().map(|v| v.to_f32()).collect();
            let x = data(t * cols, 6);
            let mut y = vec![0.0f32; t * rows];
            matmul(&w16, rows, cols, &x, t, &mut y);
            close(&y, &naive(&w32, rows, cols, &x, t), cols as f64);
        }
    }

    #[test]
    fn transpose_product_matches_naive() {
        for (rows, cols, t) in [
            (37, 300, 1),
            (37, 300, 2),
            (37, 300, 5),
            (37, 300, 9),
            (300, 290, 33),
        ] {
            let w = data(rows * cols, 9);
            let x = data(t * rows, 4);
            let mut y = vec![0.0f32; t * cols];
            matmul_transpose(&w, rows, cols, &x, t, &mut y);
            // Wᵀ is cols × rows: build it and reuse the naive product.
            let mut wt = vec![0.0f32; rows * cols];
            for r in 0..rows {
                for c in 0..cols {
                    wt[c * rows + r] = w[r * cols + c];
                }
            }
            close(&y, &naive(&wt, cols, rows, &x, t), rows as f64);
        }
    }

    #[test]
    fn every_instruction_set_variant_gives_identical_bits() {
        // Rust never reassociates float sums, so vector width cannot change the result.
        let (rows, cols, t) = (37, 333, 5);
        let w = data(rows * cols, 8);
        let x = data(t * cols, 2);
        let mut dispatched = vec![0.0f32; rows * t];
        rows_times_inputs(&w, cols, &x, t, 0, &mut dispatched);
        let mut portable = vec![0.0f32; rows * t];
        rows_times_inputs_portable(&w, cols, &x, t, 0, &mut portable);
        assert_eq!(dispatched, portable);
    }

    #[test]
    fn threaded_and_single_threaded_paths_agree() {
        let (rows, cols) = (1024, 576);
        let w = data(rows * cols, 3);
        let x = data(3 * cols, 5);
        let mut threaded = vec![0.0f32; 3 * rows];
        matmul(&w, rows, cols, &x, 3, &mut threaded);
        let mut single = vec![0.0f32; 3 * rows];
        rows_times_inputs(&w, cols, &x, 3, 0, &mut single);
        for r in 0..rows {
            for tok in 0..3 {
                assert_eq!(threaded[tok * rows + r], single[r * 3 + tok]);
            }
        }
    }
}
