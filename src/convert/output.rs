//! Writing a planned model safely.
//!
//! [`write_model`] plans the layout, fills in the `strata.*` metadata with
//! absolute offsets (the offsets arrays have a fixed encoded size, so the
//! data section start is known before their values), and writes through
//! `GgufWriter` into `.NAME.partial-PID` beside the output. The magic is
//! written as zeros first and as "GGUF" only after every byte is on disk
//! (fsync); the file is then reopened and checked (header, model, layout)
//! before the rename. Any failure, cancellation included, removes the
//! temporary file. So no interrupted or failed run leaves a file that a GGUF
//! reader accepts, under any name.

use super::cancel::is_cancelled;
use super::check::check_layout;
use super::error::ConvertError;
use super::error::Result;
use super::layout::KEY_ALIGNMENT;
use super::layout::KEY_GROUP_OFFSETS;
use super::layout::KEY_GROUP_SIZES;
use super::layout::KEY_LAYOUT;
use super::layout::LAYOUT_NAME;
use super::layout::STRATA_ALIGNMENT;
use super::layout::{plan, Extent, Slot};
use crate::dtype::GgmlType;
use crate::gguf::{
    Array, GgufFile, GgufWriter, TensorDataFn, TensorInfo, Value,
    KEY_ALIGNMENT as GENERAL_ALIGNMENT,
};
use crate::model::ModelSpec;
use indicatif::{ProgressBar, ProgressStyle};
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Writes one tensor's bytes (exactly its size) when the file is written.
pub type TensorFill = TensorDataFn;

/// One tensor of the output.
pub struct OutTensor {
    pub name: String,
    /// ggml order.
    pub ne: Vec<u64>,
    pub ty: GgmlType,
    pub fill: TensorFill,
}

impl OutTensor {
    /// Bytes of data (0 if the shape does not fit the type; the writer
    /// rejects such a tensor with a precise error).
    pub fn size(&self) -> u64 {
        let rows: u64 = self.ne.iter().skip(1).product();
        self.ne
            .first()
            .and_then(|&n0| self.ty.row_bytes(n0))
            .map_or(0, |r| r * rows)
    }
}

/// A complete model to write: metadata (any `general.alignment` and
/// `strata.*` keys are replaced) and tensors in any order.
pub struct OutputModel {
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<OutTensor>,
    pub n_layer: u32,
}

/// What was written.
#[derive(Clone, Debug)]
pub struct WriteSummary {
    pub path: PathBuf,
    pub file_size: u64,
    pub n_tensors: usize,
    pub data_offset: u64,
    /// Absolute extents, groups order.
    pub groups: Vec<Extent>,
    pub seconds: f64,
}

/// Counts bytes, keeps the magic zeroed, feeds the progress bar and fails
/// once cancellation is requested.
struct Guarded<W> {
    w: W,
    pos: u64,
    bar: ProgressBar,
}

const CANCELLED_MSG: &str = "strata-convert: cancelled";

impl<W: Write> Write for Guarded<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if is_cancelled() {
            // not ErrorKind::Interrupted: write_all would retry it forever
            return Err(io::Error::other(CANCELLED_MSG));
        }
        let n = if self.pos < 4 {
            let k = (4 - self.pos as usize).min(buf.len());
            self.w.write_all(&[0u8; 4][..k])?;
            k
        } else {
            self.w.write(buf)?
        };
        self.pos += n as u64;
        self.bar.inc(n as u64);
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.w.flush()
    }
}

fn progress_bar(total: u64, show: bool) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let style = ProgressStyle::with_template(
        "{spinner} [{elapsed_precise}] [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta} {msg}",
    )
    .map(|s| s.progress_chars("=> "))
    .unwrap_or_else(|_| ProgressStyle::default_bar());
    ProgressBar::new(total).with_style(style)
}

/// Free bytes for unprivileged users on the filesystem holding `dir`.
fn free_space(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs is plain data, zero is a valid bit pattern.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path and `st` a valid out-pointer.
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut st) };
    (rc == 0).then(|| st.f_bavail as u64 * st.f_frsize as u64)
}

fn temp_path(out: &Path) -> PathBuf {
    let name = out.file_name().map(|n| n.to_string_lossy().into_owned());
    let name = name.unwrap_or_else(|| "out".into());
    out.with_file_name(format!(".{name}.partial-{}", std::process::id()))
}

/// Plans, writes, verifies and renames `model` to `out`.
pub fn write_model(model: OutputModel, out: &Path, progress: bool) -> Result<WriteSummary> {
    let t0 = Instant::now();
    if out.is_dir() {
        return Err(ConvertError::Io {
            path: out.to_path_buf(),
            err: io::Error::new(io::ErrorKind::IsADirectory, "output is a directory"),
        });
    }
    let items: Vec<(Slot, u64)> = model
        .tensors
        .iter()
        .map(|t| (Slot::of(&t.name), t.size()))
        .collect();
    let layout = plan(&items, model.n_layer, STRATA_ALIGNMENT)?;
    let n_groups = layout.groups.len();

    let names: Vec<(String, Vec<u64>, GgmlType)> = (model.tensors.iter())
        .map(|t| (t.name.clone(), t.ne.clone(), t.ty))
        .collect();
    let mut metadata: Vec<(String, Value)> = model
        .metadata
        .into_iter()
        .filter(|(k, _)| k != GENERAL_ALIGNMENT && !super::layout::is_layout_key(k))
        .collect();
    metadata.push((KEY_LAYOUT.into(), Value::Str(LAYOUT_NAME.into())));
    metadata.push((KEY_ALIGNMENT.into(), Value::U32(STRATA_ALIGNMENT as u32)));
    metadata.push((
        KEY_GROUP_OFFSETS.into(),
        Value::Array(Array::U64(vec![0; n_groups])),
    ));
    metadata.push((
        KEY_GROUP_SIZES.into(),
        Value::Array(Array::U64(vec![0; n_groups])),
    ));
    let mut w = GgufWriter::new(STRATA_ALIGNMENT);
    for (k, v) in &metadata {
        w.set(k, v.clone());
    }

    let n_tensors = model.tensors.len();
    let mut slots: Vec<Option<OutTensor>> = model.tensors.into_iter().map(Some).collect();
    let bar = progress_bar(0, progress);
    for &i in &layout.order {
        let Some(t) = slots[i].take() else { continue };
        let (b, name, fill) = (bar.clone(), t.name.clone(), t.fill);
        let fill: TensorFill = Box::new(move |w| {
            b.set_message(name.clone());
            fill(w)
        });
        w.add_tensor_fn(&t.name, &t.ne, t.ty, fill)?;
    }
    let data_offset = w.data_offset()?;
    let groups: Vec<Extent> = (layout.groups.iter())
        .map(|e| Extent {
            offset: data_offset + e.offset,
            size: e.size,
        })
        .collect();
    let offsets = Value::Array(Array::U64(groups.iter().map(|e| e.offset).collect()));
    let sizes = Value::Array(Array::U64(groups.iter().map(|e| e.size).collect()));
    w.set(KEY_GROUP_OFFSETS, offsets.clone());
    w.set(KEY_GROUP_SIZES, sizes.clone());
    for (k, v) in metadata.iter_mut() {
        if k == KEY_GROUP_OFFSETS {
            *v = offsets.clone();
        } else if k == KEY_GROUP_SIZES {
            *v = sizes.clone();
        }
    }
    if w.data_offset()? != data_offset {
        return Err(ConvertError::Layout(
            "header size changed while filling offsets".into(),
        ));
    }
    let file_size = data_offset + layout.data_size;
    // Pre-flight: the header as it will be read back must describe a model
    // strata runs (hyperparameters, shapes, types) before a byte is written.
    let infos = (layout.order.iter())
        .map(|&i| TensorInfo {
            name: names[i].0.clone(),
            ne: names[i].1.clone(),
            ty: names[i].2,
            offset: data_offset + layout.offsets[i],
            size: items[i].1,
        })
        .collect();
    let mut md: Vec<(String, Value)> = metadata
        .into_iter()
        .filter(|(k, _)| k != GENERAL_ALIGNMENT)
        .collect();
    md.push((
        GENERAL_ALIGNMENT.into(),
        Value::U32(STRATA_ALIGNMENT as u32),
    ));
    let header = GgufFile::from_parts(3, STRATA_ALIGNMENT, data_offset, file_size, md, infos);
    ModelSpec::from_gguf(&header)?;
    let dir = match out.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if let Some(have) = free_space(&dir) {
        if have < file_size {
            return Err(ConvertError::NoSpace {
                dir,
                need: file_size,
                have,
            });
        }
    }

    bar.set_length(file_size);
    let tmp = temp_path(out);
    let result = write_temp(&w, &tmp, bar.clone()).and_then(|()| verify(&tmp, &groups, file_size));
    bar.finish_and_clear();
    if let Err(e) = result {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    if let Err(err) = fs::rename(&tmp, out) {
        let _ = fs::remove_file(&tmp);
        return Err(ConvertError::Io {
            path: out.to_path_buf(),
            err,
        });
    }
    if let Ok(d) = File::open(&dir) {
        let _ = d.sync_all(); // persist the rename; best effort
    }
    Ok(WriteSummary {
        path: out.to_path_buf(),
        file_size,
        n_tensors,
        data_offset,
        groups,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

fn write_temp(w: &GgufWriter, tmp: &Path, bar: ProgressBar) -> Result<()> {
    let io_err = ConvertError::io(tmp);
    let file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(tmp)
        .map_err(io_err)?;
    let mut g = Guarded {
        w: BufWriter::with_capacity(1 << 22, file),
        pos: 0,
        bar,
    };
    if let Err(e) = w.write_to_path(&mut g, tmp) {
        return Err(if is_cancelled() {
            ConvertError::Cancelled
        } else {
            e.into()
        });
    }
    let file =
        g.w.into_inner()
            .map_err(|e| ConvertError::io(tmp)(e.into_error()))?;
    file.sync_all().map_err(ConvertError::io(tmp))?;
    file.write_all_at(b"GGUF", 0)
        .map_err(ConvertError::io(tmp))?;
    file.sync_all().map_err(ConvertError::io(tmp))?;
    if is_cancelled() {
        return Err(ConvertError::Cancelled);
    }
    Ok(())
}

/// Reopens the written file: it must parse, describe a supported model, be
/// strata-aligned and declare exactly the planned extents.
fn verify(tmp: &Path, groups: &[Extent], file_size: u64) -> Result<()> {
    let verr = |e: String| ConvertError::Verify(e);
    let f = GgufFile::open(tmp).map_err(|e| verr(e.to_string()))?;
    if f.file_size != file_size {
        return Err(verr(format!(
            "file is {} bytes, planned {file_size}",
            f.file_size
        )));
    }
    let spec = ModelSpec::from_gguf(&f).map_err(|e| verr(e.to_string()))?;
    let r = check_layout(&f, &spec);
    if !r.is_aligned() {
        return Err(verr(r.problems.join("; ")));
    }
    if r.declared.as_deref() != Some(groups) {
        return Err(verr("declared extents differ from the plan".into()));
    }
    Ok(())
}

/// Streams `n` chunks to `w`: a helper thread makes chunk i+1 (with
/// `make(i, buf)`, which may itself fan out over threads) while chunk i is
/// written, so producing and writing overlap.
pub(crate) fn pipelined<F>(w: &mut dyn Write, n: usize, make: F) -> io::Result<()>
where
    F: Fn(usize, &mut Vec<u8>) -> io::Result<()> + Sync,
{
    use std::sync::mpsc::{channel, sync_channel};
    std::thread::scope(|s| {
        let (tx, rx) = sync_channel::<io::Result<Vec<u8>>>(1);
        let (back_tx, back_rx) = channel::<Vec<u8>>();
        let make = &make;
        s.spawn(move || {
            for i in 0..n {
                let mut buf = back_rx.try_recv().unwrap_or_default();
                buf.clear();
                let r = make(i, &mut buf).map(|()| buf);
                let failed = r.is_err();
                if tx.send(r).is_err() || failed || is_cancelled() {
                    return;
                }
            }
        });
        for _ in 0..n {
            let buf = rx
                .recv()
                .map_err(|_| io::Error::other("chunk producer stopped"))??;
            w.write_all(&buf)?;
            let _ = back_tx.send(buf);
        }
        Ok(())
    })
}

/// Maps a conversion error into the `io::Error` a tensor fill returns.
pub(crate) fn to_io(e: ConvertError) -> io::Error {
    io::Error::other(e.to_string())
}
