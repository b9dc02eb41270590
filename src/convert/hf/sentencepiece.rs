//! SentencePiece `tokenizer.model` (Llama 1/2, Mistral 7B) -> the "llama"
//! GGUF vocabulary, as convert_hf_to_gguf.py `_set_vocab_sentencepiece`
//! writes it: piece texts, scores and types from the model; ids missing
//! from it `[PAD{id}]` (UNUSED, score -10000); entries of
//! tokenizer_config.json's `added_tokens_decoder` override text and type
//! (CONTROL if special or special-looking, else USER_DEFINED) with score
//! -1000; pre-tokenizer "default".
//!
//! The model file is a protobuf `ModelProto`; only field 1 (repeated
//! `SentencePiece { string piece = 1; float score = 2; Type type = 3 }`) is
//! read, by a minimal wire-format reader that skips every other field and
//! fails with the byte offset on anything malformed.

use super::super::error::ConvertError;
use super::super::error::Result;
use serde_json::Value as Json;
use std::path::Path;

fn bad(at: usize, what: &str) -> ConvertError {
    ConvertError::Tokenizer(format!("tokenizer.model: {what} at byte {at}"))
}

struct Wire<'a> {
    b: &'a [u8],
    pos: usize,
}

impl Wire<'_> {
    fn varint(&mut self) -> Result<u64> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let byte = *self
                .b
                .get(self.pos)
                .ok_or_else(|| bad(self.pos, "truncated varint"))?;
            self.pos += 1;
            v |= u64::from(byte & 0x7f) << shift;
            if byte & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(bad(self.pos, "varint longer than 10 bytes"))
    }

    fn take(&mut self, n: u64) -> Result<&[u8]> {
        let end = (self.pos as u64)
            .checked_add(n)
            .filter(|&e| e <= self.b.len() as u64);
        let end = end.ok_or_else(|| bad(self.pos, "field runs past the end"))? as usize;
        let s = &self.b[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    /// Next (field number, wire type), or None at the end.
    fn key(&mut self) -> Result<Option<(u64, u64)>> {
        if self.pos >= self.b.len() {
            return Ok(None);
        }
        let k = self.varint()?;
        Ok(Some((k >> 3, k & 7)))
    }

    /// Reads a field of wire type `wt`: its bytes (LEN, I32, I64) or value (VARINT).
    fn value(&mut self, wt: u64) -> Result<(&[u8], u64)> {
        match wt {
            0 => Ok((&[], self.varint()?)),
            1 => Ok((self.take(8)?, 0)),
            2 => {
                let n = self.varint()?;
                Ok((self.take(n)?, 0))
            }
            5 => Ok((self.take(4)?, 0)),
            _ => Err(bad(self.pos, &format!("unsupported wire type {wt}"))),
        }
    }
}

/// (piece, score, type) of every piece of a `tokenizer.model`.
pub fn read_pieces(bytes: &[u8]) -> Result<Vec<(String, f32, i32)>> {
    let mut w = Wire { b: bytes, pos: 0 };
    let mut out = Vec::new();
    while let Some((field, wt)) = w.key()? {
        let at = w.pos;
        let (data, _) = w.value(wt)?;
        if field != 1 {
            continue;
        }
        if wt != 2 {
            return Err(bad(at, "piece is not a message"));
        }
        let mut p = Wire { b: data, pos: 0 };
        let (mut piece, mut score, mut ty) = (None, 0.0f32, 1i32);
        while let Some((f, t)) = p.key()? {
            let (d, v) = p.value(t)?;
            match (f, t) {
                (1, 2) => {
                    piece = Some(
                        String::from_utf8(d.to_vec()).map_err(|_| bad(at, "piece is not UTF-8"))?,
                    )
                }
                (2, 5) => score = f32::from_le_bytes([d[0], d[1], d[2], d[3]]),
                (3, 0) => ty = v as i32,
                _ => {}
            }
        }
        let piece = piece.ok_or_else(|| bad(at, "piece without text"))?;
        if !(1..=6).contains(&ty) {
            return Err(bad(at, &format!("piece '{piece}' has unknown type {ty}")));
        }
        out.push((piece, score, ty));
    }
    if out.is_empty() {
        return Err(bad(0, "no pieces"));
    }
    Ok(out)
}

fn looks_special(t: &str) -> bool {
    matches!(t, "<pad>" | "<mask>" | "<2mass>" | "[@BOS@]")
        || (t.starts_with("<|") && t.ends_with("|>"))
        || (t.starts_with("<unused") && t.ends_with('>'))
}

/// Tokens, scores and types for `n_vocab` ids.
pub fn vocab(dir: &Path, tc: &Json, n_vocab: u64) -> Result<(Vec<String>, Vec<f32>, Vec<i32>)> {
    let path = dir.join("tokenizer.model");
    let bytes = std::fs::read(&path).map_err(ConvertError::io(&path))?;
    let pieces = read_pieces(&bytes)?;
    let n = n_vocab as usize;
    if pieces.len() > n {
        return Err(ConvertError::Tokenizer(format!(
            "tokenizer.model has {} pieces, more than the {n} embedding rows",
            pieces.len()
        )));
    }
    let mut tokens: Vec<String> = (0..n).map(|i| format!("[PAD{i}]")).collect();
    let mut scores = vec![-10000.0f32; n];
    let mut types = vec![5i32; n];
    for (i, (p, s, t)) in pieces.into_iter().enumerate() {
        (tokens[i], scores[i], types[i]) = (p, s, t);
    }
    if let Some(added) = tc.get("added_tokens_decoder").and_then(Json::as_object) {
        for (id, data) in added {
            let Some(id) = id.parse::<usize>().ok().filter(|&i| i < n) else {
                continue;
            };
            let Some(text) = data.get("content").and_then(Json::as_str) else {
                continue;
            };
            let special = data.get("special").and_then(Json::as_bool).unwrap_or(false);
            (tokens[id], types[id]) = if special || looks_special(text) {
                (text.to_string(), 3)
            } else {
                (text.replace('\u{2581}', " "), 4)
            };
            scores[id] = -1000.0;
        }
    }
    Ok((tokens, scores, types))
}
