//! Where a placeholder tensor's data lives, tied to the buffer that owns it.
//!
//! A graph template's weight and KV tensors are placeholders that the engine
//! points at whichever layer's memory it runs (see
//! [`Tensor::rebind`](super::Tensor::rebind)). A [`Binding`] names that
//! memory as a buffer and an offset inside it, and holds a reference to the
//! buffer: a template that keeps the bindings it was pointed at cannot point
//! into memory that was freed. Offsets are checked against the buffer's size
//! when a binding is made, and the tensor's allocation size against what is
//! left of the buffer when it is bound.

use super::buffer::Buffer;
use super::context::Tensor;
use super::error::{GgmlError, Result};
use crate::sys;
use std::sync::Arc;

/// Memory a tensor's data lives in: an offset inside a shared buffer, and
/// the backend's per-tensor data for it (a repacked CPU weight's layout).
#[derive(Clone)]
pub struct Binding {
    buffer: Arc<Buffer>,
    offset: usize,
    /// The backend's per-tensor data (a repacked CPU weight's layout
    /// traits, static per buffer type); null for plain memory.
    extra: *mut std::ffi::c_void,
}

// SAFETY: the buffer is shared through an Arc (Buffer is Send and Sync);
// `extra` points at a backend's static per-buffer-type traits, which are
// never freed and never written through a binding.
unsafe impl Send for Binding {}
// SAFETY: as above; a shared binding only reads its fields.
unsafe impl Sync for Binding {}

impl Binding {
    /// Plain memory at `offset` inside `buffer`.
    pub fn at(buffer: &Arc<Buffer>, offset: usize) -> Result<Binding> {
        if offset > buffer.size() {
            return Err(GgmlError::Tensor {
                name: buffer.name(),
                what: format!(
                    "binding at offset {offset} is outside the {} byte buffer",
                    buffer.size()
                ),
            });
        }
        Ok(Binding {
            buffer: buffer.clone(),
            offset,
            extra: std::ptr::null_mut(),
        })
    }

    /// Where `t`, a tensor placed in `buffer`, lives (with the extra data
    /// the buffer gave it when it was placed).
    pub fn of(buffer: &Arc<Buffer>, t: Tensor<'_>) -> Result<Binding> {
        // SAFETY: reading three pointer fields of a live tensor header.
        let (data, buf, extra) = unsafe {
            let r = &*t.raw();
            (r.data, r.buffer, r.extra)
        };
        let base = buffer.base() as usize;
        let at = (data as usize).wrapping_sub(base);
        if buf != buffer.raw() || data.is_null() || at > buffer.size() {
            return Err(GgmlError::Tensor {
                name: t.name(),
                what: format!("is not placed in buffer {}", buffer.name()),
            });
        }
        Ok(Binding {
            extra,
            ..Binding::at(buffer, at)?
        })
    }

    /// The shared buffer (to make another binding inside it).
    pub fn buffer_arc(&self) -> &Arc<Buffer> {
        &self.buffer
    }
    pub fn buffer(&self) -> &Buffer {
        &self.buffer
    }
    /// Byte offset inside the buffer.
    pub fn offset(&self) -> usize {
        self.offset
    }
    /// Bytes from the offset to the end of the buffer.
    pub fn room(&self) -> usize {
        self.buffer.size() - self.offset
    }
    pub(super) fn extra(&self) -> *mut std::ffi::c_void {
        self.extra
    }
}

impl std::fmt::Debug for Binding {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Binding({} + {})", self.buffer.name(), self.offset)
    }
}

impl Tensor<'_> {
    /// Points this tensor at the memory `b` names: the rebinding of a graph
    /// template's weight or KV placeholder. Views of this tensor must be
    /// refreshed afterwards ([`super::Graph::refresh_views`]). Fails, changing
    /// nothing, when the tensor's allocation (padding that kernels may read
    /// included) runs past the end of `b`'s buffer.
    ///
    /// # Safety
    /// - `b` holds this tensor's data in the layout of `b`'s buffer type:
    ///   written for this tensor's type and shape;
    /// - `b`'s buffer stays allocated while any computation that reads this
    ///   tensor may run: the caller keeps `b` (or another reference to its
    ///   buffer) until the tensor is rebound or dropped, and rebinds or drops
    ///   it only when no computation of its graph is in flight.
    pub unsafe fn rebind(&self, b: &Binding) -> Result<()> {
        // SAFETY: a query of the buffer's type on a valid tensor header.
        let need = unsafe {
            sys::ggml_backend_buft_get_alloc_size(
                sys::ggml_backend_buffer_get_type(b.buffer().raw()),
                self.raw(),
            )
        };
        if need > b.room() {
            return Err(GgmlError::Tensor {
                name: self.name(),
                what: format!(
                    "needs {need} bytes, but its binding has {} left in {}",
                    b.room(),
                    b.buffer().name()
                ),
            });
        }
        // SAFETY: we only write three pointer fields of a header we own
        // through the context; kernels read them at launch, so this takes
        // effect at the next compute. The data lies inside the buffer (checked
        // above); what it holds and how long it lives is the caller's
        // contract.
        unsafe {
            let t = &mut *self.raw();
            t.data = b.buffer().base().add(b.offset()).cast();
            t.buffer = b.buffer().raw();
            t.extra = b.extra();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::GgmlType;
    use crate::ggml::{BufferUsage, Context, TensorArena, TensorSpec};

    #[test]
    fn bindings_stay_inside_their_buffer_and_keep_it_alive() {
        crate::ggml::load_backends().unwrap();
        let buft = crate::ggml::cpu_device().unwrap().buffer_type();
        let spec = TensorSpec::new(GgmlType::F32, &[4]);
        let a = TensorArena::new(buft, BufferUsage::Any, &[spec.clone(), spec]).unwrap();
        assert!(Binding::at(a.buffer(), a.buffer().size() + 1).is_err());
        let ctx = Context::new(2, 0).unwrap();
        // a tensor of another arena is not placed in this buffer
        let other = TensorArena::new(
            buft,
            BufferUsage::Any,
            &[TensorSpec::new(GgmlType::F32, &[4])],
        )
        .unwrap();
        assert!(Binding::of(a.buffer(), other.tensor(0)).is_err());
        let last = a.binding(1);
        assert_eq!(last.offset(), a.offset(1));
        // a placeholder larger than what is left of the buffer is refused
        let big = ctx.new_tensor(GgmlType::F32, &[1 << 20]);
        // SAFETY: the call fails before writing anything.
        assert!(unsafe { big.rebind(&last) }.is_err());
        assert!(!big.is_bound());
        let small = ctx.new_tensor(GgmlType::F32, &[4]);
        // SAFETY: `last` holds an F32 [4] tensor and outlives every use below.
        unsafe { small.rebind(&last) }.unwrap();
        a.tensor(1).set_f32(&[1.0, 2.0, 3.0, 4.0]).unwrap();
        // the binding keeps the buffer: dropping the arena does not free it
        assert_eq!(Arc::strong_count(a.buffer()), 2);
        drop(a);
        let mut out = [0.0f32; 4];
        small.get_f32(&mut out).unwrap();
        assert_eq!(out, [1.0, 2.0, 3.0, 4.0]);
    }
}
