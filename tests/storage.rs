//! The SSD-tier reader on real files: every backend returns the file's
//! bytes for aligned and unaligned extents, rejects bad requests without
//! stopping, and stops cleanly when the file is truncated or deleted.
//! Fault injection lives in tests/storage_faults.rs.

mod storage_util;

use proptest::prelude::*;
use std::time::Duration;
use storage_util::*;
use strata::storage::{
    sequential_read, AlignedBuf, AlignedWindow, ExtentReader, IoBackend, ReadRequest, Reader,
    ReaderConfig, RegisteredRegion, StorageError,
};

const SIZE: u64 = (3 << 20) + 123;

#[test]
fn extents_match_the_file_on_every_backend() {
    let (_d, path) = pattern_file(SIZE);
    let cases = [
        (0, 4096),
        (0, SIZE),
        (1, 1),
        (4095, 2),
        (100_000, 300_000),
        (65_536 - 7, 65_536 * 3 + 11),
        (SIZE - 10, 10),
        (SIZE - 1, 1),
        (SIZE, 0),
        (12_345, 0),
    ];
    for backend in backends(&path) {
        // direct: false is the path taken where O_DIRECT is refused.
        for direct in [true, false] {
            let cfg = ReaderConfig {
                direct,
                ..small_cfg(backend)
            };
            let r = Reader::open(&path, cfg).unwrap();
            assert_eq!(r.backend(), backend);
            if direct {
                direct_or_skip(&r);
            } else {
                assert!(!r.is_direct());
            }
            for &(off, len) in &cases {
                let got = read_one(&r, off, len).unwrap();
                assert!(got == expected(off, len), "{backend:?} {off}+{len}");
            }
        }
    }
}

#[test]
fn several_extents_share_one_buffer() {
    let (_d, path) = pattern_file(SIZE);
    for backend in backends(&path) {
        let r = Reader::open(&path, small_cfg(backend)).unwrap();
        let wanted = [(7u64, 70_000u64), (1 << 20, 4096), (2_000_001, 999_999)];
        let mut reqs = Vec::new();
        let mut at = 0usize;
        for &(off, len) in &wanted {
            reqs.push(ReadRequest {
                file_offset: off,
                len,
                buf_offset: at,
            });
            at += AlignedWindow::covering(off, len).unwrap().len as usize;
        }
        let done = r.submit(AlignedBuf::new(at).unwrap(), &reqs).unwrap();
        let done = done.wait().unwrap();
        for (i, &(off, len)) in wanted.iter().enumerate() {
            assert!(
                done.data(i) == expected(off, len),
                "{backend:?} request {i}"
            );
        }
    }
}

#[test]
fn read_exact_at_fills_an_unaligned_slice() {
    let (_d, path) = pattern_file(SIZE);
    let r = Reader::open(&path, ReaderConfig::default()).unwrap();
    let mut dst = vec![0u8; 10_001];
    r.read_exact_at(77_777, &mut dst[1..]).unwrap();
    assert!(dst[1..] == expected(77_777, 10_000)[..]);
}

#[test]
fn registered_region_views_read_correctly() {
    let (_d, path) = pattern_file(SIZE);
    let mut region = AlignedBuf::new(4 << 20).unwrap();
    let mut cfg = small_cfg(IoBackend::Auto);
    // SAFETY: region is declared before the reader and outlives it.
    cfg.registered
        .push(unsafe { RegisteredRegion::of(&mut region) });
    let base = region.as_mut_ptr();
    let r = Reader::open(&path, cfg).unwrap();
    // SAFETY: the second MiB of region, used only through this view.
    let view = unsafe { AlignedBuf::from_raw(base.wrapping_add(1 << 20), 1 << 20) }.unwrap();
    let req = ReadRequest {
        file_offset: 5000,
        len: 1_000_000,
        buf_offset: 0,
    };
    let done = r.submit(view, &[req]).unwrap().wait().unwrap();
    assert!(done.data(0) == expected(5000, 1_000_000));
    let stats = r.stats();
    if r.backend() == IoBackend::IoUring {
        // Every chunk lies inside the region: all reads use the fixed buffer.
        assert_eq!(stats.fixed_ops, stats.ops, "{stats:?}");
    }
    assert!(stats.bytes >= 1_000_000, "{stats:?}");
    drop(done);
    drop(r);
    let inner = 5000 % 4096;
    assert_eq!(region[(1 << 20) + inner], storage_util::byte_at(5000));
}

#[test]
fn bad_requests_are_refused_and_the_reader_goes_on() {
    let (_d, path) = pattern_file(SIZE);
    let r = Reader::open(&path, small_cfg(IoBackend::Auto)).unwrap();
    let req = |file_offset, len, buf_offset| ReadRequest {
        file_offset,
        len,
        buf_offset,
    };
    let buf = || AlignedBuf::new(1 << 20).unwrap();
    let err = r.submit(buf(), &[req(SIZE - 5, 6, 0)]).unwrap_err();
    assert!(matches!(err, StorageError::OutOfRange { .. }), "{err}");
    assert!(err.to_string().contains("model.bin"), "{err}");
    let err = r.submit(buf(), &[req(0, 10, 100)]).unwrap_err();
    assert!(matches!(err, StorageError::BadDestination(_)), "{err}");
    let err = r.submit(buf(), &[req(0, 2 << 20, 0)]).unwrap_err();
    assert!(matches!(err, StorageError::BadDestination(_)), "{err}");
    let err = r
        .submit(buf(), &[req(0, 8192, 0), req(0, 10, 4096)])
        .unwrap_err();
    assert!(err.to_string().contains("overlap"), "{err}");
    let err = r.submit(buf(), &[req(u64::MAX - 1, 10, 0)]).unwrap_err();
    assert!(matches!(err, StorageError::OutOfRange { .. }), "{err}");
    assert!(r.stop_cause().is_none());
    assert!(read_one(&r, 10, 10).unwrap() == expected(10, 10));
}

#[test]
fn a_missing_file_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("nope.gguf");
    let err = Reader::open(&path, ReaderConfig::default()).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, StorageError::Open { .. }), "{msg}");
    assert!(
        msg.contains("nope.gguf") && msg.contains("No such file"),
        "{msg}"
    );
}

#[test]
fn a_file_truncated_after_open_stops_the_reader() {
    let (_d, path) = pattern_file(SIZE);
    for backend in backends(&path) {
        std::fs::write(&path, expected(0, SIZE)).unwrap();
        let r = Reader::open(&path, small_cfg(backend)).unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(1 << 20)
            .unwrap();
        let err = read_one(&r, 2 << 20, 100_000).unwrap_err();
        let msg = err.to_string();
        match err {
            StorageError::Truncated {
                offset,
                size_at_open,
                size_now,
                ..
            } => {
                // Chunks run in parallel: any of them may hit the end first.
                assert!((2 << 20..(2 << 20) + 100_000).contains(&offset), "{offset}");
                assert_eq!((size_at_open, size_now), (SIZE, 1 << 20));
            }
            e => panic!("{backend:?}: expected Truncated, got {e}"),
        }
        assert!(msg.contains("model.bin") && msg.contains("shrank"), "{msg}");
        assert!(workers_exit(&r), "{backend:?}: workers still running");
        let again = read_one(&r, 0, 10).unwrap_err();
        assert!(again.to_string().contains("shrank"), "{again}");
    }
}

#[test]
fn restat_catches_truncation_and_deletion_before_reading() {
    let (_d, path) = pattern_file(SIZE);
    let cfg = || ReaderConfig {
        restat_every: Some(Duration::ZERO),
        ..small_cfg(IoBackend::Auto)
    };
    let r = Reader::open(&path, cfg()).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(5000)
        .unwrap();
    let err = read_one(&r, 0, 100).unwrap_err();
    assert!(matches!(err, StorageError::Changed { .. }), "{err}");
    assert!(
        err.to_string().contains(&format!("size {SIZE} -> 5000")),
        "{err}"
    );

    std::fs::write(&path, expected(0, SIZE)).unwrap();
    let r = Reader::open(&path, cfg()).unwrap();
    assert!(read_one(&r, 0, 100).is_ok());
    std::fs::remove_file(&path).unwrap();
    let err = read_one(&r, 0, 100).unwrap_err();
    assert!(matches!(err, StorageError::Missing { .. }), "{err}");
    assert!(err.to_string().contains("deleted"), "{err}");
    assert!(workers_exit(&r));
}

#[test]
fn without_restat_a_deleted_file_still_reads_its_old_bytes() {
    // The open descriptor keeps the inode: the bytes are the ones opened.
    let (_d, path) = pattern_file(SIZE);
    let r = Reader::open(&path, small_cfg(IoBackend::Auto)).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert!(read_one(&r, 4000, 200_000).unwrap() == expected(4000, 200_000));
    assert!(matches!(r.check_file(), Err(StorageError::Missing { .. })));
}

#[test]
fn dropping_tickets_and_readers_early_does_not_hang() {
    let (_d, path) = pattern_file(SIZE);
    for backend in backends(&path) {
        let r = Reader::open(&path, small_cfg(backend)).unwrap();
        let req = ReadRequest {
            file_offset: 0,
            len: SIZE,
            buf_offset: 0,
        };
        let t = r.submit(AlignedBuf::new(4 << 20).unwrap(), &[req]).unwrap();
        drop(t);
        let t = r.submit(AlignedBuf::new(4 << 20).unwrap(), &[req]).unwrap();
        t.cancel();
        assert!(t.wait_timeout(Duration::from_secs(5)));
        assert!(matches!(t.wait(), Err(StorageError::Cancelled { .. })));
        let t = r.submit(AlignedBuf::new(4 << 20).unwrap(), &[req]).unwrap();
        drop(r);
        // Either it finished before the close or it was cancelled.
        match t.wait() {
            Ok(done) => assert!(done.data(0) == expected(0, SIZE)),
            Err(e) => assert!(matches!(e, StorageError::Cancelled { .. }), "{e}"),
        }
    }
}

#[test]
fn threads_submit_concurrently() {
    let (_d, path) = pattern_file(SIZE);
    let r = Reader::open(&path, small_cfg(IoBackend::Auto)).unwrap();
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let r = &r;
            s.spawn(move || {
                for i in 0..20u64 {
                    let off = (t * 777_777 + i * 50_021) % (SIZE - 70_000);
                    assert!(read_one(r, off, 70_000).unwrap() == expected(off, 70_000));
                }
            });
        }
    });
}

#[test]
fn sequential_bench_reads_the_whole_file() {
    let (_d, path) = pattern_file(SIZE);
    for backend in backends(&path) {
        let cfg = ReaderConfig {
            backend,
            ..ReaderConfig::default()
        };
        let rep = sequential_read(&path, cfg, 1 << 20, 2).unwrap();
        assert_eq!(rep.bytes, SIZE);
        assert_eq!(rep.backend, backend);
        assert!(rep.gb_per_s > 0.0);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn any_extent_reads_the_right_bytes(off in 0u64..SIZE, len in 0u64..300_000, pread: bool) {
        let (_d, path) = pattern_file(SIZE);
        let len = len.min(SIZE - off);
        let backend = if pread { IoBackend::Pread } else { IoBackend::Auto };
        let r = Reader::open(&path, small_cfg(backend)).unwrap();
        prop_assert!(read_one(&r, off, len).unwrap() == expected(off, len));
    }
}
