//! Opening the model a conversion reads, and the threads it uses.

use super::error::{ConvertError, Result};

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

/// Worker threads to use by default: every core.
pub fn default_threads() -> usize {
    std::thread::available_parallelism().map_or(4, |n| n.get())
}
