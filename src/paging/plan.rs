//! Placement: which layer groups stay on the GPU and how many slots the
//! rest stream through (uploads run up to slots - 1 groups ahead, see
//! `engine::pager`). Plain Rust.
//!
//! The floor of a step of n tokens is max(bytes streamed / copy bandwidth,
//! compute time at n tokens): with enough slots the copies hide under
//! compute or the compute hides under the copies, never less than that.
//! Compute time comes from the device's measured speed per weight byte at
//! one token and at a large step ([`ComputeRate`]), so the floor is right
//! for decode (bus-bound) and for prefill (compute-bound) alike.

use super::groups::max_bytes;
use super::groups::GroupInfo;
use crate::model::GroupKind;

/// Inputs of a placement decision.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanInput {
    pub groups: Vec<GroupInfo>,
    /// Bytes that must be on the device whatever happens: output head,
    /// KV cache, persistent tensors, activations.
    pub fixed_bytes: u64,
    /// Total device budget (None: everything that fits stays resident).
    pub budget: Option<u64>,
    /// Measured host-to-device copy bandwidth, bytes/s.
    pub copy_bw: f64,
    /// The device's measured compute speed; None: not measured (the
    /// floor is then the copies alone).
    pub compute: Option<ComputeRate>,
    /// Slots per kind when streaming (>= 2 so copy and compute overlap).
    pub slots: usize,
    /// Stream every group, whatever the budget (tests, benchmarks).
    pub stream_all: bool,
    /// Which groups stay resident when not all fit: the first layers', or
    /// as many spread evenly through the layers.
    pub resident: ResidentOrder,
    /// The host CPU as a compute tier for streamed groups (hybrid decode);
    /// None: the bus carries every streamed group.
    pub cpu: Option<super::hybrid::CpuInput>,
}

/// Which groups a plan keeps resident when not all fit (the same number of
/// each kind either way).
///
/// `Spread` (the default) spaces the resident groups of each kind evenly
/// through the layers, the first layer's among them: in a large step the
/// bus then uploads the next streamed groups while resident ones compute
/// all through the step. `First` keeps the first layers, the streamed
/// groups one run at the end: the bus fills the rings while the first
/// layers compute and then waits. Measured on the H100 (70B shape, 12G,
/// docs/device-runs.md runs 71-78, orders alternated within each call):
/// pp512 1.01x its bus floor spread (948-954 t/s, run 76) against 1.11x
/// first (863-866 t/s); hybrid decode 3.73 t/s spread and 3.74 first on
/// average over four calls, each call's difference within its repeats'
/// noise (the plan's simulation at equal rates has spread 2.4% slower).
/// The Qwen3-30B-A3B shape at 8G: pp2048 7551 to 9221 t/s spread, decode
/// 46.9 and 46.6 (runs 25-27).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ResidentOrder {
    #[default]
    Spread,
    First,
}

/// `k` of `m` positions spaced evenly, the first at 0.
fn evenly(m: usize, k: usize) -> impl Iterator<Item = usize> {
    (0..k.min(m)).map(move |i| i * m / k)
}

/// Bytes of the groups `resident` marks.
fn bytes_of(groups: &[GroupInfo], resident: &[bool]) -> u64 {
    groups
        .iter()
        .zip(resident)
        .filter(|(_, r)| **r)
        .map(|(g, _)| g.bytes)
        .sum()
}

/// The resident set `resident` (a prefix, with `room` bytes left beside it)
/// moved to the same number of each kind's groups spread evenly through
/// the layers, if that fits in the same bytes; groups of one kind differ in
/// size in some models (Q4_K_M's wider ffn_down on some layers), so what
/// is left is then filled in layer order.
fn spread_residents(groups: &[GroupInfo], resident: &[bool], room: u64) -> Vec<bool> {
    let mut out = resident.to_vec();
    for kind in [GroupKind::Attn, GroupKind::Ffn] {
        let idx: Vec<usize> = (0..groups.len())
            .filter(|&i| groups[i].kind == kind)
            .collect();
        let k = idx.iter().filter(|&&i| resident[i]).count();
        for &i in &idx {
            out[i] = false;
        }
        for p in evenly(idx.len(), k) {
            out[idx[p]] = true;
        }
    }
    let before = bytes_of(groups, resident);
    if bytes_of(groups, &out) > before {
        out = resident.to_vec();
    }
    let mut left = room + before - bytes_of(groups, &out);
    for (i, g) in groups.iter().enumerate() {
        if !out[i] && g.bytes <= left {
            out[i] = true;
            left -= g.bytes;
        }
    }
    out
}

/// The device's measured compute speed, seconds per weight byte: at one
/// token (reading the weights bounds it) and at `n` tokens (arithmetic
/// bounds it). In between, the larger of the one-token rate and the large
/// step's rate scaled by the tokens: a roofline through both measurements.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ComputeRate {
    pub s_per_byte_1: f64,
    pub s_per_byte_n: f64,
    pub n: u32,
}

impl ComputeRate {
    /// Seconds per weight byte of a step of `tokens` tokens.
    pub fn s_per_byte(&self, tokens: u32) -> f64 {
        let per_token = self.s_per_byte_n / self.n.max(1) as f64;
        self.s_per_byte_1.max(per_token * tokens as f64)
    }
}

/// A placement.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    pub resident: Vec<bool>,
    /// Slots of each kind: (attn, ffn); 0 when nothing of that kind streams.
    pub slots: (usize, usize),
    pub resident_bytes: u64,
    pub slot_bytes: u64,
    pub streamed_bytes_per_step: u64,
    pub fixed_bytes: u64,
    pub predicted_copy_s: f64,
    /// The device's speed the compute predictions use.
    pub compute: Option<ComputeRate>,
    /// Every group (what the device computes when the host CPU computes
    /// none).
    pub groups: Vec<GroupInfo>,
    /// Streamed groups the CPU computes at small steps, if that pays.
    pub hybrid: Option<super::hybrid::HybridPlan>,
}

impl Plan {
    /// Predicted device compute seconds of a step of `n` tokens over every
    /// group (0 when the device's speed was not measured).
    pub fn compute_s(&self, n: u32) -> f64 {
        self.compute.map_or(0.0, |c| {
            self.groups
                .iter()
                .map(|g| g.compute_s(n, |t| c.s_per_byte(t)))
                .sum()
        })
    }
    /// The floor of a step of `n` tokens: copies and compute overlap
    /// perfectly.
    pub fn floor_s(&self, n: u32) -> f64 {
        self.predicted_copy_s.max(self.compute_s(n))
    }
    /// The predicted time of a step of `n` tokens: the hybrid split's
    /// prediction where the CPU takes part, else the floor.
    pub fn predicted_step_s(&self, n: u32) -> f64 {
        match &self.hybrid {
            Some(h) if n >= 1 && (n as usize) <= h.per_size.len() => {
                match h.split.as_ref().filter(|s| s.at(n).is_some()) {
                    Some(s) => s.per_size[n as usize - 1].predicted.step_s(),
                    None => h.per_size[n as usize - 1].predicted.step_s(),
                }
            }
            _ => self.floor_s(n),
        }
    }
    pub fn n_streamed(&self) -> usize {
        self.resident.iter().filter(|r| !**r).count()
    }
    pub fn device_bytes(&self) -> u64 {
        self.fixed_bytes + self.resident_bytes + self.slot_bytes
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum PlanError {
    #[error("GPU budget {budget} bytes is below the working minimum of {minimum} bytes (fixed {fixed} + {slots} slots per group kind); raise --gpu-budget to at least {minimum_gib:.2} GiB")]
    BudgetTooSmall {
        budget: u64,
        minimum: u64,
        fixed: u64,
        slots: usize,
        minimum_gib: f64,
    },
    #[error("the model has no layer groups")]
    Empty,
    #[error("DRAM budget {budget} bytes is below the minimum of {minimum} bytes (two host slots of the largest streamed group of each kind); raise --dram-budget")]
    DramBudget { budget: u64, minimum: u64 },
    #[error("KV DRAM budget {budget} bytes is below the minimum of {minimum} bytes (one block of every windowed layer); raise --kv-dram")]
    KvDramBudget { budget: u64, minimum: u64 },
}

/// Chooses the placement. As many groups as fit are kept resident, spread
/// through the layers or the first layers' ([`ResidentOrder`]);
/// everything else streams through `slots` slots per kind. With a
/// CPU input, the host CPU computes some streamed FFN groups if that pays
/// (see `hybrid`), and attention gets the deeper ring that keeps the bus
/// busy while the CPU computes.
pub fn plan(inp: &PlanInput) -> Result<Plan, PlanError> {
    if inp.groups.is_empty() {
        return Err(PlanError::Empty);
    }
    let slots = inp.slots.max(2);
    if let Some(c) = &inp.cpu {
        let deep = super::hybrid::attn_slots(&inp.groups, inp.copy_bw, c, slots);
        if let Ok(p) = place(inp, deep, true) {
            if p.hybrid.is_some() {
                return Ok(p);
            }
        }
    }
    place(inp, slots, inp.cpu.is_some())
}

/// A placement with `attn_slots` attention slots and `inp.slots` FFN slots.
fn place(inp: &PlanInput, attn_slots: usize, hybrid: bool) -> Result<Plan, PlanError> {
    let total: u64 = inp.groups.iter().map(|g| g.bytes).sum();
    let slots = inp.slots.max(2);
    let ring = attn_slots as u64 * max_bytes(&inp.groups, GroupKind::Attn)
        + slots as u64 * max_bytes(&inp.groups, GroupKind::Ffn);
    let budget = inp.budget.unwrap_or(u64::MAX);
    let mut resident = vec![true; inp.groups.len()];
    let mut resident_bytes = total;
    let mut slot_bytes = 0;
    if inp.stream_all || inp.fixed_bytes.saturating_add(total) > budget {
        let minimum = inp.fixed_bytes + ring;
        if budget < minimum {
            return Err(PlanError::BudgetTooSmall {
                budget,
                minimum,
                fixed: inp.fixed_bytes,
                slots,
                minimum_gib: minimum as f64 / (1u64 << 30) as f64,
            });
        }
        // fill what is left after the ring with groups, first layers first
        let mut room = budget - minimum;
        for (i, g) in inp.groups.iter().enumerate() {
            let fits = !inp.stream_all && g.bytes <= room && resident[..i].iter().all(|&r| r);
            resident[i] = fits;
            if fits {
                room -= g.bytes;
            }
        }
        if !inp.stream_all && inp.resident == ResidentOrder::Spread {
            resident = spread_residents(&inp.groups, &resident, room);
        }
        resident_bytes = bytes_of(&inp.groups, &resident);
        slot_bytes = ring;
    }
    let streamed: u64 = inp
        .groups
        .iter()
        .zip(&resident)
        .filter(|(_, r)| !**r)
        .map(|(g, _)| g.bytes)
        .sum();
    let kind_streams = |k| {
        inp.groups
            .iter()
            .zip(&resident)
            .any(|(g, r)| !*r && g.kind == k)
    };
    let slots_of = |k| if kind_streams(k) { slots } else { 0 };
    let streams: Vec<bool> = resident.iter().map(|r| !r).collect();
    let hybrid = inp.cpu.as_ref().filter(|_| hybrid).and_then(|c| {
        let slots = (attn_slots, slots);
        let mut h = super::hybrid::plan_hybrid(&inp.groups, &streams, slots, inp.copy_bw, c)?;
        // a mixture's expert split, where it beats whole CPU groups
        h.split = super::split::plan_split(
            &inp.groups,
            &streams,
            &h.host,
            slots,
            inp.copy_bw,
            c,
            c.split,
            |n| h.per_size[n as usize - 1].predicted.step_s(),
        );
        Some(h)
    });
    Ok(Plan {
        hybrid,
        slots: (
            if kind_streams(GroupKind::Attn) {
                attn_slots
            } else {
                0
            },
            slots_of(GroupKind::Ffn),
        ),
        resident,
        resident_bytes,
        slot_bytes,
        streamed_bytes_per_step: streamed,
        fixed_bytes: inp.fixed_bytes,
        predicted_copy_s: streamed as f64 / inp.copy_bw.max(1.0),
        compute: inp.compute,
        groups: inp.groups.clone(),
    })
}

impl std::fmt::Display for Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        write!(
            f,
            "plan: {} of {} groups resident ({:.1} MiB), {} streamed through {}+{} slots ({:.1} MiB), fixed {:.1} MiB; \
             streamed {:.1} MiB/step, predicted copy {:.2} ms/step",
            self.resident.len() - self.n_streamed(),
            self.resident.len(),
            mib(self.resident_bytes),
            self.n_streamed(),
            self.slots.0,
            self.slots.1,
            mib(self.slot_bytes),
            mib(self.fixed_bytes),
            mib(self.streamed_bytes_per_step),
            self.predicted_copy_s * 1e3,
        )?;
        if let Some(c) = &self.compute {
            // the floor where decode and a large step are bound
            let sizes: &[u32] = if c.n > 1 { &[1, c.n] } else { &[1] };
            for &n in sizes {
                let compute = self.compute_s(n);
                write!(
                    f,
                    "; {n} token{}: compute {:.2} ms, floor {:.2} ms ({}-bound, {:.1} t/s)",
                    if n == 1 { "" } else { "s" },
                    compute * 1e3,
                    self.floor_s(n) * 1e3,
                    if compute > self.predicted_copy_s {
                        "compute"
                    } else {
                        "bus"
                    },
                    n as f64 / self.floor_s(n).max(1e-12)
                )?;
            }
        }
        if let Some(h) = &self.hybrid {
            let d = &h.per_size[0];
            write!(
                f,
                "\nhybrid: the CPU keeps {} streamed groups ({:.1} MiB); a 1-token step: CPU computes {} ({:.1} MiB), predicted (simulated) bus {:.2} ms beside CPU {:.2} ms + GPU {:.2} ms + stalls {:.2} ms = step {:.2} ms",
                h.host.iter().filter(|h| **h).count(),
                mib(h.host_bytes),
                d.cpu_groups,
                mib(d.cpu_bytes),
                d.predicted.bus_s * 1e3,
                d.predicted.cpu_s * 1e3,
                d.predicted.gpu_s * 1e3,
                d.predicted.stall_s * 1e3,
                d.predicted.step_s() * 1e3
            )?;
            if let Some(last) = h.per_size.iter().rposition(|s| s.cpu_groups > 0) {
                write!(f, "; CPU takes part up to {}-token steps", last + 1)?;
            }
            // each power-of-two step size's split, so a log shows why a
            // step ran as it did
            write!(f, "\nhybrid steps by size:")?;
            for (i, z) in h.per_size.iter().enumerate() {
                let n = i + 1;
                if n.is_power_of_two() {
                    // the tier, where the host groups' costs differ
                    let all = h.host.iter().filter(|x| **x).count();
                    let pool = (h.host.iter().zip(&h.tier))
                        .filter(|&(&x, &t)| x && t <= z.tier)
                        .count();
                    write!(
                        f,
                        " {n} tokens: {} CPU groups{}, {:.2} ms{};",
                        z.cpu_groups,
                        if pool < all && z.cpu_groups > 0 {
                            format!(" of the {pool} cheapest")
                        } else {
                            String::new()
                        },
                        z.predicted.step_s() * 1e3,
                        if z.carry { " carrying" } else { "" }
                    )?;
                }
            }
            if let Some(s) = &h.split {
                let n_split = s.groups.iter().filter(|g| **g).count();
                for (i, z) in s.per_size.iter().enumerate() {
                    let n = i + 1;
                    // the first split size, then every doubling
                    let first = z.dev_experts > 0 && (n == 1 || s.per_size[i - 1].dev_experts == 0);
                    if z.dev_experts > 0 && (first || n.is_power_of_two()) {
                        write!(
                            f,
                            "\nexpert split at {n} tokens: {n_split} streamed layers keep {} experts on the GPU (the most picked where router counts say, else the first), the CPU computes the others' picks; predicted bus {:.2} ms, chain {:.2} ms + stalls {:.2} ms = step {:.2} ms (whole CPU groups: {:.2} ms)",
                            z.dev_experts,
                            z.predicted.bus_s * 1e3,
                            (z.predicted.cpu_s + z.predicted.gpu_s) * 1e3,
                            z.predicted.stall_s * 1e3,
                            z.predicted.step_s() * 1e3,
                            h.per_size[i].predicted.step_s() * 1e3
                        )?;
                    }
                }
            }
        }
        Ok(())
    }
}

/// How many layers keep their KV cache on the device when no KV budget is
/// given: all of them if they fit beside the whole model or beside the
/// smallest streaming working set (`slots` per group kind); otherwise as
/// many as fit beside that working set and `windows` layer-sized KV windows
/// (the rest travel with their attention group). `fixed` excludes the KV.
pub fn auto_kv_layers(
    groups: &[GroupInfo],
    fixed: u64,
    per_layer: u64,
    n_layer: usize,
    windows: usize,
    slots: usize,
    budget: Option<u64>,
) -> usize {
    let Some(budget) = budget else {
        return n_layer;
    };
    let total: u64 = groups.iter().map(|g| g.bytes).sum();
    let ring = slots.max(2) as u64
        * (max_bytes(groups, GroupKind::Attn) + max_bytes(groups, GroupKind::Ffn));
    if fixed + per_layer * n_layer as u64 + total.min(ring) <= budget {
        return n_layer;
    }
    let room = budget.saturating_sub(fixed + ring + windows as u64 * per_layer);
    ((room / per_layer.max(1)) as usize).min(n_layer)
}

#[cfg(test)]
mod tests {
    use super::super::testutil::{cpu as probe, layers as groups};
    use super::*;
    use proptest::prelude::*;

    fn input(budget: Option<u64>) -> PlanInput {
        PlanInput {
            groups: groups(4, 10, 30),
            fixed_bytes: 5,
            budget,
            copy_bw: 100.0,
            compute: None,
            slots: 2,
            stream_all: false,
            resident: ResidentOrder::First,
            cpu: None,
        }
    }

    #[test]
    fn spread_keeps_as_many_of_each_kind_evenly() {
        // 8 layers of 10 + 30 bytes; room for 3 attention and 2 FFN groups
        // beside the ring (2 x 10 + 2 x 30) and 5 fixed bytes
        let inp = PlanInput {
            groups: groups(8, 10, 30),
            budget: Some(5 + 80 + 90),
            ..input(None)
        };
        let first = plan(&inp).unwrap();
        let spread = plan(&PlanInput {
            resident: ResidentOrder::Spread,
            ..inp.clone()
        })
        .unwrap();
        let on = |p: &Plan| -> Vec<usize> { (0..16).filter(|&i| p.resident[i]).collect() };
        // the prefix: attn 0, ffn 0, attn 1, ffn 1, attn 2
        assert_eq!(on(&first), [0, 1, 2, 3, 4]);
        // the same kinds spread: attention of layers 0, 2, 5; FFN of 0, 4
        assert_eq!(on(&spread), [0, 1, 4, 9, 10]);
        assert_eq!(spread.resident_bytes, first.resident_bytes);
        assert_eq!(
            spread.streamed_bytes_per_step,
            first.streamed_bytes_per_step
        );
        // FFN groups of two sizes (the first layers' wider): the spread set
        // is smaller, and the room it leaves is filled
        let mut g = groups(8, 10, 30);
        g[1].bytes = 40;
        g[3].bytes = 40;
        let inp = PlanInput {
            groups: g,
            budget: Some(5 + 20 + 80 + 100),
            resident: ResidentOrder::Spread,
            ..input(None)
        };
        let p = plan(&inp).unwrap();
        let first = plan(&PlanInput {
            resident: ResidentOrder::First,
            ..inp.clone()
        })
        .unwrap();
        // first: attn 0 (10), ffn 0 (40), attn 1 (10), ffn 1 (40) = 100
        assert_eq!(on(&first), [0, 1, 2, 3]);
        // spread: attn 0, 4 and FFN 0, 4 (10 + 40 + 10 + 30 = 90), then
        // attention 1 fills the 10 left
        assert_eq!(on(&p), [0, 1, 2, 8, 9]);
        assert!(p.device_bytes() <= 205);
        assert_eq!(p.resident_bytes, 100);
        // --stream-all streams everything, spread or not
        for budget in [None, Some(1000)] {
            let all = plan(&PlanInput {
                stream_all: true,
                budget,
                ..inp.clone()
            })
            .unwrap();
            assert_eq!(all.n_streamed(), 16, "{budget:?}");
        }
    }

    #[test]
    fn no_budget_keeps_everything() {
        let p = plan(&input(None)).unwrap();
        assert!(p.resident.iter().all(|&r| r));
        assert_eq!(p.streamed_bytes_per_step, 0);
        assert_eq!(p.slots, (0, 0));
    }

    #[test]
    fn minimum_budget_streams_everything() {
        // fixed 5 + 2 slots * (10 + 30)
        let p = plan(&input(Some(85))).unwrap();
        assert_eq!(p.n_streamed(), 8);
        assert_eq!(p.streamed_bytes_per_step, 160);
        assert!((p.floor_s(1) - 1.6).abs() < 1e-9);
    }

    #[test]
    fn the_floor_is_the_bus_for_decode_and_compute_for_large_steps() {
        // everything streams: 160 bytes over the bus, 1.6 s
        let mut inp = input(Some(85));
        inp.compute = Some(ComputeRate {
            s_per_byte_1: 0.005,
            s_per_byte_n: 0.1,
            n: 100,
        });
        let p = plan(&inp).unwrap();
        assert!((p.compute_s(1) - 0.8).abs() < 1e-9);
        assert!((p.floor_s(1) - 1.6).abs() < 1e-9);
        // a roofline: reading bounds small steps, arithmetic large ones
        assert!((p.compute_s(5) - 0.8).abs() < 1e-9);
        assert!((p.compute_s(50) - 8.0).abs() < 1e-9);
        assert!((p.floor_s(100) - 16.0).abs() < 1e-9);
        assert_eq!(p.predicted_step_s(100), p.floor_s(100));
        assert!(p.to_string().contains("100 tokens: compute 16000.00 ms"));
    }

    #[test]
    fn too_small_names_the_minimum() {
        let e = plan(&input(Some(84))).unwrap_err();
        assert!(matches!(e, PlanError::BudgetTooSmall { minimum: 85, .. }));
        assert!(e.to_string().contains("85 bytes"));
    }

    proptest! {
        #[test]
        fn plans_fit_the_budget(n in 1usize..20, a in 1u64..100, f in 1u64..300, fixed in 0u64..500, budget in 0u64..20000, slots in 2usize..5, spread in any::<bool>()) {
            let inp = PlanInput { groups: groups(n, a, f), fixed_bytes: fixed, budget: Some(budget), copy_bw: 1.0, compute: None, slots, stream_all: false, resident: if spread { ResidentOrder::Spread } else { ResidentOrder::First }, cpu: None };
            match plan(&inp) {
                Ok(p) => {
                    prop_assert!(p.device_bytes() <= budget);
                    let r: u64 = inp.groups.iter().zip(&p.resident).filter(|(_, r)| **r).map(|(g, _)| g.bytes).sum();
                    prop_assert_eq!(r, p.resident_bytes);
                    prop_assert_eq!(r + p.streamed_bytes_per_step, inp.groups.iter().map(|g| g.bytes).sum::<u64>());
                    // resident groups form a prefix, or as many of each kind
                    // spread with the first layer's among them
                    let first_streamed = p.resident.iter().position(|r| !r).unwrap_or(p.resident.len());
                    if !spread {
                        prop_assert!(p.resident[first_streamed..].iter().all(|r| !r));
                    } else if r > 0 {
                        prop_assert!(p.resident[0] || p.resident[1]);
                    }
                }
                Err(PlanError::BudgetTooSmall { minimum, .. }) => prop_assert!(budget < minimum),
                Err(e) => prop_assert!(false, "{}", e),
            }
        }
    }

    proptest! {
        #[test]
        fn hybrid_plans_fit_the_budget(n in 1usize..20, a in 1u64..100, f in 1u64..300, fixed in 0u64..500, budget in 0u64..20000, spb in 0.001f64..2.0) {
            let cpu = probe(spb);
            let inp = PlanInput { groups: groups(n, a, f), fixed_bytes: fixed, budget: Some(budget), copy_bw: 1.0, compute: None, slots: 2, stream_all: false, resident: ResidentOrder::Spread, cpu: Some(cpu) };
            match plan(&inp) {
                Ok(p) => {
                    prop_assert!(p.device_bytes() <= budget);
                    let ring = p.slots.0 as u64 * a + p.slots.1 as u64 * f;
                    prop_assert!(p.n_streamed() == 0 || p.slot_bytes >= ring);
                    // (spread residents may keep every attention group)
                    let attn_streams = inp.groups.iter().zip(&p.resident).any(|(g, r)| !r && g.kind == GroupKind::Attn);
                    if p.hybrid.is_some() && attn_streams { prop_assert!(p.slots.0 >= 2); }
                    let r: u64 = inp.groups.iter().zip(&p.resident).filter(|(_, r)| **r).map(|(g, _)| g.bytes).sum();
                    prop_assert_eq!(r, p.resident_bytes);
                }
                Err(PlanError::BudgetTooSmall { minimum, .. }) => prop_assert!(budget < minimum),
                Err(e) => prop_assert!(false, "{}", e),
            }
        }
    }

    #[test]
    fn kv_stays_on_the_device_while_it_fits() {
        // 4 layers of weights (1200 bytes; ring of 2 slots: 600), KV of 8
        // layers at 40 bytes each, 3 windows
        let g = groups(4, 100, 200);
        let kv = |budget| auto_kv_layers(&g, 50, 40, 8, 3, 2, budget);
        assert_eq!(kv(None), 8);
        // model and KV fit
        assert_eq!(kv(Some(50 + 1200 + 320)), 8);
        // KV fits beside the ring, the weights stream
        assert_eq!(kv(Some(50 + 600 + 320)), 8);
        // not even that: what fits beside the ring and 3 windows
        assert_eq!(kv(Some(50 + 600 + 320 - 1)), 4);
        assert_eq!(kv(Some(50 + 600 + 120 + 39)), 0);
    }
}
