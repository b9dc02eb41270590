//! The OpenAI wire format: requests parsed and checked into a [`Job`],
//! answers and stream chunks built as JSON.
//!
//! Defaults follow llama-server rather than OpenAI where they differ:
//! temperature 0.8, top-k 40, top-p 0.95, min-p 0.05, a random seed unless
//! one is given, and no token limit but the sequence's context unless
//! `max_tokens` is given. Fields strata does not use are ignored; fields it
//! uses are checked, and a bad one answers 400 naming it.

use super::chat::{ChatError, ChatTemplate, Message};
use crate::sample::SamplerConfig;
use serde::Deserialize;
use serde_json::{json, Value};

/// An error answer: HTTP status and message, sent as OpenAI's error body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
}

impl ApiError {
    pub fn bad(message: impl Into<String>) -> ApiError {
        ApiError {
            status: 400,
            message: message.into(),
        }
    }
    pub fn kind(&self) -> &'static str {
        match self.status {
            400 | 413 | 422 => "invalid_request_error",
            404 => "not_found_error",
            503 => "server_busy",
            _ => "server_error",
        }
    }
    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind(), "code": self.status}})
    }
}

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
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Prompt {
    /// Tokenized with the model's special tokens (BOS where it adds one).
    Text(String),
    Tokens(Vec<u32>),
}

/// Which endpoint a request came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completion,
}

/// A parsed request: the job, whether to stream, and the usage option.
#[derive(Clone, Debug)]
pub struct Parsed {
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
    /// Positions one sequence may hold.
    pub n_ctx_seq: usize,
    pub chat: &'a ChatTemplate,
}

fn field<T: for<'de> Deserialize<'de>>(v: &Value, what: &str) -> Result<T, ApiError> {
    T::deserialize(v).map_err(|e| ApiError::bad(format!("{what}: {e}")))
}

/// Parses and checks a request body.
pub fn parse(endpoint: Endpoint, body: &[u8], lim: &Limits, seed: u64) -> Result<Parsed, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad(format!("the request body is not valid JSON: {e}")))?;
    if !v.is_object() {
        return Err(ApiError::bad("the request body must be a JSON object"));
    }
    let c: Common = field(&v, "bad field")?;
    if let Some(m) = &c.model {
        if m != lim.model_id {
            return Err(ApiError {
                status: 404,
                message: format!(
                    "model {m:?} does not exist; this server serves {:?}",
                    lim.model_id
                ),
            });
        }
    }
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
                        role: m.role,
                        content,
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            let text = lim.chat.render(&msgs, true).map_err(|e| match e {
                ChatError::NoTemplate => ApiError {
                    status: 400,
                    message: e.to_string(),
                },
                e => ApiError::bad(e.to_string()),
            })?;
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
        prompt,
        job: Job {
            max_tokens,
            stop,
            sampler,
            ignore_eos: c.ignore_eos,
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
    /// The whole answer of a non-streaming request.
    pub fn full(&self, text: &str, finish: &str, usage: Usage) -> Value {
        let choice = match self.endpoint {
            Endpoint::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": null,
                "finish_reason": finish,
            }),
            Endpoint::Completion => json!({
                "index": 0, "text": text, "logprobs": null, "finish_reason": finish,
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
    /// the role), or the end with its finish reason.
    pub fn chunk(&self, text: Option<&str>, first: bool, finish: Option<&str>) -> Value {
        let choice = match self.endpoint {
            Endpoint::Chat => {
                let mut delta = serde_json::Map::new();
                if first {
                    delta.insert("role".into(), json!("assistant"));
                }
                if let Some(t) = text {
                    delta.insert("content".into(), json!(t));
                }
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
            }
            Endpoint::Completion => {
                json!({"index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish})
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
            n_ctx_seq: 100,
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
        let f = a.full("hi", "stop", u);
        assert_eq!(f["choices"][0]["message"]["content"], "hi");
        assert_eq!(f["usage"]["total_tokens"], 5);
        let c = a.chunk(Some("h"), true, None);
        assert_eq!(c["choices"][0]["delta"]["role"], "assistant");
        assert!(c["choices"][0]["finish_reason"].is_null());
        assert_eq!(a.usage_chunk(u)["choices"].as_array().unwrap().len(), 0);
    }
}
