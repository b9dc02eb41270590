//! Hot experts: the most picked experts of a mixture's streamed layers kept
//! resident on the GPU (issue 31). Plain Rust.
//!
//! A step of a few tokens reads only the experts its tokens were routed
//! to. Where the host CPU computes a streamed mixture layer in a step of
//! at most [`HOT_MAX_TOKENS`] (hybrid decode) or the layer's experts are
//! split between the two (see `paging::split`), the picks of a hot expert
//! go to the GPU instead,
//! which computes them from its resident copy while the CPU computes the
//! others' picks; the results are summed with the router's weights. Real
//! routers are skewed, so a few experts per layer catch a large share of
//! the picks: each hot expert takes more CPU work off the step than a
//! byte of a whole resident group would.
//!
//! Which experts: the most picked of each layer in the router counts
//! persisted beside the model (`routing::RouterCounts`, written by
//! `--expert-stats`). `Auto` keeps a layer's hot set only where the counts
//! are skewed: the smallest set of at least `n_used` experts that caught
//! [`AUTO_SHARE`] of the layer's picks, where that is at most a quarter of
//! its experts (uniform routing needs two thirds of them). The share is
//! high because a hot layer costs a fixed 0.15-0.2 ms more than a whole
//! CPU group (a second host graph, the device's round trip): on an H100,
//! Qwen3-30B-A3B shape, sets catching 41% of the decode picks made decode
//! 0.85x, sets catching 65% 1.16x (docs/device-runs.md, runs 50-52).
//! `Force(k)` keeps `k` in every eligible
//! layer (the lowest-numbered where nothing was counted). Either way the
//! pool stays within the budget given, layers with the most picks per byte
//! first.

use super::groups::GroupInfo;
use super::routing::RouterCounts;

/// The share of a layer's counted picks `Auto`'s hot set must catch.
pub const AUTO_SHARE: f64 = 2.0 / 3.0;

/// The largest step whose host-computed layers send their hot picks to
/// the device. Above it the host computes whole groups as without hot
/// experts: its per-pick rows are slower than the whole group's product
/// once a step has many tokens (measured on an H100, run 50: at 64
/// sequences the per-pick rows made the step 1.6x slower), and a step
/// of many tokens picks nearly every expert anyway.
pub const HOT_MAX_TOKENS: u32 = 16;

/// How many experts per streamed mixture layer stay on the GPU.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HotExperts {
    #[default]
    Off,
    /// Where the router counts show skew (see the module notes).
    Auto,
    /// `k` per eligible layer (at least the experts a token uses).
    Force(u32),
}

/// The hot set of every group (empty: none), and what it costs and
/// should catch.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HotPlan {
    /// Per group index: its hot experts, ascending.
    pub sets: Vec<Vec<u32>>,
    /// Per group index: the share of its picks its hot set should take
    /// (from the counts; without them, the set's share of the experts).
    pub hit: Vec<f64>,
    /// Device bytes of every hot expert's weights.
    pub bytes: u64,
    /// The share of the counted picks of the layers with a hot set that
    /// landed in it (None: nothing counted).
    pub expected_hit: Option<f64>,
}

impl HotPlan {
    pub fn is_empty(&self) -> bool {
        self.sets.iter().all(|s| s.is_empty())
    }
    /// Groups with a hot set.
    pub fn n_groups(&self) -> usize {
        self.sets.iter().filter(|s| !s.is_empty()).count()
    }
    /// Hot experts over every group.
    pub fn n_experts(&self) -> usize {
        self.sets.iter().map(|s| s.len()).sum()
    }
    /// The compact index of `expert` in group `gi`'s hot tensors.
    pub fn slot_of(&self, gi: usize, expert: u32) -> Option<u32> {
        self.sets
            .get(gi)?
            .binary_search(&expert)
            .ok()
            .map(|i| i as u32)
    }
}

/// Device bytes of one expert of `g` (its share of the expert tensors).
pub fn expert_bytes(g: &GroupInfo) -> u64 {
    g.experts
        .map_or(0, |x| x.bytes.div_ceil(x.n_expert.max(1) as u64))
}

/// Alignment slack per hot group: three tensors, each padded by the
/// allocator.
pub const GROUP_SLACK: u64 = 3 * 512;

/// Chooses the hot experts of the `eligible` groups (streamed mixture FFN
/// groups the host keeps a copy of). `counts` is indexed by the model's
/// layer (group index / 2). The pool's bytes never exceed `budget`.
pub fn plan_hot(
    groups: &[GroupInfo],
    eligible: &[bool],
    counts: Option<&RouterCounts>,
    mode: HotExperts,
    budget: u64,
) -> HotPlan {
    let mut plan = HotPlan {
        sets: vec![Vec::new(); groups.len()],
        hit: vec![0.0; groups.len()],
        ..HotPlan::default()
    };
    if mode == HotExperts::Off {
        return plan;
    }
    // candidates: (group, set, picks caught, picks counted)
    let mut cand: Vec<(usize, Vec<u32>, u64, u64)> = Vec::new();
    for (gi, g) in groups.iter().enumerate() {
        let Some(x) = g.experts else { continue };
        if !eligible.get(gi).copied().unwrap_or(false) || x.n_expert < 2 {
            continue;
        }
        let n = x.n_expert;
        let used = x.n_used.clamp(1, n - 1);
        let layer = gi / 2;
        let counted = counts
            .filter(|c| layer < c.n_layer() && c.n_expert() == n as usize)
            .filter(|c| c.layer_picks(layer) > 0);
        let order: Vec<u32> = match counted {
            Some(c) => c.hot(layer, n as usize),
            None => (0..n).collect(),
        };
        let k = match mode {
            HotExperts::Off => unreachable!("returned above"),
            HotExperts::Force(k) => k.clamp(used, n - 1) as usize,
            HotExperts::Auto => {
                let Some(c) = counted else { continue };
                let total = c.layer_picks(layer);
                let mut caught = 0u64;
                let mut k = 0usize;
                for &e in &order {
                    if k >= used as usize && caught as f64 >= AUTO_SHARE * total as f64 {
                        break;
                    }
                    caught += c.count(layer, e as usize);
                    k += 1;
                }
                if 4 * k > n as usize {
                    continue;
                }
                k
            }
        };
        let mut set: Vec<u32> = order[..k].to_vec();
        let (caught, total) = match counted {
            Some(c) => (
                set.iter().map(|&e| c.count(layer, e as usize)).sum(),
                c.layer_picks(layer),
            ),
            None => (0, 0),
        };
        set.sort_unstable();
        cand.push((gi, set, caught, total));
    }
    // the most picks caught per byte first (equal: layer order)
    let cost = |gi: usize, k: usize| k as u64 * expert_bytes(&groups[gi]) + GROUP_SLACK;
    cand.sort_by(|a, b| {
        let ra = a.2 as f64 / cost(a.0, a.1.len()) as f64;
        let rb = b.2 as f64 / cost(b.0, b.1.len()) as f64;
        rb.total_cmp(&ra).then(a.0.cmp(&b.0))
    });
    let (mut caught, mut total) = (0u64, 0u64);
    for (gi, set, c, t) in cand {
        let b = cost(gi, set.len());
        if plan.bytes + b > budget {
            continue;
        }
        plan.bytes += b;
        caught += c;
        total += t;
        plan.hit[gi] = if t > 0 {
            c as f64 / t as f64
        } else {
            set.len() as f64 / groups[gi].experts.map_or(1, |x| x.n_expert) as f64
        };
        plan.sets[gi] = set;
    }
    plan.expected_hit = (total > 0).then(|| caught as f64 / total as f64);
    plan
}

/// How much more of a layer's counted picks a refreshed hot set must catch
/// than the set the device holds before it replaces it (a changed set is
/// copied to the device whole).
pub const REFRESH_GAIN: f64 = 0.05;

/// The hot sets `plan`'s pool should hold now that `counts` (every pick
/// counted, by the model's layer, group index / 2) say more: each group
/// keeps its set's size, so the pool's bytes and graphs stay, and takes
/// its layer's most picked experts where they catch at least
/// [`REFRESH_GAIN`] more of the layer's picks than its set does. Between
/// requests, never inside a step. Returns the new plan and the groups
/// whose set changed, ascending.
pub fn refresh_hot(plan: &HotPlan, counts: &RouterCounts) -> (HotPlan, Vec<usize>) {
    let mut next = plan.clone();
    let mut changed = Vec::new();
    let (mut caught, mut total) = (0u64, 0u64);
    for (gi, set) in plan.sets.iter().enumerate() {
        let layer = gi / 2;
        if set.is_empty() || layer >= counts.n_layer() {
            continue;
        }
        let t = counts.layer_picks(layer);
        if t == 0 {
            continue;
        }
        let catch = |s: &[u32]| -> u64 { s.iter().map(|&e| counts.count(layer, e as usize)).sum() };
        let mut best = counts.hot(layer, set.len());
        best.sort_unstable();
        let (now, then) = (catch(set), catch(&best));
        let pick = if then as f64 >= now as f64 + REFRESH_GAIN * t as f64 {
            changed.push(gi);
            next.sets[gi] = best;
            then
        } else {
            now
        };
        next.hit[gi] = pick as f64 / t as f64;
        caught += pick;
        total += t;
    }
    if total > 0 {
        next.expected_hit = Some(caught as f64 / total as f64);
    }
    (next, changed)
}

#[cfg(test)]
mod tests {
    use super::super::groups::Experts;
    use super::*;
    use crate::model::GroupKind;
    use proptest::prelude::*;

    fn mixture(layers: usize, n_expert: u32, n_used: u32) -> Vec<GroupInfo> {
        (0..layers)
            .flat_map(|_| {
                [
                    GroupInfo::dense(GroupKind::Attn, 1000),
                    GroupInfo {
                        kind: GroupKind::Ffn,
                        bytes: 100 + 1000 * n_expert as u64,
                        experts: Some(Experts {
                            bytes: 1000 * n_expert as u64,
                            n_expert,
                            n_used,
                            hot: 0.0,
                            popularity: None,
                            cpu_scale: [1.0; 2],
                        }),
                    },
                ]
            })
            .collect()
    }

    fn ffn_eligible(groups: &[GroupInfo]) -> Vec<bool> {
        groups.iter().map(|g| g.experts.is_some()).collect()
    }

    /// Counts with expert e of every layer picked about 1/(e+1) as often
    /// (Zipf), or uniformly.
    fn counts(layers: usize, n_expert: usize, n_used: usize, zipf: bool) -> RouterCounts {
        let mut c = RouterCounts::new(layers, n_expert, n_used);
        for l in 0..layers {
            for t in 0..400usize {
                // n_used distinct experts a token
                let mut ids: Vec<i32> = Vec::new();
                let mut j = 0usize;
                while ids.len() < n_used {
                    let e = if zipf {
                        // 0 in most tokens, then 1, 2, ... rarer
                        let r = (t * 7 + j * 13) % 64;
                        match r {
                            0..=39 => 0,
                            40..=51 => 1,
                            52..=57 => 2,
                            _ => 3 + (t + j) % (n_expert - 3),
                        }
                    } else {
                        (t * n_used + j) % n_expert
                    };
                    if !ids.contains(&(e as i32)) {
                        ids.push(e as i32);
                    }
                    j += 1;
                }
                c.add(l, &ids).unwrap();
            }
        }
        c
    }

    #[test]
    fn auto_keeps_skewed_layers_and_skips_uniform_ones() {
        let g = mixture(4, 16, 2);
        let el = ffn_eligible(&g);
        let skewed = counts(4, 16, 2, true);
        let p = plan_hot(&g, &el, Some(&skewed), HotExperts::Auto, u64::MAX);
        assert_eq!(p.n_groups(), 4);
        for gi in (1..8).step_by(2) {
            // expert 0 is in most tokens: always hot
            assert!(p.slot_of(gi, 0).is_some(), "{:?}", p.sets[gi]);
            assert!(p.sets[gi].len() >= 2 && p.sets[gi].len() <= 4);
        }
        assert!(p.expected_hit.unwrap() >= 0.5);
        let uniform = counts(4, 16, 2, false);
        let p = plan_hot(&g, &el, Some(&uniform), HotExperts::Auto, u64::MAX);
        assert!(p.is_empty(), "{:?}", p.sets);
        // nothing counted: auto keeps nothing, force the first experts
        assert!(plan_hot(&g, &el, None, HotExperts::Auto, u64::MAX).is_empty());
        let f = plan_hot(&g, &el, None, HotExperts::Force(3), u64::MAX);
        assert_eq!(f.sets[1], vec![0, 1, 2]);
        assert_eq!(f.expected_hit, None);
        assert_eq!(f.slot_of(1, 2), Some(2));
        assert_eq!(f.slot_of(1, 5), None);
    }

    #[test]
    fn force_takes_the_most_picked_and_at_least_a_tokens_experts() {
        let g = mixture(2, 16, 2);
        let el = ffn_eligible(&g);
        let c = counts(2, 16, 2, true);
        let p = plan_hot(&g, &el, Some(&c), HotExperts::Force(1), u64::MAX);
        // clamped up to n_used
        assert_eq!(p.sets[1], vec![0, 1]);
        let p = plan_hot(&g, &el, Some(&c), HotExperts::Force(99), u64::MAX);
        assert_eq!(p.sets[1].len(), 15);
        assert_eq!(plan_hot(&g, &el, Some(&c), HotExperts::Off, u64::MAX), {
            HotPlan {
                sets: vec![Vec::new(); 4],
                hit: vec![0.0; 4],
                ..HotPlan::default()
            }
        });
    }

    #[test]
    fn a_small_budget_keeps_fewer_layers() {
        let g = mixture(4, 16, 2);
        let el = ffn_eligible(&g);
        let one = 4 * expert_bytes(&g[1]) + GROUP_SLACK;
        let p = plan_hot(&g, &el, None, HotExperts::Force(4), 2 * one + 1);
        assert_eq!(p.n_groups(), 2);
        assert_eq!(p.bytes, 2 * one);
        assert!(plan_hot(&g, &el, None, HotExperts::Force(4), one - 1).is_empty());
        let mut only_first = vec![false; 8];
        only_first[1] = true;
        let p = plan_hot(&g, &only_first, None, HotExperts::Force(4), u64::MAX);
        assert_eq!(p.n_groups(), 1);
    }

    #[test]
    fn refresh_moves_a_set_to_the_most_picked_experts() {
        let g = mixture(2, 16, 2);
        let el = ffn_eligible(&g);
        // forced without counts: experts 0-3 of each layer
        let p = plan_hot(&g, &el, None, HotExperts::Force(4), u64::MAX);
        assert_eq!(p.sets[1], vec![0, 1, 2, 3]);
        // then the router picks 12-15 in layer 0, 0-3 in layer 1
        let mut c = RouterCounts::new(2, 16, 2);
        for _ in 0..50 {
            c.add(0, &[12, 13, 14, 15]).unwrap();
            c.add(1, &[0, 1, 2, 3]).unwrap();
        }
        let (r, changed) = refresh_hot(&p, &c);
        assert_eq!(changed, vec![1]);
        assert_eq!(r.sets[1], vec![12, 13, 14, 15]);
        assert_eq!(r.sets[3], p.sets[3]);
        assert_eq!(r.bytes, p.bytes);
        assert_eq!((r.hit[1], r.hit[3]), (1.0, 1.0));
        assert_eq!(r.expected_hit, Some(1.0));
        // again: nothing to move
        let (r2, changed) = refresh_hot(&r, &c);
        assert!(changed.is_empty());
        assert_eq!(r2, r);
        // a gain under REFRESH_GAIN moves nothing
        let mut d = RouterCounts::new(2, 16, 2);
        for i in 0..100 {
            let x = if i < 52 { [4, 5] } else { [0, 1] };
            d.add(0, &x).unwrap();
        }
        let near = plan_hot(&g, &el, None, HotExperts::Force(2), u64::MAX);
        let (_, changed) = refresh_hot(&near, &d);
        assert!(changed.is_empty(), "{changed:?}");
    }

    proptest! {
        /// A refresh keeps every set's size and the pool's bytes, keeps
        /// each set valid, never catches fewer of the counted picks than
        /// before, and a second refresh with the same counts moves
        /// nothing.
        #[test]
        fn refresh_keeps_the_pool_and_never_loses_picks(
            layers in 1usize..5,
            n_expert in 3u32..24,
            k in 1u32..12,
            picks in proptest::collection::vec((0usize..5, 0usize..24), 0..300),
        ) {
            let g = mixture(layers, n_expert, 1);
            let el = ffn_eligible(&g);
            let p = plan_hot(&g, &el, None, HotExperts::Force(k), u64::MAX);
            let mut c = RouterCounts::new(layers, n_expert as usize, 1);
            for &(l, e) in &picks {
                c.add(l % layers, &[(e % n_expert as usize) as i32]).unwrap();
            }
            let (r, changed) = refresh_hot(&p, &c);
            prop_assert_eq!(r.bytes, p.bytes);
            for (gi, (a, b)) in p.sets.iter().zip(&r.sets).enumerate() {
                prop_assert_eq!(a.len(), b.len());
                prop_assert!(b.windows(2).all(|w| w[0] < w[1]));
                prop_assert!(b.iter().all(|&e| e < n_expert));
                prop_assert_eq!(a != b, changed.contains(&gi));
                let catch = |s: &[u32]| -> u64 { s.iter().map(|&e| c.count(gi / 2, e as usize)).sum() };
                prop_assert!(catch(b) >= catch(a));
            }
            let (_, again) = refresh_hot(&r, &c);
            prop_assert!(again.is_empty());
        }
    }

    proptest! {
        /// Within the budget; only eligible mixture groups; every expert
        /// at most once, in range, ascending; a set holds at least a
        /// token's experts and leaves one to the host.
        #[test]
        fn hot_sets_are_valid_and_within_budget(
            layers in 1usize..6,
            n_expert in 2u32..40,
            n_used in 1u32..9,
            k in 0u32..48,
            auto in any::<bool>(),
            budget_k in 0u64..200,
            elig in proptest::collection::vec(any::<bool>(), 12),
            picks in proptest::collection::vec(0usize..40, 0..400),
        ) {
            let n_used = n_used.min(n_expert);
            let g = mixture(layers, n_expert, n_used);
            let el: Vec<bool> = (0..g.len()).map(|i| elig[i % 12]).collect();
            let mut c = RouterCounts::new(layers, n_expert as usize, 1);
            for (i, &e) in picks.iter().enumerate() {
                c.add(i % layers, &[(e % n_expert as usize) as i32]).unwrap();
            }
            let budget = budget_k * 1000;
            let mode = if auto { HotExperts::Auto } else { HotExperts::Force(k) };
            let p = plan_hot(&g, &el, Some(&c), mode, budget);
            prop_assert!(p.bytes <= budget);
            let mut bytes = 0;
            for (gi, s) in p.sets.iter().enumerate() {
                if s.is_empty() { continue; }
                prop_assert!(el[gi] && g[gi].experts.is_some());
                prop_assert!(s.windows(2).all(|w| w[0] < w[1]));
                prop_assert!(s.iter().all(|&e| e < n_expert));
                prop_assert!(s.len() as u32 >= n_used.min(n_expert - 1));
                prop_assert!((s.len() as u32) < n_expert);
                bytes += s.len() as u64 * expert_bytes(&g[gi]) + GROUP_SLACK;
            }
            prop_assert_eq!(bytes, p.bytes);
            for (gi, &h) in p.hit.iter().enumerate() {
                prop_assert!((0.0..=1.0).contains(&h));
                prop_assert_eq!(h > 0.0 || p.sets[gi].is_empty() || c.layer_picks(gi / 2) > 0, true);
            }
            if let Some(h) = p.expected_hit {
                prop_assert!((0.0..=1.0).contains(&h));
            }
        }
    }
}
