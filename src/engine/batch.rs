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
    /// Groups computed in two halves of rows: by the row split
    /// (`rows.rs`), or a hybrid step's (`halves.rs`).
    pub halved: u32,
    /// Mixture groups that went up only as far as their experts were
    /// picked (`routed.rs`).
    pub routed: crate::paging::routed::RoutedStats,
}

impl StepStats {
    /// Adds what another device's part of the same step did (a model split
    /// across devices); the step's tokens and time stay this one's.
    pub fn add_part(&mut self, o: &StepStats) {
        let (p, q) = (&mut self.pager, &o.pager);
        p.uploads += q.uploads;
        p.bytes += q.bytes;
        p.copy_wait += q.copy_wait;
        p.kv_bytes += q.kv_bytes;
        p.relayed += q.relayed;
        self.disk_bytes += o.disk_bytes;
        let (k, m) = (&mut self.kv, &o.kv);
        k.up_bytes += m.up_bytes;
        k.down_bytes += m.down_bytes;
        k.spilled += m.spilled;
        k.loaded += m.loaded;
        k.spill_bytes += m.spill_bytes;
        k.load_bytes += m.load_bytes;
        let (h, g) = (&mut self.host, &o.host);
        h.groups += g.groups;
        h.bytes += g.bytes;
        h.compute += g.compute;
        h.hops += g.hops;
        self.routed.add(&o.routed);
    }
}
