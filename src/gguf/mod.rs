//! GGUF v2/v3 reader and writer in plain Rust (no FFI).
//!
//! [`GgufFile::open`] reads only the header (metadata and tensor
//! descriptors) and validates everything ggml's own loader trusts or aborts
//! on: every read lies inside the file, every count is bounded by the bytes
//! left, strings are UTF-8, `general.alignment` is a power of two, each
//! tensor has 1..=4 dims of at least 1 with a whole number of blocks per row,
//! its data is aligned, inside the file and overlaps no other tensor. Once a
//! `GgufFile` exists, every `TensorInfo` can be read or mapped without further
//! checks. Typed getters return [`GgufError`] instead of aborting on a wrong
//! type. [`GgufWriter`] produces files that ggml loads (tensors in order,
//! each padded to the alignment). The reader is deliberately a little more
//! lenient than the pinned ggml, which also demands tensor offsets in file
//! order with no gaps; here any aligned, disjoint, in-file layout passes.
//!
//! Layout (little-endian): "GGUF", u32 version, u64 n_tensors, u64 n_kv,
//! n_kv x (string key, u32 type, value), n_tensors x (string name, u32 n_dims,
//! n_dims x u64 ne, u32 ggml_type, u64 offset relative to the data section),
//! padding to the alignment, then the data section. Strings are u64 length +
//! bytes; arrays are u32 element type + u64 count + elements.

mod file;
mod read;
mod types;
mod write;

pub use crate::dtype::GgmlType;
pub use file::{GgufError, GgufFile, DEFAULT_ALIGNMENT, KEY_ALIGNMENT, MAX_TENSOR_NAME};
pub use types::{Array, TensorInfo, Value};
pub use write::{GgufWriter, TensorDataFn};

#[cfg(test)]
mod tests {
    use super::*;

    fn file(kv: Vec<(&str, Value)>) -> GgufFile {
        let kv = kv.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
        GgufFile::from_parts(3, 32, 64, 64, kv, Vec::new())
    }

    #[test]
    fn integer_getters_accept_lossless_widths() {
        let f = file(vec![
            ("a", Value::U32(7)),
            ("b", Value::I32(9)),
            ("c", Value::U64(1 << 40)),
            ("d", Value::I32(-1)),
            ("e", Value::U8(3)),
            ("s", Value::Str("x".into())),
        ]);
        assert_eq!(f.get_u32("a").ok(), Some(7));
        assert_eq!(f.get_u32("b").ok(), Some(9));
        assert_eq!(f.get_u32("e").ok(), Some(3));
        assert_eq!(f.get_u64("c").ok(), Some(1 << 40));
        assert!(matches!(f.get_u32("c"), Err(GgufError::OutOfRange { .. })));
        assert!(matches!(f.get_u32("d"), Err(GgufError::OutOfRange { .. })));
        assert!(matches!(
            f.get_u32("s"),
            Err(GgufError::WrongType {
                expected: "u32",
                found: "str",
                ..
            })
        ));
        assert!(matches!(f.get_u32("zz"), Err(GgufError::MissingKey(k)) if k == "zz"));
        assert_eq!(f.get_u32_opt("zz").ok(), Some(None));
        assert!(f.get_u32_opt("s").is_err());
    }

    #[test]
    fn other_getters() {
        let f = file(vec![
            ("f", Value::F32(0.5)),
            ("g", Value::F64(1e-5)),
            ("h", Value::F64(1e300)),
            ("b", Value::Bool(true)),
            ("t", Value::Array(Array::Str(vec!["a".into()]))),
            ("i", Value::Array(Array::I32(vec![1, -2]))),
        ]);
        assert_eq!(f.get_f32("f").ok(), Some(0.5));
        assert_eq!(f.get_f32("g").ok(), Some(1e-5));
        assert!(matches!(f.get_f32("h"), Err(GgufError::OutOfRange { .. })));
        assert!(matches!(f.get_f32("b"), Err(GgufError::WrongType { .. })));
        assert_eq!(f.get_bool_opt("b").ok(), Some(Some(true)));
        assert_eq!(f.get_str_array("t").ok().map(|a| a.len()), Some(1));
        assert_eq!(f.get_i32_array("i").ok(), Some(&[1, -2][..]));
        assert!(matches!(
            f.get_f32_array("i"),
            Err(GgufError::WrongType {
                found: "array<i32>",
                ..
            })
        ));
        assert!(matches!(f.get_str("f"), Err(GgufError::WrongType { .. })));
        assert_eq!(f.get_str_opt("nope").ok(), Some(None));
        assert!(matches!(
            f.require_tensor("w"),
            Err(GgufError::MissingTensor(_))
        ));
    }
}
