//! Compute kernels: the CPU reference backend, threaded on native targets, and the wgpu backend
//! (WGSL kernels for native GPUs and WebGPU).

pub(crate) mod cpu;
pub mod gpu;
pub mod par;
pub mod q4;
pub mod q8;

pub use cpu::{WeightElem, dot, matmul, matmul_transpose};
pub use par::threads;
