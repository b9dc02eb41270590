//! Persistent device tensors: the residual stream and step inputs that
//! every group graph views, and the per-layer K/V cache tensors.

use super::error::EngineError;
use crate::dtype::GgmlType;
use crate::ggml::{
    Backend, Binding, Buffer, BufferType, BufferUsage, Device, Event, Tensor, TensorArena,
    TensorSpec,
};
use crate::graph::{Dims, Externals, Limits};
use crate::model::{GroupSpec, ModelSpec, Role};
use crate::paging::gemm::{widened_offsets, Widened};
use std::sync::Arc;

/// x, pos, mask, kv_idx, out_ids (in `Externals::all` order).
pub struct Persistent {
    arena: TensorArena,
    pub bindings: Vec<Binding>,
    pub bytes: u64,
}

pub const X: usize = 0;
pub const POS: usize = 1;
pub const MASK: usize = 2;
pub const KV_IDX: usize = 3;
pub const OUT_IDS: usize = 4;

impl Persistent {
    pub fn alloc(d: &Dims, lim: Limits, dev: Device) -> Result<Persistent, EngineError> {
        Persistent::alloc_in(d, lim, dev.buffer_type())
    }
    /// [`Persistent::alloc`] in buffers of `buft`.
    pub fn alloc_in(d: &Dims, lim: Limits, buft: BufferType) -> Result<Persistent, EngineError> {
        let specs = Externals::specs(d, lim);
        let arena = TensorArena::new(buft, BufferUsage::Compute, &specs)?;
        Ok(Persistent {
            bindings: (0..arena.len()).map(|i| arena.binding(i)).collect(),
            bytes: arena.bytes() as u64,
            arena,
        })
    }
    pub fn tensor(&self, i: usize) -> Tensor<'_> {
        self.arena.tensor(i)
    }
    pub fn arena(&self) -> &TensorArena {
        &self.arena
    }
}

/// K and V per layer, F16 [n_embd_kv, n_ctx], in one device buffer.
pub struct KvStore {
    arena: TensorArena,
    /// Per layer: its index in the arena, if its KV stays on the device.
    index_of: Vec<Option<usize>>,
    bindings: Vec<[Binding; 2]>,
    pub bytes: u64,
}

impl KvStore {
    /// K/V tensors of `layers` (those whose KV stays on the device; the
    /// rest are windowed, see `kvtier`) of a model of `n_layer` layers.
    pub fn alloc(
        d: &Dims,
        lim: Limits,
        dev: Device,
        layers: &[u32],
        n_layer: usize,
    ) -> Result<KvStore, EngineError> {
        let spec = TensorSpec::new(GgmlType::F16, &[d.hp.n_embd_kv() as i64, lim.n_ctx as i64]);
        let arena = TensorArena::new(
            dev.buffer_type(),
            BufferUsage::Any,
            &vec![spec; 2 * layers.len()],
        )?;
        // zeros, not whatever the memory held: a step computed in halves
        // (the row split, `rows.rs`) reads, in its first half's attention,
        // the cells its second half has yet to write; masked, they weigh
        // nothing, but nothing times a NaN pattern is NaN
        arena.buffer().clear(0);
        let mut index_of = vec![None; n_layer];
        for (i, &l) in layers.iter().enumerate() {
            index_of[l as usize] = Some(i);
        }
        Ok(KvStore {
            index_of,
            bindings: (0..layers.len())
                .map(|i| [arena.binding(2 * i), arena.binding(2 * i + 1)])
                .collect(),
            bytes: arena.bytes() as u64,
            arena,
        })
    }
    /// Layers whose KV stays on the device.
    pub fn n_layers(&self) -> usize {
        self.bindings.len()
    }
    /// Whether layer `l` keeps its KV here.
    pub fn holds(&self, l: usize) -> bool {
        self.index_of.get(l).is_some_and(|i| i.is_some())
    }
    fn index(&self, l: usize) -> usize {
        self.index_of[l].expect("layer keeps its KV on the device")
    }
    /// K and V bindings of layer `l`.
    pub fn bindings(&self, l: usize) -> &[Binding; 2] {
        &self.bindings[self.index(l)]
    }
    /// K (kv 0) or V tensor of layer `l`.
    pub fn tensor(&self, l: usize, kv: usize) -> Tensor<'_> {
        self.arena.tensor(2 * self.index(l) + kv)
    }
}

/// Host memory the copy stream reads from: pinned (the device's host buffer
/// type) on a GPU, plain CPU memory on the CPU device and for a remote
/// device (whose copies go through a socket). ggml falls back to pageable
/// memory silently when pinning fails; that is reported loudly (naming
/// `what`), and the returned flag says whether the memory is as the device
/// needs it (pinned where that matters).
pub fn alloc_host(
    dev: Device,
    bytes: usize,
    usage: BufferUsage,
    what: &str,
) -> Result<(Buffer, bool), EngineError> {
    let plain = dev.is_cpu() || dev.is_remote();
    let (buft, real) = match dev.host_buffer_type() {
        Some(h) if !plain => (h, true),
        // the CPU device computes from host memory directly
        _ => (crate::ggml::cpu_device()?.buffer_type(), plain),
    };
    let b = Buffer::alloc(buft, bytes, usage)?;
    let pinned = real && (plain || b.name().contains("Host"));
    if !pinned {
        tracing::warn!(
            "pinned host allocation of {bytes} bytes for {what} fell back to pageable memory ({})",
            b.name()
        );
        eprintln!(
            "warning: host memory for {what} is NOT pinned ({}); copies will be slow and synchronous",
            b.name()
        );
    }
    Ok((b, pinned))
}

/// Device memory for the host's rows of a split step: F32 [n_embd, n_batch].
pub struct SplitRows {
    pub arena: TensorArena,
    /// The host's sums, reused from step to step.
    pub host: Vec<f32>,
    /// Per layer, its experts most picked first (from the router counts
    /// kept beside the model), of which the device computes the first
    /// `k` (`paging::device_experts`); None: experts `0..k`.
    pub order: Vec<Option<Vec<u32>>>,
    /// The router outputs' reads, made at the first split step that
    /// needs them (None after: the device has no pinned memory or events).
    pub reads: Option<RouterReads>,
    pub reads_tried: bool,
}

/// Pinned host memory and an event: a split layer's router outputs read
/// back on the device's stream ahead of its experts' graph, which reuses
/// their activations, so the host need not drain the device before
/// queuing that graph (`engine::split`). A GPU's only.
pub struct RouterReads {
    event: Event,
    host: Buffer,
}

impl RouterReads {
    /// Room for `bytes`, on `dev`'s pinned host memory and with its
    /// events; None where it has neither (the CPU device, a remote one).
    pub(super) fn new(dev: Device, bytes: usize) -> Option<RouterReads> {
        if dev.is_cpu() || dev.is_remote() {
            return None;
        }
        let host = Buffer::alloc(dev.host_buffer_type()?, bytes, BufferUsage::Any).ok()?;
        let event = Event::new(dev).ok()?;
        (host.is_host() && host.size() >= bytes).then_some(RouterReads { event, host })
    }
    pub(super) fn len(&self) -> usize {
        self.host.size()
    }
    /// The host memory, for `Template::queue_reads` and then to read.
    pub(super) fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: the buffer is host memory of `size()` bytes, owned by
        // self and borrowed mutably through it; every bit pattern is a
        // valid u8. Copies into it are ordered by the event, which the
        // caller waits on before reading (`Template::queue_reads`).
        unsafe { std::slice::from_raw_parts_mut(self.host.base(), self.host.size()) }
    }
    /// Records the event after what `backend` queued so far.
    pub(super) fn record(&self, backend: &Backend) {
        self.event.record(backend);
    }
    /// Blocks until the recorded point: the reads queued before it are in.
    pub(super) fn wait(&self) {
        self.event.synchronize();
    }
}

impl SplitRows {
    pub(super) fn alloc(d: &Dims, lim: Limits, dev: Device) -> Result<SplitRows, EngineError> {
        Self::alloc_in(d, lim, dev.buffer_type())
    }

    /// The rows the host CPU computes and the device adds (an expert
    /// split's): in pinned host memory on a GPU, which the add graph reads
    /// there, so writing them is a memcpy, not a copy that would queue
    /// behind the weights' uploads on the bus (whole host groups' rows
    /// waited 45-50 ms a step so, runs 154-155); else device memory.
    pub(super) fn alloc_host_side(
        d: &Dims,
        lim: Limits,
        dev: Device,
    ) -> Result<SplitRows, EngineError> {
        match dev.host_buffer_type().filter(|_| !dev.is_cpu()) {
            Some(buft) => Self::alloc_in(d, lim, buft),
            None => Self::alloc(d, lim, dev),
        }
    }

    fn alloc_in(d: &Dims, lim: Limits, buft: BufferType) -> Result<SplitRows, EngineError> {
        // what `paging::sizes::split_rows_bytes` reserves in the plan
        let spec = TensorSpec::new(GgmlType::F32, &[d.hp.n_embd as i64, lim.n_batch as i64])
            .named("host_rows");
        Ok(SplitRows {
            arena: TensorArena::new(buft, BufferUsage::Compute, &[spec])?,
            host: Vec::new(),
            order: Vec::new(),
            reads: None,
            reads_tried: false,
        })
    }
    pub(super) fn bytes(&self) -> u64 {
        self.arena.bytes() as u64
    }
}

/// Host memory the big inputs (embedding rows, masks) are written into
/// and copied to the device from, one after the other (each copy is
/// synchronous): pinned on a GPU, whose copies from pageable memory go
/// through the driver's bounce buffers; plain memory on the CPU device and
/// a remote one (copied through a socket), or where pinning fails. It
/// grows to the largest step's need and is kept.
#[derive(Default)]
pub struct Staging {
    pinned: Option<Buffer>,
    /// u64s: aligned for any element type the inputs use
    plain: Vec<u64>,
    /// Pinning failed once: plain memory from then on.
    unpinnable: bool,
}

impl Staging {
    /// Whether the memory is pinned (on a GPU, unless pinning failed).
    pub fn is_pinned(&self) -> bool {
        self.pinned.is_some()
    }
    /// The first `len` elements of the staging memory, as `T`s (contents
    /// undefined: the caller writes all of them).
    pub fn get<T: bytemuck::Pod>(
        &mut self,
        dev: Device,
        len: usize,
    ) -> Result<&mut [T], EngineError> {
        let bytes = len * std::mem::size_of::<T>();
        let pin = !(dev.is_cpu() || dev.is_remote() || self.unpinnable);
        if pin && self.pinned.as_ref().is_none_or(|b| b.size() < bytes) {
            self.pinned = None;
            // rounded up to 8 MiB, so steps a little bigger reuse it
            let size = bytes.next_multiple_of(8 << 20);
            match dev
                .host_buffer_type()
                .map(|t| Buffer::alloc(t, size, BufferUsage::Any))
            {
                Some(Ok(b)) if b.is_host() && (b.base() as usize).is_multiple_of(8) => {
                    self.pinned = Some(b)
                }
                _ => {
                    tracing::debug!(
                        "no pinned staging for a step's inputs: written from pageable memory"
                    );
                    self.unpinnable = true;
                }
            }
        }
        match &self.pinned {
            Some(b) => {
                // SAFETY: the buffer is host memory of at least `bytes`
                // bytes, aligned to 8 (checked when allocated), owned by
                // self and borrowed mutably through it; no copy reads it
                // now (every copy from it was synchronous), and every bit
                // pattern is a valid Pod.
                Ok(unsafe { std::slice::from_raw_parts_mut(b.base().cast::<T>(), len) })
            }
            _ => {
                self.plain
                    .resize(bytes.div_ceil(8).max(self.plain.len()), 0);
                Ok(&mut bytemuck::cast_slice_mut::<u64, T>(&mut self.plain)[..len])
            }
        }
    }
}

/// A device's widened buffer and where each group's matrices go in it.
pub struct Widening {
    pub plan: Widened,
    pub(super) buffer: Arc<Buffer>,
    /// Per group (by index), the offset of each weight of its signature in
    /// the buffer; None: bound where it is.
    pub(super) offsets: Vec<Vec<Option<u64>>>,
}

/// A group's weights in signature order: type and shape.
fn weights_of(g: &GroupSpec) -> Vec<(GgmlType, [i64; 4])> {
    g.weights
        .iter()
        .filter(|w| w.role.is_some())
        .map(|w| (w.ty, w.ne))
        .collect()
}

impl Widening {
    /// The plan's copy for `spec`'s groups (an expert stack is never
    /// widened: `gemm::widens`).
    pub(super) fn plan(spec: &ModelSpec, mmq_max_rows: u32, n_batch: u32) -> Option<Widened> {
        let groups: Vec<_> = spec.groups.iter().map(weights_of).collect();
        Widened::plan(groups.iter().map(Vec::as_slice), mmq_max_rows, n_batch)
    }

    pub(super) fn alloc(
        spec: &ModelSpec,
        plan: Widened,
        device: Device,
    ) -> Result<Widening, EngineError> {
        let offsets: Vec<_> = spec
            .groups
            .iter()
            .map(|g| widened_offsets(&weights_of(g)).0)
            .collect();
        let buffer = Buffer::alloc(
            device.buffer_type(),
            plan.bytes as usize,
            BufferUsage::Compute,
        )?;
        Ok(Widening {
            plan,
            buffer: Arc::new(buffer),
            offsets,
        })
    }
}

/// A widened group, as its halves' templates take it: the signature with
/// the widened matrices as BF16, and the weights bound to the copies.
pub(super) struct WidenedGroup {
    pub sig: Vec<(Role, GgmlType)>,
    pub weights: Vec<Binding>,
}
