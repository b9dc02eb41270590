//! The widening graph of the row split's halved steps
//! (`paging::gemm::Widened`): a group's quantized matrices copied into
//! BF16 placeholders (the engine binds them into its widened buffer), so
//! both halves of the step multiply 16-bit weights without dequantizing
//! each again. ggml's CUDA copy dequantizes with the converter its cuBLAS
//! path uses (vendor/patches/0005), so the halves' products are the
//! quantized products bit for bit.

use super::blocks::{weight_shape, Built, Externals};
use super::shape::Dims;
use crate::dtype::GgmlType;
use crate::ggml::Context;
use crate::model::Role;
use crate::paging::Limits;

/// `copy = matrix` for each of `matrices` (the group's weights the engine
/// widens, in signature order). The weight placeholders are the matrices
/// as they are, then their BF16 copies.
pub fn build_widen<'c>(
    ctx: &'c Context,
    d: &Dims,
    matrices: &[(Role, GgmlType)],
    lim: Limits,
) -> Built<'c> {
    assert!(!matrices.is_empty(), "a widening graph copies a matrix");
    let ext = Externals::new(ctx, d, lim, false);
    let mut g = ctx.new_graph(super::shape::GRAPH_NODES);
    let (mut weights, mut copies, mut out) = (Vec::new(), Vec::new(), None);
    for &(role, ty) in matrices {
        let ne = weight_shape(d, role);
        let w = ctx.new_tensor(ty, &ne).named(role.suffix());
        let copy = ctx.new_tensor(GgmlType::BF16, &ne).named("widened");
        let c = ctx.cpy(w, copy).named("widen");
        g.expand(c);
        weights.push(w);
        copies.push(copy);
        out = Some(c);
    }
    weights.extend(copies);
    Built {
        graph: g,
        ext,
        weights,
        kv: None,
        out: out.expect("asserted above"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::graph::GRAPH_NODES;
    use crate::model::Arch;

    #[test]
    fn one_copy_per_matrix_into_bf16() {
        let d = Dims {
            arch: Arch::Llama,
            hp: crate::paging::testutil::hparams_70b(),
            has_rope_freqs: false,
            read_routing: false,
            partial: false,
        };
        let ctx = Context::new(GRAPH_NODES + 64, GRAPH_NODES).unwrap();
        let m = [(Role::Gate, GgmlType::Q4_0), (Role::Down, GgmlType::Q4_0)];
        let lim = Limits {
            n_batch: 8,
            n_ctx: 256,
            ffn_rows: 8,
        };
        let b = build_widen(&ctx, &d, &m, lim);
        assert_eq!(b.weights.len(), 4);
        assert_eq!(b.graph.n_nodes(), 2);
        for (w, c) in b.weights[..2].iter().zip(&b.weights[2..]) {
            assert_eq!(w.ty(), GgmlType::Q4_0);
            assert_eq!(c.ty(), GgmlType::BF16);
            assert_eq!(w.ne(), c.ne());
        }
    }
}
