//! Genesis a matrix at a time: every row's shard set encoded straight into a writer, reading
//! the model a few rows at a time, so that encoding never holds the model, nor more of the rows
//! than a bounded part of one matrix's.

use std::io::Write;
use std::sync::Arc;

use super::compact::{CodedInts, Q8Values, wide_row};
use super::{CodedError, Shard, ShardFormat, ShardValues, shapes};
use crate::code::Generator;
use crate::compute::q8::blocks_per_row;
use crate::model::{
    LayerWeights, LeaderWeights, LlamaConfig, Matrix, MatrixSource, ModelError, ModelWeights,
};

/// Values a slab of rows holds at most, for all `k·m` sub-blocks together (16 MB of f32).
const SLAB_VALUES: usize = 4 << 20;

/// How [`encode_rows`] cuts its work.
#[derive(Debug, Clone, Copy)]
pub struct StreamLimits {
    /// Bytes of one matrix's shards encoded at once: rows whose shards would pass it are
    /// encoded in another pass over the matrix (at least one row a pass).
    pub shard_bytes: usize,
    /// Values of uncoded rows read at once.
    pub slab_values: usize,
}

impl Default for StreamLimits {
    fn default() -> Self {
        Self {
            shard_bytes: 512 << 20,
            slab_values: SLAB_VALUES,
        }
    }
}

/// Encodes every genesis row's shard set of `src` into `sinks` (one per row of `g`, in order),
/// the bytes [`super::ShardSet`]'s serialization would have: a matrix at a time, each read in
/// slabs of rows; `progress(done, total)` counts matrices.
pub fn encode_rows<W: Write>(
    src: &dyn MatrixSource,
    g: &Generator,
    format: ShardFormat,
    sinks: &mut [W],
    limits: StreamLimits,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<(), CodedError> {
    let rows = g.genesis_rows();
    if sinks.len() != rows {
        return Err(CodedError::BadRequest(format!(
            "{} writers for {rows} rows",
            sinks.len()
        )));
    }
    let cfg = src.cfg();
    let io = |e: postcard::Error| CodedError::BadRequest(format!("writing a row: {e}"));
    // A shard set's fields in order: the config, the code, the row, then the blocks (a
    // sequence of sequences of seven shards), the embedding and the optional LM head.
    for (node, sink) in sinks.iter_mut().enumerate() {
        postcard::to_io(cfg, &mut *sink).map_err(io)?;
        postcard::to_io(g, &mut *sink).map_err(io)?;
        postcard::to_io(&node, &mut *sink).map_err(io)?;
        postcard::to_io(&cfg.layers, &mut *sink).map_err(io)?;
    }
    let all = shapes(cfg, g);
    let nodes: Vec<usize> = (0..rows).collect();
    for (matrix, shape) in all.iter().enumerate() {
        for part in groups(&nodes, |&n| shard_bytes(g, n, *shape, format), limits) {
            let shards = encode_matrix(src, g, matrix, *shape, format, part, limits)?;
            for (&node, shard) in part.iter().zip(&shards) {
                let sink = &mut sinks[node];
                if matrix < 7 * cfg.layers && matrix % 7 == 0 {
                    postcard::to_io(&7usize, &mut *sink).map_err(io)?;
                }
                if matrix == 7 * cfg.layers + 1 {
                    postcard::to_io(&Some(shard), &mut *sink).map_err(io)?;
                } else {
                    postcard::to_io(shard, &mut *sink).map_err(io)?;
                }
            }
        }
        progress(matrix + 1, all.len());
    }
    if cfg.tied_embeddings {
        for sink in sinks.iter_mut() {
            postcard::to_io(&None::<Shard>, &mut *sink).map_err(io)?;
        }
    }
    Ok(())
}

/// Bytes of row `node`'s shard of a matrix.
fn shard_bytes(
    g: &Generator,
    node: usize,
    shape: super::MatrixShape,
    format: ShardFormat,
) -> usize {
    let values = g.sub_blocks() * shape.block_len * shape.cols;
    match format {
        ShardFormat::F32 => 4 * values,
        ShardFormat::F16 => 2 * values,
        ShardFormat::Q8 if wide_row(g, node) => 2 * values,
        // A q4 set's matrices off a 4-bit grid are q8: at most a byte a value.
        ShardFormat::Q8 | ShardFormat::Q4 => values,
    }
}

/// `items` cut into runs whose `size`s add up to at most the limit (at least one item a run).
fn groups<T>(items: &[T], size: impl Fn(&T) -> usize, limits: StreamLimits) -> Vec<&[T]> {
    let mut out = Vec::new();
    let (mut start, mut sum) = (0, 0);
    for (i, item) in items.iter().enumerate() {
        let s = size(item);
        if i > start && sum + s > limits.shard_bytes {
            out.push(&items[start..i]);
            (start, sum) = (i, 0);
        }
        sum += s;
    }
    if start < items.len() {
        out.push(&items[start..]);
    }
    out
}

/// Rows `nodes`' shards of matrix `matrix`, encoded from slabs of its rows: rows
/// `r0..r0 + s` of every sub-block are a matrix of `k·m` sub-blocks of `s` rows, whose shards
/// are rows `r0..r0 + s` of every sub-block of the whole matrix's.
fn encode_matrix(
    src: &dyn MatrixSource,
    g: &Generator,
    matrix: usize,
    shape: super::MatrixShape,
    format: ShardFormat,
    nodes: &[usize],
    limits: StreamLimits,
) -> Result<Vec<Shard>, CodedError> {
    if format == ShardFormat::Q4 {
        // Whether a matrix keeps 4-bit blocks is decided over the whole of it, and a slab is
        // a part (its padding alone lies on any grid).
        return Err(CodedError::BadRequest(
            "4-bit (q4) rows are encoded from the whole model so far, not streamed (issue 81)"
                .into(),
        ));
    }
    let (l, cols, m) = (shape.block_len, shape.cols, g.sub_blocks());
    let km = g.k() * m;
    let slab = (limits.slab_values / (km * cols).max(1)).clamp(1, l.max(1));
    let mut out: Vec<Option<Shard>> = nodes.iter().map(|_| None).collect();
    let mut r0 = 0;
    while r0 < l {
        let s = slab.min(l - r0);
        let mut data = vec![0.0f32; km * s * cols];
        for j in 0..km {
            let first = j * l + r0;
            let n = s.min(shape.out.saturating_sub(first));
            if n > 0 {
                src.read_rows(matrix, first, &mut data[j * s * cols..(j * s + n) * cols])?;
            }
        }
        let piece = Matrix::new(km * s, cols, data)?;
        let pieces =
            crate::compute::par::map(nodes, |&node| Shard::encode(g, node, &piece, format));
        for (dst, piece) in out.iter_mut().zip(pieces) {
            let piece = piece?;
            let dst = dst.get_or_insert_with(|| empty_like(&piece, shape, m));
            for sub in 0..m {
                copy_rows(
                    &mut dst.values,
                    sub * l + r0,
                    &piece.values,
                    sub * s,
                    s,
                    cols,
                );
            }
        }
        r0 += s;
    }
    out.into_iter()
        .zip(nodes)
        .map(|(s, &node)| {
            s.ok_or_else(|| CodedError::BadRequest(format!("row {node}: an empty matrix")))
        })
        .collect()
}

/// A shard of a matrix of `shape` (`m` sub-blocks) with zero values stored like `piece`'s.
fn empty_like(piece: &Shard, shape: super::MatrixShape, m: usize) -> Shard {
    let rows = m * shape.block_len;
    let n = rows * shape.cols;
    let values = match &piece.values {
        ShardValues::F32(_) => ShardValues::F32(vec![0.0; n]),
        ShardValues::F16(_) => ShardValues::F16(vec![half::f16::ZERO; n]),
        ShardValues::Q8(v) => ShardValues::Q8(Q8Values {
            q: match v.q {
                CodedInts::I8(_) => CodedInts::I8(Arc::new(vec![0; n])),
                CodedInts::I16(_) => CodedInts::I16(Arc::new(vec![0; n])),
            },
            scales: Arc::new(vec![half::f16::ZERO; rows * blocks_per_row(shape.cols)]),
        }),
        ShardValues::Q4(_) => ShardValues::Q4(super::Q4Values::zeros(rows, shape.cols)),
    };
    Shard {
        out: shape.out,
        block_len: shape.block_len,
        cols: shape.cols,
        values,
        carry: Vec::new(),
        adapter: super::Adapter::default(),
    }
}

/// Copies `n` rows of `cols` values from `src` (from row `from`) into `dst` (from row `to`).
fn copy_rows(
    dst: &mut ShardValues,
    to: usize,
    src: &ShardValues,
    from: usize,
    n: usize,
    cols: usize,
) {
    let (d, s) = (to * cols..(to + n) * cols, from * cols..(from + n) * cols);
    match (dst, src) {
        (ShardValues::F32(a), ShardValues::F32(b)) => a[d].copy_from_slice(&b[s]),
        (ShardValues::F16(a), ShardValues::F16(b)) => a[d].copy_from_slice(&b[s]),
        (ShardValues::Q8(a), ShardValues::Q8(b)) => {
            match (&mut a.q, &b.q) {
                (CodedInts::I8(x), CodedInts::I8(y)) => Arc::make_mut(x)[d].copy_from_slice(&y[s]),
                (CodedInts::I16(x), CodedInts::I16(y)) => {
                    Arc::make_mut(x)[d].copy_from_slice(&y[s])
                }
                _ => {}
            }
            let nb = blocks_per_row(cols);
            Arc::make_mut(&mut a.scales)[to * nb..(to + n) * nb]
                .copy_from_slice(&b.scales[from * nb..(from + n) * nb]);
        }
        (ShardValues::Q4(a), ShardValues::Q4(b)) => a.copy_rows(to, b, from, n, cols),
        _ => {}
    }
}

/// A small model that stands for `src` where the whole would not fit: its first `layers`
/// blocks and the first `vocab` rows of its embedding and head, with `leader`'s gains.
pub fn calibration_model(
    src: &dyn MatrixSource,
    leader: &LeaderWeights,
    layers: usize,
    vocab: usize,
) -> Result<(ModelWeights, LeaderWeights), ModelError> {
    let full = src.cfg();
    let cfg = LlamaConfig {
        layers: layers.clamp(1, full.layers),
        vocab: vocab.clamp(1, full.vocab),
        ..full.clone()
    };
    let shapes = full.matrix_shapes();
    let read = |matrix: usize, rows: usize| -> Result<Matrix, ModelError> {
        let cols = shapes[matrix].1;
        let mut data = vec![0.0f32; rows * cols];
        src.read_rows(matrix, 0, &mut data)?;
        Matrix::new(rows, cols, data)
    };
    let keep = |v: &[Vec<f32>]| -> Vec<Vec<f32>> { v.iter().take(cfg.layers).cloned().collect() };
    let gains = LeaderWeights {
        attn_norm: keep(&leader.attn_norm),
        ffn_norm: keep(&leader.ffn_norm),
        final_norm: leader.final_norm.clone(),
        qkv_bias: keep(&leader.qkv_bias),
        q_norm: keep(&leader.q_norm),
        k_norm: keep(&leader.k_norm),
    };
    let gain = |v: &[Vec<f32>], l: usize| v.get(l).cloned().unwrap_or_default();
    let layers = (0..cfg.layers)
        .map(|l| {
            let m = |i: usize| read(7 * l + i, shapes[7 * l + i].0);
            Ok(LayerWeights {
                attn_norm: gain(&gains.attn_norm, l),
                q: m(0)?,
                k: m(1)?,
                v: m(2)?,
                o: m(3)?,
                ffn_norm: gain(&gains.ffn_norm, l),
                gate: m(4)?,
                up: m(5)?,
                down: m(6)?,
                qkv_bias: gain(&gains.qkv_bias, l),
                q_norm: gain(&gains.q_norm, l),
                k_norm: gain(&gains.k_norm, l),
            })
        })
        .collect::<Result<Vec<_>, ModelError>>()?;
    let embed = 7 * full.layers;
    let w = ModelWeights {
        embed: read(embed, cfg.vocab)?,
        lm_head: if cfg.tied_embeddings {
            None
        } else {
            Some(read(embed + 1, cfg.vocab)?)
        },
        layers,
        final_norm: gains.final_norm.clone(),
        cfg,
    };
    Ok((w, gains))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

    use super::*;
    use crate::coded::ShardSet;

    fn cfg(tied: bool) -> LlamaConfig {
        LlamaConfig {
            hidden: 40,
            ffn: 72,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 10,
            vocab: 53,
            norm_eps: 1e-5,
            rope_theta: 10000.0,
            max_seq: 64,
            tied_embeddings: tied,
            family: crate::model::Family::Llama,
            rope_freq_factors: Vec::new(),
        }
    }

    /// Streamed rows are byte for byte the shard sets encoded whole, however the work is cut:
    /// several slabs a matrix (with rows past the end of the last sub-block), several passes
    /// over one matrix, both codes, tied and separate heads; so are rows encoded a matrix a
    /// thread, in any order of rows.
    #[test]
    fn streamed_and_parallel_rows_are_the_shard_sets_encoded_whole() {
        for (tied, format) in [
            (false, ShardFormat::Q8),
            (true, ShardFormat::Q8),
            (false, ShardFormat::F32),
            (true, ShardFormat::F16),
        ] {
            let w = ModelWeights::synthetic(cfg(tied), 7).unwrap();
            let g = match format {
                ShardFormat::Q8 => Generator::integer(4, 2, None),
                _ => Generator::growing(5, 3, None),
            }
            .unwrap();
            for limits in [
                StreamLimits::default(),
                StreamLimits {
                    shard_bytes: 1000,
                    slab_values: 300,
                },
            ] {
                let mut sinks = vec![Vec::new(); g.genesis_rows()];
                let mut seen = 0;
                encode_rows(&w, &g, format, &mut sinks, limits, &mut |done, _| {
                    seen = done
                })
                .unwrap();
                assert_eq!(seen, 7 * 2 + 1 + usize::from(!tied));
                for (node, bytes) in sinks.iter().enumerate() {
                    let whole = ShardSet::encode(&w, &g, node, format, &mut |_, _| {}).unwrap();
                    assert_eq!(
                        bytes,
                        &postcard::to_allocvec(&whole).unwrap(),
                        "row {node}, {format:?}, tied {tied}, {limits:?}"
                    );
                }
            }
            let nodes: Vec<usize> = (0..g.genesis_rows()).rev().collect();
            let parallel = ShardSet::encode_parallel(&w, &g, &nodes, format).unwrap();
            assert_eq!(parallel.len(), nodes.len());
            for (set, &node) in parallel.iter().zip(&nodes) {
                let whole = ShardSet::encode(&w, &g, node, format, &mut |_, _| {}).unwrap();
                assert_eq!(set, &whole, "row {node}, {format:?}, tied {tied}");
            }
        }
        // Whether a matrix keeps 4-bit blocks is decided over the whole of it: q4 rows are
        // not streamed, and say so.
        let w = ModelWeights::synthetic(cfg(true), 7).unwrap();
        let g = ShardFormat::Q4.code(2, 2).unwrap();
        let mut sinks = vec![Vec::new(); 2];
        let limits = StreamLimits::default();
        let err = encode_rows(&w, &g, ShardFormat::Q4, &mut sinks, limits, &mut |_, _| {});
        let err = err.unwrap_err().to_string();
        assert!(err.contains("not streamed"), "{err}");
    }

    #[test]
    fn a_calibration_model_is_the_first_blocks_and_rows_of_the_model() {
        let w = ModelWeights::synthetic(cfg(false), 3).unwrap();
        let leader = LeaderWeights::from_model(&w);
        let (small, gains) = calibration_model(&w, &leader, 1, 20).unwrap();
        assert_eq!((small.cfg.layers, small.cfg.vocab), (1, 20));
        assert_eq!(small.layers[0].down, w.layers[0].down);
        assert_eq!(small.embed.data, w.embed.data[..20 * 40]);
        assert_eq!(
            small.lm_head.unwrap().data,
            w.lm_head.as_ref().unwrap().data[..20 * 40]
        );
        assert_eq!(gains.attn_norm.len(), 1);
    }
}
