//! Real processes on 127.0.0.1 for the end-to-end tests: `codedmesh seed`, `node`, `status`
//! and `generate`, each killed when its handle drops.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// The `codedmesh` binary built next to this test (or `$CODEDMESH_BIN`).
pub fn bin() -> PathBuf {
    if let Some(p) = std::env::var_os("CODEDMESH_BIN") {
        return PathBuf::from(p);
    }
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target directory");
    let p = dir.join("codedmesh");
    assert!(
        p.exists(),
        "{} is missing: build it first (cargo build --release -p node-native)",
        p.display()
    );
    p
}

/// The small Hugging Face model in testdata.
pub fn tiny_model() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/tiny-llama-hf")
}

/// Fast health timing so dead rows show within seconds.
pub const HEALTH: [&str; 6] = [
    "--heartbeat-ms",
    "200",
    "--suspect-ms",
    "800",
    "--dead-ms",
    "2000",
];

/// A process of the mesh, killed when dropped; its stderr collected in a file.
#[derive(Debug)]
pub struct Proc {
    /// The process.
    pub child: Child,
    /// Its stderr, in a file.
    pub log: PathBuf,
    /// A name for messages.
    pub name: String,
}

impl Proc {
    /// Its process id.
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Sends it a signal (`STOP`, `CONT`, `KILL`…).
    pub fn signal(&self, sig: &str) {
        signal(self.child.id(), sig);
    }

    /// Kills it and waits until it has exited (a zombie until reaped): its sockets are closed
    /// by then, so its peers see it gone. An exit takes a while on a loaded machine (memory is
    /// released before files are closed).
    pub fn kill_until_gone(&self) -> Result<()> {
        self.signal("KILL");
        let stat = format!("/proc/{}/stat", self.child.id());
        let start = Instant::now();
        loop {
            // The state follows the name in parentheses: `pid (name) S …`.
            let state = std::fs::read_to_string(&stat)
                .ok()
                .and_then(|s| s.rsplit_once(')')?.1.trim_start().chars().next());
            if matches!(state, None | Some('Z' | 'X')) {
                return Ok(());
            }
            if start.elapsed() > Duration::from_secs(30) {
                bail!("{} did not exit in 30 s after SIGKILL", self.name);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Its stderr so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until the log contains `needle`.
    pub fn wait_log(&mut self, needle: &str, timeout: Duration) -> Result<String> {
        let start = Instant::now();
        loop {
            let log = self.log();
            if log.contains(needle) {
                return Ok(log);
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                bail!("{} exited ({status}) before {needle:?}:\n{log}", self.name);
            }
            if start.elapsed() > timeout {
                bail!(
                    "{} did not log {needle:?} in {timeout:?}:\n{log}",
                    self.name
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.signal("CONT");
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sends process `pid` a signal (`STOP`, `CONT`, `KILL`…).
pub fn signal(pid: u32, sig: &str) {
    let _ = Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .status();
}

/// Resumes a stopped process (SIGCONT) when dropped, so a `during` that panics leaves no
/// process stopped behind it.
#[derive(Debug)]
pub struct Resume(pub u32);

impl Drop for Resume {
    fn drop(&mut self) {
        signal(self.0, "CONT");
    }
}

/// A temporary directory for one mesh, removed at the end.
#[derive(Debug)]
pub struct Scratch(pub PathBuf);

impl Scratch {
    /// A fresh directory named after `name` and this process. The tests share one process
    /// (one test binary), so each names its own.
    pub fn new(name: &str) -> Self {
        let p = std::env::temp_dir().join(format!("codedmesh-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("scratch dir");
        Self(p)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[derive(Debug)]
pub struct Mesh {
    /// Its scratch directory.
    pub dir: Scratch,
    /// The seed process.
    pub seed: Proc,
    /// The other nodes.
    pub nodes: Vec<Proc>,
    /// The seed's TCP address.
    pub bootstrap: String,
    /// The seed's dashboard URL.
    pub dashboard: String,
}

/// The identity key file (made there if missing) and certificate, admitted by the mesh key in
/// `mesh_key` to write the model and report members, in `dir` as `<name>.key` and
/// `<name>.cert` (`codedmesh admit`).
pub fn admit(mesh_key: &Path, dir: &Path, name: &str) -> Result<(PathBuf, PathBuf)> {
    let (key, cert) = (
        dir.join(format!("{name}.key")),
        dir.join(format!("{name}.cert")),
    );
    let out = Command::new(bin())
        .arg("admit")
        .arg("--mesh-key")
        .arg(mesh_key)
        .arg("--identity")
        .arg(&key)
        .args(["--name", name])
        .arg("--out")
        .arg(&cert)
        .output()?;
    if !out.status.success() {
        bail!("admit: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok((key, cert))
}

/// A `codedmesh node` on TCP only with data dir `dir/<data>`, joining through `bootstrap`.
pub fn spawn_node(dir: &Path, name: &str, data: &str, bootstrap: &str) -> Result<Proc> {
    spawn_node_with(dir, name, data, bootstrap, &["--tcp-only"])
}

/// A `codedmesh node` with these arguments (on every transport unless they say
/// `--tcp-only`).
pub fn spawn_node_with(
    dir: &Path,
    name: &str,
    data: &str,
    bootstrap: &str,
    extra: &[&str],
) -> Result<Proc> {
    let d = dir.join(data);
    let mut a = vec!["node", "--bootstrap", bootstrap, "--data"];
    a.push(d.to_str().context("path")?);
    a.extend(HEALTH);
    a.extend(extra);
    spawn(dir, name, &a)
}

/// A free TCP port on 127.0.0.1 for a mesh's API, below the range dials take their source
/// ports from and apart from the ports `up` gives its nodes, so neither a test's connection
/// nor another test's mesh can take it before it is used.
pub fn free_port() -> Result<u16> {
    // Tests run side by side in one process: none gets a port another was given, even one
    // its mesh does not listen on yet.
    static GIVEN: std::sync::Mutex<Vec<u16>> = std::sync::Mutex::new(Vec::new());
    let mut given = GIVEN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    for _ in 0..100 {
        let port = node_native::up::free_api_port()?;
        if !given.contains(&port) {
            given.push(port);
            return Ok(port);
        }
    }
    anyhow::bail!("no free port that no other test was given")
}

/// Whether this runs under CI (`CI` set and not empty): there a missing tool or device is a
/// failure, never a skip.
pub fn in_ci() -> bool {
    std::env::var_os("CI").is_some_and(|v| !v.is_empty())
}

/// Where a skipped check is recorded for the test command's closing line: the file
/// `scripts/test.sh` names in this variable.
pub const SKIPS_VAR: &str = "CODEDMESH_SKIPS";

/// Skips a check this machine cannot run, saying `why`: a failure under CI (panics, naming
/// what is missing), elsewhere a line on stderr and one in the file [`SKIPS_VAR`] names.
pub fn skip(why: &str) {
    assert!(!in_ci(), "CI cannot skip this: {why}");
    eprintln!("SKIPPED: {why}");
    if let Some(file) = std::env::var_os(SKIPS_VAR) {
        use std::io::Write as _;
        let line = why.replace('\n', " ");
        let _ = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(file)
            .and_then(|mut f| writeln!(f, "{line}"));
    }
}

/// Whether this machine has any wgpu adapter (a GPU, or Mesa's lavapipe as in CI); under
/// `CI` a missing one panics, so a GPU check cannot pass by skipping there.
pub fn have_gpu() -> bool {
    match pollster::block_on(node_core::compute::gpu::Gpu::open(false)) {
        Ok(_) => true,
        Err(e) => {
            skip(&format!(
                "the GPU node: no wgpu adapter (scripts/test.sh installs mesa-vulkan-drivers): {e}"
            ));
            false
        }
    }
}

/// The body of a 200 answer to `GET path` from the HTTP server at `addr` (HTTP/1.1,
/// `Connection: close`: the whole answer is read until the server closes).
pub fn http_get(addr: std::net::SocketAddr, path: &str) -> Result<String> {
    use std::io::Write as _;
    let mut tcp = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    tcp.set_read_timeout(Some(Duration::from_secs(30)))?;
    write!(
        tcp,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut answer = String::new();
    tcp.read_to_string(&mut answer)?;
    let (head, body) = answer
        .split_once("\r\n\r\n")
        .with_context(|| format!("GET {path}: no HTTP answer"))?;
    anyhow::ensure!(head.starts_with("HTTP/1.1 200"), "GET {path}: {head}");
    Ok(body.to_string())
}

/// One metric's value (its full name, e.g. `codedmesh_hop_steps_total`) in a `/metrics` text.
pub fn metric(text: &str, name: &str) -> Result<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .with_context(|| format!("no {name} in /metrics"))
}

/// Starts `codedmesh ARGS`, its stderr in `dir/<name>.log`.
pub fn spawn(dir: &Path, name: &str, args: &[&str]) -> Result<Proc> {
    let mut cmd = Command::new(bin());
    cmd.args(args).env("RUST_LOG", "warn,libp2p_kad=error");
    spawn_command(cmd, dir, name, Stdio::null())
}

/// Starts `cmd` (its arguments and environment set), its stdout to `stdout` and its stderr
/// in `dir/<name>.log`.
pub fn spawn_command(mut cmd: Command, dir: &Path, name: &str, stdout: Stdio) -> Result<Proc> {
    let log = dir.join(format!("{name}.log"));
    let child = cmd
        .stdin(Stdio::null())
        .stdout(stdout)
        .stderr(std::fs::File::create(&log)?)
        .spawn()
        .with_context(|| format!("starting {name}"))?;
    Ok(Proc {
        child,
        log,
        name: name.into(),
    })
}

impl Mesh {
    /// Seed plus n − 1 nodes, every row handed out and seen healthy; `learning` is the
    /// seed's learning flags (`["--no-learning"]` for a frozen model).
    pub fn start(name: &str, model: Option<&Path>, learning: &[&str]) -> Result<Self> {
        Self::start_with(name, model, learning, &["--tcp-only"])
    }

    /// [`Mesh::start`] with more arguments for the seed; the nodes listen on TCP only when the
    /// seed does, else on every transport (browsers dial them over WebSocket).
    pub fn start_with(
        name: &str,
        model: Option<&Path>,
        learning: &[&str],
        seed_args: &[&str],
    ) -> Result<Self> {
        let dir = Scratch::new(name);
        let d0 = dir.0.join("d0");
        let mut args = vec!["seed", "--k", "3", "--n", "5", "--data"];
        args.push(d0.to_str().context("path")?);
        args.extend(seed_args);
        args.extend(learning);
        // A frozen mesh defaults to compact shards; these tests' faults and tolerances are set
        // for f32 unless a test asks for a format (the compact mesh's test does).
        if !seed_args
            .iter()
            .chain(learning)
            .any(|a| *a == "--shard-format")
        {
            args.extend(["--shard-format", "f32"]);
        }
        args.extend(HEALTH);
        let model_s;
        if let Some(m) = model {
            model_s = m.display().to_string();
            args.extend(["--model", &model_s]);
        }
        // The seed's stdout carries its address: read it from a pipe.
        let log = dir.0.join("seed.log");
        let mut child = Command::new(bin())
            .args(&args)
            .env("RUST_LOG", "warn,libp2p_kad=error")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log)?)
            .spawn()?;
        let stdout = child.stdout.take().context("seed stdout")?;
        let mut seed = Proc {
            child,
            log,
            name: "seed".into(),
        };
        let mut lines = BufReader::new(stdout).lines();
        let (mut bootstrap, mut dashboard) = (None, None);
        while bootstrap.is_none() || dashboard.is_none() {
            match lines.next() {
                Some(line) => {
                    let line = line?;
                    // The TCP address: the nodes listen and dial on TCP only.
                    if let Some(a) = line.strip_prefix("listening: ")
                        && bootstrap.is_none()
                        && a.contains("/tcp/")
                        && !a.contains("/ws")
                    {
                        bootstrap = Some(a.to_string());
                    }
                    if let Some(a) = line.strip_prefix("dashboard: ") {
                        dashboard = Some(a.to_string());
                    }
                }
                None => bail!("the seed exited:\n{}", seed.log()),
            }
        }
        let (bootstrap, dashboard) = (
            bootstrap.context("no address")?,
            dashboard.context("no dashboard")?,
        );
        std::thread::spawn(move || for _ in lines {});
        seed.wait_log("serving row 0", Duration::from_secs(120))?;
        let transports: &[&str] = if seed_args.contains(&"--tcp-only") {
            &["--tcp-only"]
        } else {
            &[]
        };
        let mut nodes = Vec::new();
        for i in 1..5 {
            nodes.push(spawn_node_with(
                &dir.0,
                &format!("node{i}"),
                &format!("d{i}"),
                &bootstrap,
                transports,
            )?);
        }
        for n in &mut nodes {
            n.wait_log("serving row", Duration::from_secs(180))?;
        }
        let mesh = Self {
            dir,
            seed,
            nodes,
            bootstrap,
            dashboard,
        };
        mesh.wait_healthy(5)?;
        Ok(mesh)
    }

    /// `codedmesh status --json` through the seed.
    pub fn status(&self) -> Result<serde_json::Value> {
        let out = Command::new(bin())
            .args(["status", "--json", "--bootstrap", &self.bootstrap])
            .output()?;
        if !out.status.success() {
            bail!("status failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(serde_json::from_slice(&out.stdout)?)
    }

    /// Waits until the seed sees `rows` healthy rows.
    pub fn wait_healthy(&self, rows: u64) -> Result<serde_json::Value> {
        let start = Instant::now();
        loop {
            let s = self.status()?;
            if s["healthy_rows"] == rows {
                return Ok(s);
            }
            if start.elapsed() > Duration::from_secs(60) {
                bail!(
                    "never saw {rows} healthy rows: {s}\n{}",
                    self.processes_report()
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// For a failure's message: whether each process still runs, and the end of its log.
    pub fn processes_report(&self) -> String {
        std::iter::once(&self.seed)
            .chain(&self.nodes)
            .map(|p| {
                // The process state letter in /proc (Z: exited, not yet reaped).
                let stat = std::fs::read_to_string(format!("/proc/{}/stat", p.pid()));
                let state = match stat.as_deref().map(|s| s.rsplit(") ").next()) {
                    Ok(Some(rest)) if rest.starts_with('Z') => "exited",
                    Ok(Some(rest)) if rest.starts_with('T') => "stopped",
                    Ok(_) => "running",
                    Err(_) => "gone",
                };
                let log = p.log();
                let lines: Vec<&str> = log.lines().collect();
                let tail = lines[lines.len().saturating_sub(20)..].join("\n");
                format!(
                    "--- {} (pid {}): {state}; the end of its log:\n{tail}",
                    p.name,
                    p.pid()
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Kills (SIGKILL) the node process holding `row` and waits until the mesh no longer counts
    /// the row healthy: its index. (Waiting for one healthy row fewer is not the same: another
    /// row that was down, say a stopped member that just resumed, may be the one still
    /// counted out while the killed holder's last heartbeat is still fresh.)
    pub fn kill_holder(&self, row: u64) -> Result<usize> {
        let i = self.holder(row)?;
        self.nodes[i].signal("KILL");
        let start = Instant::now();
        loop {
            let s = self.status()?;
            let up = s["nodes"].as_array().is_some_and(|nodes| {
                nodes
                    .iter()
                    .any(|n| n["row"] == row && n["health"] == "Healthy")
            });
            if !up {
                return Ok(i);
            }
            if start.elapsed() > Duration::from_secs(60) {
                bail!("row {row} stays healthy after its holder was killed: {s}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The node process holding `row`.
    pub fn holder(&self, row: u64) -> Result<usize> {
        let s = self.status()?;
        let peer = s["nodes"]
            .as_array()
            .context("nodes")?
            .iter()
            .find(|n| n["row"] == row && n["health"] == "Healthy")
            .and_then(|n| n["peer"].as_str())
            .context("no healthy holder")?
            .to_string();
        self.nodes
            .iter()
            .position(|n| n.log().contains(&format!("serving row {row} as {peer}")))
            .with_context(|| format!("no node process logs peer {peer}"))
    }

    /// Waits until all five nodes hold one version of `count` updates.
    pub fn wait_version(&mut self, count: u64) -> Result<()> {
        let start = Instant::now();
        loop {
            let s = self.status()?;
            let nodes = s["nodes"].as_array().context("nodes")?;
            let digests: Vec<&str> = nodes
                .iter()
                .filter_map(|n| n["version_digest"].as_str())
                .collect();
            if nodes.len() == 5
                && s["version_count"] == count
                && digests.iter().all(|d| *d == digests[0])
                && nodes.iter().all(|n| n["lag"] == 0)
            {
                return Ok(());
            }
            if start.elapsed() > Duration::from_secs(30) {
                bail!("versions did not converge: {s}");
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The mesh's key (the seed made it at genesis).
    pub fn mesh_key(&self) -> PathBuf {
        self.dir.0.join("d0").join("mesh.key")
    }

    /// Runs `generate` on the mesh as a leader the mesh admits (`leader.key`, admitted once);
    /// `during` is called once the first text arrives, with the generation stopped (SIGSTOP)
    /// until it returns.
    pub fn generate(
        &self,
        prompt: &str,
        tokens: usize,
        during: impl FnOnce(),
    ) -> Result<(String, String)> {
        self.generate_with(prompt, tokens, &[], during)
    }

    /// [`Self::generate`] with more arguments.
    pub fn generate_with(
        &self,
        prompt: &str,
        tokens: usize,
        extra: &[&str],
        during: impl FnOnce(),
    ) -> Result<(String, String)> {
        let mut admitted = Vec::new();
        if !extra.contains(&"--identity") {
            let (key, cert) = (
                self.dir.0.join("leader.key"),
                self.dir.0.join("leader.cert"),
            );
            if !cert.exists() {
                admit(&self.mesh_key(), &self.dir.0, "leader")?;
            }
            admitted = vec![
                "--identity".into(),
                key.into_os_string(),
                "--cert".into(),
                cert.into_os_string(),
            ];
        }
        let mut child = Command::new(bin())
            .args([
                "generate",
                "--bootstrap",
                &self.bootstrap,
                "--prompt",
                prompt,
            ])
            .args(["--max-tokens", &tokens.to_string()])
            .args(&admitted)
            .args(extra)
            .env("RUST_LOG", "warn,libp2p_kad=error")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        let mut stdout = child.stdout.take().context("stdout")?;
        let mut stderr = child.stderr.take().context("stderr")?;
        let (tx, rx) = mpsc::channel();
        let reader = std::thread::spawn(move || {
            let mut all = Vec::new();
            let mut buf = [0u8; 256];
            while let Ok(n) = stdout.read(&mut buf) {
                if n == 0 {
                    break;
                }
                all.extend_from_slice(&buf[..n]);
                let _ = tx.send(());
            }
            all
        });
        let err_reader = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = stderr.read_to_string(&mut s);
            s
        });
        // Wait for the first token, then disturb while the generation stands still: whatever
        // `during` does has happened before the next token, however long it takes.
        let first = rx.recv_timeout(Duration::from_secs(120)).is_ok();
        let stopped = first.then(|| {
            signal(child.id(), "STOP");
            Resume(child.id())
        });
        during();
        drop(stopped);
        let status = child.wait()?;
        let out = String::from_utf8_lossy(&reader.join().unwrap_or_default()).into_owned();
        let err = err_reader.join().unwrap_or_default();
        if !status.success() {
            bail!("generate failed ({status}):\n{err}");
        }
        Ok((out, err))
    }
}
