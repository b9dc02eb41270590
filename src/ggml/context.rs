//! Contexts (tensor metadata arenas, always `no_alloc`) and tensor handles.
//!
//! A [`Context`] owns a `ggml_context`; a [`Tensor`] is a copyable handle that
//! borrows it. Tensor data lives in backend buffers, never in the context.
//! Shapes are in ggml order: `ne[0]` is the contiguous dimension.

use super::error::GgmlError;
use super::error::Result;
use crate::dtype::GgmlType;
use crate::sys;
use std::ffi::CString;
use std::marker::PhantomData;
use std::ptr::NonNull;

/// An owned `ggml_context` created with `no_alloc`.
pub struct Context {
    ptr: NonNull<sys::ggml_context>,
}

// SAFETY: a context is plain host memory owned by this value; moving it to
// another thread is fine (we never use one from two threads at once).
unsafe impl Send for Context {}

impl Context {
    /// A context with room for `n_tensors` tensor headers and one graph of
    /// `graph_size` nodes (0 for none).
    pub fn new(n_tensors: usize, graph_size: usize) -> Result<Context> {
        // SAFETY: pure size queries.
        let mem_size = unsafe {
            sys::ggml_tensor_overhead() * n_tensors
                + if graph_size > 0 {
                    sys::ggml_graph_overhead_custom(graph_size, false)
                } else {
                    0
                }
        };
        let params = sys::ggml_init_params {
            mem_size,
            mem_buffer: std::ptr::null_mut(),
            no_alloc: true,
        };
        // SAFETY: params are valid; ggml allocates and owns mem_size bytes.
        let p = unsafe { sys::ggml_init(params) };
        NonNull::new(p)
            .map(|ptr| Context { ptr })
            .ok_or(GgmlError::ContextAlloc(mem_size))
    }

    pub fn raw(&self) -> *mut sys::ggml_context {
        self.ptr.as_ptr()
    }

    fn wrap(&self, p: *mut sys::ggml_tensor) -> Tensor<'_> {
        // ggml aborts rather than returning null when a context is full or
        // shapes disagree, so a null here is a broken invariant.
        Tensor {
            ptr: NonNull::new(p).expect("ggml returned a null tensor"),
            _ctx: PhantomData,
        }
    }

    /// A new tensor of `ty` with shape `ne` (1 to 4 dims, ggml order).
    pub fn new_tensor(&self, ty: GgmlType, ne: &[i64]) -> Tensor<'_> {
        assert!((1..=4).contains(&ne.len()), "tensor rank must be 1..=4");
        // SAFETY: the context is live; ne has ne.len() elements.
        self.wrap(unsafe { sys::ggml_new_tensor(self.raw(), ty.0, ne.len() as i32, ne.as_ptr()) })
    }

    // ---- operations (each returns a new node in this context) ----
    // SAFETY (all ops below): every argument tensor belongs to this context
    // (enforced by the shared lifetime) and ggml checks shapes itself.

    /// `w · x`. A quantized `w` may be multiplied in BF16 with F32
    /// accumulation: what the GPU does when a large step leaves ggml's
    /// quantized kernels for cuBLAS (see `paging::gemm`); without it ggml
    /// would pick F16 accumulation there. The quantized kernels and the
    /// CPU ignore it.
    pub fn mul_mat<'a>(&'a self, w: Tensor<'a>, x: Tensor<'a>) -> Tensor<'a> {
        // SAFETY: see above.
        let t = self.wrap(unsafe { sys::ggml_mul_mat(self.raw(), w.raw(), x.raw()) });
        if w.ty().block_size().is_some_and(|b| b > 1) {
            // SAFETY: t is a MUL_MAT node of this context; this sets its
            // accumulator precision parameter.
            unsafe { sys::ggml_prec_set_acc(t.raw(), sys::GGML_PREC_BF16) };
        }
        t
    }
    /// `as[ids] · b`: for each of `b`'s rows and each of its `ids`, the
    /// product with that expert's matrix. `as` F32/quantized
    /// [k, m, n_expert], `b` F32 [k, n_used or 1, n_tokens], `ids` I32
    /// [n_used, n_tokens]; result F32 [m, n_used, n_tokens].
    pub fn mul_mat_id<'a>(&'a self, w: Tensor<'a>, x: Tensor<'a>, ids: Tensor<'a>) -> Tensor<'a> {
        // SAFETY: operands belong to this context (shared lifetime); ggml checks shapes.
        self.wrap(unsafe { sys::ggml_mul_mat_id(self.raw(), w.raw(), x.raw(), ids.raw()) })
    }
    /// `a` filled with `c` in place (F32 or F16).
    pub fn fill_inplace<'a>(&'a self, a: Tensor<'a>, c: f32) -> Tensor<'a> {
        // SAFETY: operands belong to this context (shared lifetime); ggml checks types.
        self.wrap(unsafe { sys::ggml_fill_inplace(self.raw(), a.raw(), c) })
    }
    /// `a * s`.
    pub fn scale<'a>(&'a self, a: Tensor<'a>, s: f32) -> Tensor<'a> {
        // SAFETY: operands belong to this context (shared lifetime); ggml checks shapes.
        self.wrap(unsafe { sys::ggml_scale(self.raw(), a.raw(), s) })
    }
    /// GELU(gate) * up, GELU by its tanh approximation.
    pub fn geglu_split<'a>(&'a self, gate: Tensor<'a>, up: Tensor<'a>) -> Tensor<'a> {
        // SAFETY: operands belong to this context (shared lifetime); ggml checks shapes.
        self.wrap(unsafe { sys::ggml_geglu_split(self.raw(), gate.raw(), up.raw()) })
    }
    /// Softmax along rows (ne0).
    pub fn soft_max<'a>(&'a self, a: Tensor<'a>) -> Tensor<'a> {
        // SAFETY: operands belong to this context (shared lifetime); ggml checks shapes.
        self.wrap(unsafe { sys::ggml_soft_max(self.raw(), a.raw()) })
    }
    /// I32 indices of the `k` largest values of each row, largest first.
    pub fn argsort_top_k<'a>(&'a self, a: Tensor<'a>, k: i32) -> Tensor<'a> {
        // SAFETY: operands belong to this context (shared lifetime); ggml checks shapes.
        self.wrap(unsafe { sys::ggml_argsort_top_k(self.raw(), a.raw(), k) })
    }
    /// Each row's sum: [1, ne1, ...].
    pub fn sum_rows<'a>(&'a self, a: Tensor<'a>) -> Tensor<'a> {
        // SAFETY: operands belong to this context (shared lifetime); ggml checks shapes.
        self.wrap(unsafe { sys::ggml_sum_rows(self.raw(), a.raw()) })
    }
    pub fn clamp<'a>(&'a self, a: Tensor<'a>, min: f32, max: f32) -> Tensor<'a> {
        // SAFETY: operands belong to this context (shared lifetime); ggml checks shapes.
        self.wrap(unsafe { sys::ggml_clamp(self.raw(), a.raw(), min, max) })
    }
    /// `a / b`, `b` broadcast along `a`'s rows where it is narrower.
    pub fn div<'a>(&'a self, a: Tensor<'a>, b: Tensor<'a>) -> Tensor<'a> {
        // SAFETY: operands belong to this context (shared lifetime); ggml checks shapes.
        self.wrap(unsafe { sys::ggml_div(self.raw(), a.raw(), b.raw()) })
    }
    /// A contiguous copy of a view.
    pub fn cont<'a>(&'a self, a: Tensor<'a>) -> Tensor<'a> {
        // SAFETY: operands belong to this context (shared lifetime); ggml checks shapes.
        self.wrap(unsafe { sys::ggml_cont(self.raw(), a.raw()) })
    }
    pub fn mul<'a>(&'a self, a: Tensor<'a>, b: Tensor<'a>) -> Tensor<'a> {
        // SAFETY: operands belong to this context (shared lifetime); ggml checks shapes.
        self.wrap(unsafe { sys::ggml_mul(self.raw(), a.raw(), b.raw()) })
    }
    pub fn add<'a>(&'a self, a: Tensor<'a>, b: Tensor<'a>) -> Tensor<'a> {
        // SAFETY: operands belong to this context (shared lifetime); ggml checks shapes.
        self.wrap(unsafe { sys::ggml_add(self.raw(), a.raw(), b.raw()) })
    }
    /// `a + b` written over `a` (a view of it is returned).
    pub fn add_inplace<'a>(&'a self, a: Tensor<'a>, b: Tensor<'a>) -> Tensor<'a> {
        // SAFETY: operands belong to this context (shared lifetime); ggml checks shapes.
        self.wrap(unsafe { sys::ggml_add_inplace(self.raw(), a.raw(), b.raw()) })
    }
    pub fn rms_norm<'a>(&'a self, a: Tensor<'a>, eps: f32) -> Tensor<'a> {
        // SAFETY: operands belong to this context (shared lifetime); ggml checks shapes.
        self.wrap(unsafe { sys::ggml_rms_norm(self.raw(), a.raw(), eps) })
    }
    pub fn get_rows<'a>(&'a self, a: Tensor<'a>, ids: Tensor<'a>) -> Tensor<'a> {
        // SAFETY: operands belong to this context (shared lifetime); ggml checks shapes.
        self.wrap(unsafe { sys::ggml_get_rows(self.raw(), a.raw(), ids.raw()) })
    }
    /// Writes the rows of `src` into `dst` at row indices `ids` (I64).
    pub fn set_rows<'a>(&'a self, dst: Tensor<'a>, src: Tensor<'a>, ids: Tensor<'a>) -> Tensor<'a> {
        // SAFETY: operands belong to this context (shared lifetime); ggml checks shapes.
        self.wrap(unsafe { sys::ggml_set_rows(self.raw(), dst.raw(), src.raw(), ids.raw()) })
    }
    pub fn cpy<'a>(&'a self, src: Tensor<'a>, dst: Tensor<'a>) -> Tensor<'a> {
        // SAFETY: operands belong to this context (shared lifetime); ggml checks shapes.
        self.wrap(unsafe { sys::ggml_cpy(self.raw(), src.raw(), dst.raw()) })
    }
    pub fn swiglu_split<'a>(&'a self, gate: Tensor<'a>, up: Tensor<'a>) -> Tensor<'a> {
        // SAFETY: operands belong to this context (shared lifetime); ggml checks shapes.
        self.wrap(unsafe { sys::ggml_swiglu_split(self.raw(), gate.raw(), up.raw()) })
    }
    pub fn reshape_2d<'a>(&'a self, a: Tensor<'a>, ne0: i64, ne1: i64) -> Tensor<'a> {
        // SAFETY: operands belong to this context (shared lifetime); ggml checks shapes.
        self.wrap(unsafe { sys::ggml_reshape_2d(self.raw(), a.raw(), ne0, ne1) })
    }
    pub fn reshape_3d<'a>(&'a self, a: Tensor<'a>, ne0: i64, ne1: i64, ne2: i64) -> Tensor<'a> {
        // SAFETY: operands belong to this context (shared lifetime); ggml checks shapes.
        self.wrap(unsafe { sys::ggml_reshape_3d(self.raw(), a.raw(), ne0, ne1, ne2) })
    }
    pub fn view_2d<'a>(
        &'a self,
        a: Tensor<'a>,
        ne0: i64,
        ne1: i64,
        nb1: usize,
        offset: usize,
    ) -> Tensor<'a> {
        // SAFETY: operands belong to this context (shared lifetime); ggml checks shapes.
        self.wrap(unsafe { sys::ggml_view_2d(self.raw(), a.raw(), ne0, ne1, nb1, offset) })
    }
    #[allow(clippy::too_many_arguments)]
    pub fn view_3d<'a>(
        &'a self,
        a: Tensor<'a>,
        ne: [i64; 3],
        nb1: usize,
        nb2: usize,
        offset: usize,
    ) -> Tensor<'a> {
        // SAFETY: operands belong to this context (shared lifetime); ggml checks shapes.
        self.wrap(unsafe {
            sys::ggml_view_3d(self.raw(), a.raw(), ne[0], ne[1], ne[2], nb1, nb2, offset)
        })
    }
    pub fn permute<'a>(&'a self, a: Tensor<'a>, axes: [i32; 4]) -> Tensor<'a> {
        // SAFETY: operands belong to this context (shared lifetime); ggml checks shapes.
        self.wrap(unsafe {
            sys::ggml_permute(self.raw(), a.raw(), axes[0], axes[1], axes[2], axes[3])
        })
    }
    /// `ggml_rope_ext` with the llama.cpp argument order.
    #[allow(clippy::too_many_arguments)]
    pub fn rope_ext<'a>(
        &'a self,
        a: Tensor<'a>,
        pos: Tensor<'a>,
        freq_factors: Option<Tensor<'a>>,
        n_rot: i32,
        mode: i32,
        p: &RopeParams,
    ) -> Tensor<'a> {
        let ff = freq_factors.map_or(std::ptr::null_mut(), |t| t.raw());
        // SAFETY: operands belong to this context (shared lifetime); ggml checks shapes.
        self.wrap(unsafe {
            sys::ggml_rope_ext(
                self.raw(),
                a.raw(),
                pos.raw(),
                ff,
                n_rot,
                mode,
                p.n_ctx_orig,
                p.freq_base,
                p.freq_scale,
                p.ext_factor,
                p.attn_factor,
                p.beta_fast,
                p.beta_slow,
            )
        })
    }
    /// Flash attention with F32 accumulation, as llama.cpp builds it.
    pub fn flash_attn_ext<'a>(
        &'a self,
        q: Tensor<'a>,
        k: Tensor<'a>,
        v: Tensor<'a>,
        mask: Tensor<'a>,
        scale: f32,
    ) -> Tensor<'a> {
        // SAFETY: operands belong to this context (shared lifetime); ggml checks shapes.
        let t = self.wrap(unsafe {
            sys::ggml_flash_attn_ext(
                self.raw(),
                q.raw(),
                k.raw(),
                v.raw(),
                mask.raw(),
                scale,
                0.0,
                0.0,
            )
        });
        // SAFETY: operands belong to this context (shared lifetime); ggml checks shapes.
        unsafe { sys::ggml_prec_set_acc(t.raw(), sys::GGML_PREC_F32) };
        t
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: we own the context; tensors borrowing it are gone (lifetimes).
        unsafe { sys::ggml_free(self.ptr.as_ptr()) }
    }
}

/// RoPE constants shared by every layer (llama.cpp's cparams/hparams).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeParams {
    pub n_ctx_orig: i32,
    pub freq_base: f32,
    pub freq_scale: f32,
    pub ext_factor: f32,
    pub attn_factor: f32,
    pub beta_fast: f32,
    pub beta_slow: f32,
}

/// A handle to a tensor whose metadata lives in a [`Context`].
#[derive(Clone, Copy)]
pub struct Tensor<'ctx> {
    ptr: NonNull<sys::ggml_tensor>,
    _ctx: PhantomData<&'ctx Context>,
}

impl<'ctx> Tensor<'ctx> {
    pub fn raw(&self) -> *mut sys::ggml_tensor {
        self.ptr.as_ptr()
    }
    fn header(&self) -> &sys::ggml_tensor {
        // SAFETY: the tensor header lives in the context, which outlives 'ctx.
        unsafe { self.ptr.as_ref() }
    }
    pub fn ty(&self) -> GgmlType {
        GgmlType(self.header().type_)
    }
    pub fn ne(&self) -> [i64; 4] {
        self.header().ne
    }
    pub fn nb(&self) -> [usize; 4] {
        self.header().nb
    }
    pub fn nbytes(&self) -> usize {
        // SAFETY: header is valid.
        unsafe { sys::ggml_nbytes(self.raw()) }
    }
    pub fn name(&self) -> String {
        // SAFETY: name is a NUL-terminated fixed array inside the header.
        unsafe { super::rows::cstr_to_string(self.header().name.as_ptr()) }
    }
    /// Names the tensor (truncated to ggml's 63 bytes).
    pub fn named(self, name: &str) -> Self {
        let c = CString::new(name.replace('\0', "")).unwrap_or_default();
        // SAFETY: ggml copies at most sizeof(name)-1 bytes.
        unsafe { sys::ggml_set_name(self.raw(), c.as_ptr()) };
        self
    }
    /// Marks the tensor as a graph input (allocated first, never reused).
    pub fn as_input(self) -> Self {
        // SAFETY: header is valid.
        unsafe { sys::ggml_set_input(self.raw()) };
        self
    }
    /// Marks the tensor as a graph output (its memory is not reused). A
    /// view's source is marked too: the memory is the source's, which the
    /// allocator would otherwise free after its last view.
    pub fn as_output(self) -> Self {
        let mut t = self.raw();
        while !t.is_null() {
            // SAFETY: t is this tensor or a view source of it, all headers
            // in the same live context.
            unsafe {
                sys::ggml_set_output(t);
                t = (*t).view_src;
            }
        }
        self
    }
    /// True when the tensor has memory (bound to a buffer).
    pub fn is_bound(&self) -> bool {
        !self.header().data.is_null()
    }
    /// Uploads `data` synchronously. Never use on memory a computation in
    /// flight reads (it runs on another stream).
    pub fn set_bytes(&self, data: &[u8], offset: usize) -> Result<()> {
        if !self.is_bound() || offset + data.len() > self.nbytes() {
            return Err(GgmlError::Tensor {
                name: self.name(),
                what: format!("cannot write {} bytes at {offset}", data.len()),
            });
        }
        // SAFETY: tensor is bound and the range lies inside it (checked).
        unsafe {
            sys::ggml_backend_tensor_set(self.raw(), data.as_ptr().cast(), offset, data.len())
        };
        Ok(())
    }
    /// Downloads `out.len()` bytes starting at `offset`, synchronously.
    pub fn get_bytes(&self, out: &mut [u8], offset: usize) -> Result<()> {
        if !self.is_bound() || offset + out.len() > self.nbytes() {
            return Err(GgmlError::Tensor {
                name: self.name(),
                what: format!("cannot read {} bytes at {offset}", out.len()),
            });
        }
        // SAFETY: tensor is bound and the range lies inside it (checked).
        unsafe {
            sys::ggml_backend_tensor_get(self.raw(), out.as_mut_ptr().cast(), offset, out.len())
        };
        Ok(())
    }
    pub fn set_f32(&self, v: &[f32]) -> Result<()> {
        self.set_bytes(bytemuck::cast_slice(v), 0)
    }
    pub fn set_i32(&self, v: &[i32]) -> Result<()> {
        self.set_bytes(bytemuck::cast_slice(v), 0)
    }
    pub fn set_i64(&self, v: &[i64]) -> Result<()> {
        self.set_bytes(bytemuck::cast_slice(v), 0)
    }
    pub fn get_f32(&self, out: &mut [f32]) -> Result<()> {
        self.get_bytes(bytemuck::cast_slice_mut(out), 0)
    }
}

impl Context {
    pub fn view_1d<'a>(&'a self, a: Tensor<'a>, ne0: i64, offset: usize) -> Tensor<'a> {
        // SAFETY: see the ops above.
        self.wrap(unsafe { sys::ggml_view_1d(self.raw(), a.raw(), ne0, offset) })
    }
}

impl<'ctx> Tensor<'ctx> {
    /// Re-wraps a tensor pointer kept by an owner of `ctx`.
    ///
    /// # Safety
    /// `p` must point to a tensor created in `ctx`.
    pub unsafe fn from_raw(_ctx: &'ctx Context, p: NonNull<sys::ggml_tensor>) -> Tensor<'ctx> {
        Tensor {
            ptr: p,
            _ctx: PhantomData,
        }
    }
}

impl<'ctx> Tensor<'ctx> {
    /// Fills the whole tensor with byte `value`, synchronously. Never use on
    /// memory a computation in flight reads.
    /// Sets `len` bytes from `offset` to `value` (synchronously).
    pub fn fill_range(&self, value: u8, offset: usize, len: usize) -> Result<()> {
        if !self.is_bound() || offset + len > self.nbytes() {
            return Err(GgmlError::Tensor {
                name: self.name(),
                what: format!("cannot fill {len} bytes at {offset}"),
            });
        }
        // SAFETY: bound tensor, the range lies inside it (checked).
        unsafe { sys::ggml_backend_tensor_memset(self.raw(), value, offset, len) };
        Ok(())
    }
    pub fn fill(&self, value: u8) -> Result<()> {
        if !self.is_bound() {
            return Err(GgmlError::Tensor {
                name: self.name(),
                what: "fill of an unbound tensor".into(),
            });
        }
        // SAFETY: bound tensor, whole range.
        unsafe { sys::ggml_backend_tensor_memset(self.raw(), value, 0, self.nbytes()) };
        Ok(())
    }
}
