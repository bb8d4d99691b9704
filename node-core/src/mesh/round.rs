//! The leader's side of a group: choosing k + s rows, and one round of a coded step over them
//! (first k answers win; a failed member is replaced; a straggler is outrun by a spare).

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use web_time::{Duration, Instant};

use crate::code::{CodeError, Generator, select_nodes};

/// A chosen group: the k best-conditioned rows first, then the spares.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupPlan {
    /// Rows asked in every round, the decoding k first.
    pub members: Vec<usize>,
    /// Condition number of the first k.
    pub condition_number: f64,
}

/// One holder of each row for a group: the first of the row's holders that `avoid` leaves
/// free (another group computes with the others); rows with no free holder are left out.
pub fn pick_holders<P: Ord + Clone>(
    holders: &std::collections::BTreeMap<usize, Vec<P>>,
    avoid: &std::collections::BTreeSet<P>,
) -> std::collections::BTreeMap<usize, P> {
    holders
        .iter()
        .filter_map(|(&row, peers)| Some((row, peers.iter().find(|p| !avoid.contains(p))?.clone())))
        .collect()
}

/// One holder of each row as [`pick_holders`] picks, the nearest by `rtt_ms` (milliseconds;
/// holders of unknown distance after the known, in their order).
pub fn pick_nearest<P: Ord + Clone>(
    holders: &std::collections::BTreeMap<usize, Vec<P>>,
    avoid: &std::collections::BTreeSet<P>,
    rtt_ms: impl Fn(&P) -> Option<f32>,
) -> std::collections::BTreeMap<usize, P> {
    let far = |p: &P| rtt_ms(p).unwrap_or(f32::INFINITY);
    let mut by_distance = holders.clone();
    for peers in by_distance.values_mut() {
        peers.sort_by(|a, b| far(a).total_cmp(&far(b)));
    }
    pick_holders(&by_distance, avoid)
}

/// Picks k well-conditioned rows of `live` and up to `spares` more.
pub fn plan_group(g: &Generator, live: &[usize], spares: usize) -> Result<GroupPlan, CodeError> {
    let sel = select_nodes(g, live)?;
    let mut members = sel.nodes.clone();
    let mut rest: Vec<usize> = live
        .iter()
        .copied()
        .filter(|r| !members.contains(r))
        .collect();
    rest.sort_unstable();
    rest.dedup();
    // Prefer spares that keep the worst swap well conditioned.
    let score = |r: usize| -> f64 {
        (0..members.len().min(g.k()))
            .map(|drop| {
                let mut trial = sel.nodes.clone();
                trial[drop] = r;
                g.condition_number(&trial).unwrap_or(f64::INFINITY)
            })
            .fold(0.0, f64::max)
    };
    rest.sort_by(|&a, &b| score(a).total_cmp(&score(b)));
    members.extend(rest.into_iter().take(spares));
    Ok(GroupPlan {
        members,
        condition_number: sel.condition_number,
    })
}

/// Condition number a nearer group may have though a farther one is better conditioned: its
/// decode error stays about `1e-7 · κ` ≤ 1e-5 (every group of a code is within
/// [`crate::code::GROWTH_MAX_CONDITION`] anyway), while a far member costs every round a long
/// round trip.
pub const NEAR_MAX_CONDITION: f64 = 100.0;

/// Picks a group as [`plan_group`] does, from the nearest rows that make one: rows sorted by
/// `rtt_ms` (the leader's round trip to the holder it would ask; unknown last), the decoding k
/// from the fewest nearest rows (and every row within [`NEAR_ALIKE_MS`] of the farthest of
/// them) that hold k conditioned within [`NEAR_MAX_CONDITION`] (or as well as the best of
/// all), then the nearest others as checks and spares. A round waits for its slowest
/// member, so this keeps the slowest near.
pub fn plan_group_near(
    g: &Generator,
    live: &[usize],
    spares: usize,
    rtt_ms: impl Fn(usize) -> Option<f32>,
) -> Result<GroupPlan, CodeError> {
    let best = plan_group(g, live, spares)?;
    let mut near: Vec<usize> = live.to_vec();
    near.sort_unstable();
    near.dedup();
    if near.iter().all(|&r| rtt_ms(r).is_none()) {
        return Ok(best);
    }
    let far = |r: usize| rtt_ms(r).map_or(f32::INFINITY, |ms| ms.max(0.0));
    near.sort_by(|&a, &b| far(a).total_cmp(&far(b)));
    let bound = NEAR_MAX_CONDITION.max(best.condition_number);
    for m in g.k()..=near.len() {
        let reach = far(near[m - 1]) + NEAR_ALIKE_MS;
        let m = m + near[m..].iter().take_while(|&&r| far(r) <= reach).count();
        // Checks and spares: the near rows' best (as `plan_group` ranks them), then the nearest.
        let mut plan = plan_group(g, &near[..m], spares)?;
        if plan.condition_number <= bound {
            let more = spares.saturating_sub(plan.members.len() - g.k());
            let rest: Vec<usize> = near[m..].iter().copied().take(more).collect();
            plan.members.extend(rest);
            return Ok(plan);
        }
    }
    Ok(best)
}

/// Round trips within this many milliseconds of each other are alike: among them a group is
/// chosen by conditioning alone (on one machine or one LAN, the best-conditioned rows, as
/// without distances).
pub const NEAR_ALIKE_MS: f32 = 2.0;

/// How much nearer a fresh group's slowest member must be than the group's own for a leader
/// to form it again (a share of the group's slowest round trip).
pub const MUCH_CLOSER: f64 = 0.5;

/// Least milliseconds a group's slowest round trip must shrink for a leader to form it again:
/// below that, a new group's set-up costs more than it saves.
pub const MUCH_CLOSER_MS: f32 = 5.0;

/// Whether a group whose slowest member is `now_ms` away should be formed again from holders
/// whose slowest would be `fresh_ms` away (both the leader's round trips, milliseconds): a round
/// waits for its slowest member, so a group formed before the mesh's coordinates settled, or
/// before a near holder joined, is formed again once one is much closer.
pub fn much_closer(now_ms: f32, fresh_ms: f32) -> bool {
    fresh_ms.is_finite()
        && f64::from(fresh_ms) < MUCH_CLOSER * f64::from(now_ms)
        && now_ms - fresh_ms >= MUCH_CLOSER_MS
}

/// Timing of rounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoundConfig {
    /// Without k answers by then, one more row is asked (if one is free).
    pub straggler_after: Duration,
    /// A member silent this long in a round is dropped.
    pub member_timeout: Duration,
    /// A member that missed this many finished rounds in a row is swapped for a free row.
    pub max_misses: u32,
}

impl Default for RoundConfig {
    fn default() -> Self {
        Self {
            straggler_after: Duration::from_millis(250),
            member_timeout: Duration::from_secs(5),
            max_misses: 2,
        }
    }
}

/// The rows a leader may use beyond its members, and their record.
#[derive(Debug, Clone)]
pub struct MemberPool {
    generator: Generator,
    free: Vec<usize>,
    misses: BTreeMap<usize, u32>,
    /// Members asked in a finished round that have not answered since.
    /// (with the start of the first round it has been silent since).
    outstanding: BTreeMap<usize, Instant>,
    /// Rows whose requests failed: never asked again.
    down: BTreeSet<usize>,
    cfg: RoundConfig,
}

impl MemberPool {
    /// A pool of `free` rows (live rows that are not members).
    pub fn new(generator: Generator, free: Vec<usize>, cfg: RoundConfig) -> Self {
        Self {
            generator,
            free,
            misses: BTreeMap::new(),
            outstanding: BTreeMap::new(),
            down: BTreeSet::new(),
            cfg,
        }
    }

    /// Rows not in the group.
    pub fn free(&self) -> &[usize] {
        &self.free
    }

    /// A row's request failed outside a round (a late error): it is not asked again.
    pub fn note_failure(&mut self, row: usize) {
        self.down.insert(row);
        self.free.retain(|&r| r != row);
    }

    /// A row answered (in its round or late, to an earlier one): it is not straggling.
    pub fn note_answer(&mut self, row: usize) {
        self.outstanding.remove(&row);
        self.misses.remove(&row);
    }

    /// Takes the free row that conditions best with `with` (the rows that will decode).
    /// A row silent for several straggler periods has stalled: it is taken only when
    /// `allow_stalled` (a member is needed, not merely wanted).
    fn take_replacement(
        &mut self,
        now: Instant,
        with: &[usize],
        allow_stalled: bool,
    ) -> Option<usize> {
        let k = self.generator.k();
        let stalled = self.cfg.straggler_after * 4;
        let free: Vec<usize> = self
            .free
            .iter()
            .copied()
            .filter(|r| {
                allow_stalled
                    || self
                        .outstanding
                        .get(r)
                        .is_none_or(|&since| now.saturating_duration_since(since) < stalled)
            })
            .collect();
        // A row still silent on an earlier request is a later choice, and the one silent the
        // longest (a stalled node, not a slow one) the last.
        let silent_since = |r: &usize| self.outstanding.get(r).copied();
        let latest = self
            .free
            .iter()
            .map(silent_since)
            .min_by(|a, b| match (a, b) {
                (None, _) => std::cmp::Ordering::Less,
                (_, None) => std::cmp::Ordering::Greater,
                (Some(x), Some(y)) => y.cmp(x),
            })?;
        let best = free
            .iter()
            .copied()
            .filter(|r| silent_since(r) == latest)
            .map(|r| {
                let mut trial: Vec<usize> = with.iter().copied().take(k - 1).collect();
                trial.push(r);
                let kappa = if trial.len() == k {
                    self.generator
                        .condition_number(&trial)
                        .unwrap_or(f64::INFINITY)
                } else {
                    0.0
                };
                (r, kappa)
            })
            .min_by(|a, b| a.1.total_cmp(&b.1))?;
        self.free.retain(|&r| r != best.0);
        Some(best.0)
    }
}

/// Why a round could not be completed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error(
    "only {got} of {need} answers: every member failed or timed out and no free row is left ({failures})"
)]
pub struct RoundError {
    /// Answers needed.
    pub need: usize,
    /// Answers got.
    pub got: usize,
    /// What went wrong, per row.
    pub failures: String,
}

/// One round: the request goes to every member; the first `need` answers finish it.
#[derive(Debug)]
pub struct RoundDriver {
    need: usize,
    started: Instant,
    members: Vec<usize>,
    pending: BTreeMap<usize, Instant>,
    answers: Vec<(usize, Vec<u8>)>,
    failures: Vec<(usize, String)>,
    transmits: VecDeque<usize>,
    straggler_asked: bool,
    cfg: RoundConfig,
}

impl RoundDriver {
    /// Starts a round over `members`. A member still silent on an earlier round misses this
    /// one's start; after `max_misses` in a row it is swapped for a free row.
    pub fn start(now: Instant, members: &[usize], need: usize, pool: &mut MemberPool) -> Self {
        let mut members: Vec<usize> = members
            .iter()
            .copied()
            .filter(|r| !pool.down.contains(r))
            .collect();
        for &row in &members {
            if pool.outstanding.contains_key(&row) {
                *pool.misses.entry(row).or_default() += 1;
            }
        }
        for i in 0..members.len() {
            let row = members[i];
            if pool.misses.get(&row).copied().unwrap_or(0) >= pool.cfg.max_misses {
                let keep: Vec<usize> = members.iter().copied().filter(|&r| r != row).collect();
                if let Some(fresh) = pool.take_replacement(now, &keep, false) {
                    tracing::info!(row, fresh, "swapping a straggling member for a free row");
                    pool.misses.remove(&row);
                    pool.free.push(row);
                    members[i] = fresh;
                }
            }
        }
        // Too few members (some failed since the last round): top up from the free rows now.
        while members.len() < need {
            let Some(fresh) = pool.take_replacement(now, &members, true) else {
                break;
            };
            members.push(fresh);
        }
        let transmits = members.iter().copied().collect();
        let pending = members.iter().map(|&r| (r, now)).collect();
        Self {
            need,
            started: now,
            members,
            pending,
            answers: Vec::new(),
            failures: Vec::new(),
            transmits,
            straggler_asked: false,
            cfg: pool.cfg,
        }
    }

    /// The next row to send the request to.
    pub fn poll_transmit(&mut self) -> Option<usize> {
        self.transmits.pop_front()
    }

    /// The members now (failed ones dropped, replacements added).
    pub fn members(&self) -> &[usize] {
        &self.members
    }

    /// Whether `need` answers are in.
    pub fn is_done(&self) -> bool {
        self.answers.len() >= self.need
    }

    /// Whether the round can no longer finish.
    pub fn is_failed(&self) -> bool {
        !self.is_done() && self.pending.is_empty() && self.transmits.is_empty()
    }

    /// A member answered (`Ok`) or its request failed (`Err`: connection lost, refused).
    pub fn handle_answer(
        &mut self,
        now: Instant,
        row: usize,
        answer: Result<Vec<u8>, String>,
        pool: &mut MemberPool,
    ) {
        if self.pending.remove(&row).is_none() {
            return; // not asked, or already settled
        }
        match answer {
            Ok(bytes) => {
                pool.note_answer(row);
                if !self.is_done() {
                    self.answers.push((row, bytes));
                }
            }
            Err(reason) => {
                tracing::warn!(row, %reason, "member failed; replacing it");
                self.drop_member(now, row, reason, pool);
            }
        }
    }

    /// A member's answer could not be used: drop it and ask a replacement.
    pub fn reject(&mut self, now: Instant, row: usize, reason: String, pool: &mut MemberPool) {
        self.answers.retain(|(r, _)| *r != row);
        self.pending.remove(&row);
        self.drop_member(now, row, reason, pool);
    }

    fn drop_member(&mut self, now: Instant, row: usize, reason: String, pool: &mut MemberPool) {
        self.members.retain(|&r| r != row);
        pool.down.insert(row);
        pool.misses.remove(&row);
        self.failures.push((row, reason));
        let outstanding = self.answers.len() + self.pending.len();
        if outstanding < self.need {
            self.ask_replacement(now, pool, true);
        }
    }

    fn ask_replacement(&mut self, now: Instant, pool: &mut MemberPool, needed: bool) {
        let decoding: Vec<usize> = self
            .answers
            .iter()
            .map(|(r, _)| *r)
            .chain(self.pending.keys().copied())
            .collect();
        if let Some(fresh) = pool.take_replacement(now, &decoding, needed) {
            self.members.push(fresh);
            self.pending.insert(fresh, now);
            self.transmits.push_back(fresh);
        }
    }

    /// Advances time: asks a spare when answers are late, drops members silent too long.
    pub fn handle_timeout(&mut self, now: Instant, pool: &mut MemberPool) {
        if self.is_done() {
            return;
        }
        if !self.straggler_asked && now >= self.started + self.cfg.straggler_after {
            self.straggler_asked = true;
            self.ask_replacement(now, pool, false);
        }
        let silent: Vec<usize> = self
            .pending
            .iter()
            .filter(|&(_, &since)| now >= since + self.cfg.member_timeout)
            .map(|(&r, _)| r)
            .collect();
        for row in silent {
            self.pending.remove(&row);
            self.drop_member(now, row, "timed out".into(), pool);
        }
    }

    /// When `handle_timeout` should next be called, if the round is still open.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.is_done() || self.is_failed() {
            return None;
        }
        let mut t = self
            .pending
            .values()
            .map(|&since| since + self.cfg.member_timeout)
            .min()?;
        if !self.straggler_asked {
            t = t.min(self.started + self.cfg.straggler_after);
        }
        Some(t)
    }

    /// Ends the round: the answers, or why there are too few. Members still silent are
    /// outstanding until they answer.
    pub fn finish(self, pool: &mut MemberPool) -> Result<Vec<(usize, Vec<u8>)>, RoundError> {
        if !self.is_done() {
            return Err(RoundError {
                need: self.need,
                got: self.answers.len(),
                failures: self
                    .failures
                    .iter()
                    .map(|(r, why)| format!("row {r}: {why}"))
                    .collect::<Vec<_>>()
                    .join("; "),
            });
        }
        for &row in self.pending.keys() {
            pool.outstanding.entry(row).or_insert(self.started);
        }
        Ok(self.answers)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_row_gives_its_first_free_holder() {
        let holders = std::collections::BTreeMap::from([
            (0, vec!["a", "b"]),
            (1, vec!["c"]),
            (2, vec!["d", "e"]),
        ]);
        let avoid = std::collections::BTreeSet::from(["a", "c", "d", "e"]);
        let picked = pick_holders(&holders, &avoid);
        assert_eq!(picked, std::collections::BTreeMap::from([(0, "b")]));
        let all = pick_holders(&holders, &Default::default());
        assert_eq!(
            all.values().copied().collect::<Vec<_>>(),
            vec!["a", "c", "d"]
        );
    }

    #[test]
    fn a_group_forms_from_the_nearest_rows_that_decode_well() {
        let g = Generator::cauchy(8, 3).unwrap();
        let live: Vec<usize> = (0..8).collect();
        // Rows 4..8 are 2 ms away, the data rows 100 ms; row 7's distance is not known.
        let rtt = |r: usize| match r {
            0..4 => Some(100.0),
            4..7 => Some(2.0),
            _ => None,
        };
        let near = plan_group_near(&g, &live, 1, rtt).unwrap();
        let best = plan_group(&g, &live, 1).unwrap();
        let mut decoding = near.members[..3].to_vec();
        decoding.sort_unstable();
        assert_eq!(
            (decoding, near.members[3]),
            (vec![4, 5, 6], 0),
            "the near rows decode; the spare is the nearest known of the rest (κ {} against the best {})",
            near.condition_number,
            best.condition_number
        );
        assert!(near.condition_number <= NEAR_MAX_CONDITION);
        // Nothing known: the best-conditioned group.
        let unknown = plan_group_near(&g, &live, 1, |_| None).unwrap();
        assert_eq!(unknown.members, best.members);
        // Too few near rows for a group: its slowest is the nearest far row, or one as near.
        let two_near = |r: usize| {
            Some(if r == 5 || r == 6 {
                1.0
            } else {
                50.0 + r as f32
            })
        };
        let mixed = plan_group_near(&g, &live, 0, two_near).unwrap();
        let slowest = (mixed.members.iter())
            .map(|&r| two_near(r).unwrap())
            .fold(0.0, f32::max);
        assert!(slowest <= 50.0 + NEAR_ALIKE_MS, "{:?}", mixed.members);
        // Every row about as near (one machine, one LAN): the best-conditioned group.
        let lan = |r: usize| Some(0.2 + 0.1 * (7 - r) as f32);
        assert_eq!(
            plan_group_near(&g, &live, 1, lan).unwrap().members,
            best.members
        );
    }

    #[test]
    fn a_group_is_formed_again_only_for_a_much_closer_one() {
        assert!(much_closer(150.0, 20.0));
        assert!(
            much_closer(f32::INFINITY, 20.0),
            "a member of unknown distance"
        );
        assert!(!much_closer(150.0, 100.0), "not half");
        assert!(
            !much_closer(6.0, 2.0),
            "4 ms saved is not worth a new group"
        );
        assert!(!much_closer(150.0, f32::INFINITY));
        assert!(!much_closer(150.0, f32::NAN));
    }

    fn pool(free: Vec<usize>) -> (Generator, MemberPool) {
        let g = Generator::cauchy(5, 3).unwrap();
        (g.clone(), MemberPool::new(g, free, RoundConfig::default()))
    }

    #[test]
    fn plan_has_k_best_then_spares() {
        let g = Generator::cauchy(5, 3).unwrap();
        let plan = plan_group(&g, &[0, 1, 2, 3, 4], 1).unwrap();
        assert_eq!(plan.members.len(), 4);
        let sel = select_nodes(&g, &[0, 1, 2, 3, 4]).unwrap();
        assert_eq!(plan.members[..3], sel.nodes[..]);
        assert!(plan.condition_number < 10.0);
        assert!(plan_group(&g, &[0, 1], 1).is_err());
    }

    #[test]
    fn first_k_answers_win_and_a_failure_is_replaced() {
        let (_, mut pool) = pool(vec![4]);
        let t0 = Instant::now();
        let mut r = RoundDriver::start(t0, &[0, 1, 2, 3], 3, &mut pool);
        let sent: Vec<usize> = std::iter::from_fn(|| r.poll_transmit()).collect();
        assert_eq!(sent, vec![0, 1, 2, 3]);
        r.handle_answer(t0, 1, Err("connection closed".into()), &mut pool);
        r.handle_answer(t0, 2, Err("connection closed".into()), &mut pool);
        assert_eq!(
            r.poll_transmit(),
            Some(4),
            "a failed member is replaced by the free row"
        );
        r.handle_answer(t0, 0, Ok(vec![0]), &mut pool);
        r.handle_answer(t0, 3, Ok(vec![3]), &mut pool);
        assert!(!r.is_done());
        r.handle_answer(t0, 4, Ok(vec![4]), &mut pool);
        assert!(r.is_done());
        assert_eq!(r.members(), &[0, 3, 4]);
        let answers = r.finish(&mut pool).unwrap();
        assert_eq!(
            answers.iter().map(|a| a.0).collect::<Vec<_>>(),
            vec![0, 3, 4]
        );
    }

    #[test]
    fn a_chronic_straggler_is_swapped_out_but_a_late_answerer_stays() {
        let (_, mut pool) = pool(vec![4]);
        let t0 = Instant::now();
        let mut members = vec![0, 1, 2, 3];
        // Rows 0 and 1 answer in time; row 2 answers after each round ends; row 3 never does.
        for round in 0..4 {
            let mut r = RoundDriver::start(t0, &members, 2, &mut pool);
            while r.poll_transmit().is_some() {}
            r.handle_answer(t0, 0, Ok(vec![]), &mut pool);
            r.handle_answer(t0, 1, Ok(vec![]), &mut pool);
            members = r.members().to_vec();
            r.finish(&mut pool).unwrap();
            pool.note_answer(2);
            if round < 2 {
                assert!(members.contains(&3), "round {round}: {members:?}");
            }
        }
        assert!(!members.contains(&3) && members.contains(&4), "{members:?}");
        assert!(
            members.contains(&2),
            "a late but answering member stays: {members:?}"
        );
    }

    #[test]
    fn the_row_silent_longest_is_the_last_replacement() {
        let (_, mut pool) = pool(vec![]);
        let t0 = Instant::now();
        // Rows 3 and 4 miss a round each, 3 first; both end up free.
        let mut r = RoundDriver::start(t0, &[0, 1, 2, 3], 3, &mut pool);
        while r.poll_transmit().is_some() {}
        for row in [0, 1, 2] {
            r.handle_answer(t0, row, Ok(vec![]), &mut pool);
        }
        r.finish(&mut pool).unwrap();
        let t1 = t0 + Duration::from_millis(10);
        let mut r = RoundDriver::start(t1, &[0, 1, 2, 4], 3, &mut pool);
        while r.poll_transmit().is_some() {}
        for row in [0, 1, 2] {
            r.handle_answer(t1, row, Ok(vec![]), &mut pool);
        }
        r.finish(&mut pool).unwrap();
        pool.free = vec![3, 4];
        assert_eq!(pool.take_replacement(t1, &[0, 1], false), Some(4));
        assert_eq!(pool.take_replacement(t1, &[0, 1], false), Some(3));
        // Silent for long, a row is asked again only when a member is needed, or once it answers.
        pool.free = vec![3];
        let later = t0 + pool.cfg.straggler_after * 4;
        assert_eq!(pool.take_replacement(later, &[0, 1], false), None);
        assert_eq!(pool.take_replacement(later, &[0, 1], true), Some(3));
        pool.free = vec![3];
        pool.note_answer(3);
        assert_eq!(pool.take_replacement(later, &[0, 1], false), Some(3));
    }

    #[test]
    fn a_round_without_enough_rows_fails_with_reasons() {
        let (_, mut pool) = pool(vec![]);
        let t0 = Instant::now();
        let mut r = RoundDriver::start(t0, &[0, 1, 2], 3, &mut pool);
        while r.poll_transmit().is_some() {}
        r.handle_answer(t0, 0, Ok(vec![]), &mut pool);
        r.handle_answer(t0, 1, Ok(vec![]), &mut pool);
        let late = r.poll_timeout().unwrap();
        r.handle_timeout(late, &mut pool);
        let late = r.poll_timeout().unwrap();
        r.handle_timeout(late, &mut pool);
        assert!(r.is_failed());
        let err = r.finish(&mut pool).unwrap_err();
        assert_eq!((err.need, err.got), (3, 2));
        assert!(
            err.failures.contains("row 2: timed out"),
            "{}",
            err.failures
        );
    }
}
