//! What can go wrong converting a model.

use std::path::PathBuf;

/// Everything that can go wrong in a conversion, each naming what is wrong.
#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    // The causes are part of the message, not `source()`, so an error
    // chain (anyhow) does not print them twice.
    #[error("{}: {err}", path.display())]
    Io { path: PathBuf, err: std::io::Error },
    #[error("{}: {err}", path.display())]
    BadGguf {
        path: PathBuf,
        err: crate::gguf::GgufError,
    },
    #[error("{}: {err}", path.display())]
    BadModel {
        path: PathBuf,
        err: crate::model::ModelError,
    },
    #[error(transparent)]
    Gguf(#[from] crate::gguf::GgufError),
    #[error(transparent)]
    Model(#[from] crate::model::ModelError),
    #[error(transparent)]
    Ggml(#[from] crate::ggml::GgmlError),
    #[error("{}: {problem}", file.display())]
    Safetensors { file: PathBuf, problem: String },
    #[error("{}: {problem}", file.display())]
    Json { file: PathBuf, problem: String },
    #[error("config.json: {0}")]
    Config(String),
    #[error("tensor '{tensor}' has shape {found:?}, but config.json implies {expected:?}")]
    ShapeMismatch {
        tensor: String,
        found: Vec<u64>,
        expected: Vec<u64>,
    },
    #[error("tensor '{tensor}' has dtype {dtype}, which the converter cannot read (supported: F32, F16, BF16)")]
    UnsupportedDtype { tensor: String, dtype: String },
    #[error("checkpoint is missing tensor '{0}'")]
    MissingTensor(String),
    #[error("checkpoint has tensor '{0}', which this architecture does not use")]
    UnexpectedTensor(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("unknown output type '{0}' (supported: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k, iq4_nl)")]
    UnknownType(String),
    #[error("cannot convert tensor '{tensor}' to {ty}: {reason}")]
    Quantize {
        tensor: String,
        ty: String,
        reason: String,
    },
    #[error("tensor '{tensor}' is already quantized ({from}); requantizing it to {to} loses quality twice: convert from an f16/bf16/f32 file, or pass --allow-requantize")]
    Requantize {
        tensor: String,
        from: String,
        to: String,
    },
    #[error("layout: {0}")]
    Layout(String),
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error("not enough free space in {}: need {need} bytes, {have} available", dir.display())]
    NoSpace { dir: PathBuf, need: u64, have: u64 },
    #[error("interrupted; the partial output was removed")]
    Cancelled,
    #[error("written file failed verification, removed: {0}")]
    Verify(String),
}

impl ConvertError {
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> ConvertError {
        let path = path.into();
        move |err| ConvertError::Io { path, err }
    }
}

pub type Result<T> = std::result::Result<T, ConvertError>;
