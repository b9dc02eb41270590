//! Completion tracking: one [`ReadState`] per submission, shared by the
//! caller's [`ReadTicket`] and every chunk in the queues or the kernel.
//!
//! The state owns the destination buffer until the last chunk finished
//! (completed, failed or cancelled); only then may the ticket hand it back.
//! Chunks write through raw pointers into that buffer, so nothing else may
//! touch it earlier, and a ticket dropped early blocks until the in-flight
//! chunks are reaped.

use super::align::AlignedBuf;
use super::error::StorageError;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

pub(crate) struct ReadState {
    path: PathBuf,
    buf: Mutex<Option<AlignedBuf>>,
    data_offsets: Vec<usize>,
    data_lens: Vec<usize>,
    pending: AtomicUsize,
    cancelled: AtomicBool,
    error: Mutex<Option<StorageError>>,
    done: Mutex<bool>,
    done_cv: Condvar,
}

impl ReadState {
    /// A state for `chunks` chunks writing into `buf`; with no chunks it is
    /// complete at once.
    pub fn new(
        path: PathBuf,
        buf: AlignedBuf,
        data: Vec<(usize, usize)>,
        chunks: usize,
    ) -> Arc<Self> {
        let (data_offsets, data_lens) = data.into_iter().unzip();
        Arc::new(Self {
            path,
            buf: Mutex::new(Some(buf)),
            data_offsets,
            data_lens,
            pending: AtomicUsize::new(chunks),
            cancelled: AtomicBool::new(false),
            error: Mutex::new(None),
            done: Mutex::new(chunks == 0),
            done_cv: Condvar::new(),
        })
    }

    pub fn is_cancelled(&self) -> bool {
        self.cancelled.load(Ordering::Acquire)
    }

    /// Stops the chunks not yet issued. `wait` reports the first real error,
    /// else the first cancellation.
    pub fn cancel(&self, why: StorageError) {
        let mut e = lock(&self.error);
        let replace = match &*e {
            None => true,
            Some(StorageError::Cancelled { .. }) => !matches!(why, StorageError::Cancelled { .. }),
            Some(_) => false,
        };
        if replace {
            *e = Some(why);
        }
        self.cancelled.store(true, Ordering::Release);
    }

    /// Accounts one chunk as over. After the last one the buffer is free.
    pub fn finish_chunk(&self, result: Result<(), StorageError>) {
        if let Err(e) = result {
            self.cancel(e);
        }
        if self.pending.fetch_sub(1, Ordering::AcqRel) == 1 {
            *lock(&self.done) = true;
            self.done_cv.notify_all();
        }
    }

    pub fn cancelled_error(&self, reason: &str) -> StorageError {
        StorageError::Cancelled {
            path: self.path.clone(),
            reason: reason.into(),
        }
    }

    fn is_done(&self) -> bool {
        *lock(&self.done)
    }

    fn wait_done(&self, timeout: Option<Duration>) -> bool {
        let mut done = lock(&self.done);
        while !*done {
            done = match timeout {
                None => self.done_cv.wait(done).unwrap_or_else(|e| e.into_inner()),
                Some(t) => {
                    let (g, r) = self
                        .done_cv
                        .wait_timeout(done, t)
                        .unwrap_or_else(|e| e.into_inner());
                    if r.timed_out() {
                        return *g;
                    }
                    g
                }
            };
        }
        true
    }

    /// The outcome; call only once every chunk is over.
    fn take(&self) -> Result<CompletedRead, StorageError> {
        if let Some(e) = lock(&self.error).take() {
            return Err(e);
        }
        let buf = lock(&self.buf)
            .take()
            .ok_or_else(|| StorageError::Cancelled {
                path: self.path.clone(),
                reason: "result already taken".into(),
            })?;
        Ok(CompletedRead {
            buf,
            data_offsets: self.data_offsets.clone(),
            data_lens: self.data_lens.clone(),
        })
    }
}

/// A submitted read. Wait on it or poll it; dropping it before completion
/// cancels the chunks not yet issued and blocks until the rest are reaped.
pub struct ReadTicket {
    state: Option<Arc<ReadState>>,
}

impl ReadTicket {
    pub(crate) fn new(state: Arc<ReadState>) -> Self {
        Self { state: Some(state) }
    }

    /// True once every chunk completed (or failed): `wait` will not block.
    pub fn is_done(&self) -> bool {
        self.state.as_ref().is_none_or(|s| s.is_done())
    }

    /// Blocks up to `timeout` for completion; true when done.
    pub fn wait_timeout(&self, timeout: Duration) -> bool {
        self.state
            .as_ref()
            .is_none_or(|s| s.wait_done(Some(timeout)))
    }

    /// Blocks until every chunk is over; gives the buffer back, or the
    /// first error of this read.
    pub fn wait(mut self) -> Result<CompletedRead, StorageError> {
        let state = self.take_state()?;
        state.wait_done(None);
        state.take()
    }

    /// The result if done, else the ticket back.
    pub fn try_wait(mut self) -> Result<Result<CompletedRead, StorageError>, ReadTicket> {
        if !self.is_done() {
            return Err(self);
        }
        Ok(self.take_state().and_then(|s| s.take()))
    }

    /// Asks the workers to skip the chunks not yet issued; `wait` then
    /// reports [`StorageError::Cancelled`].
    pub fn cancel(&self) {
        if let Some(s) = &self.state {
            s.cancel(s.cancelled_error("cancelled by the caller"));
        }
    }

    fn take_state(&mut self) -> Result<Arc<ReadState>, StorageError> {
        self.state.take().ok_or_else(|| StorageError::Cancelled {
            path: PathBuf::new(),
            reason: "ticket already consumed".into(),
        })
    }
}

impl Drop for ReadTicket {
    fn drop(&mut self) {
        if let Some(s) = self.state.take() {
            if !s.is_done() {
                s.cancel(s.cancelled_error("ticket dropped"));
                s.wait_done(None);
            }
        }
    }
}

impl std::fmt::Debug for ReadTicket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReadTicket")
            .field("done", &self.is_done())
            .finish()
    }
}

/// A finished read: the buffer and where each request's bytes start in it.
#[derive(Debug)]
pub struct CompletedRead {
    buf: AlignedBuf,
    data_offsets: Vec<usize>,
    data_lens: Vec<usize>,
}

impl CompletedRead {
    /// Offset in the buffer of request `i`'s first wanted byte
    /// (`buf_offset + window.inner`).
    pub fn data_offset(&self, i: usize) -> usize {
        self.data_offsets[i]
    }

    /// The wanted bytes of request `i` (empty for an empty request, whose
    /// offset may lie past a buffer sized for its empty window).
    pub fn data(&self, i: usize) -> &[u8] {
        let (o, n) = (self.data_offsets[i], self.data_lens[i]);
        if n == 0 {
            return &[];
        }
        &self.buf[o..o + n]
    }

    pub fn buf(&self) -> &AlignedBuf {
        &self.buf
    }

    pub fn into_buf(self) -> AlignedBuf {
        self.buf
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
