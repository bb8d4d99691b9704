//! Group sessions: one long-lived stream from a leader to each member of its group, opened when
//! the group forms and kept while it works. Every round is one frame each way on it, so the
//! swarm task is off the per-step path: no new substream, no protocol negotiation, no hop
//! through the swarm's event loop for a step.
//!
//! Frames are length-prefixed (u32, little-endian), versioned postcard ([`crate::protocol`]),
//! and size-limited before anything is allocated. A member answers its asks in order.

use std::future::Future;

use futures::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use serde::{Deserialize, Serialize, de::DeserializeOwned};

use crate::mesh::MeshResponse;
use crate::protocol::{self, MAX_MESSAGE_BYTES, ProtocolError, StepRequest};

/// Name of the session protocol; the version is part of it.
pub const SESSION_PROTOCOL: &str = "/codedmesh/session/1";

/// The session protocol's name, as libp2p takes it.
pub fn protocol() -> libp2p::StreamProtocol {
    libp2p::StreamProtocol::new(SESSION_PROTOCOL)
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
}

/// One message as a frame: its length, then its versioned encoding.
pub fn frame<T: Serialize>(msg: &T) -> Result<Vec<u8>, SessionError> {
    let body = protocol::encode(msg)?;
    let len = u32::try_from(body.len()).map_err(|_| SessionError::TooLarge {
        len: body.len(),
        max: MAX_FRAME_BYTES,
    })?;
    let mut out = Vec::with_capacity(4 + body.len());
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&body);
    Ok(out)
}

/// Writes a frame made by [`frame`] and flushes it (in pieces a WebRTC channel takes).
pub async fn write_frame<W: AsyncWrite + Unpin>(io: &mut W, frame: &[u8]) -> std::io::Result<()> {
    for piece in frame.chunks(WRITE_PIECE) {
        io.write_all(piece).await?;
    }
    io.flush().await
}

/// Reads the next frame; `None` when the stream ends cleanly between frames. The buffer grows
/// only as bytes arrive, so a lying length costs nothing.
pub async fn read_frame<T: DeserializeOwned, R: AsyncRead + Unpin>(
    io: &mut R,
    buf: &mut Vec<u8>,
) -> Result<Option<T>, SessionError> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < len.len() {
        match io.read(&mut len[got..]).await? {
            0 if got == 0 => return Ok(None),
            0 => return Err(SessionError::Truncated { got, len: 4 }),
            n => got += n,
        }
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME_BYTES {
        return Err(SessionError::TooLarge {
            len,
            max: MAX_FRAME_BYTES,
        });
    }
    buf.clear();
    let got = io.take(len as u64).read_to_end(buf).await?;
    if got < len {
        return Err(SessionError::Truncated { got, len });
    }
    Ok(Some(protocol::decode(buf)?))
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
    let mut buf = Vec::new();
    let mut served = 0;
    while let Some(ask) = read_frame::<Ask, _>(&mut reader, &mut buf).await? {
        let response = match protocol::decode::<StepRequest>(&ask.step) {
            Ok(step) => compute(ask.version, step).await,
            Err(e) => MeshResponse::Error(format!("bad step: {e}")),
        };
        let answer = frame(&Answer {
            id: ask.id,
            response,
        })
        .or_else(|e| {
            frame(&Answer {
                id: ask.id,
                response: MeshResponse::Error(e.to_string()),
            })
        })?;
        write_frame(&mut writer, &answer).await?;
        served += 1;
    }
    writer.close().await?;
    Ok(served)
}

/// The asks a leader has sent on one session and not yet had answered, in order.
#[derive(Debug, Default)]
pub struct Outstanding {
    ids: std::collections::VecDeque<u64>,
}

impl Outstanding {
    /// An ask went out.
    pub fn sent(&mut self, id: u64) {
        self.ids.push_back(id);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Stage;
    use futures::executor::block_on;
    use futures::io::Cursor;
    use proptest::prelude::*;

    fn ask(id: u64, x: Vec<f32>) -> Ask {
        Ask {
            id,
            version: [7; 32],
            step: protocol::encode(&StepRequest::Matmul {
                stage: Stage::Qkv(1),
                t: 1,
                x,
            })
            .unwrap(),
        }
    }

    /// A member at version [7; 32] that sums its input; a refusal for another version.
    async fn sum(version: [u8; 32], step: StepRequest) -> MeshResponse {
        match step {
            _ if version != [7; 32] => MeshResponse::Stale {
                have: [7; 32],
                updates: 1,
                want: version,
            },
            StepRequest::Matmul { x, .. } => MeshResponse::Step {
                bytes: x.iter().sum::<f32>().to_le_bytes().to_vec(),
                compute_us: 1,
            },
            _ => MeshResponse::Error("not a product".into()),
        }
    }

    #[test]
    fn a_member_answers_every_ask_in_order() {
        let mut asks = Vec::new();
        asks.extend(frame(&ask(1, vec![1.0, 2.0])).unwrap());
        let mut wrong = ask(2, vec![1.0]);
        wrong.version = [0; 32];
        asks.extend(frame(&wrong).unwrap());
        let mut garbled = ask(3, vec![]);
        garbled.step = vec![0xff, 0xff, 0xff];
        asks.extend(frame(&garbled).unwrap());
        asks.extend(frame(&ask(4, vec![0.5; 4])).unwrap());
        let mut out = Cursor::new(Vec::new());
        let served = block_on(serve(Cursor::new(asks), &mut out, sum)).unwrap();
        assert_eq!(served, 4);
        let mut reader = Cursor::new(out.into_inner());
        let mut buf = Vec::new();
        let mut answers = Vec::new();
        while let Some(a) = block_on(read_frame::<Answer, _>(&mut reader, &mut buf)).unwrap() {
            answers.push(a);
        }
        assert_eq!(
            answers.iter().map(|a| a.id).collect::<Vec<_>>(),
            [1, 2, 3, 4]
        );
        assert_eq!(
            answers[0].response,
            MeshResponse::Step {
                bytes: 3.0f32.to_le_bytes().to_vec(),
                compute_us: 1
            }
        );
        assert!(matches!(
            answers[1].response.clone().into_step(),
            Err(crate::mesh::StepRefusal::Stale {
                have: [7, ..],
                updates: 1,
                want: [0, ..]
            })
        ));
        assert!(matches!(&answers[2].response, MeshResponse::Error(e) if e.contains("bad step")));
        assert_eq!(
            answers[3].response,
            MeshResponse::Step {
                bytes: 2.0f32.to_le_bytes().to_vec(),
                compute_us: 1
            }
        );
    }

    #[test]
    fn oversized_truncated_and_foreign_frames_are_errors() {
        let mut buf = Vec::new();
        let huge = u32::MAX.to_le_bytes().to_vec();
        let err = block_on(read_frame::<Ask, _>(&mut Cursor::new(huge), &mut buf)).unwrap_err();
        assert!(matches!(err, SessionError::TooLarge { .. }), "{err}");
        assert!(
            buf.capacity() < 1024,
            "nothing allocated for a lying length"
        );
        let mut cut = frame(&ask(1, vec![1.0; 8])).unwrap();
        cut.truncate(cut.len() - 3);
        let err = block_on(read_frame::<Ask, _>(&mut Cursor::new(cut), &mut buf)).unwrap_err();
        assert!(matches!(err, SessionError::Truncated { .. }), "{err}");
        let err =
            block_on(read_frame::<Ask, _>(&mut Cursor::new(vec![3, 0]), &mut buf)).unwrap_err();
        assert!(
            matches!(err, SessionError::Truncated { got: 2, len: 4 }),
            "{err}"
        );
        // Another protocol version is named, not misread.
        let mut other = frame(&ask(1, vec![])).unwrap();
        other[4] = other[4].wrapping_add(1);
        let err = block_on(read_frame::<Ask, _>(&mut Cursor::new(other), &mut buf)).unwrap_err();
        assert!(err.to_string().contains("version"), "{err}");
        // A member reading garbage ends the session with the error and answers nothing.
        let mut out = Cursor::new(Vec::new());
        let err = block_on(serve(Cursor::new(vec![9, 0, 0, 0, 1, 2]), &mut out, sum));
        assert!(err.is_err());
        assert!(out.into_inner().is_empty());
    }

    #[test]
    fn answers_must_come_in_order() {
        let mut o = Outstanding::default();
        o.sent(5);
        o.sent(6);
        assert!(matches!(
            o.answered(6),
            Err(SessionError::OutOfOrder { got: 6, want: 5 })
        ));
        o.answered(5).unwrap();
        o.sent(7);
        assert_eq!(o.drain().collect::<Vec<_>>(), [6, 7]);
        assert!(o.answered(8).is_err());
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let mut buf = Vec::new();
            let mut r = Cursor::new(bytes.clone());
            while let Ok(Some(_)) = block_on(read_frame::<Ask, _>(&mut r, &mut buf)) {}
            let mut r = Cursor::new(bytes.clone());
            while let Ok(Some(_)) = block_on(read_frame::<Answer, _>(&mut r, &mut buf)) {}
            let mut out = Cursor::new(Vec::new());
            let _ = block_on(serve(Cursor::new(bytes), &mut out, sum));
        }
    }
}
