//! The routed experts of a mixture-of-experts FFN (Mixtral-style `llama`
//! files, Qwen3-MoE): llama.cpp's `build_moe_ffn` (src/llama-graph.cpp)
//! for softmax gating, in its order, so that ggml-cuda's fused top-k-MoE
//! kernel sees the nodes it fuses and both engines round alike:
//!
//! 1. router logits `gate_inp · x`, softmax over the experts;
//! 2. the `n_expert_used` most probable experts (argsort, top k) and their
//!    probabilities, renormalized to sum 1 (clamped below at F16's
//!    smallest normal so a sum of zeros cannot divide by zero);
//! 3. each token through its experts only (`mul_mat_id`): SwiGLU of gate
//!    and up, then down;
//! 4. the experts' outputs weighted and summed.
//!
//! The router and every expert are one layer group: the engine pages it
//! like a dense FFN group (all experts move together), or, for steps of
//! many tokens, splits its experts between the device (the first ones,
//! uploaded) and the host CPU (the rest; see `paging::split`).

use super::shape::Dims;
use crate::ggml::{Context, Graph, Tensor};

/// The expert tensors of one FFN group.
pub struct Experts<'c> {
    /// [n_embd, n_expert]
    pub gate_inp: Tensor<'c>,
    /// [n_embd, n_ff_exp, n_expert]
    pub gate: Tensor<'c>,
    /// [n_embd, n_ff_exp, n_expert]
    pub up: Tensor<'c>,
    /// [n_ff_exp, n_embd, n_expert]
    pub down: Tensor<'c>,
}

/// The three expert tensors, all a product of picked rows reads.
#[derive(Clone, Copy)]
pub struct ExpertMats<'c> {
    pub gate: Tensor<'c>,
    pub up: Tensor<'c>,
    pub down: Tensor<'c>,
}

impl<'c> From<&Experts<'c>> for ExpertMats<'c> {
    fn from(w: &Experts<'c>) -> ExpertMats<'c> {
        ExpertMats {
            gate: w.gate,
            up: w.up,
            down: w.down,
        }
    }
}

/// The name of the router's picks the host reads, I32 [n_used, n_tokens]
/// (a copy `route` keeps).
pub const ROUTED: &str = "ffn_moe_picks";

/// F16's smallest normal value: the floor of the routing weights' sum.
const WEIGHT_SUM_MIN: f32 = 6.103_515_6e-5;

/// The router's picks for `cur`, the FFN-normed rows F32 [n_embd,
/// n_tokens]: I32 [n_used, n_tokens] (a view of the full argsort) and their
/// renormalized weights F32 [1, n_used, n_tokens]. `keep`: copies of the
/// picks ([`ROUTED`]) and of their weights ([`WEIGHTS`]) stay readable
/// after the compute.
///
/// The copies come after the routing and read only its two results:
/// ggml-cuda fuses the routing into one top-k-MoE kernel, as in llama.cpp's
/// graphs, only where no node inside it is a graph output or read outside
/// it, and its separate kernels round differently (on the synthetic
/// Qwen3-30B-A3B shape the logits departed from llama.cpp's by NMSE 4-6e-3
/// with the routing's own nodes kept as outputs, runs 134-136). Two graphs
/// that route the same rows, kept or not, so run the same kernels and pick
/// alike, which routed uploads and the expert split rely on.
pub fn route<'c>(
    ctx: &'c Context,
    g: &mut Graph<'c>,
    d: &Dims,
    gate_inp: Tensor<'c>,
    cur: Tensor<'c>,
    keep: bool,
) -> (Tensor<'c>, Tensor<'c>) {
    let hp = &d.hp;
    let n = cur.ne()[1];
    let (n_exp, k) = (hp.n_expert as i64, hp.n_expert_used as i64);
    // F32 [n_expert, n_tokens]
    // kept apart (an output is never reused): ggml-cuda fuses the routing
    // below into one kernel only where its results do not overlap the
    // logits, which above 8 tokens depends on how the allocator happened
    // to reuse the logits' memory
    let logits = ctx
        .mul_mat(gate_inp, cur)
        .named("ffn_moe_logits")
        .as_output();
    let probs = ctx.soft_max(logits).named("ffn_moe_probs");
    // I32 [n_used, n_tokens]
    let selected = ctx.argsort_top_k(probs, k as i32).named("ffn_moe_topk");
    // F32 [1, n_used, n_tokens]: the chosen experts' probabilities
    let probs3 = ctx.reshape_3d(probs, 1, n_exp, n).named("ffn_moe_probs_3d");
    let weights = ctx.get_rows(probs3, selected).named("ffn_moe_weights");
    let weights = ctx.reshape_2d(weights, k, n).named("ffn_moe_weights_2d");
    let sum = ctx.sum_rows(weights).named("ffn_moe_weights_sum");
    let sum = ctx
        .clamp(sum, WEIGHT_SUM_MIN, f32::INFINITY)
        .named("ffn_moe_weights_sum_clamped");
    let weights = ctx.div(weights, sum).named("ffn_moe_weights_norm");
    let weights = ctx.reshape_3d(weights, 1, k, n).named("ffn_moe_weights_3d");
    // the routing first, as llama.cpp expands it, so the fused top-k-MoE
    // kernel can take it
    g.expand(weights);
    if keep {
        g.expand(ctx.cont(selected).named(ROUTED).as_output());
        let w = ctx
            .reshape_2d(weights, k, n)
            .named("ffn_moe_pick_weights_2d");
        g.expand(ctx.cont(w).named(WEIGHTS).as_output());
    }
    (selected, weights)
}

/// The name of the routing weights the host reads, F32 [n_used,
/// n_tokens] (a copy `route` keeps).
pub const WEIGHTS: &str = "ffn_moe_pick_weights";

/// The experts' combined output, F32 [n_embd, n_tokens], for `cur`, the
/// FFN-normed rows F32 [n_embd, n_tokens]. `split`: the device's side of
/// an expert split, whose slot holds zeros in place of the experts the
/// host computes (their picks add nothing here); its picks stay readable,
/// as the split's router graph's do, and both pick alike (see [`route`]).
pub fn moe_ffn<'c>(
    ctx: &'c Context,
    g: &mut Graph<'c>,
    d: &Dims,
    w: &Experts<'c>,
    cur: Tensor<'c>,
    split: bool,
) -> Tensor<'c> {
    let hp = &d.hp;
    let (e, n) = (hp.n_embd as i64, cur.ne()[1]);
    let k = hp.n_expert_used as i64;
    let (selected, weights) = route(ctx, g, d, w.gate_inp, cur, d.read_routing || split);

    // F32 [n_embd, 1, n_tokens]
    let cur = ctx.reshape_3d(cur, e, 1, n).named("ffn_moe_in");
    let experts = expert_products(ctx, &w.into(), cur, selected);
    let experts = ctx.mul(experts, weights).named("ffn_moe_weighted");
    g.expand(experts);

    // the views before the adds, as llama.cpp orders them
    let [_, nb1, nb2, _] = experts.nb();
    let views: Vec<Tensor<'c>> = (0..k as usize)
        .map(|i| {
            let v = ctx
                .view_2d(experts, e, n, nb2, i * nb1)
                .named("ffn_moe_expert");
            g.expand(v);
            v
        })
        .collect();
    let mut out = views[0];
    for &v in &views[1..] {
        out = ctx.add(out, v).named("ffn_moe_sum");
        g.expand(out);
    }
    if k == 1 {
        // a view of one expert is not contiguous
        out = ctx.cont(out);
    }
    out.named("ffn_moe_out")
}

/// Each row of `x` F32 [n_embd, 1 or n_used, rows] through the experts
/// `ids` I32 [n_used, rows] names: SwiGLU of gate and up, then down; F32
/// [n_embd, n_used, rows], unweighted.
pub fn expert_products<'c>(
    ctx: &'c Context,
    w: &ExpertMats<'c>,
    x: Tensor<'c>,
    ids: Tensor<'c>,
) -> Tensor<'c> {
    // F32 [n_ff_exp, n_used, rows]
    let up = ctx.mul_mat_id(w.up, x, ids).named("ffn_moe_up");
    let gate = ctx.mul_mat_id(w.gate, x, ids).named("ffn_moe_gate");
    let act = ctx.swiglu_split(gate, up).named("ffn_moe_swiglu");
    ctx.mul_mat_id(w.down, act, ids).named("ffn_moe_down")
}
