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

/// How fast a [`DraftPolicy`] forgets: the weight of an observation falls by this much with
/// each pass after it (a memory of about 50 passes).
const PASS_DECAY: f64 = 0.98;
/// The same for drafts offered (about 100 drafts).
const DRAFT_DECAY: f64 = 0.99;
/// Every this many passes a sequence may draft as much as it can, so that acceptance beyond
/// the current limit and the cost of wider passes are measured again.
const EXPLORE_EVERY: u64 = 32;
/// Passes of each width a policy needs before it trusts its fit of their cost.
const MIN_PASSES: f64 = 4.0;

/// Chooses how many drafted tokens a sequence checks in a pass: those whose chance of being
/// kept is worth the time their rows add to the pass.
///
/// It fits a pass's time as `a + b · rows` over recent passes and counts, for each draft
/// position `j`, how often a drafted `j`-th token was kept (`v_j`). A pass of `n` sequences
/// without drafts gives `n / (a + b·n)` tokens a second; one more drafted row raises that
/// when `v_j > b · n / (a + b·n)`. Where rows cost little beside the pass (a network's round
/// trips), every draft pays; where a row is a fifth of the pass (one machine's cores), only
/// drafts the text keeps often do. With no fit yet it drafts up to the maximum.
#[derive(Debug, Clone)]
pub struct DraftPolicy {
    max: usize,
    /// Per position (0 = the first drafted token): decayed counts offered and kept.
    offered: Vec<f64>,
    kept: Vec<f64>,
    /// Decayed sums of the passes: weight, rows, rows², seconds, rows × seconds.
    n: f64,
    r: f64,
    rr: f64,
    t: f64,
    rt: f64,
    /// Decayed weight of passes wider than one row a sequence (the slope's evidence).
    wide: f64,
    passes: u64,
}

impl DraftPolicy {
    /// A policy for drafts of at most `max` tokens.
    pub fn new(max: usize) -> Self {
        Self {
            max,
            offered: vec![0.0; max],
            kept: vec![0.0; max],
            n: 0.0,
            r: 0.0,
            rr: 0.0,
            t: 0.0,
            rt: 0.0,
            wide: 0.0,
            passes: 0,
        }
    }

    /// Records a decode pass of `sequences` sequences and `rows` rows that took `seconds`.
    pub fn record_pass(&mut self, sequences: usize, rows: usize, seconds: f64) {
        if !seconds.is_finite() || seconds <= 0.0 || rows == 0 {
            return;
        }
        let x = rows as f64;
        for s in [
            &mut self.n,
            &mut self.r,
            &mut self.rr,
            &mut self.t,
            &mut self.rt,
            &mut self.wide,
        ] {
            *s *= PASS_DECAY;
        }
        self.n += 1.0;
        self.r += x;
        self.rr += x * x;
        self.t += seconds;
        self.rt += x * seconds;
        if rows > sequences {
            self.wide += 1.0;
        }
        self.passes += 1;
    }

    /// Records a sequence's draft of `offered` tokens, of which the model kept `kept`.
    pub fn record_draft(&mut self, offered: usize, kept: usize) {
        if offered == 0 {
            return;
        }
        for j in 0..self.max {
            self.offered[j] *= DRAFT_DECAY;
            self.kept[j] *= DRAFT_DECAY;
        }
        for j in 0..offered.min(self.max) {
            self.offered[j] += 1.0;
            if j < kept {
                self.kept[j] += 1.0;
            }
        }
    }

    /// The fitted cost of a pass, `(a, b)` in seconds and seconds a row, once enough passes
    /// of different widths were seen.
    pub fn cost(&self) -> Option<(f64, f64)> {
        let spread = self.n * self.rr - self.r * self.r;
        if self.wide < MIN_PASSES || self.n - self.wide < MIN_PASSES || spread <= 0.0 {
            return None;
        }
        let b = (self.n * self.rt - self.r * self.t) / spread;
        let a = (self.t - b * self.r) / self.n;
        Some((a.max(0.0), b.max(0.0)))
    }

    /// The chance that a drafted token at `position` (0 = the first) is kept, once drafts
    /// that long were seen.
    pub fn kept_share(&self, position: usize) -> Option<f64> {
        let offered = *self.offered.get(position)?;
        (offered >= 1.0).then(|| self.kept[position] / offered)
    }

    /// The most drafted tokens a sequence should check in the next pass of `sequences`.
    pub fn limit(&self, sequences: usize) -> usize {
        if self.passes % EXPLORE_EVERY == EXPLORE_EVERY - 1 {
            return self.max;
        }
        let Some((a, b)) = self.cost() else {
            return self.max;
        };
        let n = sequences.max(1) as f64;
        let worth = b * n / (a + b * n);
        (0..self.max)
            .take_while(|&j| self.kept_share(j).is_none_or(|v| v > worth))
            .count()
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

    /// A policy that saw `passes` of one sequence alternating one row and `1 + 4` rows, each
    /// costing `a + b · rows`, and drafts kept with chances `kept` by position.
    fn trained(a: f64, b: f64, kept: [f64; 4]) -> DraftPolicy {
        let mut p = DraftPolicy::new(4);
        for i in 0..200 {
            let rows = if i % 2 == 0 { 1 } else { 5 };
            p.record_pass(1, rows, a + b * rows as f64);
            // Drafts of 4, the j-th kept in a share kept_j of them, spread evenly over time
            // (the golden ratio's multiples modulo 1).
            let u = (i as f64 * 0.618_033_988_75).fract();
            let k = (0..4).take_while(|&j| u < kept[j]).count();
            p.record_draft(4, k);
        }
        p
    }

    /// The limit outside the exploring passes.
    fn settled(p: &mut DraftPolicy) -> usize {
        if p.passes % EXPLORE_EVERY == EXPLORE_EVERY - 1 {
            p.record_pass(1, 1, 1.0);
        }
        p.limit(1)
    }

    #[test]
    fn the_fit_recovers_a_passes_cost_and_the_kept_shares() {
        let p = trained(0.010, 0.002, [0.6, 0.5, 0.3, 0.1]);
        let (a, b) = p.cost().unwrap();
        assert!(
            (a - 0.010).abs() < 1e-9 && (b - 0.002).abs() < 1e-9,
            "{a} {b}"
        );
        for (j, want) in [0.6, 0.5, 0.3, 0.1].into_iter().enumerate() {
            let got = p.kept_share(j).unwrap();
            assert!(
                (got - want).abs() < 0.02,
                "position {j}: {got} against {want}"
            );
        }
    }

    #[test]
    fn where_rows_cost_little_every_draft_pays_and_where_they_cost_much_only_likely_ones_do() {
        // A network: 10 ms a pass, 10 µs a row: even a draft kept one time in ten pays.
        assert_eq!(settled(&mut trained(0.010, 1e-5, [0.3, 0.2, 0.15, 0.1])), 4);
        // One machine: a row is a fifth of a one-row pass (b / (a + b) = 0.2).
        assert_eq!(settled(&mut trained(0.008, 0.002, [0.6, 0.5, 0.3, 0.1])), 3);
        assert_eq!(
            settled(&mut trained(0.008, 0.002, [0.3, 0.1, 0.05, 0.0])),
            1
        );
        assert_eq!(
            settled(&mut trained(0.008, 0.002, [0.1, 0.05, 0.0, 0.0])),
            0
        );
        // Rows that cost as much as the pass: nothing pays.
        assert_eq!(settled(&mut trained(0.0, 0.002, [0.9, 0.8, 0.7, 0.6])), 0);
    }

    #[test]
    fn a_wider_batch_raises_the_bar() {
        // b·n / (a + b·n): 0.2 for one sequence, 0.5 for four.
        let mut p = trained(0.008, 0.002, [0.4, 0.3, 0.25, 0.1]);
        assert_eq!(settled(&mut p), 3);
        assert_eq!(p.limit(4), 0);
    }

    #[test]
    fn without_evidence_it_drafts_the_most_and_it_explores_now_and_then() {
        let mut p = DraftPolicy::new(4);
        assert_eq!(p.limit(1), 4, "no passes yet");
        // Passes of one width only: the slope is unknown.
        for _ in 0..50 {
            p.record_pass(1, 1, 0.01);
        }
        assert_eq!(p.limit(1), 4);
        let mut p = trained(0.008, 0.002, [0.1, 0.0, 0.0, 0.0]);
        let limits: Vec<usize> = (0..EXPLORE_EVERY)
            .map(|_| {
                let l = p.limit(1);
                p.record_pass(1, 1, 0.01);
                l
            })
            .collect();
        assert_eq!(limits.iter().filter(|&&l| l == 4).count(), 1, "{limits:?}");
        assert_eq!(limits.iter().filter(|&&l| l == 0).count(), limits.len() - 1);
        // A policy for no drafts never drafts.
        assert_eq!(DraftPolicy::new(0).limit(1), 0);
    }

    #[test]
    fn bad_timings_are_ignored() {
        let mut p = trained(0.008, 0.002, [0.6, 0.5, 0.3, 0.1]);
        let before = p.cost();
        p.record_pass(1, 3, f64::NAN);
        p.record_pass(1, 3, -1.0);
        p.record_pass(1, 0, 0.5);
        assert_eq!(p.cost(), before);
    }
}
