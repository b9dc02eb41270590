//! A tiny Hugging Face checkpoint (random weights, written as config.json +
//! safetensors) and an independent f64 forward pass of it, written from the
//! transformers modeling code (modeling_llama.py / modeling_qwen2.py), not
//! from llama.cpp: RMSNorm, rotate-half RoPE on the *unpermuted* HF weights
//! (with llama3 frequency scaling), GQA causal attention, SwiGLU; for Qwen3
//! (modeling_qwen3.py) an explicit head_dim and per-head RMSNorm of Q and K
//! before RoPE; for Mixtral and Qwen3-MoE (modeling_mixtral.py,
//! modeling_qwen3_moe.py) a router softmax, the top-k experts' weights
//! renormalized, and their SwiGLU outputs weighted and summed. strata's
//! logits on the converted GGUF are compared against it.

use half::{bf16, f16};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::Path;

#[derive(Clone, Debug)]
pub struct TinyConfig {
    pub class: &'static str,
    pub hidden: usize,
    pub n_head: usize,
    pub n_kv: usize,
    pub inter: usize,
    pub n_layer: usize,
    pub vocab: usize,
    pub tie: bool,
    pub qkv_bias: bool,
    pub theta: f64,
    pub eps: f64,
    /// (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
    pub llama3: Option<(f64, f64, f64, f64)>,
    /// "F32", "F16" or "BF16"
    pub dtype: &'static str,
    /// Qwen3: an explicit head_dim (config.json `head_dim`) and Q/K norms.
    pub qwen3_head_dim: Option<usize>,
    /// A mixture of experts in every FFN: (experts, used per token, one
    /// expert's width), named as the class names them (Mixtral's
    /// block_sparse_moe, Qwen3-MoE's mlp.experts).
    pub moe: Option<(usize, usize, usize)>,
}

impl TinyConfig {
    pub fn head_dim(&self) -> usize {
        self.qwen3_head_dim.unwrap_or(self.hidden / self.n_head)
    }
    fn mixtral(&self) -> bool {
        self.class == "MixtralForCausalLM"
    }
    /// The router's name after `model.layers.N.`.
    fn router(&self) -> String {
        if self.mixtral() {
            "block_sparse_moe.gate.weight"
        } else {
            "mlp.gate.weight"
        }
        .into()
    }
    /// Expert `e`'s gate, up and down names after `model.layers.N.`.
    fn expert(&self, e: usize) -> [String; 3] {
        if self.mixtral() {
            ["w1", "w3", "w2"].map(|w| format!("block_sparse_moe.experts.{e}.{w}.weight"))
        } else {
            ["gate_proj", "up_proj", "down_proj"].map(|w| format!("mlp.experts.{e}.{w}.weight"))
        }
    }
}

pub struct TinyModel {
    pub cfg: TinyConfig,
    /// name -> (shape, values as stored, i.e. already rounded to dtype)
    pub w: BTreeMap<String, (Vec<u64>, Vec<f64>)>,
}

/// splitmix64-based uniform in [-1, 1).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9e3779b97f4a7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 52) as f64 - 1.0
    }
}

fn round(dtype: &str, x: f64) -> f64 {
    match dtype {
        "F16" => f16::from_f64(x).to_f64(),
        "BF16" => bf16::from_f64(x).to_f64(),
        _ => x as f32 as f64,
    }
}

impl TinyModel {
    pub fn new(cfg: TinyConfig, seed: u64) -> TinyModel {
        let mut rng = Rng(seed);
        let (h, hd) = (cfg.hidden as u64, cfg.head_dim() as u64);
        let (q, kv, ff, v) = (
            cfg.n_head as u64 * hd,
            cfg.n_kv as u64 * hd,
            cfg.inter as u64,
            cfg.vocab as u64,
        );
        let mut w = BTreeMap::new();
        let dt = cfg.dtype;
        // (name, shape, scale, offset): value = offset + scale * U(-1, 1) * sqrt(3)
        let mut add = |name: String, shape: Vec<u64>, scale: f64, offset: f64| {
            let n: u64 = shape.iter().product();
            let vals = (0..n)
                .map(|_| round(dt, offset + scale * 1.732 * rng.next()))
                .collect();
            w.insert(name, (shape, vals));
        };
        add("model.embed_tokens.weight".into(), vec![v, h], 1.0, 0.0);
        add("model.norm.weight".into(), vec![h], 0.1, 1.0);
        if !cfg.tie {
            add(
                "lm_head.weight".into(),
                vec![v, h],
                1.0 / (h as f64).sqrt(),
                0.0,
            );
        }
        for l in 0..cfg.n_layer {
            let p = |s: &str| format!("model.layers.{l}.{s}");
            let s = 1.0 / (h as f64).sqrt();
            add(p("input_layernorm.weight"), vec![h], 0.1, 1.0);
            add(p("self_attn.q_proj.weight"), vec![q, h], s, 0.0);
            add(p("self_attn.k_proj.weight"), vec![kv, h], s, 0.0);
            add(p("self_attn.v_proj.weight"), vec![kv, h], s, 0.0);
            if cfg.qwen3_head_dim.is_some() {
                add(p("self_attn.q_norm.weight"), vec![hd], 0.1, 1.0);
                add(p("self_attn.k_norm.weight"), vec![hd], 0.1, 1.0);
            }
            if cfg.qkv_bias {
                add(p("self_attn.q_proj.bias"), vec![q], 0.3, 0.0);
                add(p("self_attn.k_proj.bias"), vec![kv], 0.3, 0.0);
                add(p("self_attn.v_proj.bias"), vec![kv], 0.3, 0.0);
            }
            add(
                p("self_attn.o_proj.weight"),
                vec![h, q],
                1.0 / (q as f64).sqrt(),
                0.0,
            );
            add(p("post_attention_layernorm.weight"), vec![h], 0.1, 1.0);
            if let Some((n_exp, _, fe)) = cfg.moe {
                let fe = fe as u64;
                // a router scaled so its logits spread over several units:
                // no near-ties between the experts chosen and the next
                add(p(&cfg.router()), vec![n_exp as u64, h], 3.0 * s, 0.0);
                for e in 0..n_exp {
                    let [g, u, d] = cfg.expert(e);
                    add(p(&g), vec![fe, h], s, 0.0);
                    add(p(&u), vec![fe, h], s, 0.0);
                    add(p(&d), vec![h, fe], 1.0 / (fe as f64).sqrt(), 0.0);
                }
                continue;
            }
            add(p("mlp.gate_proj.weight"), vec![ff, h], s, 0.0);
            add(p("mlp.up_proj.weight"), vec![ff, h], s, 0.0);
            add(
                p("mlp.down_proj.weight"),
                vec![h, ff],
                1.0 / (ff as f64).sqrt(),
                0.0,
            );
        }
        TinyModel { cfg, w }
    }

    pub fn config_json(&self) -> serde_json::Value {
        let c = &self.cfg;
        let mut j = json!({
            "architectures": [c.class],
            "hidden_size": c.hidden,
            "intermediate_size": c.inter,
            "num_hidden_layers": c.n_layer,
            "num_attention_heads": c.n_head,
            "num_key_value_heads": c.n_kv,
            "rms_norm_eps": c.eps,
            "rope_theta": c.theta,
            "max_position_embeddings": 4096,
            "vocab_size": c.vocab,
            "tie_word_embeddings": c.tie,
            "torch_dtype": "float32",
        });
        if let Some(hd) = c.qwen3_head_dim {
            j["head_dim"] = json!(hd);
        }
        if let Some((n_exp, used, fe)) = c.moe {
            j["num_experts_per_tok"] = json!(used);
            if c.mixtral() {
                j["num_local_experts"] = json!(n_exp);
                j["intermediate_size"] = json!(fe);
            } else {
                j["num_experts"] = json!(n_exp);
                j["moe_intermediate_size"] = json!(fe);
                j["norm_topk_prob"] = json!(true);
                j["decoder_sparse_step"] = json!(1);
                j["mlp_only_layers"] = json!([]);
            }
        }
        if let Some((factor, low, high, orig)) = c.llama3 {
            j["rope_scaling"] = json!({"rope_type": "llama3", "factor": factor,
                "low_freq_factor": low, "high_freq_factor": high,
                "original_max_position_embeddings": orig});
        }
        j
    }

    /// The bytes of one safetensors file holding `names`.
    pub fn safetensors(&self, names: &[&String]) -> Vec<u8> {
        let size = match self.cfg.dtype {
            "F32" => 4,
            _ => 2,
        };
        let mut header = serde_json::Map::new();
        let mut data = Vec::new();
        for n in names {
            let (shape, vals) = &self.w[*n];
            let begin = data.len();
            for &x in vals {
                match self.cfg.dtype {
                    "F16" => data.extend_from_slice(&f16::from_f64(x).to_le_bytes()),
                    "BF16" => data.extend_from_slice(&bf16::from_f64(x).to_le_bytes()),
                    _ => data.extend_from_slice(&(x as f32).to_le_bytes()),
                }
            }
            assert_eq!(data.len() - begin, vals.len() * size);
            header.insert((*n).clone(), json!({"dtype": self.cfg.dtype, "shape": shape, "data_offsets": [begin, data.len()]}));
        }
        header.insert("__metadata__".into(), json!({"format": "pt"}));
        let mut h = serde_json::to_vec(&header).expect("json");
        while !h.len().is_multiple_of(8) {
            h.push(b' ');
        }
        let mut out = (h.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(&h);
        out.extend_from_slice(&data);
        out
    }

    /// Writes config.json and the weights (one file, or `shards` files plus
    /// model.safetensors.index.json).
    pub fn write(&self, dir: &Path, shards: usize) {
        std::fs::write(dir.join("config.json"), self.config_json().to_string()).expect("config");
        let names: Vec<&String> = self.w.keys().collect();
        if shards <= 1 {
            std::fs::write(dir.join("model.safetensors"), self.safetensors(&names)).expect("st");
            return;
        }
        let per = names.len().div_ceil(shards);
        let mut map = serde_json::Map::new();
        for (i, part) in names.chunks(per).enumerate() {
            let file = format!("model-{:05}-of-{:05}.safetensors", i + 1, shards);
            std::fs::write(dir.join(&file), self.safetensors(part)).expect("shard");
            for n in part {
                map.insert((*n).clone(), json!(file));
            }
        }
        let index = json!({"metadata": {"total_size": 0}, "weight_map": map});
        std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).expect("index");
    }

    fn t(&self, name: &str) -> &[f64] {
        &self.w[name].1
    }

    /// Logits (f64) at every position of `tokens`.
    pub fn forward(&self, tokens: &[u32]) -> Vec<Vec<f64>> {
        let c = &self.cfg;
        let (h, hd, n) = (c.hidden, c.head_dim(), tokens.len());
        let emb = self.t("model.embed_tokens.weight");
        let mut xs: Vec<Vec<f64>> = tokens
            .iter()
            .map(|&t| emb[t as usize * h..(t as usize + 1) * h].to_vec())
            .collect();
        let inv_freq: Vec<f64> = (0..hd / 2)
            .map(|i| {
                let f = 1.0 / c.theta.powf(2.0 * i as f64 / hd as f64);
                match c.llama3 {
                    None => f,
                    Some((factor, low, high, orig)) => {
                        let wl = 2.0 * std::f64::consts::PI / f;
                        if wl < orig / high {
                            f
                        } else if wl > orig / low {
                            f / factor
                        } else {
                            let s = (orig / wl - low) / (high - low);
                            (1.0 - s) * f / factor + s * f
                        }
                    }
                }
            })
            .collect();
        let rope = |v: &mut [f64], pos: usize| {
            for head in v.chunks_exact_mut(hd) {
                for i in 0..hd / 2 {
                    let (s, co) = (pos as f64 * inv_freq[i]).sin_cos();
                    let (x1, x2) = (head[i], head[i + hd / 2]);
                    head[i] = x1 * co - x2 * s;
                    head[i + hd / 2] = x2 * co + x1 * s;
                }
            }
        };
        for l in 0..c.n_layer {
            let p = |s: &str| format!("model.layers.{l}.{s}");
            let bias = |s: &str, m: usize| {
                if c.qkv_bias {
                    self.t(&p(s)).to_vec()
                } else {
                    vec![0.0; m]
                }
            };
            let (q_dim, kv_dim) = (c.n_head * hd, c.n_kv * hd);
            let (mut qs, mut ks, mut vs) = (Vec::new(), Vec::new(), Vec::new());
            for (pos, x) in xs.iter().enumerate() {
                let hn = rms_norm(x, self.t(&p("input_layernorm.weight")), c.eps);
                let mut q = add(
                    &matvec(self.t(&p("self_attn.q_proj.weight")), &hn),
                    &bias("self_attn.q_proj.bias", q_dim),
                );
                let mut k = add(
                    &matvec(self.t(&p("self_attn.k_proj.weight")), &hn),
                    &bias("self_attn.k_proj.bias", kv_dim),
                );
                let v = add(
                    &matvec(self.t(&p("self_attn.v_proj.weight")), &hn),
                    &bias("self_attn.v_proj.bias", kv_dim),
                );
                if c.qwen3_head_dim.is_some() {
                    let norm = |v: &mut Vec<f64>, w: &str| {
                        let w = self.t(&p(w));
                        *v = v
                            .chunks_exact(hd)
                            .flat_map(|h| rms_norm(h, w, c.eps))
                            .collect();
                    };
                    norm(&mut q, "self_attn.q_norm.weight");
                    norm(&mut k, "self_attn.k_norm.weight");
                }
                rope(&mut q, pos);
                rope(&mut k, pos);
                qs.push(q);
                ks.push(k);
                vs.push(v);
            }
            let group = c.n_head / c.n_kv;
            for i in 0..n {
                let mut attn = vec![0.0; q_dim];
                for hh in 0..c.n_head {
                    let kvh = hh / group;
                    let q = &qs[i][hh * hd..(hh + 1) * hd];
                    let scores: Vec<f64> = (0..=i)
                        .map(|j| dot(q, &ks[j][kvh * hd..(kvh + 1) * hd]) / (hd as f64).sqrt())
                        .collect();
                    let m = scores.iter().cloned().fold(f64::MIN, f64::max);
                    let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for (j, ej) in e.iter().enumerate() {
                        for d in 0..hd {
                            attn[hh * hd + d] += ej / z * vs[j][kvh * hd + d];
                        }
                    }
                }
                let o = matvec(self.t(&p("self_attn.o_proj.weight")), &attn);
                xs[i] = add(&xs[i], &o);
                let hn = rms_norm(&xs[i], self.t(&p("post_attention_layernorm.weight")), c.eps);
                let swiglu = |g: &str, u: &str, d: &str| {
                    let g = matvec(self.t(&p(g)), &hn);
                    let u = matvec(self.t(&p(u)), &hn);
                    let a: Vec<f64> = g
                        .iter()
                        .zip(&u)
                        .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                        .collect();
                    matvec(self.t(&p(d)), &a)
                };
                let d = match c.moe {
                    None => swiglu(
                        "mlp.gate_proj.weight",
                        "mlp.up_proj.weight",
                        "mlp.down_proj.weight",
                    ),
                    Some((_, used, _)) => {
                        // softmax over the router's logits, the top-k
                        // experts, their probabilities renormalized
                        let logits = matvec(self.t(&p(&c.router())), &hn);
                        let m = logits.iter().cloned().fold(f64::MIN, f64::max);
                        let e: Vec<f64> = logits.iter().map(|l| (l - m).exp()).collect();
                        let mut order: Vec<usize> = (0..e.len()).collect();
                        order.sort_by(|&a, &b| e[b].total_cmp(&e[a]));
                        let top = &order[..used];
                        let z: f64 = top.iter().map(|&k| e[k]).sum();
                        let mut out = vec![0.0; h];
                        for &k in top {
                            let [g, u, dn] = c.expert(k);
                            let y = swiglu(&g, &u, &dn);
                            for (o, v) in out.iter_mut().zip(y) {
                                *o += e[k] / z * v;
                            }
                        }
                        out
                    }
                };
                xs[i] = add(&xs[i], &d);
            }
        }
        let head = if c.tie { emb } else { self.t("lm_head.weight") };
        xs.iter()
            .map(|x| matvec(head, &rms_norm(x, self.t("model.norm.weight"), c.eps)))
            .collect()
    }
}

fn rms_norm(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let s = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(v, w)| v * s * w).collect()
}

/// W [out, in] (row-major) times x [in].
fn matvec(w: &[f64], x: &[f64]) -> Vec<f64> {
    w.chunks_exact(x.len()).map(|row| dot(row, x)).collect()
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

fn add(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).map(|(x, y)| x + y).collect()
}
