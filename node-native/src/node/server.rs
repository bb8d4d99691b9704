//! Serving: a node announces its row and answers peers — coded steps, pieces of its shard,
//! its part in others' chains, learning updates — and runs the API's engine when it serves HTTP.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Instant;

use anyhow::{Result, anyhow, bail};
use libp2p::request_response::ResponseChannel;
use libp2p::{Multiaddr, PeerId};
use node_core::code::Generator;
use node_core::coded::Member;
use node_core::compute::gpu::{DeviceChoice, Gpu};
use node_core::holder::{self, Held, LearnLimit, Link as _, Route, Snapshot};
use node_core::mesh::{
    BrowserBootstrap, Heartbeat, MeshEvent, MeshRequest, MeshResponse, MeshView, ShardVersion,
    Usage,
};
use node_core::protocol;

use super::{Holding, InjectedFault, Net, NodeOptions, stop_signal};
use crate::hold::learning::read;
use crate::hold::learning::{Rules, ShardState, UpdateStore};
use crate::hold::link::{NativeLink, order_addrs};
use crate::hold::row::{InfoRequest, Internal, LocalRow, learn};
use crate::hold::spread::{Relay, Spreads, catch_up};
use crate::hold::store::DataDir;
use crate::net::swarm::{Client, Inbound, with_peer};
use node_core::net::reach::Reach;

/// Peers announcing a version a node lacks: what each announces.
type Ahead = HashMap<PeerId, holder::Ahead>;

/// How long a peer this node pulled from without coming level is asked again only when no
/// other peer ahead is left.
const TRIED_FOR: std::time::Duration = std::time::Duration::from_secs(30);

/// How long a node behind its peers waits, with no update spreading to it, before it pulls what
/// it lacks: an update spreads to every live holder well within it, so pulls are for the holders
/// the spread missed (restarted, partitioned, their relay gone).
pub const PULL_AFTER: std::time::Duration = std::time::Duration::from_secs(2);

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
        addrs: listen_addrs,
    } = net;
    let Holding {
        manifest,
        manifest_bytes,
        shard,
        genesis,
    } = holding;
    let store = UpdateStore::open(&data)?;
    let rules = Rules::of(&manifest);
    let mut row = shard.node as u32;
    let restore_store = store.clone();
    let restore_rules = rules.clone();
    let genesis_norms = manifest.leader.clone();
    let mut state = tokio::task::spawn_blocking(move || {
        restore_store.restore(shard, &restore_rules, &genesis_norms)
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
            InjectedFault::BackwardOnly => {
                let shards = state.member.shards().clone();
                state.member = Member::misbehaving(
                    shards,
                    row as usize,
                    node_core::coded::Misbehaviour::BackwardOnly,
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
        addrs: listen_addrs.clone(),
        offers: genesis.keys().copied().collect(),
        incarnation: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64),
        seq: 0,
        uptime_ms: 0,
        device,
        usage: Usage::default(),
        reach: Default::default(),
        trains: false,
        coord: Default::default(),
    };
    let mut view = MeshView::new(
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
    let (info_tx, info_rx) = tokio::sync::mpsc::channel(16);
    let (internal_tx, internal_rx) = tokio::sync::mpsc::channel(64);
    let state = Arc::new(RwLock::new(state));
    crate::hold::session::serve(&client, state.clone())?;
    crate::hold::hop::serve(&client, state.clone())?;
    let metrics = crate::serve::metrics::Metrics::new();
    let row_bytes = read(&state).member.shards().bytes();
    metrics
        .row_bytes
        .set(i64::try_from(row_bytes).unwrap_or(i64::MAX));
    let mut teach = None;
    if let Some(addr) = opts.http {
        let local_row = LocalRow {
            row: row as usize,
            peer: client.peer_id(),
            state: state.clone(),
            store: store.clone(),
            rules: rules.clone(),
            internal: internal_tx.clone(),
        };
        let engine = crate::serve::engine::Engine::start(crate::serve::engine::EngineContext {
            client: client.clone(),
            signer: crate::hold::trust::signer(data.identity()?, data.cert()?, &manifest),
            manifest: manifest.clone(),
            local: local_row,
            info: info_tx.clone(),
            cfg: opts.serve.clone(),
            metrics: metrics.clone(),
            runtime: tokio::runtime::Handle::current(),
            probed: Default::default(),
        })?;
        if engine.trains() {
            // Peers that may not write hand this node their users' text.
            let mut local = view.local().clone();
            local.trains = true;
            view.set_local(local);
        }
        teach = Some(engine.clone());
        let parts = crate::serve::http::Parts {
            web: crate::serve::http::find_web_dir(opts.web_dir.as_deref()),
            info: info_tx,
            bootstrap: BrowserBootstrap::from_addrs(
                client.peer_id().to_string(),
                &view.local().addrs,
            ),
            api: crate::serve::api::Api::new(engine, &manifest, api_keys(opts)?, metrics.clone())?,
            metrics: metrics.clone(),
            updates: store.clone(),
        };
        let server = crate::serve::http::start(addr, parts).await?;
        println!("dashboard: {}", server.url);
        println!("api: {}v1", server.url);
        view.set_dashboard(Some(server.url));
    }
    // Last, once its API (if any) listens: tests and scripts read this line as "ready".
    eprintln!("serving row {row} as {}", client.peer_id());
    Server {
        client,
        view,
        manifest_bytes: Arc::new(manifest_bytes),
        state,
        rules,
        row,
        limit: LearnLimit::default(),
        generator: manifest.generator.clone(),
        store,
        genesis,
        snapshot: Arc::new(Mutex::new(Snapshot::default())),
        internal_tx,
        syncing: false,
        behind: None,
        spreads: Default::default(),
        tried: HashMap::new(),
        folding: false,
        teach,
        manifest: Arc::new(manifest),
        metrics,
        listen_addrs,
    }
    .run(inbound, internal_rx, info_rx)
    .await
}

struct Server {
    client: Client,
    view: MeshView<PeerId>,
    manifest_bytes: Arc<Vec<u8>>,
    state: Arc<RwLock<ShardState>>,
    rules: Rules,
    row: u32,
    /// Updates each peer handed over lately.
    limit: LearnLimit<PeerId>,
    /// The mesh's code.
    generator: Generator,
    store: UpdateStore,
    genesis: BTreeMap<u32, Arc<Vec<u8>>>,
    /// This node's shard as a blob at one version, while a peer downloads it.
    snapshot: Arc<Mutex<Snapshot>>,
    internal_tx: tokio::sync::mpsc::Sender<Internal>,
    /// A catch-up with a peer (or a rebuild after one) is running.
    syncing: bool,
    /// Since when peers have announced a version this node lacks, and each such peer's update
    /// count and requests led: pulled from once no update has spread to it for [`PULL_AFTER`].
    behind: Option<(Instant, Ahead)>,
    /// Updates spreading through this node.
    spreads: Spreads,
    /// Peers this node pulled from lately, and when ([`holder::catch_up_source`]).
    tried: HashMap<PeerId, Instant>,
    /// A fold of the kept updates into a new snapshot is running.
    folding: bool,
    /// The node's engine, when it serves the API: it trains on text peers hand over.
    teach: Option<crate::serve::engine::Engine>,
    /// The mesh's manifest (a rebuild obtains the row as a joiner would).
    manifest: Arc<node_core::mesh::ModelManifest>,
    /// What `/metrics` reports.
    metrics: crate::serve::metrics::Metrics,
    /// The addresses it listens on (announced after those peers reach it at).
    listen_addrs: Vec<String>,
}

/// The callers a node's API admits: a keys file's, one key's, or everyone as the anonymous
/// user.
fn api_keys(opts: &NodeOptions) -> Result<crate::serve::api::keys::Keys> {
    use crate::serve::api::keys::Keys;
    Ok(match (&opts.api_keys, &opts.api_key) {
        (Some(file), _) => Keys::from_file(file)?,
        (None, Some(key)) if !key.is_empty() => Keys::single(key),
        _ => Keys::open(),
    })
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
                    let _ = reply.send(self.view.info(Instant::now()));
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
            self.store.set_lags(self.view.lags(Instant::now()));
        }
    }

    fn on_internal(&mut self, msg: Internal) -> Result<()> {
        match msg {
            Internal::Applied(id) => {
                self.behind = None;
                let version = read(&self.state).version.clone();
                self.store.save_version(&version)?;
                self.metrics.updates_applied.inc();
                self.announce_version(&version);
                tracing::info!(
                    id = format!("{id:016x}"),
                    count = version.count(),
                    "applied an update"
                );
                self.maybe_fold(&version);
            }
            Internal::SyncDone(None) => self.syncing = false,
            Internal::SyncDone(Some((peer, version))) => self.rebuild(peer, version),
            Internal::Rebuilt(result) => {
                self.syncing = false;
                match result {
                    Ok(how) => {
                        let version = read(&self.state).version.clone();
                        self.announce_version(&version);
                        eprintln!(
                            "rebuilt row {} at version {} ({} updates): {how}",
                            self.row,
                            hex8(&version.digest()),
                            version.count()
                        );
                    }
                    Err(e) => tracing::warn!("rebuilding the row: {e:#}"),
                }
            }
            Internal::Folded(result) => {
                self.folding = false;
                match result {
                    Ok((n, took)) => {
                        self.metrics.snapshots.inc();
                        let count = read(&self.state).version.count();
                        eprintln!(
                            "saved a snapshot of row {} at {count} updates ({n} folded into it, {:.1} s)",
                            self.row,
                            took.as_secs_f64()
                        );
                    }
                    Err(e) => tracing::warn!("saving a snapshot: {e:#}"),
                }
            }
            Internal::Served(usage) => self.view.add_usage(&usage),
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

    /// Announces the shard's version in this node's heartbeats from now on.
    fn announce_version(&mut self, version: &ShardVersion) {
        let mut local = self.view.local().clone();
        local.version_count = version.count();
        local.version_digest = version.digest();
        self.view.set_local(local);
        self.view.handle_timeout(Instant::now());
    }

    /// Folds the kept updates into a new snapshot once they are due, on a thread that waits
    /// for idle cores ([`crate::hold::background`]).
    fn maybe_fold(&mut self, version: &ShardVersion) {
        if self.folding || !self.store.fold_due(version) {
            return;
        }
        self.folding = true;
        let (state, store, tx) = (
            self.state.clone(),
            self.store.clone(),
            self.internal_tx.clone(),
        );
        tokio::spawn(async move {
            let started = Instant::now();
            let folded = crate::hold::background::run("fold", move || store.fold(&state))
                .await
                .and_then(|r| r)
                .map(|n| (n, started.elapsed()));
            let _ = tx.send(Internal::Folded(folded)).await;
        });
    }

    /// Rebuilds this node's row at `version`, which `peer` is at and which the updates it
    /// still keeps cannot reach: a copy from another holder of the row, else along a chain.
    fn rebuild(&mut self, peer: PeerId, version: [u8; 32]) {
        let offer = self.view.rebuild_offer(version);
        if offer == node_core::mesh::JoinOffer::Full {
            tracing::info!(
                %peer,
                "behind the updates the mesh keeps, and no holders at its version to rebuild from yet"
            );
            self.syncing = false;
            return;
        }
        eprintln!(
            "row {} is behind what its peers keep: rebuilding it at version {}",
            self.row,
            hex8(&version)
        );
        let (client, state, store, tx, manifest) = (
            self.client.clone(),
            self.state.clone(),
            self.store.clone(),
            self.internal_tx.clone(),
            self.manifest.clone(),
        );
        tokio::spawn(async move {
            let link = NativeLink::quiet(client);
            let rebuilt = async {
                let joined = holder::obtain(&link, &peer, &manifest, offer).await?;
                let how = joined.how.clone();
                tokio::task::spawn_blocking(move || -> Result<()> {
                    store.save_snapshot(&joined.blob, &joined.version, &joined.norms)?;
                    crate::hold::learning::write(&state).replace(
                        joined.shard,
                        joined.version,
                        joined.norms,
                    )?;
                    Ok(())
                })
                .await
                .map_err(|e| anyhow!("{e}"))??;
                Ok::<_, anyhow::Error>(how)
            };
            let _ = tx.send(Internal::Rebuilt(rebuilt.await)).await;
        });
    }

    fn on_event(&mut self, ev: MeshEvent<PeerId>) {
        match ev {
            MeshEvent::Discovered { peer, addrs } => {
                tracing::info!(%peer, "discovered");
                let addrs: Vec<Multiaddr> = addrs.iter().filter_map(|a| a.parse().ok()).collect();
                let client = self.client.clone();
                tokio::spawn(async move {
                    let _ = client.add_addrs(peer, addrs.clone()).await;
                    if let Err(e) = client.dial_any(peer, &order_addrs(&addrs)).await {
                        tracing::debug!(%peer, "dialing a discovered peer: {e:#}");
                    }
                });
            }
            MeshEvent::HealthChanged { peer, row, health } => {
                eprintln!(
                    "peer {peer} (row {}) is {health}",
                    row.map_or("-".into(), |r| r.to_string())
                );
            }
            MeshEvent::Refused { peer, error } => {
                self.metrics.heartbeats_refused.inc();
                tracing::warn!(%peer, "{error}")
            }
        }
    }

    /// A peer announces a version this node does not have: once behind for [`PULL_AFTER`] with
    /// no update spreading to it, fetch what is missing from the most advanced of the peers
    /// ahead that leads the fewest requests (leaders have their own work).
    fn maybe_sync(&mut self, peer: PeerId, hb: &Heartbeat, now: Instant) {
        if !holder::worth_catching_up(self.view.local(), hb) {
            return;
        }
        let (since, ahead) = self.behind.get_or_insert_with(|| (now, HashMap::new()));
        let tried = (self.tried.get(&peer)).is_some_and(|at| now.duration_since(*at) < TRIED_FOR);
        let announced = holder::Ahead {
            count: hb.version_count,
            digest: hb.version_digest,
            led: hb.usage.requests,
            tried,
        };
        ahead.insert(peer, announced);
        if self.syncing || !self.spreads.is_empty() || now.duration_since(*since) < PULL_AFTER {
            return;
        }
        let Some(peer) = self.behind.take().and_then(|(_, ahead)| {
            let ahead: Vec<(PeerId, holder::Ahead)> = ahead.into_iter().collect();
            holder::catch_up_source(&ahead)
        }) else {
            return;
        };
        self.tried
            .retain(|_, at| now.duration_since(*at) < TRIED_FOR);
        self.tried.insert(peer, now);
        self.syncing = true;
        eprintln!("behind the mesh: pulling the updates this node lacks from {peer}");
        let node = self.relay();
        tokio::spawn(async move {
            let behind = match catch_up(&node, peer).await {
                Ok(behind) => behind.map(|version| (peer, version)),
                Err(e) => {
                    tracing::warn!(%peer, "catching up: {e:#}");
                    None
                }
            };
            let _ = node.tx.send(Internal::SyncDone(behind)).await;
        });
    }

    /// What taking an update (by a notice or a catch-up) needs of this node.
    fn relay(&self) -> Relay {
        Relay {
            client: self.client.clone(),
            spreads: self.spreads.clone(),
            state: self.state.clone(),
            store: self.store.clone(),
            rules: self.rules.clone(),
            tx: self.internal_tx.clone(),
            received: self.metrics.update_bytes_received.clone(),
            duplicates: self.metrics.update_duplicate_pieces.clone(),
        }
    }

    fn on_inbound(&mut self, msg: Inbound) {
        let now = Instant::now();
        match msg {
            Inbound::Gossip { peer, data } => self.on_gossip(peer, &data, now),
            Inbound::Request {
                peer,
                request,
                channel,
            } => self.on_request(peer, request, channel, now),
            Inbound::Reach { reach, addrs, .. } => self.on_reach(reach, &addrs),
            Inbound::RoundTrip { peer, rtt } => self.view.observe_rtt(&peer, rtt),
            Inbound::Listening(_) | Inbound::Expired(_) => {}
        }
    }

    /// Announces how peers reach this node: its reachability, and its confirmed addresses and
    /// relay circuits (not through a relay's own private addresses) before the addresses it
    /// listens on.
    fn on_reach(&mut self, reach: Reach, addrs: &[Multiaddr]) {
        let me = self.client.peer_id();
        let mut local = self.view.local().clone();
        let mut seen = std::collections::HashSet::new();
        let all: Vec<String> = node_core::net::reach::announced(addrs)
            .iter()
            .map(|a| with_peer(a, me).to_string())
            .chain(self.listen_addrs.iter().cloned())
            .filter(|a| seen.insert(a.clone()))
            .collect();
        local.reach = reach;
        local.addrs = all;
        self.view.set_local(local);
    }

    /// A heartbeat: the rows it takes out of this node's offers, updates to catch up on, the view.
    fn on_gossip(&mut self, peer: PeerId, data: &[u8], now: Instant) {
        self.metrics.gossip_bytes.inc_by(data.len() as u64);
        let hb = match protocol::decode::<Heartbeat>(data) {
            Ok(hb) => hb,
            Err(e) => return tracing::warn!(%peer, "bad heartbeat: {e}"),
        };
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
        self.maybe_sync(peer, &hb, now);
        self.view.handle_heartbeat(now, peer, hb);
    }

    /// Answers a peer: at once where [`holder::route`] can, else on the pool or a task.
    fn on_request(
        &mut self,
        peer: PeerId,
        request: MeshRequest,
        channel: ResponseChannel<MeshResponse>,
        now: Instant,
    ) {
        if let MeshRequest::UpdateChunk { id, offset, .. } = &request
            && let Some(piece) = self.spreads.piece(*id, *offset)
        {
            let (client, sent) = (self.client.clone(), self.metrics.update_bytes_sent.clone());
            tokio::spawn(async move {
                let answer = piece.await;
                if let MeshResponse::Chunk { bytes, .. } = &answer {
                    sent.inc_by(bytes.len() as u64);
                }
                client.respond(channel, answer).await
            });
            return;
        }
        let route = {
            let state = read(&self.state);
            let held = Held {
                row: self.row,
                state: &state,
                manifest: &self.manifest_bytes,
                genesis: &self.genesis,
                rules: &self.rules,
                wall_ms: node_core::holder::wall_ms(),
                live: self.view.live_holders(),
            };
            holder::route(&held, &mut self.limit, &peer, now, request)
        };
        let client = self.client.clone();
        let respond = move |resp| async move { client.respond(channel, resp).await };
        let job: Box<dyn FnOnce() -> MeshResponse + Send> = match route {
            Route::Answer(resp) => {
                tokio::spawn(respond(resp));
                return;
            }
            Route::View(query) => {
                let onward = query.onward();
                let resp = holder::answer_view(&mut self.view, &peer, query, now);
                tokio::spawn(respond(resp));
                if let Some((report, to)) = onward {
                    let link = NativeLink::quiet(self.client.clone());
                    tokio::spawn(async move {
                        holder::pass_report(&link, report, &to).await;
                    });
                }
                return;
            }
            Route::Step { version, request } => {
                let work = crate::hold::session::compute(self.state.clone(), version, request);
                tokio::spawn(async move { respond(work.await).await });
                return;
            }
            Route::Spread(notice) => {
                let relay = self.relay();
                let id = notice.list.id;
                tokio::spawn(respond(MeshResponse::Spreading { id }));
                tokio::spawn(relay.take(notice));
                return;
            }
            Route::Teach(tokens) => {
                let answer = match &self.teach {
                    Some(engine) => match engine.teach(tokens, &peer) {
                        Ok(()) => MeshResponse::Taught,
                        Err(e) => MeshResponse::Error(e),
                    },
                    None => MeshResponse::Error(
                        "this node does not train: ask a node that serves the API and the mesh admits to write"
                            .into(),
                    ),
                };
                tokio::spawn(respond(answer));
                return;
            }
            Route::Learn(bytes) => {
                self.metrics
                    .update_bytes_received
                    .inc_by(bytes.len() as u64);
                let (state, store, rules, tx) = (
                    self.state.clone(),
                    self.store.clone(),
                    self.rules.clone(),
                    self.internal_tx.clone(),
                );
                Box::new(move || learn(&state, &store, &rules, &tx, &bytes))
            }
            Route::ShardPiece { offset, len } => {
                let (state, snapshot) = (self.state.clone(), self.snapshot.clone());
                Box::new(move || {
                    let mut snap = snapshot.lock().unwrap_or_else(PoisonError::into_inner);
                    snap.piece(&read(&state), offset, len)
                })
            }
            Route::UpdatePiece { id, offset, len } => {
                let (store, sent) = (self.store.clone(), self.metrics.update_bytes_sent.clone());
                Box::new(move || match store.chunk(id, offset, len) {
                    Ok((total, bytes)) => {
                        sent.inc_by(bytes.len() as u64);
                        MeshResponse::Chunk {
                            total,
                            version: [0; 32],
                            bytes,
                        }
                    }
                    Err(e) => MeshResponse::Error(format!("{e:#}")),
                })
            }
            Route::Chain(part) => {
                let (state, chain_bytes) = (self.state.clone(), self.metrics.chain_bytes.clone());
                let (g, cfg) = (self.generator.clone(), self.rules.cfg.clone());
                let link = NativeLink::quiet(self.client.clone());
                tokio::spawn(async move {
                    let resp = holder::chain(&link, part, &g, &cfg, |part, before| {
                        chain_bytes.inc_by(before.as_ref().map_or(0, holder::Running::bytes));
                        link.blocking(move || holder::contribute(&read(&state), &part, before))
                    })
                    .await;
                    respond(resp).await;
                });
                return;
            }
        };
        tokio::spawn(async move {
            let resp = tokio::task::spawn_blocking(job)
                .await
                .unwrap_or_else(|e| MeshResponse::Error(e.to_string()));
            respond(resp).await;
        });
    }
}
