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

    /// The share of the picks hot experts on the device take (0: none).
    pub fn hot_share(&self) -> f64 {
        self.experts.map_or(0.0, |x| x.hot.clamp(0.0, 1.0))
    }

    /// The share of the routed experts' bytes the device holds when it
    /// keeps the first `k` experts (1 for a dense group).
    pub fn device_share(&self, k: u32) -> f64 {
        match self.experts {
            None => 1.0,
            Some(x) => (k.min(x.n_expert) as f64) / x.n_expert.max(1) as f64,
        }
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
