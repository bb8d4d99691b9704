//! Compact rows along a chain. The integer code re-encodes exactly: row `t` is
//! `q_t = Σ_j (a_j / d) · q_{s_j}` with integers `a_j` and `d` ([`Generator::reencode_integers`]),
//! so each source adds `a_j · q_j` to an integer running sum and the last source divides by
//! `d`, which leaves the row's own integers (a remainder means the sources are not one
//! codeword). The scales are the same in every row of a matrix, so the last source sends its
//! own with the piece; the adapters (f32) are summed as an f32 chain sums values. The joiner
//! receives exactly its row's bytes: integers as the row stores them, scales and adapter.

use std::sync::Arc;

use super::{ChainError, Running, Turn};
use crate::code::Generator;
use crate::coded::{
    Adapter, CodedInts, MatrixShape, Q8Values, Shard, ShardValues, adapter_rank, tiled_at, wide_row,
};
use crate::compute::q8::blocks_per_row;
use crate::mesh::{ChainPart, CompactPiece, IntSum, Piece};

/// Adds the term of `shard` (this holder's matrix of the piece `part` asks) to the running sum
/// `before`; the chain's last source returns the finished piece.
pub(super) fn contribute(
    part: &ChainPart,
    g: &Generator,
    shard: &Shard,
    shape: MatrixShape,
    before: Option<Running>,
) -> Result<Turn, ChainError> {
    let ShardValues::Q8(values) = &shard.values else {
        return Err(ChainError::BadRequest(
            "a compact chain reached a holder of a row that is not q8 (4-bit rows are not \
             re-encoded along chains yet)"
                .into(),
        ));
    };
    let rows: Vec<usize> = part.chain.iter().map(|s| s.row as usize).collect();
    let (a, d) = g
        .reencode_integers(part.target as usize, &rows)?
        .ok_or_else(|| ChainError::BadRequest("compact rows need the integer code".into()))?;
    let (first, n, cols) = (
        part.piece.first as usize,
        part.piece.rows as usize,
        shape.cols,
    );
    let rank = adapter_rank(cols);
    let (len, adapter_len) = (n * cols, n * rank);
    let at = part.at as usize;
    let mut sum = match (before, at) {
        (Some(Running::Ints(p)), 1..)
            if p.q.len() == len && (p.adapter.is_empty() || p.adapter.len() == adapter_len) =>
        {
            p
        }
        (None, 0) => IntSum {
            q: vec![0; len],
            adapter: Vec::new(),
        },
        (Some(Running::Ints(p)), _) => {
            return Err(ChainError::BadRequest(format!(
                "an integer running sum of {} values and {} adapter values at position {at}, \
                 where {len} and {adapter_len} were due after position 0",
                p.q.len(),
                p.adapter.len()
            )));
        }
        (Some(Running::Values(_)), _) => {
            return Err(ChainError::BadRequest(
                "an f32 running sum where a compact chain's integers were due".into(),
            ));
        }
        (None, _) => return Err(ChainError::BadRequest("no running sum to add to".into())),
    };
    let aj = a[at];
    let own = first * cols;
    for (i, s) in sum.q.iter_mut().enumerate() {
        let z = i64::from(*s) + aj * i64::from(values.q.get(own + i));
        *s = i32::try_from(z)
            .map_err(|_| ChainError::BadRequest(format!("a running sum of {z} is past an i32")))?;
    }
    if let Some(block) = shard.adapter_block(0) {
        if sum.adapter.is_empty() {
            sum.adapter = vec![0.0; adapter_len];
        }
        let c = aj as f64 / d as f64;
        for r in 0..n {
            for k in 0..rank {
                let v = block[tiled_at(shard.block_len, rank, first + r, k)];
                let dst = &mut sum.adapter[r * rank + k];
                *dst = (f64::from(*dst) + c * f64::from(v)) as f32;
            }
        }
    }
    if at + 1 < part.chain.len() {
        return Ok(Turn::Running(Running::Ints(sum)));
    }
    let mut q = Vec::with_capacity(len);
    for z in sum.q {
        let z = i64::from(z);
        if z % d != 0 {
            return Err(ChainError::BadRequest(format!(
                "the chain's sum {z} is not a multiple of {d}: its sources are not one codeword"
            )));
        }
        q.push(i32::try_from(z / d).map_err(|_| ChainError::BadRequest(format!("{z} / {d}")))?);
    }
    let q = CodedInts::from_i32(q, wide_row(g, part.target as usize))
        .map_err(|e| ChainError::BadRequest(e.to_string()))?;
    let per = blocks_per_row(cols);
    let scales = values
        .scales
        .get(first * per..(first + n) * per)
        .ok_or_else(|| ChainError::BadRequest("this holder's scales are short".into()))?
        .to_vec();
    Ok(Turn::Finished(CompactPiece {
        q,
        scales,
        adapter: sum.adapter,
    }))
}

/// One compact matrix of a row being assembled: the integers as the row stores them, its
/// scales and its adapter (empty until a piece brings one).
#[derive(Debug)]
pub(super) struct Matrix {
    q: CodedInts,
    scales: Vec<half::f16>,
    adapter: Vec<f32>,
}

impl Matrix {
    /// An empty matrix of `shape` for a row stored `wide` (two bytes a value) or not.
    pub(super) fn new(shape: MatrixShape, wide: bool) -> Self {
        let len = shape.block_len * shape.cols;
        Self {
            q: if wide {
                CodedInts::I16(Arc::new(vec![0; len]))
            } else {
                CodedInts::I8(Arc::new(vec![0; len]))
            },
            scales: vec![half::f16::ZERO; shape.block_len * blocks_per_row(shape.cols)],
            adapter: Vec::new(),
        }
    }

    /// Stores a finished piece (untrusted: checked against the shape) and returns its bytes.
    pub(super) fn add(
        &mut self,
        shape: MatrixShape,
        piece: &Piece,
        p: CompactPiece,
    ) -> Result<u64, ChainError> {
        let (first, n, cols) = (piece.first as usize, piece.rows as usize, shape.cols);
        let (per, rank) = (blocks_per_row(cols), adapter_rank(cols));
        let same_width = matches!(
            (&self.q, &p.q),
            (CodedInts::I8(_), CodedInts::I8(_)) | (CodedInts::I16(_), CodedInts::I16(_))
        );
        if !same_width
            || p.q.len() != n * cols
            || p.scales.len() != n * per
            || !(p.adapter.is_empty() || p.adapter.len() == n * rank)
        {
            return Err(ChainError::BadRequest(format!(
                "a compact piece of {} values, {} scales and {} adapter values does not fill \
                 rows {first}..+{n} of {cols} columns",
                p.q.len(),
                p.scales.len(),
                p.adapter.len()
            )));
        }
        let bytes = (p.q.bytes() + p.scales.len() * 2 + p.adapter.len() * 4) as u64;
        let at = first * cols..(first + n) * cols;
        match (&mut self.q, &p.q) {
            (CodedInts::I8(dst), CodedInts::I8(src)) => {
                Arc::make_mut(dst)[at.clone()].copy_from_slice(&src[..]);
            }
            (CodedInts::I16(dst), CodedInts::I16(src)) => {
                Arc::make_mut(dst)[at.clone()].copy_from_slice(&src[..]);
            }
            _ => unreachable!("the widths were checked to match"),
        }
        self.scales[first * per..(first + n) * per].copy_from_slice(&p.scales);
        if !p.adapter.is_empty() {
            if self.adapter.is_empty() {
                self.adapter = vec![0.0; shape.block_len * rank];
            }
            for r in 0..n {
                for k in 0..rank {
                    self.adapter[tiled_at(shape.block_len, rank, first + r, k)] =
                        p.adapter[r * rank + k];
                }
            }
        }
        Ok(bytes)
    }

    /// The finished shard of `shape`.
    pub(super) fn finish(self, shape: MatrixShape) -> Shard {
        Shard {
            out: shape.out,
            block_len: shape.block_len,
            cols: shape.cols,
            values: ShardValues::Q8(Q8Values {
                q: self.q,
                scales: Arc::new(self.scales),
            }),
            adapter: Adapter {
                a: self.adapter,
                carry: Vec::new(),
            },
            carry: Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{run_chain, src, tiny};
    use super::*;
    use crate::chain::Assembly;
    use crate::coded::{ShardFormat, ShardSet};
    use crate::model::ModelWeights;

    /// Rows 0..5 of an integer code (k = 3, room for 7) of a tiny model, compact, whose data
    /// rows learnt (random adapters) and whose other rows hold the adapters' codeword.
    fn learnt_rows() -> (Generator, Vec<ShardSet>) {
        let w = ModelWeights::synthetic(tiny(), 3).unwrap();
        let g = Generator::integer(5, 3, None).unwrap();
        let mut sets: Vec<ShardSet> = (0..3)
            .map(|r| ShardSet::encode(&w, &g, r, ShardFormat::Q8, &mut |_, _| {}).unwrap())
            .collect();
        let mut x = 1u32;
        for set in &mut sets {
            for shard in set.blocks.iter_mut().flatten().chain([&mut set.embed]) {
                shard.adapter.a = (0..shard.adapter_len())
                    .map(|_| {
                        x = x.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                        (x >> 8) as f32 / (1u32 << 24) as f32 - 0.5
                    })
                    .collect();
            }
        }
        for r in 3..5 {
            let data: Vec<&ShardSet> = sets[..3].iter().collect();
            let parity = ShardSet::reencode(r, &data).unwrap();
            sets.push(parity);
        }
        (g, sets)
    }

    /// Builds row `target` along `chain` over `sets`: the row and the bytes the joiner took.
    fn build(g: &Generator, sets: &[ShardSet], target: u32, chain: &[u32]) -> (ShardSet, u64) {
        let chain: Vec<_> = chain.iter().map(|&r| src(r)).collect();
        let mut asm = Assembly::new(&tiny(), g, target as usize, ShardFormat::Q8).unwrap();
        for piece in asm.pieces() {
            let answer = run_chain(sets, target, &chain, piece).unwrap();
            assert!(matches!(answer, Turn::Finished(_)));
            asm.add(&piece, answer).unwrap();
        }
        let received = asm.received();
        (asm.finish(), received)
    }

    #[test]
    fn a_compact_chain_gives_the_re_encoded_row_bit_for_bit_and_one_rows_bytes() {
        let (g, sets) = learnt_rows();
        // A new parity row (two bytes a value) and a lost data row (one byte a value).
        for (target, chain) in [(6u32, [4u32, 0, 2]), (1, [3, 4, 2])] {
            let (built, received) = build(&g, &sets, target, &chain);
            let from: Vec<&ShardSet> = chain.iter().map(|&r| &sets[r as usize]).collect();
            let direct = ShardSet::reencode(target as usize, &from).unwrap();
            assert_eq!(received, direct.bytes() as u64, "row {target}");
            assert_eq!(built.node, target as usize);
            for (b, d) in built.matrices().zip(direct.matrices()) {
                assert_eq!(b.values, d.values, "row {target}: integers and scales");
                assert_eq!(b.adapter.a.len(), d.adapter.a.len());
                for (x, y) in b.adapter.a.iter().zip(&d.adapter.a) {
                    assert!((x - y).abs() <= 1e-6 * (1.0 + y.abs()), "{x} vs {y}");
                }
            }
            built.check_shapes().unwrap();
        }
        // A data row rebuilt is the row encoding gave it.
        let (built, _) = build(&g, &sets, 1, &[3, 4, 2]);
        for (b, d) in built.matrices().zip(sets[1].matrices()) {
            assert_eq!(b.values, d.values);
        }
    }

    #[test]
    fn a_source_off_the_codeword_is_refused_when_the_sum_cannot_divide() {
        let (g, mut sets) = learnt_rows();
        // Pick a chain whose common denominator is over 1, so a wrong integer shows.
        let (target, chain) = [(6u32, [4u32, 0, 2]), (6, [3, 4, 2]), (5, [3, 4, 0])]
            .into_iter()
            .find(|(t, c)| {
                let rows: Vec<usize> = c.iter().map(|&r| r as usize).collect();
                g.reencode_integers(*t as usize, &rows).unwrap().unwrap().1 > 1
            })
            .expect("a chain with a denominator over 1");
        let ShardValues::Q8(v) = &mut sets[chain[1] as usize].embed.values else {
            panic!("compact rows");
        };
        match &mut v.q {
            CodedInts::I8(q) => Arc::make_mut(q)[0] += 1,
            CodedInts::I16(q) => Arc::make_mut(q)[0] += 1,
        }
        let asm = Assembly::new(&tiny(), &g, target as usize, ShardFormat::Q8).unwrap();
        let chain: Vec<_> = chain.iter().map(|&r| src(r)).collect();
        let embed = (tiny().layers * 7) as u32;
        let piece = asm
            .pieces()
            .into_iter()
            .find(|p| p.matrix == embed && p.first == 0)
            .unwrap();
        let e = run_chain(&sets, target, &chain, piece).unwrap_err();
        assert!(e.to_string().contains("not one codeword"), "{e}");
    }

    #[test]
    fn bad_compact_answers_are_refused() {
        let (g, sets) = learnt_rows();
        let chain = [src(4), src(0), src(2)];
        let mut asm = Assembly::new(&tiny(), &g, 6, ShardFormat::Q8).unwrap();
        let piece = asm.pieces()[0];
        let Turn::Finished(good) = run_chain(&sets, 6, &chain, piece).unwrap() else {
            panic!("the last source finishes a compact piece");
        };
        let short = CompactPiece {
            scales: good.scales[1..].to_vec(),
            ..good.clone()
        };
        let narrow = CompactPiece {
            q: CodedInts::I8(Arc::new(vec![0; good.q.len()])),
            ..good.clone()
        };
        let ragged = CompactPiece {
            adapter: vec![0.0; 3],
            ..good.clone()
        };
        for bad in [short, narrow, ragged] {
            assert!(asm.add(&piece, Turn::Finished(bad)).is_err());
        }
        let sum = Turn::Running(Running::Values(vec![0.0; good.q.len()]));
        assert!(asm.add(&piece, sum).is_err());
        asm.add(&piece, Turn::Finished(good)).unwrap();
        // A source refuses an f32 sum, and a sum of the wrong length.
        let part = ChainPart {
            target: 6,
            chain: chain.to_vec(),
            at: 1,
            version: [1; 32],
            piece,
        };
        let len = part.check(&g, &tiny()).unwrap().1;
        let f32_sum = Some(Running::Values(vec![0.0; len]));
        assert!(part.contribute(&sets[0], &[1; 32], f32_sum).is_err());
        let short = Some(Running::Ints(IntSum {
            q: vec![0; len - 1],
            adapter: Vec::new(),
        }));
        assert!(part.contribute(&sets[0], &[1; 32], short).is_err());
        let first = ChainPart {
            at: 0,
            ..part.clone()
        };
        let fine = Some(Running::Ints(IntSum {
            q: vec![0; len],
            adapter: Vec::new(),
        }));
        assert!(first.contribute(&sets[4], &[1; 32], fine).is_err());
    }
}
