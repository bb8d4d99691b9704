//! Compact shards: the weights quantised to 8-bit integers with scales shared by the k blocks
//! of a row, encoded with the integer code, so every shard is an exact codeword of integers:
//! i8 in a data row (a unit row of the code), i16 in a parity row, whose sums need up to
//! `log₂ ‖g‖₁` more bits (docs/coding.md, "Compact shards").

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::CodedError;
use crate::code::Generator;
use crate::compute::q8::{Ints, Q8_BLOCK, Q8Matrix, blocks_per_row, dequantize_row};
use crate::model::{Matrix, ModelWeights};

/// A compact shard's coded integers, row-major. They never change once encoded (compact
/// shards learn in their adapters), so a copy of a shard shares them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum CodedInts {
    /// A data row's: the weights' own integers.
    I8(#[serde(with = "shared")] Arc<Vec<i8>>),
    /// A parity row's: sums of up to `‖g‖₁ · 127`, stored entropy-coded ([`super::packed`]).
    I16(#[serde(with = "super::packed::serde_packed")] Arc<Vec<i16>>),
}

/// Shared values on the wire as a plain sequence (the bytes a `Vec` of them makes).
pub(super) mod shared {
    use std::sync::Arc;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    /// Writes the values as a sequence.
    pub fn serialize<S: Serializer, T: Serialize>(values: &[T], s: S) -> Result<S::Ok, S::Error> {
        values.serialize(s)
    }

    /// Reads a sequence of values.
    pub fn deserialize<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
        d: D,
    ) -> Result<Arc<Vec<T>>, D::Error> {
        Vec::<T>::deserialize(d).map(Arc::new)
    }
}

impl CodedInts {
    /// Number of values.
    pub fn len(&self) -> usize {
        self.view().len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The values, borrowed.
    pub fn view(&self) -> Ints<'_> {
        match self {
            Self::I8(v) => Ints::I8(v),
            Self::I16(v) => Ints::I16(v),
        }
    }

    /// Value `i`.
    pub fn get(&self, i: usize) -> i32 {
        match self {
            Self::I8(v) => i32::from(v[i]),
            Self::I16(v) => i32::from(v[i]),
        }
    }

    /// Bytes the values take.
    pub fn bytes(&self) -> usize {
        match self {
            Self::I8(v) => v.len(),
            Self::I16(v) => v.len() * 2,
        }
    }

    /// `values` stored one byte each when `wide` is false, else two.
    pub(crate) fn from_i32(values: Vec<i32>, wide: bool) -> Result<Self, CodedError> {
        let too_big = |z: i32| CodedError::BadRequest(format!("coded value {z} does not fit"));
        if wide {
            let v = values
                .into_iter()
                .map(|z| i16::try_from(z).map_err(|_| too_big(z)));
            Ok(Self::I16(Arc::new(v.collect::<Result<_, _>>()?)))
        } else {
            let v = values
                .into_iter()
                .map(|z| i8::try_from(z).map_err(|_| too_big(z)));
            Ok(Self::I8(Arc::new(v.collect::<Result<_, _>>()?)))
        }
    }
}

/// Whether row `node` of `g` stores its integers in two bytes: any row but a unit row.
pub fn wide_row(g: &Generator, node: usize) -> bool {
    g.coeffs(node).iter().map(|c| c.abs()).sum::<f64>() > 1.0
}

/// A compact shard's values: coded integers, row-major, and one f16 scale per [`Q8_BLOCK`]
/// values of a row (the same scale in every shard of the matrix).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Q8Values {
    /// The coded integers.
    pub q: CodedInts,
    /// `rows × ⌈cols / 32⌉` scales (the same in every shard of the matrix, so shared, as
    /// the integers are: a copy of the shard, as a fold writes, copies neither).
    #[serde(with = "shared")]
    pub scales: Arc<Vec<half::f16>>,
}

impl Q8Values {
    /// Builds a row's values from its integers, one byte each unless `wide`.
    pub(crate) fn from_i32(
        values: Vec<i32>,
        scales: Arc<Vec<half::f16>>,
        wide: bool,
    ) -> Result<Self, CodedError> {
        Ok(Self {
            q: CodedInts::from_i32(values, wide)?,
            scales,
        })
    }

    /// The values as a matrix of `cols` columns, checked against their scales.
    pub fn matrix(&self, cols: usize) -> Result<Q8Matrix<'_>, CodedError> {
        let rows = self.q.len() / cols.max(1);
        if rows * cols != self.q.len() || self.scales.len() != rows * blocks_per_row(cols) {
            return Err(CodedError::BadRequest(format!(
                "compact shard: {} values and {} scales do not make rows of {cols}",
                self.q.len(),
                self.scales.len()
            )));
        }
        Ok(Q8Matrix {
            q: self.q.view(),
            scales: &self.scales,
            rows,
            cols,
        })
    }

    /// Rows `first..first + n` as f32.
    pub fn rows_f32(&self, cols: usize, first: usize, n: usize) -> Vec<f32> {
        let mut out = vec![0.0f32; n * cols];
        for (i, row) in out.chunks_exact_mut(cols.max(1)).enumerate() {
            dequantize_row(self.q.view(), &self.scales, cols, first + i, row);
        }
        out
    }
}

/// The levels of `g`'s grid, or why `g` cannot make compact shards.
fn levels(g: &Generator) -> Result<i32, CodedError> {
    g.levels().ok_or_else(|| {
        CodedError::BadRequest(format!(
            "compact (q8) shards need the integer code, not {:?}",
            g.construction()
        ))
    })
}

/// One weight on the grid: where it sits and its integer.
struct OnGrid {
    /// Row within a block (`L` rows each).
    r: usize,
    /// Block of the scale along the row.
    b: usize,
    /// The block (`j` of k) the weight's row belongs to.
    j: usize,
    /// Its row and column in the matrix.
    row: usize,
    col: usize,
    /// The scale it shares with the other k − 1 blocks' rows.
    scale: half::f16,
    /// The weight in units of `scale`.
    q: i32,
}

/// How a compact code cuts one matrix: `k` blocks of `l` rows, `levels` per sign.
struct Grid {
    out: usize,
    inp: usize,
    k: usize,
    l: usize,
    levels: i32,
}

impl Grid {
    /// The grid of `g` for an `out × inp` matrix, or why `g` cannot make compact shards.
    fn new(g: &Generator, out: usize, inp: usize) -> Result<Self, CodedError> {
        Ok(Self::of(out, inp, g.k(), levels(g)?))
    }

    /// The grid of `k` blocks and `levels` per sign for an `out × inp` matrix.
    fn of(out: usize, inp: usize, k: usize, levels: i32) -> Self {
        Self {
            out,
            inp,
            k: k.max(1),
            l: out.div_ceil(k.max(1)),
            levels: levels.max(1),
        }
    }

    /// Columns of block `b`.
    fn columns(&self, b: usize) -> std::ops::Range<usize> {
        b * Q8_BLOCK..((b + 1) * Q8_BLOCK).min(self.inp)
    }

    /// The scale shared by rows `r, L + r, …, (k−1)·L + r` of `w` over block `b`.
    fn scale(&self, w: &[f32], r: usize, b: usize) -> half::f16 {
        let cols = self.columns(b);
        let mut most = 0.0f32;
        for j in 0..self.k {
            let row = j * self.l + r;
            if row < self.out {
                for &v in &w[row * self.inp + cols.start..row * self.inp + cols.end] {
                    most = most.max(v.abs());
                }
            }
        }
        half::f16::from_f32(most / self.levels as f32)
    }

    /// Puts every weight of `w` on the grid, one shared scale at a time, and hands each to `f`.
    fn each(&self, w: &[f32], mut f: impl FnMut(&OnGrid)) {
        for r in 0..self.l {
            for b in 0..blocks_per_row(self.inp) {
                let scale = self.scale(w, r, b);
                for j in 0..self.k {
                    let row = j * self.l + r;
                    if row >= self.out {
                        continue;
                    }
                    for col in self.columns(b) {
                        f(&OnGrid {
                            r,
                            b,
                            j,
                            row,
                            col,
                            scale,
                            q: quantise(w[row * self.inp + col], scale, self.levels),
                        });
                    }
                }
            }
        }
    }
}

/// `v` on the grid of `scale`, within `±levels`.
fn quantise(v: f32, scale: half::f16, levels: i32) -> i32 {
    let s = scale.to_f32();
    if s == 0.0 || !s.is_finite() {
        return 0;
    }
    ((v / s).round() as i32).clamp(-levels, levels)
}

/// Node `node`'s compact shard of `w` (`out × inp`).
pub fn encode_q8(
    g: &Generator,
    node: usize,
    w: &[f32],
    out: usize,
    inp: usize,
) -> Result<Q8Values, CodedError> {
    let grid = Grid::new(g, out, inp)?;
    if w.len() != out * inp {
        return Err(CodedError::BadRequest(format!(
            "a {out} × {inp} matrix with {} values",
            w.len()
        )));
    }
    if node >= g.n() {
        return Err(crate::code::CodeError::NoSuchNode { node, n: g.n() }.into());
    }
    let (l, nb) = (grid.l, blocks_per_row(inp));
    let coeffs: Vec<i32> = g.coeffs(node).iter().map(|&c| c as i32).collect();
    let mut q = vec![0i32; l * inp];
    let mut scales = vec![half::f16::ZERO; l * nb];
    grid.each(w, |v| {
        scales[v.r * nb + v.b] = v.scale;
        // |Σ| ≤ ‖g‖₁ · levels: one byte in a unit row, two in a parity row.
        q[v.r * inp + v.col] += coeffs[v.j] * v.q;
    });
    Q8Values::from_i32(q, Arc::new(scales), wide_row(g, node))
}

/// The uncoded matrix a compact code of `g` encodes: `w` on the grid of its shared scales.
pub fn compact_matrix(g: &Generator, w: &Matrix) -> Result<Matrix, CodedError> {
    Ok(on_grid(w, &Grid::new(g, w.rows, w.cols)?))
}

/// `w` on the grid of `k` blocks with `levels` per sign: what a compact code of k blocks with
/// those levels encodes (the integer code fixes them; other values measure the trade-off).
pub fn grid_matrix(w: &Matrix, k: usize, levels: i32) -> Matrix {
    on_grid(w, &Grid::of(w.rows, w.cols, k, levels))
}

/// `w` with every weight replaced by its value on `grid`.
fn on_grid(w: &Matrix, grid: &Grid) -> Matrix {
    let mut data = vec![0.0f32; w.rows * w.cols];
    grid.each(&w.data, |v| {
        data[v.row * w.cols + v.col] = v.scale.to_f32() * v.q as f32;
    });
    Matrix {
        rows: w.rows,
        cols: w.cols,
        data,
    }
}

/// The uncoded model a compact code of `g` encodes: every linear matrix on its grid, norms as
/// they are. Coded compact decoding matches this model up to f32 rounding.
pub fn compact_model(g: &Generator, w: &ModelWeights) -> Result<ModelWeights, CodedError> {
    Ok(grid_model(w, g.k(), levels(g)?))
}

/// The model with every linear matrix on the grid of `k` blocks and `levels` per sign.
pub fn grid_model(w: &ModelWeights, k: usize, levels: i32) -> ModelWeights {
    map_linear(w, |m| grid_matrix(m, k, levels))
}

/// `w` on an affine grid of `levels + 1` unsigned steps whose unit is shared by the k blocks'
/// rows over 32 columns while each row keeps its own offset (the shape of a 4-bit file's
/// blocks: at k = 1 and 15 levels it gives back a Q4_1 block's values).
pub fn affine_grid_matrix(w: &Matrix, k: usize, levels: i32) -> Matrix {
    let grid = Grid::of(w.rows, w.cols, k, levels);
    let mut data = vec![0.0f32; w.rows * w.cols];
    let span = |row: usize, b: usize| {
        let cols = grid.columns(b);
        w.data[row * w.cols + cols.start..row * w.cols + cols.end]
            .iter()
            .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &v| {
                (lo.min(v), hi.max(v))
            })
    };
    for r in 0..grid.l {
        for b in 0..blocks_per_row(w.cols) {
            let rows = (0..grid.k)
                .map(|j| j * grid.l + r)
                .filter(|&row| row < w.rows);
            let unit = rows
                .clone()
                .map(|row| {
                    let (lo, hi) = span(row, b);
                    hi - lo
                })
                .fold(0.0f32, f32::max)
                / grid.levels as f32;
            let unit = half::f16::from_f32(unit).to_f32();
            for row in rows {
                let lo = half::f16::from_f32(span(row, b).0).to_f32();
                for col in grid.columns(b) {
                    let v = w.data[row * w.cols + col];
                    let q = if unit > 0.0 {
                        ((v - lo) / unit).round().clamp(0.0, grid.levels as f32)
                    } else {
                        0.0
                    };
                    data[row * w.cols + col] = lo + unit * q;
                }
            }
        }
    }
    Matrix {
        rows: w.rows,
        cols: w.cols,
        data,
    }
}

/// `w` as a group of k = 2 decodes it when block 0's row is lost: block 1 as it is, block 0 as
/// `P − W₁` from the parity row `P = W₀ + W₁` stored at `bits` bits with its own unit over
/// each 32 columns (a measurement of what parity rows of few bits cost, not a shard format).
pub fn through_parity_matrix(w: &Matrix, bits: u32) -> Matrix {
    let grid = Grid::of(w.rows, w.cols, 2, 1);
    let most = ((1i64 << (bits.clamp(2, 24) - 1)) - 1) as f32;
    let mut data = w.data.clone();
    for r in 0..grid.l {
        let other = grid.l + r;
        if other >= w.rows {
            continue;
        }
        for b in 0..blocks_per_row(w.cols) {
            let cols = grid.columns(b);
            let sum = |c: usize| w.data[r * w.cols + c] + w.data[other * w.cols + c];
            let unit = cols.clone().map(|c| sum(c).abs()).fold(0.0f32, f32::max) / most;
            // Rounded up to f16, so the largest sum stays within the levels.
            let mut unit16 = half::f16::from_f32(unit);
            if unit16.to_f32() < unit {
                unit16 = half::f16::from_bits(unit16.to_bits() + 1);
            }
            let unit = unit16.to_f32();
            for c in cols {
                let stored = if unit > 0.0 {
                    unit * (sum(c) / unit).round().clamp(-most, most)
                } else {
                    0.0
                };
                data[r * w.cols + c] = stored - w.data[other * w.cols + c];
            }
        }
    }
    Matrix {
        rows: w.rows,
        cols: w.cols,
        data,
    }
}

/// The model with every linear matrix replaced by `f` of it, norms as they are.
pub fn map_linear(w: &ModelWeights, f: impl Fn(&Matrix) -> Matrix) -> ModelWeights {
    let mut out = w.clone();
    for layer in &mut out.layers {
        for m in [
            &mut layer.q,
            &mut layer.k,
            &mut layer.v,
            &mut layer.o,
            &mut layer.gate,
            &mut layer.up,
            &mut layer.down,
        ] {
            *m = f(m);
        }
    }
    out.embed = f(&out.embed);
    if let Some(h) = &mut out.lm_head {
        *h = f(h);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matrix(rows: usize, cols: usize) -> Matrix {
        let data = (0..rows * cols)
            .map(|i| ((i * 7919 % 1009) as f32 / 504.5 - 1.0) * (1.0 + (i % 13) as f32))
            .collect();
        Matrix { rows, cols, data }
    }

    #[test]
    fn compact_shards_are_an_exact_codeword_of_the_compact_matrix() {
        let g = Generator::integer(5, 3, None).unwrap();
        let w = matrix(100, 70);
        let reference = compact_matrix(&g, &w).unwrap();
        let l = g.block_len(w.rows);
        for node in 0..g.n() {
            let shard = encode_q8(&g, node, &w.data, w.rows, w.cols).unwrap();
            let rows = shard.rows_f32(w.cols, 0, l);
            // The shard equals the code applied to the compact matrix, exactly: each value is
            // an integer sum times the shared scale.
            let exact = g
                .encode_shard(node, &reference.data, w.rows, w.cols)
                .unwrap();
            for (i, (&a, &b)) in rows.iter().zip(&exact).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-6 * b.abs().max(1e-3),
                    "node {node}, value {i}: {a} vs {b}"
                );
            }
        }
    }

    #[test]
    fn compact_matrices_stay_within_half_a_step_of_the_weights() {
        let g = Generator::integer(5, 3, None).unwrap();
        let w = matrix(96, 64);
        let c = compact_matrix(&g, &w).unwrap();
        let grid = Grid::new(&g, w.rows, w.cols).unwrap();
        for (i, (&a, &b)) in w.data.iter().zip(&c.data).enumerate() {
            let (row, col) = (i / w.cols, i % w.cols);
            let scale = grid.scale(&w.data, row % grid.l, col / Q8_BLOCK);
            assert!(
                (a - b).abs() <= 0.5 * scale.to_f32() * 1.001 + 1e-3 * a.abs(),
                "value {i}: {a} vs {b}"
            );
        }
    }

    #[test]
    fn a_compact_row_rebuilt_from_any_three_others_is_bit_for_bit_the_encoded_one() {
        use crate::coded::{ShardFormat, ShardSet};
        let cfg = crate::model::LlamaConfig::small();
        let w = ModelWeights::synthetic(cfg, 11).unwrap();
        let g = Generator::integer(5, 3, None).unwrap();
        let sets: Vec<ShardSet> = (0..g.n())
            .map(|r| ShardSet::encode(&w, &g, r, ShardFormat::Q8, &mut |_, _| {}).unwrap())
            .collect();
        for target in 0..g.n() {
            for sources in crate::code::subsets(g.n(), 3) {
                if sources.contains(&target) {
                    continue;
                }
                let from: Vec<&ShardSet> = sources.iter().map(|&r| &sets[r]).collect();
                let rebuilt = ShardSet::reencode(target, &from).unwrap();
                assert_eq!(rebuilt, sets[target], "row {target} from {sources:?}");
            }
        }
        // A source that is not part of the codeword is refused, not rounded into one: row 1 is
        // a combination in thirds of rows 3, 4 and 5 (determinant 3), so an integer off by one in
        // row 4 lands between integers.
        let mut wrong = sets[4].clone();
        if let crate::coded::ShardValues::Q8(v) = &mut wrong.embed.values {
            match &mut v.q {
                CodedInts::I8(q) => Arc::make_mut(q)[0] = q[0].wrapping_add(1),
                CodedInts::I16(q) => Arc::make_mut(q)[0] = q[0].wrapping_add(1),
            }
        }
        let err = ShardSet::reencode(1, &[&sets[3], &wrong, &sets[5]]).unwrap_err();
        assert!(err.to_string().contains("not one codeword"), "{err}");
    }

    #[test]
    fn a_real_coefficient_code_is_refused_with_a_reason() {
        let g = Generator::cauchy(5, 3).unwrap();
        let err = encode_q8(&g, 0, &[0.0; 6], 3, 2).unwrap_err();
        assert!(err.to_string().contains("integer code"), "{err}");
    }

    /// A matrix whose every row's 32-column blocks are Q4_1 blocks (`d·q + m`, q in 0..=15,
    /// both ends used), with scales and minimums exact in f16 and differing from row to row.
    fn q4_1(rows: usize, cols: usize) -> Matrix {
        let data = (0..rows * cols)
            .map(|i| {
                let (row, col) = (i / cols, i % cols);
                let d = 2f32.powi(-(((row * 3 + col / 32) % 5) as i32) - 4);
                let m = -(((row + col / 32) % 7) as f32) * 0.125;
                let q = match col % 32 {
                    0 => 0,
                    1 => 15,
                    c => (c * 7 + row * 3) % 16,
                };
                m + d * q as f32
            })
            .collect();
        Matrix { rows, cols, data }
    }

    #[test]
    fn an_affine_grid_gives_back_4_bit_blocks_alone_and_loses_levels_when_k_rows_share_a_unit() {
        let w = q4_1(8, 64);
        assert_eq!(
            affine_grid_matrix(&w, 1, 15),
            w,
            "a row's own unit and offset are its block's"
        );
        // Shared by rows r and 4 + r, the unit is the larger scale's: the row with the larger
        // scale keeps its values, the other is rounded to the coarser unit.
        let shared = affine_grid_matrix(&w, 2, 15);
        let (mut kept, mut moved) = (0, 0);
        for r in 0..4 {
            for b in 0..2 {
                let d = |row: usize| w.data[row * 64 + b * 32 + 1] - w.data[row * 64 + b * 32];
                let (big, small) = if d(r) >= d(4 + r) {
                    (r, 4 + r)
                } else {
                    (4 + r, r)
                };
                let block = |m: &Matrix, row: usize| {
                    m.data[row * 64 + b * 32..row * 64 + b * 32 + 32].to_vec()
                };
                assert_eq!(block(&shared, big), block(&w, big), "row {big}, block {b}");
                let unit = d(big) / 15.0;
                for (a, v) in block(&shared, small).iter().zip(block(&w, small)) {
                    assert!(
                        (a - v).abs() <= unit / 2.0 + 1e-6,
                        "row {small}: {a} vs {v}"
                    );
                    moved += usize::from(a != &v);
                }
                kept += 1;
            }
        }
        assert_eq!(kept, 8);
        assert!(moved > 0, "a coarser shared unit moved no weight");
    }

    #[test]
    fn a_row_decoded_through_a_parity_row_of_few_bits_is_off_by_its_rounding_alone() {
        let w = q4_1(8, 64);
        // Rows 4..8 are the other block's: kept as they are.
        for bits in [5u32, 8, 12] {
            let got = through_parity_matrix(&w, bits);
            assert_eq!(got.data[4 * 64..], w.data[4 * 64..], "{bits} bits");
            let most = ((1i64 << (bits - 1)) - 1) as f32;
            let mut worst = 0.0f32;
            for r in 0..4 {
                for b in 0..2 {
                    let sums: Vec<f32> = (b * 32..b * 32 + 32)
                        .map(|c| w.data[r * 64 + c] + w.data[(4 + r) * 64 + c])
                        .collect();
                    let unit = sums.iter().fold(0.0f32, |a, v| a.max(v.abs())) / most;
                    for c in b * 32..b * 32 + 32 {
                        let e = (got.data[r * 64 + c] - w.data[r * 64 + c]).abs();
                        assert!(
                            e <= unit * 0.5005 + 1e-6,
                            "{bits} bits, row {r}, col {c}: {e}"
                        );
                        worst = worst.max(e / unit);
                    }
                }
            }
            assert!(worst > 0.0, "{bits} bits rounded nothing");
        }
    }
}
