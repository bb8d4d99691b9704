//! A shard's version: the set of applied update ids (SGD updates commute, so order is moot).

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

/// The set of updates a shard has applied.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardVersion {
    updates: BTreeSet<u64>,
}

impl ShardVersion {
    /// Number of updates applied.
    pub fn count(&self) -> u64 {
        self.updates.len() as u64
    }

    /// Digest of the set: equal digests mean consistent shards.
    pub fn digest(&self) -> [u8; 32] {
        let mut h = blake3::Hasher::new();
        h.update(b"codedmesh-version");
        for id in &self.updates {
            h.update(&id.to_le_bytes());
        }
        *h.finalize().as_bytes()
    }

    /// Records an applied update; false if it was already there.
    pub fn insert(&mut self, id: u64) -> bool {
        self.updates.insert(id)
    }

    /// Whether an update was applied.
    pub fn contains(&self, id: u64) -> bool {
        self.updates.contains(&id)
    }

    /// The applied update ids, ascending.
    pub fn ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.updates.iter().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digest_depends_on_the_set_not_the_order() {
        let mut a = ShardVersion::default();
        let mut b = ShardVersion::default();
        assert_eq!(a.digest(), b.digest());
        a.insert(3);
        a.insert(9);
        b.insert(9);
        assert_ne!(a.digest(), b.digest());
        b.insert(3);
        assert_eq!(a.digest(), b.digest());
        assert_eq!(a.count(), 2);
        assert!(!a.insert(3));
    }
}
