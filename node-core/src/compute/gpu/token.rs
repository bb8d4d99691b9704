//! A whole decoded token on the GPU: the k members' shard products of a coded group and the
//! leader's work between them (RMSNorm, decoding, RoPE and the KV cache, attention, SwiGLU,
//! the residual stream), recorded once and replayed per token as one submission with one
//! readback of the logits.

use std::sync::Arc;

use super::kernels::{ParamBlocks, bind, layout, part, pipeline, read_back};
use super::{Gpu, GpuError, GpuMatrix};
use crate::model::{LeaderWeights, LlamaConfig, Stage};

const RMS_NORM: &str = include_str!("kernels/rms_norm.wgsl");
const DECODE: &str = include_str!("kernels/decode.wgsl");
const ROPE_KV: &str = include_str!("kernels/rope_kv.wgsl");
const ATTENTION: &str = include_str!("kernels/attention.wgsl");
const SWIGLU: &str = include_str!("kernels/swiglu.wgsl");

/// Invocations of the flat kernels' workgroups (decode, RoPE, SwiGLU).
const FLAT: u32 = 256;
/// Invocations of the RoPE kernel's workgroups.
const ROPE_GROUP: u32 = 64;

/// One stage of a coded group: every member's shards of the stage's matrices, the members one
/// after another (in decoding order) and inside each the matrices one after another, as one
/// resident matrix, so one product computes every member's answer.
#[derive(Debug)]
pub struct GroupStage {
    /// The stage.
    pub stage: Stage,
    /// The members' shards, stacked.
    pub matrix: GpuMatrix,
    /// Per matrix of the stage: rows of the uncoded matrix, and of one sub-block (`L`).
    pub mats: Vec<(usize, usize)>,
}

/// What a token pipeline is built from.
#[derive(Debug)]
pub struct TokenSpec<'a> {
    /// The model's shape.
    pub cfg: &'a LlamaConfig,
    /// The norm gains.
    pub norms: &'a LeaderWeights,
    /// RoPE frequencies, one per pair of a head.
    pub inv_freq: &'a [f64],
    /// The `k·m × k·m` decoding coefficients of the group, row-major.
    pub coef: &'a [f64],
    /// Sub-blocks per member.
    pub m: usize,
    /// Every stage of the model, in [`Stage::all`] order.
    pub stages: Vec<GroupStage>,
    /// Positions the KV cache holds.
    pub max_ctx: usize,
}

/// One recorded dispatch: the pipeline, its bind group and its workgroups.
#[derive(Debug)]
struct Dispatch {
    pipeline: usize,
    group: wgpu::BindGroup,
    groups: (u32, u32),
}

/// A recorded decode step of a coded model, replayed per token.
#[derive(Debug)]
pub struct GpuToken {
    gpu: Arc<Gpu>,
    pipelines: Vec<wgpu::ComputePipeline>,
    dispatches: Vec<Dispatch>,
    x: wgpu::Buffer,
    step: wgpu::Buffer,
    logits: wgpu::Buffer,
    staging: wgpu::Buffer,
    hidden: usize,
    vocab: usize,
    max_ctx: usize,
    /// Kept resident for the recorded bind groups.
    _stages: Vec<GroupStage>,
    _buffers: Vec<wgpu::Buffer>,
}

/// Pipelines by index in `GpuToken::pipelines`.
const P_GEMV_F32: usize = 0;
const P_GEMV_F16: usize = 1;
const P_RMS_NORM: usize = 2;
const P_DECODE: usize = 3;
const P_ROPE_KV: usize = 4;
const P_ATTENTION: usize = 5;
const P_SWIGLU: usize = 6;

/// A binding of a whole buffer.
fn part_all(b: &wgpu::Buffer) -> wgpu::BindingResource<'_> {
    part(b, 0, None)
}

fn u32_of(v: usize, what: &str) -> Result<u32, GpuError> {
    u32::try_from(v).map_err(|_| GpuError::Shape(format!("{what} {v} is past 2³²")))
}

impl Gpu {
    fn storage(&self, label: &str, floats: usize) -> wgpu::Buffer {
        use wgpu::BufferUsages as U;
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: (4 * floats.max(4)).next_multiple_of(16) as u64,
            usage: U::STORAGE | U::COPY_DST | U::COPY_SRC,
            mapped_at_creation: false,
        })
    }

    fn filled(&self, label: &str, values: &[f32]) -> wgpu::Buffer {
        let b = self.storage(label, values.len());
        self.queue.write_buffer(&b, 0, bytemuck::cast_slice(values));
        b
    }
}

impl GpuToken {
    /// Records the decode step of `spec` on `gpu`; the stages' matrices move in and stay.
    pub fn new(gpu: Arc<Gpu>, spec: TokenSpec<'_>) -> Result<Self, GpuError> {
        let cfg = spec.cfg;
        let (d, hd) = (cfg.hidden, cfg.head_dim);
        let (q_dim, kv_dim, inter) = (cfg.q_dim(), cfg.kv_dim(), cfg.ffn);
        let km = spec.coef.len().isqrt();
        if km * km != spec.coef.len() || spec.m == 0 || !km.is_multiple_of(spec.m) {
            return Err(GpuError::Shape(
                "decoding coefficients are not k·m × k·m".into(),
            ));
        }
        if hd == 0
            || hd > 256
            || !256usize.is_multiple_of(hd)
            || cfg.kv_heads == 0
            || !cfg.heads.is_multiple_of(cfg.kv_heads)
        {
            return Err(GpuError::Shape(format!(
                "the GPU leader needs a head dimension dividing 256, not {hd}"
            )));
        }
        let want = Stage::all(cfg);
        if spec.stages.len() != want.len()
            || spec.stages.iter().zip(&want).any(|(s, w)| s.stage != *w)
        {
            return Err(GpuError::Shape("stages do not match the model".into()));
        }
        let max_ctx = spec.max_ctx.min(cfg.max_seq).max(1);
        let dev = &gpu.device;
        // Layouts: the shared four (read, read, read-write, uniform) and three, and RoPE's and
        // attention's own.
        let rope_layout = layout(dev, &[Some(true), Some(false), Some(false), None, None]);
        let attn_layout = layout(
            dev,
            &[Some(true), Some(true), Some(false), Some(false), None, None],
        );
        let k4 = &gpu.kernels.four;
        let pipelines = vec![
            gpu.kernels.matmul[0][0].clone(),
            gpu.kernels.matmul[1][0].clone(),
            pipeline(dev, "rms_norm", RMS_NORM.into(), k4, None),
            pipeline(dev, "decode", DECODE.into(), k4, None),
            pipeline(dev, "rope_kv", ROPE_KV.into(), &rope_layout, None),
            pipeline(dev, "attention", ATTENTION.into(), &attn_layout, None),
            pipeline(dev, "swiglu", SWIGLU.into(), &gpu.kernels.three, None),
        ];
        // Activations: padded to the products' column alignment, pads kept at zero.
        let pad = |n: usize| n.next_multiple_of(8);
        let x = gpu.storage("x", pad(d));
        let h = gpu.storage("h", pad(d));
        let attn = gpu.storage("attn", pad(q_dim));
        let act = gpu.storage("act", pad(inter));
        let qkv = gpu.storage("qkv", q_dim + 2 * kv_dim);
        let gu = gpu.storage("gu", 2 * inter);
        let answers_len = spec
            .stages
            .iter()
            .map(|s| s.matrix.rows())
            .max()
            .unwrap_or(1);
        let answers = gpu.storage("answers", answers_len);
        let logits = gpu.storage("logits", cfg.vocab);
        let coef: Vec<f32> = spec.coef.iter().map(|&c| c as f32).collect();
        let coef = gpu.filled("coef", &coef);
        let gains: Vec<f32> = spec
            .norms
            .attn_norm
            .iter()
            .chain(&spec.norms.ffn_norm)
            .chain(std::iter::once(&spec.norms.final_norm))
            .flatten()
            .copied()
            .collect();
        if gains.len() != (2 * cfg.layers + 1) * d {
            return Err(GpuError::Shape("norm gains do not match the model".into()));
        }
        let gains = gpu.filled("gains", &gains);
        let half = hd / 2;
        let mut table = Vec::with_capacity(max_ctx * half * 2);
        for pos in 0..max_ctx {
            for &f in spec.inv_freq.iter().take(half) {
                let angle = pos as f64 * f;
                table.extend([angle.cos() as f32, angle.sin() as f32]);
            }
        }
        let table = gpu.filled("rope", &table);
        let caches: Vec<wgpu::Buffer> = (0..cfg.layers)
            .map(|_| gpu.storage("kv cache", 2 * max_ctx * kv_dim))
            .collect();
        if caches.first().is_some_and(|c| c.size() > gpu.max_binding) {
            return Err(GpuError::Shape(format!(
                "a KV cache of {max_ctx} positions is larger than one binding"
            )));
        }
        let scores = gpu.storage("scores", cfg.heads * max_ctx);
        let step = gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("step"),
            size: 16,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let staging = gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("logits staging"),
            size: (4 * cfg.vocab) as u64,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });

        // Every dispatch's parameters, then the bind groups over one uniform buffer.
        let mut params = ParamBlocks::default();
        enum Op<'b> {
            Gemv(bool, &'b wgpu::Buffer, &'b wgpu::Buffer, u32),
            Four(usize, [&'b wgpu::Buffer; 3], u32),
            Swiglu(u32),
            Rope(usize, u32),
            Attention(usize),
        }
        let mut ops: Vec<(Op, u64)> = Vec::new();
        let eps = cfg.norm_eps.to_bits();
        let norm = |params: &mut ParamBlocks, goff: usize| -> Result<u64, GpuError> {
            Ok(params.push([
                u32_of(d, "hidden")?,
                eps,
                u32_of(goff, "gain offset")?,
                0,
                0,
                0,
                0,
                0,
            ]))
        };
        // Decodes matrix `i` of a stage into `dst` at `dst_off` (added when `add`).
        let decode = |params: &mut ParamBlocks,
                      s: &GroupStage,
                      i: usize,
                      dst_off: usize,
                      add: bool|
         -> Result<(u64, u32), GpuError> {
            let member: usize = s.mats.iter().map(|&(_, l)| spec.m * l).sum();
            let mat_off: usize = s.mats[..i].iter().map(|&(_, l)| spec.m * l).sum();
            let (out, l) = s.mats[i];
            let offset = params.push([
                u32_of(out, "rows")?,
                u32_of(l, "block length")?,
                u32_of(km, "k·m")?,
                u32_of(spec.m, "m")?,
                u32_of(member, "answer")?,
                u32_of(mat_off, "offset")?,
                u32_of(dst_off, "offset")?,
                u32::from(add),
            ]);
            Ok((offset, u32_of(out, "rows")?.div_ceil(FLAT)))
        };
        let attn_params = params.push([
            u32_of(cfg.heads, "heads")?,
            u32_of(cfg.kv_heads, "kv heads")?,
            u32_of(hd, "head dim")?,
            u32_of(q_dim, "q dim")?,
            u32_of(kv_dim, "kv dim")?,
            u32_of(max_ctx, "context")?,
            (1.0 / (hd as f32).sqrt()).to_bits(),
            0,
        ]);
        let rope_groups =
            u32_of((cfg.heads + cfg.kv_heads) * half + kv_dim, "rope")?.div_ceil(ROPE_GROUP);
        let swiglu_params = params.push([u32_of(inter, "intermediate")?, 0, 0, 0, 0, 0, 0, 0]);
        let mut stages = spec.stages.iter();
        let mut next = || {
            stages
                .next()
                .ok_or_else(|| GpuError::Shape("too few stages".into()))
        };
        for l in 0..cfg.layers {
            let off = norm(&mut params, l * d)?;
            ops.push((Op::Four(P_RMS_NORM, [&gains, &x, &h], 1), off));
            let s = next()?;
            for (f16, w, offset, groups) in gpu.gemv_dispatches(&s.matrix, &mut params)? {
                ops.push((Op::Gemv(f16, w, &h, groups), offset));
            }
            for (i, dst_off) in [(0, 0), (1, q_dim), (2, q_dim + kv_dim)] {
                let (off, n) = decode(&mut params, s, i, dst_off, false)?;
                ops.push((Op::Four(P_DECODE, [&coef, &answers, &qkv], n), off));
            }
            ops.push((Op::Rope(l, rope_groups), attn_params));
            ops.push((Op::Attention(l), attn_params));
            let s = next()?;
            for (f16, w, offset, groups) in gpu.gemv_dispatches(&s.matrix, &mut params)? {
                ops.push((Op::Gemv(f16, w, &attn, groups), offset));
            }
            let (off, n) = decode(&mut params, s, 0, 0, true)?;
            ops.push((Op::Four(P_DECODE, [&coef, &answers, &x], n), off));
            let off = norm(&mut params, (cfg.layers + l) * d)?;
            ops.push((Op::Four(P_RMS_NORM, [&gains, &x, &h], 1), off));
            let s = next()?;
            for (f16, w, offset, groups) in gpu.gemv_dispatches(&s.matrix, &mut params)? {
                ops.push((Op::Gemv(f16, w, &h, groups), offset));
            }
            for (i, dst_off) in [(0, 0), (1, inter)] {
                let (off, n) = decode(&mut params, s, i, dst_off, false)?;
                ops.push((Op::Four(P_DECODE, [&coef, &answers, &gu], n), off));
            }
            ops.push((
                Op::Swiglu(u32_of(inter, "intermediate")?.div_ceil(FLAT)),
                swiglu_params,
            ));
            let s = next()?;
            for (f16, w, offset, groups) in gpu.gemv_dispatches(&s.matrix, &mut params)? {
                ops.push((Op::Gemv(f16, w, &act, groups), offset));
            }
            let (off, n) = decode(&mut params, s, 0, 0, true)?;
            ops.push((Op::Four(P_DECODE, [&coef, &answers, &x], n), off));
        }
        let off = norm(&mut params, 2 * cfg.layers * d)?;
        ops.push((Op::Four(P_RMS_NORM, [&gains, &x, &h], 1), off));
        let s = next()?;
        for (f16, w, offset, groups) in gpu.gemv_dispatches(&s.matrix, &mut params)? {
            ops.push((Op::Gemv(f16, w, &h, groups), offset));
        }
        let (off, n) = decode(&mut params, s, 0, 0, false)?;
        ops.push((Op::Four(P_DECODE, [&coef, &answers, &logits], n), off));

        let pbuf = gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("token params"),
            size: params.bytes().len().max(256) as u64,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        gpu.queue.write_buffer(&pbuf, 0, params.bytes());
        let p32 = |offset: u64| part(&pbuf, offset, Some(32));
        let mut dispatches = Vec::with_capacity(ops.len());
        for (op, offset) in ops {
            let (pipeline, group, groups) = match op {
                Op::Gemv(f16, w, input, n) => (
                    if f16 { P_GEMV_F16 } else { P_GEMV_F32 },
                    bind(
                        dev,
                        k4,
                        vec![
                            part_all(w),
                            part_all(input),
                            part_all(&answers),
                            p32(offset),
                        ],
                    ),
                    (n, 1),
                ),
                Op::Four(p, [a, b, c], n) => (
                    p,
                    bind(
                        dev,
                        k4,
                        vec![part_all(a), part_all(b), part_all(c), p32(offset)],
                    ),
                    (n, 1),
                ),
                Op::Swiglu(n) => (
                    P_SWIGLU,
                    bind(
                        dev,
                        &gpu.kernels.three,
                        vec![part_all(&gu), part_all(&act), p32(offset)],
                    ),
                    (n, 1),
                ),
                Op::Rope(l, n) => (
                    P_ROPE_KV,
                    bind(
                        dev,
                        &rope_layout,
                        vec![
                            part_all(&table),
                            part_all(&qkv),
                            part_all(&caches[l]),
                            p32(offset),
                            part(&step, 0, Some(16)),
                        ],
                    ),
                    (n, 1),
                ),
                Op::Attention(l) => (
                    P_ATTENTION,
                    bind(
                        dev,
                        &attn_layout,
                        vec![
                            part_all(&caches[l]),
                            part_all(&qkv),
                            part_all(&attn),
                            part_all(&scores),
                            p32(offset),
                            part(&step, 0, Some(16)),
                        ],
                    ),
                    (u32_of(cfg.heads, "heads")?, 1),
                ),
            };
            dispatches.push(Dispatch {
                pipeline,
                group,
                groups,
            });
        }
        let mut buffers = vec![
            h, attn, act, qkv, gu, answers, coef, gains, table, scores, pbuf,
        ];
        buffers.extend(caches);
        Ok(Self {
            gpu,
            pipelines,
            dispatches,
            x,
            step,
            logits,
            staging,
            hidden: d,
            vocab: cfg.vocab,
            max_ctx,
            _stages: spec.stages,
            _buffers: buffers,
        })
    }

    /// Positions the cache holds.
    pub fn max_ctx(&self) -> usize {
        self.max_ctx
    }

    /// The adapter it runs on.
    pub fn gpu_info(&self) -> &super::GpuInfo {
        self.gpu.info()
    }

    /// Dispatches one token takes.
    pub fn dispatches(&self) -> usize {
        self.dispatches.len()
    }

    /// Runs the token whose embedding is `x` at position `pos` (the cache holds every earlier
    /// position of the sequence) and returns its logits.
    pub async fn step(&self, x: &[f32], pos: usize) -> Result<Vec<f32>, GpuError> {
        if x.len() != self.hidden {
            return Err(GpuError::Shape(format!(
                "an embedding of {} values, expected {}",
                x.len(),
                self.hidden
            )));
        }
        if pos >= self.max_ctx {
            return Err(GpuError::Shape(format!(
                "position {pos} is past the GPU cache of {} positions",
                self.max_ctx
            )));
        }
        let gpu = &self.gpu;
        gpu.queue.write_buffer(&self.x, 0, bytemuck::cast_slice(x));
        let pos = u32_of(pos, "position")?;
        gpu.queue
            .write_buffer(&self.step, 0, bytemuck::cast_slice(&[pos, 0, 0, 0]));
        let mut enc = gpu.device.create_command_encoder(&Default::default());
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            for d in &self.dispatches {
                pass.set_pipeline(&self.pipelines[d.pipeline]);
                pass.set_bind_group(0, &d.group, &[]);
                pass.dispatch_workgroups(d.groups.0, d.groups.1, 1);
            }
        }
        let bytes = (4 * self.vocab) as u64;
        enc.copy_buffer_to_buffer(&self.logits, 0, &self.staging, 0, bytes);
        gpu.queue.submit([enc.finish()]);
        read_back(gpu, &self.staging, bytes).await
    }
}
