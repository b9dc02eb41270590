//! Parsing and validation of a GGUF header from any `Read`.
//!
//! Invariants: every read is checked against the declared file size before
//! it happens (so a short file gives `Truncated` with the offset), every
//! count is checked against the bytes left before anything is allocated for
//! it (so a 1 KB file claiming 2^60 entries fails at once with `TooLarge`),
//! strings and arrays grow only as bytes actually arrive, and nothing here
//! panics or reads tensor data. The data-section checks (alignment, bounds,
//! overlap) run after all descriptors are read, because the data offset
//! depends on where the header ends.

use super::file::GgufError;
use super::file::GgufFile;
use super::file::DEFAULT_ALIGNMENT;
use super::file::KEY_ALIGNMENT;
use super::file::MAX_TENSOR_NAME;
use super::types::{value_type as vt, Array, TensorInfo, Value};
use crate::dtype::GgmlType;
use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

/// Same cap as ggml's GGUF_MAX_STRING_LENGTH / GGUF_MAX_ARRAY_ELEMENTS.
const MAX_STRING_LEN: u64 = 1 << 30;
const MAX_ARRAY_LEN: u64 = 1 << 30;
/// Arrays of arrays deeper than this are refused (ggml refuses any).
const MAX_NESTING: u32 = 8;
/// Smallest encodings, used to bound counts by the bytes left:
/// key (u64 len + 1 byte) + u32 type + 1-byte value.
const MIN_KV_BYTES: u64 = 8 + 1 + 4 + 1;
/// name (u64 len) + u32 n_dims + one u64 dim + u32 type + u64 offset.
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 8 + 4 + 8;

type Result<T> = std::result::Result<T, GgufError>;

impl GgufFile {
    /// Reads and validates the header of the file at `path` through a
    /// buffered reader; tensor data is never read.
    pub fn open(path: &Path) -> Result<GgufFile> {
        let io = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        let file_size = file.metadata().map_err(io)?.len();
        let reader = BufReader::with_capacity(1 << 20, file);
        parse_with_path(reader, file_size, path)
    }

    /// Parses a header from `r`, positioned at the start of a file of
    /// `file_size` bytes. Pass a buffered reader: values are read in small
    /// pieces.
    pub fn parse<R: Read>(r: R, file_size: u64) -> Result<GgufFile> {
        parse_with_path(r, file_size, Path::new("<reader>"))
    }
}

/// A reader that knows its absolute position and the end of the file.
struct HeaderReader<'p, R> {
    r: R,
    pos: u64,
    file_size: u64,
    path: &'p Path,
}

impl<R: Read> HeaderReader<'_, R> {
    fn remaining(&self) -> u64 {
        self.file_size.saturating_sub(self.pos)
    }

    fn truncated(&self, what: &str) -> GgufError {
        GgufError::Truncated {
            what: what.to_string(),
            offset: self.pos,
        }
    }

    /// Fills `buf` from the file, or fails with `Truncated` before reading if
    /// the file is too short.
    fn fill(&mut self, buf: &mut [u8], what: &str) -> Result<()> {
        if (buf.len() as u64) > self.remaining() {
            return Err(self.truncated(what));
        }
        match self.r.read_exact(buf) {
            Ok(()) => {
                self.pos += buf.len() as u64;
                Ok(())
            }
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Err(self.truncated(what)),
            Err(source) => Err(GgufError::Io {
                path: PathBuf::from(self.path),
                source,
            }),
        }
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let mut b = [0u8; N];
        self.fill(&mut b, what)?;
        Ok(b)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// Reads `n` bytes, growing the buffer only as they arrive.
    fn bytes(&mut self, n: u64, what: &str) -> Result<Vec<u8>> {
        if n > self.remaining() {
            return Err(self.truncated(what));
        }
        let mut buf = Vec::new();
        let got = (&mut self.r).take(n).read_to_end(&mut buf);
        match got {
            Ok(k) if k as u64 == n => {
                self.pos += n;
                Ok(buf)
            }
            Ok(_) => Err(self.truncated(what)),
            Err(source) => Err(GgufError::Io {
                path: PathBuf::from(self.path),
                source,
            }),
        }
    }

    /// Fails with `TooLarge` unless `count` items of at least `min_bytes`
    /// each (and at most `cap` items) could fit in the rest of the file.
    fn check_count(&self, count: u64, min_bytes: u64, cap: u64, what: &str) -> Result<()> {
        let limit = (self.remaining() / min_bytes.max(1)).min(cap);
        if count > limit {
            return Err(GgufError::TooLarge {
                what: what.to_string(),
                count,
                limit,
                offset: self.pos,
            });
        }
        Ok(())
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.u64(what)?;
        let offset = self.pos;
        self.check_count(len, 1, MAX_STRING_LEN, &format!("length of {what}"))?;
        let bytes = self.bytes(len, what)?;
        String::from_utf8(bytes).map_err(|_| GgufError::InvalidUtf8 {
            what: what.to_string(),
            offset,
        })
    }

    /// Reads `n` fixed-size elements in one piece and decodes each.
    fn fixed<T, const N: usize>(
        &mut self,
        n: u64,
        what: &str,
        f: fn([u8; N]) -> T,
    ) -> Result<Vec<T>> {
        self.check_count(
            n,
            N as u64,
            MAX_ARRAY_LEN,
            &format!("element count of {what}"),
        )?;
        let bytes = self.bytes(n * N as u64, what)?;
        let mut out = Vec::with_capacity(bytes.len() / N);
        for chunk in bytes.chunks_exact(N) {
            let mut b = [0u8; N];
            b.copy_from_slice(chunk);
            out.push(f(b));
        }
        Ok(out)
    }

    fn value(&mut self, type_id: u32, what: &str, depth: u32) -> Result<Value> {
        let offset = self.pos;
        Ok(match type_id {
            vt::U8 => Value::U8(u8::from_le_bytes(self.array(what)?)),
            vt::I8 => Value::I8(i8::from_le_bytes(self.array(what)?)),
            vt::U16 => Value::U16(u16::from_le_bytes(self.array(what)?)),
            vt::I16 => Value::I16(i16::from_le_bytes(self.array(what)?)),
            vt::U32 => Value::U32(u32::from_le_bytes(self.array(what)?)),
            vt::I32 => Value::I32(i32::from_le_bytes(self.array(what)?)),
            vt::F32 => Value::F32(f32::from_le_bytes(self.array(what)?)),
            vt::BOOL => Value::Bool(self.array::<1>(what)?[0] != 0),
            vt::STR => Value::Str(self.string(what)?),
            vt::ARRAY => Value::Array(self.array_value(what, depth)?),
            vt::U64 => Value::U64(u64::from_le_bytes(self.array(what)?)),
            vt::I64 => Value::I64(i64::from_le_bytes(self.array(what)?)),
            vt::F64 => Value::F64(f64::from_le_bytes(self.array(what)?)),
            _ => return Err(unknown_type(what, type_id, offset)),
        })
    }

    fn array_value(&mut self, what: &str, depth: u32) -> Result<Array> {
        let offset = self.pos;
        if depth >= MAX_NESTING {
            return Err(GgufError::NestedTooDeep {
                what: what.to_string(),
                offset,
            });
        }
        let elem = self.u32(what)?;
        let n = self.u64(what)?;
        Ok(match elem {
            vt::U8 => Array::U8(self.fixed(n, what, u8::from_le_bytes)?),
            vt::I8 => Array::I8(self.fixed(n, what, i8::from_le_bytes)?),
            vt::U16 => Array::U16(self.fixed(n, what, u16::from_le_bytes)?),
            vt::I16 => Array::I16(self.fixed(n, what, i16::from_le_bytes)?),
            vt::U32 => Array::U32(self.fixed(n, what, u32::from_le_bytes)?),
            vt::I32 => Array::I32(self.fixed(n, what, i32::from_le_bytes)?),
            vt::F32 => Array::F32(self.fixed(n, what, f32::from_le_bytes)?),
            vt::BOOL => Array::Bool(self.fixed(n, what, |b: [u8; 1]| b[0] != 0)?),
            vt::U64 => Array::U64(self.fixed(n, what, u64::from_le_bytes)?),
            vt::I64 => Array::I64(self.fixed(n, what, i64::from_le_bytes)?),
            vt::F64 => Array::F64(self.fixed(n, what, f64::from_le_bytes)?),
            vt::STR => {
                self.check_count(n, 8, MAX_ARRAY_LEN, &format!("element count of {what}"))?;
                let mut out = Vec::with_capacity(n.min(1 << 16) as usize);
                for _ in 0..n {
                    out.push(self.string(what)?);
                }
                Array::Str(out)
            }
            vt::ARRAY => {
                self.check_count(n, 12, MAX_ARRAY_LEN, &format!("element count of {what}"))?;
                let mut out = Vec::with_capacity(n.min(1 << 10) as usize);
                for _ in 0..n {
                    out.push(self.array_value(what, depth + 1)?);
                }
                Array::Nested(out)
            }
            _ => return Err(unknown_type(what, elem, offset)),
        })
    }
}

fn unknown_type(what: &str, type_id: u32, offset: u64) -> GgufError {
    GgufError::UnknownValueType {
        what: what.to_string(),
        type_id,
        offset,
    }
}

fn bad_shape(tensor: &str, ne: &[u64], reason: String) -> GgufError {
    GgufError::BadShape {
        tensor: tensor.to_string(),
        ne: ne.to_vec(),
        reason,
    }
}

fn parse_with_path<R: Read>(r: R, file_size: u64, path: &Path) -> Result<GgufFile> {
    let mut c = HeaderReader {
        r,
        pos: 0,
        file_size,
        path,
    };

    let magic: [u8; 4] = c.array("magic")?;
    if &magic != b"GGUF" {
        return Err(GgufError::BadMagic { found: magic });
    }
    let version = c.u32("version")?;
    if version != 2 && version != 3 {
        return Err(GgufError::UnsupportedVersion(version));
    }
    let n_tensors = c.u64("tensor count")?;
    let n_kv = c.u64("metadata count")?;
    c.check_count(n_kv, MIN_KV_BYTES, u64::MAX, "metadata count")?;
    c.check_count(n_tensors, MIN_TENSOR_INFO_BYTES, u64::MAX, "tensor count")?;

    let mut metadata = Vec::with_capacity(n_kv.min(1 << 10) as usize);
    let mut keys = HashMap::new();
    for index in 0..n_kv {
        let offset = c.pos;
        let key = c.string(&format!("metadata key #{index}"))?;
        if key.is_empty() {
            return Err(GgufError::EmptyKey { index, offset });
        }
        if keys.insert(key.clone(), metadata.len()).is_some() {
            return Err(GgufError::DuplicateKey(key));
        }
        let what = format!("value of '{key}'");
        let type_id = c.u32(&what)?;
        let value = c.value(type_id, &what, 0)?;
        metadata.push((key, value));
    }

    let alignment = match keys.get(KEY_ALIGNMENT).map(|&i| &metadata[i].1) {
        None => DEFAULT_ALIGNMENT,
        Some(Value::U32(a)) if a.is_power_of_two() => u64::from(*a),
        Some(Value::U32(a)) => return Err(GgufError::BadAlignment(u64::from(*a))),
        Some(v) => {
            return Err(GgufError::WrongType {
                key: KEY_ALIGNMENT.to_string(),
                expected: "u32",
                found: v.type_name(),
            })
        }
    };

    let mut tensors = Vec::with_capacity(n_tensors.min(1 << 12) as usize);
    let mut names = HashMap::new();
    let mut rel_offsets = Vec::with_capacity(tensors.capacity());
    for index in 0..n_tensors {
        let (info, rel) = read_tensor_info(&mut c, index)?;
        if names.insert(info.name.clone(), tensors.len()).is_some() {
            return Err(GgufError::DuplicateTensor(info.name));
        }
        tensors.push(info);
        rel_offsets.push(rel);
    }

    let header_end = c.pos;
    let data_offset = header_end
        .checked_next_multiple_of(alignment)
        .ok_or_else(|| GgufError::TooLarge {
            what: "data section offset".to_string(),
            count: header_end,
            limit: u64::MAX - alignment,
            offset: header_end,
        })?;
    for (t, &rel) in tensors.iter_mut().zip(&rel_offsets) {
        if !rel.is_multiple_of(alignment) {
            return Err(GgufError::Misaligned {
                tensor: t.name.clone(),
                offset: rel,
                alignment,
            });
        }
        let abs = data_offset.checked_add(rel);
        let end = abs.and_then(|a| a.checked_add(t.size));
        if end.is_none_or(|e| e > file_size) {
            return Err(GgufError::DataOutOfRange {
                tensor: t.name.clone(),
                offset: abs.unwrap_or(u64::MAX),
                size: t.size,
                file_size,
            });
        }
        t.offset = abs.unwrap_or(u64::MAX);
    }
    check_overlap(&tensors)?;

    Ok(GgufFile::from_parts(
        version,
        alignment,
        data_offset,
        file_size,
        metadata,
        tensors,
    ))
}

/// Reads one descriptor; returns it with `offset` still unset (0) and the
/// offset relative to the data section beside it.
fn read_tensor_info<R: Read>(c: &mut HeaderReader<'_, R>, index: u64) -> Result<(TensorInfo, u64)> {
    let name = c.string(&format!("name of tensor #{index}"))?;
    if name.len() >= MAX_TENSOR_NAME {
        return Err(GgufError::TensorNameTooLong {
            len: name.len(),
            name,
        });
    }
    let what = format!("descriptor of tensor '{name}'");
    let n_dims = c.u32(&what)?;
    if !(1..=4).contains(&n_dims) {
        return Err(bad_shape(
            &name,
            &[],
            format!("{n_dims} dims, expected 1 to 4"),
        ));
    }
    let mut ne = Vec::with_capacity(n_dims as usize);
    for _ in 0..n_dims {
        ne.push(c.u64(&what)?);
    }
    if let Some(d) = ne.iter().position(|&d| d == 0 || d > i64::MAX as u64) {
        return Err(bad_shape(
            &name,
            &ne,
            format!("dim {d} is {} (must be 1..=i64::MAX)", ne[d]),
        ));
    }
    let n_elements = ne.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d));
    if n_elements.is_none_or(|n| n > i64::MAX as u64) {
        return Err(bad_shape(
            &name,
            &ne,
            "element count overflows i64".to_string(),
        ));
    }
    let type_id = c.u32(&what)?;
    let ty = GgmlType(type_id);
    let (Some(block), Some(type_size)) = (ty.block_size(), ty.type_size()) else {
        return Err(GgufError::UnknownTensorType {
            tensor: name,
            type_id,
        });
    };
    if !ne[0].is_multiple_of(block) {
        let reason = format!(
            "ne0 {} is not a multiple of the {} block size {block}",
            ne[0],
            ty.name()
        );
        return Err(bad_shape(&name, &ne, reason));
    }
    let blocks = n_elements.unwrap_or(0) / block;
    let Some(size) = blocks.checked_mul(type_size) else {
        return Err(bad_shape(&name, &ne, "byte size overflows u64".to_string()));
    };
    let rel = c.u64(&what)?;
    Ok((
        TensorInfo {
            name,
            ne,
            ty,
            offset: 0,
            size,
        },
        rel,
    ))
}

/// Fails with `Overlap` naming the first pair (by offset) that shares bytes.
fn check_overlap(tensors: &[TensorInfo]) -> Result<()> {
    let mut order: Vec<&TensorInfo> = tensors.iter().collect();
    order.sort_by_key(|t| (t.offset, t.size));
    for pair in order.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        // Offsets and sizes were checked to end inside the file: no overflow.
        if a.offset + a.size > b.offset {
            return Err(GgufError::Overlap {
                a: a.name.clone(),
                b: b.name.clone(),
            });
        }
    }
    Ok(())
}
