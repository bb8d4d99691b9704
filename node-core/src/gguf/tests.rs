//! Tests of [`super`].

use super::*;
use proptest::prelude::*;

/// Serialises a small GGUF v3 file: metadata of several types, an F32, a Q8_0 and a Q4_1 tensor.
fn tiny_file() -> Vec<u8> {
    let mut b = Vec::new();
    let s = |b: &mut Vec<u8>, s: &str| {
        b.extend_from_slice(&(s.len() as u64).to_le_bytes());
        b.extend_from_slice(s.as_bytes());
    };
    b.extend_from_slice(b"GGUF");
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&3u64.to_le_bytes()); // tensors
    b.extend_from_slice(&4u64.to_le_bytes()); // kv
    s(&mut b, "general.architecture");
    b.extend_from_slice(&8u32.to_le_bytes());
    s(&mut b, "llama");
    s(&mut b, "llama.block_count");
    b.extend_from_slice(&4u32.to_le_bytes());
    b.extend_from_slice(&30u32.to_le_bytes());
    s(&mut b, "eps");
    b.extend_from_slice(&6u32.to_le_bytes());
    b.extend_from_slice(&1e-5f32.to_le_bytes());
    s(&mut b, "tokens");
    b.extend_from_slice(&9u32.to_le_bytes());
    b.extend_from_slice(&8u32.to_le_bytes());
    b.extend_from_slice(&2u64.to_le_bytes());
    s(&mut b, "a");
    s(&mut b, "bc");
    // Tensor infos: f32 [2,3] (ne0 = 3), q8_0 [32], q4_1 [32].
    let mut info = |name: &str, dims: &[u64], ty: u32, off: u64| {
        s(&mut b, name);
        b.extend_from_slice(&(dims.len() as u32).to_le_bytes());
        for d in dims {
            b.extend_from_slice(&d.to_le_bytes());
        }
        b.extend_from_slice(&ty.to_le_bytes());
        b.extend_from_slice(&off.to_le_bytes());
    };
    info("w", &[3, 2], 0, 0);
    info("q8", &[32], 8, 32);
    info("q41", &[32], 3, 96);
    while b.len() % 32 != 0 {
        b.push(0);
    }
    for v in [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0] {
        b.extend_from_slice(&v.to_le_bytes());
    }
    b.resize(b.len() + 8, 0); // pad to offset 32
    b.extend_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
    b.extend((0..32).map(|i| (i as i8 - 16) as u8));
    b.resize(b.len() + 30, 0); // to offset 96
    b.extend_from_slice(&half::f16::from_f32(2.0).to_le_bytes());
    b.extend_from_slice(&half::f16::from_f32(-1.0).to_le_bytes());
    b.extend((0..16).map(|i| (i as u8) | ((15 - i as u8) << 4)));
    b
}

#[test]
fn reads_metadata_and_dequantizes() {
    let bytes = tiny_file();
    let f = GgufFile::parse(&bytes).unwrap();
    assert_eq!(f.version(), 3);
    assert_eq!(f.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(f.get_u32("llama.block_count").unwrap(), 30);
    assert_eq!(f.get_f32("eps").unwrap(), 1e-5);
    assert_eq!(f.get_str_array("tokens").unwrap(), vec!["a", "bc"]);
    assert!(matches!(f.get_u32("eps"), Err(GgufError::WrongType { .. })));
    assert!(matches!(f.get_u32("nope"), Err(GgufError::MissingKey(_))));
    assert_eq!(f.tensor("w").unwrap().shape, vec![2, 3]);
    assert_eq!(
        f.tensor_f32(&bytes, "w").unwrap(),
        vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    );
    let q8 = f.tensor_f32(&bytes, "q8").unwrap();
    assert_eq!(q8[0], -8.0);
    assert_eq!(q8[31], 7.5);
    let q41 = f.tensor_f32(&bytes, "q41").unwrap();
    // Low nibbles are elements 0..16, high nibbles 16..32: x = d·q + m.
    assert_eq!(q41[0], -1.0);
    assert_eq!(q41[15], 29.0);
    assert_eq!(q41[16], 29.0);
    assert_eq!(q41[31], -1.0);
}

#[test]
fn damaged_files_are_clear_errors() {
    let bytes = tiny_file();
    assert!(matches!(
        GgufFile::parse(b"GGML\x03\0\0\0"),
        Err(GgufError::BadMagic(_))
    ));
    let mut v9 = bytes.clone();
    v9[4] = 9;
    assert!(matches!(GgufFile::parse(&v9), Err(GgufError::Version(9))));
    // Cut inside the tensor data: the last tensor lies outside the file.
    let cut = &bytes[..bytes.len() - 4];
    assert!(GgufFile::parse(cut).is_err());
    // A huge metadata count cannot allocate.
    let mut huge = bytes.clone();
    huge[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(GgufFile::parse(&huge).is_err());
}

/// Test vectors of tests/reference/gguf_quants.py, one file per quantized type: u32 type id,
/// u32 block count, the blocks, then the `gguf` package's dequantization as f32, all
/// little-endian.
macro_rules! vectors {
    ($($name:literal),* $(,)?) => {
        [$(include_bytes!(concat!("../../../tests/testdata/gguf-quants/", $name, ".bin")).as_slice()),*]
    };
}
const VECTORS: [&[u8]; 11] = vectors![
    "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "q8_k",
];

/// One vector file: its type, blocks of raw bytes, and the expected values of each.
struct Vectors<'a> {
    id: u32,
    ty: GgmlType,
    per_block: usize,
    blocks: Vec<&'a [u8]>,
    expected: Vec<Vec<f32>>,
}

fn vectors(file: &[u8]) -> Vectors<'_> {
    let word = |at: usize| u32::from_le_bytes(file[at..at + 4].try_into().unwrap());
    let id = word(0);
    let ty = GgmlType::from_id(id);
    let n = word(4) as usize;
    let (per_block, block_bytes) = ty.block().unwrap();
    let (raw, values) = file[8..].split_at(n * block_bytes);
    assert_eq!(values.len(), n * per_block * 4, "{ty:?} vector file length");
    let values: Vec<f32> = values
        .as_chunks::<4>()
        .0
        .iter()
        .map(|b| f32::from_le_bytes(*b))
        .collect();
    Vectors {
        id,
        ty,
        per_block,
        blocks: raw.chunks_exact(block_bytes).collect(),
        expected: values
            .chunks_exact(per_block)
            .map(<[f32]>::to_vec)
            .collect(),
    }
}

/// Bits, so that -0.0 and 0.0 differ too.
fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Bit for bit, not within an ulp: every value is computed with the reference's f32
/// operations in its order, with no fused multiply-add, so not even the last bit may differ.
/// (Most of them cannot round anyway: an f16 scale times the small integer factors is exact
/// in f32. What rounds is subtracting a minimum, adding Q4_1's and Q5_1's, and Q8_K's f32
/// scale times its quant.)
#[test]
fn dequantization_matches_the_gguf_reference_block_by_block() {
    let mut types = Vec::new();
    for file in VECTORS {
        let v = vectors(file);
        types.push(v.ty);
        for (i, (block, expected)) in v.blocks.iter().zip(&v.expected).enumerate() {
            let got = dequantize(v.ty, block, v.per_block).unwrap();
            assert_eq!(bits(&got), bits(expected), "{:?} block {i}", v.ty);
        }
        let all = dequantize(v.ty, &v.blocks.concat(), v.blocks.len() * v.per_block).unwrap();
        assert_eq!(bits(&all), bits(&v.expected.concat()), "{:?} run", v.ty);
    }
    // Every quantized type the reader knows has vectors.
    let quantized: Vec<GgmlType> = (0..64)
        .map(GgmlType::from_id)
        .filter(|t| t.block().is_some_and(|(per_block, _)| per_block > 1))
        .collect();
    assert_eq!(types, quantized);
}

/// Byte offsets of each type's scale fields, f16 except Q8_K's f32.
fn scale_fields(ty: GgmlType) -> &'static [usize] {
    match ty {
        GgmlType::Q4_0 | GgmlType::Q5_0 | GgmlType::Q8_0 | GgmlType::Q8_K => &[0],
        GgmlType::Q4_1 | GgmlType::Q5_1 | GgmlType::Q4_K | GgmlType::Q5_K => &[0, 2],
        GgmlType::Q2_K => &[80, 82],
        GgmlType::Q3_K => &[108],
        GgmlType::Q6_K => &[208],
        _ => &[],
    }
}

#[test]
fn damaged_blocks_are_clear_errors() {
    for file in VECTORS {
        let v = vectors(file);
        let (ty, n) = (v.ty, v.per_block);
        let two = v.blocks[..2].concat();
        // Truncated: a byte short of two blocks, or of one.
        for data in [&two[..two.len() - 1], &v.blocks[0][..v.blocks[0].len() - 1]] {
            let e = dequantize(ty, data, data.len() / v.blocks[0].len() * n + n);
            assert!(matches!(e, Err(GgufError::Invalid { .. })), "{ty:?}: {e:?}");
        }
        // Element counts that two blocks do not hold.
        for wrong in [n, 3 * n, 2 * n - 1, 2 * n + 1, 0] {
            let e = dequantize(ty, &two, wrong);
            assert!(
                matches!(e, Err(GgufError::Invalid { .. })),
                "{ty:?} {wrong}: {e:?}"
            );
        }
        // A non-finite scale or minimum in the second block.
        for &at in scale_fields(ty) {
            let patches: Vec<Vec<u8>> = if ty == GgmlType::Q8_K {
                [f32::INFINITY, f32::NEG_INFINITY, f32::NAN]
                    .map(|x| x.to_le_bytes().to_vec())
                    .to_vec()
            } else {
                [half::f16::INFINITY, half::f16::NEG_INFINITY, half::f16::NAN]
                    .map(|x| x.to_le_bytes().to_vec())
                    .to_vec()
            };
            for patch in patches {
                let mut bad = two.clone();
                let at = v.blocks[0].len() + at;
                bad[at..at + patch.len()].copy_from_slice(&patch);
                let e = dequantize(ty, &bad, 2 * n);
                assert!(
                    matches!(e, Err(GgufError::NonFiniteScale { offset, value, .. })
                        if offset == v.blocks[0].len() && !value.is_finite()),
                    "{ty:?} scale at {at}: {e:?}"
                );
            }
        }
    }
}

/// A GGUF v3 file with no metadata and one tensor per `(name, ggml dims, type id, data)`,
/// each aligned to 32 bytes.
fn file_of(tensors: &[(String, Vec<u64>, u32, Vec<u8>)]) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(b"GGUF");
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    b.extend_from_slice(&0u64.to_le_bytes()); // kv
    let mut offset = 0u64;
    for (name, dims, ty, data) in tensors {
        b.extend_from_slice(&(name.len() as u64).to_le_bytes());
        b.extend_from_slice(name.as_bytes());
        b.extend_from_slice(&(dims.len() as u32).to_le_bytes());
        for d in dims {
            b.extend_from_slice(&d.to_le_bytes());
        }
        b.extend_from_slice(&ty.to_le_bytes());
        b.extend_from_slice(&offset.to_le_bytes());
        offset = (offset + data.len() as u64).div_ceil(32) * 32;
    }
    for (_, _, _, data) in tensors {
        b.resize(b.len().div_ceil(32) * 32, 0);
        b.extend_from_slice(data);
    }
    b
}

/// Each vector file's blocks as a tensor of one row per block.
fn vectors_file() -> Vec<u8> {
    let tensors: Vec<_> = VECTORS
        .iter()
        .map(|file| {
            let v = vectors(file);
            let dims = vec![v.per_block as u64, v.blocks.len() as u64];
            (format!("{:?}", v.ty), dims, v.id, v.blocks.concat())
        })
        .collect();
    file_of(&tensors)
}

#[test]
fn a_file_of_every_quantized_type_loads() {
    let bytes = vectors_file();
    let f = GgufFile::parse(&bytes).unwrap();
    for file in VECTORS {
        let v = vectors(file);
        let name = format!("{:?}", v.ty);
        let info = f.tensor(&name).unwrap();
        assert_eq!(info.ggml_type, v.ty);
        assert_eq!(info.shape, vec![v.blocks.len(), v.per_block]);
        let got = f.tensor_f32(&bytes, &name).unwrap();
        assert_eq!(bits(&got), bits(&v.expected.concat()), "{name}");
    }
    // A row that is not a whole number of 256-element super-blocks is refused.
    let q4_k = vectors(VECTORS[7]);
    assert_eq!(q4_k.ty, GgmlType::Q4_K);
    let half_rows = file_of(&[("t".into(), vec![128, 2], 12, q4_k.blocks[0].to_vec())]);
    assert!(matches!(
        GgufFile::parse(&half_rows),
        Err(GgufError::Invalid { what: "tensor", .. })
    ));
    // A scale made infinite in the file names the tensor and the block's place in the file.
    let mut inf = file_of(&[("t".into(), vec![256, 2], 12, q4_k.blocks[..2].concat())]);
    let start = GgufFile::parse(&inf).unwrap().tensors()[0].offset as usize;
    let second = start + q4_k.blocks[0].len();
    inf[second..second + 2].copy_from_slice(&[0x00, 0x7c]);
    let e = GgufFile::parse(&inf).unwrap().tensor_f32(&inf, "t");
    assert!(
        matches!(&e, Err(GgufError::NonFiniteScale { tensor, offset, .. }) if tensor == "t" && *offset == second),
        "{e:?}"
    );
}

proptest! {
    #[test]
    fn arbitrary_damage_never_panics(flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..8), cut in any::<usize>(), every_type in any::<bool>()) {
        let mut bytes = if every_type { vectors_file() } else { tiny_file() };
        for (i, v) in flips {
            let n = bytes.len();
            bytes[i % n] = v;
        }
        let len = bytes.len();
        bytes.truncate(cut % (len + 1));
        if let Ok(f) = GgufFile::parse(&bytes) {
            for t in f.tensors().to_vec() {
                let _ = f.tensor_f32(&bytes, &t.name);
            }
        }
    }
}
