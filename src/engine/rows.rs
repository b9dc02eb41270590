//! The row split's step (`SplitMode::Row`): every device holds a share of
//! every layer's heads and FFN columns (`model::shard`), each its own part
//! with its own plan, rings, link and KV heads, chained by `Engine::next`
//! like the layer split's parts. A step runs the groups in layer order; for
//! each group:
//!
//! 1. every device queues its share (a device's group graph on its own
//!    stream, waiting for its own link's upload), or the host CPU computes
//!    the share from its copy (hybrid decode), so all the links and
//!    devices work on the group at once;
//! 2. the outputs are summed (the first device's graph added the residual
//!    stream; the others' write their output alone, `Dims::partial`). Two
//!    devices exchange their outputs at once, each copying its output into
//!    the other's reduce buffer (a peer copy between GPUs, queued on the
//!    sender's stream with the receiver's stream waiting for it), and each
//!    adds (`exchange`). With more, the first device adds the others'
//!    outputs and copies the sum back to each (`reduce`).
//!
//! Between GPUs nothing waits on the host: each copy orders the two streams
//! by an event (ggml's `cpy_tensor_async`). Backends that cannot copy
//! asynchronously (the CPU, an RPC server) drain both streams and copy
//! through the host. The first device computes the head.
//!
//! Two devices cut big steps in two halves of rows (`exchange::Halves`):
//! each group's first half, then its second, and one half's exchange runs
//! beside the other's compute (`exchange`: on its own stream between
//! GPUs; on the compute streams elsewhere, where only `--row-halves` turns
//! it on).

use super::buffers;
use super::error::EngineError;
use super::exchange::ExchangeStreams;
use super::state::{on_each_at_once, Engine, Share};
use crate::dtype::GgmlType;
use crate::ggml::Context;
use crate::graph::{BindId, StepShape, TemplateKey};
use crate::model::{GroupId, GroupKind};
use std::time::{Duration, Instant};

impl Engine {
    /// Runs the begun step on this device (the row split's first) and the
    /// devices after it, group by group.
    pub(super) fn run_rows(&mut self, out: &mut Vec<f32>) -> Result<(), EngineError> {
        self.with_chain(|first, others| first.run_rows_on(others, out))
    }

    fn run_rows_on(
        &mut self,
        others: &mut [Box<Engine>],
        out: &mut Vec<f32>,
    ) -> Result<(), EngineError> {
        let p = self.pending.as_mut().expect("begun");
        let order = std::mem::take(&mut p.order);
        let n_out = p.n_out;
        let ons: Vec<Vec<bool>> = std::iter::once(std::mem::take(&mut p.on_cpu))
            .chain(others.iter_mut().map(|e| {
                let p = e.pending.as_mut().expect("begun");
                p.order.clear();
                std::mem::take(&mut p.on_cpu)
            }))
            .collect();
        // a group computed in halves owes its second half's exchange
        // until the next group's first half is queued (parity, rows)
        let mut owed: Option<(usize, StepShape)> = None;
        let mut halved = 0;
        let mut turns = HostTurns::default();
        for (i, (l, kind, shape)) in order.into_iter().enumerate() {
            turns.next(l, kind);
            let gi = GroupId::new(l, kind);
            let halves = match others {
                [other] if !ons.iter().any(|on| on[gi.index()]) && other.halves.is_some() => {
                    self.halves_of(l, kind, shape)
                }
                _ => None,
            };
            if let (Some([a, b]), [other]) = (halves, &mut *others) {
                let t = Instant::now();
                let g0 = self.begin_group(l, kind)?;
                let g1 = other.begin_group(l, kind)?;
                let t = turns.lap(Phase::Begin, t);
                // both devices widen alike: their shards' shapes match
                let (w0, w1) = if self.widens(gi, [a, b]) && other.widens(gi, [a, b]) {
                    (Some(self.widen_group(&g0)?), Some(other.widen_group(&g1)?))
                } else {
                    (None, None)
                };
                self.compute_half(&g0, a, 0, w0.as_ref())?;
                other.compute_half(&g1, a, 0, w1.as_ref())?;
                let mut t = turns.lap(Phase::Compute, t);
                if let Some((p, rows)) = owed.take() {
                    self.exchange(other, p, (rows.row0, rows.n_tokens), Some(1))?;
                    t = turns.lap(Phase::Exchange, t);
                }
                self.compute_half(&g0, b, 1, w0.as_ref())?;
                other.compute_half(&g1, b, 1, w1.as_ref())?;
                let t = turns.lap(Phase::Compute, t);
                self.end_group(g0)?;
                other.end_group(g1)?;
                let t = turns.lap(Phase::End, t);
                self.exchange(other, i % 2, (a.row0, a.n_tokens), Some(0))?;
                turns.lap(Phase::Exchange, t);
                owed = Some((i % 2, b));
                halved += 1;
                continue;
            }
            if let (Some((p, rows)), [other]) = (owed.take(), &mut *others) {
                self.exchange(other, p, (rows.row0, rows.n_tokens), Some(1))?;
            }
            // the devices' shares queued first, then the host's shares
            // computed at once, each on its own pool's cores
            let mut host: Vec<Share<'_>> = Vec::new();
            let all = std::iter::once(&mut *self).chain(others.iter_mut().map(|e| &mut **e));
            for (e, on) in all.zip(&ons) {
                if on[gi.index()] {
                    host.push(Share(e));
                } else {
                    e.run_group(l, kind, shape)?;
                }
            }
            run_host_shares(host, l, kind, shape)?;
            // the rows the group wrote: the last layer's attention keeps
            // only those that want logits
            let rows = if kind == GroupKind::Attn && shape.last_layer {
                shape.n_out
            } else {
                shape.n_tokens
            };
            if others.len() == 1 {
                self.exchange(&mut others[0], i % 2, (0, rows), None)?;
            } else {
                self.reduce(others, rows)?;
            }
        }
        if let (Some((p, rows)), [other]) = (owed.take(), &mut *others) {
            self.exchange(other, p, (rows.row0, rows.n_tokens), Some(1))?;
        }
        for e in std::iter::once(&mut *self).chain(others.iter_mut().map(|e| &mut **e)) {
            e.pager.end_step(e.kv.tier_mut())?;
            if let Some(h) = e.host.as_ref() {
                h.park_threads();
            }
        }
        turns.finish();
        if n_out > 0 {
            self.run_head(n_out, out)?;
        }
        self.backend.synchronize();
        for e in std::iter::once(&mut *self).chain(others.iter_mut().map(|e| &mut **e)) {
            e.backend.synchronize();
            e.finish_part();
        }
        turns.report();
        self.last_step.halved = halved;
        Ok(())
    }

    /// Adds the other devices' outputs (the first `rows` rows of their
    /// residual streams) to this device's, then copies the sum to theirs.
    fn reduce(&mut self, others: &mut [Box<Engine>], rows: u32) -> Result<(), EngineError> {
        // a view of this device's residual, and of each other device's
        // residual and reduce buffer here
        let ctx = Context::new(1 + others.len() * 2, 0)?;
        let n_embd = self.spec.hp.n_embd;
        let view = |b: &crate::ggml::Binding| row_view(&ctx, n_embd, 0, rows, b);
        let x0 = view(&self.persistent.bindings[buffers::X])?;
        let xs = others
            .iter()
            .map(|o| view(&o.persistent.bindings[buffers::X]))
            .collect::<Result<Vec<_>, _>>()?;
        for (j, (o, xo)) in others.iter().zip(&xs).enumerate() {
            let yv = view(&self.reduce[j].arena.binding(0))?;
            // SAFETY: same size and layout; xo was last written by o's
            // graph (this copy is queued after it on o's stream) and is
            // next written by the copy back below, queued after the add
            // that reads yv; yv was last read by the add of the group
            // before, which this device's stream ran before the copy back
            // that o's stream waited for ahead of this group's graph.
            unsafe { o.backend.copy_tensor_async(&self.backend, *xo, yv) };
            self.add_reduced(j, 0, rows)?;
        }
        for (o, xo) in others.iter().zip(&xs) {
            // SAFETY: as above; queued after the adds on this device's
            // stream, and o's stream waits for it before its next graph.
            unsafe { self.backend.copy_tensor_async(&o.backend, x0, *xo) };
        }
        Ok(())
    }

    /// Queues `x += reduce[j]` over rows `row0..row0 + rows` of the
    /// residual stream, on this device's stream (`TemplateKey::AddRows`,
    /// bound to reduce buffer `j`).
    fn add_reduced(&mut self, j: usize, row0: u32, rows: u32) -> Result<(), EngineError> {
        let key = TemplateKey::AddRows { n_rows: rows, row0 };
        let id = BindId {
            group: None,
            weight_slot: Some(j),
            kv_window: None,
        };
        let y = self.reduce[j].arena.binding(0);
        self.templates.get(&key)?.bind(id, &[y], None)?;
        let t = self.templates.allocated(&key, &self.backend)?;
        self.backend.compute_async(&t.graph())?;
        Ok(())
    }

    /// The two halves of rows a group of `shape` is computed in at this
    /// step, where this device cuts steps (`Halves`): not the last layer
    /// (it keeps only the rows that want logits), nor a mixture's split
    /// FFN, a sliding-window model's layer or a windowed KV layer.
    pub(super) fn halves_of(
        &self,
        layer: u32,
        kind: GroupKind,
        shape: StepShape,
    ) -> Option<[StepShape; 2]> {
        let h = self.halves.as_ref()?;
        let n = shape.n_tokens;
        if n < h.min_tokens.max(2)
            || shape.last_layer
            || shape.dev_experts > 0
            || shape.routed
            || shape.row0 != 0
            || self.spec.hp.n_swa > 0
            || (kind == GroupKind::Attn && self.kv.is_windowed(layer))
        {
            return None;
        }
        // the first half in whole tiles of the GEMM kernels where it can
        let a = (n / 2).next_multiple_of(32).min(n - 1);
        Some(shape.halves(a))
    }

    /// Queues half `half` (0, 1) of a begun group, then marks on the
    /// device's stream that its rows are computed (what its exchange
    /// waits for).
    fn compute_half(
        &mut self,
        g: &super::step::BoundGroup,
        shape: StepShape,
        half: usize,
        widened: Option<&super::buffers::WidenedGroup>,
    ) -> Result<(), EngineError> {
        self.compute_group(g, shape, true, widened)?;
        if let Some(x) = exchange_streams(self) {
            x.computed[half].record(&self.backend);
        }
        Ok(())
    }

    /// Two devices: each copies its output of rows `row0..row0 + rows`
    /// into the other's reduce buffer `parity` (the groups alternate
    /// between two, so a copy never overwrites what the other's add of the
    /// group before still reads), then each adds. The first device's
    /// output holds the residual stream, so both compute (x + f0) + f1,
    /// bit for bit alike. The copies run on the compute streams, except
    /// for one `half` of a step cut in two between GPUs: then each send
    /// runs on the sender's exchange stream once its half is computed,
    /// while the compute stream goes on with the other half; each add
    /// waits for the other's send (ggml's copy makes the receiving stream
    /// wait) and for its own (it rewrites the rows sent).
    fn exchange(
        &mut self,
        other: &mut Engine,
        parity: usize,
        (row0, rows): (u32, u32),
        half: Option<usize>,
    ) -> Result<(), EngineError> {
        let ctx = Context::new(4, 0)?;
        let n_embd = self.spec.hp.n_embd;
        let view = |b: &crate::ggml::Binding| row_view(&ctx, n_embd, row0, rows, b);
        let (x0, y0) = (
            view(&self.persistent.bindings[buffers::X])?,
            view(&self.reduce[parity].arena.binding(0))?,
        );
        let (x1, y1) = (
            view(&other.persistent.bindings[buffers::X])?,
            view(&other.reduce[parity].arena.binding(0))?,
        );
        match (half, exchange_streams(self), exchange_streams(other)) {
            (Some(half), Some(s0), Some(s1)) => {
                s0.computed[half].wait_on(&s0.backend);
                s1.computed[half].wait_on(&s1.backend);
                // SAFETY: same sizes and layouts. Each send reads its
                // half's rows of the sender's residual stream once the
                // half's graph is done (the exchange stream waited for it);
                // the sender's add, which rewrites those rows, waits for
                // the send (`sent`), and nothing else writes them before
                // (the other half's graph writes only its own rows). The
                // receiver's add waits for the copy; its reduce buffer is
                // next written two groups later: the send then waits for
                // its half's graph of that group, queued after the
                // sender's add of the group between, which waited for the
                // receiver's send of that group, which waited for the
                // receiver's half's graph, queued after the receiver's
                // add of this group.
                unsafe {
                    s0.backend.copy_tensor_async(&other.backend, x0, y1);
                    s0.sent[half].record(&s0.backend);
                    s1.backend.copy_tensor_async(&self.backend, x1, y0);
                    s1.sent[half].record(&s1.backend);
                }
                s0.sent[half].wait_on(&self.backend);
                s1.sent[half].wait_on(&other.backend);
            }
            // SAFETY: same sizes and layouts. Each copy is queued on the
            // sender's stream after its group's graph (both halves' where
            // the group was cut) and before its add, and the receiver's
            // stream waits for it before its own add. A reduce buffer is
            // next written two groups later, by a copy the sender queues
            // after waiting for the receiver's copy of the group in
            // between, which the receiver queued after this group's add.
            _ => unsafe {
                other.backend.copy_tensor_async(&self.backend, x1, y0);
                self.backend.copy_tensor_async(&other.backend, x0, y1);
            },
        }
        self.add_reduced(parity, row0, rows)?;
        other.add_reduced(parity, row0, rows)
    }
}

/// A device's exchange stream, where it has one.
fn exchange_streams(e: &Engine) -> Option<&ExchangeStreams> {
    e.halves.as_ref().and_then(|h| h.streams.as_ref())
}

/// A view of rows `row0..row0 + rows` of the F32 [n_embd, n_batch] tensor
/// at `b` (a residual stream or a reduce buffer), for a copy between
/// devices.
fn row_view<'c>(
    ctx: &'c Context,
    n_embd: u32,
    row0: u32,
    rows: u32,
    b: &crate::ggml::Binding,
) -> Result<crate::ggml::Tensor<'c>, EngineError> {
    let t = ctx.new_tensor(GgmlType::F32, &[i64::from(n_embd), i64::from(rows)]);
    let at = crate::ggml::Binding::at(
        b.buffer_arc(),
        b.offset() + row0 as usize * n_embd as usize * 4,
    )?;
    // SAFETY: every caller passes the binding of a persistent F32 [n_embd,
    // n_batch] tensor (row0 + rows <= n_batch: a view of those rows), kept
    // alive by its engine for the whole step; the view is only read by
    // copies that complete before the step ends (every stream is drained
    // then).
    unsafe { t.rebind(&at)? };
    Ok(t)
}

/// How long the host took to queue each group of a step, for a debug line:
/// whether the devices could run out of queued work because the thread
/// that feeds them was held up (a long turn), or keep ahead of it.
#[derive(Default)]
struct HostTurns {
    start: Option<Instant>,
    /// The turn under way: when it began, and its group.
    last: Option<(Instant, GroupId)>,
    longest: Option<(Duration, GroupId)>,
    over_2ms: usize,
    queued: Duration,
    /// Halved groups: the host's time in each [`Phase`], total and longest.
    phases: [(Duration, Duration); 4],
}

/// What the host does for a group cut in halves.
#[derive(Clone, Copy, Debug)]
enum Phase {
    /// The pager's work before the group (its slot, uploads queued).
    Begin,
    /// The halves' graphs queued.
    Compute,
    /// After the group (its slot's release).
    End,
    /// The halves' exchanges queued.
    Exchange,
}

impl HostTurns {
    /// The turn of group (`layer`, `kind`) begins.
    fn next(&mut self, layer: u32, kind: GroupKind) {
        self.end_turn(Some(GroupId::new(layer, kind)));
    }

    /// Every group is queued.
    fn finish(&mut self) {
        self.end_turn(None);
    }

    fn end_turn(&mut self, next: Option<GroupId>) {
        let now = Instant::now();
        let start = *self.start.get_or_insert(now);
        if let Some((t, gi)) = self.last {
            let d = now - t;
            if self.longest.is_none_or(|(m, _)| d > m) {
                self.longest = Some((d, gi));
            }
            self.over_2ms += usize::from(d > Duration::from_millis(2));
        }
        self.last = next.map(|gi| (now, gi));
        self.queued = now - start;
    }

    /// Adds the time since `since` to `phase`; returns now.
    fn lap(&mut self, phase: Phase, since: Instant) -> Instant {
        let now = Instant::now();
        let (total, longest) = &mut self.phases[phase as usize];
        *total += now - since;
        *longest = (*longest).max(now - since);
        now
    }

    fn report(&self) {
        // formatted only for a reader: this runs every step
        if !tracing::enabled!(tracing::Level::DEBUG) {
            return;
        }
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let total = self.start.map_or(Duration::ZERO, |s| s.elapsed());
        let (d, longest) = match self.longest {
            Some((d, gi)) => (d, format!("{} {}", gi.kind().name(), gi.layer())),
            None => (Duration::ZERO, "none".into()),
        };
        let phases: Vec<String> = [Phase::Begin, Phase::Compute, Phase::End, Phase::Exchange]
            .iter()
            .map(|&p| {
                let (t, m) = self.phases[p as usize];
                format!("{p:?} {:.2} (longest {:.2})", ms(t), ms(m))
            })
            .collect();
        tracing::debug!(
            "row step: groups queued in {:.2} ms of {:.2}; longest turn {:.2} ms ({longest}), {} over 2 ms; \
             halved groups, ms: {}",
            ms(self.queued),
            ms(total),
            ms(d),
            self.over_2ms,
            phases.join(", ")
        );
    }
}

/// The host shares of one group: each device's rows through its host
/// copy, back to its residual stream; several at once in scoped threads,
/// each on its own pool (`shard_threads`), so they read host memory
/// together rather than in turn.
fn run_host_shares(
    shares: Vec<Share<'_>>,
    l: u32,
    kind: GroupKind,
    shape: crate::graph::StepShape,
) -> Result<(), EngineError> {
    on_each_at_once(shares, |Share(e)| {
        let mut x_host = None;
        e.run_host_group(l, kind, shape, &mut x_host)?;
        e.residual_to_device(&mut x_host)
    })
}
