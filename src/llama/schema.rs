//! llama.cpp's JSON-schema-to-grammar converter
//! (`common/json-schema-to-grammar.cpp`, built by ffi/build.rs from
//! vendor/llama-common.tar.xz): the GBNF grammar a `response_format`
//! `json_schema` answer is sampled under, through [`super::GrammarSampler`].

use super::grammar::GrammarError;
use crate::sys;
use std::ffi::{CStr, CString};

/// Most bytes of grammar a schema may turn into: libllama parses the
/// grammar for every answer.
pub const MAX_GRAMMAR_BYTES: usize = 256 << 10;

/// The largest count a schema may give (`minItems`, `maxLength`, ...): the
/// converter writes it as a repetition `x{m,n}`, which libllama's parser
/// expands into that many rules (`"minItems": 100000` would take
/// gigabytes).
pub const MAX_REPEAT: u64 = 1024;

/// The counts that become repetitions.
const COUNT_KEYS: [&str; 6] = [
    "minItems",
    "maxItems",
    "minLength",
    "maxLength",
    "minProperties",
    "maxProperties",
];

/// Refuses a count above [`MAX_REPEAT`] anywhere in `v`.
fn check_counts(v: &serde_json::Value) -> Result<(), GrammarError> {
    match v {
        serde_json::Value::Object(o) => {
            for (k, x) in o {
                if COUNT_KEYS.contains(&k.as_str())
                    && x.as_f64().is_some_and(|n| n > MAX_REPEAT as f64)
                {
                    return Err(GrammarError::Schema(format!(
                        "{k} {x} is above the {MAX_REPEAT} this server allows \
                         (a count becomes that many grammar rules)"
                    )));
                }
                check_counts(x)?;
            }
            Ok(())
        }
        serde_json::Value::Array(a) => a.iter().try_for_each(check_counts),
        _ => Ok(()),
    }
}

/// The GBNF grammar (root rule "root") whose texts are the JSON values
/// `schema` (a JSON schema, as text) accepts, as far as llama.cpp's
/// converter implements JSON schema; an error names what it refused.
pub fn json_schema_to_gbnf(schema: &str) -> Result<String, GrammarError> {
    let c = CString::new(schema).map_err(|_| GrammarError::Nul)?;
    let v: serde_json::Value =
        serde_json::from_str(schema).map_err(|e| GrammarError::Schema(format!("not JSON: {e}")))?;
    check_counts(&v)?;
    let mut out: *mut std::os::raw::c_char = std::ptr::null_mut();
    // SAFETY: `c` is NUL-terminated and alive for the call; the converter
    // catches every C++ exception and writes a malloc'ed string (or NULL)
    // to `out`, freed below with the matching function.
    let rc = unsafe { sys::strata_json_schema_to_grammar(c.as_ptr(), &mut out) };
    if out.is_null() {
        return Err(GrammarError::Schema("out of memory".into()));
    }
    // SAFETY: `out` is a NUL-terminated string the converter allocated.
    let text = unsafe { CStr::from_ptr(out) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: allocated by the converter, freed once, not used after.
    unsafe { sys::strata_json_schema_free(out) };
    if rc != 0 {
        return Err(GrammarError::Schema(text));
    }
    if text.len() > MAX_GRAMMAR_BYTES {
        return Err(GrammarError::Schema(format!(
            "the schema's grammar takes {} bytes, more than the {MAX_GRAMMAR_BYTES} allowed",
            text.len()
        )));
    }
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schemas_become_grammars_and_bad_ones_are_refused() {
        let g = json_schema_to_gbnf(
            r#"{"type":"object","properties":{"n":{"type":"integer"},"e":{"enum":["a","b"]}},"required":["n"]}"#,
        )
        .expect("grammar");
        assert!(g.contains("root ::="), "{g}");
        assert!(
            g.contains("\"\\\"a\\\"\""),
            "the enum's values are literals: {g}"
        );
        let e = json_schema_to_gbnf(r#"{"type":"objec"#).expect_err("not JSON");
        assert!(matches!(e, GrammarError::Schema(_)), "{e}");
        let e = json_schema_to_gbnf(
            r#"{"type":"object","properties":{"a":{"type":"array","minItems":100000}}}"#,
        )
        .expect_err("too big");
        assert!(e.to_string().contains("minItems 100000"), "{e}");
        // a schema the converter itself refuses (an unresolvable reference)
        let e = json_schema_to_gbnf(r##"{"$ref":"#/$defs/missing"}"##).expect_err("bad ref");
        assert!(matches!(e, GrammarError::Schema(_)), "{e}");
        assert!(matches!(
            json_schema_to_gbnf("{\0}"),
            Err(GrammarError::Nul)
        ));
    }
}
