//! Test bodies shared by the native GPU tests (tests/native/gpu.rs, Vulkan, Metal, DX12 or
//! lavapipe) and the browser ones (tests/webgpu.rs, WebGPU in headless Chromium): the same
//! checks on every backend.

#![allow(dead_code)] // each test crate uses some of them

use std::sync::Arc;

use node_core::coded::{CodedGroup, GpuGroup, InProcess, ShardFormat, ShardSet};
use node_core::compute::gpu::{Gpu, Placement, Weights};
use node_core::compute::matmul;
use node_core::compute::q8::{Ints, blocks_per_row, dequantize_row};
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

/// GEMV (32 rows a workgroup, and one), GEMM and the transpose product, f32, f16 and compact
/// (i8 and i16 with block scales), whole and split into row chunks, against the CPU.
pub async fn products_match_the_cpu(gpu: &mut Gpu) {
    let shapes = [
        (1, 1),
        (7, 37),
        (64, 576),
        (300, 130),
        (33, 1536),
        (3, 20000),
    ];
    for (split, narrow) in [(false, 0), (false, u32::MAX), (true, 0), (true, u32::MAX)] {
        if split {
            // Chunks of 1 KiB: the larger matrices are split into many row chunks.
            gpu.limit_chunk(1024);
        }
        gpu.narrow_rows_up_to(narrow);
        for (i, &(rows, cols)) in shapes.iter().enumerate() {
            let w = random(rows * cols, i as u64);
            let w16: Vec<half::f16> = w.iter().map(|&v| half::f16::from_f32(v)).collect();
            let w16_as_f32: Vec<f32> = w16.iter().map(|h| h.to_f32()).collect();
            // Compact: integers of a data row (±127) and of a parity row (±508), one scale per
            // row and 32 columns; the reference is their dequantised values.
            let (i8s, i16s, scales) = compact(&w, rows, cols);
            let as_f32 = |q: Ints<'_>| {
                let mut out = vec![0.0f32; rows * cols];
                for (r, row) in out.chunks_exact_mut(cols).enumerate() {
                    dequantize_row(q, &scales, cols, r, row);
                }
                out
            };
            let (i8_as_f32, i16_as_f32) = (as_f32(Ints::I8(&i8s)), as_f32(Ints::I16(&i16s)));
            let q8 = |q| Weights::Q8 { q, scales: &scales };
            for (format, mat, reference) in [
                ("f32", gpu.upload(rows, cols, Weights::F32(&w)).unwrap(), &w),
                (
                    "f16",
                    gpu.upload(rows, cols, Weights::F16(&w16)).unwrap(),
                    &w16_as_f32,
                ),
                (
                    "i8",
                    gpu.upload(rows, cols, q8(Ints::I8(&i8s))).unwrap(),
                    &i8_as_f32,
                ),
                (
                    "i16",
                    gpu.upload(rows, cols, q8(Ints::I16(&i16s))).unwrap(),
                    &i16_as_f32,
                ),
            ] {
                if split && rows * cols * 4 > 4096 {
                    assert!(mat.chunks() > 1, "{rows}×{cols} {format} was not split");
                }
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
                        "{rows}×{cols} {format} t={t} split={split} narrow={narrow}: {e:e}"
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
                    assert!(e < TOL, "transpose {rows}×{cols} {format} t={t}: {e:e}");
                }
            }
        }
    }
}

/// `w` (values within ±1) on compact grids: i8 integers within ±127, i16 ones within ±508 (a
/// parity row's range), and one scale per row and 32 columns that keeps `|w|` within 1.
fn compact(w: &[f32], rows: usize, cols: usize) -> (Vec<i8>, Vec<i16>, Vec<half::f16>) {
    let nb = blocks_per_row(cols);
    let scales = vec![half::f16::from_f32(1.0 / 508.0); rows * nb];
    let i8s = w.iter().map(|&v| (v * 127.0).round() as i8).collect();
    let i16s = w.iter().map(|&v| (v * 508.0).round() as i16).collect();
    (i8s, i16s, scales)
}

/// A whole decoded token on the GPU (members' products, decoding, the leader's work) gives the
/// logits of the same group on the CPU, for tied and untied models and f32 and f16 shards.
pub async fn a_whole_token_matches_the_cpu_group(mut gpu: Gpu) {
    // Small chunks: every stage's stacked matrix is split, as large models' are.
    gpu.limit_chunk(2048);
    let gpu = Arc::new(gpu);
    // Rows 4, 1, 2 mix a parity row in (compact: stacked as i16); compact data rows 0, 1, 2
    // stack as i8.
    for (tied, format, rows, tol) in [
        (true, ShardFormat::F32, [4, 1, 2], 1e-4),
        (false, ShardFormat::F32, [4, 1, 2], 1e-4),
        (true, ShardFormat::F16, [4, 1, 2], 1e-4),
        (true, ShardFormat::Q8, [4, 1, 2], 1e-4),
        (false, ShardFormat::Q8, [0, 1, 2], 1e-4),
    ] {
        let w = ModelWeights::synthetic(super::common::train_config(tied), 5).unwrap();
        let g = format.code(5, 3).unwrap();
        let mesh = InProcess::encode(&w, &g, format, &|_, _| {}).unwrap();
        let llama = Llama::new(w.cfg.clone(), LeaderWeights::from_model(&w)).unwrap();
        let sets: Vec<&ShardSet> = rows.iter().map(|&r| mesh.members()[r].shards()).collect();
        let group = GpuGroup::new(gpu.clone(), &llama, &sets, w.cfg.max_seq).unwrap();
        let mut cpu = CodedGroup::new(w.cfg.clone(), g.clone(), &rows, mesh).unwrap();
        let mut cache = KvCache::new(&w.cfg);
        let tokens = [3u32, 17, 60, 42, 9, 17, 5, 33, 12, 63, 0];
        for (pos, &tok) in tokens.iter().enumerate() {
            let want = llama.forward(&mut cpu, &[tok], &mut cache).await.unwrap();
            let got = group.step_async(tok, pos).await.unwrap();
            let err = super::common::max_rel_diff(&got, &want);
            assert!(
                err < tol,
                "tied {tied}, {format:?}, rows {rows:?}, position {pos}: logits off by {err:.2e}"
            );
        }
        // Past the cache, and a token outside the vocabulary: errors, not panics.
        assert!(group.step_async(1, w.cfg.max_seq).await.is_err());
        assert!(group.step_async(w.cfg.vocab as u32, 0).await.is_err());
    }
}
