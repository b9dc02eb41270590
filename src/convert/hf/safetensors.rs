//! Safetensors checkpoints, read through memmap2 and validated up front.
//!
//! Format: u64 little-endian header length N, N bytes of JSON
//! (`{"name": {"dtype", "shape", "data_offsets": [begin, end]}, ...,
//! "__metadata__": {...}}`), then the data section; offsets are relative to
//! it. Checked before any tensor is used: the file holds the length and the
//! header, the header is at most 100 MB and valid JSON, every dtype is known
//! (F32/F16/BF16 are read, the other safetensors dtypes are refused by
//! name), every range lies in the data section and matches its shape, and
//! no two ranges overlap. A sharded checkpoint's index may only name plain
//! file names in the model directory, each tensor it lists must be in the
//! named shard, and no tensor may appear in two shards.

use super::super::error::ConvertError;
use super::super::error::Result;
use half::{bf16, f16};
use memmap2::Mmap;
use serde_json::Value as Json;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Largest header accepted (the safetensors library's own limit).
pub const MAX_HEADER: u64 = 100_000_000;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    F32,
    F16,
    BF16,
}

impl Dtype {
    pub fn size(self) -> u64 {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::BF16 => 2,
        }
    }
    pub fn ggml(self) -> crate::dtype::GgmlType {
        match self {
            Dtype::F32 => crate::dtype::GgmlType::F32,
            Dtype::F16 => crate::dtype::GgmlType::F16,
            Dtype::BF16 => crate::dtype::GgmlType::BF16,
        }
    }
}

/// Safetensors dtypes that exist but are not model weights we convert.
const OTHER_DTYPES: [&str; 14] = [
    "F64", "I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "BOOL", "F8_E4M3", "F8_E5M2",
    "F8_E8M0", "F4",
];

/// One tensor: where its bytes are.
#[derive(Clone, Debug)]
pub struct StTensor {
    pub dtype: Dtype,
    /// Row-major (PyTorch) order.
    pub shape: Vec<u64>,
    /// Index into `Checkpoint::files`.
    pub file: usize,
    /// Absolute byte range in that file.
    pub start: u64,
    pub len: u64,
}

/// Every tensor of a checkpoint, by name, with the mapped files.
pub struct Checkpoint {
    pub files: Vec<(PathBuf, Arc<Mmap>)>,
    pub tensors: BTreeMap<String, StTensor>,
}

impl Checkpoint {
    pub fn data(&self, t: &StTensor) -> &[u8] {
        &self.files[t.file].1[t.start as usize..(t.start + t.len) as usize]
    }
}

fn bad(file: &Path, problem: String) -> ConvertError {
    ConvertError::Safetensors {
        file: file.to_path_buf(),
        problem,
    }
}

/// Parses and validates the header of a mapped safetensors file.
pub fn parse(path: &Path, bytes: &[u8], file_index: usize) -> Result<Vec<(String, StTensor)>> {
    let len = bytes.len() as u64;
    if len < 8 {
        return Err(bad(
            path,
            format!("truncated: {len} bytes, no header length"),
        ));
    }
    let mut n8 = [0u8; 8];
    n8.copy_from_slice(&bytes[..8]);
    let n = u64::from_le_bytes(n8);
    if n > MAX_HEADER {
        return Err(bad(
            path,
            format!("header of {n} bytes is larger than the limit of {MAX_HEADER}"),
        ));
    }
    if 8 + n > len {
        return Err(bad(
            path,
            format!("truncated: header of {n} bytes, but the file has {len} bytes"),
        ));
    }
    let header: Json = serde_json::from_slice(&bytes[8..(8 + n) as usize])
        .map_err(|e| bad(path, format!("header is not valid JSON: {e}")))?;
    let Json::Object(map) = header else {
        return Err(bad(path, "header is not a JSON object".into()));
    };
    let data_start = 8 + n;
    let data_len = len - data_start;
    let mut out = Vec::with_capacity(map.len());
    for (name, v) in &map {
        if name == "__metadata__" {
            continue;
        }
        let dtype = match v.get("dtype").and_then(Json::as_str) {
            Some("F32") => Dtype::F32,
            Some("F16") => Dtype::F16,
            Some("BF16") => Dtype::BF16,
            Some(d) if OTHER_DTYPES.contains(&d) => {
                return Err(ConvertError::UnsupportedDtype {
                    tensor: name.clone(),
                    dtype: d.to_string(),
                })
            }
            Some(d) => {
                return Err(bad(
                    path,
                    format!("tensor '{name}' has unknown dtype '{d}'"),
                ))
            }
            None => return Err(bad(path, format!("tensor '{name}' has no dtype"))),
        };
        let shape: Option<Vec<u64>> = v
            .get("shape")
            .and_then(Json::as_array)
            .and_then(|a| a.iter().map(Json::as_u64).collect());
        let shape =
            shape.ok_or_else(|| bad(path, format!("tensor '{name}' has no valid shape")))?;
        let offs: Option<Vec<u64>> = v
            .get("data_offsets")
            .and_then(Json::as_array)
            .and_then(|a| a.iter().map(Json::as_u64).collect());
        let (begin, end) = match offs.as_deref() {
            Some(&[b, e]) => (b, e),
            _ => {
                return Err(bad(
                    path,
                    format!("tensor '{name}' has no valid data_offsets"),
                ))
            }
        };
        if begin > end || end > data_len {
            return Err(bad(
                path,
                format!("tensor '{name}' data [{begin}, {end}) is out of range: the data section has {data_len} bytes"),
            ));
        }
        let need = shape
            .iter()
            .try_fold(dtype.size(), |a, &d| a.checked_mul(d))
            .ok_or_else(|| bad(path, format!("tensor '{name}' shape {shape:?} overflows")))?;
        if end - begin != need {
            return Err(bad(
                path,
                format!("tensor '{name}' has {} bytes of data, but shape {shape:?} of {dtype:?} needs {need}", end - begin),
            ));
        }
        let t = StTensor {
            dtype,
            shape,
            file: file_index,
            start: data_start + begin,
            len: need,
        };
        out.push((name.clone(), t));
    }
    let mut by_start: Vec<&(String, StTensor)> = out.iter().filter(|(_, t)| t.len > 0).collect();
    by_start.sort_by_key(|(_, t)| t.start);
    for w in by_start.windows(2) {
        if w[0].1.start + w[0].1.len > w[1].1.start {
            return Err(bad(
                path,
                format!("tensors '{}' and '{}' overlap", w[0].0, w[1].0),
            ));
        }
    }
    Ok(out)
}

fn map(path: &Path) -> Result<Arc<Mmap>> {
    crate::convert::relayout::map_file(path)
}

/// Opens `dir/model.safetensors`, or every shard named by
/// `dir/model.safetensors.index.json`.
pub fn open_checkpoint(dir: &Path) -> Result<Checkpoint> {
    let index = dir.join("model.safetensors.index.json");
    let single = dir.join("model.safetensors");
    let mut files = Vec::new();
    let mut tensors = BTreeMap::new();
    let mut wanted: Vec<(String, String)> = Vec::new();
    let names: Vec<String> = if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(ConvertError::io(&index))?;
        let j: Json = serde_json::from_str(&text).map_err(|e| ConvertError::Json {
            file: index.clone(),
            problem: e.to_string(),
        })?;
        let wm = j
            .get("weight_map")
            .and_then(Json::as_object)
            .ok_or_else(|| ConvertError::Json {
                file: index.clone(),
                problem: "no weight_map object".into(),
            })?;
        let mut shards = Vec::new();
        for (t, f) in wm {
            let f = f.as_str().ok_or_else(|| ConvertError::Json {
                file: index.clone(),
                problem: format!("weight_map entry '{t}' is not a string"),
            })?;
            if f.is_empty() || f.contains('/') || f.contains('\\') || f == "." || f == ".." {
                return Err(ConvertError::Json {
                    file: index.clone(),
                    problem: format!("shard name '{f}' is not a plain file name"),
                });
            }
            if !shards.iter().any(|s| s == f) {
                shards.push(f.to_string());
            }
            wanted.push((t.clone(), f.to_string()));
        }
        shards
    } else if single.is_file() {
        vec!["model.safetensors".into()]
    } else {
        return Err(ConvertError::Io {
            path: dir.to_path_buf(),
            err: std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "no model.safetensors or model.safetensors.index.json",
            ),
        });
    };
    for name in &names {
        let path = dir.join(name);
        let m = map(&path)?;
        for (t, info) in parse(&path, &m, files.len())? {
            if let Some(prev) = tensors.insert(t.clone(), info) {
                let other = &names[prev.file];
                return Err(bad(&path, format!("tensor '{t}' also appears in {other}")));
            }
        }
        files.push((path, m));
    }
    for (t, f) in wanted {
        match tensors.get(&t) {
            Some(info) if files[info.file].0.file_name() == Some(f.as_ref()) => {}
            _ => {
                return Err(bad(
                    &dir.join(&f),
                    format!("the index lists tensor '{t}' here, but the shard does not contain it"),
                ))
            }
        }
    }
    Ok(Checkpoint { files, tensors })
}

/// Decodes little-endian `dtype` values into f32.
pub fn decode(dtype: Dtype, bytes: &[u8], out: &mut [f32]) {
    match dtype {
        Dtype::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        Dtype::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        Dtype::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
    }
}
