//! Paging on the CPU backend: with every layer group streamed through the
//! slot rings, greedy tokens and logits equal the all-resident run, for one
//! sequence and for a multi-sequence batch; the NaN-poison debug switch
//! catches a deliberately broken copy/compute ordering.

mod common;

use common::{all_positions, model};
use strata::engine::{DeviceChoice, Engine, EngineConfig, PagingOptions};
use strata::llama::LlamaModel;
use strata::parity::{compare, nmse, run_strata};

const PROMPTS: [&str; 2] = ["The capital of France is", "def quicksort(xs):\n    "];

/// Streamed slots hold the plain weight layout, so the resident engines
/// compared with them keep plain (not repacked) weights too.
fn cfg(stream_all: bool, slots: usize) -> EngineConfig {
    EngineConfig {
        repack: false,
        n_ctx: 512,
        n_batch: 512,
        n_threads: 2,
        device: DeviceChoice::Cpu,
        paging: PagingOptions {
            stream_all,
            slots,
            ..PagingOptions::default()
        },
        ..EngineConfig::default()
    }
}

/// Every position of both PROMPTS, one sequence each.
fn prompts_batch(vocab: &LlamaModel) -> Vec<strata::engine::BatchToken> {
    let prompts: Vec<Vec<u32>> = PROMPTS
        .iter()
        .map(|p| vocab.tokenize(p, true, true).expect("tokenize"))
        .collect();
    all_positions(&prompts)
}

fn streamed_equals_resident(name: &str) {
    let Some(path) = model(name) else { return };
    let vocab = LlamaModel::load(&path, true, 0).expect("vocab");
    let mut resident = Engine::load(&path, &cfg(false, 3)).expect("resident engine");
    assert_eq!(resident.plan.placement.n_streamed(), 0);
    for slots in [2, 3] {
        let mut streamed = Engine::load(&path, &cfg(true, slots)).expect("streamed engine");
        assert_eq!(
            streamed.plan.placement.n_streamed(),
            2 * streamed.spec.hp.n_layer as usize
        );
        for p in PROMPTS {
            let prompt = vocab.tokenize(p, true, true).expect("tokenize");
            let a = run_strata(&mut resident, &prompt, 24).expect("resident run");
            let b = run_strata(&mut streamed, &prompt, 24).expect("streamed run");
            let (worst, diff) = compare(&b, &a);
            assert!(
                worst <= 1e-6,
                "{name} slots={slots}: NMSE {worst} streamed vs resident"
            );
            assert_eq!(diff, None, "{name} slots={slots}: tokens differ");
            let up = streamed.last_step.pager;
            assert_eq!(
                up.uploads,
                2 * streamed.spec.hp.n_layer as u64,
                "every group uploaded once per step"
            );
        }
    }
    // multi-sequence batch
    let mut streamed = Engine::load(&path, &cfg(true, 2)).expect("streamed engine");
    let batch = prompts_batch(&vocab);
    resident.clear();
    let a = resident.decode(&batch).expect("resident batch");
    let b = streamed.decode(&batch).expect("streamed batch");
    let e = nmse(&b, &a);
    assert!(e <= 1e-6, "{name}: batched NMSE {e} streamed vs resident");
}

#[test]
fn smollm2_streamed_equals_resident() {
    streamed_equals_resident(common::SMOLLM2);
}

#[test]
fn qwen2_streamed_equals_resident() {
    streamed_equals_resident(common::QWEN2);
}

#[test]
fn poison_switch_catches_broken_ordering() {
    let Some(path) = model(common::SMOLLM2) else {
        return;
    };
    let vocab = LlamaModel::load(&path, true, 0).expect("vocab");
    let prompt = vocab
        .tokenize("The capital of France is", true, true)
        .expect("tokenize");
    let mut base = Engine::load(&path, &cfg(false, 2)).expect("engine");
    let want = run_strata(&mut base, &prompt, 4).expect("run");

    // poison on, ordering intact: identical results
    let mut c = cfg(true, 2);
    c.faults.poison_slots = true;
    let mut ok = Engine::load(&path, &c).expect("engine");
    let got = run_strata(&mut ok, &prompt, 4).expect("run");
    assert_eq!(compare(&got, &want), (0.0, None));

    // computations that do not wait for their upload read poisoned slots
    c.faults.skip_load_wait = true;
    let mut broken = Engine::load(&path, &c).expect("engine");
    let got = run_strata(&mut broken, &prompt, 4).expect("run");
    let nan = got.logits.iter().flatten().any(|x| x.is_nan());
    assert!(nan, "a read before its upload completed must show as NaN");

    // without the switch the same fault goes unnoticed by a NaN check
    c.faults.poison_slots = false;
    let mut silent = Engine::load(&path, &c).expect("engine");
    let got = run_strata(&mut silent, &prompt, 4).expect("run");
    assert!(!got.logits.iter().flatten().any(|x| x.is_nan()));
    assert!(
        compare(&got, &want).0 > 1e-3,
        "the fault must change the output"
    );
}

/// The DRAM tier: a host window of 3 groups forces every streamed group to
/// be re-read from the model file each step; results equal all-resident.
fn dram_window_equals_resident(name: &str) {
    let Some(path) = model(name) else { return };
    let vocab = LlamaModel::load(&path, true, 0).expect("vocab");
    let mut resident = Engine::load(&path, &cfg(false, 3)).expect("resident engine");
    let probe = Engine::load(&path, &cfg(true, 2)).expect("streamed engine");
    let max_extent = probe
        .store()
        .layouts
        .iter()
        .map(|l| l.bytes as u64)
        .max()
        .expect("groups");
    drop(probe);
    let mut c = cfg(true, 2);
    // a small window without read-ahead, and a larger one reading ahead
    for groups in [4u64, 10] {
        c.budgets.dram = Some(groups * max_extent);
        let mut windowed = Engine::load(&path, &c).expect("windowed engine");
        assert!(windowed.store().window_slots().is_some());
        if groups == 10 {
            assert!(
                windowed.store().read_ahead() > 0,
                "a larger window reads ahead"
            );
        }
        for p in PROMPTS {
            let prompt = vocab.tokenize(p, true, true).expect("tokenize");
            let a = run_strata(&mut resident, &prompt, 12).expect("resident run");
            let b = run_strata(&mut windowed, &prompt, 12).expect("windowed run");
            assert_eq!(
                compare(&b, &a),
                (0.0, None),
                "{name}: DRAM-windowed run differs ({groups} groups)"
            );
            let step = windowed.last_step;
            assert!(
                step.disk_bytes >= step.pager.bytes / 2,
                "{name}: a small window must re-read most streamed bytes each step ({} of {})",
                step.disk_bytes,
                step.pager.bytes
            );
        }
    }
    let mut windowed = Engine::load(&path, &c).expect("windowed engine");
    // a multi-sequence batch through the window
    let batch = prompts_batch(&vocab);
    resident.clear();
    windowed.clear();
    let a = resident.decode(&batch).expect("resident batch");
    let b = windowed.decode(&batch).expect("windowed batch");
    assert_eq!(
        nmse(&b, &a),
        0.0,
        "{name}: batched DRAM-windowed run differs"
    );
    // a budget below two host slots is refused, naming the minimum
    c.budgets.dram = Some(max_extent);
    let e = Engine::load(&path, &c)
        .err()
        .expect("too small a DRAM budget is refused");
    assert!(e.to_string().contains("DRAM budget"), "{e}");
}

#[test]
fn smollm2_dram_window_equals_resident() {
    dram_window_equals_resident(common::SMOLLM2);
}

#[test]
fn qwen2_dram_window_equals_resident() {
    dram_window_equals_resident(common::QWEN2);
}

/// The timeline records, for one streamed step, one compute span per layer
/// group plus the head and one copy span per upload with its bytes; with
/// no timeline on, nothing is recorded.
#[test]
fn timeline_records_each_group_and_upload() {
    use strata::engine::timeline::Stream;
    use strata::engine::BatchToken;
    let Some(path) = model("SmolLM2-135M-Instruct.Q4_1.gguf") else {
        return;
    };
    let mut e = Engine::load(&path, &cfg(true, 2)).expect("streamed engine");
    let n_groups = 2 * e.spec.hp.n_layer as usize;
    let tok = |pos| BatchToken {
        token: 1,
        pos,
        seq: 0,
        logits: true,
    };
    e.decode(&[tok(0)]).expect("step without a timeline");
    assert!(e.finish_timeline().is_empty(), "nothing recorded while off");
    e.start_timeline();
    e.decode(&[tok(1)]).expect("recorded step");
    let spans = e.finish_timeline();
    let compute: Vec<_> = spans
        .iter()
        .filter(|s| s.stream == Stream::Compute)
        .collect();
    let copies: Vec<_> = spans.iter().filter(|s| s.stream == Stream::Copy).collect();
    assert_eq!(compute.len(), n_groups + 1, "every group and the head");
    assert_eq!(compute.last().map(|s| s.name.as_str()), Some("head"));
    assert_eq!(copies.len(), n_groups, "every group uploaded once");
    let up = e.last_step.pager;
    assert_eq!(copies.iter().map(|s| s.bytes).sum::<u64>(), up.bytes);
    assert!(spans.windows(2).all(|w| w[0].start <= w[1].start), "sorted");
    assert!(spans.iter().all(|s| s.end >= s.start));
    // a second recording starts empty
    e.start_timeline();
    assert!(e.finish_timeline().is_empty());
}

/// The plan reserves activation memory before any graph exists; the one
/// buffer every graph shares must never outgrow that reserve, at a decode
/// step, at the largest step, with logits for every row, and with up to 64
/// sequences in a step (their prompts, then a token each).
#[test]
fn activation_reserve_covers_the_largest_graph() {
    for name in [common::SMOLLM2, common::QWEN2] {
        let Some(path) = model(name) else { continue };
        for n_batch in [1u32, 7, 64, 300, 512] {
            let c = EngineConfig {
                n_batch,
                n_ctx: 1024,
                ..cfg(false, 3)
            };
            let mut e = Engine::load(&path, &c).expect("engine");
            let toks: Vec<_> = (0..n_batch)
                .map(|i| strata::engine::BatchToken {
                    token: 100 + i,
                    pos: i as i32,
                    seq: 0,
                    logits: true,
                })
                .collect();
            e.decode(&toks).expect("full step");
            // and a decode step deep into the context
            let last = strata::engine::BatchToken {
                token: 7,
                pos: 1000,
                seq: 0,
                logits: true,
            };
            e.decode(&[last]).expect("decode step");
            // many sequences in one step (a batch of 64 sequences' prompts
            // and their decode step): each token sees its own sequence
            e.clear();
            let seqs = 64.min(n_batch);
            let per = (n_batch / seqs).max(1);
            let many: Vec<_> = (0..seqs * per)
                .map(|i| strata::engine::BatchToken {
                    token: 100 + i % 50,
                    pos: (i % per) as i32,
                    seq: i / per,
                    logits: i % per == per - 1,
                })
                .collect();
            e.decode(&many).expect("many sequences");
            let next: Vec<_> = (0..seqs)
                .map(|s| strata::engine::BatchToken {
                    token: 9,
                    pos: per as i32,
                    seq: s,
                    logits: true,
                })
                .collect();
            e.decode(&next).expect("many sequences' decode step");
            let (used, reserve) = (e.activation_bytes(), e.activation_reserve());
            eprintln!("{name} b={n_batch}: activations {used} of {reserve} reserved");
            assert!(used > 0, "{name} b={n_batch}: no activations allocated");
            assert!(
                used <= reserve,
                "{name} b={n_batch}: activations {used} bytes outgrew the plan's reserve {reserve}"
            );
        }
    }
}

/// A step larger than `ffn_rows` runs each FFN over chunks of rows inside
/// one graph. With batch-invariant numerics (kernels that do not depend on
/// the number of rows) the logits equal the whole step's bit for bit; with
/// the default kernels, which ggml picks by batch size (Qwen2's Q5_0/Q8_0
/// matrices go through its tiled GEMM), the same greedy tokens and the same
/// NMSE as steps of 8 tokens against steps of 64 (4.4e-4 for Qwen2, 0 for
/// SmolLM2). Activations stay within the reserve.
#[test]
fn chunked_ffn_equals_whole() {
    for name in [common::SMOLLM2, common::QWEN2] {
        let Some(path) = model(name) else { continue };
        let vocab = LlamaModel::load(&path, true, 0).expect("vocab");
        let text = "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n    pivot = xs[0]\n    left = [x for x in xs[1:] if x < pivot]\n";
        let prompt = vocab.tokenize(text, true, true).expect("tokenize");
        assert!(prompt.len() > 24, "{} tokens", prompt.len());
        for invariant in [true, false] {
            let whole_cfg = EngineConfig {
                n_batch: 64,
                batch_invariant: invariant,
                ..cfg(false, 3)
            };
            let mut whole = Engine::load(&path, &whole_cfg).expect("engine");
            let mut chunked = Engine::load(
                &path,
                &EngineConfig {
                    paging: PagingOptions {
                        ffn_rows: Some(8),
                        ..whole_cfg.paging.clone()
                    },
                    ..whole_cfg.clone()
                },
            )
            .expect("chunked engine");
            let a = run_strata(&mut whole, &prompt, 8).expect("whole run");
            let b = run_strata(&mut chunked, &prompt, 8).expect("chunked run");
            let (worst, diff) = compare(&b, &a);
            eprintln!("{name}, batch-invariant {invariant}: chunked FFN vs whole, NMSE {worst:e}");
            let bound = if invariant { 0.0 } else { 1e-3 };
            assert!(worst <= bound, "{name}: NMSE {worst} chunked vs whole");
            assert_eq!(diff, None, "{name}: tokens differ");
            // (the head's logits dominate these small models' activations)
            assert!(chunked.activation_reserve() <= whole.activation_reserve());
            assert!(chunked.activation_bytes() <= chunked.activation_reserve());
        }
    }
}

/// `--resident spread`: under a budget that keeps part of the model, the
/// same number of groups of each kind stay resident, spread through the
/// layers instead of the first ones, and the tokens and logits are those of
/// the all-resident run, for one sequence and a batch.
#[test]
fn spread_residents_equal_resident() {
    let Some(path) = model(common::SMOLLM2) else {
        return;
    };
    let vocab = LlamaModel::load(&path, true, 0).expect("vocab");
    let mut resident = Engine::load(&path, &cfg(false, 3)).expect("resident engine");
    let groups: u64 = resident
        .store()
        .layouts
        .iter()
        .map(|l| l.bytes as u64)
        .sum();
    let with = |order, budget| {
        let mut c = cfg(false, 2);
        c.budgets.gpu = Some(budget);
        c.paging.resident = order;
        Engine::load(&path, &c)
    };
    // the smallest budget (fixed bytes and the rings), then half the groups
    let minimum = match with(strata::paging::ResidentOrder::First, 1) {
        Err(strata::engine::EngineError::Plan(strata::paging::PlanError::BudgetTooSmall {
            minimum,
            ..
        })) => minimum,
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("a 1-byte budget is refused"),
    };
    let budgeted = |order| with(order, minimum + groups / 2).expect("budgeted engine");
    let first = budgeted(strata::paging::ResidentOrder::First);
    let mut spread = budgeted(strata::paging::ResidentOrder::Spread);
    let (f, s) = (first.plan.placement.clone(), spread.plan.placement.clone());
    let n = f.resident.len();
    assert!(f.n_streamed() > 0 && f.n_streamed() < n, "a partial plan");
    assert_eq!(f.resident_bytes, s.resident_bytes);
    let on = |r: &[bool]| (0..n).filter(|&i| r[i]).collect::<Vec<_>>();
    assert!(
        on(&s.resident).last() > on(&f.resident).last(),
        "spread reaches later layers: {:?} against {:?}",
        on(&s.resident),
        on(&f.resident)
    );
    assert!(s.resident[0], "the first layer's attention stays resident");
    for p in PROMPTS {
        let prompt = vocab.tokenize(p, true, true).expect("tokenize");
        let a = run_strata(&mut resident, &prompt, 16).expect("resident run");
        let b = run_strata(&mut spread, &prompt, 16).expect("spread run");
        assert_eq!(compare(&b, &a), (0.0, None), "spread run differs");
        assert_eq!(spread.last_step.pager.uploads, s.n_streamed() as u64);
    }
    let batch = prompts_batch(&vocab);
    resident.clear();
    spread.clear();
    let a = resident.decode(&batch).expect("resident batch");
    let b = spread.decode(&batch).expect("spread batch");
    assert_eq!(nmse(&b, &a), 0.0, "spread batch differs");
}
