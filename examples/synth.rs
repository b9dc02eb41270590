//! Writes a synthetic model (see `strata::synth`).
//!   synth PRESET TYPE VOCAB_GGUF OUT [LAYERS]     TYPE: q4_0 | f16 | f32
use anyhow::{bail, Context};
use std::time::Instant;
use strata::gguf::GgmlType;

fn main() -> anyhow::Result<()> {
    let a: Vec<String> = std::env::args().collect();
    if a.len() < 5 {
        bail!("usage: synth PRESET(tiny|llama3-8b|llama3-70b|qwen2.5-7b) TYPE(q4_0|f16|f32) VOCAB_GGUF OUT [LAYERS]");
    }
    let p = strata::synth::preset(&a[1]).with_context(|| {
        format!(
            "unknown preset {} (known: {:?})",
            a[1],
            strata::synth::PRESETS
        )
    })?;
    let ty = match a[2].as_str() {
        "q4_0" => GgmlType::Q4_0,
        "f16" => GgmlType::F16,
        "f32" => GgmlType::F32,
        t => bail!("unsupported type {t}"),
    };
    let layers = a.get(5).map(|s| s.parse()).transpose()?;
    let threads = std::thread::available_parallelism().map_or(4, |n| n.get());
    let t0 = Instant::now();
    let bytes = strata::synth::write(&p, ty, layers, a[3].as_ref(), a[4].as_ref(), threads)?;
    let s = t0.elapsed().as_secs_f64();
    println!(
        "wrote {} ({:.2} GiB) in {s:.1} s, {:.2} GB/s",
        a[4],
        bytes as f64 / (1u64 << 30) as f64,
        bytes as f64 / s / 1e9
    );
    Ok(())
}
