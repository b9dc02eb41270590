//! `Reference::fill_kv`: llama.cpp's KV cache made to hold n cells of a
//! sequence without computing them.

mod common;

use std::path::Path;
use std::time::Instant;
use strata::llama::{LlamaError, LlamaModel, Reference, ReferenceConfig};
use strata::sys;

fn cfg(offload_kqv: bool) -> ReferenceConfig {
    ReferenceConfig {
        n_ctx: 2048,
        n_batch: 512,
        n_ubatch: 512,
        n_seq: 1,
        n_threads: 2,
        offload_kqv,
    }
}

fn pos_range(r: &Reference, seq: i32) -> (i32, i32) {
    // SAFETY: live context; its memory handle is owned by it.
    unsafe {
        let m = sys::llama_get_memory(r.raw());
        (
            sys::llama_memory_seq_pos_min(m, seq),
            sys::llama_memory_seq_pos_max(m, seq),
        )
    }
}

fn check_fill(path: &Path) {
    let lm = LlamaModel::load(path, false, 0).expect("llama.cpp loads the model");
    let tok = lm.tokenize("Hello", false, false).expect("tokenizes")[0];
    for offload in [true, false] {
        let mut r = Reference::new(&lm, &cfg(offload)).expect("llama.cpp context");

        // baseline: the token at position 0 of an empty cache
        let at0 = r.decode(&[(tok, 0, 0, true)]).expect("decode at 0");
        assert_eq!(at0.len(), lm.n_vocab() as usize);

        let t = Instant::now();
        r.fill_kv(0, 1000).expect("fill_kv");
        let dt = t.elapsed();
        eprintln!(
            "{} offload_kqv={offload}: fill_kv(0, 1000) took {:.1} ms",
            path.file_name().unwrap().to_string_lossy(),
            dt.as_secs_f64() * 1e3
        );
        assert_eq!(pos_range(&r, 0), (0, 999));
        assert_eq!(r.seq_pos_range(0), Some((0, 999)));

        let at1000 = r.decode(&[(tok, 1000, 0, true)]).expect("decode at 1000");
        assert_eq!(at1000.len(), at0.len());
        assert!(at1000.iter().all(|x| x.is_finite()), "non-finite logits");
        assert_eq!(pos_range(&r, 0), (0, 1000));
        let diff = at0
            .iter()
            .zip(&at1000)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            diff > 1e-3,
            "logits at 1000 after fill equal those at 0 (max diff {diff})"
        );

        // refilling replaces the sequence (the layout is learned once by now)
        let t = Instant::now();
        r.fill_kv(0, 1000).expect("refill");
        eprintln!(
            "{} offload_kqv={offload}: refill_kv(0, 1000) took {:.1} ms",
            path.file_name().unwrap().to_string_lossy(),
            t.elapsed().as_secs_f64() * 1e3
        );
        assert_eq!(pos_range(&r, 0), (0, 999));
        let again = r.decode(&[(tok, 1000, 0, true)]).expect("decode at 1000");
        assert_eq!(again, at1000, "a refill gives the same cache");

        // and a smaller fill works too
        r.fill_kv(0, 10).expect("refill");
        assert_eq!(pos_range(&r, 0), (0, 9));
        let at10 = r.decode(&[(tok, 10, 0, true)]).expect("decode at 10");
        assert!(at10.iter().all(|x| x.is_finite()));
    }
}

#[test]
fn fill_smollm2() {
    if let Some(p) = common::model(common::SMOLLM2) {
        check_fill(&p);
    }
}

#[test]
fn fill_qwen2() {
    if let Some(p) = common::model(common::QWEN2) {
        check_fill(&p);
    }
}

#[test]
fn fill_errors() {
    let Some(p) = common::model(common::SMOLLM2) else {
        return;
    };
    let lm = LlamaModel::load(&p, false, 0).expect("llama.cpp loads the model");
    let mut r = Reference::new(&lm, &cfg(true)).expect("llama.cpp context");

    // more cells than the context holds: an error, no crash
    match r.fill_kv(0, 4096) {
        Err(LlamaError::FillTooLarge { n: 4096, .. }) => {}
        other => panic!("expected FillTooLarge, got {other:?}"),
    }
    // a sequence the context does not have
    assert!(matches!(
        r.fill_kv(1, 10),
        Err(LlamaError::BadSeq { seq: 1, .. })
    ));

    // a state llama.cpp rejects is a typed error naming it
    r.fill_kv(0, 8).expect("fill");
    let mut st = r.seq_state(0).expect("state");
    st[0] ^= 0xff; // break the magic
    match r.set_seq_state(0, &st, "corrupted state") {
        Err(e @ LlamaError::StateRejected { .. }) => {
            assert!(e.to_string().contains("corrupted state"), "{e}");
        }
        other => panic!("expected StateRejected, got {other:?}"),
    }
    // truncated: a real state cut short
    let mut st = r.seq_state(0).expect("state");
    st.truncate(st.len() - 7);
    assert!(matches!(
        r.set_seq_state(0, &st, "truncated state"),
        Err(LlamaError::StateRejected { .. })
    ));
    // the cache still works afterwards
    r.fill_kv(0, 100).expect("fill after rejections");
    let l = r.decode(&[(1, 100, 0, true)]).expect("decode");
    assert!(l.iter().all(|x| x.is_finite()));
}
