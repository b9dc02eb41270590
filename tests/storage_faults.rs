//! Fault injection against the SSD-tier reader: each fault the issue names
//! (short read, EINTR, EAGAIN, EIO, a file that shrinks) on each backend
//! available here. With one worker and depth 1, operation k is the k-th read
//! in file order (chunks of 64 KiB).

mod storage_util;

use std::sync::Arc;
use storage_util::*;
use strata::storage::{Fault, FaultPlan, IoBackend, Reader, ReaderConfig, StorageError};

const SIZE: u64 = 1 << 20;
const CHUNK: u64 = 64 << 10;

fn reader(backend: IoBackend, plan: FaultPlan) -> (tempfile::TempDir, Reader, Arc<FaultPlan>) {
    reader_with(backend, plan, true)
}

fn reader_with(
    backend: IoBackend,
    plan: FaultPlan,
    direct: bool,
) -> (tempfile::TempDir, Reader, Arc<FaultPlan>) {
    let (d, path) = pattern_file(SIZE);
    let plan = Arc::new(plan);
    let cfg = ReaderConfig {
        direct,
        ..serial_cfg(backend, &plan)
    };
    let r = Reader::open(&path, cfg).unwrap();
    (d, r, plan)
}

fn each_backend(f: impl Fn(IoBackend)) {
    let (_d, path) = pattern_file(4096);
    for b in backends(&path) {
        f(b);
    }
}

#[test]
fn short_reads_are_resubmitted_from_the_right_offset() {
    // Under O_DIRECT a resubmission starts at the short read's end rounded
    // down to 4096; buffered, exactly at its end.
    each_backend(|b| {
        for direct in [true, false] {
            // Op 0: 1000 bytes (less than a block); op 2: 5000 bytes; op 5:
            // 70000, capped to the 64 KiB asked minus one.
            let plan = FaultPlan::new()
                .at_op(0, Fault::Short(1000))
                .at_op(2, Fault::Short(5000))
                .at_op(5, Fault::Short(70_000));
            let (_d, r, plan) = reader_with(b, plan, direct);
            if direct && !direct_or_skip(&r) {
                continue;
            }
            let (off, len) = (100, 5 * CHUNK);
            assert!(
                read_one(&r, off, len).unwrap() == expected(off, len),
                "{b:?}"
            );
            assert_eq!(plan.fired(), 3, "{b:?}");
            // 6 chunks of the window and three resubmissions.
            assert_eq!(plan.ops_issued(), 6 + 3, "{b:?} direct={direct}");
        }
    });
}

#[test]
fn eintr_and_eagain_are_retried() {
    each_backend(|b| {
        let plan = FaultPlan::new()
            .at_op(0, Fault::Interrupted)
            .at_op(1, Fault::WouldBlock)
            .at_op(2, Fault::Interrupted)
            .at_op(4, Fault::WouldBlock);
        let (_d, r, plan) = reader(b, plan);
        assert!(read_one(&r, 0, 2 * CHUNK).unwrap() == expected(0, 2 * CHUNK));
        assert_eq!((plan.fired(), plan.ops_issued()), (4, 6), "{b:?}");
        assert!(r.stop_cause().is_none());
    });
}

#[test]
fn endless_eintr_gives_up_with_an_error() {
    each_backend(|b| {
        let mut plan = FaultPlan::new();
        for k in 0..10 {
            plan = plan.at_op(k, Fault::Interrupted);
        }
        let (_d, r, _plan) = reader(b, plan);
        let err = read_one(&r, 0, CHUNK).unwrap_err();
        assert!(
            matches!(
                err,
                StorageError::RetriesExhausted {
                    retries: 3,
                    offset: 0,
                    ..
                }
            ),
            "{b:?}: {err}"
        );
        assert!(workers_exit(&r), "{b:?}");
    });
}

#[test]
fn eio_names_file_and_offset_and_stops_cleanly() {
    each_backend(|b| {
        let (_d, r, _plan) = reader(b, FaultPlan::new().at_op(3, Fault::Io));
        let err = read_one(&r, 0, 8 * CHUNK).unwrap_err();
        let msg = err.to_string();
        match &err {
            StorageError::Read { offset, .. } => assert_eq!(*offset, 3 * CHUNK),
            e => panic!("{b:?}: expected Read, got {e}"),
        }
        assert!(
            msg.contains("model.bin") && msg.contains("Input/output error"),
            "{msg}"
        );
        assert!(workers_exit(&r), "{b:?}: workers still running");
        let later = read_one(&r, 0, 10).unwrap_err();
        assert!(matches!(later, StorageError::Cancelled { .. }), "{later}");
        assert!(later.to_string().contains("Input/output error"), "{later}");
    });
}

#[test]
fn other_errnos_fail_too() {
    each_backend(|b| {
        let (_d, r, _plan) = reader(b, FaultPlan::new().at_op(0, Fault::Errno(libc::ENODEV)));
        let err = read_one(&r, 0, 10).unwrap_err();
        assert!(matches!(err, StorageError::Read { offset: 0, .. }), "{err}");
    });
}

#[test]
fn simulated_truncation_is_reported_as_shrinking() {
    each_backend(|b| {
        let plan = FaultPlan::new().at_op(2, Fault::TruncateAt(2 * CHUNK + 100));
        let (_d, r, _plan) = reader(b, plan);
        let err = read_one(&r, 0, 4 * CHUNK).unwrap_err();
        match err {
            StorageError::Truncated {
                offset,
                need_end,
                size_now,
                ..
            } => {
                assert!((2 * CHUNK..=2 * CHUNK + 100).contains(&offset), "{offset}");
                assert_eq!((need_end, size_now), (3 * CHUNK, 2 * CHUNK + 100));
            }
            e => panic!("{b:?}: expected Truncated, got {e}"),
        }
        assert!(workers_exit(&r));
    });
}

#[test]
fn a_failure_cancels_the_other_reads_in_flight() {
    each_backend(|b| {
        let (_d, path) = pattern_file(SIZE);
        let plan = Arc::new(FaultPlan::new().at_op(1, Fault::Io));
        let r = Reader::open(&path, serial_cfg(b, &plan)).unwrap();
        let mut tickets = Vec::new();
        for i in 0..4 {
            let w = strata::storage::AlignedWindow::covering(i * 2 * CHUNK, 2 * CHUNK).unwrap();
            let buf = strata::storage::AlignedBuf::new(w.len as usize).unwrap();
            let req = strata::storage::ReadRequest {
                file_offset: i * 2 * CHUNK,
                len: 2 * CHUNK,
                buf_offset: 0,
            };
            use strata::storage::ExtentReader;
            match r.submit(buf, &[req]) {
                Ok(t) => tickets.push(t),
                Err(e) => assert!(matches!(e, StorageError::Cancelled { .. })),
            }
        }
        let results: Vec<_> = tickets.into_iter().map(|t| t.wait()).collect();
        assert!(
            matches!(results[0], Err(StorageError::Read { .. })),
            "{b:?}"
        );
        for res in &results[1..] {
            assert!(matches!(res, Err(StorageError::Cancelled { .. })), "{b:?}");
        }
        assert!(workers_exit(&r));
    });
}
