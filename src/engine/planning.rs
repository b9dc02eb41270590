//! What a load asks the memory plan: the machine measured (`probe`), the
//! plan's input assembled from the model and the configuration, the plan
//! asked, and asked again where GEMM, a widened copy, the host CPU or hot
//! experts change what it places. Allocates nothing the engine keeps:
//! `load` allocates what the plan decided.

use super::config::EngineConfig;
use super::error::EngineError;
use super::probe;
use super::state::Probes;
use super::store;
use super::store::GroupLayout;
use crate::dtype::GgmlType;
use crate::ggml::Backend;
use crate::ggml::Device;
use crate::graph::Dims;
use crate::model::ModelSpec;
use crate::paging::gemm;
use crate::paging::routing::RouterCounts;
use crate::paging::sizes;
use crate::paging::ComputeRate;
use crate::paging::CpuCalibration;
use crate::paging::GemmPlan;
use crate::paging::GroupInfo;
use crate::paging::HotPlan;
use crate::paging::KvShape;
use crate::paging::Limits;
use crate::paging::MemoryInput;
use crate::paging::MemoryPlan;

/// What [`plan`] decided, and what allocating it needs.
pub(super) struct Planned {
    /// The graphs' shape (architecture, hyperparameters, what they read
    /// back).
    pub dims: Dims,
    /// Batch, context and FFN chunk rows (the plan's).
    pub lim: Limits,
    /// Tokens a KV block holds (the KV tier's unit).
    pub kv_block: usize,
    /// Every group's layout in a slot.
    pub layouts: Vec<GroupLayout>,
    /// The row split's reduce buffers this device holds.
    pub n_reduce: u64,
    pub plan: MemoryPlan,
    /// What the load measured (the row split's other devices plan with
    /// the first one's).
    pub probes: Probes,
    /// The host's speed per band of step sizes, where the plan is hybrid.
    pub cpu_cal: Option<CpuCalibration>,
    /// Hot experts, and the counts they were chosen from.
    pub hot: Option<HotPlan>,
    pub hot_counted: Option<RouterCounts>,
    /// The router counts kept beside the model (`saved_counts`).
    pub saved_counts: Option<RouterCounts>,
}

/// Measures what `like` does not bring (`like`: the first device's
/// probes, for the row split's others) and plans `spec` on `device` under
/// `cfg`, whose budgets are all known.
pub(super) fn plan(
    spec: &ModelSpec,
    cfg: &EngineConfig,
    device: Device,
    backend: &Backend,
    like: Option<&Probes>,
) -> Result<Planned, EngineError> {
    let (dims, mut lim) = shape(spec, cfg)?;
    let kv_block = cfg.kv_tier.block.clamp(1, lim.n_ctx as usize);
    let layouts = store::layouts(spec, device)?;
    // the row split's reduce buffers: two devices each hold two (they
    // exchange outputs, alternating buffers group by group); with more,
    // the first one per other device
    let n_reduce = match spec.shard {
        Some(s) if s.count == 2 => 2,
        Some(s) if s.index == 0 => s.count as u64 - 1,
        _ => 0,
    };
    let dev = device_input(
        spec, cfg, device, backend, like, &dims, lim, &layouts, n_reduce, kv_block,
    )?;
    let measured_compute = dev.input.compute;
    let (input, plan) = choose_gemm(dev.input, dev.paths, device, lim)?;
    let (mut input, mut plan) = choose_widening(spec, input, plan, dev.halved, lim)?;
    let host = plan_host(spec, cfg, device, backend, like, &mut input, &mut plan, lim)?;
    lim.ffn_rows = plan.ffn_rows.unwrap_or(lim.n_batch);
    Ok(Planned {
        dims,
        lim,
        kv_block,
        layouts,
        n_reduce,
        plan,
        probes: Probes {
            copy_bw: input.copy_bw,
            compute: measured_compute,
            cpu: input.cpu.clone(),
            cpu_scales: host.cpu_scales,
        },
        cpu_cal: host.cpu_cal,
        hot: host.hot,
        hot_counted: host.hot_counted,
        saved_counts: host.saved_counts,
    })
}

/// The graphs' shape and the step's limits under `cfg`.
fn shape(spec: &ModelSpec, cfg: &EngineConfig) -> Result<(Dims, Limits), EngineError> {
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
    let lim = Limits {
        n_batch,
        n_ctx,
        ffn_rows: n_batch,
    };
    Ok((dims, lim))
}

/// The plan's input before the host CPU is measured, with what choosing
/// the large steps' kernels needs.
struct DeviceInput {
    input: MemoryInput,
    /// Which kernels multiply large steps (None: no choice here).
    paths: Option<probe::MatmulPaths>,
    /// The row split cuts its steps in halves, which may share one
    /// widened copy of each group (`choose_widening`).
    halved: bool,
}

/// The device's side of the plan's input: the groups, the fixed memory,
/// the activations, the KV cache's shape, the copy and compute rates
/// (measured here unless `like` brings them) and what ggml and the driver
/// take outside strata's buffers.
#[allow(clippy::too_many_arguments)]
fn device_input(
    spec: &ModelSpec,
    cfg: &EngineConfig,
    device: Device,
    backend: &Backend,
    like: Option<&Probes>,
    dims: &Dims,
    lim: Limits,
    layouts: &[GroupLayout],
    n_reduce: u64,
    kv_block: usize,
) -> Result<DeviceInput, EngineError> {
    let (n_batch, n_ctx) = (lim.n_batch, lim.n_ctx);
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
    let persistent_bytes = sizes::persistent_bytes(&dims.hp, lim)
        + (n_reduce + u64::from(split_on_device)) * sizes::split_rows_bytes(&dims.hp, lim);
    // the reserve for whole steps and for FFN chunks (the plan picks)
    let activations = sizes::activations(&dims.hp, lim, cfg.paging.ffn_rows);
    let n_layer = dims.hp.n_layer as usize;
    // which kernels multiply large steps; before the compute probe,
    // which then measures the chosen path
    let free0 = device.has_gemm_switch().then(|| device.memory().0);
    let paths = probe::matmul_paths(spec, device, n_batch, cfg.paging.gemm)?;
    // the compute rate, measured where anything may stream (the plan's
    // floor then includes compute: prefill is compute-bound). On a GPU
    // on a backend of its own: what the path takes from ggml's memory
    // pool (GEMM's dequantized matrix) goes with it, so the engine's
    // pool holds only what the plan reserves. On the engine's backend
    // the probe's 448 MiB stayed there for good, also where the plan
    // then dropped GEMM and reserved nothing for it: 64 sequences at
    // 12G took 12868 MiB (docs/device-runs.md, run 99).
    let compute = if let Some(p) = like {
        p.compute
    } else if !device.is_cpu() || cfg.budgets.gpu.is_some() || cfg.paging.stream_all {
        if device.is_cpu() {
            probe::device_compute(spec, device, backend, n_batch)?
        } else {
            let own = device.init_backend()?;
            probe::device_compute(spec, device, &own, n_batch)?
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
    // dequantized once for both (`choose_widening`)
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
    let input = MemoryInput {
        groups: spec
            .groups
            .iter()
            .zip(layouts)
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
        copy_bw: if let Some(p) = like {
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
    Ok(DeviceInput {
        input,
        paths,
        halved,
    })
}

/// The plan, with GEMM for large steps only where its scratch is worth
/// the resident groups it displaces: where the plan predicts the largest
/// step faster with it.
fn choose_gemm(
    input: MemoryInput,
    paths: Option<probe::MatmulPaths>,
    device: Device,
    lim: Limits,
) -> Result<(MemoryInput, MemoryPlan), EngineError> {
    let n_batch = lim.n_batch;
    let plan = crate::paging::memory_plan(&input)?;
    let (Some(p), Some(c)) = (paths, input.compute) else {
        return Ok((input, plan));
    };
    let Some(ratio) = p.mmq_over_gemm else {
        return Ok((input, plan));
    };
    let mmq = MemoryInput {
        gemm: None,
        compute: Some(ComputeRate {
            s_per_byte_n: c.s_per_byte_n * ratio,
            ..c
        }),
        ..input.clone()
    };
    let without = crate::paging::memory_plan(&mmq)?;
    if gemm::pays(&plan.placement, &without.placement, n_batch) {
        return Ok((input, plan));
    }
    tracing::info!(
        "GEMM for steps over {} rows does not pay here: a {n_batch}-token step {:.1} ms with it, {:.1} ms without",
        p.mmq_max_rows,
        plan.placement.floor_s(n_batch) * 1e3,
        without.placement.floor_s(n_batch) * 1e3
    );
    probe::drop_gemm(device, p.elements);
    Ok((mmq, without))
}

/// The plan with the row split's widened copy where it keeps GEMM
/// (`halved`), and only where the resident groups the copy displaces
/// leave the step as fast as the plan predicts it without: what it saves
/// (a dequantizing pass a group) is compute the plan's rate does not
/// itemize.
fn choose_widening(
    spec: &ModelSpec,
    input: MemoryInput,
    plan: MemoryPlan,
    halved: bool,
    lim: Limits,
) -> Result<(MemoryInput, MemoryPlan), EngineError> {
    let n_batch = lim.n_batch;
    let Some(g) = input.gemm.filter(|_| halved) else {
        return Ok((input, plan));
    };
    let Some(w) = super::buffers::Widening::plan(spec, g.mmq_max_rows, n_batch) else {
        return Ok((input, plan));
    };
    let widened = MemoryInput {
        gemm: Some(GemmPlan {
            widened: Some(w),
            ..g
        }),
        ..input.clone()
    };
    match crate::paging::memory_plan(&widened) {
        Ok(p) if p.placement.floor_s(n_batch) <= plan.placement.floor_s(n_batch) * (1.0 + 1e-9) => {
            Ok((widened, p))
        }
        _ => {
            tracing::info!(
                "the row split's halves dequantize each weight twice: a widened copy ({:.1} MiB) would displace resident groups the step needs",
                w.bytes as f64 / (1u64 << 20) as f64
            );
            Ok((input, plan))
        }
    }
}

/// What the host CPU's side of the plan decided.
#[derive(Default)]
struct HostPlan {
    cpu_cal: Option<CpuCalibration>,
    hot: Option<HotPlan>,
    hot_counted: Option<RouterCounts>,
    saved_counts: Option<RouterCounts>,
    /// Each group's CPU cost against the probe's mean (empty: none).
    cpu_scales: Vec<[f64; 2]>,
}

/// The host CPU measured (unless `like` brings it) and the plan asked
/// again with it: which streamed groups the host computes (hybrid
/// decode), an expert split's spread of picks, the look-ahead's and the
/// hot experts' memory out of the budget.
#[allow(clippy::too_many_arguments)]
fn plan_host(
    spec: &ModelSpec,
    cfg: &EngineConfig,
    device: Device,
    backend: &Backend,
    like: Option<&Probes>,
    input: &mut MemoryInput,
    plan: &mut MemoryPlan,
    lim: Limits,
) -> Result<HostPlan, EngineError> {
    let n_batch = lim.n_batch;
    // router counts kept beside the model, for hot experts and routed
    // uploads
    let saved_counts = saved_counts(spec, cfg)?;
    let cpu = match like {
        Some(p) => p.cpu.clone().map(|c| (c, p.cpu_scales.clone())),
        None => probe::cpu_input(spec, &plan.placement, input.copy_bw, device, backend, cfg)?.map(
            |(c, scales)| match spec.shard {
                // the row split: every device's host share runs on the
                // same cores, so each plan sees its share of the CPU
                Some(s) => (c.scaled(f64::from(s.count)), scales),
                None => (c, scales),
            },
        ),
    };
    let Some((c, scales)) = cpu else {
        return Ok(HostPlan {
            saved_counts,
            ..HostPlan::default()
        });
    };
    input.cpu = Some(c.clone());
    // each group's kinds of expert matrix: the plan prefers the cheaper
    // groups for the CPU
    crate::paging::set_cpu_scales(&mut input.groups, &scales);
    if cfg.paging.split.mode != crate::paging::ExpertSplit::Off {
        // an expert split gives the device each layer's most picked
        // experts: the plan costs it by how the picks spread
        if let Some(counts) = saved_counts.as_ref() {
            set_popularity(&mut input.groups, spec, counts);
        }
    }
    if cfg.paging.look_ahead > 0 && spec.hp.is_moe() {
        // the look-ahead's slots and rows out of the budget
        input.fixed_bytes += super::aheadslots::device_bytes(
            spec,
            device,
            cfg.paging.look_ahead,
            cfg.paging.look_ahead_layers,
            crate::paging::experts::HOT_MAX_TOKENS.min(n_batch),
        )?;
    }
    *plan = crate::paging::memory_plan(input)?;
    // hot experts: their pool out of the budget, so the plan again
    let hot_counted = saved_counts.clone();
    let counts = hot_counted.as_ref();
    let mut hot = None;
    if let Some(h) = hot_plan(spec, &input.groups, plan, cfg, n_batch, counts, None) {
        // the CPU's share of those groups falls by the hot sets'
        crate::paging::set_hot_shares(&mut input.groups, &h.hit);
        input.fixed_bytes += h.bytes + hot_io_bytes(spec, n_batch);
        *plan = crate::paging::memory_plan(input)?;
        // the plan moved groups (spread residency shifts them all): the
        // sets again for the groups streamed now, in the bytes reserved
        let h = hot_plan(
            spec,
            &input.groups,
            plan,
            cfg,
            n_batch,
            counts,
            Some(h.bytes),
        )
        .unwrap_or_default();
        crate::paging::set_hot_shares(&mut input.groups, &h.hit);
        hot = Some(h);
    }
    let cpu_cal = plan.placement.hybrid.is_some().then(|| {
        CpuCalibration::new(
            c,
            input.groups.clone(),
            plan.placement.resident.iter().map(|r| !r).collect(),
            plan.placement.slots,
            input.copy_bw,
        )
    });
    Ok(HostPlan {
        cpu_cal,
        hot,
        hot_counted,
        saved_counts,
        cpu_scales: scales,
    })
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
fn set_popularity(groups: &mut [GroupInfo], spec: &ModelSpec, counts: &RouterCounts) {
    for (g, s) in groups.iter_mut().zip(&spec.groups) {
        let l = s.layer as usize;
        if let Some(x) = g.experts.as_mut().filter(|_| l < counts.n_layer()) {
            let row: Vec<u64> = (0..counts.n_expert()).map(|e| counts.count(l, e)).collect();
            x.popularity = crate::paging::Popularity::from_counts(&row);
        }
    }
}

/// Streamed mixture FFN groups the host keeps a copy of: where hot experts
/// may go (`resident`, `host`: the plan's groups on the device and those
/// the host computes, None where the plan is not hybrid).
fn hot_eligible(groups: &[GroupInfo], resident: &[bool], host: Option<&[bool]>) -> Vec<bool> {
    (0..groups.len())
        .map(|i| groups[i].experts.is_some() && !resident[i] && host.is_some_and(|h| h[i]))
        .collect()
}

/// The device bytes hot experts may take: `cap` where given (the second
/// plan keeps the first's), else what the resident groups' `resident`
/// bytes hold less the pool's rows and ids (`io`), all of it for a number
/// asked, half for auto; unbounded where everything streams whatever the
/// budget (tests, benchmarks).
fn hot_budget(
    mode: crate::paging::HotExperts,
    resident: u64,
    io: u64,
    stream_all: bool,
    cap: Option<u64>,
) -> u64 {
    let room = if stream_all {
        u64::MAX
    } else {
        resident.saturating_sub(io)
    };
    match (cap, mode) {
        (Some(c), _) => c,
        (None, crate::paging::HotExperts::Auto) => room / 2,
        (None, _) => room,
    }
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
    plan: &MemoryPlan,
    cfg: &EngineConfig,
    n_batch: u32,
    counts: Option<&RouterCounts>,
    cap: Option<u64>,
) -> Option<HotPlan> {
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
    let io = hot_io_bytes(spec, n_batch);
    let budget = hot_budget(mode, resident, io, cfg.paging.stream_all, cap);
    let host = plan.placement.hybrid.as_ref().map(|h| h.host.as_slice());
    let eligible = hot_eligible(groups, &plan.placement.resident, host);
    let h = crate::paging::plan_hot(groups, &eligible, counts, mode, budget);
    (!h.is_empty()).then_some(h)
}

/// The router counts kept beside the model where hot experts, routed
/// uploads or an expert split are asked for (read once per load), None
/// where there are none or they are another model's.
fn saved_counts(spec: &ModelSpec, cfg: &EngineConfig) -> Result<Option<RouterCounts>, EngineError> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::GroupKind;
    use crate::paging::testutil::qwen3moe_30b;
    use crate::paging::HotExperts;

    #[test]
    fn hot_experts_go_only_to_streamed_mixture_groups_the_host_computes() {
        // two mixture layers, then a dense FFN group
        let mut groups = qwen3moe_30b(2, 0.0);
        groups.push(GroupInfo::dense(GroupKind::Ffn, 100));
        let resident = [true, true, false, false, false];
        let host = [false, true, false, true, true];
        assert_eq!(
            hot_eligible(&groups, &resident, Some(&host)),
            // layer 0's FFN resident (its host mark aside); layer 1's
            // streamed and on the host; the dense group has no experts
            [false, false, false, true, false]
        );
        let streamed = [false; 5];
        assert_eq!(
            hot_eligible(&groups, &streamed, Some(&[true, false, true, false, false])),
            [false; 5],
            "attention groups hold no experts"
        );
        assert_eq!(hot_eligible(&groups, &streamed, None), [false; 5]);
    }

    #[test]
    fn the_hot_pool_takes_the_resident_groups_room_half_of_it_for_auto() {
        let (resident, io) = (1000, 100);
        assert_eq!(
            hot_budget(HotExperts::Force(16), resident, io, false, None),
            900
        );
        assert_eq!(hot_budget(HotExperts::Auto, resident, io, false, None), 450);
        // the second plan keeps the first's bytes
        assert_eq!(
            hot_budget(HotExperts::Auto, resident, io, false, Some(321)),
            321
        );
        assert_eq!(
            hot_budget(HotExperts::Force(8), resident, io, false, Some(5000)),
            5000
        );
        // rows and ids larger than the resident groups: no room
        assert_eq!(hot_budget(HotExperts::Force(8), 50, io, false, None), 0);
        // everything streamed whatever the budget: the pool too
        assert_eq!(
            hot_budget(HotExperts::Force(8), 0, io, true, None),
            u64::MAX
        );
    }
}
