//! A shard's version: the set of applied update ids (SGD updates commute, so order is moot),
//! kept as a snapshot of folded updates plus the ids applied since.
//!
//! The version's identity is a *set hash* of every applied id: each id maps to 512 bits
//! (BLAKE3's extendable output), and a set's hash is their lane-wise sum (eight `u64` lanes,
//! wrapping). Adding an id adds its hash, so folding updates into a snapshot changes nothing
//! about the digest: two nodes that applied the same updates have the same digest whatever
//! they folded and when. That is why the mesh needs no agreement on snapshot points: each node
//! folds when the payloads applied since its snapshot grow past a bound
//! ([`ShardVersion::fold_due`]), keeps the payloads of the latest folded updates while they fit
//! a second bound (for peers a little behind), and a node further behind than a peer's oldest
//! kept update rebuilds its row at the peer's version instead of replaying ([`plan_catch_up`]).

use std::collections::{BTreeSet, VecDeque};

use serde::{Deserialize, Serialize};

/// Most updates kept unfolded: a node folds at this many whatever their size.
pub const MAX_SINCE: usize = 32;

/// Folded ids remembered, so that a late copy of an update already folded is recognized and
/// not applied twice (a peer keeps at most [`MAX_SINCE`] + [`MAX_KEPT`] payloads, all of them
/// later than this window).
pub const RECENT_FOLDED: usize = 1024;

/// Most folded payloads kept for peers, whatever their size.
pub const MAX_KEPT: usize = RECENT_FOLDED / 2;

/// The payloads applied since the snapshot may reach this share of the shard blob's bytes
/// before they are folded into a new snapshot.
pub const FOLD_SHARE: f64 = 0.05;

/// Every payload a node keeps (since its snapshot, and the latest folded ones, for peers a
/// little behind) stays within this share of the shard blob's bytes: with the version files,
/// disk stays within 10% over the shard whatever the history.
pub const KEEP_SHARE: f64 = 0.08;

/// While a live holder lags this node, the payloads of the newest updates it may lack are kept
/// beyond [`KEEP_SHARE`] as long as they fit this share of the shard blob's bytes, so that it
/// catches up by replaying them rather than by rebuilding its row (a rebuild needs k holders at
/// the new version; right after failures there may be exactly k in all). A holder further
/// behind than that rebuilds, and nothing is held back for it.
pub const LAG_KEEP_SHARE: f64 = 0.25;

/// However large updates are beside the shard (a small model's adapters), the payloads of this
/// many of the newest updates may stay for a lagging live holder.
pub const LAG_KEEP_UPDATES: usize = 4;

/// A set hash: the lane-wise wrapping sum of every member's 512-bit hash.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SetHash([u64; 8]);

impl SetHash {
    /// The hash of the set holding `id` alone.
    pub fn of(id: u64) -> Self {
        let mut h = blake3::Hasher::new_derive_key("codedmesh update id set hash v1");
        h.update(&id.to_le_bytes());
        let mut bytes = [0u8; 64];
        h.finalize_xof().fill(&mut bytes);
        let mut lanes = [0u64; 8];
        for (lane, chunk) in lanes.iter_mut().zip(bytes.as_chunks::<8>().0) {
            *lane = u64::from_le_bytes(*chunk);
        }
        Self(lanes)
    }

    /// Adds the set `other` (disjoint from this one) to it.
    pub fn add(&mut self, other: &Self) {
        for (a, b) in self.0.iter_mut().zip(&other.0) {
            *a = a.wrapping_add(*b);
        }
    }

    fn bytes(&self) -> [u8; 64] {
        let mut out = [0u8; 64];
        for (chunk, lane) in out.as_chunks_mut::<8>().0.iter_mut().zip(&self.0) {
            *chunk = lane.to_le_bytes();
        }
        out
    }
}

/// The updates folded into a shard's snapshot: how many, and their set hash.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Folded {
    /// Updates folded.
    pub count: u64,
    /// Their set hash.
    pub sum: SetHash,
}

/// The set of updates a shard has applied: a snapshot's folded updates plus those since.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "VersionWire", into = "VersionWire")]
pub struct ShardVersion {
    folded: Folded,
    /// Ids folded lately, oldest first (at most [`RECENT_FOLDED`]).
    recent: VecDeque<u64>,
    /// Ids applied since the snapshot.
    since: BTreeSet<u64>,
    /// Folded ids whose payloads this node still keeps (all of them in `recent`).
    kept: BTreeSet<u64>,
    /// The set hash of every applied id (folded and since), kept current.
    total: SetHash,
}

/// A version as it travels and is stored: the cached total is recomputed on arrival.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct VersionWire {
    folded: Folded,
    recent: Vec<u64>,
    since: Vec<u64>,
    kept: Vec<u64>,
}

/// A version received or read that cannot be one.
#[derive(Debug, thiserror::Error)]
pub enum VersionError {
    /// More ids than a version keeps.
    #[error("a version lists {got} {what} ids; at most {max} are kept")]
    TooMany {
        /// Which list.
        what: &'static str,
        /// Its length.
        got: usize,
        /// The most allowed.
        max: usize,
    },
    /// An id listed twice.
    #[error("a version lists update {0:016x} twice")]
    Repeated(u64),
}

impl TryFrom<VersionWire> for ShardVersion {
    type Error = VersionError;

    fn try_from(w: VersionWire) -> Result<Self, VersionError> {
        // A holder that was behind can keep more than MAX_SINCE until its next fold, but never
        // more than the ids it remembers.
        for (what, got) in [
            ("kept", w.since.len()),
            ("folded", w.recent.len()),
            ("folded and kept", w.kept.len()),
        ] {
            if got > RECENT_FOLDED {
                return Err(VersionError::TooMany {
                    what,
                    got,
                    max: RECENT_FOLDED,
                });
            }
        }
        let mut v = Self {
            folded: w.folded,
            total: w.folded.sum,
            ..Self::default()
        };
        for id in w.since {
            if !v.insert(id) {
                return Err(VersionError::Repeated(id));
            }
        }
        v.recent = w.recent.into();
        // A folded payload is kept only while its id is remembered.
        v.kept = w
            .kept
            .into_iter()
            .filter(|id| v.recent.contains(id))
            .collect();
        Ok(v)
    }
}

impl From<ShardVersion> for VersionWire {
    fn from(v: ShardVersion) -> Self {
        Self {
            folded: v.folded,
            recent: v.recent.into(),
            since: v.since.into_iter().collect(),
            kept: v.kept.into_iter().collect(),
        }
    }
}

impl ShardVersion {
    /// Number of updates applied (folded or not).
    pub fn count(&self) -> u64 {
        self.folded.count + self.since.len() as u64
    }

    /// Digest of the set: equal digests mean consistent shards, however each node folded.
    pub fn digest(&self) -> [u8; 32] {
        let mut h = blake3::Hasher::new();
        h.update(b"codedmesh-version/2");
        h.update(&self.count().to_le_bytes());
        h.update(&self.total.bytes());
        *h.finalize().as_bytes()
    }

    /// Records an applied update; false if it was already there (kept or folded lately).
    pub fn insert(&mut self, id: u64) -> bool {
        if self.contains(id) {
            return false;
        }
        self.since.insert(id);
        self.total.add(&SetHash::of(id));
        true
    }

    /// Whether an update was applied: kept since the snapshot, or folded lately.
    pub fn contains(&self, id: u64) -> bool {
        self.since.contains(&id) || self.recent.contains(&id)
    }

    /// Whether this node keeps an update's payload (applied since the snapshot, or folded
    /// lately and not yet released).
    pub fn keeps(&self, id: u64) -> bool {
        self.since.contains(&id) || self.kept.contains(&id)
    }

    /// The ids applied since the snapshot, ascending.
    pub fn since(&self) -> impl ExactSizeIterator<Item = u64> + '_ {
        self.since.iter().copied()
    }

    /// Every update whose payload this node keeps (since the snapshot, and folded lately).
    pub fn served(&self) -> impl Iterator<Item = u64> + '_ {
        self.since.iter().chain(&self.kept).copied()
    }

    /// The folded updates whose payloads are still kept, oldest fold first: the order they
    /// are released in.
    pub fn releasable(&self) -> Vec<u64> {
        self.recent
            .iter()
            .copied()
            .filter(|id| self.kept.contains(id))
            .collect()
    }

    /// The updates folded into the snapshot.
    pub fn folded(&self) -> Folded {
        self.folded
    }

    /// Folds the updates `ids` applied since the snapshot into it (others are skipped); their
    /// payloads stay kept until [`Self::release`]. The digest does not change.
    pub fn fold(&mut self, ids: impl IntoIterator<Item = u64>) {
        for id in ids {
            if self.since.remove(&id) {
                self.folded.count += 1;
                self.folded.sum.add(&SetHash::of(id));
                self.recent.push_back(id);
                self.kept.insert(id);
            }
        }
        while self.recent.len() > RECENT_FOLDED {
            if let Some(id) = self.recent.pop_front() {
                self.kept.remove(&id);
            }
        }
    }

    /// Records that a folded update's payload is no longer kept.
    pub fn release(&mut self, id: u64) {
        self.kept.remove(&id);
    }

    /// Folds every update into the snapshot, keeping no payload: a row just obtained from
    /// the mesh (its updates are inside the shard, their payloads are elsewhere).
    pub fn fold_all(&mut self) {
        let ids: Vec<u64> = self.since().collect();
        self.fold(ids);
        self.kept.clear();
    }

    /// The folded updates to release, oldest fold first, so that the payloads kept and one
    /// more of `incoming` bytes fit [`KEEP_SHARE`] of the shard blob's `blob_bytes` (and at
    /// most [`MAX_KEPT`] folded ones stay); `size(id)` is a kept payload's bytes. `lags` are how
    /// many of this node's newest updates each live holder may lack ([`crate::mesh::MeshView::lags`]):
    /// the newest payloads the largest of them needs stay too, when they fit
    /// [`LAG_KEEP_SHARE`] of the blob.
    pub fn to_release(
        &self,
        blob_bytes: u64,
        incoming: u64,
        size: impl Fn(u64) -> u64,
        lags: &[u64],
    ) -> Vec<u64> {
        let releasable = self.releasable();
        let since: u64 = self.since().map(&size).sum::<u64>() + incoming;
        let protected = protected_newest(
            &releasable,
            self.since.len(),
            incoming > 0,
            since,
            blob_bytes,
            &size,
            lags,
        );
        let (older, newest) = releasable.split_at(releasable.len() - protected);
        let budget = (KEEP_SHARE * blob_bytes as f64)
            .max((since + newest.iter().map(|&id| size(id)).sum::<u64>()) as f64);
        let mut total: u64 = self.served().map(&size).sum::<u64>() + incoming;
        let mut kept = self.kept.len();
        let mut out = Vec::new();
        for &id in older {
            if total as f64 <= budget && kept <= MAX_KEPT {
                break;
            }
            total = total.saturating_sub(size(id));
            kept -= 1;
            out.push(id);
        }
        out
    }

    /// Whether the updates applied since the snapshot should be folded now: [`MAX_SINCE`] of
    /// them, or their payloads (`since_bytes`) past [`FOLD_SHARE`] of the shard blob's
    /// `blob_bytes`.
    pub fn fold_due(&self, since_bytes: u64, blob_bytes: u64) -> bool {
        !self.since.is_empty()
            && (self.since.len() >= MAX_SINCE
                || since_bytes as f64 > FOLD_SHARE * blob_bytes as f64)
    }

    /// Whether an update of `incoming` bytes may be applied while a fold runs: fewer than
    /// [`MAX_SINCE`] are kept since the snapshot, and their payloads (`since_bytes`) and it fit
    /// [`KEEP_SHARE`] of the shard blob's `blob_bytes`. Past that it waits for the fold.
    pub fn room_beside_fold(&self, since_bytes: u64, incoming: u64, blob_bytes: u64) -> bool {
        self.since.len() < MAX_SINCE
            && (since_bytes + incoming) as f64 <= KEEP_SHARE * blob_bytes as f64
    }
}

/// How many of the newest folded payloads (`releasable`, oldest first) stay for lagging
/// holders: a holder that lags by `lag` may lack every update applied since the snapshot
/// (`since_count` of them, `since` bytes with the incoming one, never released) and the newest
/// `lag − since_count` folded ones (an `incoming` payload counts as kept too). The largest lag of `lags` whose payloads fit
/// [`LAG_KEEP_SHARE`] of `blob_bytes` (or number at most [`LAG_KEEP_UPDATES`]) is served; a lag
/// that does not fit gets nothing (that holder rebuilds whatever is kept).
fn protected_newest(
    releasable: &[u64],
    since_count: usize,
    incoming: bool,
    since: u64,
    blob_bytes: u64,
    size: impl Fn(u64) -> u64,
    lags: &[u64],
) -> usize {
    let cap = LAG_KEEP_SHARE * blob_bytes as f64;
    let fits = |bytes: u64, updates: usize| bytes as f64 <= cap || updates <= LAG_KEEP_UPDATES;
    // The payloads kept whatever happens: those since the snapshot, and an incoming one.
    let held = since_count + usize::from(incoming);
    let mut total = since;
    let mut fit = 0;
    if fits(total, held) {
        for &id in releasable.iter().rev().take(MAX_KEPT) {
            total += size(id);
            if !fits(total, held + fit + 1) {
                break;
            }
            fit += 1;
        }
    }
    lags.iter()
        .map(|&lag| {
            usize::try_from(lag)
                .unwrap_or(usize::MAX)
                .saturating_sub(since_count)
        })
        .filter(|&need| need <= fit)
        .max()
        .unwrap_or(0)
}

/// What a holder at `have` does about a peer at `theirs`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CatchUp {
    /// Nothing: the peer holds no update this holder can use.
    Nothing,
    /// Fetch and apply these updates the peer keeps, in this order.
    Replay(Vec<u64>),
    /// The peer holds updates it no longer keeps (it folded them): rebuild the row at the
    /// peer's version (a copy from another holder of the row, or a chain of k rows).
    Rebuild,
}

/// How a holder at `have` catches up with a peer at `theirs`: the updates the peer keeps
/// payloads of and it lacks, unless even those would leave it behind (the peer folded updates it lacks), in which
/// case it rebuilds; two holders at one count and different sets that cannot replay either way
/// converge on the larger digest (the smaller rebuilds).
pub fn plan_catch_up(have: &ShardVersion, theirs: &ShardVersion) -> CatchUp {
    if have.digest() == theirs.digest() {
        return CatchUp::Nothing;
    }
    let missing: Vec<u64> = theirs.served().filter(|&id| !have.contains(id)).collect();
    let reached = have.count() + missing.len() as u64;
    if reached < theirs.count() {
        return CatchUp::Rebuild;
    }
    if !missing.is_empty() {
        return CatchUp::Replay(missing);
    }
    if have.count() == theirs.count() && have.digest() < theirs.digest() {
        return CatchUp::Rebuild;
    }
    CatchUp::Nothing
}

#[cfg(test)]
mod tests {
    use super::*;

    fn version(ids: &[u64]) -> ShardVersion {
        let mut v = ShardVersion::default();
        for &id in ids {
            v.insert(id);
        }
        v
    }

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

    #[test]
    fn folding_keeps_the_digest_and_remembers_the_ids() {
        let mut a = version(&[1, 2, 3, 4]);
        let b = a.clone();
        a.fold([2, 4, 7]);
        assert_eq!(a.digest(), b.digest(), "folding is invisible in the digest");
        assert_eq!(a.count(), 4);
        assert_eq!(a.since().collect::<Vec<_>>(), vec![1, 3]);
        assert!(
            a.contains(2) && a.keeps(2),
            "folded, remembered, its payload still kept"
        );
        a.release(2);
        assert!(
            a.contains(2) && !a.keeps(2),
            "released: remembered, not kept"
        );
        assert!(
            !a.insert(2),
            "a late copy of a folded update is not applied again"
        );
        // Folding at different points, the same set: the same digest.
        let mut c = version(&[3, 1]);
        c.fold_all();
        c.insert(4);
        c.insert(2);
        assert_eq!(c.digest(), a.digest());
        assert_ne!(c, a, "different folds, one version");
    }

    #[test]
    fn the_remembered_ids_are_bounded() {
        let mut v = ShardVersion::default();
        for id in 0..(RECENT_FOLDED as u64 + 10) {
            v.insert(id);
            v.fold_all();
        }
        assert_eq!(v.count(), RECENT_FOLDED as u64 + 10);
        assert!(!v.contains(0) && v.contains(RECENT_FOLDED as u64 + 9));
    }

    #[test]
    fn a_version_survives_the_wire_and_a_lying_one_is_refused() {
        let mut v = version(&[5, 6, 7]);
        v.fold([5]);
        let bytes = postcard::to_allocvec(&v).expect("encodes");
        let back: ShardVersion = postcard::from_bytes(&bytes).expect("decodes");
        assert_eq!(back, v);
        assert_eq!(back.digest(), v.digest());
        let twice = VersionWire {
            folded: Folded::default(),
            recent: vec![],
            since: vec![8, 8],
            kept: vec![],
        };
        let bytes = postcard::to_allocvec(&twice).expect("encodes");
        assert!(postcard::from_bytes::<ShardVersion>(&bytes).is_err());
        let many = VersionWire {
            folded: Folded::default(),
            recent: vec![],
            since: (0..RECENT_FOLDED as u64 + 1).collect(),
            kept: vec![],
        };
        let bytes = postcard::to_allocvec(&many).expect("encodes");
        assert!(postcard::from_bytes::<ShardVersion>(&bytes).is_err());
    }

    #[test]
    fn the_fold_is_due_at_a_count_or_a_share_of_the_blob() {
        let mut v = version(&[1]);
        assert!(!v.fold_due(10, 1000));
        assert!(v.fold_due(51, 1000), "past 5% of the blob");
        for id in 2..=MAX_SINCE as u64 {
            v.insert(id);
        }
        assert!(v.fold_due(0, 1000));
        v.fold_all();
        assert!(!v.fold_due(1 << 40, 1000), "nothing kept, nothing to fold");
    }

    #[test]
    fn an_update_beside_a_fold_must_fit_the_budget_and_the_count() {
        let mut v = version(&[1]);
        // A blob of 1000: 8% is 80 bytes.
        assert!(v.room_beside_fold(40, 40, 1000));
        assert!(!v.room_beside_fold(40, 41, 1000), "past 8% of the blob");
        for id in 2..=MAX_SINCE as u64 {
            v.insert(id);
        }
        assert!(!v.room_beside_fold(0, 0, 1000), "MAX_SINCE kept already");
    }

    #[test]
    fn folded_payloads_are_released_oldest_first_to_fit_the_budget() {
        let mut v = version(&[1, 2, 3, 4]);
        v.fold([2, 1, 3]);
        // 10 bytes each, a blob of 400: 8% is 32 bytes, three payloads fit, four do not.
        assert_eq!(v.to_release(400, 0, |_| 10, &[]), vec![2]);
        assert_eq!(
            v.to_release(400, 10, |_| 10, &[]),
            vec![2, 1],
            "room for one more"
        );
        assert_eq!(v.to_release(10_000, 0, |_| 10, &[]), Vec::<u64>::new());
        assert_eq!(
            v.to_release(100, 0, |_| 10, &[]),
            vec![2, 1, 3],
            "since-payloads stay"
        );
    }

    #[test]
    fn the_newest_payloads_a_live_holder_lacks_stay_while_they_fit() {
        // Updates 1..=6 applied in that order, 1..=5 folded; 10 bytes each, a blob of 200:
        // the usual budget (8%) keeps one payload, the lag budget (25%) five.
        let mut v = version(&[1, 2, 3, 4, 5]);
        v.fold([1, 2, 3, 4, 5]);
        v.insert(6);
        let all_but_newest = vec![1, 2, 3, 4, 5];
        assert_eq!(v.to_release(200, 0, |_| 10, &[]), all_but_newest);
        assert_eq!(
            v.to_release(200, 0, |_| 10, &[0]),
            all_but_newest,
            "a holder at this version needs nothing"
        );
        assert_eq!(
            v.to_release(200, 0, |_| 10, &[1]),
            all_but_newest,
            "one behind: it lacks only update 6, kept anyway"
        );
        assert_eq!(
            v.to_release(200, 0, |_| 10, &[3]),
            vec![1, 2, 3],
            "three behind: 4, 5 and 6 stay"
        );
        assert_eq!(
            v.to_release(200, 0, |_| 10, &[5, 2]),
            vec![1],
            "the largest lag that fits is served"
        );
        assert_eq!(
            v.to_release(200, 0, |_| 10, &[9, 2]),
            vec![1, 2, 3, 4],
            "a lag past what fits gets nothing (it rebuilds); the smaller one is served"
        );
        assert_eq!(
            v.to_release(200, 20, |_| 10, &[3]),
            vec![1, 2, 3],
            "an incoming payload takes its room from the lag budget"
        );
        assert_eq!(
            v.to_release(200, 20, |_| 10, &[4]),
            all_but_newest,
            "beside an incoming payload, four behind no longer fits"
        );
        // Payloads larger than the blob (a small model's adapters): the newest few stay all
        // the same, up to LAG_KEEP_UPDATES with the one since the snapshot.
        assert_eq!(v.to_release(10, 0, |_| 100, &[3]), vec![1, 2, 3]);
        assert_eq!(
            v.to_release(10, 0, |_| 100, &[LAG_KEEP_UPDATES as u64 + 1]),
            all_but_newest,
            "past LAG_KEEP_UPDATES only the bytes could make room"
        );
    }

    #[test]
    fn catching_up_replays_what_the_peer_keeps_and_rebuilds_when_it_folded_more() {
        let mut peer = version(&[1, 2, 3, 4, 5]);
        peer.fold([1, 2, 3]);
        peer.release(1);
        peer.release(2);
        // A folded update whose payload the peer still keeps is replayed too.
        assert_eq!(
            plan_catch_up(&version(&[1, 2]), &peer),
            CatchUp::Replay(vec![4, 5, 3])
        );
        peer.release(3);
        // Behind by what the peer keeps: replay it.
        assert_eq!(
            plan_catch_up(&version(&[1, 2, 3]), &peer),
            CatchUp::Replay(vec![4, 5])
        );
        // Behind by a folded update: replaying cannot reach the peer.
        assert_eq!(plan_catch_up(&version(&[1, 2]), &peer), CatchUp::Rebuild);
        // Ahead or equal: nothing.
        assert_eq!(
            plan_catch_up(&version(&[1, 2, 3, 4, 5, 6]), &peer),
            CatchUp::Nothing
        );
        assert_eq!(
            plan_catch_up(&version(&[1, 2, 3, 4, 5]), &peer),
            CatchUp::Nothing
        );
        // Ahead by one and missing one the peer keeps: take it.
        assert_eq!(
            plan_catch_up(&version(&[1, 2, 3, 4, 9]), &peer),
            CatchUp::Replay(vec![5])
        );
        // One count, different folded sets: exactly one of the two rebuilds.
        let mut a = version(&[1, 2, 7]);
        a.fold_all();
        let mut b = version(&[1, 2, 8]);
        b.fold_all();
        let plans = [plan_catch_up(&a, &b), plan_catch_up(&b, &a)];
        assert_eq!(
            plans.iter().filter(|p| **p == CatchUp::Rebuild).count(),
            1,
            "{plans:?}"
        );
        assert!(plans.contains(&CatchUp::Nothing));
    }
}
