//! Gemma 3, text (llama.cpp's src/models/gemma3.cpp): token embeddings
//! scaled by sqrt(n_embd); attention with per-head Q/K RMS norms before
//! NEOX RoPE, Q scaled by 1/sqrt(query_pre_attn_scalar) after it, and an
//! RMS norm of its output before the residual add; a GeGLU FFN (GELU by
//! its tanh approximation) with a norm of its output likewise. Five of
//! every six layers attend over a sliding window
//! (`gemma3.attention.sliding_window` tokens) with their own RoPE base
//! (`rope.freq_base_swa`, 10000 where the file has none); every sixth
//! over the whole context. The norm weights in the GGUF already hold
//! Gemma's `1 + w` (convert_hf_to_gguf.py adds the one).

use super::table::{t, Act, Arch, ArchSpec, Need::*, Shape::*};
use crate::gguf::GgufFile;
use crate::model::error::ModelError;
use crate::model::hparams::{bad, Hparams};
use crate::model::role::Role;

pub const SPEC: ArchSpec = ArchSpec {
    arch: Arch::Gemma3,
    name: "gemma3",
    rope_mode: 2,
    attn: &[
        t(Role::AttnNorm, Required, Embd),
        t(Role::Wq, Required, EmbdQ),
        t(Role::QNorm, Required, HeadDim),
        t(Role::Wk, Required, EmbdKv),
        t(Role::KNorm, Required, HeadDim),
        t(Role::Wv, Required, EmbdKv),
        t(Role::Wo, Required, QEmbd),
        t(Role::AttnPostNorm, Required, Embd),
    ],
    ffn: &[
        t(Role::FfnNorm, Required, Embd),
        t(Role::Gate, Required, EmbdFf),
        t(Role::Up, Required, EmbdFf),
        t(Role::Down, Required, FfEmbd),
        t(Role::FfnPostNorm, Required, Embd),
    ],
    moe_ffn: &[],
    ffn_act: Act::GeluTanh,
    read_hparams: Some(read_hparams),
};

/// Layers of Gemma 3 27B, the one size whose query scale is
/// 1/sqrt(n_embd / n_head) rather than 1/sqrt(head_dim) (gemma_pytorch's
/// config, as llama.cpp follows it).
const LAYERS_27B: u32 = 62;

/// Layers per sliding-window pattern where the file gives none.
const SWA_PATTERN: u32 = 6;

fn read_hparams(f: &GgufFile, hp: &mut Hparams) -> Result<(), ModelError> {
    let k = |s: &str| format!("gemma3.{s}");
    hp.embd_scale = (hp.n_embd as f32).sqrt();
    hp.q_scale = if hp.n_layer == LAYERS_27B {
        1.0 / ((hp.n_embd / hp.n_head) as f32).sqrt()
    } else {
        1.0 / (hp.head_dim as f32).sqrt()
    };
    // Q is scaled before attention, which then scales by one
    hp.kq_scale = 1.0;
    hp.n_swa = f.get_u32_opt(&k("attention.sliding_window"))?.unwrap_or(0);
    if hp.n_swa > 0 {
        let key = k("attention.sliding_window_pattern");
        hp.swa_pattern = match f.get_u32_opt(&key) {
            Ok(p) => p.unwrap_or(SWA_PATTERN),
            // llama.cpp also takes a per-layer array
            Err(e) => {
                return Err(ModelError::Unsupported(format!(
                    "{key}: {e} (strata reads one pattern length, not a per-layer array)"
                )))
            }
        };
        if hp.swa_pattern < 2 {
            return Err(bad(&key, hp.swa_pattern, "must be at least 2"));
        }
        hp.rope_freq_base_swa = f.get_f32_opt(&k("rope.freq_base_swa"))?.unwrap_or(10000.0);
        if !(hp.rope_freq_base_swa.is_finite() && hp.rope_freq_base_swa > 0.0) {
            return Err(bad(
                &k("rope.freq_base_swa"),
                hp.rope_freq_base_swa,
                "must be positive",
            ));
        }
    }
    if let Some(c) = f.get_f32_opt(&k("final_logit_softcapping"))? {
        if c != 0.0 {
            return Err(ModelError::Unsupported(format!(
                "{} = {c}: logit soft-capping",
                k("final_logit_softcapping")
            )));
        }
    }
    Ok(())
}
