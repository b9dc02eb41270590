//! Text generation on top of the engine: prompt in, streamed text out.
//!
//! One [`Session`] is one sequence (seq 0) in the engine's KV cache. Text is
//! streamed as soon as it forms whole UTF-8 characters. Each step is one
//! [`crate::round`], the decode round `strata serve` drives too.

use crate::engine::{Engine, EngineError};
use crate::llama::{LlamaError, LlamaModel};
use crate::round::{self, Feed};
use crate::sample::{SampleError, Sampler};
use crate::speculative::{DraftTree, Speculator};
use std::time::{Duration, Instant};

#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Llama(#[from] LlamaError),
    #[error(transparent)]
    Sample(#[from] SampleError),
    #[error("the prompt has {n} tokens but the context holds {n_ctx}")]
    PromptTooLong { n: usize, n_ctx: u32 },
    #[error("the prompt is empty after tokenization")]
    EmptyPrompt,
    #[error("session file {path}: {what}")]
    BadSession { path: String, what: String },
}

/// Timings of one generation.
#[derive(Clone, Copy, Debug, Default)]
pub struct Timings {
    pub prompt_tokens: usize,
    pub prompt_time: Duration,
    pub gen_tokens: usize,
    pub gen_time: Duration,
}

impl Timings {
    pub fn prompt_tps(&self) -> f64 {
        self.prompt_tokens as f64 / self.prompt_time.as_secs_f64().max(1e-9)
    }
    pub fn gen_tps(&self) -> f64 {
        self.gen_tokens as f64 / self.gen_time.as_secs_f64().max(1e-9)
    }
}

/// Streams UTF-8 text out of token byte pieces.
#[derive(Default)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    /// Adds bytes, returns the longest complete prefix as text.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        match std::str::from_utf8(&self.pending) {
            Ok(s) => {
                let out = s.to_string();
                self.pending.clear();
                out
            }
            Err(e) if e.error_len().is_none() => {
                // incomplete trailing sequence: keep it for the next piece
                let valid = e.valid_up_to();
                let out = String::from_utf8_lossy(&self.pending[..valid]).into_owned();
                self.pending.drain(..valid);
                out
            }
            Err(_) => {
                let out = String::from_utf8_lossy(&self.pending).into_owned();
                self.pending.clear();
                out
            }
        }
    }
}

/// One conversation / completion on sequence 0 of an engine.
pub struct Session<'a> {
    pub engine: &'a mut Engine,
    pub vocab: &'a LlamaModel,
    pub sampler: Sampler,
    /// Tokens in the KV cache, in order.
    pub tokens: Vec<u32>,
    /// The last sampled token, not yet in the KV cache (fed first by the
    /// next `generate`). None after an end-of-generation token.
    pub pending: Option<u32>,
    /// Set (by a SIGINT handler, say) to end the current generation at the
    /// next step boundary, as if `n_predict` were reached; cleared then.
    pub interrupt: Option<&'static std::sync::atomic::AtomicBool>,
    /// Whether the last generation ended by `interrupt`.
    pub interrupted: bool,
}

impl<'a> Session<'a> {
    pub fn new(engine: &'a mut Engine, vocab: &'a LlamaModel, sampler: Sampler) -> Session<'a> {
        engine.clear();
        Session {
            engine,
            vocab,
            sampler,
            tokens: Vec::new(),
            pending: None,
            interrupt: None,
            interrupted: false,
        }
    }

    /// Saves the KV cache, tokens, pending token and sampler state to
    /// `path`, so [`Session::load`] can go on as if never stopped.
    pub fn save(&mut self, path: &std::path::Path) -> Result<u64, GenerateError> {
        let st = self.sampler.state();
        let payload = serde_json::json!({
            "format": "strata-session-1",
            "tokens": self.tokens,
            "pending": self.pending,
            "seed": st.seed,
            "word_pos": st.word_pos.to_string(),
            "history": st.history,
        });
        let bytes = serde_json::to_vec(&payload).expect("plain JSON");
        Ok(self.engine.save_seq(0, path, &bytes)?)
    }

    /// Restores a session saved by [`Session::save`] on the same model. On
    /// error the session is left empty.
    pub fn load(&mut self, path: &std::path::Path) -> Result<(), GenerateError> {
        let r = self.load_inner(path);
        if r.is_err() {
            self.engine.clear_seq(0);
            self.tokens.clear();
            self.pending = None;
        }
        r
    }

    fn load_inner(&mut self, path: &std::path::Path) -> Result<(), GenerateError> {
        let bad = |what: &str| GenerateError::BadSession {
            path: path.display().to_string(),
            what: what.to_string(),
        };
        let bytes = self.engine.load_seq(0, path)?;
        let v: serde_json::Value =
            serde_json::from_slice(&bytes).map_err(|_| bad("payload is not JSON"))?;
        if v["format"] != "strata-session-1" {
            return Err(bad("not a strata session"));
        }
        let toks = |k: &str| -> Result<Vec<u32>, GenerateError> {
            v[k].as_array()
                .ok_or_else(|| bad(k))?
                .iter()
                .map(|t| t.as_u64().map(|t| t as u32).ok_or_else(|| bad(k)))
                .collect()
        };
        let tokens = toks("tokens")?;
        if tokens.len() != self.engine.kv().cells().seq_cells(0).len() {
            self.engine.clear_seq(0);
            return Err(bad("token count differs from the saved cache"));
        }
        let n_vocab = self.engine.n_vocab();
        if tokens.iter().any(|&t| t >= n_vocab) {
            self.engine.clear_seq(0);
            return Err(bad("token outside the vocabulary"));
        }
        let state = crate::sample::SamplerState {
            seed: v["seed"].as_u64().ok_or_else(|| bad("seed"))?,
            word_pos: v["word_pos"]
                .as_str()
                .and_then(|s| s.parse().ok())
                .ok_or_else(|| bad("word_pos"))?,
            history: toks("history")?,
        };
        if state.history.iter().any(|&t| t >= n_vocab) {
            self.engine.clear_seq(0);
            return Err(bad("sampler history token outside the vocabulary"));
        }
        let pending = match &v["pending"] {
            serde_json::Value::Null => None,
            p => match p.as_u64() {
                Some(t) if t < u64::from(n_vocab) => Some(t as u32),
                _ => {
                    self.engine.clear_seq(0);
                    return Err(bad("pending token outside the vocabulary"));
                }
            },
        };
        self.sampler.restore(&state);
        self.tokens = tokens;
        self.pending = pending;
        if self.pending.is_none() {
            // the next token's logits come from the last token: take it out
            // of the cache and feed it again
            if let Some(last) = self.tokens.pop() {
                self.engine.truncate_seq(0, self.tokens.len() as i32);
                self.pending = Some(last);
            }
        }
        Ok(())
    }

    /// Feeds `prompt` tokens, then samples up to `n_predict` tokens, calling
    /// `on_text` with each piece of text. Stops at end of generation.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        n_predict: usize,
        on_text: impl FnMut(&str),
    ) -> Result<(Vec<u32>, Timings), GenerateError> {
        self.generate_with(prompt, n_predict, None, on_text)
    }

    /// [`Session::generate`], with drafts from `spec` verified in each step
    /// (see [`crate::speculative`]): the tokens are those plain decoding
    /// gives for the same logits.
    pub fn generate_with(
        &mut self,
        prompt: &[u32],
        n_predict: usize,
        mut spec: Option<&mut Speculator>,
        mut on_text: impl FnMut(&str),
    ) -> Result<(Vec<u32>, Timings), GenerateError> {
        self.interrupted = false;
        // the token sampled last time goes in first (the sampler saw it)
        let feed: Vec<u32> = self.pending.iter().chain(prompt).copied().collect();
        if feed.is_empty() {
            return Err(GenerateError::EmptyPrompt);
        }
        let n_ctx = self.engine.n_ctx() as usize;
        if self.tokens.len() + feed.len() > n_ctx {
            return Err(GenerateError::PromptTooLong {
                n: self.tokens.len() + feed.len(),
                n_ctx: n_ctx as u32,
            });
        }
        let mut t = Timings {
            prompt_tokens: feed.len(),
            ..Default::default()
        };
        let start = Instant::now();
        let mut rows = round::step(
            self.engine,
            &[Feed {
                seq: 0,
                pos: self.tokens.len(),
                tokens: &feed,
                drafts: 0,
                sample: true,
                tree: None,
            }],
        )?;
        for &p in prompt {
            self.sampler.accept(p);
        }
        self.pending = None;
        self.tokens.extend_from_slice(&feed);
        t.prompt_time = start.elapsed();

        let gen_start = Instant::now();
        let mut out = Vec::new();
        let mut text = Utf8Stream::default();
        let n_vocab = self.engine.n_vocab() as usize;
        // rows.of(0)[0]: logits after the cache's last token; [1 + i]:
        // after the tree's node i and its ancestors
        let mut tree = DraftTree::default();
        // accepted nodes of the last round, root to leaf
        let mut path: Vec<usize> = Vec::new();
        // positions the KV cache holds: self.tokens plus unverified drafts
        let mut cached = self.tokens.len();
        // the last round's target step; None: the rows come from the prompt
        let mut last_round: Option<Duration> = None;
        'rounds: while out.len() < n_predict {
            let mut stop = false;
            let first = out.len();
            let round_start = self.tokens.len();
            // a replayed round's accepted nodes (not the prompt's rows)
            let forced: Option<Vec<usize>> = spec
                .as_deref()
                .filter(|_| last_round.is_some())
                .and_then(|s| s.replayed_path().map(<[usize]>::to_vec));
            let on_token = |tok, verified| {
                out.push(tok);
                if self.vocab.is_eog(tok) {
                    stop = true;
                    return false;
                }
                self.pending = Some(tok);
                let s = text.push(&self.vocab.token_bytes(tok, false));
                if !s.is_empty() {
                    on_text(&s);
                }
                if out.len() == n_predict || self.tokens.len() + 1 >= n_ctx {
                    stop = true;
                    return false;
                }
                if verified {
                    // its KV row is in the cache already
                    self.tokens.push(tok);
                    self.pending = None;
                }
                true
            };
            let drawn = match &forced {
                Some(p) => {
                    round::draw_replayed(&mut self.sampler, rows.of(0), n_vocab, &tree, p, on_token)
                }
                None => round::draw_tree(
                    &mut self.sampler,
                    rows.of(0),
                    n_vocab,
                    &tree,
                    None,
                    on_token,
                ),
            };
            // drafts accepted
            let i = match drawn {
                Ok(d) => {
                    path = d.path;
                    d.tokens.len() - 1
                }
                Err(e) => {
                    // the round's tokens are forgotten, the cache with them
                    self.tokens.truncate(round_start);
                    self.pending = None;
                    self.drop_unverified(&tree, rows.cells_of(0), &[], &mut cached);
                    return Err(e.into());
                }
            };
            if let (Some(s), Some(step)) = (spec.as_deref_mut(), last_round) {
                s.round_done(tree.len(), i, out[first], step);
                s.record_round(&tree, &path);
            }
            if stop {
                break 'rounds;
            }
            if self
                .interrupt
                .is_some_and(|f| f.swap(false, std::sync::atomic::Ordering::SeqCst))
            {
                // the last token stays pending, fed first by the next call
                self.interrupted = true;
                break 'rounds;
            }
            // rejected drafts leave the cache; accepted nodes out of a
            // chain's cells are fed again with the next step
            let refeed = self.drop_unverified(&tree, rows.cells_of(0), &path, &mut cached);
            // the next round: the pending token plus new drafts
            let tok = self
                .pending
                .take()
                .expect("a round ends with a pending token");
            self.tokens.push(tok);
            tree = match spec.as_deref_mut() {
                Some(s) => {
                    if s.uses_model() {
                        // the draft model computes on the same cores
                        self.engine.park_threads();
                    }
                    // each round emits at most 1 + drafts tokens; drafts
                    // and the pending token must fit in the context
                    let room = n_ctx.saturating_sub(self.tokens.len());
                    match s.draft_round(&self.tokens, (n_predict - out.len() - 1).min(room)) {
                        Ok(mut d) => {
                            // the re-fed tokens, the pending token and the
                            // tree in one step
                            d.truncate((self.engine.n_batch() as usize).saturating_sub(1 + refeed));
                            d
                        }
                        Err(e) => {
                            self.tokens.pop();
                            self.pending = Some(tok);
                            return Err(e.into());
                        }
                    }
                }
                None => DraftTree::default(),
            };
            let base = self.tokens.len() - 1;
            let from = base - refeed;
            let step: Vec<u32> = self.tokens[from..base]
                .iter()
                .copied()
                .chain(tree.step_tokens(tok))
                .collect();
            if refeed > 0 {
                self.engine.truncate_seq(0, from as i32);
            }
            let round = Instant::now();
            let f = Feed {
                seq: 0,
                pos: from,
                tokens: &step,
                drafts: tree.len(),
                sample: true,
                tree: Some(&tree),
            };
            match round::step(self.engine, &[f]) {
                Ok(r) => {
                    rows = r;
                    cached = base + 1 + tree.depth();
                }
                Err(e) => {
                    // the cache holds the tokens before `from`: so does
                    // the session (re-fed tokens are lost from its context)
                    self.tokens.truncate(from);
                    self.pending = Some(tok);
                    return Err(e.into());
                }
            }
            last_round = Some(round.elapsed());
        }
        let refeed = self.drop_unverified(&tree, rows.cells_of(0), &path, &mut cached);
        if refeed > 0 {
            // the cache in position order for the next call
            let from = self.tokens.len() - refeed;
            self.engine.truncate_seq(0, from as i32);
            let f = Feed {
                seq: 0,
                pos: from,
                tokens: &self.tokens[from..],
                drafts: 0,
                sample: false,
                tree: None,
            };
            if let Err(e) = round::step(self.engine, &[f]) {
                self.tokens.truncate(from);
                return Err(e.into());
            }
        }
        // tokens sampled; all but an end-of-generation token and the last
        // one (pending, fed first by the next call) are in the KV cache
        t.gen_tokens = out.len();
        t.gen_time = gen_start.elapsed();
        Ok((out, t))
    }

    /// Takes the drafts that were not accepted (the nodes of `tree` off
    /// `path`, and any position past the session's tokens) out of the KV
    /// cache. `cells`: the last step's cells (empty for a chain). Returns
    /// how many accepted tokens sit outside the cells a chain would have
    /// given them (a side branch of the tree was accepted): they must be
    /// fed again, or the attention would read the cache out of position
    /// order and round differently from a cache that never saw the
    /// rejected nodes.
    fn drop_unverified(
        &mut self,
        tree: &DraftTree,
        cells: &[u32],
        path: &[usize],
        cached: &mut usize,
    ) -> usize {
        if *cached > self.tokens.len() || !path.is_empty() {
            round::rollback_tree(
                self.engine,
                0,
                tree,
                cells,
                path,
                *cached,
                self.tokens.len(),
            );
        }
        *cached = (*cached).min(self.tokens.len());
        // only a step that placed the tree has cells to be out of order
        if cells.is_empty() || DraftTree::in_chain_cells(path) {
            0
        } else {
            path.len()
        }
    }
}
