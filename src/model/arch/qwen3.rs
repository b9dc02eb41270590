//! Qwen3, dense (llama.cpp's src/models/qwen3.cpp): no biases; Q and K are
//! RMS-normed per head (`attn_q_norm`, `attn_k_norm`, [head_dim]) after
//! the projection and before NEOX RoPE. The head dimension is its own key
//! (`attention.key_length`), so n_embd_q may differ from n_embd.

use super::table::{t, Act, Arch, ArchSpec, Need::*, Shape::*, SWIGLU_FFN};
use crate::model::role::Role;

pub const SPEC: ArchSpec = ArchSpec {
    arch: Arch::Qwen3,
    name: "qwen3",
    rope_mode: 2,
    attn: &[
        t(Role::AttnNorm, Required, Embd),
        t(Role::Wq, Required, EmbdQ),
        t(Role::QNorm, Required, HeadDim),
        t(Role::Wk, Required, EmbdKv),
        t(Role::KNorm, Required, HeadDim),
        t(Role::Wv, Required, EmbdKv),
        t(Role::Wo, Required, QEmbd),
    ],
    ffn: &SWIGLU_FFN,
    moe_ffn: &[],
    ffn_act: Act::Silu,
    read_hparams: None,
};
