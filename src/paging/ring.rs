//! The slot ring and its residency state machine, plain Rust.
//!
//! Streamed groups of a step are numbered 0..n in compute order; group j
//! goes to slot j mod S every step (uploads are also numbered across steps
//! for the simulator). The ring emits the operations the engine
//! enqueues on two streams, in host order:
//!
//! copy stream:    [wait free(s)] upload j -> s, record loaded(s)
//! compute stream: wait loaded(s), compute j on s, [poison s], record free(s)
//!
//! Before compute j, uploads up to j + depth are issued (depth < S, so an
//! upload never targets the slot of a group still waiting to compute).
//! [`SlotRing::prefetch`] issues uploads of that window earlier, so the
//! pager can put several rings' uploads on the one copy stream in the
//! order the step needs them. The
//! compute stream waits `loaded(s)`, so a group is only read once its copy
//! completed; a copy into s waits `free(s)`, so a slot is only overwritten
//! after the computation that reads it finished. `simulate` checks both for
//! any interleaving of the two streams, and that no interleaving deadlocks.
//!
//! Once every group of a step was released, [`SlotRing::carry_next`]
//! uploads the next step's first groups, assuming that step streams the
//! same groups (a decode loop does): the bus carries them while the step's
//! last groups compute and the next step's inputs are written, instead of
//! idling until the next step asks. [`SlotRing::begin_step_carried`] keeps
//! them or, where the next step differs, forgets them (their slots are
//! uploaded again, after them on the copy stream).

use crate::model::GroupKind;

/// The slot rings the copy stream fills: attention weights, FFN weights,
/// and the KV windows of windowed layers (see `kvtier`). `ring as usize`
/// indexes the per-ring arrays.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ring {
    Attn = 0,
    Ffn = 1,
    Kv = 2,
}

impl Ring {
    /// The weight ring a group of `kind` streams through.
    pub fn of(kind: GroupKind) -> Ring {
        match kind {
            GroupKind::Attn => Ring::Attn,
            GroupKind::Ffn => Ring::Ffn,
        }
    }
    /// How the trace names this ring's slots (a0, f1, w2).
    pub fn label(self) -> &'static str {
        match self {
            Ring::Attn => "a",
            Ring::Ffn => "f",
            Ring::Kv => "w",
        }
    }
}

/// Host-side state of a slot (what has been enqueued, not what completed:
/// completion is enforced on the device by the event waits).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotState {
    Empty,
    /// Copy of streamed group `j` enqueued, loaded(s) recorded after it.
    Uploading(usize),
    /// Copy of `j` known complete (synchronous copy path).
    Resident(usize),
    /// Computation of `j` enqueued after waiting loaded(s).
    InUse(usize),
    /// Computation of `j` enqueued and free(s) recorded: may be overwritten
    /// by a copy that first waits free(s).
    Evictable(usize),
}

/// One operation on a stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// Copy stream waits the last recorded free(slot).
    WaitFree(usize),
    /// Debug: fill a slot with NaN once its reader finished, so a read
    /// before the next upload completes shows in the output.
    Poison(usize),
    /// Copy the upload numbered `j` (counted over all steps; see
    /// [`SlotRing::local`]) into `slot`.
    Upload {
        j: usize,
        slot: usize,
    },
    RecordLoaded(usize),
    /// Compute stream waits the last recorded loaded(slot).
    WaitLoaded(usize),
    Compute {
        j: usize,
        slot: usize,
    },
    RecordFree(usize),
}

impl Op {
    pub fn on_copy_stream(&self) -> bool {
        matches!(
            self,
            Op::WaitFree(_) | Op::Upload { .. } | Op::RecordLoaded(_)
        )
    }
}

/// A ring of `slots` slots with uploads `depth` ahead of compute.
#[derive(Clone, Debug)]
pub struct SlotRing {
    slots: usize,
    depth: usize,
    /// Global upload counter at the start of this step.
    base: usize,
    /// Streamed groups in this step.
    n: usize,
    /// Uploads issued in this step.
    issued: usize,
    /// Groups of this step whose computation was enqueued and their slot
    /// released (after_compute).
    released: usize,
    /// Uploads of the next step's first groups issued at the end of this
    /// one (`carry_next`).
    carried: usize,
    state: Vec<SlotState>,
    ever_freed: Vec<bool>,
    pub poison: bool,
    /// Debug fault: computations do not wait for their upload.
    pub skip_load_wait: bool,
}

impl SlotRing {
    /// `depth` is clamped to 1..slots-1 (slots >= 2).
    pub fn new(slots: usize, depth: usize) -> SlotRing {
        let slots = slots.max(2);
        SlotRing {
            slots,
            depth: depth.clamp(1, slots - 1),
            base: 0,
            n: 0,
            issued: 0,
            released: 0,
            carried: 0,
            state: vec![SlotState::Empty; slots],
            ever_freed: vec![false; slots],
            poison: false,
            skip_load_wait: false,
        }
    }
    pub fn slots(&self) -> usize {
        self.slots
    }
    pub fn depth(&self) -> usize {
        self.depth
    }
    pub fn state(&self, slot: usize) -> SlotState {
        self.state[slot]
    }
    /// Slot of streamed group `j` of the current step: the same every step,
    /// so each group's graph sees the same addresses and its captured form
    /// can be replayed.
    pub fn slot_of(&self, j: usize) -> usize {
        j % self.slots
    }

    /// The streamed group (index within the current step) of an op's `j`.
    pub fn local(&self, j: usize) -> usize {
        j - self.base
    }

    /// Forgets a step that stopped half-way (an error), once both streams
    /// are drained: every slot is empty, the next step uploads afresh.
    pub fn abort(&mut self) {
        self.base += self.issued + self.carried;
        self.carried = 0;
        self.issued = 0;
        self.released = 0;
        self.n = 0;
        self.state.fill(SlotState::Empty);
    }

    /// Starts a step with `n` streamed groups (forgetting any carried
    /// uploads).
    pub fn begin_step(&mut self, n: usize) {
        self.begin_step_carried(n, false);
    }

    /// Starts a step with `n` streamed groups whose first `carried()`
    /// groups, uploaded at the end of the last step, are kept (`keep`:
    /// they are this step's first groups too) or forgotten.
    pub fn begin_step_carried(&mut self, n: usize, keep: bool) {
        let keep = keep && self.carried <= n;
        self.base += self.issued;
        self.issued = 0;
        if keep {
            // they were numbered as this step's first uploads
            self.issued = self.carried;
        } else {
            // their numbers are not given again
            self.base += self.carried;
        }
        self.carried = 0;
        self.n = n;
        self.released = 0;
    }

    /// Uploads of the next step's first groups issued at the end of this
    /// step.
    pub fn carried(&self) -> usize {
        self.carried
    }

    /// Once every group of this step was released: the operations that
    /// upload the next step's group `carried()` (the same slot as this
    /// step's group of that index), numbered as that step's upload; None
    /// when the window of a step's start (groups 0..=depth) is full or a
    /// group of this step is still held, and for a step no longer than
    /// that window (the next would then wait for every upload before it
    /// computes anything, where without them it computes its first groups
    /// while the others go up).
    pub fn carry_next(&mut self) -> Option<Vec<Op>> {
        let i = self.carried;
        if self.released < self.n
            || self.issued < self.n
            || i > self.depth
            || self.n <= self.depth + 1
        {
            return None;
        }
        let slot = self.slot_of(i);
        let mut ops = Vec::new();
        if self.ever_freed[slot] {
            ops.push(Op::WaitFree(slot));
        }
        ops.push(Op::Upload {
            j: self.base + self.n + i,
            slot,
        });
        ops.push(Op::RecordLoaded(slot));
        self.state[slot] = SlotState::Uploading(i);
        self.carried += 1;
        Some(ops)
    }

    /// Groups of this step released so far (their computation enqueued).
    pub fn released(&self) -> usize {
        self.released
    }

    /// Streamed groups in this step.
    pub fn n(&self) -> usize {
        self.n
    }
    /// Uploads issued so far in this step (groups 0..issued).
    pub fn issued(&self) -> usize {
        self.issued
    }

    /// Issues the uploads of groups up to `upto` now, as far as the window
    /// allows: up to `depth` past the next group to compute, whose slots
    /// the groups before them released. `before_compute` issues what is
    /// left of its window itself.
    pub fn prefetch(&mut self, upto: usize) -> Vec<Op> {
        let mut ops = Vec::new();
        if self.n == 0 {
            return ops;
        }
        let last = upto.min(self.n - 1).min(self.released + self.depth);
        while self.issued <= last {
            let k = self.issued;
            self.upload_ops(k, &mut ops);
            self.issued += 1;
        }
        ops
    }

    fn upload_ops(&mut self, j: usize, ops: &mut Vec<Op>) {
        let slot = self.slot_of(j);
        if self.ever_freed[slot] {
            ops.push(Op::WaitFree(slot));
        }
        ops.push(Op::Upload {
            j: self.base + j,
            slot,
        });
        ops.push(Op::RecordLoaded(slot));
        self.state[slot] = SlotState::Uploading(j);
    }

    /// Operations to enqueue before computing streamed group `j`.
    pub fn before_compute(&mut self, j: usize) -> Vec<Op> {
        self.before_compute_holding(j, 0)
    }

    /// [`SlotRing::before_compute`] leaving the last `hold` uploads of
    /// group `j`'s window to a later [`SlotRing::prefetch`]: a routed
    /// group's (`engine::routed`), issued after the upload its router
    /// asks for, so that the bus has work while the device computes it.
    pub fn before_compute_holding(&mut self, j: usize, hold: usize) -> Vec<Op> {
        assert!(
            j < self.n && j <= self.issued,
            "groups must compute in order"
        );
        let mut ops = Vec::new();
        // never into the slot of a group not yet released: groups computed
        // in two halves (`paging::halves`) hold their slots past later
        // groups' computes
        let last = (j + self.depth.saturating_sub(hold))
            .min(self.n - 1)
            .min(self.released + self.slots - 1);
        while self.issued <= last {
            let k = self.issued;
            self.upload_ops(k, &mut ops);
            self.issued += 1;
        }
        let slot = self.slot_of(j);
        if !self.skip_load_wait {
            ops.push(Op::WaitLoaded(slot));
        }
        ops.push(Op::Compute {
            j: self.base + j,
            slot,
        });
        self.state[slot] = SlotState::InUse(j);
        ops
    }

    /// Whether group `j` can be computed while the groups from the first
    /// not released up to it are all held: they must fit the slots.
    pub fn can_hold_to(&self, j: usize) -> bool {
        j < self.released + self.slots
    }

    /// Operations to enqueue after computing streamed group `j`.
    pub fn after_compute(&mut self, j: usize) -> Vec<Op> {
        let slot = self.slot_of(j);
        self.released = self.released.max(j + 1);
        self.ever_freed[slot] = true;
        self.state[slot] = SlotState::Evictable(j);
        if self.poison {
            vec![Op::Poison(slot), Op::RecordFree(slot)]
        } else {
            vec![Op::RecordFree(slot)]
        }
    }

    /// Marks a copy as complete (synchronous copy path, or after waiting
    /// its loaded event on the host).
    pub fn mark_resident(&mut self, slot: usize) {
        if let SlotState::Uploading(j) = self.state[slot] {
            self.state[slot] = SlotState::Resident(j);
        }
    }
}

/// A violation found by [`simulate`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Violation {
    /// Group j computed from a slot that did not hold its completed copy.
    EarlyRead {
        j: usize,
        slot: usize,
    },
    /// A copy overwrote a slot whose reader had not computed yet.
    Overwrite {
        j: usize,
        slot: usize,
    },
    Deadlock,
}

/// Executes host-ordered `ops` on two FIFO streams with CUDA event
/// semantics (a wait covers the records enqueued before it), choosing which
/// stream advances from `choices` (cycled). Returns the first violation.
pub fn simulate(ops: &[Op], slots: usize, choices: &[bool]) -> Result<(), Violation> {
    #[derive(Clone, Copy)]
    enum Q {
        Op(Op),
        Wait {
            loaded: bool,
            slot: usize,
            gen: usize,
        },
    }
    let (mut copy, mut comp): (Vec<Q>, Vec<Q>) = (Vec::new(), Vec::new());
    let mut rec_loaded = vec![0usize; slots];
    let mut rec_free = vec![0usize; slots];
    // pending computations per slot, in enqueue order
    let mut readers: Vec<Vec<usize>> = vec![Vec::new(); slots];
    for op in ops {
        let q = match *op {
            Op::WaitFree(s) => Q::Wait {
                loaded: false,
                slot: s,
                gen: rec_free[s],
            },
            Op::WaitLoaded(s) => Q::Wait {
                loaded: true,
                slot: s,
                gen: rec_loaded[s],
            },
            Op::RecordLoaded(s) => {
                rec_loaded[s] += 1;
                Q::Op(*op)
            }
            Op::RecordFree(s) => {
                rec_free[s] += 1;
                Q::Op(*op)
            }
            Op::Compute { j, slot } => {
                readers[slot].push(j);
                Q::Op(*op)
            }
            other => Q::Op(other),
        };
        if op.on_copy_stream() {
            copy.push(q);
        } else {
            comp.push(q);
        }
    }
    let (mut done_loaded, mut done_free) = (vec![0usize; slots], vec![0usize; slots]);
    let mut content: Vec<Option<usize>> = vec![None; slots];
    let mut complete: Vec<bool> = vec![false; slots];
    let (mut ci, mut pi) = (0usize, 0usize);
    let mut step = 0usize;
    let ready = |q: &Q, dl: &[usize], df: &[usize]| match *q {
        Q::Wait {
            loaded: true,
            slot,
            gen,
        } => dl[slot] >= gen,
        Q::Wait {
            loaded: false,
            slot,
            gen,
        } => df[slot] >= gen,
        Q::Op(_) => true,
    };
    while ci < copy.len() || pi < comp.len() {
        let c_ok = ci < copy.len() && ready(&copy[ci], &done_loaded, &done_free);
        let p_ok = pi < comp.len() && ready(&comp[pi], &done_loaded, &done_free);
        let pick_copy = match (c_ok, p_ok) {
            (false, false) => return Err(Violation::Deadlock),
            (true, false) => true,
            (false, true) => false,
            (true, true) => choices
                .get(step % choices.len().max(1))
                .copied()
                .unwrap_or(true),
        };
        step += 1;
        let q = if pick_copy {
            ci += 1;
            copy[ci - 1]
        } else {
            pi += 1;
            comp[pi - 1]
        };
        match q {
            Q::Wait { .. } => {}
            Q::Op(Op::Poison(s)) => {
                content[s] = None;
                complete[s] = false;
            }
            Q::Op(Op::Upload { j, slot }) => {
                if readers[slot].iter().any(|&r| r < j) {
                    return Err(Violation::Overwrite { j, slot });
                }
                content[slot] = Some(j);
                complete[slot] = false;
            }
            Q::Op(Op::RecordLoaded(s)) => {
                complete[s] = true;
                done_loaded[s] += 1;
            }
            Q::Op(Op::Compute { j, slot }) => {
                if content[slot] != Some(j) || !complete[slot] {
                    return Err(Violation::EarlyRead { j, slot });
                }
                readers[slot].retain(|&r| r != j);
            }
            Q::Op(Op::RecordFree(s)) => done_free[s] += 1,
            Q::Op(_) => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn schedule(ring: &mut SlotRing, steps: &[usize]) -> Vec<Op> {
        let mut ops = Vec::new();
        for &n in steps {
            ring.begin_step(n);
            for j in 0..n {
                ops.extend(ring.before_compute(j));
                ops.extend(ring.after_compute(j));
            }
        }
        ops
    }

    #[test]
    fn uploads_run_depth_ahead() {
        let mut r = SlotRing::new(3, 2);
        r.begin_step(5);
        let ops = r.before_compute(0);
        let uploads: Vec<_> = ops
            .iter()
            .filter(|o| matches!(o, Op::Upload { .. }))
            .collect();
        assert_eq!(uploads.len(), 3);
        assert_eq!(r.state(2), SlotState::Uploading(2));
        assert_eq!(r.state(0), SlotState::InUse(0));
        r.after_compute(0);
        assert_eq!(r.state(0), SlotState::Evictable(0));
        let ops = r.before_compute(1);
        assert_eq!(
            ops[0],
            Op::WaitFree(0),
            "slot 0 is reused only after its free event"
        );
    }

    #[test]
    fn simulator_catches_a_missing_load_wait() {
        let mut r = SlotRing::new(2, 1);
        r.skip_load_wait = true;
        let ops = schedule(&mut r, &[4]);
        // the compute stream runs ahead of the copy stream
        assert!(matches!(
            simulate(&ops, 2, &[false]),
            Err(Violation::EarlyRead { .. })
        ));
    }

    #[test]
    fn simulator_catches_a_missing_free_wait() {
        let mut r = SlotRing::new(2, 1);
        let ops: Vec<Op> = schedule(&mut r, &[4])
            .into_iter()
            .filter(|o| !matches!(o, Op::WaitFree(_)))
            .collect();
        assert!(matches!(
            simulate(&ops, 2, &[true]),
            Err(Violation::Overwrite { .. })
        ));
    }

    /// `schedule` with a prefetch of a random reach before each group.
    fn schedule_prefetching(ring: &mut SlotRing, steps: &[usize], reach: &[usize]) -> Vec<Op> {
        let mut ops = Vec::new();
        let mut r = reach.iter().cycle();
        for &n in steps {
            ring.begin_step(n);
            for j in 0..n {
                ops.extend(ring.prefetch(j + r.next().copied().unwrap_or(0)));
                ops.extend(ring.before_compute(j));
                ops.extend(ring.after_compute(j));
            }
        }
        ops
    }

    #[test]
    fn prefetch_stays_in_the_window() {
        let mut r = SlotRing::new(3, 2);
        r.begin_step(6);
        // before anything computed: groups 0..=2 (slots all free)
        let up = |ops: &[Op]| {
            ops.iter()
                .filter(|o| matches!(o, Op::Upload { .. }))
                .count()
        };
        assert_eq!(up(&r.prefetch(10)), 3);
        assert_eq!(r.issued(), 3);
        assert_eq!(up(&r.before_compute(0)), 0, "already issued");
        r.after_compute(0);
        // group 3 reuses slot 0, released by group 0
        let ops = r.prefetch(10);
        assert_eq!(ops[0], Op::WaitFree(0));
        assert_eq!(up(&ops), 1);
        assert_eq!(up(&r.prefetch(10)), 0, "slot 1 still holds group 1");
    }

    #[test]
    fn a_carried_window_starts_the_next_step() {
        let mut r = SlotRing::new(3, 2);
        let up = |ops: &[Op]| {
            ops.iter()
                .filter(|o| matches!(o, Op::Upload { .. }))
                .count()
        };
        r.begin_step(5);
        for j in 0..4 {
            r.before_compute(j);
            assert!(r.carry_next().is_none(), "groups of this step still held");
            r.after_compute(j);
        }
        r.before_compute(4);
        r.after_compute(4);
        // the next step's groups 0..=2, each after its slot's last reader
        let ops: Vec<Op> = std::iter::from_fn(|| r.carry_next()).flatten().collect();
        assert_eq!(up(&ops), 3);
        assert_eq!(ops[0], Op::WaitFree(0));
        assert_eq!(r.carried(), 3);
        r.begin_step_carried(5, true);
        assert_eq!(r.issued(), 3);
        assert_eq!(up(&r.before_compute(0)), 0, "group 0 came up last step");
        // forgotten: the next step uploads its window again
        let ran = |n: usize| {
            let mut r = SlotRing::new(3, 2);
            r.begin_step(n);
            for j in 0..n {
                r.before_compute(j);
                r.after_compute(j);
            }
            r
        };
        let mut f = ran(4);
        assert!(f.carry_next().is_some());
        f.begin_step_carried(4, false);
        assert_eq!(up(&f.before_compute(0)), 3);
        // a step no longer than the window carries nothing
        assert!(ran(3).carry_next().is_none());
    }

    proptest! {
        /// Steps that end by carrying the next step's first uploads, kept
        /// or forgotten at random, with prefetches of random reach: every
        /// group reads its own completed upload, none deadlocks, and each
        /// forgotten upload is made again.
        #[test]
        fn carrying_is_safe_and_live(
            slots in 2usize..6,
            depth in 1usize..6,
            steps in proptest::collection::vec(1usize..12, 1..5),
            carry in proptest::collection::vec(0usize..6, 1..5),
            keep in proptest::collection::vec(any::<bool>(), 1..5),
            reach in proptest::collection::vec(0usize..8, 1..16),
            choices in proptest::collection::vec(any::<bool>(), 1..64),
        ) {
            let mut r = SlotRing::new(slots, depth);
            let mut ops = Vec::new();
            let mut expected = 0;
            let mut reach = reach.iter().cycle();
            for (s, &n) in steps.iter().enumerate() {
                let carried = r.carried();
                let keep = keep[s % keep.len()];
                r.begin_step_carried(n, keep);
                expected += if keep && carried <= n { n } else { n + carried };
                for j in 0..n {
                    ops.extend(r.prefetch(j + reach.next().copied().unwrap_or(0)));
                    ops.extend(r.before_compute(j));
                    ops.extend(r.after_compute(j));
                }
                for _ in 0..carry[s % carry.len()] {
                    if let Some(o) = r.carry_next() {
                        ops.extend(o);
                    }
                }
            }
            expected += r.carried();
            let uploads = ops.iter().filter(|o| matches!(o, Op::Upload { .. })).count();
            prop_assert_eq!(uploads, expected);
            prop_assert_eq!(simulate(&ops, r.slots(), &choices), Ok(()));
        }

        #[test]
        fn prefetching_is_safe_and_live(
            slots in 2usize..6,
            depth in 1usize..6,
            steps in proptest::collection::vec(1usize..12, 1..4),
            reach in proptest::collection::vec(0usize..8, 1..16),
            choices in proptest::collection::vec(any::<bool>(), 1..64),
        ) {
            let mut r = SlotRing::new(slots, depth);
            let ops = schedule_prefetching(&mut r, &steps, &reach);
            let uploads = ops.iter().filter(|o| matches!(o, Op::Upload { .. })).count();
            prop_assert_eq!(uploads, steps.iter().sum::<usize>());
            prop_assert_eq!(simulate(&ops, r.slots(), &choices), Ok(()));
        }

        /// Routed groups hold back their window's last uploads and issue
        /// them after their routers (`before_compute_holding`, then a
        /// prefetch of the whole window).
        #[test]
        fn holding_back_is_safe_and_live(
            slots in 2usize..6,
            depth in 1usize..6,
            steps in proptest::collection::vec(1usize..12, 1..4),
            holds in proptest::collection::vec(0usize..3, 1..16),
            choices in proptest::collection::vec(any::<bool>(), 1..64),
        ) {
            let mut r = SlotRing::new(slots, depth);
            let mut ops = Vec::new();
            let mut h = holds.iter().cycle();
            for &n in &steps {
                r.begin_step(n);
                for j in 0..n {
                    let hold = h.next().copied().unwrap_or(0);
                    ops.extend(r.before_compute_holding(j, hold));
                    ops.extend(r.prefetch(j + r.depth()));
                    ops.extend(r.after_compute(j));
                }
            }
            let uploads = ops.iter().filter(|o| matches!(o, Op::Upload { .. })).count();
            prop_assert_eq!(uploads, steps.iter().sum::<usize>());
            prop_assert_eq!(simulate(&ops, r.slots(), &choices), Ok(()));
        }

        /// Groups computed in two halves (`paging::halves`): a stage's
        /// groups are begun (their first half computed), then each
        /// computed again and released; while held, no upload may take
        /// their slots (the second compute reads them), and stages that
        /// fit the slots never deadlock.
        #[test]
        fn holding_a_stage_is_safe_and_live(
            slots in 2usize..7,
            depth in 1usize..6,
            stages in proptest::collection::vec(1usize..7, 1..8),
            choices in proptest::collection::vec(any::<bool>(), 1..64),
        ) {
            let mut r = SlotRing::new(slots, depth);
            let stages: Vec<usize> = stages.into_iter().map(|s| s.min(slots - 1)).collect();
            let n: usize = stages.iter().sum();
            r.begin_step(n);
            let mut ops = Vec::new();
            let mut j = 0;
            for s in stages {
                for k in j..j + s {
                    prop_assert!(r.can_hold_to(k));
                    ops.extend(r.before_compute(k));
                }
                for k in j..j + s {
                    ops.push(Op::Compute { j: k, slot: r.slot_of(k) });
                    ops.extend(r.after_compute(k));
                }
                j += s;
            }
            let uploads = ops.iter().filter(|o| matches!(o, Op::Upload { .. })).count();
            prop_assert_eq!(uploads, n);
            prop_assert_eq!(simulate(&ops, r.slots(), &choices), Ok(()));
        }

        #[test]
        fn any_interleaving_is_safe_and_live(
            slots in 2usize..6,
            depth in 1usize..6,
            steps in proptest::collection::vec(1usize..12, 1..4),
            poison in any::<bool>(),
            choices in proptest::collection::vec(any::<bool>(), 1..64),
        ) {
            let mut r = SlotRing::new(slots, depth);
            r.poison = poison;
            prop_assert!(r.depth() < r.slots());
            let ops = schedule(&mut r, &steps);
            prop_assert_eq!(simulate(&ops, r.slots(), &choices), Ok(()));
        }
    }
}
