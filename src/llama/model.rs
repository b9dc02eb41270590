//! A model loaded by libllama: its vocabulary, tokenizer and chat template.
//!
//! Loading takes llama.cpp's model options as its command-line flags set
//! them ([`LoadOptions`]), expert placement (`--n-cpu-moe`, `--cpu-moe`)
//! included: that becomes libllama's tensor buffer-type overrides, whose
//! pattern strings and array this module owns until the load returns.

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

/// llama.cpp's model options, as its command-line flags set them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadOptions {
    /// `-ngl`: layers offloaded to the GPU.
    pub n_gpu_layers: i32,
    /// Weight repacking into the CPU's extra buffer types (its default;
    /// `--no-repack` turns it off).
    pub repack: bool,
    /// Memory-mapped weights (its default; `--no-mmap` reads them into
    /// host buffers, pinned where a GPU is loaded).
    pub mmap: bool,
    /// Which layers' expert tensors of a mixture of experts stay in CPU
    /// memory whatever `n_gpu_layers` says (`--n-cpu-moe N`, `--cpu-moe`).
    pub cpu_experts: CpuExperts,
}

/// Where llama.cpp keeps a mixture of experts' expert tensors
/// (`blk.{i}.ffn_{up,down,gate,gate_up}_{,ch}exps`): with their layer, as
/// `-ngl` places it, or in CPU memory. Everything else follows `-ngl`. On a
/// model without experts no tensor matches and the choice changes nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CpuExperts {
    /// Every tensor follows `-ngl` (llama.cpp's default).
    #[default]
    None,
    /// The experts of the first N layers stay on the CPU (`--n-cpu-moe N`).
    FirstLayers(u32),
    /// Every layer's experts stay on the CPU (`--cpu-moe`).
    All,
}

/// llama.cpp's pattern of every expert tensor (common/arg.cpp, `--cpu-moe`).
const EXPS_REGEX: &str = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps";

impl CpuExperts {
    /// The tensor-name patterns (regex, searched) of the expert tensors
    /// this choice keeps on the CPU, as llama.cpp's `--n-cpu-moe` and
    /// `--cpu-moe` write them: one per layer, or one for all. `n_layer`
    /// (the model's block count) bounds N: N at or above it is all layers.
    pub fn patterns(self, n_layer: u32) -> Vec<String> {
        match self {
            CpuExperts::None | CpuExperts::FirstLayers(0) => Vec::new(),
            CpuExperts::FirstLayers(n) if n < n_layer => {
                (0..n).map(|i| format!(r"blk\.{i}{EXPS_REGEX}")).collect()
            }
            CpuExperts::FirstLayers(_) | CpuExperts::All => vec![EXPS_REGEX.to_string()],
        }
    }
}

/// An owned `llama_model`.
pub struct LlamaModel {
    ptr: NonNull<sys::llama_model>,
}

// SAFETY: a llama_model is immutable after load and documented thread-safe for reads.
unsafe impl Send for LlamaModel {}
// SAFETY: as above.
unsafe impl Sync for LlamaModel {}

impl LlamaModel {
    /// Loads a model. `vocab_only` skips weights (tokenizer use);
    /// `n_gpu_layers` offloads that many layers (-1: all).
    pub fn load(
        path: &Path,
        vocab_only: bool,
        n_gpu_layers: i32,
    ) -> Result<LlamaModel, LlamaError> {
        // plain CPU buffers (no weight repacking), like strata with
        // --no-repack
        Self::load_with(path, vocab_only, n_gpu_layers, false)
    }

    /// Loads a model with llama.cpp's default settings, weight repacking
    /// into its CPU extra buffer types included: llama.cpp as its users run
    /// it (benchmarks), and as strata runs by default.
    pub fn load_as_users_run(path: &Path, n_gpu_layers: i32) -> Result<LlamaModel, LlamaError> {
        Self::load_with(path, false, n_gpu_layers, true)
    }

    fn load_with(
        path: &Path,
        vocab_only: bool,
        n_gpu_layers: i32,
        repack: bool,
    ) -> Result<LlamaModel, LlamaError> {
        let opts = LoadOptions {
            n_gpu_layers,
            repack,
            mmap: true,
            cpu_experts: CpuExperts::None,
        };
        Self::load_with_options(path, vocab_only, &opts)
    }

    /// Loads a model with llama.cpp's model options as its command-line
    /// flags set them (`-ngl`, `--no-repack`, `--no-mmap`, `--n-cpu-moe`,
    /// `--cpu-moe`).
    pub fn load_with_options(
        path: &Path,
        vocab_only: bool,
        o: &LoadOptions,
    ) -> Result<LlamaModel, LlamaError> {
        let f = checked_file(path)?;
        let invalid = |what: String| LlamaError::Invalid {
            path: path.display().to_string(),
            what,
        };
        let c = CString::new(path.to_string_lossy().as_bytes()).map_err(|_| LlamaError::Nul)?;
        // SAFETY: default params are a plain struct; we change plain fields.
        let mut p = unsafe { sys::llama_model_default_params() };
        p.vocab_only = vocab_only;
        p.n_gpu_layers = o.n_gpu_layers;
        // a vocabulary needs no device: an empty list keeps libllama from
        // asking every registered device (a lost RPC server's included,
        // which ggml's RPC client aborts on) for its memory
        let mut no_devices: [sys::ggml_backend_dev_t; 1] = [std::ptr::null_mut()];
        if vocab_only {
            p.devices = no_devices.as_mut_ptr();
        }
        if !o.repack {
            p.use_extra_bufts = false;
        }
        // --no-mmap: weights read into buffers of the backends' host types
        // (pinned memory where a GPU is loaded), not mapped from the file
        if !o.mmap {
            p.load_mode = sys::LLAMA_LOAD_MODE_NONE;
        }
        // --n-cpu-moe / --cpu-moe: expert tensors overridden to the CPU
        // device's buffer type. libllama reads the NULL-terminated array
        // (and the strings it points to) during the load only (the model's
        // copy of the params keeps the pointer, unread after); both live in
        // this frame until the load returns.
        let n_layer = match o.cpu_experts {
            CpuExperts::None => 0,
            _ => f
                .get_str("general.architecture")
                .and_then(|a| f.get_u32(&format!("{a}.block_count")))
                .map_err(|e| invalid(e.to_string()))?,
        };
        let patterns = o
            .cpu_experts
            .patterns(n_layer)
            .into_iter()
            .map(|s| CString::new(s).map_err(|_| LlamaError::Nul))
            .collect::<Result<Vec<_>, _>>()?;
        // SAFETY: plain query of a constant.
        let max_overrides = unsafe { sys::llama_max_tensor_buft_overrides() };
        if patterns.len() >= max_overrides {
            return Err(invalid(format!(
                "{} expert-placement patterns exceed libllama's {} tensor overrides",
                patterns.len(),
                max_overrides - 1
            )));
        }
        let mut overrides: Vec<sys::llama_model_tensor_buft_override> = Vec::new();
        if !patterns.is_empty() {
            let cpu = crate::ggml::cpu_device()?.buffer_type().raw();
            overrides.extend(
                patterns
                    .iter()
                    .map(|pat| sys::llama_model_tensor_buft_override {
                        pattern: pat.as_ptr(),
                        buft: cpu,
                    }),
            );
            overrides.push(sys::llama_model_tensor_buft_override {
                pattern: std::ptr::null(),
                buft: std::ptr::null_mut(),
            });
            p.tensor_buft_overrides = overrides.as_ptr();
        }
        quiet_logs();
        // SAFETY: c is a valid path string; params are valid; the override
        // array (NULL-pattern terminated), its pattern strings and the
        // NULL-terminated device list outlive the call, the only time
        // libllama reads them.
        let m = unsafe { sys::llama_model_load_from_file(c.as_ptr(), p) };
        drop(overrides);
        drop(patterns);
        let _ = &mut no_devices;
        NonNull::new(m)
            .map(|ptr| LlamaModel { ptr })
            .ok_or_else(|| LlamaError::Load(path.display().to_string()))
    }
    pub fn raw(&self) -> *mut sys::llama_model {
        self.ptr.as_ptr()
    }
    pub(crate) fn vocab(&self) -> *const sys::llama_vocab {
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

/// Loads ggml's backends and opens the GGUF file `path` for libllama,
/// refusing first what libllama would abort or throw on.
pub(super) fn checked_file(path: &Path) -> Result<crate::gguf::GgufFile, LlamaError> {
    crate::ggml::load_backends()?;
    let invalid = |what: String| LlamaError::Invalid {
        path: path.display().to_string(),
        what,
    };
    let f = crate::gguf::GgufFile::open(path).map_err(|e| invalid(e.to_string()))?;
    crate::model::validate_vocab(&f).map_err(|e| invalid(e.to_string()))?;
    Ok(f)
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
pub(crate) fn quiet_logs() {
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

#[cfg(test)]
mod tests {
    use super::CpuExperts;

    #[test]
    fn expert_patterns_are_llama_cpps() {
        assert!(CpuExperts::None.patterns(24).is_empty());
        assert!(CpuExperts::FirstLayers(0).patterns(24).is_empty());
        assert_eq!(
            CpuExperts::FirstLayers(2).patterns(24),
            [
                r"blk\.0\.ffn_(up|down|gate|gate_up)_(ch|)exps",
                r"blk\.1\.ffn_(up|down|gate|gate_up)_(ch|)exps"
            ]
        );
        let all = [r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"];
        assert_eq!(CpuExperts::All.patterns(24), all);
        // N at or above the block count is every layer
        assert_eq!(CpuExperts::FirstLayers(24).patterns(24), all);
        assert_eq!(CpuExperts::FirstLayers(u32::MAX).patterns(24), all);
    }
}
