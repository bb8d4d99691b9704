//! An update's wire form: postcard, with factor values as raw little-endian f32 or f16 bytes.
//! Canonical: decoding and encoding again gives the same bytes, so a payload's hash is its id.

use half::f16;
use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;

use super::{Precision, StageFactors, Update, UpdateError};
use crate::model::{LeaderWeights, Stage};

/// Tag of the wire format, first in every payload.
const FORMAT: u8 = 2;

/// A stage on the wire: the stage, its rows, the input factor and the output factors (byte
/// runs: the same bytes on the wire as a sequence of u8, read with one copy).
type WireStage = (Stage, u32, ByteBuf, Vec<ByteBuf>);

#[derive(Serialize, Deserialize)]
struct Wire {
    format: u8,
    precision: Precision,
    step: f32,
    t: u32,
    stages: Vec<WireStage>,
    embed_tokens: Vec<u32>,
    #[serde(with = "serde_bytes")]
    embed_dx: Vec<u8>,
    norms: LeaderWeights,
}

fn pack(v: &[f32], p: Precision) -> Vec<u8> {
    match p {
        Precision::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        Precision::F16 => v
            .iter()
            .flat_map(|&x| f16::from_f32(x).to_bits().to_le_bytes())
            .collect(),
    }
}

fn unpack(b: &[u8], p: Precision) -> Result<Vec<f32>, UpdateError> {
    let bad = || UpdateError::Shape("a factor's byte length does not fit its precision".into());
    match p {
        Precision::F32 => {
            let (chunks, rest) = b.as_chunks::<4>();
            if !rest.is_empty() {
                return Err(bad());
            }
            Ok(chunks.iter().map(|c| f32::from_le_bytes(*c)).collect())
        }
        Precision::F16 => {
            let (chunks, rest) = b.as_chunks::<2>();
            if !rest.is_empty() {
                return Err(bad());
            }
            Ok(chunks
                .iter()
                .map(|c| f16::from_bits(u16::from_le_bytes(*c)).to_f32())
                .collect())
        }
    }
}

/// The update's wire form.
pub(super) fn encode(u: &Update) -> Vec<u8> {
    let p = u.precision;
    let wire = Wire {
        format: FORMAT,
        precision: p,
        step: u.step,
        t: u.t,
        stages: u
            .stages
            .iter()
            .map(|f| {
                (
                    f.stage,
                    f.rows,
                    ByteBuf::from(pack(&f.x, p)),
                    f.dy.iter().map(|d| ByteBuf::from(pack(d, p))).collect(),
                )
            })
            .collect(),
        embed_tokens: u.embed_tokens.clone(),
        embed_dx: pack(&u.embed_dx, p),
        norms: u.norms.clone(),
    };
    postcard::to_allocvec(&wire).unwrap_or_default()
}

/// Parses an update's wire form from untrusted bytes.
pub(super) fn decode(bytes: &[u8]) -> Result<Update, UpdateError> {
    let w: Wire = postcard::from_bytes(bytes)
        .map_err(|e| UpdateError::Shape(format!("not an update: {e}")))?;
    if w.format != FORMAT {
        return Err(UpdateError::Shape(format!(
            "update format {} is not this node's {FORMAT}",
            w.format
        )));
    }
    let p = w.precision;
    let stages = w
        .stages
        .into_iter()
        .map(|(stage, rows, x, dy)| {
            Ok(StageFactors {
                stage,
                rows,
                x: unpack(&x, p)?,
                dy: dy.iter().map(|d| unpack(d, p)).collect::<Result<_, _>>()?,
            })
        })
        .collect::<Result<_, UpdateError>>()?;
    Ok(Update {
        step: w.step,
        t: w.t,
        stages,
        embed_tokens: w.embed_tokens,
        embed_dx: unpack(&w.embed_dx, p)?,
        norms: w.norms,
        precision: p,
    })
}

/// Rounds every factor value to the precision's, so that what a leader keeps is what nodes
/// decode.
pub(super) fn round(u: &mut Update) {
    if u.precision == Precision::F16 {
        let r = |v: &mut Vec<f32>| {
            v.iter_mut().for_each(|x| *x = f16::from_f32(*x).to_f32());
        };
        for f in &mut u.stages {
            r(&mut f.x);
            f.dy.iter_mut().for_each(r);
        }
        r(&mut u.embed_dx);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode(&bytes);
        }

        #[test]
        fn f16_factors_round_trip_exactly(values in proptest::collection::vec(-1e4f32..1e4, 0..64)) {
            let packed = pack(&values, Precision::F16);
            let once = unpack(&packed, Precision::F16).unwrap_or_default();
            prop_assert_eq!(pack(&once, Precision::F16), packed);
            for (a, b) in values.iter().zip(&once) {
                prop_assert!((a - b).abs() <= 1e-3 * a.abs() + 1e-7);
            }
        }
    }

    #[test]
    fn odd_lengths_are_refused() {
        assert!(unpack(&[1, 2, 3], Precision::F16).is_err());
        assert!(unpack(&[1, 2, 3, 4, 5], Precision::F32).is_err());
    }
}
