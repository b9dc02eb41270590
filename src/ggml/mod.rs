//! Safe layer over the raw ggml bindings (`crate::sys`, bindgen output of the
//! pinned llama.cpp/ggml source).
//!
//! Invariants kept here:
//! - tensors that live together in one buffer come from a [`TensorArena`],
//!   which owns their context and buffer and hands out tensors and bindings;
//! - every C handle has exactly one owner whose `Drop` frees it
//!   ([`Context`], [`Backend`], [`Buffer`], [`Event`], [`GraphAllocator`]);
//! - a [`Tensor`] or [`Graph`] borrows the [`Context`] that holds its metadata,
//!   so it cannot outlive it;
//! - backends are modules loaded at run time ([`load_backends`]); no
//!   backend-specific symbol is linked: the CPU module's own functions are
//!   reached through strata's C shim (ffi/shim/), which finds them in the
//!   module and calls them with their declared signatures.

mod arena;
mod backend;
mod binding;
mod buffer;
mod context;
mod error;
mod graph;
mod rows;
pub mod rpc;

pub use arena::{TensorArena, TensorSpec};
pub use backend::{
    cpu_device, devices, exit_on_fatal_errors, gpu_device, load_backends, remote_device, Backend,
    Device, Event, MAX_THREADS,
};
pub use binding::Binding;
pub use buffer::{Buffer, BufferType, BufferUsage};
pub use context::{Context, RopeParams, Tensor};
pub use error::{GgmlError, Result};
pub use graph::{Graph, GraphAllocator, NodeInfo};
pub use rows::{dequantize_row, row_size, version};
