//! Hugging Face import: tiny checkpoints of each architecture convert to
//! models whose strata and llama.cpp logits match the f64 reference, whose
//! tokenizer equals the GGUF it was derived from, and a SentencePiece
//! tokenizer.model becomes a "llama" vocabulary llama.cpp tokenizes with.

use crate::common::{self, model};
use crate::convert_support::reference::{TinyConfig, TinyModel};
use crate::convert_support::{self as cs, TokenizerStyle};
use crate::{assert_aligned, TEXTS};
use std::path::{Path, PathBuf};
use strata::convert::hf;
use strata::gguf::{GgmlType, GgufFile};

fn tiny(class: &'static str, dtype: &'static str, vocab: usize) -> TinyConfig {
    TinyConfig {
        class,
        hidden: 128,
        n_head: 4,
        n_kv: 2,
        inter: 256,
        n_layer: 2,
        vocab,
        tie: false,
        qkv_bias: false,
        theta: 10000.0,
        eps: 1e-5,
        llama3: None,
        dtype,
        qwen3_head_dim: None,
        moe: None,
    }
}

/// Converts `m` (+ tokenizer from `vocab`) and compares strata and
/// llama.cpp with the f64 reference; returns the output path.
fn hf_matches_reference(
    dir: &Path,
    m: &TinyModel,
    target: Option<GgmlType>,
    bound: f64,
) -> PathBuf {
    let out = dir.join(format!("out-{:?}.gguf", target.map(|t| t.name())));
    hf::convert_hf(
        dir,
        &out,
        &hf::HfOptions {
            target: target.map(strata::convert::quant::Target::Type),
            pre: None,
            threads: 2,
            progress: false,
        },
    )
    .expect("hf conversion");
    assert_aligned(&out);
    let tokens = [1u32, 504, 3458, 282, 4649, 314, 17, 99, 1000, 7];
    let reference: Vec<Vec<f32>> = m
        .forward(&tokens)
        .iter()
        .map(|v| v.iter().map(|&x| x as f32).collect())
        .collect();
    let s = cs::strata_logits(&mut cs::engine(&out), &tokens);
    let l = cs::llama_logits(&out, &tokens);
    let (ns, nl) = (
        cs::worst_nmse(&s, &reference),
        cs::worst_nmse(&l, &reference),
    );
    eprintln!(
        "{} {:?}: NMSE vs f64 reference: strata {ns:.3e}, llama.cpp {nl:.3e}",
        m.cfg.class, target
    );
    assert!(ns <= bound, "{}: strata NMSE {ns} > {bound}", m.cfg.class);
    assert!(
        nl <= bound,
        "{}: llama.cpp NMSE {nl} > {bound}",
        m.cfg.class
    );
    out
}

/// Qwen2's tokenizer (split pre-tokenizer, pair merges, BOS named in
/// config.json) from `vocab` into `dir`, and config.json with its BOS id;
/// returns that config.
fn write_qwen_tokenizer(vocab: &Path, dir: &Path, m: &TinyModel) -> serde_json::Value {
    let pre = cs::split_pre(
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    );
    let style = TokenizerStyle {
        pre_tokenizer: pre,
        pair_merges: true,
        bos_via_config: true,
    };
    let bos = cs::write_tokenizer(vocab, dir, &style);
    let mut cfg = m.config_json();
    cfg["bos_token_id"] = serde_json::json!(bos);
    std::fs::write(dir.join("config.json"), cfg.to_string()).expect("config");
    cfg
}

#[test]
fn hf_llama3_f32_matches_reference() {
    let Some(vocab) = model(common::SMOLLM2) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tmp");
    let mut c = tiny("LlamaForCausalLM", "F32", 49152);
    c.tie = true;
    c.theta = 500000.0;
    c.llama3 = Some((8.0, 1.0, 4.0, 64.0));
    let m = TinyModel::new(c, 1);
    m.write(dir.path(), 1);
    let style = TokenizerStyle {
        pre_tokenizer: cs::smollm_pre(),
        pair_merges: false,
        bos_via_config: false,
    };
    cs::write_tokenizer(&vocab, dir.path(), &style);
    let out = hf_matches_reference(dir.path(), &m, None, 1e-4);
    let f = GgufFile::open(&out).expect("open");
    assert!(f.tensor("rope_freqs.weight").is_some() && f.tensor("output.weight").is_none());
    assert_eq!(
        f.require_tensor("blk.0.attn_q.weight").expect("q").ty,
        GgmlType::F32
    );
    cs::assert_same_tokenizer(&out, &vocab);
    cs::assert_same_tokens(&out, &vocab, &TEXTS);
}

#[test]
fn hf_mistral_f16_matches_reference() {
    let Some(vocab) = model(common::SMOLLM2) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tmp");
    let m = TinyModel::new(tiny("MistralForCausalLM", "F16", 49152), 2);
    m.write(dir.path(), 1);
    let style = TokenizerStyle {
        pre_tokenizer: cs::smollm_pre(),
        pair_merges: true,
        bos_via_config: false,
    };
    cs::write_tokenizer(&vocab, dir.path(), &style);
    let out = hf_matches_reference(dir.path(), &m, None, 1e-4);
    assert_eq!(
        GgufFile::open(&out)
            .expect("o")
            .require_tensor("blk.1.ffn_up.weight")
            .expect("u")
            .ty,
        GgmlType::F16
    );
    // requantized to q8_0: runs, close to the reference
    hf_matches_reference(dir.path(), &m, Some(GgmlType::Q8_0), 1e-2);
}

#[test]
fn hf_qwen2_bf16_sharded_matches_reference() {
    let Some(vocab) = model(common::QWEN2) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tmp");
    let mut c = tiny("Qwen2ForCausalLM", "BF16", 151936);
    c.qkv_bias = true;
    c.theta = 1000000.0;
    c.eps = 1e-6;
    let m = TinyModel::new(c, 3);
    m.write(dir.path(), 3);
    write_qwen_tokenizer(&vocab, dir.path(), &m);
    let out = hf_matches_reference(dir.path(), &m, None, 1e-4);
    let f = GgufFile::open(&out).expect("open");
    assert_eq!(
        f.require_tensor("blk.0.attn_k.bias").expect("bias").ty,
        GgmlType::F32
    );
    assert_eq!(
        f.require_tensor("blk.0.attn_k.weight").expect("k").ty,
        GgmlType::BF16
    );
    cs::assert_same_tokenizer(&out, &vocab);
    cs::assert_same_tokens(&out, &vocab, &TEXTS);
}

#[test]
fn hf_qwen3_bf16_matches_reference() {
    let Some(vocab) = model(common::QWEN2) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tmp");
    let mut c = tiny("Qwen3ForCausalLM", "BF16", 151936);
    // as every Qwen3: a head dimension of its own (here 64, not 128 / 4)
    c.qwen3_head_dim = Some(64);
    c.theta = 1000000.0;
    c.eps = 1e-6;
    let m = TinyModel::new(c, 4);
    m.write(dir.path(), 1);
    write_qwen_tokenizer(&vocab, dir.path(), &m);
    let out = hf_matches_reference(dir.path(), &m, None, 1e-4);
    let f = GgufFile::open(&out).expect("open");
    assert_eq!(f.get_str("general.architecture").expect("arch"), "qwen3");
    assert_eq!(
        f.require_tensor("blk.1.attn_k_norm.weight")
            .expect("k norm")
            .ne,
        vec![64]
    );
    assert!(f.tensor("blk.0.attn_q.bias").is_none());
}

/// Mixtral: 4 experts, 2 used, in Mistral's layout (Q/K permuted for
/// NORM RoPE); the experts' matrices land stacked, expert after expert.
#[test]
fn hf_mixtral_f32_matches_reference() {
    let Some(vocab) = model(common::SMOLLM2) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tmp");
    let mut c = tiny("MixtralForCausalLM", "F32", 49152);
    c.moe = Some((4, 2, 96));
    let m = TinyModel::new(c, 6);
    m.write(dir.path(), 2);
    let style = TokenizerStyle {
        pre_tokenizer: cs::smollm_pre(),
        pair_merges: true,
        bos_via_config: false,
    };
    cs::write_tokenizer(&vocab, dir.path(), &style);
    let out = hf_matches_reference(dir.path(), &m, None, 1e-4);
    let f = GgufFile::open(&out).expect("open");
    assert_eq!(f.get_str("general.architecture").expect("arch"), "llama");
    assert_eq!(f.get_u32("llama.expert_count").expect("experts"), 4);
    assert_eq!(f.get_u32("llama.expert_used_count").expect("used"), 2);
    let down = f
        .require_tensor("blk.1.ffn_down_exps.weight")
        .expect("down");
    assert_eq!(down.ne, vec![96, 128, 4]);
    assert_eq!(
        f.require_tensor("blk.0.ffn_gate_inp.weight")
            .expect("router")
            .ne,
        vec![128, 4]
    );
    // and requantized to q8_0 (the router stays F32, as llama.cpp keeps it)
    let q = hf_matches_reference(dir.path(), &m, Some(GgmlType::Q8_0), 1e-2);
    let f = GgufFile::open(&q).expect("open");
    assert_eq!(
        f.require_tensor("blk.0.ffn_gate_inp.weight")
            .expect("router")
            .ty,
        GgmlType::F32
    );
    assert_eq!(
        f.require_tensor("blk.0.ffn_up_exps.weight").expect("up").ty,
        GgmlType::Q8_0
    );
}

/// Qwen3-MoE: Qwen3's attention, 8 experts of their own width, 2 used, the
/// top-k weights renormalized (norm_topk_prob), BF16.
#[test]
fn hf_qwen3moe_bf16_matches_reference() {
    let Some(vocab) = model(common::QWEN2) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tmp");
    let mut c = tiny("Qwen3MoeForCausalLM", "BF16", 151936);
    c.qwen3_head_dim = Some(64);
    c.theta = 1000000.0;
    c.eps = 1e-6;
    c.moe = Some((8, 2, 64));
    let m = TinyModel::new(c, 7);
    m.write(dir.path(), 1);
    let mut cfg = write_qwen_tokenizer(&vocab, dir.path(), &m);
    let out = hf_matches_reference(dir.path(), &m, None, 1e-4);
    let f = GgufFile::open(&out).expect("open");
    assert_eq!(f.get_str("general.architecture").expect("arch"), "qwen3moe");
    assert_eq!(
        f.get_u32("qwen3moe.expert_feed_forward_length")
            .expect("width"),
        64
    );
    assert_eq!(
        f.require_tensor("blk.0.ffn_gate_exps.weight")
            .expect("gate")
            .ne,
        vec![128, 64, 8]
    );
    // a checkpoint whose top-k weights are not renormalized is refused
    cfg["norm_topk_prob"] = serde_json::json!(false);
    std::fs::write(dir.path().join("config.json"), cfg.to_string()).expect("config");
    let err = hf::convert_hf(
        dir.path(),
        &dir.path().join("refused.gguf"),
        &hf::HfOptions {
            target: None,
            pre: None,
            threads: 2,
            progress: false,
        },
    )
    .expect_err("refused");
    assert!(err.to_string().contains("norm_topk_prob"), "{err}");
}

/// A protobuf `ModelProto` with `pieces` (text, score, type) and a
/// trainer_spec field the reader must skip.
fn sentencepiece_model(pieces: &[(String, f32, u64)]) -> Vec<u8> {
    fn varint(out: &mut Vec<u8>, mut v: u64) {
        while v >= 0x80 {
            out.push((v as u8) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }
    let mut out = vec![0x12, 3, 0x08, 0x96, 0x01]; // field 2 (trainer_spec), 3 bytes
    for (text, score, ty) in pieces {
        let mut m = vec![0x0a];
        varint(&mut m, text.len() as u64);
        m.extend_from_slice(text.as_bytes());
        m.push(0x15);
        m.extend_from_slice(&score.to_le_bytes());
        m.push(0x18);
        varint(&mut m, *ty);
        out.push(0x0a);
        varint(&mut out, m.len() as u64);
        out.extend_from_slice(&m);
    }
    out
}

#[test]
fn hf_sentencepiece_tokenizer() {
    let dir = tempfile::tempdir().expect("tmp");
    let mut c = tiny("MistralForCausalLM", "BF16", 300);
    c.hidden = 64;
    TinyModel::new(c, 4).write(dir.path(), 1);
    let mut pieces: Vec<(String, f32, u64)> = vec![
        ("<unk>".into(), 0.0, 2),
        ("<s>".into(), 0.0, 3),
        ("</s>".into(), 0.0, 3),
    ];
    pieces.extend((0..=255).map(|b| (format!("<0x{b:02X}>"), 0.0, 6)));
    let normal = [
        "▁", "t", "h", "e", "c", "a", "▁t", "he", "▁the", "at", "▁c", "▁cat",
    ];
    pieces.extend(
        normal
            .iter()
            .enumerate()
            .map(|(i, p)| (p.to_string(), -(i as f32) - 1.0, 1)),
    );
    std::fs::write(
        dir.path().join("tokenizer.model"),
        sentencepiece_model(&pieces),
    )
    .expect("spm");
    let tc = serde_json::json!({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "added_tokens_decoder": {"271": {"content": "<|im_start|>", "special": true}}});
    std::fs::write(dir.path().join("tokenizer_config.json"), tc.to_string()).expect("tc");
    let out = dir.path().join("out.gguf");
    hf::convert_hf(
        dir.path(),
        &out,
        &hf::HfOptions {
            target: None,
            pre: None,
            threads: 2,
            progress: false,
        },
    )
    .expect("spm conversion");
    let f = GgufFile::open(&out).expect("open");
    assert_eq!(f.get_str("tokenizer.ggml.model").ok(), Some("llama"));
    let types = f.get_i32_array("tokenizer.ggml.token_type").expect("types");
    assert_eq!(
        (types[0], types[1], types[3], types[259], types[271], types[299]),
        (2, 3, 6, 1, 3, 5)
    );
    assert_eq!(f.get_u32("tokenizer.ggml.eos_token_id").ok(), Some(2));
    let lm = strata::llama::LlamaModel::load(&out, true, 0).expect("llama.cpp loads the vocab");
    let id = |p: &str| 259 + normal.iter().position(|x| *x == p).expect("piece") as u32;
    assert_eq!(
        lm.tokenize("the cat", true, false).expect("tok"),
        vec![1, id("▁the"), id("▁cat")]
    );
    assert!(cs::all_finite(&cs::strata_logits(
        &mut cs::engine(&out),
        &[1, id("▁the")]
    )));
    // a truncated tokenizer.model is refused by name
    let spm = std::fs::read(dir.path().join("tokenizer.model")).expect("read");
    std::fs::write(dir.path().join("tokenizer.model"), &spm[..spm.len() - 3]).expect("w");
    std::fs::remove_file(&out).expect("rm");
    let e = hf::convert_hf(
        dir.path(),
        &out,
        &hf::HfOptions {
            target: None,
            pre: None,
            threads: 1,
            progress: false,
        },
    );
    let msg = e.expect_err("truncated tokenizer.model").to_string();
    assert!(msg.contains("tokenizer.model") && !out.exists(), "{msg}");
}
