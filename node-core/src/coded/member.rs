//! A member: a stateless matmul server for its shards.

use std::sync::Arc;

use super::{CodedError, GpuShards, ShardSet};
use crate::compute::gpu::{Gpu, GpuInfo};
use crate::protocol::{StepRequest, StepResponse};

/// Ways a member can be made to answer wrongly on purpose (`codedmesh node --inject-fault`),
/// to test and demonstrate verification. Faults in the shard itself (scaled, stale) are made by
/// changing the shard; these act on the answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Misbehaviour {
    /// Answers with random values of the honest answer's magnitude.
    Garbage,
    /// Answers with the result of another row's shard, under its own row's name.
    WrongRow {
        /// The row it really computes with.
        actual: usize,
    },
    /// Answers forward products and embedding rows honestly and scales its transposed
    /// (backward) products by 1 + [`SKEW`]: caught only by checking backward rounds.
    BackwardOnly,
    /// Answers transposed (backward) products honestly and scales its forward products and
    /// embedding rows by 1 + [`SKEW`].
    ForwardOnly,
}

/// The relative size of the lie of [`Misbehaviour::BackwardOnly`] and
/// [`Misbehaviour::ForwardOnly`].
pub const SKEW: f32 = 1e-3;

/// Answers step requests from its shards.
#[derive(Debug, Clone)]
pub struct Member {
    shards: ShardSet,
    /// The row it answers as (its shards' own unless it lies).
    row: usize,
    /// How it lies, if it does.
    lie: Option<Misbehaviour>,
    /// The stream its garbage is drawn from (shared by clones).
    garbage: Arc<std::sync::atomic::AtomicU64>,
    /// The GPU it computes products on, if any.
    device: Option<Arc<Gpu>>,
    /// Its shards on that GPU; `None` while they are out of date (products run on the CPU).
    gpu: Option<Arc<GpuShards>>,
    /// Products reading fewer weight bytes × tokens than this stay on the CPU.
    gpu_min_work: usize,
}

/// The work (weight bytes × tokens) above which `--device auto` sends a product to the GPU.
/// A GPU call costs ~150 µs however small the product (an H200 through Vulkan, docs/perf.md),
/// in which a many-core CPU reads ~16 MB of weights; at 2 MiB SmolLM2's gate/up shards went
/// to the GPU and decoding slowed from 46 to 21 tok/s.
pub const AUTO_GPU_MIN_WORK: usize = 16 << 20;

impl Member {
    /// A member serving these shards.
    pub fn new(shards: ShardSet) -> Self {
        let row = shards.node;
        Self {
            shards,
            row,
            lie: None,
            garbage: Arc::default(),
            device: None,
            gpu: None,
            gpu_min_work: 0,
        }
    }

    /// Computes products of at least `min_work` weight bytes × tokens on `gpu` from now on
    /// (0: every product); uploads the shards, which stay resident.
    pub fn use_gpu(&mut self, gpu: Arc<Gpu>, min_work: usize) -> Result<(), CodedError> {
        self.gpu = Some(Arc::new(GpuShards::upload(gpu.clone(), &self.shards)?));
        self.device = Some(gpu);
        self.gpu_min_work = min_work;
        Ok(())
    }

    /// Uploads the shards again after [`Self::shards_mut`] changed them (a no-op on the CPU).
    pub fn sync_gpu(&mut self) -> Result<(), CodedError> {
        match (&self.device, &self.gpu) {
            (Some(gpu), None) => self.use_gpu(gpu.clone(), self.gpu_min_work),
            _ => Ok(()),
        }
    }

    /// The GPU shards, when `req` is a product large enough to send there.
    fn gpu_for(&self, req: &StepRequest) -> Option<&GpuShards> {
        let gpu = self.gpu.as_deref()?;
        if self.gpu_min_work == 0 {
            return Some(gpu);
        }
        let (stage, t) = req.product()?;
        let bytes: usize = self
            .shards
            .stage_shards(stage)
            .ok()?
            .iter()
            .map(|s| s.bytes())
            .sum();
        (bytes.saturating_mul(t) >= self.gpu_min_work).then_some(gpu)
    }

    /// Its shards on the GPU, when they are there and up to date.
    pub fn gpu_shards(&self) -> Option<&GpuShards> {
        self.gpu.as_deref()
    }

    /// The adapter products run on, when on a GPU.
    pub fn gpu_info(&self) -> Option<&GpuInfo> {
        self.device.as_deref().map(Gpu::info)
    }

    /// A member that misbehaves: for `WrongRow`, `shards` are row `actual`'s and it answers
    /// as `row`.
    pub fn misbehaving(shards: ShardSet, row: usize, how: Misbehaviour) -> Self {
        let mut m = Self::new(shards);
        m.row = row;
        m.lie = Some(how);
        m
    }

    /// The row it answers as.
    pub fn row(&self) -> usize {
        self.row
    }

    /// The shards it serves.
    pub fn shards(&self) -> &ShardSet {
        &self.shards
    }

    /// The shards, to apply a learning update; products run on the CPU until
    /// [`Self::sync_gpu`] uploads the changed shards.
    pub fn shards_mut(&mut self) -> &mut ShardSet {
        self.gpu = None;
        &mut self.shards
    }

    /// Runs `f` on the shards to apply learning updates. Compact shards learn only in their
    /// adapters, which products add on the CPU, so their GPU copy stays; other shards run on
    /// the CPU until [`Self::sync_gpu`].
    pub fn learn<R>(&mut self, f: impl FnOnce(&mut ShardSet) -> R) -> R {
        if self.shards.embed.format() != super::ShardFormat::Q8 {
            self.gpu = None;
        }
        f(&mut self.shards)
    }

    /// Answers one request; failures become a `Failed` answer, never a panic.
    pub fn handle(&self, req: &StepRequest) -> StepResponse {
        self.answer(req, self.compute(req))
    }

    /// [`Self::handle`] for callers that cannot block (the browser, on WebGPU).
    pub async fn handle_async(&self, req: &StepRequest) -> StepResponse {
        self.answer(req, self.compute_async(req).await)
    }

    /// Whether `req` is computed on the GPU.
    pub fn on_gpu(&self, req: &StepRequest) -> bool {
        self.gpu_for(req).is_some()
    }

    /// The answer to `req` carrying a computed result (altered if this member lies).
    fn answer(&self, req: &StepRequest, computed: Result<Vec<f32>, CodedError>) -> StepResponse {
        match computed {
            Ok(mut values) => {
                let backward = matches!(req, StepRequest::MatmulT { .. });
                match self.lie {
                    Some(Misbehaviour::Garbage) => scramble(&mut values, &self.garbage),
                    Some(Misbehaviour::BackwardOnly) if backward => {
                        values.iter_mut().for_each(|v| *v *= 1.0 + SKEW);
                    }
                    Some(Misbehaviour::ForwardOnly) if !backward => {
                        values.iter_mut().for_each(|v| *v *= 1.0 + SKEW);
                    }
                    _ => {}
                }
                StepResponse::Partial {
                    node: self.row as u32,
                    values,
                }
            }
            Err(e) => StepResponse::Failed {
                reason: e.to_string(),
            },
        }
    }

    /// Answers one encoded request; undecodable bytes become a `Failed` answer.
    pub fn handle_bytes(&self, request: &[u8]) -> StepResponse {
        match crate::protocol::decode::<StepRequest>(request) {
            Ok(req) => self.handle(&req),
            Err(e) => StepResponse::Failed {
                reason: e.to_string(),
            },
        }
    }

    /// The partial result of a request, laid out sub-block major (in the browser, products
    /// reach the GPU only through [`Self::compute_async`]).
    pub fn compute(&self, req: &StepRequest) -> Result<Vec<f32>, CodedError> {
        #[cfg(not(target_arch = "wasm32"))]
        return pollster::block_on(self.compute_async(req));
        #[cfg(target_arch = "wasm32")]
        self.compute_cpu(req)
    }

    /// [`Self::compute`] for callers that cannot block (the browser).
    pub async fn compute_async(&self, req: &StepRequest) -> Result<Vec<f32>, CodedError> {
        self.answer_fits(req)?;
        if let Some(gpu) = self.gpu_for(req) {
            let m = self.shards.generator.sub_blocks();
            if let Some(answer) = gpu.compute(m, req).await {
                return self.with_adapters(req, answer?);
            }
        }
        self.compute_cpu(req)
    }

    /// Adds what the shards' adapters learnt to a product's answer `out` (compact shards that
    /// learn; docs/coding.md).
    fn with_adapters(&self, req: &StepRequest, mut out: Vec<f32>) -> Result<Vec<f32>, CodedError> {
        let m = self.shards.generator.sub_blocks();
        let shards = match req {
            StepRequest::EmbedRows { .. } => vec![&self.shards.embed],
            StepRequest::Matmul { stage, .. } | StepRequest::MatmulT { stage, .. } => {
                self.shards.stage_shards(*stage)?
            }
        };
        super::adapter::add_products(&shards, m, req, &mut out)?;
        Ok(out)
    }

    /// Runs one product of every kind of stage, for one token and for a prompt's `t`, so the
    /// GPU compiles its kernels before the first request waits on them (a browser's WebGPU
    /// compiles on first use, for seconds).
    pub async fn warm_up(&self, t: u32) -> Result<(), CodedError> {
        use crate::model::Stage;
        let stages = [
            Stage::Qkv(0),
            Stage::AttnOut(0),
            Stage::GateUp(0),
            Stage::Down(0),
            Stage::LmHead,
        ];
        for stage in stages {
            let cols = self
                .shards
                .stage_shards(stage)?
                .first()
                .map_or(0, |s| s.cols);
            for t in [1, t.max(1)] {
                let x = vec![0.5f32; t as usize * cols];
                self.compute_async(&StepRequest::Matmul { stage, t, x })
                    .await?;
            }
        }
        Ok(())
    }

    /// Refuses a request whose answer could not travel back in one message (what a peer asks
    /// decides what this member allocates and computes: a count is bounded before it costs).
    fn answer_fits(&self, req: &StepRequest) -> Result<(), CodedError> {
        let m = self.shards.generator.sub_blocks();
        let values = match req {
            StepRequest::Matmul { stage, t, .. } => {
                let shards = self.shards.stage_shards(*stage)?;
                (*t as usize).saturating_mul(m * shards.iter().map(|s| s.block_len).sum::<usize>())
            }
            // Its answer is as large as its input, which fits a message.
            StepRequest::MatmulT { .. } => 0,
            StepRequest::EmbedRows { rows } => {
                rows.len().saturating_mul(m * self.shards.embed.cols)
            }
        };
        let most = crate::protocol::MAX_MESSAGE_BYTES / 4;
        if values > most {
            return Err(CodedError::BadRequest(format!(
                "an answer of {values} values, over the {most} one message carries"
            )));
        }
        Ok(())
    }

    /// The CPU reference of [`Self::compute`].
    pub fn compute_cpu(&self, req: &StepRequest) -> Result<Vec<f32>, CodedError> {
        self.answer_fits(req)?;
        let out = self.products_cpu(req)?;
        match req {
            StepRequest::Matmul { .. } => Ok(out),
            _ => self.with_adapters(req, out),
        }
    }

    /// [`Self::compute_cpu`], with the adapters of a product (not yet of the other requests).
    fn products_cpu(&self, req: &StepRequest) -> Result<Vec<f32>, CodedError> {
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
                let z = super::adapter::inputs_down(&shards, x, t);
                for s in 0..m {
                    let Some(sub) = chunks.next() else { break };
                    let mut offset = 0;
                    for shard in &shards {
                        let len = t * shard.block_len;
                        let y = &mut sub[offset..offset + len];
                        shard.matmul_sub_block(s, x, t, y, z.as_deref());
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

/// Replaces values by pseudo-random ones of the same largest magnitude (SplitMix64 stream).
fn scramble(values: &mut [f32], counter: &std::sync::atomic::AtomicU64) {
    let scale = values.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-3);
    let mut state = counter.fetch_add(0x9E37_79B9_7F4A_7C15, std::sync::atomic::Ordering::Relaxed);
    for v in values.iter_mut() {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        let unit = (z >> 11) as f64 / (1u64 << 53) as f64;
        *v = scale * (2.0 * unit as f32 - 1.0);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

    use super::*;
    use crate::code::Generator;
    use crate::coded::{InProcess, ShardFormat};
    use crate::model::{LlamaConfig, ModelWeights, Stage};

    #[test]
    fn a_request_whose_answer_cannot_travel_is_refused_before_it_costs() {
        let cfg = LlamaConfig::small();
        let w = ModelWeights::synthetic(cfg.clone(), 1).unwrap();
        let mesh = InProcess::encode(
            &w,
            &Generator::cauchy(3, 2).unwrap(),
            ShardFormat::F32,
            &|_, _| {},
        )
        .unwrap();
        let member = &mesh.members()[0];
        // Tens of millions of embedding rows, each a valid row: refused, nothing allocated.
        let rows = vec![0u32; 50_000_000];
        let err = member
            .compute(&StepRequest::EmbedRows { rows })
            .unwrap_err();
        assert!(err.to_string().contains("one message carries"), "{err}");
        // A product claiming more rows than any answer carries.
        let err = member
            .compute(&StepRequest::Matmul {
                stage: Stage::LmHead,
                t: u32::MAX,
                x: vec![0.0; cfg.hidden],
            })
            .unwrap_err();
        assert!(err.to_string().contains("one message carries"), "{err}");
        // An honest one is answered.
        let ok = member.compute(&StepRequest::EmbedRows { rows: vec![0, 1] });
        assert!(ok.is_ok(), "{ok:?}");
    }
}
