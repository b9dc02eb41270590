//! llama.cpp through libllama: the tokenizer and chat templates (a
//! vocabulary-only model load), and the reference decoder that parity tests
//! and `strata bench` compare against.

mod fill;

use crate::sys;
use std::ffi::{CStr, CString};
use std::path::Path;
use std::ptr::NonNull;

#[derive(Debug, thiserror::Error)]
pub enum LlamaError {
    #[error("libllama could not load {0}")]
    Load(String),
    #[error("{path}: {what}")]
    Invalid { path: String, what: String },
    #[error("libllama could not create a context")]
    Context,
    #[error("tokenization failed for a text of {0} bytes")]
    Tokenize(usize),
    #[error("the model has no chat template")]
    NoTemplate,
    #[error("the chat template could not be applied")]
    Template,
    #[error("llama_decode failed with status {0}")]
    Decode(i32),
    #[error("sequence {seq} is out of range: the context holds {n_seq} sequences")]
    BadSeq { seq: u32, n_seq: u32 },
    #[error("fill_kv: {n} cells do not fit the {n_ctx}-cell context")]
    FillTooLarge { n: u32, n_ctx: u32 },
    #[error("llama_state_seq_get_data failed for sequence {seq} ({what})")]
    StateGet { seq: u32, what: String },
    #[error("unrecognised llama.cpp sequence-state layout: {0}")]
    StateLayout(String),
    #[error("llama_state_seq_set_data rejected the {what} of sequence {seq} ({bytes} bytes, {read} read)")]
    StateRejected {
        seq: u32,
        what: String,
        bytes: usize,
        read: usize,
    },
    #[error(
        "fill_kv: sequence {seq} holds positions {min}..={max} after the load, expected 0..={want}"
    )]
    FillCheck {
        seq: u32,
        min: i32,
        max: i32,
        want: i64,
    },
    #[error("path or text contains a NUL byte")]
    Nul,
    #[error(transparent)]
    Ggml(#[from] crate::ggml::GgmlError),
}

/// An owned `llama_model`.
pub struct LlamaModel {
    ptr: NonNull<sys::llama_model>,
}

// SAFETY: a llama_model is immutable after load and documented thread-safe for reads.
unsafe impl Send for LlamaModel {}
unsafe impl Sync for LlamaModel {}

impl LlamaModel {
    /// Loads a model. `vocab_only` skips weights (tokenizer use);
    /// `n_gpu_layers` offloads that many layers (-1: all).
    pub fn load(
        path: &Path,
        vocab_only: bool,
        n_gpu_layers: i32,
    ) -> Result<LlamaModel, LlamaError> {
        // plain CPU buffers, like strata's (no weight repacking)
        Self::load_with(path, vocab_only, n_gpu_layers, false)
    }

    /// Loads a model with llama.cpp's default settings, weight repacking
    /// into its CPU extra buffer types included: llama.cpp as its users run
    /// it (benchmarks). Its CPU numerics then differ from strata's.
    pub fn load_as_users_run(path: &Path, n_gpu_layers: i32) -> Result<LlamaModel, LlamaError> {
        Self::load_with(path, false, n_gpu_layers, true)
    }

    fn load_with(
        path: &Path,
        vocab_only: bool,
        n_gpu_layers: i32,
        repack: bool,
    ) -> Result<LlamaModel, LlamaError> {
        crate::ggml::load_backends()?;
        // what libllama would abort or throw on, refused first
        let invalid = |what: String| LlamaError::Invalid {
            path: path.display().to_string(),
            what,
        };
        let f = crate::gguf::GgufFile::open(path).map_err(|e| invalid(e.to_string()))?;
        crate::model::validate_vocab(&f).map_err(|e| invalid(e.to_string()))?;
        let c = CString::new(path.to_string_lossy().as_bytes()).map_err(|_| LlamaError::Nul)?;
        // SAFETY: default params are a plain struct; we change plain fields.
        let mut p = unsafe { sys::llama_model_default_params() };
        p.vocab_only = vocab_only;
        p.n_gpu_layers = n_gpu_layers;
        if !repack {
            p.use_extra_bufts = false;
        }
        quiet_logs();
        // SAFETY: c is a valid path string; params are valid.
        let m = unsafe { sys::llama_model_load_from_file(c.as_ptr(), p) };
        NonNull::new(m)
            .map(|ptr| LlamaModel { ptr })
            .ok_or_else(|| LlamaError::Load(path.display().to_string()))
    }
    pub fn raw(&self) -> *mut sys::llama_model {
        self.ptr.as_ptr()
    }
    fn vocab(&self) -> *const sys::llama_vocab {
        // SAFETY: live model; the vocab lives as long as it.
        unsafe { sys::llama_model_get_vocab(self.raw()) }
    }

    /// Tokenizes `text` (adding BOS etc. when `add_special`; special tokens in
    /// the text are parsed when `parse_special`).
    pub fn tokenize(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, LlamaError> {
        let mut buf = vec![0i32; text.len() + 8];
        for _ in 0..2 {
            // SAFETY: text is valid for text.len() bytes; buf for buf.len() tokens.
            let n = unsafe {
                sys::llama_tokenize(
                    self.vocab(),
                    text.as_ptr().cast(),
                    text.len() as i32,
                    buf.as_mut_ptr(),
                    buf.len() as i32,
                    add_special,
                    parse_special,
                )
            };
            if n >= 0 {
                buf.truncate(n as usize);
                return Ok(buf.into_iter().map(|t| t as u32).collect());
            }
            buf.resize((-n) as usize, 0);
        }
        Err(LlamaError::Tokenize(text.len()))
    }

    /// The raw bytes of a token's text (may be part of a UTF-8 sequence).
    pub fn token_bytes(&self, token: u32, special: bool) -> Vec<u8> {
        let mut buf = vec![0u8; 64];
        for _ in 0..2 {
            // SAFETY: buf is valid for buf.len() bytes.
            let n = unsafe {
                sys::llama_token_to_piece(
                    self.vocab(),
                    token as i32,
                    buf.as_mut_ptr().cast(),
                    buf.len() as i32,
                    0,
                    special,
                )
            };
            if n >= 0 {
                buf.truncate(n as usize);
                return buf;
            }
            buf.resize((-n) as usize, 0);
        }
        Vec::new()
    }

    pub fn n_vocab(&self) -> u32 {
        // SAFETY: plain query.
        unsafe { sys::llama_vocab_n_tokens(self.vocab()) as u32 }
    }

    pub fn is_eog(&self, token: u32) -> bool {
        // SAFETY: plain query.
        unsafe { sys::llama_vocab_is_eog(self.vocab(), token as i32) }
    }

    /// Formats a conversation with the model's chat template, using
    /// libllama's built-in renderer for the template it recognises.
    pub fn apply_chat_template(
        &self,
        messages: &[(String, String)],
        add_assistant: bool,
    ) -> Result<String, LlamaError> {
        // SAFETY: live model; null name means the default template.
        let tmpl = unsafe { sys::llama_model_chat_template(self.raw(), std::ptr::null()) };
        if tmpl.is_null() {
            return Err(LlamaError::NoTemplate);
        }
        // SAFETY: libllama returns a NUL-terminated string owned by the model.
        let tmpl = unsafe { CStr::from_ptr(tmpl) }.to_owned();
        builtin_chat_template(&tmpl, messages, add_assistant)
    }
}

/// Formats a conversation with libllama's built-in renderer for `tmpl`: a
/// template's name ("chatml", "llama3", ...) or a Jinja source it
/// recognises. No model needed.
pub fn builtin_chat_template(
    tmpl: &CStr,
    messages: &[(String, String)],
    add_assistant: bool,
) -> Result<String, LlamaError> {
    {
        let tmpl = tmpl.as_ptr();
        let owned: Vec<(CString, CString)> = messages
            .iter()
            .map(|(r, c)| Ok((CString::new(r.as_str())?, CString::new(c.as_str())?)))
            .collect::<Result<_, std::ffi::NulError>>()
            .map_err(|_| LlamaError::Nul)?;
        let msgs: Vec<sys::llama_chat_message> = owned
            .iter()
            .map(|(r, c)| sys::llama_chat_message {
                role: r.as_ptr(),
                content: c.as_ptr(),
            })
            .collect();
        let mut buf = vec![0u8; 4096];
        for _ in 0..2 {
            // SAFETY: msgs point to live C strings; buf is valid for its length.
            let n = unsafe {
                sys::llama_chat_apply_template(
                    tmpl,
                    msgs.as_ptr(),
                    msgs.len(),
                    add_assistant,
                    buf.as_mut_ptr().cast(),
                    buf.len() as i32,
                )
            };
            if n < 0 {
                return Err(LlamaError::Template);
            }
            if (n as usize) <= buf.len() {
                buf.truncate(n as usize);
                return String::from_utf8(buf).map_err(|_| LlamaError::Template);
            }
            buf.resize(n as usize, 0);
        }
        Err(LlamaError::Template)
    }
}

impl LlamaModel {
    /// A metadata string of the model, if present.
    pub fn meta(&self, key: &str) -> Option<String> {
        let k = CString::new(key).ok()?;
        let mut buf = vec![0u8; 256];
        // SAFETY: buf valid for its length; returns -1 if missing.
        let n = unsafe {
            sys::llama_model_meta_val_str(
                self.raw(),
                k.as_ptr(),
                buf.as_mut_ptr().cast(),
                buf.len(),
            )
        };
        if n < 0 {
            return None;
        }
        // SAFETY: llama writes a NUL-terminated string into buf.
        Some(
            unsafe { CStr::from_ptr(buf.as_ptr().cast()) }
                .to_string_lossy()
                .into_owned(),
        )
    }
}

impl Drop for LlamaModel {
    fn drop(&mut self) {
        // SAFETY: we own the model; contexts borrowing it are dropped first (lifetimes).
        unsafe { sys::llama_model_free(self.ptr.as_ptr()) }
    }
}

/// Silences libllama's and ggml's log output unless STRATA_LLAMA_LOG is set.
fn quiet_logs() {
    unsafe extern "C" fn silent(
        _: sys::ggml_log_level,
        _: *const std::os::raw::c_char,
        _: *mut std::ffi::c_void,
    ) {
    }
    if std::env::var_os("STRATA_LLAMA_LOG").is_none() {
        // SAFETY: the callback is a valid function for the program's lifetime.
        unsafe { sys::llama_log_set(Some(silent), std::ptr::null_mut()) };
    }
}

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
