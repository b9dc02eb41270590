//! Hyperparameters and the per-group tensor table, validated against the
//! architecture's expectations.

use super::arch::Arch;
use super::arch::Need;
use super::error::ModelError;
use super::hparams::bad;
use super::hparams::Hparams;
use super::role::Role;
use crate::dtype::GgmlType;
use crate::gguf::{GgufFile, TensorInfo};

/// A layer group: the unit of scheduling and paging.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum GroupKind {
    Attn,
    Ffn,
}

impl GroupKind {
    pub fn name(self) -> &'static str {
        match self {
            GroupKind::Attn => "attn",
            GroupKind::Ffn => "ffn",
        }
    }
}

/// A layer group: layer `l`'s attention is group 2l, its FFN group 2l+1,
/// the order a step runs them in and the index of every per-group table
/// (`ModelSpec::groups`, the weight store's locations and layouts).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GroupId(u32);

impl GroupId {
    pub fn new(layer: u32, kind: GroupKind) -> GroupId {
        GroupId(2 * layer + u32::from(kind == GroupKind::Ffn))
    }
    /// The group at `index` of the per-group tables.
    pub fn from_index(index: usize) -> GroupId {
        GroupId(u32::try_from(index).expect("group index fits u32"))
    }
    pub fn index(self) -> usize {
        self.0 as usize
    }
    pub fn layer(self) -> u32 {
        self.0 / 2
    }
    pub fn kind(self) -> GroupKind {
        if self.0.is_multiple_of(2) {
            GroupKind::Attn
        } else {
            GroupKind::Ffn
        }
    }
}

impl std::fmt::Display for GroupId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "g{}", self.0)
    }
}

/// One weight tensor: where it lies in the file and what it is.
#[derive(Clone, Debug, PartialEq)]
pub struct WeightSpec {
    pub role: Option<Role>,
    pub name: String,
    pub ty: GgmlType,
    /// ggml order, unused dims 1.
    pub ne: [i64; 4],
    /// Absolute byte offset in the model file.
    pub offset: u64,
    pub size: u64,
    /// A column slice of a matrix (a device's share in the row split,
    /// [`ModelSpec::shard`]): each of the tensor's rows is `size / rows`
    /// bytes taken at `skip` within the file's rows of `stride` bytes,
    /// the first at `offset`; None: the bytes are one extent.
    pub cols: Option<ColSlice>,
}

/// Where a column slice's rows lie in the file (see [`WeightSpec::cols`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ColSlice {
    /// Bytes of one whole row in the file.
    pub stride: u64,
    /// Bytes before the slice in each row.
    pub skip: u64,
}

impl WeightSpec {
    fn from_info(role: Option<Role>, t: &TensorInfo) -> WeightSpec {
        WeightSpec {
            role,
            name: t.name.clone(),
            ty: t.ty,
            ne: t.ne4(),
            offset: t.offset,
            size: t.size,
            cols: None,
        }
    }
    /// The rows of this matrix (ggml's ne1 and above).
    pub fn rows(&self) -> u64 {
        (self.ne[1] * self.ne[2] * self.ne[3]) as u64
    }
}

/// The tensors of one (layer, group), in a fixed role order.
#[derive(Clone, Debug, PartialEq)]
pub struct GroupSpec {
    pub layer: u32,
    pub kind: GroupKind,
    pub weights: Vec<WeightSpec>,
}

impl GroupSpec {
    /// (role, type) of each weight: layers with equal signatures share a
    /// graph template.
    pub fn signature(&self) -> Vec<(Role, GgmlType)> {
        self.weights
            .iter()
            .filter_map(|w| w.role.map(|r| (r, w.ty)))
            .collect()
    }
    pub fn bytes(&self) -> u64 {
        self.weights.iter().map(|w| w.size).sum()
    }
    pub fn weight(&self, role: Role) -> Option<&WeightSpec> {
        self.weights.iter().find(|w| w.role == Some(role))
    }
}

/// A validated description of a model file.
#[derive(Clone, Debug)]
pub struct ModelSpec {
    pub arch: Arch,
    pub name: String,
    pub hp: Hparams,
    /// Two groups per layer: groups[2*l] is attention, groups[2*l+1] FFN.
    pub groups: Vec<GroupSpec>,
    pub tok_embd: WeightSpec,
    pub output_norm: WeightSpec,
    /// The output head; the token embedding when the file ties them.
    pub output: WeightSpec,
    /// llama3 rope frequency factors [n_rot/2], shared by all layers.
    pub rope_freqs: Option<WeightSpec>,
    /// Whether this spec ends with the output head: true but in the part
    /// of a model a device before the last computes ([`ModelSpec::part`]).
    pub has_head: bool,
    /// A device's share of every layer's rows in the row split
    /// ([`ModelSpec::shard`]); None: whole layers.
    pub shard: Option<Shard>,
}

/// Which share of the row split a spec is (`ModelSpec::shard`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    /// This device's place among the split's (0: the one whose graphs add
    /// the residual stream, with the attention output's bias and the head).
    pub index: u32,
    pub count: u32,
}

fn expect_shape(t: &TensorInfo, expected: &[u64]) -> Result<(), ModelError> {
    if t.ne != expected {
        return Err(ModelError::BadShape {
            name: t.name.clone(),
            found: t.ne.clone(),
            expected: expected.to_vec(),
        });
    }
    Ok(())
}

/// Types strata computes with for a given role: norms and biases must be
/// float; matrices any type ggml can multiply on every backend we use.
fn check_type(t: &TensorInfo, norm_or_bias: bool) -> Result<(), ModelError> {
    let float = [GgmlType::F32, GgmlType::F16, GgmlType::BF16];
    let ok = if norm_or_bias {
        t.ty == GgmlType::F32
    } else {
        float.contains(&t.ty)
            || [
                GgmlType::Q4_0,
                GgmlType::Q4_1,
                GgmlType::Q5_0,
                GgmlType::Q5_1,
                GgmlType::Q8_0,
                GgmlType::Q2_K,
                GgmlType::Q3_K,
                GgmlType::Q4_K,
                GgmlType::Q5_K,
                GgmlType::Q6_K,
                GgmlType::IQ4_NL,
            ]
            .contains(&t.ty)
    };
    if ok {
        Ok(())
    } else {
        Err(ModelError::BadType {
            name: t.name.clone(),
            ty: t.ty.name().to_string(),
        })
    }
}

/// What a tensor strata does not read usually means, for the error.
fn unsupported_hint(name: &str) -> &'static str {
    let has = |s: &str| name.contains(s);
    let per_expert = ["ffn_gate.", "ffn_up.", "ffn_down."].iter().any(|p| {
        name.split_once(p)
            .and_then(|(_, r)| r.split('.').next())
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    });
    if has("_shexp") {
        ": shared experts"
    } else if per_expert {
        ": one tensor per expert (an old Mixtral conversion; llama.cpp's convert_hf_to_gguf.py writes them stacked as ffn_*_exps)"
    } else if has("_exps") || has("ffn_gate_inp") {
        ": a mixture of experts (without an expert_count key, or in an architecture strata reads without experts)"
    } else if has("attn_qkv") {
        ": fused QKV"
    } else if has("ffn_gate.bias") || has("ffn_up.bias") || has("ffn_down.bias") {
        ": FFN biases"
    } else if has("post_attention_norm") || has("post_ffw_norm") {
        ": post-norms (Gemma)"
    } else {
        ""
    }
}

impl ModelSpec {
    /// Reads and validates the model description of a GGUF file.
    pub fn from_gguf(f: &GgufFile) -> Result<ModelSpec, ModelError> {
        let arch = Arch::from_name(f.get_str("general.architecture")?)?;
        let mut hp = Hparams::from_gguf(f, arch.name())?;
        if let Some(read) = arch.spec().read_hparams {
            read(f, &mut hp)?;
        }
        let name = f.get_str_opt("general.name")?.unwrap_or("").to_string();
        super::vocab::validate_vocab(f)?;
        // a block_count below the layers present would silently drop them
        for t in &f.tensors {
            let layer = t
                .name
                .strip_prefix("blk.")
                .and_then(|r| r.split('.').next())
                .and_then(|n| n.parse::<u64>().ok());
            if layer.is_some_and(|l| l >= hp.n_layer as u64) {
                return Err(ModelError::ExtraLayer {
                    key: format!("{}.block_count", arch.name()),
                    n_layer: hp.n_layer,
                    tensor: t.name.clone(),
                });
            }
        }
        let (e, l) = (hp.n_embd as u64, hp.n_layer);

        let tok = f.require_tensor("token_embd.weight")?;
        if tok.ne.len() != 2 || tok.ne[0] != e {
            return Err(ModelError::BadShape {
                name: tok.name.clone(),
                found: tok.ne.clone(),
                expected: vec![e, 0],
            });
        }
        let n_vocab = tok.ne[1];
        if n_vocab == 0 || n_vocab > u32::MAX as u64 {
            return Err(bad(
                "token_embd.weight ne1",
                n_vocab,
                "vocabulary size out of range",
            ));
        }
        hp.n_vocab = n_vocab as u32;
        check_type(tok, false)?;
        let out_norm = f.require_tensor("output_norm.weight")?;
        expect_shape(out_norm, &[e])?;
        check_type(out_norm, true)?;
        let output = match f.tensor("output.weight") {
            Some(t) => {
                expect_shape(t, &[e, n_vocab])?;
                check_type(t, false)?;
                t
            }
            None => tok,
        };
        let rope_freqs = match f.tensor("rope_freqs.weight") {
            Some(t) => {
                expect_shape(t, &[hp.n_rot as u64 / 2])?;
                check_type(t, true)?;
                Some(WeightSpec::from_info(None, t))
            }
            None => None,
        };

        // what the file carries that this architecture does not read is
        // refused by name, never ignored (it would compute something else)
        let top = [
            "token_embd.weight",
            "output_norm.weight",
            "output.weight",
            "rope_freqs.weight",
        ];
        let spec = arch.spec();
        // the FFN is dense or a mixture of experts as the file's
        // expert_count says
        let ffn = spec.ffn_tensors(hp.n_expert).ok_or_else(|| {
            let key = format!("{}.expert_count", arch.name());
            if hp.is_moe() {
                ModelError::Unsupported(format!(
                    "{key} = {}: {} files strata reads have no experts",
                    hp.n_expert,
                    arch.name()
                ))
            } else {
                bad(
                    &key,
                    0,
                    "this architecture is a mixture of experts: must be > 0",
                )
            }
        })?;
        for t in &f.tensors {
            let known = match t.name.strip_prefix("blk.").and_then(|r| r.split_once('.')) {
                Some((_, suffix)) => spec
                    .attn
                    .iter()
                    .chain(ffn)
                    .any(|x| x.role.suffix() == suffix),
                None => top.contains(&t.name.as_str()),
            };
            if !known {
                return Err(ModelError::Unsupported(format!(
                    "tensor {} ({} files strata reads carry no such tensor{})",
                    t.name,
                    arch.name(),
                    unsupported_hint(&t.name)
                )));
            }
        }
        let mut groups = Vec::with_capacity(2 * l as usize);
        for layer in 0..l {
            for (kind, table) in [(GroupKind::Attn, spec.attn), (GroupKind::Ffn, ffn)] {
                let mut weights = Vec::new();
                for x in table {
                    let n = format!("blk.{layer}.{}", x.role.suffix());
                    let Some(t) = f.tensor(&n) else {
                        if x.need == Need::Required {
                            return Err(crate::gguf::GgufError::MissingTensor(n).into());
                        }
                        continue;
                    };
                    expect_shape(t, &x.shape.ne(&hp))?;
                    check_type(t, x.role.is_norm_or_bias())?;
                    weights.push(WeightSpec::from_info(Some(x.role), t));
                }
                groups.push(GroupSpec {
                    layer,
                    kind,
                    weights,
                });
            }
        }
        Ok(ModelSpec {
            arch,
            name,
            hp,
            groups,
            tok_embd: WeightSpec::from_info(None, tok),
            output_norm: WeightSpec::from_info(None, out_norm),
            output: WeightSpec::from_info(None, output),
            rope_freqs,
            has_head: true,
            shard: None,
        })
    }

    /// The part of this model one of several devices computes: layers
    /// `layers` of the file, renumbered from 0 (`Hparams::layer0` keeps
    /// the file's index), with the output head only if it is the last part.
    /// The embedding stays in the spec (the host reads it from the file);
    /// only the part with `hp.layer0 == 0` embeds.
    pub fn part(&self, layers: std::ops::Range<u32>) -> ModelSpec {
        assert!(
            layers.start < layers.end && layers.end <= self.hp.n_layer,
            "layers {layers:?} of {}",
            self.hp.n_layer
        );
        let groups = self.groups[2 * layers.start as usize..2 * layers.end as usize]
            .iter()
            .map(|g| GroupSpec {
                layer: g.layer - layers.start,
                ..g.clone()
            })
            .collect();
        ModelSpec {
            hp: Hparams {
                n_layer: layers.end - layers.start,
                layer0: self.hp.layer0 + layers.start,
                ..self.hp.clone()
            },
            groups,
            has_head: self.has_head && layers.end == self.hp.n_layer,
            ..self.clone()
        }
    }

    /// Whether this spec embeds the tokens (it starts at the file's first
    /// layer; every device of the row split does).
    pub fn embeds(&self) -> bool {
        self.hp.layer0 == 0
    }

    pub fn group(&self, layer: u32, kind: GroupKind) -> &GroupSpec {
        &self.groups[2 * layer as usize + usize::from(kind == GroupKind::Ffn)]
    }

    /// Bytes of all layer-group weights.
    pub fn layer_bytes(&self) -> u64 {
        self.groups.iter().map(|g| g.bytes()).sum()
    }
}

#[cfg(test)]
mod group_id_tests {
    use super::*;

    #[test]
    fn group_ids_run_attention_then_ffn_per_layer() {
        let mut seen = Vec::new();
        for layer in 0..5 {
            for kind in [GroupKind::Attn, GroupKind::Ffn] {
                let g = GroupId::new(layer, kind);
                assert_eq!((g.layer(), g.kind()), (layer, kind));
                assert_eq!(GroupId::from_index(g.index()), g);
                seen.push(g.index());
            }
        }
        assert_eq!(seen, (0..10).collect::<Vec<_>>());
        assert_eq!(GroupId::new(3, GroupKind::Ffn).to_string(), "g7");
    }
}
