//! A hop group's leader: it feeds each pass's tokens to the members and decodes (and checks)
//! the logits from their LM head parts; a pass that fails on members is fed once more without
//! them.

use std::collections::BTreeMap;

use web_time::{Duration, Instant};

use super::{Fed, Feed, FeedSeq, Join, at_min_rate, in_order};
use crate::code::Generator;
use crate::coded::{CodedError, CodedGroup, ExecStats, Transport, TransportError};
use crate::model::{LinearExec, LlamaConfig, ModelError, Pass, Stage};

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
    /// Members that answered the current pass, or failed it.
    reported: std::collections::BTreeSet<usize>,
    /// Members that failed the current pass on their own (their stream, their compute, their
    /// silence to the leader).
    failed: std::collections::BTreeSet<usize>,
    /// How many members named each row as the one whose parts did not come.
    blamed: BTreeMap<usize, usize>,
}

impl<L: FeedLink> Gather<L> {
    /// Notes `row`'s failure of the current pass and the members it blamed for it: each once
    /// (a member naming another many times, or itself, counts as naming it once, or not).
    fn note_failure(&mut self, row: usize, silent: &[u32]) {
        if silent.is_empty() {
            self.failed.insert(row);
        }
        let named: std::collections::BTreeSet<usize> = (silent.iter().take(self.k * 4))
            .map(|&r| r as usize)
            .filter(|&r| r != row)
            .collect();
        for r in named {
            *self.blamed.entry(r).or_default() += 1;
        }
    }

    /// Takes the reports of `rows` still to come on the current pass, for at most the wait:
    /// until every member has answered, failed, or been named silent by another (a hung member
    /// is not waited for a second time).
    async fn settle(&mut self, rows: &[usize]) {
        let deadline = Instant::now() + self.wait;
        while (rows.iter()).any(|r| !self.reported.contains(r) && !self.blamed.contains_key(r)) {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.link.next(left).await {
                Some((row, fed)) if fed.pass == self.pass => {
                    self.reported.insert(row);
                    if fed.result.is_err() {
                        self.note_failure(row, &fed.silent);
                    }
                }
                Some(_) => {}
                None => return,
            }
        }
    }

    /// The members of `rows` that failed the current pass: those that failed on their own,
    /// and those the most members found silent.
    fn culprits(&self, rows: &[usize]) -> Vec<usize> {
        let most = rows
            .iter()
            .filter_map(|r| self.blamed.get(r))
            .max()
            .copied()
            .unwrap_or(0);
        rows.iter()
            .copied()
            .filter(|r| self.failed.contains(r) || (most > 0 && self.blamed.get(r) == Some(&most)))
            .collect()
    }
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
                Some((row, fed)) if fed.pass == self.pass => {
                    self.reported.insert(row);
                    match fed.result {
                        Ok(answer) if members.contains(&row) => {
                            self.got.entry(row).or_insert(answer);
                            if self.decodable_at.is_none() && self.got.len() >= self.k {
                                self.decodable_at = Some(Instant::now());
                            }
                        }
                        Ok(_) => {} // a member left out
                        Err(reason) => {
                            self.note_failure(row, &fed.silent);
                            if members.contains(&row) {
                                members.retain(|&r| r != row);
                                return Err(TransportError { node: row, reason });
                            }
                        }
                    }
                }
                Some(_) => {} // an earlier pass's answer come late
                None => {
                    self.failed.extend(
                        (members.iter())
                            .filter(|r| !self.got.contains_key(r) && !self.reported.contains(r)),
                    );
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
    /// Passes fed again without members that failed them.
    reruns: u64,
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
            reported: Default::default(),
            failed: Default::default(),
            blamed: BTreeMap::new(),
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
            reruns: 0,
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
    ///
    /// Members change only between passes, so that all decode the same rows: a pass that fails
    /// on members (one's parts did not come to another) is fed once more without them, where
    /// k remain.
    pub async fn forward_batch(
        &mut self,
        seqs: &[HopSeq<'_>],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let forget = std::mem::take(&mut self.forget);
        let rows = self.group.nodes().to_vec();
        let failed = match self.pass_once(seqs, &rows, &forget).await {
            Ok(out) => return Ok(out),
            Err(e) => e,
        };
        let gather = self.group.transport_mut();
        gather.settle(&rows).await;
        let out = gather.culprits(&rows);
        let left: Vec<usize> = rows.iter().copied().filter(|r| !out.contains(r)).collect();
        if out.is_empty() || left.len() < self.group.k() {
            return Err(failed);
        }
        tracing::info!(left_out = ?out, "a hop pass failed on members ({failed}): fed again without them");
        self.group
            .set_nodes(&left)
            .map_err(|e| ModelError::NoGroup(e.to_string()))?;
        self.reruns += 1;
        self.pass_once(seqs, &left, &forget).await
    }

    /// Passes fed again without members that failed them, since the group formed.
    pub fn reruns(&self) -> u64 {
        self.reruns
    }

    /// One feed of a pass to `rows`, the LM head's answers decoded.
    async fn pass_once(
        &mut self,
        seqs: &[HopSeq<'_>],
        rows: &[usize],
        forget: &[u64],
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let tokens: usize = seqs.iter().map(|s| s.pass.tokens.len()).sum();
        // Each member sends every other its part of every stage, four bytes a value.
        let sent = tokens * self.part_floats * 4 * rows.len().saturating_sub(1);
        let gather = self.group.transport_mut();
        gather.pass += 1;
        gather.got.clear();
        gather.fed_at = Instant::now();
        gather.pass_wait = PASS_WAIT + at_min_rate(sent);
        gather.decodable_at = None;
        gather.reported.clear();
        gather.failed.clear();
        gather.blamed.clear();
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
            forget: forget.to_vec(),
            rows: rows.iter().map(|&r| r as u32).collect(),
        };
        for &row in rows {
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
