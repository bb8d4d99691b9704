//! The serving batch's passes one hop per stage ([`node_core::net::hop`]): chosen where the
//! group's members are remote, or where its rounds measure slow on the network; the batch's
//! sequences then live on the members, and start again there whenever the hop group changes.

use node_core::net::hop::HopLeader;

use super::*;
use crate::lead::hop::NetFeedLink;

/// How a leader runs a forward pass.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum PassRoute {
    /// One hop per stage where a member is on another machine (its session runs over libp2p
    /// and it was reached at no loopback address) or the rounds wait on the network more than
    /// [`HOP_OVER`] a round; the leader's rounds otherwise.
    #[default]
    Auto,
    /// The leader decodes every stage (two one-way delays a round).
    Rounds,
    /// One hop per stage: the members pass their coded outputs to each other.
    Hop,
}

/// Network time a round (its wait beyond the slowest member's compute) above which one hop
/// per stage is faster: at 0 ms a hop pass costs 78 ms a token against rounds' 34, and each
/// round trip saved is worth half its time (docs/perf.md, "The delay bench"), so hops win
/// past about 0.7 ms a round on the 2-core machine.
pub const HOP_OVER: Duration = Duration::from_millis(1);

/// Rounds measured before the network time a round is trusted (a token's worth or so).
const PROBE_ROUNDS: u64 = 128;

/// How long an automatic choice keeps to rounds after a hop group failed.
const HOP_RETRY: Duration = Duration::from_secs(60);

/// A serving group's hop side: the hop group while it runs, and what chose it.
#[derive(Debug, Default)]
pub(super) struct HopSide {
    /// The hop group, while passes run on it.
    pub(super) leader: Option<HopLeader<NetFeedLink>>,
    /// Changes whenever the sequences' keys and values move (a hop group formed or let go):
    /// a sequence started at another epoch starts again.
    pub(super) epoch: u64,
    /// The rounds measured since the rounds group formed, and the network time they waited.
    rounds: u64,
    network: Duration,
    /// The rounds group's members' compute so far (its transport counts it from the start).
    computed: Duration,
    /// When a hop group last failed.
    failed: Option<Instant>,
}

impl HopSide {
    /// Counts a step's rounds: their number and the time spent waiting for members, with the
    /// rounds group's slowest members' compute so far (what the step added to it was not
    /// network).
    pub(super) fn measured(&mut self, rounds: u64, waited: Duration, computed: Duration) {
        let step = computed.saturating_sub(self.computed);
        self.computed = computed;
        self.rounds += rounds;
        self.network += waited.saturating_sub(step);
    }

    /// The network time a round, once enough rounds were measured.
    pub(super) fn network_per_round(&self) -> Option<Duration> {
        (self.rounds >= PROBE_ROUNDS).then(|| self.network / self.rounds as u32)
    }

    /// Forgets what was measured (the rounds group formed again).
    pub(super) fn forget_measures(&mut self) {
        self.rounds = 0;
        self.network = Duration::ZERO;
        self.computed = Duration::ZERO;
    }

    /// Lets the hop group go: the sequences start again wherever they run next.
    pub(super) fn drop_group(&mut self) {
        if self.leader.take().is_some() {
            self.epoch += 1;
        }
    }
}

/// Whether a member is on another machine: every address it was reached at is off this one.
fn remote(addrs: &[libp2p::Multiaddr]) -> bool {
    use libp2p::multiaddr::Protocol;
    !addrs.is_empty()
        && addrs.iter().all(|a| {
            !a.iter().any(|p| match p {
                Protocol::Ip4(ip) => ip.is_loopback(),
                Protocol::Ip6(ip) => ip.is_loopback(),
                _ => false,
            })
        })
}

impl Lead {
    /// Whether this serving group's next pass goes one hop per stage.
    pub(super) fn wants_hop(&self) -> bool {
        let Some(f) = self.formed.as_ref() else {
            return false;
        };
        if self.slot.is_none() {
            return false; // the trainer's backward rounds need the leader
        }
        match self.ctx.cfg.pass {
            PassRoute::Rounds => false,
            PassRoute::Hop => true,
            PassRoute::Auto => {
                if self.hop.failed.is_some_and(|at| at.elapsed() < HOP_RETRY) {
                    return false;
                }
                // Off this machine: its session is not on a local socket, and it was reached at
                // no address of this machine.
                let far = f
                    .group
                    .transport()
                    .over_libp2p()
                    .iter()
                    .any(|p| f.addrs.get(p).is_some_and(|a| remote(a)));
                far || self.hop.network_per_round().is_some_and(|n| n > HOP_OVER)
            }
        }
    }

    /// The hop group, formed now over the rounds group's members other than this node (k and
    /// the checked ones); why not when there are too few.
    pub(super) fn hop_group(&mut self) -> Result<&mut HopLeader<NetFeedLink>, String> {
        if self.hop.leader.is_none() {
            let f = self.formed.as_ref().ok_or("no group")?;
            let me = self.ctx.client.peer_id();
            let k = self.ctx.manifest.generator.k();
            let want = k + self.ctx.cfg.verify;
            // The group's own members first (the best conditioned), then the other rows.
            let mut rows: Vec<usize> = f.group.nodes().to_vec();
            rows.extend(
                f.rows
                    .keys()
                    .filter(|r| !rows.contains(r))
                    .copied()
                    .collect::<Vec<_>>(),
            );
            let members: Vec<(usize, PeerId, Vec<libp2p::Multiaddr>)> = rows
                .into_iter()
                .filter_map(|row| {
                    let peer = *f.rows.get(&row)?;
                    (peer != me)
                        .then(|| (row, peer, f.addrs.get(&peer).cloned().unwrap_or_default()))
                })
                .take(want)
                .collect();
            if members.len() < want {
                return Err(format!(
                    "a hop group needs {want} members besides this node (k = {k} and {} checked), {} have a row at the version",
                    self.ctx.cfg.verify,
                    members.len()
                ));
            }
            let leader = crate::lead::hop::lead(
                &self.ctx.runtime,
                &self.ctx.client,
                self.ctx.manifest.cfg.clone(),
                self.ctx.manifest.generator.clone(),
                f.version,
                &members,
                crate::lead::hop::WAIT,
            )
            .map_err(|e| format!("{e:#}"))?;
            tracing::info!(
                rows = ?leader.rows(),
                network_per_round_us = self.hop.network_per_round().map(|d| d.as_micros() as u64),
                "passes go one hop per stage"
            );
            self.hop.leader = Some(leader);
            self.hop.epoch += 1;
        }
        self.hop
            .leader
            .as_mut()
            .ok_or_else(|| "no hop group".into())
    }

    /// A hop pass failed: the hop group goes, and an automatic choice keeps to rounds a while.
    pub(super) fn hop_failed(&mut self) {
        self.hop.drop_group();
        self.hop.failed = Some(Instant::now());
    }

    /// Counts what the hop group's rounds did since the last call, and reports members it
    /// caught.
    pub(super) async fn after_hop(&mut self) {
        let Some(leader) = self.hop.leader.as_mut() else {
            return;
        };
        let s = leader.stats().clone();
        leader.reset_stats();
        let none = std::collections::BTreeMap::new();
        let (rows, holders) = self
            .formed
            .as_ref()
            .map_or((&none, &[][..]), |f| (&f.rows, &f.holders[..]));
        self.ctx.count_rounds(s, rows, holders).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_member_reached_only_off_this_machine_is_remote() {
        let at = |s: &str| s.parse::<libp2p::Multiaddr>().unwrap();
        assert!(remote(&[at("/ip4/10.0.0.2/tcp/4001")]));
        assert!(!remote(&[at("/ip4/127.0.0.1/tcp/4001")]));
        assert!(!remote(&[
            at("/ip4/10.0.0.2/tcp/4001"),
            at("/ip6/::1/tcp/4001")
        ]));
        assert!(!remote(&[]), "nothing known of a member says nothing");
    }

    #[test]
    fn the_network_time_a_round_counts_once_enough_rounds_were_measured() {
        let mut side = HopSide::default();
        side.measured(100, Duration::from_millis(300), Duration::from_millis(100));
        assert_eq!(side.network_per_round(), None);
        // The transport's compute is a running total: 100 ms more in this step.
        side.measured(100, Duration::from_millis(300), Duration::from_millis(200));
        assert_eq!(side.network_per_round(), Some(Duration::from_millis(2)));
        side.forget_measures();
        assert_eq!(side.network_per_round(), None);
    }
}
