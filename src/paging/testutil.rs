//! Inputs the paging tests share.

use super::groups::GroupInfo;
use super::hybrid::CpuInput;
use crate::model::GroupKind;
use crate::model::Hparams;

/// `n` layers of an attention group of `attn` bytes and an FFN group of
/// `ffn` bytes.
pub fn layers(n: usize, attn: u64, ffn: u64) -> Vec<GroupInfo> {
    (0..n)
        .flat_map(|_| {
            [
                GroupInfo::dense(GroupKind::Attn, attn),
                GroupInfo::dense(GroupKind::Ffn, ffn),
            ]
        })
        .collect()
}

/// A CPU of `s_per_byte` seconds per byte at one token (8 times that at
/// its 16-token probe), with no hop or GPU costs and unlimited room.
pub fn cpu(s_per_byte: f64) -> CpuInput {
    CpuInput {
        s_per_byte_1: s_per_byte,
        s_per_byte_n: s_per_byte * 8.0,
        probe_tokens: 16,
        big: None,
        host_room: u64::MAX,
        hop_s: 0.0,
        gpu_s_per_byte: 0.0,
        gpu_group_s: 0.0,
        cpu_group_s: 0.0,
        bus_bw_beside: None,
        force: None,
        split: super::hybrid::SplitInput::default(),
        carry: false,
        tiers: true,
    }
}

/// Per-group GPU overhead on the H100 machine, from the run-4 trace (36
/// resident groups in 6.9 ms for 3.3 ms of weight reads).
pub const GPU_GROUP_S: f64 = 100e-6;

/// `n` layers of Qwen3-30B-A3B's shape: 10.6 MiB of attention and an
/// FFN group of 340 MiB of experts, 8 of 128 per token, `hot` of
/// their picks on the device.
pub fn qwen3moe_30b(n: usize, hot: f64) -> Vec<GroupInfo> {
    let mib = |x: f64| (x * 1048576.0) as u64;
    layers(n, mib(10.6), mib(340.5))
        .into_iter()
        .map(|g| GroupInfo {
            experts: (g.kind == GroupKind::Ffn).then_some(super::groups::Experts {
                bytes: mib(340.0),
                n_expert: 128,
                n_used: 8,
                hot,
                popularity: None,
                cpu_scale: [1.0; 2],
            }),
            ..g
        })
        .collect()
}

/// The H100 machine's probe readings (docs/device/hybrid/run4).
pub fn h100_cpu() -> CpuInput {
    CpuInput {
        s_per_byte_n: 1.0 / 30.3e9,
        hop_s: 45e-6,
        gpu_s_per_byte: 1.0 / 2502e9,
        gpu_group_s: GPU_GROUP_S,
        ..cpu(1.0 / 93.2e9)
    }
}

/// A Llama-3-70B-shaped model (the vocabulary smaller).
pub fn hparams_70b() -> Hparams {
    Hparams {
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
        n_swa: 0,
        swa_pattern: 1,
        rope_freq_base_swa: 10000.0,
        q_scale: 1.0,
        embd_scale: 1.0,
        n_expert: 0,
        n_expert_used: 0,
        n_ff_exp: 0,
        layer0: 0,
    }
}

/// The Qwen3-30B-A3B shape of the device runs (128 experts, 8 used).
pub fn hparams_qwen3moe_30b() -> Hparams {
    Hparams {
        n_vocab: 151936,
        n_ctx_train: 40960,
        n_embd: 2048,
        n_layer: 48,
        n_ff: 6144,
        n_head: 32,
        n_head_kv: 4,
        head_dim: 128,
        n_rot: 128,
        rms_eps: 1e-6,
        rope_freq_base: 1000000.0,
        n_ctx_orig: 40960,
        kq_scale: 1.0 / (128f32).sqrt(),
        n_expert: 128,
        n_expert_used: 8,
        n_ff_exp: 768,
        ..hparams_70b()
    }
}
