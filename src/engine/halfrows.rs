//! What a hybrid step in two halves of rows (`halves.rs`) owns, the
//! events marking each half's rows computed; and how the host's rows go
//! back up to the device after every host group, halved or whole
//! ([`RowsUp`]).

use super::error::EngineError;
use crate::dtype::GgmlType;
use crate::ggml::{Binding, BufferUsage, Context, Device, Event, TensorArena, TensorSpec};
use std::collections::HashMap;
use std::ptr::NonNull;

/// The events marking each half's rows computed on the device (None on
/// the CPU device, whose graphs finish before `compute_async` returns).
pub(super) struct CpuHalves {
    pub(super) done: Option<[Event; 2]>,
    /// Whether a step that wanted halves but ran whole was reported.
    pub(super) warned: std::cell::Cell<bool>,
}

impl CpuHalves {
    pub(super) fn new(device: Device) -> Result<CpuHalves, EngineError> {
        let done = if device.is_cpu() {
            None
        } else {
            Some([Event::new(device)?, Event::new(device)?])
        };
        Ok(CpuHalves {
            done,
            warned: std::cell::Cell::new(false),
        })
    }
}

/// The host's rows going back up to the device's residual stream by a
/// kernel on the compute stream that reads them from pinned host memory
/// (`set_rows`), not by a copy: the bus's copy engine is busy with the
/// weights, and a copy of a few hundred KB queued behind them waited
/// 9-17 ms (run 151's trace; whole host groups of 16 and 64 sequences
/// spent 45-50 ms a step so in runs 154-155). Queued, it also orders
/// itself before the next graphs without the host waiting.
///
/// Staging `h` is written again only once the graph that read it has
/// finished: a half waits its event first; a whole host group drains the
/// compute stream before it brings the rows down (`run_host_group`).
pub(super) struct RowsUp {
    // field order is drop order: the graphs before the buffers they read
    /// By half, first row and row count: each reads its half's staging.
    graphs: HashMap<(usize, u32, u32), UpGraph>,
    /// Per half: its rows F32 [n_embd, n_batch] and their row indices I64
    /// [n_batch], in pinned host memory.
    staging: [TensorArena; 2],
    /// The device's residual stream, F32 [n_embd, n_batch].
    x: Binding,
    n_embd: i64,
    n_batch: i64,
}

/// One half's graph: rows `row0..row0 + rows` of the residual from its
/// staging.
struct UpGraph {
    graph: NonNull<crate::sys::ggml_cgraph>,
    ctx: Context,
}

impl RowsUp {
    pub(super) fn new(
        device: Device,
        x: Binding,
        n_embd: u32,
        n_batch: u32,
    ) -> Result<Option<RowsUp>, EngineError> {
        let Some(buft) = device.host_buffer_type() else {
            return Ok(None);
        };
        let (e, n) = (i64::from(n_embd), i64::from(n_batch));
        let specs = [
            TensorSpec::new(GgmlType::F32, &[e, n]).named("rows_up"),
            TensorSpec::new(GgmlType::I64, &[n]).named("rows_up_ids"),
        ];
        let staging = [
            TensorArena::new(buft, BufferUsage::Compute, &specs)?,
            TensorArena::new(buft, BufferUsage::Compute, &specs)?,
        ];
        Ok(Some(RowsUp {
            graphs: HashMap::new(),
            staging,
            x,
            n_embd: e,
            n_batch: n,
        }))
    }

    /// Writes half `h`'s rows (`rows` of them from row `row0`, F32 [n_embd,
    /// rows]) into its staging and queues their way up on `backend`. The
    /// half's last graph queued before has finished (its event waited).
    pub(super) fn queue(
        &mut self,
        backend: &crate::ggml::Backend,
        h: usize,
        row0: u32,
        data: &[f32],
    ) -> Result<(), EngineError> {
        let rows = (data.len() as i64 / self.n_embd) as u32;
        let st = &self.staging[h];
        st.tensor(0).set_bytes(bytemuck::cast_slice(data), 0)?;
        let ids: Vec<i64> = (i64::from(row0)..i64::from(row0 + rows)).collect();
        st.tensor(1).set_bytes(bytemuck::cast_slice(&ids), 0)?;
        let key = (h, row0, rows);
        if !self.graphs.contains_key(&key) {
            let g = self.build(h, rows)?;
            self.graphs.insert(key, g);
        }
        let g = &self.graphs[&key];
        // SAFETY: the graph lives in g.ctx.
        let graph = unsafe { crate::ggml::Graph::from_raw(&g.ctx, g.graph) };
        backend.compute_async(&graph)?;
        Ok(())
    }

    fn build(&self, h: usize, rows: u32) -> Result<UpGraph, EngineError> {
        let ctx = Context::new(8, 4)?;
        let graph = {
            let x = ctx.new_tensor(GgmlType::F32, &[self.n_embd, self.n_batch]);
            let src = ctx.new_tensor(GgmlType::F32, &[self.n_embd, self.n_batch]);
            let ids = ctx.new_tensor(GgmlType::I64, &[self.n_batch]);
            // SAFETY: each binding is its tensor's whole buffer region (the
            // same shapes); `self` keeps those buffers alive as long as the
            // graph, which runs only while they are.
            unsafe {
                x.rebind(&self.x)?;
                src.rebind(&self.staging[h].binding(0))?;
                ids.rebind(&self.staging[h].binding(1))?;
            }
            let r = i64::from(rows);
            let src = ctx.view_2d(src, self.n_embd, r, src.nb()[1], 0);
            let ids = ctx.view_1d(ids, r, 0);
            let mut g = ctx.new_graph(4);
            g.expand(ctx.set_rows(x, src, ids));
            NonNull::new(g.raw()).expect("graph handle is never null")
        };
        Ok(UpGraph { graph, ctx })
    }
}
