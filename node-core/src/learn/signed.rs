//! Signed payloads (learning updates and their piece lists): the signer's libp2p identity
//! (ed25519) signs a header and the payload, and the envelope carries the certificate by which
//! the mesh admits the signer ([`super::admit`]). Every node checks the signature before
//! anything else, also for payloads relayed by peers during catch-up. An update's id stays the
//! hash of the payload inside.

use libp2p::PeerId;
use libp2p::identity::{Keypair, PublicKey};
use serde::{Deserialize, Serialize};

use super::UpdateError;
use super::admit::{AdmitError, CertBody, Certificate, MeshKey, Power};

/// What a signature covers, before the header: nothing else the identity signs reads as one.
const DOMAIN: &[u8] = b"codedmesh signed payload v2\0";

/// Most bytes of a header (two timestamps' worth and a verdict).
const MAX_HEADER_BYTES: usize = 128;

/// The canary gate's verdict, as a trainer attaches it to an update: the canary loss before and
/// after the update, and the mesh's reference loss it counted the drift from.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GateClaim {
    /// The canary loss at the version the update was judged at.
    pub before: f64,
    /// The canary loss with the update applied.
    pub after: f64,
    /// The mesh's reference loss (the manifest's) the drift was counted from.
    pub reference: f64,
}

/// What a signer says beside its payload.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Header {
    /// When it was signed, in unix milliseconds.
    pub issued_ms: u64,
    /// The trainer's canary verdict on an update, when its gate judged it.
    pub verdict: Option<GateClaim>,
}

#[derive(Serialize, Deserialize)]
struct Envelope {
    /// The signer's public key, protobuf-encoded (libp2p's form).
    #[serde(with = "serde_bytes")]
    key: Vec<u8>,
    /// The certificate admitting the signer, if it has one.
    cert: Option<Certificate>,
    /// What the signer says beside the payload.
    header: Header,
    /// Signature over [`DOMAIN`], the header and the payload.
    #[serde(with = "serde_bytes")]
    signature: Vec<u8>,
    /// The signed thing (an update's wire form, a piece list).
    #[serde(with = "serde_bytes")]
    payload: Vec<u8>,
}

/// Who a leader (or a trainer) signs as: its libp2p identity, and the certificate by which the mesh's key
/// admits it to write (without one, holders refuse what it signs).
#[derive(Debug, Clone)]
pub struct Signer {
    /// The identity that signs.
    pub key: Keypair,
    /// The certificate admitting it, if the mesh admitted it.
    pub cert: Option<Certificate>,
}

impl Signer {
    /// A signer the mesh has not admitted (its updates are refused).
    pub fn unadmitted(key: Keypair) -> Self {
        Self { key, cert: None }
    }
}

/// A payload whose signature holds: who signed it, with what certificate and header.
#[derive(Debug, Clone)]
pub struct Signed {
    /// The signer.
    pub signer: PeerId,
    /// The certificate the signer attached.
    pub cert: Option<Certificate>,
    /// What the signer said beside the payload.
    pub header: Header,
    /// The payload.
    pub payload: Vec<u8>,
}

impl Signed {
    /// What the mesh key admits the signer to do ([`Certificate::verify`]): the certificate's
    /// body if it grants `power` at `now` (unix seconds; `None` skips the expiry).
    pub fn admitted(
        &self,
        mesh: &MeshKey,
        power: Power,
        now: Option<u64>,
    ) -> Result<CertBody, AdmitError> {
        self.cert
            .as_ref()
            .ok_or(AdmitError::Missing)?
            .verify(mesh, &self.signer, power, now)
    }
}

fn signed_bytes(header: &Header, payload: &[u8]) -> Result<Vec<u8>, UpdateError> {
    let header = postcard::to_allocvec(header)
        .map_err(|e| UpdateError::Signature(format!("encoding a header: {e}")))?;
    let mut out = Vec::with_capacity(DOMAIN.len() + 8 + header.len() + payload.len());
    out.extend_from_slice(DOMAIN);
    out.extend_from_slice(&(header.len() as u64).to_le_bytes());
    out.extend_from_slice(&header);
    out.extend_from_slice(payload);
    Ok(out)
}

/// `payload` and `header` signed by `key` (ed25519), with the certificate that admits it.
pub fn seal(
    payload: Vec<u8>,
    key: &Keypair,
    cert: Option<&Certificate>,
    header: Header,
) -> Result<Vec<u8>, UpdateError> {
    if key.key_type() != libp2p::identity::KeyType::Ed25519 {
        return Err(UpdateError::Signature(
            "only ed25519 identities sign for the mesh".into(),
        ));
    }
    let signature = key
        .sign(&signed_bytes(&header, &payload)?)
        .map_err(|e| UpdateError::Signature(format!("signing: {e}")))?;
    let env = Envelope {
        key: key.public().encode_protobuf(),
        cert: cert.cloned(),
        header,
        signature,
        payload,
    };
    postcard::to_allocvec(&env).map_err(|e| UpdateError::Signature(format!("encoding: {e}")))
}

/// The signer, certificate, header and payload of signed bytes, if the signature holds. Who
/// the signer is allowed to be is the caller's question ([`Signed::admitted`]).
pub fn open(bytes: &[u8]) -> Result<Signed, UpdateError> {
    let env: Envelope = postcard::from_bytes(bytes)
        .map_err(|e| UpdateError::Signature(format!("not a signed payload: {e}")))?;
    let key = PublicKey::try_decode_protobuf(&env.key)
        .map_err(|e| UpdateError::Signature(format!("signer's key: {e}")))?;
    if key.key_type() != libp2p::identity::KeyType::Ed25519 {
        return Err(UpdateError::Signature(
            "only ed25519 identities sign for the mesh".into(),
        ));
    }
    let header_bytes = postcard::to_allocvec(&env.header)
        .map_err(|e| UpdateError::Signature(format!("header: {e}")))?;
    if header_bytes.len() > MAX_HEADER_BYTES {
        return Err(UpdateError::Signature("an oversized header".into()));
    }
    if !key.verify(&signed_bytes(&env.header, &env.payload)?, &env.signature) {
        return Err(UpdateError::Signature(
            "the signature does not match the payload".into(),
        ));
    }
    Ok(Signed {
        signer: key.to_peer_id(),
        cert: env.cert,
        header: env.header,
        payload: env.payload,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_signature_holds_and_any_change_breaks_it() {
        let key = Keypair::generate_ed25519();
        let mesh = Keypair::generate_ed25519();
        let cert = Certificate::issue(
            &mesh,
            key.public().to_peer_id(),
            "t",
            1,
            u64::MAX,
            &[Power::Write],
        )
        .unwrap();
        let header = Header {
            issued_ms: 1234,
            verdict: Some(GateClaim {
                before: 3.0,
                after: 3.001,
                reference: 3.0,
            }),
        };
        let sealed = seal(b"an update".to_vec(), &key, Some(&cert), header).unwrap();
        let opened = open(&sealed).unwrap();
        assert_eq!(opened.signer, key.public().to_peer_id());
        assert_eq!(opened.payload, b"an update");
        assert_eq!(opened.header, header);
        assert!(
            opened
                .admitted(&MeshKey::of(&mesh), Power::Write, Some(0))
                .is_ok()
        );
        assert_eq!(
            opened.admitted(&MeshKey::of(&key), Power::Write, Some(0)),
            Err(AdmitError::NotTheMesh)
        );
        // Flip each byte in turn: the envelope no longer opens, opens to another signer, or
        // its certificate no longer admits it.
        for i in 0..sealed.len() {
            let mut bad = sealed.clone();
            bad[i] ^= 0x40;
            let admitted = open(&bad)
                .map_err(|e| e.to_string())
                .and_then(|o| {
                    o.admitted(&MeshKey::of(&mesh), Power::Write, Some(0))
                        .map_err(|e| e.to_string())
                        .map(|_| o)
                })
                .is_ok_and(|o| o.payload == b"an update" && o.header == header);
            assert!(!admitted, "byte {i}: a changed envelope still verified");
        }
        let unadmitted =
            open(&seal(b"x".to_vec(), &key, None, Header::default()).unwrap()).unwrap();
        assert_eq!(
            unadmitted.admitted(&MeshKey::of(&mesh), Power::Write, Some(0)),
            Err(AdmitError::Missing)
        );
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            prop_assert!(open(&bytes).is_err());
        }
    }
}
