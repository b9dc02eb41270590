//! Where each KV block of the windowed layers lives, plain Rust.
//!
//! A windowed layer keeps no KV on the GPU between steps: its blocks live in
//! pinned DRAM frames (one frame holds block `b` of every windowed layer)
//! and travel to a GPU window with the layer's attention group. When the
//! frames run out, blocks the batch does not need go to SSD spill files and
//! come back when a later batch needs them.
//!
//! States of a block: empty (no cells), in a frame, in a spill file, or
//! both (a frame and a spill file with the same rows, so evicting it again
//! costs no write). Writing rows into a block makes its spill file stale;
//! the engine then deletes it. [`TierTable::plan`] is pure: it returns the
//! actions that bring a batch's blocks into frames, and the engine applies
//! each with [`TierTable::apply`] only after carrying it out, so a failed
//! spill (full disk) leaves the table describing what is really where.

use std::collections::BTreeSet;

/// One thing to do to bring a batch's blocks into DRAM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Write the frame of `block` to a spill file, then free the frame.
    Spill { block: u32, frame: u32 },
    /// Free the frame of `block`; its spill file is current.
    Drop { block: u32, frame: u32 },
    /// Read `block` from its spill file into `frame`.
    Load { block: u32, frame: u32 },
    /// Give `block`, which holds no data yet, the free `frame`.
    Alloc { block: u32, frame: u32 },
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum TierError {
    #[error("the KV DRAM budget holds {frames} blocks but this batch needs {needed} at once (the blocks holding cells of its sequences; sequences decoded together interleave their cells over more blocks); raise --kv-dram")]
    TooSmall { needed: usize, frames: usize },
}

/// Frame and spill-file residency of every block.
#[derive(Clone, Debug)]
pub struct TierTable {
    frame_of: Vec<Option<u32>>,
    block_in: Vec<Option<u32>>,
    on_disk: Vec<bool>,
    last_use: Vec<u64>,
    clock: u64,
}

impl TierTable {
    pub fn new(n_blocks: usize, n_frames: usize) -> TierTable {
        TierTable {
            frame_of: vec![None; n_blocks],
            block_in: vec![None; n_frames],
            on_disk: vec![false; n_blocks],
            last_use: vec![0; n_blocks],
            clock: 0,
        }
    }
    pub fn n_frames(&self) -> usize {
        self.block_in.len()
    }
    pub fn n_blocks(&self) -> usize {
        self.frame_of.len()
    }
    pub fn frame_of(&self, b: u32) -> Option<u32> {
        self.frame_of[b as usize]
    }
    pub fn on_disk(&self, b: u32) -> bool {
        self.on_disk[b as usize]
    }
    /// Blocks with a frame.
    pub fn in_dram(&self) -> usize {
        self.block_in.iter().flatten().count()
    }
    /// Blocks with a spill file.
    pub fn on_ssd(&self) -> usize {
        self.on_disk.iter().filter(|&&d| d).count()
    }

    /// What brings every block of `needed` into a frame. `has_data(b)`: the
    /// block held cells before this batch (so it must be loaded, not
    /// allocated). Victims are blocks outside `needed`, those with a
    /// current spill file first, then least recently used.
    pub fn plan(
        &self,
        needed: &[u32],
        has_data: impl Fn(u32) -> bool,
    ) -> Result<Vec<Action>, TierError> {
        let want: BTreeSet<u32> = needed.iter().copied().collect();
        if want.len() > self.n_frames() {
            return Err(TierError::TooSmall {
                needed: want.len(),
                frames: self.n_frames(),
            });
        }
        let mut t = self.clone();
        let mut out = Vec::new();
        for &b in &want {
            if t.frame_of(b).is_some() {
                continue;
            }
            let frame = match t.free_frame(b) {
                Some(f) => f,
                None => {
                    let (victim, frame) = t.victim(&want).expect("fewer needed blocks than frames");
                    let a = if t.on_disk(victim) {
                        Action::Drop {
                            block: victim,
                            frame,
                        }
                    } else {
                        Action::Spill {
                            block: victim,
                            frame,
                        }
                    };
                    t.apply(a);
                    out.push(a);
                    frame
                }
            };
            let a = if has_data(b) {
                debug_assert!(t.on_disk(b), "block {b} has data but is nowhere");
                Action::Load { block: b, frame }
            } else {
                Action::Alloc { block: b, frame }
            };
            t.apply(a);
            out.push(a);
        }
        Ok(out)
    }

    /// A free frame, `b`'s own index first (so a cache that fits keeps
    /// block b in frame b and a layer's blocks copy in one run).
    fn free_frame(&self, b: u32) -> Option<u32> {
        if self.block_in.get(b as usize) == Some(&None) {
            return Some(b);
        }
        self.block_in
            .iter()
            .position(|x| x.is_none())
            .map(|f| f as u32)
    }

    fn victim(&self, want: &BTreeSet<u32>) -> Option<(u32, u32)> {
        self.block_in
            .iter()
            .enumerate()
            .filter_map(|(f, b)| b.map(|b| (b, f as u32)))
            .filter(|(b, _)| !want.contains(b))
            .min_by_key(|&(b, _)| (!self.on_disk(b), self.last_use[b as usize], b))
    }

    /// Records that `a` was carried out.
    pub fn apply(&mut self, a: Action) {
        match a {
            Action::Spill { block, frame } | Action::Drop { block, frame } => {
                debug_assert_eq!(self.frame_of[block as usize], Some(frame));
                self.frame_of[block as usize] = None;
                self.block_in[frame as usize] = None;
                self.on_disk[block as usize] = true;
            }
            Action::Load { block, frame } | Action::Alloc { block, frame } => {
                debug_assert!(self.block_in[frame as usize].is_none());
                self.frame_of[block as usize] = Some(frame);
                self.block_in[frame as usize] = Some(block);
            }
        }
    }

    /// Marks the blocks a batch used (for least-recently-used eviction).
    pub fn touch(&mut self, blocks: &[u32]) {
        self.clock += 1;
        for &b in blocks {
            self.last_use[b as usize] = self.clock;
        }
    }

    /// Rows of `b` changed in its frame: its spill file is stale. Returns
    /// whether there was one (the caller deletes it).
    pub fn written(&mut self, b: u32) -> bool {
        debug_assert!(self.frame_of(b).is_some(), "written block {b} has no frame");
        std::mem::replace(&mut self.on_disk[b as usize], false)
    }

    /// `b` holds no cells any more: frees its frame. Returns whether it had
    /// a spill file (the caller deletes it).
    pub fn release(&mut self, b: u32) -> bool {
        if let Some(f) = self.frame_of[b as usize].take() {
            self.block_in[f as usize] = None;
        }
        std::mem::replace(&mut self.on_disk[b as usize], false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn fitting_cache_keeps_block_b_in_frame_b() {
        let mut t = TierTable::new(8, 8);
        let plan = t.plan(&[0, 1, 2], |_| false).unwrap();
        for a in &plan {
            t.apply(*a);
        }
        assert_eq!(
            plan,
            (0..3)
                .map(|b| Action::Alloc { block: b, frame: b })
                .collect::<Vec<_>>()
        );
    }

    #[test]
    fn too_small_names_both_counts() {
        let t = TierTable::new(8, 2);
        assert_eq!(
            t.plan(&[0, 1, 2], |_| false),
            Err(TierError::TooSmall {
                needed: 3,
                frames: 2
            })
        );
    }

    #[test]
    fn clean_blocks_are_dropped_before_dirty_ones_are_spilled() {
        let mut t = TierTable::new(8, 2);
        for a in t.plan(&[0, 1], |_| false).unwrap() {
            t.apply(a);
        }
        t.touch(&[0, 1]);
        // block 0 goes out and back, so it has a current spill file
        for a in t.plan(&[2, 1], |_| false).unwrap() {
            t.apply(a);
        }
        assert!(t.on_disk(0));
        for a in t.plan(&[0, 1], |b| b == 0).unwrap() {
            t.apply(a);
        }
        let plan = t.plan(&[3, 1], |_| false).unwrap();
        assert_eq!(plan[0], Action::Drop { block: 0, frame: 0 });
    }

    /// A model of block contents: each write bumps a version; the frame and
    /// the spill file each hold a version. Every load must bring back the
    /// latest version, and no block with data may be lost.
    #[derive(Debug, Clone)]
    enum Op {
        /// A batch reads blocks (given as a bitmask over 8 blocks) and
        /// writes its first one.
        Batch(u8),
        /// Every cell of a block is freed.
        Release(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (1u8..=255).prop_map(Op::Batch),
            1 => (0u8..8).prop_map(Op::Release),
        ]
    }

    proptest! {
        #[test]
        fn every_load_brings_back_the_latest_rows(frames in 1usize..6, ops in proptest::collection::vec(op(), 1..60)) {
            let mut t = TierTable::new(8, frames);
            let mut version = [0u32; 8]; // 0: no data
            let mut frame_ver = vec![0u32; frames];
            let mut disk_ver = [0u32; 8];
            for o in ops {
                match o {
                    Op::Batch(mask) => {
                        let need: Vec<u32> = (0..8).filter(|b| mask & (1 << b) != 0).collect();
                        let plan = t.plan(&need, |b| version[b as usize] > 0);
                        if need.len() > frames {
                            prop_assert!(plan.is_err());
                            continue;
                        }
                        for a in plan.unwrap() {
                            match a {
                                Action::Spill { block, frame } => {
                                    prop_assert!(!need.contains(&block));
                                    disk_ver[block as usize] = frame_ver[frame as usize];
                                }
                                Action::Drop { block, frame } => {
                                    prop_assert!(!need.contains(&block));
                                    prop_assert_eq!(disk_ver[block as usize], frame_ver[frame as usize]);
                                }
                                Action::Load { block, frame } => {
                                    prop_assert_eq!(disk_ver[block as usize], version[block as usize]);
                                    frame_ver[frame as usize] = disk_ver[block as usize];
                                }
                                Action::Alloc { block, frame } => {
                                    prop_assert_eq!(version[block as usize], 0);
                                    frame_ver[frame as usize] = 0;
                                }
                            }
                            t.apply(a);
                        }
                        for &b in &need {
                            let f = t.frame_of(b);
                            prop_assert!(f.is_some());
                            prop_assert_eq!(frame_ver[f.unwrap() as usize], version[b as usize]);
                        }
                        t.touch(&need);
                        let w = need[0];
                        version[w as usize] += 1;
                        frame_ver[t.frame_of(w).unwrap() as usize] = version[w as usize];
                        if t.written(w) {
                            disk_ver[w as usize] = 0;
                        }
                    }
                    Op::Release(b) => {
                        t.release(b as u32);
                        version[b as usize] = 0;
                        disk_ver[b as usize] = 0;
                    }
                }
                // frames are unique and every block with data is somewhere
                let mut seen = BTreeSet::new();
                for b in 0..8u32 {
                    if let Some(f) = t.frame_of(b) {
                        prop_assert!(seen.insert(f));
                    } else if version[b as usize] > 0 {
                        prop_assert!(t.on_disk(b));
                        prop_assert_eq!(disk_ver[b as usize], version[b as usize]);
                    }
                }
                prop_assert!(t.in_dram() <= frames);
            }
        }
    }
}
