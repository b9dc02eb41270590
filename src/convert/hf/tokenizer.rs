//! Tokenizer files -> `tokenizer.*` metadata that llama.cpp's vocabulary
//! code loads, following convert_hf_to_gguf.py (`get_vocab_base`,
//! `_set_vocab_gpt2`, `_set_vocab_sentencepiece`, `gguf.SpecialVocab`):
//!
//! - with a SentencePiece tokenizer.model: the "llama" vocabulary
//!   ([`super::sentencepiece`]);
//! - otherwise byte-level BPE from tokenizer.json ("gpt2"): ids without a
//!   token become `[PAD{id}]` (UNUSED); added tokens are CONTROL when marked
//!   special or when they look special (`<|...|>`, `<pad>`, `<unused...>`),
//!   else USER_DEFINED; everything else NORMAL; merges as "left right"
//!   strings (both JSON spellings accepted); the pre-tokenizer type
//!   recognized from tokenizer.json's pre_tokenizer (the regexes of
//!   llama.cpp's llama-vocab.cpp), or given;
//! - both: special ids from tokenizer_config.json's `*_token` entries,
//!   falling back to config.json's `*_token_id`; add_bos/add_eos from
//!   tokenizer_config.json, else from the post-processor template; the chat
//!   template from chat_template.jinja or tokenizer_config.json (string or
//!   named list).

use super::super::error::ConvertError;
use super::super::error::Result;
use crate::gguf::{Array, Value};
use serde_json::Value as Json;
use std::collections::HashMap;
use std::path::Path;

type Metadata = Vec<(String, Value)>;

const NORMAL: i32 = 1;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const UNUSED: i32 = 5;

const LLAMA3_RE: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_RE: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const TEKKEN_RE: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn tok_err(s: String) -> ConvertError {
    ConvertError::Tokenizer(s)
}

fn read_json(path: &Path) -> Result<Json> {
    let text = std::fs::read_to_string(path).map_err(ConvertError::io(path))?;
    serde_json::from_str(&text).map_err(|e| ConvertError::Json {
        file: path.to_path_buf(),
        problem: e.to_string(),
    })
}

/// What kind of pre-tokenizer one tokenizer.json element is.
fn pre_parts(p: &Json) -> Vec<String> {
    match p.get("type").and_then(Json::as_str) {
        Some("Sequence") => p
            .get("pretokenizers")
            .and_then(Json::as_array)
            .map(|a| a.iter().flat_map(pre_parts).collect())
            .unwrap_or_default(),
        Some("Split") => {
            let re = p
                .pointer("/pattern/Regex")
                .and_then(Json::as_str)
                .unwrap_or("?");
            vec![format!("Split({re})")]
        }
        Some("ByteLevel") => {
            let re = p.get("use_regex").and_then(Json::as_bool).unwrap_or(true);
            vec![format!("ByteLevel(regex={re})")]
        }
        Some("Digits") => {
            let ind = p
                .get("individual_digits")
                .and_then(Json::as_bool)
                .unwrap_or(false);
            vec![format!("Digits(individual={ind})")]
        }
        Some(other) => vec![other.to_string()],
        None => vec!["none".into()],
    }
}

/// llama.cpp's pre-tokenizer name for tokenizer.json's `pre_tokenizer`.
pub fn detect_pre(tj: &Json) -> Result<&'static str> {
    let parts = pre_parts(tj.get("pre_tokenizer").unwrap_or(&Json::Null));
    let split = |re: &str| format!("Split({re})");
    let p: Vec<&str> = parts.iter().map(String::as_str).collect();
    let name = match p.as_slice() {
        ["ByteLevel(regex=true)"] => "gpt-2",
        ["Digits(individual=true)", "ByteLevel(regex=true)"] => "smollm",
        [s, "ByteLevel(regex=false)"] if *s == split(LLAMA3_RE) => "llama-bpe",
        [s, "ByteLevel(regex=false)"] if *s == split(QWEN2_RE) => "qwen2",
        [s, "ByteLevel(regex=false)"] if *s == split(TEKKEN_RE) => "tekken",
        _ => {
            return Err(tok_err(format!(
                "pre-tokenizer {parts:?} is not one llama.cpp is known to match; pass --pre NAME (e.g. llama-bpe, qwen2, gpt-2, smollm, tekken)"
            )))
        }
    };
    Ok(name)
}

fn looks_special(t: &str) -> bool {
    matches!(t, "<pad>" | "<mask>" | "<2mass>" | "[@BOS@]")
        || (t.starts_with("<|") && t.ends_with("|>"))
        || (t.starts_with("<｜") && t.ends_with("｜>"))
        || (t.starts_with("<unused") && t.ends_with('>'))
}

/// A token's content in tokenizer_config.json: a string or `{"content": ..}`.
fn content(v: &Json) -> Option<&str> {
    v.as_str()
        .or_else(|| v.get("content").and_then(Json::as_str))
}

/// The `tokenizer.*` metadata for the model in `dir` with `n_vocab` rows:
/// from tokenizer.model when present (as convert_hf_to_gguf.py prefers it),
/// else from tokenizer.json.
pub fn metadata(
    dir: &Path,
    config: &Json,
    n_vocab: u64,
    pre: Option<&str>,
) -> Result<Vec<(String, Value)>> {
    let tcp = dir.join("tokenizer_config.json");
    let tc = if tcp.is_file() {
        read_json(&tcp)?
    } else {
        Json::Null
    };
    let tjp = dir.join("tokenizer.json");
    let (tj, mut md, ids) = if dir.join("tokenizer.model").is_file() {
        let tj = if tjp.is_file() {
            read_json(&tjp)?
        } else {
            Json::Null
        };
        let (tokens, scores, types) = super::sentencepiece::vocab(dir, &tc, n_vocab)?;
        let ids: HashMap<String, u64> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u64))
            .collect();
        let md = vec![
            ("tokenizer.ggml.model".into(), Value::Str("llama".into())),
            (
                "tokenizer.ggml.pre".into(),
                Value::Str(pre.unwrap_or("default").into()),
            ),
            (
                "tokenizer.ggml.tokens".into(),
                Value::Array(Array::Str(tokens)),
            ),
            (
                "tokenizer.ggml.scores".into(),
                Value::Array(Array::F32(scores)),
            ),
            (
                "tokenizer.ggml.token_type".into(),
                Value::Array(Array::I32(types)),
            ),
        ];
        (tj, md, ids)
    } else {
        let tj = read_json(&tjp)?;
        let (md, ids) = bpe(&tj, n_vocab, pre)?;
        (tj, md, ids)
    };
    for typ in ["bos", "eos", "unk", "sep", "pad", "cls", "mask"] {
        let from_tc = tc
            .get(format!("{typ}_token"))
            .and_then(content)
            .and_then(|t| ids.get(t).copied());
        let from_cfg = || {
            let v = config.get(format!("{typ}_token_id"))?;
            v.as_u64().or_else(|| v.as_array()?.first()?.as_u64())
        };
        if let Some(id) = from_tc.or_else(from_cfg).filter(|&id| id < n_vocab) {
            // llama.cpp's key names (sic "seperator")
            let key = match typ {
                "unk" => "unknown",
                "sep" => "seperator",
                "pad" => "padding",
                t => t,
            };
            md.push((
                format!("tokenizer.ggml.{key}_token_id"),
                Value::U32(id as u32),
            ));
        }
    }
    let (mut add_bos, mut add_eos) = (
        tc.get("add_bos_token").and_then(Json::as_bool),
        tc.get("add_eos_token").and_then(Json::as_bool),
    );
    if let Some(single) = post_template(&tj) {
        let bos = tc.get("bos_token").and_then(content);
        let eos = tc.get("eos_token").and_then(content);
        add_bos = add_bos.or(Some(
            bos.is_some() && single.first().map(String::as_str) == bos,
        ));
        add_eos = add_eos.or(Some(
            eos.is_some() && single.last().map(String::as_str) == eos,
        ));
    }
    if let Some(b) = add_bos {
        md.push(("tokenizer.ggml.add_bos_token".into(), Value::Bool(b)));
    }
    if let Some(b) = add_eos {
        md.push(("tokenizer.ggml.add_eos_token".into(), Value::Bool(b)));
    }
    md.extend(chat_templates(dir, &tc)?);
    Ok(md)
}

/// The byte-level BPE ("gpt2") vocabulary of tokenizer.json, and the id of
/// every token text.
fn bpe(tj: &Json, n_vocab: u64, pre: Option<&str>) -> Result<(Metadata, HashMap<String, u64>)> {
    let model = tj
        .get("model")
        .ok_or_else(|| tok_err("tokenizer.json has no model".into()))?;
    let ty = model.get("type").and_then(Json::as_str).unwrap_or("?");
    if ty != "BPE" {
        return Err(ConvertError::Unsupported(format!(
            "tokenizer model type {ty} (only byte-level BPE)"
        )));
    }
    if model.get("byte_fallback").and_then(Json::as_bool) == Some(true) {
        return Err(ConvertError::Unsupported(
            "sentencepiece-style tokenizer.json (BPE with byte_fallback) without tokenizer.model; add the checkpoint's tokenizer.model".into(),
        ));
    }
    let pre = match pre {
        Some(p) => p.to_string(),
        None => detect_pre(tj)?.to_string(),
    };
    let vocab = model
        .get("vocab")
        .and_then(Json::as_object)
        .ok_or_else(|| tok_err("model.vocab is not an object".into()))?;
    let mut tokens: Vec<Option<String>> = vec![None; n_vocab as usize];
    let mut types = vec![NORMAL; n_vocab as usize];
    let mut ids: HashMap<String, u64> = HashMap::new();
    let mut put = |tok: &str, id: Option<u64>, what: &str| -> Result<usize> {
        let id = id.ok_or_else(|| tok_err(format!("{what} '{tok}' has no valid id")))?;
        if id >= n_vocab {
            return Err(tok_err(format!(
                "{what} '{tok}' has id {id}, outside the {n_vocab} embedding rows"
            )));
        }
        tokens[id as usize] = Some(tok.to_string());
        ids.insert(tok.to_string(), id);
        Ok(id as usize)
    };
    for (tok, id) in vocab {
        put(tok, id.as_u64(), "token")?;
    }
    let added = tj
        .get("added_tokens")
        .and_then(Json::as_array)
        .cloned()
        .unwrap_or_default();
    for a in &added {
        let tok = a
            .get("content")
            .and_then(Json::as_str)
            .ok_or_else(|| tok_err("added token without content".into()))?;
        let id = put(tok, a.get("id").and_then(Json::as_u64), "added token")?;
        let special = a.get("special").and_then(Json::as_bool).unwrap_or(false);
        types[id] = if special || looks_special(tok) {
            CONTROL
        } else {
            USER_DEFINED
        };
    }
    let tokens: Vec<String> = tokens
        .into_iter()
        .enumerate()
        .map(|(i, t)| {
            t.unwrap_or_else(|| {
                types[i] = UNUSED;
                format!("[PAD{i}]")
            })
        })
        .collect();
    let merges: Vec<String> = match model.get("merges").and_then(Json::as_array) {
        Some(m) => m
            .iter()
            .map(|x| match x {
                Json::String(s) => Some(s.clone()),
                Json::Array(p) => match p.as_slice() {
                    [Json::String(a), Json::String(b)] => Some(format!("{a} {b}")),
                    _ => None,
                },
                _ => None,
            })
            .collect::<Option<_>>()
            .ok_or_else(|| tok_err("model.merges holds something other than pairs".into()))?,
        None => return Err(tok_err("model.merges is missing".into())),
    };
    let md = vec![
        ("tokenizer.ggml.model".into(), Value::Str("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::Str(pre)),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(Array::Str(tokens)),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(Array::I32(types)),
        ),
        (
            "tokenizer.ggml.merges".into(),
            Value::Array(Array::Str(merges)),
        ),
    ];
    Ok((md, ids))
}

/// The special tokens of a TemplateProcessing post-processor's "single"
/// template, in order ("$A" sequences skipped).
fn post_template(tj: &Json) -> Option<Vec<String>> {
    let pp = tj.get("post_processor")?;
    let tp = match pp.get("type").and_then(Json::as_str)? {
        "TemplateProcessing" => pp,
        "Sequence" => pp
            .get("processors")?
            .as_array()?
            .iter()
            .find(|p| p.get("type").and_then(Json::as_str) == Some("TemplateProcessing"))?,
        _ => return None,
    };
    let single = tp.get("single")?.as_array()?;
    Some(
        single
            .iter()
            .filter_map(|x| x.pointer("/SpecialToken/id")?.as_str().map(String::from))
            .collect(),
    )
}

fn chat_templates(dir: &Path, tc: &Json) -> Result<Vec<(String, Value)>> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.is_file() {
        let t = std::fs::read_to_string(&jinja).map_err(ConvertError::io(&jinja))?;
        return Ok(vec![("tokenizer.chat_template".into(), Value::Str(t))]);
    }
    let mut out = Vec::new();
    match tc.get("chat_template") {
        Some(Json::String(t)) => {
            out.push(("tokenizer.chat_template".into(), Value::Str(t.clone())))
        }
        Some(Json::Array(list)) => {
            for item in list {
                let (Some(name), Some(t)) = (
                    item.get("name").and_then(Json::as_str),
                    item.get("template").and_then(Json::as_str),
                ) else {
                    return Err(tok_err(
                        "chat_template list entry without name/template".into(),
                    ));
                };
                let key = if name == "default" {
                    "tokenizer.chat_template".to_string()
                } else {
                    format!("tokenizer.chat_template.{name}")
                };
                out.push((key, Value::Str(t.to_string())));
            }
        }
        _ => {}
    }
    Ok(out)
}
