//! Choosing the next token: greedy, or temperature with nucleus (top-p) sampling from a seed.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use super::ModelError;

/// How to pick tokens from logits.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means greedy.
    pub temperature: f32,
    /// Nucleus mass in (0, 1]; 1 keeps every token.
    pub top_p: f32,
    /// Seed of the random stream.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Checks the ranges.
    pub fn validate(&self) -> Result<(), ModelError> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(ModelError::Sampling(format!(
                "temperature must be a finite number ≥ 0, got {}",
                self.temperature
            )));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(ModelError::Sampling(format!(
                "top_p must be in (0, 1], got {}",
                self.top_p
            )));
        }
        Ok(())
    }
}

/// A seeded token sampler.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha8Rng,
    /// The last distribution (kept: a vocabulary's worth of weights each token).
    probs: Vec<(u32, f64)>,
}

/// Tokens sorted first when cutting a nucleus; more (eight times as many each time) only when
/// these do not hold its mass.
const NUCLEUS_HEAD: usize = 64;

impl Sampler {
    /// A sampler with these parameters.
    pub fn new(params: SamplingParams) -> Result<Self, ModelError> {
        params.validate()?;
        Ok(Self {
            params,
            rng: ChaCha8Rng::seed_from_u64(params.seed),
            probs: Vec::new(),
        })
    }

    /// Picks a token id from a row of logits.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if !distribution(&self.params, logits, &mut self.probs) {
            return argmax(logits);
        }
        let probs = &self.probs;
        let kept: f64 = probs.iter().map(|p| p.1).sum();
        let r = self.rng.random::<f64>() * kept;
        draw(probs, r, None)
    }

    /// Whether the drafted token `draft` is kept as the next token ([`super::speculate`]):
    /// `Err` with the token drawn instead when it is not. Greedy keeps it when it is the
    /// largest logit; sampling keeps it with its probability and otherwise draws from the
    /// distribution without it, so the token is distributed exactly as [`Self::sample`]'s.
    pub fn verify(&mut self, logits: &[f32], draft: u32) -> Result<(), u32> {
        if !distribution(&self.params, logits, &mut self.probs) {
            let best = argmax(logits);
            return if best == draft { Ok(()) } else { Err(best) };
        }
        let probs = &self.probs;
        let kept: f64 = probs.iter().map(|p| p.1).sum();
        let mass = probs.iter().find(|p| p.0 == draft).map_or(0.0, |p| p.1);
        if self.rng.random::<f64>() * kept < mass {
            return Ok(());
        }
        let rest = kept - mass;
        let r = self.rng.random::<f64>() * rest;
        Err(draw(probs, r, Some(draft)))
    }
}

/// Fills `probs` with the tokens sampling may pick and their weights (unnormalised): every
/// finite token in id order when `top_p` is 1, else the nucleus, largest first (ties in id
/// order); `false` for greedy, or when no logit is finite. Only the nucleus is sorted, not the
/// vocabulary: that sort was most of a sampled token's time on the leader.
fn distribution(params: &SamplingParams, logits: &[f32], probs: &mut Vec<(u32, f64)>) -> bool {
    probs.clear();
    if params.temperature == 0.0 {
        return false;
    }
    let inv_t = 1.0 / params.temperature as f64;
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    probs.extend(
        logits
            .iter()
            .enumerate()
            .filter(|(_, l)| l.is_finite())
            .map(|(i, &l)| (i as u32, ((l as f64 - max) * inv_t).exp())),
    );
    if probs.is_empty() {
        return false;
    }
    if params.top_p >= 1.0 {
        return true;
    }
    let keep_mass = params.top_p as f64 * probs.iter().map(|p| p.1).sum::<f64>();
    let order = |a: &(u32, f64), b: &(u32, f64)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let mut head = NUCLEUS_HEAD.min(probs.len());
    loop {
        if head < probs.len() {
            probs.select_nth_unstable_by(head - 1, order);
        }
        probs[..head].sort_unstable_by(order);
        let mut kept = 0.0;
        if let Some(cut) = probs[..head].iter().position(|p| {
            kept += p.1;
            kept >= keep_mass
        }) {
            probs.truncate(cut + 1);
            return true;
        }
        if head == probs.len() {
            return true;
        }
        head = (head * 8).min(probs.len());
    }
}

/// The token at `r` along the weights of `probs` (without `skip`).
fn draw(probs: &[(u32, f64)], mut r: f64, skip: Option<u32>) -> u32 {
    let mut last = probs.first().map_or(0, |p| p.0);
    for &(id, p) in probs.iter().filter(|p| Some(p.0) != skip) {
        if r < p {
            return id;
        }
        r -= p;
        last = id;
    }
    last
}

/// Index of the largest finite logit (the first one on ties).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > best_v {
            best = i;
            best_v = v;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};

    use super::*;

    #[test]
    fn greedy_picks_the_largest() {
        let mut s = Sampler::new(SamplingParams::default()).unwrap();
        assert_eq!(s.sample(&[0.1, 3.0, -1.0, 2.9]), 1);
    }

    #[test]
    fn same_seed_same_tokens_and_top_p_restricts() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let params = SamplingParams {
            temperature: 1.0,
            top_p: 0.9,
            seed: 7,
        };
        let mut a = Sampler::new(params).unwrap();
        let mut b = Sampler::new(params).unwrap();
        let xs: Vec<u32> = (0..200).map(|_| a.sample(&logits)).collect();
        let ys: Vec<u32> = (0..200).map(|_| b.sample(&logits)).collect();
        assert_eq!(xs, ys);
        // Distinct values appear (it is not greedy), all within the top tokens.
        let mut distinct = xs.clone();
        distinct.sort();
        distinct.dedup();
        assert!(distinct.len() > 3);
        let tiny = Sampler::new(SamplingParams {
            top_p: 1e-6,
            ..params
        });
        let mut tiny = tiny.unwrap();
        for _ in 0..20 {
            assert_eq!(tiny.sample(&logits), argmax(&logits));
        }
    }

    /// The nucleus by sorting the whole vocabulary, as the sampler once did.
    fn sorted_nucleus(logits: &[f32], temperature: f32, top_p: f32) -> Vec<(u32, f64)> {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let mut probs: Vec<(u32, f64)> = logits
            .iter()
            .enumerate()
            .filter(|(_, l)| l.is_finite())
            .map(|(i, &l)| {
                (
                    i as u32,
                    ((l as f64 - max) * (1.0 / temperature as f64)).exp(),
                )
            })
            .collect();
        probs.sort_by(|a, b| b.1.total_cmp(&a.1));
        let keep_mass = top_p as f64 * probs.iter().map(|p| p.1).sum::<f64>();
        let mut kept = 0.0;
        let cut = probs
            .iter()
            .position(|p| {
                kept += p.1;
                kept >= keep_mass
            })
            .map_or(probs.len(), |c| c + 1);
        probs.truncate(cut);
        probs
    }

    #[test]
    fn the_nucleus_is_the_one_a_whole_sort_gives() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        // A peaked vocabulary (the nucleus within the first tokens sorted), a flat one (it
        // needs far more), ties, and logits that are not finite.
        let peaked: Vec<f32> = (0..5000).map(|_| rng.random_range(-8.0f32..8.0)).collect();
        let flat: Vec<f32> = (0..5000).map(|_| rng.random_range(-0.1f32..0.1)).collect();
        let mut tied = vec![1.0f32; 300];
        tied[7] = f32::NAN;
        tied[9] = f32::NEG_INFINITY;
        tied[200] = 2.0;
        for logits in [&peaked, &flat, &tied] {
            for (temperature, top_p) in [(0.7, 0.9), (1.0, 0.5), (1.3, 0.99), (0.2, 1e-3)] {
                let params = SamplingParams {
                    temperature,
                    top_p,
                    seed: 0,
                };
                let mut probs = Vec::new();
                assert!(distribution(&params, logits, &mut probs));
                let want = sorted_nucleus(logits, temperature, top_p);
                let ids = |p: &[(u32, f64)]| p.iter().map(|p| p.0).collect::<Vec<_>>();
                assert_eq!(ids(&probs), ids(&want), "t {temperature}, top_p {top_p}");
            }
            // top_p 1: every finite token, with its weight, in id order.
            let params = SamplingParams {
                temperature: 0.7,
                top_p: 1.0,
                seed: 0,
            };
            let mut probs = Vec::new();
            assert!(distribution(&params, logits, &mut probs));
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let want: Vec<(u32, f64)> = logits
                .iter()
                .enumerate()
                .filter(|(_, l)| l.is_finite())
                .map(|(i, &l)| (i as u32, ((l as f64 - max) * (1.0 / 0.7f32 as f64)).exp()))
                .collect();
            assert_eq!(probs, want);
        }
    }

    #[test]
    fn bad_params_are_rejected() {
        for (t, p) in [(-1.0, 1.0), (f32::NAN, 1.0), (1.0, 0.0), (1.0, 1.5)] {
            let params = SamplingParams {
                temperature: t,
                top_p: p,
                seed: 0,
            };
            assert!(Sampler::new(params).is_err());
        }
    }
}
