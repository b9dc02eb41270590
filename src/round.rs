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
//! A feed's drafts may be a token tree ([`crate::speculative::DraftTree`]):
//! the step then carries the tree's structure ([`crate::kv::StepTree`]),
//! [`draw_tree`] walks down the tree, and [`rollback_tree`] drops the nodes
//! off the accepted path.
//!
//! What each caller does between those (streaming text, stop strings,
//! drafting the next round, scheduling) stays its own.

use crate::engine::{BatchToken, Engine, EngineError};
use crate::kv::StepTree;
use crate::sample::logprobs::TokenLogprob;
use crate::sample::{SampleError, Sampler};
use crate::speculative::DraftTree;

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
    /// The drafts as a tree: `tokens` is then the pending token followed by
    /// the tree's nodes in order ([`DraftTree::step_tokens`]), and
    /// `drafts` the tree's size. None: the drafts are a chain.
    pub tree: Option<&'a DraftTree>,
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
    /// Per token: its position and its parent's index in the feed (None:
    /// the feed's first token).
    fn layout(&self) -> Vec<(i32, Option<u32>)> {
        let first = (self.tokens.len() - self.drafts - 1) as u32;
        let chain = (0..self.tokens.len()).map(|i| {
            (
                self.pos as i32 + i as i32,
                i.checked_sub(1).map(|p| p as u32),
            )
        });
        match self.tree {
            None => chain.collect(),
            Some(t) => {
                let at = (self.pos + first as usize) as i32;
                chain
                    .take(first as usize)
                    .chain(t.step_layout().into_iter().map(|(d, p)| {
                        let parent = match p {
                            Some(p) => Some(first + p),
                            None => first.checked_sub(1),
                        };
                        (at + d as i32, parent)
                    }))
                    .collect()
            }
        }
    }
    /// Whether the feed's drafts branch.
    fn branches(&self) -> bool {
        self.tree.is_some_and(|t| !t.is_chain())
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
                .zip(f.layout())
                .enumerate()
                .map(move |(i, (&token, (pos, _)))| BatchToken {
                    token,
                    pos,
                    seq: f.seq,
                    logits: i >= first_row,
                })
        })
        .collect()
}

/// The tree structure of the batch of `feeds` (each token's parent in the
/// batch); None when no feed's drafts branch.
pub fn step_tree(feeds: &[Feed]) -> Option<StepTree> {
    if !feeds.iter().any(Feed::branches) {
        return None;
    }
    let mut t = StepTree::new();
    let mut at = 0u32;
    for f in feeds {
        for (_, p) in f.layout() {
            t.push(p.map(|p| at + p), Vec::new());
        }
        at += f.tokens.len() as u32;
    }
    Some(t)
}

/// The logits of one round, per feed.
pub struct Rows {
    logits: Vec<f32>,
    /// Per feed: (first value, values); empty for a feed that does not
    /// sample.
    spans: Vec<(usize, usize)>,
    /// The cell of each token of the batch, in a step with a tree (empty
    /// otherwise).
    cells: Vec<u32>,
    /// Per feed: its first token in the batch.
    starts: Vec<usize>,
    pub n_vocab: usize,
}

impl Rows {
    /// Feed `i`'s rows (`Feed::rows` rows of `n_vocab` logits).
    pub fn of(&self, i: usize) -> &[f32] {
        let (at, n) = self.spans[i];
        &self.logits[at..at + n]
    }
    /// The cells of feed `i`'s tokens, in a step with a tree (empty
    /// otherwise).
    pub fn cells_of(&self, i: usize) -> &[u32] {
        if self.cells.is_empty() {
            return &[];
        }
        let end = self.starts.get(i + 1).copied().unwrap_or(self.cells.len());
        &self.cells[self.starts[i]..end]
    }
}

/// Runs `feeds` in one engine step (a tree step where a feed's drafts
/// branch: it must fit one step). On error the KV cache holds what it
/// held before.
pub fn step(engine: &mut Engine, feeds: &[Feed]) -> Result<Rows, EngineError> {
    let n_vocab = engine.n_vocab() as usize;
    let toks = batch(feeds);
    let (logits, cells) = match step_tree(feeds) {
        Some(t) => engine.decode_tree(&toks, &t)?,
        None => (engine.decode(&toks)?, Vec::new()),
    };
    let mut n = 0;
    let starts = feeds
        .iter()
        .map(|f| {
            n += f.tokens.len();
            n - f.tokens.len()
        })
        .collect();
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
        cells,
        starts,
        n_vocab,
    })
}

/// The tokens one feed drew, with their logprobs when asked.
#[derive(Debug, Default)]
pub struct Drawn {
    pub tokens: Vec<u32>,
    pub logprobs: Vec<TokenLogprob>,
    /// The accepted drafts' nodes, root to leaf.
    pub path: Vec<usize>,
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
    on_token: impl FnMut(u32, bool) -> bool,
) -> Result<Drawn, SampleError> {
    let chain = DraftTree::chain(drafts);
    draw_tree(sampler, rows, n_vocab, &chain, top_logprobs, on_token)
}

/// [`draw`] for drafts as a tree: from row 0 down the tree while the token
/// drawn is a child's (row 1 + i: after node i).
pub fn draw_tree(
    sampler: &mut Sampler,
    rows: &[f32],
    n_vocab: usize,
    tree: &DraftTree,
    top_logprobs: Option<usize>,
    mut on_token: impl FnMut(u32, bool) -> bool,
) -> Result<Drawn, SampleError> {
    let mut d = Drawn::default();
    let mut failed = None;
    let path = crate::speculative::verify_tree(sampler, rows, n_vocab, tree, |tok, node, s| {
        let verified = node.is_some();
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
    d.path = path;
    match failed {
        Some(e) => Err(e),
        None => Ok(d),
    }
}

/// [`draw_tree`] with the accepted nodes dictated (a replayed acceptance
/// trace, [`crate::speculative::Replay`]): the sampler draws from every row
/// plain verification would, but the round accepts the nodes of `path`
/// (root to leaf) and ends with the token drawn after the last of them.
pub fn draw_replayed(
    sampler: &mut Sampler,
    rows: &[f32],
    n_vocab: usize,
    tree: &DraftTree,
    path: &[usize],
    mut on_token: impl FnMut(u32, bool) -> bool,
) -> Result<Drawn, SampleError> {
    let mut d = Drawn::default();
    let row = |at: Option<usize>| {
        let r = at.map_or(0, |i| i + 1);
        &rows[r * n_vocab..(r + 1) * n_vocab]
    };
    let mut at = None;
    for &node in path {
        // drawn for real, overruled by the recording
        sampler.sample(row(at))?;
        let tok = tree.nodes[node].token;
        sampler.accept(tok);
        d.tokens.push(tok);
        if !on_token(tok, true) {
            return Ok(d);
        }
        d.path.push(node);
        at = Some(node);
    }
    let tok = sampler.sample(row(at))?;
    sampler.accept(tok);
    d.tokens.push(tok);
    on_token(tok, false);
    Ok(d)
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

/// After a tree step: the nodes of `tree` off the accepted `path` leave the
/// cache (`cells`: the feed's cells, the tree's nodes last), then
/// [`rollback`] keeps the first `keep` tokens of the `held`.
pub fn rollback_tree(
    engine: &mut Engine,
    seq: u32,
    tree: &DraftTree,
    cells: &[u32],
    path: &[usize],
    held: usize,
    keep: usize,
) -> bool {
    let first = cells.len().saturating_sub(tree.len());
    let off: Vec<u32> = (0..tree.len())
        .filter(|i| !path.contains(i))
        .filter_map(|i| cells.get(first + i).copied())
        .collect();
    if !off.is_empty() {
        engine.drop_cells(seq, &off);
    }
    rollback(engine, seq, held, keep) || !off.is_empty()
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
                tree: None,
            },
            // a pending token and two drafts
            Feed {
                seq: 1,
                pos: 10,
                tokens: &b,
                drafts: 2,
                sample: true,
                tree: None,
            },
            Feed {
                seq: 2,
                pos: 5,
                tokens: &c,
                drafts: 0,
                sample: true,
                tree: None,
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

    /// A tree feed's tokens sit at their depth's position with their
    /// parents' indices; a prompt chunk before it chains.
    #[test]
    fn a_tree_feed_carries_its_structure() {
        let mut t = DraftTree::default();
        let a = t.add(None, 5, 0.0);
        t.add(None, 6, 0.0);
        t.add(a, 7, 0.0);
        let toks = t.step_tokens(9);
        let chunk = [1, 2];
        let feeds = [
            Feed {
                seq: 1,
                pos: 0,
                tokens: &chunk,
                drafts: 0,
                sample: false,
                tree: None,
            },
            Feed {
                seq: 0,
                pos: 20,
                tokens: &toks,
                drafts: t.len(),
                sample: true,
                tree: Some(&t),
            },
        ];
        let got: Vec<_> = batch(&feeds)
            .iter()
            .map(|b| (b.token, b.pos, b.logits))
            .collect();
        assert_eq!(
            got,
            vec![
                (1, 0, false),
                (2, 1, false),
                (9, 20, true),
                (5, 21, true),
                (6, 21, true),
                (7, 22, true)
            ]
        );
        let st = step_tree(&feeds).expect("a tree");
        assert_eq!(
            st.parent,
            vec![None, Some(0), None, Some(2), Some(2), Some(3)]
        );
        // chains need no tree
        let c = DraftTree::chain(&[5, 7]);
        let ct = c.step_tokens(9);
        let chain = [Feed {
            seq: 0,
            pos: 3,
            tokens: &ct,
            drafts: 2,
            sample: true,
            tree: Some(&c),
        }];
        assert!(step_tree(&chain).is_none());
        assert_eq!(batch(&chain)[2].pos, 5);
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
