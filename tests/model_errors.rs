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
        matches!(e, ModelError::UnknownArch { ref name, ref supported } if name == "mamba" && supported.contains("gemma3")),
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

/// The tiny model with a mixture of 4 experts (2 used) in each FFN.
fn tiny_moe(
    edit: impl Fn(&mut Vec<(String, Value)>, &mut Vec<(String, Vec<u64>, GgmlType)>),
) -> ModelSpecResult {
    tiny(|kv, ts| {
        kv.push(("llama.expert_count".into(), Value::U32(4)));
        kv.push(("llama.expert_used_count".into(), Value::U32(2)));
        ts.retain(|(n, _, _)| {
            !n.contains("ffn_gate.") && !n.contains("ffn_up.") && !n.contains("ffn_down.")
        });
        for l in 0..2 {
            for (n, s) in [
                ("ffn_gate_inp.weight", vec![E, 4]),
                ("ffn_gate_exps.weight", vec![E, FF, 4]),
                ("ffn_up_exps.weight", vec![E, FF, 4]),
                ("ffn_down_exps.weight", vec![FF, E, 4]),
            ] {
                ts.push((format!("blk.{l}.{n}"), s, GgmlType::F32));
            }
        }
        edit(kv, ts);
    })
}

fn set(kv: &mut [(String, Value)], key: &str, v: Value) {
    kv.iter_mut().find(|(k, _)| k == key).expect("key").1 = v;
}

#[test]
fn mixture_of_experts_is_read_and_checked() {
    let spec = tiny_moe(|_, _| {}).expect("a valid Mixtral-style file");
    assert_eq!(
        (spec.hp.n_expert, spec.hp.n_expert_used, spec.hp.n_ff_exp),
        (4, 2, FF as u32)
    );
    let ffn = &spec.groups[1];
    assert_eq!(ffn.weights.len(), 5);
    assert_eq!(ffn.weights[2].ne, [E as i64, FF as i64, 4, 1]);

    let err = |e: ModelSpecResult| e.expect_err("refused").to_string();
    // used experts out of range
    let e = err(tiny_moe(|kv, _| {
        set(kv, "llama.expert_used_count", Value::U32(5))
    }));
    assert!(e.contains("expert_used_count"), "{e}");
    let e = err(tiny_moe(|kv, _| {
        set(kv, "llama.expert_used_count", Value::U32(0))
    }));
    assert!(e.contains("expert_used_count"), "{e}");
    // the count disagrees with the tensors
    let e = err(tiny_moe(|kv, _| {
        set(kv, "llama.expert_count", Value::U32(8))
    }));
    assert!(e.contains("ffn_gate_inp"), "{e}");
    // experts without a count: refused by tensor name
    let e = err(tiny_moe(|kv, _| {
        kv.retain(|(k, _)| !k.starts_with("llama.expert"))
    }));
    assert!(
        e.contains("ffn_gate_inp") && e.contains("mixture of experts"),
        "{e}"
    );
    // routing strata does not compute, by key
    for (key, v, says) in [
        ("llama.expert_shared_count", Value::U32(1), "shared experts"),
        ("llama.expert_group_count", Value::U32(4), "grouped"),
        ("llama.expert_gating_func", Value::U32(2), "softmax"),
        (
            "llama.expert_weights_norm",
            Value::Bool(false),
            "renormalized",
        ),
        ("llama.expert_weights_scale", Value::F32(2.5), "scaled"),
    ] {
        let e = err(tiny_moe(|kv, _| kv.push((key.into(), v.clone()))));
        assert!(e.contains(key) && e.contains(says), "{key}: {e}");
    }
    // the values these architectures compute are accepted
    for (key, v) in [
        ("llama.expert_gating_func", Value::U32(1)),
        ("llama.expert_weights_norm", Value::Bool(true)),
        ("llama.expert_weights_scale", Value::F32(1.0)),
        ("llama.expert_shared_count", Value::U32(0)),
    ] {
        tiny_moe(|kv, _| kv.push((key.into(), v.clone()))).expect(key);
    }
    // one tensor per expert (old Mixtral conversions): named, with the fix
    let e = err(tiny_moe(|_, ts| {
        ts.push(("blk.0.ffn_gate.3.weight".into(), vec![E, FF], GgmlType::F32))
    }));
    assert!(
        e.contains("blk.0.ffn_gate.3.weight") && e.contains("one tensor per expert"),
        "{e}"
    );
    // a dense FFN tensor beside the experts is not silently ignored
    let e = err(tiny_moe(|_, ts| {
        ts.push(("blk.1.ffn_up.weight".into(), vec![E, FF], GgmlType::F32))
    }));
    assert!(e.contains("blk.1.ffn_up.weight"), "{e}");
}
