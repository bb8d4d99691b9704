//! The libp2p side of a node, shared by native and browser shells: one behaviour struct, the
//! request-response codec and the swarm task's [`Driver`]. Transports and the loops that drive
//! a swarm on each runtime live in the shells.

pub mod asks;
mod driver;
pub mod frames;
pub mod hop;
pub mod link;
pub mod reach;
pub mod session;

pub use driver::{Driver, NetEvent, Reply, UNSIGNED_GOSSIP};

use std::io;

use futures::{AsyncRead, AsyncWrite, AsyncWriteExt};
use libp2p::swarm::{NetworkBehaviour, behaviour::toggle::Toggle};
use libp2p::{
    StreamProtocol, autonat, dcutr, gossipsub, identify, identity, kad, ping, relay,
    request_response,
};
use web_time::Duration;

use crate::mesh::{HEARTBEAT_TOPIC, MeshRequest, MeshResponse};
use crate::protocol::{self, PROTOCOL_VERSION};

/// Name of the mesh request-response protocol; the version is part of it.
pub const MESH_PROTOCOL: &str = "/codedmesh/mesh/2";
/// Name of the mesh's DHT protocol.
pub const KAD_PROTOCOL: &str = "/codedmesh/kad/1";
/// Prefix every version of the mesh protocol shares.
const MESH_PROTOCOL_PREFIX: &str = "/codedmesh/mesh/";

/// Reservations and circuits one peer may ask a relay for per minute.
const RELAY_PER_MINUTE: std::num::NonZeroU32 = match std::num::NonZeroU32::new(60) {
    Some(n) => n,
    None => std::num::NonZeroU32::MIN,
};

/// Connections one peer may hold with a node at once (a relayed one, a direct one, one per
/// transport while hole punching).
pub const MAX_PEER_CONNECTIONS: u32 = 8;

/// Connections from peers a node holds at once.
pub const MAX_INCOMING: u32 = 2048;

/// Requests at once on one connection (each one's frame read within the node's budget,
/// [`frames::INBOUND_BUDGET`]).
pub const MAX_STREAMS: usize = 128;

/// Pieces a message is written in (WebRTC data channels fail on larger single writes).
const WRITE_PIECE: usize = 4 << 10;

#[cfg(all(native, feature = "mdns"))]
type Mdns = Toggle<libp2p::mdns::tokio::Behaviour>;
#[cfg(not(all(native, feature = "mdns")))]
type Mdns = Toggle<libp2p::swarm::dummy::Behaviour>;

/// Every protocol a node speaks.
#[derive(NetworkBehaviour)]
#[allow(missing_debug_implementations)]
pub struct MeshBehaviour {
    /// Bounds on connections: per peer, pending and established incoming ones.
    pub limits: libp2p::connection_limits::Behaviour,
    /// Peer addresses and protocol lists.
    pub identify: identify::Behaviour,
    /// Liveness of connections.
    pub ping: ping::Behaviour,
    /// Heartbeats and announcements (small messages only).
    pub gossipsub: gossipsub::Behaviour,
    /// Coded steps, manifests, joins and shard transfer.
    pub mesh: request_response::Behaviour<MeshCodec>,
    /// Long-lived streams of group sessions ([`session`]).
    pub session: libp2p_stream::Behaviour,
    /// Peer discovery over the DHT.
    pub kad: kad::Behaviour<kad::store::MemoryStore>,
    /// Peer discovery on the local network (feature `mdns`, native only).
    pub mdns: Mdns,
    /// Relaying for peers nobody can dial (browsers): on for native nodes.
    pub relay: Toggle<relay::Behaviour>,
    /// Reaching peers through a relay, and being reached through one.
    pub relay_client: Toggle<relay::client::Behaviour>,
    /// Whether peers can dial this node's addresses (AutoNAT v2; native nodes).
    pub autonat: Toggle<autonat::v2::client::Behaviour>,
    /// Dialing peers back so they learn whether they can be dialed (AutoNAT v2; native nodes).
    pub autonat_server: Toggle<autonat::v2::server::Behaviour>,
    /// Turning relayed connections into direct ones by hole punching (DCUtR; native nodes).
    pub dcutr: Toggle<dcutr::Behaviour>,
}

/// Errors building the behaviour.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// Gossipsub refused its configuration.
    #[error("gossipsub: {0}")]
    Gossipsub(String),
    /// mDNS could not start.
    #[error("mdns: {0}")]
    Mdns(String),
}

impl MeshBehaviour {
    /// Builds the behaviour for a node with `key`; `mdns` turns on local discovery where built.
    pub fn new(key: &identity::Keypair, mdns: bool) -> Result<Self, NetError> {
        Self::build(key, mdns, true)
    }

    /// The behaviour of a browser node: no DHT queries of its own (their dials would open
    /// WebRTC connections beside its WebSocket ones); the native nodes it dials tell it the mesh.
    pub fn for_browser(key: &identity::Keypair) -> Result<Self, NetError> {
        Self::build(key, false, false)
    }

    /// The behaviour of a probe that dials one peer and watches the connection: no DHT queries
    /// and no AutoNAT probes, so no connection but the ones it asks for (and hole punching's).
    pub fn for_probe(key: &identity::Keypair) -> Result<Self, NetError> {
        let mut b = Self::build(key, false, false)?.with_nat_traversal(key.public().to_peer_id());
        b.autonat = Toggle::from(None);
        Ok(b)
    }

    fn build(key: &identity::Keypair, mdns: bool, dht_queries: bool) -> Result<Self, NetError> {
        let peer_id = key.public().to_peer_id();
        let gossip_cfg = gossipsub::ConfigBuilder::default()
            .heartbeat_interval(Duration::from_millis(500))
            .validation_mode(gossipsub::ValidationMode::Strict)
            .max_transmit_size(64 << 10)
            .build()
            .map_err(|e| NetError::Gossipsub(e.to_string()))?;
        let mut gossipsub = gossipsub::Behaviour::new(
            gossipsub::MessageAuthenticity::Signed(key.clone()),
            gossip_cfg,
        )
        .map_err(|e| NetError::Gossipsub(e.to_string()))?;
        gossipsub
            .subscribe(&gossipsub::IdentTopic::new(HEARTBEAT_TOPIC))
            .map_err(|e| NetError::Gossipsub(e.to_string()))?;
        let mesh = request_response::Behaviour::with_codec(
            MeshCodec,
            [(
                StreamProtocol::new(MESH_PROTOCOL),
                request_response::ProtocolSupport::Full,
            )],
            request_response::Config::default()
                .with_request_timeout(Duration::from_secs(60))
                // Per connection; every frame is read within the node's budget (`frames`).
                .with_max_concurrent_streams(MAX_STREAMS),
        );
        let mut kad_cfg = kad::Config::new(StreamProtocol::new(KAD_PROTOCOL));
        kad_cfg.set_query_timeout(Duration::from_secs(30));
        if !dht_queries {
            // An empty routing table: nothing to bootstrap from, so nothing dialed.
            kad_cfg.set_periodic_bootstrap_interval(None);
            kad_cfg.set_kbucket_inserts(kad::BucketInserts::Manual);
        }
        let kad =
            kad::Behaviour::with_config(peer_id, kad::store::MemoryStore::new(peer_id), kad_cfg);
        let limits = libp2p::connection_limits::ConnectionLimits::default()
            .with_max_established_per_peer(Some(MAX_PEER_CONNECTIONS))
            .with_max_pending_incoming(Some(256))
            .with_max_established_incoming(Some(MAX_INCOMING));
        Ok(Self {
            limits: libp2p::connection_limits::Behaviour::new(limits),
            identify: identify::Behaviour::new(
                identify::Config::new("/codedmesh/id/1".into(), key.public())
                    .with_agent_version(format!("codedmesh/{}", env!("CARGO_PKG_VERSION"))),
            ),
            ping: ping::Behaviour::default(),
            gossipsub,
            mesh,
            session: libp2p_stream::Behaviour::new(),
            kad,
            mdns: build_mdns(peer_id, mdns)?,
            relay: Toggle::from(None),
            relay_client: Toggle::from(None),
            autonat: Toggle::from(None),
            autonat_server: Toggle::from(None),
            dcutr: Toggle::from(None),
        })
    }

    /// Finds out whether peers can dial this node (and tells peers the same), and turns
    /// relayed connections into direct ones where the NATs on the way allow it.
    pub fn with_nat_traversal(mut self, peer_id: libp2p::PeerId) -> Self {
        // Probes every 5 s, each a candidate address (identify's observations) at a server.
        self.autonat = Toggle::from(Some(autonat::v2::client::Behaviour::default()));
        self.autonat_server = Toggle::from(Some(autonat::v2::server::Behaviour::default()));
        self.dcutr = Toggle::from(Some(dcutr::Behaviour::new(peer_id)));
        self
    }

    /// Relays circuits for others, with limits raised for coded steps: a browser row answers
    /// every step of a request through its relay.
    pub fn with_relay_server(mut self, peer_id: libp2p::PeerId) -> Self {
        let cfg = relay::Config {
            max_reservations: 1024,
            max_reservations_per_peer: 8,
            reservation_duration: Duration::from_secs(3600),
            reservation_rate_limiters: Vec::new(),
            max_circuits: 1024,
            max_circuits_per_peer: 64,
            max_circuit_duration: Duration::from_secs(24 * 3600),
            // No byte limit: a shard is hundreds of megabytes.
            max_circuit_bytes: 0,
            circuit_src_rate_limiters: Vec::new(),
        }
        .reservation_rate_per_peer(RELAY_PER_MINUTE, Duration::from_secs(60))
        .circuit_src_per_peer(RELAY_PER_MINUTE, Duration::from_secs(60));
        self.relay = Toggle::from(Some(relay::Behaviour::new(peer_id, cfg)));
        self
    }

    /// Dials through relays and listens on them with `client` (the swarm builder's).
    pub fn with_relay_client(mut self, client: relay::client::Behaviour) -> Self {
        self.relay_client = Toggle::from(Some(client));
        self
    }
}

#[cfg(all(native, feature = "mdns"))]
fn build_mdns(peer_id: libp2p::PeerId, on: bool) -> Result<Mdns, NetError> {
    if !on {
        return Ok(Toggle::from(None));
    }
    let b = libp2p::mdns::tokio::Behaviour::new(libp2p::mdns::Config::default(), peer_id)
        .map_err(|e| NetError::Mdns(e.to_string()))?;
    Ok(Toggle::from(Some(b)))
}

#[cfg(not(all(native, feature = "mdns")))]
fn build_mdns(_peer_id: libp2p::PeerId, on: bool) -> Result<Mdns, NetError> {
    if on {
        return Err(NetError::Mdns(
            "this build has no mDNS (feature `mdns`, native only)".into(),
        ));
    }
    Ok(Toggle::from(None))
}

/// If a peer lists the mesh protocol only in another version, says so with both versions.
pub fn version_mismatch(protocols: &[StreamProtocol]) -> Option<String> {
    let ours = protocols.iter().any(|p| p.as_ref() == MESH_PROTOCOL);
    let theirs: Vec<&str> = protocols
        .iter()
        .map(|p| p.as_ref())
        .filter(|p| p.starts_with(MESH_PROTOCOL_PREFIX))
        .collect();
    (!ours && !theirs.is_empty()).then(|| {
        format!(
            "the peer speaks Coded Mesh protocol {} but this node speaks {MESH_PROTOCOL} (version {PROTOCOL_VERSION}); run the same release on both",
            theirs.join(", ")
        )
    })
}

/// Length-prefixed, versioned postcard frames for [`MeshRequest`] and [`MeshResponse`].
#[derive(Debug, Clone, Copy, Default)]
pub struct MeshCodec;

async fn write_frame<T: AsyncWrite + Unpin + Send>(io: &mut T, body: &[u8]) -> io::Result<()> {
    let len = u32::try_from(body.len()).map_err(|_| io::Error::other("frame too large"))?;
    // One buffer, so a small message leaves as one write (one yamux frame, one TCP segment).
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&len.to_le_bytes());
    frame.extend_from_slice(body);
    for piece in frame.chunks(WRITE_PIECE) {
        io.write_all(piece).await?;
        io.flush().await?;
    }
    io.close().await
}

fn to_io(e: protocol::ProtocolError) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e.to_string())
}

impl request_response::Codec for MeshCodec {
    type Protocol = StreamProtocol;
    type Request = MeshRequest;
    type Response = MeshResponse;

    async fn read_request<T: AsyncRead + Unpin + Send>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
    ) -> io::Result<MeshRequest> {
        let frame = frames::read_frame(io, Some(frames::request_cap)).await?;
        protocol::decode(&frame).map_err(|e| {
            frames::UNDECODABLE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            to_io(e)
        })
    }

    async fn read_response<T: AsyncRead + Unpin + Send>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
    ) -> io::Result<MeshResponse> {
        protocol::decode(&frames::read_frame(io, None).await?).map_err(to_io)
    }

    async fn write_request<T: AsyncWrite + Unpin + Send>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
        req: MeshRequest,
    ) -> io::Result<()> {
        write_frame(io, &protocol::encode(&req).map_err(to_io)?).await
    }

    async fn write_response<T: AsyncWrite + Unpin + Send>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
        res: MeshResponse,
    ) -> io::Result<()> {
        write_frame(io, &protocol::encode(&res).map_err(to_io)?).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use request_response::Codec;

    #[test]
    fn frames_round_trip_and_oversize_is_refused() {
        futures::executor::block_on(async {
            let proto = StreamProtocol::new(MESH_PROTOCOL);
            let mut buf = Vec::new();
            let req = MeshRequest::Step {
                version: [1; 32],
                bytes: vec![7; 10_000],
            };
            MeshCodec
                .write_request(&proto, &mut futures::io::Cursor::new(&mut buf), req.clone())
                .await
                .unwrap();
            let got = MeshCodec
                .read_request(&proto, &mut futures::io::Cursor::new(&buf))
                .await
                .unwrap();
            assert_eq!(got, req);
            let mut huge = (u32::MAX).to_le_bytes().to_vec();
            huge.extend_from_slice(&[0; 16]);
            let err = MeshCodec
                .read_request(&proto, &mut futures::io::Cursor::new(&huge))
                .await
                .unwrap_err();
            assert!(err.to_string().contains("its kind may take"), "{err}");
            let truncated = &buf[..buf.len() - 1];
            assert!(
                MeshCodec
                    .read_request(&proto, &mut futures::io::Cursor::new(truncated))
                    .await
                    .is_err()
            );
        });
    }

    #[test]
    fn another_version_is_named() {
        let msg = version_mismatch(&[StreamProtocol::new("/codedmesh/mesh/1")]).unwrap();
        assert!(
            msg.contains("/codedmesh/mesh/1") && msg.contains("/codedmesh/mesh/2"),
            "{msg}"
        );
        assert!(version_mismatch(&[StreamProtocol::new(MESH_PROTOCOL)]).is_none());
    }
}
