//! The trainer's policy, for a leader that serves and learns at once, with no I/O: when a
//! minibatch begins and when an idle learner flushes ([`Schedule`]), how much of the mesh's
//! time training may take while requests are served ([`Turns`]), and how finished requests
//! share one minibatch (each text once, each cut to its share of the positions). Time is
//! passed in; the shell's tasks wait as it says.

use std::collections::VecDeque;

use web_time::{Duration, Instant};

use crate::learn::{Optimizer, bytes_per_position};
use crate::mesh::{LearningConfig, ModelManifest};
use crate::model::{LlamaConfig, training_bytes};

/// The share of the time training may take while requests are being served (all of it while
/// none are): serving keeps at least `1 − TRAIN_SHARE` of the mesh, and training still moves.
pub const TRAIN_SHARE: f64 = 0.15;

/// Fewest positions a waiting request keeps when the minibatch is cut among many.
pub const MIN_SHARE: usize = 32;

/// Most tokens in one training minibatch, whatever the model.
pub const LEARN_TOKENS: usize = 1024;

/// While requests are being served, a minibatch begins at most this long after the one before
/// it (sooner once the waiting requests fill one): under load the requests that finish meanwhile
/// share one update's fixed costs (the canary gate's forward pass, publishing it, every
/// holder's apply). Measured (`scripts/learning-bench.sh --load`, 150 chats from one client):
/// without the gap, learning kept 0.66× of learning-off throughput.
pub const MIN_STEP_GAP: Duration = Duration::from_secs(10);

/// An idle trainer publishes what its learner accumulated after this long with nothing to
/// train on.
pub const IDLE_FLUSH: Duration = Duration::from_secs(10);

/// How long training waits, while requests are served, before its next round after working
/// for `worked`: so that it keeps to [`TRAIN_SHARE`] of the time.
pub fn turn_wait(worked: Duration) -> Duration {
    worked.mul_f64((1.0 - TRAIN_SHARE) / TRAIN_SHARE)
}

/// The trainer's turns at the mesh while requests are served: each round of its group starts
/// when [`Turns::next`] says, so training keeps to [`TRAIN_SHARE`] of the time.
#[derive(Debug, Default, Clone)]
pub struct Turns {
    /// When the last round began.
    last: Option<Instant>,
}

impl Turns {
    /// When the next round may begin, asked at `now`: at once while nothing is served, else once
    /// training has waited its share for all it did since its last round began (the shell
    /// starts it sooner if serving goes quiet meanwhile).
    pub fn next(&self, now: Instant, serving: bool) -> Instant {
        if !serving {
            return now;
        }
        let worked = self
            .last
            .map_or(Duration::ZERO, |t| now.saturating_duration_since(t));
        now + turn_wait(worked)
    }

    /// A round began at `now`.
    pub fn began(&mut self, now: Instant) {
        self.last = Some(now);
    }

    /// The trainer stopped working (its pass ran and its update settled): the next round's
    /// wait counts nothing before it, so the time spent gathering the next minibatch is not
    /// taken for work.
    pub fn rest(&mut self) {
        self.last = None;
    }
}

/// What the trainer does next ([`Schedule::poll`]).
#[derive(Debug)]
pub enum Due<R> {
    /// Nothing before this moment, unless a request arrives or serving goes quiet; then poll
    /// again.
    Wait(Instant),
    /// Train on this minibatch now.
    Train(Minibatch<R>),
    /// Nothing came for [`IDLE_FLUSH`]: hand out what the learner accumulated.
    Flush,
}

/// When the trainer trains, with no I/O: finished requests arrive; while requests are being
/// served it gathers them for up to [`MIN_STEP_GAP`] after the last minibatch began or until
/// their distinct texts fill one, and at once while nothing is served; after [`IDLE_FLUSH`]
/// with nothing to train on it flushes. The API's trainer and the simulation drive it.
#[derive(Debug)]
pub struct Schedule<R> {
    /// Requests waiting to be trained on, in order.
    waiting: VecDeque<R>,
    /// Positions of the waiting requests' distinct texts.
    positions: usize,
    /// Most positions of one minibatch.
    limit: usize,
    /// When the last minibatch began.
    began: Option<Instant>,
    /// Since when nothing has waited (the idle flush counts from it).
    idle_from: Option<Instant>,
}

impl<R: Lesson> Schedule<R> {
    /// A schedule of minibatches of at most `limit` positions ([`minibatch_tokens`]).
    pub fn new(limit: usize) -> Self {
        Self {
            waiting: VecDeque::new(),
            positions: 0,
            limit,
            began: None,
            idle_from: None,
        }
    }

    /// A finished request arrived to be trained on.
    pub fn arrived(&mut self, r: R) {
        if !self.waiting.iter().any(|w| w.tokens() == r.tokens()) {
            self.positions += r.tokens().len();
        }
        self.waiting.push_back(r);
        self.idle_from = None;
    }

    /// Requests waiting.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// What to do at `now`, with requests being `serving` or not.
    pub fn poll(&mut self, now: Instant, serving: bool) -> Due<R> {
        if self.waiting.is_empty() {
            let from = *self.idle_from.get_or_insert(now);
            if now < from + IDLE_FLUSH {
                return Due::Wait(from + IDLE_FLUSH);
            }
            self.idle_from = Some(now);
            return Due::Flush;
        }
        if let Some(began) = self.began
            && serving
            && self.positions < self.limit
            && now < began + MIN_STEP_GAP
        {
            return Due::Wait(began + MIN_STEP_GAP);
        }
        self.began = Some(now);
        let taken = share_out(&mut self.waiting, self.limit);
        self.positions = distinct_positions(&self.waiting);
        Due::Train(taken)
    }
}

/// Positions of the distinct texts of `waiting`.
fn distinct_positions<R: Lesson>(waiting: &VecDeque<R>) -> usize {
    let mut distinct: Vec<&[u32]> = waiting.iter().map(Lesson::tokens).collect();
    distinct.sort_unstable();
    distinct.dedup();
    distinct.iter().map(|t| t.len()).sum()
}

/// Most tokens one training minibatch can carry on this mesh: the LM head's answers for all of
/// its rows (`rows × vocab / k` values per member) within a message's worth (the minibatches
/// learning was measured with; the head now runs [`crate::model::HEAD_BYTES`] at a time),
/// exact updates (rank 0) at most the training window, and the pass within [`TRAIN_BYTES`].
pub fn minibatch_tokens(manifest: &ModelManifest) -> usize {
    minibatch_positions(&manifest.cfg, manifest.generator.k(), &manifest.learning)
}

/// [`minibatch_tokens`] of a mesh of model `cfg` coded with `k` and learning with `learning`.
pub fn minibatch_positions(cfg: &LlamaConfig, k: usize, learning: &LearningConfig) -> usize {
    let per_row = 2 * 4 * cfg.vocab.div_ceil(k.max(1));
    let by_message = crate::protocol::MAX_MESSAGE_BYTES / per_row.max(1);
    let window = crate::learn::training_window(learning, cfg);
    let limit = if learning.rank == 0 {
        window
    } else {
        LEARN_TOKENS
    };
    // The most positions whose training pass fits [`TRAIN_BYTES`] (SGD also keeps every
    // stage's factors until the pass ends).
    let sgd = learning.optimizer == Optimizer::Sgd;
    let fits = |p: usize| {
        let factors = if sgd { p * bytes_per_position(cfg) } else { 0 };
        training_bytes(cfg, p, window) + factors <= TRAIN_BYTES
    };
    let (mut lo, mut hi) = (2, limit.min(by_message).max(2));
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

/// Most bytes a leader's training pass may hold: its activations, a run of the LM head's
/// logits and (SGD) its factors, beside its row (docs/models.md, "Memory that follows 1/k").
pub const TRAIN_BYTES: usize = 128 << 20;

/// A finished request, as a minibatch sees it: the text it trains on.
pub trait Lesson {
    /// The tokens it trains on.
    fn tokens(&self) -> &[u32];
}

/// What one training pass takes: the requests it trains on, and their distinct token
/// sequences (requests that sent the same text train once, and count as many), each cut to its
/// share of the minibatch's positions.
#[derive(Debug)]
pub struct Minibatch<R> {
    /// The requests taken.
    pub requests: Vec<R>,
    /// Their distinct texts, cut to fit.
    pub seqs: Vec<Vec<u32>>,
}

/// Takes requests from the front of `waiting` while their distinct sequences fit `limit`
/// positions at [`MIN_SHARE`] each, and cuts each sequence to its share (its last positions):
/// the shortest keep all they have, the rest split what is left evenly.
pub fn share_out<R: Lesson>(waiting: &mut VecDeque<R>, limit: usize) -> Minibatch<R> {
    let most = (limit / MIN_SHARE).max(1);
    let (mut requests, mut seqs) = (Vec::new(), Vec::<Vec<u32>>::new());
    while let Some(r) = waiting.front() {
        let seen = seqs.iter().any(|s| s == r.tokens());
        if !seen && seqs.len() >= most {
            break;
        }
        if !seen {
            seqs.push(r.tokens().to_vec());
        }
        requests.extend(waiting.pop_front());
    }
    let total: usize = seqs.iter().map(Vec::len).sum();
    if total > limit {
        seqs.sort_by_key(Vec::len);
        let mut left = limit;
        let n = seqs.len();
        for (i, s) in seqs.iter_mut().enumerate() {
            let share = (left / (n - i)).max(2);
            let keep = s.len().min(share);
            s.drain(..s.len() - keep);
            left = left.saturating_sub(keep);
        }
    }
    Minibatch { requests, seqs }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Lesson for Vec<u32> {
        fn tokens(&self) -> &[u32] {
            self
        }
    }

    #[test]
    fn a_minibatch_takes_every_waiting_request_trains_each_text_once_and_cuts_them_to_fit() {
        // Ten requests: the same 100-token text six times, and four texts of 300, 40, 300 and
        // 300 tokens, with room for 512 positions (16 distinct texts at most).
        let same: Vec<u32> = (0..100).collect();
        let long = |seed: u32| -> Vec<u32> { (0..300).map(|i| i * 7 + seed).collect() };
        let mut waiting: VecDeque<Vec<u32>> = [
            same.clone(),
            long(1),
            same.clone(),
            (0..40).rev().collect(),
            same.clone(),
            long(2),
            same.clone(),
            long(3),
            same.clone(),
            same.clone(),
        ]
        .into_iter()
        .collect();
        let b = share_out(&mut waiting, 512);
        assert!(waiting.is_empty(), "every request is taken");
        assert_eq!(b.requests.len(), 10);
        assert_eq!(b.seqs.len(), 5, "the repeated text trains once");
        let total: usize = b.seqs.iter().map(Vec::len).sum();
        assert!(total <= 512, "{total} positions");
        // The short ones keep everything; the long ones split the rest, keeping their ends.
        let lens: Vec<usize> = b.seqs.iter().map(Vec::len).collect();
        assert_eq!(lens, vec![40, 100, 124, 124, 124]);
        assert!(b.seqs.iter().any(|s| s.last() == Some(&(299 * 7 + 3))));
        // Past the most distinct texts a minibatch holds, the rest wait for the next one.
        let mut many: VecDeque<Vec<u32>> = (0..20u32).map(|i| vec![i, i + 1]).collect();
        let b = share_out(&mut many, 4 * MIN_SHARE);
        assert_eq!((b.seqs.len(), many.len()), (4, 16));
    }

    #[test]
    fn while_serving_a_minibatch_gathers_until_its_gap_or_a_full_one_and_at_once_when_quiet() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let text = |n: u32, len: u32| -> Vec<u32> { (0..len).map(|i| i * 31 + n).collect() };
        let mut s: Schedule<Vec<u32>> = Schedule::new(256);
        // The first request trains at once, served or not.
        s.arrived(text(1, 40));
        let Due::Train(first) = s.poll(at(0), true) else {
            panic!("the first request did not train at once");
        };
        assert_eq!(first.requests.len(), 1);
        // While serving, what comes next waits for the gap after the last minibatch began.
        s.arrived(text(2, 40));
        s.arrived(text(2, 40));
        assert!(matches!(s.poll(at(3), true), Due::Wait(t) if t == at(10)));
        let Due::Train(second) = s.poll(at(10), true) else {
            panic!("the gap passed and nothing trained");
        };
        assert_eq!((second.requests.len(), second.seqs.len()), (2, 1));
        // Texts that fill a minibatch train before the gap.
        for n in 3..9 {
            s.arrived(text(n, 40));
            assert!(matches!(s.poll(at(11), true), Due::Wait(_)), "{n}");
        }
        s.arrived(text(9, 40));
        assert!(matches!(s.poll(at(11), true), Due::Train(b) if b.seqs.len() == 7));
        // Once serving is quiet, a waiting request trains at once.
        s.arrived(text(10, 40));
        assert!(matches!(s.poll(at(12), true), Due::Wait(t) if t == at(21)));
        assert!(matches!(s.poll(at(12), false), Due::Train(b) if b.requests.len() == 1));
        assert_eq!(s.waiting(), 0);
    }

    #[test]
    fn an_idle_trainer_flushes_after_its_wait_and_again_after_another() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut s: Schedule<Vec<u32>> = Schedule::new(256);
        assert!(matches!(s.poll(at(0), false), Due::Wait(t) if t == at(0) + IDLE_FLUSH));
        assert!(matches!(s.poll(at(9_999), false), Due::Wait(_)));
        assert!(matches!(s.poll(at(10_000), false), Due::Flush));
        assert!(matches!(s.poll(at(10_001), false), Due::Wait(t) if t == at(20_000)));
        // A request restarts the wait: the flush counts from when nothing waited again.
        s.arrived(vec![1, 2, 3]);
        assert!(matches!(s.poll(at(15_000), false), Due::Train(_)));
        assert!(matches!(s.poll(at(16_000), false), Due::Wait(t) if t == at(26_000)));
    }

    #[test]
    fn training_takes_its_turn_after_waiting_its_share_and_at_once_when_nothing_is_served() {
        let t0 = Instant::now();
        let mut turns = Turns::default();
        assert_eq!(
            turns.next(t0, true),
            t0,
            "the first round waits for nothing"
        );
        turns.began(t0);
        let now = t0 + Duration::from_millis(150);
        assert_eq!(
            turns.next(now, true),
            now + turn_wait(Duration::from_millis(150))
        );
        assert_eq!(turns.next(now, false), now);
    }

    #[test]
    fn training_waits_so_it_keeps_its_share_of_the_time() {
        let worked = Duration::from_millis(150);
        let waited = turn_wait(worked);
        let share = worked.as_secs_f64() / (worked + waited).as_secs_f64();
        assert!((share - TRAIN_SHARE).abs() < 1e-9, "{share}");
        assert_eq!(turn_wait(Duration::ZERO), Duration::ZERO);
    }
}
