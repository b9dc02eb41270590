//! A mutation fuzzer over what strata reads from disk: model files (GGUF,
//! through the reader, the model checks, the engine and libllama's
//! vocabulary load), session files (the spill format plus the session
//! payload) and Hugging Face checkpoints (safetensors, config.json and
//! tokenizer.json through `strata-convert hf`, and whatever it writes
//! through the model loaders). Each case derives from a fixed seed, so a
//! failure names the case that reproduces it.
//!
//! A case passes when strata either loads the input or refuses it with an
//! error: no panic (caught per case), no abort (the process would die: the
//! case being run is written to $STRATA_FUZZ_LOG, default
//! target/fuzz-current.txt), no hang (a watchdog aborts after
//! STRATA_FUZZ_CASE_SECONDS, default 60), and bounded memory (peak RSS
//! checked at the end). STRATA_FUZZ_CASES sets the number of cases per
//! input kind (default 1000: about 80 s for model files and a few for
//! sessions on a 2-core machine; checkpoints run half of it, each
//! case being a whole conversion); STRATA_FUZZ_SEED the
//! first seed; STRATA_FUZZ_VERBOSE=1 prints each refused case with its
//! error; tools/dev/fuzz.sh runs it for an hour.
//!
//! Regression cases for the failures found by hand (a duplicated token, a
//! vocabulary shorter than token_embd, a block count that disagrees with
//! the tensors, a NaN attention scale) and the GGUF CVE classes (huge
//! string and array lengths, tensor count overflow, offsets beyond the
//! file, duplicate names) are among the structural mutations below, so
//! every run covers them.

mod common;
mod convert_support;

use common::{model, SMOLLM2};
use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use strata::engine::Engine;
use strata::gguf::{Array, GgufFile, GgufWriter, Value};
use strata::llama::LlamaModel;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Where the case being run is written before it runs (an abort leaves it).
fn log_path() -> PathBuf {
    std::env::var_os("STRATA_FUZZ_LOG")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("target/fuzz-current.txt"))
}

/// Aborts the process when a case runs longer than the limit: a hang is a
/// failure, and CI must end.
struct Watchdog {
    /// When the running case started, in ms since `t0` plus one (0: none).
    started: Arc<AtomicU64>,
    t0: Instant,
}

impl Watchdog {
    fn new(limit: Duration) -> Watchdog {
        let started = Arc::new(AtomicU64::new(0));
        let s = started.clone();
        let t0 = Instant::now();
        std::thread::spawn(move || loop {
            std::thread::sleep(Duration::from_millis(500));
            let at = s.load(Ordering::SeqCst);
            let now = t0.elapsed().as_millis() as u64 + 1;
            if at != 0 && now.saturating_sub(at) > limit.as_millis() as u64 {
                let case = std::fs::read_to_string(log_path()).unwrap_or_default();
                eprintln!("fuzz: case hangs for over {limit:?}: {case}");
                std::process::abort();
            }
        });
        Watchdog { started, t0 }
    }
    fn run<T>(&self, f: impl FnOnce() -> T) -> T {
        self.started
            .store(self.t0.elapsed().as_millis() as u64 + 1, Ordering::SeqCst);
        let r = f();
        self.started.store(0, Ordering::SeqCst);
        r
    }
}

fn peak_rss_mib() -> u64 {
    // SAFETY: rusage is plain integers, for which all zeroes is valid.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage fills the struct it is given.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    u.ru_maxrss as u64 / 1024
}

/// Seeds of cases that failed once (kind, seed), run every time first.
/// gguf 1000311: four zero bytes inside a token string made two tokens
/// equal up to a NUL, which libllama (reading C strings) aborted on.
const REGRESSIONS: &[(&str, u64)] = &[("gguf", 1000311)];

/// Makes a case's bytes (and what was done) from its seed's generator.
type MakeCase<'a> = dyn FnMut(&mut ChaCha8Rng) -> Option<(Vec<u8>, String)> + 'a;

/// Bytes worth writing over a length, count, offset or id.
const INTERESTING: [u64; 10] = [
    0,
    1,
    0x7f,
    0xffff,
    0x7fff_ffff,
    0xffff_ffff,
    1 << 32,
    1 << 40,
    0x7fff_ffff_ffff_ffff,
    u64::MAX,
];

/// A byte-level mutation of `base` within `[0, region)` (the header), or a
/// truncation anywhere.
fn mutate_bytes(base: &[u8], region: usize, rng: &mut ChaCha8Rng) -> (Vec<u8>, String) {
    let mut b = base.to_vec();
    let region = region.clamp(16, b.len());
    match rng.next_u32() % 4 {
        0 => {
            let n = 1 + rng.next_u32() % 4;
            let mut at = Vec::new();
            for _ in 0..n {
                let i = (rng.next_u64() % region as u64) as usize;
                b[i] ^= 1 << (rng.next_u32() % 8);
                at.push(i);
            }
            (b, format!("bit flips at {at:?}"))
        }
        1 => {
            let i = (rng.next_u64() % (region as u64 - 8)) as usize;
            let v = INTERESTING[(rng.next_u32() as usize) % INTERESTING.len()];
            b[i..i + 8].copy_from_slice(&v.to_le_bytes());
            (b, format!("u64 {v:#x} at {i}"))
        }
        2 => {
            let i = (rng.next_u64() % (region as u64 - 4)) as usize;
            let v = INTERESTING[(rng.next_u32() as usize) % INTERESTING.len()] as u32;
            b[i..i + 4].copy_from_slice(&v.to_le_bytes());
            (b, format!("u32 {v:#x} at {i}"))
        }
        _ => {
            let n = (rng.next_u64() % b.len() as u64) as usize;
            b.truncate(n);
            (b, format!("truncated to {n} bytes"))
        }
    }
}

/// The model file rewritten with its metadata or tensor table changed in a
/// way libllama or ggml would assert on, or that disagrees with itself.
fn mutate_structure(f: &GgufFile, data: &[u8], rng: &mut ChaCha8Rng) -> Option<(Vec<u8>, String)> {
    let mut meta = f.metadata.clone();
    let mut tensors: Vec<(String, Vec<u64>, strata::gguf::GgmlType, Vec<u8>)> = f
        .tensors
        .iter()
        .map(|t| {
            let at = t.offset as usize;
            (
                t.name.clone(),
                t.ne.clone(),
                t.ty,
                data[at..at + t.size as usize].to_vec(),
            )
        })
        .collect();
    let set = |meta: &mut Vec<(String, Value)>, k: &str, v: Value| match meta
        .iter_mut()
        .find(|(n, _)| n == k)
    {
        Some(slot) => slot.1 = v,
        None => meta.push((k.to_string(), v)),
    };
    let tokens_at = meta
        .iter()
        .position(|(k, _)| k == "tokenizer.ggml.tokens")?;
    let arch = f.get_str("general.architecture").ok()?.to_string();
    let what;
    match rng.next_u32() % 12 {
        0 => {
            // a duplicated token string (libllama asserted: exit 134)
            if let Value::Array(Array::Str(t)) = &mut meta[tokens_at].1 {
                let i = 1 + (rng.next_u64() % (t.len() as u64 - 2)) as usize;
                t[i] = t[i + 1].clone();
                what = format!("token {i} duplicates token {}", i + 1);
            } else {
                return None;
            }
        }
        1 => {
            // fewer tokens than token_embd rows (a sampled id beyond the
            // vocabulary threw a C++ exception)
            if let Value::Array(Array::Str(t)) = &mut meta[tokens_at].1 {
                let n = [1usize, 1000, t.len() - 1][(rng.next_u32() % 3) as usize];
                t.truncate(n);
                what = format!("vocabulary cut to {n} tokens");
            } else {
                return None;
            }
        }
        2 => {
            let k = format!("{arch}.block_count");
            let n = f.get_u32(&k).ok()?;
            let v = [0, n - 1, n + 1, u32::MAX][(rng.next_u32() % 4) as usize];
            set(&mut meta, &k, Value::U32(v));
            what = format!("{k} = {v} (tensors for {n})");
        }
        3 => {
            let k = format!("{arch}.attention.scale");
            let v = [f32::NAN, f32::INFINITY, -1.0, 0.0][(rng.next_u32() % 4) as usize];
            set(&mut meta, &k, Value::F32(v));
            what = format!("{k} = {v}");
        }
        4 => {
            let keys = [
                "attention.head_count",
                "attention.head_count_kv",
                "embedding_length",
                "feed_forward_length",
                "rope.dimension_count",
                "context_length",
            ];
            let k = format!("{arch}.{}", keys[(rng.next_u32() as usize) % keys.len()]);
            let v = INTERESTING[(rng.next_u32() as usize) % 6] as u32;
            set(&mut meta, &k, Value::U32(v));
            what = format!("{k} = {v}");
        }
        5 => {
            let keys = [
                "tokenizer.ggml.bos_token_id",
                "tokenizer.ggml.eos_token_id",
                "tokenizer.ggml.padding_token_id",
            ];
            let k = keys[(rng.next_u32() as usize) % keys.len()];
            let v = [49152u32, u32::MAX, 0x7fff_ffff][(rng.next_u32() % 3) as usize];
            set(&mut meta, k, Value::U32(v));
            what = format!("{k} = {v}");
        }
        6 => {
            let i = (rng.next_u64() % tensors.len() as u64) as usize;
            what = format!("tensor {} removed", tensors[i].0);
            tensors.remove(i);
        }
        7 => {
            // a tensor of another shape (same bytes: the type's row count changes)
            let i = (rng.next_u64() % tensors.len() as u64) as usize;
            let t = &mut tensors[i];
            if t.1.len() < 2 {
                return None;
            }
            t.1.swap(0, 1);
            what = format!("tensor {} transposed to {:?}", t.0, t.1);
        }
        8 => {
            for k in [
                "tokenizer.ggml.token_type",
                "tokenizer.ggml.scores",
                "tokenizer.ggml.merges",
            ] {
                if let Some(slot) = meta.iter_mut().find(|(n, _)| n == k) {
                    if let Value::Array(a) = &mut slot.1 {
                        match a {
                            Array::I32(v) => v.truncate(v.len() / 2),
                            Array::F32(v) => v.truncate(v.len() / 2),
                            Array::Str(v) => {
                                // merges naming tokens that do not exist
                                for m in v.iter_mut().take(50) {
                                    *m = format!("\u{1}zz{m} q\u{2}");
                                }
                            }
                            _ => {}
                        }
                    }
                }
            }
            what = "token types and scores cut in half, merges of unknown tokens".into();
        }
        9 => {
            let v = ["gpt2", "llama", "bert", "", "no-such-model"][(rng.next_u32() % 5) as usize];
            set(&mut meta, "tokenizer.ggml.model", Value::Str(v.into()));
            what = format!("tokenizer.ggml.model = {v:?}");
        }
        10 => {
            let v = ["qwen2", "gpt2", "falcon", "mamba", ""][(rng.next_u32() % 5) as usize];
            set(&mut meta, "general.architecture", Value::Str(v.into()));
            what = format!("general.architecture = {v:?}");
        }
        _ => {
            // the token_type array of another element type
            let n = f.get("tokenizer.ggml.tokens").map(|v| match v {
                Value::Array(Array::Str(t)) => t.len(),
                _ => 0,
            })?;
            set(
                &mut meta,
                "tokenizer.ggml.token_type",
                Value::Array(Array::Str(vec!["x".into(); n])),
            );
            what = "token_type as strings".into();
        }
    }
    let mut w = GgufWriter::new(f.alignment);
    for (k, v) in meta {
        if k != "general.alignment" {
            w.set(&k, v);
        }
    }
    for (name, ne, ty, bytes) in tensors {
        if w.add_tensor(&name, &ne, ty, bytes).is_err() {
            return None;
        }
    }
    let mut out = Vec::new();
    w.write_to(&mut out).ok()?;
    Some((out, what))
}

/// Loads a model file the way `strata run` does; Ok or a refusal both pass.
fn load_model(path: &Path) -> Result<(), String> {
    let f = GgufFile::open(path).map_err(|e| e.to_string())?;
    drop(f);
    let e = Engine::load(path, &common::cpu_cfg()).map_err(|e| e.to_string())?;
    drop(e);
    LlamaModel::load(path, true, 0).map_err(|e| e.to_string())?;
    Ok(())
}

struct Outcome {
    cases: u64,
    refused: u64,
    loaded: u64,
    failures: Vec<String>,
}

fn run_cases(
    kind: &str,
    n: u64,
    first_seed: u64,
    make: &mut MakeCase<'_>,
    check: &mut dyn FnMut(&Path) -> Result<(), String>,
    dir: &Path,
) -> Outcome {
    let dog = Watchdog::new(Duration::from_secs(env_u64("STRATA_FUZZ_CASE_SECONDS", 60)));
    let t0 = Instant::now();
    let mut out = Outcome {
        cases: 0,
        refused: 0,
        loaded: 0,
        failures: Vec::new(),
    };
    let path = dir.join(format!("{kind}.case"));
    let verbose = env_u64("STRATA_FUZZ_VERBOSE", 0) == 1;
    // cases that failed once, then the window
    let seeds = REGRESSIONS
        .iter()
        .filter(|(k, _)| *k == kind)
        .map(|&(_, s)| s)
        .chain(first_seed..first_seed + n);
    for seed in seeds {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let Some((bytes, what)) = make(&mut rng) else {
            continue;
        };
        std::fs::write(&path, &bytes).expect("write the case");
        let label = format!("{kind} seed {seed}: {what}");
        std::fs::write(log_path(), &label).expect("log the case");
        let r = dog.run(|| std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(&path))));
        out.cases += 1;
        match r {
            Ok(Ok(())) => out.loaded += 1,
            Ok(Err(e)) => {
                out.refused += 1;
                if verbose {
                    eprintln!("{label}\n    refused: {e}");
                }
            }
            Err(p) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                out.failures.push(format!("{label}: panicked: {msg}"));
            }
        }
    }
    let _ = std::fs::remove_file(log_path());
    eprintln!(
        "fuzz {kind}: {} cases in {:.1} s: {} refused, {} loaded, {} failed; peak RSS {} MiB",
        out.cases,
        t0.elapsed().as_secs_f64(),
        out.refused,
        out.loaded,
        out.failures.len(),
        peak_rss_mib()
    );
    out
}

/// A small model with SmolLM2's real vocabulary: the tiny synthetic preset
/// (two layers), so each case writes and loads a few MB.
fn base_model(dir: &Path) -> Option<PathBuf> {
    let vocab = model(SMOLLM2)?;
    let out = dir.join("base.gguf");
    let s = common::Synth {
        layers: Some(2),
        seed: 1,
        ..common::Synth::default()
    };
    common::synth(&out, &vocab, s);
    Some(out)
}

#[test]
fn fuzz_model_files() {
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(base) = base_model(dir.path()) else {
        return;
    };
    load_model(&base).expect("the base model loads");
    let bytes = std::fs::read(&base).unwrap();
    let f = GgufFile::open(&base).unwrap();
    let header = f.data_offset as usize;
    let n = env_u64("STRATA_FUZZ_CASES", 1000);
    let seed = env_u64("STRATA_FUZZ_SEED", 0);
    let mut make = |rng: &mut ChaCha8Rng| {
        if rng.next_u32().is_multiple_of(2) {
            Some(mutate_bytes(&bytes, header, rng))
        } else {
            mutate_structure(&f, &bytes, rng)
        }
    };
    let o = run_cases("gguf", n, seed, &mut make, &mut load_model, dir.path());
    assert!(o.failures.is_empty(), "{:#?}", o.failures);
    assert!(
        n == 0 || (o.refused > 0 && o.cases > n / 2),
        "the mutations did not reach the checks"
    );
    assert!(peak_rss_mib() < 4096, "peak RSS {} MiB", peak_rss_mib());
}

#[test]
fn fuzz_session_files() {
    use strata::generate::Session;
    use strata::sample::Sampler;
    let dir = tempfile::tempdir().expect("tempdir");
    let Some(base) = base_model(dir.path()) else {
        return;
    };
    let vocab = LlamaModel::load(&base, true, 0).expect("vocab");
    let mut e = Engine::load(&base, &common::cpu_cfg()).expect("engine");
    let saved = dir.path().join("s.kv");
    {
        let prompt = vocab
            .tokenize("Hello there, how are you", true, true)
            .unwrap();
        let mut s = Session::new(
            &mut e,
            &vocab,
            Sampler::new(common::sampled_cfg(3)).unwrap(),
        );
        s.generate(&prompt, 6, |_| {}).unwrap();
        s.save(&saved).unwrap();
    }
    let bytes = std::fs::read(&saved).unwrap();
    // the header page and the table and payload after it
    let region = bytes.len().min(3 * 4096);
    let n = env_u64("STRATA_FUZZ_CASES", 1000);
    let seed = env_u64("STRATA_FUZZ_SEED", 0);
    let mut make = |rng: &mut ChaCha8Rng| Some(mutate_bytes(&bytes, region, rng));
    let mut check = |p: &Path| -> Result<(), String> {
        let mut s = Session::new(
            &mut e,
            &vocab,
            Sampler::new(common::sampled_cfg(3)).unwrap(),
        );
        match s.load(p) {
            Ok(()) => {
                // a file that loads must generate
                s.generate(&[], 2, |_| {}).map_err(|e| e.to_string())?;
                s.engine.clear_seq(0);
                Ok(())
            }
            Err(err) => {
                assert!(
                    s.engine.kv().cells().seq_cells(0).is_empty(),
                    "a refused session left cells: {err}"
                );
                Err(err.to_string())
            }
        }
    };
    let o = run_cases("session", n, seed, &mut make, &mut check, dir.path());
    assert!(o.failures.is_empty(), "{:#?}", o.failures);
    assert!(
        n == 0 || o.refused > 0,
        "the mutations did not reach the checks"
    );
    assert!(peak_rss_mib() < 4096, "peak RSS {} MiB", peak_rss_mib());
}

/// A checkpoint file rewritten in a way the converter must refuse or
/// survive: the safetensors header's JSON changed entry by entry, or
/// config.json / tokenizer.json with a key removed or given an odd value.
/// Returns the file's name, its bytes and what was done.
fn mutate_checkpoint(
    files: &[(&'static str, Vec<u8>)],
    rng: &mut ChaCha8Rng,
) -> Option<(&'static str, Vec<u8>, String)> {
    use serde_json::{json, Value};
    let pick = |rng: &mut ChaCha8Rng, n: usize| (rng.next_u64() % n as u64) as usize;
    let odd = |rng: &mut ChaCha8Rng| -> Value {
        let v = [
            json!(0),
            json!(-1),
            json!(1),
            json!(3),
            json!(1e12),
            json!(4294967552u64),
            json!(u64::MAX),
            json!(1.5),
            json!(-0.0),
            json!(1e308),
            json!("x"),
            json!(null),
            json!([]),
            json!({}),
            json!(true),
        ];
        v[(rng.next_u64() % v.len() as u64) as usize].clone()
    };
    let (name, base) = &files[pick(rng, files.len())];
    match *name {
        "model.safetensors" => {
            let hlen = u64::from_le_bytes(base[..8].try_into().ok()?) as usize;
            let mut header: serde_json::Map<String, Value> =
                serde_json::from_slice(&base[8..8 + hlen]).ok()?;
            let data = &base[8 + hlen..];
            let names: Vec<String> = header
                .keys()
                .filter(|k| *k != "__metadata__")
                .cloned()
                .collect();
            let t = names[pick(rng, names.len())].clone();
            let what = match rng.next_u32() % 8 {
                0 => {
                    let d = ["F64", "I8", "U8", "BOOL", "F8_E4M3", "I64", "", "f32"];
                    let d = d[pick(rng, d.len())];
                    header[&t]["dtype"] = json!(d);
                    format!("{t}: dtype {d:?}")
                }
                1 => {
                    let v = odd(rng);
                    let shape = header[&t]["shape"].as_array_mut()?;
                    let i = pick(rng, shape.len() + 1);
                    if i == shape.len() {
                        shape.push(v.clone());
                    } else {
                        shape[i] = v.clone();
                    }
                    format!("{t}: shape[{i}] = {v}")
                }
                2 => {
                    let shape = header[&t]["shape"].as_array_mut()?;
                    shape.reverse();
                    format!("{t}: shape reversed")
                }
                3 => {
                    let v = odd(rng);
                    let i = pick(rng, 2);
                    header[&t]["data_offsets"][i] = v.clone();
                    format!("{t}: data_offsets[{i}] = {v}")
                }
                4 => {
                    let o = header[&t]["data_offsets"].as_array_mut()?;
                    o.swap(0, 1);
                    format!("{t}: data_offsets swapped")
                }
                5 => {
                    // overlap another tensor's bytes
                    let u = names[pick(rng, names.len())].clone();
                    let o = header[&u]["data_offsets"].clone();
                    header[&t]["data_offsets"] = o;
                    format!("{t}: data_offsets of {u}")
                }
                6 => {
                    header.remove(&t);
                    format!("{t} removed")
                }
                _ => {
                    let v = header.remove(&t)?;
                    let n = format!("{t}.extra");
                    header.insert(n.clone(), v);
                    format!("{t} renamed {n}")
                }
            };
            let mut h = serde_json::to_vec(&header).ok()?;
            let lie = rng.next_u32().is_multiple_of(8);
            let len = if lie {
                INTERESTING[pick(rng, INTERESTING.len())]
            } else {
                h.len() as u64
            };
            let mut out = len.to_le_bytes().to_vec();
            out.append(&mut h);
            out.extend_from_slice(data);
            let what = if lie {
                format!("{what}; header length {len:#x}")
            } else {
                what
            };
            Some((name, out, what))
        }
        _ => {
            let mut j: Value = serde_json::from_slice(base).ok()?;
            let what = if *name == "tokenizer.json" {
                match rng.next_u32() % 5 {
                    0 => {
                        let v = odd(rng);
                        j["model"]["type"] = v.clone();
                        format!("model.type = {v}")
                    }
                    1 => {
                        // a token string given twice
                        let vocab = j["model"]["vocab"].as_object_mut()?;
                        let keys: Vec<String> = vocab.keys().cloned().collect();
                        let (a, b) = (&keys[pick(rng, keys.len())], &keys[pick(rng, keys.len())]);
                        let id = vocab[b].clone();
                        vocab.insert(a.clone(), id.clone());
                        format!("vocab[{a:?}] = {id} (the id of {b:?})")
                    }
                    2 => {
                        let vocab = j["model"]["vocab"].as_object_mut()?;
                        let keys: Vec<String> = vocab.keys().cloned().collect();
                        let k = &keys[pick(rng, keys.len())];
                        let v = odd(rng);
                        vocab.insert(k.clone(), v.clone());
                        format!("vocab[{k:?}] = {v}")
                    }
                    3 => {
                        let merges = j["model"]["merges"].as_array_mut()?;
                        let i = pick(rng, merges.len().max(1));
                        let v = if rng.next_u32().is_multiple_of(2) {
                            json!("zzzq qqqz")
                        } else {
                            odd(rng)
                        };
                        if i < merges.len() {
                            merges[i] = v.clone();
                        }
                        format!("merges[{i}] = {v}")
                    }
                    _ => {
                        let v = odd(rng);
                        j["added_tokens"] =
                            json!([{"id": v.clone(), "content": "<x>", "special": true}]);
                        format!("added_tokens id {v}")
                    }
                }
            } else {
                let obj = j.as_object_mut()?;
                let keys: Vec<String> = obj.keys().cloned().collect();
                let k = keys[pick(rng, keys.len())].clone();
                if rng.next_u32().is_multiple_of(4) {
                    obj.remove(&k);
                    format!("{k} removed")
                } else {
                    let v = if k == "architectures" && rng.next_u32().is_multiple_of(2) {
                        json!(["GPTNeoXForCausalLM"])
                    } else {
                        odd(rng)
                    };
                    obj.insert(k.clone(), v.clone());
                    format!("{k} = {v}")
                }
            };
            Some((name, serde_json::to_vec(&j).ok()?, what))
        }
    }
}

#[test]
fn fuzz_hf_checkpoints() {
    use convert_support::reference::{TinyConfig, TinyModel};
    use std::cell::Cell;
    use strata::convert::hf;
    let Some(vocab) = model(SMOLLM2) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let ckpt = dir.path().join("ckpt");
    std::fs::create_dir(&ckpt).unwrap();
    // a two-layer Llama with SmolLM2's tokenizer, f16, tied embeddings
    let m = TinyModel::new(
        TinyConfig {
            class: "LlamaForCausalLM",
            hidden: 64,
            n_head: 4,
            n_kv: 2,
            inter: 128,
            n_layer: 2,
            vocab: 49152,
            tie: true,
            qkv_bias: false,
            theta: 10000.0,
            eps: 1e-5,
            llama3: None,
            dtype: "F16",
            qwen3_head_dim: None,
            moe: None,
        },
        7,
    );
    m.write(&ckpt, 1);
    let style = convert_support::TokenizerStyle {
        pre_tokenizer: convert_support::smollm_pre(),
        pair_merges: false,
        bos_via_config: false,
    };
    convert_support::write_tokenizer(&vocab, &ckpt, &style);
    let names = ["model.safetensors", "config.json", "tokenizer.json"];
    let files: Vec<(&'static str, Vec<u8>)> = names
        .iter()
        .map(|&n| (n, std::fs::read(ckpt.join(n)).expect("checkpoint file")))
        .collect();
    let out = dir.path().join("out.gguf");
    let opts = hf::HfOptions {
        target: None,
        pre: None,
        threads: 2,
        progress: false,
    };
    hf::convert_hf(&ckpt, &out, &opts).expect("the base checkpoint converts");
    load_model(&out).expect("its conversion loads");
    // the file the case changes; the others are restored before each case
    let target = Cell::new("");
    let converted_unloadable = Cell::new(0u64);
    let mut make = |rng: &mut ChaCha8Rng| {
        let (name, bytes, what) = if rng.next_u32().is_multiple_of(3) {
            let (name, base) = &files[0];
            let region = 8 + u64::from_le_bytes(base[..8].try_into().unwrap()) as usize;
            let (b, w) = mutate_bytes(base, region + 64, rng);
            (*name, b, w)
        } else {
            mutate_checkpoint(&files, rng)?
        };
        target.set(name);
        Some((bytes, format!("{name}: {what}")))
    };
    let mut check = |case: &Path| -> Result<(), String> {
        for (n, b) in &files {
            std::fs::write(ckpt.join(n), b).expect("restore");
        }
        std::fs::copy(case, ckpt.join(target.get())).expect("case file");
        let _ = std::fs::remove_file(&out);
        hf::convert_hf(&ckpt, &out, &opts).map_err(|e| format!("{e:#}"))?;
        // what the converter accepted, the loaders refuse or load
        load_model(&out).inspect_err(|_| converted_unloadable.set(converted_unloadable.get() + 1))
    };
    let n = env_u64("STRATA_FUZZ_CASES", 1000) / 2;
    let seed = env_u64("STRATA_FUZZ_SEED", 0);
    let o = run_cases("hf", n, seed, &mut make, &mut check, dir.path());
    eprintln!(
        "fuzz hf: {} converted files refused by the loaders",
        converted_unloadable.get()
    );
    assert!(o.failures.is_empty(), "{:#?}", o.failures);
    assert!(
        n == 0 || (o.refused > 0 && o.cases > n / 2),
        "the mutations did not reach the checks"
    );
    assert!(peak_rss_mib() < 4096, "peak RSS {} MiB", peak_rss_mib());
}
