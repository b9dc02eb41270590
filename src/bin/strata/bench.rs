//! `strata bench`: prompt processing, generation and batched decode at a
//! GPU budget, side by side with llama.cpp on the same file, printing
//! tokens/s and what each step streamed, waited and overlapped.

use super::workloads::{batched, depth_of, workloads, Workload};
use anyhow::{Context as _, Result};
use clap::Args;
use std::path::PathBuf;
use std::time::Instant;
use strata::engine::timeline::{write_chrome_trace, Overlap, Span, Stream};
use strata::engine::{BatchToken, Engine, EngineConfig};
use strata::llama::{CpuExperts, LlamaModel};
#[cfg(feature = "reference")]
use strata::llama::{Reference, ReferenceConfig};

#[derive(Args)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: super::ModelArgs,
    /// Prompt-processing tests (tokens), comma separated.
    #[arg(
        short = 'p',
        long = "n-prompt",
        value_delimiter = ',',
        default_value = "512"
    )]
    pub pp: Vec<u32>,
    /// Generation test (tokens); 0 skips it.
    #[arg(short = 'n', long = "n-gen", default_value_t = 32)]
    pub tg: u32,
    /// Batched decode tests: number of sequences, comma separated.
    #[arg(
        short = 'B',
        long = "batch-seqs",
        value_delimiter = ',',
        default_value = "8"
    )]
    pub batched: Vec<u32>,
    /// Tokens already in the KV cache (sequence 0) before the generation
    /// test: filled without computing, so long-context decode can be timed
    /// without a long prefill (e.g. 32000).
    #[arg(long, default_value_t = 0)]
    pub depth: u32,
    /// llama.cpp keeps its KV cache in host memory and attends on the CPU
    /// (its -nkvo).
    #[arg(long = "llama-nkvo")]
    pub llama_nkvo: bool,
    /// Decode steps per batched test.
    #[arg(long = "batch-steps", default_value_t = 8)]
    pub batch_steps: u32,
    /// Repetitions per test (the median is reported).
    #[arg(short = 'r', long, default_value_t = 3)]
    pub reps: usize,
    /// No unmeasured run of each test before its timed repetitions
    /// (llama-bench's --no-warmup). By default every engine runs each test
    /// once untimed first, as llama-bench does: strata's calibration and
    /// ggml's CUDA graphs then start the timed runs settled for both.
    #[arg(long = "no-warmup")]
    pub no_warmup: bool,
    /// Also time llama.cpp with these numbers of GPU layers (e.g. 24,99).
    #[arg(long = "llama-ngl", value_delimiter = ',')]
    pub llama_ngl: Vec<i32>,
    /// llama.cpp's physical batch (n_ubatch), as llama-bench defaults it.
    #[arg(long = "llama-ubatch", default_value_t = 512)]
    pub llama_ubatch: u32,
    /// Time llama.cpp configured like strata computes (no weight repacking,
    /// flash attention on) instead of with its default settings.
    #[arg(long = "llama-match")]
    pub llama_match: bool,
    /// llama.cpp reads its weights into host buffers, pinned where a GPU is
    /// loaded, instead of mapping the file (its --no-mmap): the copies its
    /// scheduler makes of host weights for big batches then run at bus
    /// speed.
    #[arg(long = "llama-no-mmap")]
    pub llama_no_mmap: bool,
    /// llama.cpp keeps its CPU weights in plain memory (its --no-repack).
    #[arg(long = "llama-no-repack")]
    pub llama_no_repack: bool,
    /// llama.cpp keeps the expert tensors of the first N layers of a
    /// mixture of experts in CPU memory, everything else placed by
    /// --llama-ngl (its --n-cpu-moe N), on the rows with every layer on the
    /// GPU (--llama-ngl 99, and the rows --llama-best adds); rows of partial
    /// offload keep llama.cpp's default placement. Several (e.g. 30,31)
    /// time each, so the fastest that fits strata's GPU memory is found.
    /// Refused on a model without experts.
    #[arg(
        long = "llama-n-cpu-moe",
        value_name = "N",
        value_delimiter = ',',
        conflicts_with = "llama_cpu_moe"
    )]
    pub llama_n_cpu_moe: Vec<u32>,
    /// llama.cpp keeps every layer's expert tensors in CPU memory (its
    /// --cpu-moe), on the rows with every layer on the GPU. Refused on a
    /// model without experts.
    #[arg(long = "llama-cpu-moe")]
    pub llama_cpu_moe: bool,
    /// Time llama.cpp under its default settings and under the flags its
    /// users pick for big batches at partial offload (--no-mmap -ub 2048),
    /// each test under both; ratios are also printed against the faster of
    /// them that used no more GPU memory than strata. On a mixture of
    /// experts with --llama-n-cpu-moe N (or --llama-cpu-moe), also every
    /// layer on the GPU but those experts (ngl 99 --n-cpu-moe N), under
    /// both settings. With --spec-replay, llama.cpp's speculative decoding
    /// runs with its defaults and with --no-mmap.
    #[arg(long = "llama-best")]
    pub llama_best: bool,
    /// Skip strata (time llama.cpp only).
    #[arg(long = "no-strata")]
    pub no_strata: bool,
    /// A mixture with hot experts: re-choose them from the router's
    /// counts after each repetition, as `strata serve` does between
    /// requests (`Engine::refresh_hot`), and say what moved.
    #[arg(long = "hot-refresh")]
    pub hot_refresh: bool,
    /// Print results as JSON lines.
    #[arg(long)]
    pub json: bool,
    /// Write a Chrome/Perfetto trace of the generation test's last
    /// repetition (of the first test's when there is no generation test).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// The test --trace follows instead, by its printed name (pp2048,
    /// tg16, batched64x8, ...).
    #[arg(long = "trace-test", value_name = "NAME", requires = "trace")]
    pub trace_test: Option<String>,
    #[command(flatten)]
    pub spec: super::spec::SpecArgs,
    /// Speculative step costs: the target step with 1 + k tokens and the
    /// draft model's time for k tokens, for each k (e.g. 0,4,8,16).
    #[arg(long = "spec-k", value_delimiter = ',')]
    pub spec_k: Vec<usize>,
    /// Speculative generation: N greedy tokens on each of a fixed set of
    /// code and chat prompts, plain and with the drafter (-md or --lookup).
    #[arg(long = "spec-gen", value_name = "N", default_value_t = 0)]
    pub spec_gen: usize,
    /// Speculative acceptance: N greedy tokens on each of 40 prompts (20
    /// code, 20 chat) with the drafter; accepted tokens per target step for
    /// each category.
    #[arg(long = "spec-accept", value_name = "N", default_value_t = 0)]
    pub spec_accept: usize,
    /// With --spec-accept: write every round (the drafts' shape, the nodes
    /// accepted) to FILE, an acceptance trace for --spec-replay.
    #[arg(long = "spec-record", value_name = "FILE")]
    pub spec_record: Option<PathBuf>,
    /// Speculative decoding measured end to end at a recorded pair's
    /// acceptance: with the draft model (-md), rounds take the shape and
    /// accepted nodes of FILE's rounds (code and chat in turn), everything
    /// else runs for real; N tokens per category (--spec-replay-n). Several
    /// files (comma-separated) are replayed in turn; llama.cpp's anchor
    /// (--llama-ngl) replays the first.
    #[arg(long = "spec-replay", value_name = "FILE", value_delimiter = ',')]
    pub spec_replay: Vec<PathBuf>,
    #[arg(long = "spec-replay-n", value_name = "N", default_value_t = 64)]
    pub spec_replay_n: usize,
}

/// One measured test.
#[derive(serde::Serialize)]
struct Row {
    engine: String,
    test: String,
    #[serde(rename = "tokens_per_s")]
    tps: f64,
    #[serde(rename = "runs")]
    tps_all: Vec<f64>,
    step: Option<StepFigures>,
    /// GPU memory the engine held: the device's free memory before it was
    /// loaded less the least free after its tests (None on the CPU).
    gpu_mib: Option<f64>,
}

/// What every `--json` line names besides its figures: the model, the
/// device and the build, so lines from different runs can be told apart.
#[derive(serde::Serialize)]
struct RunInfo {
    model: String,
    device: String,
    build: BuildInfo,
}

#[derive(serde::Serialize)]
struct BuildInfo {
    strata: &'static str,
    ggml: String,
    ggml_source: &'static str,
    cpu_variants: &'static str,
}

impl RunInfo {
    fn new(model: &std::path::Path, device: String) -> RunInfo {
        RunInfo {
            model: model
                .file_name()
                .map_or_else(String::new, |n| n.to_string_lossy().into_owned()),
            device,
            build: BuildInfo {
                strata: env!("CARGO_PKG_VERSION"),
                ggml: strata::ggml::version(),
                ggml_source: env!("STRATA_GGML_SOURCE"),
                cpu_variants: strata::sys::CPU_VARIANTS,
            },
        }
    }
}

#[derive(serde::Serialize)]
struct StepFigures {
    step_ms: f64,
    /// The trace's copy spans imply more than twice the probed bus rate:
    /// spans collapsed (their watcher threads were held up), so the copy
    /// rate, compute wait and overlap from them are not to be trusted.
    trace_unreliable: bool,
    /// MiB read from the model file per step (DRAM tier), and its rate.
    disk_mib: f64,
    disk_gbs: f64,
    #[serde(rename = "mib_uploaded")]
    mib_up: f64,
    copy_gbs: f64,
    #[serde(rename = "compute_wait_ms")]
    wait_ms: f64,
    overlap: f64,
    floor_ms: f64,
    /// Time per step the pager waited for disk reads (DRAM tier).
    read_wait_ms: f64,
    /// KV MiB per step up to the GPU and back (windowed layers).
    kv_up_mib: f64,
    /// MiB per step that went up over another GPU's bus (not in `mib_up`).
    relayed_mib: f64,
    kv_down_mib: f64,
    /// Hybrid decode, per step: host CPU compute, groups, GB/s of weights
    /// it read, residual hops; and the plan's predicted step.
    cpu_ms: f64,
    cpu_groups: f64,
    cpu_gbs: f64,
    hop_ms: f64,
    predicted_ms: f64,
    /// The same with the CPU at the speed the steps before each showed
    /// (the calibration's estimate as the step began: a prediction, not a
    /// fit), and the speed all of them showed as a factor on the probe's
    /// time per byte.
    measured_cpu_predicted_ms: f64,
    cpu_factor: f64,
    /// The same with the bus too at the rate these steps showed, and the
    /// bus rate the load-time probe read beside the CPU (GB/s; 0: none).
    rates_predicted_ms: f64,
    bus_probe_gbs: f64,
    /// Hot experts: routed picks per step of the layers with hot experts
    /// on the GPU, and the share of them the GPU computed (its hit rate).
    expert_picks: f64,
    hot_hit: f64,
    /// Look-ahead: the share of the picks of predicted layers (beyond hot
    /// experts) the prefetched experts caught, the share of all picks on
    /// the GPU, and experts and MiB uploaded per step.
    ahead_hit: f64,
    gpu_share: f64,
    ahead_experts: f64,
    ahead_mib: f64,
    /// Routed uploads, per step: groups routed, their MiB whole, the MiB
    /// the plan expected them to carry, and those they carried ahead of
    /// their routers and after; per group, experts sent ahead, after, and
    /// picked.
    routed_groups: f64,
    routed_whole_mib: f64,
    routed_expected_mib: f64,
    routed_ahead_mib: f64,
    routed_after_mib: f64,
    routed_ahead_experts: f64,
    routed_after_experts: f64,
    routed_picked: f64,
    /// Routed steps: the share of steps that ran routed in place of the
    /// hybrid plan's step, and, per step predicted, the routed step's
    /// prediction; per step chosen over the hybrid one, that one's and
    /// the factor on the probe's CPU time it took.
    routed_over_hybrid: f64,
    routed_predicted_share: f64,
    routed_predicted_ms: f64,
    routed_hybrid_ms: f64,
    routed_hybrid_factor: f64,
}

#[cfg(any(feature = "reference", test))]
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        0.0
    } else {
        v[v.len() / 2]
    }
}

/// The index of the value [`median`] reports (the upper middle of an even
/// count); 0 for an empty slice.
fn median_index(v: &[f64]) -> usize {
    let mut order: Vec<usize> = (0..v.len()).collect();
    order.sort_by(|&a, &b| v[a].total_cmp(&v[b]));
    order.get(v.len() / 2).copied().unwrap_or(0)
}

/// Runs one repetition of a test; `bw`: the probed pinned host-to-device
/// rate (bytes/s; 0 where none was measured).
fn time_strata(
    e: &mut Engine,
    pre: &[Vec<BatchToken>],
    run: &[Vec<BatchToken>],
    bw: f64,
) -> Result<(f64, Option<StepFigures>, Vec<Span>)> {
    e.clear();
    let depth = if pre.is_empty() { depth_of(run) } else { 0 };
    if depth > 0 {
        e.fill_synthetic(0, depth)?;
    }
    for b in pre {
        e.decode(b)?;
    }
    e.start_timeline();
    let disk0 = e.store().disk_bytes_read();
    let wait0 = e.store().read_wait();
    let (mut kv_up, mut kv_down) = (0u64, 0u64);
    let mut relayed = 0u64;
    let mut routed = strata::engine::RoutedStats::default();
    let mut host = strata::engine::host::HostStats::default();
    let (mut predicted, mut cal_predicted) = (0.0, 0.0);
    let t0 = Instant::now();
    let mut tokens = 0usize;
    for b in run {
        // predicted before the step runs: at the probe's rates, and at
        // the host's speed the steps before it showed (the untimed run's
        // and the earlier timed ones'; the calibration counts each step
        // after it ran)
        for c in b.chunks(e.n_batch() as usize) {
            // the parts of a model split across devices run in turn (a
            // layer range each), or at once (the row split)
            let parts = e
                .parts()
                .map(|e| e.plan.placement.predicted_step_s(c.len() as u32));
            let p = if e.spec.shard.is_some() {
                parts.fold(0.0, f64::max)
            } else {
                parts.sum()
            };
            predicted += p;
            cal_predicted += e.cpu_calibration(c.len() as u32).map_or(p, |c| c.1);
        }
        e.decode(b)?;
        kv_up += e.last_step.kv.up_bytes;
        relayed += e.last_step.pager.relayed;
        routed.add(&e.last_step.routed);
        kv_down += e.last_step.kv.down_bytes;
        let h = e.last_step.host;
        host.groups += h.groups;
        host.bytes += h.bytes;
        host.compute += h.compute;
        host.hops += h.hops;
        host.picks += h.picks;
        host.hot_picks += h.hot_picks;
        host.ahead_picks += h.ahead_picks;
        host.ahead_hits += h.ahead_hits;
        host.ahead_experts += h.ahead_experts;
        host.ahead_bytes += h.ahead_bytes;
        tokens += b.len();
    }
    let secs = t0.elapsed().as_secs_f64();
    let spans = e.finish_timeline();
    let read_wait = (e.store().read_wait() - wait0).as_secs_f64();
    let disk = (e.store().disk_bytes_read() - disk0) as f64;
    let steps = run
        .iter()
        .map(|b| b.len().div_ceil(e.n_batch() as usize))
        .sum::<usize>()
        .max(1);
    let o = Overlap::of(&spans);
    // the prediction at both rates these steps showed
    let (mut rates_predicted, mut bus_probe) = (0.0, 0.0);
    for c in run.iter().flat_map(|b| b.chunks(e.n_batch() as usize)) {
        let n = c.len() as u32;
        match e.predict_at_bus(n, o.copy_bw()) {
            Some((p, probe)) => {
                rates_predicted += p;
                bus_probe = probe.unwrap_or(0.0);
            }
            None => rates_predicted += e.plan.placement.predicted_step_s(n),
        }
    }
    let fig = StepFigures {
        step_ms: secs * 1e3 / steps as f64,
        trace_unreliable: bw > 0.0 && o.copy_bw() > 2.0 * bw,
        disk_mib: disk / steps as f64 / (1u64 << 20) as f64,
        disk_gbs: disk / secs / 1e9,
        mib_up: o.bytes as f64 / steps as f64 / (1u64 << 20) as f64,
        copy_gbs: o.copy_bw() / 1e9,
        wait_ms: ((secs - o.compute_s).max(0.0)) * 1e3 / steps as f64,
        overlap: if o.copy_s > 0.0 {
            o.overlapped_s / o.copy_s
        } else {
            0.0
        },
        floor_ms: (o.bytes as f64 / bw.max(1.0)).max(o.compute_s) * 1e3 / steps as f64,
        read_wait_ms: read_wait * 1e3 / steps as f64,
        kv_up_mib: kv_up as f64 / steps as f64 / (1u64 << 20) as f64,
        relayed_mib: relayed as f64 / steps as f64 / (1u64 << 20) as f64,
        kv_down_mib: kv_down as f64 / steps as f64 / (1u64 << 20) as f64,
        cpu_ms: host.compute.as_secs_f64() * 1e3 / steps as f64,
        cpu_groups: host.groups as f64 / steps as f64,
        cpu_gbs: host.bytes as f64 / host.compute.as_secs_f64().max(1e-9) / 1e9,
        hop_ms: host.hops.as_secs_f64() * 1e3 / steps as f64,
        predicted_ms: predicted * 1e3 / steps as f64,
        measured_cpu_predicted_ms: cal_predicted * 1e3 / steps as f64,
        cpu_factor: e
            .cpu_calibration(usual_step(run, e.n_batch()))
            .map_or(1.0, |c| c.0),
        rates_predicted_ms: rates_predicted * 1e3 / steps as f64,
        bus_probe_gbs: bus_probe / 1e9,
        expert_picks: host.picks as f64 / steps as f64,
        hot_hit: host.hot_picks as f64 / host.picks.max(1) as f64,
        ahead_hit: host.ahead_hits as f64 / host.ahead_picks.max(1) as f64,
        gpu_share: (host.hot_picks + host.ahead_hits) as f64 / host.picks.max(1) as f64,
        ahead_experts: host.ahead_experts as f64 / steps as f64,
        ahead_mib: host.ahead_bytes as f64 / steps as f64 / (1u64 << 20) as f64,
        routed_groups: routed.groups as f64 / steps as f64,
        routed_whole_mib: routed.whole_bytes as f64 / steps as f64 / (1u64 << 20) as f64,
        routed_expected_mib: routed.expected_bytes / steps as f64 / (1u64 << 20) as f64,
        routed_ahead_mib: routed.ahead_bytes as f64 / steps as f64 / (1u64 << 20) as f64,
        routed_after_mib: routed.after_bytes as f64 / steps as f64 / (1u64 << 20) as f64,
        routed_ahead_experts: routed.ahead as f64 / routed.groups.max(1) as f64,
        routed_after_experts: routed.after as f64 / routed.groups.max(1) as f64,
        routed_picked: routed.picked as f64 / routed.groups.max(1) as f64,
        routed_over_hybrid: routed.over_hybrid as f64 / steps as f64,
        routed_predicted_share: routed.predicted as f64 / steps as f64,
        routed_predicted_ms: routed.predicted_s * 1e3 / routed.predicted.max(1) as f64,
        routed_hybrid_ms: routed.hybrid_s * 1e3 / routed.over_hybrid.max(1) as f64,
        routed_hybrid_factor: routed.hybrid_factor / routed.over_hybrid.max(1) as f64,
    };
    Ok((tokens as f64 / secs, Some(fig), spans))
}

#[cfg(feature = "reference")]
fn time_llama(r: &mut Reference, pre: &[Vec<BatchToken>], run: &[Vec<BatchToken>]) -> Result<f64> {
    let conv = |b: &Vec<BatchToken>| {
        b.iter()
            .map(|t| (t.token, t.pos, t.seq, t.logits))
            .collect::<Vec<_>>()
    };
    r.clear();
    let depth = if pre.is_empty() { depth_of(run) } else { 0 };
    if depth > 0 {
        r.fill_kv(0, depth)?;
    }
    for b in pre {
        r.decode(&conv(b))?;
    }
    let t0 = Instant::now();
    let mut tokens = 0usize;
    for b in run {
        r.decode(&conv(b))?;
        tokens += b.len();
    }
    Ok(tokens as f64 / t0.elapsed().as_secs_f64())
}

pub fn bench(a: BenchArgs) -> Result<()> {
    if a.no_strata && a.llama_ngl.is_empty() {
        anyhow::bail!("--no-strata times llama.cpp only: give it --llama-ngl N");
    }
    super::check_model_path(&a.model.model, "model file")?;
    check_expert_flags(&a)?;
    let mut cfg = super::engine_config(&a.model, true);
    let max_pp = a.pp.iter().copied().max().unwrap_or(0);
    let max_seqs = a.batched.iter().copied().max().unwrap_or(1);
    cfg.n_ctx = cfg
        .n_ctx
        .max(max_pp + a.tg + 16)
        .max(a.depth + a.tg + 16)
        .max(max_seqs * (16 + a.batch_steps) + 16)
        .max(a.depth.max(64) + a.spec_k.iter().copied().max().unwrap_or(0) as u32 + 16)
        .max(if a.spec_gen > 0 {
            512 + a.spec_gen as u32
        } else {
            0
        })
        .max(if a.spec_accept > 0 {
            512 + a.spec_accept as u32
        } else {
            0
        })
        .max(if !a.spec_replay.is_empty() {
            a.depth.max(64) + a.spec_replay_n as u32 + 64 + 2 * super::spec::MAX_TREE as u32
        } else {
            0
        });
    let mut tests: Vec<(String, Workload)> = Vec::new();
    let mut rows = Vec::new();
    let mut trace_spans: Vec<Span> = Vec::new();
    // the device both engines compute on (llama.cpp's unoffloaded layers
    // on the CPU)
    let gpu = match cfg.device {
        strata::engine::DeviceChoice::Cpu | strata::engine::DeviceChoice::Remote => None,
        _ => strata::ggml::gpu_device().ok().flatten(),
    };
    let device = match gpu {
        Some(g) => g.description(),
        None => strata::ggml::cpu_device()?.description(),
    };
    let info = RunInfo::new(&a.model.model, device);
    let json = a.json.then_some(&info);
    if !a.no_strata {
        let free0 = free_mib(gpu);
        let draft = super::spec::load_draft(&a.spec, &mut cfg)?;
        let mut e = Engine::load(&a.model.model, &cfg).context("loading strata")?;
        let vocab = if a.spec.enabled() {
            Some(LlamaModel::load(&a.model.model, true, 0).context("loading the vocabulary")?)
        } else {
            None
        };
        let mut spec = match &vocab {
            Some(v) => super::spec::speculator(&a.spec, draft, &e, v, &a.model.model)?,
            None => None,
        };
        let n_vocab = e.n_vocab();
        let bw = e.measure_h2d(256 << 20, 8).unwrap_or(0.0);
        eprintln!(
            "strata: {} on {}: {}",
            e.spec.name,
            e.device().description(),
            e.placement_summary()
        );
        for p in e.parts() {
            if e.next_part().is_some() {
                eprintln!("{} on {}:", p.part_label(), p.device().description());
            }
            eprintln!("{}", p.plan);
        }
        eprintln!("measured pinned host-to-device copy: {:.1} GB/s", bw / 1e9);

        build_tests(&a, n_vocab, &mut tests);
        // the test named, else the generation test's steps, else the
        // first test's
        let traced = match &a.trace_test {
            Some(t) => tests.iter().position(|(n, _)| n == t).with_context(|| {
                let names: Vec<&str> = tests.iter().map(|(n, _)| n.as_str()).collect();
                format!("--trace-test {t}: no such test here ({})", names.join(", "))
            })?,
            None => tests
                .iter()
                .position(|(n, _)| n.starts_with("tg"))
                .unwrap_or(0),
        };
        for (i, (name, (pre, run))) in tests.iter().enumerate() {
            // when each test starts, for logs and samplers beside the run
            tracing::info!("bench: {name} starts");
            let mut all = Vec::new();
            let mut figs = Vec::new();
            if !a.no_warmup {
                time_strata(&mut e, pre, run, bw)?;
            }
            for _ in 0..a.reps.max(1) {
                let (tps, f, spans) = time_strata(&mut e, pre, run, bw)?;
                all.push(tps);
                if a.hot_refresh {
                    if let Some(r) = e.refresh_hot()? {
                        let hit = f.as_ref().map_or(0.0, |f| f.hot_hit);
                        eprintln!(
                            "{name}: {:.1}% of the picks on the GPU; hot experts re-chosen in {} layers ({:.1} MiB copied){}",
                            100.0 * hit,
                            r.groups,
                            r.bytes as f64 / (1u64 << 20) as f64,
                            r.expected_hit.map_or(String::new(), |x| format!(
                                ", {:.1}% of the counted picks in the sets now",
                                100.0 * x
                            ))
                        );
                    }
                }
                figs.push(f);
                if i == traced {
                    trace_spans = spans;
                }
            }
            // the step figures of the repetition whose tokens/s is
            // reported: a shape's second run, where ggml captures its CUDA
            // graphs, can show spans that collapsed (see timeline.rs)
            let rep = median_index(&all);
            let fig = figs.into_iter().nth(rep).flatten();
            rows.push(Row {
                engine: format!("strata {}", budget_label(&a.model)),
                test: name.clone(),
                tps: all[rep],
                tps_all: all,
                step: fig,
                gpu_mib: used_mib(gpu, free0),
            });
            print_row(rows.last().expect("row"), json);
        }
        if let Some(r) = e.router_counts().filter(|r| r.picks() > 0) {
            println!("{r}");
            if a.model.saves_counts() {
                super::save_router_counts(&a.model.counts_path(), r)?;
            }
        }
        if let Some((n, moves, trials)) = e.thread_tuning().filter(|_| json.is_none()) {
            println!(
                "{:<47} CPU threads at the end: {n} (the tuner judged {trials} trials, moved {moves} times; -t fixes the count)",
                ""
            );
        }
        if !a.spec_k.is_empty() {
            let spans = super::bench_spec::step_costs(
                &mut e,
                spec.as_mut(),
                &a.spec_k,
                a.depth.max(64),
                a.reps,
                a.json,
                a.trace.is_some(),
            )?;
            if !spans.is_empty() {
                trace_spans = spans;
            }
        }
        if a.spec_gen > 0 {
            let (Some(sp), Some(v)) = (spec.as_mut(), vocab.as_ref()) else {
                anyhow::bail!("--spec-gen needs a drafter: -md FILE or --lookup N");
            };
            super::bench_spec::generation(&mut e, v, sp, a.spec_gen, a.json)?;
        }
        if a.spec_accept > 0 {
            let (Some(sp), Some(v)) = (spec.as_mut(), vocab.as_ref()) else {
                anyhow::bail!("--spec-accept needs a drafter: -md FILE or --lookup N");
            };
            let pair = super::bench_spec::pair_name(&a.model.model, a.spec.model_draft.as_deref());
            super::bench_spec::acceptance(
                &mut e,
                v,
                sp,
                a.spec_accept,
                &pair,
                a.spec_record.as_deref(),
                a.json,
            )?;
        }
        if !a.spec_replay.is_empty() {
            let (Some(sp), Some(v)) = (spec.as_mut(), vocab.as_ref()) else {
                anyhow::bail!("--spec-replay needs a draft model: -md FILE");
            };
            super::bench_spec::replay(
                &mut e,
                v,
                sp,
                &a.spec_replay,
                a.spec_replay_n,
                a.depth.max(64),
                a.json,
            )?;
        }
    }
    llama_rows(&a, &cfg, max_seqs, gpu, &mut tests, &mut rows, json)?;
    llama_spec(&a, &cfg, gpu)?;
    if !a.json {
        print_ratios(&rows);
    }
    if let Some(p) = &a.trace {
        write_chrome_trace(&trace_spans, p).with_context(|| format!("writing {}", p.display()))?;
        let copies = trace_spans
            .iter()
            .filter(|s| s.stream == Stream::Copy)
            .count();
        eprintln!(
            "trace: {} spans ({copies} copies) written to {}",
            trace_spans.len(),
            p.display()
        );
    }
    Ok(())
}

/// The expert placements `--llama-n-cpu-moe N[,N...]` or `--llama-cpu-moe`
/// ask of llama.cpp (each distinct one once, in the order given), with
/// the flag that asked.
fn expert_flag(a: &BenchArgs) -> Option<(&'static str, Vec<CpuExperts>)> {
    if !a.llama_n_cpu_moe.is_empty() {
        let mut v = Vec::new();
        for &n in &a.llama_n_cpu_moe {
            if !v.contains(&CpuExperts::FirstLayers(n)) {
                v.push(CpuExperts::FirstLayers(n));
            }
        }
        return Some(("--llama-n-cpu-moe", v));
    }
    a.llama_cpu_moe
        .then(|| ("--llama-cpu-moe", vec![CpuExperts::All]))
}

/// Refuses the expert-placement flags where they could not change what is
/// timed: without `--llama-ngl` (no llama.cpp row) or on a model without
/// experts (`{arch}.expert_count` absent or 0).
fn check_expert_flags(a: &BenchArgs) -> Result<()> {
    let Some((flag, _)) = expert_flag(a) else {
        return Ok(());
    };
    if a.llama_ngl.is_empty() {
        anyhow::bail!("{flag} places llama.cpp's expert tensors: give it --llama-ngl N");
    }
    let path = &a.model.model;
    let f = strata::gguf::GgufFile::open(path)
        .with_context(|| format!("{flag}: reading {}", path.display()))?;
    let arch = f
        .get_str("general.architecture")
        .with_context(|| format!("{flag}: {}", path.display()))?;
    let key = format!("{arch}.expert_count");
    let n = f
        .get_u32_opt(&key)
        .with_context(|| format!("{flag}: {}", path.display()))?
        .unwrap_or(0);
    if n == 0 {
        anyhow::bail!(
            "{flag}: {} is not a mixture of experts ({key} is {}), so it has no expert tensors to keep on the CPU",
            path.display(),
            if f.get(&key).is_some() { "0" } else { "absent" }
        );
    }
    Ok(())
}

/// Times llama.cpp in each configuration the flags ask for (each
/// `--llama-ngl`, ...) on the same tests, adding a row per test.
#[cfg(feature = "reference")]
fn llama_rows(
    a: &BenchArgs,
    cfg: &EngineConfig,
    max_seqs: u32,
    gpu: Option<strata::ggml::Device>,
    tests: &mut Vec<(String, Workload)>,
    rows: &mut Vec<Row>,
    json: Option<&RunInfo>,
) -> Result<()> {
    let mut probe = Vec::new();
    build_tests(a, 1, &mut probe);
    if probe.is_empty() {
        // nothing for these rows to time (--spec-replay times its own)
        return Ok(());
    }
    for c in llama_configs(a) {
        llama_config_rows(a, cfg, max_seqs, gpu, &c, tests, rows, json)?;
    }
    Ok(())
}

/// One configuration of llama.cpp: its model and context flags and the
/// label its rows carry.
#[cfg(feature = "reference")]
#[derive(Clone, Debug, PartialEq)]
struct LlamaConfig {
    ngl: i32,
    cpu_experts: CpuExperts,
    mmap: bool,
    repack: bool,
    ubatch: u32,
    label: String,
}

/// The configurations `--llama-*` ask for, at each `--llama-ngl`: the one
/// the flags set, and with `--llama-best` also its users' flags for big
/// batches at partial offload (--no-mmap -ub 2048) where they differ. On a
/// mixture of experts with `--llama-n-cpu-moe N[,N...]` (or
/// `--llama-cpu-moe`), an `--llama-ngl` of every layer runs each of those
/// placements, and `--llama-best` adds what its users run such a model
/// with: every layer on the GPU (ngl 99) but those expert tensors, each
/// placement under both settings, unless an `--llama-ngl` already timed
/// it.
#[cfg(feature = "reference")]
fn llama_configs(a: &BenchArgs) -> Vec<LlamaConfig> {
    let placements = expert_flag(a).map_or(Vec::new(), |(_, e)| e);
    let label = |experts: CpuExperts, mmap: bool, repack: bool, ubatch: u32| {
        let mut l = match experts {
            CpuExperts::None => String::new(),
            CpuExperts::FirstLayers(n) => format!(" n-cpu-moe={n}"),
            CpuExperts::All => " cpu-moe".to_string(),
        };
        if !mmap {
            l += " no-mmap";
        }
        if !repack {
            l += " no-repack";
        }
        if ubatch != 512 {
            l += &format!(" ub={ubatch}");
        }
        l
    };
    let repack = !a.llama_no_repack && !a.llama_match;
    let config = |ngl: i32, cpu_experts: CpuExperts| LlamaConfig {
        ngl,
        cpu_experts,
        mmap: !a.llama_no_mmap,
        repack,
        ubatch: a.llama_ubatch,
        label: label(cpu_experts, !a.llama_no_mmap, repack, a.llama_ubatch),
    };
    // with --llama-best, each configuration also under --no-mmap -ub 2048
    let with_best = |base: LlamaConfig| {
        let best = a.llama_best.then(|| LlamaConfig {
            mmap: false,
            ubatch: 2048,
            label: label(base.cpu_experts, false, repack, 2048),
            ..base.clone()
        });
        std::iter::once(base).chain(best)
    };
    let mut v: Vec<LlamaConfig> = Vec::new();
    let push = |v: &mut Vec<LlamaConfig>, c: LlamaConfig| {
        for c in with_best(c) {
            if !v.contains(&c) {
                v.push(c);
            }
        }
    };
    // the expert placements go with every layer on the GPU (ngl >= 99),
    // as llama.cpp's users run --n-cpu-moe; rows of partial offload keep
    // its default placement, so they stay llama.cpp's defaults
    for &ngl in &a.llama_ngl {
        if ngl >= ALL_LAYERS && !placements.is_empty() {
            for &e in &placements {
                push(&mut v, config(ngl, e));
            }
        } else {
            push(&mut v, config(ngl, CpuExperts::None));
        }
    }
    // (placements passed check_expert_flags: the model has experts)
    if a.llama_best && !v.is_empty() {
        for &e in &placements {
            push(&mut v, config(ALL_LAYERS, e));
        }
    }
    v
}

/// llama.cpp's -ngl for every layer on the GPU.
#[cfg(feature = "reference")]
const ALL_LAYERS: i32 = 99;

#[cfg(feature = "reference")]
#[allow(clippy::too_many_arguments)]
fn llama_config_rows(
    a: &BenchArgs,
    cfg: &EngineConfig,
    max_seqs: u32,
    gpu: Option<strata::ggml::Device>,
    c: &LlamaConfig,
    tests: &mut Vec<(String, Workload)>,
    rows: &mut Vec<Row>,
    json: Option<&RunInfo>,
) -> Result<()> {
    // ggml's own kernels, whatever strata chose for itself
    strata::engine::reset_matmul_path();
    let free0 = free_mib(gpu);
    // llama.cpp as its users run it (flash attention auto; repacking and
    // mapping as the configuration says); --llama-match: as strata computes
    let opts = strata::llama::LoadOptions {
        n_gpu_layers: c.ngl,
        repack: c.repack,
        mmap: c.mmap,
        cpu_experts: c.cpu_experts,
    };
    let lm =
        LlamaModel::load_with_options(&a.model.model, false, &opts).context("loading llama.cpp")?;
    if tests.is_empty() {
        build_tests(a, lm.n_vocab(), tests);
    }
    let rcfg = ReferenceConfig {
        n_ctx: cfg.n_ctx,
        n_batch: a.model.logical_batch().max(cfg.n_batch).max(c.ubatch),
        n_ubatch: c.ubatch,
        n_seq: max_seqs.max(1),
        n_threads: cfg.n_threads as i32,
        offload_kqv: !a.llama_nkvo,
    };
    let mut r = if a.llama_match {
        Reference::new(&lm, &rcfg)
    } else {
        Reference::new_default_settings(&lm, &rcfg)
    }
    .context("llama.cpp context")?;
    for (name, (pre, run)) in tests.iter() {
        let mut all = Vec::new();
        if !a.no_warmup {
            time_llama(&mut r, pre, run)?;
        }
        for _ in 0..a.reps.max(1) {
            all.push(time_llama(&mut r, pre, run)?);
        }
        let mut s = all.clone();
        rows.push(Row {
            engine: format!(
                "llama.cpp ngl={}{}{}{}",
                c.ngl,
                c.label,
                if a.llama_nkvo { " nkvo" } else { "" },
                if a.llama_match { " match" } else { "" }
            ),
            test: name.clone(),
            tps: median(&mut s),
            tps_all: all,
            step: None,
            gpu_mib: used_mib(gpu, free0),
        });
        print_row(rows.last().expect("row"), json);
    }
    Ok(())
}

#[cfg(not(feature = "reference"))]
fn llama_rows(
    a: &BenchArgs,
    _: &EngineConfig,
    _: u32,
    _: Option<strata::ggml::Device>,
    _: &mut Vec<(String, Workload)>,
    _: &mut Vec<Row>,
    _: Option<&RunInfo>,
) -> Result<()> {
    if !a.llama_ngl.is_empty() {
        anyhow::bail!(
            "--llama-ngl: this strata was built without the `reference` feature (llama.cpp's decoder)"
        );
    }
    Ok(())
}

/// llama.cpp's speculative decoding at the replayed acceptance, where
/// `--spec-replay`, `--llama-ngl` and a draft model are given (at the
/// first `--llama-ngl`).
#[cfg(feature = "reference")]
fn llama_spec(a: &BenchArgs, cfg: &EngineConfig, gpu: Option<strata::ggml::Device>) -> Result<()> {
    let (Some(f), Some(&ngl), Some(draft)) = (
        a.spec_replay.first(),
        a.llama_ngl.first(),
        &a.spec.model_draft,
    ) else {
        return Ok(());
    };
    let trace = super::bench_spec::read_trace(f)?;
    // the flags' configuration, and with --llama-best also --no-mmap (its
    // steps of up to 17 tokens are below the batch ggml offloads to the
    // GPU, so -ub does not matter here)
    let mut mmaps = vec![!a.llama_no_mmap];
    if a.llama_best && !a.llama_no_mmap {
        mmaps.push(false);
    }
    for mmap in mmaps {
        strata::engine::reset_matmul_path();
        let free0 = free_mib(gpu);
        super::bench_llama_spec::run(
            &super::bench_llama_spec::LlamaSpec {
                target: &a.model.model,
                draft,
                ngl,
                mmap,
                trace: &trace,
                n: a.spec_replay_n,
                depth: a.depth.max(64),
                spec_k: &a.spec_k,
                reps: a.reps,
                n_ctx: cfg.n_ctx,
                n_threads: cfg.n_threads as i32,
                json: a.json,
            },
            || used_mib(gpu, free0),
        )?;
    }
    Ok(())
}

#[cfg(not(feature = "reference"))]
fn llama_spec(_: &BenchArgs, _: &EngineConfig, _: Option<strata::ggml::Device>) -> Result<()> {
    Ok(())
}

fn budget_label(m: &super::ModelArgs) -> String {
    let kv = m
        .kv_budget
        .map(|b| format!(" kv={:.1}G", b as f64 / (1u64 << 30) as f64))
        .unwrap_or_default();
    if m.stream_all {
        return format!("stream-all{kv}");
    }
    if m.gpu_budget.is_empty() {
        return format!("all-resident{kv}");
    }
    let b: Vec<String> = m
        .gpu_budget
        .iter()
        .map(|&b| format!("{:.1}G", b as f64 / (1u64 << 30) as f64))
        .collect();
    format!("budget={}{kv}", b.join(","))
}

fn build_tests(a: &BenchArgs, n_vocab: u32, tests: &mut Vec<(String, Workload)>) {
    tests.clear();
    for &p in a.pp.iter().filter(|&&p| p > 0) {
        tests.push((format!("pp{p}"), workloads("pp", p, n_vocab, 0)));
    }
    if a.tg > 0 {
        let name = if a.depth > 0 {
            format!("tg{}@d{}", a.tg, a.depth)
        } else {
            format!("tg{}", a.tg)
        };
        tests.push((name, workloads("tg", a.tg, n_vocab, a.depth)));
    }
    for &b in a.batched.iter().filter(|&&b| b > 0) {
        tests.push((
            format!("batched{b}x{}", a.batch_steps),
            batched(b, a.batch_steps, n_vocab),
        ));
    }
}

fn print_row(r: &Row, json: Option<&RunInfo>) {
    if let Some(info) = json {
        #[derive(serde::Serialize)]
        struct Line<'a> {
            #[serde(flatten)]
            info: &'a RunInfo,
            #[serde(flatten)]
            row: &'a Row,
        }
        match serde_json::to_string(&Line { info, row: r }) {
            Ok(l) => println!("{l}"),
            Err(e) => eprintln!("error: a result as JSON: {e}"),
        }
        return;
    }
    let gpu = r
        .gpu_mib
        .map_or(String::new(), |m| format!(", GPU {m:.0} MiB"));
    match &r.step {
        Some(f) => {
            println!(
                "{:<32} {:<14} {:>10.2} t/s | step {:>9.2} ms, up {:>8.1} MiB, copy {:>6.1} GB/s, compute waited {:>8.2} ms, overlap {:>4.0}%, floor {:>9.2} ms{gpu}",
                r.engine, r.test, r.tps, f.step_ms, f.mib_up, f.copy_gbs, f.wait_ms, f.overlap * 100.0, f.floor_ms
            );
            if f.trace_unreliable {
                println!(
                    "{:<47} (the trace's spans collapsed in this repetition: copy rate, compute wait and overlap above are not measured figures)",
                    ""
                );
            }
            if f.disk_mib > 0.0 {
                println!(
                    "{:<47} disk read {:>8.1} MiB/step at {:.2} GB/s, pager waited on reads {:.1} ms/step",
                    "", f.disk_mib, f.disk_gbs, f.read_wait_ms
                );
            }
            if f.cpu_groups > 0.0 {
                println!(
                    "{:<47} host CPU {:>8.2} ms/step ({:.1} groups at {:.1} GB/s), residual hops {:.2} ms/step; predicted step {:.2} ms (measured/predicted {:.2})",
                    "", f.cpu_ms, f.cpu_groups, f.cpu_gbs, f.hop_ms, f.predicted_ms, f.step_ms / f.predicted_ms.max(1e-9)
                );
                println!(
                    "{:<47} the CPU ran at {:.2}x its probe's time per byte; at the speed the steps before each showed the plan predicted {:.2} ms (measured/predicted {:.2})",
                    "", f.cpu_factor, f.measured_cpu_predicted_ms, f.step_ms / f.measured_cpu_predicted_ms.max(1e-9)
                );
                println!(
                    "{:<47} the bus ran at {:.1} GB/s (probed beside the CPU: {:.1}); at both rates the plan predicts {:.2} ms (measured/predicted {:.2})",
                    "", f.copy_gbs, f.bus_probe_gbs, f.rates_predicted_ms, f.step_ms / f.rates_predicted_ms.max(1e-9)
                );
            }
            // (the look-ahead alone counts picks too: no hot line then)
            if f.expert_picks > 0.0 && (f.hot_hit > 0.0 || f.ahead_experts == 0.0) {
                println!(
                    "{:<47} hot experts: {:.1} routed picks/step in their layers, {:.1}% of them on the GPU (its hit rate)",
                    "", f.expert_picks, 100.0 * f.hot_hit
                );
            }
            if f.ahead_experts > 0.0 {
                println!(
                    "{:<47} look-ahead: {:.1} experts ({:.1} MiB) up per step; they caught {:.1}% of their layers' picks beyond hot experts; {:.1}% of all picks on the GPU",
                    "", f.ahead_experts, f.ahead_mib, 100.0 * f.ahead_hit, 100.0 * f.gpu_share
                );
            }
            if f.routed_groups > 0.0 {
                println!(
                    "{:<47} routed uploads: {:.1} groups/step, {:.1} MiB whole, {:.1} expected, {:.1} sent ({:.1} ahead, {:.1} after the routers); a group's experts: {:.1} ahead, {:.1} after, {:.1} picked",
                    "",
                    f.routed_groups,
                    f.routed_whole_mib,
                    f.routed_expected_mib,
                    f.routed_ahead_mib + f.routed_after_mib,
                    f.routed_ahead_mib,
                    f.routed_after_mib,
                    f.routed_ahead_experts,
                    f.routed_after_experts,
                    f.routed_picked
                );
            }
            if f.routed_predicted_share > 0.0 {
                println!(
                    "{:<47} routed steps: {:.0}% of steps, predicted {:.2} ms a step; {:.0}% of steps chosen over the hybrid plan's (predicted {:.2} ms, the CPU at {:.2}x its probe's time)",
                    "",
                    100.0 * f.routed_predicted_share,
                    f.routed_predicted_ms,
                    100.0 * f.routed_over_hybrid,
                    f.routed_hybrid_ms,
                    f.routed_hybrid_factor
                );
            }
            if f.relayed_mib > 0.0 {
                println!(
                    "{:<47} relayed {:>8.1} MiB/step over the next GPU's bus (not in up, copy or floor)",
                    "", f.relayed_mib
                );
            }
            if f.kv_up_mib > 0.0 {
                println!(
                    "{:<47} KV {:>8.1} MiB/step up, {:.3} MiB/step back (included in up and floor)",
                    "", f.kv_up_mib, f.kv_down_mib
                );
            }
        }
        None => println!(
            "{:<32} {:<14} {:>10.2} t/s{}",
            r.engine,
            r.test,
            r.tps,
            gpu.replacen(", ", " | ", 1)
        ),
    }
}

/// The free memory of every local GPU now, MiB, summed (None without a
/// GPU): a model split across GPUs counts on each, and so does llama.cpp's
/// layer split.
fn free_mib(gpu: Option<strata::ggml::Device>) -> Option<f64> {
    gpu?;
    let gpus = strata::ggml::devices().ok()?;
    Some(
        gpus.iter()
            .filter(|d| d.is_gpu() && !d.is_remote())
            .map(|g| g.memory().0 as f64 / (1u64 << 20) as f64)
            .sum(),
    )
}

/// The step size most of `run`'s steps have (batches cut at `n_batch`
/// rows; the larger on a tie): the calibration's factor is kept per band
/// of step sizes, so a test's figure is its usual step's band's.
fn usual_step(run: &[Vec<BatchToken>], n_batch: u32) -> u32 {
    let mut count: std::collections::BTreeMap<usize, usize> = Default::default();
    for c in run.iter().flat_map(|b| b.chunks(n_batch.max(1) as usize)) {
        *count.entry(c.len()).or_default() += 1;
    }
    count
        .into_iter()
        .max_by_key(|&(n, k)| (k, n))
        .map_or(1, |(n, _)| n as u32)
}

/// GPU memory taken since the device had `free0` MiB free.
fn used_mib(gpu: Option<strata::ggml::Device>, free0: Option<f64>) -> Option<f64> {
    Some((free0? - free_mib(gpu)?).max(0.0))
}

/// Ratios of strata against each llama.cpp row of the same test, only where
/// llama.cpp used no more GPU memory than strata (a faster engine holding
/// more of the model on the GPU is not the comparison a budget asks for),
/// and against the fastest such llama.cpp configuration.
fn print_ratios(rows: &[Row]) {
    let strata: Vec<&Row> = rows
        .iter()
        .filter(|r| r.engine.starts_with("strata"))
        .collect();
    let within = |s: &Row, r: &Row| match (s.gpu_mib, r.gpu_mib) {
        (Some(sg), Some(lg)) => lg <= sg,
        _ => true,
    };
    let mib = |r: &Row| {
        r.gpu_mib
            .map_or(String::new(), |m| format!(" ({m:.0} MiB)"))
    };
    let llama: Vec<&Row> = rows
        .iter()
        .filter(|r| r.engine.starts_with("llama"))
        .collect();
    for r in &llama {
        let Some(s) = strata.iter().find(|s| s.test == r.test) else {
            continue;
        };
        if within(s, r) {
            println!(
                "ratio {:<14} {}{} / {}{}: {:.2}x",
                r.test,
                s.engine,
                mib(s),
                r.engine,
                mib(r),
                s.tps / r.tps.max(1e-9)
            );
        } else {
            println!(
                "no ratio {:<11} against {}: it used{} of GPU memory, more than {}{}",
                r.test,
                r.engine,
                mib(r),
                s.engine,
                mib(s)
            );
        }
    }
    for s in &strata {
        let best = llama
            .iter()
            .filter(|r| r.test == s.test && within(s, r))
            .max_by(|a, b| a.tps.total_cmp(&b.tps));
        let configs = llama.iter().filter(|r| r.test == s.test).count();
        if let (Some(r), true) = (best, configs > 1) {
            println!(
                "best  {:<14} {}{} / the fastest llama.cpp at no more GPU memory, {}{}: {:.2}x",
                s.test,
                s.engine,
                mib(s),
                r.engine,
                mib(r),
                s.tps / r.tps.max(1e-9)
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reported repetition is the one `median` reports, whatever the
    /// order the repetitions ran in (its figures go beside its tokens/s).
    #[test]
    fn median_index_names_the_reported_repetition() {
        for v in [
            vec![5.0],
            vec![4000.0, 5400.0],
            vec![5400.0, 4000.0],
            vec![3.0, 1.0, 2.0],
            vec![2.0, 9.0, 4.0, 7.0, 1.0],
            vec![1.0, 1.0, 2.0, 2.0],
        ] {
            let i = median_index(&v);
            assert_eq!(v[i], median(&mut v.clone()), "{v:?}");
        }
        assert_eq!(median_index(&[]), 0);
    }

    /// A test's CPU factor is its usual step's band's: a batched test's
    /// 64-token steps, not the one-token band (what every row printed
    /// once the factor was kept per band).
    #[test]
    fn usual_step_is_the_most_common_chunk() {
        let batch = |n: usize| {
            (0..n)
                .map(|i| BatchToken {
                    token: 1,
                    pos: i as i32,
                    seq: 0,
                    logits: false,
                })
                .collect::<Vec<_>>()
        };
        // a 1024-token prefill cut at 512 rows, then eight 64-token steps
        let mut run = vec![batch(1024)];
        run.extend((0..8).map(|_| batch(64)));
        assert_eq!(usual_step(&run, 512), 64);
        // decode: one token a step
        assert_eq!(usual_step(&vec![batch(1); 16], 2048), 1);
        // a tie takes the larger size
        assert_eq!(usual_step(&[batch(4), batch(16)], 2048), 16);
        assert_eq!(usual_step(&[], 2048), 1);
    }

    fn args(extra: &[&str]) -> BenchArgs {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            bench: BenchArgs,
        }
        let argv = ["strata", "-m", "m.gguf"].iter().chain(extra);
        <Cli as clap::Parser>::try_parse_from(argv)
            .expect("valid flags")
            .bench
    }

    fn labels(a: &BenchArgs) -> Vec<(i32, String)> {
        llama_configs(a)
            .into_iter()
            .map(|c| (c.ngl, c.label))
            .collect()
    }

    /// Each expert placement asked for runs under both of llama.cpp's
    /// settings with every layer on the GPU, once each, beside the
    /// partial-offload rows with its default placement.
    #[test]
    fn every_expert_placement_runs_under_both_settings() {
        let a = args(&[
            "--llama-ngl",
            "18",
            "--llama-best",
            "--llama-n-cpu-moe",
            "30,31,30",
        ]);
        let want = [
            (18, ""),
            (18, " no-mmap ub=2048"),
            (99, " n-cpu-moe=30"),
            (99, " n-cpu-moe=30 no-mmap ub=2048"),
            (99, " n-cpu-moe=31"),
            (99, " n-cpu-moe=31 no-mmap ub=2048"),
        ];
        let want: Vec<_> = want.iter().map(|&(n, l)| (n, l.to_string())).collect();
        assert_eq!(labels(&a), want);
        // asked at ngl 99 directly: the same rows, not twice
        let b = args(&[
            "--llama-ngl",
            "99",
            "--llama-best",
            "--llama-n-cpu-moe",
            "30,31",
        ]);
        assert_eq!(labels(&b), want[2..].to_vec());
        // without --llama-best, only the asked rows
        let c = args(&["--llama-ngl", "99", "--llama-n-cpu-moe", "31"]);
        assert_eq!(labels(&c), vec![(99, " n-cpu-moe=31".to_string())]);
    }
}
