//! A node of the mesh: genesis (`seed`, [`genesis`]), joining ([`join`]), serving peers and
//! users ([`server`]: its row from [`crate::hold`], the API from [`crate::serve`], hop groups
//! from [`crate::lead`]); restarting from a data dir and starting the network are here.
//! Requests to peers are in [`crate::net::rpc`].

pub mod fit;
mod genesis;
mod join;
mod server;

pub use genesis::Shape;
pub use genesis::seed;
pub(crate) use genesis::{Trust, encode_genesis};

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use libp2p::{Multiaddr, PeerId};
use node_core::coded::ShardSet;
use node_core::compute::gpu::{DeviceChoice, Gpu};
use node_core::mesh::{HealthConfig, ModelManifest};

use crate::hold::store::DataDir;
use crate::net::swarm::{self, Client, Inbound, NetConfig, with_peer};

/// How a node connects.
#[derive(Debug, Clone)]
pub struct NodeOptions {
    /// Its data directory.
    pub data: PathBuf,
    /// A peer to join through.
    pub bootstrap: Option<Multiaddr>,
    /// Addresses to listen on.
    pub listen: Vec<Multiaddr>,
    /// Also listen on QUIC, WebSocket and WebRTC-direct next to each TCP address.
    pub all_transports: bool,
    /// Discover peers with mDNS.
    pub mdns: bool,
    /// Heartbeat and health timing.
    pub health: HealthConfig,
    /// A fault to inject (tests and demonstrations of verification).
    pub fault: Option<InjectedFault>,
    /// Where the shard products run.
    pub device: DeviceChoice,
    /// Where to serve HTTP (the dashboard and the status JSON); `None` serves none.
    pub http: Option<std::net::SocketAddr>,
    /// The dashboard's built files; `None` looks for them (see [`crate::serve::http::find_web_dir`]).
    pub web_dir: Option<PathBuf>,
    /// How the requests this node leads (its OpenAI API) are served.
    pub serve: crate::serve::engine::EngineConfig,
    /// The bearer key its API asks for, if any.
    pub api_key: Option<String>,
    /// A file of API keys, each with a name, a learning budget and a rate
    /// ([`crate::serve::api::keys`]).
    pub api_keys: Option<std::path::PathBuf>,
}

/// A fault a node injects into its own answers or shard, on purpose.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum InjectedFault {
    /// Answers with random values.
    Garbage,
    /// Its shard is scaled by 1 + 1e-3.
    Scale,
    /// Its shard misses the first learning update it receives (which it records as applied).
    Stale,
    /// It records every update as applied and applies none: it claims versions it does not hold.
    LieVersion,
    /// It claims the next row (`(own + 1) mod n`) and answers with its own row's results.
    WrongRow,
    /// Answers forward products honestly and scales its backward (transpose) products by
    /// 1 + 1e-3: only the check of backward rounds catches it.
    BackwardOnly,
}

/// Listen addresses: each TCP one, plus QUIC, WebSocket and WebRTC-direct on the same host.
fn expand_listen(listen: &[Multiaddr], all: bool) -> Vec<Multiaddr> {
    use libp2p::multiaddr::Protocol;
    let mut out = listen.to_vec();
    if !all {
        return out;
    }
    for addr in listen {
        let Some(host) = addr.iter().next() else {
            continue;
        };
        if !matches!(host, Protocol::Ip4(_) | Protocol::Ip6(_))
            || !addr.iter().any(|p| matches!(p, Protocol::Tcp(_)))
        {
            continue;
        }
        let base = Multiaddr::empty().with(host);
        out.push(base.clone().with(Protocol::Udp(0)).with(Protocol::QuicV1));
        out.push(
            base.clone()
                .with(Protocol::Tcp(0))
                .with(Protocol::Ws("/".into())),
        );
        out.push(base.with(Protocol::Udp(0)).with(Protocol::WebRTCDirect));
    }
    out
}

/// A started network: the client, what peers send, and the node's full addresses.
struct Net {
    client: Client,
    inbound: tokio::sync::mpsc::Receiver<Inbound>,
    addrs: Vec<String>,
}

/// What a node serves: the manifest, its shard, and genesis rows still to hand out.
struct Holding {
    manifest: ModelManifest,
    manifest_bytes: Vec<u8>,
    shard: ShardSet,
    genesis: BTreeMap<u32, Arc<Vec<u8>>>,
}

/// Starts the swarm for a node with a data dir; prints its full addresses.
async fn start_network(opts: &NodeOptions, data: &DataDir) -> Result<Net> {
    let listen = expand_listen(&opts.listen, opts.all_transports);
    let webrtc = listen
        .iter()
        .any(|a| {
            a.iter()
                .any(|p| matches!(p, libp2p::multiaddr::Protocol::WebRTCDirect))
        })
        .then(|| data.webrtc_certificate())
        .transpose()?;
    let swarm = swarm::build(NetConfig {
        key: data.identity()?,
        webrtc,
        listen: listen.clone(),
        mdns: opts.mdns,
        probe: false,
    })
    .await?;
    let (client, inbound) = swarm::spawn(swarm);
    // Wait until every listener has its real addresses (ports, certhash), on every interface.
    let ips = crate::net::this_machine();
    let mut addrs = Vec::new();
    for _ in 0..100 {
        addrs = client.listen_addrs().await?;
        if crate::net::every_listener_reported(&listen, &addrs, &ips) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let full: Vec<String> = addrs
        .iter()
        .map(|a| with_peer(a, client.peer_id()).to_string())
        .collect();
    for a in &full {
        println!("listening: {a}");
    }
    Ok(Net {
        client,
        inbound,
        addrs: full,
    })
}

/// `codedmesh node`: restarts from the data dir, or joins through `--bootstrap` and takes a row.
pub async fn node(opts: NodeOptions) -> Result<()> {
    let gpu = open_device(opts.device).await?;
    let data = DataDir::open(&opts.data)?;
    if let (Some((manifest, bytes)), Some(shard)) = (data.manifest()?, data.shard()?) {
        check_shard(&shard, &manifest, shard.node as u32)?;
        eprintln!(
            "restarting with row {} of {} from {}",
            shard.node,
            manifest.name,
            data.path().display()
        );
        let holding = Holding {
            manifest,
            manifest_bytes: bytes,
            shard,
            genesis: BTreeMap::new(),
        };
        return serve(opts, data, holding, gpu).await;
    }
    let Some(bootstrap) = opts.bootstrap.clone() else {
        bail!(
            "{} holds no shard yet: give --bootstrap MULTIADDR of a mesh node to join",
            data.path().display()
        );
    };
    join::join(opts, gpu, data, bootstrap).await
}

/// The shard belongs to this manifest and row.
fn check_shard(shard: &ShardSet, manifest: &ModelManifest, row: u32) -> Result<()> {
    Ok(node_core::holder::check_shard(shard, manifest, row)?)
}

/// The GPU `choice` asks for, opened before anything else so a missing one fails at once.
async fn open_device(choice: DeviceChoice) -> Result<Option<Arc<Gpu>>> {
    Ok(Gpu::for_choice(choice)
        .await
        .context("--device gpu")?
        .map(Arc::new))
}

/// Starts the network (dialing the bootstrap, if any) and serves what the node holds.
async fn serve(
    opts: NodeOptions,
    data: DataDir,
    holding: Holding,
    gpu: Option<Arc<Gpu>>,
) -> Result<()> {
    let net = start_network(&opts, &data).await?;
    if let Some(b) = &opts.bootstrap
        && let Err(e) = net.client.dial(b.clone()).await
    {
        tracing::warn!("bootstrap {b}: {e:#}; trying again in the background");
        // The bootstrap may be starting too (a whole mesh restarted at once): keep trying,
        // waiting longer each time, until it answers.
        let (client, b) = (net.client.clone(), b.clone());
        tokio::spawn(async move {
            if dial_with_backoff(&client, &b, BOOTSTRAP_TRIES)
                .await
                .is_err()
            {
                tracing::warn!("bootstrap {b} never answered; waiting for peers to find this node");
            }
        });
    }
    server::run_server(&opts, gpu, net, data, holding).await
}

/// Times a restarted node tries its bootstrap address before waiting to be found.
const BOOTSTRAP_TRIES: u32 = 40;

/// Times a new node tries its bootstrap address before it gives up (about 2 minutes).
const JOIN_TRIES: u32 = 12;

/// Dials `addr` until it answers, waiting twice as long after each failure (0.5 s up to 15 s),
/// at most `tries` more times after a first failure; the last error when it never answers.
async fn dial_with_backoff(client: &Client, addr: &Multiaddr, tries: u32) -> Result<PeerId> {
    let mut wait = Duration::from_millis(500);
    let mut last = match client.dial(addr.clone()).await {
        Ok(peer) => return Ok(peer),
        Err(e) => e,
    };
    for _ in 0..tries {
        tracing::debug!("bootstrap {addr}: {last:#}; trying again in {wait:?}");
        tokio::time::sleep(wait).await;
        match client.dial(addr.clone()).await {
            Ok(peer) => {
                tracing::info!(%peer, "reached the bootstrap node");
                return Ok(peer);
            }
            Err(e) => last = e,
        }
        wait = (wait * 2).min(Duration::from_secs(15));
    }
    Err(last)
}

/// Resolves when the process is asked to stop: Ctrl-C (SIGINT) or SIGTERM.
pub async fn stop_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => {}
                    _ = term.recv() => {}
                }
            }
            Err(e) => {
                tracing::warn!("cannot listen for SIGTERM: {e}");
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}
