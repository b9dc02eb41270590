//! Log-probabilities of one row of logits. Plain Rust, no FFI. The server
//! reports OpenAI's `logprobs` / `top_logprobs` from the row of the
//! distribution a token was sampled from
//! ([`super::Sampler::sampled_logprob`] builds it and calls this).
//!
//! Invariants:
//! - Numerically stable: the row's maximum is subtracted before `exp`, the
//!   sum runs in f64, and every logprob is `<= 0` (`-inf` for a masked
//!   token, whose logit is `-inf`).
//! - The top alternatives are found by partial selection
//!   (`select_nth_unstable_by`, linear in the vocabulary), then only the
//!   `k` chosen are sorted; the vocabulary is never sorted.
//! - Ties go to the lowest token id, as the sampler's argmax: under greedy
//!   decoding the chosen token is the first alternative.
//! - NaN or `+inf` in the row, or a row without a finite logit, is an
//!   error, as in the sampler.

use super::error::SampleError;
use std::cmp::Ordering;

/// Most alternatives a token may report (OpenAI's and vLLM's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// One generated token's logprob and the row's most likely tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    /// The `k` most likely tokens of the row, best first: (id, logprob).
    pub top: Vec<(u32, f32)>,
}

/// The row's log-softmax normalizer as `(max, ln(sum(exp(logit - max))))`,
/// kept apart so that `logit - max` is taken before the (small) log-sum is
/// subtracted: at logits of 1e30 their sum would round the log-sum away.
/// Errors on NaN, `+inf`, an empty row or one whose every logit is `-inf`.
fn normalizer(logits: &[f32]) -> Result<(f64, f64), SampleError> {
    let mut max = f32::NEG_INFINITY;
    for &l in logits {
        if l.is_nan() || l == f32::INFINITY {
            return Err(SampleError::NonFiniteLogits);
        }
        max = max.max(l);
    }
    if max == f32::NEG_INFINITY {
        return Err(SampleError::EmptyLogits);
    }
    let m = f64::from(max);
    // the maximum's own term is 1: the sum is >= 1 and its log >= 0
    let sum: f64 = logits.iter().map(|&l| (f64::from(l) - m).exp()).sum();
    Ok((m, sum.ln()))
}

/// The logprob of a logit in a row of [`normalizer`] `(max, ln_sum)`:
/// always `<= 0`.
fn logprob(logit: f32, (max, ln_sum): (f64, f64)) -> f32 {
    ((f64::from(logit) - max - ln_sum) as f32).min(0.0)
}

/// `token`'s logprob in the row `logits` (`F32 [n_vocab]`) and the row's
/// `k` most likely tokens (fewer when the row is shorter), best first.
/// `scratch` is reused between calls (no allocation once it has grown).
pub fn token_logprob(
    logits: &[f32],
    token: u32,
    k: usize,
    scratch: &mut Vec<u32>,
) -> Result<TokenLogprob, SampleError> {
    let norm = normalizer(logits)?;
    let own = usize::try_from(token)
        .ok()
        .and_then(|i| logits.get(i))
        .ok_or(SampleError::InvalidParameter {
            name: "token",
            value: token.to_string(),
            reason: "outside the row of logits",
        })?;
    let top = top_k(logits, k, scratch)
        .iter()
        .map(|&id| (id, logprob(logits[id as usize], norm)))
        .collect();
    Ok(TokenLogprob {
        token,
        logprob: logprob(*own, norm),
        top,
    })
}

/// Ids of the `k` highest logits, best first, lowest id on ties. The row
/// must hold no NaN (checked by [`normalizer`] before).
fn top_k<'a>(logits: &[f32], k: usize, ids: &'a mut Vec<u32>) -> &'a [u32] {
    let k = k.min(logits.len());
    ids.clear();
    if k == 0 {
        return ids;
    }
    ids.extend(0..logits.len() as u32);
    let order = |a: &u32, b: &u32| {
        logits[*b as usize]
            .partial_cmp(&logits[*a as usize])
            .unwrap_or(Ordering::Equal)
            .then(a.cmp(b))
    };
    if k < ids.len() {
        ids.select_nth_unstable_by(k - 1, order);
        ids.truncate(k);
    }
    ids.sort_unstable_by(order);
    ids
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn lp(logits: &[f32], token: u32, k: usize) -> TokenLogprob {
        token_logprob(logits, token, k, &mut Vec::new()).expect("a valid row")
    }

    #[test]
    fn logprobs_are_the_log_of_softmax() {
        let probs = [0.1f64, 0.2, 0.3, 0.4];
        // shifted by a constant: the same distribution
        let logits: Vec<f32> = probs.iter().map(|p| (p.ln() + 7.0) as f32).collect();
        for (i, p) in probs.iter().enumerate() {
            let got = lp(&logits, i as u32, 0).logprob;
            assert!((f64::from(got) - p.ln()).abs() < 1e-6, "{i}: {got}");
        }
        // one token: probability 1
        assert_eq!(lp(&[-3.5], 0, 1).logprob, 0.0);
        // two equal logits: ln(1/2)
        let half = lp(&[2.0, 2.0], 1, 0).logprob;
        assert!((half - 0.5f32.ln()).abs() < 1e-7, "{half}");
    }

    #[test]
    fn huge_and_tiny_logits_neither_overflow_nor_underflow() {
        // exp(1e4) overflows f64; subtracting the maximum keeps it finite
        let t = lp(&[1.0e4, 1.0e4 + 1.0, -1.0e4], 1, 3);
        let want = -(1.0f64 + (-1.0f64).exp()).ln();
        assert!((f64::from(t.logprob) - want).abs() < 1e-6, "{t:?}");
        assert!(t.top.iter().all(|x| x.1 <= 0.0 && x.1.is_finite()));
        // the third is 2e4 below: a large negative logprob, not NaN
        assert!(t.top[2].1 < -1.9e4, "{t:?}");
        let t = lp(&[-1.0e30, -1.0e30], 0, 1);
        assert!((t.logprob - 0.5f32.ln()).abs() < 1e-7, "{t:?}");
    }

    #[test]
    fn top_k_is_best_first_with_lowest_id_on_ties() {
        let logits = [1.0, 3.0, 2.0, 3.0, 0.0, 2.0];
        let t = lp(&logits, 4, 4);
        let ids: Vec<u32> = t.top.iter().map(|x| x.0).collect();
        assert_eq!(ids, [1, 3, 2, 5]);
        assert_eq!(t.top[0].1, t.top[1].1);
        assert_eq!(t.token, 4);
        // k past the row: every token; k = 0: none
        assert_eq!(lp(&logits, 0, 100).top.len(), 6);
        assert!(lp(&logits, 0, 0).top.is_empty());
    }

    #[test]
    fn masked_tokens_have_minus_infinity_and_bad_rows_are_errors() {
        let t = lp(&[f32::NEG_INFINITY, 0.0, 0.0], 0, 3);
        assert_eq!(t.logprob, f32::NEG_INFINITY);
        assert_eq!(t.top[2], (0, f32::NEG_INFINITY));
        let mut s = Vec::new();
        assert!(matches!(
            token_logprob(&[1.0, f32::NAN], 0, 1, &mut s),
            Err(SampleError::NonFiniteLogits)
        ));
        assert!(matches!(
            token_logprob(&[1.0, f32::INFINITY], 0, 1, &mut s),
            Err(SampleError::NonFiniteLogits)
        ));
        assert!(matches!(
            token_logprob(&[f32::NEG_INFINITY; 2], 0, 1, &mut s),
            Err(SampleError::EmptyLogits)
        ));
        assert!(matches!(
            token_logprob(&[], 0, 1, &mut s),
            Err(SampleError::EmptyLogits)
        ));
        assert!(token_logprob(&[1.0, 2.0], 2, 1, &mut s).is_err());
    }

    #[test]
    fn scratch_is_reused() {
        let logits: Vec<f32> = (0..1000).map(|i| ((i * 37) % 101) as f32).collect();
        let mut s = Vec::new();
        let _ = token_logprob(&logits, 0, 5, &mut s);
        let (ptr, cap) = (s.as_ptr(), s.capacity());
        for t in 0..50 {
            let _ = token_logprob(&logits, t, 20, &mut s);
        }
        assert_eq!((s.as_ptr(), s.capacity()), (ptr, cap));
    }

    proptest! {
        /// Against a reference that sorts the whole row and sums in f64:
        /// the same top ids in the same order, logprobs within 1e-5, all
        /// `<= 0`, probabilities summing to 1 over the row.
        #[test]
        fn matches_a_full_sort_reference(
            logits in prop::collection::vec(
                prop_oneof![8 => -50.0f32..50.0, 1 => Just(f32::NEG_INFINITY), 1 => Just(3.0f32)],
                1..300,
            ).prop_filter("a finite logit", |v| v.iter().any(|x| x.is_finite())),
            k in 0usize..=MAX_TOP_LOGPROBS,
            pick in any::<prop::sample::Index>(),
        ) {
            let token = pick.index(logits.len()) as u32;
            let t = lp(&logits, token, k);
            let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let z: f64 = logits.iter().map(|&l| (l as f64 - m).exp()).sum();
            let want = |i: usize| (logits[i] as f64 - m - z.ln()) as f32;
            let mut order: Vec<u32> = (0..logits.len() as u32).collect();
            order.sort_by(|&a, &b| {
                logits[b as usize]
                    .partial_cmp(&logits[a as usize])
                    .unwrap()
                    .then(a.cmp(&b))
            });
            order.truncate(k);
            let ids: Vec<u32> = t.top.iter().map(|x| x.0).collect();
            prop_assert_eq!(ids, order);
            let close = |a: f32, b: f32| a == b || (a - b).abs() < 1e-5;
            prop_assert!(close(t.logprob, want(token as usize)), "{} vs {}", t.logprob, want(token as usize));
            for &(id, l) in &t.top {
                prop_assert!(close(l, want(id as usize)));
                prop_assert!(l <= 0.0);
            }
            prop_assert!(t.logprob <= 0.0);
            let all = lp(&logits, token, logits.len());
            let total: f64 = all.top.iter().map(|x| (x.1 as f64).exp()).sum();
            prop_assert!((total - 1.0).abs() < 1e-4, "{}", total);
        }
    }
}
