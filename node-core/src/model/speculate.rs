//! Speculative decoding without a draft model: prompt lookup proposes the tokens that followed
//! the last few tokens where they occurred before in the text, one forward pass runs them all,
//! and the sampler keeps the longest prefix the model agrees with, plus one token of its own.
//!
//! With greedy decoding the output is the plain loop's, token for token. With sampling, a
//! drafted token `d` is kept with probability `p(d)` (the draft is a point mass, so this is
//! standard speculative sampling's `min(1, p/q)`), and otherwise the token is drawn from `p`
//! with `d` taken out: every token still comes from exactly the sampler's distribution.

use super::Sampler;

/// The longest n-gram matched when looking the text's tail up in the text.
const MAX_NGRAM: usize = 3;
/// The shortest: a single token's earlier successors predict too little to pay for a pass's
/// extra rows (`codedmesh bench --speculate`, docs/perf.md).
const MIN_NGRAM: usize = 2;

/// Drafts of at most this many tokens are proposed by default.
pub const DEFAULT_DRAFT: usize = 4;

/// What a drafted row costs, as a share of a pass of one token, until passes measure it: on
/// 2 cores over loopback a pass with 4 drafted rows took about 1.75 passes of one
/// (docs/perf-history.md, "Drafted decoding").
pub const DEFAULT_DRAFT_COST: f64 = 0.2;

/// How much one observation of a draft's fate weighs against those before it: a sequence's
/// drafts follow its text as it goes from prose (little to copy) to a passage it repeats.
const ACCEPT_MEMORY: f64 = 0.85;

/// A sequence's draft length, following how its drafts fare: the length that makes the most
/// tokens per unit of a pass's cost, given the chance that each drafted token is kept (after
/// the ones before it were) and what a drafted row costs. No drafts while they are seldom
/// kept; longer ones while they are.
///
/// Every pass tells something, drafted or not: the lookup's proposal is compared with the
/// tokens the pass emitted, so a sequence that stopped drafting still sees when its text
/// begins to repeat itself.
#[derive(Debug, Clone, PartialEq)]
pub struct DraftLength {
    max: usize,
    cost: f64,
    /// Decayed counts of proposed tokens the model agreed with, and of first disagreements.
    kept: f64,
    missed: f64,
}

impl DraftLength {
    /// Drafts of at most `max` tokens, each row costing `cost` of a pass until told otherwise.
    pub fn new(max: usize, cost: f64) -> Self {
        Self {
            max,
            cost,
            kept: 0.0,
            missed: 0.0,
        }
    }

    /// The chance that a proposed token is kept after those before it were: the decayed
    /// share, with half a token of either kind as the prior.
    pub fn acceptance(&self) -> f64 {
        (self.kept + 0.5) / (self.kept + self.missed + 1.0)
    }

    /// What a drafted row costs now, as a share of a pass.
    pub fn set_cost(&mut self, cost: f64) {
        self.cost = cost.clamp(0.0, 1.0);
    }

    /// How many of a proposal of `available` tokens the next pass should draft.
    pub fn length(&self, available: usize) -> usize {
        let p = self.acceptance();
        let (mut best, mut best_rate) = (0, 1.0);
        // Tokens a pass of d drafts emits on average: 1 + p + … + p^d.
        let (mut tokens, mut term) = (1.0, 1.0);
        for d in 1..=self.max.min(available) {
            term *= p;
            tokens += term;
            let rate = tokens / (1.0 + self.cost * d as f64);
            if rate > best_rate {
                (best, best_rate) = (d, rate);
            }
        }
        best
    }

    /// Learns from one pass: `proposal` is what the lookup offered before it (drafted or
    /// not), `emitted` the tokens the pass gave (the kept draft, then the model's own).
    pub fn observe(&mut self, proposal: &[u32], emitted: &[u32]) {
        for (p, e) in proposal.iter().zip(emitted) {
            self.kept *= ACCEPT_MEMORY;
            self.missed *= ACCEPT_MEMORY;
            if p == e {
                self.kept += 1.0;
            } else {
                self.missed += 1.0;
                return;
            }
        }
    }
}

/// What a drafted row costs as a share of a pass of one token, measured on the passes
/// themselves: the time of passes without drafts, and what each drafted row adds.
#[derive(Debug, Clone, Default)]
pub struct DraftCost {
    plain: Option<f64>,
    per_row: Option<f64>,
}

impl DraftCost {
    /// Takes a pass (or a batch's step) that ran `drafted` drafted rows in `seconds`.
    pub fn observe(&mut self, drafted: usize, seconds: f64) {
        let ema = |old: Option<f64>, new: f64| Some(old.map_or(new, |o| 0.8 * o + 0.2 * new));
        match (drafted, self.plain) {
            (0, _) => self.plain = ema(self.plain, seconds),
            (d, Some(plain)) => {
                self.per_row = ema(self.per_row, ((seconds - plain) / d as f64).max(0.0));
            }
            // No plain pass measured yet: nothing to compare with.
            (_, None) => {}
        }
    }

    /// The cost of a drafted row as a share of a plain pass, once both were measured.
    pub fn share(&self) -> Option<f64> {
        match (self.plain, self.per_row) {
            (Some(plain), Some(row)) if plain > 0.0 => Some((row / plain).clamp(0.0, 1.0)),
            _ => None,
        }
    }
}

/// Up to `max` tokens that followed the most recent earlier occurrence of the text's last
/// `n` tokens (the longest `2 ≤ n ≤ 3` that occurs); empty when none does.
pub fn draft(context: &[u32], max: usize) -> Vec<u32> {
    if max == 0 {
        return Vec::new();
    }
    for n in (MIN_NGRAM..=MAX_NGRAM.min(context.len().saturating_sub(1))).rev() {
        let tail = &context[context.len() - n..];
        // The most recent match that ends before the tail itself.
        let found = (0..context.len() - n)
            .rev()
            .find(|&i| &context[i..i + n] == tail);
        if let Some(i) = found {
            let from = i + n;
            let to = (from + max).min(context.len());
            return context[from..to].to_vec();
        }
    }
    Vec::new()
}

/// Checks `draft` against the model: `logits` holds `draft.len() + 1` rows of `vocab`, row `i`
/// the model's logits after the input's token `i` (the token before the draft, then each
/// drafted token). Returns the tokens to emit: the drafted tokens kept, then one the sampler
/// drew itself (so at least one).
pub fn accept(sampler: &mut Sampler, logits: &[f32], vocab: usize, draft: &[u32]) -> Vec<u32> {
    let mut out = Vec::with_capacity(draft.len() + 1);
    for (row, &d) in logits.chunks_exact(vocab).zip(draft) {
        match sampler.verify(row, d) {
            Ok(()) => out.push(d),
            Err(own) => {
                out.push(own);
                return out;
            }
        }
    }
    if let Some(row) = logits.chunks_exact(vocab).nth(draft.len()) {
        out.push(sampler.sample(row));
    }
    out
}

/// How well drafts did.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SpecStats {
    /// Tokens proposed.
    pub drafted: u64,
    /// Of those, kept.
    pub accepted: u64,
}

impl SpecStats {
    /// The share of drafted tokens kept.
    pub fn acceptance(&self) -> f64 {
        self.accepted as f64 / self.drafted.max(1) as f64
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

    use super::*;
    use crate::model::SamplingParams;

    #[test]
    fn a_draft_continues_the_latest_earlier_occurrence_of_the_tail() {
        // "a b c d e a b" → the tail "a b" occurred at 0: propose "c d e".
        let text = [1, 2, 3, 4, 5, 1, 2];
        assert_eq!(draft(&text, 3), vec![3, 4, 5]);
        assert_eq!(draft(&text, 10), vec![3, 4, 5, 1, 2]);
        // The latest occurrence wins, and the longest n-gram before shorter ones.
        assert_eq!(draft(&[7, 1, 9, 7, 1, 8, 7, 1], 1), vec![8]);
        assert_eq!(draft(&[5, 2, 6, 1, 2, 9, 1, 2], 2), vec![9, 1]);
        assert_eq!(draft(&[4, 1, 2, 3, 9, 1, 2, 3], 1), vec![9]);
        // A single token's earlier successor is not drafted.
        assert!(draft(&[1, 5, 6, 1], 2).is_empty());
        assert!(draft(&[1, 2, 3], 4).is_empty());
        assert!(draft(&[1], 4).is_empty());
        assert!(draft(&text, 0).is_empty());
    }

    fn one_hot(vocab: usize, at: &[u32]) -> Vec<f32> {
        at.iter()
            .flat_map(|&t| (0..vocab).map(move |i| if i as u32 == t { 5.0 } else { 0.0 }))
            .collect()
    }

    #[test]
    fn drafts_stop_after_misses_grow_while_kept_and_come_back_when_the_text_repeats() {
        let mut d = DraftLength::new(4, DEFAULT_DRAFT_COST);
        let start = d.length(4);
        assert!(
            (1..4).contains(&start),
            "a fresh sequence drafts a little: {start}"
        );
        // Prose: proposals the model never follows.
        for _ in 0..4 {
            d.observe(&[1, 2, 3], &[9]);
        }
        assert_eq!(d.length(4), 0, "no drafts after a run of misses");
        // The text begins to repeat a passage: undrafted passes still see the proposal agree
        // with the token the model gave, and drafting comes back, then lengthens.
        for _ in 0..3 {
            d.observe(&[5, 6], &[5]);
        }
        assert!(d.length(4) >= 1);
        for _ in 0..12 {
            d.observe(&[5, 6, 7, 8], &[5, 6, 7, 8, 1]);
        }
        assert_eq!(d.length(4), 4, "long drafts while they are kept");
        assert_eq!(d.length(2), 2, "never more than the proposal");
        // Where a drafted row costs nothing (a network's round trips dominate), any chance
        // of a kept token is worth a draft; where it costs a whole pass, none is.
        let mut free = DraftLength::new(4, 0.0);
        free.observe(&[1, 2], &[9]);
        assert_eq!(free.length(4), 4);
        free.set_cost(1.0);
        assert_eq!(free.length(4), 0);
    }

    #[test]
    fn the_cost_of_a_drafted_row_is_measured_against_plain_passes() {
        let mut c = DraftCost::default();
        c.observe(3, 1.3);
        assert_eq!(
            c.share(),
            None,
            "nothing to compare a drafted pass with yet"
        );
        c.observe(0, 1.0);
        c.observe(4, 1.4);
        let share = c.share().unwrap();
        assert!((share - 0.1).abs() < 1e-9, "{share}");
        // A pass slower than plain by less than nothing costs nothing, not less.
        let mut c = DraftCost::default();
        c.observe(0, 1.0);
        c.observe(2, 0.9);
        assert_eq!(c.share(), Some(0.0));
    }

    #[test]
    fn greedy_keeps_the_agreeing_prefix_and_adds_the_models_token() {
        let mut s = Sampler::new(SamplingParams::default()).unwrap();
        // The model would say 3, 4, 7, 1 after the four inputs.
        let logits = one_hot(10, &[3, 4, 7, 1]);
        assert_eq!(accept(&mut s, &logits, 10, &[3, 4, 5]), vec![3, 4, 7]);
        assert_eq!(accept(&mut s, &logits, 10, &[3, 4, 7]), vec![3, 4, 7, 1]);
        assert_eq!(accept(&mut s, &logits, 10, &[9, 4, 7]), vec![3]);
        assert_eq!(accept(&mut s, &logits[..10], 10, &[]), vec![3]);
    }

    #[test]
    fn speculative_sampling_draws_from_the_samplers_distribution() {
        // Whatever the draft, the first token emitted must follow softmax(logits / T): compare
        // the empirical frequencies over many seeds with the exact probabilities.
        let logits = [1.0f32, 0.2, -0.5, 0.8, 0.0];
        let t = 0.7;
        let weights: Vec<f64> = logits.iter().map(|&l| (l as f64 / t).exp()).collect();
        let total: f64 = weights.iter().sum();
        let p: Vec<f64> = weights.iter().map(|w| w / total).collect();
        let trials = 40_000;
        for drafted in [0u32, 2, 4] {
            let mut counts = [0usize; 5];
            for seed in 0..trials {
                let mut s = Sampler::new(SamplingParams {
                    temperature: t as f32,
                    top_p: 1.0,
                    seed,
                    ..SamplingParams::default()
                })
                .unwrap();
                let row = [logits.as_slice(), logits.as_slice()].concat();
                let out = accept(&mut s, &row, 5, &[drafted]);
                counts[out[0] as usize] += 1;
            }
            for (i, &c) in counts.iter().enumerate() {
                let f = c as f64 / trials as f64;
                // Five standard deviations of a binomial frequency.
                let tol = 5.0 * (p[i] * (1.0 - p[i]) / trials as f64).sqrt();
                assert!(
                    (f - p[i]).abs() < tol,
                    "draft {drafted}: token {i} drawn {f:.4}, expected {:.4}",
                    p[i]
                );
            }
        }
    }
}
