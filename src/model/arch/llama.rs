//! Llama 1/2/3, Mistral, SmolLM2 (llama.cpp's src/models/llama.cpp):
//! pre-norm attention with NORM RoPE (llama 3's frequency factors in
//! `rope_freqs.weight` when present), optional biases, SwiGLU FFN; or,
//! where the file has `llama.expert_count`, a mixture of experts with
//! softmax routing (Mixtral: `ffn_gate_inp` and stacked `ffn_*_exps`).

use super::table::{t, Act, Arch, ArchSpec, Need::*, Shape::*, MOE_FFN, SWIGLU_FFN};
use crate::model::role::Role;

pub const SPEC: ArchSpec = ArchSpec {
    arch: Arch::Llama,
    name: "llama",
    rope_mode: 0,
    attn: &[
        t(Role::AttnNorm, Required, Embd),
        t(Role::Wq, Required, EmbdQ),
        t(Role::Bq, Optional, Q),
        t(Role::Wk, Required, EmbdKv),
        t(Role::Bk, Optional, Kv),
        t(Role::Wv, Required, EmbdKv),
        t(Role::Bv, Optional, Kv),
        t(Role::Wo, Required, QEmbd),
        t(Role::Bo, Optional, Embd),
    ],
    ffn: &SWIGLU_FFN,
    moe_ffn: &MOE_FFN,
    ffn_act: Act::Silu,
    read_hparams: None,
};
