//! The leader as one state machine with no I/O: the rules of its group ([`Steer`]: forming,
//! backing off, looking for a row that came back, each pass's route) and its batch of
//! sequences ([`Batch`]: admission, planning a pass where the keys and values live, taking its
//! logits, giving up after a run of failures), driven with the time. Every leader's shell (the
//! API's serving and training tasks, the command line's leader and its hop groups, the page's
//! prompt box, the in-process loop and the simulation) embeds one, reports what its networking
//! did through [`LeadShell`], and runs the one loop over it: [`step`] (made ready by [`ready`]).
//! Inputs are the shell's reports with `now`; outputs are [`Action`]s and the next timeout.

use web_time::{Duration, Instant};

use super::choose::PassRows;
use super::route::PassRoute;
use super::steer::{Action, Looking, Route, Steer};
use crate::model::{
    AfterFailure, Batch, BatchLimits, Entry, GenerateOptions, LlamaConfig, ModelError,
    TokenLogprob, Took,
};

/// What a failed pass met, as the shell saw it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Failure {
    /// Its members were at another version (the mesh took an update): the next group is
    /// formed after [`super::steer::MOVED_WAIT`].
    pub moved: bool,
    /// It went one hop per stage: an automatic route keeps to rounds for a while.
    pub hop: bool,
}

/// What a pass's rounds measured, as the shell's group counted them since the last report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Measured {
    /// Rounds run.
    pub rounds: u64,
    /// Time the leader waited on them.
    pub waited: Duration,
    /// The members' compute, counted since the group formed.
    pub computed: Duration,
    /// Answers disagreed with the code and no member could be told wrong.
    pub unlocated: bool,
}

/// A leader's group rules and batch, as one state machine driven with the time (`J`: the
/// caller's request of each sequence).
#[derive(Debug)]
pub struct Leader<J> {
    steer: Steer,
    batch: Batch<J>,
    /// Answers checked beyond the k decoded, before any added after an unlocated wrong answer.
    checks: usize,
    /// Where the batch's keys and values live (a new hop group is another place).
    epoch: u64,
    /// When the pass under way began, its route and its rows.
    began: Option<(Instant, Route, usize)>,
}

impl<J> Leader<J> {
    /// A leader of a model of `model` whose batch keeps to `limits`, forming groups of `k`
    /// decoding members, `checks` checked ones and `spares`; it holds no group yet and its
    /// passes go over rounds.
    pub fn new(
        model: &LlamaConfig,
        limits: BatchLimits,
        k: usize,
        checks: usize,
        spares: usize,
    ) -> Self {
        Self {
            steer: Steer::new(k + checks + spares),
            batch: Batch::new(model, limits),
            checks,
            epoch: 0,
            began: None,
        }
    }

    /// The same leader, its passes travelling as `route` says.
    pub fn with_route(mut self, route: PassRoute) -> Self {
        self.steer.set_route(route);
        self
    }

    /// Its passes travel as `route` says from now on.
    pub fn set_route(&mut self, route: PassRoute) {
        self.steer.set_route(route);
    }

    /// How its passes travel: chosen, or as forced.
    pub fn route(&self) -> PassRoute {
        self.steer.route()
    }

    /// Its sequences.
    pub fn batch(&self) -> &Batch<J> {
        &self.batch
    }

    /// Its sequences, for the shell to run the planned pass on or to take some out.
    pub fn batch_mut(&mut self) -> &mut Batch<J> {
        &mut self.batch
    }

    /// Admits `job`'s `prompt` as a sequence whose keys and values live where the batch's do
    /// ([`Batch::admit`]).
    pub fn admit(
        &mut self,
        job: J,
        prompt: Vec<u32>,
        opts: GenerateOptions,
    ) -> Result<(), (J, ModelError)> {
        self.batch.admit(job, prompt, opts, self.epoch)
    }

    /// What to do at `now` before the next pass, the group holding `rows` now.
    pub fn poll(&mut self, now: Instant, rows: &[usize]) -> Action {
        let next = PassRows {
            stay: self.batch.rows_at(self.epoch),
            all: self.batch.text_rows(),
        };
        self.steer.next_pass(next);
        self.steer.poll(now, rows)
    }

    /// When [`Leader::poll`] next has something new to say although nothing was reported:
    /// the end of a backoff, or of a failure to form that stands as the answer.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.steer.timeout()
    }

    /// Checked answers a group formed at `now` takes beyond the k decoded.
    pub fn checks(&self, now: Instant) -> usize {
        self.steer.checks(now, self.checks)
    }

    /// A group was formed (`far`: a member is on another machine).
    pub fn formed(&mut self, far: bool) {
        self.steer.formed();
        self.steer.set_far(far);
    }

    /// Forming failed at `now` for `why`.
    pub fn form_failed(&mut self, now: Instant, why: String) {
        self.steer.form_failed(now, why);
    }

    /// What looking found at `now`; true when the group is let go to be formed again with it
    /// ([`Steer::looked`]).
    pub fn looked(&mut self, now: Instant, row: Option<usize>) -> bool {
        self.steer.looked(now, row)
    }

    /// The shell let its group go: it is formed again before the next pass.
    pub fn let_go(&mut self) {
        self.steer.let_go();
    }

    /// A hop group could not be formed at `now`: an automatic route keeps to rounds a while,
    /// or until its group is formed again.
    pub fn hop_unformed(&mut self, now: Instant) {
        self.steer.hop_unformed(now);
    }

    /// What the group's rounds measured, reported at `now`.
    pub fn measured(&mut self, now: Instant, m: Measured) {
        self.steer.measured(m.rounds, m.waited, m.computed);
        if m.unlocated {
            self.steer.unlocated(now);
        }
    }

    /// The network time a round of the group, once enough rounds were measured.
    pub fn network_per_round(&self) -> Option<Duration> {
        self.steer.network_per_round()
    }

    /// Failed passes since the last that ran.
    pub fn failures(&self) -> u32 {
        self.steer.failures()
    }

    /// Plans the next pass at `now`, going by `route` with the keys and values at `epoch`;
    /// the rows it runs.
    pub fn plan(&mut self, now: Instant, route: Route, epoch: u64) -> usize {
        self.epoch = epoch;
        let rows = self.batch.plan(epoch);
        self.began = Some((now, route, rows));
        rows
    }

    /// The pass ran, its logits here at `now`: each sequence's tokens go to `on_token` (false
    /// ends it).
    pub fn passed(
        &mut self,
        now: Instant,
        logits: Vec<Vec<f32>>,
        on_token: impl FnMut(&mut J, u32, Option<TokenLogprob>) -> bool,
    ) -> Took<J> {
        self.steer.passed();
        let took = self.began.take().map(|(at, route, rows)| {
            let took = now.saturating_duration_since(at);
            self.steer.ran_pass(route, rows, took);
            took
        });
        let seconds = took.unwrap_or_default().as_secs_f64();
        self.batch.take_scored(logits, seconds, on_token)
    }

    /// A pass that took no sequence's logits (a trainer's backward pass) ran: a run of failures
    /// ends.
    pub fn ran(&mut self) {
        self.steer.passed();
    }

    /// The pass failed at `now`, having met `failure`: the group goes and is formed again
    /// after the run's backoff, or the batch's sequences give up.
    pub fn failed(&mut self, now: Instant, failure: Failure) -> AfterFailure<J> {
        self.began = None;
        if failure.hop {
            self.steer.hop_failed(now);
        }
        self.steer.pass_failed(now, failure.moved);
        self.batch.failed()
    }
}

/// A leader's shell as [`step`] and [`ready`] drive it: its clock, its group, forming,
/// looking and running passes over its own networking, and the [`Leader`] it embeds.
#[allow(
    async_fn_in_trait,
    reason = "the browser leader's futures are !Send by nature; native callers name the concrete type"
)]
pub trait LeadShell<J> {
    /// Its state machine.
    fn leader(&mut self) -> &mut Leader<J>;
    /// The time now: the clock's, by default (a simulation's is virtual).
    fn now(&mut self) -> Instant {
        Instant::now()
    }
    /// Its group's rows now (none without a group).
    fn rows(&self) -> Vec<usize>;
    /// Waits until `until`.
    async fn wait_until(&mut self, until: Instant);
    /// Forms a group with `checks` checked answers beyond k, letting go of the one it holds:
    /// whether a member is on another machine, or why no group could be formed.
    async fn form(&mut self, checks: usize) -> Result<bool, String>;
    /// The row a group short of members could take again, as `looking` says (for example
    /// [`Looking::in_view`] over its view of the mesh).
    async fn look(&mut self, looking: &Looking) -> Option<usize>;
    /// The leader let the group go for `row`, which came back: the shell lets it go too.
    fn regroup(&mut self, row: usize, looking: &Looking);
    /// Makes the group ready for a pass travelling by `route`: where the batch's keys and
    /// values then live, or why a hop group could not be formed (the pass then goes over
    /// rounds). A shell with rounds only takes every pass over them.
    async fn route(&mut self, route: Route) -> Result<u64, String> {
        let _ = route;
        Ok(0)
    }
    /// Runs the planned pass of its leader's batch: the logits of its sequences, in order.
    async fn pass(&mut self) -> Result<Vec<Vec<f32>>, ModelError>;
    /// What its group's rounds measured since it last said, if it counts them.
    fn measured(&mut self) -> Option<Measured> {
        None
    }
    /// The last pass failed with `why`: what it met, or `None` to fail for good (a group that
    /// cannot be formed again).
    fn failed(&mut self, why: &ModelError) -> Option<Failure>;
}

/// Does what the shell's [`Leader`] says until a pass may run: forms the group (again), backs
/// off after failed passes, and lets a group short of members go when a row comes back; the
/// pass's route, or why not when no group can be formed now.
pub async fn ready<J, S: LeadShell<J>>(shell: &mut S) -> Result<Route, String> {
    loop {
        let now = shell.now();
        let rows = shell.rows();
        match shell.leader().poll(now, &rows) {
            Action::Pass(route) => return Ok(route),
            Action::Wait(until) => shell.wait_until(until).await,
            Action::Unavailable { why, .. } => return Err(why),
            Action::Look(looking) => {
                let row = shell.look(&looking).await;
                if shell.leader().looked(now, row)
                    && let Some(row) = row
                {
                    shell.regroup(row, &looking);
                }
            }
            Action::Form => {
                let checks = shell.leader().checks(now);
                match shell.form(checks).await {
                    Ok(far) => shell.leader().formed(far),
                    Err(why) => shell.leader().form_failed(now, why),
                }
            }
        }
    }
}

/// What one [`step`] did to the batch.
#[derive(Debug)]
pub enum Stepped<J> {
    /// The pass ran: what its logits did.
    Took(Took<J>),
    /// It failed and the group is formed again for the next step.
    Failed(ModelError),
    /// It failed [`crate::model::MAX_PASS_FAILURES`] times in a row: these sequences left
    /// the batch, failed.
    GaveUp(Vec<Entry<J>>, ModelError),
}

/// One step of the loop every leader runs, the API's batch of many and the one-sequence
/// generation alike: the group made ready ([`ready`]) and routed, the batch's pass planned
/// where its keys and values live and run, then its logits taken (`on_token` sees each
/// sequence's tokens and returns false to end it) or the failure handed to the leader. An
/// error when no group can be formed, or a failed pass is final.
pub async fn step<J, S: LeadShell<J>>(
    shell: &mut S,
    mut on_token: impl FnMut(&mut J, u32) -> bool,
) -> Result<Stepped<J>, ModelError> {
    step_scored(shell, |j, t, _| on_token(j, t)).await
}

/// [`step`], each token with its log-probability where its sequence asked for them
/// ([`crate::model::Sequence::want_logprobs`]).
pub async fn step_scored<J, S: LeadShell<J>>(
    shell: &mut S,
    on_token: impl FnMut(&mut J, u32, Option<TokenLogprob>) -> bool,
) -> Result<Stepped<J>, ModelError> {
    let route = ready(shell).await.map_err(ModelError::NoGroup)?;
    let (route, epoch) = match shell.route(route).await {
        Ok(epoch) => (route, epoch),
        Err(why) => {
            tracing::warn!("rounds, not hops: {why}");
            let now = shell.now();
            shell.leader().hop_unformed(now);
            let rounds = shell.route(Route::Rounds).await;
            (Route::Rounds, rounds.map_err(ModelError::NoGroup)?)
        }
    };
    let now = shell.now();
    shell.leader().plan(now, route, epoch);
    let result = shell.pass().await;
    let now = shell.now();
    if let Some(m) = shell.measured() {
        shell.leader().measured(now, m);
    }
    match result {
        Ok(logits) => Ok(Stepped::Took(shell.leader().passed(now, logits, on_token))),
        Err(e) => {
            let Some(failure) = shell.failed(&e) else {
                return Err(e);
            };
            Ok(match shell.leader().failed(now, failure) {
                AfterFailure::Regroup => Stepped::Failed(e),
                AfterFailure::GiveUp(gone) => Stepped::GaveUp(gone, e),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lead::steer::{FORM_RETRY, MOVED_WAIT};
    use crate::model::{Ended, SamplingParams};

    /// A shell whose forming, routing and passes answer as told, and which logs what the loop
    /// had it do, in virtual time.
    struct Shell {
        leader: Leader<u32>,
        at: Instant,
        rows: Vec<usize>,
        forms: Vec<Result<bool, String>>,
        found: Option<usize>,
        /// Whether a hop group forms.
        hops: bool,
        passes: Vec<Result<u32, Failure>>,
        log: Vec<String>,
    }

    impl Shell {
        fn new(forms: Vec<Result<bool, String>>) -> Self {
            let cfg = LlamaConfig::small();
            let limits = BatchLimits {
                max_batch: 4,
                step_tokens: 64,
            };
            Self {
                leader: Leader::new(&cfg, limits, 2, 1, 0),
                at: Instant::now(),
                rows: Vec::new(),
                forms,
                found: None,
                hops: true,
                passes: Vec::new(),
                log: Vec::new(),
            }
        }

        fn go(&mut self) -> Result<Route, String> {
            futures::executor::block_on(ready(self))
        }

        fn step(&mut self) -> Result<Stepped<u32>, ModelError> {
            futures::executor::block_on(step(self, |job, t| {
                *job = t;
                true
            }))
        }
    }

    impl LeadShell<u32> for Shell {
        fn leader(&mut self) -> &mut Leader<u32> {
            &mut self.leader
        }

        fn now(&mut self) -> Instant {
            self.at
        }

        fn rows(&self) -> Vec<usize> {
            self.rows.clone()
        }

        async fn wait_until(&mut self, until: Instant) {
            self.log
                .push(format!("wait {}", (until - self.at).as_millis()));
            self.at = until;
        }

        async fn form(&mut self, checks: usize) -> Result<bool, String> {
            self.log.push(format!("form +{checks}"));
            self.rows.clear();
            let far = self.forms.remove(0)?;
            self.rows = vec![0, 1, 2];
            Ok(far)
        }

        async fn look(&mut self, looking: &Looking) -> Option<usize> {
            self.log.push(format!("look {:?}", looking.rows));
            self.found
        }

        fn regroup(&mut self, row: usize, _: &Looking) {
            self.log.push(format!("regroup {row}"));
            self.rows.clear();
        }

        async fn route(&mut self, route: Route) -> Result<u64, String> {
            self.log.push(format!("{route:?}"));
            match route {
                Route::Hop if !self.hops => Err("a member does not answer".into()),
                Route::Hop => Ok(1),
                Route::Rounds => Ok(0),
            }
        }

        async fn pass(&mut self) -> Result<Vec<Vec<f32>>, ModelError> {
            let cfg = LlamaConfig::small();
            let next = self
                .passes
                .remove(0)
                .map_err(|f| ModelError::NoGroup(format!("moved {} hop {}", f.moved, f.hop)))?;
            let mut logits = vec![0.0f32; cfg.vocab];
            logits[next as usize] = 1.0;
            Ok(vec![logits; self.leader.batch().len()])
        }

        fn measured(&mut self) -> Option<Measured> {
            Some(Measured {
                rounds: 10,
                ..Measured::default()
            })
        }

        fn failed(&mut self, why: &ModelError) -> Option<Failure> {
            let why = why.to_string();
            Some(Failure {
                moved: why.contains("moved true"),
                hop: why.contains("hop true"),
            })
        }
    }

    fn opts(max_tokens: usize) -> GenerateOptions {
        GenerateOptions {
            max_tokens,
            sampling: SamplingParams::default(),
            stop_ids: vec![],
            draft: 0,
        }
    }

    #[test]
    fn one_loop_drives_a_shell_through_forming_failing_looking_and_regrouping() {
        let mut shell = Shell::new(vec![
            Err("two rows".into()),
            Ok(false),
            Ok(false),
            Ok(false),
            Ok(false),
        ]);
        shell.found = Some(2);
        assert_eq!(shell.go(), Err("two rows".to_string()));
        assert_eq!(shell.leader.poll_timeout(), Some(shell.at + FORM_RETRY));
        assert_eq!(shell.go(), Err("two rows".to_string()), "within FORM_RETRY");
        shell.at += FORM_RETRY;
        assert_eq!(shell.go(), Ok(Route::Rounds));
        assert_eq!(shell.log, ["form +1", "form +1"]);
        // A member goes and a row comes back: the group is formed again with it.
        shell.log.clear();
        shell.rows = vec![0, 1];
        assert_eq!(shell.go(), Ok(Route::Rounds));
        assert_eq!(shell.log, ["look [0, 1]", "regroup 2", "form +1"]);
        assert_eq!(shell.rows, [0, 1, 2]);
        // Two failed passes: formed at once, then after the backoff.
        shell.log.clear();
        let at = shell.at;
        let _ = shell.leader.failed(at, Failure::default());
        assert_eq!(shell.go(), Ok(Route::Rounds));
        let _ = shell.leader.failed(at, Failure::default());
        assert_eq!(shell.go(), Ok(Route::Rounds));
        assert_eq!(shell.log, ["form +1", "wait 250", "form +1"]);
    }

    #[test]
    fn a_step_passes_or_hands_its_failure_to_the_rules_and_a_run_of_them_gives_up() {
        let mut shell = Shell::new(vec![Ok(false); 8]);
        shell.leader.admit(0, vec![1, 2, 3], opts(8)).unwrap();
        shell.passes = vec![
            Ok(7),
            Err(Failure {
                moved: true,
                hop: false,
            }),
            Ok(9),
            Err(Failure::default()),
            Err(Failure::default()),
            Err(Failure::default()),
        ];
        let Ok(Stepped::Took(took)) = shell.step() else {
            panic!("the first pass runs")
        };
        assert!(took.ended.is_empty());
        assert_eq!(shell.leader.batch().entries()[0].job, 7, "its token came");
        assert!(matches!(shell.step(), Ok(Stepped::Failed(_))));
        assert_eq!(
            shell.leader.poll_timeout(),
            Some(shell.at + MOVED_WAIT),
            "the mesh moved: the next group waits for its holders"
        );
        assert!(matches!(shell.step(), Ok(Stepped::Took(_))));
        assert_eq!(shell.leader.batch().entries()[0].job, 9);
        assert!(matches!(shell.step(), Ok(Stepped::Failed(_))));
        assert!(matches!(shell.step(), Ok(Stepped::Failed(_))));
        let Ok(Stepped::GaveUp(gone, _)) = shell.step() else {
            panic!("three failed passes in a row give up")
        };
        assert_eq!(gone.len(), 1);
        assert!(shell.leader.batch().is_empty());
        assert_eq!(
            shell.log,
            [
                "form +1", "Rounds", "Rounds", "wait 300", "form +1", "Rounds", "Rounds",
                "form +1", "Rounds", "wait 250", "form +1", "Rounds"
            ]
        );
    }

    #[test]
    fn a_hop_group_that_cannot_form_sends_the_pass_over_rounds_and_restarts_nothing_twice() {
        let mut shell = Shell::new(vec![Ok(true); 4]);
        shell.leader = std::mem::replace(
            &mut shell.leader,
            Leader::new(&LlamaConfig::small(), one(), 2, 1, 0),
        )
        .with_route(PassRoute::Auto);
        shell.leader.admit(0, vec![1, 2, 3], opts(2)).unwrap();
        shell.hops = false;
        shell.passes = vec![Ok(5)];
        let Ok(Stepped::Took(took)) = shell.step() else {
            panic!("the pass runs over rounds")
        };
        assert!(took.ended.is_empty());
        assert_eq!(shell.log, ["form +1", "Hop", "Rounds"]);
        // An automatic route keeps to rounds after the hop group failed.
        shell.log.clear();
        shell.hops = true;
        shell.passes = vec![Ok(6)];
        let Ok(Stepped::Took(took)) = shell.step() else {
            panic!("the pass runs")
        };
        assert!(matches!(&took.ended[..], [Ended::Finished(e, _)] if e.job == 6));
        assert_eq!(shell.log, ["Rounds"]);
    }

    fn one() -> BatchLimits {
        BatchLimits {
            max_batch: 1,
            step_tokens: 64,
        }
    }
}
