//! The browser's swarm: WebSocket (noise, yamux) and WebRTC-direct to native nodes, and
//! circuits through them (relay v2), so native leaders can reach it.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures::future::Either;
use futures::{AsyncRead, AsyncWrite};
use libp2p::core::muxing::StreamMuxerBox;
use libp2p::core::transport::{Transport, upgrade::Version};
use libp2p::{Swarm, identity, noise, yamux};
use node_core::net::MeshBehaviour;
use web_time::Duration;

use crate::error::WebError;

/// Builds a swarm with the mesh's behaviour for `key`.
pub fn build(key: identity::Keypair) -> Result<Swarm<MeshBehaviour>, WebError> {
    let swarm = libp2p::SwarmBuilder::with_existing_identity(key)
        .with_wasm_bindgen()
        .with_other_transport(|key| {
            let ws = libp2p_websocket_websys::Transport::default()
                .map(|conn, _| HandedOver(conn))
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

/// A browser WebSocket whose flush is done once the bytes are handed to the browser.
///
/// `libp2p-websocket-websys` flushes only when the socket's `bufferedAmount` is zero and
/// checks that on a 100 ms timer, so every yamux flush (each request and each answer) waited
/// up to 100 ms: a coded round from the page took 100–200 ms. Bytes given to
/// `WebSocket.send` leave unless the socket closes, which the next read or write reports, as
/// a TCP socket's flush means "in the kernel's buffer", not "acknowledged".
#[derive(Debug)]
struct HandedOver<C>(C);

impl<C: AsyncRead + Unpin> AsyncRead for HandedOver<C> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_read(cx, buf)
    }
}

impl<C: AsyncWrite + Unpin> AsyncWrite for HandedOver<C> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().0).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().0).poll_close(cx)
    }
}
