//! Group sessions on a native node ([`node_core::net::session`]): a member answers a leader's
//! steps on one long-lived stream, and a leader keeps one such stream per member while its group
//! works. Browser holders serve sessions too (node-web/src/node.rs); a holder that does not
//! speak the protocol (an older release) fails as a member, naming the protocol, and is replaced.

use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant};

use futures::{AsyncReadExt, StreamExt};
use libp2p::PeerId;
use libp2p_stream::OpenStreamError;
use node_core::holder;
use node_core::mesh::{MeshResponse, StepRefusal};
use node_core::net::session::{self, Answer, Ask, Outstanding, SessionError, protocol};
use node_core::protocol::StepRequest;
use tokio::sync::mpsc;

use crate::learning::ShardState;
use crate::row::read;
use crate::swarm::Client;

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
    tokio::spawn(async move {
        while let Some((peer, stream)) = incoming.next().await {
            let Ok(slot) = slots.clone().try_acquire_owned() else {
                tracing::warn!(%peer, "refusing a session: {MAX_SESSIONS} are open");
                continue;
            };
            let state = state.clone();
            tokio::spawn(async move {
                let (reader, writer) = stream.split();
                let served = session::serve(reader, writer, |version, request| {
                    compute(state.clone(), version, request)
                })
                .await;
                match served {
                    Ok(steps) => tracing::debug!(%peer, steps, "session closed"),
                    Err(e) => tracing::debug!(%peer, "session ended: {e}"),
                }
                drop(slot);
            });
        }
    });
    Ok(())
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

/// Where a link hands a member's answer: the ask's id, and the encoded step answer with the
/// member's compute time (µs), or why there is none.
pub type Deliver = Arc<dyn Fn(u64, Result<(Vec<u8>, u64), StepRefusal>) + Send + Sync>;

/// A leader's link to one member: asks go out in order on the member's session. Dropping it
/// closes the session.
#[derive(Debug, Clone)]
pub struct Link {
    tx: mpsc::UnboundedSender<(Instant, Ask)>,
}

impl Link {
    /// Opens a session with `peer` in the background on `runtime`; answers go to `deliver`.
    /// With `delay` (bench only), every ask and answer is held back by it, as a network would.
    pub fn open(
        runtime: &tokio::runtime::Handle,
        client: &Client,
        peer: PeerId,
        deliver: Deliver,
        delay: Duration,
    ) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        runtime.spawn(run(client.clone(), peer, rx, deliver, delay));
        Self { tx }
    }

    /// Sends an ask (answered through the link's `deliver`, an error included).
    pub fn ask(&self, ask: Ask) -> Result<(), String> {
        self.tx
            .send((Instant::now(), ask))
            .map_err(|_| "the member's session has stopped".to_string())
    }
}

async fn run(
    client: Client,
    peer: PeerId,
    mut asks: mpsc::UnboundedReceiver<(Instant, Ask)>,
    deliver: Deliver,
    delay: Duration,
) {
    let why = match client.control().open_stream(peer, protocol()).await {
        Ok(stream) => match converse(stream, &mut asks, &deliver, delay).await {
            Ok(()) => return, // the leader is done with the member
            Err(e) => e,
        },
        Err(OpenStreamError::UnsupportedProtocol(p)) => {
            format!("the holder does not speak {p}: it runs another release")
        }
        Err(e) => e.to_string(),
    };
    // A link that failed answers every later ask with why: its member is replaced.
    tracing::debug!(%peer, "session failed: {why}");
    while let Some((_, ask)) = asks.recv().await {
        deliver(ask.id, Err(why.clone().into()));
    }
}

/// Runs asks over an open session until the leader drops the link (`Ok`) or the stream fails;
/// asks left unanswered then get the error.
async fn converse(
    stream: libp2p::Stream,
    asks: &mut mpsc::UnboundedReceiver<(Instant, Ask)>,
    deliver: &Deliver,
    delay: Duration,
) -> Result<(), String> {
    let (mut reader, mut writer) = stream.split();
    let outstanding = Mutex::new(Outstanding::default());
    let lock = || outstanding.lock().unwrap_or_else(PoisonError::into_inner);
    let send = async {
        while let Some((queued, ask)) = asks.recv().await {
            let id = ask.id;
            let frame = match session::frame(&ask) {
                Ok(frame) => frame,
                Err(e) => {
                    deliver(id, Err(e.to_string().into()));
                    continue;
                }
            };
            lock().sent(id);
            if !delay.is_zero() {
                tokio::time::sleep_until((queued + delay).into()).await;
            }
            session::write_frame(&mut writer, &frame).await?;
        }
        Ok::<_, SessionError>(())
    };
    let receive = async {
        let mut buf = Vec::new();
        loop {
            let Some(answer) = session::read_frame::<Answer, _>(&mut reader, &mut buf).await?
            else {
                return Err::<(), _>(SessionError::Io(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "the member closed its session",
                )));
            };
            lock().answered(answer.id)?;
            hand_over(deliver, answer.id, answer.response.into_step(), delay);
        }
    };
    let why = tokio::select! {
        sent = send => match sent {
            Ok(()) => return Ok(()),
            Err(e) => e.to_string(),
        },
        Err(e) = receive => e.to_string(),
    };
    for id in lock().drain() {
        deliver(id, Err(why.clone().into()));
    }
    Err(why)
}

/// Delivers an answer, after the bench's delay when one is set.
fn hand_over(
    deliver: &Deliver,
    id: u64,
    answer: Result<(Vec<u8>, u64), StepRefusal>,
    delay: Duration,
) {
    if delay.is_zero() {
        return deliver(id, answer);
    }
    let deliver = deliver.clone();
    tokio::spawn(async move {
        tokio::time::sleep(delay).await;
        deliver(id, answer);
    });
}
