//! Expert split, the execution side (`paging::split` says what and why):
//! a streamed mixture FFN group whose first experts the device computes
//! from a partial upload while the host CPU computes the others' picks
//! from its own copy, at the same time.
//!
//! For a split group at a step of n tokens:
//! 1. the pager uploads the group's norm and router whole and only the
//!    first `k` experts of each expert tensor, and zeroes the rest of them
//!    in the slot on the copy stream (`split_ranges`);
//! 2. the router graph runs on the device and the host reads its normed
//!    rows, picks and weights (one drain of the compute stream);
//! 3. the device's FFN graph is queued: picks of the zeroed experts add
//!    exactly nothing there (a zero matrix's product is 0), and it routes
//!    as the router graph does, so both pick alike (`graph::moe::route`);
//! 4. meanwhile the host computes the picks of experts `k..` and sums them
//!    per token;
//! 5. its rows go up and a small graph adds them to the residual, queued
//!    after the device's FFN.

use super::buffers::RouterReads;
use super::error::EngineError;
use super::host::picks_of;
use super::pager::Partial;
use super::state::Engine;
use super::store::Location;
use super::timeline;
use crate::graph::{BindId, NodeRead, StepShape, TemplateKey, ROUTED, ROUTER_IN, WEIGHTS};
use crate::model::{GroupId, GroupKind};
use std::time::Instant;

/// The byte ranges of a group's extent (weights at `offsets`) an upload
/// keeping the experts `on` marks (`paging::device_experts`) carries, and
/// those its slot zeroes instead: each weight whole, but of an expert
/// tensor only the marked experts (the outermost dimension), the others
/// zeroed; adjacent ranges merged.
pub(super) fn split_ranges(
    weights: &[crate::model::WeightSpec],
    offsets: &[usize],
    on: &[bool],
) -> Partial {
    let mut p = Partial::default();
    for (w, &off) in weights.iter().zip(offsets) {
        let size = w.size as usize;
        if !(w.role.is_some_and(|r| r.is_expert()) && w.ne[2] > 0) {
            p.up.push((off, size));
            continue;
        }
        let n = w.ne[2] as usize;
        let per = size / n;
        let mut e = 0;
        while e < n {
            let up = on.get(e).copied().unwrap_or(false);
            let run = (e..n)
                .take_while(|&x| on.get(x).copied().unwrap_or(false) == up)
                .count();
            let r = (off + e * per, run * per);
            if up {
                p.up.push(r);
            } else {
                p.zero.push(r);
            }
            e += run;
        }
    }
    p
}

/// A split layer's router outputs: read (the device drained), or queued
/// into the split's pinned memory behind the router
/// ([`Engine::queue_router_reads`]).
enum RouterOut {
    Read(Vec<f32>, Vec<i32>, Vec<f32>),
    Queued(Vec<Option<NodeRead>>),
}

impl Engine {
    /// This step's split groups (`dev_experts` > 0 in their shapes) and
    /// the ranges their uploads carry, for the pager.
    pub(super) fn plan_partial_uploads(&mut self, split: &[(GroupId, u32)]) {
        self.pager.partial.clear();
        for &(gi, k) in split {
            let on = self.split_experts(gi.layer(), k);
            let ranges = split_ranges(
                &self.spec.groups[gi.index()].weights,
                &self.store.layouts[gi.index()].offsets,
                &on,
            );
            self.pager.partial.insert(gi.index(), ranges);
        }
    }

    /// The experts of split layer `layer` the device computes at `k`
    /// (`paging::device_experts`), as a mask over the layer's experts.
    pub fn split_experts(&self, layer: u32, k: u32) -> Vec<bool> {
        let order = self
            .split
            .as_ref()
            .and_then(|s| s.order.get(layer as usize))
            .and_then(|o| o.as_deref());
        crate::paging::device_experts(order, self.spec.hp.n_expert, k)
    }

    /// The router graph of mixture FFN group `gi` at `n` rows.
    fn router_key(&self, gi: GroupId, n: u32) -> TemplateKey {
        TemplateKey::Router {
            sig: self.spec.groups[gi.index()].signature(),
            n_tokens: n,
            instance: gi.index() as u32,
        }
    }

    /// Queues mixture FFN group `gi`'s router graph over `n` rows on the
    /// device (its weights bound as `b`).
    fn queue_router(
        &mut self,
        gi: GroupId,
        n: u32,
        id: BindId,
        b: &[crate::ggml::Binding],
    ) -> Result<(), EngineError> {
        let rkey = self.router_key(gi, n);
        self.templates.get(&rkey)?.bind(id, b, None)?;
        let t = self.templates.allocated(&rkey, &self.backend)?;
        let rec = self.rec.scope(
            timeline::Stream::Compute,
            &self.backend,
            || format!("router {}", gi.layer()),
            0,
        );
        self.backend.compute_async(&t.graph())?;
        drop(rec);
        Ok(())
    }

    /// Runs mixture FFN group `gi`'s router graph over `n` rows on the
    /// device (its weights bound as `b`) and drains the device; returns
    /// the graph, whose picks are then readable. Routed uploads' first
    /// step (and the expert split's where the device cannot read ahead,
    /// [`Engine::queue_router_reads`]).
    pub(super) fn run_router(
        &mut self,
        gi: GroupId,
        n: u32,
        id: BindId,
        b: &[crate::ggml::Binding],
    ) -> Result<&crate::graph::Template, EngineError> {
        self.queue_router(gi, n, id, b)?;
        self.backend.synchronize();
        let rkey = self.router_key(gi, n);
        self.templates.allocated(&rkey, &self.backend)
    }

    /// Queues, right behind group `gi`'s router graph at `n` rows, copies
    /// of its rows, picks and weights into the split's pinned host memory
    /// and an event after them, so the host can queue the experts' graph
    /// (which reuses those activations) before it waits. None where the
    /// device has no pinned memory or events (then the caller drains it and
    /// reads, as [`Engine::run_router`]).
    fn queue_router_reads(
        &mut self,
        gi: GroupId,
        n: u32,
    ) -> Result<Option<Vec<Option<NodeRead>>>, EngineError> {
        const NODES: [&str; 3] = [ROUTER_IN, ROUTED, WEIGHTS];
        let rkey = self.router_key(gi, n);
        let need = self
            .templates
            .allocated(&rkey, &self.backend)?
            .read_bytes(&NODES);
        let Some(rows) = self.split.as_mut() else {
            return Ok(None);
        };
        if rows.reads.as_ref().is_some_and(|r| r.len() < need) {
            rows.reads = None;
            rows.reads_tried = false;
        }
        if rows.reads.is_none() && !rows.reads_tried {
            rows.reads_tried = true;
            // STRATA_SPLIT_READS=drain keeps the drain-then-read order on a
            // GPU too: tools/device/split-host.sh checks that both give the
            // same tokens
            let drain = std::env::var_os("STRATA_SPLIT_READS").is_some_and(|v| v == "drain");
            if !drain {
                rows.reads = RouterReads::new(self.device, need.next_multiple_of(1 << 20));
            }
        }
        let Some(reads) = rows.reads.as_mut() else {
            return Ok(None);
        };
        let t = self.templates.allocated(&rkey, &self.backend)?;
        // SAFETY: the pinned memory is read only after `wait`, past the
        // event recorded right after these copies, and written by nothing
        // else: the next reads are queued after that wait.
        let at = unsafe { t.queue_reads(&self.backend, &NODES, reads.bytes_mut())? };
        reads.record(&self.backend);
        Ok(Some(at))
    }

    /// Streamed group `gi` bound in its slot once its upload is in (the
    /// device's stream waits for it), leaving the last `hold` uploads of
    /// its ring's window for later (`Pager::before_compute_holding`): its
    /// ring, its weights' bindings there and the bind id. `resident`: the
    /// error for a group that is not streamed.
    pub(super) fn bind_streamed(
        &mut self,
        gi: GroupId,
        hold: usize,
        resident: &'static str,
    ) -> Result<(crate::paging::Ring, Vec<crate::ggml::Binding>, BindId), EngineError> {
        let Location::Streamed { ring, .. } = self.store.groups[gi.index()] else {
            return Err(EngineError::Unsupported(resident));
        };
        let slot = self.pager.before_compute_holding(
            gi,
            ring,
            &self.store,
            &self.backend,
            self.kv.tier_mut(),
            hold,
        )?;
        let b = self.store.slot_bindings(gi, ring, slot)?;
        let id = BindId {
            group: Some(gi),
            weight_slot: Some(slot),
            kv_window: None,
        };
        Ok((ring, b, id))
    }

    /// Runs FFN group `layer` split at `shape.dev_experts` (see the module
    /// notes). The residual is on the device.
    pub(super) fn run_split_ffn(
        &mut self,
        layer: u32,
        shape: StepShape,
    ) -> Result<(), EngineError> {
        let gi = GroupId::new(layer, GroupKind::Ffn);
        let (ring, b, id) = self.bind_streamed(gi, 0, "an expert split of a resident group")?;
        let n = shape.n_tokens;
        let dev = shape.dev_experts;
        let on = self.split_experts(layer, dev);
        let sig = self.spec.groups[gi.index()].signature();

        // 2. the router, then (3.) the device's experts, queued; the
        // router's rows, picks and weights read back between the two on the
        // device's stream where it can (a GPU), so the host waits only for
        // the router, not for the experts' graph, whose launch is off the
        // host's path; elsewhere the device drains and the host reads first
        // (the experts' graph reuses those activations)
        let t_router = Instant::now();
        self.queue_router(gi, n, id, &b)?;
        let router = match self.queue_router_reads(gi, n)? {
            Some(at) => RouterOut::Queued(at),
            None => {
                self.backend.synchronize();
                let t = self
                    .templates
                    .allocated(&self.router_key(gi, n), &self.backend)?;
                RouterOut::Read(
                    t.read_node(ROUTER_IN)?,
                    t.read_node(ROUTED)?,
                    t.read_node(WEIGHTS)?,
                )
            }
        };
        // (its activations growing drains the device first: the reads are
        // in by then)
        let (_, key) = self.group_key(layer, GroupKind::Ffn, shape);
        self.templates.get(&key)?.bind(id, &b, None)?;
        let t = self.templates.allocated(&key, &self.backend)?;
        let rec = self.rec.scope(
            timeline::Stream::Compute,
            &self.backend,
            || format!("ffn {layer} ({dev} experts)"),
            0,
        );
        self.backend.compute_async(&t.graph())?;
        drop(rec);
        self.pager
            .after_compute(gi, ring, &self.store, &self.backend, self.kv.tier_mut())?;
        let (cur, ids, wts): (Vec<f32>, Vec<i32>, Vec<f32>) = match router {
            RouterOut::Read(cur, ids, wts) => (cur, ids, wts),
            RouterOut::Queued(at) => {
                let reads = self.split.as_mut().and_then(|r| r.reads.as_mut()).ok_or(
                    EngineError::Unsupported("router reads without their memory"),
                )?;
                reads.wait();
                let host = reads.bytes_mut();
                let node = |i: usize| {
                    at.get(i)
                        .copied()
                        .flatten()
                        .ok_or(EngineError::Unsupported("a router graph without its picks"))
                };
                (
                    node(0)?.rows(host),
                    node(1)?.rows(host),
                    node(2)?.rows(host),
                )
            }
        };
        let mut picks = picks_of(&ids, &wts, self.spec.hp.n_expert_used as usize, n as usize)?;
        self.count_routed(layer, &ids)?;
        self.rec.host_span(
            timeline::Stream::Host,
            || format!("router {layer}: rows and picks read"),
            t_router,
            Instant::now(),
        );
        // the host's side: the experts the slot holds zeros for
        picks.retain(|p| !on.get(p.expert as usize).copied().unwrap_or(false));

        if picks.is_empty() {
            // every pick on the device: nothing for the host to add
            return Ok(());
        }
        // the picks of hot experts (`engine::hot`) to the device's pool
        let (picks, hot) = self.queue_hot(gi, &cur, picks)?;

        // 4. the host's experts meanwhile
        let rows = self
            .split
            .as_mut()
            .expect("a split plan allocates its rows");
        let mut sums = std::mem::take(&mut rows.host);
        if self.device.is_cpu() {
            // a CPU standing in for the device: its pool would spin on the
            // host's cores
            self.backend.synchronize();
            self.backend.park_threads();
        }
        let host = self.host.as_mut().expect("a split plan has a host");
        let t0 = Instant::now();
        let r = host.split_experts(gi, &sig, &cur, &picks, &mut sums);
        let t1 = Instant::now();
        self.rec.host_span(
            timeline::Stream::Cpu,
            || format!("ffn {layer} (the other experts, {} picks)", picks.len()),
            t0,
            t1,
        );
        r?;
        // its phases on the host's own track, for the trace
        let mut at = t0;
        for (name, d) in ["rows in", "experts", "rows out"]
            .iter()
            .zip(host.split_phases)
        {
            self.rec.host_span(
                timeline::Stream::Host,
                || format!("ffn {layer}: {name}"),
                at,
                at + d,
            );
            at += d;
        }
        self.finish_hot(gi, &hot, &mut sums)?;

        // 5. its rows up (nothing queued reads them: the last add ran
        // before the router, which the host waited for), added after the
        // device's experts
        let rows = self.split.as_mut().expect("checked above");
        rows.arena
            .tensor(0)
            .set_bytes(bytemuck::cast_slice(&sums), 0)?;
        let y = rows.arena.binding(0);
        rows.host = sums;
        let akey = TemplateKey::AddRows { n_rows: n, row0: 0 };
        self.templates
            .get(&akey)?
            .bind(BindId::head(), &[y], None)?;
        let t = self.templates.allocated(&akey, &self.backend)?;
        let rec = self.rec.scope(
            timeline::Stream::Compute,
            &self.backend,
            || format!("ffn {layer}: host rows added"),
            0,
        );
        self.backend.compute_async(&t.graph())?;
        drop(rec);
        // the host's side from its experts' end to the add queued
        self.rec.host_span(
            timeline::Stream::Host,
            || format!("ffn {layer}: rows up queued"),
            t1,
            Instant::now(),
        );
        Ok(())
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::dtype::GgmlType;
    use crate::model::{Role, WeightSpec};

    /// A mixture FFN group of 4 experts and its weights' offsets.
    pub(in crate::engine) fn group() -> ([WeightSpec; 4], [usize; 4]) {
        let ws = [
            w(Role::FfnNorm, [8, 1, 1, 1], 32),
            w(Role::GateInp, [8, 4, 1, 1], 128),
            w(Role::GateExps, [8, 6, 4, 1], 768),
            w(Role::DownExps, [6, 8, 4, 1], 768),
        ];
        (ws, [0, 256, 512, 1536])
    }

    fn w(role: Role, ne: [i64; 4], size: u64) -> WeightSpec {
        WeightSpec {
            role: Some(role),
            name: String::new(),
            ty: GgmlType::F32,
            ne,
            offset: 0,
            size,
            cols: None,
        }
    }

    #[test]
    fn a_split_upload_carries_the_device_experts_and_zeroes_the_rest() {
        let (ws, offsets) = group();
        assert_eq!(
            split_ranges(&ws, &offsets, &[true, false, false, false]),
            Partial {
                up: vec![(0, 32), (256, 128), (512, 192), (1536, 192)],
                zero: vec![(704, 576), (1728, 576)],
            }
        );
        assert_eq!(
            split_ranges(&ws, &offsets, &[true; 4]),
            Partial {
                up: vec![(0, 32), (256, 128), (512, 768), (1536, 768)],
                zero: vec![],
            }
        );
        // the most picked experts where counts ordered them: runs of each
        assert_eq!(
            split_ranges(&ws, &offsets, &[false, true, true, false]),
            Partial {
                up: vec![(0, 32), (256, 128), (704, 384), (1728, 384)],
                zero: vec![(512, 192), (1088, 192), (1536, 192), (2112, 192)],
            }
        );
    }
}
