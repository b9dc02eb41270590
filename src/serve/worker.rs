//! The engine loop: one thread owns the engine and runs every step.
//!
//! Requests arrive on a channel. At each step boundary the loop takes them
//! in, drops the ones whose client went away (their cells are freed by the
//! step's cache operations), asks the [`Batcher`] what the step holds,
//! carries out its cache operations, runs the step, and samples one token
//! for every sequence that wanted logits, each with its own sampler: one
//! [`crate::round`], the decode round `strata run` drives too. Text
//! goes back to the request's handler on its own channel as it forms, with
//! the logprobs of its tokens when the request asked for them.
//!
//! A request for a JSON object (`response_format`) samples under
//! llama.cpp's JSON grammar, a [`crate::sample::Constraint`] inside its
//! sampler: each row is masked before the chain and each token drawn is
//! accepted into the grammar. Drafting (prompt lookup or a draft model)
//! stays on for it: [`crate::speculative::verify`] samples and accepts row
//! by row and stops at the first draft that differs from the token drawn,
//! so the grammar accepts exactly the tokens emitted, each drawn from the
//! row computed after the tokens before it; a draft the grammar forbids is
//! simply never verified. The logprobs reported are those of the
//! distribution each token was drawn from (grammar, bias, penalties,
//! filters and temperature applied).

use super::api::{ApiError, Job, Usage};
use super::batch::{Batcher, Feed, Finish, KvOp, StepPlan};
use super::logprobs::{EntryQueue, LogprobEntry};
use super::metrics::Metrics;
use super::stop::StopMatcher;
use crate::engine::Engine;
use crate::generate::Utf8Stream;
use crate::llama::{GrammarSampler, LlamaModel};
use crate::round::{self, Drawn};
use crate::sample::logprobs::TokenLogprob;
use crate::sample::{SampleError, Sampler};
use crate::speculative::{
    DraftModel, DraftRequest, DraftTree, Drafter, NgramLookup, SpecConfig, Speculator,
};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;

/// What the engine loop sends back about a request.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// Tokenized and queued.
    Queued {
        prompt_tokens: usize,
    },
    /// The next piece of the answer, and the logprob entries of the tokens
    /// whose text begins in it (empty unless the request asked; the text
    /// may be empty when only entries are due).
    Text {
        text: String,
        logprobs: Vec<LogprobEntry>,
    },
    Done {
        finish: &'static str,
        usage: Usage,
    },
    /// Refused or failed; no more events follow.
    Error(ApiError),
}

/// A request handed to the engine loop.
pub struct Submit {
    pub id: u64,
    /// The prompt's tokens (the HTTP side tokenized it).
    pub prompt: Vec<u32>,
    pub job: Job,
    pub arrived: Instant,
    pub events: UnboundedSender<Event>,
}

/// Shutdown state shared with the HTTP side.
#[derive(Default)]
pub struct Shutdown {
    /// Set on SIGTERM: no new requests; running ones finish.
    pub stopping: std::sync::atomic::AtomicBool,
    /// Past this, running requests are cut off.
    pub deadline: std::sync::Mutex<Option<Instant>>,
}

impl Shutdown {
    pub fn begin(&self, grace: Duration) {
        self.stopping.store(true, Relaxed);
        *self.deadline.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now() + grace);
    }
    pub fn is_stopping(&self) -> bool {
        self.stopping.load(Relaxed)
    }
    fn past_deadline(&self) -> bool {
        self.deadline
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some_and(|d| Instant::now() >= d)
    }
}

/// Per-request state beside the batcher's.
struct Seq {
    sampler: Sampler,
    stop: StopMatcher,
    utf8: Utf8Stream,
    events: UnboundedSender<Event>,
    max_tokens: usize,
    prompt_tokens: usize,
    cached_tokens: usize,
    generated: usize,
    arrived: Instant,
    first_token: bool,
    admitted: bool,
    ignore_eos: bool,
    /// Prompt and emitted tokens (what drafting looks at).
    history: Vec<u32>,
    /// This sequence's drafting (length, statistics; prompt lookup's
    /// proposals), when the server drafts.
    spec: Option<Speculator>,
    /// Logprob entries waiting for their text, when the request asked.
    logprobs: Option<EntryQueue>,
}

pub struct Worker {
    engine: Engine,
    vocab: Arc<LlamaModel>,
    batcher: Batcher,
    seqs: HashMap<u64, Seq>,
    rx: Receiver<Submit>,
    metrics: Arc<Metrics>,
    shutdown: Arc<Shutdown>,
    /// (when, tokens sampled) of recent steps, for tokens/s.
    recent: VecDeque<(Instant, usize)>,
    /// Drafting parameters, when sequences draft.
    spec: Option<SpecConfig>,
    /// The draft model all sequences share (None: prompt lookup).
    draft: Option<DraftModel>,
    /// Requests the draft model holds a sequence for: (request, KV seq).
    draft_seqs: HashMap<u64, u32>,
    /// This step's requests waiting for drafts: (request, KV seq, tokens).
    to_draft: Vec<(u64, u32, usize)>,
    /// Where the router's counts are added when the loop ends (None: not
    /// kept).
    counts_path: Option<std::path::PathBuf>,
    /// Router picks counted when the hot experts were last re-chosen.
    hot_seen: u64,
}

impl Worker {
    pub fn new(
        engine: Engine,
        vocab: Arc<LlamaModel>,
        batcher: Batcher,
        rx: Receiver<Submit>,
        metrics: Arc<Metrics>,
        shutdown: Arc<Shutdown>,
    ) -> Worker {
        metrics
            .kv_cells
            .store(engine.kv().cells().size() as u64, Relaxed);
        Worker {
            engine,
            vocab,
            batcher,
            seqs: HashMap::new(),
            rx,
            metrics,
            shutdown,
            recent: VecDeque::new(),
            spec: None,
            draft: None,
            draft_seqs: HashMap::new(),
            to_draft: Vec::new(),
            counts_path: None,
            hot_seen: 0,
        }
    }

    /// The router counts this run makes are added to the file at `path`
    /// when the loop ends (`ServeConfig::router_counts`).
    pub fn with_counts(mut self, path: Option<std::path::PathBuf>) -> Worker {
        self.counts_path = path;
        self
    }

    /// Each sequence drafts, and every decode step verifies its drafts:
    /// from n-grams of its own prompt and output (prompt lookup) without a
    /// draft model; with one, the model drafts for every sequence at once
    /// after each step.
    pub fn with_drafting(mut self, cfg: Option<SpecConfig>, draft: Option<DraftModel>) -> Worker {
        self.spec = cfg.filter(|c| c.draft_max > 0);
        self.draft = self.spec.and(draft);
        self
    }

    /// Runs until the channel closes (the HTTP side is gone) with nothing
    /// left to compute.
    pub fn run(mut self) {
        loop {
            self.metrics.beat();
            if self.batcher.is_idle() {
                self.update_rate();
                match self.rx.recv_timeout(Duration::from_millis(200)) {
                    Ok(s) => self.intake(s),
                    Err(RecvTimeoutError::Timeout) => {
                        self.refresh_hot();
                        continue;
                    }
                    Err(RecvTimeoutError::Disconnected) => return self.save_counts(),
                }
            }
            while let Ok(s) = self.rx.try_recv() {
                self.intake(s);
            }
            self.drop_gone();
            if self.batcher.is_idle() {
                // a cancelled sequence's cells go now, not at the next request
                let ops = self.batcher.take_ops();
                self.apply_ops(&ops);
                self.update_kv();
                continue;
            }
            self.step();
        }
    }

    /// Queues a request, or answers its error. Its prompt comes tokenized:
    /// text is never tokenized on this thread (a long prompt would stop
    /// every stream meanwhile).
    fn intake(&mut self, mut s: Submit) {
        let prompt = std::mem::take(&mut s.prompt);
        let n_vocab = self.engine.n_vocab();
        if let Some(&t) = prompt.iter().find(|&&t| t >= n_vocab) {
            return self.refuse(
                &s,
                ApiError::bad(format!(
                    "token id {t} is outside the vocabulary (n_vocab = {n_vocab})"
                )),
            );
        }
        let n = prompt.len();
        if let Err(e) = self.batcher.enqueue(s.id, prompt.clone()) {
            return self.refuse(&s, ApiError::bad(e.to_string()));
        }
        let mut sampler = match Sampler::new(s.job.sampler.clone()) {
            Ok(x) => x,
            Err(e) => {
                self.batcher.finish(s.id, Finish::Cancelled);
                return self.refuse(&s, ApiError::bad(e.to_string()));
            }
        };
        // the penalties see the prompt, as in `strata run`
        for &t in &prompt {
            sampler.accept(t);
        }
        // the grammar sees the answer only: set after the prompt
        if let Some((grammar, root)) = s.job.grammar() {
            match GrammarSampler::new(self.vocab.clone(), grammar, root) {
                Ok(g) => sampler.constrain(Box::new(g)),
                Err(e) => {
                    self.batcher.finish(s.id, Finish::Cancelled);
                    return self.refuse(
                        &s,
                        ApiError {
                            status: 500,
                            message: format!("the response_format grammar failed: {e}"),
                        },
                    );
                }
            }
        }
        let room = self.batcher.n_ctx_seq() - n;
        let _ = s.events.send(Event::Queued { prompt_tokens: n });
        self.seqs.insert(
            s.id,
            Seq {
                sampler,
                stop: StopMatcher::new(s.job.stop.clone()),
                utf8: Utf8Stream::default(),
                events: s.events,
                max_tokens: s.job.max_tokens.unwrap_or(room),
                prompt_tokens: n,
                cached_tokens: 0,
                generated: 0,
                arrived: s.arrived,
                first_token: false,
                admitted: false,
                ignore_eos: s.job.ignore_eos,
                history: prompt,
                logprobs: s.job.logprobs.map(EntryQueue::new),
                spec: self.spec.map(|cfg| {
                    let d = if self.draft.is_some() {
                        Drafter::Shared
                    } else {
                        Drafter::Lookup(NgramLookup::default())
                    };
                    Speculator::new(d, cfg)
                }),
            },
        );
    }

    fn refuse(&self, s: &Submit, e: ApiError) {
        self.metrics.queued.fetch_sub(1, Relaxed);
        self.metrics.rejected.fetch_add(1, Relaxed);
        let _ = s.events.send(Event::Error(e));
    }

    /// Requests whose client went away, and all of them past the shutdown
    /// deadline, end here.
    fn drop_gone(&mut self) {
        let cut = self.shutdown.past_deadline();
        let gone: Vec<u64> = self
            .batcher
            .ids()
            .into_iter()
            .filter(|id| cut || self.seqs.get(id).is_none_or(|s| s.events.is_closed()))
            .collect();
        for id in gone {
            if let Some(s) = self.seqs.get(&id) {
                if cut {
                    let _ = s.events.send(Event::Error(ApiError {
                        status: 503,
                        message: "the server shut down before the answer was complete".into(),
                    }));
                }
            }
            self.end(id, Finish::Cancelled);
        }
    }

    fn end(&mut self, id: u64, why: Finish) {
        self.forget_draft(id);
        self.batcher.finish(id, why);
        if let Some(s) = self.seqs.remove(&id) {
            if !s.admitted {
                self.metrics.queued.fetch_sub(1, Relaxed);
            }
            match why {
                Finish::Cancelled => self.metrics.cancelled.fetch_add(1, Relaxed),
                _ => self.metrics.completed.fetch_add(1, Relaxed),
            };
        }
    }

    fn step(&mut self) {
        let plan = self.batcher.plan(self.engine.kv().cells());
        self.apply_ops(&plan.ops);
        for a in &plan.admitted {
            if let Some(s) = self.seqs.get_mut(&a.id) {
                s.admitted = true;
                s.cached_tokens = a.reused;
                self.metrics.queued.fetch_sub(1, Relaxed);
                self.metrics
                    .prompt_tokens
                    .fetch_add(s.prompt_tokens as u64, Relaxed);
                if a.reused > 0 {
                    self.metrics.prefix_hits.fetch_add(1, Relaxed);
                    self.metrics
                        .prefix_tokens
                        .fetch_add(a.reused as u64, Relaxed);
                }
            }
        }
        self.metrics
            .prefix_evictions
            .store(self.batcher.prefix.evictions, Relaxed);
        if plan.feeds.is_empty() {
            // everyone waits for a prefix another request computes: cannot
            // happen (a source in prefill is always fed), but never spin
            std::thread::sleep(Duration::from_millis(1));
            return;
        }
        let feeds: Vec<round::Feed> = plan.feeds.iter().map(view).collect();
        let n_tokens: usize = feeds.iter().map(|f| f.tokens.len()).sum();
        let t0 = Instant::now();
        let rows = match round::step(&mut self.engine, &feeds) {
            Ok(r) => r,
            Err(e) => return self.fail_step(&plan, &e.to_string()),
        };
        let secs = t0.elapsed().as_secs_f64();
        self.batcher.fed(&plan);
        let m = &self.metrics;
        m.steps.fetch_add(1, Relaxed);
        m.step_tokens.fetch_add(n_tokens as u64, Relaxed);
        m.step_micros.fetch_add((secs * 1e6) as u64, Relaxed);
        m.last_step_seconds.set(secs);
        let bytes = self.engine.last_step.pager.bytes;
        m.last_step_bytes.store(bytes, Relaxed);
        m.streamed_bytes.fetch_add(bytes, Relaxed);
        let h = self.engine.last_step.host;
        m.expert_picks.fetch_add(h.picks, Relaxed);
        m.expert_hot_picks.fetch_add(h.hot_picks, Relaxed);

        let n_vocab = rows.n_vocab;
        // each sampling feed's rows: its last pending token's and its
        // drafts' (a chain, or a tree's nodes)
        let feed_rows: Vec<FeedRows> = plan
            .feeds
            .iter()
            .zip(&feeds)
            .enumerate()
            .filter(|(_, (_, v))| v.sample)
            .map(|(i, (f, v))| FeedRows {
                id: f.id,
                rows: rows.of(i),
                drafts: v.drafted(),
                tree: f.tree.as_ref(),
            })
            .collect();
        let drawn = self.draw(&feed_rows, n_vocab);
        let mut sampled = 0;
        for (id, toks) in drawn {
            // feeds and drawn tokens are matched by request, not by order
            let Some(i) = plan.feeds.iter().position(|f| f.id == id) else {
                continue;
            };
            sampled += toks.as_ref().map_or(0, |t| t.tokens.len());
            self.emit(id, toks, &plan.feeds[i], rows.cells_of(i), secs);
        }
        self.run_drafts();
        self.recent.push_back((Instant::now(), sampled));
        self.update_rate();
        self.update_kv();
    }

    fn apply_ops(&mut self, ops: &[KvOp]) {
        for op in ops {
            match *op {
                KvOp::Remove(s) => self.engine.clear_seq(s),
                KvOp::Share { src, dst, n } => {
                    // ids and positions come from the batcher: in range
                    let _ = self.engine.copy_seq(src, dst, 0, n as i32);
                }
            }
        }
    }

    /// Each feed's tokens, drawn by its request's own sampler (and
    /// accepted into it): row 0, then each next row while the token drawn
    /// equals the draft there (speculative verification, see
    /// [`crate::speculative`]), with each token's logprobs from its row
    /// when the request asked. In feed order. Many feeds are sampled on
    /// several threads (64 rows of a large vocabulary take tens of
    /// milliseconds on one core).
    fn draw(
        &mut self,
        rows: &[FeedRows<'_>],
        n_vocab: usize,
    ) -> Vec<(u64, Result<Drawn, SampleError>)> {
        struct Work<'a> {
            id: u64,
            sampler: &'a mut Sampler,
            rows: &'a [f32],
            drafts: &'a [u32],
            tree: Option<&'a DraftTree>,
            /// alternatives, when the request wants logprobs
            logprobs: Option<usize>,
            out: Option<Result<Drawn, SampleError>>,
        }
        let index: HashMap<u64, &FeedRows> = rows.iter().map(|r| (r.id, r)).collect();
        let mut work: Vec<Work> = self
            .seqs
            .iter_mut()
            .filter_map(|(id, s)| {
                index.get(id).map(|r| Work {
                    id: *id,
                    sampler: &mut s.sampler,
                    rows: r.rows,
                    drafts: r.drafts,
                    tree: r.tree,
                    logprobs: s.logprobs.as_ref().map(EntryQueue::top),
                    out: None,
                })
            })
            .collect();
        let verify = |w: &mut Work| {
            // logprobs: from the distribution each token was drawn from
            w.out = Some(match w.tree {
                Some(t) => round::draw_tree(w.sampler, w.rows, n_vocab, t, w.logprobs, |_, _| true),
                None => round::draw(w.sampler, w.rows, n_vocab, w.drafts, w.logprobs, |_, _| {
                    true
                }),
            });
        };
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let threads = cores.min(work.len() / 8).max(1);
        if threads > 1 {
            let per = work.len().div_ceil(threads);
            std::thread::scope(|sc| {
                for chunk in work.chunks_mut(per) {
                    sc.spawn(move || chunk.iter_mut().for_each(verify));
                }
            });
        } else {
            work.iter_mut().for_each(verify);
        }
        let mut by_id: HashMap<u64, Result<Drawn, SampleError>> = work
            .into_iter()
            .filter_map(|w| Some((w.id, w.out?)))
            .collect();
        rows.iter()
            .filter_map(|r| by_id.remove(&r.id).map(|d| (r.id, d)))
            .collect()
    }

    /// Takes request `id`'s tokens from feed `f` (the first, then each
    /// verified draft's successor), sends their text, drops rejected
    /// drafts from the cache (`cells`: the feed's, in a step with a tree),
    /// and drafts the next round.
    fn emit(
        &mut self,
        id: u64,
        drawn: Result<Drawn, SampleError>,
        f: &Feed,
        cells: &[u32],
        step_s: f64,
    ) {
        let (toks, mut lps, path) = match drawn {
            Ok(d) => (d.tokens, d.logprobs.into_iter(), d.path),
            Err(e) => {
                self.forget_draft(id);
                if let Some(s) = self.seqs.remove(&id) {
                    let _ = s.events.send(Event::Error(ApiError {
                        status: 500,
                        message: format!("sampling failed: {e}"),
                    }));
                }
                self.metrics.failed.fetch_add(1, Relaxed);
                self.batcher.finish(id, Finish::Cancelled);
                return;
            }
        };
        // cached tokens before the drafts: the cache keeps them plus the
        // drafts verified
        let base = f.pos + f.tokens.len() - f.drafts;
        let accepted = toks.len() - 1;
        self.metrics
            .draft_tokens
            .fetch_add(f.drafts as u64, Relaxed);
        self.metrics
            .draft_accepted
            .fetch_add(accepted as u64, Relaxed);
        // a tree's accepted side branch sits in cells out of position
        // order: its nodes leave the cache with the rejected ones and its
        // tokens are fed again, so the cache is what plain decoding's
        // would be (`DraftTree::in_chain_cells`)
        let side = f.tree.is_some() && !DraftTree::in_chain_cells(&path);
        let kept = if side { 0 } else { accepted };
        if side {
            self.metrics.draft_refed.fetch_add(accepted as u64, Relaxed);
        }
        for (j, &tok) in toks.iter().enumerate() {
            if let Some(why) = self.take_token(id, tok, lps.next()) {
                self.drop_drafts(f, cells, &path, base + j.min(kept));
                self.finish_seq(id, why);
                return;
            }
        }
        self.drop_drafts(f, cells, &path, base + kept);
        let held = self.batcher.sampled(id, &toks[kept..]);
        if held >= self.batcher.n_ctx_seq() {
            return self.finish_seq(id, Finish::Length);
        }
        let room = self.batcher.n_ctx_seq() - held - 1;
        let Some(s) = self.seqs.get_mut(&id) else {
            return;
        };
        s.history.extend_from_slice(&toks);
        let Some(spec) = s.spec.as_mut() else {
            return;
        };
        if f.drafts > 0 || f.pos + f.tokens.len() > s.prompt_tokens {
            spec.round_done(
                f.drafts,
                accepted,
                toks[0],
                std::time::Duration::from_secs_f64(step_s),
            );
        }
        let max = room.min(s.max_tokens.saturating_sub(s.generated + 1));
        if matches!(spec.drafter, Drafter::Shared) {
            // the draft model drafts for every sequence after the step
            let k = if spec.cfg.tree > 0 {
                max.min(spec.cfg.draft_max)
            } else {
                spec.length(max)
            };
            if k > 0 {
                self.to_draft.push((id, f.seq, k));
            } else {
                spec.take(Vec::new(), 0, Duration::ZERO);
            }
            return;
        }
        if spec.cfg.tree > 0 {
            if let Ok(t) = spec.draft_round(&s.history, max) {
                self.batcher.set_tree(id, t);
            }
        } else if let Ok(d) = spec.draft(&s.history, max) {
            self.batcher.set_drafts(id, d);
        }
    }

    /// The draft model drafts for this step's requests in one batch (their
    /// catch-up tokens in one step, then one step per drafted position),
    /// and each request's drafts go to the batcher. A failure (the draft's
    /// context full) costs the round its drafts, nothing else.
    fn run_drafts(&mut self) {
        let todo = std::mem::take(&mut self.to_draft);
        if self.spec.is_some_and(|c| c.tree > 0) {
            return self.run_draft_trees(&todo);
        }
        let Some(dm) = self.draft.as_mut() else {
            return;
        };
        let (mut ids, mut reqs) = (Vec::new(), Vec::new());
        for &(id, seq, k) in &todo {
            if let Some(s) = self.seqs.get(&id) {
                self.draft_seqs.insert(id, seq);
                ids.push((id, seq, k));
                reqs.push(DraftRequest {
                    seq,
                    context: &s.history,
                    max: k,
                });
            }
        }
        if reqs.is_empty() {
            return;
        }
        let t = Instant::now();
        match dm.draft_many(&reqs) {
            Ok(drafts) => {
                // each sequence's share of the batch's time
                let share = t.elapsed() / reqs.len() as u32;
                for ((id, _, k), d) in ids.into_iter().zip(drafts) {
                    if let Some(spec) = self.seqs.get_mut(&id).and_then(|s| s.spec.as_mut()) {
                        let d = spec.take(d, k, share);
                        self.batcher.set_drafts(id, d);
                    }
                }
            }
            Err(e) => {
                tracing::warn!("the draft model failed; this round verifies no drafts: {e}");
                for (id, seq, _) in ids {
                    dm.forget(seq);
                    self.draft_seqs.remove(&id);
                }
            }
        }
    }

    /// The draft model grows a token tree for each of this step's requests
    /// `(request, KV seq, depth)`, one after another (a tree's levels are
    /// steps of their own); each request's tree goes to the batcher.
    fn run_draft_trees(&mut self, ids: &[(u64, u32, usize)]) {
        let Some(dm) = self.draft.as_mut() else {
            return;
        };
        for &(id, seq, depth) in ids {
            let Some(s) = self.seqs.get_mut(&id) else {
                continue;
            };
            let Some(spec) = s.spec.as_mut() else {
                continue;
            };
            self.draft_seqs.insert(id, seq);
            let t = Instant::now();
            match dm.draft_tree(seq, &s.history, spec.tree_shape(depth), depth) {
                Ok(tree) => {
                    let tree = spec.take_tree(tree, t.elapsed());
                    self.batcher.set_tree(id, tree);
                }
                Err(e) => {
                    tracing::warn!("the draft model failed; this round verifies no drafts: {e}");
                    dm.forget(seq);
                    self.draft_seqs.remove(&id);
                }
            }
        }
    }

    /// Request `id` ended: the draft model forgets its sequence.
    fn forget_draft(&mut self, id: u64) {
        if let (Some(seq), Some(dm)) = (self.draft_seqs.remove(&id), self.draft.as_mut()) {
            dm.forget(seq);
        }
    }

    /// Drafts of feed `f` beyond the first `keep` cached tokens leave the
    /// cache; of a tree, every node off the accepted `path` too (`cells`:
    /// the feed's cells).
    fn drop_drafts(&mut self, f: &Feed, cells: &[u32], path: &[usize], keep: usize) {
        let held = f.pos + f.tokens.len();
        let dropped = match &f.tree {
            Some(t) if !cells.is_empty() => {
                // nodes past `keep` leave by position, the others by cell
                let base = held - f.drafts;
                let on: Vec<usize> = path
                    .iter()
                    .copied()
                    .take(keep.saturating_sub(base))
                    .collect();
                round::rollback_tree(&mut self.engine, f.seq, t, cells, &on, held, keep)
            }
            _ => round::rollback(&mut self.engine, f.seq, held, keep),
        };
        if dropped {
            self.batcher.rollback(f.id, keep);
        }
    }

    /// Counts one generated token of request `id` and sends its text (and
    /// the logprob entries due with it, see [`EntryQueue`]); says why the
    /// request ends with it, if it does.
    fn take_token(&mut self, id: u64, tok: u32, lp: Option<TokenLogprob>) -> Option<Finish> {
        let s = self.seqs.get_mut(&id)?;
        s.generated += 1;
        self.metrics.generated_tokens.fetch_add(1, Relaxed);
        if !s.first_token {
            s.first_token = true;
            self.metrics
                .ttft_micros
                .fetch_add(s.arrived.elapsed().as_micros() as u64, Relaxed);
            self.metrics.ttft_count.fetch_add(1, Relaxed);
        }
        if !s.ignore_eos && self.vocab.is_eog(tok) {
            // no text: no logprob entry either
            return Some(Finish::Stop);
        }
        let piece = s.utf8.push(&self.vocab.token_bytes(tok, false));
        let r = s.stop.push(&piece);
        let mut logprobs = Vec::new();
        if let (Some(q), Some(lp)) = (s.logprobs.as_mut(), lp) {
            q.push(lp, &piece);
            logprobs = q.sent(r.text.len());
            if r.stopped {
                q.cut();
            }
        }
        if !r.text.is_empty() || !logprobs.is_empty() {
            let _ = s.events.send(Event::Text {
                text: r.text,
                logprobs,
            });
        }
        if r.stopped {
            Some(Finish::Stop)
        } else if s.generated >= s.max_tokens {
            Some(Finish::Length)
        } else {
            None
        }
    }

    /// Sends the end of request `id`'s answer and lets its sequence go.
    fn finish_seq(&mut self, id: u64, why: Finish) {
        let Some(s) = self.seqs.get_mut(&id) else {
            return;
        };
        // text held back for a stop string that did not come, and the
        // entries of every token not sent yet (a stop string cut them)
        let rest = s.stop.flush();
        let logprobs = s.logprobs.as_mut().map_or(Vec::new(), EntryQueue::finish);
        if !rest.is_empty() || !logprobs.is_empty() {
            let _ = s.events.send(Event::Text {
                text: rest,
                logprobs,
            });
        }
        let usage = Usage {
            prompt_tokens: s.prompt_tokens,
            completion_tokens: s.generated,
            cached_tokens: s.cached_tokens,
        };
        let finish = if why == Finish::Stop {
            "stop"
        } else {
            "length"
        };
        let _ = s.events.send(Event::Done { finish, usage });
        self.end(id, why);
    }

    /// An engine error: every request in the step gets it and ends; the
    /// engine gave the step's cells back.
    fn fail_step(&mut self, plan: &StepPlan, err: &str) {
        tracing::error!("step failed: {err}");
        for f in &plan.feeds {
            self.forget_draft(f.id);
            if let Some(s) = self.seqs.remove(&f.id) {
                let _ = s.events.send(Event::Error(ApiError {
                    status: 500,
                    message: format!("the engine failed: {err}"),
                }));
                self.metrics.failed.fetch_add(1, Relaxed);
            }
            self.batcher.finish(f.id, Finish::Cancelled);
        }
    }

    /// Nothing runs: re-chooses the hot experts (`Engine::refresh_hot`)
    /// where the router picked more since the last time.
    fn refresh_hot(&mut self) {
        let seen: u64 = self
            .engine
            .parts()
            .filter_map(|p| p.router_counts())
            .map(|r| r.picks())
            .sum();
        if seen == self.hot_seen {
            return;
        }
        self.hot_seen = seen;
        match self.engine.refresh_hot() {
            Ok(Some(r)) if r.groups > 0 => {
                self.metrics
                    .hot_refreshes
                    .fetch_add(r.groups as u64, Relaxed);
                self.metrics.hot_refresh_bytes.fetch_add(r.bytes, Relaxed);
            }
            Ok(_) => {}
            Err(e) => tracing::warn!("re-choosing the hot experts: {e}"),
        }
    }

    /// Adds the router's counts to the file beside the model, where asked
    /// and where this engine counted the whole model's layers.
    fn save_counts(&self) {
        let (Some(path), Some(r)) = (&self.counts_path, self.engine.router_counts()) else {
            return;
        };
        let whole = self.engine.spec.hp.layer0 == 0
            && (self.engine.next_part().is_none() || self.engine.spec.shard.is_some());
        if r.picks() == 0 || !whole {
            return;
        }
        match crate::engine::save_router_counts(path, r) {
            Ok(n) => eprintln!(
                "strata serve: router counts saved to {} ({n} picks in all)",
                path.display()
            ),
            Err(e) => eprintln!("strata serve: router counts not saved: {e}"),
        }
    }

    fn update_rate(&mut self) {
        let now = Instant::now();
        let window = Duration::from_secs(10);
        while self.recent.front().is_some_and(|(t, _)| now - *t > window) {
            self.recent.pop_front();
        }
        let n: usize = self.recent.iter().map(|r| r.1).sum();
        let span = self
            .recent
            .front()
            .map_or(0.0, |(t, _)| (now - *t).as_secs_f64().max(1.0));
        self.metrics
            .tokens_per_second
            .set(if span > 0.0 { n as f64 / span } else { 0.0 });
    }

    fn update_kv(&self) {
        let m = &self.metrics;
        let cells = self.engine.kv().cells();
        m.kv_cells_used.store(cells.used() as u64, Relaxed);
        m.active.store(self.batcher.n_active() as u64, Relaxed);
        m.parked.store(self.batcher.n_parked() as u64, Relaxed);
        let (block, dram, ssd) = match self.engine.kv_tier() {
            Some(t) => (t.block(), t.table.in_dram() as u64, t.table.on_ssd() as u64),
            None => (256, 0, 0),
        };
        let nb = cells.size().div_ceil(block);
        let live = (0..nb).filter(|&b| cells.block_rows(b, block) > 0).count() as u64;
        // resident layers hold every live block on the GPU
        let gpu = if self.engine.kv_resident_layers() > 0 {
            live
        } else {
            0
        };
        m.kv_blocks_gpu.store(gpu, Relaxed);
        m.kv_blocks_dram.store(dram, Relaxed);
        m.kv_blocks_ssd.store(ssd, Relaxed);
    }
}

/// A sampling feed's logit rows and the drafts they verify.
struct FeedRows<'a> {
    id: u64,
    rows: &'a [f32],
    drafts: &'a [u32],
    tree: Option<&'a DraftTree>,
}

/// A step plan's feed as the shared decode round sees it.
fn view(f: &Feed) -> round::Feed<'_> {
    round::Feed {
        seq: f.seq,
        pos: f.pos,
        tokens: &f.tokens,
        drafts: f.drafts,
        sample: f.logits,
        tree: f.tree.as_ref(),
    }
}
