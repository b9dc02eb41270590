//! Resident weight storage: the model file mapped read-only, and every
//! layer group's tensors copied into one buffer of the compute device.
//!
//! Each group's tensors are laid out back to back (aligned) so the paging
//! engine can later move a group as one extent.

use super::EngineError;
use crate::ggml::{Buffer, BufferUsage, Context, Device};
use crate::graph::Binding;
use crate::model::{ModelSpec, WeightSpec};
use indicatif::{ProgressBar, ProgressStyle};
use memmap2::Mmap;
use std::path::Path;
use std::sync::Arc;

/// The model file, mapped read-only.
pub struct ModelFile {
    pub map: Arc<Mmap>,
}

impl ModelFile {
    pub fn open(path: &Path) -> Result<ModelFile, EngineError> {
        let f = std::fs::File::open(path)
            .map_err(|e| EngineError::Io(path.display().to_string(), e))?;
        // SAFETY: the file is opened read-only; strata never writes it. A
        // concurrent truncation by another process would fault, as with any
        // mmap-based loader (llama.cpp's included).
        let map =
            unsafe { Mmap::map(&f) }.map_err(|e| EngineError::Io(path.display().to_string(), e))?;
        Ok(ModelFile { map: Arc::new(map) })
    }
    /// The bytes of a tensor (validated to lie inside the file by the GGUF reader).
    pub fn bytes(&self, w: &WeightSpec) -> &[u8] {
        &self.map[w.offset as usize..(w.offset + w.size) as usize]
    }
}

/// Every weight the model computes with, resident on one device.
pub struct ResidentWeights {
    /// Per group (same indexing as `ModelSpec::groups`): one binding per weight.
    pub groups: Vec<Vec<Binding>>,
    /// output_norm, output.
    pub head: Vec<Binding>,
    pub rope_freqs: Option<Binding>,
    pub bytes: u64,
    _ctx: Context,
    _buf: Buffer,
}

impl ResidentWeights {
    pub fn load(
        spec: &ModelSpec,
        file: &ModelFile,
        dev: Device,
        progress: bool,
    ) -> Result<ResidentWeights, EngineError> {
        let mut all: Vec<&WeightSpec> = Vec::new();
        for g in &spec.groups {
            all.extend(g.weights.iter());
        }
        all.push(&spec.output_norm);
        all.push(&spec.output);
        all.extend(spec.rope_freqs.iter());

        let ctx = Context::new(all.len() + 1, 0)?;
        let tensors: Vec<_> = all
            .iter()
            .map(|w| ctx.new_tensor(w.ty, &w.ne[..]).named(&w.name))
            .collect();
        let buft = dev.buffer_type();
        // SAFETY: pure query of the buffer type's alignment.
        let align = unsafe { crate::sys::ggml_backend_buft_get_alignment(buft) }.max(1);
        let mut offsets = Vec::with_capacity(tensors.len());
        let mut size = 0usize;
        for t in &tensors {
            // SAFETY: t is a valid tensor header; the query reads its shape.
            let need = unsafe { crate::sys::ggml_backend_buft_get_alloc_size(buft, t.raw()) };
            offsets.push(size);
            size += need.div_ceil(align) * align;
        }
        let buf = Buffer::alloc(buft, size, BufferUsage::Weights)?;
        // zero the padding that quantized kernels may read past a row
        buf.clear(0);
        let bar = if progress {
            let b = ProgressBar::new(size as u64);
            b.set_style(
                ProgressStyle::with_template(
                    "loading {bar:40} {bytes}/{total_bytes} {bytes_per_sec}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            b
        } else {
            ProgressBar::hidden()
        };
        let mut bindings = Vec::with_capacity(tensors.len());
        for ((t, w), off) in tensors.iter().zip(&all).zip(&offsets) {
            buf.place(*t, *off)?;
            t.set_bytes(file.bytes(w), 0)?;
            bar.inc(w.size);
            // SAFETY: t was just placed, so data is set.
            let data = unsafe { (*t.raw()).data };
            bindings.push(Binding {
                data,
                buffer: buf.raw(),
            });
        }
        bar.finish_and_clear();
        let mut it = bindings.into_iter();
        let groups = spec
            .groups
            .iter()
            .map(|g| it.by_ref().take(g.weights.len()).collect())
            .collect();
        let head = it.by_ref().take(2).collect();
        let rope_freqs = it.next();
        drop(tensors);
        Ok(ResidentWeights {
            groups,
            head,
            rope_freqs,
            bytes: size as u64,
            _ctx: ctx,
            _buf: buf,
        })
    }
}
