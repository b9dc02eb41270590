//! `strata bench` for speculative decoding: what a verifying step costs
//! with k drafts beside the plain step (`--spec-k`), and real generation
//! with the drafter on fixed code and chat prompts beside plain decoding
//! (`--spec-gen N`): accepted tokens per step, draft and target time,
//! effective tokens/s.

use super::spec_corpus::{CHAT as CORPUS_CHAT, CODE as CORPUS_CODE};
use anyhow::{Context as _, Result};
use std::path::Path;
use std::time::{Duration, Instant};
use strata::engine::timeline::{Span, Stream};
use strata::engine::{BatchToken, Engine};
use strata::generate::Session;
use strata::llama::LlamaModel;
use strata::sample::{Sampler, SamplerConfig};
use strata::speculative::{
    grow, AcceptTrace, DraftTree, Drafter, Replay, SpecStats, Speculator, TreeShape,
};

/// Raw code prompts: the model continues them.
const CODE: [&str; 3] = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "// Reverse a singly linked list in C.\nstruct node { int value; struct node *next; };\n\nstruct node *reverse(struct node *head) {\n",
    "import json\n\ndef load_config(path):\n    with open(path) as f:\n        return json.load(f)\n\ndef save_config(path, config):\n",
];

/// User messages, rendered with the model's chat template.
const CHAT: [&str; 3] = [
    "Rename the variable `x` to `count` in this function and return the whole function:\n```python\ndef positives(items):\n    x = 0\n    for i in items:\n        if i > 0:\n            x += 1\n    return x\n```",
    "Summarize in two sentences: A hash map stores key-value pairs in an array of buckets. A hash function maps each key to a bucket index. Collisions, where two keys map to the same bucket, are resolved by chaining or open addressing. Lookups, inserts and deletes take constant time on average.",
    "What are three tips for writing good unit tests?",
];

pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

/// Target step time with 1 + k tokens (the pending token and k drafts) at
/// `depth` cached tokens, and the draft's time to produce k tokens, for
/// each k; medians of `reps`. Returns the timeline of the last round of the
/// last k (draft, then the target step) when `trace` is set.
pub fn step_costs(
    e: &mut Engine,
    spec: Option<&mut Speculator>,
    ks: &[usize],
    depth: u32,
    reps: usize,
    json: bool,
    trace: bool,
) -> Result<Vec<Span>> {
    let n_vocab = e.n_vocab();
    let tok = |i: u32| (i.wrapping_mul(2654435761) >> 7) % n_vocab.max(1);
    let depth = depth.max(1);
    e.clear();
    // the context: the bench's pseudo-random prompt of `depth` tokens
    let (_, prompt) = super::workloads::workloads("pp", depth, n_vocab, 0);
    e.decode(&prompt[0]).context("filling the context")?;
    let context: Vec<u32> = prompt[0].iter().map(|t| t.token).collect();
    // with --draft-tree: k nodes as a tree (drafted by the model, or of
    // the shape it would grow), verified in a tree step
    let trees = spec.as_ref().is_some_and(|s| s.cfg.tree > 0);
    let mut model = match spec {
        Some(Speculator {
            drafter: Drafter::Model(m),
            ..
        }) => Some(m),
        _ => None,
    };
    let mut base = None;
    let mut spans = Vec::new();
    for (ki, &k) in ks.iter().enumerate() {
        let mut step = Vec::new();
        let mut draft = Vec::new();
        for r in 0..reps.max(1) + 1 {
            let traced = trace && ki + 1 == ks.len() && r == reps.max(1);
            if traced {
                e.start_timeline();
            }
            let d0 = Instant::now();
            let mut tree = DraftTree::default();
            let d = match model.as_deref_mut() {
                Some(m) if k > 0 && trees => {
                    let shape = TreeShape {
                        min_p: 0.0,
                        ..TreeShape::of(k, 16)
                    };
                    let t = Instant::now();
                    tree = m.draft_tree(0, &context, shape, 16)?;
                    anyhow::ensure!(
                        tree.len() == k,
                        "the draft model grew {} of {k} nodes",
                        tree.len()
                    );
                    t.elapsed().as_secs_f64()
                }
                Some(m) if k > 0 => {
                    // always k tokens: the probability floor off
                    let p_min = std::mem::replace(&mut m.p_min, 0.0);
                    let t = Instant::now();
                    let out = m.draft(&context, k)?;
                    let d = t.elapsed().as_secs_f64();
                    m.p_min = p_min;
                    anyhow::ensure!(
                        out.len() == k,
                        "the draft model made {} of {k} tokens",
                        out.len()
                    );
                    d
                }
                _ => 0.0,
            };
            if traced {
                e.record_host_span(Stream::Draft, &format!("draft {k}"), d0, Instant::now());
            }
            if trees && tree.len() < k {
                tree = synthetic_tree(k, tok);
            }
            let batch: Vec<BatchToken> = (0..=k as u32)
                .map(|i| BatchToken {
                    token: tok(depth + i),
                    pos: (depth + i) as i32,
                    seq: 0,
                    logits: true,
                })
                .collect();
            let t = Instant::now();
            if trees {
                let toks = tree.step_tokens(tok(depth));
                let f = strata::round::Feed {
                    seq: 0,
                    pos: depth as usize,
                    tokens: &toks,
                    drafts: tree.len(),
                    sample: true,
                    tree: Some(&tree),
                };
                strata::round::step(e, &[f])?;
            } else {
                e.decode(&batch)?;
            }
            let s = t.elapsed().as_secs_f64();
            e.truncate_seq(0, depth as i32);
            if traced {
                spans = e.finish_timeline();
            }
            // the first repetition warms templates and graphs up
            if r > 0 {
                step.push(s);
                draft.push(d);
            }
        }
        let (s, d) = (median(step) * 1e3, median(draft) * 1e3);
        let b = *base.get_or_insert(s);
        if json {
            println!(
                "{{\"test\":\"spec-step\",\"k\":{k},\"target_step_ms\":{s:.3},\"vs_plain\":{:.4},\"draft_ms\":{d:.3},\"draft_share\":{:.4}}}",
                s / b,
                d / s
            );
        } else {
            println!(
                "spec step k={k:<3} target {s:>9.2} ms ({:.3}x the k={} step) | draft {d:>8.2} ms ({:.1}% of the step)",
                s / b,
                ks[0],
                100.0 * d / s
            );
        }
    }
    e.clear();
    Ok(spans)
}

/// An acceptance trace file, or an error naming it and what is wrong.
pub fn read_trace(file: &Path) -> Result<AcceptTrace> {
    let meta = std::fs::metadata(file).with_context(|| format!("reading {}", file.display()))?;
    anyhow::ensure!(
        meta.len() <= 64 << 20,
        "{}: over 64 MiB, not an acceptance trace",
        file.display()
    );
    let text =
        std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
    AcceptTrace::from_json(&text)
        .map_err(|why| anyhow::anyhow!("{}: not an acceptance trace: {why}", file.display()))
}

/// A tree of `k` nodes of the shape best-first growth gives where every
/// node's children are equally likely.
fn synthetic_tree(k: usize, tok: impl Fn(u32) -> u32) -> DraftTree {
    let shape = TreeShape {
        min_p: 0.0,
        ..TreeShape::of(k, 16)
    };
    let kids: Vec<(u32, f32)> = (0..shape.children as u32)
        .map(|i| (tok(i), -(1.0 + i as f32)))
        .collect();
    grow(shape, &kids, |_, new| {
        Ok::<_, ()>(new.iter().map(|_| kids.clone()).collect())
    })
    .unwrap_or_default()
}

/// One side of the generation comparison.
#[derive(Default)]
struct Side {
    tokens: usize,
    time: Duration,
    out: Vec<Vec<u32>>,
}

/// Greedy generation of `n` tokens per prompt, plain and with `spec`.
pub fn generation(
    e: &mut Engine,
    vocab: &LlamaModel,
    spec: &mut Speculator,
    n: usize,
    json: bool,
) -> Result<()> {
    let mut prompts: Vec<(String, Vec<u32>)> = Vec::new();
    for (i, p) in CODE.iter().enumerate() {
        prompts.push((format!("code{}", i + 1), vocab.tokenize(p, true, true)?));
    }
    for (i, p) in CHAT.iter().enumerate() {
        let text = vocab.apply_chat_template(&[("user".to_string(), p.to_string())], true)?;
        prompts.push((
            format!("chat{}", i + 1),
            vocab.tokenize(&text, true, false)?,
        ));
    }
    let (mut plain, mut drafted) = (Side::default(), Side::default());
    let mut total = SpecStats::default();
    for (name, p) in &prompts {
        for (side, sp) in [(&mut plain, None), (&mut drafted, Some(&mut *spec))] {
            let mut s = Session::new(e, vocab, Sampler::new(SamplerConfig::greedy())?);
            let (out, t) = match sp {
                Some(sp) => {
                    sp.reset();
                    sp.stats = SpecStats::default();
                    let r = s.generate_with(p, n, Some(&mut *sp), |_| {})?;
                    total.add(&sp.stats);
                    if !json {
                        println!(
                            "  {name:<6} {:>4} tokens {:>8.2} t/s  {:.2} tokens/step  accepted {}",
                            r.1.gen_tokens,
                            r.1.gen_tps(),
                            sp.stats.tokens_per_round(),
                            sp.stats.histogram_text()
                        );
                    }
                    r
                }
                None => s.generate_with(p, n, None, |_| {})?,
            };
            side.tokens += t.gen_tokens;
            side.time += t.gen_time;
            side.out.push(out);
        }
        let (a, b) = (
            plain.out.last().expect("run"),
            drafted.out.last().expect("run"),
        );
        if let Some(j) = a.iter().zip(b).position(|(x, y)| x != y) {
            let gap = top2_gap(e, p, &a[..j])?;
            println!(
                "  {name:<6} differs from plain at token {j}: plain's top-2 logit gap there is {gap:.4}"
            );
        }
    }
    let tps = |s: &Side| s.tokens as f64 / s.time.as_secs_f64().max(1e-9);
    let same = plain.out == drafted.out;
    if json {
        println!(
            "{{\"test\":\"spec-gen\",\"prompts\":{},\"n\":{n},\"plain_tps\":{:.3},\"spec_tps\":{:.3},\"speedup\":{:.4},\"tokens_per_step\":{:.4},\"acceptance\":{:.4},\"draft_ms_per_round\":{:.3},\"target_ms_per_round\":{:.3},\"histogram\":{:?},\"identical\":{same}}}",
            prompts.len(),
            tps(&plain),
            tps(&drafted),
            tps(&drafted) / tps(&plain),
            total.tokens_per_round(),
            total.acceptance(),
            total.draft_ms_per_round(),
            total.target_ms_per_round(),
            total.histogram
        );
    } else {
        println!(
            "spec gen: plain {:.2} t/s, speculative {:.2} t/s ({:.2}x); {}; output {}",
            tps(&plain),
            tps(&drafted),
            tps(&drafted) / tps(&plain),
            total.summary(),
            if same {
                "identical to plain".to_string()
            } else {
                "DIFFERS from plain".to_string()
            }
        );
    }
    Ok(())
}

/// The gap between the two largest logits after `prompt` + `tokens`,
/// computed one token per step as plain decoding does.
fn top2_gap(e: &mut Engine, prompt: &[u32], tokens: &[u32]) -> Result<f32> {
    e.clear();
    let batch: Vec<BatchToken> = prompt
        .iter()
        .enumerate()
        .map(|(i, &t)| BatchToken {
            token: t,
            pos: i as i32,
            seq: 0,
            logits: i + 1 == prompt.len(),
        })
        .collect();
    let mut logits = e.decode(&batch)?;
    for (i, &t) in tokens.iter().enumerate() {
        logits = e.decode(&[BatchToken {
            token: t,
            pos: (prompt.len() + i) as i32,
            seq: 0,
            logits: true,
        }])?;
    }
    e.clear();
    let mut l = logits;
    l.sort_by(|a, b| b.total_cmp(a));
    Ok(l[0] - l.get(1).copied().unwrap_or(f32::NEG_INFINITY))
}

/// "TARGET + DRAFT" (file names), or the target's with prompt lookup.
pub fn pair_name(target: &Path, draft: Option<&Path>) -> String {
    let name = |p: &Path| {
        p.file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned())
    };
    match draft {
        Some(d) => format!("{} + {}", name(target), name(d)),
        None => format!("{} + prompt lookup", name(target)),
    }
}

/// Accepted tokens per target step on the acceptance corpus (20 code and
/// 20 chat prompts, `n` greedy tokens each), per category, with the
/// drafter as configured (chains or trees, fixed or adaptive size). With
/// `record`, every round goes to that file as an acceptance trace.
pub fn acceptance(
    e: &mut Engine,
    vocab: &LlamaModel,
    spec: &mut Speculator,
    n: usize,
    pair: &str,
    record: Option<&Path>,
    json: bool,
) -> Result<()> {
    spec.record = record.map(|_| AcceptTrace::new(pair));
    let shape = match spec.cfg.tree {
        0 => format!("chains of up to {}", spec.cfg.draft_max),
        t => format!("trees of up to {t} nodes, {} deep", spec.cfg.draft_max),
    };
    let sizing = if spec.cfg.adaptive {
        "adaptive"
    } else {
        "fixed"
    };
    for (cat, prompts) in [("code", &CORPUS_CODE[..]), ("chat", &CORPUS_CHAT[..])] {
        spec.category = cat.to_string();
        let mut total = SpecStats::default();
        let mut tokens = 0;
        let mut time = Duration::ZERO;
        for p in prompts {
            let toks = if cat == "chat" {
                let text =
                    vocab.apply_chat_template(&[("user".to_string(), p.to_string())], true)?;
                vocab.tokenize(&text, true, false)?
            } else {
                vocab.tokenize(p, true, true)?
            };
            spec.reset();
            spec.stats = SpecStats::default();
            let mut s = Session::new(e, vocab, Sampler::new(SamplerConfig::greedy())?);
            let (_, t) = s.generate_with(&toks, n, Some(&mut *spec), |_| {})?;
            total.add(&spec.stats);
            tokens += t.gen_tokens;
            time += t.gen_time;
        }
        let tps = tokens as f64 / time.as_secs_f64().max(1e-9);
        let nodes = total.drafted_per_round();
        if json {
            println!(
                "{{\"test\":\"spec-accept\",\"category\":\"{cat}\",\"pair\":{},\"shape\":\"{shape}\",\"sizing\":\"{sizing}\",\"prompts\":{},\"n\":{n},\"rounds\":{},\"tokens_per_step\":{:.4},\"nodes_per_round\":{nodes:.2},\"tps\":{tps:.3},\"draft_ms_per_round\":{:.3},\"target_ms_per_round\":{:.3},\"histogram\":{:?}}}",
                serde_json::to_string(pair)?,
                prompts.len(),
                total.rounds,
                total.tokens_per_round(),
                total.draft_ms_per_round(),
                total.target_ms_per_round(),
                total.histogram
            );
        } else {
            println!(
                "spec accept {cat}: {} prompts x {n} tokens, {shape} ({sizing}): {:.2} tokens per target step over {} rounds, {nodes:.1} nodes verified per round, {tps:.2} t/s; {}",
                prompts.len(),
                total.tokens_per_round(),
                total.rounds,
                total.summary()
            );
        }
    }
    if let (Some(path), Some(tr)) = (record, spec.record.take()) {
        std::fs::write(path, tr.to_json())
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!(
            "acceptance trace of {} rounds written to {}",
            tr.rounds.len(),
            path.display()
        );
    }
    Ok(())
}

/// Speculative decoding measured end to end at the acceptance of the pair
/// that recorded `file`: per category, `n` tokens after a `depth`-token
/// prompt with the draft model drafting trees (or chains) of the recorded
/// shapes and the recorded nodes accepted (see
/// `strata::speculative::Replay`), beside plain decoding of the same
/// tokens count on the same engine.
pub fn replay(
    e: &mut Engine,
    vocab: &LlamaModel,
    spec: &mut Speculator,
    files: &[std::path::PathBuf],
    n: usize,
    depth: u32,
    json: bool,
) -> Result<()> {
    anyhow::ensure!(
        matches!(spec.drafter, Drafter::Model(_)),
        "--spec-replay needs a draft model (-md FILE): prompt lookup has no shapes to replay"
    );
    // every file read before anything runs
    let traces = files
        .iter()
        .map(|f| {
            Ok((
                f.file_name()
                    .map_or(String::new(), |n| n.to_string_lossy().into_owned()),
                read_trace(f)?,
            ))
        })
        .collect::<Result<Vec<_>>>()?;
    let n_vocab = e.n_vocab();
    let (_, prompt) = super::workloads::workloads("pp", depth, n_vocab, 0);
    let prompt: Vec<u32> = prompt[0].iter().map(|t| t.token).collect();
    // the bench's text has no end: its end-of-generation tokens are banned
    let greedy = SamplerConfig {
        logit_bias: (0..n_vocab)
            .filter(|&t| vocab.is_eog(t))
            .map(|t| (t, f32::NEG_INFINITY))
            .collect(),
        ..SamplerConfig::greedy()
    };
    let run =
        |e: &mut Engine, spec: Option<&mut Speculator>, n: usize| -> Result<(usize, Duration)> {
            let mut s = Session::new(e, vocab, Sampler::new(greedy.clone())?);
            let (out, t) = s.generate_with(&prompt, n, spec, |_| {})?;
            Ok((out.len(), t.gen_time))
        };
    // warm-up: graphs and templates
    run(e, None, n.min(16))?;
    let (pn, pt) = run(e, None, n)?;
    let plain = pn as f64 / pt.as_secs_f64().max(1e-9);
    for (cat, (file, trace)) in traces.iter().flat_map(|t| ["code", "chat"].map(|c| (c, t))) {
        let Some(r) = Replay::spread(trace, Some(cat), n) else {
            continue;
        };
        spec.replay = Some(r);
        spec.reset();
        spec.stats = SpecStats::default();
        let (tn, tt) = run(e, Some(&mut *spec), n)?;
        spec.replay = None;
        let tps = tn as f64 / tt.as_secs_f64().max(1e-9);
        let st = &spec.stats;
        let recorded = trace.tokens_per_step(Some(cat));
        if json {
            println!(
                "{{\"test\":\"spec-replay\",\"category\":\"{cat}\",\"trace\":{},\"pair\":{},\"n\":{tn},\"tps\":{tps:.3},\"plain_tps\":{plain:.3},\"speedup\":{:.4},\"tokens_per_step\":{:.4},\"recorded_tokens_per_step\":{recorded:.4},\"nodes_per_round\":{:.2},\"draft_ms_per_round\":{:.3},\"target_ms_per_round\":{:.3}}}",
                serde_json::to_string(file)?,
                serde_json::to_string(&trace.pair)?,
                tps / plain,
                st.tokens_per_round(),
                st.drafted_per_round(),
                st.draft_ms_per_round(),
                st.target_ms_per_round(),
            );
        } else {
            println!(
                "spec replay {cat} ({file}): {tps:.2} t/s measured end to end, acceptance replayed from {} ({:.2} tokens per step here, {recorded:.2} recorded; {:.1} nodes per round); plain {plain:.2} t/s on this engine, {:.2}x; draft {:.1} ms, target step {:.1} ms per round",
                trace.pair,
                st.tokens_per_round(),
                st.drafted_per_round(),
                tps / plain,
                st.draft_ms_per_round(),
                st.target_ms_per_round(),
            );
        }
    }
    Ok(())
}
