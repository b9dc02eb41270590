//! Writing spill files: planning the pages, writing through a temporary
//! file and renaming, reserving quota first.

use super::format::align_up;
use super::format::data_crc_start;
use super::format::encode_entry;
use super::format::invalid;
use super::format::io_err;
use super::format::kv_len;
use super::format::layout;
use super::format::write_err;
use super::format::Entry;
use super::format::EntryDesc;
use super::format::Header;
use super::format::KvShape;
use super::format::Layout;
use super::format::SpillError;
use super::format::ENTRY_LEN;
use super::format::MAX_ENTRIES;
use super::format::MAX_EXTRA;
use super::format::PAGE;
use super::quota::Quota;
use std::collections::HashSet;
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// A reservation that goes back to its quota on Drop unless kept.
pub(super) struct Reservation<'q> {
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
pub(super) struct TempFile {
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

/// A validated file image, ready to write.
pub(super) struct Plan<'a> {
    /// Header page, table and extra payload, zero-padded to `data_off`.
    pub(super) prefix: Vec<u8>,
    pub(super) layout: Layout,
    pub(super) entries: &'a [Entry<'a>],
}

/// Checks a write request and builds its header and table.
pub(super) fn plan<'a>(
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

pub(super) static ZEROS: [u8; PAGE as usize] = [0; PAGE as usize];

/// Writes the whole file image of `plan` to `w`. Returns the bytes written.
pub(super) fn write_image<W: Write + ?Sized>(w: &mut W, plan: &Plan) -> io::Result<u64> {
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

pub(super) static TEMP_SEQ: AtomicU64 = AtomicU64::new(0);

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
pub(super) fn write_file_via(
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
