//! A learning update spreading to 100, 1000 and 10 000 home holders in virtual time
//! (tests/src/spread.rs): a tree of three from the leader, pieces forwarded as they come,
//! 10 % of the holders dying a minute, against the leader handing it to every holder itself.
//! Prints the tables docs/perf.md records; the goals are issue 57's.

#![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

use node_core::code::Generator;
use node_core::model::LlamaConfig;
use tests::spread::{SpreadConfig, leader_hands_out_s, llama_8b, run_spread, update_bytes};

#[test]
fn an_update_reaches_every_live_holder_through_a_tree_the_leader_pays_three_copies_for() {
    let _machine = crate::machine::share();
    let smol = LlamaConfig::smollm2_135m();
    let big = llama_8b();
    let (g3, g4) = (
        Generator::cauchy(5, 3).unwrap(),
        Generator::cauchy(6, 4).unwrap(),
    );
    let sizes = [
        (
            "SmolLM2-135M, k = 3",
            update_bytes(&smol, 8, 0, None),
            update_bytes(&smol, 8, 0, Some(&g3)),
        ),
        (
            "Llama-3.1-8B shape, k = 4",
            update_bytes(&big, 8, 256, None),
            update_bytes(&big, 8, 256, Some(&g4)),
        ),
    ];
    println!("| model | an update, every holder the same | one row's encoded share |");
    println!("|---|---|---|");
    for (name, full, share) in sizes {
        println!(
            "| {name} | {full} bytes | {share} bytes ({:.0} %) |",
            100.0 * share as f64 / full as f64
        );
        assert!(share < full, "{name}: a share is smaller than the whole");
    }
    // The wire size `codedmesh bench --learning` measured for SmolLM2 (docs/perf.md).
    let smol_bytes = sizes[0].1;
    assert!(
        smol_bytes.abs_diff(4_992_604) < 4096,
        "SmolLM2's update is {smol_bytes} bytes, the bench measured 4 992 604"
    );
    println!(
        "\n| update | holders | leader sends (× the update) | applied p50 / p99 / last | relays p50 / p99 (2·log₂ n) | died / pulled / missed | duplicate bytes a holder | the leader to every holder: last applied |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for (name, bytes) in [("SmolLM2", smol_bytes), ("8B shape", sizes[1].1)] {
        for holders in [100, 1000, 10_000] {
            let cfg = SpreadConfig {
                holders,
                update_bytes: bytes,
                ..SpreadConfig::default()
            };
            let r = run_spread(&cfg);
            let bound = 2.0 * (holders as f64).log2();
            println!(
                "| {name} | {holders} | {:.0} | {:.1} / {:.1} / {:.1} s | {} / {} ({bound:.0}) | {} / {} / {} | {:.0} | {:.0} s |",
                r.leader_copies,
                r.applied_s.0,
                r.applied_s.1,
                r.applied_s.2,
                r.rounds.0,
                r.rounds.1,
                r.died,
                r.pulled,
                r.missed,
                r.duplicate_bytes,
                leader_hands_out_s(&cfg),
            );
            assert!(r.leader_copies <= 3.0, "{r:?}");
            assert!(r.rounds.1 as f64 <= bound, "{holders}: {r:?}");
            assert_eq!(r.missed, 0, "{r:?}");
            if name == "SmolLM2" && holders == 1000 {
                assert!(
                    r.applied_s.2 <= 30.0,
                    "every live holder of 1000 at the newest version within 30 s: {r:?}"
                );
            }
            if holders == 10_000 {
                assert!(r.died > 0 && r.pulled > 0, "churn happened: {r:?}");
            }
        }
    }
}
