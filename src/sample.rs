//! Token sampler: turns one row of logits into the next token id.
//!
//! The chain follows llama.cpp's common sampler (`common/sampling.cpp`, with the
//! individual stages in `src/llama-sampler.cpp` of the vendored llama.cpp,
//! vendor/llama.cpp.tar.xz), restricted to the stages strata exposes, applied in this order:
//!
//! 0. logit bias: each `(token, bias)` of `logit_bias` adds `bias` to that
//!    token's logit (llama.cpp's `logit-bias` stage, first in its chain;
//!    OpenAI's `logit_bias`), so it moves greedy decoding too;
//! 1. penalties over the last `repeat_last_n` accepted tokens, llama.cpp's
//!    `penalties` stage: each *distinct* token in the window has its logit
//!    divided by `repeat_penalty` when positive, multiplied by it otherwise
//!    (once, however often it repeats), then lowered by
//!    `count * frequency_penalty + presence_penalty` (OpenAI's two penalties);
//! 2. top-k: keep the `top_k` highest logits;
//! 3. top-p (nucleus): keep the smallest prefix of the probability-sorted
//!    candidates whose cumulative probability reaches `top_p` (at least one);
//! 4. min-p: keep candidates with `p >= min_p * p_max`;
//! 5. temperature: divide the surviving logits by `temperature`;
//! 6. one seeded draw from the softmax of what is left.
//!
//! Top-p and min-p see the penalized logits *before* temperature, as in
//! llama.cpp. `temperature <= 0` short-cuts the chain to greedy decoding: the
//! argmax of the penalized logits (the filters never remove the argmax).
//!
//! Invariants:
//! - Ties are broken by the lowest token id everywhere (argmax, top-k cut,
//!   top-p cut), so results never depend on sort stability.
//! - The returned token always has a finite logit. `-inf` marks a masked token
//!   and is never returned; NaN or `+inf` is rejected with
//!   [`SampleError::NonFiniteLogits`]. The penalty never turns a finite logit
//!   into an infinite one (it saturates at `f32::MIN`/`f32::MAX`).
//! - `sample` does not record the token; the caller calls `accept` for the
//!   token it actually emits (which may differ, e.g. under a grammar).
//! - A non-greedy `sample` consumes exactly one draw from the ChaCha stream,
//!   greedy consumes none, so a run is reproducible from `seed` alone.
//! - After the first call, `sample` allocates nothing as long as the vocabulary
//!   size does not grow: candidates and the penalty window live in scratch
//!   buffers owned by the [`Sampler`].
//! - A [`Constraint`] (a grammar: `response_format` json_object in serve)
//!   comes before stage 0: it sets the logit of every token it forbids to
//!   `-inf` in a copy of the row, and the chain then samples as usual, so
//!   the token drawn is always one the constraint allows. The constraint
//!   sees only the tokens accepted after [`Sampler::constrain`] (not the
//!   prompt the penalties see), and is no part of [`SamplerState`].

use std::cmp::Ordering;
use std::collections::VecDeque;

mod error;
pub mod logprobs;
pub use error::SampleError;

use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha20Rng;

/// Seed used by [`SamplerConfig::default`].
///
/// llama-cli defaults to `0xFFFF_FFFF`, meaning "pick a random seed". strata
/// uses a fixed seed instead so that two runs with default settings produce the
/// same text; pass a different `seed` (e.g. from the clock) for fresh output.
pub const DEFAULT_SEED: u64 = 1234;

/// A seed nobody chose: what `-s` defaults to (and a negative seed, as
/// llama.cpp's -1, asks for), different in every call and every process.
/// From the standard library's per-process random hash keys (the OS's
/// randomness) mixed with the clock.
pub fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    h.write_u128(now);
    h.finish()
}

/// Sampling parameters. Field meanings and defaults follow llama-cli.
#[derive(Clone, Debug)]
pub struct SamplerConfig {
    /// Softmax temperature. `<= 0` means greedy (argmax). Must not be NaN/inf.
    pub temperature: f32,
    /// Keep this many highest-logit tokens. `<= 0` disables top-k.
    pub top_k: i32,
    /// Nucleus threshold in `(0, 1]`. `1` disables top-p.
    pub top_p: f32,
    /// Relative probability floor in `[0, 1]`. `0` disables min-p.
    pub min_p: f32,
    /// Repetition penalty, `> 0`. `1` disables it; `< 1` favours repeats.
    pub repeat_penalty: f32,
    /// How many of the most recently accepted tokens the penalty looks at.
    /// `0` disables the penalty.
    pub repeat_last_n: usize,
    /// Subtracted from a logit once per occurrence in the window. `0` disables it.
    pub frequency_penalty: f32,
    /// Subtracted once from the logit of every token in the window. `0` disables it.
    pub presence_penalty: f32,
    /// Seed of the ChaCha20 stream behind the random draw.
    pub seed: u64,
    /// `(token, bias)`: added to the token's logit before every other
    /// stage. A bias of `-inf` bans the token; NaN and `+inf` are refused.
    /// Ids outside the vocabulary are ignored. Empty: no bias.
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplerConfig {
    /// llama-cli's defaults (temp 0.8, top-k 40, top-p 0.95, min-p 0.05,
    /// repeat penalty 1.0 over 64 tokens), except the seed: [`DEFAULT_SEED`]
    /// rather than "random", so default runs are reproducible.
    fn default() -> Self {
        Self {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            seed: DEFAULT_SEED,
            logit_bias: Vec::new(),
        }
    }
}

impl SamplerConfig {
    /// Deterministic argmax decoding: temperature 0, every filter and the
    /// repetition penalty off.
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            ..Self::default()
        }
    }

    /// Checks every parameter; the error names the first offending one.
    pub fn validate(&self) -> Result<(), SampleError> {
        if !self.temperature.is_finite() {
            return Err(invalid(
                "temperature",
                self.temperature,
                "must be finite (<= 0 means greedy)",
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(invalid(
                "top_p",
                self.top_p,
                "must be in (0, 1] (1 disables top-p)",
            ));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(invalid(
                "min_p",
                self.min_p,
                "must be in [0, 1] (0 disables min-p)",
            ));
        }
        if !(self.repeat_penalty > 0.0 && self.repeat_penalty.is_finite()) {
            return Err(invalid(
                "repeat_penalty",
                self.repeat_penalty,
                "must be finite and > 0 (1 disables the penalty)",
            ));
        }
        for (name, v) in [
            ("frequency_penalty", self.frequency_penalty),
            ("presence_penalty", self.presence_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(invalid(name, v, "must be in [-2, 2] (0 disables it)"));
            }
        }
        if let Some(&(_, b)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| b.is_nan() || *b == f32::INFINITY)
        {
            return Err(invalid(
                "logit_bias",
                b,
                "must be a number or -inf (which bans the token)",
            ));
        }
        Ok(())
    }

    fn penalty_enabled(&self) -> bool {
        (self.repeat_penalty != 1.0
            || self.frequency_penalty != 0.0
            || self.presence_penalty != 0.0)
            && self.repeat_last_n > 0
    }
}

fn invalid(name: &'static str, value: f32, reason: &'static str) -> SampleError {
    SampleError::InvalidParameter {
        name,
        value: value.to_string(),
        reason,
    }
}

/// A rule on which tokens may come next (a grammar), applied before the
/// sampling chain. The sampler calls `mask` on a copy of each row it
/// samples and `accept` with each token accepted after that row.
pub trait Constraint: Send + std::fmt::Debug {
    /// Sets the logit of every token that may not come next to `-inf`
    /// (`logits`: `F32 [n_vocab]`; others are left as they are).
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), SampleError>;
    /// Moves past `token`, which the last `mask` allowed; an error (the
    /// token was not allowed) leaves the constraint unchanged.
    fn accept(&mut self, token: u32) -> Result<(), SampleError>;
    /// Back to the start, as if nothing had been accepted.
    fn reset(&mut self);
}

/// One token under consideration: its id and its (possibly penalized) logit.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Candidate {
    id: u32,
    logit: f32,
}

/// Stateful sampler: config, seeded RNG, penalty history, scratch buffers.
#[derive(Debug)]
pub struct Sampler {
    cfg: SamplerConfig,
    rng: ChaCha20Rng,
    /// The last `repeat_last_n` accepted tokens, oldest first.
    history: VecDeque<u32>,
    /// Scratch: one entry per token, filtered in place by the chain.
    candidates: Vec<Candidate>,
    /// Scratch: the distinct tokens of `history`.
    window: Vec<u32>,
    /// Applied before the chain, when set ([`Sampler::constrain`]).
    constraint: Option<Box<dyn Constraint>>,
    /// Scratch: the row the constraint masks.
    masked: Vec<f32>,
    /// Why the constraint refused an accepted token: every later `sample`
    /// fails with it (`accept` itself cannot fail).
    constraint_error: Option<String>,
    /// Scratch of [`Sampler::sampled_logprob`]: the last draw's tokens in
    /// id order and their logits over the temperature, and top-k ids.
    dist_ids: Vec<u32>,
    dist: Vec<f32>,
    top: Vec<u32>,
}

/// Upper bound on memory reserved up front for the history ring; a larger
/// `repeat_last_n` still works, the ring just grows as tokens arrive.
const HISTORY_RESERVE_MAX: usize = 4096;

impl Sampler {
    /// Validates `cfg` and seeds the RNG from `cfg.seed`.
    pub fn new(cfg: SamplerConfig) -> Result<Self, SampleError> {
        cfg.validate()?;
        let reserve = cfg.repeat_last_n.min(HISTORY_RESERVE_MAX);
        Ok(Self {
            rng: ChaCha20Rng::seed_from_u64(cfg.seed),
            history: VecDeque::with_capacity(reserve),
            candidates: Vec::new(),
            window: Vec::with_capacity(reserve),
            cfg,
            constraint: None,
            masked: Vec::new(),
            constraint_error: None,
            dist_ids: Vec::new(),
            dist: Vec::new(),
            top: Vec::new(),
        })
    }

    /// Applies `c` before the chain from now on: it sees the tokens
    /// accepted from here (tokens accepted before, a prompt, feed only the
    /// penalties).
    pub fn constrain(&mut self, c: Box<dyn Constraint>) {
        self.constraint = Some(c);
        self.constraint_error = None;
    }

    /// Whether a constraint is set.
    pub fn is_constrained(&self) -> bool {
        self.constraint.is_some()
    }

    /// The configuration this sampler was built with.
    pub fn config(&self) -> &SamplerConfig {
        &self.cfg
    }

    /// Picks the next token from one row of logits (`F32 [n_vocab]`).
    ///
    /// Does not record the token: call [`Sampler::accept`] with the token that
    /// is actually emitted.
    pub fn sample(&mut self, logits: &[f32]) -> Result<u32, SampleError> {
        if logits.is_empty() {
            return Err(SampleError::EmptyLogits);
        }
        if logits.iter().any(|l| l.is_nan() || *l == f32::INFINITY) {
            return Err(SampleError::NonFiniteLogits);
        }
        if u32::try_from(logits.len()).is_err() {
            return Err(SampleError::InvalidParameter {
                name: "logits",
                value: logits.len().to_string(),
                reason: "vocabulary larger than u32 token ids can address",
            });
        }
        if let Some(e) = &self.constraint_error {
            return Err(SampleError::Constraint(e.clone()));
        }
        let logits = match self.constraint.as_mut() {
            Some(c) => {
                self.masked.clear();
                self.masked.extend_from_slice(logits);
                c.mask(&mut self.masked)?;
                &self.masked[..]
            }
            None => logits,
        };

        self.candidates.clear();
        self.candidates.extend(
            (0u32..)
                .zip(logits)
                .map(|(id, &logit)| Candidate { id, logit }),
        );
        apply_bias(&mut self.candidates, &self.cfg.logit_bias);
        if self.cfg.penalty_enabled() {
            apply_penalties(
                &mut self.candidates,
                &self.history,
                &mut self.window,
                Penalties {
                    repeat: self.cfg.repeat_penalty,
                    frequency: self.cfg.frequency_penalty,
                    presence: self.cfg.presence_penalty,
                },
            );
        }
        // Masked tokens can never be drawn; dropping them keeps every later
        // stage working on finite logits only.
        self.candidates.retain(|c| c.logit > f32::NEG_INFINITY);
        if self.candidates.is_empty() {
            return Err(SampleError::EmptyLogits);
        }

        if self.cfg.temperature <= 0.0 {
            return best(&self.candidates)
                .map(|c| c.id)
                .ok_or(SampleError::EmptyLogits);
        }

        let mut sorted = apply_top_k(&mut self.candidates, self.cfg.top_k);
        apply_top_p(&mut self.candidates, self.cfg.top_p, &mut sorted);
        apply_min_p(&mut self.candidates, self.cfg.min_p);

        let u = uniform01(&mut self.rng);
        draw(&self.candidates, self.cfg.temperature, u).ok_or(SampleError::EmptyLogits)
    }

    /// `token`'s logprob in the distribution the last [`Sampler::sample`]
    /// drew from, and that distribution's `k` most likely tokens: the
    /// logits after the constraint, the bias and the penalties, the tokens
    /// top-k, top-p and min-p kept, at the temperature. A token the draw
    /// could not pick has logprob `-inf`; the kept tokens' probabilities
    /// sum to 1. Greedy decoding (temperature 0) picks the maximum of that
    /// distribution, reported at temperature 1 over every token left
    /// (filters do not apply to it).
    pub fn sampled_logprob(
        &mut self,
        token: u32,
        k: usize,
    ) -> Result<logprobs::TokenLogprob, SampleError> {
        let t = if self.cfg.temperature > 0.0 {
            self.cfg.temperature
        } else {
            1.0
        };
        // in id order, so ties among the alternatives go to the lower id
        // (the candidates are rebuilt by the next draw)
        if !self.candidates.is_sorted_by_key(|c| c.id) {
            self.candidates.sort_unstable_by_key(|c| c.id);
        }
        self.dist_ids.clear();
        self.dist_ids.extend(self.candidates.iter().map(|c| c.id));
        self.dist.clear();
        self.dist
            .extend(self.candidates.iter().map(|c| c.logit / t));
        let at = self.dist_ids.binary_search(&token).ok();
        let mut lp = logprobs::token_logprob(&self.dist, at.unwrap_or(0) as u32, k, &mut self.top)?;
        lp.token = token;
        if at.is_none() {
            // not drawable: its logprob is -inf, the alternatives stand
            lp.logprob = f32::NEG_INFINITY;
        }
        lp.top
            .iter_mut()
            .for_each(|e| e.0 = self.dist_ids[e.0 as usize]);
        Ok(lp)
    }

    /// Records an emitted token in the repetition-penalty history, and
    /// moves the constraint past it. A token the constraint refuses makes
    /// every later `sample` fail.
    pub fn accept(&mut self, token: u32) {
        if let Some(c) = self.constraint.as_mut() {
            if self.constraint_error.is_none() {
                if let Err(e) = c.accept(token) {
                    self.constraint_error = Some(e.to_string());
                }
            }
        }
        let n = self.cfg.repeat_last_n;
        if n == 0 {
            return;
        }
        while self.history.len() >= n {
            self.history.pop_front();
        }
        self.history.push_back(token);
    }

    /// Forgets the history, resets the constraint and restarts the random
    /// stream from `seed`, so the next calls reproduce a fresh sampler's
    /// output.
    pub fn reset(&mut self) {
        self.history.clear();
        if let Some(c) = self.constraint.as_mut() {
            c.reset();
        }
        self.constraint_error = None;
        self.rng = ChaCha20Rng::seed_from_u64(self.cfg.seed);
    }
}

/// What a sampler needs to go on exactly where it stopped: the seed, how
/// far its random stream has advanced, and the penalty history.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SamplerState {
    pub seed: u64,
    pub word_pos: u128,
    pub history: Vec<u32>,
}

impl Sampler {
    pub fn state(&self) -> SamplerState {
        SamplerState {
            seed: self.cfg.seed,
            word_pos: self.rng.get_word_pos(),
            history: self.history.iter().copied().collect(),
        }
    }
    /// Continues from `s` (its seed replaces the configured one).
    pub fn restore(&mut self, s: &SamplerState) {
        self.cfg.seed = s.seed;
        self.rng = ChaCha20Rng::seed_from_u64(s.seed);
        self.rng.set_word_pos(s.word_pos);
        self.history = s.history.iter().copied().collect();
        while self.history.len() > self.cfg.repeat_last_n {
            self.history.pop_front();
        }
    }
}

/// Index of the largest logit, lowest index on ties; NaN entries are ignored.
/// `None` for an empty slice or one holding only NaN.
pub fn argmax(logits: &[f32]) -> Option<u32> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &l) in logits.iter().enumerate() {
        if l.is_nan() {
            continue;
        }
        match best {
            Some((_, b)) if l <= b => {}
            _ => best = Some((i, l)),
        }
    }
    best.and_then(|(i, _)| u32::try_from(i).ok())
}

/// llama.cpp's repetition penalty for one logit, saturating so that a finite
/// logit stays finite.
fn penalize(logit: f32, penalty: f32) -> f32 {
    let out = if logit > 0.0 {
        logit / penalty
    } else {
        logit * penalty
    };
    if logit.is_finite() {
        out.clamp(f32::MIN, f32::MAX)
    } else {
        out
    }
}

/// Adds each bias to its token's logit, saturating so that a finite logit
/// stays finite (a `-inf` bias masks the token). `cands` must still be
/// indexed by token id; ids outside the vocabulary are ignored.
fn apply_bias(cands: &mut [Candidate], bias: &[(u32, f32)]) {
    for &(t, b) in bias {
        if let Some(c) = usize::try_from(t).ok().and_then(|i| cands.get_mut(i)) {
            let l = c.logit + b;
            c.logit = if c.logit.is_finite() && b.is_finite() {
                l.clamp(f32::MIN, f32::MAX)
            } else {
                l
            };
        }
    }
}

/// The three penalties of llama.cpp's `penalties` stage.
#[derive(Clone, Copy)]
struct Penalties {
    repeat: f32,
    frequency: f32,
    presence: f32,
}

/// Penalizes each distinct token of `history` once: the repetition penalty,
/// then `count * frequency + presence` subtracted. `cands` must still be
/// indexed by token id; ids outside the vocabulary are ignored.
fn apply_penalties(
    cands: &mut [Candidate],
    history: &VecDeque<u32>,
    window: &mut Vec<u32>,
    p: Penalties,
) {
    window.clear();
    window.extend(history.iter().copied());
    window.sort_unstable();
    for run in window.chunk_by(|a, b| a == b) {
        let t = run[0];
        if let Some(c) = usize::try_from(t).ok().and_then(|i| cands.get_mut(i)) {
            let mut l = penalize(c.logit, p.repeat);
            if l.is_finite() && (p.frequency != 0.0 || p.presence != 0.0) {
                l = (l - run.len() as f32 * p.frequency - p.presence).clamp(f32::MIN, f32::MAX);
            }
            c.logit = l;
        }
    }
}

/// Descending logit, then ascending id: a strict total order on candidates
/// (which never hold NaN). `-0.0` and `0.0` compare equal, so they tie on id.
fn by_logit_desc(a: &Candidate, b: &Candidate) -> Ordering {
    b.logit
        .partial_cmp(&a.logit)
        .unwrap_or(Ordering::Equal)
        .then(a.id.cmp(&b.id))
}

/// The highest-logit candidate, lowest id on ties.
fn best(cands: &[Candidate]) -> Option<Candidate> {
    cands.iter().copied().min_by(by_logit_desc)
}

/// Keeps the `k` best candidates. Returns whether `cands` is now sorted by
/// [`by_logit_desc`].
fn apply_top_k(cands: &mut Vec<Candidate>, k: i32) -> bool {
    let Ok(k) = usize::try_from(k) else {
        return false;
    };
    if k == 0 || k >= cands.len() {
        return false;
    }
    cands.select_nth_unstable_by(k - 1, by_logit_desc);
    cands.truncate(k);
    cands.sort_unstable_by(by_logit_desc);
    true
}

/// Keeps the smallest best-first prefix whose softmax mass reaches `p`.
fn apply_top_p(cands: &mut Vec<Candidate>, p: f32, sorted: &mut bool) {
    if p >= 1.0 || cands.is_empty() {
        return;
    }
    if !*sorted {
        cands.sort_unstable_by(by_logit_desc);
        *sorted = true;
    }
    let max = f64::from(cands[0].logit);
    let total: f64 = cands.iter().map(|c| (f64::from(c.logit) - max).exp()).sum();
    let mut cum = 0.0;
    let mut keep = cands.len();
    for (i, c) in cands.iter().enumerate() {
        cum += (f64::from(c.logit) - max).exp() / total;
        if cum >= f64::from(p) {
            keep = i + 1;
            break;
        }
    }
    cands.truncate(keep);
}

/// Keeps candidates whose probability is at least `min_p` times the largest.
/// Preserves order, and always keeps the best candidate.
fn apply_min_p(cands: &mut Vec<Candidate>, min_p: f32) {
    if min_p <= 0.0 {
        return;
    }
    let Some(top) = best(cands) else {
        return;
    };
    let max = f64::from(top.logit);
    let floor = f64::from(min_p);
    cands.retain(|c| (f64::from(c.logit) - max).exp() >= floor);
}

/// Inverse-CDF draw from `softmax(logit / temperature)` with `u` in `[0, 1)`.
/// Works in f64 on `logit - max`, so tiny temperatures cannot overflow.
/// Returns `None` only for an empty slice.
fn draw(cands: &[Candidate], temperature: f32, u: f64) -> Option<u32> {
    let max = f64::from(best(cands)?.logit);
    let t = f64::from(temperature);
    let weight = |c: &Candidate| ((f64::from(c.logit) - max) / t).exp();
    let total: f64 = cands.iter().map(weight).sum();
    let target = u * total;
    let mut cum = 0.0;
    let mut last_positive = None;
    for c in cands {
        let w = weight(c);
        if w > 0.0 {
            last_positive = Some(c.id);
        }
        cum += w;
        if cum > target {
            return Some(c.id);
        }
    }
    // Rounding left `target` at or above the final sum: take the last token
    // that had any mass (the best candidate always has weight 1).
    last_positive
}

/// Uniform f64 in `[0, 1)` from the top 53 bits of one `u64`.
fn uniform01(rng: &mut ChaCha20Rng) -> f64 {
    (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cfg(temperature: f32) -> SamplerConfig {
        SamplerConfig {
            temperature,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            seed: 7,
            logit_bias: Vec::new(),
        }
    }

    fn sampler(c: SamplerConfig) -> Sampler {
        match Sampler::new(c) {
            Ok(s) => s,
            Err(e) => panic!("valid config rejected: {e}"),
        }
    }

    fn cands(logits: &[f32]) -> Vec<Candidate> {
        (0u32..)
            .zip(logits)
            .map(|(id, &logit)| Candidate { id, logit })
            .collect()
    }

    fn ids(c: &[Candidate]) -> Vec<u32> {
        let mut v: Vec<u32> = c.iter().map(|c| c.id).collect();
        v.sort_unstable();
        v
    }

    /// Logits whose softmax is exactly `probs` (up to rounding).
    fn from_probs(probs: &[f32]) -> Vec<f32> {
        probs.iter().map(|p| p.ln()).collect()
    }

    fn counts(s: &mut Sampler, logits: &[f32], n: usize) -> Vec<usize> {
        let mut out = vec![0; logits.len()];
        for _ in 0..n {
            let t = s.sample(logits).expect("finite logits");
            out[t as usize] += 1;
        }
        out
    }

    #[test]
    fn argmax_basics() {
        assert_eq!(argmax(&[]), None);
        assert_eq!(argmax(&[f32::NAN]), None);
        assert_eq!(argmax(&[0.1, 3.0, -2.0]), Some(1));
        assert_eq!(argmax(&[2.0, 5.0, 5.0, 1.0]), Some(1));
        assert_eq!(argmax(&[f32::NAN, 1.0, f32::NAN, 1.0]), Some(1));
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), Some(0));
    }

    #[test]
    fn greedy_picks_argmax_with_lowest_id_on_ties() {
        let mut s = sampler(SamplerConfig::greedy());
        assert_eq!(s.sample(&[0.1, 3.0, -2.0, 2.9]).ok(), Some(1));
        assert_eq!(s.sample(&[1.0, 4.0, 4.0, 4.0]).ok(), Some(1));
        assert_eq!(s.sample(&[f32::NEG_INFINITY, -5.0, -5.0]).ok(), Some(1));
        // Greedy ignores the filters and the seed.
        let mut s = sampler(SamplerConfig {
            temperature: -1.0,
            seed: 99,
            ..SamplerConfig::default()
        });
        assert_eq!(s.sample(&[0.0, 0.5, 0.25]).ok(), Some(1));
    }

    #[test]
    fn top_k_one_equals_greedy_at_any_temperature() {
        let logits = [0.3, 2.0, -1.0, 2.0, 1.9, 0.0];
        for temp in [0.01, 0.5, 1.0, 5.0, 1000.0] {
            for seed in 0..20 {
                let mut s = sampler(SamplerConfig {
                    top_k: 1,
                    seed,
                    ..cfg(temp)
                });
                assert_eq!(s.sample(&logits).ok(), Some(1), "temp {temp} seed {seed}");
            }
        }
    }

    #[test]
    fn random_seeds_differ() {
        let seeds: std::collections::HashSet<u64> = (0..64).map(|_| random_seed()).collect();
        assert_eq!(seeds.len(), 64);
    }

    #[test]
    fn same_seed_same_sequence_different_seed_differs() {
        let logits = vec![0.0_f32; 100];
        let run = |seed| {
            let mut s = sampler(SamplerConfig { seed, ..cfg(1.0) });
            (0..50)
                .map(|_| s.sample(&logits).expect("finite logits"))
                .collect::<Vec<_>>()
        };
        assert_eq!(run(1), run(1));
        // Uniform over 100 tokens: two seeds agree on 50 draws with p = 1e-100.
        assert_ne!(run(1), run(2));
    }

    #[test]
    fn reset_replays_the_stream_and_clears_history() {
        let logits = [0.5, 1.0, 1.5, 0.2];
        let mut s = sampler(SamplerConfig {
            repeat_penalty: 1.3,
            ..cfg(1.0)
        });
        let first: Vec<u32> = (0..20).map(|_| s.sample(&logits).unwrap_or(99)).collect();
        s.accept(2);
        s.accept(2);
        s.reset();
        assert!(s.history.is_empty());
        let again: Vec<u32> = (0..20).map(|_| s.sample(&logits).unwrap_or(99)).collect();
        assert_eq!(first, again);
    }

    #[test]
    fn history_keeps_only_the_last_n_tokens() {
        let mut s = sampler(SamplerConfig {
            repeat_last_n: 3,
            ..cfg(1.0)
        });
        for t in 0..10 {
            s.accept(t);
        }
        assert_eq!(s.history.iter().copied().collect::<Vec<_>>(), [7, 8, 9]);
        let mut off = sampler(SamplerConfig {
            repeat_last_n: 0,
            ..cfg(1.0)
        });
        off.accept(1);
        assert!(off.history.is_empty());
    }

    #[test]
    fn penalty_matches_hand_computed_values() {
        // Token 1 repeats but is penalized once; token 2 (0.5) is not in the
        // window; token 5 is outside the vocabulary and ignored.
        let mut c = cands(&[2.0, -1.0, 0.5, 3.0]);
        let history: VecDeque<u32> = [0, 1, 1, 5].into_iter().collect();
        let mut window = Vec::new();
        apply_penalties(
            &mut c,
            &history,
            &mut window,
            Penalties {
                repeat: 2.0,
                frequency: 0.0,
                presence: 0.0,
            },
        );
        let got: Vec<f32> = c.iter().map(|c| c.logit).collect();
        assert_eq!(got, [1.0, -2.0, 0.5, 3.0]);
        // A zero logit is unchanged (0 * penalty), as in llama.cpp.
        assert_eq!(penalize(0.0, 2.0), 0.0);
        // Saturates instead of overflowing; -inf stays masked.
        assert_eq!(penalize(f32::MIN, 4.0), f32::MIN);
        assert_eq!(penalize(f32::MAX, 0.25), f32::MAX);
        assert_eq!(penalize(f32::NEG_INFINITY, 2.0), f32::NEG_INFINITY);
    }

    #[test]
    fn frequency_and_presence_penalties_follow_llama_cpp() {
        // llama.cpp: logit -= count * frequency + (count > 0) * presence,
        // after the repetition penalty, once per distinct token
        let mut c: Vec<Candidate> = [1.0f32, 2.0, -1.0, 3.0]
            .iter()
            .enumerate()
            .map(|(i, &logit)| Candidate {
                id: i as u32,
                logit,
            })
            .collect();
        let history: VecDeque<u32> = [1, 1, 1, 2].into_iter().collect();
        let mut window = Vec::new();
        let p = Penalties {
            repeat: 2.0,
            frequency: 0.5,
            presence: 0.25,
        };
        apply_penalties(&mut c, &history, &mut window, p);
        let got: Vec<f32> = c.iter().map(|c| c.logit).collect();
        assert_eq!(got, [1.0, 1.0 - 1.5 - 0.25, -2.0 - 0.5 - 0.25, 3.0]);
        // a configuration with only a frequency penalty turns the stage on
        let cfg = SamplerConfig {
            frequency_penalty: 1.0,
            ..SamplerConfig::greedy()
        };
        assert!(cfg.validate().is_ok());
        let mut s = Sampler::new(cfg).unwrap();
        s.accept(3);
        assert_eq!(s.sample(&[1.0, 0.0, 0.0, 1.5]).unwrap(), 0);
        let bad = SamplerConfig {
            presence_penalty: 3.0,
            ..SamplerConfig::greedy()
        };
        assert!(bad.validate().is_err());
    }

    #[test]
    fn penalty_window_is_last_n_and_flips_greedy_choice() {
        let mut s = sampler(SamplerConfig {
            repeat_penalty: 2.0,
            repeat_last_n: 2,
            ..cfg(0.0)
        });
        let logits = [3.0, 2.0, 1.0];
        s.accept(0);
        // 3.0 / 2 = 1.5 < 2.0: token 1 wins now.
        assert_eq!(s.sample(&logits).ok(), Some(1));
        // Token 0 falls out of the 2-token window again.
        s.accept(2);
        s.accept(2);
        assert_eq!(s.sample(&logits).ok(), Some(0));
    }

    #[test]
    fn penalty_lowers_a_repeated_tokens_frequency() {
        let logits = [1.0, 1.0];
        let mut plain = sampler(cfg(1.0));
        let mut pen = sampler(SamplerConfig {
            repeat_penalty: 1.5,
            ..cfg(1.0)
        });
        pen.accept(0);
        let n = 20_000;
        let a = counts(&mut plain, &logits, n)[0] as f64 / n as f64;
        let b = counts(&mut pen, &logits, n)[0] as f64 / n as f64;
        // Analytic: 0.5 vs 1 / (1 + e^(1 - 2/3)) = 0.4174.
        let expect = 1.0 / (1.0 + (1.0f64 - 2.0 / 3.0).exp());
        assert!((a - 0.5).abs() < 0.02, "unpenalized {a}");
        assert!((b - expect).abs() < 0.02, "penalized {b} vs {expect}");
    }

    #[test]
    fn logit_bias_moves_greedy_and_sampled_choices() {
        let logits = [3.0, 2.0, 1.0, 0.0];
        // +100 on the worst token makes it the argmax
        let mut s = sampler(SamplerConfig {
            logit_bias: vec![(3, 100.0)],
            ..SamplerConfig::greedy()
        });
        assert_eq!(s.sample(&logits).ok(), Some(3));
        // -100 on the best leaves the second best; -inf bans it
        for b in [-100.0, f32::NEG_INFINITY] {
            let mut s = sampler(SamplerConfig {
                logit_bias: vec![(0, b)],
                ..SamplerConfig::greedy()
            });
            assert_eq!(s.sample(&logits).ok(), Some(1), "bias {b}");
        }
        // sampled: a banned token is never drawn, a +100 one always is
        let mut s = sampler(SamplerConfig {
            logit_bias: vec![(0, f32::NEG_INFINITY), (9, 5.0)],
            ..cfg(1.0)
        });
        assert_eq!(counts(&mut s, &logits, 2_000)[0], 0);
        let mut s = sampler(SamplerConfig {
            logit_bias: vec![(2, 100.0)],
            ..cfg(1.0)
        });
        assert_eq!(counts(&mut s, &logits, 500)[2], 500);
        // saturates: a finite logit stays finite
        let mut s = sampler(SamplerConfig {
            logit_bias: vec![(1, f32::MAX)],
            ..SamplerConfig::greedy()
        });
        assert_eq!(s.sample(&[f32::MAX, f32::MAX]).ok(), Some(0));
        for bad in [f32::NAN, f32::INFINITY] {
            let c = SamplerConfig {
                logit_bias: vec![(0, bad)],
                ..SamplerConfig::greedy()
            };
            assert_eq!(rejected_name(c), Some("logit_bias"));
        }
    }

    #[test]
    fn top_k_keeps_k_best_lowest_id_on_ties() {
        let mut c = cands(&[1.0, 3.0, 2.0, 3.0, 0.0]);
        assert!(apply_top_k(&mut c, 3));
        assert_eq!(ids(&c), [1, 2, 3]);
        let mut c = cands(&[1.0, 2.0, 2.0, 2.0]);
        assert!(apply_top_k(&mut c, 2));
        assert_eq!(ids(&c), [1, 2]);
        for k in [0, -3, 4, 100] {
            let mut c = cands(&[1.0, 2.0, 2.0, 2.0]);
            assert!(!apply_top_k(&mut c, k));
            assert_eq!(c.len(), 4);
        }
    }

    #[test]
    fn top_p_keeps_exact_hand_sets() {
        let logits = from_probs(&[0.05, 0.5, 0.15, 0.3]);
        for (p, want) in [
            (0.4, vec![1]),
            (0.75, vec![1, 3]),
            (0.85, vec![1, 2, 3]),
            (0.96, vec![0, 1, 2, 3]),
            (1.0, vec![0, 1, 2, 3]),
        ] {
            let mut c = cands(&logits);
            let mut sorted = false;
            apply_top_p(&mut c, p, &mut sorted);
            assert_eq!(ids(&c), want, "top_p {p}");
        }
    }

    #[test]
    fn min_p_keeps_exact_hand_sets() {
        let logits = from_probs(&[0.05, 0.5, 0.15, 0.3]);
        for (min_p, want) in [
            (0.0, vec![0, 1, 2, 3]),
            (0.2, vec![1, 2, 3]),
            (0.5, vec![1, 3]),
            (0.61, vec![1]),
            (1.0, vec![1]),
        ] {
            let mut c = cands(&logits);
            apply_min_p(&mut c, min_p);
            assert_eq!(ids(&c), want, "min_p {min_p}");
        }
    }

    #[test]
    fn filters_only_ever_sample_the_kept_set() {
        let logits = from_probs(&[0.05, 0.5, 0.15, 0.3]);
        let mut s = sampler(SamplerConfig {
            top_p: 0.75,
            ..cfg(1.0)
        });
        let c = counts(&mut s, &logits, 2_000);
        assert_eq!((c[0], c[2]), (0, 0));
        assert!(c[1] > 0 && c[3] > 0);
        let mut s = sampler(SamplerConfig {
            min_p: 0.2,
            ..cfg(1.0)
        });
        assert_eq!(counts(&mut s, &logits, 2_000)[0], 0);
    }

    #[test]
    fn small_temperature_approaches_greedy() {
        let logits = [1.0, 1.1, 0.9, -3.0];
        for temp in [1e-3, 1e-10, 1e-30, f32::MIN_POSITIVE] {
            let mut s = sampler(cfg(temp));
            let c = counts(&mut s, &logits, 1_000);
            assert_eq!(c[1], 1_000, "temp {temp}: {c:?}");
        }
    }

    #[test]
    fn empirical_frequencies_match_softmax() {
        let logits = [1.0, 2.0, 3.0];
        let n = 20_000;
        for temp in [1.0f32, 2.0] {
            let mut s = sampler(SamplerConfig {
                seed: 42,
                ..cfg(temp)
            });
            let c = counts(&mut s, &logits, n);
            let w: Vec<f64> = logits
                .iter()
                .map(|&l| (f64::from(l) / f64::from(temp)).exp())
                .collect();
            let z: f64 = w.iter().sum();
            for i in 0..3 {
                let got = c[i] as f64 / n as f64;
                let want = w[i] / z;
                assert!(
                    (got - want).abs() < 0.02,
                    "temp {temp} token {i}: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn bad_logits_are_errors() {
        let mut s = sampler(SamplerConfig::default());
        assert!(matches!(s.sample(&[]), Err(SampleError::EmptyLogits)));
        assert!(matches!(
            s.sample(&[1.0, f32::NAN]),
            Err(SampleError::NonFiniteLogits)
        ));
        assert!(matches!(
            s.sample(&[1.0, f32::INFINITY]),
            Err(SampleError::NonFiniteLogits)
        ));
        assert!(matches!(
            s.sample(&[f32::NEG_INFINITY; 3]),
            Err(SampleError::EmptyLogits)
        ));
        // Masked tokens are never drawn.
        let mut s = sampler(cfg(100.0));
        let c = counts(
            &mut s,
            &[f32::NEG_INFINITY, 0.0, f32::NEG_INFINITY, 0.0],
            500,
        );
        assert_eq!((c[0], c[2]), (0, 0));
    }

    /// A constraint for the tests: after token `t`, only multiples of
    /// `t + 1` may come (any token first); it records what it accepted.
    #[derive(Debug, Default)]
    struct Multiples {
        last: Option<u32>,
        accepted: std::sync::Arc<std::sync::Mutex<Vec<u32>>>,
    }

    impl Constraint for Multiples {
        fn mask(&mut self, logits: &mut [f32]) -> Result<(), SampleError> {
            if let Some(t) = self.last {
                for (i, l) in logits.iter_mut().enumerate() {
                    if !(i as u32).is_multiple_of(t + 1) {
                        *l = f32::NEG_INFINITY;
                    }
                }
            }
            Ok(())
        }
        fn accept(&mut self, token: u32) -> Result<(), SampleError> {
            if self.last.is_some_and(|t| !token.is_multiple_of(t + 1)) {
                return Err(SampleError::Constraint(format!("{token} not allowed")));
            }
            self.last = Some(token);
            self.accepted.lock().unwrap().push(token);
            Ok(())
        }
        fn reset(&mut self) {
            self.last = None;
        }
    }

    /// The constraint masks before the chain: greedy and sampled draws
    /// take only allowed tokens, the prompt accepted before `constrain`
    /// never reaches it, and a refused token fails every later draw
    /// instead of corrupting the constraint.
    #[test]
    fn a_constraint_masks_before_the_chain() {
        let row: Vec<f32> = (0..12).map(|i| (i % 5) as f32).collect();
        for temp in [0.0, 1.0] {
            let mut s = sampler(cfg(temp));
            s.accept(7); // a prompt token: penalties only
            let seen = std::sync::Arc::default();
            s.constrain(Box::new(Multiples {
                last: None,
                accepted: std::sync::Arc::clone(&seen),
            }));
            assert!(s.is_constrained());
            let first = s.sample(&row).unwrap();
            if temp == 0.0 {
                assert_eq!(first, 4, "unconstrained argmax, lowest id");
            }
            s.accept(first);
            for _ in 0..20 {
                let t = s.sample(&row).unwrap();
                let prev = *seen.lock().unwrap().last().unwrap();
                assert!(t.is_multiple_of(prev + 1), "{t} after {prev}");
                s.accept(t);
            }
            assert_eq!(
                seen.lock().unwrap()[0],
                first,
                "the prompt token is not seen"
            );
            // after 4 only multiples of 5: the argmax 4 is masked, 0 is next
            s.reset();
            s.accept(4);
            if temp == 0.0 {
                assert_eq!(s.sample(&row).unwrap(), 0);
            }
            s.accept(3); // refused
            assert!(matches!(s.sample(&row), Err(SampleError::Constraint(_))));
            s.reset();
            assert!(s.sample(&row).is_ok(), "reset clears the failure");
        }
    }

    #[test]
    fn scratch_is_reused_across_calls() {
        let logits: Vec<f32> = (0..1000).map(|i| (i % 17) as f32 * 0.1).collect();
        let mut s = sampler(SamplerConfig::default());
        let _ = s.sample(&logits);
        let (ptr, cap) = (s.candidates.as_ptr(), s.candidates.capacity());
        for t in 0..100 {
            s.accept(t);
            let _ = s.sample(&logits);
        }
        assert_eq!((s.candidates.as_ptr(), s.candidates.capacity()), (ptr, cap));
    }

    #[test]
    fn defaults_and_greedy_validate() {
        let d = SamplerConfig::default();
        assert_eq!(
            (d.temperature, d.top_k, d.top_p, d.min_p),
            (0.8, 40, 0.95, 0.05)
        );
        assert_eq!(
            (d.repeat_penalty, d.repeat_last_n, d.seed),
            (1.0, 64, DEFAULT_SEED)
        );
        assert!(d.validate().is_ok());
        assert!(SamplerConfig::greedy().validate().is_ok());
    }

    fn rejected_name(c: SamplerConfig) -> Option<&'static str> {
        match Sampler::new(c) {
            Err(SampleError::InvalidParameter { name, .. }) => Some(name),
            _ => None,
        }
    }

    #[test]
    fn invalid_configs_name_the_parameter() {
        let base = SamplerConfig::default;
        let cases: [(SamplerConfig, &str); 12] = [
            (
                SamplerConfig {
                    temperature: f32::NAN,
                    ..base()
                },
                "temperature",
            ),
            (
                SamplerConfig {
                    temperature: f32::INFINITY,
                    ..base()
                },
                "temperature",
            ),
            (
                SamplerConfig {
                    top_p: 0.0,
                    ..base()
                },
                "top_p",
            ),
            (
                SamplerConfig {
                    top_p: -0.5,
                    ..base()
                },
                "top_p",
            ),
            (
                SamplerConfig {
                    top_p: 1.01,
                    ..base()
                },
                "top_p",
            ),
            (
                SamplerConfig {
                    top_p: f32::NAN,
                    ..base()
                },
                "top_p",
            ),
            (
                SamplerConfig {
                    min_p: -0.01,
                    ..base()
                },
                "min_p",
            ),
            (
                SamplerConfig {
                    min_p: 1.5,
                    ..base()
                },
                "min_p",
            ),
            (
                SamplerConfig {
                    min_p: f32::NAN,
                    ..base()
                },
                "min_p",
            ),
            (
                SamplerConfig {
                    repeat_penalty: 0.0,
                    ..base()
                },
                "repeat_penalty",
            ),
            (
                SamplerConfig {
                    repeat_penalty: -1.0,
                    ..base()
                },
                "repeat_penalty",
            ),
            (
                SamplerConfig {
                    repeat_penalty: f32::NAN,
                    ..base()
                },
                "repeat_penalty",
            ),
        ];
        for (c, want) in cases {
            assert_eq!(rejected_name(c.clone()), Some(want), "{c:?}");
        }
        let msg = SamplerConfig {
            top_p: 2.0,
            ..base()
        }
        .validate()
        .map_err(|e| e.to_string());
        assert_eq!(
            msg,
            Err("invalid sampler parameter top_p = 2: must be in (0, 1] (1 disables top-p)".into())
        );
    }

    // ---- property tests -------------------------------------------------

    /// The kept set, computed from scratch without the sampler's helpers:
    /// penalty, then full sort (logit desc, id asc), top-k, top-p, min-p.
    fn reference_kept(logits: &[f32], c: &SamplerConfig, history: &[u32]) -> Vec<(u32, f32)> {
        let mut l = logits.to_vec();
        if c.repeat_penalty != 1.0 && c.repeat_last_n > 0 {
            let start = history.len().saturating_sub(c.repeat_last_n);
            let mut seen = std::collections::BTreeSet::new();
            for &t in &history[start..] {
                if (t as usize) < l.len() && seen.insert(t) {
                    let x = l[t as usize];
                    let y = if x > 0.0 {
                        x / c.repeat_penalty
                    } else {
                        x * c.repeat_penalty
                    };
                    l[t as usize] = if x.is_finite() {
                        y.clamp(f32::MIN, f32::MAX)
                    } else {
                        y
                    };
                }
            }
        }
        let mut v: Vec<(u32, f32)> = l
            .iter()
            .enumerate()
            .filter(|(_, x)| x.is_finite())
            .map(|(i, &x)| (i as u32, x))
            .collect();
        v.sort_by(|a, b| {
            b.1.partial_cmp(&a.1)
                .unwrap_or(Ordering::Equal)
                .then(a.0.cmp(&b.0))
        });
        if c.top_k > 0 && (c.top_k as usize) < v.len() {
            v.truncate(c.top_k as usize);
        }
        if c.top_p < 1.0 && !v.is_empty() {
            let m = f64::from(v[0].1);
            let z: f64 = v.iter().map(|x| (f64::from(x.1) - m).exp()).sum();
            let mut cum = 0.0;
            let mut n = v.len();
            for (i, x) in v.iter().enumerate() {
                cum += (f64::from(x.1) - m).exp() / z;
                if cum >= f64::from(c.top_p) {
                    n = i + 1;
                    break;
                }
            }
            v.truncate(n);
        }
        if c.min_p > 0.0 && !v.is_empty() {
            let m = f64::from(v[0].1);
            v.retain(|x| (f64::from(x.1) - m).exp() >= f64::from(c.min_p));
        }
        v
    }

    fn valid_config() -> impl Strategy<Value = SamplerConfig> {
        (
            prop_oneof![Just(0.0f32), -1.0f32..0.0, 1e-6f32..4.0, 4.0f32..1e6],
            -5i32..600,
            prop_oneof![Just(1.0f32), 1e-6f32..1.0],
            prop_oneof![Just(0.0f32), 0.0f32..=1.0],
            prop_oneof![Just(1.0f32), 0.1f32..3.0],
            0usize..80,
            any::<u64>(),
        )
            .prop_map(
                |(temperature, top_k, top_p, min_p, repeat_penalty, repeat_last_n, seed)| {
                    SamplerConfig {
                        temperature,
                        top_k,
                        top_p,
                        min_p,
                        repeat_penalty,
                        repeat_last_n,
                        frequency_penalty: 0.0,
                        presence_penalty: 0.0,
                        seed,
                        logit_bias: Vec::new(),
                    }
                },
            )
    }

    /// Finite logits with some tokens masked, at least one left unmasked.
    fn masked_logits() -> impl Strategy<Value = Vec<f32>> {
        prop::collection::vec(
            prop_oneof![8 => -30.0f32..30.0, 1 => Just(f32::NEG_INFINITY)],
            1..500,
        )
        .prop_filter("needs a finite logit", |v| v.iter().any(|x| x.is_finite()))
    }

    proptest! {
        #[test]
        fn sampled_token_is_finite_and_in_the_kept_set(
            logits in masked_logits(),
            c in valid_config(),
            history in prop::collection::vec(0u32..520, 0..100),
        ) {
            let mut s = sampler(c.clone());
            for &t in &history {
                s.accept(t);
            }
            let tok = s.sample(&logits).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert!(logits[tok as usize].is_finite());
            let kept = reference_kept(&logits, &c, &history);
            if c.temperature <= 0.0 {
                prop_assert_eq!(Some(tok), kept.first().map(|x| x.0));
            } else {
                prop_assert!(kept.iter().any(|x| x.0 == tok), "{} not in {:?}", tok, kept);
            }
        }

        #[test]
        fn never_panics_on_any_finite_logits(
            logits in prop::collection::vec(
                prop::num::f32::NORMAL | prop::num::f32::SUBNORMAL | prop::num::f32::ZERO,
                1..500,
            ),
            c in valid_config(),
            temperature in prop_oneof![Just(f32::MIN_POSITIVE), Just(f32::MAX), -1e30f32..1e30],
            history in prop::collection::vec(any::<u32>(), 0..100),
        ) {
            let mut s = sampler(SamplerConfig { temperature, ..c });
            for &t in &history {
                s.accept(t);
            }
            for _ in 0..3 {
                let tok = s.sample(&logits).map_err(|e| TestCaseError::fail(e.to_string()))?;
                prop_assert!((tok as usize) < logits.len());
                s.accept(tok);
            }
        }

        #[test]
        fn top_k_one_is_greedy(
            logits in masked_logits(),
            temperature in 1e-3f32..100.0,
            seed in any::<u64>(),
        ) {
            let mut s = sampler(SamplerConfig { top_k: 1, seed, ..cfg(temperature) });
            prop_assert_eq!(s.sample(&logits).ok(), argmax(&logits));
        }

        #[test]
        fn invalid_configs_are_rejected(
            c in valid_config(),
            which in 0usize..4,
            bad in prop_oneof![
                Just(f32::NAN), Just(f32::INFINITY), Just(f32::NEG_INFINITY),
                -10.0f32..=0.0, 1.0001f32..10.0,
            ],
        ) {
            let (c, name) = match which {
                0 if !bad.is_finite() => (SamplerConfig { temperature: bad, ..c }, "temperature"),
                0 | 1 if !(bad > 0.0 && bad <= 1.0) => (SamplerConfig { top_p: bad, ..c }, "top_p"),
                2 if !(0.0..=1.0).contains(&bad) => (SamplerConfig { min_p: bad, ..c }, "min_p"),
                3 if !(bad > 0.0 && bad.is_finite()) => {
                    (SamplerConfig { repeat_penalty: bad, ..c }, "repeat_penalty")
                }
                _ => (SamplerConfig { min_p: -1.0, ..c }, "min_p"),
            };
            prop_assert_eq!(rejected_name(c), Some(name));
        }
    }
}
