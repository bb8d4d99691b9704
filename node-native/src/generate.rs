//! `generate` in this process: the model encoded into k of n rows here, a completion printed
//! as it comes, on the CPU or the GPU; and the printing every `generate` shares.

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use node_core::code::{Generator, select_nodes};
use node_core::coded::{CodedGroup, GpuGroup, InProcess, ShardFormat};
use node_core::compute::gpu::Gpu;
use node_core::lead::{generate, generate_with};
use node_core::model::{
    ChatMessage, GenerateOptions, Generation, LeaderWeights, Llama, Pass, SamplingParams, Tokenizer,
};
use node_native::{load, progress};

use crate::cli::GenerateArgs;
use crate::model_path;

pub(crate) fn run_generate(args: GenerateArgs) -> Result<()> {
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
    let format = crate::cli::mesh_format(args.shard_format, args.k, args.n);
    let generator = format.code(args.n, args.k)?;
    let started = std::time::Instant::now();
    let pb = progress::bar(0, "encoding");
    let mesh = InProcess::encode(&model.weights, &generator, format, &|done, total| {
        pb.set_length(total as u64);
        pb.set_position(done as u64);
    })?;
    pb.finish_and_clear();
    let shard_mib = mesh.members().first().map_or(0, |m| m.shards().bytes()) as f64 / 1048576.0;
    eprintln!(
        "encoded {} shards (k = {}, {:?}, {:?}, {:.1} MiB each) in {:.2} s",
        args.n,
        args.k,
        generator.construction(),
        format,
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

pub(crate) fn prompt_ids(tokenizer: &Tokenizer, args: &GenerateArgs) -> Result<Vec<u32>> {
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

pub(crate) fn generate_options(tokenizer: &Tokenizer, args: &GenerateArgs) -> GenerateOptions {
    GenerateOptions {
        max_tokens: args.max_tokens,
        sampling: SamplingParams {
            temperature: args.temperature,
            top_p: args.top_p,
            seed: args.seed,
            ..SamplingParams::default()
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
pub(crate) struct Printer<'a> {
    text: node_core::model::TextStream<'a>,
    emitted: usize,
}

impl<'a> Printer<'a> {
    /// The request `args` make, and a printer for its completion.
    pub(crate) fn start(
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
    pub(crate) fn token(&mut self, id: u32) -> bool {
        self.emitted += 1;
        if let Some(new) = self.text.push(id) {
            let mut stdout = std::io::stdout();
            let _ = write!(stdout, "{new}");
            let _ = stdout.flush();
        }
        true
    }

    /// Ends the completion's line; how many tokens were printed.
    pub(crate) fn end(self) -> usize {
        println!();
        self.emitted
    }
}

/// Prints the prefill and decode speed; `how` notes how the prompt ran.
pub(crate) fn print_speed(out: &Generation, how: &str) {
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
pub(crate) fn print_coded_stats(
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
