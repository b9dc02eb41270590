//! The [`Engine`] value: what it owns (in drop order), and what callers ask
//! of it between steps: sizes, the placement summary, the timeline and the
//! KV cache's sequences. Building one is `load.rs`, running a step
//! `step.rs`.

use super::batch::StepStats;
use super::buffers::Persistent;
use super::error::EngineError;
use super::host;
use super::kvcache::KvCache;
use super::kvtier::KvTier;
use super::model_file::ModelFile;
use super::pager::Pager;
use super::probe::measure_h2d;
use super::store::WeightStore;
use super::templates::TemplateCache;
use super::timeline;
use crate::ggml::Backend;
use crate::ggml::Device;
use crate::model::ModelSpec;
use crate::paging::Limits;
use crate::paging::MemoryPlan;
use std::time::Instant;

/// A step begun on one part of the model (`Engine::begin_part`), for
/// `Engine::run_part` to finish.
pub(super) struct Pending {
    /// The cells before the step, restored if it fails.
    pub(super) before: crate::kv::KvCells,
    pub(super) start: Instant,
    pub(super) disk0: u64,
    pub(super) n_tokens: usize,
    pub(super) n_out: u32,
    /// The groups of the step, in order, with their shapes.
    pub(super) order: Vec<(u32, crate::model::GroupKind, crate::graph::StepShape)>,
    /// The groups the host CPU computes (hybrid decode).
    pub(super) on_cpu: Vec<bool>,
    /// The step's last group the CPU takes part in.
    pub(super) last_cpu: Option<usize>,
    /// The stages of a step run in two halves of rows (`halves.rs`).
    pub(super) halves: Option<Vec<crate::paging::halves::Stage>>,
    /// What the step's inputs are written from, once every part began
    /// (`Engine::write_chain_inputs`).
    pub(super) inputs: Option<StepInputs>,
}

/// A begun step's inputs, as `Engine::prepare_part` worked them out.
pub(super) struct StepInputs {
    /// The tokens' (sequence, position).
    pub(super) sp: Vec<(u32, i32)>,
    /// The cells the masks span.
    pub(super) n_kv: usize,
    /// The rows that want logits.
    pub(super) out_ids: Vec<i32>,
}

/// What a load measured for its plan (`planning::plan`): the row split's other
/// devices plan with the first one's.
#[derive(Clone)]
pub(super) struct Probes {
    pub(super) copy_bw: f64,
    pub(super) compute: Option<crate::paging::ComputeRate>,
    pub(super) cpu: Option<crate::paging::CpuInput>,
    /// Each group's CPU cost against the probe's mean
    /// (`paging::Experts::cpu_scale`; empty: none measured).
    pub(super) cpu_scales: Vec<[f64; 2]>,
}

pub struct Engine {
    pub spec: ModelSpec,
    /// Where the weights, the KV cache and the CPU's copies live.
    pub plan: MemoryPlan,
    pub(super) lim: Limits,
    pub(super) device: Device,
    // field order is drop order: graphs before the buffers they point into
    /// Group and head graphs, and the activation buffer they share.
    pub(super) templates: TemplateCache,
    pub(super) pager: Pager,
    /// The residual's hops around whole host groups by kernels (`hops`),
    /// where the host's residual is in the GPU's pinned host memory.
    pub(super) hops: Option<super::hops::Hops>,
    pub(super) host: Option<host::HostCompute>,
    /// The host's rows of expert-split steps, where the plan splits.
    pub(super) split: Option<super::buffers::SplitRows>,
    /// The row split's first device: a buffer per other device, where its
    /// outputs land to be added (`rows.rs`).
    pub(super) reduce: Vec<super::buffers::SplitRows>,
    /// The row split over two devices: how this device cuts big steps in
    /// halves of rows (`rows.rs`), where it does.
    pub(super) halves: Option<super::exchange::Halves>,
    /// A hybrid step's halves of rows (`halves.rs`), where asked for.
    pub(super) cpu_halves: Option<super::halfrows::CpuHalves>,
    /// The way the host's rows go back up after a host group, made at
    /// the first such hop on a GPU (`halfrows::RowsUp`).
    pub(super) rows_up: Option<super::halfrows::RowsUp>,
    /// How a step's inputs go up on a GPU (`inputsup`); None: copied from
    /// `staging`.
    pub(super) inputs_up: Option<super::inputsup::InputsUp>,
    /// Hot experts on the device (`paging::experts`), where the plan keeps
    /// any.
    pub(super) hot: Option<super::hotpool::HotPool>,
    /// The next host layer's predicted experts, uploaded ahead
    /// (`paging::lookahead`), where asked for.
    pub(super) ahead: Option<super::aheadslots::LookAhead>,
    pub(super) backend: Backend,
    pub(super) store: WeightStore,
    pub(super) persistent: Persistent,
    /// Cells, resident KV tensors and the tier of windowed layers.
    pub(super) kv: KvCache,
    pub(super) file: ModelFile,
    /// Host memory a step's embedding rows and masks are written into.
    pub(super) staging: super::buffers::Staging,
    pub last_step: StepStats,
    /// The timeline switch, shared with the pager.
    pub(super) rec: timeline::Recorder,
    /// The budgets chosen because none was given, described.
    pub auto_budgets: Vec<String>,
    /// The device memory held against the GPU budget (`step.rs` warns
    /// once past it); None on the CPU or without a budget.
    pub(super) budget_watch: Option<crate::paging::BudgetWatch>,
    /// The host CPU's speed in hybrid steps against its probe's.
    pub(super) cpu_cal: Option<crate::paging::CpuCalibration>,
    /// The CPU's thread count, step by step (`EngineConfig::tune_threads`).
    pub(super) threads: Option<super::threads::ThreadTuner>,
    /// The experts the router picked: in the layers the host CPU
    /// computes (hybrid decode, always on a mixture), and in every layer
    /// with `EngineConfig::expert_stats`.
    pub(super) routing: Option<crate::paging::routing::RouterCounts>,
    /// Whether the device's mixture layers are counted too
    /// (`EngineConfig::expert_stats`: the device waits for each).
    pub(super) count_device: bool,
    /// Routed uploads of streamed mixture groups (`routed.rs`); None on
    /// a dense model.
    pub(super) routed: Option<crate::paging::routed::RoutedSteps>,
    /// The next device's part of the model, where it is split across
    /// devices (`Engine::load`): it takes this part's residual stream and
    /// computes the layers after it. Its KV cells mirror this part's.
    pub(super) next: Option<Box<Engine>>,
    /// A step begun on this part and not yet finished (`step.rs`).
    pub(super) pending: Option<Pending>,
    /// The rates its plan was made from (`load.rs`).
    pub(super) probes: Probes,
}

impl Engine {
    /// The device of this part (the first, for a model split across
    /// devices; [`Engine::parts`] lists them all).
    pub fn device(&self) -> Device {
        self.device
    }
    /// This engine and the parts after it on other devices, in layer order
    /// (one for a model on one device).
    pub fn parts(&self) -> impl Iterator<Item = &Engine> {
        std::iter::successors(Some(self), |e| e.next.as_deref())
    }
    /// The part after this one, on the next device (None: this part ends
    /// with the head).
    pub fn next_part(&self) -> Option<&Engine> {
        self.next.as_deref()
    }
    /// The file's layers this part computes.
    pub fn layers(&self) -> std::ops::Range<u32> {
        self.spec.hp.layer0..self.spec.hp.layer0 + self.spec.hp.n_layer
    }
    /// Stops the warning given when the device holds more than the GPU
    /// budget (`Engine::watch_budget`), in every part. The watch reads the
    /// device's free memory, so it counts whatever else the process puts
    /// on the device as the engine's: for a process that does so on
    /// purpose (`strata check`: llama.cpp's reference and a second engine
    /// on the same GPU).
    pub fn stop_budget_watch(&mut self) {
        let mut part = Some(self);
        while let Some(e) = part {
            e.budget_watch = None;
            part = e.next.as_deref_mut();
        }
    }
    /// Sets ggml's process-wide kernel switch to this engine's plan (see
    /// `paging::gemm`), after something else in the process ran with
    /// ggml's own choice (llama.cpp as a reference,
    /// [`reset_matmul_path`](super::reset_matmul_path)).
    pub fn apply_matmul_path(&self) {
        if !self.device.is_cpu() {
            self.device
                .set_mmq_max_rows(self.plan.gemm.map(|g| g.mmq_max_rows));
        }
    }
    pub fn n_ctx(&self) -> u32 {
        self.lim.n_ctx
    }
    pub fn n_batch(&self) -> u32 {
        self.lim.n_batch
    }
    pub fn n_vocab(&self) -> u32 {
        self.spec.hp.n_vocab
    }
    pub fn store(&self) -> &WeightStore {
        &self.store
    }
    /// Bytes of weights held, resident and pinned, over every part.
    pub fn weight_bytes(&self) -> u64 {
        self.parts()
            .map(|e| e.store.resident_bytes + e.store.pinned_bytes)
            .sum()
    }
    /// Device bytes of the KV cache and the persistent tensors.
    pub fn fixed_device_bytes(&self) -> u64 {
        self.kv.resident_bytes()
            + self.persistent.bytes
            + self.split.as_ref().map_or(0, |s| s.bytes())
    }

    /// Device bytes this engine holds or will allocate: resident weights,
    /// KV, persistent tensors and the activation estimate the plan uses
    /// (what a resident draft model takes from the target's GPU budget).
    pub fn device_footprint(&self) -> u64 {
        self.store.resident_bytes + self.fixed_device_bytes() + self.activation_reserve()
    }

    /// Device bytes the plan reserves for activations: the largest step's
    /// graphs (see [`crate::paging::sizes::activation_bytes`]).
    pub fn activation_reserve(&self) -> u64 {
        self.plan.activation_bytes
    }

    /// One line on where the weights live (a clause per device where the
    /// model is split across devices).
    pub fn placement_summary(&self) -> String {
        if self.next.is_none() {
            return self.part_summary();
        }
        self.parts()
            .map(|e| {
                format!(
                    "{} on {}: {}",
                    e.part_label(),
                    e.device.name(),
                    e.part_summary()
                )
            })
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// What this part of a model split across devices computes: a range of
    /// layers, or in the row split a share of every layer's rows.
    pub fn part_label(&self) -> String {
        let hp = &self.spec.hp;
        match self.spec.shard {
            Some(s) => format!(
                "rows {}/{} ({} KV heads, {} FFN columns of every layer)",
                s.index + 1,
                s.count,
                hp.n_head_kv,
                hp.n_ff
            ),
            None => {
                let r = self.layers();
                format!("layers {}..{}", r.start, r.end)
            }
        }
    }

    /// The model's layers (a model split across devices counted once).
    pub fn n_layers(&self) -> u32 {
        match self.spec.shard {
            Some(_) => self.spec.hp.n_layer,
            None => self.parts().map(|p| p.spec.hp.n_layer).sum(),
        }
    }

    fn part_summary(&self) -> String {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        let hot = match &self.hot {
            None => String::new(),
            Some(h) => format!(
                "; hot experts: {} in {} layers on the device ({:.1} MiB{})",
                h.plan.n_experts(),
                h.plan.n_groups(),
                mib(h.bytes()),
                h.plan.expected_hit.map_or(String::new(), |x| format!(
                    ", {:.1}% of their layers' counted picks",
                    100.0 * x
                ))
            ),
        };
        let widened = match self.halves.as_ref().and_then(|h| h.widening.as_ref()) {
            None => String::new(),
            Some(w) => format!(
                "; halved steps whose halves have {} rows or more widen each group once ({:.1} MiB of BF16)",
                w.plan.min_half_rows,
                mib(w.plan.bytes)
            ),
        };
        let kv = hot
            + &widened
            + &match self.kv.tier() {
            None => String::new(),
            Some(t) => format!(
                "; KV of {} layers on the device, {} windowed ({} windows, {} frames of {} cells in {:.1} MiB of {} host memory)",
                self.kv.resident_layers(),
                t.layers.len(),
                t.windows(),
                t.frames(),
                t.block(),
                mib(t.host_bytes()),
                if t.host_pinned { "pinned" } else { "PAGEABLE" }
            ),
        };
        if self.plan.placement.n_streamed() == 0 {
            return format!(
                "{:.1} MiB of weights resident{kv}",
                mib(self.store.resident_bytes)
            );
        }
        format!(
            "{:.1} MiB resident, {} of {} groups streamed through {}+{} slots from {:.1} MiB of {} host memory",
            mib(self.store.resident_bytes),
            self.plan.placement.n_streamed(),
            self.plan.placement.resident.len(),
            self.plan.placement.slots.0,
            self.plan.placement.slots.1,
            mib(self.store.pinned_bytes),
            if self.device.is_cpu() {
                "plain"
            } else if self.store.pinned_is_pinned {
                "pinned"
            } else {
                "PAGEABLE"
            }
        ) + &kv
    }

    /// Lets this engine's CPU threads sleep until its next step, so another
    /// engine (a draft model) gets the cores. See [`Backend::park_threads`].
    pub fn park_threads(&self) {
        self.backend.park_threads();
        if let Some(h) = &self.host {
            h.park_threads();
        }
    }

    /// Starts recording a timeline of copies and computations.
    pub fn start_timeline(&mut self) {
        let t0 = Instant::now();
        for (i, e) in self.parts().enumerate() {
            e.rec.start_part(e.device, i, t0);
        }
    }
    /// Adds a host-timed span (e.g. the draft model's turn) to the timeline
    /// being recorded, if any.
    pub fn record_host_span(
        &self,
        stream: timeline::Stream,
        name: &str,
        start: Instant,
        end: Instant,
    ) {
        self.rec.host_span(stream, || name.to_string(), start, end);
    }
    /// Stops recording and returns the spans recorded.
    pub fn finish_timeline(&mut self) -> Vec<timeline::Span> {
        let mut v = Vec::new();
        for e in self.parts() {
            e.pager_sync();
            v.extend(e.rec.finish());
        }
        v.sort_by(|a, b| a.start.total_cmp(&b.start));
        v
    }

    /// The KV cache: its cells, resident layers and tier.
    pub fn kv(&self) -> &KvCache {
        &self.kv
    }
    /// Frees the KV cells of a sequence, in every tier.
    pub fn clear_seq(&mut self, seq: u32) {
        // frames may be the target of copies still in flight
        self.pager_sync();
        self.kv.remove_seq(seq);
        if let Some(n) = self.next.as_deref_mut() {
            n.clear_seq(seq);
        }
    }
    /// Frees every KV cell, in every tier.
    pub fn clear(&mut self) {
        self.pager_sync();
        self.kv.clear();
        if let Some(n) = self.next.as_deref_mut() {
            n.clear();
        }
    }
    /// Frees KV cells of sequence `seq` at positions >= `from`, in every
    /// tier (rejected drafts, a shortened history).
    pub fn truncate_seq(&mut self, seq: u32, from: i32) {
        self.pager_sync();
        self.kv.truncate(seq, from);
        if let Some(n) = self.next.as_deref_mut() {
            n.truncate_seq(seq, from);
        }
    }
    /// Frees sequence `seq`'s hold on `cells`: the rejected nodes of a
    /// token tree ([`Engine::decode_tree`]), in every tier and part.
    pub fn drop_cells(&mut self, seq: u32, cells: &[u32]) {
        self.pager_sync();
        self.kv.drop_cells(seq, cells);
        if let Some(n) = self.next.as_deref_mut() {
            n.drop_cells(seq, cells);
        }
    }
    /// Shares the cells of `src` at positions `[p0, p1)` with `dst`, which
    /// must hold no cells yet: a cached prefix, reused without recomputing
    /// or copying it.
    pub fn copy_seq(&mut self, src: u32, dst: u32, p0: i32, p1: i32) -> Result<(), EngineError> {
        // checked on every part before any changes
        if let Some(n) = self.next.as_deref_mut() {
            n.copy_seq(src, dst, p0, p1)?;
        }
        Ok(self.kv.copy_seq(src, dst, p0, p1)?)
    }
    /// Drains the compute and copy streams.
    pub(super) fn pager_sync(&self) {
        self.backend.synchronize();
        self.pager.synchronize();
    }

    /// Benchmark aid: sequence `seq` holds positions 0..n afterwards, as if
    /// a prompt of n tokens had been run, without computing anything. The
    /// cached rows are whatever the memory held (finite: caches start
    /// zeroed), so only timings after it mean anything.
    pub fn fill_synthetic(&mut self, seq: u32, n: u32) -> Result<(), EngineError> {
        if n > self.lim.n_ctx {
            return Err(EngineError::BadPos {
                seq,
                pos: n as i32 - 1,
                n_ctx: self.lim.n_ctx,
            });
        }
        self.pager_sync();
        let before = self.kv.snapshot();
        let sp: Vec<(u32, i32)> = (0..n as i32).map(|p| (seq, p)).collect();
        let cells = self.kv.place(&sp)?;
        if let Err(e) = self.kv.prepare(&before, &cells, 1 << seq, None) {
            self.kv.restore(before);
            return Err(e);
        }
        if let Some(next) = self.next.as_deref_mut() {
            if let Err(e) = next.fill_synthetic(seq, n) {
                self.kv.restore(before);
                return Err(e);
            }
        }
        Ok(())
    }

    /// The tiered KV cache of windowed layers, if any layer is windowed.
    pub fn kv_tier(&self) -> Option<&KvTier> {
        self.kv.tier()
    }
    /// Layers whose KV stays on the device.
    pub fn kv_resident_layers(&self) -> usize {
        self.kv.resident_layers()
    }

    /// Device bytes the activation buffer holds now (it grows to the
    /// largest graph run so far; the plan reserves
    /// [`MemoryPlan::activation_bytes`] for it).
    pub fn activation_bytes(&self) -> u64 {
        self.templates.activation_bytes()
    }

    /// Host-to-device copy bandwidth of this engine's device (bytes/s).
    pub fn measure_h2d(&self, bytes: usize, reps: usize) -> Result<f64, EngineError> {
        measure_h2d(self.device, bytes, reps)
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // copies and computations still queued read or write buffers that
        // the fields below free
        self.pager_sync();
    }
}

/// One device's part of a split model, handed to a thread of its own for
/// work that touches that part alone (its host share of a row-split
/// group, its step inputs).
pub(super) struct Share<'a>(pub(super) &'a mut Engine);

// SAFETY: a `Share` moves to one scoped thread, which alone touches that
// engine until the scope ends (the step's thread waits at its end). An
// engine shares no handle with another: its CPU backend, thread pool,
// device backend, recorder and buffers are its own, and ggml's device
// calls set their device per call.
unsafe impl Send for Share<'_> {}

/// Runs `f` on each part at once, a scoped thread each (on this thread
/// where there is one part or none); the first error is returned once
/// every thread ended.
pub(super) fn on_each_at_once<F>(parts: Vec<Share<'_>>, f: F) -> Result<(), EngineError>
where
    F: Fn(Share<'_>) -> Result<(), EngineError> + Sync,
{
    if parts.len() <= 1 {
        return parts.into_iter().try_for_each(f);
    }
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = parts.into_iter().map(|sh| s.spawn(move || f(sh))).collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a part's thread panicked"))
            .collect::<Result<Vec<()>, EngineError>>()
            .map(|_| ())
    })
}

impl Engine {
    /// Runs `f` on this part and the parts after it (the chain of a model
    /// split across devices) as a list; the chain is put back together
    /// whatever `f` returns.
    pub(super) fn with_chain<R>(
        &mut self,
        f: impl FnOnce(&mut Engine, &mut [Box<Engine>]) -> R,
    ) -> R {
        let mut others: Vec<Box<Engine>> = Vec::new();
        let mut n = self.next.take();
        while let Some(mut e) = n {
            n = e.next.take();
            others.push(e);
        }
        let r = f(self, &mut others);
        let mut next = None;
        while let Some(mut e) = others.pop() {
            e.next = next;
            next = Some(e);
        }
        self.next = next;
        r
    }
}
