//! The browser node: one task owns the swarm and the mesh view; the page holds a handle that
//! sends it commands and reads the latest snapshot.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use futures::channel::{mpsc, oneshot};
use futures::{FutureExt, SinkExt, StreamExt};
use libp2p::swarm::{ConnectionId, SwarmEvent};
use libp2p::{Multiaddr, PeerId, Swarm, gossipsub, identity, request_response};
use node_core::mesh::{
    BrowserBootstrap, HealthConfig, Heartbeat, MeshEvent, MeshInfo, MeshRequest, MeshResponse,
    MeshView, unhex32,
};
use node_core::net::{MeshBehaviour, MeshBehaviourEvent};
use node_core::protocol;
use serde::Serialize;
use wasm_bindgen::JsCast;
use web_time::{Duration, Instant};

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

enum Command {
    Dial {
        addr: Multiaddr,
        reply: Reply<PeerId>,
    },
    Request {
        peer: PeerId,
        request: MeshRequest,
        reply: Reply<MeshResponse>,
    },
    Watch {
        info: Box<MeshInfo>,
    },
}

/// A handle on the browser node; cheap to clone.
#[derive(Clone)]
pub struct BrowserNode {
    commands: mpsc::Sender<Command>,
    shared: Rc<RefCell<Shared>>,
    bootstrap: PeerId,
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
        Self::connect(&origin).await
    }

    /// Starts a node that joins the mesh of the native node serving HTTP at `origin`.
    pub async fn connect(origin: &str) -> Result<Self, WebError> {
        let url = format!("{}/api/bootstrap", origin.trim_end_matches('/'));
        let text = fetch_text(&url).await?;
        let boot: BrowserBootstrap = serde_json::from_str(&text)
            .map_err(|e| fetch_error(&url, &format!("not a bootstrap answer: {e}")))?;
        Self::connect_to(boot).await
    }

    /// Starts a node that dials the native node `boot` describes.
    pub async fn connect_to(boot: BrowserBootstrap) -> Result<Self, WebError> {
        let key = identity::Keypair::generate_ed25519();
        let me = key.public().to_peer_id();
        let swarm = crate::transport::build(key)?;
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
            },
            watchers: Vec::new(),
        }));
        let (tx, rx) = mpsc::channel(64);
        let task = Task {
            swarm,
            commands: rx,
            shared: shared.clone(),
            view: None,
            dials: HashMap::new(),
            requests: HashMap::new(),
        };
        wasm_bindgen_futures::spawn_local(task.run());
        let node = Self {
            commands: tx,
            shared,
            bootstrap,
        };
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
        Shared::set(&node.shared, |s| {
            s.connection = Connection::Connected { via };
            s.info = Some(info.clone());
        });
        node.send(Command::Watch {
            info: Box::new(info),
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

    async fn dial_any(&self, addrs: &[String]) -> Result<String, WebError> {
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

    async fn request(&self, peer: PeerId, request: MeshRequest) -> Result<MeshResponse, WebError> {
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

    async fn send(&self, cmd: Command) -> Result<(), WebError> {
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
    dials: HashMap<ConnectionId, Reply<PeerId>>,
    /// Requests in flight; request-response's own timeout ends each with a failure event.
    requests: HashMap<request_response::OutboundRequestId, Reply<MeshResponse>>,
}

impl Task {
    async fn run(mut self) {
        let mut tick = futures_timer::Delay::new(SNAPSHOT_EVERY).fuse();
        loop {
            futures::select! {
                ev = self.swarm.select_next_some() => self.on_event(ev),
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
        }
    }

    fn on_tick(&mut self) {
        let now = Instant::now();
        let Some(view) = self.view.as_mut() else {
            return;
        };
        view.handle_timeout(now);
        // An observer announces nothing: its heartbeats would list it as a node without a row.
        while view.poll_transmit().is_some() {}
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
        Shared::set(&self.shared, |s| {
            let mut info = info;
            // Show the mesh's nodes; this observer is the page itself.
            info.nodes.retain(|n| n.peer != me);
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
        });
    }

    fn on_command(&mut self, cmd: Command) {
        match cmd {
            Command::Dial { addr, reply } => {
                let opts = libp2p::swarm::dial_opts::DialOpts::unknown_peer_id()
                    .address(addr)
                    .build();
                let id = opts.connection_id();
                match self.swarm.dial(opts) {
                    Ok(()) => {
                        self.dials.insert(id, reply);
                    }
                    Err(e) => {
                        let _ = reply.send(Err(e.to_string()));
                    }
                }
            }
            Command::Request {
                peer,
                request,
                reply,
            } => {
                let id = self.swarm.behaviour_mut().mesh.send_request(&peer, request);
                self.requests.insert(id, reply);
            }
            Command::Watch { info } => match watch_view(&info, *self.swarm.local_peer_id()) {
                Ok(view) => self.view = Some(view),
                Err(e) => {
                    tracing::error!("cannot follow the mesh: {e}");
                    Shared::set(&self.shared, |s| {
                        s.connection = Connection::Failed {
                            reason: e.to_string(),
                        }
                    });
                }
            },
        }
    }

    fn on_event(&mut self, event: SwarmEvent<MeshBehaviourEvent>) {
        match event {
            SwarmEvent::ConnectionEstablished {
                peer_id,
                connection_id,
                ..
            } => {
                if let Some(reply) = self.dials.remove(&connection_id) {
                    let _ = reply.send(Ok(peer_id));
                }
            }
            SwarmEvent::OutgoingConnectionError {
                connection_id,
                error,
                ..
            } => {
                if let Some(reply) = self.dials.remove(&connection_id) {
                    let _ = reply.send(Err(error.to_string()));
                }
            }
            SwarmEvent::Behaviour(MeshBehaviourEvent::Gossipsub(gossipsub::Event::Message {
                message,
                ..
            })) => self.on_gossip(message),
            SwarmEvent::Behaviour(MeshBehaviourEvent::Mesh(event)) => self.on_mesh(event),
            _ => {}
        }
    }

    fn on_gossip(&mut self, message: gossipsub::Message) {
        let bytes = message.data.len() as u64;
        Shared::set_quiet(&self.shared, |s| s.gossip_bytes += bytes);
        // Strict validation drops badly signed messages; one without an author is dropped here.
        let Some(peer) = message.source else {
            return;
        };
        let Some(view) = self.view.as_mut() else {
            return;
        };
        match protocol::decode::<Heartbeat>(&message.data) {
            Ok(hb) => {
                view.handle_heartbeat(Instant::now(), peer, hb);
                Shared::set_quiet(&self.shared, |s| s.heartbeats += 1);
            }
            Err(e) => tracing::warn!(%peer, "bad heartbeat: {e}"),
        }
    }

    fn on_mesh(&mut self, event: request_response::Event<MeshRequest, MeshResponse>) {
        match event {
            request_response::Event::Message {
                message:
                    request_response::Message::Response {
                        request_id,
                        response,
                    },
                ..
            } => {
                if let Some(reply) = self.requests.remove(&request_id) {
                    let _ = reply.send(Ok(response));
                }
            }
            request_response::Event::Message {
                peer,
                message: request_response::Message::Request { channel, .. },
                ..
            } => {
                let answer =
                    MeshResponse::Error("this browser node holds no row: it only watches".into());
                if self
                    .swarm
                    .behaviour_mut()
                    .mesh
                    .send_response(channel, answer)
                    .is_err()
                {
                    tracing::debug!(%peer, "the peer left before the answer");
                }
            }
            request_response::Event::OutboundFailure {
                request_id, error, ..
            } => {
                if let Some(reply) = self.requests.remove(&request_id) {
                    let _ = reply.send(Err(error.to_string()));
                }
            }
            _ => {}
        }
    }
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
        device: "browser (watching)".into(),
    };
    MeshView::new(
        Instant::now(),
        me,
        HealthConfig::default(),
        info.k,
        info.n,
        info.model_name.clone(),
        local,
    )
    .map_err(|e| WebError::Mesh(e.to_string()))
}
