//! Router skew for synthetic mixtures of experts (`synth --router-skew S`).
//!
//! A random router (`blk.N.ffn_gate_inp.weight`, F32 [n_embd, n_expert])
//! picks every expert about equally often, which flatters no expert cache.
//! With S > 0 each layer gets its own random popularity order of the
//! experts, and the expert of rank r is aimed at the Zipf-like share
//! `(r + 1)^-S` of the selections (normalized), capped as below.
//!
//! How: the router's input is an RMS-normed hidden state x (|x| = sqrt(n_embd)
//! times the norm weights, all ones in a synthetic file) with no fixed
//! direction, so a bias-like term along a "mean direction" has nothing to
//! hold on to. What the router controls is each row's norm: logit_e =
//! s_e (w_e . x), where w_e . x is about N(0, 1) over tokens for a random
//! row w_e (std 1/sqrt(n_embd)). An expert with a larger s_e lands in the
//! top k more often. The scales per rank are calibrated once per (n_expert,
//! k, S) by Monte Carlo on i.i.d. N(0, 1) logits so that the selection
//! shares meet the Zipf targets; their mean square is 1, so the average
//! row keeps today's norm.
//!
//! The cap: hidden states of a random model are about as often x as -x, and
//! -x reverses a linear router's order, so with n_expert >= 2k no expert can
//! be chosen by more than half the tokens (share 1/(2k) of the selections).
//! Targets are water-filled under [`TOKEN_CAP`] / k: for Qwen3-30B-A3B
//! (128 experts, 8 used) that is 5.6 % of the selections per expert, 7x the
//! uniform 0.8 %; for Mixtral (8, 2) 22.5 % against 12.5 %.
//!
//! All of this is plain Rust, seeded (ChaCha8), and stated in the file:
//! [`KEY_ROUTER_SKEW`], [`KEY_EXPERT_RANK`], [`KEY_TARGET_SHARE`].

use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// f32: the Zipf exponent S (0: a plain random router).
pub const KEY_ROUTER_SKEW: &str = "strata.synth.router_skew";
/// string: the preset the file was synthesized from.
pub const KEY_PRESET: &str = "strata.synth.preset";
/// u32 [n_layer * n_expert]: layer l's expert ids, most popular first, at
/// l * n_expert (only with S > 0).
pub const KEY_EXPERT_RANK: &str = "strata.synth.expert_rank";
/// f32 [n_expert]: the share of selections rank r is calibrated to (same
/// for every layer; only with S > 0).
pub const KEY_TARGET_SHARE: &str = "strata.synth.router_target_share";

/// Most of the tokens one expert is aimed at (a linear router on
/// sign-symmetric states reaches at most 1/2; the margin keeps the scales
/// finite).
pub const TOKEN_CAP: f64 = 0.45;
/// Calibration samples (tokens) and rounds.
const SAMPLES: usize = 4096;
const ROUNDS: usize = 200;
/// Largest scale ratio a row may get over the mean.
const MAX_SCALE: f64 = 40.0;

/// splitmix64 (the synth seed mixer).
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e3779b97f4a7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
    z ^ (z >> 31)
}

/// `n` N(0, 1) values (Box-Muller), deterministic in `seed`.
pub fn normals(n: usize, seed: u64) -> Vec<f64> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut v = Vec::with_capacity(n + 1);
    while v.len() < n {
        let u1 = (rng.next_u32() as f64 + 1.0) / 4294967297.0;
        let u2 = rng.next_u32() as f64 / 4294967296.0;
        let r = (-2.0 * u1.ln()).sqrt();
        let a = std::f64::consts::TAU * u2;
        v.push(r * a.cos());
        v.push(r * a.sin());
    }
    v.truncate(n);
    v
}

/// Target share of the selections per popularity rank: (r + 1)^-s,
/// normalized, water-filled under `TOKEN_CAP / k` (never below uniform).
pub fn target_shares(n_expert: usize, k: usize, s: f64) -> Vec<f64> {
    let cap = (TOKEN_CAP / k as f64).max(1.0 / n_expert as f64);
    let w: Vec<f64> = (0..n_expert).map(|r| (r as f64 + 1.0).powf(-s)).collect();
    // w decreases, so the capped ranks are a prefix
    let mut n_cap = 0;
    loop {
        let rest: f64 = w[n_cap..].iter().sum();
        let c = (1.0 - n_cap as f64 * cap) / rest;
        if n_cap < n_expert && c * w[n_cap] > cap {
            n_cap += 1;
            continue;
        }
        return (0..n_expert)
            .map(|r| if r < n_cap { cap } else { c * w[r] })
            .collect();
    }
}

/// Share of the selections each expert gets when every sample (a row of
/// `n_expert` logits) picks its `k` largest.
pub fn selection_shares(logits: &[f64], n_expert: usize, k: usize) -> Vec<f64> {
    let mut count = vec![0u64; n_expert];
    let mut idx: Vec<usize> = Vec::with_capacity(n_expert);
    let rows = logits.len() / n_expert;
    for row in logits.chunks_exact(n_expert) {
        idx.clear();
        idx.extend(0..n_expert);
        if k < n_expert {
            idx.select_nth_unstable_by(k - 1, |&a, &b| row[b].total_cmp(&row[a]));
        }
        for &e in &idx[..k.min(n_expert)] {
            count[e] += 1;
        }
    }
    let total = (rows * k.min(n_expert)).max(1) as f64;
    count.iter().map(|&c| c as f64 / total).collect()
}

/// Row scales by rank (mean square 1) whose top-`k` shares on i.i.d.
/// N(0, 1) logits meet `targets`; deterministic in `seed`.
pub fn calibrate(targets: &[f64], k: usize, seed: u64) -> Vec<f64> {
    let n = targets.len();
    let z = normals(SAMPLES * n, mix(seed ^ 0x005e_ed0f_2a7e));
    let mut s = vec![1.0f64; n];
    let mut logits = vec![0.0; z.len()];
    for _ in 0..ROUNDS {
        for (row, zr) in logits.chunks_exact_mut(n).zip(z.chunks_exact(n)) {
            for ((l, &zi), &si) in row.iter_mut().zip(zr).zip(&s) {
                *l = si * zi;
            }
        }
        let f = selection_shares(&logits, n, k);
        for ((si, &t), &fi) in s.iter_mut().zip(targets).zip(&f) {
            // damped: one row's scale moves the threshold of all
            let ratio = t / fi.max(0.25 / (SAMPLES * k) as f64);
            *si *= ratio.powf(0.5).clamp(0.9, 1.1);
        }
        let rms = (s.iter().map(|x| x * x).sum::<f64>() / n as f64).sqrt();
        for si in &mut s {
            *si = (*si / rms).clamp(1.0 / MAX_SCALE, MAX_SCALE);
        }
    }
    s
}

/// Layer `layer`'s expert ids, most popular first (Fisher-Yates, seeded).
pub fn popularity_order(n_expert: usize, seed: u64, layer: u32) -> Vec<u32> {
    let mut rng = ChaCha8Rng::seed_from_u64(mix(seed ^ mix(0x7a1f_u64 << 32 | u64::from(layer))));
    let mut p: Vec<u32> = (0..n_expert as u32).collect();
    for i in (1..n_expert).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        p.swap(i, j);
    }
    p
}

/// The skewed router of one layer: F32 [n_embd, n_expert], expert e's row
/// N(0, 1/n_embd) times the scale of its rank in `order`.
pub fn router_rows(
    n_embd: usize,
    scales: &[f64],
    order: &[u32],
    seed: u64,
    layer: u32,
) -> Vec<f32> {
    let n_expert = order.len();
    let mut scale_of = vec![1.0; n_expert];
    for (r, &e) in order.iter().enumerate() {
        scale_of[e as usize] = scales[r];
    }
    let z = normals(
        n_embd * n_expert,
        mix(seed ^ mix(0x2047_u64 << 32 | u64::from(layer))),
    );
    let std = 1.0 / (n_embd as f64).sqrt();
    z.chunks_exact(n_embd)
        .zip(&scale_of)
        .flat_map(|(row, &s)| row.iter().map(move |&v| (v * std * s) as f32))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn top_share(shares: &[f64], n_top: usize) -> f64 {
        let mut s = shares.to_vec();
        s.sort_by(|a, b| b.total_cmp(a));
        s[..n_top].iter().sum()
    }

    #[test]
    fn synth_targets_are_zipf_under_the_cap() {
        let t = target_shares(128, 8, 1.0);
        assert!((t.iter().sum::<f64>() - 1.0).abs() < 1e-9);
        assert!(t.windows(2).all(|w| w[0] >= w[1]));
        assert!(t.iter().all(|&x| x <= TOKEN_CAP / 8.0 + 1e-12));
        // past the cap, Zipf: rank 63 gets half of rank 31
        assert!((t[31] / t[63] - 2.0).abs() < 1e-9);
        let u = target_shares(16, 4, 0.0);
        assert!(u.iter().all(|&x| (x - 1.0 / 16.0).abs() < 1e-12));
    }

    #[test]
    fn synth_order_is_a_seeded_permutation_per_layer() {
        let a = popularity_order(128, 7, 0);
        let mut sorted = a.clone();
        sorted.sort();
        assert_eq!(sorted, (0..128).collect::<Vec<u32>>());
        assert_eq!(a, popularity_order(128, 7, 0));
        assert_ne!(a, popularity_order(128, 7, 1));
        assert_ne!(a, popularity_order(128, 8, 0));
    }

    /// The calibrated scales meet the targets on fresh i.i.d. logits.
    /// Measured (seed 1, 8192 fresh tokens): Qwen3-30B-A3B's 128/8 at S=1:
    /// see the assertion messages; top 13 experts (10 %) get ~54 % of the
    /// selections against 10 % uniform.
    #[test]
    fn synth_calibrated_scales_skew_top_k() {
        for (n, k) in [(128usize, 8usize), (16, 4), (8, 2)] {
            let t = target_shares(n, k, 1.0);
            let s = calibrate(&t, k, 1);
            let ms = s.iter().map(|x| x * x).sum::<f64>() / n as f64;
            assert!((ms - 1.0).abs() < 1e-6, "mean square {ms}");
            let z = normals(8192 * n, 99);
            let logits: Vec<f64> = z
                .chunks_exact(n)
                .flat_map(|r| r.iter().zip(&s).map(|(a, b)| a * b).collect::<Vec<_>>())
                .collect();
            let f = selection_shares(&logits, n, k);
            // total variation distance between measured and target shares
            let tv = f.iter().zip(&t).map(|(a, b)| (a - b).abs()).sum::<f64>() / 2.0;
            let n_top = n.div_ceil(10);
            eprintln!(
                "{n}/{k} S=1: top {n_top} share {:.3} (target {:.3}, uniform {:.3}), TV {tv:.3}, rank0 {:.4} (target {:.4})",
                top_share(&f, n_top),
                top_share(&t, n_top),
                n_top as f64 / n as f64,
                f[0],
                t[0]
            );
            assert!(tv < 0.05, "{n}/{k}: shares {f:?} targets {t:?}");
        }
    }
}
