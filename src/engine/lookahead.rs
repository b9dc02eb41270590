//! Look-ahead, the execution side (`paging::lookahead` says what and why):
//! while the host computes a mixture layer, the next host layer's
//! predicted experts go up over the bus into a slot, and when that layer
//! comes the device computes the picks the slot holds while the CPU
//! computes the others.
//!
//! The prefetches run `depth` host layers ahead (`--look-ahead-layers`),
//! through a ring of depth + 1 slots: the j-th host layer of a step uses
//! slot j modulo depth + 1, so a prefetch never writes the slot the
//! current layer reads. A slot is written only by the host after the
//! device's last graph over it completed (each host layer ends by
//! draining the compute stream, `finish_ahead`), and read only
//! after the compute stream waited for the slot's `loaded` event, recorded
//! on the upload stream after its copies. The uploads go on a stream of
//! their own, so they never queue behind the ring's, and the slots'
//! graphs have an activation buffer of their own: a hot-expert graph
//! queued just before holds its output in the engine's until read.

use super::aheadslots::LookAhead;
use super::error::EngineError;
use super::host::{pad_picks, Pick};
use super::state::Engine;
use super::timeline;
use crate::ggml::Binding;
use crate::graph::BindId;
use crate::model::GroupId;

impl Engine {
    /// Whether group `gi` has a look-ahead.
    pub(super) fn has_ahead(&self, gi: GroupId) -> bool {
        self.ahead.as_ref().is_some_and(|a| a.has(gi.index()))
    }

    /// Splits `picks` of group `gi` into those a slot holds, queued on the
    /// device now, and the others, returned for the host. `cur`: the
    /// router's normed rows F32 [n_embd, n_tokens].
    pub(super) fn queue_ahead(
        &mut self,
        gi: GroupId,
        cur: &[f32],
        picks: Vec<Pick>,
    ) -> Result<(Vec<Pick>, Vec<Pick>), EngineError> {
        let Some(a) = self.ahead.as_mut() else {
            return Ok((picks, Vec::new()));
        };
        let Some(s) = (0..a.slots.len()).find(|&s| a.slots[s].group == Some(gi.index())) else {
            return Ok((picks, Vec::new()));
        };
        let (mut got, mut rest) = (Vec::new(), Vec::new());
        for p in picks {
            match a.slots[s].set.iter().position(|&x| x as i32 == p.expert) {
                Some(k) => got.push(Pick {
                    expert: k as i32,
                    ..p
                }),
                None => rest.push(p),
            }
        }
        if let Some(h) = self.host.as_mut() {
            h.stats.ahead_picks += (got.len() + rest.len()) as u64;
            h.stats.ahead_hits += got.len() as u64;
        }
        if got.is_empty() {
            return Ok((rest, got));
        }
        let n = pad_picks(got.len() as u32);
        if n > a.io.most {
            return Err(EngineError::Unsupported(
                "more look-ahead picks than the device's rows hold",
            ));
        }
        let e = self.spec.hp.n_embd as usize;
        // nothing queued reads them: the last graph over them was waited
        // for (`finish_ahead`) before these are written
        a.io.write(&got, cur, e, n)?;
        let slot = &a.slots[s];
        let base = slot.arena.offset(0);
        let mut binds = a.offsets[&gi.index()]
            .iter()
            .map(|&o| Binding::at(slot.arena.buffer(), base + o))
            .collect::<Result<Vec<_>, _>>()?;
        binds.extend(a.io.bindings());
        if let Some(ev) = &slot.loaded {
            // resident only once its copies completed
            ev.wait_on(&self.backend);
        }
        let key = LookAhead::key(&self.spec, gi.index(), s, a.most, n);
        let id = BindId {
            group: Some(gi),
            weight_slot: Some(s),
            kv_window: None,
        };
        a.templates.get(&key)?.bind(id, &binds, None)?;
        let t = a.templates.allocated(&key, &self.backend)?;
        let layer = gi.layer() + self.spec.hp.layer0;
        let rec = self.rec.scope(
            timeline::Stream::Compute,
            &self.backend,
            || format!("ffn {layer} (prefetched experts)"),
            0,
        );
        self.backend.compute_async(&t.graph())?;
        drop(rec);
        Ok((rest, got))
    }

    /// Waits for the device's look-ahead picks (`queue_ahead`) and adds
    /// them, weighted, to `sums`.
    pub(super) fn finish_ahead(
        &mut self,
        gi: GroupId,
        got: &[Pick],
        sums: &mut [f32],
    ) -> Result<(), EngineError> {
        if got.is_empty() {
            return Ok(());
        }
        let a = self.ahead.as_mut().expect("queue_ahead found it");
        let s = (0..a.slots.len())
            .find(|&s| a.slots[s].group == Some(gi.index()))
            .expect("queue_ahead found the slot");
        let n = pad_picks(got.len() as u32);
        let key = LookAhead::key(&self.spec, gi.index(), s, a.most, n);
        self.backend.synchronize();
        let e = self.spec.hp.n_embd as usize;
        let t = a.templates.get(&key)?;
        a.io.add_out(t, got, e, n, sums)
    }

    /// Predicts the experts of the next `depth` host layers of this step
    /// from `cur` (layer `gi`'s normed rows), those not predicted yet, and
    /// uploads each one's (but those the device holds as hot experts)
    /// into its slot: the j-th host layer of the step uses slot j modulo
    /// depth + 1, never the one layer `gi` reads.
    pub(super) fn prefetch_after(&mut self, gi: GroupId, cur: &[f32]) -> Result<(), EngineError> {
        let Some(a) = self.ahead.as_ref() else {
            return Ok(());
        };
        let Some(i) = a.targets.iter().position(|&t| t == gi.index()) else {
            return Ok(());
        };
        let last = (i + a.depth()).min(a.targets.len().saturating_sub(1));
        for j in a.issued.max(i + 1)..=last {
            self.prefetch(gi, j, cur)?;
        }
        Ok(())
    }

    /// Predicts and uploads the experts of this step's `j`-th host layer
    /// (see `prefetch_after`).
    fn prefetch(&mut self, gi: GroupId, j: usize, cur: &[f32]) -> Result<(), EngineError> {
        let a = self.ahead.as_mut().expect("checked by the caller");
        let next = a.targets[j];
        a.issued = j + 1;
        let s = j % a.slots.len();
        if a.slots[s].group == Some(gi.index()) {
            // a slot kept from an earlier step that the current layer
            // reads: not overwritten under it
            return Ok(());
        }
        let hp = &self.spec.hp;
        let hot = self.hot.as_ref();
        let set = crate::paging::lookahead::predict(
            &a.routers[&next],
            cur,
            hp.n_embd as usize,
            hp.n_expert_used as usize,
            a.most as usize,
            |e| hot.is_some_and(|h| h.plan.slot_of(next, e).is_some()),
        );
        if a.slots[s].group == Some(next) && a.slots[s].set == set {
            return Ok(());
        }
        // one slot per group: another one holding it (kept from an
        // earlier step) is not read before this one is filled
        for o in a.slots.iter_mut() {
            if o.group == Some(next) {
                o.group = None;
            }
        }
        // the slot's last reader finished: every host layer drains the
        // compute stream before the next one begins, and its last reader
        // was at least one host layer before this one
        let slot = &mut a.slots[s];
        let src = self.store.host_extent(GroupId::from_index(next), || ())?;
        let layout = &self.store.layouts[next].offsets;
        let ws: Vec<_> = self.spec.groups[next]
            .weights
            .iter()
            .zip(layout)
            .filter(|(w, _)| w.role.is_some_and(|r| r.is_expert()))
            .collect();
        let t = slot.arena.tensor(0);
        let mut bytes = 0u64;
        let layer = GroupId::from_index(next).layer() + self.spec.hp.layer0;
        let rec = self.rec.scope(
            timeline::Stream::Copy,
            &a.upload,
            || format!("ffn {layer} (look-ahead, {} experts)", set.len()),
            0,
        );
        for ((w, &from), &to) in ws.iter().zip(&a.offsets[&next]) {
            let per = w.size as usize / w.ne[2].max(1) as usize;
            for (k, &x) in set.iter().enumerate() {
                let at = from + x as usize * per;
                // SAFETY: the source is the group's pinned extent, written
                // only at load; the slot's byte range lies inside its tensor
                // (sized for `most` experts of every look-ahead group), and
                // no graph reads it until the compute stream waited for the
                // event recorded below.
                unsafe {
                    a.upload
                        .tensor_set_async(t, &src[at..at + per], to + k * per)
                };
                bytes += per as u64;
            }
        }
        drop(rec);
        if let Some(ev) = &slot.loaded {
            ev.record(&a.upload);
        }
        slot.group = Some(next);
        slot.set = set;
        if let Some(h) = self.host.as_mut() {
            h.stats.ahead_bytes += bytes;
            h.stats.ahead_experts += slot.set.len() as u64;
        }
        Ok(())
    }
}
