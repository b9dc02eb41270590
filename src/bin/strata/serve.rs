//! `strata serve`: the OpenAI-compatible server (see strata::serve).

use crate::ModelArgs;
use anyhow::{Context as _, Result};
use clap::Args;
use std::time::Duration;
use strata::serve::access::{Access, AllowedHosts};
use strata::serve::{serve as run_server, ServeConfig};

#[derive(Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on.
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Sequences decoded together, 1 to 64 (llama.cpp's -np). --ctx-size is the whole KV
    /// cache, shared: each sequence may hold ctx-size / parallel positions.
    #[arg(long = "parallel", default_value_t = 4,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=64))]
    parallel: usize,
    /// Requests that may wait for a place; more answer 503.
    #[arg(long, default_value_t = 256)]
    queue: usize,
    /// Chat template: a file holding a Jinja template, Jinja source, or the
    /// name of a libllama built-in ("chatml", "llama3", ...). Default: the
    /// model's tokenizer.chat_template.
    #[arg(long = "chat-template")]
    chat_template: Option<String>,
    /// Batch-invariant numerics (CPU device): every request's tokens are
    /// those it gets alone, whatever it is batched with, at a cost in
    /// speed. Without it, as in llama-server, kernels chosen by batch size
    /// round differently and greedy answers can differ with the load.
    #[arg(long = "batch-invariant")]
    batch_invariant: bool,
    /// API key clients must send (`Authorization: Bearer KEY`) on every
    /// route but /health; repeatable. As llama-server's and vLLM's.
    #[arg(long = "api-key", value_name = "KEY")]
    api_key: Vec<String>,
    /// A file of API keys, one per line (kept out of the process list).
    #[arg(long = "api-key-file", value_name = "FILE")]
    api_key_file: Option<std::path::PathBuf>,
    /// Host header names the server answers, comma-separated, or * for any.
    /// Default: on a loopback address the loopback names only (a web page
    /// cannot then reach the server through DNS rebinding); else any.
    #[arg(long = "allowed-hosts", value_name = "NAMES")]
    allowed_hosts: Option<String>,
    /// Seconds a connection has to send a request's headers, from when it
    /// connects or its previous answer ends (so also how long an idle
    /// keep-alive connection stays open).
    #[arg(long = "timeout-headers", value_name = "SECS", default_value_t = 10.0)]
    timeout_headers: f64,
    /// Seconds a client has to send a request's body.
    #[arg(long = "timeout-body", value_name = "SECS", default_value_t = 60.0)]
    timeout_body: f64,
    /// Connections open at once; more are closed unanswered.
    #[arg(long = "max-connections", value_name = "N", default_value_t = 1024,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1_000_000))]
    max_connections: usize,
    /// Seconds the engine loop may spend without coming round (one step)
    /// before /health answers 503.
    #[arg(long = "health-stall", value_name = "SECS", default_value_t = 120.0)]
    health_stall: f64,
    /// Another name the model is served under, repeatable (llama-server's
    /// --alias, vLLM's --served-model-name): /v1/models lists it and
    /// requests may give it (clients that hard-code a model name).
    #[arg(long = "alias", value_name = "NAME")]
    alias: Vec<String>,
    /// Seconds running requests may go on after SIGTERM.
    #[arg(long = "shutdown-grace", default_value_t = 30.0)]
    shutdown_grace: f64,
    #[command(flatten)]
    spec: crate::spec::SpecArgs,
}

pub fn serve(a: ServeArgs) -> Result<()> {
    crate::check_model_path(&a.model.model, "model file")?;
    if !(a.shutdown_grace.is_finite() && a.shutdown_grace >= 0.0) {
        anyhow::bail!("--shutdown-grace must be a number of seconds >= 0");
    }
    let spec = crate::spec::serve_config(&a.spec, a.model.step_size(), a.parallel)?;
    let secs = |flag: &str, v: f64| {
        if v.is_finite() && v > 0.0 && v <= 86400.0 {
            Ok(Duration::from_secs_f64(v))
        } else {
            Err(anyhow::anyhow!(
                "{flag} must be a number of seconds in (0, 86400]"
            ))
        }
    };
    let header_timeout = secs("--timeout-headers", a.timeout_headers)?;
    let body_timeout = secs("--timeout-body", a.timeout_body)?;
    let health_stall = secs("--health-stall", a.health_stall)?;
    if let Some(n) = a.alias.iter().find(|n| n.trim().is_empty()) {
        anyhow::bail!("--alias {n:?}: a name must not be empty");
    }
    let mut keys = a.api_key.clone();
    if let Some(f) = &a.api_key_file {
        let text = std::fs::read_to_string(f)
            .with_context(|| format!("--api-key-file: reading {}", f.display()))?;
        keys.extend(
            text.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .map(String::from),
        );
        if keys.is_empty() {
            anyhow::bail!("--api-key-file {}: no key in the file", f.display());
        }
    }
    if let Some(k) = keys
        .iter()
        .find(|k| k.trim().is_empty() || k.chars().any(char::is_whitespace))
    {
        anyhow::bail!("--api-key: {k:?} is empty or holds white space");
    }
    let hosts = match &a.allowed_hosts {
        Some(list) => AllowedHosts::parse(list).map_err(anyhow::Error::msg)?,
        None => AllowedHosts::default_for(&a.host),
    };
    let cfg = ServeConfig {
        host: a.host.clone(),
        port: a.port,
        parallel: a.parallel,
        queue: a.queue,
        chat_template: a.chat_template.clone(),
        grace: Duration::from_secs_f64(a.shutdown_grace),
        model_id: a
            .model
            .model
            .file_stem()
            .map_or("model".into(), |s| s.to_string_lossy().into_owned()),
        spec,
        access: Access { keys, hosts },
        header_timeout,
        body_timeout,
        max_connections: a.max_connections,
        health_stall,
        aliases: a.alias.clone(),
        router_counts: a.model.saves_counts().then(|| a.model.counts_path()),
    };
    let mut ecfg = crate::engine_config(&a.model, true);
    ecfg.batch_invariant = a.batch_invariant;
    let model = a.model.model.clone();
    let path = model.clone();
    let spec_args = a.spec.clone();
    run_server(cfg, &model, move || {
        let mut load = || -> Result<strata::serve::Loaded> {
            // the draft first: its device memory comes out of the budget
            let draft = crate::spec::load_draft(&spec_args, &mut ecfg)?;
            let (engine, vocab) = crate::load_with(&path, &ecfg)?;
            let draft = match draft {
                Some(d) => Some(crate::spec::draft_model(
                    &spec_args, d, &engine, &vocab, &path,
                )?),
                None => None,
            };
            Ok((engine, vocab, draft))
        };
        load().map_err(|e| format!("{e:#}"))
    })
    .with_context(|| format!("serving {}", model.display()))
}
