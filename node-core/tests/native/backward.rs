//! Backward rounds on gradients f32 barely holds: tokens the model is certain of.

use node_core::coded::{CodedGroup, InProcess, Misbehaviour};
use node_core::model::{LinearExec, Stage};

use crate::verification::{calibrated, honest, lying};

/// A token the model is certain of has an output gradient of a few subnormal values (its
/// softmax rounds to the one-hot target; seen on the 1B shape, 1e-43), where f32 keeps almost
/// no relative precision. Honest members must pass the backward check on it, and the product
/// must still be the uncoded one; a lying member is still caught.
#[test]
fn tokens_with_vanishing_output_gradients_convict_no_honest_member() {
    let (w, g, members) = honest();
    let check = calibrated(&w, &g, &members, 1);
    let (vocab, d) = (w.cfg.vocab, w.cfg.hidden);
    let t = 4;
    let mut dy = vec![0.0f32; t * vocab];
    // An ordinary token, a certain one (subnormal), a nearly certain one (normal, tiny) and
    // one that predicts nothing.
    for (i, v) in dy[..vocab].iter_mut().enumerate() {
        *v = ((i * 37 % 101) as f32 - 50.0) / 500.0;
    }
    dy[vocab + 3] = -1.3e-43;
    dy[vocab + 40] = 1.0e-43;
    dy[vocab + 41] = 2.9e-44;
    dy[2 * vocab + 7] = -3.0e-30;
    dy[2 * vocab + 8] = 3.0e-30;
    let want: Vec<f64> = (0..t)
        .flat_map(|tok| {
            let (dy, e) = (&dy, &w.embed);
            (0..d).map(move |c| {
                (0..vocab)
                    .map(|r| f64::from(dy[tok * vocab + r]) * f64::from(e.data[r * d + c]))
                    .sum::<f64>()
            })
        })
        .collect();
    for rows in [[0, 1, 2, 3], [3, 4, 0, 1]] {
        let mut group = CodedGroup::new(
            w.cfg.clone(),
            g.clone(),
            &rows,
            InProcess::new(members.clone()).unwrap(),
        )
        .unwrap();
        group.set_verify(check);
        group.seed_checks(3);
        let got =
            futures::executor::block_on(group.linear_t(Stage::LmHead, &[dy.clone()], t)).unwrap();
        let caught = &group.stats().caught;
        assert!(caught.is_empty(), "rows {rows:?}: {caught:?}");
        assert_eq!(group.stats().checked_backward_rounds, 1);
        for tok in 0..t {
            let (got, want) = (&got[tok * d..(tok + 1) * d], &want[tok * d..(tok + 1) * d]);
            let scale = want.iter().fold(0.0f64, |m, v| m.max(v.abs()));
            let err = got
                .iter()
                .zip(want)
                .fold(0.0f64, |m, (&a, &b)| m.max((f64::from(a) - b).abs()));
            // Within f32's spacing where the product itself is subnormal.
            let spacing = f64::from(f32::from_bits(1));
            assert!(
                err <= 1e-5 * scale + spacing,
                "rows {rows:?}, token {tok}: off by {err:.2e} of {scale:.2e}"
            );
        }
    }
    let liar = lying(&members, 1, Misbehaviour::BackwardOnly);
    let mut group = CodedGroup::new(
        w.cfg.clone(),
        g.clone(),
        &[0, 1, 2, 3],
        InProcess::new(liar).unwrap(),
    )
    .unwrap();
    group.set_verify(check);
    futures::executor::block_on(group.linear_t(Stage::LmHead, &[dy], t)).unwrap();
    let caught: Vec<usize> = group.stats().caught.iter().map(|c| c.node).collect();
    assert_eq!(caught, vec![1]);
}
