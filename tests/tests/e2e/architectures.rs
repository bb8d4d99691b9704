//! Every supported architecture against llama.cpp. scripts/arch_files.py writes small GGUF
//! files of each (Llama 3 with RoPE factors, Mistral, Qwen2, Qwen3) with seeded random weights
//! through the `gguf` package, quantises them with llama.cpp's own quantiser, and records
//! llama.cpp's greedy tokens and logits on them. Here each file is loaded as `up --model` loads
//! it, coded into shards and run through a group of k = 2 of n = 3 members that are not the
//! systematic ones: the greedy tokens must be llama.cpp's, 32 of 32, and every logit within the
//! tolerance stated below.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, ensure};
use node_core::code::Generator;
use node_core::coded::{CodedGroup, InProcess, ShardFormat};
use node_core::model::{Family, KvCache, LeaderWeights, Llama};
use serde_json::Value;
use tests::procs::Scratch;
use tests::{argmax, json_ids, read_f32};

/// Largest logit difference, relative to the root mean square of the position's logits, that an
/// f32 file may show: llama.cpp and this model compute the same f32 products in other orders
/// (measured: under 1e-6). Leaving out Llama 3's RoPE factors moves them by 3 (scripts/arch_files.py
/// makes them count within the positions compared).
const F32_TOLERANCE: f32 = 1e-4;
/// The same for quantised files: llama.cpp rounds the activations to 8 bits before each
/// quantised product (Q8_0 and Q8_K), this model multiplies them in f32 (measured: up to 0.1).
const QUANTISED_TOLERANCE: f32 = 0.2;

/// The Python of scripts/llama-cpp-env.sh: `$CODEDMESH_LLAMA_PYTHON` (the test command sets
/// it), else none.
pub(crate) fn llama_python() -> Option<PathBuf> {
    let p = PathBuf::from(std::env::var_os("CODEDMESH_LLAMA_PYTHON")?);
    Command::new(&p)
        .args(["-c", "import llama_cpp, gguf"])
        .status()
        .is_ok_and(|s| s.success())
        .then_some(p)
}

/// What one file gave: its worst logit difference and the greedy tokens that matched.
struct Outcome {
    worst: f32,
    matched: usize,
}

/// Runs llama.cpp's prompt and greedy tokens through the coded model of `path`, comparing
/// each position's logits with llama.cpp's (`reference`, one row of `vocab` per position).
fn run_file(
    path: &Path,
    prompt: &[u32],
    greedy: &[u32],
    reference: &[f32],
    text: (&str, &[u32]),
) -> Result<Outcome> {
    let model = node_native::load::load_model(path)?;
    let ids = model.tokenizer.encode(text.0)?;
    ensure!(
        ids == text.1,
        "the file's tokenizer gives {ids:?}, llama.cpp's {:?}",
        text.1
    );
    let back = model.tokenizer.decode(&ids)?;
    ensure!(back == text.0, "the tokens decode to {back:?}");
    let w = &model.weights;
    streams_as_loaded(path, w)?;
    let g = Generator::cauchy(3, 2)?;
    let mesh = InProcess::encode(w, &g, ShardFormat::F32, &|_, _| {})?;
    let mut group = CodedGroup::new(w.cfg.clone(), g, &[1, 2], mesh)?;
    let llama = Llama::new(w.cfg.clone(), LeaderWeights::from_model(w))?;
    let vocab = w.cfg.vocab;
    ensure!(reference.len() == greedy.len() * vocab, "reference logits");
    let mut cache = KvCache::new(&w.cfg);
    let mut logits = pollster::block_on(llama.forward(&mut group, prompt, &mut cache))?;
    let (mut worst, mut matched) = (0.0f32, 0);
    for (i, &expected) in greedy.iter().enumerate() {
        let want = &reference[i * vocab..(i + 1) * vocab];
        let scale = (want.iter().map(|v| v * v).sum::<f32>() / vocab as f32).sqrt();
        let diff = logits
            .iter()
            .zip(want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        worst = worst.max(diff / scale);
        if argmax(&logits) == expected && matched == i {
            matched += 1;
        }
        logits = pollster::block_on(llama.forward(&mut group, &[expected], &mut cache))?;
    }
    Ok(Outcome { worst, matched })
}

/// Genesis of a model too large to encode whole reads the file a few rows at a time
/// (`GgufModel`): its config, leader parameters and compact rows must be byte for byte those of
/// the model loaded whole, including Qwen's query and key rows reordered from the file's
/// half-split layout and quantised rows dequantised a slab at a time.
fn streams_as_loaded(path: &Path, w: &node_core::model::ModelWeights) -> Result<()> {
    use node_core::coded::stream::{StreamLimits, encode_rows};
    use node_core::model::MatrixSource;
    let bytes = std::fs::read(path)?;
    let file = node_core::gguf::GgufFile::parse(&bytes)?;
    let src = node_core::model::GgufModel::open(&file, &bytes)?;
    ensure!(src.cfg() == &w.cfg, "the streamed config differs");
    ensure!(
        src.leader()? == LeaderWeights::from_model(w),
        "the streamed gains differ"
    );
    let g = Generator::integer(4, 2, None)?;
    let mut rows = vec![Vec::new(); 4];
    let small = StreamLimits {
        shard_bytes: 64 << 10,
        slab_values: 5000,
    };
    encode_rows(&src, &g, ShardFormat::Q8, &mut rows, small, &mut |_, _| {})?;
    for (node, row) in rows.iter().enumerate() {
        let whole =
            node_core::coded::ShardSet::encode(w, &g, node, ShardFormat::Q8, &mut |_, _| {})?;
        ensure!(
            row == &postcard::to_allocvec(&whole)?,
            "row {node} streamed differs from the one encoded whole"
        );
    }
    Ok(())
}

#[test]
fn every_architecture_matches_llama_cpp_on_its_own_files() -> Result<()> {
    let _machine = crate::machine::share();
    let Some(python) = llama_python() else {
        tests::procs::skip(
            "the architectures against llama.cpp: no llama.cpp Python (scripts/test.sh builds it, \
             or set CODEDMESH_LLAMA_PYTHON to the python scripts/llama-cpp-env.sh prints)",
        );
        return Ok(());
    };
    let scratch = Scratch::new("architectures");
    let dir = &scratch.0;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/arch_files.py");
    let status = Command::new(&python).arg(&script).arg(dir).status()?;
    ensure!(status.success(), "{} failed", script.display());
    let index: Value = serde_json::from_slice(&std::fs::read(dir.join("index.json"))?)?;
    let prompt = json_ids(&index["prompt"])?;
    let files = index["files"].as_array().context("files")?;
    let mut seen = Vec::new();
    for f in files {
        let name = f["file"].as_str().context("file")?;
        let ty = f["type"].as_str().context("type")?;
        let greedy = json_ids(&f["tokens"])?;
        ensure!(greedy.len() == 32, "llama.cpp's greedy tokens");
        let reference = read_f32(&dir.join(f["logits"].as_str().context("logits")?))?;
        let text_ids = json_ids(&f["text_ids"])?;
        let text = (index["text"].as_str().context("text")?, text_ids.as_slice());
        let out = run_file(&dir.join(name), &prompt, &greedy, &reference, text)
            .with_context(|| format!("running {name}"))?;
        let tolerance = if ty == "F32" {
            F32_TOLERANCE
        } else {
            QUANTISED_TOLERANCE
        };
        eprintln!(
            "{name:22} greedy {}/32 as llama.cpp; worst logit difference {:.2e} of their RMS (tolerance {tolerance:.0e}); llama.cpp's smallest top-2 gap {:.3}",
            out.matched,
            out.worst,
            f["min_gap"].as_f64().unwrap_or(f64::NAN)
        );
        ensure!(
            out.matched == greedy.len(),
            "{name}: greedy tokens differ from llama.cpp's after {} of 32",
            out.matched
        );
        ensure!(
            out.worst <= tolerance,
            "{name}: logits differ from llama.cpp's by {:.2e} of their RMS (tolerance {tolerance:.0e})",
            out.worst
        );
        seen.push((
            f["arch"].as_str().context("arch")?.to_string(),
            ty.to_string(),
        ));
    }
    // Every family, every file type.
    for arch in ["llama", "qwen2", "qwen3"] {
        Family::from_name(arch)?;
        for ty in ["F32", "Q8_0", "Q4_K_M"] {
            ensure!(
                seen.iter().any(|(a, t)| a == arch && t == ty),
                "no {arch} {ty} file was compared"
            );
        }
    }
    Ok(())
}

#[test]
fn an_unsupported_architecture_is_refused_by_name() -> Result<()> {
    // A GGUF whose architecture is not one of ours: a clear error naming what is supported.
    let mut file = Vec::new();
    let kv = |file: &mut Vec<u8>, key: &str, value: &str| {
        file.extend((key.len() as u64).to_le_bytes());
        file.extend(key.as_bytes());
        file.extend(8u32.to_le_bytes()); // string
        file.extend((value.len() as u64).to_le_bytes());
        file.extend(value.as_bytes());
    };
    file.extend(b"GGUF");
    file.extend(3u32.to_le_bytes());
    file.extend(0u64.to_le_bytes()); // tensors
    file.extend(1u64.to_le_bytes()); // metadata
    kv(&mut file, "general.architecture", "gemma3");
    let scratch = Scratch::new("unsupported-arch");
    let path = scratch.0.join("gemma3.gguf");
    std::fs::write(&path, &file)?;
    let err = match node_native::load::load_model(&path) {
        Ok(_) => anyhow::bail!("a gemma3 file loaded"),
        Err(e) => format!("{e:#}"),
    };
    ensure!(
        err.contains("\"gemma3\"") && err.contains("qwen3") && err.contains("llama"),
        "the error names the architecture and what is supported: {err}"
    );
    Ok(())
}

#[test]
fn up_refuses_a_mesh_that_would_not_fit_before_encoding_it() -> Result<()> {
    // The default model's file, with the machine said to have 200 MB: `up` estimates what the
    // mesh needs before it encodes anything, refuses, and writes nothing.
    let _machine = crate::machine::share();
    let model = tests::model_path()?;
    let scratch = Scratch::new("up-fit");
    let data = scratch.0.join("mesh");
    let out = Command::new(tests::procs::bin())
        .args(["up", "--no-build-web", "--port", "0", "--model"])
        .arg(&model)
        .arg("--data")
        .arg(&data)
        .env("CODEDMESH_MEMORY", "200e6")
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(!out.status.success(), "up started in 200 MB: {err}");
    ensure!(
        err.contains("needs about") && err.contains("has 0.2 GB available"),
        "the refusal says what the mesh needs and what is available: {err}"
    );
    ensure!(
        !data.join("mesh.json").exists(),
        "a refused mesh left a mesh file"
    );
    Ok(())
}
