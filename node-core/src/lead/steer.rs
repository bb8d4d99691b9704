//! A leader's choices about its group, without I/O: when to form it, when a group short of
//! members looks for a row that came back, when a pass that failed may run again, and how
//! each pass travels (rounds or one hop per stage, [`super::route`]). The group's half of
//! every [`super::Leader`]: one set of rules, tested in virtual time.

use std::collections::BTreeSet;

use std::str::FromStr;
use web_time::{Duration, Instant};

pub use super::choose::Route;
use super::choose::{PassRows, RouteChoice};
use super::route::{PassRoute, RouteMeasures};
use crate::mesh::MeshInfo;

/// How long a failure to form a group stands as the answer before forming is tried again.
pub const FORM_RETRY: Duration = Duration::from_secs(1);

/// How often a group short of members looks for a row that came back.
pub const SHORT_CHECK: Duration = Duration::from_millis(500);

/// How often a whole group looks for a much closer one ([`crate::mesh::much_closer`]): the
/// mesh's round trips are learnt as it runs, and near holders join. Looking reads the view
/// alone; on the simulated world map a SmolLM2 token's p50 was 1,035 ms looking every 10 s
/// against 1,178 every 30 s (docs/perf.md).
pub const CLOSER_CHECK: Duration = Duration::from_secs(10);

/// When a group first looks for a much closer one after it formed: a leader just started
/// formed it by coordinates still settling, and the pings that open with its members'
/// connections have measured their round trips by then (a leader 50 ms from its region's
/// holders kept a far one for 30 s).
pub const FIRST_CLOSER_CHECK: Duration = Duration::from_secs(5);

/// How long a group formed again for a row that came back does not do so again for that row
/// (a stalled holder can come back and stall again).
pub const RETURNED_BACKOFF: Duration = Duration::from_secs(60);

/// The wait before the second formation in a run of failed passes; each later one waits
/// twice the one before, up to [`RETRY_MAX`]. The first is formed at once: a member died and
/// its row's place is taken by another.
pub const RETRY_BASE: Duration = Duration::from_millis(250);

/// The longest wait between formations in a run of failed passes.
pub const RETRY_MAX: Duration = Duration::from_secs(2);

/// The wait after a pass met members at another version: the mesh is taking an update, and
/// its holders apply it within about this.
pub const MOVED_WAIT: Duration = Duration::from_millis(300);

/// How long a leader forms its groups with one more check after a pass whose answers disagreed
/// with the code and no member could be told wrong ([`Steer::unlocated`]).
pub const CHECK_MORE_FOR: Duration = Duration::from_secs(60);

/// What a leader's shell does next for its group.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Form a group, then tell [`Steer::formed`] or [`Steer::form_failed`].
    Form,
    /// The group is short of members: find a row it could take again ([`Looking::in_view`]
    /// over the mesh's view, or the shell's own rule), then tell [`Steer::looked`].
    Look(Looking),
    /// Nothing runs before this moment (a run of failed passes backs off); then poll again.
    Wait(Instant),
    /// No group can be formed now, for this reason; forming is tried again from `until`.
    Unavailable {
        /// Why forming failed.
        why: String,
        /// When it may be tried again.
        until: Instant,
    },
    /// Run the next pass on the group, travelling as this says.
    Pass(Route),
}

/// What a group short of members looks for: a row at its version, not among its rows,
/// whose holder was heard from since it went short.
#[derive(Debug, Clone, PartialEq)]
pub struct Looking {
    /// Its rows now.
    pub rows: Vec<usize>,
    /// Members it was formed to have (k, the checked ones and the spares).
    pub wanted: usize,
    /// How long it has been short: a holder heard from within this came back.
    pub heard_within: Duration,
}

impl Looking {
    /// The row in the mesh's view `info` a group at `version` could take again, leaving out
    /// holders in `avoid` and taking its members that `left` it only once heard from since
    /// ([`returned_row`]).
    pub fn in_view<P: Ord + FromStr>(
        &self,
        info: &MeshInfo,
        version: &[u8; 32],
        avoid: &BTreeSet<P>,
        left: &BTreeSet<P>,
    ) -> Option<usize> {
        let heard = self.heard_within.as_secs_f64();
        returned_row(info, version, &self.rows, self.wanted, avoid, left, heard)
    }
}

/// A row a group short of `wanted` members could take again: healthy at the group's
/// `version` in `info`, not among the group's `rows`, with a holder not in `avoid` (another
/// group's) that is alive: heard from within two heartbeats, or, for a member that `left` the
/// group, within the last `heard_within` seconds (since the group went short: a member that
/// stalled still shows healthy for a while). A leader forms its group again when one comes
/// back, instead of going on short of its checks and spares. `P` names peers as the view does
/// (a [`libp2p::PeerId`]; a simulation's numbers).
pub fn returned_row<P: Ord + FromStr>(
    info: &MeshInfo,
    version: &[u8; 32],
    rows: &[usize],
    wanted: usize,
    avoid: &BTreeSet<P>,
    left: &BTreeSet<P>,
    heard_within: f64,
) -> Option<usize> {
    if rows.len() >= wanted {
        return None;
    }
    let (at, live) = info.live_holders()?;
    if at != *version {
        return None;
    }
    let alive = (2.0 * info.health.heartbeat_interval.as_secs_f64()).max(heard_within);
    live.iter()
        .filter(|(row, _)| !rows.contains(row))
        .find(|(_, holders)| {
            holders.iter().any(|n| {
                n.peer.parse::<P>().is_ok_and(|p| {
                    let within = if left.contains(&p) {
                        heard_within
                    } else {
                        alive
                    };
                    !avoid.contains(&p) && n.silent_for_s < within
                })
            })
        })
        .map(|(&row, _)| row)
}

/// What a [`Steer`] knows of the group it holds (the rows are the shell's, passed to
/// [`Steer::poll`]).
#[derive(Debug, Clone, Default)]
struct Group {
    /// Since when it has been short of members.
    short_since: Option<Instant>,
    /// When it last looked for a row that came back.
    looked: Option<Instant>,
    /// When it was first polled whole, or last looked for a much closer group.
    closer: Option<Instant>,
    /// Whether it has looked for a much closer group yet.
    looked_closer: bool,
}

/// A leader's rules for its group, as a state machine driven with the time: the shell asks
/// [`Steer::poll`] what to do before each pass (with its group's rows now) and reports forming, looking and each pass's
/// outcome.
#[derive(Debug, Clone)]
pub struct Steer {
    wanted: usize,
    group: Option<Group>,
    /// When forming last failed, and why.
    form_failed: Option<(Instant, String)>,
    /// Failed passes since the last that ran.
    failures: u32,
    /// No formation before this (a run of failed passes backs off).
    retry_at: Option<Instant>,
    /// The row it last formed again for, and when.
    tried: Option<(usize, Instant)>,
    /// How passes may travel (rounds unless the shell says otherwise).
    route: PassRoute,
    /// Whether a member of the group is on another machine.
    far: bool,
    /// What the group's rounds measured, and when a hop group last failed.
    measures: RouteMeasures,
    /// What each route's passes took for their rows, and where the keys and values are.
    choice: RouteChoice,
    /// The rows of the next pass, on each route.
    next: PassRows,
    /// Groups are formed with one more check until then (a wrong answer went unlocated).
    check_more_until: Option<Instant>,
}

impl Steer {
    /// Rules for a group formed to have `wanted` members (k, the checked ones and the
    /// spares); it has no group yet.
    pub fn new(wanted: usize) -> Self {
        Self {
            wanted,
            group: None,
            form_failed: None,
            failures: 0,
            retry_at: None,
            tried: None,
            route: PassRoute::Rounds,
            far: false,
            measures: RouteMeasures::default(),
            choice: RouteChoice::default(),
            next: PassRows::default(),
            check_more_until: None,
        }
    }

    /// A pass at `now` met answers that disagree with the code and could not tell which
    /// member was wrong: groups formed within [`CHECK_MORE_FOR`] take one more check, so the
    /// next pass locates the wrong member (and the group drops it) instead of failing again.
    pub fn unlocated(&mut self, now: Instant) {
        self.check_more_until = Some(now + CHECK_MORE_FOR);
    }

    /// Checks a group formed at `now` takes beyond the k decoded: the shell's `checks`, and
    /// one more after an unlocated wrong answer ([`Steer::unlocated`]).
    pub fn checks(&self, now: Instant, checks: usize) -> usize {
        checks + self.more_checks(now)
    }

    /// The check added at `now` after an unlocated wrong answer (one, or none).
    fn more_checks(&self, now: Instant) -> usize {
        usize::from(self.check_more_until.is_some_and(|until| now < until))
    }

    /// Its passes travel as `route` says from now on (an automatic choice goes one hop per
    /// stage where a member is far or the rounds wait on the network).
    pub fn set_route(&mut self, route: PassRoute) {
        self.route = route;
    }

    /// How its passes travel: chosen, or as forced.
    pub fn route(&self) -> PassRoute {
        self.route
    }

    /// The group just formed has a member on another machine (`far`), or has none.
    pub fn set_far(&mut self, far: bool) {
        self.far = far;
    }

    /// Counts a step's rounds ([`RouteMeasures::measured`]).
    pub fn measured(&mut self, rounds: u64, waited: Duration, computed: Duration) {
        self.measures.measured(rounds, waited, computed);
    }

    /// The network time a round, once enough rounds were measured.
    pub fn network_per_round(&self) -> Option<Duration> {
        self.measures.network_per_round()
    }

    /// A hop group's pass failed at `now`: an automatic choice keeps to rounds for a while.
    pub fn hop_failed(&mut self, now: Instant) {
        self.measures.hop_failed(now);
    }

    /// A hop group could not be formed at `now`: an automatic choice keeps to rounds for a
    /// while, or until a group is formed again ([`RouteMeasures::hop_unformed`]).
    pub fn hop_unformed(&mut self, now: Instant) {
        self.measures.hop_unformed(now);
    }

    /// The next pass runs `rows` rows (on the route the keys and values are on, and on the
    /// other, where every sequence starts again).
    pub fn next_pass(&mut self, rows: PassRows) {
        self.next = rows;
    }

    /// A pass of `rows` rows went by `route` and took `took`.
    pub fn ran_pass(&mut self, route: Route, rows: usize, took: Duration) {
        self.choice.ran(route, rows, took);
    }

    /// What each route's passes took for their rows.
    pub fn choice(&self) -> &RouteChoice {
        &self.choice
    }

    /// How a pass at `now` travels: as the route says, or automatically as the delays choose
    /// ([`RouteMeasures::wants_hop`]) unless what passes of each route took for their rows
    /// says otherwise for this one ([`RouteChoice::choose`]).
    fn route_at(&mut self, now: Instant) -> Route {
        let preferred = if self.measures.wants_hop(self.route, self.far, now) {
            Route::Hop
        } else {
            Route::Rounds
        };
        if self.route != PassRoute::Auto || self.measures.held_to_rounds(now) {
            return preferred;
        }
        let chosen = self.choice.choose(preferred, self.next);
        if chosen != preferred && self.choice.on() != Some(chosen) {
            let PassRows { stay, all } = self.next;
            tracing::info!(
                stay,
                all,
                "a pass goes by {chosen:?}, not {preferred:?}: faster for its rows by what each route's passes took"
            );
        }
        chosen
    }

    /// The keys and values a hop group held are gone with it (a group formed again, let go, a
    /// pass failed): every sequence starts again on the next pass.
    fn hop_keys_gone(&mut self) {
        if self.choice.on() == Some(Route::Hop) {
            self.choice.restart();
        }
    }

    /// What to do at `now` before the next pass, its group holding `rows` now (a member that
    /// failed with no free row to take its place leaves it short).
    pub fn poll(&mut self, now: Instant, rows: &[usize]) -> Action {
        let wanted = self.wanted + self.more_checks(now);
        let Some(g) = self.group.as_mut() else {
            if let Some(at) = self.retry_at.filter(|&at| now < at) {
                return Action::Wait(at);
            }
            if let Some((at, why)) = &self.form_failed {
                let until = *at + FORM_RETRY;
                if now < until {
                    let why = why.clone();
                    return Action::Unavailable { why, until };
                }
            }
            return Action::Form;
        };
        if rows.len() >= wanted {
            g.short_since = None;
            let since = *g.closer.get_or_insert(now);
            let every = if g.looked_closer {
                CLOSER_CHECK
            } else {
                FIRST_CLOSER_CHECK
            };
            if now >= since + every {
                g.closer = Some(now);
                g.looked_closer = true;
                return Action::Look(Looking {
                    rows: rows.to_vec(),
                    wanted,
                    heard_within: Duration::ZERO,
                });
            }
            return Action::Pass(self.route_at(now));
        }
        let since = *g.short_since.get_or_insert(now);
        if g.looked.is_some_and(|at| now < at + SHORT_CHECK) {
            return Action::Pass(self.route_at(now));
        }
        g.looked = Some(now);
        Action::Look(Looking {
            rows: rows.to_vec(),
            wanted,
            heard_within: now.saturating_duration_since(since),
        })
    }

    /// A group was formed: what its rounds measure starts again.
    pub fn formed(&mut self) {
        self.group = Some(Group::default());
        (self.form_failed, self.retry_at) = (None, None);
        self.measures.forget();
        self.hop_keys_gone();
    }

    /// Forming failed at `now` for `why`: that is the answer for [`FORM_RETRY`].
    pub fn form_failed(&mut self, now: Instant, why: String) {
        self.group = None;
        self.form_failed = Some((now, why));
    }

    /// What looking found at `now`: a row that came back, or none. True when the group is to
    /// be let go and formed again with it (not for a row it formed again for within
    /// [`RETURNED_BACKOFF`]).
    pub fn looked(&mut self, now: Instant, row: Option<usize>) -> bool {
        let Some(row) = row else {
            return false;
        };
        let recent = self
            .tried
            .is_some_and(|(r, at)| r == row && now < at + RETURNED_BACKOFF);
        if recent || self.group.is_none() {
            return false;
        }
        self.tried = Some((row, now));
        self.group = None;
        true
    }

    /// A pass ran.
    pub fn passed(&mut self) {
        self.failures = 0;
    }

    /// A pass failed at `now` (`moved`: it met members at another version): the group goes,
    /// and the next is formed after the run's backoff.
    pub fn pass_failed(&mut self, now: Instant, moved: bool) {
        self.failures += 1;
        self.group = None;
        self.hop_keys_gone();
        let wait = if moved {
            MOVED_WAIT
        } else if self.failures <= 1 {
            Duration::ZERO
        } else {
            let doubled = RETRY_BASE.saturating_mul(1 << (self.failures - 2).min(16));
            doubled.min(RETRY_MAX)
        };
        self.retry_at = (!wait.is_zero()).then(|| now + wait);
    }

    /// The shell let the group go (formed again when next polled).
    pub fn let_go(&mut self) {
        self.group = None;
        self.hop_keys_gone();
    }

    /// Failed passes since the last that ran.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// When [`Steer::poll`] next says something new with nothing reported: the end of a
    /// backoff or of a failure to form that stands as the answer, or a short group's next
    /// look.
    pub fn timeout(&self) -> Option<Instant> {
        match &self.group {
            None => (self.retry_at)
                .or_else(|| self.form_failed.as_ref().map(|(at, _)| *at + FORM_RETRY)),
            Some(g) => g
                .short_since
                .and(g.looked)
                .map(|looked| looked + SHORT_CHECK),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_leader_forms_then_passes_and_a_failed_form_is_the_answer_for_a_while() {
        let t0 = Instant::now();
        let mut s = Steer::new(4);
        assert_eq!(s.poll(t0, &[]), Action::Form);
        s.form_failed(t0, "two rows".into());
        let until = t0 + FORM_RETRY;
        let why = "two rows".to_string();
        assert_eq!(s.poll(t0, &[]), Action::Unavailable { why, until });
        assert_eq!(s.poll(until, &[]), Action::Form);
        s.formed();
        assert_eq!(s.poll(until, &[0, 1, 2, 3]), Action::Pass(Route::Rounds));
    }

    #[test]
    fn failed_passes_back_off_doubling_and_a_pass_resets_the_run() {
        let t0 = Instant::now();
        let mut s = Steer::new(3);
        s.formed();
        s.pass_failed(t0, false);
        assert_eq!(s.poll(t0, &[]), Action::Form, "the first is formed at once");
        let mut waits = Vec::new();
        for _ in 0..5 {
            s.formed();
            s.pass_failed(t0, false);
            let Action::Wait(at) = s.poll(t0, &[]) else {
                panic!("no backoff")
            };
            waits.push(at - t0);
        }
        let ms: Vec<u128> = waits.iter().map(Duration::as_millis).collect();
        assert_eq!(ms, [250, 500, 1000, 2000, 2000]);
        assert_eq!(s.poll(t0 + RETRY_MAX, &[]), Action::Form);
        s.formed();
        s.passed();
        s.pass_failed(t0, false);
        assert_eq!(s.poll(t0, &[]), Action::Form);
        s.formed();
        s.pass_failed(t0, true);
        assert_eq!(
            s.poll(t0, &[]),
            Action::Wait(t0 + MOVED_WAIT),
            "the mesh moved"
        );
    }

    #[test]
    fn an_unlocated_wrong_answer_adds_a_check_to_the_groups_formed_for_a_while() {
        let t0 = Instant::now();
        let mut s = Steer::new(4);
        assert_eq!(s.checks(t0, 1), 1);
        s.formed();
        s.unlocated(t0);
        s.pass_failed(t0, false);
        assert_eq!(s.poll(t0, &[]), Action::Form);
        assert_eq!(s.checks(t0, 1), 2, "the next group locates a wrong answer");
        s.formed();
        assert_eq!(
            s.poll(t0, &[0, 1, 2, 3, 4]),
            Action::Pass(Route::Rounds),
            "five members are the group it wants"
        );
        let Action::Look(l) = s.poll(t0, &[0, 1, 2, 3]) else {
            panic!("four members are short of the check")
        };
        assert_eq!(l.wanted, 5);
        let later = t0 + CHECK_MORE_FOR;
        assert_eq!(s.checks(later, 1), 1, "back to the shell's checks");
        assert_eq!(
            past_closer(&mut s, later, &[0, 1, 2, 3]),
            Action::Pass(Route::Rounds)
        );
    }

    /// What `s` says at `at` for `rows`, past a whole group's look for a closer one (none found).
    fn past_closer(s: &mut Steer, at: Instant, rows: &[usize]) -> Action {
        match s.poll(at, rows) {
            Action::Look(l) if l.rows.len() >= l.wanted => {
                assert!(!s.looked(at, None));
                s.poll(at, rows)
            }
            other => other,
        }
    }

    #[test]
    fn a_whole_group_looks_for_a_much_closer_one_soon_after_forming_then_every_closer_check() {
        let t0 = Instant::now();
        let mut s = Steer::new(3);
        s.formed();
        let whole = [0, 1, 2];
        assert_eq!(s.poll(t0, &whole), Action::Pass(Route::Rounds));
        assert_eq!(
            s.poll(t0 + FIRST_CLOSER_CHECK / 2, &whole),
            Action::Pass(Route::Rounds)
        );
        // Its first look comes soon: it was formed by coordinates still settling.
        let t1 = t0 + FIRST_CLOSER_CHECK;
        let Action::Look(l) = s.poll(t1, &whole) else {
            panic!("a whole group looks for a closer one")
        };
        assert!(l.rows.len() >= l.wanted, "{l:?}");
        assert!(!s.looked(t1, None));
        assert_eq!(s.poll(t1, &whole), Action::Pass(Route::Rounds));
        assert_eq!(
            s.poll(t1 + FIRST_CLOSER_CHECK, &whole),
            Action::Pass(Route::Rounds),
            "then every CLOSER_CHECK"
        );
        let t2 = t1 + CLOSER_CHECK;
        assert!(matches!(s.poll(t2, &whole), Action::Look(_)));
        assert!(s.looked(t2, Some(4)), "a closer group: formed again");
        assert_eq!(s.poll(t2, &[]), Action::Form);
    }

    #[test]
    fn a_short_group_looks_every_check_and_goes_once_for_a_row_that_came_back() {
        let t0 = Instant::now();
        let mut s = Steer::new(4);
        s.formed();
        assert_eq!(s.poll(t0, &[0, 1, 2, 3]), Action::Pass(Route::Rounds));
        let short = [0, 1, 3];
        let t1 = t0 + Duration::from_secs(3);
        let Action::Look(l) = s.poll(t1, &short) else {
            panic!("a short group looks")
        };
        assert_eq!(
            (l.rows, l.wanted, l.heard_within),
            (vec![0, 1, 3], 4, Duration::ZERO)
        );
        assert!(!s.looked(t1, None));
        assert_eq!(
            s.poll(t1 + SHORT_CHECK / 2, &short),
            Action::Pass(Route::Rounds),
            "not before the next check"
        );
        let t2 = t1 + SHORT_CHECK;
        let Action::Look(l) = s.poll(t2, &short) else {
            panic!("looks again")
        };
        assert_eq!(
            l.heard_within, SHORT_CHECK,
            "heard from since it went short"
        );
        assert!(s.looked(t2, Some(2)));
        assert_eq!(s.poll(t2, &[]), Action::Form);
        s.formed();
        let t3 = t2 + SHORT_CHECK;
        assert!(matches!(s.poll(t3, &short), Action::Look(_)));
        assert!(
            !s.looked(t3, Some(2)),
            "not again for the same row within the backoff"
        );
        let t4 = t2 + RETURNED_BACKOFF;
        assert!(matches!(s.poll(t4, &short), Action::Look(_)));
        assert!(s.looked(t4, Some(2)));
    }

    #[test]
    fn passes_go_over_rounds_until_the_rounds_wait_on_the_network_or_a_member_is_far() {
        use crate::lead::route::{HOP_RETRY, PROBE_ROUNDS};
        let t0 = Instant::now();
        let mut s = Steer::new(2);
        s.formed();
        s.set_far(true);
        s.measured(PROBE_ROUNDS, Duration::from_secs(60), Duration::ZERO);
        assert_eq!(
            s.poll(t0, &[0, 1]),
            Action::Pass(Route::Rounds),
            "rounds unless told"
        );
        let mut s = Steer::new(2);
        s.set_route(PassRoute::Auto);
        s.formed();
        assert_eq!(
            s.poll(t0, &[0, 1]),
            Action::Pass(Route::Rounds),
            "nothing measured"
        );
        // 128 rounds of 1 ms compute that waited 10 ms each: 9 ms of network a round.
        let compute = Duration::from_millis(PROBE_ROUNDS);
        s.measured(PROBE_ROUNDS, compute * 10, compute);
        assert_eq!(s.network_per_round(), Some(Duration::from_millis(9)));
        assert_eq!(s.poll(t0, &[0, 1]), Action::Pass(Route::Hop));
        s.hop_failed(t0);
        assert_eq!(
            s.poll(t0, &[0, 1]),
            Action::Pass(Route::Rounds),
            "a hop group failed"
        );
        assert_eq!(
            past_closer(&mut s, t0 + HOP_RETRY, &[0, 1]),
            Action::Pass(Route::Hop)
        );
        s.formed();
        assert_eq!(s.network_per_round(), None, "a new group measures anew");
        assert_eq!(s.poll(t0 + HOP_RETRY, &[0, 1]), Action::Pass(Route::Rounds));
        s.set_far(true);
        assert_eq!(
            s.poll(t0 + HOP_RETRY, &[0, 1]),
            Action::Pass(Route::Hop),
            "a far member"
        );
        let short = s.poll(t0 + HOP_RETRY, &[0]);
        assert!(matches!(short, Action::Look(_)), "{short:?}");
        let short = s.poll(t0 + HOP_RETRY, &[0]);
        assert_eq!(
            short,
            Action::Pass(Route::Hop),
            "a short group's pass, routed too"
        );
    }

    #[test]
    fn a_long_pass_bound_by_a_link_goes_by_rounds_where_the_route_is_automatic() {
        use crate::lead::choose::PassRows;
        let t0 = Instant::now();
        let secs = Duration::from_secs_f64;
        let mut s = Steer::new(2);
        s.set_route(PassRoute::Auto);
        s.formed();
        s.set_far(true);
        // Hops measured: 300 rows took 21 s, a token 3.06 s (each row 60 ms on a link).
        s.next_pass(PassRows {
            stay: 300,
            all: 300,
        });
        assert_eq!(
            s.poll(t0, &[0, 1]),
            Action::Pass(Route::Hop),
            "nothing measured"
        );
        s.ran_pass(Route::Hop, 300, secs(21.0));
        s.ran_pass(Route::Hop, 1, secs(3.06));
        s.next_pass(PassRows { stay: 1, all: 301 });
        assert_eq!(
            s.poll(t0, &[0, 1]),
            Action::Pass(Route::Hop),
            "a token stays"
        );
        // A new prompt of 300 rows with nothing else in the batch: rounds are tried.
        s.next_pass(PassRows {
            stay: 300,
            all: 300,
        });
        assert_eq!(s.poll(t0, &[0, 1]), Action::Pass(Route::Rounds));
        // Asked for hops, or after a hop group failed, the route is as before.
        s.set_route(PassRoute::Hop);
        assert_eq!(s.poll(t0, &[0, 1]), Action::Pass(Route::Hop));
        s.set_route(PassRoute::Auto);
        s.hop_failed(t0);
        s.next_pass(PassRows { stay: 1, all: 301 });
        assert_eq!(s.poll(t0, &[0, 1]), Action::Pass(Route::Rounds));
        // A group formed again loses the hop group's keys: the pass starts again anywhere.
        assert_eq!(s.choice().on(), Some(Route::Hop));
        s.formed();
        assert_eq!(s.choice().on(), None);
        let kept = s
            .choice()
            .fit(Route::Hop)
            .predict(300)
            .unwrap()
            .as_secs_f64();
        assert!((kept - 21.0).abs() < 1e-6, "what hops took is kept: {kept}");
    }
}
