//! Catching members that claim learning updates they do not hold (docs/verification.md).
//!
//! A shard missing one small update differs from the codeword by far less than the f32 noise
//! the residual check must allow, so that check cannot see it. But the update is public: for a
//! round's input the leader computes what the update adds to each member's answer, `e_i`, and
//! how a member missing it would shift the residual, `s_i = −R(e_i)` (`R` maps the answers to
//! the residual of the extra ones). The residuals of every round are then fitted, for
//! each member alone and by weighted least squares over rounds, as `res ≈ β_i · s_i`. An honest
//! group gives `β ≈ 0`; a member that misses the update gives `β_i ≈ 1`, and the significance
//! `β_i / sd(β_i)` grows with the square root of the number of values compared, so a shift far
//! below the noise of one value stands out after a few rounds (a matched filter).

use std::sync::Arc;

use crate::model::{LlamaConfig, Stage};
use crate::update::Update;

/// Significance, in standard deviations of the fit, at which a member is taken to miss an
/// update (honest fits stay within a few; docs/verification.md has the measured largest).
pub const PROBE_SIGMAS: f64 = 10.0;

/// Smallest share of an update a member must miss (or hold twice) to be caught: keeps a tiny
/// correlation between noise and an update, significant over many values, from counting.
pub const PROBE_MIN_FIT: f64 = 0.5;

/// A hypothesis stops being tested once a missing update would show at this significance.
const CLEAR_SIGMAS: f64 = 4.0 * PROBE_SIGMAS;

/// Learning updates a leader checks its group's members against, with the evidence so far.
#[derive(Debug, Clone)]
pub struct UpdateProbe {
    updates: Vec<Probed>,
    n: usize,
}

/// One update under test: the sums of each row's fit, over rows `0..n`.
#[derive(Debug, Clone)]
struct Probed {
    id: u64,
    update: Arc<Update>,
    /// `Σ ⟨s_a, s_a⟩ / σ²`.
    energy: Vec<f64>,
    /// `Σ ⟨res, s_a⟩ / σ²`.
    fit: Vec<f64>,
}

/// A member's fit for one update.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fit {
    /// The member's row.
    pub row: usize,
    /// The update's id.
    pub id: u64,
    /// The share of the update its answers miss (1: all of it).
    pub share: f64,
    /// `share` over its standard deviation.
    pub sigmas: f64,
    /// The significance a wholly missing update would reach with the evidence so far.
    pub power: f64,
    /// For the row that explains the residuals best, by how much (in `σ²`) it beats the next
    /// best; 0 for the others.
    pub lead: f64,
}

impl Fit {
    /// Whether this fit convicts the member.
    pub fn convicts(&self) -> bool {
        self.sigmas.abs() >= PROBE_SIGMAS
            && self.share.abs() >= PROBE_MIN_FIT
            && self.lead >= PROBE_SIGMAS * PROBE_SIGMAS
    }
}

impl UpdateProbe {
    /// A probe of `updates` (`(id, update)`) for a code of `n` rows.
    pub fn new(updates: Vec<(u64, Arc<Update>)>, n: usize) -> Self {
        let updates = updates
            .into_iter()
            .map(|(id, update)| Probed {
                id,
                update,
                energy: vec![0.0; n],
                fit: vec![0.0; n],
            })
            .collect();
        Self { updates, n }
    }

    /// Updates whose test is not settled for every one of `rows`.
    pub(super) fn open(&self, rows: &[usize]) -> Vec<usize> {
        (0..self.updates.len())
            .filter(|&u| {
                let fits = self.fits(u);
                rows.iter().any(|&r| {
                    fits.iter()
                        .find(|f| f.row == r)
                        .is_none_or(|f| f.power < CLEAR_SIGMAS || f.convicts())
                })
            })
            .collect()
    }

    /// Update `u`'s effect on the stage's outputs for input `x` (`t × in`), in the decoder's
    /// layout, or `None` when it does not touch the stage.
    pub(super) fn effect(
        &self,
        u: usize,
        cfg: &LlamaConfig,
        g: &crate::code::Generator,
        stage: Stage,
        x: &[f32],
        t: usize,
    ) -> Option<Vec<f32>> {
        let update = &self.updates.get(u)?.update;
        let f = update.stages.iter().find(|f| f.stage == stage)?;
        let shapes = stage.shapes(cfg);
        let inp = shapes.first()?.1;
        let rows = f.rows as usize;
        if x.len() != t * inp || f.x.len() != rows * inp {
            return None;
        }
        let step = -(update.step as f64);
        // p = x · Xᵀ (t × rows), scaled by −step.
        let mut p = vec![0.0f64; t * rows];
        for (tok, xr) in x.chunks_exact(inp).enumerate() {
            for (r, fr) in f.x.chunks_exact(inp).enumerate() {
                let dot: f64 = xr.iter().zip(fr).map(|(&a, &b)| a as f64 * b as f64).sum();
                p[tok * rows + r] = step * dot;
            }
        }
        let mut outs: Vec<Vec<f32>> = Vec::with_capacity(shapes.len());
        for (dy, &(out, _)) in f.dy.iter().zip(&shapes) {
            let mut d = vec![0.0f64; t * out];
            for tok in 0..t {
                let row = &mut d[tok * out..(tok + 1) * out];
                for r in 0..rows {
                    let a = p[tok * rows + r];
                    row.iter_mut()
                        .zip(&dy[r * out..(r + 1) * out])
                        .for_each(|(v, &b)| *v += a * b as f64);
                }
            }
            outs.push(d.into_iter().map(|v| v as f32).collect());
        }
        // A tied LM head is the embedding: the lookup's gradient moves its rows too.
        if stage == Stage::LmHead && cfg.tied_embeddings {
            let (vocab, d) = (cfg.vocab, cfg.hidden);
            for (i, &tok_id) in update.embed_tokens.iter().enumerate() {
                let dx = update.embed_dx.get(i * d..(i + 1) * d)?;
                for (tok, xr) in x.chunks_exact(inp).enumerate() {
                    let dot: f64 = xr.iter().zip(dx).map(|(&a, &b)| a as f64 * b as f64).sum();
                    if let Some(v) = outs.first_mut()?.get_mut(tok * vocab + tok_id as usize) {
                        *v += (step * dot) as f32;
                    }
                }
            }
        }
        Some(super::shards::to_blocks(&outs, &shapes, g, t))
    }

    /// Adds one round's evidence for update `u`: the residual `res` and each answering row's
    /// signature, weighted by the round's noise variance `var`.
    pub(super) fn add(&mut self, u: usize, res: &[f32], sigs: &[(usize, Vec<f32>)], var: f64) {
        let n = self.n;
        let Some(p) = self.updates.get_mut(u) else {
            return;
        };
        let dot = |a: &[f32], b: &[f32]| -> f64 {
            a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
        };
        for (row, sig) in sigs {
            if *row < n {
                p.fit[*row] += dot(res, sig) / var;
                p.energy[*row] += dot(sig, sig) / var;
            }
        }
    }

    /// Every row's fit for update `u` so far (rows with no evidence left out). Each row is
    /// fitted alone: the k + r signatures of a round are linearly dependent (all members
    /// missing an update looks like none missing), so only "one member misses it, the others
    /// do not" can be told apart, and the row whose fit explains the residuals best leads.
    pub fn fits(&self, u: usize) -> Vec<Fit> {
        let Some(p) = self.updates.get(u) else {
            return Vec::new();
        };
        let n = self.n;
        let mut fits: Vec<Fit> = (0..n)
            .filter(|&r| p.energy[r] > 0.0)
            .map(|row| {
                let g = p.energy[row];
                Fit {
                    row,
                    id: p.id,
                    share: p.fit[row] / g,
                    sigmas: p.fit[row] / g.sqrt(),
                    power: g.sqrt(),
                    lead: 0.0,
                }
            })
            .collect();
        // How much better the best row explains the residuals than the next best.
        let mut order: Vec<usize> = (0..fits.len()).collect();
        order.sort_by(|&a, &b| fits[b].sigmas.abs().total_cmp(&fits[a].sigmas.abs()));
        if let Some(&best) = order.first() {
            let next = order.get(1).map_or(0.0, |&i| fits[i].sigmas.powi(2));
            fits[best].lead = fits[best].sigmas.powi(2) - next;
        }
        fits
    }

    /// Number of updates under test.
    pub fn len(&self) -> usize {
        self.updates.len()
    }

    /// Whether no update is under test.
    pub fn is_empty(&self) -> bool {
        self.updates.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Twenty rounds of two rows' signatures (amplitude `amp`) and a residual that is
    /// `missing` of row 1's plus uniform noise of variance 1e-6 / 12.
    fn fitted(amp: f32, missing: f32) -> Vec<Fit> {
        let mut probe = UpdateProbe::new(vec![(7, Arc::new(dummy_update()))], 2);
        let mut rng = 1u64;
        let mut noise = || {
            rng = rng
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((rng >> 33) as f32 / (1u64 << 31) as f32 - 0.5) * 1e-3
        };
        for round in 0..20 {
            let s0: Vec<f32> = (0..500)
                .map(|i| amp * ((i + round) as f32 * 0.37).sin())
                .collect();
            let s1: Vec<f32> = (0..500)
                .map(|i| amp * ((i * 3 + round) as f32 * 0.11).cos())
                .collect();
            let res: Vec<f32> = s1.iter().map(|&v| missing * v + noise()).collect();
            probe.add(0, &res, &[(0, s0), (1, s1)], 1e-6 / 12.0);
        }
        probe.fits(0)
    }

    #[test]
    fn a_fit_finds_the_row_missing_an_update_far_below_the_noise() {
        // Each value moves by under a third of the noise's spread; 10⁴ values make it plain.
        let fits = fitted(1.2e-4, 0.8);
        assert_eq!(fits.len(), 2);
        assert!((fits[1].share - 0.8).abs() < 0.1, "{fits:?}");
        assert!(fits[1].convicts() && fits[1].sigmas > 10.0, "{fits:?}");
        assert!(!fits[0].convicts() && fits[0].share.abs() < 0.2, "{fits:?}");
    }

    #[test]
    fn honest_noise_convicts_nobody() {
        let fits = fitted(1.2e-4, 0.0);
        assert!(
            fits.iter()
                .all(|f| !f.convicts() && f.sigmas.abs() < 5.0 && f.power > 10.0),
            "{fits:?}"
        );
    }

    fn dummy_update() -> Update {
        Update {
            step: 0.0,
            t: 0,
            stages: Vec::new(),
            embed_tokens: Vec::new(),
            embed_dx: Vec::new(),
            norms: crate::model::LeaderWeights {
                attn_norm: Vec::new(),
                ffn_norm: Vec::new(),
                final_norm: Vec::new(),
                ..Default::default()
            },
            precision: crate::update::Precision::F32,
        }
    }
}
