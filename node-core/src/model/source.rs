//! A model's coded matrices read a few rows at a time: from weights in memory, or from a file
//! ([`super::GgufModel`]) by genesis, which never holds the model.

use super::{LlamaConfig, ModelError, ModelWeights};

/// A model's coded matrices, read a few rows at a time.
pub trait MatrixSource: Sync {
    /// The model's shape (with `tied_embeddings` as the source has it).
    fn cfg(&self) -> &LlamaConfig;

    /// Rows `first..` of matrix `matrix` (its index in the chain order of `coded::shapes`: per
    /// block q, k, v, o, gate, up, down; the embedding; the separate LM head), as many as fill
    /// `out`.
    fn read_rows(&self, matrix: usize, first: usize, out: &mut [f32]) -> Result<(), ModelError>;
}

impl MatrixSource for ModelWeights {
    fn cfg(&self) -> &LlamaConfig {
        &self.cfg
    }

    fn read_rows(&self, matrix: usize, first: usize, out: &mut [f32]) -> Result<(), ModelError> {
        let m = match (matrix / 7, matrix % 7) {
            (l, i) if l < self.layers.len() => self.layers[l].matrices()[i],
            _ if matrix == 7 * self.layers.len() => &self.embed,
            _ => self
                .lm_head
                .as_ref()
                .ok_or_else(|| ModelError::Config(format!("the model has no matrix {matrix}")))?,
        };
        let start = first * m.cols;
        let src = m.data.get(start..start + out.len()).ok_or_else(|| {
            ModelError::Config(format!(
                "rows from {first} of a {} × {} matrix",
                m.rows, m.cols
            ))
        })?;
        out.copy_from_slice(src);
        Ok(())
    }
}
