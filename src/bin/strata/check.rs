//! `strata check`: strata against llama.cpp on this machine's device, and
//! against strata on the CPU: greedy tokens and per-position logits.

use anyhow::{Context as _, Result};
use clap::Args;
use strata::engine::{Budgets, DeviceChoice, Engine, EngineConfig};
use strata::llama::{LlamaModel, Reference, ReferenceConfig};
use strata::parity::{
    compare, margin_at, prompt_logits, run_reference, run_strata, run_strata_forced, run_turns,
};

#[derive(Args)]
pub struct CheckArgs {
    #[command(flatten)]
    pub model: super::ModelArgs,
    /// Greedy tokens to generate per prompt.
    #[arg(short = 'n', long, default_value_t = 32)]
    pub n_gen: usize,
    /// Largest per-position logits NMSE accepted.
    #[arg(long, default_value_t = 5e-4)]
    pub max_nmse: f64,
    /// Also compare with strata on the CPU backend.
    #[arg(long)]
    pub with_cpu: bool,
    /// Also run the prompts as sequences taking turns, this many rounds of
    /// n/2 tokens each, against an engine keeping all KV on the device (so
    /// a tiered KV cache, --kv-budget/--kv-dram, is checked with several
    /// sequences moving through DRAM and spill files).
    #[arg(long, default_value_t = 0)]
    pub turns: usize,
    /// The row split over two GPUs: instead of the comparison with
    /// llama.cpp, run a prompt of one full step (--ubatch-size tokens)
    /// against a second engine of the same split whose halved steps widen
    /// (on) or dequantize each weight again (off, as --no-row-widen):
    /// every position's logits must be equal bit for bit.
    #[arg(long = "vs-row-widen", value_parser = ["on", "off"])]
    pub vs_row_widen: Option<String>,
}

const PROMPTS: [&str; 3] = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
];

pub fn check(a: CheckArgs) -> Result<()> {
    let cfg = super::engine_config(&a.model, false);
    let mut engine = Engine::load(&a.model.model, &cfg).context("loading strata")?;
    // llama.cpp's reference (and a second engine) share the device: the
    // budget watch would count their memory as this engine's
    engine.stop_budget_watch();
    if let Some(w) = a.vs_row_widen.as_deref() {
        // llama.cpp's model for its tokenizer alone
        let lm = LlamaModel::load_as_users_run(&a.model.model, 0).context("loading llama.cpp")?;
        return vs_row_widen(&a, &cfg, w == "on", &mut engine, &lm);
    }
    let on_gpu = !engine.device().is_cpu();
    // llama.cpp as its users run it: repacked CPU weights, flash attention auto
    let lm = LlamaModel::load_as_users_run(&a.model.model, if on_gpu { 999 } else { 0 })
        .context("loading llama.cpp")?;
    let rcfg = ReferenceConfig {
        n_ctx: cfg.n_ctx,
        n_batch: cfg.n_batch,
        n_ubatch: 0,
        n_seq: 1,
        n_threads: cfg.n_threads as i32,
        offload_kqv: true,
    };
    let mut reference = Reference::new_default_settings(&lm, &rcfg).context("llama.cpp context")?;
    let mut cpu = if a.with_cpu && on_gpu {
        let c = EngineConfig {
            device: DeviceChoice::Cpu,
            ..cfg.clone()
        };
        Some(Engine::load(&a.model.model, &c).context("loading strata on the CPU")?)
    } else {
        None
    };
    println!(
        "strata check: {} on {} ({})",
        engine.spec.name,
        engine.device().description(),
        engine.placement_summary()
    );
    let nv = engine.n_vocab() as usize;
    let mut ok = true;
    for p in PROMPTS {
        let prompt = lm.tokenize(p, true, true)?;
        // each with its own kernels: strata with the path its plan chose,
        // llama.cpp with ggml's (the switch is one for the process)
        engine.apply_matmul_path();
        let s = run_strata(&mut engine, &prompt, a.n_gen)?;
        strata::engine::reset_matmul_path();
        let r = run_reference(&mut reference, &prompt, a.n_gen, nv)?;
        let (worst, diff) = compare(&s, &r);
        let pass = worst <= a.max_nmse && diff.is_none();
        ok &= pass;
        println!(
            "  vs llama.cpp: {:<4} nmse {worst:.3e} tokens {} prompt {:?}",
            if pass { "ok" } else { "FAIL" },
            diff.map_or("identical".to_string(), |i| match margin_at(&s, &r, i) {
                Some(m) => format!("differ at {i} (llama.cpp's logits {m:.3} apart there)"),
                None => format!("differ at {i}"),
            }),
            p.chars().take(30).collect::<String>()
        );
        if !pass {
            // the same inputs as llama.cpp (its greedy tokens fed to strata):
            // where the first position differs tells a kernel or graph
            // difference (from the prompt on) from a near-tie that parted
            // the free-running tokens
            engine.apply_matmul_path();
            let forced = run_strata_forced(&mut engine, &prompt, &r.tokens)?;
            strata::engine::reset_matmul_path();
            let (worst, _) = compare(&forced, &r);
            let first = forced
                .logits
                .iter()
                .zip(&r.logits)
                .position(|(a, b)| strata::parity::nmse(a, b) > 0.0);
            println!(
                "    fed llama.cpp's tokens: nmse {worst:.3e}, {}",
                match first {
                    None => "every position bit for bit".to_string(),
                    Some(i) if i < prompt.len() => format!(
                        "first off at prompt position {i} of {} (nmse {:.3e} there)",
                        prompt.len(),
                        strata::parity::nmse(&forced.logits[i], &r.logits[i])
                    ),
                    Some(i) => format!(
                        "the prompt bit for bit, first off at generated token {} (nmse {:.3e} there)",
                        i - prompt.len() + 1,
                        strata::parity::nmse(&forced.logits[i], &r.logits[i])
                    ),
                }
            );
        }
        if let Some(c) = cpu.as_mut() {
            // same inputs on both backends: the CPU's greedy tokens fed to
            // this device (free-running greedy runs may part at near-ties)
            let c = run_strata(c, &prompt, a.n_gen)?;
            engine.apply_matmul_path();
            let forced = run_strata_forced(&mut engine, &prompt, &c.tokens)?;
            let (worst, _) = compare(&forced, &c);
            let (_, free_diff) = compare(&s, &c);
            let pass = worst <= a.max_nmse;
            ok &= pass;
            println!(
                "  vs strata CPU: {:<4} nmse {worst:.3e} (same tokens); free-running greedy {}",
                if pass { "ok" } else { "FAIL" },
                free_diff.map_or("identical".to_string(), |i| format!("parts at step {i}"))
            );
        }
    }
    if a.turns > 0 {
        let dev = EngineConfig {
            budgets: Budgets {
                kv_gpu: Some(u64::MAX),
                ..cfg.budgets
            },
            ..cfg.clone()
        };
        let mut base =
            Engine::load(&a.model.model, &dev).context("loading strata, KV on the device")?;
        base.stop_budget_watch();
        let prompts = PROMPTS
            .iter()
            .map(|p| lm.tokenize(p, true, true))
            .collect::<Result<Vec<_>, _>>()?;
        let per_turn = (a.n_gen / 2).max(1);
        engine.apply_matmul_path();
        let t = run_turns(&mut engine, &prompts, a.turns, per_turn)?;
        let b = run_turns(&mut base, &prompts, a.turns, per_turn)?;
        let (worst, diff) = compare(&t, &b);
        let pass = worst <= a.max_nmse && diff.is_none();
        ok &= pass;
        let moved = engine
            .kv_tier()
            .map(|k| k.total)
            .map_or("no KV tier".to_string(), |t| {
                format!("{} blocks spilled, {} loaded back", t.spilled, t.loaded)
            });
        println!(
            "  3 sequences taking turns ({} rounds of {per_turn}) vs all KV on the device: {:<4} nmse {worst:.3e} tokens {} ({moved})",
            a.turns,
            if pass { "ok" } else { "FAIL" },
            diff.map_or("identical".to_string(), |i| format!("differ at {i}")),
        );
    }
    anyhow::ensure!(ok, "strata check failed");
    println!("strata check: all passed");
    Ok(())
}

/// `--vs-row-widen`: the row split's halved steps against a second
/// engine whose halves widen or not (`widen`), over a prompt of one full
/// step: every position's logits bit for bit. Decoding after it is not
/// compared: its one-token steps are never halved, and two engines' plans
/// (the widened copy takes room) may give the host CPU different groups.
fn vs_row_widen(
    a: &CheckArgs,
    cfg: &EngineConfig,
    widen: bool,
    engine: &mut Engine,
    lm: &LlamaModel,
) -> Result<()> {
    let other_cfg = EngineConfig {
        paging: strata::engine::PagingOptions {
            row_widen: widen,
            ..cfg.paging.clone()
        },
        ..cfg.clone()
    };
    let mut other =
        Engine::load(&a.model.model, &other_cfg).context("loading the second engine")?;
    other.stop_budget_watch();
    println!(
        "strata check: {} on {}\n  this engine: {}\n  against: {}",
        engine.spec.name,
        engine.device().description(),
        engine.placement_summary(),
        other.placement_summary()
    );
    // the prompts over and over, to one full step
    let mut long = Vec::new();
    while long.len() < cfg.n_batch as usize {
        for p in PROMPTS {
            long.extend(lm.tokenize(p, long.is_empty(), true)?);
        }
    }
    long.truncate(cfg.n_batch as usize);
    engine.apply_matmul_path();
    let r = prompt_logits(engine, &long)?;
    other.apply_matmul_path();
    let o = prompt_logits(&mut other, &long)?;
    let nmse: Vec<f64> = r
        .iter()
        .zip(&o)
        .map(|(x, y)| strata::parity::nmse(x, y))
        .collect();
    let worst = nmse.iter().copied().fold(0.0, f64::max);
    let first = nmse.iter().position(|&e| e > 0.0);
    let pass = first.is_none() && r.len() == o.len();
    println!(
        "  a {}-token prompt vs --row-widen {}: {:<4} nmse {worst:.3e}, {}",
        long.len(),
        if widen { "on" } else { "off" },
        if pass { "ok" } else { "FAIL" },
        match first {
            None => "every position's logits bit for bit".to_string(),
            Some(i) => format!("logits first off at position {i} (nmse {:.3e})", nmse[i]),
        }
    );
    anyhow::ensure!(pass, "strata check failed");
    println!("strata check: all passed");
    Ok(())
}
