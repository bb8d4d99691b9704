//! The API's trainer in the simulation: the trainer's [`Schedule`] (when a minibatch begins,
//! when an idle learner flushes), its [`Turns`] before each round of its group while requests
//! are served, and [`settle`] (the canary gate, then the publisher), with a real [`Teacher`]
//! computing real gradients through a group of [`SimTransport`]s, in virtual time. Finished
//! requests arrive at virtual moments, serving is busy over spans of it, and the holders can
//! refuse an update: the same rules the engine's trainer task runs, without processes.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;

use node_core::lead::training::{Due, Lesson, Minibatch, Schedule, Turns};
use node_core::lead::{Publisher, Settled, settle};
use node_core::learn::{GateClaim, Published, Teacher};
use node_core::model::Llama;

use super::*;

/// The version the simulated mesh is at (its updates are not applied to the members).
const VERSION: [u8; 32] = [9; 32];

/// A finished request the simulated trainer takes: its text.
#[derive(Debug, Clone)]
pub struct SimLesson(pub Vec<u32>);

impl Lesson for SimLesson {
    fn tokens(&self) -> &[u32] {
        &self.0
    }
}

/// What the simulated trainer did, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum TrainerStep {
    /// Trained on a minibatch of this many requests and distinct texts.
    Trained {
        /// When the minibatch began.
        began: Duration,
        /// Requests taken.
        requests: usize,
        /// Their distinct texts.
        texts: usize,
    },
    /// Idle, it flushed its learner.
    Flushed,
    /// An update was handed out, folding this many requests.
    Published(u32),
    /// The canary gate refused an update.
    Refused,
    /// The holders did not take an update.
    Lost(String),
    /// The gate could not judge an update.
    Unjudged(String),
}

/// The simulated holders as the trainer's publisher: they take every update but those whose
/// places (0 for the first handed out) are refused.
#[derive(Debug)]
struct SimHolders {
    refuse: BTreeSet<usize>,
    handed: usize,
    taken: Vec<Published>,
}

impl Publisher for SimHolders {
    type Sent = ();

    async fn publish(
        &mut self,
        p: Published,
        _: Option<GateClaim>,
    ) -> Result<((), Option<[u8; 32]>), String> {
        let n = self.handed;
        self.handed += 1;
        if self.refuse.contains(&n) {
            return Err(format!("no holder took update {n}"));
        }
        self.taken.push(p);
        Ok(((), None))
    }
}

/// Spans of virtual time (from, to) during which requests are served.
type Spans = Rc<Vec<(Duration, Duration)>>;

/// The end of the serving span that holds `at`, if one does.
fn serving_until(spans: &[(Duration, Duration)], at: Duration) -> Option<Duration> {
    spans
        .iter()
        .find(|(from, to)| *from <= at && at < *to)
        .map(|(_, to)| *to)
}

/// How a simulated trainer runs.
#[derive(Debug, Clone)]
pub struct TrainerConfig {
    /// The rows of its group (the k decoded).
    pub rows: Vec<usize>,
    /// Its transport's latencies.
    pub leader: LeaderConfig,
    /// Most positions of a minibatch.
    pub limit: usize,
    /// Spans of virtual time (from, to) during which requests are served.
    pub serving: Vec<(Duration, Duration)>,
}

/// The API's trainer over one simulated group, in virtual time.
pub struct SimTrainer<'a> {
    llama: &'a Llama,
    group: CodedGroup<SimTransport>,
    teacher: Teacher,
    schedule: Schedule<SimLesson>,
    turns: Rc<RefCell<Turns>>,
    holders: SimHolders,
    /// Finished requests still to arrive, by virtual time.
    arrivals: VecDeque<(Duration, SimLesson)>,
    serving: Spans,
    base: Instant,
    /// What it did, with the virtual time.
    pub log: Vec<(Duration, TrainerStep)>,
    /// Each round's wait for its turn: when it was asked, and how long it waited.
    pub waits: Rc<RefCell<Vec<(Duration, Duration)>>>,
}

impl std::fmt::Debug for SimTrainer<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimTrainer")
            .field("log", &self.log)
            .finish_non_exhaustive()
    }
}

impl<'a> SimTrainer<'a> {
    /// A trainer of `teacher` over a group of `shards`' rows, as `cfg` says.
    pub fn new(
        llama: &'a Llama,
        generator: &Generator,
        shards: &InProcess,
        cfg: TrainerConfig,
        teacher: Teacher,
    ) -> Result<Self, CodedError> {
        let turns = Rc::new(RefCell::new(Turns::default()));
        let waits = Rc::new(RefCell::new(Vec::new()));
        let serving: Spans = Rc::new(cfg.serving);
        let members = shards.members().to_vec();
        let t = SimTransport::new(members, generator.clone(), Vec::new(), cfg.leader)?;
        let base = t.now();
        let gate = {
            let (turns, waits, serving) = (turns.clone(), waits.clone(), serving.clone());
            // As the engine's gate: the turn's moment, or sooner when serving goes quiet.
            RoundGate(Box::new(move |now: Instant| {
                let at = now.saturating_duration_since(base);
                let end = serving_until(&serving, at);
                let mut may = turns.borrow().next(now, end.is_some());
                if let Some(end) = end {
                    may = may.min(base + end);
                }
                turns.borrow_mut().began(may);
                waits
                    .borrow_mut()
                    .push((at, may.saturating_duration_since(now)));
                may
            }))
        };
        let group = CodedGroup::new(
            llama.config().clone(),
            generator.clone(),
            &cfg.rows,
            t.with_gate(gate),
        )?;
        Ok(Self {
            llama,
            group,
            teacher,
            schedule: Schedule::new(cfg.limit),
            turns,
            holders: SimHolders {
                refuse: BTreeSet::new(),
                handed: 0,
                taken: Vec::new(),
            },
            arrivals: VecDeque::new(),
            serving,
            base,
            log: Vec::new(),
            waits,
        })
    }

    /// The holders refuse the updates at these places (0: the first handed out).
    pub fn refusing(mut self, places: &[usize]) -> Self {
        self.holders.refuse = places.iter().copied().collect();
        self
    }

    /// A finished request with `text` arrives at virtual time `at` (in order of `at`).
    pub fn arrives(mut self, at: Duration, text: Vec<u32>) -> Self {
        self.arrivals.push_back((at, SimLesson(text)));
        self
    }

    /// Virtual time so far.
    pub fn elapsed(&self) -> Duration {
        self.group.transport().elapsed()
    }

    /// The updates the holders took, in order.
    pub fn published(&self) -> &[Published] {
        &self.holders.taken
    }

    /// The longest round of its group so far.
    pub fn longest_round(&self) -> Duration {
        let log = self.group.transport().log();
        log.iter().map(|r| r.took).max().unwrap_or_default()
    }

    /// Updates handed to the holders, taken or not.
    pub fn handed(&self) -> usize {
        self.holders.handed
    }

    fn note(&mut self, step: TrainerStep) {
        let at = self.elapsed();
        self.log.push((at, step));
    }

    /// Runs the trainer until every request arrived, nothing waits and virtual time reached
    /// `until`; the error of a training pass that failed.
    pub fn run(&mut self, until: Duration) -> Result<(), ModelError> {
        loop {
            let at = self.elapsed();
            while self.arrivals.front().is_some_and(|(when, _)| *when <= at) {
                if let Some((_, r)) = self.arrivals.pop_front() {
                    self.schedule.arrived(r);
                }
            }
            let serving = serving_until(&self.serving, at);
            let now = self.base + at;
            match self.schedule.poll(now, serving.is_some()) {
                Due::Train(minibatch) => self.train(minibatch)?,
                Due::Flush => {
                    self.note(TrainerStep::Flushed);
                    if let Some(p) = self.teacher.flush().map_err(model_error)? {
                        self.settle(p);
                    }
                }
                Due::Wait(t) => {
                    // As the engine's trainer: until then, or a request, or serving going quiet.
                    let mut next = t.saturating_duration_since(self.base);
                    next = next.min(self.arrivals.front().map_or(next, |(when, _)| *when));
                    next = next.min(serving.unwrap_or(next));
                    if self.arrivals.is_empty() && self.schedule.waiting() == 0 && next >= until {
                        return Ok(());
                    }
                    let t = self.base + next;
                    self.group.transport_mut().wait_until(t);
                    continue;
                }
            }
            // As the engine's trainer: it worked, and rests its turns.
            self.turns.borrow_mut().rest();
        }
    }

    /// One minibatch: its gradients through the group, folded into the learner, and the
    /// update that makes settled.
    fn train(&mut self, minibatch: Minibatch<SimLesson>) -> Result<(), ModelError> {
        let began = self.elapsed();
        let seqs: Vec<&[u32]> = minibatch.seqs.iter().map(Vec::as_slice).collect();
        let mut grads =
            futures::executor::block_on(self.llama.gradients_batch(&mut self.group, &seqs))?;
        grads.sequences = minibatch.requests.len();
        self.note(TrainerStep::Trained {
            began,
            requests: minibatch.requests.len(),
            texts: seqs.len(),
        });
        if let Some(p) = self.teacher.fold(grads).map_err(model_error)? {
            self.settle(p);
        }
        Ok(())
    }

    /// Settles an update as every leader does: the gate on the group, then the holders.
    fn settle(&mut self, p: Published) {
        let settled = futures::executor::block_on(settle(
            &mut self.teacher,
            self.llama,
            &mut self.group,
            VERSION,
            p,
            &mut self.holders,
        ));
        let step = match settled {
            Settled::Published { requests, .. } => TrainerStep::Published(requests),
            Settled::Refused(..) => TrainerStep::Refused,
            Settled::Lost(why) => TrainerStep::Lost(why),
            Settled::Unjudged(why) => TrainerStep::Unjudged(why),
        };
        self.note(step);
    }
}

/// A learner's error as the generation loop's.
fn model_error(e: node_core::learn::UpdateError) -> ModelError {
    ModelError::Config(e.to_string())
}
