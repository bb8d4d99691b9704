//! GGUF model file reader and dequantization (F32, F16, Q8_0, Q4_0, Q4_1).
//!
//! The file is hostile input: every count, length and offset is checked against the bytes
//! that are actually there before anything is allocated, and nothing panics.

use std::collections::BTreeMap;

/// Everything that can be wrong with a GGUF file.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The file does not start with `GGUF`.
    #[error("not a GGUF file (magic {0:02x?})")]
    BadMagic([u8; 4]),
    /// A GGUF version this reader does not know.
    #[error("GGUF version {0} is not supported (2 and 3 are)")]
    Version(u32),
    /// The file ends inside a structure.
    #[error("file truncated at byte {offset} while reading {what}")]
    Truncated {
        /// Where reading stopped.
        offset: usize,
        /// What was being read.
        what: &'static str,
    },
    /// A field holds a value outside its range.
    #[error("invalid {what} at byte {offset}: {detail}")]
    Invalid {
        /// Where.
        offset: usize,
        /// Which field.
        what: &'static str,
        /// What is wrong.
        detail: String,
    },
    /// A metadata key is absent.
    #[error("metadata key {0:?} is missing")]
    MissingKey(String),
    /// A metadata key has another type.
    #[error("metadata key {key:?} is not {expected}")]
    WrongType {
        /// The key.
        key: String,
        /// The type wanted.
        expected: &'static str,
    },
    /// No tensor of that name.
    #[error("tensor {0:?} is missing")]
    MissingTensor(String),
    /// A tensor of a type this reader cannot dequantize.
    #[error("tensor {name:?} has unsupported type {ty:?}")]
    UnsupportedType {
        /// The tensor.
        name: String,
        /// Its type.
        ty: GgmlType,
    },
}

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    /// u8.
    U8(u8),
    /// i8.
    I8(i8),
    /// u16.
    U16(u16),
    /// i16.
    I16(i16),
    /// u32.
    U32(u32),
    /// i32.
    I32(i32),
    /// u64.
    U64(u64),
    /// i64.
    I64(i64),
    /// f32.
    F32(f32),
    /// f64.
    F64(f64),
    /// bool.
    Bool(bool),
    /// UTF-8 string.
    Str(String),
    /// Array of values of one type.
    Array(Vec<MetaValue>),
}

impl MetaValue {
    fn as_i128(&self) -> Option<i128> {
        Some(match *self {
            MetaValue::U8(v) => v.into(),
            MetaValue::I8(v) => v.into(),
            MetaValue::U16(v) => v.into(),
            MetaValue::I16(v) => v.into(),
            MetaValue::U32(v) => v.into(),
            MetaValue::I32(v) => v.into(),
            MetaValue::U64(v) => v.into(),
            MetaValue::I64(v) => v.into(),
            _ => return None,
        })
    }
}

/// GGML tensor element types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgmlType {
    /// 32-bit float.
    F32,
    /// 16-bit float.
    F16,
    /// 4-bit blocks of 32 with a scale.
    Q4_0,
    /// 4-bit blocks of 32 with a scale and a minimum.
    Q4_1,
    /// 8-bit blocks of 32 with a scale.
    Q8_0,
    /// Any other type id.
    Other(u32),
}

impl GgmlType {
    fn from_id(id: u32) -> Self {
        match id {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            8 => Self::Q8_0,
            other => Self::Other(other),
        }
    }

    /// `(elements per block, bytes per block)`, for the types this reader knows.
    fn block(self) -> Option<(usize, usize)> {
        match self {
            Self::F32 => Some((1, 4)),
            Self::F16 => Some((1, 2)),
            Self::Q4_0 => Some((32, 18)),
            Self::Q4_1 => Some((32, 20)),
            Self::Q8_0 => Some((32, 34)),
            Self::Other(_) => None,
        }
    }
}

/// Where a tensor lives in the file and what it holds.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    /// Tensor name.
    pub name: String,
    /// Shape in row-major order (GGUF's dimensions reversed).
    pub shape: Vec<usize>,
    /// Element type.
    pub ggml_type: GgmlType,
    /// Absolute offset of its data in the file.
    pub offset: u64,
    /// Size of its data in bytes (0 for types this reader cannot size).
    pub n_bytes: u64,
}

/// A parsed GGUF header: metadata and tensor directory.
#[derive(Debug, Clone)]
pub struct GgufFile {
    version: u32,
    metadata: BTreeMap<String, MetaValue>,
    tensors: Vec<TensorInfo>,
}

/// Deepest nesting of metadata arrays accepted.
const MAX_ARRAY_DEPTH: usize = 4;
/// Most dimensions of a tensor.
const MAX_DIMS: usize = 8;

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], GgufError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len());
        match end {
            Some(end) => {
                let s = &self.bytes[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(GgufError::Truncated {
                offset: self.pos,
                what,
            }),
        }
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], GgufError> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &'static str) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    /// A count that must fit in what is left, given each item takes at least `min_size` bytes.
    fn count(&mut self, min_size: usize, what: &'static str) -> Result<usize, GgufError> {
        let at = self.pos;
        let n = self.u64(what)?;
        let max = (self.remaining() / min_size.max(1)) as u64;
        if n > max {
            return Err(GgufError::Invalid {
                offset: at,
                what,
                detail: format!(
                    "count {n} cannot fit in the {} bytes left",
                    self.remaining()
                ),
            });
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &'static str) -> Result<String, GgufError> {
        let at = self.pos;
        let n = self.count(1, what)?;
        let s = self.take(n, what)?;
        String::from_utf8(s.to_vec()).map_err(|_| GgufError::Invalid {
            offset: at,
            what,
            detail: "not UTF-8".into(),
        })
    }

    fn value(&mut self, ty: u32, depth: usize) -> Result<MetaValue, GgufError> {
        let w = "metadata value";
        Ok(match ty {
            0 => MetaValue::U8(self.array::<1>(w)?[0]),
            1 => MetaValue::I8(self.array::<1>(w)?[0] as i8),
            2 => MetaValue::U16(u16::from_le_bytes(self.array(w)?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.array(w)?)),
            4 => MetaValue::U32(self.u32(w)?),
            5 => MetaValue::I32(i32::from_le_bytes(self.array(w)?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.array(w)?)),
            7 => MetaValue::Bool(self.array::<1>(w)?[0] != 0),
            8 => MetaValue::Str(self.string(w)?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::Invalid {
                        offset: self.pos,
                        what: "metadata array",
                        detail: "nested too deeply".into(),
                    });
                }
                let elem = self.u32("array type")?;
                let n = self.count(min_value_size(elem), "array length")?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(elem, depth + 1)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::U64(self.u64(w)?),
            11 => MetaValue::I64(i64::from_le_bytes(self.array(w)?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.array(w)?)),
            other => {
                return Err(GgufError::Invalid {
                    offset: self.pos,
                    what: "metadata type",
                    detail: format!("unknown type id {other}"),
                });
            }
        })
    }
}

/// Smallest encoding of a value of type `ty`, used to bound counts.
fn min_value_size(ty: u32) -> usize {
    match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 | 10..=12 => 8,
        9 => 12,
        _ => 1,
    }
}

impl GgufFile {
    /// Parses the header, metadata and tensor directory of a GGUF file's bytes.
    pub fn parse(bytes: &[u8]) -> Result<Self, GgufError> {
        let mut r = Reader { bytes, pos: 0 };
        let magic: [u8; 4] = r.array("magic")?;
        if &magic != b"GGUF" {
            return Err(GgufError::BadMagic(magic));
        }
        let version = r.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::Version(version));
        }
        let n_tensors = r.count(24, "tensor count")?;
        let n_kv = r.count(12, "metadata count")?;
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = r.string("metadata key")?;
            let ty = r.u32("metadata type")?;
            let value = r.value(ty, 0)?;
            metadata.insert(key, value);
        }
        let mut raw = Vec::with_capacity(n_tensors);
        for _ in 0..n_tensors {
            let at = r.pos;
            let name = r.string("tensor name")?;
            let n_dims = r.u32("tensor dims")? as usize;
            if n_dims == 0 || n_dims > MAX_DIMS {
                return Err(GgufError::Invalid {
                    offset: at,
                    what: "tensor dims",
                    detail: format!("{name:?} has {n_dims} dimensions"),
                });
            }
            let mut dims = Vec::with_capacity(n_dims);
            for _ in 0..n_dims {
                dims.push(r.u64("tensor dim")?);
            }
            let ty = GgmlType::from_id(r.u32("tensor type")?);
            let offset = r.u64("tensor offset")?;
            raw.push((at, name, dims, ty, offset));
        }
        let alignment = match metadata
            .get("general.alignment")
            .and_then(MetaValue::as_i128)
        {
            None => 32u64,
            Some(a) if a > 0 && a <= 1 << 20 && (a as u64).is_power_of_two() => a as u64,
            Some(a) => {
                return Err(GgufError::Invalid {
                    offset: 0,
                    what: "general.alignment",
                    detail: format!("{a} is not a power of two up to 1 MiB"),
                });
            }
        };
        let data_start = (r.pos as u64).div_ceil(alignment) * alignment;
        let file_len = bytes.len() as u64;
        let mut tensors = Vec::with_capacity(raw.len());
        for (at, name, dims, ty, rel) in raw {
            let invalid = |detail: String| GgufError::Invalid {
                offset: at,
                what: "tensor",
                detail: format!("{name:?}: {detail}"),
            };
            let elements = dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .filter(|&e| e <= file_len.saturating_mul(2))
                .ok_or_else(|| invalid(format!("dimensions {dims:?} are too large")))?;
            let n_bytes = match ty.block() {
                Some((per_block, block_bytes)) => {
                    if dims[0] % per_block as u64 != 0 {
                        return Err(invalid(format!(
                            "row of {} is not a multiple of the {per_block}-element block",
                            dims[0]
                        )));
                    }
                    elements / per_block as u64 * block_bytes as u64
                }
                None => 0,
            };
            let offset = data_start
                .checked_add(rel)
                .filter(|o| o.checked_add(n_bytes).is_some_and(|end| end <= file_len))
                .ok_or_else(|| {
                    invalid(format!(
                        "data at {rel} (+{n_bytes} bytes) lies outside the file"
                    ))
                })?;
            let shape = dims.iter().rev().map(|&d| d as usize).collect();
            tensors.push(TensorInfo {
                name,
                shape,
                ggml_type: ty,
                offset,
                n_bytes,
            });
        }
        Ok(Self {
            version,
            metadata,
            tensors,
        })
    }

    /// The GGUF format version.
    pub fn version(&self) -> u32 {
        self.version
    }

    /// All metadata.
    pub fn metadata(&self) -> &BTreeMap<String, MetaValue> {
        &self.metadata
    }

    /// One metadata value.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    fn require(&self, key: &str) -> Result<&MetaValue, GgufError> {
        self.get(key)
            .ok_or_else(|| GgufError::MissingKey(key.to_string()))
    }

    /// An integer value that fits in u32.
    pub fn get_u32(&self, key: &str) -> Result<u32, GgufError> {
        self.require(key)?
            .as_i128()
            .and_then(|v| u32::try_from(v).ok())
            .ok_or_else(|| GgufError::WrongType {
                key: key.to_string(),
                expected: "an integer that fits in u32",
            })
    }

    /// A floating-point value.
    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        match self.require(key)? {
            MetaValue::F32(v) => Ok(*v),
            MetaValue::F64(v) => Ok(*v as f32),
            _ => Err(GgufError::WrongType {
                key: key.to_string(),
                expected: "a float",
            }),
        }
    }

    /// A string value.
    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        match self.require(key)? {
            MetaValue::Str(s) => Ok(s),
            _ => Err(GgufError::WrongType {
                key: key.to_string(),
                expected: "a string",
            }),
        }
    }

    /// An array of strings.
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>, GgufError> {
        let wrong = || GgufError::WrongType {
            key: key.to_string(),
            expected: "an array of strings",
        };
        match self.require(key)? {
            MetaValue::Array(items) => items
                .iter()
                .map(|v| match v {
                    MetaValue::Str(s) => Ok(s.as_str()),
                    _ => Err(wrong()),
                })
                .collect(),
            _ => Err(wrong()),
        }
    }

    /// An array of integers that fit in i32.
    pub fn get_i32_array(&self, key: &str) -> Result<Vec<i32>, GgufError> {
        let wrong = || GgufError::WrongType {
            key: key.to_string(),
            expected: "an array of i32",
        };
        match self.require(key)? {
            MetaValue::Array(items) => items
                .iter()
                .map(|v| {
                    v.as_i128()
                        .and_then(|x| i32::try_from(x).ok())
                        .ok_or_else(wrong)
                })
                .collect(),
            _ => Err(wrong()),
        }
    }

    /// The tensor directory.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// One tensor's entry.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// A tensor dequantized to f32, in storage order (row-major in `shape`).
    pub fn tensor_f32(&self, bytes: &[u8], name: &str) -> Result<Vec<f32>, GgufError> {
        let info = self
            .tensor(name)
            .ok_or_else(|| GgufError::MissingTensor(name.to_string()))?;
        if info.ggml_type.block().is_none() {
            return Err(GgufError::UnsupportedType {
                name: name.to_string(),
                ty: info.ggml_type,
            });
        }
        let start = info.offset as usize;
        let data = bytes
            .get(start..start.saturating_add(info.n_bytes as usize))
            .ok_or(GgufError::Truncated {
                offset: start,
                what: "tensor data",
            })?;
        let elements = info
            .shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| GgufError::Invalid {
                offset: start,
                what: "tensor",
                detail: format!("{name:?}: dimensions {:?} overflow", info.shape),
            })?;
        dequantize(info.ggml_type, data, elements)
    }
}

/// Dequantizes `n_elements` values of type `ty` from `data`.
pub fn dequantize(ty: GgmlType, data: &[u8], n_elements: usize) -> Result<Vec<f32>, GgufError> {
    let (per_block, block_bytes) = ty.block().ok_or(GgufError::UnsupportedType {
        name: String::new(),
        ty,
    })?;
    if !n_elements.is_multiple_of(per_block) || data.len() != n_elements / per_block * block_bytes {
        return Err(GgufError::Invalid {
            offset: 0,
            what: "tensor data",
            detail: format!(
                "{} bytes do not hold {n_elements} elements of {ty:?}",
                data.len()
            ),
        });
    }
    let f16 = |b: &[u8]| half::f16::from_le_bytes([b[0], b[1]]).to_f32();
    let mut out = Vec::with_capacity(n_elements);
    match ty {
        GgmlType::F32 => out.extend(
            data.as_chunks::<4>()
                .0
                .iter()
                .map(|b| f32::from_le_bytes(*b)),
        ),
        GgmlType::F16 => out.extend(data.as_chunks::<2>().0.iter().map(|b| f16(b))),
        GgmlType::Q8_0 => {
            for b in data.chunks_exact(block_bytes) {
                let d = f16(&b[0..2]);
                out.extend(b[2..34].iter().map(|&q| d * (q as i8) as f32));
            }
        }
        GgmlType::Q4_0 => {
            for b in data.chunks_exact(block_bytes) {
                let d = f16(&b[0..2]);
                let qs = &b[2..18];
                out.extend(qs.iter().map(|&q| d * ((q & 0x0f) as i32 - 8) as f32));
                out.extend(qs.iter().map(|&q| d * ((q >> 4) as i32 - 8) as f32));
            }
        }
        GgmlType::Q4_1 => {
            for b in data.chunks_exact(block_bytes) {
                let (d, m) = (f16(&b[0..2]), f16(&b[2..4]));
                let qs = &b[4..20];
                out.extend(qs.iter().map(|&q| d * (q & 0x0f) as f32 + m));
                out.extend(qs.iter().map(|&q| d * (q >> 4) as f32 + m));
            }
        }
        // `block()` is None for `Other`, so `dequantize` returned above.
        GgmlType::Other(_) => {}
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
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

    proptest! {
        #[test]
        fn arbitrary_damage_never_panics(flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..8), cut in any::<usize>()) {
            let mut bytes = tiny_file();
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
}
