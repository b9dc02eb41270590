//! The io_uring backend: one ring per worker thread, the file registered as
//! fixed file 0 and the caller's [`super::RegisteredRegion`]s as fixed
//! buffers (reads landing wholly inside one use `READ_FIXED`).
//!
//! Each worker keeps up to its share of the queue depth in flight; slot `i`
//! of its table holds the chunk whose SQE carries user_data `i`, so a chunk
//! (and its buffer) stays reachable until its CQE is reaped.

use super::config::ReaderConfig;
use super::error::StorageError;
use super::file::OpenFile;
use super::shared::{Chunk, Shared, Step};
use crossbeam_utils::sync::Parker;
use io_uring::{opcode, squeue, types, IoUring};
use std::collections::VecDeque;
use std::io;
use std::os::unix::io::AsRawFd;
use std::sync::{Arc, Once};
use std::time::Duration;

/// Largest fixed buffer the kernel takes in one iovec.
const MAX_FIXED: usize = 1 << 30;

/// A worker's ring and what is registered with it.
pub(crate) struct Ring {
    ring: IoUring,
    depth: usize,
    fixed_file: bool,
    /// Registered buffers `(addr, len)`, index = buffer index.
    fixed_bufs: Vec<(usize, usize)>,
}

static FALLBACK: Once = Once::new();
static NO_FIXED: Once = Once::new();

/// Says once that io_uring is not used; passes the error through.
pub(crate) fn warn_fallback(e: StorageError) -> StorageError {
    FALLBACK.call_once(|| tracing::warn!("{e}; reading with pread instead (said once)"));
    e
}

/// One working ring per worker, or why none can be had.
pub(crate) fn setup(file: &OpenFile, cfg: &ReaderConfig) -> Result<Vec<Ring>, StorageError> {
    let unavailable = |e: io::Error| StorageError::Unavailable {
        source: Arc::new(e),
    };
    let workers = cfg.workers.max(1);
    let mut bufs = Vec::new();
    for r in &cfg.registered {
        let mut off = 0;
        while off < r.len {
            let n = (r.len - off).min(MAX_FIXED);
            bufs.push((r.addr + off, n));
            off += n;
        }
    }
    let mut rings = Vec::with_capacity(workers);
    for i in 0..workers {
        let depth = cfg.queue_depth / workers + usize::from(i < cfg.queue_depth % workers);
        let depth = depth.max(1);
        let mut ring = IoUring::new(depth.next_power_of_two() as u32).map_err(unavailable)?;
        probe(&mut ring).map_err(unavailable)?;
        let fixed_file = ring
            .submitter()
            .register_files(&[file.file.as_raw_fd()])
            .is_ok();
        let mut fixed_bufs = Vec::new();
        if !bufs.is_empty() {
            let iov: Vec<libc::iovec> = bufs
                .iter()
                .map(|&(a, n)| libc::iovec {
                    iov_base: a as *mut libc::c_void,
                    iov_len: n,
                })
                .collect();
            // SAFETY: RegisteredRegion::new's caller promised the regions
            // stay mapped for the reader's lifetime, which bounds the ring's.
            match unsafe { ring.submitter().register_buffers(&iov) } {
                Ok(()) => fixed_bufs = bufs.clone(),
                Err(e) => NO_FIXED.call_once(|| {
                    tracing::warn!("io_uring buffer registration failed ({e}); using plain reads")
                }),
            }
        }
        rings.push(Ring {
            ring,
            depth,
            fixed_file,
            fixed_bufs,
        });
    }
    Ok(rings)
}

/// Submits a NOP and reaps it: seccomp may allow setup but not enter.
fn probe(ring: &mut IoUring) -> io::Result<()> {
    let nop = opcode::Nop::new().build().user_data(u64::MAX);
    // SAFETY: a NOP references no memory.
    unsafe { ring.submission().push(&nop) }.map_err(|_| io::Error::other("SQ full"))?;
    ring.submit_and_wait(1)?;
    match ring.completion().next() {
        Some(c) if c.result() >= 0 => Ok(()),
        Some(c) => Err(io::Error::from_raw_os_error(-c.result())),
        None => Err(io::Error::other("no completion for a NOP")),
    }
}

impl Ring {
    fn fixed_index(&self, addr: usize, len: usize) -> Option<u16> {
        let i = self
            .fixed_bufs
            .iter()
            .position(|&(a, n)| addr >= a && addr + len <= a + n)?;
        u16::try_from(i).ok()
    }

    /// The SQE reading the rest of `c`, and whether it uses a fixed buffer.
    fn sqe(&self, c: &Chunk, slot: usize, fd: i32) -> (squeue::Entry, bool) {
        let len = c.want() as u32;
        let ptr = c.dst_at_pos();
        let buf = self.fixed_index(ptr as usize, len as usize);
        let e = match (self.fixed_file, buf) {
            (true, Some(b)) => opcode::ReadFixed::new(types::Fixed(0), ptr, len, b)
                .offset(c.pos)
                .build(),
            (true, None) => opcode::Read::new(types::Fixed(0), ptr, len)
                .offset(c.pos)
                .build(),
            (false, Some(b)) => opcode::ReadFixed::new(types::Fd(fd), ptr, len, b)
                .offset(c.pos)
                .build(),
            (false, None) => opcode::Read::new(types::Fd(fd), ptr, len)
                .offset(c.pos)
                .build(),
        };
        (e.user_data(slot as u64), buf.is_some())
    }
}

/// Worker loop: fill the ring from the queue, wait for a completion, let
/// [`Shared::advance`] judge each result, resubmit or finish.
pub(crate) fn run(sh: &Shared, mut r: Ring, parker: Parker) {
    let fd = sh.file.file.as_raw_fd();
    let mut slots: Vec<Option<Chunk>> = (0..r.depth).map(|_| None).collect();
    let mut free: Vec<usize> = (0..r.depth).rev().collect();
    let mut again: VecDeque<Chunk> = VecDeque::new();
    let mut reaped: Vec<(u64, i32)> = Vec::with_capacity(r.depth);
    let mut inflight = 0usize;
    let mut enter_failures = 0u32;
    loop {
        while let Some(&slot) = free.last() {
            let Some(mut c) = again.pop_front().or_else(|| sh.next_chunk()) else {
                break;
            };
            if sh.is_stopping() || c.read.is_cancelled() {
                sh.skip(c);
                continue;
            }
            let (sqe, fixed) = r.sqe(&c, slot, fd);
            c.op = sh.begin_op(fixed);
            // SAFETY: the SQE points into the chunk's buffer, kept alive by
            // `c.read` which stays in `slots[slot]` until this SQE's CQE is
            // reaped below; no other code writes that range meanwhile.
            if unsafe { r.ring.submission().push(&sqe) }.is_err() {
                again.push_front(c);
                break;
            }
            free.pop();
            slots[slot] = Some(c);
            inflight += 1;
            // One SQE per enter: a batch is plugged and its adjacent reads
            // merged into few large requests, fewer in flight at the device.
            // An error leaves the SQE queued for the submit_and_wait below.
            let _ = r.ring.submit();
        }
        if inflight == 0 {
            if sh.is_stopping() {
                for c in again.drain(..) {
                    sh.skip(c);
                }
                sh.drain();
                return;
            }
            parker.park_timeout(Duration::from_millis(200));
            continue;
        }
        if let Err(e) = r.ring.submit_and_wait(1) {
            let transient = matches!(
                e.raw_os_error(),
                Some(libc::EINTR | libc::EBUSY | libc::EAGAIN)
            );
            if !transient {
                enter_failures += 1;
                if enter_failures == 1 {
                    sh.stop(StorageError::Read {
                        path: sh.file.path.clone(),
                        offset: 0,
                        len: 0,
                        source: Arc::new(e),
                    });
                }
                if enter_failures > 1000 {
                    abandon(sh, &mut slots);
                    return;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        reaped.extend(r.ring.completion().map(|c| (c.user_data(), c.result())));
        for (ud, res) in reaped.drain(..) {
            let Some(mut c) = slots.get_mut(ud as usize).and_then(Option::take) else {
                continue;
            };
            free.push(ud as usize);
            inflight -= 1;
            match sh.advance(&mut c, res as i64) {
                Step::Again => again.push_back(c),
                step => sh.finish(c, step),
            }
        }
    }
}

/// The ring is unusable and its in-flight reads cannot be reaped: fail them
/// but leak their buffers, since the kernel may still write into them.
fn abandon(sh: &Shared, slots: &mut [Option<Chunk>]) {
    for c in slots.iter_mut().filter_map(Option::take) {
        std::mem::forget(c.read.clone());
        c.read
            .finish_chunk(Err(c.read.cancelled_error("io_uring stopped responding")));
    }
    sh.drain();
}
