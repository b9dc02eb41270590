//! The supported architectures and what differs between them.

use super::error::ModelError;

/// An architecture as named by `general.architecture`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arch {
    /// Llama 1/2/3 (incl. llama3 `rope_freqs`), Mistral, SmolLM2: NORM rope.
    Llama,
    /// Qwen2 / Qwen2.5: Q/K/V biases, NEOX rope.
    Qwen2,
}

impl Arch {
    pub fn from_name(name: &str) -> Result<Arch, ModelError> {
        match name {
            "llama" => Ok(Arch::Llama),
            "qwen2" => Ok(Arch::Qwen2),
            other => Err(ModelError::UnknownArch(other.to_string())),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
        }
    }
    /// ggml rope mode: 0 = NORM (adjacent pairs), 2 = NEOX (split halves).
    pub fn rope_mode(self) -> i32 {
        match self {
            Arch::Llama => 0,
            Arch::Qwen2 => 2,
        }
    }
    /// Whether Q/K/V biases are required (Qwen2) rather than optional.
    pub fn requires_qkv_bias(self) -> bool {
        matches!(self, Arch::Qwen2)
    }
}
