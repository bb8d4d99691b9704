//! Checking a group's answers against the code (DESIGN.md §4): with `k + r` answers, the `r`
//! beyond the `k` decoded must equal their prediction from the decoded result. The residual is
//! `max|z − ẑ| / max|z|` over the answer; the threshold scales with the decoding group's
//! condition number, from the f32 noise measured on honest groups (docs/verification.md).

use serde::{Deserialize, Serialize};

use crate::code::CodeError;
use crate::compute::cpu::dot_f64;

/// How a leader checks answers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VerifyConfig {
    /// Answers beyond the k decoded (`r`): 0 turns checking off, 1 detects, 2 also locates.
    pub extra: usize,
    /// Residual allowed per unit of condition number (the threshold is `noise · κ`).
    pub noise: f64,
    /// With `extra` 1: check a forward round against secret projections of the check row
    /// instead of asking it for its answer (docs/verification.md, "Projected checks").
    pub project: bool,
}

/// Honest residual per unit of condition number for SmolLM2 in f32 (1.9e-6, the largest over
/// 20 single-token requests of 122 rounds), times a margin of 5; a mesh measures its own at
/// genesis with [`measure_noise`] (docs/verification.md).
pub const DEFAULT_NOISE: f64 = 1e-5;

/// How far above the largest honest residual measured the threshold sits.
pub const NOISE_MARGIN: f64 = 10.0;

impl Default for VerifyConfig {
    fn default() -> Self {
        Self {
            extra: 1,
            noise: DEFAULT_NOISE,
            project: false,
        }
    }
}

impl VerifyConfig {
    /// The residual above which answers disagree, for a decoding group of condition `kappa`.
    pub fn threshold(&self, kappa: f64) -> f64 {
        self.noise * kappa.max(1.0)
    }

    /// The Freivalds residual ([`transpose_residual`]) above which a member's answer to a
    /// backward round is wrong, for a prediction decoded with condition `kappa`: the forward
    /// threshold, times `terms / inp` when the member's transposed product sums more `terms`
    /// per value than a forward product of the stage does (`inp`; the LM head's sums 16384
    /// terms for SmolLM2 with k = 3, its forward product 576). The worst-case f32 rounding of
    /// a sum grows with its length. Its typical growth, the square root, was the factor first:
    /// a served mesh convicted an honest member on the LM head's backward step at 1.43 times
    /// that threshold (docs/verification.md).
    pub fn backward_threshold(&self, kappa: f64, terms: usize, inp: usize) -> f64 {
        let longer = terms.max(inp) as f64 / inp.max(1) as f64;
        self.threshold(kappa) * longer
    }
}

/// A member caught answering against the code, with the evidence.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Caught {
    /// Its row.
    pub node: usize,
    /// The step it was caught on.
    pub step: String,
    /// Its residual when checked against the other members.
    pub residual: f64,
    /// The threshold it exceeded.
    pub threshold: f64,
    /// The rows whose answers agreed without it.
    #[serde(deserialize_with = "crate::protocol::bounded::numbers")]
    pub witnesses: Vec<usize>,
    /// When its answers miss a learning update it claims: the update's id and the share
    /// missed; `residual` and `threshold` are then the fit's significance and the bar, in
    /// standard deviations.
    #[serde(default)]
    pub missing_update: Option<(u64, f64)>,
}

impl std::fmt::Display for Caught {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Self {
            node,
            step,
            residual,
            threshold,
            witnesses,
            missing_update,
        } = self;
        match missing_update {
            Some((id, share)) => write!(
                f,
                "row {node} caught on {step}: its answers miss {:.0}% of update {id:016x} ({residual:.1} σ > {threshold:.0} σ); rows {witnesses:?} agree without it",
                100.0 * share
            ),
            None => write!(
                f,
                "row {node} caught on {step}: residual {residual:.2e} > threshold {threshold:.2e}; rows {witnesses:?} agree without it"
            ),
        }
    }
}

/// `max|actual − predicted|` relative to the largest of `floor` and the values' magnitudes (∞
/// when the answer holds a non-finite value). `floor` is the round's decoded values' largest
/// magnitude ([`largest`]): an answer that is legitimately all zeros (a compact data row whose
/// integers round to 0 for the rows asked) is otherwise compared with the prediction's rounding
/// noise alone, and any noise over itself is 1.0: an honest mesh failed its first embedding
/// lookup that way.
pub fn residual(actual: &[f32], predicted: &[f32], floor: f64) -> f64 {
    let mut diff = 0.0f64;
    let mut scale = floor;
    for (&a, &p) in actual.iter().zip(predicted) {
        if !a.is_finite() {
            return f64::INFINITY;
        }
        diff = diff.max((a as f64 - p as f64).abs());
        scale = scale.max((a as f64).abs()).max((p as f64).abs());
    }
    if diff == 0.0 { 0.0 } else { diff / scale }
}

/// The largest magnitude of `v`: a round's scale, the floor of [`residual`].
pub fn largest(v: &[f32]) -> f64 {
    v.iter().fold(0.0f64, |m, x| m.max(f64::from(x.abs())))
}

/// `len` standard normal values (Box–Muller): the random input of a backward check.
pub(super) fn random_input(rng: &mut impl rand::Rng, len: usize) -> Vec<f32> {
    (0..len)
        .map(|_| {
            let radius = (-2.0 * (1.0 - rng.random::<f64>()).ln()).sqrt();
            (radius * (std::f64::consts::TAU * rng.random::<f64>()).cos()) as f32
        })
        .collect()
}

/// Freivalds' residual of one member's answer to a backward round, the largest over its tokens
/// τ of `|r·a[τ] − u[τ]·p| / (|r|·|a[τ]|/√in + |u[τ]|·|p|/√len)`: `r` the random input (`in`
/// values) drawn after the answer came, `a` the answer (`t × in`), `u` the member's input
/// (`[sub-block][matrix][token][row]`, `lens` rows per matrix and sub-block) and `p` its product
/// with `r` as predicted from the code (`[sub-block][matrix][row]`, `len` values). Each term of
/// the denominator is the typical size of a dot product with a random direction, so f32 noise
/// gives residuals like the forward check's; ∞ when the answer holds a non-finite value.
pub fn transpose_residual(
    r: &[f32],
    a: &[f32],
    u: &[f32],
    p: &[f32],
    lens: &[usize],
    t: usize,
) -> Result<f64, CodeError> {
    transpose_residuals(&[(r, p)], &[pair_norms(r, p)], a, u, lens, t)
}

/// `(|r|, |p|)` of a pair of [`transpose_residuals`], as it takes them.
pub fn pair_norms(r: &[f32], p: &[f32]) -> (f64, f64) {
    (dot_f64(r, r).sqrt(), dot_f64(p, p).sqrt())
}

/// The largest [`transpose_residual`] over pairs `(r, p)` that share the answer `a` and the
/// input `u`, as a projected check's directions do; `norms` holds each pair's `(|r|, |p|)`.
pub fn transpose_residuals(
    pairs: &[(&[f32], &[f32])],
    norms: &[(f64, f64)],
    a: &[f32],
    u: &[f32],
    lens: &[usize],
    t: usize,
) -> Result<f64, CodeError> {
    let per_sub: usize = lens.iter().sum();
    if norms.len() != pairs.len() {
        return Err(CodeError::Length {
            what: "norms of the directions",
            expected: pairs.len(),
            got: norms.len(),
        });
    }
    for &(r, p) in pairs {
        let m = p.len() / per_sub.max(1);
        for (what, expected, got) in [
            ("predicted product", m * per_sub, p.len()),
            ("backward input", m * t * per_sub, u.len()),
            ("backward answer", t * r.len(), a.len()),
        ] {
            if expected != got {
                return Err(CodeError::Length {
                    what,
                    expected,
                    got,
                });
            }
        }
    }
    if a.iter().any(|v| !v.is_finite()) {
        return Ok(f64::INFINITY);
    }
    let Some(&(r0, p0)) = pairs.first() else {
        return Ok(0.0);
    };
    let (r_dims, p_dims) = (
        (r0.len().max(1) as f64).sqrt(),
        (p0.len().max(1) as f64).sqrt(),
    );
    let mut up = vec![0.0f64; pairs.len()];
    let mut worst = 0.0f64;
    for (tok, a_tok) in a.chunks_exact(r0.len().max(1)).enumerate() {
        // u[τ]·p and |u[τ]|², matrix by matrix within each sub-block.
        up.fill(0.0);
        let mut uu = 0.0f64;
        for (sub, u_sub) in u.chunks_exact((t * per_sub).max(1)).enumerate() {
            let (mut u_at, mut p_at) = (0, sub * per_sub);
            for &l in lens {
                let u_row = &u_sub[u_at + tok * l..u_at + (tok + 1) * l];
                uu += dot_f64(u_row, u_row);
                for (sum, &(_, p)) in up.iter_mut().zip(pairs) {
                    *sum += dot_f64(u_row, &p[p_at..p_at + l]);
                }
                u_at += t * l;
                p_at += l;
            }
        }
        let a_norm = dot_f64(a_tok, a_tok).sqrt();
        for ((&(r, _), &(r_norm, p_norm)), &up) in pairs.iter().zip(norms).zip(&up) {
            let diff = (dot_f64(r, a_tok) - up).abs();
            if diff > 0.0 {
                let scale = r_norm * a_norm / r_dims + uu.sqrt() * p_norm / p_dims;
                worst = worst.max(diff / scale);
            }
        }
    }
    Ok(worst)
}

/// Tokens in each calibration request's prompt ([`measure_noise`]).
const CALIBRATION_PROMPT: usize = 8;
/// Single-token steps each calibration request takes after its prompt, on its KV cache.
const CALIBRATION_STEPS: usize = 3;

/// The largest honest residual per unit of condition number over `requests` requests through
/// k + 1 members in process: the f32 noise floor a threshold must clear. Each request is what
/// a served one is: a prompt of [`CALIBRATION_PROMPT`] tokens, then [`CALIBRATION_STEPS`]
/// single-token steps on its cache, on rows drawn at random in a random order (the order
/// decides which k answers are decoded and which is checked). Single tokens on an empty
/// cache through rows in a fixed order saw a tenth of the residuals served requests reach.
/// The members come back.
pub fn measure_noise(
    cfg: &crate::model::LlamaConfig,
    norms: &crate::model::LeaderWeights,
    generator: &crate::code::Generator,
    mesh: super::InProcess,
    requests: usize,
) -> Result<(f64, super::InProcess), crate::model::ModelError> {
    use rand::{Rng, SeedableRng};
    let (n, k) = (generator.genesis_rows(), generator.k());
    let llama = crate::model::Llama::new(cfg.clone(), norms.clone())?;
    // Seeded: the same mesh measures the same threshold.
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0x6e6f697365);
    let mut worst = 0.0f64;
    let mut transport = Some(mesh);
    for _ in 0..requests {
        let rows = rand::seq::index::sample(&mut rng, n, (k + 1).min(n)).into_vec();
        let Some(t) = transport.take() else {
            break;
        };
        let mut group = super::CodedGroup::new(cfg.clone(), generator.clone(), &rows, t)
            .map_err(|e| crate::model::ModelError::Config(e.to_string()))?;
        group.set_verify(VerifyConfig {
            extra: 1,
            noise: 1.0,
            project: false,
        });
        let mut token = || rng.random_range(0..cfg.vocab as u32);
        // A model with a shorter context gets a shorter request.
        let prompt = CALIBRATION_PROMPT.min(cfg.max_seq.saturating_sub(CALIBRATION_STEPS).max(1));
        let steps = CALIBRATION_STEPS.min(cfg.max_seq - prompt);
        let prompt: Vec<u32> = (0..prompt).map(|_| token()).collect();
        let mut cache = crate::model::KvCache::new(cfg);
        futures::executor::block_on(llama.forward(&mut group, &prompt, &mut cache))?;
        for _ in 0..steps {
            futures::executor::block_on(llama.forward(&mut group, &[token()], &mut cache))?;
        }
        worst = worst.max(group.stats().max_pass_ratio);
        transport = Some(group.into_transport());
    }
    let mesh = transport
        .ok_or_else(|| crate::model::ModelError::Config("lost the in-process members".into()))?;
    Ok((worst, mesh))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

    use rand::SeedableRng;

    use super::*;

    /// A member's transposed answer and its product with `r`, from explicit sub-blocks
    /// `s[sub][matrix]` (`lens[matrix] × inp`, row-major), in the layouts of a round.
    fn products(
        s: &[Vec<Vec<f32>>],
        lens: &[usize],
        inp: usize,
        u: &[f32],
        r: &[f32],
        t: usize,
    ) -> (Vec<f32>, Vec<f32>) {
        let (mut a, mut p) = (vec![0.0f32; t * inp], Vec::new());
        let per_sub: usize = lens.iter().sum();
        for (sub, mats) in s.iter().enumerate() {
            let mut u_at = sub * t * per_sub;
            for (mat, &l) in mats.iter().zip(lens) {
                for row in 0..l {
                    let w = &mat[row * inp..(row + 1) * inp];
                    p.push(w.iter().zip(r).map(|(a, b)| a * b).sum());
                    for tok in 0..t {
                        let coef = u[u_at + tok * l + row];
                        for (o, &x) in a[tok * inp..(tok + 1) * inp].iter_mut().zip(w) {
                            *o += coef * x;
                        }
                    }
                }
                u_at += t * l;
            }
        }
        (a, p)
    }

    #[test]
    fn an_answer_of_zeros_is_measured_against_the_rounds_scale() {
        // A data row whose integers are all 0 for the rows asked answers zeros; the prediction
        // from other rows carries their rounding. Over itself that is a residual of 1.
        let zeros = [0.0f32; 8];
        let noise = [1e-9f32, -2e-9, 0.0, 5e-10, 0.0, 0.0, 1e-9, 0.0];
        assert_eq!(residual(&zeros, &noise, 0.0), 1.0);
        assert!(residual(&zeros, &noise, 0.5) < 1e-8);
        // A wrong answer on that row is still far off the round's scale.
        let wrong = [0.3f32; 8];
        assert!(residual(&wrong, &noise, 0.5) > 0.5);
    }

    #[test]
    fn the_transpose_residual_follows_the_round_layout() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        let (lens, inp, t) = ([3usize, 1, 2], 7, 4);
        let s: Vec<Vec<Vec<f32>>> = (0..2)
            .map(|_| {
                lens.iter()
                    .map(|&l| random_input(&mut rng, l * inp))
                    .collect()
            })
            .collect();
        let u = random_input(&mut rng, 2 * t * lens.iter().sum::<usize>());
        let r = random_input(&mut rng, inp);
        let (a, p) = products(&s, &lens, inp, &u, &r, t);
        let honest = transpose_residual(&r, &a, &u, &p, &lens, t).unwrap();
        assert!(honest < 1e-6, "honest residual {honest:.2e}");
        // One token's answer 1e-3 off, a token whose input is zero, a non-finite value.
        let mut wrong = a.clone();
        wrong[2 * inp..3 * inp].iter_mut().for_each(|v| *v *= 1.001);
        let lie = transpose_residual(&r, &wrong, &u, &p, &lens, t).unwrap();
        assert!(lie > 100.0 * honest.max(1e-8), "lie {lie:.2e}");
        let mut zero_u = u.clone();
        let per_sub: usize = lens.iter().sum();
        for sub in 0..2 {
            let mut at = sub * t * per_sub;
            for &l in &lens {
                zero_u[at + l..at + 2 * l].iter_mut().for_each(|v| *v = 0.0);
                at += t * l;
            }
        }
        let (a0, _) = products(&s, &lens, inp, &zero_u, &r, t);
        assert!(a0[inp..2 * inp].iter().all(|&v| v == 0.0));
        assert!(transpose_residual(&r, &a0, &zero_u, &p, &lens, t).unwrap() < 1e-6);
        let mut garbage = a0;
        garbage[inp] = 1e-3;
        assert!(transpose_residual(&r, &garbage, &zero_u, &p, &lens, t).unwrap() > 1e-2);
        wrong[0] = f32::NAN;
        assert!(transpose_residual(&r, &wrong, &u, &p, &lens, t).unwrap() == f64::INFINITY);
        assert!(transpose_residual(&r, &a, &u[1..], &p, &lens, t).is_err());
        assert!(transpose_residual(&r, &a[1..], &u, &p, &lens, t).is_err());
        // Directions without their norms are refused, not read past.
        let pair: [(&[f32], &[f32]); 1] = [(&r, &p)];
        assert!(transpose_residuals(&pair, &[], &a, &u, &lens, t).is_err());
    }
}
