//! Browser storage in headless Chromium (wasm-bindgen-test): shards survive a round trip through
//! IndexedDB byte for byte, tampered or malformed records are reported as corrupt, and the node's
//! identity is stable across calls. Each test uses its own key.

#![cfg(target_arch = "wasm32")]

use std::error::Error;

use idb::{Factory, TransactionMode};
use js_sys::{Reflect, Uint8Array};
use node_web::{ShardStore, StoreError, identity};
use wasm_bindgen::JsValue;
use wasm_bindgen_test::{wasm_bindgen_test, wasm_bindgen_test_configure};

wasm_bindgen_test_configure!(run_in_browser);

/// `len` bytes of varied content (xorshift), so a shifted or truncated copy cannot compare equal.
fn varied(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

type TestResult<T = ()> = Result<T, Box<dyn Error>>;

/// A JS exception as a test error.
fn js(e: JsValue) -> Box<dyn Error> {
    format!("{e:?}").into()
}

/// Rewrites the raw record under `key` with `edit`, behind the store's back.
async fn tamper(key: &str, edit: impl FnOnce(&JsValue) -> TestResult<JsValue>) -> TestResult {
    let db = Factory::new()?.open("codedmesh", None)?.await?;
    let tx = db.transaction(&["shards"], TransactionMode::ReadWrite)?;
    let store = tx.object_store("shards")?;
    let record = store.get(JsValue::from_str(key))?.await?;
    let record = edit(&record.unwrap_or(JsValue::NULL))?;
    store.put(&record, Some(&JsValue::from_str(key)))?.await?;
    assert!(tx.await?.is_committed());
    db.close();
    Ok(())
}

#[wasm_bindgen_test]
async fn a_saved_shard_loads_back_identical() -> TestResult {
    let store = ShardStore::open().await?;
    let meta = br#"{"row":3,"k":4}"#.to_vec();
    let blob = varied(5 << 20, 7);
    store.save("test.roundtrip", &meta, &blob).await?;
    let loaded = store
        .load("test.roundtrip")
        .await?
        .ok_or("the record just saved is gone")?;
    assert_eq!(loaded.meta, meta);
    assert_eq!(loaded.blob.len(), blob.len());
    assert!(loaded.blob == blob, "the blob came back different");

    // A second connection (a page reload) sees the same record; a save replaces it.
    let again = ShardStore::open().await?;
    let seen = again
        .load("test.roundtrip")
        .await?
        .ok_or("not seen by a second connection")?;
    assert!(
        seen.blob == blob,
        "the second connection read a different blob"
    );
    again.save("test.roundtrip", b"", b"short").await?;
    let loaded = store
        .load("test.roundtrip")
        .await?
        .ok_or("the replacement is gone")?;
    assert_eq!(
        (loaded.meta.as_slice(), loaded.blob.as_slice()),
        (&b""[..], &b"short"[..])
    );
    store.remove("test.roundtrip").await?;
    Ok(())
}

#[wasm_bindgen_test]
async fn a_missing_key_is_none() -> TestResult {
    let store = ShardStore::open().await?;
    assert_eq!(store.load("test.never-saved").await?, None);
    Ok(())
}

#[wasm_bindgen_test]
async fn a_tampered_blob_is_corrupt() -> TestResult {
    let store = ShardStore::open().await?;
    store
        .save("test.tampered", b"meta", &varied(64 << 10, 11))
        .await?;
    tamper("test.tampered", |record| {
        let blob: Uint8Array = Reflect::get(record, &"blob".into()).map_err(js)?.into();
        blob.set_index(1000, blob.get_index(1000) ^ 0x01);
        Ok(record.clone())
    })
    .await?;
    match store.load("test.tampered").await {
        Err(StoreError::Corrupt { key, reason }) => {
            assert_eq!(key, "test.tampered");
            assert!(reason.contains("blob checksum mismatch"), "{reason}");
        }
        other => panic!("expected a corrupt record, got {other:?}"),
    }
    // What the caller then does: remove it, and the key is free again.
    store.remove("test.tampered").await?;
    assert_eq!(store.load("test.tampered").await?, None);
    Ok(())
}

#[wasm_bindgen_test]
async fn a_tampered_checksum_or_malformed_record_is_corrupt() -> TestResult {
    let store = ShardStore::open().await?;
    store.save("test.malformed", b"meta", b"blob").await?;
    tamper("test.malformed", |record| {
        Reflect::set(
            record,
            &"meta_blake3".into(),
            &Uint8Array::new_with_length(32),
        )
        .map_err(js)?;
        Ok(record.clone())
    })
    .await?;
    match store.load("test.malformed").await {
        Err(StoreError::Corrupt { reason, .. }) => {
            assert!(reason.contains("meta checksum"), "{reason}")
        }
        other => panic!("expected a corrupt record, got {other:?}"),
    }
    for bad in [
        JsValue::from_str("not a record"),
        js_sys::Object::new().into(),
    ] {
        tamper("test.malformed", move |_| Ok(bad)).await?;
        let loaded = store.load("test.malformed").await;
        assert!(
            matches!(loaded, Err(StoreError::Corrupt { .. })),
            "{loaded:?}"
        );
    }
    store.remove("test.malformed").await?;
    Ok(())
}

#[wasm_bindgen_test]
async fn remove_deletes_and_tolerates_absence() -> TestResult {
    let store = ShardStore::open().await?;
    store.save("test.remove", b"m", b"b").await?;
    assert!(store.load("test.remove").await?.is_some());
    store.remove("test.remove").await?;
    assert_eq!(store.load("test.remove").await?, None);
    store.remove("test.remove").await?;
    Ok(())
}

#[wasm_bindgen_test]
fn identity_is_stable_and_survives_garbage() -> TestResult {
    let storage = web_sys::window()
        .ok_or("no window")?
        .local_storage()
        .map_err(js)?
        .ok_or("no localStorage")?;
    let first = identity()?.public().to_peer_id();
    assert_eq!(identity()?.public().to_peer_id(), first);

    // An unreadable stored key is replaced, and the replacement is then kept.
    storage
        .set_item("codedmesh.identity", "zz-not-a-key")
        .map_err(js)?;
    let replaced = identity()?.public().to_peer_id();
    assert_ne!(replaced, first);
    assert_eq!(identity()?.public().to_peer_id(), replaced);
    Ok(())
}
