//! SSD tier I/O: read byte ranges of one model file into 4096-aligned host
//! buffers with O_DIRECT, through io_uring where the kernel allows it.
//!
//! Role: the bottom of the SSD -> pinned DRAM -> GPU chain (DESIGN.md). The
//! pager asks a [`Reader`] for extents (`file_offset`, `len`) of the model
//! file, each to land at an aligned offset of an [`AlignedBuf`] (usually a
//! slice of the CUDA-pinned DRAM window, wrapped with
//! [`AlignedBuf::from_raw`]). A request is expanded to its
//! [`AlignedWindow`] (4096-aligned start and length), split into chunks of
//! [`ReaderConfig::chunk_size`], and the chunks are fed through a
//! crossbeam-deque injector to a few worker threads. Each worker owns an
//! io_uring (with the file and any [`RegisteredRegion`] registered) and keeps
//! its share of [`ReaderConfig::queue_depth`] reads in flight; without
//! io_uring (or when forced) workers issue `pread` instead. The caller gets
//! a [`ReadTicket`] to poll or wait on; the wanted bytes of request `i` start
//! at [`CompletedRead::data_offset`]`(i)` inside the buffer, so an unaligned
//! GGUF tensor streams without a copy.
//!
//! Invariants:
//! - Ownership of the buffer moves into the ticket at [`ExtentReader::submit`]
//!   and comes back from [`ReadTicket::wait`]. While any chunk is queued or in
//!   the kernel nobody else can reach the buffer; dropping a ticket cancels
//!   its queued chunks and blocks until its in-flight ones completed, so the
//!   memory is never released (or handed back) while the kernel may write it.
//! - A read is complete only when every one of its chunks completed. Short
//!   reads are resubmitted from where they stopped (rounded down to 4096 under
//!   O_DIRECT), EINTR/EAGAIN are retried up to [`ReaderConfig::max_retries`]
//!   times in a row, and anything else (EIO, a file that shrank, changed or
//!   vanished) becomes a [`StorageError`] naming the file and offset. The first
//!   such error stops the reader: later submissions fail fast, queued chunks
//!   are cancelled, in-flight ones are reaped, and the workers exit.
//! - Fallbacks (no io_uring, no O_DIRECT) are decided once at
//!   [`Reader::open`] and said once per process with `tracing::warn`.
//!
//! Speed: destination memory should be physically contiguous per chunk.
//! A 1 MiB read into 4 KiB pages is 256 segments, more than some devices
//! take in one request (virtio-blk here: 254), so the block layer splits it;
//! owned [`AlignedBuf`]s of 2 MiB and up are therefore huge-page mappings
//! (1.3-1.6 GB/s instead of 0.7-1.0 here). A pinned window handed in with
//! [`AlignedBuf::from_raw`] is best huge-page backed too, e.g. an
//! [`AlignedBuf`] registered with CUDA rather than `cudaMallocHost` memory.

mod align;
mod bench;
mod fault;
mod file;
mod pread;
mod reader;
mod shared;
mod ticket;
mod uring;

pub use align::{AlignedBuf, AlignedWindow, DIRECT_ALIGN};
pub use bench::{sequential_read, BenchReport};
pub use fault::{Fault, FaultPlan};
pub use reader::{ExtentReader, Reader};
pub use ticket::{CompletedRead, ReadTicket};

use std::path::PathBuf;
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

/// Everything that can go wrong reading the model file. Cloneable so a
/// reader can stop on the first error and still report it everywhere.
#[derive(Clone, Debug, thiserror::Error)]
pub enum StorageError {
    #[error("{}: cannot open: {source}", path.display())]
    Open {
        path: PathBuf,
        source: Arc<std::io::Error>,
    },
    #[error("{}: not a regular file", path.display())]
    NotRegular { path: PathBuf },
    #[error("{}: read of {len} bytes at offset {offset} failed: {source}", path.display())]
    Read {
        path: PathBuf,
        offset: u64,
        len: u64,
        source: Arc<std::io::Error>,
    },
    #[error("{}: read at offset {offset} still failing after {retries} retries: {source}", path.display())]
    RetriesExhausted {
        path: PathBuf,
        offset: u64,
        retries: u32,
        source: Arc<std::io::Error>,
    },
    #[error(
        "{}: file ends at offset {offset}, before byte {need_end} that was asked for \
         (size at open {size_at_open}, now {size_now}): it shrank while being read",
        path.display()
    )]
    Truncated {
        path: PathBuf,
        offset: u64,
        need_end: u64,
        size_at_open: u64,
        size_now: u64,
    },
    #[error("{}: file changed since it was opened: {what}", path.display())]
    Changed { path: PathBuf, what: String },
    #[error("{}: file is missing: deleted or renamed after it was opened", path.display())]
    Missing { path: PathBuf },
    #[error("{}: range {offset}+{len} lies outside the file (size {size})", path.display())]
    OutOfRange {
        path: PathBuf,
        offset: u64,
        len: u64,
        size: u64,
    },
    #[error("bad destination buffer: {0}")]
    BadDestination(String),
    #[error("cannot allocate {len} bytes aligned to {align}")]
    Alloc { len: usize, align: usize },
    #[error("io_uring is unavailable here: {source}")]
    Unavailable { source: Arc<std::io::Error> },
    #[error("{}: read cancelled: {reason}", path.display())]
    Cancelled { path: PathBuf, reason: String },
}
