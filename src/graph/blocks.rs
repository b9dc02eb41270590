//! The blocks of a Llama-family layer: attention group, FFN group, head.

use super::moe::{moe_ffn, Experts};
use super::shape::Dims;
use super::shape::StepShape;
use crate::dtype::GgmlType;
use crate::ggml::{Context, Graph, RopeParams, Tensor, TensorSpec};
use crate::model::arch::Act;
use crate::model::Role;
use crate::paging::sizes;
use crate::paging::Limits;

/// Persistent tensors a group graph reads or writes, as placeholders in the
/// graph's context (bound once to the engine's persistent memory).
pub struct Externals<'c> {
    /// F32 [n_embd, n_batch]: the residual stream.
    pub x: Tensor<'c>,
    /// I32 [n_batch]: token positions.
    pub pos: Tensor<'c>,
    /// F16 [n_ctx * n_batch] (twice that with sliding-window layers): the
    /// KQ mask, packed as [n_kv, n_tokens], then the sliding-window
    /// layers' mask packed likewise right after it.
    pub mask: Tensor<'c>,
    /// I64 [n_batch]: KV cell of each token.
    pub kv_idx: Tensor<'c>,
    /// I32 [n_batch]: rows kept after the last layer's attention.
    pub out_ids: Tensor<'c>,
    /// F32 [n_rot/2]: llama3 rope frequency factors.
    pub rope_freqs: Option<Tensor<'c>>,
}

impl<'c> Externals<'c> {
    /// x, pos, mask, kv_idx and out_ids: the step's persistent tensors (the
    /// engine keeps them in one arena; rope_freqs is a weight).
    pub fn specs(d: &Dims, lim: Limits) -> [TensorSpec; 5] {
        let (b, e) = (lim.n_batch as i64, d.hp.n_embd as i64);
        [
            TensorSpec::new(GgmlType::F32, &[e, b]).named("x"),
            TensorSpec::new(GgmlType::I32, &[b]).named("inp_pos"),
            TensorSpec::new(GgmlType::F16, &[sizes::mask_elements(&d.hp, lim) as i64])
                .named("kq_mask"),
            TensorSpec::new(GgmlType::I64, &[b]).named("kv_idxs"),
            TensorSpec::new(GgmlType::I32, &[b]).named("out_ids"),
        ]
    }
    /// The externals of one graph; `rope`: whether it rotates positions
    /// (attention), so it needs the rope frequency factors where the model
    /// has them.
    pub fn new(ctx: &'c Context, d: &Dims, lim: Limits, rope: bool) -> Externals<'c> {
        let [x, pos, mask, kv_idx, out_ids] = Self::specs(d, lim).map(|s| {
            ctx.new_tensor(s.ty, &s.ne)
                .named(s.name.as_deref().unwrap_or_default())
        });
        Externals {
            x,
            pos,
            mask,
            kv_idx,
            out_ids,
            rope_freqs: (rope && d.has_rope_freqs).then(|| {
                ctx.new_tensor(GgmlType::F32, &[d.hp.n_rot as i64 / 2])
                    .named("rope_freqs")
            }),
        }
    }
    pub fn all(&self) -> Vec<Tensor<'c>> {
        let mut v = vec![self.x, self.pos, self.mask, self.kv_idx, self.out_ids];
        v.extend(self.rope_freqs);
        v
    }
}

/// A built group graph and the handles the engine binds.
pub struct Built<'c> {
    pub graph: Graph<'c>,
    pub ext: Externals<'c>,
    /// Weight placeholders in signature order.
    pub weights: Vec<Tensor<'c>>,
    /// K and V cache placeholders ([n_embd_kv, n_ctx] F16), attention only.
    pub kv: Option<(Tensor<'c>, Tensor<'c>)>,
    /// The result the engine reads (head: logits), or the final copy.
    pub out: Tensor<'c>,
}

/// The shape the architecture gives `role` (model/arch/).
pub(super) fn weight_shape(d: &Dims, role: Role) -> Vec<i64> {
    let x = d
        .arch
        .layer_tensors()
        .find(|t| t.role == role)
        .expect("a signature holds only the architecture's roles");
    x.shape.ne(&d.hp).into_iter().map(|n| n as i64).collect()
}

fn weights<'c>(ctx: &'c Context, d: &Dims, sig: &[(Role, GgmlType)]) -> Vec<Tensor<'c>> {
    sig.iter()
        .map(|&(role, ty)| {
            ctx.new_tensor(ty, &weight_shape(d, role))
                .named(role.suffix())
        })
        .collect()
}

fn find<'c>(sig: &[(Role, GgmlType)], w: &[Tensor<'c>], role: Role) -> Option<Tensor<'c>> {
    sig.iter().position(|&(r, _)| r == role).map(|i| w[i])
}

/// `x[:, :n]` of the residual stream.
fn rows<'c>(ctx: &'c Context, x: Tensor<'c>, n: u32) -> Tensor<'c> {
    rows_at(ctx, x, 0, n)
}

/// `x[:, r0..r0 + n]` of the residual stream.
fn rows_at<'c>(ctx: &'c Context, x: Tensor<'c>, r0: u32, n: u32) -> Tensor<'c> {
    let [e, ..] = x.ne();
    ctx.view_2d(x, e, n as i64, x.nb()[1], r0 as usize * x.nb()[1])
}

fn rms_norm<'c>(
    ctx: &'c Context,
    x: Tensor<'c>,
    w: Tensor<'c>,
    eps: f32,
    name: &str,
) -> Tensor<'c> {
    let n = ctx.rms_norm(x, eps).named("norm");
    ctx.mul(n, w).named(name)
}

/// RoPE of a layer: a sliding-window layer has its own base, unscaled
/// (llama.cpp's get_rope_freq_base/scale).
fn rope_params(d: &Dims, swa: bool) -> RopeParams {
    let (freq_base, freq_scale) = if swa {
        (d.hp.rope_freq_base_swa, 1.0)
    } else {
        (d.hp.rope_freq_base, d.hp.rope_freq_scale)
    };
    RopeParams {
        n_ctx_orig: d.hp.n_ctx_orig as i32,
        freq_base,
        freq_scale,
        ext_factor: 0.0,
        attn_factor: 1.0,
        beta_fast: 32.0,
        beta_slow: 1.0,
    }
}

/// Attention group: x += wo · attn(rope(wq·norm(x)), cache(rope(wk·…)), cache(wv·…)).
pub fn build_attn<'c>(
    ctx: &'c Context,
    d: &Dims,
    sig: &[(Role, GgmlType)],
    s: StepShape,
    lim: Limits,
) -> Built<'c> {
    let hp = &d.hp;
    let ext = Externals::new(ctx, d, lim, true);
    let w = weights(ctx, d, sig);
    let role = |r| find(sig, &w, r);
    let (hd, nh, nkv, n) = (
        hp.head_dim as i64,
        hp.n_head as i64,
        hp.n_head_kv as i64,
        s.n_tokens as i64,
    );
    let n_embd_kv = hp.n_embd_kv() as i64;
    let k_cache = ctx
        .new_tensor(GgmlType::F16, &[n_embd_kv, lim.n_ctx as i64])
        .named("cache_k");
    let v_cache = ctx
        .new_tensor(GgmlType::F16, &[n_embd_kv, lim.n_ctx as i64])
        .named("cache_v");
    let mut g = ctx.new_graph(super::shape::GRAPH_NODES);

    // the rows row0.. of the step: a sliding-window layer's mask lies
    // after the whole step's full-context mask, whose size a part of the
    // step does not know
    assert!(
        !(s.swa && s.row0 > 0),
        "a sliding-window layer's step is never cut into parts"
    );
    let r0 = s.row0 as usize;
    let x = rows_at(ctx, ext.x, s.row0, s.n_tokens).named("inp");
    let pos = ctx.view_1d(ext.pos, n, r0 * 4).named("pos");
    let kv_idx = ctx.view_1d(ext.kv_idx, n, r0 * 8).named("k_idxs");
    // F16 [n_kv, n_tokens]; a sliding-window layer's right after it
    let mask_at = if s.swa {
        s.n_kv as usize * n as usize * 2
    } else {
        r0 * s.n_kv as usize * 2
    };
    let mask = ctx
        .view_2d(ext.mask, s.n_kv as i64, n, s.n_kv as usize * 2, mask_at)
        .named(if s.swa {
            "kq_mask_swa_view"
        } else {
            "kq_mask_view"
        });
    // the step's inputs first, as llama.cpp's graph has them (inputs, not
    // nodes between the ops): ggml-cuda fuses RMS_NORM, MUL, ROPE (and the
    // KV store after it) only where they are adjacent in the graph, and the
    // fused kernels round as llama.cpp's computation does
    g.expand(pos);
    g.expand(kv_idx);
    g.expand(mask);

    let cur = rms_norm(
        ctx,
        x,
        role(Role::AttnNorm).expect("attn_norm"),
        hp.rms_eps,
        "attn_norm",
    );
    // projection, bias if the file has one, heads; a per-head RMS norm
    // where the architecture has one (Qwen3's Q and K), before RoPE
    let proj = |wr: Role, br: Role, nr: Option<Role>, heads: i64, name: &str| {
        let mut t = ctx
            .mul_mat(role(wr).expect("projection weight"), cur)
            .named(name);
        if let Some(b) = role(br) {
            t = ctx.add(t, b).named(name);
        }
        let t = ctx.reshape_3d(t, hd, heads, n).named(name);
        match nr.and_then(role) {
            Some(w) => rms_norm(ctx, t, w, hp.rms_eps, &format!("{name}_normed")),
            None => t,
        }
    };
    let q = proj(Role::Wq, Role::Bq, Some(Role::QNorm), nh, "Qcur");
    let k = proj(Role::Wk, Role::Bk, Some(Role::KNorm), nkv, "Kcur");
    let v = proj(Role::Wv, Role::Bv, None, nkv, "Vcur");
    let rp = rope_params(d, s.swa);
    let mode = d.arch.rope_mode();
    let mut q = ctx
        .rope_ext(q, pos, ext.rope_freqs, hp.n_rot as i32, mode, &rp)
        .named("Qcur_rope");
    if hp.q_scale != 1.0 {
        // Gemma 3: Q scaled here, attention then scales by kq_scale = 1
        q = ctx.scale(q, hp.q_scale).named("Qcur_scaled");
    }
    let k = ctx
        .rope_ext(k, pos, ext.rope_freqs, hp.n_rot as i32, mode, &rp)
        .named("Kcur_rope");
    g.expand(q);
    g.expand(v);
    g.expand(k);

    // store the new K/V rows into the cache (before the cache is read)
    let k2 = ctx.view_2d(k, n_embd_kv, n, k.nb()[2], 0).named("k_rows");
    g.expand(ctx.set_rows(k_cache, k2, kv_idx).named("k_store"));
    let v2 = ctx.view_2d(v, n_embd_kv, n, v.nb()[2], 0).named("v_rows");
    g.expand(ctx.set_rows(v_cache, v2, kv_idx).named("v_store"));

    // F16 [hd, n_head_kv, n_kv] views of the cache
    let row = crate::ggml::row_size(GgmlType::F16, hd);
    let row_kv = crate::ggml::row_size(GgmlType::F16, n_embd_kv);
    let kview = ctx
        .view_3d(k_cache, [hd, nkv, s.n_kv as i64], row, row_kv, 0)
        .named("k_view");
    let vview = ctx
        .view_3d(v_cache, [hd, nkv, s.n_kv as i64], row, row_kv, 0)
        .named("v_view");

    let q = ctx.permute(q, [0, 2, 1, 3]).named("q_perm");
    let kp = ctx.permute(kview, [0, 2, 1, 3]).named("k_perm");
    let vp = ctx.permute(vview, [0, 2, 1, 3]).named("v_perm");
    let fa = ctx
        .flash_attn_ext(q, kp, vp, mask, hp.kq_scale)
        .named("fattn");
    let [a0, a1, a2, a3] = fa.ne();
    let attn = ctx.reshape_2d(fa, a0 * a1, a2 * a3).named("kqv_out");
    let mut cur = ctx
        .mul_mat(role(Role::Wo).expect("attn_output"), attn)
        .named("attn_out");
    if let Some(b) = role(Role::Bo) {
        cur = ctx.add(cur, b).named("attn_out");
    }
    let mut inp_sa = x;
    let mut n_rows = s.n_tokens;
    if s.last_layer {
        assert_eq!(s.row0, 0, "the last layer's step is never cut into parts");
        let ids = ctx
            .view_1d(ext.out_ids, s.n_out as i64, 0)
            .named("out_ids_view");
        cur = ctx.get_rows(cur, ids).named("attn_out_sel");
        inp_sa = ctx.get_rows(x, ids).named("inp_sel");
        n_rows = s.n_out;
    }
    if let Some(w) = role(Role::AttnPostNorm) {
        cur = rms_norm(ctx, cur, w, hp.rms_eps, "attn_post_norm");
    }
    let out = if d.partial || s.last_layer {
        let res = if d.partial {
            cur
        } else {
            ctx.add(cur, inp_sa).named("ffn_inp")
        };
        ctx.cpy(res, rows_at(ctx, ext.x, s.row0, n_rows).named("x_out"))
            .named("x_store")
    } else {
        residual_add(ctx, x, cur)
    };
    g.expand(out);
    Built {
        graph: g,
        ext,
        weights: w,
        kv: Some((k_cache, v_cache)),
        out,
    }
}

/// FFN group: x += down · swiglu(gate·norm(x), up·norm(x)), or for a
/// mixture of experts the routed experts' weighted sum (graph/moe.rs).
pub fn build_ffn<'c>(
    ctx: &'c Context,
    d: &Dims,
    sig: &[(Role, GgmlType)],
    s: StepShape,
    lim: Limits,
) -> Built<'c> {
    let ext = Externals::new(ctx, d, lim, false);
    let w = weights(ctx, d, sig);
    let role = |r| find(sig, &w, r).expect("ffn weight");
    // a mixture of experts where the group has a router
    let experts = find(sig, &w, Role::GateInp).map(|gate_inp| Experts {
        gate_inp,
        gate: role(Role::GateExps),
        up: role(Role::UpExps),
        down: role(Role::DownExps),
    });
    let mut g = ctx.new_graph(super::shape::GRAPH_NODES);
    // chunks of at most lim.ffn_rows rows, in order: each reads and writes
    // only its own rows, and the allocator reuses one chunk's memory for
    // the next; the step is cut into chunks of nearly equal size, in
    // multiples of 32 rows (the GEMM kernels' tile) where the limit allows
    // (2048 rows at most 672: four of 512, not three of 672 and 32)
    let n_rows = s.n_tokens.max(1);
    let most = lim.ffn_rows.clamp(1, n_rows);
    let chunk = n_rows
        .div_ceil(n_rows.div_ceil(most))
        .next_multiple_of(32)
        .min(most);
    let mut out = None;
    for r0 in (0..s.n_tokens).step_by(chunk as usize) {
        let n = chunk.min(s.n_tokens - r0);
        let x = rows_at(ctx, ext.x, s.row0 + r0, n).named("ffn_in");
        let cur = rms_norm(ctx, x, role(Role::FfnNorm), d.hp.rms_eps, "ffn_norm");
        let down = match &experts {
            Some(ex) => moe_ffn(ctx, &mut g, d, ex, cur, s.dev_experts > 0 || s.routed),
            None => {
                let up = ctx.mul_mat(role(Role::Up), cur).named("ffn_up");
                let gate = ctx.mul_mat(role(Role::Gate), cur).named("ffn_gate");
                let act = match d.arch.spec().ffn_act {
                    Act::Silu => ctx.swiglu_split(gate, up).named("ffn_swiglu"),
                    Act::GeluTanh => ctx.geglu_split(gate, up).named("ffn_geglu"),
                };
                ctx.mul_mat(role(Role::Down), act).named("ffn_down")
            }
        };
        let down = match find(sig, &w, Role::FfnPostNorm) {
            Some(pn) => rms_norm(ctx, down, pn, d.hp.rms_eps, "ffn_post_norm"),
            None => down,
        };
        let o = if d.partial {
            ctx.cpy(down, rows_at(ctx, ext.x, s.row0 + r0, n).named("x_out"))
                .named("x_store")
        } else {
            residual_add(ctx, x, down)
        };
        g.expand(o);
        out = Some(o);
    }
    let out = out.expect("a step has at least one row");
    Built {
        graph: g,
        ext,
        weights: w,
        kv: None,
        out,
    }
}

/// The experts of a mixture's FFN group, from its signature's weights.
fn experts_of<'c>(sig: &[(Role, GgmlType)], w: &[Tensor<'c>]) -> Option<Experts<'c>> {
    let role = |r| find(sig, w, r);
    Some(Experts {
        gate_inp: role(Role::GateInp)?,
        gate: role(Role::GateExps)?,
        up: role(Role::UpExps)?,
        down: role(Role::DownExps)?,
    })
}

/// A mixture's router over the first `n` rows of the residual stream, as
/// its FFN graph routes them: the FFN-normed rows F32 [n_embd, n] (named
/// [`ROUTER_IN`]), the picks and their weights, all readable after the
/// compute. Weights as the FFN group's signature (only the norm and the
/// router are read), so it binds the same memory.
pub fn build_router<'c>(
    ctx: &'c Context,
    d: &Dims,
    sig: &[(Role, GgmlType)],
    n: u32,
    lim: Limits,
) -> Built<'c> {
    let ext = Externals::new(ctx, d, lim, false);
    let w = weights(ctx, d, sig);
    let ex = experts_of(sig, &w).expect("a router needs a mixture's FFN group");
    let norm = find(sig, &w, Role::FfnNorm).expect("ffn norm");
    let mut g = ctx.new_graph(super::shape::GRAPH_NODES);
    let x = rows(ctx, ext.x, n).named("ffn_in");
    let cur = rms_norm(ctx, x, norm, d.hp.rms_eps, "ffn_norm")
        .named(ROUTER_IN)
        .as_output();
    g.expand(cur);
    let (_, weights) = super::moe::route(ctx, &mut g, d, ex.gate_inp, cur, true);
    // a node after the routing: ggml-cuda's check for its fused top-k-MoE
    // kernel reads the node after the weights' reshape without looking for
    // the graph's end (a graph ending there crashed on the H200)
    let out = ctx.cont(weights).named("ffn_moe_router_out");
    g.expand(out);
    Built {
        graph: g,
        ext,
        weights: w,
        kv: None,
        out,
    }
}

/// The name of a router graph's normed rows.
pub const ROUTER_IN: &str = "ffn_moe_router_in";

/// The host's part of an expert split, or the device's hot experts:
/// `picks` rows, each one token's row through one expert, F32 [n_embd, 1,
/// picks] in and out (unweighted). Weights: `sig` (the FFN group's
/// signature, or only its expert tensors), then the two inputs, rows F32
/// [n_embd, 1, picks] and expert ids I32 [1, picks].
pub fn build_host_experts<'c>(
    ctx: &'c Context,
    d: &Dims,
    sig: &[(Role, GgmlType)],
    picks: u32,
    lim: Limits,
) -> Built<'c> {
    let ext = Externals::new(ctx, d, lim, false);
    let mut w = weights(ctx, d, sig);
    let mats = |r| find(sig, &w, r).expect("expert rows need a mixture's expert tensors");
    let ex = super::moe::ExpertMats {
        gate: mats(Role::GateExps),
        up: mats(Role::UpExps),
        down: mats(Role::DownExps),
    };
    let e = d.hp.n_embd as i64;
    let x = ctx
        .new_tensor(GgmlType::F32, &[e, 1, picks as i64])
        .named("ffn_moe_picks_in");
    let ids = ctx
        .new_tensor(GgmlType::I32, &[1, picks as i64])
        .named("ffn_moe_picks_ids");
    let mut g = ctx.new_graph(super::shape::GRAPH_NODES);
    let out = super::moe::expert_products(ctx, &ex, x, ids).as_output();
    g.expand(out);
    w.push(x);
    w.push(ids);
    Built {
        graph: g,
        ext,
        weights: w,
        kv: None,
        out,
    }
}

/// A group's output `f` added to the residual rows `x` it read, written
/// over them: one kernel where an add into a new tensor and a copy back
/// took two (the row split's first GPU, which adds the residual, spent
/// about 0.04 ms more on each 1024-row graph of an 8192-wide model than
/// the second, which only copies its output: two H200s, run 110).
/// `x + f` is llama.cpp's `f + x`: the sum is the same.
fn residual_add<'c>(ctx: &'c Context, x: Tensor<'c>, f: Tensor<'c>) -> Tensor<'c> {
    ctx.add_inplace(x, f).named("x_store")
}

/// `x[:, r] += y[:, r]` over rows `r = row0..row0 + n`, for `y` F32
/// [n_embd, n_batch] (the only weight): the host's experts, or another
/// device's share of the row split, added to the residual stream.
pub fn build_add_rows<'c>(ctx: &'c Context, d: &Dims, n: u32, row0: u32, lim: Limits) -> Built<'c> {
    let ext = Externals::new(ctx, d, lim, false);
    let y = ctx
        .new_tensor(GgmlType::F32, &[d.hp.n_embd as i64, lim.n_batch as i64])
        .named("host_rows");
    let mut g = ctx.new_graph(super::shape::GRAPH_NODES);
    let x = rows_at(ctx, ext.x, row0, n).named("add_in");
    let out = residual_add(ctx, x, rows_at(ctx, y, row0, n));
    g.expand(out);
    Built {
        graph: g,
        ext,
        weights: vec![y],
        kv: None,
        out,
    }
}

/// Output head on rows `row0..row0 + n_tokens`: logits = output · norm(x).
/// The engine runs it over at most [`HEAD_ROWS`](crate::paging::sizes::HEAD_ROWS) rows at a time, so the
/// logits' activation memory stays bounded whatever the step size.
pub fn build_head<'c>(
    ctx: &'c Context,
    d: &Dims,
    out_ty: GgmlType,
    s: StepShape,
    row0: u32,
    lim: Limits,
) -> Built<'c> {
    let ext = Externals::new(ctx, d, lim, false);
    let (e, v) = (d.hp.n_embd as i64, d.hp.n_vocab as i64);
    let norm_w = ctx
        .new_tensor(GgmlType::F32, &[e])
        .named("output_norm.weight");
    let out_w = ctx.new_tensor(out_ty, &[e, v]).named("output.weight");
    let mut g = ctx.new_graph(super::shape::GRAPH_NODES);
    let x = rows_at(ctx, ext.x, row0, s.n_tokens).named("head_in");
    let cur = rms_norm(ctx, x, norm_w, d.hp.rms_eps, "result_norm");
    let logits = ctx.mul_mat(out_w, cur).named("result_output").as_output();
    g.expand(logits);
    Built {
        graph: g,
        ext,
        weights: vec![norm_w, out_w],
        kv: None,
        out: logits,
    }
}
