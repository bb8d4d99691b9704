//! One hop per stage: the members of a group send their coded outputs straight to each other,
//! and each member decodes, checks and runs the model's non-linear part itself, so a stage costs
//! one one-way delay instead of a leader's round trip. The leader only feeds tokens and reads
//! the LM head's coded outputs, which it decodes and checks as in any round.
//!
//! Every member keeps its own copy of the sequence's keys and values (the attention runs on each
//! member), and waits for every member's part of a round before it decodes, in the group's order:
//! so all members decode the same rows the same way and compute on bit-identical inputs, and
//! every round is checked with the answers beyond the first k, on every member.
//!
//! Frames are [`crate::net::session`]'s: length-prefixed, versioned postcard, size-limited.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use web_time::{Duration, Instant};

use crate::code::Generator;
use crate::coded::{CodedError, CodedGroup, ExecStats, Transport, TransportError, VerifyConfig};
use crate::model::{BatchItem, KvCache, LinearExec, Llama, LlamaConfig, ModelError, Pass, Stage};
use crate::protocol::{self, StepRequest};

/// Name of the hop protocol; the version is part of it. (2: the receiver of every stream
/// writes [`crate::net::session::ACCEPTED`] first;
/// 3: a pass carries a batch of sequences.)
pub const HOP_PROTOCOL: &str = "/codedmesh/hop/3";

/// The hop protocol's name, as libp2p takes it.
pub fn protocol() -> libp2p::StreamProtocol {
    libp2p::StreamProtocol::new(HOP_PROTOCOL)
}

/// What travels on a hop stream. A leader's stream to a member opens with [`HopFrame::Join`]
/// and then carries [`HopFrame::Feed`]s (each answered with a [`Fed`]); a member's stream to
/// another member carries only [`HopFrame::Part`]s.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum HopFrame {
    /// A leader forms a hop group.
    Join(Join),
    /// A leader's forward pass.
    Feed(Feed),
    /// A member's coded output of one round, for the other members.
    Part(Part),
}

/// A hop group, as its leader tells each member.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Join {
    /// The leader's number for the group; parts carry it.
    pub group: u64,
    /// The version every member computes at.
    pub version: [u8; 32],
    /// The members' rows, in the order every member decodes them (the first k decode).
    #[serde(deserialize_with = "crate::protocol::bounded::numbers")]
    pub rows: Vec<u32>,
    /// The members' peer ids (libp2p's bytes), by position in `rows`.
    pub peers: Vec<Vec<u8>>,
    /// Addresses each member may be dialed at, by position in `rows`.
    pub addrs: Vec<Vec<String>>,
    /// The row of the member this frame goes to.
    pub row: u32,
    /// How long a member waits for another's part before it leaves it out (ms).
    pub wait_ms: u32,
    /// Answers beyond the k decoded that every round is checked with.
    pub extra: u32,
    /// Residual allowed per unit of condition number.
    pub noise: f64,
}

impl Join {
    /// The members' rows, in the group's order.
    fn member_rows(&self) -> Vec<usize> {
        self.rows.iter().map(|&r| r as usize).collect()
    }

    /// How long a member's part (or a checking answer) is waited for, beyond the time its
    /// bytes take at [`MIN_RATE`].
    fn wait(&self) -> Duration {
        Duration::from_millis(self.wait_ms.into())
    }

    /// The coded group over `transport` that a member or the leader of this hop group
    /// decodes with, checking as the join says.
    fn group<T: Transport>(
        &self,
        cfg: LlamaConfig,
        generator: Generator,
        transport: T,
    ) -> Result<CodedGroup<T>, CodedError> {
        let mut group = CodedGroup::new(cfg, generator, &self.member_rows(), transport)?;
        group.set_verify(VerifyConfig {
            extra: self.extra as usize,
            noise: self.noise,
            // Every member decodes for itself, and the leader only the LM head: none projects.
            project: false,
        });
        Ok(group)
    }
}

/// One forward pass, as the leader feeds it: the sequences of its batch, each with tokens at
/// its own positions, run together.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Feed {
    /// The leader's number for the pass; the answer carries it back.
    pub pass: u64,
    /// The batch's sequences, in the order their logits come back.
    pub seqs: Vec<FeedSeq>,
    /// Sequences the leader is done with: members forget their keys and values first.
    #[serde(deserialize_with = "crate::protocol::bounded::numbers")]
    pub forget: Vec<u64>,
    /// The members the leader feeds this pass: the others have left the group.
    pub rows: Vec<u32>,
}

/// One sequence of a pass: `tokens` at positions `start..`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FeedSeq {
    /// The leader's number for the sequence; each member keeps its keys and values by it.
    pub seq: u64,
    /// The position of the first token (what members held from there on is forgotten).
    pub start: u32,
    /// The tokens.
    #[serde(deserialize_with = "crate::protocol::bounded::numbers")]
    pub tokens: Vec<u32>,
    /// How many of the last positions' logits the leader wants.
    pub logits: u32,
}

/// Every wait here is [`Join::wait_ms`] (or [`PASS_WAIT`]) plus the bytes waited for at this
/// rate.
pub use crate::protocol::{MIN_RATE, at_min_rate};

/// Sequences a member of a hop group holds at once; a pass that would start another fails
/// (its leader forgets every sequence it is done with).
pub const MAX_SEQUENCES: usize = 256;

/// A member's coded output of one round of a pass.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Part {
    /// The group.
    pub group: u64,
    /// The pass.
    pub pass: u64,
    /// The round within the pass (the embedding lookup is 1).
    pub round: u32,
    /// The sender's row.
    pub row: u32,
    /// Its encoded [`crate::protocol::StepResponse`].
    #[serde(with = "serde_bytes")]
    pub answer: Vec<u8>,
}

/// A member's answer to a [`Feed`]: its coded part of the LM head's output, or why it has none.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Fed {
    /// The pass.
    pub pass: u64,
    /// The encoded [`crate::protocol::StepResponse`] of the LM head round, or the error.
    pub result: Result<Vec<u8>, String>,
}

/// Why a hop pass failed on a member.
#[derive(Debug, thiserror::Error)]
pub enum HopError {
    /// The pass starts past what this member holds (it missed a pass).
    #[error("the pass starts at position {start}, this member holds {held}")]
    Gap {
        /// Where the pass starts.
        start: usize,
        /// Positions held.
        held: usize,
    },
    /// A sequence new to this member would be one more than it holds at once.
    #[error("a member holds at most {MAX_SEQUENCES} sequences of a group")]
    TooManySequences,
    /// A pass names a sequence twice, or none.
    #[error("a pass names each of its sequences once, and at least one")]
    BadBatch,
    /// The forward pass failed.
    #[error("{0}")]
    Model(#[from] ModelError),
    /// The group could not be set up.
    #[error("{0}")]
    Coded(#[from] CodedError),
    /// The pass ended without an LM head round.
    #[error("the pass ended without an LM head round")]
    NoHead,
}

/// What a member's exchange needs from its shell: its own shard, and streams to the others.
#[allow(
    async_fn_in_trait,
    reason = "a shell's streams and shard may be !Send (a browser's)"
)]
pub trait HopLink {
    /// This member's own encoded answer to a step (a [`crate::protocol::StepResponse`]).
    async fn compute(&mut self, step: StepRequest) -> Result<Vec<u8>, String>;
    /// Sends a part to the member holding `row` (a lost part shows as that member's silence).
    fn send(&mut self, row: usize, part: &Part);
    /// What comes next from the other members, or `None` if nothing comes within `wait`.
    async fn next(&mut self, wait: Duration) -> Option<Heard>;
}

/// What a member hears from the others.
#[derive(Debug, Clone, PartialEq)]
pub enum Heard {
    /// A member's part.
    Part(Part),
    /// The member holding this row left (its stream ended): no part of it will come.
    Gone(usize),
}

/// A member's side of the rounds: its own answer goes to every other member, and the round
/// returns once the parts asked for are in, in the group's order.
#[derive(Debug)]
pub struct Exchange<L> {
    link: L,
    group: u64,
    row: usize,
    rows: Vec<usize>,
    wait: Duration,
    /// The wait for the current round's parts: `wait` and their bytes at [`MIN_RATE`].
    round_wait: Duration,
    pass: u64,
    round: u32,
    request: Vec<u8>,
    got: BTreeMap<usize, Vec<u8>>,
    /// Parts of rounds this member has not reached yet (a faster member is one round ahead).
    early: Vec<Part>,
    head: Option<Vec<u8>>,
    /// Members that left the group.
    gone: std::collections::BTreeSet<usize>,
    /// Members left out of rounds, and why.
    dropped: Vec<(usize, String)>,
}

impl<L: HopLink> Exchange<L> {
    /// The exchange of the member holding `row` in `join`'s group, before its first pass.
    fn new(join: &Join, row: usize, link: L) -> Self {
        Self {
            link,
            group: join.group,
            row,
            rows: join.member_rows(),
            wait: join.wait(),
            round_wait: join.wait(),
            pass: 0,
            round: 0,
            request: Vec::new(),
            got: BTreeMap::new(),
            early: Vec::new(),
            head: None,
            gone: Default::default(),
            dropped: Vec::new(),
        }
    }

    fn start_pass(&mut self, pass: u64, rows: &[u32]) {
        let fed: Vec<usize> = rows.iter().map(|&r| r as usize).collect();
        self.gone
            .extend(self.rows.iter().filter(|r| !fed.contains(r)).copied());
        self.pass = pass;
        self.round = 0;
        self.request.clear();
        self.got.clear();
        self.head = None;
        self.early.retain(|p| p.pass >= pass);
    }

    fn take(&mut self, part: Part) {
        let row = part.row as usize;
        if part.group != self.group || !self.rows.contains(&row) || row == self.row {
            return;
        }
        match (part.pass, part.round).cmp(&(self.pass, self.round)) {
            std::cmp::Ordering::Equal => {
                self.got.entry(row).or_insert(part.answer);
            }
            std::cmp::Ordering::Greater => self.early.push(part),
            std::cmp::Ordering::Less => {} // a round already decoded without it
        }
    }

    /// The shell's link.
    pub fn link(&self) -> &L {
        &self.link
    }
}

impl<L: HopLink> Transport for Exchange<L> {
    async fn round(
        &mut self,
        members: &mut Vec<usize>,
        request: &[u8],
        need: usize,
    ) -> Result<Vec<(usize, Vec<u8>)>, TransportError> {
        if request != self.request.as_slice() {
            // A new round: compute this member's part and send it to the others. (The group
            // asks again with the same request for more answers of the same round.)
            self.round += 1;
            self.request = request.to_vec();
            self.got.clear();
            let step: StepRequest = protocol::decode(request).map_err(|e| TransportError {
                node: self.row,
                reason: format!("bad step: {e}"),
            })?;
            let head = matches!(
                step,
                StepRequest::Matmul {
                    stage: Stage::LmHead,
                    ..
                }
            );
            let own = self
                .link
                .compute(step)
                .await
                .map_err(|reason| TransportError {
                    node: self.row,
                    reason,
                })?;
            let part = Part {
                group: self.group,
                pass: self.pass,
                round: self.round,
                row: self.row as u32,
                answer: own,
            };
            for &row in &self.rows {
                if row != self.row {
                    self.link.send(row, &part);
                }
            }
            if head {
                self.head = Some(part.answer.clone());
            }
            // Every member's part is about as long as this one, and each sends one to each.
            self.round_wait = self.wait + at_min_rate(part.answer.len() * self.rows.len());
            self.got.insert(self.row, part.answer);
            for early in std::mem::take(&mut self.early) {
                self.take(early);
            }
        }
        let deadline = Instant::now() + self.round_wait;
        loop {
            let have = members.iter().filter(|r| self.got.contains_key(r)).count();
            if have >= need.min(members.len()) {
                return Ok(in_order(members, &self.got));
            }
            if let Some(gone) = members
                .iter()
                .copied()
                .find(|r| self.gone.contains(r) && !self.got.contains_key(r))
            {
                members.retain(|&r| r != gone);
                let reason = "left the group".to_string();
                self.dropped.push((gone, reason.clone()));
                return Err(TransportError { node: gone, reason });
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match self.link.next(left).await {
                Some(Heard::Part(part)) => self.take(part),
                Some(Heard::Gone(row)) => {
                    self.gone.insert(row);
                }
                None => {
                    let missing = leave_out_silent(members, &self.got);
                    let reason = format!(
                        "no part of round {} within {:?}",
                        self.round, self.round_wait
                    );
                    self.dropped.push((missing, reason.clone()));
                    return Err(TransportError {
                        node: missing,
                        reason,
                    });
                }
            }
        }
    }
}

/// The answers in, in the members' order.
fn in_order(members: &[usize], got: &BTreeMap<usize, Vec<u8>>) -> Vec<(usize, Vec<u8>)> {
    members
        .iter()
        .filter_map(|r| Some((*r, got.get(r)?.clone())))
        .collect()
}

/// Leaves out the members that have not answered; returns the first of them.
fn leave_out_silent(members: &mut Vec<usize>, got: &BTreeMap<usize, Vec<u8>>) -> usize {
    let missing = members
        .iter()
        .copied()
        .find(|r| !got.contains_key(r))
        .unwrap_or(usize::MAX);
    members.retain(|r| got.contains_key(r));
    missing
}

/// A member of a hop group: its copy of each sequence's keys and values, and the group it
/// decodes with.
#[derive(Debug)]
pub struct HopMember<L: HopLink> {
    llama: Llama,
    group: CodedGroup<Exchange<L>>,
    caches: BTreeMap<u64, KvCache>,
    cfg: LlamaConfig,
}

impl<L: HopLink> HopMember<L> {
    /// The member holding `join.row` of a group, computing with `llama` (the norm gains at the
    /// group's version) and decoding with `generator`.
    pub fn new(llama: Llama, generator: Generator, join: &Join, link: L) -> Result<Self, HopError> {
        let rows = join.member_rows();
        let row = join.row as usize;
        if !rows.contains(&row) {
            return Err(CodedError::BadRequest(format!("row {row} is not in the group")).into());
        }
        let exchange = Exchange::new(join, row, link);
        let cfg = llama.config().clone();
        let group = join.group(cfg.clone(), generator, exchange)?;
        Ok(Self {
            caches: BTreeMap::new(),
            cfg,
            llama,
            group,
        })
    }

    /// Runs a pass with the other members; returns this member's coded part of the logits.
    pub async fn feed(&mut self, feed: &Feed) -> Result<Vec<u8>, HopError> {
        for seq in &feed.forget {
            self.caches.remove(seq);
        }
        let mut ids: Vec<u64> = feed.seqs.iter().map(|s| s.seq).collect();
        ids.sort_unstable();
        ids.dedup();
        if ids.len() != feed.seqs.len() || ids.is_empty() {
            return Err(HopError::BadBatch);
        }
        let new = ids
            .iter()
            .filter(|id| !self.caches.contains_key(id))
            .count();
        if self.caches.len() + new > MAX_SEQUENCES {
            return Err(HopError::TooManySequences);
        }
        for s in &feed.seqs {
            let (start, held) = (
                s.start as usize,
                self.caches.get(&s.seq).map_or(0, KvCache::len),
            );
            if start > held {
                return Err(HopError::Gap { start, held });
            }
        }
        // Each sequence's cache comes out of the map for the pass and goes back after it.
        let mut caches: Vec<KvCache> = feed
            .seqs
            .iter()
            .map(|s| {
                let mut cache = self
                    .caches
                    .remove(&s.seq)
                    .unwrap_or_else(|| KvCache::new(&self.cfg));
                cache.truncate(s.start as usize);
                cache
            })
            .collect();
        self.group.transport_mut().start_pass(feed.pass, &feed.rows);
        let mut items: Vec<BatchItem<'_>> = feed
            .seqs
            .iter()
            .zip(caches.iter_mut())
            .map(|(s, cache)| BatchItem {
                logits: s.logits as usize,
                ..BatchItem::new(&s.tokens, cache)
            })
            .collect();
        let ran = self.llama.forward_batch(&mut self.group, &mut items).await;
        drop(items);
        self.caches
            .extend(feed.seqs.iter().map(|s| s.seq).zip(caches));
        ran?;
        self.group
            .transport_mut()
            .head
            .take()
            .ok_or(HopError::NoHead)
    }

    /// Sequences this member holds keys and values of.
    pub fn sequences(&self) -> usize {
        self.caches.len()
    }

    /// What this member's checks found so far (members caught, rounds checked).
    pub fn stats(&self) -> &ExecStats {
        self.group.stats()
    }

    /// Members this member left out of rounds, and why.
    pub fn dropped(&self) -> &[(usize, String)] {
        &self.group.transport().dropped
    }

    /// The shell's link.
    pub fn link(&self) -> &L {
        self.group.transport().link()
    }
}

/// What a hop leader needs from its shell: streams to the members.
#[allow(
    async_fn_in_trait,
    reason = "a shell's streams may be !Send (a browser's)"
)]
pub trait FeedLink {
    /// Sends a pass to the member holding `row`.
    fn feed(&mut self, row: usize, feed: &Feed);
    /// The next member's answer, or `None` if none comes within `wait`.
    async fn next(&mut self, wait: Duration) -> Option<(usize, Fed)>;
}

/// The leader's side of the LM head round: the members' answers to the current pass.
#[derive(Debug)]
pub struct Gather<L> {
    link: L,
    /// How long answers beyond the first k are waited for once those are in.
    wait: Duration,
    /// The answers needed to decode.
    k: usize,
    pass: u64,
    /// When the current pass was fed.
    fed_at: Instant,
    /// How long its first k answers are waited for: [`PASS_WAIT`], and the bytes each member
    /// sends the others in the pass at [`MIN_RATE`].
    pass_wait: Duration,
    /// When its k-th answer came.
    decodable_at: Option<Instant>,
    got: BTreeMap<usize, Vec<u8>>,
}

/// How long a leader waits for the first k answers to a pass, beyond its parts' bytes at
/// [`MIN_RATE`]: a whole forward pass runs in between (every stage's compute and one network
/// delay), so a silent group fails only after this. A member that fails is heard at once (its
/// stream ends), and one that is silent is left out by the others.
pub const PASS_WAIT: Duration = Duration::from_secs(120);

impl<L: FeedLink> Transport for Gather<L> {
    async fn round(
        &mut self,
        members: &mut Vec<usize>,
        _request: &[u8],
        need: usize,
    ) -> Result<Vec<(usize, Vec<u8>)>, TransportError> {
        loop {
            let have = members.iter().filter(|r| self.got.contains_key(r)).count();
            if have >= need.min(members.len()) {
                return Ok(in_order(members, &self.got));
            }
            // The first k answers may take a whole pass; the checking ones only a wait more.
            let deadline = match self.decodable_at {
                Some(at) => at + self.wait,
                None => self.fed_at + self.pass_wait,
            };
            let left = deadline.saturating_duration_since(Instant::now());
            match self.link.next(left).await {
                Some((row, fed)) if fed.pass == self.pass && members.contains(&row) => {
                    match fed.result {
                        Ok(answer) => {
                            self.got.entry(row).or_insert(answer);
                            if self.decodable_at.is_none() && self.got.len() >= self.k {
                                self.decodable_at = Some(Instant::now());
                            }
                        }
                        Err(reason) => {
                            members.retain(|&r| r != row);
                            return Err(TransportError { node: row, reason });
                        }
                    }
                }
                Some(_) => {} // an earlier pass's answer come late, or a member left out
                None => {
                    let missing = leave_out_silent(members, &self.got);
                    return Err(TransportError {
                        node: missing,
                        reason: format!(
                            "no answer to pass {} within {:?}",
                            self.pass,
                            self.fed_at.elapsed()
                        ),
                    });
                }
            }
        }
    }
}

/// A hop group's leader: feeds each pass's tokens to the members and decodes (and checks) the
/// logits from their LM head parts.
#[derive(Debug)]
pub struct HopLeader<L: FeedLink> {
    cfg: LlamaConfig,
    group: CodedGroup<Gather<L>>,
    /// Sequences done since the last pass, for the members to forget.
    forget: Vec<u64>,
    /// Values of a member's parts of one token's pass, every block's stages together.
    part_floats: usize,
}

/// One sequence of a leader's batch: its number among the group's sequences and its pass.
#[derive(Debug, Clone, Copy)]
pub struct HopSeq<'a> {
    /// The leader's number for the sequence.
    pub seq: u64,
    /// Its tokens, where they start, and the logits wanted.
    pub pass: Pass<'a>,
}

impl<L: FeedLink> HopLeader<L> {
    /// Leads the members of `join` (its `row` is ignored); each must already have its own
    /// [`Join`]. `link` reaches them.
    pub fn new(
        cfg: LlamaConfig,
        generator: Generator,
        join: &Join,
        link: L,
    ) -> Result<Self, CodedError> {
        let gather = Gather {
            link,
            wait: join.wait(),
            k: generator.k(),
            pass: 0,
            fed_at: Instant::now(),
            pass_wait: PASS_WAIT,
            decodable_at: None,
            got: BTreeMap::new(),
        };
        let part_floats = Stage::all(&cfg)
            .iter()
            .filter(|s| s.layer().is_some())
            .flat_map(|s| s.shapes(&cfg))
            .map(|(out, _)| generator.block_len(out) * generator.sub_blocks())
            .sum();
        let group = join.group(cfg.clone(), generator, gather)?;
        Ok(Self {
            cfg,
            group,
            forget: Vec::new(),
            part_floats,
        })
    }

    /// One forward pass of one sequence (number 0) through the group: the logits it asks
    /// for, row after row.
    pub async fn forward(&mut self, pass: Pass<'_>) -> Result<Vec<f32>, ModelError> {
        let mut out = self.forward_batch(&[HopSeq { seq: 0, pass }]).await?;
        out.pop()
            .ok_or_else(|| ModelError::Config("no logits".into()))
    }

    /// One forward pass of a batch of sequences through the group: each sequence's logits,
    /// row after row, in the batch's order.
    pub async fn forward_batch(
        &mut self,
        seqs: &[HopSeq<'_>],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let rows = self.group.nodes().to_vec();
        let forget = std::mem::take(&mut self.forget);
        let tokens: usize = seqs.iter().map(|s| s.pass.tokens.len()).sum();
        // Each member sends every other its part of every stage, four bytes a value.
        let sent = tokens * self.part_floats * 4 * rows.len().saturating_sub(1);
        let gather = self.group.transport_mut();
        gather.pass += 1;
        gather.got.clear();
        gather.fed_at = Instant::now();
        gather.pass_wait = PASS_WAIT + at_min_rate(sent);
        gather.decodable_at = None;
        let feed = Feed {
            pass: gather.pass,
            seqs: seqs
                .iter()
                .map(|s| FeedSeq {
                    seq: s.seq,
                    start: s.pass.start as u32,
                    tokens: s.pass.tokens.to_vec(),
                    logits: s.pass.logits as u32,
                })
                .collect(),
            forget,
            rows: rows.iter().map(|&r| r as u32).collect(),
        };
        for row in rows {
            gather.link.feed(row, &feed);
        }
        // The LM head's input lives on the members; the leader only decodes their answers.
        let wanted: Vec<usize> = seqs
            .iter()
            .map(|s| s.pass.logits.clamp(1, s.pass.tokens.len().max(1)))
            .collect();
        let total: usize = wanted.iter().sum();
        let x = vec![0.0; total * self.cfg.hidden];
        let mut out = self.group.linear(Stage::LmHead, &x, total).await?;
        let all = out
            .pop()
            .ok_or_else(|| ModelError::Config("no logits".into()))?;
        let vocab = self.cfg.vocab;
        if all.len() != total * vocab {
            return Err(ModelError::Config(format!(
                "the LM head gave {} values, not {total} rows of {vocab}",
                all.len()
            )));
        }
        let mut at = 0;
        Ok(wanted
            .iter()
            .map(|&w| {
                let rows = all[at * vocab..(at + w) * vocab].to_vec();
                at += w;
                rows
            })
            .collect())
    }

    /// Tells the members, with the next pass, that `seq` is done: they forget it.
    pub fn forget(&mut self, seq: u64) {
        self.forget.push(seq);
    }

    /// Counters of the leader's decoding (LM head rounds, caught members).
    pub fn stats(&self) -> &ExecStats {
        self.group.stats()
    }

    /// Clears the counters.
    pub fn reset_stats(&mut self) {
        self.group.reset_stats();
    }

    /// The members still in the group (one that failed is left out).
    pub fn rows(&self) -> &[usize] {
        self.group.nodes()
    }
}

#[cfg(test)]
mod tests;
