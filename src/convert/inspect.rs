//! `strata-convert inspect`: a readable report of a GGUF file: header,
//! metadata (long arrays and strings abbreviated), the tensor table, the
//! per-group extents, and whether the file is strata-aligned, with the
//! command that fixes it when it is not.

use super::check::check_layout;
use super::error::Result;
use crate::gguf::{Array, Value};
use crate::model::{ModelSpec, Role};
use std::fmt::Write as _;
use std::path::Path;

fn short_str(s: &str, max: usize) -> String {
    let mut out: String = s
        .chars()
        .take(max)
        .collect::<String>()
        .escape_debug()
        .to_string();
    if s.chars().count() > max {
        let _ = write!(out, "... ({} chars)", s.chars().count());
    }
    format!("\"{out}\"")
}

fn show_array(a: &Array) -> String {
    const N: usize = 4;
    let items: Vec<String> = match a {
        Array::Str(v) => v.iter().take(N).map(|s| short_str(s, 24)).collect(),
        Array::U8(v) => v.iter().take(N).map(|x| x.to_string()).collect(),
        Array::I8(v) => v.iter().take(N).map(|x| x.to_string()).collect(),
        Array::U16(v) => v.iter().take(N).map(|x| x.to_string()).collect(),
        Array::I16(v) => v.iter().take(N).map(|x| x.to_string()).collect(),
        Array::U32(v) => v.iter().take(N).map(|x| x.to_string()).collect(),
        Array::I32(v) => v.iter().take(N).map(|x| x.to_string()).collect(),
        Array::F32(v) => v.iter().take(N).map(|x| x.to_string()).collect(),
        Array::Bool(v) => v.iter().take(N).map(|x| x.to_string()).collect(),
        Array::U64(v) => v.iter().take(N).map(|x| x.to_string()).collect(),
        Array::I64(v) => v.iter().take(N).map(|x| x.to_string()).collect(),
        Array::F64(v) => v.iter().take(N).map(|x| x.to_string()).collect(),
        Array::Nested(v) => v.iter().take(N).map(show_array).collect(),
    };
    let more = if a.len() > N { ", ..." } else { "" };
    format!("x{} [{}{more}]", a.len(), items.join(", "))
}

fn show_value(v: &Value) -> String {
    match v {
        Value::Str(s) => short_str(s, 72),
        Value::Array(a) => show_array(a),
        Value::U8(x) => format!("{x}"),
        Value::I8(x) => format!("{x}"),
        Value::U16(x) => format!("{x}"),
        Value::I16(x) => format!("{x}"),
        Value::U32(x) => format!("{x}"),
        Value::I32(x) => format!("{x}"),
        Value::F32(x) => format!("{x}"),
        Value::Bool(x) => format!("{x}"),
        Value::U64(x) => format!("{x}"),
        Value::I64(x) => format!("{x}"),
        Value::F64(x) => format!("{x}"),
    }
}

fn mib(b: u64) -> String {
    format!("{:.2} MiB", b as f64 / (1u64 << 20) as f64)
}

/// The report for the GGUF file at `path`; fails only if it is not a valid
/// GGUF. (A GGUF strata cannot run is reported, not refused.)
pub fn inspect(path: &Path) -> Result<String> {
    let f = super::input::open_gguf(path)?;
    let mut o = String::new();
    let _ = writeln!(o, "file: {}", path.display());
    let _ = writeln!(
        o,
        "GGUF v{}, {} bytes ({}), alignment {}, data section at {}, {} metadata keys, {} tensors",
        f.version,
        f.file_size,
        mib(f.file_size),
        f.alignment,
        f.data_offset,
        f.metadata.len(),
        f.tensors.len()
    );
    let _ = writeln!(o, "\nmetadata:");
    for (k, v) in &f.metadata {
        let _ = writeln!(o, "  {k:<44} {:<10} {}", v.type_name(), show_value(v));
    }
    let _ = writeln!(o, "\ntensors (file order):");
    let _ = writeln!(
        o,
        "  {:>4}  {:<32} {:<7} {:<22} {:>14} {:>14}",
        "#", "name", "type", "shape", "offset", "bytes"
    );
    for (i, t) in f.tensors.iter().enumerate() {
        let shape = format!("{:?}", t.ne);
        let _ = writeln!(
            o,
            "  {i:>4}  {:<32} {:<7} {shape:<22} {:>14} {:>14}",
            t.name,
            t.ty.name(),
            t.offset,
            t.size
        );
    }
    let spec = match ModelSpec::from_gguf(&f) {
        Ok(s) => s,
        Err(e) => {
            let _ = writeln!(o, "\nnot a model strata runs: {e}");
            let _ = writeln!(o, "strata-aligned: no");
            return Ok(o);
        }
    };
    let r = check_layout(&f, &spec);
    let _ = writeln!(
        o,
        "\nmodel: {} ({}), {} layers, {} groups, layer weights {}",
        spec.name,
        spec.arch.name(),
        spec.hp.n_layer,
        spec.groups.len(),
        mib(spec.layer_bytes())
    );
    let hp = &spec.hp;
    if hp.is_moe() {
        // one expert's bytes: its slice of each stacked matrix
        let ffn = spec.group(0, crate::model::GroupKind::Ffn);
        let exps = [Role::GateExps, Role::UpExps, Role::DownExps];
        let per_expert: u64 = exps
            .iter()
            .filter_map(|&r| ffn.weight(r))
            .map(|w| w.size / hp.n_expert as u64)
            .sum();
        let router = ffn.weight(Role::GateInp).map_or(0, |w| w.size);
        let _ = writeln!(
            o,
            "experts: {} per layer, {} used per token, expert width {} (layer 0: {} per expert, router {}; a token reads {} of the layer's {} expert bytes)",
            hp.n_expert,
            hp.n_expert_used,
            hp.n_ff_exp,
            mib(per_expert),
            mib(router),
            mib(per_expert * hp.n_expert_used as u64),
            mib(per_expert * hp.n_expert as u64),
        );
    }
    let _ = writeln!(
        o,
        "groups (tensors as found; extent = declared by strata.*):"
    );
    let _ = writeln!(
        o,
        "  {:>5} {:<5} {:>3} {:>14} {:>12} {:>12}  {:<26} state",
        "layer", "group", "n", "offset", "span", "bytes", "extent"
    );
    for (i, g) in r.groups.iter().enumerate() {
        let ext = r.declared.as_ref().and_then(|d| d.get(i));
        let ext = ext.map_or("-".to_string(), |e| format!("[{}, +{})", e.offset, e.size));
        let state = match (
            g.contiguous,
            g.offset % super::layout::STRATA_ALIGNMENT == 0,
        ) {
            (true, true) => "contiguous, aligned",
            (true, false) => "contiguous, unaligned",
            (false, _) => "scattered",
        };
        let _ = writeln!(
            o,
            "  {:>5} {:<5} {:>3} {:>14} {:>12} {:>12}  {ext:<26} {state}",
            g.layer,
            g.kind.name(),
            g.n_tensors,
            g.offset,
            g.span,
            g.bytes
        );
    }
    if r.is_aligned() {
        let _ = writeln!(
            o,
            "\nstrata-aligned: yes (layout {}, one read per group)",
            super::layout::LAYOUT_NAME
        );
    } else {
        let _ = writeln!(o, "\nstrata-aligned: no");
        for p in r.problems.iter().take(8) {
            let _ = writeln!(o, "  - {p}");
        }
        if r.problems.len() > 8 {
            let _ = writeln!(o, "  - ... and {} more", r.problems.len() - 8);
        }
        let out = aligned_name(path);
        let _ = writeln!(
            o,
            "fix: strata-convert gguf {} {}",
            shell_quote(&path.display().to_string()),
            shell_quote(&out)
        );
    }
    Ok(o)
}

/// `model.gguf` -> `model.strata.gguf` beside it.
fn aligned_name(path: &Path) -> String {
    let stem = path
        .file_stem()
        .map_or("model".into(), |s| s.to_string_lossy().into_owned());
    path.with_file_name(format!("{stem}.strata.gguf"))
        .display()
        .to_string()
}

fn shell_quote(s: &str) -> String {
    if s.chars()
        .all(|c| c.is_ascii_alphanumeric() || "/._-+=:,".contains(c))
    {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}
