//! An update's wire form: postcard, with factor values as raw little-endian f32 or f16 bytes,
//! and an adapter step's input factors, which are the adapters' fixed projection `V` every node
//! builds alike, as their width alone. Canonical: decoding and encoding again gives the same
//! bytes, so a payload's hash is its id.

use half::f16;
use serde::{Deserialize, Serialize};
use serde_bytes::ByteBuf;

use super::{Precision, StageFactors, Update, UpdateError};
use crate::coded::{Projection, adapter_rank};
use crate::model::{LeaderWeights, Stage};

/// Tag of the wire format, first in every payload.
const FORMAT: u8 = 3;

/// The widest input a projection named on the wire may have (a model's widest matrix input is
/// a few tens of thousands).
const MAX_PROJECTION_COLS: usize = 1 << 20;

/// Projection values any payload may name, whatever its size (4 MiB of f32), beyond four a
/// byte of it.
const FREE_PROJECTED: usize = 1 << 20;

/// A stage on the wire: the stage, its rows, the input factor and the output factors (byte
/// runs: the same bytes on the wire as a sequence of u8, read with one copy).
type WireStage = (Stage, u32, WireX, Vec<ByteBuf>);

/// A stage's input factor on the wire.
#[derive(Serialize, Deserialize)]
enum WireX {
    /// Its values.
    Values(ByteBuf),
    /// The adapters' projection `V` of this many inputs ([`Projection`]): an adapter step's,
    /// which every node builds alike, so it need not travel.
    Projection(u32),
}

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
                let x = match projection_width(f) {
                    Some(cols) => WireX::Projection(cols as u32),
                    None => WireX::Values(ByteBuf::from(pack(&f.x, p))),
                };
                (
                    f.stage,
                    f.rows,
                    x,
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
    // What the projections named cost in memory is bounded by the payload's own size (a real
    // model's update names a third as many values as it has bytes), so that a few bytes cannot
    // make a node build gigabytes.
    let most = FREE_PROJECTED + 4 * bytes.len();
    let mut projected = 0usize;
    let stages = w
        .stages
        .into_iter()
        .map(|(stage, rows, x, dy)| {
            let (x, as_values) = match x {
                WireX::Values(x) => (unpack(&x, p)?, true),
                WireX::Projection(cols) => {
                    let cols = cols as usize;
                    if cols == 0
                        || cols > MAX_PROJECTION_COLS
                        || adapter_rank(cols) != rows as usize
                    {
                        return Err(UpdateError::Shape(format!(
                            "{stage:?} names a projection of {cols} inputs for {rows} rows"
                        )));
                    }
                    projected += rows as usize * cols;
                    if projected > most {
                        return Err(UpdateError::Shape(format!(
                            "the projections named hold more than {most} values, too many for \
                             a payload of {} bytes",
                            bytes.len()
                        )));
                    }
                    (Projection::passing(cols).matrix().to_vec(), false)
                }
            };
            let f = StageFactors {
                stage,
                rows,
                x,
                dy: dy.iter().map(|d| unpack(d, p)).collect::<Result<_, _>>()?,
            };
            if as_values && projection_width(&f).is_some() {
                // Sent as values, it would hash differently from the same update sent as a width.
                return Err(UpdateError::Shape(format!(
                    "{stage:?}'s input factor is the adapters' projection, sent as its values"
                )));
            }
            Ok(f)
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

/// The width of the adapters' projection `f`'s input factor is, if it is one (an adapter step's).
fn projection_width(f: &StageFactors) -> Option<usize> {
    let rows = f.rows as usize;
    if rows == 0 || f.x.is_empty() || !f.x.len().is_multiple_of(rows) {
        return None;
    }
    let cols = f.x.len() / rows;
    if cols > MAX_PROJECTION_COLS
        || adapter_rank(cols) != rows
        || f.x.iter().any(|v| v.abs() != 1.0)
    {
        return None;
    }
    (Projection::passing(cols).matrix() == f.x.as_slice()).then_some(cols)
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

    /// An adapter step of one `GateUp` stage with `cols` inputs: `V` as its input factor.
    fn adapter_step(cols: usize) -> Update {
        let proj = Projection::of(cols);
        let rows = proj.rank();
        Update {
            step: 1e-3,
            t: 7,
            stages: vec![StageFactors {
                stage: Stage::GateUp(0),
                rows: rows as u32,
                x: proj.matrix().to_vec(),
                dy: vec![(0..rows * 48).map(|i| (i as f32 * 0.37).sin()).collect(); 2],
            }],
            embed_tokens: Vec::new(),
            embed_dx: Vec::new(),
            norms: LeaderWeights::default(),
            precision: Precision::F16,
        }
    }

    fn wire_of(stages: Vec<WireStage>) -> Vec<u8> {
        postcard::to_allocvec(&Wire {
            format: FORMAT,
            precision: Precision::F16,
            step: 1e-3,
            t: 1,
            stages,
            embed_tokens: Vec::new(),
            embed_dx: Vec::new(),
            norms: LeaderWeights::default(),
        })
        .unwrap()
    }

    #[test]
    fn an_adapter_steps_projection_travels_as_its_width_and_comes_back_whole() {
        let mut u = adapter_step(256);
        round(&mut u);
        let bytes = encode(&u);
        let back = decode(&bytes).unwrap();
        assert_eq!(back, u, "the projection is rebuilt exactly");
        assert_eq!(encode(&back), bytes, "canonical");
        let (rows, cols) = (u.stages[0].rows as usize, 256);
        let dy_bytes = 2 * rows * 48 * 2;
        assert!(
            bytes.len() < dy_bytes + 64,
            "{} bytes for {dy_bytes} of output factors: the {} of V did not travel",
            bytes.len(),
            rows * cols * 2
        );
        // Activations (not ±1) still travel as values.
        let mut other = u.clone();
        other.stages[0].x[3] = 0.5;
        let sent = encode(&other);
        assert!(sent.len() > bytes.len() + rows * cols * 2 - 8);
        assert_eq!(decode(&sent).unwrap(), other);
    }

    #[test]
    fn a_peer_cannot_name_a_projection_larger_than_its_payload_or_send_one_as_values() {
        let dy = || vec![ByteBuf::from(vec![0u8; 32])];
        // The rank's rows of 2^20 inputs would be 32 MiB or more of f32 from a payload of a
        // hundred bytes.
        let rank = adapter_rank(1 << 20) as u32;
        let huge = wire_of(vec![(
            Stage::Down(0),
            rank,
            WireX::Projection(1 << 20),
            dy(),
        )]);
        let e = decode(&huge).unwrap_err().to_string();
        assert!(e.contains("too many for a payload of"), "{e}");
        let wide = wire_of(vec![(
            Stage::Down(0),
            rank,
            WireX::Projection(u32::MAX),
            dy(),
        )]);
        assert!(decode(&wide).is_err());
        // The rows must be the projection's rank.
        let e = decode(&wire_of(vec![(
            Stage::Down(0),
            3,
            WireX::Projection(16),
            dy(),
        )]))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("names a projection of 16 inputs for 3 rows"),
            "{e}"
        );
        // The same step with V sent as values would hash to another id: refused.
        let u = adapter_step(64);
        let f = &u.stages[0];
        let as_values = wire_of(vec![(
            f.stage,
            f.rows,
            WireX::Values(ByteBuf::from(pack(&f.x, Precision::F16))),
            f.dy.iter()
                .map(|d| ByteBuf::from(pack(d, Precision::F16)))
                .collect(),
        )]);
        let e = decode(&as_values).unwrap_err().to_string();
        assert!(e.contains("sent as its values"), "{e}");
    }

    #[test]
    fn odd_lengths_are_refused() {
        assert!(unpack(&[1, 2, 3], Precision::F16).is_err());
        assert!(unpack(&[1, 2, 3, 4, 5], Precision::F32).is_err());
    }
}
