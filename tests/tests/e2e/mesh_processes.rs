//! Real multi-process meshes on 127.0.0.1: `codedmesh seed`, `node`, `status` and `generate`
//! as separate processes, n = 5, k = 3. The small Hugging Face model in testdata keeps most
//! runs fast; one scenario runs the real SmolLM2.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use tests::procs::{HEALTH, Mesh, bin, have_gpu, spawn, spawn_node, spawn_node_with, tiny_model};

/// The same request in one process on shards of `format` (the mesh's): the reference tokens.
fn local_generate(
    model: &Path,
    prompt: &str,
    tokens: usize,
    format: &str,
    extra: &[&str],
) -> Result<String> {
    let out = Command::new(bin())
        .args([
            "generate", "--k", "3", "--n", "5", "--prompt", prompt, "--model",
        ])
        .arg(model)
        .args(["--shard-format", format])
        .args(["--max-tokens", &tokens.to_string()])
        .args(extra)
        .output()?;
    if !out.status.success() {
        bail!("local generate: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
const PROMPT: &str = "The history of the printing press begins";
#[test]
fn tiny_mesh_status_generate_straggler_restart_and_rejoin() -> Result<()> {
    let _machine = crate::machine::share();
    let model = tiny_model();
    let mut mesh = Mesh::start("tiny", Some(&model), &["--no-learning"])?;

    // Status: every row healthy, tolerates n − k failures; the summary line says so.
    let s = mesh.status()?;
    assert_eq!(
        (s["k"].as_u64(), s["n"].as_u64()),
        (Some(3), Some(5)),
        "{s}"
    );
    assert_eq!(s["available"], true);
    assert_eq!(s["tolerates"], 2);
    let nodes = s["nodes"].as_array().context("nodes")?;
    let mut rows: Vec<u64> = nodes.iter().filter_map(|n| n["row"].as_u64()).collect();
    rows.sort_unstable();
    assert_eq!(rows, vec![0, 1, 2, 3, 4]);
    assert!(
        nodes
            .iter()
            .all(|n| n["version_count"] == 0 && n["version_digest"].is_string())
    );
    let text = Command::new(bin())
        .args(["status", "--bootstrap", &mesh.bootstrap])
        .output()?;
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains(
            "model available: yes — 5 of 5 rows healthy, k = 3, tolerates 2 more failures"
        ),
        "{text}"
    );

    // A normal run gives the in-process coded run's tokens.
    let expected = local_generate(&model, PROMPT, 24, "f32", &[])?;
    if have_gpu() {
        // The whole token on the GPU (members' products and the leader's work) agrees.
        let on_gpu = local_generate(&model, PROMPT, 24, "f32", &["--device", "gpu"])?;
        assert_eq!(on_gpu, expected, "generate --device gpu");
    }
    let (out, err) = mesh.generate(PROMPT, 24, || {})?;
    assert_eq!(out, expected, "{err}");
    assert!(err.contains("rounds per forward pass 10"), "{err}");

    // One hop per stage: the members pass their parts to each other and run the model between
    // stages; the same tokens come out, every LM head round checked by the leader.
    let (out, err) = mesh.generate_with(PROMPT, 24, &["--pass", "hop"], || {})?;
    assert_eq!(out, expected, "--pass hop\n{err}");
    assert!(
        err.contains("LM head rounds (0 unchecked)"),
        "{err}\n{}",
        mesh.processes_report()
    );

    // A SIGSTOP-ed member of the decoding group: the others answer without it. (The group is
    // k + 1 checked + 1 spare = all five rows, so there is no free row to swap it for; every
    // round still gets the k + 1 answers it checks.)
    let stalled = mesh.holder(2)?;
    mesh.nodes[stalled].signal("STOP");
    let (out, err) = mesh.generate(PROMPT, 24, || {})?;
    assert_eq!(out, expected, "{err}");
    assert!(
        err.contains(", 0 unchecked"),
        "rounds went unchecked:\n{err}"
    );
    // With one hop per stage, the group forms without the silent member (its session does
    // not answer) and decodes without it.
    let (out, err) = mesh.generate_with(PROMPT, 24, &["--pass", "hop"], || {})?;
    assert_eq!(out, expected, "--pass hop\n{err}");
    mesh.nodes[stalled].signal("CONT");

    // A node restarted from its data dir comes back with its row, without downloading; it
    // comes back computing on the GPU (lavapipe in CI) and the mesh computes the same.
    let restarted = mesh.kill_holder(3)?;
    mesh.wait_healthy(4)?;
    let name = format!("node{}", restarted + 1);
    let data = format!("d{}", restarted + 1);
    let gpu = have_gpu();
    let mut p = spawn_node_with(
        &mesh.dir.0,
        &format!("{name}-again"),
        &data,
        &mesh.bootstrap,
        if gpu {
            &["--tcp-only", "--device", "gpu"]
        } else {
            &["--tcp-only"]
        },
    )?;
    let log = p.wait_log("serving row 3", Duration::from_secs(60))?;
    assert!(log.contains("restarting with row 3"), "{log}");
    mesh.nodes[restarted] = p;
    mesh.wait_healthy(5)?;
    if gpu {
        assert!(log.contains("computing on the GPU"), "{log}");
        let s = mesh.status()?;
        let row3 = s["nodes"]
            .as_array()
            .context("nodes")?
            .iter()
            .find(|n| n["row"] == 3)
            .context("row 3")?
            .clone();
        assert!(
            row3["device"].as_str().is_some_and(|d| d != "cpu"),
            "{row3}\nthe whole status: {s}\nthe restarted node's log:\n{log}\nthe seed's log:\n{}",
            mesh.nodes[0].log()
        );
        let (out, err) = mesh.generate(PROMPT, 24, || {})?;
        assert_eq!(out, expected, "{err}");
    }

    // A dead row is re-created by a new node from k live shards; the mesh computes the same.
    let gone = mesh.kill_holder(4)?;
    mesh.wait_healthy(4)?;
    std::thread::sleep(Duration::from_millis(2500)); // past --dead-ms: row 4 is free
    let mut fresh = spawn_node(&mesh.dir.0, "node5", "d5", &mesh.bootstrap)?;
    let log = fresh.wait_log("serving row", Duration::from_secs(60))?;
    assert!(
        log.contains("joined as row 4 (re-encoded from rows"),
        "{log}"
    );
    one_shard_received(&log)?;
    mesh.nodes[gone] = fresh;
    mesh.wait_healthy(5)?;
    let (out, err) = mesh.generate(PROMPT, 24, || {})?;
    assert_eq!(out, expected, "{err}");

    // After genesis the seed is a node like any other: it may leave; any node bootstraps.
    let s = mesh.status()?;
    let other = s["nodes"]
        .as_array()
        .context("nodes")?
        .iter()
        .find(|n| n["row"] == 1)
        .and_then(|n| n["addrs"].as_array()?.first()?.as_str())
        .context("row 1's address")?
        .to_string();
    mesh.seed.signal("KILL");
    mesh.bootstrap = other;
    mesh.wait_healthy(4)?;
    let (out, err) = mesh.generate(PROMPT, 24, || {})?;
    assert_eq!(out, expected, "{err}");
    Ok(())
}
#[test]
fn real_model_survives_n_minus_k_kills_mid_generation() -> Result<()> {
    let _machine = crate::machine::share();
    let mesh = Mesh::start("real", None, &["--no-learning"])?;
    let (undisturbed, err) = mesh.generate(PROMPT, 32, || {})?;
    assert!(undisturbed.contains("Gutenberg"), "{undisturbed}\n{err}");
    // Kill two members of the decoding group (rows 2 and 4; the seed, row 0, is the bootstrap).
    let victims = [mesh.holder(2)?, mesh.holder(4)?];
    let mut killed = Ok(());
    let (out, err) = mesh.generate(PROMPT, 32, || {
        killed = victims
            .iter()
            .try_for_each(|&i| mesh.nodes[i].kill_until_gone());
    })?;
    killed?;
    assert_eq!(out, undisturbed, "{err}");
    // The killed rows left the group (failed, or outrun as stragglers and swapped out).
    let end = err
        .lines()
        .find_map(|l| l.strip_prefix("members at the end: "))
        .with_context(|| format!("no members line:\n{err}"))?;
    assert!(
        !end.contains('2') && !end.contains('4'),
        "killed rows 2 and 4 still members ({end}):\n{err}"
    );
    let s = mesh.wait_healthy(3)?;
    assert_eq!(s["tolerates"], 0);
    drop(mesh.nodes);
    Ok(())
}
/// How close honest answers came to the residual check's threshold in a `generate` run.
pub(super) fn honest_noise(err: &str) -> Result<f64> {
    let line = err
        .lines()
        .find_map(|l| l.split_once("honest noise at ").map(|(_, r)| r))
        .with_context(|| format!("no verification line in:\n{err}"))?;
    let v = line.split_whitespace().next().context("noise value")?;
    Ok(v.parse()?)
}
/// A node from data dir `data` that injects `fault` (`--inject-fault`), once it serves `row`.
pub(super) fn start_faulty(
    mesh: &Mesh,
    fault: &str,
    data: &Path,
    row: u64,
) -> Result<tests::procs::Proc> {
    let mut args = vec!["node", "--tcp-only", "--inject-fault", fault, "--bootstrap"];
    args.push(&mesh.bootstrap);
    args.push("--data");
    args.push(data.to_str().context("path")?);
    args.extend(HEALTH);
    let mut p = spawn(&mesh.dir.0, &format!("faulty-{fault}"), &args)?;
    p.wait_log(&format!("serving row {row}"), Duration::from_secs(60))?;
    Ok(p)
}
/// Node `i`'s data dir in a [`Mesh`] scratch dir (the seed's is `d0`).
pub(super) fn mesh_data(dir: &Path, i: usize) -> std::path::PathBuf {
    dir.join(format!("d{i}"))
}
/// Starts node `i` of `mesh.nodes` again from its data dir (its log named for the `nth`
/// restart), once it serves its row.
pub(super) fn restart(mesh: &Mesh, i: usize, nth: usize) -> Result<tests::procs::Proc> {
    let mut p = spawn_node(
        &mesh.dir.0,
        &format!("node{}-restart{nth}", i + 1),
        &format!("d{}", i + 1),
        &mesh.bootstrap,
    )?;
    p.wait_log("serving row", Duration::from_secs(60))?;
    Ok(p)
}
#[test]
fn a_member_that_answers_wrongly_is_caught_outvoted_and_replaced() -> Result<()> {
    let _machine = crate::machine::share();
    let model = tiny_model();
    let mut mesh = Mesh::start("fault", Some(&model), &["--no-learning"])?;
    let (undisturbed, _) = mesh.generate("hello world", 8, || {})?;
    for (fault, row) in [("wrong-row", 2u64), ("scale", 3), ("garbage", 4)] {
        // Restart the row's holder from its data dir, misbehaving on purpose. For wrong-row,
        // the holder of the row before takes its place instead: a copy of that holder's
        // shard (not its identity) that claims this row and answers with its own.
        let i = mesh.kill_holder(row)?;
        mesh.wait_healthy(4)?;
        let mut data = mesh.dir.0.join(format!("d{}", i + 1));
        if fault == "wrong-row" {
            let before = mesh.dir.0.join(format!("d{}", mesh.holder(row - 1)? + 1));
            data = mesh.dir.0.join("liar");
            std::fs::create_dir_all(&data)?;
            for f in std::fs::read_dir(&before)? {
                let f = f?;
                if f.file_type()?.is_file() && f.file_name() != "identity.key" {
                    std::fs::copy(f.path(), data.join(f.file_name()))?;
                }
            }
        }
        mesh.nodes[i] = start_faulty(&mesh, fault, &data, row)?;
        mesh.wait_healthy(5)?;
        // Every answer needed in every round (k + 2 checked, no spare): with a spare, a
        // liar that always answers last is never used, so never checked either, and the
        // tiny model's whole generation (a few ms) can pass while a busy machine keeps the
        // liar's process waiting. Two checks also locate it without a vote.
        let every = ["--check", "2", "--spares", "0"];
        let (out, err) = mesh.generate_with("hello world", 8, &every, || {})?;
        assert_eq!(out, undisturbed, "{fault}: the answer changed:\n{err}");
        assert!(
            err.contains(&format!("row {row} caught on")),
            "{fault}: row {row} was not caught:\n{err}"
        );
        // The mesh knows, with the evidence, and leaves the node out.
        let s = mesh.wait_healthy(4)?;
        let caught: Vec<&serde_json::Value> = s["nodes"]
            .as_array()
            .context("nodes")?
            .iter()
            .filter(|n| n["caught"].is_string())
            .collect();
        assert!(
            caught.iter().any(|n| n["row"] == row
                && n["caught"]
                    .as_str()
                    .is_some_and(|e| e.contains("caught on"))),
            "{fault}: status does not show row {row} caught: {s}"
        );
        if fault != "garbage" {
            // A new node re-creates the caught row from healthy shards (for wrong-row once
            // the killed holder of the row is past --dead-ms too).
            if fault == "wrong-row" {
                std::thread::sleep(Duration::from_millis(2500));
            }
            let name = format!("replacement-{fault}");
            let mut p = spawn_node(&mesh.dir.0, &name, &name, &mesh.bootstrap)?;
            let log = p.wait_log(&format!("serving row {row}"), Duration::from_secs(60))?;
            assert!(log.contains("re-encoded from rows"), "{log}");
            mesh.nodes.push(p);
            mesh.wait_healthy(5)?;
            let (out, err) = mesh.generate("hello world", 8, || {})?;
            assert_eq!(out, undisturbed, "after the replacement:\n{err}");
            assert!(!err.contains("caught on"), "{err}");
        }
    }
    Ok(())
}
#[test]
fn the_mesh_grows_new_rows_then_replicas_and_survives_two_holders_killed() -> Result<()> {
    let _machine = crate::machine::share();
    let model = tiny_model();
    // Room for two rows past genesis: of four joiners, two get new rows and two replicas.
    let mut mesh = Mesh::start_with(
        "grow",
        Some(&model),
        &["--no-learning"],
        &["--tcp-only", "--max-rows", "7"],
    )?;
    let expected = local_generate(&model, PROMPT, 24, "f32", &[])?;
    let mut joiners = Vec::new();
    for i in 5..9 {
        joiners.push(spawn_node(
            &mesh.dir.0,
            &format!("node{i}"),
            &format!("d{i}"),
            &mesh.bootstrap,
        )?);
    }
    let mut how = Vec::new();
    for j in &mut joiners {
        let log = j.wait_log("serving row", Duration::from_secs(120))?;
        let line = log
            .lines()
            .find(|l| l.starts_with("joined as row"))
            .with_context(|| format!("no join line:\n{log}"))?;
        how.push(line.to_string());
    }
    let new_rows = how
        .iter()
        .filter(|l| l.contains("a new row, encoded"))
        .count();
    let replicas = how
        .iter()
        .filter(|l| l.contains("a replica of row"))
        .count();
    assert_eq!((new_rows, replicas), (2, 2), "{how:#?}");
    let chained: Vec<&String> = how.iter().filter(|l| l.contains("along a chain")).collect();
    assert_eq!(
        chained.len(),
        new_rows,
        "every new row is built along a chain: {how:#?}"
    );
    for line in chained {
        one_shard_received(line)?;
    }
    mesh.nodes.extend(joiners);

    // Nine holders of seven rows, every one healthy; nobody was turned away.
    let start = std::time::Instant::now();
    let s = loop {
        let s = mesh.status()?;
        let healthy = s["nodes"]
            .as_array()
            .context("nodes")?
            .iter()
            .filter(|n| n["health"] == "Healthy")
            .count();
        if healthy == 9 && s["healthy_rows"] == 7 {
            break s;
        }
        if start.elapsed() > Duration::from_secs(60) {
            bail!("never saw 9 healthy holders of 7 rows: {s}");
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!((s["n"].as_u64(), s["n_max"].as_u64()), (Some(7), Some(7)));
    let holders: Vec<usize> = s["rows"]
        .as_array()
        .context("rows")?
        .iter()
        .map(|r| r["holders"].as_array().map_or(0, Vec::len))
        .collect();
    assert_eq!(holders.iter().sum::<usize>(), 9, "{s}");
    assert!(holders.iter().all(|&h| h >= 1), "{s}");
    let text = Command::new(bin())
        .args(["status", "--bootstrap", &mesh.bootstrap])
        .output()?;
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("n = 7 rows (room for 7)"), "{text}");
    assert!(text.contains("rows × holders"), "{text}");
    let (out, err) = mesh.generate(PROMPT, 24, || {})?;
    assert_eq!(out, expected, "{err}");

    // Two holders die: a row with a replica and a row without. Its replica keeps the first
    // row; the mesh still computes the same tokens.
    let doubled = holders
        .iter()
        .rposition(|&h| h == 2)
        .context("a replicated row")? as u64;
    let single = holders
        .iter()
        .rposition(|&h| h == 1)
        .context("a single row")? as u64;
    for row in [doubled, single] {
        let peer = s["nodes"]
            .as_array()
            .context("nodes")?
            .iter()
            .find(|n| n["row"] == row)
            .and_then(|n| n["peer"].as_str())
            .context("holder")?
            .to_string();
        let i = mesh
            .nodes
            .iter()
            .position(|n| n.log().contains(&format!("serving row {row} as {peer}")))
            .with_context(|| format!("no process serves row {row} as {peer}"))?;
        mesh.nodes[i].signal("KILL");
    }
    mesh.wait_healthy(6)?;
    let (out, err) = mesh.generate(PROMPT, 24, || {})?;
    assert_eq!(out, expected, "{err}");
    Ok(())
}
#[test]
fn a_node_started_before_its_bootstrap_keeps_trying_and_joins() -> Result<()> {
    let _machine = crate::machine::share();
    let dir = tests::procs::Scratch::new("order");
    let port = tests::procs::free_port()?;
    let addr = format!("/ip4/127.0.0.1/tcp/{port}");
    // The node first: nothing listens at its bootstrap address yet.
    let mut node = spawn_node(&dir.0, "node1", "d1", &addr)?;
    node.wait_log("does not answer yet", Duration::from_secs(60))?;
    let d0 = dir.0.join("d0");
    let model = tiny_model();
    let mut args = vec![
        "seed",
        "--k",
        "3",
        "--n",
        "5",
        "--no-learning",
        "--tcp-only",
    ];
    args.extend(["--listen", &addr, "--data", d0.to_str().context("path")?]);
    args.extend(["--model", model.to_str().context("path")?]);
    args.extend(HEALTH);
    let _seed = spawn(&dir.0, "seed", &args)?;
    let log = node.wait_log("serving row", Duration::from_secs(120))?;
    assert!(log.contains("joined as row 1 (a genesis shard"), "{log}");
    Ok(())
}
/// A joiner that built its row along a chain received exactly its shard's bytes (not the k
/// shards a local re-encoding would download): its join line says both.
fn one_shard_received(log: &str) -> Result<()> {
    let line = log
        .lines()
        .find(|l| l.starts_with("joined as row") && l.contains("along a chain"))
        .with_context(|| format!("no chained join line:\n{log}"))?;
    let number_after = |key: &str| -> Result<u64> {
        let rest = &line[line
            .find(key)
            .with_context(|| format!("{key:?} in {line}"))?
            + key.len()..];
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        digits.parse().with_context(|| format!("{key:?} in {line}"))
    };
    let (received, holds) = (
        number_after("MiB (")?,
        number_after("the row's shard holds ")?,
    );
    ensure!(received == holds && holds > 0, "{line}");
    Ok(())
}
#[test]
fn a_compact_mesh_serves_its_models_tokens_and_builds_a_new_row_along_a_chain() -> Result<()> {
    let _machine = crate::machine::share();
    let model = tiny_model();
    // q8 shards on the integer code, with room for one row past genesis.
    let mut mesh = Mesh::start_with(
        "compact",
        Some(&model),
        &["--no-learning"],
        &["--tcp-only", "--shard-format", "q8", "--max-rows", "6"],
    )?;
    let expected = local_generate(&model, PROMPT, 24, "q8", &[])?;
    let (out, err) = mesh.generate(PROMPT, 24, || {})?;
    assert_eq!(out, expected, "{err}");
    // A joiner gets row 5 along a chain of three holders, which sum their integers exactly:
    // it receives its own row's bytes and no more.
    let mut joiner = spawn_node(&mesh.dir.0, "node5", "d5", &mesh.bootstrap)?;
    let log = joiner.wait_log("serving row", Duration::from_secs(120))?;
    let line = log
        .lines()
        .find(|l| l.starts_with("joined as row 5"))
        .with_context(|| format!("no join line:\n{log}"))?;
    assert!(line.contains("a new row, encoded from rows"), "{line}");
    one_shard_received(&log)?;
    mesh.nodes.push(joiner);
    mesh.wait_healthy(6)?;
    // Rows 1 and 2 die: a group of three and its check row are the four rows left, row 5
    // among them, so the same tokens, with no one caught, mean row 5 is the code's row.
    mesh.kill_holder(1)?;
    mesh.kill_holder(2)?;
    mesh.wait_healthy(4)?;
    let (out, err) = mesh.generate(PROMPT, 24, || {})?;
    assert_eq!(out, expected, "{err}");
    assert!(!err.contains("caught"), "{err}");
    Ok(())
}
