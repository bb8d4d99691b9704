//! Checking a group's answers against the code (DESIGN.md §4): with `k + r` answers, the `r`
//! beyond the `k` decoded must equal their prediction from the decoded result. The residual is
//! `max|z − ẑ| / max|z|` over the answer; the threshold scales with the decoding group's
//! condition number, from the f32 noise measured on honest groups (docs/verification.md).

use serde::{Deserialize, Serialize};

/// How a leader checks answers.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct VerifyConfig {
    /// Answers beyond the k decoded (`r`): 0 turns checking off, 1 detects, 2 also locates.
    pub extra: usize,
    /// Residual allowed per unit of condition number (the threshold is `noise · κ`).
    pub noise: f64,
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
        }
    }
}

impl VerifyConfig {
    /// The residual above which answers disagree, for a decoding group of condition `kappa`.
    pub fn threshold(&self, kappa: f64) -> f64 {
        self.noise * kappa.max(1.0)
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

/// `max|actual − predicted| / max|actual|` (∞ when the answer holds a non-finite value).
pub fn residual(actual: &[f32], predicted: &[f32]) -> f64 {
    let mut diff = 0.0f64;
    let mut scale = 0.0f64;
    for (&a, &p) in actual.iter().zip(predicted) {
        if !a.is_finite() {
            return f64::INFINITY;
        }
        diff = diff.max((a as f64 - p as f64).abs());
        scale = scale.max((a as f64).abs()).max((p as f64).abs());
    }
    if diff == 0.0 { 0.0 } else { diff / scale }
}

/// The largest honest residual per unit of condition number over `requests` single-token
/// forward passes through k + 1 members in process (rows rotated, tokens spread over the
/// vocabulary): the f32 noise floor a threshold must clear. The members come back.
pub fn measure_noise(
    cfg: &crate::model::LlamaConfig,
    norms: &crate::model::LeaderWeights,
    generator: &crate::code::Generator,
    mesh: super::InProcess,
    requests: usize,
) -> Result<(f64, super::InProcess), crate::model::ModelError> {
    let (n, k) = (generator.genesis_rows(), generator.k());
    let llama = crate::model::Llama::new(cfg.clone(), norms.clone())?;
    let mut worst = 0.0f64;
    let mut transport = Some(mesh);
    for i in 0..requests {
        let rows: Vec<usize> = (0..(k + 1).min(n)).map(|j| (i + j) % n).collect();
        let Some(t) = transport.take() else {
            break;
        };
        let mut group = super::CodedGroup::new(cfg.clone(), generator.clone(), &rows, t)
            .map_err(|e| crate::model::ModelError::Config(e.to_string()))?;
        group.set_verify(VerifyConfig {
            extra: 1,
            noise: 1.0,
        });
        let token = ((i as u64).wrapping_mul(0x9E37_79B9) % cfg.vocab as u64) as u32;
        llama.forward(&mut group, &[token], &mut crate::model::KvCache::new(cfg))?;
        worst = worst.max(group.stats().max_pass_ratio);
        transport = Some(group.into_transport());
    }
    let mesh = transport
        .ok_or_else(|| crate::model::ModelError::Config("lost the in-process members".into()))?;
    Ok((worst, mesh))
}
