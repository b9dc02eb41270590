//! `strata-convert synth`: random-weight models with real shapes, for
//! benchmarks where real weights cannot be brought.
//!
//! Speed: weights are not drawn one by one. For every (output type, scale)
//! a pool of about 2M normal values is drawn (ChaCha8, Box-Muller) and
//! quantized once by ggml; each tensor row is then a window of whole blocks
//! of that pool starting at a per-row pseudo-random block, so generation is
//! a memory copy and the file is written at disk speed (chunks are made on a
//! helper thread while the previous one is written). Rows are distinct
//! shifts of i.i.d. values, which is all a shape benchmark needs.
//!
//! Scale: every matrix has std 1/sqrt(fan_in) (embeddings 1), norms are 1,
//! biases small. Each block reads an RMS-normed input, so its output has
//! variance about 1 and the residual stream's variance grows by about one
//! per group: about 161 (std ~13) after 80 layers, far inside f16 range, so
//! activations, KV (f16) and logits stay finite through every layer.
//!
//! The tokenizer (every `tokenizer.*` key) is copied from `--vocab-from`
//! and the vocabulary size follows it, so text generation runs end to end.
//!
//! Routing: a random router picks experts about uniformly. `router_skew`
//! S > 0 gives each layer a Zipf-like expert popularity instead
//! ([`super::synth_router`]); the file states the preset, S and each
//! layer's popularity order in `strata.synth.*` keys.

use super::error::ConvertError;
use super::error::Result;
use super::output::{pipelined, write_model, OutTensor, OutputModel, TensorFill, WriteSummary};
use super::quant;
use super::synth_router as router;
use crate::dtype::GgmlType;
use crate::gguf::Value;
use crate::model::arch::Need;
use crate::model::Arch;
use crate::model::Role;
use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Shapes of a model family member (llama.cpp hyperparameter names).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Preset {
    pub name: &'static str,
    pub arch: Arch,
    pub n_embd: u32,
    pub n_layer: u32,
    pub n_head: u32,
    pub n_head_kv: u32,
    pub n_ff: u32,
    /// Per-head dimension where it is not n_embd / n_head (Qwen3); 0: that.
    pub head_dim: u32,
    pub n_ctx: u32,
    pub rope_base: f32,
    pub rms_eps: f32,
    /// Llama 3.1 rope frequency factors (`rope_freqs.weight`).
    pub llama3_rope: bool,
    /// Experts per FFN (0: dense) and experts used per token.
    pub n_expert: u32,
    pub n_expert_used: u32,
    /// One expert's hidden width where it is not `n_ff` (Qwen3-MoE's
    /// `expert_feed_forward_length`); 0: `n_ff`, written as Mixtral's
    /// files have it (no key).
    pub n_ff_exp: u32,
    /// Sliding-window attention (Gemma 3: five of every six layers), its
    /// window in tokens; 0: none.
    pub n_swa: u32,
    /// Linear RoPE scaling factor of the full-context layers (1: none).
    pub rope_linear: f32,
}

/// No experts: a dense FFN.
const DENSE: (u32, u32, u32) = (0, 0, 0);

const fn llama(name: &'static str, n_embd: u32, n_layer: u32, n_head: u32, n_ff: u32) -> Preset {
    Preset {
        name,
        arch: Arch::Llama,
        n_embd,
        n_layer,
        n_head,
        n_head_kv: 8,
        n_ff,
        head_dim: 0,
        n_ctx: 131072,
        rope_base: 500000.0,
        rms_eps: 1e-5,
        llama3_rope: true,
        n_expert: DENSE.0,
        n_expert_used: DENSE.1,
        n_ff_exp: DENSE.2,
        n_swa: 0,
        rope_linear: 1.0,
    }
}

/// A Qwen3-MoE shape (head dimension 128, as every Qwen3).
#[allow(clippy::too_many_arguments)]
const fn qwen3moe(
    name: &'static str,
    n_embd: u32,
    n_layer: u32,
    n_head: u32,
    n_head_kv: u32,
    n_ff: u32,
    n_ff_exp: u32,
    (n_expert, n_expert_used): (u32, u32),
) -> Preset {
    Preset {
        name,
        arch: Arch::Qwen3Moe,
        n_embd,
        n_layer,
        n_head,
        n_head_kv,
        n_ff,
        head_dim: 128,
        n_ctx: 40960,
        rope_base: 1000000.0,
        rms_eps: 1e-6,
        llama3_rope: false,
        n_expert,
        n_expert_used,
        n_ff_exp,
        n_swa: 0,
        rope_linear: 1.0,
    }
}

/// A Mixtral shape: `llama` with experts, no llama3 rope factors.
const fn mixtral(
    name: &'static str,
    n_embd: u32,
    n_layer: u32,
    n_head: u32,
    n_head_kv: u32,
    n_ff: u32,
) -> Preset {
    Preset {
        name,
        arch: Arch::Llama,
        n_embd,
        n_layer,
        n_head,
        n_head_kv,
        n_ff,
        head_dim: 0,
        n_ctx: 32768,
        rope_base: 1000000.0,
        rms_eps: 1e-5,
        llama3_rope: false,
        n_expert: 8,
        n_expert_used: 2,
        n_ff_exp: 0,
        n_swa: 0,
        rope_linear: 1.0,
    }
}

/// The presets: a tiny one for tests and the shapes of real models.
pub const PRESETS: [Preset; 13] = [
    Preset {
        name: "tiny",
        arch: Arch::Llama,
        n_embd: 256,
        n_layer: 2,
        n_head: 4,
        n_head_kv: 2,
        n_ff: 512,
        head_dim: 0,
        n_ctx: 4096,
        rope_base: 10000.0,
        rms_eps: 1e-5,
        llama3_rope: false,
        n_expert: DENSE.0,
        n_expert_used: DENSE.1,
        n_ff_exp: DENSE.2,
        n_swa: 0,
        rope_linear: 1.0,
    },
    // the draft model of the Llama 3 family's speculative decoding
    llama("llama3.2-1b", 2048, 16, 32, 8192),
    llama("llama3-8b", 4096, 32, 32, 14336),
    llama("llama3-70b", 8192, 80, 64, 28672),
    Preset {
        name: "qwen2.5-7b",
        arch: Arch::Qwen2,
        n_embd: 3584,
        n_layer: 28,
        n_head: 28,
        n_head_kv: 4,
        n_ff: 18944,
        head_dim: 0,
        n_ctx: 32768,
        rope_base: 1000000.0,
        rms_eps: 1e-6,
        llama3_rope: false,
        n_expert: DENSE.0,
        n_expert_used: DENSE.1,
        n_ff_exp: DENSE.2,
        n_swa: 0,
        rope_linear: 1.0,
    },
    // Qwen3 for tests: a head dimension wider than n_embd / n_head, as in
    // every Qwen3
    Preset {
        name: "qwen3-tiny",
        arch: Arch::Qwen3,
        n_embd: 256,
        n_layer: 2,
        n_head: 4,
        n_head_kv: 2,
        n_ff: 512,
        head_dim: 128,
        n_ctx: 4096,
        rope_base: 1000000.0,
        rms_eps: 1e-6,
        llama3_rope: false,
        n_expert: DENSE.0,
        n_expert_used: DENSE.1,
        n_ff_exp: DENSE.2,
        n_swa: 0,
        rope_linear: 1.0,
    },
    Preset {
        name: "qwen3-32b",
        arch: Arch::Qwen3,
        n_embd: 5120,
        n_layer: 64,
        n_head: 64,
        n_head_kv: 8,
        n_ff: 25600,
        head_dim: 128,
        n_ctx: 40960,
        rope_base: 1000000.0,
        rms_eps: 1e-6,
        llama3_rope: false,
        n_expert: DENSE.0,
        n_expert_used: DENSE.1,
        n_ff_exp: DENSE.2,
        n_swa: 0,
        rope_linear: 1.0,
    },
    // mixtures of experts for tests: Mixtral-style (llama with 8 experts,
    // 2 used) and Qwen3-MoE (16 experts, 4 used, a narrower expert width)
    mixtral("mixtral-tiny", 256, 2, 4, 2, 512),
    qwen3moe("qwen3moe-tiny", 256, 2, 4, 2, 768, 256, (16, 4)),
    // the real shapes (Mixtral-8x7B-v0.1, Qwen3-30B-A3B, Qwen3-235B-A22B)
    mixtral("mixtral-8x7b", 4096, 32, 32, 8, 14336),
    qwen3moe("qwen3-30b-a3b", 2048, 48, 32, 4, 6144, 768, (128, 8)),
    qwen3moe("qwen3-235b-a22b", 4096, 94, 64, 4, 12288, 1536, (128, 8)),
    // Gemma-3-27B: head_dim 128 under 32 heads of a 5376-wide stream,
    // windows of 1024 tokens, full-context layers' RoPE scaled 8x
    Preset {
        name: "gemma3-27b",
        arch: Arch::Gemma3,
        n_embd: 5376,
        n_layer: 62,
        n_head: 32,
        n_head_kv: 16,
        n_ff: 21504,
        head_dim: 128,
        n_ctx: 131072,
        rope_base: 1000000.0,
        rms_eps: 1e-6,
        llama3_rope: false,
        n_expert: DENSE.0,
        n_expert_used: DENSE.1,
        n_ff_exp: DENSE.2,
        n_swa: 1024,
        rope_linear: 8.0,
    },
];

pub fn preset(name: &str) -> Result<Preset> {
    PRESETS
        .iter()
        .find(|p| p.name == name)
        .copied()
        .ok_or_else(|| {
            let names: Vec<_> = PRESETS.iter().map(|p| p.name).collect();
            ConvertError::Unsupported(format!("preset '{name}' (known: {})", names.join(", ")))
        })
}

/// Options of [`synth`].
#[derive(Clone, Debug)]
pub struct SynthOptions {
    pub preset: Preset,
    /// Type (or mix) of the matrices (norms, biases, rope_freqs stay f32).
    pub target: quant::Target,
    /// Override the number of layers.
    pub layers: Option<u32>,
    /// GGUF whose tokenizer is copied.
    pub vocab_from: PathBuf,
    pub seed: u64,
    /// Zipf exponent of the experts' popularity per layer (0: a plain
    /// random router, about uniform); only for presets with experts.
    pub router_skew: f32,
    pub threads: usize,
    pub progress: bool,
}

/// Values per pool (a multiple of every block size).
const POOL: usize = 1 << 21;
/// Output bytes per generated chunk.
const CHUNK_BYTES: u64 = 64 << 20;

/// A quantized pool of N(0, std^2) values, extended so that any window of
/// up to POOL/2 values is contiguous.
struct Pool {
    bytes: Vec<u8>,
    n_blocks: u64,
    block_bytes: usize,
    block: u64,
}

fn normal_pool(std: f32, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut v = Vec::with_capacity(POOL);
    while v.len() < POOL {
        let u1 = (rng.next_u32() as f64 + 1.0) / 4294967297.0;
        let u2 = rng.next_u32() as f64 / 4294967296.0;
        let r = (-2.0 * u1.ln()).sqrt() * std as f64;
        let a = std::f64::consts::TAU * u2;
        v.push((r * a.cos()) as f32);
        v.push((r * a.sin()) as f32);
    }
    v
}

impl Pool {
    fn new(ty: GgmlType, std: f32, seed: u64, threads: usize) -> Result<Pool> {
        let vals = normal_pool(std, seed);
        let mut bytes = Vec::new();
        quant::from_f32(&vals, ty, 256, threads, &mut bytes)?;
        let block = ty.block_size().unwrap_or(1);
        let block_bytes = ty.type_size().unwrap_or(4) as usize;
        let n_blocks = (bytes.len() / block_bytes) as u64;
        let head = bytes[..bytes.len() / 2].to_vec();
        bytes.extend_from_slice(&head);
        Ok(Pool {
            bytes,
            n_blocks,
            block_bytes,
            block,
        })
    }

    /// Fills `out` (whole rows of `row_blocks` blocks) for rows starting at `row0`.
    fn fill_rows(&self, out: &mut [u8], row0: u64, row_blocks: u64, salt: u64) {
        let rb = row_blocks as usize * self.block_bytes;
        for (i, row) in out.chunks_exact_mut(rb).enumerate() {
            let start = (mix(salt ^ (row0 + i as u64)) % self.n_blocks) as usize;
            let a = start * self.block_bytes;
            row.copy_from_slice(&self.bytes[a..a + rb]);
        }
    }
}

/// splitmix64.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e3779b97f4a7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
    z ^ (z >> 31)
}

/// A fill writing rows of `ne` from `pool`, `threads` rows ranges per chunk.
fn pool_fill(pool: Arc<Pool>, ne: &[u64], salt: u64, threads: usize) -> TensorFill {
    let row_blocks = ne[0] / pool.block;
    let rb = row_blocks * pool.block_bytes as u64;
    let n_rows: u64 = ne[1..].iter().product();
    let per_chunk = (CHUNK_BYTES / rb).max(1);
    let n_chunks = n_rows.div_ceil(per_chunk) as usize;
    Box::new(move |w| {
        pipelined(w, n_chunks, |i, buf| {
            let r0 = i as u64 * per_chunk;
            let rows = per_chunk.min(n_rows - r0);
            buf.resize((rows * rb) as usize, 0);
            let per_thread = rows.div_ceil(threads.max(1) as u64).max(1);
            std::thread::scope(|s| {
                for (k, part) in buf.chunks_mut((per_thread * rb) as usize).enumerate() {
                    let pool = &pool;
                    s.spawn(move || {
                        pool.fill_rows(part, r0 + k as u64 * per_thread, row_blocks, salt)
                    });
                }
            });
            Ok(())
        })
    })
}

fn f32_fill(vals: Vec<f32>) -> TensorFill {
    let bytes: Vec<u8> = vals.iter().flat_map(|x| x.to_le_bytes()).collect();
    Box::new(move |w| w.write_all(&bytes))
}

/// Llama 3.1 rope frequency factors (convert_hf_to_gguf.py, LlamaModel).
pub fn llama3_rope_factors(
    head_dim: u32,
    base: f32,
    factor: f32,
    low: f32,
    high: f32,
    orig_ctx: f32,
) -> Vec<f32> {
    let (low_wavelen, high_wavelen) = (orig_ctx / low, orig_ctx / high);
    (0..head_dim / 2)
        .map(|i| {
            let freq = 1.0 / base.powf(2.0 * i as f32 / head_dim as f32);
            let wavelen = 2.0 * std::f32::consts::PI / freq;
            if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor
            } else {
                let smooth = (orig_ctx / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            }
        })
        .collect()
}

/// Writes a synthetic model to `out`.
fn is_bias(r: Role) -> bool {
    matches!(r, Role::Bq | Role::Bk | Role::Bv | Role::Bo)
}

pub fn synth(opts: &SynthOptions, out: &Path) -> Result<WriteSummary> {
    let p = opts.preset;
    let n_layer = opts.layers.unwrap_or(p.n_layer);
    if n_layer == 0 || n_layer > 4096 {
        return Err(ConvertError::Unsupported(format!(
            "--layers {n_layer} (1 to 4096)"
        )));
    }
    let skew = opts.router_skew;
    if !(skew.is_finite() && skew >= 0.0) {
        return Err(ConvertError::Unsupported(format!(
            "--router-skew {skew} (a Zipf exponent: finite and >= 0)"
        )));
    }
    if skew > 0.0 && p.n_expert == 0 {
        let moe: Vec<_> = PRESETS
            .iter()
            .filter(|q| q.n_expert > 0)
            .map(|q| q.name)
            .collect();
        return Err(ConvertError::Unsupported(format!(
            "--router-skew for preset {}, which has no experts (presets with experts: {})",
            p.name,
            moe.join(", ")
        )));
    }
    let vocab = super::input::open_gguf(&opts.vocab_from)?;
    let n_vocab = (vocab.get_str_array("tokenizer.ggml.tokens"))
        .map_err(|err| ConvertError::BadGguf {
            path: opts.vocab_from.clone(),
            err,
        })?
        .len() as u64;
    let e = p.n_embd as u64;
    let hd = match p.head_dim {
        0 => (p.n_embd / p.n_head) as u64,
        d => d as u64,
    };

    let a = p.arch.name();
    let mut md: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::Str(a.into())),
        (
            "general.name".into(),
            Value::Str(format!("strata synthetic {}", p.name)),
        ),
    ];
    if let Some(ft) = opts.target.file_type() {
        md.push(("general.file_type".into(), Value::U32(ft)));
    }
    md.push((router::KEY_PRESET.into(), Value::Str(p.name.into())));
    // the routers of a skewed mixture, by tensor name
    let mut routers: HashMap<String, Vec<f32>> = HashMap::new();
    if p.n_expert > 0 {
        md.push((router::KEY_ROUTER_SKEW.into(), Value::F32(skew)));
    }
    if skew > 0.0 {
        let (n_exp, k) = (p.n_expert as usize, p.n_expert_used as usize);
        let targets = router::target_shares(n_exp, k, f64::from(skew));
        let scales = router::calibrate(&targets, k, opts.seed);
        let mut ranks = Vec::with_capacity(n_layer as usize * n_exp);
        for l in 0..n_layer {
            let order = router::popularity_order(n_exp, opts.seed, l);
            let rows = router::router_rows(p.n_embd as usize, &scales, &order, opts.seed, l);
            routers.insert(format!("blk.{l}.{}", Role::GateInp.suffix()), rows);
            ranks.extend(order);
        }
        md.push((
            router::KEY_EXPERT_RANK.into(),
            Value::Array(crate::gguf::Array::U32(ranks)),
        ));
        let shares = targets.iter().map(|&t| t as f32).collect();
        md.push((
            router::KEY_TARGET_SHARE.into(),
            Value::Array(crate::gguf::Array::F32(shares)),
        ));
    }
    let mut hp = |k: &str, v: Value| md.push((format!("{a}.{k}"), v));
    hp("context_length", Value::U32(p.n_ctx));
    hp("embedding_length", Value::U32(p.n_embd));
    hp("block_count", Value::U32(n_layer));
    hp("feed_forward_length", Value::U32(p.n_ff));
    hp("attention.head_count", Value::U32(p.n_head));
    hp("attention.head_count_kv", Value::U32(p.n_head_kv));
    hp("rope.freq_base", Value::F32(p.rope_base));
    hp("attention.layer_norm_rms_epsilon", Value::F32(p.rms_eps));
    hp("rope.dimension_count", Value::U32(hd as u32));
    if p.head_dim != 0 {
        hp("attention.key_length", Value::U32(hd as u32));
        hp("attention.value_length", Value::U32(hd as u32));
    }
    hp("vocab_size", Value::U32(n_vocab as u32));
    if p.n_swa > 0 {
        hp("attention.sliding_window", Value::U32(p.n_swa));
    }
    if p.rope_linear != 1.0 {
        hp("rope.scaling.type", Value::Str("linear".into()));
        hp("rope.scaling.factor", Value::F32(p.rope_linear));
    }
    if p.n_expert > 0 {
        hp("expert_count", Value::U32(p.n_expert));
        hp("expert_used_count", Value::U32(p.n_expert_used));
        if p.n_ff_exp != 0 {
            hp("expert_feed_forward_length", Value::U32(p.n_ff_exp));
        }
    }
    md.extend(
        vocab
            .metadata
            .iter()
            .filter(|(k, _)| k.starts_with("tokenizer."))
            .cloned(),
    );

    // (name, shape, std); std 0 marks a norm (ones)
    let mut specs: Vec<(String, Vec<u64>, f32)> = vec![
        ("token_embd.weight".into(), vec![e, n_vocab], 1.0),
        ("output_norm.weight".into(), vec![e], 0.0),
        (
            "output.weight".into(),
            vec![e, n_vocab],
            1.0 / (e as f32).sqrt(),
        ),
    ];
    // the architecture's tensors (model/arch/): its required ones
    let dims = crate::model::Hparams {
        n_vocab: n_vocab as u32,
        n_ctx_train: p.n_ctx,
        n_embd: p.n_embd,
        n_layer,
        n_ff: p.n_ff,
        n_head: p.n_head,
        n_head_kv: p.n_head_kv,
        head_dim: hd as u32,
        n_rot: hd as u32,
        rms_eps: p.rms_eps,
        rope_freq_base: p.rope_base,
        rope_freq_scale: 1.0,
        n_ctx_orig: p.n_ctx,
        kq_scale: 1.0 / (hd as f32).sqrt(),
        n_swa: 0,
        swa_pattern: 1,
        rope_freq_base_swa: p.rope_base,
        q_scale: 1.0,
        embd_scale: 1.0,
        n_expert: p.n_expert,
        n_expert_used: p.n_expert_used,
        n_ff_exp: if p.n_ff_exp == 0 { p.n_ff } else { p.n_ff_exp },
        layer0: 0,
    };
    let spec = p.arch.spec();
    let ffn = spec.ffn_tensors(p.n_expert).ok_or_else(|| {
        ConvertError::Unsupported(format!(
            "preset {}: {} with {} experts",
            p.name,
            p.arch.name(),
            p.n_expert
        ))
    })?;
    for l in 0..n_layer {
        for x in spec.attn.iter().chain(ffn) {
            if x.need != Need::Required {
                continue;
            }
            let ne = x.shape.ne(&dims);
            // biases small, norms ones (std 0), matrices 1/sqrt(fan_in)
            let std = if is_bias(x.role) {
                0.02
            } else if x.role.is_norm_or_bias() {
                0.0
            } else {
                1.0 / (ne[0] as f32).sqrt()
            };
            specs.push((format!("blk.{l}.{}", x.role.suffix()), ne, std));
        }
    }

    let model_info = quant::MixInfo {
        n_layer,
        n_expert: p.n_expert,
        has_output: specs.iter().any(|s| s.0 == "output.weight"),
    };
    let mut pools: HashMap<(u32, u32), Arc<Pool>> = HashMap::new();
    let mut tensors = Vec::with_capacity(specs.len() + 1);
    if p.llama3_rope {
        let f = llama3_rope_factors(hd as u32, p.rope_base, 8.0, 1.0, 4.0, 8192.0);
        tensors.push(OutTensor {
            name: "rope_freqs.weight".into(),
            ne: vec![hd / 2],
            ty: GgmlType::F32,
            fill: f32_fill(f),
        });
    }
    for (i, (name, ne, std)) in specs.into_iter().enumerate() {
        let ty = quant::choose_type(&name, &ne, GgmlType::F32, Some(opts.target), &model_info);
        let fill = if let Some(rows) = routers.remove(&name) {
            // routers stay f32 (quant::allows_quantization)
            if ty != GgmlType::F32 {
                return Err(ConvertError::Unsupported(format!(
                    "{name} as {}: a skewed router is written in f32",
                    ty.name()
                )));
            }
            f32_fill(rows)
        } else if std == 0.0 {
            f32_fill(vec![1.0; ne[0] as usize])
        } else {
            quant::check_target(&name, ty, ne[0])?;
            if ne[0] as usize > POOL / 2 {
                return Err(ConvertError::Unsupported(format!(
                    "rows of {} values",
                    ne[0]
                )));
            }
            let key = (ty.0, std.to_bits());
            let pool = match pools.get(&key) {
                Some(pool) => pool.clone(),
                None => {
                    let seed = mix(opts.seed ^ mix(u64::from(key.0) << 32 | u64::from(key.1)));
                    let pool = Arc::new(Pool::new(ty, std, seed, opts.threads)?);
                    pools.insert(key, pool.clone());
                    pool
                }
            };
            let ne2 = if ne.len() == 1 {
                vec![ne[0], 1]
            } else {
                ne.clone()
            };
            pool_fill(pool, &ne2, mix(opts.seed ^ (i as u64) << 40), opts.threads)
        };
        tensors.push(OutTensor { name, ne, ty, fill });
    }
    let model = OutputModel {
        metadata: md,
        tensors,
        n_layer,
    };
    write_model(model, out, opts.progress)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(preset: &str, router_skew: f32) -> SynthOptions {
        SynthOptions {
            preset: super::preset(preset).expect("preset"),
            target: quant::Target::Type(GgmlType::Q8_0),
            layers: None,
            // never opened: the options are refused first
            vocab_from: PathBuf::from("/nonexistent/vocab.gguf"),
            seed: 1,
            router_skew,
            threads: 1,
            progress: false,
        }
    }

    #[test]
    fn synth_router_skew_is_refused_for_dense_presets_and_bad_values() {
        let out = Path::new("/nonexistent/out.gguf");
        let e = synth(&opts("llama3-8b", 1.0), out).unwrap_err().to_string();
        assert!(
            e.contains("no experts") && e.contains("qwen3-30b-a3b"),
            "{e}"
        );
        for bad in [-0.5, f32::NAN, f32::INFINITY] {
            let e = synth(&opts("mixtral-tiny", bad), out)
                .unwrap_err()
                .to_string();
            assert!(e.contains("finite and >= 0"), "{bad}: {e}");
        }
        // S = 0 on a dense preset is today's model: not refused (fails later,
        // opening the vocabulary)
        let e = synth(&opts("tiny", 0.0), out).unwrap_err().to_string();
        assert!(e.contains("/nonexistent/vocab.gguf"), "{e}");
    }
}
