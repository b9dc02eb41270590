//! What can go wrong reading a model file.

use std::path::PathBuf;
use std::sync::Arc;

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
