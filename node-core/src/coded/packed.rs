//! A parity row's i16 sums as they are stored: entropy-coded, since the sums of a parity row
//! carry 8–9 bits of information each and two bytes (or postcard's varints, ~1.45 bytes)
//! waste the rest (docs/perf-history.md, "Blob sizes"). Each value is zigzagged, then split into a
//! high part, coded with the measured frequencies of the vector, and `low` uniform low bits;
//! both go through one rANS stack (the `constriction` crate).
//!
//! Layout (little-endian): version `u8`, value count `u64`, low bits `u8`, high-part
//! alphabet `u16`, that many 24-bit fixed-point probabilities (`u32` each), then the rANS
//! words (`u32` each). The bytes are untrusted when they come from a blob: every field is
//! checked, and the count is bounded by the bits present (each value takes at least `low ≥ 1`
//! bits), so no input allocates more than eight values per byte it holds.

use constriction::stream::model::{
    DefaultContiguousCategoricalEntropyModel, DefaultUniformModel, IterableEntropyModel,
};
use constriction::stream::stack::DefaultAnsCoder;
use constriction::stream::{Decode, Encode};

/// The format written.
const VERSION: u8 = 1;
/// Bits of a zigzagged value that go through the frequency model at most; the rest are coded
/// as uniform low bits (which they nearly are, this far below the spread of the values).
const HIGH_BITS: u32 = 10;
/// Bytes before the probabilities: version, count, low bits, alphabet.
const HEADER: usize = 1 + 8 + 1 + 2;

/// Pushed before the values, read after them (two 16-bit halves).
const SEAL: [u16; 2] = [0x434d, 0x5031];

/// The seal's model: 16 uniform bits.
fn seal_model() -> DefaultUniformModel {
    DefaultUniformModel::new(1 << 16)
}

/// Why packed values could not be read.
#[derive(Debug, thiserror::Error)]
#[error("packed i16 values: {0}")]
pub struct PackError(String);

fn zigzag(v: i16) -> u16 {
    ((v << 1) ^ (v >> 15)) as u16
}

fn unzigzag(z: u16) -> i16 {
    ((z >> 1) as i16) ^ -((z & 1) as i16)
}

/// `values`, entropy-coded.
pub fn pack(values: &[i16]) -> Result<Vec<u8>, PackError> {
    let (mut out, words) = pack_parts(values)?;
    out.reserve_exact(4 * words.len());
    for w in words {
        out.extend_from_slice(&w.to_le_bytes());
    }
    Ok(out)
}

/// [`pack`]'s bytes in two parts: the header with the probabilities, and the rANS words
/// (reserved once from the values' entropy, so that a large row's words never double).
fn pack_parts(values: &[i16]) -> Result<(Vec<u8>, Vec<u32>), PackError> {
    fn coding(e: impl std::fmt::Debug) -> PackError {
        PackError(format!("coding: {e:?}"))
    }
    let max = values.iter().map(|&v| zigzag(v)).max().unwrap_or(0);
    let low = (u16::BITS - max.leading_zeros())
        .saturating_sub(HIGH_BITS)
        .max(1);
    // The model needs two symbols at least; no values get a flat one.
    let alphabet = ((usize::from(max) >> low) + 1).max(2);
    let mut counts = vec![f64::from(u8::from(values.is_empty())); alphabet];
    for &v in values {
        counts[usize::from(zigzag(v) >> low)] += 1.0;
    }
    // Leaky: every symbol gets a probability, so any high part can be coded.
    let model = DefaultContiguousCategoricalEntropyModel::from_floating_point_probabilities_fast(
        &counts, None,
    )
    .map_err(|()| PackError("no distribution of the values".into()))?;
    let mut out = Vec::with_capacity(HEADER + 4 * alphabet);
    out.push(VERSION);
    out.extend_from_slice(&(values.len() as u64).to_le_bytes());
    out.push(low as u8);
    out.extend_from_slice(&(alphabet as u16).to_le_bytes());
    for (_, _, p) in model.symbol_table() {
        out.extend_from_slice(&p.get().to_le_bytes());
    }
    let uniform = DefaultUniformModel::new(1 << low);
    // The words the values take: their entropy under the model, the low bits, the seal and
    // the state, and a margin for the model's rounding.
    let n = values.len() as f64;
    let bits: f64 = counts
        .iter()
        .filter(|&&c| c > 0.0)
        .map(|&c| c * (n / c).log2().max(0.0))
        .sum::<f64>()
        + n * f64::from(low);
    let words = (bits / 32.0 * 1.02) as usize + 1024;
    // An empty bulk with a zero state is a new coder (`AnsCoder::default`).
    let mut coder = DefaultAnsCoder::from_raw_parts(Vec::with_capacity(words), 0);
    // The seal goes in first and comes out last: it fills the coder's state, so every value
    // after it costs its bits in words (an empty coder's state codes the first symbols
    // nearly free, which would break the count's bound), and it checks the end.
    for half in SEAL {
        coder
            .encode_symbol(usize::from(half), seal_model())
            .map_err(coding)?;
    }
    // A stack: the last value is pushed first, and each value's low bits before its high
    // part, so decoding reads the values in order, high part first.
    for &v in values.iter().rev() {
        let z = usize::from(zigzag(v));
        coder
            .encode_symbol(z & ((1 << low) - 1), uniform)
            .and_then(|()| coder.encode_symbol(z >> low, &model))
            .map_err(coding)?;
    }
    Ok((out, coder.into_compressed().map_err(coding)?))
}

/// Values [`pack`] wrote, from untrusted bytes.
pub fn unpack(bytes: &[u8]) -> Result<Vec<i16>, PackError> {
    let bad = |why: &str| PackError(why.to_string());
    if bytes.len() < HEADER {
        return Err(bad("shorter than the header"));
    }
    if bytes[0] != VERSION {
        return Err(PackError(format!("unknown format {}", bytes[0])));
    }
    let mut count = [0u8; 8];
    count.copy_from_slice(&bytes[1..9]);
    let count = u64::from_le_bytes(count);
    let low = u32::from(bytes[9]);
    let alphabet = usize::from(u16::from_le_bytes([bytes[10], bytes[11]]));
    if !(1..=16).contains(&low) {
        return Err(PackError(format!("{low} low bits")));
    }
    if alphabet < 2 || alphabet > (usize::from(u16::MAX) >> low) + 1 {
        return Err(PackError(format!(
            "a high-part alphabet of {alphabet} with {low} low bits"
        )));
    }
    let body = &bytes[HEADER..];
    if body.len() < 4 * alphabet || !(body.len() - 4 * alphabet).is_multiple_of(4) {
        return Err(bad("the probabilities and words do not fill the bytes"));
    }
    let (probs, words) = body.split_at(4 * alphabet);
    let word = |c: &[u8; 4]| u32::from_le_bytes(*c);
    let words: Vec<u32> = words.as_chunks::<4>().0.iter().map(word).collect();
    // Each value takes `low` bits of the words at least (the seal filled the state first).
    let bits = 32 * words.len() as u64 + 64;
    if count.saturating_mul(u64::from(low)) > bits {
        return Err(PackError(format!(
            "{count} values cannot fit in {} words",
            words.len()
        )));
    }
    if count == 0 {
        return Ok(Vec::new());
    }
    let count = usize::try_from(count).map_err(|_| bad("more values than this machine holds"))?;
    let model = DefaultContiguousCategoricalEntropyModel::from_nonzero_fixed_point_probabilities(
        probs.as_chunks::<4>().0.iter().map(word),
        false,
    )
    .map_err(|()| bad("the probabilities are not a distribution"))?;
    let uniform = DefaultUniformModel::new(1 << low);
    let mut coder = DefaultAnsCoder::from_compressed(words)
        .map_err(|_| bad("the words do not end an rANS stream"))?;
    let mut out = Vec::with_capacity(count);
    for _ in 0..count {
        let high = coder
            .decode_symbol(&model)
            .map_err(|e| PackError(format!("decoding: {e:?}")))?;
        let lo = coder
            .decode_symbol(uniform)
            .map_err(|e| PackError(format!("decoding: {e:?}")))?;
        // high < alphabet ≤ (u16::MAX >> low) + 1 and lo < 2^low: the value fits.
        let z = u16::try_from((high << low) | lo).map_err(|_| bad("a value out of range"))?;
        out.push(unzigzag(z));
    }
    for half in SEAL.iter().rev() {
        let got = coder
            .decode_symbol(seal_model())
            .map_err(|e| PackError(format!("decoding: {e:?}")))?;
        if got != usize::from(*half) {
            return Err(bad("the seal after the last value is wrong"));
        }
    }
    if !coder.is_empty() {
        return Err(bad("words left over after the last value"));
    }
    Ok(out)
}

/// Serde for a parity row's values: packed bytes on the wire, `Vec<i16>` in memory.
pub mod serde_packed {
    use std::sync::Arc;

    use serde::{Deserialize, Deserializer, Serializer};

    /// Writes the values packed: as a sequence of bytes (in postcard the same bytes as a byte
    /// string), straight from the rANS words, so that no copy of them is made.
    pub fn serialize<S: Serializer>(values: &[i16], s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeSeq;
        let (head, words) = super::pack_parts(values).map_err(serde::ser::Error::custom)?;
        let mut seq = s.serialize_seq(Some(head.len() + 4 * words.len()))?;
        for b in head
            .iter()
            .copied()
            .chain(words.iter().flat_map(|w| w.to_le_bytes()))
        {
            seq.serialize_element(&b)?;
        }
        seq.end()
    }

    /// Reads packed values: as a sequence of bytes (the same bytes in postcard), which a
    /// reader streams without a buffer the size of the whole string.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Arc<Vec<i16>>, D::Error> {
        let bytes = Vec::<u8>::deserialize(d)?;
        super::unpack(&bytes)
            .map(Arc::new)
            .map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

    use rand::{Rng, SeedableRng};

    use super::*;

    /// Sums like a parity row's: a few i8 values times small integer coefficients.
    fn sums(n: usize, seed: u64) -> Vec<i16> {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        (0..n)
            .map(|_| {
                (0..3)
                    .map(|c| (c + 1) * i16::from(rng.random_range(-127i8..=127) / 3))
                    .sum()
            })
            .collect()
    }

    #[test]
    fn values_come_back_exactly() {
        for values in [
            Vec::new(),
            vec![0],
            vec![i16::MIN, i16::MAX, -1, 0, 1],
            vec![7; 1000],
            sums(100_000, 1),
            (i16::MIN..=i16::MAX).collect(),
        ] {
            assert_eq!(unpack(&pack(&values).unwrap()).unwrap(), values);
        }
    }

    #[test]
    fn serde_writes_the_packed_bytes_as_a_byte_string_and_reads_them_back() {
        #[derive(serde::Serialize, serde::Deserialize)]
        struct Row(#[serde(with = "serde_packed")] std::sync::Arc<Vec<i16>>);
        for values in [Vec::new(), vec![7, -3, 0], sums(100_000, 4)] {
            let bytes = postcard::to_allocvec(&Row(values.clone().into())).unwrap();
            let packed = pack(&values).unwrap();
            // postcard's byte string: the length as a varint, then the bytes.
            let mut want = postcard::to_allocvec(&(packed.len() as u64)).unwrap();
            want.extend_from_slice(&packed);
            assert_eq!(bytes, want);
            let back: Row = postcard::from_bytes(&bytes).unwrap();
            assert_eq!(*back.0, values);
            // The words were reserved once: never doubled on the way.
            let (_, words) = pack_parts(&values).unwrap();
            assert!(
                words.capacity() <= words.len() * 21 / 20 + 1024,
                "{} words in {}",
                words.len(),
                words.capacity()
            );
        }
    }

    #[test]
    fn sums_take_about_their_entropy() {
        let values = sums(200_000, 2);
        let mut counts = std::collections::HashMap::new();
        for &v in &values {
            *counts.entry(v).or_insert(0usize) += 1;
        }
        let n = values.len() as f64;
        let entropy: f64 = counts
            .values()
            .map(|&c| -(c as f64 / n) * (c as f64 / n).log2())
            .sum();
        let bits = 8.0 * pack(&values).unwrap().len() as f64 / n;
        assert!(
            bits < entropy + 0.05,
            "{bits:.3} bits a value against an entropy of {entropy:.3}"
        );
    }

    #[test]
    fn damaged_bytes_are_refused_or_decode_without_panic() {
        let packed = pack(&sums(5_000, 3)).unwrap();
        assert!(unpack(&packed[..packed.len() - 1]).is_err(), "truncated");
        assert!(unpack(&packed[..5]).is_err(), "no header");
        let mut huge = packed.clone();
        huge[1..9].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(unpack(&huge).is_err(), "a count the words cannot hold");
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(4);
        for _ in 0..200 {
            let mut b = packed.clone();
            let at = rng.random_range(0..b.len());
            b[at] ^= 1 << rng.random_range(0..8);
            // Either refused or some values: never a panic.
            let _ = unpack(&b);
        }
    }
}
