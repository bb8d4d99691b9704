//! A node of the mesh: genesis (`seed`), joining and restarting (`node`), and serving peers.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail, ensure};
use libp2p::{Multiaddr, PeerId};
use node_core::code::Generator;
use node_core::coded::{InProcess, Member, ShardFormat, ShardSet};
use node_core::compute::gpu::{DeviceChoice, Gpu};
use node_core::mesh::{
    BrowserBootstrap, HealthConfig, Heartbeat, LearningConfig, MAX_CHUNK_BYTES, MeshEvent,
    MeshInfo, MeshRequest, MeshResponse, MeshView, ModelManifest, ShardVersion, Usage,
};
use node_core::model::LeaderWeights;
use node_core::protocol;
use std::time::Instant;

use crate::http::InfoRequest;
use crate::learning::{Rules, ShardState, UpdateStore};
use crate::link::{NativeLink, pick_addr};
use crate::store::{DataDir, shard_from_blob, shard_to_blob};
use crate::swarm::{self, Client, Inbound, NetConfig, with_peer};
use crate::{load, progress};
use node_core::holder::Link as _;
use node_core::holder::{self, Download, Joined, chunk_of, describe, update_chunk_request};

/// How a node connects.
#[derive(Debug, Clone)]
pub struct NodeOptions {
    /// Its data directory.
    pub data: PathBuf,
    /// A peer to join through.
    pub bootstrap: Option<Multiaddr>,
    /// Addresses to listen on.
    pub listen: Vec<Multiaddr>,
    /// Also listen on QUIC, WebSocket and WebRTC-direct next to each TCP address.
    pub all_transports: bool,
    /// Discover peers with mDNS.
    pub mdns: bool,
    /// Heartbeat and health timing.
    pub health: HealthConfig,
    /// A fault to inject (tests and demonstrations of verification).
    pub fault: Option<InjectedFault>,
    /// Where the shard products run.
    pub device: DeviceChoice,
    /// Where to serve HTTP (the dashboard and the status JSON); `None` serves none.
    pub http: Option<std::net::SocketAddr>,
    /// The dashboard's built files; `None` looks for them (see [`crate::http::find_web_dir`]).
    pub web_dir: Option<PathBuf>,
    /// How the requests this node leads (its OpenAI API) are served.
    pub serve: crate::engine::EngineConfig,
    /// The bearer key its API asks for, if any.
    pub api_key: Option<String>,
}

/// A fault a node injects into its own answers or shard, on purpose.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum InjectedFault {
    /// Answers with random values.
    Garbage,
    /// Its shard is scaled by 1 + 1e-3.
    Scale,
    /// Its shard misses the first learning update it receives (which it records as applied).
    Stale,
    /// It records every update as applied and applies none: it claims versions it does not hold.
    LieVersion,
    /// It claims the next row (`(own + 1) mod n`) and answers with its own row's results.
    WrongRow,
}

/// Listen addresses: each TCP one, plus QUIC, WebSocket and WebRTC-direct on the same host.
fn expand_listen(listen: &[Multiaddr], all: bool) -> Vec<Multiaddr> {
    use libp2p::multiaddr::Protocol;
    let mut out = listen.to_vec();
    if !all {
        return out;
    }
    for addr in listen {
        let Some(host) = addr.iter().next() else {
            continue;
        };
        if !matches!(host, Protocol::Ip4(_) | Protocol::Ip6(_))
            || !addr.iter().any(|p| matches!(p, Protocol::Tcp(_)))
        {
            continue;
        }
        let base = Multiaddr::empty().with(host);
        out.push(base.clone().with(Protocol::Udp(0)).with(Protocol::QuicV1));
        out.push(
            base.clone()
                .with(Protocol::Tcp(0))
                .with(Protocol::Ws("/".into())),
        );
        out.push(base.with(Protocol::Udp(0)).with(Protocol::WebRTCDirect));
    }
    out
}

/// A started network: the client, what peers send, and the node's full addresses.
struct Net {
    client: Client,
    inbound: tokio::sync::mpsc::Receiver<Inbound>,
    addrs: Vec<String>,
}

/// What a node serves: the manifest, its shard, and genesis rows still to hand out.
struct Holding {
    manifest: ModelManifest,
    manifest_bytes: Vec<u8>,
    shard: ShardSet,
    genesis: BTreeMap<u32, Arc<Vec<u8>>>,
}

/// Starts the swarm for a node with a data dir; prints its full addresses.
async fn start_network(opts: &NodeOptions, data: &DataDir) -> Result<Net> {
    let listen = expand_listen(&opts.listen, opts.all_transports);
    let webrtc = listen
        .iter()
        .any(|a| {
            a.iter()
                .any(|p| matches!(p, libp2p::multiaddr::Protocol::WebRTCDirect))
        })
        .then(|| data.webrtc_certificate())
        .transpose()?;
    let swarm = swarm::build(NetConfig {
        key: data.identity()?,
        webrtc,
        listen: listen.clone(),
        mdns: opts.mdns,
    })
    .await?;
    let (client, inbound) = swarm::spawn(swarm);
    // Wait until every listener has its real address (ports, certhash).
    let mut addrs = Vec::new();
    for _ in 0..100 {
        addrs = client.listen_addrs().await?;
        if addrs.len() >= listen.len() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let full: Vec<String> = addrs
        .iter()
        .map(|a| with_peer(a, client.peer_id()).to_string())
        .collect();
    for a in &full {
        println!("listening: {a}");
    }
    Ok(Net {
        client,
        inbound,
        addrs: full,
    })
}

/// `codedmesh seed`: encodes a model into n rows, keeps row 0 and hands the others out.
pub async fn seed(
    opts: NodeOptions,
    model: PathBuf,
    k: usize,
    n: usize,
    max_rows: Option<usize>,
    format: ShardFormat,
    learning: LearningConfig,
) -> Result<()> {
    learning.validate()?;
    let data = DataDir::open(&opts.data)?;
    if data.shard()?.is_some() {
        eprintln!(
            "{} already holds a shard: restarting it as a node",
            data.path().display()
        );
        return node(opts).await;
    }
    let gpu = open_device(opts.device).await?;
    ensure!(k >= 1 && n >= k, "need 1 ≤ k ≤ n, got k = {k}, n = {n}");
    let started = std::time::Instant::now();
    let (manifest, blobs) = tokio::task::spawn_blocking(move || {
        encode_genesis(&model, k, n, max_rows, format, learning)
    })
    .await
    .map_err(|e| anyhow!("encoding task: {e}"))??;
    let manifest_bytes = manifest.to_bytes()?;
    data.save_manifest(&manifest_bytes)?;
    let mut blobs = blobs;
    let own = blobs
        .remove(&0)
        .ok_or_else(|| anyhow!("row 0 was not encoded"))?;
    data.save_shard_blob(&own)?;
    eprintln!(
        "genesis: {} encoded into n = {n} rows (k = {k}) in {:.1} s; this node keeps row 0, {} rows to hand out; the mesh may grow to {} rows, then adds replicas",
        manifest.name,
        started.elapsed().as_secs_f64(),
        blobs.len(),
        manifest.generator.n()
    );
    let shard = shard_from_blob(&own)?;
    let genesis = blobs.into_iter().map(|(r, b)| (r, Arc::new(b))).collect();
    let holding = Holding {
        manifest,
        manifest_bytes,
        shard,
        genesis,
    };
    serve(opts, data, holding, gpu).await
}

/// Loads a model and encodes every row's shard blob (with the verification threshold measured
/// on them).
pub(crate) fn encode_genesis(
    model: &std::path::Path,
    k: usize,
    n: usize,
    max_rows: Option<usize>,
    format: ShardFormat,
    learning: LearningConfig,
) -> Result<(ModelManifest, BTreeMap<u32, Vec<u8>>)> {
    let loaded = load::load_model(model)?;
    let generator = Generator::growing(n, k, max_rows)?;
    let mut manifest = ModelManifest {
        name: model.file_name().map_or_else(
            || model.display().to_string(),
            |f| f.to_string_lossy().into_owned(),
        ),
        cfg: loaded.weights.cfg.clone(),
        leader: LeaderWeights::from_model(&loaded.weights),
        tokenizer: loaded.tokenizer.to_data()?,
        generator: generator.clone(),
        format,
        learning,
        verify_noise: node_core::coded::DEFAULT_NOISE,
    };
    let pb = progress::bar(0, "encoding");
    let mesh = InProcess::encode(&loaded.weights, &generator, format, &|done, total| {
        pb.set_length(total as u64);
        pb.set_position(done as u64);
    })?;
    pb.finish_and_clear();
    drop(loaded);
    // The verification threshold: honest f32 noise of this model and code, measured on every
    // row while they are all here.
    let started = std::time::Instant::now();
    let requests = 24;
    let (noise, mesh) = node_core::coded::measure_noise(
        &manifest.cfg,
        &manifest.leader,
        &generator,
        mesh,
        requests,
    )?;
    if noise > 0.0 {
        manifest.verify_noise = (node_core::coded::NOISE_MARGIN * noise).min(0.5);
    }
    eprintln!(
        "verification threshold {:.2e} × condition number (honest residual up to {noise:.2e} × κ over {requests} requests, {:.1} s)",
        manifest.verify_noise,
        started.elapsed().as_secs_f64()
    );
    let mut blobs = BTreeMap::new();
    for m in mesh.members() {
        blobs.insert(m.shards().node as u32, shard_to_blob(m.shards())?);
    }
    Ok((manifest, blobs))
}

/// `codedmesh node`: restarts from the data dir, or joins through `--bootstrap` and takes a row.
pub async fn node(opts: NodeOptions) -> Result<()> {
    let gpu = open_device(opts.device).await?;
    let data = DataDir::open(&opts.data)?;
    if let (Some((manifest, bytes)), Some(shard)) = (data.manifest()?, data.shard()?) {
        check_shard(&shard, &manifest, shard.node as u32)?;
        eprintln!(
            "restarting with row {} of {} from {}",
            shard.node,
            manifest.name,
            data.path().display()
        );
        let holding = Holding {
            manifest,
            manifest_bytes: bytes,
            shard,
            genesis: BTreeMap::new(),
        };
        return serve(opts, data, holding, gpu).await;
    }
    let Some(bootstrap) = opts.bootstrap.clone() else {
        bail!(
            "{} holds no shard yet: give --bootstrap MULTIADDR of a mesh node to join",
            data.path().display()
        );
    };
    let net = start_network(&opts, &data).await?;
    let client = net.client.clone();
    // The bootstrap node may still be starting (a mesh started in any order): keep trying.
    let peer = match client.dial(bootstrap.clone()).await {
        Ok(peer) => peer,
        Err(e) => {
            eprintln!(
                "bootstrap {bootstrap} does not answer yet ({e:#}); trying again for about 2 minutes"
            );
            dial_with_backoff(&client, &bootstrap, JOIN_TRIES)
                .await
                .with_context(|| {
                    format!("bootstrap {bootstrap} did not answer for about 2 minutes: is a mesh node listening there?")
                })?
        }
    };
    let (manifest, manifest_bytes) = fetch_manifest(&client, peer).await?;
    data.save_manifest(&manifest_bytes)?;
    let started = std::time::Instant::now();
    let link = NativeLink::new(client.clone());
    let joined = holder::join(&link, &peer, &manifest).await;
    link.finish();
    let Joined {
        shard,
        blob,
        version,
        norms,
        how,
        received,
    } = joined?;
    let store = UpdateStore::open(&data)?;
    store.save_base(&version, &norms)?;
    store.save_version(&version)?;
    data.save_shard_blob(&blob)?;
    drop(blob);
    eprintln!(
        "joined as row {} ({how}): received {:.1} MiB ({received} bytes; the row's shard holds {}) in {:.1} s",
        shard.node,
        received as f64 / 1048576.0,
        shard.bytes(),
        started.elapsed().as_secs_f64()
    );
    let holding = Holding {
        manifest,
        manifest_bytes,
        shard,
        genesis: BTreeMap::new(),
    };
    run_server(&opts, gpu, net, data, holding).await
}

/// The shard belongs to this manifest and row.
fn check_shard(shard: &ShardSet, manifest: &ModelManifest, row: u32) -> Result<()> {
    Ok(node_core::holder::check_shard(shard, manifest, row)?)
}

/// One request, with the answer's `Error` turned into an error.
pub async fn ask(client: &Client, peer: PeerId, req: MeshRequest) -> Result<MeshResponse> {
    match client.request(peer, req).await? {
        MeshResponse::Error(e) => bail!("{peer} answered: {e}"),
        other => Ok(other),
    }
}

/// The model manifest from a peer, checked.
pub async fn fetch_manifest(client: &Client, peer: PeerId) -> Result<(ModelManifest, Vec<u8>)> {
    match ask(client, peer, MeshRequest::Manifest).await? {
        MeshResponse::Manifest(bytes) => {
            let m = ModelManifest::from_bytes(&bytes).context("the peer's manifest")?;
            Ok((m, bytes))
        }
        other => bail!("asked for the manifest, got a {}", describe(&other)),
    }
}

/// Downloads a blob piece by piece (`request(offset)` asks for the piece at `offset`): the
/// total and the version must stay the same throughout, and the total under `limit`.
async fn fetch_chunked(
    client: &Client,
    peer: PeerId,
    limit: u64,
    request: impl Fn(u64) -> MeshRequest,
) -> Result<(Vec<u8>, [u8; 32])> {
    let mut download = Download::new(limit);
    loop {
        let resp = client.request(peer, request(download.offset())).await?;
        let done = download.accept(resp)?;
        if done {
            return Ok(download.finish());
        }
    }
}

/// The GPU `choice` asks for, opened before anything else so a missing one fails at once.
async fn open_device(choice: DeviceChoice) -> Result<Option<Arc<Gpu>>> {
    Ok(Gpu::for_choice(choice)
        .await
        .context("--device gpu")?
        .map(Arc::new))
}

/// Starts the network (dialing the bootstrap, if any) and serves what the node holds.
async fn serve(
    opts: NodeOptions,
    data: DataDir,
    holding: Holding,
    gpu: Option<Arc<Gpu>>,
) -> Result<()> {
    let net = start_network(&opts, &data).await?;
    if let Some(b) = &opts.bootstrap
        && let Err(e) = net.client.dial(b.clone()).await
    {
        tracing::warn!("bootstrap {b}: {e:#}; trying again in the background");
        // The bootstrap may be starting too (a whole mesh restarted at once): keep trying,
        // waiting longer each time, until it answers.
        let (client, b) = (net.client.clone(), b.clone());
        tokio::spawn(async move {
            if dial_with_backoff(&client, &b, BOOTSTRAP_TRIES)
                .await
                .is_err()
            {
                tracing::warn!("bootstrap {b} never answered; waiting for peers to find this node");
            }
        });
    }
    run_server(&opts, gpu, net, data, holding).await
}

/// Times a restarted node tries its bootstrap address before waiting to be found.
const BOOTSTRAP_TRIES: u32 = 40;

/// Times a new node tries its bootstrap address before it gives up (about 2 minutes).
const JOIN_TRIES: u32 = 12;

/// Dials `addr` until it answers, waiting twice as long after each failure (0.5 s up to 15 s),
/// at most `tries` more times after a first failure; the last error when it never answers.
async fn dial_with_backoff(client: &Client, addr: &Multiaddr, tries: u32) -> Result<PeerId> {
    let mut wait = Duration::from_millis(500);
    let mut last = match client.dial(addr.clone()).await {
        Ok(peer) => return Ok(peer),
        Err(e) => e,
    };
    for _ in 0..tries {
        tracing::debug!("bootstrap {addr}: {last:#}; trying again in {wait:?}");
        tokio::time::sleep(wait).await;
        match client.dial(addr.clone()).await {
            Ok(peer) => {
                tracing::info!(%peer, "reached the bootstrap node");
                return Ok(peer);
            }
            Err(e) => last = e,
        }
        wait = (wait * 2).min(Duration::from_secs(15));
    }
    Err(last)
}

/// Announces the node's row and answers peers until stopped.
async fn run_server(
    opts: &NodeOptions,
    gpu: Option<Arc<Gpu>>,
    net: Net,
    data: DataDir,
    holding: Holding,
) -> Result<()> {
    let (health, fault) = (opts.health, opts.fault);
    let Net {
        client,
        inbound,
        addrs,
    } = net;
    let Holding {
        manifest,
        manifest_bytes,
        shard,
        genesis,
    } = holding;
    let store = UpdateStore::open(&data)?;
    let rules = Rules {
        cfg: manifest.cfg.clone(),
        learning: manifest.learning,
    };
    let mut row = shard.node as u32;
    let restore_store = store.clone();
    let restore_rules = rules.clone();
    let genesis_norms = manifest.leader.clone();
    let mut state = tokio::task::spawn_blocking(move || {
        restore_store.restore(Member::new(shard), &restore_rules, &genesis_norms)
    })
    .await
    .map_err(|e| anyhow!("{e}"))??;
    if let Some(fault) = fault {
        eprintln!("injecting a fault on purpose: {fault:?}");
        match fault {
            InjectedFault::Garbage => {
                let shards = state.member.shards().clone();
                state.member = Member::misbehaving(
                    shards,
                    row as usize,
                    node_core::coded::Misbehaviour::Garbage,
                );
            }
            InjectedFault::Scale => state.member.shards_mut().scale_values(1.0 + 1e-3),
            InjectedFault::Stale => state.skip_updates = 1,
            InjectedFault::LieVersion => state.skip_updates = u64::MAX,
            InjectedFault::WrongRow => {
                let shards = state.member.shards().clone();
                let claimed = (row + 1) % shards.generator.genesis_rows() as u32;
                eprintln!("claiming row {claimed} while computing with row {row}'s shard");
                state.member = Member::misbehaving(
                    shards,
                    claimed as usize,
                    node_core::coded::Misbehaviour::WrongRow {
                        actual: row as usize,
                    },
                );
                row = claimed;
            }
        }
    }
    let device = match gpu {
        Some(gpu) => {
            let info = gpu.info().clone();
            // Once, before serving: uploading the shards blocks only this start-up.
            let min_work = match opts.device {
                DeviceChoice::Auto => node_core::coded::AUTO_GPU_MIN_WORK,
                _ => 0,
            };
            state.member.use_gpu(gpu, min_work)?;
            if min_work > 0 {
                eprintln!(
                    "computing on the GPU: {info} (products of at least {} MiB of weights × tokens; smaller ones are faster on the CPU)",
                    min_work >> 20
                );
            } else {
                eprintln!("computing on the GPU: {info}");
            }
            format!("{} ({})", info.name, info.backend)
        }
        None => "cpu".to_string(),
    };
    let version = state.version.clone();
    if version.count() > 0 {
        eprintln!(
            "shard at version {} ({} updates)",
            hex8(&version.digest()),
            version.count()
        );
    }
    let local = Heartbeat {
        model: manifest.digest()?,
        row: Some(row),
        version_count: version.count(),
        version_digest: version.digest(),
        addrs,
        offers: genesis.keys().copied().collect(),
        incarnation: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64),
        seq: 0,
        device,
        usage: Usage::default(),
    };
    let view = MeshView::new(
        Instant::now(),
        client.peer_id(),
        health,
        manifest.generator.k() as u32,
        (
            manifest.generator.genesis_rows() as u32,
            manifest.generator.n() as u32,
        ),
        manifest.name.clone(),
        local,
    )?;
    eprintln!("serving row {row} as {}", client.peer_id());
    let (info_tx, info_rx) = tokio::sync::mpsc::channel(16);
    let (internal_tx, internal_rx) = tokio::sync::mpsc::channel(64);
    let state = Arc::new(RwLock::new(state));
    let metrics = crate::metrics::Metrics::new();
    let dashboard = match opts.http {
        Some(addr) => {
            let local_row = LocalRow {
                row: row as usize,
                peer: client.peer_id(),
                state: state.clone(),
                store: store.clone(),
                rules: rules.clone(),
                internal: internal_tx.clone(),
            };
            let engine = crate::engine::Engine::start(crate::engine::EngineContext {
                client: client.clone(),
                key: data.identity()?,
                manifest: manifest.clone(),
                local: local_row,
                info: info_tx.clone(),
                cfg: opts.serve.clone(),
                metrics: metrics.clone(),
                runtime: tokio::runtime::Handle::current(),
            })?;
            let parts = crate::http::Parts {
                web: crate::http::find_web_dir(opts.web_dir.as_deref()),
                info: info_tx,
                bootstrap: BrowserBootstrap::from_addrs(
                    client.peer_id().to_string(),
                    &view.local().addrs,
                ),
                api: crate::api::Api::new(engine, &manifest, opts.api_key.clone())?,
                metrics: metrics.clone(),
            };
            let server = crate::http::start(addr, parts).await?;
            println!("dashboard: {}", server.url);
            println!("api: {}v1", server.url);
            Some(server.url)
        }
        None => None,
    };
    Server {
        client,
        view,
        manifest_bytes: Arc::new(manifest_bytes),
        state,
        rules,
        row,
        learn_times: Default::default(),
        store,
        genesis,
        snapshot: Arc::new(Mutex::new(None)),
        internal_tx,
        syncing: false,
        dashboard,
        metrics,
    }
    .run(inbound, internal_rx, info_rx)
    .await
}

/// This node's shard as a blob at one version (digest), made when a peer starts a download.
type Snapshot = Arc<Mutex<Option<([u8; 32], Arc<Vec<u8>>)>>>;

/// What the node's helper tasks report back to its loop.
enum Internal {
    /// An update was applied (and its payload saved).
    Applied(u64),
    /// A catch-up with a peer ended.
    SyncDone,
    /// A request this node led finished: count it in the usage it announces.
    Served(Usage),
    /// A leader in this node caught a member answering against the code.
    Caught {
        /// The member.
        peer: PeerId,
        /// The evidence.
        evidence: String,
    },
}

/// This node's own row as a leader inside the node uses it: its coded steps are computed and
/// its learning updates applied here, without a network hop (a libp2p node cannot send a
/// request to itself).
#[derive(Clone)]
pub struct LocalRow {
    /// The row.
    pub row: usize,
    /// The node's peer id.
    pub peer: PeerId,
    state: Arc<RwLock<ShardState>>,
    store: UpdateStore,
    rules: Rules,
    internal: tokio::sync::mpsc::Sender<Internal>,
}

impl std::fmt::Debug for LocalRow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalRow").field("row", &self.row).finish()
    }
}

impl LocalRow {
    /// Computes a coded step at `version` (an error when the shard is at another).
    pub fn step(&self, version: &[u8; 32], bytes: &[u8]) -> MeshResponse {
        step(&self.state, version, bytes)
    }

    /// Checks, keeps and applies a sealed learning update, as a peer handing it over would.
    /// Blocks: call it from a blocking thread.
    pub fn learn(&self, bytes: &[u8]) -> MeshResponse {
        learn(&self.state, &self.store, &self.rules, &self.internal, bytes)
    }

    /// The shard's version (digest) and the norm gains at it.
    pub fn norms(&self) -> ([u8; 32], LeaderWeights) {
        let s = read(&self.state);
        (s.version.digest(), s.norms.clone())
    }

    /// Counts a finished request in the usage this node announces. Blocks: call it from a
    /// blocking thread.
    pub fn served(&self, usage: Usage) {
        let _ = self.internal.blocking_send(Internal::Served(usage));
    }

    /// Records a member caught answering against the code, as a peer's report would. Blocks:
    /// call it from a blocking thread.
    pub fn caught(&self, peer: PeerId, evidence: String) {
        let _ = self
            .internal
            .blocking_send(Internal::Caught { peer, evidence });
    }
}

struct Server {
    client: Client,
    view: MeshView<PeerId>,
    manifest_bytes: Arc<Vec<u8>>,
    state: Arc<RwLock<ShardState>>,
    rules: Rules,
    row: u32,
    /// When each peer last handed over updates (a rate limit).
    learn_times: std::collections::HashMap<PeerId, std::collections::VecDeque<Instant>>,
    store: UpdateStore,
    genesis: BTreeMap<u32, Arc<Vec<u8>>>,
    /// This node's shard as a blob at one version, while a peer downloads it.
    snapshot: Snapshot,
    internal_tx: tokio::sync::mpsc::Sender<Internal>,
    syncing: bool,
    /// This node's dashboard URL, when it serves HTTP.
    dashboard: Option<String>,
    /// What `/metrics` reports.
    metrics: crate::metrics::Metrics,
}

fn hex8(d: &[u8; 32]) -> String {
    node_core::mesh::hex(&d[..8])
}

impl Server {
    async fn run(
        mut self,
        mut inbound: tokio::sync::mpsc::Receiver<Inbound>,
        mut internal: tokio::sync::mpsc::Receiver<Internal>,
        mut info: tokio::sync::mpsc::Receiver<InfoRequest>,
    ) -> Result<()> {
        let stop = stop_signal();
        tokio::pin!(stop);
        loop {
            let deadline = tokio::time::Instant::from_std(self.view.poll_timeout());
            tokio::select! {
                msg = inbound.recv() => match msg {
                    Some(msg) => self.on_inbound(msg),
                    None => bail!("the network task stopped"),
                },
                Some(msg) = internal.recv() => self.on_internal(msg)?,
                Some(InfoRequest(reply)) = info.recv() => {
                    let _ = reply.send(self.info(Instant::now()));
                }
                _ = tokio::time::sleep_until(deadline) => self.view.handle_timeout(Instant::now()),
                _ = &mut stop => {
                    eprintln!("stopping");
                    return Ok(());
                }
            }
            while let Some(hb) = self.view.poll_transmit() {
                self.client.publish(protocol::encode(&hb)?).await?;
            }
            while let Some(ev) = self.view.poll_event() {
                self.on_event(ev);
            }
        }
    }

    /// The mesh as this node sees it, with its dashboard's URL.
    fn info(&self, now: Instant) -> MeshInfo {
        let mut info = self.view.info(now);
        info.dashboard = self.dashboard.clone();
        info
    }

    fn on_internal(&mut self, msg: Internal) -> Result<()> {
        match msg {
            Internal::Applied(id) => {
                let version = read(&self.state).version.clone();
                self.store.save_version(&version)?;
                self.metrics.updates_applied.inc();
                let mut local = self.view.local().clone();
                local.version_count = version.count();
                local.version_digest = version.digest();
                self.view.set_local(local);
                self.view.handle_timeout(Instant::now());
                tracing::info!(
                    id = format!("{id:016x}"),
                    count = version.count(),
                    "applied an update"
                );
            }
            Internal::SyncDone => self.syncing = false,
            Internal::Served(usage) => {
                let mut local = self.view.local().clone();
                local.usage.add(&usage);
                self.view.set_local(local);
            }
            Internal::Caught { peer, evidence } => {
                let text = format!(
                    "{evidence}; reported by {} (this node)",
                    self.client.peer_id()
                );
                self.view.report_caught(peer, text);
            }
        }
        Ok(())
    }

    fn on_event(&mut self, ev: MeshEvent<PeerId>) {
        match ev {
            MeshEvent::Discovered { peer, addrs } => {
                tracing::info!(%peer, "discovered");
                let addrs: Vec<Multiaddr> = addrs.iter().filter_map(|a| a.parse().ok()).collect();
                let client = self.client.clone();
                tokio::spawn(async move {
                    let _ = client.add_addrs(peer, addrs.clone()).await;
                    if let Some(a) = pick_addr(&addrs) {
                        let _ = client.dial(with_peer(&a, peer)).await;
                    }
                });
            }
            MeshEvent::HealthChanged { peer, row, health } => {
                eprintln!(
                    "peer {peer} (row {}) is {health}",
                    row.map_or("-".into(), |r| r.to_string())
                );
            }
            MeshEvent::Refused { peer, error } => tracing::warn!(%peer, "{error}"),
        }
    }

    /// A peer announces a version this node does not have: fetch what is missing from it.
    fn maybe_sync(&mut self, peer: PeerId, hb: &Heartbeat) {
        let local = self.view.local();
        if self.syncing
            || hb.version_digest == local.version_digest
            || hb.version_count < local.version_count
        {
            return;
        }
        self.syncing = true;
        let (client, state, store, rules, tx) = (
            self.client.clone(),
            self.state.clone(),
            self.store.clone(),
            self.rules.clone(),
            self.internal_tx.clone(),
        );
        tokio::spawn(async move {
            if let Err(e) = catch_up(&client, peer, &state, &store, &rules, &tx).await {
                tracing::warn!(%peer, "catching up: {e:#}");
            }
            let _ = tx.send(Internal::SyncDone).await;
        });
    }

    /// Counts a peer's update hand-over; false past the rate limit.
    fn within_rate(&mut self, peer: PeerId, now: Instant) -> bool {
        let times = self.learn_times.entry(peer).or_default();
        while times
            .front()
            .is_some_and(|t| now.duration_since(*t) > Duration::from_secs(60))
        {
            times.pop_front();
        }
        if times.len() >= LEARN_PER_MINUTE {
            return false;
        }
        times.push_back(now);
        true
    }

    fn on_inbound(&mut self, msg: Inbound) {
        let now = Instant::now();
        if let Inbound::Gossip { data, .. } = &msg {
            self.metrics.gossip_bytes.inc_by(data.len() as u64);
        }
        match msg {
            Inbound::Gossip { peer, data } => match protocol::decode::<Heartbeat>(&data) {
                Ok(hb) => {
                    if let Some(row) = hb.row
                        && self.genesis.remove(&row).is_some()
                    {
                        eprintln!(
                            "row {row} handed out to {peer}; {} left",
                            self.genesis.len()
                        );
                        let mut local = self.view.local().clone();
                        local.offers = self.genesis.keys().copied().collect();
                        self.view.set_local(local);
                    }
                    if hb.model == self.view.local().model {
                        self.maybe_sync(peer, &hb);
                    }
                    self.view.handle_heartbeat(now, peer, hb);
                }
                Err(e) => tracing::warn!(%peer, "bad heartbeat: {e}"),
            },
            Inbound::Request {
                peer,
                request,
                channel,
            } => {
                let client = self.client.clone();
                let job: Box<dyn FnOnce() -> MeshResponse + Send> = match request {
                    MeshRequest::Info => {
                        let info = self.info(now);
                        Box::new(move || MeshResponse::Info(info))
                    }
                    MeshRequest::Manifest => {
                        let bytes = self.manifest_bytes.clone();
                        Box::new(move || MeshResponse::Manifest(bytes.as_ref().clone()))
                    }
                    MeshRequest::Join => {
                        let offer = self.view.offer_row(now, peer);
                        tracing::info!(%peer, ?offer, "join");
                        Box::new(move || MeshResponse::Join(offer))
                    }
                    MeshRequest::Chunk { row, offset, len } => {
                        let len = len.min(MAX_CHUNK_BYTES);
                        let genesis = self.genesis.get(&row).cloned();
                        let own = row == self.row;
                        let (state, snapshot) = (self.state.clone(), self.snapshot.clone());
                        Box::new(move || {
                            chunk(
                                genesis,
                                own.then_some((&state, &snapshot)),
                                row,
                                offset,
                                len,
                            )
                        })
                    }
                    MeshRequest::Report {
                        peer: caught,
                        evidence,
                    } => {
                        let answer = match caught.parse::<PeerId>() {
                            Ok(p) => {
                                let text = format!("{evidence}; reported by {peer}");
                                if p == self.client.peer_id() {
                                    eprintln!(
                                        "this node was caught answering against the code: {text}"
                                    );
                                }
                                self.view.report_caught(p, text);
                                MeshResponse::Reported
                            }
                            Err(e) => MeshResponse::Error(format!("peer id {caught:?}: {e}")),
                        };
                        Box::new(move || answer)
                    }
                    MeshRequest::Served(usage) => {
                        // Counts for the dashboards only: nothing is decided on them.
                        let mut local = self.view.local().clone();
                        local.usage.add(&usage);
                        self.view.set_local(local);
                        Box::new(|| MeshResponse::Reported)
                    }
                    MeshRequest::Norms => {
                        let s = read(&self.state);
                        let (version, norms) = (s.version.digest(), s.norms.clone());
                        Box::new(move || MeshResponse::Norms { version, norms })
                    }
                    MeshRequest::Versions => {
                        let ids = read(&self.state).version.ids().collect();
                        Box::new(move || MeshResponse::Versions { ids })
                    }
                    MeshRequest::UpdateChunk { id, offset, len } => {
                        let store = self.store.clone();
                        let len = len.min(MAX_CHUNK_BYTES);
                        Box::new(move || match store.chunk(id, offset, len) {
                            Ok((total, bytes)) => MeshResponse::Chunk {
                                total,
                                version: [0; 32],
                                bytes,
                            },
                            Err(e) => MeshResponse::Error(format!("{e:#}")),
                        })
                    }
                    MeshRequest::Learn(_) if !self.within_rate(peer, now) => {
                        let msg = format!(
                            "rate limit: at most {LEARN_PER_MINUTE} updates a minute from one peer"
                        );
                        Box::new(move || MeshResponse::Error(msg))
                    }
                    MeshRequest::Learn(bytes) => {
                        let (state, store, rules, tx) = (
                            self.state.clone(),
                            self.store.clone(),
                            self.rules.clone(),
                            self.internal_tx.clone(),
                        );
                        Box::new(move || learn(&state, &store, &rules, &tx, &bytes))
                    }
                    // A decode step is a fraction of a millisecond of work: computing it here
                    // saves two thread hand-offs per round. Prefill steps go to the pool.
                    MeshRequest::Step { version, bytes } if bytes.len() <= INLINE_STEP_BYTES => {
                        let resp = step(&self.state, &version, &bytes);
                        tokio::spawn(async move { client.respond(channel, resp).await });
                        return;
                    }
                    MeshRequest::Step { version, bytes } => {
                        let state = self.state.clone();
                        Box::new(move || step(&state, &version, &bytes))
                    }
                    MeshRequest::Chain(part) => {
                        let (state, chain_bytes) =
                            (self.state.clone(), self.metrics.chain_bytes.clone());
                        let (g, cfg) = {
                            let s = read(&self.state);
                            let set = s.member.shards();
                            (set.generator.clone(), set.cfg.clone())
                        };
                        tokio::spawn(async move {
                            let link = NativeLink::quiet(client.clone());
                            let resp = match holder::answer_chain(&link, &part, &g, &cfg).await {
                                Ok(before) => {
                                    let got = before.as_ref().map_or(0, |s| s.len() as u64 * 4);
                                    chain_bytes.inc_by(got);
                                    link.blocking(move || {
                                        let s = read(&state);
                                        let version = s.version.digest();
                                        match part.contribute(s.member.shards(), &version, before) {
                                            Ok(sum) => MeshResponse::Partial(sum),
                                            Err(e) => MeshResponse::Error(e.to_string()),
                                        }
                                    })
                                    .await
                                }
                                Err(e) => MeshResponse::Error(e.to_string()),
                            };
                            client.respond(channel, resp).await;
                        });
                        return;
                    }
                };
                tokio::spawn(async move {
                    let resp = tokio::task::spawn_blocking(job)
                        .await
                        .unwrap_or_else(|e| MeshResponse::Error(e.to_string()));
                    client.respond(channel, resp).await;
                });
            }
        }
    }
}

/// Resolves when the process is asked to stop: Ctrl-C (SIGINT) or SIGTERM.
pub async fn stop_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(e) => {
                tracing::warn!("cannot listen for SIGTERM: {e}");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

fn read(state: &RwLock<ShardState>) -> std::sync::RwLockReadGuard<'_, ShardState> {
    state
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn write(state: &RwLock<ShardState>) -> std::sync::RwLockWriteGuard<'_, ShardState> {
    state
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Saves and applies an update a leader hands over.
fn learn(
    state: &RwLock<ShardState>,
    store: &UpdateStore,
    rules: &Rules,
    tx: &tokio::sync::mpsc::Sender<Internal>,
    bytes: &[u8],
) -> MeshResponse {
    match apply_and_keep(state, store, rules, bytes) {
        Ok((id, applied)) => {
            if applied {
                let _ = tx.blocking_send(Internal::Applied(id));
            }
            MeshResponse::Learned {
                id,
                version_count: read(state).version.count(),
            }
        }
        Err(e) => MeshResponse::Error(format!("{e:#}")),
    }
}

/// Validates, saves the payload, then applies: `(id, applied now)`.
fn apply_and_keep(
    state: &RwLock<ShardState>,
    store: &UpdateStore,
    rules: &Rules,
    bytes: &[u8],
) -> Result<(u64, bool)> {
    let checked = rules.check(bytes)?;
    let id = checked.id;
    tracing::debug!(id = format!("{id:016x}"), signer = %checked.signer, "a signed update");
    let update = checked.update;
    if read(state).version.contains(id) {
        return Ok((id, false));
    }
    store.save(id, bytes)?;
    let applied = write(state).apply(&update, id)?;
    Ok((id, applied))
}

/// Fetches and applies every update `peer` has applied and this node has not.
async fn catch_up(
    client: &Client,
    peer: PeerId,
    state: &Arc<RwLock<ShardState>>,
    store: &UpdateStore,
    rules: &Rules,
    tx: &tokio::sync::mpsc::Sender<Internal>,
) -> Result<()> {
    let MeshResponse::Versions { ids } = ask(client, peer, MeshRequest::Versions).await? else {
        bail!("asked for versions, got something else");
    };
    let missing: Vec<u64> = {
        let s = read(state);
        ids.into_iter()
            .filter(|id| !s.version.contains(*id))
            .collect()
    };
    for id in missing {
        let bytes = fetch_update(client, peer, id).await?;
        let (state, store, rules) = (state.clone(), store.clone(), rules.clone());
        let (got, applied) =
            tokio::task::spawn_blocking(move || apply_and_keep(&state, &store, &rules, &bytes))
                .await
                .map_err(|e| anyhow!("{e}"))??;
        ensure!(
            got == id,
            "the peer's update {id:016x} hashes to {got:016x}"
        );
        if applied {
            tx.send(Internal::Applied(id))
                .await
                .map_err(|_| anyhow!("the node stopped"))?;
        }
    }
    Ok(())
}

/// Downloads an update's payload in chunks.
pub(crate) async fn fetch_update(client: &Client, peer: PeerId, id: u64) -> Result<Vec<u8>> {
    let limit = crate::learning::MAX_UPDATE_BYTES;
    let req = |offset| update_chunk_request(id, offset);
    Ok(fetch_chunked(client, peer, limit, req).await?.0)
}

/// Updates one peer may hand over per minute.
const LEARN_PER_MINUTE: usize = 120;

/// Step requests up to this size (one token's activations) are computed on the node's task.
const INLINE_STEP_BYTES: usize = 16 << 10;

/// A piece of a genesis blob, or of a snapshot of this node's shard at its current version.
fn chunk(
    genesis: Option<Arc<Vec<u8>>>,
    own: Option<(&Arc<RwLock<ShardState>>, &Snapshot)>,
    row: u32,
    offset: u64,
    len: u32,
) -> MeshResponse {
    let slice = |blob: &[u8], version: [u8; 32]| chunk_of(blob, version, offset, len);
    if let Some(blob) = genesis {
        return slice(&blob, ShardVersion::default().digest());
    }
    let Some((state, snapshot)) = own else {
        return MeshResponse::Error(format!("this node does not hold row {row}"));
    };
    let mut snap = snapshot
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let s = read(state);
    let digest = s.version.digest();
    let fresh = snap.as_ref().is_some_and(|(d, _)| *d == digest);
    if !fresh {
        if offset != 0 {
            return MeshResponse::Error(
                "the shard changed version during the transfer; start again".into(),
            );
        }
        match shard_to_blob(s.member.shards()) {
            Ok(blob) => *snap = Some((digest, Arc::new(blob))),
            Err(e) => return MeshResponse::Error(format!("{e:#}")),
        }
    }
    match snap.as_ref() {
        Some((d, blob)) => slice(blob, *d),
        None => MeshResponse::Error("no snapshot".into()),
    }
}

/// Computes a coded step at the leader's version; the answer carries the compute time.
fn step(state: &RwLock<ShardState>, version: &[u8; 32], bytes: &[u8]) -> MeshResponse {
    let started = std::time::Instant::now();
    let s = read(state);
    if let Some(e) = s.version_mismatch(version) {
        return MeshResponse::Error(e);
    }
    let answer = s.member.handle_bytes(bytes);
    let compute_us = started.elapsed().as_micros() as u64;
    match protocol::encode(&answer) {
        Ok(bytes) => MeshResponse::Step { bytes, compute_us },
        Err(e) => MeshResponse::Error(e.to_string()),
    }
}
