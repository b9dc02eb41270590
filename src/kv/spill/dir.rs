//! A spill directory and the byte budget shared by its files.

use super::format::invalid;
use super::format::io_err;
use super::format::EntryDesc;
use super::format::KvShape;
use super::format::SpillError;
use super::quota::Quota;
use super::write::write_file;
use std::fs;
use std::io;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

static DIR_SEQ: AtomicU64 = AtomicU64::new(0);

/// A private spill directory `<parent>/strata-kv-<pid>-<n>/` (mode 0700),
/// removed with its files on Drop. Files written through it are charged to
/// its optional [`Quota`], which several directories may share.
#[derive(Debug)]
pub struct SpillDir {
    path: PathBuf,
    quota: Option<Arc<Quota>>,
}

impl SpillDir {
    /// Creates a fresh directory under `parent` (which must exist).
    pub fn create(parent: &Path, quota: Option<Arc<Quota>>) -> Result<SpillDir, SpillError> {
        let pid = std::process::id();
        for _ in 0..1000 {
            let n = DIR_SEQ.fetch_add(1, Ordering::Relaxed);
            let path = parent.join(format!("strata-kv-{pid}-{n}"));
            match fs::DirBuilder::new().mode(0o700).create(&path) {
                Ok(()) => return Ok(SpillDir { path, quota }),
                // Left by an earlier process with the same pid.
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(io_err(&path, "create spill directory", e)),
            }
        }
        Err(io_err(
            parent,
            "create spill directory",
            io::Error::new(
                io::ErrorKind::AlreadyExists,
                "1000 candidate names already taken",
            ),
        ))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn quota(&self) -> Option<&Quota> {
        self.quota.as_deref()
    }

    /// The path of file `name` in this directory. `name` is chosen by the
    /// engine, never by a user: a single path component that does not start
    /// with '.' (those are temp files).
    pub fn path_for(&self, name: &str) -> PathBuf {
        assert!(
            !name.is_empty() && !name.starts_with('.') && !name.contains(['/', '\0']),
            "spill file name {name:?} must be one path component not starting with '.'"
        );
        self.path.join(name)
    }

    /// Writes file `name` through [`write_file`] with this directory's quota.
    /// Returns its path and length.
    pub fn write(
        &self,
        name: &str,
        shape: KvShape,
        extra: &[u8],
        entries: &[(EntryDesc, &[u8], &[u8])],
    ) -> Result<(PathBuf, u64), SpillError> {
        let path = self.path_for(name);
        let n = write_file(&path, shape, extra, entries, self.quota())?;
        Ok((path, n))
    }

    /// Deletes a file of this directory and releases its length from the
    /// quota. Returns the bytes released.
    pub fn remove(&self, path: &Path) -> Result<u64, SpillError> {
        if path.parent() != Some(self.path.as_path()) {
            return Err(invalid(
                path,
                format!("not a file of spill directory {}", self.path.display()),
            ));
        }
        let len = fs::symlink_metadata(path)
            .map_err(|e| io_err(path, "stat", e))?
            .len();
        fs::remove_file(path).map_err(|e| io_err(path, "remove", e))?;
        if let Some(q) = &self.quota {
            q.release(len);
        }
        Ok(len)
    }
}

impl Drop for SpillDir {
    fn drop(&mut self) {
        // Give back the quota charged for the files still here.
        if let Some(q) = &self.quota {
            if let Ok(rd) = fs::read_dir(&self.path) {
                for e in rd.flatten() {
                    let hidden = e.file_name().to_string_lossy().starts_with('.');
                    match e.metadata() {
                        Ok(m) if m.is_file() && !hidden => q.release(m.len()),
                        _ => {}
                    }
                }
            }
        }
        if let Err(e) = fs::remove_dir_all(&self.path) {
            tracing::warn!("cannot remove spill directory {}: {e}", self.path.display());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::quota::QuotaFull;
    use super::*;

    #[test]
    fn quota_reserve_release() {
        let q = Quota::new(100);
        assert!(q.reserve(60).is_ok());
        assert_eq!(
            q.reserve(41),
            Err(QuotaFull {
                needed: 41,
                available: 40,
                limit: 100
            })
        );
        assert_eq!(q.used(), 60);
        assert!(q.reserve(40).is_ok());
        assert_eq!(q.available(), 0);
        q.release(70);
        assert_eq!(q.used(), 30);
        q.release(1000);
        assert_eq!(q.used(), 0);
        assert!(q.reserve(u64::MAX).is_err());
    }

    #[test]
    fn quota_is_exact_under_threads() {
        let q = Arc::new(Quota::new(1000));
        let ok: usize = (0..8)
            .map(|_| {
                let q = q.clone();
                std::thread::spawn(move || (0..100).filter(|_| q.reserve(3).is_ok()).count())
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|t| t.join().unwrap())
            .sum();
        assert_eq!(ok, 333);
        assert_eq!(q.used(), 999);
    }
}
