//! A hybrid step in two halves of rows (`--cpu-halves`; which steps and
//! the stages: `paging::halves`). The step's rows are cut in halves A and
//! B that run the same groups one stage apart, so the device computes one
//! half's groups while the host CPU computes the other's:
//!
//! 1. the device queues a stage's groups for A (each group's slot bound
//!    once, `begin_group`), and an event marks A's rows done;
//! 2. then the host computes the CPU group that ended the stage before for
//!    B: it waits B's event, downloads B's rows, computes, uploads them,
//!    while the device runs A's stage;
//! 3. the device queues the stage's groups for B and releases their slots
//!    (`end_group`), and an event marks B's rows done;
//! 4. the host computes the stage's CPU group for A (waiting A's event)
//!    while the device runs B's stage; and so on.
//!
//! Each half's rows are read and written only by its own graphs: an
//! upload of A's rows while B's graphs run touches nothing they read. The
//! model's last layer runs whole after both halves (`Engine::run_part`).

use super::buffers;
use super::error::EngineError;
use super::state::Engine;
use super::timeline;
use crate::graph::StepShape;
use crate::model::{GroupId, GroupKind};
use crate::paging::halves::{first_half, plan_halves, HalfItem, Stage, HALVES_MIN_TOKENS};
use crate::paging::Ring;
use std::time::Instant;

/// A group of the step: layer, kind, shape.
type Item = (u32, GroupKind, StepShape);

impl Engine {
    /// The stages of a step of `n` tokens run in halves, where this one
    /// is (`--cpu-halves`, a step of at least `HALVES_MIN_TOKENS` whose
    /// host CPU computes FFN groups, on one device, no sliding-window or
    /// windowed-KV layers, no routed or split groups), over the order's
    /// groups before the model's last layer.
    pub(super) fn plan_cpu_halves(
        &self,
        n: u32,
        order: &[Item],
        on_cpu: &[bool],
    ) -> Option<Vec<Stage>> {
        let halves = self.cpu_halves.as_ref()?;
        let last = self.spec.hp.n_layer.checked_sub(1)?;
        let single = self.next.is_none() && self.spec.shard.is_none() && self.spec.has_head;
        if n < HALVES_MIN_TOKENS || !single || self.spec.hp.n_swa > 0 {
            return None;
        }
        let prefix = order.iter().take_while(|(l, ..)| *l < last);
        let mut items = Vec::new();
        for &(l, kind, s) in prefix {
            let gi = GroupId::new(l, kind);
            let cpu = on_cpu[gi.index()];
            if s.routed || s.dev_experts > 0 || s.n_out != s.n_tokens || s.row0 != 0 {
                return None;
            }
            if (cpu && kind != GroupKind::Ffn) || self.kv.is_windowed(l) {
                return None;
            }
            let ring = match self.store.groups[gi.index()] {
                super::store::Location::Streamed { ring, .. } if !cpu => Some(ring),
                _ => None,
            };
            items.push(HalfItem { cpu, ring });
        }
        let slots = [Ring::Attn, Ring::Ffn].map(|r| self.pager.slots(r));
        let stages = plan_halves(&items, slots);
        if stages.is_none() && items.iter().any(|i| i.cpu) && !halves.warned.replace(true) {
            tracing::warn!(
                "--cpu-halves: steps of {n} tokens run whole: a stage between host groups streams \
                 more groups than the rings' {} and {} slots less one allow (raise --slots)",
                slots[0],
                slots[1]
            );
        }
        stages
    }

    /// The two halves of a covered group's shape (all of the step's rows:
    /// `plan_cpu_halves` covers no last layer).
    pub(super) fn half_shapes(shape: StepShape) -> [StepShape; 2] {
        shape.halves(first_half(shape.n_tokens))
    }

    /// Runs the order's first groups (those `stages` cover) in halves of
    /// the step's rows; the residual stream is on the device after.
    pub(super) fn run_halves(
        &mut self,
        order: &[Item],
        stages: &[Stage],
    ) -> Result<(), EngineError> {
        let mut cpu_before: Option<Item> = None;
        for st in stages {
            if let Some(c) = cpu_before {
                self.host_half(c, 0)?;
            }
            let mut bound = Vec::with_capacity(st.device.len());
            for &(l, kind, s) in &order[st.device.clone()] {
                let g = self.begin_group(l, kind)?;
                self.compute_group(&g, Self::half_shapes(s)[0], true, None)?;
                bound.push((g, s));
            }
            self.mark_half(0);
            if let Some(c) = cpu_before {
                self.host_half(c, 1)?;
            }
            for (g, s) in bound {
                self.compute_group(&g, Self::half_shapes(s)[1], true, None)?;
                self.end_group(g)?;
            }
            self.mark_half(1);
            cpu_before = st.cpu.map(|c| order[c]);
        }
        Ok(())
    }

    /// Marks on the device's stream that half `h`'s rows, as queued so
    /// far, are computed.
    fn mark_half(&self, h: usize) {
        if let Some(d) = self.cpu_halves.as_ref().and_then(|c| c.done.as_ref()) {
            d[h].record(&self.backend);
        }
    }

    /// The host computes CPU group `item` over half `h` of the step's
    /// rows: once the device computed that half's rows, they come down,
    /// the CPU computes, they go back up.
    fn host_half(&mut self, item: Item, h: usize) -> Result<(), EngineError> {
        let (l, kind, s) = item;
        let shape = Self::half_shapes(s)[h];
        let w0 = Instant::now();
        if let Some(d) = self.cpu_halves.as_ref().and_then(|c| c.done.as_ref()) {
            d[h].synchronize();
        }
        let w1 = Instant::now();
        let (gi, key) = self.group_key(l, kind, shape);
        let x = self.persistent.tensor(buffers::X);
        let host = self
            .host
            .as_mut()
            .expect("a plan with CPU groups has a host");
        host.download_rows(x, shape.row0, shape.n_tokens)?;
        let t0 = Instant::now();
        host.compute(gi, &key)?;
        let t1 = Instant::now();
        self.rows_to_device(h, shape.row0, shape.n_tokens)?;
        let t2 = Instant::now();
        if self.routing.is_some() {
            let host = self.host.as_mut().expect("checked above");
            let ids = host.routed(&key)?;
            self.count_routed(l, &ids)?;
        }
        let cpu = timeline::Stream::Cpu;
        self.rec.host_span(cpu, || "wait for rows".into(), w0, w1);
        self.rec.host_span(cpu, || "rows down".into(), w1, t0);
        self.rec.host_span(cpu, || "rows up".into(), t1, t2);
        self.rec.host_span(
            cpu,
            || {
                let r = shape.row0;
                let name = format!("{} {}", kind.name(), l + self.spec.hp.layer0);
                format!("{name} (rows {r}-{})", r + shape.n_tokens - 1)
            },
            t0,
            t1,
        );
        Ok(())
    }
}
