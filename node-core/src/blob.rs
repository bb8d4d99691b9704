//! Checksummed, erasure-protected shard blobs: bytes that must survive exactly, at rest and in
//! transit. The payload is cut into chunks; each group of `data_chunks` chunks gets
//! `parity_chunks` Reed–Solomon parity chunks (GF(2⁸)); every chunk carries a BLAKE3 hash, so
//! a damaged or missing chunk is an erasure that parity repairs bit-exactly.
//!
//! Layout: `header | chunk hashes | chunks (group by group, data then parity) | header copy`.
//! The header (magic, version, parameters, lengths, payload hash, hash of the hash table) is
//! self-checked with its own BLAKE3 and stored at both ends, so either copy suffices.

use reed_solomon_erasure::galois_8::ReedSolomon;

const MAGIC: &[u8; 8] = b"CMBLOB\0\x01";
const FORMAT_VERSION: u32 = 1;
/// Header: magic 8, version 4, chunk size 4, data 2, parity 2, payload len 8,
/// payload hash 32, table hash 32, header hash 32.
const HEADER_LEN: usize = 8 + 4 + 4 + 2 + 2 + 8 + 32 + 32 + 32;
/// Largest payload accepted (a shard of a large model, with room).
pub const MAX_PAYLOAD: u64 = 1 << 36;

/// Errors of encoding or decoding a blob.
#[derive(Debug, thiserror::Error)]
pub enum BlobError {
    /// Parameters out of range.
    #[error("invalid blob parameters: {0}")]
    Params(String),
    /// Neither header copy is intact.
    #[error("blob header is damaged at both ends (or this is not a shard blob)")]
    Header,
    /// Too many chunks of one group are damaged to repair.
    #[error("group {group}: {damaged} chunks damaged, parity repairs at most {parity}")]
    Unrepairable {
        /// The group index.
        group: usize,
        /// Damaged or missing chunks in it.
        damaged: usize,
        /// Parity chunks per group.
        parity: usize,
    },
    /// The repaired payload does not match its hash.
    #[error("payload hash mismatch after repair")]
    PayloadHash,
    /// The erasure coder failed.
    #[error("erasure coding: {0}")]
    Erasure(String),
}

/// How a blob is cut and protected.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlobParams {
    /// Bytes per chunk.
    pub chunk_size: usize,
    /// Data chunks per group.
    pub data_chunks: usize,
    /// Parity chunks per group.
    pub parity_chunks: usize,
}

/// 64 KiB chunks, 2 parity chunks per 32: any 2 damaged chunks of each 2 MiB are repaired,
/// for 6.25% more bytes. A row damaged past that is rebuilt from k others, as a lost one is;
/// 4 per 32 (12.5%) pushed compact rows that have learnt past 60 MB.
impl Default for BlobParams {
    fn default() -> Self {
        Self {
            chunk_size: 64 << 10,
            data_chunks: 32,
            parity_chunks: 2,
        }
    }
}

impl BlobParams {
    /// Checks the ranges.
    pub fn validate(&self) -> Result<(), BlobError> {
        if !(64..=(16 << 20)).contains(&self.chunk_size) {
            return Err(BlobError::Params(format!(
                "chunk size {} is outside 64 B ..= 16 MiB",
                self.chunk_size
            )));
        }
        if self.data_chunks == 0
            || self.parity_chunks == 0
            || self.data_chunks + self.parity_chunks > 256
        {
            return Err(BlobError::Params(format!(
                "{} data + {} parity chunks: need ≥ 1 of each and ≤ 256 together",
                self.data_chunks, self.parity_chunks
            )));
        }
        Ok(())
    }
}

/// A decoded blob.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodedBlob {
    /// The original bytes.
    pub payload: Vec<u8>,
    /// Chunks that were damaged or missing and were rebuilt.
    pub repaired_chunks: usize,
}

struct Header {
    params: BlobParams,
    payload_len: u64,
    payload_hash: [u8; 32],
    table_hash: [u8; 32],
}

impl Header {
    fn groups(&self) -> usize {
        let chunks = (self.payload_len as usize).div_ceil(self.params.chunk_size);
        chunks.div_ceil(self.params.data_chunks)
    }

    fn total_chunks(&self) -> usize {
        self.groups() * (self.params.data_chunks + self.params.parity_chunks)
    }

    fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(HEADER_LEN);
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        b.extend_from_slice(&(self.params.chunk_size as u32).to_le_bytes());
        b.extend_from_slice(&(self.params.data_chunks as u16).to_le_bytes());
        b.extend_from_slice(&(self.params.parity_chunks as u16).to_le_bytes());
        b.extend_from_slice(&self.payload_len.to_le_bytes());
        b.extend_from_slice(&self.payload_hash);
        b.extend_from_slice(&self.table_hash);
        let h = blake3::hash(&b);
        b.extend_from_slice(h.as_bytes());
        b
    }

    fn parse(b: &[u8]) -> Option<Self> {
        let b = b.get(..HEADER_LEN)?;
        let (body, hash) = b.split_at(HEADER_LEN - 32);
        if blake3::hash(body).as_bytes() != hash || &body[..8] != MAGIC {
            return None;
        }
        let u32_at =
            |i: usize| u32::from_le_bytes([body[i], body[i + 1], body[i + 2], body[i + 3]]);
        let u16_at = |i: usize| u16::from_le_bytes([body[i], body[i + 1]]);
        if u32_at(8) != FORMAT_VERSION {
            return None;
        }
        let mut len = [0u8; 8];
        len.copy_from_slice(&body[20..28]);
        let mut payload_hash = [0u8; 32];
        payload_hash.copy_from_slice(&body[28..60]);
        let mut table_hash = [0u8; 32];
        table_hash.copy_from_slice(&body[60..92]);
        let header = Self {
            params: BlobParams {
                chunk_size: u32_at(12) as usize,
                data_chunks: u16_at(16) as usize,
                parity_chunks: u16_at(18) as usize,
            },
            payload_len: u64::from_le_bytes(len),
            payload_hash,
            table_hash,
        };
        (header.params.validate().is_ok() && header.payload_len <= MAX_PAYLOAD).then_some(header)
    }
}

/// Encodes `payload` into a self-describing, repairable blob.
pub fn encode_blob(payload: &[u8], params: &BlobParams) -> Result<Vec<u8>, BlobError> {
    params.validate()?;
    if payload.len() as u64 > MAX_PAYLOAD {
        return Err(BlobError::Params(format!(
            "payload of {} bytes exceeds {MAX_PAYLOAD}",
            payload.len()
        )));
    }
    let (cs, d, p) = (params.chunk_size, params.data_chunks, params.parity_chunks);
    let rs = ReedSolomon::new(d, p).map_err(|e| BlobError::Erasure(format!("{e:?}")))?;
    let mut chunks: Vec<Vec<u8>> = Vec::new();
    for group in payload.chunks(cs * d) {
        let mut shards: Vec<Vec<u8>> = group
            .chunks(cs)
            .map(|c| {
                let mut v = c.to_vec();
                v.resize(cs, 0);
                v
            })
            .collect();
        shards.resize(d + p, vec![0u8; cs]);
        rs.encode(&mut shards)
            .map_err(|e| BlobError::Erasure(format!("{e:?}")))?;
        chunks.extend(shards);
    }
    let mut table = Vec::with_capacity(chunks.len() * 32);
    for c in &chunks {
        table.extend_from_slice(blake3::hash(c).as_bytes());
    }
    let header = Header {
        params: *params,
        payload_len: payload.len() as u64,
        payload_hash: *blake3::hash(payload).as_bytes(),
        table_hash: *blake3::hash(&table).as_bytes(),
    }
    .to_bytes();
    let mut out = Vec::with_capacity(2 * HEADER_LEN + table.len() + chunks.len() * cs);
    out.extend_from_slice(&header);
    out.extend_from_slice(&table);
    for c in &chunks {
        out.extend_from_slice(c);
    }
    out.extend_from_slice(&header);
    Ok(out)
}

/// Decodes a blob, repairing damaged chunks from parity; never returns a wrong payload.
pub fn decode_blob(bytes: &[u8]) -> Result<DecodedBlob, BlobError> {
    let header = Header::parse(bytes)
        .or_else(|| {
            bytes
                .len()
                .checked_sub(HEADER_LEN)
                .and_then(|start| Header::parse(&bytes[start..]))
        })
        .ok_or(BlobError::Header)?;
    let (cs, d, p) = (
        header.params.chunk_size,
        header.params.data_chunks,
        header.params.parity_chunks,
    );
    let total = header.total_chunks();
    // The hash table must be intact: it is what tells good chunks from bad ones.
    let table_end = HEADER_LEN + total * 32;
    let table = bytes
        .get(HEADER_LEN..table_end)
        .filter(|t| blake3::hash(t).as_bytes() == &header.table_hash)
        .ok_or(BlobError::Header)?;
    let rs = ReedSolomon::new(d, p).map_err(|e| BlobError::Erasure(format!("{e:?}")))?;
    let mut payload = Vec::with_capacity((header.payload_len as usize).min(bytes.len()));
    let mut repaired = 0;
    for g in 0..header.groups() {
        let mut shards: Vec<Option<Vec<u8>>> = (0..d + p)
            .map(|i| {
                let idx = g * (d + p) + i;
                let start = table_end + idx * cs;
                bytes
                    .get(start..start + cs)
                    .filter(|c| blake3::hash(c).as_bytes()[..] == table[idx * 32..idx * 32 + 32])
                    .map(<[u8]>::to_vec)
            })
            .collect();
        let damaged = shards.iter().filter(|s| s.is_none()).count();
        if damaged > p {
            return Err(BlobError::Unrepairable {
                group: g,
                damaged,
                parity: p,
            });
        }
        if damaged > 0 {
            rs.reconstruct_data(&mut shards)
                .map_err(|e| BlobError::Erasure(format!("{e:?}")))?;
            repaired += damaged;
        }
        for s in shards.into_iter().take(d) {
            let s = s.ok_or(BlobError::PayloadHash)?;
            let want = header.payload_len as usize - payload.len();
            payload.extend_from_slice(&s[..want.min(cs)]);
            if payload.len() == header.payload_len as usize {
                break;
            }
        }
    }
    if payload.len() as u64 != header.payload_len
        || blake3::hash(&payload).as_bytes() != &header.payload_hash
    {
        return Err(BlobError::PayloadHash);
    }
    Ok(DecodedBlob {
        payload,
        repaired_chunks: repaired,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const SMALL: BlobParams = BlobParams {
        chunk_size: 64,
        data_chunks: 4,
        parity_chunks: 2,
    };

    fn payload(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 + i / 13) as u8).collect()
    }

    #[test]
    fn round_trips_many_sizes() {
        for n in [0, 1, 63, 64, 65, 255, 256, 257, 1000, 5000] {
            let p = payload(n);
            let blob = encode_blob(&p, &SMALL).unwrap();
            let d = decode_blob(&blob).unwrap();
            assert_eq!(d.payload, p, "size {n}");
            assert_eq!(d.repaired_chunks, 0);
        }
    }

    #[test]
    fn repairs_up_to_parity_per_group_and_refuses_beyond() {
        let p = payload(1000); // 16 chunks → 4 groups of 4 data + 2 parity
        let blob = encode_blob(&p, &SMALL).unwrap();
        let total = 4 * 6;
        let start = HEADER_LEN + total * 32;
        let mut damaged = blob.clone();
        for chunk in [0usize, 5, 6, 9, 13, 17] {
            // two per group in groups 0, 1 (chunks 0, 5 | 6, 9), one in 2 (13), one in 3 (17)
            damaged[start + chunk * 64 + 3] ^= 0xff;
        }
        let d = decode_blob(&damaged).unwrap();
        assert_eq!(d.payload, p);
        assert!(d.repaired_chunks >= 1);
        let mut too_much = blob.clone();
        for chunk in [0usize, 1, 2] {
            too_much[start + chunk * 64] ^= 1;
        }
        assert!(matches!(
            decode_blob(&too_much),
            Err(BlobError::Unrepairable {
                group: 0,
                damaged: 3,
                parity: 2
            })
        ));
    }

    #[test]
    fn header_damage_at_one_end_is_survived() {
        let p = payload(300);
        let blob = encode_blob(&p, &SMALL).unwrap();
        let mut front = blob.clone();
        front[10] ^= 1;
        assert_eq!(decode_blob(&front).unwrap().payload, p);
        let mut both = front.clone();
        let n = both.len();
        both[n - 5] ^= 1;
        assert!(matches!(decode_blob(&both), Err(BlobError::Header)));
    }

    #[test]
    fn truncation_within_parity_is_repaired() {
        let p = payload(4 * 64 * 3); // 3 full groups
        let blob = encode_blob(&p, &SMALL).unwrap();
        // Cut off the trailer and the last parity chunk: the front header still describes it.
        let cut = &blob[..blob.len() - HEADER_LEN - 64];
        assert_eq!(decode_blob(cut).unwrap().payload, p);
    }

    #[test]
    fn bad_params_are_rejected() {
        for params in [
            BlobParams {
                chunk_size: 1,
                ..SMALL
            },
            BlobParams {
                data_chunks: 0,
                ..SMALL
            },
            BlobParams {
                parity_chunks: 0,
                ..SMALL
            },
            BlobParams {
                data_chunks: 200,
                parity_chunks: 100,
                ..SMALL
            },
        ] {
            assert!(encode_blob(b"x", &params).is_err());
        }
    }

    proptest! {
        #[test]
        fn damage_never_panics_and_never_returns_a_wrong_payload(
            n in 0usize..2000,
            flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..12),
            cut in any::<usize>(),
        ) {
            let p = payload(n);
            let mut blob = encode_blob(&p, &SMALL).unwrap();
            for (i, v) in flips {
                let len = blob.len();
                blob[i % len] ^= v;
            }
            let len = blob.len();
            blob.truncate(len - cut % (len / 4 + 1));
            if let Ok(d) = decode_blob(&blob) {
                prop_assert_eq!(d.payload, p);
            }
        }
    }
}
