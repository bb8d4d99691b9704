//! `codedmesh reach`: dials a peer the way a peer of the mesh would and tells how the
//! connection ends up (direct, direct after hole punching, or relayed), so anyone can check
//! what their NAT allows.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use libp2p::multiaddr::Protocol;
use libp2p::{Multiaddr, PeerId};
use node_core::net::reach::{Path, is_relayed};

use super::swarm::{self, NetConfig};

/// How a probe reached a peer.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Reached {
    /// The peer.
    pub peer: String,
    /// "direct", "direct after hole punching" or "relayed".
    pub path: String,
    /// Milliseconds from the dial to the final path.
    pub ms: u64,
}

/// The part of a relay circuit address before `/p2p-circuit`: the relay's own address.
pub fn relay_of(addr: &Multiaddr) -> Option<Multiaddr> {
    is_relayed(addr).then(|| {
        addr.iter()
            .take_while(|p| *p != Protocol::P2pCircuit)
            .collect()
    })
}

/// Dials `addr` from a fresh identity listening on `listen` and waits up to `wait` for a
/// relayed connection to become direct by hole punching.
pub async fn reach(addr: Multiaddr, listen: Vec<Multiaddr>, wait: Duration) -> Result<Reached> {
    let target = match addr.iter().last() {
        Some(Protocol::P2p(p)) => p,
        _ => bail!("{addr}: the address must end in /p2p/<peer id>"),
    };
    let swarm = swarm::build(NetConfig {
        key: libp2p::identity::Keypair::generate_ed25519(),
        webrtc: None,
        listen,
        mdns: false,
        probe: true,
    })
    .await?;
    let (client, mut inbound) = swarm::spawn(swarm);
    tokio::spawn(async move { while inbound.recv().await.is_some() {} });
    if let Some(relay) = relay_of(&addr) {
        // Meet the relay first: it tells this node the address it sees, which hole punching
        // hands to the peer.
        client
            .dial(relay.clone())
            .await
            .with_context(|| format!("reaching the relay {relay}"))?;
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let started = tokio::time::Instant::now();
    let peer: PeerId = client.dial(addr.clone()).await?;
    anyhow::ensure!(peer == target, "{addr} answered as {peer}");
    let path = loop {
        let conns = client.connections().await?;
        let paths: Vec<Path> = conns
            .iter()
            .filter(|(p, _)| *p == peer)
            .map(|(_, path)| *path)
            .collect();
        // A direct dial is final at once. After a relayed one the probe dials nothing else
        // and asks nothing that makes the peer dial it, so a direct connection beside the
        // relayed one is hole punching's (reported as such, or made by the peer's side of it
        // and accepted here).
        if !is_relayed(&addr) {
            break paths.iter().max().copied();
        }
        if paths.contains(&Path::Punched) || paths.contains(&Path::Direct) {
            break Some(Path::Punched);
        }
        if started.elapsed() >= wait {
            break paths.first().copied();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let path = match path {
        Some(Path::Punched) => "direct after hole punching",
        Some(Path::Direct) => "direct",
        Some(Path::Relayed) => "relayed",
        None => bail!("the connection to {peer} closed"),
    };
    Ok(Reached {
        peer: peer.to_string(),
        path: path.into(),
        ms: started.elapsed().as_millis() as u64,
    })
}
