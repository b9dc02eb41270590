//! OpenAI function calling: `tools` and `tool_choice` read from a chat
//! request, the grammar a required call is sampled under, and an answer's
//! text turned into `tool_calls`.
//!
//! The model is told about the tools by its chat template (the `tools`
//! variable, as Hugging Face's `apply_chat_template` passes it); a template
//! that renders nothing of them is refused, since the model would not know
//! what it may call. The calls are read in the format the template teaches:
//! `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes,
//! Qwen2.5, Qwen3) where the template mentions the tag, else the bare JSON
//! object.
//!
//! - `tool_choice: "required"` or a named function: the answer is sampled
//!   under the grammar llama.cpp's JSON-schema converter makes of the calls
//!   allowed (the name as a constant, the arguments by the function's
//!   `parameters` schema), in the template's format; so the arguments
//!   always validate. One call per answer.
//! - `"auto"` (the default with tools): the model answers freely; the
//!   calls it writes in the template's tag format become `tool_calls`, the
//!   rest stays content; an answer that is nothing but one call's JSON is
//!   that call (small models drop the tags). Only templates with the tag
//!   format take it.
//! - `"none"`: the tools are shown to the template, no call is read.
//!
//! `parallel_tool_calls: false` keeps an answer to its first call (the
//! others stay in the content); a required call is one call either way.

use super::request::ApiError;
use serde_json::{json, Value};
use std::sync::Arc;

/// The grammar rule a required call starts at (the converter's own rules
/// are kept as they are beside it).
pub const ROOT: &str = "tool-call";

/// Most tools one request may list.
pub const MAX_TOOLS: usize = 128;

/// One function the model may call.
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    pub name: String,
    pub description: Option<String>,
    /// A JSON schema of the arguments object.
    pub parameters: Value,
}

/// `tool_choice`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Choice {
    None,
    Auto,
    Required,
    Named(String),
}

/// The tools of one request.
#[derive(Clone, Debug, PartialEq)]
pub struct Tools {
    pub tools: Vec<Tool>,
    pub choice: Choice,
    /// Calls are written inside `<tool_call>` tags (else bare JSON).
    pub tagged: bool,
    /// For a required or named call: the grammar (GBNF, root [`ROOT`]).
    pub grammar: Option<Arc<str>>,
    /// More than one call per answer (`parallel_tool_calls`, default true).
    pub parallel: bool,
}

fn bad(m: impl Into<String>) -> ApiError {
    ApiError::bad(m)
}

/// OpenAI's rule for function names.
fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 64
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

fn parse_tool(v: &Value) -> Result<Tool, ApiError> {
    if v.get("type").and_then(Value::as_str) != Some("function") {
        return Err(bad("tools: each tool needs \"type\": \"function\""));
    }
    let f = v
        .get("function")
        .and_then(Value::as_object)
        .ok_or_else(|| bad("tools: a tool needs a \"function\" object"))?;
    let name = f
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("tools: a function needs a name"))?;
    if !valid_name(name) {
        return Err(bad(format!(
            "tools: function name {name:?} (1 to 64 of a-z, A-Z, 0-9, _ and -)"
        )));
    }
    let description = match f.get("description") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err(bad("tools: a function's description must be a string")),
    };
    let parameters = match f.get("parameters") {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(_) => {
            return Err(bad(
                "tools: a function's parameters must be a JSON schema object",
            ))
        }
    };
    Ok(Tool {
        name: name.to_string(),
        description,
        parameters,
    })
}

fn parse_choice(v: Option<&Value>, tools: &[Tool]) -> Result<Choice, ApiError> {
    let c = match v {
        None | Some(Value::Null) => Choice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => Choice::None,
            "auto" => Choice::Auto,
            "required" => Choice::Required,
            _ => {
                return Err(bad(format!(
                    "tool_choice {s:?} (\"none\", \"auto\", \"required\" or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}})"
                )))
            }
        },
        Some(o) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| o.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| {
                    bad("tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}")
                })?;
            if !tools.iter().any(|t| t.name == name) {
                return Err(bad(format!(
                    "tool_choice names {name:?}, which is not among the tools"
                )));
            }
            Choice::Named(name.to_string())
        }
    };
    Ok(c)
}

/// The schema of one call among `tools`: its name as a constant and its
/// arguments by the function's parameters.
fn call_schema(tools: &[&Tool]) -> Value {
    let one = |t: &Tool| {
        json!({
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": t.parameters},
            "required": ["name", "arguments"],
            "additionalProperties": false,
        })
    };
    match tools {
        [t] => one(t),
        _ => json!({"anyOf": tools.iter().map(|t| one(t)).collect::<Vec<_>>()}),
    }
}

/// The grammar of one call among `tools`, in the template's format.
fn call_grammar(tools: &[&Tool], tagged: bool) -> Result<String, ApiError> {
    let g = crate::llama::json_schema_to_gbnf(&call_schema(tools).to_string())
        .map_err(|e| bad(format!("tools: {e}")))?;
    let call = if tagged {
        r#""<tool_call>\n" root "\n</tool_call>""#
    } else {
        "root"
    };
    Ok(format!("{g}\n{ROOT} ::= {call}\n"))
}

/// Reads `tools` and `tool_choice` of a chat request (None: no tools, or
/// an empty list). `tagged`: the template writes calls in `<tool_call>`
/// tags.
pub fn parse(body: &Value, tagged: bool) -> Result<Option<Tools>, ApiError> {
    let list = match body.get("tools") {
        None | Some(Value::Null) => &Vec::new(),
        Some(Value::Array(a)) => a,
        Some(_) => return Err(bad("tools must be an array")),
    };
    if list.is_empty() {
        return match body.get("tool_choice") {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) if s == "none" || s == "auto" => Ok(None),
            Some(_) => Err(bad("tool_choice needs tools")),
        };
    }
    if list.len() > MAX_TOOLS {
        return Err(bad(format!(
            "tools: {} tools, at most {MAX_TOOLS}",
            list.len()
        )));
    }
    let tools = list.iter().map(parse_tool).collect::<Result<Vec<_>, _>>()?;
    if let Some(t) = tools
        .iter()
        .enumerate()
        .find(|(i, t)| tools[..*i].iter().any(|u| u.name == t.name))
    {
        return Err(bad(format!("tools: {:?} is listed twice", t.1.name)));
    }
    let choice = parse_choice(body.get("tool_choice"), &tools)?;
    let parallel = match body.get("parallel_tool_calls") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(bad("parallel_tool_calls must be true or false")),
    };
    let grammar =
        match &choice {
            Choice::None => None,
            Choice::Auto if tagged => None,
            Choice::Auto => return Err(bad(
                "tool_choice \"auto\": this model's chat template writes calls in no format this \
                 server reads (<tool_call> tags); use \"required\" or a named function",
            )),
            Choice::Required => Some(call_grammar(&tools.iter().collect::<Vec<_>>(), tagged)?),
            Choice::Named(n) => {
                let t: Vec<&Tool> = tools.iter().filter(|t| &t.name == n).collect();
                Some(call_grammar(&t, tagged)?)
            }
        };
    Ok(Some(Tools {
        tools,
        choice,
        tagged,
        grammar: grammar.map(Arc::from),
        parallel,
    }))
}

impl Tools {
    /// The `tools` variable of the chat template, as Hugging Face passes it.
    pub fn template_value(&self) -> Vec<Value> {
        self.tools
            .iter()
            .map(|t| {
                let mut f = json!({"name": t.name, "parameters": t.parameters});
                if let Some(d) = &t.description {
                    f["description"] = json!(d);
                }
                json!({"type": "function", "function": f})
            })
            .collect()
    }

    /// Call `v` (`{"name": ..., "arguments": {...}}`) as OpenAI's
    /// `tool_calls` entry number `index` (id `{id}-{index}`), if it names a
    /// listed function with an arguments object and the answer may still
    /// call (`parallel_tool_calls`).
    fn call(&self, v: &Value, id: &str, index: usize) -> Option<Value> {
        if !self.parallel && index > 0 {
            return None;
        }
        let name = v.get("name").and_then(Value::as_str)?;
        self.tools.iter().find(|t| t.name == name)?;
        let args = v.get("arguments").filter(|a| a.is_object())?;
        Some(json!({
            "id": format!("{id}-{index}"),
            "type": "function",
            "function": {"name": name, "arguments": args.to_string()},
        }))
    }

    /// Splits an answer into its content and its calls (OpenAI's
    /// `tool_calls` entries, ids `{id}-{i}`). A call that is not JSON of a
    /// listed function stays in the content.
    pub fn extract(&self, text: &str, id: &str) -> (Option<String>, Vec<Value>) {
        if self.choice == Choice::None {
            return (Some(text.to_string()), Vec::new());
        }
        let mut calls = Vec::new();
        let mut content = String::new();
        let mut push = |v: &Value| {
            let c = self.call(v, id, calls.len())?;
            calls.push(c);
            Some(())
        };
        // an answer that is one call as bare JSON is that call (small
        // models drop the tags their template asks for)
        let bare = |t: &str| serde_json::from_str::<Value>(t.trim()).ok();
        if self.tagged && text.contains(OPEN) {
            let mut rest = text;
            while let Some(a) = rest.find(OPEN) {
                let after = &rest[a + OPEN.len()..];
                let Some(b) = after.find(CLOSE) else {
                    break;
                };
                let parsed = serde_json::from_str::<Value>(after[..b].trim())
                    .ok()
                    .and_then(|v| push(&v));
                content.push_str(&rest[..a]);
                if parsed.is_none() {
                    content.push_str(&rest[a..a + OPEN.len() + b + CLOSE.len()]);
                }
                rest = &after[b + CLOSE.len()..];
            }
            content.push_str(rest);
        } else if bare(text).and_then(|v| push(&v)).is_none() {
            content.push_str(text);
        }
        let content = content.trim();
        let content = (!content.is_empty() || calls.is_empty()).then(|| content.to_string());
        (content, calls)
    }
}

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";

/// A piece of a streamed answer with tools.
#[derive(Clone, Debug, PartialEq)]
pub enum Piece {
    Content(String),
    /// A `tool_calls` entry and its index in the answer.
    Call(usize, Value),
}

/// Streams an answer that may call tools: content goes out as it forms;
/// what may still be a call is held until it is known: the text from a
/// `<tool_call>` tag to its closing tag, a trailing piece that may begin
/// the tag, and an answer that opens with `{` (it may be one bare call,
/// known at its end). Each call goes out when its tag closes. What goes out
/// adds up to what [`Tools::extract`] makes of the whole answer, but for
/// whitespace before a call and at the ends, which is dropped.
pub struct CallStream {
    tools: Arc<Tools>,
    id: String,
    held: String,
    /// Whitespace after the last content sent: it goes out with the next
    /// content, not before a call or at the end.
    ws: String,
    sent_content: bool,
    calls: usize,
    /// The answer opened with `{`: all of it is held to its end.
    bare: bool,
}

impl CallStream {
    pub fn new(tools: Arc<Tools>, id: &str) -> CallStream {
        CallStream {
            tools,
            id: id.to_string(),
            held: String::new(),
            ws: String::new(),
            sent_content: false,
            calls: 0,
            bare: false,
        }
    }

    /// Calls sent so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    /// The pieces that can go out once `text` is added to the answer.
    pub fn push(&mut self, text: &str) -> Vec<Piece> {
        let mut out = Vec::new();
        if self.tools.choice == Choice::None {
            if !text.is_empty() {
                out.push(Piece::Content(text.to_string()));
            }
            return out;
        }
        self.held.push_str(text);
        if !self.sent_content && self.calls == 0 && !self.bare {
            match self.held.trim_start().chars().next() {
                None => return out,
                Some('{') => self.bare = true,
                Some(_) => {}
            }
        }
        if self.bare {
            return out;
        }
        if !self.tools.tagged {
            let all = std::mem::take(&mut self.held);
            self.content(&all, &mut out);
            return out;
        }
        loop {
            let Some(a) = self.held.find(OPEN) else {
                // a trailing piece that may begin the tag stays held
                let keep = (1..OPEN.len())
                    .rev()
                    .find(|&k| self.held.ends_with(&OPEN[..k]))
                    .unwrap_or(0);
                let cut = self.held.len() - keep;
                let before: String = self.held.drain(..cut).collect();
                self.content(&before, &mut out);
                return out;
            };
            let before: String = self.held.drain(..a).collect();
            self.content(&before, &mut out);
            let Some(b) = self.held[OPEN.len()..].find(CLOSE) else {
                return out;
            };
            let end = OPEN.len() + b + CLOSE.len();
            let inner = &self.held[OPEN.len()..OPEN.len() + b];
            let call = serde_json::from_str::<Value>(inner.trim())
                .ok()
                .and_then(|v| self.tools.call(&v, &self.id, self.calls));
            let whole: String = self.held.drain(..end).collect();
            match call {
                Some(c) => {
                    self.ws.clear();
                    out.push(Piece::Call(self.calls, c));
                    self.calls += 1;
                }
                None => self.content(&whole, &mut out),
            }
        }
    }

    /// What is left at the end of the answer.
    pub fn finish(&mut self) -> Vec<Piece> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.held);
        if self.bare {
            let (content, calls) = self.tools.extract(&rest, &self.id);
            if let Some(c) = content.filter(|c| !c.is_empty()) {
                out.push(Piece::Content(c));
            }
            self.calls = calls.len();
            out.extend(
                calls
                    .into_iter()
                    .enumerate()
                    .map(|(i, c)| Piece::Call(i, c)),
            );
        } else {
            self.content(rest.trim_end(), &mut out);
        }
        out
    }

    /// Sends content `s`, whitespace at its end held back.
    fn content(&mut self, s: &str, out: &mut Vec<Piece>) {
        let s = if self.sent_content || self.calls > 0 {
            s
        } else {
            s.trim_start()
        };
        if s.is_empty() {
            return;
        }
        let mut all = std::mem::take(&mut self.ws);
        all.push_str(s);
        let n = all.trim_end().len();
        if n == 0 {
            self.ws = all;
            return;
        }
        self.ws = all[n..].to_string();
        all.truncate(n);
        self.sent_content = true;
        out.push(Piece::Content(all));
    }
}

/// An assistant message's `tool_calls` as a template reads them: the
/// arguments string parsed into its JSON object (templates print it with
/// `tojson`), ids and names kept.
pub fn message_calls(v: &Value) -> Result<Vec<Value>, ApiError> {
    let a = v
        .as_array()
        .ok_or_else(|| bad("messages: tool_calls must be an array"))?;
    a.iter()
        .map(|c| {
            let f = c
                .get("function")
                .ok_or_else(|| bad("messages: a tool call needs a \"function\""))?;
            let name = f
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| bad("messages: a tool call's function needs a name"))?;
            let arguments = match f.get("arguments") {
                Some(Value::String(s)) => serde_json::from_str::<Value>(s).map_err(|e| {
                    bad(format!(
                        "messages: the arguments of a call to {name:?} are not JSON: {e}"
                    ))
                })?,
                Some(o @ Value::Object(_)) => o.clone(),
                _ => {
                    return Err(bad(format!(
                        "messages: a call to {name:?} needs its arguments (a JSON string)"
                    )))
                }
            };
            let mut out =
                json!({"type": "function", "function": {"name": name, "arguments": arguments}});
            if let Some(id) = c.get("id").and_then(Value::as_str) {
                out["id"] = json!(id);
            }
            Ok(out)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(extra: Value) -> Value {
        let mut b = json!({"tools": [
            {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}}},
            {"type": "function", "function": {"name": "now"}},
        ]});
        if let (Some(b), Some(e)) = (b.as_object_mut(), extra.as_object()) {
            b.extend(e.clone());
        }
        b
    }

    /// Streams `text` in pieces of `n` bytes (at char boundaries).
    fn stream(t: &Tools, text: &str, n: usize) -> (String, Vec<Value>) {
        let mut s = CallStream::new(Arc::new(t.clone()), "c");
        let mut pieces = Vec::new();
        let mut at = 0;
        while at < text.len() {
            let mut end = (at + n).min(text.len());
            while !text.is_char_boundary(end) {
                end += 1;
            }
            pieces.extend(s.push(&text[at..end]));
            at = end;
        }
        pieces.extend(s.finish());
        let (mut content, mut calls) = (String::new(), Vec::new());
        for p in pieces {
            match p {
                Piece::Content(c) => content.push_str(&c),
                Piece::Call(i, c) => {
                    assert_eq!(i, calls.len());
                    calls.push(c)
                }
            }
        }
        (content, calls)
    }

    #[test]
    fn streamed_calls_add_up_to_the_extracted_answer() {
        let call = r#"<tool_call>
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}
</tool_call>"#;
        let now = r#"<tool_call>{"name": "now", "arguments": {}}</tool_call>"#;
        let answers = [
            "It is sunny, I think.".to_string(),
            format!("Let me look. {call}"),
            format!("{call}\n{now}"),
            format!("  Two: {call} and {now} done"),
            // not a listed function: stays content
            r#"<tool_call>{"name": "nope", "arguments": {}}</tool_call> ok"#.to_string(),
            // an unclosed tag stays content
            "a <tool_call> b".to_string(),
            // a bare call, and JSON that is no call
            r#"{"name": "now", "arguments": {}}"#.to_string(),
            r#"{"answer": 42}"#.to_string(),
            "<tool_ca is not a tag".to_string(),
        ];
        for parallel in [true, false] {
            let mut t = parse(&body(json!({})), true).unwrap().unwrap();
            t.parallel = parallel;
            for a in &answers {
                let (content, calls) = t.extract(a, "c");
                for n in [1, 3, 7, 1000] {
                    let (sc, scalls) = stream(&t, a, n);
                    assert_eq!(scalls, calls, "{a:?} in pieces of {n}");
                    let norm = |s: &str| s.split_whitespace().collect::<Vec<_>>().join(" ");
                    assert_eq!(
                        norm(&sc),
                        norm(content.as_deref().unwrap_or("")),
                        "{a:?} in pieces of {n}"
                    );
                }
            }
        }
        // content goes out before the call closes, and a call as soon as it does
        let t = parse(&body(json!({})), true).unwrap().unwrap();
        let mut s = CallStream::new(Arc::new(t), "c");
        assert_eq!(s.push("Checking"), vec![Piece::Content("Checking".into())]);
        assert_eq!(s.push(" now <tool"), vec![Piece::Content(" now".into())]);
        assert!(s
            .push(r#"_call>{"name": "now", "arguments": {}}"#)
            .is_empty());
        let p = s.push("</tool_call>");
        assert!(
            matches!(&p[..], [Piece::Call(0, c)] if c["id"] == "c-0"),
            "{p:?}"
        );
        assert_eq!(s.calls(), 1);
    }

    #[test]
    fn choices_and_grammars() {
        let t = parse(&body(json!({})), true).unwrap().unwrap();
        assert_eq!(t.choice, Choice::Auto);
        assert!(t.grammar.is_none());
        let e = parse(&body(json!({})), false).unwrap_err();
        assert!(e.message.contains("\"auto\""), "{}", e.message);
        let t = parse(&body(json!({"tool_choice": "required"})), true)
            .unwrap()
            .unwrap();
        let g = t.grammar.unwrap();
        assert!(
            g.contains(&format!("{ROOT} ::= \"<tool_call>\\n\" root")),
            "{g}"
        );
        assert!(g.contains("get_weather") && g.contains("now"), "{g}");
        let named = json!({"tool_choice": {"type": "function", "function": {"name": "now"}}});
        let t = parse(&body(named), false).unwrap().unwrap();
        assert_eq!(t.choice, Choice::Named("now".into()));
        let g = t.grammar.unwrap();
        assert!(
            g.contains(&format!("{ROOT} ::= root")) && !g.contains("get_weather"),
            "{g}"
        );
        assert_eq!(parse(&json!({"tools": []}), true).unwrap(), None);
        for (b, says) in [
            (
                json!({"tool_choice": {"type": "function", "function": {"name": "nope"}}}),
                "not among",
            ),
            (
                json!({"tool_choice": "sometimes"}),
                "tool_choice \"sometimes\"",
            ),
        ] {
            let e = parse(&body(b), true).unwrap_err();
            assert!(e.message.contains(says), "{}", e.message);
        }
        for (b, says) in [
            (
                json!({"tools": [{"type": "function", "function": {"name": "a b"}}]}),
                "function name",
            ),
            (
                json!({"tools": [{"type": "web"}]}),
                "\"type\": \"function\"",
            ),
            (json!({"tools": {}}), "must be an array"),
            (
                json!({"tools": [{"type": "function", "function": {"name": "a"}},
                                 {"type": "function", "function": {"name": "a"}}]}),
                "listed twice",
            ),
        ] {
            let e = parse(&b, true).unwrap_err();
            assert!(e.message.contains(says), "{}", e.message);
        }
    }

    #[test]
    fn answers_become_tool_calls() {
        let t = parse(&body(json!({})), true).unwrap().unwrap();
        let (c, calls) = t.extract(
            "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"c\"}}\n</tool_call>",
            "call-1",
        );
        assert_eq!(c.as_deref(), Some("Let me check."));
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0]["id"], "call-1-0");
        assert_eq!(calls[0]["function"]["name"], "get_weather");
        let args: Value =
            serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
        assert_eq!(args, json!({"city": "Paris", "unit": "c"}));
        // parallel_tool_calls false: the first call only, the rest content
        let two = "<tool_call>{\"name\": \"now\", \"arguments\": {}}</tool_call>\n<tool_call>{\"name\": \"now\", \"arguments\": {\"tz\": \"UTC\"}}</tool_call>";
        assert_eq!(t.extract(two, "x").1.len(), 2);
        let one = Tools {
            parallel: false,
            ..t.clone()
        };
        let (c, calls) = one.extract(two, "x");
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0]["function"]["arguments"], "{}");
        assert!(c.is_some_and(|c| c.contains("UTC")));
        let e = parse(&body(json!({"parallel_tool_calls": 1})), true).unwrap_err();
        assert!(e.message.contains("parallel_tool_calls"), "{}", e.message);
        // an unknown function or broken JSON stays content
        let text = "<tool_call>{\"name\": \"rm\", \"arguments\": {}}</tool_call> <tool_call>{oops</tool_call>";
        let (c, calls) = t.extract(text, "x");
        assert!(calls.is_empty());
        assert_eq!(c.as_deref(), Some(text));
        // plain text: no calls; a bare call without its tags is a call
        assert_eq!(t.extract("Hello", "x"), (Some("Hello".into()), vec![]));
        let (c, calls) = t.extract(" {\"name\": \"now\", \"arguments\": {}}\n", "x");
        assert_eq!((c, calls.len()), (None, 1));
        // bare JSON where the template has no tags
        let bare = Tools { tagged: false, ..t };
        let (c, calls) = bare.extract("{\"name\": \"now\", \"arguments\": {}}", "y");
        assert_eq!((c, calls.len()), (None, 1));
    }

    #[test]
    fn message_calls_parse_their_arguments() {
        let v = json!([{"id": "c1", "type": "function", "function": {"name": "now", "arguments": "{\"tz\": \"UTC\"}"}}]);
        let m = message_calls(&v).unwrap();
        assert_eq!(m[0]["function"]["arguments"], json!({"tz": "UTC"}));
        assert_eq!(m[0]["id"], "c1");
        let e =
            message_calls(&json!([{"function": {"name": "now", "arguments": "{"}}])).unwrap_err();
        assert!(e.message.contains("not JSON"), "{}", e.message);
    }
}
