//! Learning on a coded model: gradients through the coded group, one SGD update applied by every
//! node to its own shard; the shards stay the codeword of the uncoded model that applied the
//! same updates, every k-group decodes the same logits, and the loss on the sequence falls.

#![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

mod common;

use node_core::code::Generator;
use node_core::coded::{CodedGroup, InProcess, ShardFormat, ShardSet, ShardValues};
use node_core::learn::{Update, UpdateError};
use node_core::mesh::LearningConfig;
use node_core::model::{KvCache, LeaderWeights, Llama, ModelWeights};

const SEQ: [u32; 9] = [3, 17, 60, 42, 9, 17, 5, 33, 12];

fn values(s: &ShardSet) -> Vec<f32> {
    let mut v = Vec::new();
    for shard in s
        .blocks
        .iter()
        .flatten()
        .chain([&s.embed])
        .chain(s.lm_head.as_ref())
    {
        if let ShardValues::F32(x) = &shard.values {
            v.extend_from_slice(x);
        }
    }
    v
}

fn max_rel_diff(a: &[f32], b: &[f32]) -> f64 {
    let scale = b.iter().fold(0.0f32, |m, v| m.max(v.abs())) as f64;
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() as f64)
        .fold(0.0, f64::max)
        / scale
}

#[test]
fn coded_sgd_keeps_every_shard_a_codeword_and_lowers_the_loss() {
    let g = Generator::cauchy(5, 3).unwrap();
    let mut reference = ModelWeights::synthetic(common::train_config(true), 5).unwrap();
    let mut norms = LeaderWeights::from_model(&reference);
    let mesh = InProcess::encode(&reference, &g, ShardFormat::F32, &|_, _| {}).unwrap();
    let mut group = CodedGroup::new(reference.cfg.clone(), g.clone(), &[0, 2, 4, 1], mesh).unwrap();
    let mut losses = Vec::new();
    for _ in 0..25 {
        let llama = Llama::new(reference.cfg.clone(), norms.clone()).unwrap();
        let grads = llama.gradients(&mut group, &SEQ).unwrap();
        losses.push(grads.loss);
        let update = Update::from_gradients(grads, 0.2, 5.0);
        update.validate(&reference.cfg).unwrap();
        for member in group.transport_mut().members_mut() {
            update.apply_to_shards(member.shards_mut()).unwrap();
        }
        update.apply_to_norms(&mut norms);
        update.apply_to_weights(&mut reference).unwrap();
    }
    // Every node's shard equals the shard freshly encoded from the updated uncoded model.
    let fresh = InProcess::encode(&reference, &g, ShardFormat::F32, &|_, _| {}).unwrap();
    let mut worst = 0.0f64;
    for (a, b) in group.transport().members().iter().zip(fresh.members()) {
        worst = worst.max(max_rel_diff(&values(a.shards()), &values(b.shards())));
    }
    assert!(
        worst < 1e-5,
        "shards drifted from the codeword by {worst:.2e}"
    );
    // Every k-group decodes the updated model's logits.
    let llama = Llama::new(reference.cfg.clone(), norms.clone()).unwrap();
    assert_eq!(norms, LeaderWeights::from_model(&reference));
    let uncoded_mesh = InProcess::encode(
        &reference,
        &Generator::uncoded(),
        ShardFormat::F32,
        &|_, _| {},
    )
    .unwrap();
    let mut uncoded = CodedGroup::new(
        reference.cfg.clone(),
        Generator::uncoded(),
        &[0],
        uncoded_mesh,
    )
    .unwrap();
    let want = llama
        .forward(&mut uncoded, &SEQ, &mut KvCache::new(&reference.cfg))
        .unwrap();
    let members: Vec<_> = group.transport().members().to_vec();
    for nodes in [[0, 1, 2], [0, 3, 4], [1, 2, 4], [2, 3, 4]] {
        let mesh = InProcess::new(members.clone()).unwrap();
        let mut coded = CodedGroup::new(reference.cfg.clone(), g.clone(), &nodes, mesh).unwrap();
        let got = llama
            .forward(&mut coded, &SEQ, &mut KvCache::new(&reference.cfg))
            .unwrap();
        let err = max_rel_diff(&got, &want);
        assert!(err < 1e-4, "group {nodes:?}: logits differ by {err:.2e}");
    }
    // The loss on the repeated sequence falls.
    let (first, last) = (losses[0], *losses.last().unwrap());
    assert!(
        last < 0.5 * first,
        "loss {first:.3} → {last:.3}: {losses:?}"
    );
    eprintln!("loss {first:.3} → {last:.3}; shard drift {worst:.2e}");
}

#[test]
fn bad_updates_are_refused_before_anything_changes() {
    let w = ModelWeights::synthetic(common::train_config(true), 5).unwrap();
    let g = Generator::uncoded();
    let mesh = InProcess::encode(&w, &g, ShardFormat::F32, &|_, _| {}).unwrap();
    let mut group = CodedGroup::new(w.cfg.clone(), g, &[0], mesh).unwrap();
    let llama = Llama::new(w.cfg.clone(), LeaderWeights::from_model(&w)).unwrap();
    let good = Update::from_gradients(llama.gradients(&mut group, &SEQ).unwrap(), 0.1, 1.0);
    good.validate(&w.cfg).unwrap();
    // The size estimate the leader uses to fit an update in one message holds.
    let encoded = postcard::to_allocvec(&good).unwrap().len();
    let norms = 4 * (2 * w.cfg.layers + 1) * w.cfg.hidden;
    let estimate = SEQ.len() * node_core::learn::bytes_per_position(&w.cfg) + norms;
    assert!(
        encoded <= estimate + 1024 && encoded * 10 >= estimate * 9,
        "{encoded} bytes, estimated {estimate}"
    );
    let other = Update::from_gradients(llama.gradients(&mut group, &SEQ[..5]).unwrap(), 0.1, 1.0);
    assert_ne!(good.id(), other.id());
    assert_eq!(good.id(), good.clone().id());

    let mut nan = good.clone();
    nan.stages[3].2[0][7] = f32::NAN;
    assert!(matches!(nan.validate(&w.cfg), Err(UpdateError::NotFinite)));
    let mut shape = good.clone();
    shape.stages[0].1.pop();
    assert!(matches!(shape.validate(&w.cfg), Err(UpdateError::Shape(_))));
    let mut token = good.clone();
    token.embed_tokens[0] = 64;
    assert!(matches!(token.validate(&w.cfg), Err(UpdateError::Shape(_))));
    let mut huge = good.clone();
    huge.step = 1e6;
    assert!(matches!(
        huge.validate(&w.cfg),
        Err(UpdateError::TooLarge { .. })
    ));
    // The mesh's own settings: learning on, the step within lr and lr · clip.
    let mesh = LearningConfig {
        enabled: true,
        lr: 0.1,
        clip: 1.0,
    };
    good.validate_for(&w.cfg, &mesh).unwrap();
    let off = LearningConfig {
        enabled: false,
        ..mesh
    };
    assert!(matches!(
        good.validate_for(&w.cfg, &off),
        Err(UpdateError::Settings(_))
    ));
    let mut bold = good.clone();
    bold.step *= 2.0;
    assert!(matches!(
        bold.validate_for(&w.cfg, &mesh),
        Err(UpdateError::Settings(_))
    ));
    // A refused update leaves the shard as it was.
    let mut shard = group.transport().members()[0].shards().clone();
    let before = shard.clone();
    assert!(nan.apply_to_shards(&mut shard).is_err());
    assert_eq!(shard, before);
}
