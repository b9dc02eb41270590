//! The forward step: tokens in, logits out, one group graph at a time.
//!
//! A step embeds its tokens on the host (ggml's own dequantizer, identical to
//! `get_rows`) into the persistent residual stream, then for every layer
//! runs the attention template bound to that layer's weights and KV cache,
//! then the FFN template, and finally the output head on the rows that want
//! logits. Groups the placement keeps resident are bound in place; streamed
//! groups are bound to the slot the pager filled (see `pager`). Templates are
//! cached by (kind, tensor types, shape) and share one activation allocator
//! per kind.

mod buffers;
mod cpuweights;
mod error;
pub mod host;
mod kvcache;
pub mod kvtier;
mod model_file;
mod pager;
mod session;
mod store;
pub mod timeline;
mod window;

pub use error::EngineError;
pub use kvcache::KvCache;
pub use model_file::ModelFile;
pub use pager::PagerStats;
pub use store::{GroupLayout, Location, WeightStore};

use crate::ggml::{self, Backend, Device, GgmlError, GraphAllocator};
use crate::gguf::GgufFile;
use crate::graph::{BindId, Binding, Dims, Limits, StepShape, Template, TemplateKey, HEAD_ROWS};
use crate::kv::KvCells;
use crate::model::{GroupId, GroupKind, ModelSpec};
pub use crate::paging::Budgets;
use crate::paging::Ring;
use crate::paging::{GroupInfo, KvShape, MemoryInput, MemoryPlan, Plan};
use buffers::{KvStore, Persistent};
use kvtier::{KvStats, KvTier, KvTierConfig};
use pager::Pager;
use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

/// Whether the host CPU computes some streamed groups (hybrid decode).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hybrid {
    /// When the plan predicts it pays (a GPU streaming weights).
    Auto,
    Off,
    /// Exactly this many groups at every step size the CPU takes part in,
    /// whatever the prediction; on the CPU device too, where a second CPU
    /// backend stands in for the host (tests, benchmarks).
    Force(usize),
}

/// Which device computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceChoice {
    Cpu,
    /// The first GPU; an error if none is loaded.
    Gpu,
    /// The GPU if present, else the CPU.
    Auto,
}

#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub n_ctx: u32,
    pub n_batch: u32,
    pub n_threads: usize,
    /// CPU thread pool polling level, 0-100 (llama.cpp's --poll).
    pub poll: u32,
    pub device: DeviceChoice,
    pub progress: bool,
    /// What strata may use of GPU and host memory, for weights and KV
    /// (the memory plan decides the rest; see [`crate::paging::memory_plan`]).
    pub budgets: Budgets,
    /// How layer groups may be placed.
    pub paging: PagingOptions,
    /// The KV tier of layers whose KV is windowed.
    pub kv_tier: KvTierOptions,
    /// CPU weights in the CPU's repacked buffer types (llama.cpp's
    /// default; its --no-repack turns it off).
    pub repack: bool,
    /// Batch-invariant numerics on the CPU: ggml's reference kernels and
    /// plain weights, so a sequence's logits do not depend on what it is
    /// batched with (slower; the server's --batch-invariant).
    pub batch_invariant: bool,
    /// Debug switches for tests.
    pub faults: Faults,
}

/// How layer groups may be placed.
#[derive(Clone, Debug)]
pub struct PagingOptions {
    /// Slots per group kind when streaming (>= 2).
    pub slots: usize,
    /// Stream every layer group whatever the budget (tests, benchmarks).
    pub stream_all: bool,
    /// Whether the host CPU computes some streamed groups.
    pub hybrid: Hybrid,
    /// Most rows an FFN graph computes at once; None: all of a step's where
    /// the model fits the GPU budget whole, else as few as keep the FFN's
    /// activations within the attention's (see `buffers::ffn_rows`).
    pub ffn_rows: Option<u32>,
}

impl Default for PagingOptions {
    fn default() -> Self {
        PagingOptions {
            slots: 3,
            stream_all: false,
            hybrid: Hybrid::Auto,
            ffn_rows: None,
        }
    }
}

/// The KV tier of windowed layers.
#[derive(Clone, Debug)]
pub struct KvTierOptions {
    /// Cells per KV block (the unit moved between tiers).
    pub block: usize,
    /// Where KV spill files go (a private directory is made inside).
    pub spill_dir: Option<std::path::PathBuf>,
    /// Most bytes the KV spill files may take.
    pub spill_max: Option<u64>,
}

impl Default for KvTierOptions {
    fn default() -> Self {
        KvTierOptions {
            block: 256,
            spill_dir: None,
            spill_max: None,
        }
    }
}

/// Debug switches for tests.
#[derive(Clone, Debug, Default)]
pub struct Faults {
    /// Fill each slot with NaN once its reader finished, so a read before
    /// its next upload completed shows as NaN logits.
    pub poison_slots: bool,
    /// Computations do not wait for their upload (a deliberate bug).
    pub skip_load_wait: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            n_ctx: 4096,
            n_batch: 512,
            n_threads: default_threads(),
            poll: 50,
            device: DeviceChoice::Auto,
            progress: false,
            budgets: Budgets::default(),
            paging: PagingOptions::default(),
            kv_tier: KvTierOptions::default(),
            repack: true,
            batch_invariant: false,
            faults: Faults::default(),
        }
    }
}

/// One token of a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchToken {
    pub token: u32,
    pub pos: i32,
    pub seq: u32,
    /// Whether logits are wanted for this token.
    pub logits: bool,
}

/// What the last step did.
#[derive(Clone, Copy, Debug, Default)]
pub struct StepStats {
    pub n_tokens: usize,
    pub seconds: f64,
    pub pager: PagerStats,
    /// Bytes the DRAM window read from the model file during the step.
    pub disk_bytes: u64,
    /// KV traffic of windowed layers during the step.
    pub kv: KvStats,
    /// What the host CPU computed (hybrid decode).
    pub host: host::HostStats,
}

pub struct Engine {
    pub spec: ModelSpec,
    /// Where the weights, the KV cache and the CPU's copies live.
    pub plan: MemoryPlan,
    dims: Dims,
    lim: Limits,
    device: Device,
    // field order is drop order: graphs before the buffers they point into
    templates: HashMap<TemplateKey, Template>,
    /// The activation buffer every group graph and the head share.
    activations: Option<(GraphAllocator, usize)>,
    pager: Pager,
    host: Option<host::HostCompute>,
    backend: Backend,
    store: WeightStore,
    persistent: Persistent,
    /// Cells, resident KV tensors and the tier of windowed layers.
    kv: KvCache,
    file: ModelFile,
    embd: Vec<f32>,
    mask: Vec<u16>,
    pub last_step: StepStats,
    /// The timeline switch, shared with the pager.
    rec: timeline::Recorder,
    /// The budgets chosen because none was given, described.
    pub auto_budgets: Vec<String>,
    /// The host CPU's speed in hybrid steps against its probe's.
    cpu_cal: Option<crate::paging::CpuCalibration>,
}

impl Engine {
    pub fn load(path: &Path, cfg: &EngineConfig) -> Result<Engine, EngineError> {
        let gguf = GgufFile::open(path)?;
        let spec = ModelSpec::from_gguf(&gguf)?;
        let file = ModelFile::open(path)?;
        let device = match cfg.device {
            DeviceChoice::Cpu => ggml::cpu_device()?,
            DeviceChoice::Gpu => ggml::gpu_device()?.ok_or(GgmlError::NoDevice("GPU"))?,
            DeviceChoice::Auto => match ggml::gpu_device()? {
                Some(d) => d,
                None => ggml::cpu_device()?,
            },
        };
        // budgets not given: what the machine has free, less a margin
        let mut budgets = Vec::new();
        let auto_gpu = (cfg.budgets.gpu.is_none() && !device.is_cpu()).then(|| {
            let (free, total) = device.memory();
            let b = crate::paging::auto_gpu_budget(free as u64, total as u64);
            budgets.push(format!(
                "GPU budget {} (free {} less a margin)",
                gib(b),
                gib(free as u64)
            ));
            b
        });
        let auto_dram = match cfg.budgets.dram {
            Some(_) => None,
            None => crate::paging::mem_available().map(|avail| {
                let b = crate::paging::auto_dram_budget(avail);
                budgets.push(format!(
                    "DRAM budget {} (available {} less a margin)",
                    gib(b),
                    gib(avail)
                ));
                b
            }),
        };
        let cfg = &EngineConfig {
            // batch invariance needs the plain layout: repacked kernels
            // pick gemv or gemm by batch size
            repack: cfg.repack && !cfg.batch_invariant,
            budgets: Budgets {
                gpu: cfg.budgets.gpu.or(auto_gpu),
                dram: cfg.budgets.dram.or(auto_dram),
                ..cfg.budgets
            },
            ..cfg.clone()
        };
        let mut backend = device.init_backend()?;
        backend.set_n_threads(cfg.n_threads);
        backend.attach_cpu_threadpool(cfg.n_threads, cfg.poll)?;
        if cfg.batch_invariant && !backend.set_use_ref(true) {
            return Err(EngineError::Unsupported(
                "batch-invariant numerics need the CPU device (GPU kernels depend on the batch size)",
            ));
        }
        // KV cells in multiples of 256, as llama.cpp pads them: attention
        // reads n_kv cells padded to 256 (see KvCells::n_kv)
        let n_ctx = cfg
            .n_ctx
            .max(1)
            .div_ceil(256)
            .checked_mul(256)
            .filter(|&c| c <= 1 << 24)
            .ok_or(EngineError::BadContext(cfg.n_ctx))?;
        let dims = Dims {
            arch: spec.arch,
            hp: spec.hp.clone(),
            has_rope_freqs: spec.rope_freqs.is_some(),
        };
        let n_batch = cfg.n_batch.clamp(1, n_ctx);
        let mut lim = Limits {
            n_batch,
            n_ctx,
            ffn_rows: n_batch,
        };

        let layouts = store::layouts(&spec, device)?;
        let head_bytes = spec.output.size
            + spec.output_norm.size
            + spec.rope_freqs.as_ref().map_or(0, |w| w.size);
        let persistent_bytes =
            lim.n_batch as u64 * (dims.hp.n_embd as u64 * 4 + 16 + lim.n_ctx as u64 * 2);
        // the reserve for whole steps and for FFN chunks (the plan picks)
        let forced = cfg.paging.ffn_rows.map(|r| r.clamp(1, n_batch));
        let ffn_rows = forced.unwrap_or_else(|| buffers::ffn_rows(&dims, n_batch));
        let chunked = buffers::activation_estimate(&dims, Limits { ffn_rows, ..lim });
        let activations = crate::paging::Activations {
            whole: match forced {
                Some(_) => chunked,
                None => buffers::activation_estimate(&dims, lim),
            },
            chunked,
            ffn_rows,
        };
        let n_layer = dims.hp.n_layer as usize;
        let kv_block = cfg.kv_tier.block.clamp(1, n_ctx as usize);
        let mut input = MemoryInput {
            groups: spec
                .groups
                .iter()
                .zip(&layouts)
                .map(|(g, l)| GroupInfo {
                    kind: g.kind,
                    bytes: l.bytes as u64,
                })
                .collect(),
            fixed_bytes: head_bytes + persistent_bytes,
            activations,
            kv: KvShape {
                n_layer,
                layer_bytes: KvStore::bytes_per_layer(&dims, lim),
                n_blocks: (n_ctx as usize).div_ceil(kv_block),
                block_bytes: (2 * kv_block * dims.hp.n_embd_kv() as usize * 2) as u64,
            },
            budgets: cfg.budgets,
            host_available: crate::paging::mem_available().unwrap_or(0),
            slots: cfg.paging.slots,
            stream_all: cfg.paging.stream_all,
            // measured: a quick pinned copy on a second stream (GPU)
            copy_bw: if device.is_cpu() || cfg.budgets.gpu.is_none() && !cfg.paging.stream_all {
                10e9
            } else {
                measure_h2d(device, 64 << 20, 4)?
            },
            cpu: None,
        };
        let mut plan = crate::paging::memory_plan(&input)?;
        let mut cpu_cal = None;
        if let Some(c) = cpu_input(&spec, &plan.placement, input.copy_bw, device, &backend, cfg)? {
            input.cpu = Some(c.clone());
            plan = crate::paging::memory_plan(&input)?;
            cpu_cal = plan.placement.hybrid.is_some().then(|| {
                crate::paging::CpuCalibration::new(
                    c,
                    input.groups.clone(),
                    plan.placement.resident.iter().map(|r| !r).collect(),
                    plan.placement.slots,
                    input.copy_bw,
                )
            });
        }
        lim.ffn_rows = plan.ffn_rows.or(forced).unwrap_or(n_batch);
        let store = WeightStore::load(
            &spec,
            &file,
            path,
            device,
            &plan,
            layouts,
            cfg.repack,
            cfg.progress,
        )?;
        let host = match &plan.placement.hybrid {
            Some(h) => {
                let bar = store::progress(h.host_bytes, cfg.progress);
                let hb = crate::paging::HYBRID_MAX_TOKENS.min(lim.n_batch);
                let hl = Limits {
                    n_batch: hb,
                    n_ctx,
                    ffn_rows: hb,
                };
                let hc = host::HostCompute::new(
                    &spec,
                    &dims,
                    hl,
                    &h.host,
                    &file,
                    host_threads(device, cfg.n_threads),
                    cfg.poll,
                    cfg.repack,
                    &bar,
                )?;
                bar.finish_and_clear();
                Some(hc)
            }
            None => None,
        };
        let n_kv_resident = plan.kv.resident_layers;
        let tier = if n_kv_resident < n_layer {
            Some(KvTier::new(
                device,
                (n_kv_resident as u32..n_layer as u32).collect(),
                n_layer,
                dims.hp.n_embd_kv() as usize,
                n_ctx as usize,
                plan.kv.windows,
                kv_fingerprint(&spec),
                &KvTierConfig {
                    block: kv_block,
                    frames: plan.kv.frames,
                    spill_parent: cfg
                        .kv_tier
                        .spill_dir
                        .clone()
                        .unwrap_or_else(std::env::temp_dir),
                    spill_max: cfg.kv_tier.spill_max,
                },
            )?)
        } else {
            None
        };
        let rec = timeline::Recorder::default();
        let pager = Pager::new(
            device,
            &plan.placement,
            cfg.faults.poison_slots,
            cfg.faults.skip_load_wait,
            tier.is_some(),
            plan.kv.windows,
            rec.clone(),
        )?;
        let persistent = Persistent::alloc(&dims, lim, device)?;
        let mut kv = KvCache::new(
            KvCells::new(n_ctx as usize),
            KvStore::alloc(&dims, lim, device, n_kv_resident)?,
            tier,
        );
        // batch invariance: each sequence's cells in position order
        kv.set_ordered(cfg.batch_invariant);
        Ok(Engine {
            spec,
            plan,
            dims,
            lim,
            device,
            templates: HashMap::new(),
            activations: None,
            pager,
            host,
            backend,
            store,
            persistent,
            kv,
            file,
            embd: Vec::new(),
            mask: Vec::new(),
            last_step: StepStats::default(),
            rec,
            auto_budgets: budgets,
            cpu_cal,
        })
    }

    pub fn device(&self) -> Device {
        self.device
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
    pub fn weight_bytes(&self) -> u64 {
        self.store.resident_bytes + self.store.pinned_bytes
    }
    /// Device bytes of the KV cache and the persistent tensors.
    pub fn fixed_device_bytes(&self) -> u64 {
        self.kv.resident_bytes() + self.persistent.bytes
    }

    /// Device bytes this engine holds or will allocate: resident weights,
    /// KV, persistent tensors and the activation estimate the plan uses
    /// (what a resident draft model takes from the target's GPU budget).
    pub fn device_footprint(&self) -> u64 {
        self.store.resident_bytes + self.fixed_device_bytes() + self.activation_reserve()
    }

    /// Device bytes the plan reserves for activations: the largest step's
    /// graphs (see [`buffers::activation_estimate`]).
    pub fn activation_reserve(&self) -> u64 {
        self.plan.activation_bytes
    }

    /// One line on where the weights live.
    pub fn placement_summary(&self) -> String {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        let kv = match self.kv.tier() {
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
        self.rec.start(self.device);
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
        self.pager_sync();
        self.rec.finish()
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
    }
    /// Frees every KV cell, in every tier.
    pub fn clear(&mut self) {
        self.pager_sync();
        self.kv.clear();
    }
    /// Frees KV cells of sequence `seq` at positions >= `from`, in every
    /// tier (rejected drafts, a shortened history).
    pub fn truncate_seq(&mut self, seq: u32, from: i32) {
        self.pager_sync();
        self.kv.truncate(seq, from);
    }
    /// Shares the cells of `src` at positions `[p0, p1)` with `dst`, which
    /// must hold no cells yet: a cached prefix, reused without recomputing
    /// or copying it.
    pub fn copy_seq(&mut self, src: u32, dst: u32, p0: i32, p1: i32) -> Result<(), EngineError> {
        Ok(self.kv.copy_seq(src, dst, p0, p1)?)
    }
    /// Drains the compute and copy streams.
    fn pager_sync(&self) {
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
        if let Err(e) = self.kv.prepare(&before, &cells, 1 << seq) {
            self.kv.restore(before);
            return Err(e);
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

    fn ext_bindings(&self) -> Vec<Binding> {
        let mut b = self.persistent.bindings.clone();
        b.extend(self.store.rope_freqs);
        b
    }

    /// Runs `tokens` (split into steps of at most n_batch) and returns the
    /// logits of each token with `logits == true`, in order, n_vocab each.
    /// On error the KV cache holds what it held before the call.
    pub fn decode(&mut self, tokens: &[BatchToken]) -> Result<Vec<f32>, EngineError> {
        if tokens.is_empty() {
            return Err(EngineError::EmptyBatch);
        }
        let mut out = Vec::new();
        let before = (tokens.len() > self.lim.n_batch as usize).then(|| self.kv.snapshot());
        for chunk in tokens.chunks(self.lim.n_batch as usize) {
            if let Err(e) = self.step(chunk, &mut out) {
                // all or nothing: earlier steps' cells are given back too
                if let Some(b) = before {
                    self.pager_sync();
                    self.kv.restore(b);
                }
                return Err(e);
            }
        }
        Ok(out)
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
    fn step(&mut self, toks: &[BatchToken], out: &mut Vec<f32>) -> Result<(), EngineError> {
        self.validate(toks)?;
        // inputs and the KV tier's host frames are written below: nothing
        // may be in flight
        self.pager_sync();
        let before = self.kv.snapshot();
        let sp: Vec<(u32, i32)> = toks.iter().map(|t| (t.seq, t.pos)).collect();
        let cells = self.kv.place(&sp)?;
        let out_len = out.len();
        let r = self.run_step(toks, &cells, &before, out);
        if r.is_err() {
            self.pager_sync();
            self.pager.abort_step(self.kv.tier_mut());
            // the step's cells given back, and the frames of blocks that
            // are empty again
            self.kv.restore(before);
            out.truncate(out_len);
        }
        r
    }

    fn run_step(
        &mut self,
        toks: &[BatchToken],
        cells: &[u32],
        before: &KvCells,
        out: &mut Vec<f32>,
    ) -> Result<(), EngineError> {
        let start = Instant::now();
        let disk0 = self.store.disk_bytes_read();
        let n = toks.len() as u32;
        let sp: Vec<(u32, i32)> = toks.iter().map(|t| (t.seq, t.pos)).collect();
        let mask = toks.iter().fold(0u64, |m, t| m | 1 << t.seq);
        self.kv.prepare(before, cells, mask)?;
        let n_kv = self.kv.cells().n_kv() as u32;
        let out_ids: Vec<i32> = toks
            .iter()
            .enumerate()
            .filter(|(_, t)| t.logits)
            .map(|(i, _)| i as i32)
            .collect();
        let n_out = out_ids.len() as u32;

        // inputs: synchronous writes (both streams drained in `step`)
        self.embed(toks)?;
        let pos: Vec<i32> = toks.iter().map(|t| t.pos).collect();
        self.persistent.tensor(buffers::POS).set_i32(&pos)?;
        self.kv.fill_mask(&sp, n_kv as usize, &mut self.mask);
        self.persistent
            .tensor(buffers::MASK)
            .set_bytes(bytemuck::cast_slice(&self.mask), 0)?;
        let idx: Vec<i64> = cells.iter().map(|&c| c as i64).collect();
        self.persistent.tensor(buffers::KV_IDX).set_i64(&idx)?;
        if n_out > 0 {
            self.persistent.tensor(buffers::OUT_IDS).set_i32(&out_ids)?;
        }

        // the groups of this step, in order, with their shapes
        let n_layer = self.spec.hp.n_layer;
        let mut order: Vec<(u32, GroupKind, StepShape)> = Vec::with_capacity(2 * n_layer as usize);
        for l in 0..n_layer {
            let last = l + 1 == n_layer;
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
                },
            ));
        }
        // hybrid decode: the groups the CPU computes at this step size
        let on_cpu = match (&self.host, &self.plan.placement.hybrid) {
            (Some(_), Some(h)) => h.cpu_groups(n),
            _ => vec![false; self.spec.groups.len()],
        };
        if let Some(h) = self.host.as_mut() {
            h.stats = host::HostStats::default();
        }
        let gis: Vec<GroupId> = order
            .iter()
            .map(|(l, k, _)| GroupId::new(*l, *k))
            .filter(|gi| !on_cpu[gi.index()])
            .collect();
        let shapes: Vec<StepShape> = order.iter().map(|(_, _, s)| *s).collect();
        self.evict_templates(&shapes);
        self.pager.begin_step(&gis, &self.store, self.kv.tier())?;
        self.pager
            .prefetch_window(&self.store, &self.backend, self.kv.tier_mut())?;
        // rows of the residual stream on the host, while they are there
        let mut x_host: Option<u32> = None;
        // after the step's last CPU group its pool sleeps: spinning, it
        // would take the cores the thread driving the GPU and the driver's
        // own threads need (the H100 traces showed that thread losing a
        // 4 ms scheduler tick in most steps)
        let last_cpu = order
            .iter()
            .rposition(|(l, k, _)| on_cpu[GroupId::new(*l, *k).index()]);
        for (i, (l, kind, shape)) in order.into_iter().enumerate() {
            if on_cpu[GroupId::new(l, kind).index()] {
                self.run_host_group(l, kind, shape, &mut x_host)?;
                if Some(i) == last_cpu && !self.device.is_cpu() {
                    if let Some(h) = self.host.as_ref() {
                        h.park_threads();
                    }
                }
            } else {
                self.residual_to_device(&mut x_host)?;
                self.run_group(l, kind, shape)?;
            }
        }
        self.residual_to_device(&mut x_host)?;
        self.pager.end_step(self.kv.tier_mut())?;
        if n_out > 0 {
            self.run_head(n_out, out)?;
        }
        self.backend.synchronize();
        self.last_step = StepStats {
            n_tokens: toks.len(),
            seconds: start.elapsed().as_secs_f64(),
            pager: self.pager.stats,
            disk_bytes: self.store.disk_bytes_read() - disk0,
            kv: self.kv.tier().map(|k| k.step).unwrap_or_default(),
            host: self.host.as_ref().map(|h| h.stats).unwrap_or_default(),
        };
        self.calibrate_cpu(n);
        Ok(())
    }

    /// Hybrid decode: the factor on the probe's CPU time per byte that the
    /// steps so far showed, and the step of `n` tokens predicted with the
    /// CPU at that speed (the plan's own prediction uses the probe's).
    pub fn cpu_calibration(&self, n: u32) -> Option<(f64, f64)> {
        let (c, plan) = (self.cpu_cal.as_ref()?, self.plan.placement.hybrid.as_ref()?);
        (1..=crate::paging::HYBRID_MAX_TOKENS)
            .contains(&n)
            .then(|| (c.seen, c.predict(plan, n)))
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
                    c.predict_at(plan, n, c.seen, Some(bus_bw)),
                    c.probe.bus_bw_beside,
                )
            })
    }

    /// Tracks the host CPU's speed in hybrid steps against its probe's.
    fn calibrate_cpu(&mut self, n: u32) {
        let h = self.last_step.host;
        if let Some(cal) = self.cpu_cal.as_mut() {
            if h.groups > 0 {
                cal.observe(n, h.bytes, h.compute.as_secs_f64());
            }
        }
    }

    /// Host-side embedding of the step's tokens into x[:, :n].
    fn embed(&mut self, toks: &[BatchToken]) -> Result<(), EngineError> {
        let e = self.spec.hp.n_embd as usize;
        let w = &self.spec.tok_embd;
        let row = ggml::row_size(w.ty, e as i64);
        self.embd.resize(e * toks.len(), 0.0);
        let bytes = self.file.bytes(w);
        for (i, t) in toks.iter().enumerate() {
            let r = &bytes[t.token as usize * row..(t.token as usize + 1) * row];
            ggml::dequantize_row(w.ty, r, &mut self.embd[i * e..(i + 1) * e])?;
        }
        self.persistent
            .tensor(buffers::X)
            .set_bytes(bytemuck::cast_slice(&self.embd), 0)?;
        Ok(())
    }

    fn template(&mut self, key: &TemplateKey) -> Result<(), EngineError> {
        if !self.templates.contains_key(key) {
            let mut t = Template::build(key, &self.dims, self.lim)?;
            t.bind_externals(&self.ext_bindings());
            self.templates.insert(key.clone(), t);
        }
        if self.activations.is_none() {
            self.activations = Some((GraphAllocator::new(self.device.buffer_type())?, 0));
        }
        Ok(())
    }

    /// Allocates activations of `key`'s graph once. Every template shares
    /// one allocator buffer (the graphs run one after another on one
    /// stream, and what one hands the next lives in persistent tensors), so
    /// the device holds the largest graph's activations, not a sum; if the
    /// buffer had to grow, every other template points into freed memory
    /// and is dropped.
    fn ensure_allocated(&mut self, key: &TemplateKey) -> Result<(), EngineError> {
        if self.templates.get(key).is_some_and(|t| t.allocated) {
            return Ok(());
        }
        let (alloc, size) = self.activations.as_mut().expect("allocator exists");
        let t = self.templates.get_mut(key).expect("template exists");
        alloc.alloc(&t.graph())?;
        t.allocated = true;
        let new_size = alloc.buffer_size();
        let grew = new_size != *size;
        *size = new_size;
        if grew {
            tracing::debug!(
                "activations grew to {:.1} MiB ({key:?})",
                new_size as f64 / (1u64 << 20) as f64
            );
            // drained first: the old buffer may still be in use on the device
            self.backend.synchronize();
            let keep = key.clone();
            self.templates.retain(|k, _| *k == keep);
        }
        Ok(())
    }

    /// Device bytes the activation buffer holds now (it grows to the
    /// largest graph run so far; the plan reserves
    /// [`buffers::activation_estimate`] for it).
    pub fn activation_bytes(&self) -> u64 {
        self.activations.as_ref().map_or(0, |(_, s)| *s as u64)
    }

    /// Bounds the template cache: when it holds more than a few templates
    /// per group, drop those of shapes other than this step's.
    fn evict_templates(&mut self, shapes: &[StepShape]) {
        let cap = 4 * self.spec.groups.len() + 16;
        if self.templates.len() <= cap {
            return;
        }
        self.backend.synchronize();
        self.templates.retain(|k, _| match k {
            TemplateKey::Group { shape, .. } => shapes.contains(shape),
            TemplateKey::Head { .. } => true,
        });
    }

    /// A group's id and the key of its template for a step shape.
    fn group_key(&self, layer: u32, kind: GroupKind, shape: StepShape) -> (GroupId, TemplateKey) {
        let gi = GroupId::new(layer, kind);
        let key = TemplateKey::Group {
            kind,
            sig: self.spec.groups[gi.index()].signature(),
            shape,
            instance: gi.index() as u32,
        };
        (gi, key)
    }

    fn run_group(
        &mut self,
        layer: u32,
        kind: GroupKind,
        shape: StepShape,
    ) -> Result<(), EngineError> {
        let (gi, key) = self.group_key(layer, kind, shape);
        self.template(&key)?;
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
            Some(self.kv.bindings(layer, Some(w)))
        } else if kind == GroupKind::Attn {
            Some(self.kv.bindings(layer, None))
        } else {
            None
        };
        let streamed = match self.store.groups[gi.index()] {
            Location::Resident(ref b) => {
                let b = b.clone();
                let t = self.templates.get_mut(&key).expect("template exists");
                t.bind(id, &b, kv);
                None
            }
            Location::Streamed { ring, .. } => {
                let slot = self.pager.before_compute(
                    gi,
                    ring,
                    &self.store,
                    &self.backend,
                    self.kv.tier_mut(),
                )?;
                let b = self.store.slot_bindings(gi, ring, slot);
                let t = self.templates.get_mut(&key).expect("template exists");
                id.weight_slot = Some(slot);
                t.bind(id, &b, kv);
                Some(ring)
            }
        };
        // bound before allocating so the allocator sees weights as external
        self.ensure_allocated(&key)?;
        let t = self.templates.get(&key).expect("template exists");
        let rec = self.rec.scope(
            timeline::Stream::Compute,
            &self.backend,
            || format!("{} {layer}", kind.name()),
            0,
        );
        self.backend.compute_async(&t.graph())?;
        drop(rec);
        if let Some(ring) = streamed {
            self.pager
                .after_compute(gi, ring, &self.store, &self.backend, self.kv.tier_mut())?;
        }
        if windowed {
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
    fn run_host_group(
        &mut self,
        layer: u32,
        kind: GroupKind,
        shape: StepShape,
        x_host: &mut Option<u32>,
    ) -> Result<(), EngineError> {
        let (gi, key) = self.group_key(layer, kind, shape);
        let host = self.host.as_mut().expect("hybrid plan has a host");
        if x_host.is_none() {
            // the device's groups so far wrote the residual
            self.backend.synchronize();
            host.download(self.persistent.tensor(buffers::X), shape.n_tokens)?;
        }
        *x_host = Some(shape.n_tokens);
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
        self.rec.host_span(
            timeline::Stream::Cpu,
            || format!("{} {layer}", kind.name()),
            t0,
            Instant::now(),
        );
        Ok(())
    }

    /// Sends the residual rows the host computed back to the device.
    fn residual_to_device(&mut self, x_host: &mut Option<u32>) -> Result<(), EngineError> {
        if let (Some(rows), Some(host)) = (x_host.take(), self.host.as_mut()) {
            host.upload(self.persistent.tensor(buffers::X), rows)?;
        }
        Ok(())
    }

    /// Logits of the first `n_rows` rows of the residual stream, at most
    /// [`HEAD_ROWS`] rows per graph so the logits never need more
    /// activation memory than the plan reserved.
    fn run_head(&mut self, n_rows: u32, out: &mut Vec<f32>) -> Result<(), EngineError> {
        let n_vocab = self.spec.hp.n_vocab as usize;
        let start = out.len();
        out.resize(start + n_rows as usize * n_vocab, 0.0);
        for row0 in (0..n_rows).step_by(HEAD_ROWS as usize) {
            let rows = HEAD_ROWS.min(n_rows - row0);
            let key = TemplateKey::Head {
                out_ty: self.spec.output.ty,
                n_rows: rows,
                row0,
            };
            self.template(&key)?;
            let head = self.store.head.clone();
            self.templates.get_mut(&key).expect("template exists").bind(
                BindId::head(),
                &head,
                None,
            );
            self.ensure_allocated(&key)?;
            let t = self.templates.get(&key).expect("template exists");
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

/// Identifies the model a KV spill or session file belongs to: its
/// architecture, shapes and the first bytes of its token embeddings.
fn kv_fingerprint(spec: &ModelSpec) -> u64 {
    // FNV-1a: stable across builds, so a session file outlives the binary
    let text = format!(
        "{:?}|{:?}|{:?}|{}",
        spec.arch, spec.hp, spec.tok_embd.ty, spec.tok_embd.size
    );
    text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

impl Drop for Engine {
    fn drop(&mut self) {
        // copies and computations still queued read or write buffers that
        // the fields below free
        self.pager_sync();
    }
}

fn gib(b: u64) -> String {
    format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
}

/// What the planner needs to know about the host CPU, measured, when the
/// plan streams FFN groups the CPU could compute instead (see
/// `paging::hybrid`); None when hybrid decode is off or cannot apply.
fn cpu_input(
    spec: &ModelSpec,
    plan: &Plan,
    copy_bw: f64,
    device: Device,
    backend: &Backend,
    cfg: &EngineConfig,
) -> Result<Option<crate::paging::CpuInput>, EngineError> {
    let force = match cfg.paging.hybrid {
        Hybrid::Off => return Ok(None),
        Hybrid::Auto if device.is_cpu() => return Ok(None),
        Hybrid::Auto => None,
        Hybrid::Force(n) => Some(n),
    };
    let cand: Vec<usize> = (0..spec.groups.len())
        .filter(|&i| !plan.resident[i] && spec.groups[i].kind == GroupKind::Ffn)
        .collect();
    let Some(&first) = cand.first() else {
        return Ok(None);
    };
    // a representative matrix: the group's largest
    let w = spec.groups[first]
        .weights
        .iter()
        .max_by_key(|w| w.size)
        .expect("an FFN group has weights");
    let ne = [w.ne[0], w.ne[1]];
    // more than a server's last-level cache (up to 320 MB): a probe that
    // fits partly in it reads faster and meets less contention than the
    // model's weights will
    let probe_bytes = (2u64 << 30).min(cand.iter().map(|&i| spec.groups[i].bytes()).sum());
    let cpu = ggml::cpu_device()?;
    let mut cb = cpu.init_backend()?;
    let threads = host_threads(device, cfg.n_threads);
    cb.set_n_threads(threads);
    cb.attach_cpu_threadpool(threads, cfg.poll)?;
    let buft = if cfg.repack {
        host::cpu_weight_buft(cpu, w.ty, ne)
    } else {
        cpu.buffer_type()
    };
    const PROBE_TOKENS: u32 = 16;
    // measured while the bus uploads: DMA and CPU share the host's memory
    // bandwidth in a hybrid step (on the H100 machine the CPU read 93 GB/s
    // alone, 67 GB/s beside the copies)
    let bus = Some((device, copy_bw));
    let s1 = host::measure_matmul(&cb, buft, w.ty, ne, probe_bytes, 1, bus)?;
    let sn = host::measure_matmul(&cb, buft, w.ty, ne, probe_bytes, PROBE_TOKENS, bus)?;
    let gpu = host::measure_matmul(
        backend,
        device.buffer_type(),
        w.ty,
        ne,
        probe_bytes,
        1,
        None,
    )?;
    let bus_beside =
        host::measure_bus_beside_cpu(&cb, buft, w.ty, ne, probe_bytes, device, copy_bw)?;
    let hop = host::measure_hop(device, backend, spec.hp.n_embd as i64)?;
    let per_group = host::measure_group_overhead(device, backend, spec.hp.n_embd as i64)?;
    let c = crate::paging::CpuInput {
        s_per_byte_1: s1,
        s_per_byte_n: sn,
        probe_tokens: PROBE_TOKENS,
        // the memory plan decides the room
        host_room: 0,
        hop_s: hop,
        gpu_s_per_byte: gpu,
        gpu_group_s: per_group,
        bus_bw_beside: bus_beside,
        force,
    };
    tracing::info!(
        "hybrid probe: CPU {:.1} GB/s at 1 token, {:.1} GB/s at {PROBE_TOKENS}; device {:.1} GB/s, {:.0} us per group; hop {:.0} us; bus {:.1} GB/s alone, {:.1} beside the CPU",
        1e-9 / s1,
        1e-9 / sn,
        1e-9 / gpu,
        per_group * 1e6,
        hop * 1e6,
        copy_bw / 1e9,
        bus_beside.unwrap_or(copy_bw) / 1e9,
    );
    Ok(Some(c))
}

/// CPU threads by default: the physical cores (as llama.cpp: a second
/// hyperthread per core adds little to matrix work and contends for the
/// core), within the CPUs this process may run on.
pub fn default_threads() -> usize {
    let allowed = std::thread::available_parallelism().map_or(4, |n| n.get());
    let physical = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| physical_cores(&s));
    physical.map_or(allowed, |p| p.min(allowed)).max(1)
}

/// Distinct (physical id, core id) pairs in /proc/cpuinfo; None when the
/// file does not say (some virtual machines and architectures).
fn physical_cores(cpuinfo: &str) -> Option<usize> {
    let mut cores = std::collections::HashSet::new();
    for block in cpuinfo.split("\n\n") {
        let field = |name: &str| {
            block.lines().find_map(|l| {
                let (k, v) = l.split_once(':')?;
                (k.trim() == name).then(|| v.trim().to_string())
            })
        };
        if let (Some(p), Some(c)) = (field("physical id"), field("core id")) {
            cores.insert((p, c));
        }
    }
    (!cores.is_empty()).then_some(cores.len())
}

/// Threads of the host's CPU backend in hybrid decode: beside a GPU, all
/// cores but one, which the thread driving the GPU and its copies needs (on
/// the 16-core H100 machine, 16 threads decoded at 2.91 t/s and 15 at 3.98:
/// a pool thread sharing its core with the driver stalls every group).
fn host_threads(device: Device, n_threads: usize) -> usize {
    if device.is_cpu() {
        return n_threads;
    }
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    n_threads.min(cores.saturating_sub(1)).max(1)
}

/// Host memory available now (MemAvailable), or 0 where unknown.
impl Engine {
    /// Host-to-device copy bandwidth of this engine's device (bytes/s).
    pub fn measure_h2d(&self, bytes: usize, reps: usize) -> Result<f64, EngineError> {
        measure_h2d(self.device, bytes, reps)
    }
}

/// Measures host-to-device copy bandwidth (bytes/s) from pinned memory on a
/// separate backend instance, as the pager copies. On the CPU it measures a
/// plain memory copy.
pub fn measure_h2d(device: Device, bytes: usize, reps: usize) -> Result<f64, EngineError> {
    use crate::ggml::{Buffer, BufferUsage, Context};
    let host_buft = match device.host_buffer_type() {
        Some(h) if !device.is_cpu() => h,
        _ => device.buffer_type(),
    };
    let host = Buffer::alloc(host_buft, bytes, BufferUsage::Any)?;
    let dev = Buffer::alloc(device.buffer_type(), bytes, BufferUsage::Any)?;
    let ctx = Context::new(2, 0)?;
    let t = ctx.new_tensor(crate::dtype::GgmlType::I8, &[bytes as i64]);
    dev.place(t, 0)?;
    // SAFETY: the host buffer holds `bytes` bytes and outlives the copies,
    // which complete before `copy.synchronize()` returns.
    let src = unsafe { std::slice::from_raw_parts_mut(host.base(), bytes) };
    src.iter_mut().enumerate().for_each(|(i, b)| *b = i as u8);
    let copy = device.init_backend()?;
    // SAFETY: as above.
    unsafe { copy.tensor_set_async(t, src, 0) };
    copy.synchronize();
    let start = Instant::now();
    for _ in 0..reps {
        // SAFETY: as above.
        unsafe { copy.tensor_set_async(t, src, 0) };
    }
    copy.synchronize();
    Ok((bytes * reps) as f64 / start.elapsed().as_secs_f64())
}

#[cfg(test)]
mod default_threads_tests {
    use super::*;

    #[test]
    fn physical_cores_count_core_ids_not_hyperthreads() {
        let cpu =
            |p: u32, c: u32| format!("processor\t: x\nphysical id\t: {p}\ncore id\t\t: {c}\n");
        // two sockets, two cores each, two threads per core
        let info: Vec<String> = [
            (0, 0),
            (0, 0),
            (0, 1),
            (0, 1),
            (1, 0),
            (1, 0),
            (1, 1),
            (1, 1),
        ]
        .iter()
        .map(|&(p, c)| cpu(p, c))
        .collect();
        assert_eq!(physical_cores(&info.join("\n")), Some(4));
        assert_eq!(physical_cores("processor\t: 0\nmodel name\t: x\n"), None);
        assert!(default_threads() >= 1);
    }
}
