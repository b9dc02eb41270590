//! Model definitions: architectures, hyperparameters and the tensor table.
//!
//! A [`ModelSpec`] is everything strata needs to know about a GGUF model
//! before touching its weights: the hyperparameters, and for every layer
//! group (attention, FFN) the ordered list of tensors with their types and
//! shapes. It is built only from a validated [`GgufFile`] and checks every
//! shape the architecture expects, so graph builders can trust it.
//!
//! One file per architecture in `arch/` (llama.cpp's `src/models/*.cpp`);
//! hyperparameters as llama.cpp's `src/llama-model.cpp` loads them.

pub mod arch;
mod error;
mod hparams;
mod role;
mod shard;
mod spec;
mod vocab;

pub use arch::Arch;
pub use error::ModelError;
pub use hparams::Hparams;
pub use role::Role;
pub use spec::{ColSlice, GroupId, GroupKind, GroupSpec, ModelSpec, Shard, WeightSpec};
pub use vocab::validate_vocab;
