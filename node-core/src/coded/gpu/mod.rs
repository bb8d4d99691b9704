//! A member's shards resident on a GPU, answering the products of step requests there.

mod token;

pub use token::{GpuToken, GroupStage, TokenSpec};

use std::sync::Arc;

use super::{CodedError, CodedInts, Shard, ShardSet, ShardValues};
use crate::code::Decoder;
use crate::compute::gpu::{Gpu, GpuError, GpuMatrix, Placement, Weights};
use crate::compute::q8::Ints;
use crate::model::{Llama, ModelError, Stage};
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
        ShardValues::Q8(v) => gpu.upload(
            rows,
            s.cols,
            Weights::Q8 {
                q: v.q.view(),
                scales: &v.scales,
            },
        ),
        ShardValues::Q4(_) => Err(GpuError::Shape(
            "4-bit rows compute on the CPU so far (issue 81)".into(),
        )),
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

    /// The matrices a product of `stage` multiplies, as uploaded.
    pub fn stage_matrices(&self, stage: Stage) -> Result<Vec<&GpuMatrix>, CodedError> {
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
        let mats = self.stage_matrices(stage)?;
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

/// A coded group of k members and its leader on one GPU: each generated token is one
/// submission (every member's products, the decoding and the leader's operations) and one
/// readback of the logits. The embedding lookup is decoded on the CPU from the members'
/// embedding shards (one row each).
#[derive(Debug)]
pub struct GpuGroup {
    token: GpuToken,
    /// The members' embedding shards, in decoding order.
    embeds: Vec<Shard>,
    decoder: Decoder,
    m: usize,
    vocab: usize,
}

/// Every member's shards of one stage, members in order and matrices in order, in one matrix.
fn stack(gpu: &Gpu, members: &[&ShardSet], stage: Stage) -> Result<GroupStage, CodedError> {
    let mut f32s = Vec::new();
    let mut f16s = Vec::new();
    // Compact members: their integers as i8 while every row is a data row, widened to i16 (a
    // parity row's width) from the first parity row on, and their scales.
    let (mut narrow, mut wide, mut scales) = (Vec::new(), None::<Vec<i16>>, Vec::new());
    let mut rows = 0;
    let mut mats = Vec::new();
    let mut cols = None;
    for (i, set) in members.iter().enumerate() {
        let items = super::shards::stage_items(
            &set.blocks,
            set.lm_head.as_ref().unwrap_or(&set.embed),
            stage,
        )?;
        for s in items {
            if *cols.get_or_insert(s.cols) != s.cols {
                return Err(CodedError::BadRequest(format!(
                    "{stage:?}: matrices of different widths"
                )));
            }
            if i == 0 {
                mats.push((s.out, s.block_len));
            }
            if !s.adapter.is_empty() {
                return Err(CodedError::BadRequest(format!(
                    "{stage:?}: a whole-token GPU group does not apply learnt adapters"
                )));
            }
            rows += s.stored_rows();
            match &s.values {
                ShardValues::F32(v) => f32s.extend_from_slice(v),
                ShardValues::F16(v) => f16s.extend_from_slice(v),
                ShardValues::Q8(v) => {
                    scales.extend_from_slice(&v.scales);
                    match (&v.q, &mut wide) {
                        (CodedInts::I8(q), None) => narrow.extend_from_slice(q),
                        (CodedInts::I8(q), Some(w)) => w.extend(q.iter().map(|&v| i16::from(v))),
                        (CodedInts::I16(q), w) => w
                            .get_or_insert_with(|| narrow.drain(..).map(i16::from).collect())
                            .extend_from_slice(q),
                    }
                }
                ShardValues::Q4(_) => {
                    return Err(CodedError::BadRequest(format!(
                        "{stage:?}: 4-bit rows compute on the CPU so far (issue 81)"
                    )));
                }
            }
        }
    }
    let cols = cols.unwrap_or(0);
    let compact = !scales.is_empty();
    let matrix = match (f32s.is_empty(), f16s.is_empty(), compact) {
        (false, true, false) => gpu.upload(rows, cols, Weights::F32(&f32s))?,
        (true, false, false) => gpu.upload(rows, cols, Weights::F16(&f16s))?,
        (true, true, true) => {
            let q = match &wide {
                Some(w) => Ints::I16(w),
                None => Ints::I8(&narrow),
            };
            gpu.upload(rows, cols, Weights::Q8 { q, scales: &scales })?
        }
        _ => {
            return Err(CodedError::BadRequest(format!(
                "{stage:?}: members hold shards in different formats"
            )));
        }
    };
    Ok(GroupStage {
        stage,
        matrix,
        mats,
    })
}

impl GpuGroup {
    /// Uploads the shards of k members (any order; they decode sorted by row) and records a
    /// decode step for `llama` with a cache of `max_ctx` positions.
    pub fn new(
        gpu: Arc<Gpu>,
        llama: &Llama,
        members: &[&ShardSet],
        max_ctx: usize,
    ) -> Result<Self, CodedError> {
        let mut members = members.to_vec();
        members.sort_by_key(|s| s.node);
        let first = members
            .first()
            .ok_or_else(|| CodedError::BadRequest("a GPU group needs members".into()))?;
        let g = first.generator.clone();
        let rows: Vec<usize> = members.iter().map(|s| s.node).collect();
        let decoder = Decoder::new(&g, &rows)?;
        let cfg = llama.config();
        let stages = Stage::all(cfg)
            .into_iter()
            .map(|stage| stack(&gpu, &members, stage))
            .collect::<Result<Vec<_>, _>>()?;
        let spec = TokenSpec {
            cfg,
            norms: llama.norms(),
            inv_freq: llama.inv_freq(),
            coef: decoder.inverse(),
            m: g.sub_blocks(),
            stages,
            max_ctx,
        };
        let token = GpuToken::new(gpu, spec)?;
        Ok(Self {
            token,
            embeds: members.iter().map(|s| s.embed.clone()).collect(),
            decoder,
            m: g.sub_blocks(),
            vocab: cfg.vocab,
        })
    }

    /// Positions the GPU cache holds.
    pub fn max_ctx(&self) -> usize {
        self.token.max_ctx()
    }

    /// Dispatches one token takes.
    pub fn dispatches(&self) -> usize {
        self.token.dispatches()
    }

    /// The adapter it runs on.
    pub fn gpu_info(&self) -> &crate::compute::gpu::GpuInfo {
        self.token.gpu_info()
    }

    /// The token's embedding, decoded from one row of each member's embedding shard.
    pub fn embed(&self, token: u32) -> Result<Vec<f32>, CodedError> {
        if token as usize >= self.vocab {
            return Err(ModelError::TokenOutOfRange {
                id: token,
                vocab: self.vocab,
            }
            .into());
        }
        let first = self
            .embeds
            .first()
            .ok_or_else(|| CodedError::BadRequest("no members".into()))?;
        let (l, cols) = (first.block_len, first.cols);
        let (j, r) = (token as usize / l, token as usize % l);
        // Each member's answer to the lookup of local row r, decoded; block j is the token's.
        let answers: Vec<Vec<f32>> = self
            .embeds
            .iter()
            .map(|e| {
                let mut out = Vec::with_capacity(self.m * cols);
                (0..self.m).for_each(|s| e.push_row(s, r, &mut out));
                out
            })
            .collect();
        let refs: Vec<&[f32]> = answers.iter().map(Vec::as_slice).collect();
        let mut blocks = vec![0.0f32; self.embeds.len() * self.m * cols];
        self.decoder.decode(&refs, &mut blocks)?;
        Ok(blocks[j * cols..(j + 1) * cols].to_vec())
    }

    /// The logits after `token` at position `pos`; the cache must hold positions `0..pos` of
    /// the same sequence (run the prompt one token at a time from 0).
    pub async fn step_async(&self, token: u32, pos: usize) -> Result<Vec<f32>, CodedError> {
        let x = self.embed(token)?;
        Ok(self.token.step(&x, pos).await?)
    }

    /// [`Self::step_async`], waiting on this thread (native).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn step(&self, token: u32, pos: usize) -> Result<Vec<f32>, CodedError> {
        pollster::block_on(self.step_async(token, pos))
    }
}
