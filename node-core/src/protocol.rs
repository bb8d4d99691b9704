//! Messages between a leader and the members of its group, postcard-encoded with a version.
//!
//! Every decoder here treats its input as hostile: a size limit is checked before anything is
//! decoded, the version is read first, and errors name what was wrong.

use serde::{Deserialize, Serialize, de::DeserializeOwned};

use crate::model::Stage;

/// Version of the step protocol; a peer on another version is refused with both named (4: shard
/// sets carry their learnt adapters; 5: adapters of rank 8; 6: a step at another version is
/// refused with `MeshResponse::Stale`; 9: updates and reports carry the certificate by which the
/// mesh's key admits their signer, and a peer that may not write teaches a trainer text; 10:
/// heartbeats carry the sender's network coordinate; 11: adapters of rank 16, and updates
/// name the adapters' projection instead of carrying it).
pub const PROTOCOL_VERSION: u16 = 11;

/// Largest encoded message accepted (a prefill of a few thousand tokens fits).
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// The slowest bytes may travel between two nodes, in bytes a second (1 Mbit/s), before the
/// one waiting stops: every wait for bytes is a fixed wait plus the time they take at this
/// rate. A long prompt's parts are megabytes, and one TCP or QUIC connection with 1 % loss at
/// 50 ms carries about 3 Mbit/s: a fixed wait would give up on transfers that are slow, not
/// stuck.
pub const MIN_RATE: f64 = 125_000.0;

/// How long `bytes` take at [`MIN_RATE`].
pub fn at_min_rate(bytes: usize) -> std::time::Duration {
    std::time::Duration::from_secs_f64(bytes as f64 / MIN_RATE)
}

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
        #[serde(deserialize_with = "bounded::numbers")]
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
    let mut out = Vec::new();
    encode_into(&mut out, 0, msg)?;
    Ok(out)
}

/// [`encode`] into `out` (cleared first) after `room` zero bytes the caller fills in (a
/// frame's length), reserved at exactly the size it takes, so a large answer (an LM head's
/// logits) is copied once; a caller that encodes one message after another keeps `out`, as a
/// fresh buffer of a large answer is slow to fill each time.
pub(crate) fn encode_into<T: Serialize>(
    out: &mut Vec<u8>,
    room: usize,
    msg: &T,
) -> Result<(), ProtocolError> {
    let malformed = |e: postcard::Error| ProtocolError::Malformed(e.to_string());
    let size = postcard::experimental::serialized_size(&PROTOCOL_VERSION).map_err(malformed)?
        + postcard::experimental::serialized_size(msg).map_err(malformed)?;
    if size > MAX_MESSAGE_BYTES {
        return Err(ProtocolError::TooLarge {
            len: size,
            max: MAX_MESSAGE_BYTES,
        });
    }
    out.clear();
    out.reserve(room + size);
    out.resize(room, 0);
    postcard::serialize_with_flavor(&PROTOCOL_VERSION, Appending(out)).map_err(malformed)?;
    postcard::serialize_with_flavor(msg, Appending(out)).map_err(malformed)
}

/// Postcard's output appended to a `Vec`, byte strings whole (postcard's own `to_extend`
/// pushes them a byte at a time through an iterator).
struct Appending<'a>(&'a mut Vec<u8>);

impl postcard::ser_flavors::Flavor for Appending<'_> {
    type Output = ();

    fn try_extend(&mut self, data: &[u8]) -> postcard::Result<()> {
        self.0.extend_from_slice(data);
        Ok(())
    }

    fn try_push(&mut self, data: u8) -> postcard::Result<()> {
        self.0.push(data);
        Ok(())
    }

    fn finalize(self) -> postcard::Result<()> {
        Ok(())
    }
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

/// Lists read from peers with their length bounded while they are read: a list of small
/// items (empty strings, numbers) costs up to 24 times its wire bytes in memory, so its length
/// is checked before, not after, it is built (`#[serde(deserialize_with = ...)]`).
pub mod bounded {
    use serde::de::{Deserializer, Error, SeqAccess, Visitor};

    /// Most peers (or addresses) a list a peer sends may name.
    pub const MAX_NAMES: usize = 100_000;

    /// Most characters of one name (a peer id, a multiaddr).
    pub const MAX_NAME_CHARS: usize = 256;

    /// Most addresses a peer lists for itself.
    pub const MAX_ADDRS: usize = 32;

    /// Most small numbers (rows, witnesses, tokens of an embedding lookup) in a list.
    pub const MAX_NUMBERS: usize = 1 << 20;

    struct Strings(usize);

    impl<'de> Visitor<'de> for Strings {
        type Value = Vec<String>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(
                f,
                "at most {} names of at most {MAX_NAME_CHARS} bytes",
                self.0
            )
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<String>, A::Error> {
            let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(self.0).min(1024));
            while let Some(s) = seq.next_element::<String>()? {
                if out.len() == self.0 {
                    return Err(A::Error::custom(format!("a list of over {} names", self.0)));
                }
                if s.len() > MAX_NAME_CHARS {
                    return Err(A::Error::custom(format!(
                        "a name of {} bytes, over {MAX_NAME_CHARS}",
                        s.len()
                    )));
                }
                out.push(s);
            }
            Ok(out)
        }
    }

    /// A list of at most [`MAX_NAMES`] names (peer ids, addresses).
    pub fn names<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
        d.deserialize_seq(Strings(MAX_NAMES))
    }

    /// A list of at most [`MAX_ADDRS`] addresses.
    pub fn addrs<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
        d.deserialize_seq(Strings(MAX_ADDRS))
    }

    struct Numbers<T>(std::marker::PhantomData<T>);

    impl<'de, T: serde::Deserialize<'de>> Visitor<'de> for Numbers<T> {
        type Value = Vec<T>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "at most {MAX_NUMBERS} numbers")
        }

        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Vec<T>, A::Error> {
            let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1024));
            while let Some(x) = seq.next_element::<T>()? {
                if out.len() == MAX_NUMBERS {
                    return Err(A::Error::custom(format!(
                        "a list of over {MAX_NUMBERS} numbers"
                    )));
                }
                out.push(x);
            }
            Ok(out)
        }
    }

    /// A list of at most [`MAX_NUMBERS`] numbers.
    pub fn numbers<'de, D: Deserializer<'de>, T: serde::Deserialize<'de>>(
        d: D,
    ) -> Result<Vec<T>, D::Error> {
        d.deserialize_seq(Numbers(std::marker::PhantomData))
    }
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
    fn a_list_of_names_is_bounded_while_it_is_read() {
        #[derive(Debug, Serialize, Deserialize)]
        struct Named {
            #[serde(deserialize_with = "bounded::addrs")]
            addrs: Vec<String>,
        }
        let ok = Named {
            addrs: vec![String::new(); bounded::MAX_ADDRS],
        };
        assert!(decode::<Named>(&encode(&ok).unwrap()).is_ok());
        let many = Named {
            addrs: vec![String::new(); bounded::MAX_ADDRS + 1],
        };
        assert!(decode::<Named>(&encode(&many).unwrap()).is_err());
        let long = Named {
            addrs: vec!["x".repeat(bounded::MAX_NAME_CHARS + 1)],
        };
        assert!(decode::<Named>(&encode(&long).unwrap()).is_err());
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
