//! `strata-convert hf`: a Hugging Face model directory (config.json,
//! model.safetensors or shards + index, tokenizer.json,
//! tokenizer_config.json) of LlamaForCausalLM, MistralForCausalLM,
//! MixtralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM or
//! Qwen3MoeForCausalLM to a strata-aligned GGUF. A mixture of experts'
//! per-expert matrices are stacked into one GGUF tensor per kind
//! (`ffn_{gate,up,down}_exps`, expert after expert), as
//! convert_hf_to_gguf.py writes them.
//!
//! Everything is checked before writing starts: config.json values, every
//! safetensors header ([`safetensors`]), that each checkpoint tensor maps to
//! a GGUF name (llama.cpp's tensor names) and has exactly the shape
//! config.json implies, that none is missing, and the tokenizer. Weights are
//! then streamed in row chunks: decoded (F32/F16/BF16 via `half`), Q and K
//! rows permuted for Llama/Mistral (convert_hf_to_gguf.py
//! `LlamaModel.permute`: within each head, HF's rotate-half halves become
//! the interleaved pairs of llama.cpp's NORM rope), and converted by ggml to
//! the output type (the checkpoint's own float type by default, f32 for
//! 1-D tensors).

mod config;
pub mod safetensors;
mod sentencepiece;
mod tokenizer;

pub use config::{HfConfig, MoeConfig, MoeNaming, RopeScaling, CLASSES};
pub use tokenizer::detect_pre;

use super::error::ConvertError;
use super::error::Result;
use super::output::{
    pipelined, to_io, write_model, OutTensor, OutputModel, TensorFill, WriteSummary,
};
use super::quant;
use super::synth::llama3_rope_factors;
use crate::dtype::GgmlType;
use crate::gguf::Value;
use safetensors::{Checkpoint, Dtype, StTensor};
use std::path::Path;
use std::sync::Arc;

/// Options of [`convert_hf`].
#[derive(Clone, Debug)]
pub struct HfOptions {
    /// Output type of the matrices; `None`: the checkpoint's dtype.
    pub target: Option<quant::Target>,
    /// llama.cpp pre-tokenizer name, overriding detection.
    pub pre: Option<String>,
    pub threads: usize,
    pub progress: bool,
}

/// The GGUF name of a checkpoint tensor: `Ok(None)` for tensors that carry
/// no weights (rotary inv_freq), an error for anything unexpected. An
/// expert's matrix names the stacked tensor it goes into.
fn gguf_name(hf: &str, c: &HfConfig) -> Result<Option<String>> {
    let unexpected = || ConvertError::UnexpectedTensor(hf.to_string());
    Ok(Some(match hf {
        "model.embed_tokens.weight" => "token_embd.weight".into(),
        "model.norm.weight" => "output_norm.weight".into(),
        "lm_head.weight" => "output.weight".into(),
        _ => {
            let rest = hf.strip_prefix("model.layers.").ok_or_else(unexpected)?;
            let (l, suffix) = rest.split_once('.').ok_or_else(unexpected)?;
            let l: u64 = l.parse().map_err(|_| unexpected())?;
            if l >= c.n_layer {
                return Err(unexpected());
            }
            if let Some(m) = c.moe {
                if suffix == m.naming.router() {
                    return Ok(Some(format!("blk.{l}.ffn_gate_inp.weight")));
                }
                if let Some((e, k)) = m.naming.parse_expert(suffix) {
                    if e >= m.n_expert {
                        return Err(unexpected());
                    }
                    let g = ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"][k];
                    return Ok(Some(format!("blk.{l}.{g}.weight")));
                }
            }
            let g = match suffix {
                "self_attn.rotary_emb.inv_freq" => return Ok(None),
                "input_layernorm.weight" => "attn_norm.weight",
                "self_attn.q_proj.weight" => "attn_q.weight",
                "self_attn.q_proj.bias" => "attn_q.bias",
                "self_attn.k_proj.weight" => "attn_k.weight",
                "self_attn.k_proj.bias" => "attn_k.bias",
                "self_attn.q_norm.weight" => "attn_q_norm.weight",
                "self_attn.k_norm.weight" => "attn_k_norm.weight",
                "self_attn.v_proj.weight" => "attn_v.weight",
                "self_attn.v_proj.bias" => "attn_v.bias",
                "self_attn.o_proj.weight" => "attn_output.weight",
                "self_attn.o_proj.bias" => "attn_output.bias",
                "post_attention_layernorm.weight" => "ffn_norm.weight",
                "mlp.gate_proj.weight" if c.moe.is_none() => "ffn_gate.weight",
                "mlp.up_proj.weight" if c.moe.is_none() => "ffn_up.weight",
                "mlp.down_proj.weight" if c.moe.is_none() => "ffn_down.weight",
                _ => return Err(unexpected()),
            };
            format!("blk.{l}.{g}")
        }
    }))
}

/// One GGUF tensor and where it comes from: one checkpoint tensor, or
/// several of one shape stacked (the experts), each of `shape` (PyTorch
/// order).
struct Expected {
    sources: Vec<String>,
    gguf: String,
    shape: Vec<u64>,
    stacked: bool,
}

impl Expected {
    /// The GGUF shape (ggml order): a stack adds the sources as the
    /// outermost dimension.
    fn ne(&self) -> Vec<u64> {
        let mut ne: Vec<u64> = self.shape.iter().rev().copied().collect();
        if self.stacked {
            ne.push(self.sources.len() as u64);
        }
        ne
    }
}

/// Every GGUF tensor the config requires and its sources.
fn expected(c: &HfConfig) -> Vec<Expected> {
    let one = |hf: String, gguf: String, shape: Vec<u64>| Expected {
        sources: vec![hf],
        gguf,
        shape,
        stacked: false,
    };
    let (h, q, kv) = (c.hidden, c.n_head * c.head_dim, c.n_kv * c.head_dim);
    let mut v = vec![
        one(
            "model.embed_tokens.weight".into(),
            "token_embd.weight".into(),
            vec![c.vocab, h],
        ),
        one(
            "model.norm.weight".into(),
            "output_norm.weight".into(),
            vec![h],
        ),
    ];
    if !c.tie {
        v.push(one(
            "lm_head.weight".into(),
            "output.weight".into(),
            vec![c.vocab, h],
        ));
    }
    for l in 0..c.n_layer {
        let mut t = |hf: &str, g: &str, shape: Vec<u64>| {
            v.push(one(
                format!("model.layers.{l}.{hf}"),
                format!("blk.{l}.{g}"),
                shape,
            ))
        };
        t("input_layernorm.weight", "attn_norm.weight", vec![h]);
        t("self_attn.q_proj.weight", "attn_q.weight", vec![q, h]);
        t("self_attn.k_proj.weight", "attn_k.weight", vec![kv, h]);
        t("self_attn.v_proj.weight", "attn_v.weight", vec![kv, h]);
        if c.qkv_bias {
            t("self_attn.q_proj.bias", "attn_q.bias", vec![q]);
            t("self_attn.k_proj.bias", "attn_k.bias", vec![kv]);
            t("self_attn.v_proj.bias", "attn_v.bias", vec![kv]);
        }
        if c.qk_norm {
            t(
                "self_attn.q_norm.weight",
                "attn_q_norm.weight",
                vec![c.head_dim],
            );
            t(
                "self_attn.k_norm.weight",
                "attn_k_norm.weight",
                vec![c.head_dim],
            );
        }
        t("self_attn.o_proj.weight", "attn_output.weight", vec![h, q]);
        if c.o_bias {
            t("self_attn.o_proj.bias", "attn_output.bias", vec![h]);
        }
        t(
            "post_attention_layernorm.weight",
            "ffn_norm.weight",
            vec![h],
        );
        let Some(m) = c.moe else {
            t("mlp.gate_proj.weight", "ffn_gate.weight", vec![c.inter, h]);
            t("mlp.up_proj.weight", "ffn_up.weight", vec![c.inter, h]);
            t("mlp.down_proj.weight", "ffn_down.weight", vec![h, c.inter]);
            continue;
        };
        t(
            m.naming.router(),
            "ffn_gate_inp.weight",
            vec![m.n_expert, h],
        );
        // each expert's gate, up, down, stacked expert after expert
        for (k, (g, shape)) in [
            ("ffn_gate_exps", vec![m.inter, h]),
            ("ffn_up_exps", vec![m.inter, h]),
            ("ffn_down_exps", vec![h, m.inter]),
        ]
        .into_iter()
        .enumerate()
        {
            v.push(Expected {
                sources: (0..m.n_expert)
                    .map(|e| format!("model.layers.{l}.{}", m.naming.expert(e)[k]))
                    .collect(),
                gguf: format!("blk.{l}.{g}.weight"),
                shape,
                stacked: true,
            });
        }
    }
    v
}

/// Rows of source data per chunk.
const CHUNK_BYTES: u64 = 32 << 20;

/// Reorders the rows of whole heads of `hd` rows from HF's rotate-half
/// layout to interleaved pairs: new[2b + a] = old[a * hd/2 + b].
pub fn permute_heads(rows: &[f32], row_len: usize, hd: usize, out: &mut Vec<f32>) {
    out.clear();
    out.resize(rows.len(), 0.0);
    let head = hd * row_len;
    for (src, dst) in rows.chunks_exact(head).zip(out.chunks_exact_mut(head)) {
        for b in 0..hd / 2 {
            for a in 0..2 {
                let (d, s) = (2 * b + a, a * hd / 2 + b);
                dst[d * row_len..(d + 1) * row_len]
                    .copy_from_slice(&src[s * row_len..(s + 1) * row_len]);
            }
        }
    }
}

/// The fill of one tensor: decode, permute (if `hd` is given), convert.
fn tensor_fill(
    ck: Arc<Checkpoint>,
    t: StTensor,
    ty: GgmlType,
    hd: Option<usize>,
    threads: usize,
) -> TensorFill {
    let (n_rows, row_len) = match t.shape.as_slice() {
        [n, k] => (*n as usize, *k as usize),
        [n] if hd.is_some() => (*n as usize, 1), // permuted bias: one value per row
        s => (1, s.iter().product::<u64>() as usize),
    };
    let unit = hd.unwrap_or(1);
    let src_row = row_len * t.dtype.size() as usize;
    let per_chunk = ((CHUNK_BYTES as usize / src_row.max(1)).max(unit) / unit) * unit;
    let n_chunks = n_rows.div_ceil(per_chunk);
    let out_row = if row_len == 1 && n_rows > 1 {
        n_rows
    } else {
        row_len
    };
    Box::new(move |w| {
        if out_row != row_len {
            // a permuted 1-D tensor: convert as one row
            let mut f = vec![0.0; n_rows];
            safetensors::decode(t.dtype, ck.data(&t), &mut f);
            let mut p = Vec::new();
            permute_heads(&f, 1, unit, &mut p);
            let mut buf = Vec::new();
            quant::from_f32(&p, ty, out_row, 1, &mut buf).map_err(to_io)?;
            return w.write_all(&buf);
        }
        pipelined(w, n_chunks, |i, buf| {
            let r0 = i * per_chunk;
            let r1 = (r0 + per_chunk).min(n_rows);
            let src = &ck.data(&t)[r0 * src_row..r1 * src_row];
            let mut f = vec![0.0; (r1 - r0) * row_len];
            safetensors::decode(t.dtype, src, &mut f);
            if let Some(hd) = hd {
                let mut p = Vec::new();
                permute_heads(&f, row_len, hd, &mut p);
                f = p;
            }
            quant::from_f32(&f, ty, row_len, threads, buf).map_err(to_io)
        })
    })
}

/// Converts the Hugging Face model in `dir` to `out`.
pub fn convert_hf(dir: &Path, out: &Path, opts: &HfOptions) -> Result<WriteSummary> {
    let c = HfConfig::read(dir)?;
    let ck = Arc::new(safetensors::open_checkpoint(dir)?);
    for name in ck.tensors.keys() {
        gguf_name(name, &c)?;
    }
    let mut tensors = Vec::new();
    let mut src_types = Vec::new();
    let mut exp = expected(&c);
    if c.tie && ck.tensors.contains_key("lm_head.weight") {
        exp.push(Expected {
            sources: vec!["lm_head.weight".into()],
            gguf: "output.weight".into(),
            shape: vec![c.vocab, c.hidden],
            stacked: false,
        });
    }
    let mix = quant::MixInfo {
        n_layer: c.n_layer as u32,
        n_expert: c.moe.as_ref().map_or(0, |m| m.n_expert as u32),
        has_output: exp.iter().any(|x| x.gguf == "output.weight"),
    };
    for x in exp {
        let mut srcs = Vec::with_capacity(x.sources.len());
        for hf in &x.sources {
            let t = ck
                .tensors
                .get(hf)
                .ok_or_else(|| ConvertError::MissingTensor(hf.clone()))?;
            if t.shape != x.shape {
                return Err(ConvertError::ShapeMismatch {
                    tensor: hf.clone(),
                    found: t.shape.clone(),
                    expected: x.shape.clone(),
                });
            }
            srcs.push(t.clone());
        }
        let ne = x.ne();
        let gname = x.gguf;
        // a stack decodes each source by its own dtype; the output type
        // follows the first (a checkpoint stores its experts alike)
        let src_ty = srcs[0].dtype;
        let ty = match opts.target {
            Some(_) => quant::choose_type(&gname, &ne, GgmlType::F32, opts.target, &mix),
            None => quant::choose_type(&gname, &ne, src_ty.ggml(), None, &mix),
        };
        quant::check_target(&gname, ty, ne[0])?;
        let permute = c.permute_qk() && (gname.contains(".attn_q.") || gname.contains(".attn_k."));
        let hd = permute.then_some(c.head_dim as usize);
        src_types.push(src_ty);
        let fills: Vec<TensorFill> = srcs
            .into_iter()
            .map(|t| tensor_fill(ck.clone(), t, ty, hd, opts.threads))
            .collect();
        let fill: TensorFill = if fills.len() == 1 {
            fills.into_iter().next().expect("one fill")
        } else {
            // expert after expert: each a whole number of rows
            Box::new(move |w| fills.iter().try_for_each(|f| f(w)))
        };
        tensors.push(OutTensor {
            name: gname,
            ne,
            ty,
            fill,
        });
    }
    if let RopeScaling::Llama3 {
        factor,
        low,
        high,
        orig_ctx,
    } = c.rope
    {
        let f = llama3_rope_factors(c.head_dim as u32, c.rope_theta, factor, low, high, orig_ctx);
        let bytes: Vec<u8> = f.iter().flat_map(|x| x.to_le_bytes()).collect();
        tensors.push(OutTensor {
            name: "rope_freqs.weight".into(),
            ne: vec![c.head_dim / 2],
            ty: GgmlType::F32,
            fill: Box::new(move |w| w.write_all(&bytes)),
        });
    }
    let mut md = c.metadata();
    let main_ty = opts
        .target
        .map(quant::Target::main_type)
        .unwrap_or_else(|| {
            let all16 = src_types.iter().all(|&d| d == Dtype::BF16);
            let any32 = src_types.contains(&Dtype::F32);
            if all16 {
                GgmlType::BF16
            } else if any32 {
                GgmlType::F32
            } else {
                GgmlType::F16
            }
        });
    let ft = match opts.target {
        Some(t) => t.file_type(),
        None => quant::file_type(main_ty),
    };
    if let Some(ft) = ft {
        md.push(("general.file_type".into(), Value::U32(ft)));
    }
    md.extend(tokenizer::metadata(
        dir,
        &c.json,
        c.vocab,
        opts.pre.as_deref(),
    )?);
    let model = OutputModel {
        metadata: md,
        tensors,
        n_layer: c.n_layer as u32,
    };
    write_model(model, out, opts.progress)
}
