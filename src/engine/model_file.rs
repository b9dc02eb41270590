//! The model file, mapped read-only: where every weight's bytes come from.

use super::error::EngineError;
use crate::model::WeightSpec;
use memmap2::Mmap;
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
    /// The bytes of a tensor (validated to lie inside the file by the GGUF reader).
    pub fn bytes(&self, w: &WeightSpec) -> &[u8] {
        &self.map[w.offset as usize..(w.offset + w.size) as usize]
    }
}
