//! What a request may ask beyond its tokens: each token's log-probability under the model's own
//! distribution (the log-softmax of the raw logits, before temperature, top-k, top-p, min-p or a
//! constraint cut it, as OpenAI's `logprobs` are), and a constraint on what may come next (a
//! grammar, a JSON schema) that masks the logits before sampling.

/// A token and its log-probability under the model's softmax over the raw logits, with the
/// likeliest tokens at that position.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    /// The token.
    pub token: u32,
    /// Its natural log-probability.
    pub logprob: f32,
    /// The likeliest tokens and their log-probabilities, likeliest first (ties by id).
    pub top: Vec<(u32, f32)>,
}

/// Most alternatives a position's [`TokenLogprob::top`] lists (OpenAI's `top_logprobs` bound).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// `token`'s log-probability in `row` (one position's raw logits) and the `top` likeliest
/// tokens' (at most [`MAX_TOP_LOGPROBS`]); non-finite logits count as impossible.
pub fn token_logprob(row: &[f32], token: u32, top: usize) -> TokenLogprob {
    let max = row
        .iter()
        .copied()
        .filter(|l| l.is_finite())
        .fold(f32::NEG_INFINITY, f32::max);
    let sum: f64 = row
        .iter()
        .filter(|l| l.is_finite())
        .map(|&l| (l as f64 - max as f64).exp())
        .sum();
    let lse = max as f64 + sum.ln();
    let lp = |l: f32| {
        if l.is_finite() {
            (l as f64 - lse) as f32
        } else {
            f32::NEG_INFINITY
        }
    };
    let logprob = row
        .get(token as usize)
        .map_or(f32::NEG_INFINITY, |&l| lp(l));
    let n = top.min(MAX_TOP_LOGPROBS).min(row.len());
    // The `n` largest, kept sorted while scanning: n is at most 20, the row a vocabulary.
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(n + 1);
    if n > 0 {
        for (i, &l) in row.iter().enumerate().filter(|(_, l)| l.is_finite()) {
            if best.len() == n && best.last().is_some_and(|b| l <= b.1) {
                continue;
            }
            let at = best.partition_point(|b| b.1 >= l);
            best.insert(at, (i as u32, l));
            best.truncate(n);
        }
    }
    TokenLogprob {
        token,
        logprob,
        top: best.into_iter().map(|(i, l)| (i, lp(l))).collect(),
    }
}

/// What a request's output must follow (a grammar, a JSON schema): which tokens may come next,
/// and each token taken. A constrained sequence drafts nothing.
pub trait TokenConstraint: Send + Sync + std::fmt::Debug {
    /// Sets the logit of every token that may not come next to −∞ in `row` (one position's
    /// logits); why not when it cannot say (no token may come, or its bounds were met).
    fn mask(&mut self, row: &mut [f32]) -> Result<(), String>;
    /// Takes the token chosen from the masked row: whether the output is now complete (only
    /// its end may follow), or why the token cannot be taken.
    fn commit(&mut self, token: u32) -> Result<bool, String>;
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// log-softmax of one row, in f64.
    pub(crate) fn log_softmax(row: &[f32]) -> Vec<f64> {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let lse = max
            + row
                .iter()
                .map(|&l| (l as f64 - max).exp())
                .sum::<f64>()
                .ln();
        row.iter().map(|&l| l as f64 - lse).collect()
    }

    #[test]
    fn a_tokens_logprob_is_the_log_softmax_and_the_top_ones_are_sorted() {
        let row = [1.0f32, 3.0, -2.0, 3.0, 0.5, 2.5];
        let exact = log_softmax(&row);
        let t = token_logprob(&row, 4, 3);
        assert!((t.logprob as f64 - exact[4]).abs() < 1e-6);
        // Ties in id order, likeliest first.
        let ids: Vec<u32> = t.top.iter().map(|x| x.0).collect();
        assert_eq!(ids, vec![1, 3, 5]);
        for (id, lp) in &t.top {
            assert!((*lp as f64 - exact[*id as usize]).abs() < 1e-6);
        }
        let probs: f64 = exact.iter().map(|l| l.exp()).sum();
        assert!((probs - 1.0).abs() < 1e-9);
        assert!(token_logprob(&row, 0, 0).top.is_empty());
        assert_eq!(token_logprob(&row, 0, 100).top.len(), row.len());
        // Out of the vocabulary, or masked away: impossible, not a panic.
        assert_eq!(token_logprob(&row, 99, 1).logprob, f32::NEG_INFINITY);
        let masked = [f32::NEG_INFINITY, 0.0];
        assert_eq!(token_logprob(&masked, 0, 2).top, vec![(1, 0.0)]);
    }
}
