//! Every decoder of outside bytes on the inputs that once broke one (the fuzz regressions in
//! node-core/fuzz/regressions/) and on every truncation and many one-byte changes of valid
//! inputs: each must return an error or a value, never panic.

use std::path::Path;

use node_core::code::Generator;
use node_core::coded::{CodedGroup, InProcess, ShardFormat};
use node_core::fuzzing::{self, TARGETS};
use node_core::learn::{Update, seal};
use node_core::mesh::{MeshRequest, MeshResponse};
use node_core::model::{LeaderWeights, Llama, ModelWeights};

/// Every truncation, and every byte flipped in two ways (all of them for short inputs, a
/// stride through long ones).
fn mutations(valid: &[u8], f: fn(&[u8])) -> usize {
    let mut n = 0;
    let step = (valid.len() / 4096).max(1);
    for cut in (0..valid.len()).step_by(step) {
        f(&valid[..cut]);
        n += 1;
    }
    for i in (0..valid.len()).step_by(step) {
        for mask in [0x01u8, 0xff] {
            let mut v = valid.to_vec();
            v[i] ^= mask;
            f(&v);
            n += 1;
        }
    }
    n
}

#[test]
fn saved_regressions_replay_without_panicking() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/regressions");
    let mut replayed = 0;
    for (name, target) in TARGETS {
        let dir = root.join(name);
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries {
            let bytes = std::fs::read(entry.unwrap().path()).unwrap();
            target(&bytes);
            replayed += 1;
        }
    }
    eprintln!("replayed {replayed} saved inputs");
    // Two inputs are committed (manifest, gguf_header): fewer means they went missing.
    assert!(
        replayed >= 2,
        "only {replayed} saved inputs under {}",
        root.display()
    );
}

#[test]
fn mutated_messages_never_panic() {
    let reqs = [
        MeshRequest::Step {
            version: [3; 32],
            bytes: vec![1, 2, 3, 4],
        },
        MeshRequest::Chunk {
            row: 2,
            offset: 1 << 40,
            len: 1 << 20,
        },
    ];
    let mut n = 0;
    for r in &reqs {
        n += mutations(
            &node_core::protocol::encode(r).unwrap(),
            fuzzing::mesh_messages,
        );
    }
    let resp = MeshResponse::Chunk {
        total: 10,
        version: [1; 32],
        bytes: vec![9; 10],
    };
    n += mutations(
        &node_core::protocol::encode(&resp).unwrap(),
        fuzzing::mesh_messages,
    );
    assert!(n > 100);
}

#[test]
fn mutated_safetensors_never_panic() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/testdata/tiny-llama-hf/model.safetensors");
    let bytes = std::fs::read(path).unwrap();
    // The header is what is parsed before any tensor: mutate the first 4 KiB densely.
    let head = bytes.len().min(4096);
    for i in 0..head {
        let mut v = bytes.clone();
        v[i] ^= 0x5a;
        fuzzing::safetensors_header(&v);
    }
    for cut in (0..bytes.len()).step_by(997) {
        fuzzing::safetensors_header(&bytes[..cut]);
    }
}

#[test]
fn mutated_updates_and_shard_blobs_never_panic() {
    let cfg = node_core::model::LlamaConfig::small();
    let w = ModelWeights::synthetic(cfg.clone(), 3).unwrap();
    let g = Generator::uncoded();
    let mesh = InProcess::encode(&w, &g, ShardFormat::F32, &|_, _| {}).unwrap();
    let shard = mesh.members()[0].shards().clone();
    let mut group = CodedGroup::new(cfg.clone(), g, &[0], mesh).unwrap();
    let llama = Llama::new(cfg.clone(), LeaderWeights::from_model(&w)).unwrap();
    let grads = futures::executor::block_on(llama.gradients(&mut group, &[1, 5, 9, 2])).unwrap();
    let update = Update::from_gradients(grads, 1e-3, 1.0);
    update.validate(&cfg).unwrap();
    let key = libp2p::identity::Keypair::generate_ed25519();
    let sealed = seal(
        update.encode(),
        &key,
        None,
        node_core::learn::Header::default(),
    )
    .unwrap();
    assert!(mutations(&sealed, fuzzing::update_payload) > 100);
    assert!(mutations(&update.encode(), fuzzing::update_payload) > 100);
    let payload = postcard::to_allocvec(&shard).unwrap();
    let blob = node_core::blob::encode_blob(
        &payload,
        &node_core::blob::BlobParams {
            chunk_size: 256,
            data_chunks: 4,
            parity_chunks: 2,
        },
    )
    .unwrap();
    fuzzing::shard_blob(&blob);
    assert!(mutations(&blob, fuzzing::shard_blob) > 100);
}
