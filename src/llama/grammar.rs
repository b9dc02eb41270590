//! llama.cpp's grammar sampler (GBNF, `llama_sampler_init_grammar`) as a
//! [`Constraint`] on strata's sampler: each row is copied into a
//! `llama_token_data_array`, libllama sets the logit of every token the
//! grammar forbids next to `-inf`, and strata's own chain samples from
//! what is left; each emitted token is then accepted into the grammar.
//!
//! Invariants:
//! - libllama aborts the process (`GGML_ABORT`, or a C++ exception thrown
//!   through the C API) when a token the grammar forbids is accepted, so
//!   [`GrammarSampler::accept`] accepts only a token the last
//!   [`GrammarSampler::mask`] allowed and refuses any other with an error.
//! - The grammar reads a token's text with special tokens rendered
//!   (`<|im_start|>` as that text), while answers print control and
//!   unknown tokens as nothing. Such tokens (end-of-generation ones aside)
//!   are always masked, so the text sent is the text the grammar accepted.
//! - End-of-generation tokens are allowed exactly when the grammar is
//!   complete (libllama's rule), so a constrained answer ends with one.

use super::model::LlamaModel;
use crate::sample::{Constraint, SampleError};
use crate::sys;
use std::ffi::CString;
use std::ptr::NonNull;
use std::sync::Arc;

/// llama.cpp's JSON grammar, `grammars/json.gbnf` of llama.cpp (MIT
/// license, Copyright (c) 2023-2024 The ggml authors), copied as is: the
/// vendored archive (vendor/llama.cpp.tar.xz) holds no grammars. A
/// subset of JSON (an object at the top; no `\/` escape; at most 16
/// digits in an integer part or exponent; whitespace bounded to one line
/// break and 20 blanks between tokens): every text it accepts whole is
/// valid JSON.
pub const JSON_GBNF: &str = r#"root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws

object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws

array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws

string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) # escapes
  )* "\"" ws

number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws

# Optional space: by convention, applied in this grammar after literal chars when allowed
ws ::= | " " | "\n" [ \t]{0,20}
"#;

#[derive(Debug, thiserror::Error)]
pub enum GrammarError {
    #[error("the grammar is empty")]
    Empty,
    #[error("the grammar or its root name contains a NUL byte")]
    Nul,
    /// libllama could not parse it, found no rule `root`, or found left
    /// recursion (its log says which).
    #[error("libllama could not parse the grammar (root rule {root:?})")]
    Parse { root: String },
    #[error("a row of {got} logits is shorter than the vocabulary of {n_vocab} tokens")]
    RowSize { got: usize, n_vocab: usize },
    #[error("token {token} is not allowed by the grammar here")]
    NotAllowed { token: u32 },
    /// llama.cpp's JSON-schema converter refused the schema.
    #[error("JSON schema: {0}")]
    Schema(String),
}

impl From<GrammarError> for SampleError {
    fn from(e: GrammarError) -> SampleError {
        SampleError::Constraint(e.to_string())
    }
}

/// An owned libllama grammar sampler and the vocabulary it reads.
pub struct GrammarSampler {
    ptr: NonNull<sys::llama_sampler>,
    /// Keeps the vocabulary the sampler points to alive.
    vocab: Arc<LlamaModel>,
    /// Non-EOG tokens whose answer text differs from the grammar's (control
    /// and unknown tokens): always masked.
    hidden: Vec<u32>,
    /// Scratch: the candidates handed to libllama.
    data: Vec<sys::llama_token_data>,
    /// Which tokens the last `mask` allowed (empty: no mask since the last
    /// accept).
    allowed: Vec<bool>,
}

// SAFETY: the sampler's state is its own (no thread-local or shared
// mutable state); it is used through &mut self only, so from one thread at
// a time. The vocabulary it reads is immutable after load (LlamaModel is
// Sync) and kept alive by `vocab`.
unsafe impl Send for GrammarSampler {}

impl std::fmt::Debug for GrammarSampler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarSampler")
            .field("ptr", &self.ptr)
            .field("hidden", &self.hidden.len())
            .finish()
    }
}

impl GrammarSampler {
    /// Parses `gbnf` with start symbol `root` for `vocab`'s tokens.
    pub fn new(vocab: Arc<LlamaModel>, gbnf: &str, root: &str) -> Result<Self, GrammarError> {
        // libllama takes an empty grammar as "no grammar": refuse it here
        if gbnf.trim().is_empty() {
            return Err(GrammarError::Empty);
        }
        let g = CString::new(gbnf).map_err(|_| GrammarError::Nul)?;
        let r = CString::new(root).map_err(|_| GrammarError::Nul)?;
        let v = vocab.vocab();
        // SAFETY: v is the live vocabulary of `vocab`, which the sampler
        // keeps alive; both strings are NUL-terminated and outlive the call
        // (libllama copies them). Parse errors are caught inside libllama
        // and give NULL.
        let p = unsafe { sys::llama_sampler_init_grammar(v, g.as_ptr(), r.as_ptr()) };
        let ptr = NonNull::new(p).ok_or_else(|| GrammarError::Parse {
            root: root.to_string(),
        })?;
        let special = sys::LLAMA_TOKEN_ATTR_UNKNOWN | sys::LLAMA_TOKEN_ATTR_CONTROL;
        let hidden = (0..vocab.n_vocab())
            .filter(|&t| {
                // SAFETY: plain query of a token id below n_vocab.
                let attr = unsafe { sys::llama_vocab_get_attr(v, t as i32) };
                attr & special != 0 && !vocab.is_eog(t)
            })
            .collect();
        Ok(GrammarSampler {
            ptr,
            vocab,
            hidden,
            data: Vec::new(),
            allowed: Vec::new(),
        })
    }

    /// Sets to `-inf` the logit of every token the grammar forbids next
    /// (`logits`: `F32 [n_vocab]`, or longer where the output head is
    /// padded: ids past the vocabulary have no text and are masked); other
    /// logits are left as they are.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), GrammarError> {
        let n_vocab = self.vocab.n_vocab() as usize;
        if logits.len() < n_vocab {
            return Err(GrammarError::RowSize {
                got: logits.len(),
                n_vocab,
            });
        }
        let (logits, past) = logits.split_at_mut(n_vocab);
        past.fill(f32::NEG_INFINITY);
        for &t in &self.hidden {
            logits[t as usize] = f32::NEG_INFINITY;
        }
        // only tokens still possible go to libllama (it decodes each one's
        // text against the grammar)
        self.data.clear();
        self.data.extend(
            logits
                .iter()
                .enumerate()
                .filter(|(_, l)| **l > f32::NEG_INFINITY)
                .map(|(id, &logit)| sys::llama_token_data {
                    id: id as i32,
                    logit,
                    p: 0.0,
                }),
        );
        let mut arr = sys::llama_token_data_array {
            data: self.data.as_mut_ptr(),
            size: self.data.len(),
            selected: -1,
            sorted: false,
        };
        // SAFETY: `arr` points to `data`, valid for `size` entries, every id
        // below n_vocab; libllama only lowers logits in place (no resize,
        // no reorder) and keeps no pointer to it after the call.
        unsafe { sys::llama_sampler_apply(self.ptr.as_ptr(), &mut arr) };
        self.allowed.clear();
        self.allowed.resize(n_vocab, false);
        for d in &self.data {
            if d.logit > f32::NEG_INFINITY {
                self.allowed[d.id as usize] = true;
            } else {
                logits[d.id as usize] = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    /// Moves the grammar past `token`, which the last [`Self::mask`] must
    /// have allowed (anything else is refused, and the grammar unchanged).
    pub fn accept(&mut self, token: u32) -> Result<(), GrammarError> {
        if self.allowed.get(token as usize) != Some(&true) {
            return Err(GrammarError::NotAllowed { token });
        }
        // SAFETY: the grammar allows `token` here (checked above against the
        // last mask, with no accept since), so libllama neither aborts nor
        // throws.
        unsafe { sys::llama_sampler_accept(self.ptr.as_ptr(), token as i32) };
        self.allowed.clear();
        Ok(())
    }

    /// Back to the grammar's start.
    pub fn reset(&mut self) {
        // SAFETY: live sampler; libllama re-parses the grammar it parsed
        // before (it succeeded then).
        unsafe { sys::llama_sampler_reset(self.ptr.as_ptr()) };
        self.allowed.clear();
    }
}

impl Constraint for GrammarSampler {
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), SampleError> {
        Ok(GrammarSampler::mask(self, logits)?)
    }
    fn accept(&mut self, token: u32) -> Result<(), SampleError> {
        Ok(GrammarSampler::accept(self, token)?)
    }
    fn reset(&mut self) {
        GrammarSampler::reset(self)
    }
}

impl Drop for GrammarSampler {
    fn drop(&mut self) {
        // SAFETY: we own the sampler; nothing else points to it. `vocab`
        // is dropped after this (field order does not matter: the Arc
        // outlives this call).
        unsafe { sys::llama_sampler_free(self.ptr.as_ptr()) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::{Sampler, SamplerConfig};

    /// The SmolLM2 vocabulary (cached test model), or None with a message.
    fn vocab() -> Option<Arc<LlamaModel>> {
        let dir = std::env::var_os("STRATA_MODELS")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| {
                std::path::PathBuf::from(std::env::var("HOME").unwrap_or_default())
                    .join(".cache/strata/models")
            });
        let p = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
        if !p.is_file() {
            eprintln!("skipping: test model {} not found", p.display());
            return None;
        }
        Some(Arc::new(LlamaModel::load(&p, true, 0).expect("vocab")))
    }

    fn json(v: &Arc<LlamaModel>) -> GrammarSampler {
        GrammarSampler::new(v.clone(), JSON_GBNF, "root").expect("json grammar")
    }

    /// Whether `text` is JSON or could become JSON with more text: serde
    /// stops at its end (EOF) rather than at a syntax error.
    fn json_prefix(text: &str) -> bool {
        match serde_json::from_str::<serde_json::Value>(text) {
            Ok(_) => true,
            Err(e) => e.is_eof(),
        }
    }

    #[test]
    fn bad_grammars_are_errors() {
        let Some(v) = vocab() else { return };
        for (g, root) in [
            ("", "root"),
            ("root ::= \"a", "root"),
            ("root ::= other", "root"),
            ("root ::= \"a\"", "start"),
            ("root ::= root \"a\"", "root"),
        ] {
            let e = GrammarSampler::new(v.clone(), g, root);
            assert!(e.is_err(), "{g:?} / {root:?}");
        }
        assert!(matches!(
            GrammarSampler::new(v.clone(), "root ::= \"\0\"", "root"),
            Err(GrammarError::Nul)
        ));
        let mut g = json(&v);
        let mut row = vec![0.0f32; 3];
        assert!(matches!(
            g.mask(&mut row),
            Err(GrammarError::RowSize { got: 3, .. })
        ));
    }

    /// A JSON text, tokenized, passes the grammar token by token; EOG is
    /// refused until the object closes and allowed after; a token the
    /// grammar forbids is refused with an error, not an abort.
    #[test]
    fn json_text_passes_and_other_text_is_refused() {
        let Some(v) = vocab() else { return };
        let n = v.n_vocab() as usize;
        let eog: Vec<u32> = (0..n as u32).filter(|&t| v.is_eog(t)).collect();
        assert!(!eog.is_empty());
        let mut g = json(&v);
        let text = r#"{"name": "Ann", "age": 31, "tags": ["a\n", true, null, -2.5e3], "x": {}}"#;
        let toks = v.tokenize(text, false, false).unwrap();
        for (i, &t) in toks.iter().enumerate() {
            let mut row = vec![0.0f32; n];
            g.mask(&mut row).unwrap();
            assert!(row[t as usize].is_finite(), "token {i} ({t}) of {text}");
            assert!(eog.iter().all(|&e| row[e as usize] == f32::NEG_INFINITY));
            g.accept(t).unwrap();
        }
        let mut row = vec![0.0f32; n];
        g.mask(&mut row).unwrap();
        assert!(eog.iter().all(|&e| row[e as usize].is_finite()));
        // a second object after the first is not JSON
        let brace = v.tokenize("{", false, false).unwrap()[0];
        assert_eq!(row[brace as usize], f32::NEG_INFINITY);
        assert!(matches!(
            g.accept(brace),
            Err(GrammarError::NotAllowed { .. })
        ));
        // at the start only an object may begin
        let mut g = json(&v);
        let mut row = vec![0.0f32; n];
        g.mask(&mut row).unwrap();
        let allowed: Vec<u32> = (0..n as u32)
            .filter(|&t| row[t as usize].is_finite())
            .collect();
        assert!(!allowed.is_empty());
        for &t in &allowed {
            let s = String::from_utf8_lossy(&v.token_bytes(t, false)).into_owned();
            assert!(s.starts_with('{'), "{t}: {s:?}");
        }
        let quote = v.tokenize("\"", false, false).unwrap()[0];
        assert!(g.accept(quote).is_err());
        // reset: the start again
        g.accept(allowed[0]).unwrap();
        g.reset();
        let mut row2 = vec![0.0f32; n];
        g.mask(&mut row2).unwrap();
        assert_eq!(row, row2);
    }

    /// Random logits sampled under the grammar (strata's chain at
    /// temperature 1) always spell a JSON prefix, and whole JSON when the
    /// grammar lets an EOG token through and the sampler takes it.
    #[test]
    fn sampling_under_the_grammar_spells_json() {
        use rand_chacha::rand_core::{RngCore, SeedableRng};
        let Some(v) = vocab() else { return };
        let n = v.n_vocab() as usize;
        let mut ended = 0;
        for seed in 0..4u64 {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            let mut s = Sampler::new(SamplerConfig {
                temperature: 1.0,
                top_k: 0,
                top_p: 1.0,
                min_p: 0.0,
                seed,
                ..SamplerConfig::default()
            })
            .unwrap();
            s.constrain(Box::new(json(&v)));
            let mut text = Vec::new();
            for _ in 0..60 {
                let mut row: Vec<f32> = (0..n)
                    .map(|_| (rng.next_u32() % 1000) as f32 / 100.0)
                    .collect();
                // lean toward ending once something is written
                for t in 0..n as u32 {
                    if v.is_eog(t) {
                        row[t as usize] = 30.0;
                    }
                }
                let t = s.sample(&row).unwrap();
                s.accept(t);
                if v.is_eog(t) {
                    let st = String::from_utf8(text.clone()).unwrap();
                    serde_json::from_str::<serde_json::Value>(&st)
                        .unwrap_or_else(|e| panic!("{st:?}: {e}"));
                    ended += 1;
                    break;
                }
                text.extend(v.token_bytes(t, false));
                let st = String::from_utf8_lossy(&text);
                assert!(json_prefix(&st), "seed {seed}: {st:?}");
            }
        }
        eprintln!("{ended} of 4 runs ended in whole JSON");
    }
}
