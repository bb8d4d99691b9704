//! Local sessions on Linux: abstract Unix sockets, a member's session on a thread of its own,
//! and the shared memory a polling session's frames go through ([`super::ring`]).

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

use super::ring::{self, End, Ends, Move};
use super::{HANDSHAKE, LocalError, Offer, POLL_AFTER_HEAD, Pending, TOKEN, lock};

thread_local! {
    /// Whether this thread's poll of local sessions is one it repeats at once ([`polling`]).
    static POLLING: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` as a poll the caller repeats at once ([`super::polling`]).
pub fn polling<T>(f: impl FnOnce() -> T) -> T {
    /// Puts the flag back however `f` ends (a panic unwinds a task, not the runtime's thread,
    /// whose other sessions must not keep polling unarmed).
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            POLLING.set(self.0);
        }
    }
    let _restore = Restore(POLLING.replace(true));
    f()
}

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
    /// The session's shared memory, where its frames go (the socket then only rings).
    ring: Option<Ends>,
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
            ring: None,
        })
    }

    /// Whether the session's frames go through shared memory.
    pub fn shared(&self) -> bool {
        self.ring.is_some()
    }

    /// Another use of the same socket (one side reads while the other writes).
    fn another(&self) -> Self {
        Self {
            io: self.io.clone(),
            room: None,
            read_first: self.read_first,
            ring: None,
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
        let this = self.get_mut();
        if let Some(ends) = &mut this.ring {
            return poll_move(&this.io, &mut ends.read, Move::Take(buf), cx);
        }
        if this.read_first {
            match this.io.get_ref().read(buf) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                read => return Poll::Ready(read),
            }
        }
        loop {
            let mut ready = ready!(this.io.poll_read_ready(cx))?;
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
        let this = &mut *self;
        if let Some(ends) = &mut this.ring {
            return poll_move(&this.io, &mut ends.write, Move::Put(buf), cx);
        }
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

/// Moves `m` through the leader's `end` of the session's shared memory; where nothing can
/// move, unless the caller polls again at once ([`polling`]), asks the member to ring and waits
/// on the socket.
fn poll_move(
    io: &AsyncFd<UnixStream>,
    end: &mut End,
    mut m: Move,
    cx: &mut Context<'_>,
) -> Poll<std::io::Result<usize>> {
    loop {
        let (n, wake) = end.advance(&mut m)?;
        if wake {
            ring_bell(io.get_ref());
        }
        if n > 0 || m.is_empty() {
            return Poll::Ready(Ok(n));
        }
        if POLLING.get() {
            return Poll::Pending;
        }
        if end.sleep_for(&m)? && !ready!(poll_rung(io, cx))? {
            return Poll::Ready(closed(end, m));
        }
    }
}

/// What moving `m` comes to once the other side closed the session: a reader reads what it
/// wrote before; a writer's pipe is broken.
fn closed(end: &mut End, mut m: Move) -> std::io::Result<usize> {
    match m {
        Move::Take(_) => end.advance(&mut m).map(|(n, _)| n),
        Move::Put(_) => Err(std::io::ErrorKind::BrokenPipe.into()),
    }
}

/// Waits for the other side's bell on the socket: true once rung (this task is woken again,
/// as the bell may have been for its other way), false once the other side closed it.
fn poll_rung(io: &AsyncFd<UnixStream>, cx: &mut Context<'_>) -> Poll<std::io::Result<bool>> {
    loop {
        let mut ready = ready!(io.poll_read_ready(cx))?;
        match ready.try_io(|io| io.get_ref().read(&mut [0; 64])) {
            Ok(Ok(0)) => return Poll::Ready(Ok(false)),
            Ok(Ok(_)) => {
                cx.waker().wake_by_ref();
                return Poll::Ready(Ok(true));
            }
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Ok(Err(e)) => return Poll::Ready(Err(e)),
            Err(_would_block) => {}
        }
    }
}

/// Rings the other side of a session whose frames go through shared memory: one byte on its
/// socket, never blocking (a full socket already holds bells it has not read, and a closed one
/// is seen when this side next reads).
fn ring_bell(stream: &UnixStream) {
    let flags = MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL;
    let _ = nix::sys::socket::send(stream.as_raw_fd(), &[1], flags);
}

/// Waits, blocking, for the other side's bell: true once rung, false once it closed the
/// socket.
fn rung(stream: &UnixStream) -> std::io::Result<bool> {
    loop {
        match (&*stream).read(&mut [0; 64]) {
            Ok(n) => return Ok(n > 0),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
}

/// A member's end of one way of a session's shared memory (its asks to read, or its answers
/// to write): where nothing can move it polls for `spin`, then sleeps until the leader rings.
struct RingSide<'a> {
    stream: &'a UnixStream,
    end: End,
    spin: &'a Cell<Duration>,
}

impl RingSide<'_> {
    fn advance(&mut self, mut m: Move) -> std::io::Result<usize> {
        let start = Instant::now();
        loop {
            let (n, wake) = self.end.advance(&mut m)?;
            if wake {
                ring_bell(self.stream);
            }
            if n > 0 || m.is_empty() {
                return Ok(n);
            }
            if start.elapsed() < self.spin.get() {
                std::hint::spin_loop();
            } else if self.end.sleep_for(&m)? && !rung(self.stream)? {
                return closed(&mut self.end, m);
            }
        }
    }
}

impl Read for RingSide<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.advance(Move::Take(buf))
    }
}

impl Write for RingSide<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.advance(Move::Put(buf))
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
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
    use node_core::net::session::serve;
    // The leader's word first: shared memory for the frames, or the socket.
    stream.set_read_timeout(Some(HANDSHAKE))?;
    let memory = ring::take_over(stream)?;
    stream.set_read_timeout(None)?;
    let next = Cell::new(spin);
    let compute = |version, request: StepRequest| {
        next.set(poll_after(&request, spin));
        compute(version, request)
    };
    use futures::executor::block_on;
    let Some(Ends { read, write }) = memory else {
        let reader = BufReader::new(AllowStdIo::new(Polling {
            stream,
            spin: &next,
        }));
        let writer = BufWriter::with_capacity(WRITE_BUFFER, AllowStdIo::new(stream));
        return block_on(serve(reader, writer, compute));
    };
    let side = |end| RingSide {
        stream,
        end,
        spin: &next,
    };
    let reader = BufReader::new(AllowStdIo::new(side(read)));
    block_on(serve(reader, AllowStdIo::new(side(write)), compute))
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

/// Connects to an offer's socket and checks the member's answer; where the member takes shared
/// memory, hands it some if `shared` (this side polls) and the memory could be made.
pub async fn connect(offer: Offer, shared: bool) -> Result<Socket, LocalError> {
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
    if offer.ring {
        let end = socket.get_mut().get_mut();
        let memory = shared.then(ring::create).transpose();
        let memory = memory.unwrap_or_else(|e| {
            tracing::debug!("a local session's frames stay on its socket: {e}");
            None
        });
        ring::hand_over(end.io.get_ref(), memory.as_ref().map(|(_, fd)| fd))?;
        end.ring = memory.map(|(ends, _)| ends);
    }
    Ok(socket)
}
