//! Server counters, written by the engine loop and the HTTP handlers,
//! rendered as Prometheus text by GET /metrics.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// An f64 in an atomic (its bits).
#[derive(Default)]
pub struct Gauge(AtomicU64);

impl Gauge {
    pub fn set(&self, v: f64) {
        self.0.store(v.to_bits(), Relaxed);
    }
    pub fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Relaxed))
    }
}

#[derive(Default)]
pub struct Metrics {
    /// Accepted and not yet running (in the channel or the batcher's queue).
    pub queued: AtomicU64,
    pub active: AtomicU64,
    pub parked: AtomicU64,
    /// Requests by outcome.
    pub completed: AtomicU64,
    pub cancelled: AtomicU64,
    /// Refused before running: bad input (4xx) or a full queue (503).
    pub rejected: AtomicU64,
    pub failed: AtomicU64,
    pub prompt_tokens: AtomicU64,
    /// Prompt tokens taken from the prefix cache.
    pub prefix_tokens: AtomicU64,
    pub prefix_hits: AtomicU64,
    pub prefix_evictions: AtomicU64,
    pub generated_tokens: AtomicU64,
    /// Draft tokens verified, and those accepted (prompt lookup).
    pub draft_tokens: AtomicU64,
    pub draft_accepted: AtomicU64,
    /// Accepted draft tokens of a token tree's side branch, fed again.
    pub draft_refed: AtomicU64,
    /// Routed picks of the mixture layers with hot experts the host
    /// computed, and those the GPU's hot experts took.
    pub expert_picks: AtomicU64,
    pub expert_hot_picks: AtomicU64,
    /// Hot expert sets re-chosen between requests, and the bytes copied.
    pub hot_refreshes: AtomicU64,
    pub hot_refresh_bytes: AtomicU64,
    pub steps: AtomicU64,
    pub step_tokens: AtomicU64,
    /// Sum of step wall times, microseconds.
    pub step_micros: AtomicU64,
    pub last_step_seconds: Gauge,
    pub last_step_bytes: AtomicU64,
    pub streamed_bytes: AtomicU64,
    /// Generated tokens per second over the last few seconds.
    pub tokens_per_second: Gauge,
    pub kv_cells_used: AtomicU64,
    pub kv_cells: AtomicU64,
    /// When the engine loop last came round (milliseconds since the Unix
    /// epoch): at least every 200 ms while idle, after each step while
    /// busy. /health reads how long ago.
    pub loop_beat_ms: AtomicU64,
    pub kv_blocks_gpu: AtomicU64,
    pub kv_blocks_dram: AtomicU64,
    pub kv_blocks_ssd: AtomicU64,
    /// Time to first token, microseconds: sum and count.
    pub ttft_micros: AtomicU64,
    pub ttft_count: AtomicU64,
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Metrics {
    /// The engine loop came round.
    pub fn beat(&self) {
        self.loop_beat_ms
            .store(now_ms(), std::sync::atomic::Ordering::Relaxed);
    }
    /// Time since the engine loop last came round.
    pub fn since_beat(&self) -> std::time::Duration {
        let b = self.loop_beat_ms.load(std::sync::atomic::Ordering::Relaxed);
        std::time::Duration::from_millis(now_ms().saturating_sub(b))
    }

    /// The Prometheus text exposition of every counter.
    pub fn render(&self) -> String {
        let mut s = String::new();
        let mut one = |name: &str, kind: &str, help: &str, v: String| {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
        };
        let g = |a: &AtomicU64| a.load(Relaxed).to_string();
        one(
            "strata_requests_queued",
            "gauge",
            "Requests accepted and waiting for a sequence.",
            g(&self.queued),
        );
        one(
            "strata_requests_active",
            "gauge",
            "Sequences running.",
            g(&self.active),
        );
        one(
            "strata_prefix_sequences",
            "gauge",
            "Finished sequences kept as cached prefixes.",
            g(&self.parked),
        );
        one(
            "strata_requests_completed_total",
            "counter",
            "Requests answered in full.",
            g(&self.completed),
        );
        one(
            "strata_requests_cancelled_total",
            "counter",
            "Requests whose client went away.",
            g(&self.cancelled),
        );
        one(
            "strata_requests_rejected_total",
            "counter",
            "Requests refused (bad input, full queue, shutting down).",
            g(&self.rejected),
        );
        one(
            "strata_requests_failed_total",
            "counter",
            "Requests ended by an engine error.",
            g(&self.failed),
        );
        one(
            "strata_prompt_tokens_total",
            "counter",
            "Prompt tokens of admitted requests.",
            g(&self.prompt_tokens),
        );
        one(
            "strata_prefix_cache_tokens_total",
            "counter",
            "Prompt tokens taken from the prefix cache instead of computed.",
            g(&self.prefix_tokens),
        );
        one(
            "strata_prefix_cache_hits_total",
            "counter",
            "Requests that reused a cached prefix.",
            g(&self.prefix_hits),
        );
        one(
            "strata_prefix_cache_evictions_total",
            "counter",
            "Cached prefixes dropped for room.",
            g(&self.prefix_evictions),
        );
        one(
            "strata_generated_tokens_total",
            "counter",
            "Tokens sampled.",
            g(&self.generated_tokens),
        );
        one(
            "strata_draft_tokens_total",
            "counter",
            "Draft tokens verified (prompt lookup or a draft model; a tree's nodes).",
            g(&self.draft_tokens),
        );
        one(
            "strata_draft_accepted_total",
            "counter",
            "Draft tokens accepted.",
            g(&self.draft_accepted),
        );
        one(
            "strata_draft_refed_total",
            "counter",
            "Accepted draft tokens of a token tree's side branch, fed again in position order.",
            g(&self.draft_refed),
        );
        one(
            "strata_expert_picks_total",
            "counter",
            "Routed picks of the mixture layers with hot experts that the host CPU computed.",
            g(&self.expert_picks),
        );
        one(
            "strata_expert_hot_picks_total",
            "counter",
            "Of those, picks the GPU's hot experts computed (over the above: the hit rate).",
            g(&self.expert_hot_picks),
        );
        one(
            "strata_hot_refreshes_total",
            "counter",
            "Layers whose hot experts were re-chosen from the router's counts between requests.",
            g(&self.hot_refreshes),
        );
        one(
            "strata_hot_refresh_bytes_total",
            "counter",
            "Expert bytes copied to the GPU by those refreshes.",
            g(&self.hot_refresh_bytes),
        );
        one(
            "strata_steps_total",
            "counter",
            "Engine steps.",
            g(&self.steps),
        );
        one(
            "strata_step_tokens_total",
            "counter",
            "Tokens computed by engine steps.",
            g(&self.step_tokens),
        );
        one(
            "strata_step_seconds_total",
            "counter",
            "Wall time of engine steps.",
            format!("{:.6}", self.step_micros.load(Relaxed) as f64 / 1e6),
        );
        one(
            "strata_step_seconds",
            "gauge",
            "Wall time of the last step.",
            format!("{:.6}", self.last_step_seconds.get()),
        );
        one(
            "strata_step_streamed_bytes",
            "gauge",
            "Weight bytes uploaded to the GPU by the last step.",
            g(&self.last_step_bytes),
        );
        one(
            "strata_streamed_bytes_total",
            "counter",
            "Weight bytes uploaded to the GPU.",
            g(&self.streamed_bytes),
        );
        one(
            "strata_tokens_per_second",
            "gauge",
            "Tokens sampled per second over the last 10 s.",
            format!("{:.3}", self.tokens_per_second.get()),
        );
        one(
            "strata_kv_cells_used",
            "gauge",
            "KV cells holding a position.",
            g(&self.kv_cells_used),
        );
        one(
            "strata_kv_cells",
            "gauge",
            "KV cells in all.",
            g(&self.kv_cells),
        );
        let _ = writeln!(
            s,
            "# HELP strata_kv_blocks KV blocks holding cells, by tier.\n# TYPE strata_kv_blocks gauge\nstrata_kv_blocks{{tier=\"gpu\"}} {}\nstrata_kv_blocks{{tier=\"dram\"}} {}\nstrata_kv_blocks{{tier=\"ssd\"}} {}",
            g(&self.kv_blocks_gpu),
            g(&self.kv_blocks_dram),
            g(&self.kv_blocks_ssd)
        );
        let _ = writeln!(
            s,
            "# HELP strata_time_to_first_token_seconds Time from arrival to the first token.\n# TYPE strata_time_to_first_token_seconds summary\nstrata_time_to_first_token_seconds_sum {:.6}\nstrata_time_to_first_token_seconds_count {}",
            self.ttft_micros.load(Relaxed) as f64 / 1e6,
            g(&self.ttft_count)
        );
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_prometheus_text() {
        let m = Metrics::default();
        m.completed.store(3, Relaxed);
        m.tokens_per_second.set(12.5);
        let t = m.render();
        assert!(t.contains("\nstrata_requests_completed_total 3\n"), "{t}");
        assert!(t.contains("\nstrata_tokens_per_second 12.500\n"));
        assert!(t.contains("strata_kv_blocks{tier=\"ssd\"} 0"));
        // every sample line is `name[{labels}] value`
        for l in t.lines().filter(|l| !l.starts_with('#')) {
            let (name, v) = l.rsplit_once(' ').unwrap();
            assert!(name.starts_with("strata_"), "{l}");
            assert!(v.parse::<f64>().is_ok(), "{l}");
        }
    }
}
