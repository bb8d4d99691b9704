//! A data row at a 4-bit file's own bits (issue 81, docs/coding.md "Rows at the file's bits"):
//! where a matrix's weights lie on a 4-bit affine grid of 32 columns a block (`w = d·q + m`,
//! `q` in 0..=15, as Q4_1 stores them and as the loader gives them back), a data row keeps
//! those blocks as they are, 0.625 bytes a weight, and multiplies them by its input quantised
//! to 8 bits as llama.cpp does (`compute::q4`). A data row's values are the model's, so a
//! group of data rows computes the file's weights; parity rows at these bits are not built yet.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::CodedError;
use crate::compute::q4::{Q4_BLOCK, Q4Matrix, Q8Input, dequantize_row, matmul_q4_q8_then};
use crate::compute::q8::RowWork;

/// A data row's values as a 4-bit file's blocks: per 32 columns of a row 16 bytes of packed
/// values (weight `i` in byte `i`'s low nibble, `16 + i` in byte `i`'s high one), an f16 scale
/// and an f16 minimum.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Q4Values {
    /// The packed values, `rows · cols / 2` bytes.
    #[serde(with = "super::compact::shared")]
    pub packed: Arc<Vec<u8>>,
    /// Per block, its scale `d`.
    #[serde(with = "super::compact::shared")]
    pub scales: Arc<Vec<half::f16>>,
    /// Per block, its minimum `m`.
    #[serde(with = "super::compact::shared")]
    pub mins: Arc<Vec<half::f16>>,
}

impl Q4Values {
    /// The blocks of `rows` rows of `cols` values (`w`), or `None` where a block's values do
    /// not lie on one 4-bit grid with f16 scale and minimum (they did not come from a 4-bit
    /// file: they stay on the integer code's 8-bit grid) or `cols` is not whole blocks.
    pub fn exact(w: &[f32], rows: usize, cols: usize) -> Option<Self> {
        if !cols.is_multiple_of(Q4_BLOCK) || w.len() != rows * cols {
            return None;
        }
        let blocks = w.len() / Q4_BLOCK;
        let mut packed = vec![0u8; w.len() / 2];
        let (mut scales, mut mins) = (Vec::with_capacity(blocks), Vec::with_capacity(blocks));
        for (b, vals) in w.as_chunks::<Q4_BLOCK>().0.iter().enumerate() {
            let (lo, hi) = vals
                .iter()
                .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, z), &v| {
                    (a.min(v), z.max(v))
                });
            // A file's minimum is an f16 and its largest value `15·d + m`.
            let m = half::f16::from_f32(lo);
            let d = half::f16::from_f32((hi - m.to_f32()) / 15.0);
            let (mf, df) = (m.to_f32(), d.to_f32());
            let out = &mut packed[b * Q4_BLOCK / 2..(b + 1) * Q4_BLOCK / 2];
            for (i, &v) in vals.iter().enumerate() {
                let q = if df > 0.0 {
                    ((v - mf) / df).round()
                } else {
                    0.0
                };
                if !(0.0..=15.0).contains(&q) || df * q + mf != v {
                    return None;
                }
                let q = q as u8;
                out[i % 16] |= if i < 16 { q } else { q << 4 };
            }
            scales.push(d);
            mins.push(m);
        }
        Some(Self {
            packed: Arc::new(packed),
            scales: Arc::new(scales),
            mins: Arc::new(mins),
        })
    }

    /// Zero rows: `rows` of `cols` values, all 0.
    pub fn zeros(rows: usize, cols: usize) -> Self {
        let blocks = rows * cols / Q4_BLOCK;
        Self {
            packed: Arc::new(vec![0; rows * cols / 2]),
            scales: Arc::new(vec![half::f16::ZERO; blocks]),
            mins: Arc::new(vec![half::f16::ZERO; blocks]),
        }
    }

    /// Values held.
    pub fn len(&self) -> usize {
        self.packed.len() * 2
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.packed.is_empty()
    }

    /// Bytes held: packed values, scales and minimums.
    pub fn bytes(&self) -> usize {
        self.packed.len() + 2 * (self.scales.len() + self.mins.len())
    }

    /// Rows `first..first + n` as a matrix of `cols` columns, or why the parts (which may
    /// have come from a peer) do not make one.
    pub fn matrix(&self, cols: usize, first: usize, n: usize) -> Result<Q4Matrix<'_>, CodedError> {
        let bad = |why: String| CodedError::BadRequest(format!("4-bit shard: {why}"));
        if cols == 0 || !cols.is_multiple_of(Q4_BLOCK) {
            return Err(bad(format!("{cols} columns are not whole blocks of 32")));
        }
        let (row_bytes, row_blocks) = (cols / 2, cols / Q4_BLOCK);
        let rows = self.packed.len() / row_bytes;
        if rows * row_bytes != self.packed.len()
            || self.scales.len() != rows * row_blocks
            || self.mins.len() != rows * row_blocks
        {
            return Err(bad(format!(
                "{} bytes, {} scales and {} minimums do not make rows of {cols}",
                self.packed.len(),
                self.scales.len(),
                self.mins.len()
            )));
        }
        if first.checked_add(n).is_none_or(|end| end > rows) {
            return Err(bad(format!("rows {first}..{} of {rows}", first + n)));
        }
        let blocks = first * row_blocks..(first + n) * row_blocks;
        Q4Matrix::new(
            &self.packed[first * row_bytes..(first + n) * row_bytes],
            &self.scales[blocks.clone()],
            &self.mins[blocks],
            n,
            cols,
        )
        .map_err(|e| bad(e.to_string()))
    }

    /// Rows `first..first + n` of `cols` columns as f32.
    pub fn rows_f32(&self, cols: usize, first: usize, n: usize) -> Result<Vec<f32>, CodedError> {
        let w = self.matrix(cols, first, n)?;
        let mut out = vec![0.0f32; n * cols];
        for (r, o) in out.chunks_exact_mut(cols.max(1)).enumerate() {
            dequantize_row(w, r, o);
        }
        Ok(out)
    }

    /// `y (t × n) = x̂ (t × cols) · W[first..first + n]ᵀ`, the input quantised to 8 bits
    /// ([`Q8Input`]), with `work` on the rows as they are computed.
    #[allow(clippy::too_many_arguments)] // a product's operands and its rows' work
    pub(crate) fn matmul(
        &self,
        cols: usize,
        first: usize,
        n: usize,
        x: &[f32],
        t: usize,
        y: &mut [f32],
        work: &dyn RowWork,
    ) -> Result<(), CodedError> {
        let w = self.matrix(cols, first, n)?;
        if x.len() != t * cols || y.len() != t * n {
            return Err(CodedError::BadRequest(format!(
                "a 4-bit product of {n} × {cols} with {} inputs and {} outputs for {t} tokens",
                x.len(),
                y.len()
            )));
        }
        thread_local! {
            /// The quantised input's buffers, kept between a thread's products.
            static INPUT: std::cell::RefCell<Q8Input> = std::cell::RefCell::default();
        }
        // A thread that runs another product while it waits on its helpers finds the
        // buffers taken, and takes fresh ones.
        INPUT.with(|cell| match cell.try_borrow_mut() {
            Ok(mut input) => matmul_q4_q8_then(w, x, t, y, &mut input, work),
            Err(_) => matmul_q4_q8_then(w, x, t, y, &mut Q8Input::default(), work),
        });
        Ok(())
    }

    /// Copies `n` rows of `cols` columns from `src` (from row `from`) to this one's row `to`.
    pub fn copy_rows(&mut self, to: usize, src: &Self, from: usize, n: usize, cols: usize) {
        let (b, nb) = (cols / 2, cols / Q4_BLOCK);
        Arc::make_mut(&mut self.packed)[to * b..(to + n) * b]
            .copy_from_slice(&src.packed[from * b..(from + n) * b]);
        Arc::make_mut(&mut self.scales)[to * nb..(to + n) * nb]
            .copy_from_slice(&src.scales[from * nb..(from + n) * nb]);
        Arc::make_mut(&mut self.mins)[to * nb..(to + n) * nb]
            .copy_from_slice(&src.mins[from * nb..(from + n) * nb]);
    }

    /// Every value times `factor` (scales and minimums, rounded to f16).
    pub fn scale(&mut self, factor: f32) {
        for h in Arc::make_mut(&mut self.scales)
            .iter_mut()
            .chain(Arc::make_mut(&mut self.mins).iter_mut())
        {
            *h = half::f16::from_f32(h.to_f32() * factor);
        }
    }
}

/// Node `node`'s rows of `m` as 4-bit blocks where it is a data row (its generator row a unit
/// vector, one sub-block) and they lie on a 4-bit grid; `None` otherwise.
pub(crate) fn data_row(
    g: &crate::code::Generator,
    node: usize,
    m: &crate::model::Matrix,
) -> Option<Q4Values> {
    let coeffs = g.coeffs(node);
    let j = coeffs.iter().position(|&c| c == 1.0)?;
    let unit = coeffs
        .iter()
        .enumerate()
        .all(|(i, &c)| c == if i == j { 1.0 } else { 0.0 });
    if !unit || g.sub_blocks() != 1 || m.data.len() != m.rows * m.cols {
        return None;
    }
    // Block j's rows, the last block padded with zero rows.
    let l = g.block_len(m.rows);
    let mut rows = vec![0.0f32; l * m.cols];
    let (first, end) = ((j * l).min(m.rows), ((j + 1) * l).min(m.rows));
    rows[..(end - first) * m.cols].copy_from_slice(&m.data[first * m.cols..end * m.cols]);
    Q4Values::exact(&rows, l, m.cols)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `rows × cols` values on a 4-bit grid: each block its own scale and minimum, every level
    /// 0 and 15 used (as a Q4_1 file's blocks are).
    fn on_grid(rows: usize, cols: usize) -> Vec<f32> {
        let mut next = crate::compute::xorshift(3);
        let mut w = Vec::new();
        for _ in 0..rows * cols / 32 {
            let d = half::f16::from_f32((next() % 1000 + 1) as f32 * 1e-4).to_f32();
            let m = half::f16::from_f32(-((next() % 1000) as f32) * 1e-3).to_f32();
            for i in 0..32u32 {
                let q = match i {
                    0 => 0,
                    1 => 15,
                    _ => next() % 16,
                };
                w.push(d * q as f32 + m);
            }
        }
        w
    }

    #[test]
    fn a_4_bit_files_blocks_are_kept_exactly_and_other_values_are_not_taken() {
        let (rows, cols) = (6, 96);
        let w = on_grid(rows, cols);
        let v = Q4Values::exact(&w, rows, cols).expect("values on a 4-bit grid");
        assert_eq!(v.rows_f32(cols, 0, rows).unwrap(), w);
        assert_eq!(v.bytes(), rows * cols / 2 + 4 * rows * cols / 32);
        assert_eq!(v.rows_f32(cols, 2, 3).unwrap(), w[2 * cols..5 * cols]);
        // One value off its block's grid, or columns that are not whole blocks: not taken.
        let mut off = w.clone();
        off[37] += 1e-3;
        assert!(Q4Values::exact(&off, rows, cols).is_none());
        assert!(Q4Values::exact(&w[..rows * 48], rows, 48).is_none());
        // No parity rows at these bits yet: a code with more rows than k is refused.
        let err = crate::coded::ShardFormat::Q4
            .code(3, 2)
            .unwrap_err()
            .to_string();
        assert!(err.contains("data rows only"), "{err}");
        // An all-equal block (scale 0) is exact.
        let flat = vec![0.25f32; 32];
        assert_eq!(
            Q4Values::exact(&flat, 1, 32)
                .unwrap()
                .rows_f32(32, 0, 1)
                .unwrap(),
            flat
        );
    }

    #[test]
    fn the_product_is_the_blocks_times_the_quantised_input_and_bad_parts_are_refused() {
        let (rows, cols) = (8, 64);
        let w = on_grid(rows, cols);
        let v = Q4Values::exact(&w, rows, cols).unwrap();
        let x: Vec<f32> = (0..cols).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut y = vec![0.0f32; 3];
        use crate::compute::q8::NoRowWork as Nothing;
        v.matmul(cols, 4, 3, &x, 1, &mut y, &Nothing).unwrap();
        for (r, &got) in y.iter().enumerate() {
            let exact: f32 = (w[(4 + r) * cols..(5 + r) * cols].iter().zip(&x))
                .map(|(a, b)| a * b)
                .sum();
            // 8-bit inputs: within a 1 % of the row's absolute products.
            let scale: f32 = (w[(4 + r) * cols..(5 + r) * cols].iter().zip(&x))
                .map(|(a, b)| (a * b).abs())
                .sum();
            assert!(
                (got - exact).abs() <= 1e-2 * scale,
                "row {r}: {got} vs {exact}"
            );
        }
        assert!(v.matmul(cols, 6, 3, &x, 1, &mut y, &Nothing).is_err());
        assert!(v.matmul(cols, 0, 3, &x[1..], 1, &mut y, &Nothing).is_err());
        let mut bad = v.clone();
        Arc::make_mut(&mut bad.mins).pop();
        let err = bad.rows_f32(cols, 0, 1).unwrap_err().to_string();
        assert!(err.contains("minimums"), "{err}");
        assert!(v.rows_f32(48, 0, 1).is_err());
    }
}
