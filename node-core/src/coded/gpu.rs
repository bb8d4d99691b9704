//! A member's shards resident on a GPU, answering the products of step requests there.

use std::sync::Arc;

use super::{CodedError, Shard, ShardSet, ShardValues};
use crate::compute::gpu::{Gpu, GpuError, GpuMatrix, Placement, Weights};
use crate::model::Stage;
use crate::protocol::StepRequest;

/// Every product matrix of a [`ShardSet`], uploaded once.
#[derive(Debug)]
pub struct GpuShards {
    gpu: Arc<Gpu>,
    /// Per block: q, k, v, o, gate, up, down.
    blocks: Vec<Vec<GpuMatrix>>,
    /// The LM head: the separate one, or the tied embedding.
    lm_head: GpuMatrix,
}

fn upload(gpu: &Gpu, s: &Shard) -> Result<GpuMatrix, GpuError> {
    let rows = s.stored_rows();
    match &s.values {
        ShardValues::F32(v) => gpu.upload(rows, s.cols, Weights::F32(v)),
        ShardValues::F16(v) => gpu.upload(rows, s.cols, Weights::F16(v)),
    }
}

impl GpuShards {
    /// Uploads `shards` to `gpu`.
    pub fn upload(gpu: Arc<Gpu>, shards: &ShardSet) -> Result<Self, CodedError> {
        let blocks = shards
            .blocks
            .iter()
            .map(|b| b.iter().map(|s| upload(&gpu, s)).collect())
            .collect::<Result<Vec<Vec<_>>, _>>()?;
        let lm_head = upload(&gpu, shards.lm_head.as_ref().unwrap_or(&shards.embed))?;
        Ok(Self {
            gpu,
            blocks,
            lm_head,
        })
    }

    fn stage(&self, stage: Stage) -> Result<Vec<&GpuMatrix>, CodedError> {
        super::shards::stage_items(&self.blocks, &self.lm_head, stage)
    }

    /// Answers a product request (`Matmul`, `MatmulT`) as [`super::Member::compute`] does on
    /// the CPU; `None` for requests that are not products.
    pub async fn compute(
        &self,
        m: usize,
        req: &StepRequest,
    ) -> Option<Result<Vec<f32>, CodedError>> {
        let (stage, t) = req.product()?;
        Some(self.product(m, stage, t, req).await)
    }

    async fn product(
        &self,
        m: usize,
        stage: Stage,
        t: usize,
        req: &StepRequest,
    ) -> Result<Vec<f32>, CodedError> {
        let mats = self.stage(stage)?;
        let block_len = |g: &GpuMatrix| g.rows() / m.max(1);
        let per_sub: usize = mats.iter().map(|g| t * block_len(g)).sum();
        let mut off = 0;
        let parts: Vec<(&GpuMatrix, Placement)> = mats
            .iter()
            .map(|g| {
                let p = Placement {
                    block_len: block_len(g),
                    per_sub,
                    off,
                };
                off += t * block_len(g);
                (*g, p)
            })
            .collect();
        if let StepRequest::MatmulT { u, .. } = req {
            if u.len() != m * per_sub {
                return Err(CodedError::BadRequest(format!(
                    "{stage:?}: {} transpose inputs, expected {} for t = {t}",
                    u.len(),
                    m * per_sub
                )));
            }
            return Ok(self.gpu.matmul_t(&parts, u, t).await?);
        }
        let StepRequest::Matmul { x, .. } = req else {
            return Err(CodedError::BadRequest(
                "an embedding lookup is not a product".into(),
            ));
        };
        Ok(self.gpu.matmul(&parts, x, t, m * per_sub).await?)
    }
}
