//! How many tokens to draft: the length that maximizes expected tokens per
//! second, from what the rounds so far measured. Plain Rust.
//!
//! With per-token acceptance `a` (drafts accepted independently, the model
//! of Leviathan et al. 2023, section 3.5), a round of k drafts emits
//! E(k) = 1 + a + ... + a^k tokens and costs T(k) = t0 + t1 k (the target
//! step) + d k (drafting). Where weights stream over PCIe t1 is ~0 and the
//! longest draft wins; on a CPU that computes every token, t1 is close to
//! t0 and drafting pays only when acceptance is high. The estimates:
//!
//! - `a`: accepted / (accepted + rejections), each round contributing its
//!   accepted drafts and one rejection if it stopped short, decayed so the
//!   estimate follows the text;
//! - t0, t1: a least-squares line through (k, target step seconds) of the
//!   recent rounds; until two different k were seen, t1 = 0 (optimistic).
//!   The very first round drafts at most [`FIRST`] tokens, so the line gets
//!   a second point before a long draft is paid for where it costs;
//! - d: drafting seconds per drafted token.
//!
//! The line is corrected where step sizes were measured: per power-of-two
//! bucket of rows, by how far the bucket's measured steps lay off the line
//! ([`DraftLength::step_s`]). Hybrid decode makes the curve anything but a
//! line
//! (measured at 12G, run 59: 223 ms for one row, 347 for two, 413 for five,
//! 548 from seventeen on, where the CPU stops computing whole groups).
//!
//! When the best length is 0, every 16th round still drafts one token, so a
//! change (a repetitive passage, a warmed-up draft) is noticed.
//!
//! Trees ([`super::tree`]) use the same step-cost line, over the nodes a
//! step verifies, and the drafter's own probabilities: a grown tree's
//! first n nodes are expected to add c (p_1 + ... + p_n) accepted tokens,
//! p_i the drafter's probability of node i's path, and c the measured
//! share of what it predicted that the target accepted (a drafter that is
//! right as often as it thinks has c = 1). [`DraftLength::choose_nodes`]
//! keeps the n that maximizes (1 + c (p_1 + ... + p_n)) / (t0 + t1 n + d),
//! d the drafting seconds per round.

/// Decay per round of the running sums (about the last 30 rounds count).
const DECAY: f64 = 0.97;
/// Most drafts in the first round, before any cost was measured.
pub const FIRST: usize = 4;
/// Rounds between exploring drafts while drafting does not pay.
const EXPLORE_EVERY: u32 = 16;

#[derive(Clone, Debug)]
pub struct DraftLength {
    accepted: f64,
    rejected: f64,
    // decayed sums over rounds of (k, seconds) for the step-cost line
    n: f64,
    sk: f64,
    skk: f64,
    st: f64,
    skt: f64,
    draft_s: f64,
    drafted: f64,
    idle: u32,
    // trees: decayed sums of the drafter's predicted and the accepted
    // tokens, and of rounds for the drafting time per round
    predicted: f64,
    got: f64,
    tree_rounds: f64,
    /// Per bucket of rows (1, 2, 3-4, 5-8, ...): decayed sums of step
    /// seconds, of drafts and of steps.
    table: [(f64, f64, f64); BUCKETS],
}

/// Buckets of rows per step: up to 2^(BUCKETS-1) rows.
const BUCKETS: usize = 12;

/// The bucket of a step of `rows` rows: 1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3.
fn bucket(rows: usize) -> usize {
    ((usize::BITS - (rows.max(1) - 1).leading_zeros()) as usize).min(BUCKETS - 1)
}

impl Default for DraftLength {
    fn default() -> Self {
        DraftLength {
            // prior: two accepted, one rejected
            accepted: 2.0,
            rejected: 1.0,
            n: 0.0,
            sk: 0.0,
            skk: 0.0,
            st: 0.0,
            skt: 0.0,
            draft_s: 0.0,
            drafted: 0.0,
            idle: 0,
            predicted: 0.0,
            got: 0.0,
            tree_rounds: 0.0,
            table: [(0.0, 0.0, 0.0); BUCKETS],
        }
    }
}

impl DraftLength {
    /// A round verified `k` drafts and accepted `accepted` of them; the
    /// target step took `step_s`, drafting `draft_s`.
    pub fn record(&mut self, k: usize, accepted: usize, step_s: f64, draft_s: f64) {
        let (k, a) = (k as f64, accepted.min(k) as f64);
        self.accepted = self.accepted * DECAY + a;
        self.rejected = self.rejected * DECAY + f64::from(u8::from(a < k));
        self.n = self.n * DECAY + 1.0;
        self.sk = self.sk * DECAY + k;
        self.skk = self.skk * DECAY + k * k;
        self.st = self.st * DECAY + step_s;
        self.skt = self.skt * DECAY + k * step_s;
        self.draft_s = self.draft_s * DECAY + draft_s;
        self.drafted = self.drafted * DECAY + k;
        for b in &mut self.table {
            b.0 *= DECAY;
            b.1 *= DECAY;
            b.2 *= DECAY;
        }
        let b = &mut self.table[bucket(k as usize + 1)];
        b.0 += step_s;
        b.1 += k;
        b.2 += 1.0;
    }

    /// Seconds of a target step verifying `k` drafts: the cost line's, off
    /// by as much as the steps measured lately in its bucket of rows lay
    /// off the line (None before any round).
    pub fn step_s(&self, k: usize) -> Option<f64> {
        let (t0, t1) = self.step_cost()?;
        let line = |k: f64| t0 + t1 * k;
        let (st, sk, n) = self.table[bucket(k + 1)];
        let off = if n >= 0.3 { st / n - line(sk / n) } else { 0.0 };
        Some((line(k as f64) + off).max(1e-6))
    }

    /// A tree round verified `nodes` nodes whose paths the drafter gave
    /// `predicted` expected accepted tokens (the sum of their
    /// probabilities) and accepted `accepted`; the target step took
    /// `step_s`, drafting `draft_s`.
    pub fn record_tree(
        &mut self,
        nodes: usize,
        predicted: f64,
        accepted: usize,
        step_s: f64,
        draft_s: f64,
    ) {
        self.record(nodes, accepted, step_s, draft_s);
        self.predicted = self.predicted * DECAY + predicted;
        self.got = self.got * DECAY + accepted as f64;
        self.tree_rounds = self.tree_rounds * DECAY + 1.0;
    }

    /// The share of the drafter's predicted accepted tokens the target
    /// accepted (prior: 1).
    pub fn calibration(&self) -> f64 {
        (self.got + 1.0) / (self.predicted + 1.0)
    }

    /// How many of a grown tree's first nodes to verify, given each node's
    /// path probability by the drafter (`probs`, in node order): all of
    /// them before a cost was measured but [`FIRST`] in the first round,
    /// then the count that maximizes expected tokens per second.
    pub fn choose_nodes(&mut self, probs: &[f64]) -> usize {
        if self.n == 0.0 {
            return probs.len().min(FIRST);
        }
        let Some(t0) = self.step_s(0) else {
            return probs.len();
        };
        let c = self.calibration();
        let d = self.draft_s / self.tree_rounds.max(1.0);
        let mut best = (0, 1.0 / (t0 + d));
        let mut e = 1.0;
        for (n, p) in probs.iter().enumerate() {
            e += c * p;
            let rate = e / (self.step_s(n + 1).unwrap_or(t0) + d);
            if rate >= best.1 {
                best = (n + 1, rate);
            }
        }
        if best.0 == 0 && !probs.is_empty() {
            self.idle += 1;
            if self.idle.is_multiple_of(EXPLORE_EVERY) {
                return 1;
            }
        }
        best.0
    }

    /// A proposal that was not verified turned out right (`hit`) or wrong
    /// for its first token: free evidence on acceptance (prompt lookup).
    pub fn shadow(&mut self, hit: bool) {
        if hit {
            self.accepted = self.accepted * DECAY + 1.0;
        } else {
            self.rejected = self.rejected * DECAY + 1.0;
        }
    }

    /// Per-token acceptance estimate.
    pub fn acceptance(&self) -> f64 {
        self.accepted / (self.accepted + self.rejected).max(1e-9)
    }

    /// Target step cost line (t0, t1): seconds = t0 + t1 k.
    pub fn step_cost(&self) -> Option<(f64, f64)> {
        if self.n < 1e-9 {
            return None;
        }
        let mk = self.sk / self.n;
        let var = self.skk / self.n - mk * mk;
        let mt = self.st / self.n;
        let t1 = if var > 0.05 {
            ((self.skt / self.n - mk * mt) / var).max(0.0)
        } else {
            0.0
        };
        Some(((mt - t1 * mk).max(1e-6), t1))
    }

    /// Expected tokens per second of a round of k drafts under the current
    /// estimates (None before any round was measured).
    pub fn rate(&self, k: usize) -> Option<f64> {
        let t = self.step_s(k)?;
        let a = self.acceptance().min(0.999);
        let d = self.draft_s / self.drafted.max(1e-9);
        let e = (1.0 - a.powi(k as i32 + 1)) / (1.0 - a);
        Some(e / (t + d * k as f64))
    }

    /// The number of tokens to draft next, at most `max`.
    pub fn choose(&mut self, max: usize) -> usize {
        if self.n == 0.0 {
            return max.min(FIRST);
        }
        let Some(best) = (0..=max).max_by(|&x, &y| {
            let (rx, ry) = (self.rate(x).unwrap_or(0.0), self.rate(y).unwrap_or(0.0));
            // on ties the longer draft (no measurement yet: draft the most)
            rx.total_cmp(&ry).then(x.cmp(&y))
        }) else {
            return 0;
        };
        if best == 0 && max > 0 {
            self.idle += 1;
            if self.idle.is_multiple_of(EXPLORE_EVERY) {
                return 1;
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Feeds rounds from a world where a step of k drafts costs t0 + t1 k,
    /// drafting d per token, and drafts are accepted at rate `a` (accepted
    /// count = the expected prefix, rounded); returns the length chosen.
    fn settle(t0: f64, t1: f64, d: f64, a: f64, max: usize) -> usize {
        let mut l = DraftLength::default();
        let mut k = l.choose(max);
        for round in 0..200 {
            // a deterministic mix of outcomes with mean acceptance a
            let acc = (0..k)
                .take_while(|i| ((round * 7 + i * 13) % 100) as f64 / 100.0 < a)
                .count();
            l.record(k, acc, t0 + t1 * k as f64, d * k as f64);
            if k == 0 {
                // prompt lookup keeps proposing: the first token checked
                l.shadow(((round * 7) % 100) as f64 / 100.0 < a);
            }
            k = l.choose(max);
            // vary k a little, as drafts that stop early do
            if round % 5 == 0 && k > 1 {
                k -= 1;
            }
        }
        l.choose(max)
    }

    #[test]
    fn streamed_steps_draft_the_most() {
        // PCIe-bound: a step costs the same for any k, drafting is cheap
        assert_eq!(settle(0.58, 0.0, 0.002, 0.9, 16), 16);
        let k = settle(0.58, 0.0, 0.002, 0.7, 16);
        assert!((8..=16).contains(&k), "{k}");
        // low acceptance: drafts past the first few are almost never
        // reached, and even 2 ms each is not worth it
        let k = settle(0.58, 0.0005, 0.002, 0.3, 16);
        assert!((4..16).contains(&k), "{k}");
    }

    #[test]
    fn compute_bound_steps_draft_little_or_nothing() {
        // CPU: every drafted token costs about what a plain step costs
        assert_eq!(settle(0.08, 0.035, 0.045, 0.9, 8), 0);
        assert_eq!(settle(0.08, 0.04, 0.0, 0.15, 8), 0);
        // cheap drafts that are nearly always right still pay on a CPU
        let k = settle(0.08, 0.01, 0.0, 0.95, 8);
        assert!(k >= 3, "{k}");
    }

    #[test]
    fn the_first_round_drafts_a_few_the_second_the_most() {
        let mut l = DraftLength::default();
        assert_eq!(l.choose(16), FIRST);
        assert_eq!(l.choose(2), 2);
        l.record(FIRST, FIRST, 0.5, 0.01);
        assert_eq!(l.choose(16), 16);
    }

    #[test]
    fn idle_drafting_explores_now_and_then() {
        let mut l = DraftLength::default();
        for _ in 0..20 {
            l.record(0, 0, 0.08, 0.0);
            l.record(2, 0, 0.16, 0.1);
        }
        let picks: Vec<usize> = (0..32).map(|_| l.choose(8)).collect();
        assert_eq!(picks.iter().filter(|&&k| k == 1).count(), 2, "{picks:?}");
        assert!(picks.iter().all(|&k| k <= 1));
    }

    /// Trees: where steps are flat (streamed weights) every node the
    /// drafter offers is verified; where each node costs nearly a plain
    /// step (a CPU), only the likeliest few, and none when the drafter is
    /// over-confident.
    #[test]
    fn tree_size_follows_step_costs_and_calibration() {
        // paths' probabilities, falling
        let probs: Vec<f64> = (0..64).map(|i| 0.9 / (1.0 + i as f64)).collect();
        let mut flat = DraftLength::default();
        assert_eq!(flat.choose_nodes(&probs), FIRST);
        for n in [4usize, 64, 32, 64, 16] {
            flat.record_tree(n, 2.0, 2, 0.58 + 1e-5 * n as f64, 0.01);
        }
        assert_eq!(flat.choose_nodes(&probs), 64);
        let mut cpu = DraftLength::default();
        for n in [4usize, 16, 8, 4, 16] {
            cpu.record_tree(n, 2.0, 2, 0.08 + 0.03 * n as f64, 0.01);
        }
        let n = cpu.choose_nodes(&probs);
        assert!((1..=4).contains(&n), "{n}");
        // a drafter that promises 3 tokens a round and delivers none
        let mut wrong = DraftLength::default();
        for n in [4usize, 16, 8, 4, 16] {
            wrong.record_tree(n, 3.0, 0, 0.08 + 0.03 * n as f64, 0.01);
        }
        for _ in 0..20 {
            wrong.record_tree(4, 3.0, 0, 0.2, 0.01);
        }
        assert!(wrong.calibration() < 0.1);
        assert_eq!(wrong.choose_nodes(&probs), 0);
    }

    /// Hybrid decode's measured curve (run 59): one row 223 ms, two 347,
    /// five 413, seventeen and more 548. With a drafter whose paths are
    /// likely, the tree stays at the size where a step is still cheap only
    /// if the gain pays for the jump; the choice is the best rate of the
    /// world it measured, within 5%.
    #[test]
    fn tree_size_follows_a_measured_curve_not_a_line() {
        let world = |rows: usize| match rows {
            1 => 0.223,
            2 => 0.347,
            3..=4 => 0.39,
            5..=16 => 0.413,
            _ => 0.548,
        };
        for p in [0.3f64, 0.6, 0.9] {
            // path probabilities p, p^2, ... (a chain-like tree) and a few
            // side branches at a tenth of them
            let mut probs: Vec<f64> = (1..=16).map(|i| p.powi(i)).collect();
            probs.extend((1..=16).map(|i| 0.1 * p.powi(i)));
            probs.sort_by(|a, b| b.total_cmp(a));
            let mut l = DraftLength::default();
            for n in [0usize, 1, 4, 8, 16, 32, 2, 0, 1, 4, 8, 16, 32] {
                let acc: f64 = probs[..n].iter().sum();
                l.record_tree(n, acc, acc.round() as usize, world(n + 1), 0.0);
            }
            let rate = |n: usize| (1.0 + probs[..n].iter().sum::<f64>()) / world(n + 1);
            let best = (0..=32).map(rate).fold(0.0, f64::max);
            let n = l.choose_nodes(&probs);
            assert!(
                rate(n) >= 0.95 * best,
                "p {p}: chose {n} ({}), best {best}",
                rate(n)
            );
        }
    }

    #[test]
    fn cost_line_is_fitted() {
        let mut l = DraftLength::default();
        for k in [0usize, 4, 8, 0, 4, 8] {
            l.record(k, 0, 0.1 + 0.02 * k as f64, 0.0);
        }
        let (t0, t1) = l.step_cost().unwrap();
        assert!(
            (t0 - 0.1).abs() < 1e-9 && (t1 - 0.02).abs() < 1e-9,
            "{t0} {t1}"
        );
    }
}
