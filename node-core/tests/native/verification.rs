//! Verification in one process: with k + r answers a member that answers against the code is
//! caught, located, dropped, and the request still gets the honest result; a member whose
//! backward answers are wrong is caught by a forward round at a random input, and the
//! gradient is the honest one.

use crate::common::{self, max_rel_diff};

use node_core::code::Generator;
use node_core::coded::ShardValues;
use node_core::coded::{
    CodedGroup, InProcess, Member, Misbehaviour, NOISE_MARGIN, PROBE_SIGMAS, ShardFormat,
    Transport, TransportError, UpdateProbe, VerifyConfig, measure_noise,
};
use node_core::learn::Update;
use node_core::model::{Gradients, KvCache, LeaderWeights, Llama, ModelWeights};

const SEQ: [u32; 9] = [3, 17, 60, 42, 9, 17, 5, 33, 12];

/// The honest members of a synthetic model, k = 3 of n = 5.
pub(crate) fn honest() -> (ModelWeights, Generator, Vec<Member>) {
    let w = ModelWeights::synthetic(common::train_config(true), 11).unwrap();
    let g = Generator::cauchy(5, 3).unwrap();
    let mesh = InProcess::encode(&w, &g, ShardFormat::F32, &|_, _| {}).unwrap();
    (w, g, mesh.members().to_vec())
}

/// The check as a mesh sets it: the f32 noise measured on honest members, times the margin.
pub(crate) fn calibrated(
    w: &ModelWeights,
    g: &Generator,
    members: &[Member],
    extra: usize,
) -> VerifyConfig {
    let mesh = InProcess::new(members.to_vec()).unwrap();
    let norms = LeaderWeights::from_model(w);
    let (noise, _) = measure_noise(&w.cfg, &norms, g, mesh, 20).unwrap();
    assert!(
        noise > 0.0 && noise < 1e-5,
        "honest noise {noise:.2e} per unit of κ"
    );
    VerifyConfig {
        extra,
        noise: NOISE_MARGIN * noise,
        project: false,
    }
}

fn logits(w: &ModelWeights, group: &mut CodedGroup<InProcess>) -> Vec<f32> {
    let llama = Llama::new(w.cfg.clone(), LeaderWeights::from_model(w)).unwrap();
    futures::executor::block_on(llama.forward(group, &SEQ, &mut KvCache::new(&w.cfg))).unwrap()
}

/// The error of a forward pass that must fail.
fn forward_error(w: &ModelWeights, group: &mut CodedGroup<InProcess>) -> String {
    let llama = Llama::new(w.cfg.clone(), LeaderWeights::from_model(w)).unwrap();
    futures::executor::block_on(llama.forward(group, &SEQ, &mut KvCache::new(&w.cfg)))
        .unwrap_err()
        .to_string()
}

/// The faults of the issue, each made on member `bad`.
fn faulty(kind: &str, bad: usize, w: &ModelWeights, members: &[Member]) -> Vec<Member> {
    let mut out = members.to_vec();
    let shards = members[bad].shards().clone();
    out[bad] = match kind {
        "garbage" => Member::misbehaving(shards, bad, Misbehaviour::Garbage),
        "scale" => {
            let mut s = shards;
            s.scale_values(1.0 + 1e-3);
            Member::new(s)
        }
        "wrong-row" => {
            let actual = (bad + 1) % members.len();
            Member::misbehaving(
                members[actual].shards().clone(),
                bad,
                Misbehaviour::WrongRow { actual },
            )
        }
        "stale" => {
            // Every other member applies one learning update at the default rate; this one
            // does not.
            let llama = Llama::new(w.cfg.clone(), LeaderWeights::from_model(w)).unwrap();
            let mesh = InProcess::new(members.to_vec()).unwrap();
            let mut group = CodedGroup::new(
                w.cfg.clone(),
                Generator::cauchy(5, 3).unwrap(),
                &[0, 1, 2],
                mesh,
            )
            .unwrap();
            let update = Update::from_gradients(
                futures::executor::block_on(llama.gradients(&mut group, &SEQ)).unwrap(),
                1e-4,
                1.0,
            );
            for (i, m) in out.iter_mut().enumerate() {
                if i != bad {
                    update.apply_to_shards(m.shards_mut()).unwrap();
                }
            }
            return out;
        }
        other => panic!("unknown fault {other}"),
    };
    out
}

#[test]
fn every_kind_of_fault_is_caught_located_and_outvoted() {
    let (w, g, members) = honest();
    let check = calibrated(&w, &g, &members, 1);
    for kind in ["garbage", "scale", "wrong-row", "stale"] {
        for extra in [1, 2] {
            // The group is all five rows; k + r of them answer each round.
            let rows: &[usize] = if extra == 1 { &[0, 2, 3] } else { &[0, 2, 4] };
            for &bad in rows {
                let members = faulty(kind, bad, &w, &members);
                // The honest result: the same members with the faulty one left out.
                let honest_rows: Vec<usize> = (0..5).filter(|&r| r != bad).collect();
                let mesh = InProcess::new(members.clone()).unwrap();
                let mut reference =
                    CodedGroup::new(w.cfg.clone(), g.clone(), &honest_rows, mesh).unwrap();
                let want = logits(&w, &mut reference);

                let mesh = InProcess::new(members).unwrap();
                let mut group =
                    CodedGroup::new(w.cfg.clone(), g.clone(), &[0, 1, 2, 3, 4], mesh).unwrap();
                group.set_verify(VerifyConfig { extra, ..check });
                let got = logits(&w, &mut group);
                let caught = &group.stats().caught;
                assert!(
                    !caught.is_empty() && caught.iter().all(|c| c.node == bad),
                    "{kind}, r = {extra}, bad row {bad}: caught {caught:?}"
                );
                assert!(
                    !group.nodes().contains(&bad),
                    "{kind}: row {bad} still a member"
                );
                let err = max_rel_diff(&got, &want);
                assert!(err < 1e-4, "{kind}, r = {extra}: logits off by {err:.2e}");
            }
        }
    }
}

/// In-process members whose answers beyond the first `need` of a round come late, handed over
/// as late answers: as a network leader sees a member that always answers last.
pub(crate) struct LastIsLate {
    members: InProcess,
    round: u64,
    late: Vec<(u64, usize, Vec<u8>)>,
}

impl LastIsLate {
    /// Over `members`, before any round.
    pub(crate) fn new(members: Vec<Member>) -> Self {
        Self {
            members: InProcess::new(members).unwrap(),
            round: 0,
            late: Vec::new(),
        }
    }
}

impl Transport for LastIsLate {
    async fn round(
        &mut self,
        members: &mut Vec<usize>,
        request: &[u8],
        need: usize,
    ) -> Result<Vec<(usize, Vec<u8>)>, TransportError> {
        self.round += 1;
        let mut answers = self.members.round(members, request, need).await?;
        let late = answers.split_off(need.min(answers.len()));
        self.late
            .extend(late.into_iter().map(|(n, b)| (self.round, n, b)));
        Ok(answers)
    }

    async fn round_each(
        &mut self,
        requests: Vec<(usize, Vec<u8>)>,
    ) -> Result<Vec<(usize, Vec<u8>)>, TransportError> {
        self.members.round_each(requests).await
    }

    fn last_round(&self) -> Option<u64> {
        Some(self.round)
    }

    fn late_answers(&mut self) -> Vec<(u64, usize, Vec<u8>)> {
        std::mem::take(&mut self.late)
    }

    fn asks_alone(&self) -> bool {
        true
    }
}

#[test]
fn a_member_whose_answers_always_come_last_is_still_checked_and_caught() {
    let (w, g, members) = honest();
    let check = calibrated(&w, &g, &members, 1);
    let llama = Llama::new(w.cfg.clone(), LeaderWeights::from_model(&w)).unwrap();
    // k + 1 = 4 answers are used and checked; row 4, asked last, always comes fifth.
    for kind in ["honest", "garbage", "scale", "wrong-row"] {
        let bad = 4;
        let members = match kind {
            "honest" => members.clone(),
            kind => faulty(kind, bad, &w, &members),
        };
        let reference = InProcess::new(members.clone()).unwrap();
        let mut reference =
            CodedGroup::new(w.cfg.clone(), g.clone(), &[0, 1, 2, 3], reference).unwrap();
        let want = logits(&w, &mut reference);
        let transport = LastIsLate::new(members);
        let mut group =
            CodedGroup::new(w.cfg.clone(), g.clone(), &[0, 1, 2, 3, 4], transport).unwrap();
        group.set_verify(VerifyConfig { extra: 1, ..check });
        let got =
            futures::executor::block_on(llama.forward(&mut group, &SEQ, &mut KvCache::new(&w.cfg)))
                .unwrap();
        let stats = group.stats();
        assert!(stats.late_checked > 0, "{kind}: no late answer was checked");
        if kind == "honest" {
            assert!(stats.caught.is_empty(), "honest: caught {:?}", stats.caught);
            assert!(group.nodes().contains(&bad), "honest: row {bad} dropped");
        } else {
            let caught = &stats.caught;
            assert!(
                !caught.is_empty()
                    && caught
                        .iter()
                        .all(|c| c.node == bad && c.step.contains("came late")),
                "{kind}: caught {caught:?}"
            );
            assert!(
                !group.nodes().contains(&bad),
                "{kind}: row {bad} still a member"
            );
        }
        let err = max_rel_diff(&got, &want);
        assert!(err < 1e-4, "{kind}: logits off by {err:.2e}");
    }
}

#[test]
fn honest_groups_pass_every_check() {
    let (w, g, members) = honest();
    let check = calibrated(&w, &g, &members, 1);
    // Every group of k + 1 rows in every rotation: the order decides which k answers are
    // decoded and which one is checked, and the threshold holds for each.
    let groups = (0..5).flat_map(|left_out| {
        let rows: Vec<usize> = (0..5).filter(|&r| r != left_out).collect();
        (0..rows.len()).map(move |turn| {
            let mut rows = rows.clone();
            rows.rotate_left(turn);
            rows
        })
    });
    for rows in groups {
        let mesh = InProcess::new(members.clone()).unwrap();
        let mut group = CodedGroup::new(w.cfg.clone(), g.clone(), &rows, mesh).unwrap();
        group.set_verify(check);
        let _ = logits(&w, &mut group);
        let s = group.stats();
        assert!(s.caught.is_empty(), "{rows:?}: {:?}", s.caught);
        assert!(s.verified_rounds > 0 && s.unverified_rounds == 0);
        assert!(
            s.max_pass_ratio < 0.5,
            "{rows:?}: noise at {:.3} of the threshold",
            s.max_pass_ratio
        );
    }
}

#[test]
fn a_fault_with_nobody_left_to_tell_fails_clearly() {
    let (w, g, members) = honest();
    let check = calibrated(&w, &g, &members, 1);
    let members = faulty("scale", 1, &w, &members);
    let mesh = InProcess::new(members).unwrap();
    // k + 1 members and no other: the disagreement is seen but cannot be pinned on anyone.
    let mut group = CodedGroup::new(w.cfg.clone(), g, &[0, 1, 2, 3], mesh).unwrap();
    group.set_verify(check);
    let err = forward_error(&w, &mut group);
    assert!(err.contains("disagree"), "{err}");
}

/// Learning updates at `lr`, each from one training sequence through honest members.
fn updates(w: &ModelWeights, members: &[Member], lr: f32, count: usize) -> Vec<Update> {
    let llama = Llama::new(w.cfg.clone(), LeaderWeights::from_model(w)).unwrap();
    (0..count)
        .map(|i| {
            let mesh = InProcess::new(members.to_vec()).unwrap();
            let g = Generator::cauchy(5, 3).unwrap();
            let mut group = CodedGroup::new(w.cfg.clone(), g, &[0, 1, 2], mesh).unwrap();
            let seq: Vec<u32> = SEQ.iter().map(|&t| (t + 7 * i as u32) % 64).collect();
            Update::from_gradients(
                futures::executor::block_on(llama.gradients(&mut group, &seq)).unwrap(),
                lr,
                1.0,
            )
        })
        .collect()
}

#[test]
fn members_missing_updates_they_claim_are_caught_by_the_probe() {
    let (w, g, genesis) = honest();
    let check = calibrated(&w, &g, &genesis, 1);
    // Updates too small for the residual check: the stale shard differs by far less than the
    // f32 noise it must allow.
    let ups = updates(&w, &genesis, 4e-6, 2);
    let probe = || {
        let list = ups
            .iter()
            .enumerate()
            .map(|(i, u)| (100 + i as u64, std::sync::Arc::new(u.clone())))
            .collect();
        Some(UpdateProbe::new(list, 5))
    };
    let at = |missing: &[usize], bad: usize| {
        let mut out = genesis.clone();
        for (i, m) in out.iter_mut().enumerate() {
            for (j, u) in ups.iter().enumerate() {
                if i != bad || !missing.contains(&j) {
                    u.apply_to_shards(m.shards_mut()).unwrap();
                }
            }
        }
        out
    };
    // Honest members pass with the probe on, and the fits stay far from the bar.
    let mesh = InProcess::new(at(&[], usize::MAX)).unwrap();
    let mut group = CodedGroup::new(w.cfg.clone(), g.clone(), &[0, 1, 2, 3], mesh).unwrap();
    group.set_verify(check);
    group.set_probe(probe());
    let want = logits(&w, &mut group);
    let s = group.stats();
    assert!(s.caught.is_empty(), "{:?}", s.caught);
    assert!(s.probed_rounds > 0);
    assert!(
        s.max_probe_sigmas < PROBE_SIGMAS / 2.0,
        "honest fit at {:.1} σ",
        s.max_probe_sigmas
    );
    // Stale (missing the second update) and lying (missing both), with r = 1 and r = 2.
    for (missing, ids) in [(&[1][..], &[101u64][..]), (&[0, 1][..], &[100, 101][..])] {
        for extra in [1, 2] {
            for bad in [0, 2, 3] {
                let members = at(missing, bad);
                let mesh = InProcess::new(members.clone()).unwrap();
                let mut group =
                    CodedGroup::new(w.cfg.clone(), g.clone(), &[0, 1, 2, 3, 4], mesh).unwrap();
                group.set_verify(VerifyConfig { extra, ..check });
                let _ = logits(&w, &mut group);
                assert!(
                    group.stats().caught.is_empty(),
                    "the residual check alone saw {missing:?} missing: {:?}",
                    group.stats().caught
                );
                let mesh = InProcess::new(members).unwrap();
                let mut group =
                    CodedGroup::new(w.cfg.clone(), g.clone(), &[0, 1, 2, 3, 4], mesh).unwrap();
                group.set_verify(VerifyConfig { extra, ..check });
                group.set_probe(probe());
                let got = logits(&w, &mut group);
                let caught = &group.stats().caught;
                let p = group.probe().unwrap();
                let fits: Vec<_> = (0..p.len()).map(|u| p.fits(u)).collect();
                let what = format!(
                    "missing {missing:?}, r = {extra}, bad row {bad}: {caught:?}; fits {fits:?}"
                );
                assert_eq!(caught.len(), 1, "{what}");
                let (id, share) = caught[0].missing_update.expect(&what);
                assert_eq!(caught[0].node, bad, "{what}");
                assert!(ids.contains(&id), "{what}");
                assert!((share - 1.0).abs() < 0.5, "{what}");
                assert!(!group.nodes().contains(&bad), "{what}");
                assert!(caught[0].to_string().contains("miss"), "{what}");
                let err = max_rel_diff(&got, &want);
                assert!(err < 1e-4, "{what}: logits off by {err:.2e}");
            }
        }
    }
    // Projected checks: rounds are checked by answers until the probe has settled on the rows
    // that take part (the decoding rows and the check row, not spare row 4, which never
    // answers here), then by projection; a member missing an update is caught all the same.
    let projected = VerifyConfig {
        project: true,
        ..check
    };
    let mesh = InProcess::new(at(&[], usize::MAX)).unwrap();
    let mut group = CodedGroup::new(w.cfg.clone(), g.clone(), &[0, 1, 2, 3, 4], mesh).unwrap();
    group.set_verify(projected);
    group.set_probe(probe());
    // The test model has two blocks: the probe takes a few requests to settle.
    for _ in 0..8 {
        let _ = logits(&w, &mut group);
    }
    let s = group.stats();
    assert!(s.caught.is_empty(), "{:?}", s.caught);
    assert!(s.probed_rounds > 0 && s.projected_rounds > 0, "{s:?}");
    for bad in [0, 2, 3] {
        let mesh = InProcess::new(at(&[1], bad)).unwrap();
        let mut group = CodedGroup::new(w.cfg.clone(), g.clone(), &[0, 1, 2, 3, 4], mesh).unwrap();
        group.set_verify(projected);
        group.set_probe(probe());
        let got = logits(&w, &mut group);
        let caught = &group.stats().caught;
        assert_eq!(caught.len(), 1, "projected, bad row {bad}: {caught:?}");
        assert_eq!(caught[0].node, bad, "{}", caught[0]);
        assert_eq!(caught[0].missing_update.map(|(id, _)| id), Some(101));
        let err = max_rel_diff(&got, &want);
        assert!(
            err < 1e-4,
            "projected, bad row {bad}: logits off by {err:.2e}"
        );
    }
}

// Backward rounds: each member's transposed product is checked (Freivalds) against a checked
// forward round at a random input drawn after its answer came.

/// Relative L2 difference of two gradients over every factor and the embedding's rows.
fn grad_diff(a: &Gradients, b: &Gradients) -> f64 {
    let mut pairs: Vec<(&[f32], &[f32])> = vec![(&a.embed_dx, &b.embed_dx)];
    for (x, y) in a.stages.iter().zip(&b.stages) {
        assert_eq!(x.stage, y.stage);
        pairs.push((&x.x, &y.x));
        pairs.extend(
            x.dy.iter()
                .zip(&y.dy)
                .map(|(p, q)| (p.as_slice(), q.as_slice())),
        );
    }
    pairs
        .into_iter()
        .map(|(p, q)| {
            let num: f64 = p.iter().zip(q).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
            let den: f64 = q.iter().map(|&y| (y as f64).powi(2)).sum();
            (num / den.max(1e-30)).sqrt()
        })
        .fold(0.0, f64::max)
}

/// The gradient of `seq` through `rows` of `members`, checked as `check` says; the group
/// comes back for its counters.
fn checked_gradients(
    w: &ModelWeights,
    g: &Generator,
    members: Vec<Member>,
    rows: &[usize],
    check: VerifyConfig,
    seq: &[u32],
) -> (Gradients, CodedGroup<InProcess>) {
    let mesh = InProcess::new(members).unwrap();
    let mut group = CodedGroup::new(w.cfg.clone(), g.clone(), rows, mesh).unwrap();
    group.set_verify(check);
    group.seed_checks(7);
    let llama = Llama::new(w.cfg.clone(), LeaderWeights::from_model(w)).unwrap();
    let grads = futures::executor::block_on(llama.gradients(&mut group, seq)).unwrap();
    (grads, group)
}

/// `members` with row `bad` lying as `how`.
pub(crate) fn lying(members: &[Member], bad: usize, how: Misbehaviour) -> Vec<Member> {
    let mut out = members.to_vec();
    out[bad] = Member::misbehaving(members[bad].shards().clone(), bad, how);
    out
}

/// Backward stages of a gradient: the LM head and four per block.
fn backward_stages(w: &ModelWeights) -> u64 {
    1 + 4 * w.cfg.layers as u64
}

#[test]
fn checked_backward_rounds_give_the_unchecked_gradients_to_honest_members() {
    let (w, g, members) = honest();
    let check = calibrated(&w, &g, &members, 1);
    for rows in [[0, 1, 2, 3, 4], [4, 2, 0, 1, 3]] {
        let off = VerifyConfig { extra: 0, ..check };
        let (want, plain) = checked_gradients(&w, &g, members.clone(), &rows, off, &SEQ);
        assert_eq!(plain.stats().checked_backward_rounds, 0);
        let (got, group) = checked_gradients(&w, &g, members.clone(), &rows, check, &SEQ);
        let s = group.stats();
        assert!(s.caught.is_empty(), "{rows:?}: {:?}", s.caught);
        // The check only adds rounds: the backward rows and every product are the same.
        assert_eq!(got, want, "{rows:?}");
        assert_eq!(s.checked_backward_rounds, backward_stages(&w));
        assert_eq!(s.rounds, plain.stats().rounds + backward_stages(&w));
        assert!(
            s.max_backward_pass_ratio > 0.0 && s.max_backward_pass_ratio < 0.1,
            "{rows:?}: backward noise at {:.3} of the threshold",
            s.max_backward_pass_ratio
        );
        eprintln!(
            "honest backward noise at {:.2e} of the threshold",
            s.max_backward_pass_ratio
        );
    }
}

#[test]
fn a_member_lying_only_in_backward_rounds_is_caught_dropped_and_outvoted() {
    let (w, g, members) = honest();
    let check = calibrated(&w, &g, &members, 1);
    let off = VerifyConfig { extra: 0, ..check };
    // k + 1 members are enough: each backward answer is checked on its own.
    for rows in [&[0, 1, 2, 3][..], &[0, 1, 2, 3, 4]] {
        // The backward steps go to the first k rows.
        for bad in [0, 1, 2] {
            let members = lying(&members, bad, Misbehaviour::BackwardOnly);
            let what = format!("rows {rows:?}, bad row {bad}");
            // Unchecked, it poisons every gradient.
            let honest_rows: Vec<usize> = rows.iter().copied().filter(|&r| r != bad).collect();
            let (want, _) = checked_gradients(&w, &g, members.clone(), &honest_rows, off, &SEQ);
            let (poisoned, plain) = checked_gradients(&w, &g, members.clone(), rows, off, &SEQ);
            assert!(plain.stats().caught.is_empty());
            let err = grad_diff(&poisoned, &want);
            assert!(
                err > 1e-4,
                "{what}: the lie moved the gradient by only {err:.2e}"
            );

            let (got, group) = checked_gradients(&w, &g, members, rows, check, &SEQ);
            let caught = &group.stats().caught;
            assert_eq!(caught.len(), 1, "{what}: {caught:?}");
            let c = &caught[0];
            assert_eq!(c.node, bad, "{what}: {c}");
            // Caught on the first backward step, with its residual and the threshold.
            assert_eq!(c.step, "LmHead backward", "{what}: {c}");
            assert!(c.residual > c.threshold, "{what}: {c}");
            assert!(!c.witnesses.contains(&bad), "{what}: {c}");
            assert!(!group.nodes().contains(&bad), "{what}: still a member");
            let err = grad_diff(&got, &want);
            assert!(err < 1e-4, "{what}: gradient off by {err:.2e}");
            eprintln!("{what}: {c}");
        }
    }
}

#[test]
fn a_member_lying_only_in_forward_rounds_is_still_caught_by_the_forward_check() {
    let (w, g, members) = honest();
    let check = calibrated(&w, &g, &members, 1);
    for bad in [0, 2, 3] {
        let members = lying(&members, bad, Misbehaviour::ForwardOnly);
        let honest_rows: Vec<usize> = (0..5).filter(|&r| r != bad).collect();
        let off = VerifyConfig { extra: 0, ..check };
        let (want, _) = checked_gradients(&w, &g, members.clone(), &honest_rows, off, &SEQ);
        let (got, group) = checked_gradients(&w, &g, members, &[0, 1, 2, 3, 4], check, &SEQ);
        let caught = &group.stats().caught;
        assert_eq!(caught.len(), 1, "bad row {bad}: {caught:?}");
        assert_eq!(caught[0].node, bad);
        // The first forward round finds it: the embedding lookup.
        assert_eq!(caught[0].step, "embedding", "{}", caught[0]);
        assert!(!group.nodes().contains(&bad));
        assert_eq!(
            group.stats().checked_backward_rounds,
            backward_stages(&w),
            "bad row {bad}"
        );
        let err = grad_diff(&got, &want);
        assert!(err < 1e-4, "bad row {bad}: gradient off by {err:.2e}");
    }
}

/// SmolLM2-135M's shapes (random weights, two blocks), as a mesh checks them: k = 3 of n = 5,
/// the threshold measured on the honest members. Honest backward answers stay far below it
/// for sequences of several lengths; a backward answer 1e-3 off is caught at once.
#[test]
fn backward_checks_separate_honest_noise_from_a_lie_on_smollm2_shapes() {
    let cfg = node_core::model::LlamaConfig {
        layers: 2,
        max_seq: 64,
        ..node_core::model::LlamaConfig::smollm2_135m()
    };
    let w = ModelWeights::synthetic(cfg, 3).unwrap();
    let g = Generator::cauchy(5, 3).unwrap();
    let members = InProcess::encode(&w, &g, ShardFormat::F32, &|_, _| {})
        .unwrap()
        .into_members();
    let check = calibrated(&w, &g, &members, 1);
    let seq = |len: usize, salt: u32| -> Vec<u32> {
        (0..len as u32)
            .map(|i| (i * 7919 + salt * 104_729) % w.cfg.vocab as u32)
            .collect()
    };
    let mut honest_worst = 0.0f64;
    for (i, rows) in [[0, 1, 2, 3], [4, 2, 0, 1], [3, 1, 4, 2]]
        .iter()
        .enumerate()
    {
        for len in [2, 9, 32] {
            let tokens = seq(len, i as u32);
            let (_, group) = checked_gradients(&w, &g, members.clone(), rows, check, &tokens);
            let s = group.stats();
            assert!(
                s.caught.is_empty(),
                "{rows:?}, {len} tokens: {:?}",
                s.caught
            );
            assert_eq!(s.checked_backward_rounds, backward_stages(&w));
            honest_worst = honest_worst.max(s.max_backward_pass_ratio);
        }
    }
    let mut lie_least = f64::INFINITY;
    for bad in [0, 1, 2] {
        for len in [9, 32] {
            let members = lying(&members, bad, Misbehaviour::BackwardOnly);
            let rows = [0, 1, 2, 3];
            let (_, group) = checked_gradients(&w, &g, members, &rows, check, &seq(len, 5));
            let caught = &group.stats().caught;
            assert_eq!(caught.len(), 1, "bad row {bad}, {len} tokens: {caught:?}");
            assert_eq!(caught[0].node, bad);
            assert_eq!(caught[0].step, "LmHead backward");
            lie_least = lie_least.min(caught[0].residual / caught[0].threshold);
        }
    }
    eprintln!(
        "SmolLM2 shapes: honest backward residual up to {honest_worst:.3} of the threshold; \
         a 1e-3 lie at {lie_least:.1} × the threshold or more (noise {:.2e} per κ)",
        check.noise
    );
    assert!(
        honest_worst < 0.2,
        "honest at {honest_worst:.3} of the threshold"
    );
    // The threshold grows with the backward sums' length as f32 rounding's worst case does
    // (`VerifyConfig::backward_threshold`), so a lie's margin is smaller than the honest one
    // here; on these random weights the noise per κ is ten times SmolLM2's, which puts the same
    // lie far higher there.
    assert!(
        lie_least > 1.5,
        "a lie at only {lie_least:.2} of the threshold"
    );
}

// Projected checks: the check row is asked for `w = S_pᵀ·ρ` once per stage, and each forward
// round is checked by `ρ·ŷ_p ≈ w·x` instead of by the check row's answer.

/// `members` with the output projection (`o`) of block `block` on row `bad` off by 1e-3: a
/// fault no embedding lookup shows, so only a checked product round can catch it.
fn wrong_o(members: &[Member], bad: usize, block: usize) -> Vec<Member> {
    let mut out = members.to_vec();
    let mut shards = members[bad].shards().clone();
    match &mut shards.blocks[block][3].values {
        ShardValues::F32(v) => v.iter_mut().for_each(|x| *x *= 1.0 + 1e-3),
        other => panic!("expected f32 shards, got {other:?}"),
    }
    out[bad] = Member::new(shards);
    out
}

#[test]
fn honest_groups_pass_every_projected_check_and_decode_as_without_it() {
    let (w, g, members) = honest();
    let check = VerifyConfig {
        project: true,
        ..calibrated(&w, &g, &members, 1)
    };
    // The first k rows answer and the next is the check row; a fifth is a spare.
    for rows in [
        vec![0, 1, 2, 3],
        vec![0, 1, 2, 4, 3],
        vec![2, 3, 4, 0],
        vec![4, 1, 3, 2, 0],
    ] {
        let mesh = InProcess::new(members.clone()).unwrap();
        let mut plain = CodedGroup::new(w.cfg.clone(), g.clone(), &rows[..3], mesh).unwrap();
        let want = logits(&w, &mut plain);

        let mesh = InProcess::new(members.clone()).unwrap();
        let mut group = CodedGroup::new(w.cfg.clone(), g.clone(), &rows, mesh).unwrap();
        group.set_verify(check);
        let got = logits(&w, &mut group);
        let s = group.stats();
        assert!(s.caught.is_empty(), "{rows:?}: {:?}", s.caught);
        // The same k rows decode: the same logits, to the bit.
        assert_eq!(got, want, "{rows:?}");
        // Every product round is projected; the embedding lookup is checked by answers.
        let products = plain.stats().rounds - 1;
        assert_eq!(s.projected_rounds, products, "{rows:?}");
        assert_eq!(s.verified_rounds, products + 1, "{rows:?}");
        assert_eq!(s.unverified_rounds, 0, "{rows:?}");
        // The check row is asked once per stage (its projections) and for the lookup.
        let stages = 1 + 4 * w.cfg.layers as u64;
        assert_eq!(s.rounds, plain.stats().rounds + stages, "{rows:?}");
        assert!(
            s.max_projected_ratio > 0.0 && s.max_projected_ratio < 0.5,
            "{rows:?}: projected noise at {:.3} of the threshold",
            s.max_projected_ratio
        );
        eprintln!(
            "{rows:?}: honest projected noise at {:.2e} of the threshold",
            s.max_projected_ratio
        );
    }
}

#[test]
fn a_wrong_answer_is_caught_by_projection_located_and_outvoted() {
    let (w, g, members) = honest();
    let check = VerifyConfig {
        project: true,
        ..calibrated(&w, &g, &members, 1)
    };
    for bad in [0, 1, 2] {
        let members = wrong_o(&members, bad, 1);
        let honest_rows: Vec<usize> = (0..5).filter(|&r| r != bad).collect();
        let mesh = InProcess::new(members.clone()).unwrap();
        let mut reference = CodedGroup::new(w.cfg.clone(), g.clone(), &honest_rows, mesh).unwrap();
        let want = logits(&w, &mut reference);

        // Rows 0, 1, 2 answer, row 3 checks by projection, row 4 settles who is wrong.
        let mesh = InProcess::new(members).unwrap();
        let mut group = CodedGroup::new(w.cfg.clone(), g.clone(), &[0, 1, 2, 3, 4], mesh).unwrap();
        group.set_verify(check);
        let got = logits(&w, &mut group);
        let caught = &group.stats().caught;
        assert_eq!(caught.len(), 1, "bad row {bad}: {caught:?}");
        assert_eq!(caught[0].node, bad, "{}", caught[0]);
        assert_eq!(caught[0].step, "AttnOut(1)", "{}", caught[0]);
        assert!(!group.nodes().contains(&bad));
        let err = max_rel_diff(&got, &want);
        assert!(err < 1e-4, "bad row {bad}: logits off by {err:.2e}");
        eprintln!("{}", caught[0]);
    }
    // With nobody beyond the check row, the fault is seen and the request fails clearly.
    let members = wrong_o(&members, 1, 1);
    let mesh = InProcess::new(members).unwrap();
    let mut group = CodedGroup::new(w.cfg.clone(), g, &[0, 1, 2, 3], mesh).unwrap();
    group.set_verify(check);
    let err = forward_error(&w, &mut group);
    assert!(err.contains("disagree"), "{err}");
}

#[test]
fn a_check_row_whose_projection_lies_is_caught_by_its_own_answer() {
    let (w, g, members) = honest();
    let check = VerifyConfig {
        project: true,
        ..calibrated(&w, &g, &members, 1)
    };
    // Row 3's transposed products, so its projections, are off by 1e-3; its answers are not.
    let members = lying(&members, 3, Misbehaviour::BackwardOnly);
    let mesh = InProcess::new(members.clone()).unwrap();
    let mut plain = CodedGroup::new(w.cfg.clone(), g.clone(), &[0, 1, 2], mesh).unwrap();
    let want = logits(&w, &mut plain);

    let mesh = InProcess::new(members).unwrap();
    let mut group = CodedGroup::new(w.cfg.clone(), g, &[0, 1, 2, 3], mesh).unwrap();
    group.set_verify(check);
    let got = logits(&w, &mut group);
    let s = group.stats();
    assert_eq!(s.caught.len(), 1, "{:?}", s.caught);
    let c = &s.caught[0];
    assert_eq!(c.node, 3, "{c}");
    // Caught on the first product round, the first block's q, k, v.
    assert_eq!(c.step, "Qkv(0) projection", "{c}");
    assert_eq!(c.witnesses, vec![0, 1, 2], "{c}");
    assert!(c.residual > c.threshold, "{c}");
    assert!(!group.nodes().contains(&3));
    // The rest of the request is decoded from the three honest rows, unchecked.
    assert_eq!(got, want);
    assert!(s.unverified_rounds > 0);
    eprintln!("{c}");
}

#[test]
fn projections_are_asked_again_when_the_members_take_an_update() {
    let (w, g, members) = honest();
    let check = VerifyConfig {
        project: true,
        ..calibrated(&w, &g, &members, 1)
    };
    let update = updates(&w, &members, 1e-4, 1).remove(0);
    // A group that serves a request, then every member takes the update, then another.
    let serve_across = |told: bool| {
        let mesh = InProcess::new(members.clone()).unwrap();
        let mut group = CodedGroup::new(w.cfg.clone(), g.clone(), &[0, 1, 2, 3], mesh).unwrap();
        group.set_verify(check);
        let _ = logits(&w, &mut group);
        for m in group.transport_mut().members_mut() {
            update.apply_to_shards(m.shards_mut()).unwrap();
        }
        if told {
            group.weights_moved();
        }
        let _ = logits(&w, &mut group);
        group
    };
    let group = serve_across(true);
    let s = group.stats();
    assert!(s.caught.is_empty(), "{:?}", s.caught);
    assert_eq!(s.unverified_rounds, 0);
    // Not told, the old projections convict the honest check row: the call is needed.
    let group = serve_across(false);
    let caught = &group.stats().caught;
    assert!(
        caught.len() == 1 && caught[0].node == 3 && caught[0].step.ends_with("projection"),
        "{caught:?}"
    );
}

/// In-process members, one of which dies after a number of rounds: from then on a round that
/// asks it fails with its row, as a network leader sees a member's stream end.
struct DiesAfter {
    members: InProcess,
    row: usize,
    rounds: u64,
    round: u64,
}

impl Transport for DiesAfter {
    async fn round(
        &mut self,
        members: &mut Vec<usize>,
        request: &[u8],
        need: usize,
    ) -> Result<Vec<(usize, Vec<u8>)>, TransportError> {
        self.round += 1;
        if self.round > self.rounds && members.contains(&self.row) {
            members.retain(|&n| n != self.row);
            return Err(TransportError {
                node: self.row,
                reason: "its stream ended".into(),
            });
        }
        self.members.round(members, request, need).await
    }

    async fn round_each(
        &mut self,
        requests: Vec<(usize, Vec<u8>)>,
    ) -> Result<Vec<(usize, Vec<u8>)>, TransportError> {
        self.members.round_each(requests).await
    }
}

#[test]
fn a_spare_takes_a_dead_members_place_and_every_round_stays_checked() {
    let (w, g, members) = honest();
    let check = calibrated(&w, &g, &members, 1);
    let llama = Llama::new(w.cfg.clone(), LeaderWeights::from_model(&w)).unwrap();
    let reference = InProcess::new(members.clone()).unwrap();
    let mut reference =
        CodedGroup::new(w.cfg.clone(), g.clone(), &[0, 1, 2, 3], reference).unwrap();
    let want = logits(&w, &mut reference);
    // k = 3, one check and one spare; row 1 dies in the middle of the pass.
    let transport = DiesAfter {
        members: InProcess::new(members).unwrap(),
        row: 1,
        rounds: 5,
        round: 0,
    };
    let mut group = CodedGroup::new(w.cfg.clone(), g, &[0, 1, 2, 3, 4], transport).unwrap();
    group.set_verify(VerifyConfig { extra: 1, ..check });
    let got =
        futures::executor::block_on(llama.forward(&mut group, &SEQ, &mut KvCache::new(&w.cfg)))
            .unwrap();
    let stats = group.stats();
    assert!(
        !group.nodes().contains(&1),
        "the dead row is still a member"
    );
    assert_eq!(
        stats.unverified_rounds, 0,
        "a round went unchecked: {stats:?}"
    );
    assert!(
        stats.verified_rounds > 5 && stats.caught.is_empty(),
        "{stats:?}"
    );
    let err = max_rel_diff(&got, &want);
    assert!(err < 1e-4, "logits off by {err:.2e}");
}
