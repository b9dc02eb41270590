//! Speculative-decoding flags (llama.cpp's names) and loading a target with
//! its draft model, the draft's device memory taken out of --gpu-budget.

use anyhow::{bail, Context as _, Result};
use clap::Args;
use std::path::{Path, PathBuf};
use strata::engine::{Budgets, Engine, EngineConfig, Faults, PagingOptions};
use strata::llama::LlamaModel;
use strata::speculative::{check_vocab, DraftModel, Drafter, NgramLookup, SpecConfig, Speculator};

#[derive(Args, Clone, Debug)]
pub struct SpecArgs {
    /// Draft model for speculative decoding (llama.cpp's -md): a small model
    /// with the target's vocabulary, kept resident on the device; its
    /// memory counts against --gpu-budget.
    #[arg(long = "model-draft", value_name = "FILE")]
    pub model_draft: Option<PathBuf>,
    /// Most tokens drafted per step.
    #[arg(long = "draft-max", alias = "draft", default_value_t = 16)]
    pub draft_max: usize,
    /// Drafts shorter than this are not verified (the step runs without).
    #[arg(long = "draft-min", default_value_t = 0)]
    pub draft_min: usize,
    /// The draft model stops drafting when its top token's probability
    /// (among its 10 best, as llama.cpp computes it) is below this.
    #[arg(long = "draft-p-min", default_value_t = 0.75)]
    pub draft_p_min: f32,
    /// Always draft up to --draft-max. Default: each round drafts the
    /// length that the measured step cost, draft cost and acceptance say
    /// pays best (on a PCIe-bound step that is --draft-max; on a CPU that
    /// computes every token it can be none).
    #[arg(long = "draft-fixed")]
    pub draft_fixed: bool,
    /// Prompt lookup: without a draft model, draft up to N tokens from
    /// n-grams (3 and 2 tokens) of the prompt and the generated text.
    #[arg(long = "lookup", value_name = "N")]
    pub lookup: Option<usize>,
    /// Draft token trees of up to N nodes instead of chains, at most
    /// --draft-max deep: the draft model's best few tokens after each node,
    /// grown best-first by path probability (prompt lookup: every earlier
    /// occurrence's continuation); the target verifies all nodes in one
    /// step. Default: the first nodes that the measured step cost and the
    /// drafter's measured calibration say pay best (--draft-fixed: all).
    #[arg(long = "draft-tree", value_name = "N")]
    pub draft_tree: Option<usize>,
}

impl SpecArgs {
    pub fn enabled(&self) -> bool {
        self.model_draft.is_some() || self.lookup.is_some_and(|n| n > 0)
    }

    fn validate(&self) -> Result<()> {
        if self.model_draft.is_some() && self.lookup.is_some() {
            bail!("--model-draft and --lookup are two ways to draft: pass one");
        }
        if !(0.0..=1.0).contains(&self.draft_p_min) {
            bail!("--draft-p-min {} is outside [0, 1]", self.draft_p_min);
        }
        if let Some(n) = self.draft_tree {
            if !(1..=MAX_TREE).contains(&n) {
                bail!("--draft-tree {n} is outside 1..={MAX_TREE}");
            }
            if !self.enabled() {
                bail!("--draft-tree needs drafts: pass --model-draft FILE or --lookup N");
            }
        }
        if self.draft_min > self.draft_max {
            bail!(
                "--draft-min {} is above --draft-max {}",
                self.draft_min,
                self.draft_max
            );
        }
        Ok(())
    }
}

/// The draft model loaded and checked, and where it came from.
pub struct Draft {
    engine: Engine,
    vocab: LlamaModel,
    path: PathBuf,
}

/// Loads the draft model (if any) resident on `cfg`'s device, and takes its
/// device memory out of `cfg.budgets.gpu`.
pub fn load_draft(s: &SpecArgs, cfg: &mut EngineConfig) -> Result<Option<Draft>> {
    s.validate()?;
    let Some(path) = &s.model_draft else {
        return Ok(None);
    };
    super::check_model_path(path, "draft model file")?;
    // the draft stays resident: no budget, no tiers
    let dcfg = EngineConfig {
        budgets: Budgets::default(),
        paging: PagingOptions {
            stream_all: false,
            ..cfg.paging.clone()
        },
        faults: Faults::default(),
        progress: false,
        ..cfg.clone()
    };
    let e = Engine::load(path, &dcfg)
        .with_context(|| format!("loading draft model {}", path.display()))?;
    let bytes = e.device_footprint();
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    eprintln!(
        "draft: {} ({} layers), {:.1} MiB on the device (weights {:.1}, KV and activations {:.1})",
        e.spec.name,
        e.spec.hp.n_layer,
        mib(bytes),
        mib(e.weight_bytes()),
        mib(bytes.saturating_sub(e.weight_bytes())),
    );
    if let Some(b) = cfg.budgets.gpu {
        let Some(left) = b.checked_sub(bytes) else {
            bail!("the draft model needs {bytes} bytes on the device, more than the GPU budget of {b}");
        };
        eprintln!(
            "draft: the target plans with {:.1} MiB of the {:.1} MiB GPU budget",
            mib(left),
            mib(b)
        );
        cfg.budgets.gpu = Some(left);
    }
    let vocab = LlamaModel::load(path, true, 0)
        .with_context(|| format!("loading the vocabulary of {}", path.display()))?;
    Ok(Some(Draft {
        engine: e,
        vocab,
        path: path.clone(),
    }))
}

/// The drafter for a loaded target: the draft model (its vocabulary checked
/// against the target's) or prompt lookup; None without either.
pub fn speculator(
    s: &SpecArgs,
    draft: Option<Draft>,
    target: &Engine,
    target_vocab: &LlamaModel,
    target_path: &Path,
) -> Result<Option<Speculator>> {
    let drafter = match draft {
        Some(d) => Some(Drafter::Model(Box::new(draft_model(
            s,
            d,
            target,
            target_vocab,
            target_path,
        )?))),
        None => s
            .lookup
            .filter(|&n| n > 0)
            .map(|_| Drafter::Lookup(NgramLookup::default())),
    };
    Ok(drafter.map(|d| Speculator::new(d, spec_config(s))))
}

/// The loaded draft model, once its vocabulary is checked against the
/// target's.
pub fn draft_model(
    s: &SpecArgs,
    d: Draft,
    target: &Engine,
    target_vocab: &LlamaModel,
    target_path: &Path,
) -> Result<DraftModel> {
    check_vocab(target_vocab, target, &d.vocab, &d.engine).with_context(|| {
        format!(
            "draft model {} cannot draft for {}",
            d.path.display(),
            target_path.display()
        )
    })?;
    Ok(DraftModel::new(d.engine, s.draft_p_min))
}

fn spec_config(s: &SpecArgs) -> SpecConfig {
    SpecConfig {
        draft_max: s.lookup.unwrap_or(s.draft_max),
        draft_min: s.draft_min,
        adaptive: !s.draft_fixed,
        tree: s.draft_tree.unwrap_or(0),
    }
}

/// Most nodes of a token tree: they are verified in one step.
pub const MAX_TREE: usize = 1024;

/// The server's drafting parameters, when `-md FILE` or `--lookup N` asks
/// for drafting. With token trees, a step of `step` tokens must hold every
/// sequence's token and one sequence's accepted side branch fed again
/// (at most a tree's depth, --draft-max).
pub fn serve_config(s: &SpecArgs, step: u32, parallel: usize) -> Result<Option<SpecConfig>> {
    s.validate()?;
    let cfg = s.enabled().then(|| spec_config(s));
    if let Some(c) = cfg.filter(|c| c.tree > 0) {
        let need = parallel + c.draft_max;
        if (step as usize) < need {
            bail!(
                "--draft-tree: a step of {step} tokens (--ubatch-size / --batch-size) has no room for \
                 --parallel {parallel} sequences and a tree's accepted path fed again \
                 (--draft-max {}): use steps of at least {need} tokens",
                c.draft_max
            );
        }
    }
    Ok(cfg)
}
