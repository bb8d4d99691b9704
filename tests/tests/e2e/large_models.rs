//! A model of a real size on this machine: a random-weight file of Llama-3.2-1B's shape
//! (scripts/shape_files.py, Q4_K_M, 0.8 GB) served by `codedmesh up` as a newcomer starts it.
//! Encoding it takes no more than the file and a gigabyte, and each node, the API's leader
//! included, holds no more than 1.25 × its row + its KV caches + 300 MB (issue 58's bounds; the
//! leader also its optimiser's state, six copies of the model's adapters: 97 MB here),
//! read from each node's `/metrics` after a request has been served and trained on, and from
//! its peak (`VmHWM`, loading, serving, the training pass and its update included). Then a
//! browser holds a row of it: "Contribute this GPU" in headless Chromium copies a row of
//! hundreds of MB, keeps it in IndexedDB, uploads it to WebGPU, and computes coded steps of a
//! leader's request once the native holder of its row is stopped.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use tests::procs::{Resume, Scratch, free_port, signal};

use crate::api::{Up, metric, post, status};
use crate::browser::{
    open_browser_with, start_driver_in, steps_answered, steps_on_webgpu, wait_text_within,
};

/// Issue 58's allowances: a node's row times this, plus its KV caches and this many bytes.
const ROW_FACTOR: f64 = 1.25;
const OVERHEAD: f64 = 300e6;
/// Genesis's: the model file and this many bytes.
const ENCODE_ALLOWANCE: f64 = 1e9;

/// Llama-3.2-1B's KV cache per token: 16 layers × keys and values × 512 × 4 bytes.
const KV_PER_TOKEN: f64 = 16.0 * 2.0 * 512.0 * 4.0;

/// Llama-3.2-1B's adapters (`A`, `out × rank` f32 per coded matrix): 16 layers × (q 2048, k 512,
/// v 512, o 2048, gate 8192, up 8192, down 2048) outputs, and the tied LM head's 128,256 rows.
/// The trainer keeps its state for every adapter, trained or not.
const ADAPTER_BYTES: f64 =
    (16.0 * 23_552.0 + 128_256.0) * node_core::coded::ADAPTER_RANK as f64 * 4.0;
/// The trainer's optimiser state beside its pass, in adapters' worth: Adam's two moments, the
/// two it keeps from before a DiLoCo round until the round's update is out or refused, and the
/// outer Nesterov momentum with its copy from before the round (docs/models.md).
const LEARNER_COPIES: f64 = 6.0;

/// A process's resident memory now and at its peak, in bytes.
fn memory(pid: u32) -> Result<(f64, f64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kib = |key: &str| -> Result<f64> {
        let line = status
            .lines()
            .find(|l| l.starts_with(key))
            .with_context(|| format!("{key} of process {pid}"))?;
        let v: f64 = line
            .split_whitespace()
            .nth(1)
            .context(key.to_string())?
            .parse()?;
        Ok(v * 1024.0)
    };
    Ok((kib("VmRSS:")?, kib("VmHWM:")?))
}

/// Most a node of `up`'s mesh may take to log its HTTP address after `up` is ready: `up` is
/// ready once k rows have been healthy for a minute, and a node still loading its row (a 1B
/// row under a loaded CI run: "node 2 logged no HTTP address", once) logs it when it serves.
const NODE_API_WITHIN: Duration = Duration::from_secs(300);

/// The HTTP port a node of `up`'s mesh logged (`api: http://127.0.0.1:PORT/v1`), waiting
/// [`NODE_API_WITHIN`] for it.
pub(crate) fn node_port(data: &Path, node: usize) -> Result<u16> {
    let start = Instant::now();
    loop {
        let log = std::fs::read_to_string(data.join(format!("node{node}.log"))).unwrap_or_default();
        let port = log
            .lines()
            .find_map(|l| l.trim().strip_prefix("api: http://127.0.0.1:"))
            .and_then(|rest| rest.split('/').next());
        if let Some(port) = port {
            return Ok(port.parse()?);
        }
        ensure!(
            start.elapsed() < NODE_API_WITHIN,
            "node {node} logged no HTTP address in {NODE_API_WITHIN:?}:\n{log}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Waits until the leader of `up`'s mesh in `data` (API on `port`) has trained on the request and its update was
/// published and applied by every node, or refused by the canary gate (a random-weight model
/// may well get worse); no honest member may have been convicted meanwhile.
fn settle_learning(up: &Up, data: &Path, port: u16) -> Result<String> {
    let ports: Vec<u16> = (1..4)
        .map(|node| node_port(data, node))
        .collect::<Result<_>>()?;
    let start = Instant::now();
    loop {
        let trained = metric(port, "codedmesh_train_trained_total")?;
        let published = metric(port, "codedmesh_updates_published_total")?;
        let refused = metric(port, "codedmesh_updates_refused_total")?;
        let mut applied = vec![metric(port, "codedmesh_updates_applied_total")?];
        for &p in &ports {
            applied.push(metric(p, "codedmesh_updates_applied_total")?);
        }
        let caught = metric(port, "codedmesh_members_caught_total")?;
        ensure!(
            caught == 0.0,
            "the leader convicted {caught} members of a mesh of honest nodes:\n{}",
            up.log()
        );
        if trained >= 1.0 && published + refused >= 1.0 && applied.iter().all(|&a| a >= published) {
            return Ok(format!(
                "trained {trained}, published {published}, refused {refused}, applied {applied:?}"
            ));
        }
        ensure!(
            start.elapsed() < Duration::from_secs(900),
            "the request was not trained on and settled: trained {trained}, published \
             {published}, refused {refused}, applied {applied:?}\n{}",
            up.log()
        );
        std::thread::sleep(Duration::from_secs(2));
    }
}

#[test]
fn a_1b_shape_mesh_encodes_and_serves_within_its_memory_bounds() -> Result<()> {
    let _machine = crate::machine::share();
    let Some(python) = crate::architectures::llama_python() else {
        tests::procs::skip(
            "the 1B-shape mesh: no llama.cpp Python to write its file (scripts/test.sh builds it)",
        );
        return Ok(());
    };
    let scratch = Scratch::new("shape-1b");
    let dir = scratch.0.clone();
    let file = dir.join("llama-1b-shape.Q4_K_M.gguf");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/shape_files.py");
    let status = Command::new(&python)
        .arg(&script)
        .args(["1b"])
        .arg(&file)
        .status()?;
    ensure!(status.success(), "{} failed", script.display());
    let file_bytes = std::fs::metadata(&file)?.len() as f64;

    let data = dir.join("mesh");
    let port = free_port()?;
    let steps = dir.join("steps.jsonl");
    let mut up = Up::start_model(&dir, &data, port, &steps, "up1b", &file, &[])?;
    // Ready once every row is healthy, or k rows have been for a minute: the line says which.
    eprintln!("{}", up.ready(Duration::from_secs(1500))?);
    // up's own peak is genesis's: after it, up only supervises.
    let (_, encode_peak) = memory(up.pid())?;
    eprintln!(
        "genesis: peak {:.2} GB for a file of {:.2} GB",
        encode_peak / 1e9,
        file_bytes / 1e9
    );
    ensure!(
        encode_peak <= file_bytes + ENCODE_ALLOWANCE,
        "encoding took {encode_peak} bytes, over the file's {file_bytes} + 1 GB"
    );

    // A prompt of a few hundred tokens: its prefill runs in passes, and training on it takes
    // the leader's whole pass budget.
    let passage = "The river Loire rises in the Massif Central and flows north and then west \
                   for more than a thousand kilometres, past Orleans, Blois, Tours and Angers, \
                   to reach the Atlantic at Saint-Nazaire. ";
    let request = serde_json::json!({
        "model": "llama-1b-shape.Q4_K_M",
        "prompt": passage.repeat(2),
        "max_tokens": 8,
        "temperature": 0,
    });
    let body = post(port, "/v1/completions", &request.to_string())?;
    let answer: serde_json::Value = serde_json::from_str(&body)?;
    let tokens = answer["usage"]["total_tokens"]
        .as_f64()
        .context("the answer's usage")?;
    ensure!(
        answer["usage"]["completion_tokens"].as_u64() == Some(8),
        "8 tokens generated: {body}"
    );
    let settled = settle_learning(&up, &data, port)?;
    eprintln!("learning: {settled}");

    let pids = up.node_pids();
    ensure!(pids.len() == 4, "up started 4 nodes: {pids:?}");
    for (node, pid) in pids {
        let http = if node == 0 {
            port
        } else {
            node_port(&data, node)?
        };
        let row = metric(http, "codedmesh_row_bytes")?;
        let resident = metric(http, "codedmesh_resident_memory_bytes")?;
        let (_, peak) = memory(pid as u32)?;
        // Only the leader (node 0, the API's) holds a KV cache, and it trains: its optimiser
        // state follows the model's adapters, not its row.
        let (kv, learner) = if node == 0 {
            (tokens * KV_PER_TOKEN, LEARNER_COPIES * ADAPTER_BYTES)
        } else {
            (0.0, 0.0)
        };
        let bound = ROW_FACTOR * row + kv + learner + OVERHEAD;
        eprintln!(
            "node {node}: row {:.2} GB, resident {:.2} GB, peak {:.2} GB, bound {:.2} GB",
            row / 1e9,
            resident / 1e9,
            peak / 1e9,
            bound / 1e9
        );
        ensure!(row > 0.0, "node {node} reports its row's bytes");
        ensure!(
            resident <= bound && peak <= bound,
            "node {node} holds {resident} bytes (peak {peak}) for a row of {row}: over {bound}"
        );
    }
    a_browser_holds_a_row(&up, port, &data, &dir)
}

/// "Contribute this GPU" on `up`'s dashboard: the page's node copies a row, keeps it in
/// IndexedDB and serves it on WebGPU; then, its row's native holder stopped, a leader's request
/// on every row is computed partly by the browser.
fn a_browser_holds_a_row(up: &Up, api_port: u16, data: &Path, dir: &Path) -> Result<()> {
    let ports = mesh_ports(data)?;
    // The page is served by, and its node dials, the last node: the row it is offered (a
    // replica of the thinnest, row 0 here) is held by another, which can stop.
    let via = ports.len() - 1;
    let dashboard = format!("http://127.0.0.1:{}/", node_port(data, via)?);
    let driver = start_driver_in(dir, None)?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let c = open_browser_with(&driver, "1b", &[]).await?;
        let r = async {
            let serving = contribute(&c, &dashboard, Duration::from_secs(1500)).await?;
            ensure!(
                serving.contains(" on browser WebGPU"),
                "the browser serves a row of the 1B shape on WebGPU: {serving}"
            );
            let row: usize = serving
                .strip_prefix("serving row ")
                .and_then(|r| r.split(' ').next())
                .and_then(|r| r.parse().ok())
                .with_context(|| format!("no row in {serving:?}"))?;
            ensure!(
                row != via,
                "the browser took row {row}, the row of the node it dials"
            );
            let kept_mib: f64 = serving
                .split("; ")
                .last()
                .and_then(|k| k.strip_suffix(" MiB kept in this browser's storage"))
                .and_then(|k| k.parse().ok())
                .with_context(|| format!("the page does not say what it keeps: {serving:?}"))?;
            // The row the page keeps is the one the native holder of that row holds.
            let http = if row == 0 {
                api_port
            } else {
                node_port(data, row)?
            };
            let row_bytes = metric(http, "codedmesh_row_bytes")?;
            let kept = kept_mib * 1048576.0;
            eprintln!(
                "the browser keeps {:.2} GB of row {row} ({:.2} GB in a native node's memory)",
                kept / 1e9,
                row_bytes / 1e9
            );
            ensure!(
                kept >= 0.9 * row_bytes && kept <= 1.25 * row_bytes,
                "the browser keeps {kept} bytes for a row of {row_bytes}"
            );
            computes_for_a_leader(up, &c, row, &ports).await
        }
        .await;
        let _ = c.close().await;
        r
    })
}

/// The libp2p TCP port of each node of `up`'s mesh in `data`.
pub(crate) fn mesh_ports(data: &Path) -> Result<Vec<u64>> {
    let mesh: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(data.join("mesh.json"))?)?;
    let ports: Vec<u64> = (mesh["ports"].as_array())
        .map(|p| p.iter().filter_map(serde_json::Value::as_u64).collect())
        .unwrap_or_default();
    ensure!(ports.len() >= 2, "mesh.json lists the nodes' ports: {mesh}");
    Ok(ports)
}

/// Whether `status --json`'s node `nd` is a browser.
pub(crate) fn browser(nd: &serde_json::Value) -> bool {
    nd["device"].as_str().unwrap_or("").starts_with("browser")
}

/// Whether `status --json`'s node `nd` is reached through a relay (a circuit address).
pub(crate) fn relayed(nd: &serde_json::Value) -> bool {
    nd["addrs"].as_array().is_some_and(|a| {
        a.iter()
            .any(|a| a.as_str().unwrap_or("").contains("/p2p-circuit/"))
    })
}

/// Opens `dashboard` in `c`, waits for the mesh to be available and presses "Contribute this
/// GPU": the page's contribution line once it serves a row (or says it could not), within
/// `within` of the click.
pub(crate) async fn contribute(
    c: &fantoccini::Client,
    dashboard: &str,
    within: Duration,
) -> Result<String> {
    c.goto(dashboard).await?;
    let yes = |t: &str| t.starts_with("model available: yes");
    wait_text_within(c, "#summary", yes, "the mesh", Duration::from_secs(90)).await?;
    let started = Instant::now();
    c.find(fantoccini::Locator::Css("#contribute"))
        .await?
        .click()
        .await?;
    let serving = wait_text_within(
        c,
        "#contribution",
        |t| t.starts_with("serving row") || t.contains("could not"),
        "the browser serving a row",
        within,
    )
    .await?;
    eprintln!(
        "the page says, {:.1} s after the click: {serving}",
        started.elapsed().as_secs_f64()
    );
    Ok(serving)
}

/// Waits until `status` through `bootstrap` shows a node that `ok` accepts (`what`, for the
/// error after 90 s).
pub(crate) async fn wait_for_node(
    bootstrap: &str,
    what: &str,
    ok: impl Fn(&serde_json::Value) -> bool,
) -> Result<()> {
    let start = Instant::now();
    loop {
        let s = status(bootstrap)?;
        if s["nodes"].as_array().is_some_and(|n| n.iter().any(&ok)) {
            return Ok(());
        }
        ensure!(
            start.elapsed() < Duration::from_secs(90),
            "status never showed {what}: {s}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Stops the native holder of the browser's row `row` and runs a leader's request on every row
/// (k decoded, the rest checked): the browser, its row's only live holder, answers steps.
async fn computes_for_a_leader(
    up: &Up,
    c: &fantoccini::Client,
    row: usize,
    ports: &[u64],
) -> Result<()> {
    let n = ports.len();
    // The leader and `status` go through a node that keeps running.
    let other = format!("/ip4/127.0.0.1/tcp/{}", ports[(row + 1) % n]);
    // The mesh knows the browser's row and how to reach it (its relay circuit) first.
    wait_for_node(&other, "the browser's row healthy behind its relay", |nd| {
        nd["row"] == row && browser(nd) && nd["health"] == "Healthy" && relayed(nd)
    })
    .await?;
    let before = steps_answered(&crate::browser::text(c, "#contribution").await);
    let pid = up.node_pid(row)?;
    signal(pid, "STOP");
    let _resume = Resume(pid);
    wait_for_node(&other, "the stopped native holder's row unhealthy", |nd| {
        nd["row"] == row && !browser(nd) && nd["health"] != "Healthy"
    })
    .await?;
    let checks = (n - 2).to_string();
    let out = Command::new(tests::procs::bin())
        .args(["generate", "--bootstrap", &other])
        .args(["--prompt", "The river Loire", "--max-tokens", "1"])
        .args(["--check", &checks, "--spares", "0", "--no-learning"])
        .env("RUST_LOG", "warn,libp2p_kad=error")
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    eprintln!(
        "a leader on every row, the browser's among them: {:?}\n{err}",
        String::from_utf8_lossy(&out.stdout)
    );
    ensure!(out.status.success(), "the request failed:\n{err}");
    let group: Vec<usize> = err
        .split_once("group [")
        .and_then(|(_, rest)| rest.split_once(']'))
        .map(|(g, _)| g.split(',').filter_map(|r| r.trim().parse().ok()).collect())
        .unwrap_or_default();
    ensure!(
        group.len() == n && group.contains(&row),
        "the leader's group is every row, the browser's row {row} among them:\n{err}"
    );
    ensure!(
        !err.contains(" caught on "),
        "nobody is caught, the browser included:\n{err}"
    );
    let after = wait_text_within(
        c,
        "#contribution",
        |t| steps_answered(t) > before,
        "the browser answering the leader's steps",
        Duration::from_secs(90),
    )
    .await?;
    eprintln!("the page says: {after}");
    // Products of this size go to WebGPU.
    ensure!(
        steps_on_webgpu(&after) > 0,
        "the browser computes its row's products on WebGPU: {after}"
    );
    Ok(())
}
