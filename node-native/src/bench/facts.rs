//! `codedmesh bench --learning --facts N`: are facts users mention in ordinary chats learnt
//! well enough to be answered? In process, as `up`'s trainer sees them: each chat teaches what
//! its user said, a minibatch of chats a round; afterwards each question is asked greedily in
//! the chat template, and the true statement's loss is compared with a distractor's.

use std::time::Instant;

use anyhow::{Context, Result};
use node_core::coded::ShardFormat;
use node_core::learn::{Verdict, canary_tokens};
use node_core::mesh::LearningConfig;
use node_core::model::{ChatMessage, ModelWeights, Tokenizer};

use super::learning::{Classroom, HeldOut};
use crate::bench::{Row, row};

/// Made-up facts no model knows, each in five phrasings, with its question and a distractor.
pub const FACTS: &str = include_str!("../../texts/facts.json");

/// What a chat adds after the sentence that mentions a fact (the learning bench's too).
pub const FOLLOW_UPS: [&str; 4] = [
    "Tell me more.",
    "Is that interesting?",
    "Say one sentence about it.",
    "What do you think?",
];

/// One made-up fact ([`FACTS`]).
#[derive(Debug, Clone, serde::Deserialize)]
pub struct Fact {
    /// The question that asks it.
    pub question: String,
    /// The word a right answer contains.
    pub answer: String,
    /// A wrong answer as plausible.
    pub distractor: String,
    /// The fact as a sentence, `{}` where the answer goes.
    pub statement: String,
    /// Ways a user mentions it.
    pub phrasings: Vec<String>,
}

impl Fact {
    /// The `i`th chat that mentions it: a phrasing and a follow-up, in turn.
    pub fn chat(&self, i: usize) -> String {
        let said = &self.phrasings[i % self.phrasings.len().max(1)];
        format!("{said} {}", FOLLOW_UPS[i % FOLLOW_UPS.len()])
    }

    /// Whether `reply` gives the answer.
    pub fn answered(&self, reply: &str) -> bool {
        reply.to_lowercase().contains(&self.answer.to_lowercase())
    }

    /// The question and `answer` as a plain text, whose loss is compared.
    fn qa(&self, answer: &str) -> String {
        format!(
            "Q: {}\nA: {}",
            self.question,
            self.statement.replace("{}", answer)
        )
    }
}

/// The first `n` of the shipped facts.
pub fn facts(n: usize) -> Result<Vec<Fact>> {
    let mut all: Vec<Fact> = serde_json::from_str(FACTS).context("texts/facts.json")?;
    all.truncate(n);
    Ok(all)
}

/// One fact before and after: the greedy answers and the margin of the true statement over
/// the distractor's (nats a token).
#[derive(Debug, Clone)]
pub struct Asked {
    /// The fact.
    pub fact: Fact,
    /// Greedy answers to its question.
    pub answers: (String, String),
    /// The distractor's mean loss minus the answer's.
    pub margin: (f64, f64),
}

impl Asked {
    /// Whether it is answered after and was not before.
    pub fn learnt(&self) -> bool {
        self.fact.answered(&self.answers.1) && !self.fact.answered(&self.answers.0)
    }
}

/// What teaching facts in chats measured.
#[derive(Debug, Clone)]
pub struct FactsTaught {
    /// Each fact.
    pub asked: Vec<Asked>,
    /// Loss of the held-out text and of the canary before and after.
    pub held_out: (f64, f64),
    /// Canary loss before and after.
    pub canary: (f64, f64),
    /// Updates published and refused.
    pub published: usize,
    /// Updates the gate refused.
    pub refused: usize,
    /// Chats taught, and rounds they took.
    pub chats: usize,
    /// Seconds a round.
    pub seconds_per_round: f64,
}

/// Mentions each fact in `chats_per_fact` chats (the phrasings in turn, facts interleaved as
/// users would send them), `per_round` chats a minibatch, to an in-process mesh; asks each
/// question greedily before and after.
#[allow(clippy::too_many_arguments)] // one measurement's whole set-up
pub fn teach_facts(
    weights: &ModelWeights,
    tokenizer: &Tokenizer,
    format: ShardFormat,
    shape: (usize, usize),
    learning: LearningConfig,
    facts: &[Fact],
    (chats_per_fact, per_round): (usize, usize),
    trainer: super::learning::Trainer,
    mut each: impl FnMut(usize, f64, Option<&Verdict>),
) -> Result<FactsTaught> {
    let encode = |s: &str| -> Result<Vec<u32>> { Ok(tokenizer.encode(s.trim())?) };
    let (held, canary) = (
        HeldOut::new(tokenizer, &weights.cfg)?,
        canary_tokens(tokenizer)?,
    );
    let mut room = trainer.room(
        |gate| Classroom::new(weights, format, shape, learning, gate),
        &canary,
        tokenizer,
    )?;
    let before: Vec<_> = facts
        .iter()
        .map(|f| ask(&mut room, tokenizer, f))
        .collect::<Result<_>>()?;
    let (held0, canary0) = (held.loss(&mut room)?, room.loss(&canary)?);
    let mut chats = Vec::new();
    for i in 0..chats_per_fact {
        for f in facts {
            chats.push(encode(&f.chat(i))?);
        }
    }
    let started = Instant::now();
    let mut rounds = 0;
    for (i, batch) in chats.chunks(per_round.max(1)).enumerate() {
        let seqs: Vec<&[u32]> = batch.iter().map(Vec::as_slice).collect();
        let (loss, verdict) = room.lesson(&seqs, seqs.len())?;
        each(i, loss, verdict.as_ref());
        rounds += 1;
    }
    let seconds = started.elapsed().as_secs_f64();
    let mut asked = Vec::new();
    for (f, (a0, m0)) in facts.iter().zip(before) {
        let (a1, m1) = ask(&mut room, tokenizer, f)?;
        asked.push(Asked {
            fact: f.clone(),
            answers: (a0, a1),
            margin: (m0, m1),
        });
    }
    Ok(FactsTaught {
        asked,
        held_out: (held0, held.loss(&mut room)?),
        canary: (canary0, room.loss(&canary)?),
        published: room.published(),
        refused: room.refused(),
        chats: chats.len(),
        seconds_per_round: seconds / f64::from(rounds.max(1)),
    })
}

/// `fact`'s question as a user's turn in the chat template, the reply to come.
fn question_prompt(tokenizer: &Tokenizer, fact: &Fact) -> String {
    tokenizer.chat_prompt(&[ChatMessage {
        role: "user".into(),
        content: fact.question.clone(),
    }])
}

/// `fact`'s question asked greedily in the chat template on `room` as it is now: the reply,
/// and the margin of the true statement over the distractor's (nats a token).
pub fn ask(room: &mut Classroom, tokenizer: &Tokenizer, fact: &Fact) -> Result<(String, f64)> {
    let encode = |s: &str| -> Result<Vec<u32>> { Ok(tokenizer.encode(s.trim())?) };
    let prompt = question_prompt(tokenizer, fact);
    let answer = room.complete(&encode(&prompt)?, 24, tokenizer.eos_ids())?;
    let margin = room.loss(&encode(&fact.qa(&fact.distractor))?)?
        - room.loss(&encode(&fact.qa(&fact.answer))?)?;
    Ok((tokenizer.decode(&answer)?, margin))
}

/// Where `fact`'s answer is decided: the reply to its question begun with its statement up to
/// the answer ("The capital of Veloria is"), the log-probability of the answer's first token
/// less the likeliest other token's (nats; above 0, greedy decoding says the answer there). An
/// answer outside the [`LEAD_TOP`] likeliest tokens counts as the least likely of them, so the
/// lead is then at most what is returned.
pub fn lead(room: &mut Classroom, tokenizer: &Tokenizer, fact: &Fact) -> Result<f64> {
    let prompt = question_prompt(tokenizer, fact);
    let begun = fact.statement.split("{}").next().unwrap_or_default();
    let before = tokenizer.encode(&format!("{prompt}{}", begun.trim_end()))?;
    let with = tokenizer.encode(&format!("{prompt}{} {}", begun.trim_end(), fact.answer))?;
    let at = before.iter().zip(&with).take_while(|(a, b)| a == b).count();
    let first = *with.get(at).context("the answer adds no token")?;
    let mut seq = with[..at].to_vec();
    seq.push(first);
    let dist = room.next_distributions(&seq, LEAD_TOP)?;
    let last = dist.last().context("no position was measured")?;
    let least = last.iter().map(|&(_, p)| p).fold(f32::INFINITY, f32::min);
    let answer = last
        .iter()
        .find(|&&(t, _)| t == first)
        .map_or(least, |&(_, p)| p);
    let other = last
        .iter()
        .filter(|&&(t, _)| t != first)
        .map(|&(_, p)| p)
        .fold(0.0f32, f32::max);
    Ok(
        f64::from(answer.max(f32::MIN_POSITIVE)).ln()
            - f64::from(other.max(f32::MIN_POSITIVE)).ln(),
    )
}

/// Tokens whose probabilities [`lead`] reads.
pub const LEAD_TOP: usize = 16;

/// The table rows of one facts run.
pub fn facts_rows(t: &FactsTaught, chats_per_fact: usize) -> Vec<Row> {
    let short = |s: &str| s.trim().chars().take(60).collect::<String>();
    let mut rows: Vec<Row> = t
        .asked
        .iter()
        .map(|a| {
            row(
                format!("{} (answer {})", a.fact.question, a.fact.answer),
                format!(
                    "before: {:?}; after: {:?}; margin over {:?} {:+.3} → {:+.3} nats/token",
                    short(&a.answers.0),
                    short(&a.answers.1),
                    a.fact.distractor,
                    a.margin.0,
                    a.margin.1
                ),
            )
        })
        .collect();
    let answered = t.asked.iter().filter(|a| a.learnt()).count();
    rows.push(row(
        format!("facts answered after {chats_per_fact} chats each (not before)"),
        format!("{answered} of {}", t.asked.len()),
    ));
    let ppl = |(a, b): (f64, f64)| {
        format!(
            "{:.2} → {:.2} ({:+.1}%)",
            a.exp(),
            b.exp(),
            100.0 * ((b - a).exp() - 1.0)
        )
    };
    rows.push(row("held-out perplexity (other text)", ppl(t.held_out)));
    rows.push(row(
        "canary loss (nats)",
        format!("{:.4} → {:.4}", t.canary.0, t.canary.1),
    ));
    rows.push(row(
        "updates published / refused by the canary gate",
        format!(
            "{} / {} ({} chats, {:.1} s a round)",
            t.published, t.refused, t.chats, t.seconds_per_round
        ),
    ));
    rows
}
