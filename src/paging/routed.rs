//! Routed uploads: a streamed mixture layer whose experts go up over the
//! bus only if a token of the step picked them. Plain Rust.
//!
//! A step of many tokens on the GPU streams each mixture layer's expert
//! group whole, but its tokens pick only some of the experts: with
//! skewed routing, 64 tokens picking 8 of 128 experts each touch about
//! 78% of a layer's experts (Zipf-1 popularity, computed), and 16 tokens
//! under uniform routing about 64%. llama.cpp's scheduler copies only the
//! picked experts of a host-side expert tensor, which put it ahead of
//! whole-group streaming at 64 skewed sequences (run 95).
//!
//! The picks are known only once the layer's router ran on the layer's
//! input, so a routed group goes up in two parts:
//! - ahead, as every streamed group does (the ring's window): its other
//!   weights (norm, router) and the experts the step's tokens are all but
//!   sure to pick ([`SURE`]); those keep the bus busy while the device
//!   computes;
//! - after the router: the picked experts not sent ahead.
//!
//! Experts no token picked never go up; the slot keeps whatever it held
//! there, which nothing reads (ggml's expert products read only the
//! experts their ids name).
//!
//! A routed group costs the layer a round trip: the device drains to hand
//! the picks to the host, and the upload after the router starts only
//! then, so the bus idles while the device computes the layer
//! ([`layer_cost_s`]). `auto` routes a group only where the bytes it
//! expects to save take longer on the bus than that, and only in steps
//! the host CPU takes no part in: there the bus carries uploads while
//! the CPU computes its groups, and an upload after a router would wait
//! in the layer chain instead (16 sequences on an H100, hybrid: 0.85x,
//! run 131).

use super::routing::RouterCounts;
use std::collections::HashMap;

/// Whether streamed mixture layers upload only their picked experts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum RoutedUploads {
    /// Every expert group whole (the ring's uploads).
    Off,
    /// The groups whose expected saving beats a layer's round trip, on a
    /// GPU.
    #[default]
    Auto,
    /// Every streamed mixture group of a step of at least two tokens that
    /// the device computes (tests, benchmarks).
    Force,
}

/// A pick chance at or above which an expert goes up ahead of the router.
pub const SURE: f64 = 0.9;

/// What routing a group costs its layer beyond the bytes at a step of
/// `n_tokens`: the device's drain for the picks, the host's read of them
/// and its many small copies, and the bus idle while the device computes
/// the layer's router and products, which take longer at larger steps.
/// Measured on an H100 (Qwen3-30B-A3B shape at 8G, the step against the
/// bytes it sent at the bus's rate): 0.45-0.52 ms a routed group at 8 and
/// 16 sequences (run 133), 0.73-0.93 ms at 64 (run 131); linear between.
pub fn layer_cost_s(n_tokens: u32) -> f64 {
    let (few, many) = (0.5e-3, 0.9e-3);
    let f = ((f64::from(n_tokens) - 16.0) / 48.0).clamp(0.0, 1.0);
    few + (many - few) * f
}

/// The share of a layer's experts that routed steps actually picked, by
/// layer and step size (rounded up to a power of two), each a running
/// mean of the last steps': the chances from router counts assume tokens
/// pick independently, and overestimated what 64 sequences skip by about
/// twice with skewed routing (run 131); once a layer was routed at a
/// size, its own steps say.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Coverage {
    seen: std::collections::HashMap<(usize, u32), f64>,
}

impl Coverage {
    fn key(layer: usize, n_tokens: u32) -> (usize, u32) {
        (layer, n_tokens.max(1).next_power_of_two())
    }

    /// A routed step of `n_tokens` picked `picked` of `layer`'s `n_expert`.
    pub fn observe(&mut self, layer: usize, n_tokens: u32, picked: usize, n_expert: usize) {
        let x = picked.min(n_expert) as f64 / n_expert.max(1) as f64;
        self.seen
            .entry(Self::key(layer, n_tokens))
            .and_modify(|m| *m = 0.75 * *m + 0.25 * x)
            .or_insert(x);
    }

    /// The share seen at this size, if any step of it was routed.
    pub fn get(&self, layer: usize, n_tokens: u32) -> Option<f64> {
        self.seen.get(&Self::key(layer, n_tokens)).copied()
    }
}

/// Per expert of `layer`, the chance that at least one of `n_tokens`
/// tokens picks it: each token picks expert `e` with probability
/// `q_e = n_used * (c_e + 1) / (C + n_expert)` (the layer's counts `c`,
/// `C` their sum; one pick added to each, so that without counts every
/// expert has `n_used / n_expert`), tokens independent.
pub fn pick_chances(
    counts: Option<&RouterCounts>,
    layer: usize,
    n_expert: usize,
    n_used: usize,
    n_tokens: u32,
) -> Vec<f64> {
    let row: Vec<u64> = match counts.filter(|c| layer < c.n_layer() && c.n_expert() == n_expert) {
        Some(c) => (0..n_expert).map(|e| c.count(layer, e)).collect(),
        None => vec![0; n_expert],
    };
    let total: u64 = row.iter().sum();
    let denom = total as f64 + n_expert as f64;
    row.iter()
        .map(|&c| {
            let q = (n_used as f64 * (c as f64 + 1.0) / denom).clamp(0.0, 1.0);
            1.0 - (1.0 - q).powi(n_tokens.min(i32::MAX as u32) as i32)
        })
        .collect()
}

/// How one group goes up when routed.
#[derive(Clone, Debug, PartialEq)]
pub struct RoutedGroup {
    /// The experts uploaded ahead of the router, ascending.
    pub sure: Vec<u32>,
    /// The bytes the group is expected to carry: its other weights, the
    /// sure experts, and each other expert by its pick chance.
    pub expected_bytes: f64,
}

/// Decides one streamed mixture group: `chances` per expert (from
/// [`pick_chances`]), `seen` the share of its experts the routed steps
/// of this size picked ([`Coverage`]; it replaces the chances' sum where
/// there is one), `expert_bytes` each expert's weights (every expert
/// tensor's slice), `whole` the group's bytes, at a step of `n_tokens`.
/// None: it goes up whole.
pub fn choose(
    mode: RoutedUploads,
    n_tokens: u32,
    chances: &[f64],
    seen: Option<f64>,
    expert_bytes: u64,
    whole: u64,
    copy_bw: f64,
) -> Option<RoutedGroup> {
    if mode == RoutedUploads::Off || chances.is_empty() {
        return None;
    }
    let experts = expert_bytes as f64 * chances.len() as f64;
    let other = (whole as f64 - experts).max(0.0);
    let sure: Vec<u32> = (0..chances.len() as u32)
        .filter(|&e| chances[e as usize] >= SURE)
        .collect();
    let experts_up = match seen {
        Some(c) => (c * chances.len() as f64).max(sure.len() as f64),
        None => chances
            .iter()
            .map(|&p| if p >= SURE { 1.0 } else { p })
            .sum::<f64>(),
    };
    let expected_bytes = other + experts_up * expert_bytes as f64;
    let saved_s = (whole as f64 - expected_bytes) / copy_bw.max(1.0);
    let pays = saved_s > layer_cost_s(n_tokens) && sure.len() < chances.len();
    (mode == RoutedUploads::Force || pays).then_some(RoutedGroup {
        sure,
        expected_bytes,
    })
}

/// An engine's routed uploads: the mode, the counts it predicts from,
/// this step's groups, what its steps picked and sent.
#[derive(Clone, Debug)]
pub struct RoutedSteps {
    pub mode: RoutedUploads,
    /// Router counts persisted beside the model, read at load (None:
    /// none, or another model's); the online counts are added to them.
    pub prior: Option<RouterCounts>,
    /// This step's routed groups: by group index, the experts sent ahead.
    pub step: HashMap<usize, Vec<u32>>,
    /// What routed steps picked, by layer and size.
    pub seen: Coverage,
    pub stats: RoutedStats,
}

/// What a step's routed uploads did.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RoutedStats {
    /// Groups routed.
    pub groups: u64,
    /// Their bytes whole.
    pub whole_bytes: u64,
    /// The bytes the plan expected them to carry.
    pub expected_bytes: f64,
    /// The bytes they carried ahead of their routers, and after.
    pub ahead_bytes: u64,
    pub after_bytes: u64,
    /// Experts of theirs sent ahead of the routers, and sent after.
    pub ahead: u64,
    pub after: u64,
    /// Experts of theirs the steps' tokens picked.
    pub picked: u64,
    /// Steps routed whose plan had the host CPU compute groups: the
    /// routed step was predicted faster (`predicted_s`) than the hybrid
    /// one (`hybrid_s`), and ran instead.
    pub over_hybrid: u64,
    /// Routed steps predicted (the engine's `CpuCalibration::predict_routed`
    /// where it has one), and their predictions.
    pub predicted: u64,
    pub predicted_s: f64,
    pub hybrid_s: f64,
    /// The factor on the probe's CPU time each `hybrid_s` took (the
    /// calibration's, 1 before a hybrid step was seen).
    pub hybrid_factor: f64,
}

impl RoutedStats {
    pub fn add(&mut self, o: &RoutedStats) {
        self.groups += o.groups;
        self.whole_bytes += o.whole_bytes;
        self.expected_bytes += o.expected_bytes;
        self.ahead_bytes += o.ahead_bytes;
        self.after_bytes += o.after_bytes;
        self.ahead += o.ahead;
        self.after += o.after;
        self.picked += o.picked;
        self.over_hybrid += o.over_hybrid;
        self.predicted += o.predicted;
        self.predicted_s += o.predicted_s;
        self.hybrid_s += o.hybrid_s;
        self.hybrid_factor += o.hybrid_factor;
    }
}

impl RoutedSteps {
    pub fn new(mode: RoutedUploads, prior: Option<RouterCounts>) -> RoutedSteps {
        RoutedSteps {
            mode,
            prior,
            step: HashMap::new(),
            seen: Coverage::default(),
            stats: RoutedStats::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A Qwen3-30B-A3B-shaped layer: 128 experts of 2.9 MB, 8 a token, a
    /// 55 GB/s bus.
    const E: usize = 128;
    const BYTES: u64 = 2_900_000;
    const WHOLE: u64 = 128 * BYTES + 1_000_000;
    const BW: f64 = 55e9;

    fn zipf(layers: usize, tokens: u64) -> RouterCounts {
        let mut c = RouterCounts::new(layers, E, 8);
        let h: f64 = (1..=E).map(|r| 1.0 / r as f64).sum();
        for l in 0..layers {
            let ids: Vec<i32> = (0..E)
                .flat_map(|e| {
                    let n = (8.0 * tokens as f64 / ((e + 1) as f64 * h)).round() as usize;
                    std::iter::repeat_n(e as i32, n)
                })
                .collect();
            // whole tokens of 8 picks
            let n = ids.len() / 8 * 8;
            c.add(l, &ids[..n]).expect("counts");
        }
        c
    }

    #[test]
    fn without_counts_every_expert_has_its_share() {
        let p = pick_chances(None, 0, E, 8, 1);
        assert!(p.iter().all(|&x| (x - 8.0 / 128.0).abs() < 1e-12));
        // 64 tokens: 1 - (15/16)^64
        let p = pick_chances(None, 3, E, 8, 64);
        assert!((p[0] - 0.98386).abs() < 1e-4, "{}", p[0]);
    }

    #[test]
    fn uniform_routing_routes_small_steps_only() {
        let at = |n| {
            choose(
                RoutedUploads::Auto,
                n,
                &pick_chances(None, 0, E, 8, n),
                None,
                BYTES,
                WHOLE,
                BW,
            )
        };
        // 16 tokens touch about 64% of the experts: 2.4 ms saved a layer
        let g = at(16).expect("routed at 16 tokens");
        assert!(g.sure.is_empty());
        assert!((g.expected_bytes / WHOLE as f64 - 0.64).abs() < 0.01);
        // 64 tokens touch 98%: all sure, nothing to save
        assert_eq!(at(64), None);
        assert_eq!(at(2048), None);
        // forced, it routes with every expert sent ahead
        let f = choose(
            RoutedUploads::Force,
            64,
            &pick_chances(None, 0, E, 8, 64),
            None,
            BYTES,
            WHOLE,
            BW,
        )
        .expect("forced");
        assert_eq!(f.sure.len(), E);
        assert_eq!(
            choose(
                RoutedUploads::Off,
                1,
                &pick_chances(None, 0, E, 8, 1),
                None,
                BYTES,
                WHOLE,
                BW
            ),
            None
        );
    }

    #[test]
    fn skewed_routing_routes_64_tokens_and_sends_the_popular_ahead() {
        let c = zipf(2, 100_000);
        let p = pick_chances(Some(&c), 1, E, 8, 64);
        let g = choose(RoutedUploads::Auto, 64, &p, None, BYTES, WHOLE, BW).expect("routed");
        // the most picked experts first
        assert!(g.sure.contains(&0) && g.sure.contains(&20));
        assert!(!g.sure.contains(&127));
        let share = g.expected_bytes / WHOLE as f64;
        assert!((0.7..0.85).contains(&share), "{share}");
        // 2048 tokens pick every expert
        let p = pick_chances(Some(&c), 1, E, 8, 2048);
        assert_eq!(
            choose(RoutedUploads::Auto, 2048, &p, None, BYTES, WHOLE, BW),
            None
        );
    }

    #[test]
    fn what_routed_steps_picked_overrides_the_counts() {
        let c = zipf(2, 100_000);
        let p = pick_chances(Some(&c), 1, E, 8, 64);
        assert!(choose(RoutedUploads::Auto, 64, &p, None, BYTES, WHOLE, BW).is_some());
        // the steps picked 98% of the experts: nothing worth the wait
        assert_eq!(
            choose(RoutedUploads::Auto, 64, &p, Some(0.98), BYTES, WHOLE, BW),
            None
        );
        // 60% picked: routed, expecting 60% of the experts' bytes
        let g = choose(RoutedUploads::Auto, 64, &p, Some(0.6), BYTES, WHOLE, BW).expect("routed");
        let experts = (128 * BYTES) as f64;
        assert!((g.expected_bytes - 1e6 - 0.6 * experts).abs() < 1.0);
        let mut cov = Coverage::default();
        assert_eq!(cov.get(3, 64), None);
        cov.observe(3, 64, 64, 128);
        assert_eq!(cov.get(3, 64), Some(0.5));
        // 33 to 64 tokens share a size; a running mean
        cov.observe(3, 40, 128, 128);
        assert_eq!(cov.get(3, 50), Some(0.625));
        assert_eq!(cov.get(3, 16), None);
        assert_eq!(cov.get(2, 64), None);
    }

    #[test]
    fn counts_of_another_shape_are_ignored() {
        let c = zipf(2, 1000);
        assert_eq!(
            pick_chances(Some(&c), 5, E, 8, 4),
            pick_chances(None, 5, E, 8, 4)
        );
        assert_eq!(
            pick_chances(Some(&c), 0, 64, 8, 4),
            pick_chances(None, 0, 64, 8, 4)
        );
    }

    proptest! {
        /// Chances are probabilities, grow with the step, and a routed
        /// group never expects more than its whole bytes, nor sends ahead
        /// an expert below [`SURE`].
        #[test]
        fn chances_and_choices_are_consistent(
            counts in proptest::collection::vec(0u64..1000, 16),
            n in 1u32..4096,
            bytes in 1u64..10_000_000,
            other in 0u64..10_000_000,
        ) {
            let mut c = RouterCounts::new(1, 16, 2);
            let ids: Vec<i32> = counts.iter().enumerate()
                .flat_map(|(e, &k)| std::iter::repeat_n(e as i32, k as usize))
                .collect();
            c.add(0, &ids[..ids.len() / 2 * 2]).expect("counts");
            let p = pick_chances(Some(&c), 0, 16, 2, n);
            let p2 = pick_chances(Some(&c), 0, 16, 2, n + 1);
            for (a, b) in p.iter().zip(&p2) {
                prop_assert!((0.0..=1.0).contains(a));
                prop_assert!(b >= a);
            }
            let whole = 16 * bytes + other;
            for mode in [RoutedUploads::Auto, RoutedUploads::Force] {
                if let Some(g) = choose(mode, n, &p, None, bytes, whole, BW) {
                    prop_assert!(g.expected_bytes <= whole as f64 + 1e-6);
                    prop_assert!(g.sure.iter().all(|&e| p[e as usize] >= SURE));
                    prop_assert!(g.sure.windows(2).all(|w| w[0] < w[1]));
                    if mode == RoutedUploads::Auto {
                        prop_assert!((whole as f64 - g.expected_bytes) / BW > layer_cost_s(n));
                    }
                }
            }
        }
    }
}
