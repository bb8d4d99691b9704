//! The browser's swarm: WebSocket (noise, yamux) and WebRTC-direct to native nodes, and
//! circuits through them (relay v2), so native leaders can reach it.

use futures::future::Either;
use libp2p::core::muxing::StreamMuxerBox;
use libp2p::core::transport::{Transport, upgrade::Version};
use libp2p::{Swarm, identity, noise, yamux};
use node_core::net::MeshBehaviour;
use web_time::Duration;

use crate::node::WebError;

/// Builds a swarm with the mesh's behaviour for `key`.
pub fn build(key: identity::Keypair) -> Result<Swarm<MeshBehaviour>, WebError> {
    let swarm = libp2p::SwarmBuilder::with_existing_identity(key)
        .with_wasm_bindgen()
        .with_other_transport(|key| {
            let ws = libp2p_websocket_websys::Transport::default()
                .upgrade(Version::V1Lazy)
                .authenticate(noise::Config::new(key).map_err(Box::new)?)
                .multiplex(yamux::Config::default());
            let rtc = libp2p_webrtc_websys::Transport::new(libp2p_webrtc_websys::Config::new(key));
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>(ws.or_transport(rtc).map(
                |either, _| match either {
                    Either::Left((peer, conn)) => (peer, StreamMuxerBox::new(conn)),
                    Either::Right((peer, conn)) => (peer, StreamMuxerBox::new(conn)),
                },
            ))
        })
        .map_err(|e| WebError::Transport(e.to_string()))?
        .with_relay_client(noise::Config::new, yamux::Config::default)
        .map_err(|e| WebError::Transport(e.to_string()))?
        .with_behaviour(|key, relay_client| {
            Ok(MeshBehaviour::for_browser(key)
                .map_err(|e| Box::new(e) as Box<dyn std::error::Error + Send + Sync>)?
                .with_relay_client(relay_client))
        })
        .map_err(|e| WebError::Transport(e.to_string()))?
        .with_swarm_config(|c| c.with_idle_connection_timeout(Duration::from_secs(600)))
        .build();
    Ok(swarm)
}
