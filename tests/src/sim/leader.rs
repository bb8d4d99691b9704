//! The leader in the simulation: the [`Steer`] and the generation loop
//! ([`generate_regrouping`]) every leader runs, over groups of [`SimTransport`]s formed from a
//! view of which rows are up, in virtual time. Rows crash (a member's [`Fault`]), come back at
//! a virtual moment, and the leader forms, backs off, looks and regroups as the API's and the
//! command line's leaders do.

use node_core::lead::{Looking, Steer, SteerShell};
use node_core::model::{Batch, GenerateOptions, Generation, Llama, Regroup, generate_regrouping};

use super::*;

/// What the simulated leader did, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaderStep {
    /// Formed a group over these rows.
    Formed(Vec<usize>),
    /// Forming failed, for this reason.
    FormFailed(String),
    /// Waited this long before forming again.
    Waited(Duration),
    /// Its short group looked for a row that came back, and found this.
    Looked(Option<usize>),
    /// Let its group go to form it again with a row that came back.
    Regrouped(usize),
    /// A pass failed on the group of these rows.
    PassFailed(Vec<usize>),
    /// A row came back up.
    RowUp(usize),
    /// The group caught the member of this row answering wrong; the view leaves it out.
    Caught(usize),
}

/// A simulated leader over the members of `shards`: which rows are up, when others come back,
/// the faults its groups' members have, and what it did (with the virtual time).
pub struct SimLeader<'a> {
    llama: &'a Llama,
    generator: &'a Generator,
    shards: &'a InProcess,
    cfg: LeaderConfig,
    /// Answers checked beyond the k decoded in every round.
    verify: usize,
    /// Whether the rows of the view beyond the group are its pool's free rows (replacing a
    /// failed member within a pass); without, a failed member leaves the group short.
    pool: bool,
    steer: Steer,
    group: Option<CodedGroup<SimTransport>>,
    /// Rows up now: the mesh's view.
    up: BTreeSet<usize>,
    /// Rows that come back up at a virtual moment.
    returns: Vec<(Duration, usize)>,
    /// Faults of members not yet fired: each group's transport counts a member's requests
    /// from its forming.
    faults: Vec<(usize, Fault)>,
    /// Virtual time spent before the current group (past groups' rounds and waits).
    past: Duration,
    base: Instant,
    /// What it did, with the virtual time.
    pub log: Vec<(Duration, LeaderStep)>,
}

impl std::fmt::Debug for SimLeader<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimLeader")
            .field("up", &self.up)
            .field("log", &self.log)
            .finish_non_exhaustive()
    }
}

impl<'a> SimLeader<'a> {
    /// A leader with no group yet, over `shards` (every row's member), with the rows of `up`
    /// up; `cfg.spares` spares are planned beyond k.
    pub fn new(
        llama: &'a Llama,
        generator: &'a Generator,
        shards: &'a InProcess,
        cfg: LeaderConfig,
        up: &[usize],
    ) -> Self {
        Self {
            llama,
            generator,
            shards,
            cfg,
            verify: 0,
            pool: false,
            steer: Steer::new(generator.k() + cfg.spares),
            group: None,
            up: up.iter().copied().collect(),
            returns: Vec::new(),
            faults: Vec::new(),
            past: Duration::ZERO,
            base: Instant::now(),
            log: Vec::new(),
        }
    }

    /// Makes the member of `row` misbehave in the groups it is in (once).
    pub fn with_fault(mut self, row: usize, fault: Fault) -> Self {
        self.faults.push((row, fault));
        self
    }

    /// Brings `row` up at virtual time `at`.
    pub fn with_return(mut self, at: Duration, row: usize) -> Self {
        self.returns.push((at, row));
        self
    }

    /// Its groups check every round with `verify` answers beyond the k decoded.
    pub fn with_verify(mut self, verify: usize) -> Self {
        self.verify = verify;
        self.steer = Steer::new(self.generator.k() + verify + self.cfg.spares);
        self
    }

    /// Its groups take the view's other rows as free rows for replacing failed members.
    pub fn with_pool(mut self) -> Self {
        self.pool = true;
        self
    }

    /// Virtual time so far.
    pub fn elapsed(&self) -> Duration {
        self.past
            + self
                .group
                .as_ref()
                .map_or(Duration::ZERO, |g| g.transport().elapsed())
    }

    /// Lets virtual time pass.
    pub fn advance(&mut self, by: Duration) {
        self.past += by;
    }

    /// The group's rows, if it has one.
    pub fn rows(&self) -> Option<Vec<usize>> {
        self.group.as_ref().map(|g| g.nodes().to_vec())
    }

    /// Generates a completion of `prompt` through the loop every leader runs.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        opts: &GenerateOptions,
    ) -> Result<Generation, ModelError> {
        let cfg = self.llama.config().clone();
        futures::executor::block_on(generate_regrouping(self, &cfg, prompt, opts, &mut |_| true))
    }

    /// The virtual time now.
    fn clock(&self) -> Instant {
        self.base + self.elapsed()
    }

    fn note(&mut self, step: LeaderStep) {
        let at = self.elapsed();
        self.log.push((at, step));
    }

    /// The view catches up: rows whose members crashed or stalled in the group go down, rows
    /// due back come up.
    fn refresh(&mut self) {
        if let Some(g) = &self.group {
            let t = g.transport();
            let fired: Vec<usize> = (self.faults.iter())
                .filter(|(row, fault)| match fault {
                    Fault::Crash { after_requests } | Fault::Stall { after_requests } => {
                        t.requests(*row) > *after_requests
                    }
                    // A liar stays up until a group catches it.
                    Fault::Lie { .. } => false,
                })
                .map(|(row, _)| *row)
                .collect();
            for row in fired {
                self.up.remove(&row);
                self.faults.retain(|(r, _)| *r != row);
            }
            // A member the group caught is reported: the view leaves it out.
            let caught: Vec<usize> = g.stats().caught.iter().map(|c| c.node).collect();
            for row in caught {
                if self.up.remove(&row) {
                    self.note(LeaderStep::Caught(row));
                }
            }
        }
        let at = self.elapsed();
        let due: Vec<usize> = (self.returns.iter())
            .filter(|(when, _)| *when <= at)
            .map(|(_, row)| *row)
            .collect();
        self.returns.retain(|(when, _)| *when > at);
        for row in due {
            self.up.insert(row);
            self.note(LeaderStep::RowUp(row));
        }
    }

    /// Lets the group go, keeping the virtual time its rounds took.
    fn let_go(&mut self) {
        self.refresh();
        if let Some(g) = self.group.take() {
            self.past += g.transport().elapsed();
        }
    }
}

/// The simulated leader as the steer drives it, in virtual time; its view of the mesh is
/// exact.
impl SteerShell for SimLeader<'_> {
    fn steer(&mut self) -> &mut Steer {
        &mut self.steer
    }

    /// The virtual time now, the view caught up with it.
    fn now(&mut self) -> Instant {
        self.refresh();
        self.clock()
    }

    fn rows(&self) -> Vec<usize> {
        SimLeader::rows(self).unwrap_or_default()
    }

    async fn wait_until(&mut self, until: Instant) {
        let by = until.saturating_duration_since(self.clock());
        self.past += by;
        self.note(LeaderStep::Waited(by));
    }

    /// Forms a group over the rows up (the best-conditioned k plus spares), its members'
    /// faults armed; why not.
    async fn form(&mut self) -> Result<(), String> {
        self.let_go();
        let up: Vec<usize> = self.up.iter().copied().collect();
        let verify = self.steer.checks(self.clock(), self.verify);
        let formed = plan_group(self.generator, &up, verify + self.cfg.spares)
            .map_err(|e| e.to_string())
            .and_then(|plan| {
                let free = if self.pool {
                    up.iter()
                        .copied()
                        .filter(|r| !plan.members.contains(r))
                        .collect()
                } else {
                    Vec::new()
                };
                let cfg = LeaderConfig {
                    seed: self.cfg.seed.wrapping_add(self.log.len() as u64),
                    ..self.cfg
                };
                let members = self.shards.members().to_vec();
                let mut t = SimTransport::new(members, self.generator.clone(), free, cfg)
                    .map_err(|e| e.to_string())?;
                for &(row, fault) in &self.faults {
                    t = t.with_fault(row, fault);
                }
                let model = self.llama.config().clone();
                let mut g = CodedGroup::new(model, self.generator.clone(), &plan.members, t)
                    .map_err(|e| e.to_string())?;
                g.set_verify(node_core::coded::VerifyConfig {
                    extra: verify,
                    ..Default::default()
                });
                Ok(g)
            });
        match formed {
            Ok(g) => {
                self.note(LeaderStep::Formed(g.nodes().to_vec()));
                self.group = Some(g);
                Ok(())
            }
            Err(why) => {
                self.note(LeaderStep::FormFailed(why.clone()));
                Err(why)
            }
        }
    }

    /// A row up and not a member came back.
    async fn look(&mut self, looking: &Looking) -> Option<usize> {
        let row = (self.up.iter())
            .find(|r| !looking.rows.contains(r))
            .copied();
        self.note(LeaderStep::Looked(row));
        row
    }

    fn regroup(&mut self, row: usize, _: &Looking) {
        self.note(LeaderStep::Regrouped(row));
        self.let_go();
    }
}

impl Regroup for SimLeader<'_> {
    async fn ready(&mut self) -> Result<(), ModelError> {
        node_core::lead::ready(self)
            .await
            .map(drop)
            .map_err(|why| ModelError::NoGroup(format!("forming the group: {why}")))
    }

    async fn pass(&mut self, batch: &mut Batch<()>) -> Result<Vec<Vec<f32>>, ModelError> {
        let Some(group) = self.group.as_mut() else {
            return Err(ModelError::Config("no group".into()));
        };
        let mut items = batch.rounds_items();
        self.llama.forward_batch(group, &mut items).await
    }

    fn passed(&mut self) {
        self.steer.passed();
    }

    fn failed(&mut self, _why: &ModelError) -> bool {
        let rows = self.rows().unwrap_or_default();
        self.note(LeaderStep::PassFailed(rows));
        let now = self.clock();
        if self.group.as_ref().is_some_and(|g| g.stats().unlocated > 0) {
            self.steer.unlocated(now);
        }
        self.steer.pass_failed(now, false);
        self.let_go();
        true
    }
}

/// A small random model ([`tiny_config`]) coded k of n into f32 rows: what the simulation's
/// leaders, members and trainers compute with.
#[derive(Debug)]
pub struct SimModel {
    /// The leader's part of it.
    pub llama: Llama,
    /// The code.
    pub g: Generator,
    /// Every row's member.
    pub shards: InProcess,
}

/// The model of `seed`'s random weights, coded `k` of `n`.
pub fn sim_model(seed: u64, n: usize, k: usize) -> Result<SimModel, ModelError> {
    let weights = node_core::model::ModelWeights::synthetic(tiny_config(), seed)?;
    let leader = node_core::model::LeaderWeights::from_model(&weights);
    let llama = Llama::new(weights.cfg.clone(), leader)?;
    let g = Generator::cauchy(n, k).map_err(|e| ModelError::Config(e.to_string()))?;
    let shards = InProcess::encode(&weights, &g, node_core::coded::ShardFormat::F32, &|_, _| {})
        .map_err(|e| ModelError::Config(e.to_string()))?;
    Ok(SimModel { llama, g, shards })
}

/// A small model's shape (two blocks, a vocabulary of 250) for the simulation's runs of real
/// generations.
pub fn tiny_config() -> LlamaConfig {
    LlamaConfig {
        hidden: 64,
        ffn: 160,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        vocab: 250,
        norm_eps: 1e-5,
        rope_theta: 10_000.0,
        max_seq: 64,
        tied_embeddings: true,
        family: node_core::model::Family::Llama,
        rope_freq_factors: Vec::new(),
    }
}
