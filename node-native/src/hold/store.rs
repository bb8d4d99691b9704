//! A node's data directory: its identity, WebRTC certificate, the model manifest and its shard,
//! each written atomically; the manifest and shard as checksummed, erasure-protected blobs.

use std::fs;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use libp2p::identity::Keypair;
use node_core::blob::{self, BlobParams};
use node_core::coded::ShardSet;
use node_core::mesh::ModelManifest;

/// A node's data directory.
#[derive(Debug, Clone)]
pub struct DataDir {
    root: PathBuf,
}

/// The shard blob, and what it holds beside it.
const SHARD: &str = "shard.blob";
const BASE: &str = "base.bin";
/// The pair being written by [`DataDir::save_row`].
const SHARD_NEXT: &str = "shard.blob.next";
const BASE_NEXT: &str = "base.bin.next";
/// A shard set's payload while [`DataDir::save_shard_set`] encodes it into the blob.
const PAYLOAD_NEXT: &str = "shard.payload.next";

/// Writes `bytes` to `path` and waits until they are on disk.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let mut f = fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .with_context(|| format!("writing {}", path.display()))
}

/// Writes `bytes` to `path` through a temporary file and a rename, so a crash leaves either
/// the old file or the new one.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
    fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))
}

impl DataDir {
    /// Opens (creating if needed) a data directory.
    pub fn open(root: &Path) -> Result<Self> {
        fs::create_dir_all(root)
            .with_context(|| format!("creating data dir {}", root.display()))?;
        Ok(Self {
            root: root.to_path_buf(),
        })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.root
    }

    fn file(&self, name: &str) -> PathBuf {
        self.root.join(name)
    }

    /// The node's libp2p identity, created on first use so the peer id survives restarts.
    pub fn identity(&self) -> Result<Keypair> {
        crate::hold::trust::key_file(&self.file("identity.key"))
    }

    /// The certificate by which the mesh's key admits this node, if it has one.
    pub fn cert(&self) -> Result<Option<node_core::learn::Certificate>> {
        crate::hold::trust::read_cert(&self.file(crate::hold::trust::CERT_FILE))
    }

    /// Keeps the certificate by which the mesh's key admits this node.
    pub fn save_cert(&self, cert: &node_core::learn::Certificate) -> Result<()> {
        crate::hold::trust::write_cert(&self.file(crate::hold::trust::CERT_FILE), cert)
    }

    /// The mesh's key, where this is the data dir genesis made it in.
    pub fn mesh_key_path(&self) -> PathBuf {
        self.file(crate::hold::trust::MESH_KEY_FILE)
    }

    /// The WebRTC certificate, created on first use so the certhash survives restarts.
    pub fn webrtc_certificate(&self) -> Result<libp2p_webrtc::tokio::Certificate> {
        let path = self.file("webrtc.pem");
        if path.exists() {
            let pem = fs::read_to_string(&path)?;
            return libp2p_webrtc::tokio::Certificate::from_pem(&pem)
                .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()));
        }
        let cert = libp2p_webrtc::tokio::Certificate::generate(&mut rand_webrtc::rng())
            .map_err(|e| anyhow::anyhow!("generating a WebRTC certificate: {e}"))?;
        write_atomic(&path, cert.serialize_pem().as_bytes())?;
        Ok(cert)
    }

    /// Saves the manifest (as a blob).
    pub fn save_manifest(&self, bytes: &[u8]) -> Result<()> {
        let blob = blob::encode_blob(bytes, &BlobParams::default())?;
        write_atomic(&self.file("manifest.blob"), &blob)
    }

    /// The saved manifest and its bytes, if there is one.
    pub fn manifest(&self) -> Result<Option<(ModelManifest, Vec<u8>)>> {
        let path = self.file("manifest.blob");
        if !path.exists() {
            return Ok(None);
        }
        let decoded = blob::decode_blob(&fs::read(&path)?)
            .with_context(|| format!("reading {}", path.display()))?;
        let manifest = ModelManifest::from_bytes(&decoded.payload)?;
        Ok(Some((manifest, decoded.payload)))
    }

    /// Path of the shard blob.
    pub fn shard_path(&self) -> PathBuf {
        self.file(SHARD)
    }

    /// Saves a genesis shard blob (already encoded): the row at the genesis version.
    pub fn save_shard_blob(&self, blob: &[u8]) -> Result<()> {
        write_atomic(&self.shard_path(), blob)
    }

    /// Takes a genesis shard blob written elsewhere on the same file system (moved, not
    /// copied): the row at the genesis version.
    pub fn adopt_shard_file(&self, blob: &Path) -> Result<()> {
        fs::rename(blob, self.shard_path())
            .with_context(|| format!("moving {} into {}", blob.display(), self.root.display()))
    }

    /// Saves a shard blob together with `base` (what the blob holds), so that a crash at any
    /// point leaves the old pair or the new one: both are written beside the old ones, then
    /// renamed in turn, and [`Self::recover`] finishes or undoes an interrupted save.
    pub fn save_row(&self, blob: &[u8], base: &[u8]) -> Result<()> {
        self.save_row_with(
            |f| {
                use std::io::Write;
                Ok(f.write_all(blob)?)
            },
            base,
        )
    }

    /// [`Self::save_row`] with the blob written by `write` straight to its file, and the
    /// shard set `shard` encoded into it a group of chunks at a time: neither its payload nor
    /// its blob is ever in memory whole. Returns the blob's bytes.
    pub fn save_shard_set(&self, shard: &ShardSet, base: &[u8]) -> Result<u64> {
        use std::io::{BufReader, BufWriter, Write};
        let payload = self.file(PAYLOAD_NEXT);
        let len = {
            let f = fs::File::create(&payload)
                .with_context(|| format!("creating {}", payload.display()))?;
            let mut w = postcard::to_io(shard, BufWriter::new(f))
                .with_context(|| format!("writing {}", payload.display()))?;
            w.flush()?;
            w.get_ref().metadata()?.len()
        };
        let saved = self.save_row_with(
            |out| {
                let mut reader = BufReader::new(fs::File::open(&payload)?);
                let mut w = BufWriter::new(out);
                blob::encode_blob_to(&mut reader, len, &BlobParams::default(), &mut w)?;
                Ok(w.flush()?)
            },
            base,
        );
        fs::remove_file(&payload).with_context(|| format!("removing {}", payload.display()))?;
        saved?;
        Ok(fs::metadata(self.shard_path())?.len())
    }

    /// [`Self::save_row`], the blob written to its (new) file by `write`.
    fn save_row_with(
        &self,
        write: impl FnOnce(&mut fs::File) -> Result<()>,
        base: &[u8],
    ) -> Result<()> {
        let (shard_next, base_next) = (self.file(SHARD_NEXT), self.file(BASE_NEXT));
        {
            let mut f = fs::File::create(&shard_next)
                .with_context(|| format!("creating {}", shard_next.display()))?;
            write(&mut f)
                .and_then(|()| Ok(f.sync_all()?))
                .with_context(|| format!("writing {}", shard_next.display()))?;
        }
        write_synced(&base_next, base)?;
        fs::rename(&shard_next, self.shard_path())
            .with_context(|| format!("renaming {}", shard_next.display()))?;
        fs::rename(&base_next, self.file(BASE))
            .with_context(|| format!("renaming {}", base_next.display()))?;
        if let Ok(dir) = fs::File::open(&self.root) {
            let _ = dir.sync_all();
        }
        Ok(())
    }

    /// Finishes or undoes a [`Self::save_row`] that a crash interrupted.
    fn recover(&self) -> Result<()> {
        let (shard_next, base_next) = (self.file(SHARD_NEXT), self.file(BASE_NEXT));
        if base_next.exists() && !shard_next.exists() {
            // The blob was renamed into place, its base was not yet.
            fs::rename(&base_next, self.file(BASE))
                .with_context(|| format!("renaming {}", base_next.display()))?;
            tracing::warn!("finished saving a snapshot that a stop interrupted");
        } else {
            for f in [shard_next, base_next, self.file(PAYLOAD_NEXT)] {
                if f.exists() {
                    fs::remove_file(&f).with_context(|| format!("removing {}", f.display()))?;
                }
            }
        }
        Ok(())
    }

    /// What the saved shard blob holds (written by [`Self::save_row`]); `None` for a genesis
    /// blob.
    pub fn base(&self) -> Result<Option<Vec<u8>>> {
        self.recover()?;
        let path = self.file(BASE);
        if !path.exists() {
            return Ok(None);
        }
        Ok(Some(
            fs::read(&path).with_context(|| format!("reading {}", path.display()))?,
        ))
    }

    /// The saved shard, checked and repaired if damaged, if there is one.
    pub fn shard(&self) -> Result<Option<ShardSet>> {
        self.recover()?;
        let path = self.shard_path();
        if !path.exists() {
            return Ok(None);
        }
        let reading = || format!("reading {}", path.display());
        // Read a group of chunks at a time: never the blob whole beside the shard.
        let f = fs::File::open(&path).with_context(reading)?;
        let shard = node_core::holder::shard_from_reader(f).with_context(reading)?;
        Ok(Some(shard))
    }

    /// Bytes of the saved shard blob (0 when there is none).
    pub fn shard_bytes(&self) -> u64 {
        fs::metadata(self.shard_path()).map_or(0, |m| m.len())
    }

    /// Reads `len` bytes of the shard blob at `offset` (for peers fetching it).
    pub fn shard_chunk(&self, offset: u64, len: u32) -> Result<(u64, Vec<u8>)> {
        read_chunk(&self.shard_path(), offset, len)
    }
}

/// Reads a byte range of a file, clamped to its end.
fn read_chunk(path: &Path, offset: u64, len: u32) -> Result<(u64, Vec<u8>)> {
    let mut f = fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let total = f.metadata()?.len();
    if offset > total {
        bail!("offset {offset} is past the end ({total} bytes)");
    }
    let n = (total - offset).min(u64::from(len)) as usize;
    let mut buf = vec![0u8; n];
    f.seek(SeekFrom::Start(offset))?;
    f.read_exact(&mut buf)?;
    Ok((total, buf))
}

pub use node_core::holder::{shard_from_blob, shard_to_blob};

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh directory under the system's temporary one, removed when dropped.
    struct Dir(PathBuf);

    impl Dir {
        fn new(name: &str) -> Self {
            let p = std::env::temp_dir().join(format!("codedmesh-{name}-{}", std::process::id()));
            let _ = fs::remove_dir_all(&p);
            Self(p)
        }
    }

    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn pair(d: &DataDir) -> (Vec<u8>, Vec<u8>) {
        let blob = fs::read(d.shard_path()).expect("blob");
        let base = d.base().expect("base").expect("a base");
        (blob, base)
    }

    #[test]
    fn a_shard_set_saved_a_group_of_chunks_at_a_time_is_the_blob_a_whole_save_makes() {
        use node_core::code::Generator;
        use node_core::coded::ShardFormat;
        use node_core::model::{LlamaConfig, ModelWeights};
        let dir = Dir::new("save-shard-set");
        let d = DataDir::open(&dir.0).expect("dir");
        let w = ModelWeights::synthetic(LlamaConfig::small(), 3).expect("model");
        let g = Generator::integer(5, 3, None).expect("code");
        // A data row (i8) and a parity row (i16, packed).
        for row in [0, 4] {
            let set = ShardSet::encode(&w, &g, row, ShardFormat::Q8, &mut |_, _| {}).expect("set");
            let bytes = d.save_shard_set(&set, b"base").expect("saved");
            let whole = shard_to_blob(&set).expect("blob");
            assert_eq!(pair(&d), (whole.clone(), b"base".to_vec()), "row {row}");
            assert_eq!(bytes, whole.len() as u64);
            assert_eq!(d.shard().expect("read back"), Some(set), "row {row}");
            assert!(
                !d.file(PAYLOAD_NEXT).exists(),
                "the payload's scratch file is gone"
            );
        }
    }

    #[test]
    fn a_saved_row_is_read_back_as_a_pair() {
        let dir = Dir::new("save-row");
        let d = DataDir::open(&dir.0).expect("dir");
        assert!(
            d.base().expect("base").is_none(),
            "a genesis blob has no base"
        );
        d.save_row(b"blob 1", b"base 1").expect("saved");
        d.save_row(b"blob 2", b"base 2").expect("saved");
        assert_eq!(pair(&d), (b"blob 2".to_vec(), b"base 2".to_vec()));
    }

    #[test]
    fn a_save_stopped_at_any_point_leaves_the_old_pair_or_the_new_one() {
        let dir = Dir::new("save-crash");
        let d = DataDir::open(&dir.0).expect("dir");
        d.save_row(b"old blob", b"old base").expect("saved");
        // Stopped while writing: both new files beside the old pair (or a part of them).
        fs::write(dir.0.join(SHARD_NEXT), b"new blob").expect("write");
        fs::write(dir.0.join(BASE_NEXT), b"new ba").expect("write");
        assert_eq!(pair(&d), (b"old blob".to_vec(), b"old base".to_vec()));
        assert!(!dir.0.join(SHARD_NEXT).exists() && !dir.0.join(BASE_NEXT).exists());
        // Stopped before the base was written at all.
        fs::write(dir.0.join(SHARD_NEXT), b"new blob").expect("write");
        assert_eq!(pair(&d), (b"old blob".to_vec(), b"old base".to_vec()));
        // Stopped between the two renames: the new blob is in place, its base not yet.
        fs::write(dir.0.join(BASE_NEXT), b"new base").expect("write");
        fs::write(d.shard_path(), b"new blob").expect("write");
        assert_eq!(pair(&d), (b"new blob".to_vec(), b"new base".to_vec()));
    }
}
