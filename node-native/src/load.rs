//! Loads a model from disk: a GGUF file, or a Hugging Face directory
//! (`config.json`, `model.safetensors`, `tokenizer.json`).

use std::path::Path;

use anyhow::{Context, Result};
use node_core::gguf::GgufFile;
use node_core::model::{ModelWeights, SamplingDefaults, Tokenizer};

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
        let mut tokenizer = Tokenizer::from_hf_json(&read("tokenizer.json")?)?;
        // The publisher's sampling, where the directory has it.
        if path.join("generation_config.json").is_file() {
            let json = String::from_utf8(read("generation_config.json")?)
                .context("generation_config.json is not UTF-8")?;
            tokenizer = tokenizer.with_sampling(SamplingDefaults::from_generation_config(&json)?);
        }
        return Ok(LoadedModel { weights, tokenizer });
    }
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let file = GgufFile::parse(&bytes).with_context(|| format!("parsing {}", path.display()))?;
    let weights = ModelWeights::from_gguf(&file, &bytes)
        .with_context(|| format!("loading {}", path.display()))?;
    let tokenizer = Tokenizer::from_gguf(&file)?;
    Ok(LoadedModel { weights, tokenizer })
}

/// A GGUF file opened for reading a tensor at a time: its parsed directory and the file.
#[derive(Debug)]
pub struct GgufOnDisk {
    /// The header, metadata and tensor directory.
    pub file: GgufFile,
    /// The open file, read at offsets.
    pub data: FileAt,
    /// Bytes of the file.
    pub len: u64,
}

/// A file read at offsets (`pread`), from any thread.
#[derive(Debug)]
pub struct FileAt(std::fs::File);

impl node_core::model::ReadAt for FileAt {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        std::os::unix::fs::FileExt::read_exact_at(&self.0, buf, offset)
    }
}

/// Bytes read for a GGUF file's directory before reading it all.
const HEAD_BYTES: u64 = 64 << 20;

/// Opens a GGUF file and reads its directory (its first bytes, not its tensors).
pub fn open_gguf(path: &Path) -> Result<GgufOnDisk> {
    use std::io::Read;
    let reading = || format!("reading {}", path.display());
    let mut f = std::fs::File::open(path).with_context(reading)?;
    let len = f.metadata().with_context(reading)?.len();
    // The header, metadata and tensor directory: a few MB even with a 128k vocabulary.
    let mut head = Vec::new();
    f.by_ref()
        .take(HEAD_BYTES)
        .read_to_end(&mut head)
        .with_context(reading)?;
    let file = match GgufFile::parse_header(&head, len) {
        Err(node_core::gguf::GgufError::Truncated { .. }) if len > HEAD_BYTES => {
            f.read_to_end(&mut head).with_context(reading)?;
            GgufFile::parse(&head)
        }
        parsed => parsed,
    }
    .with_context(|| format!("parsing {}", path.display()))?;
    Ok(GgufOnDisk {
        file,
        data: FileAt(f),
        len,
    })
}
