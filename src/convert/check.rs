//! Checking a GGUF file against the strata layout.
//!
//! A file is strata-aligned when its alignment is a multiple of 4096, every
//! (layer, group) is one run of consecutive tensors starting on a 4096
//! boundary, and `strata.*` metadata is present and agrees with the tensors
//! actually in the file (declared offset = first tensor's offset, declared
//! size = span to the last tensor's end rounded up to 4096, inside the
//! file). Only such extents may be read as one piece: the engine should call
//! [`read_group_extents`], which returns them only when all of this holds.

use super::error::ConvertError;
use super::error::Result;
use super::layout::Extent;
use super::layout::KEY_ALIGNMENT;
use super::layout::KEY_GROUP_OFFSETS;
use super::layout::KEY_GROUP_SIZES;
use super::layout::KEY_LAYOUT;
use super::layout::LAYOUT_NAME;
use super::layout::STRATA_ALIGNMENT;
use crate::gguf::{Array, GgufFile, Value};
use crate::model::{GroupKind, ModelSpec};
use std::collections::HashMap;

/// One group as found in the file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupReport {
    pub layer: u32,
    pub kind: GroupKind,
    /// Absolute offset of the group's first tensor.
    pub offset: u64,
    /// From the first tensor's start to the last tensor's end.
    pub span: u64,
    /// Sum of the tensor sizes (no padding).
    pub bytes: u64,
    pub n_tensors: usize,
    /// Whether the group's tensors are consecutive in the file.
    pub contiguous: bool,
}

/// What [`check_layout`] found.
#[derive(Clone, Debug)]
pub struct LayoutReport {
    pub alignment: u64,
    pub groups: Vec<GroupReport>,
    /// The extents `strata.*` declares, when present and well-formed.
    pub declared: Option<Vec<Extent>>,
    /// Every reason the file is not strata-aligned; empty when it is.
    pub problems: Vec<String>,
}

impl LayoutReport {
    pub fn is_aligned(&self) -> bool {
        self.problems.is_empty()
    }
}

fn u64_array<'a>(f: &'a GgufFile, key: &str) -> std::result::Result<&'a [u64], String> {
    match f.get(key) {
        Some(Value::Array(Array::U64(v))) => Ok(v),
        Some(v) => Err(format!("{key} is {}, expected array<u64>", v.type_name())),
        None => Err(format!("{key} is missing")),
    }
}

/// Reads the declared extents; `Ok(None)` when the file has no strata
/// metadata at all.
fn declared(f: &GgufFile, n_groups: usize) -> std::result::Result<Option<Vec<Extent>>, String> {
    let Some(layout) = f.get(KEY_LAYOUT) else {
        return Ok(None);
    };
    match layout {
        Value::Str(s) if s == LAYOUT_NAME => {}
        v => return Err(format!("{KEY_LAYOUT} is {v:?}, expected \"{LAYOUT_NAME}\"")),
    }
    match f.get(KEY_ALIGNMENT).and_then(Value::as_integer) {
        Some(a) if a == i128::from(STRATA_ALIGNMENT) => {}
        other => {
            return Err(format!(
                "{KEY_ALIGNMENT} is {other:?}, expected {STRATA_ALIGNMENT}"
            ))
        }
    }
    let offsets = u64_array(f, KEY_GROUP_OFFSETS)?;
    let sizes = u64_array(f, KEY_GROUP_SIZES)?;
    if offsets.len() != n_groups || sizes.len() != n_groups {
        return Err(format!(
            "{KEY_GROUP_OFFSETS}/{KEY_GROUP_SIZES} have {}/{} entries, the model has {n_groups} groups",
            offsets.len(),
            sizes.len()
        ));
    }
    Ok(Some(
        offsets
            .iter()
            .zip(sizes)
            .map(|(&offset, &size)| Extent { offset, size })
            .collect(),
    ))
}

/// Checks `f` (described by `spec`) against the strata layout.
pub fn check_layout(f: &GgufFile, spec: &ModelSpec) -> LayoutReport {
    let mut problems = Vec::new();
    if !f.alignment.is_multiple_of(STRATA_ALIGNMENT) {
        problems.push(format!(
            "alignment is {}, strata needs {STRATA_ALIGNMENT}",
            f.alignment
        ));
    }
    // position of every tensor in file order
    let mut by_offset: Vec<&crate::gguf::TensorInfo> = f.tensors.iter().collect();
    by_offset.sort_by_key(|t| t.offset);
    let rank: HashMap<&str, usize> = by_offset
        .iter()
        .enumerate()
        .map(|(i, t)| (t.name.as_str(), i))
        .collect();
    let mut groups = Vec::with_capacity(spec.groups.len());
    for g in &spec.groups {
        let mut ranks: Vec<usize> = g
            .weights
            .iter()
            .filter_map(|w| rank.get(w.name.as_str()).copied())
            .collect();
        ranks.sort_unstable();
        let contiguous = ranks.windows(2).all(|w| w[1] == w[0] + 1);
        let start = g.weights.iter().map(|w| w.offset).min().unwrap_or(0);
        let end = g
            .weights
            .iter()
            .map(|w| w.offset + w.size)
            .max()
            .unwrap_or(0);
        let name = format!("layer {} {}", g.layer, g.kind.name());
        if !contiguous {
            problems.push(format!(
                "{name}: tensors are interleaved with other tensors"
            ));
        } else if !start.is_multiple_of(STRATA_ALIGNMENT) {
            problems.push(format!(
                "{name}: starts at {start}, not on a {STRATA_ALIGNMENT} boundary"
            ));
        }
        groups.push(GroupReport {
            layer: g.layer,
            kind: g.kind,
            offset: start,
            span: end - start,
            bytes: g.bytes(),
            n_tensors: g.weights.len(),
            contiguous,
        });
    }
    let declared = match declared(f, groups.len()) {
        Ok(Some(d)) => {
            for (g, e) in groups.iter().zip(&d) {
                let want = g.span.next_multiple_of(STRATA_ALIGNMENT);
                if e.offset != g.offset || e.size != want || e.end() > f.file_size {
                    problems.push(format!(
                        "layer {} {}: declared extent [{}, +{}) does not match its tensors [{}, +{want}) or lies past the end of the file",
                        g.layer, g.kind.name(), e.offset, e.size, g.offset
                    ));
                }
            }
            Some(d)
        }
        Ok(None) => {
            problems.push(format!("no strata layout metadata ({KEY_LAYOUT})"));
            None
        }
        Err(e) => {
            problems.push(e);
            None
        }
    };
    LayoutReport {
        alignment: f.alignment,
        groups,
        declared,
        problems,
    }
}

/// The validated group extents of a strata-aligned file (absolute offsets,
/// groups order), `Ok(None)` for a file without strata metadata (use
/// per-tensor reads), and an error naming the problem when the metadata is
/// present but does not match the file.
pub fn read_group_extents(f: &GgufFile, spec: &ModelSpec) -> Result<Option<Vec<Extent>>> {
    if f.get(KEY_LAYOUT).is_none() {
        return Ok(None);
    }
    let r = check_layout(f, spec);
    if !r.is_aligned() {
        return Err(ConvertError::Layout(r.problems.join("; ")));
    }
    Ok(r.declared)
}
