//! What a row holder keeps and answers with, shared by the native and the browser node: its
//! shard and the updates applied to it, the rules an update must satisfy, shard blobs, the
//! piece-by-piece download of a blob from a peer, how a node obtains its row ([`join`]) and how
//! it answers its peers ([`route`]), written once over the [`Link`] each shell implements.

mod catchup;
mod join;
mod report;
mod rules;
mod seen;
mod serve;
pub mod spread;

pub use crate::chain::{Running, Turn};
pub use catchup::{Ahead, catch_up_source, fetch_update, plan_with, version_of, worth_catching_up};
pub use join::{Joined, Link, answer_chain, join, obtain, source_error, source_peer};
pub use report::{MAX_REPORT_BYTES, Report, open_report, sign_report};
pub use rules::{
    CLOCK_SKEW_MS, Checked, MAX_UPDATE_AGE_MS, REFUSED, Refusal, Refused, Rules, Sender,
    gate_holds, wall_ms,
};
pub use seen::{
    KeyShare, LearningStatus, MAX_KEYS_SHOWN, MAX_SEEN_TEXT, UPDATES_SEEN, UpdateLog, UpdateSeen,
};
pub use serve::{
    Held, LEARN_PER_MINUTE, LearnLimit, Route, Snapshot, ViewQuery, answer_view, chain, contribute,
    receipt, route, step, step_async,
};
pub use spread::{
    FANOUT, Notice, Opened, PIECE_BYTES, Passed, PieceList, deal, pass_on, pass_report, pull, tell,
};

use crate::blob::{self, BlobError, BlobParams};
use crate::coded::{CodedError, Member, ShardSet};
use crate::learn::{Update, UpdateError};
use crate::mesh::{MAX_CHUNK_BYTES, MeshRequest, MeshResponse, ModelManifest, ShardVersion};
use crate::model::{LeaderWeights, LlamaConfig};

/// Largest update payload any mesh accepts, whatever its manifest (a mesh's own bound,
/// [`Rules::max_sealed`], is far smaller: 5 MB for SmolLM2's adapters).
pub const MAX_UPDATE_BYTES: u64 = 256 << 20;

/// Largest shard blob accepted from a peer.
pub const MAX_BLOB_BYTES: u64 = 1 << 36;

/// Errors of a row holder.
#[derive(Debug, thiserror::Error)]
pub enum HolderError {
    /// A learning update is malformed, badly signed or breaks the mesh's rules.
    #[error(transparent)]
    Update(#[from] UpdateError),
    /// An update payload is over [`MAX_UPDATE_BYTES`].
    #[error("update of {0} bytes exceeds the limit of {MAX_UPDATE_BYTES}")]
    UpdateTooLarge(usize),
    /// The mesh's rules refuse an update (counted by reason in [`REFUSED`]).
    #[error(transparent)]
    Refused(#[from] Refused),
    /// A shard blob is damaged beyond repair.
    #[error("shard blob: {0}")]
    Blob(#[from] BlobError),
    /// The shard could not be (de)serialized.
    #[error("{0}")]
    Shard(String),
    /// The shard does not belong where it is used.
    #[error("{0}")]
    Mismatch(String),
    /// Uploading the changed shard to the GPU failed.
    #[error(transparent)]
    Coded(#[from] CodedError),
    /// A peer's answer broke the download protocol.
    #[error("{0}")]
    Download(String),
    /// A peer could not be reached or did not answer.
    #[error("{0}")]
    Link(String),
    /// Building a row along a chain of holders failed.
    #[error(transparent)]
    Chain(#[from] crate::chain::ChainError),
}

/// A shard and the updates applied to it.
#[derive(Debug)]
pub struct ShardState {
    /// The member serving the shard.
    pub member: Member,
    /// Updates applied.
    pub version: ShardVersion,
    /// The replicated norm gains at this version (every node updates its own copy).
    pub norms: LeaderWeights,
    /// Updates still to record without applying to the shard (an injected fault).
    pub skip_updates: u64,
}

impl ShardState {
    /// Applies a checked update once: true when applied now, false when it already was.
    pub fn apply(&mut self, update: &Update, id: u64) -> Result<bool, HolderError> {
        if self.version.contains(id) {
            return Ok(false);
        }
        if self.skip_updates > 0 {
            // An injected fault: the version claims the update, the shard does not have it.
            self.skip_updates -= 1;
            update.validate(&self.member.shards().cfg)?;
            tracing::warn!(
                id = format!("{id:016x}"),
                "fault injected: recording an update without applying it"
            );
        } else {
            self.member.learn(|s| update.apply_to_shards(s))?;
            self.member.sync_gpu()?;
        }
        update.apply_to_norms(&mut self.norms);
        self.version.insert(id);
        Ok(true)
    }

    /// Takes a rebuilt row in place of the shard ([`obtain`]): its values, the version they
    /// are at and the norm gains there.
    pub fn replace(
        &mut self,
        shard: ShardSet,
        version: ShardVersion,
        norms: LeaderWeights,
    ) -> Result<(), HolderError> {
        let row = self.member.shards().node;
        if shard.node != row {
            return Err(HolderError::Mismatch(format!(
                "a rebuilt row {} cannot replace row {row}",
                shard.node
            )));
        }
        *self.member.shards_mut() = shard;
        self.member.sync_gpu()?;
        self.version = version;
        self.norms = norms;
        Ok(())
    }

    /// The refusal of a step at `version` when this node is at another one.
    pub fn stale(&self, version: &[u8; 32]) -> Option<MeshResponse> {
        let have = self.version.digest();
        (have != *version).then(|| MeshResponse::Stale {
            have,
            updates: self.version.count(),
            want: *version,
        })
    }
}

/// The layout of a shard set in a blob; a release that changes it changes this (2: compact
/// shards carry their learnt adapters; 3: of rank 8, not 16; 4: the model's config names its
/// family and RoPE factors; 5: the manifest beside it names the mesh's key and canary
/// reference; 6: adapters of rank 16, the MLP's alone where only they learnt).
pub const SHARD_LAYOUT: u32 = 6;

/// A shard set as a blob (hashed chunks with parity).
pub fn shard_to_blob(shard: &ShardSet) -> Result<Vec<u8>, HolderError> {
    let payload = postcard::to_allocvec(shard)
        .map_err(|e| HolderError::Shard(format!("serializing: {e}")))?;
    Ok(blob::encode_blob(&payload, &BlobParams::default())?)
}

/// A shard set from a blob (untrusted bytes: checked, repaired where parity allows).
pub fn shard_from_blob(bytes: &[u8]) -> Result<ShardSet, HolderError> {
    let decoded = blob::decode_blob(bytes)?;
    if decoded.repaired_chunks > 0 {
        tracing::warn!(
            chunks = decoded.repaired_chunks,
            "repaired damaged chunks of a shard blob"
        );
    }
    postcard::from_bytes(&decoded.payload).map_err(|e| {
        HolderError::Shard(format!(
            "parsing the shard (layout {SHARD_LAYOUT}; a blob of another release?): {e}"
        ))
    })
}

/// A shard set from a blob read from `source` a group of chunks at a time (untrusted bytes:
/// checked, repaired where parity allows), so that loading a row never holds its blob or its
/// payload whole, only the shard set it builds.
pub fn shard_from_reader<R: std::io::Read + std::io::Seek>(
    source: R,
) -> Result<ShardSet, HolderError> {
    let mut reader = blob::BlobReader::new(source)?;
    // Every value, packed integers included, is read a value at a time: the scratch holds
    // only the config's strings.
    let mut scratch = vec![0u8; 1 << 20];
    let buffered = std::io::BufReader::with_capacity(1 << 20, &mut reader);
    let parsed = postcard::from_io::<ShardSet, _>((buffered, &mut scratch));
    let shard = parsed.map(|(s, _)| s).map_err(|e| {
        HolderError::Shard(format!(
            "parsing the shard (layout {SHARD_LAYOUT}; a blob of another release?): {e}"
        ))
    })?;
    let repaired = reader.finish()?;
    if repaired > 0 {
        tracing::warn!(chunks = repaired, "repaired damaged chunks of a shard blob");
    }
    Ok(shard)
}

/// Checks that `shard` is row `row` of the mesh `manifest` describes.
pub fn check_shard(
    shard: &ShardSet,
    manifest: &ModelManifest,
    row: u32,
) -> Result<(), HolderError> {
    let fail = |s: String| Err(HolderError::Mismatch(s));
    if shard.node != row as usize {
        return fail(format!(
            "the shard is row {}, expected row {row}",
            shard.node
        ));
    }
    if shard.generator != manifest.generator {
        return fail("the shard was encoded with another code than the mesh's".into());
    }
    if shard.cfg != manifest.cfg {
        return fail("the shard belongs to another model".into());
    }
    if shard.embed.format() != manifest.format {
        return fail(format!(
            "the shard is stored as {:?}, the mesh as {:?}",
            shard.embed.format(),
            manifest.format
        ));
    }
    shard
        .check_shapes()
        .or_else(|e| fail(format!("the shard is malformed: {e}")))
}

/// The version and norm gains of a shard copied or re-encoded from a source whose blob was at
/// `at`, from that source's answers to [`MeshRequest::Norms`] and [`MeshRequest::Versions`]:
/// both must still be at `at`. The updates the source kept are folded: they are inside the
/// copied shard, and this node has none of their payloads.
pub fn version_from_source(
    at: [u8; 32],
    norms: MeshResponse,
    versions: MeshResponse,
    cfg: &LlamaConfig,
) -> Result<(ShardVersion, LeaderWeights), HolderError> {
    let MeshResponse::Norms { version, norms } = norms else {
        return Err(HolderError::Download(format!(
            "asked for the norm gains, got {}",
            describe(&norms)
        )));
    };
    if version != at || !norms.fits(cfg) {
        return Err(HolderError::Download(
            "the source's norm gains are not at the shard's version; try again".into(),
        ));
    }
    let MeshResponse::Versions(mut applied) = versions else {
        return Err(HolderError::Download(format!(
            "asked for versions, got {}",
            describe(&versions)
        )));
    };
    if applied.digest() != at {
        return Err(HolderError::Download(
            "the source's version moved while this node copied its row; try again".into(),
        ));
    }
    applied.fold_all();
    Ok((applied, norms))
}

/// The piece of `blob` a `Chunk` request asks for, as the answer.
pub fn chunk_of(blob: &[u8], version: [u8; 32], offset: u64, len: u32) -> MeshResponse {
    let len = len.min(MAX_CHUNK_BYTES);
    let total = blob.len() as u64;
    let start = offset.min(total) as usize;
    let end = (start + len as usize).min(blob.len());
    MeshResponse::Chunk {
        total,
        version,
        bytes: blob[start..end].to_vec(),
    }
}

/// A short name of an answer's kind, for errors.
pub fn describe(r: &MeshResponse) -> &'static str {
    match r {
        MeshResponse::Info(_) => "info",
        MeshResponse::Manifest(_) => "manifest",
        MeshResponse::Join(_) => "join offer",
        MeshResponse::Chunk { .. } => "chunk",
        MeshResponse::Step { .. } => "step",
        MeshResponse::Versions { .. } => "version list",
        MeshResponse::Learned { .. } => "learning receipt",
        MeshResponse::Norms { .. } => "norm gains",
        MeshResponse::Reported => "report receipt",
        MeshResponse::Spreading { .. } => "notice receipt",
        MeshResponse::Partial(_) => "running sum",
        MeshResponse::IntPartial(_) => "integer running sum",
        MeshResponse::CompactPiece(_) => "compact piece",
        MeshResponse::Error(_) => "error",
        MeshResponse::Stale { .. } => "refusal at another version",
        MeshResponse::Taught => "teaching receipt",
    }
}

/// A blob downloaded piece by piece from one peer: the total and the version must stay the
/// same throughout, and the total under a limit.
#[derive(Debug)]
pub struct Download {
    out: Vec<u8>,
    total: Option<u64>,
    version: Option<[u8; 32]>,
    limit: u64,
}

impl Download {
    /// A download of at most `limit` bytes.
    pub fn new(limit: u64) -> Self {
        Self {
            out: Vec::new(),
            total: None,
            version: None,
            limit,
        }
    }

    /// The offset the next request asks for.
    pub fn offset(&self) -> u64 {
        self.out.len() as u64
    }

    /// The size the peer announced, once it answered.
    pub fn total(&self) -> Option<u64> {
        self.total
    }

    /// Takes the peer's answer to the request at [`Self::offset`]: true once complete.
    pub fn accept(&mut self, resp: MeshResponse) -> Result<bool, HolderError> {
        let fail = |s: String| Err(HolderError::Download(s));
        let offset = self.offset();
        let (t, bytes, v) = match resp {
            MeshResponse::Chunk {
                total,
                bytes,
                version,
            } => (total, bytes, version),
            MeshResponse::Error(e) => return fail(format!("the peer answered: {e}")),
            other => return fail(format!("asked for a chunk, got a {}", describe(&other))),
        };
        if *self.version.get_or_insert(v) != v {
            return fail("the peer's data changed version mid-transfer".into());
        }
        if t > self.limit {
            return fail(format!(
                "the peer announces {t} bytes, over the limit of {}",
                self.limit
            ));
        }
        if *self.total.get_or_insert(t) != t {
            return fail("the peer changed the size mid-transfer".into());
        }
        if bytes.len() > MAX_CHUNK_BYTES as usize {
            return fail("the peer sent an oversized chunk".into());
        }
        if bytes.is_empty() && offset < t {
            return fail(format!("the peer sent an empty chunk at {offset} of {t}"));
        }
        if self.out.is_empty() {
            self.out.reserve(t.min(1 << 30) as usize);
        }
        self.out.extend_from_slice(&bytes);
        Ok(self.out.len() as u64 >= t)
    }

    /// The bytes and the version they are at.
    pub fn finish(self) -> (Vec<u8>, [u8; 32]) {
        (self.out, self.version.unwrap_or_default())
    }
}

/// The request for piece `offset` of row `row`'s shard blob.
pub fn shard_chunk_request(row: u32, offset: u64) -> MeshRequest {
    MeshRequest::Chunk {
        row,
        offset,
        len: crate::mesh::CHUNK_BYTES,
    }
}

/// The request for piece `offset` of update `id`'s payload.
pub fn update_chunk_request(id: u64, offset: u64) -> MeshRequest {
    MeshRequest::UpdateChunk {
        id,
        offset,
        len: crate::mesh::CHUNK_BYTES,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

    use super::*;
    use crate::coded::ShardFormat;

    fn chunk(total: u64, version: u8, bytes: &[u8]) -> MeshResponse {
        MeshResponse::Chunk {
            total,
            version: [version; 32],
            bytes: bytes.to_vec(),
        }
    }

    #[test]
    fn a_download_assembles_pieces_and_refuses_a_peer_that_changes_its_story() {
        let blob: Vec<u8> = (0..10u8).collect();
        let mut d = Download::new(100);
        assert!(!d.accept(chunk_of(&blob, [7; 32], d.offset(), 4)).unwrap());
        assert!(!d.accept(chunk_of(&blob, [7; 32], d.offset(), 4)).unwrap());
        assert!(d.accept(chunk_of(&blob, [7; 32], d.offset(), 4)).unwrap());
        assert_eq!(d.finish(), (blob, [7; 32]));

        let mut d = Download::new(100);
        d.accept(chunk(10, 1, &[0; 4])).unwrap();
        let e = d.accept(chunk(10, 2, &[0; 4])).unwrap_err().to_string();
        assert!(e.contains("changed version"), "{e}");

        let mut d = Download::new(100);
        d.accept(chunk(10, 1, &[0; 4])).unwrap();
        let e = d.accept(chunk(12, 1, &[0; 4])).unwrap_err().to_string();
        assert!(e.contains("changed the size"), "{e}");

        let e = Download::new(5).accept(chunk(10, 1, &[0; 4])).unwrap_err();
        assert!(e.to_string().contains("over the limit"), "{e}");
        let e = Download::new(100).accept(chunk(10, 1, &[])).unwrap_err();
        assert!(e.to_string().contains("empty chunk"), "{e}");
        let e = Download::new(100)
            .accept(MeshResponse::Error("no".into()))
            .unwrap_err();
        assert!(e.to_string().contains("answered: no"), "{e}");
    }

    #[test]
    fn a_shard_blob_round_trips_and_a_cut_one_is_refused() {
        let w =
            crate::model::ModelWeights::synthetic(crate::model::LlamaConfig::small(), 1).unwrap();
        let g = crate::code::Generator::cauchy(5, 3).unwrap();
        let shard = ShardSet::encode(&w, &g, 1, Default::default(), &mut |_, _| {}).unwrap();
        let blob = shard_to_blob(&shard).unwrap();
        let back = shard_from_blob(&blob).unwrap();
        assert_eq!(shard_to_blob(&back).unwrap(), blob);
        let mut bad = blob.clone();
        bad.truncate(bad.len() / 2);
        assert!(shard_from_blob(&bad).is_err());
    }

    /// A compact parity row (packed integers) and a data row, each with a learnt adapter, read
    /// from a file-like source a group of chunks at a time, are the shard sets written; a damaged chunk is repaired
    /// and a cut blob refused.
    #[test]
    fn a_shard_read_from_a_reader_is_the_one_written() {
        let w =
            crate::model::ModelWeights::synthetic(crate::model::LlamaConfig::small(), 1).unwrap();
        let g = crate::code::Generator::integer(4, 2, None).unwrap();
        for row in [0, 3] {
            let mut shard = ShardSet::encode(&w, &g, row, ShardFormat::Q8, &mut |_, _| {}).unwrap();
            // A row that has learnt: an adapter larger than the reader's scratch.
            shard.embed.adapter.a = (0..400_000).map(|i| i as f32 * 0.25).collect();
            let mut blob = shard_to_blob(&shard).unwrap();
            let back = shard_from_reader(std::io::Cursor::new(&blob)).unwrap();
            assert_eq!(back, shard, "row {row}");
            let middle = blob.len() / 2;
            blob[middle] ^= 0x5a;
            let back = shard_from_reader(std::io::Cursor::new(&blob)).unwrap();
            assert_eq!(back, shard, "row {row}, repaired");
            blob.truncate(blob.len() / 2);
            assert!(shard_from_reader(std::io::Cursor::new(&blob)).is_err());
        }
    }
}
