//! Measurements taken at load: the host-to-device copy rate and, when
//! hybrid decode may pay, the host CPU's and the device's speed per byte,
//! the hop between them and the bus's rate beside the CPU.

use super::config::host_threads;
use super::config::EngineConfig;
use super::config::Gemm;
use super::config::Hybrid;
use super::error::EngineError;
use super::host;
use crate::ggml;
use crate::ggml::Device;
use crate::ggml::{Backend, Buffer, BufferType, BufferUsage, Context, GraphAllocator};
use crate::model::GroupKind;
use crate::model::ModelSpec;
use crate::paging::{ComputeRate, PathTiming, Plan};
use std::sync::Mutex;
use std::time::Instant;

/// Each group's CPU cost against the probe's mean group
/// ([`crate::paging::Experts::cpu_scale`], by group index).
pub(super) type CpuScales = Vec<[f64; 2]>;

/// What the planner needs to know about the host CPU, measured, when the
/// plan streams FFN groups the CPU could compute instead (see
/// `paging::hybrid`); None when hybrid decode is off or cannot apply.
pub(super) fn cpu_input(
    spec: &ModelSpec,
    plan: &Plan,
    copy_bw: f64,
    device: Device,
    backend: &Backend,
    cfg: &EngineConfig,
) -> Result<Option<(crate::paging::CpuInput, CpuScales)>, EngineError> {
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
    let buft = host::cpu_weight_buft(cpu, w.ty, ne, cfg.cpu_layout());
    const PROBE_TOKENS: u32 = 16;
    // measured while the bus uploads: DMA and CPU share the host's memory
    // bandwidth in a hybrid step (on the H100 machine the CPU read 93 GB/s
    // alone, 67 GB/s beside the copies)
    let bus = Some((device, copy_bw));
    let moe = spec.hp.is_moe() && w.ne[2] > 1;
    let points = if moe {
        expert_points(spec, &cand, &cb, cfg, probe_bytes, PROBE_TOKENS, bus)?
    } else {
        CpuPoints {
            s1: measure_matmul(&cb, buft, w.ty, ne, probe_bytes, 1, bus)?,
            sn: measure_matmul(&cb, buft, w.ty, ne, probe_bytes, PROBE_TOKENS, bus)?,
            big: None,
            scales: vec![[1.0; 2]; spec.groups.len()],
        }
    };
    let gpu = measure_matmul(
        backend,
        device.buffer_type(),
        w.ty,
        ne,
        probe_bytes,
        1,
        None,
    )?;
    let bus_beside = measure_bus_beside_cpu(&cb, buft, w.ty, ne, probe_bytes, device, copy_bw)?;
    let hop = measure_hop(device, backend, spec.hp.n_embd as i64)?;
    let per_group = measure_group_overhead(device, backend, spec.hp.n_embd as i64, 12)?;
    // a host group's nodes: a mixture's routing, products and weighted sum
    // about 22, a dense FFN's about 8
    let host_nodes = if moe { 22 } else { 8 };
    let cpu_group = measure_group_overhead(cpu, &cb, spec.hp.n_embd as i64, host_nodes)?;
    let CpuPoints {
        s1,
        sn,
        big,
        scales,
    } = points;
    let c = crate::paging::CpuInput {
        s_per_byte_1: s1,
        s_per_byte_n: sn,
        probe_tokens: PROBE_TOKENS,
        big: big.map(|(n, s, _)| (n, s)),
        // the memory plan decides the room
        host_room: 0,
        hop_s: hop,
        gpu_s_per_byte: gpu,
        gpu_group_s: per_group,
        cpu_group_s: cpu_group,
        bus_bw_beside: bus_beside,
        force,
        split: cfg.paging.split,
        // the CPU device's copies run when its computation waits
        carry: cfg.paging.carry && !device.is_cpu(),
        tiers: cfg.paging.cpu_tiers,
    };
    tracing::info!(
        "hybrid probe: CPU {:.1} GB/s at 1 token, {:.1} GB/s at {PROBE_TOKENS}{}{}, {:.0} us per group; device {:.1} GB/s, {:.0} us per group; hop {:.0} us; bus {:.1} GB/s alone, {:.1} beside the CPU",
        1e-9 / s1,
        1e-9 / sn,
        big.map_or(String::new(), |(n, _, gb_s)| format!(
            ", {gb_s:.1} GB/s of picked experts at {n}"
        )),
        if moe { " (its experts' product)" } else { "" },
        cpu_group * 1e6,
        1e-9 / gpu,
        per_group * 1e6,
        hop * 1e6,
        copy_bw / 1e9,
        bus_beside.unwrap_or(copy_bw) / 1e9,
    );
    Ok(Some((c, scales)))
}

/// The CPU's three points and each group's cost against their mean
/// ([`crate::paging::Experts::cpu_scale`], by group index).
struct CpuPoints {
    s1: f64,
    sn: f64,
    /// Tokens, seconds per byte and the log's GB/s of picked experts.
    big: Option<(u32, f64, f64)>,
    scales: Vec<[f64; 2]>,
}

/// A mixture's points, from its experts' product (`mul_mat_id`, which a
/// host group spends its time in): each kind of expert matrix the
/// candidate groups `cand` hold, timed once at one token, at
/// `probe_tokens` and, for batches, at the largest hybrid step, and
/// weighted by its bytes over them (the largest step because the line
/// through 1 and 16 tokens missed a mixture's time at 64 by 0.65-0.83x,
/// runs 154-158). In llama.cpp's Q4_K_M mix half the layers' `ffn_down`
/// is Q6_K, whose product (plain memory on x86) ran 21-25 GB/s at 64
/// tokens where Q4_K's repacked one ran 30-34 (run 182): a dense product
/// of the largest matrix read the host 1.2-1.4x slow at one token and at
/// 64, and each group's own mix sets its cost.
fn expert_points(
    spec: &ModelSpec,
    cand: &[usize],
    cb: &Backend,
    cfg: &EngineConfig,
    probe_bytes: u64,
    probe_tokens: u32,
    bus: Option<(Device, f64)>,
) -> Result<CpuPoints, EngineError> {
    type Kind = (crate::dtype::GgmlType, [i64; 3]);
    let key = |x: &crate::model::WeightSpec| (x.ty, [x.ne[0], x.ne[1], x.ne[2]]);
    let mut kinds: Vec<(Kind, u64)> = Vec::new();
    for &i in cand {
        for x in spec.groups[i].weights.iter().filter(|x| x.ne[2] > 1) {
            match kinds.iter_mut().find(|(k, _)| *k == key(x)) {
                Some((_, b)) => *b += x.size,
                None => kinds.push((key(x), x.size)),
            }
        }
    }
    let big_n =
        (cfg.n_batch > probe_tokens).then(|| crate::paging::HYBRID_MAX_TOKENS.min(cfg.n_batch));
    let tokens: Vec<u32> = [1, probe_tokens].into_iter().chain(big_n).collect();
    // the probe's bytes shared among the kinds, each still more than a
    // server's last-level cache (run 187: 680 MiB a kind read the host as
    // 2 GiB did, 36.2 against 35.3-37.8 GB/s)
    let per_kind = (probe_bytes / kinds.len().max(1) as u64)
        .max(512 << 20)
        .min(probe_bytes);
    let cpu = cb.device();
    // per kind: seconds per byte of its stacked tensors at each of `tokens`
    let mut rate: Vec<(Kind, Vec<f64>)> = Vec::with_capacity(kinds.len());
    for &((ty, ne3), _) in &kinds {
        let kb = host::cpu_weight_buft(cpu, ty, [ne3[0], ne3[1]], cfg.cpu_layout());
        let (t, b) = measure_expert_matmul(
            cb,
            kb,
            ty,
            ne3,
            spec.hp.n_expert_used,
            per_kind,
            &tokens,
            bus,
        )?;
        rate.push(((ty, ne3), t.iter().map(|s| s / b.max(1) as f64).collect()));
    }
    let rate_of = |k: Kind| rate.iter().find(|r| r.0 == k).map(|r| &r.1);
    // the candidates' mean group: each kind's share
    let each: u64 = kinds.iter().map(|&(_, b)| b).sum::<u64>() / cand.len().max(1) as u64;
    let mean_secs: Vec<f64> = (0..tokens.len())
        .map(|j| {
            kinds
                .iter()
                .zip(&rate)
                .map(|(&(_, b), (_, r))| b as f64 / cand.len().max(1) as f64 * r[j])
                .sum()
        })
        .collect();
    let w = &spec.groups[cand[0]].weights;
    let n_expert = w.iter().map(|x| x.ne[2]).max().unwrap_or(1) as u32;
    let mean = crate::paging::GroupInfo {
        kind: GroupKind::Ffn,
        bytes: each,
        experts: Some(crate::paging::Experts {
            bytes: each,
            n_expert,
            n_used: spec.hp.n_expert_used,
            hot: 0.0,
            popularity: None,
            cpu_scale: [1.0; 2],
        }),
    };
    let s1 = mean_secs[0] / mean.read_bytes(1).max(1) as f64;
    let sn = crate::paging::s_per_byte_at(&mean, probe_tokens, mean_secs[1], s1);
    let big = big_n.map(|n| {
        let secs = mean_secs[2];
        // the log's figure: the bytes of the experts the step picked
        let gb_s = mean.read_bytes(n) as f64 / secs / 1e9;
        (n, crate::paging::s_per_byte_at(&mean, n, secs, s1), gb_s)
    });
    // each candidate's seconds against the mean group's for its bytes, at
    // one token and at the largest step measured
    let last = tokens.len() - 1;
    let scales = (0..spec.groups.len())
        .map(|i| {
            let ws: Vec<_> = spec.groups[i]
                .weights
                .iter()
                .filter(|x| x.ne[2] > 1)
                .collect();
            let bytes: u64 = ws.iter().map(|x| x.size).sum();
            let mut out = [1.0; 2];
            if !cand.contains(&i) || bytes == 0 {
                return out;
            }
            for (o, j) in out.iter_mut().zip([0, last]) {
                let secs: Option<f64> = ws
                    .iter()
                    .map(|x| rate_of(key(x)).map(|r| x.size as f64 * r[j]))
                    .sum();
                let mean_for = mean_secs[j] * bytes as f64 / each.max(1) as f64;
                if let Some(s) = secs.filter(|_| mean_for > 0.0) {
                    *o = s / mean_for;
                }
            }
            out
        })
        .collect();
    Ok(CpuPoints {
        s1,
        sn,
        big,
        scales,
    })
}

/// The device's compute speed per weight byte at one token and at a step
/// of `n_batch` tokens, over the model's largest FFN matrix (the groups'
/// bulk), its rows cut so each product stays near `flops` (a few
/// milliseconds on a GPU, on the CPU device a few dozen). The memory plan
/// predicts every step's compute from it (see `paging::ComputeRate`).
pub(super) fn device_compute(
    spec: &ModelSpec,
    device: Device,
    backend: &Backend,
    n_batch: u32,
) -> Result<Option<ComputeRate>, EngineError> {
    let Some(w) = spec
        .groups
        .iter()
        .filter(|g| g.kind == GroupKind::Ffn)
        .flat_map(|g| g.weights.iter())
        .filter(|w| w.ne.len() >= 2 && w.ne[1] > 1)
        .max_by_key(|w| w.size)
    else {
        return Ok(None);
    };
    let flops = if device.is_cpu() { 5e8 } else { 2e12 };
    let n = n_batch.max(1);
    let rows = (flops / (2.0 * w.ne[0] as f64 * n as f64)) as i64 / 32 * 32;
    let ne = [w.ne[0], rows.clamp(32, w.ne[1])];
    let buft = device.buffer_type();
    let s1 = measure_matmul(backend, buft, w.ty, ne, 0, 1, None)?;
    let sn = if n > 1 {
        measure_matmul(backend, buft, w.ty, ne, 0, n, None)?
    } else {
        s1
    };
    tracing::info!(
        "compute probe: {} [{}, {}]: {:.1} GB/s at 1 token, {:.1} TFLOPS at {n}",
        w.ty,
        ne[0],
        ne[1],
        1e-9 / s1,
        // 2 flops per weight element and token
        2.0 * (ne[0] * ne[1]) as f64 * n as f64
            / (sn * crate::ggml::row_size(w.ty, ne[0]) as f64 * ne[1] as f64)
            / 1e12,
    );
    Ok(Some(ComputeRate {
        s_per_byte_1: s1,
        s_per_byte_n: sn,
        n,
    }))
}

/// Step sizes the path probe times (those up to the step limit, and the
/// limit itself).
const PATH_ROWS: [u32; 6] = [64, 128, 256, 512, 1024, 2048];

/// The matmul path this process chose, with the elements of the matrix it
/// was probed on: ggml's switch is one setting for the whole process, so
/// the engine with the largest matrix decides and the others (a draft model
/// beside its target) follow it.
static PATH_LIMIT: Mutex<Option<(u64, Option<u32>)>> = Mutex::new(None);

/// Gives ggml's own choice of kernels back to the process (llama.cpp as a
/// reference must run as its users run it); the next engine to load probes
/// afresh. Engines loaded before keep their plans but not their path.
pub fn reset_matmul_path() {
    let mut decided = PATH_LIMIT.lock().unwrap_or_else(|e| e.into_inner());
    if let Ok(Some(gpu)) = crate::ggml::gpu_device() {
        gpu.set_mmq_max_rows(None);
    }
    *decided = None;
}

/// The model's largest layer matrix: its type and shape.
fn largest_matrix(spec: &ModelSpec) -> Option<(crate::dtype::GgmlType, [i64; 2])> {
    spec.groups
        .iter()
        .flat_map(|g| g.weights.iter())
        .filter(|w| w.ne.len() >= 2 && w.ne[1] > 1)
        .max_by_key(|w| w.ne[0] * w.ne[1])
        .map(|w| (w.ty, [w.ne[0], w.ne[1]]))
}

/// What [`matmul_paths`] chose.
#[derive(Clone, Copy, Debug)]
pub(super) struct MatmulPaths {
    /// Products of more rows than this go through GEMM.
    pub mmq_max_rows: u32,
    /// Elements of the largest layer matrix (the scratch GEMM needs).
    pub elements: u64,
    /// MMQ's time over GEMM's at a step of `n_batch` rows, as probed; None
    /// where the path was given or chosen by an earlier engine.
    pub mmq_over_gemm: Option<f64>,
}

/// Chooses which kernels multiply each step size on `device` and sets
/// ggml's switch (see `paging::gemm`): under [`Gemm::Auto`] the model's
/// largest layer matrix is timed through ggml's quantized kernels and
/// through dequantize + BF16 GEMM at each of [`PATH_ROWS`] up to
/// `n_batch`, and GEMM takes the sizes from the crossover up. None where
/// every size keeps the quantized kernels (no switch in the device's
/// module, steps too small, [`Gemm::Off`], or GEMM never faster).
pub(super) fn matmul_paths(
    spec: &ModelSpec,
    device: Device,
    n_batch: u32,
    gemm: Gemm,
) -> Result<Option<MatmulPaths>, EngineError> {
    let Some((ty, ne)) = largest_matrix(spec) else {
        return Ok(None);
    };
    if !device.has_gemm_switch() || ty.block_size().is_none_or(|b| b <= 1) {
        return Ok(None);
    }
    let elements = (ne[0] * ne[1]) as u64;
    let mut decided = PATH_LIMIT.lock().unwrap_or_else(|e| e.into_inner());
    let chosen = |limit: Option<u32>, ratio: Option<f64>| {
        limit.filter(|&r| n_batch > r).map(|r| MatmulPaths {
            mmq_max_rows: r,
            elements,
            mmq_over_gemm: ratio,
        })
    };
    if let Some((probed, limit)) = *decided {
        if probed >= elements {
            return Ok(chosen(limit, None));
        }
    }
    let mut ratio = None;
    let limit = match gemm {
        Gemm::Off => None,
        Gemm::Above(r) => Some(r),
        Gemm::Auto => {
            let mut sizes: Vec<u32> = PATH_ROWS.iter().copied().filter(|&r| r < n_batch).collect();
            if n_batch >= PATH_ROWS[0] {
                sizes.push(n_batch);
            }
            let buft = device.buffer_type();
            // each path on a backend of its own: ggml's CUDA backend
            // replays a graph it captured before when the next one looks
            // the same, kernels included, so a second measurement on one
            // backend could time the first path again
            let timed = |limit: Option<u32>, rows: u32| -> Result<f64, EngineError> {
                device.set_mmq_max_rows(limit);
                let b = device.init_backend()?;
                measure_matmul(&b, buft, ty, ne, 0, rows, None)
            };
            let mut table = Vec::new();
            for &rows in &sizes {
                let mmq_s = timed(None, rows)?;
                let gemm_s = timed(Some(0), rows)?;
                table.push(PathTiming {
                    rows,
                    mmq_s,
                    gemm_s,
                });
            }
            let limit = crate::paging::choose_mmq_max_rows(&table);
            ratio = table.last().map(|p| p.mmq_s / p.gemm_s);
            // per weight byte, as the compute probe reports
            let bytes = crate::ggml::row_size(ty, ne[0]) as f64 * ne[1] as f64;
            let tflops = |s: f64, rows: u32| 2.0 * elements as f64 * rows as f64 / s / 1e12;
            let rows: Vec<String> = table
                .iter()
                .map(|p| {
                    format!(
                        "{} rows {:.0}/{:.0} TFLOPS",
                        p.rows,
                        tflops(p.mmq_s * bytes, p.rows),
                        tflops(p.gemm_s * bytes, p.rows)
                    )
                })
                .collect();
            tracing::info!(
                "matmul path probe, {ty} [{}, {}], MMQ/GEMM: {}; {}",
                ne[0],
                ne[1],
                rows.join(", "),
                match limit {
                    Some(r) => format!("GEMM above {r} rows"),
                    None => "MMQ at every size".into(),
                }
            );
            limit
        }
    };
    device.set_mmq_max_rows(limit);
    *decided = Some((elements, limit));
    Ok(chosen(limit, ratio))
}

/// The memory plan decided the GEMM path does not pay (see
/// `paging::gemm::pays`): ggml's kernels at every size for this process.
pub(super) fn drop_gemm(device: Device, elements: u64) {
    let mut decided = PATH_LIMIT.lock().unwrap_or_else(|e| e.into_inner());
    device.set_mmq_max_rows(None);
    *decided = Some((elements, None));
}

/// Measures host-to-device copy bandwidth (bytes/s) from pinned memory on a
/// separate backend instance, as the pager copies. On the CPU it measures a
/// plain memory copy.
pub fn measure_h2d(device: Device, bytes: usize, reps: usize) -> Result<f64, EngineError> {
    use crate::ggml::{Buffer, BufferUsage, Context};
    // host memory as the pager copies from (buffers::alloc_host): the
    // device's pinned type, or plain CPU memory (the CPU device, a remote
    // device, a device without a host type)
    let host_buft = match device.host_buffer_type() {
        Some(h) if !device.is_cpu() && !device.is_remote() => h,
        _ => crate::ggml::cpu_device()?.buffer_type(),
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

/// Calls `f` with a graph of matrix-vector products over about `bytes` of
/// weights of type `ty` and shape `ne` (several matrices, so caches do not
/// hold them) placed in `buft`, `n_tokens` columns each, on `backend`: `f`
/// gets a function computing the graph once and the bytes one run reads.
fn with_matmul_probe<R>(
    backend: &Backend,
    buft: BufferType,
    ty: crate::dtype::GgmlType,
    ne: [i64; 2],
    bytes: u64,
    n_tokens: u32,
    f: impl FnOnce(&mut dyn FnMut() -> Result<(), EngineError>, usize) -> Result<R, EngineError>,
) -> Result<R, EngineError> {
    let ctx = Context::new(512, 512)?;
    let (_wbuf, ws) = zeroed_weights(&ctx, buft, ty, &ne, bytes, 200)?;
    let read = ws.iter().map(|w| w.nbytes()).sum();
    let x = ctx.new_tensor(crate::dtype::GgmlType::F32, &[ne[0], n_tokens as i64]);
    let xbuf = Buffer::alloc(backend.device().buffer_type(), x.nbytes(), BufferUsage::Any)?;
    xbuf.place(x, 0)?;
    x.set_f32(&vec![0.5f32; (ne[0] * n_tokens as i64) as usize])?;
    let mut g = ctx.new_graph(512);
    for &w in &ws {
        g.expand(ctx.mul_mat(w, x));
    }
    let mut alloc = GraphAllocator::new(backend.device().buffer_type())?;
    alloc.alloc(&g)?;
    let mut run = || backend.compute(&g).map_err(EngineError::from);
    // warm-up
    run()?;
    f(&mut run, read)
}

/// Zeroed tensors of `ty` and shape `ne` in one buffer of `buft`, as many
/// as about `bytes` hold (1 to `most`), each written whole, so a repacked
/// buffer repacks them. The buffer holds their memory.
fn zeroed_weights<'c>(
    ctx: &'c Context,
    buft: BufferType,
    ty: crate::dtype::GgmlType,
    ne: &[i64],
    bytes: u64,
    most: usize,
) -> Result<(Buffer, Vec<crate::ggml::Tensor<'c>>), EngineError> {
    let probe = ctx.new_tensor(ty, ne);
    let each = probe.nbytes().max(1);
    let count = (bytes as usize / each).clamp(1, most);
    let a = buft.alignment();
    let stride = buft.alloc_size(probe).div_ceil(a) * a;
    let buf = Buffer::alloc(buft, stride * count, BufferUsage::Weights)?;
    buf.clear(0);
    let zeros = vec![0u8; each];
    let mut ws = Vec::with_capacity(count);
    for i in 0..count {
        let w = ctx.new_tensor(ty, ne);
        buf.place(w, i * stride)?;
        w.set_bytes(&zeros, 0)?;
        ws.push(w);
    }
    Ok((buf, ws))
}

/// The fastest of `n` runs of `run` (warmed up before), while `bus` (a
/// device and its copy rate) uploads where given (see [`BusLoad`]).
fn best_of(
    n: usize,
    run: &mut dyn FnMut() -> Result<(), EngineError>,
    bus: Option<(Device, f64)>,
) -> Result<f64, EngineError> {
    // uploads for longer than the timed runs take
    let _load = match bus {
        Some((dev, bw)) => BusLoad::start(dev, bw, 0.4)?,
        None => None,
    };
    let mut best = f64::MAX;
    for _ in 0..n.max(1) {
        let t0 = Instant::now();
        run()?;
        best = best.min(t0.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// Seconds per weight byte of a step of `n_tokens` tokens on `backend`
/// over about `bytes` of weights of type `ty` and shape `ne` placed in
/// `buft` (a repacked CPU layout, the device's memory). The best of three
/// timed runs after a warm-up; with `bus` (a device and its copy rate),
/// while that device's bus uploads (see [`BusLoad`]).
pub fn measure_matmul(
    backend: &Backend,
    buft: BufferType,
    ty: crate::dtype::GgmlType,
    ne: [i64; 2],
    bytes: u64,
    n_tokens: u32,
    bus: Option<(Device, f64)>,
) -> Result<f64, EngineError> {
    with_matmul_probe(backend, buft, ty, ne, bytes, n_tokens, |run, read| {
        Ok(best_of(3, run, bus)? / read as f64)
    })
}

/// Seconds a step of each of `tokens` tokens takes over one stacked
/// expert tensor of type `ty` and shape `ne` ([k, m, n_expert]) placed in
/// `buft`, each token routed to `n_used` distinct experts drawn uniformly
/// (a random router's picks), and the tensor's bytes: `mul_mat_id` over
/// about `bytes` of such tensors (written once for every step size), the
/// best of three timed runs after a warm-up; with `bus`, while that
/// device's bus uploads.
#[allow(clippy::too_many_arguments)]
pub fn measure_expert_matmul(
    backend: &Backend,
    buft: BufferType,
    ty: crate::dtype::GgmlType,
    ne: [i64; 3],
    n_used: u32,
    bytes: u64,
    tokens: &[u32],
    bus: Option<(Device, f64)>,
) -> Result<(Vec<f64>, u64), EngineError> {
    let n_expert = ne[2].max(1);
    let used = i64::from(n_used).clamp(1, n_expert);
    let wctx = Context::new(128, 0)?;
    let (_wbuf, ws) = zeroed_weights(&wctx, buft, ty, &ne, bytes, 64)?;
    let mut secs = Vec::with_capacity(tokens.len());
    for &t in tokens {
        let n = i64::from(t.max(1));
        let ctx = Context::new(256, 256)?;
        let x = ctx.new_tensor(crate::dtype::GgmlType::F32, &[ne[0], used, n]);
        let ids = ctx.new_tensor(crate::dtype::GgmlType::I32, &[used, n]);
        let mut g = ctx.new_graph(256);
        for &w in &ws {
            g.expand(ctx.mul_mat_id(w, x, ids));
        }
        let ibuft = backend.device().buffer_type();
        let a = ibuft.alignment();
        let inputs = Buffer::alloc(ibuft, x.nbytes() + ids.nbytes() + 2 * a, BufferUsage::Any)?;
        inputs.place(x, 0)?;
        inputs.place(ids, x.nbytes().div_ceil(a) * a)?;
        x.set_f32(&vec![0.5f32; x.nbytes() / 4])?;
        let mut alloc = GraphAllocator::new(ibuft)?;
        alloc.alloc(&g)?;
        // new picks every run: the experts of a run before stay in the
        // host's last-level cache (run 188: 8 of 128 experts of 512 MiB
        // read 131 GB/s at one token where the engine's steps, whose
        // layers each pick anew, read 53)
        let mut r = 0;
        let mut run = || {
            ids.set_i32(&run_picks(n_expert as u32, used as u32, n as u32, r))?;
            r += 1;
            backend.compute(&g).map_err(EngineError::from)
        };
        // warm-up
        run()?;
        // steps of a few tokens take a millisecond or less, and one of
        // three was at times slow throughout (run 189: 35 GB/s at one
        // token in one load, 51-57 in others, the engine's steps then at
        // 0.64x its time): more runs, as many as one token's picks stay new
        let runs = if t <= 16 { 8 } else { 3 };
        secs.push(best_of(runs, &mut run, bus)? / ws.len() as f64);
    }
    Ok((secs, ws[0].nbytes() as u64))
}

/// The picks of a probe's run `run`: one token's are the `n_used`
/// experts after the previous run's (none read again within `n_expert /
/// n_used` runs); more tokens' are drawn uniformly, anew each run.
fn run_picks(n_expert: u32, n_used: u32, n_tokens: u32, run: u32) -> Vec<i32> {
    if n_tokens == 1 {
        let used = n_used.min(n_expert);
        return (0..used)
            .map(|j| ((run * used + j) % n_expert) as i32)
            .collect();
    }
    uniform_picks(n_expert, n_used, n_tokens, run)
}

/// `n_used` distinct experts of `n_expert` for each of `n_tokens` tokens,
/// drawn uniformly by a fixed generator (the same picks every load for a
/// `seed`).
fn uniform_picks(n_expert: u32, n_used: u32, n_tokens: u32, seed: u32) -> Vec<i32> {
    // never zero (xorshift's fixed point): the constant's halves differ,
    // the seed's are equal
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15 ^ (u64::from(seed) << 32 | u64::from(seed));
    let mut out = Vec::with_capacity((n_used * n_tokens) as usize);
    for _ in 0..n_tokens {
        let start = out.len();
        while out.len() - start < n_used.min(n_expert) as usize {
            // xorshift64
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let e = (state % u64::from(n_expert)) as i32;
            if !out[start..].contains(&e) {
                out.push(e);
            }
        }
    }
    out
}

/// The host-to-device copy rate (bytes/s) of `device` while the CPU
/// computes one-token products on `cpu` over weights as in
/// [`measure_matmul`]: the copies and the CPU share the host's memory
/// bandwidth in a hybrid step, and the bus is the slower for it (H100 run
/// 12: 49.7 GB/s in hybrid steps, 54.2 streaming alone). About 0.3 s of
/// 256 MiB copies on their own thread, the CPU computing until they are
/// done. None on the CPU device.
#[allow(clippy::too_many_arguments)]
pub fn measure_bus_beside_cpu(
    cpu: &Backend,
    buft: BufferType,
    ty: crate::dtype::GgmlType,
    ne: [i64; 2],
    bytes: u64,
    device: Device,
    copy_bw: f64,
) -> Result<Option<f64>, EngineError> {
    if device.is_cpu() {
        return Ok(None);
    }
    const CHUNK: usize = 256 << 20;
    let reps = ((0.3 * copy_bw) / CHUNK as f64).ceil().clamp(2.0, 32.0) as usize;
    with_matmul_probe(cpu, buft, ty, ne, bytes, 1, |run, _| {
        let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let copies = {
            let done = done.clone();
            std::thread::spawn(move || {
                let r = measure_h2d(device, CHUNK, reps);
                done.store(true, std::sync::atomic::Ordering::Release);
                r
            })
        };
        let mut computed = Ok(());
        while computed.is_ok() && !done.load(std::sync::atomic::Ordering::Acquire) {
            computed = run();
        }
        let bw = copies
            .join()
            .map_err(|_| EngineError::Unsupported("the bus probe's thread panicked"))??;
        computed?;
        Ok(Some(bw))
    })
}

/// Uploads keeping the bus busy for a while: a copy stream of a device
/// uploading from pinned host memory, so a CPU measurement meanwhile sees
/// the host memory bandwidth the copies take, as in a hybrid step.
pub struct BusLoad {
    // field order is drop order: the stream drains before the buffers go
    copy: Backend,
    _ctx: Context,
    _dev: Buffer,
    _host: Buffer,
}

impl BusLoad {
    /// About `seconds` of uploads at `copy_bw` bytes/s; None on the CPU
    /// device (nothing to load the bus with).
    pub fn start(
        device: Device,
        copy_bw: f64,
        seconds: f64,
    ) -> Result<Option<BusLoad>, EngineError> {
        let Some(host_buft) = device.host_buffer_type().filter(|_| !device.is_cpu()) else {
            return Ok(None);
        };
        const CHUNK: usize = 256 << 20;
        let host = Buffer::alloc(host_buft, CHUNK, BufferUsage::Any)?;
        let dev = Buffer::alloc(device.buffer_type(), CHUNK, BufferUsage::Any)?;
        let ctx = Context::new(2, 0)?;
        let t = ctx.new_tensor(crate::dtype::GgmlType::I8, &[CHUNK as i64]);
        dev.place(t, 0)?;
        let copy = device.init_backend()?;
        // SAFETY: the host buffer holds CHUNK bytes, nothing writes it, and
        // it outlives the copies: BusLoad drains the stream before freeing.
        let src = unsafe { std::slice::from_raw_parts(host.base(), CHUNK) };
        let n = ((seconds * copy_bw) / CHUNK as f64).ceil().clamp(1.0, 64.0) as usize;
        for _ in 0..n {
            // SAFETY: as above; the device tensor is only a copy target.
            unsafe { copy.tensor_set_async(t, src, 0) };
        }
        Ok(Some(BusLoad {
            copy,
            _ctx: ctx,
            _dev: dev,
            _host: host,
        }))
    }
}

impl Drop for BusLoad {
    fn drop(&mut self) {
        self.copy.synchronize();
    }
}

/// Seconds one residual hop of one token costs on `device`, the way a
/// hybrid step pays it around each CPU group: upload the rows, launch a
/// small graph on them, drain the stream, download the rows. The best of 20.
pub fn measure_hop(device: Device, backend: &Backend, n_embd: i64) -> Result<f64, EngineError> {
    let ctx = Context::new(8, 8)?;
    let x = ctx.new_tensor(crate::dtype::GgmlType::F32, &[n_embd]);
    let buf = Buffer::alloc(device.buffer_type(), x.nbytes(), BufferUsage::Any)?;
    buf.place(x, 0)?;
    let mut g = ctx.new_graph(8);
    g.expand(ctx.cpy(ctx.rms_norm(x, 1e-5), x));
    let mut alloc = GraphAllocator::new(device.buffer_type())?;
    alloc.alloc(&g)?;
    let mut v = vec![0f32; n_embd as usize];
    let mut best = f64::MAX;
    for _ in 0..20 {
        let t0 = Instant::now();
        x.set_f32(&v)?;
        backend.compute_async(&g)?;
        backend.synchronize();
        x.get_f32(&mut v)?;
        best = best.min(t0.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// Seconds a small group graph costs on `backend` beyond its weight reads:
/// a chain of `nodes` tiny ones (a device group launches about 12
/// kernels at decode; on the CPU each node ends at a barrier of its
/// threads) computed and drained, the best of 20.
pub fn measure_group_overhead(
    device: Device,
    backend: &Backend,
    n_embd: i64,
    nodes: usize,
) -> Result<f64, EngineError> {
    let ctx = Context::new(nodes + 8, nodes + 8)?;
    let x = ctx.new_tensor(crate::dtype::GgmlType::F32, &[n_embd]);
    let buf = Buffer::alloc(device.buffer_type(), x.nbytes(), BufferUsage::Any)?;
    buf.place(x, 0)?;
    x.set_f32(&vec![1.0f32; n_embd as usize])?;
    let mut g = ctx.new_graph(nodes + 8);
    let mut cur = x;
    for _ in 0..nodes {
        cur = ctx.rms_norm(cur, 1e-5);
    }
    g.expand(cur);
    let mut alloc = GraphAllocator::new(device.buffer_type())?;
    alloc.alloc(&g)?;
    let mut best = f64::MAX;
    for _ in 0..20 {
        let t0 = Instant::now();
        backend.compute_async(&g)?;
        backend.synchronize();
        best = best.min(t0.elapsed().as_secs_f64());
    }
    Ok(best)
}

#[cfg(test)]
mod tests {
    use super::run_picks;

    #[test]
    fn a_probes_runs_pick_distinct_experts() {
        // one token: no expert read again within n_expert / n_used runs
        let mut seen = std::collections::HashSet::new();
        for r in 0..16 {
            for e in run_picks(128, 8, 1, r) {
                assert!((0..128).contains(&e));
                assert!(seen.insert(e), "expert {e} again in run {r}");
            }
        }
        // more tokens: each token's picks distinct, runs differ
        let a = run_picks(128, 8, 64, 0);
        assert_eq!(a.len(), 64 * 8);
        for t in a.chunks(8) {
            let s: std::collections::HashSet<_> = t.iter().collect();
            assert_eq!(s.len(), 8);
        }
        assert_ne!(a, run_picks(128, 8, 64, 1));
        assert_eq!(a, run_picks(128, 8, 64, 0));
        // fewer experts than picks: each token takes them all
        assert_eq!(run_picks(4, 8, 1, 3).len(), 4);
    }
}
