//! Shared helpers for integration tests: locating the test models.
#![allow(dead_code)]

use std::path::PathBuf;

pub const SMOLLM2: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const QWEN2: &str = "Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf";
/// Gemma 3 270M (gemma3: sliding-window layers, post-norms, GeGLU).
pub const GEMMA3: &str = "gemma-3-270m-q4_k_m.gguf";
/// The speculative-decoding target (QWEN2 drafts for it).
pub const QWEN15: &str = "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf";

/// The cached test model `name`, or None (with a message) when absent.
/// With STRATA_REQUIRE_MODELS=1 (CI) a missing model fails the test.
pub fn model(name: &str) -> Option<PathBuf> {
    let dir = std::env::var_os("STRATA_MODELS")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache/strata/models")
        });
    let p = dir.join(name);
    if p.is_file() {
        return Some(p);
    }
    if std::env::var("STRATA_REQUIRE_MODELS").as_deref() == Ok("1") {
        panic!(
            "test model {} missing: run tools/fetch-models.sh",
            p.display()
        );
    }
    eprintln!(
        "skipping: test model {} not found (run tools/fetch-models.sh)",
        p.display()
    );
    None
}

#[allow(unused_imports)]
pub use strata::parity::nmse;

/// The engine configuration the CPU tests share: a 512-token context and
/// batch, 2 threads.
pub fn cpu_cfg() -> strata::engine::EngineConfig {
    strata::engine::EngineConfig {
        n_ctx: 512,
        n_batch: 512,
        n_threads: 2,
        device: strata::engine::DeviceChoice::Cpu,
        ..strata::engine::EngineConfig::default()
    }
}

pub fn argmax(v: &[f32]) -> u32 {
    strata::sample::argmax(v).expect("non-empty logits")
}

/// Every position of every prompt, one sequence per prompt, all with logits.
pub fn all_positions(prompts: &[Vec<u32>]) -> Vec<strata::engine::BatchToken> {
    prompts
        .iter()
        .enumerate()
        .flat_map(|(s, p)| {
            p.iter()
                .enumerate()
                .map(move |(i, &t)| strata::engine::BatchToken {
                    token: t,
                    pos: i as i32,
                    seq: s as u32,
                    logits: true,
                })
        })
        .collect()
}

/// The sampling configuration the sampled-generation tests share
/// (temperature 0.9, top-k 40, top-p 0.95, min-p 0.05, penalty 1.1 over 16).
pub fn sampled_cfg(seed: u64) -> strata::sample::SamplerConfig {
    strata::sample::SamplerConfig {
        temperature: 0.9,
        top_k: 40,
        top_p: 0.95,
        min_p: 0.05,
        repeat_penalty: 1.1,
        repeat_last_n: 16,
        frequency_penalty: 0.0,
        presence_penalty: 0.0,
        seed,
        logit_bias: Vec::new(),
    }
}

/// What [`synth`] writes: a preset, its matrices' type and what differs
/// between the tests' files.
pub struct Synth<'a> {
    pub preset: &'a str,
    /// `--type` spelling: "q4_0", "q8_0", ...
    pub ty: &'a str,
    pub layers: Option<u32>,
    pub seed: u64,
    pub router_skew: f32,
}

impl Default for Synth<'_> {
    fn default() -> Self {
        Synth {
            preset: "tiny",
            ty: "q4_0",
            layers: None,
            seed: 7,
            router_skew: 0.0,
        }
    }
}

/// Writes the synthetic model `s` describes to `out`, with `vocab`'s
/// tokenizer (`strata-convert synth` on two threads, no progress bar).
pub fn synth(
    out: &std::path::Path,
    vocab: &std::path::Path,
    s: Synth,
) -> strata::convert::WriteSummary {
    use strata::convert::{quant, synth};
    let opts = synth::SynthOptions {
        preset: synth::preset(s.preset).expect("preset"),
        target: quant::parse_target(s.ty).expect("type"),
        layers: s.layers,
        vocab_from: vocab.to_path_buf(),
        seed: s.seed,
        router_skew: s.router_skew,
        threads: 2,
        progress: false,
    };
    synth::synth(&opts, out).expect("synth")
}

/// A tiny Qwen3-MoE (16 experts, 4 a token) in Q8_0 at `dir/NAME`, its
/// router skewed by `router_skew` (`strata-convert synth --router-skew`).
pub fn synth_moe(
    dir: &std::path::Path,
    vocab: &std::path::Path,
    router_skew: f32,
) -> std::path::PathBuf {
    let path = dir.join(format!("qwen3moe-tiny-{router_skew}.gguf"));
    let s = Synth {
        preset: "qwen3moe-tiny",
        ty: "q8_0",
        router_skew,
        ..Synth::default()
    };
    synth(&path, vocab, s);
    path
}

/// The experts of each layer of a file `synth --router-skew` wrote, most
/// popular first, layer after layer (its `strata.synth.expert_rank`).
pub fn expert_ranks(path: &std::path::Path) -> Vec<u32> {
    let g = strata::gguf::GgufFile::open(path).expect("open");
    match g.get("strata.synth.expert_rank") {
        Some(strata::gguf::Value::Array(strata::gguf::Array::U32(r))) => r.clone(),
        other => panic!("expert_rank is {other:?}"),
    }
}

/// Prompts of the speculative tests: two whose continuations repeat their
/// text (prompt lookup finds drafts) and one that does not.
pub const SPEC_PROMPTS: [&str; 3] = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
    "Write a haiku about the sea.",
];

/// `n` tokens after `prompt` in a fresh session of `e`, drafted by `spec`
/// where given.
pub fn generate(
    e: &mut strata::engine::Engine,
    vocab: &strata::llama::LlamaModel,
    sc: &strata::sample::SamplerConfig,
    prompt: &str,
    n: usize,
    spec: Option<&mut strata::speculative::Speculator>,
) -> Vec<u32> {
    let toks = vocab.tokenize(prompt, true, true).expect("tokenize");
    let sampler = strata::sample::Sampler::new(sc.clone()).expect("sampler");
    let mut s = strata::generate::Session::new(e, vocab, sampler);
    s.generate_with(&toks, n, spec, |_| {}).expect("generate").0
}

/// Every tier at once, for a rollback to go through: KV windowed through
/// DRAM frames (all but two layers' worth on the device) in 16-cell blocks
/// that spill to files in `spill`, weights streamed through poisoned
/// slots. `per_layer`: one layer's KV bytes at the context size.
pub fn tiered_streaming_cfg(
    per_layer: u64,
    spill: &std::path::Path,
) -> strata::engine::EngineConfig {
    use strata::engine::{Budgets, EngineConfig, Faults, KvTierOptions, PagingOptions};
    EngineConfig {
        budgets: Budgets {
            kv_gpu: Some(2 * per_layer),
            ..Budgets::default()
        },
        kv_tier: KvTierOptions {
            block: 16,
            spill_dir: Some(spill.to_path_buf()),
            ..KvTierOptions::default()
        },
        paging: PagingOptions {
            stream_all: true,
            ..PagingOptions::default()
        },
        faults: Faults {
            poison_slots: true,
            ..Faults::default()
        },
        ..cpu_cfg()
    }
}
