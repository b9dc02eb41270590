//! The tiered KV cache on the CPU backend: with layers' KV windowed through
//! host frames, and with blocks forced through SSD spill files, greedy
//! tokens and logits equal the all-on-device KV run, for one sequence, for
//! multi-sequence batches and for sequences that take turns. Corrupt or
//! truncated spill files and a full spill disk are clean errors.

mod common;

use common::{all_positions, argmax, model, QWEN2, SMOLLM2};
use strata::engine::{
    BatchToken, Budgets, Engine, EngineConfig, EngineError, Faults, KvTierOptions, PagingOptions,
};
use strata::llama::LlamaModel;
use strata::parity::{compare, nmse, run_strata};

const PROMPTS: [&str; 3] = [
    "The capital of France is",
    "def quicksort(xs):\n    ",
    "Once upon a time, in a small village by the sea,",
];

/// Plain (not repacked) CPU weights: one variant streams its weights, and
/// streamed slots hold the plain layout, so every engine compared here
/// computes from plain memory.
fn cfg() -> EngineConfig {
    EngineConfig {
        repack: false,
        ..common::cpu_cfg()
    }
}

fn tiered(kv_layers_on_device: u64, e: &Engine) -> EngineConfig {
    // the KV of one layer: K and V, F16, n_ctx cells
    let per_layer = 2 * 2 * e.spec.hp.n_embd_kv() as u64 * e.n_ctx() as u64;
    EngineConfig {
        budgets: Budgets {
            kv_gpu: Some(kv_layers_on_device * per_layer),
            ..Budgets::default()
        },
        ..cfg()
    }
}

/// `c` with blocks of `block` cells, `kv_dram` bytes of frames and spill
/// files in `dir` (at most `spill_max` bytes).
fn spilling(
    c: EngineConfig,
    block: usize,
    kv_dram: u64,
    dir: &std::path::Path,
    spill_max: Option<u64>,
) -> EngineConfig {
    EngineConfig {
        budgets: Budgets {
            kv_dram: Some(kv_dram),
            ..c.budgets
        },
        kv_tier: KvTierOptions {
            block,
            spill_dir: Some(dir.to_path_buf()),
            spill_max,
        },
        ..c
    }
}

/// Every group streamed through two slots.
fn streamed() -> PagingOptions {
    PagingOptions {
        stream_all: true,
        slots: 2,
        ..PagingOptions::default()
    }
}

fn tokenize(path: &std::path::Path) -> Vec<Vec<u32>> {
    let vocab = LlamaModel::load(path, true, 0).expect("vocab");
    PROMPTS
        .iter()
        .map(|p| vocab.tokenize(p, true, true).expect("tokenize"))
        .collect()
}

/// Greedy continuation of sequence `seq` whose tokens so far are `toks`
/// (the first call feeds them all): `n` more tokens, with the logits.
fn continue_seq(
    e: &mut Engine,
    seq: u32,
    toks: &mut Vec<u32>,
    fed: &mut usize,
    n: usize,
) -> Result<Vec<Vec<f32>>, EngineError> {
    let mut out = Vec::new();
    for _ in 0..n {
        let batch: Vec<_> = (*fed..toks.len())
            .map(|i| BatchToken {
                token: toks[i],
                pos: i as i32,
                seq,
                logits: i + 1 == toks.len(),
            })
            .collect();
        let l = e.decode(&batch)?;
        *fed = toks.len();
        toks.push(argmax(&l));
        out.push(l);
    }
    Ok(out)
}

fn windowed_equals_device_kv(name: &str) {
    let Some(path) = model(name) else { return };
    let prompts = tokenize(&path);
    let mut base = Engine::load(&path, &cfg()).expect("engine");
    let n_layer = base.spec.hp.n_layer as u64;
    // all layers windowed; half; and all windowed with streamed weights
    // and NaN-poisoned windows (a block missing from an upload shows)
    let variants: Vec<(&str, EngineConfig)> = vec![
        ("all windowed", tiered(0, &base)),
        ("half windowed", tiered(n_layer / 2, &base)),
        (
            "windowed+streamed+poison",
            EngineConfig {
                paging: streamed(),
                faults: Faults {
                    poison_slots: true,
                    ..Faults::default()
                },
                ..tiered(0, &base)
            },
        ),
    ];
    for (what, c) in variants {
        let mut e = Engine::load(&path, &c).expect("tiered engine");
        let tier = e.kv_tier().expect("some layers windowed");
        assert_eq!(tier.layers.len() + e.kv_resident_layers(), n_layer as usize);
        for p in &prompts[..2] {
            let a = run_strata(&mut base, p, 16).expect("device-KV run");
            let b = run_strata(&mut e, p, 16).expect("tiered run");
            let (worst, diff) = compare(&b, &a);
            assert_eq!(worst, 0.0, "{name} {what}: NMSE {worst}");
            assert_eq!(diff, None, "{name} {what}: tokens differ");
            let kv = e.last_step.kv;
            assert!(kv.up_bytes > 0 && kv.down_bytes > 0, "{what}: KV travelled");
        }
        // a batch of three sequences, then each sequence on its own
        base.clear();
        e.clear();
        let mut toks_a: Vec<Vec<u32>> = prompts.clone();
        let mut toks_b = prompts.clone();
        let la = base
            .decode(&all_positions(&toks_a))
            .expect("device-KV batch");
        let lb = e.decode(&all_positions(&toks_b)).expect("tiered batch");
        assert_eq!(nmse(&lb, &la), 0.0, "{name} {what}: batch logits differ");
        let mut fed_a: Vec<usize> = toks_a.iter().map(|t| t.len()).collect();
        let mut fed_b = fed_a.clone();
        let nv = base.n_vocab() as usize;
        let mut off = 0;
        for s in 0..3 {
            off += toks_a[s].len();
            toks_a[s].push(argmax(&la[(off - 1) * nv..off * nv]));
            toks_b[s].push(argmax(&lb[(off - 1) * nv..off * nv]));
        }
        for round in 0..3 {
            for s in 0..3 {
                let a = continue_seq(&mut base, s as u32, &mut toks_a[s], &mut fed_a[s], 2)
                    .expect("device-KV turn");
                let b = continue_seq(&mut e, s as u32, &mut toks_b[s], &mut fed_b[s], 2)
                    .expect("tiered turn");
                for (x, y) in b.iter().zip(&a) {
                    assert_eq!(nmse(x, y), 0.0, "{name} {what}: seq {s} round {round}");
                }
            }
        }
        assert_eq!(toks_a, toks_b, "{name} {what}: turn tokens differ");
    }
}

#[test]
fn windowed_kv_equals_device_kv_smollm2() {
    windowed_equals_device_kv(SMOLLM2);
}

#[test]
fn windowed_kv_equals_device_kv_qwen2() {
    windowed_equals_device_kv(QWEN2);
}

/// Sequences take turns with a DRAM budget of just the blocks one sequence
/// needs, so the blocks of waiting sequences go to spill files and come
/// back when their turn comes.
fn through_ssd(name: &str) {
    let Some(path) = model(name) else { return };
    let prompts = tokenize(&path);
    const BLOCK: usize = 16;
    const TURN: usize = 24;
    let mut base = Engine::load(&path, &cfg()).expect("engine");
    let mut toks_a = prompts.clone();
    let mut fed_a = [0usize; 3];
    let mut logits_a = Vec::new();
    for _round in 0..2 {
        for s in 0..3 {
            logits_a.push(
                continue_seq(&mut base, s as u32, &mut toks_a[s], &mut fed_a[s], TURN)
                    .expect("device-KV turn"),
            );
        }
    }
    // the most blocks one sequence touches (same placement as the tiered run)
    let frames = (0..3)
        .map(|s| base.kv().cells().seq_blocks(s, BLOCK).len())
        .max()
        .unwrap();
    let used = base.kv().cells().blocks_of(0b111, BLOCK).len();
    assert!(
        used >= frames + 3,
        "{name}: the test must need more blocks than frames"
    );

    let spill = tempfile::tempdir().expect("tempdir");
    let frame =
        (2 * 2 * BLOCK) as u64 * base.spec.hp.n_embd_kv() as u64 * base.spec.hp.n_layer as u64;
    let c = spilling(
        tiered(0, &base),
        BLOCK,
        frames as u64 * frame,
        spill.path(),
        None,
    );
    let mut e = Engine::load(&path, &c).expect("tiered engine");
    assert_eq!(e.kv_tier().unwrap().frames(), frames);
    let mut toks_b = prompts.clone();
    let mut fed_b = [0usize; 3];
    let mut turn = 0;
    for round in 0..2 {
        for s in 0..3 {
            let b = continue_seq(&mut e, s as u32, &mut toks_b[s], &mut fed_b[s], TURN)
                .unwrap_or_else(|err| panic!("{name}: tiered turn: {err}"));
            for (x, y) in b.iter().zip(&logits_a[turn]) {
                assert_eq!(nmse(x, y), 0.0, "{name}: seq {s} round {round}");
            }
            turn += 1;
        }
    }
    assert_eq!(toks_a, toks_b, "{name}: tokens differ");
    let t = e.kv_tier().unwrap().total;
    assert!(
        t.spilled as usize >= used - frames && t.loaded >= 3,
        "{name}: blocks went through SSD ({used} blocks, {frames} frames): {t:?}"
    );
    let dir = e.kv_tier().unwrap().spill_path().expect("spill dir");
    assert!(dir.starts_with(spill.path()));
    // freeing the sequences frees their files
    for s in 0..3 {
        e.clear_seq(s);
    }
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
    drop(e);
    assert!(!dir.exists(), "spill directory removed");
}

#[test]
fn ssd_spill_equals_device_kv_smollm2() {
    through_ssd(SMOLLM2);
}

#[test]
fn ssd_spill_equals_device_kv_qwen2() {
    through_ssd(QWEN2);
}

/// Two sequences with room in DRAM for about one: running the second one
/// spills blocks of the first.
struct TwoSeqs {
    e: Engine,
    toks: [Vec<u32>; 2],
    fed: [usize; 2],
    _dir: tempfile::TempDir,
}

fn two_seqs(path: &std::path::Path, spill_max: Option<u64>) -> TwoSeqs {
    let prompts = tokenize(path);
    let probe = Engine::load(path, &cfg()).expect("engine");
    let frame =
        (2 * 2 * 16) as u64 * probe.spec.hp.n_embd_kv() as u64 * probe.spec.hp.n_layer as u64;
    let dir = tempfile::tempdir().expect("tempdir");
    let c = spilling(tiered(0, &probe), 16, 3 * frame, dir.path(), spill_max);
    drop(probe);
    let mut e = Engine::load(path, &c).expect("tiered engine");
    let mut toks = [prompts[0].clone(), prompts[1].clone()];
    let mut fed = [0, 0];
    continue_seq(&mut e, 0, &mut toks[0], &mut fed[0], 20).expect("first sequence");
    TwoSeqs {
        e,
        toks,
        fed,
        _dir: dir,
    }
}

fn spill_files(e: &Engine) -> Vec<std::path::PathBuf> {
    let Some(dir) = e.kv_tier().unwrap().spill_path() else {
        return Vec::new();
    };
    std::fs::read_dir(dir)
        .unwrap()
        .map(|d| d.unwrap().path())
        .collect()
}

fn damaged_spill_is_refused(name: &str, damage: fn(&std::path::Path)) {
    let Some(path) = model(name) else { return };
    let mut t = two_seqs(&path, None);
    let TwoSeqs { e, toks, fed, .. } = &mut t;
    continue_seq(e, 1, &mut toks[1], &mut fed[1], 20).expect("second sequence");
    let files = spill_files(e);
    assert!(
        !files.is_empty(),
        "the second sequence spilled blocks of the first"
    );
    for f in &files {
        damage(f);
    }
    let before = toks[0].len();
    let err = continue_seq(e, 0, &mut toks[0], &mut fed[0], 1).expect_err("damaged spill used");
    let msg = err.to_string();
    assert!(
        files.iter().any(|f| msg.contains(&f.display().to_string())),
        "error names the file: {msg}"
    );
    assert_eq!(toks[0].len(), before);
    // the other sequence goes on
    continue_seq(e, 1, &mut toks[1], &mut fed[1], 4).expect("other sequence untouched");
}

#[test]
fn corrupt_spill_file_is_detected() {
    damaged_spill_is_refused(SMOLLM2, |f| {
        let mut b = std::fs::read(f).unwrap();
        let i = b.len() - 5000;
        b[i] ^= 0x40;
        std::fs::write(f, b).unwrap();
    });
}

#[test]
fn truncated_spill_file_is_detected() {
    damaged_spill_is_refused(SMOLLM2, |f| {
        let len = std::fs::metadata(f).unwrap().len();
        let file = std::fs::OpenOptions::new().write(true).open(f).unwrap();
        file.set_len(len / 2).unwrap();
    });
}

/// A spill that does not fit is an error for the sequence that needed the
/// room; its batch is not placed and no file is left. Once that sequence is
/// stopped, the other one goes on from an intact cache and gives the same
/// tokens as with the cache on the device.
#[test]
fn full_spill_disk_stops_only_the_sequence_that_needed_room() {
    let Some(path) = model(SMOLLM2) else { return };
    let mut t = two_seqs(&path, Some(1000));
    let TwoSeqs { e, toks, fed, .. } = &mut t;
    let err = continue_seq(e, 1, &mut toks[1], &mut fed[1], 20).expect_err("spill past the quota");
    assert!(
        matches!(
            err,
            EngineError::KvSpill(strata::kv::spill::SpillError::DiskFull { .. })
        ),
        "{err}"
    );
    assert_eq!(
        e.kv().cells().seq_cells(1).len(),
        fed[1],
        "the failed batch was not placed"
    );
    assert!(spill_files(e).is_empty());
    // the caller stops the sequence that could not get room
    e.clear_seq(1);
    let more = continue_seq(e, 0, &mut toks[0], &mut fed[0], 8).expect("first sequence goes on");
    // the same tokens as an untiered engine
    let mut base = Engine::load(&path, &cfg()).expect("engine");
    let mut bt = tokenize(&path)[0].clone();
    let mut bf = 0;
    continue_seq(&mut base, 0, &mut bt, &mut bf, 20).unwrap();
    let again = continue_seq(&mut base, 0, &mut bt, &mut bf, 8).unwrap();
    for (x, y) in more.iter().zip(&again) {
        assert_eq!(nmse(x, y), 0.0);
    }
    assert_eq!(toks[0], bt);
}

/// With only a GPU budget, KV that does not fit beside the smallest
/// streaming working set is windowed automatically, layers from the last
/// one back, and the output does not change.
#[test]
fn gpu_budget_alone_windows_the_kv_that_does_not_fit() {
    let Some(path) = model(SMOLLM2) else { return };
    let c = |b: Option<u64>| EngineConfig {
        n_ctx: 4096,
        budgets: Budgets {
            gpu: b,
            ..Budgets::default()
        },
        ..cfg()
    };
    let mut base = Engine::load(&path, &c(None)).expect("engine");
    assert!(base.kv_tier().is_none());
    // the largest budget at which some layers' KV is windowed, and one at
    // which all of it is
    let mut partly = None;
    let mut all = None;
    for mib in (10..400u64).rev() {
        let Ok(e) = Engine::load(&path, &c(Some(mib << 20))) else {
            continue;
        };
        if let Some(t) = e.kv_tier() {
            if e.kv_resident_layers() > 0 && partly.is_none() {
                partly = Some((mib, t.layers.len()));
            }
            if e.kv_resident_layers() == 0 {
                all = Some(mib);
                break;
            }
        }
    }
    let (mib, windowed) = partly.expect("a budget that windows some layers");
    assert!(all.is_some(), "a budget that windows every layer");
    let prompt = tokenize(&path)[0].clone();
    let a = run_strata(&mut base, &prompt, 12).expect("device-KV run");
    for b in [mib, all.unwrap()] {
        let mut e = Engine::load(&path, &c(Some(b << 20))).expect("budgeted engine");
        let r = run_strata(&mut e, &prompt, 12).expect("budgeted run");
        let (worst, diff) = compare(&r, &a);
        assert_eq!(worst, 0.0, "{b} MiB: NMSE");
        assert_eq!(diff, None, "{b} MiB: tokens");
    }
    eprintln!("{mib} MiB windows {windowed} layers");
}

/// A batch that fails part-way (its second step needs more blocks than the
/// DRAM frames hold) leaves the cache as it was: the next batch gives the
/// same logits as on an engine that never saw the failed one.
#[test]
fn failed_batch_leaves_the_cache_as_it_was() {
    let Some(path) = model(SMOLLM2) else { return };
    let prompt = tokenize(&path)[2].clone();
    let probe = Engine::load(&path, &cfg()).expect("engine");
    let frame =
        (2 * 2 * 16) as u64 * probe.spec.hp.n_embd_kv() as u64 * probe.spec.hp.n_layer as u64;
    let c = EngineConfig {
        n_batch: 8,
        ..spilling(
            tiered(0, &probe),
            16,
            2 * frame,
            &std::env::temp_dir(),
            None,
        )
    };
    drop(probe);
    let mut e = Engine::load(&path, &c).expect("tiered engine");
    let mut base = Engine::load(
        &path,
        &EngineConfig {
            n_batch: 8,
            ..cfg()
        },
    )
    .expect("engine");
    let batch = |from: usize, n: usize| -> Vec<BatchToken> {
        (from..from + n)
            .map(|i| BatchToken {
                token: prompt[i % prompt.len()],
                pos: i as i32,
                seq: 0,
                logits: true,
            })
            .collect()
    };
    e.decode(&batch(0, 10)).expect("first batch");
    base.decode(&batch(0, 10)).expect("first batch");
    // 30 more tokens need 3 blocks at once in the last step: more than 2
    let err = e
        .decode(&batch(10, 30))
        .expect_err("too long for the frames");
    assert!(matches!(err, EngineError::KvTier(_)), "{err}");
    assert_eq!(
        e.kv().cells().seq_cells(0).len(),
        10,
        "no step of the batch stays"
    );
    let a = e.decode(&batch(10, 6)).expect("a batch that fits");
    let b = base.decode(&batch(10, 6)).expect("a batch that fits");
    assert_eq!(nmse(&a, &b), 0.0);
}

/// Speculative rounds with random drafts, random acceptance and sequences
/// taking turns leave the KV cache, in every tier, equal to one that never
/// saw the rejected drafts: after the history, each sequence's next step
/// gives bit for bit the logits of an engine fed only the kept tokens.
/// Tiers: KV on the device; every layer windowed; half the layers
/// windowed with streamed weights; every layer windowed with DRAM for a
/// few blocks, so blocks go through spill files and come back.
#[test]
fn rejected_drafts_leave_no_trace_in_any_tier() {
    use rand_chacha::rand_core::{RngCore, SeedableRng};
    let Some(path) = model(SMOLLM2) else { return };
    const BLOCK: usize = 16;
    let probe = Engine::load(&path, &cfg()).expect("engine");
    let n_vocab = probe.n_vocab();
    let n_layer = probe.spec.hp.n_layer as u64;
    let frame = (2 * 2 * BLOCK) as u64 * probe.spec.hp.n_embd_kv() as u64 * n_layer;
    let spill = tempfile::tempdir().expect("tempdir");
    let modes: Vec<(&str, EngineConfig)> = vec![
        ("device KV", cfg()),
        ("all windowed", tiered(0, &probe)),
        (
            "half windowed, streamed weights",
            EngineConfig {
                paging: streamed(),
                ..tiered(n_layer / 2, &probe)
            },
        ),
        (
            "windowed through spill files",
            spilling(tiered(0, &probe), BLOCK, 6 * frame, spill.path(), None),
        ),
    ];
    drop(probe);
    for seed in 0..2u64 {
        for (mode, c) in &modes {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
            let mut e = Engine::load(&path, c).expect("engine");
            let mut clean = Engine::load(&path, &cfg()).expect("engine");
            let mut len = [0i32; 3];
            let tok = |rng: &mut rand_chacha::ChaCha8Rng| rng.next_u32() % n_vocab;
            // turns of a few rounds each: a sequence's cells stay close
            // together, so the others' blocks can spill while it runs
            for turn in 0..9 {
                let s = turn % 3;
                for _ in 0..3 + rng.next_u32() % 3 {
                    let base = len[s as usize];
                    let n_new = if base == 0 { 6 } else { 1 };
                    let k = (rng.next_u32() % 7) as i32;
                    let keep = (rng.next_u32() % (k as u32 + 1)) as i32;
                    let feed: Vec<BatchToken> = (0..n_new + k)
                        .map(|i| BatchToken {
                            token: tok(&mut rng),
                            pos: base + i,
                            seq: s,
                            logits: i >= n_new - 1,
                        })
                        .collect();
                    e.decode(&feed)
                        .unwrap_or_else(|err| panic!("{mode}: drafted step: {err}"));
                    e.truncate_seq(s, base + n_new + keep);
                    if let Some(t) = e.kv_tier() {
                        // a block keeps a frame or a spill file exactly
                        // while cells use it
                        for b in 0..t.table.n_blocks() as u32 {
                            let used = e.kv().cells().block_rows(b as usize, t.block()) > 0;
                            let held = t.table.frame_of(b).is_some() || t.table.on_disk(b);
                            assert_eq!(held, used, "{mode}: block {b} after a truncation");
                        }
                    }
                    let kept = &feed[..(n_new + keep) as usize];
                    clean.decode(kept).expect("clean step");
                    len[s as usize] = base + n_new + keep;
                }
            }
            for s in 0..3u32 {
                assert_eq!(
                    e.kv().cells().seq_cells(s).len() as i32,
                    len[s as usize],
                    "{mode}: seq {s} holds its kept positions"
                );
                let probe = [BatchToken {
                    token: 42,
                    pos: len[s as usize],
                    seq: s,
                    logits: true,
                }];
                let a = e.decode(&probe).expect("probe");
                let b = clean.decode(&probe).expect("probe");
                assert_eq!(nmse(&a, &b), 0.0, "{mode} seed {seed}: seq {s}");
            }
            if let Some(t) = e.kv_tier() {
                if t.spill_path().is_some() {
                    assert!(
                        t.total.spilled > 0 && t.total.loaded > 0,
                        "{mode}: blocks went through spill files: {:?}",
                        t.total
                    );
                }
            }
            // every tier gives back what a cleared sequence held
            for s in 0..3 {
                e.clear_seq(s);
            }
            if let Some(dir) = e.kv_tier().and_then(|t| t.spill_path()) {
                assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0, "{mode}");
            }
            if let Some(t) = e.kv_tier() {
                assert_eq!(
                    (t.table.in_dram(), t.table.on_ssd()),
                    (0, 0),
                    "{mode}: frames and files freed"
                );
            }
        }
    }
}
