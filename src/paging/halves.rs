//! A hybrid step in two halves of rows (`--cpu-halves`), plain Rust.
//!
//! In a hybrid step the host CPU's groups sit in the layer chain: the
//! device waits while the CPU computes, and the CPU waits while the device
//! computes. A step of many tokens (64 sequences decoding) can be cut in
//! two halves of rows, A and B, that run the same layers one stage apart:
//! while the CPU computes a group for A, the device computes B's groups up
//! to that group; while the CPU computes it for B, the device runs A on to
//! the next CPU group. The engine (`engine::halves`) executes the stages
//! this module cuts the step's order into:
//!
//! ```text
//! device:  stage0 A | stage0 B | stage1 A       | stage1 B       | ...
//! CPU:              | cpu0 A   | cpu0 B         | cpu1 A         | ...
//! ```
//!
//! A stage's streamed groups stay in their slots from A's use to B's, so
//! each ring must hold a stage's streamed groups with a slot to spare for
//! the uploads ahead; [`plan_halves`] refuses a step where one does not.

use super::ring::Ring;
use std::ops::Range;

/// Steps of fewer tokens run whole: halves of a few rows would each pay
/// the CPU's per-graph cost for little overlap.
pub const HALVES_MIN_TOKENS: u32 = 32;

/// One group of the step's order, as the stages need it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HalfItem {
    /// The host CPU computes it.
    pub cpu: bool,
    /// The weight ring it streams through; None where resident (or on the
    /// CPU).
    pub ring: Option<Ring>,
}

/// A run of the order: the device's groups `device` (indices into the
/// order), then the CPU's group `cpu`, except in the last stage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stage {
    pub device: Range<usize>,
    pub cpu: Option<usize>,
}

/// The stages of `items` (the step's order up to its last layer), or
/// None where halves do not apply: no CPU group, or a stage whose
/// streamed groups of a ring need more than `slots[ring] - 1` slots
/// (`slots`: the attention and FFN rings' slots, 0 where a ring is
/// absent).
pub fn plan_halves(items: &[HalfItem], slots: [usize; 2]) -> Option<Vec<Stage>> {
    if !items.iter().any(|i| i.cpu) {
        return None;
    }
    let mut stages = Vec::new();
    let mut start = 0;
    for (i, it) in items.iter().enumerate() {
        if it.cpu {
            stages.push(Stage {
                device: start..i,
                cpu: Some(i),
            });
            start = i + 1;
        }
    }
    stages.push(Stage {
        device: start..items.len(),
        cpu: None,
    });
    for s in &stages {
        for (r, &n) in slots.iter().enumerate() {
            let held = items[s.device.clone()]
                .iter()
                .filter(|i| i.ring.map(|g| g as usize) == Some(r))
                .count();
            if held > 0 && held + 1 > n {
                return None;
            }
        }
    }
    Some(stages)
}

/// How many of the order's first groups `stages` cover.
pub fn covered(stages: &[Stage]) -> usize {
    stages.last().map_or(0, |s| s.device.end)
}

/// The rows of the first half of a step of `n` tokens: half, in whole
/// tiles of 16 rows where that leaves the second half some.
pub fn first_half(n: u32) -> u32 {
    (n / 2).next_multiple_of(16).min(n - 1).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn item(cpu: bool, ring: Option<Ring>) -> HalfItem {
        HalfItem { cpu, ring }
    }

    #[test]
    fn stages_end_at_each_cpu_group() {
        let d = item(false, None);
        let f = item(false, Some(Ring::Ffn));
        let c = item(true, None);
        let items = [d, f, d, c, d, f, c, d];
        let s = plan_halves(&items, [0, 3]).expect("halves");
        assert_eq!(
            s,
            vec![
                Stage {
                    device: 0..3,
                    cpu: Some(3)
                },
                Stage {
                    device: 4..6,
                    cpu: Some(6)
                },
                Stage {
                    device: 7..8,
                    cpu: None
                },
            ]
        );
        // no CPU group: nothing to overlap
        assert_eq!(plan_halves(&[d, f, d], [0, 3]), None);
        // two streamed FFN groups in a stage need three slots
        assert_eq!(plan_halves(&[f, f, c], [0, 2]), None);
        assert!(plan_halves(&[f, f, c], [0, 3]).is_some());
        // a CPU group first: an empty first stage
        let s = plan_halves(&[c, d], [0, 0]).expect("halves");
        assert_eq!(s[0].device, 0..0);
    }

    #[test]
    fn halves_split_in_tiles() {
        assert_eq!(first_half(64), 32);
        assert_eq!(first_half(40), 32);
        assert_eq!(first_half(33), 16);
        assert_eq!(first_half(2), 1);
        for n in 2..200 {
            let a = first_half(n);
            assert!(a >= 1 && a < n, "{n}: {a}");
        }
    }

    proptest! {
        /// Every group is in exactly one stage, in order; the CPU's groups
        /// end the stages; no stage holds more streamed groups of a ring
        /// than its slots less one.
        #[test]
        fn stages_cover_the_order_once(
            kinds in prop::collection::vec(0u8..4, 1..60),
            attn in 0usize..5,
            ffn in 0usize..8,
        ) {
            let items: Vec<HalfItem> = kinds
                .iter()
                .map(|k| match k {
                    0 => item(true, None),
                    1 => item(false, Some(Ring::Attn)),
                    2 => item(false, Some(Ring::Ffn)),
                    _ => item(false, None),
                })
                .collect();
            let slots = [attn, ffn];
            match plan_halves(&items, slots) {
                None => {
                    // refused only for a reason
                    let cpu = items.iter().any(|i| i.cpu);
                    let mut over = false;
                    let mut held = [0usize; 2];
                    for i in &items {
                        if i.cpu {
                            held = [0, 0];
                            continue;
                        }
                        if let Some(r) = i.ring {
                            held[r as usize] += 1;
                            over |= held[r as usize] + 1 > slots[r as usize];
                        }
                    }
                    prop_assert!(!cpu || over);
                }
                Some(stages) => {
                    let mut next = 0;
                    for (k, s) in stages.iter().enumerate() {
                        prop_assert_eq!(s.device.start, next);
                        next = s.device.end;
                        match s.cpu {
                            Some(c) => {
                                prop_assert_eq!(c, next);
                                prop_assert!(items[c].cpu);
                                next += 1;
                            }
                            None => prop_assert_eq!(k, stages.len() - 1),
                        }
                        prop_assert!(items[s.device.clone()].iter().all(|i| !i.cpu));
                        for (r, &n) in slots.iter().enumerate() {
                            let held = items[s.device.clone()]
                                .iter()
                                .filter(|i| i.ring.map(|g| g as usize) == Some(r))
                                .count();
                            prop_assert!(held == 0 || held < n);
                        }
                    }
                    prop_assert_eq!(next, items.len());
                }
            }
        }
    }
}
