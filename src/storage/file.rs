//! Opening the model file (O_DIRECT when the file system takes it) and
//! noticing when it changes under us.
//!
//! At open we record the file's identity (device, inode, size, mtime).
//! [`OpenFile::check`] compares the open descriptor (size, mtime: the file
//! was written or truncated in place) and the path (gone, or now another
//! inode) against it.

use super::error::StorageError;
use super::fault::FaultPlan;
use std::fs::{File, Metadata, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Once};

/// What identifies the bytes we opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct FileIdent {
    dev: u64,
    ino: u64,
    pub size: u64,
    mtime_ns: i128,
}

impl FileIdent {
    fn of(m: &Metadata) -> Self {
        Self {
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            mtime_ns: m.mtime() as i128 * 1_000_000_000 + m.mtime_nsec() as i128,
        }
    }
}

/// The model file, opened for reading.
#[derive(Debug)]
pub(crate) struct OpenFile {
    pub file: File,
    pub path: PathBuf,
    /// Opened with O_DIRECT (and a probe read worked).
    pub direct: bool,
    pub ident: FileIdent,
}

static NO_DIRECT: Once = Once::new();

impl OpenFile {
    /// Opens `path`, with O_DIRECT when `try_direct` and the file system
    /// accepts both the flag and an aligned probe read; otherwise buffered.
    pub fn open(path: &Path, try_direct: bool) -> Result<Self, StorageError> {
        let open_err = |e: io::Error| StorageError::Open {
            path: path.to_path_buf(),
            source: Arc::new(e),
        };
        let mut direct = false;
        let mut file = None;
        if try_direct {
            match OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECT)
                .open(path)
            {
                Ok(f) if probe_direct(&f) => {
                    file = Some(f);
                    direct = true;
                }
                Ok(_) => warn_no_direct(path, "an aligned O_DIRECT read failed"),
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    warn_no_direct(path, "the file system refuses O_DIRECT")
                }
                Err(e) => return Err(open_err(e)),
            }
        }
        let file = match file {
            Some(f) => f,
            None => File::open(path).map_err(open_err)?,
        };
        let meta = file.metadata().map_err(open_err)?;
        if !meta.is_file() {
            return Err(StorageError::NotRegular {
                path: path.to_path_buf(),
            });
        }
        Ok(Self {
            file,
            path: path.to_path_buf(),
            direct,
            ident: FileIdent::of(&meta),
        })
    }

    /// Err when the file was changed in place, replaced or deleted since it
    /// was opened (or a fault plan pretends it shrank).
    pub fn check(&self, faults: Option<&FaultPlan>) -> Result<(), StorageError> {
        let path = || self.path.clone();
        if let Some(size) = faults.and_then(|f| f.simulated_size()) {
            return Err(StorageError::Changed {
                path: path(),
                what: format!("size {} -> {size}", self.ident.size),
            });
        }
        let now = self.file.metadata().map(|m| FileIdent::of(&m));
        let now = now.map_err(|e| StorageError::Changed {
            path: path(),
            what: format!("cannot stat the open file: {e}"),
        })?;
        if now.size != self.ident.size {
            return Err(StorageError::Changed {
                path: path(),
                what: format!("size {} -> {}", self.ident.size, now.size),
            });
        }
        if now.mtime_ns != self.ident.mtime_ns {
            return Err(StorageError::Changed {
                path: path(),
                what: "modified (mtime changed)".into(),
            });
        }
        match std::fs::metadata(&self.path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                Err(StorageError::Missing { path: path() })
            }
            Err(e) => Err(StorageError::Changed {
                path: path(),
                what: format!("cannot stat the path: {e}"),
            }),
            Ok(m) if FileIdent::of(&m) != self.ident => Err(StorageError::Changed {
                path: path(),
                what: "the path now names another file".into(),
            }),
            Ok(_) => Ok(()),
        }
    }

    /// The current size of the open file (for error messages).
    pub fn size_now(&self, faults: Option<&FaultPlan>) -> u64 {
        if let Some(size) = faults.and_then(|f| f.simulated_size()) {
            return size;
        }
        self.file.metadata().map(|m| m.size()).unwrap_or(0)
    }
}

/// Reads the first aligned block with O_DIRECT: some file systems accept
/// the flag at open and fail the reads with EINVAL.
fn probe_direct(f: &File) -> bool {
    let Ok(mut buf) = super::align::AlignedBuf::new(super::align::DIRECT_ALIGN) else {
        return false;
    };
    loop {
        match f.read_at(&mut buf, 0) {
            Ok(_) => return true,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => return false,
        }
    }
}

fn warn_no_direct(path: &Path, why: &str) {
    NO_DIRECT.call_once(|| {
        tracing::warn!(
            "{}: {why}; reading through the page cache instead (said once)",
            path.display()
        )
    });
}
