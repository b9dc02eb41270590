//! How a reader is set up (I/O backend, queue depth, registered memory),
//! what it is asked to read and what it reports.

use super::align::AlignedBuf;
use super::fault::FaultPlan;
use std::sync::Arc;
use std::time::Duration;

/// Which I/O path a [`Reader`] uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum IoBackend {
    /// io_uring when a ring can be set up and used, else pread (said once).
    #[default]
    Auto,
    /// io_uring or an error ([`StorageError::Unavailable`]); for tests and
    /// benchmarks.
    IoUring,
    /// One blocking `pread` per worker thread; `queue_depth` threads.
    Pread,
}

/// How a [`Reader`] reads. The defaults suit an NVMe drive.
#[derive(Clone, Debug)]
pub struct ReaderConfig {
    pub backend: IoBackend,
    /// Try O_DIRECT (and fall back to buffered reads where the file system
    /// refuses it, said once).
    pub direct: bool,
    /// io_uring worker threads, each with its own ring (pread uses
    /// `queue_depth` threads instead).
    pub workers: usize,
    /// Reads in flight across all workers.
    pub queue_depth: usize,
    /// Largest single read, bytes; rounded up to a multiple of 4096.
    pub chunk_size: usize,
    /// Re-stat the file (size, mtime, inode, path) at a submission when this
    /// much time passed since the last check; `Some(ZERO)` checks every
    /// submission, `None` only after a failed or short read.
    pub restat_every: Option<Duration>,
    /// EINTR/EAGAIN retries in a row for one chunk before giving up.
    pub max_retries: u32,
    /// Fault injection for tests (see [`FaultPlan`]).
    pub faults: Option<Arc<FaultPlan>>,
    /// Memory to register with every ring (io_uring fixed buffers).
    pub registered: Vec<RegisteredRegion>,
}

impl Default for ReaderConfig {
    fn default() -> Self {
        Self {
            backend: IoBackend::Auto,
            direct: true,
            workers: 1,
            queue_depth: 8,
            chunk_size: 1 << 20,
            restat_every: Some(Duration::from_secs(1)),
            max_retries: 64,
            faults: None,
            registered: Vec::new(),
        }
    }
}

/// A host memory range to register with each worker's io_uring so reads into
/// it use `READ_FIXED` (no page pinning per read).
#[derive(Clone, Copy, Debug)]
pub struct RegisteredRegion {
    pub(crate) addr: usize,
    pub(crate) len: usize,
}

impl RegisteredRegion {
    /// Registers `len` bytes at `ptr` (typically the whole pinned window).
    ///
    /// # Safety
    /// The range must stay mapped and must not be freed or remapped while any
    /// [`Reader`] built with it is alive: the kernel pins the pages at
    /// registration and fixed reads land in those pages, whatever the address
    /// maps to later.
    pub unsafe fn new(ptr: *mut u8, len: usize) -> Self {
        Self {
            addr: ptr as usize,
            len,
        }
    }

    /// The region covering all of `buf`.
    ///
    /// # Safety
    /// As for [`RegisteredRegion::new`]: `buf`'s memory must outlive the reader.
    pub unsafe fn of(buf: &mut AlignedBuf) -> Self {
        Self {
            addr: buf.as_mut_ptr() as usize,
            len: buf.len(),
        }
    }
}

/// What a [`Reader`] did so far.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReaderStats {
    /// Read operations issued, resubmissions included.
    pub ops: u64,
    /// Of those, io_uring reads into a registered (fixed) buffer.
    pub fixed_ops: u64,
    /// Bytes the reads returned (re-read partial blocks count twice).
    pub bytes: u64,
    /// Resubmissions after a short read, EINTR or EAGAIN.
    pub retries: u64,
}

/// One extent to read: file bytes `[file_offset, file_offset + len)` into
/// the buffer, whose aligned window starts at `buf_offset` (a multiple of
/// 4096; room for [`AlignedWindow::len`] bytes is needed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadRequest {
    pub file_offset: u64,
    pub len: u64,
    pub buf_offset: usize,
}
