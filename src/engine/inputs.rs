//! A step's host-side inputs: its tokens' embedding rows (ggml's own
//! dequantizer, identical to `get_rows`) and its attention masks, written
//! into the persistent buffers before the step's graphs run.
//!
//! On a GPU the host's cores are idle while a step begins, and big steps
//! cut the rows among scoped threads: at 2048 tokens of an 8192-wide
//! model the inputs took about 34 ms of the two-GPU machine's host before
//! any group could start (run 70's trace), and each device of the row
//! split writes its own inputs in turn. On the CPU device the cores are
//! ggml's pool's, whose threads still spin from the last step: there one
//! thread writes them (two threads were slower than one on the 2-core
//! development machine).

use super::buffers;
use super::error::EngineError;
use super::state::Engine;
use crate::ggml;
use crate::kv::StepTree;
use std::ops::Range;

/// Fewest rows a thread is given: below this a step's inputs are written
/// on the step's own thread (decode steps take microseconds).
const ROWS_PER_THREAD: usize = 128;
/// Most threads the inputs of one step are written with.
const MAX_THREADS: usize = 8;

impl Engine {
    /// Embeds the step's tokens into x[:, :n] on the host.
    pub(super) fn embed(&mut self, tokens: &[u32]) -> Result<(), EngineError> {
        let e = self.spec.hp.n_embd as usize;
        let w = &self.spec.tok_embd;
        let row = ggml::row_size(w.ty, e as i64);
        let scale = self.spec.hp.embd_scale;
        let bytes = self.file.bytes(w);
        self.embd.resize(e * tokens.len(), 0.0);
        let threads = self.input_threads();
        par_rows(
            &mut self.embd,
            e,
            threads,
            |rows, out| -> Result<(), EngineError> {
                for (&t, dst) in tokens[rows].iter().zip(out.chunks_exact_mut(e)) {
                    let t = t as usize;
                    ggml::dequantize_row(w.ty, &bytes[t * row..(t + 1) * row], dst)?;
                    if scale != 1.0 {
                        // Gemma: as llama.cpp's ggml_scale of the rows, in F32
                        dst.iter_mut().for_each(|v| *v *= scale);
                    }
                }
                Ok(())
            },
        )?;
        self.persistent
            .tensor(buffers::X)
            .set_bytes(bytemuck::cast_slice(&self.embd), 0)?;
        Ok(())
    }

    /// Writes the step's masks over `n_kv` cells: the full-context mask,
    /// then with a sliding window the windowed layers' after it; a token
    /// tree's tokens see, of its cells, only their ancestors.
    pub(super) fn write_masks(
        &mut self,
        sp: &[(u32, i32)],
        n_kv: usize,
        tree: Option<(&StepTree, &[u32])>,
    ) -> Result<(), EngineError> {
        let n_swa = self.spec.hp.n_swa;
        let windows: &[Option<u32>] = if n_swa > 0 {
            &[None, Some(n_swa)]
        } else {
            &[None]
        };
        let one = n_kv * sp.len();
        self.mask.resize(one * windows.len(), 0);
        let threads = self.input_threads();
        let cells = self.kv.cells();
        for (&window, mask) in windows.iter().zip(self.mask.chunks_exact_mut(one)) {
            par_rows(mask, n_kv, threads, |rows, out| {
                cells.fill_mask_rows(&sp[rows], n_kv, window, out);
                Ok::<(), EngineError>(())
            })?;
            if let Some((t, placed)) = tree {
                t.hide(placed, n_kv, mask);
            }
        }
        self.persistent
            .tensor(buffers::MASK)
            .set_bytes(bytemuck::cast_slice(&self.mask), 0)?;
        Ok(())
    }

    /// Threads that may write a step's inputs: one on the CPU device.
    fn input_threads(&self) -> usize {
        if self.device.is_cpu() {
            return 1;
        }
        std::thread::available_parallelism().map_or(1, |n| n.get().min(MAX_THREADS))
    }
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
