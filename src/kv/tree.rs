//! Token trees in the KV cache: a step whose tokens are the nodes of a tree
//! of drafts (speculative decoding with trees), each node seeing only its
//! ancestors.
//!
//! The causal rule of [`super::KvCells::fill_mask`] lets a token see every
//! cell of its sequence at a position up to its own. A tree's nodes at one
//! depth share a position, so that rule would let a node see its siblings
//! and cousins. A [`StepTree`] names the tree's cells (those this step
//! places, and those earlier steps placed: a draft model grows its tree one
//! step per level) and, per token, which of them are its ancestors;
//! [`StepTree::hide`] then masks every other tree cell from it. Cells that
//! are not the tree's (the context before it) keep the causal rule.
//!
//! Positions: a node at depth d below a token at position p sits at p + d,
//! the position it would have in a chain, so rotary embeddings see what a
//! plain decode of that path would see.

/// The tree structure of one step's tokens (see the module docs).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StepTree {
    /// Cells of the tree placed by earlier steps: hidden from this step's
    /// tokens except where `sees` lists them.
    pub placed: Vec<u32>,
    /// Per token of the step: its parent among the step's tokens (an index
    /// below its own), or None. A token sees the step's cells of its parent
    /// chain and its own, no other cell this step places.
    pub parent: Vec<Option<u32>>,
    /// Per token of the step: the cells of `placed` it may see (its
    /// ancestors placed earlier). A token also sees what its parent chain
    /// in the step sees.
    pub sees: Vec<Vec<u32>>,
}

impl StepTree {
    /// A step of `n` tokens with no tree: each token its own root. Chains
    /// are built with [`StepTree::push`].
    pub fn new() -> StepTree {
        StepTree::default()
    }

    /// Adds the next token of the step.
    pub fn push(&mut self, parent: Option<u32>, sees: Vec<u32>) {
        self.parent.push(parent);
        self.sees.push(sees);
    }

    /// Checks the tree against the step's `(seq, pos)` tokens and a cache
    /// of `size` cells: one entry per token, parents before their children,
    /// in the same sequence, one position before; seen cells among the
    /// placed ones, placed cells in the cache. Err: what is wrong.
    pub fn validate(&self, tokens: &[(u32, i32)], size: usize) -> Result<(), String> {
        let bad = |what: String| Err(what);
        if self.parent.len() != tokens.len() || self.sees.len() != tokens.len() {
            return bad(format!(
                "{} parents and {} seen lists for {} tokens",
                self.parent.len(),
                self.sees.len(),
                tokens.len()
            ));
        }
        if let Some(&c) = self.placed.iter().find(|&&c| c as usize >= size) {
            return bad(format!(
                "placed cell {c} is outside the cache of {size} cells"
            ));
        }
        for (i, (&p, sees)) in self.parent.iter().zip(&self.sees).enumerate() {
            if let Some(p) = p {
                let (s, pos) = tokens[i];
                if p as usize >= i {
                    return bad(format!("token {i} has parent {p}, not an earlier token"));
                }
                if tokens[p as usize] != (s, pos - 1) {
                    return bad(format!(
                        "token {i} (sequence {s}, position {pos}) has parent {p} at {:?}",
                        tokens[p as usize]
                    ));
                }
            }
            if let Some(c) = sees.iter().find(|c| !self.placed.contains(c)) {
                return bad(format!(
                    "token {i} sees cell {c}, which is not a placed tree cell"
                ));
            }
        }
        Ok(())
    }

    /// The tree cells token `i` may see, given the cells the step's tokens
    /// were placed in.
    pub fn visible(&self, i: usize, cells: &[u32]) -> Vec<u32> {
        let mut out = Vec::new();
        let mut at = Some(i as u32);
        while let Some(j) = at {
            out.push(cells[j as usize]);
            out.extend_from_slice(&self.sees[j as usize]);
            at = self.parent[j as usize];
        }
        out
    }

    /// Masks (to -inf) in `mask`, the [n_kv, n_tokens] rows
    /// [`super::KvCells::fill_mask`] wrote for this step, every tree cell a
    /// token may not see. `cells`: the cells the step's tokens were placed
    /// in.
    pub fn hide(&self, cells: &[u32], n_kv: usize, mask: &mut [u16]) {
        const NEG_INF: u16 = 0xFC00;
        let tree: Vec<u32> = self.placed.iter().chain(cells).copied().collect();
        for i in 0..cells.len() {
            let vis = self.visible(i, cells);
            let row = &mut mask[i * n_kv..(i + 1) * n_kv];
            for &c in &tree {
                if (c as usize) < n_kv && !vis.contains(&c) {
                    row[c as usize] = NEG_INF;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::KvCells;
    use super::*;
    use proptest::prelude::*;

    /// The visible cells of each row of a mask.
    fn rows(m: &[u16], n_kv: usize) -> Vec<Vec<usize>> {
        m.chunks(n_kv)
            .map(|r| (0..n_kv).filter(|&c| r[c] == 0).collect())
            .collect()
    }

    /// Pinned: a context of 3 tokens, then a verifying step of the pending
    /// token (position 3) and a tree of 5 drafts: two children of the root
    /// (a, b), two children of a (c, d) and one of c (e).
    ///
    /// ```text
    ///   root(3) ─ a(4) ─ c(5) ─ e(6)
    ///           │      └ d(5)
    ///           └ b(4)
    /// ```
    #[test]
    fn verifying_step_mask_snapshot() {
        let mut kv = KvCells::new(16);
        kv.place(&[(0, 0), (0, 1), (0, 2)]).unwrap();
        let toks = [(0, 3), (0, 4), (0, 4), (0, 5), (0, 5), (0, 6)];
        let cells = kv.place(&toks).unwrap();
        let mut t = StepTree::new();
        for p in [None, Some(0), Some(0), Some(1), Some(1), Some(3)] {
            t.push(p, Vec::new());
        }
        t.validate(&toks, 16).unwrap();
        let mut m = Vec::new();
        kv.fill_mask(&toks, 16, None, &mut m);
        t.hide(&cells, 16, &mut m);
        let text: Vec<String> = rows(&m, 16)
            .iter()
            .map(|r| {
                r.iter()
                    .map(|c| c.to_string())
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .collect();
        assert_eq!(
            text,
            [
                "0 1 2 3",     // root
                "0 1 2 3 4",   // a
                "0 1 2 3 5",   // b: not a
                "0 1 2 3 4 6", // c: root, a
                "0 1 2 3 4 7", // d: not c
                "0 1 2 3 4 6 8",
            ]
        );
    }

    #[test]
    fn bad_trees_are_refused_with_the_reason() {
        let toks = [(0, 3), (0, 4), (1, 4)];
        let mut t = StepTree::new();
        t.push(None, Vec::new());
        assert!(t
            .validate(&toks, 8)
            .unwrap_err()
            .to_string()
            .contains("1 parents"));
        t.push(Some(1), Vec::new());
        t.push(None, Vec::new());
        let e = t.validate(&toks, 8).unwrap_err().to_string();
        assert!(e.contains("not an earlier token"), "{e}");
        t.parent[1] = Some(0);
        t.parent[2] = Some(0);
        let e = t.validate(&toks, 8).unwrap_err().to_string();
        assert!(e.contains("sequence 1"), "{e}");
        t.parent[2] = None;
        t.sees[2] = vec![5];
        let e = t.validate(&toks, 8).unwrap_err().to_string();
        assert!(e.contains("cell 5"), "{e}");
        t.placed = vec![5, 9];
        let e = t.validate(&toks, 8).unwrap_err().to_string();
        assert!(e.contains("placed cell 9"), "{e}");
        t.placed = vec![5];
        t.validate(&toks, 8).unwrap();
    }

    /// A random tree of `n` nodes below a root: each node's parent (None:
    /// the root), in topological order.
    fn tree_strategy() -> impl Strategy<Value = Vec<Option<usize>>> {
        proptest::collection::vec(any::<prop::sample::Index>(), 1..24).prop_map(|ix| {
            (0..ix.len())
                .map(|i| {
                    let k = ix[i].index(i + 1);
                    (k < i).then_some(k)
                })
                .collect()
        })
    }

    fn depth(parents: &[Option<usize>], i: usize) -> i32 {
        parents[i].map_or(1, |p| 1 + depth(parents, p))
    }

    fn path(parents: &[Option<usize>], i: usize) -> Vec<usize> {
        let mut out = vec![i];
        while let Some(p) = parents[*out.last().unwrap()] {
            out.push(p);
        }
        out.reverse();
        out
    }

    proptest! {
        /// Grown in one step or level by level over several steps (as a
        /// draft model grows it), a tree's mask lets every node see exactly
        /// the context, the root and its ancestors; then, the accepted path
        /// kept and the other nodes dropped, the sequence holds exactly the
        /// context and the path's positions, each once, and a next token
        /// sees exactly them, as if the rejected nodes were never placed.
        #[test]
        fn tree_masks_and_rollback(parents in tree_strategy(), ctx in 1i32..6, pick in any::<prop::sample::Index>(), levels in any::<bool>(), other in any::<bool>()) {
            let n = parents.len();
            let mut kv = KvCells::new(64);
            let context: Vec<(u32, i32)> = (0..ctx).map(|p| (0, p)).collect();
            kv.place(&context).unwrap();
            if other {
                // another sequence's cells interleave
                kv.place(&[(1, 0), (1, 1)]).unwrap();
            }
            let root = kv.place(&[(0, ctx)]).unwrap()[0];
            let mut cell = vec![u32::MAX; n];
            let d: Vec<i32> = (0..n).map(|i| depth(&parents, i)).collect();
            let max_d = *d.iter().max().unwrap();
            // one step of every node, or one step per depth
            let steps: Vec<Vec<usize>> = if levels {
                (1..=max_d).map(|l| (0..n).filter(|&i| d[i] == l).collect()).collect()
            } else {
                vec![(0..n).collect()]
            };
            for step in steps {
                let toks: Vec<(u32, i32)> = step.iter().map(|&i| (0, ctx + d[i])).collect();
                let mut t = StepTree::new();
                t.placed.push(root);
                t.placed.extend(cell.iter().copied().filter(|&c| c != u32::MAX));
                for &i in &step {
                    let in_step = parents[i].and_then(|p| step.iter().position(|&j| j == p));
                    let sees: Vec<u32> = if in_step.is_some() {
                        Vec::new()
                    } else {
                        // ancestors placed earlier, and the root
                        let mut s = vec![root];
                        s.extend(path(&parents, i).iter().rev().skip(1).map(|&a| cell[a]));
                        s
                    };
                    t.push(in_step.map(|x| x as u32), sees);
                }
                t.validate(&toks, 64).unwrap();
                let placed = kv.place(&toks).unwrap();
                let mut m = Vec::new();
                kv.fill_mask(&toks, 64, None, &mut m);
                t.hide(&placed, 64, &mut m);
                for (k, &i) in step.iter().enumerate() {
                    cell[i] = placed[k];
                    let mut want: Vec<u32> = kv.seq_cells(0).iter().filter(|&&(_, p)| p < ctx).map(|&(c, _)| c).collect();
                    want.push(root);
                    want.extend(path(&parents, i).iter().map(|&a| cell[a]));
                    want.sort_unstable();
                    let got: Vec<u32> = (0..64u32).filter(|&c| m[k * 64 + c as usize] == 0).collect();
                    prop_assert_eq!(got, want, "node {}", i);
                }
            }
            // accept a path: the nodes on the way to a random node
            let kept = path(&parents, pick.index(n));
            let dropped: Vec<u32> = (0..n).filter(|i| !kept.contains(i)).map(|i| cell[i]).collect();
            kv.drop_cells(0, &dropped);
            let held: Vec<i32> = kv.seq_cells(0).iter().map(|&(_, p)| p).collect::<std::collections::BTreeSet<_>>().into_iter().collect();
            let want: Vec<i32> = (0..=ctx + kept.len() as i32).collect();
            prop_assert_eq!(&held, &want);
            prop_assert_eq!(kv.seq_cells(0).len(), want.len());
            prop_assert_eq!(kv.used(), want.len() + if other { 2 } else { 0 });
            let next = (0, ctx + kept.len() as i32 + 1);
            let c = kv.place(&[next]).unwrap();
            let mut m = Vec::new();
            kv.fill_mask(&[next], 64, None, &mut m);
            let seen: Vec<u32> = (0..64u32).filter(|&x| m[x as usize] == 0).collect();
            let mut want: Vec<u32> = kv.seq_cells(0).iter().map(|&(x, _)| x).collect();
            want.sort_unstable();
            prop_assert_eq!(seen, want);
            prop_assert!(kv.seq_cells(0).iter().any(|&(x, _)| x == c[0]));
        }
    }
}
