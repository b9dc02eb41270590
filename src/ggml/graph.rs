//! Compute graphs, their activation allocator, and the printable snapshot
//! used by the layout tests.

use super::context::Context;
use super::context::Tensor;
use super::error::GgmlError;
use super::error::Result;
use super::rows::cstr_to_string;
use crate::dtype::GgmlType;
use crate::sys;
use std::marker::PhantomData;
use std::ptr::NonNull;

/// A graph whose nodes live in a [`Context`].
pub struct Graph<'ctx> {
    ptr: NonNull<sys::ggml_cgraph>,
    _ctx: PhantomData<&'ctx Context>,
}

/// One node of a graph as the snapshot tests record it: no addresses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeInfo {
    pub name: String,
    pub op: String,
    pub ty: String,
    pub ne: [i64; 4],
    /// The accumulator precision a product or attention node asks for
    /// ("bf16", "f32"; see `Context::mul_mat`), None when it leaves it to
    /// the backend.
    pub acc: Option<&'static str>,
}

impl std::fmt::Display for NodeInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let dims: Vec<i64> = match self.ne.iter().rposition(|&d| d != 1) {
            Some(last) => self.ne[..=last].to_vec(),
            None => vec![1],
        };
        let dims: Vec<String> = dims.iter().map(|d| d.to_string()).collect();
        write!(
            f,
            "{:<28} {:<16} {:<5} [{}]",
            self.name,
            self.op,
            self.ty,
            dims.join(", ")
        )?;
        match self.acc {
            Some(a) => write!(f, " acc={a}"),
            None => Ok(()),
        }
    }
}

/// The accumulator precision `node` asks for, where its op has one: the
/// first op parameter of a product, the fourth of flash attention (ggml's
/// `ggml_prec_set_acc`).
fn accumulator(node: &sys::ggml_tensor) -> Option<&'static str> {
    let prec = match node.op {
        sys::GGML_OP_MUL_MAT | sys::GGML_OP_MUL_MAT_ID => node.op_params[0],
        sys::GGML_OP_FLASH_ATTN_EXT => node.op_params[3],
        _ => return None,
    };
    match prec as sys::ggml_prec {
        sys::GGML_PREC_F32 => Some("f32"),
        sys::GGML_PREC_BF16 => Some("bf16"),
        sys::GGML_PREC_F16 => Some("f16"),
        _ => None,
    }
}

impl Context {
    /// A graph with room for `size` nodes (the context must have been made
    /// with a graph of at least that size).
    pub fn new_graph(&self, size: usize) -> Graph<'_> {
        // SAFETY: the context is live and was sized for this graph.
        let p = unsafe { sys::ggml_new_graph_custom(self.raw(), size, false) };
        Graph {
            ptr: NonNull::new(p).expect("ggml_new_graph_custom returned null"),
            _ctx: PhantomData,
        }
    }
}

impl<'ctx> Graph<'ctx> {
    pub fn raw(&self) -> *mut sys::ggml_cgraph {
        self.ptr.as_ptr()
    }
    /// Adds `t` and everything it depends on. Only such nodes are computed.
    pub fn expand(&mut self, t: Tensor<'ctx>) {
        // SAFETY: graph and tensor share the live context.
        unsafe { sys::ggml_build_forward_expand(self.raw(), t.raw()) }
    }
    pub fn n_nodes(&self) -> usize {
        // SAFETY: live graph.
        unsafe { sys::ggml_graph_n_nodes(self.raw()) as usize }
    }
    fn node_raw(&self, i: usize) -> *mut sys::ggml_tensor {
        // SAFETY: i < n_nodes (callers iterate 0..n_nodes).
        unsafe { sys::ggml_graph_node(self.raw(), i as i32) }
    }
    /// The nodes named `name`, in execution order (raw: the owner of the
    /// context hands them out as tensors with its lifetime).
    pub fn nodes_named(&self, name: &str) -> Vec<NonNull<sys::ggml_tensor>> {
        (0..self.n_nodes())
            .map(|i| self.node_raw(i))
            // SAFETY: each is a node of this live graph; its name is a
            // NUL-terminated array in the header.
            .filter(|&t| unsafe { cstr_to_string((*t).name.as_ptr()) } == name)
            .filter_map(NonNull::new)
            .collect()
    }
    /// The nodes in execution order, as (name, op, type, shape).
    pub fn snapshot(&self) -> Vec<NodeInfo> {
        (0..self.n_nodes())
            .map(|i| {
                let t = self.node_raw(i);
                // SAFETY: t is a node of this graph; op_desc returns a static string.
                unsafe {
                    let h = &*t;
                    NodeInfo {
                        name: cstr_to_string(h.name.as_ptr()),
                        op: cstr_to_string(sys::ggml_op_desc(t)),
                        ty: GgmlType(h.type_).name().to_string(),
                        ne: h.ne,
                        acc: accumulator(h),
                    }
                }
            })
            .collect()
    }
    /// After rebinding `roots` (weights, KV), points every view of them at
    /// the new memory: data = root.data + view_offs.
    pub fn refresh_views(&self, roots: &[Tensor<'ctx>]) {
        for i in 0..self.n_nodes() {
            let t = self.node_raw(i);
            // SAFETY: t is a node of this live graph; view_src, if set, is a
            // tensor of the same context. We only rewrite data/buffer, which
            // kernels read at launch.
            unsafe {
                let h = &mut *t;
                if h.view_src.is_null() || !roots.iter().any(|r| r.raw() == h.view_src) {
                    continue;
                }
                let src = &*h.view_src;
                h.data = src.data.cast::<u8>().add(h.view_offs).cast();
                h.buffer = src.buffer;
            }
        }
    }
}

/// Owned activation allocator (`ggml_gallocr`) for one buffer type.
pub struct GraphAllocator {
    ptr: NonNull<sys::ggml_gallocr>,
}

// SAFETY: the allocator is host state owned by this value.
unsafe impl Send for GraphAllocator {}

impl GraphAllocator {
    pub fn new(buft: super::buffer::BufferType) -> Result<GraphAllocator> {
        // SAFETY: buft is a live buffer type.
        let p = unsafe { sys::ggml_gallocr_new(buft.raw()) };
        NonNull::new(p)
            .map(|ptr| GraphAllocator { ptr })
            .ok_or_else(|| GgmlError::GraphAlloc("ggml_gallocr_new".into()))
    }
    /// Sizes the buffer for `graph` (call with the largest graph first).
    pub fn reserve(&mut self, graph: &Graph<'_>) -> Result<()> {
        // SAFETY: live allocator and graph; external tensors are bound.
        if unsafe { sys::ggml_gallocr_reserve(self.ptr.as_ptr(), graph.raw()) } {
            Ok(())
        } else {
            Err(GgmlError::GraphAlloc("reserve".into()))
        }
    }
    /// Assigns memory to every unbound tensor of `graph`.
    pub fn alloc(&mut self, graph: &Graph<'_>) -> Result<()> {
        // SAFETY: live allocator and graph.
        if unsafe { sys::ggml_gallocr_alloc_graph(self.ptr.as_ptr(), graph.raw()) } {
            Ok(())
        } else {
            Err(GgmlError::GraphAlloc("alloc_graph".into()))
        }
    }
    pub fn buffer_size(&self) -> usize {
        // SAFETY: live allocator; buffer 0 always exists.
        unsafe { sys::ggml_gallocr_get_buffer_size(self.ptr.as_ptr(), 0) }
    }
}

impl Drop for GraphAllocator {
    fn drop(&mut self) {
        // SAFETY: we own the allocator (and with it the activation buffer).
        unsafe { sys::ggml_gallocr_free(self.ptr.as_ptr()) }
    }
}

impl<'ctx> Graph<'ctx> {
    /// Re-wraps a graph pointer kept by an owner of `ctx`.
    ///
    /// # Safety
    /// `p` must be a graph created in `ctx`.
    pub unsafe fn from_raw(_ctx: &'ctx Context, p: NonNull<sys::ggml_cgraph>) -> Graph<'ctx> {
        Graph {
            ptr: p,
            _ctx: PhantomData,
        }
    }
}
