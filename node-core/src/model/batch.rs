//! A leader's batch, with no I/O: the sequences a group decodes together, what their next pass
//! runs, what that pass's logits emit, and what a failed pass does. Every leader drives it: the
//! API's serving tasks (a batch of many, over rounds or a hop group) and the one-sequence loop
//! of the CLI, the bench and the page's prompt box, each through its leader
//! (`crate::lead::Leader`). The shells keep only tasks, channels and transports.

use super::speculate::DraftCost;
use super::{
    BatchItem, GenerateOptions, KvCache, LlamaConfig, ModelError, Pass, Sequence, StopReason,
    TokenLogprob,
};

/// A run of failed passes this long fails the batch's sequences.
pub const MAX_PASS_FAILURES: u32 = 3;

/// How many sequences a batch holds, and how many rows one pass may run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchLimits {
    /// Sequences decoded together.
    pub max_batch: usize,
    /// Rows of one pass (prompts count whole): a prompt that would pass it waits, unless the
    /// batch is empty.
    pub step_tokens: usize,
}

/// One sequence of a batch and the request it answers.
#[derive(Debug)]
pub struct Entry<J> {
    /// The caller's request.
    pub job: J,
    /// Its decoding: the next pass, and what that pass's logits emit.
    pub step: Sequence,
    /// Its keys and values, when the leader's rounds run it ([`Batch::rounds_items`]; a hop
    /// group's members keep their own).
    pub cache: KvCache,
    /// Where its keys and values live ([`Batch::plan`]): at another place it starts again.
    epoch: u64,
}

/// How a sequence left the batch.
#[derive(Debug)]
pub enum Ended<J> {
    /// It stopped, for this reason.
    Finished(Entry<J>, StopReason),
    /// Its pass gave logits it cannot take.
    Failed(Entry<J>, ModelError),
}

/// What one pass's logits did to the batch.
#[derive(Debug)]
pub struct Took<J> {
    /// The sequences that left it.
    pub ended: Vec<Ended<J>>,
    /// Drafted rows the pass checked.
    pub drafted: usize,
    /// Of those, kept.
    pub kept: usize,
}

/// What follows a failed pass.
#[derive(Debug)]
pub enum AfterFailure<J> {
    /// Form the group again; the pass runs again.
    Regroup,
    /// [`MAX_PASS_FAILURES`] in a row: these sequences fail.
    GiveUp(Vec<Entry<J>>),
}

/// The sequences a leader decodes together (`J`: the caller's request of each).
#[derive(Debug)]
pub struct Batch<J> {
    model: LlamaConfig,
    limits: BatchLimits,
    entries: Vec<Entry<J>>,
    failures: u32,
    /// What a drafted row costs this batch's passes.
    draft_cost: DraftCost,
    /// Drafted rows of the planned pass; `None` while a sequence runs its prompt (its rows
    /// would swamp the drafts').
    planned_drafts: Option<usize>,
}

impl<J> Batch<J> {
    /// An empty batch of a model of `model` within `limits`.
    pub fn new(model: &LlamaConfig, limits: BatchLimits) -> Self {
        Self {
            model: model.clone(),
            limits,
            entries: Vec::new(),
            failures: 0,
            draft_cost: DraftCost::default(),
            planned_drafts: None,
        }
    }

    /// Its sequences, in admission order (a pass's logits come in this order).
    pub fn entries(&self) -> &[Entry<J>] {
        &self.entries
    }

    /// Its sequences, to set what each asks beyond its tokens (log-probabilities, a
    /// constraint) or to read what its passes left (the prompt's log-probabilities).
    pub fn entries_mut(&mut self) -> &mut [Entry<J>] {
        &mut self.entries
    }

    /// How many sequences it holds.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Whether it holds as many sequences as it may.
    pub fn is_full(&self) -> bool {
        self.entries.len() >= self.limits.max_batch
    }

    /// Whether a prompt of `len` tokens fits the next pass's rows (an empty batch takes any).
    pub fn fits(&self, len: usize) -> bool {
        self.entries.is_empty() || len <= self.limits.step_tokens.saturating_sub(self.rows())
    }

    /// Rows of the next pass, every sequence's together.
    pub fn rows(&self) -> usize {
        self.entries
            .iter()
            .map(|e| e.step.pass().tokens.len())
            .sum()
    }

    /// Rows of the next pass if it ran with the keys and values at `epoch`: a sequence whose
    /// keys live elsewhere runs its whole text.
    pub fn rows_at(&self, epoch: u64) -> usize {
        self.entries
            .iter()
            .map(|e| match e.epoch == epoch {
                true => e.step.pass().tokens.len(),
                false => e.step.text_len(),
            })
            .sum()
    }

    /// Rows of the next pass if every sequence started again: their texts so far.
    pub fn text_rows(&self) -> usize {
        self.entries.iter().map(|e| e.step.text_len()).sum()
    }

    /// Admits `job`'s `prompt` as a new sequence whose keys and values will live at `epoch`;
    /// a prompt it cannot run (empty, longer than the context, bad sampling) gives the job
    /// back with why.
    pub fn admit(
        &mut self,
        job: J,
        prompt: Vec<u32>,
        opts: GenerateOptions,
        epoch: u64,
    ) -> Result<(), (J, ModelError)> {
        match Sequence::new(prompt, opts, &self.model) {
            Ok(step) => {
                self.entries.push(Entry {
                    job,
                    step,
                    cache: KvCache::new(&self.model),
                    epoch,
                });
                Ok(())
            }
            Err(e) => Err((job, e)),
        }
    }

    /// Plans the next pass with the keys and values at `epoch` (where the pass runs): a
    /// sequence whose keys lived elsewhere starts again, its whole text in the pass. Returns
    /// the rows the pass runs.
    pub fn plan(&mut self, epoch: u64) -> usize {
        for e in self.entries.iter_mut().filter(|e| e.epoch != epoch) {
            e.cache.truncate(0);
            e.step.restart();
            e.epoch = epoch;
        }
        self.planned_drafts = self.entries.iter().try_fold(0, |n, e| {
            let (p, drafted) = (e.step.pass(), e.step.drafted());
            (p.tokens.len() == 1 + drafted).then_some(n + drafted)
        });
        self.rows()
    }

    /// The planned pass on the leader's rounds: each sequence's rows over its own cache, cut
    /// back to the pass's start (a failed pass may have left keys and values behind it).
    pub fn rounds_items(&mut self) -> Vec<BatchItem<'_>> {
        self.entries
            .iter_mut()
            .map(|e| {
                let pass = e.step.pass();
                e.cache.truncate(pass.start);
                BatchItem {
                    logits: pass.logits,
                    ..BatchItem::new(pass.tokens, &mut e.cache)
                }
            })
            .collect()
    }

    /// The planned pass's sequences with their requests, for a pass that runs elsewhere (a
    /// hop group's members keep the keys and values).
    pub fn passes(&self) -> impl Iterator<Item = (&J, Pass<'_>)> {
        self.entries.iter().map(|e| (&e.job, e.step.pass()))
    }

    /// Takes the planned pass's logits (a row block per sequence, in order) after it took
    /// `seconds`: each sequence's tokens go to `on_token` (false: its caller left, and it
    /// stops), and what drafted rows cost is learnt.
    pub fn take(
        &mut self,
        logits: Vec<Vec<f32>>,
        seconds: f64,
        mut on_token: impl FnMut(&mut J, u32) -> bool,
    ) -> Took<J> {
        self.take_scored(logits, seconds, |j, t, _| on_token(j, t))
    }

    /// [`Self::take`], each token with its log-probability where its sequence asked for them
    /// ([`Sequence::want_logprobs`]).
    pub fn take_scored(
        &mut self,
        logits: Vec<Vec<f32>>,
        seconds: f64,
        mut on_token: impl FnMut(&mut J, u32, Option<TokenLogprob>) -> bool,
    ) -> Took<J> {
        self.failures = 0;
        if let Some(drafted) = self.planned_drafts.take() {
            self.draft_cost.observe(drafted, seconds);
        }
        let cost = self.draft_cost.share();
        let mut took = Took {
            ended: Vec::new(),
            drafted: 0,
            kept: 0,
        };
        let mut logits = logits.into_iter();
        for mut e in std::mem::take(&mut self.entries) {
            let Some(rows) = logits.next() else {
                let missing = ModelError::Config("the pass gave no logits for the sequence".into());
                took.ended.push(Ended::Failed(e, missing));
                continue;
            };
            if let Some(c) = cost {
                e.step.set_draft_cost(c);
            }
            let job = &mut e.job;
            let taken = e.step.take_scored(&rows, &mut |t, lp| on_token(job, t, lp));
            // Forget the drafted positions the model did not keep.
            e.cache.truncate(e.step.held());
            match taken {
                Ok(t) => {
                    took.drafted += t.drafted;
                    took.kept += t.kept;
                    match t.stop {
                        Some(stop) => took.ended.push(Ended::Finished(e, stop)),
                        None => self.entries.push(e),
                    }
                }
                Err(err) => took.ended.push(Ended::Failed(e, err)),
            }
        }
        took
    }

    /// A pass failed: form the group again, or after [`MAX_PASS_FAILURES`] in a row give up
    /// every sequence.
    pub fn failed(&mut self) -> AfterFailure<J> {
        self.planned_drafts = None;
        self.failures += 1;
        if self.failures < MAX_PASS_FAILURES {
            return AfterFailure::Regroup;
        }
        self.failures = 0;
        AfterFailure::GiveUp(self.drain())
    }

    /// Failed passes in a row so far.
    pub fn failures(&self) -> u32 {
        self.failures
    }

    /// Takes every sequence out.
    pub fn drain(&mut self) -> Vec<Entry<J>> {
        std::mem::take(&mut self.entries)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::SamplingParams;

    fn opts(max_tokens: usize, draft: usize) -> GenerateOptions {
        GenerateOptions {
            max_tokens,
            sampling: SamplingParams::default(),
            stop_ids: vec![],
            draft,
        }
    }

    /// Logits whose greedy pick is `next` for each of `rows` rows.
    fn pick(cfg: &LlamaConfig, rows: usize, next: u32) -> Vec<f32> {
        let mut v = vec![0.0f32; rows * cfg.vocab];
        for r in 0..rows {
            v[r * cfg.vocab + next as usize] = 1.0;
        }
        v
    }

    fn limits(max_batch: usize, step_tokens: usize) -> BatchLimits {
        BatchLimits {
            max_batch,
            step_tokens,
        }
    }

    #[test]
    fn a_batch_admits_within_its_limits_and_refuses_what_cannot_run() {
        let cfg = LlamaConfig::small();
        let mut b: Batch<u32> = Batch::new(&cfg, limits(2, 6));
        assert!(b.fits(100), "an empty batch takes any prompt");
        b.admit(1, vec![1, 2, 3, 4], opts(4, 0), 0).unwrap();
        assert!(b.fits(2) && !b.fits(3), "four of six rows are taken");
        let (job, e) = b
            .admit(2, vec![1; cfg.max_seq + 1], opts(4, 0), 0)
            .unwrap_err();
        assert_eq!(job, 2);
        assert!(
            e.to_string().contains("longer than the model's context"),
            "{e}"
        );
        b.admit(3, vec![5], opts(4, 0), 0).unwrap();
        assert!(b.is_full());
        assert_eq!(b.plan(0), 5);
    }

    #[test]
    fn logits_emit_tokens_finish_sequences_and_a_missing_row_fails_its_own() {
        let cfg = LlamaConfig::small();
        let mut b: Batch<Vec<u32>> = Batch::new(&cfg, limits(4, 64));
        b.admit(vec![], vec![1, 2], opts(2, 0), 0).unwrap();
        b.admit(vec![], vec![3], opts(5, 0), 0).unwrap();
        b.admit(vec![], vec![4], opts(5, 0), 0).unwrap();
        b.plan(0);
        let logits = vec![pick(&cfg, 1, 7), pick(&cfg, 1, 8)];
        let took = b.take(logits, 0.01, |seen, t| {
            seen.push(t);
            true
        });
        assert_eq!(took.ended.len(), 1, "the third had no logits");
        assert!(matches!(&took.ended[0], Ended::Failed(e, _) if e.job.is_empty()));
        assert_eq!(b.len(), 2);
        b.plan(0);
        let items = b.rounds_items();
        assert_eq!(items.len(), 2);
        assert!(items.iter().all(|i| i.tokens.len() == 1 && i.logits == 1));
        drop(items);
        let took = b.take(vec![pick(&cfg, 1, 9), pick(&cfg, 1, 9)], 0.01, |seen, t| {
            seen.push(t);
            seen != &[8, 9]
        });
        // The first reached its two tokens; the second's caller left at its second.
        let ends: Vec<(Vec<u32>, StopReason)> = took
            .ended
            .into_iter()
            .map(|e| match e {
                Ended::Finished(e, stop) => (e.job, stop),
                Ended::Failed(_, err) => panic!("{err}"),
            })
            .collect();
        assert_eq!(
            ends,
            vec![
                (vec![7, 9], StopReason::Length),
                (vec![8, 9], StopReason::Cancelled)
            ]
        );
        assert!(b.is_empty());
    }

    #[test]
    fn a_sequence_whose_keys_moved_runs_its_whole_text_again() {
        let cfg = LlamaConfig::small();
        let mut b: Batch<()> = Batch::new(&cfg, limits(1, 64));
        b.admit((), vec![1, 2, 3], opts(5, 0), 0).unwrap();
        assert_eq!(b.plan(0), 3);
        b.take(vec![pick(&cfg, 1, 4)], 0.01, |_, _| true);
        assert_eq!(b.plan(0), 1, "a token a pass");
        // Asked before planning: a token where the keys are, the whole text anywhere else.
        assert_eq!((b.rows_at(0), b.rows_at(1), b.text_rows()), (1, 4, 4));
        assert_eq!(b.plan(1), 4, "elsewhere: the prompt and the token again");
        assert_eq!(b.entries()[0].step.pass().start, 0);
    }

    #[test]
    fn failed_passes_regroup_until_too_many_in_a_row_give_the_batch_up() {
        let cfg = LlamaConfig::small();
        let mut b: Batch<u8> = Batch::new(&cfg, limits(2, 64));
        b.admit(1, vec![1], opts(5, 0), 0).unwrap();
        b.admit(2, vec![2], opts(5, 0), 0).unwrap();
        assert!(matches!(b.failed(), AfterFailure::Regroup));
        b.plan(0);
        b.take(vec![pick(&cfg, 1, 3), pick(&cfg, 1, 3)], 0.01, |_, _| true);
        assert_eq!(b.failures(), 0, "a pass that ran clears the count");
        for _ in 1..MAX_PASS_FAILURES {
            assert!(matches!(b.failed(), AfterFailure::Regroup));
        }
        match b.failed() {
            AfterFailure::GiveUp(gone) => {
                assert_eq!(gone.iter().map(|e| e.job).collect::<Vec<_>>(), vec![1, 2])
            }
            AfterFailure::Regroup => panic!("the third failure in a row gives up"),
        }
        assert!(b.is_empty());
    }
}
