//! The leader's half of the simulation: [`SimTransport`], a leader's transport over simulated
//! members computing on real shards, with faults; a group over it ([`sim_group`]); holders in
//! memory ([`MemoryHolders`]) for the holder logic.

use super::*;

/// How a simulated member misbehaves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Serves this many requests, then crashes while serving the next one: that request's
    /// connection breaks, and every later request is refused.
    Crash {
        /// Requests served before the crash.
        after_requests: u64,
    },
    /// Serves this many requests, then never answers again (the connection stays open).
    Stall {
        /// Requests served before the stall.
        after_requests: u64,
    },
    /// Serves this many requests, then answers every later one wrong (its values scaled and
    /// shifted), on time.
    Lie {
        /// Requests served honestly first.
        after_requests: u64,
    },
}

/// One round as the simulated leader ran it.
#[derive(Debug, Clone, PartialEq)]
pub struct RoundRecord {
    /// Index of the round, from 1.
    pub round: u64,
    /// Virtual time at which it started.
    pub started: Duration,
    /// Virtual time it took.
    pub took: Duration,
    /// Answers needed.
    pub need: usize,
    /// The members the round started with (after the pool swapped chronic stragglers).
    pub started_with: Vec<usize>,
    /// The members when it ended (failed ones dropped, replacements added).
    pub ended_with: Vec<usize>,
    /// Rows the request went to, in order.
    pub asked: Vec<usize>,
    /// Rows whose answers were used.
    pub answered: Vec<usize>,
    /// Rows whose request failed during the round, with why.
    pub failed: Vec<(usize, String)>,
    /// Members left out because their connection broke after an earlier round had ended.
    pub noticed_down: Vec<usize>,
    /// Whether the round got its answers.
    pub ok: bool,
}

/// How the simulated leader's transport behaves.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LeaderConfig {
    /// Seed of its latencies.
    pub seed: u64,
    /// Shortest round trip to a member (compute included).
    pub min_latency: Duration,
    /// Longest round trip.
    pub max_latency: Duration,
    /// Round timing of the [`RoundDriver`].
    pub round: RoundConfig,
    /// Spares planned beyond k.
    pub spares: usize,
}

impl Default for LeaderConfig {
    fn default() -> Self {
        Self {
            seed: 0,
            min_latency: Duration::from_millis(5),
            max_latency: Duration::from_millis(60),
            round: RoundConfig::default(),
            spares: 1,
        }
    }
}

#[derive(Debug, Clone)]
struct SimMember {
    member: Member,
    fault: Option<Fault>,
    requests: u64,
}

/// What comes back from a member on the simulated wire.
#[derive(Debug)]
enum Reply {
    /// It answers: computed on arrival (late answers of a finished round are never computed).
    Answer,
    /// It answers wrong.
    Lie,
    /// Its connection failed.
    Failed(String),
}

/// A leader's [`Transport`] over simulated members, in virtual time.
#[derive(Debug)]
pub struct SimTransport {
    clock: VirtualClock,
    rng: SimRng,
    cfg: LeaderConfig,
    members: Vec<SimMember>,
    pool: MemberPool,
    log: Vec<RoundRecord>,
    sent: u64,
    /// Connection failures that arrive after their round ended: when, and whose.
    late: Vec<(Instant, usize)>,
    /// What each round waits for before it starts, if anything.
    gate: Option<RoundGate>,
}

/// What a round waits for before it starts, as a network transport's gate (the API trainer's
/// turns): given the virtual now, the moment the round may start.
pub struct RoundGate(pub Box<dyn FnMut(Instant) -> Instant>);

impl std::fmt::Debug for RoundGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RoundGate")
    }
}

impl SimTransport {
    /// A transport to `members`, each at the index of its row; `free` rows are the pool's
    /// spares beyond the group.
    pub fn new(
        members: Vec<Member>,
        generator: Generator,
        free: Vec<usize>,
        cfg: LeaderConfig,
    ) -> Result<Self, CodedError> {
        if let Some((i, m)) = members
            .iter()
            .enumerate()
            .find(|(i, m)| m.shards().node != *i)
        {
            return Err(CodedError::BadRequest(format!(
                "member at index {i} holds row {}",
                m.shards().node
            )));
        }
        Ok(Self {
            clock: VirtualClock::new(),
            rng: SimRng::new(cfg.seed),
            members: members
                .into_iter()
                .map(|member| SimMember {
                    member,
                    fault: None,
                    requests: 0,
                })
                .collect(),
            pool: MemberPool::new(generator, free, cfg.round),
            cfg,
            log: Vec::new(),
            sent: 0,
            late: Vec::new(),
            gate: None,
        })
    }

    /// Makes every round wait for `gate` before it starts.
    pub fn with_gate(mut self, gate: RoundGate) -> Self {
        self.gate = Some(gate);
        self
    }

    /// The virtual now.
    pub fn now(&self) -> Instant {
        self.clock.now()
    }

    /// Lets virtual time pass until `t` (never backwards).
    pub fn wait_until(&mut self, t: Instant) {
        self.clock.advance_to(t);
    }

    /// Makes the member of `row` misbehave.
    pub fn with_fault(mut self, row: usize, fault: Fault) -> Self {
        if let Some(m) = self.members.get_mut(row) {
            m.fault = Some(fault);
        }
        self
    }

    /// Every round so far.
    pub fn log(&self) -> &[RoundRecord] {
        &self.log
    }

    /// The pool of free rows.
    pub fn pool(&self) -> &MemberPool {
        &self.pool
    }

    /// Virtual time spent in rounds.
    pub fn elapsed(&self) -> Duration {
        self.clock.elapsed()
    }

    /// Requests the member of `row` has received.
    pub fn requests(&self, row: usize) -> u64 {
        self.members.get(row).map_or(0, |m| m.requests)
    }

    /// Sends a request to `row`: schedules what comes back, if anything.
    fn send(&mut self, row: usize, wire: &mut BTreeMap<(Instant, u64), (usize, Reply)>) {
        let now = self.clock.now();
        let mut at = now
            + self
                .rng
                .duration(self.cfg.min_latency, self.cfg.max_latency);
        let reply = match self.members.get_mut(row) {
            None => Some(Reply::Failed("no such member".into())),
            Some(m) => {
                m.requests += 1;
                let served = fault_after(m.fault);
                match m.fault {
                    _ if m.requests <= served => Some(Reply::Answer),
                    Some(Fault::Crash { .. }) if m.requests == served + 1 => {
                        // It dies while computing: the break shows a while after the send.
                        at += self.rng.duration(Duration::ZERO, self.cfg.max_latency);
                        Some(Reply::Failed("connection reset mid-request".into()))
                    }
                    Some(Fault::Crash { .. }) => Some(Reply::Failed("connection refused".into())),
                    Some(Fault::Stall { .. }) => None,
                    Some(Fault::Lie { .. }) => Some(Reply::Lie),
                    None => Some(Reply::Answer),
                }
            }
        };
        if let Some(reply) = reply {
            self.sent += 1;
            wire.insert((at, self.sent), (row, reply));
        }
    }

    /// The member of `row` computes its answer to `request`.
    fn answer(&self, row: usize, request: &[u8]) -> Result<Vec<u8>, String> {
        let member = &self
            .members
            .get(row)
            .ok_or_else(|| format!("no member {row}"))?
            .member;
        let answer = match protocol::decode::<StepRequest>(request) {
            Ok(req) => member.handle(&req),
            Err(e) => StepResponse::Failed {
                reason: e.to_string(),
            },
        };
        protocol::encode(&answer).map_err(|e| e.to_string())
    }
}

/// A wrong answer in place of `answer`: its values scaled and shifted.
fn lie(answer: &[u8]) -> Result<Vec<u8>, String> {
    let lied = match protocol::decode::<StepResponse>(answer).map_err(|e| e.to_string())? {
        StepResponse::Partial { node, values } => StepResponse::Partial {
            node,
            values: values.iter().map(|v| v * 1.5 + 0.25).collect(),
        },
        failed => failed,
    };
    protocol::encode(&lied).map_err(|e| e.to_string())
}

/// Requests a faulty member serves before its fault.
fn fault_after(fault: Option<Fault>) -> u64 {
    match fault {
        Some(
            Fault::Crash { after_requests }
            | Fault::Stall { after_requests }
            | Fault::Lie { after_requests },
        ) => after_requests,
        None => u64::MAX,
    }
}

impl Transport for SimTransport {
    async fn round(
        &mut self,
        members: &mut Vec<usize>,
        request: &[u8],
        need: usize,
    ) -> Result<Vec<(usize, Vec<u8>)>, TransportError> {
        if let Some(gate) = self.gate.as_mut() {
            let may = (gate.0)(self.clock.now());
            self.clock.advance_to(may);
        }
        let started = self.clock.elapsed();
        // Connection failures that arrived since the last round: those members are gone.
        let now = self.clock.now();
        let (seen, later): (Vec<_>, Vec<_>) = self.late.drain(..).partition(|&(t, _)| t <= now);
        self.late = later;
        let mut noticed_down: Vec<usize> = seen.into_iter().map(|(_, row)| row).collect();
        noticed_down.retain(|row| members.contains(row));
        noticed_down.sort_unstable();
        noticed_down.dedup();
        members.retain(|row| !noticed_down.contains(row));
        let mut driver = RoundDriver::start(now, members, need, &mut self.pool);
        let mut record = RoundRecord {
            round: self.log.len() as u64 + 1,
            started,
            took: Duration::ZERO,
            need,
            started_with: driver.members().to_vec(),
            ended_with: Vec::new(),
            asked: Vec::new(),
            answered: Vec::new(),
            failed: Vec::new(),
            noticed_down,
            ok: false,
        };
        let mut wire = BTreeMap::new();
        loop {
            while let Some(row) = driver.poll_transmit() {
                record.asked.push(row);
                self.send(row, &mut wire);
            }
            if driver.is_done() || driver.is_failed() {
                break;
            }
            let arrival = wire.keys().next().map(|&(t, _)| t);
            let next = match (arrival, driver.poll_timeout()) {
                (Some(a), Some(b)) => a.min(b),
                (Some(t), None) | (None, Some(t)) => t,
                (None, None) => break,
            };
            self.clock.advance_to(next);
            let now = self.clock.now();
            while let Some(entry) = wire.first_entry() {
                if entry.key().0 > now {
                    break;
                }
                let (row, reply) = entry.remove();
                let answer = match reply {
                    Reply::Answer => self.answer(row, request),
                    Reply::Lie => self.answer(row, request).and_then(|a| lie(&a)),
                    Reply::Failed(why) => Err(why),
                };
                match &answer {
                    Ok(_) if !driver.is_done() => record.answered.push(row),
                    Ok(_) => {}
                    Err(why) => record.failed.push((row, why.clone())),
                }
                driver.handle_answer(now, row, answer, &mut self.pool);
            }
            if driver.poll_timeout().is_some_and(|t| t <= now) {
                driver.handle_timeout(now, &mut self.pool);
            }
        }
        // Answers still on the wire arrive after the round: a real transport drops them, but
        // it learns from a broken connection that the member is gone.
        for ((t, _), (row, reply)) in wire {
            if matches!(reply, Reply::Failed(_)) {
                self.late.push((t, row));
            }
        }
        *members = driver.members().to_vec();
        record.ended_with = members.clone();
        record.took = self.clock.elapsed() - started;
        let result = driver.finish(&mut self.pool);
        record.ok = result.is_ok();
        self.log.push(record);
        result.map_err(|e| TransportError {
            node: usize::MAX,
            reason: e.to_string(),
        })
    }
}

/// A coded group over simulated members: [`plan_group`] over every row picks k + spares
/// members, the other rows are the pool's; `faults` make members misbehave.
pub fn sim_group(
    model: &LlamaConfig,
    generator: &Generator,
    shards: &InProcess,
    cfg: LeaderConfig,
    faults: &[(usize, Fault)],
) -> Result<CodedGroup<SimTransport>, CodedError> {
    let rows: Vec<usize> = (0..generator.n()).collect();
    let plan = plan_group(generator, &rows, cfg.spares)?;
    let free = rows
        .iter()
        .copied()
        .filter(|r| !plan.members.contains(r))
        .collect();
    let mut transport = SimTransport::new(shards.members().to_vec(), generator.clone(), free, cfg)?;
    for &(row, fault) in faults {
        transport = transport.with_fault(row, fault);
    }
    CodedGroup::new(model.clone(), generator.clone(), &plan.members, transport)
}

/// A [`LinearExec`] that records the logits (the LM head's output) of every forward pass.
#[derive(Debug)]
pub struct LogitsTap<'a, E: ?Sized> {
    inner: &'a mut E,
    /// The logits of each forward pass, in order.
    pub logits: Vec<Vec<f32>>,
}

impl<'a, E: LinearExec + ?Sized> LogitsTap<'a, E> {
    /// Records what `inner` computes.
    pub fn new(inner: &'a mut E) -> Self {
        Self {
            inner,
            logits: Vec::new(),
        }
    }
}

impl<E: LinearExec + ?Sized> LinearExec for LogitsTap<'_, E> {
    async fn linear(
        &mut self,
        stage: Stage,
        x: &[f32],
        t: usize,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let out = self.inner.linear(stage, x, t).await?;
        if stage == Stage::LmHead
            && let Some(logits) = out.first()
        {
            self.logits.push(logits.clone());
        }
        Ok(out)
    }

    async fn linear_t(
        &mut self,
        stage: Stage,
        dy: &[Vec<f32>],
        t: usize,
    ) -> Result<Vec<f32>, ModelError> {
        self.inner.linear_t(stage, dy, t).await
    }

    async fn embed(&mut self, tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
        self.inner.embed(tokens).await
    }
}

// ---------------------------------------------------------------------------------------------
// Holders in memory
// ---------------------------------------------------------------------------------------------

/// Row holders answering each other in memory through [`node_core::holder`]'s own code (joins,
/// chains, version queries), counting the bytes of answers each of them receives.
#[derive(Debug)]
pub struct MemoryHolders {
    manifest: node_core::mesh::ModelManifest,
    /// Holder id → its shard.
    holders: BTreeMap<u32, node_core::holder::ShardState>,
    /// The manifest, serialized.
    manifest_bytes: Vec<u8>,
    /// Updates each holder let each peer hand over.
    limits: std::cell::RefCell<BTreeMap<u32, node_core::holder::LearnLimit<u32>>>,
    /// Each holder's shard blob, while peers download it.
    snapshots: std::cell::RefCell<BTreeMap<u32, node_core::holder::Snapshot>>,
    /// What a join request to any holder is answered with.
    offer: JoinOffer,
    received: std::cell::RefCell<BTreeMap<u32, u64>>,
}

/// One holder's (or the joiner's) [`node_core::holder::Link`] into [`MemoryHolders`].
#[derive(Debug)]
pub struct MemoryLink<'a> {
    mesh: &'a MemoryHolders,
    me: u32,
}

impl MemoryHolders {
    /// Holders of `manifest`'s mesh, each with its shard set, answering joins with `offer`.
    pub fn new(
        manifest: node_core::mesh::ModelManifest,
        holders: BTreeMap<u32, node_core::coded::ShardSet>,
        offer: JoinOffer,
    ) -> Self {
        let holders = holders
            .into_iter()
            .map(|(id, set)| {
                let state = node_core::holder::ShardState {
                    member: node_core::coded::Member::new(set),
                    version: node_core::mesh::ShardVersion::default(),
                    norms: manifest.leader.clone(),
                    skip_updates: 0,
                };
                (id, state)
            })
            .collect();
        Self {
            manifest_bytes: manifest.to_bytes().unwrap_or_default(),
            manifest,
            holders,
            limits: Default::default(),
            snapshots: Default::default(),
            offer,
            received: Default::default(),
        }
    }

    /// The link of node `me` (a holder or a joiner).
    pub fn link(&self, me: u32) -> MemoryLink<'_> {
        MemoryLink { mesh: self, me }
    }

    /// Bytes of answers node `id` received.
    pub fn received(&self, id: u32) -> u64 {
        self.received.borrow().get(&id).copied().unwrap_or(0)
    }

    /// Holder `id`'s answer to `from`'s `request` ([`node_core::holder::route`]), asking others
    /// through its own link where it must.
    async fn answer(&self, id: u32, from: u32, request: MeshRequest) -> MeshResponse {
        use node_core::holder::{self, Held, Route, ViewQuery};
        let Some(state) = self.holders.get(&id) else {
            return MeshResponse::Error(format!("no holder {id}"));
        };
        let route = {
            let rules = node_core::holder::Rules::of(&self.manifest);
            let held = Held {
                row: state.member.shards().node as u32,
                state,
                manifest: &self.manifest_bytes,
                genesis: &BTreeMap::new(),
                rules: &rules,
                wall_ms: 0,
                live: self.holders.len(),
            };
            let mut limits = self.limits.borrow_mut();
            let limit = limits.entry(id).or_default();
            holder::route(&held, limit, &from, std::time::Instant::now(), request)
        };
        match route {
            Route::Answer(resp) => resp,
            Route::View(ViewQuery::Join(_)) => MeshResponse::Join(self.offer.clone()),
            Route::Chain(part) => {
                let (link, g) = (self.link(id), &self.manifest.generator);
                holder::chain(&link, part, g, &self.manifest.cfg, |part, before| {
                    std::future::ready(holder::contribute(state, &part, before))
                })
                .await
            }
            Route::ShardPiece { offset, len } => {
                let mut snapshots = self.snapshots.borrow_mut();
                snapshots.entry(id).or_default().piece(state, offset, len)
            }
            Route::Step { version, request } => holder::step(state, &version, &request),
            other => MeshResponse::Error(format!("a memory holder does not answer {other:?}")),
        }
    }
}

impl node_core::holder::Link for MemoryLink<'_> {
    type Peer = u32;

    fn ask(
        &self,
        peer: &u32,
        request: MeshRequest,
    ) -> impl std::future::Future<Output = Result<MeshResponse, node_core::holder::HolderError>>
    {
        let (mesh, me, peer) = (self.mesh, self.me, *peer);
        // Boxed: a chain's answers recurse through the holders before it.
        let answer: std::pin::Pin<Box<dyn std::future::Future<Output = _> + '_>> =
            Box::pin(async move {
                let resp = mesh.answer(peer, me, request).await;
                let bytes = protocol::encode(&resp)
                    .map_err(|e| node_core::holder::HolderError::Link(e.to_string()))?
                    .len() as u64;
                *mesh.received.borrow_mut().entry(me).or_default() += bytes;
                Ok(resp)
            });
        answer
    }

    async fn dial(
        &self,
        src: &node_core::mesh::SourceRow,
    ) -> Result<u32, node_core::holder::HolderError> {
        src.peer
            .parse()
            .map_err(|e| node_core::holder::HolderError::Link(format!("{:?}: {e}", src.peer)))
    }

    async fn blocking<R: Send + 'static>(&self, work: impl FnOnce() -> R + Send + 'static) -> R {
        work()
    }

    fn progress(&self, _what: &str, _done: u64, _total: u64) {}
}
