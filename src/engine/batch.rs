//! What a step takes and reports: the tokens of a batch and the step's
//! statistics.

use super::host::HostStats;
use super::kvtier::KvStats;
use super::pager::PagerStats;

/// One token of a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchToken {
    pub token: u32,
    pub pos: i32,
    pub seq: u32,
    /// Whether logits are wanted for this token.
    pub logits: bool,
}

/// What the last step did.
#[derive(Clone, Copy, Debug, Default)]
pub struct StepStats {
    pub n_tokens: usize,
    pub seconds: f64,
    pub pager: PagerStats,
    /// Bytes the DRAM window read from the model file during the step.
    pub disk_bytes: u64,
    /// KV traffic of windowed layers during the step.
    pub kv: KvStats,
    /// What the host CPU computed (hybrid decode).
    pub host: HostStats,
}
