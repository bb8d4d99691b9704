//! Genesis: `codedmesh seed` encodes a model into the mesh's first rows.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, anyhow, ensure};
use node_core::blob::{self, BlobParams};
use node_core::code::Generator;
use node_core::coded::stream::{StreamLimits, calibration_model, encode_rows};
use node_core::coded::{InProcess, ShardFormat};
use node_core::mesh::{LearningConfig, ModelManifest};
use node_core::model::{GgufModel, LeaderWeights, LlamaConfig, MatrixSource, Tokenizer};

use super::fit;
use super::{Holding, NodeOptions, node, open_device, serve};
use crate::hold::store::{DataDir, shard_to_blob};
use crate::{load, progress};

/// `codedmesh seed`: encodes a model into n rows, keeps row 0 and hands the others out.
pub async fn seed(
    opts: NodeOptions,
    model: PathBuf,
    shape: Shape,
    learning: LearningConfig,
    gate: bool,
) -> Result<()> {
    let Shape { k, n, .. } = shape;
    learning.validate()?;
    let data = DataDir::open(&opts.data)?;
    if data.shard_path().exists() {
        eprintln!(
            "{} already holds a shard: restarting it as a node",
            data.path().display()
        );
        return node(opts).await;
    }
    let gpu = open_device(opts.device).await?;
    ensure!(k >= 1 && n >= k, "need 1 ≤ k ≤ n, got k = {k}, n = {n}");
    let started = std::time::Instant::now();
    let dir = data.path().join("genesis");
    let rows_dir = dir.clone();
    // The mesh's key: it admits who may write the model, this node first.
    let mesh_key = crate::hold::trust::key_file(&data.mesh_key_path())?;
    let trust = Trust {
        mesh: node_core::learn::MeshKey::of(&mesh_key),
        gate,
    };
    let (manifest, mut blobs) = tokio::task::spawn_blocking(move || {
        encode_genesis(&model, shape, learning, &trust, &rows_dir)
    })
    .await
    .map_err(|e| anyhow!("encoding task: {e}"))??;
    let manifest_bytes = manifest.to_bytes()?;
    data.save_manifest(&manifest_bytes)?;
    let me = data.identity()?.public().to_peer_id();
    let powers = [
        node_core::learn::Power::Write,
        node_core::learn::Power::Report,
    ];
    let cert = crate::hold::trust::admit(
        &mesh_key,
        me,
        "seed",
        crate::hold::trust::DEFAULT_VALIDITY,
        &powers,
    )?;
    data.save_cert(&cert)?;
    eprintln!(
        "the mesh's key is {} (keep it: `codedmesh admit --mesh-key {}` admits trainers with it)",
        data.mesh_key_path().display(),
        data.mesh_key_path().display()
    );
    let own = blobs
        .remove(&0)
        .ok_or_else(|| anyhow!("row 0 was not encoded"))?;
    data.adopt_shard_file(&own)?;
    eprintln!(
        "genesis: {} encoded into n = {n} rows (k = {k}) in {:.1} s; this node keeps row 0, {} rows to hand out; the mesh may grow to {} rows, then adds replicas",
        manifest.name,
        started.elapsed().as_secs_f64(),
        blobs.len(),
        manifest.generator.n()
    );
    let shard = data
        .shard()?
        .ok_or_else(|| anyhow!("row 0 was not saved"))?;
    // The rows to hand out are served from memory until nodes have taken them.
    let mut genesis = BTreeMap::new();
    for (r, path) in blobs {
        let bytes = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        genesis.insert(r, Arc::new(bytes));
    }
    std::fs::remove_dir_all(&dir).with_context(|| format!("removing {}", dir.display()))?;
    let holding = Holding {
        manifest,
        manifest_bytes,
        shard,
        genesis,
    };
    serve(opts, data, holding, gpu).await
}

/// Encodes every genesis row of a model into a blob file in `dir` (`row-R.blob`), with the
/// verification threshold measured on them: a small model whole, in memory; a larger one a
/// matrix at a time, read from its file a few rows at a time, so that encoding takes no more
/// memory than its file's size and a gigabyte ([`fit::ENCODE_ALLOWANCE`]).
pub(crate) fn encode_genesis(
    model: &Path,
    shape: Shape,
    learning: LearningConfig,
    trust: &Trust,
    dir: &Path,
) -> Result<(ModelManifest, BTreeMap<u32, PathBuf>)> {
    let Shape {
        k,
        n,
        max_rows,
        format,
    } = shape;
    ensure!(
        format != ShardFormat::F16 || !learning.enabled,
        "f16 shards do not learn: an f16 mesh needs --no-learning (f32 and q8 shards learn)"
    );
    // Compact shards need the integer code, whose coefficients keep them exact i8 values.
    let generator = match format {
        ShardFormat::Q8 => Generator::integer(n, k, max_rows)?,
        _ => Generator::growing(n, k, max_rows)?,
    };
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let name = model.file_name().map_or_else(
        || model.display().to_string(),
        |f| f.to_string_lossy().into_owned(),
    );
    // A GGUF's directory, read once: whether it fits encoded whole, and what to stream if not.
    let gguf = if model.is_dir() {
        None
    } else {
        Some(load::open_gguf(model)?)
    }
    .filter(|g| !fit::encodes_whole(fit::ModelSize::of_gguf(g), k, n, format));
    if let Some(gguf) = gguf {
        let src = GgufModel::open(&gguf.file, &gguf.data)
            .with_context(|| format!("loading {}", model.display()))?;
        let manifest = ModelManifest {
            name,
            cfg: src.cfg().clone(),
            leader: src.leader()?,
            tokenizer: Tokenizer::from_gguf(&gguf.file)?.to_data()?,
            generator,
            format,
            learning,
            verify_noise: node_core::coded::DEFAULT_NOISE,
            mesh_key: trust.mesh.to_bytes(),
            canary_loss: None,
        };
        if learning.enabled && trust.gate {
            eprintln!(
                "a model encoded a matrix at a time gets no canary reference at genesis: its trainers' gates count drift from their own first measurement, and holders take updates without a verdict"
            );
        }
        return encode_streamed(&src, manifest, dir);
    }
    let loaded = load::load_model(model)?;
    let mut manifest = ModelManifest {
        name,
        cfg: loaded.weights.cfg.clone(),
        leader: LeaderWeights::from_model(&loaded.weights),
        tokenizer: loaded.tokenizer.to_data()?,
        generator: generator.clone(),
        format,
        learning,
        verify_noise: node_core::coded::DEFAULT_NOISE,
        mesh_key: trust.mesh.to_bytes(),
        canary_loss: None,
    };
    let pb = progress::bar(0, "encoding");
    let mesh = InProcess::encode(&loaded.weights, &generator, format, &|done, total| {
        pb.set_length(total as u64);
        pb.set_position(done as u64);
    })?;
    pb.finish_and_clear();
    // The weights go; the tokenizer cuts the canary text.
    let tokenizer = loaded.tokenizer.clone();
    drop(loaded);
    // Measured on every row while they are all here.
    let (threshold, mesh) = measure_threshold(&generator, &manifest.cfg, &manifest.leader, mesh)?;
    manifest.verify_noise = threshold;
    let mesh = if learning.enabled && trust.gate {
        let (loss, mesh) = canary_reference(&manifest, &tokenizer, mesh)?;
        manifest.canary_loss = Some(loss);
        mesh
    } else {
        mesh
    };
    let mut blobs = BTreeMap::new();
    for m in mesh.members() {
        let row = m.shards().node as u32;
        let path = dir.join(format!("row-{row}.blob"));
        std::fs::write(&path, shard_to_blob(m.shards())?)
            .with_context(|| format!("writing {}", path.display()))?;
        blobs.insert(row, path);
    }
    Ok((manifest, blobs))
}

/// The code a new mesh is encoded on: k of n genesis rows, the most it may grow to, and how
/// its shards are stored.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// Rows needed to compute.
    pub k: usize,
    /// Rows encoded at genesis.
    pub n: usize,
    /// Most rows the mesh may grow to (`None`: the code's own limit).
    pub max_rows: Option<usize>,
    /// How shards are stored.
    pub format: ShardFormat,
}

/// Who may write a new mesh's model: its key, and whether its trainers run a canary gate whose
/// reference loss genesis measures.
#[derive(Debug, Clone)]
pub struct Trust {
    /// The mesh's key (public half).
    pub mesh: node_core::learn::MeshKey,
    /// Whether the mesh runs a canary gate.
    pub gate: bool,
}

/// The canary text's loss on the encoded model through its first k rows (what the mesh
/// serves, the compact grid's rounding included): the reference every gate counts drift from.
fn canary_reference(
    manifest: &ModelManifest,
    tokenizer: &Tokenizer,
    mesh: InProcess,
) -> Result<(f64, InProcess)> {
    let g = &manifest.generator;
    let rows: Vec<usize> = (0..g.k()).collect();
    let mut group =
        node_core::coded::CodedGroup::new(manifest.cfg.clone(), g.clone(), &rows, mesh)?;
    let llama = node_core::model::Llama::new(manifest.cfg.clone(), manifest.leader.clone())?;
    let loss = futures::executor::block_on(node_core::learn::canary_reference(
        &llama, &mut group, tokenizer,
    ))?;
    eprintln!(
        "canary reference loss {loss:.4} nats a token (every trainer's gate counts drift from it)"
    );
    Ok((loss, group.into_transport()))
}

/// The verification threshold: the honest f32 noise of a model of shape `cfg` and gains
/// `leader` under the code `g`, measured on `mesh` (its rows), with a margin; the mesh back.
fn measure_threshold(
    g: &Generator,
    cfg: &LlamaConfig,
    leader: &LeaderWeights,
    mesh: InProcess,
) -> Result<(f64, InProcess)> {
    let started = std::time::Instant::now();
    let requests = 24;
    let (noise, mesh) = node_core::coded::measure_noise(cfg, leader, g, mesh, requests)?;
    let threshold = if noise > 0.0 {
        (node_core::coded::NOISE_MARGIN * noise).min(0.5)
    } else {
        node_core::coded::DEFAULT_NOISE
    };
    eprintln!(
        "verification threshold {threshold:.2e} × condition number (honest residual up to {noise:.2e} × κ over {requests} requests, {:.1} s)",
        started.elapsed().as_secs_f64()
    );
    Ok((threshold, mesh))
}

/// Blocks and vocabulary rows of the model that stands for a model too large to encode whole
/// when genesis measures the verification threshold.
const CALIBRATION_LAYERS: usize = 1;
const CALIBRATION_VOCAB: usize = 4096;

/// Encodes `src`'s rows a matrix at a time into `dir`: each row's shard set is written to a
/// payload file as its matrices are encoded, then made a blob a group of chunks at a time.
fn encode_streamed(
    src: &GgufModel<'_>,
    mut manifest: ModelManifest,
    dir: &Path,
) -> Result<(ModelManifest, BTreeMap<u32, PathBuf>)> {
    // The threshold, on a model of the first block and vocabulary rows (every row of it fits).
    let (small, gains) =
        calibration_model(src, &manifest.leader, CALIBRATION_LAYERS, CALIBRATION_VOCAB)?;
    let mesh = InProcess::encode(&small, &manifest.generator, manifest.format, &|_, _| {})?;
    manifest.verify_noise = measure_threshold(&manifest.generator, &small.cfg, &gains, mesh)?.0;
    drop(small);
    let rows = manifest.generator.genesis_rows();
    let payload = |r: usize| dir.join(format!("row-{r}.payload"));
    let create = |p: &Path| {
        std::fs::File::create(p)
            .map(|f| std::io::BufWriter::with_capacity(1 << 20, f))
            .with_context(|| format!("creating {}", p.display()))
    };
    let mut sinks = (0..rows)
        .map(|r| create(&payload(r)))
        .collect::<Result<Vec<_>>>()?;
    let pb = progress::bar(0, "encoding");
    encode_rows(
        src,
        &manifest.generator,
        manifest.format,
        &mut sinks,
        StreamLimits::default(),
        &mut |done, total| {
            pb.set_length(total as u64);
            pb.set_position(done as u64);
        },
    )?;
    pb.finish_and_clear();
    for sink in sinks {
        sink.into_inner()
            .map_err(|e| anyhow!("writing a row: {e}"))?
            .sync_all()?;
    }
    let mut blobs = BTreeMap::new();
    let pb = progress::bar(rows as u64, "sealing rows");
    for r in 0..rows {
        let (from, to) = (payload(r), dir.join(format!("row-{r}.blob")));
        let len = std::fs::metadata(&from)?.len();
        let mut reader = std::io::BufReader::with_capacity(
            1 << 20,
            std::fs::File::open(&from).with_context(|| format!("opening {}", from.display()))?,
        );
        let mut out = create(&to)?;
        blob::encode_blob_to(&mut reader, len, &BlobParams::default(), &mut out)
            .with_context(|| format!("writing {}", to.display()))?;
        out.into_inner()
            .map_err(|e| anyhow!("writing {}: {e}", to.display()))?
            .sync_all()?;
        std::fs::remove_file(&from).with_context(|| format!("removing {}", from.display()))?;
        blobs.insert(r as u32, to);
        pb.inc(1);
    }
    pb.finish_and_clear();
    Ok((manifest, blobs))
}
