//! A node's learning state: its shard with the set of updates applied to it, the update
//! payloads kept on disk (so peers that missed them can fetch them), and restoring it all at
//! start-up.

use std::collections::BTreeSet;
use std::fs;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use node_core::coded::Member;
pub use node_core::holder::{MAX_UPDATE_BYTES, Rules, ShardState};
use node_core::mesh::ShardVersion;
use node_core::model::LeaderWeights;

use crate::store::DataDir;

/// Where a node keeps update payloads and its version.
#[derive(Debug, Clone)]
pub struct UpdateStore {
    dir: PathBuf,
    version_file: PathBuf,
    base_file: PathBuf,
    base_norms: PathBuf,
}

impl UpdateStore {
    /// The store of a data dir.
    pub fn open(data: &DataDir) -> Result<Self> {
        let dir = data.path().join("updates");
        fs::create_dir_all(&dir)?;
        Ok(Self {
            dir,
            version_file: data.path().join("version.json"),
            base_file: data.path().join("base-version.json"),
            base_norms: data.path().join("base-norms.bin"),
        })
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

    fn read_ids(path: &PathBuf) -> Result<BTreeSet<u64>> {
        if !path.exists() {
            return Ok(BTreeSet::new());
        }
        let text = fs::read_to_string(path)?;
        serde_json::from_str(&text).with_context(|| format!("reading {}", path.display()))
    }

    fn write_ids(path: &PathBuf, ids: impl Iterator<Item = u64>) -> Result<()> {
        let ids: Vec<u64> = ids.collect();
        let tmp = path.with_extension("tmp");
        fs::write(&tmp, serde_json::to_string(&ids)?)?;
        fs::rename(&tmp, path)?;
        Ok(())
    }

    /// Records the applied set (after the payloads are saved).
    pub fn save_version(&self, v: &ShardVersion) -> Result<()> {
        Self::write_ids(&self.version_file, v.ids())
    }

    /// Records the updates already inside the shard blob on disk, and the norm gains at that
    /// version.
    pub fn save_base(&self, v: &ShardVersion, norms: &LeaderWeights) -> Result<()> {
        let tmp = self.base_norms.with_extension("tmp");
        fs::write(&tmp, postcard::to_allocvec(norms)?)?;
        fs::rename(&tmp, &self.base_norms)?;
        Self::write_ids(&self.base_file, v.ids())
    }

    /// The norm gains of the base version: saved with it, or the genesis ones when the base is
    /// the genesis version.
    fn base_norms(&self, base: &BTreeSet<u64>, genesis: &LeaderWeights) -> Result<LeaderWeights> {
        if !self.base_norms.exists() {
            if base.is_empty() {
                return Ok(genesis.clone());
            }
            bail!(
                "{} is missing: the norm gains at the shard's version are unknown",
                self.base_norms.display()
            );
        }
        let bytes = fs::read(&self.base_norms)?;
        let norms: LeaderWeights = postcard::from_bytes(&bytes)
            .with_context(|| format!("reading {}", self.base_norms.display()))?;
        Ok(norms)
    }

    /// Rebuilds the state at start-up: the blob's shard plus every recorded update not in it.
    pub fn restore(
        &self,
        member: Member,
        rules: &Rules,
        genesis: &LeaderWeights,
    ) -> Result<ShardState> {
        let base = Self::read_ids(&self.base_file)?;
        let applied = Self::read_ids(&self.version_file)?;
        let norms = self.base_norms(&base, genesis)?;
        if !norms.fits(&rules.cfg) {
            bail!("the saved norm gains do not fit the model");
        }
        let mut version = ShardVersion::default();
        for &id in &base {
            version.insert(id);
        }
        let mut state = ShardState {
            member,
            version,
            norms,
            skip_updates: 0,
        };
        for id in applied.difference(&base) {
            let bytes = self.load(*id)?.with_context(|| {
                format!("update {id:016x} is recorded as applied but its payload is missing")
            })?;
            let checked = rules.check(&bytes)?;
            if checked.id != *id {
                bail!(
                    "the payload kept as update {id:016x} hashes to {:016x}",
                    checked.id
                );
            }
            state.apply(&checked.update, *id)?;
        }
        for id in applied {
            state.version.insert(id);
        }
        Ok(state)
    }
}
