//! Backend buffers and their types: device memory, pinned host memory, and
//! the CPU's repacked weight layouts. Each [`Buffer`] frees its memory on drop.

use super::context::Tensor;
use super::error::GgmlError;
use super::error::Result;
use super::rows::cstr_to_string;
use crate::sys;
use std::ptr::NonNull;

/// A device's buffer type (device memory, or pinned host memory). Buffer
/// types are static registry entries: only obtained from a [`Device`].
#[derive(Clone, Copy, Debug)]
pub struct BufferType(pub(super) sys::ggml_backend_buffer_type_t);

// SAFETY: buffer types are immutable registry entries.
unsafe impl Send for BufferType {}
// SAFETY: as above: shared references only read the registry entry.
unsafe impl Sync for BufferType {}

impl BufferType {
    pub fn raw(&self) -> sys::ggml_backend_buffer_type_t {
        self.0
    }
    pub fn name(&self) -> String {
        // SAFETY: static name of a registered buffer type.
        unsafe { cstr_to_string(sys::ggml_backend_buft_name(self.0)) }
    }
    /// Alignment of allocations (at least 1).
    pub fn alignment(&self) -> usize {
        // SAFETY: pure query.
        unsafe { sys::ggml_backend_buft_get_alignment(self.0) }.max(1)
    }
    /// Bytes `t` needs in a buffer of this type (may exceed nbytes: padding).
    pub fn alloc_size(&self, t: Tensor<'_>) -> usize {
        // SAFETY: t is a valid tensor header; the query reads its shape.
        unsafe { sys::ggml_backend_buft_get_alloc_size(self.0, t.raw()) }
    }
}

/// How a buffer is used (the scheduler and some backends care).
#[derive(Clone, Copy, Debug)]
pub enum BufferUsage {
    Any,
    Weights,
    Compute,
}

/// An owned backend buffer.
pub struct Buffer {
    ptr: NonNull<sys::ggml_backend_buffer>,
}

// SAFETY: buffer handles may be moved across threads; access is synchronized
// by the engine (events) like any device memory.
unsafe impl Send for Buffer {}
// SAFETY: through a shared reference a buffer reads its immutable metadata
// (handle, base, size, type) or writes device memory (clear, placing a
// tensor), whose ordering against other users the engine provides with
// events and synchronization, as for any device memory.
unsafe impl Sync for Buffer {}

impl Buffer {
    /// Allocates `size` bytes of buffer type `buft`.
    pub fn alloc(buft: BufferType, size: usize, usage: BufferUsage) -> Result<Buffer> {
        // SAFETY: buft is a live buffer type; size may be anything.
        let b = unsafe { sys::ggml_backend_buft_alloc_buffer(buft.0, size.max(1)) };
        let ptr = NonNull::new(b).ok_or_else(|| GgmlError::BufferAlloc {
            size,
            buft: buft.name(),
        })?;
        let u = match usage {
            BufferUsage::Any => sys::GGML_BACKEND_BUFFER_USAGE_ANY,
            BufferUsage::Weights => sys::GGML_BACKEND_BUFFER_USAGE_WEIGHTS,
            BufferUsage::Compute => sys::GGML_BACKEND_BUFFER_USAGE_COMPUTE,
        };
        // SAFETY: ptr is the buffer just allocated.
        unsafe { sys::ggml_backend_buffer_set_usage(ptr.as_ptr(), u) };
        Ok(Buffer { ptr })
    }
    pub fn raw(&self) -> sys::ggml_backend_buffer_t {
        self.ptr.as_ptr()
    }
    pub fn base(&self) -> *mut u8 {
        // SAFETY: live buffer.
        unsafe { sys::ggml_backend_buffer_get_base(self.raw()).cast() }
    }
    pub fn size(&self) -> usize {
        // SAFETY: live buffer.
        unsafe { sys::ggml_backend_buffer_get_size(self.raw()) }
    }
    pub fn name(&self) -> String {
        // SAFETY: live buffer; static name.
        unsafe { cstr_to_string(sys::ggml_backend_buffer_name(self.raw())) }
    }
    pub fn is_host(&self) -> bool {
        // SAFETY: live buffer.
        unsafe { sys::ggml_backend_buffer_is_host(self.raw()) }
    }
    pub fn clear(&self, value: u8) {
        // SAFETY: live buffer; the caller ensures no computation uses it now.
        unsafe { sys::ggml_backend_buffer_clear(self.raw(), value) }
    }
    /// Places `t` (never bound before) at byte `offset` of this buffer.
    pub fn place(&self, t: Tensor<'_>, offset: usize) -> Result<()> {
        let need = t.nbytes();
        if offset + need > self.size() {
            return Err(GgmlError::Tensor {
                name: t.name(),
                what: format!(
                    "{need} bytes at offset {offset} overflow a {} byte buffer",
                    self.size()
                ),
            });
        }
        // SAFETY: t is unbound (checked by ggml), the address lies inside the
        // buffer (checked above).
        let st = unsafe {
            sys::ggml_backend_tensor_alloc(self.raw(), t.raw(), self.base().add(offset).cast())
        };
        if st != sys::GGML_STATUS_SUCCESS {
            return Err(GgmlError::Tensor {
                name: t.name(),
                what: format!("tensor_alloc failed ({st})"),
            });
        }
        Ok(())
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: we own the buffer; tensors pointing into it must not be used
        // after this (the engine drops graphs before buffers).
        unsafe { sys::ggml_backend_buffer_free(self.ptr.as_ptr()) }
    }
}
