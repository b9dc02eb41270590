//! A step's host-side inputs: its tokens' embedding rows (ggml's own
//! dequantizer, identical to `get_rows`), positions, attention masks and
//! cells, written into the persistent buffers before the step's graphs
//! run.
//!
//! On a GPU the host's cores are idle while a step begins, and big steps
//! cut the rows among scoped threads: at 2048 tokens of an 8192-wide
//! model one thread took 17-25 ms on the 2-core development machine. On
//! a GPU the inputs are written into pinned memory that a graph on the
//! compute stream reads them from (`inputsup`): copies wait for the copy
//! engine, behind the weights' uploads. Copied (a remote device, or
//! `STRATA_INPUTS=copy`), they go from pinned staging (`buffers::Staging`)
//! after the step's first upload and before the rest: queued behind a
//! window of uploads, the copies waited 16-30 ms for the copy engine (two
//! H200s, run 103), against 2-3 ms on an idle bus. A split model's parts write theirs at
//! once, a thread each (in turn they took 58 ms before either GPU of the
//! row split computed, run 102; 9-10 ms at once, run 104). On the CPU
//! device the cores are ggml's pool's, whose threads still spin from the
//! last step: there one thread writes them (two threads were no faster
//! on the 2-core development machine).

use super::batch::BatchToken;
use super::buffers;
use super::error::EngineError;
use super::state::{on_each_at_once, Engine, Share};
use super::timeline;
use crate::dtype::GgmlType;
use crate::ggml;
use crate::kv::StepTree;
use std::ops::Range;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Fewest rows a thread is given: below this a step's inputs are written
/// on the step's own thread (decode steps take microseconds).
const ROWS_PER_THREAD: usize = 128;
/// Most threads the inputs of one step are written with.
const MAX_THREADS: usize = 8;

impl Engine {
    /// Writes the begun step's inputs on this part and the parts after
    /// it, once every part's first upload is queued. Where every part
    /// is a GPU or a remote device, the parts write theirs at once, a
    /// thread each (the row split's devices each embed the same rows); on
    /// the CPU device, whose pool's threads spin, in turn.
    pub(super) fn write_chain_inputs(
        &mut self,
        toks: &[BatchToken],
        tree: Option<&StepTree>,
        cells: &[u32],
    ) -> Result<(), EngineError> {
        self.with_chain(|first, others| {
            let one = |Share(e): Share<'_>| e.write_inputs(toks, tree, cells);
            let at_once = !others.is_empty()
                && !first.device.is_cpu()
                && others.iter().all(|e| !e.device.is_cpu());
            let parts = std::iter::once(first).chain(others.iter_mut().map(|e| &mut **e));
            if at_once {
                on_each_at_once(parts.map(Share).collect(), one)
            } else {
                parts.map(Share).try_for_each(one)
            }
        })
    }

    /// Queues the rest of every part's first uploads (their rings'
    /// windows), once the inputs are written. Only the step's first upload
    /// goes before the inputs: their copies share the bus's copy engine
    /// with the uploads and wait behind all queued before them (16-30 ms
    /// behind a full window on the H200s of run 103, against 2-3 ms on an
    /// idle bus), while the first upload runs beside the host's work.
    pub(super) fn prefetch_chain(&mut self) -> Result<(), EngineError> {
        let mut e = Some(self);
        while let Some(p) = e {
            p.pager
                .prefetch_window(&p.store, &p.backend, p.kv.tier_mut(), usize::MAX)?;
            e = p.next.as_deref_mut();
        }
        Ok(())
    }

    /// Writes this part's inputs for the begun step: on a GPU into the
    /// pinned memory a graph queued on the compute stream reads them from
    /// (`inputsup`), otherwise by synchronous writes of buffers no stream
    /// touches now (the compute stream was drained in `begin_part`; the
    /// copy stream carries only weights into slots and KV frames). A later
    /// device's part of the layer split gets its residual from the part
    /// before. `cells`: where the tokens were placed.
    fn write_inputs(
        &mut self,
        toks: &[BatchToken],
        tree: Option<&StepTree>,
        cells: &[u32],
    ) -> Result<(), EngineError> {
        let inputs = self
            .pending
            .as_mut()
            .and_then(|p| p.inputs.take())
            .expect("begun");
        let (sp, n_kv, out_ids) = (&inputs.sp[..], inputs.n_kv, &inputs.out_ids[..]);
        let t0 = Instant::now();
        let mut copies = Duration::ZERO;
        if self.spec.embeds() {
            let ids: Vec<u32> = toks.iter().map(|t| t.token).collect();
            copies += self.embed(&ids)?;
        }
        let pos: Vec<i32> = toks.iter().map(|t| t.pos).collect();
        let idx: Vec<i64> = cells.iter().map(|&c| c as i64).collect();
        copies += self.write_masks(sp, n_kv, tree.map(|t| (t, cells)))?;
        if let Some(up) = self.inputs_up.as_mut() {
            up.slot::<i32>(buffers::POS, pos.len())?
                .copy_from_slice(&pos);
            up.slot::<i64>(buffers::KV_IDX, idx.len())?
                .copy_from_slice(&idx);
            if !out_ids.is_empty() {
                up.slot::<i32>(buffers::OUT_IDS, out_ids.len())?
                    .copy_from_slice(out_ids);
            }
            up.queue(&self.backend)?;
        } else {
            self.persistent.tensor(buffers::POS).set_i32(&pos)?;
            self.persistent.tensor(buffers::KV_IDX).set_i64(&idx)?;
            if !out_ids.is_empty() {
                self.persistent.tensor(buffers::OUT_IDS).set_i32(out_ids)?;
            }
        }
        let t1 = Instant::now();
        let n = toks.len();
        self.rec.host_span(
            timeline::Stream::Host,
            || format!("inputs ({n} tokens)"),
            t0,
            t1,
        );
        tracing::debug!(
            "step of {n} tokens: the first upload enqueued after {:.2} ms, inputs written in {:.2} ms \
             (of which {:.2} ms copying embedding rows and masks from {} memory)",
            (t0 - self.pending.as_ref().expect("begun").start).as_secs_f64() * 1e3,
            (t1 - t0).as_secs_f64() * 1e3,
            copies.as_secs_f64() * 1e3,
            if self.staging.is_pinned() { "pinned" } else { "pageable" }
        );
        Ok(())
    }

    /// Embeds the step's tokens into x[:, :n] on the host; returns the
    /// time the copy to the device took.
    fn embed(&mut self, tokens: &[u32]) -> Result<Duration, EngineError> {
        let e = self.spec.hp.n_embd as usize;
        let threads = self.input_threads();
        let w = &self.spec.tok_embd;
        let table = self.file.bytes(w);
        let scale = self.spec.hp.embd_scale;
        if let Some(up) = self.inputs_up.as_mut() {
            // written where the compute stream reads them from
            let out = up.slot::<f32>(buffers::X, e * tokens.len())?;
            embed_rows(w.ty, &table, tokens, scale, out, threads)?;
            return Ok(Duration::ZERO);
        }
        let out = self.staging.get::<f32>(self.device, e * tokens.len())?;
        embed_rows(w.ty, &table, tokens, scale, out, threads)?;
        let t = Instant::now();
        self.persistent
            .tensor(buffers::X)
            .set_bytes(bytemuck::cast_slice(out), 0)?;
        Ok(t.elapsed())
    }

    /// Writes the step's masks over `n_kv` cells: the full-context mask,
    /// then with a sliding window the windowed layers' after it; a token
    /// tree's tokens see, of its cells, only their ancestors. Returns the
    /// time the copy to the device took.
    fn write_masks(
        &mut self,
        sp: &[(u32, i32)],
        n_kv: usize,
        tree: Option<(&StepTree, &[u32])>,
    ) -> Result<Duration, EngineError> {
        let n_swa = self.spec.hp.n_swa;
        let windows: &[Option<u32>] = if n_swa > 0 {
            &[None, Some(n_swa)]
        } else {
            &[None]
        };
        let one = n_kv * sp.len();
        let threads = self.input_threads();
        let cells = self.kv.cells();
        let pulled = self.inputs_up.is_some();
        let masks = match self.inputs_up.as_mut() {
            Some(up) => up.slot::<u16>(buffers::MASK, one * windows.len())?,
            None => self.staging.get::<u16>(self.device, one * windows.len())?,
        };
        for (&window, mask) in windows.iter().zip(masks.chunks_exact_mut(one.max(1))) {
            par_rows(mask, n_kv, threads, |rows, out| {
                cells.fill_mask_rows(&sp[rows], n_kv, window, out);
                Ok::<(), EngineError>(())
            })?;
            if let Some((t, placed)) = tree {
                t.hide(placed, n_kv, mask);
            }
        }
        if pulled {
            return Ok(Duration::ZERO);
        }
        let t = Instant::now();
        self.persistent
            .tensor(buffers::MASK)
            .set_bytes(bytemuck::cast_slice(masks), 0)?;
        Ok(t.elapsed())
    }

    /// Threads that may write a step's inputs: one on the CPU device.
    fn input_threads(&self) -> usize {
        if self.device.is_cpu() {
            return 1;
        }
        // read once: the standard library reads the cgroup files each call
        static CORES: OnceLock<usize> = OnceLock::new();
        let cores =
            *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
        cores.min(MAX_THREADS)
    }
}

/// Dequantizes the rows of `tokens` from `table` (an embedding matrix of
/// type `ty`, `out.len() / tokens.len()` values a row) into `out`, each
/// times `scale` (Gemma's, as llama.cpp's ggml_scale of the rows, in F32),
/// on up to `threads` threads.
fn embed_rows(
    ty: GgmlType,
    table: &[u8],
    tokens: &[u32],
    scale: f32,
    out: &mut [f32],
    threads: usize,
) -> Result<(), EngineError> {
    let e = out.len().checked_div(tokens.len()).unwrap_or(0);
    let row = ggml::row_size(ty, e as i64);
    par_rows(out, e, threads, |rows, out| -> Result<(), EngineError> {
        for (&t, dst) in tokens[rows].iter().zip(out.chunks_exact_mut(e)) {
            let t = t as usize;
            ggml::dequantize_row(ty, &table[t * row..(t + 1) * row], dst)?;
            if scale != 1.0 {
                dst.iter_mut().for_each(|v| *v *= scale);
            }
        }
        Ok(())
    })
}

/// Runs `f(rows, out_rows)` over `out`, a buffer of rows of `row_len`,
/// cut into consecutive pieces of rows, one per scoped thread, at most
/// `threads` of them and none under ROWS_PER_THREAD rows (a single piece,
/// on this thread, for small buffers). The first error is returned.
fn par_rows<T, E, F>(out: &mut [T], row_len: usize, threads: usize, f: F) -> Result<(), E>
where
    T: Send,
    E: Send,
    F: Fn(Range<usize>, &mut [T]) -> Result<(), E> + Sync,
{
    let n_rows = out.len().checked_div(row_len).unwrap_or(0);
    let threads = (n_rows / ROWS_PER_THREAD).min(threads);
    if threads <= 1 {
        return f(0..n_rows, out);
    }
    let per = n_rows.div_ceil(threads);
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = out
            .chunks_mut(per * row_len)
            .enumerate()
            .map(|(i, piece)| {
                let rows = i * per..i * per + piece.len() / row_len;
                s.spawn(move || f(rows, piece))
            })
            .collect();
        // the scope joins the rest if one fails
        handles
            .into_iter()
            .try_for_each(|h| h.join().expect("an input thread panicked"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every row is visited once, with its own index, however many
    /// threads the machine gives.
    #[test]
    fn par_rows_visits_every_row_once_with_its_index() {
        for (n_rows, threads) in [0, 1, 127, 128, 129, 300, 1000, 2048, 4099]
            .into_iter()
            .flat_map(|n| [(n, 1), (n, 3), (n, 8)])
        {
            let mut out = vec![0usize; n_rows * 3];
            par_rows(&mut out, 3, threads, |rows, piece| {
                assert_eq!(piece.len(), rows.len() * 3);
                for (r, row) in rows.zip(piece.chunks_exact_mut(3)) {
                    row.iter_mut().for_each(|v| *v += r + 1);
                }
                Ok::<(), ()>(())
            })
            .unwrap();
            let want: Vec<usize> = (0..n_rows).flat_map(|r| [r + 1; 3]).collect();
            assert_eq!(out, want, "{n_rows} rows, {threads} threads");
        }
    }

    /// Embedding rows written by several threads equal those written by
    /// one, and are the table's rows dequantized and scaled.
    #[test]
    fn embedding_rows_alike_on_any_number_of_threads() {
        // a Q8_0 table of 50 rows of 64 values: per block of 32, an f16
        // scale and 32 signed bytes
        let (n_vocab, e) = (50usize, 64usize);
        let ty = GgmlType::Q8_0;
        let row = ggml::row_size(ty, e as i64);
        let mut table = vec![0u8; n_vocab * row];
        for (r, bytes) in table.chunks_exact_mut(row).enumerate() {
            for (b, block) in bytes.chunks_exact_mut(34).enumerate() {
                // scale 0.5 as f16, then values r + b + i - 40
                block[..2].copy_from_slice(&0x3800u16.to_le_bytes());
                for (i, q) in block[2..].iter_mut().enumerate() {
                    *q = (r as i32 + b as i32 + i as i32 - 40) as i8 as u8;
                }
            }
        }
        let tokens: Vec<u32> = (0..1000u32).map(|i| (i * 7 + 3) % n_vocab as u32).collect();
        let mut one = vec![0f32; tokens.len() * e];
        embed_rows(ty, &table, &tokens, 2.0, &mut one, 1).unwrap();
        let mut many = vec![0f32; tokens.len() * e];
        embed_rows(ty, &table, &tokens, 2.0, &mut many, 8).unwrap();
        assert_eq!(one, many);
        for (&t, got) in tokens.iter().zip(one.chunks_exact(e)) {
            let want: Vec<f32> = (0..e)
                .map(|c| 2.0 * 0.5 * (t as i32 + (c / 32) as i32 + (c % 32) as i32 - 40) as f32)
                .collect();
            assert_eq!(got, want.as_slice(), "token {t}");
        }
    }

    /// An error in any piece is returned.
    #[test]
    fn par_rows_returns_an_error() {
        let mut out = vec![0u8; 4096];
        let r = par_rows(&mut out, 1, 8, |rows, _| {
            if rows.contains(&4000) {
                Err(rows.start)
            } else {
                Ok(())
            }
        });
        assert!(r.is_err());
    }
}
