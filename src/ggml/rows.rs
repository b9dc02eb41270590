//! Small facts from ggml itself: its version, C strings it owns, row sizes
//! and its own dequantizer.

use super::error::{GgmlError, Result};
use crate::dtype::GgmlType;

/// The ggml version string libggml-base reports (e.g. "0.26.0").
pub fn version() -> String {
    // SAFETY: ggml_version returns a pointer to a static NUL-terminated string.
    unsafe { cstr_to_string(crate::sys::ggml_version()) }
}

/// Copies a C string owned by ggml into a Rust `String` (empty if null).
///
/// # Safety
/// `p` must be null or point to a NUL-terminated string valid for this call.
pub(crate) unsafe fn cstr_to_string(p: *const std::os::raw::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
}

/// Bytes of one row of `ne0` elements of `ty`, as ggml computes it.
pub fn row_size(ty: GgmlType, ne0: i64) -> usize {
    // SAFETY: pure function of its arguments.
    unsafe { crate::sys::ggml_row_size(ty.0, ne0) }
}

/// Dequantizes `n` elements of type `ty` from `src` into `dst` with ggml's own
/// `to_float` (so results equal what `get_rows` computes).
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    let n = dst.len();
    let need = row_size(ty, n as i64);
    if src.len() < need {
        return Err(GgmlError::Tensor {
            name: ty.name().into(),
            what: format!("row needs {need} bytes, got {}", src.len()),
        });
    }
    if ty == GgmlType::F32 {
        for (d, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
            *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        }
        return Ok(());
    }
    // SAFETY: ggml_get_type_traits returns a pointer to a static table entry.
    let traits = unsafe { &*crate::sys::ggml_get_type_traits(ty.0) };
    let Some(to_float) = traits.to_float else {
        return Err(GgmlError::Tensor {
            name: ty.name().into(),
            what: "type has no dequantizer".into(),
        });
    };
    // SAFETY: src holds at least row_size(ty, n) bytes and dst holds n floats,
    // which is exactly what to_float reads and writes.
    unsafe { to_float(src.as_ptr().cast(), dst.as_mut_ptr(), n as i64) };
    Ok(())
}
