//! Routed uploads, the execution side (`paging::routed` says what and
//! why): a streamed mixture FFN group of a step on the device goes up
//! only as far as the step's tokens picked its experts.
//!
//! For a routed group at a step of n tokens:
//! 1. the ring uploads, ahead as ever, the group's other weights and the
//!    experts the plan called sure (`Pager::partial`);
//! 2. the router graph runs on the device and the host reads its picks
//!    (one drain of the compute stream);
//! 3. the picked experts not sent ahead go up into the slot behind
//!    whatever the copy stream holds (`Pager::top_up`), and the device's
//!    stream waits for them; the ring's window issues its last upload
//!    only after them (`Pager::before_compute_holding`): that upload's
//!    slot is already free, so the bus carries it while the device
//!    computes this layer and the next one's router, where it would
//!    otherwise wait for a slot this layer frees and leave the bus idle;
//! 4. the group's FFN graph, routing as the router graph does (so both
//!    pick alike: `graph::moe::route`), reads only the experts its picks
//!    name: the slot's other experts hold whatever they held.

use super::error::EngineError;
use super::pager::{Partial, Range};
use super::state::Engine;
use super::store::Location;
use super::timeline;
use crate::graph::{StepShape, ROUTED};
use crate::model::{GroupId, GroupKind, WeightSpec};
use crate::paging::routed::{choose, pick_chances, RoutedGroup, RoutedStats, RoutedUploads};
use crate::paging::CpuCalibration;

/// Whether a weight is an expert tensor of `n_expert` experts (the
/// outermost dimension).
fn is_experts(w: &WeightSpec, n_expert: u32) -> bool {
    w.role.is_some_and(|r| r.is_expert()) && w.ne[2] == i64::from(n_expert) && n_expert > 0
}

/// Ranges sorted by offset, adjacent ones merged.
fn merged(mut r: Vec<Range>) -> Vec<Range> {
    r.sort_unstable();
    let mut out: Vec<Range> = Vec::with_capacity(r.len());
    for (off, len) in r {
        match out.last_mut() {
            Some(last) if last.0 + last.1 == off => last.1 += len,
            _ => out.push((off, len)),
        }
    }
    out
}

/// The byte ranges of a group's extent (weights at `offsets`) holding
/// `experts` of each expert tensor, and with `others` every weight that
/// is not an expert tensor whole; adjacent ranges merged.
pub(super) fn expert_ranges(
    weights: &[WeightSpec],
    offsets: &[usize],
    n_expert: u32,
    experts: &[u32],
    others: bool,
) -> Vec<Range> {
    let mut r = Vec::new();
    for (w, &off) in weights.iter().zip(offsets) {
        let size = w.size as usize;
        if is_experts(w, n_expert) {
            let per = size / n_expert as usize;
            r.extend(
                experts
                    .iter()
                    .filter(|&&e| e < n_expert)
                    .map(|&e| (off + e as usize * per, per)),
            );
        } else if others {
            r.push((off, size));
        }
    }
    merged(r)
}

/// A step's routed uploads, chosen before its groups are placed
/// ([`Engine::choose_routed_step`]).
#[derive(Default)]
pub(super) struct RoutedStep {
    /// By group index, how each routed group goes up.
    choices: Vec<(usize, RoutedGroup)>,
    /// The routed step's prediction, where the engine has one.
    predicted_s: Option<f64>,
    /// Some: the step runs routed in place of the hybrid plan's, whose
    /// prediction this is.
    hybrid_s: Option<f64>,
    /// The factor on the probe's CPU time that prediction took
    /// (`CpuCalibration::factor`).
    hybrid_factor: f64,
    /// The step runs routed because of that factor: at the probe's speed
    /// the hybrid step would have been predicted faster.
    by_factor: bool,
}

impl RoutedStep {
    /// Whether the step runs routed in place of the hybrid plan's only
    /// because the host's steps of its size band ran slower than probed
    /// (`CpuCalibration::skipped` counts these).
    pub(super) fn off_host_by_factor(&self) -> bool {
        self.by_factor
    }
}

impl Engine {
    /// The groups of `order` a step of `n` tokens would route, with how
    /// each goes up (by group index): its streamed mixture FFN groups on
    /// the device (not `on_cpu`, not split) whose routing pays (`auto`)
    /// or all of them (forced). Empty where nothing can be routed.
    fn routed_choices(
        &self,
        n: u32,
        order: &[(u32, GroupKind, StepShape)],
        on_cpu: &[bool],
    ) -> Vec<(usize, RoutedGroup)> {
        let Some(r) = self.routed.as_ref() else {
            return Vec::new();
        };
        let hp = &self.spec.hp;
        // `auto` on a GPU only: its costs were measured there
        if r.mode == RoutedUploads::Off
            || (r.mode == RoutedUploads::Auto && self.device.is_cpu())
            || n < 2
            || n > self.lim.ffn_rows
            || self.spec.shard.is_some()
            || !hp.is_moe()
        {
            return Vec::new();
        }
        // the counts read at load and those of this load's steps
        let counts = match (&r.prior, &self.routing) {
            (Some(p), Some(o)) => {
                let mut c = p.clone();
                c.merge(o).ok().map(|()| c)
            }
            (Some(p), None) => Some(p.clone()),
            (None, o) => o.clone(),
        };
        let mut out = Vec::new();
        for (l, kind, shape) in order {
            let gi = GroupId::new(*l, *kind);
            if *kind != GroupKind::Ffn || on_cpu[gi.index()] || shape.dev_experts > 0 {
                continue;
            }
            // a host copy outside any DRAM window: its experts are read
            // again after the router
            if !matches!(
                self.store.groups[gi.index()],
                Location::Streamed { host: Some(_), .. }
            ) {
                continue;
            }
            let g = &self.spec.groups[gi.index()];
            let expert_bytes: u64 = g
                .weights
                .iter()
                .filter(|w| is_experts(w, hp.n_expert))
                .map(|w| w.size / u64::from(hp.n_expert))
                .sum();
            if expert_bytes == 0 {
                continue;
            }
            let chances = pick_chances(
                counts.as_ref(),
                *l as usize,
                hp.n_expert as usize,
                hp.n_expert_used as usize,
                shape.n_tokens,
            );
            let seen = r.seen.get(*l as usize, shape.n_tokens);
            if let Some(c) = choose(
                r.mode,
                shape.n_tokens,
                &chances,
                seen,
                expert_bytes,
                g.bytes(),
                self.probes.copy_bw,
            ) {
                out.push((gi.index(), c));
            }
        }
        out
    }

    /// A step's routed groups (see [`Engine::routed_choices`]), chosen
    /// before its groups are placed. `auto` routes only steps without
    /// host groups: there the bus carries uploads while the CPU computes,
    /// and an upload after a router would wait in the layer chain
    /// instead. So where the plan has the host CPU compute `on_cpu`,
    /// `auto` predicts the step with no host group and its mixture groups
    /// routed (`CpuCalibration::predict_routed`) against the hybrid
    /// step's `predict` (the CPU at the speed the steps showed), and
    /// clears `on_cpu` where the routed one is faster.
    pub(super) fn choose_routed_step(
        &self,
        n: u32,
        order: &[(u32, GroupKind, StepShape)],
        on_cpu: &mut [bool],
    ) -> RoutedStep {
        let Some(r) = self.routed.as_ref() else {
            return RoutedStep::default();
        };
        let cal = self.cpu_cal.as_ref();
        // the routed step's prediction, for the choice and `strata bench`
        let predict = |choices: &[(usize, RoutedGroup)], cal: &CpuCalibration| {
            let mut expected = vec![None; on_cpu.len()];
            for (i, c) in choices {
                expected[*i] = Some(c.expected_bytes.round() as u64);
            }
            cal.predict_routed(n, &expected).step_s()
        };
        // a split step (whole CPU groups beside split layers) is the plan's
        // choice over routing, as it is over whole CPU groups
        let split = order.iter().any(|(_, _, s)| s.dev_experts > 0);
        if r.mode == RoutedUploads::Auto && on_cpu.iter().any(|&c| c) && !split {
            let (Some(cal), Some(plan)) = (cal, self.plan.placement.hybrid.as_ref()) else {
                return RoutedStep::default();
            };
            // the host measured again now and then, where its band's
            // estimate has kept the steps off it (`RECHECK_STEPS`)
            if cal.recheck_due(n) {
                return RoutedStep::default();
            }
            let choices = self.routed_choices(n, order, &vec![false; on_cpu.len()]);
            if choices.is_empty() {
                return RoutedStep::default();
            }
            let (routed, hybrid) = (predict(&choices, cal), cal.predict(plan, n));
            if routed >= hybrid {
                return RoutedStep::default();
            }
            on_cpu.fill(false);
            // only a factor over the probe's can be wrong in this
            // direction: the host's steps slower than probed made the
            // hybrid step lose, and only a hybrid step can say whether
            // they still are
            let by_factor = cal.factor(n) > 1.0 && routed >= cal.predict_at(plan, n, 1.0, None);
            return RoutedStep {
                choices,
                predicted_s: Some(routed),
                hybrid_s: Some(hybrid),
                hybrid_factor: cal.factor(n),
                by_factor,
            };
        }
        let choices = self.routed_choices(n, order, on_cpu);
        let predicted_s = cal
            .filter(|_| !choices.is_empty())
            .map(|cal| predict(&choices, cal));
        RoutedStep {
            choices,
            predicted_s,
            hybrid_s: None,
            hybrid_factor: 0.0,
            by_factor: false,
        }
    }

    /// Routes `step`'s groups: marks their shapes in `order`, adds their
    /// first uploads to the pager's partial ones, and starts the step's
    /// statistics.
    pub(super) fn plan_routed_uploads(
        &mut self,
        order: &mut [(u32, GroupKind, StepShape)],
        step: RoutedStep,
    ) {
        let Some(r) = self.routed.as_mut() else {
            return;
        };
        r.step.clear();
        r.stats = RoutedStats::default();
        if let Some(h) = step.hybrid_s {
            r.stats.over_hybrid = 1;
            r.stats.hybrid_s = h;
            r.stats.hybrid_factor = step.hybrid_factor;
        }
        if let Some(p) = step.predicted_s {
            r.stats.predicted = 1;
            r.stats.predicted_s = p;
        }
        for (i, c) in step.choices {
            let Some((_, _, shape)) = order
                .iter_mut()
                .find(|(l, k, _)| GroupId::new(*l, *k).index() == i)
            else {
                continue;
            };
            let g = &self.spec.groups[i];
            let offsets = &self.store.layouts[i].offsets;
            let up = expert_ranges(&g.weights, offsets, self.spec.hp.n_expert, &c.sure, true);
            r.stats.ahead_bytes += up.iter().map(|u| u.1 as u64).sum::<u64>();
            self.pager.partial.insert(i, Partial { up, zero: vec![] });
            shape.routed = true;
            r.stats.groups += 1;
            r.stats.whole_bytes += g.bytes();
            r.stats.expected_bytes += c.expected_bytes;
            r.stats.ahead += c.sure.len() as u64;
            r.step.insert(i, c.sure);
        }
    }

    /// Runs routed FFN group `layer` (see the module notes). The
    /// residual is on the device.
    pub(super) fn run_routed_ffn(
        &mut self,
        layer: u32,
        shape: StepShape,
    ) -> Result<(), EngineError> {
        let gi = GroupId::new(layer, GroupKind::Ffn);
        let n = shape.n_tokens;
        // the window's last upload waits for this group's picked experts
        // (step 3), so that the bus has it to carry while the device
        // computes this layer and the next one's router
        let (ring, b, id) = self.bind_streamed(gi, 1, "a routed upload of a resident group")?;
        let slot = id.weight_slot.expect("a streamed group's slot");

        // 2. the router, and its picks on the host
        let t = self.run_router(gi, n, id, &b)?;
        let ids: Vec<i32> = t.read_node(ROUTED)?;
        self.count_routed(layer, &ids)?;
        let n_expert = self.spec.hp.n_expert;
        let mut picked = vec![false; n_expert as usize];
        for &e in &ids {
            let e = usize::try_from(e)
                .ok()
                .filter(|&e| e < picked.len())
                .ok_or(EngineError::Unsupported("a router pick out of range"))?;
            picked[e] = true;
        }

        // 3. the picked experts not sent ahead
        let r = self
            .routed
            .as_mut()
            .expect("a routed step has routed state");
        let sure = r.step.get(&gi.index()).map_or(&[][..], |s| s.as_slice());
        let after: Vec<u32> = (0..n_expert)
            .filter(|&e| picked[e as usize] && sure.binary_search(&e).is_err())
            .collect();
        let n_picked = picked.iter().filter(|&&p| p).count();
        r.seen
            .observe(layer as usize, n, n_picked, n_expert as usize);
        r.stats.after += after.len() as u64;
        r.stats.picked += n_picked as u64;
        let g = &self.spec.groups[gi.index()];
        let ranges = expert_ranges(
            &g.weights,
            &self.store.layouts[gi.index()].offsets,
            n_expert,
            &after,
            false,
        );
        let r = self.routed.as_mut().expect("checked above");
        r.stats.after_bytes += ranges.iter().map(|u| u.1 as u64).sum::<u64>();
        self.pager
            .top_up(gi, ring, slot, &ranges, &self.store, &self.backend)?;
        self.pager
            .issue_window(gi, ring, &self.store, &self.backend, self.kv.tier_mut())?;

        // 4. the experts, over the picks
        let (_, key) = self.group_key(layer, GroupKind::Ffn, shape);
        self.templates.get(&key)?.bind(id, &b, None)?;
        let t = self.templates.allocated(&key, &self.backend)?;
        let rec = self.rec.scope(
            timeline::Stream::Compute,
            &self.backend,
            || format!("ffn {layer} ({n_picked} experts picked)"),
            0,
        );
        self.backend.compute_async(&t.graph())?;
        drop(rec);
        self.pager
            .after_compute(gi, ring, &self.store, &self.backend, self.kv.tier_mut())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_hold_the_named_experts_of_each_expert_tensor() {
        let (ws, offsets) = super::super::split::tests::group();
        // experts 1 and 3: 192 bytes each, per tensor
        assert_eq!(
            expert_ranges(&ws, &offsets, 4, &[1, 3], false),
            vec![(704, 192), (1088, 192), (1728, 192), (2112, 192)]
        );
        // adjacent experts merge, and the other weights come whole
        assert_eq!(
            expert_ranges(&ws, &offsets, 4, &[0, 1], true),
            vec![(0, 32), (256, 128), (512, 384), (1536, 384)]
        );
        // every expert: each tensor whole
        assert_eq!(
            expert_ranges(&ws, &offsets, 4, &[0, 1, 2, 3], false),
            vec![(512, 768), (1536, 768)]
        );
        // nothing picked, no others: nothing
        assert!(expert_ranges(&ws, &offsets, 4, &[], false).is_empty());
        // another expert count: not expert tensors of this model's
        assert_eq!(
            expert_ranges(&ws, &offsets, 8, &[0], true),
            vec![(0, 32), (256, 128), (512, 768), (1536, 768)]
        );
    }
}
