//! The wgpu backend against the CPU reference: the same products on both, compared within a
//! stated tolerance. Where no adapter exists (no GPU and no Mesa lavapipe), the GPU half is
//! skipped and says so; CI installs lavapipe, so there it runs.

#![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

mod common;

use std::sync::Arc;

use node_core::code::Generator;
use node_core::coded::{CodedGroup, GpuGroup, InProcess, Member, ShardFormat, ShardSet};
use node_core::compute::gpu::{Gpu, GpuError, Placement, Weights};
use node_core::compute::matmul;
use node_core::model::{KvCache, LeaderWeights, Llama, ModelWeights, Stage};
use node_core::protocol::StepRequest;
use rand::{Rng, SeedableRng};

/// Largest error allowed, relative to `Σ|w·x|` of the output (f32 sums in another order).
const TOL: f64 = 1e-5;

fn open() -> Option<Gpu> {
    match pollster::block_on(Gpu::open(false)) {
        Ok(gpu) => {
            eprintln!("GPU half on {}", gpu.info());
            Some(gpu)
        }
        Err(GpuError::NoAdapter(e)) => {
            eprintln!("SKIPPING the GPU half: no wgpu adapter ({e})");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// `max |a − b| / max Σ|w||x|`, the error relative to the largest magnitude a sum can have.
fn rel_err(a: &[f32], b: &[f32], bound: f32) -> f64 {
    assert_eq!(a.len(), b.len());
    let worst = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    f64::from(worst) / f64::from(bound.max(1e-30))
}

#[test]
fn gemv_gemm_and_transpose_match_the_cpu_for_f32_and_f16() {
    let Some(mut gpu) = open() else { return };
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
                    let got = pollster::block_on(gpu.matmul(
                        &[(&mat, Placement::plain(rows, t))],
                        &x,
                        t,
                        t * rows,
                    ))
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
                    let got_t = pollster::block_on(gpu.matmul_t(
                        &[(&mat, Placement::plain(rows, t))],
                        &u,
                        t,
                    ))
                    .unwrap();
                    let e = rel_err(&got_t, &want_t, rows as f32);
                    assert!(e < TOL, "transpose {rows}×{cols} f16={f16} t={t}: {e:e}");
                }
            }
        }
    }
}

#[test]
fn bad_shapes_are_errors_not_panics() {
    let Some(gpu) = open() else { return };
    assert!(gpu.upload(3, 4, Weights::F32(&[0.0; 11])).is_err());
    assert!(gpu.upload(0, 4, Weights::F32(&[])).is_err());
    let m = gpu.upload(3, 4, Weights::F32(&[0.5; 12])).unwrap();
    let p = Placement::plain(3, 1);
    let run = |x: &[f32], t, len| pollster::block_on(gpu.matmul(&[(&m, p)], x, t, len));
    assert!(run(&[1.0; 3], 1, 3).is_err(), "short input");
    assert!(
        run(&[1.0; 4], 1, 2).is_err(),
        "answer too short for the placement"
    );
    assert!(run(&[1.0; 4], 0, 3).is_err(), "no tokens");
    assert_eq!(run(&[1.0; 4], 1, 3).unwrap(), vec![2.0; 3]);
}

/// Every request a member answers, for the stages of `cfg`, with `t` tokens.
fn requests(member: &Member, t: usize) -> Vec<StepRequest> {
    let shards = member.shards();
    let m = shards.generator.sub_blocks();
    let mut out = Vec::new();
    for (i, stage) in Stage::all(&shards.cfg).into_iter().enumerate() {
        let list = shards.stage_shards(stage).unwrap();
        let cols = list[0].cols;
        let per_sub: usize = list.iter().map(|s| t * s.block_len).sum();
        out.push(StepRequest::Matmul {
            stage,
            t: t as u32,
            x: random(t * cols, 300 + i as u64),
        });
        out.push(StepRequest::MatmulT {
            stage,
            t: t as u32,
            u: random(m * per_sub, 400 + i as u64),
        });
    }
    out
}

#[test]
fn a_member_on_the_gpu_answers_what_it_answers_on_the_cpu() {
    let Some(gpu) = open() else { return };
    let gpu = Arc::new(gpu);
    let weights = ModelWeights::synthetic(common::train_config(false), 9).unwrap();
    let g = Generator::cauchy(5, 3).unwrap();
    assert!(
        g.sub_blocks() > 1,
        "the layout test needs several sub-blocks"
    );
    for format in [ShardFormat::F32, ShardFormat::F16] {
        let shards = ShardSet::encode(&weights, &g, 4, format, &mut |_, _| {}).unwrap();
        let mut member = Member::new(shards);
        member.use_gpu(gpu.clone(), 0).unwrap();
        assert!(member.gpu_info().is_some());
        for round in 0..2 {
            for t in [1, 3] {
                for req in requests(&member, t) {
                    let want = member.compute_cpu(&req).unwrap();
                    let got = member.compute(&req).unwrap();
                    let scale = want.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                    let e = rel_err(&got, &want, scale);
                    assert!(e < 1e-5, "{format:?} round {round} t={t} {req:?}: {e:e}");
                    assert!(scale > 0.0);
                }
            }
            // Changed shards: the GPU copy is dropped and uploaded again by sync_gpu.
            member.shards_mut().scale_values(1.5);
            member.sync_gpu().unwrap();
        }
        // An embedding lookup is no product: it still answers (on the CPU).
        let req = StepRequest::EmbedRows { rows: vec![0, 1] };
        assert_eq!(
            member.compute(&req).unwrap(),
            member.compute_cpu(&req).unwrap()
        );
    }
}

#[test]
fn a_whole_token_on_the_gpu_gives_the_logits_of_the_cpu_group() {
    let Some(mut gpu) = open() else { return };
    // Small chunks: every stage's stacked matrix is split, as large models' are.
    gpu.limit_chunk(2048);
    let gpu = Arc::new(gpu);
    for (tied, format, tol) in [
        (true, ShardFormat::F32, 1e-4),
        (false, ShardFormat::F32, 1e-4),
        (true, ShardFormat::F16, 1e-4),
    ] {
        let w = ModelWeights::synthetic(common::train_config(tied), 5).unwrap();
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
            let got = group.step(tok, pos).unwrap();
            let err = common::max_rel_diff(&got, &want);
            assert!(
                err < tol,
                "tied {tied}, {format:?}, position {pos}: logits off by {err:.2e}"
            );
        }
        // Past the cache, and a token outside the vocabulary: errors, not panics.
        assert!(group.step(1, w.cfg.max_seq).is_err());
        assert!(group.step(w.cfg.vocab as u32, 0).is_err());
    }
}
