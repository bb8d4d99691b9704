//! Signed update payloads: the leader signs an update's wire form with its libp2p identity, and
//! every node checks the signature before anything else, also for payloads relayed by peers
//! during catch-up. An update's id stays the hash of the payload inside.

use libp2p::identity::{Keypair, PublicKey};
use serde::{Deserialize, Serialize};

use super::UpdateError;

#[derive(Serialize, Deserialize)]
struct Envelope {
    /// The signer's public key, protobuf-encoded (libp2p's form).
    #[serde(with = "serde_bytes")]
    key: Vec<u8>,
    /// Signature over `payload`.
    #[serde(with = "serde_bytes")]
    signature: Vec<u8>,
    /// The update's wire form.
    #[serde(with = "serde_bytes")]
    payload: Vec<u8>,
}

/// A payload signed by `key`, ready to send.
pub fn seal(payload: Vec<u8>, key: &Keypair) -> Result<Vec<u8>, UpdateError> {
    let signature = key
        .sign(&payload)
        .map_err(|e| UpdateError::Signature(format!("signing: {e}")))?;
    let env = Envelope {
        key: key.public().encode_protobuf(),
        signature,
        payload,
    };
    postcard::to_allocvec(&env).map_err(|e| UpdateError::Signature(format!("encoding: {e}")))
}

/// The signer's peer id and the payload of a signed update, if the signature holds.
pub fn open(bytes: &[u8]) -> Result<(libp2p::PeerId, Vec<u8>), UpdateError> {
    let env: Envelope = postcard::from_bytes(bytes)
        .map_err(|e| UpdateError::Signature(format!("not a signed update: {e}")))?;
    let key = PublicKey::try_decode_protobuf(&env.key)
        .map_err(|e| UpdateError::Signature(format!("signer's key: {e}")))?;
    if !key.verify(&env.payload, &env.signature) {
        return Err(UpdateError::Signature(
            "the signature does not match the payload".into(),
        ));
    }
    Ok((key.to_peer_id(), env.payload))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_signature_holds_and_any_change_breaks_it() {
        let key = Keypair::generate_ed25519();
        let sealed = seal(b"an update".to_vec(), &key).unwrap();
        let (signer, payload) = open(&sealed).unwrap();
        assert_eq!(signer, key.public().to_peer_id());
        assert_eq!(payload, b"an update");
        // Flip each byte in turn: the envelope no longer opens (or opens to another signer).
        for i in 0..sealed.len() {
            let mut bad = sealed.clone();
            bad[i] ^= 0x40;
            assert!(
                open(&bad).is_err(),
                "byte {i}: a changed envelope still verified"
            );
        }
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            prop_assert!(open(&bytes).is_err());
        }
    }
}
