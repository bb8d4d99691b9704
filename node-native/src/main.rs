//! `codedmesh`: the Coded Mesh command line.

use std::path::PathBuf;

use anyhow::Result;
use clap::Parser;
use node_core::compute::gpu::Gpu;
use node_core::model::ModelWeights;
use node_native::lead::remote::Session;
use node_native::{fetch, load, node};
use tracing_subscriber::EnvFilter;

mod cli;
mod generate;
mod on_mesh;

use cli::{BenchArgs, Cli, Command, StatusArgs, UpArgs};

/// The allocator: the rounds allocate and free a few buffers each (docs/perf-history.md, "An allocator
/// for the rounds").
#[cfg(not(feature = "system-alloc"))]
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
                .and_then(|rt| rt.block_on(on_mesh::run_generate_mesh(args, b))),
            None => generate::run_generate(args),
        },
        Command::Seed(args) => runtime().and_then(|rt| {
            let opts = args.net.options(None)?;
            let model = model_path(&args.model)?;
            let defaults = args.optimizer.learning(args.lr);
            let learning = args.diloco.apply(node_core::mesh::LearningConfig {
                enabled: !args.no_learning,
                clip: args.clip,
                rank: args.rank.unwrap_or(defaults.rank),
                accumulate: args.accumulate,
                momentum: args.momentum,
                ..defaults
            });
            let shape = node::Shape {
                k: args.k,
                n: args.n,
                max_rows: args.max_rows,
                format: cli::mesh_format(args.shard_format, args.k, args.n),
            };
            rt.block_on(node::seed(
                opts,
                model,
                shape,
                learning,
                !args.no_canary_gate,
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
        Command::Admit(args) => run_admit(&args),
        Command::Status(args) => run_status(args),
        Command::Eval(args) => node_native::lead::remote::leader_runtime()
            .map_err(anyhow::Error::from)
            .and_then(|rt| rt.block_on(on_mesh::run_eval(args))),
        Command::Bench(args) => run_bench(args),
        Command::FetchModel => fetch::default_model().map(|p| println!("{}", p.display())),
        Command::Reach(args) => runtime().and_then(|rt| rt.block_on(run_reach(args))),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// `codedmesh reach`.
async fn run_reach(args: cli::ReachArgs) -> Result<()> {
    let wait = std::time::Duration::from_secs(args.wait_s);
    let reached = node_native::net::probe::reach(args.addr, args.listen, wait).await?;
    if args.json {
        println!("{}", serde_json::to_string(&reached)?);
    } else {
        println!("{}: {} ({} ms)", reached.peer, reached.path, reached.ms);
    }
    Ok(())
}

/// `codedmesh up`.
async fn run_up(args: UpArgs) -> Result<()> {
    let mut node_args = args.serve.node_args(true);
    if let Some(ms) = args.dead_ms {
        node_args.extend(["--dead-ms".into(), ms.to_string().into()]);
    }
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
        api_key: args.serve.api_key,
        api_keys: args.serve.api_keys,
        no_learning: args.no_learning,
        learning: args
            .diloco
            .apply(node_core::mesh::LearningConfig::default()),
        format: cli::mesh_format(args.shard_format, k, nodes),
        shape_chosen: args.k.is_some() || args.nodes.is_some() || args.shard_format.is_some(),
        trace_steps: args.serve.trace_steps,
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
    let trainer = node_native::bench::learning::Trainer {
        gated: !args.no_gate,
        rehearse: args.rehearse,
        distil: args.distil,
        floor: args.floor,
        trained: cli::TrainedArg::trained(&args.train),
        replay: args.replay,
        decay: args.decay,
        anneal: args.anneal,
        consensus: args.consensus,
        gate_window: args.gate_window,
    };
    let (optimizer, lr) = args.optimizer.with_lr(args.lr);
    let learning = args.diloco.apply(args.optimizer.learning(args.lr));
    learning.validate()?;
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
    if args.mixed > 0 {
        use node_native::bench::mixed;
        let run = mixed::MixedRun {
            chats: args.mixed,
            clients: args.clients,
            per_round: args.per_round,
            checkpoint_every: args.checkpoint_every,
            seed: args.seed,
        };
        let taught = mixed::teach_mixed(
            &model.weights,
            &model.tokenizer,
            format,
            (n, k),
            learning,
            run,
            trainer,
            |c| {
                eprintln!(
                    "{} chats: {} published / {} refused, held-out {:.4} nats, canary {:.4}, \
                     fact {} (margin {:+.3}, lead {:+.2}), {} dropped, {} waiting, {:.0} s training",
                    c.chats,
                    c.published,
                    c.refused,
                    c.held_out,
                    c.canary,
                    if c.answered {
                        "answered"
                    } else {
                        "not answered"
                    },
                    c.margin,
                    c.lead,
                    c.dropped,
                    c.waiting,
                    c.seconds
                )
            },
        )?;
        print!("{}", mixed::curve_table(&taught));
        println!();
        rows.extend(mixed::mixed_rows(&taught));
        node_native::bench::print_table(&rows);
        return Ok(());
    }
    if args.facts > 0 {
        use node_native::bench::facts;
        let taught = facts::teach_facts(
            &model.weights,
            &model.tokenizer,
            format,
            (n, k),
            learning,
            &facts::facts(args.facts)?,
            (args.chats_per_fact, args.per_round),
            trainer,
            log("round"),
        )?;
        rows.extend(facts::facts_rows(&taught, args.chats_per_fact));
        node_native::bench::print_table(&rows);
        return Ok(());
    }
    let taught = learning::teach_in_process(
        &model.weights,
        &model.tokenizer,
        format,
        (n, k),
        learning,
        learning::TAUGHT,
        args.exposures,
        trainer,
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
            trainer,
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
            cli::mesh_format(args.shard_format, 3, 5),
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
        // The group of the "as the mesh" row, or (for a shape it has none of) one encoded now.
        let mut again = match measured.as_mesh {
            Some(kept) => kept,
            None => node_native::bench::InProcessDecode::new(
                &model.weights,
                &prompt,
                args.tokens,
                (k, n),
            )?,
        };
        drop(model);
        rows.extend(node_native::bench::mesh_rows(
            &node_native::bench::MeshBench {
                model: &path,
                prompt: &prompt,
                summary: &summary,
                tokens: args.tokens,
                delays: &args.one_way_delay_ms,
                group: args.group.options(true),
                k,
                n,
                in_process: measured.coded_decode,
            },
            &mut again,
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
        let cfg = args.shape.config()?;
        let started = std::time::Instant::now();
        let prompt: Vec<u32> = (0..40).map(|i| (i * 997 + 13) % cfg.vocab as u32).collect();
        let weights = ModelWeights::synthetic_parallel(cfg, 1)?;
        eprintln!(
            "random weights, {:.2} B values: {:.1} s",
            weights.parameter_count() as f64 / 1e9,
            started.elapsed().as_secs_f64()
        );
        (weights, prompt)
    } else {
        let model = load::load_model(&model_path(&args.model)?)?;
        let prompt = model.tokenizer.encode(BENCH_TEXT)?;
        (model.weights, prompt)
    };
    rows.extend(node_native::bench::gpu::member_rows(
        &gpu,
        &weights,
        args.tokens,
        copy_bw,
    )?);
    rows.extend(node_native::bench::gpu::model_rows(
        gpu,
        &weights,
        &prompt,
        args.tokens,
        copy_bw,
        args.shape == cli::SyntheticShape::Smollm2 || !args.synthetic,
    )?);
    node_native::bench::print_table(&rows);
    Ok(())
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?)
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
    // The round trip is the answering node's to each (measured, or from the coordinates).
    println!(
        "{:<54} {:>4} {:<8} {:>8} {:<16} {:>4} {:>7} {:>9}  reached",
        "peer", "row", "health", "updates", "version", "lag", "silent", "rtt"
    );
    for n in &info.nodes {
        println!(
            "{:<54} {:>4} {:<8} {:>8} {:<16} {:>4} {:>6.1}s {:>9}  {}",
            n.peer,
            n.row.map_or("-".into(), |r| r.to_string()),
            n.health.to_string(),
            n.version_count,
            &n.version_digest[..n.version_digest.len().min(16)],
            n.lag,
            n.silent_for_s,
            n.rtt_ms
                .filter(|ms| ms.is_finite())
                .map_or("-".into(), |ms| format!("{ms:.1} ms")),
            if n.reach.is_empty() { "-" } else { &n.reach }
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
    println!("{}", info.regions_line());
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

/// `admit`: a certificate, signed by the mesh's key, admitting a peer to write the model.
fn run_admit(args: &cli::AdmitArgs) -> Result<()> {
    use node_core::learn::Power;
    use node_native::hold::trust;
    let mesh = trust::read_key(&args.mesh_key)?;
    let peer = match (&args.peer, &args.identity) {
        (Some(p), _) => *p,
        (None, Some(path)) => trust::key_file(path)?.public().to_peer_id(),
        (None, None) => anyhow::bail!("name the peer to admit: --peer ID or --identity FILE"),
    };
    let powers: &[Power] = if args.write_only {
        &[Power::Write]
    } else {
        &[Power::Write, Power::Report]
    };
    let valid = std::time::Duration::from_secs(args.days.saturating_mul(24 * 3600));
    let cert = trust::admit(&mesh, peer, &args.name, valid, powers)?;
    trust::write_cert(&args.out, &cert)?;
    println!(
        "admitted {peer} as {:?} for {} days ({}): certificate in {}",
        args.name,
        args.days,
        if args.write_only {
            "write"
        } else {
            "write and report"
        },
        args.out.display()
    );
    Ok(())
}
