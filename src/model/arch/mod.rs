//! The supported architectures, one file each, as llama.cpp's
//! src/models/*.cpp: what an architecture reads from a GGUF file (the
//! tensors of each layer group, which are optional) and what its groups
//! compute that the shared Llama-family graph builder must know (the RoPE
//! mode; Q/K norms and biases follow from the tensors present). The model
//! spec, the graph builders, the snapshots and the converter's synthetic
//! models all read [`ArchSpec`]. Adding an architecture: a file here with
//! its `SPEC`, a variant of [`Arch`], its graph snapshot and its parity test.

mod gemma3;
mod llama;
mod qwen2;
mod qwen3;
mod qwen3moe;
mod table;

pub use table::{Act, Arch, ArchSpec, Need, ReadHparams, Shape, Tensor, ALL, MOE_FFN};

use super::error::ModelError;

impl Arch {
    pub fn spec(self) -> &'static ArchSpec {
        match self {
            Arch::Llama => &llama::SPEC,
            Arch::Qwen2 => &qwen2::SPEC,
            Arch::Qwen3 => &qwen3::SPEC,
            Arch::Qwen3Moe => &qwen3moe::SPEC,
            Arch::Gemma3 => &gemma3::SPEC,
        }
    }
    pub fn from_name(name: &str) -> Result<Arch, ModelError> {
        ALL.into_iter()
            .find(|a| a.name() == name)
            .ok_or_else(|| ModelError::UnknownArch {
                name: name.to_string(),
                supported: ALL.map(|a| a.name()).join(", "),
            })
    }
    pub fn name(self) -> &'static str {
        self.spec().name
    }
    /// ggml rope mode: 0 = NORM (adjacent pairs), 2 = NEOX (split halves).
    pub fn rope_mode(self) -> i32 {
        self.spec().rope_mode
    }
    /// Every tensor of a layer this architecture reads, both groups, dense
    /// FFN and mixture of experts.
    pub fn layer_tensors(self) -> impl Iterator<Item = &'static Tensor> {
        let s = self.spec();
        s.attn.iter().chain(s.ffn.iter()).chain(s.moe_ffn.iter())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Role;

    #[test]
    fn names_round_trip_and_tables_are_consistent() {
        for a in ALL {
            assert_eq!(Arch::from_name(a.name()).unwrap(), a);
            assert_eq!(a.spec().arch, a);
            // FfnNorm is in both FFN tables; every other role once
            let roles: Vec<Role> = a
                .layer_tensors()
                .map(|t| t.role)
                .filter(|&r| r != Role::FfnNorm)
                .collect();
            let mut dedup = roles.clone();
            dedup.sort();
            dedup.dedup();
            assert_eq!(dedup.len(), roles.len(), "{}: a role twice", a.name());
            // every group has its norm and its matrices
            for r in [Role::AttnNorm, Role::Wq, Role::Wk, Role::Wv, Role::Wo] {
                assert!(a
                    .spec()
                    .attn
                    .iter()
                    .any(|t| t.role == r && t.need == Need::Required));
            }
            assert!(a.spec().ffn_tensors(0).is_some() || a.spec().ffn_tensors(8).is_some());
        }
        assert!(Arch::Qwen3Moe.spec().ffn_tensors(0).is_none());
        assert!(Arch::Qwen2.spec().ffn_tensors(8).is_none());
        assert!(Arch::Llama.spec().ffn_tensors(8).is_some());
        assert!(Arch::from_name("gemma2").is_err());
    }
}
