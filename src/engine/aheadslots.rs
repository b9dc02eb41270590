//! The look-ahead's device memory (`engine::lookahead` computes with it,
//! `paging::lookahead` says what and why): a ring of slots for the next
//! host layers' predicted experts, the routers that predict them, the rows and
//! ids of the slots' graphs and the stream their uploads go on.

use super::error::EngineError;
use super::host::{pad_picks, PickRows};
use super::hotpool::expert_sig;
use super::store::{Location, WeightStore};
use super::templates::TemplateCache;
use crate::dtype::GgmlType;
use crate::ggml::{Backend, Binding, BufferUsage, Context, Device, Event, TensorArena, TensorSpec};
use crate::graph::{Dims, Limits, TemplateKey};
use crate::model::{GroupKind, ModelSpec, Role, WeightSpec};
use std::collections::HashMap;

/// Template instances of the slots' graphs start here (the hot pool's
/// are group indices).
const INSTANCE0: u32 = 1 << 20;

/// One slot: room for `most` experts of each expert tensor of a group.
pub(super) struct Slot {
    pub(super) arena: TensorArena,
    /// The group whose experts it holds, and which (slot index k holds
    /// `set[k]`).
    pub(super) group: Option<usize>,
    pub(super) set: Vec<u32>,
    /// Recorded on the upload stream after the copies into the slot; None
    /// where the device has no events (the CPU: its copies are done when
    /// they return).
    pub(super) loaded: Option<Event>,
}

/// The look-ahead's device memory, predictors and upload stream.
pub struct LookAhead {
    // field order is drop order (graphs before the buffers they point
    // into); `Drop` drains the upload stream first
    pub(super) templates: TemplateCache,
    /// Experts a layer prefetched at most.
    pub most: u32,
    /// depth + 1 slots, for the host layers predicted ahead (`depth`).
    pub(super) slots: Vec<Slot>,
    /// This step's host layers predicted so far (an index into `targets`).
    pub(super) issued: usize,
    /// Per look-ahead group index: its router as F32 [n_embd, n_expert],
    /// and the offsets of its expert tensors in a slot.
    pub(super) routers: HashMap<usize, Vec<f32>>,
    pub(super) offsets: HashMap<usize, Vec<usize>>,
    /// This step's look-ahead groups the host computes, in order.
    pub(super) targets: Vec<usize>,
    /// The picks' rows and compact ids, and the rows back.
    pub(super) io: PickRows,
    pub(super) upload: Backend,
}

impl Drop for LookAhead {
    fn drop(&mut self) {
        // no copy may still write a slot being freed
        self.upload.synchronize();
    }
}

/// Device bytes of each expert tensor of group `gi` holding `most`
/// experts, aligned as the device's buffers place them.
fn role_bytes(
    spec: &ModelSpec,
    dev: Device,
    gi: usize,
    most: u32,
) -> Result<Vec<usize>, EngineError> {
    let buft = dev.buffer_type();
    let align = buft.alignment().max(1);
    let ctx = Context::new(4, 0)?;
    Ok(spec.groups[gi]
        .weights
        .iter()
        .filter(|w| w.role.is_some_and(|r| r.is_expert()))
        .map(|w| {
            let t = ctx.new_tensor(w.ty, &[w.ne[0], w.ne[1], i64::from(most)]);
            buft.alloc_size(t).div_ceil(align) * align
        })
        .collect())
}

/// The mixture FFN groups of `spec`, each with its router.
fn moe_groups(spec: &ModelSpec) -> impl Iterator<Item = (usize, &WeightSpec)> + '_ {
    spec.groups
        .iter()
        .enumerate()
        .filter(|(_, g)| g.kind == GroupKind::Ffn)
        .filter_map(|(gi, g)| Some((gi, g.weight(Role::GateInp)?)))
}

/// Device bytes the look-ahead takes for `most` experts a layer `depth`
/// layers ahead: depth + 1 slots of the largest mixture layer's, and the rows and activations of a step
/// of `n_tokens` (each pick's input and output rows and its gate, up and
/// product rows, in F32).
pub fn device_bytes(
    spec: &ModelSpec,
    dev: Device,
    most: u32,
    depth: u32,
    n_tokens: u32,
) -> Result<u64, EngineError> {
    let mut slot = 0usize;
    for (gi, _) in moe_groups(spec) {
        slot = slot.max(role_bytes(spec, dev, gi, most)?.iter().sum());
    }
    let picks = u64::from(pad_picks(n_tokens * spec.hp.n_expert_used));
    let (e, f) = (u64::from(spec.hp.n_embd), u64::from(spec.hp.n_ff_exp));
    Ok((u64::from(depth) + 1) * slot as u64 + picks * (e * 4 + 4) + picks * (2 * e + 3 * f) * 4)
}

impl LookAhead {
    /// The look-ahead of the groups marked in `host` (the host's copies)
    /// that are mixture layers streamed from pinned memory: their routers
    /// read from the file, depth + 1 slots and the rows on `dev`. None where no
    /// group qualifies.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        spec: &ModelSpec,
        dims: &Dims,
        lim: Limits,
        ext: Vec<Binding>,
        file: &super::model_file::ModelFile,
        store: &WeightStore,
        host: &[bool],
        dev: Device,
        most: u32,
        depth: u32,
        most_tokens: u32,
    ) -> Result<Option<LookAhead>, EngineError> {
        let e = spec.hp.n_embd as usize;
        let mut routers = HashMap::new();
        let mut offsets = HashMap::new();
        let mut slot = 0usize;
        for (gi, w) in moe_groups(spec) {
            let pinned = matches!(store.groups[gi], Location::Streamed { host: Some(_), .. });
            if !host.get(gi).copied().unwrap_or(false) || !pinned {
                continue;
            }
            let n_expert = w.ne[1] as usize;
            let bytes = file.bytes(w);
            let row = crate::ggml::row_size(w.ty, e as i64);
            let mut r = vec![0f32; e * n_expert];
            for (x, out) in r.chunks_exact_mut(e).enumerate() {
                crate::ggml::dequantize_row(w.ty, &bytes[x * row..(x + 1) * row], out)?;
            }
            routers.insert(gi, r);
            // each expert tensor after the one before it
            let sizes = role_bytes(spec, dev, gi, most)?;
            let starts: Vec<usize> = sizes
                .iter()
                .scan(0, |end, s| Some(std::mem::replace(end, *end + s)))
                .collect();
            slot = slot.max(sizes.iter().sum());
            offsets.insert(gi, starts);
        }
        if routers.is_empty() {
            return Ok(None);
        }
        let buft = dev.buffer_type();
        let new_slot = || -> Result<Slot, EngineError> {
            Ok(Slot {
                arena: TensorArena::new(
                    buft,
                    BufferUsage::Weights,
                    &[TensorSpec::new(GgmlType::I8, &[slot as i64]).named("ahead_slot")],
                )?,
                group: None,
                set: Vec::new(),
                loaded: if dev.is_cpu() {
                    None
                } else {
                    Some(Event::new(dev)?)
                },
            })
        };
        let picks = pad_picks(most_tokens * spec.hp.n_expert_used);
        let io = PickRows::alloc(buft, spec.hp.n_embd, picks, "ahead")?;
        Ok(Some(LookAhead {
            templates: TemplateCache::new(dims.clone(), lim, ext, dev),
            most,
            slots: (0..=depth).map(|_| new_slot()).collect::<Result<_, _>>()?,
            issued: 0,
            routers,
            offsets,
            targets: Vec::new(),
            io,
            upload: dev.init_backend()?,
        }))
    }

    /// Host layers predicted ahead.
    pub fn depth(&self) -> usize {
        self.slots.len() - 1
    }

    /// Device bytes of the slots and rows.
    pub fn bytes(&self) -> u64 {
        (self.slots.iter().map(|s| s.arena.bytes()).sum::<usize>() + self.io.arena.bytes()) as u64
    }

    /// The groups a step computes on the host (`on_cpu`, by group index):
    /// those of them with a look-ahead are this step's targets.
    pub fn begin_step(&mut self, on_cpu: &[bool]) {
        self.targets = (0..on_cpu.len())
            .filter(|&gi| on_cpu[gi] && self.routers.contains_key(&gi))
            .collect();
        self.issued = 0;
    }

    /// Whether group `gi` takes part.
    pub fn has(&self, gi: usize) -> bool {
        self.routers.contains_key(&gi)
    }

    /// The graph over slot `s`'s experts for `n` (padded) picks.
    pub(super) fn key(spec: &ModelSpec, gi: usize, s: usize, most: u32, n: u32) -> TemplateKey {
        TemplateKey::HotExperts {
            sig: expert_sig(spec, gi),
            picks: n,
            n_hot: most,
            instance: INSTANCE0 + s as u32,
        }
    }
}
