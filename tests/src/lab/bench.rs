//! `lab bench`: the mesh measured between sites. A leader site (two API nodes, one drafting,
//! one not), a public member site (the seed and two holders) and a home site behind an
//! endpoint-independent NAT (two holders), SmolLM2 on k = 3 of 7 compact rows. For each
//! setting (delay and loss between sites, the home's rate), the same mesh with its links
//! reshaped: ms a token through the API with drafts and without, against the floor of the
//! pass the API ran (hops × delay, or two delays a round, for members on different sites;
//! two delays a pass for a hop group whose live members share a site),
//! the time to first token of a short and a long prompt, and the bytes each site's link
//! carried a token; then a stream during which the home site is cut off, and the next one.

use std::collections::BTreeSet;
use std::io::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use node_native::bench::apistream::{Streamed, stream_completion};

use super::{Lab, Nat, Site, Topology, unavailable, within};
use crate::procs::{Proc, metric, spawn_command};

/// What `lab bench` measures.
#[derive(Debug, clap::Args)]
pub struct Options {
    /// The link settings to measure at, each `MS/LOSS/MBIT`: one-way delay between two sites
    /// in ms (each site's link has half), frames lost between two sites in percent (each
    /// link loses half), and the home site's rate in Mbit/s (the others have 100). The home
    /// site is cut off mid-stream at the first, after all of them.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "25/0/100,10/0/100,25/0/20,25/1/100"
    )]
    pub settings: Vec<Setting>,
    /// Tokens of each timed stream.
    #[arg(long, default_value_t = 16)]
    pub tokens: usize,
    /// Tokens of the prompt whose time to first token is measured.
    #[arg(long, default_value_t = 512)]
    pub prompt_tokens: usize,
    /// Rows needed to compute (the mesh has 7).
    #[arg(long, default_value_t = 3)]
    pub k: usize,
    /// The model; default SmolLM2-135M-Instruct.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Where the nodes' data and logs go; default a fresh directory under the system's
    /// temporary one, removed after a run that succeeds.
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

/// One link setting of the bench.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Setting {
    /// One-way delay between two sites, in ms.
    pub ms: f64,
    /// Frames lost between two sites, in percent.
    pub loss: f64,
    /// The home site's rate, in Mbit/s.
    pub home_mbit: f64,
}

impl std::str::FromStr for Setting {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("a setting is MS/LOSS/MBIT (for example 25/0/100), not {s:?}");
        let v: Vec<f64> = s
            .split('/')
            .map(|w| w.trim().parse::<f64>().map_err(|_| bad()))
            .collect::<Result<_, _>>()?;
        let &[ms, loss, home_mbit] = v.as_slice() else {
            return Err(bad());
        };
        if !(0.0..=10_000.0).contains(&ms) {
            return Err(format!("a delay of {ms} ms is out of 0 to 10000"));
        }
        if !(0.0..100.0).contains(&loss) {
            return Err(format!("a loss of {loss} % is out of 0 to under 100"));
        }
        if !(home_mbit.is_finite() && home_mbit > 0.0) {
            return Err(format!("a rate of {home_mbit} Mbit/s is not above 0"));
        }
        Ok(Self {
            ms,
            loss,
            home_mbit,
        })
    }
}

impl std::fmt::Display for Setting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ms, {} % loss, home {} Mbit/s",
            self.ms, self.loss, self.home_mbit
        )
    }
}

/// The API port of the API nodes, inside their namespaces.
const API_PORT: u16 = 8000;

/// The bench's sites and their nodes: (site, NAT, Mbit/s, nodes).
const SITES: [(&str, Nat, f64, &[&str]); 3] = [
    ("lead", Nat::None, 100.0, &["api", "api0"]),
    ("a", Nat::None, 100.0, &["seed", "a2", "a3"]),
    ("b", Nat::EndpointIndependent, 100.0, &["b1", "b2"]),
];

/// Rows of the bench's mesh: one a node (compact q8 rows, as `up` serves, reach 7 at k = 3).
const ROWS: usize = 7;

/// The bench's topology at `set`.
fn topology(set: Setting) -> Topology {
    Topology {
        name: "bench".into(),
        sites: SITES
            .iter()
            .map(|&(name, nat, rate, nodes)| Site {
                name: name.into(),
                nat,
                delay_ms: set.ms / 2.0,
                rate_mbit: if name == "b" { set.home_mbit } else { rate },
                loss_percent: set.loss / 2.0,
                nodes: nodes.iter().map(|n| n.to_string()).collect(),
            })
            .collect(),
    }
}

/// The API's address inside an API node's namespace.
fn api_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], API_PORT))
}

/// `GET path` from the API node whose namespace is `ns`: the body of a 200 answer.
fn get(ns: &str, path: &str) -> Result<String> {
    within(ns, || crate::procs::http_get(api_addr(), path))
}

/// Forward steps, and those by hop, an API node ran between two reads of its `/metrics`.
fn steps_between(before: &str, after: &str) -> Result<(f64, f64)> {
    let d = |name: &str| -> Result<f64> { Ok(metric(after, name)? - metric(before, name)?) };
    Ok((
        d("codedmesh_forward_steps_total")?,
        d("codedmesh_hop_steps_total")?,
    ))
}

/// Bytes each site's link carried so far: (up, down) by site; none for a site cut off.
fn link_bytes(lab: &Lab) -> Result<Vec<(u64, u64)>> {
    let t = &lab.topology;
    t.sites
        .iter()
        .map(|s| {
            let out = std::process::Command::new("ip")
                .args(["-n", &t.gateway(s), "-s", "-j", "link", "show", "wan0"])
                .output()?;
            if !out.status.success() {
                // A site cut off has no link left to count on.
                let why = String::from_utf8_lossy(&out.stderr);
                ensure!(
                    why.contains("does not exist"),
                    "ip -s link in {}: {why}",
                    t.gateway(s)
                );
                return Ok((0, 0));
            }
            let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
            let stats = &v[0]["stats64"];
            let n = |dir: &str| stats[dir]["bytes"].as_u64().context("no byte count");
            Ok((n("tx")?, n("rx")?))
        })
        .collect()
}

/// One timed stream, and what the API node and the links counted during it.
#[derive(Debug)]
struct Measured {
    streamed: Streamed,
    /// The sites of the members of the hop group the API node last formed before the stream.
    hop_sites: Option<BTreeSet<&'static str>>,
    /// Forward steps the API node ran, and how many of them one hop per stage.
    steps: f64,
    hop_steps: f64,
    /// Bytes each site's link carried until the first token, and after it: (up, down).
    prompt_bytes: Vec<(u64, u64)>,
    bytes: Vec<(u64, u64)>,
}

/// Bytes each site's link had carried at an instant.
type Sample = (Instant, Vec<(u64, u64)>);

/// Bytes each link carried from `a` to `b`.
fn between(a: &[(u64, u64)], b: &[(u64, u64)]) -> Vec<(u64, u64)> {
    a.iter()
        .zip(b)
        .map(|(a, b)| (b.0.saturating_sub(a.0), b.1.saturating_sub(a.1)))
        .collect()
}

/// The bench's mesh in the lab.
struct Bench {
    lab: Lab,
    procs: Vec<Proc>,
    dir: PathBuf,
    seed_tcp: String,
    codedmesh: PathBuf,
    model_id: String,
    /// Rows needed to compute.
    k: usize,
    /// Stages of a pass: hops of one hop per stage, rounds of the leader's.
    hops: f64,
    rounds: f64,
}

impl Bench {
    fn ns(&self, node: &str) -> Result<String> {
        self.lab.topology.namespace(node)
    }

    /// Starts `codedmesh ARGS` as node `node`.
    fn spawn(&mut self, node: &str, args: &[&str], stdout: Stdio) -> Result<()> {
        let mut cmd = self.lab.topology.command(node, &self.codedmesh)?;
        // The nodes log warnings, or what RUST_LOG asks for; an API node also the hop groups
        // it forms (the floor follows where their members are).
        let mut log = std::env::var("RUST_LOG").unwrap_or_else(|_| "warn".into());
        if node.starts_with("api") {
            log.push_str(",node_native::serve::engine::hop=info");
        }
        // Plain logs: the bench reads them.
        cmd.args(args).env("RUST_LOG", log).env("NO_COLOR", "1");
        let p = spawn_command(cmd, &self.dir, node, stdout)?;
        self.procs.push(p);
        Ok(())
    }

    /// The seed, then every node; waits until every row is healthy and the API answers.
    fn start(&mut self, model: &Path) -> Result<()> {
        let dir = self.dir.clone();
        let data = |n: &str| dir.join(n).display().to_string();
        let (seed_data, model_s) = (data("seed"), model.display().to_string());
        let k = self.k.to_string();
        let n = ROWS.to_string();
        let args = ["seed", "--k", &k, "--n", &n, "--model", &model_s];
        let mut args = args.to_vec();
        args.extend(["--data", &seed_data, "--listen", "/ip4/0.0.0.0/tcp/4001"]);
        let out_path = self.dir.join("seed.out");
        let out = Stdio::from(std::fs::File::create(&out_path)?);
        eprintln!("lab bench: the seed encodes the model");
        self.spawn("seed", &args, out)?;
        let seed = self.procs.last_mut().context("no seed")?;
        seed.wait_log("serving row", Duration::from_secs(900))?;
        let listening = std::fs::read_to_string(&out_path)?;
        let ip = self.lab.topology.addr("seed")?;
        let addr = |proto: &str| super::listening_addr(&listening, ip, proto);
        let (tcp, quic) = (addr("/tcp/")?, addr("/quic-v1/")?);
        self.seed_tcp = tcp.clone();
        let api = format!("127.0.0.1:{API_PORT}");
        for node in ["api", "api0", "a2", "a3", "b1", "b2"] {
            let d = data(node);
            let behind_nat = node.starts_with('b');
            let boot = if behind_nat { &quic } else { &tcp };
            let mut a = vec!["node", "--bootstrap", boot, "--data", &d, "--listen"];
            a.push(if behind_nat {
                "/ip4/0.0.0.0/udp/4001/quic-v1"
            } else {
                "/ip4/0.0.0.0/tcp/4001"
            });
            if node.starts_with("api") {
                a.extend(["--api-listen", &api]);
            }
            if node == "api0" {
                a.extend(["--draft", "0"]);
            }
            self.spawn(node, &a, Stdio::null())?;
        }
        eprintln!("lab bench: {ROWS} nodes join (a row each over the links)");
        let began = Instant::now();
        let mut last_said = Instant::now();
        loop {
            let healthy = self.healthy_rows().unwrap_or(0);
            if healthy >= ROWS as u64 {
                break;
            }
            if let Some(p) = self.procs.iter_mut().find_map(|p| {
                p.child
                    .try_wait()
                    .ok()
                    .flatten()
                    .map(|s| (p.name.clone(), s))
            }) {
                bail!(
                    "{} exited ({}): see {}/{0}.log",
                    p.0,
                    p.1,
                    self.dir.display()
                );
            }
            ensure!(
                began.elapsed() < Duration::from_secs(900),
                "only {healthy} of {ROWS} rows healthy after 15 min (logs in {})",
                self.dir.display()
            );
            if last_said.elapsed() > Duration::from_secs(15) {
                eprintln!(
                    "lab bench: {healthy} of {ROWS} rows healthy after {:.0} s",
                    began.elapsed().as_secs_f64()
                );
                last_said = Instant::now();
            }
            std::thread::sleep(Duration::from_millis(500));
        }
        eprintln!(
            "lab bench: every row healthy after {:.0} s",
            began.elapsed().as_secs_f64()
        );
        let models: serde_json::Value =
            serde_json::from_str(&get(&self.ns("api")?, "/v1/models")?)?;
        self.model_id = models["data"][0]["id"]
            .as_str()
            .context("/v1/models names no model")?
            .to_string();
        Ok(())
    }

    /// Healthy rows as `codedmesh status` on the leader site sees them.
    fn healthy_rows(&self) -> Result<u64> {
        let out = self
            .lab
            .topology
            .command("api", &self.codedmesh)?
            .args(["status", "--json", "--bootstrap", &self.seed_tcp])
            .output()?;
        ensure!(
            out.status.success(),
            "status: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let s: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        s["healthy_rows"]
            .as_u64()
            .context("status has no healthy_rows")
    }

    /// Streams `tokens` after `prompt` from API node `node`.
    fn stream(&self, node: &str, prompt: &[u32], tokens: usize) -> Result<Streamed> {
        stream_in(&self.ns(node)?, &self.model_id, prompt, tokens)
    }

    /// Gives every site's link the setting's share: half the delay and loss between two
    /// sites, the home site's rate to site b.
    fn shape(&mut self, set: Setting) -> Result<()> {
        for site in topology(set).sites {
            let (ms, mbit, loss) = (site.delay_ms, site.rate_mbit, site.loss_percent);
            self.lab.reshape(&site.name, ms, mbit, loss)?;
        }
        Ok(())
    }

    /// [`Bench::stream`], with what the node's metrics and the links counted (the links
    /// sampled every 200 ms, to tell the prompt's bytes from the tokens').
    fn measure(&self, node: &str, prompt: &[u32], tokens: usize) -> Result<Measured> {
        let ns = self.ns(node)?;
        let hop_sites = self.hop_sites(node);
        let m0 = get(&ns, "/metrics")?;
        let done = std::sync::atomic::AtomicBool::new(false);
        let (sent, samples, streamed) = std::thread::scope(|s| {
            let sampler = s.spawn(|| -> Result<Vec<Sample>> {
                let mut samples = Vec::new();
                loop {
                    samples.push((Instant::now(), link_bytes(&self.lab)?));
                    if done.load(std::sync::atomic::Ordering::Relaxed) {
                        return Ok(samples);
                    }
                    std::thread::sleep(Duration::from_millis(200));
                }
            });
            let sent = Instant::now();
            let streamed = self.stream(node, prompt, tokens);
            done.store(true, std::sync::atomic::Ordering::Relaxed);
            let samples = sampler
                .join()
                .map_err(|_| anyhow::anyhow!("the link sampler panicked"));
            (sent, samples, streamed)
        });
        let (samples, streamed) = (samples??, streamed?);
        let m1 = get(&ns, "/metrics")?;
        let (steps, hop_steps) = steps_between(&m0, &m1)?;
        let first = sent + streamed.first;
        let start = &samples.first().context("no link sample")?.1;
        let at_first = &samples
            .iter()
            .rev()
            .find(|(t, _)| *t <= first)
            .unwrap_or(&samples[0])
            .1;
        let end = &samples.last().context("no link sample")?.1;
        Ok(Measured {
            streamed,
            hop_sites,
            steps,
            hop_steps,
            prompt_bytes: between(start, at_first),
            bytes: between(at_first, end),
        })
    }

    /// The sites of the live members of the hop group API node `api` formed last (a cut
    /// site's members have left it).
    fn hop_sites(&self, api: &str) -> Option<BTreeSet<&'static str>> {
        let mut sites = hop_sites(&self.dir, api)?;
        sites.retain(|site| !self.lab.is_cut(site));
        Some(sites)
    }

    /// The pass the steps ran and its floor a step at one-way `ms` between sites: a hop pass
    /// whose members span sites waits a delay a hop; one whose members share a site, only the
    /// leader's feed and their answers.
    fn floor(&self, m: &Measured, ms: f64) -> (String, f64) {
        let hop_share = m.hop_steps / m.steps.max(1.0);
        let (hops, within) = match &m.hop_sites {
            Some(sites) if sites.len() == 1 && sites.contains("lead") => {
                (0.0, " on the leader's site")
            }
            Some(sites) if sites.len() == 1 => (2.0, " within one site"),
            _ => (self.hops, ""),
        };
        let per_step = ms * (hop_share * hops + (1.0 - hop_share) * self.rounds * 2.0);
        let pass = if m.hop_steps >= m.steps {
            format!("hops{within}")
        } else if m.hop_steps == 0.0 {
            "rounds".to_string()
        } else {
            format!("{:.0} of {:.0} steps by hop", m.hop_steps, m.steps)
        };
        (pass, per_step)
    }
}

/// Node `node`'s log in `dir` (its stderr, without colours: [`Bench::spawn`]).
fn log(dir: &Path, node: &str) -> String {
    std::fs::read_to_string(dir.join(format!("{node}.log"))).unwrap_or_default()
}

/// The sites of the members of the hop group API node `api` formed last (its log in `dir`
/// names their rows, each node's log the row it serves); `None` before it formed one.
fn hop_sites(dir: &Path, api: &str) -> Option<BTreeSet<&'static str>> {
    let api_log = log(dir, api);
    let line = api_log
        .lines()
        .rev()
        .find(|l| l.contains("passes go one hop per stage"))?;
    let rows = line.split("rows=[").nth(1)?.split(']').next()?;
    let logs: Vec<(&'static str, String)> = SITES
        .iter()
        .flat_map(|(site, _, _, nodes)| nodes.iter().map(|n| (*site, log(dir, n))))
        .collect();
    rows.split(',')
        .map(|row| {
            let serving = format!("serving row {} as", row.trim());
            logs.iter()
                .find(|(_, l)| l.contains(&serving))
                .map(|(site, _)| *site)
        })
        .collect()
}

/// Streams `tokens` after `prompt` from the API node in namespace `ns`.
fn stream_in(ns: &str, model: &str, prompt: &[u32], tokens: usize) -> Result<Streamed> {
    within(ns, || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        rt.block_on(stream_completion(api_addr(), model, prompt, tokens))
    })
}

/// KiB each site's link carried, up and down, per `per` (`lead 3.1↑ 2.0↓, …`).
fn per_token(bytes: &[(u64, u64)], per: usize) -> String {
    let kib = |b: u64| b as f64 / 1024.0 / per.max(1) as f64;
    SITES
        .iter()
        .zip(bytes)
        .map(|((site, ..), &(up, down))| format!("{site} {:.1}↑ {:.1}↓", kib(up), kib(down)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Prints one row of the table (and keeps it on stdout as it comes).
fn print_row(cells: &[String]) {
    println!("| {} |", cells.join(" | "));
    let _ = std::io::stdout().flush();
}

/// A decode row: ms a token after the first against the floor of the pass that ran.
fn decode_row(b: &Bench, setting: &str, what: &str, m: &Measured, ms: f64) -> Vec<String> {
    let s = &m.streamed;
    let decode_ms = 1e3 / s.decode_tokens_per_s().max(1e-9);
    let (pass, per_step) = b.floor(m, ms);
    // The first step is the prompt's; the rest made the tokens after the first.
    let steps = (m.steps - 1.0).max(1.0);
    let floor = per_step * steps / s.tokens.saturating_sub(1).max(1) as f64;
    vec![
        setting.to_string(),
        what.to_string(),
        format!("{decode_ms:.0} ({} tokens, {steps:.0} passes)", s.tokens),
        format!("{floor:.0} ({pass})"),
        format!("**{:.2}×**", decode_ms / floor.max(1e-9)),
        format!("{:.2} s", s.first.as_secs_f64()),
        per_token(&m.bytes, s.tokens.saturating_sub(1)),
    ]
}

/// Runs the bench: builds the lab and the mesh, measures every setting, cuts the home site off
/// mid-stream at the first setting, and prints the table. `lab_bin` is the `lab` binary.
pub fn run(opts: &Options, lab_bin: &Path) -> Result<()> {
    let Some(&first_setting) = opts.settings.first() else {
        bail!("--settings needs at least one");
    };
    ensure!(opts.tokens >= 4, "--tokens must be 4 or more");
    ensure!((1..ROWS).contains(&opts.k), "--k must be 1 to {}", ROWS - 1);
    let model = match &opts.model {
        Some(m) => m.clone(),
        None => node_native::fetch::default_model()?,
    };
    let loaded = node_native::load::load_model(&model)?;
    let layers = loaded.weights.cfg.layers as f64;
    let summary = node_native::bench::summary_prompt(&loaded.tokenizer)?;
    let long = node_native::bench::long_prompt(&loaded.tokenizer, opts.prompt_tokens)?;
    drop(loaded);
    let topo = topology(first_setting);
    if let Some(why) = unavailable(&topo) {
        bail!("the network lab cannot run here: {why}");
    }
    let codedmesh = std::env::var_os("CODEDMESH_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| lab_bin.with_file_name("codedmesh"));
    ensure!(
        codedmesh.exists(),
        "{} is missing: cargo build --release -p node-native",
        codedmesh.display()
    );
    let (dir, temporary) = match &opts.dir {
        Some(d) => (d.clone(), false),
        None => (
            std::env::temp_dir().join(format!("codedmesh-lab-bench-{}", std::process::id())),
            true,
        ),
    };
    std::fs::create_dir_all(&dir)?;
    let lab = Lab::up(&topo, lab_bin)?;
    let mut b = Bench {
        lab,
        procs: Vec::new(),
        dir: dir.clone(),
        seed_tcp: String::new(),
        codedmesh,
        model_id: String::new(),
        k: opts.k,
        // A pass: the feed, the embedding lookup, four stages a layer and the LM head.
        hops: 4.0 * layers + 3.0,
        rounds: 4.0 * layers + 2.0,
    };
    b.start(&model)?;
    println!(
        "\nSmolLM2 on k = {} of {ROWS} rows; sites lead (api, api0: 100 Mbit/s), a (seed, a2, a3: 100 Mbit/s), b, the home (b1, b2: endpoint-independent NAT); {} tokens a stream; floors: {} hops or {} rounds × 2 a pass\n",
        opts.k, opts.tokens, b.hops, b.rounds
    );
    print_row(&[
        "between sites".into(),
        "stream".into(),
        "ms a token".into(),
        "floor (pass)".into(),
        "× floor".into(),
        "first token".into(),
        "KiB a token on each site's link".into(),
    ]);
    print_row(&vec!["---".to_string(); 7]);
    for &set in &opts.settings {
        let ms = set.ms;
        b.shape(set)?;
        let setting = set.to_string();
        // Each API node forms its group at this setting and picks its pass.
        b.stream("api", &summary, 4)?;
        b.stream("api0", &summary, 4)?;
        let on = b.measure("api", &summary, opts.tokens)?;
        print_row(&decode_row(&b, &setting, "drafts (api)", &on, ms));
        let off = b.measure("api0", &summary, opts.tokens)?;
        print_row(&decode_row(&b, &setting, "a token a pass (api0)", &off, ms));
        let first = b.measure("api0", &long, 2)?;
        let (pass, per_step) = b.floor(&first, ms);
        let prefill = (first.steps - 1.0).max(1.0);
        print_row(&[
            setting.clone(),
            format!("{}-token prompt (api0)", long.len()),
            String::new(),
            format!("{:.0} ({pass}, {prefill:.0} passes)", per_step * prefill),
            String::new(),
            format!("**{:.2} s**", first.streamed.first.as_secs_f64()),
            per_token(&first.prompt_bytes, long.len()),
        ]);
    }
    // The home site goes dark a quarter into a stream at the first setting.
    let ms = first_setting.ms;
    b.shape(first_setting)?;
    b.stream("api", &summary, 4)?;
    let before = b.stream("api", &summary, opts.tokens)?;
    let cut_at = before.first + before.streaming / 4;
    let (ns, model) = (b.ns("api")?, b.model_id.clone());
    let ns0 = b.lab.topology.namespace("api")?;
    let hop_sites = b.hop_sites("api");
    let (b0, m0) = (link_bytes(&b.lab)?, get(&ns0, "/metrics")?);
    let tokens = opts.tokens;
    let cut_stream = std::thread::scope(|s| -> Result<Streamed> {
        let streaming = s.spawn(|| stream_in(&ns, &model, &summary, tokens));
        std::thread::sleep(cut_at);
        b.lab.cut("b")?;
        streaming
            .join()
            .map_err(|_| anyhow::anyhow!("the stream's thread panicked"))?
    })?;
    let (b1, m1) = (link_bytes(&b.lab)?, get(&ns0, "/metrics")?);
    let (steps, hop_steps) = steps_between(&m0, &m1)?;
    // The bytes of the whole stream, its prompt's among them (site b's stop at the cut).
    let cut = Measured {
        streamed: cut_stream,
        hop_sites,
        steps,
        hop_steps,
        prompt_bytes: vec![(0, 0); SITES.len()],
        bytes: between(&b0, &b1),
    };
    let setting = first_setting.to_string();
    let mut row = decode_row(
        &b,
        &setting,
        "drafts (api), site b cut off mid-stream",
        &cut,
        ms,
    );
    row[5] = format!(
        "{:.2} s; longest wait {:.2} s",
        cut.streamed.first.as_secs_f64(),
        cut.streamed.longest_gap.as_secs_f64()
    );
    print_row(&row);
    let after = b.measure("api", &summary, opts.tokens)?;
    print_row(&decode_row(
        &b,
        &setting,
        "drafts (api), the next stream without site b",
        &after,
        ms,
    ));
    drop(b);
    if temporary {
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hop_groups_sites_are_read_from_the_nodes_logs() -> Result<()> {
        let dir = crate::procs::Scratch::new("bench-hop-sites");
        let write =
            |node: &str, text: &str| std::fs::write(dir.0.join(format!("{node}.log")), text);
        assert_eq!(hop_sites(&dir.0, "api"), None);
        write(
            "api",
            "\u{1b}[2mx\u{1b}[0m INFO passes go one hop per stage rows=[1, 5] network_per_round_us=9\n\
             INFO passes go one hop per stage rows=[1, 2] network_per_round_us=9\n",
        )?;
        write("seed", "serving row 1 as P\n")?;
        write("a2", "serving row 2 as Q\n")?;
        write("b1", "serving row 5 as R\n")?;
        assert_eq!(hop_sites(&dir.0, "api"), Some(BTreeSet::from(["a"])));
        write("api", "INFO passes go one hop per stage rows=[2, 5]\n")?;
        assert_eq!(hop_sites(&dir.0, "api"), Some(BTreeSet::from(["a", "b"])));
        // A row no node serves: the sites are not known.
        write("api", "INFO passes go one hop per stage rows=[2, 6]\n")?;
        assert_eq!(hop_sites(&dir.0, "api"), None);
        Ok(())
    }

    #[test]
    fn settings_read_as_written_and_bad_ones_say_why() -> Result<(), String> {
        let s: Setting = "25/1/20".parse()?;
        assert_eq!(
            s,
            Setting {
                ms: 25.0,
                loss: 1.0,
                home_mbit: 20.0
            }
        );
        assert_eq!(s.to_string(), "25 ms, 1 % loss, home 20 Mbit/s");
        for bad in [
            "",
            "25",
            "25/0",
            "25/0/100/1",
            "a/0/100",
            "-1/0/100",
            "25/100/100",
            "25/0/0",
        ] {
            assert!(bad.parse::<Setting>().is_err(), "{bad:?}");
        }
        Ok(())
    }
}
