//! Saving and restoring one sequence's KV cache, in the spill format
//! ([`crate::kv::spill`]): temp file, fsync, rename; checksummed header and
//! entries. Entry `(layer, k)` holds the sequence's cells `256k..256k+255`
//! in cell order; the extra payload holds their positions, then the
//! caller's bytes (tokens, sampler state).

use super::error::EngineError;
use super::state::Engine;
use crate::kv::spill::{self, EntryDesc, KvFile, KvShape, SpillError};
use crate::paging::sizes;
use std::path::Path;

/// Cells per entry of a session file.
const CHUNK: usize = 256;

/// Runs of consecutive cells: (first cell, index into `cells`, length).
fn runs(cells: &[u32]) -> Vec<(usize, usize, usize)> {
    let mut out: Vec<(usize, usize, usize)> = Vec::new();
    for (i, &c) in cells.iter().enumerate() {
        match out.last_mut() {
            Some((c0, _, n)) if *c0 + *n == c as usize => *n += 1,
            _ => out.push((c as usize, i, 1)),
        }
    }
    out
}

impl Engine {
    /// Session files hold one device's layers: refused for a model split
    /// across devices.
    fn one_part(&self) -> Result<(), EngineError> {
        if self.next.is_some() {
            return Err(EngineError::Unsupported(
                "session files for a model split across devices (use one device: --devices 0)",
            ));
        }
        Ok(())
    }

    /// The shape (model fingerprint, row and entry sizes) of this engine's
    /// session files.
    pub fn session_shape(&self) -> KvShape {
        KvShape {
            fingerprint: super::kvcache::kv_fingerprint(&self.spec),
            row_bytes: sizes::kv_row_bytes(&self.spec.hp) as u32,
            block_size: CHUNK as u32,
        }
    }

    /// Reads rows of cells from `cell` on of layer `l` (K or V) into `out`.
    /// Windowed layers read their frames (see `KvCache::prepare`).
    fn read_kv_rows(
        &self,
        l: usize,
        kv: usize,
        cell: usize,
        out: &mut [u8],
    ) -> Result<(), EngineError> {
        let row = sizes::kv_row_bytes(&self.spec.hp) as usize;
        self.kv.read_rows(l, kv, cell, row, out)
    }

    fn write_kv_rows(
        &mut self,
        l: usize,
        kv: usize,
        cell: usize,
        data: &[u8],
    ) -> Result<(), EngineError> {
        let row = sizes::kv_row_bytes(&self.spec.hp) as usize;
        self.kv.write_rows(l, kv, cell, row, data)
    }

    /// Writes sequence `seq`'s KV cache and `extra` to `path`. Returns the
    /// bytes written.
    pub fn save_seq(&mut self, seq: u32, path: &Path, extra: &[u8]) -> Result<u64, EngineError> {
        self.one_part()?;
        self.pager_sync();
        // the sequence's blocks into frames (from spill files if needed)
        let all = self.kv.snapshot();
        self.kv.prepare(&all, &[], 1 << seq, None)?;
        // in position order: the file's positions then read 0, 1, 2, ...,
        // which load checks
        let mut cells = self.kv.cells().seq_cells(seq);
        cells.sort_by_key(|&(_, p)| p);
        let row = sizes::kv_row_bytes(&self.spec.hp) as usize;
        let mut payload = Vec::with_capacity(8 + 4 * cells.len() + extra.len());
        payload.extend_from_slice(&(cells.len() as u64).to_le_bytes());
        for &(_, p) in &cells {
            payload.extend_from_slice(&p.to_le_bytes());
        }
        payload.extend_from_slice(extra);
        let mut data: Vec<(EntryDesc, Vec<u8>, Vec<u8>)> = Vec::new();
        for l in 0..self.spec.hp.n_layer as usize {
            for (k, chunk) in cells.chunks(CHUNK).enumerate() {
                let ids: Vec<u32> = chunk.iter().map(|&(c, _)| c).collect();
                let mut kv = [vec![0u8; ids.len() * row], vec![0u8; ids.len() * row]];
                for (which, buf) in kv.iter_mut().enumerate() {
                    for (c0, i, n) in runs(&ids) {
                        self.read_kv_rows(l, which, c0, &mut buf[i * row..(i + n) * row])?;
                    }
                }
                let [kb, vb] = kv;
                data.push((
                    EntryDesc {
                        layer: l as u32,
                        block: k as u32,
                        n_rows: ids.len() as u32,
                    },
                    kb,
                    vb,
                ));
            }
        }
        let entries: Vec<_> = data
            .iter()
            .map(|(d, k, v)| (*d, k.as_slice(), v.as_slice()))
            .collect();
        Ok(spill::write_file(
            path,
            self.session_shape(),
            &payload,
            &entries,
            None,
        )?)
    }

    /// Replaces sequence `seq`'s KV cache with the one saved in `path` and
    /// returns the caller's bytes saved with it. On error the sequence is
    /// left empty.
    pub fn load_seq(&mut self, seq: u32, path: &Path) -> Result<Vec<u8>, EngineError> {
        self.one_part()?;
        self.clear_seq(seq);
        let mut file = KvFile::open(path, self.session_shape())?;
        let corrupt = |what: String| -> EngineError {
            SpillError::Corrupt {
                path: path.to_path_buf(),
                what,
            }
            .into()
        };
        let extra = file.extra().to_vec();
        let n = extra
            .get(..8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as usize)
            .ok_or_else(|| corrupt("session payload shorter than its header".into()))?;
        if n > self.lim.n_ctx as usize || extra.len() < 8 + 4 * n {
            return Err(corrupt(format!(
                "{n} saved cells do not fit a context of {} (or the payload is short)",
                self.lim.n_ctx
            )));
        }
        let pos: Vec<i32> = extra[8..8 + 4 * n]
            .chunks(4)
            .map(|b| i32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect();
        if let Some(&p) = pos.iter().find(|&&p| p < 0 || p as u32 >= self.lim.n_ctx) {
            return Err(EngineError::BadPos {
                seq,
                pos: p,
                n_ctx: self.lim.n_ctx,
            });
        }
        // a session is one sequence at positions 0..n, written in order: a
        // duplicate, a gap or any other order is not a file strata wrote
        if let Some((i, &p)) = pos.iter().enumerate().find(|&(i, &p)| p as usize != i) {
            return Err(corrupt(format!(
                "saved cell {i} is at position {p}, not {i} (positions must run 0, 1, 2, ...)"
            )));
        }
        let n_layer = self.spec.hp.n_layer as usize;
        let chunks = n.div_ceil(CHUNK);
        let want: Vec<EntryDesc> = (0..n_layer)
            .flat_map(|l| {
                (0..chunks).map(move |k| EntryDesc {
                    layer: l as u32,
                    block: k as u32,
                    n_rows: (n - k * CHUNK).min(CHUNK) as u32,
                })
            })
            .collect();
        if file.entries() != want.as_slice() {
            return Err(corrupt(format!(
                "entries do not cover {n} cells of {n_layer} layers"
            )));
        }
        let before = self.kv.snapshot();
        let sp: Vec<(u32, i32)> = pos.iter().map(|&p| (seq, p)).collect();
        let cells = self.kv.place(&sp)?;
        let r = self.fill_seq(&mut file, &before, &cells, seq);
        if let Err(e) = r {
            self.clear_seq(seq);
            return Err(e);
        }
        Ok(extra[8 + 4 * n..].to_vec())
    }

    fn fill_seq(
        &mut self,
        file: &mut KvFile,
        before: &crate::kv::KvCells,
        cells: &[u32],
        seq: u32,
    ) -> Result<(), EngineError> {
        self.kv.prepare(before, cells, 1 << seq, None)?;
        let row = sizes::kv_row_bytes(&self.spec.hp) as usize;
        let chunks = cells.len().div_ceil(CHUNK);
        for i in 0..file.entries().len() {
            let (k, v) = file.read_entry_vec(i)?;
            let (l, c) = (i / chunks, i % chunks);
            let ids = &cells[c * CHUNK..(c * CHUNK + CHUNK).min(cells.len())];
            for (which, buf) in [(0, &k), (1, &v)] {
                for (c0, j, n) in runs(ids) {
                    self.write_kv_rows(l, which, c0, &buf[j * row..(j + n) * row])?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn runs_split_at_gaps() {
        assert_eq!(
            super::runs(&[3, 4, 5, 9, 10, 2]),
            vec![(3, 0, 3), (9, 3, 2), (2, 5, 1)]
        );
    }
}
