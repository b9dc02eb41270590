//! Writes a copy of a GGUF model keeping only its first N layers (a small,
//! real-vocabulary model for checks on machines the full file cannot reach).
//! N = vocab writes the metadata alone (tokenizer and hyperparameters), the
//! vocabulary source for synthetic models.
//!   cargo run --release --example truncate_layers -- IN OUT N|vocab
use std::path::PathBuf;
use strata::gguf::{GgufFile, GgufWriter, Value};

fn main() -> anyhow::Result<()> {
    let a: Vec<String> = std::env::args().collect();
    anyhow::ensure!(a.len() == 4, "usage: truncate_layers IN OUT N");
    let vocab_only = a[3] == "vocab";
    let (inp, out): (PathBuf, PathBuf) = (a[1].clone().into(), a[2].clone().into());
    let n: u32 = if vocab_only { 0 } else { a[3].parse()? };
    let f = GgufFile::open(&inp)?;
    let data = std::fs::read(&inp)?;
    let arch = f.get_str("general.architecture")?.to_string();
    let mut w = GgufWriter::new(f.alignment);
    for (k, v) in &f.metadata {
        if k == "general.alignment" {
            continue;
        }
        let v = if *k == format!("{arch}.block_count") && !vocab_only {
            Value::U32(n)
        } else {
            v.clone()
        };
        w.set(k, v);
    }
    for t in f.tensors.iter().filter(|_| !vocab_only) {
        if let Some(rest) = t.name.strip_prefix("blk.") {
            let layer: u32 = rest.split('.').next().unwrap_or("0").parse()?;
            if layer >= n {
                continue;
            }
        }
        let bytes = data[t.offset as usize..(t.offset + t.size) as usize].to_vec();
        w.add_tensor(&t.name, &t.ne, t.ty, bytes)?;
    }
    w.write_file(&out)?;
    Ok(())
}
