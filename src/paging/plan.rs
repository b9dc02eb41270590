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
///
/// `Cost` is `Spread`, or, where the host CPU computes streamed groups and
/// its groups differ in cost, the FFN groups it computes slowest kept
/// resident when the plan predicts that faster (`costly_residents`). The
/// plan predicted 64 skewed sequences on the Qwen3-30B-A3B shape at 8G
/// faster so (138.90-157.92 ms a step against spread's 150.47-162.96),
/// but four loads on an H200 measured no gain (runs 200-201: 417.19,
/// 312.49, 352.07 and 399.02 t/s against spread's 395.85, 390.57, 371.67,
/// 413.14 and 411.41; the host CPU at 1.05-1.89x its probe's time per
/// byte in those loads, 0.93-1.20x in spread's), so it is not the
/// default.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ResidentOrder {
    #[default]
    Spread,
    First,
    Cost,
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
    /// Whether the resident FFN groups are those the host CPU computes
    /// slowest (see `costly_residents`) instead of spread evenly.
    pub resident_by_cost: bool,
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
    let mut slot_bytes = 0;
    let mut by_cost = None;
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
        if !inp.stream_all && inp.resident != ResidentOrder::First {
            let prefix = resident;
            resident = spread_residents(&inp.groups, &prefix, room);
            let cost = inp.resident == ResidentOrder::Cost;
            if cost && hybrid && inp.cpu.as_ref().is_some_and(|c| c.tiers) {
                // the same bytes as the prefix and its room
                let left = room + bytes_of(&inp.groups, &prefix) - bytes_of(&inp.groups, &resident);
                by_cost = costly_residents(&inp.groups, &resident, left);
            }
        }
        slot_bytes = ring;
    }
    let spread = finish(inp, resident, slot_bytes, attn_slots, hybrid, false);
    // the host CPU's costliest groups resident instead, where the plan
    // predicts that faster
    match by_cost.map(|r| finish(inp, r, slot_bytes, attn_slots, hybrid, true)) {
        Some(q) if costly_pays(&spread, &q) => Ok(q),
        _ => Ok(spread),
    }
}

/// The plan that keeps `resident` on the device.
fn finish(
    inp: &PlanInput,
    resident: Vec<bool>,
    slot_bytes: u64,
    attn_slots: usize,
    hybrid: bool,
    by_cost: bool,
) -> Plan {
    let slots = inp.slots.max(2);
    let resident_bytes = bytes_of(&inp.groups, &resident);
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
        h.split =
            super::split::plan_split(&inp.groups, &streams, &h, slots, inp.copy_bw, c, c.split);
        Some(h)
    });
    Plan {
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
        resident_by_cost: by_cost,
    }
}

/// The resident set `spread` ([`spread_residents`]'s, with `left` bytes
/// of room beside it) with its FFN groups' bytes spent on the groups the host
/// CPU computes slowest per byte, its attention groups as they are; None
/// where the FFN groups all cost the CPU alike.
///
/// The CPU takes its groups of a step from the cheapest streamed ones
/// (`hybrid::tiers`). In llama.cpp's Q4_K_M mix half the layers'
/// `ffn_down` is Q6_K, which the host reads at 21-25 GB/s at 64 tokens
/// against 40-47 for Q4_K (x86 has no repacked Q6_K product), and
/// spreading the resident groups through the layers left the CPU 12 cheap
/// streamed groups of 31 on the Qwen3-30B-A3B shape at 8G (run 199): more
/// host groups at 64 sequences then came from the dear tier and ran at 30
/// GB/s against 43. Here the dearest tier's groups stay resident first,
/// each tier's spread evenly through its layers, so the cheap ones stream
/// for the CPU; what room is left is filled in layer order.
fn costly_residents(groups: &[GroupInfo], spread: &[bool], mut left: u64) -> Option<Vec<bool>> {
    let ffn: Vec<usize> = (0..groups.len())
        .filter(|&i| groups[i].kind == GroupKind::Ffn)
        .collect();
    let tier = super::hybrid::tiers(groups, &ffn, true);
    let top = ffn.iter().map(|&i| tier[i]).max()?;
    if top == 0 {
        return None;
    }
    let mut out = spread.to_vec();
    for &i in &ffn {
        if out[i] {
            out[i] = false;
            left += groups[i].bytes;
        }
    }
    for t in (0..=top).rev() {
        let idx: Vec<usize> = ffn.iter().copied().filter(|&i| tier[i] == t).collect();
        let cost = |k: usize| {
            evenly(idx.len(), k)
                .map(|p| groups[idx[p]].bytes)
                .sum::<u64>()
        };
        let k = (0..=idx.len())
            .rev()
            .find(|&k| cost(k) <= left)
            .unwrap_or(0);
        for p in evenly(idx.len(), k) {
            out[idx[p]] = true;
        }
        left -= cost(k);
        if k < idx.len() {
            break;
        }
    }
    for (i, g) in groups.iter().enumerate() {
        if !out[i] && g.bytes <= left {
            out[i] = true;
            left -= g.bytes;
        }
    }
    Some(out)
}

/// Whether `q` (the CPU's costliest groups resident) beats `p` (resident
/// groups spread): no step size the CPU takes part in predicted more than
/// 1% slower, the power-of-two sizes' steps faster in sum, and the large
/// step (where the CPU takes no part) no more than 0.5% slower at its
/// floor: the two may stream a few bytes apart, the groups packing
/// differently into the same room.
fn costly_pays(p: &Plan, q: &Plan) -> bool {
    let large = |x: &Plan| x.compute.map_or(x.predicted_copy_s, |c| x.floor_s(c.n));
    let (Some(hp), Some(hq)) = (&p.hybrid, &q.hybrid) else {
        return false;
    };
    let step = |h: &super::hybrid::HybridPlan, n: usize| h.per_size[n - 1].predicted.step_s();
    let sizes: Vec<usize> = (1..=hp.per_size.len().min(hq.per_size.len()))
        .filter(|&n| hp.per_size[n - 1].cpu_groups > 0 || hq.per_size[n - 1].cpu_groups > 0)
        .collect();
    let sum = |h| {
        sizes
            .iter()
            .filter(|n| n.is_power_of_two())
            .map(|&n| step(h, n))
            .sum::<f64>()
    };
    !sizes.is_empty()
        && sizes.iter().all(|&n| step(hq, n) <= step(hp, n) * 1.01)
        && sum(hq) < sum(hp)
        && large(q) <= large(p) * 1.005
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
        if self.resident_by_cost {
            write!(
                f,
                "; resident FFN groups: those the host CPU computes slowest, so the cheap ones stream for it"
            )?;
        }
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
                    let count = |upto: u8| {
                        (h.host.iter().zip(&h.tier))
                            .filter(|&(&x, &t)| x && t <= upto)
                            .count()
                    };
                    let pool = count(z.tier);
                    let below = z.tier.checked_sub(1).map_or(0, count);
                    write!(
                        f,
                        " {n} tokens: {} CPU groups{}, {:.2} ms{};",
                        z.cpu_groups,
                        if z.fill && z.cpu_groups > below {
                            format!(
                                " (the {below} cheapest and {} of the next {})",
                                z.cpu_groups - below,
                                pool - below
                            )
                        } else if pool < all && z.cpu_groups > 0 {
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
                            "\nexpert split at {n} tokens: {} streamed layers keep {} experts on the GPU (the most picked where router counts say, else the first), the CPU computes the others' picks{}; predicted bus {:.2} ms, chain {:.2} ms + stalls {:.2} ms = step {:.2} ms (whole CPU groups: {:.2} ms)",
                            n_split.saturating_sub(z.cpu_groups as usize),
                            z.dev_experts,
                            if z.cpu_groups > 0 {
                                format!(" and {} host groups whole", z.cpu_groups)
                            } else {
                                String::new()
                            },
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

    /// `n` layers of a mixture: attention of 10 MiB, FFN of `ffn` MiB
    /// whose experts cost the CPU 1.0x per byte, every layer `dear` says
    /// 15% larger and `dear_cost` times as slow at large steps (llama.cpp's
    /// Q4_K_M mix: Q6_K `ffn_down`, which x86 does not repack).
    fn mixture(n: usize, ffn: u64, dear: impl Fn(usize) -> bool, dear_cost: f64) -> Vec<GroupInfo> {
        let mib = 1u64 << 20;
        (0..n)
            .flat_map(|l| {
                let d = dear(l);
                let bytes = if d { ffn * mib * 115 / 100 } else { ffn * mib };
                [
                    GroupInfo::dense(GroupKind::Attn, 10 * mib),
                    GroupInfo {
                        kind: GroupKind::Ffn,
                        bytes,
                        experts: Some(crate::paging::Experts {
                            bytes: bytes - mib,
                            n_expert: 128,
                            n_used: 8,
                            hot: 0.0,
                            popularity: None,
                            cpu_scale: if d { [1.1, dear_cost] } else { [1.0, 1.0] },
                        }),
                    },
                ]
            })
            .collect()
    }

    /// The Qwen3-30B-A3B shape in the Q4_K_M mix at 8G on an H200 (runs
    /// 196-199): 48 layers, the bus at 55 GB/s, the host at 80 GB/s at one
    /// token, 55 at 16 and 49 GB/s of picked experts at 64, a 2048-token
    /// step bound by the device's compute (216 ms against 211 on the bus).
    fn moe_30b(resident: ResidentOrder) -> PlanInput {
        moe_30b_dear(resident, 1.3)
    }

    /// [`moe_30b`] with the Q6_K layers at `dear` times the host's time
    /// per byte at 64 tokens.
    fn moe_30b_dear(resident: ResidentOrder, dear: f64) -> PlanInput {
        let q6 = |l: usize| !(6..42).contains(&l) || (l - 6) % 3 == 2;
        let groups = mixture(48, 325, q6, dear);
        let g = &groups[1];
        let s1 = 1.0 / 80e9;
        let big = crate::paging::s_per_byte_at(g, 64, g.read_bytes(64) as f64 / 49e9, s1);
        PlanInput {
            groups,
            fixed_bytes: 834 << 20,
            budget: Some(8 << 30),
            copy_bw: 55e9,
            compute: Some(ComputeRate {
                s_per_byte_1: 1.0 / 134e9,
                s_per_byte_n: 5.7e-11,
                n: 2048,
            }),
            slots: 3,
            stream_all: false,
            resident,
            cpu: Some(crate::paging::CpuInput {
                s_per_byte_1: s1,
                s_per_byte_n: 1.0 / 55e9,
                big: Some((64, big)),
                hop_s: 30e-6,
                gpu_s_per_byte: 1.0 / 350e9,
                gpu_group_s: 26e-6,
                cpu_group_s: 50e-6,
                bus_bw_beside: Some(53.5e9),
                carry: true,
                ..probe(s1)
            }),
        }
    }

    /// Where the host computes the Q6_K layers' experts 1.5x slower per
    /// byte than the Q4_K ones, keeping those resident leaves it the cheap
    /// ones and pays. At the 1.3x of the H200's host (run 182) steps that
    /// fill the cheap tier first predict the two orders within 2% at 64
    /// tokens (runs 229 measured them level), and the plan keeps the
    /// spread order.
    #[test]
    fn the_cpus_dear_groups_stay_resident_where_that_is_faster() {
        let measured = plan(&moe_30b(ResidentOrder::Cost)).unwrap();
        assert!(!measured.resident_by_cost);
        let cost = plan(&moe_30b_dear(ResidentOrder::Cost, 1.5)).unwrap();
        let spread = plan(&moe_30b_dear(ResidentOrder::Spread, 1.5)).unwrap();
        assert!(cost.resident_by_cost && !spread.resident_by_cost);
        assert!(cost
            .to_string()
            .contains("those the host CPU computes slowest"));
        for p in [&cost, &spread] {
            assert!(p.device_bytes() <= 8 << 30);
        }
        let (hc, hs) = (
            cost.hybrid.as_ref().unwrap(),
            spread.hybrid.as_ref().unwrap(),
        );
        let dear = |p: &Plan, i: usize| p.groups[i].cpu_scale()[1] > 1.0;
        let ffn = |p: &Plan, r: bool| -> Vec<usize> {
            (0..96)
                .filter(|&i| p.groups[i].kind == GroupKind::Ffn && p.resident[i] == r)
                .collect()
        };
        // spread: resident FFN groups of both kinds, so the CPU's cheap
        // streamed groups are few
        assert!(ffn(&spread, true).iter().any(|&i| !dear(&spread, i)));
        // by cost: the dear ones resident, every cheap one streams for the CPU
        assert!(ffn(&cost, true).iter().all(|&i| dear(&cost, i)));
        let cheap_streamed = |p: &Plan| ffn(p, false).iter().filter(|&&i| !dear(p, i)).count();
        assert_eq!(cheap_streamed(&cost), 24);
        assert!(cheap_streamed(&spread) < 24);
        // the same bytes, give or take a group's packing, and every step
        // the CPU takes part in no slower; 64 tokens faster
        let step =
            |h: &super::super::hybrid::HybridPlan, n: usize| h.per_size[n - 1].predicted.step_s();
        for n in 1..=64 {
            assert!(
                step(hc, n) <= step(hs, n) * 1.01,
                "{n} tokens: {} against {}",
                step(hc, n),
                step(hs, n)
            );
        }
        assert!(
            step(hc, 64) < step(hs, 64) * 0.97,
            "{} against {}",
            step(hc, 64),
            step(hs, 64)
        );
        assert!(cost.floor_s(2048) <= spread.floor_s(2048) * 1.005);
        assert!(
            (0.21..0.22).contains(&spread.compute_s(2048)),
            "{}",
            spread.compute_s(2048)
        );
        // groups of one cost: by cost is spread
        let mut one = moe_30b(ResidentOrder::Cost);
        one.groups = mixture(48, 325, |_| false, 1.0);
        let a = plan(&one).unwrap();
        let s = plan(&PlanInput {
            resident: ResidentOrder::Spread,
            ..one
        })
        .unwrap();
        assert!(!a.resident_by_cost);
        assert_eq!(a.resident, s.resident);
    }

    proptest! {
        #[test]
        fn resident_by_cost_fits_and_is_never_slower(n in 4usize..24, ffn in 50u64..400, every in 2usize..4, cost in 1.05f64..2.5, share in 0.2f64..0.9, spb in 0.3f64..3.0) {
            let groups = mixture(n, ffn, |l| l % every == 0, cost);
            // a budget that streams some of the model
            let budget_mib = ((groups.iter().map(|g| g.bytes).sum::<u64>() >> 20) as f64 * share) as u64 + 834;
            let mut inp = moe_30b(ResidentOrder::Cost);
            inp.groups = groups;
            inp.budget = Some(budget_mib << 20);
            inp.cpu = inp.cpu.map(|c| c.scaled(spb));
            let spread = plan(&PlanInput { resident: ResidentOrder::Spread, ..inp.clone() });
            match plan(&inp) {
                Ok(p) => {
                    prop_assert!(p.device_bytes() <= budget_mib << 20);
                    let r: u64 = inp.groups.iter().zip(&p.resident).filter(|(_, r)| **r).map(|(g, _)| g.bytes).sum();
                    prop_assert_eq!(r, p.resident_bytes);
                    prop_assert_eq!(r + p.streamed_bytes_per_step, inp.groups.iter().map(|g| g.bytes).sum::<u64>());
                    let s = spread.expect("spread plans where by cost does");
                    if p.resident_by_cost {
                        let (hp, hs) = (p.hybrid.as_ref().unwrap(), s.hybrid.as_ref().unwrap());
                        for k in 1..=hp.per_size.len() {
                            if hp.per_size[k - 1].cpu_groups > 0 || hs.per_size[k - 1].cpu_groups > 0 {
                                prop_assert!(hp.per_size[k - 1].predicted.step_s() <= hs.per_size[k - 1].predicted.step_s() * 1.01);
                            }
                        }
                        prop_assert!(p.floor_s(2048) <= s.floor_s(2048) * 1.005);
                    } else {
                        prop_assert_eq!(&p.resident, &s.resident);
                    }
                }
                Err(PlanError::BudgetTooSmall { minimum, .. }) => prop_assert!(budget_mib << 20 < minimum),
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
