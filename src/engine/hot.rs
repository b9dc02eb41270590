//! Hot experts, the execution side (`paging::experts` says which and why):
//! the most picked experts of a streamed mixture layer kept on the device,
//! which computes their picks while the host CPU computes the others'.
//!
//! Where the host computes a layer (hybrid decode) or splits its experts
//! with the device (`engine::split`), once the router's picks are known:
//! 1. the picks of hot experts go up as rows (the normed input of their
//!    token) and compact expert ids, and a graph over the pool's experts
//!    is queued on the compute stream (`TemplateKey::HotExperts`, one
//!    (token, expert) row each, as the host's own rows);
//! 2. the host computes the other picks meanwhile;
//! 3. the device's rows come back, weighted and summed per token into the
//!    host's sums, which go to the residual as before.

use super::error::EngineError;
use super::host::{pad_picks, picks_of, Pick};
use super::hotpool::expert_sig;
use super::state::Engine;
use super::timeline;
use crate::graph::{BindId, TemplateKey, ROUTED, ROUTER_IN, WEIGHTS};
use crate::model::{GroupId, GroupKind, ModelSpec};
use crate::paging::HotPlan;
use std::time::Instant;

/// The device graph of group `gi`'s hot experts over `n` (padded) picks.
fn hot_key(spec: &ModelSpec, plan: &HotPlan, gi: GroupId, n: u32) -> TemplateKey {
    TemplateKey::HotExperts {
        sig: expert_sig(spec, gi.index()),
        picks: n,
        n_hot: plan.sets[gi.index()].len() as u32,
        instance: gi.index() as u32,
    }
}

impl Engine {
    /// Whether group `gi` has hot experts on the device.
    pub(super) fn has_hot(&self, gi: GroupId) -> bool {
        self.hot
            .as_ref()
            .is_some_and(|h| h.first.contains_key(&gi.index()))
    }

    /// Splits `picks` of group `gi` into the hot ones, queued on the device
    /// now (their compact ids in `expert`), and the others, returned for
    /// the host. `cur`: the router's normed rows F32 [n_embd, n_tokens].
    pub(super) fn queue_hot(
        &mut self,
        gi: GroupId,
        cur: &[f32],
        picks: Vec<Pick>,
    ) -> Result<(Vec<Pick>, Vec<Pick>), EngineError> {
        let Some(pool) = self
            .hot
            .as_mut()
            .filter(|h| h.first.contains_key(&gi.index()))
        else {
            return Ok((picks, Vec::new()));
        };
        let (mut hot, mut cold) = (Vec::new(), Vec::new());
        for p in picks {
            match pool.plan.slot_of(gi.index(), p.expert as u32) {
                Some(k) => hot.push(Pick {
                    expert: k as i32,
                    ..p
                }),
                None => cold.push(p),
            }
        }
        if let Some(h) = self.host.as_mut() {
            h.stats.picks += (hot.len() + cold.len()) as u64;
            h.stats.hot_picks += hot.len() as u64;
        }
        if hot.is_empty() {
            return Ok((cold, hot));
        }
        // padded as the host's rows are (a few templates serve every step)
        let n = pad_picks(hot.len() as u32);
        if n > pool.io.most {
            return Err(EngineError::Unsupported(
                "more hot expert picks than the device's rows hold",
            ));
        }
        let e = self.spec.hp.n_embd as usize;
        // nothing queued reads them: the device's last hot graph was waited
        // for (`finish_hot`) before these are written
        pool.io.write(&hot, cur, e, n)?;
        let arena = pool.weights.as_ref().expect("a hot group has tensors");
        let i0 = pool.first[&gi.index()];
        let mut binds = vec![
            arena.binding(i0),
            arena.binding(i0 + 1),
            arena.binding(i0 + 2),
        ];
        binds.extend(pool.io.bindings());
        let key = hot_key(&self.spec, &pool.plan, gi, n);
        self.templates
            .get(&key)?
            .bind(BindId::resident(gi), &binds, None)?;
        let t = self.templates.allocated(&key, &self.backend)?;
        let layer = gi.layer() + self.spec.hp.layer0;
        let rec = self.rec.scope(
            timeline::Stream::Compute,
            &self.backend,
            || format!("ffn {layer} (hot experts)"),
            0,
        );
        self.backend.compute_async(&t.graph())?;
        drop(rec);
        Ok((cold, hot))
    }

    /// Waits for the device's hot picks (`queue_hot`) and adds them,
    /// weighted, to `sums` (F32 [n_embd, n_tokens]).
    pub(super) fn finish_hot(
        &mut self,
        gi: GroupId,
        hot: &[Pick],
        sums: &mut [f32],
    ) -> Result<(), EngineError> {
        if hot.is_empty() {
            return Ok(());
        }
        let pool = self.hot.as_mut().expect("queue_hot found the pool");
        let n = pad_picks(hot.len() as u32);
        let key = hot_key(&self.spec, &pool.plan, gi, n);
        self.backend.synchronize();
        let e = self.spec.hp.n_embd as usize;
        let t = self.templates.get(&key)?;
        pool.io.add_out(t, hot, e, n, sums)
    }

    /// A mixture FFN group the host computes (hybrid decode) whose hot
    /// experts are on the device, or whose experts the look-ahead
    /// predicts (`engine::lookahead`): the router on the host, then both
    /// sides at once (see the module notes). The residual rows are on the
    /// host.
    pub(super) fn run_host_ffn_hot(&mut self, layer: u32, n: u32) -> Result<(), EngineError> {
        let gi = GroupId::new(layer, GroupKind::Ffn);
        let sig = self.spec.groups[gi.index()].signature();
        let rkey = TemplateKey::Router {
            sig: sig.clone(),
            n_tokens: n,
            instance: gi.index() as u32,
        };
        let shared_cores = self.device.is_cpu();
        let host = self.host.as_mut().expect("hybrid plan has a host");
        let t0 = Instant::now();
        host.route(gi, &rkey)?;
        let cur: Vec<f32> = host.read_node(&rkey, ROUTER_IN)?;
        let ids: Vec<i32> = host.read_node(&rkey, ROUTED)?;
        let wts: Vec<f32> = host.read_node(&rkey, WEIGHTS)?;
        let picks = picks_of(&ids, &wts, self.spec.hp.n_expert_used as usize, n as usize)?;
        self.count_routed(layer, &ids)?;
        if shared_cores {
            // a CPU standing in for the device: its pool and the host's
            // take turns on the cores
            self.host.as_ref().expect("checked").park_threads();
        }
        if !self.has_hot(gi) {
            // `queue_hot` counts the picks of the layers it serves
            let host = self.host.as_mut().expect("checked");
            host.stats.picks += picks.len() as u64;
        }
        let (cold, hot) = self.queue_hot(gi, &cur, picks)?;
        // those the look-ahead's slot caught, then the next host layer's
        // predicted experts up while the CPU computes (`engine::lookahead`)
        let (cold, ahead) = self.queue_ahead(gi, &cur, cold)?;
        self.prefetch_after(gi, &cur)?;
        if shared_cores && !(hot.is_empty() && ahead.is_empty()) {
            self.backend.synchronize();
            self.backend.park_threads();
        }
        let host = self.host.as_mut().expect("checked");
        let mut sums = Vec::new();
        host.split_experts(gi, &sig, &cur, &cold, &mut sums)?;
        self.finish_hot(gi, &hot, &mut sums)?;
        self.finish_ahead(gi, &ahead, &mut sums)?;
        let host = self.host.as_mut().expect("checked");
        host.add_rows(&sums)?;
        if shared_cores {
            host.park_threads();
        }
        let l = layer + self.spec.hp.layer0;
        self.rec.host_span(
            timeline::Stream::Cpu,
            || format!("ffn {l} (cold experts)"),
            t0,
            Instant::now(),
        );
        Ok(())
    }

    /// Re-chooses the hot experts of this part and the parts after it from
    /// the router's picks: the counts the plan was made from and those
    /// counted since (`paging::refresh_hot`: each set keeps its size, so
    /// the pool's memory and graphs stay). Between steps, never inside
    /// one; `strata serve` calls it when no request is running. None
    /// where no part holds hot experts.
    pub fn refresh_hot(&mut self) -> Result<Option<HotRefresh>, EngineError> {
        let mut report: Option<HotRefresh> = None;
        let mut e = Some(self);
        while let Some(part) = e {
            if let Some(r) = part.refresh_hot_part()? {
                let t = report.get_or_insert_with(HotRefresh::default);
                t.groups += r.groups;
                t.bytes += r.bytes;
                t.expected_hit = r.expected_hit.or(t.expected_hit);
            }
            e = part.next.as_deref_mut();
        }
        Ok(report)
    }

    fn refresh_hot_part(&mut self) -> Result<Option<HotRefresh>, EngineError> {
        let (Some(pool), Some(seen)) = (self.hot.as_mut(), self.routing.as_ref()) else {
            return Ok(None);
        };
        let mut counts = seen.clone();
        if let Some(c) = &pool.counted {
            counts.merge(c)?;
        }
        let (next, changed) = crate::paging::refresh_hot(&pool.plan, &counts);
        let expected_hit = next.expected_hit;
        // the predictions see the sets' new share of the picks
        if let Some(c) = self.cpu_cal.as_mut() {
            c.set_hot(&next.hit);
        }
        let bytes = if changed.is_empty() {
            pool.plan = next;
            0
        } else {
            // nothing queued may still read the pool
            self.backend.synchronize();
            let t0 = Instant::now();
            let b = pool.refill(&self.spec, &self.file, next, &changed)?;
            tracing::info!(
                "hot experts refreshed: {} layers, {:.1} MiB copied in {:.0} ms{}",
                changed.len(),
                b as f64 / (1u64 << 20) as f64,
                t0.elapsed().as_secs_f64() * 1e3,
                expected_hit.map_or(String::new(), |x| format!(
                    ", {:.1}% of the counted picks",
                    100.0 * x
                ))
            );
            b
        };
        Ok(Some(HotRefresh {
            groups: changed.len(),
            bytes,
            expected_hit,
        }))
    }

    /// The hot experts' plan of this part (None: it keeps none).
    pub fn hot_plan(&self) -> Option<&HotPlan> {
        self.hot.as_ref().map(|h| &h.plan)
    }
}

/// What [`Engine::refresh_hot`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct HotRefresh {
    /// Layers whose hot set changed.
    pub groups: usize,
    /// Expert bytes copied to the device.
    pub bytes: u64,
    /// The share of the counted picks the hot sets now catch.
    pub expected_hit: Option<f64>,
}
