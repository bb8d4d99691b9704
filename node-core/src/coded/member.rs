//! A member: a stateless matmul server for its shards.

use super::{CodedError, ShardSet};
use crate::protocol::{StepRequest, StepResponse};

/// Answers step requests from its shards.
#[derive(Debug, Clone)]
pub struct Member {
    shards: ShardSet,
}

impl Member {
    /// A member serving these shards.
    pub fn new(shards: ShardSet) -> Self {
        Self { shards }
    }

    /// The shards it serves.
    pub fn shards(&self) -> &ShardSet {
        &self.shards
    }

    /// The shards, to apply a learning update.
    pub fn shards_mut(&mut self) -> &mut ShardSet {
        &mut self.shards
    }

    /// Answers one request; failures become a `Failed` answer, never a panic.
    pub fn handle(&self, req: &StepRequest) -> StepResponse {
        match self.compute(req) {
            Ok(values) => StepResponse::Partial {
                node: self.shards.node as u32,
                values,
            },
            Err(e) => StepResponse::Failed {
                reason: e.to_string(),
            },
        }
    }

    /// The partial result of a request, laid out sub-block major.
    pub fn compute(&self, req: &StepRequest) -> Result<Vec<f32>, CodedError> {
        let m = self.shards.generator.sub_blocks();
        match req {
            StepRequest::Matmul { stage, t, x } => {
                let t = *t as usize;
                let shards = self.shards.stage_shards(*stage)?;
                let cols = shards.first().map_or(0, |s| s.cols);
                if t == 0 || shards.iter().any(|s| s.cols != cols) || x.len() != t * cols {
                    return Err(CodedError::BadRequest(format!(
                        "{stage:?}: {} inputs is not t = {t} rows of {cols}",
                        x.len()
                    )));
                }
                let per_sub: usize = shards.iter().map(|s| t * s.block_len).sum();
                let mut out = vec![0.0f32; m * per_sub];
                let mut chunks = out.chunks_exact_mut(per_sub);
                for s in 0..m {
                    let Some(sub) = chunks.next() else { break };
                    let mut offset = 0;
                    for shard in &shards {
                        let len = t * shard.block_len;
                        shard.matmul_sub_block(s, x, t, &mut sub[offset..offset + len]);
                        offset += len;
                    }
                }
                Ok(out)
            }
            StepRequest::MatmulT { stage, t, u } => {
                let t = *t as usize;
                let shards = self.shards.stage_shards(*stage)?;
                let cols = shards.first().map_or(0, |s| s.cols);
                let per_sub: usize = shards.iter().map(|s| t * s.block_len).sum();
                if t == 0 || shards.iter().any(|s| s.cols != cols) || u.len() != m * per_sub {
                    return Err(CodedError::BadRequest(format!(
                        "{stage:?}: {} transpose inputs, expected {} for t = {t}",
                        u.len(),
                        m * per_sub
                    )));
                }
                let mut out = vec![0.0f32; t * cols];
                for (s, sub) in u.chunks_exact(per_sub).enumerate() {
                    let mut offset = 0;
                    for shard in &shards {
                        let len = t * shard.block_len;
                        shard.matmul_t_sub_block(s, &sub[offset..offset + len], t, &mut out);
                        offset += len;
                    }
                }
                Ok(out)
            }
            StepRequest::EmbedRows { rows } => {
                let e = &self.shards.embed;
                if let Some(&r) = rows.iter().find(|&&r| r as usize >= e.block_len) {
                    return Err(CodedError::BadRequest(format!(
                        "embedding row {r} outside a block of {}",
                        e.block_len
                    )));
                }
                let mut out = Vec::with_capacity(m * rows.len() * e.cols);
                for s in 0..m {
                    for &r in rows {
                        e.push_row(s, r as usize, &mut out);
                    }
                }
                Ok(out)
            }
        }
    }
}
