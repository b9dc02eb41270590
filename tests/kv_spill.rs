//! KV spill files that cannot lie: round trips, every kind of damage the
//! format must catch (flipped bytes, truncation, trailing data, a file that
//! shrinks after open), shape mismatches, the quota as a full disk, and the
//! private spill directory's cleanup.

use std::fs;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use strata::kv::spill::{
    write_file, EntryDesc, KvFile, KvShape, Quota, SpillDir, SpillError, PAGE,
};

const SHAPE: KvShape = KvShape {
    fingerprint: 0x0123_4567_89ab_cdef,
    row_bytes: 1024,
    block_size: 32,
};

/// Bytes that differ between entries, K and V, and nearby offsets.
fn pattern(seed: u32, n: usize) -> Vec<u8> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2654435761) ^ seed.wrapping_mul(40503)) as u8)
        .collect()
}

/// Entries of several sizes: full blocks (64 KiB of K+V) and partial ones.
struct Sample {
    entries: Vec<(EntryDesc, Vec<u8>, Vec<u8>)>,
    extra: Vec<u8>,
}

impl Sample {
    fn new() -> Sample {
        let descs = [(0, 0, 32), (0, 1, 7), (1, 0, 32), (5, 3, 1), (31, 9, 20)];
        let entries = descs
            .iter()
            .enumerate()
            .map(|(i, &(layer, block, n_rows))| {
                let n = (n_rows * SHAPE.row_bytes) as usize;
                let d = EntryDesc {
                    layer,
                    block,
                    n_rows,
                };
                (d, pattern(2 * i as u32, n), pattern(2 * i as u32 + 1, n))
            })
            .collect();
        // Session-style payload: tokens then sampler state; 5000 bytes, so it
        // spans a page boundary.
        let extra = pattern(999, 5000);
        Sample { entries, extra }
    }
    fn refs(&self) -> Vec<(EntryDesc, &[u8], &[u8])> {
        self.entries
            .iter()
            .map(|(d, k, v)| (*d, k.as_slice(), v.as_slice()))
            .collect()
    }
    fn write(&self, path: &Path) -> u64 {
        write_file(path, SHAPE, &self.extra, &self.refs(), None).expect("write sample")
    }
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .expect("read dir")
        .map(|e| {
            e.expect("dir entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    v.sort();
    v
}

fn flip(path: &Path, off: u64) {
    let f = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8];
    f.read_exact_at(&mut b, off).unwrap();
    b[0] ^= 0x10;
    f.write_all_at(&b, off).unwrap();
}

fn corrupt_what(e: &SpillError) -> &str {
    match e {
        SpillError::Corrupt { what, .. } => what,
        other => panic!("expected Corrupt, got {other:?}"),
    }
}

/// Reads every entry, asserting each matches the sample.
fn assert_reads_back(f: &mut KvFile, s: &Sample) {
    assert_eq!(f.entries().len(), s.entries.len());
    for (i, (d, k, v)) in s.entries.iter().enumerate() {
        assert_eq!(f.entries()[i], *d);
        let (mut kb, mut vb) = (vec![0u8; k.len()], vec![0u8; v.len()]);
        f.read_entry(i, &mut kb, &mut vb).expect("read entry");
        assert!(kb == *k && vb == *v, "entry {i} differs");
    }
}

#[test]
fn round_trip_entries_and_extra() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("sess.kv");
    let s = Sample::new();
    let n = s.write(&path);
    assert_eq!(n, fs::metadata(&path).unwrap().len());
    assert_eq!(n % PAGE, 0);
    let mut f = KvFile::open(&path, SHAPE).unwrap();
    assert_eq!(f.extra(), s.extra.as_slice());
    assert_eq!(f.shape(), SHAPE);
    assert_eq!(f.file_len(), n);
    assert_eq!(f.find(31, 9), Some(4));
    assert_eq!(f.find(31, 8), None);
    for i in 0..s.entries.len() {
        assert_eq!(f.entry_offset(i).unwrap() % PAGE, 0);
    }
    assert_reads_back(&mut f, &s);
    // Out of order and repeated reads give the same bytes.
    let (k, v) = f.read_entry_vec(3).unwrap();
    assert_eq!((k, v), (s.entries[3].1.clone(), s.entries[3].2.clone()));
    assert_eq!(names(d.path()), vec!["sess.kv"]);
}

#[test]
fn round_trip_empty_file() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("empty.kv");
    assert_eq!(write_file(&path, SHAPE, b"", &[], None).unwrap(), PAGE);
    let f = KvFile::open(&path, SHAPE).unwrap();
    assert!(f.entries().is_empty() && f.extra().is_empty());
}

#[test]
fn overwrite_replaces_whole_file() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("sess.kv");
    let s = Sample::new();
    s.write(&path);
    let e = s.refs();
    write_file(&path, SHAPE, b"second", &e[..2], None).unwrap();
    let f = KvFile::open(&path, SHAPE).unwrap();
    assert_eq!(f.extra(), b"second");
    assert_eq!(f.entries().len(), 2);
    assert_eq!(names(d.path()), vec!["sess.kv"]);
}

#[test]
fn flipped_data_byte_names_layer_and_block() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("a.kv");
    let s = Sample::new();
    s.write(&path);
    let good = fs::read(&path).unwrap();
    let f = KvFile::open(&path, SHAPE).unwrap();
    let offsets: Vec<u64> = (0..s.entries.len())
        .map(|i| f.entry_offset(i).unwrap())
        .collect();
    drop(f);
    for (i, (desc, k, _)) in s.entries.iter().enumerate() {
        // First byte of K, last byte of K, last byte of V.
        let n = k.len() as u64;
        for off in [offsets[i], offsets[i] + n - 1, offsets[i] + 2 * n - 1] {
            fs::write(&path, &good).unwrap();
            flip(&path, off);
            let mut f = KvFile::open(&path, SHAPE).expect("header and table are intact");
            let (mut kb, mut vb) = (vec![0xAA; k.len()], vec![0xAA; k.len()]);
            let e = f.read_entry(i, &mut kb, &mut vb).unwrap_err();
            let what = corrupt_what(&e);
            assert!(
                what.contains(&format!("layer {}, block {}", desc.layer, desc.block)),
                "{e}"
            );
            assert!(e.to_string().contains("a.kv"), "{e}");
            // No unchecked byte reaches the caller.
            assert!(kb.iter().chain(&vb).all(|&b| b == 0));
            // The other entries still read back.
            for j in (0..s.entries.len()).filter(|&j| j != i) {
                let (k2, v2) = f.read_entry_vec(j).unwrap();
                assert!(k2 == s.entries[j].1 && v2 == s.entries[j].2);
            }
        }
    }
}

/// Flips each byte of `range` in turn; open must fail with Corrupt.
fn assert_flips_fail_open(range: std::ops::Range<u64>, needle: &str) {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("flip.kv");
    let s = Sample::new();
    s.write(&path);
    for off in range {
        flip(&path, off);
        let e = KvFile::open(&path, SHAPE).expect_err("open must fail");
        let what = corrupt_what(&e);
        assert!(
            what.contains(needle) || what.contains("magic"),
            "byte {off}: {e}"
        );
        assert!(e.to_string().contains("flip.kv"));
        flip(&path, off);
    }
    assert!(KvFile::open(&path, SHAPE).is_ok());
}

#[test]
fn flipped_header_byte_is_corrupt() {
    assert_flips_fail_open(0..PAGE, "header checksum");
}

#[test]
fn flipped_table_byte_is_corrupt() {
    let n = Sample::new().entries.len() as u64;
    assert_flips_fail_open(PAGE..PAGE + 16 * n, "entry table checksum");
}

#[test]
fn flipped_extra_byte_is_corrupt() {
    let s = Sample::new();
    let start = PAGE + 16 * s.entries.len() as u64;
    assert_flips_fail_open(
        start..start + s.extra.len() as u64,
        "extra payload checksum",
    );
}

#[test]
fn flipped_padding_before_data_is_corrupt() {
    let s = Sample::new();
    let end = PAGE + 16 * s.entries.len() as u64 + s.extra.len() as u64;
    assert_flips_fail_open(end..end.next_multiple_of(PAGE), "padding");
}

#[test]
fn truncation_never_returns_data() {
    let d = tempfile::tempdir().unwrap();
    let full = d.path().join("full.kv");
    let s = Sample::new();
    let len = s.write(&full);
    let good = fs::read(&full).unwrap();
    let cut_path = d.path().join("cut.kv");
    let mut cuts: Vec<u64> = (0..len).step_by(512).collect();
    cuts.extend([1, 7, PAGE - 1, PAGE + 1, len - 1]);
    for cut in cuts {
        fs::write(&cut_path, &good[..cut as usize]).unwrap();
        match KvFile::open(&cut_path, SHAPE) {
            Ok(mut f) => {
                // Never expected, but if open passes no entry may read.
                for i in 0..f.entries().len() {
                    assert!(f.read_entry_vec(i).is_err(), "cut {cut}: entry {i} read");
                }
                panic!("cut at {cut} of {len} bytes opened");
            }
            Err(e) => {
                let what = corrupt_what(&e);
                assert!(what.starts_with("truncated"), "cut {cut}: {e}");
                assert!(e.to_string().contains("cut.kv"));
            }
        }
    }
}

#[test]
fn trailing_bytes_are_corrupt() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("long.kv");
    let s = Sample::new();
    let len = s.write(&path);
    fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(len + 1)
        .unwrap();
    let e = KvFile::open(&path, SHAPE).unwrap_err();
    assert!(corrupt_what(&e).contains("trailing"), "{e}");
}

#[test]
fn file_shrinking_after_open_fails_reads() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("shrink.kv");
    let s = Sample::new();
    s.write(&path);
    let mut f = KvFile::open(&path, SHAPE).unwrap();
    let last = s.entries.len() - 1;
    let cut = f.entry_offset(last).unwrap() + 100;
    fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(cut)
        .unwrap();
    let n = s.entries[last].1.len();
    let (mut k, mut v) = (vec![0xAA; n], vec![0xAA; n]);
    let e = f.read_entry(last, &mut k, &mut v).unwrap_err();
    assert!(corrupt_what(&e).starts_with("truncated"), "{e}");
    assert!(k.iter().chain(&v).all(|&b| b == 0));
    // Entries still wholly in the file read back.
    assert!(f.read_entry_vec(0).is_ok());
}

#[test]
fn not_a_kv_file_is_corrupt() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("model.gguf");
    fs::write(&path, pattern(1, 3 * PAGE as usize)).unwrap();
    let e = KvFile::open(&path, SHAPE).unwrap_err();
    assert!(corrupt_what(&e).contains("magic"), "{e}");
}

#[test]
fn wrong_shape_is_mismatch_naming_field() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("m.kv");
    Sample::new().write(&path);
    let cases = [
        (
            KvShape {
                fingerprint: 1,
                ..SHAPE
            },
            "fingerprint",
        ),
        (
            KvShape {
                row_bytes: 512,
                ..SHAPE
            },
            "row_bytes",
        ),
        (
            KvShape {
                block_size: 64,
                ..SHAPE
            },
            "block_size",
        ),
    ];
    for (shape, field) in cases {
        match KvFile::open(&path, shape) {
            Err(SpillError::Mismatch { path: p, what }) => {
                assert!(what.starts_with(field), "{what}");
                assert_eq!(p, path);
            }
            other => panic!("{field}: expected Mismatch, got {other:?}"),
        }
    }
}

#[test]
fn read_entry_refuses_wrong_buffers() {
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("b.kv");
    let s = Sample::new();
    s.write(&path);
    let mut f = KvFile::open(&path, SHAPE).unwrap();
    let n = s.entries[0].1.len();
    let (mut k, mut v) = (vec![0u8; n], vec![0u8; n - 1]);
    assert!(matches!(
        f.read_entry(0, &mut k, &mut v),
        Err(SpillError::Invalid { .. })
    ));
    assert!(matches!(
        f.read_entry_vec(99),
        Err(SpillError::Invalid { .. })
    ));
}

#[test]
fn quota_exceeded_is_disk_full_and_touches_nothing() {
    let parent = tempfile::tempdir().unwrap();
    let s = Sample::new();
    let e = s.refs();
    // Room for one sample file and a half.
    let one = {
        let p = parent.path().join("probe.kv");
        let n = s.write(&p);
        fs::remove_file(&p).unwrap();
        n
    };
    let quota = Arc::new(Quota::new(one + one / 2));
    let dir = SpillDir::create(parent.path(), Some(quota.clone())).unwrap();
    let (kept, n) = dir.write("kept.kv", SHAPE, &s.extra, &e).unwrap();
    assert_eq!((n, quota.used()), (one, one));
    let kept_bytes = fs::read(&kept).unwrap();

    // A new file that does not fit.
    let err = dir.write("new.kv", SHAPE, &s.extra, &e).unwrap_err();
    match &err {
        SpillError::DiskFull {
            path,
            needed,
            available,
        } => {
            assert_eq!(*path, dir.path_for("new.kv"));
            assert_eq!(*needed, one);
            assert_eq!(*available, Some(one / 2));
        }
        other => panic!("expected DiskFull, got {other:?}"),
    }
    assert!(err.to_string().contains("new.kv"), "{err}");
    // Overwriting the kept file with a bigger one does not fit either.
    let err = write_file(&kept, SHAPE, &pattern(5, 1 << 20), &e, dir.quota()).unwrap_err();
    assert!(matches!(err, SpillError::DiskFull { .. }), "{err:?}");

    assert_eq!(names(dir.path()), vec!["kept.kv"]);
    assert_eq!(fs::read(&kept).unwrap(), kept_bytes);
    assert_eq!(quota.used(), one);
    let mut f = KvFile::open(&kept, SHAPE).unwrap();
    assert_reads_back(&mut f, &s);

    // After removing the kept file the new one fits.
    assert_eq!(dir.remove(&kept).unwrap(), one);
    assert_eq!(quota.used(), 0);
    dir.write("new.kv", SHAPE, &s.extra, &e).unwrap();
    assert_eq!(names(dir.path()), vec!["new.kv"]);
}

#[test]
fn write_into_missing_directory_is_io_naming_path() {
    let parent = tempfile::tempdir().unwrap();
    let path: PathBuf = parent.path().join("no/such/dir/x.kv");
    let err = write_file(&path, SHAPE, b"", &[], None).unwrap_err();
    match &err {
        SpillError::Io {
            path: p, source, ..
        } => {
            assert_eq!(*p, path);
            assert_eq!(source.kind(), std::io::ErrorKind::NotFound);
        }
        other => panic!("expected Io, got {other:?}"),
    }
    assert!(err.to_string().contains("no/such/dir/x.kv"), "{err}");

    let err = KvFile::open(&path, SHAPE).unwrap_err();
    assert!(matches!(&err, SpillError::Io { op: "open", .. }), "{err:?}");
    assert!(err.to_string().contains("x.kv"));

    let err = SpillDir::create(&parent.path().join("missing"), None).unwrap_err();
    assert!(matches!(&err, SpillError::Io { .. }), "{err:?}");
    assert!(err.to_string().contains("missing"), "{err}");
}

#[test]
fn spill_dir_drop_removes_directory_and_releases_quota() {
    let parent = tempfile::tempdir().unwrap();
    let quota = Arc::new(Quota::new(u64::MAX));
    let s = Sample::new();
    let e = s.refs();
    let a = SpillDir::create(parent.path(), Some(quota.clone())).unwrap();
    let b = SpillDir::create(parent.path(), Some(quota.clone())).unwrap();
    assert_ne!(a.path(), b.path());
    let name = a.path().file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        name.starts_with(&format!("strata-kv-{}-", std::process::id())),
        "{name}"
    );
    a.write("l0-b0.kv", SHAPE, b"", &e[..1]).unwrap();
    a.write("l0-b1.kv", SHAPE, b"", &e[1..2]).unwrap();
    let (_, nb) = b.write("l1.kv", SHAPE, b"", &e).unwrap();
    let a_path = a.path().to_path_buf();
    drop(a);
    assert!(!a_path.exists());
    assert_eq!(quota.used(), nb);
    assert!(b.path().join("l1.kv").exists());
    drop(b);
    assert_eq!(quota.used(), 0);
    assert!(names(parent.path()).is_empty());
}

#[test]
fn spill_dir_writers_on_threads_share_quota() {
    let parent = tempfile::tempdir().unwrap();
    let quota = Arc::new(Quota::new(u64::MAX));
    let dir = Arc::new(SpillDir::create(parent.path(), Some(quota.clone())).unwrap());
    let total: u64 = (0..4)
        .map(|t| {
            let dir = dir.clone();
            std::thread::spawn(move || {
                let s = Sample::new();
                let e = s.refs();
                (0..5)
                    .map(|i| {
                        let (_, n) = dir
                            .write(&format!("t{t}-{i}.kv"), SHAPE, b"x", &e[..=i % 5])
                            .unwrap();
                        n
                    })
                    .sum::<u64>()
            })
        })
        .collect::<Vec<_>>()
        .into_iter()
        .map(|h| h.join().unwrap())
        .sum();
    assert_eq!(quota.used(), total);
    assert_eq!(names(dir.path()).len(), 20);
}

#[test]
#[should_panic(expected = "spill file name")]
fn spill_dir_refuses_path_names() {
    let parent = tempfile::tempdir().unwrap();
    let dir = SpillDir::create(parent.path(), None).unwrap();
    let _ = dir.path_for("../escape.kv");
}
