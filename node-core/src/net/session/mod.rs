//! Group sessions: one long-lived stream from a leader to each member of its group, opened when
//! the group forms and kept while it works. Every round is one frame each way on it, so the
//! swarm task is off the per-step path: no new substream, no protocol negotiation, no hop
//! through the swarm's event loop for a step.
//!
//! Frames are length-prefixed (u32, little-endian), versioned postcard ([`crate::protocol`]),
//! and size-limited before anything is allocated. A member answers its asks in order.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use futures::{AsyncRead, AsyncWrite, AsyncWriteExt};
use serde::{Deserialize, Serialize, de::DeserializeOwned};
use web_time::Instant;

use crate::mesh::MeshResponse;
use crate::protocol::{self, MAX_MESSAGE_BYTES, ProtocolError, StepRequest};

/// Name of the session protocol; the version is part of it. (2: the member writes
/// [`ACCEPTED`] first.)
pub const SESSION_PROTOCOL: &str = "/codedmesh/session/2";

/// The session protocol's name, as libp2p takes it.
pub fn protocol() -> libp2p::StreamProtocol {
    libp2p::StreamProtocol::new(SESSION_PROTOCOL)
}

/// The byte a node writes first on every session, hop or local-offer stream it takes from its
/// libp2p queue. libp2p-stream keeps one waiting stream per protocol and drops the others, so a
/// burst of streams (a group forming on a busy machine) loses some; a stream that ends before
/// this byte was dropped unread, and its opener opens it again.
pub const ACCEPTED: u8 = 0xac;

/// Times a stream is opened before its receiver is taken to refuse it.
const OPEN_TRIES: u32 = 4;

/// The pause before the second try; it doubles for each one after.
const FIRST_PAUSE: std::time::Duration = std::time::Duration::from_millis(5);

/// How long an opener waits for the receiver to take its stream: a receiver that holds it
/// longer is taken to refuse it (so a stuck node holds no opener's task).
const ACCEPT_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Opens a `protocol` stream to `peer` once its receiver has taken it off its queue (it writes
/// [`ACCEPTED`] first), waiting with `sleep` (the shell's timer). libp2p-stream keeps one
/// waiting stream per protocol and drops the rest, so a burst of streams on a busy machine
/// loses some: a stream that ends before that byte is opened again after a pause, up to
/// [`OPEN_TRIES`] times.
pub async fn open_accepted<W: Future<Output = ()>>(
    control: &mut libp2p_stream::Control,
    peer: libp2p::PeerId,
    protocol: libp2p::StreamProtocol,
    sleep: impl Fn(std::time::Duration) -> W,
) -> Result<libp2p::Stream, libp2p_stream::OpenStreamError> {
    use futures::{AsyncReadExt, FutureExt};
    use libp2p_stream::OpenStreamError;
    use std::io::ErrorKind;
    let mut pause = FIRST_PAUSE;
    let mut tried = 0;
    let io = |kind, why: &str| std::io::Error::new(kind, format!("{protocol}: {why}"));
    loop {
        tried += 1;
        let mut stream = control.open_stream(peer, protocol.clone()).await?;
        let mut first = [0u8; 1];
        let read = futures::select_biased! {
            read = stream.read(&mut first).fuse() => Some(read),
            () = sleep(ACCEPT_WAIT).fuse() => None,
        };
        let why = match read {
            Some(Ok(1)) if first[0] == ACCEPTED => return Ok(stream),
            Some(Ok(1)) => {
                let why = "the receiver did not begin with the accepted byte";
                return Err(OpenStreamError::Io(io(ErrorKind::InvalidData, why)));
            }
            None => {
                let why = format!("the receiver did not take the stream within {ACCEPT_WAIT:?}");
                return Err(OpenStreamError::Io(io(ErrorKind::TimedOut, &why)));
            }
            Some(Ok(_)) => io(
                ErrorKind::UnexpectedEof,
                "the receiver dropped the stream unread",
            ),
            Some(Err(e)) => e,
        };
        if tried >= OPEN_TRIES {
            return Err(OpenStreamError::Io(why));
        }
        tracing::debug!(%peer, "opening the stream again: {why}");
        sleep(pause).await;
        pause *= 2;
    }
}

/// Tells the stream's opener that this node took the stream ([`ACCEPTED`]).
pub async fn accepted<W: AsyncWrite + Unpin>(writer: &mut W) -> std::io::Result<()> {
    writer.write_all(&[ACCEPTED]).await?;
    writer.flush().await
}

/// Largest frame either side accepts (a prefill step of a few thousand tokens fits).
pub const MAX_FRAME_BYTES: usize = MAX_MESSAGE_BYTES;

/// Pieces a frame is written in (WebRTC data channels fail on larger single writes).
const WRITE_PIECE: usize = 4 << 10;

/// A leader's ask: one coded step at a version.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Ask {
    /// The leader's number for it; the answer carries it back.
    pub id: u64,
    /// The version the leader computes at.
    pub version: [u8; 32],
    /// The encoded [`StepRequest`].
    #[serde(with = "serde_bytes")]
    pub step: Vec<u8>,
}

/// A member's answer to an [`Ask`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Answer {
    /// The ask's id.
    pub id: u64,
    /// [`MeshResponse::Step`] or [`MeshResponse::Error`].
    pub response: MeshResponse,
}

/// Why a session ended.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    /// The stream failed.
    #[error("session stream: {0}")]
    Io(#[from] std::io::Error),
    /// A frame was larger than allowed.
    #[error("session frame of {len} bytes exceeds the limit of {max}")]
    TooLarge {
        /// Its size.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The stream ended inside a frame.
    #[error("session stream ended inside a frame ({got} of {len} bytes)")]
    Truncated {
        /// Bytes read.
        got: usize,
        /// Bytes announced.
        len: usize,
    },
    /// A frame did not decode.
    #[error("session frame: {0}")]
    Protocol(#[from] ProtocolError),
    /// The peer answered out of order.
    #[error("session answer {got} where {want} was due")]
    OutOfOrder {
        /// The id that came.
        got: u64,
        /// The id due.
        want: u64,
    },
    /// The peer answered with nothing asked.
    #[error("session answer {0} with nothing asked")]
    Unasked(u64),
    /// The member left so many asks unanswered, or so many bytes unread, that it has
    /// stalled: the ask is not queued.
    #[error(
        "the member has {asks} asks unanswered and {bytes} bytes of asks not taken: it has stalled, and no more are queued"
    )]
    Stalled {
        /// Asks sent or queued and not answered.
        asks: usize,
        /// Bytes of asks queued and not yet written.
        bytes: usize,
    },
}

/// Most asks a leader leaves unanswered on one session before it refuses the next: a round
/// asks each member once, and a checking member on a slow device answers late (a browser
/// behind a relay lags by tens of rounds, and its answers are still checked), so a member
/// thousands behind has stalled. An ask written costs the leader only its id here; the bytes
/// of asks a member does not read are bounded by [`MAX_QUEUED_BYTES`].
pub const MAX_UNANSWERED: usize = 4096;

/// Most bytes of asks a leader holds unwritten for one session; one ask of any size up to
/// [`MAX_FRAME_BYTES`] is always taken when nothing else waits.
pub const MAX_QUEUED_BYTES: usize = MAX_FRAME_BYTES;

/// Whether a session with `asks` unanswered and `bytes` of asks not yet written takes one
/// more of `len` bytes: why not, when the member has stalled ([`MAX_UNANSWERED`],
/// [`MAX_QUEUED_BYTES`]).
pub fn room_for(asks: usize, bytes: usize, len: usize) -> Result<(), SessionError> {
    let over = asks >= MAX_UNANSWERED || (bytes > 0 && bytes + len > MAX_QUEUED_BYTES);
    if over {
        return Err(SessionError::Stalled { asks, bytes });
    }
    Ok(())
}

/// One message as a frame: its length, then its versioned encoding.
pub fn frame<T: Serialize>(msg: &T) -> Result<Vec<u8>, SessionError> {
    let mut out = Vec::new();
    frame_into(&mut out, msg)?;
    Ok(out)
}

/// [`frame`] into `out` (cleared first), whose memory the caller keeps for the next one.
pub fn frame_into<T: Serialize>(out: &mut Vec<u8>, msg: &T) -> Result<(), SessionError> {
    protocol::encode_into(out, 4, msg)?;
    let len = out.len() - 4;
    let len = u32::try_from(len).map_err(|_| SessionError::TooLarge {
        len,
        max: MAX_FRAME_BYTES,
    })?;
    out[..4].copy_from_slice(&len.to_le_bytes());
    Ok(())
}

/// Writes a frame made by [`frame`] and flushes it (in pieces a WebRTC channel takes).
pub async fn write_frame<W: AsyncWrite + Unpin>(io: &mut W, frame: &[u8]) -> std::io::Result<()> {
    for piece in frame.chunks(WRITE_PIECE) {
        io.write_all(piece).await?;
    }
    io.flush().await
}

/// Bytes a frame's body grows by per read: a lying length costs at most this much.
const READ_PIECE: usize = 64 << 10;

/// Most bytes a reader keeps for its next frame: a session lives as long as its group, and
/// each kept its largest frame's buffer (8 MB a member for a training round of the 1B shape).
const KEEP_READ_BYTES: usize = 1 << 20;

/// A frame being read: its length, then its body, across as many polls as its bytes take.
#[derive(Debug, Default)]
pub struct FrameReader {
    len: [u8; 4],
    len_got: usize,
    body: Vec<u8>,
    /// Bytes of the body read so far.
    got: usize,
    want: Option<usize>,
    /// What the frame being read holds of the node's budget for session frames in flight
    /// ([`super::frames::INBOUND_BUDGET`]).
    held: SessionHeld,
}

/// What a session's frame holds of the sessions' budget.
#[derive(Debug)]
struct SessionHeld(super::frames::Held);

impl Default for SessionHeld {
    fn default() -> Self {
        Self(super::frames::Held(0, super::frames::Budget::Sessions))
    }
}

impl FrameReader {
    /// Reads on until a whole frame is in and decodes it; `None` when the stream ends cleanly
    /// between frames. The buffer grows only as bytes arrive, so a lying length costs nothing.
    pub fn poll_next<T: DeserializeOwned, R: AsyncRead + Unpin>(
        &mut self,
        cx: &mut Context<'_>,
        io: &mut R,
    ) -> Poll<Result<Option<T>, SessionError>> {
        let want = loop {
            if let Some(want) = self.want {
                break want;
            }
            match ready!(Pin::new(&mut *io).poll_read(cx, &mut self.len[self.len_got..]))? {
                0 if self.len_got == 0 => return Poll::Ready(Ok(None)),
                0 => {
                    let got = std::mem::take(&mut self.len_got);
                    return Poll::Ready(Err(SessionError::Truncated { got, len: 4 }));
                }
                n => self.len_got += n,
            }
            if self.len_got == self.len.len() {
                let len = u32::from_le_bytes(self.len) as usize;
                self.len_got = 0;
                if len > MAX_FRAME_BYTES {
                    return Poll::Ready(Err(SessionError::TooLarge {
                        len,
                        max: MAX_FRAME_BYTES,
                    }));
                }
                self.body.clear();
                self.got = 0;
                self.want = Some(len);
            }
        };
        // The body is zeroed once a frame, a piece at a time as its bytes come: a poll that
        // finds no bytes yet (a leader polls for answers) leaves what it zeroed in place.
        while self.got < want {
            let start = self.got;
            let end = want.min(start + READ_PIECE);
            // The piece is taken from the node's budget before it is read.
            if self.held.0.0 < end
                && let Err(e) = self.held.0.take(end - self.held.0.0)
            {
                self.want = None;
                self.held.0.release();
                return Poll::Ready(Err(e.into()));
            }
            if self.body.len() < end {
                self.body.resize(end, 0);
            }
            let n = match Pin::new(&mut *io).poll_read(cx, &mut self.body[start..end]) {
                Poll::Ready(Ok(n)) => n,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e.into())),
                Poll::Pending => return Poll::Pending,
            };
            if n == 0 {
                self.want = None;
                return Poll::Ready(Err(SessionError::Truncated {
                    got: start,
                    len: want,
                }));
            }
            self.got += n;
        }
        self.want = None;
        let decoded = protocol::decode(&self.body);
        self.held.0.release();
        if self.body.capacity() > KEEP_READ_BYTES {
            self.body = Vec::new();
        }
        Poll::Ready(decoded.map(Some).map_err(Into::into))
    }
}

/// Reads the next frame; `None` when the stream ends cleanly between frames.
pub async fn read_frame<T: DeserializeOwned, R: AsyncRead + Unpin>(
    io: &mut R,
    reader: &mut FrameReader,
) -> Result<Option<T>, SessionError> {
    std::future::poll_fn(|cx| reader.poll_next(cx, io)).await
}

/// A member's side of a session: answers every ask in order with `compute(version, step)`
/// until the leader closes the stream. An ask whose step does not decode is answered with an
/// error (the session goes on); a frame that does not decode ends the session.
pub async fn serve<R, W, F, Fut>(
    mut reader: R,
    mut writer: W,
    mut compute: F,
) -> Result<u64, SessionError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
    F: FnMut([u8; 32], StepRequest) -> Fut,
    Fut: Future<Output = MeshResponse>,
{
    let mut buf = FrameReader::default();
    // Each answer's frame, in memory kept from one to the next (up to what a reader keeps).
    let mut out = Vec::new();
    let mut served = 0;
    while let Some(ask) = read_frame::<Ask, _>(&mut reader, &mut buf).await? {
        let response = match protocol::decode::<StepRequest>(&ask.step) {
            Ok(step) => compute(ask.version, step).await,
            Err(e) => MeshResponse::Error(format!("bad step: {e}")),
        };
        let id = ask.id;
        if let Err(e) = frame_into(&mut out, &Answer { id, response }) {
            let response = MeshResponse::Error(e.to_string());
            frame_into(&mut out, &Answer { id, response })?;
        }
        write_frame(&mut writer, &out).await?;
        if out.capacity() > KEEP_READ_BYTES {
            out = Vec::new();
        }
        served += 1;
    }
    writer.close().await?;
    Ok(served)
}

/// The asks a leader has sent on one session and not yet had answered, in order.
#[derive(Debug, Default)]
pub struct Outstanding {
    ids: VecDeque<u64>,
}

impl Outstanding {
    /// An ask went out.
    pub fn sent(&mut self, id: u64) {
        self.ids.push_back(id);
    }

    /// Asks sent and not answered.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether every ask sent was answered.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// An answer came: it must be the oldest ask's.
    pub fn answered(&mut self, id: u64) -> Result<(), SessionError> {
        match self.ids.front() {
            Some(&want) if want == id => {
                self.ids.pop_front();
                Ok(())
            }
            Some(&want) => Err(SessionError::OutOfOrder { got: id, want }),
            None => Err(SessionError::Unasked(id)),
        }
    }

    /// The asks left unanswered (the session ended), oldest first.
    pub fn drain(&mut self) -> impl Iterator<Item = u64> + '_ {
        self.ids.drain(..)
    }
}

/// A leader's end of one session, driven by whoever polls it (the round's own task): asks
/// are queued and written as it is polled, answers read as they come and checked for order.
/// No task of its own, so an ask or an answer costs no hand-off between tasks. Writes and
/// reads progress in the same poll, so a large ask cannot deadlock against an answer the
/// member is writing.
#[derive(Debug)]
pub struct Driven<S> {
    io: S,
    /// Frames to write, each not before its instant (a bench's modelled delay).
    out: VecDeque<(Instant, Vec<u8>)>,
    /// Bytes of the first frame written.
    written: usize,
    /// Bytes of the frames not yet written.
    queued: usize,
    unflushed: bool,
    reader: FrameReader,
    outstanding: Outstanding,
}

impl<S: AsyncRead + AsyncWrite + Unpin> Driven<S> {
    /// A session over an open stream.
    pub fn new(io: S) -> Self {
        Self {
            io,
            out: Default::default(),
            written: 0,
            queued: 0,
            unflushed: false,
            reader: FrameReader::default(),
            outstanding: Outstanding::default(),
        }
    }

    /// Queues an ask, to be written from `not_before` on, as the session is next polled; why
    /// not, when the member has stalled ([`room_for`]).
    pub fn ask(&mut self, ask: &Ask, not_before: Instant) -> Result<(), SessionError> {
        let frame = frame(ask)?;
        room_for(self.outstanding.len(), self.queued, frame.len())?;
        self.outstanding.sent(ask.id);
        self.queued += frame.len();
        self.out.push_back((not_before, frame));
        Ok(())
    }

    /// When the first queued ask that is held back may go out, if one is.
    pub fn held_until(&self, now: Instant) -> Option<Instant> {
        self.out.front().map(|(at, _)| *at).filter(|at| *at > now)
    }

    /// Writes what is due and returns the next answer, if one came. An error ends the
    /// session: the asks it leaves unanswered are in [`Driven::unanswered`].
    pub fn poll_answer(
        &mut self,
        cx: &mut Context<'_>,
        now: Instant,
    ) -> Poll<Result<Answer, SessionError>> {
        if let Err(e) = self.poll_write(cx, now) {
            return Poll::Ready(Err(e.into()));
        }
        let answer = match ready!(self.reader.poll_next::<Answer, _>(cx, &mut self.io)) {
            Ok(Some(answer)) => answer,
            Ok(None) => {
                return Poll::Ready(Err(SessionError::Io(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "the member closed its session",
                ))));
            }
            Err(e) => return Poll::Ready(Err(e)),
        };
        Poll::Ready(self.outstanding.answered(answer.id).map(|()| answer))
    }

    /// Writes the due frames as far as the stream takes them now, and flushes them. Returns
    /// with the task registered for what it waits on: a flush that completes after a write
    /// found no room (a buffered stream's flush makes room) leaves no wake-up to come, so
    /// writing goes on.
    fn poll_write(&mut self, cx: &mut Context<'_>, now: Instant) -> std::io::Result<()> {
        loop {
            let mut blocked = false;
            while let Some((at, frame)) = self.out.front() {
                if *at > now {
                    break;
                }
                let end = frame.len().min(self.written + WRITE_PIECE);
                match Pin::new(&mut self.io).poll_write(cx, &frame[self.written..end]) {
                    Poll::Ready(Ok(0)) => return Err(std::io::ErrorKind::WriteZero.into()),
                    Poll::Ready(Ok(n)) => {
                        self.unflushed = true;
                        self.written += n;
                        self.queued -= n;
                        if self.written == frame.len() {
                            self.out.pop_front();
                            self.written = 0;
                        }
                    }
                    Poll::Ready(Err(e)) => return Err(e),
                    Poll::Pending => {
                        blocked = true;
                        break;
                    }
                }
            }
            if !self.unflushed {
                return Ok(());
            }
            match Pin::new(&mut self.io).poll_flush(cx) {
                Poll::Ready(flushed) => {
                    flushed?;
                    self.unflushed = false;
                    if !blocked {
                        return Ok(());
                    }
                }
                Poll::Pending => return Ok(()),
            }
        }
    }

    /// The asks left unanswered (the session ended), oldest first.
    pub fn unanswered(&mut self) -> impl Iterator<Item = u64> + '_ {
        self.out.clear();
        (self.written, self.queued) = (0, 0);
        self.outstanding.drain()
    }
}

#[cfg(test)]
mod tests;
