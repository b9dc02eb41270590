//! Model-level validation: files that parse as GGUF but do not describe a
//! model strata can run get an error naming the problem.

use strata::gguf::{GgmlType, GgufFile, GgufWriter, Value};
use strata::model::{ModelError, ModelSpec};

const E: u64 = 64;
const FF: u64 = 128;
const V: u64 = 32;

/// A tiny valid llama model description (2 layers), with hooks to break it.
fn tiny(
    edit: impl Fn(&mut Vec<(String, Value)>, &mut Vec<(String, Vec<u64>, GgmlType)>),
) -> ModelSpecResult {
    let mut kv: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::Str("llama".into())),
        ("llama.embedding_length".into(), Value::U32(E as u32)),
        ("llama.block_count".into(), Value::U32(2)),
        ("llama.feed_forward_length".into(), Value::U32(FF as u32)),
        ("llama.attention.head_count".into(), Value::U32(4)),
        ("llama.attention.head_count_kv".into(), Value::U32(2)),
        ("llama.context_length".into(), Value::U32(256)),
        (
            "llama.attention.layer_norm_rms_epsilon".into(),
            Value::F32(1e-5),
        ),
    ];
    let mut ts: Vec<(String, Vec<u64>, GgmlType)> = vec![
        ("token_embd.weight".into(), vec![E, V], GgmlType::F32),
        ("output_norm.weight".into(), vec![E], GgmlType::F32),
    ];
    for l in 0..2 {
        for (n, s) in [
            ("attn_norm.weight", vec![E]),
            ("attn_q.weight", vec![E, E]),
            ("attn_k.weight", vec![E, E / 2]),
            ("attn_v.weight", vec![E, E / 2]),
            ("attn_output.weight", vec![E, E]),
            ("ffn_norm.weight", vec![E]),
            ("ffn_gate.weight", vec![E, FF]),
            ("ffn_up.weight", vec![E, FF]),
            ("ffn_down.weight", vec![FF, E]),
        ] {
            ts.push((format!("blk.{l}.{n}"), s, GgmlType::F32));
        }
    }
    edit(&mut kv, &mut ts);
    let mut w = GgufWriter::new(32);
    for (k, v) in kv {
        w.set(&k, v);
    }
    for (n, s, ty) in ts {
        let bytes = (s.iter().product::<u64>() / ty.block_size().unwrap() * ty.type_size().unwrap())
            as usize;
        w.add_tensor(&n, &s, ty, vec![0u8; bytes])
            .expect("add tensor");
    }
    let mut buf = Vec::new();
    w.write_to(&mut buf).expect("write");
    let f = GgufFile::parse(&buf[..], buf.len() as u64).expect("valid gguf");
    ModelSpec::from_gguf(&f)
}

type ModelSpecResult = Result<ModelSpec, ModelError>;

#[test]
fn tiny_model_is_valid_and_ties_embeddings() {
    let s = tiny(|_, _| {}).expect("valid");
    assert_eq!(s.hp.n_vocab, V as u32);
    assert_eq!(s.output.name, "token_embd.weight");
    assert_eq!(s.groups.len(), 4);
    assert_eq!(s.hp.head_dim, 16);
}

#[test]
fn unknown_architecture() {
    let e = tiny(|kv, _| kv[0].1 = Value::Str("mamba".into())).unwrap_err();
    assert!(
        matches!(e, ModelError::UnknownArch(ref a) if a == "mamba"),
        "{e}"
    );
    assert!(e.to_string().contains("mamba"));
}

#[test]
fn wrong_metadata_type() {
    let e = tiny(|kv, _| kv[1].1 = Value::Str("64".into())).unwrap_err();
    assert!(e.to_string().contains("llama.embedding_length"), "{e}");
}

#[test]
fn missing_tensor() {
    let e = tiny(|_, ts| ts.retain(|t| t.0 != "blk.1.ffn_up.weight")).unwrap_err();
    assert!(e.to_string().contains("blk.1.ffn_up.weight"), "{e}");
}

#[test]
fn wrong_shape() {
    let e = tiny(|_, ts| {
        for t in ts.iter_mut() {
            if t.0 == "blk.0.attn_k.weight" {
                t.1 = vec![E, E];
            }
        }
    })
    .unwrap_err();
    assert!(
        matches!(e, ModelError::BadShape { ref name, .. } if name == "blk.0.attn_k.weight"),
        "{e}"
    );
}

#[test]
fn heads_must_divide() {
    let e = tiny(|kv, _| kv[5].1 = Value::U32(3)).unwrap_err();
    assert!(e.to_string().contains("head_count_kv"), "{e}");
}

#[test]
fn qwen2_requires_biases() {
    let e = tiny(|kv, _| {
        for (k, v) in kv.iter_mut() {
            if k == "general.architecture" {
                *v = Value::Str("qwen2".into());
            } else if let Some(rest) = k.strip_prefix("llama.") {
                *k = format!("qwen2.{rest}");
            }
        }
    })
    .unwrap_err();
    assert!(e.to_string().contains("attn_q.bias"), "{e}");
}

/// The tiny model with a vocabulary of `V` tokens "t0".."t31" and types.
fn with_vocab(
    edit: impl Fn(&mut Vec<String>, &mut Vec<(String, Value)>, &mut Vec<(String, Vec<u64>, GgmlType)>),
) -> ModelSpecResult {
    tiny(|kv, ts| {
        let mut toks: Vec<String> = (0..V).map(|i| format!("t{i}")).collect();
        edit(&mut toks, kv, ts);
        let n = toks.len();
        kv.push((
            "tokenizer.ggml.tokens".into(),
            Value::Array(strata::gguf::Array::Str(toks)),
        ));
        kv.push((
            "tokenizer.ggml.token_type".into(),
            Value::Array(strata::gguf::Array::I32(vec![1; n.min(V as usize)])),
        ));
    })
}

#[test]
fn vocabulary_is_checked_before_libllama_sees_it() {
    with_vocab(|_, _, _| {}).expect("a valid vocabulary");
    // a duplicated token string aborted the process inside libllama
    let e = with_vocab(|t, _, _| t[30] = t[31].clone()).unwrap_err();
    assert!(
        e.to_string().contains("token 31") && e.to_string().contains("duplicates token 30"),
        "{e}"
    );
    // fewer tokens than embedding rows let a sampled id reach a C++ throw
    let e = with_vocab(|t, _, _| t.truncate(20)).unwrap_err();
    assert!(
        e.to_string()
            .contains("20 tokens but token_embd.weight has 32 rows"),
        "{e}"
    );
    // a special id that names no token
    let e = with_vocab(|_, kv, _| kv.push(("tokenizer.ggml.eos_token_id".into(), Value::U32(32))))
        .unwrap_err();
    assert!(e.to_string().contains("eos_token_id"), "{e}");
    with_vocab(|_, kv, _| kv.push(("tokenizer.ggml.eos_token_id".into(), Value::U32(31))))
        .expect("eos in range");
}

#[test]
fn block_count_below_the_layers_present_is_refused() {
    let e = tiny(|kv, _| kv[2].1 = Value::U32(1)).unwrap_err();
    assert!(
        matches!(e, ModelError::ExtraLayer { n_layer: 1, ref tensor, .. } if tensor.starts_with("blk.1.")),
        "{e}"
    );
    assert!(e.to_string().contains("llama.block_count = 1"), "{e}");
}
