//! Helpers shared by the storage tests: pattern files and backend probing.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use strata::storage::{
    AlignedBuf, ExtentReader, FaultPlan, IoBackend, ReadRequest, Reader, ReaderConfig, StorageError,
};

/// The byte at file offset `i` of a pattern file: differs for nearby offsets,
/// so a read from the wrong place shows.
pub fn byte_at(i: u64) -> u8 {
    let x = (i / 8).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5bd1_e995;
    (x >> ((i % 8) * 8)) as u8
}

/// Writes a pattern file of `size` bytes in a fresh temp dir.
pub fn pattern_file(size: u64) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("model.bin");
    let data: Vec<u8> = (0..size).map(byte_at).collect();
    std::fs::write(&path, data).expect("write pattern file");
    (dir, path)
}

pub fn expected(offset: u64, len: u64) -> Vec<u8> {
    (offset..offset + len).map(byte_at).collect()
}

/// Small chunks, so that tests cross chunk boundaries with small files.
pub fn small_cfg(backend: IoBackend) -> ReaderConfig {
    ReaderConfig {
        backend,
        workers: 2,
        queue_depth: 4,
        chunk_size: 64 << 10,
        restat_every: None,
        ..ReaderConfig::default()
    }
}

/// One worker, one read in flight: fault-plan operation numbers follow
/// file order.
pub fn serial_cfg(backend: IoBackend, faults: &Arc<FaultPlan>) -> ReaderConfig {
    ReaderConfig {
        backend,
        workers: 1,
        queue_depth: 1,
        chunk_size: 64 << 10,
        restat_every: None,
        max_retries: 3,
        faults: Some(faults.clone()),
        ..ReaderConfig::default()
    }
}

/// The backends to test here: pread always, io_uring when the kernel lets
/// us set up and use a ring (else a skip message, STYLE habit 7).
pub fn backends(path: &Path) -> Vec<IoBackend> {
    let mut v = vec![IoBackend::Pread];
    let cfg = ReaderConfig {
        backend: IoBackend::IoUring,
        ..ReaderConfig::default()
    };
    match Reader::open(path, cfg) {
        Ok(_) => v.push(IoBackend::IoUring),
        Err(StorageError::Unavailable { source }) => {
            eprintln!("skipping the io_uring backend: {source}")
        }
        Err(e) => panic!("opening {}: {e}", path.display()),
    }
    v
}

/// Says (once per call site) that O_DIRECT is not in use, so tests of its
/// alignment rules are skipped.
pub fn direct_or_skip(r: &Reader) -> bool {
    if !r.is_direct() {
        eprintln!(
            "skipping O_DIRECT checks: {} does not support O_DIRECT",
            r.path().display()
        );
    }
    r.is_direct()
}

/// Reads one extent into a fresh buffer and returns the wanted bytes.
pub fn read_one(r: &Reader, offset: u64, len: u64) -> Result<Vec<u8>, StorageError> {
    let w = strata::storage::AlignedWindow::covering(offset, len).expect("window");
    let buf = AlignedBuf::new(w.len as usize)?;
    let req = ReadRequest {
        file_offset: offset,
        len,
        buf_offset: 0,
    };
    let done = r.submit(buf, &[req])?.wait()?;
    assert_eq!(done.data_offset(0) as u64, w.inner);
    Ok(done.data(0).to_vec())
}

/// Waits up to two seconds for a stopped reader's workers to exit.
pub fn workers_exit(r: &Reader) -> bool {
    for _ in 0..200 {
        if r.live_workers() == 0 {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    false
}
