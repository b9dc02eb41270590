//! Device memory a CUDA run takes outside strata's own buffers, which the
//! GPU budget has to hold as well. Measured on an H200 (docs/device-runs.md,
//! session 68, runs 213-215; Qwen3-30B-A3B shape at 8 GiB): loads that
//! reserved no GEMM scratch held 174-222 MiB beyond the plan's items.
//! What it is:
//! - the driver's mapping of pinned host memory: 2 MiB of device memory
//!   per GiB pinned (`cudaMallocHost` of 1 to 22 GiB, run 215);
//! - cuBLAS's handle and workspace, 68 MiB (run 215), where ggml multiplies
//!   float matrices (a mixture's F32 router) over many rows;
//! - ggml's memory pool at the largest step: MMQ's quantized copy of the
//!   activations and its stream-k fixup buffer (mmq.cu, mmq.cuh);
//! - kernels CUDA loads lazily the first time a step shape runs one, and
//!   CUDA graphs: the rest, 58 MiB in run 213 and 106 in run 211, whose
//!   load also ran 16-token steps (CUDA graphs alone: 22 MiB, run 213).
//!
//! Where the plan keeps the GEMM path, its scratch (`gemm::scratch_bytes`,
//! cuBLAS included) covered all but the pinned mapping: those loads held
//! 8158-8182 MiB of the 8 GiB (runs 205-211).

use super::sizes::Limits;
use crate::model::Hparams;

/// Device bytes per byte of pinned host memory the driver keeps mapped
/// (2 MiB per GiB measured).
pub const PINNED_MAP_DIVISOR: u64 = 512;

/// cuBLAS's handle and workspace (68 MiB measured), with room.
pub const CUBLAS_BYTES: u64 = 72 << 20;

/// Lazily loaded kernels and CUDA graphs beyond what the load's matmul
/// probes left (counted apart): the remainder measured, 58-106 MiB, with
/// room.
pub const KERNEL_BYTES: u64 = 112 << 20;

/// MMQ's stream-k fixup buffer: one 128 x 128 F32 tile per streaming
/// multiprocessor (132 on an H100 or H200), for up to 160 of them.
const FIXUP_BYTES: u64 = 160 * 128 * 128 * 4;

/// Bytes of a q8_1 MMQ block per value (144 bytes for 128 values).
const Q8_1_MMQ_NUM: u64 = 144;
const Q8_1_MMQ_DEN: u64 = 128;

/// The reserve for what a run takes outside strata's buffers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Outside {
    /// Whatever the matmul path: the pinned mapping.
    pub always: u64,
    /// Only where the plan drops the GEMM path (whose scratch covers the
    /// rest): cuBLAS and the lazily loaded kernels...
    pub without_gemm: u64,
    /// ... and ggml's pool for MMQ, with the FFN over whole steps or over
    /// the activation reserve's chunks (`sizes::Activations::ffn_rows`).
    pub pool_whole: u64,
    pub pool_chunked: u64,
}

impl Outside {
    /// The reserve on a local CUDA device (nothing elsewhere: the CPU
    /// backend allocates in strata's buffers). `lim.ffn_rows`: the rows of
    /// an FFN chunk where the plan chunks; `pinned_max`: the most host
    /// bytes the engine may pin (every weight it may stream);
    /// `float_matmuls`: whether the model multiplies float matrices (F32,
    /// F16, BF16), which ggml sends to cuBLAS over many rows.
    pub fn cuda(hp: &Hparams, lim: Limits, pinned_max: u64, float_matmuls: bool) -> Outside {
        let cublas = if float_matmuls && lim.n_batch > 1 {
            CUBLAS_BYTES
        } else {
            0
        };
        Outside {
            always: pinned_max / PINNED_MAP_DIVISOR,
            without_gemm: cublas + KERNEL_BYTES,
            pool_whole: mmq_pool_bytes(
                hp,
                Limits {
                    ffn_rows: lim.n_batch,
                    ..lim
                },
            ),
            pool_chunked: mmq_pool_bytes(hp, lim),
        }
    }

    /// The device bytes with or without the GEMM path, the FFN in chunks
    /// or not.
    pub fn bytes(&self, gemm: bool, chunked: bool) -> u64 {
        let pool = if chunked {
            self.pool_chunked
        } else {
            self.pool_whole
        };
        self.always + if gemm { 0 } else { self.without_gemm + pool }
    }
}

/// The peak of ggml's memory pool in MMQ's products at the largest step:
/// the activations quantized to q8_1 (per expert used for a mixture's
/// experts, over an FFN chunk's rows; over the step's rows for attention
/// and the head) beside the stream-k fixup buffer. Each product frees its
/// own before the next allocates, so the peak is the largest product.
pub fn mmq_pool_bytes(hp: &Hparams, lim: Limits) -> u64 {
    let q8 = |rows: u64, width: u64| rows * width * Q8_1_MMQ_NUM / Q8_1_MMQ_DEN;
    let step = lim.n_batch as u64;
    let ffn_rows = lim.ffn_rows.min(lim.n_batch) as u64;
    let attn = q8(step, hp.n_embd.max(hp.n_embd_q()) as u64);
    let ffn = if hp.is_moe() {
        let used = hp.n_expert_used as u64;
        // the routing's three id arrays beside the copy
        q8(ffn_rows * used, hp.n_embd.max(hp.n_ff_exp) as u64) + 3 * 4 * ffn_rows * used
    } else {
        q8(ffn_rows, hp.n_embd.max(hp.n_ff) as u64)
    };
    attn.max(ffn) + FIXUP_BYTES
}

#[cfg(test)]
mod tests {
    use super::*;

    fn moe() -> Hparams {
        crate::paging::testutil::hparams_qwen3moe_30b()
    }

    /// The Qwen3-30B-A3B shape at run 213's limits: what the reserve holds
    /// against what the device held there beyond the plan's items (174
    /// MiB, and 222 in run 211) without GEMM.
    #[test]
    fn the_reserve_holds_what_the_h200_measured_beyond_the_plan() {
        let hp = moe();
        let lim = Limits {
            n_batch: 2048,
            n_ctx: 4096,
            ffn_rows: 1024,
        };
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        // 1024 rows x 8 experts x 2048 wide in q8_1, the fixup beside it
        let pool = mmq_pool_bytes(&hp, lim);
        assert!(
            (mib(pool) - (18.0 + 0.1 + 10.0)).abs() < 0.5,
            "{}",
            mib(pool)
        );
        // 17 GB of weights pinned at most
        let o = Outside::cuda(&hp, lim, 17 << 30, true);
        assert_eq!(o.always, 34 << 20);
        assert_eq!(o.pool_chunked, pool);
        assert!(o.pool_whole > o.pool_chunked);
        assert!(
            mib(o.bytes(false, true)) >= 222.0,
            "{}",
            mib(o.bytes(false, true))
        );
        assert_eq!(o.bytes(true, true), o.always);
        assert_eq!(o.bytes(true, false), o.always);
        // without float matrices cuBLAS is not reserved
        let q = Outside::cuda(&hp, lim, 17 << 30, false);
        assert_eq!(o.without_gemm - q.without_gemm, CUBLAS_BYTES);
    }

    /// Larger steps and chunks take a larger pool; a dense model's widest
    /// input is its FFN's.
    #[test]
    fn the_pool_follows_the_rows_and_the_widest_input() {
        let hp = moe();
        let lim = |b, f| Limits {
            n_batch: b,
            n_ctx: 4096,
            ffn_rows: f,
        };
        assert!(mmq_pool_bytes(&hp, lim(2048, 1024)) > mmq_pool_bytes(&hp, lim(2048, 512)));
        assert!(mmq_pool_bytes(&hp, lim(512, 512)) < mmq_pool_bytes(&hp, lim(2048, 2048)));
        let dense = crate::paging::testutil::hparams_70b();
        let l = lim(512, 512);
        assert_eq!(
            mmq_pool_bytes(&dense, l),
            512 * dense.n_ff as u64 * 144 / 128 + FIXUP_BYTES
        );
    }
}
