//! The ggml tensor types: ids, names, block sizes and row bytes. The
//! vocabulary ggml/ (tensors) and gguf/ (model files) share, kept below
//! both so neither depends on the other.
//!
//! The type table mirrors `type_traits` in the pinned ggml source
//! (`ggml/src/ggml.c`, enum `ggml_type` in `ggml/include/ggml.h`); ids that
//! ggml removed (4, 5, 31..=33, 36..=38) are unknown here, exactly as ggml
//! refuses them in GGUF files. A unit test cross-checks every entry against
//! the linked ggml through FFI. Plain Rust otherwise; nothing here panics.

/// A raw `ggml_type` id, as ggml and GGUF tensor descriptors store it.
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
}
