//! `strata serve` on 127.0.0.1 with real clients: the `openai` Python
//! package (tests/serve/*.py, installed by tools/serve-clients.sh), curl and
//! raw sockets. Each test starts its own server on a free port.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The Python with the `openai` package, or None (skip) outside CI.
fn python() -> Option<PathBuf> {
    let p = std::env::var_os("STRATA_SERVE_PYTHON")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var("HOME").unwrap_or_default())
                .join(".cache/strata/venv-serve/bin/python")
        });
    if p.is_file() {
        return Some(p);
    }
    if std::env::var("STRATA_REQUIRE_MODELS").as_deref() == Ok("1") {
        panic!("{} missing: run tools/serve-clients.sh", p.display());
    }
    eprintln!(
        "skipping: {} not found (run tools/serve-clients.sh)",
        p.display()
    );
    None
}

struct Server {
    child: Child,
    port: u16,
    log: PathBuf,
}

impl Server {
    fn start(model: &Path, extra: &[&str]) -> Server {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let log = std::env::temp_dir().join(format!("strata-serve-{port}.log"));
        let child = Command::new(env!("CARGO_BIN_EXE_strata"))
            .args(["serve", "-m"])
            .arg(model)
            .args(["--port", &port.to_string(), "-t", "2"])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start strata serve");
        let s = Server { child, port, log };
        let t0 = Instant::now();
        while http(s.port, "GET", "/health", b"").map(|r| r.0) != Some(200) {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "server did not start: {}",
                s.log_text()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        s
    }
    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
    /// Runs one of tests/serve/*.py against this server.
    fn run_py(&self, py: &Path, script: &str) {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/serve");
        let out = Command::new(py)
            .arg(dir.join(script))
            .current_dir(&dir)
            .env("STRATA_URL", self.url())
            .env("STRATA_PID", self.child.id().to_string())
            .output()
            .expect("run python");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        eprintln!("{script}: {text}");
        assert!(
            out.status.success(),
            "{script} failed:\n{text}\nserver log:\n{}",
            self.log_text()
        );
    }
    fn metric(&self, name: &str) -> f64 {
        let (_, body) = http(self.port, "GET", "/metrics", b"").unwrap();
        let body = String::from_utf8(body).unwrap();
        body.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no metric {name}"))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One HTTP/1.1 request on a fresh connection: (status, body).
fn http(port: u16, method: &str, path: &str, body: &[u8]) -> Option<(u16, Vec<u8>)> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(300))).ok()?;
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).ok()?;
    s.write_all(body).ok()?;
    let mut out = Vec::new();
    s.read_to_end(&mut out).ok()?;
    let split = out.windows(4).position(|w| w == b"\r\n\r\n")?;
    let status = std::str::from_utf8(&out[9..12]).ok()?.parse().ok()?;
    Some((status, out[split + 4..].to_vec()))
}

/// curl with a JSON content type (the server refuses POST bodies of
/// other types).
fn curl(args: &[&str]) -> (String, String) {
    let out = Command::new("curl")
        .args([
            "-sS",
            "--max-time",
            "300",
            "-H",
            "Content-Type: application/json",
        ])
        .args(args)
        .output()
        .expect("run curl");
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn openai_clients_and_concurrent_answers_equal_alone() {
    let (Some(model), Some(py)) = (common::model(common::SMOLLM2), python()) else {
        return;
    };
    let s = Server::start(
        &model,
        &["--parallel", "16", "-c", "8192", "--batch-invariant"],
    );
    s.run_py(&py, "clients.py");
    s.run_py(&py, "same_answers.py");
    drop(s);
    // the other test model (Qwen2.5, Q4_K): the same equalities
    let Some(qwen) = common::model(common::QWEN2) else {
        return;
    };
    let s = Server::start(
        &qwen,
        &["--parallel", "16", "-c", "8192", "--batch-invariant"],
    );
    s.run_py(&py, "same_answers.py");
}

#[test]
fn load_test_and_bad_input() {
    let (Some(model), Some(py)) = (common::model(common::SMOLLM2), python()) else {
        return;
    };
    let s = Server::start(&model, &["--parallel", "16", "-c", "16384"]);
    s.run_py(&py, "load.py");

    // curl, streamed and not
    let url = format!("{}/v1/chat/completions", s.url());
    let (out, _) = curl(&[
        "-N",
        &url,
        "-d",
        r#"{"messages":[{"role":"user","content":"Hi"}],"max_tokens":5,"stream":true}"#,
    ]);
    let data: Vec<&str> = out
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert!(data.len() >= 3 && data.last() == Some(&"[DONE]"), "{out}");
    let first: serde_json::Value = serde_json::from_str(data[0]).unwrap();
    assert_eq!(first["object"], "chat.completion.chunk");
    let (out, _) = curl(&[
        &url,
        "-d",
        r#"{"messages":[{"role":"user","content":"Hi"}],"max_tokens":5}"#,
    ]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(
        v["usage"]["completion_tokens"].as_u64().unwrap() <= 5,
        "{out}"
    );

    // bad input answers 4xx with a JSON error body
    let long = "word ".repeat(2000);
    let cases: Vec<(&str, Vec<u8>, u16, &str)> = vec![
        (
            "/v1/chat/completions",
            b"{\"messages\": [".to_vec(),
            400,
            "not valid JSON",
        ),
        (
            "/v1/chat/completions",
            b"{\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe\"}]}".to_vec(),
            400,
            "not valid JSON",
        ),
        (
            "/v1/chat/completions",
            br#"{"messages":[]}"#.to_vec(),
            400,
            "must not be empty",
        ),
        (
            "/v1/chat/completions",
            br#"{"model":"gpt-4","messages":[{"role":"user","content":"x"}]}"#.to_vec(),
            404,
            "does not exist",
        ),
        (
            "/v1/completions",
            br#"{"prompt":"x","max_tokens":-5}"#.to_vec(),
            400,
            "at least 1",
        ),
        (
            "/v1/completions",
            br#"{"prompt":"x","max_tokens":99999999999999}"#.to_vec(),
            400,
            "does not fit",
        ),
        (
            "/v1/completions",
            br#"{"prompt":"x","max_tokens":1e400}"#.to_vec(),
            400,
            "not valid JSON",
        ),
        (
            "/v1/completions",
            format!(r#"{{"prompt":"{long}"}}"#).into_bytes(),
            400,
            "the context holds 1024 per sequence",
        ),
        (
            "/v1/completions",
            br#"{"prompt":[1,2,99999999]}"#.to_vec(),
            400,
            "outside the vocabulary",
        ),
        ("/v1/nothing", b"{}".to_vec(), 404, "no such endpoint"),
    ];
    for (path, body, status, says) in cases {
        let (st, b) = http(s.port, "POST", path, &body).expect("an answer");
        let b = String::from_utf8_lossy(&b);
        assert_eq!(
            st,
            status,
            "{path} {}: {b}",
            String::from_utf8_lossy(&body[..body.len().min(60)])
        );
        let v: serde_json::Value =
            serde_json::from_str(&b).unwrap_or_else(|_| panic!("not JSON: {b}"));
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains(says), "{path}: {msg:?} does not say {says:?}");
    }
    let rejected = s.metric("strata_requests_rejected_total");
    assert!(rejected >= 9.0, "rejected {rejected}");

    // a thousand idle connections do not stop it serving
    let idle: Vec<TcpStream> = (0..1000)
        .map(|_| TcpStream::connect(("127.0.0.1", s.port)).expect("connect"))
        .collect();
    let (st, _) = http(
        s.port,
        "POST",
        "/v1/completions",
        br#"{"prompt":"Hello","max_tokens":3}"#,
    )
    .expect("served");
    assert_eq!(st, 200);
    drop(idle);
    assert_eq!(http(s.port, "GET", "/health", b"").map(|r| r.0), Some(200));

    // a non-streamed request whose client goes away is cancelled too
    let cancelled = s.metric("strata_requests_cancelled_total");
    let mut c = TcpStream::connect(("127.0.0.1", s.port)).unwrap();
    let body = br#"{"prompt":"Tell me a long story","max_tokens":500,"ignore_eos":true}"#;
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    c.write_all(head.as_bytes()).unwrap();
    c.write_all(body).unwrap();
    let t0 = Instant::now();
    while s.metric("strata_requests_active") < 1.0 {
        assert!(t0.elapsed() < Duration::from_secs(30));
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(c);
    while s.metric("strata_requests_cancelled_total") < cancelled + 1.0
        || s.metric("strata_requests_active") > 0.0
    {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the dropped request was not cancelled"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn full_queue_answers_503_and_sigterm_finishes_running_requests() {
    let Some(model) = common::model(common::SMOLLM2) else {
        return;
    };
    let s = Server::start(&model, &["--parallel", "1", "--queue", "1", "-c", "1024"]);
    // long enough to be seen running: no end-of-generation token cuts it short
    let body = r#"{"prompt":"Tell me a long story about the sea.","max_tokens":64,"ignore_eos":true,"stream":true}"#;
    let url = format!("{}/v1/completions", s.url());
    // one runs, one waits, the third is refused
    let spawn = |b: &str| {
        Command::new("curl")
            .args([
                "-sS",
                "-N",
                "--max-time",
                "300",
                "-H",
                "Content-Type: application/json",
                &url,
                "-d",
                b,
            ])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap()
    };
    let running = spawn(body);
    let t0 = Instant::now();
    while s.metric("strata_requests_active") < 1.0 {
        assert!(t0.elapsed() < Duration::from_secs(30));
        std::thread::sleep(Duration::from_millis(20));
    }
    let waiting = spawn(body);
    while s.metric("strata_requests_queued") < 1.0 {
        assert!(t0.elapsed() < Duration::from_secs(30));
        std::thread::sleep(Duration::from_millis(20));
    }
    let (out, _) = curl(&["-i", &url, "-d", body]);
    assert!(out.starts_with("HTTP/1.1 503"), "{out}");
    assert!(out.to_ascii_lowercase().contains("retry-after: 1"), "{out}");
    assert!(out.contains("queue is full"), "{out}");

    // SIGTERM: both accepted requests finish, new ones are refused, exit 0
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(s.child.id() as i32, libc::SIGTERM) };
    for c in [running, waiting] {
        let out = c.wait_with_output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(text.trim_end().ends_with("data: [DONE]"), "{text}");
        assert!(
            text.contains("\"finish_reason\":\"length\"")
                || text.contains("\"finish_reason\":\"stop\""),
            "{text}"
        );
    }
    let mut s = s;
    let status = s.child.wait().unwrap();
    assert!(status.success(), "exit {status:?}: {}", s.log_text());
    assert!(
        http(s.port, "GET", "/health", b"").is_none(),
        "still listening"
    );
}

/// The test models' own Jinja templates, rendered by minijinja, give what
/// libllama's built-in renderer gives for them (both are ChatML with a
/// system message); without one, Qwen's template adds its default system
/// prompt, as Hugging Face renders it.
#[test]
fn gguf_chat_templates_render_as_libllama_does() {
    use strata::serve::chat::{ChatTemplate, Message};
    for name in [common::SMOLLM2, common::QWEN2] {
        let Some(model) = common::model(name) else {
            return;
        };
        let vocab = strata::llama::LlamaModel::load(&model, true, 0).unwrap();
        let t = ChatTemplate::load(&model, None).unwrap();
        let conv = [
            Message::new("system", "Be brief."),
            Message::new("user", "Hi"),
            Message::new("assistant", "Hello."),
            Message::new("user", "What is 2+2?"),
        ];
        let pairs: Vec<(String, String)> = conv
            .iter()
            .map(|m| (m.role.clone(), m.content.clone()))
            .collect();
        for add in [true, false] {
            assert_eq!(
                t.render(&conv, add).unwrap(),
                vocab.apply_chat_template(&pairs, add).unwrap(),
                "{name}"
            );
        }
        assert!(t.describe().starts_with("Jinja"), "{name}");
    }
    let Some(model) = common::model(common::QWEN2) else {
        return;
    };
    let t = ChatTemplate::load(&model, None).unwrap();
    let r = t.render(&[Message::new("user", "Hi")], true).unwrap();
    assert!(r.starts_with("<|im_start|>system\nYou are Qwen"), "{r}");
    assert!(
        r.ends_with("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
        "{r}"
    );
}

const DRAFT_PROMPTS: [&str; 3] = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
    "List: apple, banana, cherry, apple, banana, cherry, apple,",
];

fn ask_greedy(port: u16, p: &str) -> String {
    let body = serde_json::json!({"prompt": p, "max_tokens": 40, "temperature": 0}).to_string();
    let (st, b) = http(port, "POST", "/v1/completions", body.as_bytes()).expect("answer");
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
    let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

/// Drafting in the server with `drafting` flags: the prompts sent
/// concurrently, with batch-invariant numerics, answer exactly what plain
/// decoding answers alone, and some drafts are accepted.
fn drafted_answers_equal_plain(model: &Path, drafting: &[&str]) {
    let plain: Vec<String> = {
        let s = Server::start(model, &["--parallel", "4", "--batch-invariant"]);
        DRAFT_PROMPTS
            .iter()
            .map(|p| ask_greedy(s.port, p))
            .collect()
    };
    let mut args = vec!["--parallel", "4", "--batch-invariant", "--draft-fixed"];
    args.extend_from_slice(drafting);
    let s = Server::start(model, &args);
    let drafted: Vec<String> = std::thread::scope(|sc| {
        let h: Vec<_> = DRAFT_PROMPTS
            .iter()
            .map(|p| sc.spawn(|| ask_greedy(s.port, p)))
            .collect();
        h.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(drafted, plain, "{drafting:?}");
    let (d, a) = (
        s.metric("strata_draft_tokens_total"),
        s.metric("strata_draft_accepted_total"),
    );
    let refed = s.metric("strata_draft_refed_total");
    eprintln!(
        "{drafting:?}: {a} of {d} draft tokens accepted, {refed} of them on a tree's side branch"
    );
    assert!(a > 0.0 && a <= d, "{a} of {d}");
    if drafting.contains(&"--lookup") && drafting.contains(&"--draft-tree") {
        // these prompts repeat with variations: some side branch wins
        assert!(refed > 0.0, "no side branch was accepted");
    }
}

/// Prompt lookup in the server: concurrent sequences each draft from their
/// own text and verify in their decode steps.
#[test]
fn lookup_drafting_answers_as_plain_decoding() {
    let Some(model) = common::model(common::SMOLLM2) else {
        return;
    };
    drafted_answers_equal_plain(&model, &["--lookup", "8"]);
}

/// A draft model in the server: one draft engine holds a sequence per
/// request and drafts for all of them in one batch after each step (here
/// the model drafts for itself, so most drafts are accepted).
#[test]
fn draft_model_drafting_answers_as_plain_decoding() {
    let Some(model) = common::model(common::SMOLLM2) else {
        return;
    };
    let m = model.to_str().expect("utf-8 path");
    drafted_answers_equal_plain(&model, &["-md", m, "--draft-max", "6"]);
}

/// Token trees in the server: prompt lookup proposes every earlier
/// occurrence's continuation as a tree, each sequence's tree is verified
/// in the shared step with a mask of its ancestors, and an accepted side
/// branch leaves the cache and is fed again: the answers stay plain
/// decoding's.
#[test]
fn lookup_tree_drafting_answers_as_plain_decoding() {
    let Some(model) = common::model(common::SMOLLM2) else {
        return;
    };
    drafted_answers_equal_plain(&model, &["--lookup", "8", "--draft-tree", "16"]);
}

/// Token trees from the shared draft model, grown per sequence after each
/// step.
#[test]
fn draft_model_tree_drafting_answers_as_plain_decoding() {
    let Some(model) = common::model(common::SMOLLM2) else {
        return;
    };
    let m = model.to_str().expect("utf-8 path");
    drafted_answers_equal_plain(
        &model,
        &["-md", m, "--draft-max", "6", "--draft-tree", "12"],
    );
}

/// A draft model whose vocabulary is not the target's is refused at start.
#[test]
fn serve_refuses_a_draft_model_with_another_vocabulary() {
    let (Some(target), Some(draft)) =
        (common::model(common::SMOLLM2), common::model(common::QWEN2))
    else {
        return;
    };
    let out = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["serve", "-m"])
        .arg(&target)
        .arg("-md")
        .arg(&draft)
        .args(["--port", "0", "-t", "2"])
        .output()
        .expect("run strata serve");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("cannot draft for"),
        "{err}"
    );
}

/// One request must not stall the others: a flood of special tokens in a
/// chat, a chat of many messages and megabyte prompts, sent beside a short
/// request, leave its answer prompt (tokenization runs beside the engine
/// loop, never on it; a prompt too long for the context is refused before
/// it is tokenized; libllama's special-token split is linear, vendor
/// patch 0002).
#[test]
fn abusive_prompts_do_not_stall_a_short_request() {
    let Some(m) = common::model(common::SMOLLM2) else {
        return;
    };
    // a context of 8192 tokens per sequence: the flood fits the byte bound,
    // so it is tokenized (and then refused as too long)
    let s = Server::start(&m, &["--parallel", "2", "-c", "16384"]);
    let port = s.port;
    let short = br#"{"prompt":"The capital of France is","max_tokens":8,"temperature":0}"#;
    let alone = {
        let t0 = Instant::now();
        let (st, _) = http(port, "POST", "/v1/completions", short).unwrap();
        assert_eq!(st, 200);
        t0.elapsed()
    };
    let flood = format!(
        r#"{{"messages":[{{"role":"user","content":"{}"}}],"max_tokens":4}}"#,
        "<|im_start|>".repeat(48_000)
    );
    let many = format!(
        r#"{{"messages":[{}],"max_tokens":4}}"#,
        vec![r#"{"role":"user","content":"hi"}"#; 200_000].join(",")
    );
    let mega = format!(
        r#"{{"prompt":"{}","max_tokens":4}}"#,
        "lorem ipsum dolor sit amet ".repeat(1_100_000)
    );
    let bodies: Vec<(String, &str)> = vec![
        (flood, "/v1/chat/completions"),
        (many, "/v1/chat/completions"),
        (mega.clone(), "/v1/completions"),
        (mega.clone(), "/v1/completions"),
        (mega, "/v1/completions"),
    ];
    let abusers: Vec<_> = bodies
        .into_iter()
        .map(|(b, path)| std::thread::spawn(move || http(port, "POST", path, b.as_bytes())))
        .collect();
    // while they are in, the short request runs as it ran alone
    std::thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    let (st, body) = http(port, "POST", "/v1/completions", short).unwrap();
    let beside = t0.elapsed();
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
    for a in abusers {
        let (st, body) = a.join().unwrap().expect("an answer");
        let text = String::from_utf8_lossy(&body);
        assert_eq!(st, 400, "{text}");
        assert!(text.contains("context"), "{text}");
    }
    eprintln!("short request alone {alone:?}, beside the abusive ones {beside:?}");
    assert!(
        beside < alone + Duration::from_secs(3),
        "the short request took {beside:?} beside the abusive ones ({alone:?} alone)\n{}",
        s.log_text()
    );
}

/// The vendored fix of libllama's special-token split (patch 0002) keeps
/// the tokens: a flood of special tokens between text tokenizes as its
/// pieces do one by one, and 200k of them take well under the minute the
/// quadratic split took.
#[test]
fn special_token_floods_tokenize_alike_and_in_linear_time() {
    let Some(m) = common::model(common::SMOLLM2) else {
        return;
    };
    let vocab = strata::llama::LlamaModel::load(&m, true, 0).expect("vocab");
    let piece = "<|im_start|>user\nhi<|im_end|>\n";
    let one = vocab.tokenize(piece, false, true).expect("tokenize");
    let flood = vocab
        .tokenize(&piece.repeat(500), false, true)
        .expect("tokenize");
    assert_eq!(flood, one.repeat(500));
    let t0 = Instant::now();
    let big = vocab
        .tokenize(&"<|im_start|>".repeat(200_000), false, true)
        .expect("tokenize");
    let took = t0.elapsed();
    assert_eq!(big.len(), 200_000);
    assert!(
        took < Duration::from_secs(10),
        "200k special tokens took {took:?}"
    );
}

/// A raw request with the given header lines: (status, body).
fn raw(port: u16, method: &str, path: &str, headers: &[&str], body: &[u8]) -> (u16, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut head = format!(
        "{method} {path} HTTP/1.1\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    for h in headers {
        head += h;
        head += "\r\n";
    }
    head += "\r\n";
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).unwrap();
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text[9..12].parse().unwrap();
    let body = text
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, b)| b.to_string());
    (status, body)
}

/// `--api-key` (and `--api-key-file`) on every route but /health; Host
/// headers other than the loopback names refused on a loopback server
/// (DNS rebinding); POST bodies other than JSON refused (what browsers
/// send across origins); a wrong method answers 405 with a JSON error.
#[test]
fn api_keys_hosts_content_types_and_methods() {
    let Some(m) = common::model(common::SMOLLM2) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let keys = dir.path().join("keys");
    std::fs::write(&keys, "\nsecond-key\n").unwrap();
    let s = Server::start(
        &m,
        &[
            "--api-key",
            "first-key",
            "--api-key-file",
            keys.to_str().unwrap(),
        ],
    );
    let body = br#"{"prompt":"Hi","max_tokens":2}"#;
    let json = "Content-Type: application/json";
    let post = |headers: &[&str]| raw(s.port, "POST", "/v1/completions", headers, body);
    let ok = |(st, b): (u16, String)| assert_eq!(st, 200, "{b}");
    let err = |(st, b): (u16, String), want: u16, says: &str| {
        assert_eq!(st, want, "{b}");
        let v: serde_json::Value = serde_json::from_str(&b).expect("a JSON error body");
        let msg = v["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        assert!(msg.contains(says), "{msg}");
    };
    ok(post(&[
        "Host: localhost",
        json,
        "Authorization: Bearer first-key",
    ]));
    ok(post(&[
        "Host: 127.0.0.1:1234",
        json,
        "Authorization: Bearer second-key",
    ]));
    err(post(&["Host: localhost", json]), 401, "API key");
    err(
        post(&["Host: localhost", json, "Authorization: Bearer wrong"]),
        401,
        "invalid",
    );
    err(
        post(&[
            "Host: attacker.example",
            json,
            "Authorization: Bearer first-key",
        ]),
        403,
        "allowed-hosts",
    );
    err(
        post(&[
            "Host: localhost",
            "Content-Type: text/plain",
            "Authorization: Bearer first-key",
        ]),
        415,
        "application/json",
    );
    err(
        post(&["Host: localhost", "Authorization: Bearer first-key"]),
        415,
        "application/json",
    );
    let get = |path, headers: &[&str]| raw(s.port, "GET", path, headers, b"");
    ok(get("/health", &["Host: localhost"]));
    err(get("/v1/models", &["Host: localhost"]), 401, "API key");
    ok(get(
        "/v1/models",
        &["Host: localhost", "Authorization: Bearer second-key"],
    ));
    err(
        get(
            "/v1/completions",
            &["Host: localhost", "Authorization: Bearer first-key"],
        ),
        405,
        "method",
    );
    // the flags' own errors
    let bad = Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(["serve", "-m"])
        .arg(&m)
        .args(["--api-key-file", "/nonexistent/keys"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--api-key-file"));
}

/// Whether the server closed `c` (a read gives end of file or a reset)
/// within `within`.
fn closed_by_server(c: &mut TcpStream, within: Duration) -> bool {
    c.set_read_timeout(Some(within)).unwrap();
    let mut buf = [0u8; 512];
    loop {
        match c.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e)
                if e.kind() == std::io::ErrorKind::WouldBlock
                    || e.kind() == std::io::ErrorKind::TimedOut =>
            {
                return false
            }
            Err(_) => return true,
        }
    }
}

/// Slowloris and idle connections: past --max-connections new ones are
/// closed unanswered, and served again once one closes; a connection that
/// has not sent a request's headers within --timeout-headers is closed,
/// idle keep-alive ones likewise; and half-sent requests do not delay
/// SIGTERM.
#[test]
fn slow_and_idle_connections_are_closed_and_do_not_delay_sigterm() {
    let Some(m) = common::model(common::SMOLLM2) else {
        return;
    };
    let half_sent = |port: u16| {
        let mut c = TcpStream::connect(("127.0.0.1", port)).unwrap();
        c.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n")
            .unwrap();
        c
    };
    let health = b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n";

    // The cap, under a header timeout no loaded machine reaches (a timeout
    // of 1 s, then 3 s, let the first heads time out before the ninth
    // connection came on the full suite on 2 cores, and it was served).
    let s = Server::start(&m, &["--timeout-headers", "600", "--max-connections", "8"]);
    let port = s.port;
    let mut buf = [0u8; 256];
    // Eight open: seven half-sent heads and an answered keep-alive
    // connection. The place of the start's readiness probe is given back
    // by the server's task just after the probe sees its answer end; on a
    // loaded machine that can come after these connect, and one of them is
    // then refused. The accept loop takes connections in order, so once
    // the eighth is answered every earlier one's fate is known: retry the
    // set until all eight hold a place.
    let t0 = Instant::now();
    let (mut open, idle) = loop {
        let mut open: Vec<TcpStream> = (0..7).map(|_| half_sent(port)).collect();
        let mut idle = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let answered =
            idle.write_all(health).is_ok() && matches!(idle.read(&mut buf), Ok(n) if n > 0);
        if answered
            && !open
                .iter_mut()
                .any(|c| closed_by_server(c, Duration::from_millis(200)))
        {
            break (open, idle);
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "eight connections under a cap of eight were not all kept"
        );
        drop((open, idle));
        std::thread::sleep(Duration::from_millis(200));
    };
    // the ninth is closed unanswered
    let mut over = TcpStream::connect(("127.0.0.1", port)).unwrap();
    let _ = over.write_all(health);
    over.set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let mut got = Vec::new();
    let r = over.read_to_end(&mut got);
    assert!(
        got.is_empty(),
        "past the cap: {}",
        String::from_utf8_lossy(&got)
    );
    assert!(
        !matches!(&r, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock
            || e.kind() == std::io::ErrorKind::TimedOut),
        "past the cap: neither answered nor closed"
    );
    // one closes: the next is served
    drop(open.pop());
    let t0 = Instant::now();
    let served = loop {
        if let Some((200, _)) = http(port, "GET", "/health", b"") {
            break true;
        }
        if t0.elapsed() > Duration::from_secs(10) {
            break false;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(served, "not served again after a connection closed");
    drop((open, idle, s));

    // The header timeout: half-sent heads and an idle keep-alive
    // connection are closed.
    let mut s = Server::start(&m, &["--timeout-headers", "1", "--shutdown-grace", "2"]);
    let port = s.port;
    let mut slow: Vec<TcpStream> = (0..4).map(|_| half_sent(port)).collect();
    let mut idle = TcpStream::connect(("127.0.0.1", port)).unwrap();
    idle.write_all(health).unwrap();
    assert!(idle.read(&mut buf).unwrap() > 0, "an answer");
    for c in slow.iter_mut().chain([&mut idle]) {
        assert!(
            closed_by_server(c, Duration::from_secs(20)),
            "still open after the header timeout"
        );
    }
    // and the server answers again
    assert_eq!(http(port, "GET", "/health", b"").map(|r| r.0), Some(200));

    // SIGTERM with half-sent requests open: the server exits at once
    let _held: Vec<TcpStream> = (0..4).map(|_| half_sent(port)).collect();
    let t0 = Instant::now();
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(s.child.id() as i32, libc::SIGTERM) };
    let status = loop {
        if let Some(st) = s.child.try_wait().unwrap() {
            break st;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "no exit after SIGTERM\n{}",
            s.log_text()
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{}", s.log_text());
    eprintln!("exit {:?} after SIGTERM", t0.elapsed());
}

/// `--alias` names the model as clients that hard-code one ask for it, and
/// /health answers 503 while a step runs longer than `--health-stall`.
#[test]
fn aliases_and_a_stalled_engine_loop_on_health() {
    let Some(m) = common::model(common::SMOLLM2) else {
        return;
    };
    let s = Server::start(
        &m,
        &[
            "--alias",
            "gpt-4o-mini",
            "--alias",
            "local",
            "--health-stall",
            "0.3",
            "-c",
            "4096",
            "--parallel",
            "1",
        ],
    );
    let (st, body) = http(s.port, "GET", "/v1/models", b"").unwrap();
    assert_eq!(st, 200);
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let ids: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|d| d["id"].as_str())
        .collect();
    assert_eq!(ids[1..], ["gpt-4o-mini", "local"], "{v}");
    let (st, body) = http(
        s.port,
        "POST",
        "/v1/chat/completions",
        br#"{"model":"gpt-4o-mini","messages":[{"role":"user","content":"Hi"}],"max_tokens":2}"#,
    )
    .unwrap();
    assert_eq!(st, 200, "{}", String::from_utf8_lossy(&body));
    let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(v["model"], "gpt-4o-mini");
    let (st, body) = http(
        s.port,
        "POST",
        "/v1/completions",
        br#"{"model":"other","prompt":"x"}"#,
    )
    .unwrap();
    assert_eq!(st, 404);
    assert!(String::from_utf8_lossy(&body).contains("--alias"));

    // a long prompt: its steps run longer than 0.3 s on this machine
    let port = s.port;
    let long = format!(
        r#"{{"prompt":"{}","max_tokens":2}}"#,
        "the quick brown fox ".repeat(500)
    );
    let bg = std::thread::spawn(move || http(port, "POST", "/v1/completions", long.as_bytes()));
    let t0 = Instant::now();
    let mut stalled = false;
    while !bg.is_finished() && t0.elapsed() < Duration::from_secs(60) {
        if http(port, "GET", "/health", b"").map(|r| r.0) == Some(503) {
            stalled = true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let (st, _) = bg.join().unwrap().unwrap();
    assert_eq!(st, 200);
    assert!(stalled, "/health never answered 503 during the long steps");
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(http(port, "GET", "/health", b"").map(|r| r.0), Some(200));
}

/// Seeds and the prefix cache: with --batch-invariant the logits a prompt
/// ends with do not depend on how it was split, so the same request with
/// the same seed samples the same text whether its prefix came from the
/// cache or was computed (without it, ggml's kernels round by batch size
/// and a sampled answer can change; README, "Batching changes rounding").
#[test]
fn same_seed_same_text_with_and_without_a_cached_prefix() {
    let Some(m) = common::model(common::SMOLLM2) else {
        return;
    };
    let s = Server::start(&m, &["--batch-invariant", "--parallel", "2"]);
    let body = br#"{"messages":[{"role":"system","content":"You are a storyteller who writes long, vivid tales."},{"role":"user","content":"Tell me about a lighthouse."}],"max_tokens":24,"temperature":0.9,"seed":1234}"#;
    let ask = || {
        let (st, b) = http(s.port, "POST", "/v1/chat/completions", body).unwrap();
        assert_eq!(st, 200, "{}", String::from_utf8_lossy(&b));
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        (
            v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_string(),
            v["usage"]["prompt_tokens_details"]["cached_tokens"]
                .as_u64()
                .unwrap_or(0),
        )
    };
    let (first, cached_first) = ask();
    let (second, cached_second) = ask();
    assert_eq!(cached_first, 0);
    assert!(
        cached_second > 0,
        "the second request took its prefix from the cache"
    );
    assert_eq!(
        first, second,
        "same seed, cached prefix ({cached_second} tokens)"
    );
}

/// The chat answer's logprob entries, streamed (from curl's event lines)
/// or not: (token, logprob, bytes, [(token, logprob)]) each, and the text.
type Entry = (String, f64, Vec<u64>, Vec<(String, f64)>);

fn chat_entries(v: &serde_json::Value) -> Vec<Entry> {
    v["content"]
        .as_array()
        .unwrap_or_else(|| panic!("no logprobs.content: {v}"))
        .iter()
        .map(|e| {
            let bytes = e["bytes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap())
                .collect();
            let top = e["top_logprobs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| {
                    (
                        t["token"].as_str().unwrap().to_string(),
                        t["logprob"].as_f64().unwrap(),
                    )
                })
                .collect();
            (
                e["token"].as_str().unwrap().to_string(),
                e["logprob"].as_f64().unwrap(),
                bytes,
                top,
            )
        })
        .collect()
}

/// The `data:` events of a streamed answer, parsed, without `[DONE]`.
fn sse_chunks(out: &str) -> Vec<serde_json::Value> {
    let data: Vec<&str> = out
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"), "{out}");
    data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

/// `logprobs`, `top_logprobs` and `logit_bias` on both endpoints, streamed
/// and not: greedy decoding's token is its row's most likely one, every
/// logprob is <= 0 and the top 20 hold at most all the probability, the
/// stream carries what the whole answer carries, tokens cut off by a stop
/// string or an end-of-generation token get no entry, a +100 bias forces
/// its token, and bad biases answer 400 naming the key.
#[test]
fn logprobs_and_logit_bias() {
    let Some(model) = common::model(common::SMOLLM2) else {
        return;
    };
    // batch-invariant: a prompt taken from the prefix cache gives the same
    // logits as one computed, so streamed and whole answers compare exactly
    let s = Server::start(&model, &["--parallel", "2", "--batch-invariant"]);
    let post = |path: &str, body: &serde_json::Value| post_json(s.port, path, body);
    let stream = |path: &str, body: &serde_json::Value| {
        let mut body = body.clone();
        body["stream"] = true.into();
        let url = format!("{}{path}", s.url());
        let (out, err) = curl(&["-N", &url, "-d", &body.to_string()]);
        assert!(err.is_empty(), "{err}");
        sse_chunks(&out)
    };
    let chat_path = "/v1/chat/completions";
    let chat = serde_json::json!({
        "messages": [{"role": "user", "content": "Say hello in three words."}],
        "max_tokens": 48, "temperature": 0, "logprobs": true, "top_logprobs": 20,
    });
    let (st, whole) = post(chat_path, &chat);
    assert_eq!(st, 200, "{whole}");
    let choice = &whole["choices"][0];
    let text = choice["message"]["content"].as_str().unwrap();
    let entries = chat_entries(&choice["logprobs"]);
    // an end-of-generation token ends the answer without an entry
    let n = whole["usage"]["completion_tokens"].as_u64().unwrap() as usize;
    let eog = choice["finish_reason"] == "stop";
    assert_eq!(entries.len(), n - eog as usize, "{whole}");
    assert!(!entries.is_empty());
    let joined: Vec<u8> = entries
        .iter()
        .flat_map(|e| e.2.iter().map(|&b| b as u8))
        .collect();
    assert_eq!(
        String::from_utf8_lossy(&joined),
        text,
        "entries spell the text"
    );
    for (tok, lp, _, top) in &entries {
        assert_eq!(top.len(), 20, "{tok:?}");
        // greedy: the chosen token is the first alternative, and the best
        assert_eq!((&top[0].0, top[0].1), (tok, *lp), "{tok:?}: {top:?}");
        assert!(top.iter().all(|t| t.1 <= *lp), "{tok:?}: {top:?}");
        assert!(top.windows(2).all(|w| w[0].1 >= w[1].1), "{top:?}");
        assert!(*lp <= 0.0 && top.iter().all(|t| t.1 <= 0.0), "{top:?}");
        let mass: f64 = top.iter().map(|t| t.1.exp()).sum();
        assert!(
            mass <= 1.0 + 1e-5 && mass > 0.0,
            "{tok:?}: top-20 mass {mass}"
        );
    }
    // the stream: each chunk carries its own tokens' entries; together
    // the same tokens and logprobs
    let chunks = stream(chat_path, &chat);
    let mut streamed_text = String::new();
    let mut streamed = Vec::new();
    for c in &chunks {
        let ch = &c["choices"][0];
        let piece = ch["delta"]["content"].as_str().unwrap_or("");
        streamed_text.push_str(piece);
        if ch["logprobs"].is_null() {
            assert!(piece.is_empty(), "text without logprobs: {c}");
            continue;
        }
        let es = chat_entries(&ch["logprobs"]);
        let b: Vec<u8> = es
            .iter()
            .flat_map(|e| e.2.iter().map(|&b| b as u8))
            .collect();
        assert_eq!(
            String::from_utf8_lossy(&b),
            piece,
            "a chunk's entries are its text's"
        );
        streamed.extend(es);
    }
    assert_eq!(streamed_text, text);
    assert_eq!(streamed.len(), entries.len());
    for (a, b) in streamed.iter().zip(&entries) {
        assert_eq!((&a.0, &a.2), (&b.0, &b.2));
        assert!((a.1 - b.1).abs() < 1e-4, "{a:?} vs {b:?}");
        for (x, y) in a.3.iter().zip(&b.3) {
            assert!(x.0 == y.0 && (x.1 - y.1).abs() < 1e-4, "{x:?} vs {y:?}");
        }
    }
    // not asked: null, in the answer and in the stream
    let (_, plain) = post(
        chat_path,
        &serde_json::json!({"messages": chat["messages"], "max_tokens": 4, "temperature": 0}),
    );
    assert!(plain["choices"][0]["logprobs"].is_null(), "{plain}");
    assert_eq!(
        plain["choices"][0]["message"]["content"].as_str().unwrap(),
        {
            // the same greedy tokens: asking for logprobs changes nothing
            let k: Vec<u8> = entries
                .iter()
                .take(4)
                .flat_map(|e| e.2.iter().map(|&b| b as u8))
                .collect();
            String::from_utf8_lossy(&k).into_owned()
        }
    );

    // completions: tokens, token_logprobs, top_logprobs (N and the chosen
    // one), text_offset
    let cmpl_path = "/v1/completions";
    let cmpl = serde_json::json!({
        "prompt": "The three primary colors are", "max_tokens": 16, "temperature": 0,
        "logprobs": 5,
    });
    let (st, whole) = post(cmpl_path, &cmpl);
    assert_eq!(st, 200, "{whole}");
    let text = whole["choices"][0]["text"].as_str().unwrap().to_string();
    let lp = &whole["choices"][0]["logprobs"];
    let strs = |v: &serde_json::Value| -> Vec<String> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap().to_string())
            .collect()
    };
    let tokens = strs(&lp["tokens"]);
    let logprobs: Vec<f64> = lp["token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    let offsets: Vec<u64> = lp["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    let n = whole["usage"]["completion_tokens"].as_u64().unwrap() as usize;
    let eog = whole["choices"][0]["finish_reason"] == "stop";
    assert_eq!(tokens.len(), n - eog as usize, "{whole}");
    assert!(tokens.len() >= 8, "long enough for the stop test: {whole}");
    assert_eq!(
        (logprobs.len(), offsets.len()),
        (tokens.len(), tokens.len())
    );
    assert_eq!(tokens.concat(), text);
    let mut at = 0;
    for (i, t) in tokens.iter().enumerate() {
        assert_eq!(offsets[i], at, "text_offset of {t:?}");
        at += t.chars().count() as u64;
        let top = lp["top_logprobs"][i].as_object().unwrap();
        assert!((1..=6).contains(&top.len()), "{top:?}");
        let best = top
            .values()
            .map(|v| v.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        assert_eq!(top[t].as_f64(), Some(logprobs[i]), "{t:?} in {top:?}");
        assert_eq!(best, logprobs[i], "greedy takes the best of {top:?}");
        assert!(logprobs[i] <= 0.0);
    }
    let chunks = stream(cmpl_path, &cmpl);
    let (mut st_tokens, mut st_lps, mut st_offsets) = (Vec::new(), Vec::new(), Vec::new());
    for c in &chunks {
        let l = &c["choices"][0]["logprobs"];
        if l.is_null() {
            continue;
        }
        st_tokens.extend(strs(&l["tokens"]));
        st_lps.extend(
            l["token_logprobs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap()),
        );
        st_offsets.extend(
            l["text_offset"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap()),
        );
    }
    assert_eq!((&st_tokens, &st_offsets), (&tokens, &offsets));
    for (a, b) in st_lps.iter().zip(&logprobs) {
        assert!((a - b).abs() < 1e-4, "{a} vs {b}");
    }
    assert_eq!(st_lps.len(), logprobs.len());

    // a stop string: tokens whose text begins before it keep their entries,
    // the ones inside it have none
    let stop: String = tokens[5..7].concat();
    let cut = text[..text.find(&stop).unwrap()].chars().count() as u64;
    let want = offsets.iter().filter(|&&o| o < cut).count();
    let mut stopped = cmpl.clone();
    stopped["stop"] = stop.clone().into();
    let (_, v) = post(cmpl_path, &stopped);
    let whole_stopped = (
        v["choices"][0]["text"].as_str().unwrap().to_string(),
        strs(&v["choices"][0]["logprobs"]["tokens"]),
    );
    let mut streamed_stopped = (String::new(), Vec::new());
    for c in stream(cmpl_path, &stopped) {
        let ch = &c["choices"][0];
        streamed_stopped.0.push_str(ch["text"].as_str().unwrap());
        if !ch["logprobs"].is_null() {
            streamed_stopped.1.extend(strs(&ch["logprobs"]["tokens"]));
        }
    }
    for (got_text, got) in [whole_stopped, streamed_stopped] {
        assert_eq!(got, &tokens[..want], "stop {stop:?}");
        assert_eq!(got_text, &text[..text.find(&stop).unwrap()]);
    }

    // logit_bias: +100 on one token makes greedy decoding take it every
    // time, on both endpoints; the logprob reported is the model's own
    let forced = serde_json::json!({"1000": 100});
    let mut b = cmpl.clone();
    b["logit_bias"] = forced.clone();
    b["max_tokens"] = 4.into();
    let (st, v) = post(cmpl_path, &b);
    assert_eq!(st, 200, "{v}");
    let t4 = strs(&v["choices"][0]["logprobs"]["tokens"]);
    assert_eq!(t4.len(), 4);
    assert!(t4.iter().all(|t| *t == t4[0]), "{t4:?}");
    assert_ne!(t4[0], tokens[0], "the bias changed the first token");
    let mut c = serde_json::json!({
        "messages": chat["messages"], "max_tokens": 3, "temperature": 0, "logit_bias": forced,
    });
    let (st, v) = post(chat_path, &c);
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        v["choices"][0]["message"]["content"],
        t4[0].repeat(3),
        "{v}"
    );
    // sampled at a high temperature, too
    c["temperature"] = 1.5.into();
    c["seed"] = 7.into();
    let (_, v) = post(chat_path, &c);
    assert_eq!(
        v["choices"][0]["message"]["content"],
        t4[0].repeat(3),
        "{v}"
    );

    // bad biases and logprob counts: 400 naming the key
    for (path, body, says) in [
        (
            cmpl_path,
            r#"{"prompt":"x","logit_bias":{"99999999":5}}"#,
            "\"99999999\"",
        ),
        (
            cmpl_path,
            r#"{"prompt":"x","logit_bias":{"49152":5}}"#,
            "\"49152\"",
        ),
        (
            cmpl_path,
            r#"{"prompt":"x","logit_bias":{"ten":5}}"#,
            "\"ten\"",
        ),
        (
            chat_path,
            r#"{"messages":[{"role":"user","content":"x"}],"logit_bias":{"12":-101}}"#,
            "\"12\"",
        ),
        (
            chat_path,
            r#"{"messages":[{"role":"user","content":"x"}],"logit_bias":{"12":"a"}}"#,
            "\"12\"",
        ),
        (
            chat_path,
            r#"{"messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":21}"#,
            "top_logprobs",
        ),
        (
            chat_path,
            r#"{"messages":[{"role":"user","content":"x"}],"top_logprobs":2}"#,
            "needs logprobs",
        ),
        (cmpl_path, r#"{"prompt":"x","logprobs":21}"#, "logprobs"),
    ] {
        let (st, b) = http(s.port, "POST", path, body.as_bytes()).expect("an answer");
        let b = String::from_utf8_lossy(&b);
        assert_eq!(st, 400, "{body}: {b}");
        let v: serde_json::Value = serde_json::from_str(&b).unwrap();
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains(says), "{body}: {msg}");
    }

    // the openai client reads them
    if let Some(py) = python() {
        s.run_py(&py, "logprobs.py");
    }

    // sampled: the logprobs are those of the distribution the token was
    // drawn from, here the 5 tokens top-k keeps at temperature 0.7, so the
    // top 5 hold all of it and the chosen token is among them
    let sampled = serde_json::json!({
        "messages": [{"role": "user", "content": "Write a short story about a cat."}],
        "max_tokens": 24, "temperature": 0.7, "top_k": 5, "seed": 3,
        "logprobs": true, "top_logprobs": 5,
    });
    let (st, v) = post(chat_path, &sampled);
    assert_eq!(st, 200, "{v}");
    let entries = chat_entries(&v["choices"][0]["logprobs"]);
    assert!(entries.len() >= 8, "{v}");
    for (tok, lp, _, top) in &entries {
        let mass: f64 = top.iter().map(|(_, l)| l.exp()).sum();
        assert!(
            (mass - 1.0).abs() < 1e-3,
            "the kept tokens' mass {mass}: {top:?}"
        );
        let own = top.iter().find(|(t, _)| t == tok).map(|(_, l)| *l);
        assert_eq!(own, Some(*lp), "{tok:?} among {top:?}");
    }
    // at temperature 2 the same five share the mass more evenly than at
    // 0.7: the temperature is in the numbers
    let spread = |t: f64| {
        let mut b = sampled.clone();
        b["temperature"] = t.into();
        b["max_tokens"] = 1.into();
        let (_, v) = post(chat_path, &b);
        let e = chat_entries(&v["choices"][0]["logprobs"]);
        e[0].3.iter().map(|(_, l)| *l).fold(f64::INFINITY, f64::min)
    };
    assert!(spread(2.0) > spread(0.7), "the least likely of the five");

    // drafting: a token accepted from a draft reports its own row's
    // logprobs, the ones plain decoding reports
    let rep = serde_json::json!({
        "prompt": DRAFT_PROMPTS[2], "max_tokens": 24, "temperature": 0, "logprobs": 3,
    });
    let plain = post(cmpl_path, &rep).1;
    drop(s);
    let s = Server::start(
        &model,
        &[
            "--parallel",
            "2",
            "--batch-invariant",
            "--lookup",
            "8",
            "--draft-fixed",
        ],
    );
    let (st, b) = http(s.port, "POST", cmpl_path, rep.to_string().as_bytes()).unwrap();
    assert_eq!(st, 200);
    let drafted: serde_json::Value = serde_json::from_slice(&b).unwrap();
    let (p, d) = (
        &plain["choices"][0]["logprobs"],
        &drafted["choices"][0]["logprobs"],
    );
    assert_eq!(p["tokens"], d["tokens"]);
    let lps = |v: &serde_json::Value| -> Vec<f64> {
        v["token_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect()
    };
    let (lp, ld) = (lps(p), lps(d));
    assert_eq!(lp.len(), ld.len());
    for (i, (a, b)) in lp.iter().zip(&ld).enumerate() {
        assert!((a - b).abs() < 1e-4, "token {i}: {a} vs {b}");
        let (tp, td) = (&p["top_logprobs"][i], &d["top_logprobs"][i]);
        assert_eq!(
            tp.as_object().unwrap().keys().collect::<Vec<_>>(),
            td.as_object().unwrap().keys().collect::<Vec<_>>()
        );
    }
    let accepted = s.metric("strata_draft_accepted_total");
    assert!(accepted > 0.0, "some drafts were accepted");
}

/// Whether `text` is JSON or could become JSON with more text: serde stops
/// at its end (EOF), not at a syntax error.
fn json_prefix(text: &str) -> bool {
    match serde_json::from_str::<serde_json::Value>(text) {
        Ok(_) => true,
        Err(e) => e.is_eof(),
    }
}

/// `response_format: {"type": "json_schema", ...}`: for schemas with
/// nested objects, arrays, enums, integers, numbers, booleans, null and
/// anyOf, greedy and sampled answers (SmolLM2, chat and completion) that
/// the model ended validate against the schema (jsonschema crate); one cut
/// by max_tokens is a prefix of JSON; each schema gets at least one ended
/// answer; a schema the converter refuses answers 400 naming it.
#[test]
fn response_format_json_schema() {
    let Some(model) = common::model(common::SMOLLM2) else {
        return;
    };
    let s = Server::start(&model, &["--parallel", "2"]);
    let post = |path: &str, body: &serde_json::Value| post_json(s.port, path, body);
    let schemas = [
        serde_json::json!({
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 12},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                "address": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string", "maxLength": 12},
                        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}
                    },
                    "required": ["city", "zip"],
                    "additionalProperties": false
                }
            },
            "required": ["name", "age", "address"],
            "additionalProperties": false
        }),
        serde_json::json!({
            "type": "object",
            "properties": {
                "colors": {
                    "type": "array",
                    "items": {"enum": ["red", "green", "blue"]},
                    "minItems": 1,
                    "maxItems": 3
                }
            },
            "required": ["colors"],
            "additionalProperties": false
        }),
        serde_json::json!({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4}),
        serde_json::json!({
            "type": "object",
            "properties": {
                "ok": {"type": "boolean"},
                "score": {"type": "number"},
                "tag": {"anyOf": [{"type": "null"}, {"enum": ["x", "y"]}]}
            },
            "required": ["ok", "score", "tag"],
            "additionalProperties": false
        }),
    ];
    for (i, schema) in schemas.iter().enumerate() {
        let validator = jsonschema::validator_for(schema).expect("a valid schema");
        let rf = serde_json::json!({
            "type": "json_schema",
            "json_schema": {"name": format!("s{i}"), "strict": true, "schema": schema},
        });
        let chat = serde_json::json!({
            "messages": [{"role": "user", "content": "Answer in JSON."}],
            "max_tokens": 160, "response_format": rf,
        });
        let cmpl = serde_json::json!({
            "prompt": "Here is the JSON:", "max_tokens": 160, "response_format": rf,
        });
        let mut ended = 0;
        for (path, body) in [("/v1/chat/completions", &chat), ("/v1/completions", &cmpl)] {
            for seed in [None, Some(1), Some(2)] {
                let mut b = body.clone();
                match seed {
                    None => b["temperature"] = 0.into(),
                    Some(x) => {
                        b["temperature"] = 1.0.into();
                        b["seed"] = x.into();
                    }
                }
                let (st, v) = post(path, &b);
                assert_eq!(st, 200, "{v}");
                let c = &v["choices"][0];
                let text = c["message"]["content"]
                    .as_str()
                    .or(c["text"].as_str())
                    .expect("text");
                let finish = c["finish_reason"].as_str().expect("finish_reason");
                let what = format!("schema {i} {path} seed {seed:?} ({finish}): {text:?}");
                eprintln!("{what}");
                match finish {
                    "stop" => {
                        let answer: serde_json::Value = serde_json::from_str(text)
                            .unwrap_or_else(|e| panic!("{what}: not JSON ({e})"));
                        let errors: Vec<String> = validator
                            .iter_errors(&answer)
                            .map(|e| e.to_string())
                            .collect();
                        assert!(errors.is_empty(), "{what}: {errors:?}");
                        ended += 1;
                    }
                    "length" => assert!(json_prefix(text), "{what}: not a JSON prefix"),
                    f => panic!("{what}: finish_reason {f}"),
                }
            }
        }
        assert!(ended > 0, "schema {i}: no answer ended");
    }
    let mut b = serde_json::json!({"prompt": "x", "max_tokens": 4});
    b["response_format"] = serde_json::json!({
        "type": "json_schema",
        "json_schema": {"name": "bad", "schema": {"$ref": "#/$defs/missing"}},
    });
    let (st, v) = post("/v1/completions", &b);
    assert_eq!(st, 400, "{v}");
    let m = v["error"]["message"].as_str().unwrap();
    assert!(m.contains("response_format: JSON schema"), "{m}");
}

/// Function calling with Qwen2.5-Coder-0.5B (its template lists tools
/// and writes calls in `<tool_call>` tags): a named tool_choice and
/// "required" return `tool_calls` whose arguments validate against the
/// function's parameters (finish_reason "tool_calls", content null), the
/// same streamed; "auto" answers with content or calls that validate; the
/// assistant's call and the tool's result sent back are in the prompt (its
/// token count grows with them and with a longer result; with
/// tool_choice "none" no call is read); SmolLM2's template, which renders
/// no tools, is refused.
#[test]
fn tool_calls() {
    let Some(model) = common::model(common::QWEN2) else {
        return;
    };
    let s = Server::start(&model, &["--parallel", "2"]);
    let post = |port: u16, body: &serde_json::Value| post_json(port, "/v1/chat/completions", body);
    let weather_params = serde_json::json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"enum": ["celsius", "fahrenheit"]}
        },
        "required": ["city", "unit"],
        "additionalProperties": false
    });
    let time_params = serde_json::json!({
        "type": "object",
        "properties": {"timezone": {"type": "string", "maxLength": 20}},
        "required": ["timezone"],
        "additionalProperties": false
    });
    let tools = serde_json::json!([
        {"type": "function", "function": {"name": "get_weather",
            "description": "The current weather of a city", "parameters": weather_params}},
        {"type": "function", "function": {"name": "get_time",
            "description": "The current time in a timezone", "parameters": time_params}},
    ]);
    let validators = [
        (
            "get_weather",
            jsonschema::validator_for(&weather_params).unwrap(),
        ),
        ("get_time", jsonschema::validator_for(&time_params).unwrap()),
    ];
    let check_calls = |v: &serde_json::Value, what: &str| -> Vec<(String, serde_json::Value)> {
        let c = &v["choices"][0];
        let calls = c["message"]["tool_calls"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let mut out = Vec::new();
        for call in &calls {
            assert_eq!(call["type"], "function", "{what}: {v}");
            assert!(
                call["id"].as_str().is_some_and(|i| !i.is_empty()),
                "{what}: {v}"
            );
            let name = call["function"]["name"].as_str().expect("name").to_string();
            let args: serde_json::Value =
                serde_json::from_str(call["function"]["arguments"].as_str().expect("a string"))
                    .unwrap_or_else(|e| panic!("{what}: arguments not JSON ({e}): {v}"));
            let (_, val) = validators
                .iter()
                .find(|(n, _)| *n == name)
                .expect("a listed tool");
            let errors: Vec<String> = val.iter_errors(&args).map(|e| e.to_string()).collect();
            assert!(errors.is_empty(), "{what}: {errors:?} in {args}");
            out.push((name, args));
        }
        out
    };
    let user =
        serde_json::json!({"role": "user", "content": "What is the weather in Paris, in celsius?"});
    // a named function, greedy and sampled
    for seed in [None, Some(3)] {
        let mut b = serde_json::json!({
            "messages": [user], "tools": tools, "max_tokens": 100,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        });
        match seed {
            None => b["temperature"] = 0.into(),
            Some(x) => {
                b["temperature"] = 1.0.into();
                b["seed"] = x.into();
            }
        }
        let (st, v) = post(s.port, &b);
        assert_eq!(st, 200, "{v}");
        eprintln!("named, seed {seed:?}: {v}");
        let c = &v["choices"][0];
        assert_eq!(c["finish_reason"], "tool_calls", "{v}");
        assert!(c["message"]["content"].is_null(), "{v}");
        let calls = check_calls(&v, "named");
        assert_eq!(calls.len(), 1, "{v}");
        assert_eq!(calls[0].0, "get_weather");
    }
    // required: one of the two, and the same streamed
    let req = serde_json::json!({
        "messages": [{"role": "user", "content": "What time is it in Tokyo?"}],
        "tools": tools, "tool_choice": "required", "max_tokens": 100, "temperature": 0,
    });
    let (st, v) = post(s.port, &req);
    assert_eq!(st, 200, "{v}");
    eprintln!("required: {v}");
    assert_eq!(v["choices"][0]["finish_reason"], "tool_calls", "{v}");
    let calls = check_calls(&v, "required");
    assert_eq!(calls.len(), 1, "{v}");
    let mut sb = req.clone();
    sb["stream"] = true.into();
    let (out, err) = curl(&[
        "-N",
        &format!("{}/v1/chat/completions", s.url()),
        "-d",
        &sb.to_string(),
    ]);
    assert!(err.is_empty(), "{err}");
    let chunks = sse_chunks(&out);
    let last = chunks.last().expect("a chunk");
    assert_eq!(last["choices"][0]["finish_reason"], "tool_calls", "{out}");
    // the call in a chunk of its own, before the last
    let with_calls: Vec<&serde_json::Value> = chunks
        .iter()
        .filter(|c| c["choices"][0]["delta"].get("tool_calls").is_some())
        .collect();
    assert_eq!(with_calls.len(), 1, "{out}");
    assert!(
        with_calls[0]["choices"][0]["finish_reason"].is_null(),
        "{out}"
    );
    let streamed = &with_calls[0]["choices"][0]["delta"]["tool_calls"][0];
    assert_eq!(streamed["index"], 0, "{out}");
    assert_eq!(
        streamed["function"], v["choices"][0]["message"]["tool_calls"][0]["function"],
        "{out}"
    );
    // auto: whatever the model does, calls validate
    let (st, v) = post(
        s.port,
        &serde_json::json!({"messages": [user], "tools": tools, "max_tokens": 100, "temperature": 0}),
    );
    assert_eq!(st, 200, "{v}");
    eprintln!("auto: {v}");
    let calls = check_calls(&v, "auto");
    let finish = v["choices"][0]["finish_reason"].as_str().unwrap();
    assert_eq!(finish == "tool_calls", !calls.is_empty(), "{v}");
    // streamed (greedy: the same answer): its content and calls add up to it
    let (out, err) = curl(&[
        "-N",
        &format!("{}/v1/chat/completions", s.url()),
        "-d",
        &serde_json::json!({"messages": [user], "tools": tools, "max_tokens": 100, "temperature": 0,
            "stream": true})
        .to_string(),
    ]);
    assert!(err.is_empty(), "{err}");
    let chunks = sse_chunks(&out);
    let deltas: Vec<&serde_json::Value> =
        chunks.iter().map(|c| &c["choices"][0]["delta"]).collect();
    let content: String = deltas
        .iter()
        .filter_map(|d| d["content"].as_str())
        .collect();
    let streamed_calls: Vec<&serde_json::Value> = deltas
        .iter()
        .filter_map(|d| d["tool_calls"].as_array())
        .flatten()
        .collect();
    let words = |s: &str| s.split_whitespace().collect::<Vec<_>>().join(" ");
    assert_eq!(
        words(&content),
        words(v["choices"][0]["message"]["content"].as_str().unwrap_or("")),
        "{out}"
    );
    let message_calls = v["choices"][0]["message"]["tool_calls"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(streamed_calls.len(), message_calls.len(), "{out}");
    for (i, (a, b)) in streamed_calls.iter().zip(&message_calls).enumerate() {
        assert_eq!(a["index"], i, "{out}");
        assert_eq!(a["function"], b["function"], "{out}");
    }
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        finish,
        "{out}"
    );
    // the call and its result go back into the prompt
    let call_id = "call-1";
    let conversation = |result: &str| {
        serde_json::json!({
            "messages": [
                user,
                {"role": "assistant", "content": null, "tool_calls": [{"id": call_id, "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}]},
                {"role": "tool", "tool_call_id": call_id, "content": result},
            ],
            "tools": tools, "tool_choice": "none", "max_tokens": 24, "temperature": 0,
        })
    };
    let (st, sunny) = post(s.port, &conversation("Sunny, 31 degrees celsius."));
    assert_eq!(st, 200, "{sunny}");
    let (_, snow) = post(
        s.port,
        &conversation("Heavy snow all day long, minus 12 degrees celsius."),
    );
    eprintln!("after the tool: {sunny}\n{snow}");
    let tokens = |v: &serde_json::Value| v["usage"]["prompt_tokens"].as_u64().unwrap();
    let (_, bare) = post(
        s.port,
        &serde_json::json!({"messages": [user], "tools": tools, "tool_choice": "none", "max_tokens": 1}),
    );
    assert!(
        tokens(&sunny) > tokens(&bare) + 20,
        "the call and result are in the prompt: {sunny} {bare}"
    );
    assert!(tokens(&snow) > tokens(&sunny), "{snow} {sunny}");
    assert!(
        sunny["choices"][0]["message"]["tool_calls"].is_null(),
        "tool_choice none: {sunny}"
    );
    // a template without tools is refused
    let Some(smol) = common::model(common::SMOLLM2) else {
        return;
    };
    let t = Server::start(&smol, &[]);
    let (st, v) = post(
        t.port,
        &serde_json::json!({"messages": [user], "tools": tools, "tool_choice": "required"}),
    );
    assert_eq!(st, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("renders no tools"),
        "{v}"
    );
}

/// POSTs `body` to `path` and returns the status and the JSON answer.
fn post_json(port: u16, path: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
    let (st, b) = http(port, "POST", path, body.to_string().as_bytes()).expect("answer");
    let v: serde_json::Value = serde_json::from_slice(&b)
        .unwrap_or_else(|_| panic!("not JSON: {}", String::from_utf8_lossy(&b)));
    (st, v)
}

/// An answer under `response_format` json_object: a JSON object when the
/// model ended it ("stop"), else cut by max_tokens ("length") and a prefix
/// of one.
fn check_json_answer(text: &str, finish: &str, what: &str) {
    match finish {
        "stop" => {
            let v: serde_json::Value = serde_json::from_str(text)
                .unwrap_or_else(|e| panic!("{what}: not JSON ({e}): {text:?}"));
            assert!(v.is_object(), "{what}: {text:?}");
        }
        "length" => assert!(json_prefix(text), "{what}: not a JSON prefix: {text:?}"),
        f => panic!("{what}: finish_reason {f:?}"),
    }
}

/// `response_format: {"type": "json_object"}` on both endpoints, streamed
/// and not, at temperature 0 and 1: the answer is JSON (or, cut by
/// max_tokens, a prefix of JSON); a prompt that does not ask for JSON
/// still gets an object; streaming gives greedy decoding's text; prompt
/// lookup drafting answers as plain decoding; other types answer 400.
#[test]
fn response_format_json_object() {
    let Some(model) = common::model(common::SMOLLM2) else {
        return;
    };
    let s = Server::start(&model, &["--parallel", "2", "--batch-invariant"]);
    let post = post_json;
    let chat_path = "/v1/chat/completions";
    let cmpl_path = "/v1/completions";
    let text_of = |v: &serde_json::Value| {
        let c = &v["choices"][0];
        let t = c["message"]["content"].as_str().or(c["text"].as_str());
        (
            t.expect("text").to_string(),
            c["finish_reason"].as_str().unwrap().to_string(),
        )
    };
    let fmt = serde_json::json!({"type": "json_object"});
    let chat = serde_json::json!({
        "messages": [
            {"role": "system", "content": "You answer in JSON only."},
            {"role": "user", "content": "Describe a cat as a JSON object with the keys name, age and color."},
        ],
        "max_tokens": 200, "temperature": 0, "response_format": fmt,
    });
    let (st, whole) = post(s.port, chat_path, &chat);
    assert_eq!(st, 200, "{whole}");
    let (greedy, finish) = text_of(&whole);
    eprintln!("greedy chat ({finish}): {greedy}");
    check_json_answer(&greedy, &finish, "greedy chat");
    // streamed: the same text and finish
    let mut body = chat.clone();
    body["stream"] = true.into();
    let (out, err) = curl(&[
        "-N",
        &format!("{}{chat_path}", s.url()),
        "-d",
        &body.to_string(),
    ]);
    assert!(err.is_empty(), "{err}");
    let chunks = sse_chunks(&out);
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    let last = chunks.last().unwrap()["choices"][0]["finish_reason"].clone();
    assert_eq!(
        (streamed.as_str(), last.as_str()),
        (greedy.as_str(), Some(finish.as_str()))
    );
    // sampled, several seeds
    let mut stops = usize::from(finish == "stop");
    for seed in 1..=3 {
        let mut b = chat.clone();
        b["temperature"] = 1.0.into();
        b["seed"] = seed.into();
        let (st, v) = post(s.port, chat_path, &b);
        assert_eq!(st, 200, "{v}");
        let (t, f) = text_of(&v);
        eprintln!("seed {seed} ({f}): {t}");
        check_json_answer(&t, &f, &format!("seed {seed}"));
        stops += usize::from(f == "stop");
    }
    assert!(stops > 0, "no answer closed its JSON object");
    // a completion prompt that asks for no JSON gets an object all the same
    let cmpl = serde_json::json!({
        "prompt": "The capital of France is", "max_tokens": 200, "temperature": 0,
    });
    let (_, plain) = post(s.port, cmpl_path, &cmpl);
    let (plain_text, _) = text_of(&plain);
    assert!(!plain_text.trim_start().starts_with('{'), "{plain_text:?}");
    let mut jc = cmpl.clone();
    jc["response_format"] = fmt.clone();
    let (st, v) = post(s.port, cmpl_path, &jc);
    assert_eq!(st, 200, "{v}");
    let (t, f) = text_of(&v);
    eprintln!("completion ({f}): {t}");
    assert!(t.starts_with('{'), "{t:?}");
    check_json_answer(&t, &f, "completion");
    let mut b = jc.clone();
    b["stream"] = true.into();
    let (out, _) = curl(&[
        "-N",
        &format!("{}{cmpl_path}", s.url()),
        "-d",
        &b.to_string(),
    ]);
    let streamed: String = sse_chunks(&out)
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(streamed, t);
    // max_tokens cuts the object: "length", a JSON prefix
    let mut short = chat.clone();
    short["max_tokens"] = 5.into();
    let (_, v) = post(s.port, chat_path, &short);
    let (t5, f5) = text_of(&v);
    assert_eq!(f5, "length", "{v}");
    assert!(greedy.starts_with(&t5), "{t5:?} begins {greedy:?}");
    assert!(json_prefix(&t5), "{t5:?}");
    assert!(
        serde_json::from_str::<serde_json::Value>(&t5).is_err(),
        "an object cut short: {t5:?}"
    );
    // other types: 400 naming what is supported
    for (path, mut b) in [(chat_path, chat.clone()), (cmpl_path, cmpl.clone())] {
        b["response_format"] = serde_json::json!({"type": "xml"});
        let (st, v) = post(s.port, path, &b);
        assert_eq!(st, 400, "{v}");
        let m = v["error"]["message"].as_str().unwrap();
        assert!(m.contains("\"json_schema\""), "{m}");
    }
    // prompt lookup drafting: the same greedy answers
    let d = Server::start(
        &model,
        &[
            "--parallel",
            "2",
            "--batch-invariant",
            "--draft-fixed",
            "--lookup",
            "8",
        ],
    );
    let (_, v) = post(d.port, chat_path, &chat);
    assert_eq!(text_of(&v), (greedy.clone(), finish.clone()));
    let (_, v) = post(d.port, cmpl_path, &jc);
    assert_eq!(text_of(&v).0, t);
}

/// A mixture with hot experts (`--hot-experts 2`, forced without counts:
/// the first experts of each layer): the host's layers count the router's
/// picks as requests run, the server re-chooses the hot sets from them
/// once it is idle (the metrics count the layers and bytes), answers the
/// same prompt alike before and after, and on SIGTERM adds the counts to
/// the file beside the model.
#[test]
fn hot_experts_are_rechosen_between_requests_and_counts_saved() {
    let Some(vocab) = common::model(common::SMOLLM2) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tmp");
    let path = common::synth_moe(dir.path(), &vocab, 1.0);
    let counts = dir.path().join("counts.json");
    let s = Server::start(
        &path,
        &[
            "--device",
            "cpu",
            "--stream-all",
            "--hybrid",
            "4",
            "--no-repack",
            "--hot-experts",
            "2",
            "--expert-counts",
            counts.to_str().unwrap(),
            "-c",
            "1024",
        ],
    );
    let p = "The river runs past old stone mills where the town keeps its grain";
    let first = ask_greedy(s.port, p);
    let t0 = Instant::now();
    while s.metric("strata_hot_refreshes_total") < 1.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "no refresh: {}",
            s.log_text()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(s.metric("strata_hot_refresh_bytes_total") > 0.0);
    assert!(s.metric("strata_expert_picks_total") > 0.0);
    assert_eq!(ask_greedy(s.port, p), first, "{}", s.log_text());
    assert!(s.metric("strata_expert_hot_picks_total") > 0.0);
    assert!(!counts.exists(), "counts written before the server stopped");
    let mut s = s;
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(s.child.id() as i32, libc::SIGTERM) };
    let status = s.child.wait().unwrap();
    assert!(status.success(), "exit {status:?}: {}", s.log_text());
    let log = s.log_text();
    assert!(log.contains("router counts saved to"), "{log}");
    let c = strata::paging::routing::RouterCounts::from_json(
        &std::fs::read_to_string(&counts).expect("counts file"),
    )
    .expect("counts parse");
    assert!(c.picks() > 0);
}
