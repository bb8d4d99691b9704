//! Backward rounds on gradients f32 barely holds: tokens the model is certain of.

use node_core::code::Generator;
use node_core::coded::{CodedGroup, InProcess, Member, Misbehaviour, ShardFormat, VerifyConfig};
use node_core::model::{LinearExec, ModelError, ModelWeights, Stage};

use crate::verification::{calibrated, honest, lying};

/// The LM head's backward product of `dy` (`t` tokens) through a checked group of `rows`, and
/// the rows it caught.
fn backward(
    w: &ModelWeights,
    g: &Generator,
    members: Vec<Member>,
    rows: &[usize],
    check: VerifyConfig,
    dy: &[f32],
    t: usize,
) -> (Result<Vec<f32>, ModelError>, Vec<usize>, u64) {
    let mesh = InProcess::new(members).unwrap();
    let mut group = CodedGroup::new(w.cfg.clone(), g.clone(), rows, mesh).unwrap();
    group.set_verify(check);
    group.seed_checks(3);
    let got = futures::executor::block_on(group.linear_t(Stage::LmHead, &[dy.to_vec()], t));
    let stats = group.stats();
    let caught = stats.caught.iter().map(|c| c.node).collect();
    (got, caught, stats.checked_backward_rounds)
}

/// A token the model is certain of has an output gradient of a few subnormal values (its
/// softmax rounds to the one-hot target; seen on the 1B shape, 1e-43), where f32 keeps almost
/// no relative precision. Honest members must pass the backward check on it, and the product
/// must still be the uncoded one; a lying member is still caught.
#[test]
fn tokens_with_vanishing_output_gradients_convict_no_honest_member() {
    let (w, g, members) = honest();
    let check = calibrated(&w, &g, &members, 1);
    let (vocab, d) = (w.cfg.vocab, w.cfg.hidden);
    let t = 5;
    let mut dy = vec![0.0f32; t * vocab];
    // An ordinary token, a certain one (subnormal), a nearly certain one (normal, tiny), one
    // that predicts nothing, and one more below.
    for (i, v) in dy[..vocab].iter_mut().enumerate() {
        *v = ((i * 37 % 101) as f32 - 50.0) / 500.0;
    }
    dy[vocab + 3] = -1.3e-43;
    dy[vocab + 40] = 1.0e-43;
    dy[vocab + 41] = 2.9e-44;
    dy[2 * vocab + 7] = -3.0e-30;
    dy[2 * vocab + 8] = 3.0e-30;
    // A token sure of a wrong answer: ±1 in the first rows, subnormal in the last ones, so a
    // member whose input is made of the last rows alone gets only subnormal values.
    dy[4 * vocab + 1] = 0.9;
    dy[4 * vocab + 2] = -0.9;
    dy[5 * vocab - 3] = -f32::from_bits(1);
    dy[5 * vocab - 2] = f32::from_bits(3);
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
        let (got, caught, checked) = backward(&w, &g, members.clone(), &rows, check, &dy, t);
        let got = got.unwrap();
        assert!(caught.is_empty(), "rows {rows:?}: {caught:?}");
        assert_eq!(checked, 1);
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
    let (got, caught, _) = backward(&w, &g, liar, &[0, 1, 2, 3], check, &dy, t);
    got.unwrap();
    assert_eq!(caught, vec![1]);
}

/// On compact rows the code is systematic: with the data rows decoding, each member's backward
/// input is its own share of the vocabulary, so a token sure of a wrong answer (±1 in one
/// share) gives the other member only its subnormal values. Each member's input is scaled on
/// its own, so neither is convicted, and a liar still is.
#[test]
fn a_member_whose_share_of_a_token_is_subnormal_is_not_convicted() {
    let w = ModelWeights::synthetic(crate::common::train_config(true), 11).unwrap();
    let g: Generator = ShardFormat::Q8.code(4, 2).unwrap();
    let members = InProcess::encode(&w, &g, ShardFormat::Q8, &|_, _| {})
        .unwrap()
        .members()
        .to_vec();
    let check = calibrated(&w, &g, &members, 1);
    let (vocab, t) = (w.cfg.vocab, 2);
    let mut dy = vec![0.0f32; t * vocab];
    for tok in 0..t {
        dy[tok * vocab + 1 + tok] = 0.9;
        dy[tok * vocab + 2 + tok] = -0.9;
        dy[(tok + 1) * vocab - 3] = -f32::from_bits(1);
        dy[(tok + 1) * vocab - 2] = 1.0e-43;
    }
    let (got, caught, _) = backward(&w, &g, members.clone(), &[0, 1, 2], check, &dy, t);
    assert!(caught.is_empty(), "{caught:?}");
    assert!(got.unwrap().iter().all(|v| v.is_finite()));
    let liar = lying(&members, 1, Misbehaviour::BackwardOnly);
    let (_, caught, _) = backward(&w, &g, liar, &[0, 1, 2], check, &dy, t);
    assert_eq!(caught, vec![1]);
}
