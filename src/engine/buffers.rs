//! Persistent device tensors: the residual stream and step inputs that
//! every group graph views, and the per-layer K/V cache tensors.

use super::EngineError;
use crate::ggml::{Buffer, BufferUsage, Context, Device, Tensor};
use crate::gguf::GgmlType;
use crate::graph::{Binding, Dims, Externals, Limits};
use std::ptr::NonNull;

fn alignment(dev: Device) -> usize {
    dev.buffer_type().alignment()
}

/// x, pos, mask, kv_idx, out_ids (in `Externals::all` order).
pub struct Persistent {
    ctx: Context,
    _buf: Buffer,
    pub bindings: Vec<Binding>,
    tensors: Vec<NonNull<crate::sys::ggml_tensor>>,
    pub bytes: u64,
}

pub const X: usize = 0;
pub const POS: usize = 1;
pub const MASK: usize = 2;
pub const KV_IDX: usize = 3;
pub const OUT_IDS: usize = 4;

impl Persistent {
    pub fn alloc(d: &Dims, lim: Limits, dev: Device) -> Result<Persistent, EngineError> {
        let ctx = Context::new(8, 0)?;
        let ext = Externals::new(&ctx, d, lim);
        let list = [ext.x, ext.pos, ext.mask, ext.kv_idx, ext.out_ids];
        let align = alignment(dev);
        let sizes: Vec<usize> = list
            .iter()
            .map(|t| t.nbytes().div_ceil(align) * align)
            .collect();
        let total: usize = sizes.iter().sum();
        let buf = Buffer::alloc(dev.buffer_type(), total, BufferUsage::Compute)?;
        buf.clear(0);
        let mut off = 0;
        let mut bindings = Vec::new();
        for (t, s) in list.iter().zip(&sizes) {
            buf.place(*t, off)?;
            off += s;
            bindings.push(Binding::of(*t));
        }
        let tensors = list.iter().filter_map(|t| NonNull::new(t.raw())).collect();
        Ok(Persistent {
            ctx,
            _buf: buf,
            bindings,
            tensors,
            bytes: total as u64,
        })
    }
    pub fn tensor(&self, i: usize) -> Tensor<'_> {
        // SAFETY: the tensor lives in self.ctx.
        unsafe { Tensor::from_raw(&self.ctx, self.tensors[i]) }
    }
}

/// K and V per layer, F16 [n_embd_kv, n_ctx], in one device buffer.
pub struct KvStore {
    ctx: Context,
    _buf: Buffer,
    pub layers: Vec<[Binding; 2]>,
    tensors: Vec<NonNull<crate::sys::ggml_tensor>>,
    pub bytes: u64,
}

impl KvStore {
    /// K/V tensors of the first `n_layer` layers (those whose KV stays on the
    /// device; the rest are windowed, see `kvtier`).
    pub fn alloc(
        d: &Dims,
        lim: Limits,
        dev: Device,
        n_layer: usize,
    ) -> Result<KvStore, EngineError> {
        let ctx = Context::new(2 * n_layer.max(1), 0)?;
        let shape = [d.hp.n_embd_kv() as i64, lim.n_ctx as i64];
        let ts: Vec<_> = (0..2 * n_layer)
            .map(|_| ctx.new_tensor(GgmlType::F16, &shape))
            .collect();
        let align = alignment(dev);
        let row = d.hp.n_embd_kv() as usize * 2 * lim.n_ctx as usize;
        let each = row.div_ceil(align) * align;
        let buf = Buffer::alloc(dev.buffer_type(), each * ts.len(), BufferUsage::Any)?;
        buf.clear(0);
        let mut layers = Vec::with_capacity(n_layer);
        for (i, pair) in ts.chunks(2).enumerate() {
            buf.place(pair[0], 2 * i * each)?;
            buf.place(pair[1], (2 * i + 1) * each)?;
            let b = |t: &Tensor<'_>| Binding::of(*t);
            layers.push([b(&pair[0]), b(&pair[1])]);
        }
        let bytes = (each * ts.len()) as u64;
        let tensors = ts.iter().filter_map(|t| NonNull::new(t.raw())).collect();
        drop(ts);
        Ok(KvStore {
            ctx,
            _buf: buf,
            layers,
            tensors,
            bytes,
        })
    }
    /// K (kv 0) or V tensor of layer `l`.
    pub fn tensor(&self, l: usize, kv: usize) -> Tensor<'_> {
        // SAFETY: the tensor lives in self.ctx.
        unsafe { Tensor::from_raw(&self.ctx, self.tensors[2 * l + kv]) }
    }
    /// Bytes one layer's K and V take for these dimensions.
    pub fn bytes_per_layer(d: &Dims, lim: Limits) -> u64 {
        2 * d.hp.n_embd_kv() as u64 * lim.n_ctx as u64 * 2
    }
}

/// Rough activation bytes of the largest step (three graph kinds, each with
/// its own allocator), used to plan before the graphs exist.
pub fn activation_estimate(d: &Dims, lim: Limits) -> u64 {
    let hp = &d.hp;
    let b = lim.n_batch as u64;
    let attn = 4 * (4 * hp.n_embd as u64 + 4 * hp.n_embd_q() as u64 + 4 * hp.n_embd_kv() as u64);
    let ffn = 4 * (4 * hp.n_embd as u64 + 3 * hp.n_ff as u64);
    // logits are rarely wanted for more than a few hundred rows at once
    let head = 4 * (2 * hp.n_embd as u64 + hp.n_vocab as u64) * b.min(256);
    (b * (attn + ffn) + head) * 5 / 4
}

/// Host memory the copy stream reads from: pinned (the device's host buffer
/// type) on a GPU, plain CPU memory on the CPU device. ggml falls back to
/// pageable memory silently when pinning fails; that is reported loudly
/// (naming `what`), and the returned flag says whether it is really pinned.
pub fn alloc_host(
    dev: Device,
    bytes: usize,
    usage: BufferUsage,
    what: &str,
) -> Result<(Buffer, bool), EngineError> {
    let (buft, real) = match dev.host_buffer_type() {
        Some(h) if !dev.is_cpu() => (h, true),
        // the CPU device computes from host memory directly
        _ => (crate::ggml::cpu_device()?.buffer_type(), dev.is_cpu()),
    };
    let b = Buffer::alloc(buft, bytes, usage)?;
    let pinned = real && (dev.is_cpu() || b.name().contains("Host"));
    if !pinned {
        tracing::warn!(
            "pinned host allocation of {bytes} bytes for {what} fell back to pageable memory ({})",
            b.name()
        );
        eprintln!(
            "warning: host memory for {what} is NOT pinned ({}); copies will be slow and synchronous",
            b.name()
        );
    }
    Ok((b, pinned))
}
