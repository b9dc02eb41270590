//! A built graph that owns its context: the reusable unit the engine caches.

use super::blocks::build_add_rows;
use super::blocks::build_attn;
use super::blocks::build_ffn;
use super::blocks::build_head;
use super::blocks::build_host_experts;
use super::blocks::build_router;
use super::shape::Dims;
use super::shape::StepShape;
use crate::dtype::GgmlType;
use crate::ggml::{Context, Graph, Result, Tensor};
use crate::model::{GroupId, GroupKind, Role};
use crate::paging::Limits;
use std::ptr::NonNull;

/// What distinguishes one template from another. Types are part of the key:
/// two quant types of equal block size must not share a captured graph.
/// `instance` lets the engine keep one template per layer group, so a
/// template's pointers stay the same from step to step and the backend's
/// graph capture (CUDA graphs) replays instead of re-capturing.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum TemplateKey {
    Group {
        kind: GroupKind,
        sig: Vec<(Role, GgmlType)>,
        shape: StepShape,
        instance: u32,
    },
    /// The head over rows `row0..row0 + n_rows` of the residual stream.
    Head {
        out_ty: GgmlType,
        n_rows: u32,
        row0: u32,
    },
    /// A mixture's router alone over `n_tokens` rows (an expert split:
    /// the host learns the picks before the device computes its experts).
    Router {
        sig: Vec<(Role, GgmlType)>,
        n_tokens: u32,
        instance: u32,
    },
    /// The host's experts of a split over `picks` (token, expert) rows.
    HostExperts {
        sig: Vec<(Role, GgmlType)>,
        picks: u32,
    },
    /// A mixture layer's hot experts on the device (`paging::experts`) over
    /// `picks` (token, expert) rows: `sig` the expert tensors' roles and
    /// types, `n_hot` the experts they hold; one per layer group
    /// (`instance`), so its pointers stay put and graph capture replays.
    HotExperts {
        sig: Vec<(Role, GgmlType)>,
        picks: u32,
        n_hot: u32,
        instance: u32,
    },
    /// A group's quantized matrices (`matrices`, the roles and types of
    /// those the engine widens) copied into BF16 for the row split's
    /// halved steps (`graph::widen`), one per layer group (`instance`).
    Widen {
        matrices: Vec<(Role, GgmlType)>,
        instance: u32,
    },
    /// Rows `row0..row0 + n_rows` of a buffer (the host's expert rows,
    /// another device's share of the row split) added to the residual
    /// stream's.
    AddRows { n_rows: u32, row0: u32 },
}

pub use crate::ggml::Binding;

/// What a template's weight and KV placeholders were pointed at last, so an
/// unchanged binding is not redone: the group (None: the output head),
/// the ring slot holding its weights (None: resident), and the window slot
/// holding its layer's K/V (None: the layer's resident K/V, or no KV).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BindId {
    pub group: Option<GroupId>,
    pub weight_slot: Option<usize>,
    pub kv_window: Option<usize>,
}

impl BindId {
    /// Resident weights of `group` (and its layer's resident K/V, if any).
    pub fn resident(group: GroupId) -> BindId {
        BindId {
            group: Some(group),
            weight_slot: None,
            kv_window: None,
        }
    }
    /// The output head's resident weights.
    pub fn head() -> BindId {
        BindId {
            group: None,
            weight_slot: None,
            kv_window: None,
        }
    }
}

/// A graph template: its own context, graph and placeholder handles.
/// Handles are stored raw (the context they point into is owned here) and
/// handed out with `&self`'s lifetime.
pub struct Template {
    ctx: Context,
    graph: NonNull<crate::sys::ggml_cgraph>,
    ext: Vec<NonNull<crate::sys::ggml_tensor>>,
    weights: Vec<NonNull<crate::sys::ggml_tensor>>,
    kv: Option<[NonNull<crate::sys::ggml_tensor>; 2]>,
    out: NonNull<crate::sys::ggml_tensor>,
    /// A mixture's FFN: the experts its router picked, I32 [n_used, rows]
    /// per chunk of rows (graph outputs, readable after the compute).
    routed: Vec<NonNull<crate::sys::ggml_tensor>>,
    /// Identity of the weights/KV bound last, to skip redundant rebinding.
    bound_to: Option<BindId>,
    /// What the placeholders point into, kept so those buffers outlive the
    /// pointers (externals first, then weights and KV).
    bound: Vec<Binding>,
    n_ext_bound: usize,
    /// Activations assigned from the shared activation buffer (valid until
    /// that buffer grows, which drops every other template; see
    /// `engine::templates`).
    pub allocated: bool,
}

fn nn(t: Tensor<'_>) -> NonNull<crate::sys::ggml_tensor> {
    NonNull::new(t.raw()).expect("tensor handle is never null")
}

/// Where [`Template::queue_reads`] put one node's bytes in a host buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeRead {
    offset: usize,
    bytes: usize,
    /// Values a row, rows, and the row stride in values.
    k: usize,
    rows: usize,
    stride: usize,
}

impl NodeRead {
    /// The layout of 4-byte node `t` placed at byte `offset` of a host
    /// buffer.
    fn of(t: &Tensor<'_>, offset: usize) -> NodeRead {
        let [k, rows, r2, _] = t.ne();
        NodeRead {
            offset,
            bytes: t.nbytes(),
            k: k as usize,
            rows: (rows * r2) as usize,
            stride: t.nb()[1] / 4,
        }
    }
    /// The node's values row by row (`ne[0]` of each, without the row
    /// stride's gaps), from `src`, the buffer the read went into, once
    /// the copy completed.
    pub fn rows<T: bytemuck::Pod>(&self, src: &[u8]) -> Vec<T> {
        let mut all = vec![T::zeroed(); self.bytes / 4];
        bytemuck::cast_slice_mut::<T, u8>(&mut all)
            .copy_from_slice(&src[self.offset..self.offset + self.bytes]);
        let mut out = Vec::with_capacity(self.rows * self.k);
        for row in 0..self.rows {
            out.extend_from_slice(&all[row * self.stride..row * self.stride + self.k]);
        }
        out
    }
}

impl Template {
    pub fn build(key: &TemplateKey, d: &Dims, lim: Limits) -> Result<Template> {
        let ctx = Context::new(super::shape::GRAPH_NODES + 64, super::shape::GRAPH_NODES)?;
        let (graph, ext, weights, kv, out) = {
            let b = match key {
                TemplateKey::Group {
                    kind: GroupKind::Attn,
                    sig,
                    shape,
                    ..
                } => build_attn(&ctx, d, sig, *shape, lim),
                TemplateKey::Group {
                    kind: GroupKind::Ffn,
                    sig,
                    shape,
                    ..
                } => build_ffn(&ctx, d, sig, *shape, lim),
                TemplateKey::Head {
                    out_ty,
                    n_rows,
                    row0,
                } => {
                    let s = StepShape {
                        n_tokens: *n_rows,
                        n_kv: 0,
                        n_out: *n_rows,
                        last_layer: false,
                        swa: false,
                        dev_experts: 0,
                        routed: false,
                        row0: 0,
                    };
                    build_head(&ctx, d, *out_ty, s, *row0, lim)
                }
                TemplateKey::Router { sig, n_tokens, .. } => {
                    build_router(&ctx, d, sig, *n_tokens, lim)
                }
                TemplateKey::HotExperts {
                    sig, picks, n_hot, ..
                } => {
                    let mut d = d.clone();
                    d.hp.n_expert = *n_hot;
                    build_host_experts(&ctx, &d, sig, *picks, lim)
                }
                TemplateKey::HostExperts { sig, picks } => {
                    build_host_experts(&ctx, d, sig, *picks, lim)
                }
                TemplateKey::AddRows { n_rows, row0 } => {
                    build_add_rows(&ctx, d, *n_rows, *row0, lim)
                }
                TemplateKey::Widen { matrices, .. } => {
                    super::widen::build_widen(&ctx, d, matrices, lim)
                }
            };
            (
                NonNull::new(b.graph.raw()).expect("graph handle is never null"),
                b.ext.all().into_iter().map(nn).collect(),
                b.weights.iter().copied().map(nn).collect(),
                b.kv.map(|(k, v)| [nn(k), nn(v)]),
                nn(b.out),
            )
        };
        // SAFETY: the graph lives in ctx, alive here.
        let routed = unsafe { Graph::from_raw(&ctx, graph) }.nodes_named(super::moe::ROUTED);
        Ok(Template {
            routed,
            ctx,
            graph,
            ext,
            weights,
            kv,
            out,
            bound_to: None,
            bound: Vec::new(),
            n_ext_bound: 0,
            allocated: false,
        })
    }

    fn tensor(&self, p: NonNull<crate::sys::ggml_tensor>) -> Tensor<'_> {
        // SAFETY: p points into self.ctx, which lives as long as &self.
        unsafe { Tensor::from_raw(&self.ctx, p) }
    }

    pub fn graph(&self) -> Graph<'_> {
        // SAFETY: the graph lives in self.ctx.
        unsafe { Graph::from_raw(&self.ctx, self.graph) }
    }
    pub fn out(&self) -> Tensor<'_> {
        self.tensor(self.out)
    }
    /// The router's picks this template computed last (a mixture's FFN
    /// built with `Dims::read_routing`; empty for others), token-major:
    /// `n_used` per token, each chunk of rows in turn (the copies
    /// `graph::moe::route` keeps).
    pub fn read_routed(&self) -> Result<Vec<i32>> {
        let mut out = Vec::new();
        for &p in &self.routed {
            self.read_rows(p, &mut out)?;
        }
        Ok(out)
    }
    /// The first node named `name` this graph computed, as 4-byte values
    /// (F32 or I32) in row order, `ne[0]` of each row (the node may be a
    /// view with a wider row stride). Empty when there is none.
    pub fn read_node<T: bytemuck::Pod + Default>(&self, name: &str) -> Result<Vec<T>> {
        let mut out = Vec::new();
        if let Some(&p) = self.graph().nodes_named(name).first() {
            self.read_rows(p, &mut out)?;
        }
        Ok(out)
    }
    /// The host bytes [`Template::queue_reads`] needs for the nodes named
    /// `names` (each whole, with its row stride's gaps, 64-byte aligned).
    pub fn read_bytes(&self, names: &[&str]) -> usize {
        names
            .iter()
            .filter_map(|n| self.graph().nodes_named(n).first().copied())
            .map(|p| self.tensor(p).nbytes().next_multiple_of(64))
            .sum()
    }
    /// Queues on `backend`'s stream a copy of the first node named each of
    /// `names` (4-byte values, as [`Template::read_node`] reads them) into
    /// `dst`, one after another at 64-byte aligned offsets, so that a graph
    /// queued after them may reuse the activations they sit in. Returns
    /// where each went (None: the graph has no such node); once the copies
    /// completed, [`NodeRead::rows`] takes the values out.
    ///
    /// # Safety
    /// `dst` must stay valid, and be neither read nor written, until the
    /// backend passed an event recorded after this call (or was
    /// synchronized); the copies are asynchronous only into pinned memory.
    pub unsafe fn queue_reads(
        &self,
        backend: &crate::ggml::Backend,
        names: &[&str],
        dst: &mut [u8],
    ) -> Result<Vec<Option<NodeRead>>> {
        let mut at = 0;
        let mut out = Vec::with_capacity(names.len());
        for name in names {
            let Some(&p) = self.graph().nodes_named(name).first() else {
                out.push(None);
                continue;
            };
            let t = self.tensor(p);
            let r = NodeRead::of(&t, at);
            let bytes = r.bytes;
            if at + bytes > dst.len() || !t.is_bound() {
                return Err(crate::ggml::GgmlError::Tensor {
                    name: t.name(),
                    what: format!(
                        "cannot read {bytes} bytes into {} left",
                        dst.len().saturating_sub(at)
                    ),
                });
            }
            // SAFETY: the range lies inside dst (checked) and the whole of
            // the bound tensor; the caller keeps dst as the contract says.
            unsafe { backend.tensor_get_async(t, &mut dst[at..at + bytes], 0) };
            out.push(Some(r));
            at = (at + bytes).next_multiple_of(64);
        }
        Ok(out)
    }
    /// Appends the rows of 4-byte node `p` to `out`, `ne[0]` values each,
    /// read with its row stride.
    fn read_rows<T: bytemuck::Pod + Default>(
        &self,
        p: NonNull<crate::sys::ggml_tensor>,
        out: &mut Vec<T>,
    ) -> Result<()> {
        let t = self.tensor(p);
        let r = NodeRead::of(&t, 0);
        let mut buf = vec![0u8; r.bytes];
        t.get_bytes(&mut buf, 0)?;
        out.extend(r.rows::<T>(&buf));
        Ok(())
    }
    pub fn weights(&self) -> Vec<Tensor<'_>> {
        self.weights.iter().map(|&p| self.tensor(p)).collect()
    }
    pub fn externals(&self) -> Vec<Tensor<'_>> {
        self.ext.iter().map(|&p| self.tensor(p)).collect()
    }

    /// How many externals the graph has: the five persistent step tensors,
    /// and the rope factors for an attention graph of a model with them.
    pub fn n_externals(&self) -> usize {
        self.ext.len()
    }

    /// Binds the persistent externals (residual stream, step inputs, rope
    /// factors), in the order of `Externals::all`, exactly
    /// [`Template::n_externals`] of them. Done once, before the activations
    /// are allocated.
    pub fn bind_externals(&mut self, ext: &[Binding]) -> Result<()> {
        if ext.len() != self.ext.len() {
            return Err(mismatch("externals", ext.len(), self.ext.len()));
        }
        for (&p, b) in self.ext.iter().zip(ext) {
            // SAFETY: the externals are the engine's persistent tensors, of
            // the type and shape `Externals::specs` gave both; `self.bound`
            // keeps their buffer alive as long as this template, and they
            // are bound once, before the graph first runs.
            unsafe { self.tensor(p).rebind(b)? };
        }
        self.bound.splice(..self.n_ext_bound, ext.iter().cloned());
        self.n_ext_bound = ext.len();
        Ok(())
    }

    /// Points the weight (and KV) placeholders at a layer's memory and
    /// refreshes every view of them. `id` identifies the bound memory
    /// (group, slot, KV window) so rebinding the same memory twice is free.
    /// Bindings must be in the template's signature order, each written for
    /// the type and shape of its placeholder (the engine builds templates
    /// from a group's signature and binds that group's memory); the
    /// caller rebinds only when no computation of this graph is in flight.
    pub fn bind(
        &mut self,
        id: BindId,
        weights: &[Binding],
        kv: Option<&[Binding; 2]>,
    ) -> Result<()> {
        if self.bound_to == Some(id) {
            return Ok(());
        }
        if weights.len() != self.weights.len() {
            return Err(mismatch("weights", weights.len(), self.weights.len()));
        }
        if kv.is_some() != self.kv.is_some() {
            return Err(mismatch(
                "KV tensors",
                2 * kv.is_some() as usize,
                2 * self.kv.is_some() as usize,
            ));
        }
        self.bound_to = None;
        let kv_ph: &[NonNull<crate::sys::ggml_tensor>] = self.kv.as_ref().map_or(&[], |k| k);
        let kv_b: &[Binding] = kv.map_or(&[], |k| k);
        let mut roots = Vec::with_capacity(self.weights.len() + 2);
        for (&p, b) in self
            .weights
            .iter()
            .chain(kv_ph)
            .zip(weights.iter().chain(kv_b))
        {
            let t = self.tensor(p);
            // SAFETY: the binding holds this placeholder's data (the
            // caller's contract above: its group's memory, in signature
            // order, of the types that keyed this template); `self.bound`
            // keeps its buffer alive until the next bind or drop, and the
            // engine binds only between computations of this graph.
            unsafe { t.rebind(b)? };
            roots.push(t);
        }
        self.graph().refresh_views(&roots);
        self.bound.truncate(self.n_ext_bound);
        self.bound.extend(weights.iter().chain(kv_b).cloned());
        self.bound_to = Some(id);
        Ok(())
    }
}

fn mismatch(what: &str, got: usize, want: usize) -> crate::ggml::GgmlError {
    crate::ggml::GgmlError::Tensor {
        name: "template".into(),
        what: format!("bound to {got} {what}, its signature has {want}"),
    }
}

#[cfg(test)]
mod read_tests {
    use super::NodeRead;

    #[test]
    fn a_read_node_gives_its_rows_without_the_stride_gaps() {
        // two rows of 2 values, 3 apart, after 8 bytes of another node
        let vals: [f32; 5] = [1.0, 2.0, 9.0, 3.0, 4.0];
        let mut host = vec![0u8; 8];
        host.extend_from_slice(bytemuck::cast_slice(&vals));
        let r = NodeRead {
            offset: 8,
            bytes: 20,
            k: 2,
            rows: 2,
            stride: 3,
        };
        assert_eq!(r.rows::<f32>(&host), vec![1.0, 2.0, 3.0, 4.0]);
        // an unaligned offset reads the same values
        let mut odd = vec![0u8; 3];
        odd.extend_from_slice(bytemuck::cast_slice(&vals));
        let r = NodeRead { offset: 3, ..r };
        assert_eq!(r.rows::<f32>(&odd), vec![1.0, 2.0, 3.0, 4.0]);
    }
}
