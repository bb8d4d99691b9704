//! A browser on the mesh `codedmesh up` starts, as a newcomer runs it (compact q8 rows, k and n
//! as `up` picks them for this machine): all but k of `up`'s nodes stop, "Contribute this GPU" in
//! headless Chromium rebuilds that node's row along a chain of k holders (receiving exactly
//! the row's bytes), and the API's next request is computed partly by the browser, with the
//! tokens the mesh gave before.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use tests::procs::{Resume, Scratch, free_port, signal};

use crate::api::{Up, post};
use crate::browser::{open_browser_with, start_driver_in, steps_answered, wait_text_within};
use crate::large_models::{browser, contribute, mesh_ports, node_port, relayed, wait_for_node};

/// A greedy completion through `up`'s API on `port`: its text. It does not train the mesh, so
/// the mesh answers a second one at the same version.
fn complete(port: u16) -> Result<String> {
    let request = serde_json::json!({
        "model": "tiny-llama-hf",
        "prompt": "The history of the printing press begins",
        "max_tokens": 12,
        "temperature": 0,
        "learn": false,
    });
    let body = post(port, "/v1/completions", &request.to_string())?;
    let answer: serde_json::Value = serde_json::from_str(&body)?;
    answer["choices"][0]["text"]
        .as_str()
        .map(str::to_string)
        .with_context(|| format!("no text in {body}"))
}

#[test]
fn a_browser_on_ups_own_mesh_rebuilds_a_stopped_nodes_row_and_computes_api_requests() -> Result<()>
{
    let dist = Path::new(env!("CARGO_MANIFEST_DIR")).join("../web-ui/dist/index.html");
    ensure!(
        dist.is_file(),
        "{} is missing: build the dashboard first (bash scripts/build-web.sh)",
        dist.display()
    );
    let _machine = crate::machine::alone();
    let scratch = Scratch::new("browser-up");
    let dir = scratch.0.clone();
    let data = dir.join("mesh");
    let port = free_port()?;
    let mut up = Up::start_with(&dir, &data, port, &dir.join("steps.jsonl"), "up", &[])?;
    up.ready(Duration::from_secs(300))?;
    let before = complete(port)?;

    // Every node past the first k stops: once the mesh counts them dead it has k rows, and
    // the row a joiner gets (the lowest free one, row k) is the one the API's checked rounds
    // need beside them.
    let ports = mesh_ports(&data)?;
    let api = format!("/ip4/127.0.0.1/tcp/{}", ports[0]);
    let k = crate::api::status(&api)?["k"]
        .as_u64()
        .context("k in status")? as usize;
    let n = ports.len();
    ensure!(k >= 2 && n > k, "up picks k of n with n > k: {k} of {n}");
    let row = k;
    let mut stopped = Vec::new();
    for node in k..n {
        let pid = up.node_pid(node)?;
        signal(pid, "STOP");
        stopped.push(Resume(pid));
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    for node in k..n {
        rt.block_on(wait_for_node(&api, "a stopped node dead", |nd| {
            nd["row"] == node && nd["health"] == "Dead"
        }))?;
    }

    // The page of node 1, which keeps running, is the browser's way in.
    let dashboard = format!("http://127.0.0.1:{}/", node_port(&data, 1)?);
    let driver = start_driver_in(&dir, None)?;
    let result = rt.block_on(async {
        let c = open_browser_with(&driver, "up", &[]).await?;
        let r = async {
            let serving = contribute(&c, &dashboard, Duration::from_secs(180)).await?;
            ensure!(
                serving.starts_with(&format!("serving row {row} on browser"))
                    && serving.contains("along a chain"),
                "the browser rebuilds a stopped node's row {row} along a chain: {serving}"
            );
            wait_for_node(&api, "the browser's row healthy behind its relay", |nd| {
                nd["row"] == row && browser(nd) && nd["health"] == "Healthy" && relayed(nd)
            })
            .await?;
            let answered = steps_answered(&crate::browser::text(&c, "#contribution").await);
            let after = complete(port)?;
            ensure!(
                after == before,
                "the API gives the same tokens with the browser's row: {after:?}, before {before:?}"
            );
            let page = wait_text_within(
                &c,
                "#contribution",
                |t| steps_answered(t) > answered,
                "the browser answering the API's steps",
                Duration::from_secs(30),
            )
            .await?;
            eprintln!("the page says: {page}");
            Ok(())
        }
        .await;
        let _ = c.close().await;
        r
    });
    if result.is_err() {
        // The API's node leads the request: what it made of the mesh.
        let tail = node_native::up::supervise::log_tail(&data.join("node0.log"), 60);
        eprintln!("the API node's log, last lines:\n{tail}");
    }
    result
}
