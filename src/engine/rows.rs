//! The row split's step (`SplitMode::Row`): every device holds a share of
//! every layer's heads and FFN columns (`model::shard`), each its own part
//! with its own plan, rings, link and KV heads, chained by `Engine::next`
//! like the layer split's parts. A step runs the groups in layer order; for
//! each group:
//!
//! 1. every device queues its share (a device's group graph on its own
//!    stream, waiting for its own link's upload), or the host CPU computes
//!    the share from its copy (hybrid decode), so all the links and
//!    devices work on the group at once;
//! 2. the first device adds the others' outputs to its own (its graph added
//!    the residual stream; the others' write their output alone,
//!    `Dims::partial`): each output is copied into one of its reduce
//!    buffers (a peer copy between GPUs, queued on the sender's stream
//!    with the first device's stream waiting for it), then added;
//! 3. the sum is copied back to every other device's residual stream.
//!
//! Between GPUs nothing waits on the host: each copy orders the two streams
//! by an event (ggml's `cpy_tensor_async`). Backends that cannot copy
//! asynchronously (the CPU, an RPC server) drain both streams and copy
//! through the host. The first device computes the head.

use super::batch::StepStats;
use super::buffers;
use super::error::EngineError;
use super::state::Engine;
use crate::dtype::GgmlType;
use crate::ggml::Context;
use crate::graph::{BindId, TemplateKey};
use crate::model::{GroupId, GroupKind};

impl Engine {
    /// Runs the begun step on this device (the row split's first) and the
    /// devices after it, group by group.
    pub(super) fn run_rows(&mut self, out: &mut Vec<f32>) -> Result<(), EngineError> {
        // the chain as a list for the step (given back whatever happens)
        let mut others: Vec<Box<Engine>> = Vec::new();
        let mut n = self.next.take();
        while let Some(mut e) = n {
            n = e.next.take();
            others.push(e);
        }
        let r = self.run_rows_on(&mut others, out);
        let mut next = None;
        while let Some(mut e) = others.pop() {
            e.next = next;
            next = Some(e);
        }
        self.next = next;
        r
    }

    fn run_rows_on(
        &mut self,
        others: &mut [Box<Engine>],
        out: &mut Vec<f32>,
    ) -> Result<(), EngineError> {
        let p = self.pending.as_mut().expect("begun");
        let order = std::mem::take(&mut p.order);
        let n_out = p.n_out;
        let ons: Vec<Vec<bool>> = std::iter::once(std::mem::take(&mut p.on_cpu))
            .chain(others.iter_mut().map(|e| {
                let p = e.pending.as_mut().expect("begun");
                p.order.clear();
                std::mem::take(&mut p.on_cpu)
            }))
            .collect();
        for (l, kind, shape) in order {
            let gi = GroupId::new(l, kind);
            self.run_share(l, kind, shape, ons[0][gi.index()])?;
            for (e, on) in others.iter_mut().zip(&ons[1..]) {
                e.run_share(l, kind, shape, on[gi.index()])?;
            }
            // the rows the group wrote: the last layer's attention keeps
            // only those that want logits
            let rows = if kind == GroupKind::Attn && shape.last_layer {
                shape.n_out
            } else {
                shape.n_tokens
            };
            self.reduce(others, rows)?;
        }
        for e in std::iter::once(&mut *self).chain(others.iter_mut().map(|e| &mut **e)) {
            e.pager.end_step(e.kv.tier_mut())?;
            if let Some(h) = e.host.as_ref() {
                h.park_threads();
            }
        }
        if n_out > 0 {
            self.run_head(n_out, out)?;
        }
        self.backend.synchronize();
        for e in std::iter::once(&mut *self).chain(others.iter_mut().map(|e| &mut **e)) {
            e.backend.synchronize();
            e.finish_part();
        }
        Ok(())
    }

    /// This device's share of a group: queued on its stream, or computed
    /// by the host CPU from its copy, the result back in this device's
    /// residual stream.
    fn run_share(
        &mut self,
        l: u32,
        kind: GroupKind,
        shape: crate::graph::StepShape,
        on_cpu: bool,
    ) -> Result<(), EngineError> {
        if on_cpu {
            let mut x_host = None;
            self.run_host_group(l, kind, shape, &mut x_host)?;
            // each device's host pool has its own cores (`shard_threads`)
            self.residual_to_device(&mut x_host)
        } else {
            self.run_group(l, kind, shape)
        }
    }

    /// Adds the other devices' outputs (the first `rows` rows of their
    /// residual streams) to this device's, then copies the sum to theirs.
    fn reduce(&mut self, others: &mut [Box<Engine>], rows: u32) -> Result<(), EngineError> {
        let e = i64::from(self.spec.hp.n_embd);
        let ctx = Context::new(2 + others.len() * 2, 0)?;
        let view = |b: &crate::ggml::Binding| -> Result<crate::ggml::Tensor<'_>, EngineError> {
            let t = ctx.new_tensor(GgmlType::F32, &[e, i64::from(rows)]);
            // SAFETY: the binding is a persistent F32 [n_embd, n_batch]
            // tensor (rows <= n_batch: a view of its first rows), kept
            // alive by its engine for the whole step; the view is only
            // read by the copies below, which complete before the step
            // ends (every stream is drained then).
            unsafe { t.rebind(b)? };
            Ok(t)
        };
        let x0 = view(&self.persistent.bindings[buffers::X])?;
        for (j, o) in others.iter().enumerate() {
            let y = &self.reduce[j];
            let yv = view(&y.arena.binding(0))?;
            let xo = view(&o.persistent.bindings[buffers::X])?;
            // SAFETY: same size and layout; xo was last written by o's
            // graph (this copy is queued after it on o's stream) and is
            // next written by the copy back below, queued after the add
            // that reads yv; yv was last read by the add of the group
            // before, which this device's stream ran before the copy back
            // that o's stream waited for ahead of this group's graph.
            unsafe { o.backend.copy_tensor_async(&self.backend, xo, yv) };
            let key = TemplateKey::AddRows { n_rows: rows };
            let id = BindId {
                group: None,
                weight_slot: Some(j),
                kv_window: None,
            };
            self.templates
                .get(&key)?
                .bind(id, &[y.arena.binding(0)], None)?;
            let t = self.templates.allocated(&key, &self.backend)?;
            self.backend.compute_async(&t.graph())?;
        }
        for o in others.iter() {
            let xo = view(&o.persistent.bindings[buffers::X])?;
            // SAFETY: as above; queued after the adds on this device's
            // stream, and o's stream waits for it before its next graph.
            unsafe { self.backend.copy_tensor_async(&o.backend, x0, xo) };
        }
        Ok(())
    }

    /// The statistics and tuning after this part's share of a step.
    pub(super) fn finish_part(&mut self) {
        let p = self.pending.as_ref().expect("begun");
        self.last_step = StepStats {
            n_tokens: p.n_tokens,
            seconds: p.start.elapsed().as_secs_f64(),
            pager: self.pager.stats,
            disk_bytes: self.store.disk_bytes_read() - p.disk0,
            kv: self.kv.tier().map(|k| k.step).unwrap_or_default(),
            host: self.host.as_ref().map(|h| h.stats).unwrap_or_default(),
        };
        let n = p.n_tokens as u32;
        self.calibrate_cpu(n);
        // the thread tuner is not told: several devices' host shares
        // share the cores
    }
}
