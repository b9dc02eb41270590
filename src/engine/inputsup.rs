//! A step's inputs on their way to a GPU by a kernel on the compute
//! stream, not by a copy.
//!
//! The host writes a step's inputs (embedding rows, positions, masks,
//! cells, output rows) into pinned host memory laid out as the device's
//! persistent inputs; a graph of `set_rows` nodes then reads them from
//! there into the device's tensors on the compute stream, ahead of the
//! step's graphs. A copy would take the bus's copy engine, which is
//! carrying weights: queued behind the step's first upload, the inputs of
//! a 64-sequence step waited for its 375 MiB (7.4 ms of every 144 ms step
//! on the H200, the compute stream idle meanwhile: run 227's trace), and
//! behind uploads carried over from the step before they would wait for
//! those. Each input goes as 4-byte words (`set_rows` of F32 to F32 moves
//! them bit for bit), rounded up within its tensor's padded extent.
//!
//! The host memory is written only between steps: a step begins by
//! draining the compute stream (`Engine::begin_part`), so the graph that
//! read the last inputs has finished.

use super::buffers::Persistent;
use super::error::EngineError;
use crate::dtype::GgmlType;
use crate::ggml::{Backend, Binding, BufferUsage, Context, Device, TensorArena, TensorSpec};
use std::collections::HashMap;
use std::ptr::NonNull;

/// Graphs kept, one per set of inputs and sizes (a serving loop sees a
/// few dozen step shapes); beyond it they are built again.
const MOST_GRAPHS: usize = 64;

/// The host side of a GPU's step inputs and the graphs that pull them up.
pub(super) struct InputsUp {
    // field order is drop order: the graphs before the buffers they read
    graphs: HashMap<Vec<(usize, usize)>, PullGraph>,
    /// The inputs written since the last pull: (input index, bytes).
    pending: Vec<(usize, usize)>,
    /// The persistent inputs' host mirror (the same tensors, in `Externals`
    /// order), then the row index 0 that every `set_rows` takes.
    host: TensorArena,
    /// Where each persistent input lives on the device, and the bytes it
    /// may take (its tensor padded to the buffer's alignment).
    device: Vec<(Binding, usize)>,
}

/// One set of inputs' graph: a `set_rows` per input.
struct PullGraph {
    graph: NonNull<crate::sys::ggml_cgraph>,
    ctx: Context,
}

impl InputsUp {
    /// [`InputsUp::new`] for a load: None where the device has no such
    /// memory, pinning it fails (the inputs are then copied, as they are
    /// with `STRATA_INPUTS=copy`, which benchmarks compare against).
    pub(super) fn pinned(
        device: Device,
        persistent: &Persistent,
        d: &crate::graph::Dims,
        lim: crate::graph::Limits,
    ) -> Option<InputsUp> {
        if std::env::var_os("STRATA_INPUTS").is_some_and(|v| v == "copy") {
            return None;
        }
        let specs = crate::graph::Externals::specs(d, lim);
        InputsUp::new(device, persistent, &specs).unwrap_or_else(|e| {
            tracing::debug!("a step's inputs are copied up: no pinned mirror ({e})");
            None
        })
    }

    /// The host mirror of `persistent`'s inputs (`specs`, in its order);
    /// None where the device has no pinned host memory its kernels read
    /// (the CPU device, a remote one).
    pub(super) fn new(
        device: Device,
        persistent: &Persistent,
        specs: &[TensorSpec],
    ) -> Result<Option<InputsUp>, EngineError> {
        if device.is_cpu() || device.is_remote() {
            return Ok(None);
        }
        let Some(buft) = device.host_buffer_type() else {
            return Ok(None);
        };
        let mut all = specs.to_vec();
        all.push(TensorSpec::new(GgmlType::I64, &[1]).named("inputs_up_row"));
        let host = TensorArena::new(buft, BufferUsage::Compute, &all)?;
        if !host.buffer().is_host() {
            return Ok(None);
        }
        host.tensor(specs.len())
            .set_bytes(bytemuck::cast_slice(&[0i64]), 0)?;
        let arena = persistent.arena();
        let device = (0..arena.len())
            .map(|i| (arena.binding(i), extent(arena, i).1))
            .collect();
        Ok(Some(InputsUp {
            graphs: HashMap::new(),
            pending: Vec::new(),
            host,
            device,
        }))
    }

    /// Host memory for the first `len` elements of input `i` (as `T`s,
    /// contents undefined: the caller writes all of them), which the next
    /// [`InputsUp::queue`] takes up.
    pub(super) fn slot<T: bytemuck::Pod>(
        &mut self,
        i: usize,
        len: usize,
    ) -> Result<&mut [T], EngineError> {
        let bytes = len * std::mem::size_of::<T>();
        let words = bytes.div_ceil(4) * 4;
        let (at, room) = extent(&self.host, i);
        if bytes > self.host.tensor(i).nbytes() || words > room || words > self.device[i].1 {
            return Err(crate::ggml::GgmlError::Tensor {
                name: self.host.tensor(i).name(),
                what: format!("a step's input of {bytes} bytes exceeds the tensor"),
            }
            .into());
        }
        let p = self.host.buffer().base().wrapping_add(at);
        assert!((p as usize).is_multiple_of(std::mem::align_of::<T>()));
        self.pending.retain(|&(j, _)| j != i);
        self.pending.push((i, bytes));
        // SAFETY: host memory (checked at creation) of the arena's buffer,
        // `at..at + bytes` inside tensor i's extent (checked above), aligned
        // for T (asserted); borrowed mutably through self, and no kernel
        // reads it now (see the module's comment); every bit pattern is a
        // valid Pod.
        Ok(unsafe { std::slice::from_raw_parts_mut(p.cast::<T>(), len) })
    }

    /// Queues on `backend` the graph that reads the inputs written since
    /// the last call into the device's tensors.
    pub(super) fn queue(&mut self, backend: &Backend) -> Result<(), EngineError> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let key = std::mem::take(&mut self.pending);
        if !self.graphs.contains_key(&key) {
            if self.graphs.len() >= MOST_GRAPHS {
                self.graphs.clear();
            }
            let g = self.build(&key)?;
            self.graphs.insert(key.clone(), g);
        }
        let g = &self.graphs[&key];
        // SAFETY: the graph lives in g.ctx.
        let graph = unsafe { crate::ggml::Graph::from_raw(&g.ctx, g.graph) };
        backend.compute_async(&graph)?;
        Ok(())
    }

    fn build(&self, inputs: &[(usize, usize)]) -> Result<PullGraph, EngineError> {
        let k = inputs.len();
        let ctx = Context::new(3 * k + 2, 2 * k + 2)?;
        let row = self.host.len() - 1;
        let graph = {
            let ids = ctx.new_tensor(GgmlType::I64, &[1]);
            // SAFETY: the row index's whole tensor in the host arena.
            unsafe { ids.rebind(&self.host.binding(row))? };
            let mut g = ctx.new_graph(2 * k + 2);
            for &(i, bytes) in inputs {
                let words = bytes.div_ceil(4) as i64;
                let dst = ctx.new_tensor(GgmlType::F32, &[words, 1]);
                let src = ctx.new_tensor(GgmlType::F32, &[words, 1]);
                // SAFETY: both bindings are input i's start, with room for
                // `words` words in its padded extent on both sides (checked
                // in `slot`); `self` keeps both buffers alive as long as
                // the graph, which runs only while they are.
                unsafe {
                    dst.rebind(&self.device[i].0)?;
                    src.rebind(&self.host.binding(i))?;
                }
                g.expand(ctx.set_rows(dst, src, ids));
            }
            NonNull::new(g.raw()).expect("graph handle is never null")
        };
        Ok(PullGraph { graph, ctx })
    }
}

/// Where tensor `i` of `arena` starts, and the bytes to the next one (or
/// the buffer's end): its size padded to the buffer's alignment.
fn extent(arena: &TensorArena, i: usize) -> (usize, usize) {
    let end = if i + 1 < arena.len() {
        arena.offset(i + 1)
    } else {
        arena.bytes()
    };
    (arena.offset(i), end - arena.offset(i))
}
