//! A network lab on one Linux machine, as root: every node in its own network namespace, each
//! site's nodes behind the site's gateway, and every gateway joined to a shared internet (the
//! `core` namespace) by a [`link`] that delays, paces and loses every frame in user space.
//! A site may sit behind NAT (nftables masquerade): endpoint-independent, which keeps a
//! socket's public port for every peer, or symmetric, which picks a new one for each peer.
//!
//! Addresses: site `i` (from 1) meets the core on 198.18.i.0/24 (core .1, gateway .2). A public
//! site's nodes have 198.19.i.2… (routed); a NAT'd site's have 192.168.i.2… (not routed) and
//! reach out as 198.18.i.2. The public ranges are RFC 2544's (benchmarking), which no host
//! treats as private, so nodes in the lab tell public addresses from private ones as on the
//! internet. Between two sites a frame crosses both sites' links: the one-way
//! delay is the sum of theirs.

pub mod bench;
pub mod link;

use std::fmt::Write as _;
use std::io::{BufRead, BufReader, Write as _};
use std::net::Ipv4Addr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use serde::{Deserialize, Serialize};

/// A lab: sites and their nodes.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Topology {
    /// Short name; namespaces are `cm-<name>-…`.
    pub name: String,
    /// The sites.
    #[serde(rename = "site")]
    pub sites: Vec<Site>,
}

/// A site: a gateway, its link to the internet and the nodes behind it.
#[derive(Debug, Clone, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Site {
    /// Its name.
    pub name: String,
    /// Whether its gateway translates addresses.
    #[serde(default)]
    pub nat: Nat,
    /// One-way delay of its link, each way, in milliseconds.
    #[serde(default)]
    pub delay_ms: f64,
    /// Rate of its link, each way, in Mbit/s; 0 is unlimited.
    #[serde(default)]
    pub rate_mbit: f64,
    /// Share of frames its link loses, each way, in percent.
    #[serde(default)]
    pub loss_percent: f64,
    /// Its nodes' names (unique in the lab).
    pub nodes: Vec<String>,
}

/// How a site's gateway translates its nodes' addresses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Nat {
    /// No NAT: the site's nodes have public addresses.
    #[default]
    None,
    /// Masquerade that keeps a socket's port for every peer (hole punching works).
    EndpointIndependent,
    /// Masquerade with a random port for each peer (hole punching fails; relays carry it).
    Symmetric,
}

/// Where `lab up` records what `lab down` removes.
fn state_dir() -> PathBuf {
    PathBuf::from("/run/codedmesh-lab")
}

impl Topology {
    /// The position of site `name` among the sites.
    fn site_index(&self, name: &str) -> Result<usize> {
        self.sites
            .iter()
            .position(|s| s.name == name)
            .with_context(|| format!("lab {} has no site {name}", self.name))
    }

    /// Reads and checks a topology file.
    pub fn load(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let topo: Self = toml::from_str(&text).with_context(|| format!("{}", path.display()))?;
        topo.check()?;
        Ok(topo)
    }

    /// Names are short and plain, the numbers in range, every node named once.
    pub fn check(&self) -> Result<()> {
        let plain = |s: &str| {
            !s.is_empty()
                && s.len() <= 12
                && s.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        };
        ensure!(
            plain(&self.name),
            "lab name {:?}: 1 to 12 of a-z, 0-9, -",
            self.name
        );
        ensure!(
            (1..=250).contains(&self.sites.len()),
            "a lab has 1 to 250 sites"
        );
        let mut seen = std::collections::BTreeSet::new();
        for s in &self.sites {
            ensure!(
                plain(&s.name) && s.name != "core",
                "site name {:?}: 1 to 12 of a-z, 0-9, - (not core)",
                s.name
            );
            ensure!(
                s.delay_ms.is_finite() && (0.0..=10_000.0).contains(&s.delay_ms),
                "site {}: delay_ms must be 0 to 10000",
                s.name
            );
            ensure!(
                s.rate_mbit.is_finite() && s.rate_mbit >= 0.0,
                "site {}: rate_mbit must be 0 (unlimited) or more",
                s.name
            );
            ensure!(
                (0.0..100.0).contains(&s.loss_percent),
                "site {}: loss_percent must be 0 to under 100",
                s.name
            );
            ensure!(
                (1..=200).contains(&s.nodes.len()),
                "site {}: 1 to 200 nodes",
                s.name
            );
            ensure!(seen.insert(s.name.clone()), "site {} twice", s.name);
            for n in &s.nodes {
                ensure!(plain(n), "node name {n:?}: 1 to 12 of a-z, 0-9, -");
                ensure!(seen.insert(n.clone()), "the name {n} is used twice");
            }
        }
        Ok(())
    }

    /// The site index (from 1) and node index of `node`.
    fn find(&self, node: &str) -> Result<(usize, usize)> {
        for (i, s) in self.sites.iter().enumerate() {
            if let Some(j) = s.nodes.iter().position(|n| n == node) {
                return Ok((i + 1, j));
            }
        }
        bail!("lab {} has no node {node}", self.name)
    }

    /// The network namespace of `node`.
    pub fn namespace(&self, node: &str) -> Result<String> {
        self.find(node)?;
        Ok(format!("cm-{}-{node}", self.name))
    }

    /// The address `node` has on its own interface.
    pub fn addr(&self, node: &str) -> Result<Ipv4Addr> {
        let (i, j) = self.find(node)?;
        Ok(lan(i, &self.sites[i - 1], j as u8 + 2))
    }

    /// The address peers on other sites see `node` at (its gateway's, behind NAT).
    pub fn seen_as(&self, node: &str) -> Result<Ipv4Addr> {
        let (i, _) = self.find(node)?;
        Ok(match self.sites[i - 1].nat {
            Nat::None => self.addr(node)?,
            _ => wan(i, 2),
        })
    }

    /// A command that runs `program` in `node`'s namespace.
    pub fn command(&self, node: &str, program: impl AsRef<std::ffi::OsStr>) -> Result<Command> {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.namespace(node)?])
            .arg(program);
        Ok(c)
    }

    fn core(&self) -> String {
        format!("cm-{}-core", self.name)
    }

    /// The network namespace of `site`'s gateway.
    pub fn gateway(&self, site: &Site) -> String {
        format!("cm-{}-{}", self.name, site.name)
    }

    /// Every namespace of the lab: the core, the gateways, the nodes.
    fn namespaces(&self) -> Vec<String> {
        let mut out = vec![self.core()];
        for s in &self.sites {
            out.push(self.gateway(s));
            out.extend(s.nodes.iter().map(|n| format!("cm-{}-{n}", self.name)));
        }
        out
    }
}

/// Address `host` on site `i`'s side of the core (198.18.i.0/24).
fn wan(i: usize, host: u8) -> Ipv4Addr {
    Ipv4Addr::new(198, 18, i as u8, host)
}

/// Address `host` on site `i`'s network.
fn lan(i: usize, site: &Site, host: u8) -> Ipv4Addr {
    match site.nat {
        Nat::None => Ipv4Addr::new(198, 19, i as u8, host),
        _ => Ipv4Addr::new(192, 168, i as u8, host),
    }
}

/// Why this machine cannot run the lab, if it cannot: root, `ip`, `nft`, TUN devices, netns.
pub fn unavailable(topo: &Topology) -> Option<String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Some("the lab needs root (network namespaces, TAP devices, nftables)".into());
    }
    let has = |tool: &str| {
        Command::new(tool)
            .arg("-V")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if !has("ip") {
        return Some("no `ip` (apt-get install iproute2)".into());
    }
    if topo.sites.iter().any(|s| s.nat != Nat::None) && !has("nft") {
        return Some("no `nft` for the NAT'd sites (apt-get install nftables)".into());
    }
    if !Path::new("/dev/net/tun").exists() {
        return Some("no /dev/net/tun: the links need TAP devices".into());
    }
    // One name per call: two tests of a process may probe at once.
    static PROBES: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = PROBES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let probe = format!("cm-probe-{}-{n}", std::process::id());
    match run("ip", &["netns", "add", &probe]) {
        Ok(()) => {
            let _ = run("ip", &["netns", "del", &probe]);
            None
        }
        Err(e) => Some(format!("network namespaces are not allowed here: {e:#}")),
    }
}

/// The address among a node's `listening: …` lines (its stdout) at `ip` whose transport
/// contains `proto` (`/tcp/`, `/quic-v1/`), WebSocket left out.
pub fn listening_addr(listening: &str, ip: Ipv4Addr, proto: &str) -> Result<String> {
    listening
        .lines()
        .filter_map(|l| l.strip_prefix("listening: "))
        .find(|a| a.starts_with(&format!("/ip4/{ip}/")) && a.contains(proto) && !a.contains("/ws"))
        .map(str::to_string)
        .with_context(|| format!("no {proto} address at {ip} in:\n{listening}"))
}

/// Runs a command; its stderr becomes the error.
fn run(program: &str, args: &[&str]) -> Result<()> {
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("running {program}"))?;
    ensure!(
        out.status.success(),
        "{program} {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

/// `ip -n NS ARGS…`.
fn ip(ns: &str, args: &str) -> Result<()> {
    let mut all = vec!["-n", ns];
    all.extend(args.split_whitespace());
    run("ip", &all)
}

/// Runs a shell-free command inside a namespace, with `stdin` as its input.
fn in_ns(ns: &str, program: &str, args: &[&str], stdin: &str) -> Result<()> {
    let mut child = Command::new("ip")
        .args(["netns", "exec", ns, program])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {program} in {ns}"))?;
    child
        .stdin
        .take()
        .context("stdin")?
        .write_all(stdin.as_bytes())?;
    let out = child.wait_with_output()?;
    ensure!(
        out.status.success(),
        "{program} in {ns}: {}",
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

/// A sysctl inside a namespace (through /proc, which `ip netns exec` mounts for it).
fn sysctl(ns: &str, key: &str, value: &str) -> Result<()> {
    let path = format!("/proc/sys/{}", key.replace('.', "/"));
    in_ns(ns, "tee", &[&path], value)
}

/// What `lab down` needs: the namespaces and the link processes.
#[derive(Debug, Serialize, Deserialize)]
struct State {
    topology: Topology,
    links: Vec<u32>,
}

/// A running lab; dropping it tears it down unless [`Lab::detach`] handed it to `lab down`.
#[derive(Debug)]
pub struct Lab {
    /// What it runs.
    pub topology: Topology,
    links: Vec<u32>,
    owned: bool,
}

impl Lab {
    /// Builds the lab; `lab_bin` is the `lab` binary, whose `link` command carries each link.
    pub fn up(topology: &Topology, lab_bin: &Path) -> Result<Self> {
        topology.check()?;
        if let Some(why) = unavailable(topology) {
            bail!("{why}");
        }
        let taken: Vec<String> = list_namespaces()?
            .into_iter()
            .filter(|n| topology.namespaces().contains(n))
            .collect();
        ensure!(
            taken.is_empty(),
            "lab {} is up already ({}): scripts/lab.sh down {0} first",
            topology.name,
            taken.join(", ")
        );
        let mut lab = Self {
            topology: topology.clone(),
            links: Vec::new(),
            owned: true,
        };
        lab.build(lab_bin)
            .with_context(|| format!("starting lab {}", topology.name))?;
        // Recorded while it runs, so `lab down` can clear it after its owner was killed.
        lab.record()?;
        Ok(lab)
    }

    fn build(&mut self, lab_bin: &Path) -> Result<()> {
        let t = self.topology.clone();
        for ns in t.namespaces() {
            run("ip", &["netns", "add", &ns])?;
            ip(&ns, "link set lo up")?;
            // The lab is IPv4 only. Left on, IPv6 gives each new link a link-local address a
            // second or two after it comes up, and a browser that is connecting just then
            // takes the new address for a network change and fails the page
            // (ERR_NETWORK_CHANGED): the browser starts that soon after the lab.
            sysctl(&ns, "net.ipv6.conf.default.disable_ipv6", "1")?;
        }
        let core = t.core();
        sysctl(&core, "net.ipv4.ip_forward", "1")?;
        for (idx, site) in t.sites.iter().enumerate() {
            let i = idx + 1;
            let gw = t.gateway(site);
            self.spawn_link(lab_bin, site, i, &core, &gw)?;
            ip(&core, &format!("addr add {}/24 dev s{i}", wan(i, 1)))?;
            ip(&core, &format!("link set s{i} up"))?;
            ip(&gw, &format!("addr add {}/24 dev wan0", wan(i, 2)))?;
            ip(&gw, "link set wan0 up")?;
            ip(&gw, &format!("route add default via {}", wan(i, 1)))?;
            sysctl(&gw, "net.ipv4.ip_forward", "1")?;
            ip(&gw, "link add lan0 type bridge")?;
            ip(&gw, &format!("addr add {}/24 dev lan0", lan(i, site, 1)))?;
            ip(&gw, "link set lan0 up")?;
            for (j, node) in site.nodes.iter().enumerate() {
                let ns = t.namespace(node)?;
                ip(
                    &gw,
                    &format!("link add n{j} type veth peer name eth0 netns {ns}"),
                )?;
                ip(&gw, &format!("link set n{j} master lan0 up"))?;
                ip(
                    &ns,
                    &format!("addr add {}/24 dev eth0", lan(i, site, j as u8 + 2)),
                )?;
                ip(&ns, "link set eth0 up")?;
                ip(&ns, &format!("route add default via {}", lan(i, site, 1)))?;
            }
            match site.nat {
                Nat::None => ip(
                    &core,
                    &format!("route add {}/24 via {}", lan(i, site, 0), wan(i, 2)),
                )?,
                nat => in_ns(&gw, "nft", &["-f", "-"], &nat_rules(nat))?,
            }
        }
        Ok(())
    }

    /// Starts the `lab link` process of site `i` and waits until its TAP devices exist.
    fn spawn_link(
        &mut self,
        lab_bin: &Path,
        site: &Site,
        i: usize,
        core: &str,
        gw: &str,
    ) -> Result<()> {
        let file = shape_file(&self.topology.name, i);
        std::fs::create_dir_all(state_dir())?;
        std::fs::write(&file, site_shape(site).to_line())?;
        let mut child = Command::new(lab_bin)
            .args(["link", &format!("{core}:s{i}"), &format!("{gw}:wan0")])
            .arg("--shape-file")
            .arg(&file)
            .args(["--delay-ms", &site.delay_ms.to_string()])
            .args(["--rate-mbit", &site.rate_mbit.to_string()])
            .args(["--loss-percent", &site.loss_percent.to_string()])
            .args(["--seed", &i.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            // Its own process group: it outlives `lab up` and a ^C meant for a test's output.
            .process_group(0)
            .spawn()
            .with_context(|| format!("starting {}", lab_bin.display()))?;
        self.links.push(child.id());
        let mut line = String::new();
        BufReader::new(child.stdout.take().context("link stdout")?).read_line(&mut line)?;
        ensure!(
            line.trim() == "ready",
            "the link of site {} did not start (see its error above)",
            site.name
        );
        Ok(())
    }

    /// Changes site `name`'s link to `delay_ms`, `rate_mbit` and `loss_percent` while the lab
    /// runs (connections and NAT mappings stay), and waits until the link carries frames so.
    pub fn reshape(
        &mut self,
        name: &str,
        delay_ms: f64,
        rate_mbit: f64,
        loss_percent: f64,
    ) -> Result<()> {
        reshape(&mut self.topology, name, delay_ms, rate_mbit, loss_percent)
    }

    /// Cuts site `name` off the internet: its link stops carrying frames, as when a site
    /// loses power or its uplink.
    pub fn cut(&mut self, name: &str) -> Result<()> {
        let i = self.topology.site_index(name)?;
        let pid = std::mem::take(self.links.get_mut(i).context("the site has no link")?);
        ensure!(pid != 0, "site {name} is cut already");
        // SAFETY: kill and waitpid on a link process this lab started (0 marks it gone, so
        // teardown never signals a reused pid).
        unsafe {
            libc::kill(pid as i32, libc::SIGKILL);
            libc::waitpid(pid as i32, std::ptr::null_mut(), 0);
        }
        self.record()?;
        Ok(())
    }

    /// Whether site `name` was cut off ([`Lab::cut`]).
    pub fn is_cut(&self, name: &str) -> bool {
        self.topology
            .site_index(name)
            .is_ok_and(|i| self.links.get(i).is_some_and(|&pid| pid == 0))
    }

    /// Hands the lab to `lab down`: leaves it running.
    pub fn detach(mut self) -> Result<PathBuf> {
        let path = self.record()?;
        self.owned = false;
        Ok(path)
    }

    /// Records what `lab down` removes: the topology and the link processes.
    fn record(&self) -> Result<PathBuf> {
        std::fs::create_dir_all(state_dir())?;
        let path = state_dir().join(format!("{}.json", self.topology.name));
        let state = State {
            topology: self.topology.clone(),
            links: self.links.clone(),
        };
        std::fs::write(&path, serde_json::to_vec_pretty(&state)?)?;
        Ok(path)
    }

    /// The topology of the lab `name` that `lab up` left running.
    pub fn running(name: &str) -> Result<Topology> {
        let path = state_dir().join(format!("{name}.json"));
        let state: State = serde_json::from_slice(
            &std::fs::read(&path)
                .with_context(|| format!("no lab {name} is up ({} is missing)", path.display()))?,
        )
        .with_context(|| format!("{}", path.display()))?;
        Ok(state.topology)
    }

    /// Tears down the lab `name` that `lab up` left running.
    pub fn down(name: &str) -> Result<()> {
        let path = state_dir().join(format!("{name}.json"));
        let state: State = serde_json::from_slice(
            &std::fs::read(&path)
                .with_context(|| format!("no lab {name} is up ({} is missing)", path.display()))?,
        )
        .with_context(|| format!("{}", path.display()))?;
        let lab = Self {
            topology: state.topology,
            links: state.links,
            owned: true,
        };
        drop(lab);
        Ok(())
    }

    /// A summary: each node's namespace and addresses.
    pub fn describe(&self) -> String {
        let t = &self.topology;
        let mut out = String::new();
        for s in &t.sites {
            let _ = writeln!(
                out,
                "site {} ({:?} NAT, one-way {} ms, {} Mbit/s, {} % loss):",
                s.name, s.nat, s.delay_ms, s.rate_mbit, s.loss_percent
            );
            for n in &s.nodes {
                let (addr, seen) = (t.addr(n).ok(), t.seen_as(n).ok());
                let _ = writeln!(
                    out,
                    "  {n}: ip netns exec cm-{}-{n} …   address {}, seen from other sites as {}",
                    t.name,
                    addr.map(|a| a.to_string()).unwrap_or_default(),
                    seen.map(|a| a.to_string()).unwrap_or_default()
                );
            }
        }
        out
    }

    fn teardown(&mut self) {
        let t = &self.topology;
        // Whatever still runs in the lab's namespaces belongs to the lab.
        for ns in t.namespaces() {
            if let Ok(out) = Command::new("ip").args(["netns", "pids", &ns]).output() {
                for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                    if let Ok(pid) = pid.parse::<i32>() {
                        // SAFETY: kill has no memory preconditions.
                        unsafe { libc::kill(pid, libc::SIGKILL) };
                    }
                }
            }
        }
        for &pid in self.links.iter().filter(|&&p| p != 0) {
            // SAFETY: as above; the pid is a link process this lab started.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            // Reap it if it is our child; a detached one is reaped by init.
            // SAFETY: waitpid on a pid, with no status pointer.
            unsafe { libc::waitpid(pid as i32, std::ptr::null_mut(), 0) };
        }
        for ns in t.namespaces() {
            if let Err(e) = run("ip", &["netns", "del", &ns]) {
                warn(&format!("{e:#}"));
            }
        }
        let _ = std::fs::remove_file(state_dir().join(format!("{}.json", t.name)));
        for i in 1..=t.sites.len() {
            let file = shape_file(&t.name, i);
            let _ = std::fs::remove_file(link::applied_path(&file));
            let _ = std::fs::remove_file(file);
        }
        self.links.clear();
    }
}

/// Runs `f` with this thread in network namespace `ns`: the sockets it opens are the
/// namespace's (a process it starts runs where `ip netns exec` puts it, or here).
pub fn within<T>(ns: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let mut out = None;
    link::in_namespace(ns, || {
        out = Some(f());
        Ok(())
    })?;
    out.context("the namespace's work did not run")?
}

/// The file site `i`'s link of lab `lab` reads its shape from.
fn shape_file(lab: &str, i: usize) -> PathBuf {
    state_dir().join(format!("{lab}.s{i}.shape"))
}

/// A site's link shape as its topology gives it.
fn site_shape(site: &Site) -> link::Shape {
    link::Shape {
        delay: Duration::from_secs_f64(site.delay_ms.max(0.0) / 1e3),
        rate_bps: site.rate_mbit * 1e6,
        loss: site.loss_percent / 100.0,
        queue: QUEUE,
    }
}

/// Gives site `name` of the running lab `topology` a link of `delay_ms`, `rate_mbit` and
/// `loss_percent` (and says so in `topology`), and waits (up to 5 s) until the link carries
/// frames so: [`Lab::reshape`] for a lab this process owns, `lab shape` for one `lab up` left.
pub fn reshape(
    topology: &mut Topology,
    name: &str,
    delay_ms: f64,
    rate_mbit: f64,
    loss_percent: f64,
) -> Result<()> {
    let i = topology.site_index(name)?;
    let s = &mut topology.sites[i];
    (s.delay_ms, s.rate_mbit, s.loss_percent) = (delay_ms, rate_mbit, loss_percent);
    topology.check()?;
    let site = &topology.sites[i];
    let file = shape_file(&topology.name, i + 1);
    ensure!(
        file.exists(),
        "lab {} is not up here ({} is missing)",
        topology.name,
        file.display()
    );
    let line = site_shape(site).to_line();
    let tmp = file.with_extension("new");
    std::fs::write(&tmp, &line)?;
    std::fs::rename(&tmp, &file)?;
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while std::fs::read_to_string(link::applied_path(&file))
        .ok()
        .as_deref()
        != Some(&line)
    {
        ensure!(
            std::time::Instant::now() < deadline,
            "the link of site {name} did not take its new shape in 5 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// Says on stderr what teardown could not remove.
fn warn(msg: &str) {
    if !msg.contains("No such file") {
        eprintln!("lab: {msg}");
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        if self.owned {
            self.teardown();
        }
    }
}

/// Network namespaces that exist now.
fn list_namespaces() -> Result<Vec<String>> {
    let out = Command::new("ip").args(["netns", "list"]).output()?;
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .collect())
}

/// The gateway's nftables rules for a kind of NAT.
fn nat_rules(nat: Nat) -> String {
    // Linux keeps a socket's source port when it can (endpoint-independent mapping);
    // `fully-random` draws a new one for each new peer (symmetric). Replies pass by connection tracking; an
    // unsolicited packet finds no mapping and stops at the gateway.
    let how = if nat == Nat::Symmetric {
        " fully-random"
    } else {
        ""
    };
    format!(
        "table ip lab {{\n  chain post {{\n    type nat hook postrouting priority srcnat; policy accept;\n    oifname \"wan0\" masquerade{how}\n  }}\n}}\n"
    )
}

/// How long a lab's links buffer frames beyond their rate before they drop.
pub const QUEUE: Duration = Duration::from_millis(100);
