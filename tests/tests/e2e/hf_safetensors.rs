//! Loading a Hugging Face Llama checkpoint (safetensors + config.json + tokenizer.json): a tiny
//! random model whose logits were computed by the numpy reference in HF's RoPE layout.

use anyhow::{Context, Result};
use node_native::load::load_model;
use serde_json::Value;
use tests::{leader, relative_error, testdata, uncoded_group};

#[test]
fn tiny_hf_llama_matches_the_reference() -> Result<()> {
    let _machine = crate::machine::share();
    let dir = testdata().join("tiny-llama-hf");
    let model = load_model(&dir)?;
    let reference: Value = serde_json::from_slice(&std::fs::read(dir.join("reference.json"))?)?;
    let llama = leader(&model.weights)?;
    let mut exec = uncoded_group(&model.weights)?;
    let prompts = reference["prompts"].as_array().context("prompts")?;
    assert!(!prompts.is_empty());
    for p in prompts {
        let text = p["text"].as_str().context("text")?;
        let ids = model.tokenizer.encode(text)?;
        let want: Vec<u32> = serde_json::from_value(p["token_ids"].clone())?;
        assert_eq!(ids, want, "token ids of {text:?}");
        let logits_ref: Vec<f32> = serde_json::from_value(p["logits"].clone())?;
        let mut cache = node_core::model::KvCache::new(llama.config());
        let logits = pollster::block_on(llama.forward(&mut exec, &ids, &mut cache))?;
        let err = relative_error(&logits, &logits_ref);
        eprintln!("{text:?}: relative logit error {err:.3e}");
        // f32 forward vs float64 reference on a 2-layer model: rounding is ~1e-6.
        assert!(err < 1e-4, "{text:?}: relative logit error {err:.3e}");
    }
    Ok(())
}
