//! Reading the mesh protocol's frames from peers within bounds: each kind of request has the
//! largest size it needs (a request for a node's view needs bytes, an update megabytes), a
//! frame is refused as soon as its length says it is larger, and the bytes of every frame
//! being read count against a budget for the whole node, taken as they arrive: one for
//! requests, one for the asks of group sessions, so that a flood of one does not starve the
//! other (a leader's rounds go on while strangers flood requests). A peer that claims a 64 MiB
//! frame on a thousand streams costs the node what it actually sends, within the budget; the
//! streams that find it spent fail at once, and are counted.

use std::io;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use futures::{AsyncRead, AsyncReadExt};

use crate::protocol::MAX_MESSAGE_BYTES;

/// Bytes of request frames from peers a node holds while it reads them, at most; as much
/// again for the frames of group sessions.
pub const INBOUND_BUDGET: usize = 256 << 20;

/// Bytes of a frame read at a time (each piece is taken from the budget before it is read).
const PIECE: usize = 64 << 10;

/// Bytes of request frames being read now.
static INBOUND: AtomicUsize = AtomicUsize::new(0);

/// Bytes of session frames being read now.
static SESSIONS: AtomicUsize = AtomicUsize::new(0);

/// Which budget a frame's bytes come from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum Budget {
    /// Request-response frames (anyone's requests).
    #[default]
    Requests,
    /// The asks of group sessions (leaders' rounds).
    Sessions,
}

impl Budget {
    fn counter(self) -> &'static AtomicUsize {
        match self {
            Budget::Requests => &INBOUND,
            Budget::Sessions => &SESSIONS,
        }
    }
}

/// Frames refused since the process started: larger than their kind needs, or past the
/// node's budget.
pub static OVERSIZED: AtomicU64 = AtomicU64::new(0);
/// See [`OVERSIZED`].
pub static OVER_BUDGET: AtomicU64 = AtomicU64::new(0);
/// Request frames refused since the process started because they do not decode (a list past
/// its bound, bytes of no request).
pub static UNDECODABLE: AtomicU64 = AtomicU64::new(0);

/// What a frame being read holds of a budget; returned when dropped.
#[derive(Debug, Default)]
pub(crate) struct Held(pub(crate) usize, pub(crate) Budget);

impl Held {
    /// Gives back all it holds (the frame was read).
    pub(crate) fn release(&mut self) {
        (self.1.counter()).fetch_sub(std::mem::take(&mut self.0), Ordering::AcqRel);
    }

    /// Takes `more` bytes from the budget.
    pub(crate) fn take(&mut self, more: usize) -> io::Result<()> {
        let counter = self.1.counter();
        let mut now = counter.load(Ordering::Relaxed);
        loop {
            if now + more > INBOUND_BUDGET {
                OVER_BUDGET.fetch_add(1, Ordering::Relaxed);
                return Err(io::Error::new(
                    io::ErrorKind::OutOfMemory,
                    format!("the node's {INBOUND_BUDGET} bytes for frames in flight are spent"),
                ));
            }
            match counter.compare_exchange_weak(
                now,
                now + more,
                Ordering::AcqRel,
                Ordering::Relaxed,
            ) {
                Ok(_) => {
                    self.0 += more;
                    return Ok(());
                }
                Err(actual) => now = actual,
            }
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.1.counter().fetch_sub(self.0, Ordering::AcqRel);
    }
}

/// Bytes of request frames being read from peers now.
pub fn inbound_bytes() -> usize {
    INBOUND.load(Ordering::Relaxed)
}

/// The most bytes a request frame may take, by its kind (the variant index of a
/// [`crate::mesh::MeshRequest`], after the protocol version): what the largest honest request
/// of that kind needs.
pub fn request_cap(variant: u64) -> usize {
    match variant {
        // Step, Learn, Spread: activations, an update (a notice may carry it whole).
        4 | 7 | 12 => MAX_MESSAGE_BYTES,
        // Report: a signed report and the holders to pass it on to.
        9 => 8 << 20,
        // Teach: the token ids of one text.
        13 => 1 << 20,
        // Chain: a piece and its k sources' addresses.
        11 => 256 << 10,
        // Info, Manifest, Join, Chunk, Versions, UpdateChunk, Norms, Served: a few numbers.
        _ => 4 << 10,
    }
}

/// The varint at the start of `bytes`, and the bytes after it.
fn varint(bytes: &[u8]) -> Option<(u64, &[u8])> {
    let mut v = 0u64;
    for (i, b) in bytes.iter().enumerate().take(10) {
        v |= u64::from(b & 0x7f) << (7 * i);
        if b & 0x80 == 0 {
            return Some((v, &bytes[i + 1..]));
        }
    }
    None
}

/// The variant index of an encoded message (after its protocol version), once the first bytes
/// of it are there.
fn variant_of(head: &[u8]) -> Option<u64> {
    let (_, rest) = varint(head)?;
    varint(rest).map(|(v, _)| v)
}

/// Reads one length-prefixed frame: refused as soon as it says it is larger than `cap` allows
/// for its kind (`cap` of its variant index; `None`: any size up to [`MAX_MESSAGE_BYTES`]), and
/// read a piece at a time from the node's [`INBOUND_BUDGET`].
pub async fn read_frame<T: AsyncRead + Unpin + Send>(
    io: &mut T,
    cap: Option<fn(u64) -> usize>,
) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    io.read_exact(&mut len).await?;
    let len = u32::from_le_bytes(len) as usize;
    let refuse = |limit: usize| {
        OVERSIZED.fetch_add(1, Ordering::Relaxed);
        Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a frame of {len} bytes, over the {limit} its kind may take"),
        ))
    };
    if len > MAX_MESSAGE_BYTES {
        return refuse(MAX_MESSAGE_BYTES);
    }
    let mut held = Held(0, Budget::Requests);
    let mut buf = Vec::new();
    while buf.len() < len {
        let piece = (len - buf.len()).min(PIECE);
        held.take(piece)?;
        let at = buf.len();
        buf.resize(at + piece, 0);
        io.read_exact(&mut buf[at..]).await?;
        // The kind is known from the first piece: a frame larger than its kind is refused
        // before the rest of it costs anything.
        if at == 0
            && let Some(cap) = cap
            && let Some(variant) = variant_of(&buf)
            && len > cap(variant)
        {
            return refuse(cap(variant));
        }
    }
    Ok(buf)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

    use super::*;
    use crate::mesh::MeshRequest;

    fn framed(body: &[u8], claimed: Option<u32>) -> Vec<u8> {
        let len = claimed.unwrap_or(body.len() as u32);
        [len.to_le_bytes().as_slice(), body].concat()
    }

    fn read(bytes: Vec<u8>) -> io::Result<Vec<u8>> {
        let mut io = futures::io::Cursor::new(bytes);
        futures::executor::block_on(read_frame(&mut io, Some(request_cap)))
    }

    #[test]
    fn each_kind_of_request_is_read_within_its_size() {
        let info = crate::protocol::encode(&MeshRequest::Info).unwrap();
        assert_eq!(read(framed(&info, None)).unwrap(), info);
        // A view request padded to a megabyte: refused after its first piece.
        let before = OVERSIZED.load(Ordering::Relaxed);
        let mut padded = info.clone();
        padded.resize(1 << 20, 0);
        let err = read(framed(&padded, None)).unwrap_err();
        assert!(err.to_string().contains("its kind may take"), "{err}");
        assert!(OVERSIZED.load(Ordering::Relaxed) > before);
        // An update of a few megabytes is read whole.
        let learn = crate::protocol::encode(&MeshRequest::Learn(vec![7; 3 << 20])).unwrap();
        assert_eq!(read(framed(&learn, None)).unwrap().len(), learn.len());
        // A length past any message: refused before anything is read.
        assert!(read(framed(&[], Some(u32::MAX))).is_err());
    }

    #[test]
    fn a_frame_claimed_and_not_sent_costs_what_arrived() {
        // 64 MiB claimed, 100 KiB sent: the read fails at the end of the bytes, having held at
        // most the pieces that arrived (a piece at a time), and gives them back.
        let learn = crate::protocol::encode(&MeshRequest::Learn(vec![1; 100 << 10])).unwrap();
        let err = read(framed(&learn, Some(MAX_MESSAGE_BYTES as u32))).unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
        let mut held = Held(0, Budget::Requests);
        held.take(PIECE).unwrap();
        assert!(held.take(INBOUND_BUDGET).is_err(), "past the budget");
        drop(held);
    }
}
