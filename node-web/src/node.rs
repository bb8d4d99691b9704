//! The browser node: one task owns the swarm and the mesh view; the page holds a handle that
//! sends it commands and reads the latest snapshot.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;

use futures::channel::{mpsc, oneshot};
use futures::{FutureExt, SinkExt, StreamExt};
use libp2p::multiaddr::Protocol;
use libp2p::request_response::ResponseChannel;
use libp2p::{Multiaddr, PeerId, Swarm, identity};
use node_core::holder::{self, Route};
use node_core::mesh::{
    BrowserBootstrap, HealthConfig, Heartbeat, MeshEvent, MeshInfo, MeshRequest, MeshResponse,
    MeshView, unhex32,
};
use node_core::net::{Driver, MeshBehaviour, NetEvent, session};
use node_core::protocol::{self, StepRequest};
use serde::Serialize;
use wasm_bindgen::JsCast;
use web_time::{Duration, Instant};

use crate::holder::{Contribution, Holding};
use crate::leader::Lead;

/// How long one dial may take before the next address is tried.
const DIAL_TIMEOUT: Duration = Duration::from_secs(15);
/// How often the page's snapshot is refreshed (health ages with time, not only on messages).
const SNAPSHOT_EVERY: Duration = Duration::from_millis(500);

/// Errors of the browser node.
#[derive(Debug, thiserror::Error)]
pub enum WebError {
    /// The swarm could not be built.
    #[error("libp2p transport: {0}")]
    Transport(String),
    /// An HTTP fetch of the page's origin failed.
    #[error("fetching {url}: {reason}")]
    Fetch {
        /// What was fetched.
        url: String,
        /// Why it failed.
        reason: String,
    },
    /// No address of the native node could be dialed.
    #[error("could not dial the native node at any of {addrs:?}: {reason}")]
    Dial {
        /// The addresses tried.
        addrs: Vec<String>,
        /// The last failure.
        reason: String,
    },
    /// A peer answered with an error or something unexpected.
    #[error("the mesh answered: {0}")]
    Mesh(String),
    /// The node's task has stopped.
    #[error("the browser node has stopped")]
    Stopped,
}

/// Which of a native node's addresses a page tries first (the other is the fallback).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Dial {
    /// WebSocket, then WebRTC-direct.
    #[default]
    WebSocketFirst,
    /// WebRTC-direct (no domain certificate needed), then WebSocket.
    WebRtcFirst,
}

impl std::str::FromStr for Dial {
    type Err = WebError;

    fn from_str(s: &str) -> Result<Self, WebError> {
        match s {
            "websocket" => Ok(Self::WebSocketFirst),
            "webrtc-direct" => Ok(Self::WebRtcFirst),
            other => Err(WebError::Mesh(format!(
                "transport {other:?}: expected websocket or webrtc-direct"
            ))),
        }
    }
}

/// The state of the node's link to the mesh.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum Connection {
    /// Dialing the native node that served the page.
    Connecting,
    /// Connected, through this address.
    Connected {
        /// The address that worked.
        via: String,
    },
    /// Every address failed.
    Failed {
        /// Why.
        reason: String,
    },
}

/// What the page shows: the node's link and the mesh as this node sees it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NodeSnapshot {
    /// This browser node's peer id.
    pub peer: String,
    /// Its link to the mesh.
    pub connection: Connection,
    /// The mesh, once known: from the native node's answer first, then from heartbeats.
    pub info: Option<MeshInfo>,
    /// Heartbeats received since the page opened.
    pub heartbeats: u64,
    /// Bytes of gossip received since the page opened.
    pub gossip_bytes: u64,
    /// What this node does for the mesh: watching, or serving a row.
    pub contribution: Contribution,
}

type Watcher = Rc<dyn Fn(&NodeSnapshot)>;

struct Shared {
    snapshot: NodeSnapshot,
    watchers: Vec<Watcher>,
}

impl Shared {
    /// Changes the snapshot and tells every watcher.
    fn set(shared: &RefCell<Shared>, f: impl FnOnce(&mut NodeSnapshot)) {
        let (snapshot, watchers) = {
            let mut s = shared.borrow_mut();
            f(&mut s.snapshot);
            (s.snapshot.clone(), s.watchers.clone())
        };
        for w in watchers {
            w(&snapshot);
        }
    }

    /// Changes the snapshot without telling the watchers (the next tick does).
    fn set_quiet(shared: &RefCell<Shared>, f: impl FnOnce(&mut NodeSnapshot)) {
        f(&mut shared.borrow_mut().snapshot);
    }
}

type Reply<T> = oneshot::Sender<Result<T, String>>;

pub(crate) enum Command {
    Dial {
        addr: Multiaddr,
        reply: Reply<PeerId>,
    },
    Request {
        peer: PeerId,
        request: MeshRequest,
        reply: Reply<MeshResponse>,
    },
    /// Where a peer can be dialed when a request needs a connection.
    AddAddrs { peer: PeerId, addrs: Vec<Multiaddr> },
    Watch {
        info: Box<MeshInfo>,
        /// The native node's address: the relay this node listens through once it holds a row.
        via: Multiaddr,
    },
    /// Serve this row from now on.
    Hold(Box<Holding>),
    /// A computed answer to an inbound request or a session's ask.
    Respond {
        to: AnswerTo,
        response: MeshResponse,
    },
    /// What a catch-up with a peer this node lagged behind brought.
    CaughtUp(Result<crate::holder::CaughtUp, String>),
    /// The row rebuilt at a peer's version (the peer folded updates this node lacked).
    Rebuilt(Result<Box<node_core::holder::Joined>, String>),
    /// A step asked on a leader's session.
    Step {
        version: [u8; 32],
        request: StepRequest,
        reply: oneshot::Sender<MeshResponse>,
    },
}

/// Where a computed answer goes.
pub(crate) enum AnswerTo {
    /// The peer waiting on a request.
    Request(ResponseChannel<MeshResponse>),
    /// A leader's session (which writes it in order).
    Session(oneshot::Sender<MeshResponse>),
}

/// A handle on the browser node; cheap to clone.
#[derive(Clone)]
pub struct BrowserNode {
    commands: mpsc::Sender<Command>,
    shared: Rc<RefCell<Shared>>,
    bootstrap: PeerId,
    /// This node's identity: it signs the learning updates of the requests it leads.
    pub(crate) key: identity::Keypair,
    /// What the page's leader keeps between requests.
    pub(crate) lead: Rc<RefCell<Lead>>,
}

impl std::fmt::Debug for BrowserNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BrowserNode")
            .field("snapshot", &self.shared.borrow().snapshot)
            .finish()
    }
}

impl BrowserNode {
    /// Starts a node that joins the mesh of the native node that served this page.
    pub async fn start_from_page() -> Result<Self, WebError> {
        let origin = web_sys::window()
            .ok_or_else(|| fetch_error("/", "no window"))?
            .location()
            .origin()
            .map_err(|e| fetch_error("/", &format!("{e:?}")))?;
        Self::connect(&origin, Dial::WebSocketFirst).await
    }

    /// Starts a node that joins the mesh of the native node serving HTTP at `origin`,
    /// trying its addresses in the order `dial` says.
    pub async fn connect(origin: &str, dial: Dial) -> Result<Self, WebError> {
        let url = format!("{}/api/bootstrap", origin.trim_end_matches('/'));
        let text = fetch_text(&url).await?;
        let boot: BrowserBootstrap = serde_json::from_str(&text)
            .map_err(|e| fetch_error(&url, &format!("not a bootstrap answer: {e}")))?;
        Self::connect_to(match dial {
            Dial::WebSocketFirst => boot,
            Dial::WebRtcFirst => boot.webrtc_first(),
        })
        .await
    }

    /// Starts a node that dials the native node `boot` describes, with this browser's
    /// identity (kept in localStorage).
    pub async fn connect_to(boot: BrowserBootstrap) -> Result<Self, WebError> {
        let key = crate::store::identity().unwrap_or_else(|e| {
            tracing::warn!("a new identity for this page only: {e}");
            identity::Keypair::generate_ed25519()
        });
        let me = key.public().to_peer_id();
        let swarm = crate::transport::build(key.clone())?;
        let bootstrap: PeerId = boot
            .peer
            .parse()
            .map_err(|e| WebError::Mesh(format!("peer id {:?}: {e}", boot.peer)))?;
        let shared = Rc::new(RefCell::new(Shared {
            snapshot: NodeSnapshot {
                peer: me.to_string(),
                connection: Connection::Connecting,
                info: None,
                heartbeats: 0,
                gossip_bytes: 0,
                contribution: Contribution::Watching,
            },
            watchers: Vec::new(),
        }));
        let sessions = swarm
            .behaviour()
            .session
            .new_control()
            .accept(session::protocol());
        let (tx, rx) = mpsc::channel(64);
        let node = Self {
            commands: tx,
            shared: shared.clone(),
            bootstrap,
            key,
            lead: Rc::default(),
        };
        let task = Task {
            swarm,
            commands: rx,
            shared,
            view: None,
            driver: Driver::new(false),
            node: node.clone(),
            relay: None,
            holding: None,
            circuits: Vec::new(),
            learning: VecDeque::new(),
        };
        wasm_bindgen_futures::spawn_local(task.run());
        match sessions {
            Ok(incoming) => {
                wasm_bindgen_futures::spawn_local(serve_sessions(node.clone(), incoming))
            }
            Err(e) => tracing::warn!("leaders will ask a request a step: {e}"),
        }
        let via = node.dial_any(&boot.addrs).await;
        let via = match via {
            Ok(via) => via,
            Err(e) => {
                let reason = e.to_string();
                Shared::set(&node.shared, |s| {
                    s.connection = Connection::Failed { reason }
                });
                return Err(e);
            }
        };
        tracing::info!(%via, "connected to the mesh");
        let info = match node.request(bootstrap, MeshRequest::Info).await? {
            MeshResponse::Info(info) => info,
            MeshResponse::Error(e) => return Err(WebError::Mesh(e)),
            _ => {
                return Err(WebError::Mesh(
                    "asked for the mesh's status, got something else".into(),
                ));
            }
        };
        let relay = with_peer(
            via.parse()
                .map_err(|e| WebError::Mesh(format!("{via}: {e}")))?,
            bootstrap,
        );
        Shared::set(&node.shared, |s| {
            s.connection = Connection::Connected { via };
            s.info = Some(info.clone());
        });
        node.send(Command::Watch {
            info: Box::new(info),
            via: relay,
        })
        .await?;
        Ok(node)
    }

    /// The latest snapshot.
    pub fn snapshot(&self) -> NodeSnapshot {
        self.shared.borrow().snapshot.clone()
    }

    /// Calls `f` with every new snapshot (about twice a second, and on every change).
    pub fn on_change(&self, f: impl Fn(&NodeSnapshot) + 'static) {
        self.shared.borrow_mut().watchers.push(Rc::new(f));
    }

    /// Asks the native node this node dialed first.
    pub async fn ask_bootstrap(&self, request: MeshRequest) -> Result<MeshResponse, WebError> {
        self.request(self.bootstrap, request).await
    }

    /// The native node this node dialed first.
    pub(crate) fn bootstrap(&self) -> PeerId {
        self.bootstrap
    }

    /// Shows what the node does for the mesh.
    pub(crate) fn set_contribution(&self, c: Contribution) {
        Shared::set(&self.shared, |s| s.contribution = c);
    }

    /// Hands a row to the node's task, which announces and serves it.
    pub(crate) async fn hold(&self, holding: Holding) -> Result<(), WebError> {
        self.set_contribution(Contribution::Preparing {
            what: format!(
                "row {} is ready; reserving a slot on the relay",
                holding.row
            ),
            done: 0,
            total: 0,
        });
        self.send(Command::Hold(Box::new(holding))).await
    }

    pub(crate) async fn dial_any(&self, addrs: &[String]) -> Result<String, WebError> {
        let mut reason = "the node offers no address a browser can dial".to_string();
        for a in addrs {
            let addr: Multiaddr = match a.parse() {
                Ok(addr) => addr,
                Err(e) => {
                    reason = format!("{a}: {e}");
                    continue;
                }
            };
            let (reply, rx) = oneshot::channel();
            self.send(Command::Dial { addr, reply }).await?;
            let timeout = futures_timer::Delay::new(DIAL_TIMEOUT).fuse();
            futures::pin_mut!(timeout);
            let mut rx = rx.fuse();
            futures::select! {
                r = rx => match r {
                    Ok(Ok(_)) => return Ok(a.clone()),
                    Ok(Err(e)) => reason = format!("{a}: {e}"),
                    Err(_) => return Err(WebError::Stopped),
                },
                _ = timeout => reason = format!("{a}: no connection after {DIAL_TIMEOUT:?}"),
            }
            tracing::warn!("{reason}");
        }
        Err(WebError::Dial {
            addrs: addrs.to_vec(),
            reason,
        })
    }

    pub(crate) async fn request(
        &self,
        peer: PeerId,
        request: MeshRequest,
    ) -> Result<MeshResponse, WebError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Request {
            peer,
            request,
            reply,
        })
        .await?;
        match rx.await {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(e)) => Err(WebError::Mesh(e)),
            Err(_) => Err(WebError::Stopped),
        }
    }

    /// A step asked on a session, answered by the row this node holds (an error if none).
    async fn step(&self, version: [u8; 32], request: StepRequest) -> MeshResponse {
        let (reply, rx) = oneshot::channel();
        if self
            .send(Command::Step {
                version,
                request,
                reply,
            })
            .await
            .is_err()
        {
            return MeshResponse::Error(WebError::Stopped.to_string());
        }
        rx.await
            .unwrap_or_else(|_| MeshResponse::Error(WebError::Stopped.to_string()))
    }

    pub(crate) async fn send(&self, cmd: Command) -> Result<(), WebError> {
        self.commands
            .clone()
            .send(cmd)
            .await
            .map_err(|_| WebError::Stopped)
    }
}

fn fetch_error(url: &str, reason: &str) -> WebError {
    WebError::Fetch {
        url: url.to_string(),
        reason: reason.to_string(),
    }
}

/// GETs `url` and returns its body as text.
async fn fetch_text(url: &str) -> Result<String, WebError> {
    let window = web_sys::window().ok_or_else(|| fetch_error(url, "no window"))?;
    let resp = wasm_bindgen_futures::JsFuture::from(window.fetch_with_str(url))
        .await
        .map_err(|e| fetch_error(url, &format!("{e:?}")))?;
    let resp: web_sys::Response = resp
        .dyn_into()
        .map_err(|_| fetch_error(url, "not a response"))?;
    if !resp.ok() {
        return Err(fetch_error(url, &format!("HTTP {}", resp.status())));
    }
    let text = resp
        .text()
        .map_err(|e| fetch_error(url, &format!("{e:?}")))?;
    let text = wasm_bindgen_futures::JsFuture::from(text)
        .await
        .map_err(|e| fetch_error(url, &format!("{e:?}")))?;
    text.as_string()
        .ok_or_else(|| fetch_error(url, "the body is not text"))
}

/// The task that owns the swarm.
struct Task {
    swarm: Swarm<MeshBehaviour>,
    commands: mpsc::Receiver<Command>,
    shared: Rc<RefCell<Shared>>,
    view: Option<MeshView<PeerId>>,
    /// Dials and requests in flight (request-response's own timeout ends each request).
    driver: Driver,
    /// A handle on this node, for the work the task starts (steps, catch-ups).
    node: BrowserNode,
    /// The native node this node listens through once it holds a row.
    relay: Option<Multiaddr>,
    /// The row this node serves, once it contributes.
    holding: Option<Holding>,
    /// Relayed addresses peers reach this node at.
    circuits: Vec<String>,
    /// Updates waiting until no step uses the shard, with the leader waiting for each.
    learning: VecDeque<(Vec<u8>, Option<ResponseChannel<MeshResponse>>)>,
}

impl Task {
    async fn run(mut self) {
        let mut tick = futures_timer::Delay::new(SNAPSHOT_EVERY).fuse();
        loop {
            futures::select! {
                ev = self.swarm.select_next_some() => {
                    if let Some(ev) = self.driver.on_event(&mut self.swarm, ev) {
                        self.on_net(ev);
                    }
                }
                cmd = self.commands.next() => match cmd {
                    Some(cmd) => self.on_command(cmd),
                    // Every handle is gone: the page dropped the node.
                    None => return,
                },
                _ = tick => {
                    tick = futures_timer::Delay::new(SNAPSHOT_EVERY).fuse();
                    self.on_tick();
                }
            }
            self.apply_learning();
        }
    }

    fn on_tick(&mut self) {
        let now = Instant::now();
        let Some(view) = self.view.as_mut() else {
            return;
        };
        view.handle_timeout(now);
        while let Some(hb) = view.poll_transmit() {
            // An observer announces nothing: its heartbeats would list it as a node without a
            // row. A holder announces its row once peers can reach it through its relay.
            if hb.row.is_none() {
                continue;
            }
            match protocol::encode(&hb) {
                Ok(data) => self.driver.publish(&mut self.swarm, data),
                Err(e) => tracing::debug!("heartbeat not sent: {e}"),
            }
        }
        while let Some(ev) = view.poll_event() {
            match ev {
                MeshEvent::HealthChanged { peer, row, health } => {
                    tracing::info!(%peer, ?row, %health, "health changed");
                }
                MeshEvent::Refused { peer, error } => tracing::warn!(%peer, "{error}"),
                MeshEvent::Discovered { peer, .. } => tracing::debug!(%peer, "discovered"),
            }
        }
        let info = view.info(now);
        let me = view.me().to_string();
        let contribution = self
            .holding
            .as_ref()
            .map(|h| match self.circuits.is_empty() {
                true => Contribution::Preparing {
                    what: format!("row {} is ready; reserving a slot on the relay", h.row),
                    done: 0,
                    total: 0,
                },
                false => h.contribution(),
            });
        Shared::set(&self.shared, |s| {
            let mut info = info;
            // Show the mesh's nodes; a watching page is not one of them.
            if contribution.is_none() {
                info.nodes.retain(|n| n.peer != me);
            }
            if let Some(old) = &s.info {
                info.dashboard = old.dashboard.clone();
                // Evidence of caught nodes reaches the node a leader reports to; keep what
                // the native node told us.
                for n in &mut info.nodes {
                    if n.caught.is_none() {
                        n.caught = old
                            .nodes
                            .iter()
                            .find(|o| o.peer == n.peer)
                            .and_then(|o| o.caught.clone());
                    }
                }
            }
            s.info = Some(info);
            if let Some(c) = contribution {
                s.contribution = c;
            }
        });
    }

    /// Announces the row, version and addresses this node holds now.
    fn announce(&mut self) {
        let (Some(view), Some(h)) = (self.view.as_mut(), self.holding.as_ref()) else {
            return;
        };
        let mut local = view.local().clone();
        // A row nobody can reach would only fail the leaders that pick it.
        local.row = (!self.circuits.is_empty()).then_some(h.row);
        local.version_count = h.state.version.count();
        local.version_digest = h.state.version.digest();
        local.addrs = self.circuits.clone();
        local.device = h.device.clone();
        view.set_local(local);
        view.handle_timeout(Instant::now());
    }

    fn on_command(&mut self, cmd: Command) {
        match cmd {
            Command::Dial { addr, reply } => self.driver.dial(
                &mut self.swarm,
                addr,
                Box::new(move |r| {
                    let _ = reply.send(r);
                }),
            ),
            Command::Request {
                peer,
                request,
                reply,
            } => self.driver.request(
                &mut self.swarm,
                peer,
                request,
                Box::new(move |r| {
                    let _ = reply.send(r);
                }),
            ),
            Command::AddAddrs { peer, addrs } => {
                self.driver.add_addrs(&mut self.swarm, peer, addrs)
            }
            Command::Watch { info, via } => match watch_view(&info, *self.swarm.local_peer_id()) {
                Ok(view) => {
                    self.view = Some(view);
                    self.relay = Some(via);
                }
                Err(e) => {
                    tracing::error!("cannot follow the mesh: {e}");
                    Shared::set(&self.shared, |s| {
                        s.connection = Connection::Failed {
                            reason: e.to_string(),
                        }
                    });
                }
            },
            Command::Hold(holding) => self.hold(*holding),
            Command::Respond { to, response } => {
                if let Some(h) = self.holding.as_mut() {
                    h.answered(&response);
                }
                match to {
                    AnswerTo::Request(channel) => self.respond(channel, response),
                    AnswerTo::Session(reply) => {
                        let _ = reply.send(response);
                    }
                }
            }
            Command::Step {
                version,
                request,
                reply,
            } => {
                let Some(h) = self.holding.as_mut() else {
                    let _ = reply.send(MeshResponse::Error(NO_ROW.into()));
                    return;
                };
                let work = h.step(version, request);
                respond_later(self.node.clone(), AnswerTo::Session(reply), work)
            }
            Command::CaughtUp(got) => {
                let behind = match got {
                    Ok(crate::holder::CaughtUp::Updates(updates)) => {
                        self.learning
                            .extend(updates.into_iter().map(|bytes| (bytes, None)));
                        None
                    }
                    Ok(crate::holder::CaughtUp::Behind(version)) => Some(version),
                    Err(e) => {
                        tracing::warn!("catching up: {e}");
                        None
                    }
                };
                match behind {
                    Some(version) => self.rebuild(version),
                    None => {
                        if let Some(h) = self.holding.as_mut() {
                            h.syncing = false;
                        }
                    }
                }
            }
            Command::Rebuilt(got) => {
                if let Some(h) = self.holding.as_mut() {
                    h.syncing = false;
                    match got {
                        Ok(joined) => h.rebuilt = Some(*joined),
                        Err(e) => tracing::warn!("rebuilding the row: {e}"),
                    }
                }
                self.apply_learning();
            }
        }
    }

    /// Starts serving a row: listens through the relay and announces it.
    fn hold(&mut self, holding: Holding) {
        let listening = match self.relay.clone() {
            None => Err("not connected to the mesh".to_string()),
            Some(relay) => {
                let circuit = relay.with(Protocol::P2pCircuit);
                self.swarm
                    .listen_on(circuit.clone())
                    .map(drop)
                    .map_err(|e| format!("listening through the relay {circuit}: {e}"))
            }
        };
        match listening {
            Ok(()) => {
                self.holding = Some(holding);
                self.announce();
            }
            Err(reason) => Shared::set(&self.shared, |s| {
                s.contribution = Contribution::Failed { reason }
            }),
        }
    }

    fn respond(&mut self, channel: ResponseChannel<MeshResponse>, response: MeshResponse) {
        Driver::respond(&mut self.swarm, channel, response)
    }

    /// Rebuilds the row at `version`, which a peer is at and which the updates it keeps cannot
    /// reach: a copy from another holder of the row, else along a chain of k rows.
    fn rebuild(&mut self, version: [u8; 32]) {
        let (Some(view), Some(h)) = (self.view.as_ref(), self.holding.as_mut()) else {
            return;
        };
        let offer = view.rebuild_offer(version);
        if offer == node_core::mesh::JoinOffer::Full {
            tracing::info!("behind what the mesh keeps, and no holders at its version yet");
            h.syncing = false;
            return;
        }
        tracing::info!(
            row = h.row,
            "behind what the peers keep: rebuilding the row"
        );
        let node = self.node.clone();
        let manifest = h.manifest.clone();
        wasm_bindgen_futures::spawn_local(async move {
            let boot = node.bootstrap();
            let got = holder::obtain(&node, &boot, &manifest, offer)
                .await
                .map(Box::new)
                .map_err(|e| e.to_string());
            let _ = node.send(Command::Rebuilt(got)).await;
        });
    }

    /// Applies waiting updates (and a rebuilt row) while no step uses the shard, then folds
    /// the kept updates into a snapshot when they are due.
    fn apply_learning(&mut self) {
        let Some(h) = self.holding.as_mut() else {
            self.learning.clear();
            return;
        };
        let mut changed = false;
        if let Some(save) = h.take_rebuilt() {
            wasm_bindgen_futures::spawn_local(save);
            changed = true;
        }
        let mut receipts = Vec::new();
        while let Some((bytes, channel)) = self.learning.pop_front() {
            let answer = match h.learn(&bytes) {
                Ok(None) => {
                    self.learning.push_front((bytes, channel));
                    break;
                }
                Ok(Some((id, applied))) => {
                    if applied {
                        tracing::info!(id = format!("{id:016x}"), "applied an update");
                        changed = true;
                    }
                    MeshResponse::Learned {
                        id,
                        version_count: h.state.version.count(),
                    }
                }
                Err(e) => {
                    tracing::warn!("refused an update: {e}");
                    MeshResponse::Error(e.to_string())
                }
            };
            if let Some(channel) = channel {
                receipts.push((channel, answer));
            }
        }
        if changed && let Some(save) = h.fold_if_due() {
            wasm_bindgen_futures::spawn_local(save);
        }
        for (channel, answer) in receipts {
            self.respond(channel, answer);
        }
        if changed {
            self.announce();
        }
    }

    fn on_net(&mut self, event: NetEvent) {
        match event {
            NetEvent::Listening(address) => {
                tracing::info!(%address, "reachable through the relay");
                let me = *self.swarm.local_peer_id();
                self.circuits.push(with_peer(address, me).to_string());
                self.announce();
            }
            NetEvent::Expired(address) => {
                let me = *self.swarm.local_peer_id();
                let gone = with_peer(address, me).to_string();
                self.circuits.retain(|a| *a != gone);
                self.announce();
            }
            NetEvent::Gossip { peer, data } => self.on_gossip(peer, &data),
            NetEvent::Request {
                peer,
                request,
                channel,
            } => self.on_request(peer, request, channel),
        }
    }

    fn on_gossip(&mut self, peer: PeerId, data: &[u8]) {
        let bytes = data.len() as u64;
        Shared::set_quiet(&self.shared, |s| s.gossip_bytes += bytes);
        match protocol::decode::<Heartbeat>(data) {
            Ok(hb) => {
                self.maybe_sync(peer, &hb);
                let Some(view) = self.view.as_mut() else {
                    return;
                };
                view.handle_heartbeat(Instant::now(), peer, hb);
                Shared::set_quiet(&self.shared, |s| s.heartbeats += 1);
            }
            Err(e) => tracing::warn!(%peer, "bad heartbeat: {e}"),
        }
    }

    /// A peer announces updates this node's row lacks: fetch them from it.
    fn maybe_sync(&mut self, peer: PeerId, hb: &Heartbeat) {
        let (Some(view), Some(h)) = (self.view.as_ref(), self.holding.as_mut()) else {
            return;
        };
        if h.syncing || !holder::worth_catching_up(view.local(), hb) {
            return;
        }
        h.syncing = true;
        let (node, have) = (self.node.clone(), h.state.version.clone());
        wasm_bindgen_futures::spawn_local(async move {
            let got = node.catch_up(peer, &have).await.map_err(|e| e.to_string());
            let _ = node.send(Command::CaughtUp(got)).await;
        });
    }

    fn on_request(
        &mut self,
        peer: PeerId,
        request: MeshRequest,
        channel: ResponseChannel<MeshResponse>,
    ) {
        let now = Instant::now();
        let (Some(view), Some(h)) = (self.view.as_mut(), self.holding.as_mut()) else {
            return self.respond(channel, MeshResponse::Error(NO_ROW.into()));
        };
        match h.route(&peer, request) {
            Route::Answer(response) => self.respond(channel, response),
            Route::View(query) => {
                let response = holder::answer_view(view, &peer, query, now);
                self.respond(channel, response)
            }
            Route::Learn(bytes) => self.learning.push_back((bytes, Some(channel))),
            Route::ShardPiece { offset, len } => {
                let response = h.snapshot.piece(&h.state, offset, len);
                self.respond(channel, response)
            }
            Route::UpdatePiece { id, offset, len } => {
                let response = h.update_piece(id, offset, len);
                self.respond(channel, response)
            }
            Route::Step { version, request } => {
                let work = h.step(version, request);
                respond_later(self.node.clone(), AnswerTo::Request(channel), work)
            }
            Route::Chain(part) => {
                let (node, state) = (self.node.clone(), h.state.clone());
                let work = async move { node.chain_piece(state, part).await };
                respond_later(self.node.clone(), AnswerTo::Request(channel), work)
            }
        }
    }
}

/// The answer of a browser node that holds no row.
const NO_ROW: &str = "this browser node holds no row: it only watches";

/// Answers the steps of every leader that opens a session with this node
/// ([`node_core::net::session`]), through the node's task, in order per session.
async fn serve_sessions(node: BrowserNode, mut incoming: libp2p_stream::IncomingStreams) {
    while let Some((peer, stream)) = incoming.next().await {
        let node = node.clone();
        wasm_bindgen_futures::spawn_local(async move {
            let (reader, mut writer) = futures::AsyncReadExt::split(stream);
            if let Err(e) = session::accepted(&mut writer).await {
                tracing::debug!(%peer, "session ended: {e}");
                return;
            }
            let served = session::serve(reader, writer, |version, request| {
                let node = node.clone();
                async move { node.step(version, request).await }
            })
            .await;
            if let Err(e) = served {
                tracing::debug!(%peer, "session ended: {e}");
            }
        });
    }
}

/// Runs `work` and sends its answer where it goes, through the node's task (which counts it).
fn respond_later(
    node: BrowserNode,
    to: AnswerTo,
    work: impl std::future::Future<Output = MeshResponse> + 'static,
) {
    wasm_bindgen_futures::spawn_local(async move {
        let response = work.await;
        let _ = node.send(Command::Respond { to, response }).await;
    })
}

/// `addr` ending in `/p2p/peer`.
fn with_peer(addr: Multiaddr, peer: PeerId) -> Multiaddr {
    match addr.iter().last() {
        Some(Protocol::P2p(_)) => addr,
        _ => addr.with(Protocol::P2p(peer)),
    }
}

/// This browser's health timing: it heartbeats as often as the mesh's native node does (at
/// most every 100 ms, at least every second), since a browser that announced itself more
/// slowly than the mesh expects would be seen Suspect between two heartbeats and left out of
/// groups; it judges its peers with the default, lenient, timeouts.
fn mesh_health(told: &HealthConfig) -> HealthConfig {
    let mut cfg = HealthConfig::default();
    if told.validate().is_ok() {
        cfg.heartbeat_interval = told
            .heartbeat_interval
            .clamp(Duration::from_millis(100), cfg.heartbeat_interval);
    }
    cfg
}

/// A view that follows the mesh `info` describes, as an observer holding no row.
fn watch_view(info: &MeshInfo, me: PeerId) -> Result<MeshView<PeerId>, WebError> {
    let model = unhex32(&info.model).ok_or_else(|| {
        WebError::Mesh(format!(
            "model digest {:?} is not 64 hex digits",
            info.model
        ))
    })?;
    let local = Heartbeat {
        model,
        row: None,
        version_count: 0,
        version_digest: [0; 32],
        addrs: Vec::new(),
        offers: Vec::new(),
        incarnation: js_sys::Date::now() as u64,
        seq: 0,
        uptime_ms: 0,
        device: "browser (watching)".into(),
        usage: Default::default(),
    };
    MeshView::new(
        Instant::now(),
        me,
        mesh_health(&info.health),
        info.k,
        // The rows that exist now stand for the genesis rows: the browser only watches.
        (info.n.max(info.k), info.n_max.max(info.n).max(info.k)),
        info.model_name.clone(),
        local,
    )
    .map_err(|e| WebError::Mesh(e.to_string()))
}
