//! The mesh's learning settings, fixed at genesis as part of the model's identity.

use serde::{Deserialize, Serialize};

use crate::model::ModelError;

/// How a leader turns gradients into the updates it publishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Optimizer {
    /// Plain SGD on every coded weight (with accumulation and linear momentum): `lr` is the
    /// step and `clip` bounds each request's gradient norm.
    Sgd,
    /// Adam on the coded rank-16 adapters (`W + A·V`, `V` fixed), with its moments kept by the
    /// leader: `lr` is the most one update moves an adapter entry, in units of `V`'s unit rows
    /// (docs/coding.md, "Learning that learns").
    AdamAdapters,
}

/// The mesh's learning settings (fixed at genesis, part of the model's identity).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LearningConfig {
    /// Every request also trains the model.
    pub enabled: bool,
    /// How gradients become updates.
    pub optimizer: Optimizer,
    /// Learning rate: SGD's step, or the most an Adam step moves an adapter entry.
    pub lr: f32,
    /// Gradients are clipped to this norm.
    pub clip: f32,
    /// Rank each stage's update is compressed to, sent as f16; 0 sends exact f32 factors.
    pub rank: u32,
    /// Requests a leader folds into one update (DiLoCo's H; needs `rank > 0`).
    pub accumulate: u32,
    /// Linear outer momentum `β` of a leader's updates (needs `rank > 0`).
    pub momentum: f32,
    /// DiLoCo's inner steps: Adam steps a trainer takes over each minibatch, each through its
    /// group with the steps before it added, before it publishes their sum (Adam only).
    pub inner_steps: u32,
    /// DiLoCo's outer learning rate: the published update is this times the outer step.
    pub outer_lr: f32,
    /// DiLoCo's outer Nesterov momentum over a trainer's rounds (0: none).
    pub outer_momentum: f32,
}

/// Default rows a stage of an update carries: the adapters' rank, which Adam's updates need.
pub const DEFAULT_RANK: u32 = crate::coded::ADAPTER_RANK as u32;

/// Default rank an SGD update's factors are cut to (docs/perf.md: ≤ 1% of SmolLM2's bytes).
pub const DEFAULT_SGD_RANK: u32 = 8;

/// The default learning rate of [`Optimizer::AdamAdapters`] (docs/perf.md, "Learning").
pub const DEFAULT_ADAM_LR: f32 = 5e-4;

/// The learning rate of [`Optimizer::Sgd`] before issue 54 (kept for `--optimizer sgd`).
pub const DEFAULT_SGD_LR: f32 = 1e-4;

/// Most requests one update may fold together.
pub const MAX_ACCUMULATE: u32 = 64;

/// Most inner steps a trainer may take over one minibatch.
pub const MAX_INNER_STEPS: u32 = 32;

/// DiLoCo's default inner steps a minibatch (docs/coding.md, "DiLoCo in the mesh").
pub const DEFAULT_INNER_STEPS: u32 = 4;

/// DiLoCo's default outer learning rate.
pub const DEFAULT_OUTER_LR: f32 = 1.0;

/// DiLoCo's default outer Nesterov momentum.
pub const DEFAULT_OUTER_MOMENTUM: f32 = 0.5;

impl Default for LearningConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            optimizer: Optimizer::AdamAdapters,
            lr: DEFAULT_ADAM_LR,
            clip: 1.0,
            rank: DEFAULT_RANK,
            accumulate: 1,
            momentum: 0.0,
            inner_steps: DEFAULT_INNER_STEPS,
            outer_lr: DEFAULT_OUTER_LR,
            outer_momentum: DEFAULT_OUTER_MOMENTUM,
        }
    }
}

impl LearningConfig {
    /// The default settings of `optimizer` at `lr` (SGD runs no DiLoCo rounds).
    pub fn of(optimizer: Optimizer, lr: f32) -> Self {
        let mut cfg = Self {
            optimizer,
            lr,
            ..Self::default()
        };
        if optimizer == Optimizer::Sgd {
            cfg.rank = DEFAULT_SGD_RANK;
            cfg.inner_steps = 1;
            cfg.outer_momentum = 0.0;
        }
        cfg
    }

    /// Checks the ranges.
    pub fn validate(&self) -> Result<(), ModelError> {
        if !(self.lr.is_finite() && self.lr >= 0.0 && self.lr <= 1.0)
            || !(self.clip.is_finite() && self.clip > 0.0)
        {
            return Err(ModelError::Config(format!(
                "learning rate {} must be in [0, 1] and clip {} positive",
                self.lr, self.clip
            )));
        }
        if self.rank as usize > super::MAX_POSITIONS {
            return Err(ModelError::Config(format!(
                "rank {} exceeds {}",
                self.rank,
                super::MAX_POSITIONS
            )));
        }
        if !(1..=MAX_ACCUMULATE).contains(&self.accumulate)
            || !(self.momentum.is_finite() && (0.0..0.999).contains(&self.momentum))
        {
            return Err(ModelError::Config(format!(
                "accumulate {} must be in 1..={MAX_ACCUMULATE} and momentum {} in [0, 0.999)",
                self.accumulate, self.momentum
            )));
        }
        if self.optimizer == Optimizer::AdamAdapters
            && (self.momentum > 0.0 || (self.rank as usize) < crate::coded::ADAPTER_RANK)
        {
            return Err(ModelError::Config(format!(
                "Adam on the adapters keeps its own momentum (momentum {} must be 0) and sends \
                 {} rows a stage (rank {} must be at least that)",
                self.momentum,
                crate::coded::ADAPTER_RANK,
                self.rank
            )));
        }
        if !(1..=MAX_INNER_STEPS).contains(&self.inner_steps)
            || !(self.outer_lr.is_finite() && self.outer_lr > 0.0 && self.outer_lr <= 2.0)
            || !(self.outer_momentum.is_finite() && (0.0..0.99).contains(&self.outer_momentum))
        {
            return Err(ModelError::Config(format!(
                "inner steps {} must be in 1..={MAX_INNER_STEPS}, outer learning rate {} in \
                 (0, 2] and outer momentum {} in [0, 0.99)",
                self.inner_steps, self.outer_lr, self.outer_momentum
            )));
        }
        if self.diloco() && (self.optimizer != Optimizer::AdamAdapters || self.accumulate > 1) {
            return Err(ModelError::Config(
                "DiLoCo's inner and outer steps need Adam on the adapters, one minibatch a round \
                 (accumulate 1)"
                    .into(),
            ));
        }
        if self.rank == 0 && (self.accumulate > 1 || self.momentum > 0.0) {
            return Err(ModelError::Config(
                "accumulating requests and momentum need compressed updates (rank > 0)".into(),
            ));
        }
        Ok(())
    }

    /// How update factors travel on this mesh.
    pub fn precision(&self) -> super::Precision {
        if self.rank == 0 {
            super::Precision::F32
        } else {
            super::Precision::F16
        }
    }

    /// Whether a trainer runs DiLoCo's rounds (inner steps, then an outer step) rather than
    /// publishing each Adam step.
    pub fn diloco(&self) -> bool {
        self.inner_steps > 1 || self.outer_lr != 1.0 || self.outer_momentum > 0.0
    }

    /// How many times one Adam step's bound a published adapter update may move an entry:
    /// `H` inner steps, times the outer rate, times Nesterov's `1 / (1 − μ)` (docs/coding.md).
    pub fn adapter_reach(&self) -> f64 {
        f64::from(self.inner_steps.max(1)) * f64::from(self.outer_lr)
            / (1.0 - f64::from(self.outer_momentum))
    }

    /// Largest `step · ‖update‖` an update may have: `lr · clip` per request, times the
    /// requests folded in, times the momentum's geometric sum `1 / (1 − β)`.
    pub fn step_norm_bound(&self) -> f64 {
        self.lr as f64 * self.clip as f64 * self.accumulate.max(1) as f64
            / (1.0 - self.momentum as f64)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

    use super::*;

    #[test]
    fn diloco_settings_out_of_range_are_refused_and_the_reach_follows_them() {
        let ok = LearningConfig::default();
        ok.validate().unwrap();
        assert!(ok.diloco());
        // H steps, their outer step and its momentum: H · lr_out / (1 − μ).
        let reach = f64::from(DEFAULT_INNER_STEPS) * f64::from(DEFAULT_OUTER_LR)
            / (1.0 - f64::from(DEFAULT_OUTER_MOMENTUM));
        assert!((ok.adapter_reach() - reach).abs() < 1e-9);
        // What a manifest from a peer may claim is bounded before anything trusts it.
        for bad in [
            LearningConfig {
                inner_steps: 0,
                ..ok
            },
            LearningConfig {
                inner_steps: MAX_INNER_STEPS + 1,
                ..ok
            },
            LearningConfig {
                outer_lr: 0.0,
                ..ok
            },
            LearningConfig {
                outer_lr: 2.5,
                ..ok
            },
            LearningConfig {
                outer_lr: f32::NAN,
                ..ok
            },
            LearningConfig {
                outer_momentum: 0.99,
                ..ok
            },
            LearningConfig {
                outer_momentum: -0.1,
                ..ok
            },
            LearningConfig {
                accumulate: 2,
                ..ok
            },
            LearningConfig {
                inner_steps: 2,
                ..LearningConfig::of(Optimizer::Sgd, DEFAULT_SGD_LR)
            },
        ] {
            assert!(bad.validate().is_err(), "{bad:?} was taken");
        }
        // SGD runs no rounds; Nesterov's momentum widens what holders accept.
        assert!(!LearningConfig::of(Optimizer::Sgd, DEFAULT_SGD_LR).diloco());
        let nesterov = LearningConfig {
            inner_steps: 2,
            outer_lr: 0.5,
            outer_momentum: 0.5,
            ..ok
        };
        nesterov.validate().unwrap();
        assert!((nesterov.adapter_reach() - 2.0).abs() < 1e-12);
    }
}
