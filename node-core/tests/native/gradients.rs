//! The backward pass against finite differences on a small synthetic model, and the coded
//! backward pass (transpose steps through k of n members) against the uncoded one.

use crate::common;

use futures::executor::block_on;
use node_core::code::Generator;
use node_core::coded::{CodedGroup, InProcess, ShardFormat};
use node_core::model::{
    BatchItem, Family, Gradients, KvCache, LeaderWeights, Llama, ModelWeights, Stage,
};

const TOKENS: [u32; 7] = [3, 17, 60, 42, 9, 17, 5];

fn grads(w: &ModelWeights, n: usize, k: usize, nodes: &[usize]) -> Gradients {
    let g = if n == 1 {
        Generator::uncoded()
    } else {
        Generator::cauchy(n, k).unwrap()
    };
    let mesh = InProcess::encode(w, &g, ShardFormat::F32, &|_, _| {}).unwrap();
    let mut group = CodedGroup::new(w.cfg.clone(), g, nodes, mesh).unwrap();
    let llama = Llama::new(w.cfg.clone(), LeaderWeights::from_model(w)).unwrap();
    futures::executor::block_on(llama.gradients(&mut group, &TOKENS)).unwrap()
}

fn loss(w: &ModelWeights) -> f64 {
    grads(w, 1, 1, &[0]).loss
}

/// `δW[r][c]` of matrix `m` of `stage` from its factors.
fn factor_entry(g: &Gradients, stage: Stage, m: usize, r: usize, c: usize) -> f64 {
    let s = g.stages.iter().find(|s| s.stage == stage).unwrap();
    let inp = s.x.len() / g.t;
    let out = s.dy[m].len() / g.t;
    (0..g.t)
        .map(|tok| s.dy[m][tok * out + r] as f64 * s.x[tok * inp + c] as f64)
        .sum()
}

/// The entry with the largest gradient of a factor pair (a well-measurable one).
fn largest(g: &Gradients, stage: Stage, m: usize) -> (usize, usize) {
    let s = g.stages.iter().find(|s| s.stage == stage).unwrap();
    let (inp, out) = (s.x.len() / g.t, s.dy[m].len() / g.t);
    let mut best = (0, 0, 0.0f64);
    for r in 0..out {
        for c in 0..inp {
            let v = factor_entry(g, stage, m, r, c).abs();
            if v > best.2 {
                best = (r, c, v);
            }
        }
    }
    (best.0, best.1)
}

/// Picks one weight matrix's values out of a model.
type Field = fn(&mut ModelWeights) -> &mut Vec<f32>;

fn central_difference(w: &ModelWeights, edit: impl Fn(&mut ModelWeights, f32)) -> f64 {
    let h = 1e-2f32;
    let mut plus = w.clone();
    edit(&mut plus, h);
    let mut minus = w.clone();
    edit(&mut minus, -h);
    (loss(&plus) - loss(&minus)) / (2.0 * h as f64)
}

fn close(analytic: f64, numeric: f64, what: &str) {
    let err = (analytic - numeric).abs();
    assert!(
        err <= 2e-3 + 2e-2 * analytic.abs(),
        "{what}: analytic {analytic:.6} vs finite difference {numeric:.6}"
    );
}

#[test]
fn gradients_match_finite_differences() {
    for tied in [true, false] {
        let w = ModelWeights::synthetic(common::train_config(tied), 7).unwrap();
        let g = grads(&w, 1, 1, &[0]);
        assert!(g.loss > 1.0 && g.loss.is_finite(), "loss {}", g.loss);
        // One well-measurable entry of every matrix of block 1 and of block 0's attention.
        let cases: [(Stage, usize, Field); 9] = [
            (Stage::Qkv(0), 0, |w| &mut w.layers[0].q.data),
            (Stage::Qkv(0), 1, |w| &mut w.layers[0].k.data),
            (Stage::Qkv(1), 2, |w| &mut w.layers[1].v.data),
            (Stage::AttnOut(0), 0, |w| &mut w.layers[0].o.data),
            (Stage::GateUp(1), 0, |w| &mut w.layers[1].gate.data),
            (Stage::GateUp(1), 1, |w| &mut w.layers[1].up.data),
            (Stage::Down(0), 0, |w| &mut w.layers[0].down.data),
            (Stage::Down(1), 0, |w| &mut w.layers[1].down.data),
            (Stage::Qkv(1), 0, |w| &mut w.layers[1].q.data),
        ];
        for (stage, m, data) in cases {
            let (r, c) = largest(&g, stage, m);
            let cols = g.stages.iter().find(|s| s.stage == stage).unwrap().x.len() / g.t;
            let analytic = factor_entry(&g, stage, m, r, c);
            let numeric = central_difference(&w, |w, h| data(w)[r * cols + c] += h);
            close(
                analytic,
                numeric,
                &format!("{stage:?} matrix {m} [{r}][{c}] (tied {tied})"),
            );
        }
        // The LM head; tied, its gradient adds the embedding lookup's rows.
        let (r, c) = largest(&g, Stage::LmHead, 0);
        let d = w.cfg.hidden;
        let mut analytic = factor_entry(&g, Stage::LmHead, 0, r, c);
        if tied {
            analytic += TOKENS
                .iter()
                .enumerate()
                .filter(|&(_, &tok)| tok as usize == r)
                .map(|(i, _)| g.embed_dx[i * d + c] as f64)
                .sum::<f64>();
        }
        let numeric = central_difference(&w, |w, h| match &mut w.lm_head {
            Some(m) => m.data[r * d + c] += h,
            None => w.embed.data[r * d + c] += h,
        });
        close(
            analytic,
            numeric,
            &format!("LM head [{r}][{c}] (tied {tied})"),
        );
        // An embedding row of a token of the sequence.
        let (r, c) = (TOKENS[2] as usize, 5);
        let mut analytic = TOKENS
            .iter()
            .enumerate()
            .filter(|&(_, &tok)| tok as usize == r)
            .map(|(i, _)| g.embed_dx[i * d + c] as f64)
            .sum::<f64>();
        if tied {
            analytic += factor_entry(&g, Stage::LmHead, 0, r, c);
        }
        let numeric = central_difference(&w, |w, h| w.embed.data[r * d + c] += h);
        close(
            analytic,
            numeric,
            &format!("embedding [{r}][{c}] (tied {tied})"),
        );
        // Norm gains, replicated on the leader.
        for (analytic, edit) in [
            (
                g.norms.attn_norm[0][3] as f64,
                (|w: &mut ModelWeights, h| w.layers[0].attn_norm[3] += h)
                    as fn(&mut ModelWeights, f32),
            ),
            (g.norms.ffn_norm[1][7] as f64, |w: &mut ModelWeights, h| {
                w.layers[1].ffn_norm[7] += h
            }),
            (g.norms.final_norm[11] as f64, |w: &mut ModelWeights, h| {
                w.final_norm[11] += h
            }),
        ] {
            close(
                analytic,
                central_difference(&w, edit),
                &format!("norm gain (tied {tied})"),
            );
        }
    }
}

/// A change of one weight by `h`.
type Edit = dyn Fn(&mut ModelWeights, f32);

#[test]
fn every_familys_extras_match_finite_differences() {
    // Qwen2's q/k/v biases, Qwen3's q/k head norms and Llama 3's RoPE factors change what the
    // leader does around the coded projections: their gradients, and the projections' through
    // them, against finite differences.
    let factors: Vec<f32> = (0..4).map(|i| 1.0 + 2.0 * i as f32).collect();
    for family in [Family::Llama, Family::Qwen2, Family::Qwen3] {
        let mut cfg = common::train_config(false);
        cfg.family = family;
        if family == Family::Llama {
            cfg.rope_freq_factors = factors.clone();
        }
        let mut w = ModelWeights::synthetic(cfg.clone(), 5).unwrap();
        // Gains away from 1, so that a wrong gain in the backward pass shows.
        for l in &mut w.layers {
            for (i, g) in l.q_norm.iter_mut().chain(l.k_norm.iter_mut()).enumerate() {
                *g = 0.7 + 0.05 * (i % 11) as f32;
            }
        }
        let g = grads(&w, 1, 1, &[0]);
        let (qd, kvd) = (cfg.q_dim(), cfg.kv_dim());
        let mut checks: Vec<(f64, Box<Edit>, String)> = Vec::new();
        let (r, c) = largest(&g, Stage::Qkv(0), 0);
        let cols = cfg.hidden;
        checks.push((
            factor_entry(&g, Stage::Qkv(0), 0, r, c),
            Box::new(move |w, h| w.layers[0].q.data[r * cols + c] += h),
            format!("q [{r}][{c}]"),
        ));
        let (r, c) = largest(&g, Stage::Qkv(1), 1);
        checks.push((
            factor_entry(&g, Stage::Qkv(1), 1, r, c),
            Box::new(move |w, h| w.layers[1].k.data[r * cols + c] += h),
            format!("k [{r}][{c}]"),
        ));
        for i in [3, qd + 5, qd + kvd + 2] {
            if let Some(bias) = g.norms.qkv_bias.get(1) {
                checks.push((
                    bias[i] as f64,
                    Box::new(move |w, h| w.layers[1].qkv_bias[i] += h),
                    format!("bias {i}"),
                ));
            }
        }
        for i in [1, 6] {
            if let (Some(q), Some(k)) = (g.norms.q_norm.first(), g.norms.k_norm.get(1)) {
                checks.push((
                    q[i] as f64,
                    Box::new(move |w, h| w.layers[0].q_norm[i] += h),
                    format!("q head norm {i}"),
                ));
                checks.push((
                    k[i] as f64,
                    Box::new(move |w, h| w.layers[1].k_norm[i] += h),
                    format!("k head norm {i}"),
                ));
            }
        }
        let extras = g.norms.qkv_bias.len() + g.norms.q_norm.len();
        assert_eq!(
            extras,
            match family {
                Family::Llama => 0,
                _ => cfg.layers,
            },
            "{family:?}'s extras have gradients"
        );
        for (analytic, edit, what) in checks {
            close(
                analytic,
                central_difference(&w, edit),
                &format!("{family:?} {what}"),
            );
        }
    }
}

fn rel(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|&y| (y as f64).powi(2)).sum();
    (num / den.max(1e-30)).sqrt()
}

#[test]
fn coded_backward_matches_the_uncoded_one_for_every_group() {
    let w = ModelWeights::synthetic(common::train_config(true), 11).unwrap();
    let reference = grads(&w, 1, 1, &[0]);
    let mut worst = 0.0f64;
    let all: Vec<Vec<usize>> = node_core::code::subsets(5, 3).collect();
    assert_eq!(all.len(), 10);
    for nodes in all {
        let coded = grads(&w, 5, 3, &nodes);
        assert!((coded.loss - reference.loss).abs() < 1e-4 * reference.loss);
        worst = worst.max(rel(&coded.embed_dx, &reference.embed_dx));
        for (c, r) in coded.stages.iter().zip(&reference.stages) {
            assert_eq!(c.stage, r.stage);
            worst = worst.max(rel(&c.x, &r.x));
            for (a, b) in c.dy.iter().zip(&r.dy) {
                worst = worst.max(rel(a, b));
            }
        }
    }
    assert!(
        worst < 1e-4,
        "coded gradients differ from uncoded by {worst:.2e}"
    );
    eprintln!("coded backward: worst relative difference {worst:.2e}");
}

#[test]
fn training_walks_the_blocks_of_the_models_forward_pass() {
    // The model's forward pass (each sequence over its KV cache, a token at a time as when
    // serving) and training's (each sequence within itself, keeping activations) run one
    // block ([`node_core::model::BLOCK`]): training's loss is the cross-entropy of the model's
    // logits. The GPU whole token's plan walks the same steps (tests/native/gpu.rs).
    for tied in [true, false] {
        let w = ModelWeights::synthetic(common::train_config(tied), 11).unwrap();
        let g = Generator::uncoded();
        let mesh = InProcess::encode(&w, &g, ShardFormat::F32, &|_, _| {}).unwrap();
        let mut group = CodedGroup::new(w.cfg.clone(), g, &[0], mesh).unwrap();
        let llama = Llama::new(w.cfg.clone(), LeaderWeights::from_model(&w)).unwrap();
        let trained = block_on(llama.sequence_loss(&mut group, &TOKENS)).unwrap();
        // Half the prompt at once, then a token a pass: the cache path, one row and many.
        let mut cache = KvCache::new(&w.cfg);
        let first = BatchItem {
            tokens: &TOKENS[..3],
            cache: &mut cache,
            logits: 3,
        };
        let mut logits = block_on(llama.forward_batch(&mut group, &mut [first])).unwrap();
        for &id in &TOKENS[3..TOKENS.len() - 1] {
            logits.push(block_on(llama.forward(&mut group, &[id], &mut cache)).unwrap());
        }
        let logits = logits.concat();
        let vocab = w.cfg.vocab;
        assert_eq!(logits.len(), (TOKENS.len() - 1) * vocab);
        let served: f64 = logits
            .chunks_exact(vocab)
            .zip(&TOKENS[1..])
            .map(|(row, &next)| {
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
                let sum: f64 = row.iter().map(|&z| (z as f64 - max).exp()).sum();
                sum.ln() + max - row[next as usize] as f64
            })
            .sum::<f64>()
            / (TOKENS.len() - 1) as f64;
        assert!(
            (trained - served).abs() < 1e-5 * served.abs(),
            "tied {tied}: training's loss {trained} against the served logits' {served}"
        );
    }
}
