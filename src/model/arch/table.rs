//! The shape of an architecture's description: the [`Arch`] names, the
//! tensors of a layer group and their shapes, and [`ArchSpec`], which each
//! architecture's file fills in.

use crate::gguf::GgufFile;
use crate::model::error::ModelError;
use crate::model::hparams::Hparams;
use crate::model::role::Role;

/// An architecture as named by `general.architecture`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arch {
    /// Llama 1/2/3 (incl. llama3 `rope_freqs`), Mistral, SmolLM2.
    Llama,
    /// Qwen2 / Qwen2.5: Q/K/V biases.
    Qwen2,
    /// Qwen3 (dense): per-head Q/K RMS norms, no biases.
    Qwen3,
    /// Qwen3-MoE: Qwen3's attention, a mixture-of-experts FFN.
    Qwen3Moe,
    /// Gemma 3 (text): post-norms, GELU FFN, sliding-window layers.
    Gemma3,
}

/// Every architecture, in the order errors list them.
pub const ALL: [Arch; 5] = [
    Arch::Llama,
    Arch::Qwen2,
    Arch::Qwen3,
    Arch::Qwen3Moe,
    Arch::Gemma3,
];

/// The FFN's gated activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Act {
    /// SiLU(gate) * up (SwiGLU): the Llama family.
    Silu,
    /// GELU(gate) * up, GELU by its tanh approximation (GeGLU): Gemma.
    GeluTanh,
}

/// An architecture's own hyperparameters, read after the shared ones
/// (llama.cpp's load_arch_hparams): sets what only it has.
pub type ReadHparams = fn(&GgufFile, &mut Hparams) -> Result<(), ModelError>;

/// Whether a tensor must be in the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Need {
    Required,
    Optional,
}

/// A tensor's shape in the model's dimensions (ggml order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shape {
    /// [n_embd]
    Embd,
    /// [head_dim]
    HeadDim,
    /// [n_embd_q]
    Q,
    /// [n_embd_kv]
    Kv,
    /// [n_embd, n_embd_q]: a projection to Q
    EmbdQ,
    /// [n_embd, n_embd_kv]
    EmbdKv,
    /// [n_embd_q, n_embd]: the attention output
    QEmbd,
    /// [n_embd, n_ff]
    EmbdFf,
    /// [n_ff, n_embd]
    FfEmbd,
    /// [n_embd, n_expert]: the router
    EmbdExperts,
    /// [n_embd, n_ff_exp, n_expert]: every expert's gate or up
    EmbdFfExperts,
    /// [n_ff_exp, n_embd, n_expert]: every expert's down
    FfEmbdExperts,
}

impl Shape {
    /// The shape for a model of these dimensions.
    pub fn ne(self, hp: &Hparams) -> Vec<u64> {
        let (e, hd) = (hp.n_embd as u64, hp.head_dim as u64);
        let (q, kv, ff) = (hp.n_embd_q() as u64, hp.n_embd_kv() as u64, hp.n_ff as u64);
        let (x, fx) = (hp.n_expert as u64, hp.n_ff_exp as u64);
        match self {
            Shape::Embd => vec![e],
            Shape::HeadDim => vec![hd],
            Shape::Q => vec![q],
            Shape::Kv => vec![kv],
            Shape::EmbdQ => vec![e, q],
            Shape::EmbdKv => vec![e, kv],
            Shape::QEmbd => vec![q, e],
            Shape::EmbdFf => vec![e, ff],
            Shape::FfEmbd => vec![ff, e],
            Shape::EmbdExperts => vec![e, x],
            Shape::EmbdFfExperts => vec![e, fx, x],
            Shape::FfEmbdExperts => vec![fx, e, x],
        }
    }
}

/// One tensor of a layer group: `blk.N.{role.suffix()}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tensor {
    pub role: Role,
    pub need: Need,
    pub shape: Shape,
}

pub const fn t(role: Role, need: Need, shape: Shape) -> Tensor {
    Tensor { role, need, shape }
}

/// What strata knows of an architecture.
#[derive(Debug)]
pub struct ArchSpec {
    pub arch: Arch,
    /// `general.architecture`, and the prefix of its hyperparameter keys.
    pub name: &'static str,
    /// ggml RoPE mode: 0 = NORM (adjacent pairs), 2 = NEOX (split halves).
    pub rope_mode: i32,
    /// The attention group's tensors, in the order the group lists them.
    pub attn: &'static [Tensor],
    /// The FFN group's tensors when the file has no experts
    /// (`expert_count` 0); empty where the architecture is always a
    /// mixture of experts.
    pub ffn: &'static [Tensor],
    /// The FFN group's tensors when the file has experts; empty where the
    /// architecture has none.
    pub moe_ffn: &'static [Tensor],
    /// The dense FFN's activation.
    pub ffn_act: Act,
    /// Its own hyperparameters, where it has some.
    pub read_hparams: Option<ReadHparams>,
}

impl ArchSpec {
    /// The FFN group's tensors for a file with `n_expert` experts per FFN,
    /// or None where the architecture has no FFN of that kind.
    pub fn ffn_tensors(&self, n_expert: u32) -> Option<&'static [Tensor]> {
        let t = if n_expert > 0 { self.moe_ffn } else { self.ffn };
        (!t.is_empty()).then_some(t)
    }
}

/// The Llama family's FFN: SwiGLU over gate and up.
pub const SWIGLU_FFN: [Tensor; 4] = [
    t(Role::FfnNorm, Need::Required, Shape::Embd),
    t(Role::Gate, Need::Required, Shape::EmbdFf),
    t(Role::Up, Need::Required, Shape::EmbdFf),
    t(Role::Down, Need::Required, Shape::FfEmbd),
];

/// A mixture of experts with softmax routing (graph/moe.rs): the router
/// and every expert's SwiGLU matrices, stacked.
pub const MOE_FFN: [Tensor; 5] = [
    t(Role::FfnNorm, Need::Required, Shape::Embd),
    t(Role::GateInp, Need::Required, Shape::EmbdExperts),
    t(Role::GateExps, Need::Required, Shape::EmbdFfExperts),
    t(Role::UpExps, Need::Required, Shape::EmbdFfExperts),
    t(Role::DownExps, Need::Required, Shape::FfEmbdExperts),
];
