//! Saved sessions: a generation stopped with a saved session and resumed in
//! a new engine (also one with a tiered KV cache) produces the tokens the
//! unbroken generation produced, with sampling on. Sessions of another
//! model and damaged files are refused.

mod common;

use common::{model, QWEN2, SMOLLM2};
use strata::engine::{Budgets, Engine, EngineConfig, KvTierOptions};
use strata::generate::Session;
use strata::llama::LlamaModel;
use strata::sample::Sampler;

fn cfg() -> EngineConfig {
    common::cpu_cfg()
}

fn sampler(seed: u64) -> Sampler {
    Sampler::new(common::sampled_cfg(seed)).expect("sampler")
}

fn resume_equals_unbroken(name: &str) {
    let Some(path) = model(name) else { return };
    let vocab = LlamaModel::load(&path, true, 0).expect("vocab");
    let prompt = vocab
        .tokenize("Here is a short story about a robot:", true, true)
        .expect("tokenize");
    let mut e = Engine::load(&path, &cfg()).expect("engine");
    let unbroken = {
        let mut s = Session::new(&mut e, &vocab, sampler(7));
        s.generate(&prompt, 24, |_| {}).expect("unbroken").0
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("s.kv");
    let first = {
        let mut s = Session::new(&mut e, &vocab, sampler(7));
        let out = s.generate(&prompt, 10, |_| {}).expect("first half").0;
        s.save(&file).expect("save");
        out
    };
    // a new engine each: all KV on the device, and windowed through DRAM
    let per_layer = 4 * e.spec.hp.n_embd_kv() as u64 * e.n_ctx() as u64;
    for c in [
        cfg(),
        EngineConfig {
            budgets: Budgets {
                kv_gpu: Some(per_layer),
                ..Budgets::default()
            },
            kv_tier: KvTierOptions {
                block: 16,
                ..KvTierOptions::default()
            },
            ..cfg()
        },
    ] {
        let mut e2 = Engine::load(&path, &c).expect("engine");
        // the configured seed does not matter: the saved stream goes on
        let mut s = Session::new(&mut e2, &vocab, sampler(99));
        s.load(&file).expect("load");
        let rest = s.generate(&[], 14, |_| {}).expect("second half").0;
        let joined: Vec<u32> = first.iter().chain(&rest).copied().collect();
        assert_eq!(joined, unbroken, "{name}: resumed tokens differ");
    }
}

#[test]
fn resumed_session_continues_smollm2() {
    resume_equals_unbroken(SMOLLM2);
}

#[test]
fn resumed_session_continues_qwen2() {
    resume_equals_unbroken(QWEN2);
}

#[test]
fn foreign_and_damaged_sessions_are_refused() {
    let (Some(smol), Some(qwen)) = (model(SMOLLM2), model(QWEN2)) else {
        return;
    };
    let vocab = LlamaModel::load(&smol, true, 0).expect("vocab");
    let prompt = vocab.tokenize("Hello there", true, true).expect("tokenize");
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("s.kv");
    let mut e = Engine::load(&smol, &cfg()).expect("engine");
    {
        let mut s = Session::new(&mut e, &vocab, sampler(1));
        s.generate(&prompt, 4, |_| {}).expect("generate");
        s.save(&file).expect("save");
    }
    // another model
    let qvocab = LlamaModel::load(&qwen, true, 0).expect("vocab");
    let mut q = Engine::load(&qwen, &cfg()).expect("engine");
    let mut s = Session::new(&mut q, &qvocab, sampler(1));
    let err = s.load(&file).expect_err("foreign session").to_string();
    assert!(
        err.contains("fingerprint") || err.contains("row_bytes"),
        "{err}"
    );
    // a flipped byte in the cache data
    let mut b = std::fs::read(&file).unwrap();
    // header page, then table and payload (one page here), then K of layer 0
    b[8192 + 100] ^= 1;
    let bad = dir.path().join("bad.kv");
    std::fs::write(&bad, &b).unwrap();
    let mut s = Session::new(&mut e, &vocab, sampler(1));
    let err = s.load(&bad).expect_err("damaged session").to_string();
    assert!(err.contains("bad.kv"), "{err}");
    assert!(
        s.engine.kv().cells().seq_cells(0).is_empty(),
        "nothing half-loaded"
    );
    s.load(&file).expect("the good file still loads");
}

/// The command line: `-n 20` equals `-n 8 --save-session` then
/// `--load-session -n 12`.
#[test]
fn cli_save_and_load_session() {
    let Some(path) = model(SMOLLM2) else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("cli.kv");
    let run = |extra: &[&str]| -> String {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_strata"))
            .args(["run", "-m"])
            .arg(&path)
            .args(["--device", "cpu", "-t", "2", "-c", "512", "--seed", "5"])
            .args(extra)
            .output()
            .expect("strata runs");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).expect("utf-8")
    };
    let p = "The three primary colors are";
    let full = run(&["-p", p, "-n", "20"]);
    let f = file.to_str().unwrap();
    let a = run(&["-p", p, "-n", "8", "--save-session", f]);
    let b = run(&["--load-session", f, "-n", "12"]);
    assert_eq!(
        format!("{}{}", a.trim_end_matches('\n'), b.trim_end_matches('\n')),
        full.trim_end_matches('\n')
    );
}

/// Session files whose checksums are valid but whose content is not a
/// session strata wrote are refused: duplicated, reordered or gapped
/// positions, a pending token outside the vocabulary.
#[test]
fn inconsistent_sessions_with_valid_checksums_are_refused() {
    use strata::kv::spill;
    let Some(smol) = model(SMOLLM2) else { return };
    let vocab = LlamaModel::load(&smol, true, 0).expect("vocab");
    let prompt = vocab
        .tokenize("Hello there, how are", true, true)
        .expect("tokenize");
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("s.kv");
    let mut e = Engine::load(&smol, &cfg()).expect("engine");
    {
        let mut s = Session::new(&mut e, &vocab, sampler(1));
        s.generate(&prompt, 3, |_| {}).expect("generate");
        s.save(&file).expect("save");
    }
    let mut f = spill::KvFile::open(&file, e.session_shape()).expect("open");
    let extra = f.extra().to_vec();
    let entries: Vec<_> = f.entries().to_vec();
    let data: Vec<(Vec<u8>, Vec<u8>)> = (0..entries.len())
        .map(|i| f.read_entry_vec(i).expect("entry"))
        .collect();
    let n = u64::from_le_bytes(extra[..8].try_into().unwrap()) as usize;
    assert!(n >= 4);
    let rewrite = |name: &str, edit: &dyn Fn(&mut Vec<u8>)| {
        let mut x = extra.clone();
        edit(&mut x);
        let p = dir.path().join(name);
        let ents: Vec<(spill::EntryDesc, &[u8], &[u8])> = entries
            .iter()
            .zip(&data)
            .map(|(d, (k, v))| (*d, k.as_slice(), v.as_slice()))
            .collect();
        spill::write_file(&p, e.session_shape(), &x, &ents, None).expect("write");
        p
    };
    let set_pos = |x: &mut Vec<u8>, i: usize, p: i32| {
        x[8 + 4 * i..12 + 4 * i].copy_from_slice(&p.to_le_bytes())
    };
    let cases: Vec<(&str, std::path::PathBuf, &str)> = vec![
        (
            "duplicate",
            rewrite("dup.kv", &|x| set_pos(x, 1, 0)),
            "position",
        ),
        (
            "reversed",
            rewrite("rev.kv", &|x| {
                for i in 0..n {
                    set_pos(x, i, (n - 1 - i) as i32)
                }
            }),
            "position",
        ),
        (
            "gap",
            rewrite("gap.kv", &|x| set_pos(x, n - 1, n as i32 + 5)),
            "position",
        ),
        (
            "pending",
            rewrite("pend.kv", &|x| {
                let json = String::from_utf8(x[8 + 4 * n..].to_vec()).unwrap();
                let v: serde_json::Value = serde_json::from_str(&json).unwrap();
                let mut v = v;
                v["pending"] = serde_json::json!(4_000_000_000u64);
                x.truncate(8 + 4 * n);
                x.extend_from_slice(&serde_json::to_vec(&v).unwrap());
            }),
            "pending token",
        ),
    ];
    for (what, p, says) in cases {
        let mut s = Session::new(&mut e, &vocab, sampler(1));
        let err = s.load(&p).expect_err(what).to_string();
        assert!(err.contains(says), "{what}: {err}");
        assert!(
            s.engine.kv().cells().seq_cells(0).is_empty(),
            "{what}: nothing half-loaded"
        );
    }
    let mut s = Session::new(&mut e, &vocab, sampler(1));
    s.load(&file).expect("the good file still loads");
}
