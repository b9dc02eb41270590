//! The DRAM tier: when the streamed groups do not fit in the host memory
//! budget, a window of W pinned host slots holds the groups nearest in the
//! step order and the rest are read from the model file (O_DIRECT through
//! `crate::storage`) as the step moves through the layers.
//!
//! The step visits groups in the same order every step, so the group used
//! longest ago is the one needed soonest: evicting it (LRU) would re-read
//! every group every step. Instead the first groups to arrive keep their
//! host slots, and the rest pass through the last `CYCLING` slots round
//! robin: each step re-reads only what the window cannot hold. A host slot
//! is only overwritten once
//! the copy that read it has completed (the copy stream is drained first
//! when it may still be pending). Reads run ahead of the pager: they land in
//! staging buffers (the file layout differs from the slot layout) and are
//! placed into a host slot when the pager asks for the group.

use super::error::EngineError;
use crate::model::WeightSpec;
use crate::storage::{
    AlignedBuf, AlignedWindow, ExtentReader, ReadRequest, ReadTicket, Reader, ReaderConfig,
    DIRECT_ALIGN,
};
use std::cell::RefCell;
use std::collections::HashMap;
use std::path::Path;

/// Host slots that groups beyond the window's capacity pass through.
pub const CYCLING: usize = 3;

/// Window state and the reads in flight.
pub struct DramWindow {
    pub slots: usize,
    pub slot_bytes: usize,
    /// Groups read ahead of the pager.
    pub ahead: usize,
    reader: Reader,
    state: RefCell<State>,
    /// Reads in flight, by group (each owns its staging buffer).
    inflight: RefCell<HashMap<usize, ReadTicket>>,
}

struct State {
    owner: Vec<Option<usize>>,
    /// An asynchronous copy out of this slot may still be running.
    copy_pending: Vec<bool>,
    next: usize,
    bytes_read: u64,
    /// Time the pager spent waiting for reads to complete.
    read_wait: std::time::Duration,
}

impl DramWindow {
    pub fn new(
        path: &Path,
        slots: usize,
        slot_bytes: usize,
        ahead: usize,
    ) -> Result<DramWindow, EngineError> {
        let cfg = ReaderConfig {
            workers: 2,
            queue_depth: 16,
            ..ReaderConfig::default()
        };
        Ok(DramWindow {
            slots,
            slot_bytes,
            ahead,
            reader: Reader::open(path, cfg)?,
            state: RefCell::new(State {
                owner: vec![None; slots],
                copy_pending: vec![false; slots],
                next: 0,
                bytes_read: 0,
                read_wait: std::time::Duration::ZERO,
            }),
            inflight: RefCell::new(HashMap::new()),
        })
    }

    /// Bytes read from the file so far.
    pub fn bytes_read(&self) -> u64 {
        self.state.borrow().bytes_read
    }

    /// Starts reading group `gi` unless it is in a host slot or being read.
    pub fn prefetch(&self, gi: usize, weights: &[WeightSpec]) -> Result<(), EngineError> {
        if self.state.borrow().owner.contains(&Some(gi)) || self.inflight.borrow().contains_key(&gi)
        {
            return Ok(());
        }
        let t = self.submit(weights)?;
        self.inflight.borrow_mut().insert(gi, t);
        Ok(())
    }

    /// One aligned read per tensor of a group, all in flight together, into
    /// a staging buffer.
    fn submit(&self, weights: &[WeightSpec]) -> Result<ReadTicket, EngineError> {
        let mut reqs = Vec::with_capacity(weights.len());
        let mut off = 0usize;
        for w in weights {
            let win = AlignedWindow::covering(w.offset, w.size).ok_or_else(|| {
                EngineError::Io(
                    format!("tensor {}", w.name),
                    std::io::Error::other("offset overflow"),
                )
            })?;
            reqs.push(ReadRequest {
                file_offset: w.offset,
                len: w.size,
                buf_offset: off,
            });
            off += (win.len as usize).div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN + DIRECT_ALIGN;
        }
        Ok(self
            .reader
            .submit(AlignedBuf::new(off.max(DIRECT_ALIGN))?, &reqs)?)
    }

    /// Makes group `gi` present in a host slot of `base` (the pinned window
    /// buffer): waits for its read (issuing it now if nobody did) and lays
    /// its tensors out at `offsets`. `drain` waits for pending copies before
    /// a slot whose data may still be copying is overwritten. Returns the
    /// slot's byte offset.
    ///
    /// # Safety
    /// `base` must point to `slots * slot_bytes` bytes of host memory that
    /// only this window writes.
    pub unsafe fn ensure(
        &self,
        base: *mut u8,
        gi: usize,
        weights: &[WeightSpec],
        offsets: &[usize],
        drain: impl FnOnce(),
    ) -> Result<usize, EngineError> {
        if let Some(h) = self
            .state
            .borrow()
            .owner
            .iter()
            .position(|&o| o == Some(gi))
        {
            return Ok(h * self.slot_bytes);
        }
        let ticket = self.inflight.borrow_mut().remove(&gi);
        let t0 = std::time::Instant::now();
        let done = match ticket {
            Some(t) => t.wait()?,
            None => self.submit(weights)?.wait()?,
        };
        let mut st = self.state.borrow_mut();
        st.read_wait += t0.elapsed();
        let cycling = CYCLING.min(self.slots);
        let h = match st.owner.iter().position(|o| o.is_none()) {
            Some(free) => free,
            None => {
                st.next += 1;
                self.slots - cycling + st.next % cycling
            }
        };
        if st.copy_pending[h] {
            drain();
            st.copy_pending.iter_mut().for_each(|p| *p = false);
        }
        st.owner[h] = None;
        // SAFETY: the caller guarantees the window memory; slot h lies inside it.
        let dst = std::slice::from_raw_parts_mut(base.add(h * self.slot_bytes), self.slot_bytes);
        dst.fill(0);
        for (i, (w, o)) in weights.iter().zip(offsets).enumerate() {
            dst[*o..*o + w.size as usize].copy_from_slice(done.data(i));
            st.bytes_read += w.size;
        }
        st.owner[h] = Some(gi);
        Ok(h * self.slot_bytes)
    }

    /// Time spent waiting for reads so far.
    pub fn read_wait(&self) -> std::time::Duration {
        self.state.borrow().read_wait
    }

    /// Notes that an asynchronous copy out of group `gi`'s host slot was enqueued.
    pub fn copy_enqueued_for(&self, gi: usize) {
        let mut st = self.state.borrow_mut();
        if let Some(h) = st.owner.iter().position(|&o| o == Some(gi)) {
            st.copy_pending[h] = true;
        }
    }
}
