//! Messages between a leader and the members of its group, postcard-encoded with a version.
//!
//! Every decoder here treats its input as hostile: a size limit is checked before anything is
//! decoded, the version is read first, and errors name what was wrong.

use serde::{Deserialize, Serialize, de::DeserializeOwned};

use crate::model::Stage;

/// Version of the step protocol; a peer on another version is refused with both named (4: shard
/// sets carry their learnt adapters; 5: adapters of rank 8; 6: a step at another version is
/// refused with `MeshResponse::Stale`).
pub const PROTOCOL_VERSION: u16 = 8;

/// Largest encoded message accepted (a prefill of a few thousand tokens fits).
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// What a leader asks one member to compute.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum StepRequest {
    /// Multiply the member's shards of a stage by `t` input rows `x` (`t × in`).
    Matmul {
        /// Which stage.
        stage: Stage,
        /// Number of input rows.
        t: u32,
        /// The inputs, row-major.
        #[serde(with = "f32_bytes")]
        x: Vec<f32>,
    },
    /// Multiply the transposes of the member's shards of a stage by `u` (backward pass):
    /// `Σ_s Σ_matrix u[s][matrix] · S_{matrix,s}`, `t × in`.
    MatmulT {
        /// Which stage.
        stage: Stage,
        /// Number of rows.
        t: u32,
        /// `[s][matrix][token][local row]`.
        #[serde(with = "f32_bytes")]
        u: Vec<f32>,
    },
    /// Return rows of the member's coded embedding (for the embedding lookup).
    EmbedRows {
        /// Local row index within a block, one per token.
        rows: Vec<u32>,
    },
}

impl StepRequest {
    /// The number of values the request carries (its inputs, or its embedding rows).
    pub fn values(&self) -> usize {
        match self {
            Self::Matmul { x, .. } => x.len(),
            Self::MatmulT { u, .. } => u.len(),
            Self::EmbedRows { rows } => rows.len(),
        }
    }

    /// The stage and token count of a product request (`Matmul`, `MatmulT`); `None` for an
    /// embedding lookup.
    pub fn product(&self) -> Option<(Stage, usize)> {
        match self {
            Self::Matmul { stage, t, .. } | Self::MatmulT { stage, t, .. } => {
                Some((*stage, *t as usize))
            }
            Self::EmbedRows { .. } => None,
        }
    }
}

/// A member's answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum StepResponse {
    /// The partial result, laid out sub-block major (see `coded`).
    Partial {
        /// The shard row (node index) that computed it.
        node: u32,
        /// The values.
        #[serde(with = "f32_bytes")]
        values: Vec<f32>,
    },
    /// The member could not compute it.
    Failed {
        /// Why, in words.
        reason: String,
    },
}

/// A message that could not be encoded or decoded.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    /// The peer speaks another protocol version.
    #[error("protocol version mismatch: ours is {ours}, the peer's is {theirs}")]
    Version {
        /// Our version.
        ours: u16,
        /// Theirs.
        theirs: u16,
    },
    /// The message is larger than allowed.
    #[error("message of {len} bytes exceeds the limit of {max}")]
    TooLarge {
        /// Its size.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The bytes are not a valid message.
    #[error("malformed message: {0}")]
    Malformed(String),
    /// Bytes were left after the message.
    #[error("{0} trailing bytes after the message")]
    Trailing(usize),
}

/// A vector of f32 as one run of little-endian bytes: decoded with one length check and a copy,
/// where a sequence is decoded a value at a time (postcard writes both as a length and 4 bytes
/// a value; this length counts bytes).
pub(crate) mod f32_bytes {
    use serde::{Deserializer, Serializer, de};

    pub(crate) fn serialize<S: Serializer>(v: &[f32], s: S) -> Result<S::Ok, S::Error> {
        #[cfg(target_endian = "little")]
        return s.serialize_bytes(bytemuck::cast_slice(v));
        #[cfg(target_endian = "big")]
        s.serialize_bytes(&v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>())
    }

    pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<f32>, D::Error> {
        struct Floats;
        impl de::Visitor<'_> for Floats {
            type Value = Vec<f32>;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("f32 values as little-endian bytes")
            }

            fn visit_bytes<E: de::Error>(self, b: &[u8]) -> Result<Vec<f32>, E> {
                let (whole, rest) = b.as_chunks::<4>();
                if !rest.is_empty() {
                    return Err(E::invalid_length(b.len(), &"a multiple of 4 bytes"));
                }
                Ok(whole.iter().map(|&v| f32::from_le_bytes(v)).collect())
            }
        }
        d.deserialize_bytes(Floats)
    }
}

/// Encodes a message with the protocol version in front.
pub fn encode<T: Serialize>(msg: &T) -> Result<Vec<u8>, ProtocolError> {
    let malformed = |e: postcard::Error| ProtocolError::Malformed(e.to_string());
    let out = postcard::to_extend(&PROTOCOL_VERSION, Vec::new()).map_err(malformed)?;
    let out = postcard::to_extend(msg, out).map_err(malformed)?;
    if out.len() > MAX_MESSAGE_BYTES {
        return Err(ProtocolError::TooLarge {
            len: out.len(),
            max: MAX_MESSAGE_BYTES,
        });
    }
    Ok(out)
}

/// Decodes a message, checking size and version first.
pub fn decode<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ProtocolError> {
    if bytes.len() > MAX_MESSAGE_BYTES {
        return Err(ProtocolError::TooLarge {
            len: bytes.len(),
            max: MAX_MESSAGE_BYTES,
        });
    }
    let (theirs, rest): (u16, _) =
        postcard::take_from_bytes(bytes).map_err(|e| ProtocolError::Malformed(e.to_string()))?;
    if theirs != PROTOCOL_VERSION {
        return Err(ProtocolError::Version {
            ours: PROTOCOL_VERSION,
            theirs,
        });
    }
    let (msg, rest) =
        postcard::take_from_bytes(rest).map_err(|e| ProtocolError::Malformed(e.to_string()))?;
    if !rest.is_empty() {
        return Err(ProtocolError::Trailing(rest.len()));
    }
    Ok(msg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn round_trip_and_version_check() {
        let msg = StepRequest::Matmul {
            stage: Stage::GateUp(3),
            t: 2,
            x: vec![1.0, -2.5, 3.25, 0.0],
        };
        let bytes = encode(&msg).unwrap();
        assert_eq!(decode::<StepRequest>(&bytes).unwrap(), msg);
        let mut other = postcard::to_allocvec(&(PROTOCOL_VERSION + 1)).unwrap();
        other.extend_from_slice(&bytes[1..]);
        let err = decode::<StepRequest>(&other).unwrap_err();
        assert!(
            err.to_string().contains(&format!(
                "ours is {PROTOCOL_VERSION}, the peer's is {}",
                PROTOCOL_VERSION + 1
            )),
            "{err}"
        );
        let mut trailing = bytes.clone();
        trailing.push(0);
        assert!(matches!(
            decode::<StepRequest>(&trailing),
            Err(ProtocolError::Trailing(1))
        ));
    }

    #[test]
    fn huge_length_prefix_is_an_error_not_an_allocation() {
        // This version, variant Matmul, stage LmHead, t = 1, then a vector claiming 2^60 bytes.
        let mut bytes = postcard::to_allocvec(&PROTOCOL_VERSION).unwrap();
        bytes.extend_from_slice(&[0, 4, 1]);
        bytes.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x0f]);
        let err = decode::<StepRequest>(&bytes).unwrap_err();
        assert!(matches!(err, ProtocolError::Malformed(_)), "{err}");
    }

    #[test]
    fn values_are_whole_floats_or_refused() {
        let msg = StepResponse::Partial {
            node: 2,
            values: vec![f32::MIN_POSITIVE, -0.0, 1e30, f32::NAN],
        };
        let bytes = encode(&msg).unwrap();
        let back = decode::<StepResponse>(&bytes).unwrap();
        let StepResponse::Partial { values, .. } = back else {
            panic!("{back:?}")
        };
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let StepResponse::Partial { values: sent, .. } = &msg else {
            unreachable!()
        };
        assert_eq!(bits(&values), bits(sent));
        // The same message with one byte fewer in its values (the length says 15).
        let mut cut = bytes.clone();
        let len_at = cut.len() - 17;
        assert_eq!(cut[len_at], 16, "the length of the values in bytes");
        cut[len_at] = 15;
        cut.pop();
        let err = decode::<StepResponse>(&cut).unwrap_err();
        assert!(matches!(err, ProtocolError::Malformed(_)), "{err}");
    }

    #[test]
    fn byte_runs_are_the_bytes_of_a_sequence_of_u8() {
        // Fields carried as byte runs (serde_bytes: one copy to read) keep the wire form of a
        // plain Vec<u8>, so nodes before and after the change read each other's messages.
        let v: Vec<u8> = (0..=255).chain(0..300).map(|i: i32| i as u8).collect();
        assert_eq!(
            postcard::to_allocvec(&serde_bytes::Bytes::new(&v)).unwrap(),
            postcard::to_allocvec(&v).unwrap()
        );
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode::<StepRequest>(&bytes);
            let _ = decode::<StepResponse>(&bytes);
        }
    }
}
