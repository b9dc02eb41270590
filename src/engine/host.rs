//! Hybrid decode, the execution side: the layer groups the host CPU
//! computes (see `paging::hybrid` for which and why) from its own repacked
//! copy of their weights, on a CPU backend of its own, while the device's
//! copy stream keeps uploading the groups the GPU computes.
//!
//! The residual stream hops between the device and the host around each
//! run of CPU groups: the engine drains the compute stream, downloads the
//! rows, the CPU computes, the rows go back up. At decode that is a few
//! tens of KB each way.

use super::buffers::{self, Persistent};
use super::cpuweights::CpuWeights;
use super::error::EngineError;
use super::model_file::ModelFile;
use crate::ggml::{
    Backend, Buffer, BufferType, BufferUsage, Context, Device, GraphAllocator, Tensor,
};
use crate::graph::{BindId, Dims, Limits, Template, TemplateKey};
use crate::model::{GroupId, ModelSpec};
use indicatif::ProgressBar;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// What the CPU did in one step.
#[derive(Clone, Copy, Debug, Default)]
pub struct HostStats {
    pub groups: u64,
    pub bytes: u64,
    pub compute: Duration,
    /// Host time in residual hops (drain, download, upload).
    pub hops: Duration,
}

pub struct HostCompute {
    // field order is drop order: graphs before the buffers they point into
    templates: HashMap<TemplateKey, Template>,
    allocator: GraphAllocator,
    alloc_size: usize,
    backend: Backend,
    persistent: Persistent,
    weights: CpuWeights,
    /// Group index -> its set in `weights`.
    set_of: HashMap<usize, usize>,
    group_bytes: HashMap<usize, u64>,
    dims: Dims,
    pub lim: Limits,
    x: Vec<f32>,
    pub stats: HostStats,
}

impl HostCompute {
    /// Loads the CPU copies of the groups marked in `host` (repacked
    /// unless `repack` is false).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        spec: &ModelSpec,
        dims: &Dims,
        lim: Limits,
        host: &[bool],
        file: &ModelFile,
        n_threads: usize,
        poll: u32,
        repack: bool,
        bar: &ProgressBar,
    ) -> Result<HostCompute, EngineError> {
        let cpu = crate::ggml::cpu_device()?;
        let mut backend = cpu.init_backend()?;
        backend.set_n_threads(n_threads);
        backend.attach_cpu_threadpool(n_threads, poll)?;
        let gis: Vec<usize> = (0..host.len()).filter(|&i| host[i]).collect();
        let sets: Vec<Vec<&crate::model::WeightSpec>> = gis
            .iter()
            .map(|&i| spec.groups[i].weights.iter().collect())
            .collect();
        let weights = CpuWeights::load(cpu, &sets, file, repack, bar)?;
        let persistent = Persistent::alloc(dims, lim, cpu)?;
        Ok(HostCompute {
            templates: HashMap::new(),
            allocator: GraphAllocator::new(cpu.buffer_type())?,
            alloc_size: 0,
            backend,
            persistent,
            set_of: gis.iter().enumerate().map(|(s, &g)| (g, s)).collect(),
            group_bytes: gis.iter().map(|&g| (g, spec.groups[g].bytes())).collect(),
            weights,
            dims: dims.clone(),
            lim,
            x: Vec::new(),
            stats: HostStats::default(),
        })
    }

    /// Host bytes of the CPU copies (repacked and plain).
    pub fn bytes(&self) -> u64 {
        self.weights.repacked_bytes + self.weights.plain_bytes
    }
    pub fn repacked_bytes(&self) -> u64 {
        self.weights.repacked_bytes
    }

    /// Lets the pool threads sleep (between steps).
    pub fn park_threads(&self) {
        self.backend.park_threads();
    }

    /// Copies the first `rows` rows of the device residual `x` to the host.
    /// The device's compute stream must be drained.
    pub fn download(&mut self, x: Tensor<'_>, rows: u32) -> Result<(), EngineError> {
        let t0 = Instant::now();
        let n = rows as usize * self.dims.hp.n_embd as usize;
        self.x.resize(n, 0.0);
        x.get_bytes(bytemuck::cast_slice_mut(&mut self.x), 0)?;
        self.persistent
            .tensor(buffers::X)
            .set_bytes(bytemuck::cast_slice(&self.x), 0)?;
        self.stats.hops += t0.elapsed();
        Ok(())
    }

    /// Copies the first `rows` rows of the host residual back to the
    /// device's `x` (whose compute stream is idle: it waited for the CPU).
    pub fn upload(&mut self, x: Tensor<'_>, rows: u32) -> Result<(), EngineError> {
        let t0 = Instant::now();
        let n = rows as usize * self.dims.hp.n_embd as usize;
        self.x.resize(n, 0.0);
        self.persistent
            .tensor(buffers::X)
            .get_bytes(bytemuck::cast_slice_mut(&mut self.x), 0)?;
        x.set_bytes(bytemuck::cast_slice(&self.x), 0)?;
        self.stats.hops += t0.elapsed();
        Ok(())
    }

    /// Computes group `gi` (the template `key` describes) on the CPU, on
    /// the host residual.
    pub fn compute(&mut self, gi: GroupId, key: &TemplateKey) -> Result<(), EngineError> {
        let set = *self
            .set_of
            .get(&gi.index())
            .expect("the plan only gives the CPU groups it has copies of");
        if !self.templates.contains_key(key) {
            let mut t = Template::build(key, &self.dims, self.lim)?;
            t.bind_externals(&self.persistent.bindings);
            t.bind(BindId::resident(gi), &self.weights.sets[set], None);
            // one activation buffer for every CPU template (they run one at
            // a time, synchronously): when it grows, the others re-allocate
            self.allocator.alloc(&t.graph())?;
            let size = self.allocator.buffer_size();
            if size != self.alloc_size {
                self.alloc_size = size;
                self.templates.clear();
            }
            t.allocated = true;
            self.templates.insert(key.clone(), t);
        }
        let t = self.templates.get_mut(key).expect("template exists");
        if !t.allocated {
            self.allocator.alloc(&t.graph())?;
            t.allocated = true;
        }
        let t0 = Instant::now();
        self.backend.compute(&t.graph())?;
        self.stats.compute += t0.elapsed();
        self.stats.groups += 1;
        self.stats.bytes += self.group_bytes.get(&gi.index()).copied().unwrap_or(0);
        Ok(())
    }
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
    let probe = ctx.new_tensor(ty, &ne);
    let each = probe.nbytes().max(1);
    let count = (bytes as usize / each).clamp(1, 200);
    let a = buft.alignment();
    let stride = buft.alloc_size(probe).div_ceil(a) * a;
    let wbuf = Buffer::alloc(buft, stride * count, BufferUsage::Weights)?;
    wbuf.clear(0);
    let zeros = vec![0u8; each];
    let mut ws = Vec::with_capacity(count);
    for i in 0..count {
        let w = ctx.new_tensor(ty, &ne);
        wbuf.place(w, i * stride)?;
        // whole-tensor writes: a repacked buffer repacks them
        w.set_bytes(&zeros, 0)?;
        ws.push(w);
    }
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
    f(&mut run, each * count)
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
        // uploads for longer than the timed runs take
        let _load = match bus {
            Some((dev, bw)) => BusLoad::start(dev, bw, 0.4)?,
            None => None,
        };
        let mut best = f64::MAX;
        for _ in 0..3 {
            let t0 = Instant::now();
            run()?;
            best = best.min(t0.elapsed().as_secs_f64());
        }
        Ok(best / read as f64)
    })
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
                let r = super::measure_h2d(device, CHUNK, reps);
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

/// The extra (repacked) CPU buffer type that takes weights of `ty`/`ne`,
/// or plain CPU memory.
pub fn cpu_weight_buft(cpu: Device, ty: crate::dtype::GgmlType, ne: [i64; 2]) -> BufferType {
    cpu.extra_buffer_types()
        .into_iter()
        .find(|&b| cpu.supports_weight(b, ty, &ne))
        .unwrap_or_else(|| cpu.buffer_type())
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
/// a chain of 12 tiny kernels (a group launches about that many at decode)
/// launched and drained, the best of 20.
pub fn measure_group_overhead(
    device: Device,
    backend: &Backend,
    n_embd: i64,
) -> Result<f64, EngineError> {
    let ctx = Context::new(32, 32)?;
    let x = ctx.new_tensor(crate::dtype::GgmlType::F32, &[n_embd]);
    let buf = Buffer::alloc(device.buffer_type(), x.nbytes(), BufferUsage::Any)?;
    buf.place(x, 0)?;
    x.set_f32(&vec![1.0f32; n_embd as usize])?;
    let mut g = ctx.new_graph(32);
    let mut cur = x;
    for _ in 0..12 {
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
