//! Shared helpers for the end-to-end tests: the real model, loaded once per test binary.

pub mod adversary;
pub mod lab;
pub mod procs;
pub mod scale;
pub mod sim;
pub mod spread;
pub mod world;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use node_core::code::Generator;
use node_core::coded::{CodedGroup, InProcess, ShardFormat};
use node_core::model::{LeaderWeights, Llama, ModelWeights};
use node_native::load::{LoadedModel, load_model};

/// The model the tests run: `$CODEDMESH_MODEL`, else the default model (fetched if needed).
pub fn model_path() -> Result<PathBuf> {
    match std::env::var_os("CODEDMESH_MODEL") {
        Some(p) => Ok(PathBuf::from(p)),
        None => node_native::fetch::default_model(),
    }
}

/// Loads the real model.
pub fn real_model() -> Result<LoadedModel> {
    let path = model_path()?;
    load_model(&path).with_context(|| format!("loading {}", path.display()))
}

/// A JSON array of token ids.
pub fn json_ids(v: &serde_json::Value) -> Result<Vec<u32>> {
    v.as_array()
        .context("expected an array of ids")?
        .iter()
        .map(|x| x.as_u64().map(|x| x as u32).context("expected an id"))
        .collect()
}

/// A file of little-endian f32 values.
pub fn read_f32(path: &Path) -> Result<Vec<f32>> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(bytes
        .as_chunks::<4>()
        .0
        .iter()
        .map(|b| f32::from_le_bytes(*b))
        .collect())
}

/// The directory of committed test data.
pub fn testdata() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata")
}

/// The leader of a model.
pub fn leader(weights: &ModelWeights) -> Result<Llama> {
    Ok(Llama::new(
        weights.cfg.clone(),
        LeaderWeights::from_model(weights),
    )?)
}

/// An uncoded single-member group (k = n = 1).
pub fn uncoded_group(weights: &ModelWeights) -> Result<CodedGroup<InProcess>> {
    let g = Generator::uncoded();
    let mesh = InProcess::encode(weights, &g, ShardFormat::F32, &|_, _| {})?;
    Ok(CodedGroup::new(weights.cfg.clone(), g, &[0], mesh)?)
}

pub use node_core::model::{logits_along, relative_error};

/// Index of the largest value.
pub fn argmax(v: &[f32]) -> u32 {
    node_core::model::argmax(v)
}
