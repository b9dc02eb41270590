//! What the GEMM path of large steps computes (see `paging::gemm`), on the
//! CPU backend: a quantized weight dequantized, rounded to BF16 and
//! multiplied with activations rounded to BF16 (F32 accumulation), against
//! ggml's direct product of the quantized weight, which the CPU computes
//! as the GPU's quantized kernels do (activations quantized to 8 bits).
//! The two paths round differently; this pins how far apart they may be.

use strata::convert::quant;
use strata::dtype::GgmlType;
use strata::ggml::{self, Buffer, BufferUsage, Context, GraphAllocator};

/// A deterministic pseudo-random stream in [-1, 1).
fn noise(seed: u64, n: usize) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// Normalized squared error of `b` against `a`.
fn nmse(a: &[f32], b: &[f32]) -> f64 {
    let (mut e, mut s) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        e += (*x as f64 - *y as f64).powi(2);
        s += (*x as f64).powi(2);
    }
    e / s.max(f64::MIN_POSITIVE)
}

/// Both paths for a weight of `ty`, `k` inputs by `n` outputs, over `rows`
/// activation rows; returns (direct, dequantize + BF16 GEMM).
fn both_paths(ty: GgmlType, k: usize, n: usize, rows: usize) -> (Vec<f32>, Vec<f32>) {
    let cpu = ggml::cpu_device().expect("CPU device");
    let backend = cpu.init_backend().expect("CPU backend");
    let ctx = Context::new(16, 16).expect("context");
    let w = ctx.new_tensor(ty, &[k as i64, n as i64]);
    let ids = ctx.new_tensor(GgmlType::I32, &[n as i64]);
    let x = ctx.new_tensor(GgmlType::F32, &[k as i64, rows as i64]);
    let buft = cpu.buffer_type();
    let size = w.nbytes() + ids.nbytes() + x.nbytes() + 3 * buft.alignment();
    let buf = Buffer::alloc(buft, size, BufferUsage::Any).expect("input buffer");
    let mut off = 0;
    for t in [w, ids, x] {
        buf.place(t, off).expect("placed");
        off += t.nbytes().div_ceil(buft.alignment()) * buft.alignment();
    }
    let mut q = Vec::new();
    quant::from_f32(&noise(1, k * n), ty, k, 1, &mut q).expect("quantized");
    w.set_bytes(&q, 0).expect("weight");
    ids.set_i32(&(0..n as i32).collect::<Vec<_>>())
        .expect("ids");
    x.set_f32(&noise(2, k * rows)).expect("activations");

    let direct = ctx.mul_mat(w, x);
    // the GEMM path: every weight row dequantized to F32, then rounded to
    // BF16; the product converts the activations to BF16 as cuBLAS is fed
    let w32 = ctx.get_rows(w, ids);
    let w16 = ctx.cpy(w32, ctx.new_tensor(GgmlType::BF16, &[k as i64, n as i64]));
    let gemm = ctx.mul_mat(w16, x);
    let mut g = ctx.new_graph(16);
    g.expand(direct);
    g.expand(gemm);
    let mut alloc = GraphAllocator::new(buft).expect("allocator");
    alloc.alloc(&g).expect("allocated");
    backend.compute(&g).expect("computed");
    let mut a = vec![0f32; n * rows];
    let mut b = vec![0f32; n * rows];
    direct.get_f32(&mut a).expect("direct");
    gemm.get_f32(&mut b).expect("gemm");
    (a, b)
}

#[test]
fn dequantize_then_bf16_gemm_matches_the_quantized_product() {
    // the layers' weight types, at a width where a row's rounding averages
    for ty in [
        GgmlType::Q4_0,
        GgmlType::Q4_K,
        GgmlType::Q6_K,
        GgmlType::Q8_0,
    ] {
        let (a, b) = both_paths(ty, 1024, 96, 40);
        let e = nmse(&a, &b);
        eprintln!("{}: NMSE {e:.2e}", ty.name());
        // BF16 keeps 8 bits of mantissa: about 1e-5 of squared error per
        // rounded operand; the direct path's 8-bit activations add a few
        // 1e-5; the CUDA-vs-CPU bound the parity checks use is 5e-4
        assert!(e < 2e-4, "{}: NMSE {e:.2e}", ty.name());
        assert!(e > 0.0, "{}: the two paths cannot round alike", ty.name());
    }
}

#[test]
fn a_wrong_weight_is_caught() {
    // the same comparison notices a product of the wrong weight: the
    // bound above is not loose enough to pass anything
    let (a, _) = both_paths(GgmlType::Q4_0, 512, 32, 8);
    let (b, _) = both_paths(GgmlType::Q8_0, 512, 32, 8);
    let e = nmse(&a, &b);
    assert!(e > 2e-4, "NMSE {e:.2e}");
}
