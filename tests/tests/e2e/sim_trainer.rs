//! The API's trainer in the deterministic simulation: its schedule (minibatches a gap apart
//! while requests are served, at once when serving is quiet), its turns before each round of
//! its group, and the settling of each update through the canary gate and the holders, with a
//! real learner training on real gradients through simulated members in virtual time. Faults:
//! the holders refuse an update, the gate refuses every one. Each case replays from its seed.

#![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

use std::time::Duration;

use node_core::coded::ShardFormat;
use node_core::lead::training::{MIN_STEP_GAP, turn_wait};
use node_core::learn::{CanaryGate, Learner, LearningConfig, Teacher};
use tests::sim::{
    LeaderConfig, SimModel, SimTrainer, TrainerConfig, TrainerStep, sim_model, tiny_config,
};

const K: usize = 3;
const N: usize = 5;
const SEEDS: [u64; 3] = [1, 2, 3];

fn fixture(seed: u64) -> SimModel {
    sim_model(seed, N, K).unwrap()
}

fn teacher(gate: Option<CanaryGate>) -> Teacher {
    let learner = Learner::new(LearningConfig::default(), tiny_config(), ShardFormat::F32);
    Teacher::new(learner, gate, ShardFormat::F32)
}

/// The `n`th request's text: 12 tokens, distinct for each `n`.
fn text(n: u32) -> Vec<u32> {
    (0..12).map(|i| (n * 37 + i * 11 + 1) % 250).collect()
}

fn trainer<'a>(
    f: &'a SimModel,
    seed: u64,
    serving: Vec<(Duration, Duration)>,
    gate: Option<CanaryGate>,
) -> SimTrainer<'a> {
    let cfg = TrainerConfig {
        rows: (0..K).collect(),
        leader: LeaderConfig {
            seed,
            ..LeaderConfig::default()
        },
        limit: 1024,
        serving,
    };
    SimTrainer::new(&f.llama, &f.g, &f.shards, cfg, teacher(gate)).unwrap()
}

/// Each minibatch's beginning and requests.
fn minibatches(log: &[(Duration, TrainerStep)]) -> Vec<(Duration, usize)> {
    log.iter()
        .filter_map(|(_, s)| match s {
            TrainerStep::Trained {
                began, requests, ..
            } => Some((*began, *requests)),
            _ => None,
        })
        .collect()
}

fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

#[test]
fn while_serving_the_trainer_gathers_a_gap_apart_waits_only_its_share_and_trains_at_once_when_quiet()
 {
    for seed in SEEDS {
        let f = fixture(seed);
        // Requests are served for the first 30 s; one finishes each second meanwhile, and one
        // more at 45 s, when nothing is served.
        let mut t = trainer(&f, seed, vec![(secs(0), secs(30))], None);
        for n in 0..30 {
            t = t.arrives(secs(u64::from(n)), text(n));
        }
        t = t.arrives(secs(45), text(99));
        t.run(secs(60)).unwrap();
        let batches = minibatches(&t.log);
        let taken: usize = batches.iter().map(|(_, r)| r).sum();
        assert_eq!(
            taken, 31,
            "seed {seed}: every request trained once: {batches:?}"
        );
        // The first trains at once; while serving, each next one begins no sooner than a gap
        // after the last, and gathers what finished meanwhile.
        assert_eq!(batches[0], (secs(0), 1), "seed {seed}");
        for pair in batches.windows(2).filter(|p| p[1].0 <= secs(30)) {
            assert!(
                pair[1].0 - pair[0].0 >= MIN_STEP_GAP,
                "seed {seed}: {batches:?}"
            );
            assert!(pair[1].1 >= 5, "seed {seed}: {batches:?}");
        }
        // With nothing served, the last request trains the moment it arrives.
        assert_eq!(batches.last(), Some(&(secs(45), 1)), "seed {seed}");
        // Before each round the trainer waits its share for the round before it, never for
        // the time it spent gathering a minibatch.
        let longest = t.longest_round();
        let waits = t.waits.borrow();
        let most = waits.iter().map(|(_, w)| *w).max().unwrap();
        assert!(
            most <= turn_wait(longest) + Duration::from_millis(1),
            "seed {seed}: a round waited {most:?}; the longest round took {longest:?}"
        );
        // Serving was busy for most rounds, and they did wait their turns.
        let waited: Duration = waits.iter().map(|(_, w)| *w).sum();
        assert!(
            waited > secs(1),
            "seed {seed}: rounds waited {waited:?} in all"
        );
        let published = t
            .log
            .iter()
            .filter(|(_, s)| matches!(s, TrainerStep::Published(_)));
        assert_eq!(published.count(), batches.len(), "seed {seed}: {:?}", t.log);
    }
}

#[test]
fn an_update_the_holders_refuse_is_forgotten_and_the_next_is_published_as_if_it_never_was() {
    for seed in SEEDS {
        let f = fixture(seed);
        // Three requests 5 s apart with nothing served: each trains on its own; the holders
        // refuse the first update.
        let at = |n: u32| secs(5 * u64::from(n));
        let mut refused = trainer(&f, seed, Vec::new(), None).refusing(&[0]);
        for n in 0..3 {
            refused = refused.arrives(at(n), text(n));
        }
        refused.run(secs(20)).unwrap();
        let settled: Vec<&TrainerStep> = (refused.log.iter())
            .map(|(_, s)| s)
            .filter(|s| !matches!(s, TrainerStep::Trained { .. }))
            .collect();
        assert!(
            matches!(settled[..], [TrainerStep::Lost(why), TrainerStep::Published(1), TrainerStep::Published(1)] if why.contains("no holder took update 0")),
            "seed {seed}: {:?}",
            refused.log
        );
        // The same last two requests on a trainer that never saw the first: the same two
        // updates, bit for bit. The lost one steered nothing.
        let mut fresh = trainer(&f, seed, Vec::new(), None);
        for n in 1..3 {
            fresh = fresh.arrives(at(n), text(n));
        }
        fresh.run(secs(20)).unwrap();
        assert_eq!(refused.published().len(), 2, "seed {seed}");
        assert!(
            refused.published() == fresh.published(),
            "seed {seed}: the lost update changed the ones after it"
        );
        // A gate that refuses everything: every minibatch trains, nothing reaches the holders.
        let shut = CanaryGate::new((0..24).map(|i| i * 7 % 250).collect(), None)
            .with_bounds(f64::NEG_INFINITY, f64::NEG_INFINITY);
        let mut gated = trainer(&f, seed, Vec::new(), Some(shut));
        for n in 0..3 {
            gated = gated.arrives(at(n), text(n));
        }
        gated.run(secs(20)).unwrap();
        let refusals = (gated.log.iter()).filter(|(_, s)| *s == TrainerStep::Refused);
        assert_eq!(refusals.count(), 3, "seed {seed}: {:?}", gated.log);
        assert_eq!(gated.handed(), 0, "seed {seed}");
    }
}
