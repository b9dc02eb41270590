//! Remote devices through ggml's RPC backend, on this machine: `strata
//! rpc-server` on 127.0.0.1 offering its CPU, strata computing on that
//! device (`--device rpc --rpc 127.0.0.1:PORT`): greedy tokens and logits
//! equal to the local CPU's, with every group resident and with every group
//! streamed; an unreachable server and a server killed mid-run end the
//! client with a clear error, not a hang; a non-loopback address is refused
//! without --allow-remote.

mod common;

use common::model;
use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use strata::engine::{DeviceChoice, Engine, EngineConfig, PagingOptions};
use strata::llama::LlamaModel;

const STRATA: &str = env!("CARGO_BIN_EXE_strata");

/// A `strata rpc-server` offering this machine's CPU on a free port,
/// killed when dropped.
struct Server {
    child: Child,
    port: u16,
}

impl Server {
    fn start() -> Server {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let child = Command::new(STRATA)
            .args(["rpc-server", "--device", "cpu", "-t", "2", "--port"])
            .arg(port.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("strata rpc-server starts");
        let t0 = Instant::now();
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "rpc-server never listened"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Server { child, port }
    }
    fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn a_remote_cpu_gives_the_local_cpus_tokens_and_logits() {
    let Some(path) = model(common::SMOLLM2) else {
        return;
    };
    let server = Server::start();
    let vocab = LlamaModel::load(&path, true, 0).expect("vocabulary");
    let prompt = vocab
        .tokenize("The capital of France is", true, true)
        .expect("tokenize");
    let mut local = Engine::load(&path, &common::cpu_cfg()).expect("local engine");
    let want = strata::parity::run_strata(&mut local, &prompt, 16).expect("local run");
    for stream_all in [false, true] {
        let cfg = EngineConfig {
            device: DeviceChoice::Remote,
            rpc: vec![server.endpoint()],
            paging: PagingOptions {
                stream_all,
                ..PagingOptions::default()
            },
            ..common::cpu_cfg()
        };
        let mut remote = Engine::load(&path, &cfg).expect("engine on the remote device");
        assert!(remote.device().is_remote());
        assert_eq!(remote.plan.placement.n_streamed() > 0, stream_all);
        let got = strata::parity::run_strata(&mut remote, &prompt, 16).expect("remote run");
        let (worst, _) = strata::parity::compare(&got, &want);
        eprintln!("streamed={stream_all}: worst NMSE {worst:.3e}");
        assert_eq!(got.tokens, want.tokens, "streamed={stream_all}");
        assert!(worst <= 1e-4, "streamed={stream_all}: NMSE {worst}");
    }
}

/// Runs `strata run` on the remote device; returns its exit code (None
/// when a signal ended it, or it was still running after `limit` and was
/// killed), its stderr and how long it took.
fn run_remote(
    endpoint: &str,
    path: &std::path::Path,
    n: usize,
    limit: Duration,
) -> (Option<i32>, String, Duration) {
    let mut child = Command::new(STRATA)
        .args([
            "run",
            "--device",
            "rpc",
            "--rpc",
            endpoint,
            "--stream-all",
            "-c",
            "512",
            "--temp",
            "0",
        ])
        .args(["-n", &n.to_string(), "-p", "Once upon a time"])
        .arg("-m")
        .arg(path)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("strata run starts");
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break Some(s.code());
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut err)
        .ok();
    (status.flatten(), err, t0.elapsed())
}

#[test]
fn lost_and_unreachable_servers_end_the_run_with_an_error() {
    let Some(path) = model(common::SMOLLM2) else {
        return;
    };
    // nothing listens
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let (code, err, _) = run_remote(
        &format!("127.0.0.1:{port}"),
        &path,
        4,
        Duration::from_secs(60),
    );
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("cannot reach the RPC server") && err.contains(&port.to_string()),
        "{err}"
    );
    // a malformed endpoint
    let (code, err, _) = run_remote("localhost", &path, 4, Duration::from_secs(60));
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("HOST:PORT"), "{err}");
    // the server dies while the client generates: the client ends, saying so
    let mut server = Server::start();
    let endpoint = server.endpoint();
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(4));
        let _ = server.child.kill();
        let _ = server.child.wait();
    });
    let (code, err, took) = run_remote(&endpoint, &path, 100_000, Duration::from_secs(120));
    killer.join().unwrap();
    assert!(
        took < Duration::from_secs(100),
        "the client hung after its server died: {err}"
    );
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("error: ggml:") && err.contains("RPC server"),
        "{err}"
    );
}

#[test]
fn rpc_server_refuses_a_public_address_without_allow_remote() {
    let out = Command::new(STRATA)
        .args(["rpc-server", "--host", "0.0.0.0", "--port", "1"])
        .output()
        .expect("runs");
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--allow-remote") && err.contains("authentication"),
        "{err}"
    );
}
