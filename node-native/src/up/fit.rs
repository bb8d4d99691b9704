//! Whether a local mesh of a model fits this machine's memory, estimated before `up` encodes
//! it, and what would fit when it does not.

use std::io::Read;
use std::path::Path;

use anyhow::{Context, Result, bail};
use node_core::coded::ShardFormat;
use node_core::gguf::{GgufError, GgufFile};

/// Memory a node needs beyond its row: runtime, buffers, the leader's KV caches of short
/// requests (issue 58's bound: 1.25 × the row + KV + 300 MB).
const NODE_OVERHEAD: f64 = 300e6;

/// What a local mesh of a model needs, in bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Needs {
    /// To encode it: the file, the whole model in f32 and every row at once.
    pub encode: f64,
    /// To serve it: every node's row, a quarter more, and its overhead.
    pub serve: f64,
}

impl Needs {
    /// The larger of the two.
    pub fn peak(&self) -> f64 {
        self.encode.max(self.serve)
    }
}

/// A model's size: its file's bytes and the values of its tensors.
#[derive(Debug, Clone, Copy)]
pub struct ModelSize {
    /// Bytes of the file.
    pub file: f64,
    /// Values of all its tensors.
    pub values: f64,
}

impl ModelSize {
    /// Reads a GGUF file's tensor table (its first bytes, not its tensors); `None` for a
    /// Hugging Face directory (not estimated).
    pub fn of(model: &Path) -> Result<Option<Self>> {
        if model.is_dir() {
            return Ok(None);
        }
        let reading = || format!("reading {}", model.display());
        let mut f = std::fs::File::open(model).with_context(reading)?;
        let file_len = f.metadata().with_context(reading)?.len();
        // The header, metadata and tensor directory: a few MB even with a 128k vocabulary.
        let mut head = Vec::new();
        f.by_ref()
            .take(HEAD_BYTES)
            .read_to_end(&mut head)
            .with_context(reading)?;
        let file = match GgufFile::parse_header(&head, file_len) {
            Err(GgufError::Truncated { .. }) if file_len > HEAD_BYTES => {
                f.read_to_end(&mut head).with_context(reading)?;
                GgufFile::parse(&head)
            }
            parsed => parsed,
        }
        .with_context(|| format!("parsing {}", model.display()))?;
        let values: usize = file
            .tensors()
            .iter()
            .map(|t| t.shape.iter().product::<usize>())
            .sum();
        Ok(Some(Self {
            file: file_len as f64,
            values: values as f64,
        }))
    }
}

/// Bytes read for a GGUF file's directory before reading it all.
const HEAD_BYTES: u64 = 64 << 20;

/// Bytes of each of the n rows of a k-of-n code of `values` values: q8's data rows (the first
/// k) one byte a value and its parity rows two; f16 two; f32 four.
fn rows(values: f64, k: usize, n: usize, format: ShardFormat) -> Vec<f64> {
    let per = values / k as f64;
    (0..n)
        .map(|row| match format {
            ShardFormat::Q8 if row < k => per,
            ShardFormat::Q8 | ShardFormat::F16 => 2.0 * per,
            ShardFormat::F32 => 4.0 * per,
        })
        .collect()
}

/// What a mesh of k of n rows in `format` needs on one machine.
pub fn needs(size: ModelSize, k: usize, n: usize, format: ShardFormat) -> Needs {
    let rows = rows(size.values, k, n, format);
    let all: f64 = rows.iter().sum();
    let f32_model = 4.0 * size.values;
    Needs {
        encode: f32_model + size.file.max(all),
        serve: rows.iter().map(|r| 1.25 * r + NODE_OVERHEAD).sum(),
    }
}

/// Memory this machine can give: `$CODEDMESH_MEMORY` (bytes) when set, else Linux's
/// `MemAvailable`; `None` where neither says.
pub fn available() -> Option<f64> {
    if let Some(v) = std::env::var("CODEDMESH_MEMORY")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
    {
        return Some(v);
    }
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024.0)
}

fn gb(bytes: f64) -> String {
    format!("{:.1} GB", bytes / 1e9)
}

/// Refuses a mesh that would not fit `available` bytes, saying what it needs and what would
/// fit; `encoding` when the rows are still to be made.
pub fn check(
    size: ModelSize,
    k: usize,
    n: usize,
    format: ShardFormat,
    encoding: bool,
    available: f64,
) -> Result<()> {
    let need = needs(size, k, n, format);
    let peak = if encoding { need.peak() } else { need.serve };
    if peak <= available {
        return Ok(());
    }
    // The same model with more rows needed and one spare: smaller rows each.
    let fits = |k: usize, n: usize, format: ShardFormat| {
        let need = needs(size, k, n, format);
        (if encoding { need.peak() } else { need.serve }) <= available
    };
    let suggestion = (k..=8)
        .flat_map(|k| [(k, k + 1, ShardFormat::Q8), (k, k + 1, ShardFormat::F32)])
        .find(|&(k, n, f)| fits(k, n, f));
    let what = match suggestion {
        Some((k, n, f)) => format!(
            "--k {k} --nodes {n} --shard-format {} would fit",
            format!("{f:?}").to_lowercase()
        ),
        None if encoding && need.encode > available => format!(
            "encoding alone needs {} (the model in f32 is {}), so no mesh of this model can be \
             encoded here: encode it on a machine with more memory (`codedmesh seed`) and start \
             nodes here that join it (`codedmesh node`)",
            gb(need.encode),
            gb(4.0 * size.values)
        ),
        None => "no mesh of up to k = 8 on this one machine fits: spread it over machines \
                 (`codedmesh node --join`)"
            .to_string(),
    };
    bail!(
        "a mesh of k = {k} of {n} {} rows of this model ({:.2} B values) needs about {} here \
         ({} to encode it, {} to serve it from {n} nodes); this machine has {} available: {what}",
        format!("{format:?}").to_lowercase(),
        size.values / 1e9,
        gb(peak),
        gb(need.encode),
        gb(need.serve),
        gb(available),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Llama-3.2-1B's Q4_K_M file: 1.24 B values in 0.81 GB.
    const ONE_B: ModelSize = ModelSize {
        file: 0.81e9,
        values: 1.236e9,
    };

    #[test]
    fn a_1b_q8_mesh_needs_its_rows_and_the_model_in_f32_to_encode() {
        let need = needs(ONE_B, 2, 4, ShardFormat::Q8);
        // Rows: two of 618 MB, two of 1236 MB.
        let rows = 2.0 * 0.618e9 + 2.0 * 1.236e9;
        assert!((need.serve - (1.25 * rows + 4.0 * NODE_OVERHEAD)).abs() < 1e6);
        assert!((need.encode - (4.0 * 1.236e9 + rows)).abs() < 1e6);
        assert!(check(ONE_B, 2, 4, ShardFormat::Q8, true, 24e9).is_ok());
    }

    #[test]
    fn a_mesh_that_does_not_fit_is_refused_with_one_that_does() {
        // 10 GB: encoding needs 4.9 + 3.7 GB, serving 2 × (0.77 + 1.55) + 1.2 = 5.8 GB: fits.
        assert!(check(ONE_B, 2, 4, ShardFormat::Q8, true, 10e9).is_ok());
        // 8 GB: k = 2 of 4 does not (8.7 GB to encode); 2 of 3 does (7.4 GB).
        let err = check(ONE_B, 2, 4, ShardFormat::Q8, true, 8e9)
            .unwrap_err()
            .to_string();
        assert!(err.contains("--k 2 --nodes 3 --shard-format q8"), "{err}");
        // An 8B model cannot be encoded on 24 GB at all: the f32 model alone is 32 GB.
        let eight_b = ModelSize {
            file: 4.9e9,
            values: 8.03e9,
        };
        let err = check(eight_b, 4, 5, ShardFormat::Q8, true, 24e9)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("no mesh of this model can be encoded here"),
            "{err}"
        );
        // Already encoded, it is only served: k = 4 of 5 fits in 24 GB.
        assert!(check(eight_b, 4, 5, ShardFormat::Q8, false, 24e9).is_ok());
    }
}
