//! strata against llama.cpp's own decoder (libllama) on the CPU backend,
//! as its users run it (weights repacked into the CPU's extra buffer types,
//! flash attention auto): identical greedy continuations and per-position
//! logits within NMSE 1e-4, and batched sequences equal to the same
//! sequences run one at a time. With repacking off on both sides (llama.cpp's
//! --no-repack) the plain-memory path matches too.

mod common;

use common::{argmax, model, nmse};
use strata::engine::{BatchToken, DeviceChoice, Engine, EngineConfig};
use strata::llama::{LlamaModel, Reference, ReferenceConfig};

const N_GEN: usize = 64;
const PROMPTS: [&str; 4] = [
    "The capital of France is",
    "A good unit test checks if the function returns the",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
];

fn cfg() -> EngineConfig {
    EngineConfig {
        n_ctx: 512,
        n_batch: 512,
        n_threads: 2,
        device: DeviceChoice::Cpu,
        progress: false,
        ..EngineConfig::default()
    }
}

fn ref_cfg() -> ReferenceConfig {
    ReferenceConfig {
        n_ctx: 512,
        n_batch: 512,
        n_ubatch: 0,
        n_seq: 4,
        n_threads: 2,
        offload_kqv: true,
    }
}

/// llama.cpp with its default settings, or with repacking off.
fn llama(path: &std::path::Path, repack: bool) -> LlamaModel {
    if repack {
        LlamaModel::load_as_users_run(path, 0)
    } else {
        LlamaModel::load(path, false, 0)
    }
    .expect("libllama loads the model")
}

fn reference(lm: &LlamaModel, repack: bool) -> Reference<'_> {
    if repack {
        Reference::new_default_settings(lm, &ref_cfg())
    } else {
        Reference::new(lm, &ref_cfg())
    }
    .expect("reference context")
}

/// strata on the CPU, repacking as llama.cpp does (or not).
fn strata(path: &std::path::Path, repack: bool) -> Engine {
    Engine::load(path, &EngineConfig { repack, ..cfg() }).expect("strata loads the model")
}

fn run_strata(e: &mut Engine, prompt: &[u32]) -> (Vec<u32>, Vec<Vec<f32>>) {
    let r = strata::parity::run_strata(e, prompt, N_GEN).expect("strata run");
    (r.tokens, r.logits)
}

fn run_reference(r: &mut Reference, prompt: &[u32], nv: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let r = strata::parity::run_reference(r, prompt, N_GEN, nv).expect("reference run");
    (r.tokens, r.logits)
}

/// llama.cpp with its default settings, or with repacking off (`repack`
/// false) and strata configured the same way.
fn parity(name: &str, repack: bool) {
    let Some(path) = model(name) else { return };
    let lm = llama(&path, repack);
    let mut reference = reference(&lm, repack);
    let mut engine = strata(&path, repack);
    let nv = engine.n_vocab() as usize;
    for p in PROMPTS {
        let prompt = lm.tokenize(p, true, true).expect("tokenize");
        let (st, sl) = run_strata(&mut engine, &prompt);
        let (rt, rl) = run_reference(&mut reference, &prompt, nv);
        assert_eq!(sl.len(), rl.len());
        let worst = sl
            .iter()
            .zip(&rl)
            .map(|(a, b)| nmse(a, b))
            .fold(0.0, f64::max);
        eprintln!(
            "{name} {p:?}: worst per-position NMSE {worst:.3e}; {}",
            String::from_utf8_lossy(
                &st.iter()
                    .flat_map(|&t| lm.token_bytes(t, false))
                    .collect::<Vec<u8>>()
            )
        );
        assert!(
            worst <= 1e-4,
            "{name}: logits NMSE {worst} > 1e-4 for prompt {p:?}"
        );
        assert_eq!(
            st, rt,
            "{name}: greedy continuation differs for prompt {p:?}"
        );
    }
}

#[test]
fn smollm2_matches_llama_cpp() {
    parity(common::SMOLLM2, true);
}

#[test]
fn qwen2_matches_llama_cpp() {
    parity(common::QWEN2, true);
}

#[test]
fn qwen2_matches_llama_cpp_without_repacking() {
    parity(common::QWEN2, false);
}

/// Several sequences of different lengths in one batch: strata batched
/// equals llama.cpp batched (same cells, same kernels). Logits of a batched
/// step differ from a single-sequence step by rounding only (CPU matmul
/// kernels accumulate a multi-row batch differently), so that comparison
/// has a looser bound. In plain memory the rounding never flips a greedy
/// token of these prompts; with repacked weights it does (on Qwen2.5,
/// llama.cpp's own batched and single runs part after a dozen tokens), so
/// there only the first step, where both see the same inputs, is compared.
fn batch_equals_single(name: &str, repack: bool) {
    let Some(path) = model(name) else { return };
    let lm = llama(&path, repack);
    let mut reference = reference(&lm, repack);
    let mut engine = strata(&path, repack);
    let nv = engine.n_vocab() as usize;
    let prompts: Vec<Vec<u32>> = PROMPTS
        .iter()
        .map(|p| lm.tokenize(p, true, true).expect("tokenize"))
        .collect();
    let n_steps = 16;
    let single: Vec<(Vec<u32>, Vec<Vec<f32>>)> = prompts
        .iter()
        .map(|p| {
            let (t, l) = run_strata(&mut engine, p);
            (
                t[..n_steps].to_vec(),
                l[p.len() - 1..p.len() - 1 + n_steps].to_vec(),
            )
        })
        .collect();
    engine.clear();
    reference.clear();
    let mut batch = Vec::new();
    for (s, p) in prompts.iter().enumerate() {
        for (i, &t) in p.iter().enumerate() {
            batch.push(BatchToken {
                token: t,
                pos: i as i32,
                seq: s as u32,
                logits: i + 1 == p.len(),
            });
        }
    }
    let rbatch: Vec<_> = batch
        .iter()
        .map(|b| (b.token, b.pos, b.seq, b.logits))
        .collect();
    let split = |v: Vec<f32>| -> Vec<Vec<f32>> { v.chunks(nv).map(|c| c.to_vec()).collect() };
    let mut last = split(engine.decode(&batch).expect("batch prompt"));
    let mut rlast = split(reference.decode(&rbatch).expect("reference batch prompt"));
    let mut toks = vec![Vec::new(); prompts.len()];
    let mut logs = vec![Vec::new(); prompts.len()];
    let mut worst_ref = 0f64;
    for step in 0..n_steps {
        let mut b = Vec::new();
        for s in 0..prompts.len() {
            worst_ref = worst_ref.max(nmse(&last[s], &rlast[s]));
            let t = argmax(&last[s]);
            assert_eq!(
                t,
                argmax(&rlast[s]),
                "{name}: seq {s} step {step}: batched token differs from llama.cpp"
            );
            toks[s].push(t);
            logs[s].push(last[s].clone());
            b.push(BatchToken {
                token: t,
                pos: (prompts[s].len() + step) as i32,
                seq: s as u32,
                logits: true,
            });
        }
        let rb: Vec<_> = b
            .iter()
            .map(|b| (b.token, b.pos, b.seq, b.logits))
            .collect();
        last = split(engine.decode(&b).expect("batch decode"));
        rlast = split(reference.decode(&rb).expect("reference batch decode"));
    }
    eprintln!("{name}: batched strata vs batched llama.cpp worst NMSE {worst_ref:.3e}");
    assert!(
        worst_ref <= 1e-4,
        "{name}: batched logits NMSE {worst_ref} vs llama.cpp"
    );
    for s in 0..prompts.len() {
        let steps = if repack { 1 } else { n_steps };
        assert_eq!(
            toks[s][..steps],
            single[s].0[..steps],
            "{name}: sequence {s} tokens differ batched vs single"
        );
        let worst = logs[s][..steps]
            .iter()
            .zip(&single[s].1)
            .map(|(a, b)| nmse(a, b))
            .fold(0.0, f64::max);
        eprintln!("{name} seq {s}: batched vs single NMSE {worst:.3e}");
        assert!(
            worst <= 1e-3,
            "{name}: sequence {s} logits NMSE {worst} batched vs single"
        );
    }
}

#[test]
fn smollm2_batch_equals_single() {
    batch_equals_single(common::SMOLLM2, true);
}

#[test]
fn qwen2_batch_equals_single() {
    batch_equals_single(common::QWEN2, true);
}

#[test]
fn qwen2_batch_equals_single_without_repacking() {
    batch_equals_single(common::QWEN2, false);
}

/// The thread tuner changes the CPU's thread count between steps (without
/// `-t`), so a step's logits must not depend on it: ggml splits each
/// operation's rows between the threads, a row's arithmetic is the same
/// whoever computes it. Repacked and plain weights, prompt and decode
/// steps, 1 against 2 threads, bit for bit.
#[test]
fn thread_count_does_not_change_logits() {
    for name in [common::SMOLLM2, common::QWEN2] {
        let Some(path) = model(name) else { continue };
        let lm = llama(&path, true);
        let prompt = lm
            .tokenize("def fibonacci(n):\n    \"\"\"Return", true, true)
            .expect("tokenize");
        for repack in [true, false] {
            let at = |n_threads| {
                let mut e = Engine::load(
                    &path,
                    &EngineConfig {
                        n_threads,
                        repack,
                        ..cfg()
                    },
                )
                .expect("engine");
                run_strata(&mut e, &prompt)
            };
            let (t1, l1) = at(1);
            let (t2, l2) = at(2);
            assert_eq!(t1, t2, "{name} repack={repack}: tokens");
            for (i, (a, b)) in l1.iter().zip(&l2).enumerate() {
                assert!(
                    a == b,
                    "{name} repack={repack}: logits of position {i} differ"
                );
            }
        }
    }
}
