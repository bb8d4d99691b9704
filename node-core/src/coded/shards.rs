//! A member's coded storage: one shard of every linear matrix of the model.

use serde::{Deserialize, Serialize};

use super::CodedError;
use super::adapter::{Adapter, AddRows, adapter_rank};
use super::compact::{Q8Values, encode_q8, wide_row};
use crate::code::Generator;
use crate::compute::matmul;
use crate::compute::q8::{NoRowWork, matmul_q8, matmul_q8_then};
use crate::model::{LlamaConfig, Matrix, ModelWeights, Stage};

/// The shape of one coded matrix of a row: `m` sub-blocks of `block_len × cols`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatrixShape {
    /// Rows of the uncoded matrix.
    pub out: usize,
    /// Rows of one sub-block.
    pub block_len: usize,
    /// Columns.
    pub cols: usize,
}

/// The matrices of a row of `cfg` under `g`, in chain order: per block q, k, v, o, gate, up,
/// down; then the embedding; then the separate LM head when there is one.
pub fn shapes(cfg: &LlamaConfig, g: &Generator) -> Vec<MatrixShape> {
    cfg.matrix_shapes()
        .into_iter()
        .map(|(out, cols)| MatrixShape {
            out,
            block_len: g.block_len(out),
            cols,
        })
        .collect()
}

/// How shard values are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum ShardFormat {
    /// 32-bit floats: the decode error of the code alone (docs/coding.md).
    #[default]
    F32,
    /// 16-bit floats: half the bytes to read, more rounding error (docs/perf.md).
    F16,
    /// Compact: 8-bit integers of the integer code with shared f16 scales, an exact codeword
    /// of the weights on their grid (docs/coding.md, "Compact shards").
    Q8,
    /// Data rows at a 4-bit file's own blocks where the weights lie on them, the rest as
    /// [`Self::Q8`]'s data rows; no parity rows yet, so n = k (issue 81, [`super::Q4Values`]).
    Q4,
}

impl ShardFormat {
    /// The code of `n` rows for `k` blocks that shards of this format are encoded with: the
    /// integer code for compact shards (their values must stay integers), complex Cauchy
    /// otherwise.
    pub fn code(self, n: usize, k: usize) -> Result<Generator, crate::code::CodeError> {
        match self {
            Self::Q8 => {
                let rows = Generator::integer_capacity(k);
                if n > rows {
                    return Err(crate::code::CodeError::IntegerRows { k, n, rows });
                }
                let seeded =
                    u32::try_from(n).map_err(|_| crate::code::CodeError::Params { k, n })?;
                Generator::new(crate::code::Construction::Integer { seeded }, n, k)
            }
            Self::Q4 if n != k => Err(crate::code::CodeError::FourBitParity { k, n }),
            Self::Q4 => Self::Q8.code(n, k),
            Self::F32 | Self::F16 => Generator::cauchy(n, k),
        }
    }

    /// Whether values are integers with scales (q8, q4): they learn in an adapter.
    pub fn compact(self) -> bool {
        matches!(self, Self::Q8 | Self::Q4)
    }

    /// Whether a shard set may hold matrices of both formats: a q4 set's matrices that do not
    /// lie on a 4-bit grid are q8.
    pub fn stores_like(self, other: Self) -> bool {
        self == other || (self.compact() && other.compact())
    }
}

impl std::str::FromStr for ShardFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "f32" => Ok(Self::F32),
            "f16" => Ok(Self::F16),
            "q8" => Ok(Self::Q8),
            "q4" => Ok(Self::Q4),
            other => Err(format!(
                "unknown shard format {other:?} (f32, f16, q8 or q4)"
            )),
        }
    }
}

/// Shard values in their storage format.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ShardValues {
    /// f32 values.
    F32(Vec<f32>),
    /// f16 values.
    F16(Vec<half::f16>),
    /// Compact values: integers of the integer code and their scales.
    Q8(Q8Values),
    /// A data row's 4-bit blocks, as a 4-bit file holds them.
    Q4(super::Q4Values),
}

impl ShardValues {
    /// f32 values stored in `format` (rounded to f16 for [`ShardFormat::F16`]); compact values
    /// come from integers, not from f32 sums, so [`ShardFormat::Q8`] is refused.
    pub fn from_f32(data: Vec<f32>, format: ShardFormat) -> Result<Self, CodedError> {
        match format {
            ShardFormat::F32 => Ok(Self::F32(data)),
            ShardFormat::F16 => Ok(Self::F16(
                data.iter().map(|&v| half::f16::from_f32(v)).collect(),
            )),
            ShardFormat::Q8 | ShardFormat::Q4 => Err(CodedError::BadRequest(
                "compact (q8, q4) values are built from the integer code, not from f32 values"
                    .into(),
            )),
        }
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        match self {
            Self::F32(v) => v.len(),
            Self::F16(v) => v.len(),
            Self::Q8(v) => v.q.len(),
            Self::Q4(v) => v.len(),
        }
    }

    /// Whether there are no values.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One coded matrix: `m·L` rows of `cols`, where the uncoded matrix had `out` rows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Shard {
    /// Rows of the uncoded matrix.
    pub out: usize,
    /// Rows of one sub-block (`L`).
    pub block_len: usize,
    /// Columns (inputs).
    pub cols: usize,
    /// `m·L × cols` values, row-major.
    pub values: ShardValues,
    /// What rounding the values to f32 left out of the learning updates applied so far, per
    /// value (compensated summation; empty until the first update). Kept in memory only:
    /// without it each update's rounding would add up over the shard's history, and the rows
    /// of the code, each rounded its own way, would drift apart until the residual check
    /// failed honest members.
    #[serde(skip)]
    pub carry: Vec<f32>,
    /// What a compact shard has learnt (docs/coding.md, "Learning on compact shards"); empty
    /// for f32 shards, which learn in their values.
    pub adapter: Adapter,
}

impl Shard {
    /// Encodes node `node`'s shard of a matrix, stored in `format`.
    pub fn encode(
        g: &Generator,
        node: usize,
        m: &Matrix,
        format: ShardFormat,
    ) -> Result<Self, CodedError> {
        let values = match format {
            ShardFormat::Q8 => ShardValues::Q8(encode_q8(g, node, &m.data, m.rows, m.cols)?),
            ShardFormat::Q4 => match super::fourbit::data_row(g, node, m) {
                Some(v) => ShardValues::Q4(v),
                None => ShardValues::Q8(encode_q8(g, node, &m.data, m.rows, m.cols)?),
            },
            _ => ShardValues::from_f32(g.encode_shard(node, &m.data, m.rows, m.cols)?, format)?,
        };
        Ok(Self {
            out: m.rows,
            block_len: g.block_len(m.rows),
            cols: m.cols,
            values,
            carry: Vec::new(),
            adapter: Adapter::default(),
        })
    }

    /// Values of [`Self::adapter`] once it has learnt: every stored row's
    /// [`adapter_rank`].
    pub fn adapter_len(&self) -> usize {
        self.stored_rows() * adapter_rank(self.cols)
    }

    /// Sub-block `s`'s adapter values (`L × rank`, [`super::tiled_at`]); `None` while nothing
    /// was learnt.
    pub fn adapter_block(&self, s: usize) -> Option<&[f32]> {
        let n = self.block_len * adapter_rank(self.cols);
        self.adapter.a.get(s * n..(s + 1) * n)
    }

    /// Rows stored: every sub-block's `L` rows.
    pub fn stored_rows(&self) -> usize {
        self.values.len() / self.cols.max(1)
    }

    /// `y (t × L) = x (t × cols) · S_sᵀ` for sub-block `s` (rows `[s·L, (s+1)·L)`), plus what a
    /// compact shard's adapter learnt when given `z = x·Vᵀ` (`t × rank`), added as the rows are
    /// computed.
    pub fn matmul_sub_block(
        &self,
        s: usize,
        x: &[f32],
        t: usize,
        y: &mut [f32],
        z: Option<&[f32]>,
    ) {
        let n = self.block_len * self.cols;
        let range = s * n..(s + 1) * n;
        match &self.values {
            ShardValues::F32(v) => matmul(&v[range], self.block_len, self.cols, x, t, y),
            ShardValues::F16(v) => matmul(&v[range], self.block_len, self.cols, x, t, y),
            ShardValues::Q8(v) => {
                let nb = crate::compute::q8::blocks_per_row(self.cols);
                let rows = s * self.block_len..(s + 1) * self.block_len;
                let w = crate::compute::q8::Q8Matrix {
                    q: v.q.view().slice(range),
                    scales: &v.scales[rows.start * nb..rows.end * nb],
                    rows: self.block_len,
                    cols: self.cols,
                };
                let (rank, l) = (adapter_rank(self.cols), self.block_len);
                match (z, self.adapter_block(s)) {
                    (Some(z), Some(a)) if z.len() == t * rank => {
                        matmul_q8_then(w, x, t, y, &AddRows { a, l, z, rank })
                    }
                    _ => matmul_q8(w, x, t, y),
                }
            }
            ShardValues::Q4(v) => {
                let (rank, l) = (adapter_rank(self.cols), self.block_len);
                let done = match (z, self.adapter_block(s)) {
                    (Some(z), Some(a)) if z.len() == t * rank => {
                        let add = AddRows { a, l, z, rank };
                        v.matmul(self.cols, s * l, l, x, t, y, &add)
                    }
                    _ => v.matmul(self.cols, s * l, l, x, t, y, &NoRowWork),
                };
                // The set's shapes were checked when it was made or received; a product that
                // still does not fit answers NaN, which every check refuses.
                if let Err(e) = done {
                    tracing::error!("a 4-bit product: {e}");
                    y.fill(f32::NAN);
                }
            }
        }
    }

    /// `y (t × cols) += u (t × L) · S_s` for sub-block `s`: the transpose product.
    pub fn matmul_t_sub_block(&self, s: usize, u: &[f32], t: usize, y: &mut [f32]) {
        let (l, cols) = (self.block_len, self.cols);
        let mut buf = Vec::new();
        for r in 0..l {
            let start = (s * l + r) * cols;
            let row: std::borrow::Cow<'_, [f32]> = match &self.values {
                ShardValues::F32(v) => std::borrow::Cow::Borrowed(&v[start..start + cols]),
                ShardValues::F16(v) => {
                    buf.clear();
                    buf.extend(v[start..start + cols].iter().map(|h| h.to_f32()));
                    std::borrow::Cow::Borrowed(buf.as_slice())
                }
                ShardValues::Q8(v) => {
                    buf.resize(cols, 0.0);
                    crate::compute::q8::dequantize_row(
                        v.q.view(),
                        &v.scales,
                        cols,
                        s * l + r,
                        &mut buf,
                    );
                    std::borrow::Cow::Borrowed(buf.as_slice())
                }
                ShardValues::Q4(v) => {
                    buf = v
                        .rows_f32(cols, s * l + r, 1)
                        .unwrap_or_else(|_| vec![0.0; cols]);
                    std::borrow::Cow::Borrowed(buf.as_slice())
                }
            };
            for tok in 0..t {
                let a = u[tok * l + r];
                if a != 0.0 {
                    for (o, &w) in y[tok * cols..(tok + 1) * cols].iter_mut().zip(row.iter()) {
                        *o += a * w;
                    }
                }
            }
        }
    }

    /// Appends row `r` of sub-block `s` as f32 to `out`.
    pub fn push_row(&self, s: usize, r: usize, out: &mut Vec<f32>) {
        let start = (s * self.block_len + r) * self.cols;
        match &self.values {
            ShardValues::F32(v) => out.extend_from_slice(&v[start..start + self.cols]),
            ShardValues::F16(v) => {
                out.extend(v[start..start + self.cols].iter().map(|h| h.to_f32()))
            }
            ShardValues::Q8(v) => out.extend(v.rows_f32(self.cols, s * self.block_len + r, 1)),
            // The set's shapes were checked when it was made or received.
            ShardValues::Q4(v) => {
                out.extend((v.rows_f32(self.cols, s * self.block_len + r, 1)).unwrap_or_default())
            }
        }
    }

    /// The values as f32 (a copy for f16 and compact storage).
    pub fn values_f32(&self) -> std::borrow::Cow<'_, [f32]> {
        match &self.values {
            ShardValues::F32(v) => std::borrow::Cow::Borrowed(v),
            ShardValues::F16(v) => std::borrow::Cow::Owned(v.iter().map(|h| h.to_f32()).collect()),
            ShardValues::Q8(v) => {
                std::borrow::Cow::Owned(v.rows_f32(self.cols, 0, v.q.len() / self.cols.max(1)))
            }
            ShardValues::Q4(v) => std::borrow::Cow::Owned(
                (v.rows_f32(self.cols, 0, v.len() / self.cols.max(1))).unwrap_or_default(),
            ),
        }
    }

    /// Combines the same matrix's shards of other nodes with `m × k·m` coefficients; a compact
    /// target stores two bytes a value when `wide` (a parity row).
    fn combine(
        sources: &[&Shard],
        coeffs: &[f64],
        m: usize,
        format: ShardFormat,
        wide: bool,
    ) -> Result<Self, CodedError> {
        let first = sources
            .first()
            .ok_or_else(|| CodedError::BadRequest("no source shards".into()))?;
        if sources
            .iter()
            .any(|s| s.out != first.out || s.block_len != first.block_len || s.cols != first.cols)
        {
            return Err(CodedError::BadRequest(
                "source shards disagree on shape".into(),
            ));
        }
        let n = first.block_len * first.cols;
        let km = sources.len() * m;
        if format == ShardFormat::Q8 {
            return Self::combine_q8(sources, coeffs, first, wide);
        }
        let values: Vec<std::borrow::Cow<'_, [f32]>> =
            sources.iter().map(|s| s.values_f32()).collect();
        if values.iter().any(|v| v.len() != m * n) {
            return Err(CodedError::BadRequest(
                "source shard has the wrong length".into(),
            ));
        }
        let mut data = vec![0.0f32; m * n];
        let mut acc = vec![0.0f64; n];
        for (s, dst) in data.chunks_exact_mut(n.max(1)).enumerate().take(m) {
            acc.iter_mut().for_each(|a| *a = 0.0);
            for (c, &g) in coeffs[s * km..(s + 1) * km].iter().enumerate() {
                let (i, sub) = (c / m, c % m);
                for (a, &v) in acc.iter_mut().zip(&values[i][sub * n..(sub + 1) * n]) {
                    *a += g * v as f64;
                }
            }
            for (d, &a) in dst.iter_mut().zip(&acc) {
                *d = a as f32;
            }
        }
        Ok(Self {
            out: first.out,
            block_len: first.block_len,
            cols: first.cols,
            values: ShardValues::from_f32(data, format)?,
            carry: Vec::new(),
            adapter: Adapter::default(),
        })
    }

    /// [`Shard::combine`] for compact shards: the coded integers of the target row are the
    /// rational combination of the sources' integers, rounded to the integer it must be, so a
    /// rebuilt row is bit for bit the row encoding gives; the scales are the sources' own.
    fn combine_q8(
        sources: &[&Shard],
        coeffs: &[f64],
        first: &Shard,
        wide: bool,
    ) -> Result<Self, CodedError> {
        let values: Vec<&Q8Values> = sources
            .iter()
            .map(|s| match &s.values {
                ShardValues::Q8(v) => Ok(v),
                _ => Err(CodedError::BadRequest(
                    "a compact row needs compact sources".into(),
                )),
            })
            .collect::<Result<_, _>>()?;
        let len = first.block_len * first.cols;
        for v in &values {
            v.matrix(first.cols)?;
            if v.q.len() != len || v.scales != values[0].scales {
                return Err(CodedError::BadRequest(
                    "compact sources disagree on their values or scales".into(),
                ));
            }
        }
        let mut q = vec![0i32; len];
        for (i, dst) in q.iter_mut().enumerate() {
            let sum: f64 = coeffs
                .iter()
                .zip(&values)
                .map(|(&c, v)| c * f64::from(v.q.get(i)))
                .sum();
            let z = sum.round();
            if (sum - z).abs() > 1e-3 || z.abs() > f64::from(i16::MAX) {
                return Err(CodedError::BadRequest(format!(
                    "the sources' combination is {sum}, not a coded integer: they are not one codeword"
                )));
            }
            *dst = z as i32;
        }
        // The adapters are f32, combined as f32 shards are (a source that never learnt holds
        // zeros).
        let mut adapter = Adapter::default();
        if sources.iter().any(|s| !s.adapter.is_empty()) {
            let len = first.adapter_len();
            let mut acc = vec![0.0f64; len];
            for (&c, s) in coeffs.iter().zip(sources) {
                if s.adapter.is_empty() {
                    continue;
                }
                if s.adapter.a.len() != len {
                    return Err(CodedError::BadRequest(
                        "a source's adapter has the wrong length".into(),
                    ));
                }
                acc.iter_mut()
                    .zip(&s.adapter.a)
                    .for_each(|(a, &v)| *a += c * f64::from(v));
            }
            adapter.a = acc.into_iter().map(|v| v as f32).collect();
        }
        Ok(Self {
            out: first.out,
            block_len: first.block_len,
            cols: first.cols,
            values: ShardValues::Q8(Q8Values::from_i32(q, values[0].scales.clone(), wide)?),
            carry: Vec::new(),
            adapter,
        })
    }

    /// Storage format of the values.
    pub fn format(&self) -> ShardFormat {
        match &self.values {
            ShardValues::F32(_) => ShardFormat::F32,
            ShardValues::F16(_) => ShardFormat::F16,
            ShardValues::Q8(_) => ShardFormat::Q8,
            ShardValues::Q4(_) => ShardFormat::Q4,
        }
    }

    /// Bytes of values (and adapter) held.
    pub fn bytes(&self) -> usize {
        (match &self.values {
            ShardValues::F32(v) => v.len() * 4,
            ShardValues::F16(v) => v.len() * 2,
            ShardValues::Q8(v) => v.q.bytes() + v.scales.len() * 2,
            ShardValues::Q4(v) => v.bytes(),
        }) + self.adapter.a.len() * 4
    }
}

/// Every shard one member holds, for one generator row (node index).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardSet {
    /// The model's shape.
    pub cfg: LlamaConfig,
    /// The generator the shards were encoded with.
    pub generator: Generator,
    /// The node index (generator row block) of these shards.
    pub node: usize,
    /// Per block: q, k, v, o, gate, up, down.
    pub blocks: Vec<Vec<Shard>>,
    /// The coded token embedding (also the LM head when tied).
    pub embed: Shard,
    /// The coded separate LM head, when not tied.
    pub lm_head: Option<Shard>,
}

impl ShardSet {
    /// Encodes node `node`'s shards of a whole model; `progress(done, total)` reports matrices.
    pub fn encode(
        w: &ModelWeights,
        g: &Generator,
        node: usize,
        format: ShardFormat,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self, CodedError> {
        let matrices = w.matrices();
        let total = matrices.len();
        let mut shards = matrices.iter().enumerate().map(|(i, m)| {
            let shard = Shard::encode(g, node, m, format);
            progress(i + 1, total);
            shard
        });
        Self::assemble(w, g, node, &mut shards)
    }

    /// Encodes rows `nodes`' shards of a whole model, each (row, matrix) pair on a kernel
    /// thread of its own (a large model's row one matrix after another takes minutes).
    pub fn encode_parallel(
        w: &ModelWeights,
        g: &Generator,
        nodes: &[usize],
        format: ShardFormat,
    ) -> Result<Vec<Self>, CodedError> {
        let matrices = w.matrices();
        let jobs: Vec<(usize, &Matrix)> = nodes
            .iter()
            .flat_map(|&n| matrices.iter().map(move |&m| (n, m)))
            .collect();
        let shards = crate::compute::par::map(&jobs, |&(n, m)| Shard::encode(g, n, m, format));
        let mut shards = shards.into_iter();
        nodes
            .iter()
            .map(|&node| Self::assemble(w, g, node, &mut shards))
            .collect()
    }

    /// Node `node`'s shard set from its shards in [`ModelWeights::matrices`]' order.
    fn assemble(
        w: &ModelWeights,
        g: &Generator,
        node: usize,
        shards: &mut dyn Iterator<Item = Result<Shard, CodedError>>,
    ) -> Result<Self, CodedError> {
        let mut next = || {
            shards
                .next()
                .unwrap_or_else(|| Err(CodedError::BadRequest("a shard missing".into())))
        };
        let blocks = (0..w.layers.len())
            .map(|_| (0..7).map(|_| next()).collect::<Result<Vec<_>, _>>())
            .collect::<Result<Vec<_>, _>>()?;
        let embed = next()?;
        let lm_head = w.lm_head.as_ref().map(|_| next()).transpose()?;
        Ok(Self {
            cfg: w.cfg.clone(),
            generator: g.clone(),
            node,
            blocks,
            embed,
            lm_head,
        })
    }

    /// The shards a stage multiplies, in the stage's order.
    pub fn stage_shards(&self, stage: Stage) -> Result<Vec<&Shard>, CodedError> {
        stage_items(
            &self.blocks,
            self.lm_head.as_ref().unwrap_or(&self.embed),
            stage,
        )
    }

    /// Builds node `target`'s shards from k other nodes' shards of the same model and code,
    /// without the uncoded weights: `S_target = G_target · G_K⁻¹ · S_K`.
    pub fn reencode(target: usize, sources: &[&ShardSet]) -> Result<Self, CodedError> {
        let first = sources
            .first()
            .ok_or_else(|| CodedError::BadRequest("no source shard sets".into()))?;
        if sources.iter().any(|s| {
            s.generator != first.generator
                || s.cfg != first.cfg
                || s.blocks.len() != first.blocks.len()
        }) {
            return Err(CodedError::BadRequest(
                "source shard sets come from different codes or models".into(),
            ));
        }
        let g = &first.generator;
        let nodes: Vec<usize> = sources.iter().map(|s| s.node).collect();
        let coeffs = g.reencode_coeffs(target, &nodes)?;
        let m = g.sub_blocks();
        let format = first.embed.format();
        let wide = wide_row(g, target);
        let pick = |f: &dyn Fn(&ShardSet) -> Option<&Shard>| -> Result<Option<Shard>, CodedError> {
            let parts: Option<Vec<&Shard>> = sources.iter().map(|s| f(s)).collect();
            parts
                .map(|p| Shard::combine(&p, &coeffs, m, format, wide))
                .transpose()
        };
        let mut blocks = Vec::with_capacity(first.blocks.len());
        for (l, block) in first.blocks.iter().enumerate() {
            let mut shards = Vec::with_capacity(block.len());
            for i in 0..block.len() {
                let shard = pick(&|s: &ShardSet| s.blocks[l].get(i))?
                    .ok_or_else(|| CodedError::BadRequest(format!("block {l} lacks matrix {i}")))?;
                shards.push(shard);
            }
            blocks.push(shards);
        }
        let embed = pick(&|s: &ShardSet| Some(&s.embed))?
            .ok_or_else(|| CodedError::BadRequest("no embedding shard".into()))?;
        let lm_head = match first.lm_head {
            Some(_) => Some(
                pick(&|s: &ShardSet| s.lm_head.as_ref())?
                    .ok_or_else(|| CodedError::BadRequest("a source lacks the LM head".into()))?,
            ),
            None => None,
        };
        Ok(Self {
            cfg: first.cfg.clone(),
            generator: g.clone(),
            node: target,
            blocks,
            embed,
            lm_head,
        })
    }

    /// Checks that every shard has the shape the model and code give it, and every compact
    /// shard its scales (a set read from a blob or the network is untrusted).
    pub fn check_shapes(&self) -> Result<(), CodedError> {
        let shapes = shapes(&self.cfg, &self.generator);
        let layered = self.blocks.len() * 7;
        let count = layered + 1 + usize::from(self.lm_head.is_some());
        if self.blocks.len() != self.cfg.layers
            || self.blocks.iter().any(|b| b.len() != 7)
            || count != shapes.len()
        {
            return Err(CodedError::BadRequest(
                "the shard set does not have the model's matrices".into(),
            ));
        }
        let m = self.generator.sub_blocks();
        for (i, (shard, want)) in self.matrices().zip(&shapes).enumerate() {
            let len = m * want.block_len * want.cols;
            if shard.out != want.out
                || shard.block_len != want.block_len
                || shard.cols != want.cols
                || shard.values.len() != len
            {
                return Err(CodedError::BadRequest(format!(
                    "matrix {i} of the shard set has the wrong shape"
                )));
            }
            if !shard.format().stores_like(self.embed.format()) {
                return Err(CodedError::BadRequest(format!(
                    "matrix {i} of the shard set is stored in another format"
                )));
            }
            match &shard.values {
                ShardValues::Q8(v) => drop(v.matrix(shard.cols)?),
                ShardValues::Q4(v) => drop(v.matrix(shard.cols, 0, len / shard.cols.max(1))?),
                _ => {}
            }
            let a = &shard.adapter.a;
            if !a.is_empty() {
                // The shard's shape is the model's (checked above).
                if !shard.format().compact() || a.len() != shard.adapter_len() {
                    return Err(CodedError::BadRequest(format!(
                        "matrix {i} of the shard set has an adapter of the wrong shape"
                    )));
                }
                if a.iter().any(|v| !v.is_finite()) {
                    return Err(CodedError::BadRequest(format!(
                        "matrix {i} of the shard set has a non-finite adapter value"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Bytes of shard data held.
    pub fn bytes(&self) -> usize {
        self.matrices().map(Shard::bytes).sum()
    }

    /// Every matrix's shard: the blocks' in order, then the embedding's and the LM head's.
    pub fn matrices(&self) -> impl Iterator<Item = &Shard> {
        self.blocks
            .iter()
            .flatten()
            .chain([&self.embed])
            .chain(self.lm_head.as_ref())
    }

    /// Multiplies every stored value by `factor` (a corrupted shard, for fault injection).
    pub fn scale_values(&mut self, factor: f32) {
        for shard in self
            .blocks
            .iter_mut()
            .flatten()
            .chain([&mut self.embed])
            .chain(self.lm_head.as_mut())
        {
            match &mut shard.values {
                ShardValues::F32(v) => v.iter_mut().for_each(|x| *x *= factor),
                ShardValues::F16(v) => v
                    .iter_mut()
                    .for_each(|x| *x = half::f16::from_f32(x.to_f32() * factor)),
                // The integers stay; the scales carry the fault (the shard's own copy from here).
                ShardValues::Q8(v) => std::sync::Arc::make_mut(&mut v.scales)
                    .iter_mut()
                    .for_each(|x| *x = half::f16::from_f32(x.to_f32() * factor)),
                ShardValues::Q4(v) => v.scale(factor),
            }
            shard.adapter.a.iter_mut().for_each(|x| *x *= factor);
        }
    }
}

/// The items of `stage` among per-block items (q, k, v, o, gate, up, down) and the LM head's.
pub(crate) fn stage_items<'a, T>(
    blocks: &'a [Vec<T>],
    lm_head: &'a T,
    stage: Stage,
) -> Result<Vec<&'a T>, CodedError> {
    match stage.layer() {
        Some(l) => {
            let block = blocks
                .get(l)
                .ok_or_else(|| CodedError::BadRequest(format!("block {l} does not exist")))?;
            stage
                .block_matrices()
                .iter()
                .map(|&i| {
                    block.get(i).ok_or_else(|| {
                        CodedError::BadRequest(format!("block {l} lacks matrix {i}"))
                    })
                })
                .collect()
        }
        None => Ok(vec![lm_head]),
    }
}

/// A stage's outputs (`t × out` per matrix) in the decoder's layout:
/// `[block j][matrix][token][local row]`, zero-padded.
pub(super) fn to_blocks(
    mats: &[Vec<f32>],
    shapes: &[(usize, usize)],
    g: &Generator,
    t: usize,
) -> Vec<f32> {
    let blocks = g.k() * g.sub_blocks();
    let lens: Vec<usize> = shapes.iter().map(|&(out, _)| g.block_len(out)).collect();
    let c: usize = lens.iter().map(|l| t * l).sum();
    let mut dst = vec![0.0f32; blocks * c];
    let mut offset = 0;
    for ((mat, &(out, _)), &l) in mats.iter().zip(shapes).zip(&lens) {
        for j in 0..blocks {
            let first = j * l;
            if first >= out {
                break;
            }
            let n = l.min(out - first);
            for tok in 0..t {
                let at = j * c + offset + tok * l;
                dst[at..at + n].copy_from_slice(&mat[tok * out + first..tok * out + first + n]);
            }
        }
        offset += t * l;
    }
    dst
}
