//! `strata-convert`: prepare models for strata's paging layout.
//!
//!   strata-convert gguf IN.gguf OUT.gguf [--type T]
//!   strata-convert hf MODEL_DIR OUT.gguf [--type T] [--pre NAME]
//!   strata-convert synth --preset NAME --type T [--layers N] [--router-skew S] --vocab-from V.gguf OUT.gguf
//!   strata-convert inspect FILE.gguf
//!
//! Every output is a GGUF v3 that llama.cpp loads, 4096-aligned, with each
//! (layer, group) one contiguous extent listed in `strata.*` metadata. The
//! library (`strata::convert`) does the work; this file parses arguments,
//! installs the signal handlers that make Ctrl-C remove the partial output,
//! and prints a summary.

use anyhow::{Context as _, Result};
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;
use strata::convert::{self, hf, quant, synth, WriteSummary};

#[derive(Parser)]
#[command(
    name = "strata-convert",
    version,
    about = "Convert models to strata's aligned, layer-contiguous GGUF layout"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Args)]
struct Common {
    /// Worker threads for conversion (default: all cores).
    #[arg(short = 't', long)]
    threads: Option<usize>,
    /// No progress bar.
    #[arg(short = 'q', long)]
    quiet: bool,
}

#[derive(Subcommand)]
enum Cmd {
    /// Re-lay out a GGUF (llama or qwen2), optionally requantizing it.
    Gguf {
        input: PathBuf,
        output: PathBuf,
        /// Requantize matrices: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1,
        /// q2_k, q3_k, q4_k, q5_k, q6_k, iq4_nl (norms and biases stay f32).
        #[arg(long = "type")]
        ty: Option<String>,
        /// Requantize matrices that are already quantized (as llama-quantize).
        #[arg(long = "allow-requantize")]
        allow_requantize: bool,
        #[command(flatten)]
        common: Common,
    },
    /// Convert a Hugging Face model directory (Llama, Mistral, Qwen2).
    Hf {
        dir: PathBuf,
        output: PathBuf,
        /// Output type of the matrices (default: the checkpoint's dtype).
        #[arg(long = "type")]
        ty: Option<String>,
        /// llama.cpp pre-tokenizer name, when it cannot be detected.
        #[arg(long)]
        pre: Option<String>,
        #[command(flatten)]
        common: Common,
    },
    /// Write a random-weight model with real shapes.
    Synth {
        /// A preset name: tiny, llama3-8b, llama3-70b, qwen2.5-7b, mixtral-8x7b, qwen3-30b-a3b, ... (an unknown name lists them).
        #[arg(long)]
        preset: String,
        /// Type of the matrices (see `gguf --type`).
        #[arg(long = "type")]
        ty: String,
        /// Number of layers (default: the preset's).
        #[arg(long)]
        layers: Option<u32>,
        /// GGUF whose tokenizer is copied (n_vocab follows it).
        #[arg(long = "vocab-from")]
        vocab_from: PathBuf,
        /// Seed of the random weights.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Mixtures of experts: Zipf exponent of each layer's expert
        /// popularity (0: a random router, about uniform; 1: the expert of
        /// rank r aimed at a share of the selections in proportion to
        /// 1/(r+1)). Stated in the file as strata.synth.router_skew.
        #[arg(
            long = "router-skew",
            default_value_t = 0.0,
            allow_negative_numbers = true
        )]
        router_skew: f32,
        output: PathBuf,
        #[command(flatten)]
        common: Common,
    },
    /// Print metadata, tensors, group extents and whether FILE is strata-aligned.
    Inspect { file: PathBuf },
}

fn report(s: &WriteSummary) {
    let gb = s.file_size as f64 / 1e9;
    eprintln!(
        "wrote {} ({:.3} GB, {} tensors, {} group extents) in {:.1} s ({:.2} GB/s)",
        s.path.display(),
        gb,
        s.n_tensors,
        s.groups.len(),
        s.seconds,
        gb / s.seconds.max(1e-9)
    );
}

fn main() -> std::process::ExitCode {
    // errors as `strata` prints them: one line, each cause once
    match run(Cli::parse()) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    convert::cancel::install_signal_handlers();
    let threads = |c: &Common| c.threads.unwrap_or_else(convert::default_threads).max(1);
    match cli.cmd {
        Cmd::Gguf {
            input,
            output,
            ty,
            allow_requantize,
            common,
        } => {
            let target = ty.as_deref().map(quant::parse_target).transpose()?;
            let opts = convert::GgufOptions {
                target,
                allow_requantize,
                threads: threads(&common),
                progress: !common.quiet,
            };
            let s = convert::convert_gguf(&input, &output, &opts)
                .with_context(|| format!("converting {}", input.display()))?;
            report(&s);
        }
        Cmd::Hf {
            dir,
            output,
            ty,
            pre,
            common,
        } => {
            let target = ty.as_deref().map(quant::parse_target).transpose()?;
            let opts = hf::HfOptions {
                target,
                pre,
                threads: threads(&common),
                progress: !common.quiet,
            };
            let s = hf::convert_hf(&dir, &output, &opts)
                .with_context(|| format!("converting {}", dir.display()))?;
            report(&s);
        }
        Cmd::Synth {
            preset,
            ty,
            layers,
            vocab_from,
            seed,
            router_skew,
            output,
            common,
        } => {
            let opts = synth::SynthOptions {
                preset: synth::preset(&preset)?,
                target: quant::parse_target(&ty)?,
                layers,
                vocab_from,
                seed,
                router_skew,
                threads: threads(&common),
                progress: !common.quiet,
            };
            let s = synth::synth(&opts, &output)
                .with_context(|| format!("synthesizing preset {preset}"))?;
            report(&s);
        }
        Cmd::Inspect { file } => {
            let r = convert::inspect(&file)
                .with_context(|| format!("inspecting {}", file.display()))?;
            print!("{r}");
        }
    }
    Ok(())
}
