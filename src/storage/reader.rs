//! The [`Reader`]: opens the file, starts the workers, validates requests
//! and splits their windows into chunks for the shared queue.

use super::align::AlignedBuf;
use super::align::AlignedWindow;
use super::align::DIRECT_ALIGN;
use super::config::IoBackend;
use super::config::ReadRequest;
use super::config::ReaderConfig;
use super::config::ReaderStats;
use super::error::StorageError;
use super::file::OpenFile;
use super::shared::{Chunk, Shared};
use super::ticket::ReadState;
use super::ticket::ReadTicket;
use crossbeam_utils::sync::Parker;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;

/// Reads extents of one file into caller buffers; see the module docs.
pub trait ExtentReader: Send + Sync {
    /// Queues `reqs` (each window landing at its `buf_offset` in `buf`) and
    /// returns at once. The buffer comes back from [`ReadTicket::wait`].
    fn submit(&self, buf: AlignedBuf, reqs: &[ReadRequest]) -> Result<ReadTicket, StorageError>;

    /// Size of the file when it was opened.
    fn file_size(&self) -> u64;

    /// Blocking convenience: reads `dst.len()` bytes at `offset` into any
    /// (unaligned) slice, through an aligned bounce buffer.
    fn read_exact_at(&self, offset: u64, dst: &mut [u8]) -> Result<(), StorageError> {
        let len = dst.len() as u64;
        let w = AlignedWindow::covering(offset, len).ok_or_else(|| {
            StorageError::BadDestination(format!("range {offset}+{len} overflows"))
        })?;
        let buf = AlignedBuf::new(w.len as usize)?;
        let req = ReadRequest {
            file_offset: offset,
            len,
            buf_offset: 0,
        };
        let done = self.submit(buf, &[req])?.wait()?;
        dst.copy_from_slice(done.data(0));
        Ok(())
    }
}

/// Reads extents of one file with a pool of io_uring or pread workers.
pub struct Reader {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
    backend: IoBackend,
}

impl Reader {
    /// Opens `path` and starts the workers. Fails on a missing or unreadable
    /// file, or when `cfg.backend` is `IoUring` and no ring works here.
    pub fn open(path: impl AsRef<Path>, mut cfg: ReaderConfig) -> Result<Self, StorageError> {
        let file = OpenFile::open(path.as_ref(), cfg.direct)?;
        cfg.workers = cfg.workers.max(1);
        cfg.queue_depth = cfg.queue_depth.max(cfg.workers);
        cfg.chunk_size = cfg
            .chunk_size
            .clamp(DIRECT_ALIGN, 1 << 30)
            .next_multiple_of(DIRECT_ALIGN);
        let rings = match cfg.backend {
            IoBackend::Pread => None,
            IoBackend::IoUring => Some(super::uring::setup(&file, &cfg)?),
            IoBackend::Auto => super::uring::setup(&file, &cfg)
                .map_err(super::uring::warn_fallback)
                .ok(),
        };
        let backend = match rings {
            Some(_) => IoBackend::IoUring,
            None => IoBackend::Pread,
        };
        let n_threads = rings.as_ref().map_or(cfg.queue_depth.min(64), |r| r.len());
        let parkers: Vec<Parker> = (0..n_threads).map(|_| Parker::new()).collect();
        let unparkers = parkers.iter().map(|p| p.unparker().clone()).collect();
        let shared = Arc::new(Shared::new(file, cfg, unparkers));
        let mut rings = rings.map(|r| r.into_iter());
        let mut threads = Vec::with_capacity(n_threads);
        for (i, parker) in parkers.into_iter().enumerate() {
            let sh = shared.clone();
            let ring = rings.as_mut().and_then(|r| r.next());
            let spawned = std::thread::Builder::new()
                .name(format!("strata-io-{i}"))
                .spawn(move || {
                    match ring {
                        Some(ring) => super::uring::run(&sh, ring, parker),
                        None => super::pread::run(&sh, parker),
                    }
                    sh.live_workers.fetch_sub(1, Ordering::SeqCst);
                });
            match spawned {
                Ok(t) => threads.push(t),
                Err(e) => {
                    shared.live_workers.fetch_sub(1, Ordering::SeqCst);
                    tracing::warn!("cannot start I/O worker {i}: {e}");
                }
            }
        }
        if threads.is_empty() {
            return Err(StorageError::Unavailable {
                source: Arc::new(std::io::Error::other("no I/O worker thread could start")),
            });
        }
        Ok(Self {
            shared,
            threads,
            backend,
        })
    }

    /// The backend in use: `IoUring` or `Pread` (never `Auto`).
    pub fn backend(&self) -> IoBackend {
        self.backend
    }

    /// True when reads bypass the page cache (O_DIRECT).
    pub fn is_direct(&self) -> bool {
        self.shared.file.direct
    }

    pub fn path(&self) -> &Path {
        &self.shared.file.path
    }

    /// Checks now that the file is still the one opened (see
    /// [`ReaderConfig::restat_every`]).
    pub fn check_file(&self) -> Result<(), StorageError> {
        self.shared.file.check(self.shared.cfg.faults.as_deref())
    }

    /// The error that stopped the reader, if one did.
    pub fn stop_cause(&self) -> Option<StorageError> {
        self.shared.stop_cause()
    }

    /// Worker threads still running (0 once a stopped reader wound down).
    pub fn live_workers(&self) -> usize {
        self.shared.live_workers.load(Ordering::SeqCst)
    }

    /// Operations, bytes and retries so far.
    pub fn stats(&self) -> ReaderStats {
        self.shared.stats()
    }

    /// Effective configuration (worker count, depth and chunk size settled).
    pub fn config(&self) -> &ReaderConfig {
        &self.shared.cfg
    }

    fn maybe_check(&self) -> Result<(), StorageError> {
        match self.shared.cfg.restat_every {
            Some(every) if self.shared.check_due(every) => self.check_file(),
            _ => Ok(()),
        }
    }
}

impl ExtentReader for Reader {
    fn submit(
        &self,
        mut buf: AlignedBuf,
        reqs: &[ReadRequest],
    ) -> Result<ReadTicket, StorageError> {
        let sh = &self.shared;
        if sh.is_stopping() {
            return Err(sh.stopped_error());
        }
        if let Err(e) = self.maybe_check() {
            sh.stop(e.clone());
            return Err(e);
        }
        let size = sh.file.ident.size;
        let path = &sh.file.path;
        let mut windows = Vec::with_capacity(reqs.len());
        for r in reqs {
            let out_of_range = || StorageError::OutOfRange {
                path: path.clone(),
                offset: r.file_offset,
                len: r.len,
                size,
            };
            let w = AlignedWindow::covering(r.file_offset, r.len).ok_or_else(out_of_range)?;
            if r.file_offset + r.len > size {
                return Err(out_of_range());
            }
            let fits = (r.buf_offset as u64)
                .checked_add(w.len)
                .is_some_and(|end| end <= buf.len() as u64);
            if !r.buf_offset.is_multiple_of(DIRECT_ALIGN) || !fits {
                return Err(StorageError::BadDestination(format!(
                    "window of {} bytes at buffer offset {} (must be {DIRECT_ALIGN}-aligned) \
                     does not fit a buffer of {}",
                    w.len,
                    r.buf_offset,
                    buf.len()
                )));
            }
            windows.push((r, w));
        }
        let mut by_dst: Vec<_> = windows.iter().filter(|(_, w)| w.len > 0).collect();
        by_dst.sort_by_key(|(r, _)| r.buf_offset);
        for pair in by_dst.windows(2) {
            let ((a, aw), (b, _)) = (pair[0], pair[1]);
            if a.buf_offset as u64 + aw.len > b.buf_offset as u64 {
                return Err(StorageError::BadDestination(format!(
                    "windows at buffer offsets {} and {} overlap",
                    a.buf_offset, b.buf_offset
                )));
            }
        }
        let chunk = sh.cfg.chunk_size as u64;
        let n_chunks: usize = windows
            .iter()
            .map(|(_, w)| w.len.div_ceil(chunk) as usize)
            .sum();
        let base = buf.as_mut_ptr();
        let data = windows
            .iter()
            .map(|(r, w)| (r.buf_offset + w.inner as usize, r.len as usize))
            .collect();
        let state = ReadState::new(path.clone(), buf, data, n_chunks);
        for (r, w) in &windows {
            let need_end = r.file_offset + r.len;
            let mut start = w.start;
            while start < w.end() {
                let end = (start + chunk).min(w.end());
                let dst = base.wrapping_add(r.buf_offset + (start - w.start) as usize);
                sh.push(Chunk::new(
                    state.clone(),
                    start,
                    end,
                    need_end.min(end),
                    dst,
                ));
                start = end;
            }
        }
        sh.wake_all();
        if sh.is_stopping() {
            // Workers may have exited before seeing these chunks.
            sh.drain();
        }
        Ok(ReadTicket::new(state))
    }

    fn file_size(&self) -> u64 {
        self.shared.file.ident.size
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        self.shared.close();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        self.shared.drain();
    }
}

impl std::fmt::Debug for Reader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reader")
            .field("path", &self.shared.file.path)
            .field("backend", &self.backend)
            .field("direct", &self.shared.file.direct)
            .field("workers", &self.threads.len())
            .finish()
    }
}
