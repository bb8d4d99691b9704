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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

    use super::*;
    use crate::code::Generator;
    use crate::coded::{CodedGroup, InProcess, ShardFormat};
    use crate::model::{LeaderWeights, ModelWeights, SamplingParams, TokenLogprob, log_softmax};

    fn config() -> LlamaConfig {
        LlamaConfig::test_model()
    }

    /// `t` is `row`'s log-softmax at its token and its `top` likeliest, sorted.
    fn check(row: &[f32], t: &TokenLogprob, top: usize) {
        let exact = log_softmax(row);
        assert!((t.logprob as f64 - exact[t.token as usize]).abs() < 1e-5);
        assert_eq!(t.top.len(), top);
        let mut order: Vec<usize> = (0..row.len()).collect();
        order.sort_by(|&a, &b| exact[b].total_cmp(&exact[a]).then(a.cmp(&b)));
        for (&(id, lp), &want) in t.top.iter().zip(&order) {
            assert_eq!(id as usize, want);
            assert!((lp as f64 - exact[want]).abs() < 1e-5);
        }
        assert!(t.top.windows(2).all(|w| w[0].1 >= w[1].1), "sorted");
    }

    /// A coded group of 3 of 5 rows in process over `weights`, and the leader's model.
    fn group(weights: &ModelWeights) -> (CodedGroup<InProcess>, Llama) {
        let g = Generator::cauchy(5, 3).unwrap();
        let mesh = InProcess::encode(weights, &g, ShardFormat::F32, &|_, _| {}).unwrap();
        let group = CodedGroup::new(weights.cfg.clone(), g, &[0, 1, 2], mesh).unwrap();
        let llama = Llama::new(weights.cfg.clone(), LeaderWeights::from_model(weights)).unwrap();
        (group, llama)
    }

    /// Each emitted token's score with the logits row it came from, the prompt's scores, and
    /// the first pass's rows.
    type Ran = (
        Vec<(TokenLogprob, Vec<f32>)>,
        Option<Vec<TokenLogprob>>,
        Vec<Vec<f32>>,
    );

    /// Runs a batch of one sequence to its end: each emitted token with its score and the
    /// logits row it came from, and the prompt's scores (with `echo`).
    fn run(weights: &ModelWeights, prompt: &[u32], opts: GenerateOptions, echo: bool) -> Ran {
        let (mut exec, llama) = group(weights);
        let vocab = weights.cfg.vocab;
        let mut batch: Batch<()> = Batch::new(&weights.cfg, one_at_a_time(&weights.cfg));
        batch.admit((), prompt.to_vec(), opts, 0).unwrap();
        batch.entries_mut()[0].step.want_logprobs(5);
        if echo {
            batch.entries_mut()[0].step.want_echo(5);
        }
        let (mut out, mut prompt_scores, mut first_rows) = (Vec::new(), None, Vec::new());
        while !batch.is_empty() {
            batch.plan(0);
            let mut items = batch.rounds_items();
            let logits = futures::executor::block_on(llama.forward_batch(&mut exec, &mut items));
            drop(items);
            let logits = logits.unwrap();
            let rows: Vec<Vec<f32>> = logits[0].chunks(vocab).map(<[f32]>::to_vec).collect();
            if first_rows.is_empty() {
                first_rows.clone_from(&rows);
            }
            let mut at = if echo && out.is_empty() {
                rows.len() - 1
            } else {
                0
            };
            let took = batch.take_scored(logits, 0.01, |_, t, lp| {
                let lp = lp.unwrap();
                assert_eq!(lp.token, t);
                out.push((lp, rows[at].clone()));
                at += 1;
                true
            });
            if let Some(e) = batch.entries_mut().first_mut() {
                prompt_scores = prompt_scores.or(e.step.take_prompt_logprobs());
            }
            for e in took.ended {
                if let Ended::Finished(mut e, _) = e {
                    prompt_scores = prompt_scores.or(e.step.take_prompt_logprobs());
                }
            }
        }
        (out, prompt_scores, first_rows)
    }

    #[test]
    fn returned_log_probabilities_are_the_log_softmax_of_the_models_logits() {
        let weights = ModelWeights::synthetic(config(), 5).unwrap();
        let prompt = [3, 17, 200, 42, 3, 17, 200, 42, 3];
        // Sampled at a temperature, with drafts: the scores are the raw softmax's all the same.
        let opts = GenerateOptions {
            max_tokens: 10,
            sampling: SamplingParams {
                temperature: 0.7,
                top_p: 0.9,
                seed: 11,
                ..SamplingParams::default()
            },
            stop_ids: Vec::new(),
            draft: 4,
        };
        let (out, prompt_scores, _) = run(&weights, &prompt, opts, false);
        assert_eq!(out.len(), 10);
        assert!(prompt_scores.is_none(), "no echo asked");
        for (t, row) in &out {
            check(row, t, 5);
        }
        // Scoring the prompt and the completion as one text (an echo with no tokens, as
        // lm-evaluation-harness does) gives the completion's tokens the same log-probabilities.
        let mut text = prompt.to_vec();
        text.extend(out.iter().map(|(t, _)| t.token));
        let score = GenerateOptions {
            max_tokens: 0,
            sampling: SamplingParams::default(),
            stop_ids: Vec::new(),
            draft: 0,
        };
        let (none, scores, rows) = run(&weights, &text, score, true);
        assert!(none.is_empty(), "max_tokens 0 emits nothing");
        let scores = scores.unwrap();
        assert_eq!(scores.len(), text.len() - 1, "every token but the first");
        for (i, s) in scores.iter().enumerate() {
            assert_eq!(s.token, text[i + 1]);
            check(&rows[i], s, 5);
        }
        for ((t, _), s) in out.iter().zip(&scores[prompt.len() - 1..]) {
            assert_eq!(t.token, s.token);
            assert!(
                (t.logprob - s.logprob).abs() < 1e-3,
                "{} vs {}",
                t.logprob,
                s.logprob
            );
        }
    }
}
