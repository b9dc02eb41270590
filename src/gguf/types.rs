//! Plain data types of the GGUF format: metadata values and tensor
//! descriptors (the tensor types themselves are [`crate::dtype`]). Nothing
//! in this file reads files or panics.

use crate::dtype::GgmlType;

/// GGUF metadata value type ids (`enum gguf_type` in ggml's gguf.h).
pub(crate) mod value_type {
    pub const U8: u32 = 0;
    pub const I8: u32 = 1;
    pub const U16: u32 = 2;
    pub const I16: u32 = 3;
    pub const U32: u32 = 4;
    pub const I32: u32 = 5;
    pub const F32: u32 = 6;
    pub const BOOL: u32 = 7;
    pub const STR: u32 = 8;
    pub const ARRAY: u32 = 9;
    pub const U64: u32 = 10;
    pub const I64: u32 = 11;
    pub const F64: u32 = 12;
}

/// One metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    Array(Array),
    U64(u64),
    I64(i64),
    F64(f64),
}

/// A homogeneous metadata array. `Nested` holds arrays of arrays, which the
/// format allows but ggml's own reader refuses; keep them out of model files.
#[derive(Clone, Debug, PartialEq)]
pub enum Array {
    U8(Vec<u8>),
    I8(Vec<i8>),
    U16(Vec<u16>),
    I16(Vec<i16>),
    U32(Vec<u32>),
    I32(Vec<i32>),
    F32(Vec<f32>),
    Bool(Vec<bool>),
    Str(Vec<String>),
    U64(Vec<u64>),
    I64(Vec<i64>),
    F64(Vec<f64>),
    Nested(Vec<Array>),
}

impl Value {
    /// Short type name used in error messages: "u32", "str", "array<f32>".
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::U8(_) => "u8",
            Value::I8(_) => "i8",
            Value::U16(_) => "u16",
            Value::I16(_) => "i16",
            Value::U32(_) => "u32",
            Value::I32(_) => "i32",
            Value::F32(_) => "f32",
            Value::Bool(_) => "bool",
            Value::Str(_) => "str",
            Value::Array(a) => a.type_name(),
            Value::U64(_) => "u64",
            Value::I64(_) => "i64",
            Value::F64(_) => "f64",
        }
    }

    /// The value of any integer variant, widened; `None` for the others.
    pub fn as_integer(&self) -> Option<i128> {
        Some(match *self {
            Value::U8(v) => v.into(),
            Value::I8(v) => v.into(),
            Value::U16(v) => v.into(),
            Value::I16(v) => v.into(),
            Value::U32(v) => v.into(),
            Value::I32(v) => v.into(),
            Value::U64(v) => v.into(),
            Value::I64(v) => v.into(),
            _ => return None,
        })
    }

    pub(crate) fn type_id(&self) -> u32 {
        use value_type as t;
        match self {
            Value::U8(_) => t::U8,
            Value::I8(_) => t::I8,
            Value::U16(_) => t::U16,
            Value::I16(_) => t::I16,
            Value::U32(_) => t::U32,
            Value::I32(_) => t::I32,
            Value::F32(_) => t::F32,
            Value::Bool(_) => t::BOOL,
            Value::Str(_) => t::STR,
            Value::Array(_) => t::ARRAY,
            Value::U64(_) => t::U64,
            Value::I64(_) => t::I64,
            Value::F64(_) => t::F64,
        }
    }
}

impl Array {
    /// "array<u8>", ..., "array<array>".
    pub fn type_name(&self) -> &'static str {
        match self {
            Array::U8(_) => "array<u8>",
            Array::I8(_) => "array<i8>",
            Array::U16(_) => "array<u16>",
            Array::I16(_) => "array<i16>",
            Array::U32(_) => "array<u32>",
            Array::I32(_) => "array<i32>",
            Array::F32(_) => "array<f32>",
            Array::Bool(_) => "array<bool>",
            Array::Str(_) => "array<str>",
            Array::U64(_) => "array<u64>",
            Array::I64(_) => "array<i64>",
            Array::F64(_) => "array<f64>",
            Array::Nested(_) => "array<array>",
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Array::U8(v) => v.len(),
            Array::I8(v) => v.len(),
            Array::U16(v) => v.len(),
            Array::I16(v) => v.len(),
            Array::U32(v) => v.len(),
            Array::I32(v) => v.len(),
            Array::F32(v) => v.len(),
            Array::Bool(v) => v.len(),
            Array::Str(v) => v.len(),
            Array::U64(v) => v.len(),
            Array::I64(v) => v.len(),
            Array::F64(v) => v.len(),
            Array::Nested(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(crate) fn elem_type_id(&self) -> u32 {
        use value_type as t;
        match self {
            Array::U8(_) => t::U8,
            Array::I8(_) => t::I8,
            Array::U16(_) => t::U16,
            Array::I16(_) => t::I16,
            Array::U32(_) => t::U32,
            Array::I32(_) => t::I32,
            Array::F32(_) => t::F32,
            Array::Bool(_) => t::BOOL,
            Array::Str(_) => t::STR,
            Array::U64(_) => t::U64,
            Array::I64(_) => t::I64,
            Array::F64(_) => t::F64,
            Array::Nested(_) => t::ARRAY,
        }
    }
}

/// One tensor descriptor, validated: 1..=4 dims, each >= 1, known type,
/// `ne[0]` a whole number of blocks, data inside the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// Shape in ggml order, `ne[0]` (the contiguous row) first; 1..=4 dims.
    pub ne: Vec<u64>,
    pub ty: GgmlType,
    /// Absolute byte offset of the data in the file.
    pub offset: u64,
    /// Bytes of data.
    pub size: u64,
}

impl TensorInfo {
    /// Product of the dims (validated at parse time not to overflow i64).
    pub fn n_elements(&self) -> u64 {
        self.ne.iter().fold(1u64, |acc, &d| acc.saturating_mul(d))
    }

    /// The shape padded with 1s to ggml's four dims, as `ggml_new_tensor` wants.
    pub fn ne4(&self) -> [i64; 4] {
        let mut out = [1i64; 4];
        for (o, &d) in out.iter_mut().zip(&self.ne) {
            *o = i64::try_from(d).unwrap_or(i64::MAX);
        }
        out
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ne4_pads_with_ones() {
        let t = TensorInfo {
            name: "x".into(),
            ne: vec![8, 3],
            ty: GgmlType::F32,
            offset: 0,
            size: 96,
        };
        assert_eq!(t.ne4(), [8, 3, 1, 1]);
        assert_eq!(t.n_elements(), 24);
    }
}
