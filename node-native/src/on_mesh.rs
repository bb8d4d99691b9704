//! Leading requests on a mesh from the command line: `generate --bootstrap` (a completion, then
//! the request's learning) and `eval` (perplexity through a group), each async under one
//! runtime at the binary's edge.

use anyhow::{Context, Result, bail};
use node_core::lead::generate_regrouping;
use node_core::learn::{Learner, Teacher};
use node_native::lead::leader::Leader;

use crate::cli::{EvalArgs, GenerateArgs};
use crate::generate::{Printer, print_coded_stats, print_speed};

/// `generate --bootstrap`: a leader on the mesh; with `--repeat`, the same request again on a
/// fresh group each time, learning after each (unless `--no-learning`).
pub(crate) async fn run_generate_mesh(
    args: GenerateArgs,
    bootstrap: libp2p::Multiaddr,
) -> Result<()> {
    if args.device != node_core::compute::gpu::DeviceChoice::Cpu {
        bail!(
            "--device runs a generation in this process; on a mesh each node chooses its own (codedmesh node --device gpu|auto)"
        );
    }
    let mut args = args;
    // One identity for every request of this process: a file's, or a fresh one.
    let key = match &args.identity {
        Some(path) => node_native::hold::trust::key_file(path)?,
        None => libp2p::identity::Keypair::generate_ed25519(),
    };
    let cert = match &args.cert {
        Some(path) => Some(
            node_native::hold::trust::read_cert(path)?
                .with_context(|| format!("{} holds no certificate", path.display()))?,
        ),
        None => None,
    };
    let mut teacher: Option<Teacher> = None;
    let mut last = None;
    for i in 0..args.repeat.max(1) {
        if args.repeat > 1 {
            eprintln!("request {} of {}", i + 1, args.repeat);
        }
        let began = std::time::Instant::now();
        let (mut leader, out, prompt) =
            run_once_on_mesh(&mut args, &bootstrap, &key, cert.as_ref()).await?;
        let latency = began.elapsed();
        if args.no_learning {
            let usage = node_core::mesh::Usage::of_request(prompt.len(), out.len(), latency, None);
            if let Err(e) = leader.report_served(usage).await {
                tracing::warn!("the request was not counted in the mesh's usage: {e:#}");
            }
            continue;
        }
        let teacher = match &mut teacher {
            Some(t) => t,
            None => {
                let m = &leader.manifest;
                let gate = if args.no_canary_gate {
                    None
                } else {
                    let canary = node_core::learn::canary_tokens(&leader.tokenizer)?;
                    Some(node_core::learn::CanaryGate::new(canary, m.canary_loss))
                };
                let learner = Learner::new(m.learning, m.cfg.clone(), m.format);
                teacher.insert(Teacher::new(learner, gate, m.format).for_mesh(&leader.tokenizer)?)
            }
        };
        let started = std::time::Instant::now();
        let caught_before = leader.formed.group.stats().caught.len();
        let learned = leader.learn(&prompt, teacher).await?;
        // Members caught in learning's rounds (a backward lie shows only there).
        let caught = &leader.formed.group.stats().caught[caught_before..];
        for c in caught {
            eprintln!("{c}");
        }
        if !caught.is_empty() {
            let told = leader.report_caught().await;
            eprintln!("reported to {told} nodes, who pass it on");
        }
        let usage = node_core::mesh::Usage::of_request(
            prompt.len(),
            out.len(),
            latency,
            learned
                .as_ref()
                .filter(|l| l.taught_by.is_none())
                .map(|l| l.loss),
        );
        if let Err(e) = leader.report_served(usage).await {
            tracing::warn!("the request was not counted in the mesh's usage: {e:#}");
        }
        if let Some(l) = learned {
            if let Some(to) = l.taught_by {
                eprintln!(
                    "taught: this leader is not admitted to write the model, so {} tokens of the request went to {to}, whose trainer trains on them under its budget and gate",
                    l.positions
                );
                last = Some(leader);
                continue;
            }
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
    key: &libp2p::identity::Keypair,
    cert: Option<&node_core::learn::Certificate>,
) -> Result<(Leader, Vec<u32>, Vec<u32>)> {
    let group = args.group.options(false);
    let mut opts = node_native::lead::remote::GroupOptions::new(group.verify, group.spares);
    opts.trace = args
        .trace_steps
        .as_deref()
        .map(node_native::lead::steplog::StepLog::create)
        .transpose()?;
    opts.group.project = group.project;
    let mut leader =
        Leader::connect_as(bootstrap.clone(), &opts, key.clone(), cert.cloned()).await?;
    leader.archive.clone_from(&args.keep_published);
    leader
        .formed
        .group
        .transport_mut()
        .set_context("request".into());
    let g = &leader.manifest.generator;
    eprintln!(
        "mesh {}: k = {}, n = {}, {} live rows; group {:?} (first k decode, condition number {:.2})",
        leader.manifest.name,
        g.k(),
        g.n(),
        leader.formed.live_rows,
        leader.formed.group.nodes(),
        leader.formed.condition_number
    );
    (args.k, args.n) = (g.k(), g.n());
    // The printer reads its own copy: the group may be formed again while it prints.
    let tokenizer = leader.tokenizer.clone();
    let (prompt, opts, mut printer) = Printer::start(&tokenizer, args)?;
    leader.set_pass(args.pass);
    let on = &mut |id| printer.token(id);
    // Each pass goes over rounds or one hop per stage as the leader's rules route it; one that
    // fails (members died beyond the spares, the mesh moved on) runs again on a group formed
    // anew.
    let out = generate_regrouping(&mut leader, &prompt, &opts, on).await;
    let hop = leader.hop.is_some();
    if let Some(hop) = &leader.hop {
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
    }
    printer.end();
    let out = out?;
    if hop {
        print_speed(&out, " (one hop per stage)");
        return Ok((leader, out.tokens, prompt));
    }
    let compute = leader.formed.group.transport().stats().compute;
    print_coded_stats(args, &out, leader.formed.group.stats(), Some(compute));
    let s = leader.formed.group.stats();
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
    if let Some(p) = leader.formed.group.probe() {
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
    eprintln!("members at the end: {:?}", leader.formed.group.nodes());
    if !leader.formed.group.stats().caught.is_empty() {
        let told = leader.report_caught().await;
        eprintln!("reported to {told} nodes, who pass it on");
    }
    Ok((leader, out.tokens, prompt))
}

/// Says what became of an update that fell due: who took it, or why it was not published.
fn print_settled(
    settled: node_core::lead::Settled<node_core::lead::Sent>,
    leader: &Leader,
    started: std::time::Instant,
) {
    use node_core::lead::Settled;
    match settled {
        Settled::Published { sent, .. } => eprintln!(
            "update {:016x}: {} requests, {} bytes, {:.1}% of the gradient's energy kept, told {} of {} nodes, who spread it to the rest ({:.2} s)",
            sent.id,
            sent.requests,
            sent.bytes,
            100.0 * sent.kept,
            sent.told,
            leader.formed.holders.len(),
            started.elapsed().as_secs_f64()
        ),
        Settled::Refused(why, _) => eprintln!("update not published: {why}"),
        Settled::Unjudged(why) => {
            eprintln!("update not published: the gate could not judge it: {why}")
        }
        Settled::Lost(why) => eprintln!("update not published: {why}"),
    }
}

/// `eval`: perplexity of the mesh's model on held-out text.
pub(crate) async fn run_eval(args: EvalArgs) -> Result<()> {
    let text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("reading {}", args.file.display()))?;
    let mut leader = Leader::connect(args.bootstrap.clone(), 1, 1).await?;
    let tokens = leader.tokenizer.encode(&text)?;
    // A text shorter than a chunk is one chunk of its own length.
    let chunk = args
        .chunk
        .clamp(2, leader.manifest.cfg.max_seq)
        .min(tokens.len().max(2));
    let chunks: Vec<&[u32]> = tokens
        .chunks_exact(chunk)
        .take(args.max_chunks.max(1))
        .collect();
    if chunks.is_empty() {
        bail!("{} has fewer than {chunk} tokens", args.file.display());
    }
    let mut total = 0.0;
    for c in &chunks {
        total += leader
            .formed
            .llama
            .sequence_loss(&mut leader.formed.group, c)
            .await?;
    }
    let loss = total / chunks.len() as f64;
    println!(
        "perplexity {:.3} (mean loss {:.4} nats/token over {} chunks of {chunk} tokens; mesh version {})",
        loss.exp(),
        loss,
        chunks.len(),
        node_core::mesh::hex(&leader.formed.version[..8])
    );
    Ok(())
}
