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
use super::hybrid::{simulate, split_placement, CpuInput, Prediction, MAX_TOKENS};
pub use super::hybrid::{ExpertSplit, SplitInput, SplitPlan, SplitSize};

/// Plans the split: `host` marks the groups the host keeps a copy of,
/// `whole` is the step the hybrid plan predicts at each size with whole
/// CPU groups (the split must beat it under `ExpertSplit::Auto`).
#[allow(clippy::too_many_arguments)]
pub fn plan_split(
    groups: &[GroupInfo],
    streamed: &[bool],
    host: &[bool],
    slots: (usize, usize),
    copy_bw: f64,
    c: &CpuInput,
    s: SplitInput,
    whole: impl Fn(u32) -> f64,
) -> Option<SplitPlan> {
    let split: Vec<bool> = (0..groups.len())
        .map(|i| host[i] && streamed[i] && groups[i].experts.is_some())
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
    let eval = |n: u32, k: u32| {
        let at = split_placement(streamed, &split, k);
        simulate(groups, &at, slots, copy_bw, c, n)
    };
    let per_size = (1..=MAX_TOKENS)
        .map(|n| {
            let none = SplitSize {
                dev_experts: 0,
                predicted: Prediction::default(),
            };
            if n < s.min_tokens.max(2) {
                return none;
            }
            match s.mode {
                ExpertSplit::Force(k) => {
                    let k = k.clamp(1, n_expert - 1);
                    SplitSize {
                        dev_experts: k,
                        predicted: eval(n, k),
                    }
                }
                _ => {
                    let (k, p) = (1..n_expert)
                        .map(|k| (k, eval(n, k)))
                        .min_by(|a, b| a.1.step_s().total_cmp(&b.1.step_s()))
                        .expect("n_expert >= 2");
                    if p.step_s() < whole(n) {
                        SplitSize {
                            dev_experts: k,
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
        let p = plan_split(&g, &streamed, &streamed, (3, 3), 50e9, &c, AUTO, |_| {
            f64::INFINITY
        })
        .expect("a plan");
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
        let p = plan_split(
            &g,
            &streamed,
            &streamed,
            (3, 3),
            50e9,
            &cpu_at(25.0),
            AUTO,
            |_| 0.0,
        )
        .expect("a plan");
        assert!((1..=MAX_TOKENS).all(|n| p.at(n).is_none()));
    }

    #[test]
    fn off_or_nothing_to_split_is_no_plan() {
        let g = mixture(4);
        let streamed = vec![true; g.len()];
        let off = SplitInput::default();
        assert_eq!(off.mode, ExpertSplit::Off);
        let c = cpu_at(25.0);
        assert!(plan_split(&g, &streamed, &streamed, (3, 3), 50e9, &c, off, |_| 1.0).is_none());
        // no host copies
        let none = vec![false; g.len()];
        let s = AUTO;
        assert!(plan_split(&g, &streamed, &none, (3, 3), 50e9, &c, s, |_| 1.0).is_none());
        // dense groups do not split
        let d = super::super::testutil::layers(4, 10, 100);
        assert!(plan_split(&d, &streamed, &streamed, (3, 3), 50e9, &c, s, |_| 1.0).is_none());
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
            streamed_mask in proptest::collection::vec(any::<bool>(), 24),
            host_mask in proptest::collection::vec(any::<bool>(), 24),
        ) {
            let g = mixture(layers);
            let streamed: Vec<bool> = (0..g.len()).map(|i| streamed_mask[i % 24]).collect();
            let host: Vec<bool> = (0..g.len()).map(|i| host_mask[i % 24]).collect();
            let s = SplitInput { mode: ExpertSplit::Force(k), min_tokens };
            let c = cpu_at(25.0);
            let p = plan_split(&g, &streamed, &host, (3, 3), 50e9, &c, s, |_| 0.0);
            let any = (0..g.len()).any(|i| streamed[i] && host[i] && g[i].experts.is_some());
            prop_assert_eq!(p.is_some(), any);
            if let Some(p) = p {
                for i in 0..g.len() {
                    prop_assert_eq!(p.groups[i], streamed[i] && host[i] && g[i].experts.is_some());
                }
                for n in 1..=MAX_TOKENS {
                    match p.at(n) {
                        Some(d) => {
                            prop_assert!(n >= min_tokens.max(2));
                            prop_assert!((1..128).contains(&d));
                        }
                        None => prop_assert!(n < min_tokens.max(2)),
                    }
                }
            }
        }
    }
}
