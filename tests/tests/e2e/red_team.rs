//! The red team: a live `codedmesh up` mesh (the tiny model, learning on, API keys), a client
//! streaming completions throughout, and a hostile peer on real libp2p
//! ([`tests::adversary`]) that tries every attack the mesh must refuse or contain (issue 77):
//! forged, replayed, malformed, oversized and ungated updates; a notice naming 100,000 peers
//! and one claiming 256 MiB; 1024 streams claiming 64 MiB frames and a request frame far past
//! its kind; a report framing an honest holder; heartbeats lying about their version or place; one API
//! key flooding learning; a holder answering against the code. Each is refused or contained,
//! and counted in `/metrics` with its reason; no honest holder is excluded; every honest holder
//! ends on one version; every node's memory stays within its bound; the client's stream never
//! fails.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use node_core::holder::wall_ms;
use tests::adversary::{Adversary, refusal, said};
use tests::procs::{Scratch, free_port, http_get, tiny_model};

use super::api::{Up, field, status};

/// How long the client streams before the attacks (the stream's undisturbed speed).
const CALM: Duration = Duration::from_secs(8);

/// What any node's memory stays within during the attacks (the tiny model's row and the
/// node's buffers are megabytes; the budget for frames in flight is 256 MiB).
const MEMORY_BOUND: u64 = 1 << 30;

/// A POST to the API as `key` (none: the anonymous user): the status line and the body.
fn post_as(port: u16, key: Option<&str>, body: &str) -> Result<(String, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(120)))?;
    let auth = key.map_or(String::new(), |k| format!("Authorization: Bearer {k}\r\n"));
    write!(
        s,
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut answer = String::new();
    s.read_to_string(&mut answer)?;
    let (head, body) = answer.split_once("\r\n\r\n").context("no HTTP header")?;
    Ok((
        head.lines().next().unwrap_or_default().to_string(),
        body.to_string(),
    ))
}

/// One `/metrics` sample of node 0 with these labels: `name{labels} value`.
fn sample(text: &str, name: &str, labels: &str) -> f64 {
    text.lines()
        .find_map(|l| {
            let rest = l.strip_prefix(name)?;
            let rest = rest.strip_prefix(&format!("{{{labels}}}"))?;
            rest.trim().parse().ok()
        })
        .unwrap_or(0.0)
}

/// Resident memory of a process (`VmRSS`), in bytes.
fn rss(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib: u64 = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// A client streaming completions as `alice` until told to stop: requests, failures, tokens.
struct Client {
    stop: Arc<AtomicBool>,
    done: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
    tokens: Arc<AtomicU64>,
    errors: Arc<std::sync::Mutex<Vec<String>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Client {
    fn start(port: u16) -> Self {
        let (stop, done, failed, tokens) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicU64::new(0)),
        );
        let errors = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (s, d, f, t, e) = (
            stop.clone(),
            done.clone(),
            failed.clone(),
            tokens.clone(),
            errors.clone(),
        );
        let thread = std::thread::spawn(move || {
            // Served, not trained on: the mesh's version stays put while the holders are
            // counted (alice teaches below).
            let body = r#"{"model": "tiny-llama-hf", "prompt": "the mesh keeps serving while", "max_tokens": 12, "temperature": 0, "learn": false}"#;
            while !s.load(Ordering::Relaxed) {
                match post_as(port, Some("sk-alice-key"), body) {
                    Ok((head, body)) if head.contains(" 200 ") => {
                        d.fetch_add(1, Ordering::Relaxed);
                        let n = serde_json::from_str::<serde_json::Value>(&body)
                            .ok()
                            .and_then(|v| v["usage"]["completion_tokens"].as_u64())
                            .unwrap_or(0);
                        t.fetch_add(n, Ordering::Relaxed);
                    }
                    other => {
                        f.fetch_add(1, Ordering::Relaxed);
                        if let Ok(mut e) = e.lock() {
                            e.push(format!("{other:?}"));
                        }
                    }
                }
            }
        });
        Self {
            stop,
            done,
            failed,
            tokens,
            errors,
            thread: Some(thread),
        }
    }

    /// Requests done and tokens so far.
    fn counts(&self) -> (u64, u64) {
        (
            self.done.load(Ordering::Relaxed),
            self.tokens.load(Ordering::Relaxed),
        )
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn keys_file(dir: &Path) -> Result<std::path::PathBuf> {
    let path = dir.join("keys.json");
    std::fs::write(
        &path,
        r#"{"keys": [
            {"name": "alice", "key": "sk-alice-key"},
            {"name": "flood", "key": "sk-flood-key", "learn_tokens": 64, "learn_per_s": 0.5},
            {"name": "kiosk", "key": "sk-kiosk-key", "teach": false}
        ]}"#,
    )?;
    Ok(path)
}

#[test]
fn a_stranger_cannot_take_the_mesh_over_and_every_attack_is_refused_and_counted() -> Result<()> {
    let _machine = crate::machine::share();
    let scratch = Scratch::new("red-team");
    let dir = scratch.0.clone();
    let data = dir.join("mesh");
    let port = free_port()?;
    let keys = keys_file(&dir)?;
    let keys_arg = keys.display().to_string();
    let mut up = Up::start_model(
        &dir,
        &data,
        port,
        &dir.join("steps.jsonl"),
        "redteam",
        &tiny_model(),
        // k = 3 of 5, whatever the cores: a node that joins takes a new row (the code has 7).
        &[
            "--api-keys",
            &keys_arg,
            "--max-batch",
            "4",
            "--k",
            "3",
            "--nodes",
            "5",
        ],
    )?;
    let ready = up.ready(Duration::from_secs(180))?;
    let bootstrap = field(&ready, "bootstrap ")?.to_string();
    let metrics = || http_get(([127, 0, 0, 1], port).into(), "/metrics");
    let honest: BTreeMap<String, Option<u64>> = status(&bootstrap)?["nodes"]
        .as_array()
        .context("nodes")?
        .iter()
        .filter_map(|n| Some((n["peer"].as_str()?.to_string(), n["row"].as_u64())))
        .collect();
    let mesh_key =
        libp2p::identity::Keypair::from_protobuf_encoding(&std::fs::read(data.join("mesh.key"))?)?;

    // The client streams throughout; a while without attacks first.
    let client = Client::start(port);
    let started = Instant::now();
    while client.counts().0 < 2 {
        ensure!(
            started.elapsed() < Duration::from_secs(120),
            "the client never got going"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // The stream before the attacks, over a fixed while.
    let (done_start, tokens_start) = client.counts();
    let before = Instant::now();
    std::thread::sleep(CALM);
    let (done0, tokens0) = client.counts();
    let calm = before.elapsed();

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let attacks_began = Instant::now();
    let peak = Arc::new(AtomicU64::new(0));
    let watching = Arc::new(AtomicBool::new(true));
    let watcher = {
        let (peak, watching) = (peak.clone(), watching.clone());
        let pids: Vec<u32> = up.node_pids().into_iter().map(|(_, p)| p as u32).collect();
        std::thread::spawn(move || {
            while watching.load(Ordering::Relaxed) {
                for &p in &pids {
                    peak.fetch_max(rss(p).unwrap_or(0), Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };
    let report = rt.block_on(async {
        let adv = Adversary::connect(bootstrap.parse()?).await?;
        let stranger = adv.signer(None)?;
        let insider = adv.signer(Some(&mesh_key))?;
        let max = node_core::holder::Rules::of(&adv.manifest).max_sealed as usize;
        let mut refused = Vec::new();
        // Updates: a stranger's; an admitted one's replayed an hour later, not gated, not an
        // update at all; unsigned bytes; more bytes than any update of the mesh.
        let cases = [
            (
                "a forged update from an unadmitted key",
                adv.sealed(&stranger, vec![1; 64], wall_ms(), true)?,
                "unadmitted",
            ),
            (
                "an old update replayed",
                adv.sealed(&insider, vec![1; 64], wall_ms() - 3_600_000, true)?,
                "out_of_turn",
            ),
            (
                "an update without the gate's verdict",
                adv.sealed(&insider, vec![1; 64], wall_ms(), false)?,
                "ungated",
            ),
            (
                "a malformed update",
                adv.sealed(&insider, vec![1; 64], wall_ms(), true)?,
                "malformed",
            ),
            ("unsigned bytes", vec![9; 200], "signature"),
            ("an oversized update", vec![0; max + 1], "oversized"),
        ];
        for (what, bytes, want) in cases {
            let answer = adv.learn(bytes).await;
            let got = refusal(&answer).with_context(|| format!("{what}: {}", said(&answer)))?;
            ensure!(got == want, "{what}: refused as {got}, not {want}");
            refused.push(format!("{what}: refused ({got})"));
        }
        // Notices: a stranger's; one naming 100,000 peers; one claiming 256 MiB.
        let a = adv.notice(&stranger, 1 << 20, 1).await;
        ensure!(
            said(&a).contains("unadmitted"),
            "a stranger's notice: {}",
            said(&a)
        );
        let a = adv.notice(&insider, 1 << 20, 100_000).await;
        ensure!(
            said(&a).contains("this node knows"),
            "a notice naming 100,000 peers: {}",
            said(&a)
        );
        let a = adv.notice(&insider, 256 << 20, 1).await;
        ensure!(
            said(&a).contains("oversized"),
            "a 256 MiB notice: {}",
            said(&a)
        );
        refused.push("notices: a stranger's, 100,000 names, 256 MiB: refused".into());
        // A report framing an honest holder.
        let accused: libp2p::PeerId = honest
            .keys()
            .find(|p| **p != adv.target().to_string())
            .context("another holder")?
            .parse()?;
        let a = adv.frame(&stranger, accused).await;
        ensure!(
            said(&a).contains("report_unadmitted"),
            "a framing report: {}",
            said(&a)
        );
        refused.push("a framing report: refused (report_unadmitted)".into());
        // A joiner's samples naming 60 peers: past the list's bound, refused undecoded.
        let a = adv.join_near_a_crowd().await;
        ensure!(
            !matches!(a, Ok(node_core::mesh::MeshResponse::Join(_))),
            "a join near 60 peers was answered with an offer: {}",
            said(&a)
        );
        refused.push(format!("a join near 60 peers: {}", said(&a)));
        // Heartbeats claiming a billion updates, as a holder of row 1.
        adv.lie_about_version(1, 1_000_000_000, 15).await?;
        // Heartbeats placing a holder of row 1 a billion milliseconds out.
        adv.lie_about_place(1, 15).await?;
        // 1024 streams claiming 64 MiB frames, 4 MiB sent on each (past the node's budget for
        // request frames), held 3 s; then one request frame far past what its kind (a view
        // request) needs.
        let (opened, failed) = adv
            .flood(1024, (7, 64 << 20), 4 << 20, Duration::from_secs(3))
            .await;
        refused.push(format!(
            "1024 streams of 64 MiB frames: {opened} opened, {failed} cut"
        ));
        let cut = Adversary::connect(bootstrap.parse()?).await?;
        let (_, failed) = cut
            .flood(1, (0, 64 << 20), 1 << 20, Duration::from_secs(1))
            .await;
        refused.push(format!("a view request of 64 MiB: {failed} stream cut"));
        anyhow::Ok(refused)
    })?;
    for line in &report {
        eprintln!("red team: {line}");
    }

    // Alice teaches; one API key flooding learning: its budget runs out, it is served, and
    // alice still teaches.
    let body = r#"{"model": "tiny-llama-hf", "prompt": "the river runs past the old mill", "max_tokens": 2}"#;
    let (head, _) = post_as(port, Some("sk-alice-key"), body)?;
    ensure!(head.contains(" 200 "), "alice teaching: {head}");
    for _ in 0..12 {
        let body = r#"{"model": "tiny-llama-hf", "prompt": "buy now buy now buy now buy now buy now", "max_tokens": 2}"#;
        let (head, body) = post_as(port, Some("sk-flood-key"), body)?;
        ensure!(
            head.contains(" 200 "),
            "the flooding key is still served: {head} {body}"
        );
    }
    // A key that may not teach is refused when it asks to.
    let (head, _) = post_as(
        port,
        Some("sk-kiosk-key"),
        r#"{"model": "tiny-llama-hf", "prompt": "hello", "max_tokens": 2, "learn": true}"#,
    )?;
    ensure!(head.contains(" 403 "), "kiosk asked to teach: {head}");
    // A wrong key, and the anonymous user from this machine.
    let (head, _) = post_as(
        port,
        Some("sk-wrong-key"),
        r#"{"model": "tiny-llama-hf", "prompt": "x"}"#,
    )?;
    ensure!(head.contains(" 401 "), "a wrong key: {head}");

    // A stranger's node joins (the mesh does not admit it to write): what its API's users
    // send teaches the mesh through a node that trains.
    let out = dir.join("stranger.out");
    let mut cmd = std::process::Command::new(tests::procs::bin());
    cmd.args(["node", "--tcp-only", "--bootstrap", &bootstrap, "--data"])
        .arg(dir.join("stranger"));
    let mut stranger =
        tests::procs::spawn_command(cmd, &dir, "stranger", std::fs::File::create(&out)?.into())?;
    stranger.wait_log("serving row", Duration::from_secs(120))?;
    let api_port: u16 = std::fs::read_to_string(&out)?
        .lines()
        .find_map(|l| l.strip_prefix("api: http://127.0.0.1:"))
        .and_then(|r| r.split('/').next())
        .and_then(|p| p.parse().ok())
        .context("the stranger's API port")?;
    // Once its view of the mesh has the rows a group needs (it has just joined).
    let knows = Instant::now() + Duration::from_secs(30);
    loop {
        let m = http_get(([127, 0, 0, 1], api_port).into(), "/metrics")?;
        if tests::procs::metric(&m, "codedmesh_healthy_rows").unwrap_or(0.0) >= 4.0 {
            break;
        }
        ensure!(
            Instant::now() < knows,
            "the stranger never saw the mesh:\n{m}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let (head, body) = post_as(
        api_port,
        None,
        r#"{"model": "tiny-llama-hf", "prompt": "the stranger's user says the bridge opens at noon", "max_tokens": 2}"#,
    )?;
    ensure!(head.contains(" 200 "), "the stranger's API: {head} {body}");
    // The stranger's node counts each text a trainer took (the trainer counts it as the
    // peers' budget's).
    let taken = || -> Result<f64> {
        let m = http_get(([127, 0, 0, 1], api_port).into(), "/metrics")?;
        Ok(sample(
            &m,
            "codedmesh_api_key_total",
            "key=\"anonymous\",what=\"taught_by_a_trainer\"",
        ))
    };
    let taught_by = Instant::now() + Duration::from_secs(30);
    while taken()? < 1.0 {
        ensure!(
            Instant::now() < taught_by,
            "the stranger's text never reached a trainer:\n{}",
            stranger.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    drop(stranger);

    // The stream under the network attacks so far.
    let network = attacks_began.elapsed();
    let (done_net, tokens_net) = client.counts();

    // A holder answering against the code joins with a new row, and an honest member stops, so a
    // leader's group checked twice (k = 3 and two check rows: a wrong answer is located, not
    // only seen) takes every live row, the liar's too: it is caught, and the leader (admitted
    // to report) tells every holder.
    let faulty = tests::procs::spawn(
        &dir,
        "faulty",
        &[
            "node",
            "--tcp-only",
            "--inject-fault",
            "garbage",
            "--bootstrap",
            &bootstrap,
            "--data",
            dir.join("faulty").to_str().context("path")?,
        ],
    )?;
    let mut faulty = faulty;
    faulty.wait_log("serving row", Duration::from_secs(120))?;
    let stopped = [up.node_pid(1)?];
    let resume: Vec<_> = stopped
        .iter()
        .map(|&pid| {
            tests::procs::signal(pid, "STOP");
            tests::procs::Resume(pid)
        })
        .collect();
    // An admitted leader forms its group now, from the live rows: the liar's among them.
    let (key, cert) = tests::procs::admit(&data.join("mesh.key"), &dir, "leader")?;
    let faulty_peer = faulty
        .log()
        .lines()
        .find_map(|l| {
            l.split(" as ")
                .nth(1)
                .filter(|_| l.starts_with("serving row"))
        })
        .map(str::to_string)
        .context("the faulty node's peer id")?;
    let caught = |s: &serde_json::Value| {
        s["nodes"].as_array().is_some_and(|n| {
            n.iter()
                .any(|n| n["peer"] == faulty_peer.as_str() && !n["caught"].is_null())
        })
    };
    let caught_deadline = Instant::now() + Duration::from_secs(90);
    while !caught(&status(&bootstrap)?) {
        ensure!(
            Instant::now() < caught_deadline,
            "the lying holder was never caught:\n{}",
            faulty.log()
        );
        let out = std::process::Command::new(tests::procs::bin())
            .args(["generate", "--bootstrap", &bootstrap, "--no-learning"])
            .args([
                "--prompt",
                "a liar in the group",
                "--max-tokens",
                "6",
                "--check",
                "2",
            ])
            .arg("--identity")
            .arg(&key)
            .arg("--cert")
            .arg(&cert)
            .output()?;
        eprintln!(
            "red team: an admitted leader's request: {}",
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .filter(|l| {
                    ["group ", "caught", "reported", "error", "unavailable"]
                        .iter()
                        .any(|w| l.contains(w))
                })
                .collect::<Vec<_>>()
                .join("; ")
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    drop(resume);

    let liar_phase = attacks_began.elapsed() - network;
    let (done1, tokens1) = client.counts();
    let failures = client.failed.load(Ordering::Relaxed);
    let errors = client.errors.lock().map(|e| e.clone()).unwrap_or_default();
    drop(client);
    watching.store(false, Ordering::Relaxed);
    let _ = watcher.join();

    // Every attack counted with its reason on the node attacked.
    let m = metrics()?;
    for reason in [
        "unadmitted",
        "out_of_turn",
        "ungated",
        "malformed",
        "signature",
        "oversized",
        "report_unadmitted",
    ] {
        let n = sample(
            &m,
            "codedmesh_refused_total",
            &format!("reason=\"{reason}\""),
        );
        ensure!(n >= 1.0, "no refusal counted as {reason}:\n{m}");
    }
    let places = tests::procs::metric(&m, "codedmesh_heartbeats_refused_total").unwrap_or(0.0);
    ensure!(
        places >= 1.0,
        "the heartbeats with a coordinate out of range were not refused:\n{m}"
    );
    let frames = sample(&m, "codedmesh_frames_refused_total", "reason=\"oversized\"");
    ensure!(
        frames >= 1.0,
        "the oversized frame was not refused: {frames}"
    );
    let undecodable = sample(
        &m,
        "codedmesh_frames_refused_total",
        "reason=\"undecodable\"",
    );
    ensure!(
        undecodable >= 1.0,
        "the join near 60 peers was not refused as undecodable: {undecodable}"
    );
    let over = sample(
        &m,
        "codedmesh_api_key_total",
        "key=\"flood\",what=\"over_budget\"",
    );
    ensure!(over >= 1.0, "the flooding key's budget never ran out:\n{m}");
    let taught = sample(
        &m,
        "codedmesh_api_key_total",
        "key=\"alice\",what=\"taught\"",
    );
    ensure!(taught >= 1.0, "alice's requests stopped teaching:\n{m}");

    // No honest holder excluded; the liar is; every honest holder comes to one version (the
    // one that was stopped catches up).
    let settle_by = Instant::now() + Duration::from_secs(90);
    loop {
        let s = status(&bootstrap)?;
        let nodes = s["nodes"].as_array().context("nodes")?;
        let mut digests = std::collections::BTreeSet::new();
        let mut healthy = 0;
        for n in nodes {
            let peer = n["peer"].as_str().unwrap_or_default();
            if peer == faulty_peer {
                ensure!(!n["caught"].is_null(), "the liar is not excluded: {n}");
                continue;
            }
            ensure!(n["caught"].is_null(), "an honest holder was excluded: {n}");
            if honest.contains_key(peer) && n["health"] == "Healthy" {
                healthy += 1;
                digests.insert(n["version_digest"].as_str().unwrap_or_default().to_string());
            }
        }
        if healthy == honest.len() && digests.len() == 1 {
            break;
        }
        ensure!(
            Instant::now() < settle_by,
            "honest holders not on one version ({healthy} healthy, {} versions): {s}",
            digests.len()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    let peak = peak.load(Ordering::Relaxed);
    ensure!(
        peak < MEMORY_BOUND,
        "a node's resident memory reached {peak} bytes, past {MEMORY_BOUND}"
    );
    ensure!(
        failures == 0,
        "the client's stream failed {failures} times during the attacks: {errors:?}"
    );
    let rate = |tokens: u64, t: Duration| tokens as f64 / t.as_secs_f64();
    let (calm_rate, net_rate, liar_rate) = (
        rate(tokens0 - tokens_start, calm),
        rate(tokens_net - tokens0, network),
        rate(tokens1 - tokens_net, liar_phase),
    );
    eprintln!(
        "red team: the client's stream {calm_rate:.1} tok/s before the attacks ({} requests in {:.1} s), {net_rate:.1} tok/s under the network attacks ({} requests in {:.1} s, {:.2}x), {liar_rate:.1} tok/s while a member is stopped and the liar joins ({} requests in {:.1} s, {:.2}x); peak node memory {:.0} MiB",
        done0 - done_start,
        calm.as_secs_f64(),
        done_net - done0,
        network.as_secs_f64(),
        net_rate / calm_rate,
        done1 - done_net,
        liar_phase.as_secs_f64(),
        liar_rate / calm_rate,
        peak as f64 / (1 << 20) as f64
    );
    Ok(())
}
