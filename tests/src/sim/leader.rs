//! The leader in the simulation: the [`Leader`] and the generation loop
//! ([`generate_regrouping`]) every leader runs, over groups of [`SimTransport`]s formed from a
//! view of which rows are up, in virtual time. Rows crash (a member's [`Fault`]), come back at
//! a virtual moment, and the leader forms, backs off, looks and regroups as the API's and the
//! command line's leaders do.

use node_core::lead::{Failure, LeadShell, Leader, Looking, Measured, generate_regrouping};
use node_core::model::{GenerateOptions, Generation, Llama};

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
    leader: Leader<()>,
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
            leader: sim_leader(llama, generator, 0, cfg.spares),
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
        self.leader = sim_leader(self.llama, self.generator, verify, self.cfg.spares);
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
        futures::executor::block_on(generate_regrouping(self, prompt, opts, &mut |_| true))
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

/// The simulated leader's shell, in virtual time; its view of the mesh is exact.
impl LeadShell<()> for SimLeader<'_> {
    fn leader(&mut self) -> &mut Leader<()> {
        &mut self.leader
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
    async fn form(&mut self, verify: usize) -> Result<bool, String> {
        self.let_go();
        let up: Vec<usize> = self.up.iter().copied().collect();
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
                Ok(false)
            }
            Err(why) => {
                self.note(LeaderStep::FormFailed(why.clone()));
                Err(why)
            }
        }
    }

    /// A row up and not a member came back.
    async fn look(&mut self, looking: &Looking) -> Option<usize> {
        if looking.rows.len() >= looking.wanted {
            // A whole group looking for a closer one: this world has no distances.
            return None;
        }
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

    async fn pass(&mut self) -> Result<Vec<Vec<f32>>, ModelError> {
        let Some(group) = self.group.as_mut() else {
            return Err(ModelError::Config("no group".into()));
        };
        let mut items = self.leader.batch_mut().rounds_items();
        self.llama.forward_batch(group, &mut items).await
    }

    fn measured(&mut self) -> Option<Measured> {
        let unlocated = self.group.as_ref()?.stats().unlocated > 0;
        Some(Measured {
            unlocated,
            ..Measured::default()
        })
    }

    fn failed(&mut self, _why: &ModelError) -> Option<Failure> {
        let rows = self.rows().unwrap_or_default();
        self.note(LeaderStep::PassFailed(rows));
        self.let_go();
        Some(Failure::default())
    }
}

/// The simulation's leader state machine: a model of `llama`'s, groups of the code's k with
/// `verify` checks and `spares`.
fn sim_leader(llama: &Llama, generator: &Generator, verify: usize, spares: usize) -> Leader<()> {
    let cfg = llama.config();
    let limits = node_core::lead::one_at_a_time(cfg);
    Leader::new(cfg, limits, generator.k(), verify, spares)
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
