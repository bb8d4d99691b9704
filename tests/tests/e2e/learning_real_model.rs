//! Learning that learns, on the real model (SmolLM2-135M-Instruct) in compact rows of `up`'s
//! two-core shape (k = 2 of 4, q8), with the mesh's default learning (Adam on the coded
//! adapters) and the canary gate every leader runs: a passage sent a few times is learnt, text
//! of another kind is not harmed, and a poisoner who sends the same garbage over and over is
//! stopped by the gate before the held-out text suffers.

use node_core::coded::ShardFormat;
use node_core::mesh::LearningConfig;
use node_native::bench::learning::{GARBAGE, TAUGHT, teach_in_process};
use tests::real_model;

fn ppl((before, after): (f64, f64)) -> (f64, f64) {
    (before.exp(), after.exp())
}

#[test]
fn a_taught_passage_is_learnt_and_a_poisoner_is_stopped_by_the_canary_gate() -> anyhow::Result<()> {
    let _machine = crate::machine::share();
    let model = real_model()?;
    let learning = LearningConfig::default();
    let shape = (4, 2);
    let taught = teach_in_process(
        &model.weights,
        &model.tokenizer,
        ShardFormat::Q8,
        shape,
        learning,
        TAUGHT,
        8,
        true,
        |_, _, _| {},
    )?;
    let (t0, t1) = ppl(taught.taught);
    let (h0, h1) = ppl(taught.held_out);
    eprintln!("taught 8 times: perplexity {t0:.2} → {t1:.2}; held-out {h0:.2} → {h1:.2}");
    // Measured: 51.9 → 14.6 (−72%), held-out −3.9%.
    assert!(
        t1 < 0.6 * t0,
        "the passage was not learnt: {t0:.2} → {t1:.2}"
    );
    assert!(h1 < 1.03 * h0, "held-out text suffered: {h0:.2} → {h1:.2}");
    assert_eq!(taught.refused, 0, "the gate refused a passage's updates");

    let poisoned = teach_in_process(
        &model.weights,
        &model.tokenizer,
        ShardFormat::Q8,
        shape,
        learning,
        GARBAGE,
        45,
        true,
        |_, _, _| {},
    )?;
    let (g0, g1) = ppl(poisoned.taught);
    let (h0, h1) = ppl(poisoned.held_out);
    eprintln!(
        "garbage 45 times: its perplexity {g0:.2} → {g1:.2}; held-out {h0:.2} → {h1:.2}; {} published, {} refused",
        poisoned.published, poisoned.refused
    );
    // Measured: the first refusal at the 41st request, once the canary had risen 0.03 nats.
    assert!(
        poisoned.refused > 0,
        "the gate let every garbage update through"
    );
    assert!(h1 < 1.03 * h0, "held-out text suffered: {h0:.2} → {h1:.2}");
    Ok(())
}
