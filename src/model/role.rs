//! What each weight tensor of a layer group does, and its GGUF name.

/// What a weight tensor does inside its group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    AttnNorm,
    Wq,
    /// Per-head RMS norm of Q (Qwen3), after the projection, before RoPE.
    QNorm,
    Bq,
    Wk,
    Bk,
    /// Per-head RMS norm of K (Qwen3).
    KNorm,
    Wv,
    Bv,
    Wo,
    Bo,
    /// RMS norm of the attention output before the residual add (Gemma 3).
    AttnPostNorm,
    FfnNorm,
    Gate,
    Up,
    Down,
    /// RMS norm of the FFN output before the residual add (Gemma 3).
    FfnPostNorm,
    /// The router of a mixture of experts: [n_embd, n_expert].
    GateInp,
    /// Every expert's gate, up and down matrices, stacked:
    /// [n_embd, n_ff_exp, n_expert] and [n_ff_exp, n_embd, n_expert].
    GateExps,
    UpExps,
    DownExps,
}

impl Role {
    /// GGUF tensor name suffix after "blk.N.".
    pub fn suffix(self) -> &'static str {
        match self {
            Role::AttnNorm => "attn_norm.weight",
            Role::Wq => "attn_q.weight",
            Role::Bq => "attn_q.bias",
            Role::QNorm => "attn_q_norm.weight",
            Role::Wk => "attn_k.weight",
            Role::Bk => "attn_k.bias",
            Role::KNorm => "attn_k_norm.weight",
            Role::Wv => "attn_v.weight",
            Role::Bv => "attn_v.bias",
            Role::Wo => "attn_output.weight",
            Role::Bo => "attn_output.bias",
            Role::AttnPostNorm => "post_attention_norm.weight",
            Role::FfnPostNorm => "post_ffw_norm.weight",
            Role::FfnNorm => "ffn_norm.weight",
            Role::Gate => "ffn_gate.weight",
            Role::Up => "ffn_up.weight",
            Role::Down => "ffn_down.weight",
            Role::GateInp => "ffn_gate_inp.weight",
            Role::GateExps => "ffn_gate_exps.weight",
            Role::UpExps => "ffn_up_exps.weight",
            Role::DownExps => "ffn_down_exps.weight",
        }
    }
    /// One of a mixture's stacked expert tensors.
    pub fn is_expert(self) -> bool {
        matches!(self, Role::GateExps | Role::UpExps | Role::DownExps)
    }
    pub fn is_norm_or_bias(self) -> bool {
        matches!(
            self,
            Role::AttnNorm
                | Role::FfnNorm
                | Role::AttnPostNorm
                | Role::FfnPostNorm
                | Role::QNorm
                | Role::KNorm
                | Role::Bq
                | Role::Bk
                | Role::Bv
                | Role::Bo
        )
    }
}
