//! Sequential read throughput of the SSD-tier reader on one file.
//!
//! cargo run --release --example readbench -- FILE [--qd 8] [--chunk 1M]
//!     [--workers 1] [--backend auto|uring|pread] [--extent 64M]
//!     [--in-flight 0] [--buffered] [--passes 1]
//!
//! Prints one line per pass and, last, `GBPS <best>` for scripts
//! (tools/bench/fio-compare.sh). Decimal GB (1e9 bytes), like fio.

use anyhow::{bail, Context, Result};
use clap::Parser;
use strata::storage::{sequential_read, IoBackend, ReaderConfig};

#[derive(Parser)]
struct Args {
    file: std::path::PathBuf,
    /// Reads in flight across all workers.
    #[arg(long, default_value = "8")]
    qd: usize,
    /// Bytes per read (K/M/G suffixes).
    #[arg(long, default_value = "1M", value_parser = parse_size)]
    chunk: usize,
    /// io_uring worker threads.
    #[arg(long, default_value = "1")]
    workers: usize,
    /// auto, uring or pread.
    #[arg(long, default_value = "auto")]
    backend: String,
    /// Bytes per submitted extent (a pager group).
    #[arg(long, default_value = "64M", value_parser = parse_size)]
    extent: usize,
    /// Extents submitted ahead (0: enough for twice the queue depth).
    #[arg(long, default_value = "0")]
    in_flight: usize,
    /// Read through the page cache instead of O_DIRECT.
    #[arg(long)]
    buffered: bool,
    #[arg(long, default_value = "1")]
    passes: usize,
}

fn parse_size(s: &str) -> Result<usize, String> {
    let (num, mul) = match s.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&s[..s.len() - 1], 1 << 10),
        Some('M') => (&s[..s.len() - 1], 1 << 20),
        Some('G') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>()
        .map(|n| n * mul)
        .map_err(|e| format!("bad size {s:?}: {e}"))
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let a = Args::parse();
    let backend = match a.backend.as_str() {
        "auto" => IoBackend::Auto,
        "uring" | "io_uring" => IoBackend::IoUring,
        "pread" => IoBackend::Pread,
        b => bail!("unknown backend {b:?} (auto, uring, pread)"),
    };
    let mut best = 0f64;
    for pass in 0..a.passes.max(1) {
        let cfg = ReaderConfig {
            backend,
            direct: !a.buffered,
            workers: a.workers,
            queue_depth: a.qd,
            chunk_size: a.chunk,
            ..ReaderConfig::default()
        };
        let r = sequential_read(&a.file, cfg, a.extent, a.in_flight)
            .with_context(|| format!("reading {}", a.file.display()))?;
        println!(
            "pass {pass}: {:?} direct={} qd={} chunk={} workers={} extent={}x{}: \
             {} bytes in {:.3} s = {:.3} GB/s ({} reads, {} into fixed buffers, {} retries)",
            r.backend,
            r.direct,
            r.queue_depth,
            r.chunk_size,
            r.workers,
            a.extent,
            r.extents_in_flight,
            r.bytes,
            r.seconds,
            r.gb_per_s,
            r.stats.ops,
            r.stats.fixed_ops,
            r.stats.retries
        );
        best = best.max(r.gb_per_s);
    }
    println!("GBPS {best:.4}");
    Ok(())
}
