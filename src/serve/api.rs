//! The OpenAI wire format: requests parsed and checked into a [`Job`],
//! answers and stream chunks built as JSON.
//!
//! Defaults follow llama-server rather than OpenAI where they differ:
//! temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, a random seed unless
//! one is given, and no token limit but the sequence's context unless
//! `max_tokens` is given. Fields strata does not implement are refused by
//! name ([`check_fields`]); fields it uses are checked, and a bad one
//! answers 400 naming it. `logprobs`, `top_logprobs` and `logit_bias` are
//! read and answered in [`super::logprobs`]. `response_format`
//! `{"type": "json_object"}` constrains the answer with llama.cpp's JSON
//! grammar ([`crate::llama::JSON_GBNF`], applied in the worker);
//! `{"type": "json_schema", "json_schema": {"schema": ...}}` (and
//! llama-server's `{"type": "json_object", "schema": ...}`) with the
//! grammar llama.cpp's converter makes of the schema
//! ([`crate::llama::json_schema_to_gbnf`], run here, off the engine's
//! thread).

use super::chat::{ChatTemplate, Message};
use super::logprobs;
pub use super::request::{ApiError, Endpoint};
use super::tools::{self, Tools};
use crate::sample::SamplerConfig;
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;

/// What the engine loop needs to know about a request.
#[derive(Clone, Debug)]
pub struct Job {
    /// None: until the end of generation or of the sequence's context.
    pub max_tokens: Option<usize>,
    pub stop: Vec<String>,
    pub sampler: SamplerConfig,
    /// Go on past end-of-generation tokens (llama-server's `ignore_eos`;
    /// benchmarks).
    pub ignore_eos: bool,
    /// Some(k): report each generated token's logprob and its row's `k`
    /// most likely tokens (`logprobs`); None: compute nothing of the sort.
    pub logprobs: Option<usize>,
    /// What the answer must be (`response_format`).
    pub format: ResponseFormat,
    /// The functions the model may call (`tools`, `tool_choice`).
    pub tools: Option<Arc<Tools>>,
}

impl Job {
    /// The grammar the answer is sampled under and its root rule, if any:
    /// a required tool call's, else `response_format`'s.
    pub fn grammar(&self) -> Option<(&str, &str)> {
        match self.tools.as_ref().and_then(|t| t.grammar.as_deref()) {
            Some(g) => Some((g, tools::ROOT)),
            None => self.format.grammar().map(|g| (g, "root")),
        }
    }
}

/// OpenAI's `response_format`, as far as this server implements it.
/// `max_tokens` can still cut a constrained answer (finish_reason
/// "length"), as at OpenAI.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum ResponseFormat {
    /// Any text (`{"type": "text"}`, or no field).
    #[default]
    Text,
    /// A JSON object (`{"type": "json_object"}`): sampled under llama.cpp's
    /// JSON grammar.
    JsonObject,
    /// A JSON value a schema accepts: sampled under the grammar (GBNF, root
    /// rule "root") llama.cpp's converter made of the schema.
    JsonSchema { grammar: Arc<str> },
}

impl ResponseFormat {
    /// The grammar the answer is sampled under, if any.
    pub fn grammar(&self) -> Option<&str> {
        match self {
            ResponseFormat::Text => None,
            ResponseFormat::JsonObject => Some(crate::llama::JSON_GBNF),
            ResponseFormat::JsonSchema { grammar } => Some(grammar),
        }
    }
}

/// The grammar of a schema given in a request.
fn schema_format(schema: &Value) -> Result<ResponseFormat, ApiError> {
    if !schema.is_object() && !schema.is_boolean() {
        return Err(ApiError::bad(
            "response_format's schema must be a JSON schema (an object)",
        ));
    }
    let grammar = crate::llama::json_schema_to_gbnf(&schema.to_string())
        .map_err(|e| ApiError::bad(format!("response_format: {e}")))?;
    Ok(ResponseFormat::JsonSchema {
        grammar: grammar.into(),
    })
}

/// Reads `response_format`: absent, null or `{"type": "text"}` asks for
/// text, `{"type": "json_object"}` for JSON, `{"type": "json_schema",
/// "json_schema": {"name": ..., "schema": {...}}}` for what the schema
/// accepts (llama-server's `{"type": "json_object", "schema": {...}}` too);
/// anything else is refused.
fn parse_response_format(v: Option<&Value>) -> Result<ResponseFormat, ApiError> {
    let o = match v {
        None | Some(Value::Null) => return Ok(ResponseFormat::Text),
        Some(Value::Object(o)) => o,
        Some(_) => {
            return Err(ApiError::bad(
                "response_format must be an object such as {\"type\": \"json_object\"}",
            ))
        }
    };
    match o.get("type").and_then(Value::as_str) {
        Some("text") => Ok(ResponseFormat::Text),
        Some("json_object") => match o.get("schema") {
            None | Some(Value::Null) => Ok(ResponseFormat::JsonObject),
            Some(schema) => schema_format(schema),
        },
        Some("json_schema") => match o.get("json_schema").and_then(|j| j.get("schema")) {
            Some(schema) => schema_format(schema),
            None => Err(ApiError::bad(
                "response_format json_schema needs json_schema.schema (the JSON schema)",
            )),
        },
        Some(t) => Err(ApiError::bad(format!(
            "response_format type {t:?}: this server takes \"text\", \"json_object\" or \"json_schema\""
        ))),
        None => Err(ApiError::bad(
            "response_format needs a type: \"text\", \"json_object\" or \"json_schema\"",
        )),
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Prompt {
    /// Tokenized with the model's special tokens (BOS where it adds one).
    Text(String),
    Tokens(Vec<u32>),
}

/// A parsed request: the job, whether to stream, and the usage option.
#[derive(Clone, Debug)]
pub struct Parsed {
    /// The model's name as the request gave it (the served id or an
    /// alias), for the answer.
    pub model: String,
    /// The prompt as the request gave it: tokenized before the engine
    /// loop sees it (http.rs), never on the engine's thread.
    pub prompt: Prompt,
    pub job: Job,
    pub stream: bool,
    pub include_usage: bool,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize, Default)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// Fields shared by both endpoints.
#[derive(Deserialize, Default)]
struct Common {
    model: Option<String>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    max_tokens: Option<i64>,
    max_completion_tokens: Option<i64>,
    n: Option<i64>,
    stop: Option<OneOrMany>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<i32>,
    min_p: Option<f32>,
    seed: Option<i64>,
    repeat_penalty: Option<f32>,
    repeat_last_n: Option<i64>,
    frequency_penalty: Option<f32>,
    presence_penalty: Option<f32>,
    #[serde(default)]
    ignore_eos: bool,
}

#[derive(Deserialize)]
struct ChatBody {
    messages: Vec<ChatMessage>,
}

#[derive(Deserialize)]
struct ChatMessage {
    role: String,
    #[serde(default)]
    content: Option<Content>,
    /// Every other field (tool_calls, tool_call_id, name): refused unless
    /// null, never dropped.
    #[serde(flatten)]
    other: serde_json::Map<String, Value>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize)]
struct Part {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
}

#[derive(Deserialize)]
struct CompletionBody {
    prompt: PromptIn,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum PromptIn {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
}

/// What a request is checked against.
pub struct Limits<'a> {
    pub model_id: &'a str,
    /// Other names requests may give for it (`--alias`).
    pub aliases: &'a [String],
    /// Positions one sequence may hold.
    pub n_ctx_seq: usize,
    /// Token ids of the model's vocabulary (`logit_bias` keys).
    pub n_vocab: usize,
    pub chat: &'a ChatTemplate,
}

fn field<T: for<'de> Deserialize<'de>>(v: &Value, what: &str) -> Result<T, ApiError> {
    T::deserialize(v).map_err(|e| ApiError::bad(format!("{what}: {e}")))
}

/// The request fields this server implements, per endpoint; every other
/// field is refused by name (a field accepted and ignored would give
/// agent frameworks, structured-output libraries and evaluation harnesses
/// wrong results without a word), except at its "off" value (below) or
/// when it carries no instruction at all (`user`, `metadata`).
const COMMON_FIELDS: [&str; 22] = [
    "model",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "n",
    "stop",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "repeat_penalty",
    "repeat_last_n",
    "frequency_penalty",
    "presence_penalty",
    "ignore_eos",
    "logit_bias",
    "response_format",
    // identify the caller, instruct nothing
    "user",
    "metadata",
    "store",
];

/// Whether `v` is the value that asks for nothing (the field's default):
/// such a field may be sent and is not refused.
fn is_off(name: &str, v: &Value) -> bool {
    match (name, v) {
        (_, Value::Null) => true,
        ("logprobs" | "echo" | "parallel_tool_calls", Value::Bool(false)) => true,
        ("top_logprobs", Value::Number(n)) => n.as_u64() == Some(0),
        ("best_of", Value::Number(n)) => n.as_u64() == Some(1),
        ("tools" | "functions", Value::Array(a)) => a.is_empty(),
        ("logit_bias", Value::Object(o)) => o.is_empty(),
        ("suffix", Value::String(s)) => s.is_empty(),
        ("tool_choice", Value::String(s)) => s == "none",
        ("modalities", Value::Array(a)) => a.iter().all(|m| m == "text"),
        _ => false,
    }
}

/// Refuses every field this server does not implement (see
/// [`COMMON_FIELDS`]), naming it.
fn check_fields(endpoint: Endpoint, v: &Value) -> Result<(), ApiError> {
    let own: &[&str] = match endpoint {
        Endpoint::Chat => &[
            "messages",
            "logprobs",
            "top_logprobs",
            "tools",
            "tool_choice",
            "parallel_tool_calls",
        ],
        Endpoint::Completion => &["prompt", "logprobs"],
    };
    let Some(obj) = v.as_object() else {
        return Ok(());
    };
    for (name, value) in obj {
        if own.contains(&name.as_str())
            || COMMON_FIELDS.contains(&name.as_str())
            || is_off(name, value)
        {
            continue;
        }
        let what = match name.as_str() {
            "top_logprobs" => {
                "is a field of /v1/chat/completions \
                 (here logprobs: N asks for N alternatives per token)"
            }
            "tools"
            | "tool_choice"
            | "echo"
            | "suffix"
            | "best_of"
            | "functions"
            | "function_call"
            | "parallel_tool_calls"
            | "modalities"
            | "audio"
            | "prediction"
            | "reasoning_effort"
            | "web_search_options" => "is not supported by this server",
            _ => "is not a field of this endpoint",
        };
        return Err(ApiError::bad(format!("{name} {what}")));
    }
    Ok(())
}

/// Chat roles a message may have: OpenAI's (its old `function` role
/// aside).
const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// Parses and checks a request body.
pub fn parse(endpoint: Endpoint, body: &[u8], lim: &Limits, seed: u64) -> Result<Parsed, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad(format!("the request body is not valid JSON: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::bad("the request body must be a JSON object"));
    }
    check_fields(endpoint, &v)?;
    let c: Common = field(&v, "bad field")?;
    if let Some(m) = &c.model {
        if m != lim.model_id && !lim.aliases.contains(m) {
            let mut names = vec![format!("{:?}", lim.model_id)];
            names.extend(lim.aliases.iter().map(|a| format!("{a:?}")));
            return Err(ApiError {
                status: 404,
                message: format!(
                    "model {m:?} does not exist; this server serves {} (--alias adds names)",
                    names.join(", ")
                ),
            });
        }
    }
    // answers name the model as the request did
    let model = c.model.clone().unwrap_or_else(|| lim.model_id.to_string());
    if c.n.is_some_and(|n| n != 1) {
        return Err(ApiError::bad("n: only 1 choice per request is supported"));
    }
    let max_tokens = match c.max_completion_tokens.or(c.max_tokens) {
        None => None,
        Some(n) if n < 1 => {
            return Err(ApiError::bad(format!(
                "max_tokens must be at least 1, got {n}"
            )))
        }
        Some(n) if n as u64 >= lim.n_ctx_seq as u64 => {
            return Err(ApiError::bad(format!(
                "max_tokens {n} does not fit the context of {} tokens per sequence",
                lim.n_ctx_seq
            )))
        }
        Some(n) => Some(n as usize),
    };
    let stop = match c.stop {
        None => Vec::new(),
        Some(OneOrMany::One(s)) => vec![s],
        Some(OneOrMany::Many(v)) if v.len() > 16 => {
            return Err(ApiError::bad("stop: at most 16 strings"))
        }
        Some(OneOrMany::Many(v)) => v,
    };
    if stop.iter().any(String::is_empty) {
        return Err(ApiError::bad("stop: an empty string would stop at once"));
    }
    if let Some(t) = c.temperature {
        if !(0.0..=2.0).contains(&t) {
            return Err(ApiError::bad(format!(
                "temperature must be in [0, 2] (0: greedy), got {t}"
            )));
        }
    }
    let d = SamplerConfig::default();
    let repeat_last_n = match c.repeat_last_n {
        None => d.repeat_last_n,
        Some(n) if (0..=1 << 20).contains(&n) => n as usize,
        Some(n) => {
            return Err(ApiError::bad(format!(
                "repeat_last_n must be in 0..=1048576, got {n}"
            )))
        }
    };
    let sampler = SamplerConfig {
        temperature: c.temperature.unwrap_or(d.temperature),
        top_k: c.top_k.unwrap_or(d.top_k),
        top_p: c.top_p.unwrap_or(d.top_p),
        min_p: c.min_p.unwrap_or(d.min_p),
        repeat_penalty: c.repeat_penalty.unwrap_or(d.repeat_penalty),
        repeat_last_n,
        frequency_penalty: c.frequency_penalty.unwrap_or(0.0),
        presence_penalty: c.presence_penalty.unwrap_or(0.0),
        // a negative seed (llama.cpp's -1) asks for a random one
        seed: c.seed.filter(|&s| s >= 0).map_or(seed, |s| s as u64),
        logit_bias: Vec::new(),
    };
    let logprobs = logprobs::parse_request(endpoint, &v)?;
    let format = parse_response_format(v.get("response_format"))?;
    if format.grammar().is_some() && c.ignore_eos {
        return Err(ApiError::bad(
            "ignore_eos cannot be combined with response_format json_object or json_schema: \
             the grammar ends the answer with an end-of-generation token",
        ));
    }
    let job_tools = match endpoint {
        Endpoint::Chat => tools::parse(&v, lim.chat.tagged_tool_calls())?,
        Endpoint::Completion => None,
    };
    if let Some(t) = &job_tools {
        if format != ResponseFormat::Text {
            return Err(ApiError::bad(
                "tools cannot be combined with a response_format other than text",
            ));
        }
        if c.stream && logprobs.is_some() {
            return Err(ApiError::bad(
                "logprobs cannot be combined with tools in a stream: a streamed answer with \
                 tools holds back text that may be a call (ask without stream for both)",
            ));
        }
        if t.grammar.is_some() && c.ignore_eos {
            return Err(ApiError::bad(
                "ignore_eos cannot be combined with a required tool call: \
                 the grammar ends the answer with an end-of-generation token",
            ));
        }
    }
    let logit_bias = logprobs::parse_logit_bias(v.get("logit_bias"), lim.n_vocab)?;
    let sampler = SamplerConfig {
        logit_bias,
        ..sampler
    };
    sampler
        .validate()
        .map_err(|e| ApiError::bad(e.to_string()))?;
    let prompt = match endpoint {
        Endpoint::Chat => {
            let b: ChatBody = field(&v, "messages")?;
            if b.messages.is_empty() {
                return Err(ApiError::bad("messages must not be empty"));
            }
            // every message renders at least one token: more messages than
            // the context holds cannot fit, and are not rendered
            if b.messages.len() > lim.n_ctx_seq {
                return Err(ApiError::bad(format!(
                    "messages: {} messages cannot fit a context of {} tokens",
                    b.messages.len(),
                    lim.n_ctx_seq
                )));
            }
            let msgs = b
                .messages
                .into_iter()
                .map(|m| {
                    if !ROLES.contains(&m.role.as_str()) {
                        return Err(ApiError::bad(format!(
                            "messages: role {:?} (this server takes {})",
                            m.role,
                            ROLES.join(", ")
                        )));
                    }
                    let mut tool_calls = Vec::new();
                    let mut tool_call_id = None;
                    let mut name = None;
                    for (k, v) in m.other.iter().filter(|(_, v)| !v.is_null()) {
                        match (k.as_str(), m.role.as_str(), v) {
                            ("tool_calls", "assistant", _) => tool_calls = tools::message_calls(v)?,
                            ("tool_call_id", "tool", Value::String(s)) => {
                                tool_call_id = Some(s.clone())
                            }
                            ("name", _, Value::String(s)) => name = Some(s.clone()),
                            _ => {
                                return Err(ApiError::bad(format!(
                                    "messages: the field {k:?} of a {} message is not supported by this server",
                                    m.role
                                )))
                            }
                        }
                    }
                    // OpenAI's newer name for the system role; templates know "system"
                    let role = if m.role == "developer" {
                        "system".to_string()
                    } else {
                        m.role
                    };
                    let content = match m.content {
                        None => String::new(),
                        Some(Content::Text(t)) => t,
                        Some(Content::Parts(p)) => {
                            if let Some(o) = p.iter().find(|p| p.kind != "text") {
                                return Err(ApiError::bad(format!(
                                    "content part of type {:?}: only text parts are supported",
                                    o.kind
                                )));
                            }
                            p.into_iter()
                                .filter_map(|p| p.text)
                                .collect::<Vec<_>>()
                                .join("")
                        }
                    };
                    Ok(Message {
                        role,
                        content,
                        tool_calls,
                        tool_call_id,
                        name,
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            let listed = job_tools
                .as_ref()
                .map(|t| t.template_value())
                .unwrap_or_default();
            let render = |tools: &[Value]| {
                lim.chat
                    .render_with_tools(&msgs, true, tools)
                    .map_err(|e| ApiError::bad(e.to_string()))
            };
            let text = render(&listed)?;
            if !listed.is_empty() && text == render(&[])? {
                return Err(ApiError::bad(
                    "tools: this model's chat template renders no tools, so the model would not \
                     know them (--chat-template can give one that does)",
                ));
            }
            // calls the template would drop from the prompt are refused
            if msgs.iter().any(|m| !m.tool_calls.is_empty()) {
                let stripped: Vec<Message> = msgs
                    .iter()
                    .map(|m| Message {
                        tool_calls: Vec::new(),
                        ..m.clone()
                    })
                    .collect();
                let without = lim
                    .chat
                    .render_with_tools(&stripped, true, &listed)
                    .map_err(|e| ApiError::bad(e.to_string()))?;
                if without == text {
                    return Err(ApiError::bad(
                        "messages: this model's chat template renders no tool_calls, so the \
                         model would not see its own calls (--chat-template can give one that does)",
                    ));
                }
            }
            Prompt::Text(text)
        }
        Endpoint::Completion => {
            let b: CompletionBody = field(&v, "prompt")?;
            match b.prompt {
                PromptIn::Text(t) => Prompt::Text(t),
                PromptIn::Tokens(t) => Prompt::Tokens(t),
                PromptIn::Texts(mut t) if t.len() == 1 => Prompt::Text(t.remove(0)),
                PromptIn::Texts(_) => {
                    return Err(ApiError::bad(
                        "prompt: only one prompt per request is supported",
                    ))
                }
            }
        }
    };
    if matches!(&prompt, Prompt::Text(t) if t.is_empty())
        || matches!(&prompt, Prompt::Tokens(t) if t.is_empty())
    {
        return Err(ApiError::bad("the prompt is empty"));
    }
    Ok(Parsed {
        model,
        prompt,
        job: Job {
            max_tokens,
            stop,
            sampler,
            ignore_eos: c.ignore_eos,
            logprobs,
            format,
            tools: job_tools.map(Arc::new),
        },
        stream: c.stream,
        include_usage: c.stream_options.is_some_and(|o| o.include_usage),
    })
}

/// Token counts of an answer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens taken from the prefix cache.
    pub cached_tokens: usize,
}

impl Usage {
    pub fn json(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }
}

/// Identity of one answer.
pub struct Answer<'a> {
    pub endpoint: Endpoint,
    pub id: &'a str,
    pub created: u64,
    pub model: &'a str,
}

impl Answer<'_> {
    /// The whole answer of a non-streaming request. `logprobs`: its
    /// `logprobs` object ([`logprobs::answer_json`]), null when not asked.
    pub fn full(&self, text: &str, finish: &str, usage: Usage, logprobs: Value) -> Value {
        self.full_with_calls(Some(text), &[], finish, usage, logprobs)
    }

    /// [`Self::full`] of a chat answer that may call tools: `content` null
    /// where the answer is only calls; `calls` as `tool_calls`.
    pub fn full_with_calls(
        &self,
        content: Option<&str>,
        calls: &[Value],
        finish: &str,
        usage: Usage,
        logprobs: Value,
    ) -> Value {
        let text = content.unwrap_or("");
        let choice = match self.endpoint {
            Endpoint::Chat => {
                let mut message = json!({"role": "assistant", "content": content});
                if !calls.is_empty() {
                    message["tool_calls"] = json!(calls);
                }
                json!({
                    "index": 0,
                    "message": message,
                    "logprobs": logprobs,
                    "finish_reason": finish,
                })
            }
            Endpoint::Completion => json!({
                "index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish,
            }),
        };
        json!({
            "id": self.id,
            "object": match self.endpoint { Endpoint::Chat => "chat.completion", Endpoint::Completion => "text_completion" },
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage.json(),
        })
    }

    /// One stream chunk: a piece of text (the first chat chunk also names
    /// the role), or the end with its finish reason. `logprobs`: the
    /// entries of the piece's tokens, null when not asked.
    pub fn chunk(
        &self,
        text: Option<&str>,
        first: bool,
        finish: Option<&str>,
        logprobs: Value,
    ) -> Value {
        let choice = match self.endpoint {
            Endpoint::Chat => {
                let mut delta = serde_json::Map::new();
                if first {
                    delta.insert("role".into(), json!("assistant"));
                }
                if let Some(t) = text {
                    delta.insert("content".into(), json!(t));
                }
                json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
            }
            Endpoint::Completion => {
                json!({"index": 0, "text": text.unwrap_or(""), "logprobs": logprobs, "finish_reason": finish})
            }
        };
        json!({
            "id": self.id,
            "object": match self.endpoint { Endpoint::Chat => "chat.completion.chunk", Endpoint::Completion => "text_completion" },
            "created": self.created,
            "model": self.model,
            "choices": [choice],
        })
    }

    /// A chunk of a streamed chat answer carrying call `index` (OpenAI's
    /// `tool_calls` delta: the whole call, its arguments in one piece).
    pub fn call_chunk(&self, call: &Value, index: usize, first: bool) -> Value {
        let mut c = call.clone();
        c["index"] = json!(index);
        let mut delta = json!({"tool_calls": [c]});
        if first {
            delta["role"] = json!("assistant");
        }
        json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": Value::Null, "finish_reason": Value::Null}],
        })
    }

    /// The usage chunk (`stream_options.include_usage`): no choices.
    pub fn usage_chunk(&self, usage: Usage) -> Value {
        json!({
            "id": self.id,
            "object": match self.endpoint { Endpoint::Chat => "chat.completion.chunk", Endpoint::Completion => "text_completion" },
            "created": self.created,
            "model": self.model,
            "choices": [],
            "usage": usage.json(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lim(chat: &ChatTemplate) -> Limits<'_> {
        Limits {
            model_id: "m",
            aliases: &[],
            n_ctx_seq: 100,
            n_vocab: 1000,
            chat,
        }
    }

    fn chatml() -> ChatTemplate {
        ChatTemplate::from_jinja(
            "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}",
            "",
            "",
        )
    }

    #[test]
    fn chat_requests_render_and_take_defaults() {
        let t = chatml();
        let p = parse(
            Endpoint::Chat,
            br#"{"model":"m","messages":[{"role":"system","content":"be brief"},{"role":"user","content":[{"type":"text","text":"hi"}]}],"stream":true,"stop":"\n\n","max_tokens":5,"seed":3}"#,
            &lim(&t),
            99,
        )
        .unwrap();
        assert_eq!(
            p.prompt,
            Prompt::Text("<|system|>be brief\n<|user|>hi\n<|assistant|>".into())
        );
        assert!(p.stream && !p.include_usage);
        assert_eq!(p.job.max_tokens, Some(5));
        assert_eq!(p.job.stop, vec!["\n\n".to_string()]);
        assert_eq!(p.job.sampler.seed, 3);
        assert_eq!(p.job.sampler.temperature, 0.8);
        let p = parse(
            Endpoint::Completion,
            br#"{"prompt":"x","seed":-1}"#,
            &lim(&t),
            77,
        )
        .unwrap();
        assert_eq!(
            p.job.sampler.seed, 77,
            "a negative seed asks for a random one"
        );
        let p = parse(Endpoint::Completion, br#"{"prompt":[1,2,3]}"#, &lim(&t), 99).unwrap();
        assert_eq!(p.prompt, Prompt::Tokens(vec![1, 2, 3]));
        assert_eq!((p.job.sampler.seed, p.job.max_tokens), (99, None));
    }

    /// Fields this server does not implement are refused by name, except
    /// at their off value; roles outside OpenAI's, message fields of tool
    /// calls, empty stop strings and temperatures out of range too.
    /// `logprobs`, `top_logprobs` (chat) and `logit_bias` pass.
    #[test]
    fn unsupported_fields_roles_and_ranges_are_refused() {
        let t = chatml();
        let msg = |body: &str| match parse(Endpoint::Chat, body.as_bytes(), &lim(&t), 0) {
            Ok(_) => String::new(),
            Err(e) => e.message,
        };
        let m = r#""messages":[{"role":"user","content":"hi"}]"#;
        for (field, says) in [
            (
                r#""response_format":{"type":"json_schema","json_schema":{"name":"x"}}"#,
                "json_schema needs json_schema.schema",
            ),
            (
                r#""response_format":{"type":"json_schema","json_schema":{"schema":{"type":"array","maxItems":5000}}}"#,
                "maxItems 5000 is above",
            ),
            (
                r#""response_format":{"type":"json_schema","json_schema":{"schema":"x"}}"#,
                "must be a JSON schema",
            ),
            (
                r#""response_format":{"type":"json_schema","json_schema":{"schema":{"type":"object"}}},"ignore_eos":true"#,
                "ignore_eos cannot be combined",
            ),
            (
                r#""response_format":{"type":"xml"}"#,
                "response_format type \"xml\"",
            ),
            (r#""response_format":"json""#, "must be an object"),
            (r#""response_format":{}"#, "needs a type"),
            (
                r#""response_format":{"type":"json_object"},"ignore_eos":true"#,
                "ignore_eos cannot be combined",
            ),
            (
                r#""tools":[{"type":"function","function":{"name":"f"}}]"#,
                "writes calls in no format this server reads",
            ),
            (
                r#""tools":[{"type":"function","function":{"name":"f"}}],"tool_choice":"required""#,
                "renders no tools",
            ),
            (r#""tool_choice":"required""#, "tool_choice needs tools"),
            (r#""frobnicate":1"#, "frobnicate is not a field"),
            (r#""stop":["a",""]"#, "empty string"),
            (r#""temperature":-1"#, "temperature must be in [0, 2]"),
        ] {
            let e = msg(&format!("{{{m},{field}}}"));
            assert!(e.contains(says), "{field}: {e:?}");
        }
        // off values and pure metadata pass
        for field in [
            r#""logprobs":false"#,
            r#""top_logprobs":0"#,
            r#""response_format":{"type":"text"}"#,
            r#""response_format":{"type":"json_object"}"#,
            r#""response_format":null"#,
            r#""tools":[]"#,
            r#""tool_choice":"none""#,
            r#""logit_bias":{}"#,
            r#""logprobs":true"#,
            r#""logprobs":true,"top_logprobs":3"#,
            r#""logit_bias":{"42":-100}"#,
            r#""user":"u-1""#,
            r#""metadata":{"k":"v"}"#,
        ] {
            assert_eq!(msg(&format!("{{{m},{field}}}")), "", "{field}");
        }
        let e = msg(r#"{"messages":[{"role":"hacker","content":"x"}]}"#);
        assert!(e.contains("role \"hacker\""), "{e}");
        assert_eq!(
            msg(r#"{"messages":[{"role":"tool","content":"42","tool_call_id":"c1"}]}"#),
            ""
        );
        let e = msg(r#"{"messages":[{"role":"user","content":"x","tool_call_id":"c1"}]}"#);
        assert!(e.contains("\"tool_call_id\" of a user message"), "{e}");
        let e =
            msg(r#"{"messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"c1"}]}]}"#);
        assert!(e.contains("a tool call needs a \"function\""), "{e}");
        // a template that would drop the calls from the prompt is refused
        let e = msg(
            r#"{"messages":[{"role":"user","content":"x"},{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}}]}]}"#,
        );
        assert!(e.contains("renders no tool_calls"), "{e}");
        // developer is the system role
        let p = parse(
            Endpoint::Chat,
            br#"{"messages":[{"role":"developer","content":"be brief"},{"role":"user","content":"hi"}]}"#,
            &lim(&t),
            0,
        )
        .unwrap();
        assert_eq!(
            p.prompt,
            Prompt::Text("<|system|>be brief\n<|user|>hi\n<|assistant|>".into())
        );
        let e = match parse(
            Endpoint::Completion,
            br#"{"prompt":"x","echo":true,"suffix":"y"}"#,
            &lim(&t),
            0,
        ) {
            Err(e) => e.message,
            Ok(_) => String::new(),
        };
        assert!(e.contains("is not supported"), "{e}");
        for (body, says) in [
            (r#"{"prompt":"x","echo":true}"#, "echo is not supported"),
            (r#"{"prompt":"x","suffix":"y"}"#, "suffix is not supported"),
            (
                r#"{"prompt":"x","top_logprobs":2}"#,
                "top_logprobs is a field of /v1/chat/completions",
            ),
        ] {
            let e = match parse(Endpoint::Completion, body.as_bytes(), &lim(&t), 0) {
                Err(e) => e.message,
                Ok(_) => String::new(),
            };
            assert!(e.contains(says), "{body}: {e}");
        }
    }

    /// `response_format` reaches the job on both endpoints: json_object
    /// as JSON, a schema (OpenAI's and llama-server's spelling) as its
    /// grammar, text and no field as text.
    #[test]
    fn response_format_reaches_the_job() {
        let t = chatml();
        let m = r#""messages":[{"role":"user","content":"hi"}]"#;
        for (ep, head) in [
            (Endpoint::Chat, m),
            (Endpoint::Completion, r#""prompt":"x""#),
        ] {
            let f = |extra: &str| {
                parse(ep, format!("{{{head}{extra}}}").as_bytes(), &lim(&t), 0)
                    .unwrap()
                    .job
                    .format
            };
            assert_eq!(f(""), ResponseFormat::Text);
            assert_eq!(
                f(r#","response_format":{"type":"text"}"#),
                ResponseFormat::Text
            );
            assert_eq!(
                f(r#","response_format":{"type":"json_object"},"stream":true"#),
                ResponseFormat::JsonObject
            );
            let schema =
                r#"{"type":"object","properties":{"n":{"type":"integer"}},"required":["n"]}"#;
            let want = crate::llama::json_schema_to_gbnf(schema).expect("grammar");
            for rf in [
                format!(
                    r#","response_format":{{"type":"json_schema","json_schema":{{"name":"x","strict":true,"schema":{schema}}}}}"#
                ),
                format!(r#","response_format":{{"type":"json_object","schema":{schema}}}"#),
            ] {
                let got = f(&rf);
                assert_eq!(got.grammar(), Some(want.as_str()), "{rf}");
            }
            let e = parse(
                ep,
                format!(r#"{{{head},"response_format":{{"type":"json_schema"}}}}"#).as_bytes(),
                &lim(&t),
                0,
            )
            .unwrap_err();
            assert_eq!(e.status, 400);
            assert!(
                e.message.contains("needs json_schema.schema"),
                "{}",
                e.message
            );
        }
    }

    /// `logprobs` reaches the job as the count of alternatives, only when
    /// asked; `logit_bias` reaches the sampler, its keys checked against
    /// the vocabulary.
    #[test]
    fn logprobs_and_logit_bias_reach_the_job() {
        let t = chatml();
        let m = r#""messages":[{"role":"user","content":"hi"}]"#;
        let chat = |f: &str| {
            parse(
                Endpoint::Chat,
                format!("{{{m}{f}}}").as_bytes(),
                &lim(&t),
                0,
            )
        };
        let p = chat("").unwrap();
        assert_eq!(p.job.logprobs, None);
        assert!(p.job.sampler.logit_bias.is_empty());
        let p =
            chat(r#","logprobs":true,"top_logprobs":5,"logit_bias":{"999":100,"0":-1}"#).unwrap();
        assert_eq!(p.job.logprobs, Some(5));
        assert_eq!(p.job.sampler.logit_bias, vec![(0, -1.0), (999, 100.0)]);
        assert_eq!(chat(r#","logprobs":true"#).unwrap().job.logprobs, Some(0));
        let p = parse(
            Endpoint::Completion,
            br#"{"prompt":"x","logprobs":3,"logit_bias":{"5":-100}}"#,
            &lim(&t),
            0,
        )
        .unwrap();
        assert_eq!(p.job.logprobs, Some(3));
        assert_eq!(p.job.sampler.logit_bias, vec![(5, -100.0)]);
        for (f, says) in [
            (
                r#","logit_bias":{"1000":1}"#,
                "key \"1000\" is not a token id",
            ),
            (r#","logit_bias":{"x7":1}"#, "key \"x7\""),
            (r#","logit_bias":{"7":100.5}"#, "bias of \"7\""),
            (r#","logit_bias":[1]"#, "logit_bias must be an object"),
            (r#","top_logprobs":2"#, "needs logprobs: true"),
            (r#","logprobs":true,"top_logprobs":50"#, "0..=20"),
            (r#","logprobs":1"#, "true or false"),
        ] {
            let e = chat(f).unwrap_err();
            assert_eq!(e.status, 400);
            assert!(e.message.contains(says), "{f}: {}", e.message);
        }
        let e = parse(
            Endpoint::Completion,
            br#"{"prompt":"x","logprobs":true}"#,
            &lim(&t),
            0,
        )
        .unwrap_err();
        assert!(
            e.message.contains("logprobs must be an integer"),
            "{}",
            e.message
        );
    }

    /// Request bodies, structured and not: every field name this server
    /// knows or refuses, and random ones, each with a value of a random
    /// JSON type (nested too), as chat or completion requests, and the raw
    /// bytes cut anywhere. `parse` answers each with a request or a 4xx
    /// naming the problem, never a panic, and quickly.
    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        fn value() -> impl Strategy<Value = Value> {
            let leaf = prop_oneof![
                Just(Value::Null),
                any::<bool>().prop_map(Value::Bool),
                any::<i64>().prop_map(|n| json!(n)),
                (-1e6f64..1e6).prop_map(|x| json!(x)),
                "[a-z<|>_ ]{0,12}".prop_map(Value::String),
            ];
            leaf.prop_recursive(3, 24, 4, |inner| {
                prop_oneof![
                    proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                    proptest::collection::vec(("[a-z_]{1,8}", inner), 0..4)
                        .prop_map(|kv| Value::Object(kv.into_iter().collect())),
                ]
            })
        }

        fn field_name() -> impl Strategy<Value = String> {
            let known: Vec<&'static str> = COMMON_FIELDS
                .iter()
                .copied()
                .chain([
                    "messages",
                    "prompt",
                    "logprobs",
                    "top_logprobs",
                    "response_format",
                    "tools",
                    "tool_choice",
                    "logit_bias",
                    "echo",
                    "suffix",
                    "best_of",
                ])
                .collect();
            prop_oneof![
                proptest::sample::select(known).prop_map(String::from),
                "[a-z_]{1,10}",
            ]
        }

        fn message() -> impl Strategy<Value = Value> {
            (
                proptest::sample::select(vec![
                    "system",
                    "developer",
                    "user",
                    "assistant",
                    "tool",
                    "x",
                ]),
                value(),
                proptest::option::of(("[a-z_]{1,8}", value())),
            )
                .prop_map(|(role, content, extra)| {
                    let mut m = json!({"role": role, "content": content});
                    if let Some((k, v)) = extra {
                        m[k] = v;
                    }
                    m
                })
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(400))]

            #[test]
            fn parse_never_panics(
                fields in proptest::collection::vec((field_name(), value()), 0..8),
                msgs in proptest::collection::vec(message(), 0..4),
                chat in any::<bool>(),
                cut in any::<proptest::sample::Index>(),
            ) {
                let t = chatml();
                let mut body = serde_json::Map::new();
                for (k, v) in fields {
                    body.insert(k, v);
                }
                let endpoint = if chat {
                    body.insert("messages".into(), Value::Array(msgs));
                    Endpoint::Chat
                } else {
                    Endpoint::Completion
                };
                let bytes = serde_json::to_vec(&Value::Object(body)).unwrap();
                let t0 = std::time::Instant::now();
                for b in [&bytes[..], &bytes[..cut.index(bytes.len() + 1)]] {
                    if let Err(e) = parse(endpoint, b, &lim(&t), 1) {
                        prop_assert!((400..500).contains(&e.status), "{}: {}", e.status, e.message);
                        prop_assert!(!e.message.is_empty());
                    }
                }
                prop_assert!(t0.elapsed() < std::time::Duration::from_secs(1));
            }
        }
    }

    #[test]
    fn bad_requests_name_the_problem() {
        let t = chatml();
        let bad = |ep, body: &[u8]| parse(ep, body, &lim(&t), 0).unwrap_err();
        assert!(bad(Endpoint::Chat, b"{\"messages\": [")
            .message
            .contains("not valid JSON"));
        assert!(bad(Endpoint::Chat, b"[1]").message.contains("JSON object"));
        assert!(bad(Endpoint::Chat, br#"{"messages":[]}"#)
            .message
            .contains("must not be empty"));
        assert_eq!(
            bad(
                Endpoint::Chat,
                br#"{"model":"gpt-9","messages":[{"role":"user","content":"x"}]}"#
            )
            .status,
            404
        );
        assert!(
            bad(Endpoint::Completion, br#"{"prompt":"x","max_tokens":-1}"#)
                .message
                .contains("at least 1")
        );
        assert!(bad(
            Endpoint::Completion,
            br#"{"prompt":"x","max_tokens":1000000000000}"#
        )
        .message
        .contains("does not fit"));
        assert!(bad(
            Endpoint::Completion,
            br#"{"prompt":"x","temperature":"hot"}"#
        )
        .message
        .contains("bad field"));
        assert!(bad(Endpoint::Completion, br#"{"prompt":"x","top_p":0}"#)
            .message
            .contains("top_p"));
        assert!(bad(Endpoint::Completion, br#"{"prompt":""}"#)
            .message
            .contains("empty"));
        assert!(bad(Endpoint::Completion, br#"{"prompt":"x","n":2}"#)
            .message
            .contains("n:"));
        assert!(bad(Endpoint::Completion, b"{\"prompt\":\"\xff\"}")
            .message
            .contains("not valid JSON"));
        let none = ChatTemplate::from_jinja("{{ raise_exception('no') }}", "", "");
        let e = parse(
            Endpoint::Chat,
            br#"{"messages":[{"role":"user","content":"x"}]}"#,
            &lim(&none),
            0,
        )
        .unwrap_err();
        assert_eq!(e.status, 400);
    }

    #[test]
    fn answers_have_openai_shapes() {
        let a = Answer {
            endpoint: Endpoint::Chat,
            id: "chatcmpl-1",
            created: 5,
            model: "m",
        };
        let u = Usage {
            prompt_tokens: 3,
            completion_tokens: 2,
            cached_tokens: 1,
        };
        let f = a.full("hi", "stop", u, Value::Null);
        assert_eq!(f["choices"][0]["message"]["content"], "hi");
        assert_eq!(f["usage"]["total_tokens"], 5);
        assert!(f["choices"][0]["logprobs"].is_null());
        let lp = json!({"content": []});
        let f = a.full("hi", "stop", u, lp.clone());
        assert_eq!(f["choices"][0]["logprobs"], lp);
        let c = a.chunk(Some("h"), true, None, Value::Null);
        assert_eq!(c["choices"][0]["delta"]["role"], "assistant");
        assert!(c["choices"][0]["finish_reason"].is_null());
        assert!(c["choices"][0]["logprobs"].is_null());
        let c = a.chunk(Some("h"), false, None, lp.clone());
        assert_eq!(c["choices"][0]["logprobs"], lp);
        let t = Answer {
            endpoint: Endpoint::Completion,
            ..a
        };
        let c = t.chunk(Some("h"), false, None, lp.clone());
        assert_eq!(c["choices"][0]["logprobs"], lp);
        assert_eq!(c["choices"][0]["text"], "h");
        assert_eq!(a.usage_chunk(u)["choices"].as_array().unwrap().len(), 0);
    }
}
