//! The generation loop: prefill the prompt in one batch, then decode token by token.

use web_time::{Duration, Instant};

use super::{KvCache, LinearExec, Llama, ModelError, Sampler, SamplingParams, now};

/// What to generate.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateOptions {
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// How to pick tokens.
    pub sampling: SamplingParams,
    /// Token ids that end the completion (not emitted).
    pub stop_ids: Vec<u32>,
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

/// Generates a completion of `prompt`; `on_token` sees each token and returns false to stop.
pub fn generate(
    llama: &Llama,
    exec: &mut dyn LinearExec,
    prompt: &[u32],
    opts: &GenerateOptions,
    on_token: &mut dyn FnMut(u32) -> bool,
) -> Result<Generation, ModelError> {
    let mut cache = KvCache::new(llama.config());
    let mut forward = |tokens: &[u32]| llama.forward(exec, tokens, &mut cache);
    generate_with(&mut forward, llama.config().max_seq, prompt, opts, on_token)
}

/// A forward pass: runs tokens after every token given before, returns the last one's logits.
pub type Forward<'a> = dyn FnMut(&[u32]) -> Result<Vec<f32>, ModelError> + 'a;

/// The generation loop over any forward pass: `forward(tokens)` runs `tokens` after every
/// token given before and returns the logits of the last; at most `max_seq` positions.
pub fn generate_with(
    forward: &mut Forward<'_>,
    max_seq: usize,
    prompt: &[u32],
    opts: &GenerateOptions,
    on_token: &mut dyn FnMut(u32) -> bool,
) -> Result<Generation, ModelError> {
    let ready = async |tokens: &[u32]| forward(tokens);
    now(generate_async(ready, max_seq, prompt, opts, on_token))?
}

/// [`generate_with`] over a forward pass that may wait (a browser leader's).
pub async fn generate_async(
    mut forward: impl AsyncFnMut(&[u32]) -> Result<Vec<f32>, ModelError>,
    max_seq: usize,
    prompt: &[u32],
    opts: &GenerateOptions,
    on_token: &mut dyn FnMut(u32) -> bool,
) -> Result<Generation, ModelError> {
    let mut sampler = Sampler::new(opts.sampling)?;
    let started = Instant::now();
    let mut logits = forward(prompt).await?;
    let mut positions = prompt.len();
    let mut out = Generation {
        prompt_tokens: prompt.len(),
        tokens: Vec::new(),
        stop: StopReason::Length,
        forward_passes: 1,
        prefill_time: started.elapsed(),
        decode_time: Duration::ZERO,
    };
    let decode_start = Instant::now();
    while out.tokens.len() < opts.max_tokens {
        let next = sampler.sample(&logits);
        if opts.stop_ids.contains(&next) {
            out.stop = StopReason::Stop;
            break;
        }
        out.tokens.push(next);
        if !on_token(next) {
            out.stop = StopReason::Cancelled;
            break;
        }
        if out.tokens.len() == opts.max_tokens {
            break;
        }
        if positions >= max_seq {
            out.stop = StopReason::Context;
            break;
        }
        logits = forward(&[next]).await?;
        positions += 1;
        out.forward_passes += 1;
    }
    out.decode_time = decode_start.elapsed();
    Ok(out)
}
