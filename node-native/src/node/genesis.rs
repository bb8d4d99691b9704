//! Genesis: `codedmesh seed` encodes a model into the mesh's first rows.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Result, anyhow, ensure};
use node_core::code::Generator;
use node_core::coded::{InProcess, ShardFormat};
use node_core::mesh::{LearningConfig, ModelManifest};
use node_core::model::LeaderWeights;

use super::{Holding, NodeOptions, node, open_device, serve};
use crate::hold::store::{DataDir, shard_from_blob, shard_to_blob};
use crate::{load, progress};

/// `codedmesh seed`: encodes a model into n rows, keeps row 0 and hands the others out.
pub async fn seed(
    opts: NodeOptions,
    model: PathBuf,
    k: usize,
    n: usize,
    max_rows: Option<usize>,
    format: ShardFormat,
    learning: LearningConfig,
) -> Result<()> {
    learning.validate()?;
    let data = DataDir::open(&opts.data)?;
    if data.shard()?.is_some() {
        eprintln!(
            "{} already holds a shard: restarting it as a node",
            data.path().display()
        );
        return node(opts).await;
    }
    let gpu = open_device(opts.device).await?;
    ensure!(k >= 1 && n >= k, "need 1 ≤ k ≤ n, got k = {k}, n = {n}");
    let started = std::time::Instant::now();
    let (manifest, blobs) = tokio::task::spawn_blocking(move || {
        encode_genesis(&model, k, n, max_rows, format, learning)
    })
    .await
    .map_err(|e| anyhow!("encoding task: {e}"))??;
    let manifest_bytes = manifest.to_bytes()?;
    data.save_manifest(&manifest_bytes)?;
    let mut blobs = blobs;
    let own = blobs
        .remove(&0)
        .ok_or_else(|| anyhow!("row 0 was not encoded"))?;
    data.save_shard_blob(&own)?;
    eprintln!(
        "genesis: {} encoded into n = {n} rows (k = {k}) in {:.1} s; this node keeps row 0, {} rows to hand out; the mesh may grow to {} rows, then adds replicas",
        manifest.name,
        started.elapsed().as_secs_f64(),
        blobs.len(),
        manifest.generator.n()
    );
    let shard = shard_from_blob(&own)?;
    let genesis = blobs.into_iter().map(|(r, b)| (r, Arc::new(b))).collect();
    let holding = Holding {
        manifest,
        manifest_bytes,
        shard,
        genesis,
    };
    serve(opts, data, holding, gpu).await
}

/// Loads a model and encodes every row's shard blob (with the verification threshold measured
/// on them).
pub(crate) fn encode_genesis(
    model: &std::path::Path,
    k: usize,
    n: usize,
    max_rows: Option<usize>,
    format: ShardFormat,
    learning: LearningConfig,
) -> Result<(ModelManifest, BTreeMap<u32, Vec<u8>>)> {
    ensure!(
        format != ShardFormat::F16 || !learning.enabled,
        "f16 shards do not learn: an f16 mesh needs --no-learning (f32 and q8 shards learn)"
    );
    let loaded = load::load_model(model)?;
    // Compact shards need the integer code, whose coefficients keep them exact i8 values.
    let generator = match format {
        ShardFormat::Q8 => Generator::integer(n, k, max_rows)?,
        _ => Generator::growing(n, k, max_rows)?,
    };
    let mut manifest = ModelManifest {
        name: model.file_name().map_or_else(
            || model.display().to_string(),
            |f| f.to_string_lossy().into_owned(),
        ),
        cfg: loaded.weights.cfg.clone(),
        leader: LeaderWeights::from_model(&loaded.weights),
        tokenizer: loaded.tokenizer.to_data()?,
        generator: generator.clone(),
        format,
        learning,
        verify_noise: node_core::coded::DEFAULT_NOISE,
    };
    let pb = progress::bar(0, "encoding");
    let mesh = InProcess::encode(&loaded.weights, &generator, format, &|done, total| {
        pb.set_length(total as u64);
        pb.set_position(done as u64);
    })?;
    pb.finish_and_clear();
    drop(loaded);
    // The verification threshold: honest f32 noise of this model and code, measured on every
    // row while they are all here.
    let started = std::time::Instant::now();
    let requests = 24;
    let (noise, mesh) = node_core::coded::measure_noise(
        &manifest.cfg,
        &manifest.leader,
        &generator,
        mesh,
        requests,
    )?;
    if noise > 0.0 {
        manifest.verify_noise = (node_core::coded::NOISE_MARGIN * noise).min(0.5);
    }
    eprintln!(
        "verification threshold {:.2e} × condition number (honest residual up to {noise:.2e} × κ over {requests} requests, {:.1} s)",
        manifest.verify_noise,
        started.elapsed().as_secs_f64()
    );
    let mut blobs = BTreeMap::new();
    for m in mesh.members() {
        blobs.insert(m.shards().node as u32, shard_to_blob(m.shards())?);
    }
    Ok((manifest, blobs))
}
