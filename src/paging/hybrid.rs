//! Hybrid decode: which streamed layer groups the host CPU computes from
//! its own copy of their weights while the bus streams the others. Plain
//! Rust.
//!
//! Layers run in order, so the CPU and the bus overlap by interleaving:
//! while the CPU computes group i, the copy stream uploads the next GPU
//! groups into free slots. The CPU chain and the GPU's computations wait on
//! each other (the residual stream hops between them), the bus runs beside
//! both, as far ahead as the slot rings allow. The plan predicts a step by
//! simulating exactly that (see `simulate`): the closed form
//! max(bus, CPU + GPU) missed by 13-36% on the H100 machine, where the GPU
//! waits for uploads that bunch up behind FFN groups.
//!
//! Only FFN groups go to the CPU: attention needs its layer's KV cache,
//! which lives with the GPU, and a Llama layer's FFN holds about four
//! fifths of its bytes, so FFN groups alone balance any split. The CPU is
//! compute-bound on larger steps, so the split is chosen per step size from
//! one set of host copies: moving resident weights costs, re-choosing which
//! of them the CPU computes costs nothing.

use super::groups::GroupInfo;
pub use super::groups::Where;
use crate::model::GroupKind;

/// The most tokens a step may have for the CPU to take part (the host's
/// step buffers are sized for it); larger steps stream everything. 64
/// covers a mixture of experts' batched decode (64 sequences) for the
/// expert split (`paging::split`); whole CPU groups go only up to the
/// largest step the CPU was measured at (`CpuInput::measured_tokens`)
/// unless forced (see `sizes`).
pub const MAX_TOKENS: u32 = 64;

/// What the planner knows about the host CPU as a compute tier.
#[derive(Clone, Debug, PartialEq)]
pub struct CpuInput {
    /// Measured CPU seconds per weight byte for a step of one token.
    pub s_per_byte_1: f64,
    /// ... and for a step of `probe_tokens` tokens.
    pub s_per_byte_n: f64,
    pub probe_tokens: u32,
    /// Where measured (a mixture's steps of many sequences): tokens and
    /// seconds per byte of a larger step, taken from the model's own kind
    /// of product (its experts' `mul_mat_id` for a mixture), which the
    /// rate follows beyond `probe_tokens` in place of the line through
    /// the first two points.
    pub big: Option<(u32, f64)>,
    /// Host bytes free for the CPU's (repacked) copies of its groups.
    pub host_room: u64,
    /// Seconds one round trip of the residual (device -> host -> device) costs.
    pub hop_s: f64,
    /// Measured GPU seconds per weight byte at decode (its compute is in
    /// the CPU's chain: each waits for the other).
    pub gpu_s_per_byte: f64,
    /// Measured GPU seconds per group beyond its weight reads (kernel
    /// launches: about 0.1 ms on the H100 machine, where 36 resident groups
    /// took 6.9 ms for 3.3 ms of weight reads).
    pub gpu_group_s: f64,
    /// Measured CPU seconds per group beyond its weight reads: a host
    /// group's graph is about twenty nodes, each ending at a barrier of
    /// the host's threads (about 0.2 ms a group at decode on the H200
    /// machine, which a probe of the expert product alone missed: run 186).
    pub cpu_group_s: f64,
    /// Measured host-to-device bytes/s while the CPU computes (the two
    /// share the host's memory bandwidth); None: the bus's own rate.
    pub bus_bw_beside: Option<f64>,
    /// Exactly this many groups go to the CPU at every step size (tests,
    /// benchmarks); None: as many as minimize the predicted step.
    pub force: Option<usize>,
    /// Whether and from which step size mixture layers split their
    /// experts between the device and the CPU (`paging::split`).
    pub split: SplitInput,
    /// Whether a step's last uploads are followed by the next step's
    /// first (`SlotRing::carry_next`): the simulation then prices a step
    /// as a decode loop repeats it.
    pub carry: bool,
    /// Whether steps take their CPU groups from the cheapest host groups
    /// where that is faster ([`tiers`]); false: one tier.
    pub tiers: bool,
}

impl CpuInput {
    /// CPU seconds per byte for a step of `n` tokens: measured at 1 and at
    /// `probe_tokens`, linear in between and beyond (the CPU is
    /// memory-bound on one token and compute-bound on many); beyond
    /// `probe_tokens`, where `big` was measured, the line through that
    /// point instead.
    pub fn s_per_byte(&self, n: u32) -> f64 {
        let p = self.probe_tokens.max(2);
        let floor = self.s_per_byte_1.min(self.s_per_byte_n);
        if let Some((b, sb)) = self.big.filter(|&(b, _)| b > p && n > p) {
            // the line through the probe's step and the larger one
            let slope = (sb - self.s_per_byte_n) / f64::from(b - p);
            return (self.s_per_byte_n + slope * f64::from(n - p)).max(floor.min(sb));
        }
        let slope = (self.s_per_byte_n - self.s_per_byte_1) / (f64::from(p) - 1.0);
        (self.s_per_byte_1 + slope * (n.max(1) as f64 - 1.0)).max(floor)
    }

    /// The largest step the CPU was measured at: beyond it its speed is
    /// extrapolated.
    pub fn measured_tokens(&self) -> u32 {
        self.big
            .map_or(self.probe_tokens, |(b, _)| b.max(self.probe_tokens))
    }

    /// The same CPU `f` times slower per byte.
    pub fn scaled(&self, f: f64) -> CpuInput {
        CpuInput {
            s_per_byte_1: self.s_per_byte_1 * f,
            s_per_byte_n: self.s_per_byte_n * f,
            big: self.big.map(|(b, s)| (b, s * f)),
            ..self.clone()
        }
    }

    /// The CPU's time on `g` at a step of `n` tokens against the probe's
    /// mean group ([`GroupInfo::cpu_scale`], linear in between and flat
    /// beyond its two steps).
    pub fn scale(&self, g: &GroupInfo, n: u32) -> f64 {
        let [s1, sb] = g.cpu_scale();
        let b = self.measured_tokens().max(2);
        let f = (f64::from(n.clamp(1, b)) - 1.0) / f64::from(b - 1);
        s1 + (sb - s1) * f
    }

    /// CPU seconds a step of `n` tokens computes group `g` (a mixture's
    /// experts only where its tokens were routed), hops excluded.
    pub fn group_s(&self, g: &GroupInfo, n: u32) -> f64 {
        // hot experts' picks go to the device at small steps
        // (`paging::experts`)
        let hot = if n <= super::experts::HOT_MAX_TOKENS {
            g.hot_share()
        } else {
            0.0
        };
        g.compute_s(n, |t| self.s_per_byte(t)) * (1.0 - hot) * self.scale(g, n) + self.cpu_group_s
    }

    /// CPU seconds a step of `n` tokens computes the experts an expert
    /// split leaves the host of group `g` (all but the device's `k`).
    pub fn split_s(&self, g: &GroupInfo, n: u32, k: u32) -> f64 {
        g.split_cpu_s(n, k, |t| self.s_per_byte(t)) * self.scale(g, n) + self.cpu_group_s
    }

    /// GPU seconds a step of `n` tokens (a few: decode) computes `g`.
    pub fn gpu_group_s(&self, g: &GroupInfo, n: u32) -> f64 {
        g.read_bytes(n) as f64 * self.gpu_s_per_byte + self.gpu_group_s
    }
}

/// The seconds per byte at a step of `n` tokens under which
/// [`GroupInfo::compute_s`] gives `secs` for `g`, with `s1` the one-token
/// rate: a mixture's expert product measured at that step, as
/// [`CpuInput::big`] takes it.
pub fn s_per_byte_at(g: &GroupInfo, n: u32, secs: f64, s1: f64) -> f64 {
    let extra = (secs - g.read_bytes(n) as f64 * s1) / g.token_bytes().max(1) as f64;
    s1 + extra.max(0.0)
}

/// The CPU's part of a plan.
#[derive(Clone, Debug, PartialEq)]
pub struct HybridPlan {
    /// Groups the host keeps a CPU copy of (the most the CPU computes).
    pub host: Vec<bool>,
    /// Each group's cost tier for the CPU (see [`tiers`]; 0: the cheapest).
    pub tier: Vec<u8>,
    pub host_bytes: u64,
    /// For a step of n tokens (index n - 1, n <= MAX_TOKENS): how many of
    /// the host groups the CPU computes, and the predicted step.
    pub per_size: Vec<SizePlan>,
    /// A mixture's expert split, at the step sizes where it applies (its
    /// steps compute `SplitSize::cpu_groups` whole groups on the CPU, the
    /// split layers' cold experts beside them).
    pub split: Option<SplitPlan>,
}

/// The split for one step size.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SizePlan {
    pub cpu_groups: usize,
    /// The costliest tier the step's CPU groups come from: they are
    /// spread over the host groups of this tier and cheaper, or with
    /// `fill` are all the cheaper ones and the rest spread over this
    /// tier's ([`pick`]).
    pub tier: u8,
    pub fill: bool,
    pub cpu_bytes: u64,
    pub predicted: Prediction,
    /// Whether a step of this size ends by uploading the next one's first
    /// groups (`SlotRing::carry_next`): where `CpuInput::carry` allows it
    /// and the simulation finds the repeated step faster with it.
    pub carry: bool,
}

// The expert split's data (planned by `paging::split`).

/// Whether steps split their mixture layers' experts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertSplit {
    /// At the step sizes where the plan predicts it beats whole groups.
    Auto,
    Off,
    /// The first `k` experts on the device at every step of at least
    /// `SplitInput::min_tokens` tokens, whatever the prediction (tests,
    /// benchmarks).
    Force(u32),
}

/// What the split planner is told beyond the hybrid plan's inputs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SplitInput {
    pub mode: ExpertSplit,
    /// The fewest tokens a split step has: below it a step reads few
    /// experts and whole CPU groups read only those.
    pub min_tokens: u32,
    /// Whole CPU groups a split step keeps beside its split layers (host
    /// groups spread over the layers as a hybrid step's are; the layers
    /// left split). None: the plan's choice under `Auto`, none under
    /// `Force`.
    pub whole: Option<u32>,
}

/// Off by default: on the H200 no split beat whole CPU groups by more than
/// noise at 64 sequences (docs/device-runs.md, runs 39-40).
impl Default for SplitInput {
    fn default() -> Self {
        SplitInput {
            mode: ExpertSplit::Off,
            min_tokens: 32,
            whole: None,
        }
    }
}

/// The split for every step size.
#[derive(Clone, Debug, PartialEq)]
pub struct SplitPlan {
    /// The groups that split (streamed mixture FFN groups the host keeps a
    /// copy of).
    pub groups: Vec<bool>,
    /// Index n - 1 for a step of n tokens, n <= MAX_TOKENS.
    pub per_size: Vec<SplitSize>,
}

/// A split at one step size.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SplitSize {
    /// Experts of each split group on the device; 0: no split at this size.
    pub dev_experts: u32,
    /// Host groups the CPU computes whole beside the split ones
    /// ([`HybridPlan::whole_groups`]); the others of `SplitPlan::groups`
    /// split.
    pub cpu_groups: u32,
    pub predicted: Prediction,
}

impl SplitPlan {
    /// The device's experts at a step of `n` tokens, if it splits.
    pub fn at(&self, n: u32) -> Option<u32> {
        self.size(n).map(|s| s.dev_experts)
    }

    /// The split at a step of `n` tokens, if it splits.
    pub fn size(&self, n: u32) -> Option<SplitSize> {
        let i = (n as usize).checked_sub(1)?;
        self.per_size.get(i).copied().filter(|s| s.dev_experts > 0)
    }
}

/// Where each group runs when the groups in `split` keep `k` experts on
/// the device, but those in `cpu`, which the CPU computes whole.
pub fn split_placement(streamed: &[bool], split: &[bool], cpu: &[bool], k: u32) -> Vec<Where> {
    streamed
        .iter()
        .zip(split)
        .zip(cpu)
        .map(|((&s, &x), &c)| match (s, x, c) {
            (_, _, true) => Where::Cpu,
            (_, true, false) => Where::Split(k),
            (true, false, false) => Where::Bus,
            (false, false, false) => Where::Resident,
        })
        .collect()
}

/// A step's predicted cost: the compute chain (CPU and GPU groups in
/// order) and the time it stalls waiting for uploads; the bus beside it.
#[derive(Clone, Copy, Debug, PartialEq, Default)]
pub struct Prediction {
    /// Bytes over the bus / bus rate (busy time, beside the chain).
    pub bus_s: f64,
    /// CPU groups' compute plus the residual's hops.
    pub cpu_s: f64,
    /// GPU compute.
    pub gpu_s: f64,
    /// Time the chain waits for uploads (the step starts with drained
    /// streams, and uploads bunch up behind large groups).
    pub stall_s: f64,
    /// Routed groups' round trips (`paging::routed::layer_cost_s`).
    pub routed_s: f64,
}

impl Prediction {
    pub fn step_s(&self) -> f64 {
        self.cpu_s + self.gpu_s + self.stall_s + self.routed_s
    }
}

/// Simulates a step of `n` tokens: groups in order on one compute chain;
/// uploads of `Bus` groups in order on one copy stream, each into the slot
/// its ring's group `slots` earlier used (so it waits for that group's
/// compute) and enqueued by the host when it issued the ring's group
/// `slots - 1` earlier, or before, at a CPU group after the group `slots`
/// earlier (the host issues GPU groups at once but waits for the chain at
/// each CPU group, and issues what the rings' windows allow before it
/// computes one); a GPU group waits for its upload; a CPU group costs a
/// residual hop and its bytes at the CPU's rate. Where the CPU takes part,
/// uploads run at the bus's rate beside the CPU. A `Routed` group's
/// expected bytes go up as a `Bus` group's; at its turn the chain and the
/// bus both wait out its router's round trip. With `c.carry` the step is
/// the one a decode loop repeats: the rings' first groups went up at the
/// end of the step before (`SlotRing::carry_next`); the step starts at
/// once, its chain waiting for each of them as for any upload (its inputs
/// go up on the compute stream, not behind them: `engine::inputsup`).
pub fn simulate(
    groups: &[GroupInfo],
    at: &[Where],
    slots: (usize, usize),
    copy_bw: f64,
    c: &CpuInput,
    n: u32,
) -> Prediction {
    let sim = Step {
        groups,
        at,
        slots,
        copy_bw,
        c,
        n,
    };
    let first = sim.run(None);
    if !c.carry {
        return first.0;
    }
    sim.run(Some(&first.1)).0
}

/// What a step leaves the next (`SlotRing::carry_next`): per ring, how
/// many of its first groups went up at its end and when each was in, and
/// when the bus was free, counted from the end of its chain.
struct Carried {
    groups: [usize; 2],
    ready_s: [Vec<f64>; 2],
    past_end_s: f64,
}

/// [`simulate`]'s inputs.
struct Step<'a> {
    groups: &'a [GroupInfo],
    at: &'a [Where],
    slots: (usize, usize),
    copy_bw: f64,
    c: &'a CpuInput,
    n: u32,
}

impl Step<'_> {
    /// The step, the first groups of each ring already up where `carried`
    /// says; with what it carries into the next.
    fn run(&self, carried: Option<&Carried>) -> (Prediction, Carried) {
        let Step {
            groups,
            at,
            slots,
            copy_bw,
            c,
            n,
        } = *self;
        let ring_of = |k: GroupKind| usize::from(k == GroupKind::Ffn);
        let depth = [slots.0.max(1), slots.1.max(1)];
        // per ring: compute-finish times of its groups so far, in order
        let mut done: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
        // per ring: when the host issued each of its groups
        let mut issued_at: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
        // per ring: at each CPU group, its groups computed so far and the host's
        // time (the window's uploads issued then)
        let mut eager: [Vec<(usize, f64)>; 2] = [Vec::new(), Vec::new()];
        let mut p = Prediction::default();
        // the step starts at once; the bus once the uploads carried into it
        // are in
        let t0 = 0.0;
        let up_front = carried.map_or([0, 0], |k| k.groups);
        // t: the chain; host: where the host thread is
        let (mut t, mut bus_free, mut host) = (t0, carried.map_or(t0, |k| k.past_end_s), t0);
        // uploads are issued in order as far ahead as the rings allow; the
        // next one's index in `order`
        let order: Vec<usize> = (0..groups.len())
            .filter(|&i| matches!(at[i], Where::Bus | Where::Split(_) | Where::Routed(_)))
            .collect();
        let mut uploaded: Vec<f64> = Vec::with_capacity(order.len());
        let mut issued = [0usize; 2];
        // the host's time when it released the step's last streamed group
        let mut host_last = t0;
        // the CPU computes for most of a step it takes part in, and its reads
        // slow the bus's
        let cpu_works = at.iter().any(|w| matches!(w, Where::Cpu | Where::Split(_)));
        let copy_bw = match c.bus_bw_beside {
            Some(b) if cpu_works => b,
            _ => copy_bw,
        };
        for (i, g) in groups.iter().enumerate() {
            match at[i] {
                Where::Resident => {
                    let d = c.gpu_group_s(g, n);
                    p.gpu_s += d;
                    t += d;
                }
                Where::Cpu => {
                    for r in 0..2 {
                        eager[r].push((done[r].len(), host));
                    }
                    let hot = g.hot_share();
                    let d = if hot > 0.0 && n <= super::experts::HOT_MAX_TOKENS {
                        // hot experts: the device computes their picks in a
                        // graph of its own while the CPU computes the others',
                        // and their rows go up and come back (a second hop)
                        let gpu = g.read_bytes(n) as f64 * hot * c.gpu_s_per_byte + c.gpu_group_s;
                        2.0 * c.hop_s + gpu.max(c.group_s(g, n))
                    } else {
                        c.group_s(g, n) + c.hop_s
                    };
                    p.cpu_s += d;
                    t += d;
                    host = t;
                }
                Where::Bus | Where::Split(_) | Where::Routed(_) => {
                    // issue uploads up to this one: each waits for the bus and
                    // for its slot's previous group to finish computing
                    issued_at[ring_of(g.kind)].push(host);
                    let me = uploaded.len();
                    while uploaded.len() <= me {
                        let j = order[uploaded.len()];
                        let r = ring_of(groups[j].kind);
                        let k = issued[r];
                        let d = groups[j].upload_bytes(at[j]) as f64 / copy_bw.max(1.0);
                        p.bus_s += d;
                        issued[r] += 1;
                        if k < up_front[r] {
                            // carried up by the step before
                            let ready = carried.map_or(t0, |c| c.ready_s[r][k]);
                            uploaded.push(ready);
                            continue;
                        }
                        let slot_free = if k >= depth[r] {
                            done[r][k - depth[r]]
                        } else {
                            0.0
                        };
                        let enqueued = match (k + 1).checked_sub(depth[r]) {
                            None | Some(0) => t0,
                            Some(m) => {
                                let at_cpu = eager[r].iter().find(|e| e.0 >= m).map(|e| e.1);
                                let issued = issued_at[r].get(m).copied();
                                at_cpu
                                    .into_iter()
                                    .chain(issued)
                                    .fold(f64::INFINITY, f64::min)
                            }
                        };
                        let start = bus_free.max(slot_free).max(enqueued);
                        bus_free = start + d;
                        uploaded.push(bus_free);
                    }
                    let ready = uploaded[me];
                    if ready > t {
                        p.stall_s += ready - t;
                        t = ready;
                    }
                    if let Where::Split(k) = at[i] {
                        // the router's picks come to the host, then both
                        // sides compute at once
                        let f = g.device_pick_share(k);
                        let cpu = c.split_s(g, n, k);
                        let d = c.hop_s + (c.gpu_group_s(g, n) * f).max(cpu);
                        p.cpu_s += d;
                        t += d;
                        host = t;
                    } else if let Where::Routed(_) = at[i] {
                        // the router's round trip: the chain waits for the
                        // picks and their copies, and the bus, holding back
                        // what comes after them, carries nothing else
                        let d = super::routed::layer_cost_s(n);
                        p.routed_s += d;
                        t += d;
                        host = t;
                        bus_free = bus_free.max(t);
                        let d = c.gpu_group_s(g, n);
                        p.gpu_s += d;
                        t += d;
                    } else {
                        let d = c.gpu_group_s(g, n);
                        p.gpu_s += d;
                        t += d;
                    }
                    done[ring_of(g.kind)].push(t);
                    host_last = host;
                }
            }
        }
        // the next step's first groups of each ring (up to the first that is
        // not a whole upload), in step order, once every streamed group was
        // released: each into the slot its ring's last group of that slot
        // freed
        let mut next: Vec<(usize, usize, usize)> = Vec::new();
        let mut per_ring = [0usize; 2];
        for &j in &order {
            let r = ring_of(groups[j].kind);
            let i = per_ring[r];
            per_ring[r] += 1;
            let longer = issued[r] > depth[r];
            if longer
                && i < depth[r]
                && next.iter().filter(|x| x.1 == r).count() == i
                && at[j] == Where::Bus
            {
                next.push((j, r, i));
            }
        }
        let mut out = Carried {
            groups: [0, 0],
            ready_s: [Vec::new(), Vec::new()],
            past_end_s: 0.0,
        };
        for (j, r, i) in next {
            let n_r = done[r].len();
            // the ring's last group in slot i
            let last = i + (n_r.max(i + 1) - 1 - i) / depth[r] * depth[r];
            let start = bus_free.max(done[r][last]).max(host_last);
            bus_free = start + groups[j].upload_bytes(Where::Bus) as f64 / copy_bw.max(1.0);
            out.groups[r] += 1;
            out.ready_s[r].push((bus_free - t).max(0.0));
        }
        out.past_end_s = (bus_free - t).max(0.0);
        (p, out)
    }
}

/// Attention slots for hybrid decode: while the CPU computes an FFN group,
/// the bus should keep uploading the next attention groups, so the ring
/// holds one FFN group's CPU time of uploads, half again for slack, plus the
/// two any ring needs (at least `base`, at most 16).
pub fn attn_slots(groups: &[GroupInfo], copy_bw: f64, c: &CpuInput, base: usize) -> usize {
    let attn = super::groups::max_bytes(groups, GroupKind::Attn);
    let ffn_s = groups
        .iter()
        .filter(|g| g.kind == GroupKind::Ffn)
        .map(|g| c.group_s(g, 1))
        .fold(0.0, f64::max);
    if attn == 0 {
        return base;
    }
    let during = ffn_s * copy_bw;
    let need = (1.5 * during / attn as f64).ceil().min(14.0) as usize + 2;
    need.max(base)
}

/// `k` of the `m` items 0..m, spread evenly (every m/k-th), in order.
pub fn spread(m: usize, k: usize) -> Vec<usize> {
    let k = k.min(m);
    (0..m).filter(|&j| (j + 1) * k / m > j * k / m).collect()
}

/// Where each group runs when the CPU computes the groups in `cpu`.
pub fn placement(streamed: &[bool], cpu: &[bool]) -> Vec<Where> {
    streamed
        .iter()
        .zip(cpu)
        .map(|(&s, &c)| match (s, c) {
            (_, true) => Where::Cpu,
            (true, false) => Where::Bus,
            (false, false) => Where::Resident,
        })
        .collect()
}

/// Chooses the host groups and the split per step size. `streamed` marks
/// the groups that do not stay on the device. Where the groups cost the
/// CPU differently per byte ([`GroupInfo::cpu_scale`]), a step takes its
/// CPU groups from the cheapest tier that gives the fastest step. On the
/// Qwen3-30B-A3B shape in Q4_K_M, half the layers' `ffn_down` is Q6_K
/// (1.2x the time per byte of a Q4_K layer at 64 tokens, run 182), and
/// the plan spread its 10 host groups of a 64-token step over all 31: 3.7
/// GB a step, six or seven of them Q6_K (runs 183-187), where ten Q4_K
/// ones are 3.3-3.4 GB at the faster rate.
pub fn plan_hybrid(
    groups: &[GroupInfo],
    streamed: &[bool],
    slots: (usize, usize),
    copy_bw: f64,
    c: &CpuInput,
) -> Option<HybridPlan> {
    // candidates: streamed FFN groups, in layer order
    let cand: Vec<usize> = (0..groups.len())
        .filter(|&i| streamed[i] && groups[i].kind == GroupKind::Ffn)
        .collect();
    // the most that fit the host room (groups of one kind have one size
    // in a Llama model; take the largest to be safe)
    let largest = cand.iter().map(|&i| groups[i].bytes).max().unwrap_or(0);
    let fit = c
        .host_room
        .checked_div(largest)
        .map_or(0, |f| (f as usize).min(cand.len()));
    let cand_tier = tiers(groups, &cand, c.tiers);
    let best = best_split(
        groups, streamed, slots, copy_bw, c, 1, &cand, &cand_tier, fit,
    );
    if best.k == 0 {
        return None;
    }
    let hosts = pick(&cand, &cand_tier, best.tier, best.k, best.fill);
    let mut host = vec![false; groups.len()];
    for &i in &hosts {
        host[i] = true;
    }
    // the steps' tiers: among the host groups, as `sizes` takes them
    let tier = tiers(groups, &hosts, c.tiers);
    let per_size = sizes(groups, streamed, slots, copy_bw, c, &host);
    Some(HybridPlan {
        host_bytes: best.bytes,
        host,
        tier,
        per_size,
        // planned beside this one (`paging::split::plan_split`)
        split: None,
    })
}

/// Each group's tier of CPU cost among `idx` (group indices): groups of
/// the same kinds of matrix cost the same per byte
/// ([`GroupInfo::cpu_scale`] at the largest step, where the kinds differ
/// most), tier 0 the cheapest; at most 4 tiers, the costlier kinds merged.
/// `on` false: every group tier 0.
pub fn tiers(groups: &[GroupInfo], idx: &[usize], on: bool) -> Vec<u8> {
    if !on {
        return vec![0; groups.len()];
    }
    let cost = |i: usize| groups[i].cpu_scale()[1];
    let mut levels: Vec<f64> = idx.iter().map(|&i| cost(i)).collect();
    levels.sort_by(f64::total_cmp);
    levels.dedup_by(|a, b| (*a - *b).abs() <= 1e-6 * b.abs());
    let levels: Vec<f64> = spread(levels.len(), 4).iter().map(|&j| levels[j]).collect();
    let mut out = vec![0u8; groups.len()];
    for &i in idx {
        let t = levels.iter().position(|&v| cost(i) <= v * (1.0 + 1e-6));
        out[i] = t.unwrap_or(levels.len().saturating_sub(1)) as u8;
    }
    out
}

/// The groups of `idx` of tier `t` or cheaper, in layer order.
fn in_tier(idx: &[usize], tier: &[u8], t: u8) -> Vec<usize> {
    idx.iter().copied().filter(|&i| tier[i] <= t).collect()
}

/// `k` of the groups `idx` (group indices in layer order), in layer
/// order: spread evenly over those of tier `t` and cheaper, or with `fill`
/// every group cheaper than `t` and the rest spread over tier `t`'s own
/// (where `k` exceeds the cheaper ones). Spread, a step of 13 host groups
/// where 12 are Q4_K takes six or seven Q6_K ones (the Qwen3-30B-A3B shape
/// in Q4_K_M); filled, it takes one.
pub fn pick(idx: &[usize], tier: &[u8], t: u8, k: usize, fill: bool) -> Vec<usize> {
    let pool = in_tier(idx, tier, t);
    let lower: Vec<usize> = pool.iter().copied().filter(|&i| tier[i] < t).collect();
    if !fill || k <= lower.len() {
        return spread(pool.len(), k).iter().map(|&j| pool[j]).collect();
    }
    let own: Vec<usize> = pool.iter().copied().filter(|&i| tier[i] == t).collect();
    let mut out: Vec<usize> = spread(own.len(), k - lower.len())
        .iter()
        .map(|&j| own[j])
        .chain(lower)
        .collect();
    out.sort_unstable();
    out
}

/// [`best_split`]'s choice.
struct Best {
    /// Groups the CPU computes, [`pick`]ed from those of `tier` and
    /// cheaper (`fill`: the cheaper ones first).
    k: usize,
    tier: u8,
    fill: bool,
    bytes: u64,
    predicted: Prediction,
}

/// The best split for a step of `n` tokens: up to `most` of the groups in
/// `pool` (group indices in layer order), spread over those of a tier
/// and cheaper (`tier`, by group index), the cheapest tiers tried first.
#[allow(clippy::too_many_arguments)]
fn best_split(
    groups: &[GroupInfo],
    streamed: &[bool],
    slots: (usize, usize),
    copy_bw: f64,
    c: &CpuInput,
    n: u32,
    pool: &[usize],
    tier: &[u8],
    most: usize,
) -> Best {
    let top = pool.iter().map(|&i| tier[i]).max().unwrap_or(0);
    // by tier: how many groups of that tier and cheaper, and cheaper only
    let upto: Vec<usize> = (0..=top).map(|t| in_tier(pool, tier, t).len()).collect();
    let below = |t: u8| t.checked_sub(1).map_or(0, |u| upto[u as usize]);
    let eval = |t: u8, k: usize, fill: bool| {
        let picked = pick(pool, tier, t, k, fill);
        let mut cpu = vec![false; groups.len()];
        for &i in &picked {
            cpu[i] = true;
        }
        let at = placement(streamed, &cpu);
        Best {
            k: picked.len(),
            tier: t,
            fill,
            bytes: picked.iter().map(|&i| groups[i].bytes).sum(),
            predicted: simulate(groups, &at, slots, copy_bw, c, n),
        }
    };
    // each tier's counts spread over it and the cheaper ones, and those
    // beyond the cheaper ones' count filled
    let candidates = (0..=top).flat_map(|t| {
        let spread = (0..=upto[t as usize].min(most)).map(move |k| (t, k, false));
        let filled = (below(t) + 1..=upto[t as usize].min(most)).map(move |k| (t, k, true));
        spread.chain(filled)
    });
    let fastest = |a: &Best, b: &Best| a.predicted.step_s().total_cmp(&b.predicted.step_s());
    if let Some(f) = c.force {
        // the cheapest tiers that hold that many, spread or filled
        let f = f.min(most);
        let t = (0..=top).find(|&t| upto[t as usize] >= f).unwrap_or(top);
        return candidates
            .filter(|&(u, k, _)| u == t && k == f)
            .map(|(t, k, fill)| eval(t, k, fill))
            .min_by(fastest)
            .unwrap_or_else(|| eval(t, f, false));
    }
    candidates
        .map(|(t, k, fill)| eval(t, k, fill))
        .min_by(fastest)
        .expect("k = 0 is always a candidate")
}

/// The split for every step size, from the host groups `host` (whose CPU
/// copies exist): choosing again with other rates costs nothing.
pub fn sizes(
    groups: &[GroupInfo],
    streamed: &[bool],
    slots: (usize, usize),
    copy_bw: f64,
    c: &CpuInput,
    host: &[bool],
) -> Vec<SizePlan> {
    let hosts: Vec<usize> = (0..groups.len()).filter(|&i| host[i]).collect();
    let tier = tiers(groups, &hosts, c.tiers);
    (1..=MAX_TOKENS)
        .map(|n| size_plan(groups, streamed, slots, copy_bw, c, n, &hosts, &tier))
        .collect()
}

/// The split for a step of `n` tokens among the host groups `hosts` (of
/// tiers `tier`, by group index), the CPU as `c` says.
#[allow(clippy::too_many_arguments)]
pub(super) fn size_plan(
    groups: &[GroupInfo],
    streamed: &[bool],
    slots: (usize, usize),
    copy_bw: f64,
    c: &CpuInput,
    n: u32,
    hosts: &[usize],
    tier: &[u8],
) -> SizePlan {
    // beyond the measured steps the CPU's speed is extrapolated, and the
    // extrapolation was 1.6-2x too fast: on two H200s (70B Q4_0, 12G, run
    // 57) 64-token steps ran 1.43x faster on one GPU and 2.0x on two
    // without the CPU's groups; on a mixture whole CPU groups gave 64
    // sequences 2% at best (runs 33-34). So whole groups only up to the
    // measured size, unless forced.
    let most = if c.force.is_none() && n > c.measured_tokens() {
        0
    } else {
        hosts.len()
    };
    let best = |c: &CpuInput| best_split(groups, streamed, slots, copy_bw, c, n, hosts, tier, most);
    let warm = best(c);
    // without carrying, where that is faster (carried uploads that outlast
    // the step's tail hold the bus into the next)
    let cold = || CpuInput {
        carry: false,
        ..c.clone()
    };
    let (b, carry) = match c.carry.then(|| best(&cold())) {
        Some(b) if b.predicted.step_s() < warm.predicted.step_s() => (b, false),
        _ => (warm, c.carry),
    };
    SizePlan {
        cpu_groups: b.k,
        tier: b.tier,
        fill: b.fill,
        cpu_bytes: b.bytes,
        predicted: b.predicted,
        carry,
    }
}

impl HybridPlan {
    /// Whether a step of `n` tokens ends by uploading the next one's first
    /// groups ([`SizePlan::carry`]; sizes beyond the plan's carry).
    pub fn carry_at(&self, n: u32) -> bool {
        n.checked_sub(1)
            .and_then(|i| self.per_size.get(i as usize))
            .is_none_or(|s| s.carry)
    }

    /// The device's experts of each split group at a step of `n` tokens,
    /// where that step splits.
    pub fn split_at(&self, n: u32) -> Option<u32> {
        self.split.as_ref()?.at(n)
    }

    /// Where each group runs at a step of `n` tokens (`streamed`: the
    /// groups not resident).
    pub fn placement(&self, n: u32, streamed: &[bool]) -> Vec<Where> {
        let cpu = self.cpu_groups(n);
        match (self.split_at(n), &self.split) {
            (Some(k), Some(s)) => split_placement(streamed, &s.groups, &cpu, k),
            _ => placement(streamed, &cpu),
        }
    }

    /// The groups the CPU computes whole in a step of `n` tokens (none
    /// above MAX_TOKENS): `per_size[n - 1].cpu_groups` of the host groups
    /// of its tier and cheaper, or where the step splits its split size's
    /// `cpu_groups` ([`HybridPlan::whole_groups`]).
    pub fn cpu_groups(&self, n: u32) -> Vec<bool> {
        if n == 0 || n > MAX_TOKENS {
            return vec![false; self.host.len()];
        }
        if let Some(s) = self.split.as_ref().and_then(|s| s.size(n)) {
            return self.whole_groups(n, s.cpu_groups as usize);
        }
        let s = self.per_size[n as usize - 1];
        self.pick_hosts(s.tier, s.cpu_groups, s.fill)
    }

    /// `count` host groups for a step of `n` tokens, spread evenly over
    /// the layers so the bus always has uploads queued: from the tier a
    /// hybrid step of that size takes its groups from and cheaper, or from
    /// the next costlier tiers where those hold fewer.
    pub fn whole_groups(&self, n: u32, count: usize) -> Vec<bool> {
        let from = n
            .checked_sub(1)
            .and_then(|i| self.per_size.get(i as usize))
            .map_or(0, |s| s.tier);
        let top = self.tier.iter().copied().max().unwrap_or(0).max(from);
        let tier = (from..=top)
            .find(|&t| {
                let pool = (0..self.host.len()).filter(|&i| self.host[i] && self.tier[i] <= t);
                pool.count() >= count
            })
            .unwrap_or(top);
        self.pick_hosts(tier, count, false)
    }

    /// `count` of the host groups of `tier` and cheaper ([`pick`]).
    fn pick_hosts(&self, tier: u8, count: usize, fill: bool) -> Vec<bool> {
        let mut out = vec![false; self.host.len()];
        let hosts: Vec<usize> = (0..self.host.len()).filter(|&i| self.host[i]).collect();
        for i in pick(&hosts, &self.tier, tier, count, fill) {
            out[i] = true;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::super::testutil::{cpu, h100_cpu, layers, qwen3moe_30b, GPU_GROUP_S};
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn spread_is_even_and_exact() {
        assert_eq!(spread(10, 0), Vec::<usize>::new());
        assert_eq!(spread(10, 10), (0..10).collect::<Vec<_>>());
        assert_eq!(spread(10, 5), vec![1, 3, 5, 7, 9]);
        assert_eq!(spread(4, 9), vec![0, 1, 2, 3]);
    }

    #[test]
    fn equal_rates_split_the_streamed_bytes_in_half() {
        // 70B-like: attn 85, ffn 396 per layer, 60 layers streamed, bus and
        // CPU both 1 byte per unit of time
        let g = layers(60, 85, 396);
        let streamed = vec![true; g.len()];
        let p = plan_hybrid(&g, &streamed, (8, 3), 1.0, &cpu(1.0)).expect("hybrid pays");
        let s = p.per_size[0];
        let total: u64 = g.iter().map(|g| g.bytes).sum();
        // balanced: the CPU takes about half of everything streamed, and
        // the step costs little more than half of streaming it all
        let share = s.cpu_bytes as f64 / total as f64;
        assert!((0.4..0.6).contains(&share), "CPU share {share}");
        assert!(
            s.predicted.step_s() < total as f64 * 0.56,
            "{:?}",
            s.predicted
        );
        // bigger steps give the CPU less, and none past the limit
        assert!(p.per_size[15].cpu_groups < s.cpu_groups);
        assert!(p.cpu_groups(MAX_TOKENS + 1).iter().all(|c| !c));
    }

    #[test]
    fn whole_cpu_groups_stop_at_the_probe_size_unless_forced() {
        // a CPU as fast as the bus even at 64 tokens (by its
        // extrapolation): still no whole group beyond the probe's 16
        let g = layers(60, 85, 396);
        let streamed = vec![true; g.len()];
        let c = CpuInput {
            s_per_byte_n: 1.0,
            ..cpu(1.0)
        };
        let p = plan_hybrid(&g, &streamed, (8, 3), 1.0, &c).expect("hybrid pays");
        assert!(p.per_size[15].cpu_groups > 0);
        for n in 17..=MAX_TOKENS {
            assert_eq!(p.per_size[n as usize - 1].cpu_groups, 0, "n = {n}");
            assert!(p.cpu_groups(n).iter().all(|c| !c));
        }
        // forced (tests, benchmarks): every size up to the limit
        let f = CpuInput {
            force: Some(3),
            ..c
        };
        let p = plan_hybrid(&g, &streamed, (8, 3), 1.0, &f).expect("forced");
        assert_eq!(p.cpu_groups(64).iter().filter(|c| **c).count(), 3);
    }

    /// Each step size carries the next step's first uploads only where the
    /// simulation finds the repeated step faster with them.
    #[test]
    fn steps_carry_where_the_simulation_says_it_pays() {
        // the first layer resident and long to compute: without carrying,
        // the next step's first uploads run while it computes; carried,
        // they ran at the end of the step before, and the step computes
        // its first layer at once (it waits for them no more than for any
        // upload): no slower
        let mut g = layers(4, 1, 1);
        g[0] = GroupInfo::dense(GroupKind::Attn, 40);
        let streamed: Vec<bool> = (0..g.len()).map(|i| i >= 2).collect();
        let c = CpuInput {
            gpu_s_per_byte: 0.1,
            carry: true,
            ..cpu(1.0)
        };
        let none = vec![false; g.len()];
        let at = placement(&streamed, &none);
        let cold = CpuInput {
            carry: false,
            ..c.clone()
        };
        let (warm_s, cold_s) = (
            simulate(&g, &at, (2, 2), 1.0, &c, 1).step_s(),
            simulate(&g, &at, (2, 2), 1.0, &cold, 1).step_s(),
        );
        assert!(warm_s <= cold_s, "{cold_s} against {warm_s}");
        let p = sizes(&g, &streamed, (2, 2), 1.0, &c, &none);
        assert!(p[0].carry);
        assert_eq!(p[0].predicted.step_s(), warm_s);
        // the last FFN group on the CPU: the attention ring's first
        // uploads go up while it computes (6.25 s against 8.25)
        let g = layers(3, 1, 1);
        let streamed = vec![true; g.len()];
        let mut host = vec![false; g.len()];
        host[5] = true;
        let c = CpuInput {
            gpu_s_per_byte: 0.25,
            force: Some(1),
            carry: true,
            ..cpu(3.0)
        };
        let p = sizes(&g, &streamed, (2, 2), 1.0, &c, &host);
        assert!(p[0].carry);
        assert_eq!(p[0].cpu_groups, 1);
        assert_eq!(p[0].predicted.step_s(), 6.25);
        // never where the pager may not
        let off = CpuInput { carry: false, ..c };
        assert!(!sizes(&g, &streamed, (2, 2), 1.0, &off, &host)[0].carry);
    }

    /// A CPU measured at a larger step: its rate goes through all three
    /// points, whole groups go up to that step (not beyond), and the
    /// rate solved from a measured expert product gives that product's
    /// time back.
    #[test]
    fn a_measured_larger_step_extends_whole_cpu_groups_to_it() {
        let c = CpuInput {
            big: Some((64, 3.0)),
            ..cpu(1.0)
        };
        assert_eq!(c.s_per_byte(1), 1.0);
        assert_eq!(c.s_per_byte(16), 8.0);
        assert_eq!(c.s_per_byte(64), 3.0);
        assert!((c.s_per_byte(40) - 5.5).abs() < 1e-12);
        assert_eq!(c.measured_tokens(), 64);
        assert_eq!(cpu(1.0).measured_tokens(), 16);
        let slower = c.scaled(2.0);
        assert_eq!(slower.s_per_byte(64), 6.0);
        assert_eq!(slower.s_per_byte(1), 2.0);

        // an expert group and the time its product took at 64 tokens
        let g = qwen3moe_30b(1, 0.0)[1];
        let secs = 0.015;
        let s1 = 1e-9 / 80.0;
        let m = CpuInput {
            s_per_byte_1: s1,
            s_per_byte_n: s1 * 1.5,
            big: Some((64, s_per_byte_at(&g, 64, secs, s1))),
            ..cpu(s1)
        };
        assert!((m.group_s(&g, 64) - secs).abs() < 1e-9 * secs.max(1.0));

        // a CPU about as fast as the bus per group at 64 tokens: whole
        // groups at 64 now, none beyond the measured size's rate otherwise
        let g = layers(60, 85, 396);
        let streamed = vec![true; g.len()];
        let probe_only = CpuInput {
            s_per_byte_n: 1.0,
            ..cpu(1.0)
        };
        let measured = CpuInput {
            big: Some((64, 1.0)),
            ..probe_only.clone()
        };
        let p = plan_hybrid(&g, &streamed, (8, 3), 1.0, &probe_only).expect("hybrid pays");
        assert_eq!(p.per_size[63].cpu_groups, 0);
        let p = plan_hybrid(&g, &streamed, (8, 3), 1.0, &measured).expect("hybrid pays");
        assert!(p.per_size[63].cpu_groups > 0);
        let a = CpuInput {
            big: Some((32, 1.0)),
            ..probe_only
        };
        let p = plan_hybrid(&g, &streamed, (8, 3), 1.0, &a).expect("hybrid pays");
        assert!(p.per_size[31].cpu_groups > 0);
        assert_eq!(p.per_size[32].cpu_groups, 0);
    }

    #[test]
    fn slow_cpu_gets_nothing() {
        let g = layers(8, 10, 40);
        let streamed = vec![true; g.len()];
        assert_eq!(plan_hybrid(&g, &streamed, (3, 3), 1.0, &cpu(1e6)), None);
    }

    #[test]
    fn host_room_caps_the_copies() {
        let g = layers(8, 10, 40);
        let streamed = vec![true; g.len()];
        let mut c = cpu(1.0);
        c.host_room = 80;
        let p = plan_hybrid(&g, &streamed, (3, 3), 1.0, &c).unwrap();
        assert_eq!(p.host_bytes, 80);
        c.host_room = 39;
        assert_eq!(plan_hybrid(&g, &streamed, (3, 3), 1.0, &c), None);
    }

    #[test]
    fn the_bus_runs_slower_beside_the_cpu() {
        let g = layers(2, 1, 1);
        let c = CpuInput {
            bus_bw_beside: Some(2.0),
            ..cpu(1.0)
        };
        // no CPU group: the bus's own rate
        let alone = simulate(&g, &[Where::Bus; 4], (2, 2), 4.0, &c, 1);
        assert_eq!(alone.bus_s, 1.0);
        // the CPU takes one group: the other three upload at half the rate
        let at = [Where::Bus, Where::Bus, Where::Bus, Where::Cpu];
        let beside = simulate(&g, &at, (2, 2), 4.0, &c, 1);
        assert_eq!(beside.bus_s, 1.5);
    }

    #[test]
    fn simulation_follows_the_slowest_resource() {
        let g = layers(2, 1, 1);
        let c = CpuInput {
            gpu_s_per_byte: 0.25,
            ..cpu(3.0)
        };
        // everything over the bus: the chain waits for each upload in turn
        // and computes its last group after the last upload
        let p = simulate(&g, &[Where::Bus; 4], (2, 2), 1.0, &c, 1);
        assert_eq!(p.bus_s, 4.0);
        assert_eq!(p.step_s(), 4.25);
        // everything on the CPU: its bytes at its rate, no bus
        let p = simulate(&g, &[Where::Cpu; 4], (2, 2), 1.0, &c, 1);
        assert_eq!((p.bus_s, p.step_s()), (0.0, 12.0));
        // attention over the bus while the CPU computes the FFN groups:
        // the second upload hides under the first FFN group
        let at = [Where::Bus, Where::Cpu, Where::Bus, Where::Cpu];
        let p = simulate(&g, &at, (2, 2), 1.0, &c, 1);
        assert_eq!(p.stall_s, 1.0);
        assert_eq!(p.step_s(), 1.0 + 0.25 + 3.0 + 0.25 + 3.0);
        // one slot: the second upload waits for the first group's
        // compute; the host issues it before it computes the CPU group in
        // between, so it still hides under that group
        let p = simulate(&g, &at, (1, 1), 1.0, &c, 1);
        assert_eq!(p.stall_s, 1.0);
        // the same step repeated, the next step's first upload carried
        // into it during the last CPU group: no stall at all
        let carry = CpuInput {
            carry: true,
            ..c.clone()
        };
        let p = simulate(&g, &at, (1, 1), 1.0, &carry, 1);
        assert_eq!(p.stall_s, 0.0);
        assert_eq!(p.bus_s, 2.0, "the carried upload is the step's bytes still");
        // a ring of no more groups than slots carries nothing (the next
        // step would wait for all of them before computing any)
        let p = simulate(&g, &[Where::Bus; 4], (2, 2), 1.0, &carry, 1);
        assert_eq!(p.step_s(), 4.25);
        // three layers, the last FFN group on the CPU: the attention
        // ring's first two uploads go up while the CPU computes it, and
        // the next step starts with them in
        let g = layers(3, 1, 1);
        let mut at = [Where::Bus; 6];
        at[5] = Where::Cpu;
        let cold = simulate(&g, &at, (2, 2), 1.0, &c, 1);
        assert_eq!(cold.step_s(), 5.0 + 0.25 + 3.0);
        let p = simulate(&g, &at, (2, 2), 1.0, &carry, 1);
        assert_eq!(p.bus_s, 5.0);
        assert_eq!(p.step_s(), 3.0 + 0.25 + 3.0);
    }

    /// A mixture of experts at decode (Qwen3-30B-A3B's shape at 8 GB: 48
    /// layers of 10.6 MiB attention and 340 MiB of experts, 8 of 128 per
    /// token; the first 39 groups resident): a token reads 6% of an FFN
    /// group, so the CPU computes every streamed FFN group and the step is
    /// a fraction of streaming them, where the dense view of the same
    /// bytes keeps most on the bus.
    #[test]
    fn mixture_decode_computes_every_streamed_expert_group_on_the_cpu() {
        let moe = qwen3moe_30b(48, 0.0);
        let dense: Vec<GroupInfo> = moe
            .iter()
            .map(|g| GroupInfo::dense(g.kind, g.bytes))
            .collect();
        let streamed: Vec<bool> = (0..moe.len()).map(|i| i >= 39).collect();
        let c = CpuInput {
            bus_bw_beside: Some(45e9),
            ..h100_cpu()
        };
        let n_ffn = (0..moe.len())
            .filter(|&i| streamed[i] && moe[i].kind == GroupKind::Ffn)
            .count();
        let slots = (attn_slots(&moe, 55e9, &c, 3), 3);
        let p = plan_hybrid(&moe, &streamed, slots, 55e9, &c).expect("hybrid pays");
        assert_eq!(p.per_size[0].cpu_groups, n_ffn);
        let step = p.per_size[0].predicted.step_s();
        let bus_only = simulate(
            &moe,
            &placement(&streamed, &vec![false; moe.len()]),
            slots,
            55e9,
            &c,
            1,
        );
        assert!(
            step < 0.25 * bus_only.step_s(),
            "{step} against {}",
            bus_only.step_s()
        );
        // costed as dense bytes the CPU would take part of the groups only
        let d = plan_hybrid(&dense, &streamed, slots, 55e9, &c).expect("hybrid pays");
        assert!(d.per_size[0].cpu_groups < n_ffn);
        assert!(d.per_size[0].predicted.step_s() > 2.0 * step);
        // 32-token steps read most experts: the CPU's share shrinks
        assert!(p.per_size[31].cpu_groups <= n_ffn);
        assert!(p.per_size[31].predicted.step_s() > step);
    }

    /// The first `resident` groups resident, `k` of the streamed FFN groups
    /// on the CPU (spread as the plan spreads them), the rest on the bus.
    fn spread_on_cpu(g: &[GroupInfo], resident: usize, k: usize) -> Vec<Where> {
        let streamed: Vec<bool> = (0..g.len()).map(|i| i >= resident).collect();
        let cand: Vec<usize> = (0..g.len())
            .filter(|&i| streamed[i] && g[i].kind == GroupKind::Ffn)
            .collect();
        let mut cpu = vec![false; g.len()];
        for j in spread(cand.len(), k) {
            cpu[cand[j]] = true;
        }
        placement(&streamed, &cpu)
    }

    /// Half a mixture's streamed layers dearer for the CPU (a Q6_K
    /// `ffn_down` beside Q4_K ones): at 64 tokens, where the CPU takes a
    /// few groups, it takes the cheaper ones, and the step is no slower
    /// than spreading the same count over all; every step's CPU groups are
    /// host groups of its tier or cheaper, as many as the plan says.
    #[test]
    fn the_cpu_takes_the_cheaper_groups_first() {
        let mut g = qwen3moe_30b(48, 0.0);
        for (i, x) in g.iter_mut().enumerate() {
            if let Some(e) = x.experts.as_mut().filter(|_| (i / 2) % 2 == 1) {
                e.cpu_scale = [1.15, 1.3];
            }
        }
        let streamed: Vec<bool> = (0..g.len()).map(|i| i >= 40).collect();
        let c = CpuInput {
            big: Some((64, 3.0 / 24e9)),
            bus_bw_beside: Some(54e9),
            gpu_group_s: GPU_GROUP_S,
            cpu_group_s: 200e-6,
            ..h100_cpu()
        };
        let p = plan_hybrid(&g, &streamed, (7, 3), 55e9, &c).expect("hybrid pays");
        let dear = |i: usize| g[i].cpu_scale()[1] > 1.0;
        assert!(
            (0..g.len()).any(|i| p.host[i] && dear(i)),
            "every streamed group is a host at decode"
        );
        let s = p.per_size[63];
        assert!(s.cpu_groups > 0);
        let cpu = p.cpu_groups(64);
        assert!(
            cpu.iter().enumerate().all(|(i, &x)| !x || !dear(i)),
            "{cpu:?}"
        );
        // the same count spread over every host group
        let hosts: Vec<usize> = (0..g.len()).filter(|&i| p.host[i]).collect();
        let mut all = vec![false; g.len()];
        for j in spread(hosts.len(), s.cpu_groups) {
            all[hosts[j]] = true;
        }
        let mixed = simulate(&g, &placement(&streamed, &all), (7, 3), 55e9, &c, 64);
        assert!(
            s.predicted.step_s() <= mixed.step_s(),
            "{:?} against {mixed:?}",
            s.predicted
        );
        // without tiers (`--no-cpu-tiers`): one tier, spread over all
        let one = CpuInput {
            tiers: false,
            ..c.clone()
        };
        let q = plan_hybrid(&g, &streamed, (7, 3), 55e9, &one).expect("hybrid pays");
        assert!(q.tier.iter().all(|&t| t == 0));
        assert!(q.per_size[63].predicted.step_s() >= s.predicted.step_s());
        assert!((0..g.len()).any(|i| q.cpu_groups(64)[i] && dear(i)));
        for n in 1..=MAX_TOKENS {
            let z = p.per_size[n as usize - 1];
            let cpu = p.cpu_groups(n);
            assert_eq!(cpu.iter().filter(|x| **x).count(), z.cpu_groups, "n = {n}");
            for i in (0..g.len()).filter(|&i| cpu[i]) {
                assert!(p.host[i] && p.tier[i] <= z.tier, "n = {n}, group {i}");
            }
        }
    }

    #[test]
    fn pick_spreads_or_fills_from_the_cheapest() {
        // groups 0..8 by index; tiers 0 1 0 1 1 1 1 0
        let idx: Vec<usize> = (0..8).collect();
        let tier = [0, 1, 0, 1, 1, 1, 1, 0];
        // spread over tier 0 only
        assert_eq!(pick(&idx, &tier, 0, 2, false), vec![2, 7]);
        // four spread over all eight take one cheap group
        assert_eq!(pick(&idx, &tier, 1, 4, false), vec![1, 3, 5, 7]);
        // filled: the three cheap ones and one of the five dear, in order
        assert_eq!(pick(&idx, &tier, 1, 4, true), vec![0, 2, 6, 7]);
        // no more than the cheaper ones: filling is spreading over them
        assert_eq!(
            pick(&idx, &tier, 1, 3, true),
            pick(&idx, &tier, 1, 3, false)
        );
        assert_eq!(pick(&idx, &tier, 1, 8, true), idx);
        assert_eq!(pick(&idx, &tier, 1, 9, true), idx);
    }

    /// A step that wants more host groups than the cheapest tier holds
    /// (the Qwen3-30B-A3B shape at 64 sequences: 12 Q4_K host groups of
    /// 31) takes all the cheap ones and the fewest dear ones it needs, not
    /// the count spread over both tiers (six or seven dear ones at 13), and
    /// is predicted faster than every spread of the same tiers.
    #[test]
    fn a_step_beyond_the_cheap_tier_fills_it_first() {
        let mut g = qwen3moe_30b(48, 0.0);
        // among the streamed layers (20-47) every fourth one cheap
        for (i, x) in g.iter_mut().enumerate() {
            if let Some(e) = x.experts.as_mut().filter(|_| (i / 2) % 4 != 0) {
                e.cpu_scale = [1.3, 1.6];
            }
        }
        let streamed: Vec<bool> = (0..g.len()).map(|i| i >= 40).collect();
        let c = CpuInput {
            big: Some((64, 1.0 / 40e9)),
            bus_bw_beside: Some(55e9),
            gpu_group_s: GPU_GROUP_S,
            cpu_group_s: 40e-6,
            ..h100_cpu()
        };
        let p = plan_hybrid(&g, &streamed, (7, 3), 55e9, &c).expect("hybrid pays");
        let s = p.per_size[63];
        let cheap: Vec<usize> = (0..g.len())
            .filter(|&i| p.host[i] && p.tier[i] == 0)
            .collect();
        assert!(
            s.fill && s.cpu_groups > cheap.len(),
            "{s:?}, {} cheap",
            cheap.len()
        );
        let cpu = p.cpu_groups(64);
        assert!(cheap.iter().all(|&i| cpu[i]), "{cpu:?}");
        let hosts: Vec<usize> = (0..g.len()).filter(|&i| p.host[i]).collect();
        for t in 0..=1 {
            for k in 0..=hosts.len() {
                let mut set = vec![false; g.len()];
                for i in pick(&hosts, &p.tier, t, k, false) {
                    set[i] = true;
                }
                let q = simulate(&g, &placement(&streamed, &set), (7, 3), 55e9, &c, 64);
                assert!(
                    s.predicted.step_s() <= q.step_s(),
                    "tier {t}, {k} spread: {q:?} against {:?}",
                    s.predicted
                );
            }
        }
        // forced to that count, the step fills the same way
        let forced = CpuInput {
            force: Some(s.cpu_groups),
            ..c.clone()
        };
        let f = plan_hybrid(&g, &streamed, (7, 3), 55e9, &forced).expect("forced");
        assert_eq!(f.cpu_groups(64), cpu);
    }

    /// A group's CPU cost: its scale, linear from one token to the
    /// largest measured step and flat beyond, and the per-group overhead.
    #[test]
    fn a_groups_cpu_cost_follows_its_scale_and_overhead() {
        let mut g = qwen3moe_30b(1, 0.0).remove(1);
        let c = CpuInput {
            big: Some((64, 3.0 / 24e9)),
            ..h100_cpu()
        };
        let base: Vec<f64> = [1, 16, 64].iter().map(|&n| c.group_s(&g, n)).collect();
        g.experts.as_mut().expect("a mixture").cpu_scale = [2.0, 3.0];
        assert_eq!(c.scale(&g, 1), 2.0);
        assert_eq!(c.scale(&g, 64), 3.0);
        assert!((c.scale(&g, 22) - 2.0 - 21.0 / 63.0).abs() < 1e-12);
        for (&n, b) in [1, 16, 64].iter().zip(&base) {
            assert!((c.group_s(&g, n) - b * c.scale(&g, n)).abs() < 1e-12 * b);
        }
        let over = CpuInput {
            cpu_group_s: 1e-3,
            ..c.clone()
        };
        assert!((over.group_s(&g, 1) - c.group_s(&g, 1) - 1e-3).abs() < 1e-12);
        assert!((over.split_s(&g, 64, 32) - c.split_s(&g, 64, 32) - 1e-3).abs() < 1e-12);
        // a dense group is the mean
        let d = GroupInfo::dense(GroupKind::Ffn, 1000);
        assert_eq!(c.scale(&d, 64), 1.0);
    }

    /// The H100 machine's measurements (docs/device/hybrid/run4, 70B-shaped
    /// Q4_0): groups of 85.8 and 378.0 MiB, the probe's rates, and tg16
    /// steps measured at three splits at 12 GB and one at 24 GB.
    #[test]
    fn simulation_matches_the_h100_runs() {
        let mib = |x: f64| (x * 1048576.0) as u64;
        let g = layers(80, mib(85.8), mib(378.0));
        let c = h100_cpu();
        let check = |resident: usize, slots, k: usize, measured_ms: f64| {
            let at = spread_on_cpu(&g, resident, k);
            let p = simulate(&g, &at, slots, 55.2e9, &c, 1);
            let ratio = measured_ms / (p.step_s() * 1e3);
            eprintln!("resident {resident}, k {k}: predicted {:.1} ms, measured {measured_ms} ms, ratio {ratio:.2}", p.step_s() * 1e3);
            ratio
        };
        let r = [
            check(37, (6, 3), 46, 239.9),
            check(37, (6, 3), 61, 251.0),
            check(37, (6, 3), 35, 318.4),
            check(91, (6, 3), 26, 160.4),
        ];
        for x in r {
            assert!((0.7..1.3).contains(&x), "{r:?}");
        }
    }

    /// Runs 12 (docs/device/hybrid/run12) with the rates the steps
    /// themselves showed: the CPU's (83.6 and 93.1 GB/s), the hop's, and
    /// the bus's beside the CPU (49.7 and 49.6 GB/s, against 54.2 GB/s
    /// streaming alone). With those the simulation lands within 5% of the
    /// measured step (0.98 both), so what was left of the plan's 7-10%
    /// error was its rates: the bus's beside the CPU is now probed at load
    /// (`bus_bw_beside`).
    #[test]
    fn simulation_with_in_step_rates_matches_run_12() {
        let mib = |x: f64| (x * 1048576.0) as u64;
        let g = layers(80, mib(85.8), mib(378.0));
        let check = |resident: usize,
                     k: usize,
                     cpu_gbs: f64,
                     bus_gbs: f64,
                     hop_s: f64,
                     measured_ms: f64| {
            let c = CpuInput {
                s_per_byte_1: 1.0 / (cpu_gbs * 1e9),
                s_per_byte_n: 1.0 / 30.3e9,
                probe_tokens: 16,
                big: None,
                host_room: u64::MAX,
                hop_s,
                gpu_s_per_byte: 1.0 / 2502e9,
                gpu_group_s: GPU_GROUP_S,
                cpu_group_s: 0.0,
                bus_bw_beside: Some(bus_gbs * 1e9),
                force: None,
                split: crate::paging::SplitInput::default(),
                carry: false,
                tiers: true,
            };
            let at = spread_on_cpu(&g, resident, k);
            let p = simulate(&g, &at, (7, 3), 54.2e9, &c, 1);
            let ratio = measured_ms / (p.step_s() * 1e3);
            eprintln!("resident {resident}, k {k}: predicted {:.1} ms (bus {:.1}, CPU {:.1}, GPU {:.1}, stalls {:.1}), measured {measured_ms} ms, ratio {ratio:.3}", p.step_s() * 1e3, p.bus_s * 1e3, p.cpu_s * 1e3, p.gpu_s * 1e3, p.stall_s * 1e3);
            ratio
        };
        let r = [
            check(37, 45, 83.6, 49.7, 77e-6, 252.7),
            check(91, 26, 93.1, 49.6, 90e-6, 140.44),
        ];
        for x in r {
            assert!((0.95..1.05).contains(&x), "{r:?}");
        }
    }

    proptest! {
        /// Mixture groups of differing CPU costs: every step's CPU groups
        /// are host groups of its tier or cheaper, as many and as many
        /// bytes as the plan says, the prediction is that very split's,
        /// and no step is slower than streaming everything.
        #[test]
        fn tiered_plans_are_consistent(
            n in 1usize..40, first_streamed in 0usize..80,
            scales in proptest::collection::vec((0.5f64..2.0, 0.5f64..2.0), 1..5),
            pick in proptest::collection::vec(0usize..5, 40),
            spb in 0.2f64..5.0, room in 0u64..20_000_000_000, hop in 0.0f64..1e-3,
            per_group in 0.0f64..1e-3,
        ) {
            let mut g = qwen3moe_30b(n, 0.0);
            for (i, x) in g.iter_mut().enumerate() {
                if let Some(e) = x.experts.as_mut() {
                    let (a, b) = scales[pick[i / 2] % scales.len()];
                    e.cpu_scale = [a, b];
                }
            }
            let streamed: Vec<bool> = (0..g.len()).map(|i| i >= first_streamed.min(g.len())).collect();
            let c = CpuInput {
                big: Some((64, spb * 3.0 / 24e9)),
                host_room: room,
                hop_s: hop,
                cpu_group_s: per_group,
                gpu_group_s: GPU_GROUP_S,
                ..cpu(spb / 90e9)
            };
            let Some(p) = plan_hybrid(&g, &streamed, (7, 3), 55e9, &c) else { return Ok(()) };
            prop_assert!(p.host_bytes <= room);
            for (i, s) in p.per_size.iter().enumerate() {
                let n = i as u32 + 1;
                let set = p.cpu_groups(n);
                prop_assert_eq!(set.iter().filter(|c| **c).count(), s.cpu_groups);
                for (j, _) in set.iter().enumerate().filter(|(_, c)| **c) {
                    prop_assert!(p.host[j] && p.tier[j] <= s.tier);
                }
                let b: u64 = g.iter().zip(&set).filter(|(_, c)| **c).map(|(g, _)| g.bytes).sum();
                prop_assert_eq!(b, s.cpu_bytes);
                let q = simulate(&g, &placement(&streamed, &set), (7, 3), 55e9, &c, n);
                prop_assert_eq!(q, s.predicted);
                let none = simulate(&g, &placement(&streamed, &vec![false; g.len()]), (7, 3), 55e9, &c, n);
                prop_assert!(q.step_s() <= none.step_s() + 1e-9);
            }
        }

        #[test]
        fn hybrid_plans_are_consistent(
            n in 1usize..40, attn in 1u64..100, ffn in 1u64..400,
            first_streamed in 0usize..80, spb in 0.01f64..10.0, bw in 0.1f64..10.0,
            room in 0u64..20000, hop in 0.0f64..5.0, force in proptest::option::of(0usize..50),
        ) {
            let g = layers(n, attn, ffn);
            let streamed: Vec<bool> = (0..g.len()).map(|i| i >= first_streamed.min(g.len())).collect();
            let c = CpuInput { host_room: room, hop_s: hop, force, ..cpu(spb) };
            let Some(p) = plan_hybrid(&g, &streamed, (4, 3), bw, &c) else { return Ok(()) };
            // host copies: streamed FFN groups only, within the room
            for (i, h) in p.host.iter().enumerate() {
                if *h { prop_assert!(streamed[i] && g[i].kind == GroupKind::Ffn); }
            }
            let hb: u64 = g.iter().zip(&p.host).filter(|(_, h)| **h).map(|(g, _)| g.bytes).sum();
            prop_assert_eq!(hb, p.host_bytes);
            prop_assert!(p.host_bytes <= room);
            for (i, s) in p.per_size.iter().enumerate() {
                let set = p.cpu_groups(i as u32 + 1);
                // every CPU group has a host copy; counts and bytes agree
                prop_assert!(set.iter().zip(&p.host).all(|(c, h)| !c || *h));
                prop_assert_eq!(set.iter().filter(|c| **c).count(), s.cpu_groups);
                let b: u64 = g.iter().zip(&set).filter(|(_, c)| **c).map(|(g, _)| g.bytes).sum();
                prop_assert_eq!(b, s.cpu_bytes);
                // the prediction simulates this very split; the chain
                // waits for every upload and computes every group
                let q = simulate(&g, &placement(&streamed, &set), (4, 3), bw, &c, i as u32 + 1);
                prop_assert_eq!(q, s.predicted);
                prop_assert!(q.step_s() >= q.bus_s - 1e-9);
                let cpu_bytes: f64 = b as f64 * c.s_per_byte(i as u32 + 1) + s.cpu_groups as f64 * hop;
                prop_assert!((q.cpu_s - cpu_bytes).abs() <= 1e-9 * cpu_bytes.max(1.0));
                // never worse than streaming everything (unless forced)
                if force.is_none() {
                    let none = simulate(&g, &placement(&streamed, &vec![false; g.len()]), (4, 3), bw, &c, i as u32 + 1);
                    prop_assert!(q.step_s() <= none.step_s() + 1e-9);
                }
            }
        }
    }
}
