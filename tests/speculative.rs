//! Speculative decoding is lossless: with prompt lookup or a draft model,
//! generation emits the tokens plain decoding emits, greedy and (fixed
//! seed) sampled, with KV tiers and streamed weights; rejected drafts leave
//! no trace in the cache; a draft model with another vocabulary is refused.

mod common;

use common::{model, QWEN15, QWEN2, SMOLLM2};
use strata::engine::{Engine, EngineConfig};
use strata::llama::LlamaModel;
use strata::sample::SamplerConfig;
use strata::speculative::{check_vocab, DraftModel, Drafter, NgramLookup, SpecConfig, Speculator};

fn cfg() -> EngineConfig {
    common::cpu_cfg()
}

use common::SPEC_PROMPTS as PROMPTS;

fn sampled(seed: u64) -> SamplerConfig {
    common::sampled_cfg(seed)
}

use common::generate;

fn lookup() -> Speculator {
    Speculator::new(
        Drafter::Lookup(NgramLookup::default()),
        SpecConfig {
            draft_max: 8,
            draft_min: 0,
            // every round drafts: the most verification and rollback
            adaptive: false,
            tree: 0,
        },
    )
}

/// Lookup drafting equals plain decoding in every configuration, on one
/// model; returns (rounds, accepted) over all of them.
fn lookup_equals_plain(name: &str, configs: &[EngineConfig], samplers: &[SamplerConfig]) {
    let Some(path) = model(name) else { return };
    let vocab = LlamaModel::load(&path, true, 0).expect("vocab");
    let mut plain_e = Engine::load(&path, &cfg()).expect("engine");
    let mut accepted = 0;
    for c in configs {
        let mut e = Engine::load(&path, c).expect("engine");
        for sc in samplers {
            for p in PROMPTS {
                let want = generate(&mut plain_e, &vocab, sc, p, 48, None);
                let mut spec = lookup();
                let got = generate(&mut e, &vocab, sc, p, 48, Some(&mut spec));
                assert_eq!(
                    got,
                    want,
                    "{name}, temp {}, {p:?}: {}",
                    sc.temperature,
                    spec.stats.summary()
                );
                accepted += spec.stats.accepted;
            }
        }
    }
    assert!(accepted > 0, "{name}: no draft was ever accepted");
}

#[test]
fn lookup_greedy_equals_plain_smollm2() {
    lookup_equals_plain(SMOLLM2, &[cfg()], &[SamplerConfig::greedy()]);
}

#[test]
fn lookup_greedy_equals_plain_qwen2() {
    lookup_equals_plain(QWEN2, &[cfg()], &[SamplerConfig::greedy()]);
}

#[test]
fn lookup_sampled_equals_plain_smollm2() {
    lookup_equals_plain(SMOLLM2, &[cfg()], &[sampled(3), sampled(11)]);
}

/// Rollback through every tier: KV windowed through DRAM frames in small
/// blocks that spill to files, weights streamed through slots.
#[test]
fn lookup_with_tiered_kv_and_streaming_smollm2() {
    let Some(path) = model(SMOLLM2) else { return };
    let e = Engine::load(&path, &cfg()).expect("engine");
    let per_layer = 4 * e.spec.hp.n_embd_kv() as u64 * e.n_ctx() as u64;
    drop(e);
    let dir = tempfile::tempdir().expect("tempdir");
    let tiered = common::tiered_streaming_cfg(per_layer, dir.path());
    lookup_equals_plain(SMOLLM2, &[tiered], &[SamplerConfig::greedy(), sampled(5)]);
}

#[test]
fn draft_model_greedy_equals_plain_qwen15() {
    let (Some(target), Some(draft)) = (model(QWEN15), model(QWEN2)) else {
        return;
    };
    let vocab = LlamaModel::load(&target, true, 0).expect("vocab");
    let dvocab = LlamaModel::load(&draft, true, 0).expect("draft vocab");
    // plain weights: with repacked ones a multi-token verify step rounds
    // differently from one-token steps (llama.cpp's kernels do the same), so
    // drafted and plain greedy text may part at a near-tie; on plain
    // weights they must not, which pins verification and rollback
    let plain = EngineConfig {
        repack: false,
        ..cfg()
    };
    let mut e = Engine::load(&target, &plain).expect("engine");
    let de = Engine::load(&draft, &plain).expect("draft engine");
    check_vocab(&vocab, &e, &dvocab, &de).expect("same vocabulary");
    let mut spec = Speculator::new(
        Drafter::Model(Box::new(DraftModel::new(de, 0.5))),
        SpecConfig {
            draft_max: 8,
            draft_min: 0,
            // every round drafts: the most verification and rollback
            adaptive: false,
            tree: 0,
        },
    );
    for p in PROMPTS {
        let want = generate(&mut e, &vocab, &SamplerConfig::greedy(), p, 32, None);
        let got = generate(
            &mut e,
            &vocab,
            &SamplerConfig::greedy(),
            p,
            32,
            Some(&mut spec),
        );
        assert_eq!(got, want, "{p:?}: {}", spec.stats.summary());
    }
    assert!(spec.stats.accepted > 0, "{}", spec.stats.summary());
}

#[test]
fn draft_model_with_another_vocabulary_is_refused() {
    let (Some(a), Some(b)) = (model(SMOLLM2), model(QWEN2)) else {
        return;
    };
    let (va, vb) = (
        LlamaModel::load(&a, true, 0).expect("vocab"),
        LlamaModel::load(&b, true, 0).expect("vocab"),
    );
    let (ea, eb) = (
        Engine::load(&a, &cfg()).expect("engine"),
        Engine::load(&b, &cfg()).expect("engine"),
    );
    let err = check_vocab(&va, &ea, &vb, &eb).expect_err("different vocabularies");
    assert!(err.to_string().contains("49152"), "{err}");
}

/// A verifying step computes k + 1 rows in one multi-token step where plain
/// decoding computes them one token at a time. On the Q4_1 SmolLM2 both
/// give the same bits; on the Q4_K_M Qwen models (Q5_0/Q8_0/K-quant mix)
/// ggml's CPU kernels take another path for several tokens and the logits
/// differ (NMSE ~1e-4 to 1e-3). Each path equals llama.cpp's own, bit for
/// bit, so the difference is ggml's and llama.cpp's verification has it
/// too. Returns the worst NMSE and the largest logit difference.
fn multi_token_step_vs_single(name: &str) -> Option<(f64, f32)> {
    use strata::engine::BatchToken;
    let path = model(name)?;
    let vocab = LlamaModel::load(&path, true, 0).expect("vocab");
    let toks = vocab.tokenize(PROMPTS[0], true, true).expect("tokenize");
    let (ctx, tail) = toks.split_at(toks.len() - 9);
    let mut e = Engine::load(&path, &cfg()).expect("engine");
    // llama.cpp as its users run it (repacked weights), like strata's default
    let lm = LlamaModel::load_as_users_run(&path, 0).expect("llama.cpp");
    let mut r = strata::llama::Reference::new_default_settings(
        &lm,
        &strata::llama::ReferenceConfig {
            n_ctx: 512,
            n_batch: 512,
            n_ubatch: 512,
            n_seq: 1,
            n_threads: 2,
            offload_kqv: true,
        },
    )
    .expect("reference");
    let batch = |toks: &[u32], base: usize| -> Vec<BatchToken> {
        toks.iter()
            .enumerate()
            .map(|(i, &t)| BatchToken {
                token: t,
                pos: (base + i) as i32,
                seq: 0,
                logits: true,
            })
            .collect()
    };
    let conv = |b: Vec<BatchToken>| {
        b.iter()
            .map(|t| (t.token, t.pos, t.seq, t.logits))
            .collect::<Vec<_>>()
    };
    let n_vocab = e.n_vocab() as usize;
    let (mut worst, mut max_diff) = (0.0f64, 0.0f32);
    for k in [1usize, 4, 8] {
        e.clear();
        e.decode(&batch(ctx, 0)).expect("prefix");
        let multi = e.decode(&batch(&tail[..=k], ctx.len())).expect("multi");
        e.truncate_seq(0, ctx.len() as i32);
        let mut single = Vec::new();
        for i in 0..=k {
            single.extend(
                e.decode(&batch(&tail[i..=i], ctx.len() + i))
                    .expect("single"),
            );
        }
        r.clear();
        r.decode(&conv(batch(ctx, 0))).expect("prefix");
        let r_multi = r
            .decode(&conv(batch(&tail[..=k], ctx.len())))
            .expect("multi");
        r.clear();
        r.decode(&conv(batch(ctx, 0))).expect("prefix");
        let mut r_single = Vec::new();
        for i in 0..=k {
            r_single.extend(
                r.decode(&conv(batch(&tail[i..=i], ctx.len() + i)))
                    .expect("single"),
            );
        }
        assert!(
            multi == r_multi,
            "{name} k={k}: multi-token step differs from llama.cpp's"
        );
        assert!(
            single == r_single,
            "{name} k={k}: one-token steps differ from llama.cpp's"
        );
        for i in 0..=k {
            let (a, b) = (
                &multi[i * n_vocab..(i + 1) * n_vocab],
                &single[i * n_vocab..(i + 1) * n_vocab],
            );
            worst = worst.max(common::nmse(a, b));
            max_diff = a
                .iter()
                .zip(b)
                .map(|(x, y)| (x - y).abs())
                .fold(max_diff, f32::max);
            assert_eq!(common::argmax(a), common::argmax(b), "{name} k={k} row {i}");
        }
    }
    eprintln!("{name}: multi-token vs one-token steps (k = 1, 4, 8): worst NMSE {worst:.3e}, largest logit difference {max_diff:.4}");
    Some((worst, max_diff))
}

#[test]
fn multi_token_step_is_bit_identical_smollm2() {
    if let Some((nmse, diff)) = multi_token_step_vs_single(SMOLLM2) {
        assert_eq!((nmse, diff), (0.0, 0.0));
    }
}

#[test]
fn multi_token_step_matches_llama_cpp_qwen2() {
    if let Some((nmse, _)) = multi_token_step_vs_single(QWEN2) {
        assert!(nmse < 1e-2, "{nmse}");
    }
}

#[test]
fn multi_token_step_matches_llama_cpp_qwen15() {
    if let Some((nmse, _)) = multi_token_step_vs_single(QWEN15) {
        assert!(nmse < 1e-2, "{nmse}");
    }
}

/// On the command line: `run` with prompt lookup or a draft model (-md, as
/// llama.cpp spells it) prints what plain `run` prints, also when a
/// drafted generation is saved and resumed as a session, and in `--chat`.
#[test]
fn cli_run_chat_and_sessions_with_drafting() {
    let Some(path) = model(SMOLLM2) else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    // a draft with SmolLM2's vocabulary: the converter's tiny synthetic model
    let draft = dir.path().join("draft.gguf");
    let st = std::process::Command::new(env!("CARGO_BIN_EXE_strata-convert"))
        .args([
            "synth",
            "--preset",
            "tiny",
            "--type",
            "q4_0",
            "--vocab-from",
        ])
        .arg(&path)
        .arg(&draft)
        .output()
        .expect("strata-convert runs");
    assert!(
        st.status.success(),
        "{}",
        String::from_utf8_lossy(&st.stderr)
    );
    let run = |extra: &[&str], stdin: &str| -> (String, String) {
        use std::io::Write;
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_strata"))
            .args(["run", "-m"])
            .arg(&path)
            .args(["--device", "cpu", "-t", "2", "-c", "512", "--seed", "5"])
            .args(extra)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("strata runs");
        child
            .stdin
            .take()
            .unwrap()
            .write_all(stdin.as_bytes())
            .unwrap();
        let out = child.wait_with_output().expect("strata ends");
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert!(out.status.success(), "{err}");
        (String::from_utf8(out.stdout).expect("utf-8"), err)
    };
    let d = draft.to_str().unwrap();
    let p =
        "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n";
    for temp in ["0", "0.8"] {
        let (plain, _) = run(&["-p", p, "-n", "40", "--temp", temp], "");
        let (lookup, err) = run(
            &[
                "-p",
                p,
                "-n",
                "40",
                "--temp",
                temp,
                "--lookup",
                "8",
                "--draft-fixed",
            ],
            "",
        );
        assert_eq!(lookup, plain, "lookup, temp {temp}");
        assert!(err.contains("speculative:"), "{err}");
        let (drafted, err) = run(
            &[
                "-p",
                p,
                "-n",
                "40",
                "--temp",
                temp,
                "-md",
                d,
                "--draft-fixed",
                "--draft-p-min",
                "0",
            ],
            "",
        );
        assert_eq!(drafted, plain, "draft model, temp {temp}");
        assert!(err.contains("draft: strata synthetic tiny"), "{err}");
    }
    // a drafted generation saved and resumed equals the unbroken one
    let f = dir.path().join("s.kv");
    let f = f.to_str().unwrap();
    let (full, _) = run(&["-p", p, "-n", "30", "--temp", "0.8"], "");
    let (a, _) = run(
        &[
            "-p",
            p,
            "-n",
            "12",
            "--temp",
            "0.8",
            "--lookup",
            "8",
            "--save-session",
            f,
        ],
        "",
    );
    let (b, _) = run(
        &[
            "--load-session",
            f,
            "-n",
            "18",
            "--temp",
            "0.8",
            "-md",
            d,
            "--draft-p-min",
            "0",
        ],
        "",
    );
    assert_eq!(
        format!("{}{}", a.trim_end_matches('\n'), b.trim_end_matches('\n')),
        full.trim_end_matches('\n')
    );
    // two chat turns
    let turns = "Name a color.\nName another one.\n";
    let (plain, _) = run(&["--chat", "-n", "24", "--temp", "0"], turns);
    let (lookup, _) = run(
        &[
            "--chat",
            "-n",
            "24",
            "--temp",
            "0",
            "--lookup",
            "8",
            "--draft-fixed",
        ],
        turns,
    );
    assert_eq!(lookup, plain, "chat with lookup");
    // a draft model of another vocabulary is refused, naming both
    let qwen = model(QWEN2).expect("model");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["run", "--device", "cpu", "-p", "hi", "-m"])
        .arg(&path)
        .arg("-md")
        .arg(&qwen)
        .output()
        .expect("strata runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("cannot draft for"),
        "{err}"
    );
}

/// A draft model drafting for several sequences at once (the server's way:
/// catch-up tokens in one step, then one step per drafted position) drafts
/// for each what it drafts for that sequence alone, keeps each sequence's
/// cache to its own tokens when contexts diverge (rejected drafts), and
/// forgets a sequence without touching the others.
#[test]
fn draft_model_drafts_many_sequences_as_each_alone() {
    use strata::speculative::DraftRequest;
    let Some(path) = model(SMOLLM2) else { return };
    let vocab = LlamaModel::load(&path, true, 0).expect("vocab");
    // batch-invariant kernels: a row's logits do not depend on its batch
    let c = EngineConfig {
        batch_invariant: true,
        ..cfg()
    };
    let mut many = DraftModel::new(Engine::load(&path, &c).expect("engine"), 0.0);
    let mut alone = DraftModel::new(Engine::load(&path, &c).expect("engine"), 0.0);
    let mut ctx: Vec<Vec<u32>> = PROMPTS
        .iter()
        .map(|p| vocab.tokenize(p, true, true).expect("tokenize"))
        .collect();
    for round in 0..4 {
        let reqs: Vec<DraftRequest> = ctx
            .iter()
            .enumerate()
            .map(|(s, c)| DraftRequest {
                seq: s as u32,
                context: c,
                max: 3 + s,
            })
            .collect();
        let got = many.draft_many(&reqs).expect("batched drafts");
        for (s, d) in got.iter().enumerate() {
            alone.clear();
            let want = alone.draft(&ctx[s], 3 + s).expect("drafts alone");
            assert_eq!(d, &want, "round {round}, seq {s}");
            assert_eq!(d.len(), 3 + s, "p_min 0 drafts the most");
        }
        // the target accepts a different number of drafts per sequence,
        // then emits its own token (not the next draft)
        for (s, d) in got.iter().enumerate() {
            let keep = (round + s) % (d.len() + 1);
            ctx[s].extend_from_slice(&d[..keep]);
            ctx[s].push((d.get(keep).copied().unwrap_or(7) + 1) % 1000);
        }
    }
    many.forget(1);
    assert!(many.engine.kv().cells().seq_cells(1).is_empty());
    assert!(!many.engine.kv().cells().seq_cells(0).is_empty());
}
