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
mod error;
pub mod hf;
mod input;
mod inspect;
pub mod layout;
mod output;
pub mod quant;
mod relayout;
pub mod synth;
pub mod synth_router;

pub use check::{check_layout, read_group_extents, GroupReport, LayoutReport};
pub use error::{ConvertError, Result};
pub use input::default_threads;
pub use inspect::inspect;
pub use layout::{
    Extent, Layout, Slot, KEY_ALIGNMENT, KEY_GROUP_OFFSETS, KEY_GROUP_SIZES, KEY_LAYOUT,
    LAYOUT_NAME, STRATA_ALIGNMENT,
};
pub use output::{write_model, OutTensor, OutputModel, TensorFill, WriteSummary};
pub use relayout::{convert_gguf, GgufOptions};
