//! Compute kernels: the CPU reference backend, threaded on native targets.

mod cpu;
mod par;

pub use cpu::{dot, matmul, matmul_transpose};
pub use par::threads;
