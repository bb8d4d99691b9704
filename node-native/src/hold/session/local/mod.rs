//! Group sessions between nodes on one machine over a Unix socket instead of their libp2p
//! connection ([`crate::hold::session`]): a round then costs no Noise encryption, no yamux framing
//! and no wake-up of the connection's task on either side.
//!
//! A member listens on a socket in Linux's abstract namespace (no file to leave behind, gone
//! with the process, private to its network namespace, so nodes in other namespaces, as on
//! other hosts, keep to libp2p). It offers the socket's name with two one-time tokens on an
//! authenticated libp2p stream. The leader connects and sends the first token (it got the
//! offer); the member answers with the second (it made the offer). Then the session's frames
//! run on the socket as they would on the libp2p stream. Where any of that fails (another
//! host, another release, a browser member, another platform) the leader opens the session
//! over libp2p, as before.
//!
//! Where each process of a stream has a core of its own (`up` and the bench set [`SPIN_VAR`]
//! then), both sides poll the socket for a while before they sleep: a member serves each
//! session on a thread of its own, outside the runtime, and a leader that has computed its own
//! row polls for the answers. An ask or answer that comes within the poll then wakes nobody.
//! Such a session's frames go through shared memory (`ring.rs`): the leader hands the member a
//! ring each way once the handshake is done, and the socket only wakes a side that sleeps.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use futures::{AsyncWriteExt, StreamExt};
use libp2p::{PeerId, StreamProtocol};
use node_core::net::session::{FrameReader, accepted, frame, read_frame, write_frame};
#[cfg(target_os = "linux")]
use node_core::protocol::StepRequest;
use serde::{Deserialize, Serialize};

use crate::hold::learning::ShardState;
#[cfg(target_os = "linux")]
use crate::hold::learning::read;
use crate::net::swarm::Client;
use crate::net::swarm::open_accepted;

/// The protocol a member offers its socket on.
/// (2: the member writes [`node_core::net::session::ACCEPTED`] first; 3: offers say whether
/// the member takes shared memory.)
pub const OFFER_PROTOCOL: &str = "/codedmesh/session-local/3";

/// Set to `0` to keep every session on libp2p (to measure what the socket saves).
pub const LOCAL_VAR: &str = "CODEDMESH_LOCAL_SESSIONS";

/// Set to `0` to keep a polling session's frames on its socket, not in shared memory (to
/// measure what the memory saves).
pub const MEMORY_VAR: &str = "CODEDMESH_SESSION_MEMORY";

/// Microseconds a local session's side polls its socket for the next frame before it sleeps
/// (unset or 0: it sleeps at once).
pub const SPIN_VAR: &str = "CODEDMESH_SPIN_US";

/// The poll `up` and the bench give their nodes where every process of a stream has a core:
/// on two cores, 150 µs beat 400 (docs/perf-history.md, "Sessions that poll before they sleep").
pub const SPIN_US: u64 = 150;

/// How long a session that polls polls after a pass's LM head (the leader samples first).
pub const POLL_AFTER_HEAD: Duration = Duration::from_micros(1200);

/// Shared memory a peer handed over or wrote that this node refused (memory that may shrink or
/// is another size, a hand-over that means nothing, a position past a ring): `/metrics`'
/// `codedmesh_frames_refused_total{reason="session_memory"}`.
pub static MEMORY_REFUSED: AtomicU64 = AtomicU64::new(0);

/// Longest poll [`SPIN_VAR`] may set.
const MAX_SPIN_US: u64 = 10_000;

/// This process's poll in microseconds; [`SPIN_UNSET`] until read from [`SPIN_VAR`].
static SPIN: AtomicU64 = AtomicU64::new(SPIN_UNSET);
const SPIN_UNSET: u64 = u64::MAX;

/// Bytes of each one-time token.
const TOKEN: usize = 16;

/// Offers not yet taken up that a member keeps; the oldest lapses beyond.
const MAX_PENDING: usize = 1024;

/// How long each side waits for the other's part of the handshake.
const HANDSHAKE: Duration = Duration::from_secs(5);

/// Longest offer frame a leader reads (a name and two tokens).
const MAX_OFFER_BYTES: usize = 512;

/// A member's offer: where its socket is and the tokens that open it once.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Offer {
    /// The socket's name in the abstract namespace.
    pub name: String,
    /// What the leader sends first.
    pub ask: [u8; TOKEN],
    /// What the member answers with.
    pub answer: [u8; TOKEN],
    /// The member polls (it serves each session on a thread of its own) and takes the
    /// session's frames through shared memory: the leader says whether it hands some over.
    pub ring: bool,
}

/// Why a session could not go over the local socket (the leader then uses libp2p).
#[derive(Debug, thiserror::Error)]
pub enum LocalError {
    /// The socket or the stream failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The member does not offer a socket.
    #[error("no offer: {0}")]
    NoOffer(String),
    /// The offer did not decode.
    #[error("offer: {0}")]
    Offer(#[from] node_core::net::session::SessionError),
    /// The other side did not answer in time.
    #[error("the handshake timed out")]
    TimedOut,
    /// The process at the socket did not prove it made the offer.
    #[error("the socket's answer does not match the offer")]
    WrongAnswer,
    /// Abstract sockets are Linux's.
    #[error("local sessions need Linux")]
    Unsupported,
}

/// Whether this process uses local sessions (unless [`LOCAL_VAR`] is `0`).
pub fn enabled() -> bool {
    std::env::var(LOCAL_VAR).map_or(true, |v| v.trim() != "0")
}

/// How long this process's local sessions poll their sockets before they sleep ([`SPIN_VAR`]
/// or [`set_spin`]); `None`: not at all.
pub fn spin() -> Option<Duration> {
    let mut us = SPIN.load(Ordering::Relaxed);
    if us == SPIN_UNSET {
        us = spin_from(std::env::var(SPIN_VAR).ok().as_deref());
        SPIN.store(us, Ordering::Relaxed);
    }
    (us > 0).then(|| Duration::from_micros(us))
}

/// Sets how long this process's local sessions poll (the bench's own leader); `None`: not at
/// all.
pub fn set_spin(spin: Option<Duration>) {
    let us = spin.map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(MAX_SPIN_US));
    SPIN.store(us.min(MAX_SPIN_US), Ordering::Relaxed);
}

/// Microseconds of poll a [`SPIN_VAR`] value asks for (0 for none, or for a value that is not
/// a number, which is logged).
fn spin_from(value: Option<&str>) -> u64 {
    let Some(value) = value else { return 0 };
    match value.trim().parse::<u64>() {
        Ok(us) => us.min(MAX_SPIN_US),
        Err(_) => {
            tracing::warn!(
                "{SPIN_VAR}={value:?} is not a number of microseconds: sessions sleep at once"
            );
            0
        }
    }
}

/// Offers made and not yet taken up, oldest first.
#[derive(Debug, Default)]
pub struct Pending {
    offers: VecDeque<([u8; TOKEN], [u8; TOKEN])>,
    /// Whether the offers say the member takes shared memory.
    ring: bool,
}

impl Pending {
    /// Offers that say the member takes shared memory, or not.
    pub fn with_ring(ring: bool) -> Self {
        Self {
            ring,
            ..Self::default()
        }
    }

    /// A new offer of `name`, remembered until it is taken up or lapses.
    pub fn offer(&mut self, name: &str) -> Offer {
        let (ask, answer) = (rand_webrtc::random(), rand_webrtc::random());
        if self.offers.len() == MAX_PENDING {
            self.offers.pop_front();
        }
        self.offers.push_back((ask, answer));
        Offer {
            name: name.to_owned(),
            ask,
            answer,
            ring: self.ring,
        }
    }

    /// Takes up the offer whose first token is `ask`: its answer, once.
    pub fn take(&mut self, ask: &[u8; TOKEN]) -> Option<[u8; TOKEN]> {
        let at = self.offers.iter().position(|(a, _)| a == ask)?;
        self.offers.remove(at).map(|(_, answer)| answer)
    }
}

/// Answers sessions on a local socket as well as on libp2p: offers the socket to every leader
/// that asks. A socket that cannot be made is logged, and sessions stay on libp2p.
pub fn serve(client: &Client, slots: Arc<tokio::sync::Semaphore>, state: Arc<RwLock<ShardState>>) {
    if !enabled() {
        return;
    }
    let name = format!(
        "codedmesh/session/{}/{:016x}",
        client.peer_id(),
        rand_webrtc::random::<u64>()
    );
    let listener = match platform::listen(&name) {
        Ok(listener) => listener,
        Err(e) => {
            tracing::info!("sessions stay on libp2p: no local socket ({e})");
            return;
        }
    };
    let mut offers = match client.control().accept(StreamProtocol::new(OFFER_PROTOCOL)) {
        Ok(offers) => offers,
        Err(e) => {
            tracing::warn!("sessions stay on libp2p: {e}");
            return;
        }
    };
    let on_thread = on_thread(state.clone());
    let pending = Arc::new(Mutex::new(Pending::with_ring(on_thread.is_some())));
    let offered = pending.clone();
    tokio::spawn(async move {
        while let Some((peer, mut stream)) = offers.next().await {
            let offer = lock(&offered).offer(&name);
            tokio::spawn(async move {
                let sent = async {
                    accepted(&mut stream).await?;
                    write_frame(&mut stream, &frame(&offer)?).await?;
                    stream.close().await?;
                    Ok::<_, LocalError>(())
                };
                match tokio::time::timeout(HANDSHAKE, sent).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => tracing::debug!(%peer, "offering the local socket: {e}"),
                    Err(_) => tracing::debug!(%peer, "offering the local socket timed out"),
                }
            });
        }
    });
    tokio::spawn(platform::accept(
        listener,
        pending,
        slots,
        move |reader, writer| crate::hold::session::serve_one(reader, writer, state.clone()),
        on_thread,
    ));
}

/// Where this process's sessions poll ([`spin`]): what serves each one on a thread of its own.
#[cfg(target_os = "linux")]
fn on_thread(
    state: Arc<RwLock<ShardState>>,
) -> Option<impl Fn(platform::Stream) + Clone + Send + 'static> {
    let spin = spin()?;
    Some(move |stream: platform::Stream| {
        let step = |version: [u8; 32], request: StepRequest| {
            let state = read(&state);
            std::future::ready(node_core::holder::step(&state, &version, &request))
        };
        match platform::serve_polling(&stream, spin, step) {
            Ok(steps) => tracing::debug!(steps, "local session closed"),
            Err(e) => tracing::debug!("local session ended: {e}"),
        }
    })
}

/// No local sessions off Linux.
#[cfg(not(target_os = "linux"))]
fn on_thread(_: Arc<RwLock<ShardState>>) -> Option<fn(platform::Stream)> {
    None
}

/// Opens a session with `peer` over its local socket, if it offers one this process reaches.
pub async fn open(
    control: &mut libp2p_stream::Control,
    peer: PeerId,
) -> Result<platform::Socket, LocalError> {
    let offer = tokio::time::timeout(HANDSHAKE, async {
        let mut stream = open_accepted(control, peer, StreamProtocol::new(OFFER_PROTOCOL))
            .await
            .map_err(|e| LocalError::NoOffer(e.to_string()))?;
        let mut limited = futures::AsyncReadExt::take(&mut stream, MAX_OFFER_BYTES as u64);
        let offer = read_frame::<Offer, _>(&mut limited, &mut FrameReader::default())
            .await?
            .ok_or_else(|| LocalError::NoOffer("the member closed the stream".into()))?;
        Ok::<_, LocalError>(offer)
    })
    .await
    .map_err(|_| LocalError::TimedOut)??;
    let shared = spin().is_some() && std::env::var(MEMORY_VAR).map_or(true, |v| v.trim() != "0");
    platform::connect(offer, shared).await
}

/// Runs `f`, a poll of local sessions that the caller repeats at once while it polls
/// ([`spin`]): a session whose shared memory holds nothing then does not ask the member to ring
/// it, as it would before sleeping. The caller's last poll before it sleeps is not in one.
pub fn polling<T>(f: impl FnOnce() -> T) -> T {
    #[cfg(target_os = "linux")]
    return platform::polling(f);
    #[cfg(not(target_os = "linux"))]
    f()
}

fn lock(pending: &Mutex<Pending>) -> std::sync::MutexGuard<'_, Pending> {
    pending.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(target_os = "linux")]
#[path = "linux.rs"]
mod platform;
#[cfg(target_os = "linux")]
mod ring;

#[cfg(not(target_os = "linux"))]
mod platform {
    use std::sync::{Arc, Mutex};

    use super::{LocalError, Offer, Pending};

    /// A leader's end of a local session (none on this platform).
    pub type Socket = libp2p::Stream;

    /// A member's end of a local session on a thread of its own (none on this platform).
    pub enum Stream {}

    /// No listener on this platform.
    pub enum Listener {}

    pub fn listen(_: &str) -> std::io::Result<Listener> {
        Err(std::io::ErrorKind::Unsupported.into())
    }

    pub async fn accept<F, T>(
        listener: Listener,
        _: Arc<Mutex<Pending>>,
        _: Arc<tokio::sync::Semaphore>,
        _: F,
        _: Option<T>,
    ) {
        match listener {}
    }

    pub async fn connect(_: Offer, _: bool) -> Result<Socket, LocalError> {
        Err(LocalError::Unsupported)
    }
}

#[cfg(test)]
#[cfg(target_os = "linux")]
mod tests {
    use std::time::Instant;

    use node_core::mesh::MeshResponse;
    use node_core::model::Stage;
    use node_core::net::session::{Ask, Driven};
    use node_core::protocol::{self, StepRequest};

    use super::*;

    /// A member that answers a product with the sum of its input.
    async fn sum(_: [u8; 32], step: StepRequest) -> MeshResponse {
        match step {
            StepRequest::Matmul { x, .. } => MeshResponse::Step {
                bytes: x.iter().sum::<f32>().to_le_bytes().to_vec(),
                compute_us: 1,
            },
            _ => MeshResponse::Error("not a product".into()),
        }
    }

    /// A member that answers a product with its input's bytes.
    async fn echo(_: [u8; 32], step: StepRequest) -> MeshResponse {
        match step {
            StepRequest::Matmul { x, .. } => MeshResponse::Step {
                bytes: x.iter().flat_map(|v| v.to_le_bytes()).collect(),
                compute_us: 1,
            },
            _ => MeshResponse::Error("not a product".into()),
        }
    }

    /// A member's socket under a name of its own, answering with `sum`; its pending offers.
    fn member(test: &str) -> (String, Arc<Mutex<Pending>>) {
        member_with(test, sum, None)
    }

    /// [`member`], answering with `compute`: on the runtime, or on a thread of its own for
    /// each session that polls for `spin` before it blocks.
    fn member_with<F, Fut>(
        test: &str,
        compute: F,
        spin: Option<Duration>,
    ) -> (String, Arc<Mutex<Pending>>)
    where
        F: Fn([u8; 32], StepRequest) -> Fut + Copy + Send + Sync + 'static,
        Fut: std::future::Future<Output = MeshResponse> + Send,
    {
        let name = format!(
            "codedmesh/test/{}/{test}/{:016x}",
            std::process::id(),
            rand_webrtc::random::<u64>()
        );
        let listener = platform::listen(&name).unwrap();
        let pending = Arc::new(Mutex::new(Pending::with_ring(spin.is_some())));
        let slots = Arc::new(tokio::sync::Semaphore::new(4));
        tokio::spawn(platform::accept(
            listener,
            pending.clone(),
            slots,
            move |reader, writer| async move {
                node_core::net::session::serve(reader, writer, compute)
                    .await
                    .unwrap();
            },
            spin.map(|spin| {
                move |stream: platform::Stream| {
                    platform::serve_polling(&stream, spin, compute).unwrap();
                }
            }),
        ));
        (name, pending)
    }

    /// Asks for the sum of `x` on a session over `socket`.
    async fn ask_sum(socket: platform::Socket, x: Vec<f32>) -> f32 {
        sum_on(&mut Driven::new(socket), 9, x).await
    }

    /// Asks for the sum of `x` as ask `id` on `session`, and checks the answer is to that ask.
    async fn sum_on(session: &mut Driven<platform::Socket>, id: u64, x: Vec<f32>) -> f32 {
        let step = protocol::encode(&StepRequest::Matmul {
            stage: Stage::Qkv(0),
            t: 1,
            x,
        })
        .unwrap();
        let ask = Ask {
            id,
            version: [0; 32],
            step,
        };
        session.ask(&ask, Instant::now()).unwrap();
        let answer = std::future::poll_fn(|cx| session.poll_answer(cx, Instant::now()));
        let answer = tokio::time::timeout(Duration::from_secs(10), answer)
            .await
            .unwrap_or_else(|_| panic!("no answer to ask {id}"))
            .unwrap();
        assert_eq!(answer.id, id);
        let (bytes, _) = answer.response.into_step().unwrap();
        f32::from_le_bytes(bytes.try_into().unwrap())
    }

    #[tokio::test]
    async fn an_offer_opens_one_session_once() {
        let (name, pending) = member("once");
        let offer = lock(&pending).offer(&name);
        let socket = platform::connect(offer.clone(), false).await.unwrap();
        assert_eq!(ask_sum(socket, vec![1.0, 2.0, 3.5]).await, 6.5);
        // Taken up: the same tokens again are turned away.
        let again = platform::connect(offer, false).await;
        assert!(matches!(again, Err(LocalError::Io(_))), "{again:?}");
    }

    #[tokio::test]
    async fn strangers_are_turned_away_and_the_offer_stands() {
        let (name, pending) = member("strangers");
        let offer = lock(&pending).offer(&name);
        // A token the member never offered: it closes the socket.
        let forged = Offer {
            ask: [0; TOKEN],
            ..offer.clone()
        };
        let refused = platform::connect(forged, false).await;
        assert!(matches!(refused, Err(LocalError::Io(_))), "{refused:?}");
        // Another process at the name, which cannot answer with the offer's second token.
        let impostor = Offer {
            answer: [1; TOKEN],
            ..lock(&pending).offer(&name)
        };
        let refused = platform::connect(impostor, false).await;
        assert!(
            matches!(refused, Err(LocalError::WrongAnswer)),
            "{refused:?}"
        );
        // The first offer still opens a session.
        let socket = platform::connect(offer, false).await.unwrap();
        assert_eq!(ask_sum(socket, vec![2.0; 4]).await, 8.0);
    }

    /// A member that serves its session on a thread of its own answers asks that come while
    /// it polls and asks that come after it has gone to sleep: over the socket, and through
    /// shared memory (the leader then polls too, and sleeps between asks).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_session_on_a_thread_of_its_own_answers_while_it_polls_and_after() {
        for shared in [false, true] {
            let (name, pending) = member_with("thread", sum, Some(Duration::from_millis(2)));
            let offer = lock(&pending).offer(&name);
            let socket = platform::connect(offer, shared).await.unwrap();
            assert_eq!(socket.get_ref().get_ref().shared(), shared);
            let mut session = Driven::new(socket);
            for (id, pause) in [(1u64, 0), (2, 0), (3, 50), (4, 0), (5, 50)] {
                tokio::time::sleep(Duration::from_millis(pause)).await;
                let sum = sum_on(&mut session, id, vec![id as f32; 3]).await;
                assert_eq!(sum, 3.0 * id as f32);
            }
        }
    }

    /// Asks and answers many times the socket's buffer, several at once each way: the writes
    /// that find the socket full wait for room and go on, and nothing is lost or reordered.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn frames_larger_than_the_socket_buffer_go_through_both_ways() {
        large_frames(None, false).await;
    }

    /// [`frames_larger_than_the_socket_buffer_go_through_both_ways`] with the member's session
    /// on a thread of its own, which blocks while it writes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn large_frames_go_through_a_session_on_a_thread_of_its_own() {
        large_frames(Some(Duration::from_micros(150)), false).await;
    }

    /// The same through the session's shared memory: frames four times its rings, several
    /// at once each way, so each side waits for room and is rung.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn large_frames_go_through_shared_memory_both_ways() {
        large_frames(Some(Duration::from_micros(150)), true).await;
    }

    async fn large_frames(spin: Option<Duration>, shared: bool) {
        let (name, pending) = member_with("large", echo, spin);
        let offer = lock(&pending).offer(&name);
        let mut session = Driven::new(platform::connect(offer, shared).await.unwrap());
        let inputs: Vec<Vec<f32>> = (0..3)
            .map(|a| (0..(1 << 20)).map(|i| (i * 7 + a) as f32).collect())
            .collect();
        for (id, x) in inputs.iter().enumerate() {
            let step = protocol::encode(&StepRequest::Matmul {
                stage: Stage::Qkv(0),
                t: 1,
                x: x.clone(),
            })
            .unwrap();
            let ask = Ask {
                id: id as u64,
                version: [0; 32],
                step,
            };
            session.ask(&ask, Instant::now()).unwrap();
        }
        for (id, x) in inputs.iter().enumerate() {
            let answer = std::future::poll_fn(|cx| session.poll_answer(cx, Instant::now()));
            let answer = tokio::time::timeout(std::time::Duration::from_secs(60), answer)
                .await
                .unwrap_or_else(|_| panic!("the session stalled before answer {id}"))
                .unwrap();
            assert_eq!(answer.id, id as u64);
            let (bytes, _) = answer.response.into_step().unwrap();
            let got: Vec<f32> = bytes
                .as_chunks::<4>()
                .0
                .iter()
                .map(|b| f32::from_le_bytes(*b))
                .collect();
            assert!(got == *x, "answer {id} differs from its ask");
        }
    }

    #[tokio::test]
    async fn a_name_nobody_listens_on_fails_at_once() {
        let mut pending = Pending::default();
        let offer = pending.offer("codedmesh/test/nobody/listens/here");
        let failed = platform::connect(offer, false).await;
        assert!(matches!(failed, Err(LocalError::Io(_))), "{failed:?}");
    }

    #[test]
    fn the_poll_is_read_in_microseconds_bounded_and_longer_after_a_passs_lm_head() {
        let after = |stage, spin| {
            let ask = StepRequest::Matmul {
                stage,
                t: 1,
                x: vec![0.0; 4],
            };
            platform::poll_after(&ask, spin)
        };
        let spin = Duration::from_micros(SPIN_US);
        assert_eq!(after(Stage::Qkv(3), spin), spin);
        assert_eq!(after(Stage::LmHead, spin), POLL_AFTER_HEAD);
        assert_eq!(after(Stage::LmHead, Duration::ZERO), Duration::ZERO);
        assert_eq!(spin_from(None), 0);
        assert_eq!(spin_from(Some(" 150 ")), 150);
        assert_eq!(spin_from(Some("0")), 0);
        assert_eq!(spin_from(Some("1e9")), 0);
        assert_eq!(spin_from(Some("-5")), 0);
        assert_eq!(spin_from(Some("99999999")), MAX_SPIN_US);
    }

    #[test]
    fn the_oldest_offer_lapses_beyond_the_limit() {
        let mut pending = Pending::default();
        let first = pending.offer("x");
        let second = pending.offer("x");
        for _ in 2..MAX_PENDING {
            pending.offer("x");
        }
        assert!(pending.take(&first.ask).is_some());
        pending.offer("x");
        pending.offer("x");
        assert_eq!(pending.take(&second.ask), None);
        assert_eq!(pending.offers.len(), MAX_PENDING);
    }
}
