//! The byte sizes the memory plan decides from, computed from the model's
//! dimensions and the step limits in one place: KV cells, rows, layers and
//! blocks, the persistent step tensors, the activation reserve and the FFN
//! chunk limit (the graph builder cuts a step into near-equal chunks under
//! it). The engine, the graph builders, the KV tier and the session files
//! ask here instead of multiplying sizes themselves. Weight sizes are
//! ggml's own (each buffer type's allocation size, see `engine::store`).
//! Plain Rust.
//!
//! The KV cache is F16: one cell of one layer is a K row and a V row of
//! `n_embd_kv` halves each.

use crate::model::Hparams;

/// The sizes persistent tensors are allocated for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Limits {
    /// Most tokens in one step.
    pub n_batch: u32,
    /// KV cells per layer.
    pub n_ctx: u32,
    /// Most rows an FFN graph computes at once: a larger step runs the
    /// FFN over consecutive chunks of rows inside one graph, so its
    /// activations (3 x n_ff per row, the largest of any graph) need not
    /// be reserved for the whole step. `n_batch`: no chunks.
    pub ffn_rows: u32,
}

/// The activation reserve: for steps whose FFN runs over all their rows at
/// once, and for FFN chunks of `ffn_rows` rows (see `Limits::ffn_rows`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Activations {
    pub whole: u64,
    pub chunked: u64,
    pub ffn_rows: u32,
    /// The chunk width was given (`--ffn-rows`): chunks whatever the budget.
    pub forced: bool,
}

/// KV cells come in multiples of this (as llama.cpp pads them: attention
/// reads n_kv cells padded to 256).
pub const KV_CELL_PAD: u32 = 256;

/// Most KV cells per layer (2^24).
pub const MAX_CTX: u32 = 1 << 24;

/// Most rows the output head computes per graph, so the logits never need
/// more activation memory than the plan reserved.
pub const HEAD_ROWS: u32 = 256;

/// Fewest rows an FFN chunk has. The GEMM kernels lose speed on narrower
/// products: on the H100, pp2048 of a 70B-shaped model ran 0.6% slower
/// with chunks of 512 rows than with whole steps, and as fast with chunks
/// of 1024 (docs/device-runs.md, run 19). Steps of up to this many rows run
/// whole.
pub const FFN_MIN_CHUNK: u32 = 1024;

/// Bytes of one KV element (F16).
const KV_ELEMENT: u64 = 2;

/// The context rounded up to whole KV pads; None when it exceeds
/// [`MAX_CTX`].
pub fn kv_cells(n_ctx: u32) -> Option<u32> {
    n_ctx
        .max(1)
        .div_ceil(KV_CELL_PAD)
        .checked_mul(KV_CELL_PAD)
        .filter(|&c| c <= MAX_CTX)
}

/// Bytes of one cell's K row (or V row) of one layer.
pub fn kv_row_bytes(hp: &Hparams) -> u64 {
    hp.n_embd_kv() as u64 * KV_ELEMENT
}

/// Bytes of one layer's K and V over `cells` cells.
pub fn kv_bytes(hp: &Hparams, cells: u64) -> u64 {
    2 * kv_row_bytes(hp) * cells
}

/// Device bytes of the persistent step tensors: the residual stream
/// (F32 [n_embd, n_batch]), positions, KV indices and output ids, and the
/// F16 mask [n_ctx, n_batch] (two where layers attend over a sliding
/// window).
pub fn persistent_bytes(hp: &Hparams, lim: Limits) -> u64 {
    lim.n_batch as u64 * (hp.n_embd as u64 * 4 + 16) + 2 * mask_elements(hp, lim)
}

/// Bytes of an expert split's host rows (F32 [n_embd, n_batch]), where a
/// mixture may split (`paging::split`; device memory where the device has
/// no pinned host buffer type), and of each of the row split's reduce
/// buffers.
pub fn split_rows_bytes(hp: &Hparams, lim: Limits) -> u64 {
    lim.n_batch as u64 * hp.n_embd as u64 * 4
}

/// Elements of the F16 mask tensor: [n_ctx, n_batch] for the full-context
/// layers, and as many again after them where layers attend over a
/// sliding window (graph::Externals views the second at `StepShape::swa`).
pub fn mask_elements(hp: &Hparams, lim: Limits) -> u64 {
    let masks = if hp.n_swa > 0 { 2 } else { 1 };
    masks * lim.n_ctx as u64 * lim.n_batch as u64
}

/// Activation bytes per row of the attention, FFN and head graphs.
fn row_bytes(hp: &Hparams) -> [u64; 3] {
    [
        // norm, Q, K, V, attention output (flash attention: no KQ matrix)
        4 * (2 * hp.n_embd as u64 + 2 * hp.n_embd_q() as u64 + 2 * hp.n_embd_kv() as u64),
        ffn_row_bytes(hp),
        4 * (2 * hp.n_embd as u64 + hp.n_vocab as u64),
    ]
}

/// Activation bytes per row of the FFN graph: norm, gate, up and their
/// product; for a mixture of experts, the router's logits and
/// probabilities, and per expert used its gate, up, product and output
/// (before the weighted sum), the routing ids and weights.
fn ffn_row_bytes(hp: &Hparams) -> u64 {
    let e = hp.n_embd as u64;
    if hp.is_moe() {
        let (x, k, ff) = (
            hp.n_expert as u64,
            hp.n_expert_used as u64,
            hp.n_ff_exp as u64,
        );
        4 * (2 * e + 2 * x + k * (3 * ff + 2 * e + 4))
    } else {
        4 * (2 * e + 3 * hp.n_ff as u64)
    }
}

/// Activation bytes of the largest step, used to plan before the graphs
/// exist. Every graph shares one activation buffer, so this is the largest
/// graph's need, not a sum. Each term counts the F32 intermediates alive at
/// the graph's peak with room to spare (measured on a 70B-shaped layer at
/// 512 tokens: FFN 184 MiB against 200 MiB here, attention 48 MiB against
/// 68 MiB); the margin covers alignment and allocator fragmentation.
pub fn activation_bytes(hp: &Hparams, lim: Limits) -> u64 {
    let [attn, ffn, head] = row_bytes(hp);
    let b = lim.n_batch as u64;
    let attn = attn * b;
    // the FFN runs over at most ffn_rows rows at a time
    let ffn = ffn * b.min(lim.ffn_rows as u64);
    // the head over at most HEAD_ROWS
    let head = head * b.min(HEAD_ROWS as u64);
    attn.max(ffn).max(head) * 5 / 4
}

/// Rows the FFN graph computes at once when the GPU budget is tight: as
/// many as keep its activations within what attention at `n_batch` rows
/// or the head need anyway (FFN rows cost 3 x n_ff, the most of any
/// graph; on a 70B-shaped layer 400 KiB against 136 KiB for attention), in
/// multiples of 32 rows, never fewer than [`FFN_MIN_CHUNK`]; `n_batch`
/// where it already fits. Only large steps are cut (2048 rows: two chunks
/// of 1024, halving the FFN's share of the reserve).
pub fn ffn_rows(hp: &Hparams, n_batch: u32) -> u32 {
    let [attn, ffn, head] = row_bytes(hp);
    let b = n_batch as u64;
    let target = (attn * b).max(head * b.min(HEAD_ROWS as u64));
    let rows = (target / ffn.max(1)) / 32 * 32;
    rows.max(FFN_MIN_CHUNK as u64).min(b) as u32
}

/// The activation reserve the memory plan chooses from: whole steps, and
/// FFN chunks of `forced` rows (clamped to the step) or of [`ffn_rows`].
pub fn activations(hp: &Hparams, lim: Limits, forced: Option<u32>) -> Activations {
    let forced = forced.map(|r| r.clamp(1, lim.n_batch.max(1)));
    let ffn_rows = forced.unwrap_or_else(|| ffn_rows(hp, lim.n_batch));
    let chunked = activation_bytes(hp, Limits { ffn_rows, ..lim });
    Activations {
        whole: match forced {
            Some(_) => chunked,
            None => activation_bytes(hp, lim),
        },
        chunked,
        ffn_rows,
        forced: forced.is_some(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The 70B shape of the device runs (vocabulary of the SmolLM2 model
    /// its synthetic weights borrow).
    fn llama70b() -> Hparams {
        crate::paging::testutil::hparams_70b()
    }

    #[test]
    fn ffn_chunks_are_never_narrower_than_the_minimum() {
        let hp = llama70b();
        // steps up to the minimum run whole
        for b in [1, 16, 512, 1024] {
            assert_eq!(ffn_rows(&hp, b), b);
        }
        // 2048 rows would fit in 672 at attention's reserve, but chunks of
        // 512 cost prefill speed: two of 1024
        assert_eq!(ffn_rows(&hp, 2048), FFN_MIN_CHUNK);
        // larger steps: as many rows as attention's reserve allows
        let r = ffn_rows(&hp, 8192);
        assert!(r > FFN_MIN_CHUNK && r < 8192 && r.is_multiple_of(32), "{r}");
        let lim = |ffn_rows| Limits {
            n_batch: 8192,
            n_ctx: 8192,
            ffn_rows,
        };
        assert!(activation_bytes(&hp, lim(r)) < activation_bytes(&hp, lim(8192)) / 2);
    }

    #[test]
    fn kv_sizes() {
        let hp = llama70b();
        // 8 KV heads of 128 halves: 2 KiB per row, K and V of 4096 cells
        assert_eq!(kv_row_bytes(&hp), 2048);
        assert_eq!(kv_bytes(&hp, 4096), 16 << 20);
        assert_eq!(kv_cells(1), Some(256));
        assert_eq!(kv_cells(4097), Some(4352));
        assert_eq!(kv_cells(MAX_CTX), Some(MAX_CTX));
        assert_eq!(kv_cells(MAX_CTX + 1), None);
        assert_eq!(kv_cells(u32::MAX), None);
    }

    #[test]
    fn a_forced_chunk_width_is_the_whole_reserve() {
        let hp = llama70b();
        let lim = Limits {
            n_batch: 2048,
            n_ctx: 4096,
            ffn_rows: 2048,
        };
        let a = activations(&hp, lim, Some(4096));
        assert_eq!((a.ffn_rows, a.whole), (2048, a.chunked));
        let a = activations(&hp, lim, None);
        assert_eq!(a.ffn_rows, FFN_MIN_CHUNK);
        assert!(a.chunked < a.whole);
    }
}
