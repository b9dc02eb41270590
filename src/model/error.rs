//! What can be wrong with a model file's contents.

use crate::gguf::GgufError;

/// Errors that name what is wrong with a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// `general.architecture` names none of `supported` (comma-separated).
    #[error("unsupported architecture '{name}' (supported: {supported})")]
    UnknownArch { name: String, supported: String },
    #[error("tensor '{name}' has shape {found:?}, expected {expected:?}")]
    BadShape {
        name: String,
        found: Vec<u64>,
        expected: Vec<u64>,
    },
    #[error("tensor '{name}' has type {ty}, which strata cannot use there")]
    BadType { name: String, ty: String },
    #[error("hyperparameter {key} = {value} is invalid: {why}")]
    BadHparam {
        key: String,
        value: String,
        why: &'static str,
    },
    #[error("unsupported feature: {0}")]
    Unsupported(String),
    #[error("vocabulary: {0}")]
    BadVocab(String),
    #[error("{key} = {n_layer}, but the file has tensor '{tensor}' of a layer beyond it")]
    ExtraLayer {
        key: String,
        n_layer: u32,
        tensor: String,
    },
}
