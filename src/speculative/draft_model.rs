//! A small model with the target's vocabulary drafts greedily.
//!
//! The draft engine keeps its own KV cache of sequence 0. Before drafting,
//! it keeps the longest prefix its cache shares with the target's context
//! (rejected drafts fall away here), feeds the rest, then decodes greedily
//! one token at a time while its top token is likely enough (`p_min`, the
//! probability among its 10 best tokens, as llama.cpp's draft sampler
//! computes it). Drafts are point masses: see the module docs of
//! `speculative` for why verification stays lossless.

use crate::engine::{BatchToken, Engine, EngineError};
use crate::llama::LlamaModel;

/// The draft model and what its KV cache holds.
pub struct DraftModel {
    pub engine: Engine,
    /// Tokens in the draft's KV cache (sequence 0), in order.
    cached: Vec<u32>,
    /// Stop drafting when the top token's probability falls below this.
    pub p_min: f32,
}

/// Why a draft model cannot serve a target.
#[derive(Debug, thiserror::Error)]
pub enum VocabMismatch {
    #[error("the draft model has {draft} tokens in its vocabulary, the target {target}")]
    Size { target: u32, draft: u32 },
    #[error("the draft model computes logits over {draft} tokens, the target over {target}")]
    Logits { target: u32, draft: u32 },
    #[error("token {id} differs: {target:?} in the target, {draft:?} in the draft model")]
    Token {
        id: u32,
        target: String,
        draft: String,
    },
}

/// Refuses a draft model whose tokens are not the target's: same count,
/// same bytes for every id (special tokens included), same logit rows.
pub fn check_vocab(
    target: &LlamaModel,
    target_engine: &Engine,
    draft: &LlamaModel,
    draft_engine: &Engine,
) -> Result<(), VocabMismatch> {
    let (t, d) = (target.n_vocab(), draft.n_vocab());
    if t != d {
        return Err(VocabMismatch::Size {
            target: t,
            draft: d,
        });
    }
    let (tl, dl) = (target_engine.n_vocab(), draft_engine.n_vocab());
    if tl != dl {
        return Err(VocabMismatch::Logits {
            target: tl,
            draft: dl,
        });
    }
    for id in 0..t {
        let (a, b) = (target.token_bytes(id, true), draft.token_bytes(id, true));
        if a != b {
            return Err(VocabMismatch::Token {
                id,
                target: String::from_utf8_lossy(&a).into_owned(),
                draft: String::from_utf8_lossy(&b).into_owned(),
            });
        }
    }
    Ok(())
}

impl DraftModel {
    pub fn new(engine: Engine, p_min: f32) -> DraftModel {
        let mut engine = engine;
        engine.clear();
        DraftModel {
            engine,
            cached: Vec::new(),
            p_min,
        }
    }

    /// Forgets the cache (a new conversation).
    pub fn clear(&mut self) {
        self.engine.clear();
        self.cached.clear();
    }

    /// Up to `max` greedy tokens to follow `context` (all tokens so far, the
    /// last one included). Drafting stops early when the draft is unsure.
    /// The draft's CPU threads sleep afterwards, leaving the cores to the
    /// target.
    pub fn draft(&mut self, context: &[u32], max: usize) -> Result<Vec<u32>, EngineError> {
        let r = self.draft_inner(context, max);
        self.engine.park_threads();
        r
    }

    fn draft_inner(&mut self, context: &[u32], max: usize) -> Result<Vec<u32>, EngineError> {
        let Some(last) = context.len().checked_sub(1) else {
            return Ok(Vec::new());
        };
        // drafted token j is decoded at position context.len() + j (all but
        // the last): stay inside the draft's context
        let room = (self.engine.n_ctx() as usize).saturating_sub(context.len());
        let max = max.min(room);
        if max == 0 {
            return Ok(Vec::new());
        }
        // keep what the cache shares with the context, feed the rest (at
        // least the last token, whose logits start the draft)
        let keep = self
            .cached
            .iter()
            .zip(context)
            .take_while(|(a, b)| a == b)
            .count()
            .min(last);
        if keep < self.cached.len() {
            self.engine.truncate_seq(0, keep as i32);
            self.cached.truncate(keep);
        }
        let feed: Vec<BatchToken> = (keep..context.len())
            .map(|i| BatchToken {
                token: context[i],
                pos: i as i32,
                seq: 0,
                logits: i == last,
            })
            .collect();
        // on error the cache holds what it held: the first `keep` tokens
        let mut logits = self.engine.decode(&feed)?;
        self.cached.extend_from_slice(&context[keep..]);
        let mut out = Vec::with_capacity(max);
        loop {
            let (tok, p) = top_token(&logits);
            if p < self.p_min {
                break;
            }
            out.push(tok);
            if out.len() == max {
                break;
            }
            let pos = self.cached.len() as i32;
            logits = self.engine.decode(&[BatchToken {
                token: tok,
                pos,
                seq: 0,
                logits: true,
            }])?;
            self.cached.push(tok);
        }
        Ok(out)
    }
}

/// The argmax (lowest id on ties) and its probability among the 10 best
/// logits, as llama.cpp's draft sampler (top-k 10, then softmax) sees it.
pub fn top_token(logits: &[f32]) -> (u32, f32) {
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(11);
    for (i, &l) in logits.iter().enumerate() {
        if l.is_nan() {
            continue;
        }
        if top.len() == 10 && l <= top[9].1 {
            continue;
        }
        let at = top.partition_point(|&(_, x)| x >= l);
        top.insert(at, (i as u32, l));
        top.truncate(10);
    }
    let Some(&(id, max)) = top.first() else {
        return (0, 0.0);
    };
    let sum: f64 = top
        .iter()
        .map(|&(_, l)| (f64::from(l) - f64::from(max)).exp())
        .sum();
    (id, (1.0 / sum) as f32)
}

#[cfg(test)]
mod tests {
    use super::top_token;

    #[test]
    fn top_token_is_the_argmax_with_its_top10_probability() {
        let mut l = vec![0.0f32; 100];
        l[42] = 5.0;
        let (id, p) = top_token(&l);
        assert_eq!(id, 42);
        // 1 / (1 + 9 e^-5)
        assert!((p - 1.0 / (1.0 + 9.0 * (-5.0f32).exp())).abs() < 1e-6);
        // ties: the lowest id; two equal bests share the mass
        let (id, p) = top_token(&[1.0, 3.0, 3.0]);
        assert_eq!(id, 1);
        assert!((p - 1.0 / (2.0 + (-2.0f32).exp())).abs() < 1e-6);
    }
}
