//! Checksummed, erasure-protected shard blobs: bytes that must survive exactly, at rest and in
//! transit. The payload is cut into chunks; each group of `data_chunks` chunks gets
//! `parity_chunks` Reed–Solomon parity chunks (GF(2⁸)); every chunk carries a BLAKE3 hash, so
//! a damaged or missing chunk is an erasure that parity repairs bit-exactly.
//!
//! Layout: `header | chunk hashes | chunks (group by group, data then parity) | header copy`.
//! The header (magic, version, parameters, lengths, payload hash, hash of the hash table) is
//! self-checked with its own BLAKE3 and stored at both ends, so either copy suffices.

use std::io::{Read, Seek, SeekFrom, Write};

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
    /// Reading or writing the blob failed.
    #[error("blob i/o: {0}")]
    Io(String),
}

impl BlobError {
    /// An i/o error, or the blob error a [`BlobReader`] wrapped in one.
    fn from_io(e: std::io::Error) -> Self {
        if !e.get_ref().is_some_and(|inner| inner.is::<BlobError>()) {
            return BlobError::Io(e.to_string());
        }
        match e.into_inner().map(|inner| inner.downcast::<BlobError>()) {
            Some(Ok(blob)) => *blob,
            _ => BlobError::Io("a blob error that was lost on the way".into()),
        }
    }
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
    let mut out = std::io::Cursor::new(Vec::new());
    encode_blob_to(&mut &payload[..], payload.len() as u64, params, &mut out)?;
    Ok(out.into_inner())
}

/// Encodes the `payload_len` bytes `payload` yields into a blob written to `out`, a group of
/// chunks at a time: the same bytes as [`encode_blob`], without either side in memory.
pub fn encode_blob_to<R: Read, W: Write + Seek>(
    payload: &mut R,
    payload_len: u64,
    params: &BlobParams,
    out: &mut W,
) -> Result<(), BlobError> {
    params.validate()?;
    if payload_len > MAX_PAYLOAD {
        return Err(BlobError::Params(format!(
            "payload of {payload_len} bytes exceeds {MAX_PAYLOAD}"
        )));
    }
    let (cs, d, p) = (params.chunk_size, params.data_chunks, params.parity_chunks);
    let rs = ReedSolomon::new(d, p).map_err(|e| BlobError::Erasure(format!("{e:?}")))?;
    let groups = (payload_len as usize).div_ceil(cs).div_ceil(d);
    let table_len = groups * (d + p) * 32;
    // Chunks first, after room for the header and the hash table, which need all of them.
    let io = |e: std::io::Error| BlobError::Io(e.to_string());
    out.seek(SeekFrom::Start((HEADER_LEN + table_len) as u64))
        .map_err(io)?;
    let mut table = Vec::with_capacity(table_len);
    let mut hasher = blake3::Hasher::new();
    let mut left = payload_len as usize;
    let mut shards = vec![vec![0u8; cs]; d + p];
    for _ in 0..groups {
        for shard in &mut shards[..d] {
            let n = left.min(cs);
            payload.read_exact(&mut shard[..n]).map_err(io)?;
            shard[n..].fill(0);
            hasher.update(&shard[..n]);
            left -= n;
        }
        rs.encode(&mut shards)
            .map_err(|e| BlobError::Erasure(format!("{e:?}")))?;
        for shard in &shards {
            table.extend_from_slice(blake3::hash(shard).as_bytes());
            out.write_all(shard).map_err(io)?;
        }
    }
    let header = Header {
        params: *params,
        payload_len,
        payload_hash: *hasher.finalize().as_bytes(),
        table_hash: *blake3::hash(&table).as_bytes(),
    }
    .to_bytes();
    out.write_all(&header).map_err(io)?;
    out.seek(SeekFrom::Start(0)).map_err(io)?;
    out.write_all(&header).map_err(io)?;
    out.write_all(&table).map_err(io)?;
    out.flush().map_err(io)
}

/// Decodes a blob, repairing damaged chunks from parity; never returns a wrong payload.
pub fn decode_blob(bytes: &[u8]) -> Result<DecodedBlob, BlobError> {
    let mut reader = BlobReader::new(std::io::Cursor::new(bytes))?;
    let mut payload = Vec::with_capacity((reader.header.payload_len as usize).min(bytes.len()));
    reader
        .read_to_end(&mut payload)
        .map_err(BlobError::from_io)?;
    let repaired_chunks = reader.finish()?;
    Ok(DecodedBlob {
        payload,
        repaired_chunks,
    })
}

/// A blob's payload read a group of chunks at a time (each checked against its hash and
/// repaired from parity where damaged), so that a large blob is never in memory whole.
///
/// Every byte it yields comes from a chunk whose hash the intact hash table holds; the payload
/// hash is checked when all of it has been read ([`Self::finish`]).
pub struct BlobReader<R> {
    source: R,
    source_len: u64,
    header: Header,
    table: Vec<u8>,
    rs: ReedSolomon,
    /// The next group to decode.
    group: usize,
    /// The current group's payload bytes and how many of them were read.
    buf: Vec<u8>,
    at: usize,
    hasher: blake3::Hasher,
    yielded: u64,
    repaired: usize,
}

impl<R> std::fmt::Debug for BlobReader<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BlobReader")
            .field("payload_len", &self.header.payload_len)
            .field("yielded", &self.yielded)
            .field("repaired", &self.repaired)
            .finish_non_exhaustive()
    }
}

impl<R: Read + Seek> BlobReader<R> {
    /// Opens a blob: finds an intact header copy and checks the hash table.
    pub fn new(mut source: R) -> Result<Self, BlobError> {
        let io = BlobError::from_io;
        let source_len = source.seek(SeekFrom::End(0)).map_err(io)?;
        let mut read_header = |at: u64| -> Option<Header> {
            let mut b = vec![0u8; HEADER_LEN];
            source.seek(SeekFrom::Start(at)).ok()?;
            source.read_exact(&mut b).ok()?;
            Header::parse(&b)
        };
        let header = read_header(0)
            .or_else(|| {
                source_len
                    .checked_sub(HEADER_LEN as u64)
                    .and_then(&mut read_header)
            })
            .ok_or(BlobError::Header)?;
        let (d, p) = (header.params.data_chunks, header.params.parity_chunks);
        // The hash table must be intact: it is what tells good chunks from bad ones.
        let table_len = header.total_chunks() * 32;
        if (HEADER_LEN + table_len) as u64 > source_len {
            return Err(BlobError::Header);
        }
        let mut table = vec![0u8; table_len];
        source
            .seek(SeekFrom::Start(HEADER_LEN as u64))
            .and_then(|_| source.read_exact(&mut table))
            .map_err(io)?;
        if blake3::hash(&table).as_bytes() != &header.table_hash {
            return Err(BlobError::Header);
        }
        let rs = ReedSolomon::new(d, p).map_err(|e| BlobError::Erasure(format!("{e:?}")))?;
        Ok(Self {
            source,
            source_len,
            header,
            table,
            rs,
            group: 0,
            buf: Vec::new(),
            at: 0,
            hasher: blake3::Hasher::new(),
            yielded: 0,
            repaired: 0,
        })
    }

    /// Bytes of the payload.
    pub fn payload_len(&self) -> u64 {
        self.header.payload_len
    }

    /// Decodes the next group into the buffer.
    fn next_group(&mut self) -> Result<(), BlobError> {
        let (cs, d, p) = (
            self.header.params.chunk_size,
            self.header.params.data_chunks,
            self.header.params.parity_chunks,
        );
        let g = self.group;
        let table_end = (HEADER_LEN + self.table.len()) as u64;
        let mut shards: Vec<Option<Vec<u8>>> = Vec::with_capacity(d + p);
        for i in 0..d + p {
            let idx = g * (d + p) + i;
            let start = table_end + (idx * cs) as u64;
            let mut c = vec![0u8; cs];
            let intact = start + cs as u64 <= self.source_len
                && self.source.seek(SeekFrom::Start(start)).is_ok()
                && self.source.read_exact(&mut c).is_ok()
                && blake3::hash(&c).as_bytes()[..] == self.table[idx * 32..idx * 32 + 32];
            shards.push(intact.then_some(c));
        }
        let damaged = shards.iter().filter(|s| s.is_none()).count();
        if damaged > p {
            return Err(BlobError::Unrepairable {
                group: g,
                damaged,
                parity: p,
            });
        }
        if damaged > 0 {
            self.rs
                .reconstruct_data(&mut shards)
                .map_err(|e| BlobError::Erasure(format!("{e:?}")))?;
            self.repaired += damaged;
        }
        self.buf.clear();
        let left = self.header.payload_len - self.yielded;
        for s in shards.into_iter().take(d) {
            let s = s.ok_or(BlobError::PayloadHash)?;
            let want = (left as usize - self.buf.len()).min(cs);
            self.buf.extend_from_slice(&s[..want]);
            if self.buf.len() as u64 == left {
                break;
            }
        }
        self.hasher.update(&self.buf);
        self.at = 0;
        self.group += 1;
        Ok(())
    }

    /// Reads what is left and checks the payload's hash; the chunks repaired on the way.
    pub fn finish(mut self) -> Result<usize, BlobError> {
        std::io::copy(&mut self, &mut std::io::sink()).map_err(BlobError::from_io)?;
        if self.yielded != self.header.payload_len
            || self.hasher.finalize().as_bytes() != &self.header.payload_hash
        {
            return Err(BlobError::PayloadHash);
        }
        Ok(self.repaired)
    }
}

impl<R: Read + Seek> Read for BlobReader<R> {
    fn read(&mut self, out: &mut [u8]) -> std::io::Result<usize> {
        if self.at == self.buf.len() {
            if self.yielded == self.header.payload_len {
                return Ok(0);
            }
            self.next_group().map_err(std::io::Error::other)?;
        }
        let n = out.len().min(self.buf.len() - self.at);
        out[..n].copy_from_slice(&self.buf[self.at..self.at + n]);
        self.at += n;
        self.yielded += n as u64;
        Ok(n)
    }
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

    #[test]
    fn a_reader_read_in_pieces_yields_the_payload_and_checks_its_hash() {
        let p = payload(3000);
        let blob = encode_blob(&p, &SMALL).unwrap();
        let mut r = BlobReader::new(std::io::Cursor::new(&blob)).unwrap();
        let mut head = vec![0u8; 700];
        r.read_exact(&mut head).unwrap();
        assert_eq!(head, p[..700]);
        // The rest is read and hashed by finish.
        assert_eq!(r.finish().unwrap(), 0);
        // A damaged chunk is repaired on the way.
        let mut damaged = blob.clone();
        damaged[HEADER_LEN + 72 * 32 + 10] ^= 1; // 47 chunks: 12 groups of 4 + 2
        let mut r = BlobReader::new(std::io::Cursor::new(&damaged)).unwrap();
        let mut all = Vec::new();
        r.read_to_end(&mut all).unwrap();
        assert_eq!(all, p);
        assert_eq!(r.finish().unwrap(), 1);
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
