//! How a leader's passes travel: as rounds (the leader decodes every stage) or one hop per
//! stage (the members pass their coded outputs to each other). The rule is here, with what it
//! measures; time is passed in, and the shells run whichever route it picks.

use std::collections::BTreeMap;
use std::time::Duration;

use libp2p::multiaddr::Protocol;
use libp2p::{Multiaddr, PeerId};
use web_time::Instant;

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

    /// Forgets what was measured (the rounds group formed again).
    pub fn forget(&mut self) {
        self.rounds = 0;
        self.network = Duration::ZERO;
        self.computed = Duration::ZERO;
        self.compute = Duration::ZERO;
    }

    /// A hop group failed at `now`: an automatic choice keeps to rounds for [`HOP_RETRY`].
    pub fn hop_failed(&mut self, now: Instant) {
        self.failed = Some(now);
    }

    /// Whether a leader's next pass goes one hop per stage under `route`, where `far` says
    /// whether any member is off this machine ([`off_this_machine`]): automatically, where
    /// one is, or where a round's network time passes both [`HOP_OVER`] and [`HOP_COMPUTE`]
    /// times its compute.
    pub fn wants_hop(&self, route: PassRoute, far: bool, now: Instant) -> bool {
        match route {
            PassRoute::Rounds => false,
            PassRoute::Hop => true,
            PassRoute::Auto => {
                if self
                    .failed
                    .is_some_and(|at| now.saturating_duration_since(at) < HOP_RETRY)
                {
                    return false;
                }
                let over = HOP_OVER.max(self.compute_per_round().unwrap_or_default() * HOP_COMPUTE);
                far || self.network_per_round().is_some_and(|n| n > over)
            }
        }
    }
}

/// Whether a member is on another machine: every address it was reached at is off this one
/// (no loopback address; a member on a local socket is not reached at any).
pub fn off_this_machine(addrs: &[Multiaddr]) -> bool {
    !addrs.is_empty()
        && addrs.iter().all(|a| {
            !a.iter().any(|p| match p {
                Protocol::Ip4(ip) => ip.is_loopback(),
                Protocol::Ip6(ip) => ip.is_loopback(),
                _ => false,
            })
        })
}

/// The members a hop group forms over, at least `least` and at most `most` of them: the
/// rounds group's own (`nodes`, the best conditioned first), then the other rows that answered
/// (`rows`), leaving out the leader's own node `me` (it cannot pass a part to itself); why not
/// when fewer than `least` remain. Every member's part is waited for in a hop group, so the
/// members beyond k all check every round, and each one of them can be lost without a pass
/// failing: spares are members beyond the checked ones.
pub fn hop_members(
    nodes: &[usize],
    rows: &BTreeMap<usize, PeerId>,
    me: PeerId,
    least: usize,
    most: usize,
) -> Result<Vec<(usize, PeerId)>, String> {
    let rest = rows.keys().filter(|r| !nodes.contains(r));
    let members: Vec<(usize, PeerId)> = nodes
        .iter()
        .chain(rest)
        .filter_map(|&row| rows.get(&row).filter(|&&p| p != me).map(|&p| (row, p)))
        .take(most.max(least))
        .collect();
    if members.len() < least {
        return Err(format!(
            "a hop group needs {least} members besides the leader's node, {} rows have a holder at the version",
            members.len()
        ));
    }
    Ok(members)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

    use super::*;

    #[test]
    fn a_member_reached_only_off_this_machine_is_far() {
        let at = |s: &str| s.parse::<Multiaddr>().unwrap();
        assert!(off_this_machine(&[at("/ip4/10.0.0.2/tcp/4001")]));
        assert!(!off_this_machine(&[at("/ip4/127.0.0.1/tcp/4001")]));
        assert!(!off_this_machine(&[
            at("/ip4/10.0.0.2/tcp/4001"),
            at("/ip6/::1/tcp/4001")
        ]));
        assert!(
            !off_this_machine(&[]),
            "nothing known of a member says nothing"
        );
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
        let got = hop_members(&[3, 1, 4], &rows, peers[1], 2, 3).unwrap();
        assert_eq!(got, [(3, peers[3]), (4, peers[4]), (0, peers[0])]);
        // Spares are taken where there are rows for them, and left out where there are none.
        let all = hop_members(&[3, 1, 4], &rows, peers[1], 3, 9).unwrap();
        assert_eq!(all.len(), 4);
        let err = hop_members(&[3, 1, 4], &rows, peers[1], 5, 6).unwrap_err();
        assert!(
            err.contains("needs 5 members") && err.contains("4 rows"),
            "{err}"
        );
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
