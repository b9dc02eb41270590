//! Aligned host buffers and the aligned-window arithmetic of O_DIRECT.
//!
//! O_DIRECT wants the file offset, the length and the memory address of every
//! read to be multiples of the logical block size; 4096 covers every device
//! we meet. [`AlignedWindow::covering`] maps any byte range to the smallest
//! aligned window holding it and says where the wanted bytes start inside.

use super::error::StorageError;
use std::alloc::Layout;
use std::ptr::NonNull;

/// Alignment of file offsets, lengths and buffer addresses for O_DIRECT.
pub const DIRECT_ALIGN: usize = 4096;
const ALIGN64: u64 = DIRECT_ALIGN as u64;

/// The aligned superset of a byte range of a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AlignedWindow {
    /// First file byte read; a multiple of 4096.
    pub start: u64,
    /// Bytes read; a multiple of 4096 (0 for an empty range).
    pub len: u64,
    /// Where the wanted bytes begin inside the window (< 4096).
    pub inner: u64,
}

impl AlignedWindow {
    /// The smallest aligned window covering `[offset, offset + len)`, or
    /// `None` when the end overflows u64.
    pub fn covering(offset: u64, len: u64) -> Option<Self> {
        let end = offset.checked_add(len)?;
        let start = align_down(offset);
        let inner = offset - start;
        if len == 0 {
            return Some(Self {
                start,
                len: 0,
                inner,
            });
        }
        let end = align_up(end)?;
        Some(Self {
            start,
            len: end - start,
            inner,
        })
    }

    /// One past the last file byte of the window.
    pub fn end(&self) -> u64 {
        self.start + self.len
    }
}

/// `x` rounded down to a multiple of 4096.
pub(crate) fn align_down(x: u64) -> u64 {
    x & !(ALIGN64 - 1)
}

/// `x` rounded up to a multiple of 4096, `None` on overflow.
pub(crate) fn align_up(x: u64) -> Option<u64> {
    Some(x.checked_add(ALIGN64 - 1)? & !(ALIGN64 - 1))
}

/// Buffers from this size up are mapped with transparent huge pages.
const HUGE: usize = 2 << 20;

/// A 4096-aligned host buffer: owned (allocated here, freed on drop) or
/// borrowed from an external region (pinned memory the pager got from ggml).
///
/// Owned buffers of 2 MiB or more are their own anonymous mapping, 2 MiB
/// aligned and advised for transparent huge pages: a 1 MiB read then lands
/// in physically contiguous memory, one segment for the device instead of
/// 256 (virtio-blk here takes at most 254 per request and would split it).
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    backing: Backing,
}

/// Who frees an [`AlignedBuf`]'s memory.
#[derive(Clone, Copy, Debug)]
enum Backing {
    /// The global allocator, with this layout.
    Heap(Layout),
    /// munmap of this many bytes.
    Map(usize),
    /// Someone else (from_raw).
    Borrowed,
}

// SAFETY: AlignedBuf is a unique handle to its bytes (like Box<[u8]>); the
// raw pointer is not shared with anything that outlives a move of the handle.
unsafe impl Send for AlignedBuf {}
// SAFETY: shared access only hands out &[u8].
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// Allocates `len` zeroed bytes at a 4096-aligned address (the capacity
    /// is rounded up to 4096, so an aligned window of `len` bytes fits).
    pub fn new(len: usize) -> Result<Self, StorageError> {
        let err = || StorageError::Alloc {
            len,
            align: DIRECT_ALIGN,
        };
        let cap = len
            .max(1)
            .checked_next_multiple_of(DIRECT_ALIGN)
            .ok_or_else(err)?;
        if cap >= HUGE {
            if let Some((ptr, mapped)) = map_huge(cap) {
                return Ok(Self {
                    ptr,
                    len,
                    backing: Backing::Map(mapped),
                });
            }
        }
        let layout = Layout::from_size_align(cap, DIRECT_ALIGN).map_err(|_| err())?;
        // SAFETY: layout has a non-zero size (cap >= 4096).
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).ok_or_else(err)?;
        Ok(Self {
            ptr,
            len,
            backing: Backing::Heap(layout),
        })
    }

    /// Wraps `len` bytes at `ptr` without taking ownership: drop does not
    /// free them. Fails when `ptr` is null or not 4096-aligned.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be valid for reads and writes, initialized (any
    /// bytes), and reached by nothing else from now until this `AlignedBuf`
    /// is dropped: while a read is in flight the kernel writes there, and the
    /// handle may be moved into a [`super::ReadTicket`] and handed back only
    /// when the read is over. The region must outlive the handle.
    pub unsafe fn from_raw(ptr: *mut u8, len: usize) -> Result<Self, StorageError> {
        let ptr =
            NonNull::new(ptr).ok_or_else(|| StorageError::BadDestination("null pointer".into()))?;
        if !(ptr.as_ptr() as usize).is_multiple_of(DIRECT_ALIGN) {
            return Err(StorageError::BadDestination(format!(
                "address {:p} is not {DIRECT_ALIGN}-aligned",
                ptr.as_ptr()
            )));
        }
        Ok(Self {
            ptr,
            len,
            backing: Backing::Borrowed,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// True when drop frees the memory (allocated by [`AlignedBuf::new`]).
    pub fn is_owned(&self) -> bool {
        !matches!(self.backing, Backing::Borrowed)
    }

    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: ptr..ptr+len is valid and initialized (zeroed by `new`, or
        // promised by `from_raw`'s caller), and &self excludes writers.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in deref; &mut self makes this the only access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        match self.backing {
            // SAFETY: ptr came from alloc_zeroed with exactly this layout and
            // is freed once, here.
            Backing::Heap(layout) => unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) },
            // SAFETY: ptr..ptr+mapped is the mapping map_huge made, unmapped
            // once, here.
            Backing::Map(mapped) => unsafe {
                libc::munmap(self.ptr.as_ptr().cast(), mapped);
            },
            Backing::Borrowed => {}
        }
    }
}

/// A zeroed anonymous mapping of at least `cap` bytes, 2 MiB aligned and
/// advised for huge pages; its pointer and mapped length.
fn map_huge(cap: usize) -> Option<(NonNull<u8>, usize)> {
    let mapped = cap.checked_next_multiple_of(HUGE)?;
    let span = mapped.checked_add(HUGE)?;
    // SAFETY: a fresh private anonymous mapping; it aliases nothing.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            span,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        return None;
    }
    let start = raw as usize;
    let aligned = start.next_multiple_of(HUGE);
    let (head, tail) = (aligned - start, span - (aligned - start) - mapped);
    // SAFETY: both ranges are slack of the mapping just made, outside the
    // part kept; the advice only concerns that part.
    unsafe {
        if head > 0 {
            libc::munmap(raw, head);
        }
        if tail > 0 {
            libc::munmap((aligned + mapped) as *mut libc::c_void, tail);
        }
        libc::madvise(aligned as *mut libc::c_void, mapped, libc::MADV_HUGEPAGE);
    }
    Some((NonNull::new(aligned as *mut u8)?, mapped))
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .field("backing", &self.backing)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn window_covers_and_is_aligned(offset in 0u64..(1 << 50), len in 0u64..(1 << 30)) {
            let w = AlignedWindow::covering(offset, len).unwrap();
            prop_assert_eq!(w.start % ALIGN64, 0);
            prop_assert_eq!(w.len % ALIGN64, 0);
            prop_assert_eq!(w.start + w.inner, offset);
            prop_assert!(w.inner < ALIGN64);
            prop_assert!(w.start <= offset);
            prop_assert!(offset + len <= w.end());
            // Minimal: dropping one aligned block from either side uncovers
            // a wanted byte.
            if len > 0 {
                prop_assert!(w.end() - ALIGN64 < offset + len);
                prop_assert!(w.start + ALIGN64 > offset);
                prop_assert!(w.len <= len + 2 * ALIGN64);
            } else {
                prop_assert_eq!(w.len, 0);
            }
        }

        #[test]
        fn window_near_u64_max(offset in (u64::MAX - (1 << 20))..=u64::MAX, len in 0u64..(1 << 21)) {
            match AlignedWindow::covering(offset, len) {
                Some(w) => {
                    prop_assert!(offset.checked_add(len).is_some());
                    prop_assert_eq!(w.start + w.inner, offset);
                    prop_assert!(w.end() >= offset + len);
                }
                None => prop_assert!(
                    offset.checked_add(len).is_none() || align_up(offset + len).is_none()
                ),
            }
        }

        #[test]
        fn owned_buffers_are_aligned_and_zeroed(len in 0usize..100_000) {
            let b = AlignedBuf::new(len).unwrap();
            prop_assert_eq!(b.as_ptr() as usize % DIRECT_ALIGN, 0);
            prop_assert_eq!(b.len(), len);
            prop_assert!(b.iter().all(|&x| x == 0));
        }
    }

    #[test]
    fn large_buffers_are_huge_page_aligned_zeroed_and_writable() {
        for len in [HUGE, HUGE + 1, 5 * HUGE - 4096, 9 << 20] {
            let mut b = AlignedBuf::new(len).unwrap();
            assert!(matches!(b.backing, Backing::Map(m) if m >= len && m % HUGE == 0));
            assert_eq!(b.as_ptr() as usize % HUGE, 0);
            assert_eq!(b.len(), len);
            assert!(b.iter().step_by(4093).all(|&x| x == 0));
            assert_eq!(b[len - 1], 0);
            b[len - 1] = 9;
            b[0] = 7;
            assert_eq!((b[0], b[len - 1]), (7, 9));
        }
    }

    #[test]
    fn aligned_ranges_map_to_themselves() {
        let w = AlignedWindow::covering(8192, 4096 * 3).unwrap();
        assert_eq!((w.start, w.len, w.inner), (8192, 4096 * 3, 0));
    }

    #[test]
    fn from_raw_rejects_misaligned_and_does_not_free() {
        let mut owner = AlignedBuf::new(3 * DIRECT_ALIGN).unwrap();
        let base = owner.as_mut_ptr();
        // SAFETY: base+1 lies in owner's allocation; it is rejected anyway.
        assert!(unsafe { AlignedBuf::from_raw(base.wrapping_add(1), 10) }.is_err());
        // SAFETY: the second block of owner, which outlives the view.
        let mut view =
            unsafe { AlignedBuf::from_raw(base.wrapping_add(DIRECT_ALIGN), DIRECT_ALIGN) }.unwrap();
        view[0] = 7;
        assert!(!view.is_owned());
        drop(view);
        assert_eq!(owner[DIRECT_ALIGN], 7);
    }
}
