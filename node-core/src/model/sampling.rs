//! Choosing the next token: greedy, or temperature with top-k, nucleus (top-p) and min-p
//! sampling from a seed; and the sampling a model's publisher recommends.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use super::ModelError;
use crate::gguf::{GgufError, GgufFile};

/// How to pick tokens from logits.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means greedy.
    pub temperature: f32,
    /// Nucleus mass in (0, 1]; 1 keeps every token.
    pub top_p: f32,
    /// Keeps only the `top_k` likeliest tokens; 0 keeps every token.
    pub top_k: u32,
    /// Drops the tokens less likely than this share of the likeliest one, in [0, 1]; 0 keeps
    /// every token.
    pub min_p: f32,
    /// Seed of the random stream.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Checks the ranges.
    pub fn validate(&self) -> Result<(), ModelError> {
        match out_of_range(self.temperature, self.top_p, self.min_p, f32::INFINITY) {
            Some((what, v, range)) => Err(ModelError::Sampling(format!(
                "{what} must be in {range}, got {v}"
            ))),
            None => Ok(()),
        }
    }
}

/// The first of these values out of its range, the temperature's up to `max_temperature`: its
/// name, the value and the range.
fn out_of_range(
    temperature: f32,
    top_p: f32,
    min_p: f32,
    max_temperature: f32,
) -> Option<(&'static str, f32, &'static str)> {
    if !(temperature.is_finite() && (0.0..=max_temperature).contains(&temperature)) {
        let range = if max_temperature.is_finite() {
            "[0, 2]"
        } else {
            "[0, ∞)"
        };
        return Some(("temperature", temperature, range));
    }
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Some(("top_p", top_p, "(0, 1]"));
    }
    if !(0.0..=1.0).contains(&min_p) {
        return Some(("min_p", min_p, "[0, 1]"));
    }
    None
}

/// The sampling a request gets for what it does not set: the model's publisher's
/// recommendation where its file or config gives one, else [`SamplingDefaults::LLAMA_SERVER`].
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SamplingDefaults {
    /// Softmax temperature; 0 means greedy.
    pub temperature: f32,
    /// Nucleus mass in (0, 1].
    pub top_p: f32,
    /// The likeliest tokens kept; 0 keeps every token.
    pub top_k: u32,
    /// The least share of the likeliest token's probability a token keeps.
    pub min_p: f32,
}

impl Default for SamplingDefaults {
    fn default() -> Self {
        Self::LLAMA_SERVER
    }
}

/// Most a recommended temperature may be (the API's own bound).
const MAX_TEMPERATURE: f32 = 2.0;

impl SamplingDefaults {
    /// llama.cpp's defaults (`llama-server`, `llama-cli`): what its users know.
    pub const LLAMA_SERVER: Self = Self {
        temperature: 0.8,
        top_p: 0.95,
        top_k: 40,
        min_p: 0.05,
    };

    /// The recommendation in a GGUF file's `general.sampling.*` keys (`temp`, `top_p`, `top_k`,
    /// `min_p`), each key it lacks from [`Self::LLAMA_SERVER`]; an error names a key whose value
    /// is of the wrong type or out of range.
    pub fn from_gguf(file: &GgufFile) -> Result<Self, ModelError> {
        let d = Self::LLAMA_SERVER;
        let float = |key: &str, or: f32| or_missing(file.get_f32(key), or);
        Self {
            temperature: float("general.sampling.temp", d.temperature)?,
            top_p: float("general.sampling.top_p", d.top_p)?,
            top_k: or_missing(file.get_u32("general.sampling.top_k"), d.top_k)?,
            min_p: float("general.sampling.min_p", d.min_p)?,
        }
        .checked("the file's general.sampling keys")
    }

    /// The recommendation in a Hugging Face `generation_config.json` (`temperature`, `top_p`,
    /// `top_k`, `min_p`), each field it lacks from [`Self::LLAMA_SERVER`]; greedy where it says
    /// `do_sample: false`.
    pub fn from_generation_config(json: &str) -> Result<Self, ModelError> {
        #[derive(Deserialize)]
        struct Config {
            do_sample: Option<bool>,
            temperature: Option<f32>,
            top_p: Option<f32>,
            top_k: Option<u32>,
            min_p: Option<f32>,
        }
        let c: Config = serde_json::from_str(json)
            .map_err(|e| ModelError::Config(format!("generation_config.json: {e}")))?;
        let d = Self::LLAMA_SERVER;
        let temperature = match c.do_sample {
            Some(false) => 0.0,
            _ => c.temperature.unwrap_or(d.temperature),
        };
        Self {
            temperature,
            top_p: c.top_p.unwrap_or(d.top_p),
            top_k: c.top_k.unwrap_or(d.top_k),
            min_p: c.min_p.unwrap_or(d.min_p),
        }
        .checked("generation_config.json")
    }

    /// `self` if every value is in range, else an error naming the first that is not and `from`.
    pub fn checked(self, from: &str) -> Result<Self, ModelError> {
        match out_of_range(self.temperature, self.top_p, self.min_p, MAX_TEMPERATURE) {
            Some((what, v, range)) => Err(ModelError::Config(format!(
                "{from}: the recommended {what} {v} is not in {range}"
            ))),
            None => Ok(self),
        }
    }
}

/// A value read from a GGUF file, or `or` where its key is missing.
fn or_missing<T>(read: Result<T, GgufError>, or: T) -> Result<T, ModelError> {
    match read {
        Err(GgufError::MissingKey(_)) => Ok(or),
        read => Ok(read?),
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

/// Fills `probs` with the tokens sampling may pick and their weights (unnormalised), cut as
/// Hugging Face's samplers cut them after the temperature: to the `top_k` likeliest, to the
/// nucleus of `top_p`, then to those at least `min_p` as likely as the likeliest. Every finite
/// token in id order when nothing cuts; else the kept ones, largest first where the nucleus was
/// cut (ties in id order). `false` for greedy, or when no logit is finite. Only what is cut is
/// sorted, not the vocabulary: that sort was most of a sampled token's time on the leader.
fn distribution(params: &SamplingParams, logits: &[f32], probs: &mut Vec<(u32, f64)>) -> bool {
    probs.clear();
    if params.temperature == 0.0 {
        return false;
    }
    let inv_t = 1.0 / params.temperature as f64;
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    // The likeliest token's weight is 1.
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
    let k = params.top_k as usize;
    if k > 0 && k < probs.len() {
        probs.select_nth_unstable_by(k - 1, likelier);
        probs.truncate(k);
    }
    if params.top_p < 1.0 {
        nucleus(probs, params.top_p as f64);
    }
    if params.min_p > 0.0 {
        let least = params.min_p as f64;
        probs.retain(|p| p.1 >= least);
    }
    true
}

/// The likelier of two weighted tokens first (ties in id order).
fn likelier(a: &(u32, f64), b: &(u32, f64)) -> std::cmp::Ordering {
    b.1.total_cmp(&a.1).then(a.0.cmp(&b.0))
}

/// Cuts `probs` to its nucleus of mass `top_p`, largest first.
fn nucleus(probs: &mut Vec<(u32, f64)>, top_p: f64) {
    let keep_mass = top_p * probs.iter().map(|p| p.1).sum::<f64>();
    let mut head = NUCLEUS_HEAD.min(probs.len());
    loop {
        if head < probs.len() {
            probs.select_nth_unstable_by(head - 1, likelier);
        }
        probs[..head].sort_unstable_by(likelier);
        let mut kept = 0.0;
        if let Some(cut) = probs[..head].iter().position(|p| {
            kept += p.1;
            kept >= keep_mass
        }) {
            probs.truncate(cut + 1);
            return;
        }
        if head == probs.len() {
            return;
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
            ..SamplingParams::default()
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
                    ..SamplingParams::default()
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
                ..SamplingParams::default()
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
                ..SamplingParams::default()
            };
            assert!(Sampler::new(params).is_err());
        }
    }

    /// The ids `distribution` keeps of `logits` under `params`, in id order.
    fn kept(params: SamplingParams, logits: &[f32]) -> Vec<u32> {
        let mut probs = Vec::new();
        assert!(distribution(&params, logits, &mut probs));
        let mut ids: Vec<u32> = probs.iter().map(|p| p.0).collect();
        ids.sort_unstable();
        ids
    }

    #[test]
    fn top_k_and_min_p_keep_the_likeliest_tokens_after_the_temperature() {
        // Token i has weight e^(−i/T).
        let logits: Vec<f32> = (0..100).map(|i| -(i as f32)).collect();
        let at = |temperature, top_k, min_p, top_p| {
            let params = SamplingParams {
                temperature,
                top_k,
                min_p,
                top_p,
                ..SamplingParams::default()
            };
            kept(params, &logits)
        };
        assert_eq!(at(1.0, 5, 0.0, 1.0), [0, 1, 2, 3, 4]);
        // e^−2 ≥ 0.1 > e^−3; at T = 2, e^−2 ≥ 0.1 > e^−2.5.
        assert_eq!(at(1.0, 0, 0.1, 1.0), [0, 1, 2]);
        assert_eq!(at(2.0, 0, 0.1, 1.0), [0, 1, 2, 3, 4]);
        assert_eq!(at(2.0, 3, 0.1, 1.0), [0, 1, 2]);
        // The nucleus of what top-k kept: 0.7 of 1 + e^−1 + e^−2 is past 1, within 1 + e^−1.
        assert_eq!(at(1.0, 3, 0.0, 0.7), [0, 1]);
        // Sampling draws only what is kept: top-k 1 is greedy at any temperature.
        let params = |top_k, min_p| SamplingParams {
            temperature: 1.5,
            top_k,
            min_p,
            seed: 3,
            ..SamplingParams::default()
        };
        let mut greedy = Sampler::new(params(1, 0.0)).unwrap();
        assert!((0..50).all(|_| greedy.sample(&logits) == 0));
        let mut floor = Sampler::new(params(0, 0.2)).unwrap();
        let drawn: Vec<u32> = (0..300).map(|_| floor.sample(&logits)).collect();
        // e^(−i/1.5) ≥ 0.2 for i ≤ 2.4.
        assert!(drawn.iter().all(|&t| t <= 2), "{drawn:?}");
        assert!(drawn.contains(&2), "min_p kept too little");
        assert!(Sampler::new(params(0, 1.5)).is_err());
        assert!(Sampler::new(params(0, f32::NAN)).is_err());
    }

    /// A GGUF file of metadata only: (key, GGUF value type, value bytes).
    fn gguf(kvs: &[(&str, u32, Vec<u8>)]) -> GgufFile {
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend(0u64.to_le_bytes());
        b.extend((kvs.len() as u64).to_le_bytes());
        for (key, ty, value) in kvs {
            b.extend((key.len() as u64).to_le_bytes());
            b.extend(key.as_bytes());
            b.extend(ty.to_le_bytes());
            b.extend(value);
        }
        GgufFile::parse(&b).unwrap()
    }

    #[test]
    fn the_recommended_sampling_is_the_models_else_llama_servers() {
        const F32: u32 = 6;
        const I32: u32 = 5;
        const STR: u32 = 8;
        let read = |kvs: &[(&str, u32, Vec<u8>)]| SamplingDefaults::from_gguf(&gguf(kvs));
        let server = SamplingDefaults::LLAMA_SERVER;
        assert_eq!(read(&[]).unwrap(), server);
        let temp = ("general.sampling.temp", F32, 0.6f32.to_le_bytes().to_vec());
        let top_k = ("general.sampling.top_k", I32, 20i32.to_le_bytes().to_vec());
        let want = SamplingDefaults {
            temperature: 0.6,
            top_k: 20,
            ..server
        };
        assert_eq!(read(&[temp, top_k]).unwrap(), want);
        // A value out of range, or of the wrong type: an error that names it.
        let hot = ("general.sampling.temp", F32, 7.0f32.to_le_bytes().to_vec());
        let e = read(&[hot]).unwrap_err().to_string();
        assert!(e.contains("temperature 7"), "{e}");
        let mut text = 4u64.to_le_bytes().to_vec();
        text.extend(b"high");
        let e = read(&[("general.sampling.top_p", STR, text)])
            .unwrap_err()
            .to_string();
        assert!(e.contains("general.sampling.top_p"), "{e}");
        // A Hugging Face directory's generation_config.json.
        let config = SamplingDefaults::from_generation_config;
        let g = config(r#"{"temperature": 0.2, "top_p": 0.9, "eos_token_id": 2}"#).unwrap();
        assert_eq!(
            g,
            SamplingDefaults {
                temperature: 0.2,
                top_p: 0.9,
                ..server
            }
        );
        let plain = config(r#"{"do_sample": false, "temperature": 0.6}"#).unwrap();
        assert_eq!(plain.temperature, 0.0);
        assert!(config("[1, 2]").is_err());
        let e = config(r#"{"top_p": 0}"#).unwrap_err().to_string();
        assert!(e.contains("top_p 0"), "{e}");
    }
}
