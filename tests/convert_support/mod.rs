//! Helpers for tests/convert.rs: logits from strata and llama.cpp, a
//! tokenizer.json derived from a GGUF vocabulary, and the tiny checkpoint
//! with its f64 reference forward ([`reference`]).
#![allow(dead_code)]

pub mod reference;

use serde_json::{json, Value as Json};
use std::path::Path;
use strata::engine::{BatchToken, DeviceChoice, Engine, EngineConfig};
use strata::gguf::GgufFile;
use strata::llama::{LlamaModel, Reference, ReferenceConfig};

pub fn engine(path: &Path) -> Engine {
    let cfg = EngineConfig {
        n_ctx: 256,
        n_batch: 64,
        n_threads: 2,
        device: DeviceChoice::Cpu,
        progress: false,
        ..EngineConfig::default()
    };
    Engine::load(path, &cfg).expect("strata loads the model")
}

/// strata's logits at every position of `tokens` (one sequence).
pub fn strata_logits(e: &mut Engine, tokens: &[u32]) -> Vec<Vec<f32>> {
    strata::parity::prompt_logits(e, tokens).expect("strata decode")
}

/// strata's greedy continuation of `prompt`, with every step's logits.
pub fn strata_greedy(e: &mut Engine, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let mut logits = vec![strata_logits(e, prompt).pop().expect("logits")];
    let mut out = Vec::new();
    for step in 0..n {
        let t = strata::sample::argmax(logits.last().expect("logits")).expect("argmax");
        out.push(t);
        if step + 1 == n {
            break;
        }
        let b = BatchToken {
            token: t,
            pos: (prompt.len() + step) as i32,
            seq: 0,
            logits: true,
        };
        logits.push(e.decode(&[b]).expect("decode"));
    }
    (out, logits)
}

/// llama.cpp's logits at every position of `tokens`.
pub fn llama_logits(path: &Path, tokens: &[u32]) -> Vec<Vec<f32>> {
    let lm = LlamaModel::load(path, false, 0).expect("llama.cpp loads the model");
    let cfg = ReferenceConfig {
        n_ctx: 256,
        n_batch: 64,
        n_ubatch: 0,
        n_seq: 1,
        n_threads: 2,
        offload_kqv: true,
    };
    let mut r = Reference::new(&lm, &cfg).expect("llama.cpp context");
    let batch: Vec<_> = (tokens.iter().enumerate())
        .map(|(i, &t)| (t, i as i32, 0, true))
        .collect();
    let all = r.decode(&batch).expect("llama.cpp decode");
    let nv = all.len() / tokens.len();
    all.chunks(nv).map(|c| c.to_vec()).collect()
}

pub fn all_finite(v: &[Vec<f32>]) -> bool {
    v.iter().flatten().all(|x| x.is_finite())
}

/// Worst per-position NMSE of `a` against `b`.
pub fn worst_nmse(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| crate::common::nmse(x, y))
        .fold(0.0, f64::max)
}

/// How the derived tokenizer files spell things.
pub struct TokenizerStyle {
    pub pre_tokenizer: Json,
    /// merges as ["a", "b"] pairs instead of "a b" strings.
    pub pair_merges: bool,
    /// leave bos_token out of tokenizer_config.json (config.json has bos_token_id).
    pub bos_via_config: bool,
}

pub fn split_pre(regex: &str) -> Json {
    json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}]})
}

pub fn smollm_pre() -> Json {
    json!({"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": true},
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}]})
}

/// Writes tokenizer.json and tokenizer_config.json in `dir` holding the
/// vocabulary of `gguf`; returns the bos id for config.json.
pub fn write_tokenizer(gguf: &Path, dir: &Path, style: &TokenizerStyle) -> Option<u32> {
    let f = GgufFile::open(gguf).expect("vocab gguf");
    let tokens = f.get_str_array("tokenizer.ggml.tokens").expect("tokens");
    let types = f.get_i32_array("tokenizer.ggml.token_type").expect("types");
    let merges = f.get_str_array("tokenizer.ggml.merges").expect("merges");
    let mut vocab = serde_json::Map::new();
    let mut added = Vec::new();
    for (i, (t, &ty)) in tokens.iter().zip(types).enumerate() {
        if ty == 5 {
            continue; // [PAD..]: the converter recreates them
        }
        if ty == 3 || ty == 4 {
            added.push(
                json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": ty == 3}),
            );
        }
        vocab.insert(t.clone(), json!(i));
    }
    let merges: Vec<Json> = merges
        .iter()
        .map(|m| match (style.pair_merges, m.split_once(' ')) {
            (true, Some((a, b))) => json!([a, b]),
            _ => json!(m),
        })
        .collect();
    let tj = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added, "normalizer": null,
        "pre_tokenizer": style.pre_tokenizer,
        "post_processor": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": merges},
    });
    std::fs::write(dir.join("tokenizer.json"), tj.to_string()).expect("tokenizer.json");
    let name = |k: &str| {
        f.get_u32_opt(k)
            .ok()
            .flatten()
            .map(|id| json!(tokens[id as usize]))
    };
    let bos = f.get_u32_opt("tokenizer.ggml.bos_token_id").ok().flatten();
    let mut tc = json!({
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "model_max_length": 8192,
    });
    if !style.bos_via_config {
        tc["bos_token"] = json!({"content": name("tokenizer.ggml.bos_token_id"), "special": true});
    }
    if let Ok(Some(b)) = f.get_bool_opt("tokenizer.ggml.add_bos_token") {
        tc["add_bos_token"] = json!(b);
    }
    if let Ok(Some(t)) = f.get_str_opt("tokenizer.chat_template") {
        tc["chat_template"] = json!(t);
    }
    std::fs::write(dir.join("tokenizer_config.json"), tc.to_string()).expect("tokenizer_config");
    bos
}

/// Asserts that the tokenizer metadata of `a` equals that of `b`.
pub fn assert_same_tokenizer(a: &Path, b: &Path) {
    let (fa, fb) = (GgufFile::open(a).expect("a"), GgufFile::open(b).expect("b"));
    for k in fb
        .metadata
        .iter()
        .map(|(k, _)| k)
        .filter(|k| k.starts_with("tokenizer."))
    {
        if k == "tokenizer.ggml.add_space_prefix" {
            continue; // SPM-only key some gpt2 files carry
        }
        assert_eq!(fa.get(k), fb.get(k), "tokenizer key {k} differs");
    }
}

/// Asserts that llama.cpp tokenizes `texts` the same with both files.
pub fn assert_same_tokens(a: &Path, b: &Path, texts: &[&str]) {
    let ma = LlamaModel::load(a, true, 0).expect("vocab a");
    let mb = LlamaModel::load(b, true, 0).expect("vocab b");
    for t in texts {
        let (x, y) = (
            ma.tokenize(t, true, true).expect("tok"),
            mb.tokenize(t, true, true).expect("tok"),
        );
        assert_eq!(x, y, "tokenization of {t:?} differs");
        assert!(!x.is_empty());
    }
}
