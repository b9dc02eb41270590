//! What placement knows about one layer group, and sizes over groups.

use crate::model::GroupKind;

/// Where a group runs in a simulated step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Where {
    Resident,
    /// Uploaded into a slot of its kind's ring, computed by the GPU.
    Bus,
    Cpu,
    /// A mixture's FFN group whose first `k` experts are uploaded and
    /// computed by the GPU while the CPU computes the others (see
    /// `paging::split`).
    Split(u32),
    /// A streamed mixture FFN group whose experts go up only as far as a
    /// step's tokens picked them, carrying this many bytes over the bus
    /// (expected; `paging::routed`), computed by the GPU.
    Routed(u64),
}

/// What the planner knows about one layer group.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GroupInfo {
    pub kind: GroupKind,
    /// Bytes the group occupies in a slot (device alloc sizes, padded).
    pub bytes: u64,
    /// Routed experts among those bytes (a mixture-of-experts FFN group):
    /// a step computes only the experts its tokens chose.
    pub experts: Option<Experts>,
}

/// The routed experts of a group.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Experts {
    /// Bytes of all the experts' weights (the rest of the group, the router
    /// and norms, every token reads).
    pub bytes: u64,
    pub n_expert: u32,
    /// Experts each token is routed to.
    pub n_used: u32,
    /// The share of the picks the device's hot experts take where the host
    /// computes this group (`paging::experts`; 0: none): the CPU computes
    /// only the rest.
    pub hot: f64,
    /// How the picks spread over the experts, from router counts; None:
    /// uniformly.
    pub popularity: Option<Popularity>,
    /// The CPU's time on these experts against the probe's mean group of
    /// the same bytes, at one token and at the largest step it measured
    /// (`CpuInput::measured_tokens`); [1, 1]: as the mean. The kinds of
    /// matrix differ: in llama.cpp's Q4_K_M mix half the layers' `ffn_down`
    /// is Q6_K, which x86 does not repack, and such a layer ran 1.2x the
    /// time per byte of a Q4_K one at 64 tokens (run 182).
    pub cpu_scale: [f64; 2],
}

/// Bins of [`Popularity`].
pub const POPULARITY_BINS: usize = 16;

/// How a mixture layer's picks spread over its experts: the share of the
/// picks each sixteenth of the experts took, most picked first (from the
/// router counts kept beside the model). An expert split gives the device
/// the most picked experts (`paging::device_experts`), so with skewed
/// routing its share of the picks runs ahead of its share of the bytes,
/// and the CPU's rarely picked experts each have few rows.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Popularity(pub [f64; POPULARITY_BINS]);

impl Popularity {
    /// From one layer's counts per expert; None where nothing was counted.
    pub fn from_counts(row: &[u64]) -> Option<Popularity> {
        let total: u64 = row.iter().sum();
        if total == 0 {
            return None;
        }
        let mut sorted = row.to_vec();
        sorted.sort_unstable_by(|a, b| b.cmp(a));
        let n = sorted.len();
        let mut bins = [0.0; POPULARITY_BINS];
        for (r, &c) in sorted.iter().enumerate() {
            bins[r * POPULARITY_BINS / n] += c as f64 / total as f64;
        }
        Some(Popularity(bins))
    }

    /// The share of the picks of the expert of rank `r` among `n`: its
    /// bin's share over the ranks in the bin (those x with
    /// x * BINS / n == b, that is ceil(b n / BINS) <= x < ceil((b + 1) n / BINS)).
    fn share(&self, r: u32, n: u32) -> f64 {
        let n = n.max(1) as usize;
        let b = (r as usize * POPULARITY_BINS / n).min(POPULARITY_BINS - 1);
        let in_bin = ((b + 1) * n).div_ceil(POPULARITY_BINS) - (b * n).div_ceil(POPULARITY_BINS);
        self.0[b] / in_bin.max(1) as f64
    }
}

/// Sets each mixture group's [`Experts::cpu_scale`] (by group index).
pub fn set_cpu_scales(groups: &mut [GroupInfo], scales: &[[f64; 2]]) {
    for (g, &x) in groups.iter_mut().zip(scales) {
        if let Some(e) = g.experts.as_mut() {
            e.cpu_scale = x;
        }
    }
}

/// Sets each mixture group's share of the picks its hot experts take
/// (`HotPlan::hit`, by group index), which the plan's CPU costs follow.
pub fn set_hot_shares(groups: &mut [GroupInfo], hit: &[f64]) {
    for (g, &x) in groups.iter_mut().zip(hit) {
        if let Some(e) = g.experts.as_mut() {
            e.hot = x;
        }
    }
}

impl GroupInfo {
    /// A group every token reads whole.
    pub fn dense(kind: GroupKind, bytes: u64) -> GroupInfo {
        GroupInfo {
            kind,
            bytes,
            experts: None,
        }
    }

    /// Weight bytes a step of `n` tokens reads: the whole of a dense
    /// group; of a mixture, its shared part and the experts at least one
    /// token chose. Routing is taken as uniform, so that is the expected
    /// count of distinct experts among n draws of `n_used`:
    /// E (1 - (1 - k/E)^n). Real routers are skewed, so fewer are read;
    /// the plan errs towards the slower prediction.
    pub fn read_bytes(&self, n: u32) -> u64 {
        match self.experts {
            None => self.bytes,
            Some(x) => {
                let e = x.n_expert.max(1) as f64;
                let k = (x.n_used as f64).clamp(0.0, e);
                let touched = 1.0 - (1.0 - k / e).powi(n.max(1) as i32);
                self.shared_bytes() + (x.bytes as f64 * touched).round() as u64
            }
        }
    }

    /// Weight bytes one token multiplies (each token its own experts): the
    /// arithmetic of a step grows with these times its tokens.
    pub fn token_bytes(&self) -> u64 {
        match self.experts {
            None => self.bytes,
            Some(x) => {
                let share = x.n_used.min(x.n_expert) as f64 / x.n_expert.max(1) as f64;
                self.shared_bytes() + (x.bytes as f64 * share).round() as u64
            }
        }
    }

    /// [`Experts::cpu_scale`]; [1, 1] for a dense group.
    pub fn cpu_scale(&self) -> [f64; 2] {
        self.experts.map_or([1.0; 2], |x| x.cpu_scale)
    }

    /// The share of the picks hot experts on the device take (0: none).
    pub fn hot_share(&self) -> f64 {
        self.experts.map_or(0.0, |x| x.hot.clamp(0.0, 1.0))
    }

    /// The share of the routed experts' bytes the device holds when it
    /// keeps `k` experts (1 for a dense group).
    pub fn device_share(&self, k: u32) -> f64 {
        match self.experts {
            None => 1.0,
            Some(x) => (k.min(x.n_expert) as f64) / x.n_expert.max(1) as f64,
        }
    }

    /// The share of the picks the device computes when it keeps the `k`
    /// most picked experts (their share of the bytes where routing is
    /// uniform or uncounted; 1 for a dense group).
    pub fn device_pick_share(&self, k: u32) -> f64 {
        match self.experts {
            Some(Experts {
                n_expert,
                popularity: Some(p),
                ..
            }) => (0..k.min(n_expert))
                .map(|r| p.share(r, n_expert))
                .sum::<f64>()
                .min(1.0),
            _ => self.device_share(k),
        }
    }

    /// Seconds the CPU computes the picks of the experts an expert split
    /// leaves it (all but the `k` most picked) at a step of `n` tokens, at
    /// `s_per_byte(t)` as [`GroupInfo::compute_s`] takes it: the experts
    /// its tokens touched, read at the one-token rate, and the arithmetic
    /// of its share of the picks. Uniform routing: `compute_s` of the
    /// group's experts times the CPU's share of them.
    pub fn split_cpu_s(&self, n: u32, k: u32, s_per_byte: impl Fn(u32) -> f64) -> f64 {
        let Some(x) = self.experts else {
            return 0.0;
        };
        let e = x.n_expert.max(1);
        let per_expert = x.bytes as f64 / e as f64;
        let used = x.n_used.min(e) as f64;
        let touched: f64 = (k.min(e)..e)
            .map(|r| {
                let share = x.popularity.map_or(1.0 / e as f64, |p| p.share(r, e));
                1.0 - (1.0 - (used * share).min(1.0)).powi(n.max(1) as i32)
            })
            .sum();
        let s1 = s_per_byte(1);
        let extra = (s_per_byte(n) - s1).max(0.0);
        let arithmetic = x.bytes as f64 * used / e as f64 * (1.0 - self.device_pick_share(k));
        touched * per_expert * s1 + arithmetic * extra
    }

    /// Bytes crossing the bus for a group placed at `w`: all of a streamed
    /// one, of a split one its shared part and its device's experts, of a
    /// routed one what it is expected to carry.
    pub fn upload_bytes(&self, w: Where) -> u64 {
        match (w, self.experts) {
            (Where::Split(k), Some(x)) => {
                self.shared_bytes() + (x.bytes as f64 * self.device_share(k)).round() as u64
            }
            (Where::Routed(b), _) => b.min(self.bytes),
            _ => self.bytes,
        }
    }

    /// Bytes every token reads.
    fn shared_bytes(&self) -> u64 {
        self.bytes - self.experts.map_or(0, |x| x.bytes.min(self.bytes))
    }

    /// Seconds a step of `n` tokens computes this group at a rate of
    /// `s_per_byte(t)` seconds per weight byte for a dense step of t
    /// tokens (memory-bound at one token, compute-bound at many): the
    /// bytes it reads at the one-token rate, and the arithmetic beyond
    /// that of the bytes each token multiplies. For a dense group this is
    /// bytes x s_per_byte(n).
    pub fn compute_s(&self, n: u32, s_per_byte: impl Fn(u32) -> f64) -> f64 {
        let s1 = s_per_byte(1);
        let extra = (s_per_byte(n) - s1).max(0.0);
        self.read_bytes(n) as f64 * s1 + self.token_bytes() as f64 * extra
    }
}

/// The largest group of `kind` (0 when there is none).
pub(super) fn max_bytes(groups: &[GroupInfo], kind: GroupKind) -> u64 {
    groups
        .iter()
        .filter(|g| g.kind == kind)
        .map(|g| g.bytes)
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn moe(shared: u64, experts: u64, n_expert: u32, n_used: u32) -> GroupInfo {
        GroupInfo {
            kind: GroupKind::Ffn,
            bytes: shared + experts,
            experts: Some(Experts {
                bytes: experts,
                n_expert,
                n_used,
                hot: 0.0,
                popularity: None,
                cpu_scale: [1.0; 2],
            }),
        }
    }

    #[test]
    fn one_token_reads_its_experts_and_many_read_nearly_all() {
        // Qwen3-30B-A3B's shape: 8 of 128 experts
        let g = moe(1_000, 128_000, 128, 8);
        assert_eq!(g.read_bytes(1), 1_000 + 8_000);
        assert_eq!(g.token_bytes(), 1_000 + 8_000);
        // 512 tokens touch every expert (to rounding)
        assert!(g.read_bytes(512) >= 128_900, "{}", g.read_bytes(512));
        // a dense group reads everything whatever the step
        let d = GroupInfo::dense(GroupKind::Ffn, 129_000);
        assert_eq!(d.read_bytes(1), 129_000);
        assert_eq!(d.token_bytes(), 129_000);
    }

    #[test]
    fn dense_compute_is_bytes_at_the_step_rate() {
        let d = GroupInfo::dense(GroupKind::Ffn, 1000);
        let rate = |t: u32| 1.0 + 0.5 * (t as f64 - 1.0);
        for n in [1, 2, 16, 512] {
            assert!((d.compute_s(n, rate) - 1000.0 * rate(n)).abs() < 1e-6);
        }
    }

    #[test]
    fn all_experts_used_is_dense() {
        let g = moe(500, 4_000, 8, 8);
        let d = GroupInfo::dense(GroupKind::Ffn, 4_500);
        let rate = |t: u32| 2.0 + (t as f64).sqrt();
        for n in [1, 3, 64] {
            assert_eq!(g.read_bytes(n), d.read_bytes(n));
            assert!((g.compute_s(n, rate) - d.compute_s(n, rate)).abs() < 1e-6);
        }
    }

    /// Counts of `n` experts falling as (rank + 1)^-1, in a shuffled order.
    fn zipf_counts(n: u64) -> Vec<u64> {
        (0..n).map(|e| 100_000 / ((e * 37) % n + 1)).collect()
    }

    #[test]
    fn popularity_bins_the_picks_most_picked_first() {
        assert_eq!(Popularity::from_counts(&[0; 8]), None);
        let p = Popularity::from_counts(&zipf_counts(128)).expect("counted");
        assert!((p.0.iter().sum::<f64>() - 1.0).abs() < 1e-9);
        assert!(p.0.windows(2).all(|w| w[0] >= w[1]), "{:?}", p.0);
        let flat = Popularity::from_counts(&[5; 128]).expect("counted");
        assert!(flat.0.iter().all(|&x| (x - 1.0 / 16.0).abs() < 1e-12));
    }

    #[test]
    fn each_rank_takes_its_share_of_its_bin() {
        // fewer experts than bins (empty bins) and a count bins do not divide
        for n in [8u32, 128, 100] {
            let row: Vec<u64> = (0..u64::from(n)).map(|e| 1000 / (e + 1)).collect();
            let p = Popularity::from_counts(&row).expect("counted");
            let total: f64 = (0..n).map(|r| p.share(r, n)).sum();
            assert!((total - 1.0).abs() < 1e-9, "{n}: {total}");
        }
    }

    #[test]
    fn a_split_costs_the_cpu_its_share_of_uniform_routing() {
        // no shared bytes: the CPU computing every expert is compute_s
        let g = moe(0, 128 << 20, 128, 8);
        let s = |t: u32| 1e-10 * (1.0 + f64::from(t) / 8.0);
        for n in [1, 16, 64] {
            let whole = g.compute_s(n, s);
            // (read_bytes rounds to whole bytes)
            assert!((g.split_cpu_s(n, 0, s) - whole).abs() < 1e-6 * whole);
            let quarter = g.split_cpu_s(n, 96, s);
            assert!((quarter - whole / 4.0).abs() < 1e-6 * whole, "{n}");
            assert_eq!(g.device_pick_share(96), g.device_share(96));
        }
        assert_eq!(g.split_cpu_s(64, 128, s), 0.0);
    }

    #[test]
    fn skewed_routing_gives_the_device_most_picks_and_the_cpu_few_rows() {
        let mut g = moe(0, 128 << 20, 128, 8);
        let uniform = g;
        g.experts.as_mut().expect("a mixture").popularity =
            Popularity::from_counts(&zipf_counts(128));
        let s = |t: u32| 1e-10 * (1.0 + f64::from(t) / 8.0);
        let f = g.device_pick_share(64);
        assert!(f > 0.8 && f < 1.0, "{f}");
        assert_eq!(g.device_share(64), 0.5);
        // the CPU's half of the experts: fewer touched, far fewer rows
        let (skew, flat) = (g.split_cpu_s(64, 64, s), uniform.split_cpu_s(64, 64, s));
        assert!(skew < 0.6 * flat, "{skew} against {flat}");
        // more device experts never cost the CPU more
        let c: Vec<f64> = (0..=128).map(|k| g.split_cpu_s(64, k, s)).collect();
        assert!(c.windows(2).all(|w| w[1] <= w[0] + 1e-15));
    }

    proptest! {
        #[test]
        fn reads_grow_with_tokens_within_the_group(
            shared in 0u64..1_000_000,
            experts in 1u64..100_000_000,
            n_expert in 1u32..512,
            used in 1u32..16,
            n in 1u32..4096,
        ) {
            let g = moe(shared, experts, n_expert, used.min(n_expert));
            let (a, b) = (g.read_bytes(n), g.read_bytes(n + 1));
            prop_assert!(a <= b);
            prop_assert!(b <= g.bytes);
            prop_assert!(g.token_bytes() <= g.read_bytes(1) + 1);
            prop_assert!(g.read_bytes(1) >= shared);
            // memory-bound one token, compute-bound beyond: never cheaper
            // than the shared part at the one-token rate, never dearer
            // than the dense group of the same bytes
            let rate = |t: u32| 1e-9 * (1.0 + 0.25 * (t as f64 - 1.0));
            let d = GroupInfo::dense(GroupKind::Ffn, g.bytes);
            prop_assert!(g.compute_s(n, rate) <= d.compute_s(n, rate) * (1.0 + 1e-9));
            prop_assert!(g.compute_s(n, rate) >= shared as f64 * 1e-9 * (1.0 - 1e-9));
        }
    }
}
