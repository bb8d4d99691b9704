//! The generation loop: a [`Leader`]'s batch of one sequence, stepped ([`step`]) until it ends:
//! the prompt prefilled in one pass, then decoded a token a pass or, with drafts
//! ([`crate::model::speculate`]), several. The command line, the bench, the page's prompt box
//! and the simulation run it over a group that is formed again when a pass fails; in process it
//! runs over any executor, never regrouped.

use futures::FutureExt;
use web_time::Instant;

use super::leader::{LeadShell, Leader, Stepped, step};
use super::steer::Looking;
use crate::model::{
    Batch, BatchLimits, Ended, Forward, GenerateOptions, Generation, LinearExec, Llama,
    LlamaConfig, ModelError, Pass,
};

/// The limits of a leader's batch that generates one sequence at a time.
pub fn one_at_a_time(model: &LlamaConfig) -> BatchLimits {
    BatchLimits {
        max_batch: 1,
        step_tokens: model.max_seq,
    }
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
/// over the sequence's own keys and values in its batch.
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
    generate_regrouping(&mut Plain::new(llama.config(), run), prompt, opts, on_token).await
}

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
    generate_regrouping(&mut Plain::new(cfg, run), prompt, opts, on_token).await
}

/// The generation loop over `shell`'s leader: its batch of one sequence, stepped ([`step`])
/// until it ends; a failed pass runs again on the group the leader forms next (up to
/// [`crate::model::MAX_PASS_FAILURES`] in a row), and a group short of members is formed again
/// when a row comes back.
pub async fn generate_regrouping<S: LeadShell<()>>(
    shell: &mut S,
    prompt: &[u32],
    opts: &GenerateOptions,
    on_token: &mut dyn FnMut(u32) -> bool,
) -> Result<Generation, ModelError> {
    let leader = shell.leader();
    // Whatever an earlier generation that failed left behind goes.
    leader.batch_mut().drain();
    leader
        .admit((), prompt.to_vec(), opts.clone())
        .map_err(|(_, e)| e)?;
    let started = Instant::now();
    let mut prefill_time = None;
    let (seq, stop) = loop {
        let took = match step(shell, |_, t| on_token(t)).await {
            Ok(Stepped::Took(took)) => took,
            Ok(Stepped::Failed(_)) => continue,
            Ok(Stepped::GaveUp(_, e)) => return Err(e),
            Err(e) => {
                shell.leader().batch_mut().drain();
                return Err(e);
            }
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

/// Passes through a function, over no group: never formed again, a failed pass is final.
struct Plain<F> {
    leader: Leader<()>,
    run: F,
}

impl<F> Plain<F> {
    /// Passes of a model of `cfg` through `run`.
    fn new(cfg: &LlamaConfig, run: F) -> Self {
        Self {
            leader: Leader::new(cfg, one_at_a_time(cfg), 0, 0, 0),
            run,
        }
    }
}

impl<F: AsyncFnMut(&mut Batch<()>) -> Result<Vec<Vec<f32>>, ModelError>> LeadShell<()>
    for Plain<F>
{
    fn leader(&mut self) -> &mut Leader<()> {
        &mut self.leader
    }

    fn rows(&self) -> Vec<usize> {
        Vec::new()
    }

    async fn wait_until(&mut self, _until: Instant) {}

    async fn form(&mut self, _checks: usize) -> Result<bool, String> {
        Ok(false)
    }

    async fn look(&mut self, _looking: &Looking) -> Option<usize> {
        None
    }

    fn regroup(&mut self, _row: usize, _looking: &Looking) {}

    async fn pass(&mut self) -> Result<Vec<Vec<f32>>, ModelError> {
        (self.run)(self.leader.batch_mut()).await
    }

    fn failed(&mut self, _why: &ModelError) -> Option<super::leader::Failure> {
        None
    }
}
