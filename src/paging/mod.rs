//! Paging and placement: deciding which layer groups live on the GPU, and
//! streaming the others through a small ring of slots while earlier groups
//! compute. Plain Rust (no FFI); the engine executes what these decide.

mod budget;
mod calibration;
pub mod devices;
pub mod experts;
pub mod gemm;
mod groups;
pub mod halves;
mod hybrid;
pub mod lookahead;
mod memory;
mod outside;
mod plan;
mod ring;
pub mod routed;
pub mod routing;
pub mod sizes;
mod split;
#[cfg(test)]
pub(crate) mod testutil;

pub use budget::{auto_dram_budget, auto_gpu_budget, mem_available, BudgetWatch};
pub use calibration::CpuCalibration;
pub use devices::{split_layers, split_rows, DeviceSplitError, RowSplit};
pub use experts::{plan_hot, refresh_hot, HotExperts, HotPlan};
pub use gemm::{choose_mmq_max_rows, PathTiming, Widened};
pub use groups::{set_cpu_scales, set_hot_shares, Experts, GroupInfo, Popularity, Where};
pub use hybrid::{
    plan_hybrid, s_per_byte_at, spread, CpuInput, ExpertSplit, HybridPlan, Prediction, SizePlan,
    SplitInput, SplitPlan, SplitSize, MAX_TOKENS as HYBRID_MAX_TOKENS,
};
pub use memory::{
    memory_plan, Budgets, DramWindowPlan, GemmPlan, KvPlan, KvShape, MemoryInput, MemoryPlan,
};
pub use outside::Outside;
pub use plan::{auto_kv_layers, plan, ComputeRate, Plan, PlanError, PlanInput, ResidentOrder};
pub use ring::{simulate, Op, Ring, SlotRing, SlotState, Violation};
pub use routed::RoutedUploads;
pub use sizes::{Activations, Limits};
pub use split::device_experts;

/// Parses a size like "12G", "512M", "1.5GiB", "4096" (bytes). K/M/G/T are
/// binary multiples (KiB, MiB, ...), as GPU memory is reported.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let x: f64 = num
        .parse()
        .map_err(|_| format!("'{s}' is not a size (examples: 12G, 512M, 4096)"))?;
    let mult: u64 = match unit
        .trim()
        .to_ascii_lowercase()
        .trim_end_matches("ib")
        .trim_end_matches('b')
    {
        "" => 1,
        "k" => 1 << 10,
        "m" => 1 << 20,
        "g" => 1 << 30,
        "t" => 1 << 40,
        _ => {
            return Err(format!(
                "'{s}': unknown size unit '{unit}' (use K, M, G or T)"
            ))
        }
    };
    if !x.is_finite() || x < 0.0 {
        return Err(format!("'{s}' is not a size"));
    }
    let bytes = x * mult as f64;
    // 2^64 and above would saturate silently
    if bytes >= 18446744073709551616.0 {
        return Err(format!("'{s}' is larger than 16 EiB"));
    }
    Ok(bytes as u64)
}

#[cfg(test)]
mod size_tests {
    use super::parse_size;
    #[test]
    fn sizes() {
        assert_eq!(parse_size("12G"), Ok(12 << 30));
        assert_eq!(parse_size("512M"), Ok(512 << 20));
        assert_eq!(parse_size("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("99999999999999999999").is_err());
        assert!(parse_size("17179869184G").is_err());
        assert!(parse_size("12X").is_err());
        assert!(parse_size("lots").is_err());
    }
}
