//! Several devices: which layers each one computes (the layer split).
//!
//! A model split across devices runs as a chain of parts, each a range of
//! consecutive layers on one device with its own memory plan, slot rings
//! and link (the engine's `Engine::load`); the residual stream hops from one
//! device to the next between parts, and the last part computes the output
//! head. This file decides the ranges. Each device gets a share of the
//! weights in proportion to its budget, so every device keeps the same
//! share of its layers resident and streams the same share over its own
//! link. Where the devices are not named (`--devices`), only as many of the
//! first devices are used as the model needs: a model that fits on one
//! device runs there without hops.

use std::ops::Range;

/// Why the layers could not be split.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DeviceSplitError {
    #[error("no device to place the layers on")]
    NoDevice,
    #[error("the model has no layers")]
    NoLayers,
    #[error("device {0}'s budget is 0 bytes")]
    ZeroBudget(usize),
    #[error("the row split over {devices} devices needs a KV head and {align} FFN columns for each, and the model has {n_head_kv} KV heads and {n_ff} FFN columns (use --split-mode layer)")]
    TooFewRows {
        devices: usize,
        n_head_kv: u32,
        n_ff: u32,
        align: u32,
    },
}

/// The layer ranges of the devices used, in device order (device `i`
/// computes `ranges[i]`; devices past `ranges.len()` are not used).
/// `layer_bytes[l]`: what layer `l` holds on a device (weights and KV);
/// `head_bytes`: the output head, on the last device used; `budgets`: each
/// device's memory; `slow[i]`: device `i`'s link is too slow to stream
/// weights over at every step (a remote device: an RPC socket), so its
/// range is kept within its budget where the other devices can take the
/// rest; `use_all`: the devices were named, use every one (at most one
/// per layer), else the fewest first devices whose budgets hold the whole
/// model (all of them where none do).
pub fn split_layers(
    layer_bytes: &[u64],
    head_bytes: u64,
    budgets: &[u64],
    slow: &[bool],
    use_all: bool,
) -> Result<Vec<Range<u32>>, DeviceSplitError> {
    if budgets.is_empty() {
        return Err(DeviceSplitError::NoDevice);
    }
    if layer_bytes.is_empty() {
        return Err(DeviceSplitError::NoLayers);
    }
    if let Some(i) = budgets.iter().position(|&b| b == 0) {
        return Err(DeviceSplitError::ZeroBudget(i));
    }
    let n_layer = layer_bytes.len();
    let total = layer_bytes.iter().sum::<u64>() + head_bytes;
    let k = if use_all {
        budgets.len()
    } else {
        let mut sum = 0u64;
        budgets
            .iter()
            .position(|&b| {
                sum = sum.saturating_add(b);
                sum >= total
            })
            .map_or(budgets.len(), |i| i + 1)
    }
    .min(n_layer);
    let budgets = &budgets[..k];
    let is_slow = |i: usize| slow.get(i).copied().unwrap_or(false);
    // each device's share of the bytes: in proportion to the budgets; where
    // that overfills a slow device while a fast one is used, the slow one
    // keeps only what its budget holds and the fast ones share the rest
    let b_total: f64 = budgets.iter().map(|&b| b as f64).sum();
    let mut share: Vec<f64> = budgets
        .iter()
        .map(|&b| total as f64 * b as f64 / b_total)
        .collect();
    let fast_budget: f64 = (0..k)
        .filter(|&i| !is_slow(i))
        .map(|i| budgets[i] as f64)
        .sum();
    if fast_budget > 0.0 {
        let mut spill = 0.0;
        for i in (0..k).filter(|&i| is_slow(i)) {
            let cap = budgets[i] as f64;
            if share[i] > cap {
                spill += share[i] - cap;
                share[i] = cap;
            }
        }
        for i in (0..k).filter(|&i| !is_slow(i)) {
            share[i] += spill * budgets[i] as f64 / fast_budget;
        }
    }
    // cumulative bytes before each layer boundary
    let mut cum = Vec::with_capacity(n_layer + 1);
    cum.push(0u64);
    for &b in layer_bytes {
        cum.push(cum.last().unwrap() + b);
    }
    let mut ranges = Vec::with_capacity(k);
    let mut start = 0usize;
    let mut before = 0.0;
    for i in 0..k {
        let end = if i + 1 == k {
            n_layer
        } else {
            before += share[i];
            // the boundary nearest the target (for a slow device beside a
            // fast one, the last one within its budget), leaving every
            // device a layer
            let lo = start + 1;
            let hi = n_layer - (k - 1 - i);
            if is_slow(i) && fast_budget > 0.0 {
                let target = before.min(cum[start] as f64 + budgets[i] as f64);
                (lo..=hi)
                    .rev()
                    .find(|&x| cum[x] as f64 <= target + 0.5)
                    .unwrap_or(lo)
            } else {
                (lo..=hi)
                    .min_by(|&x, &y| {
                        let dx = (cum[x] as f64 - before).abs();
                        let dy = (cum[y] as f64 - before).abs();
                        dx.total_cmp(&dy)
                    })
                    .unwrap_or(lo)
            }
        };
        ranges.push(start as u32..end as u32);
        start = end;
    }
    Ok(ranges)
}

/// The row split: device `i`'s share of every layer, `kv[i]` of its KV
/// heads (with the query heads that share them) and `ff[i]` of its FFN
/// columns, in proportion to `weights` (the budgets), every device at least
/// one head and one `ff_align` of columns (the down projection's
/// quantization block: its rows are cut across).
#[derive(Clone, Debug, PartialEq)]
pub struct RowSplit {
    pub kv: Vec<Range<u32>>,
    pub ff: Vec<Range<u32>>,
}

pub fn split_rows(
    n_head_kv: u32,
    n_ff: u32,
    ff_align: u32,
    weights: &[u64],
) -> Result<RowSplit, DeviceSplitError> {
    let k = weights.len();
    if k == 0 {
        return Err(DeviceSplitError::NoDevice);
    }
    if let Some(i) = weights.iter().position(|&b| b == 0) {
        return Err(DeviceSplitError::ZeroBudget(i));
    }
    let align = ff_align.max(1);
    let units = n_ff / align;
    if n_head_kv < k as u32 || units < k as u32 || !n_ff.is_multiple_of(align) {
        return Err(DeviceSplitError::TooFewRows {
            devices: k,
            n_head_kv,
            n_ff,
            align,
        });
    }
    let ff = proportional(units, weights)
        .into_iter()
        .map(|r| r.start * align..r.end * align)
        .collect();
    Ok(RowSplit {
        kv: proportional(n_head_kv, weights),
        ff,
    })
}

/// `n` units cut into consecutive ranges in proportion to `weights`, each
/// at least one unit (`n >= weights.len()`).
fn proportional(n: u32, weights: &[u64]) -> Vec<Range<u32>> {
    let k = weights.len() as u32;
    let total: f64 = weights.iter().map(|&w| w as f64).sum();
    let mut out = Vec::with_capacity(weights.len());
    let (mut start, mut cum) = (0u32, 0.0);
    for (i, &w) in weights.iter().enumerate() {
        cum += w as f64;
        let i = i as u32;
        let end = if i + 1 == k {
            n
        } else {
            // the nearest boundary, leaving a unit to this device and to
            // each after it
            ((n as f64 * cum / total).round() as u32).clamp(start + 1, n - (k - 1 - i))
        };
        out.push(start..end);
        start = end;
    }
    out
}

/// Splits `total` bytes (a host budget) between parts in proportion to
/// `weights` (their streamed bytes, say); every part gets something.
pub fn share(total: u64, weights: &[u64]) -> Vec<u64> {
    let sum: u128 = weights.iter().map(|&w| u128::from(w.max(1))).sum();
    weights
        .iter()
        .map(|&w| (u128::from(total) * u128::from(w.max(1)) / sum.max(1)) as u64)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_model_that_fits_on_the_first_device_stays_there() {
        let layers = vec![10u64; 8];
        let one: Vec<Range<u32>> = std::iter::once(0..8).collect();
        assert_eq!(split_layers(&layers, 5, &[100, 100], &[], false), Ok(one));
        // named devices are all used
        assert_eq!(
            split_layers(&layers, 5, &[100, 100], &[], true),
            Ok(vec![0..4, 4..8])
        );
        // too big for one: both, in proportion to the budgets
        assert_eq!(
            split_layers(&layers, 0, &[60, 20], &[], false),
            Ok(vec![0..6, 6..8])
        );
    }

    #[test]
    fn refuses_what_cannot_be_split() {
        assert_eq!(
            split_layers(&[1, 2], 0, &[], &[], true),
            Err(DeviceSplitError::NoDevice)
        );
        assert_eq!(
            split_layers(&[], 0, &[1], &[], true),
            Err(DeviceSplitError::NoLayers)
        );
        assert_eq!(
            split_layers(&[1], 0, &[1, 0], &[], true),
            Err(DeviceSplitError::ZeroBudget(1))
        );
        // more devices than layers: one layer each, the rest unused
        assert_eq!(
            split_layers(&[1, 1], 0, &[9, 9, 9], &[], true),
            Ok(vec![0..1, 1..2])
        );
    }

    #[test]
    fn a_slow_device_keeps_what_its_budget_holds() {
        let layers = vec![10u64; 20];
        // 200 bytes over budgets of 160 stream either way: in proportion the
        // remote device (second) would take 75 and stream 15 over its
        // socket; it keeps the 60 its budget holds, the local GPU the rest
        assert_eq!(
            split_layers(&layers, 0, &[100, 60], &[false, true], true),
            Ok(vec![0..14, 14..20])
        );
        // first: the same from the front
        assert_eq!(
            split_layers(&layers, 0, &[60, 100], &[true, false], true),
            Ok(vec![0..6, 6..20])
        );
        // only slow devices: in proportion, as nothing else can stream
        assert_eq!(
            split_layers(&layers, 0, &[60, 60], &[true, true], true),
            Ok(vec![0..10, 10..20])
        );
    }

    proptest! {
        /// A slow device beside a fast one never gets more than its budget
        /// holds (a layer at least), and every layer is placed once.
        #[test]
        fn slow_devices_stay_within_their_budgets(
            layers in prop::collection::vec(1u64..1000, 4..100),
            devs in prop::collection::vec((1u64..50_000, any::<bool>()), 2..6),
        ) {
            let budgets: Vec<u64> = devs.iter().map(|d| d.0).collect();
            let mut slow: Vec<bool> = devs.iter().map(|d| d.1).collect();
            slow[0] = false; // a fast device is used
            let r = split_layers(&layers, 0, &budgets, &slow, true).unwrap();
            prop_assert_eq!(r[0].start, 0);
            prop_assert_eq!(r.last().unwrap().end as usize, layers.len());
            for w in r.windows(2) {
                prop_assert_eq!(w[0].end, w[1].start);
            }
            for (i, x) in r.iter().enumerate() {
                prop_assert!(x.start < x.end);
                if slow[i] && i + 1 < r.len() {
                    let got: u64 = layers[x.start as usize..x.end as usize].iter().sum();
                    prop_assert!(x.end == x.start + 1 || got <= budgets[i],
                        "slow device {} holds {} bytes over its {}", i, got, budgets[i]);
                }
            }
        }
    }

    proptest! {
        /// Every layer is placed once, in order, every device used gets a
        /// layer, and each device's share of the bytes is its budget's
        /// share within one layer.
        #[test]
        fn every_layer_placed_once_in_proportion_to_the_budgets(
            layers in prop::collection::vec(1u64..1000, 1..120),
            head in 0u64..2000,
            budgets in prop::collection::vec(1u64..100_000, 1..9),
            use_all in any::<bool>(),
        ) {
            let r = split_layers(&layers, head, &budgets, &[], use_all).unwrap();
            prop_assert!(!r.is_empty() && r.len() <= budgets.len().min(layers.len()));
            prop_assert_eq!(r[0].start, 0);
            prop_assert_eq!(r.last().unwrap().end as usize, layers.len());
            for w in r.windows(2) {
                prop_assert_eq!(w[0].end, w[1].start);
            }
            for x in &r {
                prop_assert!(x.start < x.end);
            }
            if use_all {
                prop_assert_eq!(r.len(), budgets.len().min(layers.len()));
            }
            // proportion, where no device is squeezed to its one layer
            let total: u64 = layers.iter().sum::<u64>() + head;
            let used = &budgets[..r.len()];
            let b_total: f64 = used.iter().map(|&b| b as f64).sum();
            let max_layer = *layers.iter().max().unwrap() as f64;
            if layers.len() >= 4 * r.len() {
                let mut cum_b = 0.0;
                for (i, x) in r.iter().enumerate().take(r.len() - 1) {
                    cum_b += used[i] as f64;
                    let target = total as f64 * cum_b / b_total;
                    let got: u64 = layers[..x.end as usize].iter().sum();
                    let squeezed = x.end as usize == x.start as usize + 1
                        || x.end as usize == layers.len() - (r.len() - 1 - i);
                    prop_assert!(squeezed || (got as f64 - target).abs() <= max_layer,
                        "device {} ends at {} bytes against {:.0}", i, got, target);
                }
            }
            // not named: fewer devices only where they hold the model
            if !use_all && r.len() < budgets.len().min(layers.len()) {
                prop_assert!(used.iter().sum::<u64>() >= total);
            }
        }

        /// The row split places every KV head and FFN column once, on
        /// consecutive ranges, at least a head and an aligned unit of
        /// columns per device, in proportion to the budgets within one
        /// unit.
        #[test]
        fn every_head_and_column_placed_once_in_proportion(
            n_head_kv in 1u32..129,
            units in 1u32..2000,
            align in prop::sample::select(vec![1u32, 32, 256]),
            weights in prop::collection::vec(1u64..100_000, 1..9),
        ) {
            let n_ff = units * align;
            let k = weights.len() as u32;
            let r = split_rows(n_head_kv, n_ff, align, &weights);
            if n_head_kv < k || units < k {
                let refused = matches!(r, Err(DeviceSplitError::TooFewRows { .. }));
                prop_assert!(refused);
                return Ok(());
            }
            let r = r.unwrap();
            let total: f64 = weights.iter().map(|&w| w as f64).sum();
            for (ranges, n, unit) in [(&r.kv, n_head_kv, 1), (&r.ff, n_ff, align)] {
                prop_assert_eq!(ranges.len(), weights.len());
                prop_assert_eq!(ranges[0].start, 0);
                prop_assert_eq!(ranges.last().unwrap().end, n);
                let mut cum = 0.0;
                for (i, x) in ranges.iter().enumerate() {
                    prop_assert!(x.end >= x.start + unit);
                    prop_assert!(x.start.is_multiple_of(unit) && x.end.is_multiple_of(unit));
                    if i > 0 {
                        prop_assert_eq!(ranges[i - 1].end, x.start);
                    }
                    cum += weights[i] as f64;
                    let target = f64::from(n) * cum / total;
                    let squeezed = x.end == x.start + unit
                        || x.end == n - (k - 1 - i as u32) * unit;
                    prop_assert!(squeezed || (f64::from(x.end) - target).abs() <= f64::from(unit),
                        "device {} ends at {} against {:.1}", i, x.end, target);
                }
            }
        }

        #[test]
        fn shares_add_up_to_at_most_the_total(
            total in 0u64..1 << 40,
            w in prop::collection::vec(0u64..1 << 36, 1..9),
        ) {
            let s = share(total, &w);
            prop_assert_eq!(s.len(), w.len());
            prop_assert!(s.iter().sum::<u64>() <= total);
            prop_assert!(s.iter().sum::<u64>() + w.len() as u64 >= total);
        }
    }
}
