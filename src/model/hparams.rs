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
    /// Experts per FFN (0: a dense FFN), as `expert_count`.
    pub n_expert: u32,
    /// Experts each token is routed to (`expert_used_count`).
    pub n_expert_used: u32,
    /// Sliding-window attention: the window in tokens (0: every layer
    /// attends over the whole context), and its layer pattern: layer `l`
    /// attends over the window unless `l % swa_pattern == swa_pattern - 1`
    /// (llama.cpp's set_swa_pattern; Gemma 3: five of every six layers).
    pub n_swa: u32,
    pub swa_pattern: u32,
    /// RoPE base of the sliding-window layers.
    pub rope_freq_base_swa: f32,
    /// Factor Q is scaled by after RoPE, before attention (Gemma 3's
    /// query_pre_attn_scalar; 1: none, the scale is `kq_scale`).
    pub q_scale: f32,
    /// Factor the token embeddings are scaled by (Gemma: sqrt(n_embd)).
    pub embd_scale: f32,
    /// Hidden width of one expert: `expert_feed_forward_length`, else
    /// `feed_forward_length` (Mixtral's files carry only that).
    pub n_ff_exp: u32,
    /// The file's index of this model's layer 0: 0, but in the part of a
    /// model one of several devices computes ([`super::ModelSpec::part`]).
    pub layer0: u32,
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
    /// Whether layer `l` attends over a sliding window.
    pub fn is_swa(&self, l: u32) -> bool {
        let l = l + self.layer0;
        self.n_swa > 0 && l % self.swa_pattern < self.swa_pattern - 1
    }
    /// The layers in the order they keep their KV on the device (the
    /// memory plan's `KvPlan::resident_layers` counts from the front):
    /// full-context layers first, then the sliding-window ones, each in
    /// layer order. A windowed sliding-window layer uploads only the cells
    /// its window sees, so it is the cheaper one to window.
    pub fn kv_order(&self) -> Vec<u32> {
        let (mut full, swa): (Vec<u32>, Vec<u32>) =
            (0..self.n_layer).partition(|&l| !self.is_swa(l));
        full.extend(swa);
        full
    }
    /// Whether the FFN is a mixture of experts.
    pub fn is_moe(&self) -> bool {
        self.n_expert > 0
    }
}

/// Most experts per FFN (llama.cpp's LLAMA_MAX_EXPERTS).
pub const MAX_EXPERTS: u32 = 1024;

/// The expert keys of `f` (`{arch}.expert_*`): (n_expert, n_expert_used,
/// n_ff_exp). What strata's router does not compute is refused by key:
/// Llama-style and Qwen3-MoE routing is softmax over the router's logits,
/// top-k, the k weights renormalized to sum 1, no scale, no shared or
/// grouped experts (llama.cpp's build_moe_ffn for these architectures).
fn experts(f: &GgufFile, arch: &str, n_ff: u32) -> Result<(u32, u32, u32), ModelError> {
    let k = |s: &str| format!("{arch}.{s}");
    let n_expert = f.get_u32_opt(&k("expert_count"))?.unwrap_or(0);
    if n_expert == 0 {
        return Ok((0, 0, 0));
    }
    if n_expert > MAX_EXPERTS {
        return Err(bad(&k("expert_count"), n_expert, "must be at most 1024"));
    }
    let used = f.get_u32(&k("expert_used_count"))?;
    if used == 0 || used > n_expert {
        return Err(bad(
            &k("expert_used_count"),
            used,
            "must be in 1..=expert_count",
        ));
    }
    let n_ff_exp = f
        .get_u32_opt(&k("expert_feed_forward_length"))?
        .unwrap_or(n_ff);
    if n_ff_exp == 0 || n_ff_exp > 1 << 20 {
        return Err(bad(
            &k("expert_feed_forward_length"),
            n_ff_exp,
            "must be in 1..=2^20",
        ));
    }
    if let Some(n) = f.get_u32_opt(&k("expert_shared_count"))? {
        if n > 0 {
            return Err(ModelError::Unsupported(format!(
                "{} = {n}: shared experts",
                k("expert_shared_count")
            )));
        }
    }
    if let Some(n) = f.get_u32_opt(&k("expert_group_count"))? {
        if n > 1 {
            return Err(ModelError::Unsupported(format!(
                "{} = {n}: grouped expert selection",
                k("expert_group_count")
            )));
        }
    }
    // 0 (none given) and 1 (softmax) are what these architectures compute
    if let Some(g) = f.get_u32_opt(&k("expert_gating_func"))? {
        if g > 1 {
            return Err(ModelError::Unsupported(format!(
                "{} = {g}: routing other than softmax",
                k("expert_gating_func")
            )));
        }
    }
    if f.get_bool_opt(&k("expert_weights_norm"))? == Some(false) {
        return Err(ModelError::Unsupported(format!(
            "{} = false: top-k weights not renormalized",
            k("expert_weights_norm")
        )));
    }
    if let Some(s) = f.get_f32_opt(&k("expert_weights_scale"))? {
        if s != 0.0 && s != 1.0 {
            return Err(ModelError::Unsupported(format!(
                "{} = {s}: scaled expert weights",
                k("expert_weights_scale")
            )));
        }
    }
    Ok((n_expert, used, n_ff_exp))
}

pub(super) fn bad(key: &str, value: impl ToString, why: &'static str) -> ModelError {
    ModelError::BadHparam {
        key: key.to_string(),
        value: value.to_string(),
        why,
    }
}

impl Hparams {
    /// From the `{arch}.*` keys of `f` every architecture shares, `arch`
    /// being the architecture's name (its own keys: `ArchSpec::read_hparams`,
    /// which `ModelSpec::from_gguf` applies after).
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
        let (n_expert, n_expert_used, n_ff_exp) = experts(f, a, n_ff)?;
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
            n_swa: 0,
            swa_pattern: 1,
            rope_freq_base_swa: rope_freq_base,
            q_scale: 1.0,
            embd_scale: 1.0,
            n_expert,
            n_expert_used,
            n_ff_exp,
            layer0: 0,
        })
    }
}
