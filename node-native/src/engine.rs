//! Serving the requests a node leads (its OpenAI API): a bounded queue, and one thread that
//! runs every admitted request through one coded group, all of their new tokens in each round
//! (continuous batching: one coded round per stage for the whole batch), then trains the mesh
//! on the finished requests as one minibatch and publishes the update.
//!
//! The group is formed when the first request comes and kept while it works: after this node's
//! own update every member holds it, so the group moves to the new version in place. A step
//! that fails (a member died, another leader's update moved the mesh) forms the group again and
//! runs the step again; the requests' KV caches are kept (a cache computed before an update is
//! used after it: the model changed under the request, and the step trace shows where).

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow};
use libp2p::PeerId;
use node_core::learn::{Learner, Published, Update, seal};
use node_core::mesh::{MeshInfo, MeshRequest, MeshResponse, ModelManifest, Usage};
use node_core::model::{BatchItem, KvCache, Llama, Sampler, SamplingParams, StopReason};
use tokio::sync::{mpsc, oneshot};

use crate::http::InfoRequest;
use crate::metrics::Metrics;
use crate::node::{LocalRow, ask};
use crate::remote::{Formed, GroupOptions, form_group, settled_info};
use crate::steplog::StepLog;
use crate::swarm::Client;

/// How a node serves the requests it leads.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Most sequences generated together.
    pub max_batch: usize,
    /// Most requests waiting for a place in the batch; more are refused (429).
    pub queue: usize,
    /// Most prompt tokens admitted into one forward step (a longer prompt runs alone).
    pub step_tokens: usize,
    /// Answers checked beyond the k decoded in every forward round.
    pub verify: usize,
    /// Spare members asked beside them.
    pub spares: usize,
    /// Train the mesh on the requests (when the mesh learns).
    pub learn: bool,
    /// Where every coded step is written (`--trace-steps`).
    pub trace_steps: Option<PathBuf>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_batch: 16,
            queue: 64,
            step_tokens: 512,
            verify: 1,
            spares: 1,
            learn: true,
            trace_steps: None,
        }
    }
}

impl EngineConfig {
    /// Checks the settings.
    pub fn validate(&self) -> Result<()> {
        anyhow::ensure!(
            self.max_batch >= 1,
            "the batch must hold at least one request"
        );
        anyhow::ensure!(
            self.step_tokens >= 1,
            "a step must admit at least one token"
        );
        Ok(())
    }
}

/// What to generate for one request.
#[derive(Debug, Clone)]
pub struct GenRequest {
    /// The prompt's token ids.
    pub prompt: Vec<u32>,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// How to pick tokens.
    pub sampling: SamplingParams,
    /// Token ids that end the completion (not emitted).
    pub stop_ids: Vec<u32>,
}

/// What a request's submitter hears, in order: tokens, then one `Done` or `Failed`.
#[derive(Debug, Clone)]
pub enum Event {
    /// The next generated token.
    Token(u32),
    /// The request finished.
    Done(Finished),
    /// The request could not be served.
    Failed(EngineError),
}

/// How a request ended.
#[derive(Debug, Clone, Copy)]
pub struct Finished {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Tokens generated.
    pub tokens: usize,
    /// Why it stopped.
    pub stop: StopReason,
    /// From arrival to the first token.
    pub first_token: Option<Duration>,
    /// From arrival to the end.
    pub latency: Duration,
}

/// Why a request could not be served.
#[derive(Debug, Clone, thiserror::Error)]
pub enum EngineError {
    /// Fewer than k rows can be grouped: the model is unavailable for now.
    #[error("the model is unavailable: {0}")]
    Unavailable(String),
    /// The coded steps kept failing.
    #[error("the request failed: {0}")]
    Failed(String),
}

/// Why a request was not taken.
#[derive(Debug, Clone, thiserror::Error)]
pub enum SubmitError {
    /// The queue is full; try again after about this long.
    #[error("the node is busy: {queued} requests are waiting")]
    Busy {
        /// Requests waiting.
        queued: usize,
        /// A fair wait before trying again.
        retry_after: Duration,
    },
    /// The engine has stopped.
    #[error("the node is stopping")]
    Stopped,
}

/// A request taken: its id and where its events come.
#[derive(Debug)]
pub struct Submitted {
    /// The request's id on this node.
    pub id: u64,
    /// Tokens, then the end (at most `max_tokens + 1` events).
    pub events: mpsc::UnboundedReceiver<Event>,
}

struct Job {
    id: u64,
    req: GenRequest,
    events: mpsc::UnboundedSender<Event>,
    arrived: Instant,
    span: tracing::Span,
}

/// What the engine needs from its node.
#[derive(Debug)]
pub struct EngineContext {
    /// The node's network client.
    pub client: Client,
    /// The node's identity: it signs the updates.
    pub key: libp2p::identity::Keypair,
    /// The model.
    pub manifest: ModelManifest,
    /// The node's own row.
    pub local: LocalRow,
    /// Asks the node's loop for the mesh's view.
    pub info: mpsc::Sender<InfoRequest>,
    /// Settings.
    pub cfg: EngineConfig,
    /// Where it counts what it does.
    pub metrics: Metrics,
    /// The node's runtime (the engine's thread waits on network futures through it).
    pub runtime: tokio::runtime::Handle,
}

/// A handle on a node's engine; clones share it.
#[derive(Debug, Clone)]
pub struct Engine {
    jobs: mpsc::Sender<Job>,
    next_id: Arc<AtomicU64>,
    /// Mean request latency lately, in milliseconds (for Retry-After).
    latency_ms: Arc<AtomicU64>,
    metrics: Metrics,
    max_context: usize,
}

impl Engine {
    /// Starts the engine's thread; it forms a group when the first request comes.
    pub fn start(ctx: EngineContext) -> Result<Self> {
        ctx.cfg.validate()?;
        let (jobs, rx) = mpsc::channel(ctx.cfg.queue.max(1));
        let latency_ms = Arc::new(AtomicU64::new(1000));
        let engine = Self {
            jobs,
            next_id: Arc::new(AtomicU64::new(1)),
            latency_ms: latency_ms.clone(),
            metrics: ctx.metrics.clone(),
            max_context: ctx.manifest.cfg.max_seq,
        };
        let trace = ctx
            .cfg
            .trace_steps
            .as_deref()
            .map(StepLog::create)
            .transpose()?;
        let learner = Learner::new(ctx.manifest.learning, ctx.manifest.cfg.clone());
        let worker = Worker {
            ctx,
            jobs: rx,
            formed: None,
            formed_failed: None,
            active: Vec::new(),
            held: None,
            to_learn: VecDeque::new(),
            learner,
            last_learn: Instant::now(),
            failures: 0,
            recent: VecDeque::new(),
            latency_ms,
            trace,
            steps: 0,
        };
        std::thread::Builder::new()
            .name("leader".into())
            .spawn(move || worker.run())?;
        Ok(engine)
    }

    /// Most positions (prompt and completion) a request can use.
    pub fn max_context(&self) -> usize {
        self.max_context
    }

    /// Queues a request; refused when the queue is full.
    pub fn submit(&self, req: GenRequest) -> Result<Submitted, SubmitError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, events) = mpsc::unbounded_channel();
        let span = tracing::info_span!("request", id, prompt_tokens = req.prompt.len());
        let job = Job {
            id,
            req,
            events: tx,
            arrived: Instant::now(),
            span,
        };
        match self.jobs.try_send(job) {
            Ok(()) => {
                self.metrics.queue_depth.inc();
                Ok(Submitted { id, events })
            }
            Err(mpsc::error::TrySendError::Full(_)) => {
                self.metrics.requests_rejected.inc();
                let queued = self.metrics.queue_depth.get().max(0) as usize;
                let ms = self.latency_ms.load(Ordering::Relaxed);
                Err(SubmitError::Busy {
                    queued,
                    retry_after: Duration::from_millis(ms.clamp(1000, 60_000)),
                })
            }
            Err(mpsc::error::TrySendError::Closed(_)) => Err(SubmitError::Stopped),
        }
    }
}

/// One request being generated.
struct Seq {
    job: Job,
    cache: KvCache,
    sampler: Sampler,
    /// Tokens to run in the next step: the prompt, then each new token.
    input: Vec<u32>,
    generated: Vec<u32>,
    first_token: Option<Duration>,
}

/// A finished request waiting to be trained on.
struct ToLearn {
    tokens: Vec<u32>,
    prompt_tokens: usize,
    generated: usize,
    latency: Duration,
}

/// A run of failed steps this long fails the requests in the batch.
const MAX_STEP_FAILURES: u32 = 3;
/// How long a failed group formation is trusted before trying again.
const FORM_RETRY: Duration = Duration::from_secs(1);
/// Finished requests wait at most this long to be trained on while others are generating.
const LEARN_EVERY: Duration = Duration::from_secs(5);
/// Most tokens in one training minibatch.
const LEARN_TOKENS: usize = 1024;
/// An idle engine publishes what its learner accumulated after this long.
const IDLE_FLUSH: Duration = Duration::from_secs(10);
/// Window of the tokens/s gauge.
const RATE_WINDOW: Duration = Duration::from_secs(10);

struct Worker {
    ctx: EngineContext,
    jobs: mpsc::Receiver<Job>,
    formed: Option<Formed>,
    /// When forming last failed, and why.
    formed_failed: Option<(Instant, String)>,
    active: Vec<Seq>,
    /// A request taken from the queue that did not fit the step's token budget.
    held: Option<Job>,
    to_learn: VecDeque<ToLearn>,
    learner: Learner,
    last_learn: Instant,
    failures: u32,
    /// Tokens generated lately, for the tokens/s gauge.
    recent: VecDeque<(Instant, u64)>,
    latency_ms: Arc<AtomicU64>,
    trace: Option<StepLog>,
    steps: u64,
}

impl Worker {
    fn run(mut self) {
        // Timers and network futures below need the node's runtime as their context.
        let runtime = self.ctx.runtime.clone();
        let _context = runtime.enter();
        loop {
            if !self.admit() {
                break;
            }
            if self.active.is_empty() {
                if !self.to_learn.is_empty() {
                    self.learn();
                    continue;
                }
                let next = runtime
                    .block_on(async { tokio::time::timeout(IDLE_FLUSH, self.jobs.recv()).await });
                match next {
                    Ok(Some(job)) => {
                        self.ctx.metrics.queue_depth.dec();
                        self.held = Some(job);
                    }
                    Ok(None) => break,
                    Err(_) => self.flush_learner(),
                }
                self.update_rate();
                continue;
            }
            self.step();
            if self.learning_due() {
                self.learn();
            }
        }
        tracing::info!("the engine stopped");
    }

    /// Takes queued requests into the batch while there is room; false once the queue is
    /// closed and nothing is left to do.
    fn admit(&mut self) -> bool {
        let mut budget = self
            .ctx
            .cfg
            .step_tokens
            .saturating_sub(self.active.iter().map(|s| s.input.len()).sum());
        while self.active.len() < self.ctx.cfg.max_batch {
            let job = match self.held.take() {
                Some(j) => j,
                None => match self.jobs.try_recv() {
                    Ok(j) => {
                        self.ctx.metrics.queue_depth.dec();
                        j
                    }
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => {
                        return !self.active.is_empty() || !self.to_learn.is_empty();
                    }
                },
            };
            if job.events.is_closed() {
                continue;
            }
            let len = job.req.prompt.len();
            if len > budget && !self.active.is_empty() {
                self.held = Some(job);
                break;
            }
            budget = budget.saturating_sub(len);
            match Sampler::new(job.req.sampling) {
                Ok(sampler) => {
                    job.span.in_scope(|| tracing::debug!("admitted"));
                    self.active.push(Seq {
                        cache: KvCache::new(&self.ctx.manifest.cfg),
                        sampler,
                        input: job.req.prompt.clone(),
                        generated: Vec::new(),
                        first_token: None,
                        job,
                    });
                }
                Err(e) => {
                    let _ = job
                        .events
                        .send(Event::Failed(EngineError::Failed(e.to_string())));
                }
            }
        }
        self.ctx
            .metrics
            .active_sequences
            .set(self.active.len() as i64);
        true
    }

    /// The mesh's view from the node's loop.
    fn info(&self) -> Result<MeshInfo> {
        let info = self.ctx.info.clone();
        self.ctx.runtime.block_on(settled_info(|| {
            let info = info.clone();
            async move {
                let (tx, rx) = oneshot::channel();
                info.send(InfoRequest(tx))
                    .await
                    .map_err(|_| anyhow!("the node is stopping"))?;
                rx.await.map_err(|_| anyhow!("the node is stopping"))
            }
        }))
    }

    /// The group, formed now if there is none; `None` (every request in the batch failed)
    /// when the mesh cannot give one.
    fn ensure_group(&mut self) -> bool {
        if self.formed.is_some() {
            return true;
        }
        let error = match &self.formed_failed {
            Some((at, why)) if at.elapsed() < FORM_RETRY => why.clone(),
            _ => {
                let opts = GroupOptions {
                    trace: self.trace.clone(),
                    ..GroupOptions::new(self.ctx.cfg.verify, self.ctx.cfg.spares)
                };
                let formed = self.info().and_then(|info| {
                    self.ctx.runtime.block_on(form_group(
                        &self.ctx.client,
                        &self.ctx.manifest,
                        &info,
                        Some(&self.ctx.local),
                        &opts,
                    ))
                });
                match formed {
                    Ok(f) => {
                        tracing::info!(
                            members = ?f.group.nodes(),
                            live = f.live_rows,
                            condition_number = f.condition_number,
                            version = node_core::mesh::hex(&f.version[..8]),
                            "formed a group"
                        );
                        self.ctx.metrics.groups_formed.inc();
                        self.formed = Some(f);
                        self.formed_failed = None;
                        return true;
                    }
                    Err(e) => {
                        let why = format!("{e:#}");
                        tracing::warn!("no group: {why}");
                        self.formed_failed = Some((Instant::now(), why.clone()));
                        why
                    }
                }
            }
        };
        for seq in self.active.drain(..) {
            self.ctx.metrics.request_errors.inc();
            let _ = seq
                .job
                .events
                .send(Event::Failed(EngineError::Unavailable(error.clone())));
        }
        false
    }

    /// One forward step of every sequence in the batch, then a token for each.
    fn step(&mut self) {
        if !self.ensure_group() {
            return;
        }
        self.steps += 1;
        let rows: usize = self.active.iter().map(|s| s.input.len()).sum();
        let span = tracing::info_span!(
            "forward_step",
            step = self.steps,
            batch = self.active.len(),
            rows
        );
        let _entered = span.enter();
        let Some(f) = self.formed.as_mut() else {
            return;
        };
        let ids: Vec<String> = self.active.iter().map(|s| s.job.id.to_string()).collect();
        f.group
            .transport_mut()
            .set_context(format!("step {} req {}", self.steps, ids.join(",")));
        let mut items: Vec<BatchItem<'_>> = self
            .active
            .iter_mut()
            .map(|s| BatchItem {
                tokens: &s.input,
                cache: &mut s.cache,
            })
            .collect();
        let result = f.llama.forward_batch(&mut f.group, &mut items);
        drop(items);
        self.after_rounds();
        if let Some(t) = &self.trace {
            t.flush();
        }
        self.ctx.metrics.forward_steps.inc();
        match result {
            Ok(logits) => {
                self.failures = 0;
                let active = std::mem::take(&mut self.active);
                for (mut seq, logits) in active.into_iter().zip(logits) {
                    match self.advance(&mut seq, &logits) {
                        Some(stop) => self.finish(seq, stop),
                        None => self.active.push(seq),
                    }
                }
            }
            Err(e) => {
                self.failures += 1;
                tracing::warn!(attempt = self.failures, "a forward step failed: {e}");
                // Form the group again (a member died, or the mesh moved to another version).
                self.formed = None;
                if self.failures >= MAX_STEP_FAILURES {
                    self.failures = 0;
                    for seq in self.active.drain(..) {
                        self.ctx.metrics.request_errors.inc();
                        let _ = seq
                            .job
                            .events
                            .send(Event::Failed(EngineError::Failed(e.to_string())));
                    }
                }
            }
        }
        self.ctx
            .metrics
            .active_sequences
            .set(self.active.len() as i64);
        self.update_rate();
    }

    /// Samples a sequence's next token; `Some` when the sequence is done.
    fn advance(&mut self, seq: &mut Seq, logits: &[f32]) -> Option<StopReason> {
        let next = seq.sampler.sample(logits);
        if seq.first_token.is_none() {
            let t = seq.job.arrived.elapsed();
            seq.first_token = Some(t);
            self.ctx
                .metrics
                .time_to_first_token
                .observe(t.as_secs_f64());
        }
        if seq.job.req.stop_ids.contains(&next) {
            return Some(StopReason::Stop);
        }
        seq.generated.push(next);
        self.ctx.metrics.tokens_generated.inc();
        self.recent.push_back((Instant::now(), 1));
        if seq.job.events.send(Event::Token(next)).is_err() {
            return Some(StopReason::Cancelled);
        }
        if seq.generated.len() >= seq.job.req.max_tokens {
            return Some(StopReason::Length);
        }
        if seq.cache.len() >= self.ctx.manifest.cfg.max_seq {
            return Some(StopReason::Context);
        }
        seq.input = vec![next];
        None
    }

    /// Ends a sequence: tells its submitter, counts it, and keeps it to train on.
    fn finish(&mut self, seq: Seq, stop: StopReason) {
        let latency = seq.job.arrived.elapsed();
        let m = &self.ctx.metrics;
        m.requests.inc();
        m.prompt_tokens.inc_by(seq.job.req.prompt.len() as u64);
        m.request_latency.observe(latency.as_secs_f64());
        let old = self.latency_ms.load(Ordering::Relaxed);
        let ms = latency.as_millis() as u64;
        self.latency_ms.store((old * 7 + ms) / 8, Ordering::Relaxed);
        let done = Finished {
            prompt_tokens: seq.job.req.prompt.len(),
            tokens: seq.generated.len(),
            stop,
            first_token: seq.first_token,
            latency,
        };
        seq.job.span.in_scope(|| {
            tracing::info!(
                tokens = done.tokens,
                stop = ?stop,
                latency_ms = latency.as_millis() as u64,
                "finished"
            )
        });
        let _ = seq.job.events.send(Event::Done(done));
        let learns = self.ctx.cfg.learn && self.ctx.manifest.learning.enabled;
        let mut tokens = seq.job.req.prompt;
        tokens.extend_from_slice(&seq.generated);
        let window =
            node_core::learn::training_window(&self.ctx.manifest.learning, &self.ctx.manifest.cfg)
                .min(LEARN_TOKENS);
        if learns && tokens.len() >= 2 {
            let tokens = tokens[tokens.len().saturating_sub(window)..].to_vec();
            self.to_learn.push_back(ToLearn {
                tokens,
                prompt_tokens: done.prompt_tokens,
                generated: done.tokens,
                latency,
            });
        } else {
            self.ctx.local.served(Usage::of_request(
                done.prompt_tokens,
                done.tokens,
                latency,
                None,
            ));
        }
    }

    fn learning_due(&self) -> bool {
        !self.to_learn.is_empty()
            && (self.to_learn.len() >= self.ctx.cfg.max_batch
                || self.last_learn.elapsed() >= LEARN_EVERY)
    }

    /// Trains on finished requests as one minibatch through the group, and publishes the
    /// update when one is due.
    fn learn(&mut self) {
        self.last_learn = Instant::now();
        let mut batch = Vec::new();
        let mut tokens = 0;
        while let Some(next) = self.to_learn.front() {
            if !batch.is_empty() && tokens + next.tokens.len() > LEARN_TOKENS {
                break;
            }
            tokens += next.tokens.len();
            batch.extend(self.to_learn.pop_front());
        }
        let loss = if self.ensure_group() {
            self.train(&batch)
        } else {
            None
        };
        for r in batch {
            self.ctx.local.served(Usage::of_request(
                r.prompt_tokens,
                r.generated,
                r.latency,
                loss,
            ));
        }
    }

    /// The minibatch's loss, once its gradient went into the learner (and out, if due).
    fn train(&mut self, batch: &[ToLearn]) -> Option<f64> {
        let f = self.formed.as_mut()?;
        let span = tracing::info_span!("train", sequences = batch.len());
        let _entered = span.enter();
        f.group
            .transport_mut()
            .set_context(format!("train {} sequences", batch.len()));
        let seqs: Vec<&[u32]> = batch.iter().map(|r| r.tokens.as_slice()).collect();
        let started = Instant::now();
        let grads = f.llama.gradients_batch(&mut f.group, &seqs);
        self.after_rounds();
        if let Some(t) = &self.trace {
            t.flush();
        }
        let grads = match grads {
            Ok(g) => g,
            Err(e) => {
                tracing::warn!("training on {} requests failed: {e}", batch.len());
                self.formed = None;
                return None;
            }
        };
        let loss = grads.loss;
        self.ctx.metrics.loss.set(loss);
        tracing::info!(
            loss,
            sequences = batch.len(),
            seconds = started.elapsed().as_secs_f64(),
            "trained"
        );
        match self.learner.push(grads) {
            Ok(Some(p)) => self.publish(p),
            Ok(None) => {}
            Err(e) => tracing::warn!("the update could not be made: {e}"),
        }
        Some(loss)
    }

    /// Publishes what the learner accumulated, at the end of a busy spell.
    fn flush_learner(&mut self) {
        match self.learner.flush() {
            Ok(Some(p)) if self.ensure_group() => self.publish(p),
            Ok(_) => {}
            Err(e) => tracing::warn!("the update could not be made: {e}"),
        }
    }

    /// Hands an update to every live row's holder and to this node's own row, then moves the
    /// group to the new version.
    fn publish(&mut self, p: Published) {
        let Some(f) = self.formed.as_mut() else {
            return;
        };
        let payload = p.update.encode();
        let id = Update::id_of(&payload);
        let bytes = match seal(payload, &self.ctx.key) {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!("signing the update: {e}");
                return;
            }
        };
        let (before, _) = self.ctx.local.norms();
        let client = &self.ctx.client;
        let sends = f.holders.iter().map(|&peer| {
            let req = MeshRequest::Learn(bytes.clone());
            async move { (peer, ask(client, peer, req).await) }
        });
        let remote = self.ctx.runtime.block_on(futures::future::join_all(sends));
        let local = self.ctx.local.learn(&bytes);
        let took = remote.iter().filter(|(_, r)| r.is_ok()).count()
            + usize::from(matches!(local, MeshResponse::Learned { .. }));
        for (peer, e) in remote
            .iter()
            .filter_map(|(p, r)| Some((p, r.as_ref().err()?)))
        {
            tracing::warn!(%peer, "a node refused the update: {e:#}");
        }
        self.ctx.metrics.updates_published.inc();
        tracing::info!(
            id = format!("{id:016x}"),
            requests = p.requests,
            bytes = bytes.len(),
            taken_by = took,
            "published an update"
        );
        let (after, norms) = self.ctx.local.norms();
        let moved = before == f.version && matches!(local, MeshResponse::Learned { .. });
        match Llama::new(self.ctx.manifest.cfg.clone(), norms) {
            Ok(llama) if moved => {
                f.group.transport_mut().set_version(after);
                f.version = after;
                f.llama = llama;
            }
            _ => self.formed = None,
        }
    }

    /// Counts what the group's rounds did since the last call, and reports members it caught.
    fn after_rounds(&mut self) {
        let Some(f) = self.formed.as_mut() else {
            return;
        };
        let s = f.group.stats().clone();
        f.group.reset_stats();
        let m = &self.ctx.metrics;
        m.rounds_checked.inc_by(s.verified_rounds);
        m.members_replaced.inc_by(s.members_dropped);
        if s.verified_rounds > 0 {
            m.decode_residual_ratio.observe(s.max_pass_ratio);
        }
        let reports: Vec<(PeerId, node_core::coded::Caught)> = s
            .caught
            .iter()
            .filter_map(|c| Some((f.group.transport().peer_of(c.node)?, c.clone())))
            .collect();
        if reports.is_empty() {
            return;
        }
        m.members_caught.inc_by(reports.len() as u64);
        let holders = f.holders.clone();
        for (peer, evidence) in &reports {
            tracing::warn!(%peer, "caught: {evidence}");
            self.ctx.local.caught(*peer, evidence.to_string());
        }
        let client = self.ctx.client.clone();
        self.ctx.runtime.spawn(async move {
            for to in holders {
                for (peer, evidence) in &reports {
                    let req = MeshRequest::Report {
                        peer: peer.to_string(),
                        evidence: evidence.clone(),
                    };
                    if let Err(e) = ask(&client, to, req).await {
                        tracing::debug!(%to, "reporting a caught member: {e:#}");
                    }
                }
            }
        });
    }

    /// Sets the tokens/s gauge from the tokens of the last [`RATE_WINDOW`].
    fn update_rate(&mut self) {
        let now = Instant::now();
        while self
            .recent
            .front()
            .is_some_and(|(t, _)| now.duration_since(*t) > RATE_WINDOW)
        {
            self.recent.pop_front();
        }
        let tokens: u64 = self.recent.iter().map(|(_, n)| n).sum();
        self.ctx
            .metrics
            .tokens_per_second
            .set(tokens as f64 / RATE_WINDOW.as_secs_f64());
    }
}
