//! Learning updates spread through sixteen holders as processes: the leader pays for at most
//! three copies of each, every holder ends on one digest, a SIGSTOPped holder holds up its share
//! of a notice for its notice wait only, and a holder that was down catches up from peers other
//! than the leader.

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

/// Waits until every holder `status` shows is healthy and at one digest, with no lag; returns
/// the digest.
fn wait_one_digest(bootstrap: &str, up: &Up) -> Result<String> {
    let start = Instant::now();
    loop {
        let all = nodes(bootstrap)?;
        if all.len() == HOLDERS
            && all
                .iter()
                .all(|n| n.1 == "Healthy" && n.2 == all[0].2 && n.3 == 0)
        {
            return Ok(all[0].2.clone());
        }
        ensure!(
            start.elapsed() < Duration::from_secs(90),
            "the {HOLDERS} holders never reached one version: {all:?}\n{}",
            up.log()
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// Waits until the holders other than `victim` are healthy and at one digest that is not
/// `victim`'s; returns `victim`'s health then.
fn left_behind(bootstrap: &str, victim: &str, up: &Up) -> Result<String> {
    let start = Instant::now();
    loop {
        let all = nodes(bootstrap)?;
        let theirs = all.iter().find(|n| n.0 == victim).map(|n| n.2.clone());
        let others: Vec<_> = all.iter().filter(|n| n.0 != victim).collect();
        if others.len() == HOLDERS - 1
            && others
                .iter()
                .all(|n| n.1 == "Healthy" && n.2 == others[0].2 && n.3 == 0)
            && theirs.is_some_and(|d| d != others[0].2)
        {
            let health = all.iter().find(|n| n.0 == victim).map(|n| n.1.clone());
            return Ok(health.unwrap_or_default());
        }
        ensure!(
            start.elapsed() < Duration::from_secs(90),
            "the others never moved past the stopped holder at one version: {all:?}\n{}",
            up.log()
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// The lines of the nodes' logs in which a holder gave up on telling `victim` an update's
/// notice (no answer within the notice wait, or the connection to it closed first: QUIC drops
/// a silent peer after 10 s), waiting up to `within` for the first.
fn skipped_over(data: &std::path::Path, victim: &str, within: Duration) -> Result<Vec<String>> {
    let start = Instant::now();
    loop {
        let skipped: Vec<String> = (0..HOLDERS)
            .filter_map(|i| std::fs::read_to_string(data.join(format!("node{i}.log"))).ok())
            .flat_map(|log| {
                log.lines()
                    .filter(|l| {
                        (l.contains("did not answer an update's notice in")
                            || l.contains("an update's notice did not reach a holder"))
                            && l.contains(victim)
                    })
                    .map(str::to_string)
                    .collect::<Vec<_>>()
            })
            .collect();
        if !skipped.is_empty() {
            return Ok(skipped);
        }
        ensure!(
            start.elapsed() < within,
            "no holder told the stopped one and gave up on it within {within:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The peer id node `i` of `up` serves as (its log's "serving row … as …").
fn peer_of(data: &std::path::Path, i: usize) -> Result<String> {
    let log = std::fs::read_to_string(data.join(format!("node{i}.log")))?;
    Ok(log
        .lines()
        .find_map(|l| {
            l.split(" as ")
                .nth(1)
                .filter(|_| l.starts_with("serving row"))
        })
        .with_context(|| format!("node {i}'s peer id"))?
        .trim()
        .to_string())
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
    // A silent holder counts as dead after a minute (not 10 s): the SIGSTOPped one below is
    // still told updates, and its share must not wait on it.
    let args = ["--nodes", &holders, "--k", "2", "--max-batch", "2"];
    let args = [&args[..], &["--dead-ms", "60000"]].concat();
    let mut up = Up::start_with(&dir, &data, port, &steps, "spread", &args)?;
    let ready = up.ready(Duration::from_secs(300))?;
    let model = field(&ready, "model ")?.to_string();
    let bootstrap = field(&ready, "bootstrap ")?.to_string();
    let leader = peer_of(&data, 0)?;
    let victim_peer = peer_of(&data, HOLDERS - 1)?;

    // Updates spread to all sixteen.
    publish_past(port, &model, 1.0, &up)?;
    wait_one_digest(&bootstrap, &up)?;
    // One holder stops answering (SIGSTOP) while more updates spread: its share of the tree
    // goes to the next holders, and the others move past it.
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
    let before = metric(port, "codedmesh_updates_published_total")?;
    publish_past(port, &model, before, &up)?;
    let health = left_behind(&bootstrap, &victim_peer, &up)?;
    // The others had it while the stopped holder still counted as alive (dead only after a
    // minute's silence): whoever was to tell it waited its notice wait, then told the next of
    // its share; it did not wait for the request's timeout or the holder's death.
    ensure!(
        health != "Dead",
        "the others moved on only once the stopped holder was dead"
    );
    // The stopped holder may be the last of its share, so the rest can have it before its
    // teller's wait is up: the teller's line comes within that wait.
    let skipped = skipped_over(&data, &victim_peer, Duration::from_secs(30))?;
    eprintln!("the others moved on while the stopped holder was {health}: {skipped:#?}");
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
    wait_one_digest(&bootstrap, &up)?;
    let victim_log = std::fs::read_to_string(data.join(format!("node{}.log", HOLDERS - 1)))?;
    let pulled: Vec<&str> = victim_log
        .lines()
        .filter_map(|l| l.split("pulling the updates this node lacks from ").nth(1))
        .collect();
    ensure!(
        !pulled.is_empty() && pulled.iter().all(|p| p.trim() != leader),
        "the restarted holder pulled from peers other than the leader ({leader}): {pulled:?}"
    );
    // The leader's three copies of each update are all it sent: a pull from it would be a
    // fourth.
    let published = metric(port, "codedmesh_updates_published_total")?;
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
    Ok(())
}
