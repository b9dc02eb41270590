//! The spill file format: header, entry table, page layout and checksums,
//! and the errors reading or writing one can meet.

use std::io;
use std::path::{Path, PathBuf};

/// File magic, bytes 0..8.
pub const MAGIC: &[u8; 8] = b"STRATAKV";

/// The only format version this build reads and writes.
pub const VERSION: u32 = 1;

/// Header page size and data alignment.
pub const PAGE: u64 = 4096;

/// Bytes per entry-table row.
pub(super) const ENTRY_LEN: u64 = 16;

/// Most entries a file may hold (a bound on what a header can make us allocate).
pub const MAX_ENTRIES: u32 = 1 << 24;

/// Largest extra payload, in bytes.
pub const MAX_EXTRA: u64 = 1 << 30;

/// Shape facts a file must match to be used (checked on open).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvShape {
    /// Identifies the model and KV layout (type, heads, head dim) that wrote the file.
    pub fingerprint: u64,
    /// Bytes of one row (one cell) of K, and of V, in one layer.
    pub row_bytes: u32,
    /// Cells per block; an entry holds at most this many rows.
    pub block_size: u32,
}

/// One entry: rows `[0, n_rows)` of block `block` of layer `layer`; K and V
/// each `n_rows * row_bytes` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EntryDesc {
    pub layer: u32,
    pub block: u32,
    pub n_rows: u32,
}

/// Errors from writing, opening or reading a KV file. Each names the file.
#[derive(Debug, thiserror::Error)]
pub enum SpillError {
    #[error("{}: {op}: {source}", path.display())]
    Io {
        path: PathBuf,
        op: &'static str,
        source: io::Error,
    },
    #[error("{}: corrupt KV file: {what}", path.display())]
    Corrupt { path: PathBuf, what: String },
    #[error("{}: KV file does not fit this cache: {what}", path.display())]
    Mismatch { path: PathBuf, what: String },
    #[error("{}: disk full: {needed} bytes needed, {}", path.display(), avail_text(*available))]
    DiskFull {
        path: PathBuf,
        needed: u64,
        /// Bytes left under the quota; `None` when the file system said ENOSPC/EDQUOT.
        available: Option<u64>,
    },
    /// A request this module refuses (bad buffer size, duplicate entry, ...).
    #[error("{}: invalid request: {what}", path.display())]
    Invalid { path: PathBuf, what: String },
}

pub(super) fn avail_text(a: Option<u64>) -> String {
    match a {
        Some(a) => format!("{a} available under the spill quota"),
        None => "no space left on device".to_string(),
    }
}

impl SpillError {
    /// The file the error is about.
    pub fn path(&self) -> &Path {
        match self {
            SpillError::Io { path, .. }
            | SpillError::Corrupt { path, .. }
            | SpillError::Mismatch { path, .. }
            | SpillError::DiskFull { path, .. }
            | SpillError::Invalid { path, .. } => path,
        }
    }
}

pub(super) fn corrupt(path: &Path, what: impl Into<String>) -> SpillError {
    SpillError::Corrupt {
        path: path.to_path_buf(),
        what: what.into(),
    }
}

pub(super) fn invalid(path: &Path, what: impl Into<String>) -> SpillError {
    SpillError::Invalid {
        path: path.to_path_buf(),
        what: what.into(),
    }
}

pub(super) fn io_err(path: &Path, op: &'static str, source: io::Error) -> SpillError {
    SpillError::Io {
        path: path.to_path_buf(),
        op,
        source,
    }
}

/// Whether `e` means the file system is out of space or over a disk quota.
pub(super) fn is_disk_full(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT))
        || matches!(
            e.kind(),
            io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded
        )
}

/// Maps an error from creating/writing/fsyncing a file of `needed` bytes.
pub(super) fn write_err(path: &Path, op: &'static str, needed: u64, e: io::Error) -> SpillError {
    if is_disk_full(&e) {
        SpillError::DiskFull {
            path: path.to_path_buf(),
            needed,
            available: None,
        }
    } else {
        io_err(path, op, e)
    }
}

pub(super) fn put_u32(b: &mut [u8], off: usize, x: u32) {
    b[off..off + 4].copy_from_slice(&x.to_le_bytes());
}

pub(super) fn put_u64(b: &mut [u8], off: usize, x: u64) {
    b[off..off + 8].copy_from_slice(&x.to_le_bytes());
}

pub(super) fn get_u32(b: &[u8], off: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[off..off + 4]);
    u32::from_le_bytes(a)
}

pub(super) fn get_u64(b: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[off..off + 8]);
    u64::from_le_bytes(a)
}

pub(super) fn align_up(x: u64) -> Option<u64> {
    Some(x.checked_add(PAGE - 1)? / PAGE * PAGE)
}

/// Bytes of K (and of V) for `n_rows` rows.
pub(super) fn kv_len(row_bytes: u32, n_rows: u32) -> u64 {
    // Both factors fit in u32, so the product fits in u64.
    u64::from(row_bytes) * u64::from(n_rows)
}

/// The header page's fields, apart from magic and version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Header {
    pub(super) shape: KvShape,
    pub(super) n_entries: u32,
    pub(super) flags: u32,
    pub(super) extra_len: u64,
    pub(super) file_len: u64,
    pub(super) table_crc: u32,
    pub(super) extra_crc: u32,
}

/// CRC-32 of a header page with its crc field (bytes 12..16) taken as zero.
pub(super) fn page_crc(p: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&p[..12]);
    h.update(&[0; 4]);
    h.update(&p[16..]);
    h.finalize()
}

/// Why a header page was refused.
pub(super) enum BadHeader {
    Corrupt(String),
    Mismatch(String),
}

impl Header {
    pub(super) fn encode(&self) -> Vec<u8> {
        let mut p = vec![0u8; PAGE as usize];
        p[0..8].copy_from_slice(MAGIC);
        put_u32(&mut p, 8, VERSION);
        put_u64(&mut p, 16, self.shape.fingerprint);
        put_u32(&mut p, 24, self.shape.row_bytes);
        put_u32(&mut p, 28, self.shape.block_size);
        put_u32(&mut p, 32, self.n_entries);
        put_u32(&mut p, 36, self.flags);
        put_u64(&mut p, 40, self.extra_len);
        put_u64(&mut p, 48, self.file_len);
        put_u32(&mut p, 56, self.table_crc);
        put_u32(&mut p, 60, self.extra_crc);
        let crc = page_crc(&p);
        put_u32(&mut p, 12, crc);
        p
    }

    /// Decodes a header page (exactly [`PAGE`] bytes), checking magic, CRC,
    /// version and flags.
    pub(super) fn decode(p: &[u8]) -> Result<Header, BadHeader> {
        if &p[0..8] != MAGIC {
            return Err(BadHeader::Corrupt(format!(
                "bad magic {:02x?}, expected \"STRATAKV\": not a strata KV file",
                &p[0..8]
            )));
        }
        let version = get_u32(p, 8);
        let stored = get_u32(p, 12);
        let computed = page_crc(p);
        if stored != computed {
            let hint = if version != VERSION {
                format!(
                    " (version field reads {version}, this build reads {VERSION}: \
                     a damaged header or a file from another strata)"
                )
            } else {
                String::new()
            };
            return Err(BadHeader::Corrupt(format!(
                "header checksum mismatch: stored {stored:#010x}, computed {computed:#010x}{hint}"
            )));
        }
        if version != VERSION {
            return Err(BadHeader::Mismatch(format!(
                "format version {version}, this build reads version {VERSION}"
            )));
        }
        let h = Header {
            shape: KvShape {
                fingerprint: get_u64(p, 16),
                row_bytes: get_u32(p, 24),
                block_size: get_u32(p, 28),
            },
            n_entries: get_u32(p, 32),
            flags: get_u32(p, 36),
            extra_len: get_u64(p, 40),
            file_len: get_u64(p, 48),
            table_crc: get_u32(p, 56),
            extra_crc: get_u32(p, 60),
        };
        if h.flags != 0 {
            return Err(BadHeader::Mismatch(format!(
                "unknown flags {:#x} (this build knows none)",
                h.flags
            )));
        }
        Ok(h)
    }
}

/// Where each part of a file lies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Layout {
    pub(super) extra_off: u64,
    pub(super) data_off: u64,
    /// Start of each entry's K bytes (V follows K directly).
    pub(super) entry_off: Vec<u64>,
    pub(super) file_len: u64,
}

/// The layout for entries of `n_rows` rows each; `None` on u64 overflow.
pub(super) fn layout(row_bytes: u32, n_rows: &[u32], extra_len: u64) -> Option<Layout> {
    let table_len = (n_rows.len() as u64).checked_mul(ENTRY_LEN)?;
    let extra_off = PAGE.checked_add(table_len)?;
    let data_off = align_up(extra_off.checked_add(extra_len)?)?;
    let mut entry_off = Vec::with_capacity(n_rows.len());
    let mut off = data_off;
    for &n in n_rows {
        entry_off.push(off);
        let slot = align_up(kv_len(row_bytes, n).checked_mul(2)?)?;
        off = off.checked_add(slot)?;
    }
    Some(Layout {
        extra_off,
        data_off,
        entry_off,
        file_len: off,
    })
}

pub(super) fn encode_entry(d: &EntryDesc, crc: u32) -> [u8; ENTRY_LEN as usize] {
    let mut b = [0u8; ENTRY_LEN as usize];
    put_u32(&mut b, 0, d.layer);
    put_u32(&mut b, 4, d.block);
    put_u32(&mut b, 8, d.n_rows);
    put_u32(&mut b, 12, crc);
    b
}

/// The entry-identity prefix hashed before an entry's data.
pub(super) fn data_crc_start(d: &EntryDesc) -> crc32fast::Hasher {
    let mut h = crc32fast::Hasher::new();
    let mut id = [0u8; 12];
    put_u32(&mut id, 0, d.layer);
    put_u32(&mut id, 4, d.block);
    put_u32(&mut id, 8, d.n_rows);
    h.update(&id);
    h
}

pub(super) type Entry<'a> = (EntryDesc, &'a [u8], &'a [u8]);
