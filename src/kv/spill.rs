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

mod dir;
mod format;
mod quota;
mod read;
mod write;

pub use dir::SpillDir;
pub use format::{EntryDesc, KvShape, SpillError, MAGIC, MAX_ENTRIES, MAX_EXTRA, PAGE, VERSION};
pub use quota::{Quota, QuotaFull};
pub use read::KvFile;
pub use write::write_file;

#[cfg(test)]
mod tests {
    use super::format::*;
    use super::write::*;
    use super::*;
    use std::fs::{self, OpenOptions};
    use std::io::{self, Write};
    use std::path::Path;

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
