//! Tests of [`super`].

use super::*;

fn hb(row: Option<u32>) -> Heartbeat {
    Heartbeat::for_test(row)
}

/// `hb` from `from`, arriving at `now` as it would from a peer started at `t0`.
fn beat(v: &mut MeshView<u32>, t0: Instant, now: Instant, from: u32, hb: Heartbeat) {
    let uptime_ms = now.saturating_duration_since(t0).as_millis() as u64;
    v.handle_heartbeat(now, from, Heartbeat { uptime_ms, ..hb });
}

#[test]
fn health_moves_with_silence_and_recovers() {
    let t0 = Instant::now();
    let cfg = HealthConfig::default();
    let mut v = MeshView::new(t0, 0u32, cfg, 2, (3, 3), "m".into(), hb(Some(0))).unwrap();
    beat(&mut v, t0, t0, 1, hb(Some(1)));
    assert_eq!(v.live_rows(), vec![(0, 0), (1, 1)]);
    v.handle_timeout(t0 + cfg.suspect_after);
    assert_eq!(v.health(&1), Some(Health::Suspect));
    assert_eq!(v.live_rows().len(), 1);
    v.handle_timeout(t0 + cfg.dead_after);
    assert_eq!(v.health(&1), Some(Health::Dead));
    assert!(!v.info(t0 + cfg.dead_after).available);
    beat(&mut v, t0, t0 + cfg.dead_after, 1, hb(Some(1)));
    assert_eq!(v.health(&1), Some(Health::Healthy));
    assert!(v.info(t0 + cfg.dead_after).available);
}

#[test]
fn a_late_heartbeat_of_an_earlier_incarnation_does_not_overwrite_a_restart() {
    let t0 = Instant::now();
    let cfg = HealthConfig::default();
    let mut v = MeshView::new(t0, 0u32, cfg, 2, (3, 3), "m".into(), hb(Some(0))).unwrap();
    let restarted = Heartbeat {
        incarnation: 2,
        device: "gpu".into(),
        ..hb(Some(1))
    };
    let old = Heartbeat {
        seq: 40,
        ..hb(Some(1))
    };
    v.handle_heartbeat(t0, 1, restarted.clone());
    // Gossip hands a peer that just joined the old process's last heartbeat after the new.
    v.handle_heartbeat(t0, 1, old.clone());
    let device = |v: &MeshView<u32>| {
        v.info(t0)
            .nodes
            .iter()
            .find(|n| n.peer == "1")
            .map(|n| n.device.clone())
    };
    assert_eq!(device(&v).as_deref(), Some("gpu"));
    // Once the newer incarnation is dead, an earlier one counts again (a clock set back).
    v.handle_timeout(t0 + cfg.dead_after);
    assert_eq!(v.health(&1), Some(Health::Dead));
    v.handle_heartbeat(t0 + cfg.dead_after, 1, old);
    assert_eq!(device(&v).as_deref(), Some("cpu"));
    assert_eq!(v.health(&1), Some(Health::Healthy));
}

#[test]
fn a_heartbeat_gossip_delivers_late_does_not_revive_a_silent_peer() {
    let t0 = Instant::now();
    let ms = Duration::from_millis;
    let cfg = HealthConfig {
        heartbeat_interval: ms(200),
        suspect_after: ms(800),
        dead_after: ms(2000),
    };
    let mut v = MeshView::new(t0, 0u32, cfg, 2, (3, 3), "m".into(), hb(Some(0))).unwrap();
    let sent = |seq: u64, uptime: u64| Heartbeat {
        seq,
        uptime_ms: uptime,
        ..hb(Some(1))
    };
    // A heartbeat every 200 ms, each 3 ms on the way.
    for i in 0..5 {
        v.handle_heartbeat(t0 + ms(200 * i + 3), 1, sent(i, 200 * i));
    }
    // The peer dies after the one it sent at 1 s, which reaches this node only at 3.5 s,
    // through gossip.
    let later = t0 + ms(3500);
    v.handle_timeout(later);
    assert_eq!(v.health(&1), Some(Health::Dead));
    v.handle_heartbeat(later, 1, sent(5, 1000));
    assert_eq!(
        v.health(&1),
        Some(Health::Dead),
        "a late heartbeat is no news"
    );
    // One sent now counts.
    v.handle_heartbeat(later + ms(2), 1, sent(6, 3500));
    assert_eq!(v.health(&1), Some(Health::Healthy));
}

#[test]
fn the_mesh_usage_sums_what_every_node_was_told() {
    let t0 = Instant::now();
    let cfg = HealthConfig::default();
    let mut v = MeshView::new(t0, 0u32, cfg, 2, (3, 3), "m".into(), hb(Some(0))).unwrap();
    let one = Usage::of_request(5, 8, Duration::from_millis(1500), Some(2.25));
    assert_eq!(
        (one.latency_ms, one.trained, one.loss_micro),
        (1500, 1, 2_250_000)
    );
    let mut local = v.local().clone();
    local.usage.add(&one);
    v.set_local(local);
    let mut peer = hb(Some(1));
    peer.usage = Usage::of_request(3, 4, Duration::from_millis(500), None);
    beat(&mut v, t0, t0, 1, peer);
    let info = v.info(t0);
    let u = info.usage;
    assert_eq!((u.requests, u.prompt_tokens, u.tokens), (2, 8, 12));
    assert_eq!(
        (u.latency_ms, u.trained, u.loss_micro),
        (2000, 1, 2_250_000)
    );
    let of = |p: &str| info.nodes.iter().find(|n| n.peer == p).map(|n| n.usage);
    assert_eq!(of("1").map(|u| u.tokens), Some(4));
}

#[test]
fn other_models_are_refused() {
    let t0 = Instant::now();
    let mut v = MeshView::new(
        t0,
        0u32,
        HealthConfig::default(),
        1,
        (2, 2),
        "m".into(),
        hb(None),
    )
    .unwrap();
    let mut other = hb(Some(1));
    other.model = [9; 32];
    beat(&mut v, t0, t0, 5, other);
    assert!(matches!(v.poll_event(), Some(MeshEvent::Refused { .. })));
    assert!(v.live_rows().is_empty());
}

#[test]
fn a_reservation_ends_when_the_old_holder_returns() {
    let t0 = Instant::now();
    let cfg = HealthConfig::default();
    let mut v = MeshView::new(t0, 0u32, cfg, 2, (3, 3), "m".into(), hb(Some(0))).unwrap();
    beat(&mut v, t0, t0, 1, hb(Some(1)));
    beat(&mut v, t0, t0, 2, hb(Some(2)));
    let later = t0 + cfg.dead_after;
    beat(&mut v, t0, later, 1, hb(Some(1)));
    v.handle_timeout(later);
    assert!(matches!(
        v.offer_row(later, 9),
        JoinOffer::Reencode { row: 2, .. }
    ));
    // Row 2's holder comes back before the joiner took the row: no row is free any more,
    // so the joiner becomes a second holder of a row.
    beat(&mut v, t0, later, 2, hb(Some(2)));
    assert!(matches!(
        v.offer_row(later, 9),
        JoinOffer::Replica { row: 0, .. }
    ));
}

#[test]
fn offers_free_rows_once_and_dead_rows_again() {
    let t0 = Instant::now();
    let cfg = HealthConfig::default();
    let mut local = hb(Some(0));
    local.offers = vec![1, 2];
    let mut v = MeshView::new(t0, 0u32, cfg, 2, (3, 3), "m".into(), local).unwrap();
    assert_eq!(v.offer_row(t0, 10), JoinOffer::Genesis { row: 1 });
    assert_eq!(
        v.offer_row(t0, 10),
        JoinOffer::Genesis { row: 1 },
        "same joiner, same row"
    );
    assert_eq!(v.offer_row(t0, 11), JoinOffer::Genesis { row: 2 });
    // Rows 1 and 2 are reserved: the third joiner copies the only row that has a holder.
    assert!(matches!(
        v.offer_row(t0, 12),
        JoinOffer::Replica { row: 0, .. }
    ));
    beat(&mut v, t0, t0, 10, hb(Some(1)));
    beat(&mut v, t0, t0, 11, hb(Some(2)));
    // The seed hands out its last rows and stops offering; node 11 dies.
    let mut local = hb(Some(0));
    local.offers.clear();
    v.set_local(local);
    let later = t0 + cfg.dead_after;
    beat(&mut v, t0, later, 10, hb(Some(1)));
    v.handle_timeout(later);
    match v.offer_row(later, 13) {
        JoinOffer::Reencode { row, sources } => {
            assert_eq!(row, 2);
            assert_eq!(
                sources.iter().map(|s| s.row).collect::<Vec<_>>(),
                vec![0, 1]
            );
        }
        other => panic!("expected a re-encode offer, got {other:?}"),
    }
}

#[test]
fn a_holder_behind_rebuilds_from_a_replica_else_from_k_other_rows_at_the_version() {
    let t0 = Instant::now();
    let cfg = HealthConfig::default();
    let ahead = |row| Heartbeat {
        version_count: 40,
        version_digest: [9; 32],
        ..hb(Some(row))
    };
    // This node holds row 0 at the genesis version; rows 1 and 2 are ahead, row 3 is not.
    let mut v = MeshView::new(t0, 0u32, cfg, 2, (4, 4), "m".into(), hb(Some(0))).unwrap();
    assert_eq!(
        v.rebuild_offer([9; 32]),
        JoinOffer::Full,
        "nobody is there yet"
    );
    beat(&mut v, t0, t0, 1, ahead(1));
    beat(&mut v, t0, t0, 3, hb(Some(3)));
    assert_eq!(
        v.rebuild_offer([9; 32]),
        JoinOffer::Full,
        "one row at the version, k = 2"
    );
    beat(&mut v, t0, t0, 2, ahead(2));
    match v.rebuild_offer([9; 32]) {
        JoinOffer::Reencode { row, sources } => {
            assert_eq!(row, 0);
            let rows: Vec<u32> = sources.iter().map(|s| s.row).collect();
            assert_eq!(rows, vec![1, 2], "k other rows at the version, not row 3");
        }
        other => panic!("expected a chain, got {other:?}"),
    }
    // Another holder of row 0 at the version: copy it instead.
    beat(&mut v, t0, t0, 7, ahead(0));
    match v.rebuild_offer([9; 32]) {
        JoinOffer::Replica { row, holders } => {
            assert_eq!(row, 0);
            assert_eq!(holders.len(), 1);
            assert_eq!(holders[0].peer, "7");
        }
        other => panic!("expected a replica, got {other:?}"),
    }
}

#[test]
fn a_caught_node_leaves_the_live_rows_and_its_row_is_offered_again() {
    let t0 = Instant::now();
    let cfg = HealthConfig::default();
    let mut v = MeshView::new(t0, 0u32, cfg, 2, (4, 4), "m".into(), hb(Some(0))).unwrap();
    for p in 1..4 {
        beat(&mut v, t0, t0, p, hb(Some(p)));
    }
    assert_eq!(v.live_rows().len(), 4);
    assert!(matches!(
        v.offer_row(t0, 9),
        JoinOffer::Replica { row: 0, .. }
    ));
    v.report_caught(2, "residual 1e-3 > 1e-5".into());
    let rows: Vec<u32> = v.live_rows().iter().map(|(r, _)| *r).collect();
    assert_eq!(rows, vec![0, 1, 3]);
    match v.offer_row(t0, 9) {
        JoinOffer::Reencode { row, sources } => {
            assert_eq!(row, 2);
            assert!(sources.iter().all(|s| s.row != 2), "{sources:?}");
        }
        other => panic!("expected a re-encode offer, got {other:?}"),
    }
    let info = v.info(t0);
    let caught: Vec<_> = info.nodes.iter().filter(|n| n.caught.is_some()).collect();
    assert_eq!(caught.len(), 1);
    assert_eq!(caught[0].row, Some(2));
    assert_eq!(info.healthy_rows, 3);
}

#[test]
fn a_full_code_grows_a_row_then_adds_replicas_to_the_thinnest_rows() {
    let t0 = Instant::now();
    let cfg = HealthConfig::default();
    // k = 2, three genesis rows, room for five.
    let mut v = MeshView::new(t0, 0u32, cfg, 2, (3, 5), "m".into(), hb(Some(0))).unwrap();
    beat(&mut v, t0, t0, 1, hb(Some(1)));
    beat(&mut v, t0, t0, 2, hb(Some(2)));
    for (joiner, row) in [(10, 3), (11, 4)] {
        match v.offer_row(t0, joiner) {
            JoinOffer::Reencode { row: r, sources } => {
                assert_eq!(r, row);
                assert_eq!(sources.len(), 2);
            }
            other => panic!("joiner {joiner}: expected a new row, got {other:?}"),
        }
    }
    // No room left: replicas, spread over the rows with the fewest holders.
    let replica = |v: &mut MeshView<u32>, joiner| match v.offer_row(t0, joiner) {
        JoinOffer::Replica { row, holders } => (row, holders.len()),
        other => panic!("joiner {joiner}: expected a replica, got {other:?}"),
    };
    assert_eq!(replica(&mut v, 12), (0, 1));
    assert_eq!(replica(&mut v, 13), (1, 1));
    assert_eq!(replica(&mut v, 12), (0, 1), "same joiner, same row");
    beat(&mut v, t0, t0, 10, hb(Some(3)));
    beat(&mut v, t0, t0, 11, hb(Some(4)));
    beat(&mut v, t0, t0, 12, hb(Some(0)));
    beat(&mut v, t0, t0, 13, hb(Some(1)));
    assert_eq!(replica(&mut v, 14), (2, 1));
    let info = v.info(t0);
    assert_eq!((info.n, info.n_max, info.healthy_rows), (5, 5, 5));
    let holders: Vec<usize> = info.rows.iter().map(|r| r.holders.len()).collect();
    assert_eq!(holders, vec![2, 2, 1, 1, 1]);
    // A row beyond the code's room is refused.
    beat(&mut v, t0, t0, 20, hb(Some(5)));
    assert!(v.health(&20).is_none());
}

#[test]
fn a_dead_holder_costs_nothing_while_its_row_has_another() {
    let t0 = Instant::now();
    let cfg = HealthConfig::default();
    let mut v = MeshView::new(t0, 0u32, cfg, 2, (3, 3), "m".into(), hb(Some(0))).unwrap();
    beat(&mut v, t0, t0, 1, hb(Some(1)));
    beat(&mut v, t0, t0, 2, hb(Some(1)));
    beat(&mut v, t0, t0, 3, hb(Some(2)));
    assert_eq!(v.live_rows(), vec![(0, 0), (1, 1), (2, 3)]);
    let later = t0 + cfg.dead_after;
    for p in [2, 3] {
        beat(&mut v, t0, later, p, hb(Some(if p == 2 { 1 } else { 2 })));
    }
    v.handle_timeout(later);
    assert_eq!(v.health(&1), Some(Health::Dead));
    assert_eq!(v.live_rows(), vec![(0, 0), (1, 2), (2, 3)]);
    let info = v.info(later);
    assert_eq!((info.healthy_rows, info.rows[1].healthy), (3, 1));
}

#[test]
fn holders_behind_this_node_are_counted_until_they_are_long_gone() {
    let t0 = Instant::now();
    let cfg = HealthConfig::default();
    let at = |count: u64, digest: u8| Heartbeat {
        version_count: count,
        version_digest: [digest; 32],
        ..hb(Some(1))
    };
    let me = Heartbeat {
        version_count: 5,
        version_digest: [5; 32],
        ..hb(Some(0))
    };
    let mut v = MeshView::new(t0, 0u32, cfg, 2, (6, 6), "m".into(), me).unwrap();
    beat(&mut v, t0, t0, 1, at(3, 3)); // two behind
    beat(&mut v, t0, t0, 2, at(5, 9)); // one count, another set
    beat(&mut v, t0, t0, 3, at(5, 5)); // at this version
    beat(&mut v, t0, t0, 4, at(7, 7)); // ahead
    beat(
        &mut v,
        t0,
        t0,
        5,
        Heartbeat {
            row: None,
            ..at(0, 0)
        },
    ); // a leader, no row
    let mut lags = v.lags(t0);
    lags.sort_unstable();
    assert_eq!(lags, vec![1, 2]);
    // Dead, a holder still counts for a while: a crashed node comes back in seconds.
    v.handle_timeout(t0 + cfg.dead_after);
    assert_eq!(v.health(&1), Some(Health::Dead));
    assert_eq!(v.lags(t0 + cfg.dead_after).len(), 2);
    assert!(
        v.lags(t0 + LAG_MEMORY).is_empty(),
        "long gone: nothing kept for it"
    );
}

#[test]
fn round_trips_place_a_node_and_a_bad_coordinate_is_refused() {
    let t0 = Instant::now();
    let cfg = HealthConfig::default();
    let mut v = MeshView::new(t0, 0u32, cfg, 2, (3, 3), "m".into(), hb(Some(0))).unwrap();
    // A round trip to a peer not heard from moves nothing.
    v.observe_rtt(&1, Duration::from_millis(30));
    assert!(!v.coord().is_placed());
    assert_eq!(v.rtt_to(&1), None);
    beat(&mut v, t0, t0, 1, hb(Some(1)));
    beat(&mut v, t0, t0, 2, hb(Some(2)));
    // Peer 2's distance is not known until coordinates or a measurement say it.
    assert_eq!(v.rtt_to(&2), None);
    for _ in 0..3 {
        v.observe_rtt(&1, Duration::from_millis(30));
    }
    assert!(v.coord().is_placed());
    assert_eq!(v.rtt_to(&1), Some(Duration::from_millis(30)));
    assert_eq!(v.rtt_to(&0), Some(Duration::ZERO));
    // The coordinate goes out with the next heartbeat and into the status.
    v.handle_timeout(t0);
    let sent = std::iter::from_fn(|| v.poll_transmit()).last().unwrap();
    assert_eq!(sent.coord, v.coord());
    let info = v.info(t0);
    let one = info.nodes.iter().find(|n| n.peer == "1").unwrap();
    assert_eq!(one.rtt_ms, Some(30.0));
    // A placed peer's distance is estimated from the coordinates.
    let placed = Coord {
        vec: [10.0, 0.0, 0.0, 0.0],
        height: 1.0,
        error: 0.2,
    };
    beat(
        &mut v,
        t0,
        t0,
        2,
        Heartbeat {
            seq: 1,
            coord: placed,
            ..hb(Some(2))
        },
    );
    let est = v.rtt_to(&2).unwrap();
    assert_eq!(est, v.coord().rtt(&placed));
    // A coordinate out of range: the heartbeat is refused, and the peer's last one stands.
    while v.poll_event().is_some() {}
    let bad = Coord {
        height: f32::INFINITY,
        ..placed
    };
    beat(
        &mut v,
        t0,
        t0,
        2,
        Heartbeat {
            seq: 2,
            coord: bad,
            ..hb(Some(2))
        },
    );
    assert!(matches!(
        v.poll_event(),
        Some(MeshEvent::Refused { peer: 2, .. })
    ));
    assert_eq!(v.rtt_to(&2), Some(est));
}

/// `hb(Some(row))` from a node placed at `x` ms along one axis.
fn placed_at(row: u32, x: f32) -> Heartbeat {
    Heartbeat {
        coord: Coord {
            vec: [x, 0.0, 0.0, 0.0],
            height: 0.5,
            error: 0.1,
        },
        ..hb(Some(row))
    }
}

#[test]
fn a_joiner_is_offered_the_row_its_region_lacks_and_regions_show_which_serve_alone() {
    // k = 3 of 4, no room to grow. eu (around 0 ms) holds every row, row 0 three times; us
    // (100 ms away) holds rows 1, 2 and 3. The thinnest rows overall are 1, 2 and 3, but a
    // joiner in us completes its region with row 0.
    let t0 = Instant::now();
    let cfg = HealthConfig::default();
    let mut v = MeshView::new(t0, 0u32, cfg, 3, (4, 4), "m".into(), hb(Some(0))).unwrap();
    for (peer, row, x) in [
        (1, 0, 0.0),
        (2, 0, 1.0),
        (3, 1, 2.0),
        (4, 2, 1.0),
        (5, 3, 0.0),
    ] {
        beat(&mut v, t0, t0, peer, placed_at(row, x));
    }
    for (peer, row, x) in [(7, 1, 100.0), (8, 2, 101.0), (9, 3, 102.0)] {
        beat(&mut v, t0, t0, peer, placed_at(row, x));
    }
    let ms = |v: u64| Duration::from_millis(v);
    // This node (row 0) places itself in eu; a holder not placed might be anywhere, so its
    // row counts as near.
    for _ in 0..20 {
        v.observe_rtt(&1, ms(2));
    }
    // Measured: 3 ms to one node of us, 95 to one of eu; the rest estimated from its place.
    let us_joiner = [(7, ms(3)), (1, ms(95))];
    assert!(matches!(
        v.offer_row_near(t0, 20, &us_joiner),
        JoinOffer::Replica { row: 0, .. }
    ));
    // Without samples (a browser), or in eu, which lacks nothing: the thinnest row.
    assert!(matches!(
        v.offer_row(t0, 21),
        JoinOffer::Replica { row: 1, .. }
    ));
    let eu_joiner = [(1, ms(2)), (9, ms(99))];
    assert!(matches!(
        v.offer_row_near(t0, 22, &eu_joiner),
        JoinOffer::Replica { row: 2, .. }
    ));
    // Samples naming nodes it does not know place nothing: the thinnest row again.
    assert!(matches!(
        v.offer_row_near(t0, 23, &[(77, ms(1))]),
        JoinOffer::Replica { row: 3, .. }
    ));

    // The regions: eu's six nodes hold every row, us's three only three.
    let regions = v.info(t0).regions();
    assert_eq!(regions.len(), 2, "{regions:?}");
    assert_eq!(
        (regions[0].nodes.len(), &regions[0].rows[..]),
        (6, &[0, 1, 2, 3][..])
    );
    assert!(regions[0].alone);
    assert_eq!(
        (regions[1].nodes.len(), &regions[1].rows[..]),
        (3, &[1, 2, 3][..])
    );
    assert!(regions[1].alone, "three distinct rows are k");
    assert_eq!(
        v.info(t0).regions_line(),
        "regions (within 25 ms): 2, 2 can serve alone — 6 nodes with rows 0 1 2 3 (alone); \
         3 nodes with rows 1 2 3 (alone)"
    );
    beat(&mut v, t0, t0, 9, placed_at(2, 102.0));
    let regions = v.info(t0).regions();
    assert!(!regions[1].alone, "rows 1 and 2 only: {regions:?}");
}
