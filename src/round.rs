//! One decode round, the loop `strata run` ([`crate::generate`]) and
//! `strata serve` (serve/worker.rs) both drive, so the two cannot drift:
//!
//! 1. [`step`]: every sequence's feed (a prompt chunk, or its pending token
//!    followed by drafts) in one engine step, logits for the last `1 +
//!    drafts` tokens of each feed that samples;
//! 2. [`draw`]: each sampling feed's tokens from its rows with its own
//!    sampler: the first row, then each next row while the token drawn
//!    equals the draft there ([`crate::speculative::verify_with`]), with the
//!    logprobs of each token's distribution when asked;
//! 3. [`rollback`]: the drafts that were not accepted leave the KV cache.
//!
//! What each caller does between those (streaming text, stop strings,
//! drafting the next round, scheduling) stays its own.

use crate::engine::{BatchToken, Engine, EngineError};
use crate::sample::logprobs::TokenLogprob;
use crate::sample::{SampleError, Sampler};

/// One sequence's tokens in a round.
#[derive(Clone, Copy, Debug)]
pub struct Feed<'a> {
    pub seq: u32,
    /// Position of `tokens[0]`.
    pub pos: usize,
    /// What the sequence feeds: prompt tokens, or its pending token and
    /// then `drafts` unverified drafts.
    pub tokens: &'a [u32],
    pub drafts: usize,
    /// Whether the sequence samples after this step (the end of a prompt,
    /// or a decode feed).
    pub sample: bool,
}

impl Feed<'_> {
    /// Tokens of the sequence the cache holds after the step, its drafts
    /// excluded.
    pub fn base(&self) -> usize {
        self.pos + self.tokens.len() - self.drafts
    }
    /// The unverified drafts at the end of the feed.
    pub fn drafted(&self) -> &[u32] {
        &self.tokens[self.tokens.len() - self.drafts..]
    }
    /// Rows of logits the feed gets: its last token's and its drafts'.
    pub fn rows(&self) -> usize {
        if self.sample {
            1 + self.drafts
        } else {
            0
        }
    }
}

/// The engine batch of `feeds`, in order.
pub fn batch(feeds: &[Feed]) -> Vec<BatchToken> {
    feeds
        .iter()
        .flat_map(|f| {
            let first_row = f.tokens.len() - f.rows();
            f.tokens
                .iter()
                .enumerate()
                .map(move |(i, &token)| BatchToken {
                    token,
                    pos: (f.pos + i) as i32,
                    seq: f.seq,
                    logits: i >= first_row,
                })
        })
        .collect()
}

/// The logits of one round, per feed.
pub struct Rows {
    logits: Vec<f32>,
    /// Per feed: (first value, values); empty for a feed that does not
    /// sample.
    spans: Vec<(usize, usize)>,
    pub n_vocab: usize,
}

impl Rows {
    /// Feed `i`'s rows (`Feed::rows` rows of `n_vocab` logits).
    pub fn of(&self, i: usize) -> &[f32] {
        let (at, n) = self.spans[i];
        &self.logits[at..at + n]
    }
}

/// Runs `feeds` in one engine step. On error the KV cache holds what it
/// held before.
pub fn step(engine: &mut Engine, feeds: &[Feed]) -> Result<Rows, EngineError> {
    let n_vocab = engine.n_vocab() as usize;
    let logits = engine.decode(&batch(feeds))?;
    let mut at = 0;
    let spans = feeds
        .iter()
        .map(|f| {
            let n = f.rows() * n_vocab;
            at += n;
            (at - n, n)
        })
        .collect();
    debug_assert_eq!(at, logits.len());
    Ok(Rows {
        logits,
        spans,
        n_vocab,
    })
}

/// The tokens one feed drew, with their logprobs when asked.
#[derive(Debug, Default)]
pub struct Drawn {
    pub tokens: Vec<u32>,
    pub logprobs: Vec<TokenLogprob>,
}

/// Draws a feed's tokens from its `rows` with `sampler` (each accepted into
/// it): row 0, then each next row while the token drawn equals the draft
/// there. `top_logprobs`: report each token's logprob and that many
/// alternatives, from the distribution it was drawn from. `on_token(token,
/// verified)` sees each token as drawn (`verified`: it equals its draft, so
/// its KV row is in the cache) and returns false to stop there.
pub fn draw(
    sampler: &mut Sampler,
    rows: &[f32],
    n_vocab: usize,
    drafts: &[u32],
    top_logprobs: Option<usize>,
    mut on_token: impl FnMut(u32, bool) -> bool,
) -> Result<Drawn, SampleError> {
    let mut d = Drawn::default();
    let mut failed = None;
    crate::speculative::verify_with(sampler, rows, n_vocab, drafts, |tok, verified, s| {
        if let Some(top) = top_logprobs {
            match s.sampled_logprob(tok, top) {
                Ok(lp) => d.logprobs.push(lp),
                Err(e) => {
                    failed = Some(e);
                    return false;
                }
            }
        }
        d.tokens.push(tok);
        on_token(tok, verified)
    })?;
    match failed {
        Some(e) => Err(e),
        None => Ok(d),
    }
}

/// Keeps the first `keep` tokens of `seq` in the cache, which holds `held`
/// of them after the step: the drafts after the accepted ones leave it.
/// Returns whether anything left.
pub fn rollback(engine: &mut Engine, seq: u32, held: usize, keep: usize) -> bool {
    if keep < held {
        engine.truncate_seq(seq, keep as i32);
        true
    } else {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_wants_the_rows_of_each_sampling_feed() {
        let (a, b, c) = ([1, 2, 3], [7, 8, 9], [4]);
        let feeds = [
            // a prompt chunk that does not sample yet
            Feed {
                seq: 0,
                pos: 0,
                tokens: &a,
                drafts: 0,
                sample: false,
            },
            // a pending token and two drafts
            Feed {
                seq: 1,
                pos: 10,
                tokens: &b,
                drafts: 2,
                sample: true,
            },
            Feed {
                seq: 2,
                pos: 5,
                tokens: &c,
                drafts: 0,
                sample: true,
            },
        ];
        let want: Vec<(u32, i32, u32, bool)> = vec![
            (1, 0, 0, false),
            (2, 1, 0, false),
            (3, 2, 0, false),
            (7, 10, 1, true),
            (8, 11, 1, true),
            (9, 12, 1, true),
            (4, 5, 2, true),
        ];
        let got: Vec<_> = batch(&feeds)
            .iter()
            .map(|t| (t.token, t.pos, t.seq, t.logits))
            .collect();
        assert_eq!(got, want);
        assert_eq!(feeds.map(|f| f.rows()), [0, 3, 1]);
        assert_eq!((feeds[1].base(), feeds[1].drafted()), (11, &[8, 9][..]));
    }

    #[test]
    fn draw_stops_at_the_first_rejected_draft_and_reports_logprobs() {
        use crate::sample::SamplerConfig;
        let v = 4;
        // greedy rows: 2, then 1, then 3
        let mut rows = vec![0.0f32; 3 * v];
        rows[2] = 5.0;
        rows[v + 1] = 5.0;
        rows[2 * v + 3] = 5.0;
        let cfg = SamplerConfig {
            temperature: 0.0,
            ..SamplerConfig::default()
        };
        let mut s = Sampler::new(cfg.clone()).unwrap();
        let mut seen = Vec::new();
        // drafts 2 (accepted), 0 (rejected: the row says 1)
        let d = draw(&mut s, &rows, v, &[2, 0], Some(1), |t, ok| {
            seen.push((t, ok));
            true
        })
        .unwrap();
        assert_eq!(d.tokens, vec![2, 1]);
        assert_eq!(seen, vec![(2, true), (1, false)]);
        assert_eq!(d.logprobs.len(), 2);
        // a caller may stop after the first token
        let mut s = Sampler::new(cfg).unwrap();
        let d = draw(&mut s, &rows, v, &[2, 1], None, |_, _| false).unwrap();
        assert_eq!((d.tokens, d.logprobs.len()), (vec![2], 0));
    }
}
