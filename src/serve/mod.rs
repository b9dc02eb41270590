//! `strata serve`: an OpenAI-compatible HTTP server over the paged engine.
pub mod batch;
