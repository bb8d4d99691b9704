//! The generation loop: prefill the prompt in one batch, then decode, a token a pass or, with
//! drafts ([`super::speculate`]), several.

use futures::FutureExt;
use web_time::{Duration, Instant};

use super::batch::{AfterFailure, Batch, BatchLimits, Ended};
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
    generate_one(Plain(run), llama.config(), prompt, opts, on_token).await
}

/// A leader whose group can be formed again: after a pass through it fails (a member died
/// and no spare is left, or the mesh moved to another version) or when it is short of members
/// and a row comes back, as its [`crate::lead::Steer`] rules.
pub trait Regroup {
    /// Makes the group ready for the next pass: forms it (again) when it has none; an error
    /// when none can be formed.
    fn ready(&mut self) -> impl Future<Output = Result<(), ModelError>>;

    /// Runs the batch's planned pass on the group: the logits of its one sequence.
    fn pass(
        &mut self,
        batch: &mut Batch<()>,
    ) -> impl Future<Output = Result<Vec<Vec<f32>>, ModelError>>;

    /// The last pass ran.
    fn passed(&mut self);

    /// The last pass failed with `why`: the group goes, formed again at the next
    /// [`Regroup::ready`].
    fn failed(&mut self, why: &ModelError);

    /// Where the sequence's keys and values live: a change starts it again (a hop group's
    /// members held them; the leader's rounds keep them across groups).
    fn epoch(&self) -> u64 {
        0
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
    generate_one(Regrouping(lead), cfg, prompt, opts, on_token).await
}

/// What runs the generation loop's passes, and what follows a failed one.
trait Passes {
    /// Makes ready for the next pass.
    async fn ready(&mut self) -> Result<(), ModelError> {
        Ok(())
    }

    /// Runs the batch's planned pass: the logits of its one sequence.
    async fn run(&mut self, batch: &mut Batch<()>) -> Result<Vec<Vec<f32>>, ModelError>;

    /// The pass ran.
    fn passed(&mut self) {}

    /// A pass failed with `why` and the batch asks for another group: the next
    /// [`Passes::ready`] forms it, or this says why not.
    fn regroup(&mut self, why: ModelError) -> Result<(), ModelError> {
        Err(why)
    }

    /// Where the sequence's keys and values live.
    fn epoch(&self) -> u64 {
        0
    }
}

/// Passes through a function, never regrouped.
struct Plain<F>(F);

impl<F: AsyncFnMut(&mut Batch<()>) -> Result<Vec<Vec<f32>>, ModelError>> Passes for Plain<F> {
    async fn run(&mut self, batch: &mut Batch<()>) -> Result<Vec<Vec<f32>>, ModelError> {
        (self.0)(batch).await
    }
}

/// Passes through a [`Regroup`]'s group, formed again after a failure.
struct Regrouping<'a, R>(&'a mut R);

impl<R: Regroup> Passes for Regrouping<'_, R> {
    async fn ready(&mut self) -> Result<(), ModelError> {
        self.0.ready().await
    }

    async fn run(&mut self, batch: &mut Batch<()>) -> Result<Vec<Vec<f32>>, ModelError> {
        self.0.pass(batch).await
    }

    fn passed(&mut self) {
        self.0.passed();
    }

    fn regroup(&mut self, why: ModelError) -> Result<(), ModelError> {
        self.0.failed(&why);
        Ok(())
    }

    fn epoch(&self) -> u64 {
        self.0.epoch()
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
    generate_one(Plain(run), cfg, prompt, opts, on_token).await
}

/// The generation loop: a [`Batch`] of one sequence, each pass planned, run by `passes` (the
/// logits of the batch's one sequence) and taken; a failed pass runs again where `passes`
/// can form another group, as the batch allows.
async fn generate_one(
    mut passes: impl Passes,
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
        passes.ready().await?;
        batch.plan(passes.epoch());
        let began = Instant::now();
        let logits = match passes.run(&mut batch).await {
            Ok(logits) => logits,
            Err(e) => match batch.failed() {
                AfterFailure::Regroup => {
                    passes.regroup(e)?;
                    continue;
                }
                AfterFailure::GiveUp(_) => return Err(e),
            },
        };
        passes.passed();
        let took = batch.take(logits, began.elapsed().as_secs_f64(), |_, t| on_token(t));
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
