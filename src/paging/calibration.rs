//! The host CPU's speed in real steps against the probe's reading the
//! hybrid plan (`paging::hybrid`) was made from, which can be 10-30% off:
//! a probe runs 2 GiB of matrices, a step many GiB beside the bus's reads
//! of host memory. Plain Rust.
//!
//! [`CpuCalibration::observe`] keeps a running estimate of the factor on
//! the probe's time per byte for each band of step sizes;
//! [`CpuCalibration::predict`] simulates a step at that speed, which
//! separates the probe's error from the model's, and the engine weighs
//! routed steps without host groups against it
//! ([`CpuCalibration::predict_routed`]). A size is planned again at its
//! band's speed only after [`REPLAN_SAMPLES`] counted steps and a
//! [`REPLAN_MOVE`] move ([`CpuCalibration::replan`]): re-planning as each
//! step came in flip-flopped between splits on the H100 machine (the
//! per-byte speed moves with the split and from step to step), and every
//! change re-warms the changed groups' graphs (docs/device/hybrid/run11:
//! 3.11 t/s against 4.06).
//!
//! One estimate for all sizes let a busy host's one-token steps (many small
//! groups, each waiting on the host's threads) speak for 64-token ones
//! (long reads of memory): on a shared H200 host one-token steps put the
//! factor at 1.57-2.25 where 64-token ones beside them ran at 1.18-1.19
//! of their prediction, and the engine took routed steps without host
//! groups for 64 tokens at 300-309 t/s where the hybrid ones ran 331-446
//! (docs/device-runs.md, runs 204 and 207). So each band (sizes up to a
//! power of two, [`band`]) keeps its own estimate, the probe's reading
//! until a step of the band was counted.

use super::groups::{GroupInfo, Where};
use super::hybrid::{
    simulate, size_plan, tiers, CpuInput, HybridPlan, Prediction, SizePlan, MAX_TOKENS,
};

/// The host CPU's speed in the steps so far, by band of step sizes (see
/// the module notes).
#[derive(Clone, Debug)]
pub struct CpuCalibration {
    /// The probe's reading.
    pub probe: CpuInput,
    groups: Vec<GroupInfo>,
    streamed: Vec<bool>,
    slots: (usize, usize),
    copy_bw: f64,
    /// By band of step sizes ([`band`]), the running estimate, from
    /// steps, of the factor on the probe's seconds per byte.
    bands: Vec<Band>,
    /// The step sizes a step has been observed at: the first step of each
    /// size builds its graphs and warms its groups' memory, so it is not
    /// counted.
    warmed: Vec<u32>,
    /// By step size: the band's factor when the size was last planned
    /// again ([`CpuCalibration::replan`]; 1, the probe's, before).
    planned_at: Vec<(u32, f64)>,
}

/// What the steps of one band of sizes showed.
#[derive(Clone, Copy, Debug)]
struct Band {
    /// The band's largest size ([`band`]).
    top: u32,
    /// The running estimate of the factor on the probe's seconds per byte.
    factor: f64,
    /// Steps counted.
    samples: u32,
    /// Steps of the band run without host groups since one with them
    /// ([`CpuCalibration::skipped`]).
    skipped: u32,
}

/// The band of step sizes a step of `n` tokens is calibrated in: sizes up
/// to the next power of two (1, 2, 3-4, 5-8, ... 33-64), whose host groups
/// read memory alike.
pub fn band(n: u32) -> u32 {
    n.max(1).next_power_of_two()
}

/// Where the steps of a band ran without host groups only because the
/// band's estimate (over 1: the host slower than probed) made the hybrid
/// step slower ([`CpuCalibration::skipped`]), every this many such steps
/// one runs hybrid again, so that an estimate taken while the host was
/// busy is measured again: without it nothing corrects it (the choice
/// keeps the band's steps off the CPU). It costs at most one step in this
/// many the difference between the two; 8 lets a 64-sequence bench
/// repetition (8 steps) measure again what the one before it set.
pub const RECHECK_STEPS: u32 = 8;

/// A size's steps are planned again at the speed their band showed
/// ([`CpuCalibration::replan`]) once the band counted this many steps and
/// its estimate moved [`REPLAN_MOVE`] from the speed the size was last
/// planned at: the probe reads the host for a fraction of a second, and
/// one load's reading was 0.72x the others' (30.5 GB/s of picked experts
/// at 64 tokens against 42.2) while its steps then ran the host at 0.81x
/// the probe's time per byte. Planned on that reading, its 64-token steps
/// took 9 host groups where the others took 13, and ran 407 t/s against
/// 430-465 (docs/device-runs.md, run 236). After 4 steps a load's
/// estimate still carried its first slow steps (1.42x, then 1.31x and
/// 1.17x within a second), and the 64-token steps went from 13 host
/// groups to 8, 9 and back to 13 (run 237): 8 steps, where the first
/// counted weighs 6% of the estimate.
pub const REPLAN_SAMPLES: u32 = 8;

/// How far a band's estimate moves from the speed a size was last planned
/// at before it is planned again (planning a size takes about a
/// millisecond: not every step; and the host's speed wanders 5-10% from
/// step to step).
pub const REPLAN_MOVE: f64 = 0.10;

/// The gain, at the speed a band's steps showed, that a new split must
/// promise over the one it replaces (so noise does not flip it back).
pub const REPLAN_GAIN: f64 = 0.02;

impl CpuCalibration {
    pub fn new(
        probe: CpuInput,
        groups: Vec<GroupInfo>,
        streamed: Vec<bool>,
        slots: (usize, usize),
        copy_bw: f64,
    ) -> CpuCalibration {
        CpuCalibration {
            probe,
            groups,
            streamed,
            slots,
            copy_bw,
            bands: Vec::new(),
            warmed: Vec::new(),
            planned_at: Vec::new(),
        }
    }

    /// The share of each group's picks its hot experts take now (per
    /// group index, as `HotPlan::hit`), after the sets were re-chosen
    /// (`experts::refresh_hot`): the CPU's part of those groups shrinks or
    /// grows with it.
    pub fn set_hot(&mut self, hit: &[f64]) {
        super::groups::set_hot_shares(&mut self.groups, hit);
    }

    /// A step of `n` tokens in which the CPU computed its part of `plan`
    /// (whole groups, split groups' host experts) in `secs`.
    pub fn observe(&mut self, n: u32, plan: &HybridPlan, secs: f64) {
        let at_probe = self.probe_cpu_s(n, plan);
        let f = secs / at_probe;
        if at_probe <= 0.0 || !(f.is_finite() && f > 0.0) {
            return;
        }
        // the first step of a size builds its graphs and warms caches:
        // not counted (counted, the first 64-token step after 16-token ones
        // set the estimate alone, and a routed step chosen over the hybrid
        // one it mispredicted kept it there: docs/device-runs.md run 173)
        if !self.warmed.contains(&n) {
            self.warmed.push(n);
            return;
        }
        let b = self.band_mut(n);
        b.samples += 1;
        b.skipped = 0;
        b.factor = match b.samples {
            1 => f,
            _ => 0.7 * b.factor + 0.3 * f,
        };
    }

    /// The factor on the probe's CPU time per byte that steps of `n`
    /// tokens' band showed; 1 (the probe's reading) before one was
    /// counted.
    pub fn factor(&self, n: u32) -> f64 {
        self.band_of(n)
            .filter(|b| b.samples > 0)
            .map_or(1.0, |b| b.factor)
    }

    /// A step of `n` tokens ran without its host groups only because the
    /// band's estimate made the hybrid step slower (routed uploads on
    /// `auto`; at the probe's speed it would have run hybrid).
    pub fn skipped(&mut self, n: u32) {
        self.band_mut(n).skipped += 1;
    }

    /// Whether the next step of `n` tokens should run hybrid whatever the
    /// estimate says, to measure the host again ([`RECHECK_STEPS`]).
    pub fn recheck_due(&self, n: u32) -> bool {
        self.band_of(n).is_some_and(|b| b.skipped >= RECHECK_STEPS)
    }

    fn band_of(&self, n: u32) -> Option<&Band> {
        self.bands.iter().find(|b| b.top == band(n))
    }

    fn band_mut(&mut self, n: u32) -> &mut Band {
        let top = band(n);
        if !self.bands.iter().any(|b| b.top == top) {
            self.bands.push(Band {
                top,
                factor: 1.0,
                samples: 0,
                skipped: 0,
            });
        }
        self.bands
            .iter_mut()
            .find(|b| b.top == top)
            .expect("pushed")
    }

    /// The CPU seconds the probe gives its part of `plan`'s step of `n`
    /// tokens (whole groups, split groups' host experts).
    fn probe_cpu_s(&self, n: u32, plan: &HybridPlan) -> f64 {
        let at = plan.placement(n, &self.streamed);
        self.groups
            .iter()
            .zip(&at)
            .map(|(g, w)| match *w {
                Where::Cpu => self.probe.group_s(g, n),
                Where::Split(k) => self.probe.split_s(g, n, k),
                _ => 0.0,
            })
            .sum()
    }

    /// The split of steps of `n` tokens planned again at the speed their
    /// band's steps showed, where it differs from `plan`'s and is predicted
    /// [`REPLAN_GAIN`] faster at that speed; weighed once the band counted
    /// [`REPLAN_SAMPLES`] steps and its speed moved [`REPLAN_MOVE`] from
    /// the one the size was last planned at. Its `predicted` is
    /// the probe's for the new split, so the plan's predictions stay the
    /// probe's. None for a forced count, and at sizes that split experts
    /// (planned beside the whole groups' sizes).
    pub fn replan(&mut self, plan: &HybridPlan, n: u32) -> Option<SizePlan> {
        if n == 0 || n > MAX_TOKENS || self.probe.force.is_some() {
            return None;
        }
        if plan.split.as_ref().is_some_and(|s| s.size(n).is_some()) {
            return None;
        }
        let b = *self.band_of(n)?;
        let last = self
            .planned_at
            .iter()
            .find(|p| p.0 == n)
            .map_or(1.0, |p| p.1);
        if b.samples < REPLAN_SAMPLES || (b.factor / last - 1.0).abs() < REPLAN_MOVE {
            return None;
        }
        self.planned_at.retain(|p| p.0 != n);
        self.planned_at.push((n, b.factor));
        let hosts: Vec<usize> = (0..self.groups.len()).filter(|&i| plan.host[i]).collect();
        let tier = tiers(&self.groups, &hosts, self.probe.tiers);
        let at_speed = self.probe.scaled(b.factor);
        let (streamed, slots, bw) = (&self.streamed, self.slots, self.copy_bw);
        let new = size_plan(
            &self.groups,
            streamed,
            slots,
            bw,
            &at_speed,
            n,
            &hosts,
            &tier,
        );
        let cur = plan.per_size.get(n as usize - 1)?;
        let same = |a: &SizePlan| (a.cpu_groups, a.tier, a.fill, a.carry);
        if same(&new) == same(cur)
            || new.predicted.step_s() > self.predict(plan, n) * (1.0 - REPLAN_GAIN)
        {
            return None;
        }
        let mut p = plan.clone();
        p.per_size[n as usize - 1] = new;
        let c = CpuInput {
            carry: self.probe.carry && new.carry,
            ..self.probe.clone()
        };
        let predicted = simulate(&self.groups, &p.placement(n, streamed), slots, bw, &c, n);
        Some(SizePlan { predicted, ..new })
    }

    /// The predicted step of `n` tokens with `plan`'s split, the CPU at the
    /// speed the steps of its band showed.
    pub fn predict(&self, plan: &HybridPlan, n: u32) -> f64 {
        self.predict_at(plan, n, self.factor(n), None)
    }

    /// The same at given rates: the CPU at `cpu_factor` times the probe's
    /// time per byte, the bus at `bus_bw` bytes/s while the CPU computes
    /// (None: the probe's). With the rates a run showed, what is left
    /// between its steps and this is the model's error, not the probes'.
    pub fn predict_at(
        &self,
        plan: &HybridPlan,
        n: u32,
        cpu_factor: f64,
        bus_bw: Option<f64>,
    ) -> f64 {
        let at = plan.placement(n, &self.streamed);
        let c = CpuInput {
            bus_bw_beside: bus_bw.or(self.probe.bus_bw_beside),
            carry: self.probe.carry && plan.carry_at(n),
            ..self.probe.scaled(cpu_factor)
        };
        simulate(&self.groups, &at, self.slots, self.copy_bw, &c, n).step_s()
    }
}

impl CpuCalibration {
    /// The step of `n` tokens without host groups: every streamed group on
    /// the bus, those with `routed[i]` (by group index: the bytes it is
    /// expected to carry) routed (`paging::routed`). Weighed against
    /// [`CpuCalibration::predict`], it says whether a step runs better
    /// routed on the device alone than as the hybrid plan's.
    pub fn predict_routed(&self, n: u32, routed: &[Option<u64>]) -> Prediction {
        let at: Vec<Where> = self
            .streamed
            .iter()
            .enumerate()
            .map(|(i, &s)| match (s, routed.get(i).copied().flatten()) {
                (true, Some(b)) => Where::Routed(b),
                (true, None) => Where::Bus,
                (false, _) => Where::Resident,
            })
            .collect();
        simulate(&self.groups, &at, self.slots, self.copy_bw, &self.probe, n)
    }
}

#[cfg(test)]
mod tests {
    use super::super::hybrid::{placement, plan_hybrid};
    use super::super::testutil::{cpu, h100_cpu, layers, qwen3moe_30b, GPU_GROUP_S};
    use super::*;
    use crate::model::GroupKind;
    use proptest::prelude::*;

    #[test]
    fn calibration_tracks_the_cpu_speed_of_steps() {
        let g = layers(60, 85, 396);
        let streamed = vec![true; g.len()];
        let c = cpu(1.0);
        let p = plan_hybrid(&g, &streamed, (8, 3), 1.0, &c).expect("hybrid pays");
        let before = p.per_size[0];
        let mut cal = CpuCalibration::new(c.clone(), g.clone(), streamed.clone(), (8, 3), 1.0);
        // steps at the probe's speed: the plan's own prediction
        // (cpu(1.0): a second per byte)
        let bytes = before.cpu_bytes;
        for _ in 0..6 {
            cal.observe(1, &p, bytes as f64);
        }
        assert!((cal.factor(1) - 1.0).abs() < 1e-9);
        assert!((cal.predict(&p, 1) - before.predicted.step_s()).abs() < 1e-9);
        // steps 30% slower: the estimate follows, the first (warm-up) step
        // of a fresh calibration is not counted
        let mut cal = CpuCalibration::new(c, g, streamed, (8, 3), 1.0);
        cal.observe(1, &p, 5.0 * bytes as f64);
        for _ in 0..8 {
            cal.observe(1, &p, 1.3 * bytes as f64);
        }
        assert!((cal.factor(1) - 1.3).abs() < 1e-6, "{}", cal.factor(1));
        // at that speed the same split takes longer
        assert!(cal.predict(&p, 1) > before.predicted.step_s() * 1.1);
        // a step where the CPU computed nothing says nothing
        cal.observe(MAX_TOKENS + 1, &p, 0.0);
        assert!((cal.factor(1) - 1.3).abs() < 1e-6);
        // another band keeps the probe's reading until its own steps are
        // counted, the first of each size a warm-up: a slow one moves
        // nothing, the next of that size counts
        let at2 = cal.probe_cpu_s(2, &p);
        assert!(at2 > 0.0);
        assert!((cal.factor(2) - 1.0).abs() < 1e-9);
        assert!((cal.predict(&p, 2) - cal.predict_at(&p, 2, 1.0, None)).abs() < 1e-12);
        cal.observe(2, &p, 3.0 * at2);
        assert!((cal.factor(2) - 1.0).abs() < 1e-9, "{}", cal.factor(2));
        cal.observe(2, &p, 1.1 * at2);
        assert!((cal.factor(2) - 1.1).abs() < 1e-6, "{}", cal.factor(2));
        cal.observe(2, &p, 1.5 * at2);
        assert!((cal.factor(2) - (0.7 * 1.1 + 0.3 * 1.5)).abs() < 1e-6);
        assert!((cal.factor(1) - 1.3).abs() < 1e-6, "{}", cal.factor(1));
    }

    #[test]
    fn each_band_of_step_sizes_keeps_its_own_cpu_factor() {
        assert_eq!(
            [1, 2, 3, 4, 5, 8, 9, 33, 64].map(band),
            [1, 2, 4, 4, 8, 8, 16, 64, 64]
        );
        let g = layers(60, 85, 396);
        let streamed = vec![true; g.len()];
        let c = cpu(1.0);
        let p = plan_hybrid(&g, &streamed, (8, 3), 1.0, &c).expect("hybrid pays");
        let mut cal = CpuCalibration::new(c, g, streamed, (8, 3), 1.0);
        let at = |cal: &CpuCalibration, n| cal.probe_cpu_s(n, &p);
        let (at1, at3) = (at(&cal, 1), at(&cal, 3));
        assert!(at1 > 0.0 && at3 > 0.0);
        // a busy host's one-token steps (run 204: 1.87x) say nothing of
        // steps of 3 or 4 tokens
        for _ in 0..10 {
            cal.observe(1, &p, 1.87 * at1);
        }
        assert!((cal.factor(1) - 1.87).abs() < 1e-6);
        assert!((cal.factor(4) - 1.0).abs() < 1e-9);
        // 3 and 4 share a band: counted steps of 3 tokens (each size's
        // first is its warm-up) set 4's
        cal.observe(3, &p, 9.0 * at3);
        cal.observe(3, &p, 1.19 * at3);
        assert!((cal.factor(4) - 1.19).abs() < 1e-6, "{}", cal.factor(4));
        assert!((cal.factor(3) - 1.19).abs() < 1e-6);
        let at4 = at(&cal, 4);
        cal.observe(4, &p, 2.0 * at4);
        assert!((cal.factor(3) - 1.19).abs() < 1e-6, "4's warm-up counted");
        cal.observe(4, &p, 1.19 * at4);
        assert!((cal.factor(3) - 1.19).abs() < 1e-6);
        assert!((cal.factor(1) - 1.87).abs() < 1e-6);
        // and the prediction of a size takes its band's factor
        assert!((cal.predict(&p, 4) - cal.predict_at(&p, 4, 1.19, None)).abs() < 1e-12);
        assert!((cal.predict(&p, 1) - cal.predict_at(&p, 1, 1.87, None)).abs() < 1e-12);
    }

    #[test]
    fn a_band_kept_off_the_host_is_measured_again() {
        let g = layers(60, 85, 396);
        let streamed = vec![true; g.len()];
        let c = cpu(1.0);
        let p = plan_hybrid(&g, &streamed, (8, 3), 1.0, &c).expect("hybrid pays");
        let mut cal = CpuCalibration::new(c, g, streamed, (8, 3), 1.0);
        let at = cal.probe_cpu_s(8, &p);
        cal.observe(8, &p, at);
        cal.observe(8, &p, 2.2 * at);
        for _ in 1..RECHECK_STEPS {
            cal.skipped(8);
            assert!(!cal.recheck_due(8));
        }
        // skipped in a band of its own: 8's count stays
        cal.skipped(16);
        assert!(!cal.recheck_due(8));
        cal.skipped(7);
        assert!(cal.recheck_due(8) && cal.recheck_due(5));
        assert!(!cal.recheck_due(16) && !cal.recheck_due(4));
        // the hybrid step that follows counts and starts the count again
        cal.observe(8, &p, 1.0 * at);
        assert!(!cal.recheck_due(8));
        assert!((cal.factor(8) - (0.7 * 2.2 + 0.3)).abs() < 1e-6);
    }

    /// Hot sets re-chosen to catch more of the picks: the calibration's
    /// prediction of the same split falls with the CPU's share, and comes
    /// back when the share does.
    #[test]
    fn calibration_follows_refreshed_hot_shares() {
        let g = qwen3moe_30b(8, 0.2);
        let streamed = vec![true; g.len()];
        let c = h100_cpu();
        let p = plan_hybrid(&g, &streamed, (4, 3), 55e9, &c).expect("hybrid pays");
        let mut cal = CpuCalibration::new(c, g.clone(), streamed, (4, 3), 55e9);
        let before = cal.predict(&p, 1);
        let hit: Vec<f64> = g
            .iter()
            .map(|x| if x.experts.is_some() { 0.9 } else { 0.0 })
            .collect();
        cal.set_hot(&hit);
        let after = cal.predict(&p, 1);
        assert!(after < 0.8 * before, "{after} against {before}");
        let back: Vec<f64> = hit
            .iter()
            .map(|&x| if x > 0.0 { 0.2 } else { 0.0 })
            .collect();
        cal.set_hot(&back);
        assert!((cal.predict(&p, 1) - before).abs() < 1e-12);
    }

    /// The calibration at the probe's speed predicts each step size as the
    /// plan did (the engine weighs routed steps against this figure).
    #[test]
    fn calibration_at_the_probe_is_the_plan() {
        let g = qwen3moe_30b(48, 0.0);
        let streamed: Vec<bool> = (0..g.len()).map(|i| i >= 40).collect();
        for carry in [false, true] {
            let c = CpuInput {
                big: Some((64, 4.0 / 24e9)),
                bus_bw_beside: Some(54e9),
                gpu_group_s: GPU_GROUP_S,
                carry,
                ..h100_cpu()
            };
            let p = plan_hybrid(&g, &streamed, (7, 3), 55e9, &c).expect("hybrid pays");
            let cal = CpuCalibration::new(c, g.clone(), streamed.clone(), (7, 3), 55e9);
            for n in 1..=MAX_TOKENS {
                let plan = p.per_size[n as usize - 1].predicted.step_s();
                let cal = cal.predict(&p, n);
                assert!(
                    (plan - cal).abs() <= 1e-9 * plan,
                    "{n} tokens, carry {carry}: plan {plan}, calibration {cal}"
                );
            }
        }
    }

    /// A probe that read the host slower than its steps then ran (run 236:
    /// 0.72x the other loads' reading, the steps at 0.81x its time per
    /// byte): after REPLAN_SAMPLES counted steps the size is planned again
    /// at their speed, as a plan at that speed would have it, and its
    /// prediction stays the probe's.
    #[test]
    fn steps_are_planned_again_at_the_speed_they_showed() {
        let g = qwen3moe_30b(48, 0.0);
        let streamed: Vec<bool> = (0..g.len()).map(|i| i >= 40).collect();
        let fast = CpuInput {
            big: Some((64, 4.0 / 24e9)),
            bus_bw_beside: Some(54e9),
            gpu_group_s: GPU_GROUP_S,
            carry: true,
            ..h100_cpu()
        };
        let slow = fast.scaled(1.4);
        let slots = (7, 3);
        let p = plan_hybrid(&g, &streamed, slots, 55e9, &slow).expect("hybrid pays");
        let truth = plan_hybrid(&g, &streamed, slots, 55e9, &fast).expect("hybrid pays");
        let n = 64;
        let (was, want) = (p.per_size[63], truth.per_size[63]);
        assert!(want.cpu_groups > was.cpu_groups, "{want:?} against {was:?}");
        let mut cal = CpuCalibration::new(slow.clone(), g.clone(), streamed.clone(), slots, 55e9);
        let at = cal.probe_cpu_s(n, &p);
        // the warm-up step, then counted ones at the host's real speed
        cal.observe(n, &p, 3.0 * at);
        for i in 1..=REPLAN_SAMPLES {
            assert!(cal.replan(&p, n).is_none(), "after {} counted steps", i - 1);
            cal.observe(n, &p, at / 1.4);
        }
        let s = cal.replan(&p, n).expect("planned again");
        assert_eq!(
            (s.cpu_groups, s.tier, s.fill),
            (want.cpu_groups, want.tier, want.fill)
        );
        let mut q = p.clone();
        q.per_size[63] = s;
        let probe = cal.predict_at(&q, n, 1.0, None);
        assert!((s.predicted.step_s() - probe).abs() <= 1e-9 * probe);
        // faster at the steps' speed than the split it replaces
        assert!(cal.predict(&q, n) < cal.predict(&p, n) * (1.0 - REPLAN_GAIN));
        // other sizes keep theirs; the new split stays at the next check
        assert!(cal.replan(&p, 32).is_none());
        for _ in 0..REPLAN_SAMPLES {
            cal.observe(n, &q, cal.probe_cpu_s(n, &q) / 1.4);
        }
        assert!(cal.replan(&q, n).is_none());
        // steps at the probe's speed change nothing
        let mut cal = CpuCalibration::new(slow.clone(), g.clone(), streamed.clone(), slots, 55e9);
        for _ in 0..=2 * REPLAN_SAMPLES {
            cal.observe(n, &p, at);
            assert!(cal.replan(&p, n).is_none());
        }
        // nor a forced count
        let forced = CpuInput {
            force: Some(was.cpu_groups),
            ..slow
        };
        let mut cal = CpuCalibration::new(forced, g, streamed, slots, 55e9);
        for _ in 0..=REPLAN_SAMPLES {
            cal.observe(n, &p, at / 1.4);
        }
        assert!(cal.replan(&p, n).is_none());
    }

    #[test]
    fn a_routed_step_costs_its_bytes_and_a_round_trip_a_group() {
        use super::super::groups::Experts;
        use super::super::routed::layer_cost_s;
        // Qwen3-30B-A3B-like: 48 layers, 8 MB of attention, 128 experts
        // of 2.9 MB and 1 MB of router; all streamed over 55 GB/s
        let ffn = GroupInfo {
            kind: GroupKind::Ffn,
            bytes: 1_000_000 + 128 * 2_900_000,
            experts: Some(Experts {
                bytes: 128 * 2_900_000,
                n_expert: 128,
                n_used: 8,
                hot: 0.0,
                popularity: None,
                cpu_scale: [1.0; 2],
            }),
        };
        let g: Vec<GroupInfo> = (0..48)
            .flat_map(|_| [GroupInfo::dense(GroupKind::Attn, 8_000_000), ffn])
            .collect();
        let streamed = vec![true; g.len()];
        let cal = CpuCalibration::new(cpu(1e-9), g.clone(), streamed, (8, 3), 55e9);
        // nothing routed: the bus step
        let none = vec![None; g.len()];
        let bus = simulate(&g, &[Where::Bus; 96], (8, 3), 55e9, &cpu(1e-9), 16);
        assert_eq!(cal.predict_routed(16, &none), bus);
        // every FFN group carrying half its bytes: a bus-bound step of the
        // bytes sent plus each group's round trip
        let half = ffn.bytes / 2;
        let routed: Vec<Option<u64>> = g
            .iter()
            .map(|x| (x.kind == GroupKind::Ffn).then_some(half))
            .collect();
        let p = cal.predict_routed(16, &routed);
        let sent = 48.0 * (8e6 + half as f64);
        let expect = sent / 55e9 + 48.0 * layer_cost_s(16);
        assert!(
            (p.step_s() / expect - 1.0).abs() < 0.03,
            "{p:?} against {expect}"
        );
        assert!(p.step_s() < bus.step_s());
        // sending everything anyway, routing only adds the round trips
        let whole: Vec<Option<u64>> = g
            .iter()
            .map(|x| (x.kind == GroupKind::Ffn).then_some(x.bytes))
            .collect();
        let p = cal.predict_routed(16, &whole);
        let extra = p.step_s() - bus.step_s();
        assert!(
            (extra / (48.0 * layer_cost_s(16)) - 1.0).abs() < 0.05,
            "{extra}"
        );
    }

    proptest! {
        /// A routed step: nothing routed is the bus step; it never beats
        /// its own bytes on the bus plus its round trips; and a group
        /// carrying more bytes never makes it faster.
        #[test]
        fn routed_steps_are_consistent(
            n in 1usize..30, attn in 1u64..100, ffn in 1u64..400,
            first_streamed in 0usize..60, bw in 1.0f64..10.0, tokens in 2u32..128,
            shares in proptest::collection::vec(0.0f64..=1.0, 60),
            grow in 0usize..60,
        ) {
            let g = layers(n, attn, ffn);
            let streamed: Vec<bool> = (0..g.len()).map(|i| i >= first_streamed.min(g.len())).collect();
            let c = CpuInput { gpu_s_per_byte: 1e-3, ..cpu(1.0) };
            let cal = CpuCalibration::new(c.clone(), g.clone(), streamed.clone(), (4, 3), bw);
            let none = vec![None; g.len()];
            let bus = simulate(&g, &placement(&streamed, &vec![false; g.len()]), (4, 3), bw, &c, tokens);
            prop_assert_eq!(cal.predict_routed(tokens, &none), bus);
            let routed: Vec<Option<u64>> = g.iter().enumerate()
                .map(|(i, x)| (x.kind == GroupKind::Ffn).then(|| (x.bytes as f64 * shares[i % shares.len()]) as u64))
                .collect();
            let p = cal.predict_routed(tokens, &routed);
            let k = routed.iter().zip(&streamed).filter(|(r, s)| r.is_some() && **s).count();
            let sent: f64 = g.iter().zip(&streamed).zip(&routed)
                .filter(|((_, s), _)| **s)
                .map(|((x, _), r)| r.unwrap_or(x.bytes) as f64)
                .sum();
            let floor = sent / bw + k as f64 * super::super::routed::layer_cost_s(tokens);
            prop_assert!(p.step_s() >= floor * (1.0 - 1e-9), "{p:?} below {floor}");
            let mut more = routed.clone();
            let j = grow % g.len();
            if let Some(b) = more[j].as_mut() {
                *b = g[j].bytes;
            }
            prop_assert!(cal.predict_routed(tokens, &more).step_s() >= p.step_s() - 1e-9);
        }
    }
}
