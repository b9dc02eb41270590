//! Plain data types of the GGUF format: the ggml tensor type table, metadata
//! values, and tensor descriptors.
//!
//! The type table mirrors `type_traits` in the pinned ggml source
//! (`ggml/src/ggml.c`, enum `ggml_type` in `ggml/include/ggml.h`); ids that
//! ggml removed (4, 5, 31..=33, 36..=38) are unknown here, exactly as ggml
//! refuses them in GGUF files. A unit test cross-checks every entry against
//! the linked ggml through FFI. Nothing in this file reads files or panics.

/// A raw `ggml_type` id as stored in a GGUF tensor descriptor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GgmlType(pub u32);

/// (name, elements per block, bytes per block) for each known id.
type Traits = (&'static str, u64, u64);

/// Indexed by ggml_type id; `None` for ids ggml removed.
const TYPE_TABLE: [Option<Traits>; 43] = [
    Some(("f32", 1, 4)),        // 0
    Some(("f16", 1, 2)),        // 1
    Some(("q4_0", 32, 18)),     // 2
    Some(("q4_1", 32, 20)),     // 3
    None,                       // 4 (q4_2, removed)
    None,                       // 5 (q4_3, removed)
    Some(("q5_0", 32, 22)),     // 6
    Some(("q5_1", 32, 24)),     // 7
    Some(("q8_0", 32, 34)),     // 8
    Some(("q8_1", 32, 36)),     // 9
    Some(("q2_K", 256, 84)),    // 10
    Some(("q3_K", 256, 110)),   // 11
    Some(("q4_K", 256, 144)),   // 12
    Some(("q5_K", 256, 176)),   // 13
    Some(("q6_K", 256, 210)),   // 14
    Some(("q8_K", 256, 292)),   // 15
    Some(("iq2_xxs", 256, 66)), // 16
    Some(("iq2_xs", 256, 74)),  // 17
    Some(("iq3_xxs", 256, 98)), // 18
    Some(("iq1_s", 256, 50)),   // 19
    Some(("iq4_nl", 32, 18)),   // 20
    Some(("iq3_s", 256, 110)),  // 21
    Some(("iq2_s", 256, 82)),   // 22
    Some(("iq4_xs", 256, 136)), // 23
    Some(("i8", 1, 1)),         // 24
    Some(("i16", 1, 2)),        // 25
    Some(("i32", 1, 4)),        // 26
    Some(("i64", 1, 8)),        // 27
    Some(("f64", 1, 8)),        // 28
    Some(("iq1_m", 256, 56)),   // 29
    Some(("bf16", 1, 2)),       // 30
    None,                       // 31 (q4_0_4_4, removed)
    None,                       // 32 (q4_0_4_8, removed)
    None,                       // 33 (q4_0_8_8, removed)
    Some(("tq1_0", 256, 54)),   // 34
    Some(("tq2_0", 256, 66)),   // 35
    None,                       // 36 (iq4_nl_4_4, removed)
    None,                       // 37 (iq4_nl_4_8, removed)
    None,                       // 38 (iq4_nl_8_8, removed)
    Some(("mxfp4", 32, 17)),    // 39
    Some(("nvfp4", 64, 36)),    // 40
    Some(("q1_0", 128, 18)),    // 41
    Some(("q2_0", 64, 18)),     // 42
];

impl GgmlType {
    pub const F32: GgmlType = GgmlType(0);
    pub const F16: GgmlType = GgmlType(1);
    pub const Q4_0: GgmlType = GgmlType(2);
    pub const Q4_1: GgmlType = GgmlType(3);
    pub const Q5_0: GgmlType = GgmlType(6);
    pub const Q5_1: GgmlType = GgmlType(7);
    pub const Q8_0: GgmlType = GgmlType(8);
    pub const Q8_1: GgmlType = GgmlType(9);
    pub const Q2_K: GgmlType = GgmlType(10);
    pub const Q3_K: GgmlType = GgmlType(11);
    pub const Q4_K: GgmlType = GgmlType(12);
    pub const Q5_K: GgmlType = GgmlType(13);
    pub const Q6_K: GgmlType = GgmlType(14);
    pub const Q8_K: GgmlType = GgmlType(15);
    pub const IQ2_XXS: GgmlType = GgmlType(16);
    pub const IQ2_XS: GgmlType = GgmlType(17);
    pub const IQ3_XXS: GgmlType = GgmlType(18);
    pub const IQ1_S: GgmlType = GgmlType(19);
    pub const IQ4_NL: GgmlType = GgmlType(20);
    pub const IQ3_S: GgmlType = GgmlType(21);
    pub const IQ2_S: GgmlType = GgmlType(22);
    pub const IQ4_XS: GgmlType = GgmlType(23);
    pub const I8: GgmlType = GgmlType(24);
    pub const I16: GgmlType = GgmlType(25);
    pub const I32: GgmlType = GgmlType(26);
    pub const I64: GgmlType = GgmlType(27);
    pub const F64: GgmlType = GgmlType(28);
    pub const IQ1_M: GgmlType = GgmlType(29);
    pub const BF16: GgmlType = GgmlType(30);
    pub const TQ1_0: GgmlType = GgmlType(34);
    pub const TQ2_0: GgmlType = GgmlType(35);
    pub const MXFP4: GgmlType = GgmlType(39);
    pub const NVFP4: GgmlType = GgmlType(40);
    pub const Q1_0: GgmlType = GgmlType(41);
    pub const Q2_0: GgmlType = GgmlType(42);

    /// Every id this table knows, in id order.
    pub fn all_known() -> impl Iterator<Item = GgmlType> {
        (0..TYPE_TABLE.len() as u32)
            .map(GgmlType)
            .filter(|t| t.traits().is_some())
    }

    fn traits(self) -> Option<Traits> {
        TYPE_TABLE.get(self.0 as usize).copied().flatten()
    }

    /// The name ggml gives this type ("f32", "q4_K", ...), or "unknown".
    pub fn name(self) -> &'static str {
        self.traits().map_or("unknown", |t| t.0)
    }

    /// Elements per block; `None` for an unknown or removed id.
    pub fn block_size(self) -> Option<u64> {
        self.traits().map(|t| t.1)
    }

    /// Bytes per block; `None` for an unknown or removed id.
    pub fn type_size(self) -> Option<u64> {
        self.traits().map(|t| t.2)
    }

    /// Bytes in one row of `ne0` elements; `None` if the id is unknown, `ne0`
    /// is not a whole number of blocks, or the size overflows.
    pub fn row_bytes(self, ne0: u64) -> Option<u64> {
        let (_, block, size) = self.traits()?;
        if !ne0.is_multiple_of(block) {
            return None;
        }
        (ne0 / block).checked_mul(size)
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.traits() {
            Some((name, _, _)) => f.write_str(name),
            None => write!(f, "unknown ggml type {}", self.0),
        }
    }
}

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
    use std::ffi::CStr;

    #[test]
    fn table_matches_linked_ggml() {
        let count = crate::sys::GGML_TYPE_COUNT;
        assert_eq!(
            TYPE_TABLE.len() as u32,
            count,
            "ggml added or removed types"
        );
        for id in 0..count {
            let t = GgmlType(id);
            // SAFETY: these ggml functions only index the static type_traits
            // table with an id below GGML_TYPE_COUNT.
            let (blck, size, name) = unsafe {
                let name = crate::sys::ggml_type_name(id);
                let name = (!name.is_null()).then(|| CStr::from_ptr(name).to_string_lossy());
                (
                    crate::sys::ggml_blck_size(id),
                    crate::sys::ggml_type_size(id),
                    name,
                )
            };
            match t.traits() {
                Some((n, b, s)) => {
                    assert_eq!(b as i64, blck, "block size of {n} (id {id})");
                    assert_eq!(s as usize, size, "type size of {n} (id {id})");
                    assert_eq!(Some(n), name.as_deref(), "name of id {id}");
                }
                None => assert_eq!(blck, 0, "id {id} is live in ggml ({name:?})"),
            }
        }
    }

    #[test]
    fn row_bytes_and_names() {
        assert_eq!(GgmlType::Q4_K.name(), "q4_K");
        assert_eq!(GgmlType::Q4_0.row_bytes(64), Some(36));
        assert_eq!(GgmlType::Q4_0.row_bytes(33), None);
        assert_eq!(GgmlType::F32.row_bytes(3), Some(12));
        assert_eq!(GgmlType(4).row_bytes(32), None);
        assert_eq!(GgmlType(4).name(), "unknown");
        assert_eq!(GgmlType(999).block_size(), None);
        assert_eq!(GgmlType::Q8_0.row_bytes(u64::MAX - 31), None);
        assert_eq!(GgmlType::all_known().count(), 35);
    }

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
