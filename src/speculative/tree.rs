//! Token trees: many candidate continuations verified in one target step.
//!
//! A chain of k drafts is lost from its first wrong token on. A tree keeps
//! alternatives where the drafter is unsure: the draft model's best few
//! tokens after each node it expands, chosen best-first by the probability
//! of the whole path (SpecInfer, SpecExec, Sequoia). The target verifies
//! every node in one step, each node seeing only its ancestors
//! ([`crate::kv::StepTree`]), and the round emits the longest path the
//! target agrees with plus the target's own next token. Where weights
//! stream over PCIe a step of a few hundred rows costs about what one row
//! costs, so the room goes to alternatives instead of ever longer chains.
//!
//! Verification ([`verify_tree`]): from the root, the target's sampler
//! draws `y` from the current node's row exactly as plain decoding would;
//! `y` is emitted; if a child of the node carries `y`, its KV row is in the
//! cache and its row holds the logits after it, so verification goes on
//! there, else the round ends with `y` pending. Siblings carry distinct
//! tokens, so at most one child matches. Every node is a point mass, so
//! drawing `y ~ p` and descending to the child that carries it is the
//! multi-candidate rejection scheme of SpecInfer/SpecTr (accept child x_i
//! with probability p(x_i) / (1 - p(x_1) - ... - p(x_{i-1})) of the
//! residual, else go on) drawn with one sample: the emitted tokens are
//! those plain decoding draws, one draw per token, at any temperature.
//! A chain is the tree whose nodes each have one child.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

/// A drafted token and where it hangs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TreeNode {
    pub token: u32,
    /// Index of the parent node; None: a child of the root (the pending
    /// token, which is not a node).
    pub parent: Option<usize>,
    /// 1 for the root's children.
    pub depth: usize,
    /// The drafter's log probability of the path to this node.
    pub logp: f32,
}

/// Drafts as a tree, nodes in topological order (parents first), siblings
/// with distinct tokens.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DraftTree {
    pub nodes: Vec<TreeNode>,
}

impl DraftTree {
    /// `tokens` as a chain, each the child of the one before.
    pub fn chain(tokens: &[u32]) -> DraftTree {
        let nodes = tokens
            .iter()
            .enumerate()
            .map(|(i, &token)| TreeNode {
                token,
                parent: i.checked_sub(1),
                depth: i + 1,
                logp: 0.0,
            })
            .collect();
        DraftTree { nodes }
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }
    /// Whether every node has at most one child.
    pub fn is_chain(&self) -> bool {
        self.nodes
            .iter()
            .enumerate()
            .all(|(i, n)| n.parent == i.checked_sub(1))
    }
    pub fn depth(&self) -> usize {
        self.nodes.iter().map(|n| n.depth).max().unwrap_or(0)
    }

    /// Adds a node; returns its index, or None where a sibling already
    /// carries `token`.
    pub fn add(&mut self, parent: Option<usize>, token: u32, logp: f32) -> Option<usize> {
        if self.child(parent, token).is_some() {
            return None;
        }
        let depth = parent.map_or(1, |p| self.nodes[p].depth + 1);
        self.nodes.push(TreeNode {
            token,
            parent,
            depth,
            logp,
        });
        Some(self.nodes.len() - 1)
    }

    /// The child of `parent` (None: the root) that carries `token`.
    pub fn child(&self, parent: Option<usize>, token: u32) -> Option<usize> {
        self.nodes
            .iter()
            .position(|n| n.parent == parent && n.token == token)
    }

    /// The nodes from the root's child down to `node`.
    pub fn path(&self, node: usize) -> Vec<usize> {
        let mut out = vec![node];
        while let Some(p) = self.nodes[*out.last().expect("nonempty")].parent {
            out.push(p);
        }
        out.reverse();
        out
    }

    /// Keeps the first `n` nodes (a tree still: parents come first).
    pub fn truncate(&mut self, n: usize) {
        self.nodes.truncate(n);
    }

    /// The same tree in depth-first order, each node's children likeliest
    /// first, and where each old index went. A verifying step places its
    /// nodes in cells in this order, so the likeliest path sits in the very
    /// cells a chain would: when it is the one accepted, nothing moves
    /// ([`DraftTree::in_chain_cells`]).
    pub fn preorder(&self) -> (DraftTree, Vec<usize>) {
        let mut kids: Vec<Vec<usize>> = vec![Vec::new(); self.len() + 1];
        for (i, n) in self.nodes.iter().enumerate() {
            kids[n.parent.map_or(0, |p| p + 1)].push(i);
        }
        for k in &mut kids {
            // stable: equal paths keep their order
            k.sort_by(|&a, &b| self.nodes[b].logp.total_cmp(&self.nodes[a].logp));
        }
        let mut out = DraftTree::default();
        let mut map = vec![usize::MAX; self.len()];
        let mut stack: Vec<usize> = kids[0].iter().rev().copied().collect();
        while let Some(i) = stack.pop() {
            let n = self.nodes[i];
            map[i] = out.nodes.len();
            out.nodes.push(TreeNode {
                parent: n.parent.map(|p| map[p]),
                ..n
            });
            stack.extend(kids[i + 1].iter().rev());
        }
        (out, map)
    }

    /// Whether accepting `path` leaves its nodes in the cells a chain of
    /// them would have taken: the step placed its tokens in order, so that
    /// holds iff the path is the tree's first nodes.
    pub fn in_chain_cells(path: &[usize]) -> bool {
        path.iter().enumerate().all(|(k, &n)| n == k)
    }

    /// The tokens of a verifying step: the pending token, then each node.
    pub fn step_tokens(&self, pending: u32) -> Vec<u32> {
        std::iter::once(pending)
            .chain(self.nodes.iter().map(|n| n.token))
            .collect()
    }
    /// Per token of the verifying step: its position offset from the
    /// pending token's, and its parent's index in the step.
    pub fn step_layout(&self) -> Vec<(usize, Option<u32>)> {
        std::iter::once((0, None))
            .chain(
                self.nodes
                    .iter()
                    .map(|n| (n.depth, Some(n.parent.map_or(0, |p| p as u32 + 1)))),
            )
            .collect()
    }
}

/// Draws a round's tokens from a verifying step's `rows` (row 0: after the
/// pending token; row 1 + i: after node i and its ancestors; `n_vocab`
/// each), walking down the tree while the drawn token is a child's (see
/// the module docs). `emit(token, node)` sees each token with the node
/// that carries it (its KV row is in the cache) or None (the round's last,
/// pending token), and returns false to stop there. Returns the accepted
/// nodes, root to leaf.
pub fn verify_tree(
    sampler: &mut crate::sample::Sampler,
    rows: &[f32],
    n_vocab: usize,
    tree: &DraftTree,
    mut emit: impl FnMut(u32, Option<usize>, &mut crate::sample::Sampler) -> bool,
) -> Result<Vec<usize>, crate::sample::SampleError> {
    let mut path = Vec::new();
    let mut at: Option<usize> = None;
    loop {
        let row = at.map_or(0, |i| i + 1);
        let tok = sampler.sample(&rows[row * n_vocab..(row + 1) * n_vocab])?;
        sampler.accept(tok);
        let child = tree.child(at, tok);
        if !emit(tok, child, sampler) {
            return Ok(path);
        }
        match child {
            Some(c) => {
                path.push(c);
                at = Some(c);
            }
            None => return Ok(path),
        }
    }
}

/// A candidate child while a tree grows: its path's log probability.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Candidate {
    logp: f32,
    parent: Option<usize>,
    token: u32,
}
impl Eq for Candidate {}
impl Ord for Candidate {
    fn cmp(&self, o: &Self) -> Ordering {
        // best path first; on ties the earlier parent, the lower token
        self.logp
            .total_cmp(&o.logp)
            .then_with(|| o.parent.cmp(&self.parent))
            .then_with(|| o.token.cmp(&self.token))
    }
}
impl PartialOrd for Candidate {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}

/// How a tree grows.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TreeShape {
    /// Most nodes.
    pub nodes: usize,
    /// Most drafting steps, so most levels: each step evaluates the nodes
    /// the last one added, in one batch.
    pub depth: usize,
    /// Children considered per expanded node.
    pub children: usize,
    /// Paths less likely than this (by the drafter) are not drafted.
    pub min_p: f32,
}

impl TreeShape {
    /// A tree of up to `nodes` nodes and `depth` levels: up to 8 children
    /// considered per node; paths below 0.1% left out.
    pub fn of(nodes: usize, depth: usize) -> TreeShape {
        TreeShape {
            nodes,
            depth,
            children: nodes.clamp(1, 8),
            min_p: 1e-3,
        }
    }
}

/// Grows a tree best-first by path probability in at most `shape.depth`
/// drafting steps: the root's `children` (token, log probability) are the
/// first candidates; each step takes the best candidates into the tree,
/// as many as spreads the nodes left evenly over the steps left (so a
/// drafter that is sure grows one long path and a few branches, and one
/// that is not a bushy tree), and, unless the tree is full, asks `expand`
/// for the best children of those new nodes ((token, log probability
/// given the node), `shape.children` at most each), whose paths become
/// candidates. Stops when the tree holds `shape.nodes`, the steps are
/// spent, or no candidate path is likelier than `shape.min_p`.
pub fn grow<E>(
    shape: TreeShape,
    children: &[(u32, f32)],
    mut expand: impl FnMut(&DraftTree, &[usize]) -> Result<Vec<Vec<(u32, f32)>>, E>,
) -> Result<DraftTree, E> {
    let min_logp = shape.min_p.max(f32::MIN_POSITIVE).ln();
    let mut tree = DraftTree::default();
    let mut heap = BinaryHeap::new();
    let offer = |heap: &mut BinaryHeap<Candidate>, parent, base: f32, kids: &[(u32, f32)]| {
        for &(token, lp) in kids.iter().take(shape.children) {
            let logp = base + lp;
            if logp >= min_logp {
                heap.push(Candidate {
                    logp,
                    parent,
                    token,
                });
            }
        }
    };
    offer(&mut heap, None, 0.0, children);
    for step in 0..shape.depth {
        let take = (shape.nodes - tree.len()).div_ceil(shape.depth - step);
        let mut new = Vec::new();
        while new.len() < take {
            let Some(c) = heap.pop() else { break };
            if let Some(i) = tree.add(c.parent, c.token, c.logp) {
                new.push(i);
            }
        }
        if new.is_empty() || tree.len() == shape.nodes || step + 1 == shape.depth {
            break;
        }
        let kids = expand(&tree, &new)?;
        for (&i, k) in new.iter().zip(&kids) {
            offer(&mut heap, Some(i), tree.nodes[i].logp, k);
        }
    }
    Ok(tree)
}

/// The `k` likeliest tokens of a logit row with their log probabilities
/// (softmax over the whole row), best first, lowest id on ties.
pub fn top_logprobs(logits: &[f32], k: usize) -> Vec<(u32, f32)> {
    let max = logits
        .iter()
        .copied()
        .filter(|x| !x.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() || k == 0 {
        return Vec::new();
    }
    let lse = f64::from(max)
        + logits
            .iter()
            .filter(|x| !x.is_nan())
            .map(|&x| (f64::from(x) - f64::from(max)).exp())
            .sum::<f64>()
            .ln();
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    for (i, &l) in logits.iter().enumerate() {
        if l.is_nan() || (top.len() == k && l <= top[k - 1].1) {
            continue;
        }
        let at = top.partition_point(|&(_, x)| x >= l);
        top.insert(at, (i as u32, l));
        top.truncate(k);
    }
    top.into_iter()
        .map(|(i, l)| (i, (f64::from(l) - lse) as f32))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::{Sampler, SamplerConfig};

    const V: usize = 6;

    /// A toy language: the logits after a path depend on its tokens.
    fn logits_after(path: &[u32]) -> Vec<f32> {
        let h = path
            .iter()
            .fold(7u64, |h, &t| h.wrapping_mul(31).wrapping_add(t as u64 + 1));
        (0..V as u64)
            .map(|t| ((h.wrapping_mul(t + 3) % 97) as f32) / 20.0)
            .collect()
    }

    /// The rows of a verifying step over `tree` after `ctx`.
    fn rows(ctx: &[u32], tree: &DraftTree) -> Vec<f32> {
        let mut out = logits_after(ctx);
        for i in 0..tree.len() {
            let mut p = ctx.to_vec();
            p.extend(tree.path(i).iter().map(|&j| tree.nodes[j].token));
            out.extend(logits_after(&p));
        }
        out
    }

    /// `n` tokens by plain decoding from `ctx`.
    fn plain(s: &mut Sampler, ctx: &[u32], n: usize) -> Vec<u32> {
        let mut c = ctx.to_vec();
        let mut out = Vec::new();
        for _ in 0..n {
            let t = s.sample(&logits_after(&c)).unwrap();
            s.accept(t);
            out.push(t);
            c.push(t);
        }
        out
    }

    /// `n` tokens by rounds of tree drafting (every node's children: the
    /// drafter's best `w`, a drafter that is not the target).
    fn drafted(
        s: &mut Sampler,
        ctx: &[u32],
        n: usize,
        nodes: usize,
        w: usize,
    ) -> (Vec<u32>, usize) {
        let mut c = ctx.to_vec();
        let mut out = Vec::new();
        let mut accepted = 0;
        let draft = |p: &[u32]| -> Vec<(u32, f32)> {
            let mut l = logits_after(p);
            l.reverse(); // a poor drafter
            l.iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x += (i % 2) as f32);
            top_logprobs(&l, w)
        };
        while out.len() < n {
            let shape = TreeShape {
                nodes,
                depth: nodes,
                children: w,
                min_p: 0.0,
            };
            let tree = grow(shape, &draft(&c), |t, new| {
                Ok::<_, ()>(
                    new.iter()
                        .map(|&i| {
                            let mut p = c.clone();
                            p.extend(t.path(i).iter().map(|&j| t.nodes[j].token));
                            draft(&p)
                        })
                        .collect(),
                )
            })
            .unwrap();
            let r = rows(&c, &tree);
            let path = verify_tree(s, &r, V, &tree, |t, _, _| {
                out.push(t);
                c.push(t);
                out.len() < n
            })
            .unwrap();
            accepted += path.len();
        }
        (out, accepted)
    }

    fn sampled(seed: u64) -> SamplerConfig {
        SamplerConfig {
            temperature: 0.9,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.2,
            repeat_last_n: 64,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            seed,
            logit_bias: Vec::new(),
        }
    }

    #[test]
    fn trees_emit_the_tokens_plain_decoding_emits() {
        let mut accepted = 0;
        for seed in 0..300 {
            for cfg in [SamplerConfig::greedy(), sampled(seed)] {
                let want = plain(&mut Sampler::new(cfg.clone()).unwrap(), &[1, 2], 12);
                for (nodes, w) in [(1, 1), (4, 1), (6, 2), (15, 3)] {
                    let (got, a) = drafted(
                        &mut Sampler::new(cfg.clone()).unwrap(),
                        &[1, 2],
                        12,
                        nodes,
                        w,
                    );
                    assert_eq!(got, want, "seed {seed}, {nodes} nodes, width {w}");
                    accepted += a;
                }
            }
        }
        assert!(accepted > 1000, "{accepted}");
    }

    /// Pearson's chi-square (5 degrees of freedom, 20.5 at 0.001) of the
    /// second token of a sampled round through a tree whose root has
    /// several children, against the distribution plain decoding draws
    /// from: the second token comes from whichever child's row the first
    /// token chose, and must follow the target's distribution after it.
    #[test]
    fn sampled_trees_follow_the_targets_distribution() {
        let ctx = [3u32, 1];
        let cfg = |seed| SamplerConfig {
            repeat_penalty: 1.0,
            ..sampled(seed)
        };
        let dist = |row: &[f32]| -> Vec<f64> {
            let l: Vec<f64> = row.iter().map(|&x| f64::from(x) / 0.9).collect();
            let m = l.iter().cloned().fold(f64::MIN, f64::max);
            let z: f64 = l.iter().map(|x| (x - m).exp()).sum();
            l.iter().map(|x| (x - m).exp() / z).collect()
        };
        // the root's children: the three likeliest tokens
        let kids: Vec<u32> = top_logprobs(&logits_after(&ctx), 3)
            .iter()
            .map(|k| k.0)
            .collect();
        let mut tree = DraftTree::default();
        for &t in &kids {
            tree.add(None, t, 0.0);
        }
        let r = rows(&ctx, &tree);
        let p0 = dist(&r[..V]);
        let mut first = [0u64; V];
        let mut second = vec![[0u64; V]; V];
        for seed in 0..30000 {
            let mut s = Sampler::new(cfg(seed)).unwrap();
            let mut got = Vec::new();
            verify_tree(&mut s, &r, V, &tree, |t, _, _| {
                got.push(t);
                true
            })
            .unwrap();
            first[got[0] as usize] += 1;
            if let Some(&t) = got.get(1) {
                second[got[0] as usize][t as usize] += 1;
            }
        }
        let chi2 = |counts: &[u64], p: &[f64]| -> f64 {
            let n: u64 = counts.iter().sum();
            counts
                .iter()
                .zip(p)
                .map(|(&o, &p)| (o as f64 - p * n as f64).powi(2) / (p * n as f64))
                .sum()
        };
        assert!(chi2(&first, &p0) < 20.5, "first: {}", chi2(&first, &p0));
        for &t in &kids {
            let t = t as usize;
            let mut c = ctx.to_vec();
            c.push(t as u32);
            let p = dist(&logits_after(&c));
            let x = chi2(&second[t], &p);
            assert!(x < 20.5, "after {t}: chi2 {x}");
            assert!(second[t].iter().sum::<u64>() > 1000);
        }
    }

    #[test]
    fn grow_is_best_first_within_the_shape() {
        // every node's children: token 0 at 0.6, token 1 at 0.3, token 2 at 0.1
        let kids = vec![(0, 0.6f32.ln()), (1, 0.3f32.ln()), (2, 0.1f32.ln())];
        let paths = |t: &DraftTree| -> Vec<Vec<u32>> {
            (0..t.len())
                .map(|i| t.path(i).iter().map(|&j| t.nodes[j].token).collect())
                .collect()
        };
        let mut steps = 0;
        let shape = TreeShape {
            nodes: 7,
            depth: 3,
            children: 2,
            min_p: 0.0,
        };
        let t = grow(shape, &kids, |_, new| {
            steps += 1;
            Ok::<_, ()>(new.iter().map(|_| kids.clone()).collect())
        })
        .unwrap();
        // 7 nodes over 3 steps, as many as spread the rest over the steps
        // left (only the best two children count): 0 (.6) and 1 (.3), all
        // the root has; then 3: 00 (.36), 01 and 10 (.18); then 2: 000
        // (.216), 001 (.108, the earliest parent of three)
        let want: Vec<Vec<u32>> = vec![
            vec![0],
            vec![1],
            vec![0, 0],
            vec![0, 1],
            vec![1, 0],
            vec![0, 0, 0],
            vec![0, 0, 1],
        ];
        assert_eq!(paths(&t), want);
        assert_eq!(steps, 2, "the last step's nodes are not expanded");
        // a sure drafter: one node a step makes a long path
        let sure = vec![(0, 0.95f32.ln()), (1, 0.04f32.ln())];
        let t = grow(
            TreeShape {
                nodes: 8,
                depth: 8,
                children: 2,
                min_p: 0.0,
            },
            &sure,
            |_, new| Ok::<_, ()>(new.iter().map(|_| sure.clone()).collect()),
        )
        .unwrap();
        assert_eq!(t.depth(), 8);
        assert!(t.is_chain());
        // the floor: nothing under 20%
        let t = grow(
            TreeShape {
                min_p: 0.2,
                depth: 8,
                ..shape
            },
            &kids,
            |_, new| Ok::<_, ()>(new.iter().map(|_| kids.clone()).collect()),
        )
        .unwrap();
        assert!(t.nodes.iter().all(|n| n.logp >= 0.2f32.ln()));
        assert_eq!(t.len(), 4); // .6 .3 .36 .216
    }

    #[test]
    fn chains_are_trees_and_step_layout_follows_parents() {
        let c = DraftTree::chain(&[5, 6, 7]);
        assert!(c.is_chain());
        assert_eq!(c.depth(), 3);
        assert_eq!(c.step_tokens(9), vec![9, 5, 6, 7]);
        assert_eq!(
            c.step_layout(),
            vec![(0, None), (1, Some(0)), (2, Some(1)), (3, Some(2))]
        );
        let mut t = DraftTree::default();
        t.add(None, 1, 0.0);
        t.add(None, 2, 0.0);
        assert_eq!(t.add(None, 2, 0.0), None, "siblings carry distinct tokens");
        t.add(Some(1), 3, 0.0);
        assert!(!t.is_chain());
        assert_eq!(
            t.step_layout(),
            vec![(0, None), (1, Some(0)), (1, Some(0)), (2, Some(2))]
        );
        assert_eq!(t.path(2), vec![1, 2]);
    }

    #[test]
    fn preorder_puts_the_likeliest_path_first() {
        let mut t = DraftTree::default();
        let a = t.add(None, 1, -2.0); // 0
        let b = t.add(None, 2, -0.5); // 1
        t.add(a, 3, -2.5); // 2
        let bb = t.add(b, 4, -1.5); // 3
        t.add(b, 5, -0.7); // 4
        t.add(bb, 6, -1.6); // 5
        let (p, map) = t.preorder();
        let tokens: Vec<u32> = p.nodes.iter().map(|n| n.token).collect();
        assert_eq!(tokens, vec![2, 5, 4, 6, 1, 3]);
        assert_eq!(map, vec![4, 0, 5, 2, 1, 3]);
        for (old, &new) in map.iter().enumerate() {
            let path = |t: &DraftTree, i: usize| -> Vec<u32> {
                t.path(i).iter().map(|&j| t.nodes[j].token).collect()
            };
            assert_eq!(path(&p, new), path(&t, old));
            if let Some(q) = p.nodes[new].parent {
                assert!(q < new, "parents first");
            }
        }
        assert!(DraftTree::in_chain_cells(&[0, 1]));
        assert!(DraftTree::in_chain_cells(&[]));
        assert!(!DraftTree::in_chain_cells(&[0, 2]));
        let c = DraftTree::chain(&[7, 8, 9]);
        assert_eq!(c.preorder().0, c);
    }

    #[test]
    fn top_logprobs_are_log_softmax_best_first() {
        let t = top_logprobs(&[0.0, 2.0, 1.0, 2.0], 3);
        assert_eq!(t.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 3, 2]);
        let z = (1.0f64 + 2.0 * 2f64.exp() + 1f64.exp()).ln();
        assert!((f64::from(t[0].1) - (2.0 - z)).abs() < 1e-6);
        assert!(top_logprobs(&[f32::NAN], 2).is_empty());
    }
}
