//! `codedmesh bench --learning`: does the mesh learn what it is shown, and at what cost?
//!
//! In process (k rows of `up`'s shape, one coded group, every update applied by every row as
//! nodes apply it): a passage the model cannot know is taught N times, and the table shows its
//! perplexity before and after, the perplexity of held-out text of another kind, the canary
//! loss, what the canary gate decided, and the bytes of each update.

use std::time::Instant;

use anyhow::{Context, Result, bail};
use node_core::code::select_nodes;
use node_core::coded::{CodedGroup, InProcess, ShardFormat};
use node_core::lead::{Publisher, Settled, settle};
use node_core::learn::{CANARY_TEXT, CanaryGate, Learner, Published, Teacher};
use node_core::mesh::LearningConfig;
use node_core::model::{LeaderWeights, Llama, ModelWeights, Tokenizer};

use crate::bench::{Row, row};

/// The passage taught: a made-up history no model has seen.
pub const TAUGHT: &str = include_str!("../../texts/taught.txt");
/// Held-out text of another kind (technical prose), never taught.
pub const HELD_OUT: &str = include_str!("../../texts/heldout.txt");
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

/// Teaches `text` `exposures` times to an in-process mesh of `k` of `n` rows of `format`,
/// with `learning`; every update goes through the canary gate before the rows take it.
#[allow(clippy::too_many_arguments)] // one measurement's whole set-up
pub fn teach_in_process(
    weights: &ModelWeights,
    tokenizer: &Tokenizer,
    format: ShardFormat,
    (n, k): (usize, usize),
    learning: LearningConfig,
    text: &str,
    exposures: usize,
    gated: bool,
    mut each: impl FnMut(usize, f64, Option<&node_core::learn::Verdict>),
) -> Result<Taught> {
    let cfg = weights.cfg.clone();
    let g = format.code(n, k)?;
    let mesh = InProcess::encode(weights, &g, format, &|_, _| {})?;
    let nodes = select_nodes(&g, &(0..n).collect::<Vec<_>>())?.nodes;
    let mut group = CodedGroup::new(cfg.clone(), g, &nodes, mesh)?;
    let mut norms = LeaderWeights::from_model(weights);
    let tokens = |s: &str| -> Result<Vec<u32>> {
        let mut t = tokenizer.encode(s.trim())?;
        t.truncate(cfg.max_seq.min(node_core::learn::MAX_POSITIONS));
        Ok(t)
    };
    let (taught, held, canary) = (tokens(text)?, tokens(HELD_OUT)?, tokens(CANARY_TEXT)?);
    // The gate counts drift from the first loss it measures, as the model was at the start.
    let mut gate = CanaryGate::new(canary.clone(), None);
    if !gated {
        gate = gate.with_bounds(f64::INFINITY, f64::INFINITY);
    }
    let losses = |llama: &Llama, group: &mut CodedGroup<InProcess>| -> Result<[f64; 3]> {
        let mut l = [0.0; 3];
        for (out, t) in l.iter_mut().zip([&taught, &held, &canary]) {
            *out = futures::executor::block_on(llama.sequence_loss(group, t))?;
        }
        Ok(l)
    };
    let before = losses(&Llama::new(cfg.clone(), norms.clone())?, &mut group)?;
    let learner = Learner::new(learning, cfg.clone(), format);
    let mut teacher = Teacher::new(learner, Some(gate), format);
    let (mut published, mut refused, mut bytes) = (0usize, 0usize, 0usize);
    let mut version = Shelf::version(0);
    let started = Instant::now();
    for i in 0..exposures {
        let llama = Llama::new(cfg.clone(), norms.clone())?;
        let studied =
            futures::executor::block_on(teacher.learn(&llama, &mut group, &[&taught], 1))?;
        let loss = studied.loss;
        let Some(p) = studied.due else {
            each(i, loss, None);
            continue;
        };
        // The bench's rows take a passed update once the gate is done with the group.
        let mut shelf = Shelf {
            next: published as u64 + 1,
        };
        let settled = settle(&mut teacher, &llama, &mut group, version, p, &mut shelf);
        match futures::executor::block_on(settled) {
            Settled::Published {
                sent: wire,
                verdict,
                ..
            } => {
                each(i, loss, verdict.as_ref());
                bytes += wire.len();
                let update = node_core::learn::Update::decode(&wire)?;
                update.validate_for(&cfg, &learning, format)?;
                for m in group.transport_mut().members_mut() {
                    m.learn(|s| update.apply_to_shards(s))
                        .context("a row taking the update")?;
                }
                update.apply_to_norms(&mut norms);
                published += 1;
                version = Shelf::version(published as u64);
            }
            Settled::Refused(_, verdict) => {
                each(i, loss, Some(&verdict));
                refused += 1;
            }
            Settled::Unjudged(why) | Settled::Lost(why) => bail!("an update was lost: {why}"),
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let after = losses(&Llama::new(cfg.clone(), norms)?, &mut group)?;
    Ok(Taught {
        taught: (before[0], after[0]),
        held_out: (before[1], after[1]),
        canary: (before[2], after[2]),
        published,
        refused,
        update_bytes: bytes / published.max(1),
        seconds_per_exposure: seconds / exposures.max(1) as f64,
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
