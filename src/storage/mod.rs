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
mod config;
mod error;
mod fault;
mod file;
mod pread;
mod reader;
mod shared;
mod ticket;
mod uring;

pub use align::{AlignedBuf, AlignedWindow, DIRECT_ALIGN};
pub use bench::{sequential_read, BenchReport};
pub use config::{IoBackend, ReadRequest, ReaderConfig, ReaderStats, RegisteredRegion};
pub use error::StorageError;
pub use fault::{Fault, FaultPlan};
pub use reader::{ExtentReader, Reader};
pub use ticket::{CompletedRead, ReadTicket};
