//! `codedmesh bench`: kernel bandwidth next to a memory copy, and model tokens/s uncoded and coded.

pub mod apistream;
pub mod facts;
pub mod gpu;
mod kernels;
pub mod learning;
pub mod localmesh;
mod mesh;
pub mod mixed;
pub mod verify;

pub use kernels::{
    copy_bandwidth, gemv_bandwidth, gemv_q4_bandwidth, gemv_q8_bandwidth, read_bandwidth,
};
pub use mesh::{MeshBench, mesh_rows};

use std::time::{Duration, Instant};

use anyhow::Result;
use node_core::code::{Generator, select_nodes};
use node_core::coded::{CodedGroup, InProcess, ShardFormat};
use node_core::compute;
use node_core::lead::{generate, generate_async};
use node_core::model::{
    GenerateOptions, LeaderWeights, Llama, ModelWeights, Pass, logits_along, relative_error,
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
    let mut group = in_process_group(weights, n, k, format, gpu, rows)?;
    group_speed(llama, &mut group, prompt, tokens)
}

/// Prefill and decode tokens a second and decode ms a token of `group` generating `tokens`
/// greedy tokens after `prompt`: a warm-up, then the best of [`RUNS`] measured runs, prefill
/// and decode each (as scripts/llama-cpp-bench.py measures llama.cpp, so the two compare like
/// for like).
fn group_speed(
    llama: &Llama,
    group: &mut CodedGroup<InProcess>,
    prompt: &[u32],
    tokens: usize,
) -> Result<(f64, f64, f64)> {
    let opts = greedy(tokens);
    generate(llama, group, prompt, &opts, &mut |_| true)?;
    let (mut prefill, mut decode) = (0.0f64, 0.0f64);
    for _ in 0..RUNS {
        let run = generate(llama, group, prompt, &opts, &mut |_| true)?;
        prefill = prefill.max(run.prefill_tokens_per_s());
        decode = decode.max(run.decode_tokens_per_s());
    }
    Ok((prefill, decode, 1e3 / decode))
}

/// Greedy generation of `tokens` tokens, a token a pass (no drafts).
fn greedy(tokens: usize) -> GenerateOptions {
    GenerateOptions {
        max_tokens: tokens,
        sampling: Default::default(),
        stop_ids: Vec::new(),
        draft: 0,
    }
}

/// A coded group of `k` of `n` rows of `format` in this process (`rows`, or the
/// best-conditioned group), members computing on `gpu` when given one.
fn in_process_group(
    weights: &ModelWeights,
    n: usize,
    k: usize,
    format: ShardFormat,
    gpu: Option<(&std::sync::Arc<node_core::compute::gpu::Gpu>, usize)>,
    rows: Option<&[usize]>,
) -> Result<CodedGroup<InProcess>> {
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
    Ok(CodedGroup::new(weights.cfg.clone(), g, &nodes, mesh)?)
}

/// In-process coded decode on a mesh's q8 data rows, kept beside the mesh so that its streams
/// are set against decode measured just before each (the machine's speed drifts over minutes).
pub struct InProcessDecode {
    llama: Llama,
    group: CodedGroup<InProcess>,
    prompt: Vec<u32>,
    opts: GenerateOptions,
}

impl std::fmt::Debug for InProcessDecode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InProcessDecode")
            .field("prompt", &self.prompt.len())
            .field("tokens", &self.opts.max_tokens)
            .finish_non_exhaustive()
    }
}

impl InProcessDecode {
    /// Encodes `weights` as the mesh's k of n q8 rows and warms the group up on `prompt`.
    pub fn new(
        weights: &ModelWeights,
        prompt: &[u32],
        tokens: usize,
        (k, n): (usize, usize),
    ) -> Result<Self> {
        let llama = Llama::new(weights.cfg.clone(), LeaderWeights::from_model(weights))?;
        let group = in_process_group(weights, n, k, ShardFormat::Q8, None, None)?;
        let mut me = Self::on(llama, group, prompt, tokens);
        me.decode()?;
        Ok(me)
    }

    /// Decode by `llama` over a group already encoded (and warmed up).
    fn on(llama: Llama, group: CodedGroup<InProcess>, prompt: &[u32], tokens: usize) -> Self {
        Self {
            llama,
            group,
            prompt: prompt.to_vec(),
            opts: greedy(tokens),
        }
    }

    /// One generation's decode after the first token, tokens a second.
    pub fn decode(&mut self) -> Result<f64> {
        let run = generate(
            &self.llama,
            &mut self.group,
            &self.prompt,
            &self.opts,
            &mut |_| true,
        )?;
        Ok(run.decode_tokens_per_s())
    }
}

/// One learning update on `prompt` at the default rate, moving what `up`'s trainers move (the
/// MLP's matrices alone), taken by every member of `group`: f32 shards learn in their values, compact
/// ones in their adapters.
fn learn_once(llama: &Llama, group: &mut CodedGroup<InProcess>, prompt: &[u32]) -> Result<()> {
    let learning = node_core::mesh::LearningConfig::default();
    let grads = futures::executor::block_on(llama.gradients(group, prompt))?;
    let mut update = node_core::learn::Update::from_gradients(
        grads,
        node_core::mesh::DEFAULT_SGD_LR,
        learning.clip,
    );
    for f in &mut update.stages {
        if !node_core::learn::Trained::MESH.stage(f.stage) {
            f.dy.iter_mut().flatten().for_each(|d| *d = 0.0);
        }
    }
    // Nor do they move the lookup rows or the norm gains.
    update.embed_tokens.clear();
    update.embed_dx.clear();
    update.norms = node_core::model::LeaderWeights::zeros(llama.config());
    let update = update.trimmed();
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
    /// Decode on the mesh's own k of n q8 data rows, kept from its row for the mesh's
    /// streams to be set against ([`InProcessDecode`]).
    pub as_mesh: Option<InProcessDecode>,
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
    // Narrower weights: f16, compact integers (a data row's i8, a parity row's i16), and a
    // 4-bit file's blocks as they are (issue 81).
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
        ("GEMV q8 4096×4096, parity row (i16)", (4096, 4096), 2),
        (
            "GEMV q4 k=3 LM head shard 16384×576, a file's 4-bit blocks",
            shard,
            3,
        ),
        ("GEMV q4 4096×4096, a file's 4-bit blocks", (4096, 4096), 3),
        (
            "GEMV q4 k=3 LM head shard 16384×576, 4-bit blocks × 8-bit input (integer)",
            shard,
            4,
        ),
        (
            "GEMV q4 4096×4096, 4-bit blocks × 8-bit input (integer)",
            (4096, 4096),
            4,
        ),
    ] {
        let (bw, bytes_per_weight) = match width {
            0 => (gemv_bandwidth(r, c, half::f16::from_f32), 2.0),
            1 => (gemv_q8_bandwidth(r, c, false), 1.0625),
            2 => (gemv_q8_bandwidth(r, c, true), 2.0625),
            3 => (gemv_q4_bandwidth(r, c, false), 0.625),
            _ => (gemv_q4_bandwidth(r, c, true), 0.625),
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
    // What `up` serves (q8, the integer code) first, then the f32 and f16 codes beside it.
    let mut runs = vec![
        ("single node, uncoded".into(), 1, 1, ShardFormat::F32, None),
        (
            "single node, uncoded, q8 weights".into(),
            1,
            1,
            ShardFormat::Q8,
            None,
        ),
        (
            "single node, uncoded, q4 weights (a 4-bit file's blocks, integer products)".into(),
            1,
            1,
            ShardFormat::Q4,
            None,
        ),
        (
            "in-process coded k=3 of n=3, q4 data rows (a 4-bit file's blocks)".into(),
            3,
            3,
            ShardFormat::Q4,
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
        (
            "in-process coded k=3 of n=5, f32 shards".into(),
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
    let mut as_mesh = None;
    for (label, n, k, format, rows_of) in runs {
        let mut group = in_process_group(weights, n, k, format, None, rows_of)?;
        let (prefill, decode, ms) = group_speed(&llama, &mut group, prompt, tokens)?;
        let data_rows = format == ShardFormat::Q8 && rows_of.is_none();
        if k > 1 && data_rows {
            coded_decode = coded_decode.max(decode);
        }
        if (k, n) == mesh && data_rows {
            as_mesh = Some(group);
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
    let as_mesh = as_mesh.map(|group| InProcessDecode::on(llama, group, prompt, tokens));
    Ok(InProcessRows {
        rows,
        coded_decode,
        as_mesh,
    })
}

/// Prints rows as a markdown table.
pub fn print_table(rows: &[Row]) {
    println!("| measurement | value |");
    println!("|---|---|");
    for r in rows {
        println!("| {} | {} |", r.what, r.value);
    }
}

/// Kinds of text drafts are measured on: code, summarising a given passage, open chat.
const SPECULATION_PROMPTS: [(&str, &str); 4] = [
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
    (
        "prose",
        "Write a short story about a lighthouse keeper who finds a letter in a bottle.",
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
        let passes = drafted.forward_passes.saturating_sub(1).max(1) as f64;
        let per_pass = drafted.tokens.len() as f64 / passes;
        rows.push(row(
            format!("drafts of up to {draft} (prompt lookup, a length per sequence), {kind}: acceptance"),
            format!(
                "{:.0}% ({} of {} drafted), {per_pass:.2} tokens per forward pass, {:.3} drafted rows a pass",
                100.0 * spec.acceptance(),
                spec.accepted,
                spec.drafted,
                spec.drafted as f64 / passes
            ),
        ));
        rows.push(row(
            format!("drafts of up to {draft}, {kind}: decode in process, coded k=3, q8 shards"),
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

/// A prompt of exactly `tokens` tokens: the drafting texts' words, over and over (the time to
/// first token of a long prompt).
pub fn long_prompt(tokenizer: &node_core::model::Tokenizer, tokens: usize) -> Result<Vec<u32>> {
    let text: Vec<&str> = SPECULATION_PROMPTS.iter().map(|(_, t)| *t).collect();
    let once = tokenizer.encode(&text.join("\n\n"))?;
    anyhow::ensure!(!once.is_empty(), "the drafting texts encode to no tokens");
    Ok(once.iter().copied().cycle().take(tokens).collect())
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
/// model as loaded, for the integer code's grids (k blocks, `127 / ‖g‖₁` levels), a plain
/// 8-bit one, 4-bit grids and parity rows of few bits (docs/coding.md, "Rows at the file's
/// bits"): relative logit error along the model's greedy continuations, argmax agreement
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
    type Regrid = Box<dyn Fn(&ModelWeights) -> ModelWeights>;
    let symmetric = |k: usize, levels: i32| -> Regrid {
        Box::new(move |w| node_core::coded::grid_model(w, k, levels))
    };
    // The file's 4-bit matrices (the layers') on the 4-bit grid; its 8-bit embedding (Q8_0,
    // tied as the output head) stays on the 8-bit one.
    let affine = |k: usize| -> Regrid {
        Box::new(move |w| {
            let mut out =
                node_core::coded::map_linear(w, |m| node_core::coded::affine_grid_matrix(m, k, 15));
            out.embed = node_core::coded::grid_matrix(&w.embed, k, 127);
            out.lm_head = w
                .lm_head
                .as_ref()
                .map(|h| node_core::coded::grid_matrix(h, k, 127));
            out
        })
    };
    // The file's own values (4-bit layers, 8-bit embedding) in data rows, one of the two decoded
    // through a parity row of `bits` bits.
    let through = |bits: u32| -> Regrid {
        Box::new(move |w| {
            node_core::coded::map_linear(w, |m| node_core::coded::through_parity_matrix(m, bits))
        })
    };
    let grids: Vec<(String, Regrid)> = vec![
        (
            format!("integer code k = 3 (data rows i8, parity rows i16), {integer} levels"),
            symmetric(3, integer),
        ),
        // Parity rows of i8 would leave 127 / ‖g‖₁ = 127 / 4 levels (the first construction).
        (
            format!(
                "integer code k = 3 with i8 parity rows, {} levels",
                integer / 4
            ),
            symmetric(3, integer / 4),
        ),
        (
            "8-bit grid, one row per scale (k = 1), 127 levels".into(),
            symmetric(1, 127),
        ),
        ("4-bit symmetric grid, k = 2, ±7".into(), symmetric(2, 7)),
        (
            "4-bit affine grid, k = 1 (a Q4_1 block's shape)".into(),
            affine(1),
        ),
        (
            "4-bit affine grid, unit shared by k = 2, own offsets".into(),
            affine(2),
        ),
        (
            "4-bit affine grid, unit shared by k = 3, own offsets".into(),
            affine(3),
        ),
        (
            "4-bit affine grid, unit shared by k = 4, own offsets".into(),
            affine(4),
        ),
        (
            "the file's values, k = 2, one row through a 12-bit parity row".into(),
            through(12),
        ),
        (
            "the file's values, k = 2, one row through an 8-bit parity row".into(),
            through(8),
        ),
        (
            "the file's values, k = 2, one row through a 6-bit parity row".into(),
            through(6),
        ),
        (
            "the file's values, k = 2, one row through a 5-bit parity row".into(),
            through(5),
        ),
    ];
    for (label, regrid) in &grids {
        let w = regrid(weights);
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
            label.clone(),
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
