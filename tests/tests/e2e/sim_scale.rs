//! The mesh at scale in virtual time (tests/src/scale.rs): 1000 holders join a grown k = 3
//! code and 10% of them leave (and as many join) every simulated minute, while one leader
//! serves with 1 to 64 groups of disjoint holders. Prints the table docs/perf.md records.

#![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

use tests::scale::{ScaleConfig, run_scale};

#[test]
fn throughput_grows_with_groups_and_churn_fails_no_request() {
    let _machine = crate::machine::share();
    println!(
        "| groups | rows (room) | tokens/s | × one group | requests | failed | rounds asked again | members replaced | left / joined | fewest holders of a row |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut one = None;
    for groups in [1, 2, 4, 8, 16, 32, 64] {
        let r = run_scale(ScaleConfig {
            groups,
            ..ScaleConfig::default()
        })
        .unwrap();
        let base = *one.get_or_insert(r.tokens_per_s);
        let speedup = r.tokens_per_s / base;
        println!(
            "| {groups} | {} ({}) | {:.1} | {speedup:.2} | {} | {} | {} | {} | {} / {} | {} |",
            r.rows.0,
            r.rows.1,
            r.tokens_per_s,
            r.requests,
            r.failed,
            r.retried_rounds,
            r.replaced,
            r.churned.0,
            r.churned.1,
            r.min_holders
        );
        assert!(
            speedup >= 0.8 * groups as f64,
            "{groups} groups: {speedup:.2}× one group's throughput, under 80% of linear: {r:?}"
        );
        assert_eq!(r.failed, 0, "{r:?}");
        assert_eq!(r.turned_away, 0, "{r:?}");
        assert_eq!(r.unrecoverable_seconds, 0, "{r:?}");
        assert!(r.min_holders >= 1, "a row lost every holder: {r:?}");
        assert!(r.churned.0 > 100, "churn happened: {r:?}");
    }
}
