//! The forward step: tokens in, logits out, one group graph at a time.
//!
//! A step queues its first upload, writes its inputs on the host (its
//! tokens' embedding rows into the persistent residual stream, its masks;
//! `inputs`), queues the rest of its first uploads, then for every layer
//! runs the attention template bound to that layer's weights and KV
//! cache, then the FFN template, and finally the output head on the rows
//! that want logits. Groups the placement keeps resident are bound in
//! place; streamed groups are bound to the slot the pager filled (see
//! `pager`); groups the host CPU computes (hybrid decode) run on its copy
//! of the weights.

use super::batch::BatchToken;
use super::batch::StepStats;
use super::buffers;
use super::error::EngineError;
use super::hops::Way;
use super::host;
use super::state::Engine;
use super::state::{Pending, StepInputs};
use super::store::Location;
use super::timeline;
use crate::graph::BindId;
use crate::graph::StepShape;
use crate::graph::TemplateKey;
use crate::graph::HEAD_ROWS;
use crate::kv::KvCells;
use crate::kv::StepTree;
use crate::model::GroupId;
use crate::model::GroupKind;
use crate::paging::Ring;
use std::time::Instant;

impl Engine {
    /// Runs `tokens` (split into steps of at most n_batch) and returns the
    /// logits of each token with `logits == true`, in order, n_vocab each.
    /// On error the KV cache holds what it held before the call.
    pub fn decode(&mut self, tokens: &[BatchToken]) -> Result<Vec<f32>, EngineError> {
        if tokens.is_empty() {
            return Err(EngineError::EmptyBatch);
        }
        let mut out = Vec::new();
        let before = (tokens.len() > self.lim.n_batch as usize)
            .then(|| self.parts().map(|e| e.kv.snapshot()).collect::<Vec<_>>());
        for chunk in tokens.chunks(self.lim.n_batch as usize) {
            if let Err(e) = self.step(chunk, None, &mut out) {
                // all or nothing: earlier steps' cells are given back too
                if let Some(b) = before {
                    self.restore_chain(b.into_iter());
                }
                return Err(e);
            }
            self.log_device_memory(chunk.len());
            self.watch_budget();
        }
        Ok(out)
    }

    /// Runs `tokens` in one step whose tokens form a tree (`tree`: which
    /// cells each token sees, see [`crate::kv::tree`]): the verifying step
    /// of a token tree, or a level of a draft model's tree. Returns the
    /// logits of each token with `logits == true`, in order, and the cell
    /// each token was placed in. The tokens must fit one step (n_batch). On
    /// error the KV cache holds what it held before the call.
    pub fn decode_tree(
        &mut self,
        tokens: &[BatchToken],
        tree: &StepTree,
    ) -> Result<(Vec<f32>, Vec<u32>), EngineError> {
        if tokens.is_empty() {
            return Err(EngineError::EmptyBatch);
        }
        if tokens.len() > self.lim.n_batch as usize {
            return Err(crate::kv::KvError::BadTree(format!(
                "{} tokens do not fit one step of {} (raise --batch-size)",
                tokens.len(),
                self.lim.n_batch
            ))
            .into());
        }
        let sp: Vec<(u32, i32)> = tokens.iter().map(|t| (t.seq, t.pos)).collect();
        tree.validate(&sp, self.kv.cells().size())
            .map_err(crate::kv::KvError::BadTree)?;
        let mut out = Vec::new();
        let cells = self.step(tokens, Some(tree), &mut out)?;
        self.watch_budget();
        Ok((out, cells))
    }

    /// Warns, once per part, when a part's device holds more than its GPU
    /// budget since the part began loading (`paging::BudgetWatch`).
    fn watch_budget(&mut self) {
        let mut part = Some(self);
        while let Some(e) = part {
            // once it warned, the device is not read again
            if let Some(w) = e.budget_watch.as_mut().filter(|w| !w.reported()) {
                if let Some(used) = w.check(e.device.memory().0 as u64) {
                    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
                    tracing::warn!(
                        "the GPU holds {:.0} MiB since strata began loading, {:.0} MiB above the GPU budget of {:.0} MiB: \
                         ggml allocates memory the plan does not count (its memory pool, CUDA graphs); \
                         other processes on this GPU count too",
                        mib(used),
                        mib(used - w.budget()),
                        mib(w.budget())
                    );
                }
            }
            part = e.next.as_deref_mut();
        }
    }

    /// With debug logging: the device's memory in use after a step of `n`
    /// tokens, beside the plan's and the activation buffer's, to find
    /// what a workload takes beyond the plan (`-vv`).
    fn log_device_memory(&self, n: usize) {
        if self.device.is_cpu() || !tracing::enabled!(tracing::Level::DEBUG) {
            return;
        }
        let (free, total) = self.device.memory();
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        tracing::debug!(
            "after a step of {n} tokens: device {:.1} MiB in use (plan {:.1} MiB; activations {:.1} MiB now, {:.1} planned)",
            mib(total.saturating_sub(free) as u64),
            mib(self.plan.device_bytes()),
            mib(self.templates.activation_bytes()),
            mib(self.plan.activation_bytes)
        );
    }

    /// Gives every part back the cells of `snaps` (one per part, in order).
    fn restore_chain(&mut self, mut snaps: impl Iterator<Item = KvCells>) {
        if let Some(b) = snaps.next() {
            self.pager_sync();
            self.kv.restore(b);
        }
        if let Some(n) = self.next.as_deref_mut() {
            n.restore_chain(snaps);
        }
    }

    fn validate(&self, toks: &[BatchToken]) -> Result<(), EngineError> {
        let n_vocab = self.spec.hp.n_vocab;
        for t in toks {
            if t.token >= n_vocab {
                return Err(EngineError::BadToken {
                    token: t.token,
                    n_vocab,
                });
            }
            if t.pos < 0 || t.pos as u32 >= self.lim.n_ctx {
                return Err(EngineError::BadPos {
                    seq: t.seq,
                    pos: t.pos,
                    n_ctx: self.lim.n_ctx,
                });
            }
        }
        Ok(())
    }

    /// One forward step. On any error the step's cells are given back and
    /// the pager forgets the step, so the cache holds what it held before.
    /// A model split across devices runs its parts in turn: every part
    /// places its cells and starts its first upload, then writes its
    /// inputs (every part at once on GPUs), then queues the rest of its
    /// uploads (so a later device's link fills its slots while the earlier
    /// ones compute), then each computes its layers and hands the
    /// residual stream to the next.
    /// Returns the cells the step's tokens were placed in.
    fn step(
        &mut self,
        toks: &[BatchToken],
        tree: Option<&StepTree>,
        out: &mut Vec<f32>,
    ) -> Result<Vec<u32>, EngineError> {
        self.validate(toks)?;
        let start = Instant::now();
        let out_len = out.len();
        let r = self.begin_chain(toks, None).and_then(|cells| {
            self.write_chain_inputs(toks, tree, &cells)?;
            self.prefetch_chain()?;
            if self.spec.shard.is_some() {
                self.run_rows(out)
            } else {
                self.run_chain(out)
            }
            .map(|()| cells)
        });
        if r.is_err() {
            self.abort_chain();
            out.truncate(out_len);
            return r;
        }
        self.end_chain();
        if self.next.is_some() {
            // the step over every part, timed whole
            let mut st = self.last_step;
            for p in self.parts().skip(1) {
                st.add_part(&p.last_step);
            }
            st.seconds = start.elapsed().as_secs_f64();
            self.last_step = st;
        }
        r
    }

    /// Begins the step on this part and the parts after it; returns the
    /// step's cells.
    fn begin_chain(
        &mut self,
        toks: &[BatchToken],
        first: Option<&[u32]>,
    ) -> Result<Vec<u32>, EngineError> {
        let cells = self.begin_part(toks)?;
        // every part's cells mirror the first's: the same operations in
        // the same order on the same cell table
        if first.is_some_and(|f| f != cells.as_slice()) {
            return Err(EngineError::BadDevices(format!(
                "the KV cells of layers {:?} differ from the first device's",
                self.layers()
            )));
        }
        if let Some(n) = self.next.as_deref_mut() {
            n.begin_chain(toks, Some(first.unwrap_or(&cells)))?;
        }
        Ok(cells)
    }

    /// Runs the begun step on this part and the parts after it.
    fn run_chain(&mut self, out: &mut Vec<f32>) -> Result<(), EngineError> {
        self.run_part(out)?;
        if let Some(n) = self.next.as_deref_mut() {
            n.run_chain(out)?;
        }
        Ok(())
    }

    /// Ends a step every part ran: their cells stay.
    fn end_chain(&mut self) {
        self.pending = None;
        if let Some(n) = self.next.as_deref_mut() {
            n.end_chain();
        }
    }

    /// Forgets a begun step on every part: cells given back, the pager's
    /// step dropped.
    fn abort_chain(&mut self) {
        if let Some(p) = self.pending.take() {
            self.pager_sync();
            self.pager.abort_step(self.kv.tier_mut());
            // the step's cells given back, and the frames of blocks that
            // are empty again
            self.kv.restore(p.before);
        }
        if let Some(n) = self.next.as_deref_mut() {
            n.abort_chain();
        }
    }

    /// Places the step's cells and starts the pager's uploads; returns
    /// the cells. `pending` holds the rest for `Engine::write_inputs` and
    /// [`Engine::run_part`].
    fn begin_part(&mut self, toks: &[BatchToken]) -> Result<Vec<u32>, EngineError> {
        // inputs (once every part began) and the KV tier's host frames
        // are written next: nothing may be in flight but uploads carried
        // into this step
        self.backend.synchronize();
        self.pager.synchronize_for_step();
        let before = self.kv.snapshot();
        let sp: Vec<(u32, i32)> = toks.iter().map(|t| (t.seq, t.pos)).collect();
        let cells = self.kv.place(&sp)?;
        self.pending = Some(Pending {
            before,
            start: Instant::now(),
            disk0: self.store.disk_bytes_read(),
            n_tokens: toks.len(),
            n_out: 0,
            order: Vec::new(),
            on_cpu: Vec::new(),
            last_cpu: None,
            halves: None,
            inputs: None,
        });
        self.prepare_part(toks, &cells)?;
        Ok(cells)
    }

    fn prepare_part(&mut self, toks: &[BatchToken], cells: &[u32]) -> Result<(), EngineError> {
        let n = toks.len() as u32;
        let sp: Vec<(u32, i32)> = toks.iter().map(|t| (t.seq, t.pos)).collect();
        let mask = toks.iter().fold(0u64, |m, t| m | 1 << t.seq);
        let before = &self.pending.as_ref().expect("begun").before;
        self.kv.prepare(before, cells, mask, Some(&sp))?;
        let n_kv = self.kv.cells().n_kv() as u32;
        // only the part with the head computes logits; every device of
        // the row split selects the last layer's rows as the first does
        let head = self.spec.has_head || self.spec.shard.is_some();
        let out_ids: Vec<i32> = toks
            .iter()
            .enumerate()
            .filter(|(_, t)| t.logits && head)
            .map(|(i, _)| i as i32)
            .collect();
        let n_out = out_ids.len() as u32;

        // a mixture's expert split at this step size: the groups it splits
        // and the device's experts of each (steps whose FFN rows are
        // chunked do not split)
        let split_plan = self
            .plan
            .placement
            .hybrid
            .as_ref()
            .and_then(|h| h.split.as_ref());
        let split_k = split_plan
            .and_then(|s| s.at(n))
            .filter(|_| self.host.is_some() && self.split.is_some() && n <= self.lim.ffn_rows);
        // hybrid decode: the groups the CPU computes whole at this step
        // size (a split step's beside its split layers)
        let mut on_cpu = match (&self.host, &self.plan.placement.hybrid) {
            (Some(_), Some(h)) => h.cpu_groups(n),
            _ => vec![false; self.spec.groups.len()],
        };
        let dev_experts = |l: u32| {
            let gi = GroupId::new(l, GroupKind::Ffn).index();
            match (split_k, split_plan) {
                (Some(k), Some(s)) if s.groups[gi] && !on_cpu[gi] => k,
                _ => 0,
            }
        };
        // the groups of this step, in order, with their shapes
        let n_layer = self.spec.hp.n_layer;
        let mut order: Vec<(u32, GroupKind, StepShape)> = Vec::with_capacity(2 * n_layer as usize);
        for l in 0..n_layer {
            // the model's last layer (not a part's before the last device's)
            let last = l + 1 == n_layer && head;
            if last && n_out == 0 {
                // nothing wanted: the last attention still writes its KV
                // rows, the last FFN is not needed
                order.push((
                    l,
                    GroupKind::Attn,
                    StepShape {
                        n_tokens: n,
                        n_kv,
                        n_out: n,
                        last_layer: false,
                        swa: self.spec.hp.is_swa(l),
                        dev_experts: 0,
                        routed: false,
                        row0: 0,
                    },
                ));
                break;
            }
            let rows = if last { n_out } else { n };
            order.push((
                l,
                GroupKind::Attn,
                StepShape {
                    n_tokens: n,
                    n_kv,
                    n_out: rows,
                    last_layer: last,
                    swa: self.spec.hp.is_swa(l),
                    dev_experts: 0,
                    routed: false,
                    row0: 0,
                },
            ));
            order.push((
                l,
                GroupKind::Ffn,
                StepShape {
                    n_tokens: rows,
                    n_kv: 0,
                    n_out: rows,
                    last_layer: false,
                    swa: false,
                    dev_experts: dev_experts(l),
                    routed: false,
                    row0: 0,
                },
            ));
        }
        // routed uploads (on `auto`, in place of the host's groups where
        // that is predicted faster)
        let routed = self.choose_routed_step(n, &order, &mut on_cpu);
        if routed.off_host_by_factor() {
            if let Some(c) = self.cpu_cal.as_mut() {
                c.skipped(n);
            }
        }
        if let Some(h) = self.host.as_mut() {
            h.stats = host::HostStats::default();
        }
        if let Some(a) = self.ahead.as_mut() {
            a.begin_step(&on_cpu);
        }
        let gis: Vec<GroupId> = order
            .iter()
            .map(|(l, k, _)| GroupId::new(*l, *k))
            .filter(|gi| !on_cpu[gi.index()])
            .collect();
        let split: Vec<(GroupId, u32)> = order
            .iter()
            .filter(|(_, k, s)| *k == GroupKind::Ffn && s.dev_experts > 0)
            .map(|(l, k, s)| (GroupId::new(*l, *k), s.dev_experts))
            .collect();
        self.plan_partial_uploads(&split);
        self.plan_routed_uploads(&mut order, routed);
        // a hybrid step in two halves of rows (halves.rs)
        let halves = self.plan_cpu_halves(n, &order, &on_cpu);
        let halved = halves.as_deref().map_or(0, crate::paging::halves::covered);
        // with the halves the row split cuts groups in (rows.rs), or the
        // hybrid step's
        let shapes: Vec<StepShape> = order
            .iter()
            .enumerate()
            .flat_map(|(i, &(l, k, s))| {
                let cpu = (i < halved).then(|| Self::half_shapes(s));
                std::iter::once(s)
                    .chain(self.halves_of(l, k, s).into_iter().flatten())
                    .chain(cpu.into_iter().flatten())
            })
            .collect();
        self.templates
            .evict(&shapes, 4 * self.spec.groups.len() + 16, &self.backend);
        self.pager.relay_step = n >= super::pager::RELAY_MIN_TOKENS;
        self.pager.carry_step = self
            .plan
            .placement
            .hybrid
            .as_ref()
            .is_none_or(|h| h.carry_at(n));
        self.pager.begin_step(&gis, &self.store, self.kv.tier())?;
        self.pager
            .prefetch_window(&self.store, &self.backend, self.kv.tier_mut(), 1)?;
        // after the step's last CPU group its pool sleeps: spinning, it
        // would take the cores the thread driving the GPU and the driver's
        // own threads need (the H100 traces showed that thread losing a
        // 4 ms scheduler tick in most steps)
        let last_cpu = order
            .iter()
            .rposition(|(l, k, s)| on_cpu[GroupId::new(*l, *k).index()] || s.dev_experts > 0);
        let p = self.pending.as_mut().expect("begun");
        p.n_out = n_out;
        p.order = order;
        p.on_cpu = on_cpu;
        p.last_cpu = last_cpu;
        p.halves = halves;
        // the inputs are written once every part's first upload runs
        p.inputs = Some(StepInputs {
            sp,
            n_kv: n_kv as usize,
            out_ids,
        });
        Ok(())
    }

    /// Computes this part's groups of the begun step, then the head (the
    /// last part) or hands the residual stream to the next part.
    fn run_part(&mut self, out: &mut Vec<f32>) -> Result<(), EngineError> {
        let p = self.pending.as_mut().expect("begun");
        let order = std::mem::take(&mut p.order);
        let on_cpu = std::mem::take(&mut p.on_cpu);
        let (last_cpu, n_out, n_tokens) = (p.last_cpu, p.n_out, p.n_tokens);
        // the groups before the last layer in two halves, where planned
        let mut done = 0;
        if let Some(stages) = p.halves.clone() {
            self.run_halves(&order, &stages)?;
            done = crate::paging::halves::covered(&stages);
            if last_cpu.is_some_and(|c| c < done) && !self.device.is_cpu() {
                if let Some(h) = self.host.as_ref() {
                    h.park_threads();
                }
            }
        }
        // rows of the residual stream on the host, while they are there
        let mut x_host: Option<u32> = None;
        for (i, (l, kind, shape)) in order.into_iter().enumerate().skip(done) {
            if on_cpu[GroupId::new(l, kind).index()] {
                self.run_host_group(l, kind, shape, &mut x_host)?;
                if Some(i) == last_cpu && !self.device.is_cpu() {
                    if let Some(h) = self.host.as_ref() {
                        h.park_threads();
                    }
                }
            } else if shape.routed {
                self.residual_to_device(&mut x_host)?;
                self.run_routed_ffn(l, shape)?;
            } else if shape.dev_experts > 0 {
                self.residual_to_device(&mut x_host)?;
                self.run_split_ffn(l, shape)?;
                if Some(i) == last_cpu && !self.device.is_cpu() {
                    if let Some(h) = self.host.as_ref() {
                        h.park_threads();
                    }
                }
            } else {
                let t0 = Instant::now();
                self.residual_to_device(&mut x_host)?;
                self.run_group(l, kind, shape)?;
                // the host should enqueue a device group in microseconds:
                // a slow one is waiting on the device (a hidden sync)
                let dt = t0.elapsed().as_secs_f64();
                if dt > 1e-3 {
                    tracing::debug!(
                        "{} {l}: the host took {:.2} ms to enqueue it ({n_tokens} tokens)",
                        kind.name(),
                        dt * 1e3
                    );
                }
            }
        }
        self.residual_to_device(&mut x_host)?;
        self.pager.end_step(self.kv.tier_mut())?;
        if n_out > 0 {
            self.run_head(n_out, out)?;
        }
        self.backend.synchronize();
        if let Some(next) = self.next.as_deref_mut() {
            // the residual stream to the next device, through the host
            let n = n_tokens * self.spec.hp.n_embd as usize;
            let mut x = vec![0f32; n];
            let t0 = Instant::now();
            self.persistent
                .tensor(buffers::X)
                .get_bytes(bytemuck::cast_slice_mut(&mut x), 0)?;
            next.persistent
                .tensor(buffers::X)
                .set_bytes(bytemuck::cast_slice(&x), 0)?;
            self.rec.host_span(
                timeline::Stream::Cpu,
                || "hop to next device".into(),
                t0,
                Instant::now(),
            );
        }
        // pending is kept until every part ran: a later part's error
        // gives this part's cells back too (`abort_chain`)
        self.finish_part();
        self.tune_threads()?;
        Ok(())
    }

    /// The statistics and the CPU's calibration after this part's share
    /// of a step.
    pub(super) fn finish_part(&mut self) {
        let p = self.pending.as_ref().expect("begun");
        self.last_step = StepStats {
            n_tokens: p.n_tokens,
            seconds: p.start.elapsed().as_secs_f64(),
            pager: self.pager.stats,
            disk_bytes: self.store.disk_bytes_read() - p.disk0,
            kv: self.kv.tier().map(|k| k.step).unwrap_or_default(),
            host: self.host.as_ref().map(|h| h.stats).unwrap_or_default(),
            // the groups a hybrid step ran in two halves (the row split
            // counts its own in rows.rs)
            halved: p
                .halves
                .as_deref()
                .map_or(0, crate::paging::halves::covered) as u32,
            routed: self.routed.as_ref().map(|r| r.stats).unwrap_or_default(),
        };
        let n = p.n_tokens as u32;
        // (a step in halves computes its CPU groups at other sizes than
        // the plan's)
        if p.halves.is_none() {
            self.calibrate_cpu(n);
        }
    }

    /// Hybrid decode: the factor on the probe's CPU time per byte that the
    /// steps of `n` tokens' band so far showed, and the step of `n` tokens
    /// predicted with the CPU at that speed (the plan's own prediction
    /// uses the probe's).
    pub fn cpu_calibration(&self, n: u32) -> Option<(f64, f64)> {
        let (c, plan) = (self.cpu_cal.as_ref()?, self.plan.placement.hybrid.as_ref()?);
        (1..=crate::paging::HYBRID_MAX_TOKENS)
            .contains(&n)
            .then(|| (c.factor(n), c.predict(plan, n)))
    }

    /// Hybrid decode: the step of `n` tokens predicted with the CPU at the
    /// speed the steps showed and the bus at `bus_bw` bytes/s (as a run
    /// measured it), and the bus rate the load-time probe read beside the
    /// CPU. None where the CPU takes no part.
    pub fn predict_at_bus(&self, n: u32, bus_bw: f64) -> Option<(f64, Option<f64>)> {
        let (c, plan) = (self.cpu_cal.as_ref()?, self.plan.placement.hybrid.as_ref()?);
        (1..=crate::paging::HYBRID_MAX_TOKENS)
            .contains(&n)
            .then(|| {
                (
                    c.predict_at(plan, n, c.factor(n), Some(bus_bw)),
                    c.probe.bus_bw_beside,
                )
            })
    }

    /// Counts the router's picks of `layer` (expert statistics).
    pub(super) fn count_routed(&mut self, layer: u32, ids: &[i32]) -> Result<(), EngineError> {
        if let Some(r) = self.routing.as_mut() {
            r.add(layer as usize, ids)?;
        }
        Ok(())
    }

    /// The experts the router picked so far, per layer (with
    /// `EngineConfig::expert_stats` on a mixture of experts).
    pub fn router_counts(&self) -> Option<&crate::paging::routing::RouterCounts> {
        self.routing.as_ref()
    }

    /// The CPU's thread count for the next step, from this step's time:
    /// on the CPU device the whole step, with hybrid decode the host's
    /// groups (steps without them say nothing about its threads).
    fn tune_threads(&mut self) -> Result<(), EngineError> {
        let Some(t) = self.threads.as_mut() else {
            return Ok(());
        };
        let st = &self.last_step;
        let secs = if self.device.is_cpu() {
            st.seconds
        } else if st.host.groups > 0 {
            st.host.compute.as_secs_f64()
        } else {
            return Ok(());
        };
        if let Some(n) = t.observe(st.n_tokens, secs) {
            // a pool of that size: a larger pool's idle threads would still
            // poll for work on the cores fewer threads are meant to leave
            let poll = t.poll;
            if self.device.is_cpu() {
                self.backend.attach_cpu_threadpool(n, poll)?;
                self.backend.set_n_threads(n);
            } else if let Some(h) = self.host.as_mut() {
                h.set_threads(n, poll)?;
            }
        }
        Ok(())
    }

    /// The thread count the CPU computes with now, and the moves the tuner
    /// made (None when the count is fixed).
    pub fn thread_tuning(&self) -> Option<(usize, u32, u32)> {
        self.threads
            .as_ref()
            .map(|t| (t.threads(), t.moves, t.trials))
    }

    /// Tracks the host CPU's speed in hybrid steps against its probe's.
    pub(super) fn calibrate_cpu(&mut self, n: u32) {
        let h = self.last_step.host;
        let (Some(cal), Some(plan)) = (self.cpu_cal.as_mut(), self.plan.placement.hybrid.as_ref())
        else {
            return;
        };
        if h.groups == 0 {
            return;
        }
        cal.observe(n, plan, h.compute.as_secs_f64());
        // the host's groups at this size planned again at that speed
        if let Some(s) = cal.replan(plan, n) {
            let old = plan.per_size[n as usize - 1];
            tracing::info!(
                "{n}-token steps planned again at the host's speed in them ({:.2}x the probe's time per byte): \
                 {} CPU groups, was {} (at the probe's speed {:.2} ms, was {:.2})",
                cal.factor(n),
                s.cpu_groups,
                old.cpu_groups,
                s.predicted.step_s() * 1e3,
                old.predicted.step_s() * 1e3,
            );
            if let Some(h) = self.plan.placement.hybrid.as_mut() {
                h.per_size[n as usize - 1] = s;
            }
        }
    }

    /// A group's id and the key of its template for a step shape: one per
    /// group, so ggml's CUDA backend, seeing a group's graph again
    /// unchanged, captures it (CUDA graphs) and replays it. That pays for
    /// big steps too: sharing one template among a kind's groups, graphs
    /// launched kernel by kernel, a row-split 2048-token step took
    /// 453-454 ms against 447-449 replayed (the host queued its graphs in
    /// 343 ms against 115), though the capture, on a shape's second step,
    /// makes that one step 465-469 ms (two H200s, run 109).
    pub(super) fn group_key(
        &self,
        layer: u32,
        kind: GroupKind,
        shape: StepShape,
    ) -> (GroupId, TemplateKey) {
        let gi = GroupId::new(layer, kind);
        let key = TemplateKey::Group {
            kind,
            sig: self.spec.groups[gi.index()].signature(),
            shape,
            instance: gi.index() as u32,
        };
        (gi, key)
    }

    pub(super) fn run_group(
        &mut self,
        layer: u32,
        kind: GroupKind,
        shape: StepShape,
    ) -> Result<(), EngineError> {
        let g = self.begin_group(layer, kind)?;
        self.compute_group(&g, shape, false, None)?;
        self.end_group(g)
    }

    /// Binds a group's weights where they are: in place if resident, else
    /// the slot the pager filled (the device's stream waits for its
    /// upload), held until [`Engine::end_group`]; an attention group's KV
    /// likewise.
    pub(super) fn begin_group(
        &mut self,
        layer: u32,
        kind: GroupKind,
    ) -> Result<BoundGroup, EngineError> {
        let gi = GroupId::new(layer, kind);
        // KV: resident on the device, or a window the pager fills
        let windowed = kind == GroupKind::Attn && self.kv.is_windowed(layer);
        let mut id = BindId::resident(gi);
        let kv = if windowed {
            let w = self.pager.before_compute(
                gi,
                Ring::Kv,
                &self.store,
                &self.backend,
                self.kv.tier_mut(),
            )?;
            id.kv_window = Some(w);
            Some(self.kv.bindings(layer, Some(w)).clone())
        } else if kind == GroupKind::Attn {
            Some(self.kv.bindings(layer, None).clone())
        } else {
            None
        };
        let (weights, streamed) = match self.store.groups[gi.index()] {
            Location::Resident(ref b) => (b.clone(), None),
            Location::Streamed { ring, .. } => {
                let slot = self.pager.before_compute(
                    gi,
                    ring,
                    &self.store,
                    &self.backend,
                    self.kv.tier_mut(),
                )?;
                id.weight_slot = Some(slot);
                (self.store.slot_bindings(gi, ring, slot)?, Some(ring))
            }
        };
        Ok(BoundGroup {
            layer,
            kind,
            id,
            weights,
            kv,
            streamed,
            windowed,
        })
    }

    /// Queues a begun group's graph over the step's rows `shape` names
    /// (`half`: one of two halves of the step's rows, so named in traces;
    /// `widened`: its quantized matrices as the group's widened copy,
    /// `widen.rs`).
    pub(super) fn compute_group(
        &mut self,
        g: &BoundGroup,
        shape: StepShape,
        half: bool,
        widened: Option<&super::buffers::WidenedGroup>,
    ) -> Result<(), EngineError> {
        let (layer, kind) = (g.layer, g.kind);
        let (_, mut key) = self.group_key(layer, kind, shape);
        let mut weights = &g.weights;
        if let (Some(w), TemplateKey::Group { sig, .. }) = (widened, &mut key) {
            sig.clone_from(&w.sig);
            weights = &w.weights;
        }
        self.templates
            .get(&key)?
            .bind(g.id, weights, g.kv.as_ref())?;
        // bound before allocating so the allocator sees weights as external
        let t = self.templates.allocated(&key, &self.backend)?;
        let rec = self.rec.scope(
            timeline::Stream::Compute,
            &self.backend,
            || {
                let name = format!("{} {}", kind.name(), layer + self.spec.hp.layer0);
                if half {
                    let r = shape.row0;
                    format!("{name} (rows {r}-{})", r + shape.n_tokens - 1)
                } else {
                    name
                }
            },
            0,
        );
        self.backend.compute_async(&t.graph())?;
        drop(rec);
        if kind == GroupKind::Ffn && self.count_device {
            // a measuring mode: the device finishes the layer first
            self.backend.synchronize();
            let ids = self.templates.get(&key)?.read_routed()?;
            self.count_routed(layer, &ids)?;
        }
        Ok(())
    }

    /// Gives a begun group's slots back to the pager, once the graphs
    /// queued over them are done (an event on the device's stream).
    pub(super) fn end_group(&mut self, g: BoundGroup) -> Result<(), EngineError> {
        let gi = GroupId::new(g.layer, g.kind);
        if let Some(ring) = g.streamed {
            self.pager
                .after_compute(gi, ring, &self.store, &self.backend, self.kv.tier_mut())?;
        }
        if g.windowed {
            self.pager.after_compute(
                gi,
                Ring::Kv,
                &self.store,
                &self.backend,
                self.kv.tier_mut(),
            )?;
        }
        Ok(())
    }

    /// Computes a group on the host CPU (hybrid decode), bringing the
    /// residual rows down first if they are on the device.
    pub(super) fn run_host_group(
        &mut self,
        layer: u32,
        kind: GroupKind,
        shape: StepShape,
        x_host: &mut Option<u32>,
    ) -> Result<(), EngineError> {
        let (gi, key) = self.group_key(layer, kind, shape);
        // the host computes for milliseconds: the slots the device's
        // groups freed take their next uploads now, not at the next
        // streamed group's turn
        self.pager
            .prefetch_window(&self.store, &self.backend, self.kv.tier_mut(), usize::MAX)?;
        let host = self.host.as_mut().expect("hybrid plan has a host");
        if x_host.is_none() {
            // the device's groups so far wrote the residual
            let t0 = Instant::now();
            match self.hops.as_mut() {
                Some(hops) => {
                    let rec = self.rec.scope(
                        timeline::Stream::Compute,
                        &self.backend,
                        || format!("host rows down ({} rows)", shape.n_tokens),
                        0,
                    );
                    hops.queue(&self.backend, Way::Down, shape.n_tokens)?;
                    drop(rec);
                    // the host's time on the hop, not the device's groups
                    // it then waits for (as the copies count theirs)
                    host.stats.hops += t0.elapsed();
                    self.backend.synchronize();
                }
                None => {
                    self.backend.synchronize();
                    host.download(self.persistent.tensor(buffers::X), shape.n_tokens)?;
                }
            }
        }
        *x_host = Some(shape.n_tokens);
        if kind == GroupKind::Ffn
            && shape.n_tokens <= crate::paging::experts::HOT_MAX_TOKENS
            && (self.has_hot(gi) || self.has_ahead(gi))
        {
            return self.run_host_ffn_hot(layer, shape.n_tokens);
        }
        let host = self.host.as_mut().expect("hybrid plan has a host");
        // a CPU standing in for the device: its pool would spin on the
        // cores the host's pool computes on (and the other way round)
        let shared_cores = self.device.is_cpu();
        if shared_cores {
            self.backend.park_threads();
        }
        let t0 = Instant::now();
        host.compute(gi, &key)?;
        if shared_cores {
            host.park_threads();
        }
        if kind == GroupKind::Ffn && self.routing.is_some() {
            let ids = host.routed(&key)?;
            self.count_routed(layer, &ids)?;
        }
        self.rec.host_span(
            timeline::Stream::Cpu,
            || format!("{} {}", kind.name(), layer + self.spec.hp.layer0),
            t0,
            Instant::now(),
        );
        Ok(())
    }

    /// Sends the residual rows the host computed back to the device.
    pub(super) fn residual_to_device(
        &mut self,
        x_host: &mut Option<u32>,
    ) -> Result<(), EngineError> {
        let Some(rows) = x_host.take() else {
            return Ok(());
        };
        match (self.host.as_mut(), self.hops.as_mut()) {
            (Some(host), Some(hops)) => {
                let t0 = Instant::now();
                let rec = self.rec.scope(
                    timeline::Stream::Compute,
                    &self.backend,
                    || format!("host rows up ({rows} rows)"),
                    0,
                );
                hops.queue(&self.backend, Way::Up, rows)?;
                drop(rec);
                host.stats.hops += t0.elapsed();
                Ok(())
            }
            (Some(_), None) => self.rows_to_device(0, 0, rows),
            (None, _) => Ok(()),
        }
    }

    /// Sends rows `row0..row0 + rows` of the host's residual back to the
    /// device's through staging `h` (0 for a whole host group, the half's
    /// for a halved one): queued on the compute stream where the device
    /// has a pinned host buffer type, else copied at once (the CPU device,
    /// whose graphs are done when queued).
    pub(super) fn rows_to_device(
        &mut self,
        h: usize,
        row0: u32,
        rows: u32,
    ) -> Result<(), EngineError> {
        let host = self
            .host
            .as_mut()
            .expect("a step with host groups has a host");
        let x = self.persistent.tensor(buffers::X);
        if self.device.is_cpu() {
            return host.upload_rows(x, row0, rows);
        }
        if self.rows_up.is_none() {
            let (e, b) = (self.spec.hp.n_embd, self.lim.n_batch);
            let xb = self.persistent.bindings[buffers::X].clone();
            self.rows_up = super::halfrows::RowsUp::new(self.device, xb, e, b)?;
        }
        match self.rows_up.as_mut() {
            Some(up) => {
                let t0 = Instant::now();
                let data = host.rows(row0, rows)?;
                let rec = self.rec.scope(
                    timeline::Stream::Compute,
                    &self.backend,
                    || format!("host rows up ({rows} rows)"),
                    0,
                );
                up.queue(&self.backend, h, row0, data)?;
                drop(rec);
                host.stats.hops += t0.elapsed();
                Ok(())
            }
            None => host.upload_rows(x, row0, rows),
        }
    }

    /// Logits of the first `n_rows` rows of the residual stream, at most
    /// [`HEAD_ROWS`] rows per graph so the logits never need more
    /// activation memory than the plan reserved, and never more than the
    /// GEMM path's limit: the head's matrix (the vocabulary wide) would need
    /// far more scratch than the plan reserves for the layers'.
    pub(super) fn run_head(&mut self, n_rows: u32, out: &mut Vec<f32>) -> Result<(), EngineError> {
        let n_vocab = self.spec.hp.n_vocab as usize;
        let start = out.len();
        out.resize(start + n_rows as usize * n_vocab, 0.0);
        let most = self
            .plan
            .gemm
            .map_or(HEAD_ROWS, |g| HEAD_ROWS.min(g.mmq_max_rows.max(1)));
        for row0 in (0..n_rows).step_by(most as usize) {
            let rows = most.min(n_rows - row0);
            let key = TemplateKey::Head {
                out_ty: self.spec.output.ty,
                n_rows: rows,
                row0,
            };
            let head = self.store.head.clone();
            self.templates
                .get(&key)?
                .bind(BindId::head(), &head, None)?;
            let t = self.templates.allocated(&key, &self.backend)?;
            let rec = self.rec.scope(
                timeline::Stream::Compute,
                &self.backend,
                || "head".into(),
                0,
            );
            self.backend.compute_async(&t.graph())?;
            drop(rec);
            self.backend.synchronize();
            let o = start + row0 as usize * n_vocab;
            t.out().get_f32(&mut out[o..o + rows as usize * n_vocab])?;
        }
        Ok(())
    }
}

/// A group whose weights (and KV) are bound where they are for this step
/// (`Engine::begin_group`): a streamed one holds its slot until
/// `Engine::end_group`.
pub(super) struct BoundGroup {
    layer: u32,
    kind: GroupKind,
    id: BindId,
    weights: Vec<crate::ggml::Binding>,
    kv: Option<[crate::ggml::Binding; 2]>,
    streamed: Option<Ring>,
    windowed: bool,
}

impl BoundGroup {
    pub(super) fn group(&self) -> GroupId {
        GroupId::new(self.layer, self.kind)
    }
    /// What its weights (and KV) are bound to.
    pub(super) fn id(&self) -> BindId {
        self.id
    }
    /// Its weights in signature order, where they are this step.
    pub(super) fn weights(&self) -> &[crate::ggml::Binding] {
        &self.weights
    }
}
