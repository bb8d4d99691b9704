//! The mesh between sites: tests/lab/three-sites.toml in the network lab (tests/src/lab), a
//! public site (the seed, its relay, the API node) and two homes behind NAT, one
//! endpoint-independent and one symmetric. Every node holds a row; AutoNAT finds the homes'
//! nodes undialable and they reserve relay slots; hole punching makes direct connections
//! where the NATs allow it and leaves them relayed where they do not; a request through the
//! API computes on both homes' holders, and cutting one home off mid-stream fails nothing.
//!
//! Needs root, network namespaces, TAP devices and nftables: under CI it fails when they are
//! missing, elsewhere it says what is missing and passes without running.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use tests::lab::{Lab, Topology, unavailable};
use tests::procs::{HEALTH, Proc, Scratch, bin, spawn_command, tiny_model};

/// The `lab` binary built beside this test.
fn lab_bin() -> PathBuf {
    bin().with_file_name("lab")
}

/// The topology of the file, under a name of this run and with short delays (the test asserts
/// what the NATs allow, not speed).
fn topology() -> Result<Topology> {
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("lab/three-sites.toml");
    let mut topo = Topology::load(&file)?;
    topo.name = format!("t{}", std::process::id() % 100_000);
    for s in &mut topo.sites {
        s.delay_ms = 2.5;
    }
    Ok(topo)
}

/// Starts `codedmesh ARGS` as lab node `node`, its stdout to `stdout` and its stderr in
/// `dir/<node>.log`.
fn spawn_in(lab: &Lab, dir: &Path, node: &str, args: &[&str], stdout: Stdio) -> Result<Proc> {
    let mut cmd = lab.topology.command(node, bin())?;
    cmd.args(args)
        .env("RUST_LOG", "warn,node_core::net=info,libp2p_kad=error");
    spawn_command(cmd, dir, node, stdout)
}

/// Runs `codedmesh ARGS` as lab node `node` and returns its stdout.
fn run_in(lab: &Lab, node: &str, args: &[&str]) -> Result<String> {
    let out = lab.topology.command(node, bin())?.args(args).output()?;
    ensure!(
        out.status.success(),
        "codedmesh {} on {node}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?)
}

/// The peer id a node's log names when it serves its row.
fn peer_of(p: &mut Proc) -> Result<String> {
    let log = p.wait_log("serving row", Duration::from_secs(120))?;
    log.lines()
        .find_map(|l| l.split_once(" as ").filter(|_| l.contains("serving row")))
        .map(|(_, id)| id.trim().to_string())
        .context("no peer id in the log")
}

/// How `codedmesh reach` from `from` finds the peer `to` through the relay `relay`.
fn reach(lab: &Lab, from: &str, relay: &str, to: &str) -> Result<String> {
    let addr = format!("{relay}/p2p-circuit/p2p/{to}");
    let out = run_in(lab, from, &["reach", &addr, "--wait-s", "10", "--json"])?;
    let v: serde_json::Value = serde_json::from_str(out.trim())?;
    Ok(v["path"].as_str().context("no path")?.to_string())
}

#[test]
fn three_sites_two_behind_nat_hold_rows_punch_holes_and_serve() -> Result<()> {
    let topo = topology()?;
    if let Some(why) = unavailable(&topo) {
        assert!(
            std::env::var_os("CI").is_none(),
            "CI runs the network lab, and this machine cannot: {why}"
        );
        eprintln!("SKIPPED the network lab: {why}");
        return Ok(());
    }
    let _alone = crate::machine::alone();
    let mut lab = Lab::up(&topo, &lab_bin())?;
    let dir = Scratch::new("lab");
    let d = |n: &str| dir.0.join(n).display().to_string();

    // The public site: the seed (listening on every transport) and the API node.
    let (seed_data, seed_ip) = (d("seed"), topo.addr("seed")?);
    let mut args = vec!["seed", "--k", "3", "--n", "6", "--shard-format", "f32"];
    let model = tiny_model().display().to_string();
    let listen = "/ip4/0.0.0.0/tcp/0".to_string();
    args.extend(["--model", &model, "--data", &seed_data, "--listen", &listen]);
    args.extend(HEALTH);
    let seed_out = dir.0.join("seed.out");
    let out = Stdio::from(std::fs::File::create(&seed_out)?);
    let mut seed = spawn_in(&lab, &dir.0, "seed", &args, out)?;
    let seed_peer = peer_of(&mut seed)?;
    let listening = std::fs::read_to_string(&seed_out)?;
    let seed_addr = |proto: &str| {
        listening
            .lines()
            .filter_map(|l| l.strip_prefix("listening: "))
            .find(|a| {
                a.starts_with(&format!("/ip4/{seed_ip}/"))
                    && a.contains(proto)
                    && !a.contains("/ws")
            })
            .map(str::to_string)
            .with_context(|| format!("the seed has no {proto} address:\n{listening}"))
    };
    let (seed_tcp, seed_quic) = (seed_addr("/tcp/")?, seed_addr("/quic-v1/")?);

    let (api_data, trace) = (d("api"), dir.0.join("api-steps.jsonl"));
    let trace_s = trace.display().to_string();
    let mut api_args = vec!["node", "--bootstrap", &seed_tcp, "--data", &api_data];
    api_args.extend([
        "--listen",
        &listen,
        "--api-listen",
        "127.0.0.1:8000",
        "--no-learn",
    ]);
    api_args.extend(["--check", "1", "--spares", "2", "--trace-steps", &trace_s]);
    api_args.extend(HEALTH);
    let mut nodes = vec![spawn_in(&lab, &dir.0, "api", &api_args, Stdio::null())?];
    // The homes' nodes listen on QUIC, whose one socket carries their dials and hole punching.
    for n in ["ei1", "ei2", "sym1", "sym2"] {
        let data = d(n);
        let mut a = vec!["node", "--bootstrap", &seed_quic, "--data", &data];
        a.extend(["--listen", "/ip4/0.0.0.0/udp/4001/quic-v1"]);
        a.extend(HEALTH);
        nodes.push(spawn_in(&lab, &dir.0, n, &a, Stdio::null())?);
    }
    let mut peers = std::collections::BTreeMap::new();
    for p in &mut nodes {
        peers.insert(p.name.clone(), peer_of(p)?);
    }
    // Every node holds a row and reports how peers reach it.
    let status = || -> Result<serde_json::Value> {
        let out = run_in(&lab, "api", &["status", "--json", "--bootstrap", &seed_tcp])?;
        Ok(serde_json::from_str(&out)?)
    };
    let reach_of = |s: &serde_json::Value, peer: &str| -> String {
        s["nodes"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|n| n["peer"] == peer)
            .and_then(|n| n["reach"].as_str())
            .unwrap_or("")
            .to_string()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let s = loop {
        let s = status()?;
        let healthy = s["healthy_rows"].as_u64().unwrap_or(0);
        let settled = peers.iter().all(|(name, p)| {
            let r = reach_of(&s, p);
            if name == "api" {
                r == "public"
            } else {
                r == "relayed" || r == "direct after hole punching"
            }
        }) && reach_of(&s, &seed_peer) == "public";
        if healthy == 6 && settled {
            break s;
        }
        if std::time::Instant::now() > deadline {
            bail!("the mesh did not settle in 60 s: {s:#}");
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    let rows: std::collections::BTreeSet<u64> = s["nodes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|n| n["row"].as_u64())
        .collect();
    assert_eq!(rows.len(), 6, "every node holds a row of its own: {s:#}");

    // Hole punching, from the connection the probe ends up with. A public peer reaches both
    // homes directly: their side of the punch dials it, which any NAT lets out. From behind
    // the endpoint-independent NAT, the symmetric home stays relayed: each side's NAT drops
    // the other's packets, sent to a port it mapped for the relay.
    assert_eq!(
        reach(&lab, "api", &seed_quic, &peers["ei1"])?,
        "direct after hole punching"
    );
    assert_eq!(
        reach(&lab, "api", &seed_quic, &peers["sym1"])?,
        "direct after hole punching"
    );
    assert_eq!(reach(&lab, "ei2", &seed_quic, &peers["sym2"])?, "relayed");

    // A request through the API computes on holders of both homes; cutting the symmetric home
    // off mid-stream fails nothing (its holders were spares beyond k + check).
    let mut stream = topo
        .command("api", "python3")?
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("python/lab_stream.py"))
        .args(["http://127.0.0.1:8000/v1", "48", "8"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut out = BufReader::new(stream.stdout.take().context("stdout")?).lines();
    let first = out.next().transpose()?.unwrap_or_default();
    if first != "MARK" {
        let done = stream.wait_with_output()?;
        bail!(
            "the stream did not start: {first}{}\napi node:\n{}",
            String::from_utf8_lossy(&done.stderr),
            nodes[0].log()
        );
    }
    lab.cut("home-sym")?;
    let last = out.last().transpose()?.unwrap_or_default();
    let done = stream.wait_with_output()?;
    ensure!(
        done.status.success(),
        "the request failed after the symmetric home was cut off: {}",
        String::from_utf8_lossy(&done.stderr)
    );
    let result: serde_json::Value = serde_json::from_str(&last)?;
    assert_eq!(result["finish_reason"], "length", "{result}");
    assert_eq!(result["tokens"], 48, "{result}");
    let steps = std::fs::read_to_string(&trace)?;
    let served_by = |node: &str| {
        steps.lines().any(|l| {
            serde_json::from_str::<serde_json::Value>(l)
                .is_ok_and(|v| v["peer"] == peers[node].as_str() && v["outcome"] == "ok")
        })
    };
    for home in [["ei1", "ei2"], ["sym1", "sym2"]] {
        assert!(
            home.iter().any(|n| served_by(n)),
            "no holder of {home:?} answered a step: {}",
            steps.lines().take(20).collect::<Vec<_>>().join("\n")
        );
    }
    drop(nodes);
    drop(seed);
    drop(lab);
    Ok(())
}
