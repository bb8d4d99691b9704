//! Resident matrices and the products over them.

use super::kernels::{
    FLAT_GROUP, GEMM_MIN_T, GEMM_TOKENS, MATMUL_ROWS_PER_GROUP, MATMUL_T_GROUP, MAX_GROUPS,
    ParamBlocks, Scratch, bind, ensure, part, read_back, spread,
};
use super::{Gpu, GpuError};

use std::borrow::Cow;

/// Columns are padded to a multiple of this (one f16 weight element is eight columns).
const COL_ALIGN: usize = 8;

/// Columns of compact weights are padded to whole scale blocks.
const COMPACT_ALIGN: usize = crate::compute::q8::Q8_BLOCK;

/// Workgroups of the copy kernel's grid stride: enough to fill the largest GPUs (132 SMs ×
/// 16 resident workgroups × 4).
#[cfg(not(target_arch = "wasm32"))]
const COPY_GROUPS: u32 = 4 * 132 * 16;

/// Largest scratch for the transpose product's split partial sums.
const PARTS_BYTES: u64 = 64 << 20;

/// Weight values to upload, borrowed.
#[derive(Debug, Clone, Copy)]
pub enum Weights<'a> {
    /// f32 values.
    F32(&'a [f32]),
    /// f16 values.
    F16(&'a [half::f16]),
    /// Compact values: integers (i8, or i16 for a parity row) and one f16 scale per row and
    /// 32 columns ([`crate::compute::q8`]'s layout).
    Q8 {
        /// The integers, row-major.
        q: crate::compute::q8::Ints<'a>,
        /// `rows × ⌈cols / 32⌉` scales.
        scales: &'a [half::f16],
    },
}

/// How a resident matrix stores its values: the kernels' weight elements, in the order of
/// their pipelines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WFormat {
    /// f32, four columns an element.
    F32 = 0,
    /// f16, eight columns an element.
    F16 = 1,
    /// i8 with block scales, sixteen columns an element.
    I8 = 2,
    /// i16 with block scales, eight columns an element.
    I16 = 3,
}

impl WFormat {
    /// Index of its pipelines.
    pub(crate) fn index(self) -> usize {
        self as usize
    }

    /// Bytes of one value.
    fn value_bytes(self) -> usize {
        match self {
            Self::F32 => 4,
            Self::F16 | Self::I16 => 2,
            Self::I8 => 1,
        }
    }

    /// Whether block scales follow the values.
    fn scaled(self) -> bool {
        matches!(self, Self::I8 | Self::I16)
    }
}

/// One row chunk of a matrix: its own buffer, small enough for one binding.
#[derive(Debug)]
struct Chunk {
    row0: usize,
    rows: usize,
    buffer: wgpu::Buffer,
}

/// A row-major matrix resident on the GPU, split into row chunks.
#[derive(Debug)]
pub struct GpuMatrix {
    rows: usize,
    cols: usize,
    cols_p: usize,
    format: WFormat,
    chunks: Vec<Chunk>,
}

impl GpuMatrix {
    /// Rows.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// How many buffers it was split into.
    pub fn chunks(&self) -> usize {
        self.chunks.len()
    }

    /// Bytes it occupies on the device.
    pub fn bytes(&self) -> u64 {
        self.chunks.iter().map(|c| c.buffer.size()).sum()
    }

    /// Weight elements (16 bytes: f32s, or packed f16s or integers) per padded row.
    fn cols_w(&self) -> usize {
        self.cols_p * self.format.value_bytes() / 16
    }
}

/// Where one matrix's product goes in an answer laid out `[sub-block][matrix][token][row]`:
/// row `r` of the matrix is local row `r % block_len` of sub-block `r / block_len`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    /// Rows of one sub-block.
    pub block_len: usize,
    /// Values of one sub-block of the whole answer.
    pub per_sub: usize,
    /// This matrix's offset inside a sub-block.
    pub off: usize,
}

impl Placement {
    /// A plain `t × rows` row-major result of one matrix.
    pub fn plain(rows: usize, t: usize) -> Self {
        Self {
            block_len: rows.max(1),
            per_sub: rows * t,
            off: 0,
        }
    }

    /// One past the largest answer index a `rows`-row matrix writes for `t` tokens.
    fn end(&self, rows: usize, t: usize) -> Option<usize> {
        let last = rows.checked_sub(1)?;
        let s = last / self.block_len;
        s.checked_mul(self.per_sub)?
            .checked_add(self.off)?
            .checked_add((t.checked_sub(1)?).checked_mul(self.block_len)?)?
            .checked_add(last % self.block_len + 1)
    }
}

/// `v` as a shader's u32, or a shape error naming `what`.
pub(crate) fn u32_of(v: usize, what: &str) -> Result<u32, GpuError> {
    u32::try_from(v).map_err(|_| GpuError::Shape(format!("{what} {v} is past 2³²")))
}

/// The parameter block of one chunk's product; the last word is the kernel's own (the x
/// stride of gemv/gemm, the rows per split of matmul_t).
fn product_params(
    m: &GpuMatrix,
    c: &Chunk,
    p: &Placement,
    t: usize,
    last: usize,
) -> Result<[u32; 8], GpuError> {
    Ok([
        u32_of(c.rows, "rows")?,
        u32_of(m.cols_w(), "columns")?,
        u32_of(t, "t")?,
        u32_of(p.block_len, "block length")?,
        u32_of(c.row0, "row")?,
        u32_of(p.per_sub, "sub-block length")?,
        u32_of(p.off, "offset")?,
        u32_of(last, "last parameter")?,
    ])
}

/// Checks the matrices share `cols` and their answers fit in `len` values; returns `cols`.
fn check_parts(parts: &[(&GpuMatrix, Placement)], t: usize, len: usize) -> Result<usize, GpuError> {
    let cols = parts.first().map_or(0, |(m, _)| m.cols);
    for (m, p) in parts {
        if m.cols != cols || p.block_len == 0 {
            return Err(GpuError::Shape(format!(
                "matrices of {} and {cols} columns in one product",
                m.cols
            )));
        }
        match p.end(m.rows, t) {
            Some(end) if end <= len => {}
            _ => {
                return Err(GpuError::Shape(format!(
                    "a {}-row matrix at {p:?} does not fit {len} values for t = {t}",
                    m.rows
                )));
            }
        }
    }
    Ok(cols)
}

/// `t × cols` values padded to `t × cols_p` (borrowed when there is nothing to pad).
fn pad_rows(x: &[f32], t: usize, cols: usize, cols_p: usize) -> Cow<'_, [f32]> {
    if cols == cols_p {
        return Cow::Borrowed(x);
    }
    let mut out = vec![0.0f32; t * cols_p];
    if cols > 0 {
        for (dst, src) in out.chunks_exact_mut(cols_p).zip(x.chunks_exact(cols)) {
            dst[..cols].copy_from_slice(src);
        }
    }
    Cow::Owned(out)
}

/// Workgroups along the token axis: one per token for GEMV-shaped kernels, one per
/// `GEMM_TOKENS` tokens for the multi-token ones.
fn token_groups(t: usize, multi: bool) -> Result<u32, GpuError> {
    let groups = u32_of(
        if multi {
            t.div_ceil(GEMM_TOKENS as usize)
        } else {
            t
        },
        "t",
    )?;
    if groups > MAX_GROUPS {
        return Err(GpuError::Shape(format!(
            "t = {t} tokens is more than one product takes"
        )));
    }
    Ok(groups)
}

impl Gpu {
    /// Uploads a `rows × cols` row-major matrix; it stays on the device until dropped.
    pub fn upload(&self, rows: usize, cols: usize, w: Weights<'_>) -> Result<GpuMatrix, GpuError> {
        use crate::compute::q8::{Ints, blocks_per_row};
        let (len, format) = match w {
            Weights::F32(v) => (v.len(), WFormat::F32),
            Weights::F16(v) => (v.len(), WFormat::F16),
            Weights::Q8 { q, scales } => {
                check_scales(scales, rows, cols)?;
                match q {
                    Ints::I8(v) => (v.len(), WFormat::I8),
                    Ints::I16(v) => (v.len(), WFormat::I16),
                }
            }
        };
        if rows.checked_mul(cols) != Some(len) || rows == 0 || cols == 0 {
            return Err(GpuError::Shape(format!(
                "{len} values are not {rows} × {cols}"
            )));
        }
        let cols_p = cols.next_multiple_of(if format.scaled() {
            COMPACT_ALIGN
        } else {
            COL_ALIGN
        });
        let row_bytes = cols_p * format.value_bytes();
        // Compact rows: their block scales, as f32, after all of a chunk's values.
        let nb = if format.scaled() {
            blocks_per_row(cols)
        } else {
            0
        };
        let row_all = (row_bytes + 4 * nb) as u64;
        if row_all > self.max_binding {
            return Err(GpuError::Shape(format!(
                "one row of {cols} columns is larger than the adapter's {} byte binding",
                self.max_binding
            )));
        }
        let max_rows = (self.chunk_bytes / row_all)
            .clamp(1, u64::from(MAX_GROUPS * MATMUL_ROWS_PER_GROUP))
            as usize;
        u32_of(rows * cols_p, "matrix elements")?;
        let mut chunks = Vec::with_capacity(rows.div_ceil(max_rows));
        let mut row0 = 0;
        while row0 < rows {
            let n = max_rows.min(rows - row0);
            // Whole 16-byte elements: the scales are read four to an element.
            let mut bytes = vec![0u8; (n * row_bytes + 4 * n * nb).next_multiple_of(16)];
            let (values, scale_bytes) = bytes.split_at_mut(n * row_bytes);
            for (r, dst) in values.chunks_exact_mut(row_bytes).enumerate() {
                let start = (row0 + r) * cols;
                let range = start..start + cols;
                match w {
                    Weights::F32(v) => {
                        dst[..cols * 4].copy_from_slice(bytemuck::cast_slice(&v[range]))
                    }
                    Weights::F16(v) => put_each(dst, &v[range], |h| h.to_bits().to_le_bytes()),
                    Weights::Q8 { q: Ints::I8(v), .. } => {
                        put_each(dst, &v[range], |b| b.to_le_bytes())
                    }
                    Weights::Q8 {
                        q: Ints::I16(v), ..
                    } => put_each(dst, &v[range], |b| b.to_le_bytes()),
                }
            }
            if let Weights::Q8 { scales, .. } = w {
                let mine = &scales[row0 * nb..(row0 + n) * nb];
                put_each(scale_bytes, mine, |h| h.to_f32().to_le_bytes());
            }
            let buffer = self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("matrix"),
                size: bytes.len() as u64,
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            });
            self.queue.write_buffer(&buffer, 0, &bytes);
            chunks.push(Chunk {
                row0,
                rows: n,
                buffer,
            });
            row0 += n;
        }
        Ok(GpuMatrix {
            rows,
            cols,
            cols_p,
            format,
            chunks,
        })
    }

    /// `y = x · Mᵀ` for each matrix, `x` being `t × cols`, written into an answer of `len`
    /// values at each matrix's placement (one submission, one readback).
    pub async fn matmul(
        &self,
        parts: &[(&GpuMatrix, Placement)],
        x: &[f32],
        t: usize,
        len: usize,
    ) -> Result<Vec<f32>, GpuError> {
        let plan = self.plan_matmul(parts, x, t, len)?;
        let mut scratch = self.scratch.lock().await;
        let bufs = self.io_buffers(&mut scratch, &plan.x, &plan.params, plan.out_bytes);
        let mut enc = self.device.create_command_encoder(&Default::default());
        self.record_matmul(&mut enc, &plan, &bufs, 1);
        enc.copy_buffer_to_buffer(bufs.output, 0, bufs.staging, 0, plan.out_bytes);
        self.queue.submit([enc.finish()]);
        read_back(self, bufs.staging, plan.out_bytes).await
    }

    /// The GEMV dispatches of one token through `m` into a plain output (row `r` at `r`):
    /// per chunk, its format, its buffer, its parameter block in `params` and its workgroups.
    pub(crate) fn gemv_dispatches<'m>(
        &self,
        m: &'m GpuMatrix,
        params: &mut ParamBlocks,
    ) -> Result<Vec<(WFormat, &'m wgpu::Buffer, u64, u32)>, GpuError> {
        let place = Placement::plain(m.rows, 1);
        m.chunks
            .iter()
            .map(|c| {
                let offset = params.push(product_params(m, c, &place, 1, m.cols_p / 4)?);
                let groups = u32_of(c.rows, "rows")?.div_ceil(MATMUL_ROWS_PER_GROUP);
                Ok((m.format, &c.buffer, offset, groups))
            })
            .collect()
    }

    /// Checks a product and lays out its dispatches.
    fn plan_matmul<'a>(
        &'a self,
        parts: &[(&'a GpuMatrix, Placement)],
        x: &'a [f32],
        t: usize,
        len: usize,
    ) -> Result<MatmulPlan<'a>, GpuError> {
        let cols = check_parts(parts, t, len)?;
        if t == 0 || x.len() != t * cols {
            return Err(GpuError::Shape(format!(
                "{} inputs are not t = {t} rows of {cols}",
                x.len()
            )));
        }
        let cols_p = parts.first().map_or(COL_ALIGN, |(m, _)| m.cols_p);
        let x = pad_rows(x, t, cols, cols_p);
        let out_bytes = 4 * len.max(1) as u64;
        let gemm = t >= GEMM_MIN_T;
        let tok_groups = token_groups(t, gemm)?;
        if 4 * x.len() as u64 > self.max_binding || out_bytes > self.max_binding {
            return Err(GpuError::Shape(format!(
                "t = {t} tokens of {cols} columns is more than one product takes"
            )));
        }
        let mut params = ParamBlocks::default();
        let mut dispatches = Vec::new();
        for (m, p) in parts {
            for c in &m.chunks {
                let offset = params.push(product_params(m, c, p, t, cols_p / 4)?);
                let rows = u32_of(c.rows, "rows")?;
                let (kernel, groups) = if !gemm && rows <= self.narrow_rows {
                    (&self.kernels.gemv_narrow[m.format.index()], rows)
                } else {
                    (
                        &self.kernels.matmul[m.format.index()][usize::from(gemm)],
                        rows.div_ceil(MATMUL_ROWS_PER_GROUP),
                    )
                };
                dispatches.push((kernel, &c.buffer, offset, groups));
            }
        }
        Ok(MatmulPlan {
            x,
            out_bytes,
            tok_groups,
            params,
            dispatches,
        })
    }

    /// The scratch buffers of a product, with its input and parameters written.
    fn io_buffers<'s>(
        &self,
        s: &'s mut Scratch,
        input: &[f32],
        params: &ParamBlocks,
        out_bytes: u64,
    ) -> IoBuffers<'s> {
        use wgpu::BufferUsages as U;
        let bytes: &[u8] = bytemuck::cast_slice(input);
        let input = ensure(
            &self.device,
            &mut s.input,
            bytes.len().max(4) as u64,
            U::STORAGE | U::COPY_DST,
        );
        self.queue.write_buffer(input, 0, bytes);
        let pbuf = ensure(
            &self.device,
            &mut s.params,
            params.bytes().len() as u64,
            U::UNIFORM | U::COPY_DST,
        );
        self.queue.write_buffer(pbuf, 0, params.bytes());
        IoBuffers {
            input,
            input_bytes: bytes.len().max(4) as u64,
            params: pbuf,
            output: ensure(
                &self.device,
                &mut s.output,
                out_bytes,
                U::STORAGE | U::COPY_SRC | U::COPY_DST,
            ),
            staging: ensure(
                &self.device,
                &mut s.staging,
                out_bytes,
                U::MAP_READ | U::COPY_DST,
            ),
            parts: &mut s.parts,
        }
    }

    /// Records a planned product `times` times into one compute pass.
    fn record_matmul(
        &self,
        enc: &mut wgpu::CommandEncoder,
        plan: &MatmulPlan<'_>,
        bufs: &IoBuffers<'_>,
        times: usize,
    ) {
        let groups: Vec<wgpu::BindGroup> = plan
            .dispatches
            .iter()
            .map(|&(_, w, offset, _)| {
                bind(
                    &self.device,
                    &self.kernels.four,
                    vec![
                        part(w, 0, None),
                        part(bufs.input, 0, Some(bufs.input_bytes)),
                        part(bufs.output, 0, Some(plan.out_bytes)),
                        part(bufs.params, offset, Some(32)),
                    ],
                )
            })
            .collect();
        let mut pass = enc.begin_compute_pass(&Default::default());
        for _ in 0..times {
            for (&(kernel, _, _, n), bg) in plan.dispatches.iter().zip(&groups) {
                pass.set_pipeline(kernel);
                pass.set_bind_group(0, bg, &[]);
                pass.dispatch_workgroups(n, plan.tok_groups, 1);
            }
        }
    }

    /// Seconds one product takes on the device, from `times` back-to-back runs in one
    /// submission (the benchmark; inputs are zeros).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn time_matmul(&self, m: &GpuMatrix, t: usize, times: usize) -> Result<f64, GpuError> {
        let x = vec![0.0f32; t * m.cols];
        let parts = [(m, Placement::plain(m.rows, t))];
        let plan = self.plan_matmul(&parts, &x, t, m.rows * t)?;
        let mut scratch = pollster::block_on(self.scratch.lock());
        let bufs = self.io_buffers(&mut scratch, &plan.x, &plan.params, plan.out_bytes);
        self.timed(times, |enc, n| self.record_matmul(enc, &plan, &bufs, n))
    }

    /// Best seconds per run of what `record(encoder, runs)` records, over a few submissions.
    #[cfg(not(target_arch = "wasm32"))]
    pub(super) fn timed(
        &self,
        times: usize,
        record: impl Fn(&mut wgpu::CommandEncoder, usize),
    ) -> Result<f64, GpuError> {
        let mut best = f64::INFINITY;
        for round in 0..4 {
            let runs = if round == 0 { 1 } else { times.max(1) };
            let mut enc = self.device.create_command_encoder(&Default::default());
            record(&mut enc, runs);
            self.wait()?;
            let start = std::time::Instant::now();
            self.queue.submit([enc.finish()]);
            self.wait()?;
            if round > 0 {
                best = best.min(start.elapsed().as_secs_f64() / runs as f64);
            }
        }
        Ok(best)
    }

    /// Seconds an empty submission takes to come back (the floor of any call).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn time_submit(&self) -> Result<f64, GpuError> {
        let mut best = f64::INFINITY;
        for _ in 0..50 {
            let enc = self.device.create_command_encoder(&Default::default());
            let start = std::time::Instant::now();
            self.queue.submit([enc.finish()]);
            self.wait()?;
            best = best.min(start.elapsed().as_secs_f64());
        }
        Ok(best)
    }

    /// Seconds the copy kernel takes to copy `bytes` (the bandwidth reference).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn time_copy(&self, bytes: u64, times: usize) -> Result<f64, GpuError> {
        let bytes = bytes.min(self.max_binding) / 16 * 16;
        let make = |usage| {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("copy"),
                size: bytes,
                usage,
                mapped_at_creation: false,
            })
        };
        let src = make(wgpu::BufferUsages::STORAGE);
        let dst = make(wgpu::BufferUsages::STORAGE);
        let bg = bind(
            &self.device,
            &self.kernels.two,
            vec![part(&src, 0, None), part(&dst, 0, None)],
        );
        let (gx, gy) = spread(((bytes / 16) as u32).div_ceil(FLAT_GROUP).min(COPY_GROUPS));
        self.timed(times, |enc, n| {
            let mut pass = enc.begin_compute_pass(&Default::default());
            pass.set_pipeline(&self.kernels.copy);
            pass.set_bind_group(0, &bg, &[]);
            for _ in 0..n {
                pass.dispatch_workgroups(gx, gy, 1);
            }
        })
    }

    /// `y (t × cols) = Σ u_M · M` over the matrices, each `u_M` read from `u` at the matrix's
    /// placement: the transpose product of the backward pass.
    pub async fn matmul_t(
        &self,
        parts: &[(&GpuMatrix, Placement)],
        u: &[f32],
        t: usize,
    ) -> Result<Vec<f32>, GpuError> {
        let cols = check_parts(parts, t, u.len())?;
        if t == 0 {
            return Err(GpuError::Shape("a transpose product of no tokens".into()));
        }
        let Some((first, _)) = parts.first() else {
            return Ok(vec![0.0; t * cols]);
        };
        let cols_p = first.cols_p;
        let out_bytes = 4 * (t * cols_p) as u64;
        let u_bytes = 4 * u.len() as u64;
        let tok_groups = token_groups(t, t > 1)?;
        if u_bytes > self.max_binding || out_bytes > self.max_binding {
            return Err(GpuError::Shape(format!(
                "t = {t} tokens of {cols} columns is more than one product takes"
            )));
        }
        let part_limit = PARTS_BYTES.min(self.max_binding);
        let mut params = ParamBlocks::default();
        let mut dispatches = Vec::new();
        let mut parts_bytes = 0u64;
        for (m, p) in parts {
            for c in &m.chunks {
                let by_memory = (part_limit / out_bytes).max(1) as usize;
                let splits = c
                    .rows
                    .div_ceil(128)
                    .clamp(1, by_memory.min(MAX_GROUPS as usize));
                let per_split = c.rows.div_ceil(splits);
                let splits = c.rows.div_ceil(per_split);
                parts_bytes = parts_bytes.max(splits as u64 * out_bytes);
                let prod = params.push(product_params(m, c, p, t, per_split)?);
                let n4 = u32_of(t * cols_p / 4, "outputs")?;
                let sum = params.push([n4, u32_of(splits, "splits")?, 0, 0, 0, 0, 0, 0]);
                let col_groups = u32_of(m.cols_w(), "columns")?.div_ceil(MATMUL_T_GROUP);
                dispatches.push((
                    m.format,
                    &c.buffer,
                    prod,
                    sum,
                    col_groups,
                    splits as u32,
                    n4,
                ));
            }
        }
        let mut scratch = self.scratch.lock().await;
        let bufs = self.io_buffers(&mut scratch, u, &params, out_bytes);
        let (input, output, pbuf, staging) = (bufs.input, bufs.output, bufs.params, bufs.staging);
        let partial = ensure(
            &self.device,
            bufs.parts,
            parts_bytes,
            wgpu::BufferUsages::STORAGE,
        );
        let mut enc = self.device.create_command_encoder(&Default::default());
        enc.clear_buffer(output, 0, Some(out_bytes));
        {
            let mut pass = enc.begin_compute_pass(&Default::default());
            for (format, w, prod, sum, col_groups, splits, n4) in dispatches {
                let bg = bind(
                    &self.device,
                    &self.kernels.four,
                    vec![
                        part(w, 0, None),
                        part(input, 0, Some(bufs.input_bytes)),
                        part(partial, 0, Some(u64::from(splits) * out_bytes)),
                        part(pbuf, prod, Some(32)),
                    ],
                );
                pass.set_pipeline(&self.kernels.matmul_t[format.index()][usize::from(t > 1)]);
                pass.set_bind_group(0, &bg, &[]);
                pass.dispatch_workgroups(col_groups, tok_groups, splits);
                let bg = bind(
                    &self.device,
                    &self.kernels.three,
                    vec![
                        part(partial, 0, Some(u64::from(splits) * out_bytes)),
                        part(output, 0, Some(out_bytes)),
                        part(pbuf, sum, Some(32)),
                    ],
                );
                let (gx, gy) = spread(n4.div_ceil(FLAT_GROUP));
                pass.set_pipeline(&self.kernels.sum_parts);
                pass.set_bind_group(0, &bg, &[]);
                pass.dispatch_workgroups(gx, gy, 1);
            }
        }
        enc.copy_buffer_to_buffer(output, 0, staging, 0, out_bytes);
        self.queue.submit([enc.finish()]);
        let padded = read_back(self, staging, out_bytes).await?;
        drop(scratch);
        Ok(padded
            .chunks_exact(cols_p)
            .flat_map(|row| row[..cols].iter().copied())
            .collect())
    }
}

/// A checked product: parameters and one dispatch per matrix chunk.
#[derive(Debug)]
struct MatmulPlan<'a> {
    /// The input, padded to whole weight elements.
    x: Cow<'a, [f32]>,
    out_bytes: u64,
    tok_groups: u32,
    params: ParamBlocks,
    /// `(kernel, chunk buffer, parameter offset, row workgroups)`.
    dispatches: Vec<(&'a wgpu::ComputePipeline, &'a wgpu::Buffer, u64, u32)>,
}

/// The scratch buffers a product uses.
#[derive(Debug)]
struct IoBuffers<'s> {
    input: &'s wgpu::Buffer,
    /// Bytes of the input written.
    input_bytes: u64,
    params: &'s wgpu::Buffer,
    output: &'s wgpu::Buffer,
    staging: &'s wgpu::Buffer,
    /// The transpose product's partial sums, set up by it.
    parts: &'s mut Option<wgpu::Buffer>,
}

/// Writes `f(v)` of each value one after another into `dst`.
fn put_each<T: Copy, const N: usize>(dst: &mut [u8], values: &[T], f: impl Fn(T) -> [u8; N]) {
    for (d, &v) in dst.as_chunks_mut::<N>().0.iter_mut().zip(values) {
        *d = f(v);
    }
}

/// Checks that a `rows × cols` compact matrix has a scale for every row and block.
fn check_scales(scales: &[half::f16], rows: usize, cols: usize) -> Result<(), GpuError> {
    let want = rows.saturating_mul(crate::compute::q8::blocks_per_row(cols));
    if scales.len() != want {
        return Err(GpuError::Shape(format!(
            "{} scales for a {rows} × {cols} compact matrix, expected {want}",
            scales.len()
        )));
    }
    Ok(())
}
