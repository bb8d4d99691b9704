//! A learning update's content, as every layer names it: per stage the factors of an SGD step,
//! the lookup's gradient and the norms' gradients ([`crate::learn`] makes, checks and applies
//! them; [`crate::coded`]'s probe tests members against them).

use crate::model::{LeaderWeights, Stage};

/// How an update's factors travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Precision {
    /// Four bytes a value, as computed.
    F32,
    /// Two bytes a value: every factor value is an f16 (held as the f32 of the same value).
    F16,
}

/// One SGD step as factors: `W ← W − step · dYᵀ·X` for every stage.
#[derive(Debug, Clone, PartialEq)]
pub struct Update {
    /// Learning rate times the clipping factor.
    pub step: f32,
    /// Positions trained on (over every request folded into the update).
    pub t: u32,
    /// Every stage's factors, in the model's order.
    pub stages: Vec<StageFactors>,
    /// Tokens whose embedding rows the lookup's gradient reaches.
    pub embed_tokens: Vec<u32>,
    /// The lookup's gradient, a row of `hidden` per token.
    pub embed_dx: Vec<f32>,
    /// Gradients of the norm gains.
    pub norms: LeaderWeights,
    /// How the factors travel.
    pub precision: Precision,
}

/// One stage's step as factors: for matrix `m`, `δW_m = dy[m]ᵀ·x`.
#[derive(Debug, Clone, PartialEq)]
pub struct StageFactors {
    /// The stage.
    pub stage: Stage,
    /// Rows of the factors: a sequence's positions, or a compressed rank.
    pub rows: u32,
    /// The input factor, `rows × in`.
    pub x: Vec<f32>,
    /// Per matrix of the stage, the output factor, `rows × out`.
    pub dy: Vec<Vec<f32>>,
}
