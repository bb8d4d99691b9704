//! The verification threshold a mesh measures at genesis holds for the requests it serves:
//! on the tiny Hugging Face model of testdata, through a growing code of ten rows, honest
//! groups in any order, with prompts of any length and steps on their caches, never fail a
//! check. (Calibrating on single tokens through rows in a fixed order once set the threshold
//! a tenth as high, and served requests tripped it.)

use anyhow::Result;
use node_core::code::Generator;
use node_core::coded::measure_noise;
use node_core::coded::{CodedGroup, InProcess, NOISE_MARGIN, ShardFormat, VerifyConfig};
use node_core::model::{KvCache, LeaderWeights, Llama};
use node_native::load::load_model;
use tests::testdata;

#[test]
fn the_genesis_threshold_clears_honest_served_requests() -> Result<()> {
    let _machine = crate::machine::share();
    let w = load_model(&testdata().join("tiny-llama-hf"))?.weights;
    let norms = LeaderWeights::from_model(&w);
    let llama = Llama::new(w.cfg.clone(), norms.clone())?;
    for (n, g) in [
        (10, Generator::growing(10, 3, None)?),
        (5, Generator::cauchy(5, 3)?),
    ] {
        let mesh = InProcess::encode(&w, &g, ShardFormat::F32, &|_, _| {})?;
        let (noise, mesh) = measure_noise(&w.cfg, &norms, &g, mesh, 24)?;
        let check = VerifyConfig {
            extra: 1,
            noise: NOISE_MARGIN * noise,
            project: false,
        };
        let mut transport = Some(mesh);
        let mut worst = 0.0f64;
        // Groups of k + 1 rows stepping through the code in every rotation, prompts of 1 to
        // 49 tokens, then five steps each.
        for i in 0..40usize {
            let mut rows: Vec<usize> = (0..4).map(|j| (i * 3 + j * (1 + i % 3)) % n).collect();
            rows.sort_unstable();
            rows.dedup();
            if rows.len() < 4 {
                continue;
            }
            rows.rotate_left(i % 4);
            let t = transport
                .take()
                .ok_or_else(|| anyhow::anyhow!("lost the members"))?;
            let mut group = CodedGroup::new(w.cfg.clone(), g.clone(), &rows, t)?;
            group.set_verify(check);
            let prompt: Vec<u32> = (0..1 + (i * 7) % 49)
                .map(|j| ((i * 31 + j * 17) % w.cfg.vocab) as u32)
                .collect();
            let mut cache = KvCache::new(&w.cfg);
            let mut logits = pollster::block_on(llama.forward(&mut group, &prompt, &mut cache))?;
            for _ in 0..5 {
                let last = &logits[logits.len() - w.cfg.vocab..];
                logits = pollster::block_on(llama.forward(
                    &mut group,
                    &[tests::argmax(last)],
                    &mut cache,
                ))?;
            }
            let s = group.stats();
            assert!(
                s.caught.is_empty(),
                "n = {n}, rows {rows:?}: {:?}",
                s.caught
            );
            worst = worst.max(s.max_pass_ratio);
            transport = Some(group.into_transport());
        }
        eprintln!("n = {n}: honest residuals up to {worst:.3} of the threshold");
        assert!(
            worst > 0.0 && worst < 0.5,
            "n = {n}: honest residuals reached {worst:.3} of the threshold"
        );
    }
    Ok(())
}
