//! The memory plan: one decision, in one place, of where everything lives.
//! From the model's group sizes, the KV cache's shape, the budgets (GPU,
//! DRAM, KV on either) and the measured rates it decides
//! - for every layer group: resident on the GPU, streamed through the slot
//!   ring, or computed by the host CPU at small steps (see [`super::plan`]
//!   and [`super::hybrid`]);
//! - for every layer's KV: on the GPU, or windowed through host frames
//!   (and from there spilled to disk when the frames run out);
//! - for the streamed weights: pinned in host memory, or a window of host
//!   slots over the model file when they exceed the DRAM budget;
//!
//! and predicts the step time. Plain Rust: the engine measures the rates,
//! calls [`memory_plan`] and carries out what it returns.

use super::groups::GroupInfo;
use super::hybrid::CpuInput;
use super::plan;
use super::plan::ComputeRate;
use super::plan::Plan;
use super::plan::PlanError;
use super::plan::PlanInput;
use super::sizes::Activations;
use crate::model::GroupKind;

/// What strata may use of each memory; None: the default of each.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Budgets {
    /// Device bytes; None: everything stays on the device.
    pub gpu: Option<u64>,
    /// Host bytes for the streamed weights and the CPU's copies of its
    /// groups; None: all of them in memory.
    pub dram: Option<u64>,
    /// Device bytes for the KV of layers kept on the device; None: as much
    /// as the GPU budget leaves (see [`kv_resident_layers`]).
    pub kv_gpu: Option<u64>,
    /// Host bytes for the KV frames of windowed layers; None: a frame for
    /// every block of the context.
    pub kv_dram: Option<u64>,
}

/// The sizes of the KV cache.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvShape {
    pub n_layer: usize,
    /// Device bytes of one layer's K and V over the whole context.
    pub layer_bytes: u64,
    /// Blocks of the context (the unit the KV tier moves).
    pub n_blocks: usize,
    /// Host bytes of one block of one layer's K and V.
    pub block_bytes: u64,
    /// Layers attending over a sliding window much shorter than the
    /// context (at most half of it; 0 otherwise). They come last in the
    /// KV order (`Hparams::kv_order`), and when the weights stream their KV
    /// is windowed: such a layer's device KV would hold the whole context
    /// but its attention reads only the window, which is all a windowed
    /// layer uploads.
    pub n_swa_layers: usize,
}

/// Everything a memory plan depends on.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryInput {
    pub groups: Vec<GroupInfo>,
    /// Device bytes needed whatever the placement, the KV cache and the
    /// activations excluded: output head, persistent step inputs.
    pub fixed_bytes: u64,
    pub activations: Activations,
    pub kv: KvShape,
    pub budgets: Budgets,
    /// Host memory available now, for the CPU's copies when no DRAM budget
    /// is given (2 GiB of it stay free).
    pub host_available: u64,
    /// Device slots per streamed group kind (>= 2).
    pub slots: usize,
    /// Stream every group whatever the budget (tests, benchmarks).
    pub stream_all: bool,
    /// Which groups stay resident when not all fit.
    pub resident: super::plan::ResidentOrder,
    /// Measured host-to-device copy bandwidth, bytes/s.
    pub copy_bw: f64,
    /// The device's measured compute speed (None: not measured).
    pub compute: Option<ComputeRate>,
    /// The host CPU as a compute tier (measured); None: the bus alone.
    /// Its `host_room` is decided here, not by the caller.
    pub cpu: Option<CpuInput>,
    /// Large steps multiply through 16-bit GEMM, which takes scratch on
    /// the device (see [`super::gemm`]); None: ggml's kernels at every size.
    pub gemm: Option<GemmPlan>,
    /// What the run takes on the device outside strata's buffers (zero
    /// off CUDA); the plan reserves it with or without the GEMM path.
    pub outside: super::outside::Outside,
}

/// The GEMM path of large steps, as the memory plan reserves it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GemmPlan {
    /// Products of more rows than this go through GEMM.
    pub mmq_max_rows: u32,
    /// Device bytes the path takes outside strata's buffers.
    pub scratch_bytes: u64,
    /// The row split's halved steps dequantize each group once into a
    /// copy of this device's (None: each half dequantizes again).
    pub widened: Option<super::gemm::Widened>,
}

impl GemmPlan {
    /// Device bytes the path takes: its scratch and the widened copy.
    pub fn device_bytes(&self) -> u64 {
        self.scratch_bytes + self.widened.map_or(0, |w| w.bytes)
    }
}

/// Where each layer's KV cache lives.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct KvPlan {
    /// The first `resident_layers` layers of the KV order (full-context
    /// layers before sliding-window ones, `Hparams::kv_order`) keep their
    /// KV on the device.
    pub resident_layers: usize,
    /// Device windows the other layers' KV passes through (0 when none).
    pub windows: usize,
    /// Host frames (one block of every windowed layer each); blocks beyond
    /// them spill to disk. 0 when no layer is windowed.
    pub frames: usize,
}

/// A window of host slots over the model file for one group kind's
/// streamed groups (the DRAM tier when they do not all fit).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DramWindowPlan {
    pub slots: usize,
    /// Groups read from the file ahead of use (each with a staging buffer).
    pub ahead: usize,
    /// Bytes of one slot: the kind's largest group.
    pub slot_bytes: u64,
}

/// The memory plan.
#[derive(Clone, Debug, PartialEq)]
pub struct MemoryPlan {
    /// Which groups are resident, streamed or computed by the CPU; slots;
    /// the predicted step.
    pub placement: Plan,
    pub kv: KvPlan,
    /// Per group kind (attention, FFN): None when that kind's streamed
    /// groups all stay in pinned host memory.
    pub dram: [Option<DramWindowPlan>; 2],
    /// Device bytes reserved for activations.
    pub activation_bytes: u64,
    /// Most rows per FFN chunk where the model does not fit the GPU whole and
    /// chunks need less (the FFN's activations then need not be reserved
    /// for a whole step); None: whole steps.
    pub ffn_rows: Option<u32>,
    /// The GEMM path of large steps and its scratch (in `fixed_bytes`).
    pub gemm: Option<GemmPlan>,
    /// Device bytes reserved for what the run takes outside strata's
    /// buffers (in `fixed_bytes`; see [`super::Outside`]).
    pub outside_bytes: u64,
    kv_shape: KvShape,
}

impl MemoryPlan {
    /// Device bytes of the KV cache: resident layers and windows.
    pub fn kv_device_bytes(&self) -> u64 {
        kv_device_bytes(&self.kv_shape, self.kv.resident_layers, self.kv.windows)
    }
    /// Host bytes of the KV frames.
    pub fn kv_host_bytes(&self) -> u64 {
        let windowed = self.kv_shape.n_layer - self.kv.resident_layers;
        self.kv.frames as u64 * windowed as u64 * self.kv_shape.block_bytes
    }
    /// Host bytes holding streamed weights: every streamed group, or the
    /// DRAM windows' slots.
    pub fn streamed_host_bytes(&self) -> u64 {
        if self.dram.iter().any(Option::is_some) {
            self.dram
                .iter()
                .flatten()
                .map(|w| w.slots as u64 * w.slot_bytes)
                .sum()
        } else {
            self.placement.streamed_bytes_per_step
        }
    }
    /// Host bytes of the CPU's own copies of the groups it computes.
    pub fn cpu_copy_bytes(&self) -> u64 {
        self.placement.hybrid.as_ref().map_or(0, |h| h.host_bytes)
    }
    /// Device bytes in all.
    pub fn device_bytes(&self) -> u64 {
        self.placement.device_bytes()
    }
}

fn kv_device_bytes(kv: &KvShape, resident: usize, windows: usize) -> u64 {
    kv.layer_bytes
        * (resident as u64
            + if resident < kv.n_layer {
                windows as u64
            } else {
                0
            })
}

/// Plans GPU, DRAM and KV memory. See the module comment.
pub fn memory_plan(inp: &MemoryInput) -> Result<MemoryPlan, PlanError> {
    let kv = &inp.kv;
    let windows = inp.slots.max(2);
    // a model that fits whole needs no FFN chunks; one that does not
    // reserves activations for a chunk, so decode gets the difference
    let act = &inp.activations;
    let whole = inp.groups.iter().map(|g| g.bytes).sum::<u64>()
        + inp.fixed_bytes
        + inp.gemm.map_or(0, |g| g.device_bytes())
        + inp.outside.bytes(inp.gemm.is_some(), false)
        + act.whole
        + kv.layer_bytes * kv.n_layer as u64;
    let chunk = act.forced
        || (inp.stream_all || inp.budgets.gpu.is_some_and(|b| whole > b))
            && act.chunked < act.whole;
    let (activation_bytes, ffn_rows) = if chunk {
        (act.chunked, Some(act.ffn_rows))
    } else {
        (act.whole, None)
    };
    let outside_bytes = inp.outside.bytes(inp.gemm.is_some(), ffn_rows.is_some());
    let fixed = inp.fixed_bytes
        + activation_bytes
        + inp.gemm.map_or(0, |g| g.device_bytes())
        + outside_bytes;
    let resident_layers = kv_resident_layers(inp, fixed, windows);
    let mut pi = PlanInput {
        groups: inp.groups.clone(),
        fixed_bytes: fixed + kv_device_bytes(kv, resident_layers, windows),
        budget: inp.budgets.gpu,
        copy_bw: inp.copy_bw,
        compute: inp.compute,
        slots: inp.slots,
        stream_all: inp.stream_all,
        resident: inp.resident,
        cpu: None,
    };
    let plain = plan(&pi)?;
    let mut placement = plain.clone();
    if let Some(c) = &inp.cpu {
        // host room for the CPU's copies: what the DRAM budget leaves beside
        // the streamed groups (none while a DRAM window pages them from
        // disk), or what the machine has free less 2 GiB
        let host = inp
            .budgets
            .dram
            .unwrap_or_else(|| inp.host_available.saturating_sub(2 << 30));
        // the deeper attention ring of a hybrid plan streams more groups,
        // which leaves less room: shrink the room until both fit, else the
        // bus alone
        let mut room = host.saturating_sub(plain.streamed_bytes_per_step);
        placement = loop {
            pi.cpu = Some(CpuInput {
                host_room: room,
                ..c.clone()
            });
            let p = plan(&pi)?;
            let copies = p.hybrid.as_ref().map_or(0, |h| h.host_bytes);
            if p.streamed_bytes_per_step + copies <= host {
                break p;
            }
            let next = host.saturating_sub(p.streamed_bytes_per_step);
            if next >= room || p.hybrid.is_none() {
                break plain;
            }
            room = next;
        };
    }
    let dram = dram_windows(&inp.groups, &placement, inp.budgets.dram)?;
    let frames = kv_frames(kv, resident_layers, inp.budgets.kv_dram)?;
    Ok(MemoryPlan {
        placement,
        kv: KvPlan {
            resident_layers,
            windows: if resident_layers < kv.n_layer {
                windows
            } else {
                0
            },
            frames,
        },
        dram,
        activation_bytes,
        ffn_rows,
        gemm: inp.gemm,
        outside_bytes,
        kv_shape: *kv,
    })
}

/// Layers keeping their KV on the device: with a KV budget, as many as it
/// holds (all of them when windowing would leave fewer layers than
/// windows); without one, see [`super::plan::auto_kv_layers`].
fn kv_resident_layers(inp: &MemoryInput, fixed: u64, windows: usize) -> usize {
    let kv = &inp.kv;
    match inp.budgets.kv_gpu {
        Some(b) => match ((b / kv.layer_bytes.max(1)) as usize).min(kv.n_layer) {
            k if k + windows >= kv.n_layer && k > 0 => kv.n_layer,
            k => k,
        },
        None => {
            let k = super::plan::auto_kv_layers(
                &inp.groups,
                fixed,
                kv.layer_bytes,
                kv.n_layer,
                windows,
                inp.slots,
                inp.budgets.gpu,
            );
            // where weights stream, the sliding-window layers' device KV
            // (the context, of which they read a window) goes to weights
            let weights: u64 = inp.groups.iter().map(|g| g.bytes).sum();
            let all = fixed + weights + kv.layer_bytes * kv.n_layer as u64;
            let streams = inp.stream_all || inp.budgets.gpu.is_some_and(|b| all > b);
            let full = kv.n_layer - kv.n_swa_layers.min(kv.n_layer);
            if streams && kv.n_swa_layers > 0 && k > full {
                full
            } else {
                k
            }
        }
    }
}

/// The DRAM tier: when the streamed groups exceed the host budget, a
/// window of host slots per group kind (slots sized for that kind's
/// largest group), the budget split by the kinds' streamed bytes; a
/// quarter of each share reads ahead.
fn dram_windows(
    groups: &[GroupInfo],
    placement: &Plan,
    budget: Option<u64>,
) -> Result<[Option<DramWindowPlan>; 2], PlanError> {
    let streamed = placement.streamed_bytes_per_step;
    let Some(b) = budget.filter(|&b| streamed > b) else {
        return Ok([None, None]);
    };
    let mut kind_bytes = [0u64; 2];
    let mut kind_max = [0u64; 2];
    for (g, r) in groups.iter().zip(&placement.resident) {
        if !*r {
            let k = usize::from(g.kind == GroupKind::Ffn);
            kind_bytes[k] += g.bytes;
            kind_max[k] = kind_max[k].max(g.bytes);
        }
    }
    // each kind needs two host slots of its largest group
    let minimum = (0..2)
        .filter(|&k| kind_bytes[k] > 0)
        .map(|k| {
            (2 * kind_max[k] as u128 * streamed as u128).div_ceil(kind_bytes[k] as u128) as u64
        })
        .max()
        .unwrap_or(0);
    let mut out = [None, None];
    for k in 0..2 {
        if kind_bytes[k] == 0 {
            continue;
        }
        let share = (b as u128 * kind_bytes[k] as u128 / streamed as u128) as u64;
        let groups = (share / kind_max[k]) as usize;
        let ahead = (groups / 4).min(8);
        let slots = groups - ahead;
        if slots < 2 {
            return Err(PlanError::DramBudget { budget: b, minimum });
        }
        out[k] = Some(DramWindowPlan {
            slots,
            ahead,
            slot_bytes: kind_max[k],
        });
    }
    Ok(out)
}

/// Host frames for the windowed layers' KV: as many blocks as the KV DRAM
/// budget holds (every block without one); at least one.
fn kv_frames(kv: &KvShape, resident: usize, budget: Option<u64>) -> Result<usize, PlanError> {
    if resident >= kv.n_layer {
        return Ok(0);
    }
    let frame = (kv.n_layer - resident) as u64 * kv.block_bytes;
    let frames = match budget {
        None => kv.n_blocks,
        Some(b) => ((b / frame.max(1)) as usize).min(kv.n_blocks),
    };
    if frames == 0 {
        return Err(PlanError::KvDramBudget {
            budget: budget.unwrap_or(0),
            minimum: frame,
        });
    }
    Ok(frames)
}

impl std::fmt::Display for MemoryPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        writeln!(f, "{}", self.placement)?;
        let n_layer = self.kv_shape.n_layer;
        write!(
            f,
            "memory: device {:.1} MiB (activations {:.1} MiB{}; KV {:.1} MiB: {} of {} layers",
            mib(self.device_bytes()),
            mib(self.activation_bytes),
            self.ffn_rows
                .map(|r| format!(", FFN in chunks of at most {r} rows"))
                .unwrap_or_default()
                + &self
                    .gemm
                    .map(|g| {
                        format!(
                            "; GEMM scratch {:.1} MiB for steps over {} rows{}",
                            mib(g.scratch_bytes),
                            g.mmq_max_rows,
                            g.widened
                                .map(|w| format!(
                                    ", a group's weights as BF16 {:.1} MiB for halved steps",
                                    mib(w.bytes)
                                ))
                                .unwrap_or_default()
                        )
                    })
                    .unwrap_or_default()
                + &if self.outside_bytes > 0 {
                    format!(
                        "; {:.1} MiB outside strata's buffers",
                        mib(self.outside_bytes)
                    )
                } else {
                    String::new()
                },
            mib(self.kv_device_bytes()),
            self.kv.resident_layers,
            n_layer,
        )?;
        if self.kv.resident_layers < n_layer {
            write!(
                f,
                ", the rest through {} windows and {} host frames of {:.1} MiB",
                self.kv.windows,
                self.kv.frames,
                mib(self.kv_host_bytes())
            )?;
        }
        write!(
            f,
            "); host {:.1} MiB of streamed weights",
            mib(self.streamed_host_bytes())
        )?;
        for (k, w) in ["attention", "FFN"].iter().zip(&self.dram) {
            if let Some(w) = w {
                write!(
                    f,
                    ", {k} through a DRAM window of {} slots ({} read ahead)",
                    w.slots, w.ahead
                )?;
            }
        }
        if self.cpu_copy_bytes() > 0 {
            write!(f, ", {:.1} MiB of CPU copies", mib(self.cpu_copy_bytes()))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::testutil::{cpu, layers as groups};
    use super::*;
    use proptest::prelude::*;

    fn input(n: usize, budgets: Budgets) -> MemoryInput {
        MemoryInput {
            groups: groups(n, 10, 30),
            fixed_bytes: 5,
            activations: Activations {
                whole: 0,
                chunked: 0,
                ffn_rows: 1,
                forced: false,
            },
            kv: KvShape {
                n_layer: n,
                layer_bytes: 8,
                n_blocks: 4,
                block_bytes: 2,
                n_swa_layers: 0,
            },
            budgets,
            host_available: 1 << 40,
            slots: 2,
            stream_all: false,
            resident: Default::default(),
            copy_bw: 100.0,
            compute: None,
            cpu: None,
            gemm: None,
            outside: crate::paging::outside::Outside::default(),
        }
    }

    #[test]
    fn no_budgets_keep_everything_in_place() {
        let p = memory_plan(&input(4, Budgets::default())).unwrap();
        assert_eq!(p.placement.n_streamed(), 0);
        assert_eq!(
            p.kv,
            KvPlan {
                resident_layers: 4,
                windows: 0,
                frames: 0
            }
        );
        assert_eq!(p.dram, [None, None]);
        assert_eq!(p.device_bytes(), 5 + 32 + 160);
    }

    #[test]
    fn ffn_chunks_only_where_the_model_does_not_fit_whole() {
        let mut inp = input(4, Budgets::default());
        inp.activations = Activations {
            whole: 50,
            chunked: 10,
            ffn_rows: 32,
            forced: false,
        };
        // no budget, and a budget that holds everything with whole steps
        for gpu in [None, Some(5 + 50 + 32 + 160)] {
            inp.budgets.gpu = gpu;
            let p = memory_plan(&inp).unwrap();
            assert_eq!((p.ffn_rows, p.activation_bytes), (None, 50));
            assert_eq!(p.placement.n_streamed(), 0);
        }
        // a byte less: chunks, and the 40 bytes saved keep a group resident
        inp.budgets.gpu = Some(5 + 50 + 32 + 160 - 1);
        let p = memory_plan(&inp).unwrap();
        assert_eq!((p.ffn_rows, p.activation_bytes), (Some(32), 10));
        assert!(p.device_bytes() < 5 + 50 + 32 + 160);
        assert_eq!(p.placement.fixed_bytes, 5 + 10 + 32);
    }

    #[test]
    fn what_runs_outside_strata_is_reserved_by_path_and_chunking() {
        // 4 layers of 10 + 30 bytes, 5 fixed, KV 4 x 8
        let mut inp = input(4, Budgets::default());
        inp.budgets.gpu = Some(5 + 32 + 160);
        let bare = memory_plan(&inp).unwrap();
        assert_eq!(bare.outside_bytes, 0);
        inp.outside = crate::paging::outside::Outside {
            always: 3,
            without_gemm: 20,
            pool_whole: 9,
            pool_chunked: 4,
        };
        // no GEMM, whole steps: all of it, taken from the resident groups
        let p = memory_plan(&inp).unwrap();
        assert_eq!(p.outside_bytes, 3 + 20 + 9);
        assert_eq!(p.placement.fixed_bytes, 5 + 32 + 32);
        assert!(p.placement.resident_bytes < bare.placement.resident_bytes);
        assert!(p.device_bytes() <= 5 + 32 + 160);
        assert!(p.to_string().contains("outside strata's buffers"));
        // FFN chunks: the chunks' pool
        inp.activations = Activations {
            whole: 40,
            chunked: 10,
            ffn_rows: 32,
            forced: true,
        };
        let c = memory_plan(&inp).unwrap();
        assert_eq!(c.outside_bytes, 3 + 20 + 4);
        // GEMM kept: its scratch covers all but the pinned mapping
        inp.gemm = Some(GemmPlan {
            mmq_max_rows: 128,
            scratch_bytes: 30,
            widened: None,
        });
        let g = memory_plan(&inp).unwrap();
        assert_eq!(g.outside_bytes, 3);
        assert_eq!(g.placement.fixed_bytes, 5 + 10 + 30 + 3 + 32);
        assert!(g.device_bytes() <= 5 + 32 + 160);
    }

    #[test]
    fn gemm_scratch_is_reserved_and_costs_resident_groups() {
        // 4 layers of 10 + 30 bytes, 5 fixed, KV 4 x 8
        let mut inp = input(4, Budgets::default());
        inp.budgets.gpu = Some(5 + 32 + 160);
        let without = memory_plan(&inp).unwrap();
        assert_eq!(without.placement.n_streamed(), 0);
        inp.gemm = Some(GemmPlan {
            mmq_max_rows: 128,
            scratch_bytes: 30,
            widened: None,
        });
        let with = memory_plan(&inp).unwrap();
        assert_eq!(with.gemm, inp.gemm);
        assert_eq!(with.placement.fixed_bytes, 5 + 30 + 32);
        // the scratch displaced weights, and the budget still holds
        assert!(with.placement.resident_bytes < without.placement.resident_bytes);
        assert!(with.device_bytes() <= 5 + 32 + 160);
        assert!(with.to_string().contains("GEMM scratch"));
        // the row split's widened copy is reserved beside it
        inp.gemm = Some(GemmPlan {
            widened: Some(crate::paging::gemm::Widened {
                bytes: 20,
                min_half_rows: 129,
            }),
            ..inp.gemm.unwrap()
        });
        let widened = memory_plan(&inp).unwrap();
        assert_eq!(widened.placement.fixed_bytes, 5 + 30 + 20 + 32);
        assert!(widened.placement.resident_bytes < with.placement.resident_bytes);
        assert!(widened.device_bytes() <= 5 + 32 + 160);
        assert!(widened.to_string().contains("for halved steps"));
    }

    #[test]
    fn sliding_window_layers_are_windowed_when_weights_stream() {
        // 6 layers of 10 + 30 bytes, KV 8 bytes a layer, 5 of them
        // sliding-window layers: everything fits in 5 + 240 + 48
        let mut inp = input(6, Budgets::default());
        inp.kv.n_swa_layers = 5;
        inp.budgets.gpu = Some(5 + 240 + 48);
        assert_eq!(memory_plan(&inp).unwrap().kv.resident_layers, 6);
        // the weights stream: only the full-context layer keeps its KV
        inp.budgets.gpu = Some(5 + 200);
        let p = memory_plan(&inp).unwrap();
        assert!(p.placement.n_streamed() > 0);
        assert_eq!(p.kv.resident_layers, 1);
        assert!(p.kv.windows > 0 && p.kv.frames > 0);
        // without sliding-window layers the same budget keeps all six
        inp.kv.n_swa_layers = 0;
        assert_eq!(memory_plan(&inp).unwrap().kv.resident_layers, 6);
        // a KV budget is the user's word
        inp.kv.n_swa_layers = 5;
        inp.budgets.kv_gpu = Some(6 * 8);
        assert_eq!(memory_plan(&inp).unwrap().kv.resident_layers, 6);
    }

    #[test]
    fn kv_budget_windows_the_rest_and_frames_follow_kv_dram() {
        let b = Budgets {
            kv_gpu: Some(8),
            kv_dram: Some(2 * 5 * 2),
            ..Budgets::default()
        };
        let p = memory_plan(&input(8, b)).unwrap();
        // 1 layer on the device, 7 windowed through 2 windows; a frame is
        // 7 layers * 2 bytes, the budget holds 1 of them
        assert_eq!(
            p.kv,
            KvPlan {
                resident_layers: 1,
                windows: 2,
                frames: 1
            }
        );
        assert_eq!(p.kv_device_bytes(), 3 * 8);
        assert_eq!(p.kv_host_bytes(), 14);
        let e = memory_plan(&input(
            8,
            Budgets {
                kv_dram: Some(13),
                ..b
            },
        ))
        .unwrap_err();
        assert_eq!(
            e,
            PlanError::KvDramBudget {
                budget: 13,
                minimum: 14
            }
        );
    }

    #[test]
    fn dram_window_when_streamed_groups_exceed_the_host_budget() {
        let b = Budgets {
            gpu: Some(5 + 32 + 80),
            dram: Some(100),
            ..Budgets::default()
        };
        let p = memory_plan(&input(4, b)).unwrap();
        assert_eq!(p.placement.n_streamed(), 8);
        // 160 streamed bytes: attention's share 25 (2 slots), FFN's 75 (2)
        let [a, f] = p.dram;
        assert_eq!(a.map(|w| w.slots), Some(2));
        assert_eq!(f.map(|w| (w.slots, w.slot_bytes)), Some((2, 30)));
        assert!(p.streamed_host_bytes() <= 100);
        let e = memory_plan(&input(
            4,
            Budgets {
                dram: Some(70),
                ..b
            },
        ))
        .unwrap_err();
        assert!(
            matches!(e, PlanError::DramBudget { minimum: 80, .. }),
            "{e}"
        );
    }

    #[test]
    fn cpu_copies_fit_what_the_dram_budget_leaves() {
        // a CPU far faster than the bus would take every streamed FFN
        // group; the DRAM budget leaves room for two copies
        let b = Budgets {
            gpu: Some(5 + 64 + 2 * 10 + 2 * 30 + 48),
            ..Budgets::default()
        };
        let streamed = memory_plan(&input(8, b))
            .unwrap()
            .placement
            .streamed_bytes_per_step;
        let mut inp = input(
            8,
            Budgets {
                dram: Some(streamed + 60),
                ..b
            },
        );
        inp.cpu = Some(cpu(1e-9));
        let p = memory_plan(&inp).unwrap();
        let h = p.placement.hybrid.as_ref().expect("hybrid");
        assert!(h.host.iter().filter(|h| **h).count() >= 1);
        assert!(p.cpu_copy_bytes() <= 60, "{}", p.cpu_copy_bytes());
        assert!(p.streamed_host_bytes() + p.cpu_copy_bytes() <= streamed + 60);
        // no room at all: the bus alone
        inp.budgets.dram = Some(streamed);
        assert!(memory_plan(&inp).unwrap().placement.hybrid.is_none());
    }

    /// A budget in percent of what everything of its kind takes (None: no
    /// budget).
    fn pct() -> impl Strategy<Value = Option<u64>> {
        proptest::option::weighted(0.85, 0u64..=130)
    }

    proptest! {
        #[test]
        fn plans_keep_every_budget(
            n in 1usize..16, a in 1u64..100, f in 1u64..300, fixed in 0u64..200,
            layer in 1u64..40, blocks in 1usize..8, slots in 2usize..4, hybrid in any::<bool>(),
            act in 0u64..200, outside in 0u64..60,
            (gpu_pct, dram_pct, kv_gpu_pct, kv_dram_pct) in (pct(), pct(), pct(), pct()),
        ) {
            let weights = n as u64 * (a + f);
            let kv = n as u64 * layer;
            let of = |p: Option<u64>, all: u64| p.map(|p| all * p / 100);
            let (gpu, dram) = (of(gpu_pct, weights + kv + fixed), of(dram_pct, weights));
            let (kv_gpu, kv_dram) = (of(kv_gpu_pct, kv), of(kv_dram_pct, kv));
            let mut inp = input(n, Budgets { gpu, dram, kv_gpu, kv_dram });
            inp.groups = groups(n, a, f);
            inp.fixed_bytes = fixed;
            inp.kv.layer_bytes = layer;
            inp.kv.n_blocks = blocks;
            inp.kv.block_bytes = layer.div_ceil(blocks as u64);
            inp.slots = slots;
            inp.cpu = hybrid.then(|| cpu(1e-3));
            inp.activations = Activations { whole: act, chunked: act / 3, ffn_rows: 8, forced: false };
            inp.outside = crate::paging::outside::Outside {
                always: outside / 4,
                without_gemm: outside / 2,
                pool_whole: outside / 4,
                pool_chunked: outside / 8,
            };
            match memory_plan(&inp) {
                Ok(p) => {
                    if let Some(g) = gpu { prop_assert!(p.device_bytes() <= g, "device {} > {}", p.device_bytes(), g); }
                    if let Some(d) = dram { prop_assert!(p.streamed_host_bytes() + p.cpu_copy_bytes() <= d, "host {} + {} > {}", p.streamed_host_bytes(), p.cpu_copy_bytes(), d); }
                    if let Some(k) = kv_dram { prop_assert!(p.kv_host_bytes() <= k); }
                    if let Some(k) = kv_gpu {
                        prop_assert!(p.kv.resident_layers == n || p.kv.resident_layers as u64 * layer <= k);
                    }
                    // FFN chunks exactly where the model does not fit whole
                    let whole = weights + fixed + inp.outside.bytes(false, false) + act + kv;
                    prop_assert_eq!(p.ffn_rows.is_some(), gpu.is_some_and(|g| whole > g) && act / 3 < act);
                    // what runs outside strata's buffers is reserved as the chunking says
                    prop_assert_eq!(p.outside_bytes, inp.outside.bytes(false, p.ffn_rows.is_some()));
                    prop_assert_eq!(p.activation_bytes, if p.ffn_rows.is_some() { act / 3 } else { act });
                    // every group placed exactly once
                    let total: u64 = inp.groups.iter().map(|g| g.bytes).sum();
                    prop_assert_eq!(p.placement.resident_bytes + p.placement.streamed_bytes_per_step, total);
                    if let Some(h) = &p.placement.hybrid {
                        for (i, on_cpu) in h.host.iter().enumerate() {
                            prop_assert!(!*on_cpu || !p.placement.resident[i], "group {} both resident and on the CPU", i);
                        }
                        // a DRAM window pages from disk: the CPU keeps nothing then
                        prop_assert!(p.dram.iter().all(Option::is_none));
                    }
                    // the KV: resident layers and windows, or all resident
                    prop_assert!(p.kv.resident_layers <= n);
                    prop_assert_eq!(p.kv.windows > 0, p.kv.resident_layers < n);
                    prop_assert_eq!(p.kv.frames > 0, p.kv.resident_layers < n);
                    prop_assert!(p.kv.frames <= blocks);
                    // the prediction: the floor is the bus time of what streams
                    let floor = p.placement.streamed_bytes_per_step as f64 / inp.copy_bw;
                    prop_assert!((p.placement.floor_s(1) - floor).abs() <= 1e-9 * floor.max(1.0));
                    if let Some(h) = &p.placement.hybrid {
                        prop_assert!(h.per_size[0].predicted.step_s() > 0.0);
                    }
                }
                Err(PlanError::BudgetTooSmall { minimum, .. }) => prop_assert!(gpu.is_some_and(|g| g < minimum)),
                Err(PlanError::DramBudget { budget, minimum }) => prop_assert!(budget < minimum),
                Err(PlanError::KvDramBudget { budget, minimum }) => prop_assert!(budget < minimum),
                Err(e) => prop_assert!(false, "{}", e),
            }
        }
    }
}
