//! The work queue shared by a [`super::Reader`] and its workers, and the
//! one place that decides what a read result means ([`Shared::advance`]), so
//! both backends recover from faults alike.

use super::align::align_down;
use super::config::ReaderConfig;
use super::config::ReaderStats;
use super::error::StorageError;
use super::file::OpenFile;
use super::ticket::ReadState;
use crossbeam_deque::{Injector, Steal};
use crossbeam_utils::sync::Unparker;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

/// A piece of one request's window: file bytes `[start, end)` land at
/// `dst`; done once `pos` reaches `need_end` (bytes past the wanted range
/// may be missing at the end of the file).
pub(crate) struct Chunk {
    pub read: Arc<ReadState>,
    pub start: u64,
    pub end: u64,
    pub need_end: u64,
    pub pos: u64,
    dst: *mut u8,
    retries: u32,
    /// Fault-plan number of the operation in flight.
    pub op: u64,
}

// SAFETY: `dst` points into the buffer owned by `read` (kept alive by the
// Arc) and only the worker holding the chunk writes through it.
unsafe impl Send for Chunk {}

impl Chunk {
    pub fn new(read: Arc<ReadState>, start: u64, end: u64, need_end: u64, dst: *mut u8) -> Self {
        Self {
            read,
            start,
            end,
            need_end,
            pos: start,
            dst,
            retries: 0,
            op: 0,
        }
    }

    /// Where the byte at `pos` goes.
    pub fn dst_at_pos(&self) -> *mut u8 {
        self.dst.wrapping_add((self.pos - self.start) as usize)
    }

    /// Bytes the next operation asks for.
    pub fn want(&self) -> u64 {
        self.end - self.pos
    }
}

/// What to do with a chunk after a result.
pub(crate) enum Step {
    Done,
    Again,
    Failed(StorageError),
}

/// State shared by the reader handle and its workers.
pub(crate) struct Shared {
    pub file: OpenFile,
    pub cfg: ReaderConfig,
    injector: Injector<Chunk>,
    unparkers: Vec<Unparker>,
    stopping: AtomicBool,
    stop_cause: OnceLock<StorageError>,
    pub live_workers: AtomicUsize,
    last_check: Mutex<Instant>,
    counters: Counters,
}

/// Running totals behind [`ReaderStats`].
#[derive(Default)]
struct Counters {
    ops: AtomicU64,
    fixed_ops: AtomicU64,
    bytes: AtomicU64,
    retries: AtomicU64,
}

impl Shared {
    pub fn new(file: OpenFile, cfg: ReaderConfig, unparkers: Vec<Unparker>) -> Self {
        Self {
            file,
            cfg,
            injector: Injector::new(),
            live_workers: AtomicUsize::new(unparkers.len()),
            unparkers,
            stopping: AtomicBool::new(false),
            stop_cause: OnceLock::new(),
            last_check: Mutex::new(Instant::now()),
            counters: Counters::default(),
        }
    }

    pub fn push(&self, c: Chunk) {
        self.injector.push(c);
    }

    pub fn stop_cause(&self) -> Option<StorageError> {
        self.stop_cause.get().cloned()
    }

    /// True (and the clock restarted) when `every` passed since the last
    /// file check.
    pub fn check_due(&self, every: std::time::Duration) -> bool {
        let mut last = self.last_check.lock().unwrap_or_else(|e| e.into_inner());
        if last.elapsed() < every {
            return false;
        }
        *last = Instant::now();
        true
    }

    pub fn next_chunk(&self) -> Option<Chunk> {
        loop {
            match self.injector.steal() {
                Steal::Success(c) => return Some(c),
                Steal::Empty => return None,
                Steal::Retry => continue,
            }
        }
    }

    pub fn is_stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    /// Stops the reader after `cause` (the first cause sticks).
    pub fn stop(&self, cause: StorageError) {
        let _ = self.stop_cause.set(cause);
        self.close();
    }

    /// Stops the workers: queued chunks are cancelled, in-flight ones reaped.
    pub fn close(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        self.wake_all();
    }

    pub fn wake_all(&self) {
        for u in &self.unparkers {
            u.unpark();
        }
    }

    pub fn stopped_error(&self) -> StorageError {
        let cause = self.stop_cause.get().map_or("reader closed".into(), |e| {
            format!("the reader stopped after an earlier error: {e}")
        });
        StorageError::Cancelled {
            path: self.file.path.clone(),
            reason: cause,
        }
    }

    /// Accounts a chunk that will not be issued (reader stopping, or its
    /// read cancelled).
    pub fn skip(&self, c: Chunk) {
        let e = if self.is_stopping() {
            self.stopped_error()
        } else {
            c.read.cancelled_error("cancelled")
        };
        c.read.finish_chunk(Err(e));
    }

    /// Cancels every queued chunk (any thread may call it).
    pub fn drain(&self) {
        while let Some(c) = self.next_chunk() {
            self.skip(c);
        }
    }

    /// Counts an operation about to be issued (`fixed`: into a registered
    /// buffer) and takes its fault-plan number.
    pub fn begin_op(&self, fixed: bool) -> u64 {
        self.counters.ops.fetch_add(1, Ordering::Relaxed);
        if fixed {
            self.counters.fixed_ops.fetch_add(1, Ordering::Relaxed);
        }
        self.cfg.faults.as_ref().map_or(0, |f| f.next_op())
    }

    pub fn stats(&self) -> ReaderStats {
        let c = &self.counters;
        ReaderStats {
            ops: c.ops.load(Ordering::Relaxed),
            fixed_ops: c.fixed_ops.load(Ordering::Relaxed),
            bytes: c.bytes.load(Ordering::Relaxed),
            retries: c.retries.load(Ordering::Relaxed),
        }
    }

    /// Applies the fault plan to the result `res` (bytes or -errno) of the
    /// chunk's operation, then decides the chunk's next step.
    pub fn advance(&self, c: &mut Chunk, res: i64) -> Step {
        let want = c.want();
        let res = match &self.cfg.faults {
            Some(f) => f.apply(c.op, c.pos, want, res),
            None => res,
        };
        let step = self.judge(c, res, want);
        match step {
            Step::Again => self.counters.retries.fetch_add(1, Ordering::Relaxed),
            _ => 0,
        };
        if res > 0 {
            self.counters.bytes.fetch_add(res as u64, Ordering::Relaxed);
        }
        step
    }

    fn judge(&self, c: &mut Chunk, res: i64, want: u64) -> Step {
        let path = || self.file.path.clone();
        if res < 0 {
            let errno = (-res) as i32;
            let err = Arc::new(std::io::Error::from_raw_os_error(errno));
            if errno == libc::EINTR || errno == libc::EAGAIN {
                c.retries += 1;
                if c.retries <= self.cfg.max_retries {
                    return Step::Again;
                }
                return Step::Failed(StorageError::RetriesExhausted {
                    path: path(),
                    offset: c.pos,
                    retries: c.retries - 1,
                    source: err,
                });
            }
            if let Err(e) = self.file.check(self.cfg.faults.as_deref()) {
                return Step::Failed(e);
            }
            return Step::Failed(StorageError::Read {
                path: path(),
                offset: c.pos,
                len: want,
                source: err,
            });
        }
        if res == 0 {
            if c.pos >= c.need_end {
                return Step::Done;
            }
            return Step::Failed(StorageError::Truncated {
                path: path(),
                offset: c.pos,
                need_end: c.need_end,
                size_at_open: self.file.ident.size,
                size_now: self.file.size_now(self.cfg.faults.as_deref()),
            });
        }
        let before = c.pos;
        c.pos += (res as u64).min(want);
        if c.pos >= c.need_end {
            return Step::Done;
        }
        if self.file.direct {
            // O_DIRECT needs an aligned offset: re-read the partial block.
            c.pos = align_down(c.pos).max(c.start);
        }
        if c.pos > before {
            c.retries = 0;
            return Step::Again;
        }
        // Less than one block came back: the file ends inside it, or the
        // device stutters. Retry a bounded number of times.
        let size_now = self.file.size_now(self.cfg.faults.as_deref());
        if size_now < c.need_end {
            return Step::Failed(StorageError::Truncated {
                path: path(),
                offset: before + res as u64,
                need_end: c.need_end,
                size_at_open: self.file.ident.size,
                size_now,
            });
        }
        c.retries += 1;
        if c.retries <= self.cfg.max_retries {
            return Step::Again;
        }
        Step::Failed(StorageError::RetriesExhausted {
            path: path(),
            offset: before,
            retries: c.retries - 1,
            source: Arc::new(std::io::Error::other("reads of less than one block")),
        })
    }

    /// Accounts a chunk's final step; a failure stops the reader.
    pub fn finish(&self, c: Chunk, step: Step) {
        match step {
            Step::Done => c.read.finish_chunk(Ok(())),
            Step::Failed(e) => {
                // Record the error before stopping, so that chunks of this
                // read cancelled by the stop cannot report first.
                c.read.cancel(e.clone());
                self.stop(e);
                c.read.finish_chunk(Ok(()));
            }
            Step::Again => {
                // Callers resubmit on Again; never lose a chunk if one did not.
                debug_assert!(false, "finish called with Step::Again");
                let e = c.read.cancelled_error("internal error: unfinished chunk");
                c.read.finish_chunk(Err(e));
            }
        }
    }
}
