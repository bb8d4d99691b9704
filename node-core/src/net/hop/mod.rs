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
use crate::model::{BatchItem, KvCache, Llama, LlamaConfig, ModelError, Stage};
use crate::protocol::{self, StepRequest};

/// Name of the hop protocol; the version is part of it. (2: the receiver of every stream
/// writes [`crate::net::session::ACCEPTED`] first;
/// 3: a pass carries a batch of sequences;
/// 4: a member that misses a part fails the pass and names the silent rows in its [`Fed`].)
pub const HOP_PROTOCOL: &str = "/codedmesh/hop/4";

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
    /// The members whose parts this member missed, which failed its pass (none when it failed
    /// on its own, or answered).
    #[serde(deserialize_with = "crate::protocol::bounded::numbers")]
    pub silent: Vec<u32>,
}

impl Fed {
    /// A member's answer to `pass`: its part, or its error and the members that caused it.
    pub fn of(pass: u64, result: Result<Vec<u8>, HopError>) -> Self {
        let silent = match &result {
            Err(HopError::Silent { rows, .. }) => rows.clone(),
            _ => Vec::new(),
        };
        Self {
            pass,
            result: result.map_err(|e| e.to_string()),
            silent,
        }
    }

    /// A failure of the member's stream (no answer from the member itself).
    pub fn failed(pass: u64, why: String) -> Self {
        Self {
            pass,
            result: Err(why),
            silent: Vec::new(),
        }
    }
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
    /// Parts of these members did not come: the pass fails here rather than decode from other
    /// rows than the rest of the group.
    #[error("no part from rows {rows:?}: {why}")]
    Silent {
        /// The rows whose parts are missing.
        rows: Vec<u32>,
        /// Why they are missing.
        why: String,
    },
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
    /// Members the leader no longer feeds: every member leaves them out alike.
    unfed: std::collections::BTreeSet<usize>,
    /// Members heard leaving (their streams ended) while still fed.
    gone: std::collections::BTreeSet<usize>,
    /// Fed members whose parts of this pass did not come, and why: the pass has failed here.
    silent: Option<(Vec<usize>, String)>,
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
            unfed: Default::default(),
            gone: Default::default(),
            silent: None,
            dropped: Vec::new(),
        }
    }

    fn start_pass(&mut self, pass: u64, rows: &[u32]) {
        let fed: Vec<usize> = rows.iter().map(|&r| r as usize).collect();
        self.unfed
            .extend(self.rows.iter().filter(|r| !fed.contains(r)).copied());
        self.silent = None;
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
        if let Some((rows, why)) = &self.silent {
            // The pass has failed here: no round of it decodes.
            return Err(TransportError {
                node: rows.first().copied().unwrap_or(usize::MAX),
                reason: why.clone(),
            });
        }
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
            // The leader left a member out of this pass, as every member knows alike.
            if let Some(gone) = members.iter().copied().find(|r| self.unfed.contains(r)) {
                members.retain(|&r| r != gone);
                let reason = "left the group".to_string();
                self.dropped.push((gone, reason.clone()));
                return Err(TransportError { node: gone, reason });
            }
            // A fed member's part is missing: the others may have it, so leaving it out here
            // would decode from other rows than they do. The pass fails instead, naming it, and
            // the leader feeds it again without the member.
            let missing: Vec<usize> = (members.iter().copied())
                .filter(|r| !self.got.contains_key(r))
                .collect();
            let left: Vec<usize> = (missing.iter().copied())
                .filter(|r| self.gone.contains(r))
                .collect();
            if !left.is_empty() {
                return Err(self.fail(left, "left the group mid-pass".into()));
            }
            let wait = deadline.saturating_duration_since(Instant::now());
            match self.link.next(wait).await {
                Some(Heard::Part(part)) => self.take(part),
                Some(Heard::Gone(row)) => {
                    self.gone.insert(row);
                }
                None => {
                    let why = format!(
                        "no part of round {} within {:?}",
                        self.round, self.round_wait
                    );
                    return Err(self.fail(missing, why));
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

impl<L> Exchange<L> {
    /// Fails this pass here: `rows`' parts did not come, for `why`.
    fn fail(&mut self, rows: Vec<usize>, why: String) -> TransportError {
        let node = rows.first().copied().unwrap_or(usize::MAX);
        self.silent = Some((rows, why.clone()));
        TransportError { node, reason: why }
    }
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
        if let Some((rows, why)) = self.group.transport_mut().silent.take() {
            let rows = rows.iter().map(|&r| r as u32).collect();
            return Err(HopError::Silent { rows, why });
        }
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

mod leader;
pub use leader::{FeedLink, HopLeader, HopSeq, PASS_WAIT};

#[cfg(test)]
mod tests;
