//! The shapes graphs are built for: a step's tokens and KV cells, the
//! limits persistent tensors are sized for, and the model's dimensions.

use crate::model::{Arch, Hparams};

/// The shape of one step: how many tokens, how many KV cells the attention
/// reads, and how many rows go on past the last layer's attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct StepShape {
    pub n_tokens: u32,
    pub n_kv: u32,
    /// Rows kept after the last layer's attention (== n_tokens when all).
    pub n_out: u32,
    /// Whether this attention group is the last layer's (selects rows).
    pub last_layer: bool,
    /// Whether this attention group's layer attends over a sliding window
    /// (its own mask and RoPE base; `Hparams::is_swa`).
    pub swa: bool,
    /// A mixture's FFN group split between the device and the host: the
    /// device's slot holds the first `dev_experts` experts and zeros in
    /// place of the others, whose picks the host computes (see
    /// `paging::split`); 0: no split.
    pub dev_experts: u32,
    /// A mixture's FFN group whose slot holds only the experts this
    /// step's tokens picked (`paging::routed`): its picks stay readable,
    /// as the router graph's before it do, and both pick alike
    /// (`graph::moe::route`).
    pub routed: bool,
    /// The first of the step's rows this graph computes: the row split
    /// computes a big step's groups in two halves of rows (`engine::rows`),
    /// each reading and writing its own rows of the residual stream and
    /// its tokens' positions, cells and mask rows. 0 for a whole step.
    pub row0: u32,
}

impl StepShape {
    /// The step's rows in two: the first `a` (0 < a < n_tokens), then the
    /// rest, each keeping all of its rows (not a last layer's).
    pub fn halves(self, a: u32) -> [StepShape; 2] {
        let b = self.n_tokens - a;
        [
            StepShape {
                n_tokens: a,
                n_out: a,
                ..self
            },
            StepShape {
                n_tokens: b,
                n_out: b,
                row0: self.row0 + a,
                ..self
            },
        ]
    }
}

/// What graph builders need to know about the model.
#[derive(Clone, Debug)]
pub struct Dims {
    pub arch: Arch,
    pub hp: Hparams,
    pub has_rope_freqs: bool,
    /// A mixture's router picks stay readable after its FFN graph (graph
    /// outputs), for expert statistics. Costs ggml-cuda's fused routing
    /// kernel (an output inside the routing cannot be fused away).
    pub read_routing: bool,
    /// A group graph writes its output alone to the residual stream's
    /// rows, not added to them: a device's share after the first in the
    /// row split (`ModelSpec::shard`), whose outputs the engine adds to
    /// the first device's.
    pub partial: bool,
}

/// Nodes a group graph may hold at most (llama.cpp uses far fewer per
/// layer; a mixture-of-experts FFN over several row chunks needs a few
/// hundred).
pub const GRAPH_NODES: usize = 1024;
