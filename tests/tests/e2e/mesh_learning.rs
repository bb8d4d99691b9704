//! Learning across processes: every request trains, nodes are killed and restarted, rows
//! rebuilt, and every row ends on one codeword of the model that applied every update; members
//! that lie in learning's rounds or skip an update are caught.

//! as separate processes, n = 5, k = 3. The small Hugging Face model in testdata keeps most
//! runs fast; one scenario runs the real SmolLM2.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use tests::procs::{HEALTH, Mesh, spawn, tiny_model};

use super::mesh_processes::{honest_noise, mesh_data, restart, start_faulty};

/// The learning line `generate` prints: the loss before the update.
fn learned_loss(err: &str) -> Result<f64> {
    let line = err
        .lines()
        .find(|l| l.starts_with("learned: loss "))
        .with_context(|| format!("no learning line in:\n{err}"))?;
    let v = line["learned: loss ".len()..]
        .split_whitespace()
        .next()
        .context("loss value")?;
    Ok(v.parse()?)
}

/// Bytes under `dir`, recursively, but for the files named in `skip` (a live node's: a file
/// removed while it is listed counts nothing).
fn dir_bytes(dir: &Path, skip: &[&str]) -> Result<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        if skip.iter().any(|s| entry.file_name() == *s) {
            continue;
        }
        let meta = match entry.metadata() {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(e.into()),
        };
        total += if meta.is_dir() {
            dir_bytes(&entry.path(), skip)?
        } else {
            meta.len()
        };
    }
    Ok(total)
}

/// Every file under `dir` with its size.
fn files(dir: &Path) -> Result<Vec<(String, u64)>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            out.extend(files(&path)?);
        } else {
            out.push((path.display().to_string(), std::fs::metadata(&path)?.len()));
        }
    }
    Ok(out)
}

/// What a node keeps beyond its shard blob and the model's manifest: the learning updates
/// it keeps, its version and what the blob holds. (A snapshot being saved, `*.next`, is the
/// new blob written beside the old one for the seconds the save takes, and a manifest or a
/// genesis shard being saved, `*.tmp`, is the same for a write and a rename: not counted.)
/// One walk that skips those names: subtracting their sizes read afterwards raced with a
/// save renaming `shard.blob.next` over `shard.blob`, and counted a whole blob twice.
fn learning_bytes(data: &Path) -> Result<u64> {
    let saving = [
        "shard.blob",
        "manifest.blob",
        "identity.key",
        "webrtc.pem",
        "shard.blob.next",
        "base.bin.next",
        // A fold's payload, written while its blob is encoded from it (then removed).
        "shard.payload.next",
        "shard.tmp",
        "manifest.tmp",
    ];
    dir_bytes(data, &saving)
}

/// Seed arguments of a mesh whose every update goes out at a fast rate, whatever it does to
/// the canary: SGD at 0.05 on compact rows, no gate at genesis.
const FAST_SGD: [&str; 7] = [
    "--optimizer",
    "sgd",
    "--lr",
    "0.05",
    "--shard-format",
    "q8",
    "--no-canary-gate",
];

/// The soak test of issue 24: learning from every request, with nodes killed and restarted
/// throughout — some down only briefly (they replay what their peers keep), some down across
/// many snapshots (they rebuild their row at the mesh's version), one killed in the middle of
/// a request. Every node ends on one version, every shard within the code's error of the
/// codeword of the uncoded model that applied the same updates, and no node's disk grows with
/// the history.

#[test]
fn learning_soak_kills_and_restarts_end_on_one_codeword_in_bounded_disk() -> Result<()> {
    let _machine = crate::machine::share();
    let model = tiny_model();
    // Four hundred updates of one prompt at a fast rate drift the canary far past what the
    // mesh's gate allows (it counts from genesis, across leaders): this soak is about the
    // codeword and the disk, so its mesh runs no gate.
    let mut mesh = Mesh::start(
        "soak",
        Some(&model),
        &["--optimizer", "sgd", "--lr", "0.05", "--no-canary-gate"],
    )?;
    let archive = mesh.dir.0.join("published");
    let keep = archive.display().to_string();
    let scratch = mesh.dir.0.clone();
    let data = |i: usize| mesh_data(&scratch, i);
    let mut restarts = 0;
    let blob = std::fs::metadata(data(0).join("shard.blob"))?.len();
    let prompt = "hello world, this is a test";
    // 400 requests (each a `generate` process: 0.4-0.7 s here): the long absences below
    // cross several snapshots, and the last 100 requests come 300 updates after the first.
    const REQUESTS: usize = 400;
    // (request, node index in `mesh.nodes`, requests it stays down): three long absences
    // (past MAX_SINCE = 32 updates: the peers folded what it missed), four short ones, and one
    // kill in the middle of a request.
    let absences = [
        (30, 0, 45),
        (100, 1, 3),
        (130, 2, 45),
        (200, 3, 2),
        (230, 0, 5),
        (260, 1, 60),
        (340, 2, 1),
    ];
    let mid_request_kill = (360, 3);
    let mut down: Option<(usize, usize)> = None;
    let mut losses = Vec::new();
    let mut noise = Vec::new();
    let mut learning_peak = 0;
    for i in 0..REQUESTS {
        absent(&mut mesh, &absences, i, &mut down, &mut restarts)?;
        let err = if i == mid_request_kill.0 {
            let victim = &mesh.nodes[mid_request_kill.1];
            let mut killed = Ok(());
            let (_, err) = mesh.generate_with(prompt, 6, &["--keep-published", &keep], || {
                killed = victim.kill_until_gone()
            })?;
            killed?;
            restarts += 1;
            mesh.nodes[mid_request_kill.1] = restart(&mesh, mid_request_kill.1, restarts)?;
            mesh.wait_healthy(5)?;
            err
        } else {
            mesh.generate_with(prompt, 6, &["--keep-published", &keep], || {})
                .with_context(|| format!("request {i}"))?
                .1
        };
        losses.push(learned_loss(&err)?);
        noise.push(honest_noise(&err)?);
        if i % 50 == 0 {
            for n in 0..5 {
                learning_peak = learning_peak.max(learning_bytes(&data(n))?);
            }
        }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let (first, last) = (mean(&losses[..5]), mean(&losses[REQUESTS - 5..]));
    assert!(
        last < 0.5 * first,
        "the loss on the repeated prompt should fall: {first:.4} → {last:.4}"
    );
    // The rows stay one codeword: honest answers stay as far inside the residual check's
    // threshold after hundreds of updates as after the first (each update's rounding does not
    // add up).
    let worst = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
    let (early, late) = (worst(&noise[..100]), worst(&noise[REQUESTS - 100..]));
    eprintln!(
        "honest noise: {early:.3} of the threshold over the first 100 requests, {late:.3} over the last 100"
    );
    assert!(
        late < 0.5,
        "after {REQUESTS} updates honest answers reach {late:.3} of the residual threshold"
    );
    // Every node converges on one version holding every update published.
    let published = std::fs::read_dir(&archive)?.count();
    assert_eq!(published, REQUESTS, "one update per request");
    mesh.wait_version(published as u64)?;
    // Snapshots were taken, and the long absences were rebuilt rather than replayed.
    assert!(
        std::iter::once(&mesh.seed)
            .chain(&mesh.nodes)
            .all(|n| n.log().contains("saved a snapshot")),
        "every node folds its updates into snapshots"
    );
    let mut rebuilt = 0;
    for entry in std::fs::read_dir(&scratch)? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "log") {
            rebuilt += std::fs::read_to_string(&path)?
                .matches("rebuilt row")
                .count();
        }
    }
    assert!(
        rebuilt >= 3,
        "the three long absences rebuild their rows ({rebuilt} rebuilds)"
    );
    // Disk: the shard blob does not grow, and what learning keeps beside it stays within 10%
    // of it, whatever the history.
    for n in 0..5 {
        assert_eq!(std::fs::metadata(data(n).join("shard.blob"))?.len(), blob);
        learning_peak = learning_peak.max(learning_bytes(&data(n))?);
    }
    eprintln!(
        "{published} updates; shard blob {blob} bytes; learning state at most {learning_peak} bytes ({:.1}%); {rebuilt} rebuilds",
        100.0 * learning_peak as f64 / blob as f64
    );
    assert!(
        (learning_peak as f64) <= 0.10 * blob as f64,
        "learning keeps {learning_peak} bytes beside a {blob}-byte shard; node 1 holds {:?}",
        files(&data(1))?
    );
    // Stop the mesh and read every node's data dir: each shard, with its kept updates
    // replayed, is the codeword of the uncoded model that applied every published update.
    let dir = mesh.dir.0.clone();
    drop(mesh.nodes);
    drop(mesh.seed);
    let mut reference = node_native::load::load_model(&model)?.weights;
    let (shards, norms, updates) = restore_rows(&dir, &archive, REQUESTS)?;
    for update in &updates {
        update.apply_to_weights(&mut reference)?;
    }
    // The replicated norm gains learnt the same on every node, as on the reference.
    let want = node_core::model::LeaderWeights::from_model(&reference);
    let flat = |n: &node_core::model::LeaderWeights| -> Vec<f32> {
        n.attn_norm
            .iter()
            .chain(&n.ffn_norm)
            .chain([&n.final_norm])
            .flatten()
            .copied()
            .collect()
    };
    for (i, n) in norms.iter().enumerate() {
        let err = flat(n)
            .iter()
            .zip(flat(&want))
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(err < 1e-5, "node {i}: norm gains differ by {err:.2e}");
    }
    assert_ne!(
        flat(&want),
        flat(&node_core::model::LeaderWeights::from_model(
            &node_native::load::load_model(&model)?.weights
        )),
        "the norm gains learnt nothing"
    );
    let g = shards[0].generator.clone();
    let fresh = node_core::coded::InProcess::encode(
        &reference,
        &g,
        node_core::coded::ShardFormat::F32,
        &|_, _| {},
    )?;
    for got in &shards {
        let want = fresh.members().get(got.node).context("row")?;
        let err = shard_diff(got, want.shards());
        eprintln!(
            "row {}: {err:.2e} from the codeword of the uncoded model",
            got.node
        );
        // Each applied update rounds once on the row and once on the reference: the worst
        // case is one f32 ε of the largest value per update (1000 requests at lr 0.05 on one
        // prompt measured 1.1e-5, a tenth of that).
        let rounding = updates.len() as f64 * f64::from(f32::EPSILON);
        assert!(
            err < rounding,
            "row {}: shard differs from the codeword by {err:.2e} (rounding allows {rounding:.2e})",
            got.node
        );
    }
    Ok(())
}

/// Learning on compact shards across restarts: one node down past the peers' folds (it
/// rebuilds its row, integers and learnt adapters, from k others) and one down briefly (it
/// replays). Every row ends on one version with its integers as encoded and its adapters
/// those of a row that applied every published update itself.
#[test]
fn compact_rows_learn_across_restarts_and_rebuilds_and_end_on_one_codeword() -> Result<()> {
    let _machine = crate::machine::share();
    let model = tiny_model();
    let mut mesh = Mesh::start(
        "soak-q8",
        Some(&model),
        // Every update on the mesh, at a rate the canary gate would stop: no gate at genesis.
        &FAST_SGD,
    )?;
    let archive = mesh.dir.0.join("published");
    let keep = archive.display().to_string();
    const REQUESTS: usize = 150;
    // (request, node index in `mesh.nodes`, requests it stays down).
    let absences = [(20, 0, 60), (110, 2, 3)];
    let mut down: Option<(usize, usize)> = None;
    let (mut losses, mut noise, mut restarts) = (Vec::new(), Vec::new(), 0);
    for i in 0..REQUESTS {
        absent(&mut mesh, &absences, i, &mut down, &mut restarts)?;
        let (_, err) = mesh
            .generate_with(
                "hello world, this is a test",
                6,
                // Every update on the mesh, at a rate the canary gate would stop.
                &["--keep-published", &keep, "--no-canary-gate"],
                || {},
            )
            .with_context(|| format!("request {i}"))?;
        losses.push(learned_loss(&err)?);
        noise.push(honest_noise(&err)?);
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let (first, last) = (mean(&losses[..5]), mean(&losses[REQUESTS - 5..]));
    assert!(
        last < 0.5 * first,
        "the loss on the repeated prompt should fall: {first:.4} → {last:.4}"
    );
    let late = noise[REQUESTS - 50..].iter().copied().fold(0.0, f64::max);
    assert!(
        late < 0.5,
        "honest answers reach {late:.3} of the threshold"
    );
    mesh.wait_version(REQUESTS as u64)?;
    let rebuilt = mesh.nodes[0].log().matches("rebuilt row").count();
    assert!(rebuilt >= 1, "the long absence rebuilt its row");
    let dir = mesh.dir.0.clone();
    drop(mesh.nodes);
    drop(mesh.seed);
    let (shards, _, updates) = restore_rows(&dir, &archive, REQUESTS)?;
    assert_eq!(updates.len(), REQUESTS, "one update per request");
    let weights = node_native::load::load_model(&model)?.weights;
    let g = shards[0].generator.clone();
    for got in &shards {
        let mut want = node_core::coded::ShardSet::encode(
            &weights,
            &g,
            got.node,
            node_core::coded::ShardFormat::Q8,
            &mut |_, _| {},
        )?;
        for u in &updates {
            u.apply_to_shards(&mut want)?;
        }
        let largest = |a: &[f32]| a.iter().fold(0.0f32, |m, v| m.max(v.abs())) as f64;
        // A matrix whose wanted adapter is exactly zero (on a systematic row, the embedding's
        // block when no prompt token falls in it) is measured against the row's largest entry:
        // a row rebuilt from parity rows holds rounding there, not zeros.
        let row_scale = want
            .matrices()
            .map(|b| largest(&b.adapter.a))
            .fold(0.0, f64::max);
        assert!(
            row_scale > 0.0,
            "row {}: the updates moved nothing",
            got.node
        );
        let mut worst = 0.0f64;
        for (a, b) in got.matrices().zip(want.matrices()) {
            assert_eq!(a.values, b.values, "row {}: the integers moved", got.node);
            assert!(!a.adapter.is_empty(), "row {} learnt nothing", got.node);
            assert_eq!(a.adapter.a.len(), b.adapter.a.len(), "row {}", got.node);
            assert!(
                a.adapter.a.iter().all(|v| v.is_finite()),
                "row {}: an adapter entry is not finite",
                got.node
            );
            let scale = Some(largest(&b.adapter.a))
                .filter(|s| *s > 0.0)
                .unwrap_or(row_scale);
            let diff = a
                .adapter
                .a
                .iter()
                .zip(&b.adapter.a)
                .map(|(x, y)| (x - y).abs() as f64)
                .fold(0.0, f64::max);
            worst = worst.max(diff / scale);
        }
        eprintln!("row {}: adapters within {worst:.2e}", got.node);
        assert!(
            worst < 1e-4,
            "row {}: adapters differ by {worst:.2e}",
            got.node
        );
    }
    Ok(())
}

/// Before request `i`: kills the node an entry of `absences` (request, node index in
/// `mesh.nodes`, requests it stays down) names for it, or restarts the node that is `down`
/// (node index, request it comes back at) when its time has come.
fn absent(
    mesh: &mut Mesh,
    absences: &[(usize, usize, usize)],
    i: usize,
    down: &mut Option<(usize, usize)>,
    restarts: &mut usize,
) -> Result<()> {
    if let Some(&(_, node, for_requests)) = absences.iter().find(|a| a.0 == i) {
        mesh.nodes[node].signal("KILL");
        mesh.wait_healthy(4)?;
        *down = Some((node, i + for_requests));
    }
    if let Some((node, until)) = *down
        && i == until
    {
        *restarts += 1;
        mesh.nodes[node] = restart(mesh, node, *restarts)?;
        mesh.wait_healthy(5)?;
        *down = None;
    }
    Ok(())
}

/// Every node's row of a stopped [`Mesh`] in `dir`, restored from its data dir with its kept
/// updates replayed (each at `requests` updates, all on one version), its norm gains, and the
/// updates published into `archive`.
fn restore_rows(
    dir: &Path,
    archive: &Path,
    requests: usize,
) -> Result<(
    Vec<node_core::coded::ShardSet>,
    Vec<node_core::model::LeaderWeights>,
    Vec<node_core::learn::Update>,
)> {
    let (mut shards, mut norms, mut updates) = (Vec::new(), Vec::new(), Vec::new());
    let mut version = None;
    for i in 0..5 {
        let data = node_native::hold::store::DataDir::open(&mesh_data(dir, i))?;
        let (manifest, _) = data.manifest()?.context("manifest")?;
        let shard = data.shard()?.context("shard")?;
        let rules = node_native::hold::learning::Rules::of(&manifest);
        let store = node_native::hold::learning::UpdateStore::open(&data)?;
        let state = store.restore(shard, &rules, &manifest.leader)?;
        assert_eq!(state.version.count(), requests as u64, "node {i}");
        if version.is_none() {
            for entry in std::fs::read_dir(archive)? {
                let bytes = std::fs::read(entry?.path())?;
                updates.push(rules.check(&bytes, None)?.update);
            }
        }
        assert_eq!(
            version.get_or_insert(state.version.digest()),
            &state.version.digest(),
            "node {i} applied other updates"
        );
        shards.push(state.member.shards().clone());
        norms.push(state.norms);
    }
    Ok((shards, norms, updates))
}

/// Largest difference between two shard sets, relative to the largest value.
fn shard_diff(a: &node_core::coded::ShardSet, b: &node_core::coded::ShardSet) -> f64 {
    let all = |s: &node_core::coded::ShardSet| -> Vec<f32> {
        s.matrices()
            .flat_map(|sh| sh.values_f32().into_owned())
            .collect()
    };
    let (x, y) = (all(a), all(b));
    let scale = y.iter().fold(0.0f32, |m, v| m.max(v.abs())) as f64;
    x.iter()
        .zip(&y)
        .map(|(p, q)| (p - q).abs() as f64)
        .fold(0.0, f64::max)
        / scale
}

#[test]
fn a_member_lying_only_in_learnings_backward_rounds_is_caught_and_the_update_still_goes_out()
-> Result<()> {
    let _machine = crate::machine::share();
    let model = tiny_model();
    // Compact shards: their backward products carry what the adapters learnt.
    let mut mesh = Mesh::start(
        "backward",
        Some(&model),
        // Its updates at a fast rate must go out whatever they do to the canary: no gate.
        &FAST_SGD,
    )?;
    let row = 2;
    let i = mesh.kill_holder(row)?;
    mesh.wait_healthy(4)?;
    let data = mesh.dir.0.join(format!("d{}", i + 1));
    mesh.nodes[i] = start_faulty(&mesh, "backward-only", &data, row)?;
    mesh.wait_healthy(5)?;
    // Its forward answers are honest, so it is caught only on transposed products: once it
    // is among the k rows a backward step asks (the first k to answer the forward round
    // before), or once it is a forward pass's check row, whose projections are transposed
    // products too (`StepRequest::MatmulT`): a few requests.
    let mut caught = None;
    for _ in 0..10 {
        let (_, err) = mesh.generate("hello world", 6, || {})?;
        if err.contains(&format!("row {row} caught on")) {
            caught = Some(err);
            break;
        }
    }
    let err = caught.with_context(|| format!("row {row} was never caught in 10 requests"))?;
    let transposed = |l: &str| l.contains("backward") || l.contains("projection");
    assert!(
        err.lines()
            .any(|l| l.contains(&format!("row {row} caught on")) && transposed(l)),
        "caught on a backward round or a projection:\n{err}"
    );
    assert!(
        err.lines().any(|l| l.starts_with("update ")),
        "the step was redone without it and the update published:\n{err}"
    );
    let s = mesh.wait_healthy(4)?;
    assert!(
        s["nodes"]
            .as_array()
            .context("nodes")?
            .iter()
            .any(|n| n["row"] == row && n["caught"].as_str().is_some_and(transposed)),
        "status shows row {row} caught with the evidence: {s}"
    );
    Ok(())
}

#[test]
fn a_member_that_skips_an_update_it_claims_is_caught_by_the_update_probe() -> Result<()> {
    let _machine = crate::machine::share();
    let model = tiny_model();
    // A rate small enough that the missing update hides below the residual check's threshold:
    // only the fit against the update itself finds it. (At 5e-6 a late-checked answer showed
    // it at 1.04× the threshold once, and the residual check caught the row first; at 2.5e-6
    // it sits near half, and the fit finds it at 13–18 σ over the request, nine runs.) Compact shards, which learn each
    // update's projection in their adapters: the probe fits that projection.
    let mut mesh = Mesh::start(
        "stale",
        Some(&model),
        &[
            "--optimizer",
            "sgd",
            "--lr",
            "2.5e-6",
            "--shard-format",
            "q8",
        ],
    )?;
    let row = 3u64;
    let i = mesh.kill_holder(row)?;
    mesh.wait_healthy(4)?;
    let data = mesh.dir.0.join(format!("d{}", i + 1));
    let mut args = vec![
        "node",
        "--tcp-only",
        "--inject-fault",
        "stale",
        "--bootstrap",
    ];
    args.push(&mesh.bootstrap);
    args.push("--data");
    args.push(data.to_str().context("path")?);
    args.extend(HEALTH);
    let mut p = spawn(&mesh.dir.0, "faulty-stale", &args)?;
    p.wait_log(&format!("serving row {row}"), Duration::from_secs(60))?;
    mesh.nodes[i] = p;
    mesh.wait_healthy(5)?;
    // This request trains: the faulty node records the update without applying it.
    let (_, err) = mesh.generate("hello world", 8, || {})?;
    assert!(!err.contains("caught on"), "{err}");
    mesh.wait_version(1)?;
    let (_, err) = mesh.generate("hello world", 8, || {})?;
    assert!(
        err.contains(&format!("row {row} caught on")) && err.contains("of update"),
        "row {row} was not caught missing the update:\n{err}"
    );
    assert!(err.contains("update probe:"), "{err}");
    let s = mesh.wait_healthy(4)?;
    let nodes = s["nodes"].as_array().context("nodes")?;
    assert!(
        nodes.iter().any(|n| n["row"] == row
            && n["caught"]
                .as_str()
                .is_some_and(|e| e.contains("of update"))),
        "status does not show row {row} caught: {s}"
    );
    Ok(())
}

/// Any k of n while the model learns (issue 78): a holder one update behind its peers (down
/// while a request learnt, then restarted), and the next request with n − k other holders
/// SIGKILLed as its first token arrives. The request completes and learns, every time: three
/// rounds on one mesh, other holders killed in each. The lagging holder catches up by
/// replaying the update from a peer (peers keep the payloads a live holder lacks): rebuilding
/// its row would need k holders at the new version, and only k − 1 others survive. The leader
/// waits for it rather than give up on k rows at one version.
#[test]
fn n_minus_k_holders_killed_in_the_request_after_a_learning_one_and_it_completes() -> Result<()> {
    let _machine = crate::machine::share();
    // SmolLM2 on compact rows, as `up` serves it: an update (5 MB) is past what a holder keeps
    // of its row (54 MB) for peers a little behind, so its payload goes at the fold unless a
    // live holder lags. (The tiny model's updates are a few percent of its row: always kept.)
    let mut mesh = Mesh::start(
        "learn-kill",
        None,
        &["--shard-format", "q8", "--no-canary-gate"],
    )?;
    let archive = mesh.dir.0.join("published");
    let keep = archive.display().to_string();
    let args = ["--keep-published", keep.as_str(), "--no-canary-gate"];
    let prompt = "the quick brown fox jumps over the lazy dog";
    let mut restarts = 0;
    // (the holder that lags, the holders killed), as indices of `mesh.nodes`.
    for (round, (lags, victims)) in [(2, [0, 1]), (0, [2, 3]), (3, [1, 2])]
        .into_iter()
        .enumerate()
    {
        // A request learns while `lags` is down; it comes back one update behind, once every
        // other holder folded the update into a snapshot (its payload no longer kept for
        // peers a little behind, unless a live one lags).
        mesh.nodes[lags].kill_until_gone()?;
        mesh.wait_healthy(4)?;
        let snapshots = |p: &tests::procs::Proc| p.log().matches("saved a snapshot").count();
        let others = |mesh: &Mesh| -> Vec<usize> {
            std::iter::once(&mesh.seed)
                .chain(
                    mesh.nodes
                        .iter()
                        .enumerate()
                        .filter(|(i, _)| *i != lags)
                        .map(|(_, p)| p),
                )
                .map(snapshots)
                .collect()
        };
        let before = others(&mesh);
        let (_, err) = mesh
            .generate_with(prompt, 8, &args, || {})
            .with_context(|| format!("round {round}: the learning request"))?;
        assert!(err.contains("update "), "round {round}: no update\n{err}");
        let folded = std::time::Instant::now();
        while others(&mesh)
            .iter()
            .zip(&before)
            .any(|(now, was)| now <= was)
        {
            anyhow::ensure!(
                folded.elapsed() < Duration::from_secs(60),
                "round {round}: the holders did not fold the update\n{}",
                mesh.processes_report()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        restarts += 1;
        mesh.nodes[lags] = restart(&mesh, lags, restarts)?;
        // At once, the next request, with n − k of the others killed under it.
        let mut killed = Ok(());
        let (out, err) = mesh
            .generate_with(prompt, 16, &args, || {
                killed = victims
                    .iter()
                    .try_for_each(|&i| mesh.nodes[i].kill_until_gone());
            })
            .with_context(|| {
                let kept: Vec<_> = (0..5)
                    .map(|i| files(&mesh_data(&mesh.dir.0, i).join("updates")).unwrap_or_default())
                    .collect();
                format!(
                    "round {round}: the request with nodes {victims:?} killed, node {lags} lagging\nkept: {kept:?}\n{}",
                    mesh.processes_report()
                )
            })?;
        killed?;
        assert!(!out.is_empty(), "round {round}: no text\n{err}");
        assert!(
            err.contains("learned: loss"),
            "round {round}: the request after the kills did not learn\n{err}"
        );
        let log = mesh.nodes[lags].log();
        assert!(
            log.contains("pulling the updates this node lacks") && !log.contains("rebuilt row"),
            "round {round}: the lagging holder did not catch up by replaying\n{log}"
        );
        for &i in &victims {
            restarts += 1;
            mesh.nodes[i] = restart(&mesh, i, restarts)?;
        }
        mesh.wait_healthy(5)?;
        let published = std::fs::read_dir(&archive)?.count() as u64;
        mesh.wait_version(published)
            .with_context(|| format!("round {round}: after {published} updates"))?;
    }
    Ok(())
}
