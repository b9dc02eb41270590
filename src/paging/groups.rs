//! What placement knows about one layer group, and sizes over groups.

use crate::model::GroupKind;

/// What the planner knows about one layer group.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GroupInfo {
    pub kind: GroupKind,
    /// Bytes the group occupies in a slot (device alloc sizes, padded).
    pub bytes: u64,
}

/// The largest group of `kind` (0 when there is none).
pub(super) fn max_bytes(groups: &[GroupInfo], kind: GroupKind) -> u64 {
    groups
        .iter()
        .filter(|g| g.kind == kind)
        .map(|g| g.bytes)
        .max()
        .unwrap_or(0)
}
