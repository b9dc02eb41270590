//! Hyperparameters as llama.cpp's src/llama-model.cpp loads them from the
//! `{arch}.*` keys, validated.

use super::error::ModelError;
use crate::gguf::GgufFile;

/// Hyperparameters read from `{arch}.*` metadata (llama.cpp key names).
#[derive(Clone, Debug, PartialEq)]
pub struct Hparams {
    pub n_vocab: u32,
    pub n_ctx_train: u32,
    pub n_embd: u32,
    pub n_layer: u32,
    pub n_ff: u32,
    pub n_head: u32,
    pub n_head_kv: u32,
    /// Per-head dimension of Q/K/V.
    pub head_dim: u32,
    pub n_rot: u32,
    pub rms_eps: f32,
    pub rope_freq_base: f32,
    pub rope_freq_scale: f32,
    pub n_ctx_orig: u32,
    /// Attention scale; llama.cpp default 1/sqrt(head_dim).
    pub kq_scale: f32,
}

impl Hparams {
    /// K (or V) row width of one token: head_dim * n_head_kv.
    pub fn n_embd_kv(&self) -> u32 {
        self.head_dim * self.n_head_kv
    }
    /// Q width: head_dim * n_head.
    pub fn n_embd_q(&self) -> u32 {
        self.head_dim * self.n_head
    }
}

pub(super) fn bad(key: &str, value: impl ToString, why: &'static str) -> ModelError {
    ModelError::BadHparam {
        key: key.to_string(),
        value: value.to_string(),
        why,
    }
}

impl Hparams {
    /// From the `{arch}.*` keys of `f`, `arch` being the architecture's name.
    pub fn from_gguf(f: &GgufFile, arch: &str) -> Result<Hparams, ModelError> {
        let a = arch;
        let k = |s: &str| format!("{a}.{s}");
        let n_embd = f.get_u32(&k("embedding_length"))?;
        let n_layer = f.get_u32(&k("block_count"))?;
        let n_ff = f.get_u32(&k("feed_forward_length"))?;
        let n_head = f.get_u32(&k("attention.head_count"))?;
        let n_head_kv = f
            .get_u32_opt(&k("attention.head_count_kv"))?
            .unwrap_or(n_head);
        let n_ctx_train = f.get_u32(&k("context_length"))?;
        if n_embd == 0 || n_embd > 1 << 16 {
            return Err(bad(&k("embedding_length"), n_embd, "must be in 1..=65536"));
        }
        if n_layer == 0 || n_layer > 4096 {
            return Err(bad(&k("block_count"), n_layer, "must be in 1..=4096"));
        }
        if n_ff == 0 || n_ff > 1 << 20 {
            return Err(bad(&k("feed_forward_length"), n_ff, "must be in 1..=2^20"));
        }
        if n_head == 0 || n_head > 1024 {
            return Err(bad(
                &k("attention.head_count"),
                n_head,
                "must be in 1..=1024",
            ));
        }
        if n_head_kv == 0 || n_head % n_head_kv != 0 {
            return Err(bad(
                &k("attention.head_count_kv"),
                n_head_kv,
                "must divide head_count",
            ));
        }
        let head_dim = f
            .get_u32_opt(&k("attention.key_length"))?
            .unwrap_or(n_embd / n_head);
        let head_dim_v = f
            .get_u32_opt(&k("attention.value_length"))?
            .unwrap_or(head_dim);
        if head_dim == 0 || head_dim % 2 != 0 || head_dim > 1024 {
            return Err(bad(
                &k("attention.key_length"),
                head_dim,
                "must be even and in 2..=1024",
            ));
        }
        if head_dim_v != head_dim {
            return Err(ModelError::Unsupported(format!(
                "value_length {head_dim_v} != key_length {head_dim}"
            )));
        }
        let n_rot = f
            .get_u32_opt(&k("rope.dimension_count"))?
            .unwrap_or(head_dim);
        if n_rot != head_dim {
            return Err(bad(
                &k("rope.dimension_count"),
                n_rot,
                "must equal the head dimension",
            ));
        }
        let rms_eps = f.get_f32(&k("attention.layer_norm_rms_epsilon"))?;
        if !(rms_eps > 0.0 && rms_eps < 1.0) {
            return Err(bad(
                &k("attention.layer_norm_rms_epsilon"),
                rms_eps,
                "must be in (0, 1)",
            ));
        }
        let rope_freq_base = f.get_f32_opt(&k("rope.freq_base"))?.unwrap_or(10000.0);
        if !(rope_freq_base.is_finite() && rope_freq_base > 0.0) {
            return Err(bad(
                &k("rope.freq_base"),
                rope_freq_base,
                "must be positive",
            ));
        }
        let scaling = f.get_str_opt(&k("rope.scaling.type"))?.unwrap_or("none");
        let factor = match f.get_f32_opt(&k("rope.scaling.factor"))? {
            Some(x) => x,
            None => f.get_f32_opt(&k("rope.scale_linear"))?.unwrap_or(1.0),
        };
        let rope_freq_scale = match scaling {
            "none" => 1.0,
            "linear" if factor > 0.0 && factor.is_finite() => 1.0 / factor,
            "linear" => return Err(bad(&k("rope.scaling.factor"), factor, "must be positive")),
            other => {
                return Err(ModelError::Unsupported(format!(
                    "rope scaling type '{other}'"
                )))
            }
        };
        let n_ctx_orig = f
            .get_u32_opt(&k("rope.scaling.original_context_length"))?
            .unwrap_or(n_ctx_train);
        let scale = f.get_f32_opt(&k("attention.scale"))?.unwrap_or(0.0);
        let kq_scale = if scale == 0.0 {
            1.0 / (head_dim as f32).sqrt()
        } else {
            scale
        };
        Ok(Hparams {
            n_vocab: 0, // filled from the embedding table by ModelSpec
            n_ctx_train,
            n_embd,
            n_layer,
            n_ff,
            n_head,
            n_head_kv,
            head_dim,
            n_rot,
            rms_eps,
            rope_freq_base,
            rope_freq_scale,
            n_ctx_orig,
            kq_scale,
        })
    }
}
