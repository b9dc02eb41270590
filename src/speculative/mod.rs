//! Speculative decoding: draft several tokens cheaply, verify them in one
//! target step, keep the longest agreeing prefix plus the target's own next
//! token.
//!
//! Why it pays here: when weights stream over PCIe, a target step costs the
//! same for 1 or 32 tokens (BENCHMARKS.md), so every accepted draft token is
//! a step the user did not wait for.
//!
//! Drafters ([`Drafter`]): a small model with the target's vocabulary
//! ([`DraftModel`], greedy) or prompt lookup ([`NgramLookup`]).
//!
//! Verification and why it is lossless. A round feeds the pending token
//! plus drafts `d1..dk` in one step with logits for every row. Then, for
//! row i = 0, 1, ...: the target's sampler draws `y` from row i exactly as
//! plain decoding would (same chain, penalties over the tokens emitted so
//! far, the next draw of the same seeded stream); `y` is emitted; if
//! `y == d(i+1)` its KV row is already in the cache and row i+1 holds the
//! logits after it, so verification goes on, else the round ends with `y`
//! pending. Rejected drafts' cells are truncated away.
//!
//! Drafts are point masses (greedy draft model, lookup), so the standard
//! rejection scheme (Leviathan et al. 2023; Chen et al. 2023: accept `x`
//! with probability min(1, p(x)/q(x)), else draw from norm(max(0, p - q)))
//! reduces to: accept with probability p(x), else draw from p without x.
//! Drawing `y ~ p` and accepting iff `y == x` is exactly that, and it
//! consumes the random stream as plain decoding does, one draw per emitted
//! token. So for the same logits the emitted tokens are the plain ones, at
//! temperature 0 and, with a fixed seed, when sampling. Where a multi-token
//! step's logits differ in the last bits from a one-token step's (another
//! kernel path), outputs can part at a near-tie; docs/speculative.md says
//! where that happens.

mod draft_model;
mod length;
mod lookup;
mod replay;
mod tree;

pub use draft_model::{check_vocab, top_token, DraftModel, DraftRequest, VocabMismatch};
pub use length::DraftLength;
pub use lookup::NgramLookup;
pub use replay::{AcceptTrace, Replay, TraceRound, TRACE_FORMAT};
pub use tree::{grow, top_logprobs, verify_tree, DraftTree, TreeNode, TreeShape};

use crate::engine::EngineError;
use std::time::{Duration, Instant};

/// Where drafts come from.
pub enum Drafter {
    Lookup(NgramLookup),
    Model(Box<DraftModel>),
    /// A draft model the caller shares among sequences and runs for all of
    /// them at once (the server): the caller asks [`Speculator::length`]
    /// how many tokens to draft and hands the drafts to
    /// [`Speculator::take`].
    Shared,
}

/// llama.cpp's speculative parameters (its names: --draft-max, --draft-min,
/// --draft-p-min).
#[derive(Clone, Copy, Debug)]
pub struct SpecConfig {
    /// Most tokens drafted per round.
    pub draft_max: usize,
    /// Fewer drafted tokens than this: the round runs without them.
    pub draft_min: usize,
    /// Choose each round's length from measured costs and acceptance
    /// ([`DraftLength`]); false: always up to `draft_max`.
    pub adaptive: bool,
    /// Draft token trees of up to this many nodes (`--draft-tree N`, at
    /// most `draft_max` deep); 0: chains.
    pub tree: usize,
}

impl Default for SpecConfig {
    fn default() -> Self {
        SpecConfig {
            draft_max: 16,
            draft_min: 0,
            adaptive: true,
            tree: 0,
        }
    }
}

/// What drafting achieved: accepted tokens per round and where time went.
#[derive(Clone, Debug, Default)]
pub struct SpecStats {
    /// Target steps that verified at least one draft token.
    pub rounds: u64,
    pub drafted: u64,
    pub accepted: u64,
    /// accepted[i]: rounds that accepted i drafts (index drafts.len() max).
    pub histogram: Vec<u64>,
    pub draft_time: Duration,
    /// Time in target steps of rounds with drafts.
    pub target_time: Duration,
}

impl SpecStats {
    pub fn record(&mut self, drafted: usize, accepted: usize, target: Duration) {
        if drafted == 0 {
            return;
        }
        self.rounds += 1;
        self.drafted += drafted as u64;
        self.accepted += accepted as u64;
        if self.histogram.len() <= accepted {
            self.histogram.resize(accepted + 1, 0);
        }
        self.histogram[accepted] += 1;
        self.target_time += target;
    }
    /// Adds another run's figures to these.
    pub fn add(&mut self, s: &SpecStats) {
        self.rounds += s.rounds;
        self.drafted += s.drafted;
        self.accepted += s.accepted;
        if self.histogram.len() < s.histogram.len() {
            self.histogram.resize(s.histogram.len(), 0);
        }
        for (t, &n) in self.histogram.iter_mut().zip(&s.histogram) {
            *t += n;
        }
        self.draft_time += s.draft_time;
        self.target_time += s.target_time;
    }
    /// Tokens emitted per verifying step: the accepted drafts plus the
    /// target's own token.
    pub fn tokens_per_round(&self) -> f64 {
        if self.rounds == 0 {
            return 1.0;
        }
        1.0 + self.accepted as f64 / self.rounds as f64
    }
    /// Drafting milliseconds per round.
    pub fn draft_ms_per_round(&self) -> f64 {
        self.draft_time.as_secs_f64() * 1e3 / self.rounds.max(1) as f64
    }
    /// Target-step milliseconds per round.
    pub fn target_ms_per_round(&self) -> f64 {
        self.target_time.as_secs_f64() * 1e3 / self.rounds.max(1) as f64
    }
    /// Nodes (drafted tokens) verified per round.
    pub fn drafted_per_round(&self) -> f64 {
        self.drafted as f64 / self.rounds.max(1) as f64
    }
    pub fn acceptance(&self) -> f64 {
        self.accepted as f64 / self.drafted.max(1) as f64
    }
    /// "accepted 0:5 1:3 4:2" style histogram.
    pub fn histogram_text(&self) -> String {
        self.histogram
            .iter()
            .enumerate()
            .filter(|(_, &n)| n > 0)
            .map(|(i, n)| format!("{i}:{n}"))
            .collect::<Vec<_>>()
            .join(" ")
    }
    pub fn summary(&self) -> String {
        format!(
            "speculative: {} rounds, {} drafted, {} accepted ({:.0}%), {:.2} tokens/step, draft {:.1} ms/round, target step {:.1} ms; accepted per round {}",
            self.rounds,
            self.drafted,
            self.accepted,
            100.0 * self.acceptance(),
            self.tokens_per_round(),
            self.draft_ms_per_round(),
            self.target_ms_per_round(),
            self.histogram_text()
        )
    }
}

/// A drafter with its parameters and statistics.
pub struct Speculator {
    pub drafter: Drafter,
    pub cfg: SpecConfig,
    pub stats: SpecStats,
    pub length: DraftLength,
    /// Time the last draft took.
    last_draft: Duration,
    /// A free proposal's first token that the last round did not verify.
    shadow: Option<u32>,
    /// The last tree's expected accepted tokens by the drafter (None: the
    /// last round drafted a chain).
    predicted: Option<f64>,
    /// Rounds are written here as they are verified (`bench
    /// --spec-record`), under `category`.
    pub record: Option<AcceptTrace>,
    pub category: String,
    /// Rounds take their drafts' shape and accepted nodes from here
    /// (`bench --spec-replay`; the draft model drafts).
    pub replay: Option<Replay>,
    /// The accepted nodes the replayed round dictates.
    replayed: Option<Vec<usize>>,
}

impl Speculator {
    pub fn new(drafter: Drafter, cfg: SpecConfig) -> Speculator {
        Speculator {
            drafter,
            cfg,
            stats: SpecStats::default(),
            length: DraftLength::default(),
            last_draft: Duration::ZERO,
            shadow: None,
            predicted: None,
            record: None,
            category: String::new(),
            replay: None,
            replayed: None,
        }
    }

    /// The nodes the target accepts this round, where a replayed trace
    /// dictates them.
    pub fn replayed_path(&self) -> Option<&[usize]> {
        self.replayed.as_deref()
    }

    /// Writes a verified round to the recording, if one is kept.
    pub fn record_round(&mut self, tree: &DraftTree, path: &[usize]) {
        if let Some(r) = self.record.as_mut() {
            if !tree.is_empty() {
                r.rounds.push(TraceRound::of(&self.category, tree, path));
            }
        }
    }

    /// A replayed round: the draft model drafts a tree of the recorded
    /// shape (a chain is a tree), the accepted nodes are the recorded ones.
    fn replay_round(
        &mut self,
        context: &[u32],
        max_depth: usize,
    ) -> Result<DraftTree, EngineError> {
        let round = self.replay.as_mut().expect("replaying").next_round();
        let Drafter::Model(m) = &mut self.drafter else {
            return Ok(DraftTree::default());
        };
        let t = Instant::now();
        let (tree, map) = m.draft_shaped(0, context, &round.parent_indices(), max_depth)?;
        self.last_draft = t.elapsed();
        self.stats.draft_time += self.last_draft;
        let (tree, order) = tree.preorder();
        self.replayed = Some(
            round
                .path
                .iter()
                .map_while(|&n| map.get(n as usize).copied().flatten())
                .map(|i| order[i])
                .collect(),
        );
        Ok(tree)
    }

    /// This round's drafts to follow `context`, at most `max_depth` deep:
    /// a tree of up to `cfg.tree` nodes (with `adaptive`, the first nodes
    /// that pay best, [`DraftLength::choose_nodes`]), or a chain
    /// ([`Speculator::draft`]) without `cfg.tree`. Empty when fewer than
    /// `draft_min` nodes came.
    pub fn draft_round(
        &mut self,
        context: &[u32],
        max_depth: usize,
    ) -> Result<DraftTree, EngineError> {
        self.predicted = None;
        self.replayed = None;
        if self.replay.is_some() {
            self.shadow = None;
            return self.replay_round(context, max_depth);
        }
        if self.cfg.tree == 0 {
            return Ok(DraftTree::chain(&self.draft(context, max_depth)?));
        }
        self.last_draft = Duration::ZERO;
        self.shadow = None;
        let depth = max_depth.min(self.cfg.draft_max);
        if depth == 0 {
            return Ok(DraftTree::default());
        }
        let (t, shape) = (Instant::now(), self.tree_shape(depth));
        let tree = match &mut self.drafter {
            Drafter::Lookup(l) => l.draft_tree(context, depth, self.cfg.tree),
            Drafter::Model(m) => m.draft_tree(0, context, shape, depth)?,
            Drafter::Shared => DraftTree::default(),
        };
        Ok(self.take_tree(tree, t.elapsed()))
    }

    /// The shape of this round's tree at most `depth` deep (`cfg.tree`
    /// nodes); for a shared draft model, which the caller runs.
    pub fn tree_shape(&self, depth: usize) -> TreeShape {
        TreeShape::of(self.cfg.tree, depth.min(self.cfg.draft_max))
    }

    /// The round's drafted `tree`, which took `spent` to grow: with
    /// `adaptive`, its first nodes that pay best; empty when fewer than
    /// `draft_min` nodes; in preorder (the likeliest path in the cells a
    /// chain would take).
    pub fn take_tree(&mut self, mut tree: DraftTree, spent: Duration) -> DraftTree {
        self.predicted = None;
        self.shadow = None;
        self.last_draft = spent;
        self.stats.draft_time += spent;
        let probs: Vec<f64> = tree.nodes.iter().map(|n| f64::from(n.logp).exp()).collect();
        if self.cfg.adaptive {
            tree.truncate(self.length.choose_nodes(&probs));
        }
        if tree.len() < self.cfg.draft_min {
            tree = DraftTree::default();
        }
        self.predicted = Some(probs[..tree.len()].iter().sum());
        tree.preorder().0
    }

    /// Up to `max` (and at most `draft_max`; with `adaptive`, the length
    /// that pays best) tokens to follow `context`; empty when fewer than
    /// `draft_min` came.
    pub fn draft(&mut self, context: &[u32], max: usize) -> Result<Vec<u32>, EngineError> {
        let k = self.length(max);
        if max.min(self.cfg.draft_max) == 0 {
            return Ok(Vec::new());
        }
        let t = Instant::now();
        let d = match &mut self.drafter {
            // proposals are free: look as far as allowed, keep k
            Drafter::Lookup(l) => l.draft(context, max.min(self.cfg.draft_max)),
            Drafter::Model(m) if k > 0 => m.draft(context, k)?,
            Drafter::Model(_) | Drafter::Shared => Vec::new(),
        };
        Ok(self.take(d, k, t.elapsed()))
    }

    /// How many tokens this round should draft, given room for `max`: up
    /// to `draft_max`, and with `adaptive` the length that pays best.
    pub fn length(&mut self, max: usize) -> usize {
        let max = max.min(self.cfg.draft_max);
        self.last_draft = Duration::ZERO;
        self.shadow = None;
        if max == 0 {
            0
        } else if self.cfg.adaptive {
            self.length.choose(max)
        } else {
            max
        }
    }

    /// The round's drafts `d` (proposals, kept up to `k` = what `length`
    /// said), which took `spent` to make; empty when fewer than `draft_min`.
    pub fn take(&mut self, mut d: Vec<u32>, k: usize, spent: Duration) -> Vec<u32> {
        self.last_draft = spent;
        self.stats.draft_time += spent;
        if k == 0 {
            self.shadow = d.first().copied();
        }
        d.truncate(k);
        if d.len() < self.cfg.draft_min {
            Vec::new()
        } else {
            d
        }
    }

    /// A round verified `drafted` drafts and accepted `accepted`; its first
    /// emitted token was `first`; the target step took `step`.
    pub fn round_done(&mut self, drafted: usize, accepted: usize, first: u32, step: Duration) {
        self.stats.record(drafted, accepted, step);
        let (step, draft) = (step.as_secs_f64(), self.last_draft.as_secs_f64());
        match self.predicted.take() {
            Some(p) => self.length.record_tree(drafted, p, accepted, step, draft),
            None => self.length.record(drafted, accepted, step, draft),
        }
        if let Some(s) = self.shadow.take() {
            self.length.shadow(s == first);
        }
    }

    /// Whether drafts come from a model (which computes on the device or
    /// cores the target uses).
    pub fn uses_model(&self) -> bool {
        matches!(self.drafter, Drafter::Model(_) | Drafter::Shared)
    }

    /// A new conversation: the draft model's cache no longer applies.
    pub fn reset(&mut self) {
        self.replayed = None;
        if let Drafter::Model(m) = &mut self.drafter {
            m.clear();
        }
    }
}

/// Verifies `drafts` against the target's logit rows (`rows[i]`: the logits
/// after the cache's last token and `drafts[..i]`, `n_vocab` each): samples
/// row 0, 1, ... with `sampler` as plain decoding would and hands each
/// token to `emit` with whether it equals the draft at that row. Goes on to
/// the next row while it does and `emit` returns true. Returns the number
/// of drafts accepted.
pub fn verify(
    sampler: &mut crate::sample::Sampler,
    rows: &[f32],
    n_vocab: usize,
    drafts: &[u32],
    mut emit: impl FnMut(u32, bool) -> bool,
) -> Result<usize, crate::sample::SampleError> {
    verify_with(sampler, rows, n_vocab, drafts, |t, v, _| emit(t, v))
}

/// [`verify`], handing `emit` the sampler right after it drew the token
/// (whose last draw's distribution [`crate::sample::Sampler::sampled_logprob`]
/// reports).
pub fn verify_with(
    sampler: &mut crate::sample::Sampler,
    rows: &[f32],
    n_vocab: usize,
    drafts: &[u32],
    mut emit: impl FnMut(u32, bool, &mut crate::sample::Sampler) -> bool,
) -> Result<usize, crate::sample::SampleError> {
    // a chain is a tree whose nodes have one child each
    let path = verify_tree(
        sampler,
        rows,
        n_vocab,
        &DraftTree::chain(drafts),
        |t, n, s| emit(t, n.is_some(), s),
    )?;
    Ok(path.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::{Sampler, SamplerConfig};

    const V: usize = 8;

    fn cfg(seed: u64) -> SamplerConfig {
        SamplerConfig {
            temperature: 0.8,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.3,
            repeat_last_n: 64,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            seed,
            logit_bias: Vec::new(),
        }
    }

    /// Two rows of logits: after the context, and after the context + token 2.
    fn rows() -> Vec<f32> {
        let r0 = [0.5f32, 1.0, 2.0, 0.1, -1.0, 1.5, 0.0, 0.7];
        let r1 = [1.2f32, -0.5, 2.2, 0.9, 0.3, 1.1, -2.0, 0.4];
        r0.iter().chain(&r1).copied().collect()
    }

    /// What the sampler draws from: penalized logits / temperature, softmax.
    fn dist(row: &[f32], history: &[u32], c: &SamplerConfig) -> Vec<f64> {
        let l: Vec<f64> = row
            .iter()
            .enumerate()
            .map(|(i, &x)| {
                let x = if history.contains(&(i as u32)) {
                    if x > 0.0 {
                        x / c.repeat_penalty
                    } else {
                        x * c.repeat_penalty
                    }
                } else {
                    x
                };
                f64::from(x) / f64::from(c.temperature)
            })
            .collect();
        let m = l.iter().cloned().fold(f64::MIN, f64::max);
        let z: f64 = l.iter().map(|x| (x - m).exp()).sum();
        l.iter().map(|x| (x - m).exp() / z).collect()
    }

    /// Pearson's chi-square of counts against probabilities.
    fn chi2(counts: &[u64], p: &[f64]) -> f64 {
        let n: u64 = counts.iter().sum();
        counts
            .iter()
            .zip(p)
            .map(|(&o, &p)| {
                let e = p * n as f64;
                (o as f64 - e).powi(2) / e
            })
            .sum()
    }

    /// Two tokens by plain decoding: row 0, then the row after the first
    /// token (only row 1 exists here, so only runs whose first token is 2
    /// are comparable).
    fn plain(seed: u64) -> (u32, Option<u32>) {
        let mut s = Sampler::new(cfg(seed)).unwrap();
        let r = rows();
        let mut y = Vec::new();
        verify(&mut s, &r[..V], V, &[], |t, _| {
            y.push(t);
            true
        })
        .unwrap();
        if y[0] == 2 {
            verify(&mut s, &r[V..], V, &[], |t, _| {
                y.push(t);
                true
            })
            .unwrap();
        }
        (y[0], y.get(1).copied())
    }

    /// The same with token 2 drafted and verified in one step.
    fn drafted(seed: u64) -> (u32, Option<u32>, usize) {
        let mut s = Sampler::new(cfg(seed)).unwrap();
        let mut y = Vec::new();
        let n = verify(&mut s, &rows(), V, &[2], |t, _| {
            y.push(t);
            true
        })
        .unwrap();
        (y[0], y.get(1).copied(), n)
    }

    #[test]
    fn drafting_emits_the_tokens_plain_decoding_emits() {
        let mut accepted = 0;
        for seed in 0..2000 {
            let (a0, a1) = plain(seed);
            let (b0, b1, n) = drafted(seed);
            assert_eq!((a0, a1), (b0, b1), "seed {seed}");
            assert_eq!(n, usize::from(b0 == 2));
            accepted += n;
        }
        // the draft is the most likely token: accepted often, not always
        assert!((500..1500).contains(&accepted), "{accepted}");
    }

    /// Chi-square (7 degrees of freedom; 24.3 is the 0.001 critical value)
    /// of the first token and of the token after an accepted draft, with
    /// and without drafting, against the distribution the sampler defines.
    #[test]
    fn sampled_tokens_follow_the_targets_distribution() {
        let c = cfg(0);
        let r = rows();
        let p0 = dist(&r[..V], &[], &c);
        let p1 = dist(&r[V..], &[2], &c);
        for with_draft in [false, true] {
            let (mut first, mut second) = ([0u64; V], [0u64; V]);
            for seed in 0..20000 {
                let (y0, y1) = if with_draft {
                    let (a, b, _) = drafted(seed);
                    (a, b)
                } else {
                    plain(seed)
                };
                first[y0 as usize] += 1;
                if let Some(y1) = y1 {
                    second[y1 as usize] += 1;
                }
            }
            let (x0, x1) = (chi2(&first, &p0), chi2(&second, &p1));
            assert!(x0 < 24.3, "first token, draft {with_draft}: chi2 {x0}");
            assert!(x1 < 24.3, "second token, draft {with_draft}: chi2 {x1}");
        }
    }

    #[test]
    fn greedy_accepts_the_argmax_prefix() {
        let mut s = Sampler::new(SamplerConfig::greedy()).unwrap();
        let mut r = rows();
        r.extend_from_slice(&rows()[..V]);
        let mut y = Vec::new();
        // argmaxes: row0 2, row1 2, row2 2; drafts 2, 2 then a miss
        let n = verify(&mut s, &r, V, &[2, 2], |t, _| {
            y.push(t);
            true
        })
        .unwrap();
        assert_eq!((n, y), (2, vec![2, 2, 2]));
        let mut y = Vec::new();
        let n = verify(&mut s, &r, V, &[5, 2], |t, _| {
            y.push(t);
            true
        })
        .unwrap();
        assert_eq!((n, y), (0, vec![2]));
    }

    #[test]
    fn emit_can_stop_verification() {
        let mut s = Sampler::new(SamplerConfig::greedy()).unwrap();
        let r: Vec<f32> = rows().iter().chain(&rows()).copied().collect();
        let mut y = Vec::new();
        let n = verify(&mut s, &r, V, &[2, 2, 2], |t, _| {
            y.push(t);
            false
        })
        .unwrap();
        assert_eq!((n, y), (0, vec![2]));
    }

    #[test]
    fn stats_count_rounds_with_drafts() {
        let mut st = SpecStats::default();
        st.record(0, 0, Duration::from_millis(5));
        st.record(4, 2, Duration::from_millis(10));
        st.record(4, 4, Duration::from_millis(10));
        st.record(3, 0, Duration::from_millis(10));
        assert_eq!((st.rounds, st.drafted, st.accepted), (3, 11, 6));
        assert_eq!(st.histogram_text(), "0:1 2:1 4:1");
        assert!((st.tokens_per_round() - 3.0).abs() < 1e-12);
    }
}
