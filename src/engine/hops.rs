//! The residual stream's hops between a GPU and the host around a whole
//! host group (hybrid steps), by kernels on the compute stream that read
//! and write the host's residual where it lives, in pinned host memory.
//!
//! Without them a hop went through three host copies and a pageable
//! download: down, the host drained the stream, copied the device's rows
//! into a vector and from there into its residual; up, it copied its
//! residual into a vector, the vector into `RowsUp`'s pinned staging, and
//! queued the kernel that reads the staging. At 64 sequences (512 KB a
//! hop on the 30B mixture) that was about 0.2 ms down and 0.18 ms up per
//! host group, 5 ms of a 140 ms step on the layer chain (run 231's
//! trace). Here the rows go down by a `set_rows` queued right behind the
//! group before (the host drains the stream and finds them in place), and
//! up by a `set_rows` that reads the host's residual itself.
//!
//! The host's residual is written only by the host's own graphs and by a
//! hop down, each after the host drained the compute stream (a host group
//! begins so), so no kernel reading it is still queued then.
//! `STRATA_HOPS=copy` keeps the old way, for A/B runs. The CPU device
//! hops the same way, through its own memory, so the CPU tests run it.

use super::error::EngineError;
use crate::dtype::GgmlType;
use crate::ggml::{
    Backend, Binding, BufferType, BufferUsage, Context, Device, TensorArena, TensorSpec,
};
use std::collections::HashMap;
use std::ptr::NonNull;

/// The two directions of a hop.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Way {
    Down,
    Up,
}

/// The graphs that move a step's first rows of the residual between the
/// device's tensor and the host's.
pub(super) struct Hops {
    // field order is drop order: the graphs before the buffer they read
    graphs: HashMap<(Way, u32), HopGraph>,
    /// Row indices 0..n, I64, in pinned host memory.
    ids: TensorArena,
    /// The device's residual, F32 [n_embd, device rows].
    device: Binding,
    device_rows: i64,
    /// The host's, F32 [n_embd, host rows], in pinned host memory.
    host: Binding,
    host_rows: i64,
    n_embd: i64,
}

struct HopGraph {
    graph: NonNull<crate::sys::ggml_cgraph>,
    ctx: Context,
}

/// Host memory `device`'s kernels read and write, for hops: a GPU's
/// pinned host memory, the CPU device's own (the same path, which the
/// CPU tests run); None on a remote device, or with `STRATA_HOPS=copy`.
pub(super) fn buffer_type(device: Device) -> Option<BufferType> {
    if std::env::var_os("STRATA_HOPS").is_some_and(|v| v == "copy") || device.is_remote() {
        return None;
    }
    if device.is_cpu() {
        return Some(device.buffer_type());
    }
    device.host_buffer_type()
}

impl Hops {
    /// Hops between the device's residual `dev_x` (`device_rows` rows)
    /// and the host's `host_x` (`host_rows` rows, in memory the device's
    /// kernels reach), `n_embd` wide; their row indices in `buft`
    /// ([`buffer_type`]'s), None where that is not host memory.
    pub(super) fn new(
        buft: BufferType,
        dev_x: Binding,
        device_rows: u32,
        host_x: Binding,
        host_rows: u32,
        n_embd: u32,
    ) -> Result<Option<Hops>, EngineError> {
        let n = i64::from(device_rows.min(host_rows));
        let ids = TensorArena::new(
            buft,
            BufferUsage::Compute,
            &[TensorSpec::new(GgmlType::I64, &[n]).named("hop_ids")],
        )?;
        if !ids.buffer().is_host() {
            return Ok(None);
        }
        let rows: Vec<i64> = (0..n).collect();
        ids.tensor(0).set_bytes(bytemuck::cast_slice(&rows), 0)?;
        Ok(Some(Hops {
            graphs: HashMap::new(),
            ids,
            device: dev_x,
            device_rows: i64::from(device_rows),
            host: host_x,
            host_rows: i64::from(host_rows),
            n_embd: i64::from(n_embd),
        }))
    }

    /// Queues on `backend` the move of the first `rows` rows `way`.
    pub(super) fn queue(
        &mut self,
        backend: &Backend,
        way: Way,
        rows: u32,
    ) -> Result<(), EngineError> {
        let n = self.ids.tensor(0).ne()[0];
        if i64::from(rows) > n {
            return Err(EngineError::Unsupported(
                "a hop of more rows than both residuals hold",
            ));
        }
        if !self.graphs.contains_key(&(way, rows)) {
            let g = self.build(way, rows)?;
            self.graphs.insert((way, rows), g);
        }
        let g = &self.graphs[&(way, rows)];
        // SAFETY: the graph lives in g.ctx.
        let graph = unsafe { crate::ggml::Graph::from_raw(&g.ctx, g.graph) };
        backend.compute_async(&graph)?;
        Ok(())
    }

    fn build(&self, way: Way, rows: u32) -> Result<HopGraph, EngineError> {
        let ctx = Context::new(8, 4)?;
        let graph = {
            let e = self.n_embd;
            let dev = ctx.new_tensor(GgmlType::F32, &[e, self.device_rows]);
            let host = ctx.new_tensor(GgmlType::F32, &[e, self.host_rows]);
            let ids = ctx.new_tensor(GgmlType::I64, &[self.ids.tensor(0).ne()[0]]);
            // SAFETY: each binding is its tensor's whole region, of the
            // shape made here; `self` holds the ids, and the engine the
            // two residuals, as long as the graph, which runs only while
            // they live.
            unsafe {
                dev.rebind(&self.device)?;
                host.rebind(&self.host)?;
                ids.rebind(&self.ids.binding(0))?;
            }
            let r = i64::from(rows);
            let ids = ctx.view_1d(ids, r, 0);
            let (dst, src) = match way {
                Way::Down => (host, ctx.view_2d(dev, e, r, dev.nb()[1], 0)),
                Way::Up => (dev, ctx.view_2d(host, e, r, host.nb()[1], 0)),
            };
            let mut g = ctx.new_graph(4);
            g.expand(ctx.set_rows(dst, src, ids));
            NonNull::new(g.raw()).expect("graph handle is never null")
        };
        Ok(HopGraph { graph, ctx })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn arena(rows: i64, name: &str) -> TensorArena {
        let cpu = crate::ggml::cpu_device().expect("the CPU backend loads");
        let spec = TensorSpec::new(GgmlType::F32, &[4, rows]).named(name);
        TensorArena::new(cpu.buffer_type(), BufferUsage::Compute, &[spec]).unwrap()
    }

    fn read(a: &TensorArena) -> Vec<f32> {
        let mut v = vec![0f32; a.tensor(0).nbytes() / 4];
        a.tensor(0).get_f32(&mut v).unwrap();
        v
    }

    #[test]
    fn hops_move_the_first_rows_each_way_and_nothing_else() {
        let cpu = crate::ggml::cpu_device().unwrap();
        let backend = cpu.init_backend().unwrap();
        // the device's residual holds more rows than the host's
        let (dev, host) = (arena(6, "dev_x"), arena(3, "host_x"));
        let d0: Vec<f32> = (0..24).map(|i| i as f32).collect();
        dev.tensor(0).set_f32(&d0).unwrap();
        host.tensor(0).set_f32(&[-1.0; 12]).unwrap();
        let buft = buffer_type(cpu).expect("the CPU device hops through its own memory");
        let mut hops = Hops::new(buft, dev.binding(0), 6, host.binding(0), 3, 4)
            .unwrap()
            .expect("its own memory is host memory");
        hops.queue(&backend, Way::Down, 2).unwrap();
        backend.synchronize();
        let h = read(&host);
        assert_eq!(&h[..8], &d0[..8]);
        assert_eq!(&h[8..], &[-1.0; 4]);
        // the host changes its rows; up, they replace the device's first
        host.tensor(0)
            .set_f32(&(100..112).map(|i| i as f32).collect::<Vec<_>>())
            .unwrap();
        hops.queue(&backend, Way::Up, 3).unwrap();
        backend.synchronize();
        let d = read(&dev);
        let want: Vec<f32> = (100..112).chain(12..24).map(|i| i as f32).collect();
        assert_eq!(d, want);
        // more rows than the host holds: refused, not a write past it
        assert!(hops.queue(&backend, Way::Up, 4).is_err());
    }
}
