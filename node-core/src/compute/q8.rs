//! Kernels for compact weights: integers (i8, or i16 for the wider sums of a parity row) with
//! one f16 scale per [`Q8_BLOCK`] values of a row, multiplied without first converting the
//! matrix (dequantise and multiply fused per block).

use super::cpu::{GEMM_MIN_TOKENS, PARALLEL_MIN_WEIGHTS, View, dot, sgemm};
use super::par;

/// Values of a row that share one scale.
pub const Q8_BLOCK: usize = 32;

/// Scales per row of `cols` values.
pub fn blocks_per_row(cols: usize) -> usize {
    cols.div_ceil(Q8_BLOCK)
}

/// An integer type compact values are stored in.
pub trait CodedInt: Copy + Send + Sync + Into<f32> + 'static {
    /// Eight values from `p`, widened to f32.
    ///
    /// # Safety
    /// `p` must point at eight readable values, and the CPU must have AVX2.
    #[cfg(target_arch = "x86_64")]
    unsafe fn widen8(p: *const Self) -> std::arch::x86_64::__m256;

    /// Sixteen values from `p`, widened to f32.
    ///
    /// # Safety
    /// `p` must point at sixteen readable values, and the CPU must have AVX-512F.
    #[cfg(target_arch = "x86_64")]
    unsafe fn widen16(p: *const Self) -> std::arch::x86_64::__m512;
}

impl CodedInt for i8 {
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn widen8(p: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the caller guarantees eight readable bytes at `p` and AVX2.
        unsafe { _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i))) }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn widen16(p: *const Self) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: the caller guarantees sixteen readable bytes at `p` and AVX-512F.
        unsafe { _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i))) }
    }
}

impl CodedInt for i16 {
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn widen8(p: *const Self) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: the caller guarantees sixteen readable bytes at `p` and AVX2.
        unsafe { _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm_loadu_si128(p as *const __m128i))) }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn widen16(p: *const Self) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // SAFETY: the caller guarantees 32 readable bytes at `p` and AVX-512F.
        unsafe {
            _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm256_loadu_si256(
                p as *const __m256i,
            )))
        }
    }
}

/// A compact matrix's integers: i8, or i16 where a parity row's sums need more than 8 bits.
#[derive(Debug, Clone, Copy)]
pub enum Ints<'a> {
    /// One byte each.
    I8(&'a [i8]),
    /// Two bytes each.
    I16(&'a [i16]),
}

impl<'a> Ints<'a> {
    /// Number of values.
    pub fn len(&self) -> usize {
        match self {
            Self::I8(v) => v.len(),
            Self::I16(v) => v.len(),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Values `range` of them.
    pub fn slice(&self, range: std::ops::Range<usize>) -> Ints<'a> {
        match *self {
            Self::I8(v) => Self::I8(&v[range]),
            Self::I16(v) => Self::I16(&v[range]),
        }
    }
}

/// Row `r` of a compact matrix as f32, written into `out` (`cols` values).
pub fn dequantize_row(q: Ints<'_>, scales: &[half::f16], cols: usize, r: usize, out: &mut [f32]) {
    let isa = Isa::best();
    match q {
        Ints::I8(q) => dequantize_row_of(q, scales, cols, r, out, isa),
        Ints::I16(q) => dequantize_row_of(q, scales, cols, r, out, isa),
    }
}

/// [`dequantize_row`] for values of type `T`, with the instructions `isa` (which this CPU has).
fn dequantize_row_of<T: CodedInt>(
    q: &[T],
    scales: &[half::f16],
    cols: usize,
    r: usize,
    out: &mut [f32],
    isa: Isa,
) {
    let nb = blocks_per_row(cols);
    let (row, scales, out) = (
        &q[r * cols..(r + 1) * cols],
        &scales[r * nb..(r + 1) * nb],
        &mut out[..cols],
    );
    let done = match isa {
        // SAFETY: `isa` is [`Isa::best`] or below it, and AVX-512 is picked only with AVX2:
        // this CPU has AVX2. A store-bound loop gains nothing from wider vectors.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx2 => unsafe { avx2::dequantize(row, scales, out) },
        _ => 0,
    };
    for ((o, qs), s) in out[done..]
        .chunks_mut(Q8_BLOCK)
        .zip(row[done..].chunks(Q8_BLOCK))
        .zip(&scales[done / Q8_BLOCK..])
    {
        let s = s.to_f32();
        for (o, &v) in o.iter_mut().zip(qs) {
            *o = s * v.into();
        }
    }
}

/// `Σ_b s_b · Σ_i q[b·32 + i] · x[b·32 + i]` for one row, the portable way.
#[inline(always)]
fn dot_q8_portable<T: CodedInt>(q: &[T], scales: &[half::f16], x: &[f32]) -> f32 {
    let mut total = [0.0f32; 8];
    let mut tail = 0.0f32;
    for ((qs, xs), s) in q.chunks(Q8_BLOCK).zip(x.chunks(Q8_BLOCK)).zip(scales) {
        let s = s.to_f32();
        if qs.len() == Q8_BLOCK {
            let mut acc = [0.0f32; 8];
            for (qc, xc) in qs.as_chunks::<8>().0.iter().zip(xs.as_chunks::<8>().0) {
                for i in 0..8 {
                    acc[i] += qc[i].into() * xc[i];
                }
            }
            for i in 0..8 {
                total[i] += s * acc[i];
            }
        } else {
            let part: f32 = qs.iter().zip(xs).map(|(&a, &b)| a.into() * b).sum();
            tail += s * part;
        }
    }
    total.iter().sum::<f32>() + tail
}

/// The sum of a row's last, partial block (the values past its whole blocks), scaled: what the
/// vector kernels leave.
#[cfg(target_arch = "x86_64")]
fn partial_block<T: CodedInt>(q: &[T], scales: &[half::f16], x: &[f32]) -> f32 {
    let full = q.len() / Q8_BLOCK;
    let done = full * Q8_BLOCK;
    if done == q.len() {
        return 0.0;
    }
    let part: f32 = q[done..]
        .iter()
        .zip(&x[done..])
        .map(|(&a, &v)| a.into() * v)
        .sum();
    scales[full].to_f32() * part
}

/// A row's length and whole blocks, for the kernels of [`dot_q8_tokens`], once `x` is seen to
/// hold `n` inputs of that length, `scales` the row's blocks and `out` room for `n` sums.
#[cfg(target_arch = "x86_64")]
fn many_shapes<T>(
    q: &[T],
    scales: &[half::f16],
    x: &[f32],
    out: &[f32],
    n: usize,
) -> (usize, usize) {
    let (cols, full) = (q.len(), q.len() / Q8_BLOCK);
    assert!(
        x.len() >= n * cols && scales.len() >= full && out.len() >= n,
        "dot_q8_many shapes"
    );
    (cols, full)
}

/// How many bytes ahead of the block it reads a kernel asks for a row's values: on the 2-core
/// machine a row's product read 4–5 GB/s of a core's 12 without it, 7–8 at 1024 values
/// ahead, and 9 (i8) and 12 (i16) at 2.5 to 4 KB (docs/perf.md).
#[cfg(target_arch = "x86_64")]
const PREFETCH_BYTES: usize = 3072;

/// Asks for the bytes [`PREFETCH_BYTES`] past block `b`'s start to be cached: the kernels
/// call it every block (a cache line is two blocks of i8, one of i16). A hint, which never
/// faults, in bounds or not.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch<T>(q: &[T], b: usize) {
    prefetch_ahead(q.as_ptr().wrapping_add(b * Q8_BLOCK) as *const u8);
}

/// Asks for the bytes [`PREFETCH_BYTES`] past `at` to be cached (the 4-bit kernels too: at
/// their instructions a byte a core keeps too few reads in flight on its own). A hint, which
/// never faults, in bounds or not.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) fn prefetch_ahead(at: *const u8) {
    use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
    let at = at.wrapping_add(PREFETCH_BYTES) as *const i8;
    // SAFETY: SSE is in every x86-64 CPU, and a prefetch reads nothing the program sees.
    unsafe { _mm_prefetch::<_MM_HINT_T0>(at) };
}

/// The dot product with AVX2, FMA and F16C: eight values widened to f32 at a time.
#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    use std::arch::x86_64::*;

    /// A scale as f32 (F16C), inlined into the kernels' loops.
    #[inline]
    #[target_feature(enable = "f16c")]
    pub(in crate::compute) fn scale_f32(h: half::f16) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(h.to_bits()))))
    }

    /// See [`super::dot_q8_portable`]; the same sum, grouped differently.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn dot_q8<T: super::CodedInt>(q: &[T], scales: &[half::f16], x: &[f32]) -> f32 {
        let full = q.len() / super::Q8_BLOCK;
        assert!(x.len() >= q.len() && scales.len() >= full, "dot_q8 shapes");
        let mut t0 = _mm256_setzero_ps();
        let mut t1 = _mm256_setzero_ps();
        for (b, &h) in scales[..full].iter().enumerate() {
            super::prefetch(q, b);
            // SAFETY: block `b` is in bounds of `q` and `x` (asserted above); unaligned loads;
            // this function runs only where AVX2 is (its callers check).
            unsafe {
                let qp = q.as_ptr().add(b * 32);
                let xp = x.as_ptr().add(b * 32);
                let mut acc = _mm256_mul_ps(T::widen8(qp), _mm256_loadu_ps(xp));
                acc = _mm256_fmadd_ps(T::widen8(qp.add(8)), _mm256_loadu_ps(xp.add(8)), acc);
                let mut acc2 = _mm256_mul_ps(T::widen8(qp.add(16)), _mm256_loadu_ps(xp.add(16)));
                acc2 = _mm256_fmadd_ps(T::widen8(qp.add(24)), _mm256_loadu_ps(xp.add(24)), acc2);
                let s = _mm256_set1_ps(scale_f32(h));
                if b % 2 == 0 {
                    t0 = _mm256_fmadd_ps(_mm256_add_ps(acc, acc2), s, t0);
                } else {
                    t1 = _mm256_fmadd_ps(_mm256_add_ps(acc, acc2), s, t1);
                }
            }
        }
        let t = _mm256_add_ps(t0, t1);
        let mut lanes = [0.0f32; 8];
        // SAFETY: `lanes` holds eight f32.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), t) };
        lanes.iter().sum::<f32>() + super::partial_block(q, scales, x)
    }

    /// [`dot_q8`] of one row with `N` inputs (`x` holds them one after another, a row's length
    /// each) into `out`: each block is widened once for all of them.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn dot_q8_many<T: super::CodedInt, const N: usize>(
        q: &[T],
        scales: &[half::f16],
        x: &[f32],
        out: &mut [f32],
    ) {
        let (cols, full) = super::many_shapes(q, scales, x, out, N);
        let mut acc = [_mm256_setzero_ps(); N];
        for (b, &h) in scales[..full].iter().enumerate() {
            super::prefetch(q, b);
            // SAFETY: block `b` is in bounds of `q` and of each of the `N` inputs in `x`
            // (`many_shapes`); unaligned loads; this function runs only where AVX2 is.
            unsafe {
                let qp = q.as_ptr().add(b * 32);
                let w = [
                    T::widen8(qp),
                    T::widen8(qp.add(8)),
                    T::widen8(qp.add(16)),
                    T::widen8(qp.add(24)),
                ];
                let s = _mm256_set1_ps(scale_f32(h));
                for (j, a) in acc.iter_mut().enumerate() {
                    let xp = x.as_ptr().add(j * cols + b * 32);
                    let mut p = _mm256_mul_ps(w[0], _mm256_loadu_ps(xp));
                    p = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xp.add(8)), p);
                    p = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xp.add(16)), p);
                    p = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xp.add(24)), p);
                    *a = _mm256_fmadd_ps(p, s, *a);
                }
            }
        }
        for (j, (a, o)) in acc.iter().zip(out.iter_mut()).enumerate() {
            let mut lanes = [0.0f32; 8];
            // SAFETY: `lanes` holds eight f32.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), *a) };
            *o = lanes.iter().sum::<f32>()
                + super::partial_block(q, scales, &x[j * cols..(j + 1) * cols]);
        }
    }

    /// A row's whole blocks as f32 (`s_b · q`, exactly the portable products); returns how many
    /// values it wrote.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn dequantize<T: super::CodedInt>(
        q: &[T],
        scales: &[half::f16],
        out: &mut [f32],
    ) -> usize {
        let full = q.len() / super::Q8_BLOCK;
        assert!(
            out.len() >= q.len() && scales.len() >= full,
            "dequantize shapes"
        );
        for (b, &h) in scales[..full].iter().enumerate() {
            // SAFETY: block `b` is in bounds of `q` and `out` (asserted above); unaligned
            // loads and stores; this function runs only where AVX2 is (its callers check).
            unsafe {
                let s = _mm256_set1_ps(scale_f32(h));
                let (qp, op) = (q.as_ptr().add(b * 32), out.as_mut_ptr().add(b * 32));
                for i in [0, 8, 16, 24] {
                    _mm256_storeu_ps(op.add(i), _mm256_mul_ps(T::widen8(qp.add(i)), s));
                }
            }
        }
        full * super::Q8_BLOCK
    }
}

/// The dot product with AVX-512F: sixteen values widened to f32 at a time, so half the loads
/// of the AVX2 kernel.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// The scales of the row's blocks `first..first + 16` as f32 (fewer at its end, the rest of
    /// `out` left as it was), so the kernels broadcast each from memory instead of converting
    /// it there.
    #[inline]
    #[target_feature(enable = "avx512f,f16c")]
    fn scales16(scales: &[half::f16], first: usize, full: usize, out: &mut [f32; 16]) {
        let n = (full - first).min(16);
        if n == 16 {
            // SAFETY: blocks `first..first + 16` are in bounds of `scales`; unaligned load.
            unsafe {
                let h = _mm256_loadu_si256(scales.as_ptr().add(first) as *const __m256i);
                _mm512_storeu_ps(out.as_mut_ptr(), _mm512_cvtph_ps(h));
            }
        } else {
            for (o, s) in out.iter_mut().zip(&scales[first..first + n]) {
                *o = s.to_f32();
            }
        }
    }

    /// See [`super::dot_q8_portable`]; the same sum, grouped differently.
    #[target_feature(enable = "avx512f,f16c")]
    pub(super) fn dot_q8<T: super::CodedInt>(q: &[T], scales: &[half::f16], x: &[f32]) -> f32 {
        let full = q.len() / super::Q8_BLOCK;
        assert!(x.len() >= q.len() && scales.len() >= full, "dot_q8 shapes");
        let mut t0 = _mm512_setzero_ps();
        let mut t1 = _mm512_setzero_ps();
        let mut s16 = [0.0f32; 16];
        for b in 0..full {
            if b % 16 == 0 {
                scales16(scales, b, full, &mut s16);
            }
            super::prefetch(q, b);
            // SAFETY: block `b` is in bounds of `q` and `x` (asserted above); unaligned loads;
            // this function runs only where AVX-512F is (its callers check).
            unsafe {
                let qp = q.as_ptr().add(b * 32);
                let xp = x.as_ptr().add(b * 32);
                let lo = _mm512_mul_ps(T::widen16(qp), _mm512_loadu_ps(xp));
                let both = _mm512_fmadd_ps(T::widen16(qp.add(16)), _mm512_loadu_ps(xp.add(16)), lo);
                let s = _mm512_set1_ps(s16[b % 16]);
                if b % 2 == 0 {
                    t0 = _mm512_fmadd_ps(both, s, t0);
                } else {
                    t1 = _mm512_fmadd_ps(both, s, t1);
                }
            }
        }
        _mm512_reduce_add_ps(_mm512_add_ps(t0, t1)) + super::partial_block(q, scales, x)
    }

    /// See [`super::avx2::dot_q8_many`]; each block's values are scaled once for all `N`
    /// inputs, and each input sums its blocks' halves in two chains.
    #[target_feature(enable = "avx512f,f16c")]
    pub(super) fn dot_q8_many<T: super::CodedInt, const N: usize>(
        q: &[T],
        scales: &[half::f16],
        x: &[f32],
        out: &mut [f32],
    ) {
        let (cols, full) = super::many_shapes(q, scales, x, out, N);
        let mut lo_acc = [_mm512_setzero_ps(); N];
        let mut hi_acc = [_mm512_setzero_ps(); N];
        let mut s16 = [0.0f32; 16];
        for b in 0..full {
            if b % 16 == 0 {
                scales16(scales, b, full, &mut s16);
            }
            super::prefetch(q, b);
            // SAFETY: block `b` is in bounds of `q` and of each of the `N` inputs in `x`
            // (`many_shapes`); unaligned loads; this function runs only where AVX-512F is.
            unsafe {
                let qp = q.as_ptr().add(b * 32);
                let s = _mm512_set1_ps(s16[b % 16]);
                let lo = _mm512_mul_ps(T::widen16(qp), s);
                let hi = _mm512_mul_ps(T::widen16(qp.add(16)), s);
                for j in 0..N {
                    let xp = x.as_ptr().add(j * cols + b * 32);
                    lo_acc[j] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xp), lo_acc[j]);
                    hi_acc[j] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xp.add(16)), hi_acc[j]);
                }
            }
        }
        for (j, o) in out.iter_mut().enumerate().take(N) {
            *o = _mm512_reduce_add_ps(_mm512_add_ps(lo_acc[j], hi_acc[j]))
                + super::partial_block(q, scales, &x[j * cols..(j + 1) * cols]);
        }
    }
}

/// The instructions the kernels use, picked once per product ([`Isa::best`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(
    not(target_arch = "x86_64"),
    expect(dead_code, reason = "the x86-64 kernels' variants")
)]
pub(super) enum Isa {
    /// Plain Rust (any CPU, wasm).
    Portable,
    /// AVX2, FMA and F16C.
    Avx2,
    /// AVX-512F (with F16C).
    Avx512,
}

impl Isa {
    /// The best this CPU runs.
    pub(super) fn best() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c");
            if avx2 && std::arch::is_x86_feature_detected!("avx512f") {
                return Self::Avx512;
            }
            if avx2 {
                return Self::Avx2;
            }
        }
        Self::Portable
    }

    /// Every kernel this CPU runs (for tests: they must agree).
    #[cfg(test)]
    pub(super) fn available() -> Vec<Self> {
        [Self::Portable, Self::Avx2, Self::Avx512]
            .into_iter()
            .filter(|&k| k == Self::Portable || k as u8 <= Self::best() as u8)
            .collect()
    }
}

/// One row's dot product with the instructions `isa` (which this CPU has).
#[inline]
fn dot_q8<T: CodedInt>(q: &[T], scales: &[half::f16], x: &[f32], isa: Isa) -> f32 {
    match isa {
        // SAFETY: `isa` is [`Isa::best`] or below it: this CPU has its instructions.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::dot_q8(q, scales, x) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::dot_q8(q, scales, x) },
        _ => dot_q8_portable(q, scales, x),
    }
}

/// One row's dot products with the inputs in `x` (`out.len()` of them, fewer than
/// [`GEMM_MIN_TOKENS`]) with the instructions `isa`, each block widened once for all of them;
/// false where no vector kernel takes them.
fn dot_q8_tokens<T: CodedInt>(
    q: &[T],
    scales: &[half::f16],
    x: &[f32],
    out: &mut [f32],
    isa: Isa,
) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        macro_rules! kernels {
            ($($n:literal)*) => {
                match (isa, out.len()) {
                    $(
                        // SAFETY: `isa` is [`Isa::best`] or below it: this CPU has its
                        // instructions.
                        (Isa::Avx512, $n) => unsafe { avx512::dot_q8_many::<T, $n>(q, scales, x, out) },
                        // SAFETY: as above.
                        (Isa::Avx2, $n) => unsafe { avx2::dot_q8_many::<T, $n>(q, scales, x, out) },
                    )*
                    _ => return false,
                }
            };
        }
        kernels!(2 3 4 5 6 7);
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (q, scales, x, out, isa);
        false
    }
}

/// A compact matrix: `rows × cols` integers, row-major, and `rows × ⌈cols / 32⌉` scales.
#[derive(Debug, Clone, Copy)]
pub struct Q8Matrix<'a> {
    /// The values.
    pub q: Ints<'a>,
    /// One scale per block of a row.
    pub scales: &'a [half::f16],
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
}

/// Most values of a matrix a product holds dequantised at once (4 MiB of f32).
const DENSE_TILE_VALUES: usize = 1 << 20;

/// Rows `first..` of `x · Wᵀ` (`rows × t` into `yt`) for values `q` (`w`'s) of type `T`,
/// fused per row, or through SGEMM on dequantised rows for many tokens.
fn rows_times_inputs<T: CodedInt>(
    q: &[T],
    w: Q8Matrix<'_>,
    x: &[f32],
    t: usize,
    first: usize,
    yt: &mut [f32],
    isa: Isa,
) {
    let Q8Matrix { scales, cols, .. } = w;
    let nb = blocks_per_row(cols);
    let rows = yt.len() / t;
    if t >= GEMM_MIN_TOKENS {
        // A tile of rows at a time, dequantised: a large matrix (an LM head) is never held
        // in f32, whatever the rows a thread takes.
        let tile = (DENSE_TILE_VALUES / cols.max(1)).clamp(1, rows.max(1));
        let mut dense = vec![0.0f32; tile * cols];
        for (i, out) in yt.chunks_mut(tile * t).enumerate() {
            let n = out.len() / t;
            let dense = &mut dense[..n * cols];
            for (j, row) in dense.chunks_exact_mut(cols.max(1)).enumerate() {
                dequantize_row_of(q, scales, cols, first + i * tile + j, row, isa);
            }
            sgemm(
                n,
                cols,
                t,
                View::rows(dense, cols),
                View::transposed(x, cols),
                out,
                t,
            );
        }
        return;
    }
    let mut row = Vec::new();
    for (i, out) in yt.chunks_exact_mut(t).enumerate() {
        let r = first + i;
        let (qr, sr) = (&q[r * cols..(r + 1) * cols], &scales[r * nb..(r + 1) * nb]);
        if t == 1 {
            out[0] = dot_q8(qr, sr, x, isa);
            continue;
        }
        if dot_q8_tokens(qr, sr, x, out, isa) {
            continue;
        }
        row.resize(cols, 0.0);
        dequantize_row_of(q, scales, cols, r, &mut row, isa);
        for (tok, o) in out.iter_mut().enumerate() {
            *o = dot(&row, &x[tok * cols..(tok + 1) * cols]);
        }
    }
}

/// `y (t × rows) = x (t × cols) · Wᵀ` for a compact `W`.
pub fn matmul_q8(w: Q8Matrix<'_>, x: &[f32], t: usize, y: &mut [f32]) {
    matmul_q8_then(w, x, t, y, &NoRowWork);
}

/// Work a product does on its rows beside the integers' dot products, on the thread that
/// computes them: per chunk of rows for one input, per token over all rows for more.
pub trait RowWork: Sync {
    /// Before rows `first..first + len` are computed (to fetch what `after` reads).
    fn before(&self, first: usize, len: usize);
    /// On token `tok`'s outputs of rows `first..first + out.len()`, just computed.
    fn after(&self, tok: usize, first: usize, out: &mut [f32]);
}

/// No work beside the product.
pub(crate) struct NoRowWork;

impl RowWork for NoRowWork {
    fn before(&self, _: usize, _: usize) {}
    fn after(&self, _: usize, _: usize, _: &mut [f32]) {}
}

/// [`matmul_q8`], with `work` on the rows as they are computed, while they are in cache.
pub fn matmul_q8_then(w: Q8Matrix<'_>, x: &[f32], t: usize, y: &mut [f32], work: &dyn RowWork) {
    debug_assert_eq!(w.q.len(), w.rows * w.cols);
    debug_assert_eq!(w.scales.len(), w.rows * blocks_per_row(w.cols));
    debug_assert_eq!(x.len(), t * w.cols);
    debug_assert_eq!(y.len(), t * w.rows);
    let isa = Isa::best();
    match w.q {
        Ints::I8(q) => matmul_of(q, w, x, t, y, isa, work),
        Ints::I16(q) => matmul_of(q, w, x, t, y, isa, work),
    }
}

/// [`matmul_q8_then`] for values `q` (`w`'s) of type `T`, with the instructions `isa`.
fn matmul_of<T: CodedInt>(
    q: &[T],
    w: Q8Matrix<'_>,
    x: &[f32],
    t: usize,
    y: &mut [f32],
    isa: Isa,
    work: &dyn RowWork,
) {
    let (rows, cols) = (w.rows, w.cols);
    if rows == 0 || t == 0 {
        return;
    }
    let threads = par::threads();
    // The f32 kernel's threshold in weights: a quarter of its bytes, but a member's small
    // products (q, k, v, o) then split too, so three members share two threads evenly (a 4×
    // higher one left them whole: 6% slower decode over six paired runs).
    let parallel = threads > 1 && rows * cols >= PARALLEL_MIN_WEIGHTS;
    if t == 1 {
        if parallel {
            // Whole runs of 16 rows, as an adapter's tiles (`coded::TILE`) lie.
            let chunk = rows.div_ceil(threads * 4).next_multiple_of(16);
            par::for_each_chunk(y, chunk, |i, out| {
                work.before(i * chunk, out.len());
                rows_times_inputs(q, w, x, 1, i * chunk, out, isa);
                work.after(0, i * chunk, out);
            });
        } else {
            work.before(0, rows);
            rows_times_inputs(q, w, x, 1, 0, y, isa);
            work.after(0, 0, y);
        }
        return;
    }
    let mut yt = vec![0.0f32; rows * t];
    if parallel {
        let chunk_rows = rows.div_ceil(threads * 4).max(4);
        par::for_each_chunk(&mut yt, chunk_rows * t, |i, out| {
            rows_times_inputs(q, w, x, t, i * chunk_rows, out, isa)
        });
    } else {
        rows_times_inputs(q, w, x, t, 0, &mut yt, isa);
    }
    for (r, vals) in yt.chunks_exact(t).enumerate() {
        for (tok, &v) in vals.iter().enumerate() {
            y[tok * rows + r] = v;
        }
    }
    for (tok, out) in y.chunks_exact_mut(rows).enumerate() {
        work.after(tok, 0, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn compact(rows: usize, cols: usize, seed: u32) -> (Vec<i16>, Vec<half::f16>) {
        let mut next = crate::compute::xorshift(seed);
        let q = (0..rows * cols)
            .map(|_| (next() % 1017) as i16 - 508)
            .collect();
        let scales = (0..rows * blocks_per_row(cols))
            .map(|_| half::f16::from_f32(1e-3 * (1 + next() % 100) as f32))
            .collect();
        (q, scales)
    }

    fn naive(
        q: Ints<'_>,
        s: &[half::f16],
        rows: usize,
        cols: usize,
        x: &[f32],
        t: usize,
    ) -> Vec<f64> {
        let mut row = vec![0.0f32; cols];
        let mut y = vec![0.0f64; t * rows];
        for r in 0..rows {
            dequantize_row(q, s, cols, r, &mut row);
            for tok in 0..t {
                y[tok * rows + r] = row
                    .iter()
                    .zip(&x[tok * cols..(tok + 1) * cols])
                    .map(|(&a, &b)| f64::from(a) * f64::from(b))
                    .sum();
            }
        }
        y
    }

    /// The same values as i16 and, clamped to ±127, as i8: both kernels' widths.
    fn widths(q: &[i16]) -> (Vec<i16>, Vec<i8>) {
        (
            q.to_vec(),
            q.iter().map(|&v| v.clamp(-127, 127) as i8).collect(),
        )
    }

    #[test]
    fn every_kernel_dequantises_rows_exactly_as_the_portable_loop() {
        for &(rows, cols) in &[(1, 1), (3, 31), (2, 32), (4, 100), (3, 576)] {
            let (q, s) = compact(rows, cols, (rows * 7 + cols) as u32);
            let (wide, narrow) = widths(&q);
            for r in 0..rows {
                let want: Vec<f32> = q[r * cols..(r + 1) * cols]
                    .iter()
                    .enumerate()
                    .map(|(i, &v)| s[r * blocks_per_row(cols) + i / Q8_BLOCK].to_f32() * v as f32)
                    .collect();
                for isa in Isa::available() {
                    let mut got = vec![f32::NAN; cols];
                    dequantize_row_of(&wide, &s, cols, r, &mut got, isa);
                    assert_eq!(got, want, "{isa:?} i16 {rows}×{cols} row {r}");
                    dequantize_row_of(&narrow, &s, cols, r, &mut got, isa);
                    let clamped: Vec<f32> = q[r * cols..(r + 1) * cols]
                        .iter()
                        .enumerate()
                        .map(|(i, &v)| {
                            s[r * blocks_per_row(cols) + i / Q8_BLOCK].to_f32()
                                * f32::from(v.clamp(-127, 127) as i8)
                        })
                        .collect();
                    assert_eq!(got, clamped, "{isa:?} i8 {rows}×{cols} row {r}");
                }
            }
        }
    }

    #[test]
    fn fused_products_match_the_dequantised_matrix_on_ragged_shapes() {
        for &(rows, cols) in &[(1, 1), (3, 31), (5, 32), (17, 100), (300, 576), (700, 1536)] {
            let (q, s) = compact(rows, cols, (rows * 31 + cols) as u32);
            let (wide, narrow) = widths(&q);
            for ints in [Ints::I16(&wide), Ints::I8(&narrow)] {
                for t in [1, 2, 5, 9] {
                    let x: Vec<f32> = (0..t * cols)
                        .map(|i| ((i * 7919) % 997) as f32 / 500.0 - 1.0)
                        .collect();
                    let mut y = vec![0.0f32; t * rows];
                    let w = Q8Matrix {
                        q: ints,
                        scales: &s,
                        rows,
                        cols,
                    };
                    matmul_q8(w, &x, t, &mut y);
                    let want = naive(ints, &s, rows, cols, &x, t);
                    let scale = want.iter().fold(1e-3f64, |m, v| m.max(v.abs()));
                    for (i, (&g, &w)) in y.iter().zip(&want).enumerate() {
                        assert!(
                            (f64::from(g) - w).abs() <= 1e-5 * scale,
                            "{rows}×{cols}, t = {t}, value {i}: {g} vs {w}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn every_kernel_this_cpu_runs_agrees_with_the_portable_one() {
        let isas = Isa::available();
        eprintln!("kernels on this CPU: {isas:?}");
        let (rows, cols) = (64, 1000);
        let (q, s) = compact(rows, cols, 7);
        let (wide, narrow) = widths(&q);
        // One input (a decode step) and the drafted passes' few, whose rows are widened once.
        for t in [1, 2, 3, 7] {
            let x: Vec<f32> = (0..t * cols).map(|i| (i as f32 * 0.37).sin()).collect();
            for ints in [Ints::I16(&wide), Ints::I8(&narrow)] {
                let w = Q8Matrix {
                    q: ints,
                    scales: &s,
                    rows,
                    cols,
                };
                let run = |isa| {
                    let mut y = vec![0.0f32; t * rows];
                    match ints {
                        Ints::I8(q) => matmul_of(q, w, &x, t, &mut y, isa, &NoRowWork),
                        Ints::I16(q) => matmul_of(q, w, &x, t, &mut y, isa, &NoRowWork),
                    }
                    y
                };
                let portable = run(Isa::Portable);
                let mut row = vec![0.0f32; cols];
                for &isa in &isas {
                    for (i, (a, b)) in run(isa).iter().zip(&portable).enumerate() {
                        // Rounding follows the terms' magnitude, not the (cancelling) sum's.
                        let (tok, r) = (i / rows, i % rows);
                        dequantize_row(ints, &s, cols, r, &mut row);
                        let terms: f32 = row
                            .iter()
                            .zip(&x[tok * cols..(tok + 1) * cols])
                            .map(|(w, x)| (w * x).abs())
                            .sum();
                        assert!(
                            (a - b).abs() <= 1e-6 * terms,
                            "{isa:?} t = {t}, token {tok}, row {r}: {a} vs {b}"
                        );
                    }
                }
            }
        }
    }
}
