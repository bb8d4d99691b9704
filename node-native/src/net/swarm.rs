//! The task that owns the libp2p swarm, and the cloneable client every other part talks to it
//! through (bounded channels; answers come back on oneshots, errors included).

use std::collections::HashMap;
use std::sync::PoisonError;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use futures::StreamExt;
use libp2p::core::Transport as _;
use libp2p::core::muxing::StreamMuxerBox;
use libp2p::identity::Keypair;
use libp2p::multiaddr::Protocol;
use libp2p::request_response::ResponseChannel;
use libp2p::{Multiaddr, PeerId, StreamProtocol, Swarm, noise, tcp, yamux};
use libp2p_stream::OpenStreamError;
use node_core::mesh::{MeshRequest, MeshResponse};
use node_core::net::reach::{Path, is_loopback, is_relayed};
use node_core::net::{Driver, MeshBehaviour, NetEvent, session};
use tokio::sync::{mpsc, oneshot};

/// How the swarm is built.
#[derive(Debug)]
pub struct NetConfig {
    /// The node's identity.
    pub key: Keypair,
    /// Certificate for WebRTC-direct (listening on it needs one).
    pub webrtc: Option<libp2p_webrtc::tokio::Certificate>,
    /// Addresses to listen on.
    pub listen: Vec<Multiaddr>,
    /// Discover peers with mDNS.
    pub mdns: bool,
    /// A probe ([`crate::net::probe`]): it dials only what it is told to.
    pub probe: bool,
}

/// Something the network hands to the node: a request or a heartbeat (the swarm task keeps
/// listen addresses to itself).
pub type Inbound = NetEvent;

/// Where the answer to an outbound request goes.
type Reply = node_core::net::Reply<MeshResponse>;

enum Command {
    Dial {
        addr: Multiaddr,
        reply: oneshot::Sender<Result<PeerId, String>>,
    },
    AddAddrs {
        peer: PeerId,
        addrs: Vec<Multiaddr>,
    },
    Request {
        peer: PeerId,
        request: MeshRequest,
        reply: Reply,
    },
    Respond {
        channel: ResponseChannel<MeshResponse>,
        response: MeshResponse,
    },
    Publish {
        data: Vec<u8>,
    },
    ListenAddrs {
        reply: oneshot::Sender<Vec<Multiaddr>>,
    },
    Connections {
        reply: oneshot::Sender<Vec<(PeerId, Path)>>,
    },
}

/// A handle on the swarm task.
#[derive(Clone)]
pub struct Client {
    tx: mpsc::Sender<Command>,
    peer_id: PeerId,
    /// The last round trip pinged to each connected peer.
    rtts: RoundTrips,
    /// Opens and accepts session streams without the swarm task.
    control: libp2p_stream::Control,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("peer_id", &self.peer_id)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Command::Dial { .. } => "Dial",
            Command::AddAddrs { .. } => "AddAddrs",
            Command::Request { .. } => "Request",
            Command::Respond { .. } => "Respond",
            Command::Publish { .. } => "Publish",
            Command::ListenAddrs { .. } => "ListenAddrs",
            Command::Connections { .. } => "Connections",
        })
    }
}

const GONE: &str = "the network task has stopped";

impl Client {
    /// This node's peer id.
    pub fn peer_id(&self) -> PeerId {
        self.peer_id
    }

    async fn send(&self, cmd: Command) -> Result<()> {
        self.tx.send(cmd).await.map_err(|_| anyhow!(GONE))
    }

    /// The round trip last pinged to `peer`, waiting up to `wait` for a first one (a ping
    /// starts as soon as a connection opens).
    pub async fn round_trip(&self, peer: PeerId, wait: Duration) -> Option<Duration> {
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let rtt = (self.rtts.lock().unwrap_or_else(PoisonError::into_inner))
                .get(&peer)
                .copied();
            if rtt.is_some() || tokio::time::Instant::now() >= deadline {
                return rtt;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Opens and accepts the streams of group sessions ([`crate::hold::session`]).
    pub fn control(&self) -> libp2p_stream::Control {
        self.control.clone()
    }

    /// Dials an address (with or without `/p2p/…`) and returns the peer reached.
    pub async fn dial(&self, addr: Multiaddr) -> Result<PeerId> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Dial {
            addr: addr.clone(),
            reply,
        })
        .await?;
        rx.await
            .map_err(|_| anyhow!(GONE))?
            .map_err(|e| anyhow!("dialing {addr}: {e}"))
    }

    /// Dials `peer` at each address in turn until one connects (at once if it is connected).
    pub async fn dial_any(&self, peer: PeerId, addrs: &[Multiaddr]) -> Result<PeerId> {
        let mut why = Vec::new();
        for a in addrs {
            match self.dial(with_peer(a, peer)).await {
                Ok(p) => return Ok(p),
                Err(e) => why.push(format!("{e:#}")),
            }
        }
        if why.is_empty() {
            bail!("no address to dial {peer} at");
        }
        bail!("{}", why.join("; "))
    }

    /// Remembers addresses of a peer for later requests.
    pub async fn add_addrs(&self, peer: PeerId, addrs: Vec<Multiaddr>) -> Result<()> {
        self.send(Command::AddAddrs { peer, addrs }).await
    }

    /// Sends a request and waits for its answer.
    pub async fn request(&self, peer: PeerId, request: MeshRequest) -> Result<MeshResponse> {
        let (tx, rx) = oneshot::channel();
        self.send(Command::Request {
            peer,
            request,
            reply: Box::new(move |r| {
                let _ = tx.send(r);
            }),
        })
        .await?;
        rx.await
            .map_err(|_| anyhow!(GONE))?
            .map_err(|e| anyhow!("request to {peer}: {e}"))
    }

    /// Answers an inbound request.
    pub async fn respond(&self, channel: ResponseChannel<MeshResponse>, response: MeshResponse) {
        let _ = self.send(Command::Respond { channel, response }).await;
    }

    /// Publishes a heartbeat.
    pub async fn publish(&self, data: Vec<u8>) -> Result<()> {
        self.send(Command::Publish { data }).await
    }

    /// Each open connection's peer and path.
    pub async fn connections(&self) -> Result<Vec<(PeerId, Path)>> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Connections { reply }).await?;
        rx.await.map_err(|_| anyhow!(GONE))
    }

    /// Addresses the swarm listens on now.
    pub async fn listen_addrs(&self) -> Result<Vec<Multiaddr>> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::ListenAddrs { reply }).await?;
        rx.await.map_err(|_| anyhow!(GONE))
    }
}

/// Builds the swarm: TCP and WebSocket (noise, yamux), QUIC, WebRTC-direct; DNS for names.
pub async fn build(cfg: NetConfig) -> Result<Swarm<MeshBehaviour>> {
    // WebRTC's DTLS uses rustls; without a process-wide provider it panics on first use.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let (mdns, probe) = (cfg.mdns, cfg.probe);
    let webrtc = cfg.webrtc;
    let relays = !cfg.listen.is_empty();
    let swarm = libp2p::SwarmBuilder::with_existing_identity(cfg.key)
        .with_tokio()
        .with_tcp(
            tcp::Config::default().nodelay(true),
            noise::Config::new,
            yamux::Config::default,
        )?
        .with_quic()
        .with_other_transport(|key| match webrtc {
            Some(cert) => libp2p::core::transport::OptionalTransport::some(
                libp2p_webrtc::tokio::Transport::new(key.clone(), cert)
                    .map(|(peer, conn), _| (peer, StreamMuxerBox::new(conn))),
            ),
            None => libp2p::core::transport::OptionalTransport::none(),
        })?
        .with_dns()?
        .with_websocket(noise::Config::new, yamux::Config::default)
        .await?
        .with_relay_client(noise::Config::new, yamux::Config::default)?
        .with_behaviour(|key, relay_client| {
            let b = if probe {
                MeshBehaviour::for_probe(key)
            } else {
                MeshBehaviour::new(key, mdns)
                    .map(|b| b.with_nat_traversal(key.public().to_peer_id()))
            }
            .map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)?
            .with_relay_client(relay_client);
            // Nodes relay for browsers; a leader that listens nowhere relays nothing.
            Ok(if relays && !probe {
                b.with_relay_server(key.public().to_peer_id())
            } else {
                b
            })
        })?
        .with_swarm_config(|c| c.with_idle_connection_timeout(Duration::from_secs(600)))
        .build();
    let mut swarm = swarm;
    for addr in cfg.listen {
        swarm
            .listen_on(addr.clone())
            .with_context(|| format!("listening on {addr}"))?;
    }
    Ok(swarm)
}

/// Starts the swarm task; returns its client and the stream of inbound messages.
pub fn spawn(swarm: Swarm<MeshBehaviour>) -> (Client, mpsc::Receiver<Inbound>) {
    let (tx, rx) = mpsc::channel(256);
    let (in_tx, in_rx) = mpsc::channel(1024);
    let rtts = RoundTrips::default();
    let client = Client {
        tx,
        peer_id: *swarm.local_peer_id(),
        rtts: rtts.clone(),
        control: swarm.behaviour().session.new_control(),
    };
    // A probe's behaviour has no AutoNAT client (MeshBehaviour::for_probe).
    let probe = !swarm.behaviour().autonat.is_enabled();
    let mut events = EventLoop::new(probe, swarm, rx, in_tx);
    events.rtts = rtts;
    tokio::spawn(events.run());
    (client, in_rx)
}

/// The last round trip pinged to each peer, shared by the swarm task and its clients.
type RoundTrips = std::sync::Arc<std::sync::Mutex<HashMap<PeerId, Duration>>>;

/// Most peers whose round trips a node keeps (the oldest are not told apart: all go).
const MAX_ROUND_TRIPS: usize = 4096;

/// The environment variable that sets [`one_way_delay`] for a process (the nodes
/// `codedmesh bench --mesh --one-way-delay-ms` starts).
pub const DELAY_VAR: &str = "CODEDMESH_BENCH_ONE_WAY_DELAY_MS";

/// Microseconds of the delay set in this process; `u64::MAX` until read from [`DELAY_VAR`].
static DELAY_US: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(u64::MAX);

/// Bench and test only: how long every request and answer this process sends waits before it
/// leaves, a modelled one-way network delay (0 normally). Swarm tasks started afterwards use it.
pub fn one_way_delay() -> Duration {
    use std::sync::atomic::Ordering;
    let mut us = DELAY_US.load(Ordering::Relaxed);
    if us == u64::MAX {
        us = std::env::var(DELAY_VAR)
            .ok()
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|ms| ms.is_finite() && *ms >= 0.0)
            .map_or(0, |ms| (ms * 1e3) as u64);
        DELAY_US.store(us, Ordering::Relaxed);
    }
    Duration::from_micros(us)
}

/// Bench and test only: sets [`one_way_delay`] for the swarm tasks this process starts next.
pub fn set_one_way_delay(delay: Duration) {
    DELAY_US.store(
        delay.as_micros() as u64,
        std::sync::atomic::Ordering::Relaxed,
    );
}

struct EventLoop {
    swarm: Swarm<MeshBehaviour>,
    commands: mpsc::Receiver<Command>,
    inbound: mpsc::Sender<Inbound>,
    driver: Driver,
    /// Requests and answers held back by [`one_way_delay`], when it is set.
    delayed: (
        mpsc::UnboundedSender<Command>,
        mpsc::UnboundedReceiver<Command>,
    ),
    delay: Duration,
    /// The relay circuit asked for last, and when.
    reserving: Option<(libp2p::core::transport::ListenerId, tokio::time::Instant)>,
    /// Which of `relays` to ask next.
    next_relay: usize,
    /// A probe: it takes no external address (no DHT server, no relay for others).
    probe: bool,
    /// Round trips pinged, for [`Client::round_trip`].
    rtts: RoundTrips,
    /// A report of the reachability found the node's queue full: it goes again, as the
    /// reachability is then, on the next tick (it changes rarely, and a lost report would leave
    /// the node announcing the old one until the next change).
    reach_unsent: bool,
}

/// How long a relay has to accept a reservation before the next one is asked.
const RESERVE_WAIT: Duration = Duration::from_secs(10);

impl EventLoop {
    fn new(
        probe: bool,
        swarm: Swarm<MeshBehaviour>,
        commands: mpsc::Receiver<Command>,
        inbound: mpsc::Sender<Inbound>,
    ) -> Self {
        Self {
            swarm,
            commands,
            inbound,
            driver: Driver::new(true),
            // Unbounded: only the bench's delay fills it, with what this node's own tasks sent.
            delayed: mpsc::unbounded_channel(),
            delay: one_way_delay(),
            reserving: None,
            next_relay: 0,
            probe,
            rtts: RoundTrips::default(),
            reach_unsent: false,
        }
    }

    /// Each second: a report of the reachability that did not fit goes again; a relay slot is
    /// reserved if one is needed.
    fn on_tick(&mut self) {
        if self.reach_unsent {
            self.report_reach();
        }
        self.reserve();
    }

    /// Tells the node how peers reach it now ([`Self::reach_unsent`] when its queue is full).
    fn report_reach(&mut self) {
        // A closed queue takes anything: no node listens.
        let unsent = matches!(
            self.inbound.try_send(self.driver.reach_event()),
            Err(mpsc::error::TrySendError::Full(_))
        );
        if unsent && !self.reach_unsent {
            tracing::warn!(
                "the node's queue is full: its reachability is reported again in a second"
            );
        }
        self.reach_unsent = unsent;
    }

    /// Reserves a slot on a relay while peers cannot dial this node and it has no circuit:
    /// each of the relays in turn, a new one if the last did not answer in time.
    fn reserve(&mut self) {
        if !self.driver.reachability().needs_relay() {
            return;
        }
        let now = tokio::time::Instant::now();
        if let Some((id, asked)) = self.reserving {
            if now.duration_since(asked) < RESERVE_WAIT {
                return;
            }
            self.swarm.remove_listener(id);
            self.reserving = None;
        }
        let relays = self.driver.reachability().relays();
        if relays.is_empty() {
            return;
        }
        let relay = relays[self.next_relay % relays.len()].clone();
        self.next_relay += 1;
        let circuit = relay.with(Protocol::P2pCircuit);
        match self.swarm.listen_on(circuit.clone()) {
            Ok(id) => {
                tracing::info!(%circuit, "peers cannot dial this node: reserving a slot on a relay");
                self.reserving = Some((id, now));
            }
            Err(e) => tracing::warn!(%circuit, "reserving a relay slot: {e}"),
        }
    }

    async fn run(mut self) {
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tokio::select! {
                _ = tick.tick() => self.on_tick(),
                event = self.swarm.select_next_some() => {
                    if let Some(event) = self.driver.on_event(&mut self.swarm, event) {
                        self.on_net(event).await;
                    }
                }
                cmd = self.commands.recv() => match cmd {
                    Some(cmd) => self.on_command(cmd),
                    None => return, // every client is gone
                },
                Some(cmd) = self.delayed.1.recv() => self.send_now(cmd),
            }
        }
    }

    /// Runs a command, holding requests and answers back by the bench's delay when it is set.
    fn on_command(&mut self, cmd: Command) {
        let held = matches!(cmd, Command::Request { .. } | Command::Respond { .. });
        if held && !self.delay.is_zero() {
            let (tx, delay) = (self.delayed.0.clone(), self.delay);
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                let _ = tx.send(cmd);
            });
            return;
        }
        self.send_now(cmd);
    }

    fn send_now(&mut self, cmd: Command) {
        let swarm = &mut self.swarm;
        match cmd {
            Command::Dial { addr, reply } => self.driver.dial(
                swarm,
                addr,
                Box::new(move |r| {
                    let _ = reply.send(r);
                }),
            ),
            Command::AddAddrs { peer, addrs } => self.driver.add_addrs(swarm, peer, addrs),
            Command::Request {
                peer,
                request,
                reply,
            } => self.driver.request(swarm, peer, request, reply),
            Command::Respond { channel, response } => Driver::respond(swarm, channel, response),
            Command::Publish { data } => self.driver.publish(swarm, data),
            Command::ListenAddrs { reply } => {
                let _ = reply.send(swarm.listeners().cloned().collect());
            }
            Command::Connections { reply } => {
                let _ = reply.send(self.driver.reachability().connections());
            }
        }
    }

    async fn on_net(&mut self, event: NetEvent) {
        match event {
            NetEvent::Listening(address) | NetEvent::Expired(address) if is_relayed(&address) => {
                // A relay circuit opened or closed: peers reach this node another way now.
                self.report_reach();
            }
            NetEvent::Listening(address) => {
                tracing::debug!(%address, "listening");
                // A loopback address is external on this machine (a local mesh, tests); any
                // other becomes external once AutoNAT finds peers can dial it. The relay
                // serves browsers only once the node has external addresses.
                if is_loopback(&address) && !self.probe {
                    self.swarm.add_external_address(address);
                }
            }
            NetEvent::Reach {
                reach, needs_relay, ..
            } => {
                tracing::info!(reach = reach.label(), needs_relay, "reachability");
                self.reserve();
                self.report_reach();
            }
            NetEvent::Expired(_) => {}
            gossip @ (NetEvent::Gossip { .. } | NetEvent::RoundTrip { .. }) => {
                if let NetEvent::RoundTrip { peer, rtt } = &gossip {
                    let mut rtts = self.rtts.lock().unwrap_or_else(PoisonError::into_inner);
                    if rtts.len() >= MAX_ROUND_TRIPS && !rtts.contains_key(peer) {
                        rtts.clear();
                    }
                    rtts.insert(*peer, *rtt);
                }
                let _ = self.inbound.try_send(gossip);
            }
            request @ NetEvent::Request { .. } => {
                if self.inbound.send(request).await.is_err() {
                    tracing::debug!("no node is listening for requests");
                }
            }
        }
    }
}

/// The address with `/p2p/<peer>` appended (if it has none).
pub fn with_peer(addr: &Multiaddr, peer: PeerId) -> Multiaddr {
    if addr.iter().any(|p| matches!(p, Protocol::P2p(_))) {
        addr.clone()
    } else {
        addr.clone().with(Protocol::P2p(peer))
    }
}

/// Opens a `protocol` stream to `peer` once its receiver has taken it
/// ([`node_core::net::session::open_accepted`]), waiting on tokio's timer.
pub async fn open_accepted(
    control: &mut libp2p_stream::Control,
    peer: PeerId,
    protocol: StreamProtocol,
) -> Result<libp2p::Stream, OpenStreamError> {
    session::open_accepted(control, peer, protocol, tokio::time::sleep).await
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

    use super::*;

    /// The lab's "did not settle" flake as it may have come about: a home's relay circuit
    /// opened while its node's queue was full (heartbeats it had not taken yet), the report
    /// was dropped, and the node announced its old reachability for good.
    #[tokio::test]
    async fn a_reachability_report_that_finds_the_queue_full_reaches_the_node_once_there_is_room() {
        let swarm = build(NetConfig {
            key: Keypair::generate_ed25519(),
            webrtc: None,
            listen: Vec::new(),
            mdns: false,
            probe: false,
        })
        .await
        .unwrap();
        let (_commands, commands_rx) = mpsc::channel(1);
        let (inbound, mut node) = mpsc::channel(1);
        let heartbeat = || NetEvent::Gossip {
            peer: PeerId::random(),
            data: vec![1],
        };
        inbound.try_send(heartbeat()).unwrap();
        let mut events = EventLoop::new(false, swarm, commands_rx, inbound);
        events.report_reach();
        assert!(events.reach_unsent, "the queue is full");
        // A tick while it is still full: nothing lost, still to go.
        events.on_tick();
        assert!(events.reach_unsent);
        assert!(matches!(node.try_recv(), Ok(NetEvent::Gossip { .. })));
        assert!(node.try_recv().is_err(), "the report was not queued");
        events.on_tick();
        assert!(!events.reach_unsent);
        assert!(matches!(node.try_recv(), Ok(NetEvent::Reach { .. })));
    }
}
