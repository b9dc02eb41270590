//! The error type the engine's submodules share.

use crate::ggml::GgmlError;
use crate::kv::KvError;
use crate::model::ModelError;
use crate::paging::PlanError;

/// Errors of the engine, each naming what failed.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("{0}: {1}")]
    Io(String, std::io::Error),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Gguf(#[from] crate::gguf::GgufError),
    #[error(transparent)]
    Ggml(#[from] GgmlError),
    #[error(transparent)]
    Kv(#[from] KvError),
    #[error(transparent)]
    Plan(#[from] PlanError),
    #[error("token id {token} is outside the vocabulary (n_vocab = {n_vocab})")]
    BadToken { token: u32, n_vocab: u32 },
    #[error("position {pos} of sequence {seq} is outside the context (n_ctx = {n_ctx})")]
    BadPos { seq: u32, pos: i32, n_ctx: u32 },
    #[error("empty batch")]
    EmptyBatch,
    #[error("{0}")]
    Unsupported(&'static str),
    #[error("context size {0} is out of range (at most 16777216 tokens)")]
    BadContext(u32),
    #[error(transparent)]
    Storage(#[from] crate::storage::StorageError),
    #[error(transparent)]
    KvTier(#[from] crate::kv::tier::TierError),
    #[error(transparent)]
    Routing(#[from] crate::paging::routing::RoutingError),
    #[error(transparent)]
    KvSpill(#[from] crate::kv::spill::SpillError),
    #[error(transparent)]
    Devices(#[from] crate::paging::DeviceSplitError),
    #[error("{0}")]
    BadDevices(String),
    #[error("router counts {0}: {1}")]
    BadCounts(String, crate::paging::routing::RoutingError),
    #[error(
        "router counts {0} are another model's ({1}): remove the file or pass --expert-counts"
    )]
    OtherModelCounts(String, crate::paging::routing::RoutingError),
}
