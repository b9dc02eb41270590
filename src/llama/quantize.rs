//! llama.cpp's own quantizer (`llama_model_quantize`, what llama-quantize
//! runs): the reference the converter's type mixes are checked against.

use super::model::{checked_file, LlamaError};
use crate::sys;
use std::ffi::CString;
use std::path::Path;

/// Quantizes `input` into `output` as llama-quantize would for file type
/// `ftype` (llama_ftype: 15 is Q4_K_M), on `threads` threads.
pub fn quantize_reference(
    input: &Path,
    output: &Path,
    ftype: u32,
    threads: i32,
) -> Result<(), LlamaError> {
    checked_file(input)?;
    let c = |p: &Path| CString::new(p.to_string_lossy().as_bytes()).map_err(|_| LlamaError::Nul);
    let (i, o) = (c(input)?, c(output)?);
    // llama_model_quantize copies the input's general.alignment (strata
    // writes 4096) but lays tensors out at gguf's default of 32 bytes: the
    // key is overridden to what the data follows, and a terminating entry
    // (empty key) ends the list.
    // SAFETY: an all-zero override is a valid C struct (tag INT, empty key).
    let mut overrides: [sys::llama_model_kv_override; 2] = unsafe { std::mem::zeroed() };
    for (d, s) in overrides[0]
        .key
        .iter_mut()
        .zip(c"general.alignment".to_bytes())
    {
        *d = *s as std::os::raw::c_char;
    }
    overrides[0].tag = sys::LLAMA_KV_OVERRIDE_TYPE_INT;
    overrides[0].__bindgen_anon_1.val_i64 = 32;
    // SAFETY: default params are a plain struct; we change plain fields.
    let mut p = unsafe { sys::llama_model_quantize_default_params() };
    p.nthread = threads;
    p.ftype = ftype as sys::llama_ftype;
    p.kv_overrides = overrides.as_ptr();
    // SAFETY: both paths are NUL-terminated strings and `overrides` (ended
    // by an empty key) is alive for the call; the other pointers of `p` are
    // the defaults' NULLs.
    let rc = unsafe { sys::llama_model_quantize(i.as_ptr(), o.as_ptr(), &p) };
    if rc != 0 {
        return Err(LlamaError::Invalid {
            path: input.display().to_string(),
            what: format!("llama_model_quantize failed ({rc})"),
        });
    }
    Ok(())
}
