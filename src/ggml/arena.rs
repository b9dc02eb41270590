//! Tensors that live together in one backend buffer.
//!
//! A [`TensorArena`] owns the context that holds the tensors' headers and
//! the buffer that holds their data, and places each tensor at its own
//! aligned offset. It hands out the tensors ([`TensorArena::tensor`]) and
//! where their data lives ([`Binding`], what a graph template's placeholder
//! is pointed at, which keeps the buffer alive), so no caller writes the context + buffer + offset + raw
//! pointer pattern itself.

use super::binding::Binding;
use super::buffer::Buffer;
use super::buffer::BufferType;
use super::buffer::BufferUsage;
use super::context::Context;
use super::context::Tensor;
use super::error::GgmlError;
use super::error::Result;
use crate::dtype::GgmlType;
use crate::sys;
use std::ptr::NonNull;
use std::sync::Arc;

/// One tensor of an arena: its type, shape and (optional) name.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorSpec {
    pub ty: GgmlType,
    pub ne: Vec<i64>,
    pub name: Option<String>,
}

impl TensorSpec {
    pub fn new(ty: GgmlType, ne: &[i64]) -> TensorSpec {
        TensorSpec {
            ty,
            ne: ne.to_vec(),
            name: None,
        }
    }
    pub fn named(mut self, name: &str) -> TensorSpec {
        self.name = Some(name.to_string());
        self
    }
}

/// Tensors in one buffer, in the order they were asked for, each at an
/// offset aligned to the buffer type and sized as the buffer type sizes it
/// (quantized rows may be padded). The buffer starts zeroed: kernels that
/// read past a row, or attention over masked cells, see finite zeros.
pub struct TensorArena {
    // the tensors' headers (in ctx) point into buf; both go together
    ctx: Context,
    buf: Arc<Buffer>,
    tensors: Vec<NonNull<sys::ggml_tensor>>,
    offsets: Vec<usize>,
}

// SAFETY: the arena owns its context and buffer; the raw tensor handles
// point into them and are only used through &self / &mut self.
unsafe impl Send for TensorArena {}

impl TensorArena {
    pub fn new(buft: BufferType, usage: BufferUsage, specs: &[TensorSpec]) -> Result<TensorArena> {
        let ctx = Context::new(specs.len().max(1), 0)?;
        let align = buft.alignment();
        let mut tensors = Vec::with_capacity(specs.len());
        let mut offsets = Vec::with_capacity(specs.len());
        let mut size = 0usize;
        for s in specs {
            let mut t = ctx.new_tensor(s.ty, &s.ne);
            if let Some(n) = &s.name {
                t = t.named(n);
            }
            offsets.push(size);
            let need = buft.alloc_size(t).div_ceil(align) * align;
            size = size.checked_add(need).ok_or_else(|| GgmlError::Tensor {
                name: t.name(),
                what: "the arena's size overflows".into(),
            })?;
            tensors.push(NonNull::new(t.raw()).ok_or(GgmlError::ContextAlloc(0))?);
        }
        let buf = Buffer::alloc(buft, size, usage)?;
        buf.clear(0);
        let arena = TensorArena {
            ctx,
            buf: Arc::new(buf),
            tensors,
            offsets,
        };
        for i in 0..arena.tensors.len() {
            arena.buf.place(arena.tensor(i), arena.offsets[i])?;
        }
        Ok(arena)
    }
    /// The `i`th tensor.
    pub fn tensor(&self, i: usize) -> Tensor<'_> {
        // SAFETY: the handle was made in self.ctx, which lives as long as self.
        unsafe { Tensor::from_raw(&self.ctx, self.tensors[i]) }
    }
    /// Where the `i`th tensor's data lives.
    pub fn binding(&self, i: usize) -> Binding {
        Binding::of(&self.buf, self.tensor(i)).expect("placed in this arena's buffer")
    }
    /// Byte offset of the `i`th tensor in the buffer.
    pub fn offset(&self, i: usize) -> usize {
        self.offsets[i]
    }
    pub fn len(&self) -> usize {
        self.tensors.len()
    }
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }
    /// Size of the buffer, padding included.
    pub fn bytes(&self) -> usize {
        self.buf.size()
    }
    /// The buffer, shared with the bindings that point into it.
    pub fn buffer(&self) -> &Arc<Buffer> {
        &self.buf
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensors_are_placed_aligned_and_zeroed() {
        crate::ggml::load_backends().unwrap();
        let dev = crate::ggml::cpu_device().unwrap();
        let buft = dev.buffer_type();
        let a = TensorArena::new(
            buft,
            BufferUsage::Any,
            &[
                TensorSpec::new(GgmlType::F32, &[3]).named("a"),
                TensorSpec::new(GgmlType::F16, &[7, 2]),
                TensorSpec::new(GgmlType::I32, &[5]),
            ],
        )
        .unwrap();
        assert_eq!(a.len(), 3);
        assert_eq!(a.tensor(0).name(), "a");
        let align = buft.alignment();
        let mut end = 0;
        for i in 0..a.len() {
            assert_eq!(a.offset(i) % align, 0);
            assert!(a.offset(i) >= end, "tensor {i} overlaps the one before");
            end = a.offset(i) + a.tensor(i).nbytes();
            let b = a.binding(i);
            assert_eq!(b.buffer().raw(), a.buffer().raw());
            assert_eq!(b.offset(), a.offset(i));
        }
        assert!(end <= a.bytes());
        let mut out = [1.0f32; 3];
        a.tensor(0).get_f32(&mut out).unwrap();
        assert_eq!(out, [0.0; 3]);
        a.tensor(0).set_f32(&[1.0, 2.0, 3.0]).unwrap();
        a.tensor(0).get_f32(&mut out).unwrap();
        assert_eq!(out, [1.0, 2.0, 3.0]);
    }
}
