//! Compute kernels: the CPU reference backend, threaded on native targets, and the wgpu backend
//! (WGSL kernels for native GPUs and WebGPU).

pub(crate) mod cpu;
pub mod gpu;
pub mod par;
pub mod q4;
pub mod q8;

pub use cpu::{WeightElem, dot, matmul, matmul_transpose};
pub use par::threads;

/// A xorshift stream of `seed`, the kernels' tests' random values.
#[cfg(test)]
pub(crate) fn xorshift(seed: u32) -> impl FnMut() -> u32 {
    let mut state = seed.wrapping_mul(2654435761).wrapping_add(12345);
    move || {
        state ^= state << 13;
        state ^= state >> 17;
        state ^= state << 5;
        state
    }
}
