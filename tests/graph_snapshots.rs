//! Graph layouts pinned as (name, op, type, shape) per node, in order.
//! Built without weights or a backend, so they run anywhere; the snapshot
//! files live in graphs/.

use strata::ggml::Context;
use strata::gguf::GgmlType;
use strata::graph::{
    build_add_rows, build_attn, build_ffn, build_head, build_host_experts, build_router,
    build_widen, Dims, Limits, StepShape,
};
use strata::model::{Arch, Hparams, Role};

fn dims(arch: Arch) -> Dims {
    // SmolLM2-135M-like (llama), Qwen2.5-0.5B-like (qwen2) and
    // Qwen3-0.6B-like (qwen3: head_dim 128 with n_embd / n_head 64) shapes
    let hp = match arch {
        Arch::Llama => Hparams {
            n_vocab: 49152,
            n_ctx_train: 8192,
            n_embd: 576,
            n_layer: 30,
            n_ff: 1536,
            n_head: 9,
            n_head_kv: 3,
            head_dim: 64,
            n_rot: 64,
            rms_eps: 1e-5,
            rope_freq_base: 100000.0,
            rope_freq_scale: 1.0,
            n_ctx_orig: 8192,
            kq_scale: 0.125,
            n_swa: 0,
            swa_pattern: 1,
            rope_freq_base_swa: 10000.0,
            q_scale: 1.0,
            embd_scale: 1.0,
            n_expert: 0,
            n_expert_used: 0,
            n_ff_exp: 0,
            layer0: 0,
        },
        Arch::Qwen2 => Hparams {
            n_vocab: 151936,
            n_ctx_train: 32768,
            n_embd: 896,
            n_layer: 24,
            n_ff: 4864,
            n_head: 14,
            n_head_kv: 2,
            head_dim: 64,
            n_rot: 64,
            rms_eps: 1e-6,
            rope_freq_base: 1000000.0,
            rope_freq_scale: 1.0,
            n_ctx_orig: 32768,
            kq_scale: 0.125,
            n_swa: 0,
            swa_pattern: 1,
            rope_freq_base_swa: 10000.0,
            q_scale: 1.0,
            embd_scale: 1.0,
            n_expert: 0,
            n_expert_used: 0,
            n_ff_exp: 0,
            layer0: 0,
        },
        Arch::Qwen3 => Hparams {
            n_vocab: 151936,
            n_ctx_train: 40960,
            n_embd: 1024,
            n_layer: 28,
            n_ff: 3072,
            n_head: 16,
            n_head_kv: 8,
            head_dim: 128,
            n_rot: 128,
            rms_eps: 1e-6,
            rope_freq_base: 1000000.0,
            rope_freq_scale: 1.0,
            n_ctx_orig: 40960,
            kq_scale: 1.0 / (128f32).sqrt(),
            n_swa: 0,
            swa_pattern: 1,
            rope_freq_base_swa: 10000.0,
            q_scale: 1.0,
            embd_scale: 1.0,
            n_expert: 0,
            n_expert_used: 0,
            n_ff_exp: 0,
            layer0: 0,
        },
        // Qwen3-30B-A3B-like: 128 experts of width 768, 8 used
        Arch::Qwen3Moe => Hparams {
            n_vocab: 151936,
            n_ctx_train: 40960,
            n_embd: 2048,
            n_layer: 48,
            n_ff: 6144,
            n_head: 32,
            n_head_kv: 4,
            head_dim: 128,
            n_rot: 128,
            rms_eps: 1e-6,
            rope_freq_base: 1000000.0,
            rope_freq_scale: 1.0,
            n_ctx_orig: 40960,
            kq_scale: 1.0 / (128f32).sqrt(),
            n_swa: 0,
            swa_pattern: 1,
            rope_freq_base_swa: 10000.0,
            q_scale: 1.0,
            embd_scale: 1.0,
            n_expert: 128,
            n_expert_used: 8,
            n_ff_exp: 768,
            layer0: 0,
        },
        // Gemma 3 270M: head_dim 256 over 4 heads of a 640-wide stream,
        // sliding windows of 512 on five of every six layers
        Arch::Gemma3 => Hparams {
            n_vocab: 262144,
            n_ctx_train: 32768,
            n_embd: 640,
            n_layer: 18,
            n_ff: 2048,
            n_head: 4,
            n_head_kv: 1,
            head_dim: 256,
            n_rot: 256,
            rms_eps: 1e-6,
            rope_freq_base: 1000000.0,
            rope_freq_scale: 1.0,
            n_ctx_orig: 32768,
            kq_scale: 1.0,
            n_swa: 512,
            swa_pattern: 6,
            rope_freq_base_swa: 10000.0,
            q_scale: 1.0 / 16.0,
            embd_scale: (640f32).sqrt(),
            n_expert: 0,
            n_expert_used: 0,
            n_ff_exp: 0,
            layer0: 0,
        },
    };
    Dims {
        arch,
        hp,
        has_rope_freqs: false,
        read_routing: false,
        partial: false,
    }
}

/// A Mixtral-8x7B-like `llama` file: 8 experts of width 14336, 2 used.
fn mixtral_dims() -> Dims {
    let mut d = dims(Arch::Llama);
    d.hp = Hparams {
        n_embd: 4096,
        n_ff: 14336,
        n_head: 32,
        n_head_kv: 8,
        head_dim: 128,
        n_rot: 128,
        n_swa: 0,
        swa_pattern: 1,
        rope_freq_base_swa: 10000.0,
        q_scale: 1.0,
        embd_scale: 1.0,
        n_expert: 8,
        n_expert_used: 2,
        n_ff_exp: 14336,
        layer0: 0,
        ..d.hp
    };
    d
}

/// The FFN of a mixture of experts: the router F32 (as llama.cpp keeps
/// it), the experts Q4_K with down Q6_K.
fn moe_sig() -> Vec<(Role, GgmlType)> {
    vec![
        (Role::FfnNorm, GgmlType::F32),
        (Role::GateInp, GgmlType::F32),
        (Role::GateExps, GgmlType::Q4_K),
        (Role::UpExps, GgmlType::Q4_K),
        (Role::DownExps, GgmlType::Q6_K),
    ]
}

/// The architecture's required attention tensors (model/arch/): matrices
/// Q4_K, V Q6_K (as llama.cpp's Q4_K_M), norms and biases F32.
fn attn_sig(arch: Arch) -> Vec<(Role, GgmlType)> {
    arch.spec()
        .attn
        .iter()
        .filter(|t| t.need == strata::model::arch::Need::Required)
        .map(|t| {
            let ty = match t.role {
                r if r.is_norm_or_bias() => GgmlType::F32,
                Role::Wv => GgmlType::Q6_K,
                _ => GgmlType::Q4_K,
            };
            (t.role, ty)
        })
        .collect()
}

/// The architecture's dense FFN: norms F32, matrices Q4_K, down Q6_K.
fn ffn_sig_of(arch: Arch) -> Vec<(Role, GgmlType)> {
    arch.spec()
        .ffn
        .iter()
        .map(|t| {
            let ty = match t.role {
                r if r.is_norm_or_bias() => GgmlType::F32,
                Role::Down => GgmlType::Q6_K,
                _ => GgmlType::Q4_K,
            };
            (t.role, ty)
        })
        .collect()
}

fn ffn_sig() -> Vec<(Role, GgmlType)> {
    vec![
        (Role::FfnNorm, GgmlType::F32),
        (Role::Gate, GgmlType::Q4_K),
        (Role::Up, GgmlType::Q4_K),
        (Role::Down, GgmlType::Q6_K),
    ]
}

const LIM: Limits = Limits {
    ffn_rows: 64,
    n_batch: 512,
    n_ctx: 4096,
};

fn layout(arch: Arch, kind: &str, s: StepShape) -> String {
    let d = match kind {
        "mixtral_ffn" => mixtral_dims(),
        _ => dims(arch),
    };
    let ctx = Context::new(1024, 1024).expect("context");
    let b = match kind {
        "moe_ffn" | "mixtral_ffn" => build_ffn(&ctx, &d, &moe_sig(), s, LIM),
        // an expert split: the router alone, the device's first experts,
        // the host's picks, the host's rows added
        "moe_router" => build_router(&ctx, &d, &moe_sig(), s.n_tokens, LIM),
        "moe_host_experts" => build_host_experts(&ctx, &d, &moe_sig(), 32, LIM),
        "add_rows" => build_add_rows(&ctx, &d, s.n_tokens, s.row0, LIM),
        "arch_ffn" => build_ffn(&ctx, &d, &ffn_sig_of(arch), s, LIM),
        // two chunks of four rows: the routing and experts once per chunk
        "moe_ffn_chunked" => build_ffn(&ctx, &d, &moe_sig(), s, Limits { ffn_rows: 4, ..LIM }),
        "attn" => build_attn(&ctx, &d, &attn_sig(arch), s, LIM),
        "ffn" => build_ffn(&ctx, &d, &ffn_sig(), s, LIM),
        // a step larger than ffn_rows: the FFN over chunks of rows
        "ffn_chunked" => build_ffn(&ctx, &d, &ffn_sig(), s, Limits { ffn_rows: 4, ..LIM }),
        // a step of the size that multiplies through 16-bit GEMM on a GPU
        // (paging::gemm): the same nodes, every weight product asking for
        // BF16 with F32 accumulation
        "ffn_big" => build_ffn(
            &ctx,
            &d,
            &ffn_sig(),
            s,
            Limits {
                ffn_rows: 512,
                ..LIM
            },
        ),
        // the row split's halves (engine/widen.rs): the FFN's quantized
        // matrices copied into BF16 once, then each half multiplying the
        // copies
        "widen" => build_widen(&ctx, &d, &ffn_sig()[1..], LIM),
        "ffn_widened" => {
            let sig: Vec<_> = ffn_sig()
                .into_iter()
                .map(|(r, t)| match t {
                    GgmlType::F32 => (r, t),
                    _ => (r, GgmlType::BF16),
                })
                .collect();
            build_ffn(
                &ctx,
                &d,
                &sig,
                s,
                Limits {
                    ffn_rows: 512,
                    ..LIM
                },
            )
        }
        _ => build_head(&ctx, &d, GgmlType::Q8_0, s, 0, LIM),
    };
    b.graph
        .snapshot()
        .iter()
        .map(|n| n.to_string())
        .collect::<Vec<_>>()
        .join("\n")
}

fn check(arch: Arch, kind: &str, label: &str, s: StepShape) {
    let name = format!("{}_{kind}_{label}", arch.name());
    insta::with_settings!({ snapshot_path => "../graphs", prepend_module_to_snapshot => false, omit_expression => true }, {
        insta::assert_snapshot!(name, layout(arch, kind, s));
    });
}

const PREFILL: StepShape = StepShape {
    n_tokens: 7,
    n_kv: 256,
    n_out: 7,
    last_layer: false,
    swa: false,
    dev_experts: 0,
    routed: false,
    row0: 0,
};
const DECODE: StepShape = StepShape {
    n_tokens: 1,
    n_kv: 256,
    n_out: 1,
    last_layer: false,
    swa: false,
    dev_experts: 0,
    routed: false,
    row0: 0,
};
const BIG: StepShape = StepShape {
    n_tokens: 512,
    n_kv: 512,
    n_out: 1,
    last_layer: false,
    swa: false,
    dev_experts: 0,
    routed: false,
    row0: 0,
};
const LAST: StepShape = StepShape {
    n_tokens: 7,
    n_kv: 256,
    n_out: 1,
    last_layer: true,
    swa: false,
    dev_experts: 0,
    routed: false,
    row0: 0,
};

#[test]
fn llama_layouts() {
    for (label, s) in [("prefill", PREFILL), ("decode", DECODE)] {
        check(Arch::Llama, "attn", label, s);
        check(Arch::Llama, "ffn", label, s);
        check(Arch::Llama, "head", label, s);
    }
    check(Arch::Llama, "attn", "prefill_last_layer", LAST);
    check(Arch::Llama, "ffn_chunked", "prefill", PREFILL);
    check(Arch::Llama, "ffn_big", "step", BIG);
    check(Arch::Llama, "widen", "step", BIG);
    check(Arch::Llama, "ffn_widened", "step", BIG);
}

#[test]
fn qwen2_layouts() {
    for (label, s) in [("prefill", PREFILL), ("decode", DECODE)] {
        check(Arch::Qwen2, "attn", label, s);
        check(Arch::Qwen2, "ffn", label, s);
        check(Arch::Qwen2, "head", label, s);
    }
    check(Arch::Qwen2, "attn", "prefill_last_layer", LAST);
}

#[test]
fn qwen3_layouts() {
    for (label, s) in [("prefill", PREFILL), ("decode", DECODE)] {
        check(Arch::Qwen3, "attn", label, s);
        check(Arch::Qwen3, "ffn", label, s);
    }
}

#[test]
fn qwen3moe_layouts() {
    for (label, s) in [("prefill", PREFILL), ("decode", DECODE)] {
        check(Arch::Qwen3Moe, "attn", label, s);
        check(Arch::Qwen3Moe, "moe_ffn", label, s);
    }
    check(Arch::Qwen3Moe, "moe_ffn_chunked", "prefill", PREFILL);
    // an expert split: the device holds the first 48 of 128 experts
    let split = StepShape {
        dev_experts: 48,
        routed: false,
        ..PREFILL
    };
    check(Arch::Qwen3Moe, "moe_ffn", "split", split);
    check(Arch::Qwen3Moe, "moe_router", "prefill", PREFILL);
    check(Arch::Qwen3Moe, "moe_host_experts", "split", split);
    check(Arch::Qwen3Moe, "add_rows", "prefill", PREFILL);
}

#[test]
fn mixtral_layouts() {
    for (label, s) in [("prefill", PREFILL), ("decode", DECODE)] {
        check(Arch::Llama, "mixtral_ffn", label, s);
    }
}

/// Gemma 3: a sliding-window layer (its mask after the full one, its own
/// RoPE base), a full-context layer, the GeGLU FFN with its post-norm.
#[test]
fn gemma3_layouts() {
    for (label, s) in [("prefill", PREFILL), ("decode", DECODE)] {
        check(Arch::Gemma3, "attn", label, s);
        check(
            Arch::Gemma3,
            "attn",
            &format!("{label}_swa"),
            StepShape { swa: true, ..s },
        );
        check(Arch::Gemma3, "arch_ffn", label, s);
    }
    check(Arch::Gemma3, "attn", "prefill_last_layer", LAST);
}
