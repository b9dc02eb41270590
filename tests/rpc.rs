//! Remote devices through ggml's RPC backend, on this machine: `strata
//! rpc-server` on 127.0.0.1 offering its CPU, strata computing on that
//! device (`--device rpc --rpc 127.0.0.1:PORT`): greedy tokens and logits
//! equal to the local CPU's, with every group resident and with every group
//! streamed; an unreachable server and a server killed mid-run end the
//! client with a clear error, not a hang; a non-loopback address is refused
//! without --allow-remote. Two servers: the model's layers split across
//! their devices (`--devices 0,1`) give one device's tokens, plain and
//! streamed, with the KV cache tiered, and a server lost mid-run ends the
//! run with an error; token trees over either split equal plain decoding.

mod common;

use common::model;
use std::io::Read;
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use strata::engine::{DeviceChoice, Engine, EngineConfig, Hybrid, PagingOptions};
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

#[test]
fn layers_split_across_two_remote_devices_give_one_devices_tokens() {
    let Some(path) = model(common::SMOLLM2) else {
        return;
    };
    let (a, b) = (Server::start(), Server::start());
    let (prompt, mut local, want) = local_reference(&path);
    let n_layer = local.spec.hp.n_layer;
    // resident; streamed; streamed with every layer's KV in the host tier
    for (stream_all, kv_gpu) in [(false, None), (true, None), (true, Some(0))] {
        let cfg = two_remote(&a, &b, stream_all, kv_gpu);
        let mut split = Engine::load(&path, &cfg).expect("engine on two remote devices");
        let parts: Vec<_> = split.parts().map(|p| (p.layers(), p.device())).collect();
        assert_eq!(parts.len(), 2, "streamed={stream_all}");
        assert_eq!(parts[0].0.start, 0);
        assert_eq!(parts[0].0.end, parts[1].0.start);
        assert_eq!(parts[1].0.end, n_layer);
        assert!(parts.iter().all(|(_, d)| d.is_remote()));
        if kv_gpu == Some(0) {
            assert!(split.parts().all(|p| p.kv_resident_layers() == 0));
        }
        assert_ne!(parts[0].1.name(), parts[1].1.name());
        eprintln!("{}", split.placement_summary());
        let got = strata::parity::run_strata(&mut split, &prompt, 16).expect("split run");
        let (worst, _) = strata::parity::compare(&got, &want);
        eprintln!("split, streamed={stream_all}: worst NMSE {worst:.3e}");
        assert_eq!(got.tokens, want.tokens, "streamed={stream_all}");
        assert!(worst <= 1e-4, "streamed={stream_all}: NMSE {worst}");
        // a rolled-back draft leaves both parts' cells alike: the next
        // token's logits are the same again
        let nmse = after_rollback(&mut split, &mut local, prompt.len(), got.tokens[0]);
        assert!(nmse <= 1e-4, "streamed={stream_all}: NMSE {nmse}");
    }
    // devices the servers do not have, and budgets for other devices
    let bad = |devices: Vec<usize>, gpu_budgets: Vec<u64>| {
        let cfg = EngineConfig {
            device: DeviceChoice::Remote,
            rpc: vec![a.endpoint(), b.endpoint()],
            devices: Some(devices),
            gpu_budgets,
            ..common::cpu_cfg()
        };
        match Engine::load(&path, &cfg) {
            Ok(_) => panic!("loaded"),
            Err(e) => e.to_string(),
        }
    };
    let e = bad(vec![0, 2], vec![]);
    assert!(
        e.contains("--devices 2") && e.contains("2 remote devices"),
        "{e}"
    );
    let e = bad(vec![1, 1], vec![]);
    assert!(e.contains("twice"), "{e}");
    let e = bad(vec![0, 1], vec![1 << 30, 1 << 30, 1 << 30]);
    assert!(e.contains("3 GPU budgets for 2 devices"), "{e}");
}

#[test]
fn rows_split_across_two_remote_devices_give_one_devices_tokens() {
    let Some(path) = model(common::SMOLLM2) else {
        return;
    };
    let (a, b) = (Server::start(), Server::start());
    let (prompt, mut local, want) = local_reference(&path);
    // resident; streamed in prompt steps of 4 tokens; streamed with every
    // layer's KV in the host tier; budgets of 1:2 (an uneven split)
    // and streamed with the host CPU computing four FFN groups' shares of
    // each device at once (hybrid decode, each share in its own thread);
    // steps of 2 tokens or more computed in two halves of rows, resident
    // and streamed, without hybrid decode (the prompt steps' groups, all
    // but the last layer's attention)
    for (stream_all, kv_gpu, budgets, hybrid, halves) in [
        (false, None, vec![], Hybrid::Auto, None),
        (true, None, vec![], Hybrid::Auto, None),
        (true, Some(0), vec![], Hybrid::Auto, None),
        (false, None, vec![1u64 << 30, 2 << 30], Hybrid::Auto, None),
        (true, None, vec![], Hybrid::Force(4), None),
        (false, None, vec![], Hybrid::Off, Some(2)),
        (true, None, vec![], Hybrid::Off, Some(2)),
    ] {
        let mut cfg = two_remote(&a, &b, stream_all, kv_gpu);
        cfg.split_mode = strata::engine::SplitMode::Row;
        cfg.gpu_budgets = budgets.clone();
        cfg.paging.hybrid = hybrid;
        cfg.paging.row_halves = halves;
        let what = format!(
            "streamed={stream_all} kv_gpu={kv_gpu:?} budgets={budgets:?} hybrid={hybrid:?} halves={halves:?}"
        );
        let mut split = Engine::load(&path, &cfg).expect("engine on two remote devices");
        if !budgets.is_empty() {
            let parts: Vec<_> = split.parts().map(|p| p.spec.hp.n_ff).collect();
            assert!(parts[1] > parts[0], "{what}: {parts:?}");
        }
        if matches!(hybrid, Hybrid::Force(_)) {
            assert!(
                split.parts().all(|p| p.plan.placement.hybrid.is_some()),
                "{what}: the host computes no share"
            );
        }
        check_rows(&mut split, 2, &mut local, &prompt, &want, &what);
        if halves.is_some() {
            // a step of 4 tokens, all wanting logits, is cut in every
            // group but the last layer's attention (hybrid decode is off
            // here: which groups the host takes depends on the CPU's
            // measured speed, and a group either part's host computes is
            // not cut)
            split.clear();
            let four = common::all_positions(&[prompt[..4].to_vec()]);
            split.decode(&four).expect("a step of 4 tokens");
            let n_layer = split.spec.hp.n_layer;
            assert_eq!(split.last_step.halved, 2 * n_layer - 1, "{what}");
        }
    }
    // a model the row split cannot share out is refused, naming why and
    // the way out (Gemma 3 270M: one KV head for two devices, besides the
    // post-norms a sum of per-device outputs cannot compute)
    if let Some(gemma) = model(common::GEMMA3) {
        let cfg = EngineConfig {
            device: DeviceChoice::Remote,
            rpc: vec![a.endpoint(), b.endpoint()],
            devices: Some(vec![0, 1]),
            split_mode: strata::engine::SplitMode::Row,
            ..common::cpu_cfg()
        };
        let e = match Engine::load(&gemma, &cfg) {
            Ok(_) => panic!("Gemma 3 loaded with the row split"),
            Err(e) => e.to_string(),
        };
        assert!(
            e.contains("row split") && e.contains("1 KV heads") && e.contains("--split-mode layer"),
            "{e}"
        );
    }
}

/// Token trees across devices: a draft model's trees (SmolLM2 drafting
/// for itself on the local CPU), verified in steps whose tree mask every
/// part (a layer range, or a share of every layer's heads) applies, and
/// rolled back on every part, give the tokens plain greedy decoding gives
/// on the same split (sampling is tests/tree.rs's); trees branch and
/// drafts are accepted.
#[test]
fn token_trees_over_split_devices_equal_plain_decoding() {
    use strata::sample::SamplerConfig;
    use strata::speculative::{DraftModel, Drafter, SpecConfig, Speculator};
    let Some(path) = model(common::SMOLLM2) else {
        return;
    };
    let vocab = LlamaModel::load(&path, true, 0).expect("vocabulary");
    let (a, b) = (Server::start(), Server::start());
    let sc = SamplerConfig::greedy();
    for mode in [
        strata::engine::SplitMode::Layer,
        strata::engine::SplitMode::Row,
    ] {
        let mut cfg = two_remote(&a, &b, false, None);
        cfg.split_mode = mode;
        let mut e = Engine::load(&path, &cfg).expect("engine on two remote devices");
        let de = Engine::load(&path, &common::cpu_cfg()).expect("draft engine");
        let tree = SpecConfig {
            draft_max: 6,
            draft_min: 0,
            adaptive: false,
            tree: 10,
        };
        let mut spec = Speculator::new(Drafter::Model(Box::new(DraftModel::new(de, 0.0))), tree);
        for p in &common::SPEC_PROMPTS[1..] {
            let want = common::generate(&mut e, &vocab, &sc, p, 16, None);
            let got = common::generate(&mut e, &vocab, &sc, p, 16, Some(&mut spec));
            assert_eq!(got, want, "{mode:?}, {p:?}: {}", spec.stats.summary());
        }
        let st = &spec.stats;
        // more nodes than a chain of --draft-max holds: the trees branched
        assert!(
            st.accepted > 0 && st.drafted > st.rounds * 6,
            "{mode:?}: {}",
            st.summary()
        );
    }
}

/// The checks of a row split over `n` devices against the local CPU's
/// engine and its greedy run `want` of `prompt`.
fn check_rows(
    split: &mut Engine,
    n: usize,
    local: &mut Engine,
    prompt: &[u32],
    want: &strata::parity::Run,
    what: &str,
) {
    let hp = local.spec.hp.clone();
    let parts: Vec<_> = split.parts().map(|p| p.spec.hp.clone()).collect();
    assert_eq!(parts.len(), n, "{what}");
    // every layer on every device, the heads and FFN columns shared out
    assert!(parts
        .iter()
        .all(|p| p.n_layer == hp.n_layer && p.layer0 == 0));
    assert_eq!(parts.iter().map(|p| p.n_head_kv).sum::<u32>(), hp.n_head_kv);
    assert_eq!(parts.iter().map(|p| p.n_head).sum::<u32>(), hp.n_head);
    assert_eq!(parts.iter().map(|p| p.n_ff).sum::<u32>(), hp.n_ff);
    assert!(split.parts().all(|p| p.device().is_remote()));
    eprintln!("{}", split.placement_summary());
    // tokens each alone in its sequence (every step's attention sees
    // one cell, so its output is V): the devices' partial sums round
    // nearly as one device's whole products (NMSE 4e-8 at most with
    // the model's first 8 layers, 2e-5 with all 30), so a wrong slice
    // or sum shows here
    split.clear();
    local.clear();
    for (s, &t) in prompt.iter().take(5).enumerate() {
        let tok = [strata::engine::BatchToken {
            token: t,
            pos: 0,
            seq: s as u32,
            logits: true,
        }];
        let (x, y) = (split.decode(&tok).unwrap(), local.decode(&tok).unwrap());
        let nmse = strata::parity::nmse(&x, &y);
        assert!(nmse <= 1e-3, "{what}: token {t} alone: NMSE {nmse}");
    }
    split.clear();
    local.clear();
    // over several cells a last-bit difference flips the F16 rounding
    // of a K/V element or the Q8 rounding of an activation block, and
    // 30 layers amplify that (NMSE 0 with the model's first 4 layers,
    // about 3e-5 with 8, a few 1e-3 with all 30, as ggml's own kernels
    // differ between backends): so the split is fed one device's
    // greedy tokens, and its logits must stay close at every step and
    // choose the same token wherever one device's choice is clear
    let got = strata::parity::run_strata_forced(split, prompt, &want.tokens).expect("split run");
    for (i, (x, y)) in got.logits.iter().zip(&want.logits).enumerate() {
        let nmse = strata::parity::nmse(x, y);
        let top = |l: &[f32]| (0..l.len()).max_by(|&a, &b| l[a].total_cmp(&l[b])).unwrap();
        let mut sorted = y.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let gap = sorted[0] - sorted[1];
        eprintln!("{what}: step {i}: NMSE {nmse:.2e}, one device's top-2 gap {gap:.3}");
        assert!(nmse <= 5e-2, "{what}: step {i}: NMSE {nmse}");
        assert!(
            gap < 1.0 || top(x) == top(y),
            "{what}: step {i}: another token at gap {gap}"
        );
    }
    // a rolled-back draft leaves every device's cells alike
    strata::parity::run_strata_forced(local, prompt, &want.tokens).expect("local run");
    let nmse = after_rollback(split, local, prompt.len(), got.tokens[0]);
    assert!(nmse <= 5e-2, "{what}: NMSE {nmse}");
}

#[test]
fn rows_split_across_three_remote_devices_give_one_devices_tokens() {
    // three devices: the first gathers the others' outputs, adds them and
    // sends the sum back (two devices swap theirs)
    let Some(path) = model(common::SMOLLM2) else {
        return;
    };
    let servers = [Server::start(), Server::start(), Server::start()];
    let (prompt, mut local, want) = local_reference(&path);
    // SmolLM2-135M's 3 KV heads, one each; resident, and streamed with the
    // host computing two FFN groups' shares of each device
    for (stream_all, hybrid) in [(false, Hybrid::Auto), (true, Hybrid::Force(2))] {
        let mut cfg = two_remote(&servers[0], &servers[1], stream_all, None);
        cfg.rpc.push(servers[2].endpoint());
        cfg.devices = Some(vec![0, 1, 2]);
        cfg.split_mode = strata::engine::SplitMode::Row;
        cfg.paging.hybrid = hybrid;
        let what = format!("three devices, streamed={stream_all} hybrid={hybrid:?}");
        let mut split = Engine::load(&path, &cfg).expect("engine on three remote devices");
        if stream_all {
            assert!(
                split
                    .parts()
                    .all(|p| p.plan.placement.n_streamed() > 0 && p.plan.placement.hybrid.is_some()),
                "{what}: nothing streamed or the host computes no share"
            );
        }
        check_rows(&mut split, 3, &mut local, &prompt, &want, &what);
    }
}

/// The split tests' prompt, the local CPU's engine, and its greedy run of
/// 16 tokens after the prompt.
fn local_reference(path: &std::path::Path) -> (Vec<u32>, Engine, strata::parity::Run) {
    let vocab = LlamaModel::load(path, true, 0).expect("vocabulary");
    let prompt = vocab
        .tokenize("The capital of France is", true, true)
        .expect("tokenize");
    let mut local = Engine::load(path, &common::cpu_cfg()).expect("local engine");
    let want = strata::parity::run_strata(&mut local, &prompt, 16).expect("local run");
    (prompt, local, want)
}

/// The devices of servers `a` and `b`, both used: every group resident,
/// or streamed in prompt steps of 4 tokens (so every part places cells
/// over several steps); `kv_gpu`: the device's KV budget (0: every layer's
/// KV in the host tier, in blocks of 16 cells).
fn two_remote(a: &Server, b: &Server, stream_all: bool, kv_gpu: Option<u64>) -> EngineConfig {
    EngineConfig {
        device: DeviceChoice::Remote,
        rpc: vec![a.endpoint(), b.endpoint()],
        devices: Some(vec![0, 1]),
        n_batch: if stream_all { 4 } else { 512 },
        paging: PagingOptions {
            stream_all,
            ..PagingOptions::default()
        },
        budgets: strata::engine::Budgets {
            kv_gpu,
            ..Default::default()
        },
        kv_tier: strata::engine::KvTierOptions {
            block: 16,
            ..Default::default()
        },
        ..common::cpu_cfg()
    }
}

/// Both engines' sequence 0 cut back to the prompt's `n` tokens (a
/// rejected draft), then `token` decoded after it on both: the NMSE of the
/// two engines' logits.
fn after_rollback(split: &mut Engine, local: &mut Engine, n: usize, token: u32) -> f64 {
    let n = n as i32;
    split.truncate_seq(0, n);
    local.truncate_seq(0, n);
    let tok = [strata::engine::BatchToken {
        token,
        pos: n,
        seq: 0,
        logits: true,
    }];
    let (x, y) = (split.decode(&tok).unwrap(), local.decode(&tok).unwrap());
    strata::parity::nmse(&x, &y)
}

/// Runs `strata run` on the remote device; returns its exit code (None
/// when a signal ended it, or it was still running after `limit` and was
/// killed), its stderr and how long it took.
fn run_remote(
    endpoint: &str,
    path: &std::path::Path,
    n: usize,
    limit: Duration,
    extra: &[&str],
) -> (Option<i32>, String, Duration) {
    let split = endpoint.contains(',');
    let mut child = Command::new(STRATA)
        .args([
            "run",
            "--device",
            "rpc",
            "--rpc",
            endpoint,
            "--devices",
            if split { "0,1" } else { "0" },
            "--stream-all",
            "-c",
            "512",
            "--temp",
            "0",
        ])
        .args(["-n", &n.to_string(), "-p", "Once upon a time"])
        .args(extra)
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

/// Runs `strata run` on `endpoints` while `lost` is killed after `secs`
/// seconds; returns the client's exit code and stderr, having checked that
/// it did not hang.
fn run_losing(
    endpoints: &str,
    path: &std::path::Path,
    mut lost: Server,
    secs: u64,
    extra: &[&str],
) -> (Option<i32>, String) {
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(secs));
        let _ = lost.child.kill();
        let _ = lost.child.wait();
    });
    let (code, err, took) = run_remote(endpoints, path, 100_000, Duration::from_secs(120), extra);
    killer.join().unwrap();
    assert!(
        took < Duration::from_secs(100),
        "the client hung after a server died: {err}"
    );
    (code, err)
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
        &[],
    );
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("cannot reach the RPC server") && err.contains(&port.to_string()),
        "{err}"
    );
    // a malformed endpoint
    let (code, err, _) = run_remote("localhost", &path, 4, Duration::from_secs(60), &[]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("HOST:PORT"), "{err}");
    // the server dies while the client generates: the client ends, saying so
    let server = Server::start();
    let endpoint = server.endpoint();
    let (code, err) = run_losing(&endpoint, &path, server, 4, &[]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("error: ggml:") && err.contains("RPC server"),
        "{err}"
    );
    // the layers split over two servers, the second dies
    let (first, second) = (Server::start(), Server::start());
    let endpoints = format!("{},{}", first.endpoint(), second.endpoint());
    let (code, err) = run_losing(&endpoints, &path, second, 8, &[]);
    assert_eq!(code, Some(1), "{err}");
    // mid-run ggml's client names the server; on a loaded machine the
    // kill may come before the client reached it, and strata names it
    assert!(err.contains("RPC server"), "{err}");
    // every layer's rows split over two servers, the first dies (the
    // second waits on it at every group)
    let (first, second) = (Server::start(), Server::start());
    let endpoints = format!("{},{}", first.endpoint(), second.endpoint());
    let (code, err) = run_losing(&endpoints, &path, first, 8, &["--split-mode", "row"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("RPC server"), "{err}");
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
