//! A device's share of every layer in the row split (tensor parallel, as
//! llama.cpp's `-sm row` and Megatron's layers): each device computes some
//! of the attention heads and some of the FFN's hidden columns of every
//! layer, and the devices' outputs are summed after each group.
//!
//! The slices follow from the matrices' roles: Q, K, V, gate and up are
//! cut by rows (their outputs: one extent of the file each), the attention
//! output and down projections by columns (their inputs: a strided slice of
//! every row, [`ColSlice`]). Norms are whole on every device; the attention
//! output's bias goes to the first device only, so the sum adds it once.
//! Which heads and columns each device takes is `paging::devices::split_rows`.

use super::error::ModelError;
use super::hparams::Hparams;
use super::role::Role;
use super::spec::{ColSlice, GroupSpec, ModelSpec, Shard, WeightSpec};
use std::ops::Range;

impl ModelSpec {
    /// The FFN columns of a row split are cut in multiples of this (the
    /// down projection's quantization block: its rows are cut across).
    pub fn ffn_align(&self) -> u32 {
        self.groups
            .iter()
            .flat_map(|g| &g.weights)
            .filter(|w| w.role == Some(Role::Down))
            .filter_map(|w| w.ty.block_size())
            .max()
            .unwrap_or(1) as u32
    }

    /// Device `index` of `count`'s share of every layer: KV heads `kv`
    /// (and the query heads that share them), FFN columns `ff`. Device 0
    /// keeps the output head and the attention output's bias. Refused for
    /// what a sum of per-device outputs cannot compute: a mixture of
    /// experts, post-norms (Gemma 3), and slices that cut a quantization
    /// block.
    pub fn shard(
        &self,
        index: u32,
        count: u32,
        kv: Range<u32>,
        ff: Range<u32>,
    ) -> Result<ModelSpec, ModelError> {
        let hp = &self.hp;
        let refuse = |why: String| Err(ModelError::Unsupported(format!("the row split: {why}")));
        if hp.is_moe() {
            return refuse(
                "a mixture of experts splits by layers only (--split-mode layer)".into(),
            );
        }
        if kv.start >= kv.end || kv.end > hp.n_head_kv || ff.start >= ff.end || ff.end > hp.n_ff {
            return refuse(format!(
                "KV heads {kv:?} of {} and FFN columns {ff:?} of {}",
                hp.n_head_kv, hp.n_ff
            ));
        }
        let gqa = hp.n_head / hp.n_head_kv;
        let hd = hp.head_dim;
        let q = kv.start * gqa * hd..kv.end * gqa * hd;
        let k = kv.start * hd..kv.end * hd;
        let mut groups = Vec::with_capacity(self.groups.len());
        for g in &self.groups {
            let mut weights = Vec::with_capacity(g.weights.len());
            for w in &g.weights {
                let role = w.role.ok_or_else(|| {
                    ModelError::Unsupported(format!("the row split: tensor '{}'", w.name))
                })?;
                let s = match role {
                    Role::AttnNorm | Role::FfnNorm | Role::QNorm | Role::KNorm => w.clone(),
                    Role::Wq => rows(w, &q),
                    Role::Wk | Role::Wv => rows(w, &k),
                    Role::Bq => rows(w, &q),
                    Role::Bk | Role::Bv => rows(w, &k),
                    Role::Wo => cols(w, &q)?,
                    Role::Bo if index == 0 => w.clone(),
                    Role::Bo => continue,
                    Role::Gate | Role::Up => rows(w, &ff),
                    Role::Down => cols(w, &ff)?,
                    _ => {
                        return refuse(format!(
                            "tensor '{}' ({}) cannot be split by rows (--split-mode layer)",
                            w.name,
                            role.suffix()
                        ))
                    }
                };
                weights.push(s);
            }
            groups.push(GroupSpec {
                weights,
                ..g.clone()
            });
        }
        Ok(ModelSpec {
            hp: Hparams {
                n_head: (kv.end - kv.start) * gqa,
                n_head_kv: kv.end - kv.start,
                n_ff: ff.end - ff.start,
                ..hp.clone()
            },
            groups,
            has_head: self.has_head && index == 0,
            shard: Some(Shard { index, count }),
            ..self.clone()
        })
    }
}

/// Rows `r` of a matrix, or elements `r` of a vector (a bias): one extent.
fn rows(w: &WeightSpec, r: &Range<u32>) -> WeightSpec {
    let (r0, n) = (u64::from(r.start), u64::from(r.end - r.start));
    let vector = w.rows() == 1;
    let (unit, ne) = if vector {
        (w.size / w.ne[0] as u64, [n as i64, 1, 1, 1])
    } else {
        (w.size / w.rows(), [w.ne[0], n as i64, 1, 1])
    };
    WeightSpec {
        ne,
        offset: w.offset + r0 * unit,
        size: n * unit,
        ..w.clone()
    }
}

/// Columns `c` of every row of a matrix: a strided slice.
fn cols(w: &WeightSpec, c: &Range<u32>) -> Result<WeightSpec, ModelError> {
    let bad = || {
        ModelError::Unsupported(format!(
            "the row split: columns {c:?} of '{}' ({}) cut its quantization blocks",
            w.name,
            w.ty.name()
        ))
    };
    let at = w.ty.row_bytes(u64::from(c.start)).ok_or_else(bad)?;
    let width = w.ty.row_bytes(u64::from(c.end - c.start)).ok_or_else(bad)?;
    Ok(WeightSpec {
        ne: [i64::from(c.end - c.start), w.ne[1], w.ne[2], w.ne[3]],
        size: width * w.rows(),
        cols: Some(ColSlice {
            stride: w.size / w.rows(),
            skip: at,
        }),
        ..w.clone()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::GgmlType;

    fn w(role: Role, ty: GgmlType, ne: [i64; 4]) -> WeightSpec {
        let size = ty.row_bytes(ne[0] as u64).unwrap() * (ne[1] * ne[2] * ne[3]) as u64;
        WeightSpec {
            role: Some(role),
            name: role.suffix().into(),
            ty,
            ne,
            offset: 4096,
            size,
            cols: None,
        }
    }

    #[test]
    fn rows_are_one_extent_and_columns_a_strided_slice() {
        // Q4_0: 18 bytes per 32 values; 4 rows of 128 values = 72 bytes each
        let m = w(Role::Wq, GgmlType::Q4_0, [128, 4, 1, 1]);
        let r = rows(&m, &(1..3));
        assert_eq!(
            (r.ne, r.offset, r.size, r.cols),
            ([128, 2, 1, 1], 4096 + 72, 144, None)
        );
        let c = cols(&m, &(32..96)).unwrap();
        assert_eq!((c.ne, c.offset, c.size), ([64, 4, 1, 1], 4096, 4 * 36));
        assert_eq!(
            c.cols,
            Some(ColSlice {
                stride: 72,
                skip: 18
            })
        );
        // a cut inside a block is refused, naming the tensor
        let e = cols(&m, &(16..64)).unwrap_err().to_string();
        assert!(e.contains("attn_q.weight") && e.contains("q4_0"), "{e}");
        // a bias: elements
        let b = w(Role::Bq, GgmlType::F32, [128, 1, 1, 1]);
        let r = rows(&b, &(64..128));
        assert_eq!((r.ne, r.offset, r.size), ([64, 1, 1, 1], 4096 + 256, 256));
    }
}
