//! What a swarm task does alike in the native and the browser node: the dials and requests it
//! waits on, answers, heartbeats, and the swarm events it handles itself. Each shell keeps only
//! its loop (its runtime, its channels) and what an event means to it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

use libp2p::multiaddr::Protocol;
use libp2p::request_response::{self, OutboundRequestId, ResponseChannel};
use libp2p::swarm::dial_opts::DialOpts;
use libp2p::swarm::{ConnectionId, SwarmEvent};
use libp2p::{Multiaddr, PeerId, Swarm, autonat, dcutr, gossipsub, identify, ping, relay};

use super::reach::{Reach, Reachability, is_relayed};
use super::{KAD_PROTOCOL, MESH_PROTOCOL, MeshBehaviour, MeshBehaviourEvent, version_mismatch};
use crate::mesh::{HEARTBEAT_TOPIC, MeshRequest, MeshResponse};

/// Gossip messages dropped for having no signed author, since the process started.
pub static UNSIGNED_GOSSIP: AtomicU64 = AtomicU64::new(0);

/// Where the outcome of a dial or an outbound request goes (it runs on the swarm task, so it
/// must be quick: hand the value to a channel).
pub type Reply<T> = Box<dyn FnOnce(Result<T, String>) + Send>;

/// What the swarm hands to the node.
#[derive(Debug)]
pub enum NetEvent {
    /// A peer asks something; answer on `channel` ([`Driver::respond`]).
    Request {
        /// Who.
        peer: PeerId,
        /// What.
        request: MeshRequest,
        /// Where the answer goes.
        channel: ResponseChannel<MeshResponse>,
    },
    /// A heartbeat's bytes arrived on gossipsub from its signed author.
    Gossip {
        /// The author.
        peer: PeerId,
        /// Its bytes.
        data: Vec<u8>,
    },
    /// A ping measured the round trip to a connected peer.
    RoundTrip {
        /// The peer.
        peer: PeerId,
        /// The round trip.
        rtt: std::time::Duration,
    },
    /// The swarm listens on a new address (a relay circuit's included).
    Listening(Multiaddr),
    /// The swarm no longer listens on an address.
    Expired(Multiaddr),
    /// What the node knows of its reachability changed ([`Driver::reachability`]).
    Reach {
        /// How peers reach it now.
        reach: Reach,
        /// Addresses peers may reach it at: confirmed external ones and relay circuits.
        addrs: Vec<Multiaddr>,
        /// It should reserve a slot on a relay ([`Reachability::needs_relay`]).
        needs_relay: bool,
    },
}

/// The dials and requests a swarm task waits on, and how it handles the swarm's events.
pub struct Driver {
    /// Dials waited on, and the address each dials.
    dials: HashMap<ConnectionId, (Reply<PeerId>, Multiaddr)>,
    requests: HashMap<OutboundRequestId, Reply<MeshResponse>>,
    topic: gossipsub::IdentTopic,
    /// Whether peers' addresses go into the DHT's routing table (not in a browser).
    dht: bool,
    /// What the node knows of its reachability and its connections' paths.
    reach: Reachability,
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Driver")
            .field("dials", &self.dials.len())
            .field("requests", &self.requests.len())
            .finish()
    }
}

impl Driver {
    /// A driver; `dht`: add the addresses peers tell to the DHT's routing table.
    pub fn new(dht: bool) -> Self {
        Self {
            dials: HashMap::new(),
            requests: HashMap::new(),
            topic: gossipsub::IdentTopic::new(HEARTBEAT_TOPIC),
            dht,
            reach: Reachability::default(),
        }
    }

    /// What the node knows of its reachability and its connections' paths.
    pub fn reachability(&self) -> &Reachability {
        &self.reach
    }

    /// What peers see of the reachability: how they reach it, where, whether it needs a relay.
    fn seen(&self) -> (Reach, Vec<Multiaddr>, bool) {
        (
            self.reach.reach(),
            self.reach.addrs().cloned().collect(),
            self.reach.needs_relay(),
        )
    }

    /// The event that reports the reachability now (a shell sends it on after a relay
    /// circuit opens or closes, which comes as [`NetEvent::Listening`] or
    /// [`NetEvent::Expired`]).
    pub fn reach_event(&self) -> NetEvent {
        let (reach, addrs, needs_relay) = self.seen();
        NetEvent::Reach {
            reach,
            addrs,
            needs_relay,
        }
    }

    /// Runs `f` on the reachability; reports it if what peers see of it changed.
    fn on_reach(&mut self, f: impl FnOnce(&mut Reachability)) -> Option<NetEvent> {
        let before = self.seen();
        f(&mut self.reach);
        (before != self.seen()).then(|| self.reach_event())
    }

    /// Dials `addr` (with or without `/p2p/…`); `reply` gets the peer reached.
    pub fn dial(
        &mut self,
        swarm: &mut Swarm<MeshBehaviour>,
        addr: Multiaddr,
        reply: Reply<PeerId>,
    ) {
        // The last `/p2p/…` is the peer: a relay circuit names the relay first.
        let peer = addr
            .iter()
            .filter_map(|p| match p {
                Protocol::P2p(id) => Some(id),
                _ => None,
            })
            .last();
        if let Some(peer) = peer.filter(|p| swarm.is_connected(p)) {
            return reply(Ok(peer));
        }
        let opts = match peer {
            // Always: a dial the DHT or a request started to the same peer must not fail this one.
            Some(peer) => DialOpts::peer_id(peer)
                .addresses(vec![addr.clone()])
                .condition(libp2p::swarm::dial_opts::PeerCondition::Always)
                .build(),
            None => DialOpts::unknown_peer_id().address(addr.clone()).build(),
        };
        let id = opts.connection_id();
        match swarm.dial(opts) {
            Ok(()) => {
                self.dials.insert(id, (reply, addr));
            }
            Err(e) => reply(Err(e.to_string())),
        }
    }

    /// Remembers addresses of `peer` for later requests.
    pub fn add_addrs(&self, swarm: &mut Swarm<MeshBehaviour>, peer: PeerId, addrs: Vec<Multiaddr>) {
        for a in super::reach::to_dial(addrs) {
            swarm.add_peer_address(peer, a.clone());
            if self.dht {
                swarm.behaviour_mut().kad.add_address(&peer, a);
            }
        }
    }

    /// Sends `request` to `peer`; `reply` gets the answer or why there is none.
    pub fn request(
        &mut self,
        swarm: &mut Swarm<MeshBehaviour>,
        peer: PeerId,
        request: MeshRequest,
        reply: Reply<MeshResponse>,
    ) {
        let id = swarm.behaviour_mut().mesh.send_request(&peer, request);
        self.requests.insert(id, reply);
    }

    /// Answers an inbound request.
    pub fn respond(
        swarm: &mut Swarm<MeshBehaviour>,
        channel: ResponseChannel<MeshResponse>,
        response: MeshResponse,
    ) {
        if swarm
            .behaviour_mut()
            .mesh
            .send_response(channel, response)
            .is_err()
        {
            tracing::debug!("a peer left before its answer was sent");
        }
    }

    /// Publishes a heartbeat's bytes.
    pub fn publish(&self, swarm: &mut Swarm<MeshBehaviour>, data: Vec<u8>) {
        if let Err(e) = swarm
            .behaviour_mut()
            .gossipsub
            .publish(self.topic.clone(), data)
        {
            // No subscribed peer yet is normal for a lone node.
            tracing::debug!(error = %e, "heartbeat not published");
        }
    }

    /// Handles a swarm event: what concerns the node comes back.
    pub fn on_event(
        &mut self,
        swarm: &mut Swarm<MeshBehaviour>,
        event: SwarmEvent<MeshBehaviourEvent>,
    ) -> Option<NetEvent> {
        match event {
            SwarmEvent::NewListenAddr { address, .. } => {
                if is_relayed(&address) {
                    tracing::info!(%address, "reachable through a relay");
                    self.reach.listening(address.clone());
                }
                return Some(NetEvent::Listening(address));
            }
            SwarmEvent::ExpiredListenAddr { address, .. } => {
                self.reach.listen_expired(&address);
                return Some(NetEvent::Expired(address));
            }
            SwarmEvent::ExternalAddrConfirmed { address } => {
                tracing::info!(%address, "peers can dial this address");
                return self.on_reach(|r| r.confirmed(address));
            }
            SwarmEvent::ExternalAddrExpired { address } => {
                return self.on_reach(|r| r.expired(&address));
            }
            SwarmEvent::ConnectionClosed { connection_id, .. } => {
                return self.on_reach(|r| r.closed(connection_id));
            }
            SwarmEvent::Behaviour(MeshBehaviourEvent::Autonat(autonat::v2::client::Event {
                tested_addr,
                server,
                result,
                ..
            })) => match result {
                Ok(()) => tracing::debug!(%tested_addr, %server, "AutoNAT: reachable"),
                Err(e) => {
                    tracing::info!(%tested_addr, %server, "AutoNAT: peers cannot dial it: {e}");
                    return self.on_reach(|r| r.refuted(tested_addr));
                }
            },
            SwarmEvent::Behaviour(MeshBehaviourEvent::Dcutr(dcutr::Event {
                remote_peer_id,
                result,
            })) => match result {
                Ok(id) => {
                    tracing::info!(peer = %remote_peer_id, "hole punching made a direct connection");
                    return self.on_reach(|r| r.punched(id));
                }
                Err(e) => {
                    tracing::info!(peer = %remote_peer_id, "hole punching failed; the connection stays relayed: {e}");
                }
            },
            SwarmEvent::Behaviour(MeshBehaviourEvent::RelayClient(
                relay::client::Event::ReservationReqAccepted { relay_peer_id, .. },
            )) => tracing::debug!(relay = %relay_peer_id, "relay reservation accepted"),
            SwarmEvent::ListenerClosed { reason, .. } => {
                tracing::warn!("a listener closed: {reason:?}");
            }
            SwarmEvent::ConnectionEstablished {
                peer_id,
                connection_id,
                endpoint,
                ..
            } => {
                let dialed = self.dials.remove(&connection_id).map(|(reply, addr)| {
                    reply(Ok(peer_id));
                    addr
                });
                return self.on_reach(|r| {
                    if let Some(addr) = &dialed {
                        r.dialed(addr, peer_id);
                    }
                    r.connected(connection_id, peer_id, &endpoint);
                });
            }
            SwarmEvent::OutgoingConnectionError {
                connection_id,
                error,
                ..
            } => {
                if let Some((reply, _)) = self.dials.remove(&connection_id) {
                    reply(Err(error.to_string()));
                }
            }
            SwarmEvent::Behaviour(MeshBehaviourEvent::Mesh(event)) => return self.on_mesh(event),
            SwarmEvent::Behaviour(MeshBehaviourEvent::Ping(ping::Event {
                peer,
                result: Ok(rtt),
                ..
            })) => return Some(NetEvent::RoundTrip { peer, rtt }),
            SwarmEvent::Behaviour(MeshBehaviourEvent::Gossipsub(gossipsub::Event::Message {
                propagation_source,
                message,
                ..
            })) => {
                // Gossipsub runs in strict mode: it drops badly signed messages itself, and a
                // message without an author is dropped here.
                match message.source {
                    Some(peer) => {
                        return Some(NetEvent::Gossip {
                            peer,
                            data: message.data,
                        });
                    }
                    None => {
                        let n = UNSIGNED_GOSSIP.fetch_add(1, Ordering::Relaxed) + 1;
                        tracing::warn!(%propagation_source, "dropped an unsigned gossip message ({n} so far)");
                    }
                }
            }
            SwarmEvent::Behaviour(MeshBehaviourEvent::Identify(identify::Event::Received {
                peer_id,
                info,
                ..
            })) => {
                if let Some(msg) = version_mismatch(&info.protocols) {
                    tracing::error!(peer = %peer_id, "{msg}");
                }
                // Only peers that answer DHT queries (its server mode) belong in the routing
                // table: a probe or a node nobody can dial would be handed out in vain.
                let serves_dht = info.protocols.iter().any(|p| p.as_ref() == KAD_PROTOCOL);
                if self.dht && serves_dht {
                    for addr in info.listen_addrs {
                        swarm.behaviour_mut().kad.add_address(&peer_id, addr);
                    }
                }
            }
            #[cfg(all(native, feature = "mdns"))]
            SwarmEvent::Behaviour(MeshBehaviourEvent::Mdns(libp2p::mdns::Event::Discovered(
                found,
            ))) => {
                for (peer, addr) in found {
                    swarm.behaviour_mut().kad.add_address(&peer, addr.clone());
                    if !swarm.is_connected(&peer) {
                        let _ = swarm.dial(DialOpts::peer_id(peer).addresses(vec![addr]).build());
                    }
                }
            }
            _ => {}
        }
        None
    }

    fn on_mesh(
        &mut self,
        event: request_response::Event<MeshRequest, MeshResponse>,
    ) -> Option<NetEvent> {
        match event {
            request_response::Event::Message { peer, message, .. } => match message {
                request_response::Message::Request {
                    request, channel, ..
                } => {
                    return Some(NetEvent::Request {
                        peer,
                        request,
                        channel,
                    });
                }
                request_response::Message::Response {
                    request_id,
                    response,
                } => {
                    if let Some(reply) = self.requests.remove(&request_id) {
                        reply(Ok(response));
                    }
                }
            },
            request_response::Event::OutboundFailure {
                request_id, error, ..
            } => {
                if let Some(reply) = self.requests.remove(&request_id) {
                    reply(Err(match error {
                        request_response::OutboundFailure::UnsupportedProtocols => format!(
                            "the peer does not speak {MESH_PROTOCOL} (another Coded Mesh version?)"
                        ),
                        other => other.to_string(),
                    }));
                }
            }
            request_response::Event::InboundFailure { peer, error, .. } => {
                tracing::debug!(%peer, %error, "inbound request failed");
            }
            request_response::Event::ResponseSent { .. } => {}
        }
        None
    }
}
