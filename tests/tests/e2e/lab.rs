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
use tests::lab::{Lab, Nat, Site, Topology, unavailable, within};
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
    cmd.args(args).env(
        "RUST_LOG",
        "warn,node_core::net=info,node_native::serve::engine::hop=info,node_native::hold::hop=debug,libp2p_kad=error",
    );
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

/// The lab's seed on the tiny model (k = 3, f32 rows) and its addresses in the lab.
struct Seed {
    proc: Option<Proc>,
    peer: String,
    tcp: String,
    quic: String,
}

impl Seed {
    /// Starts lab node `seed` with `n` rows and `more` arguments, listening on every transport.
    fn start(lab: &Lab, dir: &Path, n: usize, more: &[&str]) -> Result<Self> {
        let (data, ip) = (
            dir.join("seed").display().to_string(),
            lab.topology.addr("seed")?,
        );
        let n = n.to_string();
        let mut args = vec!["seed", "--k", "3", "--n", &n, "--shard-format", "f32"];
        let model = tiny_model().display().to_string();
        args.extend([
            "--model",
            &model,
            "--data",
            &data,
            "--listen",
            "/ip4/0.0.0.0/tcp/0",
        ]);
        args.extend(HEALTH);
        args.extend(more);
        let out_path = dir.join("seed.out");
        let out = Stdio::from(std::fs::File::create(&out_path)?);
        let mut proc = spawn_in(lab, dir, "seed", &args, out)?;
        let peer = peer_of(&mut proc)?;
        let listening = std::fs::read_to_string(&out_path)?;
        let addr = |proto: &str| tests::lab::listening_addr(&listening, ip, proto);
        Ok(Self {
            tcp: addr("/tcp/")?,
            quic: addr("/quic-v1/")?,
            proc: Some(proc),
            peer,
        })
    }
}

/// Whether the lab can run here; under CI a lab that cannot fails the test.
fn lab_runs(topo: &Topology) -> bool {
    if let Some(why) = unavailable(topo) {
        tests::procs::skip(&format!("the network lab ({}): {why}", topo.name));
        return false;
    }
    true
}

/// The three sites' mesh, settled: the seed, the API node (on 127.0.0.1:8000 in its
/// namespace, leading with `lead`) and the homes' four nodes, by name with their peer ids.
struct ThreeSites {
    seed: Seed,
    nodes: Vec<Proc>,
    peers: std::collections::BTreeMap<String, String>,
    status: serde_json::Value,
}

impl ThreeSites {
    /// Starts them in `lab` and waits until every node holds a row and every home's node is
    /// relayed or punched through.
    fn start(lab: &Lab, dir: &Path, trace: &Path, lead: &[&str]) -> Result<Self> {
        let d = |n: &str| dir.join(n).display().to_string();
        // The public site: the seed (listening on every transport) and the API node.
        let seed = Seed::start(lab, dir, 6, &[])?;
        let (seed_peer, seed_tcp, seed_quic) =
            (seed.peer.clone(), seed.tcp.clone(), seed.quic.clone());
        let listen = "/ip4/0.0.0.0/tcp/0".to_string();
        let (api_data, trace_s) = (d("api"), trace.display().to_string());
        let mut api_args = vec!["node", "--bootstrap", &seed_tcp, "--data", &api_data];
        api_args.extend([
            "--listen",
            &listen,
            "--api-listen",
            "127.0.0.1:8000",
            "--no-learn",
        ]);
        api_args.extend(["--trace-steps", &trace_s]);
        api_args.extend(lead);
        api_args.extend(HEALTH);
        let mut nodes = vec![spawn_in(lab, dir, "api", &api_args, Stdio::null())?];
        // The homes' nodes listen on QUIC, whose one socket carries their dials and hole
        // punching.
        for n in ["ei1", "ei2", "sym1", "sym2"] {
            let data = d(n);
            let mut a = vec!["node", "--bootstrap", &seed_quic, "--data", &data];
            a.extend(["--listen", "/ip4/0.0.0.0/udp/4001/quic-v1"]);
            a.extend(HEALTH);
            nodes.push(spawn_in(lab, dir, n, &a, Stdio::null())?);
        }
        let mut peers = std::collections::BTreeMap::new();
        for p in &mut nodes {
            peers.insert(p.name.clone(), peer_of(p)?);
        }
        // Every node holds a row and reports how peers reach it.
        let status = || -> Result<serde_json::Value> {
            let out = run_in(lab, "api", &["status", "--json", "--bootstrap", &seed_tcp])?;
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
        let status = loop {
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
                let seen: Vec<String> = peers
                    .iter()
                    .map(|(name, p)| format!("{name} {p}: {:?}", reach_of(&s, p)))
                    .collect();
                bail!(
                    "the mesh did not settle in 60 s: {healthy} healthy rows, the seed {:?}, {}: {s:#}",
                    reach_of(&s, &seed_peer),
                    seen.join(", ")
                );
            }
            std::thread::sleep(Duration::from_millis(500));
        };
        Ok(Self {
            seed,
            nodes,
            peers,
            status,
        })
    }
}

#[test]
fn three_sites_two_behind_nat_hold_rows_punch_holes_and_serve() -> Result<()> {
    let topo = topology()?;
    if !lab_runs(&topo) {
        return Ok(());
    }
    let _alone = crate::machine::alone();
    let mut lab = Lab::up(&topo, &lab_bin())?;
    let dir = Scratch::new("lab");
    let trace = dir.0.join("api-steps.jsonl");
    let lead = ["--check", "1", "--spares", "2"];
    let ThreeSites {
        mut seed,
        nodes,
        peers,
        status: s,
    } = ThreeSites::start(&lab, &dir.0, &trace, &lead)?;
    let seed_quic = seed.quic.clone();
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
    stream_from(&topo, "api", 48, 8, || lab.cut("home-sym"))
        .with_context(|| format!("api node:\n{}", nodes[0].log()))?;
    let answered = answered(&trace)?;
    for home in [["ei1", "ei2"], ["sym1", "sym2"]] {
        assert!(
            home.iter().any(|n| answered.contains(&peers[*n])),
            "no holder of {home:?} answered a step: {answered:?}"
        );
    }
    drop(nodes);
    drop(seed.proc.take());
    drop(lab);
    Ok(())
}

/// A browser behind a symmetric NAT opens the dashboard of a public node, contributes its GPU
/// and computes coded steps of a request led on the public site: every connection of the
/// browser is one it dialed out (WebSocket to the seed), and the leader reaches it through the
/// seed's relay on that connection.
#[test]
fn a_browser_behind_nat_contributes_and_computes_for_a_public_mesh() -> Result<()> {
    let dist = Path::new(env!("CARGO_MANIFEST_DIR")).join("../web-ui/dist/index.html");
    ensure!(
        dist.is_file(),
        "{} is missing: build the dashboard first (bash scripts/build-web.sh)",
        dist.display()
    );
    let site = |name: &str, nat, nodes: &[&str]| Site {
        name: name.into(),
        nat,
        delay_ms: 2.5,
        rate_mbit: 100.0,
        loss_percent: 0.0,
        nodes: nodes.iter().map(|n| n.to_string()).collect(),
    };
    let topo = Topology {
        name: format!("w{}", std::process::id() % 100_000),
        sites: vec![
            site("dc", Nat::None, &["seed", "n1", "n2", "n3", "n4"]),
            site("home", Nat::Symmetric, &["browser"]),
        ],
    };
    if !lab_runs(&topo) {
        return Ok(());
    }
    let _alone = crate::machine::alone();
    let lab = Lab::up(&topo, &lab_bin())?;
    let dir = Scratch::new("lab-browser");
    let seed_ip = topo.addr("seed")?;
    let page = format!("http://{seed_ip}:8080");
    let http = format!("{seed_ip}:8080");
    let mut seed = Seed::start(&lab, &dir.0, 5, &["--no-learning", "--api-listen", &http])?;
    let mut nodes = Vec::new();
    for n in ["n1", "n2", "n3", "n4"] {
        let data = dir.0.join(n).display().to_string();
        let a = ["node", "--bootstrap", &seed.tcp, "--data", &data];
        let mut a = a.to_vec();
        a.extend(["--listen", "/ip4/0.0.0.0/tcp/0"]);
        a.extend(HEALTH);
        nodes.push(spawn_in(&lab, &dir.0, n, &a, Stdio::null())?);
    }
    for p in &mut nodes {
        peer_of(p)?;
    }
    let healthy = |rows: u64| -> Result<serde_json::Value> {
        let deadline = std::time::Instant::now() + Duration::from_secs(90);
        loop {
            let out = run_in(&lab, "n1", &["status", "--json", "--bootstrap", &seed.tcp])?;
            let s: serde_json::Value = serde_json::from_str(&out)?;
            if s["healthy_rows"].as_u64() == Some(rows) {
                return Ok(s);
            }
            ensure!(
                std::time::Instant::now() < deadline,
                "never {rows} healthy rows: {s:#}"
            );
            std::thread::sleep(Duration::from_millis(250));
        }
    };
    healthy(5)?;

    // Chromium runs in the home's namespace; the page is on the seed's lab address, which the
    // browser is told to treat as secure (WebGPU and storage need a secure origin).
    let browser_ns = topo.namespace("browser")?;
    let driver = crate::browser::start_driver_in(&dir.0, Some(&browser_ns))?;
    let secure = format!("--unsafely-treat-insecure-origin-as-secure={page}");
    let result = within(&browser_ns, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(async {
            let c = crate::browser::open_browser_with(&driver, "home", &[secure]).await?;
            let r = contribute_from_home(&c, &page, &lab, &seed.tcp, &healthy).await;
            let _ = c.close().await;
            r
        })
    });
    if result.is_err() {
        eprintln!(
            "chromedriver log:\n{}\nseed log:\n{}",
            std::fs::read_to_string(dir.0.join("chromedriver.log")).unwrap_or_default(),
            seed.proc.as_ref().map(Proc::log).unwrap_or_default()
        );
    }
    drop(driver);
    drop(nodes);
    drop(seed.proc.take());
    drop(lab);
    result
}

/// The page from the home site: it dials the seed, contributes, holds a new row, and its row
/// answers coded steps of a native leader's request.
async fn contribute_from_home(
    c: &fantoccini::Client,
    page: &str,
    lab: &Lab,
    bootstrap: &str,
    healthy: &impl Fn(u64) -> Result<serde_json::Value>,
) -> Result<()> {
    use crate::browser::{steps_answered, wait_text};
    c.goto(&format!("{page}/?webgpu=all")).await?;
    let connection = wait_text(
        c,
        "#connection",
        |t| t.contains("follows the mesh through"),
        "a connection",
    )
    .await?;
    eprintln!("the page says: {connection}");
    wait_text(
        c,
        "#summary",
        |t| t.starts_with("model available: yes — 5 of 5 rows healthy"),
        "five healthy rows",
    )
    .await?;
    c.find(fantoccini::Locator::Css("#contribute"))
        .await?
        .click()
        .await?;
    let serving = wait_text(
        c,
        "#contribution",
        |t| t.starts_with("serving row 5 on browser") || t.contains("could not"),
        "the browser serving a new row",
    )
    .await?;
    eprintln!("the page says: {serving}");
    ensure!(
        serving.starts_with("serving row 5 on browser WebGPU"),
        "the browser behind NAT holds the new row 5 on WebGPU: {serving}"
    );
    let status = healthy(6)?;
    ensure!(
        status["nodes"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|n| n["row"] == 5
                && n["device"]
                    .as_str()
                    .is_some_and(|d| d.starts_with("browser"))),
        "status shows row 5 held by the browser: {status:#}"
    );
    // A leader on the public site, on all six rows (k = 3 decoded, 3 checked): the browser's
    // answers come back through the relay on its own connection, checked every round.
    let out = lab
        .topology
        .command("n1", tests::procs::bin())?
        .args(["generate", "--bootstrap", bootstrap, "--max-tokens", "8"])
        .args(["--prompt", "The history of the printing press begins"])
        .args(["--check", "3", "--spares", "0"])
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(out.status.success(), "generate failed: {err}");
    ensure!(
        err.contains(", 0 unchecked") && !err.contains(" caught on "),
        "every round checked, nobody caught:\n{err}"
    );
    let answered = wait_text(
        c,
        "#contribution",
        |t| steps_answered(t) > 0,
        "coded steps answered by the browser behind NAT",
    )
    .await?;
    eprintln!("the page says: {answered}");
    Ok(())
}

/// tests/lab/three-regions.toml under a name of this run.
fn regions() -> Result<Topology> {
    let file = Path::new(env!("CARGO_MANIFEST_DIR")).join("lab/three-regions.toml");
    let mut topo = Topology::load(&file)?;
    topo.name = format!("r{}", std::process::id() % 100_000);
    Ok(topo)
}

/// One streamed chat of `tokens` tokens through the API node's `/v1`, `cut` called once
/// `mark` chunks have arrived: the result line of tests/python/lab_stream.py (with `ms`, the
/// milliseconds from the first chunk to the last).
fn stream_from(
    topo: &Topology,
    node: &str,
    tokens: usize,
    mark: usize,
    cut: impl FnOnce() -> Result<()>,
) -> Result<serde_json::Value> {
    let mut stream = topo
        .command(node, "python3")?
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("python/lab_stream.py"))
        .args([
            "http://127.0.0.1:8000/v1",
            &tokens.to_string(),
            &mark.to_string(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut out = BufReader::new(stream.stdout.take().context("stdout")?).lines();
    let first = out.next().transpose()?.unwrap_or_default();
    if first != "MARK" {
        let done = stream.wait_with_output()?;
        bail!(
            "the stream did not start: {first}{}",
            String::from_utf8_lossy(&done.stderr)
        );
    }
    cut()?;
    let last = out.last().transpose()?.unwrap_or_default();
    let done = stream.wait_with_output()?;
    ensure!(
        done.status.success(),
        "the stream failed: {}",
        String::from_utf8_lossy(&done.stderr)
    );
    let result: serde_json::Value = serde_json::from_str(&last)?;
    ensure!(
        result["finish_reason"] == "length" && result["tokens"] == tokens,
        "{result}"
    );
    Ok(result)
}

/// The peers whose answers to the steps traced in `trace` (a `--trace-steps` file) were ok.
fn answered(trace: &Path) -> Result<std::collections::BTreeSet<String>> {
    answered_after(trace, 0)
}

/// The steps a step trace holds.
fn steps_in(trace: &Path) -> usize {
    std::fs::read_to_string(trace).map_or(0, |s| s.lines().count())
}

/// The peers that answered a step in a step trace after its first `skip` lines, or joined a
/// hop group formed there (whose stages go member to member, past the leader's trace).
fn answered_after(trace: &Path, skip: usize) -> Result<std::collections::BTreeSet<String>> {
    let steps = std::fs::read_to_string(trace)?;
    Ok(steps
        .lines()
        .skip(skip)
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["outcome"] == "ok" || v["step"] == "hop group")
        .filter_map(|v| v["peer"].as_str().map(str::to_string))
        .collect())
}

/// Each of `peers` as `region/node`.
fn named(
    region: &std::collections::BTreeMap<String, (&'static str, String)>,
    peers: &std::collections::BTreeSet<String>,
) -> Vec<String> {
    peers
        .iter()
        .map(|p| {
            region
                .get(p)
                .map_or(format!("?{p}"), |(r, n)| format!("{r}/{n}"))
        })
        .collect()
}

/// Issue 80's lab: replicas of every row in two regions 50 ms apart (and the seed's row in a
/// third). A leader's group forms in its own region, even when it starts with both around
/// (every member of its stream's rounds and hop groups is there; its time against its region
/// alone is printed for docs/perf.md); a group formed with a far holder is formed again when a
/// much closer one joins; with its region's holders cut off mid-stream, it forms a group across
/// regions and the stream completes.
#[test]
fn a_leader_computes_in_its_own_region_and_across_when_its_region_is_cut_off() -> Result<()> {
    let topo = regions()?;
    if !lab_runs(&topo) {
        return Ok(());
    }
    let _alone = crate::machine::alone();
    let mut lab = Lab::up(&topo, &lab_bin())?;
    let dir = Scratch::new("lab-regions");
    let d = |n: &str| dir.0.join(n).display().to_string();
    // Four rows (k = 3): the seed holds row 0 in ap; the API node and e1, e2 take rows 1 to 3.
    // Every joiner measures its round trips to the mesh and is offered a replica of the
    // thinnest row its region lacks (the lowest of equals): e3 row 0 (the seed's is in ap),
    // the four of us rows 1, 2, 3 and 0.
    let mut seed = Seed::start(&lab, &dir.0, 4, &["--max-rows", "4"])?;
    let seed_tcp = seed.tcp.clone();
    let listen = "/ip4/0.0.0.0/tcp/0";
    let api_args = |trace: &str| -> Vec<String> {
        let mut a = ["node", "--bootstrap", &seed_tcp, "--data", &d("api")]
            .map(String::from)
            .to_vec();
        let more = ["--listen", listen, "--api-listen", "127.0.0.1:8000"];
        a.extend(more.map(String::from));
        let lead = [
            "--no-learn",
            "--check",
            "1",
            "--spares",
            "0",
            "--trace-steps",
            trace,
        ];
        a.extend(lead.map(String::from));
        a.extend(HEALTH.map(String::from));
        a
    };
    let start = |lab: &Lab, node: &str, args: &[String]| -> Result<(Proc, String)> {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut p = spawn_in(lab, &dir.0, node, &args, Stdio::null())?;
        let peer = peer_of(&mut p)?;
        Ok((p, peer))
    };
    let holder = |node: &str| -> Vec<String> {
        let a = [
            "node",
            "--bootstrap",
            &seed_tcp,
            "--data",
            &d(node),
            "--listen",
            listen,
        ];
        a.iter().copied().chain(HEALTH).map(String::from).collect()
    };
    let trace = |n: u32| dir.0.join(format!("api-steps-{n}.jsonl"));
    let (mut api, api_peer) = start(&lab, "api", &api_args(&trace(1).display().to_string()))?;
    let mut region = std::collections::BTreeMap::<String, (&'static str, String)>::new();
    let mut nodes = Vec::new();
    for (node, site) in [("e1", "eu"), ("e2", "eu")] {
        let (p, peer) = start(&lab, node, &holder(node))?;
        nodes.push(p);
        region.insert(peer, (site, node.to_string()));
    }
    region.insert(api_peer.clone(), ("eu", "api".into()));
    region.insert(seed.peer.clone(), ("ap", "seed".into()));
    // What the API node knows of the mesh: its /api/status, read inside its namespace.
    let status = || -> Result<serde_json::Value> {
        let get = "import urllib.request as u; print(u.urlopen('http://127.0.0.1:8000/api/status', timeout=10).read().decode())";
        let out = topo.command("api", "python3")?.args(["-c", get]).output()?;
        ensure!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(serde_json::from_slice(&out.stdout)?)
    };
    // Waits until the API node sees `count` nodes, every row healthy and a round trip to each,
    // and its own coordinate has settled (its error under a third of what knows nothing): a
    // leader just started places holders it has not pinged by its coordinate, and until that
    // settles it may take a far holder for a near one (its group is looked at again 5 s after
    // it forms, and a stream must be near from its first token).
    let settled = |count: usize| -> Result<serde_json::Value> {
        let deadline = std::time::Instant::now() + Duration::from_secs(90);
        loop {
            let s = status().unwrap_or_default();
            let nodes = s["nodes"].as_array().cloned().unwrap_or_default();
            let known = nodes.iter().all(|n| n["rtt_ms"].is_number());
            let placed = nodes.iter().any(|n| {
                n["peer"] == api_peer.as_str()
                    && n["coord"]["error"].as_f64().is_some_and(|e| e < 0.5)
            });
            if s["healthy_rows"] == 4 && nodes.len() == count && known && placed {
                return Ok(s);
            }
            ensure!(
                std::time::Instant::now() < deadline,
                "the mesh did not settle in 90 s: {s:#}"
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    };
    type Regions = std::collections::BTreeMap<String, (&'static str, String)>;
    let rows_in = |s: &serde_json::Value, region: &Regions, site: &str| {
        let nodes = s["nodes"].as_array().into_iter().flatten();
        nodes
            .filter(|n| {
                n["peer"]
                    .as_str()
                    .and_then(|p| region.get(p))
                    .is_some_and(|r| r.0 == site)
            })
            .filter_map(|n| n["row"].as_u64())
            .collect::<std::collections::BTreeSet<u64>>()
    };
    // Waits for `count` nodes with every row in `site`.
    let every_row_in = |count: usize, region: &Regions, site: &str| -> Result<()> {
        let s = settled(count)?;
        let rows = rows_in(&s, region, site);
        ensure!(rows == (0..4).collect(), "{site} holds every row: {s:#}");
        Ok(())
    };
    // A stream of 32 tokens, every step of it answered in eu (trace `n`, the steps answered
    // before it left out).
    let in_eu = |region: &Regions, n: u32| -> Result<serde_json::Value> {
        let before = steps_in(&trace(n));
        let streamed = stream_from(&topo, "api", 32, 1, || Ok(()))?;
        let by = named(region, &answered_after(&trace(n), before)?);
        ensure!(
            by.iter().all(|r| r.starts_with("eu/")),
            "a leader in eu computes in eu: {by:?}; its view: {}",
            status().map(|s| s["nodes"].to_string()).unwrap_or_default()
        );
        Ok(streamed)
    };

    // With row 0 only in ap, the leader's group takes the seed's. When a holder of row 0 joins
    // in eu, the group is formed again around it: a much closer group.
    settled(4)?;
    stream_from(&topo, "api", 8, 1, || Ok(()))?;
    let far = named(&region, &answered(&trace(1))?);
    ensure!(
        far.iter().any(|r| r == "ap/seed"),
        "row 0 was the seed's: {far:?}"
    );
    let (p, peer) = start(&lab, "e3", &holder("e3"))?;
    nodes.push(p);
    region.insert(peer, ("eu", "e3".into()));
    every_row_in(5, &region, "eu")?;
    let regrouped = || -> Result<f64> {
        let metrics = http_get(&topo, "api", "/metrics")?;
        Ok(counter(&metrics, "codedmesh_groups_regrouped_total"))
    };
    let before = regrouped()?;

    // The floor: the stream with its region alone, its group formed again closer.
    let floor = in_eu(&region, 1)?;
    let after = regrouped()?;
    eprintln!(
        "groups formed again around a closer holder: {before} before e3 joined, {after} after"
    );
    ensure!(
        after > before,
        "the group with the seed's far row was formed again around e3's"
    );

    // The other region joins with a holder of every row.
    for node in ["u1", "u2", "u3", "u4"] {
        let (p, peer) = start(&lab, node, &holder(node))?;
        nodes.push(p);
        region.insert(peer, ("us", node.to_string()));
    }
    // A leader that starts with both regions there.
    drop(api);
    let (api2, _) = start(&lab, "api", &api_args(&trace(2).display().to_string()))?;
    api = api2;
    every_row_in(9, &region, "us")?;
    // The API node comes to see eu and us as regions that serve alone, the seed's ap as one
    // that does not: once every node has announced a coordinate placed by its pings (one each
    // 15 s a connection) and is healthy in its view.
    let sites = |r: &node_core::mesh::Region| -> std::collections::BTreeSet<&'static str> {
        r.nodes
            .iter()
            .filter_map(|p| region.get(p))
            .map(|s| s.0)
            .collect()
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    loop {
        let info: node_core::mesh::MeshInfo = serde_json::from_value(status()?)?;
        let regions = info.regions();
        let alone: Vec<_> = regions.iter().filter(|r| r.alone).map(sites).collect();
        if alone.len() == 2 && alone.iter().all(|s| s.len() == 1) && alone[0] != alone[1] {
            eprintln!("{}", info.regions_line());
            break;
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "eu and us serve alone, apart, within 90 s: {}",
            info.regions_line()
        );
        std::thread::sleep(Duration::from_secs(1));
    }
    let near = in_eu(&region, 2)?;
    let (ms, floor_ms) = (near["ms"].as_f64(), floor["ms"].as_f64());
    let (ms, floor_ms) = (ms.unwrap_or(f64::NAN), floor_ms.unwrap_or(f64::NAN));
    // A figure for docs/perf.md, not asserted (the lab's user-space links slow with the
    // machine): what makes the stream near, its members all in eu, is asserted above.
    let ratio = ms / floor_ms;
    eprintln!("eu alone: {floor_ms} ms; eu and us: {ms} ms ({ratio:.2}×)");

    // Its region's holders cut off mid-stream: the group forms across regions and completes.
    let before = answered(&trace(2))?;
    let across = stream_from(&topo, "api", 32, 4, || lab.cut("eu"))?;
    let new: std::collections::BTreeSet<String> =
        answered(&trace(2))?.difference(&before).cloned().collect();
    let after = named(&region, &new);
    eprintln!(
        "across regions: {} ms for 32 tokens, new members {after:?}",
        across["ms"]
    );
    ensure!(
        after.iter().any(|r| r.starts_with("us/")),
        "holders in us answered once eu was cut off: {after:?}"
    );
    drop(nodes);
    drop(api);
    drop(seed.proc.take());
    drop(lab);
    Ok(())
}

/// `path` on the API node's HTTP port (127.0.0.1:8000 in lab node `node`'s namespace).
fn http_get(topo: &Topology, node: &str, path: &str) -> Result<String> {
    let get = format!(
        "import urllib.request as u; print(u.urlopen('http://127.0.0.1:8000{path}', timeout=10).read().decode())"
    );
    let out = topo.command(node, "python3")?.args(["-c", &get]).output()?;
    ensure!(
        out.status.success(),
        "GET {path}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8(out.stdout)?)
}

/// A counter's value in a `/metrics` text (0 when it is not there).
fn counter(metrics: &str, name: &str) -> f64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0.0)
}

/// Issue 80: a hop group whose members sit in two homes behind NAT, one endpoint-independent
/// and one symmetric, passes its coded outputs member to member (punched through where the
/// NATs allow, relayed where they do not): every pass of a stream goes one hop per stage and
/// none fails back to rounds.
#[test]
fn a_hop_group_behind_two_nats_runs_every_pass_as_hops() -> Result<()> {
    let mut topo = topology()?;
    topo.name = format!("h{}", std::process::id() % 100_000);
    if !lab_runs(&topo) {
        return Ok(());
    }
    let _alone = crate::machine::alone();
    let lab = Lab::up(&topo, &lab_bin())?;
    let dir = Scratch::new("lab-hops");
    let trace = dir.0.join("api-steps.jsonl");
    // k = 3 and one check: four members besides the API node, of the seed and four homes'
    // nodes, so at least one of each home.
    let lead = ["--pass", "hop", "--check", "1", "--spares", "0"];
    let mut sites = ThreeSites::start(&lab, &dir.0, &trace, &lead)?;
    let result = stream_from(&topo, "api", 32, 1, || Ok(())).inspect_err(|_| {
        for p in &sites.nodes {
            eprintln!("{} ({}):\n{}", p.name, sites.peers[&p.name], p.log());
        }
    })?;
    let metrics = http_get(&topo, "api", "/metrics")?;
    let (steps, hops, failed) = (
        counter(&metrics, "codedmesh_forward_steps_total"),
        counter(&metrics, "codedmesh_hop_steps_total"),
        counter(&metrics, "codedmesh_forward_step_failures_total"),
    );
    // The log without its colours' escape sequences.
    let log = sites.nodes[0]
        .log()
        .split('\x1b')
        .enumerate()
        .map(|(i, s)| {
            if i == 0 {
                s
            } else {
                s.split_once('m').map_or(s, |(_, t)| t)
            }
        })
        .collect::<String>();
    eprintln!("{steps} steps, {hops} by hops, {failed} failed; {result}");
    if failed > 0.0 {
        for p in &sites.nodes {
            eprintln!("{} ({}):\n{}", p.name, sites.peers[&p.name], p.log());
        }
    }
    // Every pass went by hops (`hop_steps` counts those that succeeded): parts crossed between
    // the homes (no "no part of round …" from a member that could not reach another). A pass
    // that failed a check instead was retried by hops: an honest hop group's check fails now
    // and then (one pass in about 1,000 over 36 runs of this lab; docs/verification.md,
    // "Checks in hop groups"), which is not the network's doing.
    let failures: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("a forward step failed"))
        .collect();
    ensure!(
        steps > 0.0 && hops + failed == steps && failures.len() as f64 == failed,
        "every pass by hops: {steps} steps, {hops} hops, {failed} failed\napi log:\n{log}"
    );
    ensure!(
        failures.iter().all(|l| l.contains("answers disagree")),
        "no pass failed on the network: {failures:#?}"
    );
    // The hop group's rows, as the leader logs it, name members of both homes.
    let rows = log
        .lines()
        .filter(|l| l.contains("passes go one hop per stage"))
        .find_map(|l| l.split("rows=").nth(1))
        .with_context(|| format!("the leader logged no hop group:\n{log}"))?;
    let row_of = |node: &str| {
        sites.status["nodes"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|n| n["peer"] == sites.peers[node].as_str())
            .and_then(|n| n["row"].as_u64())
    };
    let in_group = |node: &str| row_of(node).is_some_and(|r| rows.contains(&r.to_string()));
    ensure!(
        ["ei1", "ei2"].iter().any(|n| in_group(n)) && ["sym1", "sym2"].iter().any(|n| in_group(n)),
        "the hop group ({rows}) has members in both homes"
    );
    drop(sites.nodes);
    drop(sites.seed.proc.take());
    drop(lab);
    Ok(())
}
