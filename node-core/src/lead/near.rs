//! Distance in a leader's choices: the round trips its view knows, and whether a much closer
//! group than its own could be formed now.

use std::collections::{BTreeMap, BTreeSet};
use std::str::FromStr;

use crate::code::Generator;
use crate::mesh::{MeshInfo, much_closer, pick_nearest, plan_group_near};

/// A row of a much closer group than the one computing with `rows` (each row's holder): the
/// group [`super::form`] would pick from `info` now (each row's nearest holder outside `avoid`, the
/// nearest rows that decode well, `extra` beyond k) when its slowest member is
/// [`much_closer`] than the group's own; `None` when no such group, or while a member's round
/// trip is not known. `own` is the leader's own row's holder (at 0). `P` names peers as the
/// view does (a [`libp2p::PeerId`]; a simulation's numbers).
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
    let now = slowest(rows.values().map(|p| rtt.get(p).copied()))?;
    // The holders a fresh group could take: known round trips, free or the group's own.
    let free = |p: &P| rtt.contains_key(p) && (!avoid.contains(p) || rows.values().any(|m| m == p));
    let known: BTreeMap<usize, Vec<P>> = (live.iter())
        .map(|(&row, holders)| {
            let peers = holders.iter().filter_map(|n| n.peer.parse().ok());
            (row, peers.filter(free).collect())
        })
        .collect();
    let nearest = pick_nearest(&known, &BTreeSet::new(), |p| rtt.get(p).copied());
    let rtt_of = |r: usize| nearest.get(&r).and_then(|p| rtt.get(p)).copied();
    let candidates: Vec<usize> = nearest.keys().copied().collect();
    let plan = plan_group_near(g, &candidates, extra, rtt_of).ok()?;
    let fresh = slowest(plan.members.iter().map(|&r| rtt_of(r)))?;
    let changed = |r: &&usize| rows.get(*r) != nearest.get(*r);
    much_closer(now, fresh).then(|| {
        *plan
            .members
            .iter()
            .find(changed)
            .unwrap_or(&plan.members[0])
    })
}

/// The largest of round trips, `None` if one is not known.
fn slowest(mut ms: impl Iterator<Item = Option<f32>>) -> Option<f32> {
    ms.try_fold(0.0, |most: f32, ms| Some(most.max(ms?)))
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
    use libp2p::PeerId;

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
}
