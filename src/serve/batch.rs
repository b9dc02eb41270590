//! Continuous batching and the prefix cache, in plain Rust.
//!
//! The [`Batcher`] decides, at every step boundary, what the engine's next
//! step holds; the server's engine loop carries it out. Requests wait in a
//! FIFO queue until one of `parallel` places is free. An active sequence
//! first feeds its prompt, in chunks mixed with the other sequences' decode
//! tokens (chunked prefill: decode tokens go first, prompt chunks fill the
//! step up to `n_batch` tokens), then one sampled token per step until it
//! finishes; a finished sequence leaves at once.
//!
//! Prefix cache. Every sequence has an engine sequence id, and a KV cell can
//! belong to several sequences ([`crate::kv::KvCells`]). A new request looks
//! for the sequence (running, or finished and kept) whose tokens share the
//! longest prefix with its prompt and takes those cells over by reference
//! (`KvOp::Share`): the shared rows are neither recomputed nor copied, and a
//! divergent continuation goes to fresh cells of its own. When the source is
//! itself still computing that prefix (sixteen requests with one system
//! prompt arriving together), the newcomer waits for it instead of computing
//! the prefix again. Finished sequences stay as cached prefixes
//! ("parked"), least recently used first out when their sequence id or
//! their cells are needed; with windowed KV layers their blocks are also the
//! first the KV tier moves down to DRAM and SSD, since no step needs them.
//!
//! Capacity. Each sequence may hold at most `n_ctx_seq` positions and
//! `parallel * n_ctx_seq <= n_ctx`, so the active sequences always fit in
//! the cache once the parked ones are gone: a step never fails for cells.

use crate::kv::{KvCells, MAX_SEQ};
use crate::speculative::DraftTree;
use std::collections::VecDeque;

/// What the engine must do to the KV cache before the step, in order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KvOp {
    /// Free every cell of this sequence.
    Remove(u32),
    /// `dst` takes the cells of `src` at positions `0..n` by reference.
    Share { src: u32, dst: u32, n: usize },
}

/// Tokens of one sequence in a step.
#[derive(Clone, Debug, PartialEq)]
pub struct Feed {
    /// Request id.
    pub id: u64,
    pub seq: u32,
    /// Position of the first token.
    pub pos: usize,
    pub tokens: Vec<u32>,
    /// Whether the step's logits for the last token are wanted (the end of
    /// the prompt, or a decode token).
    pub logits: bool,
    /// Draft tokens at the end of a decode feed (speculative decoding):
    /// the last `drafts + 1` rows all want logits.
    pub drafts: usize,
    /// The drafts as a token tree (`tokens` ends with its nodes in order);
    /// None: a chain.
    pub tree: Option<DraftTree>,
}

/// One step: cache operations, then the feeds.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepPlan {
    pub ops: Vec<KvOp>,
    pub feeds: Vec<Feed>,
    /// Requests that became active this step.
    pub admitted: Vec<Admitted>,
}

/// A request that got a sequence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Admitted {
    pub id: u64,
    pub seq: u32,
    /// Prompt tokens it takes from the prefix cache (now or once its
    /// source computed them).
    pub reused: usize,
}

impl StepPlan {
    pub fn n_tokens(&self) -> usize {
        self.feeds.iter().map(|f| f.tokens.len()).sum()
    }
}

#[derive(Clone, Debug)]
struct Waiting {
    id: u64,
    prompt: Vec<u32>,
}

/// A running sequence.
#[derive(Clone, Debug)]
struct Active {
    id: u64,
    seq: u32,
    prompt: Vec<u32>,
    /// Tokens whose KV rows are in the cache, in position order.
    tokens: Vec<u32>,
    /// Sampled and not yet fed, in order: the last token sampled, after
    /// any accepted tokens whose cells a token tree's side branch held
    /// (the cache dropped them; they are fed again in position order).
    pending: Vec<u32>,
    /// Drafted tokens to verify after `pending`.
    drafts: Vec<u32>,
    /// The drafts as a tree (then `drafts` is empty).
    tree: Option<DraftTree>,
    /// Waiting for request `.0` to have computed the first `.1` prompt
    /// tokens, which it then shares.
    wait_for: Option<(u64, usize)>,
}

impl Active {
    fn prefilling(&self) -> bool {
        self.tokens.len() < self.prompt.len()
    }
    /// Tokens this sequence will have in the cache once its prompt is fed.
    fn known(&self) -> &[u32] {
        if self.prefilling() {
            &self.prompt
        } else {
            &self.tokens
        }
    }
}

/// A finished sequence kept as a cached prefix.
#[derive(Clone, Debug)]
struct Parked {
    /// The request it served.
    id: u64,
    seq: u32,
    tokens: Vec<u32>,
    last_use: u64,
}

/// Prefix-cache counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixStats {
    /// Requests that reused at least one cached token.
    pub hits: u64,
    /// Prompt tokens taken from the cache instead of computed.
    pub tokens: u64,
    /// Parked sequences dropped to free an id or cells.
    pub evictions: u64,
}

/// Errors of [`Batcher::new`] and [`Batcher::enqueue`].
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BatchError {
    #[error("--parallel {parallel} must be between 1 and {max}")]
    Parallel { parallel: usize, max: u32 },
    #[error("--batch-size {n_batch} must be at least --parallel {parallel} (every running sequence decodes one token per step)")]
    Batch { n_batch: usize, parallel: usize },
    #[error(
        "--ctx-size {n_ctx} gives each of the {parallel} parallel sequences fewer than 2 positions"
    )]
    Context { n_ctx: usize, parallel: usize },
    #[error("the prompt has {n} tokens but the context holds {n_ctx_seq} per sequence (--ctx-size / --parallel)")]
    PromptTooLong { n: usize, n_ctx_seq: usize },
    #[error("the prompt is empty")]
    EmptyPrompt,
}

/// Why a sequence stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// End-of-generation token or a stop string.
    Stop,
    /// max_tokens or the per-sequence context reached.
    Length,
    /// The client went away.
    Cancelled,
}

pub struct Batcher {
    n_batch: usize,
    n_ctx_seq: usize,
    parallel: usize,
    waiting: VecDeque<Waiting>,
    active: Vec<Active>,
    parked: Vec<Parked>,
    clock: u64,
    pub prefix: PrefixStats,
    /// Queued cache operations (from cancellations and finishes).
    ops: Vec<KvOp>,
}

impl Batcher {
    /// `n_ctx`: cells of the cache; each sequence gets `n_ctx / parallel`.
    pub fn new(n_ctx: usize, n_batch: usize, parallel: usize) -> Result<Batcher, BatchError> {
        if parallel == 0 || parallel > MAX_SEQ as usize {
            return Err(BatchError::Parallel {
                parallel,
                max: MAX_SEQ,
            });
        }
        if n_batch < parallel {
            return Err(BatchError::Batch { n_batch, parallel });
        }
        if n_ctx / parallel < 2 {
            return Err(BatchError::Context { n_ctx, parallel });
        }
        Ok(Batcher {
            n_batch,
            n_ctx_seq: n_ctx / parallel,
            parallel,
            waiting: VecDeque::new(),
            active: Vec::new(),
            parked: Vec::new(),
            clock: 0,
            prefix: PrefixStats::default(),
            ops: Vec::new(),
        })
    }

    /// Positions one sequence may hold.
    pub fn n_ctx_seq(&self) -> usize {
        self.n_ctx_seq
    }
    pub fn n_waiting(&self) -> usize {
        self.waiting.len()
    }
    pub fn n_active(&self) -> usize {
        self.active.len()
    }
    pub fn n_parked(&self) -> usize {
        self.parked.len()
    }
    /// Nothing to compute.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.active.is_empty()
    }
    /// Ids of every request not finished (waiting or active).
    pub fn ids(&self) -> Vec<u64> {
        self.waiting
            .iter()
            .map(|w| w.id)
            .chain(self.active.iter().map(|a| a.id))
            .collect()
    }

    /// Queues a request. The prompt must leave room for one generated token.
    pub fn enqueue(&mut self, id: u64, prompt: Vec<u32>) -> Result<(), BatchError> {
        if prompt.is_empty() {
            return Err(BatchError::EmptyPrompt);
        }
        if prompt.len() >= self.n_ctx_seq {
            return Err(BatchError::PromptTooLong {
                n: prompt.len(),
                n_ctx_seq: self.n_ctx_seq,
            });
        }
        self.waiting.push_back(Waiting { id, prompt });
        Ok(())
    }

    /// Ends request `id` (waiting or active). A sequence that finished
    /// normally stays as a cached prefix; a cancelled one frees its cells
    /// at the next step.
    pub fn finish(&mut self, id: u64, why: Finish) {
        if let Some(i) = self.waiting.iter().position(|w| w.id == id) {
            self.waiting.remove(i);
            return;
        }
        let Some(i) = self.active.iter().position(|a| a.id == id) else {
            return;
        };
        let a = self.active.remove(i);
        if why == Finish::Cancelled || a.tokens.is_empty() {
            self.ops.push(KvOp::Remove(a.seq));
        } else {
            self.clock += 1;
            self.parked.push(Parked {
                id: a.id,
                seq: a.seq,
                tokens: a.tokens,
                last_use: self.clock,
            });
        }
    }

    /// Cache operations waiting for the next step (cancelled sequences'
    /// cells), for an engine loop with nothing to compute to apply now.
    pub fn take_ops(&mut self) -> Vec<KvOp> {
        std::mem::take(&mut self.ops)
    }

    /// Records the tokens request `id` sampled after a step and must feed
    /// next: the last one sampled, after any accepted tokens the cache
    /// dropped (see [`Batcher::rollback`]). Returns the number of positions
    /// the sequence then holds (cache plus these), for the caller's length
    /// check.
    pub fn sampled(&mut self, id: u64, tokens: &[u32]) -> usize {
        match self.active.iter_mut().find(|a| a.id == id) {
            Some(a) => {
                a.pending = tokens.to_vec();
                a.tokens.len() + tokens.len()
            }
            None => 0,
        }
    }

    /// Draft tokens to verify after request `id`'s pending token in the
    /// next step (as many as the step has room for).
    pub fn set_drafts(&mut self, id: u64, drafts: Vec<u32>) {
        if let Some(a) = self.active.iter_mut().find(|a| a.id == id) {
            a.drafts = drafts;
            a.tree = None;
        }
    }

    /// A token tree to verify after request `id`'s pending token in the
    /// next step (its first nodes, in order, as many as the step has room
    /// for: a prefix of a tree in preorder is a tree).
    pub fn set_tree(&mut self, id: u64, tree: DraftTree) {
        if let Some(a) = self.active.iter_mut().find(|a| a.id == id) {
            a.drafts.clear();
            a.tree = (!tree.is_empty()).then_some(tree);
        }
    }

    /// After verification: request `id` keeps its first `keep` cached
    /// tokens (the rejected drafts' cells are the caller's to truncate).
    pub fn rollback(&mut self, id: u64, keep: usize) {
        if let Some(a) = self.active.iter_mut().find(|a| a.id == id) {
            a.tokens.truncate(keep.max(a.prompt.len()));
        }
    }

    /// Plans the next step. `cells`: the engine's cell table as it is now.
    /// The caller applies `ops` in order, runs `feeds`, then calls
    /// [`Batcher::fed`] with the plan.
    pub fn plan(&mut self, cells: &KvCells) -> StepPlan {
        let mut plan = StepPlan {
            ops: std::mem::take(&mut self.ops),
            ..Default::default()
        };
        let mut sim = cells.clone();
        for op in &plan.ops {
            apply(&mut sim, op);
        }
        self.start_shares(&mut plan, &mut sim);
        self.admit(&mut plan, &mut sim);

        // decode tokens first, then prompt chunks in arrival order; a
        // sequence with tokens to feed again waits for a step with room for
        // them (every sequence has room for one: n_batch >= parallel)
        let mut room = self.n_batch;
        let mut ones = self.active.iter().filter(|a| a.pending.len() == 1).count();
        for a in &self.active {
            if a.pending.is_empty() || a.prefilling() {
                continue;
            }
            let n = a.pending.len();
            if n > 1 && n > room.saturating_sub(ones) {
                continue;
            }
            ones -= usize::from(n == 1);
            plan.feeds.push(Feed {
                id: a.id,
                seq: a.seq,
                pos: a.tokens.len(),
                tokens: a.pending.clone(),
                logits: true,
                drafts: 0,
                tree: None,
            });
            room -= n;
        }
        // drafts ride along where the step has room
        for f in plan.feeds.iter_mut() {
            let Some(a) = self.active.iter_mut().find(|a| a.id == f.id) else {
                continue;
            };
            let d = std::mem::take(&mut a.drafts);
            let n = d.len().min(room);
            f.tokens.extend_from_slice(&d[..n]);
            f.drafts = n;
            room -= n;
            if let Some(mut t) = a.tree.take() {
                t.truncate(room);
                if !t.is_empty() {
                    f.tokens.extend(t.nodes.iter().map(|n| n.token));
                    f.drafts = t.len();
                    room -= t.len();
                    f.tree = Some(t);
                }
            }
        }
        for a in &self.active {
            if room == 0 {
                break;
            }
            if !a.prefilling() || a.wait_for.is_some() {
                continue;
            }
            let n = (a.prompt.len() - a.tokens.len()).min(room);
            let pos = a.tokens.len();
            plan.feeds.push(Feed {
                id: a.id,
                seq: a.seq,
                pos,
                tokens: a.prompt[pos..pos + n].to_vec(),
                logits: pos + n == a.prompt.len(),
                drafts: 0,
                tree: None,
            });
            room -= n;
        }

        // cells for the step: parked sequences go, least recently used first
        let need = plan.n_tokens();
        while sim.size() - sim.used() < need && !self.parked.is_empty() {
            self.evict_lru(&mut plan, &mut sim);
        }
        plan
    }

    /// Commits a step the engine ran.
    pub fn fed(&mut self, plan: &StepPlan) {
        for f in &plan.feeds {
            if let Some(a) = self.active.iter_mut().find(|a| a.id == f.id) {
                debug_assert_eq!(a.tokens.len(), f.pos);
                if !a.prefilling() {
                    // a decode feed: its tokens were the pending ones
                    a.pending.clear();
                }
                a.tokens.extend_from_slice(&f.tokens);
            }
        }
    }

    /// Takes waiting requests while places are free; each takes over its
    /// longest cached prefix at once, or waits for a running sequence that
    /// is computing it.
    fn admit(&mut self, plan: &mut StepPlan, sim: &mut KvCells) {
        while self.active.len() < self.parallel {
            let Some(w) = self.waiting.pop_front() else {
                break;
            };
            // the longest usable prefix (at least one prompt token is
            // computed, for its logits); a computed one wins a tie
            let cap = w.prompt.len() - 1;
            let mut best: Option<Source> = None;
            let mut consider = |s: Source| {
                if s.n > 0 && best.is_none_or(|b| (s.n, s.ready) > (b.n, b.ready)) {
                    best = Some(s);
                }
            };
            for a in self.active.iter().filter(|a| a.wait_for.is_none()) {
                let n = common_prefix(a.known(), &w.prompt).min(cap);
                consider(Source {
                    id: a.id,
                    seq: a.seq,
                    n,
                    ready: a.tokens.len() >= n,
                });
            }
            for p in &self.parked {
                let n = common_prefix(&p.tokens, &w.prompt).min(cap);
                consider(Source {
                    id: p.id,
                    seq: p.seq,
                    n,
                    ready: true,
                });
            }
            let Some(seq) = self.free_seq(plan, sim, best.map(|b| b.seq)) else {
                // cannot happen: parallel <= MAX_SEQ; keep the request
                self.waiting.push_front(w);
                break;
            };
            let mut a = Active {
                id: w.id,
                seq,
                prompt: w.prompt,
                tokens: Vec::new(),
                pending: Vec::new(),
                drafts: Vec::new(),
                tree: None,
                wait_for: None,
            };
            if let Some(b) = best {
                self.touch(b.seq);
                self.prefix.hits += 1;
                self.prefix.tokens += b.n as u64;
                if b.ready {
                    share(plan, sim, &mut a, b.seq, b.n);
                } else {
                    a.wait_for = Some((b.id, b.n));
                }
            }
            plan.admitted.push(Admitted {
                id: a.id,
                seq,
                reused: best.map_or(0, |b| b.n),
            });
            self.active.push(a);
        }
    }

    /// Sequences whose prefix source has computed it take it over now; a
    /// source that went away (cancelled) leaves them to compute it.
    fn start_shares(&mut self, plan: &mut StepPlan, sim: &mut KvCells) {
        for i in 0..self.active.len() {
            let Some((src, k)) = self.active[i].wait_for else {
                continue;
            };
            let have = self
                .active
                .iter()
                .find(|a| a.id == src)
                .map(|a| (a.seq, a.tokens.len(), a.prefilling()))
                .or_else(|| {
                    self.parked
                        .iter()
                        .find(|p| p.id == src)
                        .map(|p| (p.seq, p.tokens.len(), false))
                });
            match have {
                Some((seq, n, _)) if n >= k => share(plan, sim, &mut self.active[i], seq, k),
                // still computing it
                Some((_, _, true)) => {}
                // gone: compute it here
                _ => self.active[i].wait_for = None,
            }
        }
    }

    /// A sequence id no active or parked sequence holds; evicts the least
    /// recently used parked one (never `keep`) when none is free.
    fn free_seq(
        &mut self,
        plan: &mut StepPlan,
        sim: &mut KvCells,
        keep: Option<u32>,
    ) -> Option<u32> {
        let used = |s: u32| {
            self.active.iter().any(|a| a.seq == s)
                || self.parked.iter().any(|p| p.seq == s)
                || plan.ops.contains(&KvOp::Remove(s))
        };
        if let Some(s) = (0..MAX_SEQ).find(|&s| !used(s)) {
            return Some(s);
        }
        let victim = self
            .parked
            .iter()
            .filter(|p| Some(p.seq) != keep)
            .min_by_key(|p| p.last_use)?
            .seq;
        self.drop_parked(victim, plan, sim);
        Some(victim)
    }

    fn evict_lru(&mut self, plan: &mut StepPlan, sim: &mut KvCells) {
        if let Some(v) = self.parked.iter().min_by_key(|p| p.last_use).map(|p| p.seq) {
            self.drop_parked(v, plan, sim);
        }
    }

    fn drop_parked(&mut self, seq: u32, plan: &mut StepPlan, sim: &mut KvCells) {
        self.parked.retain(|p| p.seq != seq);
        let op = KvOp::Remove(seq);
        apply(sim, &op);
        plan.ops.push(op);
        self.prefix.evictions += 1;
    }

    fn touch(&mut self, seq: u32) {
        self.clock += 1;
        if let Some(p) = self.parked.iter_mut().find(|p| p.seq == seq) {
            p.last_use = self.clock;
        }
    }
}

/// A sequence whose first `n` tokens a new request can take over.
#[derive(Clone, Copy, Debug)]
struct Source {
    id: u64,
    seq: u32,
    n: usize,
    /// Already in the cache (else its prompt is still being computed).
    ready: bool,
}

/// `a` takes over the first `n` tokens of sequence `src`.
fn share(plan: &mut StepPlan, sim: &mut KvCells, a: &mut Active, src: u32, n: usize) {
    let op = KvOp::Share { src, dst: a.seq, n };
    apply(sim, &op);
    plan.ops.push(op);
    a.tokens = a.prompt[..n].to_vec();
    a.wait_for = None;
}

/// Applies one cache operation to a cell table (what the engine does).
pub fn apply(cells: &mut KvCells, op: &KvOp) {
    match *op {
        KvOp::Remove(s) => cells.remove_seq(s),
        KvOp::Share { src, dst, n } => {
            // ids come from the batcher, always < MAX_SEQ
            let _ = cells.copy_seq(src, dst, 0, n as i32);
        }
    }
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Runs a plan on a cell table the way the engine does.
    fn run(b: &mut Batcher, cells: &mut KvCells) -> StepPlan {
        let plan = b.plan(cells);
        for op in &plan.ops {
            apply(cells, op);
        }
        let sp: Vec<(u32, i32)> = plan
            .feeds
            .iter()
            .flat_map(|f| (0..f.tokens.len()).map(move |i| (f.seq, (f.pos + i) as i32)))
            .collect();
        cells.place(&sp).expect("the plan fits the cache");
        b.fed(&plan);
        plan
    }

    #[test]
    fn decode_tokens_go_first_and_prompts_are_chunked() {
        let mut b = Batcher::new(64, 8, 2).unwrap();
        let mut cells = KvCells::new(64);
        b.enqueue(1, (100..112).collect()).unwrap();
        let p = run(&mut b, &mut cells);
        assert_eq!(p.feeds.len(), 1);
        assert_eq!(
            (p.feeds[0].pos, p.feeds[0].tokens.len(), p.feeds[0].logits),
            (0, 8, false)
        );
        let p = run(&mut b, &mut cells);
        assert_eq!(
            (p.feeds[0].pos, p.feeds[0].tokens.len(), p.feeds[0].logits),
            (8, 4, true)
        );
        b.sampled(1, &[7]);
        b.enqueue(2, (200..220).collect()).unwrap();
        let p = run(&mut b, &mut cells);
        assert_eq!(p.feeds[0].tokens, vec![7]);
        assert_eq!(p.feeds[0].pos, 12);
        assert_eq!((p.feeds[1].id, p.feeds[1].tokens.len()), (2, 7));
        assert_eq!(p.n_tokens(), 8);
    }

    /// A tree rides along as its first nodes the step has room for; an
    /// accepted side branch, dropped from the cache, is fed again before
    /// the last sampled token, in a step with room for it beside every
    /// other sequence's token.
    #[test]
    fn trees_ride_along_and_side_branches_are_fed_again() {
        let mut b = Batcher::new(64, 6, 2).unwrap();
        let mut cells = KvCells::new(64);
        b.enqueue(1, vec![10, 11]).unwrap();
        b.enqueue(2, vec![20, 21]).unwrap();
        run(&mut b, &mut cells);
        b.sampled(1, &[12]);
        b.sampled(2, &[22]);
        // request 1: a tree of 5 nodes (root children 30 and 31, 30's
        // children 32 and 33, 32's child 34), in preorder
        let mut t = DraftTree::default();
        let a = t.add(None, 30, 0.0);
        let c = t.add(a, 32, 0.0);
        t.add(c, 34, 0.0);
        t.add(a, 33, 0.0);
        t.add(None, 31, 0.0);
        b.set_tree(1, t.clone());
        let p = run(&mut b, &mut cells);
        // 2 decode tokens, room for 4 of the 5 nodes
        let f = &p.feeds[0];
        assert_eq!((f.id, f.pos, f.drafts), (1, 2, 4));
        assert_eq!(f.tokens, vec![12, 30, 32, 34, 33]);
        let mut first4 = t.clone();
        first4.truncate(4);
        assert_eq!(f.tree.as_ref(), Some(&first4));
        assert_eq!((p.feeds[1].id, p.feeds[1].tokens.len()), (2, 1));
        // node 3 (33, off the chain cells) was accepted: the tree leaves
        // the cache, 30 and 33 are fed again before the token after them
        let base = f.pos + f.tokens.len() - f.drafts;
        cells.truncate_seq(f.seq, base as i32);
        b.rollback(1, base);
        assert_eq!(b.sampled(1, &[30, 33, 40]), 6);
        // request 2's token alone leaves room for 3 more: both fit
        b.sampled(2, &[23]);
        let p = run(&mut b, &mut cells);
        assert_eq!(p.feeds[0].tokens, vec![30, 33, 40]);
        assert_eq!((p.feeds[0].pos, p.feeds[0].drafts), (3, 0));
        assert_eq!(p.feeds[1].tokens, vec![23]);
        // a refeed with no room beside the others' tokens waits a step
        let mut b = Batcher::new(64, 3, 2).unwrap();
        let mut cells = KvCells::new(64);
        b.enqueue(1, vec![10]).unwrap();
        b.enqueue(2, vec![20]).unwrap();
        run(&mut b, &mut cells);
        b.sampled(1, &[11, 12, 13]);
        b.sampled(2, &[21]);
        let p = run(&mut b, &mut cells);
        assert_eq!(p.feeds.len(), 1);
        assert_eq!(p.feeds[0].id, 2);
        let p = run(&mut b, &mut cells);
        assert_eq!(p.feeds[0].tokens, vec![11, 12, 13]);
    }

    #[test]
    fn a_shared_prompt_is_computed_once() {
        let mut b = Batcher::new(256, 16, 4).unwrap();
        let mut cells = KvCells::new(256);
        let system: Vec<u32> = (0..20).collect();
        for id in 0..4u64 {
            let mut p = system.clone();
            p.extend([1000 + id as u32, 2000]);
            b.enqueue(id, p).unwrap();
        }
        let mut computed = 0;
        for _ in 0..10 {
            let p = run(&mut b, &mut cells);
            computed += p.n_tokens();
            for f in p.feeds.iter().filter(|f| f.logits) {
                b.sampled(f.id, &[5]);
            }
        }
        // 22 tokens for the first, 2 for each other, then decode tokens
        assert_eq!(b.prefix.hits, 3);
        assert_eq!(b.prefix.tokens, 60);
        assert!(computed <= 22 + 3 * 2 + 4 * 10, "{computed}");
        // the shared cells are held once
        assert!(cells.used() < 22 + 3 * 22);
    }

    #[test]
    fn finished_sequences_are_reused_then_evicted_lru() {
        let mut b = Batcher::new(64, 64, 1).unwrap();
        let mut cells = KvCells::new(64);
        b.enqueue(1, (0..30).collect()).unwrap();
        run(&mut b, &mut cells);
        b.finish(1, Finish::Stop);
        assert_eq!(b.n_parked(), 1);
        // a follow-up that extends it reuses all 30
        b.enqueue(2, (0..40).collect()).unwrap();
        let p = run(&mut b, &mut cells);
        assert_eq!(p.admitted[0].reused, 30);
        assert_eq!(p.feeds[0].pos, 30);
        b.finish(2, Finish::Stop);
        // an unrelated 60-token prompt needs the cells: both parked go
        b.enqueue(3, (500..560).collect()).unwrap();
        let p = run(&mut b, &mut cells);
        assert_eq!(p.feeds[0].tokens.len(), 60);
        assert_eq!(b.n_parked(), 0);
        assert_eq!(b.prefix.evictions, 2);
        // a cancelled sequence frees its cells
        b.finish(3, Finish::Cancelled);
        run(&mut b, &mut cells);
        assert_eq!(cells.used(), 0);
    }

    #[test]
    fn bad_requests_and_settings_are_refused() {
        assert!(Batcher::new(64, 4, 8).is_err());
        assert!(Batcher::new(64, 64, 65).is_err());
        assert!(Batcher::new(8, 64, 8).is_err());
        let mut b = Batcher::new(64, 64, 4).unwrap();
        assert_eq!(
            b.enqueue(1, vec![1; 16]),
            Err(BatchError::PromptTooLong {
                n: 16,
                n_ctx_seq: 16
            })
        );
        assert_eq!(b.enqueue(1, vec![]), Err(BatchError::EmptyPrompt));
    }

    proptest! {
        /// Random arrivals, prompt families, lengths and cancellations,
        /// drafts as chains and as trees whose accepted side branches are
        /// fed again: every step fits the batch and the cache, every
        /// sequence's cells hold exactly its tokens at positions 0..n after
        /// verification, and every request finishes.
        #[test]
        fn random_traffic_keeps_the_invariants(
            reqs in proptest::collection::vec((0u32..3, 1usize..40, 1usize..12, 0u8..8, 0usize..6), 1..40),
            parallel in 1usize..6,
            n_batch_extra in 0usize..20,
        ) {
            let n_ctx = 64 * parallel;
            let n_batch = parallel + n_batch_extra;
            let mut b = Batcher::new(n_ctx, n_batch, parallel).unwrap();
            let mut cells = KvCells::new(n_ctx);
            // request id -> (family, prompt len, max new, cancel after steps)
            let mut left: Vec<(u64, usize, Option<usize>)> = Vec::new();
            let mut seq_tokens: std::collections::HashMap<u32, Vec<u32>> = Default::default();
            // (id, prompt, tokens to generate, cancel after steps, arrival slot)
            type Arrival = (u64, Vec<u32>, usize, Option<usize>, usize);
            let mut arrivals: VecDeque<Arrival> = reqs
                .iter()
                .enumerate()
                .map(|(i, &(fam, len, new, cancel, at))| {
                    let prompt: Vec<u32> = (0..len as u32).map(|t| fam * 1000 + t).collect();
                    (i as u64, prompt, new, (cancel == 0).then_some(2), at)
                })
                .collect();
            let total = arrivals.len();
            let mut done = 0usize;
            for step in 0..2000usize {
                while arrivals.front().is_some_and(|a| a.4 <= step % 7) {
                    let (id, p, new, cancel, _) = arrivals.pop_front().unwrap();
                    b.enqueue(id, p).unwrap();
                    left.push((id, new, cancel));
                }
                if b.is_idle() && arrivals.is_empty() {
                    break;
                }
                let plan = b.plan(&cells);
                prop_assert!(plan.n_tokens() <= n_batch);
                for op in &plan.ops {
                    apply(&mut cells, op);
                    if let KvOp::Remove(s) = op { seq_tokens.remove(s); }
                    if let KvOp::Share { src, dst, n } = op {
                        let t = seq_tokens[src][..*n].to_vec();
                        seq_tokens.insert(*dst, t);
                    }
                }
                let sp: Vec<(u32, i32)> = plan.feeds.iter()
                    .flat_map(|f| (0..f.tokens.len()).map(move |i| (f.seq, (f.pos + i) as i32)))
                    .collect();
                prop_assert!(cells.place(&sp).is_ok(), "cache full");
                b.fed(&plan);
                for f in &plan.feeds {
                    let t = seq_tokens.entry(f.seq).or_default();
                    prop_assert_eq!(t.len(), f.pos);
                    t.extend_from_slice(&f.tokens);
                }
                for f in plan.feeds.iter().filter(|f| f.logits) {
                    let Some(i) = left.iter().position(|l| l.0 == f.id) else { continue };
                    // verification keeps a pseudo-random share of the
                    // drafts; of a tree, a path down its first nodes (the
                    // chain cells), or a side branch that leaves the cache
                    // and is fed again (the nodes sit at positions in feed
                    // order here: either way the first nodes' cells stay)
                    let r = f.id as usize + step;
                    let base = f.pos + f.tokens.len() - f.drafts;
                    let (keep, refeed) = match &f.tree {
                        Some(t) if (r / 3).is_multiple_of(2) && !t.is_chain() => (base, (r % t.depth()) + 1),
                        Some(t) => {
                            let chain = (0..t.len())
                                .take_while(|&j| t.nodes[j].parent == j.checked_sub(1))
                                .count();
                            (base + r % (chain + 1), 0)
                        }
                        None => (base + if f.drafts > 0 { r % (f.drafts + 1) } else { 0 }, 0),
                    };
                    if keep < f.pos + f.tokens.len() {
                        cells.truncate_seq(f.seq, keep as i32);
                        b.rollback(f.id, keep);
                        seq_tokens.get_mut(&f.seq).unwrap().truncate(keep);
                    }
                    let n = b.sampled(f.id, &vec![9; refeed + 1]);
                    left[i].1 -= 1;
                    if left[i].1 == 0 || n >= b.n_ctx_seq() {
                        b.finish(f.id, Finish::Stop);
                        left.remove(i);
                        done += 1;
                    } else if (f.id + step as u64).is_multiple_of(3) {
                        let room = b.n_ctx_seq() - n - 1;
                        b.set_drafts(f.id, vec![7; room.min(4)]);
                    } else if (f.id + step as u64) % 3 == 1 {
                        // a tree at most as deep as the step's spare room
                        // (the server's rule: steps of parallel + depth)
                        let depth = (b.n_ctx_seq() - n - 1).min(n_batch - parallel).min(6);
                        let mut t = DraftTree::default();
                        let mut at = None;
                        for d in 0..depth {
                            let a = t.add(at, 7, 0.0);
                            if d == 0 {
                                t.add(None, 8, 0.0);
                            }
                            at = a;
                        }
                        b.set_tree(f.id, t.preorder().0);
                    }
                }
                // every sequence's cells hold positions 0..n, once each
                for (&s, t) in &seq_tokens {
                    let pos: Vec<i32> = cells.seq_cells(s).iter().map(|c| c.1).collect();
                    let mut sorted = pos.clone();
                    sorted.sort();
                    prop_assert_eq!(sorted, (0..t.len() as i32).collect::<Vec<_>>());
                }
                for l in left.iter_mut() {
                    if let Some(c) = l.2.as_mut() {
                        *c -= 1;
                        if *c == 0 {
                            b.finish(l.0, Finish::Cancelled);
                            done += 1;
                        }
                    }
                }
                left.retain(|l| l.2 != Some(0));
            }
            prop_assert_eq!(done, total);
            prop_assert!(b.is_idle());
        }
    }
}
