//! Malformed input is refused with an error naming the problem, and no
//! failure (bad input, a write error midway, SIGINT, SIGKILL) leaves an
//! output file, or any file a GGUF reader accepts.

use crate::common::{self, model};
use crate::convert_support::reference::{TinyConfig, TinyModel};
use serde_json::json;
use std::path::Path;
use strata::convert::{self, hf, OutTensor, OutputModel};
use strata::gguf::GgufFile;

/// A valid tiny checkpoint (no tokenizer: every check below fails first).
fn checkpoint(dir: &Path) -> TinyModel {
    let c = TinyConfig {
        class: "LlamaForCausalLM",
        hidden: 64,
        n_head: 2,
        n_kv: 1,
        inter: 128,
        n_layer: 1,
        vocab: 256,
        tie: false,
        qkv_bias: false,
        theta: 10000.0,
        eps: 1e-5,
        llama3: None,
        dtype: "F32",
        qwen3_head_dim: None,
        moe: None,
    };
    let m = TinyModel::new(c, 9);
    m.write(dir, 1);
    m
}

/// Nothing but the inputs is left in `dir`: no output, no partial file.
fn assert_no_output(dir: &Path) {
    for e in std::fs::read_dir(dir).expect("dir").flatten() {
        let n = e.file_name().to_string_lossy().into_owned();
        assert!(
            !n.contains("out") && !n.contains("partial"),
            "left behind: {n}"
        );
    }
}

fn hf_error(dir: &Path) -> String {
    let opts = hf::HfOptions {
        target: None,
        pre: None,
        threads: 1,
        progress: false,
    };
    let e = hf::convert_hf(dir, &dir.join("out.gguf"), &opts).expect_err("must be refused");
    assert_no_output(dir);
    e.to_string()
}

fn raw_safetensors(dir: &Path, header: &serde_json::Value, data_len: usize) {
    let h = header.to_string().into_bytes();
    let mut b = (h.len() as u64).to_le_bytes().to_vec();
    b.extend_from_slice(&h);
    b.resize(b.len() + data_len, 0);
    std::fs::write(dir.join("model.safetensors"), b).expect("write");
}

fn expect_msg(msg: &str, want: &str) {
    assert!(
        msg.contains(want),
        "error {msg:?} does not mention {want:?}"
    );
}

#[test]
fn truncated_and_corrupt_safetensors() {
    let d = tempfile::tempdir().expect("tmp");
    let dir = d.path();
    checkpoint(dir);
    let st = dir.join("model.safetensors");
    let full = std::fs::read(&st).expect("read");
    std::fs::write(&st, &full[..5]).expect("w");
    expect_msg(&hf_error(dir), "no header length");
    std::fs::write(&st, &full[..40]).expect("w");
    expect_msg(&hf_error(dir), "truncated: header of");
    std::fs::write(&st, &full[..full.len() - 100]).expect("w");
    expect_msg(&hf_error(dir), "out of range");
    let mut huge = 200_000_000u64.to_le_bytes().to_vec();
    huge.extend_from_slice(b"{}");
    std::fs::write(&st, huge).expect("w");
    expect_msg(&hf_error(dir), "larger than the limit");
    let mut bad = 4u64.to_le_bytes().to_vec();
    bad.extend_from_slice(b"{no}");
    std::fs::write(&st, bad).expect("w");
    expect_msg(&hf_error(dir), "not valid JSON");
}

#[test]
fn bad_offsets_and_dtypes() {
    let d = tempfile::tempdir().expect("tmp");
    let dir = d.path();
    checkpoint(dir);
    let t = |dtype: &str, shape: &[u64], a: u64, b: u64| json!({"dtype": dtype, "shape": shape, "data_offsets": [a, b]});
    let h = json!({"a": t("F32", &[4], 0, 16), "b": t("F32", &[4], 8, 24)});
    raw_safetensors(dir, &h, 24);
    expect_msg(&hf_error(dir), "overlap");
    raw_safetensors(dir, &json!({"a": t("F32", &[4], 16, 32)}), 24);
    expect_msg(&hf_error(dir), "out of range");
    raw_safetensors(dir, &json!({"a": t("F32", &[5], 0, 16)}), 16);
    expect_msg(&hf_error(dir), "needs 20");
    raw_safetensors(dir, &json!({"a": t("Q9", &[4], 0, 16)}), 16);
    expect_msg(&hf_error(dir), "unknown dtype 'Q9'");
    raw_safetensors(
        dir,
        &json!({"model.norm.weight": t("I64", &[2], 0, 16)}),
        16,
    );
    let e = hf_error(dir);
    expect_msg(&e, "dtype I64");
    expect_msg(&e, "model.norm.weight");
}

#[test]
fn checkpoint_disagreeing_with_config() {
    let d = tempfile::tempdir().expect("tmp");
    let dir = d.path();
    let m = checkpoint(dir);
    let mut cfg = m.config_json();
    cfg["intermediate_size"] = json!(96);
    std::fs::write(dir.join("config.json"), cfg.to_string()).expect("w");
    let e = hf_error(dir);
    expect_msg(&e, "model.layers.0.mlp.gate_proj.weight");
    expect_msg(&e, "config.json implies [96, 64]");
    cfg["intermediate_size"] = json!(128);
    cfg["num_hidden_layers"] = json!(2);
    std::fs::write(dir.join("config.json"), cfg.to_string()).expect("w");
    expect_msg(
        &hf_error(dir),
        "missing tensor 'model.layers.1.input_layernorm.weight'",
    );
    cfg["num_hidden_layers"] = json!(0);
    std::fs::write(dir.join("config.json"), cfg.to_string()).expect("w");
    expect_msg(&hf_error(dir), "'num_hidden_layers' is 0");
    // counts are bounded before anything is allocated from them (10^12
    // layers allocated until the process aborted), and nothing wraps into
    // a u32 field (4294967552 became a context of 256)
    cfg["num_hidden_layers"] = json!(1_000_000_000_000u64);
    std::fs::write(dir.join("config.json"), cfg.to_string()).expect("w");
    expect_msg(
        &hf_error(dir),
        "'num_hidden_layers' = 1000000000000 is outside 1..=4096",
    );
    cfg["num_hidden_layers"] = json!(1);
    cfg["max_position_embeddings"] = json!(4294967552u64);
    std::fs::write(dir.join("config.json"), cfg.to_string()).expect("w");
    expect_msg(
        &hf_error(dir),
        "'max_position_embeddings' = 4294967552 is outside",
    );
    cfg["max_position_embeddings"] = json!(2048);
    cfg["num_hidden_layers"] = json!(0);
    cfg.as_object_mut().expect("obj").remove("hidden_size");
    std::fs::write(dir.join("config.json"), cfg.to_string()).expect("w");
    expect_msg(&hf_error(dir), "missing 'hidden_size'");
    cfg["architectures"] = json!(["GPT2LMHeadModel"]);
    std::fs::write(dir.join("config.json"), cfg.to_string()).expect("w");
    expect_msg(&hf_error(dir), "GPT2LMHeadModel");
    // an extra tensor
    let m = checkpoint(dir);
    let mut m2 = TinyModel {
        cfg: m.cfg.clone(),
        w: m.w.clone(),
    };
    m2.w.insert(
        "model.layers.0.mlp.extra.weight".into(),
        (vec![2], vec![0.0, 0.0]),
    );
    m2.write(dir, 1);
    expect_msg(
        &hf_error(dir),
        "tensor 'model.layers.0.mlp.extra.weight', which this architecture does not use",
    );
}

#[test]
fn bad_shard_index() {
    let d = tempfile::tempdir().expect("tmp");
    let dir = d.path();
    checkpoint(dir);
    let idx = dir.join("model.safetensors.index.json");
    std::fs::write(
        &idx,
        json!({"weight_map": {"model.norm.weight": "../evil.safetensors"}}).to_string(),
    )
    .expect("w");
    expect_msg(&hf_error(dir), "not a plain file name");
    std::fs::write(&idx, json!({"weight_map": {"model.norm.weight": "model.safetensors", "ghost.weight": "model.safetensors"}}).to_string()).expect("w");
    expect_msg(
        &hf_error(dir),
        "'ghost.weight' here, but the shard does not contain it",
    );
    std::fs::write(&idx, "{]").expect("w");
    hf_error(dir);
}

#[test]
fn truncated_gguf_is_refused() {
    let Some(src) = model(common::SMOLLM2) else {
        return;
    };
    let d = tempfile::tempdir().expect("tmp");
    let bytes = std::fs::read(&src).expect("read");
    let opts = convert::GgufOptions {
        target: None,
        allow_requantize: false,
        threads: 1,
        progress: false,
    };
    for (cut, want) in [(20, "truncated"), (50 << 20, "outside the file")] {
        let p = d.path().join("in.gguf");
        std::fs::write(&p, &bytes[..cut]).expect("w");
        let e = convert::convert_gguf(&p, &d.path().join("out.gguf"), &opts).expect_err("refused");
        expect_msg(&e.to_string(), want);
        expect_msg(&e.to_string(), "in.gguf");
        std::fs::remove_file(&p).expect("rm");
        assert_no_output(d.path());
    }
}

/// A write that fails midway leaves the previous output untouched and no
/// temporary file.
#[test]
fn failed_write_leaves_nothing() {
    let Some(vocab) = model(common::SMOLLM2) else {
        return;
    };
    let d = tempfile::tempdir().expect("tmp");
    let opts = strata::convert::synth::SynthOptions {
        preset: strata::convert::synth::preset("tiny").expect("tiny"),
        target: strata::convert::quant::Target::Type(strata::gguf::GgmlType::Q8_0),
        layers: None,
        vocab_from: vocab,
        seed: 1,
        router_skew: 0.0,
        threads: 1,
        progress: false,
    };
    let src = d.path().join("src.gguf");
    strata::convert::synth::synth(&opts, &src).expect("synth");
    let f = GgufFile::open(&src).expect("open");
    let bytes = std::sync::Arc::new(std::fs::read(&src).expect("read"));
    let tensors = f
        .tensors
        .iter()
        .map(|t| {
            let (b, a, n, fail) = (
                bytes.clone(),
                t.offset as usize,
                t.size as usize,
                t.name == "blk.1.ffn_up.weight",
            );
            OutTensor {
                name: t.name.clone(),
                ne: t.ne.clone(),
                ty: t.ty,
                fill: Box::new(move |w| {
                    if fail {
                        w.write_all(&b[a..a + n / 2])?;
                        return Err(std::io::Error::other("simulated disk failure"));
                    }
                    w.write_all(&b[a..a + n])
                }),
            }
        })
        .collect();
    let out = d.path().join("model.gguf");
    std::fs::write(&out, b"previous contents").expect("w");
    let m = OutputModel {
        metadata: f.metadata.clone(),
        tensors,
        n_layer: 2,
    };
    let e = convert::write_model(m, &out, false).expect_err("fails");
    expect_msg(&e.to_string(), "simulated disk failure");
    assert_eq!(std::fs::read(&out).expect("old"), b"previous contents");
    let names: Vec<String> = std::fs::read_dir(d.path())
        .expect("d")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.iter().all(|n| !n.contains("partial")), "{names:?}");
}

/// Runs the binary on a large synth job and signals it once the partial
/// file has grown; returns the directory listing afterwards.
fn interrupt(
    sig: i32,
) -> Option<(
    tempfile::TempDir,
    Vec<std::path::PathBuf>,
    std::process::Output,
)> {
    let vocab = model(common::SMOLLM2)?;
    let d = tempfile::tempdir().expect("tmp");
    let out = d.path().join("big.gguf");
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_strata-convert"))
        .args([
            "synth",
            "--preset",
            "llama3-70b",
            "--type",
            "q4_0",
            "--layers",
            "4",
            "-q",
            "--vocab-from",
        ])
        .arg(&vocab)
        .arg(&out)
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn");
    let t0 = std::time::Instant::now();
    loop {
        let grown = std::fs::read_dir(d.path())
            .expect("d")
            .flatten()
            .any(|e| e.metadata().is_ok_and(|m| m.len() > 64 << 20));
        if grown || t0.elapsed().as_secs() > 60 {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // SAFETY: plain kill(2) of our own child by its pid.
    unsafe { libc::kill(child.id() as i32, sig) };
    let output = child.wait_with_output().expect("wait");
    let left = std::fs::read_dir(d.path())
        .expect("d")
        .flatten()
        .map(|e| e.path())
        .collect();
    Some((d, left, output))
}

#[test]
fn sigint_removes_partial_output() {
    let Some((_d, left, out)) = interrupt(libc::SIGINT) else {
        return;
    };
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("interrupted; the partial output was removed"),
        "{err}"
    );
    assert!(left.is_empty(), "left behind after SIGINT: {left:?}");
}

#[test]
fn sigkill_never_leaves_a_valid_looking_file() {
    let Some((_d, left, out)) = interrupt(libc::SIGKILL) else {
        return;
    };
    assert!(!out.status.success());
    for p in left {
        let name = p
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        assert_ne!(name, "big.gguf", "output exists after SIGKILL");
        let e = GgufFile::open(&p).expect_err("partial file must not parse");
        assert!(matches!(e, strata::gguf::GgufError::BadMagic { .. }), "{e}");
    }
}
