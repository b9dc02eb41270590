//! How an engine is configured: the device, budgets, paging and KV tier
//! options, and the CPU threads. Plain data and the defaults the binaries
//! start from; [`Engine::load`](super::Engine::load) carries them out.

pub use super::cpuweights::{Amx, CpuLayout};
use crate::ggml::Device;
use crate::paging::Budgets;

/// Whether the host CPU computes some streamed groups (hybrid decode).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hybrid {
    /// When the plan predicts it pays (a GPU streaming weights).
    Auto,
    Off,
    /// Exactly this many groups at every step size the CPU takes part in,
    /// whatever the prediction; on the CPU device too, where a second CPU
    /// backend stands in for the host (tests, benchmarks).
    Force(usize),
}

/// How large steps multiply quantized weights (see `paging::gemm`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gemm {
    /// Dequantize + 16-bit GEMM above the crossover a load-time probe
    /// measures, where the device can switch (the patched CUDA module).
    Auto,
    /// ggml's quantized kernels at every step size (no scratch).
    Off,
    /// GEMM for products of more than this many rows, unprobed.
    Above(u32),
}

/// Which device computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceChoice {
    Cpu,
    /// The local GPUs (all, or those `EngineConfig::devices` names); an
    /// error if none is loaded.
    Gpu,
    /// The remote devices (an RPC server's, `EngineConfig::rpc`; all, or
    /// those `EngineConfig::devices` names).
    Remote,
    /// The local GPUs if there are any, else the CPU.
    Auto,
}

#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub n_ctx: u32,
    pub n_batch: u32,
    pub n_threads: usize,
    /// CPU thread pool polling level, 0-100 (llama.cpp's --poll).
    pub poll: u32,
    /// Compute with fewer than `n_threads` while that is faster (another
    /// process taking cores; see [`super::threads`]); off: always all.
    pub tune_threads: bool,
    /// Count the experts a mixture's router picks, per layer (see
    /// [`crate::paging::routing`]); a measuring mode: the device waits
    /// for each MoE layer, whose picks the host reads.
    pub expert_stats: bool,
    /// Router counts persisted beside the model (`RouterCounts::to_json`),
    /// read at load to choose the hot experts (a file that is not there
    /// is no counts).
    pub expert_counts: Option<std::path::PathBuf>,
    pub device: DeviceChoice,
    /// Which of the chosen kind's devices to use, by index in their list
    /// (`strata devices`), in layer order; None: every one the model needs
    /// (the first alone where the model fits its budget). A model on
    /// several devices is split into layer ranges (`paging::devices`).
    pub devices: Option<Vec<usize>>,
    /// GPU budgets per device, in `devices` order, where they differ; one
    /// value (or `budgets.gpu`) applies to every device.
    pub gpu_budgets: Vec<u64>,
    /// How a model on several devices is split: layer ranges (the
    /// default) or every layer's rows (`model::shard`).
    pub split_mode: SplitMode,
    /// RPC servers (`HOST:PORT`) whose devices join ggml's registry before
    /// the device is chosen.
    pub rpc: Vec<String>,
    pub progress: bool,
    /// What strata may use of GPU and host memory, for weights and KV
    /// (the memory plan decides the rest; see [`crate::paging::memory_plan`]).
    pub budgets: Budgets,
    /// How layer groups may be placed.
    pub paging: PagingOptions,
    /// The KV tier of layers whose KV is windowed.
    pub kv_tier: KvTierOptions,
    /// CPU weights in the CPU's repacked buffer types (llama.cpp's
    /// default; its --no-repack turns it off).
    pub repack: bool,
    /// Whether those may be AMX's (see [`Amx`]).
    pub cpu_amx: Amx,
    /// Stacked experts repacked too, as llama.cpp places them (with
    /// `repack`; see [`CpuLayout`]).
    pub repack_experts: bool,
    /// Batch-invariant numerics on the CPU: ggml's reference kernels and
    /// plain weights, so a sequence's logits do not depend on what it is
    /// batched with (slower; the server's --batch-invariant).
    pub batch_invariant: bool,
    /// Debug switches for tests.
    pub faults: Faults,
}

/// How a model on several devices is split (llama.cpp's `--split-mode`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SplitMode {
    /// A consecutive range of layers per device; the devices compute in
    /// turn (`paging::devices::split_layers`).
    #[default]
    Layer,
    /// Every device a share of every layer's heads and FFN columns; the
    /// devices compute each group at once and their outputs are summed
    /// (`paging::devices::split_rows`, `model::shard`).
    Row,
}

/// How layer groups may be placed.
#[derive(Clone, Debug)]
pub struct PagingOptions {
    /// Slots per group kind when streaming (>= 2).
    pub slots: usize,
    /// Stream every layer group whatever the budget (tests, benchmarks).
    pub stream_all: bool,
    /// Which groups stay resident when not all fit.
    pub resident: crate::paging::ResidentOrder,
    /// Whether the host CPU computes some streamed groups.
    pub hybrid: Hybrid,
    /// Most rows an FFN graph computes at once; None: all of a step's where
    /// the model fits the GPU budget whole, else as few as keep the FFN's
    /// activations within the attention's (see `paging::sizes::ffn_rows`).
    pub ffn_rows: Option<u32>,
    /// How large steps multiply.
    pub gemm: Gemm,
    /// Whether a mixture's steps of many tokens split each streamed
    /// layer's experts between the device and the host CPU (with hybrid
    /// decode's host copies; see `paging::split`).
    pub split: crate::paging::SplitInput,
    /// A model split across local GPUs: in steps of at least
    /// `RELAY_MIN_TOKENS`, each part's every other streamed FFN group goes
    /// up over the next GPU's bus and across by a peer copy
    /// (`Pager::lend_link`), so both links carry one part's groups. Off by
    /// default. It needs peer access (slower than without the relay where
    /// it was off: runs 48-49; 64-token steps 1.94x with it on: run 55):
    /// ggml's CUDA module turns peer access on at its start only where
    /// GGML_CUDA_P2P is set in the environment, which `strata --relay`
    /// does; a library user sets it before loading.
    pub relay: bool,
    /// A mixture's most picked experts of each streamed layer kept on the
    /// device, computed there while the host CPU computes the others'
    /// picks (`paging::experts`; needs hybrid decode's host copies).
    pub hot: crate::paging::HotExperts,
    /// A mixture's host-computed layers: while the host computes one,
    /// this many of the next host layer's predicted experts go up over
    /// the bus, and the device computes the picks they catch
    /// (`paging::lookahead`); 0: off.
    pub look_ahead: u32,
    /// Whether a mixture's streamed expert groups go up only as far as
    /// a step's tokens picked their experts (`paging::routed`).
    pub routed: crate::paging::RoutedUploads,
    /// How many host layers ahead the look-ahead predicts (at least 1).
    pub look_ahead_layers: u32,
    /// The row split over two devices: steps of at least this many tokens
    /// compute each group in two halves of rows, the first half's outputs
    /// exchanged while the second computes (`engine::rows`). None: from
    /// 512 tokens where both devices are GPUs, whose exchange runs on
    /// streams of its own, never elsewhere; Some(0): never; Some(n): from
    /// n tokens on any devices (elsewhere the exchange waits: tests).
    pub row_halves: Option<u32>,
    /// The row split's halved steps on GPUs dequantize each group's
    /// quantized matrices once into a BF16 copy both halves multiply
    /// (`paging::gemm::Widened`, planned where their products go through
    /// cuBLAS); false: each half's products dequantize again.
    pub row_widen: bool,
    /// Hybrid steps of at least `paging::halves::HALVES_MIN_TOKENS` tokens
    /// run in two halves of rows, one stage apart, so the host CPU
    /// computes its groups for one half while the device computes the
    /// other's (`engine::halves`).
    pub cpu_halves: bool,
    /// Once a step's streamed groups were all released, the copy stream
    /// uploads the next step's first groups (`paging::ring`, `carry_next`),
    /// kept where that step streams the same groups.
    pub carry: bool,
    /// Hybrid steps take their CPU groups from the host groups cheapest
    /// for the CPU where that is faster (`paging::hybrid::tiers`); false:
    /// spread over all of them, whatever their kinds of matrix cost.
    pub cpu_tiers: bool,
}

impl Default for PagingOptions {
    fn default() -> Self {
        PagingOptions {
            slots: 3,
            stream_all: false,
            resident: crate::paging::ResidentOrder::Spread,
            hybrid: Hybrid::Auto,
            ffn_rows: None,
            gemm: Gemm::Auto,
            split: crate::paging::SplitInput::default(),
            hot: crate::paging::HotExperts::Off,
            look_ahead: 0,
            routed: crate::paging::RoutedUploads::Auto,
            look_ahead_layers: 1,
            relay: false,
            row_halves: None,
            row_widen: true,
            cpu_halves: false,
            carry: true,
            cpu_tiers: true,
        }
    }
}

/// The KV tier of windowed layers.
#[derive(Clone, Debug)]
pub struct KvTierOptions {
    /// Cells per KV block (the unit moved between tiers).
    pub block: usize,
    /// Where KV spill files go (a private directory is made inside).
    pub spill_dir: Option<std::path::PathBuf>,
    /// Most bytes the KV spill files may take.
    pub spill_max: Option<u64>,
}

impl Default for KvTierOptions {
    fn default() -> Self {
        KvTierOptions {
            block: 256,
            spill_dir: None,
            spill_max: None,
        }
    }
}

/// Debug switches for tests.
#[derive(Clone, Debug, Default)]
pub struct Faults {
    /// Fill each slot with NaN once its reader finished, so a read before
    /// its next upload completed shows as NaN logits.
    pub poison_slots: bool,
    /// Computations do not wait for their upload (a deliberate bug).
    pub skip_load_wait: bool,
}

impl EngineConfig {
    /// Where the CPU's weights go.
    pub fn cpu_layout(&self) -> CpuLayout {
        CpuLayout {
            repack: self.repack,
            amx: self.cpu_amx,
            repack_experts: self.repack_experts,
        }
    }

    /// The flags set that act only on a mixture of experts' layers, as
    /// the command line spells them: a dense model's load warns that they
    /// do nothing rather than ignoring them silently.
    pub fn mixture_only_options(&self) -> Vec<&'static str> {
        let p = &self.paging;
        [
            (p.hot != crate::paging::HotExperts::Off, "--hot-experts"),
            (p.look_ahead > 0, "--look-ahead"),
            (
                p.split.mode != crate::paging::ExpertSplit::Off,
                "--expert-split",
            ),
            (self.expert_stats, "--expert-stats"),
            (
                p.routed == crate::paging::RoutedUploads::Force,
                "--routed-uploads on",
            ),
            (!self.repack_experts, "--no-repack-experts"),
        ]
        .into_iter()
        .filter_map(|(set, flag)| set.then_some(flag))
        .collect()
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            n_ctx: 4096,
            n_batch: 512,
            n_threads: default_threads(),
            poll: 50,
            tune_threads: false,
            expert_stats: false,
            expert_counts: None,
            device: DeviceChoice::Auto,
            devices: None,
            gpu_budgets: Vec::new(),
            split_mode: SplitMode::Layer,
            rpc: Vec::new(),
            progress: false,
            budgets: Budgets::default(),
            paging: PagingOptions::default(),
            kv_tier: KvTierOptions::default(),
            repack: true,
            cpu_amx: Amx::Auto,
            repack_experts: true,
            batch_invariant: false,
            faults: Faults::default(),
        }
    }
}

/// CPU threads by default: the physical cores (as llama.cpp: a second
/// hyperthread per core adds little to matrix work and contends for the
/// core), within the CPUs this process may run on.
pub fn default_threads() -> usize {
    let allowed = std::thread::available_parallelism().map_or(4, |n| n.get());
    let physical = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| physical_cores(&s));
    physical.map_or(allowed, |p| p.min(allowed)).max(1)
}

/// Distinct (physical id, core id) pairs in /proc/cpuinfo; None when the
/// file does not say (some virtual machines and architectures).
fn physical_cores(cpuinfo: &str) -> Option<usize> {
    let mut cores = std::collections::HashSet::new();
    for block in cpuinfo.split("\n\n") {
        let field = |name: &str| {
            block.lines().find_map(|l| {
                let (k, v) = l.split_once(':')?;
                (k.trim() == name).then(|| v.trim().to_string())
            })
        };
        if let (Some(p), Some(c)) = (field("physical id"), field("core id")) {
            cores.insert((p, c));
        }
    }
    (!cores.is_empty()).then_some(cores.len())
}

/// Threads of the host's CPU backend in hybrid decode: beside a GPU, all
/// cores but one, which the thread driving the GPU and its copies needs (on
/// the 16-core H100 machine, 16 threads decoded at 2.91 t/s and 15 at 3.98:
/// a pool thread sharing its core with the driver stalls every group).
pub(super) fn host_threads(device: Device, n_threads: usize) -> usize {
    if device.is_cpu() {
        return n_threads;
    }
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    n_threads.min(cores.saturating_sub(1)).max(1)
}

#[cfg(test)]
mod default_threads_tests {
    use super::*;

    #[test]
    fn physical_cores_count_core_ids_not_hyperthreads() {
        let cpu =
            |p: u32, c: u32| format!("processor\t: x\nphysical id\t: {p}\ncore id\t\t: {c}\n");
        // two sockets, two cores each, two threads per core
        let info: Vec<String> = [
            (0, 0),
            (0, 0),
            (0, 1),
            (0, 1),
            (1, 0),
            (1, 0),
            (1, 1),
            (1, 1),
        ]
        .iter()
        .map(|&(p, c)| cpu(p, c))
        .collect();
        assert_eq!(physical_cores(&info.join("\n")), Some(4));
        assert_eq!(physical_cores("processor\t: 0\nmodel name\t: x\n"), None);
        assert!(default_threads() >= 1);
    }
}

#[cfg(test)]
mod mixture_options_tests {
    use super::*;

    #[test]
    fn only_the_mixture_flags_that_are_set_are_named() {
        let mut cfg = EngineConfig::default();
        assert!(cfg.mixture_only_options().is_empty());
        cfg.paging.look_ahead = 4;
        cfg.expert_stats = true;
        assert_eq!(
            cfg.mixture_only_options(),
            ["--look-ahead", "--expert-stats"]
        );
        cfg.paging.hot = crate::paging::HotExperts::Force(8);
        cfg.paging.split.mode = crate::paging::ExpertSplit::Auto;
        assert_eq!(
            cfg.mixture_only_options(),
            [
                "--hot-experts",
                "--look-ahead",
                "--expert-split",
                "--expert-stats"
            ]
        );
        cfg.paging.routed = crate::paging::RoutedUploads::Auto;
        assert_eq!(cfg.mixture_only_options().len(), 4);
        cfg.paging.routed = crate::paging::RoutedUploads::Force;
        assert_eq!(
            cfg.mixture_only_options().last(),
            Some(&"--routed-uploads on")
        );
        cfg.repack_experts = false;
        assert_eq!(
            cfg.mixture_only_options().last(),
            Some(&"--no-repack-experts")
        );
    }
}
