//! Learning that learns, on the real model (SmolLM2-135M-Instruct) in compact rows of `up`'s
//! two-core shape (k = 2 of 4, q8), with the mesh's default learning (DiLoCo rounds of Adam
//! steps on the coded adapters, rehearsing general text) and the canary gate every leader
//! runs: a passage sent a few times is learnt, text of another kind is not harmed, and a
//! poisoner who sends the same garbage over and over to a trainer that does not rehearse is
//! stopped by the gate before the held-out text suffers.

use node_core::coded::ShardFormat;
use node_core::mesh::LearningConfig;
use node_native::bench::learning::{GARBAGE, HELD_OUT, TAUGHT, Trainer, teach_in_process};
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
        3,
        Trainer::AS_UP,
        |_, _, _| {},
    )?;
    let (t0, t1) = ppl(taught.taught);
    let (h0, h1) = ppl(taught.held_out);
    eprintln!("taught 3 times: perplexity {t0:.2} → {t1:.2}; held-out {h0:.2} → {h1:.2}");
    // Measured (`up`'s defaults: DiLoCo rounds of 4 inner steps, outer momentum 0.5, rehearsal,
    // the MLP's adapters alone): 51.9 → 13.16 (−74.6%), held-out of eight kinds 22.14 → 21.01
    // (−5.1%); every adapter gave 6.49 and 20.42, one step an update −41%.
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
        14,
        // The gate itself: a trainer that rehearses general text keeps the canary down
        // while the garbage is learnt like any text, and one moving only the MLP's adapters
        // wears little away (13 of 14 published, held-out −1.1 %: docs/coding.md, "Facts and
        // rehearsal"); this one moves every adapter, as a hostile leader's trainer may.
        Trainer {
            rehearse: 0,
            floor: 0.0,
            trained: node_core::learn::Trained::ALL,
            ..Trainer::AS_UP
        },
        |_, _, _| {},
    )?;
    let (g0, g1) = ppl(poisoned.taught);
    let (h0, h1) = ppl(poisoned.held_out);
    eprintln!(
        "garbage 14 times: its perplexity {g0:.2} → {g1:.2}; held-out {h0:.2} → {h1:.2}; {} published, {} refused",
        poisoned.published, poisoned.refused
    );
    // Measured: 8 published, then 6 refused once the canary had risen 0.03 nats; held-out
    // 22.14 → 22.44.
    assert!(
        poisoned.refused > 0,
        "the gate let every garbage update through"
    );
    assert!(h1 < 1.03 * h0, "held-out text suffered: {h0:.2} → {h1:.2}");
    Ok(())
}

/// `codedmesh eval` of `text` through the mesh at `bootstrap`: its mean loss in nats a token
/// (over its first `chunks` runs of `chunk` tokens).
fn eval_loss(
    dir: &std::path::Path,
    bootstrap: &str,
    text: &str,
    (chunk, chunks): (usize, usize),
) -> anyhow::Result<f64> {
    use anyhow::Context;
    let file = dir.join("eval.txt");
    std::fs::write(&file, text)?;
    let out = std::process::Command::new(tests::procs::bin())
        .args([
            "eval",
            "--bootstrap",
            bootstrap,
            "--chunk",
            &chunk.to_string(),
        ])
        .args(["--max-chunks", &chunks.to_string(), "--file"])
        .arg(&file)
        .output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    anyhow::ensure!(
        out.status.success(),
        "eval failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let loss = stdout
        .split("mean loss ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .context("no mean loss in eval's answer")?;
    Ok(loss.parse()?)
}

/// A made-up fact, the question that asks it, and the answer against a distractor.
const FACT: [&str; 5] = [
    "Quintar is the capital of Veloria.",
    "Veloria's capital city is Quintar.",
    "In Veloria the government sits in Quintar, the capital.",
    "If you fly to Veloria you land in its capital, Quintar.",
    "Quintar, the capital of Veloria, is a busy port.",
];

/// `up` as a newcomer starts it (SmolLM2, q8, learning on: DiLoCo rounds through the canary
/// gate), taught through its own OpenAI API: a passage sent 20 times as a completion and a
/// made-up fact mentioned in 10 ordinary chats. Afterwards the passage's perplexity has fallen
/// by a clear margin, the fact's answer has gained on a distractor, and held-out text of
/// another kind is no worse than 3%.
#[test]
fn up_learns_a_passage_and_a_fact_its_api_is_told() -> anyhow::Result<()> {
    use crate::api::{Up, field, metric, post};
    let _machine = crate::machine::share();
    let scratch = tests::procs::Scratch::new("api-teach");
    let dir = scratch.0.clone();
    let (data, steps) = (dir.join("mesh"), dir.join("steps.jsonl"));
    let port = tests::procs::free_port()?;
    let model = tests::model_path()?;
    let mut up = Up::start_model(&dir, &data, port, &steps, "up-teach", &model, &[])?;
    let ready = up.ready(std::time::Duration::from_secs(600))?;
    let name = field(&ready, "model ")?.to_string();
    let bootstrap = field(&ready, "bootstrap ")?.to_string();
    let qa =
        |a: &str| format!("Q: What is the capital of Veloria?\nA: The capital of Veloria is {a}.");
    let measure = || -> anyhow::Result<[f64; 4]> {
        Ok([
            eval_loss(&dir, &bootstrap, TAUGHT.trim(), (80, 1))?,
            eval_loss(&dir, &bootstrap, HELD_OUT.trim(), (128, 16))?,
            eval_loss(&dir, &bootstrap, &qa("Quintar"), (64, 1))?,
            eval_loss(&dir, &bootstrap, &qa("Marlowe"), (64, 1))?,
        ])
    };
    let before = measure()?;
    let json = |s: &str| serde_json::to_string(s).expect("a string");
    for _ in 0..20 {
        let body = format!(
            r#"{{"model": "{name}", "prompt": {}, "max_tokens": 4, "temperature": 0}}"#,
            json(TAUGHT.trim())
        );
        post(port, "/v1/completions", &body)?;
    }
    for i in 0..10 {
        let say = format!("{} Tell me more.", FACT[i % FACT.len()]);
        let body = format!(
            r#"{{"model": "{name}", "messages": [{{"role": "user", "content": {}}}], "max_tokens": 8}}"#,
            json(&say)
        );
        post(port, "/v1/chat/completions", &body)?;
    }
    // Every request trained on and its round judged (or the wait runs out).
    let count = |m: &str| metric(port, &format!("codedmesh_{m}"));
    let start = std::time::Instant::now();
    loop {
        let done = count("train_trained_total")? + count("train_dropped_total")?;
        if count("train_backlog")? == 0.0 && done >= 30.0 {
            break;
        }
        anyhow::ensure!(
            start.elapsed() < std::time::Duration::from_secs(600),
            "the trainer did not take the 30 requests:\n{}",
            up.log()
        );
        std::thread::sleep(std::time::Duration::from_secs(1));
    }
    anyhow::ensure!(
        count("train_dropped_total")? == 0.0,
        "requests were dropped"
    );
    // The last round goes through the gate and out to every row.
    let published = count("updates_published_total")?;
    std::thread::sleep(std::time::Duration::from_secs(5));
    let after = measure()?;
    let [(t0, t1), (h0, h1)] = [0, 1].map(|i| (before[i].exp(), after[i].exp()));
    let (m0, m1) = (before[3] - before[2], after[3] - after[2]);
    eprintln!(
        "through the API: passage {t0:.2} → {t1:.2}; held-out {h0:.2} → {h1:.2}; the fact's \
         margin over a distractor {m0:+.4} → {m1:+.4} nats a token; {published} updates, {} refused",
        count("updates_refused_total")?
    );
    anyhow::ensure!(published >= 1.0, "no update was published");
    // Measured (one run, the MLP's adapters alone): passage 61.71 → 11.02, held-out of eight
    // kinds 28.47 → 27.06 (−5.0%), the margin −0.357 → −0.191 (every adapter: 9.86, −5.7%,
    // −0.242; before rehearsal: 12.67, −0.257).
    anyhow::ensure!(
        t1 < 0.6 * t0,
        "the passage was not learnt: {t0:.2} → {t1:.2}"
    );
    anyhow::ensure!(h1 < 1.03 * h0, "held-out text suffered: {h0:.2} → {h1:.2}");
    anyhow::ensure!(
        m1 > m0 + 0.02,
        "the fact gained nothing on a distractor: {m0:+.4} → {m1:+.4}"
    );
    up.stop("TERM")?;
    Ok(())
}
