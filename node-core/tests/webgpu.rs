//! The WGSL kernels on WebGPU in a browser: the bodies of tests/native/gpu.rs, run by
//! wasm-bindgen-test in headless Chromium (its WebGPU adapter is SwiftShader, on the CPU).
//! `bash scripts/test.sh` installs the runner and Chromium and runs them:
//! `cargo test -p node-core --target wasm32-unknown-unknown --test webgpu`.

#![cfg(target_arch = "wasm32")]
#![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

mod common;
mod gpu_bodies;

use node_core::compute::gpu::Gpu;
use wasm_bindgen_test::{wasm_bindgen_test, wasm_bindgen_test_configure};

wasm_bindgen_test_configure!(run_in_browser);

async fn open() -> Gpu {
    let gpu = Gpu::open(false).await.unwrap();
    web_sys_log(&format!("WebGPU adapter: {}", gpu.info()));
    gpu
}

fn web_sys_log(s: &str) {
    wasm_bindgen_test::console_log!("{s}");
}

#[wasm_bindgen_test]
async fn gemv_gemm_and_transpose_match_the_cpu_on_webgpu() {
    let mut gpu = open().await;
    gpu_bodies::products_match_the_cpu(&mut gpu).await;
}

#[wasm_bindgen_test]
async fn a_whole_token_on_webgpu_gives_the_logits_of_the_cpu_group() {
    gpu_bodies::a_whole_token_matches_the_cpu_group(open().await).await;
}
