//! A member's coded storage: one shard of every linear matrix of the model.

use serde::{Deserialize, Serialize};

use super::CodedError;
use crate::code::Generator;
use crate::compute::matmul;
use crate::model::{LlamaConfig, Matrix, ModelWeights, Stage};

/// How shard values are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum ShardFormat {
    /// 32-bit floats: the decode error of the code alone (docs/coding.md).
    #[default]
    F32,
    /// 16-bit floats: half the bytes to read, more rounding error (docs/perf.md).
    F16,
}

impl std::str::FromStr for ShardFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "f32" => Ok(Self::F32),
            "f16" => Ok(Self::F16),
            other => Err(format!("unknown shard format {other:?} (f32 or f16)")),
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
}

impl ShardValues {
    /// f32 values stored in `format` (rounded to f16 for [`ShardFormat::F16`]).
    pub fn from_f32(data: Vec<f32>, format: ShardFormat) -> Self {
        match format {
            ShardFormat::F32 => Self::F32(data),
            ShardFormat::F16 => Self::F16(data.iter().map(|&v| half::f16::from_f32(v)).collect()),
        }
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
}

impl Shard {
    /// Encodes node `node`'s shard of a matrix, stored in `format`.
    pub fn encode(
        g: &Generator,
        node: usize,
        m: &Matrix,
        format: ShardFormat,
    ) -> Result<Self, CodedError> {
        let data = g.encode_shard(node, &m.data, m.rows, m.cols)?;
        Ok(Self {
            out: m.rows,
            block_len: g.block_len(m.rows),
            cols: m.cols,
            values: ShardValues::from_f32(data, format),
            carry: Vec::new(),
        })
    }

    /// Rows stored: every sub-block's `L` rows.
    pub fn stored_rows(&self) -> usize {
        let len = match &self.values {
            ShardValues::F32(v) => v.len(),
            ShardValues::F16(v) => v.len(),
        };
        len / self.cols.max(1)
    }

    /// `y (t × L) = x (t × cols) · S_sᵀ` for sub-block `s` (rows `[s·L, (s+1)·L)`).
    pub fn matmul_sub_block(&self, s: usize, x: &[f32], t: usize, y: &mut [f32]) {
        let n = self.block_len * self.cols;
        let range = s * n..(s + 1) * n;
        match &self.values {
            ShardValues::F32(v) => matmul(&v[range], self.block_len, self.cols, x, t, y),
            ShardValues::F16(v) => matmul(&v[range], self.block_len, self.cols, x, t, y),
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
        }
    }

    /// The values as f32 (a copy for f16 storage).
    fn values_f32(&self) -> std::borrow::Cow<'_, [f32]> {
        match &self.values {
            ShardValues::F32(v) => std::borrow::Cow::Borrowed(v),
            ShardValues::F16(v) => std::borrow::Cow::Owned(v.iter().map(|h| h.to_f32()).collect()),
        }
    }

    /// Combines the same matrix's shards of other nodes with `m × k·m` coefficients.
    fn combine(
        sources: &[&Shard],
        coeffs: &[f64],
        m: usize,
        format: ShardFormat,
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
            values: ShardValues::from_f32(data, format),
            carry: Vec::new(),
        })
    }

    /// Storage format of the values.
    pub fn format(&self) -> ShardFormat {
        match &self.values {
            ShardValues::F32(_) => ShardFormat::F32,
            ShardValues::F16(_) => ShardFormat::F16,
        }
    }

    /// Bytes of values held.
    pub fn bytes(&self) -> usize {
        match &self.values {
            ShardValues::F32(v) => v.len() * 4,
            ShardValues::F16(v) => v.len() * 2,
        }
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
        let total = w.layers.len() * 7 + 1 + usize::from(w.lm_head.is_some());
        let mut done = 0;
        let mut step = |done: &mut usize| {
            *done += 1;
            progress(*done, total);
        };
        let mut blocks = Vec::with_capacity(w.layers.len());
        for l in &w.layers {
            let mut shards = Vec::with_capacity(7);
            for m in [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down] {
                shards.push(Shard::encode(g, node, m, format)?);
                step(&mut done);
            }
            blocks.push(shards);
        }
        let embed = Shard::encode(g, node, &w.embed, format)?;
        step(&mut done);
        let lm_head = match &w.lm_head {
            Some(m) => {
                let s = Shard::encode(g, node, m, format)?;
                step(&mut done);
                Some(s)
            }
            None => None,
        };
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
        let pick = |f: &dyn Fn(&ShardSet) -> Option<&Shard>| -> Result<Option<Shard>, CodedError> {
            let parts: Option<Vec<&Shard>> = sources.iter().map(|s| f(s)).collect();
            parts
                .map(|p| Shard::combine(&p, &coeffs, m, format))
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

    /// Bytes of shard data held.
    pub fn bytes(&self) -> usize {
        self.blocks
            .iter()
            .flatten()
            .map(Shard::bytes)
            .sum::<usize>()
            + self.embed.bytes()
            + self.lm_head.as_ref().map_or(0, Shard::bytes)
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
            }
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
