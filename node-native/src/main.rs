//! `codedmesh`: the Coded Mesh command line.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use node_core::code::{Generator, select_nodes};
use node_core::coded::{CodedGroup, InProcess, ShardFormat};
use node_core::model::{
    ChatMessage, GenerateOptions, LeaderWeights, Llama, SamplingParams, generate,
};
use node_native::{fetch, load, progress};
use tracing_subscriber::EnvFilter;

/// Coded Mesh: a transformer served by Cauchy-coded shards, any k of n nodes.
#[derive(Debug, Parser)]
#[command(name = "codedmesh", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Generate a completion through k coded shards out of n, in this process.
    Generate(GenerateArgs),
    /// Fetch the default model into the cache (if needed) and print its path.
    FetchModel,
    /// Measure kernel bandwidth and model tokens/s, uncoded and coded; print a table.
    Bench(BenchArgs),
}

#[derive(Debug, clap::Args)]
struct BenchArgs {
    /// A GGUF file or a Hugging Face directory; default: SmolLM2-135M-Instruct.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Tokens to generate per measured run.
    #[arg(long, default_value_t = 32)]
    tokens: usize,
}

#[derive(Debug, clap::Args)]
struct GenerateArgs {
    /// The prompt.
    #[arg(long)]
    prompt: String,
    /// Shards needed to compute (k).
    #[arg(long, default_value_t = 3)]
    k: usize,
    /// Shards encoded (n ≥ k).
    #[arg(long, default_value_t = 5)]
    n: usize,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 32)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling mass.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Seed of the sampler.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Wrap the prompt in the model's chat template as a user message.
    #[arg(long)]
    chat: bool,
    /// A GGUF file or a Hugging Face directory; default: SmolLM2-135M-Instruct, fetched once.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Also run the uncoded model and report whether the tokens agree.
    #[arg(long)]
    verify: bool,
    /// Shard storage: f32 (exact to the code's error) or f16 (half the bytes, see docs/perf.md).
    #[arg(long, default_value = "f32")]
    shard_format: ShardFormat,
}

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(args) => run_generate(args),
        Command::Bench(args) => run_bench(args),
        Command::FetchModel => fetch::default_model().map(|p| println!("{}", p.display())),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn model_path(model: &Option<PathBuf>) -> Result<PathBuf> {
    match model {
        Some(p) => Ok(p.clone()),
        None => fetch::default_model(),
    }
}

fn run_bench(args: BenchArgs) -> Result<()> {
    let model = load::load_model(&model_path(&args.model)?)?;
    let text = "The history of the printing press begins in the fifteenth century, when Johannes \
                Gutenberg combined movable metal type, oil-based ink and a screw press into a \
                system that could produce books far faster than scribes.";
    let prompt = model.tokenizer.encode(text)?;
    let rows = node_native::bench::run(&model.weights, &prompt, args.tokens)?;
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
    let generator = Generator::cauchy(args.n, args.k)?;
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

    let text = if args.chat {
        model.tokenizer.chat_prompt(&[ChatMessage {
            role: "user".into(),
            content: args.prompt.clone(),
        }])
    } else {
        args.prompt.clone()
    };
    let prompt = model.tokenizer.encode(&text)?;
    if prompt.is_empty() {
        bail!("the prompt encodes to no tokens");
    }
    let opts = GenerateOptions {
        max_tokens: args.max_tokens,
        sampling: SamplingParams {
            temperature: args.temperature,
            top_p: args.top_p,
            seed: args.seed,
        },
        stop_ids: model.tokenizer.eos_ids().to_vec(),
    };
    let tokenizer = &model.tokenizer;
    let mut ids = Vec::new();
    let mut printed = 0usize;
    let mut stdout = std::io::stdout();
    let out = generate(&llama, &mut group, &prompt, &opts, &mut |id| {
        ids.push(id);
        if let Ok(text) = tokenizer.decode(&ids) {
            // Hold back an incomplete UTF-8 sequence until its last byte arrives.
            if !text.ends_with('\u{FFFD}') && text.len() > printed {
                let _ = write!(stdout, "{}", &text[printed..]);
                let _ = stdout.flush();
                printed = text.len();
            }
        }
        true
    })?;
    println!();
    let stats = group.stats();
    let forward_passes = out.forward_passes as u64;
    eprintln!(
        "prompt {} tokens: prefill {:.1} tok/s; generated {} tokens: decode {:.1} tok/s ({:?})",
        out.prompt_tokens,
        out.prefill_tokens_per_s(),
        out.tokens.len(),
        out.decode_tokens_per_s(),
        out.stop
    );
    let total_tokens = (out.prompt_tokens + out.tokens.len()).max(1) as u64;
    eprintln!(
        "coded: k = {}, n = {}, rounds per forward pass {}, bytes per member per token {} sent + {} received; decode {:.1}% of time",
        args.k,
        args.n,
        stats.rounds / forward_passes.max(1),
        stats.bytes_sent / args.k as u64 / total_tokens,
        stats.bytes_received / args.k as u64 / total_tokens,
        100.0 * stats.decode_time.as_secs_f64()
            / (stats.decode_time + stats.member_time)
                .as_secs_f64()
                .max(1e-9)
    );
    if args.verify {
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
