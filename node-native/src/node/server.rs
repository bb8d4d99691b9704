//! Serving: a node announces its row and answers peers — coded steps, pieces of its shard,
//! its part in others' chains, learning updates — and runs the API's engine when it serves HTTP.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow, bail};
use libp2p::{Multiaddr, PeerId};
use node_core::coded::Member;
use node_core::compute::gpu::{DeviceChoice, Gpu};
use node_core::holder::{self, Link as _, chunk_of};
use node_core::mesh::{
    BrowserBootstrap, Heartbeat, MAX_CHUNK_BYTES, MeshEvent, MeshInfo, MeshRequest, MeshResponse,
    MeshView, ShardVersion, Usage,
};
use node_core::protocol;

use super::{Holding, InjectedFault, Net, NodeOptions, stop_signal};
use crate::learning::{Rules, ShardState, UpdateStore};
use crate::link::{NativeLink, pick_addr};
use crate::row::{InfoRequest, Internal, LocalRow, catch_up, learn, read, step};
use crate::store::{DataDir, shard_to_blob};
use crate::swarm::{Client, Inbound, with_peer};

/// Announces the node's row and answers peers until stopped.
pub(super) async fn run_server(
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
        uptime_ms: 0,
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
