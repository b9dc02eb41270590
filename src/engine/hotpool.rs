//! The hot experts' device memory (`paging::experts` says which, and
//! `engine::hot` computes with them): each hot layer's expert tensors,
//! compact, copied from the model file at load, and the rows and ids their
//! graphs read.

use super::error::EngineError;
use super::model_file::ModelFile;
use crate::dtype::GgmlType;
use crate::ggml::{BufferUsage, Device, TensorArena, TensorSpec};
use crate::model::{ModelSpec, Role};
use crate::paging::HotPlan;
use std::collections::HashMap;

/// The hot experts on the device, and the inputs and outputs of their
/// graphs.
pub struct HotPool {
    pub plan: HotPlan,
    /// The router counts the plan was made from (read beside the model),
    /// which a refresh adds to what the engine counted since.
    pub(super) counted: Option<crate::paging::routing::RouterCounts>,
    /// The expert tensors of every hot group, compact (its hot experts
    /// only, in ascending order), three per group in the group's order.
    pub(super) weights: Option<TensorArena>,
    /// Group index -> index of its first tensor in `weights`.
    pub(super) first: HashMap<usize, usize>,
    /// The picks' rows and compact ids, and the rows back.
    pub(super) io: super::host::PickRows,
}

/// The roles and types of a group's expert tensors, in its order.
pub(super) fn expert_sig(spec: &ModelSpec, gi: usize) -> Vec<(Role, GgmlType)> {
    spec.groups[gi]
        .signature()
        .into_iter()
        .filter(|(r, _)| r.is_expert())
        .collect()
}

impl HotPool {
    /// Device bytes: the experts and the rows.
    pub fn bytes(&self) -> u64 {
        (self.weights.as_ref().map_or(0, |w| w.bytes()) + self.io.arena.bytes()) as u64
    }

    /// Copies the hot experts `plan` names from the model file to `dev`.
    /// `most_tokens`: the largest step whose picks may go to the device.
    pub fn load(
        spec: &ModelSpec,
        file: &ModelFile,
        dev: Device,
        plan: HotPlan,
        most_tokens: u32,
    ) -> Result<HotPool, EngineError> {
        let mut specs = Vec::new();
        let mut first = HashMap::new();
        for (gi, set) in plan.sets.iter().enumerate() {
            if set.is_empty() {
                continue;
            }
            first.insert(gi, specs.len());
            for w in spec.groups[gi]
                .weights
                .iter()
                .filter(|w| w.role.is_some_and(|r| r.is_expert()))
            {
                specs.push(TensorSpec::new(w.ty, &[w.ne[0], w.ne[1], set.len() as i64]));
            }
        }
        let weights = if specs.is_empty() {
            None
        } else {
            Some(TensorArena::new(
                dev.buffer_type(),
                BufferUsage::Weights,
                &specs,
            )?)
        };
        if let Some(arena) = &weights {
            for (&gi, &i0) in &first {
                copy_set(spec, file, arena, gi, i0, &plan.sets[gi])?;
            }
        }
        let most = super::host::pad_picks(most_tokens * spec.hp.n_expert_used);
        let io = super::host::PickRows::alloc(dev.buffer_type(), spec.hp.n_embd, most, "hot")?;
        Ok(HotPool {
            plan,
            counted: None,
            weights,
            first,
            io,
        })
    }

    /// Replaces the hot sets with `next`'s (`paging::refresh_hot`: the
    /// same sizes), copying the experts of the `changed` groups from the
    /// model file. The device must not be computing with the pool.
    pub(super) fn refill(
        &mut self,
        spec: &ModelSpec,
        file: &ModelFile,
        next: HotPlan,
        changed: &[usize],
    ) -> Result<u64, EngineError> {
        let mut bytes = 0u64;
        if let Some(arena) = &self.weights {
            for &gi in changed {
                let (Some(&i0), Some(set)) = (self.first.get(&gi), next.sets.get(gi)) else {
                    continue;
                };
                if set.len() != self.plan.sets[gi].len() {
                    return Err(EngineError::Unsupported(
                        "a refreshed hot set must keep its size",
                    ));
                }
                bytes += copy_set(spec, file, arena, gi, i0, set)?;
            }
        }
        self.plan = next;
        Ok(bytes)
    }
}

/// Copies the experts `set` (ascending) of group `gi` from the model file
/// into its compact tensors, the first at `i0` of `arena`. Returns the
/// bytes copied.
fn copy_set(
    spec: &ModelSpec,
    file: &ModelFile,
    arena: &TensorArena,
    gi: usize,
    i0: usize,
    set: &[u32],
) -> Result<u64, EngineError> {
    let mut n = 0u64;
    let ws = spec.groups[gi]
        .weights
        .iter()
        .filter(|w| w.role.is_some_and(|r| r.is_expert()));
    for (j, w) in ws.enumerate() {
        let bytes = file.bytes(w);
        let per = bytes.len() / w.ne[2].max(1) as usize;
        let t = arena.tensor(i0 + j);
        for (k, &e) in set.iter().enumerate() {
            let e = e as usize;
            t.set_bytes(&bytes[e * per..(e + 1) * per], k * per)?;
            n += per as u64;
        }
    }
    Ok(n)
}
