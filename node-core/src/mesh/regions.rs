//! Regions: nodes within a short round trip of each other, found from the network coordinates
//! ([`super::coords`]). A region holding k distinct rows serves without crossing an ocean, so a
//! joiner is offered a row its region lacks ([`super::MeshView::offer_row_near`]), and the
//! dashboard shows which regions can serve alone.

use serde::{Deserialize, Serialize};
use web_time::Duration;

use super::coords::{Coord, Vivaldi};
use super::{Health, MeshInfo};

/// Round trip (ms) within which two nodes are in one region: a continent, not an ocean.
pub const NEAR_MS: f32 = 25.0;

/// Most round trips a joiner measures and sends with its request to join.
pub const MAX_SAMPLES: usize = 8;

/// Passes over a joiner's samples that place it (each moves it at most a quarter of a round
/// trip, so a few dozen settle it among a handful of peers).
const PLACE_PASSES: usize = 48;

/// A joiner's place, fitted to the round trips it measured to nodes whose coordinates are
/// known (`(their coordinate, round trip)`); `None` when none of theirs is placed.
pub fn place(samples: &[(Coord, Duration)]) -> Option<Coord> {
    let known: Vec<&(Coord, Duration)> = samples
        .iter()
        .filter(|(c, _)| c.is_placed() && c.check().is_ok())
        .take(MAX_SAMPLES)
        .collect();
    if known.is_empty() {
        return None;
    }
    let mut v = Vivaldi::new(known.len() as u64);
    for _ in 0..PLACE_PASSES {
        for (i, (theirs, rtt)) in known.iter().enumerate() {
            // Checked above; a refused sample moves nothing.
            let _ = v.observe(&i, theirs, *rtt);
        }
    }
    Some(v.coord())
}

/// Whether a node at `a` and one at `b` are in one region (both placed).
pub fn near(a: &Coord, b: &Coord) -> bool {
    a.is_placed() && b.is_placed() && a.rtt_ms(b) <= NEAR_MS
}

/// One region: nodes each within [`NEAR_MS`] of another in it, and the rows they hold.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Region {
    /// Its nodes' peer ids.
    pub nodes: Vec<String>,
    /// The distinct rows its healthy nodes hold, ascending.
    pub rows: Vec<u32>,
    /// Whether those are at least k: a group forms within it.
    pub alone: bool,
}

impl MeshInfo {
    /// The regions of the placed nodes (healthy and not caught), largest first: a node joins
    /// the region of any node within [`NEAR_MS`] of it (single linkage), by the coordinates,
    /// or by the round trip the answering node measured where one of the two is that node.
    pub fn regions(&self) -> Vec<Region> {
        let nodes: Vec<_> = (self.nodes.iter())
            .filter(|n| n.health == Health::Healthy && n.caught.is_none() && n.coord.is_placed())
            .take(super::coords::MAX_TRACKED)
            .collect();
        // The answering node's round trips are its own (0 to itself).
        let me = |n: &super::NodeStatus| n.rtt_ms == Some(0.0);
        let close = |a: &super::NodeStatus, b: &super::NodeStatus| match (me(a), me(b)) {
            (true, false) => b
                .rtt_ms
                .map_or(near(&a.coord, &b.coord), |ms| ms <= NEAR_MS),
            (false, true) => a
                .rtt_ms
                .map_or(near(&a.coord, &b.coord), |ms| ms <= NEAR_MS),
            _ => near(&a.coord, &b.coord),
        };
        let mut region: Vec<usize> = (0..nodes.len()).collect();
        // Union-find by relabelling: a few thousand nodes at most.
        for i in 0..nodes.len() {
            for j in i + 1..nodes.len() {
                if region[i] != region[j] && close(nodes[i], nodes[j]) {
                    let (from, to) = (region[j], region[i]);
                    region
                        .iter_mut()
                        .filter(|r| **r == from)
                        .for_each(|r| *r = to);
                }
            }
        }
        let mut out: std::collections::BTreeMap<usize, Region> = Default::default();
        for (n, r) in nodes.iter().zip(&region) {
            let entry = out.entry(*r).or_insert_with(|| Region {
                nodes: Vec::new(),
                rows: Vec::new(),
                alone: false,
            });
            entry.nodes.push(n.peer.clone());
            if let Some(row) = n.row.filter(|r| !entry.rows.contains(r)) {
                entry.rows.push(row);
            }
        }
        let mut out: Vec<Region> = out.into_values().collect();
        for r in &mut out {
            r.rows.sort_unstable();
            r.alone = r.rows.len() >= self.k as usize;
        }
        out.sort_by(|a, b| {
            b.nodes
                .len()
                .cmp(&a.nodes.len())
                .then(a.nodes.cmp(&b.nodes))
        });
        out
    }

    /// The regions in a line a person reads: "regions (within 25 ms): 2, 1 can serve alone —
    /// 6 nodes with rows 0 1 2 3 (alone); 3 nodes with rows 1 2".
    pub fn regions_line(&self) -> String {
        let regions = self.regions();
        let alone = regions.iter().filter(|r| r.alone).count();
        let each: Vec<String> = (regions.iter())
            .map(|r| {
                let rows: Vec<String> = r.rows.iter().map(u32::to_string).collect();
                format!(
                    "{} node{} with rows {}{}",
                    r.nodes.len(),
                    if r.nodes.len() == 1 { "" } else { "s" },
                    if rows.is_empty() {
                        "none".into()
                    } else {
                        rows.join(" ")
                    },
                    if r.alone { " (alone)" } else { "" }
                )
            })
            .collect();
        let placed: usize = regions.iter().map(|r| r.nodes.len()).sum();
        let unplaced = self.nodes.len().saturating_sub(placed);
        format!(
            "regions (within {NEAR_MS} ms): {}, {alone} can serve alone{}{}{}",
            regions.len(),
            if each.is_empty() { "" } else { " — " },
            each.join("; "),
            match unplaced {
                0 => String::new(),
                n => format!(
                    "; {n} node{} not placed or not healthy",
                    if n == 1 { "" } else { "s" }
                ),
            }
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(x: f32) -> Coord {
        Coord::placed_at(x)
    }

    fn ms(v: f32) -> Duration {
        Duration::from_secs_f64(f64::from(v) / 1000.0)
    }

    #[test]
    fn a_joiner_is_placed_near_the_nodes_it_measured_near() {
        // Two regions 100 ms apart; the joiner measured 3 ms to two of eu, 100 to two of us.
        let (eu, us) = ([at(0.0), at(2.0)], [at(100.0), at(102.0)]);
        let samples = [
            (eu[0], ms(3.0)),
            (eu[1], ms(3.0)),
            (us[0], ms(100.0)),
            (us[1], ms(100.0)),
        ];
        let c = place(&samples).expect("placed");
        assert!(near(&c, &eu[0]) && near(&c, &eu[1]), "{c:?}");
        assert!(!near(&c, &us[0]) && !near(&c, &us[1]), "{c:?}");
        // Measured near us instead, it lands there.
        let samples = samples.map(|(theirs, _)| {
            let d = (theirs.vec[0] - 101.0).abs() + 2.0;
            (theirs, ms(d))
        });
        let c = place(&samples).expect("placed");
        assert!(near(&c, &us[0]) && !near(&c, &eu[0]), "{c:?}");
    }

    #[test]
    fn nothing_placed_places_no_joiner_and_a_bad_claim_is_ignored() {
        assert_eq!(place(&[(Coord::ORIGIN, ms(5.0))]), None);
        let mut bad = at(0.0);
        bad.vec[1] = f32::NAN;
        assert_eq!(place(&[(bad, ms(5.0))]), None);
    }
}
