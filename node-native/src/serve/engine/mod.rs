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
use node_core::lead::Stepped;
use node_core::lead::training::Turns;
use node_core::learn::{
    Budgets, CanaryGate, GateClaim, Learner, Published, TeachError, Teacher, Verdict, canary_tokens,
};
use node_core::mesh::{MeshInfo, MeshResponse, ModelManifest, Usage};
use node_core::model::{
    BatchLimits, Ended, Entry, GenerateOptions, LeaderWeights, Llama, ModelError, SamplingParams,
    StopReason, TokenLogprob,
};
use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::{mpsc, oneshot};
use tracing::Instrument;

use crate::hold::row::{InfoRequest, LocalRow};
use crate::lead::remote::{Formed, Gate, GroupOptions, form_group};
use crate::lead::steplog::StepLog;
use crate::net::swarm::Client;
use crate::serve::metrics::Metrics;

mod hop;
mod lead;
#[cfg(test)]
mod tests;
mod train;
mod worker;

use hop::HopSide;
use lead::Lead;
pub use node_core::lead::route::{HOP_OVER, PassRoute};
use train::{ToLearn, Trainer};
use worker::{Intake, Worker};

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
    /// How the serving groups run a forward pass: rounds, one hop per stage, or chosen.
    pub pass: PassRoute,
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
            pass: PassRoute::Auto,
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
    /// What it teaches, where not its prompt: a chat's user turns, without the template or the
    /// model's own earlier answers.
    pub lesson: Option<Vec<u32>>,
    /// Whose learning budget it spends: the name of the API key it came with, or "anonymous".
    pub caller: String,
    /// That caller's learning budget.
    pub budget: node_core::learn::Budget,
    /// What it asks beyond its tokens: log-probabilities, a constraint on its output.
    pub asks: Asks,
}

/// What a request asks beyond its tokens; by default nothing, and nothing is paid for.
#[derive(Debug, Clone, Default)]
pub struct Asks {
    /// Each generated token's log-probability, with this many likeliest alternatives.
    pub logprobs: Option<usize>,
    /// The prompt's log-probabilities too, with this many alternatives (a completion's `echo`).
    pub echo: Option<usize>,
    /// What its output must follow: each sequence builds its own from it.
    pub constraint: Option<Constrain>,
}

/// Builds a request's constraint ([`node_core::model::TokenConstraint`]) for its sequence,
/// from the start of its grammar; why not, when it cannot.
#[derive(Clone)]
pub struct Constrain(pub Arc<ConstraintBuilder>);

/// What [`Constrain`] calls.
pub type ConstraintBuilder =
    dyn Fn() -> Result<Box<dyn node_core::model::TokenConstraint>, String> + Send + Sync;

impl std::fmt::Debug for Constrain {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Constrain")
    }
}

/// What a request's submitter hears, in order: tokens, then one `Done` or `Failed`.
#[derive(Debug, Clone)]
pub enum Event {
    /// The next generated token, with its log-probability when they were asked for.
    Token(u32, Option<TokenLogprob>),
    /// The prompt's log-probabilities (each token after the first), when the request asked
    /// for them ([`Asks::echo`]); before `Done`.
    Prompt(Vec<TokenLogprob>),
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
    /// Who the node signs as: its identity and the certificate by which the mesh admits it
    /// to write (without one its requests do not train the mesh).
    pub signer: node_core::lead::Signer,
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
    /// The learning updates its groups' members are probed against, one choice per version
    /// for all its groups.
    pub probed: node_core::lead::ProbedUpdates,
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
    /// Where text to teach goes, when this node trains the mesh.
    teaching: Option<Teaching>,
}

/// What taking text from peers to teach needs: the trainer's queue, its backlog, the budgets
/// and the training window.
#[derive(Debug, Clone)]
struct Teaching {
    to_train: mpsc::UnboundedSender<ToLearn>,
    backlog: Arc<AtomicUsize>,
    shared: Arc<Shared>,
    window: usize,
}

/// The learning budget every peer that hands this node text to teach spends: PeerIds are free,
/// so they share one bucket, whoever they are.
pub const PEERS_CALLER: &str = "peers";

impl Engine {
    /// Starts the engine's tasks; a group is formed when the first request comes.
    pub fn start(ctx: EngineContext) -> Result<Self> {
        ctx.cfg.validate()?;
        let (jobs_tx, rx) = mpsc::channel(ctx.cfg.queue.max(1));
        let latency_ms = Arc::new(AtomicU64::new(1000));

        let trace = ctx
            .cfg
            .trace_steps
            .as_deref()
            .map(StepLog::create)
            .transpose()?;
        let admitted = ctx.signer.cert.is_some();
        if ctx.cfg.learn && ctx.manifest.learning.enabled && !admitted {
            eprintln!(
                "this node is not admitted to write the model (no certificate from the mesh's key: `codedmesh admit`): the text of the requests it serves goes to a node that trains"
            );
        }
        let learns = ctx.cfg.learn && ctx.manifest.learning.enabled && admitted;
        // A node the mesh does not admit hands its users' text to one that trains.
        let forward = (ctx.cfg.learn && ctx.manifest.learning.enabled && !admitted).then(|| {
            let (tx, rx) = mpsc::channel(FORWARD_QUEUE);
            ctx.runtime.spawn(forward_to_trainers(ctx.clone(), rx));
            tx
        });
        // Unbounded, as the backlog counts them: a text is queued only while the trainer's
        // backlog is under MAX_TRAIN_BACKLOG, and a publish request a trained step at a time.
        let (to_train, train_rx) = mpsc::unbounded_channel();
        let (publish_tx, publish_rx) = mpsc::unbounded_channel();
        let backlog = Arc::new(AtomicUsize::new(0));
        let shared = Arc::new(Shared::new(
            ctx.cfg.groups,
            ctx.metrics.serving_groups.clone(),
        ));
        if learns {
            let mut lead = Lead::new(ctx.clone(), trace.clone(), PassRoute::Rounds);
            lead.yield_to = Some(shared.clone());
            let tokenizer = node_core::model::Tokenizer::from_data(&ctx.manifest.tokenizer)?;
            let trainer = Trainer {
                lead,
                teacher: Teacher::new(
                    Learner::new(
                        ctx.manifest.learning,
                        ctx.manifest.cfg.clone(),
                        ctx.manifest.format,
                    ),
                    Some(CanaryGate::new(
                        canary_tokens(&tokenizer)?,
                        ctx.manifest.canary_loss,
                    )),
                    ctx.manifest.format,
                )
                .for_mesh(&tokenizer)?,
                requests: train_rx,
                publish: publish_tx,
                backlog: backlog.clone(),
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
            let mut lead = Lead::new(ctx.clone(), trace.clone(), ctx.cfg.pass);
            lead.slot = Some((slot, shared.clone()));
            let worker = Worker {
                lead,
                intake: Intake {
                    jobs: jobs.clone(),
                    held: None,
                    queue_depth: queue_depth.clone(),
                },
                to_train: learns.then(|| to_train.clone()),
                forward: forward.clone(),
                publishes,
                backlog: backlog.clone(),
                latency_ms: latency_ms.clone(),
                shared: shared.clone(),
            };
            ctx.runtime.spawn(worker.run());
        }
        let window = node_core::learn::training_window(&ctx.manifest.learning, &ctx.manifest.cfg)
            .min(node_core::lead::training::LEARN_TOKENS);
        Ok(Self {
            jobs: jobs_tx,
            next_id: Arc::new(AtomicU64::new(1)),
            latency_ms,
            metrics: ctx.metrics.clone(),
            max_context: ctx.manifest.cfg.max_seq,
            teaching: learns.then(|| Teaching {
                to_train,
                backlog,
                shared,
                window,
            }),
        })
    }

    /// Whether this node trains the mesh: it learns, and the mesh admits it to write.
    pub fn trains(&self) -> bool {
        self.teaching.is_some()
    }

    /// Takes text a peer that may not write the model hands this node to teach (its user's
    /// request, token ids): the trainer trains on it with its next minibatch, under the
    /// [`PEERS_CALLER`] budget every such peer shares and the canary gate. Why not, when it
    /// does not.
    pub fn teach(&self, tokens: Vec<u32>, from: &PeerId) -> Result<(), String> {
        let Some(t) = &self.teaching else {
            return Err(
                "this node does not train the mesh (not admitted, or learning is off)".into(),
            );
        };
        let tokens = node_core::learn::taught(&tokens, t.window).to_vec();
        if !t.shared.spend(PEERS_CALLER, None, tokens.len()) {
            self.metrics.train_over_budget.inc();
            tracing::info!(%from, "text to teach refused: the peers' learning budget is spent");
            return Err("the learning budget of text from peers is spent: try again later".into());
        }
        if t.backlog.load(Ordering::Relaxed) >= MAX_TRAIN_BACKLOG {
            self.metrics.train_dropped.inc();
            return Err("the trainer is behind: try again later".into());
        }
        t.backlog.fetch_add(1, Ordering::Relaxed);
        self.metrics.train_backlog.inc();
        self.metrics.learn_requests.inc();
        let item = ToLearn {
            prompt_tokens: tokens.len(),
            tokens,
            generated: 0,
            latency: Duration::ZERO,
            served: false,
        };
        if t.to_train.send(item).is_err() {
            t.backlog.fetch_sub(1, Ordering::Relaxed);
            self.metrics.train_backlog.dec();
            return Err("the trainer stopped".into());
        }
        self.metrics.by_key("taught", PEERS_CALLER).inc();
        tracing::info!(%from, "took text from a peer to teach");
        Ok(())
    }

    /// Most positions (prompt and completion) a request can use.
    pub fn max_context(&self) -> usize {
        self.max_context
    }

    /// Queues a request; refused when the queue is full.
    pub fn submit(&self, req: GenRequest) -> Result<Submitted, SubmitError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        // Unbounded: a request's events are at most its max_tokens pieces and an end, and the
        // API reads them as they come.
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

/// A request in a serving task's batch, and when its first token came.
struct Served {
    job: Job,
    first_token: Option<Duration>,
}

/// A sequence of the batch: its request, decoding and keys and values.
type Seq = Entry<Served>;

/// An update the trainer made, for the serving task to publish between two steps; the
/// answer is the new version and its norm gains (`None`: form the group again).
struct PublishRequest {
    published: Published,
    /// The canary gate's verdict on it, which the update carries.
    verdict: Option<GateClaim>,
    holders: Vec<PeerId>,
    done: oneshot::Sender<Option<([u8; 32], LeaderWeights)>>,
}

/// Texts waiting to be handed to a trainer; past that a request is served and not taught.
const FORWARD_QUEUE: usize = 64;

/// Hands the text of the requests this node served (it may not write the model) to nodes that
/// train, as the mesh's view shows them (`trains` in their heartbeats), one after another; a
/// text no trainer takes is dropped (the request was served).
async fn forward_to_trainers(ctx: EngineContext, mut texts: mpsc::Receiver<(String, Vec<u32>)>) {
    let me = ctx.client.peer_id();
    let mut turn = 0usize;
    while let Some((caller, tokens)) = texts.recv().await {
        let (tx, rx) = oneshot::channel();
        if ctx.info.send(InfoRequest(tx)).await.is_err() {
            return;
        }
        let Ok(info) = rx.await else { return };
        let trainers: Vec<PeerId> = info
            .nodes
            .iter()
            .filter(|n| n.trains && n.health == node_core::mesh::Health::Healthy)
            .filter_map(|n| n.peer.parse().ok())
            .filter(|p| *p != me)
            .collect();
        let Some(&to) = trainers.get(turn % trainers.len().max(1)) else {
            tracing::info!("no node that trains is known: a request's text is not taught");
            continue;
        };
        turn += 1;
        let request = node_core::mesh::MeshRequest::Teach(tokens);
        match crate::net::rpc::ask(&ctx.client, to, request).await {
            Ok(MeshResponse::Taught) => {
                ctx.metrics.by_key("taught_by_a_trainer", &caller).inc();
            }
            Ok(MeshResponse::Error(e)) => tracing::info!(%to, "a trainer did not take a text: {e}"),
            Ok(_) => tracing::info!(%to, "a trainer answered a text with something else"),
            Err(e) => tracing::info!(%to, "handing a text to a trainer: {e:#}"),
        }
    }
}

/// Finished requests waiting to be trained on, at most: the trainer takes all that wait into
/// its next minibatch (each cut to its share of [`node_core::lead::training::LEARN_TOKENS`]),
/// so this bounds memory only; requests that finish past it are served but not trained on.
const MAX_TRAIN_BACKLOG: usize = 4096;
/// How often an idle serving task refreshes the tokens/s gauge, and a further one looks
/// whether the mesh has holders for its group (it is woken at once when the groups before it
/// change).
const IDLE_TICK: Duration = Duration::from_secs(1);
/// Window of the tokens/s gauge.
const RATE_WINDOW: Duration = Duration::from_secs(10);

/// Most serving groups a node runs side by side.
pub const MAX_GROUPS: usize = 16;

/// Whether no serving task has a sequence, by each one's count.
fn quiet(active: &[usize]) -> bool {
    active.iter().all(|&n| n == 0)
}

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
    /// The trainer's turns at the mesh while requests are served.
    turns: std::sync::Mutex<Turns>,
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
            turns: std::sync::Mutex::new(Turns::default()),
        }
    }

    /// Takes `tokens` from `caller`'s learning budget (`budget`, where it has one of its own);
    /// false when it has not that many left.
    fn spend(&self, caller: &str, budget: Option<node_core::learn::Budget>, tokens: usize) -> bool {
        let mut b = self.budgets.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(budget) = budget {
            b.0.set(caller, budget);
        }
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

    /// Waits until the trainer may start its next round by its `turns`
    /// ([`node_core::lead::training::Turns`]), or until no serving task has a sequence.
    async fn wait_turn(&self, turns: &Turns) {
        let until = turns.next(Instant::now(), self.serving());
        // Either the serving tasks went quiet, or the trainer waited long enough.
        let _ = tokio::time::timeout_at(until.into(), self.quiet()).await;
    }

    /// Whether a serving task has a sequence now.
    fn serving(&self) -> bool {
        !quiet(&self.active.borrow())
    }

    /// Waits until no serving task has a sequence.
    async fn quiet(&self) {
        let mut active = self.active.subscribe();
        // `self` holds the sender, so the wait ends only when serving is quiet.
        let _ = active.wait_for(|a| quiet(a)).await;
    }

    /// What a trainer's group waits for before each round: its turn ([`Self::wait_turn`]),
    /// counting as its work everything since its previous round began, until the trainer rests
    /// ([`Self::rest_turns`]).
    fn training_turns(self: Arc<Self>) -> Gate {
        Gate(Arc::new(move || {
            let shared = self.clone();
            Box::pin(async move {
                let turns = shared
                    .turns
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .clone();
                shared.wait_turn(&turns).await;
                let mut turns = shared.turns.lock().unwrap_or_else(|e| e.into_inner());
                turns.began(Instant::now());
            })
        }))
    }

    /// The trainer stopped working (a minibatch trained and its update settled): the time
    /// until its next round is not counted as work.
    fn rest_turns(&self) {
        let mut turns = self.turns.lock().unwrap_or_else(|e| e.into_inner());
        turns.rest();
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
