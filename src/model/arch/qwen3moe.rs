//! Qwen3-MoE (llama.cpp's src/models/qwen3moe.cpp): Qwen3's attention
//! (per-head Q/K RMS norms before NEOX RoPE, its own head dimension, no
//! biases) and in every layer a mixture of experts with softmax routing,
//! the top-k weights renormalized, no shared expert. One expert's hidden
//! width is `qwen3moe.expert_feed_forward_length`.

use super::qwen3;
use super::table::{Act, Arch, ArchSpec, MOE_FFN};

pub const SPEC: ArchSpec = ArchSpec {
    arch: Arch::Qwen3Moe,
    name: "qwen3moe",
    rope_mode: 2,
    attn: qwen3::SPEC.attn,
    ffn: &[],
    moe_ffn: &MOE_FFN,
    ffn_act: Act::Silu,
    read_hparams: None,
};
