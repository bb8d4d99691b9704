//! Entry points for the cargo-fuzz targets (`node-core/fuzz`) and their regression tests: each
//! decoder of outside bytes, fed untrusted input. Each must return — never panic, never
//! allocate without bound — whatever the bytes.

use crate::coded::ShardSet;
use crate::gguf::GgufFile;
use crate::learn::Update;
use crate::mesh::{Heartbeat, MeshRequest, MeshResponse, ModelManifest};
use crate::model::{LlamaConfig, ModelWeights};
use crate::protocol::{self, StepRequest, StepResponse};

/// A decoder fed untrusted bytes.
pub type Target = fn(&[u8]);

/// The fuzz targets, by name (the names of `node-core/fuzz/fuzz_targets/*.rs`).
pub const TARGETS: [(&str, Target); 6] = [
    ("mesh_messages", mesh_messages),
    ("shard_blob", shard_blob),
    ("gguf_header", gguf_header),
    ("safetensors_header", safetensors_header),
    ("update_payload", update_payload),
    ("manifest", manifest),
];

/// Every message of the mesh, step, session and hop protocols.
pub fn mesh_messages(data: &[u8]) {
    let _ = protocol::decode::<MeshRequest>(data);
    let _ = protocol::decode::<MeshResponse>(data);
    let _ = protocol::decode::<Heartbeat>(data);
    let _ = protocol::decode::<StepRequest>(data);
    let _ = protocol::decode::<StepResponse>(data);
    let _ = protocol::decode::<crate::net::session::Ask>(data);
    let _ = protocol::decode::<crate::net::session::Answer>(data);
    let _ = protocol::decode::<crate::net::hop::HopFrame>(data);
    let _ = protocol::decode::<crate::net::hop::Fed>(data);
}

/// A shard blob: the erasure-coded container, then the shard set inside.
pub fn shard_blob(data: &[u8]) {
    if let Ok(decoded) = crate::blob::decode_blob(data) {
        let _ = postcard::from_bytes::<ShardSet>(&decoded.payload);
    }
}

/// A GGUF file: header, metadata, tensor table, and every tensor's data it names.
pub fn gguf_header(data: &[u8]) {
    if let Ok(file) = GgufFile::parse(data) {
        let names: Vec<String> = file.tensors().iter().map(|t| t.name.clone()).collect();
        for name in names.iter().take(16) {
            let _ = file.tensor_f32(data, name);
        }
    }
}

const SMALL_HF_CONFIG: &str = r#"{"model_type":"llama","hidden_size":8,"intermediate_size":16,
"num_hidden_layers":1,"num_attention_heads":2,"num_key_value_heads":1,"vocab_size":16,
"rms_norm_eps":1e-5,"rope_theta":10000.0,"max_position_embeddings":8,"tie_word_embeddings":true}"#;

/// A safetensors file loaded as the small model's weights.
pub fn safetensors_header(data: &[u8]) {
    let _ = ModelWeights::from_safetensors(SMALL_HF_CONFIG, data);
}

/// An update payload: the signed envelope, the update inside, and its validation.
pub fn update_payload(data: &[u8]) {
    let payload = match crate::learn::open(data) {
        Ok(signed) => signed.payload,
        Err(_) => data.to_vec(),
    };
    if let Ok(u) = Update::decode(&payload) {
        let _ = u.validate(&LlamaConfig::small());
    }
}

/// A model manifest.
pub fn manifest(data: &[u8]) {
    let _ = ModelManifest::from_bytes(data);
}
