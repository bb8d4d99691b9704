//! `codedmesh up` end to end, on the tiny test model: five node processes under a supervisor,
//! driven through the OpenAI-compatible API by the official `openai` Python client
//! (tests/python/openai_api.py: a greedy completion equal to the uncoded model's, a streamed
//! chat, errors, 429s under a burst, the WebSocket, /metrics), then the step trace, learning
//! through the API, a clean Ctrl-C, a restart from the kept data, and a crashed node restarted
//! by the supervisor.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use node_core::code::Generator;
use node_core::coded::{CodedGroup, InProcess, ShardFormat};
use node_core::lead::generate;
use node_core::model::{GenerateOptions, Llama, SamplingParams};
use tests::procs::{Scratch, bin, free_port, tiny_model};

const KEY: &str = "test-key";

/// A Python with the `openai`, `websockets` and `jsonschema` packages: `$CODEDMESH_PYTHON` (the
/// test command makes one), else `python3` if it has them.
fn python() -> Option<PathBuf> {
    let candidates = std::env::var_os("CODEDMESH_PYTHON")
        .map(PathBuf::from)
        .into_iter()
        .chain([PathBuf::from("python3")]);
    for p in candidates {
        let ok = Command::new(&p)
            .args(["-c", "import openai, websockets, jsonschema"])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            return Some(p);
        }
    }
    None
}

/// `codedmesh up`, its stdout read line by line, its stderr in a file.
pub(crate) struct Up {
    child: Child,
    lines: mpsc::Receiver<String>,
    log: PathBuf,
}

impl Up {
    /// `codedmesh up` on the tiny model in the shape it picks for this machine (k = 3 of 5,
    /// or 2 of 4 below three cores, its sessions polling: what a newcomer's `up` runs).
    fn start(dir: &Path, data: &Path, port: u16, steps: &Path, name: &str) -> Result<Self> {
        let args = ["--max-batch", "2", "--queue", "2"];
        Self::start_with(
            dir,
            data,
            port,
            steps,
            name,
            &[&args[..], &["--api-key", KEY]].concat(),
        )
    }

    /// `codedmesh up` on the tiny model with these arguments.
    pub(crate) fn start_with(
        dir: &Path,
        data: &Path,
        port: u16,
        steps: &Path,
        name: &str,
        args: &[&str],
    ) -> Result<Self> {
        Self::start_model(dir, data, port, steps, name, &tiny_model(), args)
    }

    /// `codedmesh up` on `model` with these arguments.
    pub(crate) fn start_model(
        dir: &Path,
        data: &Path,
        port: u16,
        steps: &Path,
        name: &str,
        model: &Path,
        args: &[&str],
    ) -> Result<Self> {
        let log = dir.join(format!("{name}.log"));
        let web = Path::new(env!("CARGO_MANIFEST_DIR")).join("../web-ui/dist");
        let mut child = Command::new(bin())
            .args(["up", "--no-build-web"])
            .args(args)
            .arg("--model")
            .arg(model)
            .arg("--data")
            .arg(data)
            .args(["--port", &port.to_string()])
            .arg("--trace-steps")
            .arg(steps)
            .arg("--web-dir")
            .arg(web)
            .env("RUST_LOG", "warn,libp2p_kad=error")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log)?)
            .spawn()
            .context("starting codedmesh up")?;
        let stdout = child.stdout.take().context("stdout")?;
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        Ok(Self { child, lines, log })
    }

    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The process id of `up` itself.
    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The ready line, once it comes.
    pub(crate) fn ready(&mut self, timeout: Duration) -> Result<String> {
        let start = Instant::now();
        loop {
            match self.lines.recv_timeout(Duration::from_millis(200)) {
                Ok(line) if line.starts_with("ready: ") => return Ok(line),
                Ok(_) => {}
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    bail!("up ended before it was ready:\n{}", self.log())
                }
            }
            if start.elapsed() > timeout {
                bail!("up was not ready in {timeout:?}:\n{}", self.log());
            }
        }
    }

    fn signal(&self, sig: &str) {
        let _ = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.child.id().to_string())
            .status();
    }

    /// Sends `sig` and waits for a clean exit.
    pub(crate) fn stop(&mut self, sig: &str) -> Result<()> {
        self.signal(sig);
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait()? {
                ensure!(status.success(), "up exited with {status}:\n{}", self.log());
                return Ok(());
            }
            if start.elapsed() > Duration::from_secs(40) {
                bail!("up did not stop within 40 s of {sig}:\n{}", self.log());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The pid of the latest process it started for node `node`.
    pub(crate) fn node_pid(&self, node: usize) -> Result<u32> {
        self.node_pids()
            .into_iter()
            .find(|&(nd, _)| nd == node)
            .map(|(_, pid)| pid as u32)
            .with_context(|| format!("node {node}'s pid"))
    }

    /// The pids of the nodes it started, by node, latest first.
    pub(crate) fn node_pids(&self) -> Vec<(usize, i32)> {
        let mut out: Vec<(usize, i32)> = self
            .log()
            .lines()
            .filter_map(|l| {
                let rest = l.strip_prefix("supervisor: started node ")?;
                let (node, pid) = rest.split_once(" (pid ")?;
                Some((node.parse().ok()?, pid.trim_end_matches(')').parse().ok()?))
            })
            .collect();
        out.reverse();
        out
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            self.signal("TERM");
            let deadline = Instant::now() + Duration::from_secs(20);
            while Instant::now() < deadline && matches!(self.child.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A field of the ready line: the word after `key`.
pub(crate) fn field<'a>(line: &'a str, key: &str) -> Result<&'a str> {
    line.split(key)
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .with_context(|| format!("no {key:?} in {line:?}"))
}

pub(crate) fn status(bootstrap: &str) -> Result<serde_json::Value> {
    let out = Command::new(bin())
        .args(["status", "--json", "--bootstrap", bootstrap])
        .output()?;
    ensure!(
        out.status.success(),
        "status failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// Waits until `status` shows `rows` healthy rows at one version; returns that version count.
fn wait_healthy(bootstrap: &str, rows: u64, timeout: Duration) -> Result<u64> {
    let start = Instant::now();
    loop {
        let s = status(bootstrap)?;
        let healthy = s["healthy_rows"].as_u64().unwrap_or(0);
        let lag_free = s["nodes"]
            .as_array()
            .is_some_and(|n| n.iter().all(|n| n["lag"].as_u64() == Some(0)));
        if healthy == rows && lag_free {
            return Ok(s["version_count"].as_u64().unwrap_or(0));
        }
        if start.elapsed() > timeout {
            bail!("not {rows} healthy rows at one version within {timeout:?}: {s}");
        }
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// The uncoded tiny model's log-probability of each token of `ids` after the first (the
/// log-softmax of its raw logits at the position before).
fn uncoded_scores(ids: &[u32]) -> Result<Vec<f32>> {
    let model = node_native::load::load_model(&tiny_model())?;
    let g = Generator::uncoded();
    let mesh = InProcess::encode(&model.weights, &g, ShardFormat::F32, &|_, _| {})?;
    let mut group = CodedGroup::new(model.weights.cfg.clone(), g, &[0], mesh)?;
    let cfg = model.weights.cfg.clone();
    let llama = Llama::new(
        cfg.clone(),
        node_core::model::LeaderWeights::from_model(&model.weights),
    )?;
    let mut cache = node_core::model::KvCache::new(&cfg);
    let mut items = [node_core::model::BatchItem {
        logits: ids.len(),
        ..node_core::model::BatchItem::new(ids, &mut cache)
    }];
    let logits = futures::executor::block_on(llama.forward_batch(&mut group, &mut items))?;
    let rows = logits.first().context("no logits")?;
    Ok((rows.chunks(cfg.vocab))
        .zip(&ids[1..])
        .map(|(row, &t)| node_core::model::token_logprob(row, t, 0).logprob)
        .collect())
}

/// The uncoded tiny model's greedy completion of `prompt`: (prompt ids, completion ids, text).
fn uncoded_greedy(prompt: &str, tokens: usize) -> Result<(Vec<u32>, Vec<u32>, String)> {
    let model = node_native::load::load_model(&tiny_model())?;
    let ids = model.tokenizer.encode(prompt)?;
    let g = Generator::uncoded();
    let mesh = InProcess::encode(&model.weights, &g, ShardFormat::F32, &|_, _| {})?;
    let mut group = CodedGroup::new(model.weights.cfg.clone(), g, &[0], mesh)?;
    let llama = Llama::new(
        model.weights.cfg.clone(),
        node_core::model::LeaderWeights::from_model(&model.weights),
    )?;
    let opts = GenerateOptions {
        max_tokens: tokens,
        sampling: SamplingParams::default(),
        stop_ids: model.tokenizer.eos_ids().to_vec(),
        draft: 0,
    };
    let out = generate(&llama, &mut group, &ids, &opts, &mut |_| true)?;
    let text = model.tokenizer.decode(&out.tokens)?;
    Ok((ids, out.tokens, text))
}

#[test]
fn up_serves_the_openai_api_learns_stops_restarts_and_supervises() -> Result<()> {
    let _machine = crate::machine::share();
    let Some(python) = python() else {
        tests::procs::skip(
            "the OpenAI API test: no Python with the openai, websockets and jsonschema packages \
             (scripts/test.sh makes one, or set CODEDMESH_PYTHON)",
        );
        return Ok(());
    };
    let scratch = Scratch::new("api");
    let dir = scratch.0.clone();
    let data = dir.join("mesh");
    let steps = dir.join("steps.jsonl");
    let port = free_port()?;
    let mut up = Up::start(&dir, &data, port, &steps, "up")?;
    let ready = up.ready(Duration::from_secs(180))?;
    eprintln!("{ready}");
    let api = field(&ready, "OpenAI API ")?.to_string();
    let model = field(&ready, "model ")?.to_string();
    let bootstrap = field(&ready, "bootstrap ")?.to_string();
    // "· 5 nodes, k = 3, …": the shape `up` picked for this machine.
    let nodes: u64 = ready
        .split(" · ")
        .find_map(|part| part.split_once(" nodes, ")?.0.parse().ok())
        .with_context(|| format!("no node count in: {ready}"))?;
    let (k, n) = node_native::up::default_shape(node_native::up::supervise::cores(), None, None);
    ensure!(
        nodes == n as u64 && ready.contains(&format!(" nodes, k = {k},")),
        "up picked k = {k} of {n} for this machine: {ready}"
    );
    ensure!(
        api == format!("http://127.0.0.1:{port}/v1"),
        "the API is on the asked port: {api}"
    );
    ensure!(
        up.log().contains("encoding"),
        "the first up encodes the model:\n{}",
        up.log()
    );

    // The official client, against the mesh.
    let prompt = "The mesh";
    let (prompt_ids, completion_ids, completion_text) = uncoded_greedy(prompt, 16)?;
    // What an echo of the prompt and its completion scores, uncoded.
    let text_ids = [&prompt_ids[..], &completion_ids[..]].concat();
    let scores = uncoded_scores(&text_ids)?;
    let expected = dir.join("expected.json");
    std::fs::write(
        &expected,
        serde_json::json!({
            "prompt": prompt,
            "prompt_ids": prompt_ids,
            "completion_ids": completion_ids,
            "completion_text": completion_text,
            "text_ids": text_ids,
            "text_logprobs": scores,
            "burst": 12,
        })
        .to_string(),
    )?;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/openai_api.py");
    let out = Command::new(&python)
        .arg(&script)
        .arg(&api)
        .arg(KEY)
        .arg(&model)
        .arg(&expected)
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    eprintln!("{stdout}");
    ensure!(
        out.status.success(),
        "the openai client's checks failed:\n{stdout}\n{}\nup's log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        up.log()
    );

    // The step trace: every coded step of the requests, with member, bytes and duration.
    let trace = std::fs::read_to_string(&steps)?;
    let records: Vec<serde_json::Value> = trace
        .lines()
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()
        .context("the step trace is JSON lines")?;
    let with = |step: &str| records.iter().filter(|r| r["step"] == step).count();
    ensure!(
        with("embedding") > 0 && with("Qkv(0)") > 0 && with("LmHead") > 0,
        "the trace has forward steps ({} records)",
        records.len()
    );
    ensure!(
        with("Down(1) backward") > 0,
        "the trace has the training's backward steps"
    );
    ensure!(
        records.iter().any(|r| r["local"] == true) && records.iter().any(|r| r["local"] == false),
        "the trace shows the API node's own row and remote members"
    );
    ensure!(
        records
            .iter()
            .all(|r| r["ms"].as_f64().is_some_and(|m| m >= 0.0)
                && r["bytes_sent"].as_u64().is_some_and(|b| b > 0)
                && r["member"].as_u64().is_some_and(|m| m < nodes)),
        "every record has a duration, bytes and a member"
    );
    ensure!(
        records
            .iter()
            .any(|r| r["context"].as_str().is_some_and(|c| c.contains("req"))),
        "records name their requests"
    );

    // Every request trained the mesh (but the two that asked not to): the mesh's usage counts
    // each trained request once its minibatch went into an update, and every row holds the
    // same updates.
    let summary: serde_json::Value = stdout
        .lines()
        .last()
        .and_then(|l| serde_json::from_str(l).ok())
        .context("the script's last line is its JSON summary")?;
    let served = summary["metrics"]["codedmesh_requests_total"]
        .as_f64()
        .context("requests_total in the summary")? as u64;
    let untrained = summary["untrained"].as_u64().context("untrained")?;
    let start = Instant::now();
    loop {
        let s = status(&bootstrap)?;
        let u = &s["usage"];
        let (requests, trained) = (
            u["requests"].as_u64().unwrap_or(0),
            u["trained"].as_u64().unwrap_or(0),
        );
        if requests >= served && trained + untrained == requests {
            break;
        }
        ensure!(
            start.elapsed() < Duration::from_secs(90),
            "not every request trained: {requests} served ({served} by the script's count), {trained} trained, {untrained} asked not to: {u}"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    let learned = wait_healthy(&bootstrap, nodes, Duration::from_secs(60))?;
    ensure!(
        learned >= 1,
        "the API's requests trained the mesh ({learned} updates)"
    );
    // The leader counts what its updates cost it: the holders it told pulled them from it, at
    // most three copies each (mesh_spread checks the bound on sixteen holders).
    let published = metric(port, "codedmesh_update_bytes_published_total")?;
    let sent = metric(port, "codedmesh_update_bytes_sent_total")?;
    ensure!(
        published > 0.0 && sent >= published && sent <= 3.0 * published,
        "{published} bytes of updates published, {sent} sent"
    );
    let (out, applied) = (
        metric(port, "codedmesh_updates_published_total")?,
        metric(port, "codedmesh_updates_applied_total")?,
    );
    ensure!(
        out >= 1.0 && applied >= 1.0,
        "the API's node counts the updates: {out} published, {applied} applied"
    );
    // The dashboard's learning section: the API's node lists the updates it applied, each with
    // its trainer (a peer id) and the canary verdict it carried, and the anonymous caller's
    // requests trained on.
    let body = tests::procs::http_get(([127, 0, 0, 1], port).into(), "/api/updates")?;
    let seen: node_core::holder::LearningStatus =
        serde_json::from_str(&body).with_context(|| format!("/api/updates: {body}"))?;
    ensure!(
        seen.updates.iter().any(|u| u.applied
            && u.trainer.starts_with("12D3KooW")
            && u.gate.is_some()
            && u.version.is_some()),
        "/api/updates lists an applied update with its trainer and verdict: {body}"
    );
    ensure!(
        seen.keys
            .iter()
            .any(|k| k.trained >= 1 && k.trained <= k.requests),
        "/api/updates counts the requests trained on by key: {body}"
    );
    // Every member is on this machine: the leader's sessions with them run over local sockets
    // (one opened while a restarted node was still starting may have gone over libp2p).
    let (local, libp2p) = (
        metric(port, "codedmesh_sessions_local_total")?,
        metric(port, "codedmesh_sessions_libp2p_total")?,
    );
    eprintln!("sessions: {local} over local sockets, {libp2p} over libp2p");
    ensure!(
        local >= 1.0 && local > libp2p,
        "the leader's sessions ran over local sockets: {local}, over libp2p {libp2p}"
    );
    // Memory follows the row: the leader, after every request above, holds its row, its
    // requests' KV caches and the rest within 1.25 × its row + 300 MB (the KV caches of these
    // short requests are a few MB).
    let row = metric(port, "codedmesh_row_bytes")?;
    let resident = metric(port, "codedmesh_resident_memory_bytes")?;
    eprintln!(
        "leader: row {:.1} MB, resident {:.1} MB",
        row / 1e6,
        resident / 1e6
    );
    ensure!(
        row > 0.0 && resident > row && resident <= 1.25 * row + 300e6,
        "the leader holds {resident} bytes for a row of {row}"
    );

    // Ctrl-C stops every node cleanly.
    let pids: Vec<i32> = up.node_pids().iter().map(|&(_, p)| p).collect();
    ensure!(
        pids.len() as u64 == nodes,
        "up started {nodes} nodes: {pids:?}"
    );
    up.stop("INT")?;
    for pid in &pids {
        ensure!(
            !Path::new(&format!("/proc/{pid}")).exists(),
            "node process {pid} is gone after Ctrl-C"
        );
    }
    ensure!(
        up.log().contains("stopped; the data is kept"),
        "up says it stopped:\n{}",
        up.log()
    );
    drop(up);

    // The next `up` starts from the kept data, at the learnt version.
    let started = Instant::now();
    let mut up = Up::start(&dir, &data, port, &steps, "up2")?;
    up.ready(Duration::from_secs(120))?;
    let restart = started.elapsed();
    ensure!(
        up.log().contains("using the mesh in") && !up.log().contains("encoding"),
        "the second up reuses the rows:\n{}",
        up.log()
    );
    let version = wait_healthy(&bootstrap, nodes, Duration::from_secs(30))?;
    ensure!(
        version == learned,
        "the restarted mesh is at the learnt version ({version} updates, was {learned})"
    );
    eprintln!("restarted in {:.1} s", restart.as_secs_f64());

    // A node that crashes is started again by the supervisor and its row comes back.
    let &(node, pid) = up
        .node_pids()
        .iter()
        .find(|(n, _)| *n == 2)
        .context("node 2's pid")?;
    let _ = Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status();
    let start = Instant::now();
    while !up.node_pids().iter().any(|&(n, p)| n == node && p != pid) {
        ensure!(
            start.elapsed() < Duration::from_secs(30),
            "node {node} was not restarted:\n{}",
            up.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    ensure!(
        up.log().contains(&format!("node {node} crashed")),
        "the supervisor saw the crash:\n{}",
        up.log()
    );
    wait_healthy(&bootstrap, nodes, Duration::from_secs(60))?;
    up.stop("TERM")?;
    Ok(())
}

/// POSTs a JSON body to the API on 127.0.0.1 and returns the response's body (HTTP/1.1,
/// `Connection: close`: the whole answer is read until the server closes).
pub(crate) fn post(port: u16, path: &str, body: &str) -> Result<String> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port))?;
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    let mut answer = String::new();
    s.read_to_string(&mut answer)?;
    let (head, body) = answer.split_once("\r\n\r\n").context("no HTTP header")?;
    ensure!(head.starts_with("HTTP/1.1 200"), "{head}\n{body}");
    Ok(body.to_string())
}

/// A GET of `/metrics`: one metric's value.
pub(crate) fn metric(port: u16, name: &str) -> Result<f64> {
    let text = tests::procs::http_get(([127, 0, 0, 1], port).into(), "/metrics")?;
    tests::procs::metric(&text, name)
}

#[test]
fn up_with_ten_nodes_serves_two_requests_at_once_through_disjoint_holders() -> Result<()> {
    let _machine = crate::machine::share();
    let scratch = Scratch::new("api-groups");
    let dir = scratch.0.clone();
    let data = dir.join("mesh");
    let steps = dir.join("steps.jsonl");
    let port = free_port()?;
    // Ten rows; a group is k = 3 plus one checked row, so two groups fit side by side.
    let args = [
        "--nodes",
        "10",
        "--k",
        "3",
        "--no-learning",
        "--check",
        "1",
        "--spares",
        "0",
    ];
    let mut up = Up::start_with(&dir, &data, port, &steps, "up10", &args)?;
    let ready = up.ready(Duration::from_secs(300))?;
    let model = field(&ready, "model ")?.to_string();
    let ask = move |max_tokens: usize| -> Result<String> {
        let body = format!(
            r#"{{"model": "{model}", "prompt": "The history of the printing press", "max_tokens": {max_tokens}, "temperature": 0}}"#
        );
        post(port, "/v1/completions", &body)
    };
    // The first request forms the first group; the second serving group forms beside it.
    ask(4)?;
    let start = Instant::now();
    while metric(port, "codedmesh_serving_groups")? < 2.0 {
        ensure!(
            start.elapsed() < Duration::from_secs(60),
            "the second group never formed:\n{}",
            up.log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let both: Vec<_> = (0..2)
        .map(|_| {
            let ask = ask.clone();
            std::thread::spawn(move || ask(48))
        })
        .collect();
    for t in both {
        t.join()
            .map_err(|_| anyhow::anyhow!("a request thread panicked"))??;
    }
    // Honest holders on loopback: no step fails (a false alarm of the check would fail one,
    // and its group would be formed again while the other took both requests).
    let failed = metric(port, "codedmesh_forward_step_failures_total")?;
    ensure!(
        failed == 0.0,
        "{failed} forward steps failed:\n{}",
        std::fs::read_to_string(data.join("node0.log")).unwrap_or_default()
    );
    up.stop("INT")?;
    // Requests 2 and 3 ran at once, each on its own group: no holder served both.
    let trace = std::fs::read_to_string(&steps)?;
    let mut peers: [BTreeSet<String>; 2] = Default::default();
    let mut spans = [(f64::MAX, 0.0f64); 2];
    for line in trace.lines() {
        let r: serde_json::Value = serde_json::from_str(line)?;
        let context = r["context"].as_str().unwrap_or_default();
        let Some(reqs) = context.split("req ").nth(1) else {
            continue;
        };
        let reqs: Vec<&str> = reqs.split(',').collect();
        ensure!(
            !(reqs.contains(&"2") && reqs.contains(&"3")),
            "requests 2 and 3 shared a step: {line}"
        );
        for (i, id) in ["2", "3"].iter().enumerate() {
            if reqs.contains(id) {
                peers[i].insert(r["peer"].as_str().unwrap_or_default().to_string());
                let t = r["unix_ms"].as_f64().unwrap_or_default();
                spans[i] = (spans[i].0.min(t), spans[i].1.max(t));
            }
        }
    }
    eprintln!("request 2 on {:?} during {:?}", peers[0], spans[0]);
    eprintln!("request 3 on {:?} during {:?}", peers[1], spans[1]);
    ensure!(
        peers.iter().all(|p| p.len() >= 4),
        "each request ran on k + 1 holders: {peers:?}"
    );
    ensure!(
        peers[0].is_disjoint(&peers[1]),
        "the two requests' groups share holders: {peers:?}"
    );
    ensure!(
        spans[0].0 < spans[1].1 && spans[1].0 < spans[0].1,
        "the two requests ran at once: {spans:?}"
    );
    Ok(())
}

#[test]
fn up_with_pass_hop_serves_a_batch_one_hop_per_stage_with_the_tokens_of_rounds() -> Result<()> {
    let _machine = crate::machine::share();
    let scratch = Scratch::new("api-hop");
    let dir = scratch.0.clone();
    let data = dir.join("mesh");
    let steps = dir.join("steps.jsonl");
    let port = free_port()?;
    // The API's node leads; the hop group is k = 2 plus one checked row of the other nodes.
    let args = ["--no-learning", "--pass", "hop", "--max-batch", "2"];
    let mut up = Up::start_with(&dir, &data, port, &steps, "uphop", &args)?;
    let ready = up.ready(Duration::from_secs(300))?;
    let model = field(&ready, "model ")?.to_string();
    let bootstrap = field(&ready, "bootstrap ")?.to_string();
    let prompts = ["The history of the printing press", "Once upon a time"];
    // What a leader of its own (rounds, no row) makes of the same shards.
    let rounds = |prompt: &str| -> Result<String> {
        let out = Command::new(bin())
            .args(["generate", "--bootstrap", &bootstrap, "--max-tokens", "24"])
            .args(["--prompt", prompt, "--model"])
            .arg(tiny_model())
            .output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        ensure!(
            out.status.success(),
            "generate: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(text.strip_suffix('\n').unwrap_or(&text).to_string())
    };
    let want: Vec<String> = prompts.iter().map(|p| rounds(p)).collect::<Result<_>>()?;
    let ask = move |prompt: &str| -> Result<String> {
        let body = format!(
            r#"{{"model": "{model}", "prompt": "{prompt}", "max_tokens": 24, "temperature": 0}}"#
        );
        let answer: serde_json::Value =
            serde_json::from_str(&post(port, "/v1/completions", &body)?)?;
        answer["choices"][0]["text"]
            .as_str()
            .map(str::to_string)
            .context("no text in the answer")
    };
    // Two at once share passes: the members keep each sequence's keys and values apart.
    let both: Vec<_> = prompts
        .iter()
        .map(|&p| {
            let ask = ask.clone();
            std::thread::spawn(move || ask(p))
        })
        .collect();
    for (t, want) in both.into_iter().zip(&want) {
        let got = t
            .join()
            .map_err(|_| anyhow::anyhow!("a request thread panicked"))??;
        ensure!(
            &got == want,
            "{got:?} against rounds' {want:?}\n{}",
            up.log()
        );
    }
    let hops = metric(port, "codedmesh_hop_steps_total")?;
    let steps_run = metric(port, "codedmesh_forward_steps_total")?;
    let failed = metric(port, "codedmesh_forward_step_failures_total")?;
    up.stop("INT")?;
    ensure!(
        failed == 0.0 && hops == steps_run && hops > 0.0,
        "{hops} of {steps_run} steps went one hop per stage, {failed} failed:\n{}",
        std::fs::read_to_string(data.join("node0.log")).unwrap_or_default()
    );
    Ok(())
}

/// The API's group is every row (k = 2, one checked, one spare: four nodes). A member dies:
/// the group goes on without it, short of a spare. Its node is started again and its row
/// comes back: the group is formed again with it, four members again.
#[test]
fn up_forms_its_group_again_when_a_dead_members_row_comes_back() -> Result<()> {
    let _machine = crate::machine::share();
    let scratch = Scratch::new("api-regroup");
    let dir = scratch.0.clone();
    let (data, steps, port) = (dir.join("mesh"), dir.join("steps.jsonl"), free_port()?);
    let args = [
        "--nodes",
        "4",
        "--k",
        "2",
        "--no-learning",
        "--check",
        "1",
        "--spares",
        "1",
        "--pass",
        "rounds",
    ];
    let mut up = Up::start_with(&dir, &data, port, &steps, "up-regroup", &args)?;
    let ready = up.ready(Duration::from_secs(300))?;
    let model = field(&ready, "model ")?.to_string();
    let bootstrap = field(&ready, "bootstrap ")?.to_string();
    wait_healthy(&bootstrap, 4, Duration::from_secs(60))?;
    // A request's text, and the rows of its group: those whose steps answered, or were
    // outrun by the rest (a spare, or a member whose row is still cold, may be outrun in every
    // step of a request; `{0, 1, 2}` counting answers alone failed once, thought to be this);
    // a dead member's steps fail. And what each member's steps came to, for a failure's message.
    let ask = || {
        let before = std::fs::metadata(&steps).map_or(0, |m| m.len() as usize);
        let body = format!(
            r#"{{"model": "{model}", "prompt": "The history of the printing press", "max_tokens": 16, "temperature": 0}}"#
        );
        let answer: serde_json::Value =
            serde_json::from_str(&post(port, "/v1/completions", &body)?)?;
        let trace = std::fs::read_to_string(&steps)?;
        let lines: Vec<serde_json::Value> = trace[before.min(trace.len())..]
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        let members: BTreeSet<u64> = lines
            .iter()
            .filter(|l| l["outcome"] == "ok" || l["outcome"] == "not needed (outrun)")
            .filter_map(|l| l["member"].as_u64())
            .collect();
        let mut tally = std::collections::BTreeMap::<String, usize>::new();
        for l in &lines {
            *tally
                .entry(format!("{} {}", l["member"], l["outcome"]))
                .or_default() += 1;
        }
        let text = answer["choices"][0]["text"].to_string();
        Ok::<_, anyhow::Error>((text, members, format!("{tally:?}")))
    };
    let count = |name: &str| metric(port, &format!("codedmesh_{name}_total"));
    let (answer, all, tally) = ask()?;
    ensure!(
        all.len() == 4,
        "the whole group computes: {all:?} ({tally})\n{}",
        up.log()
    );

    // Node 2 dies while up's supervisor is stopped (so that it is not started again yet):
    // the first request goes on without it, the next is served short of it.
    let dead = up.node_pid(2)?;
    let signal = |sig: &str, pid: u32| Command::new("kill").args([sig, &pid.to_string()]).status();
    signal("-STOP", up.pid())?;
    signal("-KILL", dead)?;
    let killed = Instant::now();
    let died = ask();
    let short = ask();
    signal("-CONT", up.pid())?;
    let (_, short, tally) = short.with_context(|| format!("{died:?}\n{}", up.log()))?;
    ensure!(
        short.len() == 3,
        "the group went on without the dead member: {short:?} ({tally})"
    );

    // It comes back: once its row's holder is heard from again (after the kill), the next
    // request's group has four members again.
    wait_healthy(&bootstrap, 4, Duration::from_secs(60))?;
    let heard_again = || -> Result<bool> {
        let s = status(&bootstrap)?;
        let since_kill = killed.elapsed().as_secs_f64();
        Ok(s["nodes"].as_array().is_some_and(|n| {
            n.iter().any(|n| {
                n["row"] == 2
                    && n["silent_for_s"]
                        .as_f64()
                        .is_some_and(|s| s + 0.5 < since_kill)
            })
        }))
    };
    while !heard_again()? {
        ensure!(
            killed.elapsed() < Duration::from_secs(60),
            "node 2 was not heard from again"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let (again, back, tally) = ask()?;
    ensure!(again == answer, "the same greedy completion");
    ensure!(
        back.len() == 4 && count("groups_regrouped")? >= 1.0,
        "the group was formed again with the returned row: {back:?} ({tally}), {} regrouped\n{}",
        count("groups_regrouped")?,
        up.log()
    );
    up.stop("TERM")?;
    Ok(())
}
