//! Expert split: a mixture's layer whose experts the device and the host
//! CPU compute together, in the same step. Plain Rust.
//!
//! A step of many tokens (64 sequences decoding) routes to nearly every
//! expert of a layer, so a streamed expert group must cross the bus whole,
//! and whole expert groups computed by the CPU in the layer chain make the
//! GPU wait for them (measured on an H200: 2% at best, docs/device-runs.md
//! run 33-34). Split instead: the bus uploads only the first `k` experts
//! of each split group (the expert is the outermost dimension of the
//! expert tensors, so that is a prefix of each), the device computes the
//! picks of those, and the CPU computes the picks of the others from its
//! own copy at the same time; the host's rows are added to the residual
//! after the device's. Per split layer the step then costs about
//! max(upload of k experts, CPU on the rest) instead of the upload of all.
//!
//! The router runs once, on the device, before either side starts: both
//! must agree on every pick.

use super::groups::GroupInfo;
use super::hybrid::{simulate, split_placement, CpuInput, HybridPlan, Prediction, MAX_TOKENS};
pub use super::hybrid::{ExpertSplit, SplitInput, SplitPlan, SplitSize};

/// Plans the split beside hybrid plan `h` (its host groups are the ones
/// that may split, its step at each size with whole CPU groups the one
/// the split must beat under `ExpertSplit::Auto`). A split step may keep
/// some host groups whole on the CPU (`SplitInput::whole`; `Auto` tries
/// a few counts up to the hybrid step's own): the bus then carries only
/// the other layers' device experts, and each whole group takes the
/// CPU's work of a split layer off the layer chain.
pub fn plan_split(
    groups: &[GroupInfo],
    streamed: &[bool],
    h: &HybridPlan,
    slots: (usize, usize),
    copy_bw: f64,
    c: &CpuInput,
    s: SplitInput,
) -> Option<SplitPlan> {
    let split: Vec<bool> = (0..groups.len())
        .map(|i| h.host[i] && streamed[i] && groups[i].experts.is_some())
        .collect();
    let n_expert = groups
        .iter()
        .zip(&split)
        .filter(|(_, s)| **s)
        .filter_map(|(g, _)| g.experts)
        .map(|x| x.n_expert)
        .min()?;
    if s.mode == ExpertSplit::Off || n_expert < 2 {
        return None;
    }
    let eval = |n: u32, k: u32, w: u32| {
        let cpu = h.whole_groups(n, w as usize);
        let at = split_placement(streamed, &split, &cpu, k);
        simulate(groups, &at, slots, copy_bw, c, n)
    };
    let whole = |n: u32| h.per_size[n as usize - 1].predicted.step_s();
    let per_size = (1..=MAX_TOKENS)
        .map(|n| {
            let none = SplitSize {
                dev_experts: 0,
                cpu_groups: 0,
                predicted: Prediction::default(),
            };
            if n < s.min_tokens.max(2) {
                return none;
            }
            match s.mode {
                ExpertSplit::Force(k) => {
                    let k = k.clamp(1, n_expert - 1);
                    let w = s.whole.unwrap_or(0);
                    SplitSize {
                        dev_experts: k,
                        cpu_groups: w,
                        predicted: eval(n, k, w),
                    }
                }
                _ => {
                    // whole CPU groups: the count asked for, or a few up to
                    // the hybrid step's
                    let most = h.per_size[n as usize - 1].cpu_groups as u32;
                    let counts: Vec<u32> = match s.whole {
                        Some(w) => vec![w],
                        None => {
                            let mut ws: Vec<u32> = (0..=4).map(|q| most * q / 4).collect();
                            ws.dedup();
                            ws
                        }
                    };
                    let (k, w, p) = counts
                        .iter()
                        .flat_map(|&w| (1..n_expert).map(move |k| (k, w)))
                        .map(|(k, w)| (k, w, eval(n, k, w)))
                        .min_by(|a, b| a.2.step_s().total_cmp(&b.2.step_s()))
                        .expect("n_expert >= 2");
                    if p.step_s() < whole(n) {
                        SplitSize {
                            dev_experts: k,
                            cpu_groups: w,
                            predicted: p,
                        }
                    } else {
                        none
                    }
                }
            }
        })
        .collect();
    Some(SplitPlan {
        groups: split,
        per_size,
    })
}

/// The experts of a split layer whose picks the device computes when it
/// takes `k` of the layer's `n_expert`: the first `k` of `order` (the
/// layer's experts, most picked first, from the router counts kept beside
/// the model), or experts `0..k` where no counts ordered the layer. A
/// mask over the experts: with skewed routing the most picked experts
/// take most of the picks, so the bus carries the experts worth carrying
/// and the CPU gets the rarely picked ones, each for few rows.
pub fn device_experts(order: Option<&[u32]>, n_expert: u32, k: u32) -> Vec<bool> {
    let n = n_expert as usize;
    let k = (k as usize).min(n);
    let mut on = vec![false; n];
    match order.filter(|o| o.len() == n) {
        Some(o) => o[..k].iter().for_each(|&e| on[e as usize] = true),
        None => on[..k].iter_mut().for_each(|x| *x = true),
    }
    on
}

#[cfg(test)]
const AUTO: SplitInput = SplitInput {
    mode: ExpertSplit::Auto,
    min_tokens: 32,
    whole: None,
};

#[cfg(test)]
mod tests {
    use super::super::groups::Experts;
    use super::super::groups::Where;
    use super::super::testutil::cpu;
    use super::*;
    use crate::model::GroupKind;
    use proptest::prelude::*;

    /// Qwen3-30B-A3B's shape in bytes: `layers` layers of 10 MB attention
    /// and 370 MB of 128 experts (8 per token).
    fn mixture(layers: usize) -> Vec<GroupInfo> {
        (0..layers)
            .flat_map(|_| {
                [
                    GroupInfo::dense(GroupKind::Attn, 10_000_000),
                    GroupInfo {
                        kind: GroupKind::Ffn,
                        bytes: 371_000_000,
                        experts: Some(Experts {
                            bytes: 370_000_000,
                            n_expert: 128,
                            n_used: 8,
                            hot: 0.0,
                            popularity: None,
                            cpu_scale: [1.0; 2],
                        }),
                    },
                ]
            })
            .collect()
    }

    /// A hybrid plan keeping host copies of `host`, all of tier 0, whose
    /// steps with whole CPU groups take `cpu_groups` of them and `whole_s`.
    fn hybrid(host: &[bool], cpu_groups: usize, whole_s: f64) -> HybridPlan {
        let size = super::super::hybrid::SizePlan {
            cpu_groups,
            tier: 0,
            fill: false,
            cpu_bytes: 0,
            predicted: Prediction {
                cpu_s: whole_s,
                ..Prediction::default()
            },
            carry: false,
        };
        HybridPlan {
            host: host.to_vec(),
            tier: vec![0; host.len()],
            host_bytes: 0,
            per_size: vec![size; MAX_TOKENS as usize],
            split: None,
        }
    }

    fn cpu_at(gb_s: f64) -> CpuInput {
        // the same speed at every step size, per byte read
        CpuInput {
            s_per_byte_n: 1e-9 / gb_s,
            ..cpu(1e-9 / gb_s)
        }
    }

    #[test]
    fn a_cpu_half_the_bus_takes_about_a_third_of_the_experts() {
        let g = mixture(8);
        let streamed = vec![true; g.len()];
        let c = cpu_at(25.0);
        let h = hybrid(&streamed, 0, f64::INFINITY);
        let p = plan_split(&g, &streamed, &h, (3, 3), 50e9, &c, AUTO).expect("a plan");
        assert_eq!(p.at(31), None, "below the fewest tokens");
        let k = p.at(64).expect("64 tokens split");
        // balance: (128 - k) / 25 = k / 50 -> k = 85
        assert!((75..=95).contains(&k), "{k}");
        // faster than the bus carrying every expert
        let bus = simulate(&g, &vec![Where::Bus; g.len()], (3, 3), 50e9, &c, 64).step_s();
        let split = p.per_size[63].predicted.step_s();
        assert!(split < 0.8 * bus, "{split} against {bus}");
    }

    #[test]
    fn the_device_takes_the_most_picked_experts_where_counts_order_them() {
        let order = [2, 0, 3, 1];
        assert_eq!(
            device_experts(Some(&order), 4, 2),
            [true, false, true, false]
        );
        assert_eq!(device_experts(Some(&order), 4, 9), [true; 4]);
        // no counts, or counts of another shape: the first experts
        assert_eq!(device_experts(None, 4, 1), [true, false, false, false]);
        assert_eq!(
            device_experts(Some(&[1, 0]), 4, 1),
            [true, false, false, false]
        );
        assert_eq!(device_experts(None, 4, 0), [false; 4]);
    }

    #[test]
    fn auto_keeps_whole_groups_where_they_are_faster() {
        let g = mixture(4);
        let streamed = vec![true; g.len()];
        let h = hybrid(&streamed, 0, 0.0);
        let p = plan_split(&g, &streamed, &h, (3, 3), 50e9, &cpu_at(25.0), AUTO).expect("a plan");
        assert!((1..=MAX_TOKENS).all(|n| p.at(n).is_none()));
    }

    #[test]
    fn off_or_nothing_to_split_is_no_plan() {
        let g = mixture(4);
        let streamed = vec![true; g.len()];
        let off = SplitInput::default();
        assert_eq!(off.mode, ExpertSplit::Off);
        let c = cpu_at(25.0);
        let h = hybrid(&streamed, 0, 1.0);
        assert!(plan_split(&g, &streamed, &h, (3, 3), 50e9, &c, off).is_none());
        // no host copies
        let none = hybrid(&vec![false; g.len()], 0, 1.0);
        let s = AUTO;
        assert!(plan_split(&g, &streamed, &none, (3, 3), 50e9, &c, s).is_none());
        // dense groups do not split
        let d = super::super::testutil::layers(4, 10, 100);
        assert!(plan_split(&d, &streamed, &h, (3, 3), 50e9, &c, s).is_none());
    }

    proptest! {
        /// Forced splits keep the device's experts within the layer and
        /// split exactly the streamed mixture groups with host copies, from
        /// the fewest tokens up; the predicted step never exceeds the bus
        /// carrying those groups plus the CPU computing them whole.
        #[test]
        fn forced_splits_are_well_formed(
            layers in 1usize..12,
            k in 0u32..300,
            min_tokens in 0u32..80,
            whole in proptest::option::of(0u32..30),
            streamed_mask in proptest::collection::vec(any::<bool>(), 24),
            host_mask in proptest::collection::vec(any::<bool>(), 24),
        ) {
            let g = mixture(layers);
            let streamed: Vec<bool> = (0..g.len()).map(|i| streamed_mask[i % 24]).collect();
            // the host keeps copies of streamed groups only
            let host: Vec<bool> = (0..g.len()).map(|i| host_mask[i % 24] && streamed[i]).collect();
            let s = SplitInput { mode: ExpertSplit::Force(k), min_tokens, whole };
            let c = cpu_at(25.0);
            let mut h = hybrid(&host, 0, 0.0);
            let p = plan_split(&g, &streamed, &h, (3, 3), 50e9, &c, s);
            let any = (0..g.len()).any(|i| streamed[i] && host[i] && g[i].experts.is_some());
            prop_assert_eq!(p.is_some(), any);
            if let Some(p) = p {
                for i in 0..g.len() {
                    prop_assert_eq!(p.groups[i], streamed[i] && host[i] && g[i].experts.is_some());
                }
                h.split = Some(p.clone());
                let n_host = host.iter().filter(|h| **h).count();
                for n in 1..=MAX_TOKENS {
                    match p.at(n) {
                        Some(d) => {
                            prop_assert!(n >= min_tokens.max(2));
                            prop_assert!((1..128).contains(&d));
                            // the whole groups asked for (as many as the
                            // host holds), host groups all; the split's
                            // other groups split
                            let cpu = h.cpu_groups(n);
                            let want = (whole.unwrap_or(0) as usize).min(n_host);
                            prop_assert_eq!(cpu.iter().filter(|c| **c).count(), want);
                            let at = h.placement(n, &streamed);
                            for i in 0..g.len() {
                                prop_assert!(!cpu[i] || host[i]);
                                let expect = if cpu[i] {
                                    Where::Cpu
                                } else if p.groups[i] {
                                    Where::Split(d)
                                } else if streamed[i] {
                                    Where::Bus
                                } else {
                                    Where::Resident
                                };
                                prop_assert_eq!(at[i], expect);
                            }
                        }
                        None => {
                            prop_assert!(n < min_tokens.max(2));
                            // below the split a step is the hybrid's (no
                            // CPU groups in this one)
                            prop_assert!(h.cpu_groups(n).iter().all(|c| !c));
                        }
                    }
                }
            }
        }
    }
}
