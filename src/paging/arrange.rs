//! Which groups stay resident when not all fit: the same number of each
//! kind, placed where the steps the plan foresees run fastest. Plain Rust.
//!
//! Where they sit matters because the layers run in order and the slot
//! rings let uploads run only a few groups ahead:
//! - In a large bus-bound step (a 512-token prompt step of the 70B shape at
//!   12G), the first layers' resident groups compute while the bus fills
//!   the rings and then waits: the H100's pp512 ran 12-14% above its bus
//!   floor (docs/device-runs.md, run 7). Spread through the layers, the
//!   bus uploads beside every resident group: within 3% (run 24).
//! - In hybrid decode the step starts with drained streams; resident
//!   groups at the start hide the first uploads, so the chain stalls less
//!   with the first layers resident (the simulation: 218 against 224 ms).
//!
//! `Auto` therefore keeps the first groups of each kind (a `Lead`: so
//! many attention groups, so many FFN groups) and spreads the rest, with
//! the leads chosen by simulating both steps (`hybrid::simulate`) for every
//! candidate: the one whose prompt step and one-token step are together
//! nearest their best (the smallest worst ratio to the best candidate of
//! each). On the 70B shape at 12G the simulation puts most attention groups
//! first (small, they hide decode's first uploads) and spreads the FFN
//! groups (large, they hold up a prompt step's bus). A mixture of experts
//! is spread: measured on the Qwen3-30B-A3B shape, spreading took pp2048
//! from 7551 to 9221 t/s with decode unchanged (runs 25-27), and its
//! expert groups' reads vary with the step in ways the dense simulation of
//! a prompt step leaves out.

use super::groups::{GroupInfo, Where};
use super::hybrid::{simulate, CpuInput};
use crate::model::GroupKind;

/// Which groups a plan keeps resident when not all fit (the same number of
/// each kind whatever the order).
///
/// `First` keeps the first layers: the streamed groups are one run at the
/// end. `Spread` spaces the resident groups of each kind evenly through the
/// layers, the first layer's among them. `Auto` keeps as many first layers
/// whole as the simulation finds best for both prompt steps and decode
/// (see the module's text), spreads the rest, and spreads a mixture's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ResidentOrder {
    #[default]
    Auto,
    First,
    Spread,
}

/// What `Auto` weighs: the device's speed at a prompt step and at one
/// token, and the host CPU if it computes groups at small steps.
#[derive(Clone, Debug, PartialEq)]
pub struct Steps<'a> {
    /// Tokens of a prompt step (the step size the plan is made for).
    pub prompt_tokens: u32,
    /// Device seconds per weight byte at a prompt step, and at one token.
    pub prompt_s_per_byte: f64,
    pub one_s_per_byte: f64,
    /// Slots per kind: (attention, FFN).
    pub slots: (usize, usize),
    pub copy_bw: f64,
    /// The host CPU (hybrid decode: the one-token step is its best split).
    pub cpu: Option<&'a CpuInput>,
}

/// How many of each kind's first groups stay resident before the rest
/// are spread.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Lead {
    pub attn: usize,
    pub ffn: usize,
}

/// The arrangement `Auto` chose, and what it weighed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Arrangement {
    pub lead: Lead,
    /// The resident groups of each kind (a lead of `of`: the first layers).
    pub of: Lead,
    /// Predicted prompt step and one-token step, chosen and with the first
    /// layers resident, seconds.
    pub prompt_s: f64,
    pub one_s: f64,
    pub first_prompt_s: f64,
    pub first_one_s: f64,
}

/// The resident set for `order`, from the first-layers prefix `prefix`
/// (with `room` bytes of the budget left beside it); `steps`: what `Auto`
/// weighs (None: not measured, the first layers stay).
pub fn arrange(
    groups: &[GroupInfo],
    prefix: &[bool],
    room: u64,
    order: ResidentOrder,
    steps: Option<&Steps>,
) -> (Vec<bool>, Option<Arrangement>) {
    let moe = groups.iter().any(|g| g.experts.is_some());
    let spread = || lead_then_spread(groups, prefix, room, Lead::default());
    match (order, steps) {
        (ResidentOrder::First, _) => (prefix.to_vec(), None),
        (ResidentOrder::Spread, _) => (spread(), None),
        (ResidentOrder::Auto, _) if moe => (spread(), None),
        (ResidentOrder::Auto, None) => (prefix.to_vec(), None),
        (ResidentOrder::Auto, Some(s)) => choose(groups, prefix, room, s),
    }
}

/// Resident groups of each kind in `resident`.
fn count(groups: &[GroupInfo], resident: &[bool]) -> Lead {
    let of = |k| {
        groups
            .iter()
            .zip(resident)
            .filter(|(g, r)| g.kind == k && **r)
            .count()
    };
    Lead {
        attn: of(GroupKind::Attn),
        ffn: of(GroupKind::Ffn),
    }
}

/// About 9 values from 0 to `k`, both included.
fn some_of(k: usize) -> Vec<usize> {
    let step = k.div_ceil(8).max(1);
    let mut v: Vec<usize> = (0..k).step_by(step).collect();
    v.push(k);
    v
}

/// `Auto`'s choice among the leads from 0 (spread) to the prefix's counts
/// (the first layers).
fn choose(
    groups: &[GroupInfo],
    prefix: &[bool],
    room: u64,
    s: &Steps,
) -> (Vec<bool>, Option<Arrangement>) {
    let of = count(groups, prefix);
    if of.attn + of.ffn == 0 || prefix.iter().all(|r| *r) || s.prompt_tokens <= 1 {
        return (prefix.to_vec(), None);
    }
    struct Candidate {
        lead: Lead,
        resident: Vec<bool>,
        prompt_s: f64,
        one_s: f64,
    }
    let mut scored = Vec::new();
    for attn in some_of(of.attn) {
        for ffn in some_of(of.ffn) {
            let lead = Lead { attn, ffn };
            let resident = if lead == of {
                prefix.to_vec()
            } else {
                lead_then_spread(groups, prefix, room, lead)
            };
            let (prompt_s, one_s) = predict(groups, &resident, s);
            scored.push(Candidate {
                lead,
                resident,
                prompt_s,
                one_s,
            });
        }
    }
    let best = |f: fn(&Candidate) -> f64| scored.iter().map(f).fold(f64::INFINITY, f64::min);
    let (best_p, best_o) = (best(|c| c.prompt_s), best(|c| c.one_s));
    let worst = |c: &Candidate| (c.prompt_s / best_p.max(1e-12)).max(c.one_s / best_o.max(1e-12));
    // ties go to the later candidate (nearer the first layers)
    let chosen = scored
        .iter()
        .rev()
        .min_by(|a, b| worst(a).total_cmp(&worst(b)))
        .expect("the first layers are a candidate");
    let first = scored.last().expect("the first layers are a candidate");
    let a = Arrangement {
        lead: chosen.lead,
        of,
        prompt_s: chosen.prompt_s,
        one_s: chosen.one_s,
        first_prompt_s: first.prompt_s,
        first_one_s: first.one_s,
    };
    (chosen.resident.clone(), Some(a))
}

/// Predicted prompt step and one-token step with `resident` kept.
fn predict(groups: &[GroupInfo], resident: &[bool], s: &Steps) -> (f64, f64) {
    let streamed: Vec<bool> = resident.iter().map(|r| !r).collect();
    let at: Vec<Where> = resident
        .iter()
        .map(|&r| if r { Where::Resident } else { Where::Bus })
        .collect();
    // the device alone, at a rate per byte (its per-group cost is in it)
    let device = CpuInput::device_only;
    let prompt = simulate(
        groups,
        &at,
        s.slots,
        s.copy_bw,
        &device(s.prompt_s_per_byte),
        s.prompt_tokens,
    );
    let one = match s.cpu {
        Some(c) => super::hybrid::one_token_step(groups, &streamed, s.slots, s.copy_bw, c),
        None => simulate(groups, &at, s.slots, s.copy_bw, &device(s.one_s_per_byte), 1),
    };
    (prompt.step_s(), one.step_s())
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
/// moved to the same number of each kind's groups: the first `lead` of the
/// kind, the rest spread evenly through the kind's later groups, if that
/// fits in the same bytes. Groups of one kind differ in size in some models
/// (Q4_K_M's wider ffn_down on some layers), so what is left is then filled
/// in layer order.
pub(super) fn lead_then_spread(
    groups: &[GroupInfo],
    resident: &[bool],
    room: u64,
    lead: Lead,
) -> Vec<bool> {
    let mut out = resident.to_vec();
    for (kind, lead) in [(GroupKind::Attn, lead.attn), (GroupKind::Ffn, lead.ffn)] {
        let idx: Vec<usize> = (0..groups.len())
            .filter(|&i| groups[i].kind == kind)
            .collect();
        let k = idx.iter().filter(|&&i| resident[i]).count();
        let lead = lead.min(k);
        for &i in &idx {
            out[i] = false;
        }
        for &i in &idx[..lead] {
            out[i] = true;
        }
        let rest = &idx[lead..];
        for p in evenly(rest.len(), k - lead) {
            out[rest[p]] = true;
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

#[cfg(test)]
mod tests {
    use super::super::plan::{plan, ComputeRate, PlanInput};
    use super::super::testutil::layers;
    use super::*;
    use proptest::prelude::*;

    const MIB: u64 = 1 << 20;

    /// The 70B shape at 12G with the H200's rates of run 24 (its plan
    /// printed 218 ms for hybrid decode with the first layers resident).
    fn run24(order: ResidentOrder) -> PlanInput {
        let cpu = CpuInput {
            s_per_byte_1: 1.057e-11,
            s_per_byte_n: 6.0 * 1.057e-11,
            probe_tokens: 16,
            host_room: u64::MAX,
            hop_s: 0.085e-3,
            gpu_s_per_byte: 1.0 / 3.3e12,
            gpu_group_s: 0.05e-3,
            bus_bw_beside: Some(52.3e9),
            force: None,
            split: Default::default(),
        };
        PlanInput {
            groups: layers(80, 81 * MIB, 378 * MIB),
            fixed_bytes: 1766 * MIB,
            budget: Some(12 << 30),
            copy_bw: 55.4e9,
            // 512-token steps: 333 ms of compute over the 36.7 GB model
            compute: Some(ComputeRate {
                s_per_byte_1: 4.4e-13,
                s_per_byte_n: 9.07e-12,
                n: 512,
            }),
            slots: 3,
            stream_all: false,
            resident: order,
            cpu: Some(cpu),
        }
    }

    /// Predicted (prompt step, hybrid one-token step) of a plan.
    fn steps_of(inp: &PlanInput) -> (f64, f64, Vec<bool>) {
        let p = plan(inp).unwrap();
        let s = Steps {
            prompt_tokens: 512,
            prompt_s_per_byte: 9.07e-12,
            one_s_per_byte: 4.4e-13,
            slots: p.slots,
            copy_bw: inp.copy_bw,
            cpu: inp.cpu.as_ref(),
        };
        let (a, b) = predict(&inp.groups, &p.resident, &s);
        (a, b, p.resident)
    }

    #[test]
    fn auto_takes_the_prompt_step_of_spread_and_the_decode_of_first() {
        let (fp, fo, first) = steps_of(&run24(ResidentOrder::First));
        let (sp, so, spread) = steps_of(&run24(ResidentOrder::Spread));
        let (ap, ao, auto) = steps_of(&run24(ResidentOrder::Auto));
        // what the orders trade (run 24 measured 1.18x and 1.03x the bus
        // floor at pp512): first is 10% slower at the prompt step, spread
        // slower at decode
        assert!(fp > 1.1 * sp, "first {fp} spread {sp}");
        assert!(so > 1.02 * fo, "first {fo} spread {so}");
        // auto: within 1% of the better at each
        assert!(ap <= 1.01 * sp, "auto {ap} spread {sp}");
        assert!(ao <= 1.01 * fo, "auto {ao} first {fo}");
        // as many of each kind as first, first layers whole, then spread
        let count = |r: &[bool], k: usize| r.iter().skip(k).step_by(2).filter(|x| **x).count();
        for k in 0..2 {
            assert_eq!(count(&auto, k), count(&first, k));
            assert_eq!(count(&spread, k), count(&first, k));
        }
        let p = plan(&run24(ResidentOrder::Auto)).unwrap();
        let a = p.arrangement.expect("auto weighed the orders");
        assert_ne!(a.lead, a.of, "not the first layers");
        for (k, lead) in [(0, a.lead.attn), (1, a.lead.ffn)] {
            assert!(auto.iter().skip(k).step_by(2).take(lead).all(|r| *r));
        }
        assert!(p.to_string().contains(&format!(
            "resident: the first {} of {} attention and {} of {} FFN groups",
            a.lead.attn, a.of.attn, a.lead.ffn, a.of.ffn
        )));
        // without the CPU (`--hybrid off`) too: the prompt step of spread
        let bus = |o| PlanInput {
            cpu: None,
            ..run24(o)
        };
        let (bp, _, _) = steps_of(&bus(ResidentOrder::Auto));
        let (sp, _, _) = steps_of(&bus(ResidentOrder::Spread));
        assert!(bp <= 1.01 * sp, "auto {bp} spread {sp}");
    }

    #[test]
    fn unmeasured_keeps_the_first_layers_and_mixtures_spread() {
        let inp = PlanInput {
            compute: None,
            ..run24(ResidentOrder::Auto)
        };
        let auto = plan(&inp).unwrap();
        let first = plan(&PlanInput {
            resident: ResidentOrder::First,
            ..inp.clone()
        })
        .unwrap();
        assert_eq!(auto.resident, first.resident);
        assert_eq!(auto.arrangement, None);
        // a mixture: spread, whatever was measured
        let mut moe = run24(ResidentOrder::Auto);
        for g in moe.groups.iter_mut().filter(|g| g.kind == GroupKind::Ffn) {
            g.experts = Some(super::super::groups::Experts {
                bytes: g.bytes - MIB,
                n_expert: 128,
                n_used: 8,
                hot: 0.0,
            });
        }
        let auto = plan(&moe).unwrap();
        let spread = plan(&PlanInput {
            resident: ResidentOrder::Spread,
            ..moe.clone()
        })
        .unwrap();
        assert_eq!(auto.resident, spread.resident);
    }

    proptest! {
        #[test]
        fn lead_then_spread_keeps_each_kinds_count_and_the_bytes(
            n in 1usize..40, a in 1u64..50, f in 1u64..200, k in 0usize..80,
            room in 0u64..300, la in 0usize..40, lf in 0usize..40, wide in proptest::collection::vec(0u64..60, 40),
        ) {
            let mut g = layers(n, a, f);
            for (i, x) in g.iter_mut().enumerate().filter(|(_, x)| x.kind == GroupKind::Ffn) {
                x.bytes += wide[i / 2];
            }
            let prefix: Vec<bool> = (0..g.len()).map(|i| i < k.min(g.len())).collect();
            let r = lead_then_spread(&g, &prefix, room, Lead { attn: la, ffn: lf });
            let before = bytes_of(&g, &prefix);
            prop_assert!(bytes_of(&g, &r) <= before + room);
            for (kind, lead) in [(GroupKind::Attn, la), (GroupKind::Ffn, lf)] {
                let of = |x: &[bool]| g.iter().zip(x).filter(|(q, r)| q.kind == kind && **r).count();
                // as many (more only where the left room was filled)
                prop_assert!(of(&r) >= of(&prefix));
                // the first `lead` of each kind are kept
                let kept = g.iter().zip(&r).filter(|(q, _)| q.kind == kind).take(lead.min(of(&prefix)));
                prop_assert!(kept.clone().all(|(_, r)| *r));
            }
        }
    }
}
