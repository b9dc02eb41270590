//! Text generation on top of the engine: prompt in, streamed text out.
//!
//! One [`Session`] is one sequence (seq 0) in the engine's KV cache. Text is
//! streamed as soon as it forms whole UTF-8 characters.

use crate::engine::{BatchToken, Engine, EngineError};
use crate::llama::{LlamaError, LlamaModel};
use crate::sample::{SampleError, Sampler};
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
}

impl<'a> Session<'a> {
    pub fn new(engine: &'a mut Engine, vocab: &'a LlamaModel, sampler: Sampler) -> Session<'a> {
        engine.clear();
        Session {
            engine,
            vocab,
            sampler,
            tokens: Vec::new(),
        }
    }

    /// Feeds `prompt` tokens, then samples up to `n_predict` tokens, calling
    /// `on_text` with each piece of text. Stops at end of generation.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        n_predict: usize,
        mut on_text: impl FnMut(&str),
    ) -> Result<(Vec<u32>, Timings), GenerateError> {
        if prompt.is_empty() {
            return Err(GenerateError::EmptyPrompt);
        }
        let n_ctx = self.engine.n_ctx();
        if self.tokens.len() + prompt.len() > n_ctx as usize {
            return Err(GenerateError::PromptTooLong {
                n: self.tokens.len() + prompt.len(),
                n_ctx,
            });
        }
        let mut t = Timings {
            prompt_tokens: prompt.len(),
            ..Default::default()
        };
        let start = Instant::now();
        let base = self.tokens.len() as i32;
        let batch: Vec<BatchToken> = prompt
            .iter()
            .enumerate()
            .map(|(i, &tok)| BatchToken {
                token: tok,
                pos: base + i as i32,
                seq: 0,
                logits: i + 1 == prompt.len(),
            })
            .collect();
        let mut logits = self.engine.decode(&batch)?;
        for &p in prompt {
            self.sampler.accept(p);
        }
        self.tokens.extend_from_slice(prompt);
        t.prompt_time = start.elapsed();

        let gen_start = Instant::now();
        let mut out = Vec::new();
        let mut text = Utf8Stream::default();
        for _ in 0..n_predict {
            let tok = self.sampler.sample(&logits)?;
            self.sampler.accept(tok);
            out.push(tok);
            if self.vocab.is_eog(tok) {
                break;
            }
            let s = text.push(&self.vocab.token_bytes(tok, false));
            if !s.is_empty() {
                on_text(&s);
            }
            if self.tokens.len() + 1 >= n_ctx as usize {
                break;
            }
            let pos = self.tokens.len() as i32;
            self.tokens.push(tok);
            logits = self.engine.decode(&[BatchToken {
                token: tok,
                pos,
                seq: 0,
                logits: true,
            }])?;
        }
        // tokens sampled (the last one is not decoded: it is not in the KV cache)
        t.gen_tokens = out.len();
        t.gen_time = gen_start.elapsed();
        Ok((out, t))
    }
}
