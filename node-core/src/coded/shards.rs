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
        let values = match format {
            ShardFormat::F32 => ShardValues::F32(data),
            ShardFormat::F16 => {
                ShardValues::F16(data.iter().map(|&v| half::f16::from_f32(v)).collect())
            }
        };
        Ok(Self {
            out: m.rows,
            block_len: g.block_len(m.rows),
            cols: m.cols,
            values,
        })
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
        match stage.layer() {
            Some(l) => {
                let block = self
                    .blocks
                    .get(l)
                    .ok_or_else(|| CodedError::BadRequest(format!("block {l} does not exist")))?;
                Ok(stage.block_matrices().iter().map(|&i| &block[i]).collect())
            }
            None => Ok(vec![self.lm_head.as_ref().unwrap_or(&self.embed)]),
        }
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
}
