//! The native node's [`Link`]: the swarm client, tokio's blocking pool and progress bars on
//! stderr, for the holder logic written once in `node_core::holder`.

use std::sync::Mutex;

use libp2p::{Multiaddr, PeerId};
use node_core::holder::{HolderError, Link, source_error, source_peer};
use node_core::mesh::{MeshRequest, MeshResponse, SourceRow};

use crate::net::swarm::Client;
use crate::progress;

/// A holder's link to the mesh through this node's swarm.
#[derive(Debug)]
pub struct NativeLink {
    client: Client,
    /// The progress bar of the step shown now, by its label.
    bar: Mutex<Option<(String, indicatif::ProgressBar)>>,
    quiet: bool,
}

impl NativeLink {
    /// A link that shows progress bars on stderr.
    pub fn new(client: Client) -> Self {
        Self {
            client,
            bar: Mutex::new(None),
            quiet: false,
        }
    }

    /// A link for serving peers: no progress bars.
    pub fn quiet(client: Client) -> Self {
        Self {
            client,
            bar: Mutex::new(None),
            quiet: true,
        }
    }

    /// Ends the progress bar shown, if any.
    pub fn finish(&self) {
        if let Some((_, pb)) = self.bar.lock().unwrap_or_else(|e| e.into_inner()).take() {
            pb.finish_and_clear();
        }
    }
}

impl Drop for NativeLink {
    fn drop(&mut self) {
        self.finish();
    }
}

impl Link for NativeLink {
    type Peer = PeerId;

    async fn ask(&self, peer: &PeerId, request: MeshRequest) -> Result<MeshResponse, HolderError> {
        self.client
            .request(*peer, request)
            .await
            .map_err(|e| HolderError::Link(format!("{peer}: {e:#}")))
    }

    async fn dial(&self, src: &SourceRow) -> Result<PeerId, HolderError> {
        let link = |e: String| source_error(src, e);
        let from = source_peer(src)?;
        if from == self.client.peer_id() {
            return Err(link("that is this node".into()));
        }
        let addrs: Vec<Multiaddr> = src.addrs.iter().filter_map(|a| a.parse().ok()).collect();
        self.client
            .add_addrs(from, addrs.clone())
            .await
            .map_err(|e| link(format!("{e:#}")))?;
        if !addrs.is_empty() {
            self.client
                .dial_any(from, &order_addrs(&addrs))
                .await
                .map_err(|e| link(format!("{e:#}")))?;
        }
        Ok(from)
    }

    async fn round_trip(&self, peer: &PeerId) -> Option<std::time::Duration> {
        (self.client)
            .round_trip(*peer, std::time::Duration::from_secs(2))
            .await
    }

    async fn blocking<R: Send + 'static>(&self, work: impl FnOnce() -> R + Send + 'static) -> R {
        match tokio::task::spawn_blocking(work).await {
            Ok(r) => r,
            // The work panicked: a bug, carried on as the panic it is.
            Err(e) => std::panic::resume_unwind(e.into_panic()),
        }
    }

    fn progress(&self, what: &str, done: u64, total: u64) {
        if self.quiet {
            return;
        }
        let mut bar = self.bar.lock().unwrap_or_else(|e| e.into_inner());
        if bar.as_ref().is_none_or(|(label, _)| label != what) {
            if let Some((_, pb)) = bar.take() {
                pb.finish_and_clear();
            }
            *bar = Some((what.to_string(), progress::bar(total, what)));
        }
        if let Some((_, pb)) = bar.as_ref() {
            pb.set_length(total);
            pb.set_position(done);
        }
    }
}

/// The addresses worth dialing, best first: direct ones before relay circuits, other hosts'
/// before loopback, plain TCP (the fastest to set up) before QUIC, WebSocket and WebRTC last.
pub fn order_addrs(addrs: &[Multiaddr]) -> Vec<Multiaddr> {
    use libp2p::multiaddr::Protocol;
    use node_core::net::reach::{is_loopback, is_relayed};
    let rank = |a: &Multiaddr| {
        let web = a.iter().any(|p| {
            matches!(
                p,
                Protocol::Ws(_)
                    | Protocol::Wss(_)
                    | Protocol::WebRTCDirect
                    | Protocol::WebTransport
            )
        });
        let tcp = a.iter().any(|p| matches!(p, Protocol::Tcp(_)));
        (is_relayed(a), web, is_loopback(a), !tcp)
    };
    let mut out = addrs.to_vec();
    out.sort_by_key(rank);
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn direct_addresses_come_before_loopback_ones_and_relay_circuits_last() {
        let a = |s: &str| -> Multiaddr { s.parse().unwrap() };
        let circuit = a(
            "/ip4/198.19.1.2/udp/1/quic-v1/p2p/12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN/p2p-circuit",
        );
        let got = order_addrs(&[
            circuit.clone(),
            a("/ip4/127.0.0.1/tcp/4001"),
            a("/ip4/192.168.2.2/tcp/4001/ws"),
            a("/ip4/192.168.2.2/udp/4001/quic-v1"),
            a("/ip4/192.168.2.2/tcp/4001"),
        ]);
        assert_eq!(
            got,
            vec![
                a("/ip4/192.168.2.2/tcp/4001"),
                a("/ip4/192.168.2.2/udp/4001/quic-v1"),
                a("/ip4/127.0.0.1/tcp/4001"),
                a("/ip4/192.168.2.2/tcp/4001/ws"),
                circuit,
            ]
        );
    }
}
