//! On-disk format of KV-cache blocks: one format for spilling blocks to SSD
//! and for saving/loading sessions. Plain Rust, no FFI.
//!
//! "Spill files that cannot lie": every byte a reader hands back has passed a
//! checksum, and every file on disk is either complete or absent.
//!
//! - Writes go to a temp file in the same directory (`.<name>.tmp-<pid>-<n>`),
//!   which is fsynced, renamed over `<name>`, and the directory fsynced. Any
//!   error before the rename removes the temp file; no other file is touched.
//! - A full disk (ENOSPC / EDQUOT) or an exceeded [`Quota`] is
//!   [`SpillError::DiskFull`], with no file and no temp file left behind.
//! - [`KvFile::open`] checks magic, header CRC, version, shape, the entry
//!   table's CRC and bounds, the extra payload's CRC and the exact file length
//!   before returning; [`KvFile::read_entry`] checks each entry's CRC and
//!   zeroes the caller's buffers on any error. Sizes from the file are bounded
//!   by the file's real length before anything is allocated from them.
//! - Every error names the file.
//!
//! Layout (all integers little-endian, explicit encoding):
//!
//! | offset                     | size             | contents                                              |
//! |----------------------------|------------------|-------------------------------------------------------|
//! | 0                          | 4096             | header page (below)                                   |
//! | 4096                       | 16 * n_entries   | entry table: `layer u32, block u32, n_rows u32, data_crc u32` |
//! | 4096 + 16 * n_entries      | extra_len        | extra payload (opaque: session tokens, sampler state) |
//! | data_off (4096-aligned)    | per entry        | K `[row_bytes, n_rows]` then V `[row_bytes, n_rows]`, zero-padded to 4096 |
//!
//! Header page:
//!
//! | offset | type     | field                                                        |
//! |--------|----------|--------------------------------------------------------------|
//! | 0      | `[u8;8]` | magic `STRATAKV`                                             |
//! | 8      | u32      | version (1)                                                  |
//! | 12     | u32      | header_crc: CRC-32 of the whole page with this field zeroed |
//! | 16     | u64      | shape.fingerprint                                            |
//! | 24     | u32      | shape.row_bytes                                              |
//! | 28     | u32      | shape.block_size                                             |
//! | 32     | u32      | n_entries                                                    |
//! | 36     | u32      | flags (0)                                                    |
//! | 40     | u64      | extra_len                                                    |
//! | 48     | u64      | file_len (whole file, a multiple of 4096)                    |
//! | 56     | u32      | table_crc: CRC-32 of the entry table                         |
//! | 60     | u32      | extra_crc: CRC-32 of the extra payload                       |
//! | 64     | 4032     | zero                                                         |
//!
//! The padding between the extra payload and `data_off` must be zero (checked
//! on open); the padding after each entry is not read.
//!
//! `data_crc` is the CRC-32 of `layer, block, n_rows` (u32 LE) followed by the
//! K and V bytes, so data that lands in another entry's slot fails too. Entry
//! `i`'s data starts at `data_off + sum of padded sizes of entries < i`; every
//! entry starts on a 4096 boundary, so a whole padded entry can later be read
//! with O_DIRECT.

use std::collections::HashSet;
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

mod dir;
mod read;

pub use dir::{Quota, QuotaFull, SpillDir};
pub use read::KvFile;

/// File magic, bytes 0..8.
pub const MAGIC: &[u8; 8] = b"STRATAKV";
/// The only format version this build reads and writes.
pub const VERSION: u32 = 1;
/// Header page size and data alignment.
pub const PAGE: u64 = 4096;
/// Bytes per entry-table row.
const ENTRY_LEN: u64 = 16;
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

fn avail_text(a: Option<u64>) -> String {
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

fn corrupt(path: &Path, what: impl Into<String>) -> SpillError {
    SpillError::Corrupt {
        path: path.to_path_buf(),
        what: what.into(),
    }
}

fn invalid(path: &Path, what: impl Into<String>) -> SpillError {
    SpillError::Invalid {
        path: path.to_path_buf(),
        what: what.into(),
    }
}

fn io_err(path: &Path, op: &'static str, source: io::Error) -> SpillError {
    SpillError::Io {
        path: path.to_path_buf(),
        op,
        source,
    }
}

/// Whether `e` means the file system is out of space or over a disk quota.
fn is_disk_full(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT))
        || matches!(
            e.kind(),
            io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded
        )
}

/// Maps an error from creating/writing/fsyncing a file of `needed` bytes.
fn write_err(path: &Path, op: &'static str, needed: u64, e: io::Error) -> SpillError {
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

/// A reservation that goes back to its quota on Drop unless kept.
struct Reservation<'q> {
    quota: Option<&'q Quota>,
    n: u64,
}

impl Reservation<'_> {
    fn keep(mut self) {
        self.quota = None;
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if let Some(q) = self.quota {
            q.release(self.n);
        }
    }
}

/// A temp file that is removed on Drop unless it was renamed into place.
struct TempFile {
    path: PathBuf,
    armed: bool,
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if self.armed {
            if let Err(e) = fs::remove_file(&self.path) {
                tracing::warn!("cannot remove temp file {}: {e}", self.path.display());
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Encoding

fn put_u32(b: &mut [u8], off: usize, x: u32) {
    b[off..off + 4].copy_from_slice(&x.to_le_bytes());
}
fn put_u64(b: &mut [u8], off: usize, x: u64) {
    b[off..off + 8].copy_from_slice(&x.to_le_bytes());
}
fn get_u32(b: &[u8], off: usize) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[off..off + 4]);
    u32::from_le_bytes(a)
}
fn get_u64(b: &[u8], off: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[off..off + 8]);
    u64::from_le_bytes(a)
}

fn align_up(x: u64) -> Option<u64> {
    Some(x.checked_add(PAGE - 1)? / PAGE * PAGE)
}

/// Bytes of K (and of V) for `n_rows` rows.
fn kv_len(row_bytes: u32, n_rows: u32) -> u64 {
    // Both factors fit in u32, so the product fits in u64.
    u64::from(row_bytes) * u64::from(n_rows)
}

/// The header page's fields, apart from magic and version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Header {
    shape: KvShape,
    n_entries: u32,
    flags: u32,
    extra_len: u64,
    file_len: u64,
    table_crc: u32,
    extra_crc: u32,
}

/// CRC-32 of a header page with its crc field (bytes 12..16) taken as zero.
fn page_crc(p: &[u8]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    h.update(&p[..12]);
    h.update(&[0; 4]);
    h.update(&p[16..]);
    h.finalize()
}

/// Why a header page was refused.
enum BadHeader {
    Corrupt(String),
    Mismatch(String),
}

impl Header {
    fn encode(&self) -> Vec<u8> {
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
    fn decode(p: &[u8]) -> Result<Header, BadHeader> {
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
struct Layout {
    extra_off: u64,
    data_off: u64,
    /// Start of each entry's K bytes (V follows K directly).
    entry_off: Vec<u64>,
    file_len: u64,
}

/// The layout for entries of `n_rows` rows each; `None` on u64 overflow.
fn layout(row_bytes: u32, n_rows: &[u32], extra_len: u64) -> Option<Layout> {
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

fn encode_entry(d: &EntryDesc, crc: u32) -> [u8; ENTRY_LEN as usize] {
    let mut b = [0u8; ENTRY_LEN as usize];
    put_u32(&mut b, 0, d.layer);
    put_u32(&mut b, 4, d.block);
    put_u32(&mut b, 8, d.n_rows);
    put_u32(&mut b, 12, crc);
    b
}

/// The entry-identity prefix hashed before an entry's data.
fn data_crc_start(d: &EntryDesc) -> crc32fast::Hasher {
    let mut h = crc32fast::Hasher::new();
    let mut id = [0u8; 12];
    put_u32(&mut id, 0, d.layer);
    put_u32(&mut id, 4, d.block);
    put_u32(&mut id, 8, d.n_rows);
    h.update(&id);
    h
}

type Entry<'a> = (EntryDesc, &'a [u8], &'a [u8]);

/// A validated file image, ready to write.
struct Plan<'a> {
    /// Header page, table and extra payload, zero-padded to `data_off`.
    prefix: Vec<u8>,
    layout: Layout,
    entries: &'a [Entry<'a>],
}

/// Checks a write request and builds its header and table.
fn plan<'a>(
    path: &Path,
    shape: KvShape,
    extra: &[u8],
    entries: &'a [Entry<'a>],
) -> Result<Plan<'a>, SpillError> {
    if shape.row_bytes == 0 || shape.block_size == 0 {
        return Err(invalid(
            path,
            format!(
                "shape has row_bytes {} and block_size {}: both must be > 0",
                shape.row_bytes, shape.block_size
            ),
        ));
    }
    if entries.len() > MAX_ENTRIES as usize {
        return Err(invalid(
            path,
            format!("{} entries, at most {MAX_ENTRIES} per file", entries.len()),
        ));
    }
    let extra_len = extra.len() as u64;
    if extra_len > MAX_EXTRA {
        return Err(invalid(
            path,
            format!("extra payload of {extra_len} bytes, at most {MAX_EXTRA}"),
        ));
    }
    let mut seen = HashSet::with_capacity(entries.len());
    let mut table = Vec::with_capacity(entries.len() * ENTRY_LEN as usize);
    let mut rows = Vec::with_capacity(entries.len());
    for (i, (d, k, v)) in entries.iter().enumerate() {
        let name = format!("entry {i} (layer {}, block {})", d.layer, d.block);
        if d.n_rows == 0 || d.n_rows > shape.block_size {
            return Err(invalid(
                path,
                format!(
                    "{name}: n_rows {} not in 1..={}",
                    d.n_rows, shape.block_size
                ),
            ));
        }
        let want = kv_len(shape.row_bytes, d.n_rows);
        if k.len() as u64 != want || v.len() as u64 != want {
            return Err(invalid(
                path,
                format!(
                    "{name}: K is {} bytes and V {} bytes, expected {want} each ({} rows of {} bytes)",
                    k.len(),
                    v.len(),
                    d.n_rows,
                    shape.row_bytes
                ),
            ));
        }
        if !seen.insert((d.layer, d.block)) {
            return Err(invalid(path, format!("{name}: layer/block listed twice")));
        }
        let mut h = data_crc_start(d);
        h.update(k);
        h.update(v);
        table.extend_from_slice(&encode_entry(d, h.finalize()));
        rows.push(d.n_rows);
    }
    let lay = layout(shape.row_bytes, &rows, extra_len)
        .ok_or_else(|| invalid(path, "file size overflows u64"))?;
    let header = Header {
        shape,
        n_entries: entries.len() as u32,
        flags: 0,
        extra_len,
        file_len: lay.file_len,
        table_crc: crc32fast::hash(&table),
        extra_crc: crc32fast::hash(extra),
    };
    let prefix_len = usize::try_from(lay.data_off)
        .map_err(|_| invalid(path, "header, table and extra payload exceed memory"))?;
    let mut prefix = header.encode();
    prefix.reserve(prefix_len - prefix.len());
    prefix.extend_from_slice(&table);
    prefix.extend_from_slice(extra);
    prefix.resize(prefix_len, 0);
    Ok(Plan {
        prefix,
        layout: lay,
        entries,
    })
}

static ZEROS: [u8; PAGE as usize] = [0; PAGE as usize];

/// Writes the whole file image of `plan` to `w`. Returns the bytes written.
fn write_image<W: Write + ?Sized>(w: &mut W, plan: &Plan) -> io::Result<u64> {
    w.write_all(&plan.prefix)?;
    let mut off = plan.layout.data_off;
    for (i, (_, k, v)) in plan.entries.iter().enumerate() {
        debug_assert_eq!(off, plan.layout.entry_off[i]);
        w.write_all(k)?;
        w.write_all(v)?;
        let used = (k.len() + v.len()) as u64;
        let pad = align_up(used).unwrap_or(used) - used;
        w.write_all(&ZEROS[..pad as usize])?;
        off += used + pad;
    }
    debug_assert_eq!(off, plan.layout.file_len);
    Ok(off)
}

// ---------------------------------------------------------------------------
// Writing

static TEMP_SEQ: AtomicU64 = AtomicU64::new(0);

/// Writes a KV file atomically: temp file in the same directory, fsync,
/// rename over `path`, fsync of the directory. `extra` is an opaque payload
/// (checksummed) for session data. With a `quota`, the file's length is
/// reserved first ([`SpillError::DiskFull`] when over) and kept charged on
/// success; if `path` already existed, its length is released after the
/// rename (the quota is assumed to have been charged for it).
///
/// On any error before the rename, no temp file is left and `path` is
/// untouched. An error fsyncing the directory after the rename is reported
/// as [`SpillError::Io`] and leaves the complete new file in place.
///
/// Returns the bytes written (the file's length).
pub fn write_file(
    path: &Path,
    shape: KvShape,
    extra: &[u8],
    entries: &[(EntryDesc, &[u8], &[u8])],
    quota: Option<&Quota>,
) -> Result<u64, SpillError> {
    write_file_via(path, shape, extra, entries, quota, |f| Box::new(f))
}

/// [`write_file`], writing the temp file's bytes through `wrap(file)` (tests
/// put a failing writer there).
fn write_file_via(
    path: &Path,
    shape: KvShape,
    extra: &[u8],
    entries: &[Entry],
    quota: Option<&Quota>,
    wrap: impl FnOnce(&mut File) -> Box<dyn Write + '_>,
) -> Result<u64, SpillError> {
    let plan = plan(path, shape, extra, entries)?;
    let needed = plan.layout.file_len;
    let name = match path.file_name() {
        Some(n) => n.to_string_lossy().into_owned(),
        None => return Err(invalid(path, "path has no file name")),
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };

    let reservation = match quota {
        Some(q) => {
            q.reserve(needed).map_err(|e| e.at(path))?;
            Reservation {
                quota: Some(q),
                n: needed,
            }
        }
        None => Reservation { quota: None, n: 0 },
    };

    let seq = TEMP_SEQ.fetch_add(1, Ordering::Relaxed);
    let tmp_path = dir.join(format!(".{name}.tmp-{}-{seq}", std::process::id()));
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp_path)
        .map_err(|e| write_err(path, "create temp file", needed, e))?;
    let mut tmp = TempFile {
        path: tmp_path,
        armed: true,
    };

    {
        let mut w = BufWriter::with_capacity(1 << 20, wrap(&mut file));
        write_image(&mut w, &plan).map_err(|e| write_err(path, "write temp file", needed, e))?;
        w.flush()
            .map_err(|e| write_err(path, "write temp file", needed, e))?;
    }
    file.sync_all()
        .map_err(|e| write_err(path, "fsync temp file", needed, e))?;
    drop(file);

    let old_len = fs::symlink_metadata(path)
        .ok()
        .filter(|m| m.is_file())
        .map(|m| m.len());
    fs::rename(&tmp.path, path).map_err(|e| write_err(path, "rename temp file", needed, e))?;
    tmp.armed = false;
    reservation.keep();
    if let (Some(q), Some(old)) = (quota, old_len) {
        q.release(old);
    }

    File::open(&dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io_err(path, "fsync directory", e))?;
    Ok(needed)
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) const SHAPE: KvShape = KvShape {
        fingerprint: 0x5eed_f00d_1234_5678,
        row_bytes: 96,
        block_size: 16,
    };

    pub(super) fn data(seed: u8, n: usize) -> Vec<u8> {
        (0..n)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    /// Entry descriptors and their K/V bytes.
    pub(super) fn sample() -> Vec<(EntryDesc, Vec<u8>, Vec<u8>)> {
        [(0, 0, 16), (0, 1, 5), (3, 7, 1)]
            .iter()
            .enumerate()
            .map(|(i, &(layer, block, n_rows))| {
                let n = (n_rows * SHAPE.row_bytes) as usize;
                let d = EntryDesc {
                    layer,
                    block,
                    n_rows,
                };
                (d, data(2 * i as u8, n), data(2 * i as u8 + 1, n))
            })
            .collect()
    }

    pub(super) fn refs(s: &[(EntryDesc, Vec<u8>, Vec<u8>)]) -> Vec<Entry<'_>> {
        s.iter()
            .map(|(d, k, v)| (*d, k.as_slice(), v.as_slice()))
            .collect()
    }

    pub(super) fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn header_round_trip() {
        let h = Header {
            shape: SHAPE,
            n_entries: 3,
            flags: 0,
            extra_len: 77,
            file_len: 5 * PAGE,
            table_crc: 0xdead_beef,
            extra_crc: 0x1234_5678,
        };
        let p = h.encode();
        assert_eq!(p.len(), PAGE as usize);
        assert_eq!(&p[..8], b"STRATAKV");
        assert!(matches!(Header::decode(&p), Ok(d) if d == h));
    }

    #[test]
    fn layout_aligns_every_entry() {
        // K+V of 16 rows * 96 bytes = 3072 -> one page; 100 rows -> 19200 -> 5 pages.
        let l = layout(96, &[16, 100, 1], 10).unwrap();
        assert_eq!(l.extra_off, PAGE + 3 * ENTRY_LEN);
        assert_eq!(l.data_off, 2 * PAGE);
        assert_eq!(l.entry_off, vec![2 * PAGE, 3 * PAGE, 8 * PAGE]);
        assert_eq!(l.file_len, 9 * PAGE);
        assert!(layout(u32::MAX, &[u32::MAX; 4], 0).is_none());
        assert_eq!(layout(96, &[], 0).unwrap().file_len, PAGE);
    }

    #[test]
    fn write_image_matches_layout() {
        let s = sample();
        let e = refs(&s);
        let p = plan(Path::new("x"), SHAPE, b"extra", &e).unwrap();
        let mut out = Vec::new();
        let n = write_image(&mut out, &p).unwrap();
        assert_eq!(n, out.len() as u64);
        assert_eq!(n, p.layout.file_len);
        for (i, (_, k, v)) in s.iter().enumerate() {
            let o = p.layout.entry_off[i] as usize;
            assert_eq!(o % PAGE as usize, 0);
            assert_eq!(&out[o..o + k.len()], k.as_slice());
            assert_eq!(&out[o + k.len()..o + 2 * k.len()], v.as_slice());
        }
    }

    #[test]
    fn dev_full_write_is_disk_full() {
        let Ok(mut f) = OpenOptions::new().write(true).open("/dev/full") else {
            eprintln!("skipping: /dev/full not available");
            return;
        };
        let s = sample();
        let e = refs(&s);
        let p = plan(Path::new("/spill/a.kv"), SHAPE, b"", &e).unwrap();
        let err = write_image(&mut f, &p).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ENOSPC));
        let mapped = write_err(Path::new("/spill/a.kv"), "write temp file", 42, err);
        assert!(
            matches!(&mapped, SpillError::DiskFull { path, needed: 42, available: None }
                if path == Path::new("/spill/a.kv")),
            "{mapped:?}"
        );
        assert!(mapped.to_string().contains("/spill/a.kv"));
    }

    /// Passes `left` bytes through, then fails every write with `errno`.
    struct FailAfter<W> {
        inner: W,
        left: usize,
        errno: i32,
    }

    impl<W: Write> Write for FailAfter<W> {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            if self.left == 0 {
                return Err(io::Error::from_raw_os_error(self.errno));
            }
            let n = self.inner.write(&buf[..buf.len().min(self.left)])?;
            self.left -= n;
            Ok(n)
        }
        fn flush(&mut self) -> io::Result<()> {
            self.inner.flush()
        }
    }

    /// A write that fails after `left` bytes with `errno`, into a directory
    /// holding one good file: returns the error, checking that no temp file
    /// is left, the target does not exist, the other file is intact and the
    /// quota is unchanged.
    fn failing_write(left: usize, errno: i32) -> SpillError {
        let d = tempfile::tempdir().unwrap();
        let s = sample();
        let e = refs(&s);
        let quota = Quota::new(1 << 30);
        let keep = d.path().join("keep.kv");
        write_file(&keep, SHAPE, b"keep", &e, Some(&quota)).unwrap();
        let keep_bytes = fs::read(&keep).unwrap();
        let used = quota.used();

        let target = d.path().join("new.kv");
        let err = write_file_via(&target, SHAPE, b"new", &e, Some(&quota), |f| {
            Box::new(FailAfter {
                inner: f,
                left,
                errno,
            })
        })
        .unwrap_err();
        assert_eq!(names(d.path()), vec!["keep.kv".to_string()]);
        assert_eq!(fs::read(&keep).unwrap(), keep_bytes);
        assert_eq!(quota.used(), used);
        assert!(KvFile::open(&keep, SHAPE).is_ok());
        assert!(err.to_string().contains("new.kv"), "{err}");
        err
    }

    #[test]
    fn enospc_mid_write_is_disk_full_and_cleans_up() {
        for left in [0, 100, 4096, 5000, 9000] {
            let err = failing_write(left, libc::ENOSPC);
            assert!(
                matches!(
                    err,
                    SpillError::DiskFull {
                        available: None,
                        ..
                    }
                ),
                "{err:?}"
            );
        }
    }

    #[test]
    fn edquot_is_disk_full() {
        let err = failing_write(4096, libc::EDQUOT);
        assert!(matches!(err, SpillError::DiskFull { .. }), "{err:?}");
    }

    #[test]
    fn eio_is_io_and_cleans_up() {
        let err = failing_write(5000, libc::EIO);
        assert!(
            matches!(
                err,
                SpillError::Io {
                    op: "write temp file",
                    ..
                }
            ),
            "{err:?}"
        );
    }

    #[test]
    fn write_refuses_bad_requests() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("bad.kv");
        let k = [0u8; 96];
        let one = EntryDesc {
            layer: 0,
            block: 0,
            n_rows: 1,
        };
        let cases: Vec<(KvShape, Vec<Entry>)> = vec![
            (
                KvShape {
                    row_bytes: 0,
                    ..SHAPE
                },
                vec![],
            ),
            (
                SHAPE,
                vec![(EntryDesc { n_rows: 0, ..one }, &[][..], &[][..])],
            ),
            (
                SHAPE,
                vec![(EntryDesc { n_rows: 2, ..one }, &k[..], &k[..])],
            ),
            (SHAPE, vec![(one, &k[..], &k[..95])]),
            (SHAPE, vec![(one, &k[..], &k[..]), (one, &k[..], &k[..])]),
        ];
        for (shape, e) in cases {
            let err = write_file(&path, shape, b"", &e, None).unwrap_err();
            assert!(matches!(err, SpillError::Invalid { .. }), "{err:?}");
            assert!(err.to_string().contains("bad.kv"));
        }
        assert!(names(d.path()).is_empty());
    }
}
