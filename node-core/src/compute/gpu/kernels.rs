//! The compiled WGSL kernels, their bind group layouts, and the scratch buffers of a product.

use super::GpuError;

const ELEM_F32: &str = include_str!("kernels/elem_f32.wgsl");
const ELEM_F16: &str = include_str!("kernels/elem_f16.wgsl");
const ELEM_I8: &str = include_str!("kernels/elem_i8.wgsl");
const ELEM_I16: &str = include_str!("kernels/elem_i16.wgsl");
const SCALES: &str = include_str!("kernels/scales.wgsl");
const PRODUCT_IO: &str = include_str!("kernels/product_io.wgsl");
const GEMV: &str = include_str!("kernels/gemv.wgsl");
const GEMV_NARROW: &str = include_str!("kernels/gemv_narrow.wgsl");
const GEMM: &str = include_str!("kernels/gemm.wgsl");
const MATMUL_T: &str = include_str!("kernels/matmul_t.wgsl");
const SUM_PARTS: &str = include_str!("kernels/sum_parts.wgsl");
const COPY: &str = include_str!("kernels/copy.wgsl");

/// Tokens one GEMM invocation keeps accumulators for (the kernels' `TOKENS` override).
pub(super) const GEMM_TOKENS: u32 = 4;
/// Fewest tokens a product runs as GEMM (below, GEMV once per token).
pub(super) const GEMM_MIN_T: usize = 3;
/// Rows of one product workgroup (8 lane groups × 4 rows).
pub(super) const MATMUL_ROWS_PER_GROUP: u32 = 32;
/// Most rows a matrix chunk has for a one-token product to run one row a workgroup
/// (gemv_narrow.wgsl) on a hardware adapter. At 32 rows a workgroup such a chunk fills at most
/// 64 workgroups, too few for a large GPU (an H200 has 132 multiprocessors): there a member's
/// 1366-row shards of the 8B shape ran 1.5–2× faster one row a workgroup, its 4779-row ones
/// 1.4× slower (docs/perf.md).
pub(super) const NARROW_MAX_ROWS: u32 = 2048;
/// Invocations of one transpose-product workgroup.
pub(super) const MATMUL_T_GROUP: u32 = 64;
/// Invocations of one sum-parts or copy workgroup.
pub(super) const FLAT_GROUP: u32 = 256;
/// Byte stride of the per-dispatch parameter blocks (the largest uniform offset alignment).
pub(super) const PARAMS_STRIDE: u64 = 256;
/// Largest workgroup count in one dispatch dimension.
pub(super) const MAX_GROUPS: u32 = 65535;

/// Every pipeline, per weight format where it reads weights: `[f32, f16, i8, i16][gemv, gemm]`
/// (the formats in [`super::matrix::WFormat`]'s order).
#[derive(Debug)]
pub(crate) struct Kernels {
    /// weights (read), input (read), output (read-write), parameters (uniform).
    pub four: wgpu::BindGroupLayout,
    /// input (read), output (read-write), parameters (uniform).
    pub three: wgpu::BindGroupLayout,
    /// source (read), destination (read-write).
    #[cfg_attr(target_arch = "wasm32", allow(dead_code))] // the benchmark is native
    pub two: wgpu::BindGroupLayout,
    /// `[f32, f16, i8, i16][GEMV, GEMM]`.
    pub matmul: [[wgpu::ComputePipeline; 2]; 4],
    /// `[f32, f16, i8, i16]`: GEMV one row a workgroup, for chunks of few rows.
    pub gemv_narrow: [wgpu::ComputePipeline; 4],
    pub matmul_t: [[wgpu::ComputePipeline; 2]; 4],
    pub sum_parts: wgpu::ComputePipeline,
    #[cfg_attr(target_arch = "wasm32", allow(dead_code))]
    pub copy: wgpu::ComputePipeline,
}

/// A bind group layout of storage buffers (`Some(read_only)`) and uniforms (`None`).
pub(crate) fn layout(device: &wgpu::Device, kinds: &[Option<bool>]) -> wgpu::BindGroupLayout {
    let entries: Vec<wgpu::BindGroupLayoutEntry> = kinds
        .iter()
        .enumerate()
        .map(|(i, kind)| wgpu::BindGroupLayoutEntry {
            binding: i as u32,
            visibility: wgpu::ShaderStages::COMPUTE,
            ty: match kind {
                Some(read_only) => wgpu::BindingType::Buffer {
                    ty: wgpu::BufferBindingType::Storage {
                        read_only: *read_only,
                    },
                    has_dynamic_offset: false,
                    min_binding_size: None,
                },
                None => wgpu::BindingType::Buffer {
                    ty: wgpu::BufferBindingType::Uniform,
                    has_dynamic_offset: false,
                    min_binding_size: None,
                },
            },
            count: None,
        })
        .collect();
    device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor {
        label: None,
        entries: &entries,
    })
}

/// A compute pipeline of WGSL `source` (entry point `main`) with one bind group.
pub(crate) fn pipeline(
    device: &wgpu::Device,
    label: &str,
    source: String,
    layout: &wgpu::BindGroupLayout,
    tokens: Option<u32>,
) -> wgpu::ComputePipeline {
    let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: Some(label),
        source: wgpu::ShaderSource::Wgsl(source.into()),
    });
    let pl = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
        label: Some(label),
        bind_group_layouts: &[Some(layout)],
        immediate_size: 0,
    });
    let constants: Vec<(&str, f64)> = tokens
        .map(|t| ("TOKENS", f64::from(t)))
        .into_iter()
        .collect();
    device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some(label),
        layout: Some(&pl),
        module: &module,
        entry_point: Some("main"),
        compilation_options: wgpu::PipelineCompilationOptions {
            constants: &constants,
            zero_initialize_workgroup_memory: false,
        },
        cache: None,
    })
}

impl Kernels {
    /// Compiles every kernel for `device`.
    pub fn new(device: &wgpu::Device) -> Self {
        let four = layout(device, &[Some(true), Some(true), Some(false), None]);
        let three = layout(device, &[Some(true), Some(false), None]);
        let two = layout(device, &[Some(true), Some(false)]);
        let elems = [
            ELEM_F32.to_string(),
            ELEM_F16.to_string(),
            format!("{ELEM_I8}\n{SCALES}"),
            format!("{ELEM_I16}\n{SCALES}"),
        ];
        let per_format = |kernels: [(&str, Option<u32>); 2], name: &str| {
            elems.each_ref().map(|elem| {
                kernels.map(|(body, tokens)| {
                    pipeline(device, name, format!("{elem}\n{body}"), &four, tokens)
                })
            })
        };
        let (gemv, gemm) = (
            format!("{PRODUCT_IO}\n{GEMV}"),
            format!("{PRODUCT_IO}\n{GEMM}"),
        );
        Self {
            matmul: per_format([(&gemv, None), (&gemm, Some(GEMM_TOKENS))], "matmul"),
            gemv_narrow: elems.each_ref().map(|elem| {
                pipeline(
                    device,
                    "gemv_narrow",
                    format!("{elem}\n{PRODUCT_IO}\n{GEMV_NARROW}"),
                    &four,
                    None,
                )
            }),
            matmul_t: per_format(
                [(MATMUL_T, Some(1)), (MATMUL_T, Some(GEMM_TOKENS))],
                "matmul_t",
            ),
            sum_parts: pipeline(device, "sum_parts", SUM_PARTS.into(), &three, None),
            copy: pipeline(device, "copy", COPY.into(), &two, None),
            four,
            three,
            two,
        }
    }
}

/// Buffers reused across products, grown as needed.
#[derive(Debug, Default)]
pub(super) struct Scratch {
    pub input: Option<wgpu::Buffer>,
    pub output: Option<wgpu::Buffer>,
    pub parts: Option<wgpu::Buffer>,
    pub staging: Option<wgpu::Buffer>,
    pub params: Option<wgpu::Buffer>,
}

/// The buffer in `slot`, replaced by a larger one when it holds fewer than `size` bytes.
pub(super) fn ensure<'a>(
    device: &wgpu::Device,
    slot: &'a mut Option<wgpu::Buffer>,
    size: u64,
    usage: wgpu::BufferUsages,
) -> &'a wgpu::Buffer {
    if slot.as_ref().is_none_or(|b| b.size() < size) {
        *slot = Some(device.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size: size.max(256).next_power_of_two(),
            usage,
            mapped_at_creation: false,
        }));
    }
    slot.as_ref().expect("set just above")
}

/// A binding of the first `bytes` of `buffer` (the whole buffer when `None`).
pub(crate) fn part(
    buffer: &wgpu::Buffer,
    offset: u64,
    bytes: Option<u64>,
) -> wgpu::BindingResource<'_> {
    wgpu::BindingResource::Buffer(wgpu::BufferBinding {
        buffer,
        offset,
        size: bytes.and_then(wgpu::BufferSize::new),
    })
}

/// A bind group of `resources` in binding order.
pub(crate) fn bind(
    device: &wgpu::Device,
    layout: &wgpu::BindGroupLayout,
    resources: Vec<wgpu::BindingResource<'_>>,
) -> wgpu::BindGroup {
    let entries: Vec<wgpu::BindGroupEntry> = resources
        .into_iter()
        .enumerate()
        .map(|(i, resource)| wgpu::BindGroupEntry {
            binding: i as u32,
            resource,
        })
        .collect();
    device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout,
        entries: &entries,
    })
}

/// Per-dispatch parameters, each block at a 256-byte offset of one uniform buffer.
#[derive(Debug, Default)]
pub(crate) struct ParamBlocks {
    bytes: Vec<u8>,
}

impl ParamBlocks {
    /// Appends a block of eight words; returns its byte offset.
    pub fn push(&mut self, words: [u32; 8]) -> u64 {
        self.push_words(&words)
    }

    /// Appends a block of up to 64 words; returns its byte offset.
    pub fn push_words(&mut self, words: &[u32]) -> u64 {
        let offset = self.bytes.len() as u64;
        let words = &words[..words.len().min(PARAMS_STRIDE as usize / 4)];
        self.bytes.extend_from_slice(bytemuck::cast_slice(words));
        self.bytes
            .resize(offset as usize + PARAMS_STRIDE as usize, 0);
        offset
    }

    /// The blocks' bytes.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }
}

/// Reads `bytes` from the start of a mapped-for-read `staging` buffer as f32.
pub(crate) async fn read_back(
    gpu: &super::Gpu,
    staging: &wgpu::Buffer,
    bytes: u64,
) -> Result<Vec<f32>, GpuError> {
    if bytes == 0 {
        return Ok(Vec::new());
    }
    let (tx, rx) = futures::channel::oneshot::channel();
    staging.map_async(wgpu::MapMode::Read, 0..bytes, move |r| {
        let _ = tx.send(r);
    });
    gpu.wait()?;
    rx.await
        .map_err(|_| GpuError::Readback("the device dropped the mapping".into()))?
        .map_err(|e| GpuError::Readback(e.to_string()))?;
    let values = {
        let view = staging.get_mapped_range(0..bytes);
        bytemuck::pod_collect_to_vec::<u8, f32>(&view)
    };
    staging.unmap();
    Ok(values)
}

/// `(x, y)` workgroup counts for `groups` workgroups (y > 1 past the one-dimension limit).
pub(super) fn spread(groups: u32) -> (u32, u32) {
    if groups <= MAX_GROUPS {
        (groups.max(1), 1)
    } else {
        (MAX_GROUPS, groups.div_ceil(MAX_GROUPS))
    }
}
