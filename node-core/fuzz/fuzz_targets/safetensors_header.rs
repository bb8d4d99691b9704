//! Fuzz target: `node_core::fuzzing::safetensors_header` must return on any bytes.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| node_core::fuzzing::safetensors_header(data));
