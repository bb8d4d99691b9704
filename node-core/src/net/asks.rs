//! A leader's asks over its members' sessions, for every shell: one [`SessionLink`] per row,
//! opened as the row is first asked (or as the group forms), each ask's answer, or why there is
//! none, handed on with the round it belongs to once it is due. The shells add only what their
//! runtime has: the timer a round waits on, and (natively) the leader's own row and the trace.

use std::collections::{BTreeMap, VecDeque};
use std::future::Future;
use std::task::Context;

use futures::{AsyncRead, AsyncWrite};
use libp2p::PeerId;
use web_time::{Duration, Instant};

use super::link::SessionLink;
use super::session::Ask;
use crate::mesh::StepRefusal;
use crate::mesh::rounds::MemberAnswer;

/// A leader's sessions with the holders of its rows, over streams `S` that `open` opens (a
/// future `F` giving the stream and `M`, what the shell keeps of it).
pub struct SessionAsks<S, F, M, O> {
    version: [u8; 32],
    peers: BTreeMap<usize, PeerId>,
    links: BTreeMap<usize, SessionLink<S, F, M>>,
    open: O,
    /// The round of every ask not yet answered, by its id.
    asked: BTreeMap<u64, u64>,
    next_id: u64,
    /// Asks that failed before they went out, answered at once.
    failed: VecDeque<MemberAnswer>,
    /// Answers read, each held until its instant (a bench's modelled delay; at once without).
    arrived: VecDeque<(Instant, MemberAnswer)>,
    /// The modelled one-way delay: asks go out, and answers are handed on, this much later.
    delay: Duration,
    /// The row whose session is driven first (the current round's first ask).
    first: usize,
    opened: usize,
    sent: u64,
}

impl<S, F, M: std::fmt::Debug, O> std::fmt::Debug for SessionAsks<S, F, M, O> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionAsks")
            .field("peers", &self.peers)
            .field("links", &self.links)
            .field("asked", &self.asked.len())
            .field("delay", &self.delay)
            .finish_non_exhaustive()
    }
}

impl<S, F, M, O> SessionAsks<S, F, M, O>
where
    S: AsyncRead + AsyncWrite + Unpin,
    F: Future<Output = Result<(S, M), String>> + Unpin,
    O: FnMut(PeerId) -> F,
{
    /// Asks at `version` to the holders of `peers` (row → peer), each session opened by
    /// `open` as its row is first asked.
    pub fn new(version: [u8; 32], peers: BTreeMap<usize, PeerId>, open: O) -> Self {
        Self {
            version,
            peers,
            links: BTreeMap::new(),
            open,
            asked: BTreeMap::new(),
            next_id: 0,
            failed: VecDeque::new(),
            arrived: VecDeque::new(),
            delay: Duration::ZERO,
            first: 0,
            opened: 0,
            sent: 0,
        }
    }

    /// The same, each ask going out and each answer handed on `delay` later (a bench's
    /// modelled one-way delay).
    pub fn with_delay(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    /// The modelled one-way delay (zero without one).
    pub fn delay(&self) -> Duration {
        self.delay
    }

    /// The version the members are asked at.
    pub fn version(&self) -> [u8; 32] {
        self.version
    }

    /// Asks at another version from now on.
    pub fn set_version(&mut self, version: [u8; 32]) {
        self.version = version;
    }

    /// The peer holding a row, as these asks know it.
    pub fn peer_of(&self, row: usize) -> Option<PeerId> {
        self.peers.get(&row).copied()
    }

    /// Each row's session opened so far.
    pub fn links(&self) -> impl Iterator<Item = (usize, &SessionLink<S, F, M>)> {
        self.links.iter().map(|(&row, link)| (row, link))
    }

    /// Sessions that opened, and asks handed to sessions.
    pub fn counts(&self) -> (usize, u64) {
        (self.opened, self.sent)
    }

    /// The session with a row's holder, opened now if there is none yet; `None` when no peer
    /// holds the row.
    pub fn link(&mut self, row: usize) -> Option<&mut SessionLink<S, F, M>> {
        let peer = *self.peers.get(&row)?;
        let open = &mut self.open;
        Some(
            self.links
                .entry(row)
                .or_insert_with(|| SessionLink::opening(open(peer))),
        )
    }

    /// A round begins at `row`: its session is driven first, so its ask goes out first.
    pub fn begin_at(&mut self, row: usize) {
        self.first = row;
    }

    /// Asks `row` the encoded step `step` for round `round`; an ask that cannot go out is
    /// answered at once with why.
    pub fn ask(&mut self, round: u64, row: usize, step: Vec<u8>) {
        let id = self.next_id;
        self.next_id += 1;
        let ask = Ask {
            id,
            version: self.version,
            step,
        };
        let not_before = Instant::now() + self.delay;
        let sent = match self.link(row) {
            Some(link) => link.ask(ask, not_before),
            None => Err(format!("no peer holds row {row}")),
        };
        match sent {
            Ok(()) => {
                self.asked.insert(id, round);
                self.sent += 1;
            }
            Err(why) => {
                let refusal = StepRefusal::Failed(why);
                self.failed.push_back((round, row, Err(refusal)));
            }
        }
    }

    /// Drives every session at `now`, from the round's first row on: opens, writes what is
    /// due and reads what came; registers `cx` for what comes next.
    pub fn drive(&mut self, cx: &mut Context<'_>, now: Instant) {
        let due = now + self.delay;
        let (asked, arrived, opened) = (&mut self.asked, &mut self.arrived, &mut self.opened);
        let mut poll = |row: usize, link: &mut SessionLink<S, F, M>| {
            let was_open = link.opened().is_some();
            link.poll(cx, now, &mut |id, answer| {
                if let Some(round) = asked.remove(&id) {
                    arrived.push_back((due, (round, row, answer)));
                }
            });
            *opened += usize::from(!was_open && link.opened().is_some());
        };
        for (&row, link) in self.links.range_mut(self.first..) {
            poll(row, link);
        }
        for (&row, link) in self.links.range_mut(..self.first) {
            poll(row, link);
        }
    }

    /// Drives every session without waiting for anything: writes the asks just made.
    pub fn flush(&mut self) {
        let waker = futures::task::noop_waker_ref();
        self.drive(&mut Context::from_waker(waker), Instant::now());
    }

    /// The next answer due at `now`, after driving every session; registers `cx` for the rest.
    pub fn poll_answer(&mut self, cx: &mut Context<'_>, now: Instant) -> Option<MemberAnswer> {
        if let Some(answer) = self.failed.pop_front() {
            return Some(answer);
        }
        self.drive(cx, now);
        match self.arrived.front() {
            Some((at, _)) if *at <= now => self.arrived.pop_front().map(|(_, answer)| answer),
            _ => None,
        }
    }

    /// An answer already due, if any (the sessions polled once, nothing waited for).
    pub fn try_answer(&mut self) -> Option<MemberAnswer> {
        let waker = futures::task::noop_waker_ref();
        self.poll_answer(&mut Context::from_waker(waker), Instant::now())
    }

    /// The next instant something held back by the modelled delay is due, if anything is
    /// (never without a delay).
    pub fn held_until(&mut self, now: Instant) -> Option<Instant> {
        if self.delay.is_zero() {
            return None;
        }
        let answers = self.arrived.front().map(|(at, _)| *at);
        let asks = self.links.values_mut().filter_map(|l| l.held_until(now));
        answers.into_iter().chain(asks).min()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

    use futures::future::{Ready, ready};

    use super::*;

    /// A stream that never opens: every session fails with why.
    type Refused = Ready<Result<(futures::io::Cursor<Vec<u8>>, ()), String>>;

    fn refusing(_: PeerId) -> Refused {
        ready(Err("refused".into()))
    }

    #[test]
    fn an_ask_of_a_row_no_peer_holds_or_a_session_that_fails_is_answered_with_why() {
        let peer = PeerId::random();
        let mut asks = SessionAsks::new([7; 32], BTreeMap::from([(0, peer)]), refusing);
        asks.ask(3, 5, vec![1, 2]);
        asks.ask(3, 0, vec![1, 2]);
        let (round, row, answer) = asks.try_answer().unwrap();
        assert_eq!((round, row), (3, 5));
        assert!(format!("{:?}", answer.unwrap_err()).contains("no peer holds row 5"));
        let (round, row, answer) = asks.try_answer().unwrap();
        assert_eq!((round, row), (3, 0));
        assert!(format!("{:?}", answer.unwrap_err()).contains("refused"));
        assert!(asks.try_answer().is_none());
        assert_eq!(asks.counts(), (0, 1));
        assert_eq!(asks.peer_of(0), Some(peer));
    }
}
