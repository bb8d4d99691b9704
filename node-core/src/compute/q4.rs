//! Products with 4-bit rows in a 4-bit file's own form (Q4_1's block: 32 weights `d·q + m`,
//! `q` in 0..=15, one f16 scale `d` and minimum `m`), so a row computes the file's weights as
//! they are (docs/coding.md, "Rows at the file's bits"). Values are packed as the file packs
//! them: byte `i` of a block holds weight `i` in its low nibble and weight `16 + i` in its high.

use super::par;
use super::q8::Isa;

/// Weights in a block.
pub const Q4_BLOCK: usize = 32;

/// Bytes of packed values in a block.
const PACKED: usize = Q4_BLOCK / 2;

/// A `rows × cols` matrix of 4-bit blocks, borrowed (`cols` a multiple of [`Q4_BLOCK`]).
#[derive(Debug, Clone, Copy)]
pub struct Q4Matrix<'a> {
    /// The packed values, a row's blocks one after another (`rows · cols / 2` bytes).
    pub packed: &'a [u8],
    /// Per block, its scale `d`.
    pub scales: &'a [half::f16],
    /// Per block, its minimum `m`.
    pub mins: &'a [half::f16],
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
}

/// Why a matrix's parts do not make a [`Q4Matrix`].
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Q4Error {
    /// The columns do not fill whole blocks.
    #[error("a 4-bit row has whole blocks of 32 columns, not {0} columns")]
    Columns(usize),
    /// A part's length is not the shape's.
    #[error("4-bit {part}: {got} values where a {rows} × {cols} matrix has {want}")]
    Length {
        /// Which part.
        part: &'static str,
        /// Its length.
        got: usize,
        /// The length the shape needs.
        want: usize,
        /// Rows.
        rows: usize,
        /// Columns.
        cols: usize,
    },
}

impl<'a> Q4Matrix<'a> {
    /// The matrix of these parts, or why they do not make one.
    pub fn new(
        packed: &'a [u8],
        scales: &'a [half::f16],
        mins: &'a [half::f16],
        rows: usize,
        cols: usize,
    ) -> Result<Self, Q4Error> {
        if !cols.is_multiple_of(Q4_BLOCK) {
            return Err(Q4Error::Columns(cols));
        }
        let blocks = rows * (cols / Q4_BLOCK);
        for (part, got, want) in [
            ("values", packed.len(), blocks * PACKED),
            ("scales", scales.len(), blocks),
            ("minimums", mins.len(), blocks),
        ] {
            if got != want {
                return Err(Q4Error::Length {
                    part,
                    got,
                    want,
                    rows,
                    cols,
                });
            }
        }
        Ok(Self {
            packed,
            scales,
            mins,
            rows,
            cols,
        })
    }

    /// Row `r`'s packed values, scales and minimums.
    fn row(&self, r: usize) -> (&'a [u8], &'a [half::f16], &'a [half::f16]) {
        let nb = self.cols / Q4_BLOCK;
        (
            &self.packed[r * nb * PACKED..(r + 1) * nb * PACKED],
            &self.scales[r * nb..(r + 1) * nb],
            &self.mins[r * nb..(r + 1) * nb],
        )
    }
}

/// Weight `i` of a block's packed values.
fn nibble(packed: &[u8], i: usize) -> u8 {
    if i < PACKED {
        packed[i] & 0x0f
    } else {
        packed[i - PACKED] >> 4
    }
}

/// Row `r` of `w` as f32 weights.
pub fn dequantize_row(w: Q4Matrix<'_>, r: usize, out: &mut [f32]) {
    let (packed, scales, mins) = w.row(r);
    for (b, o) in out[..w.cols]
        .as_chunks_mut::<Q4_BLOCK>()
        .0
        .iter_mut()
        .enumerate()
    {
        let (d, m) = (scales[b].to_f32(), mins[b].to_f32());
        for (i, v) in o.iter_mut().enumerate() {
            *v = d * f32::from(nibble(&packed[b * PACKED..], i)) + m;
        }
    }
}

/// `Σ_b m_b · Σx_b`: the minimums' share of a row's dot product, given the input's block sums.
fn offsets(mins: &[half::f16], sums: &[f32]) -> f32 {
    mins.iter().zip(sums).map(|(m, s)| m.to_f32() * s).sum()
}

/// One row's dot product with `x`, in plain Rust: `Σ_b d_b · (q_b · x_b) + m_b · Σx_b`, given
/// the input's block sums `sums`.
fn dot_q4_portable(
    packed: &[u8],
    scales: &[half::f16],
    mins: &[half::f16],
    sums: &[f32],
    x: &[f32],
) -> f32 {
    let mut total = 0.0f32;
    for (b, d) in scales.iter().enumerate() {
        let (p, xb) = (&packed[b * PACKED..(b + 1) * PACKED], &x[b * Q4_BLOCK..]);
        let mut acc = 0.0f32;
        for i in 0..PACKED {
            acc += f32::from(p[i] & 0x0f) * xb[i] + f32::from(p[i] >> 4) * xb[PACKED + i];
        }
        total += d.to_f32() * acc;
    }
    total + offsets(mins, sums)
}

/// Panics unless every part covers the row's blocks (the vector kernels read them unchecked).
#[cfg(target_arch = "x86_64")]
fn check(packed: &[u8], scales: &[half::f16], mins: &[half::f16], sums: &[f32], x: &[f32]) {
    let nb = scales.len();
    assert!(
        packed.len() >= nb * PACKED
            && x.len() >= nb * Q4_BLOCK
            && mins.len() >= nb
            && sums.len() >= nb,
        "dot_q4 shapes"
    );
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// See [`super::dot_q4_portable`]; the same sum, grouped differently.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn dot_q4(
        packed: &[u8],
        scales: &[half::f16],
        mins: &[half::f16],
        sums: &[f32],
        x: &[f32],
    ) -> f32 {
        super::check(packed, scales, mins, sums, x);
        let mut t0 = _mm256_setzero_ps();
        let mut t1 = _mm256_setzero_ps();
        let low = _mm256_set1_epi32(0x0f);
        let mut bias = 0.0f32;
        for (b, &h) in scales.iter().enumerate() {
            // SAFETY: block `b` is in bounds of `packed` and `x` (asserted above); unaligned
            // loads; this function runs only where AVX2, FMA and F16C are (its callers check).
            unsafe {
                super::super::q8::prefetch_ahead(packed.as_ptr().wrapping_add(b * 16));
                let p = packed.as_ptr().add(b * 16);
                // Eight bytes widened at a time; each lane then gives its two weights.
                let v0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
                let v1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(8) as *const __m128i));
                let lo = |v: __m256i| _mm256_cvtepi32_ps(_mm256_and_si256(v, low));
                let hi = |v: __m256i| _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
                let xp = x.as_ptr().add(b * 32);
                let mut acc = _mm256_mul_ps(lo(v0), _mm256_loadu_ps(xp));
                acc = _mm256_fmadd_ps(lo(v1), _mm256_loadu_ps(xp.add(8)), acc);
                let mut acc2 = _mm256_mul_ps(hi(v0), _mm256_loadu_ps(xp.add(16)));
                acc2 = _mm256_fmadd_ps(hi(v1), _mm256_loadu_ps(xp.add(24)), acc2);
                let d = _mm256_set1_ps(super::super::q8::avx2::scale_f32(h));
                bias += super::super::q8::avx2::scale_f32(mins[b]) * sums[b];
                if b % 2 == 0 {
                    t0 = _mm256_fmadd_ps(_mm256_add_ps(acc, acc2), d, t0);
                } else {
                    t1 = _mm256_fmadd_ps(_mm256_add_ps(acc, acc2), d, t1);
                }
            }
        }
        let mut lanes = [0.0f32; 8];
        // SAFETY: `lanes` holds eight f32.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_add_ps(t0, t1)) };
        lanes.iter().sum::<f32>() + bias
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;

    /// See [`super::dot_q4_portable`]; the same sum, grouped differently.
    #[target_feature(enable = "avx512f,f16c")]
    pub(super) fn dot_q4(
        packed: &[u8],
        scales: &[half::f16],
        mins: &[half::f16],
        sums: &[f32],
        x: &[f32],
    ) -> f32 {
        super::check(packed, scales, mins, sums, x);
        let nb = scales.len();
        let mut t0 = _mm512_setzero_ps();
        let mut t1 = _mm512_setzero_ps();
        let low = _mm512_set1_epi32(0x0f);
        // The minimums' share, 16 blocks at a time, and the blocks' scales as f32 (so each is
        // broadcast from memory, not converted in the loop).
        let mut bias = _mm512_setzero_ps();
        let mut tail = 0.0f32;
        let mut d16 = [0.0f32; 16];
        for b in 0..nb {
            // SAFETY: blocks `b..b + 16` (when whole) and block `b` are in bounds of `scales`,
            // `mins`, `sums`, `packed` and `x` (asserted above); unaligned loads; this function
            // runs only where AVX-512F and F16C are (its callers check).
            unsafe {
                if b % 16 == 0 {
                    if nb - b >= 16 {
                        let h = _mm256_loadu_si256(scales.as_ptr().add(b) as *const __m256i);
                        _mm512_storeu_ps(d16.as_mut_ptr(), _mm512_cvtph_ps(h));
                        let m = _mm256_loadu_si256(mins.as_ptr().add(b) as *const __m256i);
                        let s = _mm512_loadu_ps(sums.as_ptr().add(b));
                        bias = _mm512_fmadd_ps(_mm512_cvtph_ps(m), s, bias);
                    } else {
                        for i in b..nb {
                            d16[i - b] = super::super::q8::avx2::scale_f32(scales[i]);
                            tail += super::super::q8::avx2::scale_f32(mins[i]) * sums[i];
                        }
                    }
                }
                super::super::q8::prefetch_ahead(packed.as_ptr().wrapping_add(b * 16));
                // One widening of the 16 bytes; each lane then gives its two weights.
                let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(
                    packed.as_ptr().add(b * 16) as *const __m128i
                ));
                let lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, low));
                let hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
                let xp = x.as_ptr().add(b * 32);
                let lo = _mm512_mul_ps(lo, _mm512_loadu_ps(xp));
                let both = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xp.add(16)), lo);
                let d = _mm512_set1_ps(d16[b % 16]);
                if b % 2 == 0 {
                    t0 = _mm512_fmadd_ps(both, d, t0);
                } else {
                    t1 = _mm512_fmadd_ps(both, d, t1);
                }
            }
        }
        _mm512_reduce_add_ps(_mm512_add_ps(t0, t1)) + _mm512_reduce_add_ps(bias) + tail
    }
}

/// Row `r` of `w`'s dot product with `x` (whose block sums are `sums`), with the instructions
/// `isa`.
#[inline]
fn dot_q4(w: Q4Matrix<'_>, r: usize, sums: &[f32], x: &[f32], isa: Isa) -> f32 {
    let (packed, scales, mins) = w.row(r);
    match isa {
        // SAFETY: `isa` is [`Isa::best`] or below it: this CPU has its instructions.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { avx512::dot_q4(packed, scales, mins, sums, x) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::dot_q4(packed, scales, mins, sums, x) },
        _ => dot_q4_portable(packed, scales, mins, sums, x),
    }
}

/// Weights at which a product splits its rows over the kernel threads (as the 8-bit one).
const PARALLEL_MIN_WEIGHTS: usize = 1 << 16;

/// `y (t × rows) = x (t × cols) · Wᵀ` for a 4-bit `W`.
pub fn matmul_q4(w: Q4Matrix<'_>, x: &[f32], t: usize, y: &mut [f32]) {
    assert!(
        x.len() == t * w.cols && y.len() == t * w.rows,
        "matmul_q4 shapes"
    );
    let isa = Isa::best();
    for (xt, yt) in x.chunks_exact(w.cols).zip(y.chunks_exact_mut(w.rows)) {
        let sums: Vec<f32> = xt
            .as_chunks::<Q4_BLOCK>()
            .0
            .iter()
            .map(|b| b.iter().sum())
            .collect();
        let rows_from = |first: usize, out: &mut [f32]| {
            for (i, o) in out.iter_mut().enumerate() {
                *o = dot_q4(w, first + i, &sums, xt, isa);
            }
        };
        let threads = par::threads();
        if threads > 1 && w.rows * w.cols >= PARALLEL_MIN_WEIGHTS {
            let chunk = w.rows.div_ceil(threads * 4).next_multiple_of(16);
            par::for_each_chunk(yt, chunk, |i, out| rows_from(i * chunk, out));
        } else {
            rows_from(0, yt);
        }
    }
}

/// A product's input quantised as llama.cpp quantises one for a 4-bit file (its Q8_1 block):
/// per 32 values 8-bit integers `q = round(x / d)` for `d = max|x| / 127` (halves to even),
/// the unit `d` kept as an f16, and `d · Σq` as an f16 for the minimums' share. Every row of a
/// product then multiplies integers, and computes what llama.cpp computes.
#[derive(Debug, Clone, Default)]
pub struct Q8Input {
    /// The integers, 32 a block.
    q: Vec<i8>,
    /// Per block, its unit (an f16's value).
    d: Vec<f32>,
    /// Per block, `d · Σq` (an f16's value).
    sums: Vec<f32>,
}

impl Q8Input {
    /// Quantises `x` (whole blocks of [`Q4_BLOCK`]; a partial last block is left out) into
    /// this input, reusing its buffers.
    pub fn quantize(&mut self, x: &[f32]) {
        let blocks = x.as_chunks::<Q4_BLOCK>().0;
        self.q.resize(blocks.len() * Q4_BLOCK, 0);
        self.d.resize(blocks.len(), 0.0);
        self.sums.resize(blocks.len(), 0.0);
        #[cfg(target_arch = "x86_64")]
        if IntKernel::best() == IntKernel::Vnni {
            // SAFETY: the CPU has AVX-512F (`IntKernel::best`), and the buffers were sized
            // to the blocks above.
            unsafe { vnni::quantize(blocks, &mut self.q, &mut self.d, &mut self.sums) };
            return;
        }
        quantize_portable(blocks, &mut self.q, &mut self.d, &mut self.sums);
    }

    /// Value `i` as the integers give it back (`d · q`).
    pub fn value(&self, i: usize) -> f32 {
        self.d[i / Q4_BLOCK] * f32::from(self.q[i])
    }

    /// The values it holds.
    pub fn len(&self) -> usize {
        self.q.len()
    }

    /// Whether it holds no values.
    pub fn is_empty(&self) -> bool {
        self.q.is_empty()
    }
}

/// [`Q8Input::quantize`] in plain Rust, into buffers sized to the blocks.
fn quantize_portable(blocks: &[[f32; Q4_BLOCK]], q: &mut [i8], d: &mut [f32], sums: &mut [f32]) {
    for (b, v) in blocks.iter().enumerate() {
        let amax = v.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let unit = amax / 127.0;
        let inv = if unit > 0.0 { 1.0 / unit } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in q[b * Q4_BLOCK..(b + 1) * Q4_BLOCK].iter_mut().zip(v) {
            // Halves to even, as the vector quantisers (llama.cpp's and ours) round; `as`
            // saturates.
            *q = (v * inv).round_ties_even() as i8;
            sum += i32::from(*q);
        }
        (d[b], sums[b]) = units(unit, sum);
    }
}

/// A block's unit and minimums' share as llama.cpp keeps them: `d` and `d · Σq` as f16s.
fn units(unit: f32, sum: i32) -> (f32, f32) {
    let f16 = |v: f32| half::f16::from_f32(v).to_f32();
    (f16(unit), f16(sum as f32 * unit))
}

/// One row's dot product with a quantised input, in plain Rust:
/// `Σ_b d_b · dx_b · (q_b · qx_b) + m_b · Σx_b`, the integer products exact.
fn dot_q4_q8_portable(packed: &[u8], scales: &[half::f16], mins: &[half::f16], x: &Q8Input) -> f32 {
    let mut total = 0.0f32;
    for (b, d) in scales.iter().enumerate() {
        total += d.to_f32() * x.d[b] * block_dot(packed, x, b) as f32;
    }
    total + offsets(mins, &x.sums)
}

/// Block `b`'s integer product: its 4-bit values (of a row's `packed`) times the input's.
fn block_dot(packed: &[u8], x: &Q8Input, b: usize) -> i32 {
    let p = &packed[b * PACKED..(b + 1) * PACKED];
    let (lo, hi) = x.q[b * Q4_BLOCK..(b + 1) * Q4_BLOCK].split_at(PACKED);
    (p.iter().zip(lo).zip(hi))
        .map(|((&p, &l), &h)| i32::from(p & 0x0f) * i32::from(l) + i32::from(p >> 4) * i32::from(h))
        .sum()
}

/// Panics unless every part covers the row's blocks (the vector kernels read them unchecked).
#[cfg(target_arch = "x86_64")]
fn check_q8(packed: &[u8], scales: &[half::f16], mins: &[half::f16], x: &Q8Input) {
    let nb = scales.len();
    assert!(
        packed.len() >= nb * PACKED
            && x.q.len() >= nb * Q4_BLOCK
            && mins.len() >= nb
            && x.d.len() >= nb
            && x.sums.len() >= nb,
        "dot_q4_q8 shapes"
    );
}

#[cfg(target_arch = "x86_64")]
mod avx2_int {
    use std::arch::x86_64::*;

    use super::super::q8::avx2::scale_f32;

    /// See [`super::dot_q4_q8_portable`]: a block's 32 products as pairs of 16-bit sums
    /// (`maddubs`: at most 2 · 15 · 127, so none saturates), then 32-bit ones.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) fn dot_q4_q8(
        packed: &[u8],
        scales: &[half::f16],
        mins: &[half::f16],
        x: &super::Q8Input,
    ) -> f32 {
        super::check_q8(packed, scales, mins, x);
        let low = _mm_set1_epi8(0x0f);
        let ones = _mm256_set1_epi16(1);
        let mut acc = _mm256_setzero_ps();
        let mut bias = 0.0f32;
        for (b, &h) in scales.iter().enumerate() {
            // SAFETY: block `b` is in bounds of `packed` and the input (asserted above);
            // unaligned loads; this function runs only where AVX2, FMA and F16C are.
            unsafe {
                super::super::q8::prefetch_ahead(packed.as_ptr().wrapping_add(b * 16));
                let p = _mm_loadu_si128(packed.as_ptr().add(b * 16) as *const __m128i);
                let lo = _mm_and_si128(p, low);
                let hi = _mm_and_si128(_mm_srli_epi16(p, 4), low);
                let w = _mm256_set_m128i(hi, lo);
                let q = _mm256_loadu_si256(x.q.as_ptr().add(b * 32) as *const __m256i);
                let sums = _mm256_madd_epi16(_mm256_maddubs_epi16(w, q), ones);
                let s = _mm256_set1_ps(scale_f32(h) * x.d[b]);
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), s, acc);
            }
            bias += scale_f32(mins[b]) * x.sums[b];
        }
        let mut lanes = [0.0f32; 8];
        // SAFETY: `lanes` holds eight f32.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
        lanes.iter().sum::<f32>() + bias
    }
}

#[cfg(target_arch = "x86_64")]
mod vnni {
    use std::arch::x86_64::*;

    use super::super::q8::avx2::scale_f32;

    /// [`super::Q8Input::quantize`] of whole blocks, 16 values a vector: the same units,
    /// integers and sums as the plain loop's (the same IEEE operations on each value).
    #[target_feature(enable = "avx512f")]
    pub(super) fn quantize(blocks: &[[f32; 32]], q: &mut [i8], d: &mut [f32], sums: &mut [f32]) {
        assert!(
            q.len() >= blocks.len() * 32 && d.len() >= blocks.len() && sums.len() >= blocks.len(),
            "quantize shapes"
        );
        for (b, v) in blocks.iter().enumerate() {
            // SAFETY: block `b` has 32 values and `q` room for them (asserted above); this
            // function runs only where AVX-512F is (its callers check).
            unsafe {
                let lo = _mm512_loadu_ps(v.as_ptr());
                let hi = _mm512_loadu_ps(v.as_ptr().add(16));
                let amax =
                    _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
                let unit = amax / 127.0;
                let inv = _mm512_set1_ps(if unit > 0.0 { 1.0 / unit } else { 0.0 });
                // Rounded in the default mode, to nearest with halves to even; `|x·inv|` is at
                // most 127, and a NaN or infinity (i32::MIN) is clamped into i8's range.
                let round = |x: __m512| {
                    let t = _mm512_cvtps_epi32(_mm512_mul_ps(x, inv));
                    let (top, bottom) = (_mm512_set1_epi32(127), _mm512_set1_epi32(-128));
                    _mm512_max_epi32(_mm512_min_epi32(t, top), bottom)
                };
                let (l, h) = (round(lo), round(hi));
                let out = q.as_mut_ptr().add(b * 32);
                _mm_storeu_si128(out as *mut __m128i, _mm512_cvtepi32_epi8(l));
                _mm_storeu_si128(out.add(16) as *mut __m128i, _mm512_cvtepi32_epi8(h));
                let sum = _mm512_reduce_add_epi32(_mm512_add_epi32(l, h));
                (d[b], sums[b]) = super::units(unit, sum);
            }
        }
    }

    /// See [`super::dot_q4_q8_portable`]: two blocks a step, their 64 products summed four at
    /// a time into 32-bit lanes by one `vpdpbusd` (unsigned nibbles times signed integers);
    /// units and minimums 16 blocks at a time, the last (partial) 16 by masked loads.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c")]
    pub(super) fn dot_q4_q8(
        packed: &[u8],
        scales: &[half::f16],
        mins: &[half::f16],
        x: &super::Q8Input,
    ) -> f32 {
        super::check_q8(packed, scales, mins, x);
        let nb = scales.len();
        // Each 128-bit lane's 64-bit halves shift by 0 (weights 0..16 of a block, the low
        // nibbles) or 4 (weights 16..32, the high ones).
        let shifts = _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0);
        let low = _mm512_set1_epi8(0x0f);
        // `pick` puts block 2j's unit in lanes 0..8 and block 2j + 1's in lanes 8..16.
        let first_pair = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
        let two = _mm512_set1_epi32(2);
        let mut acc = _mm512_setzero_ps();
        let mut odd = 0.0f32;
        let mut b = 0;
        while b < nb {
            let n = (nb - b).min(16);
            let mask = ((1u32 << n) - 1) as __mmask16;
            // SAFETY: blocks `b..b + n` are in bounds of `scales`, `mins`, `packed` and the
            // input (asserted above), the masked loads read no lane past them; unaligned
            // loads; this function runs only where AVX-512F, BW, VL, VNNI and F16C are (its
            // callers check).
            unsafe {
                // Each block's unit times the input's, and the minimums' share.
                let h = _mm256_maskz_loadu_epi16(mask, scales.as_ptr().add(b) as *const i16);
                let dx = _mm512_maskz_loadu_ps(mask, x.d.as_ptr().add(b));
                let units = _mm512_mul_ps(_mm512_cvtph_ps(h), dx);
                let m = _mm256_maskz_loadu_epi16(mask, mins.as_ptr().add(b) as *const i16);
                let s = _mm512_maskz_loadu_ps(mask, x.sums.as_ptr().add(b));
                acc = _mm512_fmadd_ps(_mm512_cvtph_ps(m), s, acc);
                let mut pick = first_pair;
                for _ in 0..n / 2 {
                    super::super::q8::prefetch_ahead(packed.as_ptr().wrapping_add(b * 16));
                    let v = _mm512_castsi256_si512(_mm256_loadu_si256(
                        packed.as_ptr().add(b * 16) as *const __m256i
                    ));
                    // Lanes: block b's bytes twice, then block b + 1's twice.
                    let v = _mm512_shuffle_i64x2::<0x50>(v, v);
                    let w = _mm512_and_si512(_mm512_srlv_epi64(v, shifts), low);
                    let q = _mm512_loadu_si512(x.q.as_ptr().add(b * 32) as *const __m512i);
                    let sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w, q);
                    let u = _mm512_permutexvar_ps(pick, units);
                    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), u, acc);
                    pick = _mm512_add_epi32(pick, two);
                    b += 2;
                }
                if n % 2 == 1 {
                    // An odd last block.
                    let unit = scale_f32(scales[b]) * x.d[b];
                    odd = unit * super::block_dot(packed, x, b) as f32;
                    b += 1;
                }
            }
        }
        _mm512_reduce_add_ps(acc) + odd
    }
}

/// Which integer kernel a CPU runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum IntKernel {
    /// Plain Rust.
    Portable,
    /// AVX2's `maddubs`.
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// AVX-512 VNNI's `vpdpbusd`.
    #[cfg(target_arch = "x86_64")]
    Vnni,
}

impl IntKernel {
    /// The best this CPU runs.
    fn best() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            let isa = Isa::best();
            if isa == Isa::Avx512
                && std::arch::is_x86_feature_detected!("avx512bw")
                && std::arch::is_x86_feature_detected!("avx512vl")
                && std::arch::is_x86_feature_detected!("avx512vnni")
            {
                return Self::Vnni;
            }
            if isa != Isa::Portable {
                return Self::Avx2;
            }
        }
        Self::Portable
    }

    /// Every kernel this CPU runs (for tests: they must agree).
    #[cfg(test)]
    fn available() -> Vec<Self> {
        let mut all = vec![Self::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            let best = Self::best();
            if best != Self::Portable {
                all.push(Self::Avx2);
            }
            if best == Self::Vnni {
                all.push(Self::Vnni);
            }
        }
        all
    }
}

/// Row `r` of `w`'s dot product with the quantised input `x`, by `kernel`.
#[inline]
fn dot_q4_q8(w: Q4Matrix<'_>, r: usize, x: &Q8Input, kernel: IntKernel) -> f32 {
    let (packed, scales, mins) = w.row(r);
    match kernel {
        // SAFETY: `kernel` is [`IntKernel::best`] or below it: this CPU has its instructions.
        #[cfg(target_arch = "x86_64")]
        IntKernel::Vnni => unsafe { vnni::dot_q4_q8(packed, scales, mins, x) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        IntKernel::Avx2 => unsafe { avx2_int::dot_q4_q8(packed, scales, mins, x) },
        IntKernel::Portable => dot_q4_q8_portable(packed, scales, mins, x),
    }
}

/// `y (t × rows) = x̂ (t × cols) · Wᵀ` for a 4-bit `W`, each row of `x` quantised to
/// [`Q8Input`] first (`x̂`), as llama.cpp multiplies: integer products, no weight converted to
/// f32. `input` is the buffer the quantised rows go through.
pub fn matmul_q4_q8(w: Q4Matrix<'_>, x: &[f32], t: usize, y: &mut [f32], input: &mut Q8Input) {
    matmul_q4_q8_then(w, x, t, y, input, &super::q8::NoRowWork);
}

/// [`matmul_q4_q8`], with `work` on the rows as they are computed, while they are in cache.
pub fn matmul_q4_q8_then(
    w: Q4Matrix<'_>,
    x: &[f32],
    t: usize,
    y: &mut [f32],
    input: &mut Q8Input,
    work: &dyn super::q8::RowWork,
) {
    assert!(
        x.len() == t * w.cols && y.len() == t * w.rows,
        "matmul_q4_q8 shapes"
    );
    let kernel = IntKernel::best();
    for (tok, (xt, yt)) in x
        .chunks_exact(w.cols)
        .zip(y.chunks_exact_mut(w.rows))
        .enumerate()
    {
        input.quantize(xt);
        let input = &*input;
        let rows_from = |first: usize, out: &mut [f32]| {
            work.before(first, out.len());
            for (i, o) in out.iter_mut().enumerate() {
                *o = dot_q4_q8(w, first + i, input, kernel);
            }
            work.after(tok, first, out);
        };
        let threads = par::threads();
        if threads > 1 && w.rows * w.cols >= PARALLEL_MIN_WEIGHTS {
            let chunk = w.rows.div_ceil(threads * 4).next_multiple_of(16);
            par::for_each_chunk(yt, chunk, |i, out| rows_from(i * chunk, out));
        } else {
            rows_from(0, yt);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `rows × cols` matrix of random blocks: packed values, scales and minimums.
    fn blocks(rows: usize, cols: usize, seed: u32) -> (Vec<u8>, Vec<half::f16>, Vec<half::f16>) {
        let mut next = crate::compute::xorshift(seed);
        let nb = rows * cols / Q4_BLOCK;
        let packed = (0..nb * PACKED).map(|_| next() as u8).collect();
        let scales = (0..nb)
            .map(|_| half::f16::from_f32((next() % 1000) as f32 * 1e-5))
            .collect();
        let mins = (0..nb)
            .map(|_| half::f16::from_f32(-((next() % 1000) as f32) * 1e-4))
            .collect();
        (packed, scales, mins)
    }

    #[test]
    fn every_kernel_computes_the_rows_weights_times_the_input() {
        let (rows, cols) = (40, 576);
        let (packed, scales, mins) = blocks(rows, cols, 7);
        let w = Q4Matrix::new(&packed, &scales, &mins, rows, cols).unwrap();
        let x: Vec<f32> = (0..2 * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
            .collect();
        let mut dense = vec![0.0f32; cols];
        let mut want = vec![0.0f64; 2 * rows];
        for r in 0..rows {
            dequantize_row(w, r, &mut dense);
            for t in 0..2 {
                want[t * rows + r] = dense
                    .iter()
                    .zip(&x[t * cols..])
                    .map(|(&a, &b)| f64::from(a) * f64::from(b))
                    .sum();
            }
        }
        let sums: Vec<f32> = x[..cols]
            .as_chunks::<32>()
            .0
            .iter()
            .map(|b| b.iter().sum())
            .collect();
        for isa in Isa::available() {
            for (r, &want) in want[..rows].iter().enumerate() {
                let got = dot_q4(w, r, &sums, &x[..cols], isa);
                let e = (f64::from(got) - want).abs();
                assert!(
                    e <= 1e-4 * want.abs().max(1.0),
                    "{isa:?}, row {r}: {got} vs {want}"
                );
            }
        }
        let mut y = vec![0.0f32; 2 * rows];
        matmul_q4(w, &x, 2, &mut y);
        for (i, (&got, &want)) in y.iter().zip(&want).enumerate() {
            assert!(
                (f64::from(got) - want).abs() <= 1e-4 * want.abs().max(1.0),
                "output {i}"
            );
        }
    }

    #[test]
    fn every_integer_kernel_computes_the_rows_weights_times_the_quantised_input() {
        // 17 and 19 blocks a row: the VNNI kernel's pairs, its 16-block units whole and not,
        // and an odd last block either side of a 16.
        for nb in [17, 19] {
            integer_kernels_agree(40, nb * 32);
        }
    }

    /// [`every_integer_kernel_computes_the_rows_weights_times_the_quantised_input`] at a shape.
    fn integer_kernels_agree(rows: usize, cols: usize) {
        let (packed, scales, mins) = blocks(rows, cols, 11);
        let w = Q4Matrix::new(&packed, &scales, &mins, rows, cols).unwrap();
        let mut next = crate::compute::xorshift(5);
        let x: Vec<f32> = (0..2 * cols)
            .map(|_| (next() % 2001) as f32 / 1000.0 - 1.0)
            .collect();
        let mut input = Q8Input::default();
        // Every machine quantises to the same integers and units, whichever quantiser it runs.
        input.quantize(&x[..cols]);
        let (nb, mut q, mut d, mut s) = (
            cols / 32,
            vec![0; cols],
            vec![0.0; cols / 32],
            vec![0.0; cols / 32],
        );
        quantize_portable(x[..cols].as_chunks::<32>().0, &mut q, &mut d, &mut s);
        assert_eq!(
            (
                input.q.as_slice(),
                input.d.as_slice(),
                input.sums.as_slice()
            ),
            (&q[..], &d[..nb], &s[..nb])
        );
        let mut dense = vec![0.0f32; cols];
        let mut want = vec![0.0f64; 2 * rows];
        for t in 0..2 {
            let xt = &x[t * cols..(t + 1) * cols];
            input.quantize(xt);
            assert_eq!(input.len(), cols);
            // Each value is within half its block's unit of the input (and the unit's f16
            // rounding: at most 127 · 2⁻¹¹ units).
            for (i, &v) in xt.iter().enumerate() {
                let unit = input.d[i / 32];
                assert!((input.value(i) - v).abs() <= 0.57 * unit, "value {i}");
            }
            for r in 0..rows {
                dequantize_row(w, r, &mut dense);
                // The weights times the quantised values, and the minimums times the input's
                // `d · Σq` (what the kernels compute, in f64).
                let (_, _, m) = w.row(r);
                let mut sum = 0.0f64;
                for (i, &wv) in dense.iter().enumerate() {
                    let minimum = f64::from(m[i / 32].to_f32());
                    sum += (f64::from(wv) - minimum) * f64::from(input.value(i));
                }
                for (b, mb) in m.iter().enumerate() {
                    sum += f64::from(mb.to_f32()) * f64::from(input.sums[b]);
                }
                want[t * rows + r] = sum;
                for kernel in IntKernel::available() {
                    let got = f64::from(dot_q4_q8(w, r, &input, kernel));
                    assert!(
                        (got - sum).abs() <= 1e-4 * sum.abs().max(1.0),
                        "{kernel:?}, token {t}, row {r}: {got} vs {sum}"
                    );
                }
            }
        }
        let mut y = vec![0.0f32; 2 * rows];
        matmul_q4_q8(w, &x, 2, &mut y, &mut input);
        for (i, (&got, &want)) in y.iter().zip(&want).enumerate() {
            assert!(
                (f64::from(got) - want).abs() <= 1e-4 * want.abs().max(1.0),
                "output {i}"
            );
        }
        // An input of zeros (unit 0) and one with a NaN give finite or NaN outputs, no panic.
        input.quantize(&vec![0.0; cols]);
        assert!(input.d.iter().all(|&d| d == 0.0));
        assert_eq!(dot_q4_q8(w, 0, &input, IntKernel::best()), {
            let (_, _, m) = w.row(0);
            offsets(m, &input.sums)
        });
    }

    #[test]
    fn parts_that_do_not_fit_the_shape_are_refused() {
        let (packed, scales, mins) = blocks(2, 64, 1);
        assert_eq!(
            Q4Matrix::new(&packed, &scales, &mins, 2, 48).unwrap_err(),
            Q4Error::Columns(48)
        );
        let err = Q4Matrix::new(&packed[1..], &scales, &mins, 2, 64).unwrap_err();
        assert!(err.to_string().contains("values"), "{err}");
        let err = Q4Matrix::new(&packed, &scales, &mins[1..], 2, 64).unwrap_err();
        assert!(err.to_string().contains("minimums"), "{err}");
    }
}
