//! A small model with the target's vocabulary drafts greedily.
//!
//! The draft engine keeps its own KV cache, one sequence per target
//! sequence (the same ids). Before drafting, each sequence keeps the
//! longest prefix its cache shares with the target's context (rejected
//! drafts fall away here) and feeds the rest; then the draft decodes
//! greedily, one token per drafting sequence per step (all sequences in one
//! batch), while a sequence's top token is likely enough (`p_min`, the
//! probability among its 10 best tokens, as llama.cpp's draft sampler
//! computes it) and it wants more. Drafts are point masses: see the module
//! docs of `speculative` for why verification stays lossless.

use super::tree::{grow, top_logprobs, DraftTree, TreeShape};
use crate::engine::{BatchToken, Engine, EngineError};
use crate::kv::StepTree;
use crate::llama::LlamaModel;
use std::collections::HashMap;

/// The draft model and what its KV cache holds.
pub struct DraftModel {
    pub engine: Engine,
    /// Per sequence: the tokens in the draft's KV cache, in order.
    cached: HashMap<u32, Vec<u32>>,
    /// Stop drafting when the top token's probability falls below this.
    pub p_min: f32,
}

/// One sequence's request for drafts: its id (the target's), all its tokens
/// so far (the last one included), and the most tokens to draft.
#[derive(Clone, Copy, Debug)]
pub struct DraftRequest<'a> {
    pub seq: u32,
    pub context: &'a [u32],
    pub max: usize,
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
            cached: HashMap::new(),
            p_min,
        }
    }

    /// Forgets the cache (a new conversation).
    pub fn clear(&mut self) {
        self.engine.clear();
        self.cached.clear();
    }

    /// Forgets sequence `seq` (it ended; its id may come back for another).
    pub fn forget(&mut self, seq: u32) {
        if self.cached.remove(&seq).is_some() {
            self.engine.clear_seq(seq);
        }
    }

    /// Up to `max` greedy tokens to follow `context` (all tokens so far, the
    /// last one included), for sequence 0. Drafting stops early when the
    /// draft is unsure. The draft's CPU threads sleep afterwards, leaving the
    /// cores to the target.
    pub fn draft(&mut self, context: &[u32], max: usize) -> Result<Vec<u32>, EngineError> {
        let mut d = self.draft_many(&[DraftRequest {
            seq: 0,
            context,
            max,
        }])?;
        Ok(d.pop().unwrap_or_default())
    }

    /// Drafts for several sequences at once: their catch-up tokens in one
    /// step, then one step per drafted position holding every sequence
    /// still drafting. Returns each request's drafts, in order. On an error
    /// the draft's cache may have lost tokens but never holds wrong ones.
    pub fn draft_many(&mut self, reqs: &[DraftRequest]) -> Result<Vec<Vec<u32>>, EngineError> {
        let r = self.draft_inner(reqs);
        self.engine.park_threads();
        r
    }

    fn draft_inner(&mut self, reqs: &[DraftRequest]) -> Result<Vec<Vec<u32>>, EngineError> {
        let mut out = vec![Vec::new(); reqs.len()];
        let n_ctx = self.engine.n_ctx() as usize;
        // per request that drafts: (index, seq, most tokens)
        let mut live: Vec<(usize, u32, usize)> = Vec::new();
        let mut feed: Vec<BatchToken> = Vec::new();
        for (i, r) in reqs.iter().enumerate() {
            if r.context.is_empty() {
                continue;
            }
            // drafted token j is decoded at position context.len() + j (all
            // but the last): stay inside the draft's context
            let max = r.max.min(n_ctx.saturating_sub(r.context.len()));
            if max == 0 || live.iter().any(|&(_, s, _)| s == r.seq) {
                continue;
            }
            feed.extend(self.catch_up(r.seq, r.context));
            live.push((i, r.seq, max));
        }
        if live.is_empty() {
            return Ok(out);
        }
        // on error the cache holds what it held before this feed
        let mut logits = self.engine.decode(&feed)?;
        for &(i, seq, _) in &live {
            self.fed(seq, reqs[i].context);
        }
        let n_vocab = self.engine.n_vocab() as usize;
        loop {
            let mut next = Vec::new();
            let mut still = Vec::new();
            for (row, &(i, seq, max)) in live.iter().enumerate() {
                let (tok, p) = top_token(&logits[row * n_vocab..(row + 1) * n_vocab]);
                if p < self.p_min {
                    continue;
                }
                out[i].push(tok);
                if out[i].len() == max {
                    continue;
                }
                let pos = self.cached.get(&seq).map_or(0, |c| c.len()) as i32;
                next.push(BatchToken {
                    token: tok,
                    pos,
                    seq,
                    logits: true,
                });
                still.push((i, seq, max));
            }
            if next.is_empty() {
                return Ok(out);
            }
            logits = self.engine.decode(&next)?;
            for t in &next {
                self.cached.entry(t.seq).or_default().push(t.token);
            }
            live = still;
        }
    }
}

impl DraftModel {
    /// What sequence `seq` must feed for its cache to hold `context`
    /// (nonempty): the cache keeps the prefix it shares with it, the rest
    /// is fed, at least the last token, whose logits start the draft. Once
    /// the feed ran, [`DraftModel::fed`] records it.
    fn catch_up(&mut self, seq: u32, context: &[u32]) -> Vec<BatchToken> {
        let last = context.len() - 1;
        let cached = self.cached.entry(seq).or_default();
        let keep = cached
            .iter()
            .zip(context)
            .take_while(|(a, b)| a == b)
            .count()
            .min(last);
        if keep < cached.len() {
            self.engine.truncate_seq(seq, keep as i32);
            cached.truncate(keep);
        }
        (keep..context.len())
            .map(|p| BatchToken {
                token: context[p],
                pos: p as i32,
                seq,
                logits: p == last,
            })
            .collect()
    }

    /// The cache of `seq` holds `context` now.
    fn fed(&mut self, seq: u32, context: &[u32]) {
        let cached = self.cached.entry(seq).or_default();
        let keep = cached.len();
        cached.extend_from_slice(&context[keep..]);
    }

    /// A tree of drafts to follow `context` (all tokens so far, the last
    /// one included) for sequence `seq`, grown best-first by path
    /// probability ([`super::tree::grow`]), no deeper than `max_depth`.
    /// Each drafting step evaluates the tree's newest nodes in one batch,
    /// each seeing only its ancestors; the nodes leave the draft's cache
    /// afterwards (its context stays). The draft's CPU threads sleep
    /// afterwards.
    pub fn draft_tree(
        &mut self,
        seq: u32,
        context: &[u32],
        shape: TreeShape,
        max_depth: usize,
    ) -> Result<DraftTree, EngineError> {
        if shape.nodes == 0 {
            return Ok(DraftTree::default());
        }
        self.scratch_tree(
            seq,
            context,
            max_depth,
            DraftTree::default(),
            |engine, logits, base, max_depth, cells| {
                grow(shape, &top_logprobs(logits, shape.children), |tree, new| {
                    // nodes at the deepest allowed level get no children
                    let open: Vec<usize> = new
                        .iter()
                        .copied()
                        .filter(|&i| tree.nodes[i].depth < max_depth)
                        .collect();
                    let rows = expand(engine, seq, base, tree, &open, cells, shape.children)?;
                    Ok(new
                        .iter()
                        .map(|i| {
                            open.iter()
                                .position(|o| o == i)
                                .map_or_else(Vec::new, |k| rows[k].clone())
                        })
                        .collect())
                })
            },
        )
    }

    /// A tree of the shape `parents` (each node's parent, None for the
    /// root's children, parents first: a recorded round's shape) to follow
    /// `context`: each node's children carry the draft's likeliest tokens
    /// after it, in order; nodes deeper than `max_depth` are left out.
    /// Returns the tree (grown level by level) and, per node of `parents`,
    /// its index in the tree (None: left out). The nodes leave the draft's
    /// cache afterwards.
    pub fn draft_shaped(
        &mut self,
        seq: u32,
        context: &[u32],
        parents: &[Option<usize>],
        max_depth: usize,
    ) -> Result<(DraftTree, Vec<Option<usize>>), EngineError> {
        let none = (DraftTree::default(), vec![None; parents.len()]);
        if parents.is_empty() {
            return Ok(none);
        }
        self.scratch_tree(
            seq,
            context,
            max_depth,
            none,
            |engine, logits, base, max_depth, cells| {
                let mut tree = DraftTree::default();
                let mut map = vec![None; parents.len()];
                let children = |p: Option<usize>| -> Vec<usize> {
                    (0..parents.len()).filter(|&i| parents[i] == p).collect()
                };
                // the root's children, then level by level: a level's nodes
                // that have children are evaluated in one step
                let mut level: Vec<usize> = Vec::new();
                let roots = children(None);
                for (&i, (tok, lp)) in roots.iter().zip(top_logprobs(logits, roots.len())) {
                    map[i] = tree.add(None, tok, lp);
                    level.push(i);
                }
                for _ in 1..max_depth {
                    let open: Vec<usize> = level
                        .iter()
                        .copied()
                        .filter(|&i| map[i].is_some() && !children(Some(i)).is_empty())
                        .collect();
                    if open.is_empty() {
                        break;
                    }
                    let width = open
                        .iter()
                        .map(|&i| children(Some(i)).len())
                        .max()
                        .unwrap_or(0);
                    let at: Vec<usize> = open.iter().map(|&i| map[i].expect("placed")).collect();
                    let rows = expand(engine, seq, base, &tree, &at, cells, width)?;
                    level.clear();
                    for (&i, row) in open.iter().zip(&rows) {
                        let p = map[i].expect("placed");
                        let lp0 = tree.nodes[p].logp;
                        for (&c, &(tok, lp)) in children(Some(i)).iter().zip(row) {
                            map[c] = tree.add(Some(p), tok, lp0 + lp);
                            level.push(c);
                        }
                    }
                }
                Ok((tree, map))
            },
        )
    }

    /// What both tree drafters share: the cache of `seq` catches up with
    /// `context`, then `grow(engine, logits after the context, the
    /// context's last position, the depth allowed, the nodes' cells)`
    /// places the tree's nodes; afterwards those cells leave the cache and
    /// the draft's CPU threads sleep. A node at depth d is decoded at
    /// context.len() - 1 + d, so the depth stays inside the draft's
    /// context; `empty` where no node fits.
    fn scratch_tree<T>(
        &mut self,
        seq: u32,
        context: &[u32],
        max_depth: usize,
        empty: T,
        grow: impl FnOnce(&mut Engine, &[f32], i32, usize, &mut Vec<u32>) -> Result<T, EngineError>,
    ) -> Result<T, EngineError> {
        let n_ctx = self.engine.n_ctx() as usize;
        let max_depth = max_depth.min(n_ctx.saturating_sub(context.len()));
        if context.is_empty() || max_depth == 0 {
            self.engine.park_threads();
            return Ok(empty);
        }
        let mut cells = Vec::new();
        let feed = self.catch_up(seq, context);
        let r = match self.engine.decode(&feed) {
            Ok(logits) => {
                self.fed(seq, context);
                let base = context.len() as i32 - 1;
                grow(&mut self.engine, &logits, base, max_depth, &mut cells)
            }
            Err(e) => Err(e),
        };
        if !cells.is_empty() {
            self.engine.drop_cells(seq, &cells);
        }
        self.engine.park_threads();
        r
    }
}

/// Evaluates the tree's nodes `open` in one draft step, each seeing only
/// its ancestors (placed by earlier steps: `cells[i]` is node i's cell,
/// u32::MAX where none), records their cells, and returns each one's
/// `width` likeliest next tokens with their log probabilities.
fn expand(
    engine: &mut Engine,
    seq: u32,
    base: i32,
    tree: &DraftTree,
    open: &[usize],
    cells: &mut Vec<u32>,
    width: usize,
) -> Result<Vec<Vec<(u32, f32)>>, EngineError> {
    if open.is_empty() {
        return Ok(Vec::new());
    }
    let mut step = StepTree::new();
    step.placed = cells.iter().copied().filter(|&c| c != u32::MAX).collect();
    let toks: Vec<BatchToken> = open
        .iter()
        .map(|&i| {
            let n = tree.nodes[i];
            let path = tree.path(i);
            step.push(
                None,
                path[..path.len() - 1].iter().map(|&a| cells[a]).collect(),
            );
            BatchToken {
                token: n.token,
                pos: base + n.depth as i32,
                seq,
                logits: true,
            }
        })
        .collect();
    let (l, placed) = engine.decode_tree(&toks, &step)?;
    let n_vocab = l.len() / toks.len();
    let mut out = Vec::with_capacity(open.len());
    for (k, &i) in open.iter().enumerate() {
        if cells.len() <= i {
            cells.resize(i + 1, u32::MAX);
        }
        cells[i] = placed[k];
        out.push(top_logprobs(&l[k * n_vocab..(k + 1) * n_vocab], width));
    }
    Ok(out)
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
