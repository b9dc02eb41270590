//! Qwen2 and Qwen2.5 (llama.cpp's src/models/qwen2.cpp): Llama with Q/K/V
//! biases always present and NEOX RoPE.

use super::table::{t, Act, Arch, ArchSpec, Need::*, Shape::*, SWIGLU_FFN};
use crate::model::role::Role;

pub const SPEC: ArchSpec = ArchSpec {
    arch: Arch::Qwen2,
    name: "qwen2",
    rope_mode: 2,
    attn: &[
        t(Role::AttnNorm, Required, Embd),
        t(Role::Wq, Required, EmbdQ),
        t(Role::Bq, Required, Q),
        t(Role::Wk, Required, EmbdKv),
        t(Role::Bk, Required, Kv),
        t(Role::Wv, Required, EmbdKv),
        t(Role::Bv, Required, Kv),
        t(Role::Wo, Required, QEmbd),
        t(Role::Bo, Optional, Embd),
    ],
    ffn: &SWIGLU_FFN,
    moe_ffn: &[],
    ffn_act: Act::Silu,
    read_hparams: None,
};
