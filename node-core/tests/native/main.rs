//! node-core's native integration tests in one test binary, a module per subject: one test
//! crate to compile and link against node-core, libp2p and wgpu instead of seven.
//! `cargo test -p node-core --test native batched::` runs one module. The WebGPU tests in the
//! browser (../webgpu.rs) are a target of their own: they build for wasm32 only.

#![cfg(not(target_arch = "wasm32"))]
#![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

// Shared with ../webgpu.rs.
#[path = "../common/mod.rs"]
mod common;
#[path = "../gpu_bodies/mod.rs"]
mod gpu_bodies;

mod backward;
mod batched;
mod coded_synthetic;
mod embedding_check;
mod fuzz_regressions;
mod gpu;
mod gradients;
mod learning;
mod verification;
