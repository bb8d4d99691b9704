//! GGUF model file reader and dequantization: F32, F16, the 32-element block types Q4_0, Q4_1,
//! Q5_0, Q5_1 and Q8_0, and llama.cpp's 256-element K-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and
//! Q8_K (which cover the tensors of its Q2_K..Q6_K and Q*_K_S/M/L files). The block layouts are
//! ggml's (`ggml-common.h`); tests check every type bit for bit against vectors made by the
//! `gguf` Python package (tests/reference/gguf_quants.py).
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
    /// A quantized block whose scale (or minimum) is infinite or NaN.
    #[error(
        "tensor {tensor:?}: the {ty:?} block at byte {offset} has a non-finite scale ({value})"
    )]
    NonFiniteScale {
        /// The tensor (empty when [`dequantize`] was called on bare data).
        tensor: String,
        /// Its type.
        ty: GgmlType,
        /// Where the block starts: in the file, or in the data given to [`dequantize`].
        offset: usize,
        /// The scale.
        value: f32,
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
#[allow(
    non_camel_case_types,
    reason = "ggml's names (Q4_K), as in llama.cpp's file names and in our error messages"
)]
pub enum GgmlType {
    /// 32-bit float.
    F32,
    /// 16-bit float.
    F16,
    /// 4-bit blocks of 32 with a scale.
    Q4_0,
    /// 4-bit blocks of 32 with a scale and a minimum.
    Q4_1,
    /// 5-bit blocks of 32 with a scale.
    Q5_0,
    /// 5-bit blocks of 32 with a scale and a minimum.
    Q5_1,
    /// 8-bit blocks of 32 with a scale.
    Q8_0,
    /// 2-bit super-blocks of 256: 16 sub-blocks with 4-bit scales and minimums.
    Q2_K,
    /// 3-bit super-blocks of 256: 16 sub-blocks with 6-bit scales.
    Q3_K,
    /// 4-bit super-blocks of 256: 8 sub-blocks with 6-bit scales and minimums.
    Q4_K,
    /// 5-bit super-blocks of 256: 8 sub-blocks with 6-bit scales and minimums.
    Q5_K,
    /// 6-bit super-blocks of 256: 16 sub-blocks with 8-bit scales.
    Q6_K,
    /// 8-bit super-blocks of 256 with an f32 scale (llama.cpp's activation type; rare in files).
    Q8_K,
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
            6 => Self::Q5_0,
            7 => Self::Q5_1,
            8 => Self::Q8_0,
            10 => Self::Q2_K,
            11 => Self::Q3_K,
            12 => Self::Q4_K,
            13 => Self::Q5_K,
            14 => Self::Q6_K,
            15 => Self::Q8_K,
            other => Self::Other(other),
        }
    }

    /// `(elements per block, bytes per block)`, for the types this reader knows.
    pub fn block(self) -> Option<(usize, usize)> {
        match self {
            Self::F32 => Some((1, 4)),
            Self::F16 => Some((1, 2)),
            Self::Q4_0 => Some((32, Q4_0_BYTES)),
            Self::Q4_1 => Some((32, Q4_1_BYTES)),
            Self::Q5_0 => Some((32, Q5_0_BYTES)),
            Self::Q5_1 => Some((32, Q5_1_BYTES)),
            Self::Q8_0 => Some((32, Q8_0_BYTES)),
            Self::Q2_K => Some((QK_K, Q2_K_BYTES)),
            Self::Q3_K => Some((QK_K, Q3_K_BYTES)),
            Self::Q4_K => Some((QK_K, Q4_K_BYTES)),
            Self::Q5_K => Some((QK_K, Q5_K_BYTES)),
            Self::Q6_K => Some((QK_K, Q6_K_BYTES)),
            Self::Q8_K => Some((QK_K, Q8_K_BYTES)),
            Self::Other(_) => None,
        }
    }
}

/// Elements in a K-quant super-block (ggml's `QK_K`).
const QK_K: usize = 256;
// Bytes per block, as ggml's `block_*` structs lay them out (`ggml-common.h`).
const Q4_0_BYTES: usize = 2 + 16;
const Q4_1_BYTES: usize = 2 + 2 + 16;
const Q5_0_BYTES: usize = 2 + 4 + 16;
const Q5_1_BYTES: usize = 2 + 2 + 4 + 16;
const Q8_0_BYTES: usize = 2 + 32;
const Q2_K_BYTES: usize = QK_K / 16 + QK_K / 4 + 2 + 2;
const Q3_K_BYTES: usize = QK_K / 8 + QK_K / 4 + 12 + 2;
const Q4_K_BYTES: usize = 2 + 2 + 12 + QK_K / 2;
const Q5_K_BYTES: usize = 2 + 2 + 12 + QK_K / 8 + QK_K / 2;
const Q6_K_BYTES: usize = QK_K / 2 + QK_K / 4 + QK_K / 16 + 2;
const Q8_K_BYTES: usize = 4 + QK_K + 2 * QK_K / 16;

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

/// Bound on a tensor's element count per byte of the file, so that the dimensions of a tensor of
/// an unknown type cannot promise more than a file could hold (the densest GGML types, IQ1_S and
/// TQ1_0, pack about 5 elements in a byte; Q2_K about 3).
const MAX_ELEMENTS_PER_BYTE: u64 = 8;
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
        Self::parse_header(bytes, bytes.len() as u64)
    }

    /// [`Self::parse`] from the file's first bytes (`head`, at least its header, metadata and
    /// tensor directory), the whole file being `file_len` bytes: the directory is checked
    /// against that length, and no tensor's data is read.
    pub fn parse_header(head: &[u8], file_len: u64) -> Result<Self, GgufError> {
        let bytes = head;
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
        let file_len = file_len.max(bytes.len() as u64);
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
                .filter(|&e| e <= file_len.saturating_mul(MAX_ELEMENTS_PER_BYTE))
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

    /// An array whose every item `item` reads, or a `WrongType` naming `expected`.
    fn array_of<'a, T>(
        &'a self,
        key: &str,
        expected: &'static str,
        item: impl Fn(&'a MetaValue) -> Option<T>,
    ) -> Result<Vec<T>, GgufError> {
        let wrong = || GgufError::WrongType {
            key: key.to_string(),
            expected,
        };
        match self.require(key)? {
            MetaValue::Array(items) => items.iter().map(|v| item(v).ok_or_else(wrong)).collect(),
            _ => Err(wrong()),
        }
    }

    /// An array of strings.
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>, GgufError> {
        self.array_of(key, "an array of strings", |v| match v {
            MetaValue::Str(s) => Some(s.as_str()),
            _ => None,
        })
    }

    /// An array of floats.
    pub fn get_f32_array(&self, key: &str) -> Result<Vec<f32>, GgufError> {
        self.array_of(key, "an array of floats", |v| match v {
            MetaValue::F32(x) => Some(*x),
            MetaValue::F64(x) => Some(*x as f32),
            _ => None,
        })
    }

    /// An array of integers that fit in i32.
    pub fn get_i32_array(&self, key: &str) -> Result<Vec<i32>, GgufError> {
        self.array_of(key, "an array of i32", |v| {
            v.as_i128().and_then(|x| i32::try_from(x).ok())
        })
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
        dequantize_from(info.ggml_type, data, elements, name, start)
    }
}

/// Dequantizes `n_elements` values of type `ty` from `data`.
pub fn dequantize(ty: GgmlType, data: &[u8], n_elements: usize) -> Result<Vec<f32>, GgufError> {
    dequantize_from(ty, data, n_elements, "", 0)
}

/// [`dequantize`] of tensor `tensor`'s data, which starts at byte `start` of its file (for errors).
fn dequantize_from(
    ty: GgmlType,
    data: &[u8],
    n_elements: usize,
    tensor: &str,
    start: usize,
) -> Result<Vec<f32>, GgufError> {
    let (per_block, block_bytes) = ty.block().ok_or_else(|| GgufError::UnsupportedType {
        name: tensor.to_string(),
        ty,
    })?;
    if !n_elements.is_multiple_of(per_block) || data.len() != n_elements / per_block * block_bytes {
        return Err(GgufError::Invalid {
            offset: start,
            what: "tensor data",
            detail: format!(
                "{} bytes do not hold {n_elements} elements of {ty:?}",
                data.len()
            ),
        });
    }
    // Bounded by `data`: no type has more than 4 elements in a byte.
    let mut out = Vec::with_capacity(n_elements);
    let blocks = Blocks {
        data,
        ty,
        tensor,
        start,
    };
    match ty {
        GgmlType::F32 => out.extend(
            data.as_chunks::<4>()
                .0
                .iter()
                .map(|b| f32::from_le_bytes(*b)),
        ),
        GgmlType::F16 => out.extend(
            data.as_chunks::<2>()
                .0
                .iter()
                .map(|b| half::f16::from_le_bytes(*b).to_f32()),
        ),
        GgmlType::Q4_0 => blocks.each(&mut out, q4_0)?,
        GgmlType::Q4_1 => blocks.each(&mut out, q4_1)?,
        GgmlType::Q5_0 => blocks.each(&mut out, q5_0)?,
        GgmlType::Q5_1 => blocks.each(&mut out, q5_1)?,
        GgmlType::Q8_0 => blocks.each(&mut out, q8_0)?,
        GgmlType::Q2_K => blocks.each(&mut out, q2_k)?,
        GgmlType::Q3_K => blocks.each(&mut out, q3_k)?,
        GgmlType::Q4_K => blocks.each(&mut out, q4_k)?,
        GgmlType::Q5_K => blocks.each(&mut out, q5_k)?,
        GgmlType::Q6_K => blocks.each(&mut out, q6_k)?,
        GgmlType::Q8_K => blocks.each(&mut out, q8_k)?,
        // `block()` is None for `Other`, so this returned above.
        GgmlType::Other(_) => {}
    }
    Ok(out)
}

/// Data of whole blocks of one type, and where it came from (for errors).
struct Blocks<'a> {
    data: &'a [u8],
    ty: GgmlType,
    tensor: &'a str,
    start: usize,
}

impl Blocks<'_> {
    /// Dequantizes each `N`-byte block with `block` onto `out`, in order.
    fn each<const N: usize>(
        &self,
        out: &mut Vec<f32>,
        block: fn(&[u8; N], &mut Vec<f32>) -> Result<(), NonFinite>,
    ) -> Result<(), GgufError> {
        for (i, b) in self.data.as_chunks::<N>().0.iter().enumerate() {
            block(b, out).map_err(|NonFinite(value)| GgufError::NonFiniteScale {
                tensor: self.tensor.to_string(),
                ty: self.ty,
                offset: self.start + i * N,
                value,
            })?;
        }
        Ok(())
    }
}

/// A scale field that is infinite or NaN.
struct NonFinite(f32);

fn finite(v: f32) -> Result<f32, NonFinite> {
    if v.is_finite() {
        Ok(v)
    } else {
        Err(NonFinite(v))
    }
}

/// The f16 scale at byte `at` of a block.
fn f16_scale(b: &[u8], at: usize) -> Result<f32, NonFinite> {
    finite(half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32())
}

// One function per block type: each appends its block's values in element order, computing
// them in the order the `gguf` package does (ggml's order too, less any FMA contraction), so
// that the results match its reference bit for bit.

/// `d: f16, qs: [u8; 16]`: element j is the low nibble of `qs[j]`, element 16 + j the high one;
/// x = d·(q − 8).
fn q4_0(b: &[u8; Q4_0_BYTES], out: &mut Vec<f32>) -> Result<(), NonFinite> {
    let d = f16_scale(b, 0)?;
    let qs = &b[2..];
    out.extend(qs.iter().map(|&q| d * ((q & 0x0f) as i32 - 8) as f32));
    out.extend(qs.iter().map(|&q| d * ((q >> 4) as i32 - 8) as f32));
    Ok(())
}

/// `d: f16, m: f16, qs: [u8; 16]`, nibbles as in Q4_0; x = d·q + m.
fn q4_1(b: &[u8; Q4_1_BYTES], out: &mut Vec<f32>) -> Result<(), NonFinite> {
    let (d, m) = (f16_scale(b, 0)?, f16_scale(b, 2)?);
    let qs = &b[4..];
    out.extend(qs.iter().map(|&q| d * (q & 0x0f) as f32 + m));
    out.extend(qs.iter().map(|&q| d * (q >> 4) as f32 + m));
    Ok(())
}

/// The 5-bit quant j of a Q5_0 or Q5_1 block: its low 4 bits are Q4_0's nibble j of `qs`, its
/// fifth bit is bit j of the little-endian u32 `qh`.
fn q5_quant(qh: u32, qs: &[u8], j: usize) -> u32 {
    let low = (qs[j % 16] >> (4 * (j / 16))) & 0x0f;
    u32::from(low) | ((qh >> j) & 1) << 4
}

/// `d: f16, qh: u32, qs: [u8; 16]`; x = d·(q − 16).
fn q5_0(b: &[u8; Q5_0_BYTES], out: &mut Vec<f32>) -> Result<(), NonFinite> {
    let d = f16_scale(b, 0)?;
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..];
    out.extend((0..32).map(|j| d * (q5_quant(qh, qs, j) as i32 - 16) as f32));
    Ok(())
}

/// `d: f16, m: f16, qh: u32, qs: [u8; 16]`; x = d·q + m.
fn q5_1(b: &[u8; Q5_1_BYTES], out: &mut Vec<f32>) -> Result<(), NonFinite> {
    let (d, m) = (f16_scale(b, 0)?, f16_scale(b, 2)?);
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let qs = &b[8..];
    out.extend((0..32).map(|j| d * q5_quant(qh, qs, j) as f32 + m));
    Ok(())
}

/// `d: f16, qs: [i8; 32]`; x = d·q.
fn q8_0(b: &[u8; Q8_0_BYTES], out: &mut Vec<f32>) -> Result<(), NonFinite> {
    let d = f16_scale(b, 0)?;
    out.extend(b[2..].iter().map(|&q| d * (q as i8) as f32));
    Ok(())
}

/// The 2 bits of element e (< 256) in Q2_K's and Q3_K's `qs: [u8; 64]`: each half of the
/// super-block (128 elements) has 32 bytes, and their bit pairs 0-1, 2-3, 4-5, 6-7 hold its
/// elements 0..32, 32..64, 64..96, 96..128.
fn two_bits(qs: &[u8], e: usize) -> u8 {
    (qs[e / 128 * 32 + e % 32] >> (2 * (e % 128 / 32))) & 3
}

/// `scales: [u8; 16], qs: [u8; 64], d: f16, dmin: f16`. Sub-block i (elements 16i..16i + 16)
/// has scale `d·(scales[i] & 15)` and minimum `dmin·(scales[i] >> 4)`; x = scale·q − minimum.
fn q2_k(b: &[u8; Q2_K_BYTES], out: &mut Vec<f32>) -> Result<(), NonFinite> {
    let (scales, qs) = (&b[0..16], &b[16..80]);
    let (d, dmin) = (f16_scale(b, 80)?, f16_scale(b, 82)?);
    for (i, &sc) in scales.iter().enumerate() {
        let (dl, ml) = (d * (sc & 0x0f) as f32, dmin * (sc >> 4) as f32);
        out.extend((16 * i..16 * i + 16).map(|e| dl * two_bits(qs, e) as f32 - ml));
    }
    Ok(())
}

/// `hmask: [u8; 32], qs: [u8; 64], scales: [u8; 12], d: f16`. Element e's low 2 bits are as in
/// Q2_K; its high bit, bit e / 32 of `hmask[e % 32]`, clear means −4. Sub-block i's 6-bit scale
/// (stored + 32) has its low 4 bits in nibble i / 8 of `scales[i % 8]`, its high 2 bits at bit
/// 2·(i / 4) of `scales[8 + i % 4]`; x = d·scale·q.
fn q3_k(b: &[u8; Q3_K_BYTES], out: &mut Vec<f32>) -> Result<(), NonFinite> {
    let (hmask, qs, scales) = (&b[0..32], &b[32..96], &b[96..108]);
    let d = f16_scale(b, 108)?;
    let quant = |e: usize| {
        let high = (hmask[e % 32] >> (e / 32)) & 1;
        two_bits(qs, e) as i32 - if high == 1 { 0 } else { 4 }
    };
    for i in 0..16 {
        let low = (scales[i % 8] >> (4 * (i / 8))) & 0x0f;
        let high = (scales[8 + i % 4] >> (2 * (i / 4))) & 3;
        let dl = d * ((low | high << 4) as i32 - 32) as f32;
        out.extend((16 * i..16 * i + 16).map(|e| dl * quant(e) as f32));
    }
    Ok(())
}

/// Q4_K's and Q5_K's 6-bit (scale, minimum) of sub-block j (< 8), packed in 12 bytes: for
/// j < 4 the low 6 bits of bytes j and j + 4; for j ≥ 4 the nibbles of byte j + 4 with the top
/// 2 bits of bytes j − 4 and j above them.
fn scale_min_k4(scales: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (scales[j] & 63, scales[j + 4] & 63)
    } else {
        (
            (scales[j + 4] & 0x0f) | (scales[j - 4] >> 6) << 4,
            (scales[j + 4] >> 4) | (scales[j] >> 6) << 4,
        )
    }
}

/// `d: f16, dmin: f16, scales: [u8; 12], qs: [u8; 128]`. Sub-block j (32 elements) is the low
/// (even j) or high (odd j) nibbles of `qs[32·(j / 2)..][..32]`; x = d·scale·q − dmin·minimum.
fn q4_k(b: &[u8; Q4_K_BYTES], out: &mut Vec<f32>) -> Result<(), NonFinite> {
    let (d, dmin) = (f16_scale(b, 0)?, f16_scale(b, 2)?);
    let (scales, qs) = (&b[4..16], &b[16..]);
    for j in 0..8 {
        let bytes = &qs[32 * (j / 2)..][..32];
        let (sc, m) = scale_min_k4(scales, j);
        let (dl, ml) = (d * sc as f32, dmin * m as f32);
        let shift = 4 * (j % 2);
        out.extend(
            bytes
                .iter()
                .map(|&q| dl * ((q >> shift) & 0x0f) as f32 - ml),
        );
    }
    Ok(())
}

/// `d: f16, dmin: f16, scales: [u8; 12], qh: [u8; 32], qs: [u8; 128]`: Q4_K with a fifth bit,
/// bit j of `qh[l]` for element l of sub-block j.
fn q5_k(b: &[u8; Q5_K_BYTES], out: &mut Vec<f32>) -> Result<(), NonFinite> {
    let (d, dmin) = (f16_scale(b, 0)?, f16_scale(b, 2)?);
    let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..]);
    for j in 0..8 {
        let bytes = &qs[32 * (j / 2)..][..32];
        let (sc, m) = scale_min_k4(scales, j);
        let (dl, ml) = (d * sc as f32, dmin * m as f32);
        let shift = 4 * (j % 2);
        out.extend(bytes.iter().zip(qh).map(|(&q, &h)| {
            let q = (q >> shift) & 0x0f | ((h >> j) & 1) << 4;
            dl * q as f32 - ml
        }));
    }
    Ok(())
}

/// `ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16`. In half h of the super-block
/// (element e = 128h + w), the low 4 bits are nibble w / 64 of `ql[64h + w % 64]`, the high 2
/// bits are at bit 2·(w / 32) of `qh[32h + w % 32]`, stored + 32. Sub-block i (16 elements) has
/// scale `d·scales[i]`; x = scale·q.
fn q6_k(b: &[u8; Q6_K_BYTES], out: &mut Vec<f32>) -> Result<(), NonFinite> {
    let (ql, qh, scales) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = f16_scale(b, 208)?;
    let quant = |e: usize| {
        let (h, w) = (e / 128, e % 128);
        let low = (ql[64 * h + w % 64] >> (4 * (w / 64))) & 0x0f;
        let high = (qh[32 * h + w % 32] >> (2 * (w / 32))) & 3;
        (low | high << 4) as i32 - 32
    };
    for (i, &sc) in scales.iter().enumerate() {
        let dl = d * (sc as i8) as f32;
        out.extend((16 * i..16 * i + 16).map(|e| dl * quant(e) as f32));
    }
    Ok(())
}

/// `d: f32, qs: [i8; 256], bsums: [i16; 16]` (sums of 16 quants, for dot products); x = d·q.
fn q8_k(b: &[u8; Q8_K_BYTES], out: &mut Vec<f32>) -> Result<(), NonFinite> {
    let d = finite(f32::from_le_bytes([b[0], b[1], b[2], b[3]]))?;
    out.extend(b[4..4 + QK_K].iter().map(|&q| d * (q as i8) as f32));
    Ok(())
}

#[cfg(test)]
mod tests;
