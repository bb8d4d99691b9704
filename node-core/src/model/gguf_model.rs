//! A GGUF model read a tensor, or a few rows of one, at a time: what genesis encodes a model
//! from without holding it.

use super::MatrixSource;
use super::weights::{GGUF_NAMES, Part, TensorSource, gains_to_adjacent, load_gains};
use super::{LeaderWeights, LlamaConfig, ModelError};
use crate::gguf::{GgufError, GgufFile, TensorInfo, dequantize};

/// Random access to a file's bytes.
pub trait ReadAt: Sync {
    /// Fills `buf` with the bytes from `offset`.
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()>;
}

impl ReadAt for Vec<u8> {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        let start = usize::try_from(offset).unwrap_or(usize::MAX);
        let src = start
            .checked_add(buf.len())
            .and_then(|end| self.get(start..end))
            .ok_or_else(|| std::io::Error::from(std::io::ErrorKind::UnexpectedEof))?;
        buf.copy_from_slice(src);
        Ok(())
    }
}

/// A GGUF model whose tensors are read from `data` when asked for, one at a time.
pub struct GgufModel<'a> {
    file: &'a GgufFile,
    data: &'a dyn ReadAt,
    cfg: LlamaConfig,
}

impl std::fmt::Debug for GgufModel<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufModel")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

impl<'a> GgufModel<'a> {
    /// The model `file` describes, its tensors read from `data` (the whole file's bytes).
    pub fn open(file: &'a GgufFile, data: &'a dyn ReadAt) -> Result<Self, ModelError> {
        let cfg = LlamaConfig::from_gguf_with(file, &|name| read_tensor(file, data, name))?;
        Ok(Self {
            file,
            data,
            cfg: LlamaConfig {
                tied_embeddings: file.tensor(GGUF_NAMES.lm_head).is_none(),
                ..cfg
            },
        })
    }

    /// The leader's parameters: every gain and bias, in the layout the model rotates.
    pub fn leader(&self) -> Result<LeaderWeights, ModelError> {
        let mut g = load_gains(&self.cfg, self, &GGUF_NAMES)?;
        if self.cfg.family.half_split_rope_in_gguf() {
            for l in 0..self.cfg.layers {
                let mut none = (Vec::new(), Vec::new(), Vec::new());
                gains_to_adjacent(
                    &self.cfg,
                    g.qkv_bias.get_mut(l).unwrap_or(&mut none.0),
                    g.q_norm.get_mut(l).unwrap_or(&mut none.1),
                    g.k_norm.get_mut(l).unwrap_or(&mut none.2),
                );
            }
        }
        Ok(g)
    }

    /// The name of matrix `matrix` in chain order, its shape as the config has it, and
    /// whether its rows are stored half-split by head (and how many heads).
    fn matrix_name(&self, matrix: usize) -> (String, [usize; 2], Option<usize>) {
        let c = &self.cfg;
        let (rows, cols) = c.matrix_shapes().get(matrix).copied().unwrap_or((0, 0));
        let name = if matrix < 7 * c.layers {
            let part = [
                Part::Q,
                Part::K,
                Part::V,
                Part::O,
                Part::Gate,
                Part::Up,
                Part::Down,
            ][matrix % 7];
            (GGUF_NAMES.layer)(matrix / 7, part)
        } else if matrix == 7 * c.layers {
            GGUF_NAMES.embed.to_string()
        } else {
            GGUF_NAMES.lm_head.to_string()
        };
        let split = c.family.half_split_rope_in_gguf() && matrix < 7 * c.layers;
        let heads = match matrix % 7 {
            0 if split => Some(c.heads),
            1 if split => Some(c.kv_heads),
            _ => None,
        };
        (name, [rows, cols], heads)
    }
}

impl TensorSource for GgufModel<'_> {
    fn shape(&self, name: &str) -> Option<Vec<usize>> {
        self.file.tensor(name).map(|t| t.shape.clone())
    }

    fn load(&self, name: &str) -> Result<Vec<f32>, ModelError> {
        read_tensor(self.file, self.data, name)
    }
}

impl MatrixSource for GgufModel<'_> {
    fn cfg(&self) -> &LlamaConfig {
        &self.cfg
    }

    fn read_rows(&self, matrix: usize, first: usize, out: &mut [f32]) -> Result<(), ModelError> {
        let (name, [rows, cols], split_heads) = self.matrix_name(matrix);
        let info = info(self.file, &name)?;
        if info.shape != [rows, cols] {
            return Err(ModelError::TensorShape {
                name,
                got: info.shape.clone(),
                expected: vec![rows, cols],
            });
        }
        let n = out.len() / cols.max(1);
        let block = info.ggml_type.block().filter(|&(per, _)| cols % per == 0);
        let (Some((per, block_bytes)), true) = (
            block,
            cols > 0 && n * cols == out.len() && first + n <= rows,
        ) else {
            return Err(ModelError::TensorShape {
                name,
                got: info.shape.clone(),
                expected: vec![first + n, out.len() / n.max(1)],
            });
        };
        let row_bytes = cols / per * block_bytes;
        let read = |file_row: usize, count: usize, out: &mut [f32]| {
            let offset = info.offset + (file_row * row_bytes) as u64;
            let bytes = read_bytes(self.data, offset, count * row_bytes)?;
            out.copy_from_slice(&dequantize(info.ggml_type, &bytes, count * cols)?);
            Ok::<(), ModelError>(())
        };
        match split_heads {
            // Within each head, adjacent row `2i + h` is stored as row `h·(d/2) + i`.
            Some(heads) => {
                let per_head = rows / heads.max(1);
                let half = per_head / 2;
                for (i, row) in out.chunks_exact_mut(cols).enumerate() {
                    let r = first + i;
                    let (head, a) = (r / per_head, r % per_head);
                    read(head * per_head + (a % 2) * half + a / 2, 1, row)?;
                }
                Ok(())
            }
            None => read(first, n, out),
        }
    }
}

/// A tensor's entry, or the error naming it.
fn info<'f>(file: &'f GgufFile, name: &str) -> Result<&'f TensorInfo, ModelError> {
    file.tensor(name).ok_or_else(|| ModelError::MissingTensor {
        name: name.to_string(),
    })
}

/// Reads `len` bytes of the file from `offset`.
fn read_bytes(data: &dyn ReadAt, offset: u64, len: usize) -> Result<Vec<u8>, ModelError> {
    let mut buf = vec![0u8; len];
    data.read_at(offset, &mut buf).map_err(|e| {
        ModelError::Gguf(GgufError::Truncated {
            offset: usize::try_from(offset).unwrap_or(usize::MAX),
            what: if e.kind() == std::io::ErrorKind::UnexpectedEof {
                "tensor data"
            } else {
                "tensor data (the read failed)"
            },
        })
    })?;
    Ok(buf)
}

/// A whole tensor of the file, dequantized.
fn read_tensor(file: &GgufFile, data: &dyn ReadAt, name: &str) -> Result<Vec<f32>, ModelError> {
    let info = info(file, name)?;
    let bytes = read_bytes(data, info.offset, info.n_bytes as usize)?;
    let elements = info.shape.iter().product();
    Ok(dequantize(info.ggml_type, &bytes, elements)?)
}
