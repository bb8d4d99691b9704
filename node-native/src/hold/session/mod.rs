//! Group sessions on a native node ([`node_core::net::session`]): a member answers a leader's
//! steps on one long-lived stream, and a leader keeps one such stream per member while its group
//! works. Browser holders serve sessions too (node-web/src/node/mod.rs); a holder that does not
//! speak the protocol (an older release) fails as a member, naming the protocol, and is replaced.

pub mod local;

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::task::{Context, Poll};
use std::time::Instant;

use futures::{AsyncRead, AsyncReadExt, AsyncWrite, StreamExt};
use libp2p::PeerId;
use libp2p_stream::OpenStreamError;
use node_core::holder;
use node_core::mesh::{MeshResponse, StepRefusal};
use node_core::net::session::{self, Ask, Driven, protocol};
use node_core::protocol::StepRequest;

use crate::hold::learning::ShardState;
use crate::hold::learning::read;
use crate::net::swarm::{Client, open_accepted};

/// Sessions a node serves at once; streams beyond are closed at once (their leaders see the
/// member fail and ask another).
const MAX_SESSIONS: usize = 256;

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
    tokio::spawn(async move {
        while let Some((peer, stream)) = incoming.next().await {
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
                drop(slot);
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

/// A leader's link to one member's session, driven by the task that runs the leader's rounds:
/// it has no task of its own, so an ask and its answer cost no hand-off between tasks. The
/// stream is opened in the background when the link is made. Dropping it closes the session.
#[derive(Debug)]
pub struct Link {
    peer: PeerId,
    state: LinkState,
}

#[derive(Debug)]
enum LinkState {
    /// The stream is being opened; asks wait for it.
    Opening {
        open: tokio::task::JoinHandle<Result<Opened, OpenStreamError>>,
        queued: Vec<(Ask, Instant)>,
    },
    /// Open (in a mutex only to be `Sync`: it is reached only through `&mut`, which takes no
    /// lock), and whether over a local socket.
    Open(Box<Mutex<Driven<Box<dyn SessionStream>>>>, bool),
    /// The session failed: every ask is answered with why, and the member is replaced.
    Failed(String),
}

impl Link {
    /// Starts opening a session with `peer` on `runtime`: over its local socket where it
    /// offers one this process reaches ([`crate::hold::session::local`]), else over libp2p.
    pub fn open(runtime: &tokio::runtime::Handle, client: &Client, peer: PeerId) -> Self {
        let mut control = client.control();
        let open = runtime.spawn(async move {
            if crate::hold::session::local::enabled() {
                match crate::hold::session::local::open(&mut control, peer).await {
                    Ok(socket) => {
                        tracing::debug!(%peer, "session over the local socket");
                        return Ok((Box::new(socket) as Box<dyn SessionStream>, true));
                    }
                    Err(e) => tracing::debug!(%peer, "session over libp2p: no local socket ({e})"),
                }
            }
            let stream = open_accepted(&mut control, peer, protocol()).await?;
            Ok((Box::new(stream) as Box<dyn SessionStream>, false))
        });
        Self {
            peer,
            state: LinkState::Opening {
                open,
                queued: Vec::new(),
            },
        }
    }

    /// Queues an ask, to go out from `not_before` on as the link is next polled; why not,
    /// when the session has failed.
    pub fn ask(&mut self, ask: Ask, not_before: Instant) -> Result<(), String> {
        match &mut self.state {
            LinkState::Opening { queued, .. } => {
                queued.push((ask, not_before));
                Ok(())
            }
            LinkState::Open(session, _) => driven(session)
                .ask(&ask, not_before)
                .map_err(|e| e.to_string()),
            LinkState::Failed(why) => Err(why.clone()),
        }
    }

    /// Whether the session is open over libp2p, not a local socket (the member is not known
    /// to be on this machine).
    pub fn over_libp2p(&self) -> bool {
        matches!(self.state, LinkState::Open(_, false))
    }

    /// When the first ask held back (a bench's modelled delay) may go out, if one is.
    pub fn held_until(&mut self, now: Instant) -> Option<Instant> {
        match &mut self.state {
            LinkState::Opening { queued, .. } => queued
                .iter()
                .map(|(_, at)| *at)
                .filter(|at| *at > now)
                .min(),
            LinkState::Open(session, _) => driven(session).held_until(now),
            LinkState::Failed(_) => None,
        }
    }

    /// Writes what is due and hands every answer that came to `answer` (the ask's id, and the
    /// encoded answer with the member's compute time in µs, or why there is none); registers
    /// `cx` for what comes next.
    pub fn poll(
        &mut self,
        cx: &mut Context<'_>,
        now: Instant,
        answer: &mut impl FnMut(u64, Result<(Vec<u8>, u64), StepRefusal>),
    ) {
        if let LinkState::Opening { open, queued } = &mut self.state {
            let Poll::Ready(opened) = Pin::new(open).poll(cx) else {
                return;
            };
            let opened = match opened {
                Ok(Ok(stream)) => Ok(stream),
                Ok(Err(OpenStreamError::UnsupportedProtocol(p))) => Err(format!(
                    "the holder does not speak {p}: it runs another release"
                )),
                Ok(Err(e)) => Err(e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            let queued = std::mem::take(queued);
            match opened {
                Ok((stream, local)) => {
                    let mut session = Driven::new(stream);
                    for (ask, at) in queued {
                        if let Err(e) = session.ask(&ask, at) {
                            answer(ask.id, Err(e.to_string().into()));
                        }
                    }
                    self.state = LinkState::Open(Box::new(Mutex::new(session)), local);
                }
                Err(why) => {
                    tracing::debug!(peer = %self.peer, "session failed: {why}");
                    for (ask, _) in queued {
                        answer(ask.id, Err(why.clone().into()));
                    }
                    self.state = LinkState::Failed(why);
                    return;
                }
            }
        }
        let LinkState::Open(session, _) = &mut self.state else {
            return;
        };
        let session = driven(session);
        loop {
            match session.poll_answer(cx, now) {
                Poll::Ready(Ok(got)) => answer(got.id, got.response.into_step()),
                Poll::Ready(Err(e)) => {
                    let why = e.to_string();
                    tracing::debug!(peer = %self.peer, "session failed: {why}");
                    for id in session.unanswered() {
                        answer(id, Err(why.clone().into()));
                    }
                    self.state = LinkState::Failed(why);
                    return;
                }
                Poll::Pending => return,
            }
        }
    }
}

/// A session's stream, and whether it is a local socket.
type Opened = (Box<dyn SessionStream>, bool);

/// A stream a session runs on: libp2p's, or a local socket.
pub trait SessionStream: AsyncRead + AsyncWrite + Unpin + Send + std::fmt::Debug {}

impl<T: AsyncRead + AsyncWrite + Unpin + Send + std::fmt::Debug> SessionStream for T {}

fn driven(
    session: &mut Mutex<Driven<Box<dyn SessionStream>>>,
) -> &mut Driven<Box<dyn SessionStream>> {
    session.get_mut().unwrap_or_else(PoisonError::into_inner)
}
