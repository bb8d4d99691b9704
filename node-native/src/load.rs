//! Loads a model from disk: a GGUF file, or a Hugging Face directory
//! (`config.json`, `model.safetensors`, `tokenizer.json`).

use std::path::Path;

use anyhow::{Context, Result};
use node_core::gguf::GgufFile;
use node_core::model::{ModelWeights, Tokenizer};

/// A model's weights and tokenizer.
#[derive(Debug)]
pub struct LoadedModel {
    /// Uncoded f32 weights.
    pub weights: ModelWeights,
    /// The tokenizer.
    pub tokenizer: Tokenizer,
}

/// Loads the model at `path` (a `.gguf` file or a Hugging Face directory).
pub fn load_model(path: &Path) -> Result<LoadedModel> {
    if path.is_dir() {
        let read = |name: &str| {
            let p = path.join(name);
            std::fs::read(&p).with_context(|| format!("reading {}", p.display()))
        };
        let config = String::from_utf8(read("config.json")?).context("config.json is not UTF-8")?;
        let weights = ModelWeights::from_safetensors(&config, &read("model.safetensors")?)
            .with_context(|| format!("loading {}", path.display()))?;
        let tokenizer = Tokenizer::from_hf_json(&read("tokenizer.json")?)?;
        return Ok(LoadedModel { weights, tokenizer });
    }
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let file = GgufFile::parse(&bytes).with_context(|| format!("parsing {}", path.display()))?;
    let weights = ModelWeights::from_gguf(&file, &bytes)
        .with_context(|| format!("loading {}", path.display()))?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    Ok(LoadedModel { weights, tokenizer })
}
