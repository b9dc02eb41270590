//! Building GGUF v3 files.
//!
//! The writer keeps metadata in insertion order and tensors in the order
//! added, and lays the data section out the way ggml's own writer does: each
//! tensor starts at the next multiple of the alignment and is padded with
//! zeros to it, so the result loads in llama.cpp unchanged. Every tensor is
//! validated when added (shape, type, data length), so `write_to` only fails
//! on I/O or on a data provider that yields the wrong number of bytes. The
//! writer owns `general.alignment`: it is written (last) when the alignment
//! is not the default 32, and any value set by hand is dropped.

use super::file::GgufError;
use super::file::DEFAULT_ALIGNMENT;
use super::file::KEY_ALIGNMENT;
use super::file::MAX_TENSOR_NAME;
use super::types::{Array, Value};
use crate::dtype::GgmlType;
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

/// Writes one tensor's data on demand; it must write exactly the tensor's
/// byte size. Lets a converter stream tensors instead of holding them all.
pub type TensorDataFn = Box<dyn Fn(&mut dyn Write) -> io::Result<()> + Send + Sync>;

enum TensorData {
    Bytes(Vec<u8>),
    Provider(TensorDataFn),
}

struct PendingTensor {
    name: String,
    ne: Vec<u64>,
    ty: GgmlType,
    size: u64,
    data: TensorData,
}

/// An in-progress GGUF file: metadata plus tensors, written in one pass.
pub struct GgufWriter {
    alignment: u64,
    metadata: Vec<(String, Value)>,
    tensors: Vec<PendingTensor>,
}

impl std::fmt::Debug for GgufWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufWriter")
            .field("alignment", &self.alignment)
            .field("metadata", &self.metadata)
            .field(
                "tensors",
                &self.tensors.iter().map(|t| &t.name).collect::<Vec<_>>(),
            )
            .finish()
    }
}

/// A writer that counts the bytes that pass through it.
struct Counting<W> {
    w: W,
    n: u64,
}

impl<W: Write> Write for Counting<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let k = self.w.write(buf)?;
        self.n += k as u64;
        Ok(k)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.w.flush()
    }
}

impl GgufWriter {
    /// `alignment` must be a power of two that fits in u32; otherwise
    /// `write_to` fails with `BadAlignment`.
    pub fn new(alignment: u64) -> Self {
        GgufWriter {
            alignment,
            metadata: Vec::new(),
            tensors: Vec::new(),
        }
    }

    /// Sets `key`, replacing an earlier value in place (order kept).
    pub fn set(&mut self, key: &str, v: Value) {
        match self.metadata.iter_mut().find(|(k, _)| k == key) {
            Some(slot) => slot.1 = v,
            None => self.metadata.push((key.to_string(), v)),
        }
    }

    /// Adds a tensor whose bytes are already in memory.
    pub fn add_tensor(
        &mut self,
        name: &str,
        ne: &[u64],
        ty: GgmlType,
        data: Vec<u8>,
    ) -> Result<(), GgufError> {
        let size = self.check_tensor(name, ne, ty)?;
        if data.len() as u64 != size {
            return Err(GgufError::DataSizeMismatch {
                tensor: name.to_string(),
                expected: size,
                found: data.len() as u64,
            });
        }
        self.push(name, ne, ty, size, TensorData::Bytes(data));
        Ok(())
    }

    /// Adds a tensor whose bytes `provider` writes at `write_to` time.
    pub fn add_tensor_fn(
        &mut self,
        name: &str,
        ne: &[u64],
        ty: GgmlType,
        provider: TensorDataFn,
    ) -> Result<(), GgufError> {
        let size = self.check_tensor(name, ne, ty)?;
        self.push(name, ne, ty, size, TensorData::Provider(provider));
        Ok(())
    }

    fn push(&mut self, name: &str, ne: &[u64], ty: GgmlType, size: u64, data: TensorData) {
        let name = name.to_string();
        self.tensors.push(PendingTensor {
            name,
            ne: ne.to_vec(),
            ty,
            size,
            data,
        });
    }

    /// The same rules the reader enforces; returns the byte size.
    fn check_tensor(&self, name: &str, ne: &[u64], ty: GgmlType) -> Result<u64, GgufError> {
        let shape = |reason: &str| GgufError::BadShape {
            tensor: name.to_string(),
            ne: ne.to_vec(),
            reason: reason.to_string(),
        };
        if name.len() >= MAX_TENSOR_NAME {
            return Err(GgufError::TensorNameTooLong {
                name: name.to_string(),
                len: name.len(),
            });
        }
        if self.tensors.iter().any(|t| t.name == name) {
            return Err(GgufError::DuplicateTensor(name.to_string()));
        }
        if ne.is_empty() || ne.len() > 4 {
            return Err(shape("expected 1 to 4 dims"));
        }
        if ne.iter().any(|&d| d == 0 || d > i64::MAX as u64) {
            return Err(shape("every dim must be 1..=i64::MAX"));
        }
        let (Some(block), Some(type_size)) = (ty.block_size(), ty.type_size()) else {
            return Err(GgufError::UnknownTensorType {
                tensor: name.to_string(),
                type_id: ty.0,
            });
        };
        if !ne[0].is_multiple_of(block) {
            return Err(shape("ne0 is not a multiple of the block size"));
        }
        let n = ne
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .filter(|&n| n <= i64::MAX as u64);
        n.and_then(|n| (n / block).checked_mul(type_size))
            .ok_or_else(|| shape("element count or byte size overflows"))
    }

    /// Metadata as it will be written: `general.alignment` replaced by the
    /// writer's own (absent when it is the default).
    fn effective_metadata(&self) -> Vec<(&str, Value)> {
        let mut kv: Vec<(&str, Value)> = (self.metadata.iter())
            .filter(|(k, _)| k != KEY_ALIGNMENT)
            .map(|(k, v)| (k.as_str(), v.clone()))
            .collect();
        if self.alignment != DEFAULT_ALIGNMENT {
            // Checked to fit in u32 before this is called.
            kv.push((KEY_ALIGNMENT, Value::U32(self.alignment as u32)));
        }
        kv
    }

    /// Writes the whole file to `w` (wrap it in a `BufWriter`).
    pub fn write_to<W: Write>(&self, w: W) -> Result<(), GgufError> {
        self.write_to_path(w, Path::new("<writer>"))
    }

    /// As [`write_to`](Self::write_to), naming `path` (the file `w` writes)
    /// in errors.
    pub fn write_to_path<W: Write>(&self, w: W, path: &Path) -> Result<(), GgufError> {
        let a = self.alignment;
        if !a.is_power_of_two() || a > u64::from(u32::MAX) {
            return Err(GgufError::BadAlignment(a));
        }
        if let Some(i) = self.metadata.iter().position(|(k, _)| k.is_empty()) {
            return Err(GgufError::EmptyKey {
                index: i as u64,
                offset: 0,
            });
        }
        let io = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut w = Counting { w, n: 0 };
        self.write_header(&mut w).map_err(io)?;

        for t in &self.tensors {
            let start = w.n;
            match &t.data {
                TensorData::Bytes(b) => w.write_all(b).map_err(io)?,
                TensorData::Provider(f) => f(&mut w).map_err(io)?,
            }
            let found = w.n - start;
            if found != t.size {
                let tensor = t.name.clone();
                return Err(GgufError::DataSizeMismatch {
                    tensor,
                    expected: t.size,
                    found,
                });
            }
            pad(&mut w, a).map_err(io)?;
        }
        w.flush().map_err(io)
    }

    /// Absolute offset at which the data section will start: the header
    /// (metadata and tensor descriptors) padded to the alignment. It depends
    /// only on keys, encoded value sizes and tensor descriptors, so replacing
    /// a value with one of the same encoded size keeps it.
    pub fn data_offset(&self) -> Result<u64, GgufError> {
        if !self.alignment.is_power_of_two() || self.alignment > u64::from(u32::MAX) {
            return Err(GgufError::BadAlignment(self.alignment));
        }
        let mut w = Counting {
            w: io::sink(),
            n: 0,
        };
        self.write_header(&mut w).map_err(|source| GgufError::Io {
            path: PathBuf::from("<sink>"),
            source,
        })?;
        Ok(w.n)
    }

    /// Magic, counts, metadata, tensor descriptors and the padding before
    /// the data section.
    fn write_header<W: Write>(&self, w: &mut Counting<W>) -> io::Result<()> {
        let a = self.alignment;
        let kv = self.effective_metadata();
        let mut head = Vec::new();
        head.extend_from_slice(b"GGUF");
        head.extend_from_slice(&3u32.to_le_bytes());
        head.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        head.extend_from_slice(&(kv.len() as u64).to_le_bytes());
        w.write_all(&head)?;
        for (k, v) in &kv {
            let mut buf = Vec::new();
            put_str(&mut buf, k);
            buf.extend_from_slice(&v.type_id().to_le_bytes());
            put_value(&mut buf, v);
            w.write_all(&buf)?;
        }
        let mut rel = 0u64;
        for t in &self.tensors {
            let mut buf = Vec::new();
            put_str(&mut buf, &t.name);
            buf.extend_from_slice(&(t.ne.len() as u32).to_le_bytes());
            for d in &t.ne {
                buf.extend_from_slice(&d.to_le_bytes());
            }
            buf.extend_from_slice(&t.ty.0.to_le_bytes());
            buf.extend_from_slice(&rel.to_le_bytes());
            w.write_all(&buf)?;
            rel += t.size.next_multiple_of(a);
        }
        pad(w, a)
    }

    /// Writes to a temporary file beside `path`, fsyncs it, and renames it
    /// over `path`, so a reader never sees a half-written file.
    pub fn write_file(&self, path: &Path) -> Result<(), GgufError> {
        let tmp = temp_path(path);
        let result = self.write_temp(&tmp).and_then(|()| {
            fs::rename(&tmp, path).map_err(|source| GgufError::Io {
                path: path.to_path_buf(),
                source,
            })
        });
        if result.is_err() {
            let _ = fs::remove_file(&tmp);
            return result;
        }
        // Persist the rename itself; best effort (not every platform allows it).
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            if let Ok(d) = File::open(dir) {
                let _ = d.sync_all();
            }
        }
        Ok(())
    }

    fn write_temp(&self, tmp: &Path) -> Result<(), GgufError> {
        let io = |source| GgufError::Io {
            path: tmp.to_path_buf(),
            source,
        };
        let file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(tmp)
            .map_err(io)?;
        let mut w = BufWriter::with_capacity(1 << 20, file);
        self.write_to_path(&mut w, tmp)?;
        let file = w.into_inner().map_err(|e| io(e.into_error()))?;
        file.sync_all().map_err(io)
    }
}

fn temp_path(path: &Path) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(".tmp-{}-{nanos:08x}", std::process::id()));
    path.with_file_name(name)
}

fn pad<W: Write>(w: &mut Counting<W>, alignment: u64) -> io::Result<()> {
    let n = (w.n.next_multiple_of(alignment) - w.n) as usize;
    const ZEROS: [u8; 4096] = [0; 4096];
    let mut left = n;
    while left > 0 {
        let k = left.min(ZEROS.len());
        w.write_all(&ZEROS[..k])?;
        left -= k;
    }
    Ok(())
}

fn put_str(buf: &mut Vec<u8>, s: &str) {
    buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
    buf.extend_from_slice(s.as_bytes());
}

fn put_value(buf: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::I8(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::U16(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => buf.push(u8::from(*x)),
        Value::Str(s) => put_str(buf, s),
        Value::Array(a) => put_array(buf, a),
        Value::U64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => buf.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => buf.extend_from_slice(&x.to_le_bytes()),
    }
}

fn put_array(buf: &mut Vec<u8>, a: &Array) {
    buf.extend_from_slice(&a.elem_type_id().to_le_bytes());
    buf.extend_from_slice(&(a.len() as u64).to_le_bytes());
    macro_rules! each {
        ($v:expr) => {
            for x in $v {
                buf.extend_from_slice(&x.to_le_bytes());
            }
        };
    }
    match a {
        Array::U8(v) => buf.extend_from_slice(v),
        Array::I8(v) => each!(v),
        Array::U16(v) => each!(v),
        Array::I16(v) => each!(v),
        Array::U32(v) => each!(v),
        Array::I32(v) => each!(v),
        Array::F32(v) => each!(v),
        Array::Bool(v) => buf.extend(v.iter().map(|&b| u8::from(b))),
        Array::Str(v) => v.iter().for_each(|s| put_str(buf, s)),
        Array::U64(v) => each!(v),
        Array::I64(v) => each!(v),
        Array::F64(v) => each!(v),
        Array::Nested(v) => v.iter().for_each(|x| put_array(buf, x)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufFile;

    #[test]
    fn layout_matches_ggml_padding() {
        let mut w = GgufWriter::new(64);
        w.set("general.architecture", Value::Str("llama".into()));
        w.set(KEY_ALIGNMENT, Value::U32(8)); // dropped: the writer owns it
        w.add_tensor("a", &[3], GgmlType::F32, vec![1; 12])
            .expect("valid");
        w.add_tensor("b", &[32, 2], GgmlType::Q8_0, vec![2; 68])
            .expect("valid");
        let mut out = Vec::new();
        w.write_to(&mut out).expect("write");
        assert_eq!(out.len() % 64, 0, "last tensor padded too");
        let f = GgufFile::parse(&out[..], out.len() as u64).expect("parse");
        assert_eq!(f.alignment, 64);
        assert_eq!(w.data_offset().ok(), Some(f.data_offset));
        assert_eq!(f.get_u32(KEY_ALIGNMENT).ok(), Some(64));
        let (a, b) = (&f.tensors[0], &f.tensors[1]);
        assert_eq!((a.offset, a.size), (f.data_offset, 12));
        assert_eq!((b.offset, b.size), (f.data_offset + 64, 68));
        let at =
            |t: &crate::gguf::TensorInfo| &out[t.offset as usize..(t.offset + t.size) as usize];
        assert!(at(a).iter().all(|&x| x == 1) && at(b).iter().all(|&x| x == 2));
    }

    #[test]
    fn add_tensor_rejects_bad_input() {
        let mut w = GgufWriter::new(32);
        let e = w.add_tensor("x", &[4], GgmlType::F32, vec![0; 15]);
        assert!(matches!(
            e,
            Err(GgufError::DataSizeMismatch {
                expected: 16,
                found: 15,
                ..
            })
        ));
        let e = w.add_tensor("x", &[31], GgmlType::Q4_0, vec![]);
        assert!(matches!(e, Err(GgufError::BadShape { .. })));
        let e = w.add_tensor("x", &[1, 0], GgmlType::F32, vec![]);
        assert!(matches!(e, Err(GgufError::BadShape { .. })));
        let e = w.add_tensor("x", &[1], GgmlType(4), vec![]);
        assert!(matches!(
            e,
            Err(GgufError::UnknownTensorType { type_id: 4, .. })
        ));
        w.add_tensor("x", &[1], GgmlType::F32, vec![0; 4])
            .expect("valid");
        let e = w.add_tensor("x", &[1], GgmlType::F32, vec![0; 4]);
        assert!(matches!(e, Err(GgufError::DuplicateTensor(_))));
        let e = GgufWriter::new(48).write_to(Vec::new());
        assert!(matches!(e, Err(GgufError::BadAlignment(48))));
    }

    #[test]
    fn provider_with_wrong_length_fails() {
        let mut w = GgufWriter::new(32);
        let f: TensorDataFn = Box::new(|w| w.write_all(&[0; 3]));
        w.add_tensor_fn("x", &[1], GgmlType::F32, f).expect("valid");
        let e = w.write_to(Vec::new());
        assert!(matches!(
            e,
            Err(GgufError::DataSizeMismatch {
                expected: 4,
                found: 3,
                ..
            })
        ));
    }
}
