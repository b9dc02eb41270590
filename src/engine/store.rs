//! Where every weight lives: resident in a device buffer, or in pinned host
//! memory laid out exactly like a slot, so streaming a group into a slot is
//! one contiguous copy.

use super::cpuweights::{CpuLayout, CpuWeights};
use super::error::EngineError;
use super::model_file::ModelFile;
use super::window::DramWindow;
use crate::ggml::{Binding, Buffer, BufferUsage, Context, Device, TensorArena, TensorSpec};
use crate::model::{GroupId, GroupKind, ModelSpec, WeightSpec};
use crate::paging::MemoryPlan;
use crate::paging::Ring;
use indicatif::{ProgressBar, ProgressStyle};
use std::path::Path;

/// Byte layout of one group inside a slot (and inside its pinned extent).
#[derive(Clone, Debug, PartialEq)]
pub struct GroupLayout {
    /// Offset of each weight, in the group's signature order.
    pub offsets: Vec<usize>,
    /// Bytes of the extent, padding included.
    pub bytes: usize,
}

/// Where a layer group's weights are.
pub enum Location {
    Resident(Vec<Binding>),
    /// In pinned memory at `host` (same layout as a slot), streamed through ring `ring`.
    Streamed {
        ring: Ring,
        /// Offset in the pinned buffer; None when the group lives on disk
        /// and passes through the DRAM window.
        host: Option<usize>,
    },
}

/// The memory of resident weights: one device buffer (with the context of
/// its tensors), or CPU memory partly repacked.
enum ResidentMemory {
    Device { _arena: TensorArena },
    Cpu { _weights: CpuWeights },
}

/// A ring's device slots: one buffer each, holding a byte tensor spanning
/// it that uploads target.
pub struct RingBuffers {
    pub slot_bytes: usize,
    pub slots: Vec<TensorArena>,
}

impl RingBuffers {
    pub fn slot_tensor(&self, s: usize) -> crate::ggml::Tensor<'_> {
        self.slots[s].tensor(0)
    }
    /// Where slot `s`'s byte tensor lives.
    pub fn slot_binding(&self, s: usize) -> Binding {
        self.slots[s].binding(0)
    }
}

pub struct WeightStore {
    pub groups: Vec<Location>,
    pub layouts: Vec<GroupLayout>,
    /// output_norm, output.
    pub head: Vec<Binding>,
    pub rope_freqs: Option<Binding>,
    pub resident_bytes: u64,
    pub pinned_bytes: u64,
    /// Whether the host copy is really pinned (page-locked) memory.
    pub pinned_is_pinned: bool,
    pub pinned: Option<Buffer>,
    /// Per kind (0 attn, 1 ffn): the slot ring, if that kind streams.
    pub rings: [Option<RingBuffers>; 2],
    /// Per group kind: the DRAM window and where its slots start in `pinned`.
    windows: [Option<(DramWindow, usize)>; 2],
    /// Each group's tensors in the file (the window reads them from there).
    weights: Vec<Vec<WeightSpec>>,
    _resident: ResidentMemory,
}

fn align_up(x: usize, a: usize) -> usize {
    x.div_ceil(a) * a
}

/// Per-group layouts with the device buffer type's sizes and alignment.
pub fn layouts(spec: &ModelSpec, dev: Device) -> Result<Vec<GroupLayout>, EngineError> {
    let n: usize = spec.groups.iter().map(|g| g.weights.len()).sum();
    let ctx = Context::new(n + 1, 0)?;
    let buft = dev.buffer_type();
    let align = buft.alignment();
    let mut out = Vec::with_capacity(spec.groups.len());
    for g in &spec.groups {
        let mut offsets = Vec::with_capacity(g.weights.len());
        let mut off = 0usize;
        for w in &g.weights {
            let t = ctx.new_tensor(w.ty, &w.ne[..]);
            offsets.push(off);
            off += align_up(buft.alloc_size(t), align);
        }
        out.push(GroupLayout {
            offsets,
            bytes: off.max(align),
        });
    }
    Ok(out)
}

pub(super) fn progress(total: u64, on: bool) -> ProgressBar {
    if !on {
        return ProgressBar::hidden();
    }
    let b = ProgressBar::new(total);
    b.set_style(
        ProgressStyle::with_template("loading {bar:40} {bytes}/{total_bytes} {bytes_per_sec}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    b
}

impl WeightStore {
    /// Loads the weights as `plan` places them.
    #[allow(clippy::too_many_arguments)]
    pub fn load(
        spec: &ModelSpec,
        file: &ModelFile,
        path: &Path,
        dev: Device,
        plan: &MemoryPlan,
        layouts: Vec<GroupLayout>,
        cpu_layout: CpuLayout,
        show_progress: bool,
    ) -> Result<WeightStore, EngineError> {
        let buft = dev.buffer_type();
        let head_specs: Vec<&WeightSpec> = if spec.has_head {
            vec![&spec.output_norm, &spec.output]
        } else {
            Vec::new()
        };
        let total: u64 = spec.groups.iter().map(|g| g.bytes()).sum::<u64>()
            + head_specs.iter().map(|w| w.size).sum::<u64>();
        let bar = progress(total, show_progress);

        // resident: globals + resident groups, tensor by tensor into one buffer
        let n_head = head_specs.len();
        let mut resident_specs: Vec<&WeightSpec> = head_specs;
        resident_specs.extend(spec.rope_freqs.iter());
        for (g, r) in spec.groups.iter().zip(&plan.placement.resident) {
            if *r {
                resident_specs.extend(g.weights.iter());
            }
        }
        // on the CPU device, matrices go into the CPU's repacked buffer
        // types as llama.cpp puts them (unless repacking is off); it
        // computes prompt steps too
        let (resident, bindings, size) = if dev.is_cpu() && cpu_layout.repack {
            let layout = cpu_layout.for_prompt_steps();
            let w = CpuWeights::load(dev, &[resident_specs.clone()], file, layout, &bar)?;
            let size = (w.repacked_bytes + w.plain_bytes) as usize;
            let b = w.sets[0].clone();
            (ResidentMemory::Cpu { _weights: w }, b, size)
        } else {
            let specs: Vec<TensorSpec> = resident_specs
                .iter()
                .map(|w| TensorSpec::new(w.ty, &w.ne[..]).named(&w.name))
                .collect();
            // zeroed: the padding quantized kernels may read past a row
            let arena = TensorArena::new(buft, BufferUsage::Weights, &specs)?;
            for (i, w) in resident_specs.iter().enumerate() {
                arena.tensor(i).set_bytes(&file.bytes(w), 0)?;
                bar.inc(w.size);
            }
            let bindings: Vec<Binding> = (0..arena.len()).map(|i| arena.binding(i)).collect();
            let size = arena.bytes();
            (ResidentMemory::Device { _arena: arena }, bindings, size)
        };
        let mut it = bindings.into_iter();
        let head: Vec<Binding> = it.by_ref().take(n_head).collect();
        let rope_freqs = if spec.rope_freqs.is_some() {
            it.next()
        } else {
            None
        };

        // streamed: pinned host extents with the slot layout
        let streamed: Vec<usize> = layouts
            .iter()
            .zip(&plan.placement.resident)
            .filter(|(_, r)| !**r)
            .map(|(l, _)| l.bytes)
            .collect();
        let streamed_bytes: usize = streamed.iter().sum();
        // the DRAM tier, where the plan has one: a window of host slots per
        // group kind over the model file
        let mut windows: [Option<(DramWindow, usize)>; 2] = [None, None];
        let mut host_bytes = streamed_bytes;
        if plan.dram.iter().any(Option::is_some) {
            let mut off = 0usize;
            for (k, w) in plan.dram.iter().enumerate() {
                if let Some(w) = w {
                    let slot = w.slot_bytes as usize;
                    windows[k] = Some((DramWindow::new(path, w.slots, slot, w.ahead)?, off));
                    off += w.slots * slot;
                }
            }
            host_bytes = off;
        }
        let (pinned, pinned_is_pinned) = if streamed_bytes > 0 {
            let (b, really) = super::buffers::alloc_host(
                dev,
                host_bytes,
                BufferUsage::Weights,
                "streamed weights",
            )?;
            (Some(b), really)
        } else {
            (None, true)
        };
        let mut groups = Vec::with_capacity(spec.groups.len());
        let mut res_iter = it;
        let mut host = 0usize;
        for ((g, r), l) in spec
            .groups
            .iter()
            .zip(&plan.placement.resident)
            .zip(&layouts)
        {
            if *r {
                groups.push(Location::Resident(
                    res_iter.by_ref().take(g.weights.len()).collect(),
                ));
                continue;
            }
            let ring = Ring::of(g.kind);
            if windows[ring as usize].is_some() {
                groups.push(Location::Streamed { ring, host: None });
                continue;
            }
            let p = pinned
                .as_ref()
                .expect("pinned buffer exists when groups stream");
            // SAFETY: [host, host + l.bytes) lies inside the pinned buffer
            // (sized as the sum of streamed extents); nothing else uses it yet.
            let dst = unsafe { std::slice::from_raw_parts_mut(p.base().add(host), l.bytes) };
            dst.fill(0);
            for (w, off) in g.weights.iter().zip(&l.offsets) {
                let src = file.bytes(w);
                dst[*off..*off + src.len()].copy_from_slice(&src);
                bar.inc(w.size);
            }
            groups.push(Location::Streamed {
                ring,
                host: Some(host),
            });
            host += l.bytes;
        }
        bar.finish_and_clear();

        let mut rings: [Option<RingBuffers>; 2] = [None, None];
        for (ri, kind) in [GroupKind::Attn, GroupKind::Ffn].into_iter().enumerate() {
            let n_slots = if ri == 0 {
                plan.placement.slots.0
            } else {
                plan.placement.slots.1
            };
            if n_slots == 0 {
                continue;
            }
            let slot_bytes = spec
                .groups
                .iter()
                .zip(&layouts)
                .filter(|(g, _)| g.kind == kind)
                .map(|(_, l)| l.bytes)
                .max()
                .unwrap_or(0);
            // COMPUTE usage: padding past rows stays zeroed / harmless
            let slot =
                [TensorSpec::new(crate::dtype::GgmlType::I8, &[slot_bytes as i64]).named("slot")];
            let slots = (0..n_slots)
                .map(|_| TensorArena::new(buft, BufferUsage::Compute, &slot))
                .collect::<Result<Vec<_>, _>>()?;
            rings[ri] = Some(RingBuffers { slot_bytes, slots });
        }
        Ok(WeightStore {
            groups,
            layouts,
            head,
            rope_freqs,
            resident_bytes: size as u64,
            pinned_bytes: host_bytes as u64,
            pinned_is_pinned,
            pinned,
            rings,
            windows,
            weights: spec.groups.iter().map(|g| g.weights.clone()).collect(),
            _resident: resident,
        })
    }

    /// The DRAM window group `gi` passes through, with its slots' offset.
    fn window_of(&self, gi: GroupId) -> Option<&(DramWindow, usize)> {
        match self.groups[gi.index()] {
            Location::Streamed { ring, host: None } => self.windows[ring as usize].as_ref(),
            _ => None,
        }
    }

    /// The pinned extent of a streamed group, read from the file into the
    /// DRAM window first if that is where it lives. `drain` waits for the
    /// pending copies out of a window slot about to be reused.
    pub fn host_extent(&self, gi: GroupId, drain: impl FnOnce()) -> Result<&[u8], EngineError> {
        let Some(p) = &self.pinned else {
            return Ok(&[]);
        };
        let off = match (&self.groups[gi.index()], self.window_of(gi)) {
            (Location::Streamed { host: Some(h), .. }, _) => *h,
            (Location::Streamed { host: None, .. }, Some((w, base))) => {
                // SAFETY: the window's slots lie at `base` inside the pinned
                // buffer (sized as the sum of both windows) and only the
                // window writes them after load.
                let at = unsafe {
                    w.ensure(
                        p.base().add(*base),
                        gi.index(),
                        &self.weights[gi.index()],
                        &self.layouts[gi.index()].offsets,
                        drain,
                    )?
                };
                base + at
            }
            _ => return Ok(&[]),
        };
        // SAFETY: the extent lies inside the pinned buffer; it is written
        // only at load time or by the window, never while a copy reads it.
        Ok(
            unsafe {
                std::slice::from_raw_parts(p.base().add(off), self.layouts[gi.index()].bytes)
            },
        )
    }

    /// Starts reading `gis` from the file ahead of use (DRAM window only).
    pub fn prefetch(&self, gis: &[GroupId]) -> Result<(), EngineError> {
        for &gi in gis {
            if let Some((w, _)) = self.window_of(gi) {
                w.prefetch(gi.index(), &self.weights[gi.index()])?;
            }
        }
        Ok(())
    }

    /// Groups the DRAM windows read ahead of use, counted in step order (0
    /// without a window).
    pub fn has_dram_window(&self) -> bool {
        self.windows.iter().any(Option::is_some)
    }
    /// Bytes of one slot of ring `ring` (0 without that ring).
    pub fn slot_bytes(&self, ring: Ring) -> usize {
        self.rings[ring as usize]
            .as_ref()
            .map_or(0, |r| r.slot_bytes)
    }
    pub fn read_ahead(&self) -> usize {
        self.windows.iter().flatten().map(|(w, _)| w.ahead).sum()
    }

    /// Notes that an asynchronous copy of group `gi`'s host extent was enqueued.
    pub fn copy_enqueued(&self, gi: GroupId) {
        if let Some((w, _)) = self.window_of(gi) {
            w.copy_enqueued_for(gi.index());
        }
    }

    /// Bytes the DRAM windows read from the file so far (0 without one).
    pub fn disk_bytes_read(&self) -> u64 {
        self.windows
            .iter()
            .flatten()
            .map(|(w, _)| w.bytes_read())
            .sum()
    }

    /// Time the pager waited for the DRAM windows' reads so far.
    pub fn read_wait(&self) -> std::time::Duration {
        self.windows
            .iter()
            .flatten()
            .map(|(w, _)| w.read_wait())
            .sum()
    }

    /// Host slots of the DRAM windows, if the streamed groups pass through them.
    pub fn window_slots(&self) -> Option<usize> {
        let n: usize = self.windows.iter().flatten().map(|(w, _)| w.slots).sum();
        (n > 0).then_some(n)
    }

    /// Bindings of group `gi` placed in slot `s` of its ring.
    pub fn slot_bindings(
        &self,
        gi: GroupId,
        ring: Ring,
        s: usize,
    ) -> Result<Vec<Binding>, EngineError> {
        let r = self.rings[ring as usize]
            .as_ref()
            .expect("ring exists for a streamed group");
        let b = r.slots[s].buffer();
        Ok(self.layouts[gi.index()]
            .offsets
            .iter()
            .map(|&o| Binding::at(b, o))
            .collect::<Result<_, _>>()?)
    }
}
