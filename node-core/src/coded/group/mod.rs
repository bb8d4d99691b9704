//! The leader's side: send a stage to the group, decode the answers, reassemble the outputs.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use web_time::{Duration, Instant};

mod checks;
mod transport;

pub use transport::{InProcess, Transport, TransportError};

use super::CodedError;
use super::probe::UpdateProbe;
use super::shards::to_blocks;
use super::verify::{
    Caught, VerifyConfig, largest, pair_norms, random_input, residual, transpose_residual,
    transpose_residuals,
};
use crate::code::{Decoder, Generator};
use crate::model::{LinearExec, LlamaConfig, ModelError, Stage};
use crate::protocol::{self, StepRequest, StepResponse};

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
    /// Rounds whose answers disagreed with the code where the wrong member could not be told
    /// (too few members answered to leave each out): a group with more checks would locate it.
    pub unlocated: u64,
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
    /// The pass's embedding round, decoded from k answers before its check came.
    embedding: Option<Unchecked>,
    /// While that round is collected: the first answer beyond the k it needs, if one came
    /// with them (a transport that answers every member at once).
    surplus: Option<Option<(usize, Vec<u8>)>>,
}

/// A round decoded from its first k answers while the answer that checks it is still to come
/// (the embedding: the check row's session sleeps between passes): checked before the pass's
/// LM head, so no token comes of it unchecked.
#[derive(Debug)]
struct Unchecked {
    /// The transport's number for it.
    round: u64,
    /// The k answers decoded.
    parts: Parts,
    /// Columns.
    c: usize,
    /// Its encoded request, to ask again.
    bytes: Vec<u8>,
    /// The answer that checks it, once it came.
    late: Option<(usize, Vec<u8>)>,
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
type Parts<T = f32> = Vec<(usize, Vec<T>)>;

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
            embedding: None,
            surplus: None,
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

    /// Makes `nodes` the members (a hop leader between passes): at least k, the first k
    /// decoding.
    pub fn set_nodes(&mut self, nodes: &[usize]) -> Result<(), CodedError> {
        let k = self.generator.k();
        let first = nodes.get(..k).ok_or(crate::code::CodeError::TooFew {
            available: nodes.len(),
            k,
        })?;
        Decoder::new(&self.generator, first)?;
        self.members = nodes.to_vec();
        self.set_verify(self.verify);
        Ok(())
    }

    /// The rows any k of which decode.
    pub fn k(&self) -> usize {
        self.generator.k()
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
        if matches!(req, StepRequest::Matmul { stage, .. } if *stage == Stage::LmHead) {
            self.check_embedding().await?;
            self.transport.label(what);
        }
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
                    // A member failed: the round is checked with the members left (a spare
                    // takes its place); with too few, it is decoded from k, unchecked.
                    want = want.min(members.len()).max(k.max(parts.len()));
                    if want > k {
                        tracing::warn!(node = e.node, reason = %e.reason, "a member failed; checking the round with the members left");
                    } else {
                        tracing::warn!(node = e.node, reason = %e.reason, "too few members to check the round; decoding from k");
                    }
                    self.members = members;
                    last_error = Some(e.into());
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
            for (node, answer) in answers {
                self.stats.bytes_received += answer.len() as u64;
                if parts.iter().any(|(p, _)| *p == node) {
                    continue;
                }
                if parts.len() == want {
                    if let Some(slot @ None) = self.surplus.as_mut() {
                        *slot = Some((node, answer));
                    }
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
        let (inp, lens) = self.stage_layout(stage);
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
            let mut inputs: Parts = rows
                .iter()
                .copied()
                .zip(self.decoder_for(&rows)?.transpose(&dy)?)
                .collect();
            // Each member's input goes out with every token's values scaled by a power of two
            // into [1, 2), and its answer is scaled back (exact both ways): a token the model
            // is certain of has a gradient of a few subnormal values (1e-43 on the 1B shape),
            // all of a member's share on a systematic code, whose products f32 keeps with about
            // one digit, so honest answers failed the check.
            let exponents: Parts<i32> = inputs
                .iter_mut()
                .map(|(node, u)| (*node, scale_tokens(u, &lens, t)))
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
                        return Ok(scaled_back_sum(&parts, &exponents, t * inp));
                    }
                    self.stats.unlocated += 1;
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

    async fn embed_coded(&mut self, tokens: &[u32]) -> Result<Vec<f32>, CodedError> {
        let (vocab, d) = (self.cfg.vocab, self.cfg.hidden);
        let l = self.generator.block_len(vocab);
        if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(ModelError::TokenOutOfRange { id: bad, vocab }.into());
        }
        let rows = tokens.iter().map(|&t| (t as usize % l) as u32).collect();
        let c = tokens.len() * d;
        let request = StepRequest::EmbedRows { rows };
        self.check_embedding().await?;
        let decoded = if self.defers_embedding_check() {
            self.embed_unchecked(&request, c).await?
        } else {
            self.run(&request, c, "embedding").await?
        };
        let mut x = Vec::with_capacity(c);
        for (i, &t) in tokens.iter().enumerate() {
            let j = t as usize / l;
            x.extend_from_slice(&decoded[j * c + i * d..j * c + (i + 1) * d]);
        }
        Ok(x)
    }
}

/// Scales each of `t` tokens' values in a member's backward input `u` (`[sub-block][matrix]
/// [token][row]`, `lens` rows per matrix and sub-block) by the power of two that brings the
/// largest into `[1, 2)`, and answers the powers (0 for a token of zeros or with a value that
/// is not finite).
fn scale_tokens(u: &mut [f32], lens: &[usize], t: usize) -> Vec<i32> {
    let per_sub: usize = lens.iter().map(|l| t * l).sum();
    // The token's values in one sub-block: one run per matrix.
    let runs = |sub: usize, tok: usize| {
        let mut at = sub * per_sub;
        lens.iter().map(move |&l| {
            let run = at + tok * l..at + (tok + 1) * l;
            at += t * l;
            run
        })
    };
    let subs = u.len() / per_sub.max(1);
    (0..t)
        .map(|tok| {
            let largest = (0..subs)
                .flat_map(|s| runs(s, tok))
                .flat_map(|r| &u[r])
                .fold(0.0f32, |m, v| m.max(v.abs()));
            if !(largest > 0.0 && largest.is_finite()) {
                return 0;
            }
            let e = -(f64::from(largest).log2().floor() as i32);
            let f = 2f64.powi(e);
            for r in (0..subs).flat_map(|s| runs(s, tok)) {
                u[r].iter_mut()
                    .for_each(|v| *v = (f64::from(*v) * f) as f32);
            }
            e
        })
        .collect()
}

/// The sum of the members' answers `parts` (`t × in` each), each token row scaled back by the
/// power [`scale_tokens`] gave that member's input (`exponents`), formed in f64 and rounded once.
fn scaled_back_sum(parts: &Parts, exponents: &Parts<i32>, len: usize) -> Vec<f32> {
    let mut sum = vec![0.0f64; len];
    for (node, answer) in parts {
        let Some((_, powers)) = exponents.iter().find(|(n, _)| n == node) else {
            continue;
        };
        let width = len / powers.len().max(1);
        let tokens = answer
            .chunks(width.max(1))
            .zip(sum.chunks_mut(width.max(1)));
        for ((values, acc), &e) in tokens.zip(powers) {
            let f = 2f64.powi(-e);
            acc.iter_mut()
                .zip(values)
                .for_each(|(a, &v)| *a += f64::from(v) * f);
        }
    }
    sum.into_iter().map(|v| v as f32).collect()
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
