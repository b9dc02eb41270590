//! `strata`: generate text with a model whose weights are paged through ggml.

use anyhow::{bail, Context as _, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};
use std::io::{BufRead, Write};
use std::path::PathBuf;
use strata::engine::{
    Amx, Budgets, DeviceChoice, Engine, EngineConfig, Faults, Gemm, Hybrid, KvTierOptions,
    PagingOptions,
};
use strata::generate::Session;
use strata::llama::LlamaModel;
use strata::sample::{Sampler, SamplerConfig};
use strata::serve::chat::{ChatTemplate, Message};

mod bench;
#[cfg(feature = "reference")]
mod bench_llama_spec;
mod bench_spec;
#[cfg(feature = "reference")]
mod check;
mod rpc;
mod serve;
mod spec;
mod spec_corpus;
mod workloads;

#[derive(Parser)]
#[command(
    name = "strata",
    version,
    about = "Run LLMs larger than GPU memory by paging layer groups"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
    /// Log more: info, or with -vv debug (STRATA_LOG=FILTER overrides both).
    #[arg(short = 'v', long = "verbose", global = true, action = clap::ArgAction::Count)]
    verbose: u8,
    /// Log level: error, warn (default), info, debug or trace.
    #[arg(long = "log-level", global = true, value_parser = ["error", "warn", "info", "debug", "trace"])]
    log_level: Option<String>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate text from a prompt, or chat interactively (--chat).
    Run(RunArgs),
    /// Compare greedy tokens and logits with llama.cpp on this device.
    #[cfg(feature = "reference")]
    Check(check::CheckArgs),
    /// Measure prompt processing, generation and batched decode (vs llama.cpp).
    Bench(bench::BenchArgs),
    /// Serve the OpenAI API (chat and text completions) with continuous
    /// batching and a prefix cache.
    Serve(serve::ServeArgs),
    /// List the compute devices of the loaded backends (also: --list-devices).
    Devices(DevicesArgs),
    /// Offer this machine's devices to other strata (and llama.cpp)
    /// processes through ggml's RPC protocol, which has NO authentication:
    /// whoever reaches the port can use the devices and read their memory.
    RpcServer(rpc::RpcServerArgs),
}

#[derive(Args)]
struct DevicesArgs {
    /// Also list the devices of these RPC servers (HOST:PORT, comma-separated).
    #[arg(long, value_delimiter = ',')]
    rpc: Vec<String>,
}

#[derive(Clone, Copy, ValueEnum)]
enum DeviceArg {
    Auto,
    Cpu,
    Gpu,
    /// The devices of the --rpc servers.
    Rpc,
}

#[derive(Clone, Copy, ValueEnum)]
enum SplitArg {
    Layer,
    Row,
}

#[derive(Args)]
pub struct ModelArgs {
    /// GGUF model file.
    #[arg(short = 'm', long)]
    pub model: PathBuf,
    /// Context size in tokens (1 to 16777216).
    #[arg(short = 'c', long = "ctx-size", default_value_t = 4096,
          value_parser = clap::value_parser!(u32).range(1..=1 << 24))]
    ctx_size: u32,
    /// Logical batch, llama.cpp's -b: most tokens submitted together; each
    /// forward step takes at most --ubatch-size of them (at least 1).
    #[arg(short = 'b', long = "batch-size", default_value_t = 2048,
          value_parser = clap::value_parser!(u32).range(1..))]
    batch_size: u32,
    /// Physical batch, llama.cpp's -ub: most tokens per forward step, what
    /// the activation memory is sized for (at least 1; at most --batch-size).
    /// Streamed weights are read once per step, so long prompts at a small
    /// GPU budget run faster with larger steps.
    #[arg(long = "ubatch-size", default_value_t = 512,
          value_parser = clap::value_parser!(u32).range(1..))]
    ubatch_size: u32,
    /// CPU threads, 1 to 1024 (default: the physical cores, as llama.cpp,
    /// and fewer while that is faster: when another process takes cores,
    /// the pool's every meeting waits for the thread it took off its core).
    /// A count given here is used for every step.
    #[arg(short = 't', long, value_parser = parse_threads)]
    threads: Option<usize>,
    /// How the CPU thread pool waits for the next graph, 0 (sleep) to 100
    /// (spin longest), as llama.cpp's --poll. strata runs one graph per
    /// layer group, so polling saves a wake-up per group; on a busy machine
    /// spinning threads take cores from the process doing the work.
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(0..=100))]
    poll: u32,
    /// Compute device: auto (the local GPUs if there are any, else the
    /// CPU), cpu, gpu (the local GPUs, then the devices of the --rpc
    /// servers), or rpc (the servers' devices alone). Of several, --devices
    /// chooses; by default the model takes as many as it needs (see
    /// --devices), a remote device only what its budget holds where a
    /// local GPU can stream the rest.
    #[arg(long, value_enum, default_value_t = DeviceArg::Auto)]
    device: DeviceArg,
    /// RPC servers (`strata rpc-server`, or llama.cpp's rpc-server) whose
    /// devices are used as if local: HOST:PORT, comma-separated. ggml's RPC
    /// protocol has no authentication or encryption: use it on a trusted
    /// network only.
    #[arg(long, value_delimiter = ',')]
    rpc: Vec<String>,
    /// Count the experts a mixture's router picks, per layer, and print the
    /// share a hot set of the most picked experts would have caught. A
    /// measuring mode: the GPU finishes each mixture layer before the next
    /// is queued, and the host reads its picks.
    #[arg(long = "expert-stats")]
    expert_stats: bool,
    /// Router counts of this model (JSON): read to choose the hot experts
    /// (--hot-experts), and where --expert-stats adds what it counted when
    /// strata exits. Default: MODEL.experts.json beside the model.
    #[arg(long = "expert-counts")]
    expert_counts: Option<PathBuf>,
    /// GPU memory strata may use on each device (e.g. 12G), or per device
    /// in --devices order (12G,20G); layer groups beyond it stream from
    /// pinned host memory. Default: what each device has free, less a
    /// margin.
    #[arg(long = "gpu-budget", value_parser = strata::paging::parse_size, value_delimiter = ',')]
    pub gpu_budget: Vec<u64>,
    /// Which of the --device kind's devices to use, by index in `strata
    /// devices`' list, in layer order (e.g. 0,1): the model's layers are
    /// split into a range per device, in proportion to the budgets.
    /// Default: every GPU the model needs (the first alone where it fits).
    #[arg(long, value_delimiter = ',')]
    devices: Option<Vec<usize>>,
    /// How a model on several devices is split: layer (a range of layers
    /// per device, computed in turn) or row (every device a share of every
    /// layer's heads and FFN columns, all computing each group at once and
    /// their outputs summed; dense models without post-norms).
    #[arg(long = "split-mode", value_enum, default_value = "layer")]
    split_mode: SplitArg,
    /// The row split over two devices: steps of at least this many tokens
    /// compute each group in two halves of rows, one half's outputs
    /// exchanged while the other computes. Default: 512 where both devices
    /// are GPUs, off elsewhere; 0: off.
    #[arg(long = "row-halves")]
    row_halves: Option<u32>,
    /// The row split's halved steps on GPUs dequantize each layer group's
    /// quantized matrices once into a BF16 copy both halves multiply (a
    /// buffer of the largest group's, in each GPU's budget); this turns it
    /// off, so each half's products dequantize their weights again.
    #[arg(long = "no-row-widen")]
    no_row_widen: bool,
    /// Across several local GPUs, in steps of at least 64 tokens (prompts,
    /// batches), every other streamed FFN group of a part also goes up
    /// over the next GPU's bus and across by a peer copy (with peer access
    /// on: GGML_CUDA_P2P=1 is set for ggml unless given). Off by default;
    /// see BENCHMARKS.md, "Two GPUs".
    #[arg(long)]
    relay: bool,
    /// Device slots per group kind for streamed groups.
    #[arg(long, default_value_t = 3)]
    slots: usize,
    /// Host memory for streamed layer groups (e.g. 16G); below their size a
    /// window of them is kept and the rest is read from the model file.
    #[arg(long = "dram-budget", value_parser = strata::paging::parse_size)]
    pub dram_budget: Option<u64>,
    /// Stream every layer group whatever the budget.
    #[arg(long = "stream-all")]
    pub stream_all: bool,
    /// Which layer groups stay on the GPU when not all fit: as many of
    /// each kind spread evenly through the layers (spread: the bus then
    /// streams while resident groups compute all through a large step),
    /// the first layers' (first), or spread unless the host CPU computes
    /// streamed groups of unequal cost, where the plan may keep those it
    /// computes slowest and stream the cheap ones for it (cost; predicted
    /// faster, not measured so: BENCHMARKS.md).
    #[arg(long, default_value = "spread", value_parser = parse_resident)]
    pub resident: strata::paging::ResidentOrder,
    /// Debug: fill each slot with NaN after use, so a read before its upload
    /// completed shows as NaN.
    #[arg(long = "poison-slots")]
    poison_slots: bool,
    /// GPU memory for KV caches (e.g. 2G): the first layers keep their KV
    /// on the GPU while it lasts, the others' KV lives in host memory and
    /// travels with their attention group. Default: all of it on the GPU
    /// if it fits beside the smallest streaming working set of
    /// --gpu-budget, else as many layers' as do.
    #[arg(long = "kv-budget", value_parser = strata::paging::parse_size)]
    pub kv_budget: Option<u64>,
    /// Host memory for the KV blocks of layers beyond --kv-budget (e.g. 8G);
    /// blocks beyond it spill to files. Default: room for the whole context.
    #[arg(long = "kv-dram", value_parser = strata::paging::parse_size)]
    pub kv_dram: Option<u64>,
    /// Cells per KV block, the unit moved between GPU, DRAM and SSD (at least 1).
    #[arg(long = "kv-block", default_value_t = 256,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1 << 24))]
    pub kv_block: usize,
    /// Directory for KV spill files (default: the system temp directory).
    #[arg(long = "kv-spill-dir")]
    pub kv_spill_dir: Option<PathBuf>,
    /// Most bytes KV spill files may take.
    #[arg(long = "kv-spill-max", value_parser = strata::paging::parse_size)]
    pub kv_spill_max: Option<u64>,
    /// Hybrid decode: the host CPU computes some streamed FFN groups from
    /// its own copy while the bus streams the others. auto: when the plan
    /// predicts it pays; off; or a number: exactly that many groups at every
    /// step the CPU takes part in (on --device cpu a second CPU backend
    /// stands in for the host).
    #[arg(long, default_value = "auto", value_parser = parse_hybrid)]
    pub hybrid: Hybrid,
    /// A mixture of experts' steps of many tokens (64 sequences decoding):
    /// each streamed layer's first experts are uploaded and computed by the
    /// GPU while the host CPU computes the others' picks from its copy,
    /// both at once. off (the default: on an H200 it gave no more than
    /// noise over whole CPU groups); auto: at the step sizes where the plan
    /// predicts it beats whole CPU groups; or the number of experts per
    /// layer the GPU takes (from --split-min-tokens up, whatever the
    /// prediction). Needs hybrid decode's host copies.
    #[arg(long = "expert-split", default_value = "off", value_parser = parse_split)]
    pub expert_split: strata::paging::ExpertSplit,
    /// A mixture of experts: keep the most picked experts of each streamed
    /// layer on the GPU, which computes their picks while the host CPU
    /// computes the others' (hybrid decode and expert splits). off (the
    /// default); auto: the layers whose router counts (--expert-counts)
    /// show skew, the fewest experts that caught two thirds of their picks
    /// (where that is at most a quarter of them), in at
    /// most half the GPU memory resident groups would hold; or a number of
    /// experts per layer (the most picked, or the first where nothing was
    /// counted), in place of resident groups. The picks of the layers the
    /// host computes are counted as it runs and added to the counts file
    /// at exit; `serve` re-chooses the hot sets from them between
    /// requests.
    #[arg(long = "hot-experts", default_value = "off", value_parser = parse_hot)]
    pub hot_experts: strata::paging::HotExperts,
    /// A mixture of experts at decode (steps of up to 16 tokens): while
    /// the host CPU computes one of its layers, the next host layer's
    /// router on the current rows predicts that layer's experts, and up
    /// to this many of them (beyond hot experts) go up over the idle bus;
    /// the GPU then computes the picks they catch while the CPU computes
    /// the others. 0 (the default): off; on the H100 machine it did not
    /// pay (BENCHMARKS.md, "Look-ahead"). Needs hybrid decode's host
    /// copies in pinned memory; bench prints how often the prediction
    /// caught a pick.
    #[arg(long = "look-ahead", default_value_t = 0,
          value_parser = clap::value_parser!(u32).range(0..=256))]
    pub look_ahead: u32,
    /// How many host layers ahead --look-ahead predicts and uploads: 1, the
    /// next one (the best guess, the least time for its upload: faster on
    /// the H100 machine, run 98), or more.
    #[arg(long = "look-ahead-layers", default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=8))]
    pub look_ahead_layers: u32,
    /// A mixture of experts' steps of several tokens on the GPU: each
    /// streamed layer's experts go up only if a token of the step picked
    /// them. The router runs first, the experts its picks name (beyond
    /// those the router counts make all but sure, sent ahead) go up
    /// after it. auto (the default): the layers where the bytes the counts
    /// (--expert-counts, and this run's) predict saved outweigh the
    /// layer's wait for its router, and steps the plan would have the CPU
    /// take part in only where the routed step is predicted faster; on:
    /// every streamed mixture layer of a step of 2 or more tokens; off:
    /// whole expert groups. Given explicitly (auto or on), counts are added
    /// to the counts file at exit.
    #[arg(long = "routed-uploads", value_parser = parse_routed)]
    pub routed_uploads: Option<strata::paging::RoutedUploads>,
    /// The fewest tokens a step splits its experts at (at least 2).
    #[arg(long = "split-min-tokens", default_value_t = 32,
          value_parser = clap::value_parser!(u32).range(2..))]
    pub split_min_tokens: u32,
    /// Host groups a split step computes whole on the CPU beside its split
    /// layers (spread over the layers, the cheapest first); the other
    /// streamed mixture layers split. Default: none under a number given
    /// to --expert-split, the plan's choice under auto.
    #[arg(long = "split-whole")]
    pub split_whole: Option<u32>,
    /// Most rows an FFN group computes at once (e.g. 2048: whole steps).
    /// Default: the memory plan cuts steps of more than 1024 rows into
    /// chunks of at least 1024, only where the model does not fit the GPU
    /// budget whole, so the activations stay within what attention needs.
    #[arg(long = "ffn-rows", value_parser = clap::value_parser!(u32).range(1..))]
    pub ffn_rows: Option<u32>,
    /// How steps of many tokens multiply quantized weights on the GPU.
    /// auto: a probe at load times ggml's quantized kernels against
    /// dequantize + BF16 tensor-core GEMM at several step sizes and takes
    /// GEMM from where it is faster (its scratch comes out of the GPU
    /// budget); off: ggml's kernels at every size, no scratch; or a number:
    /// GEMM for steps of more than that many tokens.
    #[arg(long, default_value = "auto", value_parser = parse_gemm)]
    pub gemm: Gemm,
    /// Keep CPU weights in plain memory instead of the CPU's repacked
    /// layouts (llama.cpp's --no-repack).
    #[arg(long = "no-repack", visible_alias = "nr")]
    pub no_repack: bool,
    /// Keep a mixture's stacked experts in plain memory while other CPU
    /// weights are repacked (they are repacked by default, as llama.cpp
    /// places them).
    #[arg(long = "no-repack-experts")]
    pub no_repack_experts: bool,
    /// Hybrid steps of 32 tokens or more (many sequences decoding) run in
    /// two halves of rows one stage apart, so the host CPU computes its
    /// groups for one half while the GPU computes the other's. Off by
    /// default; the plan gives the CPU no groups above 16 tokens unless
    /// --hybrid N forces them.
    #[arg(long = "cpu-halves")]
    pub cpu_halves: bool,
    /// Do not upload the next step's first streamed groups at the end of
    /// a step (they go up by default, while the step's last groups
    /// compute, and are kept where the next step streams the same groups).
    #[arg(long = "no-carry")]
    pub no_carry: bool,
    /// Hybrid steps spread their CPU groups over all the host groups,
    /// whatever their kinds of matrix cost the CPU (by default a step
    /// takes them from the cheapest ones where the plan predicts that
    /// faster: in llama.cpp's Q4_K_M mix half a mixture's layers have a
    /// Q6_K `ffn_down`, which costs the CPU more per byte).
    #[arg(long = "no-cpu-tiers")]
    pub no_cpu_tiers: bool,
    /// Whether CPU weights may use the CPU's AMX layout (where its module
    /// has one). auto: the groups hybrid decode gives the host CPU use AMX
    /// for the types it computes one-row products of faster, and the
    /// repacked or plain layout for Q4_K and Q6_K (AMX was slower for
    /// those at one and four rows); a CPU device, which computes prompts
    /// too, keeps AMX for every type. on: AMX first for every type it
    /// takes, as llama.cpp places them; off: never.
    #[arg(long = "cpu-amx", default_value = "auto", value_parser = parse_amx)]
    pub cpu_amx: Amx,
}

fn parse_amx(s: &str) -> Result<Amx, String> {
    match s {
        "auto" => Ok(Amx::Auto),
        "on" => Ok(Amx::On),
        "off" => Ok(Amx::Off),
        _ => Err(format!("expected auto, on or off, not {s:?}")),
    }
}

fn parse_hybrid(s: &str) -> Result<Hybrid, String> {
    match s {
        "auto" => Ok(Hybrid::Auto),
        "off" => Ok(Hybrid::Off),
        n => n
            .parse::<usize>()
            .map(Hybrid::Force)
            .map_err(|_| format!("'{s}': use auto, off or a number of groups")),
    }
}

/// Adds `r` to the router counts kept at `path` (see
/// `strata::engine::save_router_counts`), saying so.
pub fn save_router_counts(
    path: &std::path::Path,
    r: &strata::paging::routing::RouterCounts,
) -> Result<()> {
    let all = strata::engine::save_router_counts(path, r)
        .with_context(|| format!("saving router counts to {}", path.display()))?;
    eprintln!(
        "router counts saved to {} ({all} picks in all)",
        path.display()
    );
    Ok(())
}

fn parse_hot(s: &str) -> Result<strata::paging::HotExperts, String> {
    use strata::paging::HotExperts;
    match s {
        "auto" => Ok(HotExperts::Auto),
        "off" => Ok(HotExperts::Off),
        n => match n.parse::<u32>() {
            Ok(k) if k > 0 => Ok(HotExperts::Force(k)),
            _ => Err(format!(
                "'{s}': use auto, off or a number of experts per layer (at least 1)"
            )),
        },
    }
}

fn parse_routed(s: &str) -> Result<strata::paging::RoutedUploads, String> {
    use strata::paging::RoutedUploads;
    match s {
        "auto" => Ok(RoutedUploads::Auto),
        "off" => Ok(RoutedUploads::Off),
        "on" => Ok(RoutedUploads::Force),
        _ => Err(format!("'{s}': use auto, off or on")),
    }
}

fn parse_split(s: &str) -> Result<strata::paging::ExpertSplit, String> {
    use strata::paging::ExpertSplit;
    match s {
        "auto" => Ok(ExpertSplit::Auto),
        "off" => Ok(ExpertSplit::Off),
        n => match n.parse::<u32>() {
            Ok(k) if k > 0 => Ok(ExpertSplit::Force(k)),
            _ => Err(format!(
                "'{s}': use auto, off or a number of experts (at least 1)"
            )),
        },
    }
}

fn parse_resident(s: &str) -> Result<strata::paging::ResidentOrder, String> {
    match s {
        "first" => Ok(strata::paging::ResidentOrder::First),
        "spread" => Ok(strata::paging::ResidentOrder::Spread),
        "cost" => Ok(strata::paging::ResidentOrder::Cost),
        _ => Err(format!("'{s}': use spread, first or cost")),
    }
}

fn parse_gemm(s: &str) -> Result<Gemm, String> {
    match s {
        "auto" => Ok(Gemm::Auto),
        "off" => Ok(Gemm::Off),
        n => n
            .parse::<u32>()
            .map(Gemm::Above)
            .map_err(|_| format!("'{s}': use auto, off or a number of tokens")),
    }
}

#[derive(Args)]
struct RunArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt text (with --chat: the first user message, optional). May
    /// start with '-' (as llama.cpp, the next argument is the value).
    #[arg(short = 'p', long, default_value = "", allow_hyphen_values = true)]
    prompt: String,
    /// Read the prompt from this file (llama.cpp's -f).
    #[arg(short = 'f', long = "file", value_name = "FILE")]
    file: Option<PathBuf>,
    /// Tokens to generate (default 128; with --chat: each reply until its
    /// end of turn or the end of the context).
    #[arg(short = 'n', long = "n-predict")]
    n_predict: Option<usize>,
    /// Temperature; 0 means greedy.
    #[arg(long, default_value_t = 0.8)]
    temp: f32,
    #[arg(long = "top-k", default_value_t = 40)]
    top_k: i32,
    #[arg(long = "top-p", default_value_t = 0.95)]
    top_p: f32,
    #[arg(long = "min-p", default_value_t = 0.05)]
    min_p: f32,
    #[arg(long = "repeat-penalty", default_value_t = 1.0)]
    repeat_penalty: f32,
    #[arg(long = "repeat-last-n", default_value_t = 64)]
    repeat_last_n: usize,
    /// Lowers a token's logit by this much per repeat in the last
    /// --repeat-last-n tokens (-2 to 2; 0: off).
    #[arg(
        long = "frequency-penalty",
        default_value_t = 0.0,
        allow_hyphen_values = true
    )]
    frequency_penalty: f32,
    /// Lowers the logit of every token seen in the last --repeat-last-n
    /// tokens by this much (-2 to 2; 0: off).
    #[arg(
        long = "presence-penalty",
        default_value_t = 0.0,
        allow_hyphen_values = true
    )]
    presence_penalty: f32,
    /// RNG seed; default (or negative, as llama.cpp's -1): a random one,
    /// printed so the run can be repeated with -s.
    #[arg(short = 's', long, allow_hyphen_values = true, value_parser = parse_seed)]
    seed: Option<Seed>,
    /// Interactive multi-turn chat with the model's chat template.
    #[arg(long)]
    chat: bool,
    /// System message for --chat.
    #[arg(long, allow_hyphen_values = true)]
    system: Option<String>,
    /// Chat template for --chat: a file holding a Jinja template, Jinja
    /// source, or a libllama built-in name ("chatml", "llama3", ...).
    /// Default: the model's tokenizer.chat_template, rendered as Hugging
    /// Face does (the same code as `strata serve`).
    #[arg(long = "chat-template")]
    chat_template: Option<String>,
    /// After generating, save the KV cache, tokens and sampler state here.
    #[arg(long = "save-session")]
    save_session: Option<PathBuf>,
    /// Resume a session saved with --save-session (same model): generation
    /// goes on with the tokens it would have produced without the break; a
    /// prompt, if given, is appended first.
    #[arg(long = "load-session")]
    load_session: Option<PathBuf>,
    #[command(flatten)]
    spec: spec::SpecArgs,
}

fn main() {
    // llama.cpp spells the draft model -md, the parallel sequences -np and
    // the physical batch -ub, which clap would read as -m d, -n p and -u b
    let cli = Cli::parse_from(std::env::args_os().map(llama_spelling));
    // warnings by default (slow fallbacks such as buffered reads instead
    // of O_DIRECT must show); -v, --log-level or STRATA_LOG for more
    let level = match (&cli.log_level, cli.verbose) {
        (Some(l), _) => l.as_str(),
        (None, 0) => "warn",
        (None, 1) => "info",
        (None, _) => "debug",
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("STRATA_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level)),
        )
        .with_writer(std::io::stderr)
        .init();
    strata::ggml::exit_on_fatal_errors();
    let model = match &cli.cmd {
        Cmd::Run(a) => Some(&a.model),
        #[cfg(feature = "reference")]
        Cmd::Check(a) => Some(&a.model),
        Cmd::Bench(a) => Some(&a.model),
        Cmd::Serve(a) => Some(&a.model),
        _ => None,
    };
    if model.is_some_and(|m| m.relay || matches!(m.split_mode, SplitArg::Row))
        && std::env::var_os("GGML_CUDA_P2P").is_none()
    {
        // the relay's peer copies go GPU to GPU only with peer access on,
        // which ggml's CUDA module turns on at its start where this is set
        // (no ggml call has been made yet; no other thread runs)
        std::env::set_var("GGML_CUDA_P2P", "1");
    }
    let res = match cli.cmd {
        Cmd::Run(a) => run(a),
        #[cfg(feature = "reference")]
        Cmd::Check(a) => check::check(a),
        Cmd::Bench(a) => bench::bench(a),
        Cmd::Serve(a) => serve::serve(a),
        Cmd::Devices(a) => list_devices(&a.rpc),
        Cmd::RpcServer(a) => rpc::serve(a),
    };
    if let Err(e) = res {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// `strata devices` / `--list-devices` (llama.cpp's): each device with its
/// memory.
fn list_devices(rpc: &[String]) -> Result<()> {
    for e in rpc {
        strata::ggml::rpc::add_server(e, std::time::Duration::from_secs(5))?;
    }
    println!("Available devices (--devices takes the index in the list --device chooses: gpu, the local GPUs then the --rpc servers' devices; rpc, the servers' devices alone):");
    let all = strata::ggml::devices()?;
    let n_gpus = all.iter().filter(|d| d.is_gpu() && !d.is_remote()).count();
    let (mut gpus, mut remote) = (0, 0);
    for d in all {
        let (free, total) = d.memory();
        let mib = |b: usize| b / (1 << 20);
        let index = if d.is_remote() {
            remote += 1;
            if n_gpus > 0 {
                format!("rpc {}, gpu {}", remote - 1, n_gpus + remote - 1)
            } else {
                format!("rpc {}", remote - 1)
            }
        } else if d.is_gpu() {
            gpus += 1;
            format!("gpu {}", gpus - 1)
        } else {
            "cpu".to_string()
        };
        println!(
            "  [{index}] {}: {} ({} MiB, {} MiB free)",
            d.name(),
            d.description(),
            mib(total),
            mib(free)
        );
    }
    println!("CPU variants built: {}", strata::sys::CPU_VARIANTS);
    Ok(())
}

/// A `--seed`: a number, or None for a random one.
#[derive(Clone, Copy, Debug)]
struct Seed(Option<u64>);

/// `--seed`: a u64, or a negative number (llama.cpp's -1) for a random one.
fn parse_seed(s: &str) -> Result<Seed, String> {
    if let Ok(n) = s.parse::<u64>() {
        return Ok(Seed(Some(n)));
    }
    match s.parse::<i64>() {
        Ok(n) if n < 0 => Ok(Seed(None)),
        _ => Err(format!(
            "'{s}' is not a seed (0 to {}, or -1 for a random one)",
            u64::MAX
        )),
    }
}

/// `--threads`: 1 to 1024 (ggml's thread pool refuses more, and 0 crashed
/// inside it); more than the machine's cores is allowed with a warning.
fn parse_threads(s: &str) -> Result<usize, String> {
    let n: usize = s
        .parse()
        .map_err(|_| format!("'{s}' is not a number of threads"))?;
    let max = strata::ggml::MAX_THREADS;
    if !(1..=max).contains(&n) {
        return Err(format!("{n} threads is outside 1..={max}"));
    }
    let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
    if n > cores {
        eprintln!("warning: --threads {n} is more than the {cores} cores available; expect it to be slower");
    }
    Ok(n)
}

/// llama.cpp's two-letter flags as clap reads them.
fn llama_spelling(a: std::ffi::OsString) -> std::ffi::OsString {
    match a.to_str() {
        Some("-md") => "--model-draft".into(),
        Some("-np") => "--parallel".into(),
        Some("-ub") => "--ubatch-size".into(),
        Some("--list-devices") => "devices".into(),
        _ => a,
    }
}

impl ModelArgs {
    /// Tokens per forward step: the physical batch, never above the logical
    /// one (llama.cpp's n_ubatch = min(n_ubatch, n_batch)).
    pub fn step_size(&self) -> u32 {
        self.ubatch_size.min(self.batch_size)
    }
    /// Whether the router counts a run made are added to the file at
    /// exit: with --expert-stats, and where hot experts, routed uploads or
    /// an expert split are asked for (the host CPU's mixture layers, routed
    /// and split layers count their picks; the next load plans from them).
    pub fn saves_counts(&self) -> bool {
        self.expert_stats
            || self.hot_experts != strata::paging::HotExperts::Off
            || self.expert_split != strata::paging::ExpertSplit::Off
            || self
                .routed_uploads
                .is_some_and(|r| r != strata::paging::RoutedUploads::Off)
    }
    /// Where this model's router counts are kept (--expert-counts).
    pub fn counts_path(&self) -> PathBuf {
        self.expert_counts.clone().unwrap_or_else(|| {
            let mut p = self.model.clone().into_os_string();
            p.push(".experts.json");
            PathBuf::from(p)
        })
    }
    /// The logical batch (-b).
    pub fn logical_batch(&self) -> u32 {
        self.batch_size
    }
}

pub fn engine_config(m: &ModelArgs, progress: bool) -> EngineConfig {
    EngineConfig {
        n_ctx: m.ctx_size,
        n_batch: m.step_size(),
        n_threads: m.threads.unwrap_or(EngineConfig::default().n_threads),
        // a count the user chose is kept; the default one adapts
        tune_threads: m.threads.is_none(),
        expert_stats: m.expert_stats,
        expert_counts: Some(m.counts_path()),
        poll: m.poll,
        device: match m.device {
            DeviceArg::Auto => DeviceChoice::Auto,
            DeviceArg::Cpu => DeviceChoice::Cpu,
            DeviceArg::Gpu => DeviceChoice::Gpu,
            DeviceArg::Rpc => DeviceChoice::Remote,
        },
        rpc: m.rpc.clone(),
        devices: m.devices.clone(),
        split_mode: match m.split_mode {
            SplitArg::Layer => strata::engine::SplitMode::Layer,
            SplitArg::Row => strata::engine::SplitMode::Row,
        },
        gpu_budgets: if m.gpu_budget.len() > 1 {
            m.gpu_budget.clone()
        } else {
            Vec::new()
        },
        progress,
        budgets: Budgets {
            gpu: m
                .gpu_budget
                .first()
                .copied()
                .filter(|_| m.gpu_budget.len() == 1),
            dram: m.dram_budget,
            kv_gpu: m.kv_budget,
            kv_dram: m.kv_dram,
        },
        paging: PagingOptions {
            slots: m.slots,
            stream_all: m.stream_all,
            resident: m.resident,
            hybrid: m.hybrid,
            ffn_rows: m.ffn_rows,
            gemm: m.gemm,
            split: strata::paging::SplitInput {
                mode: m.expert_split,
                min_tokens: m.split_min_tokens,
                whole: m.split_whole,
            },
            relay: m.relay,
            row_halves: m.row_halves,
            row_widen: !m.no_row_widen,
            cpu_halves: m.cpu_halves,
            carry: !m.no_carry,
            cpu_tiers: !m.no_cpu_tiers,
            hot: m.hot_experts,
            look_ahead: m.look_ahead,
            look_ahead_layers: m.look_ahead_layers,
            routed: m.routed_uploads.unwrap_or_default(),
        },
        kv_tier: KvTierOptions {
            block: m.kv_block,
            spill_dir: m.kv_spill_dir.clone(),
            spill_max: m.kv_spill_max,
        },
        repack: !m.no_repack,
        cpu_amx: m.cpu_amx,
        repack_experts: !m.no_repack_experts,
        faults: Faults {
            poison_slots: m.poison_slots,
            skip_load_wait: false,
        },
        batch_invariant: false,
    }
}

/// Refuses a model path that is not a readable regular file, saying why.
pub fn check_model_path(path: &std::path::Path, what: &str) -> Result<()> {
    match std::fs::metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            bail!("{what} {} does not exist", path.display())
        }
        Err(e) => bail!("{what} {}: {e}", path.display()),
        Ok(m) if m.is_dir() => bail!("{what} {} is a directory, not a GGUF file", path.display()),
        Ok(m) if !m.is_file() => bail!("{what} {} is not a regular file", path.display()),
        Ok(_) => Ok(()),
    }
}

fn load(m: &ModelArgs, cfg: &EngineConfig) -> Result<(Engine, LlamaModel)> {
    check_model_path(&m.model, "model file")?;
    load_with(&m.model, cfg)
}

/// Loads the engine and the vocabulary, printing what was loaded and the
/// plan when weights stream.
pub fn load_with(path: &std::path::Path, cfg: &EngineConfig) -> Result<(Engine, LlamaModel)> {
    let engine = Engine::load(path, cfg).with_context(|| format!("loading {}", path.display()))?;
    let vocab = LlamaModel::load(path, true, 0)
        .with_context(|| format!("loading the vocabulary of {}", path.display()))?;
    eprintln!(
        "strata: {} ({}), {} layers, {:.1} MiB of weights on {}",
        engine.spec.name,
        engine.spec.arch.name(),
        engine.n_layers(),
        engine.weight_bytes() as f64 / (1 << 20) as f64,
        engine
            .parts()
            .map(|p| p.device().description())
            .collect::<Vec<_>>()
            .join(" and ")
    );
    let split = engine.next_part().is_some();
    for p in engine.parts() {
        for b in &p.auto_budgets {
            tracing::info!("{b}");
        }
        if p.plan.placement.n_streamed() > 0 || p.plan.kv.windows > 0 {
            for b in &p.auto_budgets {
                eprintln!("strata: {b}");
            }
            if split {
                eprintln!("strata: {} on {}:", p.part_label(), p.device().name());
            }
            for line in p.plan.to_string().lines() {
                eprintln!("strata: {line}");
            }
        }
    }
    Ok((engine, vocab))
}

/// Set by the first Ctrl-C (or SIGTERM): the generation in progress ends at
/// its next step; a second one before it did exits at once.
static INTERRUPT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// Set by SIGTERM: after the generation ends as on Ctrl-C, `run` exits the
/// way it does at the end (the session saved, spill files and temp files
/// removed) instead of going on; a chat ends rather than returning to its
/// prompt.
static TERMINATE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn on_sigint(_: libc::c_int) {
    // only async-signal-safe calls: an atomic swap and _exit
    if INTERRUPT.swap(true, std::sync::atomic::Ordering::SeqCst) {
        // SAFETY: _exit is async-signal-safe and ends the process.
        unsafe { libc::_exit(130) };
    }
}

extern "C" fn on_sigterm(_: libc::c_int) {
    use std::sync::atomic::Ordering::SeqCst;
    if TERMINATE.swap(true, SeqCst) {
        // SAFETY: as in on_sigint.
        unsafe { libc::_exit(143) };
    }
    INTERRUPT.store(true, SeqCst);
    // a chat waiting at its prompt then reads the end of its input and
    // ends as on Ctrl-D. SAFETY: open, dup2 and close are async-signal-safe;
    // fd 0 is replaced by /dev/null, nothing else is touched.
    unsafe {
        let fd = libc::open(c"/dev/null".as_ptr(), libc::O_RDONLY);
        if fd >= 0 {
            libc::dup2(fd, 0);
            libc::close(fd);
        }
    }
}

fn catch_signals() {
    // SAFETY: the handlers only make async-signal-safe calls.
    unsafe {
        libc::signal(libc::SIGINT, on_sigint as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_sigterm as *const () as libc::sighandler_t);
    }
}

/// Clears a Ctrl-C given before a generation starts, but not a SIGTERM.
fn arm_interrupt() {
    use std::sync::atomic::Ordering::SeqCst;
    INTERRUPT.store(TERMINATE.load(SeqCst), SeqCst);
}

fn run(mut a: RunArgs) -> Result<()> {
    if let Some(f) = &a.file {
        if !a.prompt.is_empty() {
            bail!("pass the prompt with -p or -f, not both");
        }
        a.prompt = std::fs::read_to_string(f)
            .with_context(|| format!("reading the prompt file {}", f.display()))?;
    }
    let chosen = a.seed.and_then(|s| s.0);
    let seed = chosen.unwrap_or_else(strata::sample::random_seed);
    if a.temp > 0.0 && chosen.is_none() {
        eprintln!("sampling seed: {seed} (repeat with -s {seed})");
    }
    let scfg = SamplerConfig {
        temperature: a.temp,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        repeat_penalty: a.repeat_penalty,
        repeat_last_n: a.repeat_last_n,
        frequency_penalty: a.frequency_penalty,
        presence_penalty: a.presence_penalty,
        seed,
        logit_bias: Vec::new(),
    };
    let sampler = Sampler::new(scfg).context("sampling parameters")?;
    let mut cfg = engine_config(&a.model, true);
    let draft = spec::load_draft(&a.spec, &mut cfg)?;
    let (mut engine, vocab) = load(&a.model, &cfg)?;
    let mut spec = spec::speculator(&a.spec, draft, &engine, &vocab, &a.model.model)?;
    let mut session = Session::new(&mut engine, &vocab, sampler);
    // Ctrl-C ends the reply (and the chat returns to its prompt); a second
    // one exits
    catch_signals();
    session.interrupt = Some(&INTERRUPT);
    let mut stdout = std::io::stdout();
    if a.chat && (a.save_session.is_some() || a.load_session.is_some()) {
        bail!("--save-session and --load-session work without --chat");
    }
    if let Some(p) = &a.load_session {
        session
            .load(p)
            .with_context(|| format!("loading session {}", p.display()))?;
        eprintln!(
            "resumed {} tokens from {}",
            session.tokens.len() + usize::from(session.pending.is_some()),
            p.display()
        );
    }
    if !a.chat {
        if a.prompt.is_empty() && session.pending.is_none() {
            bail!("no prompt: pass -p TEXT (or --chat, or --load-session)");
        }
        let prompt = if a.prompt.is_empty() {
            Vec::new()
        } else {
            vocab.tokenize(&a.prompt, session.tokens.is_empty(), true)?
        };
        print!("{}", a.prompt);
        stdout.flush()?;
        arm_interrupt();
        let (_, t) =
            session.generate_with(&prompt, a.n_predict.unwrap_or(128), spec.as_mut(), |s| {
                print!("{s}");
                let _ = std::io::stdout().flush();
            })?;
        println!();
        if session.interrupted {
            eprintln!("interrupted");
        }
        eprintln!(
            "prompt: {} tokens, {:.2} t/s | generation: {} tokens, {:.2} t/s",
            t.prompt_tokens,
            t.prompt_tps(),
            t.gen_tokens,
            t.gen_tps()
        );
        if let Some(s) = &spec {
            eprintln!("{}", s.stats.summary());
        }
        if let Some(r) = session.engine.router_counts().filter(|r| r.picks() > 0) {
            if a.model.saves_counts() {
                eprintln!("{r}");
                save_router_counts(&a.model.counts_path(), r)?;
            }
        }
        if let Some(p) = &a.save_session {
            let n = session
                .save(p)
                .with_context(|| format!("saving session {}", p.display()))?;
            eprintln!(
                "session saved to {} ({} tokens, {:.1} MiB)",
                p.display(),
                session.tokens.len(),
                n as f64 / (1u64 << 20) as f64
            );
        }
        return Ok(());
    }

    // interactive chat: re-render the whole conversation each turn and feed
    // only the part the KV cache has not seen
    let template = ChatTemplate::load(&a.model.model, a.chat_template.as_deref())?;
    let mut messages: Vec<Message> = Vec::new();
    if let Some(s) = &a.system {
        messages.push(Message::new("system", s));
    }
    let mut rendered_len = 0usize;
    let mut first = a.prompt.clone();
    let stdin = std::io::stdin();
    loop {
        let user = if !first.is_empty() {
            let u = std::mem::take(&mut first);
            println!("> {u}");
            u
        } else {
            print!("> ");
            stdout.flush()?;
            let mut line = String::new();
            if stdin.lock().read_line(&mut line)? == 0 {
                println!();
                return Ok(());
            }
            let line = line.trim_end().to_string();
            if line.is_empty() {
                continue;
            }
            line
        };
        messages.push(Message::new("user", &user));
        let full = template.render(&messages, true)?;
        let new_part = full.get(rendered_len..).unwrap_or(&full);
        let mut toks = vocab.tokenize(new_part, rendered_len == 0, true)?;
        let mut full = full;
        // context shift (llama.cpp's): when this turn and a reply's worth of
        // room do not fit, the oldest turns after the system prompt go, the
        // conversation is re-rendered and computed again from its start
        let n_ctx = session.engine.n_ctx() as usize;
        let room = (n_ctx / 4).min(a.n_predict.unwrap_or(usize::MAX)).max(1);
        if session.tokens.len() + toks.len() + 1 + room > n_ctx {
            let first = usize::from(a.system.is_some());
            let mut dropped = 0;
            loop {
                full = template.render(&messages, true)?;
                toks = vocab.tokenize(&full, true, true)?;
                // keep at most half the context, so shifts stay rare
                if toks.len() + room <= n_ctx / 2 || messages.len() <= first + 1 {
                    break;
                }
                // a user turn and the reply after it
                let n = if messages.len() > first + 2 { 2 } else { 1 };
                messages.drain(first..first + n);
                dropped += 1;
            }
            if toks.len() + 1 + room > n_ctx {
                messages.pop();
                eprintln!(
                    "[this message takes {} tokens: the context of {n_ctx} holds it with no room for a reply; not sent]",
                    toks.len()
                );
                // older turns may have gone: the next turn is computed
                // from the start of what is left
                rendered_len = 0;
                session.engine.clear();
                session.tokens.clear();
                session.pending = None;
                if let Some(s) = spec.as_mut() {
                    s.reset();
                }
                continue;
            }
            eprintln!("[context full: the {dropped} oldest turns were dropped]");
            session.engine.clear();
            session.tokens.clear();
            session.pending = None;
            if let Some(s) = spec.as_mut() {
                s.reset();
            }
        }
        let n_reply = a.n_predict.unwrap_or(usize::MAX);
        let mut reply = String::new();
        // a Ctrl-C at the prompt does not cut the reply short
        arm_interrupt();
        let (_, t) = session.generate_with(&toks, n_reply, spec.as_mut(), |s| {
            print!("{s}");
            reply.push_str(s);
            let _ = std::io::stdout().flush();
        })?;
        println!();
        if session.interrupted {
            eprintln!("[interrupted]");
        }
        eprintln!("[{} tokens, {:.2} t/s]", t.gen_tokens, t.gen_tps());
        if session.tokens.len() + 1 >= n_ctx {
            eprintln!("[the context is full: the next message drops the oldest turns]");
        }
        if TERMINATE.load(std::sync::atomic::Ordering::SeqCst) {
            return Ok(());
        }
        // the KV cache now holds `full` + the reply text; the template's
        // end-of-turn marker after it is fed with the next user message
        let seen = format!("{full}{reply}");
        messages.push(Message::new("assistant", &reply));
        let next = template.render(&messages, false)?;
        if next.starts_with(&seen) {
            rendered_len = seen.len();
        } else {
            // the template rewrote history: start the cache over
            session.engine.clear();
            session.tokens.clear();
            session.pending = None;
            if let Some(s) = spec.as_mut() {
                s.reset();
            }
            rendered_len = 0;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn step(args: &[&str]) -> (u32, u32) {
        let argv = ["strata", "run", "-m", "x.gguf"]
            .iter()
            .chain(args)
            .map(|s| (*s).into());
        let cli = Cli::try_parse_from(argv.map(llama_spelling)).unwrap();
        let Cmd::Run(r) = cli.cmd else {
            panic!("not run")
        };
        (r.model.logical_batch(), r.model.step_size())
    }

    #[test]
    fn batch_and_ubatch_mean_what_they_mean_in_llama_cpp() {
        assert_eq!(step(&[]), (2048, 512));
        assert_eq!(step(&["-b", "2048"]), (2048, 512));
        assert_eq!(step(&["-b", "2048", "-ub", "2048"]), (2048, 2048));
        assert_eq!(step(&["-ub", "1024"]), (2048, 1024));
        // the step never exceeds the logical batch
        assert_eq!(step(&["-b", "64"]), (64, 64));
        assert_eq!(
            step(&["--batch-size", "256", "--ubatch-size", "4096"]),
            (256, 256)
        );
    }
}
