//! Persistent device tensors: the residual stream and step inputs that
//! every group graph views, and the per-layer K/V cache tensors.

use super::EngineError;
use crate::ggml::{Binding, Buffer, BufferUsage, Device, Tensor, TensorArena, TensorSpec};
use crate::gguf::GgmlType;
use crate::graph::{Dims, Externals, Limits, HEAD_ROWS};

/// x, pos, mask, kv_idx, out_ids (in `Externals::all` order).
pub struct Persistent {
    arena: TensorArena,
    pub bindings: Vec<Binding>,
    pub bytes: u64,
}

pub const X: usize = 0;
pub const POS: usize = 1;
pub const MASK: usize = 2;
pub const KV_IDX: usize = 3;
pub const OUT_IDS: usize = 4;

impl Persistent {
    pub fn alloc(d: &Dims, lim: Limits, dev: Device) -> Result<Persistent, EngineError> {
        let specs = Externals::specs(d, lim);
        let arena = TensorArena::new(dev.buffer_type(), BufferUsage::Compute, &specs)?;
        Ok(Persistent {
            bindings: (0..arena.len()).map(|i| arena.binding(i)).collect(),
            bytes: arena.bytes() as u64,
            arena,
        })
    }
    pub fn tensor(&self, i: usize) -> Tensor<'_> {
        self.arena.tensor(i)
    }
}

/// K and V per layer, F16 [n_embd_kv, n_ctx], in one device buffer.
pub struct KvStore {
    arena: TensorArena,
    pub layers: Vec<[Binding; 2]>,
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
        let spec = TensorSpec::new(GgmlType::F16, &[d.hp.n_embd_kv() as i64, lim.n_ctx as i64]);
        let arena = TensorArena::new(
            dev.buffer_type(),
            BufferUsage::Any,
            &vec![spec; 2 * n_layer],
        )?;
        Ok(KvStore {
            layers: (0..n_layer)
                .map(|l| [arena.binding(2 * l), arena.binding(2 * l + 1)])
                .collect(),
            bytes: arena.bytes() as u64,
            arena,
        })
    }
    /// K (kv 0) or V tensor of layer `l`.
    pub fn tensor(&self, l: usize, kv: usize) -> Tensor<'_> {
        self.arena.tensor(2 * l + kv)
    }
    /// Bytes one layer's K and V take for these dimensions.
    pub fn bytes_per_layer(d: &Dims, lim: Limits) -> u64 {
        2 * d.hp.n_embd_kv() as u64 * lim.n_ctx as u64 * 2
    }
}

/// Activation bytes of the largest step, used to plan before the graphs
/// exist. Every graph shares one activation buffer (see
/// `Engine::ensure_allocated`), so this is the largest graph's need, not a
/// sum. Each term counts the F32 intermediates alive at the graph's peak
/// with room to spare (measured on a 70B-shaped layer at 512 tokens: FFN
/// 184 MiB against 200 MiB here, attention 48 MiB against 68 MiB); the
/// margin covers alignment and allocator fragmentation.
pub fn activation_estimate(d: &Dims, lim: Limits) -> u64 {
    let [attn, ffn, head] = row_bytes(d);
    let b = lim.n_batch as u64;
    let attn = attn * b;
    // the FFN runs over at most ffn_rows rows at a time
    let ffn = ffn * b.min(lim.ffn_rows as u64);
    // the head over at most HEAD_ROWS
    let head = head * b.min(HEAD_ROWS as u64);
    attn.max(ffn).max(head) * 5 / 4
}

/// Activation bytes per row of the attention, FFN and head graphs.
fn row_bytes(d: &Dims) -> [u64; 3] {
    let hp = &d.hp;
    [
        // norm, Q, K, V, attention output (flash attention: no KQ matrix)
        4 * (2 * hp.n_embd as u64 + 2 * hp.n_embd_q() as u64 + 2 * hp.n_embd_kv() as u64),
        // norm, gate, up, their product
        4 * (2 * hp.n_embd as u64 + 3 * hp.n_ff as u64),
        4 * (2 * hp.n_embd as u64 + hp.n_vocab as u64),
    ]
}

/// Rows the FFN graph computes at once when the GPU budget is tight: as
/// many as keep its activations within what attention at `n_batch` rows
/// or the head need anyway (FFN rows cost 3 x n_ff, the most of any
/// graph; on a 70B-shaped layer 400 KiB against 136 KiB for attention), in
/// multiples of 32 rows; `n_batch` where it already fits. The reserve then
/// barely depends on the step size, so the plan for the default steps
/// keeps about as many groups resident as a decode-sized one.
pub fn ffn_rows(d: &Dims, n_batch: u32) -> u32 {
    let [attn, ffn, head] = row_bytes(d);
    let b = n_batch as u64;
    let target = (attn * b).max(head * b.min(HEAD_ROWS as u64));
    let rows = (target / ffn.max(1)) / 32 * 32;
    // (steps of fewer than 32 rows run whole)
    rows.max(32).min(b) as u32
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
