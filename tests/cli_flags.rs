//! Flags are checked when parsed, with a message naming the flag and its
//! range, instead of crashing (`--threads 0` crashed inside ggml's thread
//! pool), hanging (`--threads 100000`) or being clamped without a word.

mod common;

use common::{model, SMOLLM2};
use std::process::Command;

fn strata(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(args)
        .output()
        .expect("strata runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn out_of_range_flags_are_refused_naming_them() {
    let Some(path) = model(SMOLLM2) else { return };
    let m = path.to_str().unwrap();
    for (flag, value, says) in [
        ("--threads", "0", "outside 1..=1024"),
        ("--threads", "100000", "outside 1..=1024"),
        ("-c", "0", "--ctx-size"),
        ("-c", "99999999", "--ctx-size"),
        ("-b", "0", "--batch-size"),
        ("-ub", "0", "--ubatch-size"),
        ("--kv-block", "0", "--kv-block"),
        ("--gpu-budget", "99999999999999999999", "larger than 16 EiB"),
        ("--kv-dram", "12Q", "unknown size unit"),
        ("--expert-split", "0", "a number of experts (at least 1)"),
        (
            "--expert-split",
            "many",
            "use auto, off or a number of experts",
        ),
        ("--split-min-tokens", "1", "--split-min-tokens"),
        (
            "--hot-experts",
            "0",
            "a number of experts per layer (at least 1)",
        ),
        (
            "--hot-experts",
            "most",
            "use auto, off or a number of experts per layer",
        ),
        ("--resident", "auto", "use spread, first or cost"),
        ("--look-ahead", "257", "--look-ahead"),
        ("--look-ahead-layers", "0", "--look-ahead-layers"),
        ("--look-ahead-layers", "9", "--look-ahead-layers"),
    ] {
        let (ok, _, err) = strata(&[
            "run", "-m", m, "--device", "cpu", "-p", "hi", "-n", "1", flag, value,
        ]);
        assert!(!ok, "{flag} {value} was accepted");
        assert!(err.contains(says), "{flag} {value}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

#[test]
fn bad_model_paths_say_what_is_wrong() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path().to_str().unwrap();
    let (ok, _, err) = strata(&["run", "-m", d, "-p", "hi"]);
    assert!(!ok && err.contains("is a directory"), "{err}");
    let (ok, _, err) = strata(&["run", "-m", "/dev/null", "-p", "hi"]);
    assert!(!ok && err.contains("not a regular file"), "{err}");
    let missing = dir.path().join("missing.gguf");
    let (ok, _, err) = strata(&["run", "-m", missing.to_str().unwrap(), "-p", "hi"]);
    assert!(!ok && err.contains("does not exist"), "{err}");
    let (ok, _, err) = strata(&["run", "-m", "/dev/null", "-md", d, "-p", "hi"]);
    assert!(
        !ok && err.contains("draft model file") && err.contains("is a directory"),
        "{err}"
    );
}

#[test]
fn bench_without_anything_to_time_is_an_error() {
    let Some(path) = model(SMOLLM2) else { return };
    let (ok, _, err) = strata(&["bench", "-m", path.to_str().unwrap(), "--no-strata"]);
    assert!(!ok && err.contains("--llama-ngl"), "{err}");
}

#[test]
fn a_prompt_may_start_with_a_dash() {
    let Some(path) = model(SMOLLM2) else { return };
    let (ok, out, err) = strata(&[
        "run",
        "-m",
        path.to_str().unwrap(),
        "--device",
        "cpu",
        "-t",
        "2",
        "-p",
        "-- SQL query",
        "-n",
        "3",
        "--temp",
        "0",
    ]);
    assert!(ok, "{err}");
    assert!(out.starts_with("-- SQL query"), "{out}");
}

/// A real model file whose token 301 is set equal to token 300 (same
/// length, so only those bytes change): libllama aborted the process on
/// it (exit 134); now `run` refuses it naming the tokens.
#[test]
fn a_duplicated_token_is_refused_not_an_abort() {
    let Some(path) = model(SMOLLM2) else { return };
    let f = strata::gguf::GgufFile::open(&path).expect("gguf");
    let toks = f.get_str_array("tokenizer.ggml.tokens").expect("tokens");
    // the first pair of equal-length neighbours from 300 on
    let i = (300..toks.len() - 1)
        .find(|&i| toks[i].len() == toks[i + 1].len() && toks[i] != toks[i + 1])
        .expect("a pair");
    let enc = |s: &str| [&(s.len() as u64).to_le_bytes()[..], s.as_bytes()].concat();
    let needle = [enc(&toks[i]), enc(&toks[i + 1])].concat();
    let mut bytes = std::fs::read(&path).expect("read");
    let at = bytes
        .windows(needle.len())
        .position(|w| w == needle)
        .expect("the pair in the file");
    let second = toks[i + 1].clone();
    bytes[at + 8..at + 8 + second.len()].copy_from_slice(second.as_bytes());
    let dir = tempfile::tempdir().expect("tempdir");
    let bad = dir.path().join("dup.gguf");
    std::fs::write(&bad, &bytes).expect("write");
    let (ok, _, err) = strata(&[
        "run",
        "-m",
        bad.to_str().unwrap(),
        "--device",
        "cpu",
        "-p",
        "hi",
        "-n",
        "1",
    ]);
    assert!(!ok, "accepted");
    assert!(
        err.contains(&format!("token {} ", i + 1)) && err.contains("duplicates"),
        "{err}"
    );
}

/// `strata-convert synth --layers 4294967295` allocated until it aborted.
#[test]
fn synth_refuses_a_layer_count_out_of_range() {
    let Some(path) = model(SMOLLM2) else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let out = Command::new(env!("CARGO_BIN_EXE_strata-convert"))
        .args([
            "synth",
            "--preset",
            "tiny",
            "--type",
            "q4_0",
            "--layers",
            "4294967295",
            "--vocab-from",
        ])
        .arg(&path)
        .arg(dir.path().join("x.gguf"))
        .output()
        .expect("strata-convert runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("--layers 4294967295 (1 to 4096)"),
        "{err}"
    );
    assert!(
        std::fs::read_dir(dir.path()).expect("dir").next().is_none(),
        "left a file"
    );
}

#[test]
fn prompt_file_is_read_or_its_error_named() {
    let Some(path) = model(SMOLLM2) else { return };
    let m = path.to_str().unwrap();
    let dir = tempfile::tempdir().expect("tempdir");
    let f = dir.path().join("prompt.txt");
    std::fs::write(&f, "The capital of France is").unwrap();
    let fs = f.to_str().unwrap();
    let (ok, out, err) = strata(&[
        "run", "-m", m, "--device", "cpu", "-t", "2", "-f", fs, "-n", "2", "--temp", "0",
    ]);
    assert!(ok, "{err}");
    assert!(out.starts_with("The capital of France is"), "{out}");
    let (ok, _, err) = strata(&["run", "-m", m, "-f", fs, "-p", "hi"]);
    assert!(!ok && err.contains("not both"), "{err}");
    let missing = dir.path().join("nope.txt");
    let (ok, _, err) = strata(&["run", "-m", m, "-f", missing.to_str().unwrap()]);
    assert!(
        !ok && err.contains("reading the prompt file") && err.contains("nope.txt"),
        "{err}"
    );
}

/// Ctrl-C ends the generation at the next step, not the process: the text
/// ends with a newline, the summary is printed, and --save-session still
/// saves a session that resumes.
#[test]
fn ctrl_c_ends_the_reply_and_keeps_the_session() {
    interrupted_run(libc::SIGINT);
}

/// SIGTERM (what a service manager or `kill` sends) ends `run` as Ctrl-C
/// does, and like a normal exit it leaves no temp file and no spill
/// directory (the KV cache lives in host frames here).
#[test]
fn sigterm_ends_the_run_cleanly() {
    interrupted_run(libc::SIGTERM);
}

fn interrupted_run(signal: i32) {
    use std::io::Read;
    let Some(path) = model(SMOLLM2) else { return };
    let m = path.to_str().unwrap();
    let dir = tempfile::tempdir().expect("tempdir");
    let sess = dir.path().join("s.bin");
    let ss = sess.to_str().unwrap();
    let spill = dir.path().join("spill");
    std::fs::create_dir(&spill).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args([
            "run", "-m", m, "--device", "cpu", "-t", "2", "-c", "4096", "--temp", "0",
        ])
        // the KV of every layer in host frames, the spill directory here
        .args(["--kv-budget", "1", "--kv-block", "64", "--kv-spill-dir"])
        .arg(&spill)
        .args([
            "-p",
            "1, 2, 3, 4, 5, 6,",
            "-n",
            "4000",
            "--save-session",
            ss,
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("strata runs");
    // wait until generated text flows, then signal
    let mut stdout = child.stdout.take().unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 256];
    while seen.len() < "1, 2, 3, 4, 5, 6,".len() + 60 {
        let n = stdout.read(&mut buf).unwrap();
        assert!(n > 0, "output ended early");
        seen.extend_from_slice(&buf[..n]);
    }
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(child.id() as i32, signal) };
    stdout.read_to_end(&mut seen).unwrap();
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {err}", out.status);
    assert!(seen.ends_with(b"\n"), "{}", String::from_utf8_lossy(&seen));
    assert!(
        err.contains("interrupted") && err.contains("generation:"),
        "{err}"
    );
    assert!(err.contains("session saved"), "{err}");
    let left: Vec<_> = std::fs::read_dir(&spill)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != "s.bin" && n != "spill")
        .collect();
    assert!(left.is_empty(), "temp files left behind: {left:?}");
    let (ok, _, err) = strata(&[
        "run",
        "-m",
        m,
        "--device",
        "cpu",
        "-t",
        "2",
        "-c",
        "4096",
        "--temp",
        "0",
        "-n",
        "2",
        "--load-session",
        ss,
    ]);
    assert!(ok && err.contains("resumed"), "{err}");
}

/// Sampling without -s draws a random seed (llama.cpp's default), prints
/// it, and -s with that seed repeats the text.
#[test]
fn default_seed_is_random_printed_and_repeatable() {
    let Some(path) = model(SMOLLM2) else { return };
    let m = path.to_str().unwrap();
    let args = [
        "run",
        "-m",
        m,
        "--device",
        "cpu",
        "-t",
        "2",
        "-p",
        "Once upon a time",
        "-n",
        "12",
        "--temp",
        "1.5",
    ];
    let seed_of = |err: &str| -> String {
        let line = err
            .lines()
            .find(|l| l.starts_with("sampling seed: "))
            .expect("the seed is printed");
        line["sampling seed: ".len()..]
            .split(' ')
            .next()
            .unwrap()
            .to_string()
    };
    let (ok1, out1, err1) = strata(&args);
    let (ok2, _, err2) = strata(&args);
    assert!(ok1 && ok2, "{err1}{err2}");
    let (s1, s2) = (seed_of(&err1), seed_of(&err2));
    assert_ne!(s1, s2, "two runs drew the same seed");
    let mut again: Vec<&str> = args.to_vec();
    again.extend(["-s", &s1]);
    let (ok, out, err) = strata(&again);
    assert!(ok, "{err}");
    assert!(
        !err.contains("sampling seed"),
        "an explicit seed is not announced: {err}"
    );
    assert_eq!(out, out1, "-s {s1} did not repeat the text");
}

/// A chat through a pseudo-terminal (tests/chat/pty_chat.py) survives a full
/// context (the oldest turns go, the chat goes on) and a Ctrl-C typed during
/// a reply (the prompt comes back), and Ctrl-D ends it with status 0.
#[test]
fn chat_survives_a_full_context_and_ctrl_c() {
    let Some(path) = model(SMOLLM2) else { return };
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/chat/pty_chat.py");
    let out = Command::new("python3")
        .arg(script)
        .arg(env!("CARGO_BIN_EXE_strata"))
        .arg(&path)
        .output()
        .expect("python3 runs");
    let text = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}{err}");
    assert!(text.starts_with("ok:"), "{text}{err}");
}

/// `strata bench --json` on the CPU, pp8 and tg2 once, with `extra`
/// arguments: its JSON lines, parsed, and the output they came from.
fn bench_json(m: &str, extra: &[&str]) -> (Vec<serde_json::Value>, String) {
    #[rustfmt::skip]
    let mut args = vec![
        "bench", "-m", m, "--device", "cpu", "-t", "2", "-p", "8", "-n", "2", "-B", "0", "-r", "1",
        "--json",
    ];
    args.extend_from_slice(extra);
    let (ok, out, err) = strata(&args);
    assert!(ok, "{err}");
    let lines = out
        .lines()
        .map(|l| serde_json::from_str(l).expect(l))
        .collect();
    (lines, out)
}

/// `bench --json`: one JSON object per result, naming the model, the
/// device and the build beside the figures.
#[test]
fn bench_json_names_model_device_and_build() {
    let Some(path) = model(SMOLLM2) else { return };
    let m = path.to_str().unwrap();
    let (lines, out) = bench_json(m, &[]);
    assert_eq!(lines.len(), 2, "{out}");
    for v in &lines {
        assert_eq!(v["model"], SMOLLM2, "{v}");
        assert!(v["device"].as_str().is_some_and(|d| !d.is_empty()), "{v}");
        assert_eq!(v["build"]["ggml"], "0.26.0", "{v}");
        assert!(v["tokens_per_s"].as_f64().is_some_and(|t| t > 0.0), "{v}");
        assert!(v["step"]["step_ms"].as_f64().is_some(), "{v}");
    }
    assert_eq!(lines[0]["test"], "pp8");
    assert_eq!(lines[1]["test"], "tg2");
}

/// `bench --llama-best`: every test under llama.cpp's defaults and under
/// its users' flags for big batches (--no-mmap -ub 2048), a ratio against
/// each, and one against the faster (on the CPU no GPU memory is compared).
#[test]
fn bench_llama_best_times_both_configurations() {
    let Some(path) = model(SMOLLM2) else { return };
    let m = path.to_str().unwrap();
    let (lines, out) = bench_json(m, &["--llama-ngl", "0", "--llama-best"]);
    let engines: Vec<&str> = lines.iter().filter_map(|v| v["engine"].as_str()).collect();
    assert_eq!(
        engines,
        [
            "strata all-resident",
            "strata all-resident",
            "llama.cpp ngl=0",
            "llama.cpp ngl=0",
            "llama.cpp ngl=0 no-mmap ub=2048",
            "llama.cpp ngl=0 no-mmap ub=2048"
        ],
        "{out}"
    );
    assert!(lines.iter().all(|v| v["gpu_mib"].is_null()), "{out}");
    let (ok, out, err) = strata(&[
        "bench",
        "-m",
        m,
        "--device",
        "cpu",
        "-t",
        "2",
        "-p",
        "8",
        "-n",
        "0",
        "-B",
        "0",
        "-r",
        "1",
        "--llama-ngl",
        "0",
        "--llama-best",
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("/ llama.cpp ngl=0 no-mmap ub=2048:"), "{out}");
    assert!(out.contains("best  pp8"), "{out}");
}

/// A 2-layer mixture of experts (llama architecture, Mixtral's layout: 4
/// experts, 2 used; zero F32 weights) with SmolLM2's vocabulary, for
/// llama.cpp only.
fn tiny_moe(dir: &std::path::Path, vocab: &std::path::Path) -> std::path::PathBuf {
    use strata::gguf::{GgmlType, GgufFile, GgufWriter, Value};
    let (e, ff, kv, n_exp) = (64u64, 128u64, 32u64, 4u64);
    let f = GgufFile::open(vocab).expect("vocab gguf");
    let n_vocab = f
        .get_str_array("tokenizer.ggml.tokens")
        .expect("tokens")
        .len() as u64;
    let mut w = GgufWriter::new(32);
    for (k, v) in [
        ("general.architecture", Value::Str("llama".into())),
        ("llama.embedding_length", Value::U32(e as u32)),
        ("llama.block_count", Value::U32(2)),
        ("llama.feed_forward_length", Value::U32(ff as u32)),
        ("llama.attention.head_count", Value::U32(4)),
        ("llama.attention.head_count_kv", Value::U32(2)),
        ("llama.context_length", Value::U32(4096)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("llama.expert_count", Value::U32(n_exp as u32)),
        ("llama.expert_used_count", Value::U32(2)),
    ] {
        w.set(k, v);
    }
    for (k, v) in f
        .metadata
        .iter()
        .filter(|(k, _)| k.starts_with("tokenizer."))
    {
        w.set(k, v.clone());
    }
    let mut ts: Vec<(String, Vec<u64>)> = vec![
        ("token_embd.weight".into(), vec![e, n_vocab]),
        ("output_norm.weight".into(), vec![e]),
    ];
    for l in 0..2 {
        for (n, s) in [
            ("attn_norm.weight", vec![e]),
            ("attn_q.weight", vec![e, e]),
            ("attn_k.weight", vec![e, kv]),
            ("attn_v.weight", vec![e, kv]),
            ("attn_output.weight", vec![e, e]),
            ("ffn_norm.weight", vec![e]),
            ("ffn_gate_inp.weight", vec![e, n_exp]),
            ("ffn_gate_exps.weight", vec![e, ff, n_exp]),
            ("ffn_down_exps.weight", vec![ff, e, n_exp]),
            ("ffn_up_exps.weight", vec![e, ff, n_exp]),
        ] {
            ts.push((format!("blk.{l}.{n}"), s));
        }
    }
    for (n, s) in ts {
        let bytes = vec![0u8; 4 * s.iter().product::<u64>() as usize];
        w.add_tensor(&n, &s, GgmlType::F32, bytes)
            .expect("add tensor");
    }
    let out = dir.join("tiny-moe.gguf");
    w.write_file(&out).expect("write");
    out
}

/// `bench --llama-n-cpu-moe N` / `--llama-cpu-moe`: llama.cpp's
/// `--n-cpu-moe N` / `--cpu-moe` (expert tensors kept in CPU memory through
/// its tensor buffer-type overrides) time rows named with them, and
/// `--llama-best` adds `ngl=99` with them on a mixture of experts. A model
/// without experts, a missing `--llama-ngl`, a non-number and both flags
/// together are refused naming the flag.
#[test]
fn bench_llama_n_cpu_moe_times_a_row_named_with_it() {
    let Some(smol) = model(SMOLLM2) else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let moe = tiny_moe(dir.path(), &smol);
    let m = moe.to_str().unwrap();
    let (lines, out) = bench_json(
        m,
        &[
            "--no-strata",
            "--llama-ngl",
            "0",
            "--llama-n-cpu-moe",
            "1",
            "--llama-best",
        ],
    );
    let engines: Vec<&str> = lines.iter().filter_map(|v| v["engine"].as_str()).collect();
    assert_eq!(
        engines,
        [
            // partial offload keeps llama.cpp's default placement
            "llama.cpp ngl=0",
            "llama.cpp ngl=0",
            "llama.cpp ngl=0 no-mmap ub=2048",
            "llama.cpp ngl=0 no-mmap ub=2048",
            // every layer on the GPU but the experts, under both settings
            "llama.cpp ngl=99 n-cpu-moe=1",
            "llama.cpp ngl=99 n-cpu-moe=1",
            "llama.cpp ngl=99 n-cpu-moe=1 no-mmap ub=2048",
            "llama.cpp ngl=99 n-cpu-moe=1 no-mmap ub=2048",
        ],
        "{out}"
    );
    assert!(
        lines
            .iter()
            .all(|v| v["tokens_per_s"].as_f64().is_some_and(|t| t > 0.0)),
        "{out}"
    );
    let (lines, out) = bench_json(m, &["--no-strata", "--llama-ngl", "99", "--llama-cpu-moe"]);
    let engines: Vec<&str> = lines.iter().filter_map(|v| v["engine"].as_str()).collect();
    assert_eq!(
        engines,
        ["llama.cpp ngl=99 cpu-moe", "llama.cpp ngl=99 cpu-moe"],
        "{out}"
    );

    // the placement reaches libllama: its loader logs each tensor moved
    #[rustfmt::skip]
    let run = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args([
            "bench", "-m", m, "--device", "cpu", "-t", "2", "-p", "8", "-n", "0", "-B", "0",
            "-r", "1", "--no-strata", "--llama-ngl", "99", "--llama-n-cpu-moe", "1",
        ])
        .env("STRATA_LLAMA_LOG", "1")
        .output()
        .expect("strata runs");
    let log = String::from_utf8_lossy(&run.stderr);
    assert!(run.status.success(), "{log}");
    let moved = |t: &str| {
        log.lines()
            .any(|l| l.starts_with(&format!("tensor {t} ")) && l.ends_with("overridden to CPU"))
    };
    for t in ["gate", "down", "up"] {
        assert!(moved(&format!("blk.0.ffn_{t}_exps.weight")), "{t}: {log}");
        assert!(!moved(&format!("blk.1.ffn_{t}_exps.weight")), "{t}: {log}");
    }
    assert!(!moved("blk.0.ffn_gate_inp.weight"), "{log}");

    let s = smol.to_str().unwrap();
    let bench = |model: &str, extra: &[&str]| {
        let mut args = vec![
            "bench", "-m", model, "--device", "cpu", "-p", "8", "-n", "0",
        ];
        args.extend_from_slice(extra);
        strata(&args)
    };
    for (model, extra, says) in [
        (
            s,
            &["--llama-ngl", "0", "--llama-n-cpu-moe", "4"][..],
            "--llama-n-cpu-moe",
        ),
        (
            s,
            &["--llama-ngl", "0", "--llama-cpu-moe"][..],
            "--llama-cpu-moe",
        ),
        (m, &["--llama-n-cpu-moe", "1"][..], "--llama-ngl"),
        (
            m,
            &["--llama-ngl", "0", "--llama-n-cpu-moe", "abc"][..],
            "--llama-n-cpu-moe",
        ),
        (
            m,
            &["--llama-ngl", "0", "--llama-n-cpu-moe", "2.5"][..],
            "--llama-n-cpu-moe",
        ),
        (
            m,
            &[
                "--llama-ngl",
                "0",
                "--llama-n-cpu-moe",
                "1",
                "--llama-cpu-moe",
            ][..],
            "cannot be used with",
        ),
    ] {
        let (ok, _, err) = bench(model, extra);
        assert!(!ok, "{extra:?} was accepted");
        assert!(err.contains(says), "{extra:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    let (_, _, err) = bench(s, &["--llama-ngl", "0", "--llama-n-cpu-moe", "4"]);
    assert!(err.contains("not a mixture of experts"), "{err}");
    let (_, _, err) = bench(m, &["--llama-ngl", "0", "--llama-n-cpu-moe", "abc"]);
    assert!(err.contains("invalid value 'abc'"), "{err}");
}

#[test]
fn device_lists_and_budgets_that_do_not_match_are_refused() {
    let Some(path) = model(SMOLLM2) else { return };
    let m = path.to_str().unwrap();
    for (args, says) in [
        (&["--devices", "1"][..], "--devices 1: there is 1 CPU"),
        (&["--devices", "0,0"][..], "names CPU 0 twice"),
        (&["--gpu-budget", "1G,2G"][..], "2 GPU budgets for 1 device"),
        (&["--gpu-budget", "1G,x"][..], "not a size"),
    ] {
        let mut a = vec!["run", "-m", m, "--device", "cpu", "-p", "hi", "-n", "1"];
        a.extend_from_slice(args);
        let (ok, _, err) = strata(&a);
        assert!(!ok, "{args:?} was accepted");
        assert!(err.contains(says), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
}

/// `--expert-stats` adds the router's picks to the counts file beside the
/// model (a second run adds to the first's); a damaged counts file, or one
/// of another model, is refused naming the file, and left as it was; a run
/// that only reads it (routed uploads) warns and goes on.
#[test]
fn router_counts_are_saved_added_to_and_bad_files_refused() {
    let Some(smol) = model(SMOLLM2) else { return };
    let dir = tempfile::tempdir().expect("tempdir");
    let moe = tiny_moe(dir.path(), &smol);
    let m = moe.to_str().unwrap();
    let counts = dir.path().join("tiny-moe.gguf.experts.json");
    let stats = [
        "bench",
        "-m",
        m,
        "--device",
        "cpu",
        "-p",
        "8",
        "-n",
        "0",
        "-B",
        "0",
        "-r",
        "1",
        // the timed run's picks alone
        "--no-warmup",
        "--expert-stats",
    ];
    let picks = |path: &std::path::Path| {
        let text = std::fs::read_to_string(path).expect("counts file");
        strata::paging::routing::RouterCounts::from_json(&text)
            .expect("counts parse")
            .picks()
    };
    let (ok, out, err) = strata(&stats);
    assert!(ok, "{out}{err}");
    assert!(err.contains("router counts saved to"), "{err}");
    // 8 prompt tokens through the first layer, the last one's through the
    // second (only it wants logits), 2 experts each
    let first = picks(&counts);
    assert_eq!(first, 2 * (8 + 1), "{out}");
    let (ok, _, err) = strata(&stats);
    assert!(ok, "{err}");
    assert_eq!(picks(&counts), 2 * first);

    // damaged: refused, named, untouched
    std::fs::write(&counts, "{\"format\": \"strata-router-counts-1\"").unwrap();
    let (ok, _, err) = strata(&stats);
    assert!(!ok);
    assert!(
        err.contains("router counts") && err.contains("experts.json"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(
        std::fs::read_to_string(&counts).unwrap(),
        "{\"format\": \"strata-router-counts-1\""
    );
    // without --expert-stats (routed uploads only predict from counts):
    // named in a warning, and the run goes on, leaving it as it was
    let (ok, out, err) = strata(&stats[..stats.len() - 1]);
    assert!(ok, "{out}{err}");
    assert!(
        err.contains("experts.json") && err.contains("without counts"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_to_string(&counts).unwrap(),
        "{\"format\": \"strata-router-counts-1\""
    );

    // larger than any counts file (sparse): refused before it is read
    let f = std::fs::File::create(&counts).unwrap();
    f.set_len(strata::engine::COUNTS_MAX_BYTES + 1).unwrap();
    drop(f);
    let (ok, _, err) = strata(&stats);
    assert!(!ok);
    assert!(
        err.contains("experts.json") && err.contains("more than"),
        "{err}"
    );

    // another model's (3 layers): refused with the way out
    let other = dir.path().join("other.json");
    let mut c = strata::paging::routing::RouterCounts::new(3, 4, 2);
    c.add(0, &[0, 1]).unwrap();
    std::fs::write(&other, c.to_json()).unwrap();
    let o = other.to_str().unwrap();
    let mut args = stats.to_vec();
    args.extend(["--expert-counts", o]);
    let (ok, _, err) = strata(&args);
    assert!(!ok);
    assert!(err.contains("another model's"), "{err}");
    assert_eq!(picks(&other), 2);
}

/// `--draft-tree` prints what plain `run` prints; bad values, a tree
/// without a drafter and a tree for `serve` are refused naming the flag; a
/// damaged acceptance trace is refused naming the file.
#[test]
fn draft_trees_on_the_command_line() {
    let Some(path) = model(SMOLLM2) else { return };
    let m = path.to_str().unwrap();
    let p =
        "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n";
    let run = |extra: &[&str]| {
        let mut args = vec![
            "run", "-m", m, "--device", "cpu", "-p", p, "-n", "40", "--temp", "0",
        ];
        args.extend_from_slice(extra);
        let (ok, out, err) = strata(&args);
        assert!(ok, "{extra:?}: {err}");
        (out, err)
    };
    let (plain, _) = run(&[]);
    let (tree, err) = run(&["--lookup", "8", "--draft-tree", "12", "--draft-fixed"]);
    assert_eq!(tree, plain);
    assert!(err.contains("speculative:"), "{err}");
    // a step of 8 tokens holds the tree, the pending token and any
    // accepted side branch fed again
    let (small, err) = run(&[
        "--lookup",
        "8",
        "--draft-tree",
        "64",
        "--draft-fixed",
        "-b",
        "8",
    ]);
    assert_eq!(small, plain, "{err}");
    for (extra, says) in [
        (
            &["--lookup", "8", "--draft-tree", "0"][..],
            "--draft-tree 0 is outside 1..=1024",
        ),
        (
            &["--lookup", "8", "--draft-tree", "5000"][..],
            "--draft-tree 5000 is outside",
        ),
        (&["--draft-tree", "8"][..], "--draft-tree needs drafts"),
    ] {
        let mut args = vec!["run", "-m", m, "--device", "cpu", "-p", "hi", "-n", "1"];
        args.extend_from_slice(extra);
        let (ok, _, err) = strata(&args);
        assert!(!ok && err.contains(says), "{extra:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    let (ok, _, err) = strata(&[
        "serve",
        "-m",
        m,
        "--device",
        "cpu",
        "--lookup",
        "8",
        "--draft-tree",
        "8",
        "--parallel",
        "4",
        "-b",
        "10",
    ]);
    assert!(
        !ok && err.contains("use steps of at least 12 tokens"),
        "{err}"
    );
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("trace.json");
    std::fs::write(&bad, r#"{"format":"strata-spec-trace-1","pair":"x","rounds":[{"cat":"code","parents":[0],"path":[]}]}"#).unwrap();
    let b = bad.to_str().unwrap();
    let (ok, _, err) = strata(&[
        "bench",
        "-m",
        m,
        "--device",
        "cpu",
        "-md",
        m,
        "-p",
        "0",
        "-n",
        "0",
        "-B",
        "0",
        "--spec-replay",
        b,
    ]);
    assert!(
        !ok && err.contains(b) && err.contains("round 0: node 0 has parent 0"),
        "{err}"
    );
    let (ok, _, err) = strata(&[
        "bench",
        "-m",
        m,
        "--device",
        "cpu",
        "--lookup",
        "8",
        "-p",
        "0",
        "-n",
        "0",
        "-B",
        "0",
        "--spec-replay",
        b,
    ]);
    assert!(!ok && err.contains("needs a draft model"), "{err}");
}
