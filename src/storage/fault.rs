//! Fault injection: make chosen reads come back short, interrupted, failing
//! or truncated, so each recovery path can be tested on any kernel.
//!
//! Every read operation a [`super::Reader`] issues (a first attempt or a
//! resubmission, either backend) takes the next number from the plan, from 0
//! up. A rule for number `k` rewrites that operation's result after the real
//! read ran, so the data path stays real. With one worker and queue depth 1
//! numbers follow file order; with more they follow issue order.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// What happens to one read operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Return at most this many bytes (a short read).
    Short(u64),
    /// Fail with EINTR.
    Interrupted,
    /// Fail with EAGAIN.
    WouldBlock,
    /// Fail with EIO.
    Io,
    /// Fail with any errno.
    Errno(i32),
    /// From this operation on, every read behaves as if the file ended at
    /// this size (reads past it return 0), as when the file shrinks.
    TruncateAt(u64),
}

/// A set of faults keyed by operation number; share it with the reader
/// through [`super::ReaderConfig::faults`].
#[derive(Debug, Default)]
pub struct FaultPlan {
    rules: Mutex<Vec<(u64, Fault, bool)>>,
    next_op: AtomicU64,
    truncated_at: AtomicU64,
}

const NOT_TRUNCATED: u64 = u64::MAX;

impl FaultPlan {
    pub fn new() -> Self {
        Self {
            rules: Mutex::new(Vec::new()),
            next_op: AtomicU64::new(0),
            truncated_at: AtomicU64::new(NOT_TRUNCATED),
        }
    }

    /// Adds a fault for operation `op` (0-based).
    pub fn at_op(self, op: u64, fault: Fault) -> Self {
        lock(&self.rules).push((op, fault, false));
        self
    }

    /// Operations issued so far.
    pub fn ops_issued(&self) -> u64 {
        self.next_op.load(Ordering::SeqCst)
    }

    /// Rules that have fired.
    pub fn fired(&self) -> usize {
        lock(&self.rules).iter().filter(|r| r.2).count()
    }

    /// The size a [`Fault::TruncateAt`] that fired pretends the file has.
    pub fn simulated_size(&self) -> Option<u64> {
        let s = self.truncated_at.load(Ordering::SeqCst);
        (s != NOT_TRUNCATED).then_some(s)
    }

    pub(crate) fn next_op(&self) -> u64 {
        self.next_op.fetch_add(1, Ordering::SeqCst)
    }

    /// Rewrites the result `res` (bytes, or -errno) of operation `op`, which
    /// asked for `want` bytes at file offset `pos`.
    pub(crate) fn apply(&self, op: u64, pos: u64, want: u64, res: i64) -> i64 {
        let mut res = res;
        for rule in lock(&self.rules).iter_mut() {
            if rule.0 != op || rule.2 {
                continue;
            }
            rule.2 = true;
            res = match rule.1 {
                Fault::Short(n) => res.min(n.min(want.saturating_sub(1)) as i64),
                Fault::Interrupted => -(libc::EINTR as i64),
                Fault::WouldBlock => -(libc::EAGAIN as i64),
                Fault::Io => -(libc::EIO as i64),
                Fault::Errno(e) => -(e as i64),
                Fault::TruncateAt(size) => {
                    self.truncated_at.store(size, Ordering::SeqCst);
                    res
                }
            };
        }
        if let Some(size) = self.simulated_size() {
            if res > 0 {
                res = res.min(size.saturating_sub(pos) as i64);
            }
        }
        res
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_fire_once_on_their_op() {
        let p = FaultPlan::new()
            .at_op(1, Fault::Short(100))
            .at_op(2, Fault::Io);
        assert_eq!(p.apply(0, 0, 4096, 4096), 4096);
        assert_eq!(p.apply(1, 0, 4096, 4096), 100);
        assert_eq!(p.apply(2, 0, 4096, 4096), -(libc::EIO as i64));
        assert_eq!(p.apply(1, 0, 4096, 4096), 4096);
        assert_eq!(p.fired(), 2);
    }

    #[test]
    fn truncation_is_sticky() {
        let p = FaultPlan::new().at_op(0, Fault::TruncateAt(5000));
        assert_eq!(p.apply(0, 4096, 4096, 4096), 904);
        assert_eq!(p.apply(1, 8192, 4096, 4096), 0);
        assert_eq!(p.apply(2, 0, 4096, 4096), 4096);
        assert_eq!(p.simulated_size(), Some(5000));
    }
}
