//! Coded execution of a small synthetic model matches the uncoded model for every group.

use node_core::code::{Generator, select_nodes};
use node_core::coded::{CodedGroup, InProcess, ShardFormat};
use node_core::model::{KvCache, LeaderWeights, Llama, LlamaConfig, ModelWeights};

fn tiny_config(tied: bool) -> LlamaConfig {
    LlamaConfig {
        tied_embeddings: tied,
        ..LlamaConfig::test_model()
    }
}

/// Logits of every step: a 5-token prefill, then 3 single-token steps.
fn run(llama: &Llama, group: &mut impl node_core::model::LinearExec) -> Vec<Vec<f32>> {
    let mut cache = KvCache::new(llama.config());
    let mut out = vec![
        futures::executor::block_on(llama.forward(group, &[3, 17, 200, 42, 9], &mut cache))
            .unwrap(),
    ];
    for tok in [5u32, 249, 0] {
        out.push(futures::executor::block_on(llama.forward(group, &[tok], &mut cache)).unwrap());
    }
    out
}

fn rel_err(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (x, y) in a.iter().flatten().zip(b.iter().flatten()) {
        num += ((x - y) as f64).powi(2);
        den += (*y as f64).powi(2);
    }
    (num / den).sqrt()
}

#[test]
fn every_group_of_k_rows_matches_the_uncoded_model() {
    for tied in [true, false] {
        let weights = ModelWeights::synthetic(tiny_config(tied), 11).unwrap();
        let llama = Llama::new(weights.cfg.clone(), LeaderWeights::from_model(&weights)).unwrap();
        let g1 = Generator::uncoded();
        let mesh = InProcess::encode(&weights, &g1, ShardFormat::F32, &|_, _| {}).unwrap();
        let mut uncoded = CodedGroup::new(weights.cfg.clone(), g1, &[0], mesh).unwrap();
        let reference = run(&llama, &mut uncoded);
        for k in 1..=4 {
            let n = k + 2;
            let g = Generator::cauchy(n, k).unwrap();
            let mesh = InProcess::encode(&weights, &g, ShardFormat::F32, &|_, _| {}).unwrap();
            let mut worst = 0.0f64;
            for nodes in node_core::code::subsets(n, k) {
                let mut group =
                    CodedGroup::new(weights.cfg.clone(), g.clone(), &nodes, mesh.clone()).unwrap();
                let kappa = group.condition_number();
                let logits = run(&llama, &mut group);
                let err = rel_err(&logits, &reference);
                // f32 decode error is about 1e-7·κ per stage (docs/coding.md); 3 layers give
                // 14 decoded rounds whose errors add and pass through the network, so allow
                // 1e-5·κ: two orders of magnitude above one decode, and still far below the
                // 1e-2 that a wrong row, block or shard produces.
                let bound = 1e-5 * kappa.max(1.0);
                assert!(
                    err <= bound,
                    "tied={tied} k={k} n={n} rows {nodes:?}: rel err {err:.3e} > {bound:.3e} (κ={kappa:.2})"
                );
                worst = worst.max(err);
            }
            eprintln!("tied={tied} k={k} n={n}: worst relative logit error {worst:.3e}");
        }
    }
}

#[test]
fn a_wrong_shard_changes_the_logits_far_beyond_the_bound() {
    let weights = ModelWeights::synthetic(tiny_config(true), 5).unwrap();
    let llama = Llama::new(weights.cfg.clone(), LeaderWeights::from_model(&weights)).unwrap();
    let g = Generator::cauchy(5, 3).unwrap();
    let mesh = InProcess::encode(&weights, &g, ShardFormat::F32, &|_, _| {}).unwrap();
    let sel = select_nodes(&g, &[0, 1, 2, 3, 4]).unwrap();
    let mut good = CodedGroup::new(weights.cfg.clone(), g.clone(), &sel.nodes, mesh).unwrap();
    let reference = run(&llama, &mut good);
    // Shards encoded from a model with one weight changed by 0.5.
    let mut bad_weights = weights.clone();
    bad_weights.layers[1].up.data[7] += 0.5;
    let bad_mesh = InProcess::encode(&bad_weights, &g, ShardFormat::F32, &|_, _| {}).unwrap();
    let mut bad = CodedGroup::new(weights.cfg.clone(), g, &sel.nodes, bad_mesh).unwrap();
    let err = rel_err(&run(&llama, &mut bad), &reference);
    assert!(err > 1e-4, "a changed weight went unnoticed: {err:.3e}");
}

#[test]
fn the_coded_group_counts_rounds_and_bytes() {
    let weights = ModelWeights::synthetic(tiny_config(true), 1).unwrap();
    let llama = Llama::new(weights.cfg.clone(), LeaderWeights::from_model(&weights)).unwrap();
    let g = Generator::cauchy(5, 3).unwrap();
    let mesh = InProcess::encode(&weights, &g, ShardFormat::F32, &|_, _| {}).unwrap();
    let mut group = CodedGroup::new(weights.cfg.clone(), g, &[0, 2, 4], mesh).unwrap();
    let mut cache = KvCache::new(llama.config());
    futures::executor::block_on(llama.forward(&mut group, &[1, 2, 3], &mut cache)).unwrap();
    // One embedding round, four per layer, one LM head.
    assert_eq!(group.stats().rounds, 4 * 3 + 2);
    assert!(group.stats().bytes_sent > 0 && group.stats().bytes_received > 0);
}
