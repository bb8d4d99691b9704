//! The wgpu backend against the CPU reference: the same products on both, compared within a
//! stated tolerance. Where no adapter exists (no GPU and no Mesa lavapipe), the GPU half is
//! skipped and says so; CI installs lavapipe, so there it runs.

use std::sync::Arc;

use crate::common;
use crate::gpu_bodies::{self, random, rel_err};
use node_core::code::Generator;
use node_core::coded::{Member, ShardFormat, ShardSet, adapter_rank};
use node_core::compute::gpu::{Gpu, GpuError, Placement, Weights};
use node_core::model::{ModelWeights, Stage};
use node_core::protocol::StepRequest;

fn open() -> Option<Gpu> {
    match pollster::block_on(Gpu::open(false)) {
        Ok(gpu) => {
            eprintln!("GPU half on {}", gpu.info());
            Some(gpu)
        }
        Err(GpuError::NoAdapter(e)) => {
            // CI installs Mesa's lavapipe: there a missing adapter is a failure, not a skip.
            assert!(
                std::env::var_os("CI").is_none_or(|v| v.is_empty()),
                "CI needs a wgpu adapter (scripts/test.sh installs mesa-vulkan-drivers): {e}"
            );
            eprintln!("SKIPPED: the GPU half: no wgpu adapter ({e})");
            // Counted in the test command's closing line (scripts/test.sh names the file).
            if let Some(file) = std::env::var_os("CODEDMESH_SKIPS") {
                use std::io::Write as _;
                let _ = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(file)
                    .and_then(|mut f| {
                        writeln!(f, "the GPU half of the kernel tests: no wgpu adapter")
                    });
            }
            None
        }
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn gemv_gemm_and_transpose_match_the_cpu_in_every_weight_format() {
    let Some(mut gpu) = open() else { return };
    pollster::block_on(gpu_bodies::products_match_the_cpu(&mut gpu));
}

#[test]
fn bad_shapes_are_errors_not_panics() {
    let Some(gpu) = open() else { return };
    assert!(gpu.upload(3, 4, Weights::F32(&[0.0; 11])).is_err());
    assert!(gpu.upload(0, 4, Weights::F32(&[])).is_err());
    // Compact: a scale short, or integers that are not rows × cols.
    let one = [half::f16::ONE; 3];
    let q = node_core::compute::q8::Ints::I8(&[1; 12]);
    assert!(
        gpu.upload(
            3,
            4,
            Weights::Q8 {
                q,
                scales: &one[..2]
            }
        )
        .is_err()
    );
    assert!(gpu.upload(3, 5, Weights::Q8 { q, scales: &one }).is_err());
    assert!(gpu.upload(3, 4, Weights::Q8 { q, scales: &one }).is_ok());
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
    // Compact shards are on the integer code: row 0 holds i8, row 4 (a parity row) i16.
    let integer = ShardFormat::Q8.code(5, 3).unwrap();
    for (format, g, node) in [
        (ShardFormat::F32, &g, 4),
        (ShardFormat::F16, &g, 4),
        (ShardFormat::Q8, &integer, 0),
        (ShardFormat::Q8, &integer, 4),
    ] {
        let shards = ShardSet::encode(&weights, g, node, format, &mut |_, _| {}).unwrap();
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
                    assert!(
                        e < 1e-5,
                        "{format:?} row {node} round {round} t={t} {req:?}: {e:e}"
                    );
                    assert!(scale > 0.0);
                }
            }
            // Changed shards: the GPU copy is dropped and uploaded again by sync_gpu.
            member.shards_mut().scale_values(1.5);
            member.sync_gpu().unwrap();
            if format == ShardFormat::Q8 && round == 0 {
                // Compact shards that learnt: the integers stay on the GPU and the adapters
                // are added on the CPU, to the same answer.
                let before = member.compute_cpu(&requests(&member, 1)[0]).unwrap();
                member.learn(|s| {
                    for (i, shard) in s.blocks.iter_mut().flatten().enumerate() {
                        let len = shard.stored_rows() * adapter_rank(shard.cols);
                        shard.adapter.a = random(len, 500 + i as u64);
                    }
                });
                let after = member.compute_cpu(&requests(&member, 1)[0]).unwrap();
                assert!(rel_err(&after, &before, 1.0) > 1e-3, "the adapters count");
            }
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
    let Some(gpu) = open() else { return };
    pollster::block_on(gpu_bodies::a_whole_token_matches_the_cpu_group(gpu));
}
