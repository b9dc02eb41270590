//! Building an engine: open the file, pick the device and budgets, measure
//! the machine, ask the memory plan where everything goes, and allocate
//! what it decided. Knows no architecture by name: the model's groups come
//! from [`ModelSpec`].

use super::batch::StepStats;
use super::buffers::KvStore;
use super::buffers::Persistent;
use super::config::host_threads;
use super::config::DeviceChoice;
use super::config::EngineConfig;
use super::error::EngineError;
use super::host;
use super::kvcache::kv_fingerprint;
use super::kvcache::KvCache;
use super::kvtier::KvTier;
use super::kvtier::KvTierConfig;
use super::model_file::ModelFile;
use super::pager::Pager;
use super::planning;
use super::planning::Planned;
use super::state::Engine;
use super::state::Probes;
use super::store;
use super::store::WeightStore;
use super::templates::TemplateCache;
use super::timeline;
use crate::ggml;
use crate::ggml::GgmlError;
use crate::gguf::GgufFile;
use crate::graph::Dims;
use crate::kv::KvCells;
use crate::model::ModelSpec;
use crate::paging::sizes;
use crate::paging::Budgets;
use crate::paging::Limits;
use std::path::Path;

/// How long reaching an RPC server may take.
const RPC_CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

impl Engine {
    /// Loads the model at `path` on the device(s) `cfg` chooses: on one
    /// device, or split into layer ranges over several (`paging::devices`),
    /// each a part with its own plan, chained by [`Engine::next`].
    pub fn load(path: &Path, cfg: &EngineConfig) -> Result<Engine, EngineError> {
        let gguf = GgufFile::open(path)?;
        let spec = ModelSpec::from_gguf(&gguf)?;
        // the servers' devices, in the order given
        let mut remote = Vec::new();
        for e in &cfg.rpc {
            remote.extend(ggml::rpc::add_server(e, RPC_CONNECT_TIMEOUT)?);
        }
        let devices = pick_devices(cfg, remote)?;
        if cfg.gpu_budgets.len() > 1 && cfg.gpu_budgets.len() != devices.len() {
            return Err(EngineError::BadDevices(format!(
                "{} GPU budgets for {} device{}: give one budget for all, or one per device",
                cfg.gpu_budgets.len(),
                devices.len(),
                if devices.len() == 1 { "" } else { "s" }
            )));
        }
        // each device's budget, where it was given
        let given: Vec<Option<u64>> = (0..devices.len())
            .map(|i| match cfg.gpu_budgets.len() {
                0 => cfg.budgets.gpu,
                1 => Some(cfg.gpu_budgets[0]),
                _ => Some(cfg.gpu_budgets[i]),
            })
            .collect();
        let part_cfg = |i: usize, budgets: Budgets| EngineConfig {
            budgets: Budgets {
                gpu: given[i],
                ..budgets
            },
            ..cfg.clone()
        };
        if devices.len() == 1 || devices[0].is_cpu() {
            return Self::load_part(
                path,
                &part_cfg(0, cfg.budgets),
                spec,
                devices[0],
                None,
                None,
            );
        }
        // every device's budget (what is free where none was given)
        let budgets: Vec<u64> = devices
            .iter()
            .zip(&given)
            .map(|(d, g)| {
                g.unwrap_or_else(|| {
                    let (free, total) = d.memory();
                    crate::paging::auto_gpu_budget(free as u64, total as u64)
                })
            })
            .collect();
        if cfg.split_mode == super::config::SplitMode::Row {
            return Self::load_rows(path, cfg, spec, &devices, &budgets);
        }
        // the layer ranges, from the budgets
        let n_ctx = sizes::kv_cells(cfg.n_ctx).ok_or(EngineError::BadContext(cfg.n_ctx))?;
        let kv_layer = sizes::kv_bytes(&spec.hp, n_ctx as u64);
        let layer_bytes: Vec<u64> = spec
            .groups
            .chunks(2)
            .map(|g| g.iter().map(|g| g.bytes()).sum::<u64>() + kv_layer)
            .collect();
        let head = spec.output.size + spec.output_norm.size;
        // remote devices: an RPC socket is too slow to stream over
        let slow: Vec<bool> = devices.iter().map(|d| d.is_remote()).collect();
        let ranges = crate::paging::split_layers(
            &layer_bytes,
            head,
            &budgets,
            &slow,
            cfg.devices.is_some(),
        )?;
        if ranges.len() > 1 {
            tracing::info!(
                "layers split across {} devices: {}",
                ranges.len(),
                ranges
                    .iter()
                    .zip(&devices)
                    .map(|(r, d)| format!("{}..{} on {}", r.start, r.end, d.name()))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
        // host budgets shared in proportion to each part's weights
        let weights: Vec<u64> = ranges
            .iter()
            .map(|r| layer_bytes[r.start as usize..r.end as usize].iter().sum())
            .collect();
        let host = host_budgets(&cfg.budgets, &weights);
        // each part lends the next GPU's bus (local GPUs only): that GPU
        // holds two FFN slots of staging for it, out of its budget
        let k = ranges.len();
        let relay =
            cfg.paging.relay && k > 1 && devices[..k].iter().all(|d| d.is_gpu() && !d.is_remote());
        let staging = if relay {
            store::layouts(&spec, devices[0])?
                .iter()
                .zip(&spec.groups)
                .filter(|(_, g)| g.kind == crate::model::GroupKind::Ffn)
                .map(|(l, _)| 2 * l.bytes as u64)
                .max()
                .unwrap_or(0)
        } else {
            0
        };
        let mut parts = Vec::with_capacity(k);
        for (i, r) in ranges.iter().enumerate() {
            let mut c = part_cfg(i, host[i]);
            // the staging this GPU holds for the part before it
            c.budgets.gpu = Some(budgets[i].saturating_sub(staging));
            parts.push(Self::load_part(
                path,
                &c,
                spec.part(r.clone()),
                devices[i],
                relay.then(|| devices[(i + 1) % k]),
                None,
            )?);
        }
        Ok(chain(parts).expect("split_layers places every layer"))
    }

    /// The row split: every device a share of every layer's heads and FFN
    /// columns (`paging::devices::split_rows`, in proportion to the
    /// budgets; `ModelSpec::shard`), each a part with its own plan,
    /// chained by [`Engine::next`] like the layer split's parts.
    fn load_rows(
        path: &Path,
        cfg: &EngineConfig,
        spec: ModelSpec,
        devices: &[ggml::Device],
        budgets: &[u64],
    ) -> Result<Engine, EngineError> {
        // the first device holds the head: the others leave its room, so
        // that devices of equal budgets plan alike (the same groups
        // resident, streamed and on the host CPU, whose shares of a group
        // then run at once)
        let head = spec.output.size + spec.output_norm.size;
        let room: Vec<u64> = budgets
            .iter()
            .map(|b| b.saturating_sub(head).max(1))
            .collect();
        let rs =
            crate::paging::split_rows(spec.hp.n_head_kv, spec.hp.n_ff, spec.ffn_align(), &room)?;
        let k = devices.len();
        tracing::info!(
            "every layer's rows split across {k} devices: {}",
            devices
                .iter()
                .zip(rs.kv.iter().zip(&rs.ff))
                .map(|(d, (kv, ff))| format!(
                    "KV heads {kv:?} and FFN columns {ff:?} on {}",
                    d.name()
                ))
                .collect::<Vec<_>>()
                .join(", ")
        );
        let host = host_budgets(&cfg.budgets, budgets);
        let mut parts = Vec::with_capacity(k);
        for (i, d) in devices.iter().enumerate() {
            let c = EngineConfig {
                budgets: Budgets {
                    gpu: Some(if i == 0 { budgets[i] } else { room[i] }),
                    ..host[i]
                },
                ..cfg.clone()
            };
            let shard = spec.shard(i as u32, k as u32, rs.kv[i].clone(), rs.ff[i].clone())?;
            // the first device's measurements for all: the same rates give
            // the same plan where the shares are alike
            let like = parts.first().map(|p: &Engine| p.probes.clone());
            parts.push(Self::load_part(path, &c, shard, *d, None, like)?);
        }
        Ok(chain(parts).expect("at least two devices"))
    }

    /// Loads `spec` (a model, or a part of one) on `device`: the budgets
    /// not given filled in, the backend, the plan (`planning::plan`
    /// measures the machine and asks it), then what it decided allocated
    /// and loaded: the weights, the host CPU's groups, the KV cache and its
    /// tier, the pager, and the buffers of the options that take part.
    fn load_part(
        path: &Path,
        cfg: &EngineConfig,
        spec: ModelSpec,
        device: ggml::Device,
        relay: Option<ggml::Device>,
        like: Option<Probes>,
    ) -> Result<Engine, EngineError> {
        let file = ModelFile::open(path)?;
        let (cfg, auto_budgets) = resolve_budgets(cfg, device);
        let cfg = &cfg;
        let (backend, free_at_load) = open_backend(cfg, &spec, device)?;
        let Planned {
            dims,
            lim,
            kv_block,
            layouts,
            n_reduce,
            plan,
            probes,
            cpu_cal,
            hot,
            hot_counted,
            saved_counts,
        } = planning::plan(&spec, cfg, device, &backend, like.as_ref())?;
        if spec.shard.is_some() && plan.dram.iter().any(Option::is_some) {
            // a share's columns are strided slices of the file's rows,
            // which the DRAM window's one read per tensor cannot gather
            return Err(EngineError::BadDevices(format!(
                "the row split needs every streamed group in host memory, and the DRAM budget holds only part of {}'s share: raise --dram-budget, or use --split-mode layer",
                device.name()
            )));
        }
        let store = WeightStore::load(
            &spec,
            &file,
            path,
            device,
            &plan,
            layouts,
            cfg.cpu_layout(),
            cfg.progress,
        )?;
        // the host's threads (a row split's device: its share of the cores)
        let pool_threads = shard_threads(&spec, host_threads(device, cfg.n_threads));
        let hop_buft = super::hops::buffer_type(device);
        let host = host_compute(&spec, &dims, lim, &plan, &file, pool_threads, cfg, hop_buft)?;
        let (kv_resident, tier) = kv_placement(&spec, &dims, device, &plan, lim, kv_block, cfg)?;
        let rec = timeline::Recorder::default();
        let pager = pager(
            device,
            &spec,
            &plan,
            cfg,
            tier.is_some(),
            &rec,
            relay,
            &store,
        )?;
        let persistent = Persistent::alloc(&dims, lim, device)?;
        let inputs_up = super::inputsup::InputsUp::pinned(device, &persistent, &dims, lim);
        let hops = match hop_buft
            .zip(host.as_ref())
            .and_then(|(b, h)| Some((b, h.pinned_x()?, h.x_rows())))
        {
            Some((buft, hx, rows)) => super::hops::Hops::new(
                buft,
                persistent.bindings[super::buffers::X].clone(),
                lim.n_batch,
                hx,
                rows,
                spec.hp.n_embd,
            )?,
            None => None,
        };
        let split = expert_split(
            &spec,
            &dims,
            lim,
            &plan,
            cfg,
            device,
            host.is_some(),
            saved_counts.as_ref(),
        )?;
        let reduce = (0..n_reduce)
            .map(|_| super::buffers::SplitRows::alloc(&dims, lim, device))
            .collect::<Result<Vec<_>, _>>()?;
        let mut halves = match spec.shard {
            Some(s) if s.count == 2 => super::exchange::Halves::new(device, cfg.paging.row_halves)?,
            _ => None,
        };
        if let (Some(h), Some(w)) = (halves.as_mut(), plan.gemm.and_then(|g| g.widened)) {
            h.widening = Some(super::buffers::Widening::alloc(&spec, w, device)?);
        }
        let cpu_halves = match (&host, cfg.paging.cpu_halves) {
            (Some(_), true) => Some(super::halfrows::CpuHalves::new(device)?),
            (None, true) => {
                tracing::warn!(
                    "--cpu-halves: no hybrid plan, so no step has host groups to overlap"
                );
                None
            }
            _ => None,
        };
        let hot = hot_pool(&spec, &file, device, hot, hot_counted, cfg, lim)?;
        // what every graph's externals are bound to
        let mut ext = persistent.bindings.clone();
        ext.extend(store.rope_freqs.clone());
        let ahead = match (&host, &plan.placement.hybrid) {
            (Some(_), Some(h)) => {
                look_ahead(&spec, &dims, lim, &ext, &file, &store, &h.host, device, cfg)?
            }
            _ => None,
        };
        if ahead.is_none() && cfg.paging.look_ahead > 0 && spec.hp.is_moe() {
            tracing::warn!(
                "--look-ahead: none, it needs mixture layers the host CPU computes (hybrid decode) streamed from pinned memory"
            );
        }
        let mut kv = KvCache::new(
            KvCells::new(lim.n_ctx as usize),
            KvStore::alloc(&dims, lim, device, &kv_resident, dims.hp.n_layer as usize)?,
            tier,
        );
        // batch invariance: each sequence's cells in position order
        kv.set_ordered(cfg.batch_invariant);
        let templates = TemplateCache::new(dims.clone(), lim, ext, device);
        // `auto` routes on a GPU only (engine/routed.rs)
        let routes = match cfg.paging.routed {
            crate::paging::RoutedUploads::Off => false,
            crate::paging::RoutedUploads::Auto => !device.is_cpu(),
            crate::paging::RoutedUploads::Force => true,
        };
        let count_routing = dims.read_routing || ((host.is_some() || routes) && dims.hp.is_moe());
        let routed = dims
            .hp
            .is_moe()
            .then(|| crate::paging::routed::RoutedSteps::new(cfg.paging.routed, saved_counts));
        Ok(Engine {
            probes,
            spec,
            plan,
            lim,
            device,
            templates,
            pager,
            host,
            hot,
            ahead,
            split,
            reduce,
            halves,
            cpu_halves,
            rows_up: None,
            hops,
            inputs_up,
            backend,
            store,
            persistent,
            kv,
            file,
            staging: Default::default(),
            last_step: StepStats::default(),
            rec,
            auto_budgets,
            budget_watch: free_at_load
                .zip(cfg.budgets.gpu)
                .map(|(free, b)| crate::paging::BudgetWatch::new(free, b)),
            cpu_cal,
            count_device: dims.read_routing,
            routed,
            routing: count_routing.then(|| {
                crate::paging::routing::RouterCounts::new(
                    dims.hp.n_layer as usize,
                    dims.hp.n_expert as usize,
                    dims.hp.n_expert_used as usize,
                )
            }),
            next: None,
            pending: None,
            threads: cfg.tune_threads.then(|| {
                let mut t = super::threads::ThreadTuner::new(if device.is_cpu() {
                    cfg.n_threads
                } else {
                    pool_threads
                });
                t.poll = cfg.poll;
                t
            }),
        })
    }
}

/// `cfg` with the budgets it does not give filled in (what the machine
/// has free, less a margin), and a line for each so filled.
fn resolve_budgets(cfg: &EngineConfig, device: ggml::Device) -> (EngineConfig, Vec<String>) {
    let mut lines = Vec::new();
    let auto_gpu = (cfg.budgets.gpu.is_none() && !device.is_cpu()).then(|| {
        let (free, total) = device.memory();
        let b = crate::paging::auto_gpu_budget(free as u64, total as u64);
        lines.push(format!(
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
            lines.push(format!(
                "DRAM budget {} (available {} less a margin)",
                gib(b),
                gib(avail)
            ));
            b
        }),
    };
    let cfg = EngineConfig {
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
    (cfg, lines)
}

/// The engine's backend on `device` with its threads, and the device's
/// free memory before the engine allocates anything (None on the CPU and
/// over RPC, where each reading is a round trip): what it holds later is
/// measured from there.
fn open_backend(
    cfg: &EngineConfig,
    spec: &ModelSpec,
    device: ggml::Device,
) -> Result<(ggml::Backend, Option<u64>), EngineError> {
    let mut backend = device.init_backend()?;
    // after the backend's context is made
    let free_at_load = (!device.is_cpu() && !device.is_remote()).then(|| device.memory().0 as u64);
    backend.set_n_threads(cfg.n_threads);
    backend.attach_cpu_threadpool(cfg.n_threads, cfg.poll)?;
    if cfg.batch_invariant && !backend.set_use_ref(true) {
        return Err(EngineError::Unsupported(
            "batch-invariant numerics need the CPU device (GPU kernels depend on the batch size)",
        ));
    }
    if !spec.hp.is_moe() && spec.shard.is_none_or(|s| s.index == 0) {
        for flag in cfg.mixture_only_options() {
            tracing::warn!(
                "{flag}: this model has no mixture-of-experts layers, so it does nothing"
            );
        }
    }
    Ok((backend, free_at_load))
}

/// The groups the host CPU computes (hybrid decode), their copies loaded
/// from `file` with a progress bar; None where the plan has none.
#[allow(clippy::too_many_arguments)]
fn host_compute(
    spec: &ModelSpec,
    dims: &Dims,
    lim: Limits,
    plan: &crate::paging::MemoryPlan,
    file: &ModelFile,
    pool_threads: usize,
    cfg: &EngineConfig,
    hop_buft: Option<ggml::BufferType>,
) -> Result<Option<host::HostCompute>, EngineError> {
    let Some(h) = &plan.placement.hybrid else {
        return Ok(None);
    };
    let bar = store::progress(h.host_bytes, cfg.progress);
    let hb = crate::paging::HYBRID_MAX_TOKENS.min(lim.n_batch);
    let hl = Limits {
        n_batch: hb,
        n_ctx: lim.n_ctx,
        ffn_rows: hb,
    };
    // the host's mixture layers keep their picks readable, so they are
    // counted in every run (`count_routed`): on the CPU that costs
    // nothing, and they are the layers hot experts serve
    let host_dims = Dims {
        read_routing: spec.hp.is_moe(),
        ..dims.clone()
    };
    let hc = host::HostCompute::new(
        spec,
        &host_dims,
        hl,
        &h.host,
        file,
        pool_threads,
        cfg.poll,
        cfg.cpu_layout(),
        // the residual where the device's hop kernels reach it
        hop_buft,
        &bar,
    )?;
    bar.finish_and_clear();
    Ok(Some(hc))
}

/// The KV cache's layers on the device (the first of the KV order:
/// full-context layers before sliding-window ones) and the tier that
/// windows the rest (None where every layer's KV stays on the device).
fn kv_placement(
    spec: &ModelSpec,
    dims: &Dims,
    device: ggml::Device,
    plan: &crate::paging::MemoryPlan,
    lim: Limits,
    kv_block: usize,
    cfg: &EngineConfig,
) -> Result<(Vec<u32>, Option<KvTier>), EngineError> {
    let mut resident = spec.hp.kv_order();
    let mut windowed = resident.split_off(plan.kv.resident_layers);
    if windowed.is_empty() {
        return Ok((resident, None));
    }
    windowed.sort_unstable();
    let tier = KvTier::new(
        device,
        windowed,
        dims.hp.n_layer as usize,
        &dims.hp,
        lim.n_ctx as usize,
        plan.kv.windows,
        kv_fingerprint(spec),
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
    )?;
    Ok((resident, Some(tier)))
}

/// The pager of the plan's slot rings on `device`; where a layer split
/// lends it `relay`'s bus too (local GPUs, no DRAM window), every other
/// streamed FFN group goes up over that one.
#[allow(clippy::too_many_arguments)]
fn pager(
    device: ggml::Device,
    spec: &ModelSpec,
    plan: &crate::paging::MemoryPlan,
    cfg: &EngineConfig,
    kv_tier: bool,
    rec: &timeline::Recorder,
    relay: Option<ggml::Device>,
    store: &WeightStore,
) -> Result<Pager, EngineError> {
    let mut pager = Pager::new(
        device,
        &plan.placement,
        cfg.faults.poison_slots,
        cfg.faults.skip_load_wait,
        kv_tier,
        plan.kv.windows,
        rec.clone(),
    )?;
    pager.group0 = 2 * spec.hp.layer0 as usize;
    pager.carry = cfg.paging.carry;
    if let Some(other) = relay.filter(|_| !store.has_dram_window()) {
        let slot = store.slot_bytes(crate::paging::Ring::Ffn);
        let layers = spec.hp.layer0..spec.hp.layer0 + spec.hp.n_layer;
        if pager.lend_link(device, other, slot)? {
            tracing::info!(
                "layers {layers:?}: every other streamed FFN group also goes up over {}'s bus",
                other.name()
            );
        } else if plan.placement.n_streamed() > 0 {
            tracing::warn!(
                "layers {layers:?}: no FFN ring, so no relay over {}",
                other.name()
            );
        }
    }
    Ok(pager)
}

/// The expert split's host-side rows where the plan splits mixture
/// layers (`host`: the plan's host groups are loaded), each layer's
/// experts ordered by the counts kept beside the model; None elsewhere.
#[allow(clippy::too_many_arguments)]
fn expert_split(
    spec: &ModelSpec,
    dims: &Dims,
    lim: Limits,
    plan: &crate::paging::MemoryPlan,
    cfg: &EngineConfig,
    device: ggml::Device,
    host: bool,
    saved_counts: Option<&crate::paging::routing::RouterCounts>,
) -> Result<Option<super::buffers::SplitRows>, EngineError> {
    let planned = plan
        .placement
        .hybrid
        .as_ref()
        .is_some_and(|h| h.split.is_some());
    if !(planned && host) {
        if cfg.paging.split.mode != crate::paging::ExpertSplit::Off && spec.hp.is_moe() {
            tracing::warn!(
                "--expert-split: no split, it needs streamed mixture layers the host CPU keeps a copy of (hybrid decode)"
            );
        }
        return Ok(None);
    }
    let mut rows = super::buffers::SplitRows::alloc_host_side(dims, lim, device)?;
    // the device takes each layer's most picked experts where the counts
    // kept beside the model order them
    if let Some(c) = saved_counts {
        rows.order = (0..c.n_layer())
            .map(|l| (c.layer_picks(l) > 0).then(|| c.hot(l, c.n_expert())))
            .collect();
    }
    Ok(Some(rows))
}

/// The hot experts' pool on the device, loaded from `file`, where the plan
/// keeps any (`hot`, chosen from `counted`); None elsewhere.
fn hot_pool(
    spec: &ModelSpec,
    file: &ModelFile,
    device: ggml::Device,
    hot: Option<crate::paging::HotPlan>,
    counted: Option<crate::paging::routing::RouterCounts>,
    cfg: &EngineConfig,
    lim: Limits,
) -> Result<Option<super::hotpool::HotPool>, EngineError> {
    let Some(h) = hot.filter(|h| !h.is_empty()) else {
        if cfg.paging.hot != crate::paging::HotExperts::Off && spec.hp.is_moe() {
            tracing::warn!(
                "--hot-experts: none kept (they need streamed mixture layers the host CPU keeps a copy of, room in the GPU budget, and for auto router counts that show skew)"
            );
        }
        return Ok(None);
    };
    let most = crate::paging::HYBRID_MAX_TOKENS.min(lim.n_batch);
    let mut pool = super::hotpool::HotPool::load(spec, file, device, h, most)?;
    pool.counted = counted;
    tracing::info!(
        "hot experts: {} in {} layers on the device ({:.1} MiB){}",
        pool.plan.n_experts(),
        pool.plan.n_groups(),
        pool.bytes() as f64 / (1u64 << 20) as f64,
        pool.plan.expected_hit.map_or(String::new(), |x| format!(
            ", {:.1}% of the counted picks",
            100.0 * x
        ))
    );
    Ok(Some(pool))
}

/// The look-ahead's slots where `--look-ahead` asks for it and the host
/// computes the groups `host` marks; None where it takes no part.
#[allow(clippy::too_many_arguments)]
fn look_ahead(
    spec: &ModelSpec,
    dims: &Dims,
    lim: Limits,
    ext: &[ggml::Binding],
    file: &ModelFile,
    store: &WeightStore,
    host: &[bool],
    device: ggml::Device,
    cfg: &EngineConfig,
) -> Result<Option<super::aheadslots::LookAhead>, EngineError> {
    if cfg.paging.look_ahead == 0 {
        return Ok(None);
    }
    let ahead = super::aheadslots::LookAhead::new(
        spec,
        dims,
        lim,
        ext.to_vec(),
        file,
        store,
        host,
        device,
        cfg.paging.look_ahead,
        cfg.paging.look_ahead_layers,
        crate::paging::experts::HOT_MAX_TOKENS.min(lim.n_batch),
    )?;
    if let Some(a) = &ahead {
        tracing::info!(
            "look-ahead: up to {} predicted experts of each of the next {} host layers uploaded ahead ({:.1} MiB on the device)",
            a.most,
            a.depth(),
            a.bytes() as f64 / (1u64 << 20) as f64
        );
    }
    Ok(ahead)
}

/// Each part's host budgets (DRAM, KV on the device, KV in host memory),
/// the given ones shared in proportion to `weights` (the DRAM budget, when
/// none was given, is what the machine has available less a margin); no
/// GPU budget, which each part has of its own.
fn host_budgets(b: &Budgets, weights: &[u64]) -> Vec<Budgets> {
    let share = |b: Option<u64>| -> Vec<Option<u64>> {
        b.map_or_else(
            || vec![None; weights.len()],
            |b| {
                crate::paging::devices::share(b, weights)
                    .into_iter()
                    .map(Some)
                    .collect()
            },
        )
    };
    let dram = share(
        b.dram
            .or_else(|| crate::paging::mem_available().map(crate::paging::auto_dram_budget)),
    );
    let (kv_gpu, kv_dram) = (share(b.kv_gpu), share(b.kv_dram));
    (0..weights.len())
        .map(|i| Budgets {
            gpu: None,
            dram: dram[i],
            kv_gpu: kv_gpu[i],
            kv_dram: kv_dram[i],
        })
        .collect()
}

/// The parts of a model split across devices, in order, chained by
/// `Engine::next` (None for none).
fn chain(mut parts: Vec<Engine>) -> Option<Engine> {
    let mut next: Option<Engine> = None;
    while let Some(mut e) = parts.pop() {
        e.next = next.map(Box::new);
        next = Some(e);
    }
    next
}

/// The host's threads for one device's share of the row split: the cores
/// divided between the devices, so that one device's pool, idle and still
/// polling, never takes the cores of another's computing (the first
/// two-GPU run alternated two pools of 31 threads on 32 cores, and host
/// shares of 1.6 ms took up to 46 ms).
fn shard_threads(spec: &ModelSpec, n: usize) -> usize {
    spec.shard.map_or(n, |s| (n / s.count as usize).max(1))
}

/// The devices of the kind `cfg.device` chooses, those `cfg.devices`
/// names or all of them, in layer order; `remote`: the devices of the
/// configuration's RPC servers (not those of servers an earlier engine in
/// the process named).
fn pick_devices(
    cfg: &EngineConfig,
    remote: Vec<ggml::Device>,
) -> Result<Vec<ggml::Device>, EngineError> {
    let all = ggml::devices()?;
    let gpus: Vec<ggml::Device> = all
        .iter()
        .copied()
        .filter(|d| d.is_gpu() && !d.is_remote())
        .collect();
    let (kind, list) = match cfg.device {
        DeviceChoice::Cpu => ("CPU", vec![ggml::cpu_device()?]),
        DeviceChoice::Gpu if gpus.is_empty() => return Err(GgmlError::NoDevice("GPU").into()),
        // the local GPUs, then the --rpc servers' devices
        DeviceChoice::Gpu => ("device", gpus.into_iter().chain(remote).collect()),
        DeviceChoice::Remote => {
            let r = remote;
            if r.is_empty() {
                return Err(GgmlError::Rpc(
                    "no remote device: give an RPC server (--rpc HOST:PORT)".into(),
                )
                .into());
            }
            ("remote device", r)
        }
        DeviceChoice::Auto if gpus.is_empty() => ("CPU", vec![ggml::cpu_device()?]),
        DeviceChoice::Auto => ("device", gpus.into_iter().chain(remote).collect()),
    };
    let Some(idx) = &cfg.devices else {
        return Ok(list);
    };
    if idx.is_empty() {
        return Err(EngineError::BadDevices("--devices names no device".into()));
    }
    let mut out = Vec::with_capacity(idx.len());
    for (k, &i) in idx.iter().enumerate() {
        if idx[..k].contains(&i) {
            return Err(EngineError::BadDevices(format!(
                "--devices names {kind} {i} twice"
            )));
        }
        let d = list.get(i).ok_or_else(|| {
            EngineError::BadDevices(format!(
                "--devices {i}: there {} {} {kind}{} ({}; `strata devices` lists them)",
                if list.len() == 1 { "is" } else { "are" },
                list.len(),
                if list.len() == 1 { "" } else { "s" },
                if list.len() == 1 {
                    "index 0".to_string()
                } else {
                    format!("indices 0 to {}", list.len() - 1)
                }
            ))
        })?;
        out.push(*d);
    }
    Ok(out)
}

fn gib(b: u64) -> String {
    format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
}
