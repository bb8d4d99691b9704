//! The end-to-end tests in one test binary, a module per subject: one test crate to compile
//! and link against node-core, node-native, libp2p and wgpu instead of eight.
//! `cargo test -p tests --test e2e mesh_processes::` runs one module;
//! `bash scripts/repeat-test.sh mesh_processes` repeats it.
//!
//! Every test holds a claim on the machine for its whole run ([`machine`]): the browser test
//! runs alone, as it did when it was a binary of its own.

mod machine;

mod api;
mod architectures;
mod browser;
mod browser_up;
mod calibration;
mod coded_real_model;
mod hf_safetensors;
mod lab;
mod learning_real_model;
mod mesh_learning;
mod mesh_processes;
mod mesh_spread;
mod red_team;
mod reference_logits;
mod shapes;
mod sim_leader;
mod sim_mesh;
mod sim_scale;
mod sim_spread;
