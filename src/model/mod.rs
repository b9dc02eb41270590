//! Model definitions: architectures, hyperparameters and the tensor table.
//!
//! A [`ModelSpec`] is everything strata needs to know about a GGUF model
//! before touching its weights: the hyperparameters, and for every layer
//! group (attention, FFN) the ordered list of tensors with their types and
//! shapes. It is built only from a validated [`GgufFile`] and checks every
//! shape the architecture expects, so graph builders can trust it.
//!
//! Reference: llama.cpp `src/models/llama.cpp`, `src/models/qwen2.cpp` and
//! `src/llama-model.cpp` (hparams loading) of the pinned source.

mod arch;
mod error;
mod spec;
mod vocab;

pub use arch::Arch;
pub use error::ModelError;
pub use spec::{GroupId, GroupKind, GroupSpec, Hparams, ModelSpec, Role, WeightSpec};
pub use vocab::validate_vocab;
