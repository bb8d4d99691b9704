//! Fuzz target: `node_core::fuzzing::shard_blob` must return on any bytes.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| node_core::fuzzing::shard_blob(data));
