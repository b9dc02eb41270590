//! GGUF reader against valid, hand-broken and randomly mutated files.
//!
//! Each malformed case is built byte by byte (`Raw`) so that exactly one
//! rule is broken, and must produce its own error variant. Valid files come
//! from `GgufWriter` and are cross-checked against ggml's own GGUF loader
//! through FFI, as are the real models when present in
//! ~/.cache/strata/models (skipped with a message otherwise).

use proptest::prelude::*;
use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};
use strata::gguf::{Array, GgmlType, GgufError, GgufFile, GgufWriter, Value};

fn parse(b: &[u8]) -> Result<GgufFile, GgufError> {
    GgufFile::parse(b, b.len() as u64)
}

/// A GGUF file assembled by hand, little-endian.
struct Raw(Vec<u8>);

impl Raw {
    fn header(version: u32, n_tensors: u64, n_kv: u64) -> Raw {
        Raw(b"GGUF".to_vec()).u32(version).u64(n_tensors).u64(n_kv)
    }
    fn u32(mut self, x: u32) -> Raw {
        self.0.extend(x.to_le_bytes());
        self
    }
    fn u64(mut self, x: u64) -> Raw {
        self.0.extend(x.to_le_bytes());
        self
    }
    fn str(mut self, s: &[u8]) -> Raw {
        self.0.extend((s.len() as u64).to_le_bytes());
        self.0.extend(s);
        self
    }
    fn kv_u32(self, key: &str, v: u32) -> Raw {
        self.str(key.as_bytes()).u32(4).u32(v)
    }
    fn tensor(self, name: &str, ne: &[u64], ty: u32, rel_offset: u64) -> Raw {
        let mut r = self.str(name.as_bytes()).u32(ne.len() as u32);
        for &d in ne {
            r = r.u64(d);
        }
        r.u32(ty).u64(rel_offset)
    }
    /// Pads to `align` and appends `data` zero bytes of tensor data.
    fn data(mut self, align: usize, data: usize) -> Vec<u8> {
        let n = self.0.len().next_multiple_of(align) + data;
        self.0.resize(n, 0);
        self.0
    }
}

/// One tensor in a file with the default alignment and `data` bytes of data.
fn one_tensor(ne: &[u64], ty: u32, rel: u64, data: usize) -> Result<GgufFile, GgufError> {
    parse(&Raw::header(3, 1, 0).tensor("t", ne, ty, rel).data(32, data))
}

fn every_value() -> Vec<(&'static str, Value)> {
    let s = |x: &str| x.to_string();
    vec![
        ("general.architecture", Value::Str(s("llama"))),
        ("v.u8", Value::U8(200)),
        ("v.i8", Value::I8(-100)),
        ("v.u16", Value::U16(60000)),
        ("v.i16", Value::I16(-30000)),
        ("v.u32", Value::U32(4_000_000_000)),
        ("v.i32", Value::I32(-2_000_000_000)),
        ("v.f32", Value::F32(1.5e-5)),
        ("v.bool", Value::Bool(true)),
        ("v.str.empty", Value::Str(String::new())),
        ("v.str.utf8", Value::Str(s("héllo ▁world 🦀"))),
        ("v.u64", Value::U64(u64::MAX)),
        ("v.i64", Value::I64(i64::MIN)),
        ("v.f64", Value::F64(-2.5e300)),
        ("a.u8", Value::Array(Array::U8(vec![0, 1, 255]))),
        ("a.i8", Value::Array(Array::I8(vec![-128, 127]))),
        ("a.u16", Value::Array(Array::U16(vec![1, 65535]))),
        ("a.i16", Value::Array(Array::I16(vec![-1, 2]))),
        ("a.u32", Value::Array(Array::U32(vec![7, 8, 9]))),
        ("a.i32", Value::Array(Array::I32(vec![-1, 0, 1]))),
        ("a.f32", Value::Array(Array::F32(vec![0.25, -1.0]))),
        ("a.bool", Value::Array(Array::Bool(vec![true, false, true]))),
        (
            "a.str",
            Value::Array(Array::Str(vec![s("<s>"), s(""), s("▁the")])),
        ),
        ("a.u64", Value::Array(Array::U64(vec![u64::MAX]))),
        ("a.i64", Value::Array(Array::I64(vec![i64::MIN, 5]))),
        ("a.f64", Value::Array(Array::F64(vec![1e-300]))),
        ("a.empty", Value::Array(Array::F32(vec![]))),
        (
            "a.nested",
            Value::Array(Array::Nested(vec![
                Array::U8(vec![1]),
                Array::Str(vec![s("x")]),
            ])),
        ),
    ]
}

/// (name, ne, type): a mix of plain, legacy-quant and k-quant tensors.
const TENSORS: &[(&str, &[u64], GgmlType)] = &[
    ("token_embd.weight", &[64, 3], GgmlType::Q4_0),
    ("blk.0.attn_norm.weight", &[5], GgmlType::F32),
    ("blk.0.ffn_down.weight", &[256, 2, 2], GgmlType::Q4_K),
    ("blk.0.ffn_up.weight", &[256, 1, 1, 2], GgmlType::Q6_K),
    ("output.weight", &[3, 2], GgmlType::F16),
];

fn pattern(seed: usize, n: u64) -> Vec<u8> {
    (0..n).map(|i| (i as usize * 31 + seed * 7) as u8).collect()
}

fn writer(alignment: u64, with_nested: bool) -> GgufWriter {
    let mut w = GgufWriter::new(alignment);
    for (k, v) in every_value() {
        if with_nested || k != "a.nested" {
            w.set(k, v);
        }
    }
    for (i, &(name, ne, ty)) in TENSORS.iter().enumerate() {
        let n: u64 = ne[1..].iter().product::<u64>() * ty.row_bytes(ne[0]).expect("whole blocks");
        w.add_tensor(name, ne, ty, pattern(i, n))
            .expect("valid tensor");
    }
    w
}

fn valid_small() -> Vec<u8> {
    let mut out = Vec::new();
    writer(32, true).write_to(&mut out).expect("write");
    out
}

#[test]
fn round_trip_every_value_type_and_tensors() {
    for alignment in [32, 64, 4096] {
        let mut out = Vec::new();
        writer(alignment, true).write_to(&mut out).expect("write");
        let f = parse(&out).expect("parse own output");
        assert_eq!((f.version, f.alignment), (3, alignment));
        assert_eq!(f.data_offset % alignment, 0);
        let mut expect: Vec<(String, Value)> = every_value()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect();
        if alignment != 32 {
            expect.push(("general.alignment".into(), Value::U32(alignment as u32)));
        }
        assert_eq!(f.metadata, expect);
        assert_eq!(f.get_str("general.architecture").ok(), Some("llama"));
        assert_eq!(f.tensors.len(), TENSORS.len());
        for (i, &(name, ne, ty)) in TENSORS.iter().enumerate() {
            let t = f.require_tensor(name).expect("tensor present");
            assert_eq!((t.ne.as_slice(), t.ty), (ne, ty));
            assert_eq!(t.offset % alignment, 0);
            let bytes = &out[t.offset as usize..(t.offset + t.size) as usize];
            assert_eq!(bytes, pattern(i, t.size), "data of {name}");
        }
    }
}

#[test]
fn write_file_is_atomic_and_opens() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("m.gguf");
    writer(4096, true).write_file(&path).expect("write_file");
    let f = GgufFile::open(&path).expect("open");
    assert_eq!(f.tensors.len(), TENSORS.len());
    assert_eq!(f.file_size, std::fs::metadata(&path).expect("stat").len());
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .expect("ls")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert_eq!(
        names,
        vec![std::ffi::OsString::from("m.gguf")],
        "no temp file left"
    );
    let missing = GgufFile::open(&dir.path().join("nope.gguf"));
    assert!(matches!(missing, Err(GgufError::Io { .. })));
}

#[test]
fn every_truncation_is_an_error() {
    let full = valid_small();
    let f = parse(&full).expect("parse");
    let data_end = f
        .tensors
        .iter()
        .map(|t| t.offset + t.size)
        .max()
        .expect("tensors");
    assert!(data_end < full.len() as u64, "the last tensor is padded");
    for cut in 0..full.len() {
        // Cutting into the trailing padding loses nothing; any other cut must fail.
        let r = parse(&full[..cut]);
        assert_eq!(
            r.is_ok(),
            cut as u64 >= data_end,
            "cut at {cut} of {}: {r:?}",
            full.len()
        );
    }
    // With the true file size but a reader that ends early, the header is all
    // that is read: every cut before its end fails, every cut after it parses.
    let header_end = (0..full.len())
        .find(|&cut| GgufFile::parse(&full[..cut], full.len() as u64).is_ok())
        .expect("the whole file parses") as u64;
    assert!(header_end <= f.data_offset && header_end + f.alignment > f.data_offset);
    for cut in header_end as usize..full.len() {
        assert!(
            GgufFile::parse(&full[..cut], full.len() as u64).is_ok(),
            "short reader at {cut}"
        );
    }
    assert!(matches!(
        parse(&full[..2]),
        Err(GgufError::Truncated { offset: 0, .. })
    ));
    assert!(matches!(
        parse(&full[..6]),
        Err(GgufError::Truncated { offset: 4, .. })
    ));
    // A cut inside the data section: the header is whole, the last tensor is not.
    let r = parse(&full[..data_end as usize - 1]);
    assert!(matches!(r, Err(GgufError::DataOutOfRange { .. })), "{r:?}");
}

#[test]
fn bad_magic_and_version() {
    let mut b = valid_small();
    b[..4].copy_from_slice(b"GGML");
    assert!(matches!(parse(&b), Err(GgufError::BadMagic { found }) if &found == b"GGML"));
    for v in [0, 1, 4, 0x0300_0000] {
        let b = Raw::header(v, 0, 0).0;
        assert!(matches!(parse(&b), Err(GgufError::UnsupportedVersion(x)) if x == v));
    }
    let f = parse(&Raw::header(2, 0, 0).0).expect("v2 is supported");
    assert_eq!((f.version, f.alignment, f.data_offset), (2, 32, 32));
}

#[test]
fn getter_type_errors() {
    let f = parse(&valid_small()).expect("parse");
    let e = f.get_u32("general.architecture");
    assert!(
        matches!(
            e,
            Err(GgufError::WrongType {
                expected: "u32",
                found: "str",
                ..
            })
        ),
        "{e:?}"
    );
    assert!(matches!(
        f.get_str("v.u32"),
        Err(GgufError::WrongType { found: "u32", .. })
    ));
    assert!(matches!(
        f.get_f32("v.bool"),
        Err(GgufError::WrongType { .. })
    ));
    assert!(matches!(
        f.get_str_array("a.i32"),
        Err(GgufError::WrongType { .. })
    ));
    assert!(matches!(
        f.get_u32("v.i32"),
        Err(GgufError::OutOfRange { .. })
    ));
    assert!(matches!(f.get_u32("nope"), Err(GgufError::MissingKey(k)) if k == "nope"));
    assert!(matches!(f.get_str("nope"), Err(GgufError::MissingKey(_))));
    assert!(matches!(
        f.require_tensor("nope"),
        Err(GgufError::MissingTensor(_))
    ));
    assert_eq!(f.get_u32("v.u16").ok(), Some(60000));
    assert_eq!(f.get_i32_array("a.i32").ok(), Some(&[-1, 0, 1][..]));
}

#[test]
fn huge_counts_fail_fast() {
    let kib = |r: Raw| {
        let mut b = r.0;
        b.resize(1024, 0);
        b
    };
    // String length 2^62 in a 1 KB file.
    let b = kib(Raw::header(3, 0, 1).u64(1 << 62));
    assert!(matches!(parse(&b), Err(GgufError::TooLarge { count, .. }) if count == 1 << 62));
    // Array of 2^60 u32.
    let b = kib(Raw::header(3, 0, 1).str(b"k").u32(9).u32(4).u64(1 << 60));
    assert!(matches!(parse(&b), Err(GgufError::TooLarge { count, .. }) if count == 1 << 60));
    // Array of 2^40 strings: bounded by 8 bytes per length prefix.
    let b = kib(Raw::header(3, 0, 1).str(b"k").u32(9).u32(8).u64(1 << 40));
    assert!(matches!(parse(&b), Err(GgufError::TooLarge { .. })));
    // 2^60 tensors, 2^60 keys.
    assert!(matches!(
        parse(&kib(Raw::header(3, 1 << 60, 0))),
        Err(GgufError::TooLarge { .. })
    ));
    assert!(matches!(
        parse(&kib(Raw::header(3, 0, 1 << 60))),
        Err(GgufError::TooLarge { .. })
    ));
    // Even when the caller overstates the file size, the 1 GiB caps hold.
    let b = Raw::header(3, 0, 1).u64(1 << 62).0;
    let r = GgufFile::parse(&b[..], u64::MAX);
    assert!(matches!(r, Err(GgufError::TooLarge { .. })), "{r:?}");
}

#[test]
fn metadata_rules() {
    let dup = Raw::header(3, 0, 2).kv_u32("a", 1).kv_u32("a", 2).0;
    assert!(matches!(parse(&dup), Err(GgufError::DuplicateKey(k)) if k == "a"));
    let empty = Raw::header(3, 0, 1).kv_u32("", 1).0;
    assert!(matches!(
        parse(&empty),
        Err(GgufError::EmptyKey { index: 0, .. })
    ));
    let utf8 = Raw::header(3, 0, 1).str(b"\xff\xfe").u32(4).u32(1).0;
    assert!(matches!(
        parse(&utf8),
        Err(GgufError::InvalidUtf8 { offset: 32, .. })
    ));
    let bad_ty = Raw::header(3, 0, 1).str(b"k").u32(13).u32(0).0;
    assert!(matches!(
        parse(&bad_ty),
        Err(GgufError::UnknownValueType { type_id: 13, .. })
    ));
    let bad_elem = Raw::header(3, 0, 1).str(b"k").u32(9).u32(77).u64(0).0;
    assert!(matches!(
        parse(&bad_elem),
        Err(GgufError::UnknownValueType { type_id: 77, .. })
    ));
    // Arrays of arrays nested 20 deep: refused at a fixed depth, no stack blow-up.
    let mut deep = Raw::header(3, 0, 1).str(b"k").u32(9);
    for _ in 0..20 {
        deep = deep.u32(9).u64(1);
    }
    let mut deep = deep.0;
    deep.resize(deep.len() + 64, 0);
    assert!(matches!(parse(&deep), Err(GgufError::NestedTooDeep { .. })));
}

#[test]
fn alignment_rules() {
    for a in [0, 3, 48] {
        let b = Raw::header(3, 0, 1).kv_u32("general.alignment", a).0;
        assert!(matches!(parse(&b), Err(GgufError::BadAlignment(x)) if x == u64::from(a)));
    }
    let b = Raw::header(3, 0, 1)
        .str(b"general.alignment")
        .u32(10)
        .u64(64)
        .0;
    let r = parse(&b);
    assert!(
        matches!(
            r,
            Err(GgufError::WrongType {
                expected: "u32",
                found: "u64",
                ..
            })
        ),
        "{r:?}"
    );
    let b = Raw::header(3, 1, 1)
        .kv_u32("general.alignment", 64)
        .tensor("t", &[4], 0, 0)
        .data(64, 16);
    let f = parse(&b).expect("aligned to 64");
    assert_eq!(
        (f.alignment, f.data_offset, f.tensors[0].offset),
        (64, 128, 128)
    );
}

#[test]
fn tensor_shape_rules() {
    let q4_0 = GgmlType::Q4_0.0;
    let r = one_tensor(&[8], 4, 0, 64);
    assert!(
        matches!(r, Err(GgufError::UnknownTensorType { type_id: 4, .. })),
        "{r:?}"
    );
    assert!(matches!(
        one_tensor(&[8], 1000, 0, 64),
        Err(GgufError::UnknownTensorType { .. })
    ));
    assert!(matches!(
        one_tensor(&[33], q4_0, 0, 64),
        Err(GgufError::BadShape { .. })
    ));
    assert!(matches!(
        one_tensor(&[8, 0], 0, 0, 64),
        Err(GgufError::BadShape { .. })
    ));
    assert!(matches!(
        one_tensor(&[1, 1, 1, 1, 1], 0, 0, 64),
        Err(GgufError::BadShape { .. })
    ));
    assert!(matches!(
        one_tensor(&[], 0, 0, 64),
        Err(GgufError::BadShape { .. })
    ));
    assert!(matches!(
        one_tensor(&[u64::MAX], 0, 0, 64),
        Err(GgufError::BadShape { .. })
    ));
    let r = one_tensor(&[1 << 32, 1 << 32], 0, 0, 64);
    assert!(
        matches!(r, Err(GgufError::BadShape { .. })),
        "element count overflow: {r:?}"
    );
    let f = one_tensor(&[32, 2], q4_0, 0, 36).expect("valid q4_0");
    assert_eq!((f.tensors[0].size, f.tensors[0].ne4()), (36, [32, 2, 1, 1]));
    let long = "x".repeat(64);
    let b = Raw::header(3, 1, 0).tensor(&long, &[1], 0, 0).data(32, 4);
    assert!(matches!(
        parse(&b),
        Err(GgufError::TensorNameTooLong { len: 64, .. })
    ));
    let b = Raw::header(3, 2, 0)
        .tensor("t", &[1], 0, 0)
        .tensor("t", &[1], 0, 32)
        .data(32, 64);
    assert!(matches!(parse(&b), Err(GgufError::DuplicateTensor(n)) if n == "t"));
}

#[test]
fn tensor_placement_rules() {
    // F32 [8] = 32 bytes.
    let r = one_tensor(&[8], 0, 0, 31);
    assert!(
        matches!(r, Err(GgufError::DataOutOfRange { size: 32, .. })),
        "{r:?}"
    );
    let r = one_tensor(&[8], 0, 1 << 40, 64);
    assert!(matches!(r, Err(GgufError::DataOutOfRange { .. })), "{r:?}");
    let r = one_tensor(&[8], 0, u64::MAX - 31, 64);
    assert!(
        matches!(r, Err(GgufError::DataOutOfRange { .. })),
        "offset overflow: {r:?}"
    );
    let r = one_tensor(&[8], 0, 4, 64);
    assert!(
        matches!(
            r,
            Err(GgufError::Misaligned {
                offset: 4,
                alignment: 32,
                ..
            })
        ),
        "{r:?}"
    );
    // a: F32 [16] = 64 bytes at 0; b: 32 bytes at 32.
    let b = Raw::header(3, 2, 0)
        .tensor("a", &[16], 0, 0)
        .tensor("b", &[8], 0, 32)
        .data(32, 96);
    let r = parse(&b);
    assert!(
        matches!(&r, Err(GgufError::Overlap { a, b }) if a == "a" && b == "b"),
        "{r:?}"
    );
    // Out of file order but disjoint, with a gap: allowed.
    let b = Raw::header(3, 2, 0)
        .tensor("a", &[8], 0, 64)
        .tensor("b", &[8], 0, 0)
        .data(32, 96);
    let f = parse(&b).expect("disjoint tensors");
    assert_eq!(f.tensors[0].offset, f.data_offset + 64);
}

/// (name, offset relative to the data section, size, ggml type id).
type TensorRow = (String, u64, u64, u32);

/// Data offset and tensor rows as ggml's own loader sees the file.
fn ggml_view(path: &Path) -> Option<(u64, Vec<TensorRow>)> {
    let c = CString::new(path.to_str()?).ok()?;
    let params = strata::sys::gguf_init_params {
        no_alloc: true,
        ctx: std::ptr::null_mut(),
    };
    // SAFETY: c is a valid C string; ctx is checked for null and freed once;
    // tensor ids are below gguf_get_n_tensors; names are NUL-terminated.
    unsafe {
        let ctx = strata::sys::gguf_init_from_file(c.as_ptr(), params);
        if ctx.is_null() {
            return None;
        }
        let data = strata::sys::gguf_get_data_offset(ctx) as u64;
        let n = strata::sys::gguf_get_n_tensors(ctx);
        let tensors = (0..n)
            .map(|i| {
                let name = CStr::from_ptr(strata::sys::gguf_get_tensor_name(ctx, i));
                let off = strata::sys::gguf_get_tensor_offset(ctx, i) as u64;
                let size = strata::sys::gguf_get_tensor_size(ctx, i) as u64;
                let ty = strata::sys::gguf_get_tensor_type(ctx, i);
                (name.to_string_lossy().into_owned(), off, size, ty)
            })
            .collect();
        strata::sys::gguf_free(ctx);
        Some((data, tensors))
    }
}

fn assert_agrees_with_ggml(path: &Path, f: &GgufFile) {
    let (data, ts) = ggml_view(path).expect("ggml loads the file");
    assert_eq!(data, f.data_offset, "data offset");
    let ours: Vec<_> = f
        .tensors
        .iter()
        .map(|t| (t.name.clone(), t.offset - data, t.size, t.ty.0))
        .collect();
    assert_eq!(ours, ts);
}

#[test]
fn writer_output_loads_in_ggml() {
    let dir = tempfile::tempdir().expect("tempdir");
    for alignment in [32, 4096] {
        let path = dir.path().join(format!("w{alignment}.gguf"));
        // ggml refuses nested arrays, so leave them out here.
        writer(alignment, false).write_file(&path).expect("write");
        assert_agrees_with_ggml(&path, &GgufFile::open(&path).expect("open"));
    }
}

fn models_dir() -> PathBuf {
    let home = std::env::var_os("HOME").unwrap_or_default();
    PathBuf::from(home).join(".cache/strata/models")
}

#[test]
fn real_models_parse() {
    let cases = [
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "llama"),
        ("Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf", "qwen2"),
    ];
    for (file, arch) in cases {
        let path = models_dir().join(file);
        if !path.exists() {
            eprintln!(
                "skipping: {} not present (run tools/fetch-models.sh)",
                path.display()
            );
            continue;
        }
        let f = GgufFile::open(&path).expect("real model parses");
        assert_eq!(f.get_str("general.architecture").ok(), Some(arch));
        assert!(!f.tensors.is_empty());
        for t in &f.tensors {
            assert!(
                t.offset >= f.data_offset && t.offset + t.size <= f.file_size,
                "{}",
                t.name
            );
        }
        let n_vocab = f
            .get_str_array("tokenizer.ggml.tokens")
            .expect("vocab")
            .len();
        let n_layer = f
            .get_u32(&format!("{arch}.block_count"))
            .expect("block_count");
        assert!(n_vocab > 1000 && n_layer > 0);
        f.require_tensor("token_embd.weight").expect("embeddings");
        assert_agrees_with_ggml(&path, &f);
        eprintln!(
            "{file}: v{} {} tensors, {n_layer} layers, vocab {n_vocab}",
            f.version,
            f.tensors.len()
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    /// Random byte edits and cuts never panic, and whatever parses still
    /// satisfies the invariants callers rely on.
    #[test]
    fn mutations_never_panic(
        edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
        do_cut in any::<bool>(),
    ) {
        let mut b = valid_small();
        // Edit the header only: tensor data bytes are never interpreted.
        let header_len = parse(&b).map_or(b.len(), |f| f.data_offset as usize);
        for (i, x) in &edits {
            let i = i.index(header_len);
            b[i] = *x;
        }
        if do_cut {
            b.truncate(cut.index(b.len()));
        }
        if let Ok(f) = parse(&b) {
            let mut spans: Vec<(u64, u64)> = f.tensors.iter().map(|t| (t.offset, t.offset + t.size)).collect();
            spans.sort();
            for (s, e) in &spans {
                prop_assert!(*s >= f.data_offset && e <= &f.file_size && s % f.alignment == 0);
            }
            for w in spans.windows(2) {
                prop_assert!(w[0].1 <= w[1].0);
            }
        }
    }
}
