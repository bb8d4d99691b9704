//! A node's learning state: its shard with the set of updates applied to it, the payloads of
//! the updates applied since its last snapshot (so peers that missed them can fetch them), the
//! snapshots that fold them into the shard blob, and restoring it all at start-up.
//!
//! On disk: `shard.blob` (the row at its snapshot) and `base.bin` (that snapshot's version and
//! norm gains), always saved as a pair ([`DataDir::save_row`]); `updates/` (the payloads kept
//! since, and the latest folded ones while they fit) and `version.json` (the ids applied since).
//! Disk stays at the shard blob plus at most [`node_core::mesh::KEEP_SHARE`] of it in payloads,
//! whatever the history, and a restart replays at most [`node_core::mesh::MAX_SINCE`] updates.

use std::collections::BTreeSet;
use std::fs;
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, PoisonError, RwLock};

use anyhow::{Context, Result, bail};
use node_core::coded::{Member, ShardSet};
use node_core::holder::{KeyShare, LearningStatus, UpdateLog, UpdateSeen};
pub use node_core::holder::{MAX_UPDATE_BYTES, Rules, ShardState};
use node_core::mesh::ShardVersion;
use node_core::model::LeaderWeights;
use serde::{Deserialize, Serialize};

use crate::hold::store::DataDir;

/// What the saved shard blob holds: its version (every update in it folded) and the norm
/// gains at that version.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Base {
    version: ShardVersion,
    norms: LeaderWeights,
}

/// Where a node keeps its snapshot, the update payloads since, and its version.
#[derive(Debug, Clone)]
pub struct UpdateStore {
    data: DataDir,
    dir: PathBuf,
    version_file: PathBuf,
    /// Whether a fold is running, and what wakes the updates waiting for it to end.
    folding: Arc<(Mutex<bool>, Condvar)>,
    /// How many of this node's newest updates each live holder may lack, as the node's view
    /// last saw ([`node_core::mesh::MeshView::lags`]): their payloads are kept for them.
    lags: Arc<Mutex<Vec<u64>>>,
    /// The latest updates this node applied or refused, for `/api/updates` and the dashboard.
    seen: Arc<Mutex<UpdateLog>>,
}

/// Marks a fold as running until dropped, then wakes the updates waiting for it.
struct Folding<'a>(&'a (Mutex<bool>, Condvar));

impl<'a> Folding<'a> {
    fn start(folding: &'a (Mutex<bool>, Condvar)) -> Self {
        *folding.0.lock().unwrap_or_else(PoisonError::into_inner) = true;
        Self(folding)
    }
}

impl Drop for Folding<'_> {
    fn drop(&mut self) {
        *self.0.0.lock().unwrap_or_else(PoisonError::into_inner) = false;
        self.0.1.notify_all();
    }
}

impl UpdateStore {
    /// The store of a data dir.
    pub fn open(data: &DataDir) -> Result<Self> {
        let dir = data.path().join("updates");
        fs::create_dir_all(&dir)?;
        Ok(Self {
            data: data.clone(),
            dir,
            version_file: data.path().join("version.json"),
            folding: Arc::default(),
            lags: Arc::default(),
            seen: Arc::default(),
        })
    }

    /// Remembers an update this node applied or refused (the newest
    /// [`node_core::holder::UPDATES_SEEN`] are kept).
    pub fn record(&self, seen: UpdateSeen) {
        (self.seen.lock().unwrap_or_else(PoisonError::into_inner)).push(seen);
    }

    /// The latest updates this node saw, with its API's requests trained on by `keys`.
    pub fn learning(&self, keys: Vec<KeyShare>) -> LearningStatus {
        let seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        LearningStatus::new(&seen, keys)
    }

    fn path(&self, id: u64) -> PathBuf {
        self.dir.join(format!("{id:016x}.update"))
    }

    /// Keeps an update's payload (two threads may save the same one at once: a catch-up and
    /// this node's own leader; each writes its own temporary file).
    pub fn save(&self, id: u64, bytes: &[u8]) -> Result<()> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let path = self.path(id);
        if !path.exists() {
            let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let tmp = path.with_extension(format!("tmp{n}"));
            fs::write(&tmp, bytes)?;
            fs::rename(&tmp, &path)?;
        }
        Ok(())
    }

    /// An update's payload, if kept.
    pub fn load(&self, id: u64) -> Result<Option<Vec<u8>>> {
        let path = self.path(id);
        if !path.exists() {
            return Ok(None);
        }
        Ok(Some(fs::read(path)?))
    }

    /// A byte range of an update's payload: `(total, bytes)`.
    pub fn chunk(&self, id: u64, offset: u64, len: u32) -> Result<(u64, Vec<u8>)> {
        let bytes = self
            .load(id)?
            .with_context(|| format!("update {id:016x} is not kept here"))?;
        let total = bytes.len() as u64;
        let start = offset.min(total) as usize;
        let end = (start + len as usize).min(bytes.len());
        Ok((total, bytes[start..end].to_vec()))
    }

    /// Records the updates applied since the snapshot (after their payloads are saved).
    pub fn save_version(&self, v: &ShardVersion) -> Result<()> {
        let ids: Vec<u64> = v.since().collect();
        let tmp = self.version_file.with_extension("tmp");
        fs::write(&tmp, serde_json::to_string(&ids)?)?;
        fs::rename(&tmp, &self.version_file)?;
        Ok(())
    }

    fn read_ids(path: &PathBuf) -> Result<BTreeSet<u64>> {
        if !path.exists() {
            return Ok(BTreeSet::new());
        }
        let text = fs::read_to_string(path)?;
        serde_json::from_str(&text).with_context(|| format!("reading {}", path.display()))
    }

    /// Bytes of a kept payload (0 when it is not kept).
    fn size(&self, id: u64) -> u64 {
        fs::metadata(self.path(id)).map_or(0, |m| m.len())
    }

    /// Bytes of the payloads `v` applied since its snapshot.
    fn since_bytes(&self, v: &ShardVersion) -> u64 {
        v.since().map(|id| self.size(id)).sum()
    }

    /// Whether the updates applied since the snapshot should be folded now.
    pub fn fold_due(&self, v: &ShardVersion) -> bool {
        v.fold_due(self.since_bytes(v), self.data.shard_bytes())
    }

    /// Saves `shard` (with every update of `version` in it) as the node's snapshot and drops
    /// the payloads it folded: after joining, rebuilding or folding.
    pub fn save_snapshot(
        &self,
        blob: &[u8],
        version: &ShardVersion,
        norms: &LeaderWeights,
    ) -> Result<()> {
        let mut version = version.clone();
        version.fold_all();
        let base = Base {
            version,
            norms: norms.clone(),
        };
        self.data.save_row(blob, &postcard::to_allocvec(&base)?)?;
        self.save_version(&base.version)?;
        self.drop_payloads_beyond(&base.version)
    }

    /// Waits while a fold runs and an update of `incoming` bytes has no room beside it
    /// ([`ShardVersion::room_beside_fold`]).
    fn wait_for_fold(&self, state: &RwLock<ShardState>, incoming: u64, blob_bytes: u64) {
        let (lock, ended) = &*self.folding;
        let mut folding = lock.lock().unwrap_or_else(PoisonError::into_inner);
        while *folding {
            let version = read(state).version.clone();
            if version.room_beside_fold(self.since_bytes(&version), incoming, blob_bytes) {
                return;
            }
            folding = ended.wait(folding).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Removes every payload (and interrupted save) that `v` does not keep or serve.
    fn drop_payloads_beyond(&self, v: &ShardVersion) -> Result<()> {
        for entry in fs::read_dir(&self.dir)? {
            let path = entry?.path();
            let kept = path
                .file_stem()
                .and_then(|s| s.to_str())
                .and_then(|s| u64::from_str_radix(s, 16).ok())
                .is_some_and(|id| v.keeps(id))
                && path.extension().is_some_and(|e| e == "update");
            if !kept {
                fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
            }
        }
        Ok(())
    }

    /// Folds the updates applied since the snapshot into a new one: the shard as it is now is
    /// saved as the blob; their payloads stay for peers a little behind while every kept
    /// payload fits [`node_core::mesh::KEEP_SHARE`] of the blob, the oldest going first.
    /// The shard is copied under the lock (a compact shard's integers are shared, not copied)
    /// and written to its blob outside it a group of chunks at a time, so steps and updates go
    /// on meanwhile (an update waiting for the lock would hold up every step behind it) and
    /// memory holds neither the payload nor the blob. Returns how many updates it folded.
    pub fn fold(&self, state: &RwLock<ShardState>) -> Result<usize> {
        let _folding = Folding::start(&self.folding);
        let (shards, version, norms) = {
            let s = read(state);
            (
                s.member.shards().clone(),
                s.version.clone(),
                s.norms.clone(),
            )
        };
        let ids: Vec<u64> = version.since().collect();
        let mut base = version;
        base.fold(ids.iter().copied());
        let saved = Base {
            version: base,
            norms,
        };
        let blob_bytes = self
            .data
            .save_shard_set(&shards, &postcard::to_allocvec(&saved)?)?;
        drop(shards);
        let mut s = write(state);
        s.version.fold(ids.iter().copied());
        self.save_version(&s.version)?;
        self.release(&mut s.version, blob_bytes, 0)?;
        Ok(ids.len())
    }

    /// Records how far behind this node each live holder is ([`node_core::mesh::MeshView::lags`]).
    pub fn set_lags(&self, lags: Vec<u64>) {
        *self.lags.lock().unwrap_or_else(PoisonError::into_inner) = lags;
    }

    /// Drops the oldest folded payloads until those kept and one more of `incoming` bytes fit
    /// the budget, keeping the newest ones a lagging live holder lacks while they fit theirs
    /// ([`ShardVersion::to_release`]).
    fn release(&self, v: &mut ShardVersion, blob_bytes: u64, incoming: u64) -> Result<()> {
        let lags = self
            .lags
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        for id in v.to_release(blob_bytes, incoming, |id| self.size(id), &lags) {
            v.release(id);
            let path = self.path(id);
            fs::remove_file(&path).with_context(|| format!("removing {}", path.display()))?;
        }
        Ok(())
    }

    /// Makes room for a new payload of `bytes` by dropping the oldest folded ones beyond the
    /// budget, so that disk never holds more. While a fold runs, an update goes on only while
    /// it has room beside it ([`ShardVersion::room_beside_fold`]); past that this waits for
    /// the fold to end, as every update did before folds ran beside them.
    pub fn make_room(&self, state: &RwLock<ShardState>, bytes: usize) -> Result<()> {
        let blob_bytes = self.data.shard_bytes();
        self.wait_for_fold(state, bytes as u64, blob_bytes);
        self.release(&mut write(state).version, blob_bytes, bytes as u64)
    }

    /// The snapshot's version and norm gains: saved with it, or the genesis ones when the blob
    /// is a genesis shard.
    fn base(&self, genesis: &LeaderWeights) -> Result<Base> {
        let Some(bytes) = self.data.base()? else {
            return self.legacy_base(genesis);
        };
        postcard::from_bytes(&bytes).context("reading base.bin")
    }

    /// A data dir of an earlier release (`base-version.json` and `base-norms.bin` beside the
    /// blob), or a genesis blob when it has neither.
    fn legacy_base(&self, genesis: &LeaderWeights) -> Result<Base> {
        let ids = Self::read_ids(&self.data.path().join("base-version.json"))?;
        let mut version = ShardVersion::default();
        for id in ids {
            version.insert(id);
        }
        version.fold_all();
        let norms_file = self.data.path().join("base-norms.bin");
        let norms = if norms_file.exists() {
            let bytes = fs::read(&norms_file)?;
            postcard::from_bytes(&bytes)
                .with_context(|| format!("reading {}", norms_file.display()))?
        } else if version.count() == 0 {
            genesis.clone()
        } else {
            bail!(
                "{} is missing: the norm gains at the shard's version are unknown",
                norms_file.display()
            );
        };
        Ok(Base { version, norms })
    }

    /// Rebuilds the state at start-up: the snapshot's shard plus every update kept since.
    pub fn restore(
        &self,
        shard: ShardSet,
        rules: &Rules,
        genesis: &LeaderWeights,
    ) -> Result<ShardState> {
        let Base { version, norms } = self.base(genesis)?;
        if !norms.fits(&rules.cfg) {
            bail!("the saved norm gains do not fit the model");
        }
        let mut version = version;
        for id in version.releasable() {
            if !self.path(id).exists() {
                version.release(id);
            }
        }
        let mut state = ShardState {
            member: Member::new(shard),
            version,
            norms,
            skip_updates: 0,
        };
        for id in Self::read_ids(&self.version_file)? {
            if state.version.contains(id) {
                continue; // folded (a fold stopped before it rewrote the list)
            }
            let Some(bytes) = self.load(id)? else {
                tracing::warn!(
                    id = format!("{id:016x}"),
                    "an update recorded as applied has no payload: leaving it out (the node catches up)"
                );
                continue;
            };
            // Accepted before: its certificate may have expired and its time passed since.
            let checked = rules.check(&bytes, None)?;
            if checked.id != id {
                bail!(
                    "the payload kept as update {id:016x} hashes to {:016x}",
                    checked.id
                );
            }
            state.apply(&checked.update, id)?;
        }
        self.save_version(&state.version)?;
        self.drop_payloads_beyond(&state.version)?;
        Ok(state)
    }
}

/// Reads the row's state (a lock a panic poisoned is read all the same).
pub(crate) fn read(state: &RwLock<ShardState>) -> std::sync::RwLockReadGuard<'_, ShardState> {
    state
        .read()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Writes the row's state (a lock a panic poisoned is written all the same).
pub(crate) fn write(state: &RwLock<ShardState>) -> std::sync::RwLockWriteGuard<'_, ShardState> {
    state
        .write()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
