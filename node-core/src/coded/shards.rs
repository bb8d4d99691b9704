//! A member's coded storage: one shard of every linear matrix of the model.

use serde::{Deserialize, Serialize};

use super::CodedError;
use crate::code::Generator;
use crate::model::{LlamaConfig, Matrix, ModelWeights, Stage};

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
    pub data: Vec<f32>,
}

impl Shard {
    /// Encodes node `node`'s shard of a matrix.
    pub fn encode(g: &Generator, node: usize, m: &Matrix) -> Result<Self, CodedError> {
        let data = g.encode_shard(node, &m.data, m.rows, m.cols)?;
        Ok(Self {
            out: m.rows,
            block_len: g.block_len(m.rows),
            cols: m.cols,
            data,
        })
    }

    /// Rows `[s·L, (s+1)·L)`: sub-block `s` as a row-major slice.
    pub fn sub_block(&self, s: usize) -> &[f32] {
        let n = self.block_len * self.cols;
        &self.data[s * n..(s + 1) * n]
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
                shards.push(Shard::encode(g, node, m)?);
                step(&mut done);
            }
            blocks.push(shards);
        }
        let embed = Shard::encode(g, node, &w.embed)?;
        step(&mut done);
        let lm_head = match &w.lm_head {
            Some(m) => {
                let s = Shard::encode(g, node, m)?;
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
        let n = |s: &Shard| s.data.len() * 4;
        self.blocks.iter().flatten().map(n).sum::<usize>()
            + n(&self.embed)
            + self.lm_head.as_ref().map_or(0, n)
    }
}
