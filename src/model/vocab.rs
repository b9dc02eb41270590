//! Checks on a GGUF's tokenizer that libllama asserts on or trusts, made
//! before it sees the file: a duplicated token string aborts the process
//! inside libllama (`id_to_token.size() == token_to_id.size()`), and a
//! vocabulary shorter than the embedding table lets a sampled id reach a
//! lookup that throws a C++ exception Rust cannot catch. Plain Rust.

use super::error::ModelError;
use crate::gguf::{GgufFile, Value};
use std::collections::HashMap;

/// The special-token keys whose ids must name a token.
const SPECIAL_IDS: [&str; 8] = [
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.eot_token_id",
    "tokenizer.ggml.eom_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.seperator_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.mask_token_id",
];

/// Validates `tokenizer.ggml.*`: token strings unique, as many token types
/// (and scores) as tokens, special ids in range, and as many tokens as
/// `token_embd.weight` has rows when the file holds it. A file without a
/// token list has nothing to check here (libllama refuses it itself).
pub fn validate_vocab(f: &GgufFile) -> Result<(), ModelError> {
    let tokens = match f.get("tokenizer.ggml.tokens") {
        None => return Ok(()),
        Some(_) => f.get_str_array("tokenizer.ggml.tokens")?,
    };
    let n = tokens.len();
    let bad = |what: String| ModelError::BadVocab(what);
    if n == 0 {
        return Err(bad("tokenizer.ggml.tokens is empty".into()));
    }
    if let Some(t) = f.tensor("token_embd.weight") {
        if t.ne.get(1).copied() != Some(n as u64) {
            return Err(bad(format!(
                "tokenizer.ggml.tokens has {n} tokens but token_embd.weight has {} rows",
                t.ne.get(1).copied().unwrap_or(0)
            )));
        }
    }
    // libllama reads each token as a C string, up to its first NUL byte:
    // compare what it will see (two tokens equal up to a NUL abort it too)
    let mut seen: HashMap<&str, usize> = HashMap::with_capacity(n);
    for (id, s) in tokens.iter().enumerate() {
        let c = s.split('\0').next().unwrap_or_default();
        if let Some(first) = seen.insert(c, id) {
            return Err(bad(format!(
                "token {id} ({s:?}) duplicates token {first} in tokenizer.ggml.tokens{}",
                if c.len() < s.len() {
                    " (as libllama reads it: up to its NUL byte)"
                } else {
                    ""
                }
            )));
        }
    }
    for key in ["tokenizer.ggml.token_type", "tokenizer.ggml.scores"] {
        if let Some(Value::Array(a)) = f.get(key) {
            if a.len() != n {
                return Err(bad(format!("{key} has {} entries for {n} tokens", a.len())));
            }
        }
    }
    for key in SPECIAL_IDS {
        if let Some(v) = f.get(key) {
            match v.as_integer() {
                // -1 means "none" in some converters
                Some(id) if id == -1 || (0..n as i128).contains(&id) => {}
                _ => {
                    return Err(bad(format!(
                        "{key} = {v:?} names no token (the vocabulary has {n})"
                    )))
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::{Array, GgufWriter};

    fn file(tokens: &[&str]) -> GgufFile {
        let mut w = GgufWriter::new(32);
        let t = tokens.iter().map(|s| s.to_string()).collect();
        w.set("tokenizer.ggml.tokens", Value::Array(Array::Str(t)));
        let mut b = Vec::new();
        w.write_to(&mut b).unwrap();
        GgufFile::parse(&b[..], b.len() as u64).unwrap()
    }

    #[test]
    fn duplicates_are_found_as_libllama_reads_tokens() {
        assert!(validate_vocab(&file(&["a", "b", "c"])).is_ok());
        let e = validate_vocab(&file(&["a", "b", "a"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("token 2") && e.contains("token 0"), "{e}");
        // "b\0x" is "b" to libllama, which then aborts on the duplicate
        let e = validate_vocab(&file(&["a", "b", "b\0x"]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("duplicates token 1") && e.contains("NUL"), "{e}");
    }
}
