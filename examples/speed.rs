//! Quick side-by-side decode timing of strata and llama.cpp (CPU).
use std::time::Instant;
use strata::engine::{BatchToken, DeviceChoice, Engine, EngineConfig};
use strata::llama::{LlamaModel, Reference, ReferenceConfig};
fn main() {
    let path = std::path::PathBuf::from(std::env::args().nth(1).expect("model"));
    let n = 64;
    let lm = LlamaModel::load(&path, false, 0).unwrap();
    let mut r = Reference::new(
        &lm,
        &ReferenceConfig {
            n_ctx: 512,
            n_batch: 512,
            n_seq: 1,
            n_threads: 2,
        },
    )
    .unwrap();
    let t0 = Instant::now();
    for i in 0..n {
        r.decode(&[(1, i, 0, true)]).unwrap();
    }
    println!(
        "llama.cpp tg: {:.2} t/s",
        n as f64 / t0.elapsed().as_secs_f64()
    );
    let mut e = Engine::load(
        &path,
        &EngineConfig {
            n_ctx: 512,
            n_batch: 512,
            n_threads: 2,
            device: DeviceChoice::Cpu,
            progress: false,
        },
    )
    .unwrap();
    let t0 = Instant::now();
    for i in 0..n {
        e.decode(&[BatchToken {
            token: 1,
            pos: i,
            seq: 0,
            logits: true,
        }])
        .unwrap();
    }
    println!(
        "strata tg: {:.2} t/s",
        n as f64 / t0.elapsed().as_secs_f64()
    );
}
