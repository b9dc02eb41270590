//! Layout planning: where each tensor goes in a strata-aligned GGUF.
//!
//! Plain Rust, no I/O. Input: each tensor's [`Slot`] and byte size. Output: a
//! [`Layout`] giving the write order, each tensor's offset relative to the
//! data section and each (layer, group) extent. Invariants (property-tested
//! below):
//!
//! - order: globals (token_embd, output_norm, output, rope_freqs), then for
//!   each layer its attention group then its FFN group, tensors inside a
//!   group in role order, then anything unknown ("extras");
//! - offsets follow the GGUF writer exactly: each tensor starts at the
//!   previous start plus its size rounded up to the alignment;
//! - every group is one contiguous extent holding exactly its own tensors,
//!   starting on the alignment, its size a multiple of it; extents are
//!   disjoint and in groups order (2*layer + kind).

use super::error::ConvertError;
use super::error::Result;
use crate::model::{GroupKind, Role};

/// Value of `strata.layout` for the layout this module writes.
pub const LAYOUT_NAME: &str = "layer-groups-v1";
/// Alignment of every tensor and extent (O_DIRECT block).
pub const STRATA_ALIGNMENT: u64 = 4096;
pub const KEY_LAYOUT: &str = "strata.layout";
pub const KEY_ALIGNMENT: &str = "strata.alignment";
/// Absolute file offset of each group extent, groups order.
pub const KEY_GROUP_OFFSETS: &str = "strata.group_offsets";
/// Byte size of each group extent (a multiple of the alignment).
pub const KEY_GROUP_SIZES: &str = "strata.group_sizes";

/// Whether `key` belongs to the layout (recomputed by every writer):
/// every `strata.*` key but the `strata.synth.*` description of a
/// synthetic model, which a relayout keeps.
pub fn is_layout_key(key: &str) -> bool {
    key.starts_with("strata.") && !key.starts_with("strata.synth.")
}

/// Where a tensor belongs. The derived order is the write order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Slot {
    /// Rank among the globals: token_embd 0, output_norm 1, output 2, rope_freqs 3.
    Global(u8),
    /// A layer group tensor; `rank` is its role's position in the group.
    Group {
        layer: u32,
        kind: GroupKind,
        rank: u8,
    },
    /// A tensor strata does not know; kept after the last layer.
    Extra,
}

/// Every architecture's attention tensors (model/arch/), in write order.
const ATTN_ROLES: [Role; 12] = [
    Role::AttnNorm,
    Role::Wq,
    Role::Bq,
    Role::QNorm,
    Role::Wk,
    Role::Bk,
    Role::KNorm,
    Role::Wv,
    Role::Bv,
    Role::Wo,
    Role::Bo,
    Role::AttnPostNorm,
];
const FFN_ROLES: [Role; 9] = [
    Role::FfnNorm,
    Role::Gate,
    Role::Up,
    Role::Down,
    Role::FfnPostNorm,
    Role::GateInp,
    Role::GateExps,
    Role::UpExps,
    Role::DownExps,
];

impl Slot {
    /// The slot of a GGUF tensor name (llama.cpp naming).
    pub fn of(name: &str) -> Slot {
        match name {
            "token_embd.weight" => return Slot::Global(0),
            "output_norm.weight" => return Slot::Global(1),
            "output.weight" => return Slot::Global(2),
            "rope_freqs.weight" => return Slot::Global(3),
            _ => {}
        }
        let Some(rest) = name.strip_prefix("blk.") else {
            return Slot::Extra;
        };
        let Some((layer, suffix)) = rest.split_once('.') else {
            return Slot::Extra;
        };
        let Ok(layer) = layer.parse::<u32>() else {
            return Slot::Extra;
        };
        for (kind, roles) in [
            (GroupKind::Attn, &ATTN_ROLES[..]),
            (GroupKind::Ffn, &FFN_ROLES[..]),
        ] {
            if let Some(rank) = roles.iter().position(|r| r.suffix() == suffix) {
                let rank = rank as u8;
                return Slot::Group { layer, kind, rank };
            }
        }
        Slot::Extra
    }

    /// Index of the group in `ModelSpec::groups` order, if a group slot.
    pub fn group_index(self) -> Option<usize> {
        match self {
            Slot::Group { layer, kind, .. } => {
                Some(2 * layer as usize + usize::from(kind == GroupKind::Ffn))
            }
            _ => None,
        }
    }
}

/// A byte range; relative to the data section in a [`Layout`], absolute in
/// `strata.group_offsets`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Extent {
    pub offset: u64,
    pub size: u64,
}

impl Extent {
    pub fn end(&self) -> u64 {
        self.offset + self.size
    }
}

/// The planned data section.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    pub alignment: u64,
    /// Input indices in write order.
    pub order: Vec<usize>,
    /// Offset of each input tensor relative to the data section, by input index.
    pub offsets: Vec<u64>,
    /// One extent per group, groups order, relative to the data section.
    pub groups: Vec<Extent>,
    /// Bytes of the whole data section (a multiple of the alignment).
    pub data_size: u64,
}

/// Plans the data section for tensors with the given (slot, size), for a
/// model of `n_layer` layers. Fails if a group slot names a layer past the
/// end or some group has no tensor.
pub fn plan(items: &[(Slot, u64)], n_layer: u32, alignment: u64) -> Result<Layout> {
    if !alignment.is_power_of_two() {
        return Err(ConvertError::Layout(format!(
            "alignment {alignment} is not a power of two"
        )));
    }
    let mut order: Vec<usize> = (0..items.len()).collect();
    order.sort_by_key(|&i| items[i].0); // stable: equal slots keep input order
    let n_groups = 2 * n_layer as usize;
    let mut spans: Vec<Option<(u64, u64)>> = vec![None; n_groups];
    let mut offsets = vec![0u64; items.len()];
    let mut rel = 0u64;
    for &i in &order {
        let (slot, size) = items[i];
        offsets[i] = rel;
        let padded = size
            .checked_next_multiple_of(alignment)
            .and_then(|p| rel.checked_add(p))
            .ok_or_else(|| ConvertError::Layout("data section overflows u64".into()))?;
        if let Some(g) = slot.group_index() {
            let span = spans.get_mut(g).ok_or_else(|| {
                ConvertError::Layout(format!(
                    "tensor #{i} belongs to layer {}, but the model has {n_layer} layers",
                    g / 2
                ))
            })?;
            let start = span.map_or(rel, |s| s.0);
            *span = Some((start, padded));
        }
        rel = padded;
    }
    let mut groups = Vec::with_capacity(n_groups);
    for (g, span) in spans.into_iter().enumerate() {
        let (start, end) = span.ok_or_else(|| {
            let kind = if g % 2 == 0 { "attention" } else { "FFN" };
            ConvertError::Layout(format!("layer {} has no {kind} tensors", g / 2))
        })?;
        groups.push(Extent {
            offset: start,
            size: end - start,
        });
    }
    Ok(Layout {
        alignment,
        order,
        offsets,
        groups,
        data_size: rel,
    })
}

#[cfg(test)]
mod tests {
    /// Every tensor of every architecture has its place in its group's
    /// extent (a missing role would leave the group interleaved with others).
    #[test]
    fn every_architecture_tensor_has_a_slot_in_its_group() {
        use crate::model::arch::ALL;
        for a in ALL {
            let s = a.spec();
            for (kind, ts) in [
                (GroupKind::Attn, s.attn),
                (GroupKind::Ffn, s.ffn),
                (GroupKind::Ffn, s.moe_ffn),
            ] {
                for t in ts {
                    let name = format!("blk.3.{}", t.role.suffix());
                    assert!(
                        matches!(Slot::of(&name), Slot::Group { layer: 3, kind: k, .. } if k == kind),
                        "{}: {name}",
                        a.name()
                    );
                }
            }
        }
    }

    use super::*;
    use proptest::prelude::*;

    #[test]
    fn slots_of_names() {
        assert_eq!(Slot::of("token_embd.weight"), Slot::Global(0));
        assert_eq!(Slot::of("rope_freqs.weight"), Slot::Global(3));
        assert_eq!(
            Slot::of("blk.12.attn_k.bias"),
            Slot::Group {
                layer: 12,
                kind: GroupKind::Attn,
                rank: 5
            }
        );
        // Qwen3's per-head norms sit in their group, after their projection
        assert_eq!(
            Slot::of("blk.0.attn_k_norm.weight"),
            Slot::Group {
                layer: 0,
                kind: GroupKind::Attn,
                rank: 6
            }
        );
        assert_eq!(Slot::of("blk.3.ffn_down.weight").group_index(), Some(7));
        assert_eq!(Slot::of("blk.x.ffn_down.weight"), Slot::Extra);
        assert_eq!(Slot::of("blk.1.attn_qkv.weight"), Slot::Extra);
        assert!(Slot::Global(3) < Slot::of("blk.0.attn_norm.weight"));
        assert!(Slot::of("blk.0.ffn_down.weight") < Slot::of("blk.1.attn_norm.weight"));
    }

    #[test]
    fn empty_group_and_bad_layer_fail() {
        let items = [(Slot::of("blk.0.attn_q.weight"), 10)];
        assert!(
            plan(&items, 1, 4096).is_err(),
            "FFN group of layer 0 missing"
        );
        let items = [
            (Slot::of("blk.0.attn_q.weight"), 10),
            (Slot::of("blk.0.ffn_up.weight"), 10),
            (Slot::of("blk.1.ffn_up.weight"), 10),
        ];
        assert!(plan(&items, 1, 4096).is_err(), "layer 1 of a 1-layer model");
    }

    /// A random model: names of a llama/qwen2-like tensor set with random
    /// sizes, in a random input order.
    fn model() -> impl Strategy<Value = (u32, Vec<(String, u64)>, u64)> {
        (1u32..5, any::<bool>(), any::<bool>(), 0usize..3).prop_flat_map(
            |(n_layer, bias, rope, extras)| {
                let mut names = vec!["token_embd.weight".to_string(), "output_norm.weight".into()];
                if rope {
                    names.push("rope_freqs.weight".into());
                }
                names.push("output.weight".into());
                for l in 0..n_layer {
                    for r in ATTN_ROLES.iter().chain(&FFN_ROLES) {
                        let is_bias = r.suffix().ends_with(".bias");
                        if !is_bias || bias {
                            names.push(format!("blk.{l}.{}", r.suffix()));
                        }
                    }
                }
                for e in 0..extras {
                    names.push(format!("extra.{e}"));
                }
                let n = names.len();
                (
                    Just(n_layer),
                    prop::collection::vec(1u64..20_000, n)
                        .prop_map(move |sizes| names.iter().cloned().zip(sizes).collect::<Vec<_>>())
                        .prop_shuffle(),
                    prop::sample::select(vec![32u64, 256, 4096]),
                )
            },
        )
    }

    proptest! {
        #[test]
        fn plan_invariants((n_layer, tensors, a) in model()) {
            let items: Vec<(Slot, u64)> =
                tensors.iter().map(|(n, s)| (Slot::of(n), *s)).collect();
            let p = plan(&items, n_layer, a).expect("valid model plans");
            // every tensor placed once, in slot order
            let mut seen = p.order.clone();
            seen.sort();
            prop_assert_eq!(seen, (0..items.len()).collect::<Vec<_>>());
            prop_assert!(p.order.windows(2).all(|w| items[w[0]].0 <= items[w[1]].0));
            prop_assert_eq!(&tensors[p.order[0]].0, "token_embd.weight");
            // offsets are what the GGUF writer produces
            let mut rel = 0;
            for &i in &p.order {
                prop_assert_eq!(p.offsets[i], rel);
                rel += items[i].1.next_multiple_of(a);
            }
            prop_assert_eq!(p.data_size, rel);
            // one aligned, contiguous, exclusive extent per group, in order
            prop_assert_eq!(p.groups.len(), 2 * n_layer as usize);
            for (g, e) in p.groups.iter().enumerate() {
                prop_assert_eq!(e.offset % a, 0);
                prop_assert_eq!(e.size % a, 0);
                prop_assert!(e.size > 0);
                if g > 0 {
                    prop_assert!(p.groups[g - 1].end() <= e.offset);
                }
                let mut covered = 0;
                for (i, (slot, size)) in items.iter().enumerate() {
                    let (o, end) = (p.offsets[i], p.offsets[i] + size);
                    let inside = o >= e.offset && end <= e.end();
                    let overlaps = o < e.end() && end > e.offset;
                    prop_assert_eq!(slot.group_index() == Some(g), inside);
                    prop_assert_eq!(inside, overlaps);
                    if inside {
                        covered += size.next_multiple_of(a);
                    }
                }
                prop_assert_eq!(covered, e.size, "no gaps inside an extent");
            }
        }
    }
}
