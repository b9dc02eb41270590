//! Persistent device tensors: the residual stream and step inputs that
//! every group graph views, and the per-layer K/V cache tensors.

use super::error::EngineError;
use crate::dtype::GgmlType;
use crate::ggml::{Binding, Buffer, BufferUsage, Device, Tensor, TensorArena, TensorSpec};
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

/// Fewest rows an FFN chunk has. The GEMM kernels lose speed on narrower
/// products: on the H100, pp2048 of a 70B-shaped model ran 0.6% slower
/// with chunks of 512 rows than with whole steps, and as fast with chunks
/// of 1024 (docs/device-runs.md, run 19). Steps of up to this many rows run
/// whole.
pub const FFN_MIN_CHUNK: u32 = 1024;

/// Rows the FFN graph computes at once when the GPU budget is tight: as
/// many as keep its activations within what attention at `n_batch` rows
/// or the head need anyway (FFN rows cost 3 x n_ff, the most of any
/// graph; on a 70B-shaped layer 400 KiB against 136 KiB for attention), in
/// multiples of 32 rows, never fewer than [`FFN_MIN_CHUNK`]; `n_batch`
/// where it already fits. Only large steps are cut (2048 rows: two chunks
/// of 1024, halving the FFN's share of the reserve).
pub fn ffn_rows(d: &Dims, n_batch: u32) -> u32 {
    let [attn, ffn, head] = row_bytes(d);
    let b = n_batch as u64;
    let target = (attn * b).max(head * b.min(HEAD_ROWS as u64));
    let rows = (target / ffn.max(1)) / 32 * 32;
    rows.max(FFN_MIN_CHUNK as u64).min(b) as u32
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Arch, Hparams};

    /// The 70B shape of the device runs (vocabulary of the SmolLM2 model
    /// its synthetic weights borrow).
    fn llama70b() -> Dims {
        Dims {
            arch: Arch::Llama,
            hp: Hparams {
                n_vocab: 49152,
                n_ctx_train: 8192,
                n_embd: 8192,
                n_layer: 80,
                n_ff: 28672,
                n_head: 64,
                n_head_kv: 8,
                head_dim: 128,
                n_rot: 128,
                rms_eps: 1e-5,
                rope_freq_base: 500000.0,
                rope_freq_scale: 1.0,
                n_ctx_orig: 8192,
                kq_scale: 1.0 / (128f32).sqrt(),
            },
            has_rope_freqs: false,
        }
    }

    #[test]
    fn ffn_chunks_are_never_narrower_than_the_minimum() {
        let d = llama70b();
        // steps up to the minimum run whole
        for b in [1, 16, 512, 1024] {
            assert_eq!(ffn_rows(&d, b), b);
        }
        // 2048 rows would fit in 672 at attention's reserve, but chunks of
        // 512 cost prefill speed: two of 1024
        assert_eq!(ffn_rows(&d, 2048), FFN_MIN_CHUNK);
        // larger steps: as many rows as attention's reserve allows
        let r = ffn_rows(&d, 8192);
        assert!(r > FFN_MIN_CHUNK && r < 8192 && r.is_multiple_of(32), "{r}");
        let lim = |ffn_rows| Limits {
            n_batch: 8192,
            n_ctx: 8192,
            ffn_rows,
        };
        assert!(activation_estimate(&d, lim(r)) < activation_estimate(&d, lim(8192)) / 2);
    }
}
