//! llama.cpp's own speculative decoding as the anchor of `strata bench
//! --spec-replay FILE --llama-ngl N -md DRAFT`: the target at N layers on
//! the GPU and the draft all on it, both through libllama with its default
//! settings (with `--llama-best` also with `--no-mmap`: its host weights in
//! pinned memory), in the loop its speculative example runs (the draft
//! decodes greedily one token a step, the target verifies the pending token
//! and the drafts in one batch, rejected drafts leave both caches by
//! `llama_memory_seq_rm`). Its verifying step is timed for each `--spec-k`,
//! then its tokens per second are measured at the acceptance FILE
//! recorded: each round drafts as many tokens as the recorded chain held
//! and accepts as many as it accepted (chains only: llama.cpp drafts
//! chains).

use super::bench_spec::median;
use anyhow::{Context as _, Result};
use std::time::Instant;
use strata::llama::{CpuExperts, LlamaModel, LoadOptions, Reference, ReferenceConfig};
use strata::speculative::{top_token, AcceptTrace, Replay};

/// What the anchor needs from the bench's flags.
pub struct LlamaSpec<'a> {
    pub target: &'a std::path::Path,
    pub draft: &'a std::path::Path,
    pub ngl: i32,
    /// Memory-map the files (llama.cpp's default); false: `--no-mmap`.
    pub mmap: bool,
    pub trace: &'a AcceptTrace,
    pub n: usize,
    pub depth: u32,
    pub spec_k: &'a [usize],
    pub reps: usize,
    pub n_ctx: u32,
    pub n_threads: i32,
    pub json: bool,
}

/// Runs the anchor; `gpu_mib` measures the GPU memory both models took.
pub fn run(s: &LlamaSpec, gpu_mib: impl Fn() -> Option<f64>) -> Result<()> {
    // llama.cpp's defaults: repacking on, memory-mapped unless --no-mmap
    let defaults = |ngl| LoadOptions {
        n_gpu_layers: ngl,
        repack: true,
        mmap: s.mmap,
        cpu_experts: CpuExperts::None,
    };
    let lt = LlamaModel::load_with_options(s.target, false, &defaults(s.ngl))
        .context("loading llama.cpp's target")?;
    let ld = LlamaModel::load_with_options(s.draft, false, &defaults(99))
        .context("loading llama.cpp's draft")?;
    let rc = |n_batch| ReferenceConfig {
        n_ctx: s.n_ctx,
        n_batch,
        n_ubatch: 512,
        n_seq: 1,
        n_threads: s.n_threads,
        offload_kqv: true,
    };
    let mut t =
        Reference::new_default_settings(&lt, &rc(2048)).context("llama.cpp target context")?;
    let mut d =
        Reference::new_default_settings(&ld, &rc(512)).context("llama.cpp draft context")?;
    let mib = gpu_mib().map_or("?".to_string(), |m| format!("{m:.0}"));
    let label = format!(
        "llama.cpp ngl={} + draft all on the GPU, {} ({mib} MiB of GPU memory)",
        s.ngl,
        if s.mmap { "defaults" } else { "--no-mmap" }
    );
    let n_vocab = lt.n_vocab();
    let tok = |i: u32| (i.wrapping_mul(2654435761) >> 7) % n_vocab.max(1);
    let depth = s.depth.max(1);
    let prompt: Vec<(u32, i32, u32, bool)> = (0..depth)
        .map(|p| (tok(p), p as i32, 0, p + 1 == depth))
        .collect();
    // the verifying step: the pending token and k drafts, logits for all
    let mut base = None;
    for &k in s.spec_k {
        t.clear();
        t.decode(&prompt).context("llama.cpp prompt")?;
        let mut times = Vec::new();
        for r in 0..s.reps.max(1) + 1 {
            let batch: Vec<(u32, i32, u32, bool)> = (0..=k as u32)
                .map(|i| (tok(depth + i), (depth + i) as i32, 0, true))
                .collect();
            let t0 = Instant::now();
            t.decode(&batch)?;
            let el = t0.elapsed().as_secs_f64() * 1e3;
            t.seq_rm(0, depth as i32);
            if r > 0 {
                times.push(el);
            }
        }
        let ms = median(times);
        let b = *base.get_or_insert(ms);
        if s.json {
            println!("{{\"test\":\"llama-spec-step\",\"engine\":{},\"k\":{k},\"target_step_ms\":{ms:.3},\"vs_plain\":{:.4}}}", serde_json::to_string(&label)?, ms / b);
        } else {
            println!(
                "{label}: verify step k={k:<3} {ms:>9.2} ms ({:.3}x the k={} step)",
                ms / b,
                s.spec_k[0]
            );
        }
    }
    for cat in ["code", "chat"] {
        let Some(mut replay) = Replay::spread(s.trace, Some(cat), s.n) else {
            continue;
        };
        t.clear();
        d.clear();
        // both caches hold the prompt but its last token, which is pending
        let ctx: Vec<(u32, i32, u32, bool)> = prompt[..prompt.len() - 1].to_vec();
        t.decode(&ctx)?;
        d.decode(&ctx)?;
        let mut pending = prompt[prompt.len() - 1].0;
        let mut lacks: Vec<u32> = Vec::new();
        let mut n_past = ctx.len() as i32;
        let (mut emitted, mut rounds, mut drafted, mut accepted) = (0usize, 0usize, 0usize, 0usize);
        let t0 = Instant::now();
        while emitted < s.n {
            let r = replay.next_round();
            anyhow::ensure!(r.is_chain(), "--spec-replay with --llama-ngl: round {rounds} of {cat} is a tree; llama.cpp drafts chains (record with chains)");
            let k = r.parents.len().min(s.n - emitted);
            // the draft: what its cache lacks (the last round's last draft,
            // when all were accepted) and the pending token, then one token
            // a step
            let mut drafts = Vec::with_capacity(k);
            let mut feed: Vec<(u32, i32, u32, bool)> = lacks
                .iter()
                .enumerate()
                .map(|(i, &tk)| (tk, n_past - (lacks.len() - i) as i32, 0, false))
                .collect();
            feed.push((pending, n_past, 0, true));
            let mut l = d.decode(&feed)?;
            for j in 0..k {
                let next = top_token(&l).0;
                drafts.push(next);
                if j + 1 < k {
                    l = d.decode(&[(next, n_past + 1 + j as i32, 0, true)])?;
                }
            }
            // the target verifies the pending token and the drafts
            let batch: Vec<(u32, i32, u32, bool)> = std::iter::once(pending)
                .chain(drafts.iter().copied())
                .enumerate()
                .map(|(i, tk)| (tk, n_past + i as i32, 0, true))
                .collect();
            let rows = t.decode(&batch)?;
            // the recorded decision: a drafts accepted, then the target's
            // own token after them (drawn from its row for real)
            let a = r.path.len().min(k);
            let next = top_token(&rows[a * n_vocab as usize..(a + 1) * n_vocab as usize]).0;
            // the draft's cache holds the pending token and all drafts but
            // the last
            lacks = if a == k {
                vec![drafts[k - 1]]
            } else {
                Vec::new()
            };
            n_past += a as i32 + 1;
            t.seq_rm(0, n_past);
            d.seq_rm(0, n_past);
            pending = next;
            emitted += a + 1;
            rounds += 1;
            drafted += k;
            accepted += a;
            anyhow::ensure!(
                (n_past as u32) + 64 < s.n_ctx,
                "llama.cpp's context is full"
            );
        }
        let secs = t0.elapsed().as_secs_f64();
        let tps = emitted as f64 / secs;
        let per = 1.0 + accepted as f64 / rounds.max(1) as f64;
        if s.json {
            println!(
                "{{\"test\":\"llama-spec-replay\",\"engine\":{},\"category\":\"{cat}\",\"pair\":{},\"n\":{emitted},\"tps\":{tps:.3},\"tokens_per_step\":{per:.4},\"drafted\":{drafted},\"rounds\":{rounds}}}",
                serde_json::to_string(&label)?,
                serde_json::to_string(&s.trace.pair)?
            );
        } else {
            println!(
                "{label}: spec replay {cat}: {tps:.2} t/s measured end to end, acceptance replayed from {} ({per:.2} tokens per step, {:.1} drafted per round)",
                s.trace.pair,
                drafted as f64 / rounds.max(1) as f64
            );
        }
    }
    Ok(())
}
