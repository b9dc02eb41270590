//! The forward step: tokens in, logits out, one group graph at a time.
//!
//! A step embeds its tokens on the host (ggml's own dequantizer, identical to
//! `get_rows`) into the persistent residual stream, then for every layer
//! runs the attention template bound to that layer's weights and KV cache,
//! then the FFN template, and finally the output head on the rows that want
//! logits. Templates are cached by (kind, tensor types, shape) and share one
//! activation allocator per kind.

mod weights;

pub use weights::{ModelFile, ResidentWeights};

use crate::ggml::{self, Backend, Buffer, BufferUsage, Context, Device, GgmlError, GraphAllocator};
use crate::gguf::{GgmlType, GgufFile};
use crate::graph::{Binding, Dims, Limits, StepShape, Template, TemplateKey};
use crate::kv::{KvCells, KvError};
use crate::model::{GroupKind, ModelError, ModelSpec};
use std::collections::HashMap;
use std::path::Path;

/// Errors of the engine, each naming what failed.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("{0}: {1}")]
    Io(String, std::io::Error),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Gguf(#[from] crate::gguf::GgufError),
    #[error(transparent)]
    Ggml(#[from] GgmlError),
    #[error(transparent)]
    Kv(#[from] KvError),
    #[error("token id {token} is outside the vocabulary (n_vocab = {n_vocab})")]
    BadToken { token: u32, n_vocab: u32 },
    #[error("position {pos} of sequence {seq} is outside the context (n_ctx = {n_ctx})")]
    BadPos { seq: u32, pos: i32, n_ctx: u32 },
    #[error("empty batch")]
    EmptyBatch,
}

/// Which device computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceChoice {
    Cpu,
    /// The first GPU; an error if none is loaded.
    Gpu,
    /// The GPU if present, else the CPU.
    Auto,
}

#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub n_ctx: u32,
    pub n_batch: u32,
    pub n_threads: usize,
    pub device: DeviceChoice,
    pub progress: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            n_ctx: 4096,
            n_batch: 512,
            n_threads: std::thread::available_parallelism().map_or(4, |n| n.get()),
            device: DeviceChoice::Auto,
            progress: false,
        }
    }
}

/// One token of a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchToken {
    pub token: u32,
    pub pos: i32,
    pub seq: u32,
    /// Whether logits are wanted for this token.
    pub logits: bool,
}

/// Persistent device tensors shared by every graph of a step.
struct Persistent {
    _ctx: Context,
    _buf: Buffer,
    /// x, pos, mask, kv_idx, out_ids (Externals::all order, rope_freqs appended by the engine).
    bindings: Vec<Binding>,
    tensors: Vec<std::ptr::NonNull<crate::sys::ggml_tensor>>,
}

/// KV cache tensors: per layer K and V, F16 [n_embd_kv, n_ctx].
struct KvStore {
    _ctx: Context,
    _buf: Buffer,
    layers: Vec<[Binding; 2]>,
}

pub struct Engine {
    pub spec: ModelSpec,
    dims: Dims,
    lim: Limits,
    device: Device,
    backend: Backend,
    file: ModelFile,
    weights: ResidentWeights,
    persistent: Persistent,
    kv: KvStore,
    pub cells: KvCells,
    templates: HashMap<TemplateKey, Template>,
    allocators: HashMap<u8, (GraphAllocator, Option<TemplateKey>, usize)>,
    /// Staging for host-side inputs.
    embd: Vec<f32>,
    mask: Vec<u16>,
}

fn ext_tensor_index(name: &str) -> usize {
    match name {
        "x" => 0,
        "pos" => 1,
        "mask" => 2,
        "kv_idx" => 3,
        _ => 4,
    }
}

impl Engine {
    pub fn load(path: &Path, cfg: &EngineConfig) -> Result<Engine, EngineError> {
        let gguf = GgufFile::open(path)?;
        let spec = ModelSpec::from_gguf(&gguf)?;
        let file = ModelFile::open(path)?;
        let device = match cfg.device {
            DeviceChoice::Cpu => ggml::cpu_device()?,
            DeviceChoice::Gpu => ggml::gpu_device()?.ok_or(GgmlError::NoDevice("GPU"))?,
            DeviceChoice::Auto => match ggml::gpu_device()? {
                Some(d) => d,
                None => ggml::cpu_device()?,
            },
        };
        let mut backend = device.init_backend()?;
        backend.set_n_threads(cfg.n_threads);
        backend.attach_cpu_threadpool(cfg.n_threads)?;
        let n_ctx = cfg.n_ctx.max(1);
        let lim = Limits {
            n_batch: cfg.n_batch.clamp(1, n_ctx),
            n_ctx,
        };
        let dims = Dims {
            arch: spec.arch,
            hp: spec.hp.clone(),
            has_rope_freqs: spec.rope_freqs.is_some(),
        };
        let weights = ResidentWeights::load(&spec, &file, device, cfg.progress)?;
        let persistent = Self::alloc_persistent(&dims, lim, device)?;
        let kv = Self::alloc_kv(&dims, lim, device)?;
        let _ = ext_tensor_index;
        Ok(Engine {
            cells: KvCells::new(n_ctx as usize),
            spec,
            dims,
            lim,
            device,
            backend,
            file,
            weights,
            persistent,
            kv,
            templates: HashMap::new(),
            allocators: HashMap::new(),
            embd: Vec::new(),
            mask: Vec::new(),
        })
    }

    fn alloc_persistent(d: &Dims, lim: Limits, dev: Device) -> Result<Persistent, EngineError> {
        let ctx = Context::new(8, 0)?;
        let ext = crate::graph::Externals::new(&ctx, d, lim);
        let list = [ext.x, ext.pos, ext.mask, ext.kv_idx, ext.out_ids];
        let buft = dev.buffer_type();
        // SAFETY: pure query.
        let align = unsafe { crate::sys::ggml_backend_buft_get_alignment(buft) }.max(1);
        let sizes: Vec<usize> = list
            .iter()
            .map(|t| t.nbytes().div_ceil(align) * align)
            .collect();
        let buf = Buffer::alloc(buft, sizes.iter().sum(), BufferUsage::Compute)?;
        buf.clear(0);
        let mut off = 0;
        let mut bindings = Vec::new();
        for (t, s) in list.iter().zip(&sizes) {
            buf.place(*t, off)?;
            off += s;
            // SAFETY: t was just placed.
            bindings.push(Binding {
                data: unsafe { (*t.raw()).data },
                buffer: buf.raw(),
            });
        }
        let tensors = list
            .iter()
            .map(|t| std::ptr::NonNull::new(t.raw()).expect("non-null"))
            .collect();
        Ok(Persistent {
            _ctx: ctx,
            _buf: buf,
            bindings,
            tensors,
        })
    }

    fn alloc_kv(d: &Dims, lim: Limits, dev: Device) -> Result<KvStore, EngineError> {
        let n_layer = d.hp.n_layer as usize;
        let ctx = Context::new(2 * n_layer, 0)?;
        let shape = [d.hp.n_embd_kv() as i64, lim.n_ctx as i64];
        let ts: Vec<_> = (0..2 * n_layer)
            .map(|_| ctx.new_tensor(GgmlType::F16, &shape))
            .collect();
        let buft = dev.buffer_type();
        // SAFETY: pure query.
        let align = unsafe { crate::sys::ggml_backend_buft_get_alignment(buft) }.max(1);
        let each = ts[0].nbytes().div_ceil(align) * align;
        let buf = Buffer::alloc(buft, each * ts.len(), BufferUsage::Any)?;
        buf.clear(0);
        let mut layers = Vec::with_capacity(n_layer);
        for (i, pair) in ts.chunks(2).enumerate() {
            buf.place(pair[0], 2 * i * each)?;
            buf.place(pair[1], (2 * i + 1) * each)?;
            // SAFETY: both were just placed.
            let b = |t: &ggml::Tensor<'_>| Binding {
                data: unsafe { (*t.raw()).data },
                buffer: buf.raw(),
            };
            layers.push([b(&pair[0]), b(&pair[1])]);
        }
        drop(ts);
        Ok(KvStore {
            _ctx: ctx,
            _buf: buf,
            layers,
        })
    }

    pub fn device(&self) -> Device {
        self.device
    }
    pub fn n_ctx(&self) -> u32 {
        self.lim.n_ctx
    }
    pub fn n_vocab(&self) -> u32 {
        self.spec.hp.n_vocab
    }
    pub fn weight_bytes(&self) -> u64 {
        self.weights.bytes
    }

    /// Frees the KV cells of a sequence.
    pub fn clear_seq(&mut self, seq: u32) {
        self.cells.remove_seq(seq);
    }
    /// Frees every KV cell.
    pub fn clear(&mut self) {
        self.cells.clear();
    }

    fn ext_bindings(&self) -> Vec<Binding> {
        let mut b = self.persistent.bindings.clone();
        b.extend(self.weights.rope_freqs);
        b
    }

    /// Runs `tokens` (split into steps of at most n_batch) and returns the
    /// logits of each token with `logits == true`, in order, n_vocab each.
    pub fn decode(&mut self, tokens: &[BatchToken]) -> Result<Vec<f32>, EngineError> {
        if tokens.is_empty() {
            return Err(EngineError::EmptyBatch);
        }
        let mut out = Vec::new();
        for chunk in tokens.chunks(self.lim.n_batch as usize) {
            self.step(chunk, &mut out)?;
        }
        Ok(out)
    }

    fn step(&mut self, toks: &[BatchToken], out: &mut Vec<f32>) -> Result<(), EngineError> {
        let hp = self.spec.hp.clone();
        for t in toks {
            if t.token >= hp.n_vocab {
                return Err(EngineError::BadToken {
                    token: t.token,
                    n_vocab: hp.n_vocab,
                });
            }
            if t.pos < 0 || t.pos as u32 >= self.lim.n_ctx {
                return Err(EngineError::BadPos {
                    seq: t.seq,
                    pos: t.pos,
                    n_ctx: self.lim.n_ctx,
                });
            }
        }
        let n = toks.len();
        let sp: Vec<(u32, i32)> = toks.iter().map(|t| (t.seq, t.pos)).collect();
        let cells = self.cells.place(&sp)?;
        let n_kv = self.cells.n_kv();
        let out_ids: Vec<i32> = toks
            .iter()
            .enumerate()
            .filter(|(_, t)| t.logits)
            .map(|(i, _)| i as i32)
            .collect();

        // inputs
        self.embed(toks)?;
        let p = &self.persistent;
        // SAFETY: the tensors live in p._ctx, owned by self.
        let pt = |i: usize| unsafe { ggml::Tensor::from_raw(&p._ctx, p.tensors[i]) };
        let pos: Vec<i32> = toks.iter().map(|t| t.pos).collect();
        pt(1).set_i32(&pos)?;
        self.cells.fill_mask(&sp, n_kv, &mut self.mask);
        // SAFETY: u16 slice viewed as bytes.
        let mask_bytes = unsafe {
            std::slice::from_raw_parts(self.mask.as_ptr().cast::<u8>(), self.mask.len() * 2)
        };
        pt(2).set_bytes(mask_bytes, 0)?;
        let idx: Vec<i64> = cells.iter().map(|&c| c as i64).collect();
        pt(3).set_i64(&idx)?;
        if !out_ids.is_empty() {
            pt(4).set_i32(&out_ids)?;
        }

        let n_layer = hp.n_layer;
        let n_out = out_ids.len() as u32;
        for l in 0..n_layer {
            let last = l + 1 == n_layer;
            if last && n_out == 0 {
                // nothing wanted from this step: the last attention still
                // writes its KV rows, the last FFN is not needed
                let shape = StepShape {
                    n_tokens: n as u32,
                    n_kv: n_kv as u32,
                    n_out: n as u32,
                    last_layer: false,
                };
                self.run_group(l, GroupKind::Attn, shape)?;
                break;
            }
            let shape = StepShape {
                n_tokens: n as u32,
                n_kv: n_kv as u32,
                n_out: if last { n_out } else { n as u32 },
                last_layer: last,
            };
            self.run_group(l, GroupKind::Attn, shape)?;
            let rows = if last { n_out } else { n as u32 };
            let fshape = StepShape {
                n_tokens: rows,
                n_kv: 0,
                n_out: rows,
                last_layer: false,
            };
            self.run_group(l, GroupKind::Ffn, fshape)?;
        }
        if n_out > 0 {
            self.run_head(n_out, out)?;
        }
        Ok(())
    }

    /// Host-side embedding of the step's tokens into x[:, :n].
    fn embed(&mut self, toks: &[BatchToken]) -> Result<(), EngineError> {
        let e = self.spec.hp.n_embd as usize;
        let w = &self.spec.tok_embd;
        let row = ggml::row_size(w.ty, e as i64);
        self.embd.resize(e * toks.len(), 0.0);
        let bytes = self.file.bytes(w);
        for (i, t) in toks.iter().enumerate() {
            let r = &bytes[t.token as usize * row..(t.token as usize + 1) * row];
            ggml::dequantize_row(w.ty, r, &mut self.embd[i * e..(i + 1) * e])?;
        }
        let p = &self.persistent;
        // SAFETY: x lives in p._ctx, owned by self.
        let x = unsafe { ggml::Tensor::from_raw(&p._ctx, p.tensors[0]) };
        // SAFETY: f32 slice viewed as bytes.
        let b = unsafe {
            std::slice::from_raw_parts(self.embd.as_ptr().cast::<u8>(), self.embd.len() * 4)
        };
        x.set_bytes(b, 0)?;
        Ok(())
    }

    fn template(&mut self, key: &TemplateKey, alloc_id: u8) -> Result<(), EngineError> {
        if !self.templates.contains_key(key) {
            let mut t = Template::build(key, &self.dims, self.lim)?;
            t.bind_externals(&self.ext_bindings());
            self.templates.insert(key.clone(), t);
        }
        let buft = self.device.buffer_type();
        if let std::collections::hash_map::Entry::Vacant(e) = self.allocators.entry(alloc_id) {
            e.insert((GraphAllocator::new(buft)?, None, 0));
        }
        Ok(())
    }

    /// Allocates activations of `key`'s graph if it is not the one its
    /// allocator holds. If the allocator had to grow, every other template
    /// of that allocator points into freed memory and is dropped.
    fn ensure_allocated(&mut self, key: &TemplateKey, alloc_id: u8) -> Result<(), EngineError> {
        let (alloc, last, size) = self
            .allocators
            .get_mut(&alloc_id)
            .expect("allocator exists");
        if last.as_ref() == Some(key) {
            return Ok(());
        }
        let t = self.templates.get(key).expect("template exists");
        let g = t.graph();
        alloc.alloc(&g)?;
        let new_size = alloc.buffer_size();
        let grew = new_size != *size;
        *size = new_size;
        *last = Some(key.clone());
        if grew {
            let kind_of = |k: &TemplateKey| alloc_key(k);
            let keep = key.clone();
            self.templates
                .retain(|k, _| kind_of(k) != alloc_id || *k == keep);
        }
        Ok(())
    }

    fn run_group(
        &mut self,
        layer: u32,
        kind: GroupKind,
        shape: StepShape,
    ) -> Result<(), EngineError> {
        let gi = 2 * layer as usize + usize::from(kind == GroupKind::Ffn);
        let key = TemplateKey::Group {
            kind,
            sig: self.spec.groups[gi].signature(),
            shape,
        };
        let aid = alloc_key(&key);
        self.template(&key, aid)?;
        // bind before allocating so the allocator sees the weights as external
        let kv = (kind == GroupKind::Attn).then(|| self.kv.layers[layer as usize]);
        let t = self.templates.get_mut(&key).expect("template exists");
        t.bind((layer, 0), &self.weights.groups[gi], kv);
        self.ensure_allocated(&key, aid)?;
        let t = self.templates.get(&key).expect("template exists");
        self.backend.compute(&t.graph())?;
        Ok(())
    }

    fn run_head(&mut self, n_rows: u32, out: &mut Vec<f32>) -> Result<(), EngineError> {
        let key = TemplateKey::Head {
            out_ty: self.spec.output.ty,
            n_rows,
        };
        let aid = alloc_key(&key);
        self.template(&key, aid)?;
        let t = self.templates.get_mut(&key).expect("template exists");
        t.bind((u32::MAX, 0), &self.weights.head, None);
        self.ensure_allocated(&key, aid)?;
        let t = self.templates.get(&key).expect("template exists");
        self.backend.compute(&t.graph())?;
        let start = out.len();
        out.resize(start + (n_rows * self.spec.hp.n_vocab) as usize, 0.0);
        t.out().get_f32(&mut out[start..])?;
        Ok(())
    }
}

fn alloc_key(k: &TemplateKey) -> u8 {
    match k {
        TemplateKey::Group {
            kind: GroupKind::Attn,
            ..
        } => 0,
        TemplateKey::Group {
            kind: GroupKind::Ffn,
            ..
        } => 1,
        TemplateKey::Head { .. } => 2,
    }
}
