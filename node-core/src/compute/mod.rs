//! Compute kernels: the CPU reference backend, threaded on native targets.

mod cpu;
pub mod par;

pub use cpu::{WeightElem, dot, matmul, matmul_transpose};
pub use par::threads;
