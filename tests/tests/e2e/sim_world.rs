//! The mesh on a world map, in virtual time (tests/src/scale.rs over tests/src/world.rs): 1000
//! holders in six regions (homes and datacentres) join a grown k = 3 code and churn at 10 % a
//! minute while a leader in a Frankfurt datacentre serves with eight groups of disjoint
//! holders. The real `MeshView` measures and estimates the round trips (pings, the holders'
//! network coordinates in their heartbeats), and the leader picks its groups the way `form`
//! does: by PeerId (before issue 80) or by latency. Prints the table docs/perf.md records,
//! with a Petals-style pipeline on the same map beside it.

#![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

use std::time::Duration;

use node_core::code::Generator;
use node_core::model::LlamaConfig;
use tests::scale::{Picking, ScaleConfig, round_bytes, run_scale};
use tests::sim::SimRng;
use tests::world::{Place, World};

/// Seed of the map, the churn and every draw.
const SEED: u64 = 80;

/// A Petals-style pipeline's token on the same map: the leader's request passes through
/// `hops` servers in turn, each holding its share of the layers, and comes back; the servers
/// are the nearest to the previous hop (as Petals routes by measured latency) or random ones.
/// The compute of a whole token, `compute`, is the same as the coded group's.
fn pipeline_ms(world: &World, leader: &Place, holders: &[Place], hops: usize, near: bool) -> f64 {
    let mut rng = SimRng::new(SEED + 1);
    let mut at = *leader;
    let mut used = Vec::new();
    let mut total = Duration::ZERO;
    for _ in 0..hops {
        let next = if near {
            (0..holders.len())
                .filter(|i| !used.contains(i))
                .min_by_key(|&i| world.one_way(&at, &holders[i]))
                .unwrap()
        } else {
            (rng.next_u64() % holders.len() as u64) as usize
        };
        used.push(next);
        total += world.one_way(&at, &holders[next]);
        at = holders[next];
    }
    total += world.one_way(&at, leader);
    total.as_secs_f64() * 1000.0
}

#[test]
fn latency_picked_groups_beat_peer_id_picked_ones_on_a_world_map() {
    let _machine = crate::machine::share();
    let world = World::default();
    println!(
        "| model | picking | ms a token p50 / p99 | tokens/s (8 groups) | tokens | failed requests | groups formed again closer |"
    );
    println!("|---|---|---|---|---|---|---|");
    let shapes = [
        (
            "SmolLM2-135M",
            LlamaConfig::smollm2_135m(),
            122,
            (Duration::from_micros(300), Duration::from_micros(700)),
        ),
        (
            "8B shape",
            tests::spread::llama_8b(),
            70,
            (Duration::from_millis(2), Duration::from_millis(4)),
        ),
    ];
    for (name, cfg, rounds, compute) in shapes {
        let mut p50 = Vec::new();
        for picking in [Picking::PeerId, Picking::Latency] {
            let sim = ScaleConfig {
                seed: SEED,
                groups: 8,
                duration: Duration::from_secs(300),
                rounds_per_token: rounds,
                compute,
                round_bytes: round_bytes(&cfg, &Generator::cauchy(5, 3).unwrap()),
                world: Some(world),
                picking,
                ..ScaleConfig::default()
            };
            let r = run_scale(sim).unwrap();
            let (a, b) = (r.token_ms_at(0.5).unwrap(), r.token_ms_at(0.99).unwrap());
            println!(
                "| {name} | {picking:?} | {a:.0} / {b:.0} | {:.2} | {} | {} | {} |",
                r.tokens_per_s, r.tokens, r.failed, r.reformed
            );
            assert!(r.tokens >= 16, "{name}, {picking:?}: {r:?}");
            assert_eq!(r.unrecoverable_seconds, 0, "{r:?}");
            p50.push(a);
        }
        // Petals-style, the same compute a token, four servers.
        let mean = (compute.0 + compute.1).as_secs_f64() / 2.0 * 1000.0;
        let work = mean * f64::from(rounds) * 3.0;
        let mut rng = SimRng::new(SEED);
        let leader = world.place_in(0, true, &mut rng);
        let holders: Vec<Place> = (0..1000).map(|_| world.place(&mut rng)).collect();
        let near = pipeline_ms(&world, &leader, &holders, 4, true) + work;
        let anywhere = pipeline_ms(&world, &leader, &holders, 4, false) + work;
        println!(
            "| {name} | Petals-style pipeline, 4 servers nearest / anywhere | {near:.0} / {anywhere:.0} | | | | |"
        );
        assert!(
            p50[0] >= 3.0 * p50[1],
            "{name}: latency-picked p50 {:.0} ms is not 3× better than PeerId-picked {:.0} ms",
            p50[1],
            p50[0]
        );
    }
}
