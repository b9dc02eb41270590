//! Errors from the ggml layer.

/// Errors from the ggml layer. Each names the operation that failed.
#[derive(Debug, thiserror::Error)]
pub enum GgmlError {
    #[error("ggml_init failed to allocate a context of {0} bytes")]
    ContextAlloc(usize),
    #[error("no ggml backend modules found (searched: {searched})")]
    NoBackends { searched: String },
    #[error("no {0} device is available")]
    NoDevice(&'static str),
    #[error("could not initialize a backend on device {0}")]
    BackendInit(String),
    #[error("could not allocate a {size} byte buffer on {buft}")]
    BufferAlloc { size: usize, buft: String },
    #[error("could not create an event on device {0}")]
    EventInit(String),
    #[error("graph computation failed with ggml status {0}")]
    Compute(i32),
    #[error("graph allocation failed (reserve or alloc) for {0}")]
    GraphAlloc(String),
    #[error("backend module {module} was built from ggml {found}, but strata uses ggml {expected}; rebuild it with tools/build-cuda-module.sh")]
    VersionMismatch {
        module: String,
        found: String,
        expected: String,
    },
    #[error("{0}")]
    ModuleRefused(String),
    #[error("{0}")]
    Rpc(String),
    #[error("tensor {name}: {what}")]
    Tensor { name: String, what: String },
}

pub type Result<T> = std::result::Result<T, GgmlError>;
