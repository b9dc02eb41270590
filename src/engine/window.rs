//! The DRAM tier: when the streamed groups do not fit in the host memory
//! budget, a window of W pinned host slots holds the groups nearest in the
//! step order and the rest are read from the model file (O_DIRECT through
//! `crate::storage`) as the step moves through the layers.
//!
//! Slot h of the window receives streamed uploads h, h+W, h+2W, ... (round
//! robin in step order), so the group evicted is always the one furthest
//! behind. A host slot is only overwritten once the copy that read it has
//! completed (the copy stream is drained first when it may still be
//! pending). Reads are synchronous: they happen when the pager needs the
//! group, not ahead of it (see the issue notes).

use super::EngineError;
use crate::model::WeightSpec;
use crate::storage::{
    AlignedBuf, AlignedWindow, ExtentReader, ReadRequest, Reader, ReaderConfig, DIRECT_ALIGN,
};
use std::cell::RefCell;
use std::path::Path;

/// Window state: which group each host slot holds.
pub struct DramWindow {
    pub slots: usize,
    pub slot_bytes: usize,
    reader: Reader,
    state: RefCell<State>,
}

struct State {
    owner: Vec<Option<usize>>,
    /// An asynchronous copy out of this slot may still be running.
    copy_pending: Vec<bool>,
    next: usize,
    pub bytes_read: u64,
}

impl DramWindow {
    pub fn new(path: &Path, slots: usize, slot_bytes: usize) -> Result<DramWindow, EngineError> {
        let reader = Reader::open(path, ReaderConfig::default())?;
        Ok(DramWindow {
            slots,
            slot_bytes,
            reader,
            state: RefCell::new(State {
                owner: vec![None; slots],
                copy_pending: vec![false; slots],
                next: 0,
                bytes_read: 0,
            }),
        })
    }

    /// Bytes read from the file so far.
    pub fn bytes_read(&self) -> u64 {
        self.state.borrow().bytes_read
    }

    /// Makes group `gi` present in a host slot of `base` (the pinned window
    /// buffer), reading its tensors into the slot layout (`offsets`) if it is
    /// not there. `drain` waits for pending copies before a slot whose data
    /// may still be copying is overwritten. Returns the slot's byte offset.
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
        let mut st = self.state.borrow_mut();
        if let Some(h) = st.owner.iter().position(|&o| o == Some(gi)) {
            return Ok(h * self.slot_bytes);
        }
        let h = st.next % self.slots;
        st.next += 1;
        if st.copy_pending[h] {
            drain();
            st.copy_pending.iter_mut().for_each(|p| *p = false);
        }
        st.owner[h] = None;
        // one aligned read per tensor, all in flight together
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
        let done = self
            .reader
            .submit(AlignedBuf::new(off.max(DIRECT_ALIGN))?, &reqs)?
            .wait()?;
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

    /// Notes that an asynchronous copy out of group `gi`'s host slot was enqueued.
    pub fn copy_enqueued_for(&self, gi: usize) {
        let mut st = self.state.borrow_mut();
        if let Some(h) = st.owner.iter().position(|&o| o == Some(gi)) {
            st.copy_pending[h] = true;
        }
    }
}
