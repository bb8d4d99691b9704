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
use node_core::holder::Route;
use node_core::mesh::{
    BrowserBootstrap, HealthConfig, Heartbeat, MeshEvent, MeshInfo, MeshRequest, MeshResponse,
    MeshView, unhex32,
};
use node_core::net::{Driver, MeshBehaviour, NetEvent, session};
use node_core::protocol::{self, StepRequest};
use serde::Serialize;
use wasm_bindgen::JsCast;
use web_time::{Duration, Instant};

pub(crate) mod holder;
pub(crate) mod leader;
mod task;

use holder::{Contribution, Holding};
use leader::Lead;
use task::Task;

pub use crate::error::WebError;

/// How long one dial may take before the next address is tried.
const DIAL_TIMEOUT: Duration = Duration::from_secs(15);
/// How often the page's snapshot is refreshed (health ages with time, not only on messages).
const SNAPSHOT_EVERY: Duration = Duration::from_millis(500);

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
    /// An update that spread to this node, pulled (or why not).
    Spread(Result<Vec<u8>, String>),
    /// What a catch-up with a peer this node lagged behind brought.
    CaughtUp(Result<holder::CaughtUp, String>),
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
    /// Opens the streams a leader's sessions run on.
    pub(crate) streams: libp2p_stream::Control,
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
        Self::connect(&page_origin()?, Dial::WebSocketFirst).await
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
        let streams = swarm.behaviour().session.new_control();
        let sessions = streams.clone().accept(session::protocol());
        let (tx, rx) = mpsc::channel(64);
        let node = Self {
            commands: tx,
            shared: shared.clone(),
            bootstrap,
            key,
            lead: Rc::default(),
            streams,
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

/// The page's origin (`http://host:port`).
fn page_origin() -> Result<String, WebError> {
    web_sys::window()
        .ok_or_else(|| fetch_error("/", "no window"))?
        .location()
        .origin()
        .map_err(|e| fetch_error("/", &format!("{e:?}")))
}

/// The latest learning updates the native node that served this page applied or refused, and
/// its API's requests trained on by key (its `/api/updates`).
pub async fn page_learning() -> Result<node_core::holder::LearningStatus, WebError> {
    let url = format!("{}/api/updates", page_origin()?.trim_end_matches('/'));
    let text = fetch_text(&url).await?;
    serde_json::from_str(&text)
        .map_err(|e| fetch_error(&url, &format!("not a learning status: {e}")))
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

/// The answer of a browser node that holds no row.
const NO_ROW: &str = "this browser node holds no row: it only watches";

/// Most learning updates a page keeps waiting for its steps to end; past that a peer's are
/// refused (the spread and catch-up bring them again).
const MAX_WAITING_UPDATES: usize = 16;

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
        reach: Default::default(),
        trains: false,
        coord: Default::default(),
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
