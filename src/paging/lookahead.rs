//! Look-ahead for a mixture's host-computed layers (`--look-ahead N`).
//! Plain Rust.
//!
//! In hybrid decode the host CPU computes the routed experts of the
//! mixture layers it holds while the bus, which streams only the groups the
//! device computes, idles most of the step (the hot-expert timelines: bus
//! 3% busy, CPU 76%). While the host computes layer L, the next host
//! layer's router applied to layer L's normed rows predicts that layer's
//! picks (a hidden state changes little from one layer to the next, so the
//! next router on the current activations is the usual predictor); up to
//! N of the predicted experts, those the device holds not already as hot
//! experts, go up over the idle bus into a slot, and when that layer comes
//! the device computes the picks the slot holds while the CPU computes the
//! others. A wrong guess costs bus time only: a pick the slot lacks is the
//! CPU's as before.

/// The experts predicted for the next layer: each row's `k_used` highest
/// router logits vote for their experts; experts are ranked by votes, then
/// by their best logit over the rows (so beyond the voted ones come the
/// nearest misses), and the first `most` of them that `skip` (experts the
/// device holds already) does not exclude are returned, in rank order.
/// `router`: the layer's router as F32 [n_embd, n_expert] (expert e's
/// weights at `e * n_embd`); `rows`: F32 [n_embd, n_rows].
pub fn predict(
    router: &[f32],
    rows: &[f32],
    n_embd: usize,
    k_used: usize,
    most: usize,
    skip: impl Fn(u32) -> bool,
) -> Vec<u32> {
    if n_embd == 0 || most == 0 {
        return Vec::new();
    }
    let n_expert = router.len() / n_embd;
    let mut votes = vec![0u32; n_expert];
    let mut best = vec![f32::NEG_INFINITY; n_expert];
    let mut logits = vec![0f32; n_expert];
    let mut order: Vec<usize> = (0..n_expert).collect();
    for row in rows.chunks_exact(n_embd) {
        for (e, l) in logits.iter_mut().enumerate() {
            *l = dot(&router[e * n_embd..(e + 1) * n_embd], row);
        }
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        for &e in order.iter().take(k_used) {
            votes[e] += 1;
        }
        for (b, &l) in best.iter_mut().zip(&logits) {
            *b = b.max(l);
        }
    }
    let mut ranked: Vec<usize> = (0..n_expert).collect();
    ranked.sort_by(|&a, &b| {
        votes[b]
            .cmp(&votes[a])
            .then(best[b].total_cmp(&best[a]))
            .then(a.cmp(&b))
    });
    ranked
        .into_iter()
        .map(|e| e as u32)
        .filter(|&e| !skip(e))
        .take(most)
        .collect()
}

/// A dot product in eight lanes (which the compiler vectorizes; a plain
/// sum of f32 it must keep in order): the predictor runs on the host
/// between the router and the CPU's experts, every host layer.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A router whose expert e answers to input direction e % n_embd.
    fn router(n_embd: usize, n_expert: usize) -> Vec<f32> {
        let mut w = vec![0f32; n_embd * n_expert];
        for e in 0..n_expert {
            w[e * n_embd + e % n_embd] = 1.0 + e as f32 * 0.01;
        }
        w
    }

    #[test]
    fn the_strongest_logits_win_and_votes_rank_them() {
        let (d, n) = (4, 8);
        let w = router(d, n);
        // row 0 points at direction 1 (experts 1 and 5), row 1 at
        // direction 2 (experts 2 and 6), both partly at direction 1
        let rows = [0.0, 1.0, 0.0, 0.0, 0.0, 0.5, 1.0, 0.0];
        let p = predict(&w, &rows, d, 2, 4, |_| false);
        // 5 and 1 win row 0 (5 the stronger); 6 and 2 win row 1
        assert_eq!(p, vec![6, 5, 2, 1]);
        // beyond the voted: the others by their best logit (all 0 here,
        // then by index)
        assert_eq!(
            predict(&w, &rows, d, 2, 6, |_| false),
            vec![6, 5, 2, 1, 0, 3]
        );
        // at most `most`, the skipped left out
        assert_eq!(predict(&w, &rows, d, 2, 2, |e| e == 6), vec![5, 2]);
        assert!(predict(&w, &rows, d, 2, 0, |_| false).is_empty());
    }

    #[test]
    fn an_expert_two_rows_pick_ranks_first() {
        let (d, n) = (4, 8);
        let w = router(d, n);
        let rows = [1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.2];
        // both rows pick 4 and 0; row 1 also 7 or 3 by a little
        let p = predict(&w, &rows, d, 2, 3, |_| false);
        assert_eq!(&p[..2], &[4, 0]);
    }

    proptest! {
        /// Never more than asked, never a skipped expert, never twice; the
        /// ranking of every expert with the skipped left out, cut at
        /// `most`, with the experts some row picked first.
        #[test]
        fn predictions_are_distinct_bounded_and_picked(
            seed in 0u64..1000,
            n_rows in 1usize..5,
            k in 1usize..4,
            most in 0usize..10,
            skip_mod in 2u32..5,
        ) {
            let (d, n) = (6usize, 12usize);
            let mut s = seed;
            let mut next = || {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 33) as f32 / (1u64 << 31) as f32) - 0.5
            };
            let w: Vec<f32> = (0..d * n).map(|_| next()).collect();
            let rows: Vec<f32> = (0..d * n_rows).map(|_| next()).collect();
            let p = predict(&w, &rows, d, k, most, |e| e % skip_mod == 0);
            prop_assert!(p.len() <= most);
            let mut seen = std::collections::HashSet::new();
            for &e in &p {
                prop_assert!(e % skip_mod != 0);
                prop_assert!((e as usize) < n);
                prop_assert!(seen.insert(e));
            }
            let all = predict(&w, &rows, d, k, n, |_| false);
            prop_assert_eq!(all.len(), n);
            let want: Vec<u32> = all.iter().copied().filter(|e| e % skip_mod != 0).take(most).collect();
            prop_assert_eq!(&p, &want);
            // the voted (at most n_rows * k of them, at least k) come first:
            // each row's top k are among the first n_rows * k
            for row in rows.chunks_exact(d) {
                let mut l: Vec<(f32, u32)> = (0..n)
                    .map(|e| (w[e * d..(e + 1) * d].iter().zip(row).map(|(a, b)| a * b).sum(), e as u32))
                    .collect();
                l.sort_by(|a, b| b.0.total_cmp(&a.0));
                for &(_, e) in l.iter().take(k) {
                    let at = all.iter().position(|&x| x == e).expect("ranked");
                    prop_assert!(at < n_rows * k, "expert {} at {}", e, at);
                }
            }
        }
    }
}
