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
