//! A leader's link to one member's session ([`crate::net::session`]), for every shell: the
//! stream is opened in the background while asks queue, then asks are written and answers read
//! as the leader's rounds poll it; a failed session answers every ask with why. No task of its
//! own, so an ask and its answer cost no hand-off between tasks. Each shell gives the opening
//! future (its own streams: libp2p, a browser's, a local socket) and what it wants to know of
//! the session once open.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Mutex, PoisonError};
use std::task::{Context, Poll};

use futures::{AsyncRead, AsyncWrite};
use web_time::Instant;

use super::session::{Ask, Driven, room_for};
use crate::mesh::StepRefusal;

/// An answer a link hands on: the encoded step with the member's compute time in µs, or why
/// there is none.
pub type LinkAnswer = Result<(Vec<u8>, u64), StepRefusal>;

/// A leader's end of one member's session over streams of type `S`, opened by `F`, which
/// also gives `M`, what the shell keeps of the opened session (where it runs, say).
pub struct SessionLink<S, F, M> {
    /// In a mutex only so the link is `Sync` where its parts are `Send`: every method takes
    /// `&mut self`, so it is never locked.
    state: Mutex<State<S, F>>,
    /// What the shell keeps of the session, once open.
    opened: Option<M>,
}

enum State<S, F> {
    /// The stream is being opened; asks wait for it, each with the instant it may go out.
    Opening {
        open: F,
        queued: Vec<(Ask, Instant)>,
    },
    /// Open: asks are written and answers read as the link is polled.
    Open(Box<Driven<S>>),
    /// The session failed: every ask is answered with why.
    Failed(String),
}

impl<S, F, M: std::fmt::Debug> std::fmt::Debug for SessionLink<S, F, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match &*self.state.lock().unwrap_or_else(PoisonError::into_inner) {
            State::Opening { queued, .. } => format!("opening, {} asks queued", queued.len()),
            State::Open(_) => "open".to_string(),
            State::Failed(why) => format!("failed: {why}"),
        };
        f.debug_struct("SessionLink")
            .field("state", &state)
            .field("opened", &self.opened)
            .finish()
    }
}

impl<S, F, M> SessionLink<S, F, M>
where
    S: AsyncRead + AsyncWrite + Unpin,
    F: Future<Output = Result<(S, M), String>> + Unpin,
{
    /// A link whose session `open` opens (polled as the link is).
    pub fn opening(open: F) -> Self {
        Self {
            state: Mutex::new(State::Opening {
                open,
                queued: Vec::new(),
            }),
            opened: None,
        }
    }

    fn state(&mut self) -> &mut State<S, F> {
        self.state.get_mut().unwrap_or_else(PoisonError::into_inner)
    }

    /// What the shell keeps of the session, once it is open.
    pub fn opened(&self) -> Option<&M> {
        self.opened.as_ref()
    }

    /// Whether the session failed.
    pub fn failed(&mut self) -> bool {
        matches!(self.state(), State::Failed(_))
    }

    /// Queues an ask, to go out from `not_before` on as the link is next polled; why not,
    /// when the session has failed.
    pub fn ask(&mut self, ask: Ask, not_before: Instant) -> Result<(), String> {
        match self.state() {
            State::Opening { queued, .. } => {
                let bytes = queued.iter().map(|(a, _)| a.step.len()).sum();
                room_for(queued.len(), bytes, ask.step.len()).map_err(|e| e.to_string())?;
                queued.push((ask, not_before));
                Ok(())
            }
            State::Open(session) => session.ask(&ask, not_before).map_err(|e| e.to_string()),
            State::Failed(why) => Err(why.clone()),
        }
    }

    /// When the first ask held back (a bench's modelled delay) may go out, if one is.
    pub fn held_until(&mut self, now: Instant) -> Option<Instant> {
        match self.state() {
            State::Opening { queued, .. } => queued
                .iter()
                .map(|(_, at)| *at)
                .filter(|at| *at > now)
                .min(),
            State::Open(session) => session.held_until(now),
            State::Failed(_) => None,
        }
    }

    /// Opens the session if it just opened, writes what is due and hands every answer that
    /// came to `answer` (the ask's id and the answer); registers `cx` for what comes next. A
    /// session that fails answers every ask it holds with why.
    pub fn poll(
        &mut self,
        cx: &mut Context<'_>,
        now: Instant,
        answer: &mut impl FnMut(u64, LinkAnswer),
    ) {
        if let State::Opening { open, queued } = self.state() {
            let Poll::Ready(opened) = Pin::new(open).poll(cx) else {
                return;
            };
            let queued = std::mem::take(queued);
            match opened {
                Ok((stream, kept)) => {
                    let mut session = Driven::new(stream);
                    for (ask, at) in queued {
                        if let Err(e) = session.ask(&ask, at) {
                            answer(ask.id, Err(e.to_string().into()));
                        }
                    }
                    *self.state() = State::Open(Box::new(session));
                    self.opened = Some(kept);
                }
                Err(why) => {
                    tracing::debug!("session failed: {why}");
                    for (ask, _) in queued {
                        answer(ask.id, Err(why.clone().into()));
                    }
                    *self.state() = State::Failed(why);
                    return;
                }
            }
        }
        let State::Open(session) = self.state() else {
            return;
        };
        loop {
            match session.poll_answer(cx, now) {
                Poll::Ready(Ok(got)) => answer(got.id, got.response.into_step()),
                Poll::Ready(Err(e)) => {
                    let why = e.to_string();
                    tracing::debug!("session failed: {why}");
                    for id in session.unanswered() {
                        answer(id, Err(why.clone().into()));
                    }
                    *self.state() = State::Failed(why);
                    return;
                }
                Poll::Pending => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

    use std::io;

    use futures::channel::oneshot;
    use futures::future::{BoxFuture, FutureExt};

    use super::*;
    use crate::mesh::MeshResponse;
    use crate::net::session::{Answer, frame};

    /// What a member's stream has for the link to read, and whether the member closed it.
    type Incoming = std::sync::Arc<Mutex<(Vec<u8>, bool)>>;

    /// A member's stream: what the link writes is taken; it reads what the test gives it,
    /// and the end once the test closes it.
    struct Pipe(Incoming);

    impl AsyncRead for Pipe {
        fn poll_read(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &mut [u8],
        ) -> Poll<io::Result<usize>> {
            let mut incoming = self.0.lock().unwrap();
            let (bytes, closed) = &mut *incoming;
            if bytes.is_empty() {
                // The test polls again once it gave more.
                return if *closed {
                    Poll::Ready(Ok(0))
                } else {
                    Poll::Pending
                };
            }
            let n = buf.len().min(bytes.len());
            buf[..n].copy_from_slice(&bytes[..n]);
            bytes.drain(..n);
            Poll::Ready(Ok(n))
        }
    }

    impl AsyncWrite for Pipe {
        fn poll_write(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
            buf: &[u8],
        ) -> Poll<io::Result<usize>> {
            Poll::Ready(Ok(buf.len()))
        }

        fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }

        fn poll_close(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    /// The member answers ask `id`.
    fn answer(incoming: &Incoming, id: u64) {
        let response = MeshResponse::Step {
            bytes: vec![id as u8],
            compute_us: 5,
        };
        let framed = frame(&Answer { id, response }).unwrap();
        incoming.lock().unwrap().0.extend(framed);
    }

    type Opening = BoxFuture<'static, Result<(Pipe, &'static str), String>>;

    fn ask(id: u64) -> Ask {
        Ask {
            id,
            version: [7; 32],
            step: vec![1, 2, 3],
        }
    }

    /// A test's link: over a pipe, kept with a note of where it runs.
    type TestLink = SessionLink<Pipe, Opening, &'static str>;

    /// A link whose opening ends when the sender says how.
    fn link() -> (TestLink, oneshot::Sender<Result<Pipe, String>>) {
        let (tx, rx) = oneshot::channel::<Result<Pipe, String>>();
        let open = async move {
            let pipe = rx.await.map_err(|_| "cancelled".to_string())??;
            Ok((pipe, "over a pipe"))
        };
        (SessionLink::opening(open.boxed()), tx)
    }

    fn poll(link: &mut TestLink) -> Vec<(u64, LinkAnswer)> {
        let mut got = Vec::new();
        let waker = futures::task::noop_waker_ref();
        let mut cx = Context::from_waker(waker);
        link.poll(&mut cx, Instant::now(), &mut |id, a| got.push((id, a)));
        got
    }

    #[test]
    fn asks_wait_for_the_session_then_go_out_and_their_answers_come_back() {
        let (mut link, open) = link();
        link.ask(ask(1), Instant::now()).unwrap();
        assert!(poll(&mut link).is_empty(), "nothing while opening");
        assert!(link.opened().is_none());
        let incoming = Incoming::default();
        open.send(Ok(Pipe(incoming.clone()))).ok().unwrap();
        assert!(poll(&mut link).is_empty(), "no answer yet");
        assert_eq!(link.opened(), Some(&"over a pipe"));
        answer(&incoming, 1);
        let got = poll(&mut link);
        assert!(
            matches!(&got[..], [(1, Ok((b, 5)))] if b == &[1]),
            "{got:?}"
        );
        link.ask(ask(2), Instant::now()).unwrap();
        answer(&incoming, 2);
        let got = poll(&mut link);
        assert!(
            matches!(&got[..], [(2, Ok((b, 5)))] if b == &[2]),
            "{got:?}"
        );
        // The member closes the stream: the session fails, and so does every later ask.
        link.ask(ask(3), Instant::now()).unwrap();
        incoming.lock().unwrap().1 = true;
        let got = poll(&mut link);
        assert!(matches!(&got[..], [(3, Err(_))]), "{got:?}");
        assert!(link.failed());
        assert!(link.ask(ask(4), Instant::now()).is_err());
    }

    #[test]
    fn a_session_that_never_opens_queues_a_bounded_number_of_asks() {
        let (mut link, _open) = link();
        for id in 0..crate::net::session::MAX_UNANSWERED as u64 {
            link.ask(ask(id), Instant::now()).unwrap();
        }
        let why = link.ask(ask(99), Instant::now()).unwrap_err();
        assert!(why.contains("stalled"), "{why}");
        assert!(
            !link.failed(),
            "a full queue refuses the ask, not the session"
        );
    }

    #[test]
    fn a_session_that_cannot_open_answers_every_queued_ask_with_why() {
        let (mut link, open) = link();
        link.ask(ask(1), Instant::now()).unwrap();
        link.ask(ask(2), Instant::now()).unwrap();
        open.send(Err("the holder runs another release".into()))
            .ok()
            .unwrap();
        let got = poll(&mut link);
        let ids: Vec<u64> = got.iter().map(|(id, _)| *id).collect();
        assert_eq!(ids, [1, 2]);
        for (_, a) in &got {
            let why = format!("{:?}", a.as_ref().unwrap_err());
            assert!(why.contains("another release"), "{why}");
        }
        let why = link.ask(ask(3), Instant::now()).unwrap_err();
        assert!(why.contains("another release"), "{why}");
    }
}
