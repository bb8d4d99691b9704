//! Coded Mesh core: the Cauchy code, the model, coded execution and protocol messages.
//!
//! A weight matrix is coded into `n` shards; any `k` shard products decode to `W·x`:
//!
//! ```
//! use node_core::code::{Decoder, Generator};
//! use node_core::compute::matmul;
//!
//! let (out, inp) = (4, 3);
//! let w: Vec<f32> = (0..out * inp).map(|i| i as f32).collect();
//! let x = [1.0f32, 0.5, -1.0];
//! let g = Generator::cauchy(5, 3)?; // n = 5 shards, any k = 3 decode
//! let nodes = [0, 2, 4];
//! let rows = g.shard_rows(out);
//! let mut parts = Vec::new();
//! for &node in &nodes {
//!     let shard = g.encode_shard(node, &w, out, inp)?; // what node `node` stores
//!     let mut z = vec![0.0f32; rows];
//!     matmul(&shard, rows, inp, &x, 1, &mut z); // what it computes
//!     parts.push(z);
//! }
//! let refs: Vec<&[f32]> = parts.iter().map(Vec::as_slice).collect();
//! let mut y = vec![0.0f32; g.padded_rows(out)];
//! Decoder::new(&g, &nodes)?.decode(&refs, &mut y)?;
//! for r in 0..out {
//!     let exact: f32 = (0..inp).map(|c| w[r * inp + c] * x[c]).sum();
//!     assert!((y[r] - exact).abs() < 1e-4);
//! }
//! # Ok::<(), node_core::code::CodeError>(())
//! ```

pub mod blob;
pub mod chain;
pub mod code;
pub mod coded;
pub mod compute;
pub mod fuzzing;
pub mod gguf;
pub mod holder;
pub mod lead;
pub mod learn;
pub mod mesh;
pub mod model;
pub mod net;
pub mod protocol;
pub mod update;
