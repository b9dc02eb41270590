//! Graph builders for each group kind (attention, FFN, output head),
//! following llama.cpp's order and constants (`src/models/llama.cpp`,
//! `src/models/qwen2.cpp`, `build_attn`/`build_ffn` in `src/llama-graph.cpp`).
//!
//! A template's weight tensors (and, for attention, the layer's K/V cache
//! tensors) are placeholders: the engine points them at whichever layer's
//! memory it runs ([`Template::bind`]), so a template can serve any layer
//! with the same tensor types (the engine keeps one per layer group and
//! step shape, so its pointers stay the same from step to step and CUDA
//! graphs replay). Step inputs (positions, mask, KV row indices,
//! output row ids) and the residual stream are persistent tensors that the
//! graph views at the step's shape. Every node is named, without the layer
//! index, so [`crate::ggml::Graph::snapshot`] prints a layer-independent layout.

mod blocks;
mod moe;
mod shape;
mod template;
mod widen;

pub use crate::paging::sizes::HEAD_ROWS;
pub use crate::paging::Limits;
pub use blocks::{
    build_add_rows, build_attn, build_ffn, build_head, build_host_experts, build_router, Built,
    Externals, ROUTER_IN,
};
pub use moe::{ROUTED, WEIGHTS};
pub use shape::{Dims, StepShape, GRAPH_NODES};
pub use template::{BindId, Binding, NodeRead, Template, TemplateKey};
pub use widen::build_widen;
