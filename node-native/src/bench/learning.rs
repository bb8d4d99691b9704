//! `codedmesh bench --learning`: does the mesh learn what it is shown, and at what cost?
//!
//! In process (k rows of `up`'s shape, one coded group, every update applied by every row as
//! nodes apply it): a passage the model cannot know is taught N times, and the table shows its
//! perplexity before and after, the perplexity of held-out text of another kind, the canary
//! loss, what the canary gate decided, and the bytes of each update.

use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};
use node_core::code::select_nodes;
use node_core::coded::{CodedGroup, InProcess, ShardFormat};
use node_core::lead::{Publisher, Settled, settle};
use node_core::learn::{CANARY_TEXT, CanaryGate, Learner, Published, Teacher};
use node_core::mesh::LearningConfig;
use node_core::model::{LeaderWeights, Llama, LlamaConfig, ModelWeights, Soft, Tokenizer};

use crate::bench::{Row, row};

/// The passage taught: a made-up history no model has seen.
pub const TAUGHT: &str = include_str!("../../texts/taught.txt");
/// Held-out text of other kinds, never taught: eight passages apart by blank lines
/// (technical prose, a story, a dialogue, a recipe, science, a letter, local news, Python),
/// ~1,000 tokens in all.
pub const HELD_OUT: &str = include_str!("../../texts/heldout.txt");

/// What each of [`HELD_OUT`]'s passages is, in the file's order.
pub const HELD_OUT_KINDS: [&str; 8] = [
    "technical",
    "story",
    "dialogue",
    "recipe",
    "science",
    "letter",
    "news",
    "code",
];

/// [`HELD_OUT`]'s passages.
pub(crate) fn held_out_texts() -> impl Iterator<Item = &'static str> {
    HELD_OUT
        .split("\n\n")
        .map(str::trim)
        .filter(|p| !p.is_empty())
}

/// The held-out passages as a tokenizer cuts them, each measured alone.
#[derive(Debug, Clone)]
pub struct HeldOut(Vec<Vec<u32>>);

impl HeldOut {
    /// [`HELD_OUT`]'s passages as `tokenizer` cuts them, each at most as long as a training
    /// pass of the model `cfg` describes takes.
    pub fn new(tokenizer: &Tokenizer, cfg: &LlamaConfig) -> Result<Self> {
        let max = cfg.max_seq.min(node_core::learn::MAX_POSITIONS);
        let passages = held_out_texts()
            .map(|p| {
                let mut t = tokenizer.encode(p)?;
                t.truncate(max);
                ensure!(t.len() > 1, "a held-out passage predicts no token: {p:?}");
                Ok(t)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self(passages))
    }

    /// Each passage's mean loss a predicted token on `room`'s model as it is now, in
    /// [`HELD_OUT_KINDS`]' order.
    pub fn losses(&self, room: &mut Classroom) -> Result<Vec<f64>> {
        self.0.iter().map(|p| room.loss(p)).collect()
    }

    /// The mean loss a predicted token of all passages, from each one's `losses`.
    pub fn mean(&self, losses: &[f64]) -> f64 {
        let predicted = |p: &Vec<u32>| (p.len() - 1) as f64;
        let sum: f64 = self
            .0
            .iter()
            .zip(losses)
            .map(|(p, l)| l * predicted(p))
            .sum();
        sum / self.0.iter().map(predicted).sum::<f64>()
    }

    /// Their mean loss a predicted token on `room`'s model as it is now.
    pub fn loss(&self, room: &mut Classroom) -> Result<f64> {
        let losses = self.losses(room)?;
        Ok(self.mean(&losses))
    }
}

/// Garbage a poisoner sends over and over.
pub const GARBAGE: &str = include_str!("../../texts/garbage.txt");

/// Perplexity from a mean loss in nats.
fn ppl(loss: f64) -> f64 {
    loss.exp()
}

/// What one in-process teaching run measured.
#[derive(Debug, Clone)]
pub struct Taught {
    /// Loss of the taught text before and after.
    pub taught: (f64, f64),
    /// Loss of the held-out text before and after.
    pub held_out: (f64, f64),
    /// Canary loss before and after.
    pub canary: (f64, f64),
    /// Updates published (passed the gate) and refused.
    pub published: usize,
    /// Updates the gate refused.
    pub refused: usize,
    /// Mean bytes of an update on the wire.
    pub update_bytes: usize,
    /// Seconds per exposure (gradient, step, gate and apply).
    pub seconds_per_exposure: f64,
}

/// An in-process mesh that learns: `k` of `n` rows of one coded group, the leader's norm
/// gains, and a teacher whose updates go through the canary gate and into every row as nodes
/// take them.
#[derive(Debug)]
pub struct Classroom {
    cfg: node_core::model::LlamaConfig,
    learning: LearningConfig,
    format: ShardFormat,
    group: CodedGroup<InProcess>,
    norms: LeaderWeights,
    teacher: Teacher,
    version: [u8; 32],
    /// Updates published, refused, and the bytes of those published.
    published: usize,
    refused: usize,
    bytes: usize,
}

impl Classroom {
    /// `weights` coded into `n` rows of `format`, `k` of them computing, learning with
    /// `learning`; `gate` judges every update (`None`: every update is taken).
    pub fn new(
        weights: &ModelWeights,
        format: ShardFormat,
        (n, k): (usize, usize),
        learning: LearningConfig,
        gate: Option<CanaryGate>,
    ) -> Result<Self> {
        let cfg = weights.cfg.clone();
        let g = format.code(n, k)?;
        let mesh = InProcess::encode(weights, &g, format, &|_, _| {})?;
        let nodes = select_nodes(&g, &(0..n).collect::<Vec<_>>())?.nodes;
        let group = CodedGroup::new(cfg.clone(), g, &nodes, mesh)?;
        let learner = Learner::new(learning, cfg.clone(), format);
        Ok(Self {
            norms: LeaderWeights::from_model(weights),
            teacher: Teacher::new(learner, gate, format),
            cfg,
            learning,
            format,
            group,
            version: Shelf::version(0),
            published: 0,
            refused: 0,
            bytes: 0,
        })
    }

    /// The leader of the model as the rows hold it now.
    fn llama(&self) -> Result<Llama> {
        Ok(Llama::new(self.cfg.clone(), self.norms.clone())?)
    }

    /// The same classroom's trainer rehearsing `window` tokens of `tokens` a minibatch
    /// ([`Teacher::with_rehearsal`]), distilled where `distil` gives the next tokens' share
    /// ([`Teacher::distilling`]).
    pub fn rehearsing(mut self, tokens: Vec<u32>, window: usize, distil: Option<f32>) -> Self {
        self.teacher = self.teacher.with_rehearsal(tokens, window);
        if let Some(share) = distil {
            self.teacher = self.teacher.distilling(share);
        }
        self
    }

    /// Updates the rows took.
    pub fn published(&self) -> usize {
        self.published
    }

    /// Updates the gate refused.
    pub fn refused(&self) -> usize {
        self.refused
    }

    /// The mean loss of `tokens` on the model as it is now (nats per predicted token).
    pub fn loss(&mut self, tokens: &[u32]) -> Result<f64> {
        let llama = self.llama()?;
        Ok(futures::executor::block_on(
            llama.sequence_loss(&mut self.group, tokens),
        )?)
    }

    /// The `top` likeliest next tokens at each position of `tokens` but the first, with their
    /// probabilities, on the model as it is now.
    pub fn next_distributions(&mut self, tokens: &[u32], top: usize) -> Result<Soft> {
        let llama = self.llama()?;
        Ok(futures::executor::block_on(llama.next_distributions(
            &mut self.group,
            tokens,
            top,
        ))?)
    }

    /// The greedy completion of `prompt` (at most `max_tokens`, ending at `stop`).
    pub fn complete(
        &mut self,
        prompt: &[u32],
        max_tokens: usize,
        stop: &[u32],
    ) -> Result<Vec<u32>> {
        let llama = self.llama()?;
        let opts = node_core::model::GenerateOptions {
            max_tokens,
            sampling: node_core::model::SamplingParams::default(),
            stop_ids: stop.to_vec(),
            draft: 0,
        };
        let g = node_core::lead::generate(&llama, &mut self.group, prompt, &opts, &mut |_| true)?;
        Ok(g.tokens)
    }

    /// Trains on one minibatch (`seqs`, from `requests` requests): its loss before, and the
    /// gate's verdict on the update that fell due (taken by every row when it passed).
    pub fn lesson(
        &mut self,
        seqs: &[&[u32]],
        requests: usize,
    ) -> Result<(f64, Option<node_core::learn::Verdict>)> {
        let llama = self.llama()?;
        let studied = futures::executor::block_on(self.teacher.learn(
            &llama,
            &mut self.group,
            seqs,
            requests,
        ))?;
        let Some(p) = studied.due else {
            return Ok((studied.loss, None));
        };
        // The bench's rows take a passed update once the gate is done with the group.
        let mut shelf = Shelf {
            next: self.published as u64 + 1,
        };
        let settled = settle(
            &mut self.teacher,
            &llama,
            &mut self.group,
            self.version,
            p,
            &mut shelf,
        );
        match futures::executor::block_on(settled) {
            Settled::Published {
                sent: wire,
                verdict,
                ..
            } => {
                self.bytes += wire.len();
                let update = node_core::learn::Update::decode(&wire)?;
                update.validate_for(&self.cfg, &self.learning, self.format)?;
                for m in self.group.transport_mut().members_mut() {
                    m.learn(|s| update.apply_to_shards(s))
                        .context("a row taking the update")?;
                }
                update.apply_to_norms(&mut self.norms);
                self.published += 1;
                self.version = Shelf::version(self.published as u64);
                Ok((studied.loss, verdict))
            }
            Settled::Refused(_, verdict) => {
                self.refused += 1;
                Ok((studied.loss, Some(verdict)))
            }
            Settled::Unjudged(why) | Settled::Lost(why) => bail!("an update was lost: {why}"),
        }
    }
}

/// What a bench's trainer does beside training on what it is taught: whether the canary gate
/// judges its updates, positions of general text it rehearses a minibatch (0: none), and
/// whether it distils that text (the next tokens' share, [`Teacher::distilling`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Trainer {
    /// Whether every update goes through the canary gate before the rows take it.
    pub gated: bool,
    /// Positions of general text rehearsed a minibatch.
    pub rehearse: usize,
    /// The rehearsal's next tokens' share of each target, where it is distilled.
    pub distil: Option<f32>,
    /// Loss (nats) below which a next token is not taught ([`Teacher::with_floor`]).
    pub floor: f64,
    /// Which adapters move.
    pub trained: node_core::learn::Trained,
    /// Positions of earlier lessons taught again a minibatch ([`Teacher::with_replay`]).
    pub replay: usize,
    /// Share of its steps so far each published round takes back ([`Teacher::with_decay`]).
    pub decay: f32,
    /// Published rounds over which the outer rate halves ([`Teacher::with_anneal`]; 0: kept).
    pub anneal: u32,
    /// Agreement an entry's recent rounds need for its step to go out
    /// ([`Teacher::with_consensus`]; 0: every entry).
    pub consensus: f32,
    /// Verdicts the gate's floor is the lowest canary of ([`CanaryGate::with_window`]; 0: all).
    pub gate_window: usize,
}

impl Trainer {
    /// The trainer `up` runs ([`node_core::learn::Teacher::for_mesh`]): gated, rehearsing
    /// [`node_core::learn::REHEARSAL_TOKENS`] a minibatch, not distilled, moving the adapters
    /// of [`node_core::learn::Trained::MESH`], leaving untaught what is known within
    /// [`node_core::learn::KNOWN_NATS`].
    pub const AS_UP: Self = Self {
        gated: true,
        rehearse: node_core::learn::REHEARSAL_TOKENS,
        distil: None,
        floor: node_core::learn::KNOWN_NATS,
        trained: node_core::learn::Trained::MESH,
        replay: 0,
        decay: 0.0,
        anneal: 0,
        consensus: 0.0,
        gate_window: 0,
    };

    /// A classroom with this trainer: `room` gated by `canary` (tokens) as it says, rehearsing
    /// the mesh's text as `tokenizer` cuts it.
    pub fn room(
        &self,
        room: impl FnOnce(Option<CanaryGate>) -> Result<Classroom>,
        canary: &[u32],
        tokenizer: &Tokenizer,
    ) -> Result<Classroom> {
        let mut room = room(gate(canary, self.gated, self.gate_window))?.rehearsing(
            node_core::learn::rehearsal_tokens(tokenizer)?,
            self.rehearse,
            self.distil,
        );
        room.teacher = room
            .teacher
            .with_floor(self.floor)
            .training(self.trained)
            .with_replay(node_core::learn::REPLAY_LESSONS, self.replay)
            .with_decay(self.decay)
            .with_anneal(self.anneal)
            .with_consensus(self.consensus);
        Ok(room)
    }
}

/// Teaches `text` `exposures` times to an in-process mesh of `k` of `n` rows of `format`,
/// with `learning`, its trainer as `trainer` says.
#[allow(clippy::too_many_arguments)] // one measurement's whole set-up
pub fn teach_in_process(
    weights: &ModelWeights,
    tokenizer: &Tokenizer,
    format: ShardFormat,
    shape: (usize, usize),
    learning: LearningConfig,
    text: &str,
    exposures: usize,
    trainer: Trainer,
    mut each: impl FnMut(usize, f64, Option<&node_core::learn::Verdict>),
) -> Result<Taught> {
    let tokens = |s: &str| -> Result<Vec<u32>> {
        let mut t = tokenizer.encode(s.trim())?;
        t.truncate(weights.cfg.max_seq.min(node_core::learn::MAX_POSITIONS));
        Ok(t)
    };
    let (taught, canary) = (tokens(text)?, tokens(CANARY_TEXT)?);
    let held = HeldOut::new(tokenizer, &weights.cfg)?;
    let mut room = trainer.room(
        |gate| Classroom::new(weights, format, shape, learning, gate),
        &canary,
        tokenizer,
    )?;
    let losses = |room: &mut Classroom| -> Result<[f64; 3]> {
        Ok([room.loss(&taught)?, held.loss(room)?, room.loss(&canary)?])
    };
    let before = losses(&mut room)?;
    let started = Instant::now();
    for i in 0..exposures {
        let (loss, verdict) = room.lesson(&[&taught], 1)?;
        each(i, loss, verdict.as_ref());
    }
    let seconds = started.elapsed().as_secs_f64();
    let after = losses(&mut room)?;
    Ok(Taught {
        taught: (before[0], after[0]),
        held_out: (before[1], after[1]),
        canary: (before[2], after[2]),
        published: room.published,
        refused: room.refused,
        update_bytes: room.bytes / room.published.max(1),
        seconds_per_exposure: seconds / exposures.max(1) as f64,
    })
}

/// The canary gate a bench's mesh judges with, counting drift from the first loss it
/// measures (the model at the start); `gated` false measures without refusing.
pub(crate) fn gate(canary: &[u32], gated: bool, window: usize) -> Option<CanaryGate> {
    let gate = CanaryGate::new(canary.to_vec(), None).with_window(window);
    Some(if gated {
        gate
    } else {
        gate.with_bounds(f64::INFINITY, f64::INFINITY)
    })
}

/// The table rows of one teaching run.
pub fn taught_rows(what: &str, t: &Taught, exposures: usize) -> Vec<Row> {
    let change = |(a, b): (f64, f64)| {
        format!(
            "{:.2} → {:.2} ({:+.1}%)",
            ppl(a),
            ppl(b),
            100.0 * (ppl(b) / ppl(a) - 1.0)
        )
    };
    vec![
        row(
            format!("{what}: perplexity of the text sent, {exposures} exposures"),
            change(t.taught),
        ),
        row(
            format!("{what}: held-out perplexity (other text)"),
            change(t.held_out),
        ),
        row(
            format!("{what}: canary loss (nats)"),
            format!("{:.4} → {:.4}", t.canary.0, t.canary.1),
        ),
        row(
            format!("{what}: updates published / refused by the canary gate"),
            format!("{} / {}", t.published, t.refused),
        ),
        row(
            format!("{what}: bytes an update"),
            format!(
                "{} ({:.2} s an exposure)",
                t.update_bytes, t.seconds_per_exposure
            ),
        ),
    ]
}

/// The learning bench's [`Publisher`]: gives back an update's bytes for the bench's rows to
/// take, which moves them to the `next` version.
struct Shelf {
    next: u64,
}

impl Shelf {
    /// The bench's name for its rows' version after `published` updates.
    fn version(published: u64) -> [u8; 32] {
        let mut v = [0u8; 32];
        v[..8].copy_from_slice(&published.to_le_bytes());
        v
    }
}

impl Publisher for Shelf {
    type Sent = Vec<u8>;

    async fn publish(
        &mut self,
        p: Published,
        _: Option<node_core::learn::GateClaim>,
    ) -> Result<(Vec<u8>, Option<[u8; 32]>), String> {
        Ok((p.update.encode(), Some(Self::version(self.next))))
    }
}
