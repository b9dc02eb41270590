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
use super::probe;
use super::state::Engine;
use super::state::Probes;
use super::store;
use super::store::WeightStore;
use super::templates::TemplateCache;
use super::timeline;
use crate::dtype::GgmlType;
use crate::ggml;
use crate::ggml::GgmlError;
use crate::gguf::GgufFile;
use crate::graph::Dims;
use crate::kv::KvCells;
use crate::model::ModelSpec;
use crate::paging::gemm;
use crate::paging::sizes;
use crate::paging::Budgets;
use crate::paging::ComputeRate;
use crate::paging::GemmPlan;
use crate::paging::GroupInfo;
use crate::paging::KvShape;
use crate::paging::Limits;
use crate::paging::MemoryInput;
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

    /// Loads `spec` (a model, or a part of one) on `device`.
    fn load_part(
        path: &Path,
        cfg: &EngineConfig,
        spec: ModelSpec,
        device: ggml::Device,
        relay: Option<ggml::Device>,
        like: Option<Probes>,
    ) -> Result<Engine, EngineError> {
        let file = ModelFile::open(path)?;
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
        // the device's free memory before this engine allocates anything
        // (its context made): what it holds later is measured from here
        // (not over RPC, where each reading is a round trip)
        let free_at_load =
            (!device.is_cpu() && !device.is_remote()).then(|| device.memory().0 as u64);
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
        // KV cells padded as llama.cpp pads them (see KvCells::n_kv)
        let n_ctx = sizes::kv_cells(cfg.n_ctx).ok_or(EngineError::BadContext(cfg.n_ctx))?;
        let dims = Dims {
            arch: spec.arch,
            hp: spec.hp.clone(),
            has_rope_freqs: spec.rope_freqs.is_some(),
            read_routing: cfg.expert_stats && spec.hp.is_moe(),
            partial: spec.shard.is_some_and(|s| s.index > 0),
        };
        let n_batch = cfg.n_batch.clamp(1, n_ctx);
        let mut lim = Limits {
            n_batch,
            n_ctx,
            ffn_rows: n_batch,
        };

        let layouts = store::layouts(&spec, device)?;
        let head_bytes = if spec.has_head {
            spec.output.size + spec.output_norm.size
        } else {
            0
        } + spec.rope_freqs.as_ref().map_or(0, |w| w.size);
        // an expert split's host rows take device memory only where the
        // device has no pinned host buffer type for them
        // (`SplitRows::alloc_host_side`)
        let split_on_device = cfg.paging.split.mode != crate::paging::ExpertSplit::Off
            && spec.hp.is_moe()
            && (device.is_cpu() || device.host_buffer_type().is_none());
        // the row split's reduce buffers: two devices each hold two (they
        // exchange outputs, alternating buffers group by group); with more,
        // the first one per other device
        let n_reduce = match spec.shard {
            Some(s) if s.count == 2 => 2,
            Some(s) if s.index == 0 => s.count as u64 - 1,
            _ => 0,
        };
        let persistent_bytes = sizes::persistent_bytes(&dims.hp, lim)
            + (n_reduce + u64::from(split_on_device)) * sizes::split_rows_bytes(&dims.hp, lim);
        // the reserve for whole steps and for FFN chunks (the plan picks)
        let activations = sizes::activations(&dims.hp, lim, cfg.paging.ffn_rows);
        let n_layer = dims.hp.n_layer as usize;
        let kv_block = cfg.kv_tier.block.clamp(1, n_ctx as usize);
        // which kernels multiply large steps; before the compute probe,
        // which then measures the chosen path
        let free0 = device.has_gemm_switch().then(|| device.memory().0);
        let paths = probe::matmul_paths(&spec, device, n_batch, cfg.paging.gemm)?;
        // the compute rate, measured where anything may stream (the plan's
        // floor then includes compute: prefill is compute-bound). On a GPU
        // on a backend of its own: what the path takes from ggml's memory
        // pool (GEMM's dequantized matrix) goes with it, so the engine's
        // pool holds only what the plan reserves. On the engine's backend
        // the probe's 448 MiB stayed there for good, also where the plan
        // then dropped GEMM and reserved nothing for it: 64 sequences at
        // 12G took 12868 MiB (docs/device-runs.md, run 99).
        let compute = if let Some(p) = &like {
            p.compute
        } else if !device.is_cpu() || cfg.budgets.gpu.is_some() || cfg.paging.stream_all {
            if device.is_cpu() {
                probe::device_compute(&spec, device, &backend, n_batch)?
            } else {
                let own = device.init_backend()?;
                probe::device_compute(&spec, device, &own, n_batch)?
            }
        } else {
            None
        };
        // what the probes leave on the device once their backends are gone
        // (the BLAS library's state and kernels, loaded for good): the
        // budget holds it too
        let probe_kept = free0.map_or(0, |f| f.saturating_sub(device.memory().0) as u64);
        if probe_kept > 0 {
            tracing::info!(
                "the matmul probes left {:.1} MiB in use on the device (counted in the plan's fixed memory)",
                probe_kept as f64 / (1u64 << 20) as f64
            );
        }
        // where the row split cuts its steps in halves, each group may be
        // dequantized once for both (below)
        let halved = spec.shard.is_some_and(|s| s.count == 2)
            && super::exchange::Halves::min_tokens(device, cfg.paging.row_halves)
                .is_some_and(|m| m <= n_batch)
            && cfg.paging.row_widen;
        // what ggml and the driver take on a CUDA device outside strata's
        // buffers (the pinned mapping of every weight that may stream,
        // cuBLAS where float matrices are multiplied, ggml's pool, lazily
        // loaded kernels)
        let outside = if device.has_gemm_switch() && !device.is_remote() {
            let float = [GgmlType::F32, GgmlType::F16, GgmlType::BF16];
            let float_matmuls = spec
                .groups
                .iter()
                .flat_map(|g| g.weights.iter())
                .chain(spec.has_head.then_some(&spec.output))
                .any(|w| w.ne[1] > 1 && float.contains(&w.ty));
            let weights: u64 = spec
                .groups
                .iter()
                .flat_map(|g| g.weights.iter())
                .map(|w| w.size)
                .sum();
            crate::paging::Outside::cuda(
                &dims.hp,
                Limits {
                    ffn_rows: activations.ffn_rows,
                    ..lim
                },
                weights,
                float_matmuls,
            )
        } else {
            crate::paging::Outside::default()
        };
        let gemm = paths.map(|p| GemmPlan {
            mmq_max_rows: p.mmq_max_rows,
            scratch_bytes: gemm::scratch_bytes(&dims.hp, n_batch, p.elements),
            widened: None,
        });
        let mut input = MemoryInput {
            groups: spec
                .groups
                .iter()
                .zip(&layouts)
                .map(|(g, l)| group_info(g, l.bytes as u64, &spec.hp))
                .collect(),
            fixed_bytes: head_bytes + persistent_bytes + probe_kept,
            activations,
            kv: KvShape {
                n_layer,
                layer_bytes: sizes::kv_bytes(&dims.hp, n_ctx as u64),
                n_blocks: (n_ctx as usize).div_ceil(kv_block),
                block_bytes: sizes::kv_bytes(&dims.hp, kv_block as u64),
                n_swa_layers: if spec.hp.n_swa > 0 && n_ctx >= 2 * spec.hp.n_swa {
                    (0..n_layer as u32).filter(|&l| spec.hp.is_swa(l)).count()
                } else {
                    0
                },
            },
            budgets: cfg.budgets,
            host_available: crate::paging::mem_available().unwrap_or(0),
            slots: cfg.paging.slots,
            stream_all: cfg.paging.stream_all,
            resident: cfg.paging.resident,
            // measured: a quick pinned copy on a second stream (GPU)
            copy_bw: if let Some(p) = &like {
                p.copy_bw
            } else if device.is_cpu() || cfg.budgets.gpu.is_none() && !cfg.paging.stream_all {
                10e9
            } else {
                // this bus alone: another GPU's lent bus (`Pager::lend_link`)
                // carries only steps of many tokens (`RELAY_MIN_TOKENS`),
                // which the plan then predicts slower than they run
                probe::measure_h2d(device, 64 << 20, 4)?
            },
            cpu: None,
            gemm,
            outside,
            compute,
        };
        let measured_compute = input.compute;
        let mut plan = crate::paging::memory_plan(&input)?;
        // the scratch against the resident groups it displaces: GEMM only
        // where its plan predicts the larger step faster
        if let (Some(p), Some(ratio), Some(c)) =
            (paths, paths.and_then(|p| p.mmq_over_gemm), input.compute)
        {
            let mmq = MemoryInput {
                gemm: None,
                compute: Some(ComputeRate {
                    s_per_byte_n: c.s_per_byte_n * ratio,
                    ..c
                }),
                ..input.clone()
            };
            let without = crate::paging::memory_plan(&mmq)?;
            if !gemm::pays(&plan.placement, &without.placement, n_batch) {
                tracing::info!(
                    "GEMM for steps over {} rows does not pay here: a {n_batch}-token step {:.1} ms with it, {:.1} ms without",
                    p.mmq_max_rows,
                    plan.placement.floor_s(n_batch) * 1e3,
                    without.placement.floor_s(n_batch) * 1e3
                );
                probe::drop_gemm(device, p.elements);
                input = mmq;
                plan = without;
            }
        }
        // the widened copy where the plan keeps GEMM, and only where the
        // resident groups it displaces leave the step as fast as the plan
        // predicts it without: what it saves (a dequantizing pass a
        // group) is compute the plan's rate does not itemize
        if let Some(g) = input.gemm.filter(|_| halved) {
            if let Some(w) = super::buffers::Widening::plan(&spec, g.mmq_max_rows, n_batch) {
                let widened = MemoryInput {
                    gemm: Some(GemmPlan {
                        widened: Some(w),
                        ..g
                    }),
                    ..input.clone()
                };
                match crate::paging::memory_plan(&widened) {
                    Ok(p)
                        if p.placement.floor_s(n_batch)
                            <= plan.placement.floor_s(n_batch) * (1.0 + 1e-9) =>
                    {
                        input = widened;
                        plan = p;
                    }
                    _ => tracing::info!(
                        "the row split's halves dequantize each weight twice: a widened copy ({:.1} MiB) would displace resident groups the step needs",
                        w.bytes as f64 / (1u64 << 20) as f64
                    ),
                }
            }
        }
        let mut cpu_cal = None;
        let mut hot: Option<crate::paging::HotPlan> = None;
        let mut hot_counted = None;
        // router counts kept beside the model, for hot experts and routed
        // uploads
        let saved_counts = saved_counts(&spec, cfg)?;
        let cpu = match &like {
            Some(p) => p.cpu.clone().map(|c| (c, p.cpu_scales.clone())),
            None => probe::cpu_input(&spec, &plan.placement, input.copy_bw, device, &backend, cfg)?
                .map(|(c, scales)| match spec.shard {
                    // the row split: every device's host share runs on the
                    // same cores, so each plan sees its share of the CPU
                    Some(s) => (c.scaled(f64::from(s.count)), scales),
                    None => (c, scales),
                }),
        };
        let mut cpu_scales = Vec::new();
        if let Some((c, scales)) = cpu {
            input.cpu = Some(c.clone());
            // each group's kinds of expert matrix: the plan prefers the
            // cheaper groups for the CPU
            crate::paging::set_cpu_scales(&mut input.groups, &scales);
            cpu_scales = scales;
            if cfg.paging.split.mode != crate::paging::ExpertSplit::Off {
                // an expert split gives the device each layer's most picked
                // experts: the plan costs it by how the picks spread
                if let Some(counts) = saved_counts.as_ref() {
                    set_popularity(&mut input.groups, &spec, counts);
                }
            }
            if cfg.paging.look_ahead > 0 && spec.hp.is_moe() {
                // the look-ahead's slots and rows out of the budget
                input.fixed_bytes += super::aheadslots::device_bytes(
                    &spec,
                    device,
                    cfg.paging.look_ahead,
                    cfg.paging.look_ahead_layers,
                    crate::paging::experts::HOT_MAX_TOKENS.min(n_batch),
                )?;
            }
            plan = crate::paging::memory_plan(&input)?;
            // hot experts: their pool out of the budget, so the plan again
            hot_counted = saved_counts.clone();
            let counts = hot_counted.as_ref();
            if let Some(h) = hot_plan(&spec, &input.groups, &plan, cfg, n_batch, counts, None) {
                // the CPU's share of those groups falls by the hot sets'
                crate::paging::set_hot_shares(&mut input.groups, &h.hit);
                input.fixed_bytes += h.bytes + hot_io_bytes(&spec, n_batch);
                plan = crate::paging::memory_plan(&input)?;
                // the plan moved groups (spread residency shifts them all):
                // the sets again for the groups streamed now, in the bytes
                // reserved
                let h = hot_plan(
                    &spec,
                    &input.groups,
                    &plan,
                    cfg,
                    n_batch,
                    counts,
                    Some(h.bytes),
                )
                .unwrap_or_default();
                crate::paging::set_hot_shares(&mut input.groups, &h.hit);
                hot = Some(h);
            }
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
        lim.ffn_rows = plan.ffn_rows.unwrap_or(n_batch);
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
        let host = match &plan.placement.hybrid {
            Some(h) => {
                let bar = store::progress(h.host_bytes, cfg.progress);
                let hb = crate::paging::HYBRID_MAX_TOKENS.min(lim.n_batch);
                let hl = Limits {
                    n_batch: hb,
                    n_ctx,
                    ffn_rows: hb,
                };
                // the host's mixture layers keep their picks readable, so
                // they are counted in every run (`count_routed`): on the
                // CPU that costs nothing, and they are the layers hot
                // experts serve
                let host_dims = Dims {
                    read_routing: spec.hp.is_moe(),
                    ..dims.clone()
                };
                let hc = host::HostCompute::new(
                    &spec,
                    &host_dims,
                    hl,
                    &h.host,
                    &file,
                    pool_threads,
                    cfg.poll,
                    cfg.cpu_layout(),
                    // the residual where the device's hop kernels reach it
                    hop_buft,
                    &bar,
                )?;
                bar.finish_and_clear();
                Some(hc)
            }
            None => None,
        };
        // KV on the device: the first layers of the KV order (full-context
        // layers before sliding-window ones); the rest windowed
        let kv_order = spec.hp.kv_order();
        let (kv_resident, kv_windowed) = kv_order.split_at(plan.kv.resident_layers);
        let mut kv_windowed = kv_windowed.to_vec();
        kv_windowed.sort_unstable();
        let tier = if !kv_windowed.is_empty() {
            Some(KvTier::new(
                device,
                kv_windowed,
                n_layer,
                &dims.hp,
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
        let mut pager = pager;
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
        let split = match plan
            .placement
            .hybrid
            .as_ref()
            .and_then(|h| h.split.as_ref())
        {
            Some(_) if host.is_some() => {
                let mut rows = super::buffers::SplitRows::alloc_host_side(&dims, lim, device)?;
                // the device takes each layer's most picked experts where
                // the counts kept beside the model order them
                if let Some(c) = saved_counts.as_ref() {
                    rows.order = (0..c.n_layer())
                        .map(|l| (c.layer_picks(l) > 0).then(|| c.hot(l, c.n_expert())))
                        .collect();
                }
                Some(rows)
            }
            _ => {
                if cfg.paging.split.mode != crate::paging::ExpertSplit::Off && spec.hp.is_moe() {
                    tracing::warn!(
                        "--expert-split: no split, it needs streamed mixture layers the host CPU keeps a copy of (hybrid decode)"
                    );
                }
                None
            }
        };
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
        let hot = match hot.filter(|h| !h.is_empty()) {
            Some(h) => {
                let most = crate::paging::HYBRID_MAX_TOKENS.min(lim.n_batch);
                let mut pool = super::hotpool::HotPool::load(&spec, &file, device, h, most)?;
                pool.counted = hot_counted;
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
                Some(pool)
            }
            None => {
                if cfg.paging.hot != crate::paging::HotExperts::Off && spec.hp.is_moe() {
                    tracing::warn!(
                        "--hot-experts: none kept (they need streamed mixture layers the host CPU keeps a copy of, room in the GPU budget, and for auto router counts that show skew)"
                    );
                }
                None
            }
        };
        // what every graph's externals are bound to
        let mut ext = persistent.bindings.clone();
        ext.extend(store.rope_freqs.clone());
        let ahead = match (&host, &plan.placement.hybrid) {
            (Some(_), Some(h)) if cfg.paging.look_ahead > 0 => super::aheadslots::LookAhead::new(
                &spec,
                &dims,
                lim,
                ext.clone(),
                &file,
                &store,
                &h.host,
                device,
                cfg.paging.look_ahead,
                cfg.paging.look_ahead_layers,
                crate::paging::experts::HOT_MAX_TOKENS.min(lim.n_batch),
            )?,
            _ => None,
        };
        match &ahead {
            Some(a) => tracing::info!(
                "look-ahead: up to {} predicted experts of each of the next {} host layers uploaded ahead ({:.1} MiB on the device)",
                a.most,
                a.depth(),
                a.bytes() as f64 / (1u64 << 20) as f64
            ),
            None if cfg.paging.look_ahead > 0 && spec.hp.is_moe() => tracing::warn!(
                "--look-ahead: none, it needs mixture layers the host CPU computes (hybrid decode) streamed from pinned memory"
            ),
            None => {}
        }
        let mut kv = KvCache::new(
            KvCells::new(n_ctx as usize),
            KvStore::alloc(&dims, lim, device, kv_resident, n_layer)?,
            tier,
        );
        // batch invariance: each sequence's cells in position order
        kv.set_ordered(cfg.batch_invariant);
        let templates = TemplateCache::new(dims.clone(), lim, ext, device);
        let probes = Probes {
            copy_bw: input.copy_bw,
            compute: measured_compute,
            cpu: input.cpu.clone(),
            cpu_scales,
        };
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
            auto_budgets: budgets,
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

/// What the planner knows of group `g`, `bytes` in a slot: its routed
/// experts, if it has any, so a step is costed by the experts it reads.
fn group_info(g: &crate::model::GroupSpec, bytes: u64, hp: &crate::model::Hparams) -> GroupInfo {
    let experts: u64 = g
        .weights
        .iter()
        .filter(|w| w.role.is_some_and(|r| r.is_expert()))
        .map(|w| w.size)
        .sum();
    GroupInfo {
        kind: g.kind,
        bytes,
        experts: (experts > 0 && hp.n_expert > 0).then_some(crate::paging::Experts {
            bytes: experts.min(bytes),
            n_expert: hp.n_expert,
            n_used: hp.n_expert_used,
            hot: 0.0,
            popularity: None,
            cpu_scale: [1.0; 2],
        }),
    }
}

/// Each mixture group's spread of picks over its experts, from `counts`
/// (the whole model's, by layer).
fn set_popularity(
    groups: &mut [crate::paging::GroupInfo],
    spec: &ModelSpec,
    counts: &crate::paging::routing::RouterCounts,
) {
    for (g, s) in groups.iter_mut().zip(&spec.groups) {
        let l = s.layer as usize;
        if let Some(x) = g.experts.as_mut().filter(|_| l < counts.n_layer()) {
            let row: Vec<u64> = (0..counts.n_expert()).map(|e| counts.count(l, e)).collect();
            x.popularity = crate::paging::Popularity::from_counts(&row);
        }
    }
}

/// Streamed mixture FFN groups the host keeps a copy of: where hot experts
/// may go.
fn hot_eligible(groups: &[GroupInfo], plan: &crate::paging::MemoryPlan) -> Vec<bool> {
    let host = plan.placement.hybrid.as_ref().map(|h| h.host.as_slice());
    (0..groups.len())
        .map(|i| {
            groups[i].experts.is_some() && !plan.placement.resident[i] && host.is_some_and(|h| h[i])
        })
        .collect()
}

/// Device bytes of the hot experts' rows and ids (`HotPool::load`).
fn hot_io_bytes(spec: &ModelSpec, n_batch: u32) -> u64 {
    let most = super::host::pad_picks(
        crate::paging::HYBRID_MAX_TOKENS.min(n_batch) * spec.hp.n_expert_used,
    ) as u64;
    most * (4 * spec.hp.n_embd as u64 + 4) + 1024
}

/// The hot experts `cfg` asks for, from `counts` (persisted beside the
/// model), within `cap` bytes, else what the plan's resident groups
/// hold (all of it for a number asked, half for auto): None where there
/// are none.
fn hot_plan(
    spec: &ModelSpec,
    groups: &[GroupInfo],
    plan: &crate::paging::MemoryPlan,
    cfg: &EngineConfig,
    n_batch: u32,
    counts: Option<&crate::paging::routing::RouterCounts>,
    cap: Option<u64>,
) -> Option<crate::paging::HotPlan> {
    use crate::paging::HotExperts;
    let mode = cfg.paging.hot;
    if mode == HotExperts::Off || !spec.hp.is_moe() {
        return None;
    }
    let resident: u64 = groups
        .iter()
        .zip(&plan.placement.resident)
        .filter(|(_, r)| **r)
        .map(|(g, _)| g.bytes)
        .sum();
    // streaming everything whatever the budget (tests, benchmarks): the
    // pool too
    let room = if cfg.paging.stream_all {
        u64::MAX
    } else {
        resident.saturating_sub(hot_io_bytes(spec, n_batch))
    };
    let budget = match (cap, mode) {
        (Some(c), _) => c,
        (None, HotExperts::Auto) => room / 2,
        (None, _) => room,
    };
    let h = crate::paging::plan_hot(groups, &hot_eligible(groups, plan), counts, mode, budget);
    (!h.is_empty()).then_some(h)
}

/// The router counts kept beside the model where hot experts, routed
/// uploads or an expert split are asked for (read once per load), None
/// where there are none or they are another model's.
fn saved_counts(
    spec: &ModelSpec,
    cfg: &EngineConfig,
) -> Result<Option<crate::paging::routing::RouterCounts>, EngineError> {
    let wanted = cfg.paging.hot != crate::paging::HotExperts::Off
        || cfg.paging.routed != crate::paging::RoutedUploads::Off
        || cfg.paging.split.mode != crate::paging::ExpertSplit::Off;
    if !wanted || !spec.hp.is_moe() {
        return Ok(None);
    }
    let read = |p: &std::path::Path| match super::model_file::read_router_counts(p) {
        // routed uploads only start their predictions from the counts:
        // without hot experts, a bad file is no reason to refuse the load
        Err(e @ EngineError::BadCounts(..)) if cfg.paging.hot == crate::paging::HotExperts::Off => {
            tracing::warn!("{e}; routed uploads and the expert split start without counts");
            Ok(None)
        }
        r => r,
    };
    let counts = match &cfg.expert_counts {
        Some(p) => match read(p)? {
            // counts are the whole model's, by layer
            Some(c)
                if spec.hp.layer0 == 0
                    && c.n_layer() == spec.hp.n_layer as usize
                    && c.n_expert() == spec.hp.n_expert as usize =>
            {
                Some(c)
            }
            Some(c) => {
                tracing::warn!(
                    "router counts {}: {} layers of {} experts, not this model's; ignored",
                    p.display(),
                    c.n_layer(),
                    c.n_expert()
                );
                None
            }
            None => None,
        },
        None => None,
    };
    Ok(counts)
}
