//! `strata serve`: an OpenAI-compatible HTTP server over the paged engine.
//!
//! Layout: [`batch`] decides what each engine step holds (continuous
//! batching, chunked prefill, the prefix cache; plain Rust), [`worker`] is
//! the one thread that owns the engine and runs the steps, [`http`] the
//! axum routes, [`api`] the OpenAI wire format ([`logprobs`] its
//! `logprobs` and `logit_bias`), [`chat`] chat templates, [`stop`] stop
//! strings, [`metrics`] the Prometheus counters.
//!
//! Threads: the engine is not `Send`, so the engine loop's thread loads it
//! and keeps it; a tokio runtime serves HTTP and talks to the loop over
//! channels. SIGTERM or SIGINT stops accepting, lets running requests
//! finish within the grace period, cuts off what is left and returns.

pub mod access;
pub mod api;
pub mod batch;
pub mod chat;
pub mod http;
pub mod listen;
pub mod logprobs;
pub mod metrics;
pub mod request;
pub mod stop;
pub mod tools;
pub mod worker;

use crate::engine::Engine;
use crate::llama::LlamaModel;
use std::path::Path;
use std::sync::atomic::AtomicU64;
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot listen on {addr}: {err}")]
    Bind { addr: String, err: std::io::Error },
    #[error(transparent)]
    Chat(#[from] chat::ChatError),
    #[error(transparent)]
    Batch(#[from] batch::BatchError),
    #[error("{0}")]
    Load(String),
    #[error("the HTTP server failed: {0}")]
    Http(std::io::Error),
    #[error("the engine loop panicked")]
    Worker,
}

#[derive(Clone, Debug)]
pub struct ServeConfig {
    pub host: String,
    pub port: u16,
    /// Sequences decoded together.
    pub parallel: usize,
    /// Requests that may wait for a place.
    pub queue: usize,
    /// `--chat-template`: a file, Jinja source or a libllama built-in name.
    pub chat_template: Option<String>,
    /// How long running requests may go on after SIGTERM.
    pub grace: Duration,
    /// The name /v1/models lists and requests may give.
    pub model_id: String,
    /// API keys, allowed Host headers (access.rs).
    pub access: access::Access,
    /// Time a connection has to send a request's headers (and an idle
    /// keep-alive connection to send the next), and to send its body.
    pub header_timeout: Duration,
    pub body_timeout: Duration,
    /// Connections open at once; more are closed unanswered.
    pub max_connections: usize,
    /// /health answers 503 past this long without the engine loop coming
    /// round.
    pub health_stall: Duration,
    /// Other names the model is served under (`--alias`): /v1/models lists
    /// them after `model_id`, and requests may give any.
    pub aliases: Vec<String>,
    /// Speculative decoding: each sequence drafts up to `draft_max` tokens
    /// (prompt lookup from its own text, or the draft model `load` gives),
    /// verified in its decode steps.
    pub spec: Option<crate::speculative::SpecConfig>,
    /// Where the router's counts (a mixture's host-computed layers) are
    /// added when the server stops (None: not kept).
    pub router_counts: Option<std::path::PathBuf>,
}

/// What the server's `load` gives: the target, its vocabulary, and the
/// draft model (its vocabulary checked) when one drafts.
pub type Loaded = (Engine, LlamaModel, Option<crate::speculative::DraftModel>);

/// What the engine loop reports once the model is loaded.
struct Ready {
    n_ctx_seq: usize,
    summary: String,
    /// The vocabulary, shared with the HTTP side, which tokenizes.
    vocab: Arc<LlamaModel>,
}

/// Serves until SIGTERM or SIGINT. `load` runs on the engine loop's thread
/// (the engine stays there) and gives the engine and its vocabulary.
pub fn serve<F>(cfg: ServeConfig, model: &Path, load: F) -> Result<(), ServeError>
where
    F: FnOnce() -> Result<Loaded, String> + Send + 'static,
{
    let chat = chat::ChatTemplate::load(model, cfg.chat_template.as_deref())?;
    let addr = format!("{}:{}", cfg.host, cfg.port);
    let listener = std::net::TcpListener::bind(&addr).map_err(|err| ServeError::Bind {
        addr: addr.clone(),
        err,
    })?;
    listener.set_nonblocking(true).map_err(ServeError::Http)?;
    raise_fd_limit();

    let metrics = Arc::new(metrics::Metrics::default());
    let shutdown = Arc::new(worker::Shutdown::default());
    let (tx, rx) = mpsc::channel();
    let (ready_tx, ready_rx) = mpsc::channel::<Result<Ready, ServeError>>();
    let (m, s, parallel, spec) = (metrics.clone(), shutdown.clone(), cfg.parallel, cfg.spec);
    let counts_path = cfg.router_counts.clone();
    let handle = std::thread::Builder::new()
        .name("strata-engine".into())
        .spawn(move || {
            let started = load()
                .map_err(ServeError::Load)
                .and_then(|(engine, vocab, draft)| {
                    let b = batch::Batcher::new(
                        engine.n_ctx() as usize,
                        engine.n_batch() as usize,
                        parallel,
                    )?;
                    Ok((engine, vocab, draft, b))
                });
            match started {
                Ok((engine, vocab, draft, b)) => {
                    let vocab = Arc::new(vocab);
                    let drafting = match (&spec, &draft) {
                        (Some(c), Some(_)) => format!(
                            "; a draft model drafts up to {} tokens per sequence",
                            c.draft_max
                        ),
                        (Some(c), None) => format!(
                            "; prompt lookup drafts up to {} tokens per sequence",
                            c.draft_max
                        ),
                        _ => String::new(),
                    };
                    let summary = format!(
                        "{} sequences of up to {} tokens, steps of up to {} tokens{drafting}",
                        parallel,
                        b.n_ctx_seq(),
                        engine.n_batch()
                    );
                    let _ = ready_tx.send(Ok(Ready {
                        n_ctx_seq: b.n_ctx_seq(),
                        summary,
                        vocab: vocab.clone(),
                    }));
                    worker::Worker::new(engine, vocab, b, rx, m, s)
                        .with_drafting(spec, draft)
                        .with_counts(counts_path)
                        .run();
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            }
        })
        .map_err(ServeError::Http)?;
    let ready = match ready_rx.recv() {
        Ok(r) => r?,
        Err(_) => return Err(ServeError::Worker),
    };

    let max_piece = http::max_piece_bytes(&ready.vocab);
    // the loop is starting: /health counts from here
    metrics.beat();
    let state = Arc::new(http::AppState {
        submit: Mutex::new(Some(tx)),
        vocab: ready.vocab,
        max_piece,
        // a core each for the HTTP runtime and the engine loop stays free
        prepare: Arc::new(tokio::sync::Semaphore::new(PREPARE_THREADS)),
        access: cfg.access.clone(),
        body_timeout: cfg.body_timeout,
        health_stall: cfg.health_stall,
        metrics,
        shutdown: shutdown.clone(),
        model_id: cfg.model_id.clone(),
        aliases: cfg.aliases.clone(),
        n_ctx_seq: ready.n_ctx_seq,
        queue: cfg.queue,
        chat,
        next_id: AtomicU64::new(1),
        started: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    });
    eprintln!(
        "strata serve: {}; chat template: {}",
        ready.summary,
        state.chat.describe()
    );
    eprintln!(
        "strata serve: listening on http://{addr} (model id {:?})",
        cfg.model_id
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .worker_threads(2)
        .build()
        .map_err(ServeError::Http)?;
    let app = http::router(state.clone());
    let grace = cfg.grace;
    let limits = listen::ConnLimits {
        header_timeout: cfg.header_timeout,
        max_connections: cfg.max_connections,
        // the engine loop cuts requests off at the grace; a little more for
        // their last events to be written
        drain: grace + Duration::from_secs(5),
    };
    let res = rt.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        listen::serve(listener, app, limits, async move {
            stop_signal().await;
            eprintln!(
                "strata serve: stopping; running requests get {:.0} s to finish",
                grace.as_secs_f64()
            );
            shutdown.begin(grace);
        })
        .await;
        Ok::<(), std::io::Error>(())
    });
    // the engine loop ends once its channel is closed and nothing runs
    state
        .submit
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take();
    rt.shutdown_timeout(Duration::from_secs(1));
    handle.join().map_err(|_| ServeError::Worker)?;
    res.map_err(ServeError::Http)
}

/// Requests parsed, rendered and tokenized at once (tokio's blocking
/// pool): enough that a slow one does not hold up the others, few enough
/// that they leave the engine loop its cores.
const PREPARE_THREADS: usize = 2;

/// SIGTERM or SIGINT.
async fn stop_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(mut t), Ok(mut i)) => {
            tokio::select! {
                _ = t.recv() => {}
                _ = i.recv() => {}
            }
        }
        _ => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// Idle keep-alive connections each hold a descriptor: allow as many as
/// the hard limit permits.
fn raise_fd_limit() {
    let mut r = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read and write the struct passed.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && r.rlim_cur < r.rlim_max {
            r.rlim_cur = r.rlim_max.min(1 << 20);
            libc::setrlimit(libc::RLIMIT_NOFILE, &r);
        }
    }
}
