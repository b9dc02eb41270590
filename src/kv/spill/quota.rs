//! A byte limit several spill directories share: files reserve their
//! length before they are written.

use super::format::SpillError;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};

/// Shared byte budget for a spill directory (e.g. `--kv-spill-max`);
/// thread-safe. [`write_file`] reserves a file's length before writing it and
/// gives it back if the write fails; [`SpillDir::remove`] releases it.
#[derive(Debug)]
pub struct Quota {
    limit: u64,
    used: AtomicU64,
}

/// [`Quota::reserve`] refused: `needed` bytes asked, `available` left of `limit`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("spill quota exceeded: {needed} bytes needed, {available} of {limit} available")]
pub struct QuotaFull {
    pub needed: u64,
    pub available: u64,
    pub limit: u64,
}

impl QuotaFull {
    /// As the [`SpillError::DiskFull`] for writing `path`.
    pub fn at(self, path: &Path) -> SpillError {
        SpillError::DiskFull {
            path: path.to_path_buf(),
            needed: self.needed,
            available: Some(self.available),
        }
    }
}

impl Quota {
    pub fn new(limit: u64) -> Quota {
        Quota {
            limit,
            used: AtomicU64::new(0),
        }
    }
    pub fn limit(&self) -> u64 {
        self.limit
    }
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }
    pub fn available(&self) -> u64 {
        self.limit.saturating_sub(self.used())
    }
    /// Takes `n` bytes of the budget, or fails leaving it unchanged.
    pub fn reserve(&self, n: u64) -> Result<(), QuotaFull> {
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                u.checked_add(n).filter(|&t| t <= self.limit)
            })
            .map(|_| ())
            .map_err(|u| QuotaFull {
                needed: n,
                available: self.limit.saturating_sub(u),
                limit: self.limit,
            })
    }
    /// Gives back `n` bytes (saturating at zero).
    pub fn release(&self, n: u64) {
        // The closure never returns None, so this cannot fail.
        let _ = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |u| {
                Some(u.saturating_sub(n))
            });
    }
}
