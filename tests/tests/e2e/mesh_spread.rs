//! Learning updates spread through sixteen holders as processes: the leader pays for at most
//! three copies of each, every holder ends on one digest, and a holder that was down catches up
//! from peers other than the leader.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use tests::procs::{Scratch, free_port};

use super::api::{Up, field, metric, post, status};

/// Holders in the mesh.
const HOLDERS: usize = 16;

/// The mesh's nodes as `status` shows them: (peer, health, version digest, lag).
fn nodes(bootstrap: &str) -> Result<Vec<(String, String, String, u64)>> {
    let s = status(bootstrap)?;
    let nodes = s["nodes"].as_array().context("nodes")?;
    Ok(nodes
        .iter()
        .map(|n| {
            let text = |k: &str| n[k].as_str().unwrap_or_default().to_string();
            (
                text("peer"),
                text("health"),
                text("version_digest"),
                n["lag"].as_u64().unwrap_or(u64::MAX),
            )
        })
        .collect())
}

/// Waits until `want` healthy holders are at one digest with no lag, and the digest is not
/// `not`; returns the digest.
fn wait_one_digest(bootstrap: &str, want: usize, not: &str, up: &Up) -> Result<String> {
    let start = Instant::now();
    loop {
        let all = nodes(bootstrap)?;
        let healthy: Vec<_> = all.iter().filter(|n| n.1 == "Healthy").collect();
        if healthy.len() == want
            && healthy.iter().all(|n| n.2 == healthy[0].2 && n.3 == 0)
            && healthy[0].2 != not
        {
            return Ok(healthy[0].2.clone());
        }
        ensure!(
            start.elapsed() < Duration::from_secs(90),
            "{want} healthy holders never reached one new version: {all:?}\n{}",
            up.log()
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// Asks for completions until the leader has published more than `than` updates.
fn publish_past(port: u16, model: &str, than: f64, up: &Up) -> Result<f64> {
    let start = Instant::now();
    let mut asked = 0;
    loop {
        let published = metric(port, "codedmesh_updates_published_total")?;
        if published > than {
            return Ok(published);
        }
        ensure!(
            start.elapsed() < Duration::from_secs(120),
            "{asked} requests published no update past {than}:\n{}",
            up.log()
        );
        let body = format!(
            r#"{{"model": "{model}", "prompt": "Spread the word number {asked}", "max_tokens": 3, "temperature": 0}}"#
        );
        post(port, "/v1/completions", &body)?;
        asked += 1;
    }
}

#[test]
fn sixteen_holders_get_every_update_for_three_copies_from_the_leader_and_catch_up_from_peers()
-> Result<()> {
    let _machine = crate::machine::share();
    let scratch = Scratch::new("spread");
    let dir = scratch.0.clone();
    let data = dir.join("mesh");
    let steps = dir.join("steps.jsonl");
    let port = free_port()?;
    let holders = HOLDERS.to_string();
    let args = ["--nodes", &holders, "--k", "2", "--max-batch", "2"];
    let mut up = Up::start_with(&dir, &data, port, &steps, "spread", &args)?;
    let ready = up.ready(Duration::from_secs(300))?;
    let model = field(&ready, "model ")?.to_string();
    let bootstrap = field(&ready, "bootstrap ")?.to_string();
    let leader_log = std::fs::read_to_string(data.join("node0.log"))?;
    let leader = leader_log
        .lines()
        .find_map(|l| {
            l.split(" as ")
                .nth(1)
                .filter(|_| l.starts_with("serving row"))
        })
        .context("the API node's peer id")?
        .trim()
        .to_string();

    // Two updates, each spread to all sixteen.
    let published = publish_past(port, &model, 1.0, &up)?;
    let first = wait_one_digest(&bootstrap, HOLDERS, "", &up)?;
    // One holder stops answering (SIGSTOP) while another update spreads: its share of the tree
    // goes to the next holders, and the others reach the new version without it.
    let pids = up.node_pids();
    let (_, victim) = *pids
        .iter()
        .find(|(node, _)| *node == HOLDERS - 1)
        .context("the last node's pid")?;
    let signal = |sig: &str| {
        std::process::Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(victim.to_string())
            .status()
    };
    signal("STOP")?;
    let published = publish_past(port, &model, published, &up)?;
    let second = wait_one_digest(&bootstrap, HOLDERS - 1, &first, &up)?;
    let bytes = metric(port, "codedmesh_update_bytes_published_total")?;
    let sent = metric(port, "codedmesh_update_bytes_sent_total")?;
    eprintln!(
        "{published} updates, {bytes} bytes published; the leader sent {sent} ({:.2} copies)",
        sent / bytes
    );
    ensure!(
        sent >= bytes && sent <= 3.0 * bytes,
        "each update leaves the leader at most three times: {sent} bytes sent of {bytes} published"
    );
    // Killed, up restarts it: it pulls what it missed from peers, not from the leader.
    signal("KILL")?;
    let start = Instant::now();
    while !up
        .node_pids()
        .iter()
        .any(|&(n, pid)| n == HOLDERS - 1 && pid != victim)
    {
        ensure!(
            start.elapsed() < Duration::from_secs(60),
            "up did not restart the killed node:\n{}",
            up.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let last = wait_one_digest(&bootstrap, HOLDERS, &first, &up)?;
    ensure!(
        last == second,
        "the restarted holder is at the mesh's version"
    );
    let victim_log = std::fs::read_to_string(data.join(format!("node{}.log", HOLDERS - 1)))?;
    let pulled: Vec<&str> = victim_log
        .lines()
        .filter_map(|l| l.split("pulling the updates this node lacks from ").nth(1))
        .collect();
    ensure!(
        !pulled.is_empty() && pulled.iter().all(|p| p.trim() != leader),
        "the restarted holder pulled from peers other than the leader ({leader}): {pulled:?}"
    );
    let after = metric(port, "codedmesh_update_bytes_sent_total")?;
    ensure!(
        after == sent,
        "the leader sent nothing for the catch-up: {sent} bytes before, {after} after"
    );
    Ok(())
}
