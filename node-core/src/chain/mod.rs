//! Chain encoding: a new or lost row built by k holders in turn, so no node gathers the model.
//!
//! Row `t`'s shard is `S_t = Σ_j C_j · S_{s_j}` over k source rows `s_j`, where `C_j` is source
//! `j`'s `m × m` block of [`Generator::reencode_coeffs`]. The joiner asks the last source of the
//! chain for a [`Piece`] (some rows of one matrix); each source asks the one before it for the
//! running sum of that piece, adds its own term and answers with the sum. The first source
//! starts from zero. So the joiner receives one shard's worth of values, every source but the
//! first receives one running sum per piece, the first receives none, and no node holds more
//! than its own row and the pieces in flight. For f32 and f16 rows the running sums are f32,
//! so rounding happens once, when the joiner stores the finished row; compact rows sum their
//! integers exactly and the last source sends the finished piece ([`compact`]).

mod compact;

use crate::code::Generator;
use crate::coded::{MatrixShape, Shard, ShardFormat, ShardSet, ShardValues, shapes, wide_row};
use crate::mesh::{CHUNK_BYTES, CompactPiece, IntSum, MAX_CHUNK_BYTES, MeshResponse, SourceRow};
pub use crate::mesh::{ChainPart, Piece};
use crate::model::LlamaConfig;

/// Errors of chain encoding.
#[derive(Debug, thiserror::Error)]
pub enum ChainError {
    /// The request does not describe a chain of this mesh's code and model.
    #[error("chain request: {0}")]
    BadRequest(String),
    /// This holder is at another version than the chain's.
    #[error(
        "this holder's row moved to another version than the chain's (an update is spreading); try again"
    )]
    Version,
    /// The code could not give the coefficients.
    #[error(transparent)]
    Code(#[from] crate::code::CodeError),
}

/// A running sum as it passes from one source of a chain to the next.
#[derive(Debug, Clone, PartialEq)]
pub enum Running {
    /// f32 sums: f32 and f16 rows.
    Values(Vec<f32>),
    /// Integer sums and the adapters' sum: compact rows.
    Ints(IntSum),
}

/// A source's answer in a chain.
#[derive(Debug, Clone, PartialEq)]
pub enum Turn {
    /// The running sum up to and including this source.
    Running(Running),
    /// A compact chain's finished piece, from its last source.
    Finished(CompactPiece),
}

impl Running {
    /// Bytes of its values (four each).
    pub fn bytes(&self) -> u64 {
        match self {
            Self::Values(v) => v.len() as u64 * 4,
            Self::Ints(s) => (s.q.len() + s.adapter.len()) as u64 * 4,
        }
    }
}

impl From<Turn> for MeshResponse {
    fn from(t: Turn) -> Self {
        match t {
            Turn::Running(Running::Values(v)) => Self::Partial(v),
            Turn::Running(Running::Ints(s)) => Self::IntPartial(s),
            Turn::Finished(p) => Self::CompactPiece(p),
        }
    }
}

impl TryFrom<MeshResponse> for Turn {
    type Error = MeshResponse;

    /// The chain answer a response carries, or the response when it carries none.
    fn try_from(r: MeshResponse) -> Result<Self, MeshResponse> {
        match r {
            MeshResponse::Partial(v) => Ok(Self::Running(Running::Values(v))),
            MeshResponse::IntPartial(s) => Ok(Self::Running(Running::Ints(s))),
            MeshResponse::CompactPiece(p) => Ok(Self::Finished(p)),
            other => Err(other),
        }
    }
}

/// Values a row holds in f32: what a chain sends to build one.
pub fn row_values(shapes: &[MatrixShape], m: usize) -> u64 {
    shapes
        .iter()
        .map(|s| (m * s.block_len * s.cols) as u64)
        .sum()
}

/// The pieces of a row, each of at most [`CHUNK_BYTES`] of f32 (one row at least).
pub fn pieces(shapes: &[MatrixShape], m: usize) -> Vec<Piece> {
    let mut out = Vec::new();
    for (i, s) in shapes.iter().enumerate() {
        let row_bytes = (m * s.cols * 4).max(1);
        let per = (CHUNK_BYTES as usize / row_bytes).clamp(1, s.block_len.max(1));
        let mut first = 0;
        while first < s.block_len {
            let rows = per.min(s.block_len - first);
            out.push(Piece {
                matrix: i as u32,
                first: first as u32,
                rows: rows as u32,
            });
            first += rows;
        }
    }
    out
}

/// The matrix `i` of a shard set in [`shapes`]'s order.
fn matrix(set: &ShardSet, i: usize) -> Option<&Shard> {
    let layered = set.blocks.len() * 7;
    if i < layered {
        set.blocks.get(i / 7).and_then(|b| b.get(i % 7))
    } else if i == layered {
        Some(&set.embed)
    } else if i == layered + 1 {
        set.lm_head.as_ref()
    } else {
        None
    }
}

impl ChainPart {
    /// Checks the request against the mesh's code and model: the chain is k distinct rows
    /// other than the target, the piece lies inside its matrix and fits a message. Returns the
    /// piece's shape and its length in f32 values.
    pub fn check(
        &self,
        g: &Generator,
        cfg: &LlamaConfig,
    ) -> Result<(MatrixShape, usize), ChainError> {
        let bad = |s: String| Err(ChainError::BadRequest(s));
        let rows: Vec<usize> = self.chain.iter().map(|s| s.row as usize).collect();
        if rows.len() != g.k() {
            return bad(format!(
                "{} source rows, the code needs k = {}",
                rows.len(),
                g.k()
            ));
        }
        let mut sorted = rows.clone();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() != rows.len() || rows.contains(&(self.target as usize)) {
            return bad("the source rows repeat or include the target".into());
        }
        if let Some(&r) = rows
            .iter()
            .chain([&(self.target as usize)])
            .find(|&&r| r >= g.n())
        {
            return bad(format!("row {r} is past the code's {} rows", g.n()));
        }
        if self.at as usize >= rows.len() {
            return bad(format!("position {} in a chain of {}", self.at, rows.len()));
        }
        let shapes = shapes(cfg, g);
        let Some(&shape) = shapes.get(self.piece.matrix as usize) else {
            return bad(format!("matrix {} of {}", self.piece.matrix, shapes.len()));
        };
        let (first, n) = (self.piece.first as usize, self.piece.rows as usize);
        if n == 0 || first.checked_add(n).is_none_or(|end| end > shape.block_len) {
            return bad(format!(
                "rows {first}..+{n} of a sub-block of {}",
                shape.block_len
            ));
        }
        let len = g.sub_blocks() * n * shape.cols;
        if len * 4 > MAX_CHUNK_BYTES as usize {
            return bad(format!("a piece of {} bytes is over the limit", len * 4));
        }
        Ok((shape, len))
    }

    /// The same piece asked of the source before this one, if there is one.
    pub fn before(&self) -> Option<(SourceRow, ChainPart)> {
        let at = self.at.checked_sub(1)?;
        let src = self.chain.get(at as usize)?.clone();
        Some((src, ChainPart { at, ..self.clone() }))
    }

    /// Adds this holder's term (it holds `set`, at version `version`) to the running sum of the
    /// sources before it (`None` for the first source): the new running sum, or from a compact
    /// chain's last source the finished piece.
    pub fn contribute(
        &self,
        set: &ShardSet,
        version: &[u8; 32],
        before: Option<Running>,
    ) -> Result<Turn, ChainError> {
        let g = &set.generator;
        let (shape, len) = self.check(g, &set.cfg)?;
        if *version != self.version {
            return Err(ChainError::Version);
        }
        let at = self.at as usize;
        if set.node != self.chain[at].row as usize {
            return Err(ChainError::BadRequest(format!(
                "this holder has row {}, the chain asks for row {} here",
                set.node, self.chain[at].row
            )));
        }
        let shard = matrix(set, self.piece.matrix as usize)
            .filter(|s| s.block_len == shape.block_len && s.cols == shape.cols)
            .ok_or_else(|| ChainError::BadRequest("this holder's shard lacks the matrix".into()))?;
        if shard.format() == ShardFormat::Q8 {
            return compact::contribute(self, g, shard, shape, before);
        }
        let mut sum = match (before, at) {
            (Some(Running::Values(p)), 1..) if p.len() == len => p,
            (None, 0) => vec![0.0f32; len],
            (Some(Running::Values(p)), _) => {
                return Err(ChainError::BadRequest(format!(
                    "a running sum of {} values at position {at}, where {len} were due after \
                     position 0",
                    p.len()
                )));
            }
            (Some(Running::Ints(_)), _) => {
                return Err(ChainError::BadRequest(
                    "an integer running sum where a chain of f32 sums was due".into(),
                ));
            }
            (None, _) => return Err(ChainError::BadRequest("no running sum to add to".into())),
        };
        let rows: Vec<usize> = self.chain.iter().map(|s| s.row as usize).collect();
        let coeffs = g.reencode_coeffs(self.target as usize, &rows)?;
        let (m, km) = (g.sub_blocks(), g.k() * g.sub_blocks());
        let (first, n, cols) = (
            self.piece.first as usize,
            self.piece.rows as usize,
            shape.cols,
        );
        // Each of this shard's rows is read once and added into every target sub-block.
        let mut own = Vec::with_capacity(cols);
        for r in 0..n {
            for sub in 0..m {
                own.clear();
                shard.push_row(sub, first + r, &mut own);
                for s in 0..m {
                    let c = coeffs[s * km + at * m + sub];
                    let dst = &mut sum[(s * n + r) * cols..(s * n + r + 1) * cols];
                    for (d, &v) in dst.iter_mut().zip(&own) {
                        *d = (*d as f64 + c * v as f64) as f32;
                    }
                }
            }
        }
        Ok(Turn::Running(Running::Values(sum)))
    }
}

/// A row being assembled from finished pieces.
#[derive(Debug)]
pub struct Assembly {
    cfg: LlamaConfig,
    generator: Generator,
    target: usize,
    shapes: Vec<MatrixShape>,
    store: Store,
    received: u64,
}

/// What an assembly holds: its row's matrices as they fill.
#[derive(Debug)]
enum Store {
    /// f32 values of each matrix, stored in the format at the end (f32 or f16).
    Values(ShardFormat, Vec<Vec<f32>>),
    /// Each compact matrix as the row stores it.
    Compact(Vec<compact::Matrix>),
}

impl Assembly {
    /// An empty row `target` of the model `cfg` under the code `g`, stored in `format`
    /// (compact rows need the integer code).
    pub fn new(
        cfg: &LlamaConfig,
        g: &Generator,
        target: usize,
        format: ShardFormat,
    ) -> Result<Self, ChainError> {
        if target >= g.n() {
            return Err(ChainError::BadRequest(format!(
                "row {target} is past the code's {} rows",
                g.n()
            )));
        }
        let shapes = shapes(cfg, g);
        let store = match format {
            ShardFormat::Q8 => {
                if g.levels().is_none() || g.sub_blocks() != 1 {
                    return Err(ChainError::BadRequest(
                        "compact (q8) rows need the integer code".into(),
                    ));
                }
                let wide = wide_row(g, target);
                Store::Compact(
                    shapes
                        .iter()
                        .map(|&s| compact::Matrix::new(s, wide))
                        .collect(),
                )
            }
            _ => {
                let m = g.sub_blocks();
                let values = shapes
                    .iter()
                    .map(|s| vec![0.0f32; m * s.block_len * s.cols])
                    .collect();
                Store::Values(format, values)
            }
        };
        Ok(Self {
            cfg: cfg.clone(),
            generator: g.clone(),
            target,
            shapes,
            store,
            received: 0,
        })
    }

    /// Every piece the row needs.
    pub fn pieces(&self) -> Vec<Piece> {
        pieces(&self.shapes, self.generator.sub_blocks())
    }

    /// Bytes of the row taken so far: f32 sums for f32 and f16 rows, the row's own bytes for
    /// compact rows.
    pub fn received(&self) -> u64 {
        self.received
    }

    /// Stores a finished piece, the last source's answer (untrusted: checked against the
    /// row's shape and format).
    pub fn add(&mut self, piece: &Piece, answer: Turn) -> Result<(), ChainError> {
        let m = self.generator.sub_blocks();
        let shape = self.shapes.get(piece.matrix as usize).copied();
        let (first, n) = (piece.first as usize, piece.rows as usize);
        let Some(shape) = shape.filter(|s| first.checked_add(n).is_some_and(|e| e <= s.block_len))
        else {
            return Err(ChainError::BadRequest(format!("no such piece {piece:?}")));
        };
        let i = piece.matrix as usize;
        match (&mut self.store, answer) {
            (Store::Values(_, values), Turn::Running(Running::Values(sum))) => {
                let cols = shape.cols;
                if sum.len() != m * n * cols {
                    return Err(ChainError::BadRequest(format!(
                        "a piece of {} values where {} were due",
                        sum.len(),
                        m * n * cols
                    )));
                }
                let dst = &mut values[i];
                for s in 0..m {
                    let at = (s * shape.block_len + first) * cols;
                    dst[at..at + n * cols].copy_from_slice(&sum[s * n * cols..(s + 1) * n * cols]);
                }
                self.received += sum.len() as u64 * 4;
            }
            (Store::Compact(matrices), Turn::Finished(p)) => {
                self.received += matrices[i].add(shape, piece, p)?;
            }
            (Store::Values(..), _) => {
                return Err(ChainError::BadRequest(
                    "a compact piece where f32 sums were due".into(),
                ));
            }
            (Store::Compact(_), _) => {
                return Err(ChainError::BadRequest(
                    "a running sum where a compact row's finished piece was due".into(),
                ));
            }
        }
        Ok(())
    }

    /// The finished row.
    pub fn finish(self) -> ShardSet {
        let shards: Vec<Shard> = match self.store {
            Store::Values(format, values) => self
                .shapes
                .iter()
                .zip(values)
                .map(|(s, v)| Shard {
                    out: s.out,
                    block_len: s.block_len,
                    cols: s.cols,
                    values: match format {
                        ShardFormat::F16 => {
                            ShardValues::F16(v.iter().map(|&x| half::f16::from_f32(x)).collect())
                        }
                        _ => ShardValues::F32(v),
                    },
                    adapter: Default::default(),
                    carry: Vec::new(),
                })
                .collect(),
            Store::Compact(matrices) => self
                .shapes
                .iter()
                .zip(matrices)
                .map(|(&s, m)| m.finish(s))
                .collect(),
        };
        let mut shards = shards.into_iter();
        let blocks = (0..self.cfg.layers)
            .map(|_| shards.by_ref().take(7).collect())
            .collect();
        let embed = shards.next().expect("shapes lists the embedding");
        let lm_head = shards.next();
        ShardSet {
            cfg: self.cfg,
            generator: self.generator,
            node: self.target,
            blocks,
            embed,
            lm_head,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ModelWeights;

    pub(super) fn tiny() -> LlamaConfig {
        LlamaConfig {
            hidden: 16,
            ffn: 40,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 4,
            vocab: 50,
            norm_eps: 1e-5,
            rope_theta: 10000.0,
            max_seq: 64,
            tied_embeddings: false,
            family: crate::model::Family::Llama,
            rope_freq_factors: Vec::new(),
        }
    }

    pub(super) fn src(row: u32) -> SourceRow {
        SourceRow {
            row,
            peer: format!("p{row}"),
            addrs: Vec::new(),
        }
    }

    fn values(s: &Shard) -> Vec<f32> {
        s.values_f32().into_owned()
    }

    /// Runs `piece` of row `target` along `chain` (source rows of `sets`, by row) and returns
    /// the last source's answer.
    pub(super) fn run_chain(
        sets: &[ShardSet],
        target: u32,
        chain: &[SourceRow],
        piece: Piece,
    ) -> Result<Turn, ChainError> {
        let mut before = None;
        for at in 0..chain.len() {
            let part = ChainPart {
                target,
                chain: chain.to_vec(),
                at: at as u32,
                version: [1; 32],
                piece,
            };
            let row = chain[at].row as usize;
            match part.contribute(&sets[row], &[1; 32], before.take())? {
                Turn::Running(r) if at + 1 < chain.len() => before = Some(r),
                last => return Ok(last),
            }
        }
        Err(ChainError::BadRequest("an empty chain".into()))
    }

    #[test]
    fn a_chain_builds_the_row_that_direct_encoding_gives() {
        let cfg = tiny();
        let w = ModelWeights::synthetic(cfg.clone(), 3).unwrap();
        let g = Generator::growing(5, 3, Some(8)).unwrap();
        let sets: Vec<ShardSet> = (0..8)
            .map(|r| ShardSet::encode(&w, &g, r, ShardFormat::F32, &mut |_, _| {}).unwrap())
            .collect();
        let (target, chain) = (6u32, vec![src(4), src(0), src(2)]);
        let mut asm = Assembly::new(&cfg, &g, target as usize, ShardFormat::F32).unwrap();
        for piece in asm.pieces() {
            let answer = run_chain(&sets, target, &chain, piece).unwrap();
            asm.add(&piece, answer).unwrap();
        }
        assert_eq!(
            asm.received(),
            row_values(&shapes(&cfg, &g), g.sub_blocks()) * 4
        );
        assert_eq!(asm.received() as usize, sets[6].bytes());
        let built = asm.finish();
        let direct = &sets[6];
        assert_eq!(built.blocks.len(), direct.blocks.len());
        let pairs = built
            .blocks
            .iter()
            .flatten()
            .zip(direct.blocks.iter().flatten())
            .chain([(&built.embed, &direct.embed)])
            .chain(built.lm_head.iter().zip(direct.lm_head.iter()));
        for (b, d) in pairs {
            assert_eq!((b.out, b.block_len, b.cols), (d.out, d.block_len, d.cols));
            let (b, d) = (values(b), values(d));
            let scale = d.iter().fold(0f32, |a, v| a.max(v.abs()));
            let err = b
                .iter()
                .zip(&d)
                .fold(0f32, |a, (x, y)| a.max((x - y).abs()));
            assert!(err <= 1e-5 * scale, "{err} of {scale}");
        }
    }

    #[test]
    fn bad_chain_requests_are_refused() {
        let cfg = tiny();
        let w = ModelWeights::synthetic(cfg.clone(), 3).unwrap();
        let g = Generator::growing(5, 3, Some(8)).unwrap();
        let set = ShardSet::encode(&w, &g, 1, ShardFormat::F32, &mut |_, _| {}).unwrap();
        let ok = ChainPart {
            target: 6,
            chain: vec![src(0), src(1), src(2)],
            at: 1,
            version: [0; 32],
            piece: Piece {
                matrix: 0,
                first: 0,
                rows: 1,
            },
        };
        let len = ok.check(&g, &cfg).unwrap().1;
        assert!(
            ok.contribute(&set, &[0; 32], Some(Running::Values(vec![0.0; len])))
                .is_ok()
        );
        let refused = [
            ChainPart {
                chain: vec![src(0), src(1)],
                ..ok.clone()
            },
            ChainPart {
                chain: vec![src(0), src(1), src(1)],
                ..ok.clone()
            },
            ChainPart {
                target: 1,
                ..ok.clone()
            },
            ChainPart {
                target: 99,
                ..ok.clone()
            },
            ChainPart {
                at: 3,
                ..ok.clone()
            },
            ChainPart {
                at: 2,
                ..ok.clone()
            },
            ChainPart {
                piece: Piece {
                    matrix: 999,
                    ..ok.piece
                },
                ..ok.clone()
            },
            ChainPart {
                piece: Piece {
                    first: u32::MAX,
                    ..ok.piece
                },
                ..ok.clone()
            },
            ChainPart {
                piece: Piece {
                    rows: 0,
                    ..ok.piece
                },
                ..ok.clone()
            },
        ];
        for bad in refused {
            assert!(
                bad.contribute(&set, &[0; 32], Some(Running::Values(vec![0.0; len])))
                    .is_err(),
                "{bad:?}"
            );
        }
        assert!(matches!(
            ok.contribute(&set, &[9; 32], Some(Running::Values(vec![0.0; len]))),
            Err(ChainError::Version)
        ));
        assert!(
            ok.contribute(&set, &[0; 32], Some(Running::Values(vec![0.0; len + 1])))
                .is_err()
        );
        assert!(ok.contribute(&set, &[0; 32], None).is_err());
        let mut asm = Assembly::new(&cfg, &g, 6, ShardFormat::F32).unwrap();
        assert!(
            asm.add(
                &ok.piece,
                Turn::Running(Running::Values(vec![0.0; len - 1]))
            )
            .is_err()
        );
        assert!(
            asm.add(
                &Piece {
                    matrix: 999,
                    ..ok.piece
                },
                Turn::Running(Running::Values(Vec::new()))
            )
            .is_err()
        );
    }
}
