//! Hybrid decode on the CPU: a CPU backend stands in for the device and a
//! second CPU backend computes the groups the plan gives the host. Forced
//! hybrid plans give the same logits and tokens as the all-resident engine
//! (bit for bit with plain weights on both sides), the CPU computes exactly
//! the groups the plan names, and the bus carries the rest.

mod common;

use common::{cpu_cfg, model, Synth};
use std::path::Path;
use strata::engine::{Engine, EngineConfig, Hybrid, PagingOptions};
use strata::llama::LlamaModel;
use strata::parity::{compare, run_strata};

const PROMPTS: [&str; 2] = [
    "A good unit test checks if the function returns the",
    "def quicksort(xs):\n    ",
];

/// `strata-convert synth --preset PRESET --seed SEED` (Q4_0, the preset's
/// layers) into `dir`.
fn synth_tiny(dir: &Path, vocab: &Path, preset: &str, seed: u64) -> std::path::PathBuf {
    let path = dir.join(format!("{preset}-{seed}.gguf"));
    let s = Synth {
        preset,
        seed,
        ..Synth::default()
    };
    common::synth(&path, vocab, s);
    path
}

fn hybrid_cfg(k: usize, repack: bool) -> EngineConfig {
    EngineConfig {
        paging: PagingOptions {
            stream_all: true,
            hybrid: Hybrid::Force(k),
            ..PagingOptions::default()
        },
        repack,
        ..cpu_cfg()
    }
}

/// `splits(n_layer)`: the numbers of CPU groups to force.
fn hybrid_equals_resident(name: &str, splits: fn(usize) -> Vec<usize>) {
    let Some(path) = model(name) else { return };
    hybrid_equals_resident_at(&path, name, splits);
}

fn hybrid_equals_resident_at(path: &Path, name: &str, splits: fn(usize) -> Vec<usize>) {
    let path = path.to_path_buf();
    let vocab = LlamaModel::load(&path, true, 0).expect("vocab");
    let mut resident = Engine::load(
        &path,
        &EngineConfig {
            repack: false,
            ..cpu_cfg()
        },
    )
    .expect("resident engine");
    let n_layer = resident.spec.hp.n_layer as usize;
    for k in splits(n_layer) {
        let mut hybrid = Engine::load(&path, &hybrid_cfg(k, false)).expect("hybrid engine");
        let h = hybrid
            .plan
            .placement
            .hybrid
            .clone()
            .expect("a forced hybrid plan");
        assert_eq!(h.host.iter().filter(|h| **h).count(), k);
        assert!(h.per_size.iter().all(|s| s.cpu_groups == k));
        for p in PROMPTS {
            let prompt = vocab.tokenize(p, true, true).expect("tokenize");
            let a = run_strata(&mut resident, &prompt, 16).expect("resident run");
            let b = run_strata(&mut hybrid, &prompt, 16).expect("hybrid run");
            let (worst, diff) = compare(&b, &a);
            assert_eq!(worst, 0.0, "{name} k={k}: NMSE {worst} hybrid vs resident");
            assert_eq!(diff, None, "{name} k={k}: tokens differ");
            // the last step was one token: the CPU computed k FFN groups,
            // the bus carried every other group
            let st = hybrid.last_step;
            assert_eq!(st.n_tokens, 1);
            assert_eq!(st.host.groups, k as u64, "{name} k={k}: CPU groups");
            assert_eq!(
                st.pager.uploads,
                (2 * n_layer - k) as u64,
                "{name} k={k}: uploads"
            );
        }
        // a prompt beyond 32 tokens (64 sequences' batched decode is a
        // step of this size) keeps the CPU's groups; one longer than the
        // CPU's step limit streams everything
        let limit = strata::paging::HYBRID_MAX_TOKENS as usize;
        for (repeats, cpu) in [(4, k as u64), (8, 0)] {
            let prompt: Vec<u32> = vocab
                .tokenize(
                    &"The quick brown fox jumps over the lazy dog. ".repeat(repeats),
                    true,
                    true,
                )
                .expect("tokenize");
            if cpu > 0 {
                assert!((33..=limit).contains(&prompt.len()));
            } else {
                assert!(prompt.len() > limit);
            }
            hybrid.clear();
            resident.clear();
            let batch = common::all_positions(&[prompt]);
            let a = resident.decode(&batch).expect("resident prompt");
            let b = hybrid.decode(&batch).expect("hybrid prompt");
            assert_eq!(
                hybrid.last_step.host.groups, cpu,
                "{name} k={k}: CPU groups"
            );
            assert_eq!(
                common::nmse(&b, &a),
                0.0,
                "{name} k={k}: {repeats} sentences"
            );
        }
    }
}

#[test]
fn smollm2_hybrid_equals_resident() {
    // one group, half of them, all of them
    hybrid_equals_resident(common::SMOLLM2, |n| vec![1, n / 2, n]);
}

/// Llama 3 files carry rope frequency factors, which only attention graphs
/// take: the host's FFN graphs bind without them (a 70B-shaped run on the
/// H100 refused to, "bound to 5 externals, its signature has 6").
#[test]
fn llama3_rope_factors_hybrid_equals_resident() {
    let Some(vocab) = model(common::SMOLLM2) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tmp");
    let path = dir.path().join("llama3.2-1b-2l.gguf");
    let preset = "llama3.2-1b";
    common::synth(
        &path,
        &vocab,
        Synth {
            preset,
            layers: Some(2),
            ..Synth::default()
        },
    );
    let spec = strata::model::ModelSpec::from_gguf(&strata::gguf::GgufFile::open(&path).unwrap())
        .expect("spec");
    assert!(spec.rope_freqs.is_some(), "the preset carries rope factors");
    hybrid_equals_resident_at(&path, "llama3.2-1b x2", |n| vec![1, n]);
}

#[test]
fn qwen2_hybrid_equals_resident() {
    hybrid_equals_resident(common::QWEN2, |n| vec![n / 3]);
}

/// With repacked host weights (llama.cpp's CPU layout) the CPU's groups
/// round differently from the plain streamed ones: logits stay within the
/// bound of two CPU kernels (measured 1.1e-3 on the prompt positions), and
/// greedy tokens agree.
#[test]
fn qwen2_repacked_hybrid_stays_close() {
    let Some(path) = model(common::QWEN2) else {
        return;
    };
    let vocab = LlamaModel::load(&path, true, 0).expect("vocab");
    let mut plain = Engine::load(&path, &hybrid_cfg(0, false)).expect("streamed engine");
    let mut hybrid = Engine::load(&path, &hybrid_cfg(24, true)).expect("hybrid engine");
    assert!(hybrid.plan.placement.hybrid.is_some());
    let prompt = vocab.tokenize(PROMPTS[1], true, true).expect("tokenize");
    let a = run_strata(&mut plain, &prompt, 12).expect("streamed run");
    let b = run_strata(&mut hybrid, &prompt, 12).expect("hybrid run");
    let (worst, diff) = compare(&b, &a);
    assert!(worst <= 5e-3, "NMSE {worst} repacked hybrid vs plain");
    assert_eq!(diff, None, "tokens differ");
}

/// A mixture of experts on the host: the CPU computes the router and the
/// experts of the FFN groups the plan gives it (stacked expert matrices in
/// plain host memory) as the device does.
#[test]
fn moe_hybrid_equals_resident() {
    let Some(vocab) = model(common::SMOLLM2) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tmp");
    for preset in ["mixtral-tiny", "qwen3moe-tiny"] {
        let path = synth_tiny(dir.path(), &vocab, preset, 5);
        hybrid_equals_resident_at(&path, preset, |n| vec![1, n]);
    }
}

/// Gemma 3: the host computes GeGLU FFN groups with their post-norms.
#[test]
fn gemma3_hybrid_equals_resident() {
    hybrid_equals_resident(common::GEMMA3, |n| vec![n / 2]);
}

/// Expert statistics (`--expert-stats`): every token's picks are counted
/// once per layer, whether the device or the host CPU computed the layer,
/// the counts of a hybrid run equal the resident run's (same routing), and
/// counting changes no logit.
#[test]
fn expert_stats_count_every_pick_and_change_nothing() {
    let Some(vocab) = model(common::SMOLLM2) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tmp");
    let preset = "qwen3moe-tiny";
    let path = synth_tiny(dir.path(), &vocab, preset, 5);
    let lm = LlamaModel::load(&path, true, 0).expect("vocab");
    let prompt = lm.tokenize(PROMPTS[0], true, true).expect("tokenize");
    let n_gen = 8;
    let stats = |cfg: EngineConfig| {
        let mut e = Engine::load(
            &path,
            &EngineConfig {
                expert_stats: true,
                ..cfg
            },
        )
        .expect("engine");
        let run = run_strata(&mut e, &prompt, n_gen).expect("run");
        let counts = e.router_counts().expect("counts on a mixture").clone();
        (run, counts, e.spec.hp.clone())
    };
    let plain = {
        let mut e = Engine::load(
            &path,
            &EngineConfig {
                repack: false,
                ..cpu_cfg()
            },
        )
        .expect("engine");
        assert!(e.router_counts().is_none());
        run_strata(&mut e, &prompt, n_gen).expect("run")
    };
    let (resident, counts, hp) = stats(EngineConfig {
        repack: false,
        ..cpu_cfg()
    });
    let (worst, diff) = compare(&resident, &plain);
    assert_eq!((worst, diff), (0.0, None), "counting changed the logits");
    // the prompt's tokens in one step, then n_gen - 1 one-token steps
    let tokens = (prompt.len() + n_gen - 1) as u64;
    assert_eq!(
        counts.picks(),
        hp.n_layer as u64 * hp.n_expert_used as u64 * tokens
    );
    // the host CPU computing half the FFN groups counts the same picks
    let n_layer = hp.n_layer as usize;
    let (hybrid, hcounts, _) = stats(hybrid_cfg(n_layer / 2, false));
    assert_eq!(compare(&hybrid, &plain), (0.0, None));
    assert_eq!(hcounts, counts);
    // a hot set of every expert catches every pick
    assert!((counts.hit_rate(hp.n_expert as usize) - 1.0).abs() < 1e-12);
}

/// The router skew of `strata-convert synth --router-skew` seen through the
/// engine's own routing: on a skewed file the two experts it names most
/// popular in each layer take far more than their uniform share (2 of 16:
/// 12.5%) of the picks of a real run, on the uniform file of the same seed
/// they do not.
#[test]
fn expert_stats_see_the_synthetic_router_skew() {
    let Some(vocab) = model(common::SMOLLM2) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tmp");
    let (uniform, skewed) = (
        common::synth_moe(dir.path(), &vocab, 0.0),
        common::synth_moe(dir.path(), &vocab, 1.0),
    );
    let ranks = common::expert_ranks(&skewed);
    let lm = LlamaModel::load(&skewed, true, 0).expect("vocab");
    let text = "The river runs past old stone mills where the town keeps its grain and its stories of floods and dry years alike. ".repeat(6);
    let prompt = lm.tokenize(&text, true, true).expect("tokenize");
    let top2_share = |path: &Path| {
        let mut e = Engine::load(
            path,
            &EngineConfig {
                expert_stats: true,
                ..cpu_cfg()
            },
        )
        .expect("engine");
        run_strata(&mut e, &prompt, 16).expect("run");
        let c = e.router_counts().expect("counts");
        let n_exp = e.spec.hp.n_expert as usize;
        let hits: u64 = (0..c.n_layer())
            .map(|l| {
                let r = &ranks[l * n_exp..(l + 1) * n_exp];
                c.count(l, r[0] as usize) + c.count(l, r[1] as usize)
            })
            .sum();
        hits as f64 / c.picks() as f64
    };
    let (u, s) = (top2_share(&uniform), top2_share(&skewed));
    eprintln!("share of picks to the file's top-2 experts: uniform {u:.3}, skewed {s:.3}");
    assert!(s > 0.18, "skewed file: {s:.3}");
    assert!(u < 0.16, "uniform file: {u:.3}");
}

/// Hot experts re-chosen from the router's picks counted as the engine
/// runs (`Engine::refresh_hot`, what `strata serve` does between
/// requests): on a skewed file, sets forced without counts (the first
/// experts of each layer) move to the experts the router picks most, catch more
/// of the counted picks than before, and the engine still equals the
/// resident one afterwards (the refilled pool holds the right experts).
#[test]
fn hot_experts_follow_the_router_counted_online() {
    let Some(vocab) = model(common::SMOLLM2) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tmp");
    let path = common::synth_moe(dir.path(), &vocab, 1.0);
    let ranks = common::expert_ranks(&path);
    let lm = LlamaModel::load(&path, true, 0).expect("vocab");
    let plain = EngineConfig {
        repack: false,
        ..cpu_cfg()
    };
    let mut resident = Engine::load(&path, &plain).expect("resident engine");
    let hp = resident.spec.hp.clone();
    let (n_layer, n_exp) = (hp.n_layer as usize, hp.n_expert as usize);
    // every group on the host: every mixture layer may keep hot experts
    let mut cfg = hybrid_cfg(2 * n_layer, false);
    cfg.paging.hot = strata::paging::HotExperts::Force(2);
    let mut hot = Engine::load(&path, &cfg).expect("hot engine");
    let before = hot.hot_plan().expect("a hot plan").clone();
    let hot_layers: Vec<usize> = (0..n_layer)
        .filter(|&l| !before.sets[2 * l + 1].is_empty())
        .collect();
    assert!(!hot_layers.is_empty(), "{:?}", before.sets);
    for &l in &hot_layers {
        // no counts: the first experts (at least a token's)
        let set = &before.sets[2 * l + 1];
        assert_eq!(*set, (0..set.len() as u32).collect::<Vec<_>>());
    }
    let text = "The river runs past old stone mills where the town keeps its grain and its stories of floods and dry years alike. ".repeat(4);
    let prompt = lm.tokenize(&text, true, true).expect("tokenize");
    let a = run_strata(&mut resident, &prompt, 16).expect("resident run");
    let b = run_strata(&mut hot, &prompt, 16).expect("hot run");
    assert_eq!(compare(&b, &a).1, None, "tokens differ before the refresh");
    // nothing is counted on the device side without --expert-stats; the
    // host computed every layer here
    let counts = hot
        .router_counts()
        .expect("the host counts its picks")
        .clone();
    assert!(counts.picks() > 0);
    let caught = |sets: &[Vec<u32>]| -> f64 {
        let (mut c, mut t) = (0u64, 0u64);
        for &l in &hot_layers {
            c += sets[2 * l + 1]
                .iter()
                .map(|&e| counts.count(l, e as usize))
                .sum::<u64>();
            t += counts.layer_picks(l);
        }
        c as f64 / t as f64
    };
    let r = hot
        .refresh_hot()
        .expect("refresh")
        .expect("a pool to refresh");
    let after = hot.hot_plan().expect("a hot plan").clone();
    eprintln!(
        "refresh: {} layers, {} bytes; counted picks caught {:.3} -> {:.3}",
        r.groups,
        r.bytes,
        caught(&before.sets),
        caught(&after.sets)
    );
    assert!(r.groups > 0 && r.bytes > 0, "{r:?}");
    assert!(caught(&after.sets) > caught(&before.sets) + 0.05);
    // the file's most popular expert of most hot layers is in its set now
    let top = hot_layers
        .iter()
        .filter(|&&l| after.sets[2 * l + 1].contains(&ranks[l * n_exp]))
        .count();
    assert!(2 * top >= hot_layers.len(), "{:?}", after.sets);
    for (x, y) in before.sets.iter().zip(&after.sets) {
        assert_eq!(x.len(), y.len(), "a set changed size");
    }
    // the refilled pool computes what the resident engine does
    for p in PROMPTS {
        let prompt = lm.tokenize(p, true, true).expect("tokenize");
        let a = run_strata(&mut resident, &prompt, 12).expect("resident run");
        let b = run_strata(&mut hot, &prompt, 12).expect("hot run");
        let (worst, diff) = compare(&b, &a);
        // the same greedy tokens, and logits equal up to rounding: on an
        // AVX2-only CPU (ggml's haswell module) one decode step of the
        // first prompt parts from the resident engine's in the last bits
        // (NMSE 4.5e-5 there, 5.6e-5 at worst after it; the other prompt
        // bit for bit; the same with one thread), where the machines of
        // earlier CI runs stayed below 1e-8. A pool refilled with its
        // experts in the wrong slots gave NMSE 2.03. The cause of the
        // rounding difference is not found yet.
        assert!(worst < 1e-3, "NMSE {worst} after the refresh");
        assert_eq!(diff, None, "tokens differ after the refresh");
        assert!(hot.last_step.host.hot_picks > 0);
    }
    // the same counts again: nothing moves
    let again = hot.refresh_hot().expect("refresh").expect("pool");
    assert!(again.groups <= r.groups);
}

/// Look-ahead (`--look-ahead`): while the host computes a mixture layer,
/// the next host layer's predicted experts go up into a slot and the
/// device computes the picks they catch; the host computes the others.
/// On a skewed tiny Qwen3-MoE with every FFN group on the host, one and
/// two layers ahead, alone and beside two hot experts a layer: logits within rounding of the resident
/// engine's and equal tokens, with experts uploaded and picks caught (a
/// slot computed without its upload would hold no weights).
#[test]
fn moe_look_ahead_equals_resident() {
    let Some(vocab) = model(common::SMOLLM2) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tmp");
    let path = common::synth_moe(dir.path(), &vocab, 1.0);
    let lm = LlamaModel::load(&path, true, 0).expect("vocab");
    let plain = EngineConfig {
        repack: false,
        ..cpu_cfg()
    };
    let mut resident = Engine::load(&path, &plain).expect("resident engine");
    let hp = resident.spec.hp.clone();
    let n_layer = hp.n_layer as usize;
    for (hot, depth) in [(0, 1), (0, 2), (2, 2)] {
        let mut cfg = hybrid_cfg(2 * n_layer, false);
        // half the experts: a guess from the layers before catches some
        cfg.paging.look_ahead = 8;
        cfg.paging.look_ahead_layers = depth;
        if hot > 0 {
            cfg.paging.hot = strata::paging::HotExperts::Force(hot);
        }
        let mut e = Engine::load(&path, &cfg).expect("look-ahead engine");
        let mut st = strata::engine::host::HostStats::default();
        for p in PROMPTS {
            let prompt = lm.tokenize(p, true, true).expect("tokenize");
            let a = run_strata(&mut resident, &prompt, 12).expect("resident run");
            let b = run_strata(&mut e, &prompt, 12).expect("look-ahead run");
            let (worst, diff) = compare(&b, &a);
            assert!(worst < 1e-8, "hot {hot}: NMSE {worst}");
            assert_eq!(diff, None, "hot {hot}: tokens differ");
            // the last step was one token: every layer's picks on one
            // side or the other, the first host layer's never predicted
            let h = e.last_step.host;
            assert_eq!(h.picks, (n_layer * hp.n_expert_used as usize) as u64);
            assert!(h.ahead_picks <= h.picks - h.hot_picks);
            st.ahead_picks += h.ahead_picks;
            st.ahead_hits += h.ahead_hits;
            st.ahead_experts += h.ahead_experts;
            st.ahead_bytes += h.ahead_bytes;
        }
        eprintln!(
            "hot {hot}, {depth} layers ahead: {} experts ({} bytes) uploaded; {} of {} picks caught",
            st.ahead_experts, st.ahead_bytes, st.ahead_hits, st.ahead_picks
        );
        assert!(st.ahead_experts > 0 && st.ahead_bytes > 0);
        assert!(st.ahead_hits > 0, "hot {hot}: no pick caught");
    }
}

/// Expert split on the CPU (`--expert-split`): for steps of many tokens
/// each streamed mixture layer uploads only its first experts, which the
/// device computes, while the host computes the picks of the others; both
/// are summed into the residual. Slots are poisoned after use, so an
/// expert the device was not sent would show as NaN. The logits stay
/// within rounding of the resident engine's (the experts' sum runs in
/// another order) and the tokens are equal, for splits keeping one
/// expert, half of them and all but one on the device; one-token steps
/// keep whole CPU groups.
#[test]
fn moe_expert_split_equals_resident() {
    let Some(vocab) = model(common::SMOLLM2) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tmp");
    for preset in ["mixtral-tiny", "qwen3moe-tiny"] {
        let path = synth_tiny(dir.path(), &vocab, preset, 7);
        let lm = LlamaModel::load(&path, true, 0).expect("vocab");
        let plain = EngineConfig {
            repack: false,
            ..cpu_cfg()
        };
        let mut resident = Engine::load(&path, &plain).expect("resident engine");
        let hp = resident.spec.hp.clone();
        let n_layer = hp.n_layer as usize;
        for dev in [1, hp.n_expert / 2, hp.n_expert - 1] {
            let mut cfg = hybrid_cfg(n_layer, false);
            cfg.paging.split = strata::paging::SplitInput {
                mode: strata::paging::ExpertSplit::Force(dev),
                min_tokens: 2,
                whole: None,
            };
            cfg.faults.poison_slots = true;
            let mut split = Engine::load(&path, &cfg).expect("split engine");
            let h = split.plan.placement.hybrid.clone().expect("a hybrid plan");
            assert_eq!(h.split_at(1), None);
            assert_eq!(h.split_at(2), Some(dev));
            assert!(h.cpu_groups(2).iter().all(|c| !c));
            // one-token steps: whole CPU groups; the prompt step: every FFN
            // group split, the bus carrying the attention groups whole and
            // the FFN groups' first experts
            let what = format!("{preset} dev={dev}");
            let st = split_matches_resident(&mut split, &mut resident, &lm, &what, |e| {
                assert_eq!(e.last_step.host.groups, n_layer as u64);
            });
            // (a layer none of whose picks went to the host's experts
            // computes nothing there)
            assert!(st.host.groups <= n_layer as u64, "{preset} dev={dev}");
            if dev <= hp.n_expert / 2 {
                assert_eq!(st.host.groups, n_layer as u64, "{preset} dev={dev}");
            }
            assert_eq!(st.pager.uploads, 2 * n_layer as u64);
            let carried = split_upload_bytes(&split, dev);
            assert_eq!(st.pager.bytes, carried, "{preset} dev={dev}: bytes up");
        }
    }
}

/// A split step that keeps some host groups whole (`--split-whole`): at
/// the prompt step half the mixture layers run whole on the CPU and the
/// others split, in one layer chain; the bus carries the attention groups
/// and the split layers' first experts, nothing of the whole ones. Logits
/// within rounding of the resident engine's, tokens equal, with slots
/// poisoned after use.
#[test]
fn moe_expert_split_beside_whole_cpu_groups_equals_resident() {
    let Some(vocab) = model(common::SMOLLM2) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tmp");
    let (path, lm, mut resident) = tiny_moe(dir.path(), &vocab, 9);
    let hp = resident.spec.hp.clone();
    let n_layer = hp.n_layer as usize;
    let dev = hp.n_expert / 2;
    for whole in [1, n_layer / 2, n_layer] {
        let mut cfg = hybrid_cfg(n_layer, false);
        cfg.paging.split = strata::paging::SplitInput {
            mode: strata::paging::ExpertSplit::Force(dev),
            min_tokens: 2,
            whole: Some(whole as u32),
        };
        cfg.faults.poison_slots = true;
        let mut split = Engine::load(&path, &cfg).expect("split engine");
        let h = split.plan.placement.hybrid.clone().expect("a hybrid plan");
        assert_eq!(h.split_at(2), Some(dev));
        let cpu = h.cpu_groups(2);
        assert_eq!(cpu.iter().filter(|c| **c).count(), whole);
        let what = format!("whole={whole}");
        let st = split_matches_resident(&mut split, &mut resident, &lm, &what, |_| {});
        // the whole groups and the split layers' host parts (each layer
        // leaves the host some picks at a prompt step)
        assert_eq!(st.host.groups, n_layer as u64, "{what}");
        let split_layers = (n_layer - whole) as u64;
        assert_eq!(st.pager.uploads, n_layer as u64 + split_layers, "{what}");
        // the bytes of every group but the whole ones, the split layers'
        // experts cut to `dev`
        let whole_bytes: u64 = split
            .spec
            .groups
            .iter()
            .enumerate()
            .filter(|(i, _)| cpu[*i])
            .map(|(_, g)| {
                let experts = expert_bytes(g);
                g.bytes() - experts + experts * dev as u64 / hp.n_expert as u64
            })
            .sum();
        assert_eq!(
            st.pager.bytes,
            split_upload_bytes(&split, dev) - whole_bytes,
            "{what}: bytes up"
        );
    }
}

/// The expert split with router counts beside the model: the device takes
/// each layer's most picked experts, here every other expert from the
/// last down (so the upload is a scatter of single experts and the slot's
/// zeroed ones lie between them), not the first ones. With slots poisoned
/// after use, logits within rounding of the resident engine's and tokens
/// equal, one-token and prompt steps; the bus carries the same bytes as a
/// prefix of as many experts.
#[test]
fn moe_expert_split_takes_the_most_picked_experts() {
    let Some(vocab) = model(common::SMOLLM2) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tmp");
    let (path, lm, mut resident) = tiny_moe(dir.path(), &vocab, 5);
    let hp = resident.spec.hp.clone();
    let (n_layer, n_expert) = (hp.n_layer as usize, hp.n_expert as usize);
    // counts: expert e picked e times if odd, never if even, in every layer
    let used = hp.n_expert_used as usize;
    let mut counts = strata::paging::routing::RouterCounts::new(n_layer, n_expert, used);
    let ids: Vec<i32> = (0..n_expert as i32)
        .filter(|e| e % 2 == 1)
        .flat_map(|e| std::iter::repeat_n(e, e as usize))
        .collect();
    let whole = ids.len() / used * used;
    for l in 0..n_layer {
        counts.add(l, &ids[..whole]).expect("counts");
    }
    let counts_path = dir.path().join("counts.json");
    std::fs::write(&counts_path, counts.to_json()).expect("write counts");
    let dev = hp.n_expert / 2;
    let mut cfg = hybrid_cfg(n_layer, false);
    cfg.paging.split = strata::paging::SplitInput {
        mode: strata::paging::ExpertSplit::Force(dev),
        min_tokens: 2,
        whole: None,
    };
    cfg.expert_counts = Some(counts_path);
    cfg.faults.poison_slots = true;
    let mut split = Engine::load(&path, &cfg).expect("split engine");
    let odd: Vec<bool> = (0..n_expert).map(|e| e % 2 == 1).collect();
    for l in 0..hp.n_layer {
        assert_eq!(split.split_experts(l, dev), odd, "layer {l}");
    }
    let st = split_matches_resident(&mut split, &mut resident, &lm, "by counts", |_| {});
    assert!(st.host.groups > 0, "no layer left picks to the host");
    assert_eq!(st.pager.bytes, split_upload_bytes(&split, dev), "bytes up");
}

/// A tiny Qwen3-MoE file synthesized in `dir` from `seed`, its tokenizer
/// and the resident engine (plain host weights) it is checked against.
fn tiny_moe(dir: &Path, vocab: &Path, seed: u64) -> (std::path::PathBuf, LlamaModel, Engine) {
    let path = synth_tiny(dir, vocab, "qwen3moe-tiny", seed);
    let lm = LlamaModel::load(&path, true, 0).expect("vocab");
    let plain = EngineConfig {
        repack: false,
        ..cpu_cfg()
    };
    let resident = Engine::load(&path, &plain).expect("resident engine");
    (path, lm, resident)
}

/// Bytes of group `g`'s expert tensors.
fn expert_bytes(g: &strata::model::GroupSpec) -> u64 {
    g.weights
        .iter()
        .filter(|w| w.role.is_some_and(|r| r.is_expert()))
        .map(|w| w.size)
        .sum()
}

/// `split` against `resident` (`what` names the case): 12 tokens after
/// each of PROMPTS (logits within rounding, tokens equal; `each` then
/// checks `split`'s last, one-token step), then one prompt step of
/// PROMPTS[1] (logits within rounding), whose statistics it returns.
fn split_matches_resident(
    split: &mut Engine,
    resident: &mut Engine,
    lm: &LlamaModel,
    what: &str,
    mut each: impl FnMut(&Engine),
) -> strata::engine::StepStats {
    for p in PROMPTS {
        let prompt = lm.tokenize(p, true, true).expect("tokenize");
        let a = run_strata(resident, &prompt, 12).expect("resident run");
        let b = run_strata(split, &prompt, 12).expect("split run");
        let (worst, diff) = compare(&b, &a);
        assert!(worst < 1e-8, "{what}: NMSE {worst}");
        assert_eq!(diff, None, "{what}: tokens differ");
        each(split);
    }
    let prompt = lm.tokenize(PROMPTS[1], true, true).expect("tokenize");
    split.clear();
    resident.clear();
    let batch = common::all_positions(&[prompt]);
    let a = resident.decode(&batch).expect("resident prompt");
    let b = split.decode(&batch).expect("split prompt");
    assert!(common::nmse(&b, &a) < 1e-8, "{what}: prompt");
    split.last_step
}

/// The bytes a step of an engine streaming every group carries when each
/// mixture layer is split with `dev` experts on the device: every weight
/// but the expert tensors whole, and `dev` of each expert tensor's experts.
fn split_upload_bytes(e: &Engine, dev: u32) -> u64 {
    let whole: u64 = e.spec.groups.iter().map(|g| g.bytes()).sum();
    let experts: u64 = e.spec.groups.iter().map(expert_bytes).sum();
    whole - experts + experts * dev as u64 / e.spec.hp.n_expert as u64
}

/// Hot experts (`--hot-experts`): each mixture layer's first three experts
/// kept in the device's pool. One-token steps compute whole CPU groups'
/// hot picks on the device and the rest on the host; prompt steps split
/// each layer three ways (expert 0 uploaded into the slot, experts 1 and
/// 2 from the pool, the others on the host). Logits within rounding of the
/// resident engine's, tokens equal, with slots poisoned after use.
#[test]
fn moe_hot_experts_equal_resident() {
    let Some(vocab) = model(common::SMOLLM2) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tmp");
    for preset in ["mixtral-tiny", "qwen3moe-tiny"] {
        let path = synth_tiny(dir.path(), &vocab, preset, 11);
        let lm = LlamaModel::load(&path, true, 0).expect("vocab");
        let plain = EngineConfig {
            repack: false,
            ..cpu_cfg()
        };
        let mut resident = Engine::load(&path, &plain).expect("resident engine");
        let hp = resident.spec.hp.clone();
        let n_layer = hp.n_layer as usize;
        let mut cfg = hybrid_cfg(n_layer, false);
        cfg.paging.split = strata::paging::SplitInput {
            mode: strata::paging::ExpertSplit::Force(1),
            min_tokens: 2,
            whole: None,
        };
        cfg.paging.hot = strata::paging::HotExperts::Force(3);
        cfg.faults.poison_slots = true;
        let mut hot = Engine::load(&path, &cfg).expect("hot engine");
        let (mut picks, mut on_gpu) = (0u64, 0u64);
        for p in PROMPTS {
            let prompt = lm.tokenize(p, true, true).expect("tokenize");
            let a = run_strata(&mut resident, &prompt, 12).expect("resident run");
            let b = run_strata(&mut hot, &prompt, 12).expect("hot run");
            let (worst, diff) = compare(&b, &a);
            assert!(worst < 1e-8, "{preset}: NMSE {worst}");
            assert_eq!(diff, None, "{preset}: tokens differ");
            // the last step was one token: every pick of every layer went
            // to one side or the other
            let st = hot.last_step.host;
            assert_eq!(st.picks, (n_layer * hp.n_expert_used as usize) as u64);
            picks += st.picks;
            on_gpu += st.hot_picks;
        }
        // some picks on each side (3 of the 8 experts are hot)
        assert!(
            on_gpu > 0 && on_gpu < picks,
            "{preset}: {on_gpu} of {picks}"
        );
        let prompt = lm.tokenize(PROMPTS[1], true, true).expect("tokenize");
        hot.clear();
        resident.clear();
        let batch = common::all_positions(&[prompt]);
        let a = resident.decode(&batch).expect("resident prompt");
        let b = hot.decode(&batch).expect("hot prompt");
        assert!(common::nmse(&b, &a) < 1e-8, "{preset}: prompt");
        let st = hot.last_step;
        assert!(st.host.hot_picks > 0, "{preset}: no pick of experts 1-2");
        assert!(st.host.hot_picks < st.host.picks);
        // the bus carried the split's first expert only, as without the pool
        let carried = split_upload_bytes(&hot, 1);
        assert_eq!(st.pager.bytes, carried, "{preset}: bytes up");
    }
}

/// Routed uploads (`--routed-uploads on`): every streamed mixture layer of
/// a prompt step sends ahead its other weights and the experts the counts
/// make all but sure (experts 0 and 1 of every layer, from a counts file
/// that names them the most picked), runs its router, then uploads the
/// other experts its tokens picked; experts nobody picked never go up.
/// Slots are poisoned after use, so an expert the graph read without its
/// upload would show as NaN. Logits within rounding of the resident
/// engine's and equal tokens; the bytes the bus carried are the routed
/// groups' parts and the attention groups whole.
#[test]
fn moe_routed_uploads_equal_resident() {
    let Some(vocab) = model(common::SMOLLM2) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tmp");
    let path = common::synth_moe(dir.path(), &vocab, 1.0);
    let lm = LlamaModel::load(&path, true, 0).expect("vocab");
    let plain = EngineConfig {
        repack: false,
        ..cpu_cfg()
    };
    let mut resident = Engine::load(&path, &plain).expect("resident engine");
    let hp = resident.spec.hp.clone();
    let (n_layer, n_exp, n_used) = (
        hp.n_layer as usize,
        hp.n_expert as usize,
        hp.n_expert_used as usize,
    );
    // counts naming experts 0 and 1 of every layer the most picked
    let mut counts = strata::paging::routing::RouterCounts::new(n_layer, n_exp, n_used);
    let ids: Vec<i32> = (0..5000 * n_used).map(|i| (i % 2) as i32).collect();
    for l in 0..n_layer {
        counts.add(l, &ids).expect("counts");
    }
    let counts_path = dir.path().join("counts.json");
    strata::engine::save_router_counts(&counts_path, &counts).expect("save counts");
    let cfg = EngineConfig {
        expert_counts: Some(counts_path),
        paging: PagingOptions {
            stream_all: true,
            hybrid: Hybrid::Off,
            routed: strata::paging::RoutedUploads::Force,
            ..PagingOptions::default()
        },
        repack: false,
        faults: strata::engine::Faults {
            poison_slots: true,
            ..Default::default()
        },
        ..cpu_cfg()
    };
    let mut routed = Engine::load(&path, &cfg).expect("routed engine");
    for p in PROMPTS {
        let prompt = lm.tokenize(p, true, true).expect("tokenize");
        let a = run_strata(&mut resident, &prompt, 12).expect("resident run");
        let b = run_strata(&mut routed, &prompt, 12).expect("routed run");
        let (worst, diff) = compare(&b, &a);
        assert!(worst < 1e-8, "NMSE {worst}");
        assert_eq!(diff, None, "tokens differ");
        // one-token steps stream whole groups
        assert_eq!(routed.last_step.routed.groups, 0);
    }
    // a prompt step: every FFN group routed
    let prompt = lm.tokenize(PROMPTS[0], true, true).expect("tokenize");
    routed.clear();
    resident.clear();
    let batch = common::all_positions(&[prompt]);
    let a = resident.decode(&batch).expect("resident prompt");
    let b = routed.decode(&batch).expect("routed prompt");
    assert!(common::nmse(&b, &a) < 1e-8);
    let st = routed.last_step;
    let r = st.routed;
    eprintln!("routed prompt step: {r:?}, {} bytes up", st.pager.bytes);
    assert_eq!(r.groups, n_layer as u64);
    assert_eq!(r.ahead, 2 * n_layer as u64, "experts 0 and 1 sent ahead");
    assert!(r.after > 0 && r.after <= r.picked);
    assert!(r.picked < (n_layer * n_exp) as u64, "some expert unpicked");
    let whole: u64 = routed.spec.groups.iter().map(|g| g.bytes()).sum();
    let attn: u64 = routed
        .spec
        .groups
        .iter()
        .filter(|g| g.kind == strata::model::GroupKind::Attn)
        .map(|g| g.bytes())
        .sum();
    assert_eq!(st.pager.bytes, attn + r.ahead_bytes + r.after_bytes);
    assert!(st.pager.bytes < whole);
    assert_eq!(r.whole_bytes, whole - attn);
}

/// A hybrid step in two halves of rows (`--cpu-halves`): the host computes
/// its groups for one half while the device computes the other's. A
/// prompt step of one sequence (the second half attends to the first's
/// keys, written a stage earlier) and a step of several sequences give
/// the resident engine's logits; one-token steps run whole.
#[test]
fn cpu_halves_equal_resident() {
    let Some(vocab) = model(common::SMOLLM2) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tmp");
    let moe = synth_tiny(dir.path(), &vocab, "qwen3moe-tiny", 9);
    let Some(dense) = model(common::SMOLLM2) else {
        return;
    };
    for path in [dense, moe] {
        let lm = LlamaModel::load(&path, true, 0).expect("vocab");
        let plain = EngineConfig {
            repack: false,
            ..cpu_cfg()
        };
        let mut resident = Engine::load(&path, &plain).expect("resident engine");
        let n_layer = resident.spec.hp.n_layer as usize;
        // (the plan spreads k groups from the last layer's on: one alone
        // is the last layer's, which runs whole)
        let mut ks = vec![2, n_layer / 2, n_layer];
        ks.retain(|&k| k >= 2);
        ks.dedup();
        for k in ks {
            let mut cfg = hybrid_cfg(k, false);
            cfg.paging.cpu_halves = true;
            // a stage holds its streamed groups: room for several
            cfg.paging.slots = n_layer + 1;
            let mut halves = Engine::load(&path, &cfg).expect("halves engine");
            let name = format!("{} k={k}", path.display());
            let long = lm
                .tokenize(
                    &"The quick brown fox jumps over the lazy dog. ".repeat(4),
                    true,
                    true,
                )
                .expect("tokenize");
            let short: Vec<Vec<u32>> = PROMPTS
                .iter()
                .chain(PROMPTS.iter())
                .chain(PROMPTS.iter())
                .map(|p| lm.tokenize(p, true, true).expect("tokenize"))
                .collect();
            for prompts in [vec![long], short] {
                let batch = common::all_positions(&prompts);
                assert!(batch.len() >= 32, "{name}: {} tokens", batch.len());
                halves.clear();
                resident.clear();
                let a = resident.decode(&batch).expect("resident step");
                let b = halves.decode(&batch).expect("halves step");
                let st = halves.last_step;
                assert!(st.halved > 0, "{name}: the step ran whole");
                // each CPU group before the last layer computed twice
                assert_eq!(st.host.groups, 2 * k as u64 - 1, "{name}: CPU groups");
                let worst = strata::parity::nmse(&b, &a);
                assert!(worst < 1e-10, "{name}: NMSE {worst}");
            }
            // then decode one token a sequence: whole steps
            for p in PROMPTS {
                let prompt = lm.tokenize(p, true, true).expect("tokenize");
                let a = run_strata(&mut resident, &prompt, 8).expect("resident run");
                let b = run_strata(&mut halves, &prompt, 8).expect("halves run");
                let (worst, diff) = compare(&b, &a);
                assert!(worst < 1e-10, "{name}: NMSE {worst}");
                assert_eq!(diff, None, "{name}: tokens differ");
                assert_eq!(halves.last_step.halved, 0);
            }
        }
    }
}
