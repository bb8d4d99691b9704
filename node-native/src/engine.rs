//! Serving the requests a node leads (its OpenAI API): a bounded queue, a serving task that
//! runs every admitted request through one coded group, all of their new tokens in each round
//! (continuous batching: one coded round per stage for the whole batch), and a training task
//! that trains the mesh on the finished requests, a minibatch at a time, through a group of its
//! own. The training runs beside the serving, so streams do not stop for it; the serving task
//! publishes each update between two steps, so neither group ever sees members at two versions.
//! When training falls behind, the serving task takes no new requests until it catches up:
//! the queue fills and the API answers 429, and memory stays bounded.
//!
//! Both are tasks on the node's runtime: a request goes from the API through the engine and
//! the group's rounds to the members' sessions without leaving async code.
//!
//! A group is formed when first needed and kept while it works: after this node's own update
//! every member holds it, so both groups move to the new version in place. A step that fails (a
//! member died, another leader's update moved the mesh) forms the group again and runs the step
//! again; the requests' KV caches are kept (a cache computed before an update is used after it:
//! the model changed under the request, and the step trace shows where).

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow};
use libp2p::PeerId;
use node_core::learn::{Budgets, CANARY_TEXT, CanaryGate, Learner, Published};
use node_core::mesh::{MeshInfo, MeshResponse, ModelManifest, Usage};
use node_core::model::speculate;
use node_core::model::{
    BatchItem, KvCache, LeaderWeights, Llama, Sampler, SamplingParams, StopReason,
};
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::{mpsc, oneshot};
use tracing::Instrument;

use crate::metrics::Metrics;
use crate::remote::{Formed, Gate, GroupOptions, form_group, settled_info};
use crate::row::{InfoRequest, LocalRow};
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
    /// With `verify` 1, check against the check row's secret projections, not its answers.
    pub project: bool,
    /// Spare members asked beside them.
    pub spares: usize,
    /// Train the mesh on the requests (when the mesh learns).
    pub learn: bool,
    /// Where every coded step is written (`--trace-steps`).
    pub trace_steps: Option<PathBuf>,
    /// Most serving groups run side by side, each over holders no other uses; a group past
    /// the first forms only when the mesh has holders enough for it.
    pub groups: usize,
    /// Most drafted tokens checked in one forward pass of a sequence (prompt lookup).
    pub draft: usize,
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            max_batch: 16,
            queue: 64,
            step_tokens: 512,
            verify: 1,
            project: true,
            spares: 1,
            learn: true,
            trace_steps: None,
            groups: 4,
            draft: node_core::model::speculate::DEFAULT_DRAFT,
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
        anyhow::ensure!(
            (1..=MAX_GROUPS).contains(&self.groups),
            "serving groups must be 1 to {MAX_GROUPS}, got {}",
            self.groups
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
    /// The mesh may train on it (when the mesh learns at all).
    pub learn: bool,
    /// Whose learning budget it spends: the API key it came with, or "anonymous".
    pub caller: String,
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
#[derive(Debug, Clone)]
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
    /// The node's runtime (the engine's tasks run on it).
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
    /// Starts the engine's tasks; a group is formed when the first request comes.
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
        let learns = ctx.cfg.learn && ctx.manifest.learning.enabled;
        let (to_train, train_rx) = mpsc::unbounded_channel();
        let (publish_tx, publish_rx) = mpsc::unbounded_channel();
        let backlog = Arc::new(AtomicUsize::new(0));
        let shared = Arc::new(Shared::new(
            ctx.cfg.groups,
            ctx.metrics.serving_groups.clone(),
        ));
        if learns {
            let mut lead = Lead::new(ctx.clone(), trace.clone());
            lead.yield_to = Some(shared.clone());
            let trainer = Trainer {
                lead,
                learner: Learner::new(
                    ctx.manifest.learning,
                    ctx.manifest.cfg.clone(),
                    ctx.manifest.format,
                ),
                requests: train_rx,
                waiting: VecDeque::new(),
                publish: publish_tx,
                backlog: backlog.clone(),
                gate: CanaryGate::new(
                    node_core::model::Tokenizer::from_data(&ctx.manifest.tokenizer)?
                        .encode(CANARY_TEXT)?,
                ),
            };
            ctx.runtime.spawn(trainer.run());
        }
        let queue_depth = ctx.metrics.queue_depth.clone();
        let jobs = Arc::new(tokio::sync::Mutex::new(rx));
        let mut publishes = Some(publish_rx);
        for slot in 0..ctx.cfg.groups {
            // Only the first serving task publishes the trainer's updates.
            let publishes = publishes
                .take()
                .unwrap_or_else(|| mpsc::unbounded_channel().1);
            let mut lead = Lead::new(ctx.clone(), trace.clone());
            lead.slot = Some((slot, shared.clone()));
            let worker = Worker {
                lead,
                intake: Intake {
                    jobs: jobs.clone(),
                    held: None,
                    queue_depth: queue_depth.clone(),
                },
                active: Vec::new(),
                to_train: learns.then(|| to_train.clone()),
                publishes,
                backlog: backlog.clone(),
                failures: 0,
                latency_ms: latency_ms.clone(),
                steps: 0,
                shared: shared.clone(),
            };
            ctx.runtime.spawn(worker.run());
        }
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
    /// Tokens to run in the next step: the prompt, then each new token and its draft.
    input: Vec<u32>,
    /// The drafted tokens at the end of `input`.
    draft: usize,
    /// The prompt, then every token generated (what drafts are looked up in).
    text: Vec<u32>,
    first_token: Option<Duration>,
}

impl Seq {
    /// Tokens generated so far.
    fn generated(&self) -> usize {
        self.text.len() - self.job.req.prompt.len()
    }
}

/// A finished request waiting to be trained on.
struct ToLearn {
    tokens: Vec<u32>,
    prompt_tokens: usize,
    generated: usize,
    latency: Duration,
}

/// An update the trainer made, for the serving task to publish between two steps; the
/// answer is the new version and its norm gains (`None`: form the group again).
struct PublishRequest {
    published: Published,
    holders: Vec<PeerId>,
    done: oneshot::Sender<Option<([u8; 32], LeaderWeights)>>,
}

/// A run of failed steps this long fails the requests in the batch.
const MAX_STEP_FAILURES: u32 = 3;
/// How long a failed group formation is trusted before trying again.
const FORM_RETRY: Duration = Duration::from_secs(1);
/// Most tokens in one training minibatch, whatever the model.
const LEARN_TOKENS: usize = 1024;

/// Most tokens one training minibatch can carry on this mesh: every row of the batch goes
/// through the LM head, whose answers (`rows × vocab / k` values per member) must stay well
/// inside one message; exact updates (rank 0) carry every row, at most the training window.
fn learn_tokens(manifest: &ModelManifest) -> usize {
    let per_row = 2 * 4 * manifest.cfg.vocab.div_ceil(manifest.generator.k().max(1));
    let by_message = node_core::protocol::MAX_MESSAGE_BYTES / per_row.max(1);
    let window = node_core::learn::training_window(&manifest.learning, &manifest.cfg);
    let limit = if manifest.learning.rank == 0 {
        window
    } else {
        LEARN_TOKENS
    };
    limit.min(by_message).max(2)
}
/// Finished requests waiting to be trained on, at most: the trainer takes all that wait into
/// its next minibatch (each cut to its share of [`LEARN_TOKENS`]), so this bounds memory only;
/// requests that finish past it are served but not trained on.
const MAX_TRAIN_BACKLOG: usize = 4096;
/// Fewest positions a waiting request keeps when the minibatch is cut among many.
const MIN_SHARE: usize = 32;
/// The share of the time the trainer may take while requests are being served (all of it while
/// none are): serving keeps at least `1 − TRAIN_SHARE` of the mesh, and training still moves.
const TRAIN_SHARE: f64 = 0.15;
/// An idle trainer publishes what its learner accumulated after this long.
const IDLE_FLUSH: Duration = Duration::from_secs(10);
/// How often an idle serving task refreshes the tokens/s gauge, and a further one looks
/// whether the mesh has holders for its group (it is woken at once when the groups before it
/// change).
const IDLE_TICK: Duration = Duration::from_secs(1);
/// Window of the tokens/s gauge.
const RATE_WINDOW: Duration = Duration::from_secs(10);

/// A leader's group inside the node, formed when needed and kept while it works: what the
/// serving and the training task each hold.
struct Lead {
    ctx: EngineContext,
    /// A serving group's place among the node's serving groups (the trainer's has none).
    slot: Option<(usize, Arc<Shared>)>,
    formed: Option<Formed>,
    /// When forming last failed, and why.
    formed_failed: Option<(Instant, String)>,
    trace: Option<StepLog>,
    /// The serving tasks this group's rounds wait for (the trainer's: it computes only
    /// while they have nothing to serve).
    yield_to: Option<Arc<Shared>>,
}

impl Lead {
    fn new(ctx: EngineContext, trace: Option<StepLog>) -> Self {
        Self {
            ctx,
            slot: None,
            formed: None,
            formed_failed: None,
            trace,
            yield_to: None,
        }
    }

    /// The mesh's view from the node's loop.
    async fn info(&self) -> Result<MeshInfo> {
        let info = self.ctx.info.clone();
        settled_info(|| {
            let info = info.clone();
            async move {
                let (tx, rx) = oneshot::channel();
                info.send(InfoRequest(tx))
                    .await
                    .map_err(|_| anyhow!("the node is stopping"))?;
                rx.await.map_err(|_| anyhow!("the node is stopping"))
            }
        })
        .await
    }

    /// The group, formed now if there is none; why not when the mesh cannot give one.
    async fn group(&mut self) -> Result<&mut Formed, String> {
        if self.formed.is_none() {
            if let Some((at, why)) = &self.formed_failed
                && at.elapsed() < FORM_RETRY
            {
                return Err(why.clone());
            }
            // The first serving group takes the best holders; every other one leaves out the
            // holders the others compute with.
            let avoid = match &self.slot {
                Some((slot, shared)) if *slot > 0 => shared.busy_except(*slot),
                _ => Default::default(),
            };
            let mut opts = GroupOptions::new(self.ctx.cfg.verify, self.ctx.cfg.spares);
            opts.trace.clone_from(&self.trace);
            opts.group.avoid = avoid;
            opts.group.project = self.ctx.cfg.project;
            let formed = match self.info().await {
                Ok(info) => {
                    form_group(
                        &self.ctx.client,
                        &self.ctx.manifest,
                        &info,
                        Some(&self.ctx.local),
                        &opts,
                    )
                    .await
                }
                Err(e) => Err(e),
            };
            match formed {
                Ok(mut f) => {
                    if let Some(serving) = &self.yield_to {
                        let serving = serving.clone();
                        f.group.transport_mut().set_gate(serving.training_turns());
                    }
                    tracing::info!(
                        members = ?f.group.nodes(),
                        live = f.live_rows,
                        condition_number = f.condition_number,
                        version = node_core::mesh::hex(&f.version[..8]),
                        "formed a group"
                    );
                    self.ctx.metrics.groups_formed.inc();
                    if let Some((slot, shared)) = &self.slot {
                        shared.set_busy(*slot, f.members.clone());
                    }
                    self.formed = Some(f);
                    self.formed_failed = None;
                }
                Err(e) => {
                    let why = format!("{e:#}");
                    if matches!(self.slot, Some((slot, _)) if slot > 0) {
                        tracing::debug!("no further group: {why}");
                    } else {
                        tracing::warn!("no group: {why}");
                    }
                    self.formed_failed = Some((Instant::now(), why.clone()));
                    return Err(why);
                }
            }
        }
        self.formed.as_mut().ok_or_else(|| "no group".to_string())
    }

    /// Lets the group go (it is formed again when next needed).
    fn drop_group(&mut self) {
        self.formed = None;
        if let Some((slot, shared)) = &self.slot {
            shared.set_busy(*slot, Vec::new());
        }
    }

    /// Writes out the step trace.
    fn flush_trace(&self) {
        if let Some(t) = &self.trace {
            t.flush();
        }
    }

    /// Counts what the group's rounds did since the last call, and reports members it caught.
    async fn after_rounds(&mut self) {
        self.flush_trace();
        let Some(f) = self.formed.as_mut() else {
            return;
        };
        let s = f.group.stats().clone();
        f.group.reset_stats();
        let m = &self.ctx.metrics;
        m.rounds_checked.inc_by(s.verified_rounds);
        m.rounds_projected.inc_by(s.projected_rounds);
        m.members_replaced.inc_by(s.members_dropped);
        if s.members_dropped > 0 {
            // Replacements came from free rows: the other serving groups must now avoid them
            // (and may use the holders this one let go).
            let t = f.group.transport();
            f.members = f
                .group
                .nodes()
                .iter()
                .filter_map(|&r| t.peer_of(r))
                .collect();
            if let Some((slot, shared)) = &self.slot {
                shared.set_busy(*slot, f.members.clone());
            }
        }
        if s.verified_rounds > 0 {
            m.decode_residual_ratio
                .observe(s.max_pass_ratio.max(s.max_projected_ratio));
        }
        if s.caught.is_empty() {
            return;
        }
        m.members_caught.inc_by(s.caught.len() as u64);
        for c in &s.caught {
            if let Some(&peer) = f.rows.get(&c.node) {
                tracing::warn!(%peer, "caught: {c}");
                self.ctx.local.caught(peer, c.to_string()).await;
            }
        }
        let link = crate::link::NativeLink::quiet(self.ctx.client.clone());
        let (rows, holders) = (f.rows.clone(), f.holders.clone());
        self.ctx.runtime.spawn(async move {
            node_core::lead::report_caught(&link, &s.caught, &rows, &holders).await;
        });
    }

    /// Moves the group to a version every member now holds, with its norm gains; forms it
    /// again when that is not possible.
    fn move_to(&mut self, moved: Option<&([u8; 32], LeaderWeights)>) {
        let Some(f) = self.formed.as_mut() else {
            return;
        };
        match moved.map(|(v, n)| (v, Llama::new(self.ctx.manifest.cfg.clone(), n.clone()))) {
            Some((version, Ok(llama))) => {
                f.group.transport_mut().set_version(*version);
                f.group.weights_moved();
                f.version = *version;
                f.llama = llama;
            }
            _ => self.drop_group(),
        }
    }
}

/// Most serving groups a node runs side by side.
pub const MAX_GROUPS: usize = 16;

/// What the serving tasks share: who computes with which holders, who waits for work, and
/// the recent tokens for the tokens/s gauge.
#[derive(Debug)]
struct Shared {
    /// Each serving group's member holders (empty while it has no group).
    busy: std::sync::Mutex<Vec<Vec<PeerId>>>,
    /// How many serving tasks hold a group (the gauge of `busy`).
    holding: Gauge,
    /// Sequences each serving task is generating (the trainer waits on it).
    active: tokio::sync::watch::Sender<Vec<usize>>,
    /// Tokens generated lately (when, how many).
    recent: std::sync::Mutex<VecDeque<(Instant, u64)>>,
    /// Told whenever a serving group is formed or let go.
    groups_changed: tokio::sync::Notify,
    /// Every caller's learning budget, and the time they count from.
    budgets: std::sync::Mutex<(Budgets, Instant)>,
}

impl Shared {
    fn new(groups: usize, holding: Gauge) -> Self {
        Self {
            busy: std::sync::Mutex::new(vec![Vec::new(); groups]),
            holding,
            active: tokio::sync::watch::Sender::new(vec![0; groups]),
            recent: std::sync::Mutex::new(VecDeque::new()),
            groups_changed: tokio::sync::Notify::new(),
            budgets: std::sync::Mutex::new((Budgets::default(), Instant::now())),
        }
    }

    /// Takes `tokens` from `caller`'s learning budget; false when it has not that many left.
    fn spend(&self, caller: &str, tokens: usize) -> bool {
        let mut b = self.budgets.lock().unwrap_or_else(|e| e.into_inner());
        let now = b.1.elapsed();
        b.0.take(caller, tokens, now)
    }

    /// The holders every serving group but `slot` computes with.
    fn busy_except(&self, slot: usize) -> std::collections::BTreeSet<PeerId> {
        let busy = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        busy.iter()
            .enumerate()
            .filter(|(i, _)| *i != slot)
            .flat_map(|(_, peers)| peers.iter().copied())
            .collect()
    }

    /// Records the holders serving group `slot` computes with now.
    fn set_busy(&self, slot: usize, peers: Vec<PeerId>) {
        let mut busy = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(b) = busy.get_mut(slot) {
            *b = peers;
        }
        self.holding
            .set(busy.iter().filter(|b| !b.is_empty()).count() as i64);
        self.groups_changed.notify_waiters();
    }

    /// Whether a serving task other than `slot` holds a group and serves no sequence: it
    /// takes the next request at once, wherever it is in its loop (waiting on the queue,
    /// publishing, or just done forming its group).
    fn another_is_idle(&self, slot: usize) -> bool {
        let formed: Vec<bool> = {
            let busy = self.busy.lock().unwrap_or_else(|e| e.into_inner());
            busy.iter().map(|b| !b.is_empty()).collect()
        };
        let active = self.active.borrow();
        formed
            .iter()
            .zip(active.iter())
            .enumerate()
            .any(|(i, (&formed, &n))| i != slot && formed && n == 0)
    }

    /// Whether every serving group before `slot` has a group.
    fn formed_before(&self, slot: usize) -> bool {
        let busy = self.busy.lock().unwrap_or_else(|e| e.into_inner());
        busy.iter().take(slot).all(|b| !b.is_empty())
    }

    /// Sets serving task `slot`'s sequence count; the node's total.
    fn set_active(&self, slot: usize, n: usize) -> usize {
        self.active.send_if_modified(|active| {
            active
                .get_mut(slot)
                .is_some_and(|a| std::mem::replace(a, n) != n)
        });
        self.active.borrow().iter().sum()
    }

    /// Waits until the trainer may start its next round, after it worked for `worked` since
    /// its last one: at once while no serving task has a sequence, else once it has waited
    /// long enough that training keeps to [`TRAIN_SHARE`] of the time.
    async fn wait_turn(&self, worked: Duration) {
        let until = Instant::now() + worked.mul_f64((1.0 - TRAIN_SHARE) / TRAIN_SHARE);
        let mut active = self.active.subscribe();
        let quiet = active.wait_for(|a| a.iter().all(|&n| n == 0));
        // Either the serving tasks went quiet, or the trainer waited long enough.
        let _ = tokio::time::timeout_at(until.into(), quiet).await;
    }

    /// What a trainer's group waits for before each round: its turn ([`Self::wait_turn`]),
    /// counting as its work everything since its previous turn began.
    fn training_turns(self: Arc<Self>) -> Gate {
        let last = Arc::new(std::sync::Mutex::new(None::<Instant>));
        Gate(Arc::new(move || {
            let (shared, last) = (self.clone(), last.clone());
            Box::pin(async move {
                let worked = {
                    let last = last.lock().unwrap_or_else(|e| e.into_inner());
                    last.map_or(Duration::ZERO, |t| t.elapsed())
                };
                shared.wait_turn(worked).await;
                *last.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
            })
        }))
    }

    fn record_token(&self) {
        let mut recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        recent.push_back((Instant::now(), 1));
    }

    /// Tokens generated in the last [`RATE_WINDOW`].
    fn recent_tokens(&self) -> u64 {
        let now = Instant::now();
        let mut recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        while recent
            .front()
            .is_some_and(|(t, _)| now.duration_since(*t) > RATE_WINDOW)
        {
            recent.pop_front();
        }
        recent.iter().map(|(_, n)| n).sum()
    }
}

/// The serving task's end of the queue: requests in order, one of them possibly held back
/// until the batch has room for it.
struct Intake {
    /// The queue, shared by the serving tasks.
    jobs: Arc<tokio::sync::Mutex<mpsc::Receiver<Job>>>,
    /// A request taken from the queue that did not fit yet (the step's token budget); it
    /// comes out first.
    held: Option<Job>,
    queue_depth: Gauge,
}

/// What the queue gives next.
enum Next {
    /// A request to admit.
    Job(Job),
    /// Nothing waits now.
    Empty,
    /// The queue is closed and empty.
    Closed,
}

impl Intake {
    /// The next request: the held one, else one from the queue.
    fn next(&mut self) -> Next {
        if let Some(job) = self.held.take() {
            return Next::Job(job);
        }
        // Another serving task waiting on the queue takes what comes.
        let Ok(mut jobs) = self.jobs.try_lock() else {
            return Next::Empty;
        };
        match jobs.try_recv() {
            Ok(job) => {
                self.queue_depth.dec();
                Next::Job(job)
            }
            Err(mpsc::error::TryRecvError::Empty) => Next::Empty,
            Err(mpsc::error::TryRecvError::Disconnected) => Next::Closed,
        }
    }

    /// Whether a request is held back for this task.
    fn holds(&self) -> bool {
        self.held.is_some()
    }

    /// Holds a request back: `next` gives it first.
    fn hold(&mut self, job: Job) {
        debug_assert!(self.held.is_none(), "one request is held at a time");
        self.held = Some(job);
    }

    /// Waits up to `wait` while nothing runs: with the held request if there is one (it waits
    /// for room), else for a request to come, which is then held. False once the queue is
    /// closed and nothing is held.
    async fn idle(&mut self, wait: Duration) -> bool {
        if self.held.is_some() {
            tokio::time::sleep(wait).await;
            return true;
        }
        let jobs = self.jobs.clone();
        let next = tokio::time::timeout(wait, async move { jobs.lock().await.recv().await }).await;
        match next {
            Ok(Some(job)) => {
                self.queue_depth.dec();
                self.held = Some(job);
                true
            }
            Ok(None) => false,
            Err(_) => true,
        }
    }
}

/// The serving task: the batch, the queue, and publishing the trainer's updates.
struct Worker {
    lead: Lead,
    intake: Intake,
    active: Vec<Seq>,
    /// Where finished requests go to be trained on (when the mesh learns).
    to_train: Option<mpsc::UnboundedSender<ToLearn>>,
    publishes: mpsc::UnboundedReceiver<PublishRequest>,
    /// Finished requests not yet trained on.
    backlog: Arc<AtomicUsize>,
    failures: u32,
    latency_ms: Arc<AtomicU64>,
    steps: u64,
    /// What the serving tasks share.
    shared: Arc<Shared>,
}

impl Worker {
    async fn run(mut self) {
        let slot = self.slot();
        let shared = self.shared.clone();
        loop {
            self.publish_due().await;
            if slot > 0 && self.active.is_empty() {
                // Registered before looking, so a group formed meanwhile still wakes this task.
                let changed = shared.groups_changed.notified();
                tokio::pin!(changed);
                changed.as_mut().enable();
                if !self.ready().await {
                    // A further group waits until the groups before it hold theirs and the
                    // mesh has holders for one more; only then does it take requests.
                    if self.lead.ctx.info.is_closed() {
                        break;
                    }
                    let _ = tokio::time::timeout(IDLE_TICK, changed).await;
                    continue;
                }
            }
            if !self.admit() {
                break;
            }
            if self.active.is_empty() {
                // Idle: woken by a request, an update to publish, or the gauge's tick.
                tokio::select! {
                    more = self.intake.idle(IDLE_TICK) => if !more {
                        break;
                    },
                    Some(req) = self.publishes.recv() => self.publish_one(req).await,
                }
                self.update_rate();
                continue;
            }
            self.step().await;
        }
        tracing::info!(slot, "a serving task stopped");
    }

    /// This serving task's place among the node's serving groups.
    fn slot(&self) -> usize {
        self.lead.slot.as_ref().map_or(0, |(slot, _)| *slot)
    }

    /// Whether a further serving task holds a group it can serve with: formed once every
    /// group before it has one.
    async fn ready(&mut self) -> bool {
        let slot = self.slot();
        if self.lead.formed.is_some() {
            return true;
        }
        if !self.shared.formed_before(slot) {
            return false;
        }
        self.lead.group().await.is_ok()
    }

    /// Takes queued requests into the batch while there is room; false once the queue is
    /// closed and nothing is left to do.
    fn admit(&mut self) -> bool {
        let mut budget = self
            .lead
            .ctx
            .cfg
            .step_tokens
            .saturating_sub(self.active.iter().map(|s| s.input.len()).sum());
        while self.active.len() < self.lead.ctx.cfg.max_batch {
            // A busy task leaves new requests to an idle one: its own group runs them.
            if !self.active.is_empty()
                && !self.intake.holds()
                && self.shared.another_is_idle(self.slot())
            {
                break;
            }
            let job = match self.intake.next() {
                Next::Job(j) => j,
                Next::Empty => break,
                Next::Closed => return !self.active.is_empty(),
            };
            if job.events.is_closed() {
                continue;
            }
            let len = job.req.prompt.len();
            if len > budget && !self.active.is_empty() {
                self.intake.hold(job);
                break;
            }
            budget = budget.saturating_sub(len);
            match Sampler::new(job.req.sampling) {
                Ok(sampler) => {
                    job.span.in_scope(|| tracing::debug!("admitted"));
                    self.active.push(Seq {
                        cache: KvCache::new(&self.lead.ctx.manifest.cfg),
                        sampler,
                        input: job.req.prompt.clone(),
                        draft: 0,
                        text: job.req.prompt.clone(),
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
        self.count_active();
        true
    }

    /// Sets the active-sequences gauge.
    fn count_active(&self) {
        let slot = self.slot();
        let all = self.shared.set_active(slot, self.active.len());
        self.lead.ctx.metrics.active_sequences.set(all as i64);
    }

    /// Fails every request in the batch.
    fn fail_all(&mut self, error: &EngineError) {
        for seq in self.active.drain(..) {
            self.lead.ctx.metrics.request_errors.inc();
            let _ = seq.job.events.send(Event::Failed(error.clone()));
        }
    }

    /// One forward step of every sequence in the batch, then a token for each.
    async fn step(&mut self) {
        let f = match self.lead.group().await {
            Ok(f) => f,
            Err(why) => {
                self.fail_all(&EngineError::Unavailable(why));
                return;
            }
        };
        self.steps += 1;
        let rows: usize = self.active.iter().map(|s| s.input.len()).sum();
        let span = tracing::info_span!(
            "forward_step",
            step = self.steps,
            batch = self.active.len(),
            rows
        );
        let ids: Vec<String> = self.active.iter().map(|s| s.job.id.to_string()).collect();
        f.group
            .transport_mut()
            .set_context(format!("step {} req {}", self.steps, ids.join(",")));
        let mut items: Vec<BatchItem<'_>> = self
            .active
            .iter_mut()
            .map(|s| BatchItem {
                logits: 1 + s.draft,
                ..BatchItem::new(&s.input, &mut s.cache)
            })
            .collect();
        let result = f
            .llama
            .forward_batch(&mut f.group, &mut items)
            .instrument(span)
            .await;
        drop(items);
        let moved = result.is_err() && f.group.transport().met_another_version();
        self.lead.after_rounds().await;
        self.lead.ctx.metrics.forward_steps.inc();
        match result {
            Ok(logits) => {
                self.failures = 0;
                let active = std::mem::take(&mut self.active);
                for (mut seq, logits) in active.into_iter().zip(logits) {
                    match self.advance(&mut seq, &logits) {
                        Some(stop) => self.finish(seq, stop).await,
                        None => self.active.push(seq),
                    }
                }
            }
            Err(e) => {
                self.failures += 1;
                self.lead.ctx.metrics.forward_step_failures.inc();
                if moved {
                    tracing::info!(
                        attempt = self.failures,
                        "members are at another version (the mesh moved on): forming the group again"
                    );
                } else {
                    tracing::warn!(attempt = self.failures, "a forward step failed: {e}");
                }
                // Form the group again (a member died, or the mesh moved to another version).
                self.lead.drop_group();
                if self.failures >= MAX_STEP_FAILURES {
                    self.failures = 0;
                    self.fail_all(&EngineError::Failed(e.to_string()));
                }
            }
        }
        self.count_active();
        self.update_rate();
    }

    /// Takes a sequence's next tokens (its draft's agreeing prefix, then one the model
    /// picked) and drafts the next; `Some` when the sequence is done.
    fn advance(&mut self, seq: &mut Seq, logits: &[f32]) -> Option<StopReason> {
        let cfg = &self.lead.ctx.manifest.cfg;
        let drafted = &seq.input[seq.input.len() - seq.draft..];
        let emitted = speculate::accept(&mut seq.sampler, logits, cfg.vocab, drafted);
        // Forget the drafted positions the model did not keep.
        let rejected = seq.draft - (emitted.len() - 1);
        seq.cache.truncate(seq.cache.len() - rejected);
        let m = &self.lead.ctx.metrics;
        m.draft_tokens.inc_by(seq.draft as u64);
        m.draft_accepted.inc_by((emitted.len() - 1) as u64);
        if seq.first_token.is_none() {
            let t = seq.job.arrived.elapsed();
            seq.first_token = Some(t);
            m.time_to_first_token.observe(t.as_secs_f64());
        }
        for next in emitted {
            if seq.job.req.stop_ids.contains(&next) {
                return Some(StopReason::Stop);
            }
            seq.text.push(next);
            m.tokens_generated.inc();
            self.shared.record_token();
            if seq.job.events.send(Event::Token(next)).is_err() {
                return Some(StopReason::Cancelled);
            }
            if seq.generated() >= seq.job.req.max_tokens {
                return Some(StopReason::Length);
            }
        }
        if seq.cache.len() >= cfg.max_seq {
            return Some(StopReason::Context);
        }
        let last = *seq.text.last()?;
        let room = (cfg.max_seq - seq.cache.len() - 1)
            .min(seq.job.req.max_tokens - seq.generated() - 1)
            .min(self.lead.ctx.cfg.draft);
        let draft = speculate::draft(&seq.text, room);
        seq.draft = draft.len();
        seq.input = std::iter::once(last).chain(draft).collect();
        None
    }

    /// Ends a sequence: tells its submitter, counts it, and hands it to the trainer.
    async fn finish(&mut self, seq: Seq, stop: StopReason) {
        let latency = seq.job.arrived.elapsed();
        let m = &self.lead.ctx.metrics;
        m.requests.inc();
        m.prompt_tokens.inc_by(seq.job.req.prompt.len() as u64);
        m.request_latency.observe(latency.as_secs_f64());
        let old = self.latency_ms.load(Ordering::Relaxed);
        let ms = latency.as_millis() as u64;
        self.latency_ms.store((old * 7 + ms) / 8, Ordering::Relaxed);
        let done = Finished {
            prompt_tokens: seq.job.req.prompt.len(),
            tokens: seq.generated(),
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
        let ctx = &self.lead.ctx;
        let window = node_core::learn::training_window(&ctx.manifest.learning, &ctx.manifest.cfg)
            .min(LEARN_TOKENS);
        let item = ToLearn {
            tokens: node_core::learn::taught(&seq.job.req.prompt, window).to_vec(),
            prompt_tokens: done.prompt_tokens,
            generated: done.tokens,
            latency,
        };
        let mut learn = item.tokens.len() >= 2 && seq.job.req.learn && self.to_train.is_some();
        if learn {
            m.learn_requests.inc();
            if !self.shared.spend(&seq.job.req.caller, item.tokens.len()) {
                learn = false;
                m.train_over_budget.inc();
                tracing::info!(
                    caller = seq.job.req.caller,
                    "served, not trained on: the caller's learning budget is spent"
                );
            }
        }
        let behind = self.backlog.load(Ordering::Relaxed) >= MAX_TRAIN_BACKLOG;
        if learn && behind {
            m.train_dropped.inc();
            tracing::info!(
                backlog = MAX_TRAIN_BACKLOG,
                "served, not trained on: the trainer is that many requests behind and serving comes first"
            );
        }
        match &self.to_train {
            Some(tx) if learn && !behind => {
                self.backlog.fetch_add(1, Ordering::Relaxed);
                m.train_backlog.inc();
                if tx.send(item).is_err() {
                    self.backlog.fetch_sub(1, Ordering::Relaxed);
                    m.train_backlog.dec();
                }
            }
            _ => {
                ctx.local
                    .served(Usage::of_request(
                        done.prompt_tokens,
                        done.tokens,
                        latency,
                        None,
                    ))
                    .await
            }
        }
    }

    /// Publishes the trainer's updates, if any wait.
    async fn publish_due(&mut self) {
        while let Ok(req) = self.publishes.try_recv() {
            self.publish_one(req).await;
        }
    }

    /// Publishes one of the trainer's updates and moves the group to the version it makes.
    async fn publish_one(&mut self, req: PublishRequest) {
        let moved = self.publish(req.published, &req.holders).await;
        self.lead.move_to(moved.as_ref());
        let _ = req.done.send(moved);
    }

    /// Hands an update to every live row's holder and to this node's own row; the version
    /// that makes and its norm gains when this node's row took it.
    async fn publish(
        &mut self,
        p: Published,
        holders: &[PeerId],
    ) -> Option<([u8; 32], LeaderWeights)> {
        let ctx = &self.lead.ctx;
        let sealed = match node_core::lead::seal_update(&p, &ctx.key) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!("signing the update: {e}");
                return None;
            }
        };
        let (before, _) = ctx.local.norms();
        let link = crate::link::NativeLink::quiet(ctx.client.clone());
        let remote = node_core::lead::hand_out(&link, holders, &sealed).await;
        let (local, bytes) = (ctx.local.clone(), sealed.bytes.clone());
        let local = tokio::task::spawn_blocking(move || local.learn(&bytes))
            .await
            .unwrap_or_else(|e| MeshResponse::Error(e.to_string()));
        let took_here = matches!(local, MeshResponse::Learned { .. });
        let took = remote + usize::from(took_here);
        ctx.metrics.updates_published.inc();
        tracing::info!(
            id = format!("{:016x}", sealed.id),
            requests = p.requests,
            bytes = sealed.bytes.len(),
            taken_by = took,
            "published an update"
        );
        let was_at = self.lead.formed.as_ref().map_or(before, |f| f.version);
        (took_here && before == was_at).then(|| ctx.local.norms())
    }

    /// Sets the tokens/s gauge from the tokens of the last [`RATE_WINDOW`].
    fn update_rate(&mut self) {
        let tokens = self.shared.recent_tokens();
        self.lead
            .ctx
            .metrics
            .tokens_per_second
            .set(tokens as f64 / RATE_WINDOW.as_secs_f64());
    }
}

/// The training task: finished requests in, minibatch gradients through its own group,
/// updates through the canary gate and out to the serving task.
struct Trainer {
    lead: Lead,
    learner: Learner,
    requests: mpsc::UnboundedReceiver<ToLearn>,
    /// Requests taken that did not fit the last minibatch: the next one starts with them.
    waiting: VecDeque<ToLearn>,
    publish: mpsc::UnboundedSender<PublishRequest>,
    backlog: Arc<AtomicUsize>,
    /// Judges every update before it is published.
    gate: CanaryGate,
}

/// What one training pass takes: the requests it trains on, and their distinct token
/// sequences (requests that sent the same text train once, and count as many), each cut to its
/// share of the minibatch's positions.
struct Minibatch {
    requests: Vec<ToLearn>,
    seqs: Vec<Vec<u32>>,
}

/// Takes requests from the front of `waiting` while their distinct sequences fit `limit`
/// positions at [`MIN_SHARE`] each, and cuts each sequence to its share (its last positions):
/// the shortest keep all they have, the rest split what is left evenly.
fn share_out(waiting: &mut VecDeque<ToLearn>, limit: usize) -> Minibatch {
    let most = (limit / MIN_SHARE).max(1);
    let (mut requests, mut seqs) = (Vec::new(), Vec::<Vec<u32>>::new());
    while let Some(r) = waiting.front() {
        let seen = seqs.contains(&r.tokens);
        if !seen && seqs.len() >= most {
            break;
        }
        if !seen {
            seqs.push(r.tokens.clone());
        }
        requests.extend(waiting.pop_front());
    }
    let total: usize = seqs.iter().map(Vec::len).sum();
    if total > limit {
        seqs.sort_by_key(Vec::len);
        let mut left = limit;
        let n = seqs.len();
        for (i, s) in seqs.iter_mut().enumerate() {
            let share = (left / (n - i)).max(2);
            let keep = s.len().min(share);
            s.drain(..s.len() - keep);
            left = left.saturating_sub(keep);
        }
    }
    Minibatch { requests, seqs }
}

impl Trainer {
    async fn run(mut self) {
        loop {
            if self.waiting.is_empty() {
                match tokio::time::timeout(IDLE_FLUSH, self.requests.recv()).await {
                    Ok(Some(r)) => self.waiting.push_back(r),
                    Ok(None) => break,
                    Err(_) => {
                        // Accumulated gradients (accumulate > 1) go out once requests stop.
                        match tokio::task::block_in_place(|| self.learner.flush()) {
                            Ok(Some(p)) => self.judge_and_hand_over(p).await,
                            Ok(None) => {}
                            Err(e) => tracing::warn!("the update could not be made: {e}"),
                        }
                        continue;
                    }
                }
            }
            // Everything that waits goes into this minibatch, each request cut to its share.
            while let Ok(r) = self.requests.try_recv() {
                self.waiting.push_back(r);
            }
            let limit = learn_tokens(&self.lead.ctx.manifest);
            let Minibatch {
                requests: batch,
                seqs,
            } = share_out(&mut self.waiting, limit);
            let loss = self.train(&seqs, batch.len()).await;
            for r in &batch {
                let usage = Usage::of_request(r.prompt_tokens, r.generated, r.latency, loss);
                self.lead.ctx.local.served(usage).await;
            }
            let m = &self.lead.ctx.metrics;
            if loss.is_some() {
                m.train_trained.inc_by(batch.len() as u64);
            }
            self.backlog.fetch_sub(batch.len(), Ordering::Relaxed);
            m.train_backlog.dec_by(batch.len() as i64);
        }
    }

    /// The minibatch's loss (its distinct sequences, for `requests` requests), once its
    /// gradient went into the learner (and out, if due).
    async fn train(&mut self, batch: &[Vec<u32>], requests: usize) -> Option<f64> {
        let span = tracing::info_span!("train", sequences = batch.len(), requests);
        let f = match self.lead.group().instrument(span.clone()).await {
            Ok(f) => f,
            Err(why) => {
                tracing::warn!("not trained on {} requests: {why}", batch.len());
                return None;
            }
        };
        f.group
            .transport_mut()
            .set_context(format!("train {} requests", batch.len()));
        let seqs: Vec<&[u32]> = batch.iter().map(Vec::as_slice).collect();
        let started = Instant::now();
        let grads = f
            .llama
            .gradients_batch(&mut f.group, &seqs)
            .instrument(span.clone())
            .await;
        self.lead.after_rounds().await;
        let mut grads = match grads {
            Ok(g) => g,
            Err(e) => {
                tracing::warn!("training on {} requests failed: {e}", batch.len());
                self.lead.drop_group();
                return None;
            }
        };
        // The step follows how many asked, not how many distinct texts they sent.
        grads.sequences = requests;
        let loss = grads.loss;
        self.lead.ctx.metrics.loss.set(loss);
        span.in_scope(|| {
            tracing::info!(
                loss,
                sequences = batch.len(),
                requests,
                positions = grads.t,
                seconds = started.elapsed().as_secs_f64(),
                "trained"
            )
        });
        // Folding in a gradient (and compressing an update) is long work off the network.
        match tokio::task::block_in_place(|| self.learner.push(grads)) {
            Ok(Some(p)) => self.judge_and_hand_over(p).await,
            Ok(None) => {}
            Err(e) => tracing::warn!("the update could not be made: {e}"),
        }
        Some(loss)
    }

    /// Runs an update through the canary gate, and publishes it if it passes; a refused one
    /// is forgotten by the learner too.
    async fn judge_and_hand_over(&mut self, published: Published) {
        let format = self.lead.ctx.manifest.format;
        let taken = published.update.clone().taken_by(format);
        let verdict = match self.lead.group().await {
            Ok(f) => {
                f.group.transport_mut().set_context("canary gate".into());
                let v = self
                    .gate
                    .judge(&f.llama, &mut f.group, f.version, &taken)
                    .await;
                self.lead.after_rounds().await;
                v.map_err(|e| e.to_string())
            }
            Err(why) => Err(why),
        };
        let m = self.lead.ctx.metrics.clone();
        let verdict = match verdict {
            Ok(v) => v,
            Err(why) => {
                // Unjudged, it is not published: the next minibatch makes another.
                tracing::warn!("an update could not be judged, not published: {why}");
                self.learner.refuse_last();
                self.lead.drop_group();
                return;
            }
        };
        // The mesh's canary loss from here on: after the update if it goes out, else before it.
        let canary = if verdict.pass {
            verdict.after
        } else {
            verdict.before
        };
        m.canary_loss.set(canary);
        self.lead
            .ctx
            .local
            .served(Usage::of_gate(canary, !verdict.pass))
            .await;
        if let Some(why) = verdict.refusal() {
            m.updates_refused.inc();
            tracing::warn!(
                requests = published.requests,
                "the canary gate refused an update: {why}"
            );
            self.learner.refuse_last();
            return;
        }
        tracing::info!(
            before = verdict.before,
            after = verdict.after,
            "the canary gate passed an update"
        );
        let requests = u64::from(published.requests);
        if let Some(version) = self.hand_over(published).await {
            self.gate.moved_to(version, verdict.after);
            m.train_learnt.inc_by(requests);
        }
    }

    /// Has the serving task publish an update, and follows the mesh to the new version: that
    /// version, when this node's row took it.
    async fn hand_over(&mut self, published: Published) -> Option<[u8; 32]> {
        let holders = match self.lead.group().await {
            Ok(f) => f.holders.clone(),
            Err(why) => {
                tracing::warn!("an update is lost: {why}");
                return None;
            }
        };
        let (done, answer) = oneshot::channel();
        let req = PublishRequest {
            published,
            holders,
            done,
        };
        if self.publish.send(req).is_err() {
            return None;
        }
        let moved = answer.await.ok().flatten();
        self.lead.move_to(moved.as_ref());
        moved.map(|(v, _)| v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A queued request with `prompt` as its prompt, and where its events would go.
    fn job(prompt: u32) -> (Job, mpsc::UnboundedReceiver<Event>) {
        let (events, rx) = mpsc::unbounded_channel();
        let req = GenRequest {
            prompt: vec![prompt],
            max_tokens: 1,
            sampling: SamplingParams::default(),
            stop_ids: Vec::new(),
            learn: true,
            caller: "anonymous".into(),
        };
        let job = Job {
            id: u64::from(prompt),
            req,
            events,
            arrived: Instant::now(),
            span: tracing::Span::none(),
        };
        (job, rx)
    }

    /// An intake over a queue holding requests with these prompts, as `Engine::submit` leaves it.
    fn intake(
        prompts: &[u32],
    ) -> (
        Intake,
        mpsc::Sender<Job>,
        Vec<mpsc::UnboundedReceiver<Event>>,
    ) {
        let (tx, jobs) = mpsc::channel(8);
        let queue_depth = Gauge::default();
        let mut events = Vec::new();
        for &p in prompts {
            let (j, rx) = job(p);
            tx.try_send(j).unwrap();
            queue_depth.inc();
            events.push(rx);
        }
        let intake = Intake {
            jobs: Arc::new(tokio::sync::Mutex::new(jobs)),
            held: None,
            queue_depth,
        };
        (intake, tx, events)
    }

    fn prompt(next: Next) -> Option<u32> {
        match next {
            Next::Job(j) => Some(j.req.prompt[0]),
            Next::Empty | Next::Closed => None,
        }
    }

    fn to_learn(tokens: Vec<u32>) -> ToLearn {
        ToLearn {
            tokens,
            prompt_tokens: 1,
            generated: 1,
            latency: Duration::ZERO,
        }
    }

    #[test]
    fn a_minibatch_takes_every_waiting_request_trains_each_text_once_and_cuts_them_to_fit() {
        // Ten requests: the same 100-token text six times, and four texts of 300, 40, 300 and
        // 300 tokens, with room for 512 positions (16 distinct texts at most).
        let same: Vec<u32> = (0..100).collect();
        let long = |seed: u32| -> Vec<u32> { (0..300).map(|i| i * 7 + seed).collect() };
        let mut waiting: VecDeque<ToLearn> = [
            same.clone(),
            long(1),
            same.clone(),
            (0..40).rev().collect(),
            same.clone(),
            long(2),
            same.clone(),
            long(3),
            same.clone(),
            same.clone(),
        ]
        .into_iter()
        .map(to_learn)
        .collect();
        let b = share_out(&mut waiting, 512);
        assert!(waiting.is_empty(), "every request is taken");
        assert_eq!(b.requests.len(), 10);
        assert_eq!(b.seqs.len(), 5, "the repeated text trains once");
        let total: usize = b.seqs.iter().map(Vec::len).sum();
        assert!(total <= 512, "{total} positions");
        // The short ones keep everything; the long ones split the rest, keeping their ends.
        let lens: Vec<usize> = b.seqs.iter().map(Vec::len).collect();
        assert_eq!(lens, vec![40, 100, 124, 124, 124]);
        assert!(b.seqs.iter().any(|s| s.last() == Some(&(299 * 7 + 3))));
        // Past the most distinct texts a minibatch holds, the rest wait for the next one.
        let mut many: VecDeque<ToLearn> = (0..20u32).map(|i| to_learn(vec![i, i + 1])).collect();
        let b = share_out(&mut many, 4 * MIN_SHARE);
        assert_eq!((b.seqs.len(), many.len()), (4, 16));
    }

    #[test]
    fn a_busy_task_leaves_a_request_to_a_task_with_a_group_and_nothing_to_serve() {
        let shared = Shared::new(3, Gauge::default());
        let peer = PeerId::random();
        assert!(!shared.another_is_idle(0), "no other task has a group");
        shared.set_busy(1, vec![peer]);
        assert!(
            shared.another_is_idle(0),
            "task 1 just formed its group: it takes the next request"
        );
        assert!(!shared.another_is_idle(1), "not itself");
        shared.set_active(1, 1);
        assert!(!shared.another_is_idle(0), "task 1 is serving");
        shared.set_active(1, 0);
        shared.set_busy(1, Vec::new());
        assert!(!shared.another_is_idle(0), "task 1 lost its group");
    }

    #[tokio::test]
    async fn training_waits_its_turn_while_serving_and_goes_on_once_serving_is_idle() {
        let shared = Arc::new(Shared::new(2, Gauge::default()));
        // Nothing served: no wait, however long the trainer worked.
        let t = Instant::now();
        shared.wait_turn(Duration::from_secs(100)).await;
        assert!(t.elapsed() < Duration::from_secs(1));
        shared.set_active(0, 2);
        shared.set_active(1, 1);
        // Serving: after 30 ms of work it waits 30 · 0.85 / 0.15 = 170 ms.
        let t = Instant::now();
        shared.wait_turn(Duration::from_millis(30)).await;
        let waited = t.elapsed();
        assert!(
            waited >= Duration::from_millis(170) && waited < Duration::from_secs(5),
            "{waited:?}"
        );
        let mut waiter = tokio::spawn({
            let shared = shared.clone();
            async move { shared.wait_turn(Duration::from_secs(100)).await }
        });
        shared.set_active(0, 0);
        assert!(
            tokio::time::timeout(Duration::from_millis(200), &mut waiter)
                .await
                .is_err(),
            "one serving task still has a sequence: the trainer must still wait"
        );
        shared.set_active(1, 0);
        waiter
            .await
            .expect("every serving task is idle: the trainer goes on");
    }

    #[tokio::test]
    async fn waiting_idle_with_a_held_request_keeps_it_and_the_queue() {
        // The load benchmark's lost requests: while the trainer was behind, every idle wait
        // took the next request into the one held slot, dropping the request already there.
        let (mut intake, _tx, events) = intake(&[1, 2, 3]);
        assert!(intake.idle(Duration::from_millis(1)).await);
        assert_eq!(intake.queue_depth.get(), 2, "one request left the queue");
        for _ in 0..3 {
            assert!(intake.idle(Duration::from_millis(1)).await);
        }
        assert_eq!(intake.queue_depth.get(), 2, "no other request was taken");
        for rx in &events {
            assert!(
                !rx.is_closed(),
                "every request is still alive to be answered"
            );
        }
        let order: Vec<_> = (0..4).map(|_| prompt(intake.next())).collect();
        assert_eq!(order, [Some(1), Some(2), Some(3), None]);
        assert_eq!(intake.queue_depth.get(), 0);
    }

    #[test]
    fn a_request_held_back_for_room_comes_first() {
        let (mut intake, _tx, _events) = intake(&[1, 2]);
        let Next::Job(first) = intake.next() else {
            panic!("a queued request")
        };
        intake.hold(first);
        let order: Vec<_> = (0..3).map(|_| prompt(intake.next())).collect();
        assert_eq!(order, [Some(1), Some(2), None]);
    }

    #[tokio::test]
    async fn a_closed_queue_ends_the_intake_only_once_the_held_request_is_out() {
        let (mut intake, tx, _events) = intake(&[7]);
        drop(tx);
        assert!(intake.idle(Duration::from_millis(1)).await);
        assert!(intake.idle(Duration::from_millis(1)).await, "7 is held");
        assert_eq!(prompt(intake.next()), Some(7));
        assert!(matches!(intake.next(), Next::Closed));
        assert!(!intake.idle(Duration::from_millis(1)).await);
    }

    #[tokio::test]
    async fn an_idle_wait_with_nothing_queued_takes_nothing() {
        let (mut intake, _tx, _events) = intake(&[]);
        assert!(intake.idle(Duration::from_millis(1)).await);
        assert!(matches!(intake.next(), Next::Empty));
    }
}
