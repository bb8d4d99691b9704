//! Whether a local mesh of a model fits this machine's memory, estimated before `up` encodes
//! it, and what would fit when it does not.

use std::path::Path;

use anyhow::{Result, bail};
use node_core::coded::ShardFormat;

/// Memory a node needs beyond its row: runtime, buffers, the leader's KV caches of short
/// requests (issue 58's bound: 1.25 × the row + KV + 300 MB).
const NODE_OVERHEAD: f64 = 300e6;

/// What a local mesh of a model needs, in bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Needs {
    /// To encode it: the model in f32 and every row when it is small; otherwise one matrix's
    /// rows at a time and the model's first block (to measure the verification threshold).
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
    /// Values of its first block.
    pub block: f64,
}

impl ModelSize {
    /// Reads a GGUF file's tensor table (its first bytes, not its tensors); `None` for a
    /// Hugging Face directory (not estimated).
    pub fn of(model: &Path) -> Result<Option<Self>> {
        if model.is_dir() {
            return Ok(None);
        }
        Ok(Some(Self::of_gguf(&crate::load::open_gguf(model)?)))
    }

    /// The size of a GGUF file whose directory is read.
    pub fn of_gguf(gguf: &crate::load::GgufOnDisk) -> Self {
        let values = |block: bool| -> usize {
            gguf.file
                .tensors()
                .iter()
                .filter(|t| !block || t.name.starts_with("blk.0."))
                .map(|t| t.shape.iter().product::<usize>())
                .sum()
        };
        Self {
            file: gguf.len as f64,
            values: values(false) as f64,
            block: values(true) as f64,
        }
    }
}

/// Bytes of each of the n rows of a k-of-n code of `values` values: q8's data rows (the first
/// k) one byte a value and its parity rows two; q4's (data rows only) at most one (its
/// matrices off a 4-bit grid are q8); f16 two; f32 four.
fn rows(values: f64, k: usize, n: usize, format: ShardFormat) -> Vec<f64> {
    let per = values / k as f64;
    (0..n)
        .map(|row| match format {
            ShardFormat::Q8 | ShardFormat::Q4 if row < k => per,
            ShardFormat::Q8 | ShardFormat::Q4 | ShardFormat::F16 => 2.0 * per,
            ShardFormat::F32 => 4.0 * per,
        })
        .collect()
}

/// Memory encoding a model whole takes: the model in f32 and every row.
fn whole(size: ModelSize, k: usize, n: usize, format: ShardFormat) -> f64 {
    4.0 * size.values + rows(size.values, k, n, format).iter().sum::<f64>()
}

/// Memory genesis may take beyond the model's file (issue 58's bound: the file + 1 GB).
pub const ENCODE_ALLOWANCE: f64 = 1e9;

/// Whether genesis encodes the model whole (fast, and the same as it always did) rather than
/// a matrix at a time: when that stays within the file's size and [`ENCODE_ALLOWANCE`].
pub fn encodes_whole(size: ModelSize, k: usize, n: usize, format: ShardFormat) -> bool {
    whole(size, k, n, format) <= size.file + ENCODE_ALLOWANCE
}

/// Memory a matrix-at-a-time encoding works in: one matrix's shards at a time
/// ([`node_core::coded::stream::StreamLimits`]), its slabs, and the calibration model (the
/// first block in f32 and its rows) that measures the verification threshold.
fn streamed(size: ModelSize, k: usize, n: usize, format: ShardFormat) -> f64 {
    let limits = node_core::coded::stream::StreamLimits::default();
    let shards = (limits.shard_bytes + 4 * limits.slab_values) as f64;
    let calibration = whole(
        ModelSize {
            values: size.block,
            ..size
        },
        k,
        n,
        format,
    );
    shards.max(calibration) + NODE_OVERHEAD
}

/// What a mesh of k of n rows in `format` needs on one machine.
pub fn needs(size: ModelSize, k: usize, n: usize, format: ShardFormat) -> Needs {
    let rows = rows(size.values, k, n, format);
    Needs {
        encode: if encodes_whole(size, k, n, format) {
            whole(size, k, n, format)
        } else {
            streamed(size, k, n, format)
        },
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
            "encoding alone needs {}, so no mesh of this model can be encoded here: encode it \
             on a machine with more memory (`codedmesh seed`) and start nodes here that join it \
             (`codedmesh node`)",
            gb(need.encode),
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

    /// Llama-3.2-1B's Q4_K_M file: 1.24 B values in 0.81 GB, 60.8 M in a block.
    const ONE_B: ModelSize = ModelSize {
        file: 0.81e9,
        values: 1.236e9,
        block: 60.8e6,
    };

    /// Llama-3.1-8B's: 8.03 B values in 4.9 GB, 218 M in a block.
    const EIGHT_B: ModelSize = ModelSize {
        file: 4.9e9,
        values: 8.03e9,
        block: 218.1e6,
    };

    #[test]
    fn a_small_model_is_encoded_whole_and_a_1b_one_a_matrix_at_a_time() {
        // SmolLM2-135M in f16: the whole encoding (0.5 + 0.4 GB) is within the file + 1 GB.
        let small = ModelSize {
            file: 0.27e9,
            values: 0.135e9,
            block: 3.5e6,
        };
        assert!(encodes_whole(small, 2, 4, ShardFormat::Q8));
        assert!(!encodes_whole(ONE_B, 2, 4, ShardFormat::Q8));
        let need = needs(ONE_B, 2, 4, ShardFormat::Q8);
        // Rows: two of 618 MB, two of 1236 MB.
        let rows = 2.0 * 0.618e9 + 2.0 * 1.236e9;
        assert!((need.serve - (1.25 * rows + 4.0 * NODE_OVERHEAD)).abs() < 1e6);
        assert!(need.encode <= ONE_B.file + ENCODE_ALLOWANCE, "{need:?}");
        // 8B: the first block in f32 and its rows measure the threshold, 1.5 GB in all.
        let need = needs(EIGHT_B, 4, 5, ShardFormat::Q8);
        assert!(need.encode <= EIGHT_B.file + ENCODE_ALLOWANCE, "{need:?}");
        assert!(need.encode < 1.6e9, "{need:?}");
    }

    #[test]
    fn a_mesh_that_does_not_fit_is_refused_with_one_that_does() {
        // 8 GB: serving 2 × (0.77 + 1.55) + 1.2 = 5.8 GB fits.
        assert!(check(ONE_B, 2, 4, ShardFormat::Q8, true, 8e9).is_ok());
        // 5 GB: k = 2 of 4 does not; 2 of 3 does (4.0 GB).
        let err = check(ONE_B, 2, 4, ShardFormat::Q8, true, 5e9)
            .unwrap_err()
            .to_string();
        assert!(err.contains("--k 2 --nodes 3 --shard-format q8"), "{err}");
        // An 8B mesh of k = 4 of 5 is encoded and served in 24 GB (16.5 GB to serve)...
        assert!(check(EIGHT_B, 4, 5, ShardFormat::Q8, true, 24e9).is_ok());
        // ...and in 12 GB no mesh on one machine is.
        let err = check(EIGHT_B, 4, 5, ShardFormat::Q8, true, 12e9)
            .unwrap_err()
            .to_string();
        assert!(err.contains("spread it over machines"), "{err}");
    }
}
