//! Group sessions on a native node ([`node_core::net::session`]): a member answers a leader's
//! steps on one long-lived stream, and a leader keeps one such stream per member while its group
//! works. Browser holders serve sessions too (node-web/src/node/mod.rs); a holder that does not
//! speak the protocol (an older release) fails as a member, naming the protocol, and is replaced.

pub mod local;

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, RwLock};

use futures::{AsyncRead, AsyncReadExt, AsyncWrite, StreamExt};
use libp2p::PeerId;
use libp2p_stream::OpenStreamError;
use node_core::holder;
use node_core::mesh::MeshResponse;
use node_core::net::asks::SessionAsks;
use node_core::net::link::SessionLink;
use node_core::net::session::{self, protocol};
use node_core::protocol::StepRequest;

use crate::hold::learning::ShardState;
use crate::hold::learning::read;
use crate::net::swarm::{Client, open_accepted};

/// Sessions a node serves at once; streams beyond are closed at once (their leaders see the
/// member fail and ask another).
const MAX_SESSIONS: usize = 256;

/// Sessions one peer may have open with this node at once: a leader's serving groups, its
/// trainer's and a hop group's (another release's or a liar's streams beyond are closed).
const MAX_PEER_SESSIONS: usize = 32;

/// A session one peer holds with this node; given back when dropped.
struct PeerSlot {
    counts: Arc<std::sync::Mutex<std::collections::HashMap<PeerId, usize>>>,
    peer: PeerId,
}

impl PeerSlot {
    /// A slot for `peer`, if it holds fewer than [`MAX_PEER_SESSIONS`].
    fn take(
        counts: &Arc<std::sync::Mutex<std::collections::HashMap<PeerId, usize>>>,
        peer: PeerId,
    ) -> Option<Self> {
        let mut c = counts
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let n = c.entry(peer).or_default();
        if *n >= MAX_PEER_SESSIONS {
            return None;
        }
        *n += 1;
        Some(Self {
            counts: counts.clone(),
            peer,
        })
    }
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut c = (self.counts.lock()).unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(n) = c.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                c.remove(&self.peer);
            }
        }
    }
}

/// Step requests carrying up to this many values (a decode step's activations, drafted tokens
/// included) are computed on the asking task; larger ones (prefill) on the blocking pool.
pub(crate) const INLINE_STEP_VALUES: usize = 16 << 10;

/// Answers the steps of every leader that opens a session with this node, on `state`.
pub fn serve(client: &Client, state: Arc<RwLock<ShardState>>) -> anyhow::Result<()> {
    let mut incoming = client
        .control()
        .accept(protocol())
        .map_err(|e| anyhow::anyhow!("accepting sessions: {e}"))?;
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_SESSIONS));
    crate::hold::session::local::serve(client, slots.clone(), state.clone());
    let per_peer: Arc<std::sync::Mutex<std::collections::HashMap<PeerId, usize>>> = Arc::default();
    tokio::spawn(async move {
        while let Some((peer, stream)) = incoming.next().await {
            let Some(mine) = PeerSlot::take(&per_peer, peer) else {
                tracing::warn!(%peer, "refusing a session: {MAX_PEER_SESSIONS} of its own are open");
                continue;
            };
            let Ok(slot) = slots.clone().try_acquire_owned() else {
                tracing::warn!(%peer, "refusing a session: {MAX_SESSIONS} are open");
                continue;
            };
            let state = state.clone();
            tokio::spawn(async move {
                let (reader, mut writer) = stream.split();
                match session::accepted(&mut writer).await {
                    Ok(()) => serve_one(reader, writer, state).await,
                    Err(e) => tracing::debug!(%peer, "session ended: {e}"),
                }
                drop((slot, mine));
            });
        }
    });
    Ok(())
}

/// Answers one leader's session on `reader` and `writer` until it ends.
pub async fn serve_one(
    reader: impl AsyncRead + Unpin,
    writer: impl AsyncWrite + Unpin,
    state: Arc<RwLock<ShardState>>,
) {
    let served = session::serve(reader, writer, |version, request| {
        compute(state.clone(), version, request)
    })
    .await;
    match served {
        Ok(steps) => tracing::debug!(steps, "session closed"),
        Err(e) => tracing::debug!("session ended: {e}"),
    }
}

/// One step on this node's shard, asked on a session or in a request: decode steps on the
/// calling task (a fraction of a millisecond; no thread hand-off), prefill steps on the pool.
pub async fn compute(
    state: Arc<RwLock<ShardState>>,
    version: [u8; 32],
    request: StepRequest,
) -> MeshResponse {
    if request.values() <= INLINE_STEP_VALUES {
        return holder::step(&read(&state), &version, &request);
    }
    tokio::task::spawn_blocking(move || holder::step(&read(&state), &version, &request))
        .await
        .unwrap_or_else(|e| MeshResponse::Error(e.to_string()))
}

/// A leader's link to one member's session ([`node_core::net::link`]), driven by the task that
/// runs the leader's rounds; it keeps whether the session runs over a local socket. Dropping it
/// closes the session.
pub type Link = SessionLink<Box<dyn SessionStream>, Opening, bool>;

/// A session's stream being opened in the background: the stream, and whether it is a local
/// socket.
pub type Opening =
    Pin<Box<dyn Future<Output = Result<(Box<dyn SessionStream>, bool), String>> + Send>>;

/// Sessions this process opened with members over a local socket (`/metrics`:
/// `codedmesh_sessions_local_total`).
pub static OPENED_LOCAL: std::sync::LazyLock<prometheus_client::metrics::counter::Counter> =
    std::sync::LazyLock::new(Default::default);

/// Sessions this process opened with members over libp2p (`codedmesh_sessions_libp2p_total`).
pub static OPENED_LIBP2P: std::sync::LazyLock<prometheus_client::metrics::counter::Counter> =
    std::sync::LazyLock::new(Default::default);

/// A leader's sessions with its members ([`node_core::net::asks`]), each opened by [`open`].
pub type Sessions = SessionAsks<Box<dyn SessionStream>, Opening, bool, Opener>;

/// What opens a leader's session with a peer.
pub type Opener = Box<dyn Fn(PeerId) -> Opening + Send + Sync>;

/// A leader's sessions at `version` with the holders of `peers` (row → peer), opened on
/// `runtime` through `client`.
pub fn sessions(
    runtime: tokio::runtime::Handle,
    client: Client,
    version: [u8; 32],
    peers: std::collections::BTreeMap<usize, PeerId>,
) -> Sessions {
    SessionAsks::new(
        version,
        peers,
        Box::new(move |peer| open(&runtime, &client, peer)),
    )
}

/// Starts opening a session with `peer` on `runtime`: over its local socket where it offers
/// one this process reaches ([`crate::hold::session::local`]), else over libp2p; each counted.
pub fn open(runtime: &tokio::runtime::Handle, client: &Client, peer: PeerId) -> Opening {
    let mut control = client.control();
    let open = runtime.spawn(async move {
        if crate::hold::session::local::enabled() {
            match crate::hold::session::local::open(&mut control, peer).await {
                Ok(socket) => {
                    tracing::debug!(%peer, "session over the local socket");
                    OPENED_LOCAL.inc();
                    return Ok((Box::new(socket) as Box<dyn SessionStream>, true));
                }
                Err(e) => tracing::debug!(%peer, "session over libp2p: no local socket ({e})"),
            }
        }
        match open_accepted(&mut control, peer, protocol()).await {
            Ok(stream) => {
                OPENED_LIBP2P.inc();
                Ok((Box::new(stream) as Box<dyn SessionStream>, false))
            }
            Err(OpenStreamError::UnsupportedProtocol(p)) => Err(format!(
                "{peer} does not speak {p}: it runs another release"
            )),
            Err(e) => Err(format!("{peer}: {e}")),
        }
    });
    Box::pin(async move { open.await.map_err(|e| e.to_string())? })
}

/// Whether a session is open over libp2p, not a local socket (the member is not known to be
/// on this machine).
pub fn over_libp2p(link: &Link) -> bool {
    link.opened() == Some(&false)
}

/// A stream a session runs on: libp2p's, or a local socket.
pub trait SessionStream: AsyncRead + AsyncWrite + Unpin + Send + std::fmt::Debug {}

impl<T: AsyncRead + AsyncWrite + Unpin + Send + std::fmt::Debug> SessionStream for T {}
