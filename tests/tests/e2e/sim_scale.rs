//! The mesh at scale in virtual time (tests/src/scale.rs): 1000 holders join a grown k = 3
//! code and 10% of them leave (and as many join) every simulated minute, some in the middle of
//! a round, while one leader serves with 1 to 64 groups of disjoint holders through its own
//! uplink, downlink and cores. Prints the table docs/perf.md records.

#![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

use tests::scale::{ScaleConfig, run_scale};

#[test]
fn throughput_grows_with_groups_to_the_leaders_limits_and_churn_fails_no_request() {
    let _machine = crate::machine::share();
    let (request, answer) = ScaleConfig::default().round_bytes;
    println!(
        "a round: {request} bytes of request to each member, {answer} of answer, on average\n"
    );
    println!(
        "| leader | groups | tokens/s | × one group | the leader's bound | uplink / downlink / busiest core busy | requests | failed | passes failed | died mid-round | groups formed again | left / joined | fewest holders of a row |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let profiles: [(&str, f64, usize, &[usize]); 3] = [
        ("1 Gbit/s, 8 cores", 1000.0, 8, &[1, 2, 4, 8, 16, 32, 64]),
        ("100 Mbit/s, 4 cores", 100.0, 4, &[1, 4, 8, 16]),
        ("10 Mbit/s, 2 cores", 10.0, 2, &[1, 2]),
    ];
    for (leader, mbit, cores, counts) in profiles {
        // One group's throughput under this leader: a round waits for its own bytes too.
        let mut one = None;
        for &groups in counts {
            let cfg = ScaleConfig {
                groups,
                leader_cores: cores,
                leader_link: (mbit * 1e6 / 8.0, mbit * 1e6 / 8.0),
                ..ScaleConfig::default()
            };
            let bound = cfg.leader_bound();
            let r = run_scale(cfg).unwrap();
            let base = *one.get_or_insert(r.tokens_per_s);
            let expected = (base * groups as f64).min(bound);
            println!(
                "| {leader} | {groups} | {:.1} | {:.2} | {bound:.1} | {:.0} / {:.0} / {:.0} % | {} | {} | {} | {} | {} | {} / {} | {} |",
                r.tokens_per_s,
                r.tokens_per_s / base,
                100.0 * r.leader_busy.0,
                100.0 * r.leader_busy.1,
                100.0 * r.leader_busy.2,
                r.requests,
                r.failed,
                r.failed_passes,
                r.died_mid_round,
                r.replaced,
                r.churned.0,
                r.churned.1,
                r.min_holders
            );
            assert!(
                r.tokens_per_s >= 0.8 * expected,
                "{leader}, {groups} groups: {:.1} tokens/s, under 80% of {expected:.1} (linear, or the leader's bound): {r:?}",
                r.tokens_per_s
            );
            assert!(
                r.tokens_per_s <= 1.02 * bound,
                "{leader}, {groups} groups: {:.1} tokens/s beyond the leader's bound {bound:.1}: {r:?}",
                r.tokens_per_s
            );
            assert_eq!(r.failed, 0, "{r:?}");
            assert_eq!(r.turned_away, 0, "{r:?}");
            assert_eq!(r.unrecoverable_seconds, 0, "{r:?}");
            assert!(r.min_holders >= 1, "a row lost every holder: {r:?}");
            assert!(r.churned.0 > 100, "churn happened: {r:?}");
        }
    }
}
