//! The graph-template cache: one built graph per (group, types, step
//! shape) and for the head, all sharing one activation buffer.
//!
//! Invariants: a template's externals (residual stream, step inputs, rope
//! factors) are bound once, when it is built; its activations are assigned
//! once (`allocated`), and when the shared buffer has to grow every other
//! template, which pointed into the old buffer, is dropped.

use super::error::EngineError;
use crate::ggml::{Backend, Binding, Device, GraphAllocator};
use crate::graph::{Dims, Limits, StepShape, Template, TemplateKey};
use std::collections::HashMap;

pub struct TemplateCache {
    templates: HashMap<TemplateKey, Template>,
    /// The activation buffer every group graph and the head share, and
    /// its size now.
    activations: Option<(GraphAllocator, usize)>,
    dims: Dims,
    lim: Limits,
    /// What every template's externals are bound to, in
    /// `Externals::all` order.
    ext: Vec<Binding>,
    device: Device,
}

impl TemplateCache {
    pub fn new(dims: Dims, lim: Limits, ext: Vec<Binding>, device: Device) -> TemplateCache {
        TemplateCache {
            templates: HashMap::new(),
            activations: None,
            dims,
            lim,
            ext,
            device,
        }
    }

    /// The template of `key`, built (and its externals bound) on first use.
    pub fn get(&mut self, key: &TemplateKey) -> Result<&mut Template, EngineError> {
        if self.activations.is_none() {
            self.activations = Some((GraphAllocator::new(self.device.buffer_type())?, 0));
        }
        if !self.templates.contains_key(key) {
            let mut t = Template::build(key, &self.dims, self.lim)?;
            // the rope factors come last: only attention graphs take them
            let n = t.n_externals().min(self.ext.len());
            t.bind_externals(&self.ext[..n])?;
            self.templates.insert(key.clone(), t);
        }
        Ok(self.templates.get_mut(key).expect("inserted above"))
    }

    /// Allocates the activations of `key`'s graph once, after its weights
    /// were bound (so the allocator treats them as external) and returns
    /// the template, ready to compute. Every template shares one allocator
    /// buffer (the graphs run one after another on one stream, and what
    /// one hands the next lives in persistent tensors), so the device holds
    /// the largest graph's activations, not a sum; if the buffer had to
    /// grow, every other template points into freed memory and is dropped
    /// (after `backend` drained: the old buffer may still be in use).
    pub fn allocated(
        &mut self,
        key: &TemplateKey,
        backend: &Backend,
    ) -> Result<&Template, EngineError> {
        let t = self.templates.get_mut(key).expect("built by get() first");
        if !t.allocated {
            let (alloc, size) = self.activations.as_mut().expect("made by get()");
            alloc.alloc(&t.graph())?;
            t.allocated = true;
            let new_size = alloc.buffer_size();
            let grew = new_size != *size;
            *size = new_size;
            if grew {
                tracing::debug!(
                    "activations grew to {:.1} MiB ({key:?})",
                    new_size as f64 / (1u64 << 20) as f64
                );
                backend.synchronize();
                self.templates.retain(|k, _| k == key);
            }
        }
        Ok(self.templates.get(key).expect("kept above"))
    }

    /// Device bytes the activation buffer holds now (it grows to the
    /// largest graph run so far; the memory plan reserves its estimate).
    pub fn activation_bytes(&self) -> u64 {
        self.activations.as_ref().map_or(0, |(_, s)| *s as u64)
    }

    /// Bounds the cache: when it holds more than `cap` templates, drop the
    /// group templates of shapes other than this step's (after `backend`
    /// drained, since a dropped graph may still be queued).
    pub fn evict(&mut self, shapes: &[StepShape], cap: usize, backend: &Backend) {
        if self.templates.len() <= cap {
            return;
        }
        backend.synchronize();
        self.templates.retain(|k, _| match k {
            TemplateKey::Group { shape, .. } => shapes.contains(shape),
            TemplateKey::Router { n_tokens, .. } => shapes.iter().any(|s| s.n_tokens == *n_tokens),
            TemplateKey::Head { .. }
            | TemplateKey::HostExperts { .. }
            | TemplateKey::HotExperts { .. }
            | TemplateKey::AddRows { .. }
            | TemplateKey::Widen { .. } => true,
        });
    }
}
