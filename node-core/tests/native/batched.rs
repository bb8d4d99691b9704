//! Batched (continuous-batching) forward passes and minibatch gradients against the same
//! sequences run one at a time, through a coded group (k = 3 of n = 5) on a synthetic model.

use crate::common::{self, max_rel_diff};
use node_core::code::Generator;
use node_core::coded::{CodedGroup, InProcess, ShardFormat};
use node_core::learn::Update;
use node_core::model::{
    BatchItem, Gradients, KvCache, LeaderWeights, Llama, ModelError, ModelWeights, Stage, pass_rows,
};

fn setup(w: &ModelWeights) -> (Llama, CodedGroup<InProcess>) {
    let g = Generator::cauchy(5, 3).unwrap();
    let mesh = InProcess::encode(w, &g, ShardFormat::F32, &|_, _| {}).unwrap();
    let group = CodedGroup::new(w.cfg.clone(), g, &[0, 2, 4], mesh).unwrap();
    let llama = Llama::new(w.cfg.clone(), LeaderWeights::from_model(w)).unwrap();
    (llama, group)
}

/// `Σ_rows dy[m]ᵀ·x` of one stage: the weight gradient its factors stand for.
fn weight_grad(g: &Gradients, stage: Stage, m: usize) -> Vec<f32> {
    let s = g.stages.iter().find(|s| s.stage == stage).unwrap();
    let (inp, out) = (s.x.len() / g.t, s.dy[m].len() / g.t);
    let mut w = vec![0.0f32; out * inp];
    for row in 0..g.t {
        for r in 0..out {
            let dy = s.dy[m][row * out + r];
            for c in 0..inp {
                w[r * inp + c] += dy * s.x[row * inp + c];
            }
        }
    }
    w
}

/// Asserts that each cache holds what its single run's does: continuing both with the same
/// token gives the same logits.
fn continue_alike(
    llama: &Llama,
    group: &mut CodedGroup<InProcess>,
    caches: &mut [KvCache],
    alone: &mut [KvCache],
) {
    for (i, (c, a)) in caches.iter_mut().zip(alone.iter_mut()).enumerate() {
        assert_eq!(c.len(), a.len(), "sequence {i}: cache length");
        let next = futures::executor::block_on(llama.forward(group, &[8], c)).unwrap();
        let want = futures::executor::block_on(llama.forward(group, &[8], a)).unwrap();
        assert!(
            max_rel_diff(&next, &want) < 1e-5,
            "sequence {i}: the cache continues like the single run's"
        );
    }
}

#[test]
fn a_batch_gives_each_sequence_its_own_logits_in_one_round_per_stage() {
    let w = ModelWeights::synthetic(common::train_config(true), 11).unwrap();
    let (llama, mut group) = setup(&w);
    let prompts: [&[u32]; 3] = [&[3, 17, 60, 42], &[9, 5], &[1, 2, 3]];
    // Sequence 1 already holds two positions; sequence 2 one; sequence 0 is fresh.
    let mut caches: Vec<KvCache> = (0..3).map(|_| KvCache::new(&w.cfg)).collect();
    let history: [&[u32]; 3] = [&[], &[33, 7], &[12]];
    for (cache, h) in caches.iter_mut().zip(history) {
        if !h.is_empty() {
            futures::executor::block_on(llama.forward(&mut group, h, cache)).unwrap();
        }
    }
    let mut alone = caches.clone();
    let expected: Vec<Vec<f32>> = alone
        .iter_mut()
        .zip(prompts)
        .map(|(c, p)| futures::executor::block_on(llama.forward(&mut group, p, c)).unwrap())
        .collect();
    group.reset_stats();
    let mut items: Vec<BatchItem<'_>> = caches
        .iter_mut()
        .zip(prompts)
        .map(|(cache, tokens)| BatchItem::new(tokens, cache))
        .collect();
    let got = futures::executor::block_on(llama.forward_batch(&mut group, &mut items)).unwrap();
    // Embedding, four stages per block, the LM head: once for the whole batch.
    let rounds = 1 + 4 * w.cfg.layers as u64 + 1;
    assert_eq!(
        group.stats().rounds,
        rounds,
        "one round per stage for the batch"
    );
    for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
        let err = max_rel_diff(g, e);
        assert!(
            err < 1e-5,
            "sequence {i}: batched logits differ by {err:.2e}"
        );
    }
    // The caches now hold what the sequences alone would hold.
    continue_alike(&llama, &mut group, &mut caches, &mut alone);
}

#[test]
fn a_batch_longer_than_a_pass_runs_in_passes_with_the_logits_of_one_token_at_a_time() {
    // A wide feed-forward brings a pass down to 64 rows.
    let cfg = node_core::model::LlamaConfig {
        ffn: 16384,
        max_seq: 256,
        ..common::train_config(false)
    };
    assert_eq!(pass_rows(&cfg), 64);
    let w = ModelWeights::synthetic(cfg, 5).unwrap();
    let (llama, mut group) = setup(&w);
    let vocab = w.cfg.vocab;
    let prompt = |n: usize, seed: u32| -> Vec<u32> {
        (0..n as u32)
            .map(|i| (i * 7 + seed) % vocab as u32)
            .collect()
    };
    // Sequence 0 runs 150 tokens wanting its last 3 positions' logits, 1 runs 40 after a
    // history of 5, 2 one token.
    let (a, b, c) = (prompt(150, 1), prompt(40, 3), prompt(1, 9));
    let history = prompt(5, 11);
    let mut caches: Vec<KvCache> = (0..3).map(|_| KvCache::new(&w.cfg)).collect();
    futures::executor::block_on(llama.forward(&mut group, &history, &mut caches[1])).unwrap();
    // The reference: each sequence one token at a time, every position's logits kept.
    let mut alone = caches.clone();
    let mut expected = Vec::new();
    for ((tokens, cache), wanted) in [&a, &b, &c].into_iter().zip(&mut alone).zip([3, 1, 1]) {
        let rows: Vec<Vec<f32>> = tokens
            .iter()
            .map(|&tok| {
                futures::executor::block_on(llama.forward(&mut group, &[tok], cache)).unwrap()
            })
            .collect();
        expected.push(rows[rows.len() - wanted..].concat());
    }
    group.reset_stats();
    let mut items: Vec<BatchItem<'_>> = caches
        .iter_mut()
        .zip([&a, &b, &c])
        .map(|(cache, tokens)| BatchItem::new(tokens, cache))
        .collect();
    items[0].logits = 3;
    let got = futures::executor::block_on(llama.forward_batch(&mut group, &mut items)).unwrap();
    // 191 rows in passes of 64: 64 of sequence 0, 64 more, then its last 22 with sequences 1
    // and 2; the LM head once, in the last.
    let rounds = 3 * (1 + 4 * w.cfg.layers as u64) + 1;
    assert_eq!(group.stats().rounds, rounds, "three passes, one LM head");
    for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
        assert_eq!(g.len(), e.len(), "sequence {i}: logits wanted");
        let err = max_rel_diff(g, e);
        assert!(err < 1e-5, "sequence {i}: logits differ by {err:.2e}");
    }
    continue_alike(&llama, &mut group, &mut caches, &mut alone);
}

#[test]
fn a_bad_item_fails_the_batch_and_leaves_every_cache_as_it_was() {
    let w = ModelWeights::synthetic(common::train_config(false), 3).unwrap();
    let (llama, mut group) = setup(&w);
    let mut a = KvCache::new(&w.cfg);
    futures::executor::block_on(llama.forward(&mut group, &[4, 5, 6], &mut a)).unwrap();
    let mut b = KvCache::new(&w.cfg);
    let long: Vec<u32> = (0..=w.cfg.max_seq as u32).collect();
    let before = a.len();
    let err = futures::executor::block_on(llama.forward_batch(
        &mut group,
        &mut [BatchItem::new(&[7], &mut a), BatchItem::new(&long, &mut b)],
    ))
    .unwrap_err();
    assert!(matches!(err, ModelError::ContextFull { .. }), "{err}");
    let err = futures::executor::block_on(llama.forward_batch(
        &mut group,
        &mut [
            BatchItem::new(&[7], &mut a),
            BatchItem::new(&[9999], &mut b),
        ],
    ))
    .unwrap_err();
    assert!(matches!(err, ModelError::TokenOutOfRange { .. }), "{err}");
    assert_eq!((a.len(), b.len()), (before, 0));
    // Still usable: the same as a cache that never saw the failed batches.
    let mut fresh = KvCache::new(&w.cfg);
    futures::executor::block_on(llama.forward(&mut group, &[4, 5, 6], &mut fresh)).unwrap();
    let x = futures::executor::block_on(llama.forward(&mut group, &[7], &mut a)).unwrap();
    let y = futures::executor::block_on(llama.forward(&mut group, &[7], &mut fresh)).unwrap();
    assert!(max_rel_diff(&x, &y) < 1e-6);
}

#[test]
fn the_minibatch_gradient_is_the_weighted_mean_of_the_sequences_gradients() {
    for tied in [true, false] {
        let w = ModelWeights::synthetic(common::train_config(tied), 5).unwrap();
        let (llama, mut group) = setup(&w);
        let seqs: [&[u32]; 3] = [&[3, 17, 60, 42, 9], &[5, 6], &[40, 41, 2, 8]];
        let alone: Vec<Gradients> = seqs
            .iter()
            .map(|s| futures::executor::block_on(llama.gradients(&mut group, s)).unwrap())
            .collect();
        group.reset_stats();
        let batch = futures::executor::block_on(llama.gradients_batch(&mut group, &seqs)).unwrap();
        let forward_and_back = 2 * (1 + 4 * w.cfg.layers as u64 + 1) - 1;
        assert!(
            group.stats().rounds <= forward_and_back,
            "one round per stage each way for the batch, got {}",
            group.stats().rounds
        );
        assert_eq!(batch.sequences, 3);
        assert_eq!(batch.t, 11);
        let predicted: Vec<f64> = seqs.iter().map(|s| (s.len() - 1) as f64).collect();
        let total: f64 = predicted.iter().sum();
        let weights: Vec<f32> = predicted.iter().map(|p| (p / total) as f32).collect();
        let loss: f64 = alone
            .iter()
            .zip(&predicted)
            .map(|(g, p)| g.loss * p / total)
            .sum();
        assert!(
            (batch.loss - loss).abs() < 1e-5 * loss,
            "loss {} vs {loss}",
            batch.loss
        );
        for (stage, m) in [
            (Stage::Qkv(0), 0),
            (Stage::Qkv(1), 2),
            (Stage::AttnOut(1), 0),
            (Stage::GateUp(0), 1),
            (Stage::Down(1), 0),
            (Stage::LmHead, 0),
        ] {
            let got = weight_grad(&batch, stage, m);
            let mut want = vec![0.0f32; got.len()];
            for (g, wt) in alone.iter().zip(&weights) {
                for (a, b) in want.iter_mut().zip(weight_grad(g, stage, m)) {
                    *a += wt * b;
                }
            }
            let err = max_rel_diff(&got, &want);
            assert!(err < 1e-4, "{stage:?} matrix {m} (tied {tied}): {err:.2e}");
        }
        let mut want = vec![0.0f32; w.cfg.hidden];
        for (g, wt) in alone.iter().zip(&weights) {
            for (a, b) in want.iter_mut().zip(&g.norms.attn_norm[1]) {
                *a += wt * b;
            }
        }
        assert!(max_rel_diff(&batch.norms.attn_norm[1], &want) < 1e-4);
    }
}

#[test]
fn an_sgd_step_on_a_batch_lowers_its_loss() {
    let mut w = ModelWeights::synthetic(common::train_config(true), 9).unwrap();
    let seqs: [&[u32]; 2] = [&[3, 17, 60, 42, 9, 17], &[8, 8, 1, 2]];
    let before = {
        let (llama, mut group) = setup(&w);
        futures::executor::block_on(llama.gradients_batch(&mut group, &seqs)).unwrap()
    };
    let loss = before.loss;
    Update::from_gradients(before, 0.5, 10.0)
        .apply_to_weights(&mut w)
        .unwrap();
    let (llama, mut group) = setup(&w);
    let after = futures::executor::block_on(llama.gradients_batch(&mut group, &seqs))
        .unwrap()
        .loss;
    assert!(after < loss - 1e-3, "loss {loss:.4} → {after:.4}");
}

#[test]
fn the_logits_of_several_last_positions_are_those_of_running_them_one_by_one() {
    // What drafted decoding relies on: one pass over a token and its draft gives, row by
    // row, the logits a token-by-token decode would, and the cache can drop what was not kept.
    let w = ModelWeights::synthetic(common::train_config(false), 5).unwrap();
    let (llama, mut group) = setup(&w);
    let mut one = KvCache::new(&w.cfg);
    futures::executor::block_on(llama.forward(&mut group, &[1, 2, 3], &mut one)).unwrap();
    let mut many = one.clone();
    let run = [4u32, 5, 6, 7];
    let expected: Vec<Vec<f32>> = run
        .iter()
        .map(|&t| futures::executor::block_on(llama.forward(&mut group, &[t], &mut one)).unwrap())
        .collect();
    let mut items = [BatchItem {
        logits: run.len(),
        ..BatchItem::new(&run, &mut many)
    }];
    let got = futures::executor::block_on(llama.forward_batch(&mut group, &mut items)).unwrap();
    let rows: Vec<&[f32]> = got[0].chunks_exact(w.cfg.vocab).collect();
    assert_eq!(rows.len(), run.len());
    for (i, (g, e)) in rows.iter().zip(&expected).enumerate() {
        let err = max_rel_diff(g, e);
        assert!(err < 1e-5, "position {i}: logits differ by {err:.2e}");
    }
    // Keep two of the four, then go on: the same as having run only those two.
    many.truncate(many.len() - 2);
    let mut two = KvCache::new(&w.cfg);
    futures::executor::block_on(llama.forward(&mut group, &[1, 2, 3, 4, 5], &mut two)).unwrap();
    let next = futures::executor::block_on(llama.forward(&mut group, &[9], &mut many)).unwrap();
    let want = futures::executor::block_on(llama.forward(&mut group, &[9], &mut two)).unwrap();
    assert!(
        max_rel_diff(&next, &want) < 1e-5,
        "a truncated cache goes on like a short one"
    );
}
