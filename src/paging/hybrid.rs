//! Hybrid decode: which streamed layer groups the host CPU computes from
//! its own copy of their weights while the bus streams the others. Plain
//! Rust.
//!
//! Layers run in order, so the CPU and the bus overlap by interleaving:
//! while the CPU computes group i, the copy stream uploads the next GPU
//! groups into free slots. A step then costs about
//! max(bus bytes / bus rate, CPU bytes x CPU time per byte + hops + GPU
//! compute): the CPU chain and the GPU's computations wait on each other
//! (the residual stream hops between them), the bus runs beside both.
//!
//! Only FFN groups go to the CPU: attention needs its layer's KV cache,
//! which lives with the GPU, and a Llama layer's FFN holds about four
//! fifths of its bytes, so FFN groups alone balance any split. The CPU is
//! compute-bound on larger steps, so the split is chosen per step size from
//! one set of host copies: moving resident weights costs, re-choosing which
//! of them the CPU computes costs nothing.

use super::GroupInfo;
use crate::model::GroupKind;

/// The most tokens a step may have for the CPU to take part (the host's
/// step buffers are sized for it); larger steps stream everything.
pub const MAX_TOKENS: u32 = 32;

/// What the planner knows about the host CPU as a compute tier.
#[derive(Clone, Debug, PartialEq)]
pub struct CpuInput {
    /// Measured CPU seconds per weight byte for a step of one token.
    pub s_per_byte_1: f64,
    /// ... and for a step of `probe_tokens` tokens.
    pub s_per_byte_n: f64,
    pub probe_tokens: u32,
    /// Host bytes free for the CPU's (repacked) copies of its groups.
    pub host_room: u64,
    /// Seconds one round trip of the residual (device -> host -> device) costs.
    pub hop_s: f64,
    /// Measured GPU seconds per weight byte at decode (its compute is in
    /// the CPU's chain: each waits for the other).
    pub gpu_s_per_byte: f64,
    /// Exactly this many groups go to the CPU at every step size (tests,
    /// benchmarks); None: as many as minimize the predicted step.
    pub force: Option<usize>,
}

impl CpuInput {
    /// CPU seconds per byte for a step of `n` tokens: measured at 1 and at
    /// `probe_tokens`, linear in between and beyond (the CPU is
    /// memory-bound on one token and compute-bound on many).
    pub fn s_per_byte(&self, n: u32) -> f64 {
        let p = self.probe_tokens.max(2) as f64;
        let slope = (self.s_per_byte_n - self.s_per_byte_1) / (p - 1.0);
        (self.s_per_byte_1 + slope * (n.max(1) as f64 - 1.0))
            .max(self.s_per_byte_1.min(self.s_per_byte_n))
    }
}

/// The CPU's part of a plan.
#[derive(Clone, Debug, PartialEq)]
pub struct HybridPlan {
    /// Groups the host keeps a CPU copy of (the most the CPU computes).
    pub host: Vec<bool>,
    pub host_bytes: u64,
    /// For a step of n tokens (index n - 1, n <= MAX_TOKENS): how many of
    /// the host groups the CPU computes, and the predicted step.
    pub per_size: Vec<SizePlan>,
}

/// The split for one step size.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SizePlan {
    pub cpu_groups: usize,
    pub cpu_bytes: u64,
    pub predicted: Prediction,
}

/// A step's predicted cost, by chain.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct Prediction {
    /// Bytes over the bus / bus rate.
    pub bus_s: f64,
    /// CPU groups' compute plus the residual's hops.
    pub cpu_s: f64,
    /// GPU compute (serial with the CPU chain).
    pub gpu_s: f64,
    /// The step's first streamed upload, which nothing hides (each step
    /// starts with drained streams).
    pub startup_s: f64,
}

impl Prediction {
    pub fn step_s(&self) -> f64 {
        self.bus_s.max(self.startup_s + self.cpu_s + self.gpu_s)
    }
}

/// Attention slots for hybrid decode: while the CPU computes an FFN group,
/// the bus should keep uploading the next attention groups, so the ring
/// holds one FFN group's CPU time of uploads, half again for slack, plus the
/// two any ring needs (at least `base`, at most 16).
pub fn attn_slots(groups: &[GroupInfo], copy_bw: f64, c: &CpuInput, base: usize) -> usize {
    let max = |k| {
        groups
            .iter()
            .filter(|g| g.kind == k)
            .map(|g| g.bytes)
            .max()
            .unwrap_or(0)
    };
    let (attn, ffn) = (max(GroupKind::Attn), max(GroupKind::Ffn));
    if attn == 0 {
        return base;
    }
    let during = ffn as f64 * c.s_per_byte_1 * copy_bw;
    let need = (1.5 * during / attn as f64).ceil().min(14.0) as usize + 2;
    need.max(base)
}

/// `k` of the `m` items 0..m, spread evenly (every m/k-th), in order.
pub fn spread(m: usize, k: usize) -> Vec<usize> {
    let k = k.min(m);
    (0..m).filter(|&j| (j + 1) * k / m > j * k / m).collect()
}

/// Predicts a step of `n` tokens with the CPU computing `cpu_bytes` in
/// `cpu_groups` groups; `first_upload` bytes start the step.
#[allow(clippy::too_many_arguments)]
pub fn predict(
    c: &CpuInput,
    n: u32,
    streamed_bytes: u64,
    gpu_bytes: u64,
    copy_bw: f64,
    cpu_groups: usize,
    cpu_bytes: u64,
    first_upload: u64,
) -> Prediction {
    Prediction {
        startup_s: first_upload as f64 / copy_bw.max(1.0),
        bus_s: streamed_bytes.saturating_sub(cpu_bytes) as f64 / copy_bw.max(1.0),
        cpu_s: cpu_bytes as f64 * c.s_per_byte(n) + cpu_groups as f64 * c.hop_s,
        gpu_s: gpu_bytes.saturating_sub(cpu_bytes) as f64 * c.gpu_s_per_byte,
    }
}

/// Chooses the host groups and the split per step size. `streamed` marks
/// the groups that do not stay on the device; `total_bytes` is every
/// group's bytes (what the GPU computes when the CPU computes nothing).
pub fn plan_hybrid(
    groups: &[GroupInfo],
    streamed: &[bool],
    copy_bw: f64,
    c: &CpuInput,
) -> Option<HybridPlan> {
    // candidates: streamed FFN groups, in layer order
    let cand: Vec<usize> = (0..groups.len())
        .filter(|&i| streamed[i] && groups[i].kind == GroupKind::Ffn)
        .collect();
    let streamed_bytes: u64 = (0..groups.len())
        .filter(|&i| streamed[i])
        .map(|i| groups[i].bytes)
        .sum();
    let total: u64 = groups.iter().map(|g| g.bytes).sum();
    // the first streamed group is attention (layers stream from the first
    // non-resident one, attention first) or an FFN group the GPU computes
    let first_upload = (0..groups.len())
        .find(|&i| streamed[i])
        .map_or(0, |i| groups[i].bytes);
    // the most that fit the host room (groups of one kind have one size
    // in a Llama model; take the largest to be safe)
    let largest = cand.iter().map(|&i| groups[i].bytes).max().unwrap_or(0);
    let fit = c
        .host_room
        .checked_div(largest)
        .map_or(0, |f| (f as usize).min(cand.len()));
    // the best split for a step of n tokens, choosing up to `most` groups
    // spread over `pool` (group indices in layer order)
    let best_for = |n: u32, pool: &[usize], most: usize| -> (usize, u64, Prediction) {
        let eval = |k: usize| {
            let b: u64 = spread(pool.len(), k)
                .iter()
                .map(|&j| groups[pool[j]].bytes)
                .sum();
            (k, b, predict(c, n, streamed_bytes, total, copy_bw, k, b, first_upload))
        };
        if let Some(f) = c.force {
            return eval(f.min(most));
        }
        (0..=most)
            .map(eval)
            .min_by(|a, b| a.2.step_s().total_cmp(&b.2.step_s()))
            .expect("k = 0 is always a candidate")
    };
    let (k1, host_bytes, _) = best_for(1, &cand, fit);
    if k1 == 0 {
        return None;
    }
    let hosts: Vec<usize> = spread(cand.len(), k1).iter().map(|&j| cand[j]).collect();
    let mut host = vec![false; groups.len()];
    for &i in &hosts {
        host[i] = true;
    }
    let per_size = (1..=MAX_TOKENS)
        .map(|n| {
            let (cpu_groups, cpu_bytes, predicted) = best_for(n, &hosts, k1);
            SizePlan {
                cpu_groups,
                cpu_bytes,
                predicted,
            }
        })
        .collect();
    Some(HybridPlan {
        host_bytes,
        host,
        per_size,
    })
}

impl HybridPlan {
    /// The groups the CPU computes in a step of `n` tokens (none above
    /// MAX_TOKENS): `per_size[n - 1].cpu_groups` of the host groups, spread
    /// evenly over the layers so the bus always has uploads queued.
    pub fn cpu_groups(&self, n: u32) -> Vec<bool> {
        let mut out = vec![false; self.host.len()];
        if n == 0 || n > MAX_TOKENS {
            return out;
        }
        let hosts: Vec<usize> = (0..self.host.len()).filter(|&i| self.host[i]).collect();
        let k = self.per_size[n as usize - 1].cpu_groups;
        for j in spread(hosts.len(), k) {
            out[hosts[j]] = true;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn layers(n: usize, attn: u64, ffn: u64) -> Vec<GroupInfo> {
        (0..n)
            .flat_map(|_| {
                [
                    GroupInfo {
                        kind: GroupKind::Attn,
                        bytes: attn,
                    },
                    GroupInfo {
                        kind: GroupKind::Ffn,
                        bytes: ffn,
                    },
                ]
            })
            .collect()
    }

    fn cpu(s_per_byte: f64) -> CpuInput {
        CpuInput {
            s_per_byte_1: s_per_byte,
            s_per_byte_n: s_per_byte * 8.0,
            probe_tokens: 16,
            host_room: u64::MAX,
            hop_s: 0.0,
            gpu_s_per_byte: 0.0,
            force: None,
        }
    }

    #[test]
    fn spread_is_even_and_exact() {
        assert_eq!(spread(10, 0), Vec::<usize>::new());
        assert_eq!(spread(10, 10), (0..10).collect::<Vec<_>>());
        assert_eq!(spread(10, 5), vec![1, 3, 5, 7, 9]);
        assert_eq!(spread(4, 9), vec![0, 1, 2, 3]);
    }

    #[test]
    fn equal_rates_split_the_streamed_bytes_in_half() {
        // 70B-like: attn 85, ffn 396 per layer, 60 layers streamed, bus and
        // CPU both 1 byte per unit of time
        let g = layers(60, 85, 396);
        let streamed = vec![true; g.len()];
        let p = plan_hybrid(&g, &streamed, 1.0, &cpu(1.0)).expect("hybrid pays");
        let s = p.per_size[0];
        let total: u64 = g.iter().map(|g| g.bytes).sum();
        // balanced: CPU bytes about half of everything streamed
        let half = total / 2;
        assert!(
            s.cpu_bytes.abs_diff(half) <= 396,
            "{} vs {half}",
            s.cpu_bytes
        );
        assert!(s.predicted.step_s() < total as f64 * 0.52);
        // bigger steps give the CPU less, and none past the limit
        assert!(p.per_size[15].cpu_groups < s.cpu_groups);
        assert!(p.cpu_groups(MAX_TOKENS + 1).iter().all(|c| !c));
    }

    #[test]
    fn slow_cpu_gets_nothing() {
        let g = layers(8, 10, 40);
        let streamed = vec![true; g.len()];
        assert_eq!(plan_hybrid(&g, &streamed, 1.0, &cpu(1e6)), None);
    }

    #[test]
    fn host_room_caps_the_copies() {
        let g = layers(8, 10, 40);
        let streamed = vec![true; g.len()];
        let mut c = cpu(1.0);
        c.host_room = 80;
        let p = plan_hybrid(&g, &streamed, 1.0, &c).unwrap();
        assert_eq!(p.host_bytes, 80);
        c.host_room = 39;
        assert_eq!(plan_hybrid(&g, &streamed, 1.0, &c), None);
    }

    proptest! {
        #[test]
        fn hybrid_plans_are_consistent(
            n in 1usize..40, attn in 1u64..100, ffn in 1u64..400,
            first_streamed in 0usize..80, spb in 0.01f64..10.0, bw in 0.1f64..10.0,
            room in 0u64..20000, hop in 0.0f64..5.0, force in proptest::option::of(0usize..50),
        ) {
            let g = layers(n, attn, ffn);
            let streamed: Vec<bool> = (0..g.len()).map(|i| i >= first_streamed.min(g.len())).collect();
            let c = CpuInput { host_room: room, hop_s: hop, force, ..cpu(spb) };
            let Some(p) = plan_hybrid(&g, &streamed, bw, &c) else { return Ok(()) };
            // host copies: streamed FFN groups only, within the room
            for (i, h) in p.host.iter().enumerate() {
                if *h { prop_assert!(streamed[i] && g[i].kind == GroupKind::Ffn); }
            }
            let hb: u64 = g.iter().zip(&p.host).filter(|(_, h)| **h).map(|(g, _)| g.bytes).sum();
            prop_assert_eq!(hb, p.host_bytes);
            prop_assert!(p.host_bytes <= room);
            let streamed_bytes: u64 = g.iter().zip(&streamed).filter(|(_, s)| **s).map(|(g, _)| g.bytes).sum();
            let total: u64 = g.iter().map(|g| g.bytes).sum();
            for (i, s) in p.per_size.iter().enumerate() {
                let set = p.cpu_groups(i as u32 + 1);
                // every CPU group has a host copy; counts and bytes agree
                prop_assert!(set.iter().zip(&p.host).all(|(c, h)| !c || *h));
                prop_assert_eq!(set.iter().filter(|c| **c).count(), s.cpu_groups);
                let b: u64 = g.iter().zip(&set).filter(|(_, c)| **c).map(|(g, _)| g.bytes).sum();
                prop_assert_eq!(b, s.cpu_bytes);
                // the prediction is the chains' maximum, each from its bytes
                let first = (0..g.len()).find(|&i| streamed[i]).map_or(0, |i| g[i].bytes);
                let q = predict(&c, i as u32 + 1, streamed_bytes, total, bw, s.cpu_groups, s.cpu_bytes, first);
                prop_assert_eq!(q, s.predicted);
                prop_assert!(s.predicted.step_s() >= s.predicted.bus_s);
                // never worse than streaming everything (unless forced)
                if force.is_none() {
                    let none = predict(&c, i as u32 + 1, streamed_bytes, total, bw, 0, 0, first);
                    prop_assert!(s.predicted.step_s() <= none.step_s() + 1e-12);
                }
            }
        }
    }
}
