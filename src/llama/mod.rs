//! llama.cpp through libllama: the tokenizer and chat templates (a
//! vocabulary-only model load), its grammar sampler (GBNF constraints on
//! strata's sampler), and the reference decoder that parity tests and
//! `strata bench` compare against.

#[cfg(feature = "reference")]
mod fill;
mod grammar;
mod model;
#[cfg(feature = "reference")]
mod quantize;
#[cfg(feature = "reference")]
mod reference;
mod schema;
pub use grammar::{GrammarError, GrammarSampler, JSON_GBNF};
pub use model::{builtin_chat_template, CpuExperts, LlamaError, LlamaModel, LoadOptions};
#[cfg(feature = "reference")]
pub use quantize::quantize_reference;
#[cfg(feature = "reference")]
pub use reference::{Reference, ReferenceConfig};
pub use schema::{json_schema_to_gbnf, MAX_GRAMMAR_BYTES};
