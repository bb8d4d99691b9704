//! Learning on a coded model: gradients through the coded group, one SGD update applied by every
//! node to its own shard; the shards stay the codeword of the uncoded model that applied the
//! same updates, every k-group decodes the same logits, and the loss on the sequence falls.

use crate::common::{self, max_rel_diff};

use node_core::code::Generator;
use node_core::coded::{CodedGroup, InProcess, Member, ShardFormat, ShardSet, ShardValues};
use node_core::learn::{Learner, Update, UpdateError};
use node_core::mesh::{LearningConfig, Optimizer};
use node_core::model::{KvCache, LeaderWeights, Llama, ModelWeights};

const SEQ: [u32; 9] = [3, 17, 60, 42, 9, 17, 5, 33, 12];

fn values(s: &ShardSet) -> Vec<f32> {
    let mut v = Vec::new();
    for shard in s.matrices() {
        if let ShardValues::F32(x) = &shard.values {
            v.extend_from_slice(x);
        }
    }
    v
}

#[test]
fn coded_sgd_keeps_every_shard_a_codeword_and_lowers_the_loss() {
    let g = Generator::cauchy(5, 3).unwrap();
    let mut reference = ModelWeights::synthetic(common::train_config(true), 5).unwrap();
    let mut norms = LeaderWeights::from_model(&reference);
    let mesh = InProcess::encode(&reference, &g, ShardFormat::F32, &|_, _| {}).unwrap();
    let mut group = CodedGroup::new(reference.cfg.clone(), g.clone(), &[0, 2, 4, 1], mesh).unwrap();
    let losses = sgd(&mut group, &mut reference, &mut norms, ShardFormat::F32);
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
    let want = uncoded_logits(&llama, &reference);
    let members: Vec<_> = group.transport().members().to_vec();
    assert_eq!(node_core::code::subsets(5, 3).count(), 10);
    every_group_decodes(&llama, &members, &g, &want);
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
    let good = Update::from_gradients(
        futures::executor::block_on(llama.gradients(&mut group, &SEQ)).unwrap(),
        0.1,
        1.0,
    );
    good.validate(&w.cfg).unwrap();
    // The size estimate the leader uses to fit an update in one message holds.
    let encoded = good.encode().len();
    let norms = 4 * (2 * w.cfg.layers + 1) * w.cfg.hidden;
    let estimate = SEQ.len() * node_core::learn::bytes_per_position(&w.cfg) + norms;
    assert!(
        encoded <= estimate + 1024 && encoded * 10 >= estimate * 9,
        "{encoded} bytes, estimated {estimate}"
    );
    let other = Update::from_gradients(
        futures::executor::block_on(llama.gradients(&mut group, &SEQ[..5])).unwrap(),
        0.1,
        1.0,
    );
    assert_ne!(good.id(), other.id());
    assert_eq!(good.id(), good.clone().id());

    let mut nan = good.clone();
    nan.stages[3].dy[0][7] = f32::NAN;
    assert!(matches!(nan.validate(&w.cfg), Err(UpdateError::NotFinite)));
    let mut shape = good.clone();
    shape.stages[0].x.pop();
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
        clip: 1.0,
        rank: 0,
        ..LearningConfig::of(Optimizer::Sgd, 0.1)
    };
    good.validate_for(&w.cfg, &mesh, ShardFormat::F32).unwrap();
    let off = LearningConfig {
        enabled: false,
        ..mesh
    };
    assert!(matches!(
        good.validate_for(&w.cfg, &off, ShardFormat::F32),
        Err(UpdateError::Settings(_))
    ));
    let mut bold = good.clone();
    bold.step *= 2.0;
    assert!(matches!(
        bold.validate_for(&w.cfg, &mesh, ShardFormat::F32),
        Err(UpdateError::Settings(_))
    ));
    // A refused update leaves the shard as it was.
    let mut shard = group.transport().members()[0].shards().clone();
    let before = shard.clone();
    assert!(nan.apply_to_shards(&mut shard).is_err());
    assert_eq!(shard, before);
}

/// 25 SGD steps on `SEQ` through `group` (lr 0.2, clip 5), each update checked and taken by
/// every member, by `norms`, and by `reference` as shards in `format` take it: the losses.
fn sgd(
    group: &mut CodedGroup<InProcess>,
    reference: &mut ModelWeights,
    norms: &mut LeaderWeights,
    format: ShardFormat,
) -> Vec<f64> {
    let mut losses = Vec::new();
    for _ in 0..25 {
        let llama = Llama::new(reference.cfg.clone(), norms.clone()).unwrap();
        let grads = futures::executor::block_on(llama.gradients(group, &SEQ)).unwrap();
        losses.push(grads.loss);
        let update = Update::from_gradients(grads, 0.2, 5.0);
        update.validate(&reference.cfg).unwrap();
        for member in group.transport_mut().members_mut() {
            update.apply_to_shards(member.shards_mut()).unwrap();
        }
        update.apply_to_norms(norms);
        update.taken_by(format).apply_to_weights(reference).unwrap();
    }
    losses
}

/// Asserts that every group of 3 of the 5 `members` decodes `want`, the logits of `SEQ`.
fn every_group_decodes(llama: &Llama, members: &[Member], g: &Generator, want: &[f32]) {
    for nodes in node_core::code::subsets(5, 3) {
        let mesh = InProcess::new(members.to_vec()).unwrap();
        let cfg = llama.config().clone();
        let mut coded = CodedGroup::new(cfg.clone(), g.clone(), &nodes, mesh).unwrap();
        let got =
            futures::executor::block_on(llama.forward(&mut coded, &SEQ, &mut KvCache::new(&cfg)))
                .unwrap();
        let err = max_rel_diff(&got, want);
        assert!(err < 1e-4, "group {nodes:?}: logits differ by {err:.2e}");
    }
}

/// The logits of `SEQ` through `w` uncoded, with `llama`'s norms.
fn uncoded_logits(llama: &Llama, w: &ModelWeights) -> Vec<f32> {
    let mesh = InProcess::encode(w, &Generator::uncoded(), ShardFormat::F32, &|_, _| {}).unwrap();
    let mut uncoded = CodedGroup::new(w.cfg.clone(), Generator::uncoded(), &[0], mesh).unwrap();
    futures::executor::block_on(llama.forward(&mut uncoded, &SEQ, &mut KvCache::new(&w.cfg)))
        .unwrap()
}

/// Every weight of a model, flat.
fn flat(w: &ModelWeights) -> Vec<f32> {
    let mut v = Vec::new();
    for l in &w.layers {
        for m in [&l.q, &l.k, &l.v, &l.o, &l.gate, &l.up, &l.down] {
            v.extend_from_slice(&m.data);
        }
        v.extend_from_slice(&l.attn_norm);
        v.extend_from_slice(&l.ffn_norm);
    }
    v.extend_from_slice(&w.embed.data);
    if let Some(h) = &w.lm_head {
        v.extend_from_slice(&h.data);
    }
    v.extend_from_slice(&w.final_norm);
    v
}

fn learning(rank: u32, accumulate: u32, momentum: f32) -> LearningConfig {
    LearningConfig {
        enabled: true,
        clip: 5.0,
        rank,
        accumulate,
        momentum,
        ..LearningConfig::of(Optimizer::Sgd, 0.2)
    }
}

#[test]
fn compressed_updates_keep_every_shard_a_codeword_and_lower_the_loss() {
    let g = Generator::cauchy(5, 3).unwrap();
    let mut reference = ModelWeights::synthetic(common::train_config(true), 5).unwrap();
    let mut norms = LeaderWeights::from_model(&reference);
    let mesh = InProcess::encode(&reference, &g, ShardFormat::F32, &|_, _| {}).unwrap();
    let mut group = CodedGroup::new(reference.cfg.clone(), g.clone(), &[0, 2, 4, 1], mesh).unwrap();
    let cfg = learning(2, 1, 0.0);
    let mut learner = Learner::new(cfg, reference.cfg.clone(), ShardFormat::F32);
    let (mut losses, mut sizes) = (Vec::new(), Vec::new());
    for _ in 0..25 {
        let llama = Llama::new(reference.cfg.clone(), norms.clone()).unwrap();
        let grads = futures::executor::block_on(llama.gradients(&mut group, &SEQ)).unwrap();
        losses.push(grads.loss);
        let published = learner
            .push(grads)
            .unwrap()
            .expect("one update per request");
        // What nodes do: decode the payload, check it against the mesh's settings, apply it.
        let bytes = published.update.encode();
        sizes.push(bytes.len());
        let update = Update::decode(&bytes).unwrap();
        assert_eq!(
            update, published.update,
            "f16 factors survive the wire exactly"
        );
        assert_eq!(update.encode(), bytes, "the wire form is canonical");
        update
            .validate_for(&reference.cfg, &cfg, ShardFormat::F32)
            .unwrap();
        for member in group.transport_mut().members_mut() {
            update.apply_to_shards(member.shards_mut()).unwrap();
        }
        update.apply_to_norms(&mut norms);
        update.apply_to_weights(&mut reference).unwrap();
    }
    let fresh = InProcess::encode(&reference, &g, ShardFormat::F32, &|_, _| {}).unwrap();
    let mut worst = 0.0f64;
    for (a, b) in group.transport().members().iter().zip(fresh.members()) {
        worst = worst.max(max_rel_diff(&values(a.shards()), &values(b.shards())));
    }
    assert!(
        worst < 1e-5,
        "shards drifted from the codeword by {worst:.2e}"
    );
    let (first, last) = (losses[0], *losses.last().unwrap());
    assert!(
        last < 0.5 * first,
        "loss {first:.3} → {last:.3}: {losses:?}"
    );
    // Rank 2 in f16 against the exact f32 factors of the same sequence.
    let exact = SEQ.len() * node_core::learn::bytes_per_position(&reference.cfg);
    assert!(
        sizes.iter().all(|&s| s * 2 < exact),
        "compressed sizes {sizes:?} vs exact {exact}"
    );
    eprintln!(
        "rank 2: loss {first:.3} → {last:.3}; {} bytes per update vs {exact} exact",
        sizes[0]
    );
}

#[test]
fn accumulation_and_momentum_publish_the_sum_of_the_gradients() {
    let w0 = ModelWeights::synthetic(common::train_config(true), 7).unwrap();
    let g = Generator::uncoded();
    let mesh = InProcess::encode(&w0, &g, ShardFormat::F32, &|_, _| {}).unwrap();
    let mut group = CodedGroup::new(w0.cfg.clone(), g, &[0], mesh).unwrap();
    let llama = Llama::new(w0.cfg.clone(), LeaderWeights::from_model(&w0)).unwrap();
    let seqs: [&[u32]; 4] = [&SEQ, &SEQ[2..], &[5, 9, 1, 40, 2, 2, 7], &SEQ[..6]];
    let grads: Vec<_> = seqs
        .iter()
        .map(|s| futures::executor::block_on(llama.gradients(&mut group, s)).unwrap())
        .collect();
    // H = 2, β = 0.5, a rank large enough to cut nothing: the first update is g1 + g2, the
    // second 0.5·(g1 + g2) + g3 + g4.
    let cfg = learning(64, 2, 0.5);
    let mut learner = Learner::new(cfg, w0.cfg.clone(), ShardFormat::F32);
    let mut published = Vec::new();
    for gr in &grads {
        if let Some(p) = learner.push(gr.clone()).unwrap() {
            published.push(p);
        }
    }
    assert!(learner.flush().unwrap().is_none(), "nothing left pending");
    assert_eq!(published.len(), 2);
    assert_eq!(
        published.iter().map(|p| p.requests).collect::<Vec<_>>(),
        [2, 2]
    );
    let mut got = w0.clone();
    for p in &published {
        p.update
            .validate_for(&w0.cfg, &cfg, ShardFormat::F32)
            .unwrap();
        p.update.apply_to_weights(&mut got).unwrap();
    }
    let mut want = w0.clone();
    for (gr, c) in grads.iter().zip([1.5f32, 1.5, 1.0, 1.0]) {
        let mut u = Update::from_gradients(gr.clone(), cfg.lr, cfg.clip);
        u.step *= c;
        u.apply_to_weights(&mut want).unwrap();
    }
    let base = flat(&w0);
    let delta =
        |w: &ModelWeights| -> Vec<f32> { flat(w).iter().zip(&base).map(|(a, b)| a - b).collect() };
    let err = max_rel_diff(&delta(&got), &delta(&want));
    assert!(
        err < 5e-3,
        "published updates differ from the sum by {err:.2e}"
    );
    // A rank too small to hold the sum cuts it, and says how much it kept.
    let mut small = Learner::new(learning(1, 2, 0.0), w0.cfg.clone(), ShardFormat::F32);
    assert!(small.push(grads[0].clone()).unwrap().is_none());
    let p = small.push(grads[1].clone()).unwrap().unwrap();
    assert!(p.kept < 0.999 && p.kept > 0.0, "kept {}", p.kept);
    assert!(p.update.stages.iter().all(|f| f.rows <= 1));
}

/// Every update a leader's learner publishes passes the mesh's own check: clipping bounds each
/// request's gradient, but the published update is what nodes measure — the tied embedding's
/// lookup rows moved into the LM head, cut to the rank and rounded to f16 — and that must still
/// be within `lr · clip`, or every node refuses it and the update is lost (two of 500 on SmolLM2
/// were, before the learner scaled the published update to fit).
#[test]
fn every_update_a_learner_publishes_passes_the_meshs_bound() {
    let g = Generator::cauchy(5, 3).unwrap();
    let weights = ModelWeights::synthetic(common::train_config(true), 11).unwrap();
    let cfg = weights.cfg.clone();
    let mesh = InProcess::encode(&weights, &g, ShardFormat::F32, &|_, _| {}).unwrap();
    let mut group = CodedGroup::new(cfg.clone(), g, &[0, 2, 4], mesh).unwrap();
    let llama = Llama::new(cfg.clone(), LeaderWeights::from_model(&weights)).unwrap();
    // A small clip, so every request is clipped and sits at the bound.
    let learning = LearningConfig {
        clip: 0.05,
        rank: 2,
        ..LearningConfig::of(Optimizer::Sgd, node_core::mesh::DEFAULT_SGD_LR)
    };
    let mut learner = Learner::new(learning, cfg.clone(), ShardFormat::F32);
    let vocab = cfg.vocab as u32;
    let mut worst = 0.0f64;
    for seed in 0..40u32 {
        // Sequences that repeat tokens, so a token's lookup row and its LM head row meet.
        let seq: Vec<u32> = (0..8).map(|i| (seed * 7 + (i % 3) * 5) % vocab).collect();
        let grads = futures::executor::block_on(llama.gradients(&mut group, &seq)).unwrap();
        let p = learner.push(grads).unwrap().expect("one update a request");
        let used = p.update.step as f64 * p.update.gradient_norm() / learning.step_norm_bound();
        worst = worst.max(used);
        p.update
            .validate_for(&cfg, &learning, ShardFormat::F32)
            .unwrap_or_else(|e| panic!("request {seed}: {e}"));
    }
    assert!(worst > 0.9, "the updates sit near the bound ({worst:.3})");
}

#[test]
fn compact_shards_learn_in_coded_adapters_and_stay_one_codeword() {
    let g = ShardFormat::Q8.code(5, 3).unwrap();
    let base = ModelWeights::synthetic(common::train_config(true), 5).unwrap();
    // The reference: the model on the grid the shards hold, taking each update's projection.
    let mut reference = node_core::coded::compact_model(&g, &base).unwrap();
    let mut norms = LeaderWeights::from_model(&reference);
    let mesh = InProcess::encode(&base, &g, ShardFormat::Q8, &|_, _| {}).unwrap();
    let genesis = mesh.members().to_vec();
    let mut group = CodedGroup::new(reference.cfg.clone(), g.clone(), &[0, 2, 4, 1], mesh).unwrap();
    let losses = sgd(&mut group, &mut reference, &mut norms, ShardFormat::Q8);
    let members: Vec<_> = group.transport().members().to_vec();
    // The integers and scales did not move: only the adapters learnt.
    for (now, then) in members.iter().zip(&genesis) {
        let (a, b) = (now.shards(), then.shards());
        for (x, y) in a.blocks.iter().flatten().zip(b.blocks.iter().flatten()) {
            assert_eq!(x.values, y.values);
            assert!(!x.adapter.is_empty() && y.adapter.is_empty());
        }
        assert!(!a.embed.adapter.is_empty());
    }
    // Every k-group decodes the reference's logits.
    let llama = Llama::new(reference.cfg.clone(), norms.clone()).unwrap();
    let want = uncoded_logits(&llama, &reference);
    every_group_decodes(&llama, &members, &g, &want);
    // A lost row re-created from three others carries the adapters it must.
    let sources: Vec<&ShardSet> = [0, 1, 4].iter().map(|&i| members[i].shards()).collect();
    let rebuilt = ShardSet::reencode(3, &sources).unwrap();
    let held = members[3].shards();
    for (x, y) in rebuilt.matrices().zip(held.matrices()) {
        assert_eq!(x.values, y.values);
        let err = max_rel_diff(&x.adapter.a, &y.adapter.a);
        assert!(err < 1e-5, "rebuilt adapter differs by {err:.2e}");
    }
    // A shard blob keeps them, and a blob with a malformed adapter is refused.
    let blob = node_core::holder::shard_to_blob(held).unwrap();
    let back = node_core::holder::shard_from_blob(&blob).unwrap();
    back.check_shapes().unwrap();
    for (x, y) in back.matrices().zip(held.matrices()) {
        assert_eq!((&x.values, &x.adapter.a), (&y.values, &y.adapter.a));
    }
    let mut bad = held.clone();
    bad.blocks[0][0].adapter.a.pop();
    assert!(bad.check_shapes().is_err());
    bad.blocks[0][0].adapter.a = vec![f32::NAN; held.blocks[0][0].adapter.a.len()];
    assert!(bad.check_shapes().is_err());
    // It learns: the loss on the repeated sequence falls.
    let (first, last) = (losses[0], *losses.last().unwrap());
    assert!(
        last < 0.5 * first,
        "loss {first:.3} → {last:.3}: {losses:?}"
    );
    eprintln!("compact: loss {first:.3} → {last:.3}");
}

/// Adam on the adapters, on a mesh of `format`: every update is checked as nodes check it,
/// taken by every row and by the uncoded reference (as the format takes it); the canary
/// gate's view of each update (the group with the update added on top) is the loss the rows
/// give once they took it. Every k-group then decodes the reference's logits, and the loss
/// on the repeated sequence falls.
fn adam_keeps_one_codeword_and_learns(format: ShardFormat) {
    let g = format.code(5, 3).unwrap();
    let base = ModelWeights::synthetic(common::train_config(true), 5).unwrap();
    let mut reference = match format {
        ShardFormat::Q8 => node_core::coded::compact_model(&g, &base).unwrap(),
        _ => base.clone(),
    };
    let norms = LeaderWeights::from_model(&reference);
    let mesh = InProcess::encode(&base, &g, format, &|_, _| {}).unwrap();
    let mut group = CodedGroup::new(reference.cfg.clone(), g.clone(), &[0, 2, 4, 1], mesh).unwrap();
    let cfg = LearningConfig {
        lr: 0.02,
        ..LearningConfig::default()
    };
    assert_eq!(cfg.optimizer, Optimizer::AdamAdapters);
    let mut learner = Learner::new(cfg, reference.cfg.clone(), format);
    let llama = Llama::new(reference.cfg.clone(), norms.clone()).unwrap();
    let mut losses = Vec::new();
    for i in 0..12 {
        let grads = futures::executor::block_on(llama.gradients(&mut group, &SEQ)).unwrap();
        losses.push(grads.loss);
        let p = learner.push(grads).unwrap().expect("one update a request");
        let bytes = p.update.encode();
        let update = Update::decode(&bytes).unwrap();
        assert_eq!(
            update, p.update,
            "what the leader keeps is what nodes decode"
        );
        update
            .validate_for(&reference.cfg, &cfg, format)
            .unwrap_or_else(|e| panic!("update {i}: {e}"));
        // An update that moves one adapter entry a tenth further than the rate allows a
        // round (a minibatch's step times the round's reach) is refused.
        let mut bold = update.clone();
        let cols = bold.stages[0].x.len() / bold.stages[0].rows as usize;
        let rank = bold.stages[0].rows as usize;
        let most = f64::from(cfg.lr) * node_core::learn::MAX_BATCH_SCALE * cfg.adapter_reach()
            / (cols as f64).sqrt()
            / (f64::from(bold.step) * node_core::learn::entry_per_dy(format, cols, rank));
        bold.stages[0].dy[0][0] = (1.1 * most) as f32;
        assert!(matches!(
            bold.validate_for(&reference.cfg, &cfg, format),
            Err(UpdateError::Settings(_))
        ));
        let taken = update.clone().taken_by(format);
        let predicted = {
            // The gate's prediction, from the update as sent (projected a stage at a time).
            let mut pending =
                node_core::learn::Pending::new(&mut group, &update, llama.config(), format);
            futures::executor::block_on(llama.sequence_loss(&mut pending, &SEQ)).unwrap()
        };
        for member in group.transport_mut().members_mut() {
            update.apply_to_shards(member.shards_mut()).unwrap();
        }
        taken.apply_to_weights(&mut reference).unwrap();
        let actual = futures::executor::block_on(llama.sequence_loss(&mut group, &SEQ)).unwrap();
        assert!(
            (predicted - actual).abs() < 1e-4 * actual.abs().max(1.0),
            "update {i}: the gate predicted loss {predicted:.6}, the rows give {actual:.6}"
        );
    }
    let want = uncoded_logits(&llama, &reference);
    let members: Vec<_> = group.transport().members().to_vec();
    every_group_decodes(&llama, &members, &g, &want);
    let (first, last) = (losses[0], *losses.last().unwrap());
    assert!(
        last < 0.5 * first,
        "{format:?}: loss {first:.3} → {last:.3}: {losses:?}"
    );
    eprintln!("{format:?} Adam: loss {first:.3} → {last:.3}");
}

#[test]
fn adam_on_f32_adapters_keeps_one_codeword_and_learns() {
    adam_keeps_one_codeword_and_learns(ShardFormat::F32);
}

#[test]
fn adam_on_compact_adapters_keeps_one_codeword_and_learns() {
    adam_keeps_one_codeword_and_learns(ShardFormat::Q8);
}

#[test]
fn a_refused_adam_step_leaves_the_moments_as_they_were() {
    let w = ModelWeights::synthetic(common::train_config(true), 5).unwrap();
    let g = Generator::uncoded();
    let mesh = InProcess::encode(&w, &g, ShardFormat::F32, &|_, _| {}).unwrap();
    let mut group = CodedGroup::new(w.cfg.clone(), g, &[0], mesh).unwrap();
    let llama = Llama::new(w.cfg.clone(), LeaderWeights::from_model(&w)).unwrap();
    let cfg = LearningConfig::default();
    let mut grads = || futures::executor::block_on(llama.gradients(&mut group, &SEQ)).unwrap();
    let (g1, g2) = (grads(), grads());
    // One learner takes a step it then refuses, and the next; another only the next.
    let mut refused = Learner::new(cfg, w.cfg.clone(), ShardFormat::F32);
    refused.push(g1.clone()).unwrap().unwrap();
    assert!(refused.refuse_last());
    assert!(!refused.refuse_last(), "one step back at most");
    let a = refused.push(g2.clone()).unwrap().unwrap().update;
    let mut fresh = Learner::new(cfg, w.cfg.clone(), ShardFormat::F32);
    let b = fresh.push(g2).unwrap().unwrap().update;
    assert_eq!(a.stages, b.stages);
    // A step whose update went out is kept: nothing is held to take it back.
    fresh.keep_last();
    assert!(!fresh.refuse_last(), "a published step cannot be forgotten");
}
