//! Opening and reading KV files: every check of the format, in the order a
//! reader can trust the bytes (header CRC before header fields, table CRC
//! before entry sizes, entry CRC before entry data).

use super::format::corrupt;
use super::format::data_crc_start;
use super::format::get_u32;
use super::format::invalid;
use super::format::io_err;
use super::format::kv_len;
use super::format::layout;
use super::format::BadHeader;
use super::format::EntryDesc;
use super::format::Header;
use super::format::KvShape;
use super::format::Layout;
use super::format::SpillError;
use super::format::ENTRY_LEN;
use super::format::MAX_ENTRIES;
use super::format::MAX_EXTRA;
use super::format::PAGE;
use std::collections::HashSet;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// An opened KV file whose header, entry table, extra payload and length have
/// been checked. Entry data is checked on each [`KvFile::read_entry`].
#[derive(Debug)]
pub struct KvFile {
    path: PathBuf,
    file: File,
    shape: KvShape,
    entries: Vec<EntryDesc>,
    crcs: Vec<u32>,
    layout: Layout,
    extra: Vec<u8>,
}

/// Reads `buf.len()` bytes at `off`; a short file is Corrupt "truncated".
fn read_exact_at(
    file: &File,
    path: &Path,
    off: u64,
    buf: &mut [u8],
    what: &str,
) -> Result<(), SpillError> {
    file.read_exact_at(buf, off).map_err(|e| {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            corrupt(
                path,
                format!(
                    "truncated: {what} at bytes {off}..{} runs past the end of the file",
                    off + buf.len() as u64
                ),
            )
        } else {
            io_err(path, "read", e)
        }
    })
}

impl KvFile {
    /// Opens `path` and checks it against `expect`: magic, header CRC,
    /// version, shape ([`SpillError::Mismatch`] naming the field), entry
    /// table CRC and bounds, extra payload CRC, and that the file is exactly
    /// as long as its entries need (Corrupt "truncated: ..." when shorter).
    pub fn open(path: &Path, expect: KvShape) -> Result<KvFile, SpillError> {
        if expect.row_bytes == 0 || expect.block_size == 0 {
            return Err(invalid(
                path,
                format!(
                    "expected shape has row_bytes {} and block_size {}: both must be > 0",
                    expect.row_bytes, expect.block_size
                ),
            ));
        }
        let file = File::open(path).map_err(|e| io_err(path, "open", e))?;
        let meta = file.metadata().map_err(|e| io_err(path, "stat", e))?;
        if !meta.is_file() {
            return Err(invalid(path, "not a regular file"));
        }
        let len = meta.len();
        if len == 0 {
            return Err(corrupt(path, "truncated: empty file (0 bytes)"));
        }
        if len < PAGE {
            return Err(corrupt(
                path,
                format!("truncated: file is {len} bytes, shorter than the {PAGE}-byte header"),
            ));
        }

        let mut page = vec![0u8; PAGE as usize];
        read_exact_at(&file, path, 0, &mut page, "header")?;
        let h = Header::decode(&page).map_err(|b| match b {
            BadHeader::Corrupt(what) => corrupt(path, what),
            BadHeader::Mismatch(what) => SpillError::Mismatch {
                path: path.to_path_buf(),
                what,
            },
        })?;
        check_shape(path, h.shape, expect)?;

        if len < h.file_len {
            return Err(corrupt(
                path,
                format!("truncated: file is {len} bytes, header says {}", h.file_len),
            ));
        }
        if len > h.file_len {
            return Err(corrupt(
                path,
                format!(
                    "file is {len} bytes, header says {}: trailing data",
                    h.file_len
                ),
            ));
        }
        // Bound everything the header sizes before allocating from them.
        // Every entry takes at least one page of data.
        let n = u64::from(h.n_entries);
        let min_len = n
            .checked_mul(PAGE)
            .and_then(|d| d.checked_add(PAGE + n * ENTRY_LEN))
            .and_then(|d| d.checked_add(h.extra_len));
        if h.n_entries > MAX_ENTRIES || h.extra_len > MAX_EXTRA || min_len.is_none_or(|m| m > len) {
            return Err(corrupt(
                path,
                format!(
                    "header lists {} entries and {} extra bytes, more than a {len}-byte file \
                     can hold (limits {MAX_ENTRIES} entries, {MAX_EXTRA} extra bytes)",
                    h.n_entries, h.extra_len
                ),
            ));
        }

        let mut table = vec![0u8; (n * ENTRY_LEN) as usize];
        read_exact_at(&file, path, PAGE, &mut table, "entry table")?;
        let computed = crc32fast::hash(&table);
        if computed != h.table_crc {
            return Err(corrupt(
                path,
                format!(
                    "entry table checksum mismatch: stored {:#010x}, computed {computed:#010x}",
                    h.table_crc
                ),
            ));
        }
        let mut entries = Vec::with_capacity(h.n_entries as usize);
        let mut crcs = Vec::with_capacity(h.n_entries as usize);
        let mut seen = HashSet::with_capacity(h.n_entries as usize);
        for (i, row) in table.chunks_exact(ENTRY_LEN as usize).enumerate() {
            let d = EntryDesc {
                layer: get_u32(row, 0),
                block: get_u32(row, 4),
                n_rows: get_u32(row, 8),
            };
            if d.n_rows == 0 || d.n_rows > h.shape.block_size {
                return Err(corrupt(
                    path,
                    format!(
                        "entry {i} (layer {}, block {}): n_rows {} not in 1..={}",
                        d.layer, d.block, d.n_rows, h.shape.block_size
                    ),
                ));
            }
            if !seen.insert((d.layer, d.block)) {
                return Err(corrupt(
                    path,
                    format!(
                        "entry {i} (layer {}, block {}) listed twice",
                        d.layer, d.block
                    ),
                ));
            }
            entries.push(d);
            crcs.push(get_u32(row, 12));
        }
        let rows: Vec<u32> = entries.iter().map(|d| d.n_rows).collect();
        let lay = layout(h.shape.row_bytes, &rows, h.extra_len)
            .ok_or_else(|| corrupt(path, "entry sizes overflow u64"))?;
        if lay.file_len != h.file_len {
            return Err(corrupt(
                path,
                format!(
                    "entries need a {}-byte file, header says {}",
                    lay.file_len, h.file_len
                ),
            ));
        }

        // The extra payload and the zero padding up to the first entry.
        let mut extra = vec![0u8; (lay.data_off - lay.extra_off) as usize];
        read_exact_at(&file, path, lay.extra_off, &mut extra, "extra payload")?;
        let pad = extra.split_off(h.extra_len as usize);
        let computed = crc32fast::hash(&extra);
        if computed != h.extra_crc {
            return Err(corrupt(
                path,
                format!(
                    "extra payload checksum mismatch: stored {:#010x}, computed {computed:#010x}",
                    h.extra_crc
                ),
            ));
        }
        if let Some(i) = pad.iter().position(|&b| b != 0) {
            return Err(corrupt(
                path,
                format!(
                    "nonzero byte at offset {} in the padding before the entry data",
                    lay.extra_off + h.extra_len + i as u64
                ),
            ));
        }
        Ok(KvFile {
            path: path.to_path_buf(),
            file,
            shape: h.shape,
            entries,
            crcs,
            layout: lay,
            extra,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
    pub fn shape(&self) -> KvShape {
        self.shape
    }
    /// The file's length in bytes.
    pub fn file_len(&self) -> u64 {
        self.layout.file_len
    }
    /// The opaque payload given to [`write_file`](super::write_file) (checked on open).
    pub fn extra(&self) -> &[u8] {
        &self.extra
    }
    pub fn entries(&self) -> &[EntryDesc] {
        &self.entries
    }
    /// Index of the entry for (layer, block).
    pub fn find(&self, layer: u32, block: u32) -> Option<usize> {
        self.entries
            .iter()
            .position(|d| d.layer == layer && d.block == block)
    }
    /// Bytes of K (and of V) in entry `i`: `n_rows * row_bytes`.
    pub fn entry_bytes(&self, i: usize) -> Option<usize> {
        let d = self.entries.get(i)?;
        usize::try_from(kv_len(self.shape.row_bytes, d.n_rows)).ok()
    }
    /// File offset of entry `i`'s K bytes (4096-aligned; V follows K).
    pub fn entry_offset(&self, i: usize) -> Option<u64> {
        self.layout.entry_off.get(i).copied()
    }

    /// Reads entry `i` into `k` and `v` (each exactly `n_rows * row_bytes`
    /// long) and checks its CRC. On any error both buffers are zeroed, so
    /// unchecked data never reaches the caller; a CRC mismatch is
    /// [`SpillError::Corrupt`] naming the layer and block.
    pub fn read_entry(&mut self, i: usize, k: &mut [u8], v: &mut [u8]) -> Result<(), SpillError> {
        let Some(&d) = self.entries.get(i) else {
            return Err(invalid(
                &self.path,
                format!("entry {i} asked, the file has {}", self.entries.len()),
            ));
        };
        let want = kv_len(self.shape.row_bytes, d.n_rows);
        if k.len() as u64 != want || v.len() as u64 != want {
            return Err(invalid(
                &self.path,
                format!(
                    "entry {i} (layer {}, block {}): buffers of {} and {} bytes, expected {want} each",
                    d.layer,
                    d.block,
                    k.len(),
                    v.len()
                ),
            ));
        }
        let r = self.read_checked(i, d, k, v);
        if r.is_err() {
            k.fill(0);
            v.fill(0);
        }
        r
    }

    fn read_checked(
        &self,
        i: usize,
        d: EntryDesc,
        k: &mut [u8],
        v: &mut [u8],
    ) -> Result<(), SpillError> {
        let off = self.layout.entry_off[i];
        let name = format!("entry {i} (layer {}, block {})", d.layer, d.block);
        read_exact_at(&self.file, &self.path, off, k, &format!("{name} K"))?;
        read_exact_at(
            &self.file,
            &self.path,
            off + k.len() as u64,
            v,
            &format!("{name} V"),
        )?;
        let mut h = data_crc_start(&d);
        h.update(k);
        h.update(v);
        let computed = h.finalize();
        if computed != self.crcs[i] {
            return Err(corrupt(
                &self.path,
                format!(
                    "{name}: data checksum mismatch: stored {:#010x}, computed {computed:#010x}",
                    self.crcs[i]
                ),
            ));
        }
        Ok(())
    }

    /// [`KvFile::read_entry`] into fresh buffers.
    pub fn read_entry_vec(&mut self, i: usize) -> Result<(Vec<u8>, Vec<u8>), SpillError> {
        let n = self.entry_bytes(i).ok_or_else(|| {
            invalid(
                &self.path,
                format!("entry {i} asked, the file has {}", self.entries.len()),
            )
        })?;
        let (mut k, mut v) = (vec![0u8; n], vec![0u8; n]);
        self.read_entry(i, &mut k, &mut v)?;
        Ok((k, v))
    }
}

fn check_shape(path: &Path, got: KvShape, expect: KvShape) -> Result<(), SpillError> {
    let what = if got.fingerprint != expect.fingerprint {
        format!(
            "fingerprint: file has {:#018x}, expected {:#018x} (written by another model or KV layout)",
            got.fingerprint, expect.fingerprint
        )
    } else if got.row_bytes != expect.row_bytes {
        format!(
            "row_bytes: file has {}, expected {}",
            got.row_bytes, expect.row_bytes
        )
    } else if got.block_size != expect.block_size {
        format!(
            "block_size: file has {}, expected {}",
            got.block_size, expect.block_size
        )
    } else {
        return Ok(());
    };
    Err(SpillError::Mismatch {
        path: path.to_path_buf(),
        what,
    })
}

#[cfg(test)]
mod tests {
    use super::super::format::{page_crc, put_u32, Entry, VERSION};
    use super::super::tests::{data, refs, sample, SHAPE};
    use super::super::write::{plan, write_file, write_image};
    use super::*;
    use std::fs;

    /// Writes a file whose header and table are re-signed after `edit`, as a
    /// malicious writer would, and returns the open error.
    fn open_forged(edit: impl FnOnce(&mut Header, &mut Vec<u8>)) -> SpillError {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("forged.kv");
        let s = sample();
        let e = refs(&s);
        let p = plan(&path, SHAPE, b"xyz", &e).unwrap();
        let mut img = Vec::new();
        write_image(&mut img, &p).unwrap();
        let mut h = match Header::decode(&img[..PAGE as usize]) {
            Ok(h) => h,
            Err(_) => panic!("fresh header must decode"),
        };
        let mut table = img[PAGE as usize..(PAGE + 3 * ENTRY_LEN) as usize].to_vec();
        edit(&mut h, &mut table);
        h.table_crc = crc32fast::hash(&table);
        let n = table.len().min(3 * ENTRY_LEN as usize);
        img[PAGE as usize..PAGE as usize + n].copy_from_slice(&table[..n]);
        img[..PAGE as usize].copy_from_slice(&h.encode());
        fs::write(&path, &img).unwrap();
        let err = KvFile::open(&path, SHAPE).unwrap_err();
        assert!(err.to_string().contains("forged.kv"), "{err}");
        err
    }

    fn is_corrupt(e: &SpillError, needle: &str) -> bool {
        matches!(e, SpillError::Corrupt { what, .. } if what.contains(needle))
    }

    #[test]
    fn forged_absurd_n_entries_is_corrupt() {
        let e = open_forged(|h, _| h.n_entries = u32::MAX);
        assert!(is_corrupt(&e, "entries"), "{e:?}");
        let e = open_forged(|h, _| h.n_entries = 1000);
        assert!(is_corrupt(&e, "entries"), "{e:?}");
    }

    #[test]
    fn forged_absurd_extra_len_is_corrupt() {
        let e = open_forged(|h, _| h.extra_len = u64::MAX - 5);
        assert!(is_corrupt(&e, "extra"), "{e:?}");
        let e = open_forged(|h, _| h.extra_len = 1 << 20);
        assert!(is_corrupt(&e, "extra"), "{e:?}");
    }

    #[test]
    fn forged_n_rows_over_block_size_is_corrupt() {
        let e = open_forged(|_, t| put_u32(t, ENTRY_LEN as usize + 8, SHAPE.block_size + 1));
        assert!(is_corrupt(&e, "n_rows 17"), "{e:?}");
        let e = open_forged(|_, t| put_u32(t, 8, 0));
        assert!(is_corrupt(&e, "n_rows 0"), "{e:?}");
    }

    #[test]
    fn forged_duplicate_entry_is_corrupt() {
        // Entry 1 becomes (layer 0, block 0), like entry 0.
        let e = open_forged(|_, t| put_u32(t, ENTRY_LEN as usize + 4, 0));
        assert!(is_corrupt(&e, "listed twice"), "{e:?}");
    }

    #[test]
    fn forged_file_len_is_corrupt() {
        // Claims two entries: the layout needs one page less than file_len.
        let e = open_forged(|h, t| {
            h.n_entries = 2;
            t.truncate(2 * ENTRY_LEN as usize);
        });
        assert!(is_corrupt(&e, "entries need"), "{e:?}");
        let e = open_forged(|h, _| h.file_len += PAGE);
        assert!(is_corrupt(&e, "truncated"), "{e:?}");
    }

    #[test]
    fn forged_version_and_flags_are_mismatch() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("v2.kv");
        write_file(&path, SHAPE, b"", &[], None).unwrap();
        let mut img = fs::read(&path).unwrap();
        put_u32(&mut img, 8, 2);
        let crc = page_crc(&img[..PAGE as usize]);
        put_u32(&mut img, 12, crc);
        fs::write(&path, &img).unwrap();
        let e = KvFile::open(&path, SHAPE).unwrap_err();
        assert!(
            matches!(&e, SpillError::Mismatch { what, .. } if what.contains("version 2")),
            "{e:?}"
        );
        put_u32(&mut img, 8, VERSION);
        put_u32(&mut img, 36, 1);
        let crc = page_crc(&img[..PAGE as usize]);
        put_u32(&mut img, 12, crc);
        fs::write(&path, &img).unwrap();
        let e = KvFile::open(&path, SHAPE).unwrap_err();
        assert!(
            matches!(&e, SpillError::Mismatch { what, .. } if what.contains("flags")),
            "{e:?}"
        );
    }

    #[test]
    fn swapped_entry_data_is_corrupt() {
        // Two entries of equal size with their data slots swapped: each
        // slot's CRC is bound to its (layer, block), so both fail.
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("swap.kv");
        let n = (4 * SHAPE.row_bytes) as usize;
        let (ka, va, kb, vb) = (data(1, n), data(2, n), data(3, n), data(4, n));
        let a = EntryDesc {
            layer: 0,
            block: 0,
            n_rows: 4,
        };
        let b = EntryDesc {
            layer: 0,
            block: 1,
            ..a
        };
        let e: Vec<Entry> = vec![(a, &ka[..], &va[..]), (b, &kb[..], &vb[..])];
        write_file(&path, SHAPE, b"", &e, None).unwrap();
        let mut img = fs::read(&path).unwrap();
        let (o0, o1) = (2 * PAGE as usize, 3 * PAGE as usize);
        let slot0 = img[o0..o1].to_vec();
        img.copy_within(o1..o1 + PAGE as usize, o0);
        img[o1..o1 + PAGE as usize].copy_from_slice(&slot0);
        fs::write(&path, &img).unwrap();
        let mut f = KvFile::open(&path, SHAPE).unwrap();
        for i in 0..2 {
            let e = f.read_entry_vec(i).unwrap_err();
            assert!(is_corrupt(&e, "checksum"), "{e:?}");
        }
    }
}
