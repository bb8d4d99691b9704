//! The mesh in a deterministic simulation: group formation over a lossy network, a generation
//! that survives crashed and stalled members, and nodes that crash, restart and get partitioned.
//! Everything runs in virtual time from a seed, so each case is replayable.

#![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use node_core::code::Generator;
use node_core::coded::{CodedGroup, ShardFormat, ShardSet};
use node_core::lead::generate;
use node_core::mesh::{
    Health, HealthConfig, JoinOffer, LearningConfig, ModelManifest, RoundConfig, SourceRow,
    plan_group,
};
use node_core::model::{
    GenerateOptions, LeaderWeights, ModelWeights, SamplingParams, TokenizerData,
};
use tests::relative_error;
use tests::sim::{
    Fault, LeaderConfig, LogitsTap, MemoryHolders, NetConfig, SimMesh, SimModel, SimTransport,
    sim_group, sim_model, tiny_config,
};

const K: u32 = 3;
const N: u32 = 5;

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s)
}

/// Five nodes 0..5 holding rows 0..5.
fn mesh(seed: u64, drop: f64) -> SimMesh {
    let net = NetConfig {
        drop,
        ..NetConfig::default()
    };
    let mut m = SimMesh::new(seed, K, N, HealthConfig::default(), net);
    for id in 0..N {
        m.add_node(id, Some(id)).unwrap();
    }
    m
}

// ---------------------------------------------------------------------------------------------
// 1. Group formation
// ---------------------------------------------------------------------------------------------

#[test]
fn five_nodes_form_a_group_over_a_lossy_network() {
    let _machine = crate::machine::share();
    let g = Generator::cauchy(N as usize, K as usize).unwrap();
    for seed in 0..8 {
        let mut m = mesh(seed, 0.2);
        let formed = m
            .run_until(secs(10.0), SimMesh::converged)
            .unwrap_or_else(|| panic!("seed {seed}: no convergence in 10 s"));
        // Every node heartbeats at once, so one interval plus a few losses is enough.
        assert!(formed <= secs(5.0), "seed {seed}: formed at {formed:?}");
        // It stays formed: sampled every 100 ms for 30 s, every view keeps k rows, and the
        // views agree at the end.
        let mut worst = N;
        for _ in 0..300 {
            m.run_for(secs(0.1));
            for id in m.ids() {
                let info = m.view(id).unwrap().info(m.now());
                assert!(
                    info.available,
                    "seed {seed}: node {id} lost the model: {info:?}"
                );
                worst = worst.min(info.healthy_rows);
            }
        }
        m.run_until(secs(10.0), SimMesh::converged).unwrap();
        for id in m.ids() {
            let view = m.view(id).unwrap();
            let info = view.info(m.now());
            assert!(info.available, "seed {seed}, node {id}");
            assert_eq!(
                (info.healthy_rows, info.tolerates),
                (5, 2),
                "seed {seed}, node {id}"
            );
            assert_eq!(info.nodes.len(), 5);
            let live: Vec<usize> = view.live_rows().iter().map(|&(r, _)| r as usize).collect();
            assert_eq!(live, vec![0, 1, 2, 3, 4]);
            let plan = plan_group(&g, &live, 1).unwrap();
            assert_eq!(plan.members.len(), K as usize + 1, "k + 1 members");
            let distinct: BTreeSet<usize> = plan.members.iter().copied().collect();
            assert_eq!(distinct.len(), plan.members.len());
            assert!(
                plan.condition_number < 10.0,
                "κ = {}",
                plan.condition_number
            );
        }
        let s = m.stats();
        let lost = s.dropped as f64 / (s.dropped + s.delivered) as f64;
        assert!(
            (0.15..0.25).contains(&lost),
            "seed {seed}: {lost:.3} of heartbeats lost"
        );
        eprintln!("seed {seed}: formed at {formed:?}; fewest healthy rows seen {worst}; {s:?}");
    }
}

#[test]
fn the_same_seed_replays_the_same_history() {
    let _machine = crate::machine::share();
    let run = |seed| {
        let mut m = mesh(seed, 0.2);
        m.run_for(secs(5.0));
        m.crash(2);
        m.run_for(secs(12.0));
        m.restart(2).unwrap();
        m.run_for(secs(5.0));
        (m.events().to_vec(), m.stats())
    };
    assert_eq!(run(7), run(7));
    assert_ne!(run(7).1, run(8).1, "another seed, another history");
}

// ---------------------------------------------------------------------------------------------
// 2. Failures during a request
// ---------------------------------------------------------------------------------------------

const PROMPT: [u32; 5] = [3, 17, 200, 42, 9];
const TOKENS: usize = 12;
/// Rounds per forward pass: the embedding, four stages per block, the LM head.
const ROUNDS_PER_PASS: usize = 1 + 4 * 2 + 1;

fn fixture(seed: u64) -> SimModel {
    sim_model(seed, N as usize, K as usize).unwrap()
}

/// Greedy tokens and the logits of every forward pass, through `group`.
fn greedy(f: &SimModel, group: &mut CodedGroup<SimTransport>) -> (Vec<u32>, Vec<Vec<f32>>) {
    let opts = GenerateOptions {
        max_tokens: TOKENS,
        sampling: SamplingParams::default(),
        stop_ids: Vec::new(),
        draft: 0,
    };
    let mut tap = LogitsTap::new(group);
    let out = generate(&f.llama, &mut tap, &PROMPT, &opts, &mut |_| true).unwrap();
    assert_eq!(out.tokens.len(), TOKENS);
    (out.tokens, tap.logits)
}

fn assert_same_run(
    what: &str,
    (tokens, logits): &(Vec<u32>, Vec<Vec<f32>>),
    (ref_tokens, ref_logits): &(Vec<u32>, Vec<Vec<f32>>),
) {
    assert_eq!(tokens, ref_tokens, "{what}: other tokens");
    assert_eq!(logits.len(), ref_logits.len());
    for (step, (l, r)) in logits.iter().zip(ref_logits).enumerate() {
        let err = relative_error(l, r);
        assert!(
            err < 1e-4,
            "{what}: step {step}: relative logit error {err:.3e}"
        );
    }
}

#[test]
fn a_generation_survives_two_members_crashing_mid_request() {
    let _machine = crate::machine::share();
    for seed in 0..4 {
        let f = fixture(seed);
        let cfg = LeaderConfig {
            seed,
            ..LeaderConfig::default()
        };
        let mut calm = sim_group(f.llama.config(), &f.g, &f.shards, cfg, &[]).unwrap();
        let reference = greedy(&f, &mut calm);
        assert_eq!(calm.transport().log().len(), TOKENS * ROUNDS_PER_PASS);
        assert!(calm.transport().log().iter().all(|r| r.failed.is_empty()));

        // Two of the decoding members crash while serving a request, a few passes apart.
        let plan = plan_group(&f.g, &[0, 1, 2, 3, 4], 1).unwrap();
        let (a, b) = (plan.members[0], plan.members[1]);
        let faults = [
            (a, Fault::Crash { after_requests: 12 }),
            (b, Fault::Crash { after_requests: 45 }),
        ];
        let mut group = sim_group(f.llama.config(), &f.g, &f.shards, cfg, &faults).unwrap();
        let run = greedy(&f, &mut group);
        assert_same_run(
            &format!("seed {seed}, rows {a} and {b} crashed"),
            &run,
            &reference,
        );

        let log = group.transport().log();
        assert_eq!(log.len(), TOKENS * ROUNDS_PER_PASS, "no round was retried");
        assert!(log.iter().all(|r| r.ok));
        for (row, fault) in faults {
            let Fault::Crash { after_requests } = fault else {
                unreachable!()
            };
            assert!(
                group.transport().requests(row) > after_requests,
                "row {row} never crashed"
            );
            // The round whose request it died on: it did not answer, nor ever again.
            let fatal = log
                .iter()
                .filter(|r| r.asked.contains(&row))
                .nth(after_requests as usize)
                .unwrap();
            for r in log.iter().filter(|r| r.round >= fatal.round) {
                assert!(
                    !r.answered.contains(&row),
                    "seed {seed}: dead row {row} answered"
                );
            }
            // The leader learnt it is gone: within its round, or from the broken connection
            // after that round had ended.
            let gone = log
                .iter()
                .find(|r| r.noticed_down.contains(&row) || r.failed.iter().any(|(f, _)| *f == row))
                .unwrap_or_else(|| panic!("seed {seed}: row {row}'s crash went unnoticed"));
            assert!(gone.round >= fatal.round);
            eprintln!(
                "seed {seed}: row {row} died in round {} and was noticed in round {}",
                fatal.round, gone.round
            );
        }
        // The same seed replays the same rounds.
        let mut again = sim_group(f.llama.config(), &f.g, &f.shards, cfg, &faults).unwrap();
        assert_same_run("replay", &greedy(&f, &mut again), &run);
        assert_eq!(again.transport().log(), log);

        let end = &group.nodes();
        assert!(!end.contains(&a) && !end.contains(&b), "{end:?}");
        assert_eq!(end.len(), K as usize, "the three live rows: {end:?}");
        let failed_rounds = log.iter().filter(|r| !r.failed.is_empty()).count();
        eprintln!(
            "seed {seed}: rows {a} and {b} crashed; {failed_rounds} rounds saw a failure; \
             {:?} virtual vs {:?} undisturbed; members at the end {end:?}",
            group.transport().elapsed(),
            calm.transport().elapsed(),
        );
    }
}

#[test]
fn a_stalled_member_is_outrun_and_swapped_out() {
    let _machine = crate::machine::share();
    let round = RoundConfig::default();
    for seed in 0..4 {
        let f = fixture(seed);
        let cfg = LeaderConfig {
            seed,
            round,
            ..LeaderConfig::default()
        };
        let mut calm = sim_group(f.llama.config(), &f.g, &f.shards, cfg, &[]).unwrap();
        let reference = greedy(&f, &mut calm);

        let plan = plan_group(&f.g, &[0, 1, 2, 3, 4], 1).unwrap();
        let stalled = plan.members[1];
        let faults = [(stalled, Fault::Stall { after_requests: 20 })];
        let mut group = sim_group(f.llama.config(), &f.g, &f.shards, cfg, &faults).unwrap();
        let run = greedy(&f, &mut group);
        assert_same_run(
            &format!("seed {seed}, row {stalled} stalled"),
            &run,
            &reference,
        );

        let t = group.transport();
        let log = t.log();
        assert_eq!(log.len(), TOKENS * ROUNDS_PER_PASS, "no round was retried");
        // Rounds the stalled row was asked in after it stalled: it never answers and is
        // swapped out of the group after `max_misses` of them.
        let stalled_rounds: Vec<_> = log
            .iter()
            .filter(|r| r.asked.contains(&stalled))
            .skip(20)
            .collect();
        assert!(!stalled_rounds.is_empty());
        assert!(
            stalled_rounds
                .iter()
                .all(|r| !r.answered.contains(&stalled))
        );
        let first = stalled_rounds[0].round;
        let out = log
            .iter()
            .find(|r| r.round > first && !r.started_with.contains(&stalled))
            .unwrap_or_else(|| panic!("seed {seed}: row {stalled} was never swapped out"));
        assert!(
            out.round <= first + u64::from(round.max_misses),
            "seed {seed}: swapped out right after {} missed rounds",
            round.max_misses
        );
        let swapped_in: Vec<usize> = out
            .started_with
            .iter()
            .copied()
            .filter(|r| !log[out.round as usize - 2].ended_with.contains(r))
            .collect();
        assert_eq!(
            swapped_in.len(),
            1,
            "one free row replaced it: {swapped_in:?}"
        );
        // Every round finished without waiting for it: at most the slowest other answer.
        let slowest = log.iter().map(|r| r.took).max().unwrap();
        assert!(slowest <= cfg.max_latency, "a round waited {slowest:?}");
        // Whenever it is a member again (a healthy member churned out), it is swapped out
        // again after the same number of misses.
        let mut run_len = 0u64;
        for r in log.iter().skip(first as usize - 1) {
            if r.started_with.contains(&stalled) {
                run_len += 1;
                assert!(
                    run_len <= u64::from(round.max_misses),
                    "seed {seed}: round {}",
                    r.round
                );
            } else {
                run_len = 0;
            }
        }
        let member_rounds = log
            .iter()
            .skip(first as usize - 1)
            .filter(|r| r.started_with.contains(&stalled))
            .count();
        eprintln!(
            "seed {seed}: row {stalled} stalled at round {first}, swapped out at round {}; \
             a member in {member_rounds} of {} later rounds; members at the end {:?}",
            out.round,
            log.len() - first as usize + 1,
            group.nodes()
        );
    }
}

// ---------------------------------------------------------------------------------------------
// 3. Rejoin and partitions
// ---------------------------------------------------------------------------------------------

#[test]
fn a_crashed_node_goes_suspect_then_dead_and_rejoins_on_restart() {
    let _machine = crate::machine::share();
    let hc = HealthConfig::default();
    for seed in 0..6 {
        let mut m = mesh(seed, 0.1);
        let max_lat = m.net().max_latency;
        m.run_until(secs(10.0), SimMesh::converged).unwrap();
        m.run_for(secs(3.0));
        let crashed = 4;
        let others: Vec<u32> = (0..4).collect();
        m.crash(crashed);
        let t_crash = m.elapsed();

        // Suspect everywhere no later than `suspect_after` past its last heartbeat.
        let all_suspect = |m: &SimMesh| {
            others
                .iter()
                .all(|&o| m.view(o).unwrap().health(&crashed) != Some(Health::Healthy))
        };
        m.run_until(hc.suspect_after + max_lat, all_suspect)
            .unwrap_or_else(|| panic!("seed {seed}: not suspected in time"));
        for &o in &others {
            let at = m
                .health_change(o, crashed, Health::Suspect, t_crash)
                .unwrap();
            assert!(
                at <= t_crash + hc.suspect_after + max_lat,
                "seed {seed}: {at:?}"
            );
            let view = m.view(o).unwrap();
            assert_eq!(view.health(&crashed), Some(Health::Suspect));
            assert_eq!(m.live_rows_of(o), BTreeSet::from([0, 1, 2, 3]));
            let info = view.info(m.now());
            assert_eq!(
                (info.available, info.healthy_rows, info.tolerates),
                (true, 4, 1)
            );
            // A suspect's row is not free yet: a newcomer copies a live row instead.
            match m.offer_row(o, 99).unwrap() {
                JoinOffer::Replica { row, holders } => {
                    assert_ne!(row, crashed, "seed {seed}");
                    assert!(holders.iter().all(|h| h.row == row));
                }
                other => panic!("seed {seed}: expected a replica, got {other:?}"),
            }
        }

        // Dead everywhere no later than `dead_after` past its last heartbeat.
        let all_dead = |m: &SimMesh| {
            others
                .iter()
                .all(|&o| m.view(o).unwrap().health(&crashed) == Some(Health::Dead))
        };
        m.run_until(hc.dead_after + max_lat, all_dead)
            .unwrap_or_else(|| panic!("seed {seed}: not dead in time"));
        for &o in &others {
            let at = m.health_change(o, crashed, Health::Dead, t_crash).unwrap();
            assert!(
                at <= t_crash + hc.dead_after + max_lat,
                "seed {seed}: {at:?}"
            );
            assert!(!m.live_rows_of(o).contains(&4));
            // Its row is offered to a newcomer, re-encoded from k live rows.
            match m.offer_row(o, 99).unwrap() {
                JoinOffer::Reencode { row, sources } => {
                    assert_eq!(row, 4, "seed {seed}, node {o}");
                    let rows: BTreeSet<u32> = sources.iter().map(|s| s.row).collect();
                    assert_eq!(rows.len(), K as usize);
                    assert!(rows.is_subset(&m.live_rows_of(o)));
                    for s in &sources {
                        assert_eq!(s.peer, s.row.to_string(), "node i holds row i");
                        assert_eq!(s.addrs, vec![format!("/sim/{}", s.row)]);
                    }
                }
                other => panic!("seed {seed}, node {o}: expected a re-encode offer, got {other:?}"),
            }
        }

        // It restarts with the same id and row: Healthy again everywhere.
        m.run_for(secs(2.0));
        m.restart(crashed).unwrap();
        let t_restart = m.elapsed();
        let back = m
            .run_until(secs(10.0), SimMesh::converged)
            .unwrap_or_else(|| panic!("seed {seed}: no convergence after the restart"));
        assert!(
            back - t_restart <= secs(3.0),
            "seed {seed}: took {:?}",
            back - t_restart
        );
        for &o in &others {
            assert!(
                m.health_change(o, crashed, Health::Healthy, t_restart)
                    .is_some()
            );
            let info = m.view(o).unwrap().info(m.now());
            assert_eq!((info.healthy_rows, info.tolerates), (5, 2));
        }
        let info = m.view(crashed).unwrap().info(m.now());
        assert_eq!((info.available, info.healthy_rows), (true, 5));
        eprintln!(
            "seed {seed}: crashed at {t_crash:?}, restarted at {t_restart:?}, converged at {back:?}"
        );
    }
}

#[test]
fn a_quick_restart_converges_again() {
    let _machine = crate::machine::share();
    let hc = HealthConfig::default();
    for seed in 0..6 {
        let mut m = mesh(seed, 0.1);
        m.run_until(secs(10.0), SimMesh::converged).unwrap();
        m.run_for(secs(3.0));
        m.crash(2);
        m.run_for(secs(1.0));
        m.restart(2).unwrap();
        let t_restart = m.elapsed();
        // Its heartbeat sequence restarts from zero, below what the others last saw; they
        // take it again at the latest once they suspect it.
        m.run_for(hc.suspect_after + hc.heartbeat_interval);
        let back = m
            .run_until(secs(3.0), SimMesh::converged)
            .unwrap_or_else(|| panic!("seed {seed}: no convergence after a quick restart"));
        // Every node that suspected it took it back at its next heartbeat after that.
        let mut healthy_again = t_restart;
        for o in [0u32, 1, 3, 4] {
            if let Some(s) = m.health_change(o, 2, Health::Suspect, t_restart) {
                let h = m.health_change(o, 2, Health::Healthy, s).unwrap();
                assert!(
                    h - s <= secs(3.0),
                    "seed {seed}: node {o} suspected it for {:?}",
                    h - s
                );
                healthy_again = healthy_again.max(h);
            }
        }
        assert!(healthy_again - t_restart <= hc.suspect_after + secs(2.0));
        let suspected = (0..5)
            .filter(|&o| m.health_change(o, 2, Health::Suspect, t_restart).is_some())
            .count();
        eprintln!(
            "seed {seed}: restarted at {t_restart:?}, converged by {back:?}; {suspected} nodes \
             suspected the restarted node, the last took it back at {healthy_again:?}"
        );
    }
}

#[test]
fn a_partition_of_three_and_two_heals_and_converges() {
    let _machine = crate::machine::share();
    let hc = HealthConfig::default();
    for seed in 0..6 {
        let mut m = mesh(seed, 0.1);
        m.run_until(secs(10.0), SimMesh::converged).unwrap();
        let (big, small) = ([0u32, 1, 2], [3u32, 4]);
        m.partition(&[&big, &small]);
        let split = |m: &SimMesh| {
            big.iter().all(|&o| m.sees_exactly(o, &big))
                && small.iter().all(|&o| m.sees_exactly(o, &small))
        };
        let t_split = m.elapsed();
        let seen = m
            .run_until(hc.suspect_after + m.net().max_latency, split)
            .unwrap_or_else(|| panic!("seed {seed}: sides never saw the split"));
        m.run_for(hc.dead_after);
        for &o in &big {
            let view = m.view(o).unwrap();
            let info = view.info(m.now());
            assert_eq!(
                (info.available, info.healthy_rows, info.tolerates),
                (true, 3, 0)
            );
            assert!(small.iter().all(|p| view.health(p) == Some(Health::Dead)));
        }
        for &o in &small {
            let info = m.view(o).unwrap().info(m.now());
            assert_eq!(
                (info.available, info.healthy_rows),
                (false, 2),
                "seed {seed}"
            );
            // Two rows cannot re-create a third.
            assert_eq!(m.offer_row(o, 99).unwrap(), JoinOffer::Full);
        }

        m.heal();
        let t_heal = m.elapsed();
        let back = m
            .run_until(secs(10.0), SimMesh::converged)
            .unwrap_or_else(|| panic!("seed {seed}: no convergence after healing"));
        assert!(
            back - t_heal <= secs(3.0),
            "seed {seed}: took {:?}",
            back - t_heal
        );
        m.run_for(secs(5.0));
        assert!(m.converged());
        let views: BTreeSet<Vec<(u32, u32)>> = m
            .ids()
            .iter()
            .map(|&o| m.view(o).unwrap().live_rows())
            .collect();
        assert_eq!(views.len(), 1, "every view agrees: {views:?}");
        eprintln!(
            "seed {seed}: split at {t_split:?}, seen at {seen:?}, healed at {t_heal:?}, \
             converged at {back:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// 4. Growing the code
// ---------------------------------------------------------------------------------------------

/// Builds row `genesis` of a tiny model in `format` along each chain of `offered` (source rows)
/// through memory holders of rows `0..genesis`, and checks it is the row encoding gives and the
/// bytes each node received: the joiner one shard's worth (a compact row exactly its own
/// bytes), each source after the first one running sum per piece, everyone else nothing.
fn chains_send_one_shard(format: ShardFormat, genesis: u32, room: u32, offered: &[Vec<u32>]) {
    let weights = ModelWeights::synthetic(tiny_config(), 5).unwrap();
    let g = match format {
        ShardFormat::Q8 => Generator::integer(genesis as usize, K as usize, Some(room as usize)),
        _ => Generator::growing(genesis as usize, K as usize, Some(room as usize)),
    }
    .unwrap();
    let encode = |row: u32| ShardSet::encode(&weights, &g, row as usize, format, &mut |_, _| {});
    let direct = encode(genesis).unwrap();
    let manifest = ModelManifest {
        name: "tiny".into(),
        cfg: tiny_config(),
        leader: LeaderWeights::from_model(&weights),
        tokenizer: TokenizerData {
            json: String::new(),
            eos: Vec::new(),
            default_system: None,
            sampling: Default::default(),
        },
        generator: g.clone(),
        format,
        learning: LearningConfig::default(),
        verify_noise: node_core::coded::DEFAULT_NOISE,
        mesh_key: node_core::learn::MeshKey::of(&libp2p::identity::Keypair::generate_ed25519())
            .to_bytes(),
        canary_loss: None,
    };
    let holders: BTreeMap<u32, ShardSet> = (0..genesis).map(|r| (r, encode(r).unwrap())).collect();
    let shard_bytes = direct.bytes() as u64;
    let shapes = node_core::coded::shapes(&manifest.cfg, &g);
    let pieces = node_core::chain::pieces(&shapes, g.sub_blocks()).len() as u64;
    // A running sum: f32 values, or a compact chain's integer sums (at most four bytes each).
    let sum_bytes = node_core::chain::row_values(&shapes, g.sub_blocks()) * 4;
    // Framing of each answer: a few bytes of protocol header and length prefix.
    let framing = 16 * pieces;
    for rows in offered {
        // The joiner (id 100) asks holder 0, which offers the row built along `rows`.
        let sources = rows
            .iter()
            .map(|&r| SourceRow {
                row: r,
                peer: r.to_string(),
                addrs: Vec::new(),
            })
            .collect();
        let net = MemoryHolders::new(
            manifest.clone(),
            holders.clone(),
            JoinOffer::Reencode {
                row: genesis,
                sources,
            },
        );
        let joined =
            pollster::block_on(node_core::holder::join(&net.link(100), &0, &manifest)).unwrap();
        assert!(joined.how.contains("a new row"), "{}", joined.how);
        let built = joined.shard;
        assert_eq!(built.node, genesis as usize);
        for (b, d) in built.matrices().zip(direct.matrices()) {
            match format {
                ShardFormat::Q8 => assert_eq!(b.values, d.values, "rows {rows:?}"),
                _ => assert!(relative_error(values(b), values(d)) < 1e-5, "rows {rows:?}"),
            }
        }
        // The joiner: one shard's worth (and a few small answers). A compact piece's parity
        // integers travel entropy-coded, so its wire bytes may be fewer than the row's.
        let joiner = net.received(100);
        assert_eq!(joined.received, shard_bytes, "{format:?}, rows {rows:?}");
        assert!(
            joiner <= shard_bytes + framing + 4096
                && (format == ShardFormat::Q8 || joiner >= shard_bytes),
            "{format:?}, rows {rows:?}: the joiner received {joiner}, one shard is {shard_bytes}"
        );
        assert_eq!(net.received(rows[0]), 0, "rows {rows:?}: the chain's first");
        for &r in &rows[1..] {
            let got = net.received(r);
            assert!(
                got > 0 && got <= sum_bytes + framing,
                "{format:?}, rows {rows:?}: row {r} received {got}, one running sum is {sum_bytes}"
            );
            if format == ShardFormat::F32 {
                assert!(got >= shard_bytes, "rows {rows:?}: row {r} received {got}");
            }
        }
        for r in (0..genesis).filter(|r| !rows.contains(r)) {
            assert_eq!(net.received(r), 0, "row {r} is not in the chain");
        }
    }
}

/// The f32 values of a shard.
fn values(s: &node_core::coded::Shard) -> &[f32] {
    match &s.values {
        node_core::coded::ShardValues::F32(v) => v,
        _ => panic!("the test encodes f32 shards"),
    }
}

#[test]
fn joiners_on_two_sides_of_a_partition_get_one_new_row_with_one_content() {
    let _machine = crate::machine::share();
    // Six genesis rows (k = 3), room for eight: each side of a 3 + 3 split can build a row.
    let (genesis, room) = (6u32, 8u32);
    for seed in 0..4 {
        let mut m = SimMesh::new(
            seed,
            K,
            genesis,
            HealthConfig::default(),
            NetConfig::default(),
        )
        .with_room(room);
        for id in 0..genesis {
            m.add_node(id, Some(id)).unwrap();
        }
        m.run_until(secs(10.0), SimMesh::converged).unwrap();
        let (a, b) = ([0u32, 1, 2], [3u32, 4, 5]);
        m.partition(&[&a, &b]);
        m.run_for(secs(0.5));
        // Both sides still count every row as held, so each offers the first new row.
        let mut offered = Vec::new();
        for (observer, joiner) in [(0u32, 10u32), (3, 11)] {
            match m.offer_row(observer, joiner).unwrap() {
                JoinOffer::Reencode { row, sources } => {
                    assert_eq!(row, genesis, "seed {seed}: the lowest new row");
                    assert_eq!(sources.len(), K as usize);
                    offered.push(sources.iter().map(|s| s.row).collect::<Vec<_>>());
                }
                other => panic!("seed {seed}: expected a new row, got {other:?}"),
            }
        }
        m.add_node(10, Some(genesis)).unwrap();
        m.add_node(11, Some(genesis)).unwrap();
        m.partition(&[&[0, 1, 2, 10], &[3, 4, 5, 11]]);
        m.run_for(secs(1.0));
        m.heal();
        m.run_until(secs(10.0), SimMesh::converged)
            .unwrap_or_else(|| panic!("seed {seed}: no convergence after healing"));
        // One row with two holders, seen alike everywhere; the next joiner gets the next row.
        for o in m.up_nodes() {
            let info = m.view(o).unwrap().info(m.now());
            assert_eq!((info.n, info.n_max), (genesis + 1, room), "seed {seed}");
            let new = info.rows.iter().find(|r| r.row == genesis).unwrap();
            assert_eq!((new.holders.len(), new.healthy), (2, 2), "seed {seed}");
        }
        assert!(matches!(
            m.offer_row(0, 12).unwrap(),
            JoinOffer::Reencode { row, .. } if row == genesis + 1
        ));
        if seed == 0 {
            // Whatever sources each side used, the new row built along their chain is the same
            // codeword, and no node of the chain received more than one shard's worth: for f32
            // rows and for compact ones (whose joiner receives exactly its row's bytes).
            for format in [ShardFormat::F32, ShardFormat::Q8] {
                chains_send_one_shard(format, genesis, room, &offered);
            }
        }
    }
}
