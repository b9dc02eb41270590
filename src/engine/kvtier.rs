//! The tiered KV cache of windowed layers: GPU windows, pinned DRAM frames
//! and SSD spill files.
//!
//! Layers whose KV the `--kv-budget` cannot keep on the GPU are *windowed*:
//! between steps their KV lives in host frames (block `b` of every windowed
//! layer shares frame `f`, see [`crate::kv::tier`]). When such a layer's
//! attention group runs, the pager first uploads the blocks of the batch's
//! sequences into a GPU window (a full-size K/V pair, cells at their own
//! index, so the graph is the same as for a resident cache), and after the
//! group ran it copies the rows the step wrote back into the frames. Windows
//! form a slot ring on the copy stream like weight slots do.
//!
//! Blocks beyond the frames go to spill files (one file per block, holding
//! that block of every windowed layer) in a private directory; see
//! [`crate::kv::spill`] for the format.

use super::error::EngineError;
use crate::dtype::GgmlType;
use crate::ggml::{Backend, Binding, Buffer, BufferUsage, Device, Tensor, TensorArena, TensorSpec};
use crate::kv::spill::{EntryDesc, KvFile, KvShape, Quota, SpillDir};
use crate::kv::tier::{Action, TierTable};
use crate::kv::KvCells;
use crate::model::Hparams;
use crate::paging::sizes;
use std::path::PathBuf;

/// How the windowed layers' KV is kept.
#[derive(Clone, Debug)]
pub struct KvTierConfig {
    /// Cells per block.
    pub block: usize,
    /// Host frames (one block of every windowed layer each), as the
    /// memory plan decided; at least 1.
    pub frames: usize,
    /// Where the private spill directory is made.
    pub spill_parent: PathBuf,
    /// Most bytes the spill files may take.
    pub spill_max: Option<u64>,
}

/// KV traffic of one step (or totals, see [`KvTier::stats`]).
#[derive(Clone, Copy, Debug, Default)]
pub struct KvStats {
    /// Host-to-GPU bytes of KV blocks.
    pub up_bytes: u64,
    /// GPU-to-host bytes of new KV rows.
    pub down_bytes: u64,
    pub spilled: u64,
    pub loaded: u64,
    pub spill_bytes: u64,
    pub load_bytes: u64,
}

/// A contiguous run of cells and the host rows holding them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Run {
    cell: usize,
    /// Row index into a layer's frame array (frame * block + offset).
    hrow: usize,
    n: usize,
}

fn push_run(runs: &mut Vec<Run>, r: Run) {
    if let Some(p) = runs.last_mut() {
        if p.cell + p.n == r.cell && p.hrow + p.n == r.hrow {
            p.n += r.n;
            return;
        }
    }
    runs.push(r);
}

pub struct KvTier {
    /// Windowed layers, in order.
    pub layers: Vec<u32>,
    index_of: Vec<Option<usize>>,
    block: usize,
    row: usize,
    n_ctx: usize,
    frames: usize,
    // GPU windows: K and V per slot
    /// K and V of each window slot: tensors 2s and 2s+1.
    windows: TensorArena,
    pub wbindings: Vec<[Binding; 2]>,
    host: Buffer,
    pub host_pinned: bool,
    pub table: TierTable,
    spill: Option<SpillDir>,
    spill_parent: PathBuf,
    quota: Option<std::sync::Arc<Quota>>,
    shape: KvShape,
    /// Per windowed layer: the sliding window it attends over, if any.
    swa: Vec<Option<u32>>,
    /// This step's uploads: the blocks in frames for the step, and, where
    /// those are more than a sliding-window layer reads, that layer's (only
    /// the blocks its window sees).
    up: Vec<Run>,
    up_swa: Option<Vec<Run>>,
    down: Vec<Run>,
    /// Window slot -> windowed layer whose new rows still wait to go back.
    occupant: Vec<Option<usize>>,
    pub step: KvStats,
    pub total: KvStats,
}

impl KvTier {
    /// Window and frame memory for `layers` (windowed layers), `slots`
    /// windows on `dev`, cells of `row` bytes.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        dev: Device,
        layers: Vec<u32>,
        n_layer: usize,
        hp: &Hparams,
        n_ctx: usize,
        slots: usize,
        fingerprint: u64,
        cfg: &KvTierConfig,
    ) -> Result<KvTier, EngineError> {
        let n_embd_kv = hp.n_embd_kv() as usize;
        let row = sizes::kv_row_bytes(hp) as usize;
        let block = cfg.block.clamp(1, n_ctx);
        let n_blocks = n_ctx.div_ceil(block);
        let frame_bytes = layers.len() as u64 * sizes::kv_bytes(hp, block as u64);
        let frames = cfg.frames.clamp(1, n_blocks);
        // windows; read where the mask hides them, so zeroed (finite)
        let spec = TensorSpec::new(GgmlType::F16, &[n_embd_kv as i64, n_ctx as i64]);
        let windows =
            TensorArena::new(dev.buffer_type(), BufferUsage::Any, &vec![spec; 2 * slots])?;
        let wbindings = (0..slots)
            .map(|s| [windows.binding(2 * s), windows.binding(2 * s + 1)])
            .collect();
        // frames
        let host_bytes = frames * frame_bytes as usize;
        let (host, host_pinned) =
            super::buffers::alloc_host(dev, host_bytes, BufferUsage::Any, "the KV cache")?;
        host.clear(0);
        let mut index_of = vec![None; n_layer];
        for (i, &l) in layers.iter().enumerate() {
            index_of[l as usize] = Some(i);
        }
        let swa = layers
            .iter()
            .map(|&l| hp.is_swa(l).then_some(hp.n_swa))
            .collect();
        Ok(KvTier {
            layers,
            index_of,
            block,
            row,
            n_ctx,
            frames,
            windows,
            wbindings,
            host,
            host_pinned,
            table: TierTable::new(n_blocks, frames),
            spill: None,
            spill_parent: cfg.spill_parent.clone(),
            quota: cfg.spill_max.map(|m| std::sync::Arc::new(Quota::new(m))),
            shape: KvShape {
                fingerprint,
                row_bytes: row as u32,
                block_size: block as u32,
            },
            swa,
            up: Vec::new(),
            up_swa: None,
            down: Vec::new(),
            occupant: vec![None; slots],
            step: KvStats::default(),
            total: KvStats::default(),
        })
    }

    pub fn block(&self) -> usize {
        self.block
    }
    pub fn windows(&self) -> usize {
        self.occupant.len()
    }
    pub fn frames(&self) -> usize {
        self.frames
    }
    pub fn host_bytes(&self) -> u64 {
        self.host.size() as u64
    }
    pub fn window_bytes(&self) -> u64 {
        self.windows.bytes() as u64
    }
    pub fn is_windowed(&self, layer: u32) -> bool {
        self.index_of[layer as usize].is_some()
    }

    fn window(&self, slot: usize, kv: usize) -> Tensor<'_> {
        self.windows.tensor(2 * slot + kv)
    }

    /// Byte offset of host rows [hrow, hrow + n) of windowed layer `li`, K
    /// (kv 0) or V, checked to lie inside the host buffer.
    fn host_off(&self, li: usize, kv: usize, hrow: usize, n: usize) -> usize {
        assert!(
            li < self.layers.len() && kv < 2 && hrow + n <= self.frames * self.block,
            "host rows out of range"
        );
        ((li * 2 + kv) * self.frames * self.block + hrow) * self.row
    }

    fn host_rows(&self, li: usize, kv: usize, hrow: usize, n: usize) -> &[u8] {
        let off = self.host_off(li, kv, hrow, n);
        // SAFETY: the range lies inside the host buffer (host_off checks);
        // host writes need &mut self. Device write-backs into frames may be
        // in flight while an upload reads (other layers' rows, never these:
        // a layer's write-back is queued before its next upload on the same
        // stream); host reads of frames come after the copy stream drained.
        unsafe { std::slice::from_raw_parts(self.host.base().add(off), n * self.row) }
    }

    fn host_rows_mut(&mut self, li: usize, kv: usize, hrow: usize, n: usize) -> &mut [u8] {
        let off = self.host_off(li, kv, hrow, n);
        // SAFETY: as host_rows; &mut self makes this the only host view.
        unsafe { std::slice::from_raw_parts_mut(self.host.base().add(off), n * self.row) }
    }

    /// K and V rows of one frame range at once (disjoint regions).
    fn host_kv_mut(&mut self, li: usize, hrow: usize, n: usize) -> (&mut [u8], &mut [u8]) {
        let (k, v) = (self.host_off(li, 0, hrow, n), self.host_off(li, 1, hrow, n));
        let base = self.host.base();
        // SAFETY: both ranges lie inside the host buffer and do not overlap
        // (K and V arrays of a layer are separate); &mut self makes these the
        // only host views.
        unsafe {
            (
                std::slice::from_raw_parts_mut(base.add(k), n * self.row),
                std::slice::from_raw_parts_mut(base.add(v), n * self.row),
            )
        }
    }

    /// Brings the blocks of the sequences in `mask` into frames (spilling
    /// or reloading blocks as needed) and works out this step's copies.
    /// `had_data(b)`: block b held cells before the step's tokens were
    /// placed; `new_cells` are where the step's tokens go; `tokens`, the
    /// step's (sequence, position) pairs when attention runs (then
    /// sliding-window layers upload only the blocks their window sees).
    pub fn prepare(
        &mut self,
        cells: &KvCells,
        had_data: impl Fn(u32) -> bool,
        new_cells: &[u32],
        mask: u64,
        tokens: Option<&[(u32, i32)]>,
    ) -> Result<(), EngineError> {
        self.step = KvStats::default();
        // the blocks a sliding-window layer reads (the window is the same
        // for every such layer); where every windowed layer is one, only
        // those need frames: older blocks may stay spilled
        let window = self.swa.iter().flatten().next().copied();
        let seen = match (window, tokens) {
            (Some(w), Some(t)) => Some(cells.window_blocks(t, w, self.block)),
            _ => None,
        };
        let (needed, seen) = match seen {
            Some(s) if self.swa.iter().all(Option::is_some) => (s, None),
            s => (cells.blocks_of(mask, self.block), s),
        };
        let plan = self.table.plan(&needed, &had_data)?;
        for a in plan {
            match a {
                Action::Spill { block, frame } => self.spill_block(block, frame)?,
                Action::Load { block, frame } => self.load_block(block, frame)?,
                Action::Drop { .. } | Action::Alloc { .. } => {}
            }
            self.table.apply(a);
        }
        self.table.touch(&needed);
        let b = self.block;
        let mut written: Vec<u32> = new_cells.iter().map(|&c| c / b as u32).collect();
        written.dedup();
        for w in written {
            if self.table.written(w) {
                self.remove_file(w);
            }
        }
        self.up = self.runs(cells, &needed);
        self.up_swa = seen.map(|s| self.runs(cells, &s));
        self.down.clear();
        let mut sorted = new_cells.to_vec();
        sorted.sort_unstable();
        for c in sorted {
            let c = c as usize;
            let f = self
                .table
                .frame_of((c / b) as u32)
                .expect("written block has a frame") as usize;
            push_run(
                &mut self.down,
                Run {
                    cell: c,
                    hrow: f * b + c % b,
                    n: 1,
                },
            );
        }
        Ok(())
    }

    /// The uploads of `blocks` (each in a frame): their used rows.
    fn runs(&self, cells: &KvCells, blocks: &[u32]) -> Vec<Run> {
        let b = self.block;
        let mut up = Vec::new();
        for &blk in blocks {
            let f = self.table.frame_of(blk).expect("needed block has a frame") as usize;
            let n = cells.block_rows(blk as usize, b);
            if n > 0 {
                push_run(
                    &mut up,
                    Run {
                        cell: blk as usize * b,
                        hrow: f * b,
                        n,
                    },
                );
            }
        }
        up
    }

    /// The step's uploads of windowed layer index `li`.
    fn up_of(&self, li: usize) -> &[Run] {
        match (self.swa[li], &self.up_swa) {
            (Some(_), Some(up)) => up,
            _ => &self.up,
        }
    }

    /// Uploads the step's blocks of windowed layer `layer` into window
    /// `slot`, on `copy` (GPU) or synchronously (CPU). First writes back
    /// the rows the slot's previous layer computed.
    pub fn upload(
        &mut self,
        layer: u32,
        slot: usize,
        copy: Option<&Backend>,
    ) -> Result<u64, EngineError> {
        self.writeback(slot, copy)?;
        let li = self.index_of[layer as usize].expect("layer is windowed");
        let mut bytes = 0;
        for kv in 0..2 {
            let t = self.window(slot, kv);
            for r in self.up_of(li) {
                let src = self.host_rows(li, kv, r.hrow, r.n);
                let off = r.cell * self.row;
                assert!(off + src.len() <= t.nbytes());
                match copy {
                    // SAFETY: src is host memory (pinned; if pinning fell
                    // back, CUDA stages the copy) not written until the copy
                    // stream drained; the window slot is free (the copy
                    // stream waited its free event); range checked.
                    Some(c) => unsafe { c.tensor_set_async(t, src, off) },
                    None => t.set_bytes(src, off)?,
                }
                bytes += src.len() as u64;
            }
        }
        self.occupant[slot] = Some(li);
        self.step.up_bytes += bytes;
        self.total.up_bytes += bytes;
        Ok(bytes)
    }

    /// Bytes windowed layer `layer` uploads this step.
    pub fn upload_bytes(&self, layer: u32) -> u64 {
        let li = self.index_of[layer as usize].expect("layer is windowed");
        2 * (self.up_of(li).iter().map(|r| r.n).sum::<usize>() * self.row) as u64
    }

    /// Copies the new rows of the layer that last ran in `slot` back to its
    /// frames. On the GPU the copy stream must have waited the slot's free
    /// event first.
    pub fn writeback(&mut self, slot: usize, copy: Option<&Backend>) -> Result<(), EngineError> {
        let Some(li) = self.occupant[slot].take() else {
            return Ok(());
        };
        let mut bytes = 0;
        let runs = std::mem::take(&mut self.down);
        for kv in 0..2 {
            for r in &runs {
                let off = r.cell * self.row;
                let hoff = self.host_off(li, kv, r.hrow, r.n);
                let t = self.window(slot, kv);
                // SAFETY: inside the host buffer (host_off checks); &mut self
                // makes this the only host view of these rows.
                let dst = unsafe {
                    std::slice::from_raw_parts_mut(self.host.base().add(hoff), r.n * self.row)
                };
                assert!(off + dst.len() <= t.nbytes());
                match copy {
                    // SAFETY: dst is host frame memory nobody reads before
                    // the copy stream drained; the layer's computation
                    // finished (free event waited); range checked.
                    Some(c) => unsafe { c.tensor_get_async(t, dst, off) },
                    None => t.get_bytes(dst, off)?,
                }
                bytes += dst.len() as u64;
            }
        }
        self.down = runs;
        self.step.down_bytes += bytes;
        self.total.down_bytes += bytes;
        Ok(())
    }

    /// Drops the write-backs of a step that failed.
    pub fn forget_pending(&mut self) {
        self.occupant.fill(None);
    }

    /// Window slots whose rows still wait to go back.
    pub fn pending_slots(&self) -> Vec<usize> {
        (0..self.occupant.len())
            .filter(|&s| self.occupant[s].is_some())
            .collect()
    }

    /// Debug: fills window `slot` with a huge finite value (f16 0x7B7B,
    /// about 6e4) after its rows went back, so attending a row the next
    /// upload did not bring changes the logits. Not NaN: CUDA's attention
    /// reads masked cells too (scaled by zero), where NaN would spread.
    pub fn poison(&self, slot: usize) -> Result<(), EngineError> {
        for kv in 0..2 {
            self.window(slot, kv).fill(0x7B)?;
        }
        Ok(())
    }

    fn spill_dir(&mut self) -> Result<&SpillDir, EngineError> {
        if self.spill.is_none() {
            self.spill = Some(SpillDir::create(&self.spill_parent, self.quota.clone())?);
        }
        Ok(self.spill.as_ref().expect("just made"))
    }

    fn file_name(b: u32) -> String {
        format!("block-{b}.kv")
    }

    fn spill_block(&mut self, b: u32, frame: u32) -> Result<(), EngineError> {
        let n = self.block;
        let f = frame as usize;
        let shape = self.shape;
        if self.spill.is_none() {
            self.spill_dir()?;
        }
        let dir = self.spill.as_ref().expect("made above");
        let entries: Vec<_> = (0..self.layers.len())
            .map(|li| {
                (
                    EntryDesc {
                        layer: self.layers[li],
                        block: b,
                        n_rows: n as u32,
                    },
                    self.host_rows(li, 0, f * n, n),
                    self.host_rows(li, 1, f * n, n),
                )
            })
            .collect();
        let (_, written) = dir.write(&Self::file_name(b), shape, &[], &entries)?;
        self.step.spilled += 1;
        self.step.spill_bytes += written;
        self.total.spilled += 1;
        self.total.spill_bytes += written;
        Ok(())
    }

    fn load_block(&mut self, b: u32, frame: u32) -> Result<(), EngineError> {
        let n = self.block;
        let f = frame as usize;
        let path = self.spill_dir()?.path_for(&Self::file_name(b));
        let mut file = KvFile::open(&path, self.shape)?;
        let want: Vec<EntryDesc> = (0..self.layers.len())
            .map(|li| EntryDesc {
                layer: self.layers[li],
                block: b,
                n_rows: n as u32,
            })
            .collect();
        if file.entries() != want.as_slice() {
            return Err(crate::kv::spill::SpillError::Corrupt {
                path,
                what: format!(
                    "holds {} entries that are not block {b} of the {} windowed layers",
                    file.entries().len(),
                    self.layers.len()
                ),
            }
            .into());
        }
        for li in 0..self.layers.len() {
            let (k, v) = self.host_kv_mut(li, f * n, n);
            file.read_entry(li, k, v)?;
        }
        let bytes = (2 * self.layers.len() * n * self.row) as u64;
        self.step.loaded += 1;
        self.step.load_bytes += bytes;
        self.total.loaded += 1;
        self.total.load_bytes += bytes;
        Ok(())
    }

    fn remove_file(&mut self, b: u32) {
        if let Some(d) = self.spill.as_ref() {
            let path = d.path_for(&Self::file_name(b));
            if let Err(e) = d.remove(&path) {
                // a stale file is never read again (the table no longer
                // lists it); only its space is lost until the directory goes
                tracing::warn!("{e}");
            }
        }
    }

    /// Frees the frames and spill files of blocks that hold no cells.
    pub fn release_empty(&mut self, cells: &KvCells) {
        for b in 0..self.table.n_blocks() as u32 {
            if cells.block_rows(b as usize, self.block) == 0
                && (self.table.frame_of(b).is_some() || self.table.on_disk(b))
                && self.table.release(b)
            {
                self.remove_file(b);
            }
        }
    }

    /// The spill directory, once a block was spilled.
    pub fn spill_path(&self) -> Option<PathBuf> {
        self.spill.as_ref().map(|d| d.path().to_path_buf())
    }

    /// Host rows of cells [cell, cell + n) that lie in one block, in its
    /// frame: (windowed layer index, first host row, rows).
    fn frame_rows(&self, layer: u32, cell: usize, n: usize) -> (usize, usize, usize) {
        let li = self.index_of[layer as usize].expect("layer is windowed");
        let b = (cell / self.block) as u32;
        let f = self
            .table
            .frame_of(b)
            .expect("block has a frame (see prepare)");
        let n = n.min(self.block - cell % self.block);
        (li, f as usize * self.block + cell % self.block, n)
    }

    /// Reads the rows of cells [cell, cell + out.len() / row) of windowed
    /// layer `layer` (K or V) from the frames, whose blocks `prepare`
    /// brought in. Between steps only.
    pub fn read_rows(&self, layer: u32, kv: usize, cell: usize, out: &mut [u8]) {
        let mut done = 0;
        while done < out.len() {
            let (li, hrow, n) =
                self.frame_rows(layer, cell + done / self.row, (out.len() - done) / self.row);
            out[done..done + n * self.row].copy_from_slice(self.host_rows(li, kv, hrow, n));
            done += n * self.row;
        }
    }

    /// Writes rows of cells starting at `cell` of windowed layer `layer`
    /// into the frames, as `read_rows` reads them. Between steps only.
    pub fn write_rows(&mut self, layer: u32, kv: usize, cell: usize, data: &[u8]) {
        let mut done = 0;
        while done < data.len() {
            let (li, hrow, n) = self.frame_rows(
                layer,
                cell + done / self.row,
                (data.len() - done) / self.row,
            );
            let bytes = n * self.row;
            self.host_rows_mut(li, kv, hrow, n)
                .copy_from_slice(&data[done..done + bytes]);
            done += bytes;
        }
    }

    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }
    pub fn row_bytes(&self) -> usize {
        self.row
    }
}
