//! `strata-convert gguf`: re-lay out (and optionally requantize) a GGUF.
//!
//! The input is validated as a whole first (header, data bounds, overlap:
//! `GgufFile::open`; architecture and shapes: `ModelSpec::from_gguf`), then
//! mapped read-only. Without `--type` every tensor's bytes are copied
//! unchanged, so the output computes bit-identical logits; with it, each
//! tensor picked by `quant::choose_type` goes through ggml's dequantizer to
//! f32 and ggml's quantizer to the new type, in row chunks spread over
//! threads while the previous chunk is written.

use super::error::ConvertError;
use super::error::Result;
use super::output::{
    pipelined, to_io, write_model, OutTensor, OutputModel, TensorFill, WriteSummary,
};
use super::quant;
use crate::dtype::GgmlType;
use crate::gguf::{GgufFile, TensorInfo, Value};
use memmap2::Mmap;
use std::path::Path;
use std::sync::Arc;

/// Options of [`convert_gguf`].
#[derive(Clone, Debug)]
pub struct GgufOptions {
    /// Requantize matrices to this type or mix; `None` copies bytes unchanged.
    pub target: Option<quant::Target>,
    /// Requantize tensors that are already quantized (llama-quantize's
    /// --allow-requantize): quality is lost twice, so it is refused unless asked.
    pub allow_requantize: bool,
    pub threads: usize,
    pub progress: bool,
}

/// Bytes of source data converted per chunk (rows are never split).
const CHUNK_BYTES: u64 = 32 << 20;

/// Maps a file read-only.
pub(crate) fn map_file(path: &Path) -> Result<Arc<Mmap>> {
    let f = std::fs::File::open(path).map_err(ConvertError::io(path))?;
    // SAFETY: mapped read-only; nothing in this process writes the file. A
    // concurrent truncation by another process would fault, as with every
    // mmap-based model loader.
    let m = unsafe { Mmap::map(&f) }.map_err(ConvertError::io(path))?;
    Ok(Arc::new(m))
}

/// A fill that copies a byte range of `map` in chunks.
pub(crate) fn copy_fill(map: Arc<Mmap>, offset: u64, size: u64) -> TensorFill {
    Box::new(move |w| {
        let data = &map[offset as usize..(offset + size) as usize];
        for c in data.chunks(CHUNK_BYTES as usize) {
            w.write_all(c)?;
        }
        Ok(())
    })
}

/// A fill that converts tensor `t` of `map` from its type to `ty`.
fn convert_fill(
    map: Arc<Mmap>,
    t: &TensorInfo,
    ty: GgmlType,
    threads: usize,
) -> Result<TensorFill> {
    let n0 = t.ne[0] as usize;
    quant::check_target(&t.name, ty, n0 as u64)?;
    let src_row = t.ty.row_bytes(n0 as u64).unwrap_or(1).max(1);
    let rows_per_chunk = (CHUNK_BYTES / src_row).max(1);
    let n_rows = t.size / src_row;
    let n_chunks = n_rows.div_ceil(rows_per_chunk) as usize;
    let (offset, src_ty) = (t.offset, t.ty);
    Ok(Box::new(move |w| {
        pipelined(w, n_chunks, |i, buf| {
            let r0 = i as u64 * rows_per_chunk;
            let r1 = (r0 + rows_per_chunk).min(n_rows);
            let a = (offset + r0 * src_row) as usize;
            let src = &map[a..a + ((r1 - r0) * src_row) as usize];
            let mut f = Vec::new();
            quant::to_f32(src, src_ty, n0, threads, &mut f).map_err(to_io)?;
            quant::from_f32(&f, ty, n0, threads, buf).map_err(to_io)
        })
    }))
}

/// Metadata for the output: everything but layout keys; `general.file_type`
/// follows the new type.
fn metadata(f: &GgufFile, target: Option<quant::Target>) -> Vec<(String, Value)> {
    let mut kv: Vec<(String, Value)> = f
        .metadata
        .iter()
        .filter(|(k, _)| k != crate::gguf::KEY_ALIGNMENT && !super::layout::is_layout_key(k))
        .cloned()
        .collect();
    if let Some(ft) = target.and_then(quant::Target::file_type) {
        match kv.iter_mut().find(|(k, _)| k == "general.file_type") {
            Some(slot) => slot.1 = Value::U32(ft),
            None => kv.push(("general.file_type".into(), Value::U32(ft))),
        }
    }
    kv
}

/// Converts `input` to a strata-aligned `output`.
pub fn convert_gguf(input: &Path, output: &Path, opts: &GgufOptions) -> Result<WriteSummary> {
    let f = super::input::open_gguf(input)?;
    let spec = super::input::model_spec(input, &f)?;
    let map = map_file(input)?;
    if (map.len() as u64) < f.file_size {
        return Err(ConvertError::Io {
            path: input.to_path_buf(),
            err: std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "file shrank while open"),
        });
    }
    let mix = quant::MixInfo {
        n_layer: spec.hp.n_layer,
        n_expert: spec.hp.n_expert,
        has_output: f.tensors.iter().any(|t| t.name == "output.weight"),
    };
    let mut tensors = Vec::with_capacity(f.tensors.len());
    for t in &f.tensors {
        let ty = match opts.target {
            Some(_) => quant::choose_type(&t.name, &t.ne, t.ty, opts.target, &mix),
            None => t.ty,
        };
        if ty != t.ty && t.ty.block_size().is_some_and(|b| b > 1) && !opts.allow_requantize {
            return Err(ConvertError::Requantize {
                tensor: t.name.clone(),
                from: t.ty.name().to_string(),
                to: ty.name().to_string(),
            });
        }
        let fill = if ty == t.ty {
            copy_fill(map.clone(), t.offset, t.size)
        } else {
            convert_fill(map.clone(), t, ty, opts.threads)?
        };
        tensors.push(OutTensor {
            name: t.name.clone(),
            ne: t.ne.clone(),
            ty,
            fill,
        });
    }
    let model = OutputModel {
        metadata: metadata(&f, opts.target),
        tensors,
        n_layer: spec.hp.n_layer,
    };
    write_model(model, output, opts.progress)
}
