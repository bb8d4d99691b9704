//! The end-to-end tests in one test binary, a module per subject: one test crate to compile
//! and link against node-core, node-native, libp2p and wgpu instead of eight.
//! `cargo test -p tests --test e2e mesh_processes::` runs one module;
//! `bash scripts/repeat-test.sh mesh_processes` repeats it.
//!
//! Every test holds a claim on the machine for its whole run ([`machine`]): the browser test
//! runs alone, as it did when it was a binary of its own.
//!
//! libtest starts the tests in the order of their names as its threads come free, so the
//! order of the modules' names is the schedule: the tests that hold the machine alone come
//! first (`browser`, `browser_up`, `lab`), and the two longest (`large_models`, about 10
//! minutes, and `learning_real_model`, as long) right after them, side by side, so that
//! neither runs alone at the end.

mod machine;

mod api;
mod architectures;
mod browser;
mod browser_up;
mod calibration;
mod coded_real_model;
mod hf_safetensors;
mod lab;
mod large_models;
mod learning_real_model;
mod mesh_learning;
mod mesh_processes;
mod mesh_spread;
mod red_team;
mod reference_logits;
mod sim_leader;
mod sim_mesh;
mod sim_scale;
mod sim_spread;
mod sim_trainer;
mod sim_world;
