//! Test bodies shared by the native GPU tests (tests/native/gpu.rs, Vulkan, Metal, DX12 or
//! lavapipe) and the browser ones (tests/webgpu.rs, WebGPU in headless Chromium): the same
//! checks on every backend.

#![allow(dead_code)] // each test crate uses some of them

use std::sync::Arc;

use node_core::code::Generator;
use node_core::coded::{CodedGroup, GpuGroup, InProcess, ShardFormat, ShardSet};
use node_core::compute::gpu::{Gpu, Placement, Weights};
use node_core::compute::matmul;
use node_core::model::{KvCache, LeaderWeights, Llama, ModelWeights};
use rand::{Rng, SeedableRng};

/// Largest error allowed, relative to `Σ|w·x|` of the output (f32 sums in another order).
pub const TOL: f64 = 1e-5;

/// `n` values uniform in [−1, 1), reproducible from `seed`.
pub fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// `max |a − b| / max Σ|w||x|`, the error relative to the largest magnitude a sum can have.
pub fn rel_err(a: &[f32], b: &[f32], bound: f32) -> f64 {
    assert_eq!(a.len(), b.len());
    let worst = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    f64::from(worst) / f64::from(bound.max(1e-30))
}

/// GEMV, GEMM and the transpose product, f32 and f16, whole and split into row chunks, against
/// the CPU.
pub async fn products_match_the_cpu(gpu: &mut Gpu) {
    let shapes = [(1, 1), (7, 37), (64, 576), (300, 130), (33, 1536)];
    for split in [false, true] {
        if split {
            // Chunks of 1 KiB: the larger matrices are split into many row chunks.
            gpu.limit_chunk(1024);
        }
        for (i, &(rows, cols)) in shapes.iter().enumerate() {
            let w = random(rows * cols, i as u64);
            let w16: Vec<half::f16> = w.iter().map(|&v| half::f16::from_f32(v)).collect();
            let w16_as_f32: Vec<f32> = w16.iter().map(|h| h.to_f32()).collect();
            for (f16, mat) in [
                (false, gpu.upload(rows, cols, Weights::F32(&w)).unwrap()),
                (true, gpu.upload(rows, cols, Weights::F16(&w16)).unwrap()),
            ] {
                if split && rows * cols * 4 > 4096 {
                    assert!(mat.chunks() > 1, "{rows}×{cols} was not split");
                }
                let reference = if f16 { &w16_as_f32 } else { &w };
                for t in [1, 2, 5] {
                    let x = random(t * cols, 100 + t as u64);
                    let mut want = vec![0.0f32; t * rows];
                    matmul(reference, rows, cols, &x, t, &mut want);
                    let got = gpu
                        .matmul(&[(&mat, Placement::plain(rows, t))], &x, t, t * rows)
                        .await
                        .unwrap();
                    let bound = cols as f32; // |w|, |x| ≤ 1
                    let e = rel_err(&got, &want, bound);
                    assert!(
                        e < TOL,
                        "{rows}×{cols} f16={f16} t={t} split={split}: {e:e}"
                    );

                    // Transpose: y (t × cols) = u (t × rows) · W.
                    let u = random(t * rows, 200 + t as u64);
                    let mut want_t = vec![0.0f32; t * cols];
                    for tok in 0..t {
                        for r in 0..rows {
                            let a = u[tok * rows + r];
                            for c in 0..cols {
                                want_t[tok * cols + c] += a * reference[r * cols + c];
                            }
                        }
                    }
                    let got_t = gpu
                        .matmul_t(&[(&mat, Placement::plain(rows, t))], &u, t)
                        .await
                        .unwrap();
                    let e = rel_err(&got_t, &want_t, rows as f32);
                    assert!(e < TOL, "transpose {rows}×{cols} f16={f16} t={t}: {e:e}");
                }
            }
        }
    }
}

/// A whole decoded token on the GPU (members' products, decoding, the leader's work) gives the
/// logits of the same group on the CPU, for tied and untied models and f32 and f16 shards.
pub async fn a_whole_token_matches_the_cpu_group(mut gpu: Gpu) {
    // Small chunks: every stage's stacked matrix is split, as large models' are.
    gpu.limit_chunk(2048);
    let gpu = Arc::new(gpu);
    for (tied, format, tol) in [
        (true, ShardFormat::F32, 1e-4),
        (false, ShardFormat::F32, 1e-4),
        (true, ShardFormat::F16, 1e-4),
    ] {
        let w = ModelWeights::synthetic(super::common::train_config(tied), 5).unwrap();
        let g = Generator::cauchy(5, 3).unwrap();
        let mesh = InProcess::encode(&w, &g, format, &|_, _| {}).unwrap();
        let llama = Llama::new(w.cfg.clone(), LeaderWeights::from_model(&w)).unwrap();
        let rows = [4, 1, 2];
        let sets: Vec<&ShardSet> = rows.iter().map(|&r| mesh.members()[r].shards()).collect();
        let group = GpuGroup::new(gpu.clone(), &llama, &sets, w.cfg.max_seq).unwrap();
        let mut cpu = CodedGroup::new(w.cfg.clone(), g.clone(), &rows, mesh).unwrap();
        let mut cache = KvCache::new(&w.cfg);
        let tokens = [3u32, 17, 60, 42, 9, 17, 5, 33, 12, 63, 0];
        for (pos, &tok) in tokens.iter().enumerate() {
            let want = llama.forward(&mut cpu, &[tok], &mut cache).unwrap();
            let got = group.step_async(tok, pos).await.unwrap();
            let err = super::common::max_rel_diff(&got, &want);
            assert!(
                err < tol,
                "tied {tied}, {format:?}, position {pos}: logits off by {err:.2e}"
            );
        }
        // Past the cache, and a token outside the vocabulary: errors, not panics.
        assert!(group.step_async(1, w.cfg.max_seq).await.is_err());
        assert!(group.step_async(w.cfg.vocab as u32, 0).await.is_err());
    }
}
