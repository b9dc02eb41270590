//! The model file, mapped read-only: where every weight's bytes come from.

use super::error::EngineError;
use crate::model::WeightSpec;
use memmap2::Mmap;
use std::borrow::Cow;
use std::path::Path;

/// The model file, mapped read-only.
pub struct ModelFile {
    pub map: Mmap,
}

impl ModelFile {
    pub fn open(path: &Path) -> Result<ModelFile, EngineError> {
        let f = std::fs::File::open(path)
            .map_err(|e| EngineError::Io(path.display().to_string(), e))?;
        // SAFETY: the file is opened read-only and strata never writes it. A
        // concurrent truncation by another process would fault, as with any
        // mmap-based loader (llama.cpp's included).
        let map =
            unsafe { Mmap::map(&f) }.map_err(|e| EngineError::Io(path.display().to_string(), e))?;
        Ok(ModelFile { map })
    }
    /// The bytes of a tensor (validated to lie inside the file by the GGUF
    /// reader): borrowed from the map, or for a column slice (a device's
    /// share in the row split) its rows gathered.
    pub fn bytes(&self, w: &WeightSpec) -> Cow<'_, [u8]> {
        match w.cols {
            None => Cow::Borrowed(&self.map[w.offset as usize..(w.offset + w.size) as usize]),
            Some(c) => {
                let rows = w.rows().max(1);
                let width = (w.size / rows) as usize;
                let mut out = Vec::with_capacity(w.size as usize);
                for r in 0..rows {
                    let at = (w.offset + r * c.stride + c.skip) as usize;
                    out.extend_from_slice(&self.map[at..at + width]);
                }
                Cow::Owned(out)
            }
        }
    }
}

/// The largest router counts file read (a real one is well under a
/// megabyte: layers x experts numbers).
pub const COUNTS_MAX_BYTES: u64 = 64 << 20;

/// The router counts at `path` (`RouterCounts::to_json`'s form, kept beside
/// a model); None where there is no such file. A file over
/// [`COUNTS_MAX_BYTES`], unreadable or damaged is an error naming it.
pub fn read_router_counts(
    path: &Path,
) -> Result<Option<crate::paging::routing::RouterCounts>, EngineError> {
    let io = |e| EngineError::Io(path.display().to_string(), e);
    let size = match std::fs::metadata(path) {
        Ok(m) => m.len(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io(e)),
    };
    if size > COUNTS_MAX_BYTES {
        return Err(EngineError::BadCounts(
            path.display().to_string(),
            crate::paging::routing::RoutingError::Shape(format!(
                "{size} bytes, more than the {COUNTS_MAX_BYTES} a counts file may have"
            )),
        ));
    }
    let text = std::fs::read_to_string(path).map_err(io)?;
    crate::paging::routing::RouterCounts::from_json(&text)
        .map(Some)
        .map_err(|e| EngineError::BadCounts(path.display().to_string(), e))
}

/// Adds `r` to the router counts kept at `path` (a file that is not there
/// starts from zero; counts of another model are refused), written whole
/// to a temporary file first and renamed over it, so a failed write
/// leaves the old counts. Returns the picks the file holds now.
pub fn save_router_counts(
    path: &Path,
    r: &crate::paging::routing::RouterCounts,
) -> Result<u64, EngineError> {
    let mut all = r.clone();
    if let Some(old) = read_router_counts(path)? {
        all.merge(&old)
            .map_err(|e| EngineError::OtherModelCounts(path.display().to_string(), e))?;
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = std::path::PathBuf::from(tmp);
    std::fs::write(&tmp, all.to_json())
        .and_then(|()| std::fs::rename(&tmp, path))
        .map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            EngineError::Io(path.display().to_string(), e)
        })?;
    Ok(all.picks())
}
