//! How a leader's passes travel: as rounds (the leader decodes every stage) or one hop per
//! stage (the members pass their coded outputs to each other). The rule is here, with what it
//! measures; time is passed in, and the shells run whichever route it picks.

use std::collections::BTreeMap;
use std::time::Duration;

use libp2p::PeerId;
use web_time::Instant;

use crate::mesh::Coord;

/// How a leader runs a forward pass.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum PassRoute {
    /// One hop per stage where a member is on another machine (reached at no address of this
    /// one) or the rounds wait on the network more than [`HOP_OVER`] a round; rounds
    /// otherwise.
    #[default]
    Auto,
    /// The leader decodes every stage (two one-way delays a round).
    Rounds,
    /// One hop per stage: the members pass their coded outputs to each other.
    Hop,
}

impl PassRoute {
    /// Every route, as the command line names them.
    pub const NAMES: [&str; 3] = ["auto", "rounds", "hop"];
}

impl std::fmt::Display for PassRoute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::Rounds => "rounds",
            Self::Hop => "hop",
        })
    }
}

impl std::str::FromStr for PassRoute {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "rounds" => Ok(Self::Rounds),
            "hop" => Ok(Self::Hop),
            other => Err(format!(
                "no pass route {other:?}: one of {}",
                Self::NAMES.join(", ")
            )),
        }
    }
}

/// Network time a round (its wait beyond the slowest member's compute) above which one hop
/// per stage is faster: at 0 ms a hop pass costs 78 ms a token against rounds' 34, and each
/// round trip saved is worth half its time (docs/perf.md, "The delay bench"), so hops win
/// past about 0.7 ms a round on the 2-core machine.
pub const HOP_OVER: Duration = Duration::from_millis(1);

/// How many times a round's compute its network time must be before hops win: a hop pass
/// also asks the check row for a whole product each stage (rounds check against projections)
/// and leaves out the leader's own row, which on cores the members share costs about twice
/// the slowest member's compute a round (SmolLM2: 0.36 ms against 0.18), and saves half the
/// network time. At the 1B shape a round computes for about a millisecond, and hops decoded at
/// half the rounds' speed on one machine (docs/perf.md).
pub const HOP_COMPUTE: u32 = 4;

/// Rounds measured before the network time a round is trusted (a token's worth or so).
pub const PROBE_ROUNDS: u64 = 128;

/// How long an automatic choice keeps to rounds after a hop group failed.
pub const HOP_RETRY: Duration = Duration::from_secs(60);

/// What a leader measured of its rounds, and when its hop group last failed: what
/// [`RouteMeasures::wants_hop`] decides from.
#[derive(Debug, Clone, Default)]
pub struct RouteMeasures {
    /// The rounds measured since the rounds group formed, and the network time they waited.
    rounds: u64,
    network: Duration,
    /// The rounds group's members' compute so far (its transport counts it from the start).
    computed: Duration,
    /// The slowest members' compute in the rounds measured.
    compute: Duration,
    /// When a hop group last failed.
    failed: Option<Instant>,
    /// Whether that hop group could not be formed over this group's rows (too few of them, a
    /// member that would not join): a group formed again may form one.
    unformed: bool,
}

impl RouteMeasures {
    /// Counts a step's rounds: their number and the time spent waiting for members, with the
    /// rounds group's slowest members' compute so far (what the step added to it was not
    /// network).
    pub fn measured(&mut self, rounds: u64, waited: Duration, computed: Duration) {
        let step = computed.saturating_sub(self.computed);
        self.computed = computed;
        self.compute += step;
        self.rounds += rounds;
        self.network += waited.saturating_sub(step);
    }

    /// The network time a round, once enough rounds were measured.
    pub fn network_per_round(&self) -> Option<Duration> {
        (self.rounds >= PROBE_ROUNDS).then(|| self.network / self.rounds as u32)
    }

    /// The slowest member's compute a round, once enough rounds were measured.
    pub fn compute_per_round(&self) -> Option<Duration> {
        (self.rounds >= PROBE_ROUNDS).then(|| self.compute / self.rounds as u32)
    }

    /// Forgets what was measured (the rounds group formed again), and a hop group that could
    /// not be formed over the old group's rows.
    pub fn forget(&mut self) {
        self.rounds = 0;
        self.network = Duration::ZERO;
        self.computed = Duration::ZERO;
        self.compute = Duration::ZERO;
        if self.unformed {
            (self.failed, self.unformed) = (None, false);
        }
    }

    /// A hop group's pass failed at `now`: an automatic choice keeps to rounds for
    /// [`HOP_RETRY`].
    pub fn hop_failed(&mut self, now: Instant) {
        (self.failed, self.unformed) = (Some(now), false);
    }

    /// A hop group could not be formed at `now`: an automatic choice keeps to rounds for
    /// [`HOP_RETRY`], or until the rounds group is formed again ([`Self::forget`]).
    pub fn hop_unformed(&mut self, now: Instant) {
        (self.failed, self.unformed) = (Some(now), true);
    }

    /// Whether an automatic route keeps to rounds at `now`: a hop group failed within
    /// [`HOP_RETRY`].
    pub fn held_to_rounds(&self, now: Instant) -> bool {
        self.failed
            .is_some_and(|at| now.saturating_duration_since(at) < HOP_RETRY)
    }

    /// Whether a leader's next pass goes one hop per stage under `route`, where `far` says
    /// whether any member is off this machine (`net::reach::off_this_machine`): automatically,
    /// where one is, or where a round's network time passes both [`HOP_OVER`] and
    /// [`HOP_COMPUTE`] times its compute.
    pub fn wants_hop(&self, route: PassRoute, far: bool, now: Instant) -> bool {
        match route {
            PassRoute::Rounds => false,
            PassRoute::Hop => true,
            PassRoute::Auto => {
                if self.held_to_rounds(now) {
                    return false;
                }
                let over = HOP_OVER.max(self.compute_per_round().unwrap_or_default() * HOP_COMPUTE);
                far || self.network_per_round().is_some_and(|n| n > over)
            }
        }
    }
}

/// What a hop group of `members` costs a stage by `places`, in milliseconds: the round trip of
/// its farthest pair, and its leader's (`me`) to its farthest member [`STAGES_PER_FEED`] times
/// less; infinite where a member's place is not known.
pub fn hop_cost(members: &[(usize, PeerId)], places: &BTreeMap<PeerId, Coord>, me: PeerId) -> f32 {
    let at = |p: &PeerId| places.get(p).filter(|c| c.is_placed());
    let mut worst = 0.0f32;
    for (i, (_, a)) in members.iter().enumerate() {
        let Some(a) = at(a) else {
            return f32::INFINITY;
        };
        for (_, b) in &members[i + 1..] {
            worst = worst.max(at(b).map_or(f32::INFINITY, |b| a.rtt_ms(b)));
        }
    }
    let feed = at(&me).map_or(0.0, |leader| {
        (members.iter())
            .filter_map(|(_, p)| Some(leader.rtt_ms(at(p)?)))
            .fold(0.0, f32::max)
    });
    worst + feed / STAGES_PER_FEED
}

/// Whether a hop group of `members` crosses less network a stage than the rounds group of
/// `rounds` (its members' holders) by `places`: a hop stage costs about half the round trip of
/// its farthest pair ([`hop_cost`]), a round the leader's (`me`) round trip to its farthest
/// member (its own row computes in process). A leader's own row is no hop member, so a hop
/// group may have to take a far holder of it where rounds have a near one. Hops are taken
/// where a place is not known.
pub fn hops_beat_rounds(
    members: &[(usize, PeerId)],
    rounds: &[PeerId],
    places: &BTreeMap<PeerId, Coord>,
    me: PeerId,
) -> bool {
    let at = |p: &PeerId| places.get(p).filter(|c| c.is_placed());
    let Some(leader) = at(&me) else {
        return true;
    };
    let mut round = 0.0f32;
    for p in rounds.iter().filter(|p| **p != me) {
        match at(p) {
            Some(c) => round = round.max(leader.rtt_ms(c)),
            None => return true,
        }
    }
    let hop = hop_cost(members, places, me) / 2.0;
    !hop.is_finite() || hop <= round
}

/// A hop pass's stages per feed from the leader: a pass crosses between members once a stage
/// (about 64 to 122 a token) and between the leader and its members twice, so a member's
/// distance to the leader weighs this much less than the members' to each other.
pub const STAGES_PER_FEED: f32 = 64.0;

/// The members a hop group forms over, at least `least` and at most `most` of them: the
/// rounds group's rows (`nodes`, the best conditioned first), then the other rows that
/// answered (`rows`, the holder asked of each), leaving out the leader's own node `me` (it
/// cannot pass a part to itself); why not when fewer than `least` remain. Every member's part
/// is waited for in a hop group, so the members beyond k all check every round, and each one
/// of them can be lost without a pass failing: spares are members beyond the checked ones.
///
/// Each row's holder is the one that makes the members nearest each other: the asked holder or
/// one of the row's `others` (free holders at the version), placed in `places` (the leader's
/// own place under `me` weighs [`STAGES_PER_FEED`] times less). Of every group made by taking
/// each row's holder nearest one holder, the one whose farthest pair is nearest (the asked
/// holders where no place is known).
pub fn hop_members(
    nodes: &[usize],
    rows: &BTreeMap<usize, PeerId>,
    others: &BTreeMap<usize, Vec<PeerId>>,
    places: &BTreeMap<PeerId, Coord>,
    me: PeerId,
    least: usize,
    most: usize,
) -> Result<Vec<(usize, PeerId)>, String> {
    let rest = rows.keys().filter(|r| !nodes.contains(r));
    // Each row's candidates, the asked holder first.
    let candidates: Vec<(usize, Vec<PeerId>)> = (nodes.iter().chain(rest))
        .filter_map(|&row| {
            let asked = rows.get(&row)?;
            let c: Vec<PeerId> = std::iter::once(asked)
                .chain(
                    others
                        .get(&row)
                        .into_iter()
                        .flatten()
                        .filter(|p| *p != asked),
                )
                .filter(|&&p| p != me)
                .copied()
                .collect();
            (c.first() == Some(asked)).then_some((row, c))
        })
        .take(most.max(least))
        .collect();
    if candidates.len() < least {
        return Err(format!(
            "a hop group needs {least} members besides the leader's node, {} rows have a holder at the version",
            candidates.len()
        ));
    }
    let asked: Vec<(usize, PeerId)> = candidates.iter().map(|(r, c)| (*r, c[0])).collect();
    let cost = |members: &[(usize, PeerId)]| hop_cost(members, places, me);
    let mut best = (cost(&asked), asked);
    let anchors = candidates
        .iter()
        .flat_map(|(_, c)| c)
        .filter_map(|p| places.get(p));
    for anchor in anchors.filter(|c| c.is_placed()) {
        let near = |p: &&PeerId| places.get(*p).map_or(f32::INFINITY, |c| c.rtt_ms(anchor));
        let trial: Vec<(usize, PeerId)> = (candidates.iter())
            .map(|(r, c)| {
                (
                    *r,
                    *c.iter()
                        .min_by(|a, b| near(a).total_cmp(&near(b)))
                        .unwrap_or(&c[0]),
                )
            })
            .collect();
        let c = cost(&trial);
        if c < best.0 {
            best = (c, trial);
        }
    }
    Ok(best.1)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

    use super::*;

    #[test]
    fn a_hop_group_that_must_take_a_far_holder_loses_to_near_rounds() {
        let p: Vec<PeerId> = (0..5).map(|_| PeerId::random()).collect();
        let place = Coord::placed_at;
        // The leader (p[0]) and p[1], p[2] near each other; p[3] 50 ms away.
        let places: BTreeMap<PeerId, Coord> = [(p[0], 0.0), (p[1], 1.0), (p[2], 2.0), (p[3], 50.0)]
            .into_iter()
            .map(|(q, x)| (q, place(x)))
            .collect();
        let rounds = [p[0], p[1], p[2]];
        let far = [(1, p[1]), (2, p[2]), (0, p[3])];
        assert!(!hops_beat_rounds(&far, &rounds, &places, p[0]));
        // Every holder as far from the leader as from each other: a hop stage costs half.
        let spread: BTreeMap<PeerId, Coord> = [(p[0], 0.0), (p[1], 10.0), (p[2], 10.0)]
            .into_iter()
            .map(|(q, x)| (q, place(x)))
            .collect();
        assert!(hops_beat_rounds(
            &[(1, p[1]), (2, p[2])],
            &rounds,
            &spread,
            p[0]
        ));
        // A place not known: the delays cannot say, and hops are taken.
        assert!(hops_beat_rounds(&far, &[p[0], p[4]], &places, p[0]));
    }

    #[test]
    fn the_network_time_a_round_counts_once_enough_rounds_were_measured() {
        let mut m = RouteMeasures::default();
        m.measured(100, Duration::from_millis(300), Duration::from_millis(100));
        assert_eq!(m.network_per_round(), None);
        // The transport's compute is a running total: 100 ms more in this step.
        m.measured(100, Duration::from_millis(300), Duration::from_millis(200));
        assert_eq!(m.network_per_round(), Some(Duration::from_millis(2)));
        m.forget();
        assert_eq!(m.network_per_round(), None);
    }

    #[test]
    fn auto_hops_for_far_members_or_slow_rounds_and_keeps_to_rounds_a_while_after_a_failure() {
        let now = Instant::now();
        let mut m = RouteMeasures::default();
        assert!(
            !m.wants_hop(PassRoute::Auto, false, now),
            "near and unmeasured"
        );
        assert!(m.wants_hop(PassRoute::Auto, true, now), "a far member");
        assert!(m.wants_hop(PassRoute::Hop, false, now));
        assert!(!m.wants_hop(PassRoute::Rounds, true, now));
        // 2 ms of network a round, over HOP_OVER: hop even with every member near.
        m.measured(
            PROBE_ROUNDS,
            Duration::from_millis(2 * PROBE_ROUNDS),
            Duration::ZERO,
        );
        assert!(m.wants_hop(PassRoute::Auto, false, now));
        m.hop_failed(now);
        assert!(
            !m.wants_hop(PassRoute::Auto, true, now),
            "right after a failure"
        );
        assert!(
            m.wants_hop(PassRoute::Hop, false, now),
            "asked for, it is tried"
        );
        assert!(
            m.wants_hop(PassRoute::Auto, true, now + HOP_RETRY),
            "retried later"
        );
        m.forget();
        assert!(
            !m.wants_hop(PassRoute::Auto, true, now),
            "a pass that failed on a hop group keeps a new group to rounds too"
        );
        // One that could not be formed over the old group's rows: a new group tries again.
        m.hop_unformed(now);
        assert!(!m.wants_hop(PassRoute::Auto, true, now));
        m.forget();
        assert!(m.wants_hop(PassRoute::Auto, true, now), "a new group");
    }

    #[test]
    fn rounds_that_compute_long_keep_to_rounds_unless_the_network_waits_longer_still() {
        let now = Instant::now();
        let mut m = RouteMeasures::default();
        // The 1B shape on one machine: 1 ms of compute and 2 ms of waiting beyond it a round.
        let rounds = PROBE_ROUNDS;
        let ms = |per_round: u64| Duration::from_millis(per_round * rounds);
        m.measured(rounds, ms(3), ms(1));
        assert_eq!(m.compute_per_round(), Some(Duration::from_millis(1)));
        assert!(
            !m.wants_hop(PassRoute::Auto, false, now),
            "2 ms against 4 × 1 ms"
        );
        // A far network: 20 ms a round beyond the same compute.
        m.measured(rounds, ms(21), ms(2));
        assert!(
            m.wants_hop(PassRoute::Auto, false, now),
            "11 ms against 4 × 1 ms"
        );
    }

    #[test]
    fn a_hop_group_takes_the_rounds_groups_members_first_and_never_the_leaders_node() {
        let peers: Vec<PeerId> = (0..5).map(|_| PeerId::random()).collect();
        let rows: BTreeMap<usize, PeerId> = peers.iter().copied().enumerate().collect();
        let (others, places) = (BTreeMap::new(), BTreeMap::new());
        let hop =
            |least, most| hop_members(&[3, 1, 4], &rows, &others, &places, peers[1], least, most);
        let got = hop(2, 3).unwrap();
        assert_eq!(got, [(3, peers[3]), (4, peers[4]), (0, peers[0])]);
        // Spares are taken where there are rows for them, and left out where there are none.
        let all = hop(3, 9).unwrap();
        assert_eq!(all.len(), 4);
        let err = hop(5, 6).unwrap_err();
        assert!(
            err.contains("needs 5 members") && err.contains("4 rows"),
            "{err}"
        );
    }

    #[test]
    fn a_hop_groups_holders_are_those_nearest_each_other() {
        // Rows 0..4, each held in eu (at 0 ms) and in us (at 80 ms); the rounds group asked
        // eu's holder of rows 0 and 2 and us's of rows 1 and 3 (nearest a leader between).
        let eu: Vec<PeerId> = (0..4).map(|_| PeerId::random()).collect();
        let us: Vec<PeerId> = (0..4).map(|_| PeerId::random()).collect();
        let me = PeerId::random();
        let rows: BTreeMap<usize, PeerId> = [(0, eu[0]), (1, us[1]), (2, eu[2]), (3, us[3])].into();
        let others: BTreeMap<usize, Vec<PeerId>> =
            (0..4).map(|r| (r, vec![eu[r], us[r]])).collect();
        let mut places: BTreeMap<PeerId, Coord> = BTreeMap::new();
        for r in 0..4 {
            places.insert(eu[r], Coord::placed_at(0.0));
            places.insert(us[r], Coord::placed_at(80.0));
        }
        let hop = |places: &BTreeMap<PeerId, Coord>| {
            hop_members(&[0, 1, 2], &rows, &others, places, me, 3, 3).unwrap()
        };
        // The leader nearer us: the three in us, with the rounds group's rows.
        places.insert(me, Coord::placed_at(70.0));
        assert_eq!(hop(&places), [(0, us[0]), (1, us[1]), (2, us[2])]);
        // Nearer eu: the three in eu.
        places.insert(me, Coord::placed_at(10.0));
        assert_eq!(hop(&places), [(0, eu[0]), (1, eu[1]), (2, eu[2])]);
        // No place known: the holders the rounds group asked.
        assert_eq!(hop(&BTreeMap::new()), [(0, eu[0]), (1, us[1]), (2, eu[2])]);
        // Only one region holds row 1: a group that crosses is the only one, and it is kept
        // as asked where no group is nearer.
        let others: BTreeMap<usize, Vec<PeerId>> =
            [(0, vec![eu[0]]), (1, vec![us[1]]), (2, vec![eu[2]])].into();
        let got = hop_members(&[0, 1, 2], &rows, &others, &places, me, 3, 3).unwrap();
        assert_eq!(got, [(0, eu[0]), (1, us[1]), (2, eu[2])]);
    }

    #[test]
    fn a_route_reads_back_as_it_is_written() {
        for name in PassRoute::NAMES {
            let route: PassRoute = name.parse().unwrap();
            assert_eq!(route.to_string(), name);
        }
        let err = "hops".parse::<PassRoute>().unwrap_err();
        assert!(err.contains("auto, rounds, hop"), "{err}");
    }
}
