//! Sequential read throughput of a [`Reader`], the way the pager reads:
//! extents of a fixed size into slots of one registered region, a few
//! extents in flight. `examples/readbench.rs` and `tools/bench/fio-compare.sh`
//! drive it; `strata bench` may call [`sequential_read`] directly.

use super::align::AlignedBuf;
use super::config::ReadRequest;
use super::config::ReaderConfig;
use super::config::RegisteredRegion;
use super::error::StorageError;
use super::reader::ExtentReader;
use super::reader::Reader;
use std::collections::VecDeque;
use std::path::Path;
use std::time::Instant;

/// What one pass over the file measured.
#[derive(Clone, Debug)]
pub struct BenchReport {
    pub bytes: u64,
    pub seconds: f64,
    /// Decimal GB/s (1e9 bytes), as fio prints.
    pub gb_per_s: f64,
    pub backend: super::config::IoBackend,
    pub direct: bool,
    pub queue_depth: usize,
    pub chunk_size: usize,
    pub workers: usize,
    /// Extents kept submitted.
    pub extents_in_flight: usize,
    pub stats: super::config::ReaderStats,
}

/// Reads all of `path` front to back in extents of `extent` bytes, keeping
/// `extents_in_flight` of them submitted (0: enough to keep twice the queue
/// depth of chunks queued, so the depth never drains between extents), and
/// times it.
pub fn sequential_read(
    path: &Path,
    mut cfg: ReaderConfig,
    extent: usize,
    extents_in_flight: usize,
) -> Result<BenchReport, StorageError> {
    let extent = extent.max(1).next_multiple_of(super::align::DIRECT_ALIGN);
    let chunk = cfg.chunk_size.max(1);
    let auto = (2 * cfg.queue_depth.max(1) * chunk).div_ceil(extent) + 1;
    let slots = match extents_in_flight {
        0 => auto.max(2),
        n => n,
    };
    let mut region = AlignedBuf::new(extent * slots)?;
    // SAFETY: `region` is declared before the reader and so outlives it.
    cfg.registered
        .push(unsafe { RegisteredRegion::of(&mut region) });
    let base = region.as_mut_ptr();
    let reader = Reader::open(path, cfg)?;
    let size = reader.file_size();
    let mut free: Vec<AlignedBuf> = (0..slots)
        // SAFETY: slot i is a disjoint extent-sized piece of `region`, used
        // only through this view, and `region` outlives every view.
        .map(|i| unsafe { AlignedBuf::from_raw(base.wrapping_add(i * extent), extent) })
        .collect::<Result<_, _>>()?;
    let mut inflight = VecDeque::new();
    let mut next = 0u64;
    let t0 = Instant::now();
    loop {
        while next < size {
            let Some(buf) = free.pop() else { break };
            let len = (size - next).min(extent as u64);
            let req = ReadRequest {
                file_offset: next,
                len,
                buf_offset: 0,
            };
            inflight.push_back(reader.submit(buf, &[req])?);
            next += len;
        }
        let Some(t) = inflight.pop_front() else { break };
        free.push(t.wait()?.into_buf());
    }
    let seconds = t0.elapsed().as_secs_f64();
    let cfg = reader.config();
    Ok(BenchReport {
        bytes: size,
        seconds,
        gb_per_s: size as f64 / seconds / 1e9,
        backend: reader.backend(),
        direct: reader.is_direct(),
        queue_depth: cfg.queue_depth,
        chunk_size: cfg.chunk_size,
        workers: cfg.workers,
        extents_in_flight: slots,
        stats: reader.stats(),
    })
}
