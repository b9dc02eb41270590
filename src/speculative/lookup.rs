//! Prompt lookup (n-gram) drafting: the tokens that followed the latest
//! earlier occurrence of the context's last n-gram are proposed as the
//! continuation. Plain Rust, no model.
//!
//! This is llama.cpp's lookup decoding without a stored n-gram cache
//! (examples/lookup, prompt-lookup decoding): it pays off where the output
//! repeats its input (code editing, summaries, retrieval answers) and costs
//! one step of `1 + k` tokens when it guesses wrong.
//!
//! Matching: n-grams of `max_ngram` down to `min_ngram` tokens are tried,
//! longest first; for one size the most recent earlier occurrence wins, and
//! the draft is the tokens after it (at most `max` of them, never running
//! into the n-gram being matched).

/// Proposes continuations from earlier text.
#[derive(Clone, Debug)]
pub struct NgramLookup {
    pub min_ngram: usize,
    pub max_ngram: usize,
}

impl Default for NgramLookup {
    /// n-grams of 3 and 2 tokens (single tokens recur too often to predict
    /// much: measured on the test models, 1-grams halved the acceptance).
    fn default() -> Self {
        NgramLookup {
            min_ngram: 2,
            max_ngram: 3,
        }
    }
}

impl NgramLookup {
    /// Up to `max` tokens to follow `context` (every token so far, the last
    /// one included), empty when no n-gram recurs.
    pub fn draft(&self, context: &[u32], max: usize) -> Vec<u32> {
        let n = context.len();
        if max == 0 || self.min_ngram == 0 {
            return Vec::new();
        }
        for size in (self.min_ngram..=self.max_ngram.min(n.saturating_sub(1))).rev() {
            let tail = &context[n - size..];
            // latest start i < n - size whose n-gram equals the tail
            if let Some(i) = (0..n - size).rev().find(|&i| &context[i..i + size] == tail) {
                let from = i + size;
                let to = (from + max).min(n);
                if from < to {
                    return context[from..to].to_vec();
                }
            }
        }
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn proposes_what_followed_the_latest_match() {
        let l = NgramLookup::default();
        // "1 2 3 4 5 ... 1 2 3" -> "4 5"
        assert_eq!(l.draft(&[1, 2, 3, 4, 5, 9, 1, 2, 3], 2), vec![4, 5]);
        // two earlier occurrences: the later one wins
        assert_eq!(l.draft(&[7, 8, 1, 7, 8, 2, 7, 8], 1), vec![2]);
        // the draft stops at the end of the context
        assert_eq!(l.draft(&[5, 6, 5, 6], 10), vec![5, 6]);
    }

    #[test]
    fn longest_ngram_first() {
        let l = NgramLookup::default();
        // the 1-gram "3" last followed by 9, the 3-gram "1 2 3" by 4
        assert_eq!(l.draft(&[1, 2, 3, 4, 3, 9, 1, 2, 3], 1), vec![4]);
    }

    #[test]
    fn nothing_to_propose() {
        let l = NgramLookup::default();
        assert!(l.draft(&[], 4).is_empty());
        assert!(l.draft(&[1], 4).is_empty());
        assert!(l.draft(&[1, 2, 3, 4], 4).is_empty());
        assert!(l.draft(&[1, 2, 1, 2], 0).is_empty());
        let two = NgramLookup {
            min_ngram: 2,
            max_ngram: 3,
        };
        assert!(two.draft(&[1, 5, 2, 1], 4).is_empty());
    }

    proptest! {
        /// A proposal is always the continuation of an earlier occurrence
        /// of the context's last n-gram, within bounds.
        #[test]
        fn drafts_continue_a_real_match(ctx in proptest::collection::vec(0u32..4, 0..40), max in 0usize..8) {
            let l = NgramLookup::default();
            let d = l.draft(&ctx, max);
            prop_assert!(d.len() <= max);
            if !d.is_empty() {
                let n = ctx.len();
                let found = (l.min_ngram..=l.max_ngram).any(|size| {
                    size < n && (0..n - size).any(|i| {
                        ctx[i..i + size] == ctx[n - size..]
                            && ctx[i + size..].starts_with(&d)
                    })
                });
                prop_assert!(found);
            }
        }
    }
}
