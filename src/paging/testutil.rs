//! Inputs the paging tests share.

use super::groups::GroupInfo;
use super::hybrid::CpuInput;
use crate::model::GroupKind;

/// `n` layers of an attention group of `attn` bytes and an FFN group of
/// `ffn` bytes.
pub fn layers(n: usize, attn: u64, ffn: u64) -> Vec<GroupInfo> {
    (0..n)
        .flat_map(|_| {
            [
                GroupInfo {
                    kind: GroupKind::Attn,
                    bytes: attn,
                },
                GroupInfo {
                    kind: GroupKind::Ffn,
                    bytes: ffn,
                },
            ]
        })
        .collect()
}

/// A CPU of `s_per_byte` seconds per byte at one token (8 times that at
/// its 16-token probe), with no hop or GPU costs and unlimited room.
pub fn cpu(s_per_byte: f64) -> CpuInput {
    CpuInput {
        s_per_byte_1: s_per_byte,
        s_per_byte_n: s_per_byte * 8.0,
        probe_tokens: 16,
        host_room: u64::MAX,
        hop_s: 0.0,
        gpu_s_per_byte: 0.0,
        gpu_group_s: 0.0,
        bus_bw_beside: None,
        force: None,
    }
}
