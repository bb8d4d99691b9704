//! Network coordinates: every node places itself in a small latency space (Vivaldi, with a
//! height for its access link, as Serf and Consul do) from the round trips it measures anyway,
//! and carries its place in its heartbeats, so any node can estimate the round trip between any
//! two without measuring it. A leader uses it to form its group from near holders.
//!
//! Written here rather than taken from a crate: a peer's coordinate is a claim from the
//! network, so every field must be checked and what one sample may move a coordinate bounded
//! (the crates found keep their fields private and draw from the OS's generator); the
//! algorithm is a few dozen lines (Dabek et al., SIGCOMM 2004; heights and the latency filter
//! as in Ledlie et al., NSDI 2007).

use std::collections::{BTreeMap, VecDeque};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use web_time::Duration;

/// Dimensions of the Euclidean part of a coordinate (the height is one more).
pub const DIMS: usize = 4;

/// Most milliseconds any component or height of a coordinate may be: no node is a minute away.
pub const MAX_COORD_MS: f32 = 60_000.0;

/// Least height (milliseconds): every node is a little way from the core.
pub const MIN_HEIGHT_MS: f32 = 0.01;

/// Error of a coordinate that knows nothing yet (relative error, the most it may claim).
pub const MAX_ERROR: f32 = 1.5;

/// Least error a coordinate may claim (a peer claiming certainty would pull hardest).
pub const MIN_ERROR: f32 = 0.01;

/// How fast a node's error estimate follows its samples (`c_e`).
const CE: f32 = 0.25;

/// How far a node moves towards a sample's answer (`c_c`); also the most one sample may move it,
/// as a share of the round trip measured or of [`MIN_REACH_MS`], the larger.
const CC: f32 = 0.25;

/// The round trip below which a sample may still move a node a quarter of this (near nodes
/// would otherwise come together a fraction of a millisecond a sample).
const MIN_REACH_MS: f32 = 10.0;

/// Samples of one peer whose median is taken (one slow answer does not move a node).
const FILTER: usize = 3;

/// Most peers whose recent samples a node keeps.
pub const MAX_TRACKED: usize = 4096;

/// A node's place in the latency space, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Coord {
    /// The Euclidean part.
    pub vec: [f32; DIMS],
    /// The node's distance from the core (its access link).
    pub height: f32,
    /// Its own estimate of its relative error (0 exact, [`MAX_ERROR`] nothing known).
    pub error: f32,
}

#[cfg(test)]
impl Coord {
    /// A placed coordinate at `x` ms along the first axis, for tests.
    pub(crate) fn placed_at(x: f32) -> Self {
        let mut vec = [0.0; DIMS];
        vec[0] = x;
        Self {
            vec,
            height: 0.5,
            error: 0.1,
        }
    }
}

impl Default for Coord {
    fn default() -> Self {
        Self::ORIGIN
    }
}

impl Coord {
    /// Where a node starts: the origin, knowing nothing.
    pub const ORIGIN: Coord = Coord {
        vec: [0.0; DIMS],
        height: MIN_HEIGHT_MS,
        error: MAX_ERROR,
    };

    /// Whether a coordinate a peer sent is one a node could hold: finite, within
    /// [`MAX_COORD_MS`], a height and an error in their ranges.
    pub fn check(&self) -> Result<(), String> {
        if let Some(v) = self
            .vec
            .iter()
            .find(|v| !(v.is_finite() && v.abs() <= MAX_COORD_MS))
        {
            return Err(format!(
                "a coordinate component {v} outside ±{MAX_COORD_MS} ms"
            ));
        }
        if !(MIN_HEIGHT_MS..=MAX_COORD_MS).contains(&self.height) {
            return Err(format!(
                "a coordinate height {} ms out of range",
                self.height
            ));
        }
        if !(MIN_ERROR..=MAX_ERROR).contains(&self.error) {
            return Err(format!("a coordinate error {} out of range", self.error));
        }
        Ok(())
    }

    /// Whether it was ever moved by a sample.
    pub fn is_placed(&self) -> bool {
        self.error < MAX_ERROR
    }

    /// The round trip to `other` it predicts, in milliseconds.
    pub fn rtt_ms(&self, other: &Coord) -> f32 {
        norm(&sub(&self.vec, &other.vec)) + self.height + other.height
    }

    /// The round trip to `other` it predicts.
    pub fn rtt(&self, other: &Coord) -> Duration {
        Duration::from_secs_f64(f64::from(self.rtt_ms(other)) / 1000.0)
    }
}

fn sub(a: &[f32; DIMS], b: &[f32; DIMS]) -> [f32; DIMS] {
    std::array::from_fn(|i| a[i] - b[i])
}

fn norm(a: &[f32; DIMS]) -> f32 {
    a.iter().map(|x| x * x).sum::<f32>().sqrt()
}

/// One node's coordinate, moved by the round trips it measures.
#[derive(Debug, Clone)]
pub struct Vivaldi<P> {
    own: Coord,
    /// Recent round trips to each peer (ms), oldest first; a peer not heard from longest is
    /// forgotten first when [`MAX_TRACKED`] are kept.
    samples: BTreeMap<P, (u64, VecDeque<f32>)>,
    /// Samples taken, the clock of `samples`.
    taken: u64,
    /// Directions for two nodes at one place.
    rng: ChaCha8Rng,
}

impl<P: Ord + Clone> Vivaldi<P> {
    /// A node at the origin; `seed` draws the direction it moves in away from a node at its
    /// own place.
    pub fn new(seed: u64) -> Self {
        Self {
            own: Coord::ORIGIN,
            samples: BTreeMap::new(),
            taken: 0,
            rng: ChaCha8Rng::seed_from_u64(seed),
        }
    }

    /// The node's coordinate now.
    pub fn coord(&self) -> Coord {
        self.own
    }

    /// Peers whose samples are kept.
    pub fn tracked(&self) -> usize {
        self.samples.len()
    }

    /// Takes one round trip `rtt` measured to `peer`, which claims the coordinate `theirs`:
    /// moves this node so that its predicted round trip to `theirs` nears the median of the
    /// last few measured, by at most a quarter of that round trip (or of 10 ms). A coordinate
    /// that fails [`Coord::check`] is refused and moves nothing.
    pub fn observe(&mut self, peer: &P, theirs: &Coord, rtt: Duration) -> Result<(), String> {
        theirs.check()?;
        let ms = (rtt.as_secs_f64() * 1000.0) as f32;
        if !(ms.is_finite() && ms <= MAX_COORD_MS) {
            return Err(format!("a round trip of {rtt:?}"));
        }
        let rtt_ms = self.filtered(peer, ms.max(MIN_HEIGHT_MS));
        let dist = self.own.rtt_ms(theirs);
        let weight = self.own.error / (self.own.error + theirs.error);
        let wrongness = (dist - rtt_ms).abs() / rtt_ms;
        self.own.error = (CE * weight * wrongness + self.own.error * (1.0 - CE * weight))
            .clamp(MIN_ERROR, MAX_ERROR);
        let limit = CC * rtt_ms.max(MIN_REACH_MS);
        let force = (CC * weight * (rtt_ms - dist)).clamp(-limit, limit);
        let apart = sub(&self.own.vec, &theirs.vec);
        let mag = norm(&apart);
        let unit: [f32; DIMS] = if mag > 1e-3 {
            std::array::from_fn(|i| apart[i] / mag)
        } else {
            let r: [f32; DIMS] = std::array::from_fn(|_| self.rng.random_range(-1.0..1.0));
            let n = norm(&r).max(1e-6);
            std::array::from_fn(|i| r[i] / n)
        };
        for (v, u) in self.own.vec.iter_mut().zip(unit) {
            *v = (*v + u * force).clamp(-MAX_COORD_MS, MAX_COORD_MS);
        }
        if mag > 1e-3 {
            let h = self.own.height + (self.own.height + theirs.height) * force / mag;
            self.own.height = h.clamp(MIN_HEIGHT_MS, MAX_COORD_MS);
        }
        Ok(())
    }

    /// Keeps `ms` as `peer`'s newest sample; the median of its recent ones.
    fn filtered(&mut self, peer: &P, ms: f32) -> f32 {
        self.taken += 1;
        if !self.samples.contains_key(peer) && self.samples.len() >= MAX_TRACKED {
            let oldest = (self.samples.iter())
                .min_by_key(|(_, (at, _))| *at)
                .map(|(p, _)| p.clone());
            if let Some(p) = oldest {
                self.samples.remove(&p);
            }
        }
        let (at, recent) = self.samples.entry(peer.clone()).or_default();
        *at = self.taken;
        if recent.len() == FILTER {
            recent.pop_front();
        }
        recent.push_back(ms);
        self.measured_ms(peer).unwrap_or(ms)
    }

    /// The median of the round trips lately measured to `peer`, in milliseconds.
    pub fn measured_ms(&self, peer: &P) -> Option<f32> {
        let (_, recent) = self.samples.get(peer)?;
        let mut sorted: Vec<f32> = recent.iter().copied().collect();
        sorted.sort_by(f32::total_cmp);
        sorted.get(sorted.len() / 2).copied()
    }

    /// Forgets `peer`'s samples (it left).
    pub fn forget(&mut self, peer: &P) {
        self.samples.remove(peer);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

    use super::*;

    /// Three sites, five nodes each: 1 ms within a site (access links of 0.5 ms each), 40,
    /// 90 and 110 ms between them.
    fn world() -> (Vec<usize>, impl Fn(usize, usize) -> f32) {
        let site: Vec<usize> = (0..15).map(|i| i / 5).collect();
        let between = [[0.0, 40.0, 90.0], [40.0, 0.0, 110.0], [90.0, 110.0, 0.0]];
        let s = site.clone();
        (site, move |a, b| 1.0 + between[s[a]][s[b]])
    }

    /// Every node measures a random peer each tick, for `ticks` ticks.
    fn settle(
        ticks: usize,
    ) -> (
        Vec<Vivaldi<usize>>,
        Vec<usize>,
        impl Fn(usize, usize) -> f32,
    ) {
        let (site, rtt) = world();
        let mut nodes: Vec<Vivaldi<usize>> = (0..15).map(|i| Vivaldi::new(i as u64)).collect();
        let mut rng = ChaCha8Rng::seed_from_u64(80);
        for _ in 0..ticks {
            for i in 0..nodes.len() {
                let j = (i + rng.random_range(1..nodes.len())) % nodes.len();
                let theirs = nodes[j].coord();
                let d = Duration::from_secs_f64(f64::from(rtt(i, j)) / 1000.0);
                nodes[i].observe(&j, &theirs, d).unwrap();
            }
        }
        (nodes, site, rtt)
    }

    #[test]
    fn coordinates_settle_to_the_round_trips_of_a_world_of_three_sites() {
        let (nodes, site, rtt) = settle(200);
        let mut errors = Vec::new();
        for i in 0..15 {
            for j in (0..15).filter(|&j| j != i) {
                let est = nodes[i].coord().rtt_ms(&nodes[j].coord());
                errors.push((est - rtt(i, j)).abs() / rtt(i, j).max(10.0));
            }
            // Its four nearest by the coordinates are its own site's.
            let mut by_est: Vec<usize> = (0..15).filter(|&j| j != i).collect();
            by_est.sort_by(|&a, &b| {
                let c = nodes[i].coord();
                c.rtt_ms(&nodes[a].coord())
                    .total_cmp(&c.rtt_ms(&nodes[b].coord()))
            });
            assert!(
                by_est[..4].iter().all(|&j| site[j] == site[i]),
                "node {i} (site {}) thinks {by_est:?} nearest",
                site[i]
            );
            assert!(nodes[i].coord().is_placed());
        }
        errors.sort_by(f32::total_cmp);
        let median = errors[errors.len() / 2];
        let worst = errors[errors.len() - 1];
        assert!(
            median < 0.05 && worst < 0.2,
            "relative error: median {median}, worst {worst}"
        );
    }

    #[test]
    fn a_peer_s_claim_is_checked_and_one_sample_moves_a_node_a_quarter_of_its_round_trip_at_most() {
        let (mut nodes, _, _) = settle(100);
        let me = &mut nodes[0];
        let before = me.coord();
        for bad in [
            Coord {
                vec: [f32::NAN, 0.0, 0.0, 0.0],
                ..Coord::ORIGIN
            },
            Coord {
                vec: [1e9, 0.0, 0.0, 0.0],
                ..Coord::ORIGIN
            },
            Coord {
                height: -1.0,
                ..Coord::ORIGIN
            },
            Coord {
                error: 0.0,
                ..Coord::ORIGIN
            },
        ] {
            assert!(me.observe(&99, &bad, Duration::from_millis(20)).is_err());
            assert_eq!(me.coord(), before, "a refused claim moved nothing");
        }
        assert!(
            me.observe(&99, &Coord::ORIGIN, Duration::from_secs(3600))
                .is_err()
        );
        // A liar claiming to be at the far edge, certain of it, 20 ms away.
        let far = Coord {
            vec: [MAX_COORD_MS; DIMS],
            height: MAX_COORD_MS,
            error: MIN_ERROR,
        };
        me.observe(&99, &far, Duration::from_millis(20)).unwrap();
        let after = me.coord();
        let moved = norm(&sub(&after.vec, &before.vec));
        assert!(moved <= CC * 20.0 + 1e-3, "moved {moved} ms");
        after.check().unwrap();
    }

    #[test]
    fn a_node_keeps_the_samples_of_a_bounded_number_of_peers() {
        let mut v = Vivaldi::new(1);
        for p in 0..MAX_TRACKED + 50 {
            v.observe(&p, &Coord::ORIGIN, Duration::from_millis(10))
                .unwrap();
        }
        assert_eq!(v.tracked(), MAX_TRACKED);
        v.forget(&(MAX_TRACKED + 49));
        assert_eq!(v.tracked(), MAX_TRACKED - 1);
    }

    #[test]
    fn one_slow_answer_does_not_move_a_node_the_median_holds() {
        let (mut nodes, _, rtt) = settle(100);
        let theirs = nodes[5].coord();
        let me = &mut nodes[0];
        let usual = Duration::from_secs_f64(f64::from(rtt(0, 5)) / 1000.0);
        me.observe(&5, &theirs, usual).unwrap();
        me.observe(&5, &theirs, usual).unwrap();
        let before = me.coord().rtt_ms(&theirs);
        me.observe(&5, &theirs, Duration::from_secs(2)).unwrap();
        let after = me.coord().rtt_ms(&theirs);
        assert!(
            (after - before).abs() < 0.3 * rtt(0, 5),
            "one slow answer moved the estimate {before} → {after}"
        );
    }
}
