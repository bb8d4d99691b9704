//! `codedmesh bench`: kernel bandwidth next to a memory copy, and model tokens/s uncoded and coded.

use std::hint::black_box;
use std::time::{Duration, Instant};

use anyhow::Result;
use node_core::code::{Generator, select_nodes};
use node_core::coded::{CodedGroup, InProcess, ShardFormat};
use node_core::compute::{self, WeightElem};
use node_core::model::{
    GenerateOptions, LeaderWeights, Llama, ModelWeights, Pass, generate, generate_with,
    logits_along, relative_error,
};

/// Best time of `f` over repeated runs lasting at least `budget`.
fn best_time(budget: Duration, mut f: impl FnMut()) -> Duration {
    f();
    let start = Instant::now();
    let mut best = Duration::MAX;
    let mut runs = 0;
    while runs < 3 || start.elapsed() < budget {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed());
        runs += 1;
    }
    best
}

/// One row of the results table.
#[derive(Debug)]
pub struct Row {
    /// What was measured.
    pub what: String,
    /// The figure.
    pub value: String,
}

/// A table row.
pub fn row(what: impl Into<String>, value: impl Into<String>) -> Row {
    Row {
        what: what.into(),
        value: value.into(),
    }
}

/// Memory-copy bandwidth (bytes read per second) over a buffer far larger than the caches.
pub fn copy_bandwidth() -> f64 {
    let n = 64 << 20; // 256 MiB of f32
    let src = vec![1.0f32; n];
    let mut dst = vec![0.0f32; n];
    let t = best_time(Duration::from_secs(2), || {
        dst.copy_from_slice(black_box(&src));
        black_box(&dst);
    });
    (n * 4) as f64 / t.as_secs_f64()
}

/// Bytes per second the kernel threads read from memory (256 MiB summed, every thread its
/// share): the ceiling of a decode that only streams its weights.
pub fn read_bandwidth() -> f64 {
    let n: usize = 32 << 20; // 256 MiB of u64
    let src: Vec<u64> = (0..n as u64).collect();
    let chunk = n.div_ceil(compute::threads().max(1));
    let t = best_time(Duration::from_secs(2), || {
        let parts = compute::par::map(&src.chunks(chunk).collect::<Vec<_>>(), |c| {
            c.iter().fold(0u64, |a, &v| a.wrapping_add(v))
        });
        black_box(parts);
    });
    (n * 8) as f64 / t.as_secs_f64()
}

/// GEMV bandwidth (weight bytes read per second) of a `rows × cols` matrix of `W`, read cold:
/// calls rotate through copies that together exceed the caches, as a forward pass does.
pub fn gemv_bandwidth<W: WeightElem>(rows: usize, cols: usize, make: fn(f32) -> W) -> f64 {
    let bytes = rows * cols * std::mem::size_of::<W>();
    let copies = (256usize << 20).div_ceil(bytes).clamp(1, 256);
    let ws: Vec<Vec<W>> = (0..copies)
        .map(|c| {
            (0..rows * cols)
                .map(|i| make(((i + c) % 97) as f32 * 0.01))
                .collect()
        })
        .collect();
    let x = vec![0.5f32; cols];
    let mut y = vec![0.0f32; rows];
    let t = best_time(Duration::from_secs(1), || {
        for w in &ws {
            compute::matmul(black_box(w.as_slice()), rows, cols, &x, 1, &mut y);
            black_box(&y);
        }
    });
    (bytes * copies) as f64 / t.as_secs_f64()
}

/// GEMV bandwidth of a compact `rows × cols` matrix (i8 values, or i16 for a parity row's
/// when `wide`, and f16 scales per 32), read cold as in [`gemv_bandwidth`]; bytes counted are
/// values and scales.
pub fn gemv_q8_bandwidth(rows: usize, cols: usize, wide: bool) -> f64 {
    use node_core::coded::CodedInts;
    use node_core::compute::q8::{Q8Matrix, blocks_per_row, matmul_q8};
    let nb = blocks_per_row(cols);
    let bytes = rows * cols * if wide { 2 } else { 1 } + rows * nb * 2;
    let copies = (256usize << 20).div_ceil(bytes).clamp(1, 256);
    // Every copy has its own scales, so they are read cold too.
    let ws: Vec<(CodedInts, Vec<half::f16>)> = (0..copies)
        .map(|c| {
            let values = (0..rows * cols).map(move |i| ((i + c) % 97) as i16 - 48);
            let q = if wide {
                CodedInts::I16(values.collect())
            } else {
                CodedInts::I8(values.map(|v| v as i8).collect())
            };
            (q, vec![half::f16::from_f32(0.01); rows * nb])
        })
        .collect();
    let x = vec![0.5f32; cols];
    let mut y = vec![0.0f32; rows];
    let t = best_time(Duration::from_secs(1), || {
        for (q, scales) in &ws {
            let w = Q8Matrix {
                q: black_box(q).view(),
                scales,
                rows,
                cols,
            };
            matmul_q8(w, &x, 1, &mut y);
            black_box(&y);
        }
    });
    (bytes * copies) as f64 / t.as_secs_f64()
}

fn half_from_f32(v: f32) -> half::f16 {
    half::f16::from_f32(v)
}

/// Prefill and decode tokens/s of a model through a group of `k` of `n` rows (`rows`, or the
/// best-conditioned group), members computing on `gpu` when given one.
#[allow(clippy::too_many_arguments)] // one measurement's whole set-up
pub fn model_speed(
    weights: &ModelWeights,
    llama: &Llama,
    n: usize,
    k: usize,
    format: ShardFormat,
    prompt: &[u32],
    tokens: usize,
    gpu: Option<(&std::sync::Arc<node_core::compute::gpu::Gpu>, usize)>,
    rows: Option<&[usize]>,
) -> Result<(f64, f64, f64)> {
    let g = if n == 1 {
        Generator::uncoded()
    } else {
        format.code(n, k)?
    };
    let mut mesh = InProcess::encode(weights, &g, format, &|_, _| {})?;
    if let Some((gpu, min_work)) = gpu {
        for m in mesh.members_mut() {
            m.use_gpu(gpu.clone(), min_work)?;
        }
    }
    let all: Vec<usize> = (0..n).collect();
    let nodes = match rows {
        Some(r) => r.to_vec(),
        None => select_nodes(&g, &all)?.nodes,
    };
    let mut group = CodedGroup::new(weights.cfg.clone(), g, &nodes, mesh)?;
    let opts = GenerateOptions {
        max_tokens: tokens,
        sampling: Default::default(),
        stop_ids: Vec::new(),
        draft: 0,
    };
    // A warm-up, then the best of RUNS measured runs, prefill and decode each (as
    // scripts/llama-cpp-bench.py measures llama.cpp, so the two compare like for like).
    generate(llama, &mut group, prompt, &opts, &mut |_| true)?;
    let (mut prefill, mut decode) = (0.0f64, 0.0f64);
    for _ in 0..RUNS {
        let run = generate(llama, &mut group, prompt, &opts, &mut |_| true)?;
        prefill = prefill.max(run.prefill_tokens_per_s());
        decode = decode.max(run.decode_tokens_per_s());
    }
    Ok((prefill, decode, 1e3 / decode))
}

/// One learning update on `prompt` at the default rate, taken by every member of `group`:
/// f32 shards learn in their values, compact ones in their adapters.
fn learn_once(llama: &Llama, group: &mut CodedGroup<InProcess>, prompt: &[u32]) -> Result<()> {
    let learning = node_core::mesh::LearningConfig::default();
    let grads = futures::executor::block_on(llama.gradients(group, prompt))?;
    let update = node_core::learn::Update::from_gradients(
        grads,
        node_core::mesh::DEFAULT_SGD_LR,
        learning.clip,
    );
    for m in group.transport_mut().members_mut() {
        m.learn(|s| update.apply_to_shards(s))?;
    }
    Ok(())
}

/// Pairs of decode runs in [`learnt_rows`], one of each mesh in turn.
const LEARNT_PAIRS: usize = 8;

/// A k = 3 of n = 5 q8 mesh before and after one learning update: each row's shard blob (as a
/// node stores it), and decode on data rows 0, 1, 2 of both meshes in alternating runs, so
/// that the machine's drift falls on both alike.
pub fn learnt_rows(
    weights: &ModelWeights,
    llama: &Llama,
    prompt: &[u32],
    tokens: usize,
) -> Result<Vec<Row>> {
    let format = ShardFormat::Q8;
    let g = format.code(5, 3)?;
    let nodes = select_nodes(&g, &(0..5).collect::<Vec<_>>())?.nodes;
    let blob = |m: &node_core::coded::Member| -> Result<usize> {
        Ok(node_core::holder::shard_to_blob(m.shards())?.len())
    };
    let encoded = InProcess::encode(weights, &g, format, &|_, _| {})?.into_members();
    let mut meshes = Vec::new();
    let mut sizes: Vec<Vec<usize>> = Vec::new();
    for learn in [false, true] {
        let mesh = InProcess::new(encoded.clone())?;
        let mut group = CodedGroup::new(weights.cfg.clone(), g.clone(), &nodes, mesh)?;
        if learn {
            learn_once(llama, &mut group, prompt)?;
        }
        let members = group.transport().members();
        sizes.push(members.iter().map(blob).collect::<Result<_>>()?);
        meshes.push(group);
    }
    let mut rows: Vec<Row> = (0..5)
        .map(|r| {
            row(
                format!("q8 k=3 of n=5, row {r}'s shard blob: encoded → after a learning update"),
                format!("{} → {} bytes", sizes[0][r], sizes[1][r]),
            )
        })
        .collect();
    let opts = GenerateOptions {
        max_tokens: tokens,
        sampling: Default::default(),
        stop_ids: Vec::new(),
        draft: 0,
    };
    let mut speeds = [Vec::new(), Vec::new()];
    for group in meshes.iter_mut() {
        generate(llama, group, prompt, &opts, &mut |_| true)?;
    }
    for _ in 0..LEARNT_PAIRS {
        for (group, speed) in meshes.iter_mut().zip(speeds.iter_mut()) {
            let run = generate(llama, group, prompt, &opts, &mut |_| true)?;
            speed.push(run.decode_tokens_per_s());
        }
    }
    let ratios: Vec<f64> = speeds[0]
        .iter()
        .zip(&speeds[1])
        .map(|(a, b)| b / a)
        .collect();
    rows.push(row(
        format!(
            "in-process coded k=3 of n=5, q8 data rows 0, 1, 2, before → after a learning update \
             (adapters added): decode ({tokens} tokens, median of {LEARNT_PAIRS} alternating runs)"
        ),
        format!(
            "{:.1} → {:.1} tok/s, {:.3}× (median of the pairs' ratios)",
            median(&speeds[0]),
            median(&speeds[1]),
            median(&ratios)
        ),
    ));
    Ok(rows)
}

/// The median of `v` (the upper one of an even count); 0 when empty.
fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// Measured runs of each speed row (the best is reported), as llama.cpp's script runs.
const RUNS: usize = 3;

/// What [`run`] measured: the table's rows, and the in-process decode a mesh is compared with.
#[derive(Debug)]
pub struct InProcessRows {
    /// The table's rows.
    pub rows: Vec<Row>,
    /// The fastest in-process coded decode on compact data rows, in tokens a second.
    pub coded_decode: f64,
}

/// Runs every measurement in this process, coded k = 3 of 5 and as `mesh` (k, n) too.
pub fn run(
    weights: &ModelWeights,
    prompt: &[u32],
    tokens: usize,
    mesh: (usize, usize),
) -> Result<InProcessRows> {
    let mut rows = vec![row("threads", compute::threads().to_string())];
    let copy = copy_bandwidth();
    rows.push(row(
        "memory copy (256 MiB, bytes read)",
        format!("{:.1} GB/s", copy / 1e9),
    ));
    rows.push(row(
        "memory read, every kernel thread (256 MiB)",
        format!("{:.1} GB/s", read_bandwidth() / 1e9),
    ));
    let cfg = &weights.cfg;
    let shapes = [
        ("GEMV q/o 576×576", cfg.q_dim(), cfg.hidden),
        ("GEMV gate/up 1536×576", cfg.ffn, cfg.hidden),
        ("GEMV down 576×1536", cfg.hidden, cfg.ffn),
        ("GEMV LM head 49152×576", cfg.vocab, cfg.hidden),
        (
            "GEMV k=3 LM head shard 16384×576",
            cfg.vocab.div_ceil(3),
            cfg.hidden,
        ),
        ("GEMV 4096×4096", 4096, 4096),
    ];
    let mut read_bw = 0.0f64;
    for (name, r, c) in shapes {
        let bw = gemv_bandwidth(r, c, |v| v);
        if r * c >= 1 << 24 {
            // Matrices far larger than cache: this is the memory read bandwidth.
            read_bw = read_bw.max(bw);
        }
        rows.push(row(
            name,
            format!("{:.1} GB/s ({:.2}× copy)", bw / 1e9, bw / copy),
        ));
    }
    // Narrower weights: f16, and compact integers (a data row's i8, a parity row's i16).
    let shard = (cfg.vocab.div_ceil(3), cfg.hidden);
    for (name, (r, c), width) in [
        ("GEMV f16 k=3 LM head shard 16384×576", shard, 0),
        ("GEMV f16 4096×4096", (4096, 4096), 0),
        (
            "GEMV q8 k=3 LM head shard 16384×576, data row (i8)",
            shard,
            1,
        ),
        (
            "GEMV q8 k=3 LM head shard 16384×576, parity row (i16)",
            shard,
            2,
        ),
        ("GEMV q8 4096×4096, data row (i8)", (4096, 4096), 1),
    ] {
        let (bw, bytes_per_weight) = match width {
            0 => (gemv_bandwidth(r, c, half_from_f32), 2.0),
            1 => (gemv_q8_bandwidth(r, c, false), 1.0625),
            _ => (gemv_q8_bandwidth(r, c, true), 2.0625),
        };
        rows.push(row(
            name,
            format!(
                "{:.1} GB/s ({:.2}× copy), {:.1} G weights/s",
                bw / 1e9,
                bw / copy,
                bw / bytes_per_weight / 1e9
            ),
        ));
    }
    let llama = Llama::new(cfg.clone(), LeaderWeights::from_model(weights))?;
    let weight_bytes = 4.0
        * (weights.layers.len()
            * (2 * cfg.q_dim() * cfg.hidden
                + 2 * cfg.kv_dim() * cfg.hidden
                + 3 * cfg.ffn * cfg.hidden)
            + cfg.vocab * cfg.hidden) as f64;
    rows.push(row(
        "f32 weight bytes read per token",
        format!(
            "{:.0} MB → floor {:.1} ms/token at the large GEMV's read bandwidth",
            weight_bytes / 1e6,
            1e3 * weight_bytes / read_bw.max(1.0)
        ),
    ));
    let parity: &[usize] = &[2, 3, 4];
    let mut runs = vec![
        ("single node, uncoded".into(), 1, 1, ShardFormat::F32, None),
        (
            "in-process coded k=3 of n=5".into(),
            5,
            3,
            ShardFormat::F32,
            None,
        ),
        (
            "in-process coded k=3 of n=5, f16 shards".into(),
            5,
            3,
            ShardFormat::F16,
            None,
        ),
        (
            "single node, uncoded, q8 weights".into(),
            1,
            1,
            ShardFormat::Q8,
            None,
        ),
        (
            "in-process coded k=3 of n=5, q8 shards (integer code; data rows 0, 1, 2)".into(),
            5,
            3,
            ShardFormat::Q8,
            None,
        ),
        (
            "in-process coded k=3 of n=5, q8 shards, rows 2, 3, 4 (two i16 parity rows)".into(),
            5,
            3,
            ShardFormat::Q8,
            Some(parity),
        ),
    ];
    let (mesh_k, mesh_n) = mesh;
    if mesh != (3, 5) && mesh_n <= Generator::integer_capacity(mesh_k) {
        runs.push((
            format!(
                "in-process coded k={mesh_k} of n={mesh_n}, q8 shards (data rows), as the mesh"
            ),
            mesh_n,
            mesh_k,
            ShardFormat::Q8,
            None,
        ));
    }
    let mut coded_decode = 0.0f64;
    for (label, n, k, format, rows_of) in runs {
        let (prefill, decode, ms) =
            model_speed(weights, &llama, n, k, format, prompt, tokens, None, rows_of)?;
        if k > 1 && format == ShardFormat::Q8 && rows_of.is_none() {
            coded_decode = coded_decode.max(decode);
        }
        rows.push(row(
            format!("{label}: prefill ({} tokens, best of {RUNS})", prompt.len()),
            format!("{prefill:.1} tok/s"),
        ));
        rows.push(row(
            format!("{label}: decode ({tokens} tokens, best of {RUNS})"),
            format!("{decode:.1} tok/s ({ms:.1} ms/token)"),
        ));
    }
    rows.extend(learnt_rows(weights, &llama, prompt, tokens)?);
    Ok(InProcessRows { rows, coded_decode })
}

/// Prints rows as a markdown table.
pub fn print_table(rows: &[Row]) {
    println!("| measurement | value |");
    println!("|---|---|");
    for r in rows {
        println!("| {} | {} |", r.what, r.value);
    }
}

/// What `bench --mesh` runs.
#[derive(Debug)]
pub struct MeshBench<'a> {
    /// The model file.
    pub model: &'a std::path::Path,
    /// The prompt of the loopback rows.
    pub prompt: &'a [u32],
    /// The prompt of the delay rows, a text drafts can follow (a summary of a given passage).
    pub summary: &'a [u32],
    /// Tokens generated per loopback run.
    pub tokens: usize,
    /// One-way delays to measure at, in milliseconds (a fresh mesh for each).
    pub delays: &'a [f64],
    /// How the leader's group is checked and how many spares it asks.
    pub group: node_core::lead::GroupOptions,
    /// Rows needed to compute.
    pub k: usize,
    /// Nodes, one row each.
    pub n: usize,
    /// In-process coded decode in the same run, tokens a second (the mesh's decode is set
    /// against it).
    pub in_process: f64,
}

/// Tokens generated per run of a delay row (a pass costs 244 delays).
const DELAY_TOKENS: usize = 16;

/// A mesh of `codedmesh` processes on this machine (seed + n − 1 nodes) for each delay: at 0,
/// the loopback rows (the same generation as the in-process rows; time split into compute,
/// network, decode); at every delay, ms per token against the floor the delay sets, a token a
/// pass and with drafts.
pub fn mesh_rows(b: &MeshBench<'_>) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    // The bench's own leader, a process that computes no row, polls its sessions where each
    // of the k + 1 processes of its streams has a core (the nodes poll as `up`'s).
    if let Some(spin) = crate::supervise::mesh_spin(b.k + 1) {
        crate::local_session::set_spin(Some(spin));
    }
    for &ms in b.delays {
        let delay = Duration::from_secs_f64(ms.max(0.0) / 1e3);
        // The leader's swarm holds back what it sends as the nodes' do.
        crate::swarm::set_one_way_delay(delay);
        let dir = std::env::temp_dir().join(format!("codedmesh-bench-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut mesh =
            crate::localmesh::LocalMesh::start(b.model, (b.k, b.n), &b.group, &dir, delay)?;
        mesh.wait_serving(&dir, Duration::from_secs(300))?;
        let rt = crate::remote::leader_runtime()?;
        let bootstrap: libp2p::Multiaddr = mesh.bootstrap.parse()?;
        // Heartbeats need a moment to reach the seed before it reports every row.
        let mut leader = None;
        let mut last = format!("fewer than {} live rows", b.n);
        let opts = crate::remote::GroupOptions {
            group: b.group.clone(),
            trace: None,
        };
        for _ in 0..50 {
            // Until every heartbeat has reached the seed, it may not even see k rows.
            match crate::remote::Leader::connect_with(&rt, bootstrap.clone(), &opts) {
                Ok(l) if l.live_rows == b.n => {
                    leader = Some(l);
                    break;
                }
                Ok(l) => last = format!("{} live rows", l.live_rows),
                Err(e) => last = format!("{e:#}"),
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        let mut leader = leader.ok_or_else(|| {
            anyhow::anyhow!(
                "the local mesh never showed {} live rows (last: {last})",
                b.n
            )
        })?;
        if ms == 0.0 {
            rows.extend(loopback_rows(&mut leader, &rt, &mesh, b)?);
            rows.push(group_row(b));
            let model = crate::api::model_id(&leader.manifest);
            rows.extend(api_rows(&rt, &mut mesh, &model, b)?);
        }
        rows.extend(delay_rows(&mut leader, &rt, b.summary, ms)?);
        drop(leader);
        drop(mesh);
        let _ = std::fs::remove_dir_all(&dir);
    }
    crate::swarm::set_one_way_delay(Duration::ZERO);
    Ok(rows)
}

/// At a one-way delay of `ms`: ms per token, hops per token and the floor they set, a token a
/// pass and with drafts of the default length, with the leader's rounds (two hops a round) and
/// with one hop per stage.
fn delay_rows(
    leader: &mut crate::remote::Leader,
    runtime: &tokio::runtime::Runtime,
    prompt: &[u32],
    ms: f64,
) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    let plain = GenerateOptions {
        max_tokens: DELAY_TOKENS,
        sampling: Default::default(),
        stop_ids: Vec::new(),
        draft: 0,
    };
    // Forms the group and opens every connection.
    leader.generate(
        runtime,
        prompt,
        &GenerateOptions {
            max_tokens: 2,
            ..plain.clone()
        },
        &mut |_| true,
    )?;
    let draft = node_core::model::speculate::DEFAULT_DRAFT;
    let mut first: Option<Vec<u32>> = None;
    for (what, draft) in [("a token a pass", 0), ("drafts of 4", draft)] {
        leader.group.reset_stats();
        let opts = GenerateOptions {
            draft,
            ..plain.clone()
        };
        let run = leader.generate(runtime, prompt, &opts, &mut |_| true)?;
        let passes = run.forward_passes.max(1) as u64;
        let per_pass = leader.group.stats().rounds as f64 / passes as f64;
        let decode_tokens = run.tokens.len().saturating_sub(1).max(1) as f64;
        let rounds = per_pass * run.forward_passes.saturating_sub(1) as f64 / decode_tokens;
        let same = match &first {
            None => {
                first = Some(run.tokens.clone());
                String::new()
            }
            Some(t) if *t == run.tokens => ", the same tokens".into(),
            Some(_) => ", DIFFERENT tokens".into(),
        };
        rows.push(row(
            format!("one-way delay {ms} ms, summary, {what}"),
            format!(
                "{:.0} ms/token, {rounds:.0} rounds/token, floor {:.0} ms/token (2 hops × rounds × delay){same}",
                1e3 / run.decode_tokens_per_s(),
                2.0 * rounds * ms,
            ),
        ));
    }
    let mut hop = crate::hop::lead_group(leader, runtime.handle(), 1)?;
    let cfg = leader.llama.config().clone();
    // A pass is the feed, the embedding lookup, four stages a layer and the LM head: a hop each.
    let hops_per_pass = (4 * cfg.layers + 3) as f64;
    for (what, draft) in [("a token a pass", 0), ("drafts of 4", draft)] {
        let opts = GenerateOptions {
            draft,
            ..plain.clone()
        };
        let mut forward = |pass: Pass<'_>| crate::hop::forward(runtime, &mut hop, pass);
        let run = generate_with(&mut forward, cfg.max_seq, prompt, &opts, &mut |_| true)?;
        let decode_tokens = run.tokens.len().saturating_sub(1).max(1) as f64;
        let hops = hops_per_pass * run.forward_passes.saturating_sub(1) as f64 / decode_tokens;
        let same = match &first {
            Some(t) if *t == run.tokens => ", the same tokens",
            _ => ", DIFFERENT tokens",
        };
        rows.push(row(
            format!("one-way delay {ms} ms, summary, one hop per stage, {what}"),
            format!(
                "{:.0} ms/token, {hops:.0} hops/token, floor {:.0} ms/token (hops × delay){same}",
                1e3 / run.decode_tokens_per_s(),
                hops * ms,
            ),
        ));
    }
    let caught = &hop.stats().caught;
    anyhow::ensure!(
        caught.is_empty(),
        "the hop group's leader caught {caught:?}"
    );
    Ok(rows)
}

/// The loopback rows: prefill, decode, drafts, rounds, bytes, the time split and the CPU each
/// process spent a round.
fn loopback_rows(
    leader: &mut crate::remote::Leader,
    runtime: &tokio::runtime::Runtime,
    mesh: &crate::localmesh::LocalMesh,
    b: &MeshBench<'_>,
) -> Result<Vec<Row>> {
    let (prompt, tokens) = (b.prompt, b.tokens);
    let opts = GenerateOptions {
        max_tokens: tokens,
        sampling: Default::default(),
        stop_ids: Vec::new(),
        draft: 0,
    };
    leader.generate(runtime, prompt, &opts, &mut |_| true)?;
    leader.group.reset_stats();
    let compute_before = leader.group.transport().stats().compute;
    let pids: Vec<u32> = std::iter::once(std::process::id())
        .chain(mesh.pids())
        .collect();
    let cpu_before: Option<Vec<Duration>> = pids.iter().map(|&p| process_cpu(p)).collect();
    let run = leader.generate(runtime, prompt, &opts, &mut |_| true)?;
    let cpu_after: Option<Vec<Duration>> = pids.iter().map(|&p| process_cpu(p)).collect();
    let stats = leader.group.stats().clone();
    let compute = leader.group.transport().stats().compute - compute_before;
    let draft = node_core::model::speculate::DEFAULT_DRAFT;
    let drafted = leader.generate(
        runtime,
        prompt,
        &GenerateOptions { draft, ..opts },
        &mut |_| true,
    )?;
    let label = &mesh_label(b);
    let positions = (run.prompt_tokens + run.tokens.len()).max(1) as u64;
    let per_member = stats.bytes_sent / stats.member_requests.max(1) * stats.rounds / positions;
    let total = (stats.member_time + stats.decode_time)
        .as_secs_f64()
        .max(1e-9);
    let pct = |d: Duration| 100.0 * d.as_secs_f64() / total;
    let mut rows = vec![
        row(
            format!("{label}: prefill ({} tokens)", prompt.len()),
            format!("{:.1} tok/s", run.prefill_tokens_per_s()),
        ),
        row(
            format!("{label}: decode ({tokens} tokens)"),
            format!(
                "{:.1} tok/s ({:.1} ms/token)",
                run.decode_tokens_per_s(),
                1e3 / run.decode_tokens_per_s()
            ),
        ),
        row(
            format!(
                "{label}: decode against in-process coded decode (the fastest q8 row above; a leader that holds no row)"
            ),
            format!(
                "{:.2}× ({:.1} against {:.1} tok/s)",
                run.decode_tokens_per_s() / b.in_process.max(1e-9),
                run.decode_tokens_per_s(),
                b.in_process
            ),
        ),
        row(
            format!("{label}: decode with drafts of {draft} (prompt lookup)"),
            format!(
                "{:.1} tok/s ({:.1} ms/token), {:.2} tokens per forward pass, {:.0}% of drafts kept, {}",
                drafted.decode_tokens_per_s(),
                1e3 / drafted.decode_tokens_per_s(),
                drafted.tokens.len() as f64
                    / drafted.forward_passes.saturating_sub(1).max(1) as f64,
                100.0 * drafted.speculation.acceptance(),
                if drafted.tokens == run.tokens {
                    "the same tokens"
                } else {
                    "DIFFERENT tokens"
                }
            ),
        ),
        row(
            format!("{label}: rounds per forward pass"),
            (stats.rounds / (run.forward_passes as u64).max(1)).to_string(),
        ),
        row(
            format!("{label}: bytes per member per token"),
            format!(
                "{} sent, {} received",
                per_member,
                stats.bytes_received / stats.member_requests.max(1) * stats.rounds / positions
            ),
        ),
        row(
            format!("{label}: time split"),
            format!(
                "member compute {:.0}%, network and queueing {:.0}%, decode {:.0}%",
                pct(compute),
                pct(stats.member_time.saturating_sub(compute)),
                pct(stats.decode_time)
            ),
        ),
        row(
            format!("{label}: overhead per round (wait beyond the slowest used member's compute)"),
            format!(
                "{:.0} µs over {} rounds",
                stats.member_time.saturating_sub(compute).as_secs_f64() * 1e6
                    / stats.rounds.max(1) as f64,
                stats.rounds
            ),
        ),
    ];
    if let (Some(before), Some(after)) = (cpu_before, cpu_after) {
        let wall = (run.decode_time + run.prefill_time).as_secs_f64();
        rows.push(cpu_row(label, &before, &after, &stats, wall));
    }
    Ok(rows)
}

/// Timed streams through the seed's API (the best is reported, the median beside it).
const API_STREAMS: usize = 3;

/// Streams through the OpenAI API of the mesh's seed, whose node leads them and computes its
/// own row as `up`'s API node does: a stream as a user of `up` gets it, decode after the first
/// token set against in-process coded decode (issue 23's goal).
fn api_rows(
    runtime: &tokio::runtime::Runtime,
    mesh: &mut crate::localmesh::LocalMesh,
    model: &str,
    b: &MeshBench<'_>,
) -> Result<Vec<Row>> {
    use crate::apistream::{Streamed, stream_completion};
    let addr = mesh.api(Duration::from_secs(60))?;
    // The first stream forms the API node's group and opens its sessions.
    runtime.block_on(stream_completion(addr, model, b.prompt, 4))?;
    let runs = (0..API_STREAMS)
        .map(|_| runtime.block_on(stream_completion(addr, model, b.prompt, b.tokens)))
        .collect::<Result<Vec<_>>>()?;
    let decode: Vec<f64> = runs.iter().map(Streamed::decode_tokens_per_s).collect();
    let first: Vec<f64> = runs.iter().map(|r| r.first.as_secs_f64() * 1e3).collect();
    let each: Vec<String> = decode.iter().map(|d| format!("{d:.1}")).collect();
    let label = &mesh_label(b);
    // The in-process row is the best of its runs: the API's best is set against it, and its
    // median beside.
    let best = decode.iter().copied().fold(0.0, f64::max);
    let middle = median(&decode);
    let against = b.in_process.max(1e-9);
    Ok(vec![
        row(
            format!(
                "{label}: one stream through the seed's OpenAI API (its node leads and computes its own row, as up's API node; drafts of {})",
                node_core::model::speculate::DEFAULT_DRAFT
            ),
            format!(
                "{best:.1} tok/s decode after the first token, best of {API_STREAMS} ({}; {} tokens each), first token {:.0} ms (median)",
                each.join(" / "),
                runs.iter().map(|r| r.tokens).max().unwrap_or(0),
                median(&first)
            ),
        ),
        row(
            format!("{label}: a stream through the API against in-process coded decode"),
            format!(
                "{:.2}× best against best ({best:.1} against {:.1} tok/s); the API's median {:.2}×",
                best / against,
                b.in_process,
                middle / against
            ),
        ),
    ])
}

/// The rows' name for the bench's mesh: `5 processes over loopback, coded k=3`.
fn mesh_label(b: &MeshBench<'_>) -> String {
    format!("{} processes over loopback, coded k={}", b.n, b.k)
}

/// How the bench's leader checks its rounds and how many spares it asks.
fn group_row(b: &MeshBench<'_>) -> Row {
    let group = &b.group;
    let how = match (group.verify, group.project) {
        (0, _) => "no check",
        (1, true) => "check 1, against the check row's secret projections",
        _ => "checked answers",
    };
    let sessions = match crate::local_session::spin() {
        Some(spin) => format!("sessions poll {} µs before they sleep", spin.as_micros()),
        None => "sessions sleep at once".into(),
    };
    row(
        format!("{}: the leader's group", mesh_label(b)),
        format!(
            "{how} (--check {}), {} spares (--spares); {sessions}",
            group.verify, group.spares
        ),
    )
}

/// CPU (user and system) each process spent a round, against the cores: when all of it over
/// the cores comes near the round's time, the round waits for cores, not for the network.
fn cpu_row(
    label: &str,
    before: &[Duration],
    after: &[Duration],
    stats: &node_core::coded::ExecStats,
    wall: f64,
) -> Row {
    let rounds = stats.rounds.max(1) as f64;
    let per_round = |i: usize| after[i].saturating_sub(before[i]).as_secs_f64() * 1e6 / rounds;
    let all: f64 = (0..after.len()).map(per_round).sum();
    let nodes: Vec<String> = (1..after.len())
        .map(|i| format!("{:.0}", per_round(i)))
        .collect();
    let cores = crate::supervise::cores();
    row(
        format!("{label}: CPU per round (user + system; leader, then each node)"),
        format!(
            "leader {:.0} µs, nodes {} µs ({:.1} members asked a round); all {all:.0} µs, over {cores} cores {:.0} µs against {:.0} µs a round",
            per_round(0),
            nodes.join(" / "),
            stats.member_requests as f64 / rounds,
            all / cores as f64,
            wall * 1e6 / rounds
        ),
    )
}

/// CPU time process `pid` has used (all its threads, user and system), where the platform
/// tells (Linux: `/proc/PID/stat`).
#[cfg(target_os = "linux")]
fn process_cpu(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the command's closing parenthesis; utime and stime are 14th and 15th.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(Duration::from_secs_f64(ticks as f64 / clock_ticks()))
}

/// CPU time process `pid` has used, where the platform tells (not here).
#[cfg(not(target_os = "linux"))]
fn process_cpu(_pid: u32) -> Option<Duration> {
    None
}

/// Clock ticks a second, the unit of `/proc/PID/stat`'s times.
#[cfg(target_os = "linux")]
fn clock_ticks() -> f64 {
    match nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK) {
        Ok(Some(t)) if t > 0 => t as f64,
        _ => 100.0,
    }
}

/// Kinds of text drafts are measured on: code, summarising a given passage, open chat.
const SPECULATION_PROMPTS: [(&str, &str); 3] = [
    (
        "code",
        "Write Python functions add(a, b), subtract(a, b), multiply(a, b) and divide(a, b), \
         each with a one-line docstring.",
    ),
    (
        "summary",
        "Summarise this passage in three sentences, keeping its words where you can.\n\n\
         The history of the printing press begins in the fifteenth century, when Johannes \
         Gutenberg combined movable metal type, oil-based ink and a screw press into a system \
         that could produce books far faster than scribes. Within fifty years printing shops \
         had opened in more than two hundred European cities, and the price of books fell so \
         far that merchants, students and craftsmen could own them. The press spread news, \
         pamphlets and scientific results, and it fixed spelling and grammar in print.",
    ),
    (
        "chat",
        "I have rice, eggs, spinach and a lemon. What could I cook for dinner tonight?",
    ),
];

/// Drafted decoding (prompt lookup) against a token a pass, in process (coded k = 3 of 5, q8
/// shards, greedy): acceptance, tokens per forward pass, speed, and whether the tokens are the
/// same.
pub fn speculation_rows(
    weights: &ModelWeights,
    tokenizer: &node_core::model::Tokenizer,
    tokens: usize,
) -> Result<Vec<Row>> {
    let llama = Llama::new(weights.cfg.clone(), LeaderWeights::from_model(weights))?;
    // The shards `up` serves by default, so the rows compare with drafts through the API.
    let format = ShardFormat::Q8;
    let g = format.code(5, 3)?;
    let mesh = InProcess::encode(weights, &g, format, &|_, _| {})?;
    let nodes = select_nodes(&g, &[0, 1, 2, 3, 4])?.nodes;
    let mut group = CodedGroup::new(weights.cfg.clone(), g, &nodes, mesh)?;
    let draft = node_core::model::speculate::DEFAULT_DRAFT;
    let mut rows = Vec::new();
    for (kind, text) in SPECULATION_PROMPTS {
        let prompt = chat_prompt(tokenizer, text)?;
        let run = |group: &mut CodedGroup<InProcess>, draft: usize| {
            let opts = GenerateOptions {
                max_tokens: tokens,
                sampling: Default::default(),
                stop_ids: tokenizer.eos_ids().to_vec(),
                draft,
            };
            generate(&llama, group, &prompt, &opts, &mut |_| true)
        };
        run(&mut group, 0)?;
        let plain = run(&mut group, 0)?;
        let drafted = run(&mut group, draft)?;
        let spec = drafted.speculation;
        let per_pass =
            drafted.tokens.len() as f64 / drafted.forward_passes.saturating_sub(1).max(1) as f64;
        rows.push(row(
            format!("drafts of {draft} (prompt lookup), {kind}: acceptance"),
            format!(
                "{:.0}% ({} of {} drafted), {per_pass:.2} tokens per forward pass",
                100.0 * spec.acceptance(),
                spec.accepted,
                spec.drafted
            ),
        ));
        rows.push(row(
            format!("drafts of {draft}, {kind}: decode in process, coded k=3, q8 shards"),
            format!(
                "{:.1} tok/s against {:.1} a token a pass; {} tokens, {}",
                drafted.decode_tokens_per_s(),
                plain.decode_tokens_per_s(),
                drafted.tokens.len(),
                if drafted.tokens == plain.tokens {
                    "the same tokens"
                } else {
                    "DIFFERENT tokens"
                }
            ),
        ));
    }
    Ok(rows)
}

/// `text` as a user's chat turn in the model's template, as tokens.
fn chat_prompt(tokenizer: &node_core::model::Tokenizer, text: &str) -> Result<Vec<u32>> {
    let chat = [node_core::model::ChatMessage {
        role: "user".into(),
        content: text.into(),
    }];
    Ok(tokenizer.encode(&tokenizer.chat_prompt(&chat))?)
}

/// The summarising prompt of [`speculation_rows`], as tokens (the delay rows' prompt).
pub fn summary_prompt(tokenizer: &node_core::model::Tokenizer) -> Result<Vec<u32>> {
    chat_prompt(tokenizer, SPECULATION_PROMPTS[1].1)
}

/// Prompts of the grid measurement: the test suite's five and a chat turn.
pub const GRID_PROMPTS: [&str; 6] = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Water boils at a temperature of",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
];

/// `codedmesh bench --grids`: what putting the weights on a compact grid costs against the
/// model as loaded, for the integer code's grids (k blocks, `127 / ‖g‖₁` levels) and a plain
/// 8-bit one: relative logit error along the model's greedy continuations, argmax agreement
/// there, and how many whole continuations stay the same.
pub fn grids(weights: &ModelWeights, prompts: &[Vec<u32>], tokens: usize) -> Result<Vec<Row>> {
    let uncoded = |w: &ModelWeights| -> Result<(Llama, CodedGroup<InProcess>)> {
        let g = Generator::uncoded();
        let mesh = InProcess::encode(w, &g, ShardFormat::F32, &|_, _| {})?;
        Ok((
            Llama::new(w.cfg.clone(), LeaderWeights::from_model(w))?,
            CodedGroup::new(w.cfg.clone(), g, &[0], mesh)?,
        ))
    };
    let opts = GenerateOptions {
        max_tokens: tokens,
        sampling: Default::default(),
        stop_ids: Vec::new(),
        draft: 0,
    };
    let (llama, mut group) = uncoded(weights)?;
    let mut cases = Vec::new();
    for p in prompts {
        let want = generate(&llama, &mut group, p, &opts, &mut |_| true)?.tokens;
        let logits = futures::executor::block_on(logits_along(
            &llama,
            &mut group,
            p,
            &want[..want.len().saturating_sub(1)],
        ))?;
        cases.push((p, want, logits));
    }
    let mut rows = Vec::new();
    let integer = Generator::integer(3, 3, None)?
        .levels()
        .ok_or_else(|| anyhow::anyhow!("the integer code has no levels"))?;
    for (label, k, levels) in [
        (
            "integer code k = 3 (data rows i8, parity rows i16)",
            3,
            integer,
        ),
        // Parity rows of i8 would leave 127 / ‖g‖₁ = 127 / 4 levels (the first construction).
        ("integer code k = 3 with i8 parity rows", 3, integer / 4),
        ("8-bit grid, one row per scale (k = 1)", 1, 127),
    ] {
        let w = node_core::coded::grid_model(weights, k, levels);
        let (llama, mut group) = uncoded(&w)?;
        let (mut sum, mut worst, mut steps, mut agree, mut same) = (0.0f64, 0.0f64, 0, 0, 0);
        for (p, want, reference) in &cases {
            let got = generate(&llama, &mut group, p, &opts, &mut |_| true)?.tokens;
            same += usize::from(&got == want);
            let forced = &want[..want.len().saturating_sub(1)];
            let logits = futures::executor::block_on(logits_along(&llama, &mut group, p, forced))?;
            for (step, (l, r)) in logits.iter().zip(reference).enumerate() {
                let e = relative_error(l, r);
                sum += e;
                worst = worst.max(e);
                steps += 1;
                agree += usize::from(want.get(step) == Some(&node_core::model::argmax(l)));
            }
        }
        rows.push(row(
            format!("{label}, {levels} levels"),
            format!(
                "relative logit error mean {:.2e}, max {worst:.2e}; argmax agrees {agree}/{steps}; \
                 same greedy continuation {same}/{}",
                sum / steps.max(1) as f64,
                cases.len()
            ),
        ));
    }
    Ok(rows)
}
