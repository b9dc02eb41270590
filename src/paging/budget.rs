//! Budgets chosen when the user gives none: what the machine has free,
//! less a margin for what strata does not account for itself (the CUDA
//! context and library workspaces on the GPU; the rest of the system and
//! the page cache in host memory).

/// GPU bytes strata may use: free device memory less 1 GiB and 2% of the
/// total (CUDA context, cuBLAS workspaces, fragmentation).
pub fn auto_gpu_budget(free: u64, total: u64) -> u64 {
    free.saturating_sub((1 << 30) + total / 50)
}

/// Host bytes for streamed weights: available memory less 2 GiB and 10%
/// (the KV tier's frames, the process itself, the rest of the system).
pub fn auto_dram_budget(available: u64) -> u64 {
    available.saturating_sub((2 << 30) + available / 10)
}

/// Watches the device memory a loaded engine holds against its GPU budget.
/// The memory plan counts strata's buffers and its reserves, but ggml also
/// allocates outside them (its memory pool's temporaries, CUDA graphs): on
/// an H200, loads of the Qwen3-30B-A3B shape that reserved no GEMM scratch
/// held 8238-8284 MiB on an 8 GiB budget (BENCHMARKS.md, runs 211-212).
/// The device's free memory after steps, against its free memory when the
/// engine began loading, says so once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BudgetWatch {
    free_at_load: u64,
    budget: u64,
    reported: bool,
}

impl BudgetWatch {
    /// `free_at_load`: the device's free bytes before the engine allocated
    /// anything; `budget`: the GPU budget in bytes.
    pub fn new(free_at_load: u64, budget: u64) -> BudgetWatch {
        BudgetWatch {
            free_at_load,
            budget,
            reported: false,
        }
    }

    /// Given the device's free bytes now: the bytes taken since the load
    /// began, the first time they exceed the budget; None before that and
    /// after it (a warning, not a stream of them).
    pub fn check(&mut self, free_now: u64) -> Option<u64> {
        let used = self.free_at_load.saturating_sub(free_now);
        if self.reported || used <= self.budget {
            return None;
        }
        self.reported = true;
        Some(used)
    }

    pub fn budget(&self) -> u64 {
        self.budget
    }

    /// Whether it has already warned (nothing is left to read the device
    /// for).
    pub fn reported(&self) -> bool {
        self.reported
    }
}

/// `MemAvailable` of /proc/meminfo, in bytes (None where it is missing).
pub fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_meminfo(&text, "MemAvailable:")
}

fn parse_meminfo(text: &str, key: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with(key))?;
    let kib: u64 = line[key.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_watch_reports_the_first_step_over_the_budget_once() {
        const M: u64 = 1 << 20;
        let mut w = BudgetWatch::new(100_000 * M, 8192 * M);
        // under and at the budget: nothing
        assert_eq!(w.check(100_000 * M - 7858 * M), None);
        assert_eq!(w.check(100_000 * M - 8192 * M), None);
        // more free than at load (another process let go): nothing
        assert_eq!(w.check(101_000 * M), None);
        // over it: once, with what is held
        assert_eq!(w.check(100_000 * M - 8284 * M), Some(8284 * M));
        assert_eq!(w.check(100_000 * M - 8300 * M), None);
        assert_eq!(w.budget(), 8192 * M);
    }

    #[test]
    fn margins_and_meminfo() {
        const G: u64 = 1 << 30;
        assert_eq!(auto_gpu_budget(79 * G, 80 * G), 78 * G - 80 * G / 50);
        assert_eq!(auto_gpu_budget(G / 2, 80 * G), 0);
        assert_eq!(auto_dram_budget(100 * G), 88 * G);
        assert_eq!(auto_dram_budget(G), 0);
        let m =
            "MemTotal:       24000000 kB\nMemFree:         1000 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(parse_meminfo(m, "MemAvailable:"), Some(20_000_000 * 1024));
        assert_eq!(parse_meminfo(m, "SwapTotal:"), None);
        assert_eq!(
            parse_meminfo("MemAvailable: lots kB", "MemAvailable:"),
            None
        );
    }
}
