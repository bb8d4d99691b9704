//! The session's frames, order and bounds, over in-memory streams.

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
    let mut buf = FrameReader::default();
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
    let mut buf = FrameReader::default();
    let huge = u32::MAX.to_le_bytes().to_vec();
    let err = block_on(read_frame::<Ask, _>(&mut Cursor::new(huge), &mut buf)).unwrap_err();
    assert!(matches!(err, SessionError::TooLarge { .. }), "{err}");
    assert!(
        buf.body.capacity() < 1024,
        "nothing allocated for a lying length"
    );
    let mut cut = frame(&ask(1, vec![1.0; 8])).unwrap();
    cut.truncate(cut.len() - 3);
    let err = block_on(read_frame::<Ask, _>(&mut Cursor::new(cut), &mut buf)).unwrap_err();
    assert!(matches!(err, SessionError::Truncated { .. }), "{err}");
    let err = block_on(read_frame::<Ask, _>(&mut Cursor::new(vec![3, 0]), &mut buf)).unwrap_err();
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

/// One direction of an in-memory stream that holds at most `cap` bytes, as a socket's
/// buffer does: a writer waits for room, a reader for bytes.
#[derive(Clone)]
struct Half(std::sync::Arc<std::sync::Mutex<Pipe>>);

struct Pipe {
    bytes: VecDeque<u8>,
    cap: usize,
    closed: bool,
    reader: Option<std::task::Waker>,
    writer: Option<std::task::Waker>,
}

fn half(cap: usize) -> Half {
    Half(std::sync::Arc::new(std::sync::Mutex::new(Pipe {
        bytes: VecDeque::new(),
        cap,
        closed: false,
        reader: None,
        writer: None,
    })))
}

impl Half {
    fn shut(&self) {
        let mut p = self.0.lock().unwrap();
        p.closed = true;
        if let Some(w) = p.reader.take() {
            w.wake();
        }
    }

    fn len(&self) -> usize {
        self.0.lock().unwrap().bytes.len()
    }
}

impl AsyncRead for Half {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<std::io::Result<usize>> {
        let mut p = self.0.lock().unwrap();
        if p.bytes.is_empty() {
            if p.closed {
                return Poll::Ready(Ok(0));
            }
            p.reader = Some(cx.waker().clone());
            return Poll::Pending;
        }
        let n = buf.len().min(p.bytes.len());
        for (b, x) in buf.iter_mut().zip(p.bytes.drain(..n)) {
            *b = x;
        }
        if let Some(w) = p.writer.take() {
            w.wake();
        }
        Poll::Ready(Ok(n))
    }
}

impl AsyncWrite for Half {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let mut p = self.0.lock().unwrap();
        if p.closed {
            return Poll::Ready(Err(std::io::ErrorKind::BrokenPipe.into()));
        }
        let room = p.cap - p.bytes.len();
        if room == 0 {
            p.writer = Some(cx.waker().clone());
            return Poll::Pending;
        }
        let n = room.min(buf.len());
        p.bytes.extend(&buf[..n]);
        if let Some(w) = p.reader.take() {
            w.wake();
        }
        Poll::Ready(Ok(n))
    }

    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_close(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.shut();
        Poll::Ready(Ok(()))
    }
}

/// A leader's end: reads one half, writes the other.
struct Duplex {
    read: Half,
    write: Half,
}

impl AsyncRead for Duplex {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.read).poll_read(cx, buf)
    }
}

impl AsyncWrite for Duplex {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.write).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.write).poll_flush(cx)
    }

    fn poll_close(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.write).poll_close(cx)
    }
}

/// A member answering every step with its input repeated four times (answers larger
/// than asks), over streams of `cap` bytes each way; the leader's driven end.
fn pair(cap: usize) -> (Driven<Duplex>, Half, Half, impl Future<Output = u64>) {
    let (to_member, to_leader) = (half(cap), half(cap));
    let leader = Driven::new(Duplex {
        read: to_leader.clone(),
        write: to_member.clone(),
    });
    let member = serve(to_member.clone(), to_leader.clone(), |_, step| async move {
        match step {
            StepRequest::Matmul { x, .. } => MeshResponse::Step {
                bytes: x.repeat(4).iter().flat_map(|v| v.to_le_bytes()).collect(),
                compute_us: 1,
            },
            _ => MeshResponse::Error("not a product".into()),
        }
    });
    let member = async move { member.await.unwrap_or(0) };
    (leader, to_member, to_leader, member)
}

/// Drives `leader` until `n` answers came or it failed.
async fn answers(leader: &mut Driven<Duplex>, n: usize) -> Result<Vec<Answer>, SessionError> {
    let mut got = Vec::new();
    while got.len() < n {
        got.push(std::future::poll_fn(|cx| leader.poll_answer(cx, Instant::now())).await?);
    }
    Ok(got)
}

#[test]
fn a_driven_session_writes_while_it_reads_so_large_frames_never_deadlock() {
    // Asks of 40 000 values (160 kB) and answers four times larger through 1 kB buffers:
    // writing every ask before reading would leave both sides waiting for room.
    let (mut leader, to_member, _, member) = pair(1024);
    let now = Instant::now();
    for id in 1..=3 {
        leader.ask(&ask(id, vec![id as f32; 40_000]), now).unwrap();
    }
    // Both ends polled in turn: a deadlock shows as no answers, not as a hung test.
    let mut answers = std::pin::pin!(answers(&mut leader, 3));
    let mut member = std::pin::pin!(member);
    let mut cx = Context::from_waker(futures::task::noop_waker_ref());
    let got = (0..100_000)
        .find_map(|_| {
            if let Poll::Ready(served) = member.as_mut().poll(&mut cx) {
                panic!("the member stopped after {served} asks");
            }
            match answers.as_mut().poll(&mut cx) {
                Poll::Ready(got) => Some(got),
                Poll::Pending => None,
            }
        })
        .expect("the session deadlocked: no answers after 100 000 polls");
    let got = got.unwrap();
    assert_eq!(got.iter().map(|a| a.id).collect::<Vec<_>>(), [1, 2, 3]);
    for a in &got {
        let MeshResponse::Step { bytes, .. } = &a.response else {
            panic!("{:?}", a.response);
        };
        assert_eq!(bytes.len(), 4 * 4 * 40_000);
        assert!(bytes.chunks(4).all(|b| b == (a.id as f32).to_le_bytes()));
    }
    assert_eq!(to_member.len(), 0, "every ask was written and read");
}

#[test]
fn a_member_that_stops_reading_costs_the_leader_a_bounded_queue() {
    // A member that never reads: its stream holds 1 kB, the leader's asks queue behind it.
    let (mut leader, to_member, _, _) = pair(1024);
    let mut cx = Context::from_waker(futures::task::noop_waker_ref());
    let now = Instant::now();
    for id in 0..MAX_UNANSWERED as u64 {
        leader.ask(&ask(id, vec![1.0; 256]), now).unwrap();
        assert!(leader.poll_answer(&mut cx, now).is_pending());
    }
    assert_eq!(to_member.len(), 1024, "the stream is full");
    let err = leader.ask(&ask(99, vec![1.0; 256]), now).unwrap_err();
    assert!(
        matches!(
            err,
            SessionError::Stalled {
                asks: MAX_UNANSWERED,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("stalled"), "{err}");
    let queued: usize = leader.out.iter().map(|(_, f)| f.len()).sum();
    assert!(queued < MAX_UNANSWERED * 1100, "{queued} bytes queued");
    // Bytes bound too: one large ask is taken, a second that would pass the bound is not.
    let (mut leader, _, _, _) = pair(16);
    let big = MAX_QUEUED_BYTES / 4 - 64;
    leader.ask(&ask(1, vec![0.0; big]), now).unwrap();
    let err = leader.ask(&ask(2, vec![0.0; 64]), now).unwrap_err();
    assert!(
        matches!(err, SessionError::Stalled { asks: 1, .. }),
        "{err}"
    );
    assert!(
        room_for(0, 0, MAX_QUEUED_BYTES).is_ok(),
        "one ask of the largest frame is always taken"
    );
}

#[test]
fn a_held_ask_waits_and_a_closed_session_names_its_unanswered_asks() {
    let (mut leader, to_member, to_leader, _) = pair(1 << 20);
    let now = Instant::now();
    let later = now + std::time::Duration::from_secs(3600);
    leader.ask(&ask(1, vec![1.0]), later).unwrap();
    assert_eq!(leader.held_until(now), Some(later));
    let waker = futures::task::noop_waker_ref();
    let mut cx = Context::from_waker(waker);
    assert!(leader.poll_answer(&mut cx, now).is_pending());
    assert_eq!(
        to_member.len(),
        0,
        "a held ask is not written before its time"
    );
    leader.ask(&ask(2, vec![1.0]), now).unwrap();
    // The member goes away with both asks unanswered.
    to_leader.shut();
    let Poll::Ready(Err(err)) = leader.poll_answer(&mut cx, later) else {
        panic!("a closed session is an error");
    };
    assert!(err.to_string().contains("closed"), "{err}");
    assert_eq!(leader.unanswered().collect::<Vec<_>>(), [1, 2]);
}

#[test]
fn an_answer_out_of_order_ends_the_session() {
    let (mut leader, _, to_leader, _) = pair(1 << 20);
    leader.ask(&ask(1, vec![1.0]), Instant::now()).unwrap();
    let stray = frame(&Answer {
        id: 9,
        response: MeshResponse::Error("?".into()),
    })
    .unwrap();
    to_leader.0.lock().unwrap().bytes.extend(stray);
    let err = block_on(answers(&mut leader, 1)).unwrap_err();
    assert!(
        matches!(err, SessionError::OutOfOrder { got: 9, want: 1 }),
        "{err}"
    );
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let mut buf = FrameReader::default();
        let mut r = Cursor::new(bytes.clone());
        while let Ok(Some(_)) = block_on(read_frame::<Ask, _>(&mut r, &mut buf)) {}
        let mut r = Cursor::new(bytes.clone());
        while let Ok(Some(_)) = block_on(read_frame::<Answer, _>(&mut r, &mut buf)) {}
        let mut out = Cursor::new(Vec::new());
        let _ = block_on(serve(Cursor::new(bytes), &mut out, sum));
    }
}
