//! Keys and certificates on disk: the mesh's key (made at genesis, kept by whoever runs the
//! mesh: `mesh.key` in the seed's or `up`'s data dir), a node's or a leader's identity, and the
//! certificate by which the mesh's key admits it (`trainer.cert` beside the identity).

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use libp2p::PeerId;
use libp2p::identity::Keypair;
use node_core::holder::wall_ms;
use node_core::lead::Signer;
use node_core::learn::{Certificate, MeshKey, Power};
use node_core::mesh::ModelManifest;

/// The mesh key's file in a genesis data dir.
pub const MESH_KEY_FILE: &str = "mesh.key";

/// A certificate's file beside the identity it admits.
pub const CERT_FILE: &str = "trainer.cert";

/// How long a certificate admits its peer unless told otherwise.
pub const DEFAULT_VALIDITY: Duration = Duration::from_secs(30 * 24 * 3600);

/// Writes a secret to `path` readable by its owner only, through a temporary file and a rename.
fn write_secret(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let tmp = path.with_extension("tmp");
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    let mut f = options
        .open(&tmp)
        .with_context(|| format!("creating {}", tmp.display()))?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("renaming to {}", path.display()))
}

/// The libp2p key in `path`.
pub fn read_key(path: &Path) -> Result<Keypair> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    Keypair::from_protobuf_encoding(&bytes)
        .with_context(|| format!("{} is not a libp2p key", path.display()))
}

/// The libp2p key in `path`, made there (ed25519, owner-only) when the file does not exist.
pub fn key_file(path: &Path) -> Result<Keypair> {
    if path.exists() {
        return read_key(path);
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let key = Keypair::generate_ed25519();
    write_secret(path, &key.to_protobuf_encoding()?)?;
    Ok(key)
}

/// A certificate signed by the mesh key `mesh` admitting `peer` (named `name`) with `powers`
/// for `valid_for` from now.
pub fn admit(
    mesh: &Keypair,
    peer: PeerId,
    name: &str,
    valid_for: Duration,
    powers: &[Power],
) -> Result<Certificate> {
    let not_after = (wall_ms() / 1000).saturating_add(valid_for.as_secs());
    let serial = rand_webrtc::random::<u64>();
    Ok(Certificate::issue(
        mesh, peer, name, serial, not_after, powers,
    )?)
}

/// The certificate in `path`, if there is one.
pub fn read_cert(path: &Path) -> Result<Option<Certificate>> {
    if !path.exists() {
        return Ok(None);
    }
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(Some(Certificate::from_bytes(&bytes).with_context(
        || format!("{} is not a certificate", path.display()),
    )?))
}

/// Writes `cert` to `path`.
pub fn write_cert(path: &Path, cert: &Certificate) -> Result<()> {
    write_secret(path, &cert.to_bytes())
}

/// Who `key` signs as on the mesh `manifest` describes, with the certificate in `cert` (if
/// any): says on stderr what the mesh admits it to do, and why not when the certificate is
/// not this mesh's, not for this key or expired (its updates would be refused).
pub fn signer(key: Keypair, cert: Option<Certificate>, manifest: &ModelManifest) -> Signer {
    let peer = key.public().to_peer_id();
    let Some(cert) = cert else {
        return Signer::unadmitted(key);
    };
    let checked = manifest
        .mesh_key()
        .and_then(|mesh| cert.verify(&mesh, &peer, Power::Write, Some(wall_ms() / 1000)));
    match checked {
        Ok(body) => eprintln!(
            "admitted by the mesh's key as {:?} until {} (unix seconds): this node may publish learning updates",
            body.name, body.not_after
        ),
        Err(e) => {
            eprintln!(
                "the certificate does not admit this node ({e}): its updates would be refused"
            );
            return Signer::unadmitted(key);
        }
    }
    Signer {
        key,
        cert: Some(cert),
    }
}

/// The mesh key of a manifest, checked against the key file that should hold its secret.
pub fn check_mesh_key(manifest: &ModelManifest, key: &Keypair) -> Result<()> {
    if manifest.mesh_key()? != MeshKey::of(key) {
        bail!("this mesh key is not the one the mesh's manifest names");
    }
    Ok(())
}
