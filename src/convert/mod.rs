//! The converter behind `strata-convert`: GGUF relayout and requantization,
//! Hugging Face safetensors import, synthetic models, and layout inspection.
//!
//! Every output is a standard GGUF v3 that llama.cpp loads, laid out for
//! paging (../shared/DESIGN.md, "The on-disk layout"):
//!
//! - `general.alignment` = 4096, so every tensor, and so every extent, starts
//!   on an O_DIRECT boundary;
//! - tensors ordered globals first (token_embd, output_norm, output,
//!   rope_freqs), then per layer the attention group, then the FFN group,
//!   each group's tensors in role order ([`layout`]);
//! - `strata.layout` = "layer-groups-v1", `strata.alignment` (u32 4096),
//!   `strata.group_offsets` and `strata.group_sizes` (array u64, one entry per
//!   group in `ModelSpec::groups` order, index 2*layer + (0 attn | 1 ffn)).
//!   Offsets are **absolute file offsets** of the extent's first byte. The
//!   offsets arrays have a fixed encoded size, so the header length (and so
//!   the data section start) is known before the values are: no iteration is
//!   needed. Sizes are multiples of 4096 and include the zero padding the
//!   writer puts after each tensor, so one extent is one O_DIRECT read.
//!
//! Outputs are written to a temporary file beside the target whose magic is
//! written last, fsynced and renamed ([`output`]): an interrupted or failed
//! conversion never leaves a file that looks valid. Inputs are validated
//! before anything is written; every problem is a [`ConvertError`] that names
//! the file, tensor or key at fault.

pub mod cancel;
mod check;
pub mod hf;
mod inspect;
pub mod layout;
mod output;
pub mod quant;
mod relayout;
pub mod synth;

pub use check::{check_layout, read_group_extents, GroupReport, LayoutReport};
pub use inspect::inspect;
pub use layout::{Extent, Layout, Slot};
pub use output::{write_model, OutTensor, OutputModel, TensorFill, WriteSummary};
pub use relayout::{convert_gguf, GgufOptions};

use std::path::PathBuf;

/// Value of `strata.layout` for the layout this module writes.
pub const LAYOUT_NAME: &str = "layer-groups-v1";
/// Alignment of every tensor and extent (O_DIRECT block).
pub const STRATA_ALIGNMENT: u64 = 4096;
pub const KEY_LAYOUT: &str = "strata.layout";
pub const KEY_ALIGNMENT: &str = "strata.alignment";
/// Absolute file offset of each group extent, groups order.
pub const KEY_GROUP_OFFSETS: &str = "strata.group_offsets";
/// Byte size of each group extent (a multiple of the alignment).
pub const KEY_GROUP_SIZES: &str = "strata.group_sizes";

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

/// Opens and validates a GGUF input, naming the file in any error.
pub(crate) fn open_gguf(path: &std::path::Path) -> Result<crate::gguf::GgufFile> {
    crate::gguf::GgufFile::open(path).map_err(|err| match err {
        // already names the file
        crate::gguf::GgufError::Io { .. } => ConvertError::Gguf(err),
        err => ConvertError::BadGguf {
            path: path.to_path_buf(),
            err,
        },
    })
}

/// The model description of an input, naming the file in any error.
pub(crate) fn model_spec(
    path: &std::path::Path,
    f: &crate::gguf::GgufFile,
) -> Result<crate::model::ModelSpec> {
    crate::model::ModelSpec::from_gguf(f).map_err(|err| ConvertError::BadModel {
        path: path.to_path_buf(),
        err,
    })
}

pub type Result<T> = std::result::Result<T, ConvertError>;

/// Worker threads to use by default: every core.
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(4, |n| n.get())
}
