//! Side-by-side runs of strata and llama.cpp on the same prompt: greedy
//! continuations with the logits of every position. Used by `strata check`
//! (on any device) and the parity tests.

use crate::engine::{BatchToken, Engine, EngineError};
use crate::llama::{LlamaError, Reference};

/// Greedy tokens and the logits that chose them (prompt positions first).
#[derive(Clone, Debug, Default)]
pub struct Run {
    pub tokens: Vec<u32>,
    pub logits: Vec<Vec<f32>>,
}

fn argmax(v: &[f32]) -> u32 {
    crate::sample::argmax(v).unwrap_or(0)
}

/// strata: the logits after feeding one more token of sequence 0.
pub fn decode_next(e: &mut Engine, token: u32, pos: i32) -> Result<Vec<f32>, EngineError> {
    e.decode(&[BatchToken {
        token,
        pos,
        seq: 0,
        logits: true,
    }])
}

/// strata on a fresh KV cache: the logits of every position of `prompt`.
pub fn prompt_logits(e: &mut Engine, prompt: &[u32]) -> Result<Vec<Vec<f32>>, EngineError> {
    e.clear();
    let nv = e.n_vocab() as usize;
    let batch: Vec<_> = prompt
        .iter()
        .enumerate()
        .map(|(i, &t)| BatchToken {
            token: t,
            pos: i as i32,
            seq: 0,
            logits: true,
        })
        .collect();
    Ok(e.decode(&batch)?.chunks(nv).map(|c| c.to_vec()).collect())
}

/// strata: all prompt positions' logits, then `n_gen` greedy tokens.
pub fn run_strata(e: &mut Engine, prompt: &[u32], n_gen: usize) -> Result<Run, EngineError> {
    let mut run = Run {
        tokens: Vec::new(),
        logits: prompt_logits(e, prompt)?,
    };
    for step in 0..n_gen {
        let t = argmax(run.logits.last().map_or(&[][..], |v| v));
        run.tokens.push(t);
        if step + 1 == n_gen {
            break;
        }
        let pos = (prompt.len() + step) as i32;
        run.logits.push(decode_next(e, t, pos)?);
    }
    Ok(run)
}

/// strata: sequences taking turns. For `rounds` rounds, each prompt's
/// sequence (seq i for prompt i) is fed what it has not been fed yet and
/// generates `per_turn` greedy tokens. Tokens are listed in schedule order,
/// with the logits of every step.
pub fn run_turns(
    e: &mut Engine,
    prompts: &[Vec<u32>],
    rounds: usize,
    per_turn: usize,
) -> Result<Run, EngineError> {
    e.clear();
    let mut toks: Vec<Vec<u32>> = prompts.to_vec();
    let mut fed = vec![0usize; prompts.len()];
    let mut run = Run::default();
    for _ in 0..rounds {
        for (s, t) in toks.iter_mut().enumerate() {
            for _ in 0..per_turn {
                let batch: Vec<_> = (fed[s]..t.len())
                    .map(|i| BatchToken {
                        token: t[i],
                        pos: i as i32,
                        seq: s as u32,
                        logits: i + 1 == t.len(),
                    })
                    .collect();
                let l = e.decode(&batch)?;
                fed[s] = t.len();
                let next = argmax(&l);
                t.push(next);
                run.tokens.push(next);
                run.logits.push(l);
            }
        }
    }
    Ok(run)
}

/// llama.cpp: the same, through libllama.
pub fn run_reference(
    r: &mut Reference,
    prompt: &[u32],
    n_gen: usize,
    n_vocab: usize,
) -> Result<Run, LlamaError> {
    r.clear();
    let batch: Vec<_> = prompt
        .iter()
        .enumerate()
        .map(|(i, &t)| (t, i as i32, 0, true))
        .collect();
    let mut run = Run {
        tokens: Vec::new(),
        logits: r
            .decode(&batch)?
            .chunks(n_vocab)
            .map(|c| c.to_vec())
            .collect(),
    };
    for step in 0..n_gen {
        let t = argmax(run.logits.last().map_or(&[][..], |v| v));
        run.tokens.push(t);
        if step + 1 == n_gen {
            break;
        }
        run.logits
            .push(r.decode(&[(t, (prompt.len() + step) as i32, 0, true)])?);
    }
    Ok(run)
}

/// Normalized mean squared error of `a` against reference `b`.
pub fn nmse(a: &[f32], b: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        num += (x as f64 - y as f64).powi(2);
        den += (y as f64).powi(2);
    }
    if a.len() != b.len() || !num.is_finite() {
        // NaN logits must never compare as equal
        return f64::INFINITY;
    }
    num / den.max(1e-30)
}

/// Worst per-position NMSE, and the first step where greedy tokens differ.
pub fn compare(a: &Run, b: &Run) -> (f64, Option<usize>) {
    let worst = a
        .logits
        .iter()
        .zip(&b.logits)
        .map(|(x, y)| nmse(x, y))
        .fold(0.0, f64::max);
    let worst = if a.logits.len() != b.logits.len() {
        f64::INFINITY
    } else {
        worst
    };
    let first_diff = a.tokens.iter().zip(&b.tokens).position(|(x, y)| x != y);
    (worst, first_diff)
}

/// Where two greedy runs part at step `i`: how far apart `reference`'s
/// logits put the two tokens chosen there (its own choice's logit less the
/// other's). A small margin is a near-tie that rounding decides, not a bug.
pub fn margin_at(run: &Run, reference: &Run, i: usize) -> Option<f32> {
    let l = reference.logits.get(i)?;
    let mine = *l.get(*run.tokens.get(i)? as usize)?;
    let theirs = *l.get(*reference.tokens.get(i)? as usize)?;
    Some(theirs - mine)
}

/// strata fed `prompt` then `forced` (teacher forcing): the logits of every
/// position, so two backends can be compared on the same inputs even where
/// their free-running greedy choices would part.
pub fn run_strata_forced(
    e: &mut Engine,
    prompt: &[u32],
    forced: &[u32],
) -> Result<Run, EngineError> {
    let mut run = Run {
        tokens: forced.to_vec(),
        logits: prompt_logits(e, prompt)?,
    };
    for (step, &t) in forced
        .iter()
        .enumerate()
        .take(forced.len().saturating_sub(1))
    {
        let pos = (prompt.len() + step) as i32;
        run.logits.push(decode_next(e, t, pos)?);
    }
    Ok(run)
}
