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
/// (2: the member writes [`node_core::net::session::ACCEPTED`] first.)
pub const OFFER_PROTOCOL: &str = "/codedmesh/session-local/2";

/// Set to `0` to keep every session on libp2p (to measure what the socket saves).
pub const LOCAL_VAR: &str = "CODEDMESH_LOCAL_SESSIONS";

/// Microseconds a local session's side polls its socket for the next frame before it sleeps
/// (unset or 0: it sleeps at once).
pub const SPIN_VAR: &str = "CODEDMESH_SPIN_US";

/// The poll `up` and the bench give their nodes where every process of a stream has a core:
/// on two cores, 150 µs beat 400 (docs/perf-history.md, "Sessions that poll before they sleep").
pub const SPIN_US: u64 = 150;

/// How long a session that polls polls after a pass's LM head (the leader samples first).
pub const POLL_AFTER_HEAD: Duration = Duration::from_micros(1200);

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
}

impl Pending {
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
    let pending = Arc::new(Mutex::new(Pending::default()));
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
    let on_thread = on_thread(state.clone());
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
    platform::connect(offer).await
}

fn lock(pending: &Mutex<Pending>) -> std::sync::MutexGuard<'_, Pending> {
    pending.lock().unwrap_or_else(PoisonError::into_inner)
}

#[cfg(target_os = "linux")]
mod platform {
    use std::cell::Cell;
    use std::future::Future;
    use std::io::{Read, Write};
    use std::os::fd::{AsFd, AsRawFd, OwnedFd};
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::net::{SocketAddr, UnixStream};
    use std::pin::Pin;
    use std::sync::{Arc, Mutex};
    use std::task::{Context, Poll, ready};
    use std::time::{Duration, Instant};

    use futures::io::{AllowStdIo, BufReader, BufWriter};
    use futures::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
    use nix::errno::Errno;
    use nix::sys::socket::{MsgFlags, recv};
    use node_core::mesh::MeshResponse;
    use node_core::model::Stage;
    use node_core::net::session::SessionError;
    use node_core::protocol::StepRequest;
    use tokio::io::Interest;
    use tokio::io::unix::AsyncFd;
    use tokio::net::UnixListener;
    use tokio::sync::OwnedSemaphorePermit;

    use super::{HANDSHAKE, LocalError, Offer, POLL_AFTER_HEAD, Pending, TOKEN, lock};

    /// A member's end of a local session served on a thread of its own (blocking).
    pub type Stream = UnixStream;

    /// Connections a member lets wait for their token at once.
    const MAX_HANDSHAKES: usize = 64;

    /// Bytes a side gathers before it writes: a frame goes out in one system call (one
    /// wake-up of the reader), not in the 4 KiB pieces a WebRTC channel needs.
    const WRITE_BUFFER: usize = 128 << 10;

    /// A leader's end of a local session: reads are buffered (a frame's length and body
    /// come in one system call), and so are writes until each frame's flush.
    pub type Socket = BufReader<BufWriter<SocketEnd>>;

    /// A local session's socket as one side uses it: for reading, writing, or both. The
    /// socket is registered with the runtime for reading only. Registered for writing too,
    /// each read by the other side (which frees room on this side) would wake this process
    /// for nothing, twice a round. A write goes straight to the socket; only when it is full
    /// does a duplicate of the socket, registered for writing, wait for room.
    #[derive(Debug)]
    pub struct SocketEnd {
        io: Arc<AsyncFd<UnixStream>>,
        /// The duplicate waiting for room, while a write waits.
        room: Option<AsyncFd<OwnedFd>>,
        /// Reads try the socket before the runtime's readiness, which comes only once the
        /// runtime's poller has woken: a leader that polls for answers ([`super::spin`]).
        read_first: bool,
    }

    impl SocketEnd {
        /// `stream` (non-blocking from here on), registered for reading.
        fn new(stream: UnixStream) -> std::io::Result<Self> {
            stream.set_nonblocking(true)?;
            // SAFETY: the stream owns its descriptor and keeps it, open and the same, until
            // the `AsyncFd` drops it.
            let io = unsafe { AsyncFd::register_with_interest(stream, Interest::READABLE) }?;
            Ok(Self {
                io: Arc::new(io),
                room: None,
                read_first: super::spin().is_some(),
            })
        }

        /// Another use of the same socket (one side reads while the other writes).
        fn another(&self) -> Self {
            Self {
                io: self.io.clone(),
                room: None,
                read_first: self.read_first,
            }
        }

        /// The socket, out of the runtime and blocking, for a thread of its own; `None` while
        /// another use of it lives.
        fn into_blocking(self) -> std::io::Result<Option<UnixStream>> {
            let Ok(io) = Arc::try_unwrap(self.io) else {
                return Ok(None);
            };
            let stream = io.into_inner();
            stream.set_nonblocking(false)?;
            Ok(Some(stream))
        }
    }

    impl AsyncRead for SocketEnd {
        fn poll_read(
            self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &mut [u8],
        ) -> Poll<std::io::Result<usize>> {
            if self.read_first {
                match self.io.get_ref().read(buf) {
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    read => return Poll::Ready(read),
                }
            }
            loop {
                let mut ready = ready!(self.io.poll_read_ready(cx))?;
                if let Ok(read) = ready.try_io(|io| io.get_ref().read(buf)) {
                    return Poll::Ready(read);
                }
            }
        }
    }

    impl AsyncWrite for SocketEnd {
        fn poll_write(
            mut self: Pin<&mut Self>,
            cx: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<std::io::Result<usize>> {
            loop {
                match self.io.get_ref().write(buf) {
                    Ok(n) => {
                        self.room = None;
                        return Poll::Ready(Ok(n));
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => return Poll::Ready(Err(e)),
                }
                if self.room.is_none() {
                    // Registering reports room that came since the write at once.
                    let dup = self.io.get_ref().as_fd().try_clone_to_owned()?;
                    // SAFETY: as in `new`: `dup` owns its descriptor for the `AsyncFd`'s life.
                    let room = unsafe { AsyncFd::register_with_interest(dup, Interest::WRITABLE) };
                    self.room = Some(room?);
                }
                if let Some(room) = &self.room {
                    ready!(room.poll_write_ready(cx))?.clear_ready();
                }
            }
        }

        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }

        fn poll_close(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(self.io.get_ref().shutdown(std::net::Shutdown::Write))
        }
    }

    /// Listens on `name` in the abstract namespace.
    pub fn listen(name: &str) -> std::io::Result<UnixListener> {
        let addr = SocketAddr::from_abstract_name(name.as_bytes())?;
        let listener = std::os::unix::net::UnixListener::bind_addr(&addr)?;
        listener.set_nonblocking(true)?;
        UnixListener::from_std(listener)
    }

    /// Runs `serve` on every connection that opens with a pending offer's token, or
    /// `on_thread` on a thread of its own where given.
    pub async fn accept<F, Fut, T>(
        listener: UnixListener,
        pending: Arc<Mutex<Pending>>,
        slots: Arc<tokio::sync::Semaphore>,
        serve: F,
        on_thread: Option<T>,
    ) where
        F: Fn(BufReader<SocketEnd>, BufWriter<SocketEnd>) -> Fut + Clone + Send + 'static,
        Fut: Future<Output = ()> + Send,
        T: Fn(UnixStream) + Clone + Send + 'static,
    {
        let handshakes = Arc::new(tokio::sync::Semaphore::new(MAX_HANDSHAKES));
        loop {
            let conn = match listener.accept().await.and_then(|(c, _)| c.into_std()) {
                Ok(conn) => conn,
                Err(e) => {
                    // Out of descriptors, say: the leaders that cannot connect use libp2p.
                    tracing::warn!("accepting a local session: {e}");
                    tokio::time::sleep(HANDSHAKE / 50).await;
                    continue;
                }
            };
            // A connection costs a session's slot only once its token checks out, so
            // connections that never send one cannot keep leaders out.
            let Ok(handshake) = handshakes.clone().try_acquire_owned() else {
                tracing::warn!("refusing a local connection: {MAX_HANDSHAKES} are in handshake");
                continue;
            };
            let (pending, slots, serve) = (pending.clone(), slots.clone(), serve.clone());
            let on_thread = on_thread.clone();
            tokio::spawn(async move {
                let mut reader = match SocketEnd::new(conn) {
                    Ok(reader) => reader,
                    Err(e) => return tracing::debug!("local session: {e}"),
                };
                let mut writer = BufWriter::with_capacity(WRITE_BUFFER, reader.another());
                let mut ask = [0; TOKEN];
                match tokio::time::timeout(HANDSHAKE, reader.read_exact(&mut ask)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => return tracing::debug!("local session: {e}"),
                    Err(_) => return tracing::debug!("local session: no token in time"),
                }
                drop(handshake);
                let Some(answer) = lock(&pending).take(&ask) else {
                    return tracing::debug!("local session: a token not offered");
                };
                let Ok(slot) = slots.try_acquire_owned() else {
                    return tracing::warn!("refusing a local session: too many are open");
                };
                if let Err(e) = send(&mut writer, &answer).await {
                    return tracing::debug!("local session: {e}");
                }
                if let Some(on_thread) = on_thread {
                    drop(writer);
                    return to_thread(reader, slot, on_thread);
                }
                serve(BufReader::new(reader), writer).await;
                drop(slot);
            });
        }
    }

    /// Serves a session on a thread of its own, its socket out of the runtime.
    fn to_thread(
        socket: SocketEnd,
        slot: OwnedSemaphorePermit,
        on_thread: impl FnOnce(UnixStream) + Send + 'static,
    ) {
        let stream = match socket.into_blocking() {
            Ok(Some(stream)) => stream,
            Ok(None) => return tracing::warn!("local session: its socket is still in use"),
            Err(e) => return tracing::debug!("local session: {e}"),
        };
        let spawned = std::thread::Builder::new()
            .name("local-session".into())
            .spawn(move || {
                on_thread(stream);
                drop(slot);
            });
        if let Err(e) = spawned {
            tracing::warn!("local session: no thread for it: {e}");
        }
    }

    /// Answers a session's asks on `stream` with `compute` on the calling thread until the
    /// leader closes it; each read polls the socket for `spin` ([`poll_after`]) before it blocks.
    pub fn serve_polling<F, Fut>(
        stream: &UnixStream,
        spin: Duration,
        mut compute: F,
    ) -> Result<u64, SessionError>
    where
        F: FnMut([u8; 32], StepRequest) -> Fut,
        Fut: Future<Output = MeshResponse>,
    {
        let next = Cell::new(spin);
        let reader = BufReader::new(AllowStdIo::new(Polling {
            stream,
            spin: &next,
        }));
        let writer = BufWriter::with_capacity(WRITE_BUFFER, AllowStdIo::new(stream));
        let compute = |version, request: StepRequest| {
            next.set(poll_after(&request, spin));
            compute(version, request)
        };
        futures::executor::block_on(node_core::net::session::serve(reader, writer, compute))
    }

    /// How long to poll for the ask after `request`: `spin`, or [`POLL_AFTER_HEAD`] after a
    /// pass's LM head (the leader samples first: 0.3 ms, p90 1 ms, SmolLM2 on two cores).
    pub(super) fn poll_after(request: &StepRequest, spin: Duration) -> Duration {
        let head = matches!(request, StepRequest::Matmul { stage, .. } if *stage == Stage::LmHead);
        if head && !spin.is_zero() {
            spin.max(POLL_AFTER_HEAD)
        } else {
            spin
        }
    }

    /// Reads from a blocking socket that poll it without blocking for `spin` first.
    struct Polling<'a> {
        stream: &'a UnixStream,
        spin: &'a Cell<Duration>,
    }

    impl Read for Polling<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            let start = Instant::now();
            let spin = self.spin.get();
            loop {
                match recv(self.stream.as_raw_fd(), buf, MsgFlags::MSG_DONTWAIT) {
                    Ok(n) => return Ok(n),
                    Err(Errno::EAGAIN | Errno::EINTR) => {}
                    Err(e) => return Err(e.into()),
                }
                if start.elapsed() >= spin {
                    return self.stream.read(buf);
                }
                std::hint::spin_loop();
            }
        }
    }

    /// Writes `bytes` and flushes them.
    async fn send(writer: &mut (impl AsyncWrite + Unpin), bytes: &[u8]) -> std::io::Result<()> {
        writer.write_all(bytes).await?;
        writer.flush().await
    }

    /// Connects to an offer's socket and checks the member's answer.
    pub async fn connect(offer: Offer) -> Result<Socket, LocalError> {
        let addr = SocketAddr::from_abstract_name(offer.name.as_bytes())?;
        // A Unix socket's connect blocks only while the listener's backlog is full.
        let conn = tokio::task::spawn_blocking(move || UnixStream::connect_addr(&addr))
            .await
            .map_err(std::io::Error::other)??;
        let socket = BufWriter::with_capacity(WRITE_BUFFER, SocketEnd::new(conn)?);
        let mut socket = BufReader::new(socket);
        let answer = tokio::time::timeout(HANDSHAKE, async {
            send(&mut socket, &offer.ask).await?;
            let mut answer = [0; TOKEN];
            socket.read_exact(&mut answer).await?;
            Ok::<_, std::io::Error>(answer)
        })
        .await
        .map_err(|_| LocalError::TimedOut)??;
        if answer != offer.answer {
            return Err(LocalError::WrongAnswer);
        }
        Ok(socket)
    }
}

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

    pub async fn connect(_: Offer) -> Result<Socket, LocalError> {
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
        let pending = Arc::new(Mutex::new(Pending::default()));
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
        let socket = platform::connect(offer.clone()).await.unwrap();
        assert_eq!(ask_sum(socket, vec![1.0, 2.0, 3.5]).await, 6.5);
        // Taken up: the same tokens again are turned away.
        let again = platform::connect(offer).await;
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
        let refused = platform::connect(forged).await;
        assert!(matches!(refused, Err(LocalError::Io(_))), "{refused:?}");
        // Another process at the name, which cannot answer with the offer's second token.
        let impostor = Offer {
            answer: [1; TOKEN],
            ..lock(&pending).offer(&name)
        };
        let refused = platform::connect(impostor).await;
        assert!(
            matches!(refused, Err(LocalError::WrongAnswer)),
            "{refused:?}"
        );
        // The first offer still opens a session.
        let socket = platform::connect(offer).await.unwrap();
        assert_eq!(ask_sum(socket, vec![2.0; 4]).await, 8.0);
    }

    /// A member that serves its session on a thread of its own answers asks that come while
    /// it polls and asks that come after it has gone to sleep.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_session_on_a_thread_of_its_own_answers_while_it_polls_and_after() {
        let (name, pending) = member_with("thread", sum, Some(Duration::from_millis(2)));
        let offer = lock(&pending).offer(&name);
        let mut session = Driven::new(platform::connect(offer).await.unwrap());
        for (id, pause) in [(1u64, 0), (2, 0), (3, 50), (4, 0), (5, 50)] {
            tokio::time::sleep(Duration::from_millis(pause)).await;
            let sum = sum_on(&mut session, id, vec![id as f32; 3]).await;
            assert_eq!(sum, 3.0 * id as f32);
        }
    }

    /// Asks and answers many times the socket's buffer, several at once each way: the writes
    /// that find the socket full wait for room and go on, and nothing is lost or reordered.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn frames_larger_than_the_socket_buffer_go_through_both_ways() {
        large_frames(None).await;
    }

    /// [`frames_larger_than_the_socket_buffer_go_through_both_ways`] with the member's session
    /// on a thread of its own, which blocks while it writes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn large_frames_go_through_a_session_on_a_thread_of_its_own() {
        large_frames(Some(Duration::from_micros(150))).await;
    }

    async fn large_frames(spin: Option<Duration>) {
        let (name, pending) = member_with("large", echo, spin);
        let offer = lock(&pending).offer(&name);
        let mut session = Driven::new(platform::connect(offer).await.unwrap());
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
        let failed = platform::connect(offer).await;
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
