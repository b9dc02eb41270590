//! Safe layer over the raw ggml bindings (`crate::sys`, bindgen output of the
//! pinned llama.cpp/ggml source).
//!
//! Invariants kept here:
//! - tensors that live together in one buffer come from a [`TensorArena`],
//!   which owns their context and buffer and hands out tensors and bindings;
//! - every C handle has exactly one owner whose `Drop` frees it
//!   ([`Context`], [`Backend`], [`Buffer`], [`Event`], [`GraphAllocator`]);
//! - a [`Tensor`] or [`Graph`] borrows the [`Context`] that holds its metadata,
//!   so it cannot outlive it;
//! - backends are modules loaded at run time ([`load_backends`]); no
//!   backend-specific symbol is linked: the CPU module's own functions are
//!   reached through strata's C shim (ffi/shim/), which finds them in the
//!   module and calls them with their declared signatures.

mod arena;
mod backend;
mod context;
mod graph;

pub use arena::{Binding, TensorArena, TensorSpec};
pub use backend::{
    cpu_device, devices, gpu_device, load_backends, Backend, Buffer, BufferType, BufferUsage,
    Device, Event, MAX_THREADS,
};
pub use context::{Context, RopeParams, Tensor};
pub use graph::{Graph, GraphAllocator, NodeInfo};

use crate::dtype::GgmlType;

/// Errors from the ggml layer. Each names the operation that failed.
#[derive(Debug, thiserror::Error)]
pub enum GgmlError {
    #[error("ggml_init failed to allocate a context of {0} bytes")]
    ContextAlloc(usize),
    #[error("no ggml backend modules found (searched: {searched})")]
    NoBackends { searched: String },
    #[error("no {0} device is available")]
    NoDevice(&'static str),
    #[error("could not initialize a backend on device {0}")]
    BackendInit(String),
    #[error("could not allocate a {size} byte buffer on {buft}")]
    BufferAlloc { size: usize, buft: String },
    #[error("could not create an event on device {0}")]
    EventInit(String),
    #[error("graph computation failed with ggml status {0}")]
    Compute(i32),
    #[error("graph allocation failed (reserve or alloc) for {0}")]
    GraphAlloc(String),
    #[error("backend module {module} was built from ggml {found}, but strata uses ggml {expected}; rebuild it with tools/build-cuda-module.sh")]
    VersionMismatch {
        module: String,
        found: String,
        expected: String,
    },
    #[error("{0}")]
    ModuleRefused(String),
    #[error("tensor {name}: {what}")]
    Tensor { name: String, what: String },
}

pub type Result<T> = std::result::Result<T, GgmlError>;

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
