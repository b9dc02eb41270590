//! Executes the slot rings' operations (crate::paging) on real streams.
//!
//! GPU: a second backend instance on the device is the copy stream; per-slot
//! `loaded`/`free` events order it against the compute stream, so the copy
//! of group g+D runs while group g computes. CPU: the copy "stream" is a
//! queue run when the compute side waits for a slot, which is what an
//! asynchronous copy engine looks like to the computation.

use super::store::WeightStore;
use super::timeline::{Stream, Timeline};
use super::EngineError;
use crate::ggml::{Backend, Device, Event};
use crate::paging::{Op, Plan, SlotRing};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// What one step streamed.
#[derive(Clone, Copy, Debug, Default)]
pub struct PagerStats {
    pub uploads: u64,
    pub bytes: u64,
    /// Host time spent in synchronous copies (CPU path) or blocked on events.
    pub copy_wait: Duration,
}

enum Streams {
    Async {
        copy: Backend,
        loaded: [Vec<Event>; 2],
        free: [Vec<Event>; 2],
    },
    Sync {
        pending: VecDeque<(usize, usize, usize)>,
    },
}

pub struct Pager {
    pub rings: [Option<SlotRing>; 2],
    /// Per ring: group index of each streamed group, in this step's order.
    lists: [Vec<usize>; 2],
    /// All streamed groups of this step, in order (for reading ahead).
    streamed: Vec<usize>,
    streams: Streams,
    pub stats: PagerStats,
}

impl Pager {
    pub fn new(
        dev: Device,
        plan: &Plan,
        poison: bool,
        skip_load_wait: bool,
    ) -> Result<Pager, EngineError> {
        let mk = |n: usize| {
            (n > 0).then(|| {
                let mut r = SlotRing::new(n, plan.prefetch);
                r.poison = poison;
                r.skip_load_wait = skip_load_wait;
                r
            })
        };
        let rings = [mk(plan.slots.0), mk(plan.slots.1)];
        let streams = if dev.is_cpu() || plan.n_streamed() == 0 {
            Streams::Sync {
                pending: VecDeque::new(),
            }
        } else {
            let events = |n: usize| {
                (0..n)
                    .map(|_| Event::new(dev))
                    .collect::<Result<Vec<_>, _>>()
            };
            Streams::Async {
                copy: dev.init_backend()?,
                loaded: [events(plan.slots.0)?, events(plan.slots.1)?],
                free: [events(plan.slots.0)?, events(plan.slots.1)?],
            }
        };
        Ok(Pager {
            rings,
            lists: [Vec::new(), Vec::new()],
            streamed: Vec::new(),
            streams,
            stats: PagerStats::default(),
        })
    }

    /// Starts a step whose groups run in `order` (group indices).
    pub fn begin_step(&mut self, order: &[usize], store: &WeightStore) -> Result<(), EngineError> {
        for r in 0..2 {
            self.lists[r].clear();
        }
        self.streamed.clear();
        for &gi in order {
            if let super::store::Location::Streamed { ring, .. } = store.groups[gi] {
                self.lists[ring].push(gi);
                self.streamed.push(gi);
            }
        }
        for r in 0..2 {
            if let Some(ring) = self.rings[r].as_mut() {
                ring.begin_step(self.lists[r].len());
            }
        }
        self.stats = PagerStats::default();
        // the DRAM tier starts reading the first groups of the step
        let ahead = store.read_ahead().min(self.streamed.len());
        store.prefetch(&self.streamed[..ahead])
    }

    fn upload(
        &mut self,
        ring: usize,
        slot: usize,
        gi: usize,
        store: &WeightStore,
        compute: &Backend,
        tl: &mut Option<Timeline>,
    ) -> Result<(), EngineError> {
        let drain = || {
            if let Streams::Async { copy, .. } = &self.streams {
                copy.synchronize();
            }
        };
        // keep the DRAM tier's reads `read_ahead` groups ahead of this one
        if let Some(k) = self.streamed.iter().position(|&g| g == gi) {
            let end = (k + 1 + store.read_ahead()).min(self.streamed.len());
            store.prefetch(&self.streamed[k + 1..end])?;
        }
        let src = store.host_extent(gi, drain)?;
        let t = store.rings[ring].as_ref().expect("ring").slot_tensor(slot);
        self.stats.uploads += 1;
        self.stats.bytes += src.len() as u64;
        let name = || {
            format!(
                "upload g{gi} -> {}{slot}",
                if ring == 0 { "a" } else { "f" }
            )
        };
        match &self.streams {
            Streams::Async { copy, .. } => {
                if let Some(tl) = tl.as_mut() {
                    tl.begin(Stream::Copy, copy, name(), src.len() as u64);
                }
                // SAFETY: src is pinned memory owned by the store, not written
                // until this copy completed (the window drains the copy stream
                // before reusing a host slot); the device slot is free (the
                // copy stream waited free(s)).
                unsafe { copy.tensor_set_async(t, src, 0) };
                store.copy_enqueued(gi);
                if let Some(tl) = tl.as_mut() {
                    tl.end(copy);
                }
            }
            Streams::Sync { .. } => {
                if let Some(tl) = tl.as_mut() {
                    tl.begin(Stream::Copy, compute, name(), src.len() as u64);
                }
                let t0 = Instant::now();
                // slot fits the extent; the compute side is idle (sync path)
                t.set_bytes(src, 0)?;
                self.stats.copy_wait += t0.elapsed();
                if let Some(tl) = tl.as_mut() {
                    tl.end(compute);
                }
            }
        }
        Ok(())
    }

    fn run_ops(
        &mut self,
        ring: usize,
        ops: Vec<Op>,
        store: &WeightStore,
        compute: &Backend,
        tl: &mut Option<Timeline>,
    ) -> Result<(), EngineError> {
        for op in ops {
            match op {
                Op::Upload { j, slot } => {
                    let local = self.rings[ring].as_ref().expect("ring").local(j);
                    let gi = self.lists[ring][local];
                    match &mut self.streams {
                        Streams::Sync { pending } => pending.push_back((ring, slot, gi)),
                        Streams::Async { .. } => self.upload(ring, slot, gi, store, compute, tl)?,
                    }
                }
                Op::WaitFree(s) => {
                    if let Streams::Async { copy, free, .. } = &self.streams {
                        free[ring][s].wait_on(copy);
                    }
                }
                Op::RecordLoaded(s) => {
                    if let Streams::Async { copy, loaded, .. } = &self.streams {
                        loaded[ring][s].record(copy);
                    }
                }
                Op::WaitLoaded(s) => match &mut self.streams {
                    Streams::Async { loaded, .. } => loaded[ring][s].wait_on(compute),
                    Streams::Sync { pending } => {
                        // run queued copies up to the one filling this slot
                        if let Some(pos) =
                            pending.iter().position(|&(r, sl, _)| r == ring && sl == s)
                        {
                            let todo: Vec<_> = pending.drain(..=pos).collect();
                            for (r, sl, gi) in todo {
                                self.upload(r, sl, gi, store, compute, tl)?;
                                if let Some(rg) = self.rings[r].as_mut() {
                                    rg.mark_resident(sl);
                                }
                            }
                        }
                    }
                },
                Op::RecordFree(s) => {
                    if let Streams::Async { free, .. } = &self.streams {
                        free[ring][s].record(compute);
                    }
                }
                Op::Poison(s) => {
                    compute.synchronize();
                    store.rings[ring]
                        .as_ref()
                        .expect("ring")
                        .slot_tensor(s)
                        .fill(0xFF)?;
                }
                Op::Compute { .. } => {}
            }
        }
        Ok(())
    }

    /// Enqueues what must precede computing streamed group `gi`; returns its slot.
    pub fn before_compute(
        &mut self,
        gi: usize,
        ring: usize,
        store: &WeightStore,
        compute: &Backend,
        tl: &mut Option<Timeline>,
    ) -> Result<usize, EngineError> {
        let j = self.lists[ring]
            .iter()
            .position(|&g| g == gi)
            .expect("group is in this step's order");
        let r = self.rings[ring].as_mut().expect("ring");
        let ops = r.before_compute(j);
        let slot = r.slot_of(j);
        self.run_ops(ring, ops, store, compute, tl)?;
        Ok(slot)
    }

    /// Enqueues what follows computing streamed group `gi`.
    pub fn after_compute(
        &mut self,
        gi: usize,
        ring: usize,
        store: &WeightStore,
        compute: &Backend,
        tl: &mut Option<Timeline>,
    ) -> Result<(), EngineError> {
        let j = self.lists[ring]
            .iter()
            .position(|&g| g == gi)
            .expect("group is in this step's order");
        let ops = self.rings[ring].as_mut().expect("ring").after_compute(j);
        self.run_ops(ring, ops, store, compute, tl)
    }

    /// Waits for the copy stream (before host-side writes to shared inputs).
    pub fn synchronize(&self) {
        if let Streams::Async { copy, .. } = &self.streams {
            copy.synchronize();
        }
    }
}
