//! Weights the CPU computes from, placed as llama.cpp places them by
//! default: each matrix in the first of the CPU's extra buffer types that
//! takes it (repacked layouts such as CPU_REPACK or AMX, which interleave
//! rows for the SIMD kernels), everything else in plain CPU memory.
//! Repacking is both llama.cpp's CPU speed and its CPU numerics. A
//! mixture's stacked experts are placed as stacks (the layout must take
//! them for `mul_mat_id`), or kept plain where `repack_experts` is off.
//!
//! One exception, [`Amx::Auto`] for the groups hybrid decode gives the
//! host (steps of at most 16 tokens): ggml lists AMX first on CPUs that
//! have it, and its AMX kernels multiply one row of activations by Q4_K and
//! Q6_K weights slower than the repacked Q4_K kernel and the plain Q6_K one
//! (40.6 against 50.4 GB/s and 37.5 against 45.4 on a Sapphire Rapids host;
//! Q4_0 the other way, 99.9 against 62.5: docs/device-runs.md run 124). So
//! there those two types skip AMX unless asked. A CPU device computes
//! prompt steps too, where AMX's tiles pay (at 16 rows it was already the
//! faster for both), so its weights keep llama.cpp's placement.

use super::error::EngineError;
use super::model_file::ModelFile;
use crate::dtype::GgmlType;
use crate::ggml::{Buffer, BufferType, BufferUsage, Context, Device};
use crate::graph::Binding;
use crate::model::WeightSpec;
use indicatif::ProgressBar;
use std::collections::HashMap;
use std::sync::Arc;

/// Weights in CPU memory, some repacked.
pub struct CpuWeights {
    /// Per set loaded, the bindings of its weights in order.
    pub sets: Vec<Vec<Binding>>,
    /// Bytes in extra (repacked) buffer types, and in plain memory.
    pub repacked_bytes: u64,
    pub plain_bytes: u64,
    _ctx: Context,
    // after _ctx: the tensors point into these buffers (which the
    // bindings share)
    _bufs: Vec<Arc<Buffer>>,
}

/// Whether the CPU's weights may use AMX (where the CPU module offers it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Amx {
    /// AMX for the types whose one-row products it speeds up; Q4_K and
    /// Q6_K go to the next layout that takes them (see the module's text)
    #[default]
    Auto,
    /// AMX first for every type it takes, as llama.cpp places weights
    On,
    /// never AMX
    Off,
}

impl Amx {
    /// Whether weights of type `ty` may go into AMX's buffer type.
    pub fn allows(self, ty: GgmlType) -> bool {
        match self {
            Amx::On => true,
            Amx::Off => false,
            Amx::Auto => !matches!(ty, GgmlType::Q4_K | GgmlType::Q6_K),
        }
    }
}

/// Where the CPU computes its weights from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuLayout {
    /// the CPU's extra buffer types where they take a weight
    /// (llama.cpp's default; its --no-repack turns it off)
    pub repack: bool,
    pub amx: Amx,
    /// stacked experts too (as llama.cpp places them), not only 2-D
    /// matrices; with `repack` only
    pub repack_experts: bool,
}

impl CpuLayout {
    /// The layout of weights the CPU computes prompt steps with too (a
    /// CPU device's): `Auto` there is AMX for every type it takes.
    pub fn for_prompt_steps(self) -> CpuLayout {
        let amx = match self.amx {
            Amx::Auto => Amx::On,
            a => a,
        };
        CpuLayout { amx, ..self }
    }
}

/// The name ggml gives AMX's buffer type.
const AMX_BUFT: &str = "AMX";

/// The extra buffer type a matrix of `ty`/`ne` goes into under `layout`:
/// an index into `extras`, or None for plain memory. `ne` is a matrix's
/// two dimensions or a stack of experts' three ([k, m, n_expert]).
pub fn choose_buft(
    cpu: Device,
    extras: &[BufferType],
    ty: GgmlType,
    ne: &[i64],
    layout: CpuLayout,
) -> Option<usize> {
    if !layout.repack {
        return None;
    }
    extras.iter().position(|&b| {
        (layout.amx.allows(ty) || b.name() != AMX_BUFT) && cpu.supports_weight(b, ty, ne)
    })
}

/// Where each weight goes: the index of an extra buffer type, or None for
/// plain memory. Decided once per (type, shape).
fn choose(cpu: Device, extras: &[BufferType], w: &WeightSpec, layout: CpuLayout) -> Option<usize> {
    let dims = weight_dims(&w.ne, layout)?;
    choose_buft(cpu, extras, w.ty, &w.ne[..dims], layout)
}

/// The dimensions a weight of shape `ne` is placed by: 2 for a matrix, 3
/// for a stack of experts where `layout` repacks those, None for what
/// stays in plain memory (vectors, and stacks where it does not).
fn weight_dims(ne: &[i64], layout: CpuLayout) -> Option<usize> {
    let flat_from = |d: usize| ne.len() >= d && ne[d..].iter().all(|&x| x == 1);
    if ne.len() < 2 || ne[1] <= 1 {
        None
    } else if flat_from(2) {
        Some(2)
    } else if layout.repack_experts && ne[2] > 1 && flat_from(3) {
        Some(3)
    } else {
        None
    }
}

impl CpuWeights {
    /// Loads `sets` of weights from `file` into CPU memory (with
    /// `layout.repack`: into the extra buffer types where they take them,
    /// as llama.cpp does unless run with --no-repack).
    pub fn load(
        cpu: Device,
        sets: &[Vec<&WeightSpec>],
        file: &ModelFile,
        layout: CpuLayout,
        bar: &ProgressBar,
    ) -> Result<CpuWeights, EngineError> {
        let extras = if layout.repack {
            cpu.extra_buffer_types()
        } else {
            Vec::new()
        };
        let plain = cpu.buffer_type();
        let n: usize = sets.iter().map(|s| s.len()).sum();
        let ctx = Context::new(n + 1, 0)?;
        // buffer type of each weight: 0 plain, 1 + i extra i
        let mut memo: HashMap<(crate::dtype::GgmlType, Vec<i64>), usize> = HashMap::new();
        let mut placed = Vec::with_capacity(n);
        let mut sizes = vec![0usize; extras.len() + 1];
        for &w in sets.iter().flat_map(|s| s.iter()) {
            let k = *memo
                .entry((w.ty, w.ne.to_vec()))
                .or_insert_with(|| choose(cpu, &extras, w, layout).map_or(0, |i| i + 1));
            let buft = if k == 0 { plain } else { extras[k - 1] };
            let t = ctx.new_tensor(w.ty, &w.ne[..]).named(&w.name);
            let off = sizes[k];
            let a = buft.alignment();
            sizes[k] += buft.alloc_size(t).div_ceil(a) * a;
            placed.push((t, k, off, w));
        }
        let mut bufs: Vec<Option<Arc<Buffer>>> = Vec::with_capacity(sizes.len());
        for (k, &size) in sizes.iter().enumerate() {
            if size == 0 {
                bufs.push(None);
                continue;
            }
            let buft = if k == 0 { plain } else { extras[k - 1] };
            let b = Buffer::alloc(buft, size, BufferUsage::Weights)?;
            // padding quantized kernels may read past a row stays zero
            b.clear(0);
            bufs.push(Some(Arc::new(b)));
        }
        let mut flat = Vec::with_capacity(n);
        for (t, k, off, w) in placed {
            let b = bufs[k].as_ref().expect("buffer of a used type");
            // placing runs the buffer's init_tensor (a repacked layout's
            // traits go to tensor->extra); the write repacks
            b.place(t, off)?;
            t.set_bytes(&file.bytes(w), 0)?;
            bar.inc(w.size);
            flat.push(Binding::of(b, t)?);
        }
        let mut it = flat.into_iter();
        let out = sets
            .iter()
            .map(|s| it.by_ref().take(s.len()).collect())
            .collect();
        Ok(CpuWeights {
            sets: out,
            repacked_bytes: sizes[1..].iter().sum::<usize>() as u64,
            plain_bytes: sizes[0] as u64,
            _ctx: ctx,
            _bufs: bufs.into_iter().flatten().collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amx_auto_keeps_the_k_quants_it_slows_off_amx() {
        for ty in [GgmlType::Q4_K, GgmlType::Q6_K] {
            assert!(!Amx::Auto.allows(ty), "{ty:?}");
            assert!(Amx::On.allows(ty), "{ty:?}");
        }
        for ty in [GgmlType::Q4_0, GgmlType::Q8_0, GgmlType::Q5_K] {
            assert!(Amx::Auto.allows(ty), "{ty:?}");
        }
        assert!(!Amx::Off.allows(GgmlType::Q4_0));
    }

    #[test]
    fn expert_stacks_are_placed_as_stacks_only_where_the_layout_repacks_them() {
        let l = |repack_experts| CpuLayout {
            repack: true,
            amx: Amx::Auto,
            repack_experts,
        };
        assert_eq!(weight_dims(&[2048, 768], l(false)), Some(2));
        assert_eq!(weight_dims(&[2048, 768, 1, 1], l(true)), Some(2));
        assert_eq!(weight_dims(&[2048, 768, 128], l(true)), Some(3));
        assert_eq!(weight_dims(&[2048, 768, 128], l(false)), None);
        assert_eq!(weight_dims(&[2048, 768, 128, 2], l(true)), None);
        assert_eq!(weight_dims(&[2048], l(true)), None);
        assert_eq!(weight_dims(&[2048, 1], l(true)), None);
    }

    #[test]
    fn a_cpu_device_keeps_amx_under_auto_and_obeys_on_or_off() {
        let l = |amx| CpuLayout {
            repack: true,
            amx,
            repack_experts: true,
        };
        assert_eq!(l(Amx::Auto).for_prompt_steps().amx, Amx::On);
        assert_eq!(l(Amx::Off).for_prompt_steps().amx, Amx::Off);
        assert_eq!(l(Amx::On).for_prompt_steps().amx, Amx::On);
    }
}
