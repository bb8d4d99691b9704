//! A leader's rounds over its members, written once for every network transport (the native
//! node's sessions, the page's requests): the shell sends asks and hands back answers
//! ([`Asks`]); [`Rounds`] decides who is asked, which answers count, who is replaced and when
//! a straggler is outrun ([`RoundDriver`]).

use std::collections::{BTreeMap, VecDeque};

use web_time::{Duration, Instant};

use super::{MemberPool, RoundConfig, RoundDriver, StepRefusal};
use crate::code::Generator;
use crate::coded::{Transport, TransportError};

/// One member's answer: the round it answers, the member's row, and the encoded answer with
/// the member's compute time (µs), or why there is none.
pub type MemberAnswer = (u64, usize, Result<(Vec<u8>, u64), StepRefusal>);

/// What a shell does for a leader's rounds: sending asks and bringing their answers back.
#[allow(
    async_fn_in_trait,
    reason = "the page's futures are !Send by nature; native callers name the concrete type"
)]
pub trait Asks {
    /// The version the members are asked at.
    fn version(&self) -> [u8; 32];

    /// Sends each `(row, request)` as an ask of round `round`; every ask's answer, or why it
    /// has none, comes from [`Asks::next`].
    fn ask(&mut self, round: u64, asks: &[(usize, &[u8])]);

    /// The next answer to any ask, earlier rounds' included; `None` once `until` passed
    /// before one came.
    async fn next(&mut self, until: Instant) -> Option<MemberAnswer>;

    /// An answer that already came, if any (no waiting, no timer).
    fn try_next(&mut self) -> Option<MemberAnswer>;

    /// Sees each answer of the current round as it comes: its size and the member's compute
    /// time, or why there is none (the native step trace). Nothing by default.
    fn seen(&mut self, _row: usize, _answer: Result<(usize, u64), &str>) {}

    /// The round is over; members still unanswered were not needed. Nothing by default.
    fn ended(&mut self) {}
}

/// What a round saw beside its answers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RoundNotes {
    /// The slowest answer used, as its member's compute time in µs.
    pub slowest_compute_us: u64,
    /// Whether a member refused for being at another version than the one asked: the mesh
    /// moved on (or the member lags), and forming the group again may help.
    pub stale: bool,
}

/// A leader's rounds over a shell's [`Asks`]: the rows it may ask (the group's and the free
/// ones), the rounds so far, and what the last one saw.
#[derive(Debug)]
pub struct Rounds<A> {
    /// The shell's asks.
    pub asks: A,
    pool: MemberPool,
    round: u64,
    notes: RoundNotes,
    late: Late,
}

/// Answers that came after their round was decided, `(round, row, bytes)`, oldest first.
type Late = VecDeque<(u64, usize, Vec<u8>)>;

/// Late answers kept for the group to check; the oldest go beyond.
const MAX_LATE: usize = 64;

/// Keeps a late answer for [`Transport::late_answers`], dropping the oldest beyond
/// [`MAX_LATE`].
fn keep_late(late: &mut Late, round: u64, row: usize, bytes: Vec<u8>) {
    if late.len() == MAX_LATE {
        late.pop_front();
    }
    late.push_back((round, row, bytes));
}

impl<A: Asks> Rounds<A> {
    /// Rounds over `asks` for a group of `members`; the other `rows` are free to replace them.
    pub fn new(
        asks: A,
        generator: Generator,
        rows: impl IntoIterator<Item = usize>,
        members: &[usize],
        cfg: RoundConfig,
    ) -> Self {
        let free = rows.into_iter().filter(|r| !members.contains(r)).collect();
        Self {
            asks,
            pool: MemberPool::new(generator, free, cfg),
            round: 0,
            notes: RoundNotes::default(),
            late: Late::new(),
        }
    }

    /// What the last round saw beside its answers.
    pub fn notes(&self) -> &RoundNotes {
        &self.notes
    }

    /// Starts the next round: its notes cleared and the late answers read in; its number and
    /// the version it asks at.
    fn begin(&mut self) -> (u64, [u8; 32]) {
        self.round += 1;
        self.notes = RoundNotes::default();
        self.drain_late();
        (self.round, self.asks.version())
    }

    /// Answers to earlier rounds that came since: who is slow but alive, and who failed; the
    /// answers themselves are kept for the group to check.
    fn drain_late(&mut self) {
        while let Some((round, row, answer)) = self.asks.try_next() {
            self.note_late(round, row, answer);
        }
    }

    /// An answer to an earlier round, already decided: the member is alive (its answer kept),
    /// or not.
    fn note_late(&mut self, round: u64, row: usize, answer: Result<(Vec<u8>, u64), StepRefusal>) {
        match answer {
            Ok((bytes, _)) => {
                self.pool.note_answer(row);
                keep_late(&mut self.late, round, row, bytes);
            }
            Err(_) => self.pool.note_failure(row),
        }
    }

    /// The next round of `request` over `members`: the answers of at least `need` of them, first
    /// come first served. A failed member is dropped from `members` and a free row of the pool
    /// asked instead; a straggler is outrun.
    async fn run_round(
        &mut self,
        members: &mut Vec<usize>,
        request: &[u8],
        need: usize,
    ) -> Result<Vec<(usize, Vec<u8>)>, TransportError> {
        let (round, version) = self.begin();
        let mut driver = RoundDriver::start(Instant::now(), members, need, &mut self.pool);
        let mut compute: BTreeMap<usize, u64> = BTreeMap::new();
        loop {
            let mut due = Vec::new();
            while let Some(row) = driver.poll_transmit() {
                due.push((row, request));
            }
            if !due.is_empty() {
                self.asks.ask(round, &due);
            }
            if driver.is_done() || driver.is_failed() {
                break;
            }
            let until = driver
                .poll_timeout()
                .unwrap_or_else(|| Instant::now() + Duration::from_secs(1));
            match self.asks.next(until).await {
                Some((r, row, answer)) if r == round => {
                    let answer =
                        answer.map_err(|refusal| refused(&refusal, &version, &mut self.notes));
                    self.asks.seen(
                        row,
                        answer
                            .as_ref()
                            .map(|(b, us)| (b.len(), *us))
                            .map_err(String::as_str),
                    );
                    let answer = answer.map(|(bytes, us)| {
                        compute.insert(row, us);
                        bytes
                    });
                    driver.handle_answer(Instant::now(), row, answer, &mut self.pool);
                }
                Some((r, row, answer)) => self.note_late(r, row, answer),
                None => driver.handle_timeout(Instant::now(), &mut self.pool),
            }
        }
        self.asks.ended();
        *members = driver.members().to_vec();
        let answers = driver.finish(&mut self.pool).map_err(|e| TransportError {
            node: usize::MAX,
            reason: e.to_string(),
        })?;
        self.notes.slowest_compute_us = answers
            .iter()
            .filter_map(|(r, _)| compute.get(r))
            .max()
            .copied()
            .unwrap_or(0);
        Ok(answers)
    }

    /// The next round of backward steps: each member its own request, and every answer needed
    /// within [`RoundConfig::member_timeout`]; the first failure ends it.
    async fn run_round_each(
        &mut self,
        requests: &[(usize, Vec<u8>)],
    ) -> Result<Vec<(usize, Vec<u8>)>, TransportError> {
        let (round, version) = self.begin();
        let due: Vec<(usize, &[u8])> = requests.iter().map(|(r, q)| (*r, q.as_slice())).collect();
        self.asks.ask(round, &due);
        let deadline = Instant::now() + RoundConfig::default().member_timeout;
        let mut answers: Vec<(usize, Vec<u8>)> = Vec::with_capacity(requests.len());
        let result = loop {
            if answers.len() == requests.len() {
                break Ok(answers);
            }
            match self.asks.next(deadline).await {
                Some((r, row, answer)) if r == round => match answer {
                    Ok((bytes, us)) => {
                        self.asks.seen(row, Ok((bytes.len(), us)));
                        self.notes.slowest_compute_us = self.notes.slowest_compute_us.max(us);
                        answers.push((row, bytes));
                    }
                    Err(refusal) => {
                        let reason = refused(&refusal, &version, &mut self.notes);
                        self.asks.seen(row, Err(&reason));
                        self.pool.note_failure(row);
                        break Err(TransportError { node: row, reason });
                    }
                },
                Some((r, row, answer)) => self.note_late(r, row, answer),
                None => {
                    let missing = requests
                        .iter()
                        .map(|(r, _)| *r)
                        .find(|r| answers.iter().all(|(a, _)| a != r))
                        .unwrap_or(usize::MAX);
                    break Err(TransportError {
                        node: missing,
                        reason: "timed out".into(),
                    });
                }
            }
        };
        self.asks.ended();
        result
    }
}

impl<A: Asks> Transport for Rounds<A> {
    async fn round(
        &mut self,
        members: &mut Vec<usize>,
        request: &[u8],
        need: usize,
    ) -> Result<Vec<(usize, Vec<u8>)>, TransportError> {
        self.run_round(members, request, need).await
    }

    async fn round_each(
        &mut self,
        requests: Vec<(usize, Vec<u8>)>,
    ) -> Result<Vec<(usize, Vec<u8>)>, TransportError> {
        self.run_round_each(&requests).await
    }

    fn last_round(&self) -> Option<u64> {
        Some(self.round)
    }

    fn late_answers(&mut self) -> Vec<(u64, usize, Vec<u8>)> {
        self.drain_late();
        self.late.drain(..).collect()
    }

    fn asks_alone(&self) -> bool {
        true
    }
}

/// Why a member gave no answer, in words; notes a refusal at another version than `version`.
fn refused(refusal: &StepRefusal, version: &[u8; 32], notes: &mut RoundNotes) -> String {
    if matches!(refusal, StepRefusal::Stale { want, .. } if want == version) {
        notes.stale = true;
    }
    refusal.to_string()
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;

    use futures::executor::block_on;

    use super::*;
    use crate::code::Generator;

    /// Members in memory: each row answers at once with its row number and the request's
    /// first byte, or refuses at another version, or never answers.
    #[derive(Default)]
    struct Scripted {
        /// The version asked at.
        version: [u8; 32],
        /// Row → what it does.
        plan: BTreeMap<usize, Plan>,
        /// Answers due, in the order they come.
        due: VecDeque<MemberAnswer>,
        asked: Vec<(u64, usize)>,
        seen: Vec<usize>,
    }

    #[derive(Clone, Copy)]
    enum Plan {
        Answer,
        Stale,
        Silent,
    }

    impl Scripted {
        /// Members asked at `version`, each row doing what `plan` says (else answering).
        fn at(version: u8, plan: &[(usize, Plan)]) -> Self {
            Self {
                version: [version; 32],
                plan: plan.iter().copied().collect(),
                ..Self::default()
            }
        }
    }

    impl Asks for Scripted {
        fn version(&self) -> [u8; 32] {
            self.version
        }

        fn ask(&mut self, round: u64, asks: &[(usize, &[u8])]) {
            for &(row, request) in asks {
                self.asked.push((round, row));
                let answer = match self.plan.get(&row).copied().unwrap_or(Plan::Answer) {
                    Plan::Answer => Ok((vec![row as u8, request[0]], 5 * row as u64)),
                    Plan::Stale => Err(StepRefusal::Stale {
                        have: [2; 32],
                        updates: 2,
                        want: [1; 32],
                    }),
                    Plan::Silent => continue,
                };
                self.due.push_back((round, row, answer));
            }
        }

        async fn next(&mut self, _until: Instant) -> Option<MemberAnswer> {
            self.due.pop_front()
        }

        fn try_next(&mut self) -> Option<MemberAnswer> {
            self.due.pop_front()
        }

        fn seen(&mut self, row: usize, _answer: Result<(usize, u64), &str>) {
            self.seen.push(row);
        }
    }

    fn pool(free: Vec<usize>) -> MemberPool {
        let g = Generator::cauchy(5, 3).unwrap();
        MemberPool::new(g, free, RoundConfig::default())
    }

    /// Rounds over `asks` with `free` rows to replace members, the next one numbered `next`.
    fn rounds(asks: Scripted, free: Vec<usize>, next: u64) -> Rounds<Scripted> {
        Rounds {
            asks,
            pool: pool(free),
            round: next - 1,
            notes: RoundNotes::default(),
            late: Late::new(),
        }
    }

    #[test]
    fn a_round_takes_the_first_answers_and_replaces_a_member_at_another_version() {
        let mut r = rounds(Scripted::at(1, &[(1, Plan::Stale)]), vec![3, 4], 7);
        let mut members = vec![0, 1, 2];
        let answers = block_on(r.round(&mut members, &[9], 3)).unwrap();
        let rows: Vec<usize> = answers.iter().map(|(r, _)| *r).collect();
        assert_eq!(rows.len(), 3);
        assert!(
            !rows.contains(&1),
            "the stale member's refusal is no answer"
        );
        assert!(!members.contains(&1), "and it left the group: {members:?}");
        assert!(answers.iter().all(|(r, b)| b == &vec![*r as u8, 9]));
        assert!(r.notes.stale, "a refusal at the version asked is noted");
        assert_eq!(
            r.notes.slowest_compute_us,
            rows.iter().map(|&r| 5 * r as u64).max().unwrap()
        );
        assert!(r.asks.asked.iter().all(|&(round, _)| round == 7));
        assert_eq!(r.last_round(), Some(7));
    }

    #[test]
    fn a_refusal_at_another_version_than_asked_is_not_noted_as_the_mesh_moving() {
        let mut r = rounds(Scripted::at(5, &[(0, Plan::Stale)]), vec![3], 1);
        block_on(r.round(&mut vec![0, 1, 2], &[0], 3)).unwrap();
        assert!(!r.notes.stale);
    }

    #[test]
    fn answers_that_come_after_their_round_are_kept_for_the_group_to_check() {
        // Four asked, three needed: the fourth answer comes once the round is decided.
        let mut r = rounds(Scripted::at(1, &[]), vec![], 1);
        let answers = block_on(r.round(&mut vec![0, 1, 2, 3], &[4], 3)).unwrap();
        assert_eq!(answers.len(), 3);
        let late: Vec<usize> = (0..4)
            .filter(|row| answers.iter().all(|(a, _)| a != row))
            .collect();
        // It is read with the next round, and handed over with its round's number.
        block_on(r.round(&mut vec![0, 1, 2], &[5], 3)).unwrap();
        assert_eq!(r.late_answers(), vec![(1, late[0], vec![late[0] as u8, 4])]);
        assert!(r.late_answers().is_empty(), "taken out once");
        for round in 0..MAX_LATE as u64 + 5 {
            keep_late(&mut r.late, round, 0, vec![]);
        }
        let kept = r.late_answers();
        assert_eq!(kept.len(), MAX_LATE, "the oldest go beyond {MAX_LATE}");
        assert_eq!(kept[0].0, 5);
    }

    #[test]
    fn backward_steps_need_every_answer_and_name_the_member_that_gave_none() {
        let requests = vec![(0, vec![1]), (2, vec![3])];
        let mut r = rounds(Scripted::at(1, &[]), vec![], 3);
        let answers = block_on(r.round_each(requests.clone())).unwrap();
        assert_eq!(answers, vec![(0, vec![0, 1]), (2, vec![2, 3])]);
        assert_eq!(r.asks.seen, vec![0, 2]);

        let mut r = rounds(Scripted::at(1, &[(2, Plan::Silent)]), vec![], 4);
        let err = block_on(r.round_each(requests.clone())).unwrap_err();
        assert_eq!((err.node, err.reason.as_str()), (2, "timed out"));

        let mut r = rounds(Scripted::at(1, &[(0, Plan::Stale)]), vec![], 5);
        let err = block_on(r.round_each(requests)).unwrap_err();
        assert_eq!(err.node, 0);
        assert!(
            err.reason.contains("shard version mismatch"),
            "{}",
            err.reason
        );
        assert!(r.notes.stale);
    }
}
