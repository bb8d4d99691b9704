//! What a generation asks for and what it gave ([`GenerateOptions`], [`Generation`]), one
//! forward pass of it ([`Pass`]), and comparing logits; the loop itself is the leader's
//! (`crate::lead::generate`).

use web_time::Duration;

use super::speculate::SpecStats;
use super::{KvCache, LinearExec, Llama, ModelError, SamplingParams};

/// What to generate.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateOptions {
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// How to pick tokens.
    pub sampling: SamplingParams,
    /// Token ids that end the completion (not emitted).
    pub stop_ids: Vec<u32>,
    /// Most drafted tokens checked in one forward pass (prompt lookup); 0 decodes a token a
    /// pass.
    pub draft: usize,
}

/// Why generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopReason {
    /// A stop token came.
    Stop,
    /// `max_tokens` were generated.
    Length,
    /// The model's context is full.
    Context,
    /// The caller asked to stop.
    Cancelled,
}

/// The outcome of one generation.
#[derive(Debug, Clone, PartialEq)]
pub struct Generation {
    /// Tokens of the prompt.
    pub prompt_tokens: usize,
    /// Generated token ids.
    pub tokens: Vec<u32>,
    /// Why it stopped.
    pub stop: StopReason,
    /// Forward passes run (the prefill counts as one).
    pub forward_passes: usize,
    /// Time of the prompt's forward pass (and the first token).
    pub prefill_time: Duration,
    /// Time of the later forward passes.
    pub decode_time: Duration,
    /// How the drafts did.
    pub speculation: SpecStats,
}

impl Generation {
    /// Prompt tokens per second of the prefill.
    pub fn prefill_tokens_per_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prefill_time.as_secs_f64().max(1e-9)
    }

    /// Generated tokens per second after the first.
    pub fn decode_tokens_per_s(&self) -> f64 {
        let n = self.tokens.len().saturating_sub(1);
        n as f64 / self.decode_time.as_secs_f64().max(1e-9)
    }
}

/// Logits after `prompt`, then after each of `forced` fed one at a time: a run teacher-forced
/// along a given continuation, to compare two executions of a model step by step.
pub async fn logits_along<E: LinearExec>(
    llama: &Llama,
    exec: &mut E,
    prompt: &[u32],
    forced: &[u32],
) -> Result<Vec<Vec<f32>>, ModelError> {
    let mut cache = KvCache::new(llama.config());
    let mut out = vec![llama.forward(exec, prompt, &mut cache).await?];
    for &t in forced {
        out.push(llama.forward(exec, &[t], &mut cache).await?);
    }
    Ok(out)
}

/// `‖a − b‖ / ‖b‖` over one row of logits.
pub fn relative_error(a: &[f32], b: &[f32]) -> f64 {
    let (mut num, mut den) = (0.0f64, 0.0f64);
    for (&x, &y) in a.iter().zip(b) {
        num += (f64::from(x) - f64::from(y)).powi(2);
        den += f64::from(y).powi(2);
    }
    (num / den.max(f64::MIN_POSITIVE)).sqrt()
}

/// One forward pass of the generation loop: `tokens` run at positions `start..` (whatever the
/// model held from `start` on is forgotten: drafted tokens it did not keep).
#[derive(Debug, Clone, Copy)]
pub struct Pass<'a> {
    /// The position of the first token.
    pub start: usize,
    /// The tokens.
    pub tokens: &'a [u32],
    /// How many of the last positions' logits come back, row after row.
    pub logits: usize,
}

/// A forward pass ([`Pass`]) returning the logits it asks for.
pub type Forward<'a> = dyn FnMut(Pass<'_>) -> Result<Vec<f32>, ModelError> + 'a;
