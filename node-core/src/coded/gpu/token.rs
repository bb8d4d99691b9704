//! A whole decoded token on the GPU: the k members' shard products of a coded group and the
//! leader's work between them (RMSNorm, decoding, RoPE and the KV cache, attention, SwiGLU,
//! the residual stream), recorded once and replayed per token as one submission with one
//! readback of the logits.

use std::sync::Arc;

use crate::compute::gpu::kernels::{ParamBlocks, bind, layout, part, pipeline, read_back};
use crate::compute::gpu::matrix::{WFormat, u32_of};
use crate::compute::gpu::{Gpu, GpuError, GpuMatrix};
use crate::model::{BlockStep, LeaderWeights, LlamaConfig, PassStep, Stage, pass_steps};

const DECODING: &str = include_str!("../../compute/gpu/kernels/decoding.wgsl");
const REDUCE: &str = include_str!("../../compute/gpu/kernels/reduce.wgsl");
const RMS_NORM: &str = include_str!("../../compute/gpu/kernels/rms_norm.wgsl");
const DECODE: &str = include_str!("../../compute/gpu/kernels/decode.wgsl");
const QKV_ROPE: &str = include_str!("../../compute/gpu/kernels/decode_qkv_rope.wgsl");
const ATTENTION: &str = include_str!("../../compute/gpu/kernels/attention.wgsl");
const SWIGLU: &str = include_str!("../../compute/gpu/kernels/decode_swiglu.wgsl");
const RESIDUAL_NORM: &str = include_str!("../../compute/gpu/kernels/decode_residual_norm.wgsl");

/// Invocations of the flat kernels' workgroups (logits, SwiGLU).
const FLAT: u32 = 256;
/// Invocations of the q/k/v decoding kernel's workgroups.
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
/// The GEMVs, one per weight format in [`WFormat`]'s order.
const P_GEMV: usize = 0;
const P_RMS_NORM: usize = 4;
const P_DECODE: usize = 5;
const P_QKV_ROPE: usize = 6;
const P_ATTENTION: usize = 7;
const P_SWIGLU: usize = 8;
const P_RESIDUAL_NORM: usize = 9;

/// A product's input.
#[derive(Debug, Clone, Copy)]
enum Input {
    /// The normed hidden state.
    H,
    /// Attention's output.
    Attn,
    /// SwiGLU's output.
    Act,
}

/// One step of the token, before its bind group exists.
#[derive(Debug)]
enum Op<'b> {
    /// One chunk of a stacked stage: its format, its weights, its input, its workgroups.
    Gemv(WFormat, &'b wgpu::Buffer, Input, u32),
    /// RMSNorm of x into h.
    Norm,
    /// Decode q, k, v with RoPE and the cache append of a layer; workgroups.
    QkvRope(usize, u32),
    /// Attention of a layer.
    Attention(usize),
    /// Decode into the residual stream and the next norm.
    Residual,
    /// Decode gate and up with SwiGLU; workgroups.
    Swiglu(u32),
    /// Decode the logits; workgroups.
    Logits(u32),
}

/// Appends the GEMV dispatches of one stacked stage.
fn gemv<'b>(
    gpu: &Gpu,
    params: &mut ParamBlocks,
    ops: &mut Vec<(Op<'b>, u64)>,
    s: &'b GroupStage,
    input: Input,
) -> Result<(), GpuError> {
    for (format, w, offset, groups) in gpu.gemv_dispatches(&s.matrix, params)? {
        ops.push((Op::Gemv(format, w, input, groups), offset));
    }
    Ok(())
}

/// A binding of a whole buffer.
fn part_all(b: &wgpu::Buffer) -> wgpu::BindingResource<'_> {
    part(b, 0, None)
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
        let (q_dim, kv_dim, ffn) = (cfg.q_dim(), cfg.kv_dim(), cfg.ffn);
        let km = spec.coef.len().isqrt();
        if km * km != spec.coef.len() || spec.m == 0 || !km.is_multiple_of(spec.m) {
            return Err(GpuError::Shape(
                "decoding coefficients are not k·m × k·m".into(),
            ));
        }
        if !(2..=256).contains(&hd)
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
            || spec
                .stages
                .iter()
                .zip(&want)
                .any(|(s, w)| s.mats.len() != w.shapes(cfg).len())
        {
            return Err(GpuError::Shape("stages do not match the model".into()));
        }
        let max_ctx = spec.max_ctx.min(cfg.max_seq).max(1);
        let dev = &gpu.device;
        let (r, w) = (Some(true), Some(false));
        let qkv_layout = layout(dev, &[r, r, r, w, w, None, None]);
        let attn_layout = layout(dev, &[r, r, w, w, None, None]);
        let norm_layout = layout(dev, &[r, r, w, r, w, None]);
        let k4 = &gpu.kernels.four;
        let pipelines = vec![
            gpu.kernels.matmul[0][0].clone(),
            gpu.kernels.matmul[1][0].clone(),
            gpu.kernels.matmul[2][0].clone(),
            gpu.kernels.matmul[3][0].clone(),
            pipeline(dev, "rms_norm", format!("{REDUCE}\n{RMS_NORM}"), k4, None),
            pipeline(dev, "decode", format!("{DECODING}\n{DECODE}"), k4, None),
            pipeline(
                dev,
                "decode_qkv_rope",
                format!("{DECODING}\n{QKV_ROPE}"),
                &qkv_layout,
                None,
            ),
            pipeline(
                dev,
                "attention",
                format!("{REDUCE}\n{ATTENTION}"),
                &attn_layout,
                None,
            ),
            pipeline(
                dev,
                "decode_swiglu",
                format!("{DECODING}\n{SWIGLU}"),
                k4,
                None,
            ),
            pipeline(
                dev,
                "decode_residual_norm",
                format!("{DECODING}\n{REDUCE}\n{RESIDUAL_NORM}"),
                &norm_layout,
                None,
            ),
        ];
        // Activations: padded to the products' column alignment, pads kept at zero.
        let pad = |n: usize| n.next_multiple_of(8);
        let x = gpu.storage("x", pad(d));
        let h = gpu.storage("h", pad(d));
        let q = gpu.storage("q", pad(q_dim));
        let attn = gpu.storage("attn", pad(q_dim));
        let act = gpu.storage("act", pad(ffn));
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
        if !spec.norms.qkv_bias.is_empty() || !spec.norms.q_norm.is_empty() {
            return Err(GpuError::Shape(format!(
                "the GPU whole token runs the plain Llama block; a {:?} model's q/k/v biases or \
                 head norms run on the CPU leader (its linear stages still run on the GPU)",
                cfg.family
            )));
        }
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
        let u = |v: usize| u32_of(v, "a model dimension");
        let (heads, kv_heads) = (u(cfg.heads)?, u(cfg.kv_heads)?);
        let (kmu, mu) = (u(km)?, u(spec.m)?);
        let eps = cfg.norm_eps.to_bits();
        // The attention shape both attention.wgsl and decode_qkv_rope.wgsl start with.
        let shape = [heads, kv_heads, u(hd)?, u(q_dim)?, u(kv_dim)?, u(max_ctx)?];
        let attn_params =
            params.push_words(&[&shape[..], &[(1.0 / (hd as f32).sqrt()).to_bits()]].concat());
        let qkv_groups = u((cfg.heads + cfg.kv_heads) * half + kv_dim)?.div_ceil(ROPE_GROUP);
        let mut ops: Vec<(Op, u64)> = Vec::new();
        // The plan walks the model's forward pass (`model::pass_steps`): a linear step is every
        // member's product of its stage, and the step after it decodes the answers in the
        // kernel that does its own work (RoPE and the cache append, SwiGLU, the residual); a
        // norm right after a residual is that residual's kernel's too.
        let gain_at = |step: PassStep| match step {
            PassStep::Block(l, BlockStep::AttnNorm) => Some(l * d),
            PassStep::Block(l, BlockStep::FfnNorm) => Some((cfg.layers + l) * d),
            PassStep::FinalNorm => Some(2 * cfg.layers * d),
            _ => None,
        };
        let steps = pass_steps(cfg);
        let mut stages = spec.stages.iter();
        // The stage whose answers the next step decodes, and the next product's input.
        let mut pending: Option<&GroupStage> = None;
        let mut input = Input::H;
        for (i, &step) in steps.iter().enumerate() {
            let decoded = || {
                pending.ok_or_else(|| GpuError::Shape(format!("{step:?} has no product to decode")))
            };
            let residual_before = i
                .checked_sub(1)
                .and_then(|b| steps.get(b))
                .is_some_and(|b| {
                    matches!(
                        b,
                        PassStep::Block(_, BlockStep::AttnResidual | BlockStep::FfnResidual)
                    )
                });
            match step {
                PassStep::Block(_, BlockStep::AttnNorm | BlockStep::FfnNorm)
                | PassStep::FinalNorm => {
                    input = Input::H;
                    if !residual_before {
                        let goff = u(gain_at(step).unwrap_or(0))?;
                        ops.push((Op::Norm, params.push([u(d)?, eps, goff, 0, 0, 0, 0, 0])));
                    }
                }
                PassStep::Block(..) | PassStep::LmHead if step.stage().is_some() => {
                    let want = step.stage();
                    let s = stages
                        .next()
                        .filter(|s| Some(s.stage) == want)
                        .ok_or_else(|| GpuError::Shape(format!("no group stage for {step:?}")))?;
                    gemv(&gpu, &mut params, &mut ops, s, input)?;
                    pending = Some(s);
                    if step == PassStep::LmHead {
                        let (out, l) = s.mats[0];
                        let off = params.push([u(out)?, u(l)?, kmu, mu, u(spec.m * l)?, 0, 0, 0]);
                        ops.push((Op::Logits(u(out)?.div_ceil(FLAT)), off));
                    }
                }
                PassStep::Block(l, BlockStep::Rope) => {
                    let s = decoded()?;
                    let member: usize = s.mats.iter().map(|&(_, l)| spec.m * l).sum();
                    let mats: Vec<u32> = (0..3)
                        .map(|j| s.mats.get(j).map_or(Ok(0), |&(_, l)| u(l)))
                        .collect::<Result<_, _>>()?;
                    let layout = [kmu, mu, u(member)?, mats[0], mats[1], mats[2]];
                    let off = params.push_words(&[&shape[..], &layout[..]].concat());
                    ops.push((Op::QkvRope(l, qkv_groups), off));
                }
                PassStep::Block(l, BlockStep::Attend) => {
                    ops.push((Op::Attention(l), attn_params));
                    input = Input::Attn;
                }
                PassStep::Block(_, BlockStep::AttnResidual | BlockStep::FfnResidual) => {
                    let s = decoded()?;
                    let goff = steps
                        .get(i + 1)
                        .and_then(|&next| gain_at(next))
                        .ok_or_else(|| {
                            GpuError::Shape("a residual not followed by a norm".into())
                        })?;
                    let off = params.push([u(d)?, kmu, mu, u(s.mats[0].1)?, eps, u(goff)?, 0, 0]);
                    ops.push((Op::Residual, off));
                }
                PassStep::Block(_, BlockStep::SwiGlu) => {
                    let s = decoded()?;
                    let member: usize = s.mats.iter().map(|&(_, l)| spec.m * l).sum();
                    let (gate, up) = (s.mats[0].1, s.mats.get(1).map_or(0, |m| m.1));
                    let off = params.push([u(ffn)?, kmu, mu, u(member)?, u(gate)?, u(up)?, 0, 0]);
                    ops.push((Op::Swiglu(u(ffn)?.div_ceil(FLAT)), off));
                    input = Input::Act;
                }
                PassStep::Block(..) | PassStep::LmHead => {
                    return Err(GpuError::Shape(format!("{step:?} has no kernel")));
                }
            }
        }

        let pbuf = gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("token params"),
            size: params.bytes().len().max(256) as u64,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        gpu.queue.write_buffer(&pbuf, 0, params.bytes());
        let p32 = |offset: u64| part(&pbuf, offset, Some(64));
        let step16 = || part(&step, 0, Some(16));
        // A decoding kernel's bind group: the coefficients and answers into `dst`.
        let decode_into = |dst: &wgpu::Buffer, offset: u64| {
            bind(
                dev,
                k4,
                vec![
                    part_all(&coef),
                    part_all(&answers),
                    part_all(dst),
                    p32(offset),
                ],
            )
        };
        let mut dispatches = Vec::with_capacity(ops.len());
        for (op, offset) in ops {
            let (pipeline, group, groups) = match op {
                Op::Gemv(format, w, input, n) => {
                    let input = match input {
                        Input::H => &h,
                        Input::Attn => &attn,
                        Input::Act => &act,
                    };
                    (
                        P_GEMV + format.index(),
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
                        n,
                    )
                }
                Op::Norm => (
                    P_RMS_NORM,
                    bind(
                        dev,
                        k4,
                        vec![part_all(&gains), part_all(&x), part_all(&h), p32(offset)],
                    ),
                    1,
                ),
                Op::QkvRope(l, n) => (
                    P_QKV_ROPE,
                    bind(
                        dev,
                        &qkv_layout,
                        vec![
                            part_all(&coef),
                            part_all(&answers),
                            part_all(&table),
                            part_all(&q),
                            part_all(&caches[l]),
                            p32(offset),
                            step16(),
                        ],
                    ),
                    n,
                ),
                Op::Attention(l) => (
                    P_ATTENTION,
                    bind(
                        dev,
                        &attn_layout,
                        vec![
                            part_all(&caches[l]),
                            part_all(&q),
                            part_all(&attn),
                            part_all(&scores),
                            p32(offset),
                            step16(),
                        ],
                    ),
                    heads,
                ),
                Op::Residual => (
                    P_RESIDUAL_NORM,
                    bind(
                        dev,
                        &norm_layout,
                        vec![
                            part_all(&coef),
                            part_all(&answers),
                            part_all(&x),
                            part_all(&gains),
                            part_all(&h),
                            p32(offset),
                        ],
                    ),
                    1,
                ),
                Op::Swiglu(n) => (P_SWIGLU, decode_into(&act, offset), n),
                Op::Logits(n) => (P_DECODE, decode_into(&logits, offset), n),
            };
            dispatches.push(Dispatch {
                pipeline,
                group,
                groups: (groups, 1),
            });
        }
        let mut buffers = vec![h, q, attn, act, answers, coef, gains, table, scores, pbuf];
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
    pub fn gpu_info(&self) -> &crate::compute::gpu::GpuInfo {
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
