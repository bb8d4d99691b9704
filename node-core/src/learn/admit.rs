//! Who may write the model: a mesh key made at genesis, named in the manifest, signs the
//! certificates that admit a peer as a trainer (its updates are applied) or as a leader whose
//! reports others act on. Any holder checks a certificate against the manifest's key by
//! itself, asking no one (DESIGN.md §12); a self-signed or expired one admits nothing.

use libp2p::PeerId;
use libp2p::identity::{Keypair, PublicKey};
use serde::{Deserialize, Serialize};

/// Most bytes a certificate takes (a peer id, a short name, the numbers and a signature).
pub const MAX_CERT_BYTES: usize = 512;

/// Most characters of the name a certificate gives its peer.
pub const MAX_NAME_CHARS: usize = 64;

/// What a certificate signs over, before its body: no other signed thing of the mesh key's
/// can be taken for a certificate.
const DOMAIN: &[u8] = b"codedmesh certificate v1\0";

/// Why a certificate admits nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmitError {
    /// No certificate came with what needs one.
    #[error("no certificate: the signer is not admitted by the mesh's key")]
    Missing,
    /// The bytes are not a certificate.
    #[error("not a certificate: {0}")]
    Malformed(String),
    /// The mesh key did not sign it (a self-signed one, or another mesh's).
    #[error("the certificate is not signed by this mesh's key")]
    NotTheMesh,
    /// It admits another peer than the one that signed.
    #[error("the certificate admits {admits}, not the signer {signer}")]
    OtherPeer {
        /// The peer it admits.
        admits: String,
        /// The peer that signed.
        signer: String,
    },
    /// It has expired.
    #[error("the certificate expired at {0} (unix seconds)")]
    Expired(u64),
    /// It does not grant the power asked for.
    #[error("the certificate does not grant the power to {0}")]
    NoPower(&'static str),
}

/// What a certificate lets its peer do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Power {
    /// Publish learning updates that holders apply.
    Write,
    /// Report members it caught, which other holders act on.
    Report,
}

impl Power {
    fn name(self) -> &'static str {
        match self {
            Power::Write => "write the model",
            Power::Report => "report members",
        }
    }
}

/// What a certificate says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CertBody {
    /// The admitted peer's id, as bytes.
    pub peer: Vec<u8>,
    /// A name for people (who runs it).
    pub name: String,
    /// A number the mesh key's holder picked, to name this certificate.
    pub serial: u64,
    /// When it expires, in unix seconds.
    pub not_after: u64,
    /// What it lets the peer do.
    pub powers: Vec<Power>,
}

impl CertBody {
    /// The admitted peer.
    pub fn peer_id(&self) -> Result<PeerId, AdmitError> {
        PeerId::from_bytes(&self.peer).map_err(|e| AdmitError::Malformed(format!("peer id: {e}")))
    }
}

/// A certificate: its body, signed by the mesh key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Certificate {
    #[serde(with = "serde_bytes")]
    body: Vec<u8>,
    #[serde(with = "serde_bytes")]
    signature: Vec<u8>,
}

/// The mesh's public key, fixed at genesis: what every certificate is checked against.
#[derive(Debug, Clone, PartialEq)]
pub struct MeshKey(PublicKey);

impl MeshKey {
    /// The public half of the mesh's keypair.
    pub fn of(key: &Keypair) -> Self {
        Self(key.public())
    }

    /// The key as the manifest stores it (libp2p's protobuf form).
    pub fn to_bytes(&self) -> Vec<u8> {
        self.0.encode_protobuf()
    }

    /// The key from the manifest's bytes.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, AdmitError> {
        PublicKey::try_decode_protobuf(bytes)
            .map(Self)
            .map_err(|e| AdmitError::Malformed(format!("mesh key: {e}")))
    }

    /// A short name of the key, for people (its peer id).
    pub fn id(&self) -> PeerId {
        self.0.to_peer_id()
    }
}

impl Certificate {
    /// A certificate signed by the mesh key `mesh` admitting `peer` (named `name`) with
    /// `powers` until `not_after` (unix seconds).
    pub fn issue(
        mesh: &Keypair,
        peer: PeerId,
        name: &str,
        serial: u64,
        not_after: u64,
        powers: &[Power],
    ) -> Result<Self, AdmitError> {
        if name.chars().count() > MAX_NAME_CHARS {
            return Err(AdmitError::Malformed(format!(
                "a name of over {MAX_NAME_CHARS} characters"
            )));
        }
        let body = CertBody {
            peer: peer.to_bytes(),
            name: name.to_string(),
            serial,
            not_after,
            powers: powers.to_vec(),
        };
        let body = postcard::to_allocvec(&body)
            .map_err(|e| AdmitError::Malformed(format!("encoding: {e}")))?;
        let signature = mesh
            .sign(&signed_bytes(&body))
            .map_err(|e| AdmitError::Malformed(format!("signing: {e}")))?;
        Ok(Self { body, signature })
    }

    /// The certificate as it travels and is stored.
    pub fn to_bytes(&self) -> Vec<u8> {
        // A struct of two byte strings always encodes.
        postcard::to_allocvec(self).unwrap_or_default()
    }

    /// A certificate from untrusted bytes (at most [`MAX_CERT_BYTES`]); nothing is checked
    /// but its shape: [`Self::verify`] says what it admits.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, AdmitError> {
        if bytes.len() > MAX_CERT_BYTES {
            return Err(AdmitError::Malformed(format!(
                "{} bytes, over the {MAX_CERT_BYTES} a certificate takes",
                bytes.len()
            )));
        }
        postcard::from_bytes(bytes).map_err(|e| AdmitError::Malformed(e.to_string()))
    }

    /// What the certificate says, if the mesh key signed it (nothing else is checked).
    pub fn body(&self, mesh: &MeshKey) -> Result<CertBody, AdmitError> {
        if !mesh.0.verify(&signed_bytes(&self.body), &self.signature) {
            return Err(AdmitError::NotTheMesh);
        }
        let body: CertBody =
            postcard::from_bytes(&self.body).map_err(|e| AdmitError::Malformed(e.to_string()))?;
        if body.name.chars().count() > MAX_NAME_CHARS || body.powers.len() > 8 {
            return Err(AdmitError::Malformed("an oversized body".into()));
        }
        Ok(body)
    }

    /// Checks that the mesh key admits `signer` to `power` at `now` (unix seconds; `None`
    /// skips the expiry, for what was accepted before it expired): the certificate's body.
    pub fn verify(
        &self,
        mesh: &MeshKey,
        signer: &PeerId,
        power: Power,
        now: Option<u64>,
    ) -> Result<CertBody, AdmitError> {
        let body = self.body(mesh)?;
        let admits = body.peer_id()?;
        if admits != *signer {
            return Err(AdmitError::OtherPeer {
                admits: admits.to_string(),
                signer: signer.to_string(),
            });
        }
        if let Some(now) = now
            && now > body.not_after
        {
            return Err(AdmitError::Expired(body.not_after));
        }
        if !body.powers.contains(&power) {
            return Err(AdmitError::NoPower(power.name()));
        }
        Ok(body)
    }
}

fn signed_bytes(body: &[u8]) -> Vec<u8> {
    [DOMAIN, body].concat()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

    use super::*;
    use proptest::prelude::*;

    const NOW: u64 = 1_800_000_000;

    #[test]
    fn the_mesh_key_admits_a_peer_and_nothing_else_does() {
        let mesh = Keypair::generate_ed25519();
        let trainer = Keypair::generate_ed25519().public().to_peer_id();
        let key = MeshKey::from_bytes(&MeshKey::of(&mesh).to_bytes()).unwrap();
        let cert = Certificate::issue(&mesh, trainer, "api", 7, NOW + 60, &[Power::Write]).unwrap();
        let cert = Certificate::from_bytes(&cert.to_bytes()).unwrap();
        let body = cert
            .verify(&key, &trainer, Power::Write, Some(NOW))
            .unwrap();
        assert_eq!((body.name.as_str(), body.serial), ("api", 7));
        assert_eq!(
            cert.verify(&key, &trainer, Power::Report, Some(NOW)),
            Err(AdmitError::NoPower("report members"))
        );
        assert_eq!(
            cert.verify(&key, &trainer, Power::Write, Some(NOW + 61)),
            Err(AdmitError::Expired(NOW + 60))
        );
        assert!(
            cert.verify(&key, &trainer, Power::Write, None).is_ok(),
            "what was accepted before expiry stays readable"
        );
        let other = Keypair::generate_ed25519().public().to_peer_id();
        assert!(matches!(
            cert.verify(&key, &other, Power::Write, Some(NOW)),
            Err(AdmitError::OtherPeer { .. })
        ));
        // Self-signed: the trainer's own key is not the mesh's.
        let own = Keypair::generate_ed25519();
        let selfie = Certificate::issue(
            &own,
            own.public().to_peer_id(),
            "me",
            1,
            NOW + 60,
            &[Power::Write],
        )
        .unwrap();
        assert_eq!(
            selfie.verify(&key, &own.public().to_peer_id(), Power::Write, Some(NOW)),
            Err(AdmitError::NotTheMesh)
        );
        // Every flipped byte breaks it.
        let bytes = cert.to_bytes();
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0x21;
            let ok = Certificate::from_bytes(&bad)
                .and_then(|c| c.verify(&key, &trainer, Power::Write, Some(NOW)));
            assert!(ok.is_err(), "byte {i}: a changed certificate still admits");
        }
    }

    #[test]
    fn names_and_sizes_are_bounded() {
        let mesh = Keypair::generate_ed25519();
        let peer = mesh.public().to_peer_id();
        let long = "x".repeat(MAX_NAME_CHARS + 1);
        assert!(Certificate::issue(&mesh, peer, &long, 1, NOW, &[Power::Write]).is_err());
        assert!(Certificate::from_bytes(&vec![0u8; MAX_CERT_BYTES + 1]).is_err());
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            let mesh = MeshKey::of(&Keypair::generate_ed25519());
            let peer = Keypair::generate_ed25519().public().to_peer_id();
            if let Ok(c) = Certificate::from_bytes(&bytes) {
                prop_assert!(c.verify(&mesh, &peer, Power::Write, Some(NOW)).is_err());
            }
        }
    }
}
