//! `bench --mesh`: a mesh of processes on this machine, its tokens/s in rounds and by hop, over
//! loopback and with a one-way delay, through the API's stream, and what its processes' CPU cost.

use super::*;

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
pub(super) const DELAY_TOKENS: usize = 16;

/// A mesh of `codedmesh` processes on this machine (seed + n − 1 nodes) for each delay: at 0,
/// the loopback rows (the same generation as the in-process rows; time split into compute,
/// network, decode) and the API's streams, each after a decode in this process on the same
/// rows (`again`); at every delay, ms per token against the floor the delay sets, a token a
/// pass and with drafts.
pub fn mesh_rows(b: &MeshBench<'_>, again: &mut InProcessDecode) -> Result<Vec<Row>> {
    let mut rows = Vec::new();
    // The bench's own leader, a process that computes no row, polls its sessions where each
    // of the k + 1 processes of its streams has a core (the nodes poll as `up`'s).
    if let Some(spin) = crate::up::supervise::mesh_spin(b.k + 1) {
        crate::hold::session::local::set_spin(Some(spin));
    }
    for &ms in b.delays {
        let delay = Duration::from_secs_f64(ms.max(0.0) / 1e3);
        // The leader's swarm holds back what it sends as the nodes' do.
        crate::net::swarm::set_one_way_delay(delay);
        let dir = std::env::temp_dir().join(format!("codedmesh-bench-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut mesh =
            crate::bench::localmesh::LocalMesh::start(b.model, (b.k, b.n), &b.group, &dir, delay)?;
        mesh.wait_serving(&dir, Duration::from_secs(300))?;
        let rt = crate::lead::remote::leader_runtime()?;
        let bootstrap: libp2p::Multiaddr = mesh.bootstrap.parse()?;
        // Heartbeats need a moment to reach the seed before it reports every row.
        let mut leader = None;
        let mut last = format!("fewer than {} live rows", b.n);
        let opts = crate::lead::remote::GroupOptions {
            group: b.group.clone(),
            trace: None,
        };
        for _ in 0..50 {
            // Until every heartbeat has reached the seed, it may not even see k rows.
            let connected = crate::lead::leader::Leader::connect_with(bootstrap.clone(), &opts);
            match rt.block_on(connected) {
                Ok(l) if l.formed.live_rows == b.n => {
                    leader = Some(l);
                    break;
                }
                Ok(l) => last = format!("{} live rows", l.formed.live_rows),
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
        let model = crate::serve::api::model_id(&leader.manifest);
        if ms == 0.0 {
            rows.extend(loopback_rows(&mut leader, &rt, &mesh, b)?);
            rows.push(group_row(b));
            rows.extend(api_rows(&rt, &mut mesh, &model, b, again)?);
        }
        let (delayed, hop_ms) = delay_rows(&mut leader, &rt, b.summary, ms, &b.group)?;
        rows.extend(delayed);
        if ms > 0.0 {
            rows.extend(api_delay_rows(
                &rt, &mut mesh, &model, b.summary, ms, hop_ms,
            )?);
        }
        drop(leader);
        drop(mesh);
        let _ = std::fs::remove_dir_all(&dir);
    }
    crate::net::swarm::set_one_way_delay(Duration::ZERO);
    Ok(rows)
}

/// One generation of `prompt` through `leader`'s rounds, the bench waiting for it.
fn run_on(
    leader: &mut crate::lead::leader::Leader,
    runtime: &tokio::runtime::Runtime,
    prompt: &[u32],
    opts: &GenerateOptions,
) -> Result<node_core::model::Generation, node_core::model::ModelError> {
    let (llama, group) = (&leader.formed.llama, &mut leader.formed.group);
    runtime.block_on(node_core::lead::generate_on(
        llama,
        group,
        prompt,
        opts,
        &mut |_| true,
    ))
}

/// At a one-way delay of `ms`: ms per token, hops per token and the floor they set, a token a
/// pass and with drafts of the default length, with the leader's rounds (two hops a round) and
/// with one hop per stage (checked and spared as `group`, as the API's); and the ms a token of
/// hops with drafts.
pub(super) fn delay_rows(
    leader: &mut crate::lead::leader::Leader,
    runtime: &tokio::runtime::Runtime,
    prompt: &[u32],
    ms: f64,
    group: &node_core::lead::GroupOptions,
) -> Result<(Vec<Row>, f64)> {
    let mut rows = Vec::new();
    let plain = GenerateOptions {
        max_tokens: DELAY_TOKENS,
        sampling: Default::default(),
        stop_ids: Vec::new(),
        draft: 0,
    };
    // Forms the group and opens every connection.
    run_on(
        leader,
        runtime,
        prompt,
        &GenerateOptions {
            max_tokens: 2,
            ..plain.clone()
        },
    )?;
    let draft = node_core::model::speculate::DEFAULT_DRAFT;
    let mut first: Option<Vec<u32>> = None;
    for (what, draft) in [("a token a pass", 0), ("drafts of up to 4", draft)] {
        leader.formed.group.reset_stats();
        let opts = GenerateOptions {
            draft,
            ..plain.clone()
        };
        let run = run_on(leader, runtime, prompt, &opts)?;
        let passes = run.forward_passes.max(1) as u64;
        let per_pass = leader.formed.group.stats().rounds as f64 / passes as f64;
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
    let (check, spares) = (group.verify, group.spares);
    let (client, manifest, formed) = (&leader.session.client, &leader.manifest, &leader.formed);
    let handle = runtime.handle();
    let (mut hop, _) =
        crate::lead::hop::lead_group(handle, client, manifest, formed, check, spares, false)?;
    let cfg = leader.formed.llama.config().clone();
    // A pass is the feed, the embedding lookup, four stages a layer and the LM head: a hop each.
    let hops_per_pass = (4 * cfg.layers + 3) as f64;
    let mut hop_ms = 0.0;
    for (what, draft) in [("a token a pass", 0), ("drafts of up to 4", draft)] {
        let opts = GenerateOptions {
            draft,
            ..plain.clone()
        };
        let forward = async |pass: Pass<'_>| hop.forward(pass).await;
        let run = runtime.block_on(generate_async(forward, &cfg, prompt, &opts, &mut |_| true))?;
        let decode_tokens = run.tokens.len().saturating_sub(1).max(1) as f64;
        let hops = hops_per_pass * run.forward_passes.saturating_sub(1) as f64 / decode_tokens;
        hop_ms = 1e3 / run.decode_tokens_per_s();
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
    Ok((rows, hop_ms))
}

/// At a one-way delay of `ms`: a stream through the seed's API (its node leads, computes its own
/// row and chooses rounds or hops as `up`'s does), the delay rows' prompt and tokens, against
/// `hop_ms`, one hop per stage with drafts from a leader of its own.
pub(super) fn api_delay_rows(
    runtime: &tokio::runtime::Runtime,
    mesh: &mut crate::bench::localmesh::LocalMesh,
    model: &str,
    prompt: &[u32],
    ms: f64,
    hop_ms: f64,
) -> Result<Vec<Row>> {
    use crate::bench::apistream::stream_completion;
    let addr = mesh.api(Duration::from_secs(60))?;
    // The first stream forms the API node's group, whose rounds measure the network.
    runtime.block_on(stream_completion(addr, model, prompt, 4))?;
    let run = runtime.block_on(stream_completion(addr, model, prompt, DELAY_TOKENS))?;
    let api_ms = 1e3 / run.decode_tokens_per_s().max(1e-9);
    Ok(vec![row(
        format!(
            "one-way delay {ms} ms, summary, one stream through the seed's OpenAI API (drafts of up to {})",
            node_core::model::speculate::DEFAULT_DRAFT
        ),
        format!(
            "{api_ms:.0} ms/token ({} tokens), {:.2}× one hop per stage with drafts ({hop_ms:.0} ms/token)",
            run.tokens,
            api_ms / hop_ms.max(1e-9)
        ),
    )])
}

/// The loopback rows: prefill, decode, drafts, rounds, bytes, the time split and the CPU each
/// process spent a round.
pub(super) fn loopback_rows(
    leader: &mut crate::lead::leader::Leader,
    runtime: &tokio::runtime::Runtime,
    mesh: &crate::bench::localmesh::LocalMesh,
    b: &MeshBench<'_>,
) -> Result<Vec<Row>> {
    let (prompt, tokens) = (b.prompt, b.tokens);
    let opts = GenerateOptions {
        max_tokens: tokens,
        sampling: Default::default(),
        stop_ids: Vec::new(),
        draft: 0,
    };
    run_on(leader, runtime, prompt, &opts)?;
    leader.formed.group.reset_stats();
    let compute_before = leader.formed.group.transport().stats().compute;
    let pids: Vec<u32> = std::iter::once(std::process::id())
        .chain(mesh.pids())
        .collect();
    let cpu_before: Option<Vec<Duration>> = pids.iter().map(|&p| process_cpu(p)).collect();
    let run = run_on(leader, runtime, prompt, &opts)?;
    let cpu_after: Option<Vec<Duration>> = pids.iter().map(|&p| process_cpu(p)).collect();
    let stats = leader.formed.group.stats().clone();
    let compute = leader.formed.group.transport().stats().compute - compute_before;
    let draft = node_core::model::speculate::DEFAULT_DRAFT;
    let drafted = run_on(leader, runtime, prompt, &GenerateOptions { draft, ..opts })?;
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
            format!("{label}: decode with drafts of up to {draft} (prompt lookup)"),
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
pub(super) const API_STREAMS: usize = 3;

/// Streams through the OpenAI API of the mesh's seed, whose node leads them and computes its
/// own row as `up`'s API node does: a stream as a user of `up` gets it, decode after the first
/// token set against in-process coded decode on the same shards (issue 23's goal), measured
/// just before each stream (`again`): on two cores the machine's speed drifts by a third
/// between minutes, and a figure measured minutes earlier set the ratio as much as the API.
pub(super) fn api_rows(
    runtime: &tokio::runtime::Runtime,
    mesh: &mut crate::bench::localmesh::LocalMesh,
    model: &str,
    b: &MeshBench<'_>,
    again: &mut InProcessDecode,
) -> Result<Vec<Row>> {
    use crate::bench::apistream::{Streamed, stream_completion};
    let addr = mesh.api(Duration::from_secs(60))?;
    // The first stream forms the API node's group and opens its sessions.
    runtime.block_on(stream_completion(addr, model, b.prompt, 4))?;
    let (mut here, mut runs) = (Vec::new(), Vec::new());
    for _ in 0..API_STREAMS {
        here.push(again.decode()?);
        runs.push(runtime.block_on(stream_completion(addr, model, b.prompt, b.tokens))?);
    }
    let decode: Vec<f64> = runs.iter().map(Streamed::decode_tokens_per_s).collect();
    let first: Vec<f64> = runs.iter().map(|r| r.first.as_secs_f64() * 1e3).collect();
    let ratios: Vec<f64> = decode
        .iter()
        .zip(&here)
        .map(|(api, here)| api / here.max(1e-9))
        .collect();
    let list = |v: &[f64], digits: usize| {
        v.iter()
            .map(|x| format!("{x:.digits$}"))
            .collect::<Vec<_>>()
            .join(" / ")
    };
    let label = &mesh_label(b);
    let best = decode.iter().copied().fold(0.0, f64::max);
    let against = here.iter().copied().fold(0.0, f64::max).max(1e-9);
    Ok(vec![
        row(
            format!(
                "{label}: one stream through the seed's OpenAI API (its node leads and computes its own row, as up's API node; drafts of up to {})",
                node_core::model::speculate::DEFAULT_DRAFT
            ),
            format!(
                "{best:.1} tok/s decode after the first token, best of {API_STREAMS} ({}; {} tokens each), first token {:.0} ms (median)",
                list(&decode, 1),
                runs.iter().map(|r| r.tokens).max().unwrap_or(0),
                median(&first)
            ),
        ),
        row(
            format!(
                "{label}: a stream through the API against in-process coded decode on the same k of n q8 rows, each measured just before its stream"
            ),
            format!(
                "{:.2}× best against best ({best:.1} against {against:.1} tok/s); stream by stream {}× (in-process {}), median {:.2}×",
                best / against,
                list(&ratios, 2),
                list(&here, 1),
                median(&ratios)
            ),
        ),
    ])
}

/// The rows' name for the bench's mesh: `5 processes over loopback, coded k=3`.
pub(super) fn mesh_label(b: &MeshBench<'_>) -> String {
    format!("{} processes over loopback, coded k={}", b.n, b.k)
}

/// How the bench's leader checks its rounds and how many spares it asks.
pub(super) fn group_row(b: &MeshBench<'_>) -> Row {
    let group = &b.group;
    let how = match (group.verify, group.project) {
        (0, _) => "no check",
        (1, true) => "check 1, against the check row's secret projections",
        _ => "checked answers",
    };
    let sessions = match crate::hold::session::local::spin() {
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
pub(super) fn cpu_row(
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
    let cores = crate::up::supervise::cores();
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
pub(super) fn process_cpu(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the command's closing parenthesis; utime and stime are 14th and 15th.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(Duration::from_secs_f64(ticks as f64 / clock_ticks()))
}

/// CPU time process `pid` has used, where the platform tells (not here).
#[cfg(not(target_os = "linux"))]
pub(super) fn process_cpu(_pid: u32) -> Option<Duration> {
    None
}

/// Clock ticks a second, the unit of `/proc/PID/stat`'s times.
#[cfg(target_os = "linux")]
pub(super) fn clock_ticks() -> f64 {
    match nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK) {
        Ok(Some(t)) if t > 0 => t as f64,
        _ => 100.0,
    }
}
