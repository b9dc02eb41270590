//! Hyperparameters and the per-group tensor table, validated against the
//! architecture's expectations.

use super::arch::Arch;
use super::error::ModelError;
use crate::dtype::GgmlType;
use crate::gguf::{GgufFile, TensorInfo};

/// Hyperparameters read from `{arch}.*` metadata (llama.cpp key names).
#[derive(Clone, Debug, PartialEq)]
pub struct Hparams {
    pub n_vocab: u32,
    pub n_ctx_train: u32,
    pub n_embd: u32,
    pub n_layer: u32,
    pub n_ff: u32,
    pub n_head: u32,
    pub n_head_kv: u32,
    /// Per-head dimension of Q/K/V.
    pub head_dim: u32,
    pub n_rot: u32,
    pub rms_eps: f32,
    pub rope_freq_base: f32,
    pub rope_freq_scale: f32,
    pub n_ctx_orig: u32,
    /// Attention scale; llama.cpp default 1/sqrt(head_dim).
    pub kq_scale: f32,
}

impl Hparams {
    /// K (or V) row width of one token: head_dim * n_head_kv.
    pub fn n_embd_kv(&self) -> u32 {
        self.head_dim * self.n_head_kv
    }
    /// Q width: head_dim * n_head.
    pub fn n_embd_q(&self) -> u32 {
        self.head_dim * self.n_head
    }
}

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

/// What a weight tensor does inside its group.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    AttnNorm,
    Wq,
    Bq,
    Wk,
    Bk,
    Wv,
    Bv,
    Wo,
    Bo,
    FfnNorm,
    Gate,
    Up,
    Down,
}

impl Role {
    /// GGUF tensor name suffix after "blk.N.".
    pub fn suffix(self) -> &'static str {
        match self {
            Role::AttnNorm => "attn_norm.weight",
            Role::Wq => "attn_q.weight",
            Role::Bq => "attn_q.bias",
            Role::Wk => "attn_k.weight",
            Role::Bk => "attn_k.bias",
            Role::Wv => "attn_v.weight",
            Role::Bv => "attn_v.bias",
            Role::Wo => "attn_output.weight",
            Role::Bo => "attn_output.bias",
            Role::FfnNorm => "ffn_norm.weight",
            Role::Gate => "ffn_gate.weight",
            Role::Up => "ffn_up.weight",
            Role::Down => "ffn_down.weight",
        }
    }
    fn is_norm_or_bias(self) -> bool {
        matches!(
            self,
            Role::AttnNorm | Role::FfnNorm | Role::Bq | Role::Bk | Role::Bv | Role::Bo
        )
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
        }
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
}

fn bad(key: &str, value: impl ToString, why: &'static str) -> ModelError {
    ModelError::BadHparam {
        key: key.to_string(),
        value: value.to_string(),
        why,
    }
}

impl Hparams {
    pub fn from_gguf(f: &GgufFile, arch: Arch) -> Result<Hparams, ModelError> {
        let a = arch.name();
        let k = |s: &str| format!("{a}.{s}");
        let n_embd = f.get_u32(&k("embedding_length"))?;
        let n_layer = f.get_u32(&k("block_count"))?;
        let n_ff = f.get_u32(&k("feed_forward_length"))?;
        let n_head = f.get_u32(&k("attention.head_count"))?;
        let n_head_kv = f
            .get_u32_opt(&k("attention.head_count_kv"))?
            .unwrap_or(n_head);
        let n_ctx_train = f.get_u32(&k("context_length"))?;
        if n_embd == 0 || n_embd > 1 << 16 {
            return Err(bad(&k("embedding_length"), n_embd, "must be in 1..=65536"));
        }
        if n_layer == 0 || n_layer > 4096 {
            return Err(bad(&k("block_count"), n_layer, "must be in 1..=4096"));
        }
        if n_ff == 0 || n_ff > 1 << 20 {
            return Err(bad(&k("feed_forward_length"), n_ff, "must be in 1..=2^20"));
        }
        if n_head == 0 || n_head > 1024 {
            return Err(bad(
                &k("attention.head_count"),
                n_head,
                "must be in 1..=1024",
            ));
        }
        if n_head_kv == 0 || n_head % n_head_kv != 0 {
            return Err(bad(
                &k("attention.head_count_kv"),
                n_head_kv,
                "must divide head_count",
            ));
        }
        let head_dim = f
            .get_u32_opt(&k("attention.key_length"))?
            .unwrap_or(n_embd / n_head);
        let head_dim_v = f
            .get_u32_opt(&k("attention.value_length"))?
            .unwrap_or(head_dim);
        if head_dim == 0 || head_dim % 2 != 0 || head_dim > 1024 {
            return Err(bad(
                &k("attention.key_length"),
                head_dim,
                "must be even and in 2..=1024",
            ));
        }
        if head_dim_v != head_dim {
            return Err(ModelError::Unsupported(format!(
                "value_length {head_dim_v} != key_length {head_dim}"
            )));
        }
        let n_rot = f
            .get_u32_opt(&k("rope.dimension_count"))?
            .unwrap_or(head_dim);
        if n_rot != head_dim {
            return Err(bad(
                &k("rope.dimension_count"),
                n_rot,
                "must equal the head dimension",
            ));
        }
        let rms_eps = f.get_f32(&k("attention.layer_norm_rms_epsilon"))?;
        if !(rms_eps > 0.0 && rms_eps < 1.0) {
            return Err(bad(
                &k("attention.layer_norm_rms_epsilon"),
                rms_eps,
                "must be in (0, 1)",
            ));
        }
        let rope_freq_base = f.get_f32_opt(&k("rope.freq_base"))?.unwrap_or(10000.0);
        if !(rope_freq_base.is_finite() && rope_freq_base > 0.0) {
            return Err(bad(
                &k("rope.freq_base"),
                rope_freq_base,
                "must be positive",
            ));
        }
        let scaling = f.get_str_opt(&k("rope.scaling.type"))?.unwrap_or("none");
        let factor = match f.get_f32_opt(&k("rope.scaling.factor"))? {
            Some(x) => x,
            None => f.get_f32_opt(&k("rope.scale_linear"))?.unwrap_or(1.0),
        };
        let rope_freq_scale = match scaling {
            "none" => 1.0,
            "linear" if factor > 0.0 && factor.is_finite() => 1.0 / factor,
            "linear" => return Err(bad(&k("rope.scaling.factor"), factor, "must be positive")),
            other => {
                return Err(ModelError::Unsupported(format!(
                    "rope scaling type '{other}'"
                )))
            }
        };
        let n_ctx_orig = f
            .get_u32_opt(&k("rope.scaling.original_context_length"))?
            .unwrap_or(n_ctx_train);
        let scale = f.get_f32_opt(&k("attention.scale"))?.unwrap_or(0.0);
        let kq_scale = if scale == 0.0 {
            1.0 / (head_dim as f32).sqrt()
        } else {
            scale
        };
        Ok(Hparams {
            n_vocab: 0, // filled from the embedding table by ModelSpec
            n_ctx_train,
            n_embd,
            n_layer,
            n_ff,
            n_head,
            n_head_kv,
            head_dim,
            n_rot,
            rms_eps,
            rope_freq_base,
            rope_freq_scale,
            n_ctx_orig,
            kq_scale,
        })
    }
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

impl ModelSpec {
    /// Reads and validates the model description of a GGUF file.
    pub fn from_gguf(f: &GgufFile) -> Result<ModelSpec, ModelError> {
        let arch = Arch::from_name(f.get_str("general.architecture")?)?;
        let mut hp = Hparams::from_gguf(f, arch)?;
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

        let (q, kv, ff) = (hp.n_embd_q() as u64, hp.n_embd_kv() as u64, hp.n_ff as u64);
        let mut groups = Vec::with_capacity(2 * l as usize);
        for layer in 0..l {
            let get = |role: Role, required: bool| -> Result<Option<&TensorInfo>, ModelError> {
                let n = format!("blk.{layer}.{}", role.suffix());
                match f.tensor(&n) {
                    Some(t) => Ok(Some(t)),
                    None if required => Err(crate::gguf::GgufError::MissingTensor(n).into()),
                    None => Ok(None),
                }
            };
            if f.tensor(&format!("blk.{layer}.attn_qkv.weight")).is_some() {
                return Err(ModelError::Unsupported(format!(
                    "fused QKV tensor in layer {layer}"
                )));
            }
            for extra in [
                "ffn_gate.bias",
                "ffn_up.bias",
                "ffn_down.bias",
                "ffn_gate_inp.weight",
            ] {
                if f.tensor(&format!("blk.{layer}.{extra}")).is_some() {
                    return Err(ModelError::Unsupported(format!(
                        "tensor blk.{layer}.{extra} (MoE / FFN bias)"
                    )));
                }
            }
            let bias_req = arch.requires_qkv_bias();
            let attn: [(Role, bool, Vec<u64>); 9] = [
                (Role::AttnNorm, true, vec![e]),
                (Role::Wq, true, vec![e, q]),
                (Role::Bq, bias_req, vec![q]),
                (Role::Wk, true, vec![e, kv]),
                (Role::Bk, bias_req, vec![kv]),
                (Role::Wv, true, vec![e, kv]),
                (Role::Bv, bias_req, vec![kv]),
                (Role::Wo, true, vec![q, e]),
                (Role::Bo, false, vec![e]),
            ];
            let ffn: [(Role, bool, Vec<u64>); 4] = [
                (Role::FfnNorm, true, vec![e]),
                (Role::Gate, true, vec![e, ff]),
                (Role::Up, true, vec![e, ff]),
                (Role::Down, true, vec![ff, e]),
            ];
            for (kind, table) in [(GroupKind::Attn, &attn[..]), (GroupKind::Ffn, &ffn[..])] {
                let mut weights = Vec::new();
                for (role, required, shape) in table {
                    if let Some(t) = get(*role, *required)? {
                        expect_shape(t, shape)?;
                        check_type(t, role.is_norm_or_bias())?;
                        weights.push(WeightSpec::from_info(Some(*role), t));
                    }
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
        })
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
