//! strata: run Llama-family models whose weights do not fit in GPU memory by
//! paging layer groups through small per-group ggml graphs.
//!
//! Layout (docs/ARCHITECTURE.md is the map): [`sys`] (the raw bindings:
//! crate `strata-ffi` in ffi/, which builds the vendored ggml and
//! llama.cpp), [`dtype`] (the ggml tensor types), [`ggml`] (the safe layer
//! over them: handles with one owner each, tensor arenas), [`gguf`] (model
//! files), [`storage`] (the SSD tier's reads), [`model`] (architectures
//! and tensor tables), [`graph`] (graph builders), [`kv`] (KV cell bookkeeping), [`paging`] (placement and
//! slot residency), [`engine`] (the forward step), [`serve`] (the
//! OpenAI-compatible server), [`generate`] (the generation loop),
//! [`sample`] (sampling), [`speculative`] (drafting and verifying several
//! tokens per step), [`llama`] (llama.cpp's tokenizer and reference
//! decoder).
//!
//! Cargo features, both on by default: `convert` (the converter behind
//! `strata-convert`) and `reference` (llama.cpp's decoder as a reference:
//! `llama::Reference`, [`parity`], `strata check`, `bench --llama-ngl`).
//! Without them the library is the runtime alone.

pub use strata_ffi as sys;

pub mod dtype;

#[cfg(feature = "convert")]
pub mod convert;
pub mod engine;
pub mod generate;
pub mod ggml;
pub mod gguf;
pub mod graph;
pub mod kv;
pub mod llama;
pub mod model;
pub mod paging;
#[cfg(feature = "reference")]
pub mod parity;
pub mod round;
pub mod sample;
pub mod serve;
pub mod speculative;
pub mod storage;
