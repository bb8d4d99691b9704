//! The leader's rules in the deterministic simulation: the [`node_core::lead::Steer`] and the
//! generation loop the API's, the command line's and the bench's leaders run, driven over
//! simulated members in virtual time with faults: members die mid-pass with no spare left, a
//! row comes back to a short group, forming fails until a row is up. Each case replays from
//! its seed.

#![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

use std::time::Duration;

use node_core::code::Generator;
use node_core::coded::InProcess;
use node_core::lead::generate;
use node_core::lead::steer::{FORM_RETRY, SHORT_CHECK};
use node_core::model::{GenerateOptions, Llama, SamplingParams};
use tests::sim::{Fault, LeaderConfig, LeaderStep, SimLeader, SimModel, sim_group, sim_model};

const K: usize = 3;
const N: usize = 6;
const PROMPT: [u32; 5] = [3, 17, 200, 42, 9];
const TOKENS: usize = 12;

struct Fixture {
    llama: Llama,
    g: Generator,
    shards: InProcess,
    /// The greedy completion through an undisturbed group.
    reference: Vec<u32>,
}

fn opts() -> GenerateOptions {
    GenerateOptions {
        max_tokens: TOKENS,
        sampling: SamplingParams::default(),
        stop_ids: Vec::new(),
        draft: 0,
    }
}

fn fixture(seed: u64) -> Fixture {
    let SimModel { llama, g, shards } = sim_model(seed, N, K).unwrap();
    let cfg = LeaderConfig {
        seed,
        ..LeaderConfig::default()
    };
    let mut calm = sim_group(llama.config(), &g, &shards, cfg, &[]).unwrap();
    let reference = generate(&llama, &mut calm, &PROMPT, &opts(), &mut |_| true)
        .unwrap()
        .tokens;
    assert_eq!(reference.len(), TOKENS);
    Fixture {
        llama,
        g,
        shards,
        reference,
    }
}

/// The simulated leader's transport from `seed`, planning `spares` spares.
fn leader(seed: u64, spares: usize) -> LeaderConfig {
    LeaderConfig {
        seed,
        spares,
        ..LeaderConfig::default()
    }
}

fn formed(log: &[(Duration, LeaderStep)]) -> Vec<Vec<usize>> {
    log.iter()
        .filter_map(|(_, s)| match s {
            LeaderStep::Formed(rows) => Some(rows.clone()),
            _ => None,
        })
        .collect()
}

fn caught(log: &[(Duration, LeaderStep)]) -> Vec<usize> {
    log.iter()
        .filter_map(|(_, s)| match s {
            LeaderStep::Caught(row) => Some(*row),
            _ => None,
        })
        .collect()
}

#[test]
fn members_that_die_mid_pass_with_no_spare_left_are_regrouped_around_and_the_text_is_the_same() {
    let _machine = crate::machine::share();
    for seed in 0..3 {
        let f = fixture(seed);
        let cfg = leader(seed, 0);
        let all: Vec<usize> = (0..N).collect();
        // The first group's first member dies; then one of the group formed without it (its
        // requests are counted from that group's forming).
        let plan = |rows: &[usize]| node_core::mesh::plan_group(&f.g, rows, 0).unwrap().members;
        let a = plan(&all)[0];
        let without: Vec<usize> = all.iter().copied().filter(|&r| r != a).collect();
        let b = plan(&without)[0];
        let run = || {
            let mut lead = SimLeader::new(&f.llama, &f.g, &f.shards, cfg, &all)
                .with_fault(a, Fault::Crash { after_requests: 12 })
                .with_fault(b, Fault::Crash { after_requests: 40 });
            let out = lead.generate(&PROMPT, &opts()).unwrap();
            (out.tokens, lead.log.clone(), lead.rows().unwrap())
        };
        let (tokens, log, end) = run();
        assert_eq!(tokens, f.reference, "seed {seed}: {log:?}");
        let failed = log
            .iter()
            .filter(|(_, s)| matches!(s, LeaderStep::PassFailed(_)))
            .count();
        assert_eq!(failed, 2, "seed {seed}: one failed pass per death: {log:?}");
        let groups = formed(&log);
        assert_eq!(groups.len(), 3, "seed {seed}: {log:?}");
        assert!(
            groups[1].contains(&b) && !groups[1].contains(&a),
            "{groups:?}"
        );
        assert!(
            !end.contains(&a) && !end.contains(&b),
            "seed {seed}: {end:?}"
        );
        // A member died and another row took its place: formed again at once, no backoff
        // (a pass ran between the two deaths).
        assert!(
            !log.iter().any(|(_, s)| matches!(s, LeaderStep::Waited(_))),
            "seed {seed}: {log:?}"
        );
        assert_eq!(
            run().1,
            log,
            "seed {seed}: the same seed replays the same leader"
        );
        eprintln!("seed {seed}: rows {a} and {b} died; groups {groups:?}");
    }
}

#[test]
fn a_short_group_is_formed_again_when_a_row_comes_back() {
    let _machine = crate::machine::share();
    for seed in 0..3 {
        let f = fixture(seed);
        let cfg = leader(seed, 1);
        // Rows 4 and 5 are down: the group is every row up (k + a spare), with no free row.
        let up = [0, 1, 2, 3];
        let victim = node_core::mesh::plan_group(&f.g, &up, 1).unwrap().members[0];
        let back_at = Duration::from_millis(1500);
        let mut lead = SimLeader::new(&f.llama, &f.g, &f.shards, cfg, &up)
            .with_fault(victim, Fault::Crash { after_requests: 15 })
            .with_return(back_at, 5);
        let out = lead.generate(&PROMPT, &opts()).unwrap();
        let log = lead.log.clone();
        assert_eq!(out.tokens, f.reference, "seed {seed}: {log:?}");
        assert!(
            lead.elapsed() > back_at + SHORT_CHECK,
            "seed {seed}: the run is long enough to see the row back ({:?})",
            lead.elapsed()
        );
        // Short once the victim died, it looked every check and found nothing until row 5
        // came back; then it went for it, once.
        let looks: Vec<(Duration, Option<usize>)> = log
            .iter()
            .filter_map(|(at, s)| match s {
                LeaderStep::Looked(row) => Some((*at, *row)),
                _ => None,
            })
            .collect();
        assert!(looks.len() >= 2, "seed {seed}: {log:?}");
        assert!(looks.windows(2).all(|w| w[1].0 - w[0].0 >= SHORT_CHECK));
        for (at, row) in &looks {
            assert_eq!(row.is_some(), *at >= back_at, "seed {seed}: {looks:?}");
        }
        assert_eq!(
            log.iter()
                .filter(|(_, s)| matches!(s, LeaderStep::Regrouped(5)))
                .count(),
            1,
            "seed {seed}: {log:?}"
        );
        let groups = formed(&log);
        assert_eq!(groups.len(), 2, "seed {seed}: {log:?}");
        assert!(groups[1].contains(&5) && !groups[1].contains(&victim));
        assert_eq!(lead.rows().unwrap().len(), K + 1, "k and the spare again");
        assert!(
            !log.iter()
                .any(|(_, s)| matches!(s, LeaderStep::PassFailed(_))),
            "a spare covered the death: no pass failed"
        );
        eprintln!("seed {seed}: row {victim} died, row 5 back at {back_at:?}: groups {groups:?}");
    }
}

#[test]
fn forming_fails_while_too_few_rows_are_up_and_is_tried_again_after_its_retry() {
    let _machine = crate::machine::share();
    let f = fixture(0);
    let cfg = leader(0, 0);
    let mut lead = SimLeader::new(&f.llama, &f.g, &f.shards, cfg, &[0, 1])
        .with_return(FORM_RETRY / 2, 2)
        .with_return(FORM_RETRY / 2, 3);
    let err = lead.generate(&PROMPT, &opts()).unwrap_err().to_string();
    let failed = lead.log.iter().find_map(|(_, s)| match s {
        LeaderStep::FormFailed(why) => Some(why.clone()),
        _ => None,
    });
    assert_eq!(
        Some(err.clone()),
        failed,
        "the request fails with why forming did"
    );
    // Within the retry the failure is the answer: no second try, though rows came back.
    lead.advance(FORM_RETRY / 2);
    let again = lead.generate(&PROMPT, &opts()).unwrap_err().to_string();
    assert_eq!(again, err);
    let tries = |log: &[(Duration, LeaderStep)]| {
        log.iter()
            .filter(|(_, s)| matches!(s, LeaderStep::FormFailed(_) | LeaderStep::Formed(_)))
            .count()
    };
    assert_eq!(tries(&lead.log), 1, "{:?}", lead.log);
    lead.advance(FORM_RETRY / 2);
    let out = lead.generate(&PROMPT, &opts()).unwrap();
    assert_eq!(out.tokens, f.reference);
    assert_eq!(tries(&lead.log), 2, "{:?}", lead.log);
    let groups = formed(&lead.log);
    assert_eq!(groups.len(), 1);
    assert!(
        groups[0].len() == K && groups[0].iter().all(|r| *r <= 3),
        "{groups:?}"
    );
}

#[test]
fn a_member_that_lies_is_caught_and_the_group_regains_its_check_when_a_row_comes_back() {
    let _machine = crate::machine::share();
    for seed in 0..3 {
        let f = fixture(seed);
        let cfg = leader(seed, 0);
        // k and two checks (enough to tell which answer is wrong) over the five rows up: the
        // liar caught leaves the group short of a check.
        let up = [0, 1, 2, 3, 4];
        let liar = node_core::mesh::plan_group(&f.g, &up, 2).unwrap().members[1];
        let back_at = Duration::from_millis(1200);
        let mut lead = SimLeader::new(&f.llama, &f.g, &f.shards, cfg, &up)
            .with_verify(2)
            .with_fault(liar, Fault::Lie { after_requests: 20 })
            .with_return(back_at, 5);
        let out = lead.generate(&PROMPT, &opts()).unwrap();
        let log = lead.log.clone();
        assert_eq!(
            out.tokens, f.reference,
            "seed {seed}: no lie reached the text: {log:?}"
        );
        let caught = caught(&log);
        assert_eq!(caught, [liar], "seed {seed}: {log:?}");
        let groups = formed(&log);
        assert_eq!(
            groups.len(),
            2,
            "seed {seed}: formed again with the row back: {log:?}"
        );
        assert!(
            groups[1].contains(&5) && !groups[1].contains(&liar),
            "{groups:?}"
        );
        assert_eq!(lead.rows().unwrap().len(), K + 2, "checked twice again");
        eprintln!("seed {seed}: row {liar} lied and was caught; groups {groups:?}");
    }
}

#[test]
fn a_liar_in_a_group_checked_once_fails_a_pass_and_the_group_formed_again_checks_twice_and_catches_it()
 {
    let _machine = crate::machine::share();
    for seed in 0..3 {
        let f = fixture(seed);
        // `up`'s groups: k and one check, no spare. One check sees a wrong answer but cannot
        // tell whose it is, and nobody else is in the group to ask.
        let up = [0, 1, 2, 3, 4];
        let liar = node_core::mesh::plan_group(&f.g, &up, 1).unwrap().members[1];
        let mut lead = SimLeader::new(&f.llama, &f.g, &f.shards, leader(seed, 0), &up)
            .with_verify(1)
            .with_fault(liar, Fault::Lie { after_requests: 20 });
        let out = lead.generate(&PROMPT, &opts()).unwrap();
        let log = lead.log.clone();
        assert_eq!(out.tokens, f.reference, "seed {seed}: {log:?}");
        let failed = log
            .iter()
            .filter(|(_, s)| matches!(s, LeaderStep::PassFailed(_)))
            .count();
        assert_eq!(
            failed, 1,
            "seed {seed}: the unlocated lie fails one pass: {log:?}"
        );
        let groups = formed(&log);
        assert_eq!(
            groups.iter().map(Vec::len).collect::<Vec<_>>(),
            [K + 1, K + 2],
            "seed {seed}: formed again with one more check: {groups:?}"
        );
        assert!(groups[1].contains(&liar), "{groups:?}");
        let caught = caught(&log);
        assert_eq!(caught, [liar], "seed {seed}: {log:?}");
        eprintln!(
            "seed {seed}: row {liar} lied, went unlocated, then was caught; groups {groups:?}"
        );
    }
}
