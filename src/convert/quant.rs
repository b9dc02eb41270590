//! Output types and row conversion through ggml's own (de)quantizers.
//!
//! Which tensors change type mirrors llama.cpp's `llama-quant.cpp`
//! (`tensor_allows_quantization`, `tensor_type_fallback`): only 2-D (or
//! larger) tensors whose name ends in "weight" and is not a norm; a row
//! length that is not a whole number of the target's blocks falls back the
//! way llama.cpp does (q4_K -> q5_0, q5_K -> q5_1, q6_K -> q8_0, q2_K/q3_K ->
//! q4_0, then f16). 1-D tensors (norms, biases, rope_freqs) are written as
//! f32, which is what strata computes with. Conversion is row-parallel:
//! rows are split over threads, each calling ggml's `to_float` and
//! `ggml_quantize_chunk` on its own slice.
//!
//! `--type q4_k_m` is llama.cpp's Q4_K_M mix (`llama_tensor_get_type_impl`
//! for LLAMA_FTYPE_MOSTLY_Q4_K_M, the file type most models are published
//! in): q4_K matrices; q6_K for the output (the token embedding when it is
//! tied) and for `attn_v` and `ffn_down` (experts too) on the layers
//! `use_more_bits` picks; with 8 experts (Mixtral) `attn_v`/`attn_k` q8_0
//! and `attn_output` q5_K. A test checks every tensor against libllama's
//! own quantizer.

use super::error::ConvertError;
use super::error::Result;
use crate::dtype::GgmlType;

/// Types `--type` accepts: what ggml quantizes without an importance
/// matrix and strata's kernels accept.
const TYPES: [(&str, GgmlType); 14] = [
    ("f32", GgmlType::F32),
    ("f16", GgmlType::F16),
    ("bf16", GgmlType::BF16),
    ("q8_0", GgmlType::Q8_0),
    ("q4_0", GgmlType::Q4_0),
    ("q4_1", GgmlType::Q4_1),
    ("q5_0", GgmlType::Q5_0),
    ("q5_1", GgmlType::Q5_1),
    ("q2_k", GgmlType::Q2_K),
    ("q3_k", GgmlType::Q3_K),
    ("q4_k", GgmlType::Q4_K),
    ("q5_k", GgmlType::Q5_K),
    ("q6_k", GgmlType::Q6_K),
    ("iq4_nl", GgmlType::IQ4_NL),
];

/// What `--type` asks for: one type for every matrix, or llama.cpp's
/// Q4_K_M mix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    Type(GgmlType),
    Q4KM,
}

/// `general.file_type` of the Q4_K_M mix (LLAMA_FTYPE_MOSTLY_Q4_K_M).
const FTYPE_Q4_K_M: u32 = 15;

impl Target {
    /// `general.file_type` (llama_ftype) of a model converted to this target.
    pub fn file_type(self) -> Option<u32> {
        match self {
            Target::Type(t) => file_type(t),
            Target::Q4KM => Some(FTYPE_Q4_K_M),
        }
    }

    /// The type most matrices take.
    pub fn main_type(self) -> GgmlType {
        match self {
            Target::Type(t) => t,
            Target::Q4KM => GgmlType::Q4_K,
        }
    }
}

/// Parses a `--type` value (case-insensitive: "q4_K" and "q4_k" both work).
pub fn parse_type(s: &str) -> Result<GgmlType> {
    let l = s.to_ascii_lowercase();
    TYPES
        .iter()
        .find(|(n, _)| *n == l)
        .map(|&(_, t)| t)
        .ok_or_else(|| ConvertError::UnknownType(s.to_string()))
}

/// Parses a `--type` value: a type of [`parse_type`] or the mix "q4_k_m".
pub fn parse_target(s: &str) -> Result<Target> {
    if s.eq_ignore_ascii_case("q4_k_m") {
        return Ok(Target::Q4KM);
    }
    parse_type(s).map(Target::Type)
}

/// What a mix's per-tensor rule reads of the model.
#[derive(Clone, Copy, Debug)]
pub struct MixInfo {
    pub n_layer: u32,
    /// Experts per layer (0 or 1: dense).
    pub n_expert: u32,
    /// Whether the model has its own `output.weight` (else the token
    /// embedding is the output and takes the output's type).
    pub has_output: bool,
}

/// llama.cpp's `use_more_bits`: the first and last eighth of the layers and
/// every third layer between.
fn use_more_bits(i: i64, n: i64) -> bool {
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

/// The layer index of a `blk.N.` tensor.
fn layer_of(name: &str) -> Option<i64> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

/// The Q4_K_M mix's type for matrix `name` (before the block fallback).
fn q4_k_m_type(name: &str, m: &MixInfo) -> GgmlType {
    let more_bits = || layer_of(name).is_some_and(|i| use_more_bits(i, i64::from(m.n_layer)));
    let eight = m.n_expert == 8;
    if name == "output.weight" || (name == "token_embd.weight" && !m.has_output) {
        GgmlType::Q6_K
    } else if name.contains("attn_v.weight") {
        if eight {
            GgmlType::Q8_0
        } else if more_bits() {
            GgmlType::Q6_K
        } else {
            GgmlType::Q4_K
        }
    } else if name.contains("attn_k.weight") && eight {
        GgmlType::Q8_0
    } else if name.contains("ffn_down") && more_bits() {
        GgmlType::Q6_K
    } else if (name.contains("attn_output.weight") && eight) || name.contains("attn_qkv.weight") {
        GgmlType::Q5_K
    } else {
        GgmlType::Q4_K
    }
}

/// `general.file_type` (llama_ftype) for a model whose matrices are `ty`.
pub fn file_type(ty: GgmlType) -> Option<u32> {
    Some(match ty {
        GgmlType::F32 => 0,
        GgmlType::F16 => 1,
        GgmlType::Q4_0 => 2,
        GgmlType::Q4_1 => 3,
        GgmlType::Q8_0 => 7,
        GgmlType::Q5_0 => 8,
        GgmlType::Q5_1 => 9,
        GgmlType::Q2_K => 10,
        GgmlType::Q3_K => 11, // Q3_K_S
        GgmlType::Q4_K => 14, // Q4_K_S
        GgmlType::Q5_K => 16, // Q5_K_S
        GgmlType::Q6_K => 18,
        GgmlType::IQ4_NL => 25,
        GgmlType::BF16 => 32,
        _ => return None,
    })
}

/// llama.cpp's rule for which tensors take the target type.
pub fn allows_quantization(name: &str, ne: &[u64]) -> bool {
    // ggml_n_dims: one past the last dim above 1
    let n_dims = ne.iter().rposition(|&d| d > 1).map_or(1, |i| i + 1);
    n_dims >= 2
        && name.ends_with("weight")
        && !name.contains("_norm.weight")
        && !name.contains("ffn_gate_inp.weight")
}

/// llama.cpp's `tensor_type_fallback`: a type whose block divides `ne0`.
pub fn fallback(target: GgmlType, ne0: u64) -> GgmlType {
    let fits = |t: GgmlType| t.block_size().is_some_and(|b| ne0.is_multiple_of(b));
    if fits(target) {
        return target;
    }
    let next = match target {
        GgmlType::Q2_K | GgmlType::Q3_K => GgmlType::Q4_0,
        GgmlType::Q4_K => GgmlType::Q5_0,
        GgmlType::Q5_K => GgmlType::Q5_1,
        GgmlType::Q6_K => GgmlType::Q8_0,
        _ => GgmlType::F16,
    };
    if fits(next) {
        next
    } else {
        GgmlType::F16
    }
}

fn is_float(t: GgmlType) -> bool {
    matches!(t, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
}

/// The output type of tensor `name` (shape `ne`, now `src`) under `target`
/// (`None`: keep matrices as they are) in a model `m` describes.
pub fn choose_type(
    name: &str,
    ne: &[u64],
    src: GgmlType,
    target: Option<Target>,
    m: &MixInfo,
) -> GgmlType {
    if !allows_quantization(name, ne) {
        // norms, biases, rope_freqs: f32 (strata's kernels want f32 there)
        return if is_float(src) { GgmlType::F32 } else { src };
    }
    match target {
        Some(Target::Type(t)) => fallback(t, ne[0]),
        Some(Target::Q4KM) => fallback(q4_k_m_type(name, m), ne[0]),
        None => src,
    }
}

/// Checks that ggml can produce `ty` rows of `n_per_row` without extra input.
pub fn check_target(tensor: &str, ty: GgmlType, n_per_row: u64) -> Result<()> {
    let err = |reason: String| ConvertError::Quantize {
        tensor: tensor.to_string(),
        ty: ty.name().to_string(),
        reason,
    };
    if !TYPES.iter().any(|&(_, t)| t == ty) {
        return Err(err("not a supported output type".into()));
    }
    // SAFETY: pure query on a known type id.
    if unsafe { crate::sys::ggml_quantize_requires_imatrix(ty.0) } {
        return Err(err("needs an importance matrix".into()));
    }
    if ty.row_bytes(n_per_row).is_none() {
        return Err(err(format!(
            "row of {n_per_row} is not a whole number of blocks"
        )));
    }
    Ok(())
}

/// Splits `n_rows` into at most `threads` contiguous ranges.
fn split(n_rows: usize, threads: usize) -> Vec<std::ops::Range<usize>> {
    let t = threads.clamp(1, n_rows.max(1));
    let per = n_rows.div_ceil(t);
    (0..t)
        .map(|i| (i * per).min(n_rows)..((i + 1) * per).min(n_rows))
        .filter(|r| !r.is_empty())
        .collect()
}

/// Dequantizes `src` (whole rows of `n_per_row` elements of `ty`) into `out`.
pub fn to_f32(
    src: &[u8],
    ty: GgmlType,
    n_per_row: usize,
    threads: usize,
    out: &mut Vec<f32>,
) -> Result<()> {
    let rb = row_bytes(ty, n_per_row)?;
    if !src.len().is_multiple_of(rb) {
        return Err(ConvertError::Layout(format!(
            "{} bytes is not a whole number of {} rows",
            src.len(),
            ty.name()
        )));
    }
    let n_rows = src.len() / rb;
    out.clear();
    out.resize(n_rows * n_per_row, 0.0);
    let parts = split(n_rows, threads);
    let mut outs = Vec::new();
    let mut rest = &mut out[..];
    for r in &parts {
        let (a, b) = rest.split_at_mut(r.len() * n_per_row);
        outs.push(a);
        rest = b;
    }
    std::thread::scope(|s| {
        let jobs: Vec<_> = parts
            .iter()
            .zip(outs)
            .map(|(r, o)| {
                let src = &src[r.start * rb..r.end * rb];
                s.spawn(move || {
                    for (row, dst) in src.chunks_exact(rb).zip(o.chunks_exact_mut(n_per_row)) {
                        crate::ggml::dequantize_row(ty, row, dst)?;
                    }
                    Ok::<(), crate::ggml::GgmlError>(())
                })
            })
            .collect();
        for j in jobs {
            j.join()
                .map_err(|_| ConvertError::Layout("dequantize worker panicked".into()))??;
        }
        Ok(())
    })
}

fn row_bytes(ty: GgmlType, n_per_row: usize) -> Result<usize> {
    ty.row_bytes(n_per_row as u64)
        .map(|b| b as usize)
        .ok_or_else(|| {
            ConvertError::Layout(format!("row of {n_per_row} does not fit {}", ty.name()))
        })
}

/// Converts `src` (rows of `n_per_row` f32) to `ty` with
/// `ggml_quantize_chunk`, appending to `out`.
pub fn from_f32(
    src: &[f32],
    ty: GgmlType,
    n_per_row: usize,
    threads: usize,
    out: &mut Vec<u8>,
) -> Result<()> {
    check_target("<rows>", ty, n_per_row as u64)?;
    let rb = row_bytes(ty, n_per_row)?;
    let n_rows = src.len() / n_per_row.max(1);
    let base = out.len();
    out.resize(base + n_rows * rb, 0);
    let parts = split(n_rows, threads);
    let mut outs = Vec::new();
    let mut rest = &mut out[base..];
    for r in &parts {
        let (a, b) = rest.split_at_mut(r.len() * rb);
        outs.push(a);
        rest = b;
    }
    std::thread::scope(|s| {
        for (r, o) in parts.iter().zip(outs) {
            let src = &src[r.start * n_per_row..r.end * n_per_row];
            s.spawn(move || {
                // SAFETY: `src` holds r.len() rows of n_per_row floats and `o`
                // exactly r.len() rows of `ty` (row_bytes above), which is
                // what ggml_quantize_chunk reads and writes with start 0; the
                // type was checked to need no importance matrix.
                unsafe {
                    crate::sys::ggml_quantize_chunk(
                        ty.0,
                        src.as_ptr(),
                        o.as_mut_ptr().cast(),
                        0,
                        r.len() as i64,
                        n_per_row as i64,
                        std::ptr::null(),
                    )
                }
            });
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const DENSE24: MixInfo = MixInfo {
        n_layer: 24,
        n_expert: 0,
        has_output: true,
    };

    #[test]
    fn type_choice_follows_llama_cpp() {
        let q = Some(Target::Type(GgmlType::Q4_K));
        let c = |name: &str, ne: &[u64], src, t| choose_type(name, ne, src, t, &DENSE24);
        assert_eq!(
            c("blk.0.attn_q.weight", &[576, 576], GgmlType::F16, q),
            GgmlType::Q5_0
        );
        assert_eq!(
            c("blk.0.ffn_down.weight", &[1536, 576], GgmlType::F16, q),
            GgmlType::Q4_K
        );
        assert_eq!(
            c("blk.0.attn_norm.weight", &[576], GgmlType::F16, q),
            GgmlType::F32
        );
        assert_eq!(
            c("blk.0.attn_q.bias", &[576], GgmlType::BF16, q),
            GgmlType::F32
        );
        assert_eq!(
            c("output.weight", &[576, 100], GgmlType::Q6_K, None),
            GgmlType::Q6_K
        );
        assert_eq!(fallback(GgmlType::Q8_0, 48), GgmlType::F16);
        assert_eq!(fallback(GgmlType::Q6_K, 96), GgmlType::Q8_0);
        assert_eq!(parse_type("Q4_K").ok(), Some(GgmlType::Q4_K));
        assert!(matches!(
            parse_type("q4_k_m"),
            Err(ConvertError::UnknownType(_))
        ));
        assert_eq!(parse_target("Q4_K_M").ok(), Some(Target::Q4KM));
        assert_eq!(
            parse_target("q8_0").ok(),
            Some(Target::Type(GgmlType::Q8_0))
        );
    }

    #[test]
    fn q4_k_m_mix_picks_more_bits_where_llama_cpp_does() {
        // 24 layers: the first and last three, and every third between
        let more: Vec<i64> = (0..24).filter(|&i| use_more_bits(i, 24)).collect();
        assert_eq!(more, [0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23]);
        let t = Some(Target::Q4KM);
        let c = |name: &str, m: &MixInfo| choose_type(name, &[1024, 1024], GgmlType::F32, t, m);
        assert_eq!(c("blk.5.ffn_down.weight", &DENSE24), GgmlType::Q6_K);
        assert_eq!(c("blk.6.ffn_down_exps.weight", &DENSE24), GgmlType::Q4_K);
        assert_eq!(c("blk.20.attn_v.weight", &DENSE24), GgmlType::Q6_K);
        assert_eq!(c("blk.19.attn_v.weight", &DENSE24), GgmlType::Q4_K);
        assert_eq!(c("blk.0.ffn_gate.weight", &DENSE24), GgmlType::Q4_K);
        assert_eq!(c("output.weight", &DENSE24), GgmlType::Q6_K);
        assert_eq!(c("token_embd.weight", &DENSE24), GgmlType::Q4_K);
        let tied = MixInfo {
            has_output: false,
            ..DENSE24
        };
        assert_eq!(c("token_embd.weight", &tied), GgmlType::Q6_K);
        let mixtral = MixInfo {
            n_expert: 8,
            ..DENSE24
        };
        assert_eq!(c("blk.7.attn_v.weight", &mixtral), GgmlType::Q8_0);
        assert_eq!(c("blk.7.attn_k.weight", &mixtral), GgmlType::Q8_0);
        assert_eq!(c("blk.7.attn_output.weight", &mixtral), GgmlType::Q5_K);
        // rows that are no whole number of q6_K blocks fall back to q8_0
        assert_eq!(
            choose_type("output.weight", &[576, 100], GgmlType::F32, t, &DENSE24),
            GgmlType::Q8_0
        );
        assert_eq!(Target::Q4KM.file_type(), Some(15));
    }

    #[test]
    fn round_trip_through_ggml() {
        let n = 256;
        // bell-shaped values (sum of uniforms), like trained weights
        let mut x = 12345u64;
        let mut uni = || {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 40) as f32 / (1u64 << 24) as f32 - 0.5
        };
        let src: Vec<f32> = (0..8 * n).map(|_| uni() + uni() + uni() + uni()).collect();
        let rms = |v: &[f32]| (v.iter().map(|x| x * x).sum::<f32>() / v.len() as f32).sqrt();
        // (type, bound on the relative RMS error)
        for (ty, bound) in [
            (GgmlType::F32, 0.0),
            (GgmlType::F16, 1e-3),
            (GgmlType::BF16, 5e-3),
            (GgmlType::Q8_0, 1e-2),
            (GgmlType::Q6_K, 3e-2),
            (GgmlType::Q4_K, 0.1),
            (GgmlType::Q4_0, 0.15),
        ] {
            let mut q = Vec::new();
            from_f32(&src, ty, n, 3, &mut q).expect("quantize");
            assert_eq!(q.len() as u64, 8 * ty.row_bytes(n as u64).expect("row"));
            let mut back = Vec::new();
            to_f32(&q, ty, n, 2, &mut back).expect("dequantize");
            let diff: Vec<f32> = src.iter().zip(&back).map(|(a, b)| a - b).collect();
            let rel = rms(&diff) / rms(&src);
            assert!(rel <= bound, "{ty}: relative RMS error {rel} > {bound}");
        }
    }
}
