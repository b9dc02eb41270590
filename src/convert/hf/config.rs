//! config.json: the architecture and hyperparameters of a Hugging Face
//! checkpoint, and the GGUF metadata they become (key names and defaults as
//! in llama.cpp's convert_hf_to_gguf.py, `TextModel.set_gguf_parameters`).

use super::super::error::ConvertError;
use super::super::error::Result;
use crate::gguf::Value;
use crate::model::Arch;
use serde_json::Value as Json;
use std::path::Path;

/// Rope scaling strata (and llama.cpp's llama/qwen2 graphs) can run.
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    Linear(f32),
    /// Llama 3.1: per-frequency factors, written as `rope_freqs.weight`.
    Llama3 {
        factor: f32,
        low: f32,
        high: f32,
        orig_ctx: f32,
    },
}

/// The experts of a mixture-of-experts checkpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MoeConfig {
    pub n_expert: u64,
    pub n_used: u64,
    /// One expert's hidden width.
    pub inter: u64,
    /// How the checkpoint names them.
    pub naming: MoeNaming,
}

/// Tensor names of a layer's router and experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoeNaming {
    /// Mixtral: `block_sparse_moe.gate`, `block_sparse_moe.experts.E.{w1,w3,w2}`
    /// (gate, up, down).
    Mixtral,
    /// Qwen3-MoE: `mlp.gate`, `mlp.experts.E.{gate,up,down}_proj`.
    Qwen3Moe,
}

impl MoeNaming {
    /// The router's name after `model.layers.N.`.
    pub fn router(self) -> &'static str {
        match self {
            MoeNaming::Mixtral => "block_sparse_moe.gate.weight",
            MoeNaming::Qwen3Moe => "mlp.gate.weight",
        }
    }
    /// The experts' prefix, and their gate, up and down matrices' names.
    fn parts(self) -> (&'static str, [&'static str; 3]) {
        match self {
            MoeNaming::Mixtral => ("block_sparse_moe.experts.", ["w1", "w3", "w2"]),
            MoeNaming::Qwen3Moe => ("mlp.experts.", ["gate_proj", "up_proj", "down_proj"]),
        }
    }
    /// Expert `e`'s gate, up and down names after `model.layers.N.`.
    pub fn expert(self, e: u64) -> [String; 3] {
        let (prefix, names) = self.parts();
        names.map(|w| format!("{prefix}{e}.{w}.weight"))
    }
    /// The (expert, matrix: 0 gate, 1 up, 2 down) a name after
    /// `model.layers.N.` is, if it is an expert's matrix.
    pub fn parse_expert(self, suffix: &str) -> Option<(u64, usize)> {
        let (prefix, names) = self.parts();
        let (e, rest) = suffix.strip_prefix(prefix)?.split_once('.')?;
        let k = names
            .iter()
            .position(|w| rest.strip_suffix(".weight") == Some(*w))?;
        // the number as written for it (no sign, no leading zeros)
        let n: u64 = e.parse().ok()?;
        (n.to_string() == e).then_some((n, k))
    }
}

#[derive(Clone, Debug)]
pub struct HfConfig {
    pub arch: Arch,
    /// "LlamaForCausalLM", "MistralForCausalLM" or "Qwen2ForCausalLM".
    pub class: String,
    pub hidden: u64,
    pub inter: u64,
    pub n_layer: u64,
    pub n_head: u64,
    pub n_kv: u64,
    pub head_dim: u64,
    /// Whether config.json gave head_dim explicitly.
    pub explicit_head_dim: bool,
    pub eps: f32,
    pub rope_theta: f32,
    pub ctx: u64,
    pub vocab: u64,
    pub tie: bool,
    /// Q/K/V biases (Qwen2 always; Llama with `attention_bias`).
    pub qkv_bias: bool,
    /// Output projection bias (Llama with `attention_bias`).
    pub o_bias: bool,
    /// Per-head RMS norms of Q and K (Qwen3: `self_attn.q_norm`, `k_norm`).
    pub qk_norm: bool,
    /// A mixture of experts in every layer's FFN, if the model has one.
    pub moe: Option<MoeConfig>,
    pub rope: RopeScaling,
    pub name: String,
    pub json: Json,
}

/// The checkpoint classes `strata-convert hf` reads.
pub const CLASSES: [&str; 6] = [
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
];

fn cfg_err(s: String) -> ConvertError {
    ConvertError::Config(s)
}

fn get_u64(j: &Json, key: &str) -> Result<Option<u64>> {
    match j.get(key) {
        None | Some(Json::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(Some)
            .ok_or_else(|| cfg_err(format!("'{key}' is {v}, expected a non-negative integer"))),
    }
}

fn need_u64(j: &Json, key: &str) -> Result<u64> {
    match get_u64(j, key)? {
        Some(0) => Err(cfg_err(format!("'{key}' is 0"))),
        Some(v) => Ok(v),
        None => Err(cfg_err(format!("missing '{key}'"))),
    }
}

fn get_f32(j: &Json, key: &str, default: f32) -> Result<f32> {
    match j.get(key) {
        None | Some(Json::Null) => Ok(default),
        Some(v) => v
            .as_f64()
            .map(|x| x as f32)
            .filter(|x| x.is_finite() && *x > 0.0)
            .ok_or_else(|| cfg_err(format!("'{key}' is {v}, expected a positive number"))),
    }
}

impl HfConfig {
    /// Reads and checks `dir/config.json`.
    pub fn read(dir: &Path) -> Result<HfConfig> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(ConvertError::io(&path))?;
        let j: Json = serde_json::from_str(&text).map_err(|e| ConvertError::Json {
            file: path.clone(),
            problem: e.to_string(),
        })?;
        Self::from_json(j, dir)
    }

    pub fn from_json(j: Json, dir: &Path) -> Result<HfConfig> {
        let classes: Vec<&str> = j
            .get("architectures")
            .and_then(Json::as_array)
            .map(|a| a.iter().filter_map(Json::as_str).collect())
            .unwrap_or_default();
        let (class, arch) = match classes.first().copied() {
            Some(c @ ("LlamaForCausalLM" | "MistralForCausalLM")) => (c, Arch::Llama),
            Some(c @ "Qwen2ForCausalLM") => (c, Arch::Qwen2),
            Some(c @ "Qwen3ForCausalLM") => (c, Arch::Qwen3),
            Some(c @ "MixtralForCausalLM") => (c, Arch::Llama),
            Some(c @ "Qwen3MoeForCausalLM") => (c, Arch::Qwen3Moe),
            Some(c) => {
                return Err(ConvertError::Unsupported(format!(
                    "architecture {c} (supported: {})",
                    CLASSES.join(", ")
                )))
            }
            None => return Err(cfg_err("no 'architectures' list".into())),
        };
        // the ranges strata's model check accepts: nothing is allocated from
        // a count before it is bounded, and nothing wraps into a u32 field
        let bounded = |key: &str, v: u64, max: u64| -> Result<u64> {
            if (1..=max).contains(&v) {
                Ok(v)
            } else {
                Err(cfg_err(format!("'{key}' = {v} is outside 1..={max}")))
            }
        };
        let hidden = bounded("hidden_size", need_u64(&j, "hidden_size")?, 1 << 16)?;
        let n_head = bounded(
            "num_attention_heads",
            need_u64(&j, "num_attention_heads")?,
            1024,
        )?;
        let n_kv = get_u64(&j, "num_key_value_heads")?.unwrap_or(n_head);
        if n_kv == 0 || n_head % n_kv != 0 {
            return Err(cfg_err(format!(
                "num_key_value_heads {n_kv} does not divide num_attention_heads {n_head}"
            )));
        }
        let explicit = get_u64(&j, "head_dim")?;
        if explicit.is_none() && hidden % n_head != 0 {
            return Err(cfg_err(format!(
                "hidden_size {hidden} is not a multiple of num_attention_heads {n_head}"
            )));
        }
        let head_dim = explicit.unwrap_or(hidden / n_head);
        if head_dim == 0 || head_dim % 2 != 0 {
            return Err(cfg_err(format!(
                "head dimension {head_dim} must be even and positive"
            )));
        }
        if j.get("mlp_bias").and_then(Json::as_bool) == Some(true) {
            return Err(ConvertError::Unsupported("mlp_bias (FFN biases)".into()));
        }
        let attn_bias = j
            .get("attention_bias")
            .and_then(Json::as_bool)
            .unwrap_or(false);
        let rope_theta = get_f32(&j, "rope_theta", 10000.0)?;
        let rope = match j.get("rope_scaling") {
            None | Some(Json::Null) => RopeScaling::None,
            Some(r) => {
                let ty = r
                    .get("rope_type")
                    .or_else(|| r.get("type"))
                    .and_then(Json::as_str)
                    .unwrap_or("");
                match ty {
                    "linear" => RopeScaling::Linear(get_f32(r, "factor", 1.0)?),
                    "llama3" => RopeScaling::Llama3 {
                        factor: get_f32(r, "factor", 8.0)?,
                        low: get_f32(r, "low_freq_factor", 1.0)?,
                        high: get_f32(r, "high_freq_factor", 4.0)?,
                        orig_ctx: get_f32(r, "original_max_position_embeddings", 8192.0)?,
                    },
                    "default" | "" => RopeScaling::None,
                    other => {
                        return Err(ConvertError::Unsupported(format!(
                            "rope_scaling type '{other}'"
                        )))
                    }
                }
            }
        };
        let moe = match class {
            "MixtralForCausalLM" => Some(MoeConfig {
                n_expert: bounded(
                    "num_local_experts",
                    need_u64(&j, "num_local_experts")?,
                    1024,
                )?,
                n_used: need_u64(&j, "num_experts_per_tok")?,
                inter: need_u64(&j, "intermediate_size")?,
                naming: MoeNaming::Mixtral,
            }),
            "Qwen3MoeForCausalLM" => {
                // every layer sparse: no dense layers among the experts
                if get_u64(&j, "decoder_sparse_step")?.is_some_and(|s| s != 1) {
                    return Err(ConvertError::Unsupported(
                        "decoder_sparse_step other than 1 (dense layers between the mixtures of experts)".into(),
                    ));
                }
                if j.get("mlp_only_layers")
                    .and_then(Json::as_array)
                    .is_some_and(|a| !a.is_empty())
                {
                    return Err(ConvertError::Unsupported(
                        "mlp_only_layers (dense layers between the mixtures of experts)".into(),
                    ));
                }
                // llama.cpp's qwen3moe graph always renormalizes the top-k
                // weights, as every released Qwen3-MoE asks
                if j.get("norm_topk_prob").and_then(Json::as_bool) != Some(true) {
                    return Err(ConvertError::Unsupported(
                        "norm_topk_prob other than true (top-k routing weights not renormalized)"
                            .into(),
                    ));
                }
                Some(MoeConfig {
                    n_expert: bounded("num_experts", need_u64(&j, "num_experts")?, 1024)?,
                    n_used: need_u64(&j, "num_experts_per_tok")?,
                    inter: bounded(
                        "moe_intermediate_size",
                        need_u64(&j, "moe_intermediate_size")?,
                        1 << 20,
                    )?,
                    naming: MoeNaming::Qwen3Moe,
                })
            }
            _ => None,
        };
        if let Some(m) = moe {
            if m.n_used > m.n_expert {
                return Err(cfg_err(format!(
                    "num_experts_per_tok {} exceeds the {} experts",
                    m.n_used, m.n_expert
                )));
            }
        }
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        Ok(HfConfig {
            arch,
            class: class.to_string(),
            hidden,
            inter: bounded(
                "intermediate_size",
                need_u64(&j, "intermediate_size")?,
                1 << 20,
            )?,
            n_layer: bounded(
                "num_hidden_layers",
                need_u64(&j, "num_hidden_layers")?,
                4096,
            )?,
            n_head,
            n_kv,
            head_dim,
            explicit_head_dim: explicit.is_some(),
            eps: get_f32(&j, "rms_norm_eps", 1e-6)?,
            rope_theta,
            ctx: bounded(
                "max_position_embeddings",
                get_u64(&j, "max_position_embeddings")?.unwrap_or(4096),
                u32::MAX as u64,
            )?,
            vocab: bounded("vocab_size", need_u64(&j, "vocab_size")?, 1 << 24)?,
            tie: j
                .get("tie_word_embeddings")
                .and_then(Json::as_bool)
                .unwrap_or(false),
            qkv_bias: arch == Arch::Qwen2 || attn_bias,
            o_bias: arch == Arch::Llama && attn_bias,
            qk_norm: matches!(arch, Arch::Qwen3 | Arch::Qwen3Moe),
            moe,
            rope,
            name,
            json: j,
        })
    }

    /// Whether Q/K rows are permuted from Hugging Face's rotate-half layout
    /// to the interleaved pairs llama.cpp's NORM rope expects
    /// (convert_hf_to_gguf.py `LlamaModel.permute`). Qwen2 and Qwen3 use
    /// NEOX rope on the original layout.
    pub fn permute_qk(&self) -> bool {
        self.arch == Arch::Llama
    }

    /// `{arch}.*` and `general.*` metadata.
    pub fn metadata(&self) -> Vec<(String, Value)> {
        let a = self.arch.name();
        let mut md: Vec<(String, Value)> = vec![
            ("general.architecture".into(), Value::Str(a.into())),
            ("general.name".into(), Value::Str(self.name.clone())),
        ];
        let mut hp = |k: &str, v: Value| md.push((format!("{a}.{k}"), v));
        let u = |x: u64| Value::U32(x as u32);
        hp("context_length", u(self.ctx));
        hp("embedding_length", u(self.hidden));
        hp("block_count", u(self.n_layer));
        hp("feed_forward_length", u(self.inter));
        hp("attention.head_count", u(self.n_head));
        hp("attention.head_count_kv", u(self.n_kv));
        hp("rope.freq_base", Value::F32(self.rope_theta));
        hp("attention.layer_norm_rms_epsilon", Value::F32(self.eps));
        hp("rope.dimension_count", u(self.head_dim));
        hp("vocab_size", u(self.vocab));
        if self.explicit_head_dim {
            hp("attention.key_length", u(self.head_dim));
            hp("attention.value_length", u(self.head_dim));
        }
        if let Some(m) = self.moe {
            hp("expert_count", u(m.n_expert));
            hp("expert_used_count", u(m.n_used));
            if m.naming == MoeNaming::Qwen3Moe {
                hp("expert_feed_forward_length", u(m.inter));
            }
        }
        if let RopeScaling::Linear(f) = self.rope {
            hp("rope.scaling.type", Value::Str("linear".into()));
            hp("rope.scaling.factor", Value::F32(f));
        }
        md
    }
}
