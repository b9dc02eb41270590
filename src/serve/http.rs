//! The HTTP side: axum routes over the engine loop's channel.
//!
//! A completion request is parsed and checked here (bad input answers 4xx
//! with OpenAI's JSON error body before anything reaches the engine), then
//! handed to the engine loop, which answers with events. A full queue
//! answers 503 with Retry-After. A streamed answer is a server-sent event
//! stream of chunks ending in `data: [DONE]`; when the client goes away the
//! stream is dropped, the engine loop sees the closed channel and cancels
//! the sequence at the next step. A non-streamed answer is collected; its
//! handler is dropped with the connection, with the same effect.

use super::access::{Access, RequestHead};
use super::api::{self, Answer, ApiError, Endpoint, Parsed, Prompt};
use super::chat::ChatTemplate;
use super::logprobs::{self, LogprobEntry};
use super::metrics::Metrics;
use super::tools::{CallStream, Piece, Tools};
use super::worker::{Event, Shutdown, Submit};
use crate::llama::LlamaModel;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

pub struct AppState {
    pub submit: Mutex<Option<mpsc::Sender<Submit>>>,
    /// The model's vocabulary: prompts are tokenized here, on the blocking
    /// pool, never on the engine loop's thread.
    pub vocab: Arc<LlamaModel>,
    /// Bytes of the longest token's text: a prompt longer than
    /// `n_ctx_seq` times this cannot fit and is refused untokenized.
    pub max_piece: usize,
    /// Requests being parsed, rendered and tokenized at once.
    pub prepare: Arc<tokio::sync::Semaphore>,
    /// Who may call (API keys, Host, content type), checked first.
    pub access: Access,
    /// Time a client has to send a request's body.
    pub body_timeout: std::time::Duration,
    /// /health answers 503 when the engine loop has not come round for
    /// longer (a step that long owes its answers).
    pub health_stall: std::time::Duration,
    pub metrics: Arc<Metrics>,
    pub shutdown: Arc<Shutdown>,
    pub model_id: String,
    /// Other names the model answers to (`--alias`).
    pub aliases: Vec<String>,
    pub n_ctx_seq: usize,
    pub queue: usize,
    pub chat: ChatTemplate,
    pub next_id: AtomicU64,
    pub started: u64,
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(|| async {
            error(ApiError {
                status: 404,
                message: "no such endpoint".into(),
            })
        })
        .method_not_allowed_fallback(|| async {
            error(ApiError {
                status: 405,
                message: "this endpoint does not take that method (POST /v1/chat/completions, \
                          POST /v1/completions, GET /v1/models, GET /health, GET /metrics)"
                    .into(),
            })
        })
        // the body is read in the handlers, with its own limit and error
        .layer(axum::extract::DefaultBodyLimit::disable())
        .layer(axum::middleware::from_fn_with_state(state.clone(), access))
        .with_state(state)
}

/// Refuses what [`Access`] refuses, before any route (or body) is read.
async fn access(
    State(st): State<Arc<AppState>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let h = req.headers();
    let text = |name| h.get(name).and_then(|v: &HeaderValue| v.to_str().ok());
    let head = RequestHead {
        method: req.method().as_str(),
        path: req.uri().path(),
        host: text(header::HOST),
        content_type: text(header::CONTENT_TYPE),
        authorization: text(header::AUTHORIZATION),
    };
    if let Err(e) = st.access.check(&head) {
        st.metrics.rejected.fetch_add(1, Relaxed);
        return error(e);
    }
    next.run(req).await
}

fn error(e: ApiError) -> Response {
    let mut r = (
        StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        Json(e.body()),
    )
        .into_response();
    if e.status == 503 {
        r.headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    r
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

async fn models(State(st): State<Arc<AppState>>) -> Response {
    Json(serde_json::json!({
        "object": "list",
        "data": std::iter::once(&st.model_id)
            .chain(&st.aliases)
            .map(|id| serde_json::json!({"id": id, "object": "model", "created": st.started, "owned_by": "strata"}))
            .collect::<Vec<_>>(),
    }))
    .into_response()
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
    if st.shutdown.is_stopping() {
        return error(ApiError {
            status: 503,
            message: "shutting down".into(),
        });
    }
    // a step that has run longer than the limit: the engine owes answers
    let since = st.metrics.since_beat();
    if since > st.health_stall {
        return error(ApiError {
            status: 503,
            message: format!(
                "the engine loop has not come round for {:.0} s (--health-stall {:.0})",
                since.as_secs_f64(),
                st.health_stall.as_secs_f64()
            ),
        });
    }
    Json(serde_json::json!({"status": "ok"})).into_response()
}

async fn metrics(State(st): State<Arc<AppState>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        st.metrics.render(),
    )
        .into_response()
}

/// Largest request body read (a prompt of a million tokens' text fits).
const MAX_BODY: usize = 32 << 20;

async fn chat(State(st): State<Arc<AppState>>, body: Body) -> Response {
    read_then(st, Endpoint::Chat, body).await
}

async fn completions(State(st): State<Arc<AppState>>, body: Body) -> Response {
    read_then(st, Endpoint::Completion, body).await
}

async fn read_then(st: Arc<AppState>, endpoint: Endpoint, body: Body) -> Response {
    let read = tokio::time::timeout(st.body_timeout, axum::body::to_bytes(body, MAX_BODY)).await;
    let Ok(read) = read else {
        st.metrics.rejected.fetch_add(1, Relaxed);
        return error(ApiError {
            status: 408,
            message: format!(
                "the request body did not arrive within {:.0} s (--timeout-body)",
                st.body_timeout.as_secs_f64()
            ),
        });
    };
    match read {
        Ok(b) => complete(st, endpoint, b).await,
        Err(e) => {
            st.metrics.rejected.fetch_add(1, Relaxed);
            error(ApiError {
                status: 413,
                message: format!(
                    "the request body could not be read (at most {MAX_BODY} bytes): {e}"
                ),
            })
        }
    }
}

/// Parses, renders and tokenizes a request: CPU work that grows with the
/// request, done on tokio's blocking pool (at most `prepare` at once), so
/// neither the HTTP runtime nor the engine loop waits on it. Bounds are
/// checked before the work they bound: a text that cannot fit the context
/// is refused before it is tokenized.
fn prepare(
    st: &AppState,
    endpoint: Endpoint,
    body: &[u8],
    seed: u64,
) -> Result<(Parsed, Vec<u32>), ApiError> {
    let lim = api::Limits {
        model_id: &st.model_id,
        aliases: &st.aliases,
        n_ctx_seq: st.n_ctx_seq,
        n_vocab: st.vocab.n_vocab() as usize,
        chat: &st.chat,
    };
    let mut parsed = api::parse(endpoint, body, &lim, seed)?;
    // taken out: the text is not kept for the request's lifetime
    let prompt = std::mem::replace(&mut parsed.prompt, Prompt::Tokens(Vec::new()));
    let tokens = match prompt {
        Prompt::Text(t) => {
            let most = st.n_ctx_seq.saturating_mul(st.max_piece);
            if t.len() > most {
                return Err(ApiError::bad(format!(
                    "the prompt is {} bytes: more than a context of {} tokens can hold \
                     ({} bytes, at most {} per token)",
                    t.len(),
                    st.n_ctx_seq,
                    most,
                    st.max_piece
                )));
            }
            st.vocab
                .tokenize(&t, true, true)
                .map_err(|e| ApiError::bad(format!("tokenizing the prompt: {e}")))?
        }
        Prompt::Tokens(t) => t,
    };
    Ok((parsed, tokens))
}

/// Bytes of the longest token's text (at least 4, a UTF-8 character: a
/// character the vocabulary lacks still takes a token).
pub fn max_piece_bytes(vocab: &LlamaModel) -> usize {
    (0..vocab.n_vocab())
        .map(|t| vocab.token_bytes(t, true).len())
        .max()
        .unwrap_or(0)
        .max(4)
}

async fn complete(st: Arc<AppState>, endpoint: Endpoint, body: Bytes) -> Response {
    let arrived = Instant::now();
    let n = st.next_id.fetch_add(1, Relaxed);
    // a request without a seed gets its own
    let seed = crate::sample::random_seed();
    if st.shutdown.is_stopping() {
        st.metrics.rejected.fetch_add(1, Relaxed);
        return error(ApiError {
            status: 503,
            message: "the server is shutting down".into(),
        });
    }
    let prepared = {
        // the permit is held until the work is done, also when the client
        // goes away meanwhile (the task runs to its end)
        let Ok(permit) = st.prepare.clone().acquire_owned().await else {
            return error(ApiError {
                status: 503,
                message: "the server is shutting down".into(),
            });
        };
        let st2 = st.clone();
        let r = tokio::task::spawn_blocking(move || {
            let _permit = permit;
            prepare(&st2, endpoint, &body, seed)
        })
        .await;
        match r {
            Ok(r) => r,
            Err(_) => Err(ApiError {
                status: 500,
                message: "preparing the request failed".into(),
            }),
        }
    };
    let (parsed, prompt) = match prepared {
        Ok(p) => p,
        Err(e) => {
            st.metrics.rejected.fetch_add(1, Relaxed);
            return error(e);
        }
    };
    if st.shutdown.is_stopping() {
        st.metrics.rejected.fetch_add(1, Relaxed);
        return error(ApiError {
            status: 503,
            message: "the server is shutting down".into(),
        });
    }
    // admission: at most `queue` requests wait
    if st.metrics.queued.fetch_add(1, Relaxed) >= st.queue as u64 {
        st.metrics.queued.fetch_sub(1, Relaxed);
        st.metrics.rejected.fetch_add(1, Relaxed);
        return error(ApiError {
            status: 503,
            message: format!(
                "the queue is full ({} requests waiting); retry later",
                st.queue
            ),
        });
    }
    let want_logprobs = parsed.job.logprobs.is_some();
    let tools = parsed.job.tools.clone();
    let (tx, mut rx) = unbounded_channel();
    let sent = st
        .submit
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
        .is_some_and(|s| {
            s.send(Submit {
                id: n,
                prompt,
                job: parsed.job,
                arrived,
                events: tx,
            })
            .is_ok()
        });
    if !sent {
        st.metrics.queued.fetch_sub(1, Relaxed);
        return error(ApiError {
            status: 503,
            message: "the engine is not running".into(),
        });
    }
    // the first event says whether the engine took it
    match rx.recv().await {
        Some(Event::Queued { .. }) => {}
        Some(Event::Error(e)) => return error(e),
        _ => {
            return error(ApiError {
                status: 500,
                message: "the engine dropped the request".into(),
            })
        }
    }
    let prefix = match endpoint {
        Endpoint::Chat => "chatcmpl",
        Endpoint::Completion => "cmpl",
    };
    let id = format!("{prefix}-{n}");
    let created = now_secs();
    if parsed.stream {
        stream(
            StreamOf {
                endpoint,
                id,
                created,
                include_usage: parsed.include_usage,
                logprobs: want_logprobs,
                model: parsed.model,
                vocab: st.vocab.clone(),
                tools,
            },
            rx,
        )
    } else {
        let a = Answer {
            endpoint,
            id: &id,
            created,
            model: &parsed.model,
        };
        let mut text = String::new();
        let mut entries: Vec<LogprobEntry> = Vec::new();
        while let Some(ev) = rx.recv().await {
            match ev {
                Event::Text { text: t, logprobs } => {
                    text.push_str(&t);
                    entries.extend(logprobs);
                }
                Event::Done { finish, usage } => {
                    let lp = if want_logprobs {
                        logprobs::answer_json(endpoint, &entries, &|t| {
                            st.vocab.token_bytes(t, true)
                        })
                    } else {
                        serde_json::Value::Null
                    };
                    if let Some(t) = &tools {
                        let (content, calls) = t.extract(&text, &id);
                        let finish = calls_finish(calls.len(), finish);
                        return Json(a.full_with_calls(
                            content.as_deref(),
                            &calls,
                            finish,
                            usage,
                            lp,
                        ))
                        .into_response();
                    }
                    return Json(a.full(&text, finish, usage, lp)).into_response();
                }
                Event::Error(e) => return error(e),
                Event::Queued { .. } => {}
            }
        }
        error(ApiError {
            status: 500,
            message: "the engine dropped the request".into(),
        })
    }
}

/// What one streamed answer is: its identity and options.
struct StreamOf {
    endpoint: Endpoint,
    id: String,
    created: u64,
    include_usage: bool,
    /// Chunks of text carry their tokens' logprobs.
    logprobs: bool,
    model: String,
    /// Token ids to text, for logprobs.
    vocab: Arc<LlamaModel>,
    /// With tools the text goes out through a [`CallStream`]: content as
    /// it forms, each call when it closes.
    tools: Option<Arc<Tools>>,
}

/// An answer that ended with `n_calls` calls finishes as "tool_calls".
fn calls_finish(n_calls: usize, finish: &str) -> &str {
    if n_calls > 0 && finish == "stop" {
        "tool_calls"
    } else {
        finish
    }
}

/// The server-sent event stream of one answer.
fn stream(of: StreamOf, rx: UnboundedReceiver<Event>) -> Response {
    let of = Arc::new(of);
    struct S {
        rx: UnboundedReceiver<Event>,
        first: bool,
        done: bool,
        /// Answers with tools: their content and calls.
        calls: Option<CallStream>,
    }
    let state = S {
        rx,
        first: true,
        done: false,
        calls: of.tools.clone().map(|t| CallStream::new(t, &of.id)),
    };
    let events = futures_util::stream::unfold(state, move |mut s| {
        let of = of.clone();
        async move {
            if s.done {
                return None;
            }
            let a = Answer {
                endpoint: of.endpoint,
                id: &of.id,
                created: of.created,
                model: &of.model,
            };
            let null = serde_json::Value::Null;
            let data = |v: serde_json::Value| SseEvent::default().data(v.to_string());
            // answers with tools: a chunk per piece
            let pieces = |s: &mut S, p: Vec<Piece>| -> Vec<SseEvent> {
                p.into_iter()
                    .map(|p| {
                        let first = std::mem::take(&mut s.first);
                        data(match p {
                            Piece::Content(t) => a.chunk(Some(&t), first, None, null.clone()),
                            Piece::Call(i, c) => a.call_chunk(&c, i, first),
                        })
                    })
                    .collect()
            };
            let out: Vec<SseEvent> = match s.rx.recv().await {
                Some(Event::Text { text, logprobs }) => match s.calls.as_mut() {
                    Some(c) => {
                        let p = c.push(&text);
                        pieces(&mut s, p)
                    }
                    None => {
                        let first = std::mem::take(&mut s.first);
                        let lp = if of.logprobs {
                            logprobs::answer_json(of.endpoint, &logprobs, &|t| {
                                of.vocab.token_bytes(t, true)
                            })
                        } else {
                            null
                        };
                        vec![data(a.chunk(Some(&text), first, None, lp))]
                    }
                },
                Some(Event::Done { finish, usage }) => {
                    s.done = true;
                    // what an answer with tools held back, then its end
                    let rest = s.calls.as_mut().map(CallStream::finish).unwrap_or_default();
                    let mut v = pieces(&mut s, rest);
                    let n = s.calls.as_ref().map_or(0, CallStream::calls);
                    let finish = calls_finish(n, finish);
                    v.push(data(a.chunk(None, s.first, Some(finish), null.clone())));
                    if of.include_usage {
                        v.push(data(a.usage_chunk(usage)));
                    }
                    v.push(SseEvent::default().data("[DONE]"));
                    v
                }
                Some(Event::Queued { .. }) => Vec::new(),
                ended => {
                    s.done = true;
                    let e = match ended {
                        Some(Event::Error(e)) => e,
                        _ => ApiError {
                            status: 500,
                            message: "the engine dropped the request".into(),
                        },
                    };
                    // a last chunk says why the answer ends, then the error
                    vec![
                        data(a.chunk(None, s.first, Some("error"), null)),
                        SseEvent::default()
                            .event("error")
                            .data(e.body().to_string()),
                        SseEvent::default().data("[DONE]"),
                    ]
                }
            };
            Some((
                futures_util::stream::iter(out.into_iter().map(Ok::<_, Infallible>)),
                s,
            ))
        }
    });
    Sse::new(futures_util::StreamExt::flatten(events)).into_response()
}
