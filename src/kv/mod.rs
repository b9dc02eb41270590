//! KV cache bookkeeping in plain Rust: which cell holds which (sequence,
//! position), where a batch's tokens go, and the attention mask.
//!
//! Invariants: a cell is either empty or holds one position for a set of
//! sequences; a token of sequence `s` at position `p` may attend to cell `c`
//! iff `c` holds `s` at a position `<= p`. The device-side K/V tensors are
//! owned by the engine; this module never touches them.
//!
//! For tiering (see [`tier`]), cells are grouped into fixed blocks of
//! `block` consecutive cells. A sequence's block table is the ordered list of
//! blocks holding its cells ([`KvCells::seq_blocks`]); a block is what moves
//! between the GPU window, pinned DRAM and the SSD spill. Cells are still
//! placed lowest-free-first, llama.cpp's order, so the attention reads the
//! same cells in the same order as llama.cpp and as the all-on-GPU cache.

pub mod spill;
pub mod tier;
pub mod tree;

pub use tree::StepTree;

/// Errors from cell placement.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum KvError {
    #[error("KV cache is full: {needed} cells needed, {free} free of {size} (raise --ctx-size)")]
    Full {
        needed: usize,
        free: usize,
        size: usize,
    },
    #[error("sequence id {0} is out of range (at most {max} sequences)", max = MAX_SEQ)]
    BadSeq(u32),
    #[error("bad token tree: {0}")]
    BadTree(String),
}

/// Most sequences the bitmask per cell can hold.
pub const MAX_SEQ: u32 = 64;

/// Cell bookkeeping for a cache of `size` cells.
#[derive(Clone, Debug)]
pub struct KvCells {
    pos: Vec<i32>,
    seqs: Vec<u64>,
    used: usize,
    /// Place a sequence's new tokens after its existing cells while there
    /// is room (see [`KvCells::set_ordered`]).
    ordered: bool,
}

impl KvCells {
    pub fn new(size: usize) -> KvCells {
        KvCells {
            pos: vec![-1; size],
            seqs: vec![0; size],
            used: 0,
            ordered: false,
        }
    }

    /// With `ordered`, a sequence's new tokens go to free cells after its
    /// last cell (lowest first) while there are any, so its cells stay in
    /// position order however other sequences come and go. Attention then
    /// visits them in the same order as when the sequence runs alone, which
    /// batch-invariant numerics need (the kernels accumulate in cell
    /// order). Off: llama.cpp's lowest-free-first.
    pub fn set_ordered(&mut self, ordered: bool) {
        self.ordered = ordered;
    }
    pub fn size(&self) -> usize {
        self.pos.len()
    }
    pub fn used(&self) -> usize {
        self.used
    }
    /// One past the highest used cell.
    pub fn used_max_p1(&self) -> usize {
        self.seqs.iter().rposition(|&s| s != 0).map_or(0, |i| i + 1)
    }

    /// Finds cells for `tokens` (seq, pos) pairs, lowest free cells first
    /// (the order llama.cpp uses for a fresh cache), and marks them used.
    pub fn place(&mut self, tokens: &[(u32, i32)]) -> Result<Vec<u32>, KvError> {
        for &(s, _) in tokens {
            if s >= MAX_SEQ {
                return Err(KvError::BadSeq(s));
            }
        }
        let free = self.size() - self.used;
        if tokens.len() > free {
            return Err(KvError::Full {
                needed: tokens.len(),
                free,
                size: self.size(),
            });
        }
        let mut out = Vec::with_capacity(tokens.len());
        let mut c = 0usize;
        for &(s, p) in tokens {
            // ordered: the first free cell after the sequence's last one
            let after_own = self.ordered.then(|| {
                let from = self
                    .seqs
                    .iter()
                    .rposition(|&m| m & (1 << s) != 0)
                    .map_or(0, |i| i + 1);
                (from..self.size()).find(|&i| self.seqs[i] == 0)
            });
            let cell = match after_own.flatten() {
                Some(i) => i,
                None => {
                    while self.seqs[c] != 0 {
                        c += 1;
                    }
                    c
                }
            };
            self.seqs[cell] = 1u64 << s;
            self.pos[cell] = p;
            self.used += 1;
            out.push(cell as u32);
        }
        Ok(out)
    }

    /// Frees every cell of sequence `s`.
    pub fn remove_seq(&mut self, s: u32) {
        if s >= MAX_SEQ {
            return;
        }
        for c in 0..self.size() {
            if self.seqs[c] & (1 << s) != 0 {
                self.seqs[c] &= !(1 << s);
                if self.seqs[c] == 0 {
                    self.pos[c] = -1;
                    self.used -= 1;
                }
            }
        }
    }

    /// Frees cells of sequence `s` at positions >= `from`.
    pub fn truncate_seq(&mut self, s: u32, from: i32) {
        if s >= MAX_SEQ {
            return;
        }
        for c in 0..self.size() {
            if self.seqs[c] & (1 << s) != 0 && self.pos[c] >= from {
                self.seqs[c] &= !(1 << s);
                if self.seqs[c] == 0 {
                    self.pos[c] = -1;
                    self.used -= 1;
                }
            }
        }
    }

    /// Frees sequence `s`'s hold on `cells` (the rejected nodes of a token
    /// tree, which share positions with the accepted ones, so
    /// [`KvCells::truncate_seq`] cannot single them out).
    pub fn drop_cells(&mut self, s: u32, cells: &[u32]) {
        if s >= MAX_SEQ {
            return;
        }
        for &c in cells {
            let c = c as usize;
            if c < self.size() && self.seqs[c] & (1 << s) != 0 {
                self.seqs[c] &= !(1 << s);
                if self.seqs[c] == 0 {
                    self.pos[c] = -1;
                    self.used -= 1;
                }
            }
        }
    }

    /// Adds sequence `dst` to every cell of `src` at positions in
    /// `[p0, p1)` (llama.cpp's `seq_cp` on a unified cache): `dst` then
    /// attends to those cells as its own, with no copy of the rows. Cells
    /// stay while any of their sequences holds them.
    pub fn copy_seq(&mut self, src: u32, dst: u32, p0: i32, p1: i32) -> Result<(), KvError> {
        for s in [src, dst] {
            if s >= MAX_SEQ {
                return Err(KvError::BadSeq(s));
            }
        }
        for c in 0..self.size() {
            if self.seqs[c] & (1 << src) != 0 && (p0..p1).contains(&self.pos[c]) {
                self.seqs[c] |= 1 << dst;
            }
        }
        Ok(())
    }

    /// Cells held only by sequence `s` (what removing it would free).
    pub fn cells_only_of(&self, s: u32) -> usize {
        if s >= MAX_SEQ {
            return 0;
        }
        self.seqs.iter().filter(|&&m| m == 1 << s).count()
    }

    pub fn clear(&mut self) {
        self.pos.fill(-1);
        self.seqs.fill(0);
        self.used = 0;
    }

    /// Sequences that have a cell in block `b` (of `block` cells), as a bitmask.
    pub fn block_seqs(&self, b: usize, block: usize) -> u64 {
        let end = ((b + 1) * block).min(self.size());
        self.seqs[b * block..end].iter().fold(0, |m, &s| m | s)
    }

    /// One past the last used cell of block `b`, relative to its start (0 if
    /// the block is empty): the rows that must travel with it.
    pub fn block_rows(&self, b: usize, block: usize) -> usize {
        let end = ((b + 1) * block).min(self.size());
        self.seqs[b * block..end]
            .iter()
            .rposition(|&s| s != 0)
            .map_or(0, |i| i + 1)
    }

    /// Block table of sequence `s`: the blocks holding its cells, in order.
    pub fn seq_blocks(&self, s: u32, block: usize) -> Vec<u32> {
        let nb = self.size().div_ceil(block);
        (0..nb)
            .filter(|&b| s < MAX_SEQ && self.block_seqs(b, block) & (1 << s) != 0)
            .map(|b| b as u32)
            .collect()
    }

    /// Blocks that hold a cell of any sequence in `mask` (a bitmask), in order.
    pub fn blocks_of(&self, mask: u64, block: usize) -> Vec<u32> {
        let nb = self.size().div_ceil(block);
        (0..nb)
            .filter(|&b| self.block_seqs(b, block) & mask != 0)
            .map(|b| b as u32)
            .collect()
    }

    /// Blocks holding a cell that some token of `tokens` (seq, pos) sees
    /// through a sliding window of `window` positions (the cells
    /// [`KvCells::fill_mask`] leaves visible with that window), in order:
    /// what a sliding-window layer reads. Per sequence, a token at `p` sees
    /// its cells at positions in `(p - window, p]`, so the step's tokens of
    /// a sequence together see `(min p - window, max p]`.
    pub fn window_blocks(&self, tokens: &[(u32, i32)], window: u32, block: usize) -> Vec<u32> {
        let mut range = [(i64::MAX, i64::MIN); MAX_SEQ as usize];
        let mut mask = 0u64;
        for &(s, p) in tokens {
            if s >= MAX_SEQ {
                continue;
            }
            let r = &mut range[s as usize];
            r.0 = r.0.min(p as i64 - window as i64 + 1);
            r.1 = r.1.max(p as i64);
            mask |= 1 << s;
        }
        let seen = |c: usize| {
            let (mut m, pos) = (self.seqs[c] & mask, self.pos[c] as i64);
            while m != 0 {
                let (lo, hi) = range[m.trailing_zeros() as usize];
                if (lo..=hi).contains(&pos) {
                    return true;
                }
                m &= m - 1;
            }
            false
        };
        let nb = self.size().div_ceil(block);
        (0..nb)
            .filter(|&b| (b * block..((b + 1) * block).min(self.size())).any(seen))
            .map(|b| b as u32)
            .collect()
    }

    /// Positions of sequence `s`, in cell order, with their cells.
    pub fn seq_cells(&self, s: u32) -> Vec<(u32, i32)> {
        (0..self.size())
            .filter(|&c| s < MAX_SEQ && self.seqs[c] & (1 << s) != 0)
            .map(|c| (c as u32, self.pos[c]))
            .collect()
    }

    /// Cells the attention reads this step: llama.cpp's padding to 256 so
    /// graphs stay stable across steps.
    pub fn n_kv(&self) -> usize {
        let pad = 256usize;
        let used = self.used_max_p1().div_ceil(pad) * pad;
        self.size().min(pad.max(used))
    }

    /// Whether a token (seq, pos) may attend to cell `c`.
    pub fn visible(&self, c: usize, seq: u32, pos: i32) -> bool {
        self.seqs[c] & (1u64 << seq) != 0 && self.pos[c] <= pos
    }

    /// Appends to `mask` an [n_kv, n_tokens] mask (row-major by token): 0
    /// for visible cells and -inf otherwise, as f16 bit patterns. With a
    /// `window`, a token sees only the cells less than `window` positions
    /// behind it (llama.cpp's LLAMA_SWA_TYPE_STANDARD).
    pub fn fill_mask(
        &self,
        tokens: &[(u32, i32)],
        n_kv: usize,
        window: Option<u32>,
        mask: &mut Vec<u16>,
    ) {
        let start = mask.len();
        mask.resize(start + n_kv * tokens.len(), MASK_HIDDEN);
        self.fill_mask_rows(tokens, n_kv, window, &mut mask[start..]);
    }

    /// Writes the mask rows of `tokens` (as [`KvCells::fill_mask`]) into
    /// `rows`, n_kv entries a token; every entry is written, so a caller
    /// may split a step's rows among threads.
    pub fn fill_mask_rows(
        &self,
        tokens: &[(u32, i32)],
        n_kv: usize,
        window: Option<u32>,
        rows: &mut [u16],
    ) {
        assert_eq!(rows.len(), n_kv * tokens.len(), "mask rows");
        let (pos, seqs) = (&self.pos[..n_kv], &self.seqs[..n_kv]);
        let w = window.map_or(i64::MAX, i64::from);
        for (&(s, p), row) in tokens.iter().zip(rows.chunks_exact_mut(n_kv)) {
            let bit = 1u64 << s;
            for ((m, &cp), &cs) in row.iter_mut().zip(pos).zip(seqs) {
                let seen = cs & bit != 0 && cp <= p && i64::from(p) - i64::from(cp) < w;
                *m = if seen { MASK_SEEN } else { MASK_HIDDEN };
            }
        }
    }
}

/// A mask entry for a visible cell: 0 as an f16 bit pattern.
pub const MASK_SEEN: u16 = 0x0000;
/// A mask entry for a hidden cell: -inf as an f16 bit pattern.
pub const MASK_HIDDEN: u16 = 0xFC00;

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A 64-cell table after `steps` of (sequence 0..3, tokens) each in
    /// position order (until one does not fit), with `drop_seq` removed;
    /// and each sequence's next position.
    fn after_steps(steps: &[(u32, usize)], drop_seq: u32) -> (KvCells, [i32; 3]) {
        let mut k = KvCells::new(64);
        let mut next = [0i32; 3];
        for &(s, n) in steps {
            let toks: Vec<(u32, i32)> = (0..n).map(|i| (s, next[s as usize] + i as i32)).collect();
            if k.place(&toks).is_err() {
                break;
            }
            next[s as usize] += n as i32;
        }
        k.remove_seq(drop_seq);
        (k, next)
    }

    proptest! {
        /// The blocks a sliding-window layer reads hold every cell its mask
        /// leaves visible, and no block without one.
        #[test]
        fn window_blocks_are_exactly_the_blocks_with_visible_cells(
            steps in proptest::collection::vec((0u32..3, 1usize..6), 1..12),
            window in 1u32..20,
            block in 1usize..9,
            drop_seq in 0u32..4,
        ) {
            let (mut k, next) = after_steps(&steps, drop_seq);
            // a step: two tokens of sequence 0 and one of sequence 2
            let toks = [(0, next[0]), (0, next[0] + 1), (2, next[2])];
            k.place(&toks).ok();
            let n_kv = k.size();
            let mut mask = Vec::new();
            k.fill_mask(&toks, n_kv, Some(window), &mut mask);
            let want: Vec<u32> = (0..n_kv.div_ceil(block))
                .filter(|&b| {
                    (b * block..((b + 1) * block).min(n_kv))
                        .any(|c| (0..toks.len()).any(|t| mask[t * n_kv + c] == 0))
                })
                .map(|b| b as u32)
                .collect();
            prop_assert_eq!(k.window_blocks(&toks, window, block), want);
        }
    }

    proptest! {
        /// A step's mask written in pieces of rows (as the engine's threads
        /// write it) equals the whole, and each entry is the visibility
        /// rule with the window.
        #[test]
        fn mask_rows_in_pieces_follow_the_rule(
            steps in proptest::collection::vec((0u32..3, 1usize..6), 1..12),
            window in proptest::option::of(1u32..20),
            drop_seq in 0u32..4,
            cut in 0usize..4,
        ) {
            let (mut k, next) = after_steps(&steps, drop_seq);
            let toks = [(0, next[0]), (1, next[1]), (0, next[0] + 1), (2, next[2])];
            k.place(&toks).ok();
            let n_kv = k.n_kv();
            let mut whole = Vec::new();
            k.fill_mask(&toks, n_kv, window, &mut whole);
            let mut pieces = vec![7u16; whole.len()];
            let (a, b) = pieces.split_at_mut(cut * n_kv);
            k.fill_mask_rows(&toks[..cut], n_kv, window, a);
            k.fill_mask_rows(&toks[cut..], n_kv, window, b);
            prop_assert_eq!(&pieces, &whole);
            for (t, &(s, p)) in toks.iter().enumerate() {
                for c in 0..n_kv {
                    let near = window.is_none_or(|w| i64::from(p) - i64::from(k.pos[c]) < i64::from(w));
                    let want = if k.visible(c, s, p) && near { MASK_SEEN } else { MASK_HIDDEN };
                    prop_assert_eq!(whole[t * n_kv + c], want);
                }
            }
        }
    }

    #[test]
    fn ordered_placement_keeps_each_sequence_in_position_order() {
        let mut k = KvCells::new(8);
        k.set_ordered(true);
        k.place(&[(0, 0), (1, 0), (0, 1), (1, 1)]).unwrap();
        k.remove_seq(1);
        // seq 0 continues after its cell 2, not in the holes at 1 and 3
        assert_eq!(k.place(&[(0, 2)]).unwrap(), vec![3]);
        assert_eq!(k.place(&[(0, 3)]).unwrap(), vec![4]);
        // a new sequence starts in the lowest hole
        assert_eq!(k.place(&[(2, 0)]).unwrap(), vec![1]);
        // with no room after its cells, the lowest free cell is taken
        assert_eq!(k.place(&[(0, 4), (0, 5), (0, 6)]).unwrap(), vec![5, 6, 7]);
        k.remove_seq(2);
        assert_eq!(k.place(&[(0, 7)]).unwrap(), vec![1]);
    }

    #[test]
    fn copied_prefix_is_shared_until_both_sequences_leave() {
        let mut k = KvCells::new(8);
        let toks: Vec<(u32, i32)> = (0..4).map(|p| (0, p)).collect();
        k.place(&toks).unwrap();
        k.copy_seq(0, 1, 0, 3).unwrap();
        // seq 1 sees positions 0..3 of seq 0 and not position 3
        assert!(k.visible(2, 1, 10) && !k.visible(3, 1, 10));
        assert_eq!(k.cells_only_of(0), 1);
        assert_eq!(k.cells_only_of(1), 0);
        // its own continuation goes to fresh cells
        assert_eq!(k.place(&[(1, 3)]).unwrap(), vec![4]);
        k.remove_seq(0);
        assert_eq!(k.used(), 4, "shared cells stay with seq 1");
        assert_eq!(k.seq_cells(1), vec![(0, 0), (1, 1), (2, 2), (4, 3)]);
        k.remove_seq(1);
        assert_eq!(k.used(), 0);
        assert!(k.copy_seq(0, MAX_SEQ, 0, 1).is_err());
    }

    #[test]
    fn fresh_cache_fills_in_order() {
        let mut kv = KvCells::new(8);
        assert_eq!(kv.place(&[(0, 0), (0, 1), (0, 2)]).unwrap(), vec![0, 1, 2]);
        assert_eq!(kv.place(&[(0, 3)]).unwrap(), vec![3]);
        assert_eq!(kv.used_max_p1(), 4);
        assert_eq!(kv.n_kv(), 8); // capped by size
    }

    #[test]
    fn full_cache_is_an_error_naming_sizes() {
        let mut kv = KvCells::new(2);
        kv.place(&[(0, 0), (0, 1)]).unwrap();
        assert_eq!(
            kv.place(&[(0, 2)]),
            Err(KvError::Full {
                needed: 1,
                free: 0,
                size: 2
            })
        );
    }

    #[test]
    fn mask_is_causal_and_per_sequence() {
        let mut kv = KvCells::new(4);
        let toks = [(0, 0), (1, 0), (0, 1)];
        kv.place(&toks).unwrap();
        let mut m = Vec::new();
        kv.fill_mask(&toks, 4, None, &mut m);
        let vis = |i: usize| -> Vec<bool> { m[i * 4..i * 4 + 4].iter().map(|&b| b == 0).collect() };
        assert_eq!(vis(0), [true, false, false, false]);
        assert_eq!(vis(1), [false, true, false, false]);
        assert_eq!(vis(2), [true, false, true, false]);
    }

    #[test]
    fn sliding_window_mask_sees_only_the_window() {
        let mut kv = KvCells::new(8);
        let toks: Vec<_> = (0..6).map(|p| (0, p)).collect();
        kv.place(&toks).unwrap();
        // appended after a full mask, window of 3: position p sees p-2..=p
        let mut m = vec![7u16; 3];
        kv.fill_mask(&toks, 8, Some(3), &mut m);
        assert_eq!(&m[..3], [7, 7, 7], "what was there is kept");
        let vis = |i: usize| -> Vec<usize> { (0..8).filter(|&c| m[3 + i * 8 + c] == 0).collect() };
        assert_eq!(vis(0), [0]);
        assert_eq!(vis(2), [0, 1, 2]);
        assert_eq!(vis(5), [3, 4, 5]);
    }

    #[test]
    fn n_kv_pads_to_256() {
        let mut kv = KvCells::new(1024);
        kv.place(&[(0, 0)]).unwrap();
        assert_eq!(kv.n_kv(), 256);
        let t: Vec<_> = (1..300).map(|p| (0, p)).collect();
        kv.place(&t).unwrap();
        assert_eq!(kv.n_kv(), 512);
    }

    #[test]
    fn block_tables_follow_cells() {
        let mut kv = KvCells::new(64);
        kv.place(&[(0, 0), (0, 1), (1, 0)]).unwrap(); // cells 0,1,2
        let t: Vec<_> = (2..20).map(|p| (0, p)).collect();
        kv.place(&t).unwrap(); // cells 3..20
        assert_eq!(kv.seq_blocks(0, 16), vec![0, 1]);
        assert_eq!(kv.seq_blocks(1, 16), vec![0]);
        assert_eq!(kv.block_rows(1, 16), 5);
        assert_eq!(kv.blocks_of(0b10, 16), vec![0]);
        kv.remove_seq(0);
        assert_eq!(kv.block_rows(1, 16), 0);
        assert_eq!(kv.block_rows(0, 16), 3);
        assert_eq!(kv.seq_cells(1), vec![(2, 0)]);
    }

    proptest! {
        /// Block tables agree with the cells: a block is in sequence s's
        /// table iff it holds a cell of s, `blocks_of` is the union of the
        /// tables, and a block's rows end at its last used cell.
        #[test]
        fn block_tables_agree_with_cells(ops in proptest::collection::vec((0u32..3, 1usize..20, any::<bool>()), 1..30), block in 1usize..40) {
            let mut kv = KvCells::new(96);
            let mut next_pos = [0i32; 3];
            for (s, n, remove) in ops {
                if remove {
                    kv.truncate_seq(s, next_pos[s as usize] / 2);
                    next_pos[s as usize] /= 2;
                } else {
                    let toks: Vec<_> = (0..n).map(|i| (s, next_pos[s as usize] + i as i32)).collect();
                    if kv.place(&toks).is_ok() {
                        next_pos[s as usize] += n as i32;
                    }
                }
                let nb = kv.size().div_ceil(block);
                let mut union = Vec::new();
                for b in 0..nb {
                    let cells = b * block..((b + 1) * block).min(kv.size());
                    let holds = |q: u32| cells.clone().any(|c| kv.seqs[c] & (1 << q) != 0);
                    for q in 0..3u32 {
                        prop_assert_eq!(kv.seq_blocks(q, block).contains(&(b as u32)), holds(q));
                    }
                    if (0..3).any(holds) {
                        union.push(b as u32);
                    }
                    let last = cells.clone().rev().find(|&c| kv.seqs[c] != 0).map_or(0, |c| c - b * block + 1);
                    prop_assert_eq!(kv.block_rows(b, block), last);
                }
                prop_assert_eq!(kv.blocks_of(0b111, block), union);
                for q in 0..3u32 {
                    prop_assert_eq!(kv.seq_cells(q).len() as i32, next_pos[q as usize]);
                }
            }
        }

        #[test]
        fn placement_and_removal_keep_counts(ops in proptest::collection::vec((0u32..4, 1usize..6, any::<bool>()), 1..40)) {
            let mut kv = KvCells::new(32);
            let mut next_pos = [0i32; 4];
            for (s, n, remove) in ops {
                if remove {
                    kv.remove_seq(s);
                    next_pos[s as usize] = 0;
                } else {
                    let toks: Vec<_> = (0..n).map(|i| (s, next_pos[s as usize] + i as i32)).collect();
                    if kv.place(&toks).is_ok() {
                        next_pos[s as usize] += n as i32;
                    }
                }
                let counted = (0..kv.size()).filter(|&c| kv.seqs[c] != 0).count();
                prop_assert_eq!(counted, kv.used());
                prop_assert!(kv.n_kv() >= kv.used_max_p1());
                // every token sees exactly its own sequence's earlier cells
                for s in 0..4u32 {
                    let p = next_pos[s as usize] - 1;
                    let seen = (0..kv.size()).filter(|&c| kv.visible(c, s, p)).count();
                    prop_assert_eq!(seen as i32, next_pos[s as usize]);
                }
            }
        }

        /// Speculative rounds: each appends a sequence's next token and k
        /// drafts, then keeps a random prefix of the drafts and truncates
        /// the rest. Afterwards every sequence holds exactly its accepted
        /// positions, each once, every token sees exactly them, and a lone
        /// sequence sits in the very cells a cache that never saw the
        /// rejected drafts gives it (so attention reads the same cells in
        /// the same order: same numerics).
        #[test]
        fn rejected_drafts_leave_no_trace(
            rounds in proptest::collection::vec((0u32..3, 0usize..6, 0usize..7), 1..40),
            lone in any::<bool>(),
        ) {
            let mut kv = KvCells::new(64);
            let mut clean = KvCells::new(64);
            let mut len = [0i32; 3];
            for (s, k, keep) in rounds {
                let s = if lone { 0 } else { s };
                let keep = keep.min(k);
                let base = len[s as usize];
                let toks: Vec<_> = (0..=k as i32).map(|i| (s, base + i)).collect();
                if kv.place(&toks).is_err() {
                    continue;
                }
                kv.truncate_seq(s, base + 1 + keep as i32);
                let kept: Vec<_> = (0..=keep as i32).map(|i| (s, base + i)).collect();
                clean.place(&kept).expect("the clean cache has room when the other had");
                len[s as usize] += 1 + keep as i32;
                let counted = (0..kv.size()).filter(|&c| kv.seqs[c] != 0).count();
                prop_assert_eq!(counted, kv.used());
                for q in 0..3u32 {
                    let mut pos: Vec<i32> = kv.seq_cells(q).iter().map(|&(_, p)| p).collect();
                    pos.sort_unstable();
                    prop_assert_eq!(pos, (0..len[q as usize]).collect::<Vec<_>>());
                    let p = len[q as usize] - 1;
                    let seen = (0..kv.size()).filter(|&c| kv.visible(c, q, p)).count();
                    prop_assert_eq!(seen as i32, len[q as usize]);
                }
                if lone {
                    prop_assert_eq!(&kv.pos, &clean.pos);
                    prop_assert_eq!(&kv.seqs, &clean.seqs);
                }
            }
        }
    }
}
