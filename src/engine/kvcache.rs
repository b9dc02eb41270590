//! The KV cache, one owner for its three parts: the cell table (which
//! sequence and position each cell holds; plain Rust in `kv`), the K and V
//! tensors of the layers whose KV stays on the device, and the tier of the
//! windowed layers (pinned host frames and spill files, `kvtier`). Anything
//! that changes the cells a sequence holds goes through here, so the tier
//! never keeps a frame or a spill file for a block no cell uses.
//!
//! Methods that change the cells need both streams drained: frames may be
//! the source or target of copies still in flight. The engine drains them
//! before calling (`Engine::truncate_seq` and friends).

use super::buffers::KvStore;
use super::error::EngineError;
use super::kvtier::KvTier;
use crate::graph::Binding;
use crate::kv::{KvCells, KvError};
use crate::model::ModelSpec;

pub struct KvCache {
    cells: KvCells,
    resident: KvStore,
    tier: Option<KvTier>,
}

impl KvCache {
    pub(super) fn new(cells: KvCells, resident: KvStore, tier: Option<KvTier>) -> KvCache {
        KvCache {
            cells,
            resident,
            tier,
        }
    }

    /// Which sequence and position each cell holds.
    pub fn cells(&self) -> &KvCells {
        &self.cells
    }
    /// The tier of the windowed layers, if any layer is windowed.
    pub fn tier(&self) -> Option<&KvTier> {
        self.tier.as_ref()
    }
    pub(super) fn tier_mut(&mut self) -> Option<&mut KvTier> {
        self.tier.as_mut()
    }
    /// How many layers keep their KV on the device (the first of the KV
    /// order, `Hparams::kv_order`).
    pub fn resident_layers(&self) -> usize {
        self.resident.n_layers()
    }
    /// Device bytes of the resident layers' K and V.
    pub fn resident_bytes(&self) -> u64 {
        self.resident.bytes
    }
    /// Whether `layer`'s KV travels through a window.
    pub fn is_windowed(&self, layer: u32) -> bool {
        self.tier.as_ref().is_some_and(|t| t.is_windowed(layer))
    }
    /// The K and V tensors attention reads for `layer`: the resident ones,
    /// or window `window` of the tier for a windowed layer.
    pub(super) fn bindings(&self, layer: u32, window: Option<usize>) -> &[Binding; 2] {
        match (window, self.tier.as_ref()) {
            (Some(w), Some(t)) => &t.wbindings[w],
            _ => self.resident.bindings(layer as usize),
        }
    }

    /// Reads the rows of cells [cell, cell + out.len() / row) of layer `l`'s
    /// K (kv 0) or V; windowed layers read from frames the blocks were
    /// brought into (`prepare`).
    pub(super) fn read_rows(
        &self,
        l: usize,
        kv: usize,
        cell: usize,
        row: usize,
        out: &mut [u8],
    ) -> Result<(), EngineError> {
        match self.tier.as_ref() {
            Some(t) if !self.resident.holds(l) => t.read_rows(l as u32, kv, cell, out),
            _ => self.resident.tensor(l, kv).get_bytes(out, cell * row)?,
        }
        Ok(())
    }
    /// Writes rows as `read_rows` reads them.
    pub(super) fn write_rows(
        &mut self,
        l: usize,
        kv: usize,
        cell: usize,
        row: usize,
        data: &[u8],
    ) -> Result<(), EngineError> {
        match self.tier.as_mut() {
            Some(t) if !self.resident.holds(l) => t.write_rows(l as u32, kv, cell, data),
            _ => self.resident.tensor(l, kv).set_bytes(data, cell * row)?,
        }
        Ok(())
    }

    /// Forgets the positions >= `from` of sequence `seq`, in every tier.
    pub(super) fn truncate(&mut self, seq: u32, from: i32) {
        self.cells.truncate_seq(seq, from);
        self.release_empty();
    }
    /// Frees `seq`'s hold on `cells`, in every tier.
    pub(super) fn drop_cells(&mut self, seq: u32, cells: &[u32]) {
        self.cells.drop_cells(seq, cells);
        self.release_empty();
    }
    /// Forgets sequence `seq`, in every tier.
    pub(super) fn remove_seq(&mut self, seq: u32) {
        self.cells.remove_seq(seq);
        self.release_empty();
    }
    /// Forgets every sequence, in every tier.
    pub(super) fn clear(&mut self) {
        self.cells.clear();
        self.release_empty();
    }
    /// Shares the cells of `src` at positions `[p0, p1)` with `dst`, which
    /// holds none yet (the rows are not copied: the cells are shared).
    pub(super) fn copy_seq(&mut self, src: u32, dst: u32, p0: i32, p1: i32) -> Result<(), KvError> {
        self.cells.copy_seq(src, dst, p0, p1)
    }

    /// Places `(seq, pos)` tokens in free cells; returns the cells. On an
    /// error nothing was placed.
    pub(super) fn place(&mut self, sp: &[(u32, i32)]) -> Result<Vec<u32>, KvError> {
        self.cells.place(sp)
    }
    /// Keeps each sequence's cells in position order when placing (batch
    /// invariance, see `KvCells::set_ordered`).
    pub(super) fn set_ordered(&mut self, on: bool) {
        self.cells.set_ordered(on);
    }
    /// The cell table as it is, to go back to if a step fails.
    pub(super) fn snapshot(&self) -> KvCells {
        self.cells.clone()
    }
    /// Goes back to `cells`, a snapshot taken before a step that failed:
    /// the step's cells are given back, and blocks that only they used
    /// lose their frames.
    pub(super) fn restore(&mut self, cells: KvCells) {
        self.cells = cells;
        self.release_empty();
    }

    /// Brings the blocks of the sequences in `mask` into the tier's frames
    /// (a no-op without windowed layers) and plans the step's KV copies.
    /// `before`: the cells before `new_cells` were placed; `tokens`: the
    /// step's (sequence, position) pairs when attention runs.
    pub(super) fn prepare(
        &mut self,
        before: &KvCells,
        new_cells: &[u32],
        mask: u64,
        tokens: Option<&[(u32, i32)]>,
    ) -> Result<(), EngineError> {
        let Some(t) = self.tier.as_mut() else {
            return Ok(());
        };
        let b = t.block();
        t.prepare(
            &self.cells,
            |blk| before.block_rows(blk as usize, b) > 0,
            new_cells,
            mask,
            tokens,
        )
    }

    fn release_empty(&mut self) {
        if let Some(t) = self.tier.as_mut() {
            t.release_empty(&self.cells);
        }
    }
}
/// Identifies the model a KV spill or session file belongs to: its
/// architecture, shapes and the first bytes of its token embeddings.
pub fn kv_fingerprint(spec: &ModelSpec) -> u64 {
    // FNV-1a: stable across builds, so a session file outlives the binary
    let text = format!(
        "{:?}|{:?}|{:?}|{}",
        spec.arch, spec.hp, spec.tok_embd.ty, spec.tok_embd.size
    );
    text.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}
