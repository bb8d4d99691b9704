//! The leader's side: send a stage to the group, decode the answers, reassemble the outputs.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use web_time::{Duration, Instant};

use super::probe::UpdateProbe;
use super::verify::{
    Caught, VerifyConfig, largest, pair_norms, random_input, residual, transpose_residual,
    transpose_residuals,
};
use super::{CodedError, Member, ShardFormat, ShardSet};
use crate::code::{Decoder, Generator};
use crate::model::{LinearExec, LlamaConfig, ModelError, ModelWeights, Stage};
use crate::protocol::{self, StepRequest, StepResponse};

/// A transport could not reach a member or get its answer.
#[derive(Debug, thiserror::Error)]
#[error("node {node}: {reason}")]
pub struct TransportError {
    /// The node index it failed to reach.
    pub node: usize,
    /// Why.
    pub reason: String,
}

/// Carries one encoded request to a group's members and brings back their encoded answers.
/// In-process transports finish at the first poll; network ones wait on their members.
#[allow(
    async_fn_in_trait,
    reason = "the browser's transport is !Send by nature; native callers name the concrete type"
)]
pub trait Transport {
    /// Sends `request` to `members` and returns the answers of at least `need` distinct nodes,
    /// first come first served, as `(node, bytes)`. A transport that loses a member may drop it
    /// from `members` and ask a replacement it adds there.
    async fn round(
        &mut self,
        members: &mut Vec<usize>,
        request: &[u8],
        need: usize,
    ) -> Result<Vec<(usize, Vec<u8>)>, TransportError>;

    /// Sends each node its own request and returns every node's answer (backward steps, where
    /// each member gets a different input). The default asks them one after the other.
    async fn round_each(
        &mut self,
        requests: Vec<(usize, Vec<u8>)>,
    ) -> Result<Vec<(usize, Vec<u8>)>, TransportError> {
        let mut out = Vec::with_capacity(requests.len());
        for (node, request) in requests {
            let mut members = vec![node];
            let answers = self.round(&mut members, &request, 1).await?;
            let answer = answers
                .into_iter()
                .find(|(n, _)| *n == node)
                .ok_or_else(|| TransportError {
                    node,
                    reason: "no answer".into(),
                })?;
            out.push(answer);
        }
        Ok(out)
    }

    /// Names the step the next rounds belong to (`Qkv(3)`, `LmHead backward`…), for logs and
    /// step traces; the default ignores it.
    fn label(&mut self, _what: &str) {}

    /// The number of the last [`Transport::round`], as [`Transport::late_answers`] names it;
    /// `None` (the default) where answers never come late.
    fn last_round(&self) -> Option<u64> {
        None
    }

    /// Answers that came after their round had its `need` (so were not used there), as
    /// `(round, node, bytes)`, taken out; none by default.
    fn late_answers(&mut self) -> Vec<(u64, usize, Vec<u8>)> {
        Vec::new()
    }
}

/// Members living in this process, indexed by node; messages still go through the codec.
#[derive(Debug, Clone)]
pub struct InProcess {
    members: Vec<Member>,
}

impl InProcess {
    /// A transport to these members; each must sit at the index of its node.
    pub fn new(members: Vec<Member>) -> Result<Self, CodedError> {
        for (i, m) in members.iter().enumerate() {
            if m.row() != i {
                return Err(CodedError::BadRequest(format!(
                    "member at index {i} answers as node {}",
                    m.row()
                )));
            }
        }
        Ok(Self { members })
    }

    /// Encodes every genesis row's shards of a model (rows in parallel) and serves them in
    /// process; `progress(done, total)` counts matrices over all rows.
    pub fn encode(
        weights: &ModelWeights,
        generator: &Generator,
        format: ShardFormat,
        progress: &(dyn Fn(usize, usize) + Sync),
    ) -> Result<Self, CodedError> {
        let nodes: Vec<usize> = (0..generator.genesis_rows()).collect();
        let done = AtomicUsize::new(0);
        let sets = crate::compute::par::map(&nodes, |&node| {
            ShardSet::encode(weights, generator, node, format, &mut |_, total| {
                let d = done.fetch_add(1, Ordering::Relaxed) + 1;
                progress(d, nodes.len() * total)
            })
        });
        let members = sets
            .into_iter()
            .map(|s| s.map(Member::new))
            .collect::<Result<Vec<_>, _>>()?;
        Self::new(members)
    }

    /// The members.
    pub fn members(&self) -> &[Member] {
        &self.members
    }

    /// The members back.
    pub fn into_members(self) -> Vec<Member> {
        self.members
    }

    /// The members, to apply a learning update to each.
    pub fn members_mut(&mut self) -> &mut [Member] {
        &mut self.members
    }
}

impl InProcess {
    /// One member's encoded answer to an encoded request.
    fn answer(&self, node: usize, request: &[u8]) -> Result<(usize, Vec<u8>), TransportError> {
        let fail = |reason: String| TransportError { node, reason };
        let member = self
            .members
            .get(node)
            .ok_or_else(|| fail("no such member".into()))?;
        protocol::encode(&member.handle_bytes(request))
            .map(|bytes| (node, bytes))
            .map_err(|e| fail(e.to_string()))
    }
}

impl Transport for InProcess {
    async fn round(
        &mut self,
        nodes: &mut Vec<usize>,
        request: &[u8],
        _need: usize,
    ) -> Result<Vec<(usize, Vec<u8>)>, TransportError> {
        // Members run side by side, as they would on separate machines.
        crate::compute::par::map(nodes, |&node| self.answer(node, request))
            .into_iter()
            .collect()
    }

    async fn round_each(
        &mut self,
        requests: Vec<(usize, Vec<u8>)>,
    ) -> Result<Vec<(usize, Vec<u8>)>, TransportError> {
        crate::compute::par::map(&requests, |(node, request)| self.answer(*node, request))
            .into_iter()
            .collect()
    }
}

/// Counters of a leader's coded execution.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ExecStats {
    /// Rounds sent (one per stage or embedding lookup).
    pub rounds: u64,
    /// Bytes sent to each member (summed over members).
    pub bytes_sent: u64,
    /// Bytes received from members (summed over members).
    pub bytes_received: u64,
    /// Time spent waiting for members (compute and transport).
    pub member_time: Duration,
    /// Time spent decoding and reassembling.
    pub decode_time: Duration,
    /// Members dropped for a failed or malformed answer.
    pub members_dropped: u64,
    /// Requests sent, summed over members (a round to 4 members counts 4).
    pub member_requests: u64,
    /// Rounds whose answers were checked against the code.
    pub verified_rounds: u64,
    /// Rounds decoded from k answers with nothing to check them against.
    pub unverified_rounds: u64,
    /// Largest residual of a round that passed, over its threshold (how close honest noise came).
    pub max_pass_ratio: f64,
    /// Members caught answering against the code, with the evidence.
    pub caught: Vec<Caught>,
    /// Rounds whose residuals were fitted against learning updates ([`UpdateProbe`]).
    pub probed_rounds: u64,
    /// Largest significance, in standard deviations, of a fit that convicted nobody.
    pub max_probe_sigmas: f64,
    /// Backward rounds whose answers were checked against a forward round at a random input
    /// (Freivalds' check; that forward round counts among `rounds` and `verified_rounds`).
    pub checked_backward_rounds: u64,
    /// Largest Freivalds residual of a backward answer that passed, over its threshold.
    pub max_backward_pass_ratio: f64,
    /// Answers that came after their checked round was decoded, checked against its decode.
    pub late_checked: u64,
    /// Forward rounds checked against the check row's secret projections, not its answer
    /// (counted among `verified_rounds` too).
    pub projected_rounds: u64,
    /// Largest residual of a projected check that passed, over its threshold.
    pub max_projected_ratio: f64,
}

/// Attempts at one round before the request fails (each drops at least one bad member).
const MAX_ROUND_ATTEMPTS: usize = 4;

/// A leader's ephemeral group: k or more members, decoded from the first k answers.
#[derive(Debug)]
pub struct CodedGroup<T: Transport> {
    cfg: LlamaConfig,
    generator: Generator,
    members: Vec<usize>,
    /// Decoders by sorted answering rows; the last one used first.
    decoders: Vec<Decoder>,
    transport: T,
    stats: ExecStats,
    verify: VerifyConfig,
    probe: Option<UpdateProbe>,
    /// Draws the random inputs of backward checks; seeded from the OS, so members cannot
    /// foresee them.
    checks: ChaCha8Rng,
    /// The last checked rounds, newest last, against which answers that come late are checked.
    recent: VecDeque<Recent>,
    /// The check row and its projections, while rounds are checked by projection.
    sketch: Option<Sketch>,
}

/// Random directions per projected check: a wrong answer hides from one with a chance that
/// falls geometrically with their number (docs/verification.md, "Projected checks").
const PROJECTIONS: usize = 4;

/// A check row that is not asked for its answers: for each stage it has multiplied
/// [`PROJECTIONS`] secret random directions `ρ` of its answer by its shards' transposes, so
/// the leader can check a round's decode from the product `w = S_pᵀ·ρ` alone.
#[derive(Debug)]
struct Sketch {
    /// The check row.
    row: usize,
    /// Per stage at the members' version.
    stages: HashMap<Stage, Arc<Projection>>,
}

/// One stage's secret directions and the check row's products with them.
#[derive(Debug)]
struct Projection {
    /// The directions `ρ`, `[sub-block][matrix][row]` each, as the check row's answer lies.
    directions: Vec<Vec<f32>>,
    /// `S_pᵀ·ρ` for each, `in` values.
    products: Vec<Vec<f32>>,
    /// `(|S_pᵀ·ρ|, |ρ|)` for each, formed once ([`transpose_residuals`] needs them every round).
    norms: Vec<(f64, f64)>,
}

/// A checked round, kept to check the answers that come after it was decoded: a member whose
/// answers always come last is otherwise never checked.
#[derive(Debug)]
struct Recent {
    /// The transport's number for it.
    round: u64,
    /// k answers that agree with its decode.
    parts: Parts,
    /// Columns.
    c: usize,
    /// Its step.
    what: String,
}

/// Checked rounds kept for late answers (an answer later than this is dropped unchecked).
const RECENT_ROUNDS: usize = 8;

/// Answers of one round: `(node, values)`.
type Parts = Vec<(usize, Vec<f32>)>;

/// The decoded blocks of a round, the decoding's condition number, and the predictions of the
/// answers beyond the first k.
type Predicted = (Vec<f32>, f64, Vec<Vec<f32>>);

/// A round's decode and its threshold, or the largest residual and the threshold it broke.
type Checked = Result<(Vec<f32>, f64), (f64, f64)>;

impl<T: Transport> CodedGroup<T> {
    /// A group of `nodes` (at least k distinct rows of `generator`; the first k must decode)
    /// reached through `transport`; extra members are spares for stragglers and failures.
    pub fn new(
        cfg: LlamaConfig,
        generator: Generator,
        nodes: &[usize],
        transport: T,
    ) -> Result<Self, CodedError> {
        let k = generator.k();
        let first = nodes.get(..k).ok_or(crate::code::CodeError::TooFew {
            available: nodes.len(),
            k,
        })?;
        let decoder = Decoder::new(&generator, first)?;
        Ok(Self {
            cfg,
            generator,
            members: nodes.to_vec(),
            decoders: vec![decoder],
            transport,
            stats: ExecStats::default(),
            verify: VerifyConfig {
                extra: 0,
                ..VerifyConfig::default()
            },
            probe: None,
            checks: ChaCha8Rng::from_rng(&mut rand::rng()),
            recent: VecDeque::new(),
            sketch: None,
        })
    }

    /// Draws the random inputs of backward checks from `seed` (reproducible tests) instead of
    /// the OS's entropy.
    pub fn seed_checks(&mut self, seed: u64) {
        self.checks = ChaCha8Rng::seed_from_u64(seed);
    }

    /// Fits the residuals of checked rounds against these learning updates, to catch members
    /// that claim updates they do not hold ([`UpdateProbe`]).
    pub fn set_probe(&mut self, probe: Option<UpdateProbe>) {
        self.probe = probe;
    }

    /// The update probe and its evidence so far.
    pub fn probe(&self) -> Option<&UpdateProbe> {
        self.probe.as_ref()
    }

    /// Checks every forward round with `cfg.extra` answers beyond the k decoded, and, when
    /// `cfg.extra > 0`, every backward round by a forward round at a random input. With
    /// `cfg.project` and one extra answer, the first member beyond the k is the check row: it
    /// is asked for projections, and for answers only to settle a failed check.
    pub fn set_verify(&mut self, cfg: VerifyConfig) {
        self.verify = cfg;
        let k = self.generator.k();
        self.sketch = (cfg.project && cfg.extra == 1)
            .then(|| self.members.get(k).copied())
            .flatten()
            .map(|row| Sketch {
                row,
                stages: HashMap::new(),
            });
    }

    /// The members moved to other weights (a learning update): the check row's projections
    /// are asked for again before the next projected check, as the old ones no longer hold.
    pub fn weights_moved(&mut self) {
        if let Some(sketch) = self.sketch.as_mut() {
            sketch.stages.clear();
        }
    }

    /// The members' node indices now (spares included).
    pub fn nodes(&self) -> &[usize] {
        &self.members
    }

    /// Condition number of the rows decoded last.
    pub fn condition_number(&self) -> f64 {
        self.decoders
            .first()
            .map_or(f64::NAN, Decoder::condition_number)
    }

    /// A stage's input length and, per matrix, the rows of one sub-block (a member's answer
    /// per token and sub-block is their sum).
    fn stage_layout(&self, stage: Stage) -> (usize, Vec<usize>) {
        let shapes = stage.shapes(&self.cfg);
        let inp = shapes.first().map_or(0, |&(_, i)| i);
        let lens = shapes
            .iter()
            .map(|&(out, _)| self.generator.block_len(out))
            .collect();
        (inp, lens)
    }

    /// The decoder for these rows (sorted), built once and kept.
    fn decoder_for(&mut self, rows: &[usize]) -> Result<&Decoder, CodedError> {
        let pos = match self.decoders.iter().position(|d| d.nodes() == rows) {
            Some(p) => p,
            None => {
                self.decoders.push(Decoder::new(&self.generator, rows)?);
                self.decoders.len() - 1
            }
        };
        self.decoders.swap(0, pos);
        Ok(&self.decoders[0])
    }

    /// Counters so far.
    pub fn stats(&self) -> &ExecStats {
        &self.stats
    }

    /// Clears the counters.
    pub fn reset_stats(&mut self) {
        self.stats = ExecStats::default();
    }

    /// The transport.
    pub fn transport(&self) -> &T {
        &self.transport
    }

    /// The transport back, ending the group.
    pub fn into_transport(self) -> T {
        self.transport
    }

    /// The transport, mutably (to reach in-process members between requests).
    pub fn transport_mut(&mut self) -> &mut T {
        &mut self.transport
    }

    /// Sends one request to the group and decodes the first k usable answers into
    /// `[block j'][c]`, checked against `extra` more when verification is on.
    async fn run(
        &mut self,
        req: &StepRequest,
        c: usize,
        what: &str,
    ) -> Result<Vec<f32>, CodedError> {
        let (out, parts) = self.run_traced(req, c, what, true).await?;
        self.after_round(parts, c, what);
        Ok(out)
    }

    /// [`Self::run`], also handing back the answers that agree with the decode: every answer
    /// asked for, the check row's too (never checked by projection).
    async fn run_with_parts(
        &mut self,
        req: &StepRequest,
        c: usize,
        what: &str,
    ) -> Result<(Vec<f32>, Parts), CodedError> {
        let (out, parts) = self.run_traced(req, c, what, false).await?;
        self.after_round(parts.clone(), c, what);
        Ok((out, parts))
    }

    async fn run_traced(
        &mut self,
        req: &StepRequest,
        c: usize,
        what: &str,
        project: bool,
    ) -> Result<(Vec<f32>, Parts), CodedError> {
        use tracing::Instrument;
        self.transport.label(what);
        let span = tracing::debug_span!("coded_step", step = what);
        self.run_inner(req, c, what, project).instrument(span).await
    }

    /// A round's answers, done with: kept for the answers still to come to it, and the late
    /// answers that came meanwhile checked.
    fn after_round(&mut self, parts: Parts, c: usize, what: &str) {
        self.keep_recent(parts, c, what);
        self.check_late();
    }

    /// One round, decoded and checked; `project` lets a forward round be checked by
    /// projection ([`Sketch`]) when the group has a check row.
    async fn run_inner(
        &mut self,
        req: &StepRequest,
        c: usize,
        what: &str,
        project: bool,
    ) -> Result<(Vec<f32>, Parts), CodedError> {
        let bytes = protocol::encode(req)?;
        let k = self.generator.k();
        let projected = match req {
            StepRequest::Matmul { stage, .. } if project => self.projecting(*stage).await?,
            _ => None,
        };
        let want = match projected {
            Some(_) => k,
            None => (k + self.verify.extra).min(self.members.len()).max(k),
        };
        let mut parts = Parts::with_capacity(want);
        self.collect(&bytes, c, &mut parts, want, projected).await?;
        self.stats.rounds += 1;
        if parts.len() < k {
            return Err(CodedError::Member {
                node: usize::MAX,
                reason: format!("only {} of k = {k} members answered", parts.len()),
            });
        }
        let started = Instant::now();
        let mut out = match (projected, req) {
            (Some(row), StepRequest::Matmul { stage, t, x })
                if parts.iter().all(|(n, _)| *n != row) =>
            {
                self.decode_projected(row, *stage, x, *t as usize, &mut parts, c, &bytes, what)
                    .await?
            }
            _ => self.decode_checked(&mut parts, c, &bytes, what).await?,
        };
        if let StepRequest::Matmul { stage, t, x } = req
            && parts.len() > k
            && self.probe.is_some()
            && let Some(again) = self.probe_round(*stage, x, *t as usize, &mut parts, c, what)?
        {
            out = again;
        }
        self.stats.decode_time += started.elapsed();
        Ok((out, parts))
    }

    /// Keeps a checked round (k of its agreeing answers) for the answers still to come to it:
    /// only where some member was asked and not used.
    fn keep_recent(&mut self, mut parts: Parts, c: usize, what: &str) {
        let k = self.generator.k();
        let Some(round) = self.transport.last_round() else {
            return;
        };
        if parts.len() <= k || self.members.len() <= parts.len() {
            return;
        }
        if self.recent.len() == RECENT_ROUNDS {
            self.recent.pop_front();
        }
        parts.truncate(k);
        self.recent.push_back(Recent {
            round,
            parts,
            c,
            what: what.to_string(),
        });
    }

    /// Checks each answer that came after its round was decoded against that decode: one
    /// that disagrees with k answers the round's check passed is the wrong one, caught as in
    /// the round.
    fn check_late(&mut self) {
        let late = self.transport.late_answers();
        if late.is_empty() {
            return;
        }
        let recent = std::mem::take(&mut self.recent);
        self.check_late_against(&recent, late);
        self.recent = recent;
    }

    fn check_late_against(&mut self, recent: &VecDeque<Recent>, late: Vec<(u64, usize, Vec<u8>)>) {
        let m = self.generator.sub_blocks();
        for (round, node, bytes) in late {
            let Some(r) = recent.iter().find(|r| r.round == round) else {
                continue;
            };
            if !self.members.contains(&node) || r.parts.iter().any(|(n, _)| *n == node) {
                continue;
            }
            let values = match parse_answer(node, &bytes, m * r.c) {
                Ok(values) => values,
                Err(e) => {
                    tracing::warn!(node, error = %e, "dropping a member whose late answer is unusable");
                    self.drop_member(node);
                    continue;
                }
            };
            let answer = (node, values);
            let set: Vec<&(usize, Vec<f32>)> =
                r.parts.iter().chain(std::iter::once(&answer)).collect();
            let checked = match self.consistent(&set, r.c) {
                Ok(checked) => checked,
                Err(e) => {
                    tracing::warn!(node, error = %e, "a late answer could not be checked");
                    continue;
                }
            };
            self.stats.late_checked += 1;
            if let Err((residual, threshold)) = checked {
                self.convict(Caught {
                    node,
                    step: format!("{} (an answer that came late)", r.what),
                    residual,
                    threshold,
                    witnesses: r.parts.iter().map(|(n, _)| *n).collect(),
                    missing_update: None,
                });
            }
        }
    }

    /// Records a member caught answering against the code, with the evidence, and drops it.
    fn convict(&mut self, caught: Caught) {
        tracing::warn!(node = caught.node, "{caught}");
        self.drop_member(caught.node);
        self.stats.caught.push(caught);
    }

    /// Leaves `node` out of the group from now on, counted.
    fn drop_member(&mut self, node: usize) {
        self.members.retain(|&n| n != node);
        self.stats.members_dropped += 1;
    }

    /// The residuals of the answers beyond the first k (in order) against the decode of the
    /// first k, one after another.
    fn residuals(&mut self, parts: &[(usize, &[f32])], c: usize) -> Result<Vec<f32>, CodedError> {
        let k = self.generator.k();
        let (_, _, predicted) = self.decode_and_predict(parts, c)?;
        Ok(parts
            .iter()
            .skip(k)
            .zip(&predicted)
            .flat_map(|((_, actual), p)| actual.iter().zip(p).map(|(a, p)| a - p))
            .collect())
    }

    /// Fits a checked round's residuals against the learning updates under test; when a member
    /// is convicted of missing one, it is recorded, dropped, and the round is decoded again
    /// from the others (returned).
    fn probe_round(
        &mut self,
        stage: Stage,
        x: &[f32],
        t: usize,
        parts: &mut Parts,
        c: usize,
        what: &str,
    ) -> Result<Option<Vec<f32>>, CodedError> {
        let Some(mut probe) = self.probe.take() else {
            return Ok(None);
        };
        let result = self.fit_round(&mut probe, stage, x, t, parts, c);
        let fits: Vec<_> = (0..probe.len()).flat_map(|u| probe.fits(u)).collect();
        self.probe = Some(probe);
        result?;
        let rows: Vec<usize> = parts.iter().map(|(n, _)| *n).collect();
        let convicted = fits
            .iter()
            .filter(|f| rows.contains(&f.row) && f.convicts())
            .max_by(|a, b| a.sigmas.abs().total_cmp(&b.sigmas.abs()));
        for f in fits.iter().filter(|f| !f.convicts()) {
            self.stats.max_probe_sigmas = self.stats.max_probe_sigmas.max(f.sigmas.abs());
        }
        let Some(fit) = convicted.copied() else {
            return Ok(None);
        };
        let Some(i) = parts.iter().position(|(n, _)| *n == fit.row) else {
            return Ok(None);
        };
        parts.remove(i);
        let rest: Vec<&(usize, Vec<f32>)> = parts.iter().collect();
        let out = match self.consistent(&rest, c)? {
            Ok((out, _)) => out,
            Err((worst, threshold)) => {
                return Err(CodedError::Verification(format!(
                    "{what}: without row {} (missing update {:016x}) the others disagree (residual {worst:.2e} > {threshold:.2e})",
                    fit.row, fit.id
                )));
            }
        };
        self.convict(Caught {
            node: fit.row,
            step: what.to_string(),
            residual: fit.sigmas.abs(),
            threshold: super::probe::PROBE_SIGMAS,
            witnesses: parts.iter().map(|(n, _)| *n).collect(),
            missing_update: Some((fit.id, fit.share)),
        });
        Ok(Some(out))
    }

    /// Adds one round's evidence to every update still under test.
    fn fit_round(
        &mut self,
        probe: &mut UpdateProbe,
        stage: Stage,
        x: &[f32],
        t: usize,
        parts: &Parts,
        c: usize,
    ) -> Result<(), CodedError> {
        let m = self.generator.sub_blocks();
        let rows: Vec<usize> = parts.iter().map(|(n, _)| *n).collect();
        let open = probe.open(&rows);
        if open.is_empty() {
            return Ok(());
        }
        let refs: Vec<(usize, &[f32])> = parts.iter().map(|(n, v)| (*n, v.as_slice())).collect();
        let res = self.residuals(&refs, c)?;
        // The round's noise variance per value, floored at a fraction of f32's resolution of
        // the answers so an exactly consistent round does not claim infinite precision.
        let scale = parts
            .iter()
            .flat_map(|(_, v)| v.iter())
            .fold(0.0f64, |a, &v| a.max(v.abs() as f64));
        let floor = (1e-3 * f32::EPSILON as f64 * scale).powi(2);
        let var = (res.iter().map(|&r| r as f64 * r as f64).sum::<f64>() / res.len().max(1) as f64)
            .max(floor)
            .max(f64::MIN_POSITIVE);
        let zeros = vec![0.0f32; m * c];
        let mut counted = false;
        for u in open {
            let Some(effect) = probe.effect(u, &self.cfg, &self.generator, stage, x, t) else {
                continue;
            };
            let mut sigs = Vec::with_capacity(rows.len());
            let mut e = vec![0.0f32; m * c];
            for (i, &row) in rows.iter().enumerate() {
                self.generator.predict_part(row, &effect, &mut e)?;
                let only: Vec<(usize, &[f32])> = rows
                    .iter()
                    .enumerate()
                    .map(|(j, &n)| {
                        (
                            n,
                            if j == i {
                                e.as_slice()
                            } else {
                                zeros.as_slice()
                            },
                        )
                    })
                    .collect();
                let mut s = self.residuals(&only, c)?;
                s.iter_mut().for_each(|v| *v = -*v);
                sigs.push((row, s));
            }
            probe.add(u, &res, &sigs, var);
            counted = true;
        }
        self.stats.probed_rounds += u64::from(counted);
        Ok(())
    }

    /// Adds usable answers to `parts` from members that have not answered, up to `want`
    /// (fewer only when members run out); `leave` (the check row of a projected round) is not
    /// asked and stays a member.
    async fn collect(
        &mut self,
        bytes: &[u8],
        c: usize,
        parts: &mut Parts,
        mut want: usize,
        mut leave: Option<usize>,
    ) -> Result<(), CodedError> {
        let k = self.generator.k();
        let m = self.generator.sub_blocks();
        let mut last_error = None;
        for _ in 0..MAX_ROUND_ATTEMPTS {
            if parts.len() >= want {
                break;
            }
            let need = want - parts.len();
            let mut asked: Vec<usize> = self
                .members
                .iter()
                .copied()
                .filter(|n| parts.iter().all(|(p, _)| p != n) && Some(*n) != leave)
                .collect();
            if asked.is_empty() {
                break;
            }
            let started = Instant::now();
            let result = self.transport.round(&mut asked, bytes, need).await;
            self.stats.member_time += started.elapsed();
            self.stats.bytes_sent += (bytes.len() * asked.len()) as u64;
            self.stats.member_requests += asked.len() as u64;
            // The transport may have replaced members: keep its view, answered rows first.
            let mut members: Vec<usize> = parts.iter().map(|(n, _)| *n).collect();
            for n in asked {
                if !members.contains(&n) {
                    members.push(n);
                }
            }
            let answers = match result {
                Ok(a) => a,
                Err(e) if leave.is_some() => {
                    // A member failed a projected round: the check row answers in its place.
                    tracing::warn!(node = e.node, reason = %e.reason, "a member failed; asking the check row for its answer");
                    members
                        .extend(leave.filter(|n| self.members.contains(n) && !members.contains(n)));
                    leave = None;
                    self.members = members;
                    last_error = Some(e.into());
                    continue;
                }
                Err(e) if want > k => {
                    // Too few members left to check this round: decode from k, unchecked.
                    tracing::warn!(node = e.node, reason = %e.reason, "too few members to check the round; decoding from k");
                    want = k.max(parts.len());
                    self.members = members;
                    last_error = Some(e.into());
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            for (node, answer) in answers {
                self.stats.bytes_received += answer.len() as u64;
                if parts.len() == want || parts.iter().any(|(p, _)| *p == node) {
                    continue;
                }
                match parse_answer(node, &answer, m * c) {
                    Ok(values) => parts.push((node, values)),
                    Err(e) => {
                        tracing::warn!(node, error = %e, "dropping a member whose answer is unusable");
                        self.stats.members_dropped += 1;
                        members.retain(|&n| n != node);
                        last_error = Some(e);
                    }
                }
            }
            members.extend(leave.filter(|n| self.members.contains(n) && !members.contains(n)));
            self.members = members;
        }
        match last_error {
            Some(e) if parts.len() < k => Err(e),
            _ => Ok(()),
        }
    }

    /// Decodes the first k of `parts` (in arrival order) and checks the rest against them:
    /// the decoded blocks and the threshold of that decode, or the largest residual and the
    /// threshold when a check fails.
    fn consistent(
        &mut self,
        parts: &[&(usize, Vec<f32>)],
        c: usize,
    ) -> Result<Checked, CodedError> {
        let k = self.generator.k();
        let refs: Vec<(usize, &[f32])> = parts.iter().map(|(n, v)| (*n, v.as_slice())).collect();
        let (out, kappa, predicted) = self.decode_and_predict(&refs, c)?;
        let threshold = self.verify.threshold(kappa);
        if predicted.is_empty() {
            // No answer beyond the k decoded to check (the scale below would go unused).
            return Ok(Ok((out, threshold)));
        }
        let floor = largest(&out);
        let worst = refs
            .iter()
            .skip(k)
            .zip(&predicted)
            .map(|((_, actual), p)| residual(actual, p, floor))
            .fold(0.0f64, f64::max);
        if worst > threshold || worst.is_nan() {
            return Ok(Err((worst, threshold)));
        }
        self.stats.max_pass_ratio = self.stats.max_pass_ratio.max(worst / threshold);
        Ok(Ok((out, threshold)))
    }

    /// Decodes the first k of `parts` (in order; decoded sorted by row) and predicts each later
    /// answer from them: the decoded blocks, the decoding's condition number, the predictions.
    fn decode_and_predict(
        &mut self,
        parts: &[(usize, &[f32])],
        c: usize,
    ) -> Result<Predicted, CodedError> {
        let (k, m) = (self.generator.k(), self.generator.sub_blocks());
        let mut decode: Vec<(usize, &[f32])> = parts.iter().take(k).copied().collect();
        decode.sort_by_key(|(n, _)| *n);
        let rows: Vec<usize> = decode.iter().map(|(n, _)| *n).collect();
        let refs: Vec<&[f32]> = decode.iter().map(|(_, v)| *v).collect();
        let mut out = vec![0.0f32; k * m * c];
        let decoder = self.decoder_for(&rows)?;
        decoder.decode(&refs, &mut out)?;
        let kappa = decoder.condition_number();
        let predicted = parts
            .iter()
            .skip(k)
            .map(|(node, _)| {
                let mut p = vec![0.0f32; m * c];
                self.generator.predict_part(*node, &out, &mut p).map(|()| p)
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok((out, kappa, predicted))
    }

    /// The decoded blocks of a round, checked: a member whose answer disagrees is located
    /// (leave-one-out over k + 2 answers, asking one more member when only k + 1 came),
    /// reported in [`ExecStats::caught`], dropped from the group, and the round is decoded from
    /// the members that agree.
    async fn decode_checked(
        &mut self,
        parts: &mut Parts,
        c: usize,
        bytes: &[u8],
        what: &str,
    ) -> Result<Vec<f32>, CodedError> {
        let k = self.generator.k();
        if parts.len() > k {
            self.stats.verified_rounds += 1;
        } else {
            self.stats.unverified_rounds += u64::from(self.verify.extra > 0);
        }
        let all: Vec<&(usize, Vec<f32>)> = parts.iter().collect();
        let (worst, threshold) = match self.consistent(&all, c)? {
            // With k answers there is nothing to check: this is the plain decode.
            Ok((out, _)) => return Ok(out),
            Err(r) => r,
        };
        tracing::warn!(
            what,
            residual = worst,
            threshold,
            "answers disagree with the code; locating the member"
        );
        // Leave-one-out needs k + 2 answers: ask for one more if only k + 1 came.
        self.collect(bytes, c, parts, k + 2, None).await?;
        if parts.len() < k + 2 {
            return Err(CodedError::Verification(format!(
                "{what}: answers disagree (residual {worst:.2e} > {threshold:.2e}) and no further member can tell which is wrong"
            )));
        }
        let rest_of = |i: usize| -> Vec<&(usize, Vec<f32>)> {
            parts
                .iter()
                .enumerate()
                .filter_map(|(j, p)| (j != i).then_some(p))
                .collect()
        };
        let mut found = Vec::new();
        for i in 0..parts.len() {
            if let Ok(agreed) = self.consistent(&rest_of(i), c)? {
                found.push((i, agreed));
            }
        }
        if found.len() > 1 {
            // A set that still holds the wrong member can pass when that member weighs little
            // in the one prediction made: such sets are told apart by checking each of their
            // members in turn against the decode of the others (it fails where the wrong
            // member is the one checked). Only then, so a round located at once is located as
            // before.
            let mut kept = Vec::new();
            for (i, agreed) in found {
                let mut rest = rest_of(i);
                let mut every = true;
                for _ in 1..rest.len() {
                    rest.rotate_left(1);
                    if self.consistent(&rest, c)?.is_err() {
                        every = false;
                        break;
                    }
                }
                if every {
                    kept.push((i, agreed));
                }
            }
            found = kept;
        }
        let [(i, (out, threshold))] = <[_; 1]>::try_from(found).map_err(|found| {
            CodedError::Verification(format!(
                "{what}: answers disagree (residual {worst:.2e} > {threshold:.2e}) and {} members are suspect",
                if found.is_empty() { "several".to_string() } else { found.len().to_string() }
            ))
        })?;
        let (node, values) = parts.remove(i);
        // The evidence: its residual against the decode of the members that agree, on the
        // check's own scale (at least the decoded values', as `consistent` measures).
        let mut predicted = vec![0.0f32; values.len()];
        self.generator.predict_part(node, &out, &mut predicted)?;
        let own = residual(&values, &predicted, largest(&out));
        self.convict(Caught {
            node,
            step: what.to_string(),
            residual: own,
            threshold,
            witnesses: parts.iter().map(|(n, _)| *n).collect(),
            missing_update: None,
        });
        Ok(out)
    }

    /// The check row that checks a forward round of `stage` by projection, with its
    /// projections for the stage fetched; `None` when the round is checked by answers: no
    /// check row, too few other members, or an update probe still needing the residuals of
    /// the rows that take part. A check row that cannot give its projections is dropped.
    async fn projecting(&mut self, stage: Stage) -> Result<Option<usize>, CodedError> {
        let k = self.generator.k();
        let Some(row) = self.sketch.as_ref().map(|s| s.row) else {
            return Ok(None);
        };
        if !self.members.contains(&row) {
            self.sketch = None;
            return Ok(None);
        }
        // The rows that take part in a projected round: those decoded last and the check row
        // (a spare that never answers would keep the probe open for ever).
        let mut taking_part: Vec<usize> = self
            .decoders
            .first()
            .map(|d| d.nodes().to_vec())
            .unwrap_or_default();
        taking_part.push(row);
        if self.members.len() <= k
            || self
                .probe
                .as_ref()
                .is_some_and(|p| !p.open(&taking_part).is_empty())
        {
            return Ok(None);
        }
        if self
            .sketch
            .as_ref()
            .is_some_and(|s| s.stages.contains_key(&stage))
        {
            return Ok(Some(row));
        }
        let (inp, lens) = self.stage_layout(stage);
        let per_sub: usize = lens.iter().sum();
        let m = self.generator.sub_blocks();
        let directions: Vec<Vec<f32>> = (0..PROJECTIONS)
            .map(|_| random_input(&mut self.checks, m * per_sub))
            .collect();
        // A transpose request's layout: [sub-block][matrix][direction][row].
        let mut u = Vec::with_capacity(PROJECTIONS * m * per_sub);
        for sub in 0..m {
            let mut at = sub * per_sub;
            for &l in &lens {
                for d in &directions {
                    u.extend_from_slice(&d[at..at + l]);
                }
                at += l;
            }
        }
        let request = protocol::encode(&StepRequest::MatmulT {
            stage,
            t: PROJECTIONS as u32,
            u,
        })?;
        self.transport.label(&format!("{stage:?} projection"));
        self.stats.bytes_sent += request.len() as u64;
        self.stats.member_requests += 1;
        self.stats.rounds += 1;
        let started = Instant::now();
        let answer = self.transport.round_each(vec![(row, request)]).await;
        self.stats.member_time += started.elapsed();
        let products = answer.map_err(CodedError::Transport).and_then(|answers| {
            let (_, bytes) =
                answers
                    .iter()
                    .find(|(n, _)| *n == row)
                    .ok_or_else(|| CodedError::Member {
                        node: row,
                        reason: "gave no projection".into(),
                    })?;
            self.stats.bytes_received += bytes.len() as u64;
            let w = parse_answer(row, bytes, PROJECTIONS * inp)?;
            match w.iter().all(|v| v.is_finite()) {
                true => Ok(w),
                false => Err(CodedError::Member {
                    node: row,
                    reason: "gave a projection that is not finite".into(),
                }),
            }
        });
        match products {
            Ok(w) => {
                let products: Vec<Vec<f32>> =
                    w.chunks_exact(inp.max(1)).map(<[f32]>::to_vec).collect();
                let norms = products
                    .iter()
                    .zip(&directions)
                    .map(|(w, d)| pair_norms(w, d))
                    .collect();
                if let Some(sketch) = self.sketch.as_mut() {
                    sketch.stages.insert(
                        stage,
                        Arc::new(Projection {
                            directions,
                            products,
                            norms,
                        }),
                    );
                }
                Ok(Some(row))
            }
            Err(e) => {
                tracing::warn!(node = row, error = %e, "dropping a check row that gave no usable projection");
                self.drop_member(row);
                self.sketch = None;
                Ok(None)
            }
        }
    }

    /// Decodes a round of k answers and checks it by projection: for each direction `ρ` and
    /// token τ, `ρ·ŷ_p[τ]` (the check row's answer predicted from the decode) must match
    /// `w·x[τ]` ([`transpose_residual`] within [`VerifyConfig::backward_threshold`]). When it
    /// does not, the check row is asked for its answer and the round is checked by answers
    /// ([`Self::decode_checked`]); if every answer then agrees, the check row's projection was
    /// wrong, and it is caught.
    #[allow(clippy::too_many_arguments, reason = "one round's whole context")]
    async fn decode_projected(
        &mut self,
        row: usize,
        stage: Stage,
        x: &[f32],
        t: usize,
        parts: &mut Parts,
        c: usize,
        bytes: &[u8],
        what: &str,
    ) -> Result<Vec<f32>, CodedError> {
        // Shared, not borrowed: the decode below needs the group mutably.
        let Some(projection) = self
            .sketch
            .as_ref()
            .and_then(|s| s.stages.get(&stage))
            .cloned()
        else {
            return self.decode_checked(parts, c, bytes, what).await;
        };
        let Projection {
            directions,
            products,
            norms,
        } = &*projection;
        let m = self.generator.sub_blocks();
        let refs: Vec<(usize, &[f32])> = parts.iter().map(|(n, v)| (*n, v.as_slice())).collect();
        let (out, kappa, _) = self.decode_and_predict(&refs, c)?;
        let mut predicted = vec![0.0f32; m * c];
        self.generator.predict_part(row, &out, &mut predicted)?;
        let (inp, lens) = self.stage_layout(stage);
        let threshold = self
            .verify
            .backward_threshold(kappa, m * lens.iter().sum::<usize>(), inp);
        let mut worst = 0.0f64;
        // A non-finite answer makes every dot product NaN, which no comparison would flag.
        if !predicted.iter().all(|v| v.is_finite()) {
            worst = f64::INFINITY;
        }
        let pairs: Vec<(&[f32], &[f32])> = products
            .iter()
            .zip(directions)
            .map(|(w, d)| (w.as_slice(), d.as_slice()))
            .collect();
        worst = worst.max(transpose_residuals(&pairs, norms, x, &predicted, &lens, t)?);
        if worst <= threshold {
            self.stats.verified_rounds += 1;
            self.stats.projected_rounds += 1;
            self.stats.max_projected_ratio = self.stats.max_projected_ratio.max(worst / threshold);
            return Ok(out);
        }
        tracing::warn!(
            what,
            residual = worst,
            threshold,
            "answers disagree with the check row's projection; asking it for its answer"
        );
        let caught = self.stats.caught.len();
        let k = self.generator.k();
        self.collect(bytes, c, parts, k + 1, None).await?;
        let out = self.decode_checked(parts, c, bytes, what).await?;
        let answered = parts.iter().any(|(n, _)| *n == row);
        if self.stats.caught.len() == caught && parts.len() > k && answered {
            // Every answer agrees with the check row's own: its projection was the lie.
            self.convict(Caught {
                node: row,
                step: format!("{what} projection"),
                residual: worst,
                threshold,
                witnesses: parts
                    .iter()
                    .map(|(n, _)| *n)
                    .filter(|&n| n != row)
                    .collect(),
                missing_update: None,
            });
            parts.retain(|(n, _)| *n != row);
            self.sketch = None;
        }
        Ok(out)
    }

    async fn linear_coded(
        &mut self,
        stage: Stage,
        x: &[f32],
        t: usize,
    ) -> Result<Vec<Vec<f32>>, CodedError> {
        let shapes = stage.shapes(&self.cfg);
        let lens: Vec<usize> = shapes
            .iter()
            .map(|&(out, _)| self.generator.block_len(out))
            .collect();
        let c: usize = lens.iter().map(|l| t * l).sum();
        let req = StepRequest::Matmul {
            stage,
            t: t as u32,
            x: x.to_vec(),
        };
        let decoded = self.run(&req, c, &format!("{stage:?}")).await?;
        let started = Instant::now();
        let blocks = self.generator.k() * self.generator.sub_blocks();
        let mut outputs = Vec::with_capacity(shapes.len());
        let mut offset = 0;
        for (&(out, _), &l) in shapes.iter().zip(&lens) {
            let mut y = vec![0.0f32; t * out];
            for j in 0..blocks {
                let block = &decoded[j * c + offset..j * c + offset + t * l];
                for (tok, src) in block.chunks_exact(l).enumerate() {
                    let first = j * l;
                    if first >= out {
                        break;
                    }
                    let n = l.min(out - first);
                    y[tok * out + first..tok * out + first + n].copy_from_slice(&src[..n]);
                }
            }
            offset += t * l;
            outputs.push(y);
        }
        self.stats.decode_time += started.elapsed();
        Ok(outputs)
    }

    /// `Σ_matrix dy_matrix · W_matrix` (`t × in`) for a stage, through the group: each of k
    /// members multiplies its shards' transposes by its own `u_i = Σ_j H[j,i]·dy_j`. With
    /// checking on, the answers are checked ([`Self::check_backward`]) and the step is redone
    /// without a member that fails.
    async fn linear_t_coded(
        &mut self,
        stage: Stage,
        dys: &[Vec<f32>],
        t: usize,
    ) -> Result<Vec<f32>, CodedError> {
        let shapes = stage.shapes(&self.cfg);
        if dys.len() != shapes.len()
            || dys
                .iter()
                .zip(&shapes)
                .any(|(dy, &(out, _))| dy.len() != t * out)
        {
            return Err(CodedError::BadRequest(format!(
                "{stage:?}: gradients do not match the stage's outputs"
            )));
        }
        let inp = shapes.first().map_or(0, |&(_, i)| i);
        let k = self.generator.k();
        let dy = to_blocks(dys, &shapes, &self.generator, t);
        let what = format!("{stage:?} backward");
        let mut last_error = None;
        for _ in 0..MAX_ROUND_ATTEMPTS {
            self.transport.label(&what);
            // The rows decoded last, if all are still members; else the first k members.
            let mut rows: Vec<usize> = self
                .decoders
                .first()
                .map(|d| d.nodes().to_vec())
                .filter(|r| r.iter().all(|n| self.members.contains(n)))
                .unwrap_or_else(|| self.members.iter().copied().take(k).collect());
            rows.sort_unstable();
            let inputs: Parts = rows
                .iter()
                .copied()
                .zip(self.decoder_for(&rows)?.transpose(&dy)?)
                .collect();
            let requests = inputs
                .iter()
                .map(|(node, u)| {
                    protocol::encode(&StepRequest::MatmulT {
                        stage,
                        t: t as u32,
                        u: u.clone(),
                    })
                    .map(|b| (*node, b))
                })
                .collect::<Result<Vec<_>, _>>()?;
            let started = Instant::now();
            self.stats.bytes_sent += requests.iter().map(|(_, b)| b.len() as u64).sum::<u64>();
            self.stats.member_requests += requests.len() as u64;
            let answers = match self.transport.round_each(requests).await {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(node = e.node, reason = %e.reason, "dropping a member in a backward step");
                    self.drop_member(e.node);
                    last_error = Some(CodedError::Transport(e));
                    continue;
                }
            };
            self.stats.member_time += started.elapsed();
            self.stats.rounds += 1;
            let mut parts = Parts::with_capacity(answers.len());
            let mut bad = None;
            for (node, answer) in &answers {
                self.stats.bytes_received += answer.len() as u64;
                match parse_answer(*node, answer, t * inp) {
                    Ok(v) if rows.contains(node) && parts.iter().all(|(n, _)| n != node) => {
                        parts.push((*node, v))
                    }
                    Ok(_) => {}
                    Err(e) => bad = Some((*node, e)),
                }
            }
            match bad {
                None if parts.len() == rows.len() => {
                    if self.verify.extra == 0
                        || self.check_backward(stage, t, &inputs, &parts).await?
                    {
                        let mut sum = vec![0.0f32; t * inp];
                        for (_, v) in &parts {
                            sum.iter_mut().zip(v).for_each(|(a, &b)| *a += b);
                        }
                        return Ok(sum);
                    }
                    last_error = Some(CodedError::Verification(format!(
                        "{what}: members kept failing the check"
                    )));
                }
                None => {
                    last_error = Some(CodedError::Member {
                        node: usize::MAX,
                        reason: "a member did not answer a backward step".into(),
                    })
                }
                Some((node, e)) => {
                    self.drop_member(node);
                    last_error = Some(e);
                }
            }
            if self.members.len() < k {
                break;
            }
        }
        Err(last_error.unwrap_or_else(|| CodedError::Member {
            node: usize::MAX,
            reason: "backward step failed".into(),
        }))
    }

    /// Freivalds' check of a backward round (docs/verification.md). Now that the answers
    /// `a_i = S_iᵀ·u_i` are in (`inputs` holds each member's `u_i`), draws a random `r`, runs a
    /// checked forward round of the stage at `x = r`, predicts each member's `S_i·r` from k
    /// answers other than its own, and checks `r·a_i[τ] ≈ u_i[τ]·(S_i·r)` for every token τ
    /// ([`transpose_residual`] within [`VerifyConfig::backward_threshold`]). A member that
    /// fails is recorded in [`ExecStats::caught`] and dropped; returns whether all passed.
    async fn check_backward(
        &mut self,
        stage: Stage,
        t: usize,
        inputs: &Parts,
        answers: &Parts,
    ) -> Result<bool, CodedError> {
        let k = self.generator.k();
        let (inp, lens) = self.stage_layout(stage);
        let c: usize = lens.iter().sum();
        let r = random_input(&mut self.checks, inp);
        let req = StepRequest::Matmul {
            stage,
            t: 1,
            x: r.clone(),
        };
        let (_, forward) = self
            .run_with_parts(&req, c, &format!("{stage:?} backward check"))
            .await?;
        let started = Instant::now();
        self.stats.checked_backward_rounds += 1;
        let mut passed = true;
        for (node, a) in answers {
            let u = inputs
                .iter()
                .find(|(n, _)| n == node)
                .map(|(_, u)| u.as_slice())
                .ok_or_else(|| CodedError::Member {
                    node: *node,
                    reason: "answered a backward step it was not asked".into(),
                })?;
            // Its own forward answer must not vouch for its backward one: predict from k others
            // where the round has them.
            let others = forward.iter().filter(|(n, _)| n != node).count();
            let mut refs: Vec<(usize, &[f32])> = forward
                .iter()
                .filter(|(n, _)| others < k || n != node)
                .take(k)
                .map(|(n, v)| (*n, v.as_slice()))
                .collect();
            let witnesses: Vec<usize> = refs.iter().map(|(n, _)| *n).collect();
            refs.push((*node, &[]));
            let (_, kappa, predicted) = self.decode_and_predict(&refs, c)?;
            let p = predicted.first().map_or(&[][..], Vec::as_slice);
            let threshold = self.verify.backward_threshold(kappa, p.len(), inp);
            let res = transpose_residual(&r, a, u, p, &lens, t)?;
            if res <= threshold {
                let ratio = self.stats.max_backward_pass_ratio.max(res / threshold);
                self.stats.max_backward_pass_ratio = ratio;
                continue;
            }
            passed = false;
            self.convict(Caught {
                node: *node,
                step: format!("{stage:?} backward"),
                residual: res,
                threshold,
                witnesses,
                missing_update: None,
            });
        }
        // The backward rows stay the ones decoded last, so the next step uses them again.
        let rows: Vec<usize> = inputs.iter().map(|(n, _)| *n).collect();
        if passed {
            self.decoder_for(&rows)?;
        }
        self.stats.decode_time += started.elapsed();
        Ok(passed)
    }

    async fn embed_coded(&mut self, tokens: &[u32]) -> Result<Vec<f32>, CodedError> {
        let (vocab, d) = (self.cfg.vocab, self.cfg.hidden);
        let l = self.generator.block_len(vocab);
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(ModelError::TokenOutOfRange { id: bad, vocab }.into());
        }
        let rows = tokens.iter().map(|&t| (t as usize % l) as u32).collect();
        let c = tokens.len() * d;
        let decoded = self
            .run(&StepRequest::EmbedRows { rows }, c, "embedding")
            .await?;
        let mut x = Vec::with_capacity(c);
        for (i, &t) in tokens.iter().enumerate() {
            let j = t as usize / l;
            x.extend_from_slice(&decoded[j * c + i * d..j * c + (i + 1) * d]);
        }
        Ok(x)
    }
}

/// A stage's outputs (`t × out` per matrix) in the decoder's layout:
/// `[block j][matrix][token][local row]`, zero-padded.
pub(super) fn to_blocks(
    mats: &[Vec<f32>],
    shapes: &[(usize, usize)],
    g: &Generator,
    t: usize,
) -> Vec<f32> {
    let blocks = g.k() * g.sub_blocks();
    let lens: Vec<usize> = shapes.iter().map(|&(out, _)| g.block_len(out)).collect();
    let c: usize = lens.iter().map(|l| t * l).sum();
    let mut dst = vec![0.0f32; blocks * c];
    let mut offset = 0;
    for ((mat, &(out, _)), &l) in mats.iter().zip(shapes).zip(&lens) {
        for j in 0..blocks {
            let first = j * l;
            if first >= out {
                break;
            }
            let n = l.min(out - first);
            for tok in 0..t {
                let at = j * c + offset + tok * l;
                dst[at..at + n].copy_from_slice(&mat[tok * out + first..tok * out + first + n]);
            }
        }
        offset += t * l;
    }
    dst
}

/// A member's answer as values, or why it cannot be used.
fn parse_answer(node: usize, answer: &[u8], expected: usize) -> Result<Vec<f32>, CodedError> {
    let member_err = |reason: String| CodedError::Member { node, reason };
    match protocol::decode::<StepResponse>(answer).map_err(|e| member_err(e.to_string()))? {
        StepResponse::Partial { node: got, values } => {
            if got as usize != node {
                return Err(member_err(format!("answered as node {got}")));
            }
            if values.len() != expected {
                return Err(member_err(format!(
                    "answered {} values, expected {expected}",
                    values.len()
                )));
            }
            Ok(values)
        }
        StepResponse::Failed { reason } => Err(member_err(reason)),
    }
}

fn exec_err(stage: Stage, e: CodedError) -> ModelError {
    ModelError::Exec {
        stage,
        message: e.to_string(),
    }
}

impl<T: Transport> LinearExec for CodedGroup<T> {
    async fn linear(
        &mut self,
        stage: Stage,
        x: &[f32],
        t: usize,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        self.linear_coded(stage, x, t)
            .await
            .map_err(|e| exec_err(stage, e))
    }

    async fn linear_t(
        &mut self,
        stage: Stage,
        dy: &[Vec<f32>],
        t: usize,
    ) -> Result<Vec<f32>, ModelError> {
        self.linear_t_coded(stage, dy, t)
            .await
            .map_err(|e| exec_err(stage, e))
    }

    async fn embed(&mut self, tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
        self.embed_coded(tokens)
            .await
            .map_err(|e| ModelError::Embedding(e.to_string()))
    }
}
