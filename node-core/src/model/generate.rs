//! The generation loop: prefill the prompt in one batch, then decode, a token a pass or, with
//! drafts ([`super::speculate`]), several.

use futures::FutureExt;
use web_time::{Duration, Instant};

use super::batch::{AfterFailure, Batch, BatchLimits, Ended, Entry, Took};
use super::speculate::SpecStats;
use super::{KvCache, LinearExec, Llama, LlamaConfig, ModelError, SamplingParams};

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

/// Generates a completion of `prompt` through an executor that computes in process (a CLI, a
/// bench, a test: the loop blocks until it is done); `on_token` sees each token and returns
/// false to stop. A leader on a network awaits [`generate_on`] instead.
pub fn generate<E: LinearExec>(
    llama: &Llama,
    exec: &mut E,
    prompt: &[u32],
    opts: &GenerateOptions,
    on_token: &mut dyn FnMut(u32) -> bool,
) -> Result<Generation, ModelError> {
    futures::executor::block_on(generate_on(llama, exec, prompt, opts, on_token))
}

/// The generation loop with `llama`'s passes run through `exec` (a leader's rounds, awaited),
/// over the sequence's own keys and values in its [`Batch`].
pub async fn generate_on<E: LinearExec>(
    llama: &Llama,
    exec: &mut E,
    prompt: &[u32],
    opts: &GenerateOptions,
    on_token: &mut dyn FnMut(u32) -> bool,
) -> Result<Generation, ModelError> {
    let run = async |batch: &mut Batch<()>| {
        let mut items = batch.rounds_items();
        llama.forward_batch(exec, &mut items).await
    };
    generate_one(&mut Plain(run), llama.config(), prompt, opts, on_token).await
}

/// A leader's group as the loop every leader runs ([`step`]) drives it: made ready before each
/// pass (formed, or formed again after a pass failed or when it is short of members and a row
/// comes back, as its [`crate::lead::Steer`] rules), the batch's pass run on it, and told how
/// the pass went. `J` is the caller's request of each sequence.
pub trait Regroup<J = ()> {
    /// Makes the group ready for the next pass; [`ModelError::NoGroup`] when none can be
    /// formed.
    fn ready(&mut self) -> impl Future<Output = Result<(), ModelError>>;

    /// Runs the batch's planned pass on the group: the logits of its sequences, in order.
    fn pass(
        &mut self,
        batch: &mut Batch<J>,
    ) -> impl Future<Output = Result<Vec<Vec<f32>>, ModelError>>;

    /// The last pass ran.
    fn passed(&mut self) {}

    /// The last pass failed with `why`: whether the group is formed again for another try
    /// (at the next [`Regroup::ready`]); false fails the pass for good.
    fn failed(&mut self, why: &ModelError) -> bool;

    /// Where the sequences' keys and values live: a change starts them again (a hop group's
    /// members held them; the leader's rounds keep them across groups).
    fn epoch(&self) -> u64 {
        0
    }
}

/// What one [`step`] did to the batch.
#[derive(Debug)]
pub enum Stepped<J> {
    /// The pass ran: what its logits did.
    Took(Took<J>),
    /// It failed and the group is formed again for the next step.
    Failed(ModelError),
    /// It failed [`super::batch::MAX_PASS_FAILURES`] times in a row: these sequences left
    /// the batch, failed.
    GaveUp(Vec<Entry<J>>, ModelError),
}

/// One step of the loop every leader runs, the API's batch of many and the one-sequence
/// generation alike: the group made ready, the batch's pass planned where its keys and values
/// live and run, then its logits taken (`on_token` sees each sequence's tokens and returns false
/// to end it) or the failure handed to the group and the batch. An error when no group can be
/// formed, or a failed pass is final.
pub async fn step<J, R: Regroup<J>>(
    lead: &mut R,
    batch: &mut Batch<J>,
    on_token: impl FnMut(&mut J, u32) -> bool,
) -> Result<Stepped<J>, ModelError> {
    lead.ready().await?;
    batch.plan(lead.epoch());
    let began = Instant::now();
    match lead.pass(batch).await {
        Ok(logits) => {
            lead.passed();
            let took = batch.take(logits, began.elapsed().as_secs_f64(), on_token);
            Ok(Stepped::Took(took))
        }
        Err(e) => {
            if !lead.failed(&e) {
                return Err(e);
            }
            Ok(match batch.failed() {
                AfterFailure::Regroup => Stepped::Failed(e),
                AfterFailure::GiveUp(gone) => Stepped::GaveUp(gone, e),
            })
        }
    }
}

/// [`generate_on`] over a group that is formed again when a pass fails (up to
/// [`super::batch::MAX_PASS_FAILURES`] in a row) or a row comes back: the failed pass runs
/// again on the new group and the completion goes on.
pub async fn generate_regrouping<R: Regroup>(
    lead: &mut R,
    cfg: &LlamaConfig,
    prompt: &[u32],
    opts: &GenerateOptions,
    on_token: &mut dyn FnMut(u32) -> bool,
) -> Result<Generation, ModelError> {
    generate_one(lead, cfg, prompt, opts, on_token).await
}

/// Passes through a function, never regrouped.
struct Plain<F>(F);

impl<F: AsyncFnMut(&mut Batch<()>) -> Result<Vec<Vec<f32>>, ModelError>> Regroup for Plain<F> {
    async fn ready(&mut self) -> Result<(), ModelError> {
        Ok(())
    }

    async fn pass(&mut self, batch: &mut Batch<()>) -> Result<Vec<Vec<f32>>, ModelError> {
        (self.0)(batch).await
    }

    fn failed(&mut self, _why: &ModelError) -> bool {
        false
    }
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

/// The generation loop over any forward pass ([`Pass`]) of a model of `cfg`.
pub fn generate_with(
    forward: &mut Forward<'_>,
    cfg: &LlamaConfig,
    prompt: &[u32],
    opts: &GenerateOptions,
    on_token: &mut dyn FnMut(u32) -> bool,
) -> Result<Generation, ModelError> {
    // The loop awaits nothing but these synchronous passes, so its future is done at its
    // first poll: no executor runs it (the pass itself may run one).
    let ready = async |pass: Pass<'_>| forward(pass);
    generate_async(ready, cfg, prompt, opts, on_token)
        .now_or_never()
        .unwrap_or_else(|| {
            Err(ModelError::Config(
                "the generation loop waited on a synchronous forward pass".into(),
            ))
        })
}

/// [`generate_with`] over a forward pass that may wait (a browser leader's, a hop group's):
/// its passes one after another.
pub async fn generate_async(
    mut forward: impl AsyncFnMut(Pass<'_>) -> Result<Vec<f32>, ModelError>,
    cfg: &LlamaConfig,
    prompt: &[u32],
    opts: &GenerateOptions,
    on_token: &mut dyn FnMut(u32) -> bool,
) -> Result<Generation, ModelError> {
    let run = async |batch: &mut Batch<()>| {
        let (_, pass) = batch
            .passes()
            .next()
            .ok_or_else(|| ModelError::Config("the sequence left the batch".into()))?;
        Ok(vec![forward(pass).await?])
    };
    generate_one(&mut Plain(run), cfg, prompt, opts, on_token).await
}

/// The generation loop: a [`Batch`] of one sequence, stepped ([`step`]) until it ends; a
/// failed pass runs again where `lead` forms another group, as the batch allows.
async fn generate_one(
    lead: &mut impl Regroup,
    cfg: &LlamaConfig,
    prompt: &[u32],
    opts: &GenerateOptions,
    on_token: &mut dyn FnMut(u32) -> bool,
) -> Result<Generation, ModelError> {
    let limits = BatchLimits {
        max_batch: 1,
        step_tokens: prompt.len(),
    };
    let mut batch = Batch::new(cfg, limits);
    batch
        .admit((), prompt.to_vec(), opts.clone(), 0)
        .map_err(|(_, e)| e)?;
    let started = Instant::now();
    let mut prefill_time = None;
    let (seq, stop) = loop {
        let took = match step(lead, &mut batch, |_, t| on_token(t)).await? {
            Stepped::Took(took) => took,
            Stepped::Failed(_) => continue,
            Stepped::GaveUp(_, e) => return Err(e),
        };
        prefill_time.get_or_insert_with(|| started.elapsed());
        match took.ended.into_iter().next() {
            Some(Ended::Finished(e, stop)) => break (e.step, stop),
            Some(Ended::Failed(_, e)) => return Err(e),
            None => {}
        }
    };
    let prefill_time = prefill_time.unwrap_or_default();
    Ok(Generation {
        prompt_tokens: seq.prompt_tokens(),
        stop,
        forward_passes: seq.passes(),
        prefill_time,
        decode_time: started.elapsed().saturating_sub(prefill_time),
        speculation: seq.speculation(),
        tokens: seq.into_generated(),
    })
}
