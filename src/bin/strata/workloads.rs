//! The token batches `strata bench` times: prompts, generation from a
//! depth, and several sequences decoding at once. Deterministic
//! pseudo-random tokens, so every engine sees the same input.

use strata::engine::BatchToken;

/// Token batches: (unmeasured setup steps, measured steps).
pub(super) type Workload = (Vec<Vec<BatchToken>>, Vec<Vec<BatchToken>>);

/// A decode workload: (token batch) steps; returns tokens processed.
/// Generation starts at position `depth`.
pub(super) fn workloads(test: &str, n: u32, n_vocab: u32, depth: u32) -> Workload {
    // deterministic pseudo-random tokens in the vocabulary
    let tok = |i: u32| (i.wrapping_mul(2654435761) >> 7) % n_vocab.max(1);
    match test {
        "pp" => {
            let b = (0..n)
                .map(|i| BatchToken {
                    token: tok(i),
                    pos: i as i32,
                    seq: 0,
                    logits: i + 1 == n,
                })
                .collect();
            (Vec::new(), vec![b])
        }
        "tg" => {
            let steps = (0..n)
                .map(|i| {
                    vec![BatchToken {
                        token: tok(i),
                        pos: (depth + i) as i32,
                        seq: 0,
                        logits: true,
                    }]
                })
                .collect();
            (Vec::new(), steps)
        }
        _ => unreachable!(),
    }
}

pub(super) fn batched(seqs: u32, steps: u32, n_vocab: u32) -> Workload {
    let tok = |i: u32| (i.wrapping_mul(2654435761) >> 7) % n_vocab.max(1);
    let prompt = 16;
    let pre = vec![(0..seqs)
        .flat_map(|s| {
            (0..prompt).map(move |i| BatchToken {
                token: tok(s * 97 + i),
                pos: i as i32,
                seq: s,
                logits: i + 1 == prompt,
            })
        })
        .collect()];
    let run = (0..steps)
        .map(|k| {
            (0..seqs)
                .map(|s| BatchToken {
                    token: tok(s + k),
                    pos: (prompt + k) as i32,
                    seq: s,
                    logits: true,
                })
                .collect()
        })
        .collect();
    (pre, run)
}

/// Tokens of sequence 0 the cache must hold before `run` (its first position).
pub(super) fn depth_of(run: &[Vec<BatchToken>]) -> u32 {
    run.first()
        .and_then(|b| b.iter().filter(|t| t.seq == 0).map(|t| t.pos).min())
        .unwrap_or(0) as u32
}
