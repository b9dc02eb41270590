//! Chat templates: a conversation rendered to prompt text the way Hugging
//! Face's `apply_chat_template` does it.
//!
//! The GGUF's `tokenizer.chat_template` is a Jinja template. It is rendered
//! with minijinja in Hugging Face's environment: `trim_blocks` and
//! `lstrip_blocks` on, Python string methods (`.strip()`, `.startswith()`,
//! ...), `raise_exception`, `strftime_now`, `tojson`, and the variables
//! `messages` (with `tool_calls`, `tool_call_id` and `name` where a
//! message has them), `tools` (when a request lists some),
//! `add_generation_prompt`, `bos_token` and `eos_token`. A
//! template minijinja cannot compile or render falls back to libllama's
//! built-in renderer, which recognises the common templates by their text.
//! `--chat-template` overrides the GGUF's: a file holding a Jinja template,
//! Jinja source itself, or the name of a libllama built-in ("chatml",
//! "llama3", ...).

use crate::gguf::GgufFile;
use crate::llama::builtin_chat_template;
use std::ffi::CString;
use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    #[error("reading the chat template of the model: {0}")]
    Model(String),
    #[error("the model has no chat template (tokenizer.chat_template); pass --chat-template")]
    NoTemplate,
    #[error("chat template {0:?} is neither a file, Jinja source, nor a template libllama knows")]
    UnknownTemplate(String),
    #[error("reading chat template {path}: {err}")]
    Read { path: String, err: std::io::Error },
    #[error("the chat template failed: {0}")]
    Render(String),
    #[error("a message contains a NUL character")]
    Nul,
}

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Message {
    pub role: String,
    pub content: String,
    /// An assistant's calls, as templates read them: `{"id", "type":
    /// "function", "function": {"name", "arguments": {...}}}`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<serde_json::Value>,
    /// A tool result's call.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Message {
        Message {
            role: role.to_string(),
            content: content.to_string(),
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
        }
    }

    fn is_plain(&self) -> bool {
        self.tool_calls.is_empty() && self.tool_call_id.is_none() && self.name.is_none()
    }
}

#[derive(Clone, Debug)]
enum Renderer {
    /// Jinja source, rendered by minijinja; libllama's renderer for the
    /// same text if minijinja fails on it.
    Jinja(String),
    /// libllama's built-in renderer for this name or template text.
    Builtin(String),
}

/// A model's chat template with its special tokens.
#[derive(Clone, Debug)]
pub struct ChatTemplate {
    renderer: Option<Renderer>,
    bos: String,
    eos: String,
}

impl ChatTemplate {
    /// The template of a GGUF file, or `overrides` (see the module docs).
    pub fn load(gguf: &Path, overrides: Option<&str>) -> Result<ChatTemplate, ChatError> {
        let f = GgufFile::open(gguf).map_err(|e| ChatError::Model(e.to_string()))?;
        let token = |key: &str| -> String {
            let id = f.get_u32_opt(key).ok().flatten();
            let tokens = f.get_str_array("tokenizer.ggml.tokens").unwrap_or(&[]);
            id.and_then(|i| tokens.get(i as usize))
                .cloned()
                .unwrap_or_default()
        };
        let renderer = match overrides {
            Some(o) => Some(Self::parse_override(o)?),
            None => f
                .get_str_opt("tokenizer.chat_template")
                .ok()
                .flatten()
                .map(|t| Renderer::Jinja(t.to_string())),
        };
        Ok(ChatTemplate {
            renderer,
            bos: token("tokenizer.ggml.bos_token_id"),
            eos: token("tokenizer.ggml.eos_token_id"),
        })
    }

    /// A template from Jinja source, with these special tokens (tests).
    pub fn from_jinja(source: &str, bos: &str, eos: &str) -> ChatTemplate {
        ChatTemplate {
            renderer: Some(Renderer::Jinja(source.to_string())),
            bos: bos.to_string(),
            eos: eos.to_string(),
        }
    }

    fn parse_override(o: &str) -> Result<Renderer, ChatError> {
        let p = Path::new(o);
        if p.is_file() {
            return std::fs::read_to_string(p)
                .map(Renderer::Jinja)
                .map_err(|err| ChatError::Read {
                    path: o.to_string(),
                    err,
                });
        }
        if o.contains("{%") || o.contains("{{") {
            return Ok(Renderer::Jinja(o.to_string()));
        }
        // a built-in name: libllama must know it
        let r = Renderer::Builtin(o.to_string());
        let probe = [Message::new("user", "hi")];
        render_builtin(o, &probe, true).map_err(|_| ChatError::UnknownTemplate(o.to_string()))?;
        Ok(r)
    }

    /// Which renderer is used, for the start-up line.
    pub fn describe(&self) -> String {
        match &self.renderer {
            None => "none (chat completions refused)".into(),
            Some(Renderer::Jinja(_)) => "Jinja (minijinja, Hugging Face's environment)".into(),
            Some(Renderer::Builtin(n)) => format!("libllama built-in {n:?}"),
        }
    }

    /// Renders `messages`; with `add_generation_prompt` the text ends where
    /// the assistant's reply begins.
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        self.render_with_tools(messages, add_generation_prompt, &[])
    }

    /// [`Self::render`] with the `tools` variable (OpenAI's tool list, as
    /// Hugging Face passes it); only Jinja templates render tools and tool
    /// messages.
    pub fn render_with_tools(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        tools: &[serde_json::Value],
    ) -> Result<String, ChatError> {
        let plain = tools.is_empty() && messages.iter().all(Message::is_plain);
        let builtin = |name: &str| {
            if !plain {
                return Err(ChatError::Render(
                    "libllama's built-in templates render no tools or tool messages".into(),
                ));
            }
            render_builtin(name, messages, add_generation_prompt)
        };
        match &self.renderer {
            None => Err(ChatError::NoTemplate),
            Some(Renderer::Builtin(name)) => builtin(name),
            Some(Renderer::Jinja(src)) => self
                .render_jinja(src, messages, add_generation_prompt, tools)
                .or_else(|e| {
                    // libllama knows the common templates by their text
                    builtin(src).map_err(|_| e)
                }),
        }
    }

    /// Whether the template writes tool calls in `<tool_call>` tags
    /// (Hermes, Qwen2.5, Qwen3).
    pub fn tagged_tool_calls(&self) -> bool {
        matches!(&self.renderer, Some(Renderer::Jinja(s)) if s.contains("<tool_call>"))
    }

    fn render_jinja(
        &self,
        src: &str,
        messages: &[Message],
        add_generation_prompt: bool,
        tools: &[serde_json::Value],
    ) -> Result<String, ChatError> {
        let mut env = minijinja::Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| ChatError::Render(e.to_string()))?;
        env.set_syntax(syntax);
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_function("strftime_now", |fmt: String| strftime_now(&fmt));
        let msgs: Vec<minijinja::Value> = messages
            .iter()
            .map(|m| minijinja::Value::from(minijinja::value::Serde(m)))
            .collect();
        // templates test `if tools`: absent (none) when the request has none
        let tools =
            (!tools.is_empty()).then(|| minijinja::Value::from(minijinja::value::Serde(tools)));
        let ctx = minijinja::context! {
            messages => minijinja::Value::from(msgs),
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos,
            eos_token => &self.eos,
        };
        env.render_str(src, ctx)
            .map_err(|e| ChatError::Render(format!("{e:#}")))
    }
}

fn render_builtin(tmpl: &str, messages: &[Message], add: bool) -> Result<String, ChatError> {
    let c = CString::new(tmpl).map_err(|_| ChatError::Nul)?;
    let msgs: Vec<(String, String)> = messages
        .iter()
        .map(|m| (m.role.clone(), m.content.clone()))
        .collect();
    builtin_chat_template(&c, &msgs, add).map_err(|e| ChatError::Render(e.to_string()))
}

/// The local time formatted by the C library's strftime (templates that
/// print today's date).
fn strftime_now(fmt: &str) -> Result<String, minijinja::Error> {
    let bad = || {
        minijinja::Error::new(
            minijinja::ErrorKind::InvalidOperation,
            "strftime_now format",
        )
    };
    let cfmt = CString::new(fmt).map_err(|_| bad())?;
    let mut buf = vec![0u8; 256];
    // SAFETY: `time` and `localtime_r` write only into the locals passed;
    // strftime writes at most buf.len() bytes into buf and returns how many.
    let n = unsafe {
        let t = libc::time(std::ptr::null_mut());
        let mut tm: libc::tm = std::mem::zeroed();
        if libc::localtime_r(&t, &mut tm).is_null() {
            return Err(bad());
        }
        libc::strftime(buf.as_mut_ptr().cast(), buf.len(), cfmt.as_ptr(), &tm)
    };
    buf.truncate(n);
    String::from_utf8(buf).map_err(|_| bad())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ChatML template as Hugging Face models ship it.
    const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn conversation() -> Vec<Message> {
        vec![
            Message::new("system", "You are terse."),
            Message::new("user", "Hi  there"),
            Message::new("assistant", "Hello."),
            Message::new("user", "What is 2+2?"),
        ]
    }

    #[test]
    fn jinja_rendering_equals_libllama_builtin() {
        crate::ggml::load_backends().unwrap();
        let t = ChatTemplate::from_jinja(CHATML, "<s>", "</s>");
        for add in [true, false] {
            let ours = t.render(&conversation(), add).unwrap();
            let theirs = render_builtin("chatml", &conversation(), add).unwrap();
            assert_eq!(ours, theirs);
        }
    }

    #[test]
    fn python_methods_trim_blocks_and_exceptions_work() {
        let src = "{% for m in messages %}\n  {% if m.role == 'user' %}\n[{{ m.content.strip() | upper }}]\n  {% endif %}\n{% endfor %}{{ bos_token }}";
        let t = ChatTemplate::from_jinja(src, "<s>", "</s>");
        assert_eq!(
            t.render(&conversation(), false).unwrap(),
            "[HI  THERE]\n[WHAT IS 2+2?]\n<s>"
        );
        let t = ChatTemplate::from_jinja("{{ raise_exception('only user roles') }}", "", "");
        let e = t.render(&conversation(), true).unwrap_err().to_string();
        assert!(e.contains("only user roles"), "{e}");
        let t = ChatTemplate::from_jinja("{{ strftime_now('%Y') }}", "", "");
        assert_eq!(t.render(&[], true).unwrap().len(), 4);
    }

    #[test]
    fn unknown_builtin_names_are_refused() {
        crate::ggml::load_backends().unwrap();
        assert!(matches!(
            ChatTemplate::parse_override("no-such-template"),
            Err(ChatError::UnknownTemplate(_))
        ));
        assert!(ChatTemplate::parse_override("chatml").is_ok());
    }
}
