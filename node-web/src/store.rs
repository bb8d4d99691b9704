//! Browser storage: the coded shard this node holds, kept in IndexedDB so a page reload does not
//! download it again, and the node's identity, kept in localStorage.
//!
//! ```ignore
//! let store = ShardStore::open().await?;
//! let shard = match store.load(&key).await {
//!     Ok(Some(stored)) => stored,
//!     Ok(None) => download_and_save(&store, &key).await?,
//!     Err(StoreError::Corrupt { .. }) => {
//!         store.remove(&key).await?;
//!         download_and_save(&store, &key).await?
//!     }
//!     Err(e) => return Err(e.into()),
//! };
//! ```
//!
//! A record in the object store is a plain object, keyed out of line by the caller's key:
//! `{ v: 1, meta: Uint8Array, blob: Uint8Array, meta_blake3: Uint8Array(32),
//! blob_blake3: Uint8Array(32) }`. Bytes are stored as typed arrays (structured clone), never
//! as text, so a blob of hundreds of MB costs its size and no more.

use idb::{DatabaseEvent as _, Factory, ObjectStoreParams, TransactionMode, TransactionResult};
use js_sys::{Object, Reflect, Uint8Array};
use libp2p::identity::Keypair;
use node_core::mesh::hex;
use wasm_bindgen::closure::Closure;
use wasm_bindgen::{JsCast, JsValue};
use web_sys::{Event, IdbDatabase};

/// The IndexedDB database the node keeps its data in.
const DB_NAME: &str = "codedmesh";
/// The database's schema version (one object store, out-of-line keys).
const DB_VERSION: u32 = 1;
/// The object store holding shards.
const SHARDS: &str = "shards";
/// The record layout's version, written in every record as `v`.
const RECORD_VERSION: f64 = 1.0;
/// The localStorage key of the node's identity.
const IDENTITY_KEY: &str = "codedmesh.identity";

/// Errors of browser storage.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The browser offers no IndexedDB or localStorage here (a worker, a locked-down profile).
    #[error("browser storage unavailable: {0}")]
    Unavailable(String),
    /// A storage request failed (quota exceeded, transaction aborted, ...).
    #[error("browser storage request failed: {0}")]
    Io(String),
    /// A stored record is malformed or its checksums do not match.
    #[error("stored record {key:?} is corrupt: {reason}")]
    Corrupt {
        /// The record's key.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
}

/// A record kept in browser storage: small metadata and a large blob.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    /// The caller's metadata (what the blob is).
    pub meta: Vec<u8>,
    /// The payload.
    pub blob: Vec<u8>,
}

/// The shards this browser keeps, in IndexedDB (database "codedmesh", object store "shards").
pub struct ShardStore {
    db: idb::Database,
    /// The same connection, for closing it on drop and when another page upgrades the schema.
    raw: IdbDatabase,
    /// Closes the connection when another page needs a newer schema, so it is not blocked.
    _on_version_change: Closure<dyn FnMut(Event)>,
}

impl std::fmt::Debug for ShardStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShardStore")
            .field("db", &DB_NAME)
            .field("store", &SHARDS)
            .finish()
    }
}

impl ShardStore {
    /// Opens (creating when needed) the database.
    pub async fn open() -> Result<Self, StoreError> {
        let factory = Factory::new().map_err(|e| StoreError::Unavailable(e.to_string()))?;
        let mut request = factory
            .open(DB_NAME, Some(DB_VERSION))
            .map_err(|e| StoreError::Unavailable(e.to_string()))?;
        request.on_upgrade_needed(|event| {
            // Errors here abort the upgrade, and the open request then fails with them.
            let created = event.database().and_then(|db| {
                if db.store_names().iter().any(|n| n == SHARDS) {
                    Ok(())
                } else {
                    db.create_object_store(SHARDS, ObjectStoreParams::new())
                        .map(drop)
                }
            });
            if let Err(e) = created {
                tracing::warn!("creating the {SHARDS:?} object store: {e}");
            }
        });
        let db = request
            .await
            .map_err(|e| StoreError::Unavailable(format!("opening {DB_NAME:?}: {e}")))?;
        if !db.store_names().iter().any(|n| n == SHARDS) {
            db.close();
            return Err(StoreError::Unavailable(format!(
                "database {DB_NAME:?} has no {SHARDS:?} object store"
            )));
        }
        let raw: IdbDatabase = db.into();
        let closing = raw.clone();
        let on_version_change = Closure::<dyn FnMut(Event)>::new(move |_: Event| {
            tracing::info!("another page upgrades {DB_NAME:?}; closing this connection");
            closing.close();
        });
        raw.set_onversionchange(Some(on_version_change.as_ref().unchecked_ref()));
        Ok(Self {
            db: raw.clone().into(),
            raw,
            _on_version_change: on_version_change,
        })
    }

    /// Saves `meta` and `blob` under `key` in one transaction, with a BLAKE3 checksum of each.
    pub async fn save(&self, key: &str, meta: &[u8], blob: &[u8]) -> Result<(), StoreError> {
        let record = Object::new();
        set(&record, "v", &JsValue::from_f64(RECORD_VERSION))?;
        set(&record, "meta", &Uint8Array::from(meta))?;
        set(&record, "blob", &Uint8Array::from(blob))?;
        let meta_sum = blake3::hash(meta);
        let blob_sum = blake3::hash(blob);
        set(
            &record,
            "meta_blake3",
            &Uint8Array::from(&meta_sum.as_bytes()[..]),
        )?;
        set(
            &record,
            "blob_blake3",
            &Uint8Array::from(&blob_sum.as_bytes()[..]),
        )?;

        let tx = self.transaction(TransactionMode::ReadWrite)?;
        let store = tx.object_store(SHARDS).map_err(io("saving", key))?;
        store
            .put(&record, Some(&JsValue::from_str(key)))
            .map_err(io("saving", key))?
            .await
            .map_err(io("saving", key))?;
        finish(tx, "saving", key).await?;
        tracing::debug!(key, meta = meta.len(), blob = blob.len(), "saved shard");
        Ok(())
    }

    /// The record under `key`, its checksums verified; None when there is none; Err(Corrupt) when the checksums do not match (the caller then deletes it and downloads again).
    pub async fn load(&self, key: &str) -> Result<Option<Stored>, StoreError> {
        let tx = self.transaction(TransactionMode::ReadOnly)?;
        let store = tx.object_store(SHARDS).map_err(io("loading", key))?;
        let value = store
            .get(JsValue::from_str(key))
            .map_err(io("loading", key))?
            .await
            .map_err(io("loading", key))?;
        match value {
            None => Ok(None),
            Some(v) if v.is_undefined() => Ok(None),
            Some(v) => decode(key, &v).map(Some),
        }
    }

    /// Deletes the record under `key` (no error when absent).
    pub async fn remove(&self, key: &str) -> Result<(), StoreError> {
        let tx = self.transaction(TransactionMode::ReadWrite)?;
        let store = tx.object_store(SHARDS).map_err(io("removing", key))?;
        store
            .delete(JsValue::from_str(key))
            .map_err(io("removing", key))?
            .await
            .map_err(io("removing", key))?;
        finish(tx, "removing", key).await
    }

    /// A transaction on the shards object store.
    fn transaction(&self, mode: TransactionMode) -> Result<idb::Transaction, StoreError> {
        self.db
            .transaction(&[SHARDS], mode)
            .map_err(|e| StoreError::Io(format!("opening a transaction: {e}")))
    }
}

impl Drop for ShardStore {
    fn drop(&mut self) {
        // The handler's closure is freed with `self`: unhook it before JS could call it.
        self.raw.set_onversionchange(None);
        self.raw.close();
    }
}

/// Maps an idb error of `op` on `key` to [`StoreError::Io`].
fn io<'a>(op: &'a str, key: &'a str) -> impl Fn(idb::Error) -> StoreError + 'a {
    move |e| StoreError::Io(format!("{op} {key:?}: {e}"))
}

/// Waits for a read-write transaction to commit; an abort is an error.
async fn finish(tx: idb::Transaction, op: &str, key: &str) -> Result<(), StoreError> {
    match tx.await.map_err(io(op, key))? {
        TransactionResult::Committed => Ok(()),
        TransactionResult::Aborted => Err(StoreError::Io(format!(
            "{op} {key:?}: the transaction was aborted"
        ))),
    }
}

/// Sets `obj[name] = value`.
fn set(obj: &Object, name: &str, value: &JsValue) -> Result<(), StoreError> {
    Reflect::set(obj, &JsValue::from_str(name), value)
        .map(drop)
        .map_err(|e| StoreError::Io(format!("building a record: {}", js_text(&e))))
}

/// Reads a record written by [`ShardStore::save`] and checks it.
fn decode(key: &str, value: &JsValue) -> Result<Stored, StoreError> {
    let corrupt = |reason: String| StoreError::Corrupt {
        key: key.to_owned(),
        reason,
    };
    if !value.is_object() {
        return Err(corrupt("the record is not an object".into()));
    }
    let field = |name: &str| {
        Reflect::get(value, &JsValue::from_str(name))
            .map_err(|e| corrupt(format!("reading {name}: {}", js_text(&e))))
    };
    let bytes = |name: &str| -> Result<Vec<u8>, StoreError> {
        let v = field(name)?;
        if let Some(a) = v.dyn_ref::<Uint8Array>() {
            Ok(a.to_vec())
        } else if let Some(b) = v.dyn_ref::<js_sys::ArrayBuffer>() {
            Ok(Uint8Array::new(b).to_vec())
        } else {
            Err(corrupt(format!("{name} is not bytes")))
        }
    };
    let version = field("v")?.as_f64();
    if version != Some(RECORD_VERSION) {
        return Err(corrupt(format!("unknown record version {version:?}")));
    }
    let meta = bytes("meta")?;
    let blob = bytes("blob")?;
    for (name, data, sum) in [
        ("meta", &meta, bytes("meta_blake3")?),
        ("blob", &blob, bytes("blob_blake3")?),
    ] {
        let sum: [u8; 32] = sum
            .try_into()
            .map_err(|s: Vec<u8>| corrupt(format!("{name} checksum has {} bytes", s.len())))?;
        let actual = blake3::hash(data);
        if actual != blake3::Hash::from_bytes(sum) {
            return Err(corrupt(format!(
                "{name} checksum mismatch: stored {}, computed {}",
                hex(&sum),
                actual.to_hex()
            )));
        }
    }
    Ok(Stored { meta, blob })
}

/// This browser's node identity, kept in localStorage ("codedmesh.identity", the keypair's protobuf encoding as hex), made and saved on first use; an unreadable stored key is replaced with a warning.
pub fn identity() -> Result<Keypair, StoreError> {
    let storage = web_sys::window()
        .ok_or_else(|| StoreError::Unavailable("no window (localStorage needs a page)".into()))?
        .local_storage()
        .map_err(|e| StoreError::Unavailable(format!("localStorage: {}", js_text(&e))))?
        .ok_or_else(|| StoreError::Unavailable("localStorage is disabled".into()))?;
    let stored = storage
        .get_item(IDENTITY_KEY)
        .map_err(|e| StoreError::Io(format!("reading {IDENTITY_KEY}: {}", js_text(&e))))?;
    if let Some(text) = stored {
        match unhex(text.trim())
            .ok_or_else(|| "not hex".to_owned())
            .and_then(|b| Keypair::from_protobuf_encoding(&b).map_err(|e| e.to_string()))
        {
            Ok(key) => return Ok(key),
            Err(e) => {
                tracing::warn!("unreadable identity in {IDENTITY_KEY} ({e}); making a new one")
            }
        }
    }
    let key = Keypair::generate_ed25519();
    let encoded = key
        .to_protobuf_encoding()
        .map_err(|e| StoreError::Io(format!("encoding the identity: {e}")))?;
    storage
        .set_item(IDENTITY_KEY, &hex(&encoded))
        .map_err(|e| StoreError::Io(format!("writing {IDENTITY_KEY}: {}", js_text(&e))))?;
    tracing::info!(peer = %key.public().to_peer_id(), "made a new node identity");
    Ok(key)
}

/// Parses hex digits (either case) into bytes; None on an odd length or a non-hex digit.
fn unhex(s: &str) -> Option<Vec<u8>> {
    let (pairs, rest) = s.as_bytes().as_chunks::<2>();
    if !rest.is_empty() {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16);
    pairs
        .iter()
        .map(|&[hi, lo]| Some((digit(hi)? * 16 + digit(lo)?) as u8))
        .collect()
}

/// A JS exception as text.
fn js_text(v: &JsValue) -> String {
    v.as_string()
        .or_else(|| {
            v.dyn_ref::<js_sys::Error>()
                .map(|e| String::from(e.message()))
        })
        .unwrap_or_else(|| format!("{v:?}"))
}
