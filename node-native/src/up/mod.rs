//! `codedmesh up`: a whole local mesh from one command. It fetches the model if the cache does
//! not hold it, encodes it into n coded rows (once: the data dir keeps them), starts n node
//! processes on 127.0.0.1 under a supervisor (real libp2p between them), waits until every row
//! is healthy, and prints one ready line with the OpenAI API's and the dashboard's URLs.
//! Ctrl-C stops every node cleanly and keeps the data, so the next `up` starts in seconds.

pub mod supervise;

use std::ffi::OsString;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use node_core::coded::ShardFormat;
use node_core::mesh::{LearningConfig, MeshInfo};
use serde::{Deserialize, Serialize};

use crate::hold::store::DataDir;
use crate::up::supervise::{ChildSpec, log_tail, supervise};

/// What `up` starts.
#[derive(Debug, Clone)]
pub struct UpOptions {
    /// Nodes, one row each (n).
    pub nodes: usize,
    /// Rows needed to compute.
    pub k: usize,
    /// Most rows the mesh may grow to (`None`: the code's own limit).
    pub max_rows: Option<usize>,
    /// The model; `None` is the default model, fetched once.
    pub model: Option<PathBuf>,
    /// Where the mesh's data lives; `None` picks a folder per model and code.
    pub data: Option<PathBuf>,
    /// Port of the API and the dashboard.
    pub port: u16,
    /// Address the API and the dashboard listen on.
    pub api_listen: IpAddr,
    /// Bearer key the API asks for.
    pub api_key: Option<String>,
    /// A file of API keys every node's API takes.
    pub api_keys: Option<PathBuf>,
    /// The mesh does not learn from requests.
    pub no_learning: bool,
    /// How a new mesh learns (`enabled` follows `no_learning`).
    pub learning: LearningConfig,
    /// How shards are stored.
    pub format: ShardFormat,
    /// The user chose k, n or the format: a mesh already in the data dir must have them (else
    /// it is used with its own).
    pub shape_chosen: bool,
    /// Where the API node writes every coded step (`--trace-steps`).
    pub trace_steps: Option<PathBuf>,
    /// The dashboard's built files.
    pub web_dir: Option<PathBuf>,
    /// Do not build the dashboard when it is missing.
    pub no_build_web: bool,
    /// Extra arguments for every node (`--max-batch`, `--queue`, `--device` …).
    pub node_args: Vec<OsString>,
}

/// The k and n of a local mesh on a machine with `cores` cores, where the user gave none: 3 of
/// 5, or 2 of 4 below three cores.
///
/// One stream asks k nodes at once. With fewer cores than that, two of their products run one
/// after the other and the stream slows by a third (docs/perf-history.md, "A mesh the size of the
/// machine"). Without `nodes`, n is 5, or fewer where the compact (integer) code has fewer
/// rows for k: 4 for k = 2.
pub fn default_shape(cores: usize, k: Option<usize>, nodes: Option<usize>) -> (usize, usize) {
    let k = k.unwrap_or(if cores < 3 { 2 } else { 3 });
    let nodes = nodes.unwrap_or_else(|| {
        let rows = node_core::code::Generator::integer_capacity(k);
        if (k..5).contains(&rows) { rows } else { 5 }
    });
    (k, nodes)
}

/// What a data dir holds about the mesh `up` made there.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct MeshFile {
    model: String,
    k: usize,
    n: usize,
    /// How the shards are stored (f32 for mesh files written before compact shards).
    #[serde(default)]
    format: ShardFormat,
    /// Each node's libp2p TCP port, kept so a restarted node is found where it was.
    ports: Vec<u16>,
    /// The layout of the shard sets in the blobs ([`node_core::holder::SHARD_LAYOUT`]; 0 for
    /// mesh files written before it was recorded).
    #[serde(default)]
    layout: u32,
}

const MESH_FILE: &str = "mesh.json";

impl MeshFile {
    /// Writes it to `data`'s mesh file.
    fn save(&self, data: &Path) -> Result<()> {
        let file = data.join(MESH_FILE);
        std::fs::write(&file, serde_json::to_vec_pretty(self)?)
            .with_context(|| format!("writing {}", file.display()))
    }
}

/// The default data dir for a model and code: `$CODEDMESH_DATA`, else the user's data dir.
fn default_data(model: &Path, k: usize, n: usize, format: ShardFormat) -> Result<PathBuf> {
    let base = match std::env::var_os("CODEDMESH_DATA") {
        Some(d) => PathBuf::from(d),
        None => dirs::data_local_dir()
            .context("no data directory on this system; pass --data DIR")?
            .join("codedmesh"),
    };
    let stem = model
        .file_stem()
        .map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned());
    let suffix = match format {
        ShardFormat::F32 => "",
        ShardFormat::F16 => "-f16",
        ShardFormat::Q8 => "-q8",
        ShardFormat::Q4 => "-q4",
    };
    Ok(base.join("up").join(format!("{stem}-k{k}-n{n}{suffix}")))
}

/// Lowest port `up` gives its nodes.
const FIRST_NODE_PORT: u16 = 10_000;

/// `n` TCP ports on 127.0.0.1 free now, for the nodes to listen on (and keep across restarts).
/// They are picked below the range the system hands out to outgoing connections and to `:0`
/// listeners: a port from that range, free when checked, can be taken by any process's dial
/// before the node listens on it, and then the node fails to start for as long as that
/// connection lives (a CI run lost a node so, with other meshes dialing beside it). Nodes'
/// ports come from the lower half of what lies below that range, [`free_api_port`]'s from
/// the upper, so that an API port picked for a mesh about to start is never a node's.
pub fn free_ports(n: usize) -> Result<Vec<u16>> {
    let (low, _) = below_ephemeral();
    free_ports_in(n, low)
}

/// A TCP port on 127.0.0.1 free now, for an API to listen on: never one [`free_ports`] gives.
pub fn free_api_port() -> Result<u16> {
    let (_, high) = below_ephemeral();
    free_ports_in(1, high)?.pop().context("no free port")
}

/// The two halves of the ports from [`FIRST_NODE_PORT`] to the outgoing range; empty where
/// that range starts lower.
fn below_ephemeral() -> (std::ops::Range<u16>, std::ops::Range<u16>) {
    let end = ephemeral_start().max(FIRST_NODE_PORT);
    let mid = FIRST_NODE_PORT + (end - FIRST_NODE_PORT) / 2;
    (FIRST_NODE_PORT..mid, mid..end)
}

/// `n` ports of `range` free now, from a point that differs each time (so that meshes started
/// together rarely try the same); ports the system picks where `range` has too few.
fn free_ports_in(n: usize, range: std::ops::Range<u16>) -> Result<Vec<u16>> {
    let span = u32::from(range.end - range.start);
    if (span as usize) < n {
        return free_ephemeral_ports(n);
    }
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos())
        ^ std::process::id().wrapping_mul(2_654_435_761);
    // Each port is held until all are picked, so none is picked twice.
    let mut held = Vec::with_capacity(n);
    let mut ports = Vec::with_capacity(n);
    for i in 0..span {
        if ports.len() == n {
            break;
        }
        let port = range.start + (seed.wrapping_add(i) % span) as u16;
        if let Ok(l) = std::net::TcpListener::bind(("127.0.0.1", port)) {
            held.push(l);
            ports.push(port);
        }
    }
    if ports.len() < n {
        return free_ephemeral_ports(n);
    }
    Ok(ports)
}

/// The nodes' ports, held by `up` while it runs so that no other process on this machine
/// takes one between the nodes' restarts (or before a node first listens): each is bound,
/// never listened on, with `SO_REUSEPORT` alone, which lets only a socket that also asks for it
/// (the node's libp2p listener, same user) bind the port beside it, and every plain bind (a
/// test's or another mesh's pick) fail. A CI run lost a node of sixteen so: another mesh took
/// its port between `up` picking it and the node listening. Elsewhere than unix nothing is held.
#[derive(Debug, Default)]
pub struct HeldPorts {
    #[cfg(unix)]
    held: Vec<std::os::fd::OwnedFd>,
}

impl HeldPorts {
    /// Holds `port` when no socket has it now; false when one does.
    fn hold(&mut self, port: u16) -> bool {
        // A plain bind fails while any socket has the port, one that holds it included.
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_err() {
            return false;
        }
        #[cfg(unix)]
        match reuse_port_socket(port, false) {
            Ok(fd) => self.held.push(fd),
            Err(_) => return false,
        }
        true
    }

    /// Holds each of `ports` that is free, and in place of each that another process took
    /// meanwhile a free one below the range outgoing connections use; the ports held.
    pub fn take(ports: &[u16]) -> Result<(Self, Vec<u16>)> {
        let mut me = Self::default();
        let mut taken = Vec::with_capacity(ports.len());
        for &port in ports {
            if me.hold(port) {
                taken.push(port);
                continue;
            }
            // A port this holds already is not free: the pick passes over it.
            let other = free_ports(1)?
                .into_iter()
                .find(|&p| me.hold(p))
                .with_context(|| format!("port {port} is taken and no other is free"))?;
            taken.push(other);
        }
        Ok((me, taken))
    }
}

/// A TCP socket bound to 127.0.0.1:`port` with `SO_REUSEPORT` (and `SO_REUSEADDR` when
/// `reuse_addr`, as libp2p's listeners are), not listening.
#[cfg(unix)]
fn reuse_port_socket(port: u16, reuse_addr: bool) -> nix::Result<std::os::fd::OwnedFd> {
    use nix::sys::socket::{
        AddressFamily, SockFlag, SockType, SockaddrIn, bind, setsockopt, socket, sockopt,
    };
    use std::os::fd::AsRawFd;
    let fd = socket(
        AddressFamily::Inet,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    if reuse_addr {
        setsockopt(&fd, sockopt::ReuseAddr, &true)?;
    }
    setsockopt(&fd, sockopt::ReusePort, &true)?;
    bind(fd.as_raw_fd(), &SockaddrIn::new(127, 0, 0, 1, port))?;
    Ok(fd)
}

/// The first port of the system's range for outgoing connections (Linux's default where it
/// cannot be read; other systems' ranges start higher).
fn ephemeral_start() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768)
}

/// `n` ports the system picks (the fallback when no port below its range is free).
fn free_ephemeral_ports(n: usize) -> Result<Vec<u16>> {
    let listeners = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0"))
        .collect::<std::io::Result<Vec<_>>>()
        .context("finding free ports")?;
    listeners
        .iter()
        .map(|l| Ok(l.local_addr()?.port()))
        .collect()
}

/// The mesh of `data`: read when `up` made it before, else encoded now.
fn prepare(opts: &UpOptions, model: &Path, data: &Path) -> Result<MeshFile> {
    let file = data.join(MESH_FILE);
    let name = model.file_name().map_or_else(
        || model.display().to_string(),
        |f| f.to_string_lossy().into_owned(),
    );
    if file.exists() {
        let mesh: MeshFile = serde_json::from_slice(&std::fs::read(&file)?)
            .with_context(|| format!("reading {}", file.display()))?;
        let same_shape = mesh.k == opts.k && mesh.n == opts.nodes && mesh.format == opts.format;
        ensure!(
            mesh.model == name && (same_shape || !opts.shape_chosen),
            "{} holds a mesh of {} with k = {}, n = {} ({:?} shards), not {name} with k = {}, n = {} ({:?}): pass --data DIR for another",
            data.display(),
            mesh.model,
            mesh.k,
            mesh.n,
            mesh.format,
            opts.k,
            opts.nodes,
            opts.format
        );
        ensure!(
            mesh.layout == node_core::holder::SHARD_LAYOUT,
            "{} holds shards written by an older release (layout {}, this release reads {}): delete it to encode the mesh again, or pass --data DIR for another",
            data.display(),
            mesh.layout,
            node_core::holder::SHARD_LAYOUT
        );
        eprintln!(
            "using the mesh in {} ({} nodes, k = {})",
            data.display(),
            mesh.n,
            mesh.k
        );
        return Ok(mesh);
    }
    ensure!(
        opts.k >= 1 && opts.nodes >= opts.k,
        "need 1 ≤ k ≤ nodes, got k = {}, nodes = {}",
        opts.k,
        opts.nodes
    );
    if let (Some(size), Some(available)) = (
        crate::node::fit::ModelSize::of(model)?,
        crate::node::fit::available(),
    ) {
        crate::node::fit::check(size, opts.k, opts.nodes, opts.format, true, available)?;
    }
    let learning = LearningConfig {
        enabled: !opts.no_learning,
        ..opts.learning
    };
    learning.validate()?;
    let started = Instant::now();
    eprintln!(
        "encoding {} into {} coded rows (k = {}), once: the data dir keeps them",
        model.display(),
        opts.nodes,
        opts.k
    );
    let rows_dir = data.join("encoding");
    let mesh_key = crate::hold::trust::key_file(&data.join(crate::hold::trust::MESH_KEY_FILE))?;
    let trust = crate::node::Trust {
        mesh: node_core::learn::MeshKey::of(&mesh_key),
        gate: true,
    };
    let shape = crate::node::Shape {
        k: opts.k,
        n: opts.nodes,
        max_rows: opts.max_rows,
        format: opts.format,
    };
    let (manifest, blobs) = crate::node::encode_genesis(model, shape, learning, &trust, &rows_dir)?;
    let manifest_bytes = manifest.to_bytes()?;
    for (row, blob) in &blobs {
        let dir = DataDir::open(&node_dir(data, *row as usize))?;
        dir.save_manifest(&manifest_bytes)?;
        dir.adopt_shard_file(blob)?;
    }
    std::fs::remove_dir_all(&rows_dir)
        .with_context(|| format!("removing {}", rows_dir.display()))?;
    let mesh = MeshFile {
        model: name,
        k: opts.k,
        n: opts.nodes,
        format: opts.format,
        ports: free_ports(opts.nodes)?,
        layout: node_core::holder::SHARD_LAYOUT,
    };
    // Written last: a mesh file means every row is in place.
    mesh.save(data)?;
    eprintln!(
        "encoded and saved {} rows in {:.1} s",
        blobs.len(),
        started.elapsed().as_secs_f64()
    );
    Ok(mesh)
}

/// Admits every node of the mesh in `data` to write the model and report members: a
/// certificate from the mesh's key (`mesh.key`, made at genesis) in each node's data dir,
/// made anew at each start so that it never expires under a running mesh.
fn admit_nodes(data: &Path, n: usize) -> Result<()> {
    use node_core::learn::Power;
    let key_path = data.join(crate::hold::trust::MESH_KEY_FILE);
    let mesh = crate::hold::trust::read_key(&key_path)
        .with_context(|| format!("the mesh's key ({}) admits its nodes", key_path.display()))?;
    for i in 0..n {
        let dir = DataDir::open(&node_dir(data, i))?;
        let peer = dir.identity()?.public().to_peer_id();
        let cert = crate::hold::trust::admit(
            &mesh,
            peer,
            &format!("up node {i}"),
            crate::hold::trust::DEFAULT_VALIDITY,
            &[Power::Write, Power::Report],
        )?;
        dir.save_cert(&cert)?;
    }
    Ok(())
}

fn node_dir(data: &Path, i: usize) -> PathBuf {
    data.join(format!("node{i}"))
}

/// The checkout this program was built in (the folder holding `scripts/build-web.sh`).
fn checkout() -> Option<PathBuf> {
    let starts = [std::env::current_exe().ok(), std::env::current_dir().ok()];
    starts.into_iter().flatten().find_map(|s| {
        s.ancestors()
            .find(|a| a.join("scripts").join("build-web.sh").is_file())
            .map(Path::to_path_buf)
    })
}

/// Where the dashboard is (or will be), and a build of it started in the background when it
/// is missing and this is a checkout.
fn dashboard(opts: &UpOptions, data: &Path) -> (Option<PathBuf>, Option<tokio::process::Child>) {
    if let Some(dir) = crate::serve::http::find_web_dir(opts.web_dir.as_deref()) {
        return (Some(dir), None);
    }
    let Some(root) = checkout() else {
        eprintln!(
            "the dashboard is not built and no checkout was found: the API works, `/` says how to build it"
        );
        return (None, None);
    };
    let dist = root.join("web-ui").join("dist");
    if opts.no_build_web {
        return (Some(dist), None);
    }
    let log = data.join("build-web.log");
    // At the lowest CPU priority: the API serves meanwhile and must not slow down for it.
    let spec = ChildSpec {
        name: "the dashboard's build".into(),
        program: "nice".into(),
        args: vec![
            "-n".into(),
            "19".into(),
            "bash".into(),
            root.join("scripts").join("build-web.sh").into_os_string(),
        ],
        log: Some(log.clone()),
        env: Vec::new(),
    };
    match spec.spawn() {
        Ok(child) => {
            eprintln!(
                "the dashboard is not built yet: building it in the background (scripts/build-web.sh; the first time it installs wasm-bindgen-cli, a few minutes). The API works meanwhile; log: {}",
                log.display()
            );
            (Some(dist), Some(child))
        }
        Err(e) => {
            eprintln!("could not build the dashboard: {e:#}");
            (Some(dist), None)
        }
    }
}

/// `codedmesh up`.
pub async fn up(opts: UpOptions) -> Result<()> {
    let model = match &opts.model {
        Some(p) => p.clone(),
        None => tokio::task::spawn_blocking(crate::fetch::default_model).await??,
    };
    let model = model.canonicalize().unwrap_or(model);
    let data = match &opts.data {
        Some(d) => d.clone(),
        None => default_data(&model, opts.k, opts.nodes, opts.format)?,
    };
    std::fs::create_dir_all(&data).with_context(|| format!("creating {}", data.display()))?;
    let http = SocketAddr::new(opts.api_listen, opts.port);
    // A taken port fails here, with a clear message, rather than in a child's log.
    drop(
        std::net::TcpListener::bind(http)
            .with_context(|| format!("the API's address {http} is taken: pass --port PORT"))?,
    );
    let mesh = {
        let (o, m, d) = (opts.clone(), model.clone(), data.clone());
        tokio::task::spawn_blocking(move || prepare(&o, &m, &d)).await??
    };
    // Held until `up` ends, through every restart of a node.
    let (_held, ports) = HeldPorts::take(&mesh.ports)?;
    let mesh = if ports == mesh.ports {
        mesh
    } else {
        eprintln!(
            "another process took some of the nodes' ports {:?}: they listen on {ports:?} now",
            mesh.ports
        );
        let mesh = MeshFile { ports, ..mesh };
        mesh.save(&data)?;
        mesh
    };
    admit_nodes(&data, mesh.n)?;
    let (web, mut build) = dashboard(&opts, &data);
    let program = crate::up::supervise::this_program()?;
    let tcp = |i: usize| format!("/ip4/127.0.0.1/tcp/{}", mesh.ports[i]);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let mut tasks = Vec::new();
    for i in 0..mesh.n {
        let bootstrap = if i == 0 { tcp(1 % mesh.n) } else { tcp(0) };
        let mut args: Vec<OsString> = vec!["node".into(), "--data".into()];
        args.push(node_dir(&data, i).into_os_string());
        for a in ["--listen".to_string(), tcp(i)] {
            args.push(a.into());
        }
        if mesh.n > 1 {
            args.push("--bootstrap".into());
            args.push(bootstrap.into());
        }
        args.push("--http".into());
        let addr = if i == 0 {
            http
        } else {
            SocketAddr::from(([127, 0, 0, 1], 0))
        };
        args.push(addr.to_string().into());
        if let Some(w) = &web {
            args.push("--web-dir".into());
            args.push(w.clone().into_os_string());
        }
        if let Some(f) = &opts.api_keys {
            args.push("--api-keys".into());
            args.push(f.clone().into_os_string());
        }
        if let Some(k) = &opts.api_key {
            args.push("--api-key".into());
            args.push(k.into());
        }
        // A frozen mesh's nodes lead no learning request (unless the node arguments say so).
        if opts.no_learning && !opts.node_args.iter().any(|a| a == "--no-learn") {
            args.push("--no-learn".into());
        }
        if i == 0
            && let Some(t) = &opts.trace_steps
        {
            args.push("--trace-steps".into());
            args.push(t.clone().into_os_string());
        }
        args.extend(opts.node_args.iter().cloned());
        let spec = ChildSpec {
            name: format!("node {i}"),
            program: program.clone(),
            args,
            log: Some(data.join(format!("node{i}.log"))),
            env: crate::up::supervise::mesh_env(mesh.k, mesh.n),
        };
        let stop = stop_rx.clone();
        tasks.push(tokio::spawn(async move {
            if let Err(e) = supervise(spec, stop).await {
                eprintln!("{e:#}");
            }
        }));
        // The first node listens before the others dial it (they retry, but need not).
        if i == 0 {
            let addr = SocketAddr::from(([127, 0, 0, 1], mesh.ports[0]));
            let started = Instant::now();
            while tokio::net::TcpStream::connect(addr).await.is_err()
                && started.elapsed() < Duration::from_secs(60)
            {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    let stop_signal = crate::node::stop_signal();
    tokio::pin!(stop_signal);
    let first = tcp(0);
    let ready = tokio::select! {
        r = wait_ready(&first, &mesh, &data) => r,
        _ = &mut stop_signal => Err(anyhow::anyhow!("stopped before the mesh was ready")),
    };
    let result = match ready {
        Ok(info) => {
            let host = if opts.api_listen.is_unspecified() {
                "127.0.0.1".to_string()
            } else {
                http.ip().to_string()
            };
            let base = format!("http://{host}:{}", http.port());
            let model_id = model
                .file_stem()
                .map_or_else(String::new, |s| s.to_string_lossy().into_owned());
            let dashboard = if build.is_some() {
                format!(
                    "dashboard {base}/ (building at low priority: the first build installs its tools, 15–30 minutes on 2 cores; a line says when it is there)"
                )
            } else {
                format!("dashboard {base}/")
            };
            println!(
                "ready: OpenAI API {base}/v1 · {dashboard} · model {model_id} · {} nodes, k = {}, {} of {} rows healthy · bootstrap {first} · data {} · Ctrl-C stops",
                mesh.n,
                mesh.k,
                info.healthy_rows,
                info.n,
                data.display()
            );
            eprintln!(
                "try: curl -s {base}/v1/chat/completions -H 'Content-Type: application/json' -d '{{\"model\": \"{model_id}\", \"messages\": [{{\"role\": \"user\", \"content\": \"What is the capital of France?\"}}]}}'"
            );
            loop {
                tokio::select! {
                    _ = &mut stop_signal => break Ok(()),
                    status = async { match build.as_mut() { Some(b) => b.wait().await, None => std::future::pending().await } } => {
                        build = None;
                        match status {
                            Ok(s) if s.success() => eprintln!("the dashboard is built: {base}/"),
                            other => eprintln!("building the dashboard failed ({other:?}); see {}", data.join("build-web.log").display()),
                        }
                    }
                }
            }
        }
        Err(e) => Err(e),
    };
    eprintln!("stopping {} nodes", mesh.n);
    let _ = stop_tx.send(true);
    for t in tasks {
        let _ = t.await;
    }
    if let Some(mut b) = build {
        crate::up::supervise::stop_child(&mut b, Duration::from_secs(2)).await;
    }
    eprintln!("stopped; the data is kept in {}", data.display());
    result
}

/// Waits until every row is healthy (or, after a minute, at least k), showing progress.
async fn wait_ready(first: &str, mesh: &MeshFile, data: &Path) -> Result<MeshInfo> {
    let pb = crate::progress::bar(mesh.n as u64, "rows healthy");
    let started = Instant::now();
    let addr: libp2p::Multiaddr = first.parse()?;
    let mut session = None;
    let mut last_error = String::new();
    loop {
        if session.is_none() {
            match crate::lead::remote::Session::connect(addr.clone()).await {
                Ok(s) => session = Some(s),
                Err(e) => last_error = format!("{e:#}"),
            }
        }
        if let Some(s) = &session {
            match s.info().await {
                Ok(info) => {
                    pb.set_position(u64::from(info.healthy_rows));
                    let all = info.healthy_rows as usize >= mesh.n;
                    let enough = info.available && started.elapsed() > Duration::from_secs(60);
                    if all || enough {
                        pb.finish_and_clear();
                        return Ok(info);
                    }
                    last_error = info.summary();
                }
                Err(e) => {
                    last_error = format!("{e:#}");
                    session = None;
                }
            }
        }
        if started.elapsed() > Duration::from_secs(180) {
            pb.finish_and_clear();
            bail!(
                "the mesh did not come up in 3 minutes ({last_error}); the first node's log ends:\n{}",
                log_tail(&data.join("node0.log"), 20)
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_ports_are_distinct_free_below_dials_range_and_apart_from_api_ports() {
        let ports = free_ports(5).unwrap();
        let mut distinct = ports.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct.len(), 5, "{ports:?}");
        let (nodes, apis) = below_ephemeral();
        let api = free_api_port().unwrap();
        assert!(apis.contains(&api), "{api} is outside {apis:?}");
        for &p in &ports {
            assert!(nodes.contains(&p), "{p} is outside {nodes:?}");
            std::net::TcpListener::bind(("127.0.0.1", p)).expect("free to listen on");
        }
        // A dial's source port comes from the ephemeral range, never from these.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let dial = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        assert!(dial.local_addr().unwrap().port() >= ephemeral_start());
    }

    #[test]
    fn a_held_port_is_refused_to_a_plain_bind_but_its_node_listens_and_is_reached_on_it() {
        let free = free_ports(2).unwrap();
        let (held, ports) = HeldPorts::take(&free).unwrap();
        assert_eq!(ports, free, "free ports are held as they are");
        #[cfg(unix)]
        {
            use std::io::{Read, Write};
            let addr = SocketAddr::from(([127, 0, 0, 1], ports[0]));
            // Another process's pick (a plain bind) cannot take it ...
            assert!(std::net::TcpListener::bind(addr).is_err());
            // ... nor can another `up` hold it again: it picks another.
            let (_again, other) = HeldPorts::take(&ports[..1]).unwrap();
            assert_ne!(other, ports[..1]);
            // The node's listener (libp2p's: SO_REUSEADDR and SO_REUSEPORT) binds it, and a
            // dial reaches the node, not the held socket.
            let node = libp2p_like_listener(addr);
            let mut dial = std::net::TcpStream::connect(addr).unwrap();
            let (mut accepted, _) = node.accept().unwrap();
            dial.write_all(b"hi").unwrap();
            let mut got = [0; 2];
            accepted.read_exact(&mut got).unwrap();
            assert_eq!(&got, b"hi");
            // A node that restarts binds it again.
            drop((node, accepted, dial));
            drop(libp2p_like_listener(addr));
        }
        drop(held);
        for p in ports {
            std::net::TcpListener::bind(("127.0.0.1", p)).expect("free once up ends");
        }
    }

    /// A listener made as libp2p-tcp makes one.
    #[cfg(unix)]
    fn libp2p_like_listener(addr: SocketAddr) -> std::net::TcpListener {
        use nix::sys::socket::{Backlog, listen};
        let fd = reuse_port_socket(addr.port(), true).unwrap();
        listen(&fd, Backlog::new(16).unwrap()).unwrap();
        std::net::TcpListener::from(fd)
    }

    #[test]
    fn a_local_mesh_asks_no_more_members_at_once_than_there_are_cores() {
        assert_eq!(default_shape(16, None, None), (3, 5));
        assert_eq!(default_shape(3, None, None), (3, 5));
        // Two cores: k = 2, on the 4 rows the compact code has for it.
        assert_eq!(default_shape(2, None, None), (2, 4));
        assert_eq!(default_shape(1, None, None), (2, 4));
        ShardFormat::Q8
            .code(4, 2)
            .expect("compact shards for k = 2 of 4");
        // What the user gives stands; n follows k where only k is given.
        assert_eq!(default_shape(2, Some(3), None), (3, 5));
        assert_eq!(default_shape(16, Some(2), None), (2, 4));
        assert_eq!(default_shape(16, None, Some(7)), (3, 7));
        assert_eq!(default_shape(2, Some(3), Some(4)), (3, 4));
    }
}
