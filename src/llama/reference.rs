//! llama.cpp's own decoder (a libllama context over a loaded model): the
//! reference that parity tests, `strata check` and `strata bench
//! --llama-ngl` compare strata against. Built with the `reference` feature.

use super::fill;
use super::model::LlamaError;
use super::model::LlamaModel;
use crate::sys;
use std::ptr::NonNull;

/// llama.cpp's own decoder: the reference strata is checked against.
pub struct Reference<'m> {
    ctx: NonNull<sys::llama_context>,
    n_vocab: usize,
    n_batch: usize,
    /// The sequence-state layout fill_kv learned, with the sequence it was
    /// learned on (streams differ per sequence when the cache is not unified).
    fill_layout: Option<(u32, fill::SeqLayout)>,
    _model: &'m LlamaModel,
}

#[derive(Clone, Debug)]
pub struct ReferenceConfig {
    pub n_ctx: u32,
    pub n_batch: u32,
    /// Physical batch (llama.cpp's n_ubatch); 0 means n_batch.
    pub n_ubatch: u32,
    pub n_seq: u32,
    pub n_threads: i32,
    /// llama.cpp's offload_kqv: false is its `-nkvo` (the KV cache in host
    /// memory and attention on the CPU, whatever n_gpu_layers offloads).
    pub offload_kqv: bool,
}

impl<'m> Reference<'m> {
    /// A context configured like strata computes: flash attention, F16 KV.
    pub fn new(model: &'m LlamaModel, cfg: &ReferenceConfig) -> Result<Reference<'m>, LlamaError> {
        Self::with_flash_attn(model, cfg, sys::LLAMA_FLASH_ATTN_TYPE_ENABLED)
    }

    /// A context with llama.cpp's default flash-attention setting (auto),
    /// for benchmarks against llama.cpp as its users run it.
    pub fn new_default_settings(
        model: &'m LlamaModel,
        cfg: &ReferenceConfig,
    ) -> Result<Reference<'m>, LlamaError> {
        Self::with_flash_attn(model, cfg, sys::LLAMA_FLASH_ATTN_TYPE_AUTO)
    }

    fn with_flash_attn(
        model: &'m LlamaModel,
        cfg: &ReferenceConfig,
        flash_attn: sys::llama_flash_attn_type,
    ) -> Result<Reference<'m>, LlamaError> {
        // SAFETY: default params are a plain struct.
        let mut p = unsafe { sys::llama_context_default_params() };
        p.n_ctx = cfg.n_ctx;
        p.n_batch = cfg.n_batch;
        p.n_ubatch = if cfg.n_ubatch == 0 {
            cfg.n_batch
        } else {
            cfg.n_ubatch.min(cfg.n_batch)
        };
        p.n_seq_max = cfg.n_seq;
        p.n_threads = cfg.n_threads;
        p.n_threads_batch = cfg.n_threads;
        p.flash_attn_type = flash_attn;
        p.kv_unified = true;
        p.offload_kqv = cfg.offload_kqv;
        p.no_perf = true;
        // SAFETY: live model; valid params.
        let c = unsafe { sys::llama_init_from_model(model.raw(), p) };
        let ctx = NonNull::new(c).ok_or(LlamaError::Context)?;
        // SAFETY: live model.
        let n_vocab =
            unsafe { sys::llama_vocab_n_tokens(sys::llama_model_get_vocab(model.raw())) } as usize;
        Ok(Reference {
            ctx,
            n_vocab,
            n_batch: cfg.n_batch as usize,
            fill_layout: None,
            _model: model,
        })
    }

    /// Decodes (token, pos, seq, want_logits), n_batch tokens per call; returns the logits
    /// of the tokens that want them, in order.
    pub fn decode(&mut self, toks: &[(u32, i32, u32, bool)]) -> Result<Vec<f32>, LlamaError> {
        // llama_decode takes at most n_batch tokens per call
        let mut out = Vec::new();
        for chunk in toks.chunks(self.n_batch.max(1)) {
            out.extend(self.decode_one(chunk)?);
        }
        Ok(out)
    }

    fn decode_one(&mut self, toks: &[(u32, i32, u32, bool)]) -> Result<Vec<f32>, LlamaError> {
        // SAFETY: llama_batch_init allocates arrays for toks.len() tokens with
        // one seq id each; we fill exactly that and free it below.
        unsafe {
            let mut b = sys::llama_batch_init(toks.len() as i32, 0, 1);
            for (i, &(t, pos, seq, want)) in toks.iter().enumerate() {
                *b.token.add(i) = t as i32;
                *b.pos.add(i) = pos;
                *b.n_seq_id.add(i) = 1;
                **b.seq_id.add(i) = seq as i32;
                *b.logits.add(i) = want as i8;
            }
            b.n_tokens = toks.len() as i32;
            let st = sys::llama_decode(self.ctx.as_ptr(), b);
            let mut out = Vec::new();
            if st == 0 {
                for (i, t) in toks.iter().enumerate() {
                    if t.3 {
                        let p = sys::llama_get_logits_ith(self.ctx.as_ptr(), i as i32);
                        if !p.is_null() {
                            out.extend_from_slice(std::slice::from_raw_parts(p, self.n_vocab));
                        }
                    }
                }
            }
            sys::llama_batch_free(b);
            if st != 0 {
                return Err(LlamaError::Decode(st));
            }
            Ok(out)
        }
    }

    /// Forgets every sequence.
    pub fn clear(&mut self) {
        // SAFETY: live context; its memory handle is owned by it.
        unsafe { sys::llama_memory_clear(sys::llama_get_memory(self.ctx.as_ptr()), true) }
    }

    /// Forgets the positions >= `p0` of sequence `seq` (llama.cpp's
    /// `llama_memory_seq_rm`, how its speculative decoding drops rejected
    /// drafts). False where the cache cannot remove them.
    pub fn seq_rm(&mut self, seq: u32, p0: i32) -> bool {
        // SAFETY: live context; its memory handle is owned by it.
        unsafe {
            sys::llama_memory_seq_rm(sys::llama_get_memory(self.ctx.as_ptr()), seq as i32, p0, -1)
        }
    }

    /// The raw context (for queries such as the memory API in tests).
    pub fn raw(&self) -> *mut sys::llama_context {
        self.ctx.as_ptr()
    }

    /// The lowest and highest position sequence `seq` holds in the KV cache,
    /// or None when it holds none.
    pub fn seq_pos_range(&self, seq: u32) -> Option<(i32, i32)> {
        // SAFETY: live context; its memory handle is owned by it.
        let (lo, hi) = unsafe {
            let m = sys::llama_get_memory(self.ctx.as_ptr());
            (
                sys::llama_memory_seq_pos_min(m, seq as i32),
                sys::llama_memory_seq_pos_max(m, seq as i32),
            )
        };
        (lo >= 0 && hi >= 0).then_some((lo, hi))
    }

    /// Sequence ids at or above the context's n_seq_max trip a GGML_ASSERT
    /// (an abort) in llama.cpp's state loader: refuse them here.
    fn check_seq(&self, seq: u32) -> Result<(), LlamaError> {
        // SAFETY: plain query of a live context.
        let n_seq = unsafe { sys::llama_n_seq_max(self.ctx.as_ptr()) };
        if seq >= n_seq {
            return Err(LlamaError::BadSeq { seq, n_seq });
        }
        Ok(())
    }

    /// llama.cpp's state of sequence `seq` (`llama_state_seq_get_data`).
    pub fn seq_state(&mut self, seq: u32) -> Result<Vec<u8>, LlamaError> {
        self.check_seq(seq)?;
        let ctx = self.ctx.as_ptr();
        // SAFETY: live context; a size query.
        let size = unsafe { sys::llama_state_seq_get_size_ext(ctx, seq as i32, 0) };
        if size == 0 {
            return Err(LlamaError::StateGet {
                seq,
                what: "size query returned 0".into(),
            });
        }
        let mut buf = vec![0u8; size];
        // SAFETY: buf is valid for size bytes.
        let got = unsafe {
            sys::llama_state_seq_get_data_ext(ctx, buf.as_mut_ptr(), size, seq as i32, 0)
        };
        if got != size {
            return Err(LlamaError::StateGet {
                seq,
                what: format!("wrote {got} of {size} bytes"),
            });
        }
        Ok(buf)
    }

    /// Loads a sequence state (`llama_state_seq_set_data`) into sequence `seq`;
    /// `what` names the state in the error should llama.cpp reject it.
    pub fn set_seq_state(&mut self, seq: u32, state: &[u8], what: &str) -> Result<(), LlamaError> {
        self.check_seq(seq)?;
        // SAFETY: live context; state is valid for its length and outlives
        // the call (llama.cpp copies the tensor data out before returning).
        let read = unsafe {
            sys::llama_state_seq_set_data_ext(
                self.ctx.as_ptr(),
                state.as_ptr(),
                state.len(),
                seq as i32,
                0,
            )
        };
        if read != state.len() {
            return Err(LlamaError::StateRejected {
                seq,
                what: what.to_string(),
                bytes: state.len(),
                read,
            });
        }
        Ok(())
    }

    /// Makes the KV cache hold positions 0..n-1 of sequence `seq` without
    /// computing them, so that the next decode of `seq` at position n attends
    /// over n cells (e.g. to time decoding at a deep context without
    /// prefilling it). The cache is cleared first (all sequences).
    ///
    /// How: one real token is decoded at position 0, its one-cell state is
    /// read back (`llama_state_seq_get_data`) and parsed to learn the
    /// cache's layout (streams, cell ext, V transposition, per-layer K/V
    /// types and row sizes, rotations), then an n-cell state in the same
    /// format, every cell a copy of the real one, is built in a single
    /// buffer and loaded with `llama_state_seq_set_data` (see `fill.rs`).
    /// The layout is kept, so later fills of the same sequence skip the
    /// priming decode.
    /// The buffer is the size of the sequence's KV data (about 10 GiB for a
    /// 70B model at 32k cells) and lives only during the load.
    pub fn fill_kv(&mut self, seq: u32, n: u32) -> Result<(), LlamaError> {
        self.check_seq(seq)?;
        self.clear();
        if n == 0 {
            return Ok(());
        }
        // SAFETY: plain query of a live context.
        let n_ctx = unsafe { sys::llama_n_ctx(self.ctx.as_ptr()) };
        if n > n_ctx {
            return Err(LlamaError::FillTooLarge { n, n_ctx });
        }
        let layout = match self.fill_layout.take() {
            Some((s, l)) if s == seq => l,
            _ => {
                // SAFETY: live model; plain query.
                let bos = unsafe { sys::llama_vocab_bos(self._model.vocab()) };
                let tok = if bos >= 0 { bos as u32 } else { 0 };
                self.decode(&[(tok, 0, seq, true)])?;
                let one = self.seq_state(seq);
                self.clear();
                fill::SeqLayout::learn(&one?).map_err(LlamaError::StateLayout)?
            }
        };
        let state = layout.build(seq as i32, n);
        let what = format!(
            "synthesized {n}-cell KV state ({} layers)",
            layout.n_layer()
        );
        let loaded = self.set_seq_state(seq, &state, &what);
        drop(state);
        self.fill_layout = Some((seq, layout));
        if let Err(e) = loaded {
            self.clear();
            return Err(e);
        }
        match self.seq_pos_range(seq) {
            Some((0, max)) if max as i64 == n as i64 - 1 => Ok(()),
            r => {
                let (min, max) = r.unwrap_or((-1, -1));
                self.clear();
                Err(LlamaError::FillCheck {
                    seq,
                    min,
                    max,
                    want: n as i64 - 1,
                })
            }
        }
    }
}

impl Drop for Reference<'_> {
    fn drop(&mut self) {
        // SAFETY: we own the context.
        unsafe { sys::llama_free(self.ctx.as_ptr()) }
    }
}
