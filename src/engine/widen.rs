//! The row split's widened copy on a GPU (`paging::gemm::Widened`): where
//! a step is computed in two halves of rows (`exchange::Halves`) and both
//! halves' products go through cuBLAS, each product dequantized its
//! weight again, so every weight was dequantized twice a step. Here a
//! group's quantized matrices are copied into a BF16 buffer once, on the
//! compute stream before the first half (`graph::build_widen`), and both
//! halves multiply the copy: the same cuBLAS call on the same BF16 values,
//! so the same results. The buffer is reused group after group: the next
//! group's copy is queued after this group's halves on the same stream.

use super::buffers::WidenedGroup;
use super::error::EngineError;
use super::state::Engine;
use super::step::BoundGroup;
use super::timeline;
use crate::dtype::GgmlType;
use crate::ggml::Binding;
use crate::graph::{StepShape, TemplateKey};
use crate::model::GroupId;

impl Engine {
    /// Whether a group computed in halves `a` and `b` is widened first.
    pub(super) fn widens(&self, gi: GroupId, [a, b]: [StepShape; 2]) -> bool {
        self.halves
            .as_ref()
            .and_then(|h| h.widening.as_ref())
            .is_some_and(|w| {
                w.plan.applies(a.n_tokens, b.n_tokens)
                    && w.offsets[gi.index()].iter().any(Option::is_some)
            })
    }

    /// Queues the copy of a begun group's quantized matrices into the
    /// widened buffer, and returns what its halves' templates bind.
    pub(super) fn widen_group(&mut self, g: &BoundGroup) -> Result<WidenedGroup, EngineError> {
        let gi = g.group();
        let w = self
            .halves
            .as_ref()
            .and_then(|h| h.widening.as_ref())
            .expect("widens() said so");
        let offsets = &w.offsets[gi.index()];
        // the widened template's signature and weights: the copies (BF16)
        // where widened, the group's own elsewhere; the widening graph's:
        // the widened matrices, then their copies
        let sig = self.spec.groups[gi.index()].signature();
        let (mut matrices, mut sources, mut targets) = (Vec::new(), Vec::new(), Vec::new());
        let mut out = WidenedGroup {
            sig: Vec::with_capacity(sig.len()),
            weights: Vec::with_capacity(sig.len()),
        };
        for ((&(role, ty), b), o) in sig.iter().zip(g.weights()).zip(offsets) {
            if let Some(o) = *o {
                let copy = Binding::at(&w.buffer, o as usize)?;
                matrices.push((role, ty));
                sources.push(b.clone());
                targets.push(copy.clone());
                out.sig.push((role, GgmlType::BF16));
                out.weights.push(copy);
            } else {
                out.sig.push((role, ty));
                out.weights.push(b.clone());
            }
        }
        sources.extend(targets);
        let key = TemplateKey::Widen {
            matrices,
            instance: gi.index() as u32,
        };
        self.templates.get(&key)?.bind(g.id(), &sources, None)?;
        let t = self.templates.allocated(&key, &self.backend)?;
        let rec = self.rec.scope(
            timeline::Stream::Compute,
            &self.backend,
            || {
                format!(
                    "widen {} {}",
                    gi.kind().name(),
                    gi.layer() + self.spec.hp.layer0
                )
            },
            0,
        );
        self.backend.compute_async(&t.graph())?;
        drop(rec);
        Ok(out)
    }
}
