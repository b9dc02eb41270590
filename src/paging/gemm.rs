//! The matmul path per step size. ggml multiplies quantized weights with its
//! own kernels (MMQ), which on an H100 reach about a fifth of the GPU's
//! 16-bit tensor-core rate; dequantizing a weight to BF16 and handing the
//! product to cuBLAS costs a pass over the weight but multiplies at the
//! tensor cores' rate, so it wins above some number of rows. That number
//! comes from a probe on the machine (`engine::probe::matmul_paths`): the
//! same product timed both ways at several step sizes. This file decides
//! from that table and sizes the scratch the GEMM path takes. Plain Rust.

use super::plan::Plan;
use crate::dtype::GgmlType;
use crate::model::Hparams;

/// One row of the probe: seconds of one product of `rows` rows through
/// ggml's quantized kernels and through dequantize + 16-bit GEMM.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PathTiming {
    pub rows: u32,
    pub mmq_s: f64,
    pub gemm_s: f64,
}

/// GEMM must beat MMQ by this factor to be chosen: a path that only ties
/// costs its scratch for nothing.
const MARGIN: f64 = 0.97;

/// The most rows a product may have and stay on MMQ: every product with
/// more rows goes through GEMM. GEMM is chosen from the smallest probed
/// size at and above which it is faster at every probed size (so one
/// noisy size cannot switch a range on); the limit is the largest probed
/// size below that, or one less than the smallest probed size when GEMM
/// wins everywhere. None: MMQ at every size (GEMM never wins at the
/// largest).
pub fn choose_mmq_max_rows(table: &[PathTiming]) -> Option<u32> {
    let mut t: Vec<PathTiming> = table
        .iter()
        .copied()
        .filter(|p| p.rows > 0 && p.mmq_s.is_finite() && p.gemm_s.is_finite())
        .collect();
    t.sort_by_key(|p| p.rows);
    let wins = |p: &PathTiming| p.gemm_s < p.mmq_s * MARGIN;
    // the first index from which GEMM wins at every larger size
    let first = t.iter().rposition(|p| !wins(p)).map_or(0, |i| i + 1);
    if first == t.len() {
        return None;
    }
    Some(match first {
        0 => t[0].rows - 1,
        i => t[i - 1].rows,
    })
}

/// Whether the GEMM path pays at steps of `n` rows: its plan (the scratch
/// taken from the budget, so fewer groups resident, and GEMM's compute
/// rate) predicts a step at least `MARGIN` faster than the plan without it.
/// Where a large step is bound by the bus either way (a tight budget, a
/// step of a few hundred rows), the scratch only costs resident groups.
/// A plan with GEMM that is no slower and streams no more a step pays too:
/// without GEMM ggml's own memory for the quantized kernels can outweigh
/// the scratch (a mixture's at 8G: 246 MiB outside strata's buffers
/// against 34 and the 114 MiB scratch, so 128 MiB more streamed a step,
/// and 64 sequences 389-422 t/s against 448-465 with GEMM: runs 236-238).
pub fn pays(with: &Plan, without: &Plan, n: u32) -> bool {
    let (a, b) = (with.floor_s(n), without.floor_s(n));
    a < b * MARGIN || (a <= b && with.streamed_bytes_per_step <= without.streamed_bytes_per_step)
}

/// Device memory the GEMM path takes outside strata's buffers, in ggml's
/// memory pool: the largest weight matrix dequantized to 16 bits and a
/// step's activations converted to 16 bits (at most `n_batch` rows of the
/// widest input, the FFN's `n_ff`), plus cuBLAS's own, with 5% for the
/// pool's rounding. `largest_matrix` counts elements.
pub fn scratch_bytes(hp: &Hparams, n_batch: u32, largest_matrix: u64) -> u64 {
    let widest = hp.n_embd.max(hp.n_embd_q()).max(hp.n_ff) as u64;
    let half = 2;
    (largest_matrix * half + n_batch as u64 * widest * half) * 21 / 20
        + super::outside::CUBLAS_BYTES
}

/// Where a group's weights go in the widened copy (see [`Widened`]):
/// each quantized matrix at a 256-byte-aligned offset, its elements as
/// BF16; None for a weight that stays as it is (norms, biases, F32 or
/// 16-bit weights, an expert stack).
pub fn widened_offsets(weights: &[(GgmlType, [i64; 4])]) -> (Vec<Option<u64>>, u64) {
    let mut end = 0u64;
    let offsets = weights
        .iter()
        .map(|&(ty, ne)| {
            widens(ty, ne).then(|| {
                let at = end;
                end += (ne[0] * ne[1]) as u64 * 2;
                end = end.next_multiple_of(WIDEN_ALIGN);
                at
            })
        })
        .collect();
    (offsets, end)
}

/// Whether a weight of type `ty` and shape `ne` (ggml order, unused
/// dims 1) goes into the widened copy: a quantized matrix.
pub fn widens(ty: GgmlType, ne: [i64; 4]) -> bool {
    ne[1] > 1 && ne[2] == 1 && ne[3] == 1 && ty.block_size().is_some_and(|b| b > 1)
}

/// Offsets in the widened copy are multiples of this (ggml's CUDA
/// buffers align tensors to 128 bytes; 0004's dequantizing kernel needs
/// 16).
const WIDEN_ALIGN: u64 = 256;

/// The row split's halved steps (`engine::rows`) multiply each weight of
/// a group twice, once per half of the step's rows, and on the GEMM path
/// each product dequantized the weight again (54 of a 346 ms pp2048 step
/// on each of two H200s, docs/device-runs.md run 114). Widening
/// dequantizes a group's weights once into a device buffer of
/// `bytes` (the largest group's BF16 matrices), which both halves
/// multiply through the same cuBLAS call: bit for bit the product of the
/// quantized weight above the row limit.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Widened {
    /// Device bytes of the copy: the largest group's.
    pub bytes: u64,
    /// Steps whose smaller half has more rows than this widen (the
    /// halves' products would otherwise go through ggml's quantized
    /// kernels, which the copy does not reproduce).
    pub min_half_rows: u32,
}

impl Widened {
    /// The copy for a model's groups (each a list of its weights' types
    /// and shapes) on the GEMM path above `mmq_max_rows`; None where no
    /// group has a quantized matrix, or where no half of an `n_batch`
    /// step would have more rows than the limit.
    pub fn plan<'a>(
        groups: impl IntoIterator<Item = &'a [(GgmlType, [i64; 4])]>,
        mmq_max_rows: u32,
        n_batch: u32,
    ) -> Option<Widened> {
        let bytes = groups
            .into_iter()
            .map(|g| widened_offsets(g).1)
            .max()
            .unwrap_or(0);
        (bytes > 0 && n_batch / 2 > mmq_max_rows).then_some(Widened {
            bytes,
            min_half_rows: mmq_max_rows + 1,
        })
    }

    /// Whether a step cut in halves of `a` and `b` rows widens.
    pub fn applies(&self, a: u32, b: u32) -> bool {
        a.min(b) >= self.min_half_rows
    }
}

#[cfg(test)]
mod tests {
    use super::super::plan::ComputeRate;
    use super::*;

    #[test]
    fn widened_copy_holds_the_largest_groups_quantized_matrices() {
        let q = GgmlType::Q4_0;
        let attn = [
            (GgmlType::F32, [8192, 1, 1, 1]),   // a norm stays
            (q, [8192, 4096, 1, 1]),            // 64 MiB as BF16
            (q, [96, 3, 1, 1]),                 // 576 bytes, 768 with alignment
            (GgmlType::F16, [8192, 512, 1, 1]), // 16-bit already
            (q, [8192, 512, 1, 1]),
        ];
        let (off, end) = widened_offsets(&attn);
        let third = (64 << 20) + 768;
        assert_eq!(off, vec![None, Some(0), Some(64 << 20), None, Some(third)]);
        assert_eq!(end, third + 8192 * 512 * 2);
        let ffn = [(q, [8192, 14336, 1, 1]), (q, [14336, 8192, 1, 1])];
        let experts = [(q, [2048, 768, 128, 1])];
        let groups: [&[(GgmlType, [i64; 4])]; 3] = [&attn, &ffn, &experts];
        let w = Widened::plan(groups, 128, 2048).expect("widens");
        assert_eq!(w.bytes, 2 * 8192 * 14336 * 2);
        assert!(w.applies(1024, 1024) && w.applies(129, 2000));
        assert!(!w.applies(128, 2000));
        // halves of a 256-row batch never leave the quantized kernels
        assert_eq!(Widened::plan(groups, 128, 256), None);
        // an expert stack alone has nothing to widen
        assert_eq!(Widened::plan([&experts[..]], 128, 2048), None);
    }

    fn row(rows: u32, mmq_s: f64, gemm_s: f64) -> PathTiming {
        PathTiming {
            rows,
            mmq_s,
            gemm_s,
        }
    }

    #[test]
    fn gemm_from_the_crossover_up() {
        // shaped like an H100 70B FFN matrix: MMQ ahead while the
        // dequantize pass dominates, GEMM ahead from 256 rows
        let t = [
            row(64, 1.0, 3.0),
            row(128, 2.0, 3.2),
            row(256, 4.0, 3.5),
            row(512, 8.0, 4.5),
            row(2048, 30.0, 14.0),
        ];
        assert_eq!(choose_mmq_max_rows(&t), Some(128));
        // order does not matter
        let mut r = t;
        r.reverse();
        assert_eq!(choose_mmq_max_rows(&r), Some(128));
    }

    #[test]
    fn one_noisy_size_does_not_switch_a_range() {
        let t = [
            row(64, 1.0, 0.5), // a fluke
            row(128, 2.0, 3.2),
            row(512, 8.0, 4.5),
            row(2048, 30.0, 14.0),
        ];
        assert_eq!(choose_mmq_max_rows(&t), Some(128));
    }

    #[test]
    fn mmq_everywhere_when_gemm_loses_at_the_top() {
        let t = [row(64, 1.0, 3.0), row(512, 8.0, 4.5), row(2048, 30.0, 31.0)];
        assert_eq!(choose_mmq_max_rows(&t), None);
        // a tie is not a win
        assert_eq!(choose_mmq_max_rows(&[row(2048, 30.0, 29.5)]), None);
        assert_eq!(choose_mmq_max_rows(&[]), None);
    }

    #[test]
    fn gemm_everywhere_when_it_wins_at_the_smallest_size() {
        let t = [row(32, 1.0, 0.5), row(512, 8.0, 4.5)];
        assert_eq!(choose_mmq_max_rows(&t), Some(31));
    }

    #[test]
    fn unmeasured_sizes_are_ignored() {
        let t = [
            row(64, f64::NAN, 0.1),
            row(512, 8.0, 4.5),
            row(2048, f64::INFINITY, 1.0),
        ];
        assert_eq!(choose_mmq_max_rows(&t), Some(511));
    }

    fn placed(copy_s: f64, compute_s_per_byte: f64) -> Plan {
        Plan {
            resident: vec![],
            slots: (0, 0),
            resident_bytes: 0,
            slot_bytes: 0,
            streamed_bytes_per_step: 0,
            fixed_bytes: 0,
            predicted_copy_s: copy_s,
            compute: Some(ComputeRate {
                s_per_byte_1: 0.0,
                s_per_byte_n: compute_s_per_byte,
                n: 512,
            }),
            groups: vec![crate::paging::GroupInfo::dense(
                crate::model::GroupKind::Ffn,
                1000,
            )],
            hybrid: None,
            resident_by_cost: false,
        }
    }

    #[test]
    fn gemm_pays_only_where_a_large_step_is_compute_bound() {
        // bus-bound either way: the scratch costs copies, nothing is won
        // (70B at 12G, 512-token steps: 0.609 s against 0.587 s)
        assert!(!pays(&placed(0.609, 2.5e-4), &placed(0.587, 3.3e-4), 512));
        // compute-bound with MMQ (70B at 12G, 2048-token steps)
        assert!(pays(&placed(0.556, 5.1e-4), &placed(0.543, 1.3e-3), 512));
        // all resident: no copies at all
        assert!(pays(&placed(0.0, 5.0e-4), &placed(0.0, 1.3e-3), 512));
        // under the margin, but no slower and streaming less: the plan
        // without GEMM holds more of ggml's memory (run 238: 214.4 ms
        // against 218.4, 11262 MiB streamed a step against 11390)
        let streams = |mut p: Plan, mib: u64| {
            p.streamed_bytes_per_step = mib << 20;
            p
        };
        let (with, without) = (placed(0.2144, 0.0), placed(0.2184, 0.0));
        assert!(pays(
            &streams(with.clone(), 11262),
            &streams(without.clone(), 11390),
            2048
        ));
        // streaming more, it must beat the margin
        assert!(!pays(
            &streams(with, 11390),
            &streams(without.clone(), 11262),
            2048
        ));
        // and never where it is slower
        assert!(!pays(
            &streams(placed(0.22, 0.0), 11000),
            &streams(without, 11390),
            2048
        ));
    }

    #[test]
    fn scratch_holds_the_largest_matrix_and_a_step_in_16_bits() {
        let hp = crate::paging::testutil::hparams_70b();
        // 70B: FFN matrices of 8192 x 28672
        let m = 8192u64 * 28672;
        let s = scratch_bytes(&hp, 2048, m);
        let need = 2 * m + 2 * 2048 * 28672;
        assert!(s >= need + (32 << 20));
        assert!(s < need * 11 / 10 + super::super::outside::CUBLAS_BYTES);
        // fewer rows, less scratch
        assert!(scratch_bytes(&hp, 512, m) < s);
    }
}
