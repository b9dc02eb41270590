//! Executes the slot rings' operations (crate::paging) on real streams.
//!
//! GPU: a second backend instance on the device is the copy stream; per-slot
//! `loaded`/`free` events order it against the compute stream, so the copy
//! of group g+D runs while group g computes. CPU: the copy "stream" is a
//! queue run when the compute side waits for a slot, which is what an
//! asynchronous copy engine looks like to the computation.

use super::error::EngineError;
use super::kvtier::KvTier;
use super::store::WeightStore;
use super::timeline::{Recorder, Stream};
use crate::ggml::{Backend, Device, Event};
use crate::model::{GroupId, GroupKind};
use crate::paging::{Op, Plan, Ring, SlotRing};
use std::collections::HashMap;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// What one step streamed.
#[derive(Clone, Copy, Debug, Default)]
pub struct PagerStats {
    pub uploads: u64,
    pub bytes: u64,
    /// Host time spent in synchronous copies (CPU path) or blocked on events.
    pub copy_wait: Duration,
    /// Host-to-device bytes of KV blocks (windowed layers).
    pub kv_bytes: u64,
    /// Of `bytes`, those that went up over another GPU's bus (relayed).
    pub relayed: u64,
}

/// A byte range (offset, bytes) of a group's extent.
pub type Range = (usize, usize);

/// The byte ranges of a group's extent a partial upload carries, and those
/// its slot zeroes instead.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Partial {
    pub up: Vec<Range>,
    pub zero: Vec<Range>,
}

/// A graph writing zeros over byte ranges of one device slot, run on the
/// copy stream after the slot's last reader (ordered as its uploads are).
struct ZeroFill {
    // field order is drop order: the graph before the context it lives in
    graph: std::ptr::NonNull<crate::sys::ggml_cgraph>,
    ctx: crate::ggml::Context,
    /// The slot buffer the fills point into, kept alive with them.
    _bound: Vec<crate::ggml::Binding>,
}

impl ZeroFill {
    /// Zeros over `ranges` (offset, bytes) of the slot at `slot`: F32
    /// fills where a range is a multiple of 4 bytes, F16 where of 2.
    fn new(slot: &crate::ggml::Binding, ranges: &[Range]) -> Result<ZeroFill, EngineError> {
        use crate::dtype::GgmlType;
        let ctx = crate::ggml::Context::new(2 * ranges.len() + 1, ranges.len() + 1)?;
        let mut bound = Vec::with_capacity(ranges.len());
        let graph = {
            let mut g = ctx.new_graph(ranges.len() + 1);
            for &(off, len) in ranges {
                let (ty, n) = match len {
                    l if l % 4 == 0 => (GgmlType::F32, l / 4),
                    l if l % 2 == 0 => (GgmlType::F16, l / 2),
                    _ => {
                        return Err(EngineError::Unsupported(
                            "an expert split whose expert tensors are not whole 2-byte words",
                        ))
                    }
                };
                let t = ctx.new_tensor(ty, &[n as i64]).named("slot_zeros");
                let b = crate::ggml::Binding::at(slot.buffer_arc(), slot.offset() + off)?;
                // SAFETY: the range lies in the slot (a group's layout within
                // its slot's extent); `_bound` keeps the buffer alive, and
                // the copy stream runs the fill only once the slot is free.
                unsafe { t.rebind(&b)? };
                bound.push(b);
                g.expand(ctx.fill_inplace(t, 0.0));
            }
            std::ptr::NonNull::new(g.raw()).expect("graph handle is never null")
        };
        Ok(ZeroFill {
            graph,
            ctx,
            _bound: bound,
        })
    }
    fn graph(&self) -> crate::ggml::Graph<'_> {
        // SAFETY: the graph lives in self.ctx.
        unsafe { crate::ggml::Graph::from_raw(&self.ctx, self.graph) }
    }
}

/// Another GPU's link lent to this part (a model split across GPUs): every
/// other streamed FFN group goes up over the other GPU's bus into one of two
/// staging slots there, then across to this GPU's slot (a peer copy), while
/// this GPU's own bus carries the rest. The ring's state machine is
/// unchanged: the relay waits for the slot's `free` event itself (on its
/// own stream, so this part's copy stream does not wait behind it), and the
/// slot's `loaded` event is recorded on the landing stream, after the peer
/// copy. Two streams on the other GPU, so the next group goes up into the
/// other staging slot while this one waits for its slot to be free.
struct Relay {
    // field order is drop order: streams and events before the staging
    /// On the other GPU: host to staging.
    up: Backend,
    /// On the other GPU: waits for the slot, then staging to the slot.
    peer: Backend,
    /// On this GPU: waits for each peer copy, then records the slot loaded.
    landing: Backend,
    /// Per staging slot, on the other GPU: filled (recorded on `up`) and
    /// emptied (recorded on `peer`).
    filled: [Event; 2],
    emptied: [Event; 2],
    /// Whether a staging slot was used yet (its `emptied` was recorded).
    used: [bool; 2],
    /// The staging slot the next relayed group takes.
    next: usize,
    /// Two FFN slots' bytes on the other GPU.
    staging: crate::ggml::TensorArena,
    /// Per FFN slot: whether its upload under way was relayed.
    relayed: Vec<bool>,
}

impl Relay {
    /// Whether the FFN ring's `j`-th group of a step goes through the relay.
    fn takes(j: usize) -> bool {
        j % 2 == 1
    }
}

/// The fewest tokens a step must have for the relay to carry its groups.
/// Two H200s joined by NVLink, peer access on, 70B Q4_0 at 12G each (run
/// 55): 64-token steps 1.94x faster with the relay, one-token steps 0.75x
/// (hybrid decode's steps are bound by the CPU and the layer chain, and
/// the relay's peer copies and extra streams only add to it).
pub const RELAY_MIN_TOKENS: u32 = 64;

enum Streams {
    Async {
        copy: Backend,
        loaded: [Vec<Event>; 3],
        free: [Vec<Event>; 3],
        /// Recorded on the copy stream before a step's first carried
        /// upload ([`Pager::carry_over`]).
        before_carried: Event,
    },
    Sync {
        pending: VecDeque<(Ring, usize, GroupId)>,
    },
}

pub struct Pager {
    pub rings: [Option<SlotRing>; 3],
    /// The file's index of this part's group 0 (a model split across
    /// devices), for the timeline's names.
    pub(super) group0: usize,
    /// Per ring: each group it streams, in this step's order.
    lists: [Vec<GroupId>; 3],
    /// All streamed groups of this step, in order (for reading ahead).
    streamed: Vec<GroupId>,
    /// Each group's position in this step's device order (by group index;
    /// usize::MAX: not computed on the device this step).
    pos: Vec<usize>,
    streams: Streams,
    pub stats: PagerStats,
    /// This step's partial uploads (expert splits): by group index, the
    /// byte ranges of its extent that go up and those its slot must hold
    /// zeros in instead (the host's experts: they then add nothing to the
    /// device's sum).
    pub partial: HashMap<usize, Partial>,
    /// Zero-fill graphs by (slot, ranges), run on the copy stream.
    zero: HashMap<(usize, Vec<Range>), ZeroFill>,
    /// The engine's timeline switch.
    rec: Recorder,
    /// Another GPU's link, lent for every other FFN upload (GPUs only).
    relay: Option<Relay>,
    /// Whether this step's FFN groups may go through the relay (a step of
    /// at least [`RELAY_MIN_TOKENS`]).
    pub relay_step: bool,
    /// Whether the end of a step uploads the next one's first groups
    /// ([`Pager::carry_over`]).
    pub carry: bool,
    /// Whether this step does (the plan's choice for its size,
    /// `HybridPlan::carry_at`).
    pub carry_step: bool,
    /// Whether uploads for the next step were carried since the last
    /// [`Pager::synchronize_for_step`] (`before_carried` marks what came
    /// before them).
    carried: bool,
}

impl Pager {
    pub fn new(
        dev: Device,
        plan: &Plan,
        poison: bool,
        skip_load_wait: bool,
        has_kv_tier: bool,
        kv_slots: usize,
        rec: Recorder,
    ) -> Result<Pager, EngineError> {
        let mk = |n: usize| {
            (n > 0).then(|| {
                // each ring uploads as far ahead as its slots allow
                let mut r = SlotRing::new(n, n - 1);
                r.poison = poison;
                r.skip_load_wait = skip_load_wait;
                r
            })
        };
        let kv_slots = if has_kv_tier { kv_slots } else { 0 };
        let rings = [mk(plan.slots.0), mk(plan.slots.1), mk(kv_slots)];
        let streams = if dev.is_cpu() || plan.n_streamed() == 0 && !has_kv_tier {
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
                loaded: [
                    events(plan.slots.0)?,
                    events(plan.slots.1)?,
                    events(kv_slots)?,
                ],
                free: [
                    events(plan.slots.0)?,
                    events(plan.slots.1)?,
                    events(kv_slots)?,
                ],
                before_carried: Event::new(dev)?,
            }
        };
        Ok(Pager {
            rings,
            group0: 0,
            lists: [Vec::new(), Vec::new(), Vec::new()],
            pos: Vec::new(),
            streamed: Vec::new(),
            streams,
            stats: PagerStats::default(),
            partial: HashMap::new(),
            zero: HashMap::new(),
            rec,
            relay: None,
            relay_step: false,
            carry: false,
            carry_step: true,
            carried: false,
        })
    }

    /// Lends `other`'s bus to this pager's FFN ring (see [`Relay`]):
    /// `slot_bytes` of staging on `other`. Only between local GPUs, with
    /// device streams and no DRAM window (its host slots are reused once
    /// this GPU's copy stream drained, which the relay's stream is not).
    pub fn lend_link(
        &mut self,
        dev: Device,
        other: Device,
        slot_bytes: usize,
    ) -> Result<bool, EngineError> {
        let n_ffn = self.rings[Ring::Ffn as usize]
            .as_ref()
            .map_or(0, |r| r.slots());
        if !matches!(self.streams, Streams::Async { .. }) || n_ffn == 0 || slot_bytes == 0 {
            return Ok(false);
        }
        let spec = crate::ggml::TensorSpec::new(crate::dtype::GgmlType::I8, &[slot_bytes as i64])
            .named("relay_staging");
        let staging = crate::ggml::TensorArena::new(
            other.buffer_type(),
            crate::ggml::BufferUsage::Any,
            &[spec.clone(), spec],
        )?;
        self.relay = Some(Relay {
            up: other.init_backend()?,
            peer: other.init_backend()?,
            landing: dev.init_backend()?,
            filled: [Event::new(other)?, Event::new(other)?],
            emptied: [Event::new(other)?, Event::new(other)?],
            used: [false; 2],
            next: 0,
            staging,
            relayed: vec![false; n_ffn],
        });
        Ok(true)
    }

    /// Starts a step whose device groups run in `order`.
    pub fn begin_step(
        &mut self,
        order: &[GroupId],
        store: &WeightStore,
        kv: Option<&KvTier>,
    ) -> Result<(), EngineError> {
        // the groups the last step carried into this one, by ring
        let carried: [Vec<GroupId>; 3] = std::array::from_fn(|r| {
            let n = self.rings[r].as_ref().map_or(0, |g| g.carried());
            self.lists[r][..n].to_vec()
        });
        for list in &mut self.lists {
            list.clear();
        }
        self.streamed.clear();
        self.pos.clear();
        self.pos.resize(store.groups.len(), usize::MAX);
        for (p, &gi) in order.iter().enumerate() {
            self.pos[gi.index()] = p;
        }
        for &gi in order {
            if let super::store::Location::Streamed { ring, .. } = store.groups[gi.index()] {
                self.lists[ring as usize].push(gi);
                self.streamed.push(gi);
            }
            if gi.kind() == GroupKind::Attn && kv.is_some_and(|k| k.is_windowed(gi.layer())) {
                self.lists[Ring::Kv as usize].push(gi);
            }
        }
        for (r, carried) in carried.iter().enumerate() {
            // kept where this step streams them first too, whole
            let keep = self.lists[r].starts_with(carried)
                && carried
                    .iter()
                    .all(|g| !self.partial.contains_key(&g.index()));
            if let Some(ring) = self.rings[r].as_mut() {
                ring.begin_step_carried(self.lists[r].len(), keep);
            }
        }
        self.stats = PagerStats::default();
        // the DRAM tier starts reading the first groups of the step
        let ahead = store.read_ahead().min(self.streamed.len());
        store.prefetch(&self.streamed[..ahead])
    }

    #[allow(clippy::too_many_arguments)]
    fn upload(
        &mut self,
        ring: Ring,
        slot: usize,
        gi: GroupId,
        store: &WeightStore,
        compute: &Backend,
        kv: Option<&mut KvTier>,
        relayed: bool,
    ) -> Result<(), EngineError> {
        if ring == Ring::Kv {
            let kv = kv.expect("KV ring without a tiered cache");
            return self.upload_kv(slot, gi, compute, kv);
        }
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
        let t = store.rings[ring as usize]
            .as_ref()
            .expect("ring")
            .slot_tensor(slot);
        let whole = [(0, src.len())];
        let (ranges, zero): (&[Range], &[Range]) = match self.partial.get(&gi.index()) {
            Some(p) => (&p.up, &p.zero),
            None => (&whole, &[]),
        };
        let bytes: usize = ranges.iter().map(|r| r.1).sum();
        self.stats.uploads += 1;
        self.stats.bytes += bytes as u64;
        let carrying = self.rings[ring as usize]
            .as_ref()
            .is_some_and(|r| r.carried() > 0);
        let name = || {
            format!(
                "upload g{} -> {}{slot}{}",
                gi.index() + self.group0,
                ring.label(),
                if carrying { " (next step)" } else { "" }
            )
        };
        match &self.streams {
            Streams::Async { free, .. } if relayed && zero.is_empty() => {
                let r = self.relay.as_mut().expect("a relayed upload has a relay");
                let k = r.next;
                r.next = 1 - k;
                let st = r.staging.tensor(k);
                if r.used[k] {
                    // the staging slot's last peer copy went out
                    r.emptied[k].wait_on(&r.up);
                }
                // SAFETY: src is pinned memory owned by the store and never
                // rewritten while a relay exists (no DRAM window); staging
                // slot k is empty (`up` waited its last peer copy); the
                // extent fits the staging (a slot).
                unsafe { r.up.tensor_set_async(st, &src[..bytes], 0) };
                r.filled[k].record(&r.up);
                r.filled[k].wait_on(&r.peer);
                free[ring as usize][slot].wait_on(&r.peer);
                // SAFETY: staging and slot are both one FFN slot of bytes;
                // the slot is free (`peer` waited its `free` event), the
                // staging filled (`peer` waited `filled`) and not rewritten
                // before this copy completed (`up` waits `emptied`).
                unsafe { r.peer.copy_tensor_async(&r.landing, st, t) };
                r.emptied[k].record(&r.peer);
                r.used[k] = true;
                r.relayed[slot] = true;
                self.stats.relayed += bytes as u64;
                store.copy_enqueued(gi);
            }
            Streams::Async { copy, .. } => {
                let _rec = self.rec.scope(Stream::Copy, copy, name, bytes as u64);
                if !zero.is_empty() {
                    let key = (slot, zero.to_vec());
                    if !self.zero.contains_key(&key) {
                        let at = store.rings[ring as usize]
                            .as_ref()
                            .expect("ring")
                            .slot_binding(slot);
                        self.zero.insert(key.clone(), ZeroFill::new(&at, zero)?);
                    }
                    copy.compute_async(&self.zero[&key].graph())?;
                }
                for &(off, len) in ranges {
                    // SAFETY: src is pinned memory owned by the store, not
                    // written until this copy completed (the window drains
                    // the copy stream before reusing a host slot); the
                    // device slot is free (the copy stream waited free(s));
                    // the range lies in the extent (a group's layout).
                    unsafe { copy.tensor_set_async(t, &src[off..off + len], off) };
                }
                store.copy_enqueued(gi);
            }
            Streams::Sync { .. } => {
                let _rec = self.rec.scope(Stream::Copy, compute, name, bytes as u64);
                let t0 = Instant::now();
                // slot fits the extent; the compute side is idle (sync path)
                for &(off, len) in zero {
                    t.fill_range(0, off, len)?;
                }
                for &(off, len) in ranges {
                    t.set_bytes(&src[off..off + len], off)?;
                }
                self.stats.copy_wait += t0.elapsed();
            }
        }
        Ok(())
    }

    /// Uploads `ranges` of streamed group `gi`'s extent into its slot
    /// `slot` (between its [`Pager::before_compute`] and
    /// [`Pager::after_compute`]), after whatever the copy stream holds;
    /// the device's stream waits for them. A routed group's picked
    /// experts that were not sent ahead (`engine::routed`).
    pub fn top_up(
        &mut self,
        gi: GroupId,
        ring: Ring,
        slot: usize,
        ranges: &[Range],
        store: &WeightStore,
        compute: &Backend,
    ) -> Result<(), EngineError> {
        if ranges.is_empty() {
            return Ok(());
        }
        let src = match &self.streams {
            Streams::Async { copy, .. } => store.host_extent(gi, || copy.synchronize())?,
            Streams::Sync { .. } => store.host_extent(gi, || {})?,
        };
        if ranges.iter().any(|&(off, len)| off + len > src.len()) {
            return Err(EngineError::Unsupported(
                "a routed upload of a group without a host copy",
            ));
        }
        let t = store.rings[ring as usize]
            .as_ref()
            .expect("ring")
            .slot_tensor(slot);
        let bytes: usize = ranges.iter().map(|r| r.1).sum();
        self.stats.bytes += bytes as u64;
        let name = || {
            format!(
                "picked experts g{} -> {}{slot}",
                gi.index() + self.group0,
                ring.label()
            )
        };
        match &self.streams {
            Streams::Async { copy, loaded, .. } => {
                let rec = self.rec.scope(Stream::Copy, copy, name, bytes as u64);
                for &(off, len) in ranges {
                    // SAFETY: src is pinned memory owned by the store (a
                    // routed group has a host copy outside any DRAM window,
                    // never rewritten after load); the slot holds `gi` until
                    // its `free` event, recorded after the graph that waits
                    // for this copy; the range lies in the extent (checked).
                    unsafe { copy.tensor_set_async(t, &src[off..off + len], off) };
                }
                drop(rec);
                store.copy_enqueued(gi);
                // the slot is resident again once these copies completed
                let ev = &loaded[ring as usize][slot];
                ev.record(copy);
                ev.wait_on(compute);
            }
            Streams::Sync { .. } => {
                let _rec = self.rec.scope(Stream::Copy, compute, name, bytes as u64);
                let t0 = Instant::now();
                for &(off, len) in ranges {
                    t.set_bytes(&src[off..off + len], off)?;
                }
                self.stats.copy_wait += t0.elapsed();
            }
        }
        Ok(())
    }

    fn upload_kv(
        &mut self,
        slot: usize,
        gi: GroupId,
        compute: &Backend,
        kv: &mut KvTier,
    ) -> Result<(), EngineError> {
        let layer = gi.layer();
        let copy = match &self.streams {
            Streams::Async { copy, .. } => Some(copy),
            Streams::Sync { .. } => None,
        };
        let on = copy.unwrap_or(compute);
        let rec = self.rec.scope(
            Stream::Copy,
            on,
            || format!("kv l{layer} -> w{slot}"),
            kv.upload_bytes(layer),
        );
        let t0 = Instant::now();
        let bytes = kv.upload(layer, slot, copy)?;
        if copy.is_none() {
            self.stats.copy_wait += t0.elapsed();
        }
        drop(rec);
        self.stats.kv_bytes += bytes;
        Ok(())
    }

    /// Sends back the new KV rows still in windows at the end of a step
    /// (after the last computations were enqueued).
    pub fn end_step(&mut self, kv: Option<&mut KvTier>) -> Result<(), EngineError> {
        let Some(kv) = kv else {
            return Ok(());
        };
        for s in kv.pending_slots() {
            match &self.streams {
                Streams::Async { copy, free, .. } => {
                    free[Ring::Kv as usize][s].wait_on(copy);
                    kv.writeback(s, Some(copy))?;
                }
                Streams::Sync { .. } => kv.writeback(s, None)?,
            }
        }
        Ok(())
    }

    fn run_ops(
        &mut self,
        ring: Ring,
        ops: Vec<Op>,
        store: &WeightStore,
        compute: &Backend,
        mut kv: Option<&mut KvTier>,
    ) -> Result<(), EngineError> {
        // the slots whose uploads in these ops go through the relay: they
        // wait for their `free` event on the relay's stream, not here
        let relayed: Vec<usize> = if ring == Ring::Ffn && self.relay.is_some() && self.relay_step {
            let r = self.rings[ring as usize].as_ref().expect("ring");
            ops.iter()
                .filter_map(|op| match *op {
                    Op::Upload { j, slot } => {
                        let local = r.local(j);
                        let gi = self.lists[ring as usize][local];
                        (Relay::takes(local) && !self.partial.contains_key(&gi.index()))
                            .then_some(slot)
                    }
                    _ => None,
                })
                .collect()
        } else {
            Vec::new()
        };
        for op in ops {
            match op {
                Op::Upload { j, slot } => {
                    let local = self.rings[ring as usize].as_ref().expect("ring").local(j);
                    // a carried upload is numbered as the next step's group
                    // (n + i here): this step's group i, which that step
                    // is expected to stream first too
                    let list = &self.lists[ring as usize];
                    let gi = list[local % list.len()];
                    let relay = relayed.contains(&slot);
                    match &mut self.streams {
                        Streams::Sync { pending } => pending.push_back((ring, slot, gi)),
                        Streams::Async { .. } => {
                            self.upload(ring, slot, gi, store, compute, kv.as_deref_mut(), relay)?
                        }
                    }
                }
                Op::WaitFree(s) if relayed.contains(&s) => {}
                Op::WaitFree(s) => {
                    if let Streams::Async { copy, free, .. } = &self.streams {
                        free[ring as usize][s].wait_on(copy);
                    }
                }
                Op::RecordLoaded(s) => {
                    if let Streams::Async { copy, loaded, .. } = &self.streams {
                        match self.relay.as_mut() {
                            Some(r) if ring == Ring::Ffn && r.relayed[s] => {
                                // after the peer copy the landing stream waited for
                                loaded[ring as usize][s].record(&r.landing);
                                r.relayed[s] = false;
                            }
                            _ => loaded[ring as usize][s].record(copy),
                        }
                    }
                }
                Op::WaitLoaded(s) => match &mut self.streams {
                    Streams::Async { loaded, .. } => loaded[ring as usize][s].wait_on(compute),
                    Streams::Sync { pending } => {
                        // run queued copies up to the one filling this slot
                        if let Some(pos) =
                            pending.iter().position(|&(r, sl, _)| r == ring && sl == s)
                        {
                            let todo: Vec<_> = pending.drain(..=pos).collect();
                            for (r, sl, gi) in todo {
                                self.upload(r, sl, gi, store, compute, kv.as_deref_mut(), false)?;
                                if let Some(rg) = self.rings[r as usize].as_mut() {
                                    rg.mark_resident(sl);
                                }
                            }
                        }
                    }
                },
                Op::RecordFree(s) => {
                    if let Streams::Async { free, .. } = &self.streams {
                        free[ring as usize][s].record(compute);
                    }
                }
                Op::Poison(s) if ring == Ring::Kv => {
                    compute.synchronize();
                    let kv = kv.as_deref_mut().expect("KV ring");
                    kv.writeback(s, None)?;
                    kv.poison(s)?;
                }
                Op::Poison(s) => {
                    compute.synchronize();
                    store.rings[ring as usize]
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

    /// The slots of `ring` (0 where it has none).
    pub fn slots(&self, ring: Ring) -> usize {
        self.rings[ring as usize].as_ref().map_or(0, |r| r.slots())
    }

    /// Enqueues what must precede computing streamed group `gi`; returns its slot.
    pub fn before_compute(
        &mut self,
        gi: GroupId,
        ring: Ring,
        store: &WeightStore,
        compute: &Backend,
        kv: Option<&mut KvTier>,
    ) -> Result<usize, EngineError> {
        self.before_compute_holding(gi, ring, store, compute, kv, 0)
    }

    /// [`Pager::before_compute`] leaving the last `hold` uploads of the
    /// group's window for [`Pager::issue_window`] (`SlotRing::before_compute_holding`).
    pub fn before_compute_holding(
        &mut self,
        gi: GroupId,
        ring: Ring,
        store: &WeightStore,
        compute: &Backend,
        kv: Option<&mut KvTier>,
        hold: usize,
    ) -> Result<usize, EngineError> {
        let j = self.position(gi, ring);
        let mut kv = kv;
        self.issue_in_step_order(ring, j, hold, store, compute, kv.as_deref_mut())?;
        let r = self.rings[ring as usize].as_mut().expect("ring");
        let ops = r.before_compute_holding(j, hold);
        let slot = r.slot_of(j);
        self.run_ops(ring, ops, store, compute, kv)?;
        Ok(slot)
    }

    /// Issues what is left of streamed group `gi`'s window (after
    /// [`Pager::before_compute_holding`]).
    pub fn issue_window(
        &mut self,
        gi: GroupId,
        ring: Ring,
        store: &WeightStore,
        compute: &Backend,
        kv: Option<&mut KvTier>,
    ) -> Result<(), EngineError> {
        let j = self.position(gi, ring);
        self.issue_in_step_order(ring, j, 0, store, compute, kv)
    }

    /// Group `gi`'s place in `ring`'s list of this step.
    fn position(&self, gi: GroupId, ring: Ring) -> usize {
        self.lists[ring as usize]
            .iter()
            .position(|&g| g == gi)
            .expect("group is in this step's order")
    }

    /// Issues what the rings' windows allow now (each ring's uploads up
    /// to `depth` past the next group it computes), in the order the step
    /// needs them: at the start of a step, every ring's first uploads, so
    /// the bus starts while the host still enqueues the resident groups
    /// before the first streamed one; before the host computes a group
    /// itself, the uploads into the slots the device's groups freed, which
    /// would otherwise wait for the next streamed group's turn. `most`:
    /// issue no more than that many uploads now (the step's first; a
    /// later call issues the rest of the windows).
    pub fn prefetch_window(
        &mut self,
        store: &WeightStore,
        compute: &Backend,
        mut kv: Option<&mut KvTier>,
        most: usize,
    ) -> Result<(), EngineError> {
        let mut next: Vec<(usize, Ring, usize)> = Vec::new();
        for ring in [Ring::Attn, Ring::Ffn, Ring::Kv] {
            let Some(r) = self.rings[ring as usize].as_ref() else {
                continue;
            };
            // the window: up to depth past the next group to compute
            // (prefetch keeps to it)
            for k in r.issued()..r.n().min(r.released() + r.depth() + 1) {
                next.push((self.pos[self.lists[ring as usize][k].index()], ring, k));
            }
        }
        next.sort_unstable_by_key(|&(p, ring, _)| (p, ring as usize));
        for (_, ring, k) in next.into_iter().take(most) {
            self.prefetch(ring, k, store, compute, kv.as_deref_mut())?;
        }
        Ok(())
    }

    /// Issues `ring`'s uploads up to its group `upto`, within its window.
    fn prefetch(
        &mut self,
        ring: Ring,
        upto: usize,
        store: &WeightStore,
        compute: &Backend,
        kv: Option<&mut KvTier>,
    ) -> Result<(), EngineError> {
        let ops = self.rings[ring as usize]
            .as_mut()
            .expect("ring")
            .prefetch(upto);
        self.run_ops(ring, ops, store, compute, kv)
    }

    /// Issues the uploads `ring` is about to issue for group `j`'s window
    /// one by one, each after the other rings' uploads the step needs
    /// before it (as far as their windows allow): the copy stream runs
    /// them in the order enqueued, so an FFN group prefetched for later
    /// must not hold up the attention group needed next.
    /// `hold`: leave the window's last that many uploads for later.
    fn issue_in_step_order(
        &mut self,
        ring: Ring,
        j: usize,
        hold: usize,
        store: &WeightStore,
        compute: &Backend,
        mut kv: Option<&mut KvTier>,
    ) -> Result<(), EngineError> {
        let Some(r) = self.rings[ring as usize].as_ref() else {
            return Ok(());
        };
        let last = (j + r.depth().saturating_sub(hold)).min(r.n().saturating_sub(1));
        let (first, last) = (r.issued(), last);
        for k in first..=last {
            let p = self.pos[self.lists[ring as usize][k].index()];
            for other in [Ring::Attn, Ring::Ffn, Ring::Kv] {
                if other == ring || self.rings[other as usize].is_none() {
                    continue;
                }
                // its groups needed before position p (lists are in step order)
                let before =
                    self.lists[other as usize].partition_point(|g| self.pos[g.index()] < p);
                if before > 0 {
                    self.prefetch(other, before - 1, store, compute, kv.as_deref_mut())?;
                }
            }
            self.prefetch(ring, k, store, compute, kv.as_deref_mut())?;
        }
        Ok(())
    }

    /// Enqueues what follows computing streamed group `gi`.
    pub fn after_compute(
        &mut self,
        gi: GroupId,
        ring: Ring,
        store: &WeightStore,
        compute: &Backend,
        kv: Option<&mut KvTier>,
    ) -> Result<(), EngineError> {
        let j = self.lists[ring as usize]
            .iter()
            .position(|&g| g == gi)
            .expect("group is in this step's order");
        let ops = self.rings[ring as usize]
            .as_mut()
            .expect("ring")
            .after_compute(j);
        self.run_ops(ring, ops, store, compute, kv)?;
        self.carry_over(store, compute)
    }

    /// Once every weight ring released all of this step's groups, uploads
    /// the next step's first groups (each ring's start window, up to its
    /// first group with a partial upload), in this step's order, while the
    /// step's last groups compute and the next one's inputs are written
    /// (`SlotRing::carry_next`); the next step keeps them where it streams
    /// the same groups first ([`Pager::begin_step`]). Not through a relay
    /// or a DRAM window, whose host slots the next step fills anew.
    fn carry_over(&mut self, store: &WeightStore, compute: &Backend) -> Result<(), EngineError> {
        if !self.carry
            || !self.carry_step
            || !matches!(self.streams, Streams::Async { .. })
            || self.relay.is_some()
            || store.has_dram_window()
        {
            return Ok(());
        }
        let mut next: Vec<(usize, Ring)> = Vec::new();
        for ring in [Ring::Attn, Ring::Ffn] {
            let Some(r) = self.rings[ring as usize].as_ref() else {
                continue;
            };
            if r.released() < r.n() {
                return Ok(());
            }
            let list = &self.lists[ring as usize];
            let whole = list[..r.n().min(r.depth() + 1)]
                .iter()
                .take_while(|g| !self.partial.contains_key(&g.index()))
                .count();
            for g in &list[r.carried()..whole.max(r.carried())] {
                next.push((self.pos[g.index()], ring));
            }
        }
        next.sort_unstable_by_key(|&(p, ring)| (p, ring as usize));
        if !next.is_empty() && !self.carried {
            if let Streams::Async {
                copy,
                before_carried,
                ..
            } = &self.streams
            {
                before_carried.record(copy);
            }
            self.carried = true;
        }
        for (_, ring) in next {
            let ops = self.rings[ring as usize]
                .as_mut()
                .and_then(|r| r.carry_next());
            if let Some(ops) = ops {
                self.run_ops(ring, ops, store, compute, None)?;
            }
        }
        Ok(())
    }

    /// Forgets a step that failed half-way; both streams must be drained.
    /// Queued copies are dropped, and rows a KV window computed are not
    /// written back (the failed step's cells are given back too).
    pub fn abort_step(&mut self, kv: Option<&mut KvTier>) {
        self.carried = false;
        for r in self.rings.iter_mut().flatten() {
            r.abort();
        }
        if let Some(r) = self.relay.as_mut() {
            r.relayed.fill(false);
        }
        if let Streams::Sync { pending } = &mut self.streams {
            pending.clear();
        }
        if let Some(kv) = kv {
            kv.forget_pending();
        }
    }

    /// Before a step's host-side writes: waits for the copy stream, but
    /// for the uploads carried into the step (weights into their slots,
    /// which nothing the host writes touches; the step's graphs wait for
    /// them on the device), where no KV tier shares the stream (its frames'
    /// copies may follow them). Carried uploads are why: waiting for them,
    /// a 64-sequence step began up to a group's upload late.
    pub fn synchronize_for_step(&mut self) {
        let carried = std::mem::take(&mut self.carried);
        match &self.streams {
            Streams::Async { before_carried, .. }
                if carried && self.rings[Ring::Kv as usize].is_none() && self.relay.is_none() =>
            {
                before_carried.synchronize()
            }
            _ => self.synchronize(),
        }
    }

    /// Waits for the copy stream (before host-side writes to shared inputs).
    pub fn synchronize(&self) {
        if let Streams::Async { copy, .. } = &self.streams {
            copy.synchronize();
        }
        if let Some(r) = &self.relay {
            r.up.synchronize();
            r.peer.synchronize();
            r.landing.synchronize();
        }
    }
}
