//! Distance in a leader's choices: the round trips its view knows, and whether a much closer
//! group than its own could be formed now.

use std::collections::{BTreeMap, BTreeSet};
use std::str::FromStr;

use libp2p::PeerId;

use super::route::{hop_cost, hop_members};
use crate::code::Generator;
use crate::mesh::{Coord, HoldersByRow, MeshInfo, much_closer, pick_nearest, plan_group_near};

/// A row of a much closer group than the one computing with `rows` (each row's holder): the
/// group [`super::form`] would pick from `info` now (each row's nearest holder outside `avoid`, the
/// nearest rows that decode well, `extra` beyond k) when its slowest member is
/// [`much_closer`] than the group's own (its k + `extra`-th nearest: a round asks every member
/// and waits for that many, so spares a straggler brought in do not slow it); `None` when no
/// such group, or while a member's round trip is not known. `own` is the leader's own row's
/// holder (at 0). `P` names peers as the view does (a [`libp2p::PeerId`]; a simulation's
/// numbers).
pub fn closer_row<P: Ord + Clone + FromStr>(
    info: &MeshInfo,
    g: &Generator,
    rows: &BTreeMap<usize, P>,
    extra: usize,
    avoid: &BTreeSet<P>,
    own: Option<P>,
) -> Option<usize> {
    let (_, live) = info.live_holders()?;
    let rtt = round_trips(info, own);
    let now = answered_by(rows.values().map(|p| rtt.get(p).copied()), g.k() + extra)?;
    // The holders a fresh group could take: known round trips, free or the group's own.
    let mut known = free_holders(&live, rows, avoid);
    known
        .values_mut()
        .for_each(|peers| peers.retain(|p| rtt.contains_key(p)));
    let nearest = pick_nearest(&known, &BTreeSet::new(), |p| rtt.get(p).copied());
    let rtt_of = |r: usize| nearest.get(&r).and_then(|p| rtt.get(p)).copied();
    let candidates: Vec<usize> = nearest.keys().copied().collect();
    let plan = plan_group_near(g, &candidates, extra, rtt_of).ok()?;
    let fresh = answered_by(plan.members.iter().map(|&r| rtt_of(r)), g.k() + extra)?;
    let changed = |r: &&usize| rows.get(*r) != nearest.get(*r);
    much_closer(now, fresh).then(|| {
        *plan
            .members
            .iter()
            .find(changed)
            .unwrap_or(&plan.members[0])
    })
}

/// Where `info` places each node (placed coordinates only).
pub fn places_of(info: &MeshInfo) -> BTreeMap<PeerId, Coord> {
    (info.nodes.iter())
        .filter(|n| n.coord.is_placed())
        .filter_map(|n| Some((n.peer.parse().ok()?, n.coord)))
        .collect()
}

/// A row of a much closer hop group than `members` (each row's holder now, led by `me`): the
/// one [`hop_members`] would take from `info` now over the same rows, each from its holders at
/// the view's version outside `avoid` (the members' own kept), when its cost ([`hop_cost`]) is
/// [`much_closer`] than the group's; `None` when none is, or while a member is not placed.
pub fn closer_hop_row(
    info: &MeshInfo,
    members: &[(usize, PeerId)],
    avoid: &BTreeSet<PeerId>,
    me: PeerId,
) -> Option<usize> {
    let places = places_of(info);
    let now = hop_cost(members, &places, me);
    if !now.is_finite() {
        return None;
    }
    let (_, live) = info.live_holders()?;
    let rows: BTreeMap<usize, PeerId> = members.iter().copied().collect();
    let others = free_holders(&live, &rows, avoid);
    let nodes: Vec<usize> = members.iter().map(|&(r, _)| r).collect();
    let n = members.len();
    let fresh = hop_members(&nodes, &rows, &others, &places, me, n, n).ok()?;
    much_closer(now, hop_cost(&fresh, &places, me)).then(|| {
        let changed = fresh.iter().find(|m| !members.contains(m));
        changed.map_or(nodes[0], |&(r, _)| r)
    })
}

/// Each row's holders in `live` a group holding `rows` could take: outside `avoid`, or its own.
fn free_holders<P: Ord + FromStr>(
    live: &HoldersByRow<'_>,
    rows: &BTreeMap<usize, P>,
    avoid: &BTreeSet<P>,
) -> BTreeMap<usize, Vec<P>> {
    let free = |p: &P| !avoid.contains(p) || rows.values().any(|m| m == p);
    (live.iter())
        .map(|(&row, holders)| {
            let peers = holders.iter().filter_map(|n| n.peer.parse().ok());
            (row, peers.filter(free).collect())
        })
        .collect()
}

/// The `wanted`-th smallest of round trips (the largest where fewer): when a round that asks
/// them all has its `wanted` answers. `None` if one is not known.
fn answered_by(ms: impl Iterator<Item = Option<f32>>, wanted: usize) -> Option<f32> {
    let mut ms = ms.collect::<Option<Vec<f32>>>()?;
    ms.sort_by(f32::total_cmp);
    ms.get(wanted.clamp(1, ms.len().max(1)) - 1).copied()
}

/// The round trip to each node `info` shows, in milliseconds, as the view that answered
/// `info` measured or estimated it: the leader's own for `up`'s API, its bootstrap's for a page
/// or `generate` (a proxy: such a leader is usually near the node it joined by); the leader's
/// own row's holder, `own`, is at 0.
pub(super) fn round_trips<P: Ord + FromStr>(info: &MeshInfo, own: Option<P>) -> BTreeMap<P, f32> {
    let mut rtt: BTreeMap<P, f32> = (info.nodes.iter())
        .filter_map(|n| Some((n.peer.parse().ok()?, n.rtt_ms.filter(|ms| ms.is_finite())?)))
        .collect();
    rtt.extend(own.map(|p| (p, 0.0)));
    rtt
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

    use super::*;
    use crate::lead::tests::view;

    #[test]
    fn a_hop_group_spread_over_two_regions_is_told_a_row_of_one_within_one() {
        let g = 4;
        let eu: Vec<PeerId> = (0..g).map(|_| PeerId::random()).collect();
        let us: Vec<PeerId> = (0..g).map(|_| PeerId::random()).collect();
        let me = PeerId::random();
        let pairs: Vec<(PeerId, u32)> = (0..g)
            .flat_map(|r| [(eu[r], r as u32), (us[r], r as u32)])
            .collect();
        let mut info = view(&pairs);
        for n in &mut info.nodes {
            let p: PeerId = n.peer.parse().unwrap();
            n.coord = Coord::placed_at(if eu.contains(&p) { 0.0 } else { 50.0 });
        }
        let none = BTreeSet::new();
        let mixed = [(0, eu[0]), (1, us[1]), (2, eu[2])];
        let row = closer_hop_row(&info, &mixed, &none, me);
        assert_eq!(
            row,
            Some(1),
            "eu's holder of row 1 puts the three within one region"
        );
        let near = [(0, eu[0]), (1, eu[1]), (2, eu[2])];
        assert_eq!(closer_hop_row(&info, &near, &none, me), None);
        // eu's holder of row 1 and us's of row 0 compute for other groups: nothing closer.
        let busy: BTreeSet<PeerId> = [eu[1], us[0]].into();
        assert_eq!(closer_hop_row(&info, &mixed, &busy, me), None);
        // A member not placed yet: no judgement.
        for n in info
            .nodes
            .iter_mut()
            .filter(|n| n.peer == us[1].to_string())
        {
            n.coord = Coord::default();
        }
        assert_eq!(closer_hop_row(&info, &mixed, &none, me), None);
    }

    #[test]
    fn a_group_far_from_its_leader_is_told_a_row_of_a_much_closer_one() {
        let g = Generator::cauchy(4, 2).unwrap();
        let far: Vec<PeerId> = (0..4).map(|_| PeerId::random()).collect();
        let near: Vec<PeerId> = (0..4).map(|_| PeerId::random()).collect();
        let pairs: Vec<(PeerId, u32)> = (0..4)
            .flat_map(|r| [(far[r as usize], r), (near[r as usize], r)])
            .collect();
        let mut info = view(&pairs);
        for n in &mut info.nodes {
            let p: PeerId = n.peer.parse().unwrap();
            n.rtt_ms = Some(if far.contains(&p) { 120.0 } else { 3.0 });
        }
        let none = BTreeSet::new();
        let group = |peers: &[PeerId]| -> BTreeMap<usize, PeerId> {
            [(0, peers[0]), (1, peers[1]), (2, peers[2])].into()
        };
        let row = closer_row(&info, &g, &group(&far), 1, &none, None);
        assert!(
            row.is_some(),
            "three members 120 ms away, holders 3 ms away"
        );
        assert_eq!(closer_row(&info, &g, &group(&near), 1, &none, None), None);
        // The near holders taken by other groups: nothing closer.
        let busy: BTreeSet<PeerId> = near.iter().copied().collect();
        assert_eq!(closer_row(&info, &g, &group(&far), 1, &busy, None), None);
        // A member whose round trip is not known yet: no judgement.
        info.nodes
            .iter_mut()
            .find(|n| n.peer == far[0].to_string())
            .unwrap()
            .rtt_ms = None;
        assert_eq!(closer_row(&info, &g, &group(&far), 1, &none, None), None);
    }

    /// The lab's flapping: a near group that took far spares for stragglers is as close as a
    /// fresh one (its rounds wait for the near answers), so it is not formed again.
    #[test]
    fn a_near_group_that_took_far_spares_is_not_formed_again() {
        let g = Generator::cauchy(7, 3).unwrap();
        let peers: Vec<PeerId> = (0..7).map(|_| PeerId::random()).collect();
        let pairs: Vec<(PeerId, u32)> = (0..7).map(|r| (peers[r as usize], r)).collect();
        let mut info = view(&pairs);
        for (r, n) in info.nodes.iter_mut().enumerate() {
            n.rtt_ms = Some(if r < 5 { 2.0 + r as f32 } else { 80.0 });
        }
        let none = BTreeSet::new();
        let all: BTreeMap<usize, PeerId> = peers.iter().copied().enumerate().collect();
        assert_eq!(closer_row(&info, &g, &all, 2, &none, None), None);
        // Three far members of five: a round waits for one of them.
        let mixed: BTreeMap<usize, PeerId> = [0, 1, 4, 5, 6].map(|r| (r, peers[r])).into();
        for n in &mut info.nodes[2..4] {
            n.rtt_ms = Some(1.0);
        }
        assert!(closer_row(&info, &g, &mixed, 2, &none, None).is_some());
    }
}
