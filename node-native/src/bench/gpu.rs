//! `codedmesh bench --gpu`: the WGSL kernels' throughput next to the device's copy kernel, and
//! a coded model's tokens/s with members on the GPU against the CPU.

use std::sync::Arc;

use anyhow::{Context, Result};
use node_core::coded::{AUTO_GPU_MIN_WORK, GpuGroup, ShardFormat, ShardSet};
use node_core::compute::gpu::{Gpu, GpuMatrix, Placement, Weights};
use node_core::model::{LeaderWeights, Llama, ModelWeights, argmax};

use crate::bench::{Row, model_speed, row};

/// Products per timed submission (the per-submit cost is spread over them).
const RUNS: usize = 20;

/// How a benchmark matrix stores its values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Elem {
    F32,
    F16,
    /// A compact data row: i8 with block scales.
    I8,
    /// A compact parity row: i16 with block scales.
    I16,
}

/// A `rows × cols` matrix of small repeating values, stored as `elem`.
fn matrix(gpu: &Gpu, rows: usize, cols: usize, elem: Elem) -> Result<GpuMatrix> {
    use node_core::compute::q8::{Ints, blocks_per_row};
    let ints: Vec<i16> = (0..rows * cols).map(|i| (i % 97) as i16 - 48).collect();
    let scales = vec![half::f16::from_f32(1e-3); rows * blocks_per_row(cols)];
    let values = || ints.iter().map(|&v| f32::from(v) * 1e-3);
    let m = match elem {
        Elem::F32 => gpu.upload(rows, cols, Weights::F32(&values().collect::<Vec<_>>()))?,
        Elem::F16 => {
            let h: Vec<half::f16> = values().map(half::f16::from_f32).collect();
            gpu.upload(rows, cols, Weights::F16(&h))?
        }
        Elem::I8 => {
            let narrow: Vec<i8> = ints.iter().map(|&v| v as i8).collect();
            let q = Ints::I8(&narrow);
            gpu.upload(rows, cols, Weights::Q8 { q, scales: &scales })?
        }
        Elem::I16 => {
            let q = Ints::I16(&ints);
            gpu.upload(rows, cols, Weights::Q8 { q, scales: &scales })?
        }
    };
    Ok(m)
}

/// Kernel rows: copy, GEMV (f32, f16, the model's shard shapes), GEMM, transpose; and the copy
/// kernel's bandwidth (bytes read + written per second).
pub fn kernel_rows(gpu: &Gpu, big_bytes: u64) -> Result<(Vec<Row>, f64)> {
    let mut rows = vec![row("adapter", gpu.info().to_string())];
    let copy_s = gpu.time_copy(big_bytes, RUNS)?;
    let copy_bw = 2.0 * big_bytes as f64 / copy_s; // read + write
    rows.push(row(
        format!(
            "copy kernel, {} MiB (bytes read + written)",
            big_bytes >> 20
        ),
        format!("{:.0} GB/s", copy_bw / 1e9),
    ));
    // A square-ish matrix of `big_bytes`, f32 and f16.
    let side = ((big_bytes / 4) as f64).sqrt() as usize / 64 * 64;
    for (label, r, c, elem) in [
        ("GEMV f32", side, side, Elem::F32),
        ("GEMV f16", side, 2 * side, Elem::F16),
        ("GEMV q8 i8 (data row)", side, 4 * side, Elem::I8),
        ("GEMV q8 i16 (parity row)", side, 2 * side, Elem::I16),
    ] {
        let m = matrix(gpu, r, c, elem)?;
        let s = gpu.time_matmul(&m, 1, RUNS)?;
        let bw = m.bytes() as f64 / s;
        rows.push(row(
            format!(
                "{label} {r}×{c} ({} MiB, {} chunks)",
                m.bytes() >> 20,
                m.chunks()
            ),
            format!(
                "{:.0} GB/s ({:.2}× copy), {:.1} µs",
                bw / 1e9,
                bw / copy_bw,
                s * 1e6
            ),
        ));
    }
    let cfg = node_core::model::LlamaConfig::smollm2_135m();
    // A k = 3 member's shard of each SmolLM2 stage holds ⌈out/3⌉ rows per sub-block, 2 sub-blocks.
    let shard = |out: usize| 2 * out.div_ceil(6);
    for (label, r, c) in [
        ("GEMV SmolLM2 k=3 shard q/o", shard(cfg.hidden), cfg.hidden),
        (
            "GEMV SmolLM2 k=3 shard gate+up",
            2 * shard(cfg.ffn),
            cfg.hidden,
        ),
        ("GEMV SmolLM2 k=3 shard down", shard(cfg.hidden), cfg.ffn),
        (
            "GEMV SmolLM2 k=3 shard LM head",
            shard(cfg.vocab),
            cfg.hidden,
        ),
    ] {
        let m = matrix(gpu, r, c, Elem::F32)?;
        let s = gpu.time_matmul(&m, 1, RUNS * 10)?;
        rows.push(row(
            format!("{label} {r}×{c} f32"),
            format!("{:.1} µs ({:.0} GB/s)", s * 1e6, m.bytes() as f64 / s / 1e9),
        ));
    }
    // What a member pays per request: upload x, dispatch, read the answer back.
    let m = matrix(gpu, shard(cfg.hidden), cfg.hidden, Elem::F32)?;
    let x = vec![0.5f32; cfg.hidden];
    let p = [(&m, Placement::plain(m.rows(), 1))];
    let calls = 200;
    let start = std::time::Instant::now();
    for _ in 0..calls {
        pollster::block_on(gpu.matmul(&p, &x, 1, m.rows()))?;
    }
    rows.push(row(
        "an empty submission, submit to done",
        format!("{:.1} µs", gpu.time_submit()? * 1e6),
    ));
    rows.push(row(
        "one q-shard dispatch alone in a submission, submit to done",
        format!("{:.1} µs", gpu.time_matmul(&m, 1, 1)? * 1e6),
    ));
    rows.push(row(
        "one product call (upload, dispatch, read back), q shard",
        format!(
            "{:.1} µs",
            start.elapsed().as_secs_f64() * 1e6 / calls as f64
        ),
    ));
    let m = matrix(gpu, 4096, 4096, Elem::F32)?;
    for t in [4, 16, 64] {
        let s = gpu.time_matmul(&m, t, RUNS)?;
        let flops = 2.0 * 4096.0 * 4096.0 * t as f64;
        rows.push(row(
            format!("GEMM f32 4096×4096, t = {t}"),
            format!("{:.0} GFLOP/s, {:.1} µs", flops / s / 1e9, s * 1e6),
        ));
    }
    let m = matrix(gpu, shard(cfg.vocab), cfg.hidden, Elem::F32)?;
    let u = vec![0.5f32; m.rows()];
    let p = [(&m, Placement::plain(m.rows(), 1))];
    let start = std::time::Instant::now();
    for _ in 0..calls {
        pollster::block_on(gpu.matmul_t(&p, &u, 1))?;
    }
    rows.push(row(
        format!(
            "one transpose product call, LM head shard {}×{}",
            m.rows(),
            m.cols()
        ),
        format!(
            "{:.1} µs",
            start.elapsed().as_secs_f64() * 1e6 / calls as f64
        ),
    ));
    let floor = weight_bytes(&cfg) / copy_bw;
    rows.push(row(
        "SmolLM2 f32 weights per token ÷ copy bandwidth (a whole token's floor)",
        format!("{:.1} µs ({:.0} MB)", floor * 1e6, weight_bytes(&cfg) / 1e6),
    ));
    Ok((rows, copy_bw))
}

/// Bytes of f32 weights one token reads: every linear matrix once.
fn weight_bytes(cfg: &node_core::model::LlamaConfig) -> f64 {
    4.0 * (cfg.layers
        * (2 * cfg.q_dim() * cfg.hidden + 2 * cfg.kv_dim() * cfg.hidden + 3 * cfg.ffn * cfg.hidden)
        + cfg.vocab * cfg.hidden) as f64
}

/// f32 weights past which the whole token is not measured on f32 shards (the model, its
/// members' shards and the stacked stages would all sit in host memory at once).
const F32_WHOLE_TOKEN_MAX_BYTES: f64 = 16.0 * (1u64 << 30) as f64;

/// Tokens/s of an in-process coded k = 3 of n = 5 group: the whole token on the GPU against
/// its floor (weight bytes ÷ `copy_bw`), and with `cpu_rows` members on the CPU and on the GPU.
pub fn model_rows(
    gpu: Arc<Gpu>,
    weights: &ModelWeights,
    prompt: &[u32],
    tokens: usize,
    copy_bw: f64,
    cpu_rows: bool,
) -> Result<Vec<Row>> {
    let cfg = &weights.cfg;
    let llama = Llama::new(cfg.clone(), LeaderWeights::from_model(weights))?;
    let f32_bytes = weight_bytes(cfg);
    let mut rows = Vec::new();
    // Bytes a weight on the GPU: compact values carry an f32 scale per 32; a group with a
    // parity row stacks every member's integers as i16.
    for (label, format, bytes, members) in [
        ("f32", ShardFormat::F32, 4.0, [0, 2, 4]),
        ("f16", ShardFormat::F16, 2.0, [0, 2, 4]),
        (
            "q8, data rows 0, 1, 2 (i8)",
            ShardFormat::Q8,
            1.125,
            [0, 1, 2],
        ),
        (
            "q8, rows 2, 3, 4 (as i16)",
            ShardFormat::Q8,
            2.125,
            [2, 3, 4],
        ),
    ] {
        if format == ShardFormat::F32 && f32_bytes > F32_WHOLE_TOKEN_MAX_BYTES {
            rows.push(row(
                "whole token on the GPU, f32 shards",
                format!("not measured: {:.1} GB of f32 weights", f32_bytes / 1e9),
            ));
            continue;
        }
        let g = format.code(5, 3)?;
        let started = std::time::Instant::now();
        let sets = ShardSet::encode_parallel(weights, &g, &members, format)?;
        let sets: Vec<&ShardSet> = sets.iter().collect();
        let ctx = (prompt.len() + tokens + 1).min(cfg.max_seq);
        let group = GpuGroup::new(gpu.clone(), &llama, &sets, ctx)?;
        eprintln!(
            "{label}: rows {members:?} encoded and on the GPU in {:.1} s",
            started.elapsed().as_secs_f64()
        );
        let mut pos = 0;
        let start = std::time::Instant::now();
        let mut logits = Vec::new();
        for &t in prompt {
            logits = group.step(t, pos)?;
            pos += 1;
        }
        let prefill = start.elapsed().as_secs_f64();
        let start = std::time::Instant::now();
        let mut next = argmax(&logits);
        let mut n = 0;
        while n < tokens && pos < ctx {
            logits = group.step(next, pos)?;
            next = argmax(&logits);
            pos += 1;
            n += 1;
        }
        let per_token = start.elapsed().as_secs_f64() / n.max(1) as f64;
        let floor = f32_bytes * bytes / 4.0 / copy_bw;
        rows.push(row(
            format!(
                "whole token on the GPU, k=3 of n=5, {label} shards ({} dispatches, one submission)",
                group.dispatches()
            ),
            format!(
                "prefill {:.1} tok/s (one token at a time), decode {:.1} tok/s ({:.0} µs/token = {:.1}× the floor of {:.1} µs)",
                prompt.len() as f64 / prefill.max(1e-9),
                1.0 / per_token,
                per_token * 1e6,
                per_token / floor,
                floor * 1e6
            ),
        ));
    }
    if !cpu_rows {
        return Ok(rows);
    }
    for (label, format) in [
        ("f32", ShardFormat::F32),
        ("f16", ShardFormat::F16),
        ("q8", ShardFormat::Q8),
    ] {
        for (device, g) in [
            ("CPU", None),
            ("GPU", Some((&gpu, 0))),
            (
                "GPU for products ≥ 16 MiB (auto)",
                Some((&gpu, AUTO_GPU_MIN_WORK)),
            ),
        ] {
            let (prefill, decode, ms) =
                model_speed(weights, &llama, 5, 3, format, prompt, tokens, g, None)
                    .with_context(|| format!("coded model on the {device}"))?;
            rows.push(row(
                format!("coded k=3 of n=5, {label} shards, members on the {device}"),
                format!(
                    "prefill {prefill:.1} tok/s ({} tokens), decode {decode:.1} tok/s ({ms:.2} ms/token)",
                    prompt.len()
                ),
            ));
        }
    }
    Ok(rows)
}

/// Timed calls of each stage's product in [`member_rows`] (the median is reported).
const MEMBER_CALLS: usize = 50;

/// A member's rounds as a `--device gpu` node answers them: one q8 row of k = 3 of n = 5 (a
/// data row, then a parity row) on the GPU, each kind of stage's product for one token timed
/// (upload, dispatch, read back) against its floor (the bytes it reads ÷ `copy_bw`), then a
/// whole token's rounds one after another against the row's floor, and the same token's
/// rounds on the CPU.
pub fn member_rows(
    gpu: &Arc<Gpu>,
    weights: &ModelWeights,
    tokens: usize,
    copy_bw: f64,
) -> Result<Vec<Row>> {
    use node_core::coded::Member;
    use node_core::model::Stage;
    use node_core::protocol::StepRequest;

    let cfg = &weights.cfg;
    let g = ShardFormat::Q8.code(5, 3)?;
    let input = |m: &Member, stage: Stage| -> Result<StepRequest> {
        let cols = m
            .shards()
            .stage_shards(stage)?
            .first()
            .map_or(0, |s| s.cols);
        let x = (0..cols).map(|i| ((i % 17) as f32 - 8.0) / 8.0).collect();
        Ok(StepRequest::Matmul { stage, t: 1, x })
    };
    let mut rows = Vec::new();
    for (label, r) in [("data row 0 (i8)", 0), ("parity row 3 (as i16)", 3)] {
        let started = std::time::Instant::now();
        let set = ShardSet::encode_parallel(weights, &g, &[r], ShardFormat::Q8)?
            .pop()
            .context("encoding gave no row")?;
        let mut member = Member::new(set);
        member.use_gpu(gpu.clone(), 0)?;
        pollster::block_on(member.warm_up(1))?;
        eprintln!(
            "member, q8 {label}: encoded, on the GPU and warm in {:.1} s",
            started.elapsed().as_secs_f64()
        );
        let shards = member.gpu_shards().context("the row is not on the GPU")?;
        let stage_floor = |stage: Stage| -> Result<f64> {
            let bytes: u64 = shards
                .stage_matrices(stage)?
                .iter()
                .map(|g| g.bytes())
                .sum();
            Ok(bytes as f64 / copy_bw)
        };
        // The stage's kernels alone, back to back in one submission (no upload or read back).
        let kernels = |stage: Stage| -> Result<f64> {
            shards
                .stage_matrices(stage)?
                .iter()
                .map(|g| Ok(gpu.time_matmul(g, 1, RUNS)?))
                .sum()
        };
        for stage in [
            Stage::Qkv(0),
            Stage::AttnOut(0),
            Stage::GateUp(0),
            Stage::Down(0),
            Stage::LmHead,
        ] {
            let req = input(&member, stage)?;
            let mut times = Vec::with_capacity(MEMBER_CALLS);
            for _ in 0..MEMBER_CALLS {
                let t = std::time::Instant::now();
                member.compute(&req)?;
                times.push(t.elapsed().as_secs_f64());
            }
            times.sort_by(f64::total_cmp);
            let median = times[times.len() / 2];
            let floor = stage_floor(stage)?;
            let kernel = kernels(stage)?;
            rows.push(row(
                format!("a member's round on the GPU (`--device gpu`), q8 {label}, {stage:?}"),
                format!(
                    "{:.0} µs (median of {MEMBER_CALLS}; {:.1}× its floor of {:.1} µs); its kernels alone {:.1} µs",
                    median * 1e6,
                    median / floor,
                    floor * 1e6,
                    kernel * 1e6
                ),
            ));
        }
        let stages = Stage::all(cfg);
        let reqs = stages
            .iter()
            .map(|&s| input(&member, s))
            .collect::<Result<Vec<_>>>()?;
        let token_floor = stages
            .iter()
            .map(|&s| stage_floor(s))
            .sum::<Result<f64>>()?;
        let time_token =
            |f: &dyn Fn(&StepRequest) -> Result<Vec<f32>, node_core::coded::CodedError>,
             n: usize|
             -> Result<f64> {
                let t = std::time::Instant::now();
                for _ in 0..n {
                    for req in &reqs {
                        f(req)?;
                    }
                }
                Ok(t.elapsed().as_secs_f64() / n.max(1) as f64)
            };
        let on_gpu = time_token(&|q| member.compute(q), tokens)?;
        let on_cpu = time_token(&|q| member.compute_cpu(q), tokens.clamp(1, 4))?;
        rows.push(row(
            format!(
                "a member's rounds for a token ({} stages), q8 {label}: GPU; CPU",
                stages.len()
            ),
            format!(
                "{:.2} ms ({:.0} µs a round; {:.1}× the row's floor of {:.0} µs); {:.2} ms",
                on_gpu * 1e3,
                on_gpu * 1e6 / stages.len() as f64,
                on_gpu / token_floor,
                token_floor * 1e6,
                on_cpu * 1e3
            ),
        ));
    }
    Ok(rows)
}
