//! `codedmesh`: the Coded Mesh command line.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Parser;
use node_core::code::{Generator, select_nodes};
use node_core::coded::{CodedGroup, GpuGroup, InProcess, ShardFormat};
use node_core::compute::gpu::Gpu;
use node_core::learn::{Learner, Teacher};
use node_core::model::{
    ChatMessage, GenerateOptions, LeaderWeights, Llama, Pass, SamplingParams, generate,
    generate_async, generate_on, generate_with,
};
use node_core::model::{Generation, LlamaConfig, ModelWeights, Tokenizer};
use node_native::lead::remote::{Leader, Session};
use node_native::{fetch, load, node, progress};
use std::sync::Arc;
use std::time::Duration;
use tracing_subscriber::EnvFilter;

mod cli;

use cli::{BenchArgs, Cli, Command, EvalArgs, GenerateArgs, StatusArgs, UpArgs};

/// The allocator: the rounds allocate and free a few buffers each (docs/perf-history.md, "An allocator
/// for the rounds").
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| EnvFilter::new("warn,libp2p_kad=error")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(args) => match args.bootstrap.clone() {
            Some(b) => node_native::lead::remote::leader_runtime()
                .map_err(anyhow::Error::from)
                .and_then(|rt| rt.block_on(run_generate_mesh(args, b))),
            None => run_generate(args),
        },
        Command::Seed(args) => runtime().and_then(|rt| {
            let opts = args.net.options(None)?;
            let model = model_path(&args.model)?;
            let (optimizer, lr) = args.optimizer.with_lr(args.lr);
            let learning = node_core::mesh::LearningConfig {
                enabled: !args.no_learning,
                optimizer,
                lr,
                clip: args.clip,
                rank: args.rank,
                accumulate: args.accumulate,
                momentum: args.momentum,
            };
            rt.block_on(node::seed(
                opts,
                model,
                args.k,
                args.n,
                args.max_rows,
                cli::mesh_format(args.shard_format, args.k, args.n),
                learning,
            ))
        }),
        Command::Node(args) if args.supervise => runtime().and_then(|rt| {
            rt.block_on(node_native::up::supervise::supervise_self(
                "--supervise",
                &format!("node {}", args.net.data.display()),
            ))
        }),
        Command::Node(args) => runtime().and_then(|rt| {
            let mut opts = args.net.options(args.bootstrap.clone())?;
            opts.fault = args.inject_fault;
            rt.block_on(node::node(opts))
        }),
        Command::Up(args) => runtime().and_then(|rt| rt.block_on(run_up(args))),
        Command::Status(args) => run_status(args),
        Command::Eval(args) => node_native::lead::remote::leader_runtime()
            .map_err(anyhow::Error::from)
            .and_then(|rt| rt.block_on(run_eval(args))),
        Command::Bench(args) => run_bench(args),
        Command::FetchModel => fetch::default_model().map(|p| println!("{}", p.display())),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// `codedmesh up`.
async fn run_up(args: UpArgs) -> Result<()> {
    let mut node_args = vec![
        "--max-batch".into(),
        args.max_batch.to_string().into(),
        "--queue".into(),
        args.queue.to_string().into(),
        "--groups".into(),
        args.groups.to_string().into(),
        "--draft".into(),
        args.draft.to_string().into(),
        "--pass".into(),
        args.pass.to_string().into(),
    ];
    node_args.extend(node_native::up::supervise::group_args(
        &args.group.options(),
    ));
    let cores = node_native::up::supervise::cores();
    let (k, nodes) = node_native::up::default_shape(cores, args.k, args.nodes);
    if args.k.is_none() && k != 3 {
        eprintln!(
            "this machine has {cores} cores: a mesh of k = {k} of {nodes} nodes, so that a stream's k members work at once (--k 3 --nodes 5 for the usual mesh)"
        );
    }
    node_native::up::up(node_native::up::UpOptions {
        nodes,
        k,
        max_rows: args.max_rows,
        model: args.model,
        data: args.data,
        port: args.port,
        api_listen: args.api_listen,
        api_key: args.api_key,
        no_learning: args.no_learning,
        format: cli::mesh_format(args.shard_format, k, nodes),
        shape_chosen: args.k.is_some() || args.nodes.is_some() || args.shard_format.is_some(),
        trace_steps: args.trace_steps,
        web_dir: args.web_dir,
        no_build_web: args.no_build_web,
        node_args,
    })
    .await
}

fn model_path(model: &Option<PathBuf>) -> Result<PathBuf> {
    match model {
        Some(p) => Ok(p.clone()),
        None => fetch::default_model(),
    }
}

/// The prompt the benchmarks generate from.
const BENCH_TEXT: &str = "The history of the printing press begins in the fifteenth century, when \
                          Johannes Gutenberg combined movable metal type, oil-based ink and a \
                          screw press into a system that could produce books far faster than \
                          scribes.";

/// `codedmesh bench --learning`.
fn run_learning_bench(args: &BenchArgs, model: &load::LoadedModel) -> Result<()> {
    use node_native::bench::learning;
    let (k, n) =
        node_native::up::default_shape(node_native::up::supervise::cores(), args.k, args.nodes);
    let format = cli::mesh_format(args.learn_format, k, n);
    let (optimizer, lr) = args.optimizer.with_lr(args.lr);
    let learning = node_core::mesh::LearningConfig {
        optimizer,
        lr,
        ..node_core::mesh::LearningConfig::default()
    };
    eprintln!("in process: k = {k} of {n} rows, {format:?} shards, {optimizer:?} at lr {lr}");
    let mut rows = vec![node_native::bench::row(
        "mesh",
        format!("in process, k = {k} of {n}, {format:?}, {optimizer:?}, lr {lr}"),
    )];
    let log = |what: &'static str| {
        move |i: usize, loss: f64, v: Option<&node_core::learn::Verdict>| match v {
            Some(v) => eprintln!(
                "{what} {i}: loss {loss:.4}, canary {:.4} → {:.4}{}",
                v.before,
                v.after,
                if v.pass { "" } else { " REFUSED" }
            ),
            None => eprintln!("{what} {i}: loss {loss:.4}"),
        }
    };
    let taught = learning::teach_in_process(
        &model.weights,
        &model.tokenizer,
        format,
        (n, k),
        learning,
        learning::TAUGHT,
        args.exposures,
        !args.no_gate,
        log("taught"),
    )?;
    rows.extend(learning::taught_rows("taught", &taught, args.exposures));
    if args.poison > 0 {
        let poisoned = learning::teach_in_process(
            &model.weights,
            &model.tokenizer,
            format,
            (n, k),
            learning,
            learning::GARBAGE,
            args.poison,
            !args.no_gate,
            log("poison"),
        )?;
        rows.extend(learning::taught_rows("poison", &poisoned, args.poison));
    }
    node_native::bench::print_table(&rows);
    Ok(())
}

fn run_bench(args: BenchArgs) -> Result<()> {
    if args.gpu {
        return run_gpu_bench(&args);
    }
    let path = model_path(&args.model)?;
    let model = load::load_model(&path)?;
    let text = BENCH_TEXT;
    let prompt = model.tokenizer.encode(text)?;
    if args.grids {
        let prompts = node_native::bench::GRID_PROMPTS
            .iter()
            .map(|p| model.tokenizer.encode(p))
            .collect::<Result<Vec<_>, _>>()?;
        let rows = node_native::bench::grids(&model.weights, &prompts, args.tokens)?;
        node_native::bench::print_table(&rows);
        return Ok(());
    }
    if args.verify {
        let prompts = [
            text,
            "The capital of France is Paris, and the capital of Italy is Rome.",
            "A coded mesh keeps every weight matrix as shards that any k nodes can compute with.",
        ]
        .iter()
        .map(|p| model.tokenizer.encode(p))
        .collect::<Result<Vec<_>, _>>()?;
        let rows = node_native::bench::verify::run(
            &model.weights,
            &prompts,
            args.trials,
            args.honest,
            args.shard_format,
        )?;
        node_native::bench::print_table(&rows);
        return Ok(());
    }
    if args.learning {
        return run_learning_bench(&args, &model);
    }
    if args.speculate {
        let rows =
            node_native::bench::speculation_rows(&model.weights, &model.tokenizer, args.tokens)?;
        node_native::bench::print_table(&rows);
        return Ok(());
    }
    // The mesh `up` starts on this machine, unless the flags say otherwise.
    let (k, n) =
        node_native::up::default_shape(node_native::up::supervise::cores(), args.k, args.nodes);
    let measured = node_native::bench::run(&model.weights, &prompt, args.tokens, (k, n))?;
    let mut rows = measured.rows;
    if args.mesh {
        let summary = node_native::bench::summary_prompt(&model.tokenizer)?;
        drop(model);
        rows.extend(node_native::bench::mesh_rows(
            &node_native::bench::MeshBench {
                model: &path,
                prompt: &prompt,
                summary: &summary,
                tokens: args.tokens,
                delays: &args.one_way_delay_ms,
                group: args.group.options(),
                k,
                n,
                in_process: measured.coded_decode,
            },
        )?);
    }
    node_native::bench::print_table(&rows);
    Ok(())
}

fn run_gpu_bench(args: &BenchArgs) -> Result<()> {
    let gpu = std::sync::Arc::new(pollster::block_on(Gpu::open(false))?);
    eprintln!("adapter: {}", gpu.info());
    let (mut rows, copy_bw) = node_native::bench::gpu::kernel_rows(&gpu, args.gpu_mib << 20)?;
    let (weights, prompt) = if args.synthetic {
        let weights = ModelWeights::synthetic(LlamaConfig::smollm2_135m(), 1)?;
        let prompt: Vec<u32> = (0..40).map(|i| (i * 997 + 13) % 49152).collect();
        (weights, prompt)
    } else {
        let model = load::load_model(&model_path(&args.model)?)?;
        let prompt = model.tokenizer.encode(BENCH_TEXT)?;
        (model.weights, prompt)
    };
    rows.extend(node_native::bench::gpu::model_rows(
        gpu,
        &weights,
        &prompt,
        args.tokens,
        copy_bw,
    )?);
    node_native::bench::print_table(&rows);
    Ok(())
}

fn run_generate(args: GenerateArgs) -> Result<()> {
    if args.k == 0 || args.n < args.k {
        bail!("need 1 ≤ k ≤ n, got k = {}, n = {}", args.k, args.n);
    }
    let path = model_path(&args.model)?;
    let started = std::time::Instant::now();
    let model = load::load_model(&path)?;
    let cfg = model.weights.cfg.clone();
    eprintln!(
        "model {}: {} layers, d = {}, vocab {}, {:.1} M parameters (loaded in {:.2} s)",
        path.display(),
        cfg.layers,
        cfg.hidden,
        cfg.vocab,
        model.weights.parameter_count() as f64 / 1e6,
        started.elapsed().as_secs_f64()
    );
    let generator = args.shard_format.code(args.n, args.k)?;
    let started = std::time::Instant::now();
    let pb = progress::bar(0, "encoding");
    let mesh = InProcess::encode(
        &model.weights,
        &generator,
        args.shard_format,
        &|done, total| {
            pb.set_length(total as u64);
            pb.set_position(done as u64);
        },
    )?;
    pb.finish_and_clear();
    let shard_mib = mesh.members().first().map_or(0, |m| m.shards().bytes()) as f64 / 1048576.0;
    eprintln!(
        "encoded {} shards (k = {}, {:?}, {:?}, {:.1} MiB each) in {:.2} s",
        args.n,
        args.k,
        generator.construction(),
        args.shard_format,
        shard_mib,
        started.elapsed().as_secs_f64()
    );
    let all: Vec<usize> = (0..args.n).collect();
    let selection = select_nodes(&generator, &all)?;
    let llama = Llama::new(cfg.clone(), LeaderWeights::from_model(&model.weights))?;
    let mut group = CodedGroup::new(cfg.clone(), generator, &selection.nodes, mesh)?;
    eprintln!(
        "group: rows {:?}, condition number {:.2}",
        group.nodes(),
        group.condition_number()
    );

    let gpu = pollster::block_on(Gpu::for_choice(args.device)).context("--device gpu")?;
    let (out, prompt) = if let Some(gpu) = gpu {
        // The whole token on the GPU: the k members' products and the leader's work, one
        // submission each.
        let started = std::time::Instant::now();
        let mesh = group.transport();
        let sets: Vec<&node_core::coded::ShardSet> = selection
            .nodes
            .iter()
            .filter_map(|&r| mesh.members().get(r).map(|m| m.shards()))
            .collect();
        let max_ctx = cfg.max_seq.min(GPU_CONTEXT);
        let gpu_group = GpuGroup::new(Arc::new(gpu), &llama, &sets, max_ctx)?;
        eprintln!(
            "computing on the GPU: {} ({} dispatches a token, {max_ctx} positions of cache; set up in {:.2} s)",
            gpu_group.gpu_info(),
            gpu_group.dispatches(),
            started.elapsed().as_secs_f64()
        );
        let mut pos = 0;
        // The GPU group keeps its own cache and gives the last position's logits: no drafts.
        let mut forward = |pass: Pass<'_>| {
            if pass.start != pos || pass.logits != 1 {
                return Err(node_core::model::ModelError::Config(
                    "the GPU group runs one position after another".into(),
                ));
            }
            let mut logits = Vec::new();
            for &t in pass.tokens {
                logits = gpu_group.step(t, pos).map_err(|e| {
                    node_core::model::ModelError::Embedding(format!("GPU step: {e}"))
                })?;
                pos += 1;
            }
            Ok(logits)
        };
        let one_by_one = GenerateArgs {
            draft: Some(0),
            ..args.clone()
        };
        let ctx = node_core::model::LlamaConfig {
            max_seq: max_ctx,
            ..cfg.clone()
        };
        let mut run = |p: &[u32], o: &GenerateOptions, on: &mut dyn FnMut(u32) -> bool| {
            generate_with(&mut forward, &ctx, p, o, on)
        };
        let done = generate_and_print(&mut run, &model.tokenizer, &one_by_one)?;
        print_speed(&done.0, " (one token at a time)");
        done
    } else {
        let mut run = |p: &[u32], o: &GenerateOptions, on: &mut dyn FnMut(u32) -> bool| {
            generate(&llama, &mut group, p, o, on)
        };
        let done = generate_and_print(&mut run, &model.tokenizer, &args)?;
        print_coded_stats(&args, &done.0, group.stats(), None);
        done
    };
    if args.verify {
        let opts = generate_options(&model.tokenizer, &args);
        verify_against_uncoded(&model.weights, &llama, &prompt, &opts, &out.tokens)?;
    }
    Ok(())
}

/// Runs the uncoded model (k = n = 1) and reports whether it chose the same tokens.
fn verify_against_uncoded(
    weights: &node_core::model::ModelWeights,
    llama: &Llama,
    prompt: &[u32],
    opts: &GenerateOptions,
    coded: &[u32],
) -> Result<()> {
    let g = Generator::uncoded();
    let mesh = InProcess::encode(weights, &g, ShardFormat::F32, &|_, _| {})?;
    let mut group = CodedGroup::new(weights.cfg.clone(), g, &[0], mesh)?;
    let out = generate(llama, &mut group, prompt, opts, &mut |_| true).context("uncoded run")?;
    if out.tokens == coded {
        eprintln!(
            "verify: the uncoded run chose the same {} tokens (uncoded decode {:.1} tok/s)",
            coded.len(),
            out.decode_tokens_per_s()
        );
        Ok(())
    } else {
        bail!(
            "verify: coded tokens {coded:?} differ from uncoded {:?}",
            out.tokens
        )
    }
}

/// Most positions of the KV cache a GPU group keeps.
const GPU_CONTEXT: usize = 4096;

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
}

fn prompt_ids(tokenizer: &Tokenizer, args: &GenerateArgs) -> Result<Vec<u32>> {
    let text = if args.chat {
        tokenizer.chat_prompt(&[ChatMessage {
            role: "user".into(),
            content: args.prompt.clone(),
        }])
    } else {
        args.prompt.clone()
    };
    let prompt = tokenizer.encode(&text)?;
    if prompt.is_empty() {
        bail!("the prompt encodes to no tokens");
    }
    Ok(prompt)
}

fn generate_options(tokenizer: &Tokenizer, args: &GenerateArgs) -> GenerateOptions {
    GenerateOptions {
        max_tokens: args.max_tokens,
        sampling: SamplingParams {
            temperature: args.temperature,
            top_p: args.top_p,
            seed: args.seed,
        },
        stop_ids: tokenizer.eos_ids().to_vec(),
        draft: args.draft.unwrap_or(match args.bootstrap {
            Some(_) => node_core::model::speculate::DEFAULT_DRAFT,
            None => 0,
        }),
    }
}

/// How one generation runs: over the prompt, with the options, each token to the callback
/// (false stops it).
type Run<'a> = dyn FnMut(
        &[u32],
        &GenerateOptions,
        &mut dyn FnMut(u32) -> bool,
    ) -> Result<Generation, node_core::model::ModelError>
    + 'a;

/// Streams a completion through `run`, printing it to stdout as it comes.
fn generate_and_print(
    run: &mut Run<'_>,
    tokenizer: &Tokenizer,
    args: &GenerateArgs,
) -> Result<(Generation, Vec<u32>)> {
    let (prompt, opts, mut printer) = Printer::start(tokenizer, args)?;
    let out = run(&prompt, &opts, &mut |id| printer.token(id));
    printer.end();
    Ok((out?, prompt))
}

/// A completion printed to stdout as its tokens come.
struct Printer<'a> {
    text: node_core::model::TextStream<'a>,
    emitted: usize,
}

impl<'a> Printer<'a> {
    /// The request `args` make, and a printer for its completion.
    fn start(
        tokenizer: &'a Tokenizer,
        args: &GenerateArgs,
    ) -> Result<(Vec<u32>, GenerateOptions, Self)> {
        let prompt = prompt_ids(tokenizer, args)?;
        let opts = generate_options(tokenizer, args);
        let printer = Self {
            text: tokenizer.stream(),
            emitted: 0,
        };
        Ok((prompt, opts, printer))
    }

    /// Prints what `id` adds to the text; generation goes on.
    fn token(&mut self, id: u32) -> bool {
        self.emitted += 1;
        if let Some(new) = self.text.push(id) {
            let mut stdout = std::io::stdout();
            let _ = write!(stdout, "{new}");
            let _ = stdout.flush();
        }
        true
    }

    /// Ends the completion's line; how many tokens were printed.
    fn end(self) -> usize {
        println!();
        self.emitted
    }
}

/// Prints the prefill and decode speed; `how` notes how the prompt ran.
fn print_speed(out: &Generation, how: &str) {
    eprintln!(
        "prompt {} tokens: prefill {:.1} tok/s{how}; generated {} tokens: decode {:.1} tok/s ({:?})",
        out.prompt_tokens,
        out.prefill_tokens_per_s(),
        out.tokens.len(),
        out.decode_tokens_per_s(),
        out.stop
    );
}

/// Prints speed, rounds, bytes per member and where the time went.
fn print_coded_stats(
    args: &GenerateArgs,
    out: &Generation,
    stats: &node_core::coded::ExecStats,
    member_compute: Option<Duration>,
) {
    let k = args.k.max(1) as u64;
    print_speed(out, "");
    let forward_passes = (out.forward_passes as u64).max(1);
    let total_tokens = (out.prompt_tokens + out.tokens.len()).max(1) as u64;
    // Per member asked (spares included), per token position.
    let per_member =
        |bytes: u64| bytes / stats.member_requests.max(1) * stats.rounds / total_tokens;
    eprintln!(
        "coded: k = {}, rounds per forward pass {}, bytes per member per token {} sent + {} received",
        k,
        stats.rounds / forward_passes,
        per_member(stats.bytes_sent),
        per_member(stats.bytes_received),
    );
    let total = (stats.decode_time + stats.member_time)
        .as_secs_f64()
        .max(1e-9);
    let pct = |d: Duration| 100.0 * d.as_secs_f64() / total;
    match member_compute {
        Some(compute) => eprintln!(
            "time: member compute {:.1}%, network {:.1}%, decode {:.1}%; members dropped {}",
            pct(compute),
            pct(stats.member_time.saturating_sub(compute)),
            pct(stats.decode_time),
            stats.members_dropped
        ),
        None => eprintln!(
            "time: members {:.1}%, decode {:.1}%",
            pct(stats.member_time),
            pct(stats.decode_time)
        ),
    }
}

/// `generate --bootstrap`: a leader on the mesh; with `--repeat`, the same request again on a
/// fresh group each time, learning after each.
async fn run_generate_mesh(args: GenerateArgs, bootstrap: libp2p::Multiaddr) -> Result<()> {
    if args.device != node_core::compute::gpu::DeviceChoice::Cpu {
        bail!(
            "--device runs a generation in this process; on a mesh each node chooses its own (codedmesh node --device gpu|auto)"
        );
    }
    let mut args = args;
    let mut teacher: Option<Teacher> = None;
    let mut last = None;
    for i in 0..args.repeat.max(1) {
        if args.repeat > 1 {
            eprintln!("request {} of {}", i + 1, args.repeat);
        }
        let began = std::time::Instant::now();
        let (mut leader, out, prompt) = run_once_on_mesh(&mut args, &bootstrap).await?;
        let latency = began.elapsed();
        let teacher = match &mut teacher {
            Some(t) => t,
            None => {
                let m = &leader.manifest;
                let gate = if args.no_canary_gate {
                    None
                } else {
                    let canary = leader.tokenizer.encode(node_core::learn::CANARY_TEXT)?;
                    Some(node_core::learn::CanaryGate::new(canary))
                };
                let learner = Learner::new(m.learning, m.cfg.clone(), m.format);
                teacher.insert(Teacher::new(learner, gate, m.format))
            }
        };
        let started = std::time::Instant::now();
        let caught_before = leader.group.stats().caught.len();
        let learned = leader.learn(&prompt, teacher).await?;
        // Members caught in learning's rounds (a backward lie shows only there).
        let caught = &leader.group.stats().caught[caught_before..];
        for c in caught {
            eprintln!("{c}");
        }
        if !caught.is_empty() {
            let told = leader.report_caught().await;
            eprintln!("reported to {told} nodes");
        }
        let usage = node_core::mesh::Usage::of_request(
            prompt.len(),
            out.len(),
            latency,
            learned.as_ref().map(|l| l.loss),
        );
        if let Err(e) = leader.report_served(usage).await {
            tracing::warn!("the request was not counted in the mesh's usage: {e:#}");
        }
        if let Some(l) = learned {
            eprintln!("learned: loss {:.4} on {} tokens", l.loss, l.positions);
            if let Some(settled) = l.settled {
                print_settled(settled, &leader, started);
            } else {
                eprintln!(
                    "gradient kept for the next update ({} of {} requests)",
                    teacher.pending(),
                    leader.manifest.learning.accumulate
                );
            }
        }
        last = Some(leader);
    }
    // What is still accumulated goes out now rather than being lost with the process.
    if let (Some(teacher), Some(leader)) = (teacher.as_mut(), last.as_mut()) {
        let started = std::time::Instant::now();
        if let Some(p) = teacher.flush()? {
            let settled = leader.settle(teacher, p).await;
            print_settled(settled, leader, started);
        }
    }
    Ok(())
}

/// One request on a group formed for it: the leader, the generated and the prompt tokens.
async fn run_once_on_mesh(
    args: &mut GenerateArgs,
    bootstrap: &libp2p::Multiaddr,
) -> Result<(Leader, Vec<u32>, Vec<u32>)> {
    let mut attempt = 0;
    let (leader, out, prompt) = loop {
        attempt += 1;
        let mut opts = node_native::lead::remote::GroupOptions::new(args.check, args.spares);
        opts.trace = args
            .trace_steps
            .as_deref()
            .map(node_native::lead::steplog::StepLog::create)
            .transpose()?;
        opts.group.project = !args.check_answers;
        let mut leader = Leader::connect_with(bootstrap.clone(), &opts).await?;
        leader.archive.clone_from(&args.keep_published);
        leader
            .group
            .transport_mut()
            .set_context(format!("request {attempt}"));
        let g = &leader.manifest.generator;
        eprintln!(
            "mesh {}: k = {}, n = {}, {} live rows; group {:?} (first k decode, condition number {:.2})",
            leader.manifest.name,
            g.k(),
            g.n(),
            leader.live_rows,
            leader.group.nodes(),
            leader.condition_number
        );
        (args.k, args.n) = (g.k(), g.n());
        let (prompt, opts, mut printer) = Printer::start(&leader.tokenizer, args)?;
        let generated = if args.hop {
            let rt = tokio::runtime::Handle::current();
            let mut hop = node_native::lead::hop::lead_group(&leader, &rt, args.check)?;
            eprintln!("one hop per stage, members {:?}", hop.rows());
            let forward = async |pass: Pass<'_>| hop.forward(pass).await;
            let on = &mut |id| printer.token(id);
            let out = generate_async(forward, &leader.manifest.cfg, &prompt, &opts, on).await;
            let s = hop.stats();
            eprintln!(
                "one hop per stage: the members check every round among themselves; this leader checked {} LM head rounds ({} unchecked), members at the end {:?}",
                s.verified_rounds,
                s.unverified_rounds,
                hop.rows()
            );
            for c in &s.caught {
                eprintln!("{c}");
            }
            out
        } else {
            let on = &mut |id| printer.token(id);
            generate_on(&leader.llama, &mut leader.group, &prompt, &opts, on).await
        };
        let emitted = printer.end();
        match generated {
            Ok(out) => break (leader, out, prompt),
            // The mesh took an update between the group's forming and its first step: form
            // the group again at the new version (nothing was printed yet).
            Err(_)
                if emitted == 0
                    && attempt < 3
                    && leader.group.transport().met_another_version() =>
            {
                eprintln!(
                    "the mesh moved to a new version as the request started; forming the group again"
                );
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            Err(e) => return Err(e.into()),
        }
    };
    if args.hop {
        print_speed(&out, " (one hop per stage)");
        return Ok((leader, out.tokens, prompt));
    }
    let compute = leader.group.transport().stats().compute;
    print_coded_stats(args, &out, leader.group.stats(), Some(compute));
    let s = leader.group.stats();
    eprintln!(
        "verified: {} rounds checked ({} by projection), {} unchecked, {} answers checked that came late; honest noise at {:.3} of the threshold (answers {:.3}, projections {:.3})",
        s.verified_rounds,
        s.projected_rounds,
        s.unverified_rounds,
        s.late_checked,
        s.max_pass_ratio.max(s.max_projected_ratio),
        s.max_pass_ratio,
        s.max_projected_ratio
    );
    if let Some(p) = leader.group.probe() {
        eprintln!(
            "update probe: {} rounds fitted against {} learning updates of the version; largest fit of a member not caught {:.1} σ",
            s.probed_rounds,
            p.len(),
            s.max_probe_sigmas
        );
    }
    for c in &s.caught {
        eprintln!("{c}");
    }
    eprintln!("members at the end: {:?}", leader.group.nodes());
    if !leader.group.stats().caught.is_empty() {
        let told = leader.report_caught().await;
        eprintln!("reported to {told} nodes");
    }
    Ok((leader, out.tokens, prompt))
}

/// Says what became of an update that fell due: who took it, or why it was not published.
fn print_settled(
    settled: node_native::lead::remote::Settled<node_native::lead::remote::Sent>,
    leader: &Leader,
    started: std::time::Instant,
) {
    use node_native::lead::remote::Settled;
    match settled {
        Settled::Published { sent, .. } => eprintln!(
            "update {:016x}: {} requests, {} bytes, {:.1}% of the gradient's energy kept, taken by {} of {} nodes ({:.2} s)",
            sent.id,
            sent.requests,
            sent.bytes,
            100.0 * sent.kept,
            sent.applied_by,
            leader.holders.len(),
            started.elapsed().as_secs_f64()
        ),
        Settled::Refused(why, _) => eprintln!("update not published: {why}"),
        Settled::Unjudged(why) => {
            eprintln!("update not published: the gate could not judge it: {why}")
        }
        Settled::Lost(why) => eprintln!("update not published: {why}"),
    }
}

/// `status`: the mesh as the bootstrap node sees it.
fn run_status(args: StatusArgs) -> Result<()> {
    let rt = runtime()?;
    let info = rt.block_on(async {
        let session = Session::connect(args.bootstrap.clone()).await?;
        session.info().await
    })?;
    if args.json {
        println!("{}", serde_json::to_string(&info)?);
        return Ok(());
    }
    println!(
        "model {} ({}), k = {}, n = {} rows (room for {})",
        info.model_name,
        &info.model[..16],
        info.k,
        info.n,
        info.n_max.max(info.n)
    );
    println!(
        "{:<54} {:>4} {:<8} {:>8} {:<16} {:>4} {:>7}",
        "peer", "row", "health", "updates", "version", "lag", "silent"
    );
    for n in &info.nodes {
        println!(
            "{:<54} {:>4} {:<8} {:>8} {:<16} {:>4} {:>6.1}s",
            n.peer,
            n.row.map_or("-".into(), |r| r.to_string()),
            n.health.to_string(),
            n.version_count,
            &n.version_digest[..n.version_digest.len().min(16)],
            n.lag,
            n.silent_for_s
        );
    }
    println!("rows × holders (healthy/known):");
    for r in &info.rows {
        println!(
            "  row {:>3}: {}/{} {}",
            r.row,
            r.healthy,
            r.holders.len(),
            r.holders
                .iter()
                .map(|p| short_peer(p))
                .collect::<Vec<_>>()
                .join(" ")
        );
    }
    for n in info.nodes.iter() {
        if let Some(c) = &n.caught {
            println!(
                "CAUGHT {}: {c} (left out of groups; its row is free to re-create)",
                n.peer
            );
        }
    }
    println!("{}", info.summary());
    if let Some(url) = &info.dashboard {
        println!("dashboard: {url}");
    }
    Ok(())
}

/// The last characters of a peer id, enough to tell peers apart in a table.
fn short_peer(peer: &str) -> &str {
    peer.char_indices()
        .rev()
        .nth(7)
        .map_or(peer, |(i, _)| &peer[i..])
}

/// `eval`: perplexity of the mesh's model on held-out text.
async fn run_eval(args: EvalArgs) -> Result<()> {
    let text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("reading {}", args.file.display()))?;
    let mut leader = Leader::connect(args.bootstrap.clone(), 1, 1).await?;
    let chunk = args.chunk.clamp(2, leader.manifest.cfg.max_seq);
    let tokens = leader.tokenizer.encode(&text)?;
    let chunks: Vec<&[u32]> = tokens
        .chunks_exact(chunk)
        .take(args.max_chunks.max(1))
        .collect();
    if chunks.is_empty() {
        bail!("{} has fewer than {chunk} tokens", args.file.display());
    }
    let mut total = 0.0;
    for c in &chunks {
        total += leader.llama.sequence_loss(&mut leader.group, c).await?;
    }
    let loss = total / chunks.len() as f64;
    println!(
        "perplexity {:.3} (mean loss {:.4} nats/token over {} chunks of {chunk} tokens; mesh version {})",
        loss.exp(),
        loss,
        chunks.len(),
        node_core::mesh::hex(&leader.version[..8])
    );
    Ok(())
}
