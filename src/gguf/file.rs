//! A GGUF file's header, parsed and validated ([`GgufFile`]), and what
//! can be wrong with one ([`GgufError`]).

use super::types::Array;
use super::types::TensorInfo;
use super::types::Value;
use std::collections::HashMap;
use std::path::PathBuf;

/// Alignment of the data section when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;

/// Key that overrides [`DEFAULT_ALIGNMENT`]; must be a u32 power of two.
pub const KEY_ALIGNMENT: &str = "general.alignment";

/// ggml's `GGML_MAX_NAME`: tensor names must be shorter than this (bytes).
pub const MAX_TENSOR_NAME: usize = 64;

/// Everything that can be wrong with a GGUF file or a request against one.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("not a GGUF file: magic {found:02x?}, expected \"GGUF\"")]
    BadMagic { found: [u8; 4] },
    #[error("unsupported GGUF version {0} (supported: 2, 3)")]
    UnsupportedVersion(u32),
    #[error("file truncated: {what} at offset {offset} runs past the end")]
    Truncated { what: String, offset: u64 },
    #[error("{what} at offset {offset} is {count}, more than the limit of {limit}")]
    TooLarge {
        what: String,
        count: u64,
        limit: u64,
        offset: u64,
    },
    #[error("{what} at offset {offset} is not valid UTF-8")]
    InvalidUtf8 { what: String, offset: u64 },
    #[error("{what} at offset {offset} has unknown value type id {type_id}")]
    UnknownValueType {
        what: String,
        type_id: u32,
        offset: u64,
    },
    #[error("{what} at offset {offset}: arrays nested too deeply")]
    NestedTooDeep { what: String, offset: u64 },
    #[error("metadata key #{index} at offset {offset} is empty")]
    EmptyKey { index: u64, offset: u64 },
    #[error("duplicate metadata key '{0}'")]
    DuplicateKey(String),
    #[error("metadata key '{key}' is {found}, expected {expected}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: &'static str,
    },
    #[error("metadata key '{key}' = {value} does not fit in {expected}")]
    OutOfRange {
        key: String,
        expected: &'static str,
        value: String,
    },
    #[error("missing metadata key '{0}'")]
    MissingKey(String),
    #[error("alignment {0} is not a power of two that fits in u32")]
    BadAlignment(u64),
    #[error("tensor name '{name}' is {len} bytes; ggml allows at most {}", MAX_TENSOR_NAME - 1)]
    TensorNameTooLong { name: String, len: usize },
    #[error("duplicate tensor '{0}'")]
    DuplicateTensor(String),
    #[error("tensor '{tensor}' has a bad shape {ne:?}: {reason}")]
    BadShape {
        tensor: String,
        ne: Vec<u64>,
        reason: String,
    },
    #[error("tensor '{tensor}' has unknown ggml type id {type_id}")]
    UnknownTensorType { tensor: String, type_id: u32 },
    #[error(
        "tensor '{tensor}' data offset {offset} is not a multiple of the alignment {alignment}"
    )]
    Misaligned {
        tensor: String,
        offset: u64,
        alignment: u64,
    },
    #[error(
        "tensor '{tensor}' data [{offset}, +{size}) lies outside the file of {file_size} bytes"
    )]
    DataOutOfRange {
        tensor: String,
        offset: u64,
        size: u64,
        file_size: u64,
    },
    #[error("tensors '{a}' and '{b}' overlap in the data section")]
    Overlap { a: String, b: String },
    #[error("missing tensor '{0}'")]
    MissingTensor(String),
    #[error("tensor '{tensor}' data is {found} bytes, expected {expected}")]
    DataSizeMismatch {
        tensor: String,
        expected: u64,
        found: u64,
    },
}

/// A parsed, validated GGUF header. Fields are public for reading; the
/// lookup maps are built once at parse time, so do not edit `metadata` or
/// `tensors` and expect `get`/`tensor` to follow.
#[derive(Clone, Debug)]
pub struct GgufFile {
    pub version: u32,
    pub alignment: u64,
    /// Absolute offset of the data section (header end rounded up).
    pub data_offset: u64,
    pub file_size: u64,
    /// Key-value pairs in file order.
    pub metadata: Vec<(String, Value)>,
    /// Tensor descriptors in file order, offsets absolute.
    pub tensors: Vec<TensorInfo>,
    key_index: HashMap<String, usize>,
    tensor_index: HashMap<String, usize>,
}

impl GgufFile {
    pub(crate) fn from_parts(
        version: u32,
        alignment: u64,
        data_offset: u64,
        file_size: u64,
        metadata: Vec<(String, Value)>,
        tensors: Vec<TensorInfo>,
    ) -> Self {
        let key_index = metadata
            .iter()
            .enumerate()
            .map(|(i, (k, _))| (k.clone(), i));
        let tensor_index = tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i));
        GgufFile {
            version,
            alignment,
            data_offset,
            file_size,
            key_index: key_index.collect(),
            tensor_index: tensor_index.collect(),
            metadata,
            tensors,
        }
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.key_index.get(key).map(|&i| &self.metadata[i].1)
    }

    fn require(&self, key: &str) -> Result<&Value, GgufError> {
        self.get(key)
            .ok_or_else(|| GgufError::MissingKey(key.to_string()))
    }

    fn wrong(key: &str, expected: &'static str, v: &Value) -> GgufError {
        GgufError::WrongType {
            key: key.to_string(),
            expected,
            found: v.type_name(),
        }
    }

    /// Any integer value that fits in u32 losslessly.
    pub fn get_u32(&self, key: &str) -> Result<u32, GgufError> {
        let v = self.require(key)?;
        let i = v.as_integer().ok_or_else(|| Self::wrong(key, "u32", v))?;
        u32::try_from(i).map_err(|_| GgufError::OutOfRange {
            key: key.to_string(),
            expected: "u32",
            value: i.to_string(),
        })
    }

    pub fn get_u32_opt(&self, key: &str) -> Result<Option<u32>, GgufError> {
        self.get(key).map(|_| self.get_u32(key)).transpose()
    }

    /// Any integer value that fits in u64 losslessly.
    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        let v = self.require(key)?;
        let i = v.as_integer().ok_or_else(|| Self::wrong(key, "u64", v))?;
        u64::try_from(i).map_err(|_| GgufError::OutOfRange {
            key: key.to_string(),
            expected: "u64",
            value: i.to_string(),
        })
    }

    pub fn get_u64_opt(&self, key: &str) -> Result<Option<u64>, GgufError> {
        self.get(key).map(|_| self.get_u64(key)).transpose()
    }

    /// An f32, or an f64 rounded to the nearest f32 if finite in f32.
    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        match *self.require(key)? {
            Value::F32(x) => Ok(x),
            Value::F64(x) if (x as f32).is_finite() || !x.is_finite() => Ok(x as f32),
            Value::F64(x) => Err(GgufError::OutOfRange {
                key: key.to_string(),
                expected: "f32",
                value: x.to_string(),
            }),
            ref v => Err(Self::wrong(key, "f32", v)),
        }
    }

    pub fn get_f32_opt(&self, key: &str) -> Result<Option<f32>, GgufError> {
        self.get(key).map(|_| self.get_f32(key)).transpose()
    }

    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        match self.require(key)? {
            Value::Str(s) => Ok(s),
            v => Err(Self::wrong(key, "str", v)),
        }
    }

    pub fn get_str_opt(&self, key: &str) -> Result<Option<&str>, GgufError> {
        self.get(key).map(|_| self.get_str(key)).transpose()
    }

    pub fn get_bool(&self, key: &str) -> Result<bool, GgufError> {
        match self.require(key)? {
            Value::Bool(b) => Ok(*b),
            v => Err(Self::wrong(key, "bool", v)),
        }
    }

    pub fn get_bool_opt(&self, key: &str) -> Result<Option<bool>, GgufError> {
        self.get(key).map(|_| self.get_bool(key)).transpose()
    }

    pub fn get_str_array(&self, key: &str) -> Result<&[String], GgufError> {
        match self.require(key)? {
            Value::Array(Array::Str(a)) => Ok(a),
            v => Err(Self::wrong(key, "array<str>", v)),
        }
    }

    pub fn get_f32_array(&self, key: &str) -> Result<&[f32], GgufError> {
        match self.require(key)? {
            Value::Array(Array::F32(a)) => Ok(a),
            v => Err(Self::wrong(key, "array<f32>", v)),
        }
    }

    pub fn get_i32_array(&self, key: &str) -> Result<&[i32], GgufError> {
        match self.require(key)? {
            Value::Array(Array::I32(a)) => Ok(a),
            v => Err(Self::wrong(key, "array<i32>", v)),
        }
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    pub fn require_tensor(&self, name: &str) -> Result<&TensorInfo, GgufError> {
        self.tensor(name)
            .ok_or_else(|| GgufError::MissingTensor(name.to_string()))
    }
}
