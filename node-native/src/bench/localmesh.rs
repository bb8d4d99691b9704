//! A mesh of `codedmesh` processes on this machine (seed + n − 1 nodes on 127.0.0.1), for the
//! benchmark; the processes are stopped when it is dropped.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// Processes of a local mesh.
#[derive(Debug)]
pub struct LocalMesh {
    /// The seed's TCP address (with its peer id).
    pub bootstrap: String,
    children: Vec<Child>,
    /// The seed's API address as its HTTP server prints it.
    api: std::sync::mpsc::Receiver<String>,
    /// That address, once received.
    api_addr: Option<std::net::SocketAddr>,
    /// Where the processes' data dirs and logs are.
    dir: PathBuf,
}

/// Node `i`'s data dir under `dir` (its log is beside it, `node{i}.log`).
fn node_dir(dir: &Path, i: usize) -> PathBuf {
    dir.join(format!("node{i}"))
}

impl LocalMesh {
    /// Starts a seed encoding `model` (k of n) and n − 1 nodes, data dirs under `dir`, whose
    /// APIs check and spare their groups as `group` says; each process holds back what it
    /// sends by `delay` (bench only, [`crate::net::swarm::one_way_delay`]).
    pub fn start(
        model: &Path,
        (k, n): (usize, usize),
        group: &node_core::lead::GroupOptions,
        dir: &Path,
        delay: Duration,
    ) -> Result<Self> {
        let delay_ms = (delay.as_secs_f64() * 1e3).to_string();
        let exe = std::env::current_exe().context("locating this program")?;
        // The environment `up` gives its nodes: a stream through the seed's API keeps k
        // processes busy.
        let threads = crate::up::supervise::mesh_env(k, n);
        // A plain node asks a spare; `up`'s nodes do as its flags say (none by default).
        let serve = crate::up::supervise::group_args(group);
        std::fs::create_dir_all(dir)?;
        let data = |i: usize| node_dir(dir, i);
        let log = |i: usize| -> Result<std::fs::File> {
            Ok(std::fs::File::create(dir.join(format!("node{i}.log")))?)
        };
        let mut seed = Command::new(&exe)
            .args([
                "seed",
                "--tcp-only",
                "--k",
                &k.to_string(),
                "--n",
                &n.to_string(),
            ])
            .arg("--model")
            .arg(model)
            .arg("--data")
            .arg(data(0))
            .args(&serve)
            .env(crate::net::swarm::DELAY_VAR, &delay_ms)
            .envs(threads.clone())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(log(0)?)
            .spawn()
            .context("starting the seed")?;
        let stdout = seed.stdout.take().context("seed stdout")?;
        let (api_tx, api) = std::sync::mpsc::channel();
        let mut mesh = Self {
            bootstrap: String::new(),
            children: vec![seed],
            api,
            api_addr: None,
            dir: dir.to_path_buf(),
        };
        let mut lines = BufReader::new(stdout).lines();
        mesh.bootstrap = loop {
            match lines.next() {
                Some(line) => {
                    if let Some(a) = line?.strip_prefix("listening: ") {
                        break a.to_string();
                    }
                }
                None => bail!("the seed exited; see {}", dir.join("node0.log").display()),
            }
        };
        // The rest of the seed's output, of which the line naming its API.
        std::thread::spawn(move || {
            for line in lines.map_while(std::result::Result::ok) {
                if let Some(url) = line.strip_prefix("api: ") {
                    let _ = api_tx.send(url.to_string());
                }
            }
        });
        for i in 1..n {
            let child = Command::new(&exe)
                .args(["node", "--tcp-only", "--bootstrap", &mesh.bootstrap])
                .arg("--data")
                .arg(data(i))
                .args(&serve)
                .env(crate::net::swarm::DELAY_VAR, &delay_ms)
                .envs(threads.clone())
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log(i)?)
                .spawn()
                .with_context(|| format!("starting node {i}"))?;
            mesh.children.push(child);
        }
        Ok(mesh)
    }

    /// The processes' ids, the seed's first.
    pub fn pids(&self) -> Vec<u32> {
        self.children.iter().map(Child::id).collect()
    }

    /// The address of the seed's OpenAI API (it serves row 0 and leads the requests sent
    /// there, as `up`'s API node does), waiting up to `timeout` for its server to start.
    pub fn api(&mut self, timeout: Duration) -> Result<std::net::SocketAddr> {
        if let Some(addr) = self.api_addr {
            return Ok(addr);
        }
        let url = self
            .api
            .recv_timeout(timeout)
            .context("the seed never printed its API's address")?;
        let addr = url
            .strip_prefix("http://")
            .and_then(|rest| rest.split('/').next())
            .and_then(|host| host.parse().ok())
            .with_context(|| format!("the seed's API is at an address it cannot parse: {url}"))?;
        self.api_addr = Some(addr);
        Ok(addr)
    }

    /// Waits until every node logs that it serves its row.
    pub fn wait_serving(&mut self, dir: &Path, timeout: Duration) -> Result<()> {
        let start = Instant::now();
        let logs: Vec<PathBuf> = (0..self.children.len())
            .map(|i| dir.join(format!("node{i}.log")))
            .collect();
        loop {
            let serving = logs
                .iter()
                .filter(|l| std::fs::read_to_string(l).is_ok_and(|s| s.contains("serving row")))
                .count();
            if serving == logs.len() {
                return Ok(());
            }
            for (i, c) in self.children.iter_mut().enumerate() {
                if let Ok(Some(status)) = c.try_wait() {
                    bail!("node {i} exited ({status}); see {}", logs[i].display());
                }
            }
            if start.elapsed() > timeout {
                bail!(
                    "only {serving} of {} nodes serve after {timeout:?}",
                    logs.len()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for LocalMesh {
    /// Stops the processes and removes their data dirs (a row each), keeping their logs, which
    /// an error may point to.
    fn drop(&mut self) {
        for (i, c) in self.children.iter_mut().enumerate() {
            let _ = c.kill();
            let _ = c.wait();
            let _ = std::fs::remove_dir_all(node_dir(&self.dir, i));
        }
    }
}
