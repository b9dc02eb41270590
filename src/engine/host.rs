//! Hybrid decode, the execution side: the layer groups the host CPU
//! computes (see `paging::hybrid` for which and why) from its own repacked
//! copy of their weights, on a CPU backend of its own, while the device's
//! copy stream keeps uploading the groups the GPU computes.
//!
//! The residual stream hops between the device and the host around each
//! run of CPU groups: the rows come down, the CPU computes, the rows go
//! back up. Where the host's residual lives in memory the device's kernels
//! reach (`hops`: a GPU's pinned host memory) kernels on the compute
//! stream move them both ways; otherwise the engine drains the stream and
//! downloads them, and they go up by a kernel reading a pinned staging
//! (`halfrows::RowsUp`), not by a copy queued behind the weights. At
//! decode that is a few tens of KB each way, at 64 sequences 512 KB on
//! the 30B mixture.

use super::buffers::{self, Persistent};
use super::cpuweights::{CpuLayout, CpuWeights};
use super::error::EngineError;
use super::model_file::ModelFile;
use crate::dtype::GgmlType;
use crate::ggml::{
    Backend, Binding, BufferType, BufferUsage, Device, GraphAllocator, Tensor, TensorArena,
    TensorSpec,
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
    /// Routed picks of the layers with hot experts on the device, and
    /// those the device computed (`paging::experts`).
    pub picks: u64,
    pub hot_picks: u64,
    /// Look-ahead (`--look-ahead`): the picks of layers a slot held a
    /// prediction for (beyond hot experts), those the slot caught, and the
    /// experts and bytes uploaded.
    pub ahead_picks: u64,
    pub ahead_hits: u64,
    pub ahead_experts: u64,
    pub ahead_bytes: u64,
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
    /// Whether `persistent` is memory the device's kernels reach.
    pinned: bool,
    dims: Dims,
    pub lim: Limits,
    x: Vec<f32>,
    /// An expert split's inputs (rows, expert ids) and its rows out.
    split: Option<PickRows>,
    pub stats: HostStats,
    /// The last expert split's host phases: its rows written, its
    /// experts' graph computed, its output added per token (the trace's
    /// sub-spans of the split's host part).
    pub split_phases: [Duration; 3],
}

/// The inputs of a graph over (token, expert) picks, rows F32 [n_embd, 1,
/// most] and compact expert ids I32 [1, most] in `arena`, and what it
/// computed, added back per token: the host's side of an expert split,
/// the device's hot experts (`engine::hot`) and look-ahead slots
/// (`engine::lookahead`).
pub struct PickRows {
    pub arena: TensorArena,
    pub most: u32,
    rows: Vec<f32>,
    ids: Vec<i32>,
    out: Vec<f32>,
}

impl PickRows {
    /// Room for `most` picks of rows `n_embd` wide in `buft`; `name`
    /// prefixes the tensors' names.
    pub fn alloc(
        buft: BufferType,
        n_embd: u32,
        most: u32,
        name: &str,
    ) -> Result<PickRows, EngineError> {
        let specs = [
            TensorSpec::new(GgmlType::F32, &[i64::from(n_embd), 1, i64::from(most)])
                .named(&format!("{name}_rows")),
            TensorSpec::new(GgmlType::I32, &[1, i64::from(most)]).named(&format!("{name}_ids")),
        ];
        Ok(PickRows {
            arena: TensorArena::new(buft, BufferUsage::Compute, &specs)?,
            most,
            rows: Vec::new(),
            ids: Vec::new(),
            out: Vec::new(),
        })
    }

    /// Writes the rows of `picks` (each its token's row of `cur`, F32
    /// [e, n_tokens]) and their ids, padded to `n` (`gather_rows`).
    /// Nothing queued may read them: the last graph over them finished.
    pub fn write(
        &mut self,
        picks: &[Pick],
        cur: &[f32],
        e: usize,
        n: u32,
    ) -> Result<(), EngineError> {
        gather_rows(picks, cur, e, n as usize, &mut self.rows, &mut self.ids);
        self.arena
            .tensor(0)
            .set_bytes(bytemuck::cast_slice(&self.rows), 0)?;
        self.arena.tensor(1).set_i32(&self.ids)?;
        Ok(())
    }

    /// The rows and ids, as a graph over picks binds them after its
    /// weights.
    pub fn bindings(&self) -> [Binding; 2] {
        [self.arena.binding(0), self.arena.binding(1)]
    }

    /// Adds the output of `t` (a graph over `n` padded picks, finished),
    /// each pick's row weighted, to its token's row of `sums`.
    pub fn add_out(
        &mut self,
        t: &Template,
        picks: &[Pick],
        e: usize,
        n: u32,
        sums: &mut [f32],
    ) -> Result<(), EngineError> {
        self.out.resize(n as usize * e, 0.0);
        t.out().get_f32(&mut self.out)?;
        add_weighted(picks, &self.out, e, sums);
        Ok(())
    }
}

/// One (token, expert) pick of the host's side of an expert split.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Pick {
    pub token: u32,
    pub expert: i32,
    pub weight: f32,
}

impl HostCompute {
    /// Loads the CPU copies of the groups marked in `host` (repacked
    /// unless `repack` is false). The residual and the step's inputs live
    /// in `pinned` where given and it is host memory: memory the device's
    /// kernels read and write (a GPU's pinned host memory; the CPU
    /// device's own), for the hops (`hops`).
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        spec: &ModelSpec,
        dims: &Dims,
        lim: Limits,
        host: &[bool],
        file: &ModelFile,
        n_threads: usize,
        poll: u32,
        layout: CpuLayout,
        pinned: Option<BufferType>,
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
        let weights = CpuWeights::load(cpu, &sets, file, layout, bar)?;
        // ggml falls back to its CPU buffers where pinning fails
        let (persistent, pinned) = match pinned.map(|b| (b, Persistent::alloc_in(dims, lim, b))) {
            Some((b, Ok(p)))
                if p.arena().buffer().is_host() && p.arena().buffer().name() == b.name() =>
            {
                (p, true)
            }
            _ => (Persistent::alloc(dims, lim, cpu)?, false),
        };
        Ok(HostCompute {
            templates: HashMap::new(),
            allocator: GraphAllocator::new(cpu.buffer_type())?,
            alloc_size: 0,
            backend,
            persistent,
            set_of: gis.iter().enumerate().map(|(s, &g)| (g, s)).collect(),
            group_bytes: gis.iter().map(|&g| (g, spec.groups[g].bytes())).collect(),
            weights,
            pinned,
            dims: dims.clone(),
            lim,
            x: Vec::new(),
            split: None,
            stats: HostStats::default(),
            split_phases: [Duration::ZERO; 3],
        })
    }

    /// Host bytes of the CPU copies (repacked and plain).
    pub fn bytes(&self) -> u64 {
        self.weights.repacked_bytes + self.weights.plain_bytes
    }
    pub fn repacked_bytes(&self) -> u64 {
        self.weights.repacked_bytes
    }

    /// Computes the next graphs with a pool of `n` threads (a new pool: a
    /// larger one's idle threads would still poll for work, on the cores
    /// fewer threads are meant to leave).
    pub fn set_threads(&mut self, n: usize, poll: u32) -> Result<(), EngineError> {
        self.backend.attach_cpu_threadpool(n, poll)?;
        self.backend.set_n_threads(n);
        Ok(())
    }

    /// Lets the pool threads sleep (between steps).
    pub fn park_threads(&self) {
        self.backend.park_threads();
    }

    /// The host's residual, where it is in memory the device's kernels
    /// reach (the hops' kernels read and write it there).
    pub fn pinned_x(&self) -> Option<Binding> {
        self.pinned
            .then(|| self.persistent.bindings[buffers::X].clone())
    }

    /// The rows the host's residual holds.
    pub fn x_rows(&self) -> u32 {
        self.lim.n_batch
    }

    /// Copies the first `rows` rows of the device residual `x` to the host.
    /// The device's compute stream must be drained.
    pub fn download(&mut self, x: Tensor<'_>, rows: u32) -> Result<(), EngineError> {
        self.download_rows(x, 0, rows)
    }

    /// Copies rows `row0..row0 + rows` of the device residual `x` to the
    /// host's. No graph queued on the device may still write them.
    pub fn download_rows(
        &mut self,
        x: Tensor<'_>,
        row0: u32,
        rows: u32,
    ) -> Result<(), EngineError> {
        let t0 = Instant::now();
        let (n, at) = self.row_range(row0, rows);
        self.x.resize(n, 0.0);
        x.get_bytes(bytemuck::cast_slice_mut(&mut self.x), at)?;
        self.persistent
            .tensor(buffers::X)
            .set_bytes(bytemuck::cast_slice(&self.x), at)?;
        self.stats.hops += t0.elapsed();
        Ok(())
    }

    /// Copies rows `row0..row0 + rows` of the host residual back to the
    /// device's `x`. No graph queued on the device may read or write them.
    pub fn upload_rows(&mut self, x: Tensor<'_>, row0: u32, rows: u32) -> Result<(), EngineError> {
        let t0 = Instant::now();
        let (_, at) = self.row_range(row0, rows);
        x.set_bytes(bytemuck::cast_slice(self.rows(row0, rows)?), at)?;
        self.stats.hops += t0.elapsed();
        Ok(())
    }

    /// Rows `row0..row0 + rows` of the host residual.
    pub fn rows(&mut self, row0: u32, rows: u32) -> Result<&[f32], EngineError> {
        let (n, at) = self.row_range(row0, rows);
        self.x.resize(n, 0.0);
        self.persistent
            .tensor(buffers::X)
            .get_bytes(bytemuck::cast_slice_mut(&mut self.x), at)?;
        Ok(&self.x)
    }

    /// The floats of `rows` rows and the byte offset of row `row0`.
    fn row_range(&self, row0: u32, rows: u32) -> (usize, usize) {
        let e = self.dims.hp.n_embd as usize;
        (rows as usize * e, row0 as usize * e * 4)
    }

    /// Computes group `gi` (the template `key` describes) on the CPU, on
    /// the host residual.
    pub fn compute(&mut self, gi: GroupId, key: &TemplateKey) -> Result<(), EngineError> {
        self.run(gi, key)?;
        self.stats.groups += 1;
        self.stats.bytes += self.group_bytes.get(&gi.index()).copied().unwrap_or(0);
        Ok(())
    }

    /// Runs a mixture's router (template `key`, a `TemplateKey::Router`)
    /// over the host residual, from group `gi`'s copy; its nodes are then
    /// readable ([`HostCompute::read_node`]).
    pub fn route(&mut self, gi: GroupId, key: &TemplateKey) -> Result<(), EngineError> {
        self.run(gi, key)
    }

    /// Node `name` of template `key`'s last compute.
    pub fn read_node<T: bytemuck::Pod + Default>(
        &self,
        key: &TemplateKey,
        name: &str,
    ) -> Result<Vec<T>, EngineError> {
        let t = self.templates.get(key).ok_or(EngineError::Unsupported(
            "a node of a graph the host never ran",
        ))?;
        Ok(t.read_node(name)?)
    }

    /// Adds `y` (F32 [n_embd, rows]) to the host residual's first rows.
    pub fn add_rows(&mut self, y: &[f32]) -> Result<(), EngineError> {
        self.x.resize(y.len(), 0.0);
        let x = self.persistent.tensor(buffers::X);
        x.get_bytes(bytemuck::cast_slice_mut(&mut self.x), 0)?;
        for (a, b) in self.x.iter_mut().zip(y) {
            *a += b;
        }
        x.set_bytes(bytemuck::cast_slice(&self.x), 0)?;
        Ok(())
    }

    fn run(&mut self, gi: GroupId, key: &TemplateKey) -> Result<(), EngineError> {
        let set = *self
            .set_of
            .get(&gi.index())
            .expect("the plan only gives the CPU groups it has copies of");
        if !self.templates.contains_key(key) {
            let mut t = Template::build(key, &self.dims, self.lim)?;
            t.bind_externals(&self.persistent.bindings)?;
            t.bind(BindId::resident(gi), &self.weights.sets[set], None)?;
            // one activation buffer for every CPU template (they run one at
            // a time, synchronously): when it grows, the others, which point
            // into the old buffer, are dropped and rebuilt on next use
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
        Ok(())
    }
}

impl HostCompute {
    /// The host's side of an expert split of group `gi` (FFN signature
    /// `sig`): each of `picks` through its expert, weighted, summed per
    /// token into `out` (F32 [n_embd, n_tokens], zeroed first). `cur` is
    /// the router's normed rows F32 [n_embd, n_tokens].
    pub fn split_experts(
        &mut self,
        gi: GroupId,
        sig: &[(crate::model::Role, crate::dtype::GgmlType)],
        cur: &[f32],
        picks: &[Pick],
        out: &mut Vec<f32>,
    ) -> Result<(), EngineError> {
        let e = self.dims.hp.n_embd as usize;
        let n_tokens = cur.len() / e;
        out.clear();
        out.resize(n_tokens * e, 0.0);
        if picks.is_empty() {
            return Ok(());
        }
        let set = *self
            .set_of
            .get(&gi.index())
            .expect("the plan only splits groups the host has copies of");
        let most = (self.lim.n_batch * self.dims.hp.n_expert_used).next_multiple_of(32);
        if self.split.is_none() {
            let cpu = crate::ggml::cpu_device()?;
            self.split = Some(PickRows::alloc(
                cpu.buffer_type(),
                self.dims.hp.n_embd,
                most,
                "split",
            )?);
        }
        let io = self.split.as_mut().expect("made above");
        // padded so that a few templates serve every step
        // (`pad_host_picks`): each padding row is a product of the first
        // pick's expert
        let n = pad_host_picks(picks.len() as u32).min(io.most);
        if picks.len() > n as usize {
            return Err(EngineError::Unsupported(
                "an expert split of more picks than a host step holds",
            ));
        }
        let t_in = Instant::now();
        io.write(picks, cur, e, n)?;
        let written = t_in.elapsed();
        let key = TemplateKey::HostExperts {
            sig: sig.to_vec(),
            picks: n,
        };
        let mut binds = self.weights.sets[set].clone();
        binds.extend(io.bindings());
        if !self.templates.contains_key(&key) {
            let mut t = Template::build(&key, &self.dims, self.lim)?;
            t.bind_externals(&self.persistent.bindings)?;
            self.templates.insert(key.clone(), t);
        }
        let t = self.templates.get_mut(&key).expect("template exists");
        t.bind(BindId::resident(gi), &binds, None)?;
        if !t.allocated {
            self.allocator.alloc(&t.graph())?;
            t.allocated = true;
            let size = self.allocator.buffer_size();
            if size != self.alloc_size {
                self.alloc_size = size;
                self.templates.retain(|k, _| *k == key);
            }
        }
        let t = self.templates.get(&key).expect("kept above");
        let t0 = Instant::now();
        self.backend.compute(&t.graph())?;
        let computed = t0.elapsed();
        io.add_out(t, picks, e, n, out)?;
        self.stats.compute += t0.elapsed();
        self.split_phases = [written, computed, t0.elapsed() - computed];
        self.stats.groups += 1;
        // the weights read: each expert picked once (the group's bytes
        // over its experts, the router's and norm's few included)
        let mut seen: Vec<i32> = picks.iter().map(|p| p.expert).collect();
        seen.sort_unstable();
        seen.dedup();
        let per = self.group_bytes.get(&gi.index()).copied().unwrap_or(0)
            / self.dims.hp.n_expert.max(1) as u64;
        self.stats.bytes += per * seen.len() as u64;
        Ok(())
    }

    /// The router's picks of the last compute of template `key` (a
    /// mixture's FFN built with `Dims::read_routing`), token-major.
    pub fn routed(&self, key: &TemplateKey) -> Result<Vec<i32>, EngineError> {
        match self.templates.get(key) {
            Some(t) => Ok(t.read_routed()?),
            None => Ok(Vec::new()),
        }
    }
}

/// The picks of a router's `ids` (`n_used` per token, token-major) and
/// their weights `wts`, for `n_tokens` tokens.
pub fn picks_of(
    ids: &[i32],
    wts: &[f32],
    n_used: usize,
    n_tokens: usize,
) -> Result<Vec<Pick>, EngineError> {
    if ids.len() != n_tokens * n_used || wts.len() != ids.len() {
        return Err(EngineError::Unsupported("a router graph without its picks"));
    }
    Ok(ids
        .iter()
        .zip(wts)
        .enumerate()
        .map(|(i, (&e, &w))| Pick {
            token: (i / n_used) as u32,
            expert: e,
            weight: w,
        })
        .collect())
}

/// The input rows of `picks` (each its token's row of `cur`, F32
/// [e, n_tokens]) and their expert ids, padded to `n` rows: the padding
/// repeats the first pick's expert on zero rows, read by nobody.
pub fn gather_rows(
    picks: &[Pick],
    cur: &[f32],
    e: usize,
    n: usize,
    rows: &mut Vec<f32>,
    ids: &mut Vec<i32>,
) {
    rows.clear();
    rows.resize(n * e, 0.0);
    ids.clear();
    ids.resize(n, picks.first().map_or(0, |p| p.expert));
    for (i, p) in picks.iter().enumerate() {
        let t = p.token as usize;
        rows[i * e..(i + 1) * e].copy_from_slice(&cur[t * e..(t + 1) * e]);
        ids[i] = p.expert;
    }
}

/// Adds each pick's output row (row i of `out`, `e` wide), weighted, to its
/// token's row of `sums`.
pub fn add_weighted(picks: &[Pick], out: &[f32], e: usize, sums: &mut [f32]) {
    for (i, p) in picks.iter().enumerate() {
        let t = p.token as usize;
        let dst = &mut sums[t * e..(t + 1) * e];
        for (d, s) in dst.iter_mut().zip(&out[i * e..(i + 1) * e]) {
            *d += p.weight * s;
        }
    }
}

/// The rows the host's graph over `n` (token, expert) picks computes: a
/// power of two up to 8, then a multiple of 8. Each padding row costs the
/// host a row of products (at 64 tokens, an expert split's 65 picks
/// padded to 96 took a tenth of its host part, computed from run 221's
/// trace); a CPU graph is cheap to build, so more templates cost little.
pub fn pad_host_picks(n: u32) -> u32 {
    if n <= 8 {
        n.max(1).next_power_of_two()
    } else {
        n.next_multiple_of(8)
    }
}

/// The rows a device graph over `n` (token, expert) picks computes: a
/// power of two up to 32, then a multiple of 32 (each size is a graph the
/// device captures).
pub fn pad_picks(n: u32) -> u32 {
    if n <= 32 {
        n.max(1).next_power_of_two()
    } else {
        n.next_multiple_of(32)
    }
}

/// The CPU buffer type weights of `ty`/`ne` go into under `layout`: an
/// extra (repacked) one that takes them, or plain CPU memory.
pub fn cpu_weight_buft(
    cpu: Device,
    ty: crate::dtype::GgmlType,
    ne: [i64; 2],
    layout: CpuLayout,
) -> BufferType {
    let extras = cpu.extra_buffer_types();
    super::cpuweights::choose_buft(cpu, &extras, ty, &ne, layout)
        .map_or_else(|| cpu.buffer_type(), |i| extras[i])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_picks_pad_to_eights_and_device_picks_to_thirty_twos() {
        assert_eq!(
            [1, 3, 8, 9, 65, 96].map(pad_host_picks),
            [1, 4, 8, 16, 72, 96]
        );
        assert_eq!([1, 3, 32, 33, 65].map(pad_picks), [1, 4, 32, 64, 96]);
        // every count fits its padding, and the padding wastes under 8 rows
        // past 8 picks
        for n in 1..=512 {
            let p = pad_host_picks(n);
            assert!(p >= n && (n <= 8 || p - n < 8), "{n} -> {p}");
        }
    }
}
