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
//! into the n-gram being matched). As a tree ([`NgramLookup::draft_tree`]),
//! every earlier occurrence proposes its continuation.

use super::tree::DraftTree;

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

    /// Several proposals as a tree of at most `max_nodes` nodes and
    /// `max_depth` levels: what followed each earlier occurrence of the
    /// context's last n-gram (the longest size that recurs), most recent
    /// first, merged where they agree. A node's probability is the share of
    /// occurrences whose continuation passes through it; the first path is
    /// [`NgramLookup::draft`]'s proposal.
    pub fn draft_tree(&self, context: &[u32], max_depth: usize, max_nodes: usize) -> DraftTree {
        let n = context.len();
        let mut tree = DraftTree::default();
        if max_depth == 0 || max_nodes == 0 || self.min_ngram == 0 {
            return tree;
        }
        let mut conts: Vec<&[u32]> = Vec::new();
        for size in (self.min_ngram..=self.max_ngram.min(n.saturating_sub(1))).rev() {
            let tail = &context[n - size..];
            for i in (0..n - size).rev() {
                let from = i + size;
                let to = (from + max_depth).min(n);
                if &context[i..from] == tail && from < to {
                    conts.push(&context[from..to]);
                }
            }
            if !conts.is_empty() {
                break;
            }
        }
        let mut count: Vec<u32> = Vec::new();
        'conts: for c in &conts {
            let mut at = None;
            for &t in *c {
                let j = match tree.child(at, t) {
                    Some(j) => j,
                    None if tree.len() == max_nodes => continue 'conts,
                    None => {
                        count.push(0);
                        tree.add(at, t, 0.0).expect("no such child yet")
                    }
                };
                count[j] += 1;
                at = Some(j);
            }
        }
        let total = conts.len() as f32;
        for (node, &c) in tree.nodes.iter_mut().zip(&count) {
            node.logp = (c as f32 / total).ln();
        }
        tree
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

    #[test]
    fn every_occurrence_proposes_a_branch() {
        let l = NgramLookup::default();
        // "0 7 8" was followed by 1 2, by 3 0 and (latest) by 1 4
        let ctx = [0, 7, 8, 1, 2, 0, 7, 8, 3, 0, 7, 8, 1, 4, 0, 7, 8];
        let t = l.draft_tree(&ctx, 2, 16);
        let paths: Vec<(Vec<u32>, f32)> = (0..t.len())
            .map(|i| {
                let p = t.path(i).iter().map(|&j| t.nodes[j].token).collect();
                (p, t.nodes[i].logp.exp())
            })
            .collect();
        let third = 1.0 / 3.0;
        let want = vec![
            (vec![1], 2.0 * third),
            (vec![1, 4], third),
            (vec![3], third),
            (vec![3, 0], third),
            (vec![1, 2], third),
        ];
        assert_eq!(paths.len(), want.len());
        for ((p, q), (wp, wq)) in paths.iter().zip(&want) {
            assert_eq!(p, wp);
            assert!((q - wq).abs() < 1e-6, "{p:?} {q}");
        }
        // the first path is the chain's proposal; sizes are kept
        assert_eq!(l.draft(&ctx, 2), vec![1, 4]);
        assert_eq!(l.draft_tree(&ctx, 2, 3).len(), 3);
        assert_eq!(l.draft_tree(&ctx, 1, 16).depth(), 1);
        assert!(l.draft_tree(&[1, 2, 3], 4, 4).is_empty());
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
