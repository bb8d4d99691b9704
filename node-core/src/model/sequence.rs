//! One sequence's decoding, with no I/O: what its next forward pass runs, and what that pass's
//! logits emit (drafts included). Every leader drives it: the in-process and CLI generation
//! loop (`crate::lead::generate_async`), the API's batch, the browser's prompt box.

use super::speculate::{self, DEFAULT_DRAFT_COST, DraftLength, SpecStats};
use super::{
    GenerateOptions, LlamaConfig, ModelError, Pass, Sampler, StopReason, TokenConstraint,
    TokenLogprob, token_logprob,
};

/// A sequence being decoded: its text so far, the tokens its next pass runs and how many
/// positions the model holds of it.
#[derive(Debug)]
pub struct Sequence {
    sampler: Sampler,
    opts: GenerateOptions,
    vocab: usize,
    max_seq: usize,
    prompt_tokens: usize,
    /// The prompt, then every token emitted (what drafts are looked up in).
    text: Vec<u32>,
    /// Tokens the next pass runs: the prompt, then each new token and its draft.
    input: Vec<u32>,
    /// The drafted tokens at the end of `input`.
    draft: usize,
    /// What the lookup proposed for the next pass (drafted or not: its first `draft` tokens).
    proposal: Vec<u32>,
    /// How long its drafts are, following how they fare.
    drafts: DraftLength,
    /// Positions the model holds of the sequence.
    held: usize,
    passes: usize,
    speculation: SpecStats,
    /// Each emitted token's log-probability is computed, with this many alternatives.
    logprobs: Option<usize>,
    /// The prompt's log-probabilities are computed from its first pass (every row's logits),
    /// with this many alternatives, until they are taken.
    echo: Option<usize>,
    /// The prompt's log-probabilities, once its first pass ran ([`Self::take_prompt_logprobs`]).
    prompt_logprobs: Option<Vec<TokenLogprob>>,
    /// What the output must follow: it masks each row before sampling.
    constraint: Option<Box<dyn TokenConstraint>>,
}

/// What one pass's logits did to a sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Taken {
    /// Tokens emitted (handed to the caller's `on_token`).
    pub emitted: usize,
    /// Tokens the pass drafted, and of those, kept.
    pub drafted: usize,
    /// Drafted tokens kept.
    pub kept: usize,
    /// Why the sequence ended, if it did.
    pub stop: Option<StopReason>,
}

impl Sequence {
    /// A sequence that completes `prompt` under `opts` on a model of `cfg`; its first pass
    /// runs the whole prompt.
    pub fn new(
        prompt: Vec<u32>,
        opts: GenerateOptions,
        cfg: &LlamaConfig,
    ) -> Result<Self, ModelError> {
        if prompt.is_empty() {
            return Err(ModelError::Config("an empty prompt".into()));
        }
        if prompt.len() > cfg.max_seq {
            return Err(ModelError::Config(format!(
                "a prompt of {} tokens is longer than the model's context of {}",
                prompt.len(),
                cfg.max_seq
            )));
        }
        Ok(Self {
            sampler: Sampler::new(opts.sampling)?,
            drafts: DraftLength::new(opts.draft, DEFAULT_DRAFT_COST),
            proposal: Vec::new(),
            vocab: cfg.vocab,
            max_seq: cfg.max_seq,
            prompt_tokens: prompt.len(),
            input: prompt.clone(),
            text: prompt,
            opts,
            draft: 0,
            held: 0,
            passes: 0,
            speculation: SpecStats::default(),
            logprobs: None,
            echo: None,
            prompt_logprobs: None,
            constraint: None,
        })
    }

    /// Computes each emitted token's log-probability (of the raw logits' softmax), with the
    /// `top` likeliest tokens at its position; only a sequence asked for them pays for them.
    pub fn want_logprobs(&mut self, top: usize) {
        self.logprobs = Some(top);
    }

    /// Computes the prompt's log-probabilities too, with the `top` likeliest tokens at each
    /// position: its first pass returns every row's logits. Only before that pass.
    pub fn want_echo(&mut self, top: usize) {
        if self.passes == 0 {
            self.echo = Some(top);
        }
    }

    /// The prompt's log-probabilities, once its first pass ran (each token after the first,
    /// whose log-probability has nothing to condition on), if they were asked for; once.
    pub fn take_prompt_logprobs(&mut self) -> Option<Vec<TokenLogprob>> {
        self.prompt_logprobs.take()
    }

    /// Makes the output follow `constraint`: it masks every row before sampling, and the
    /// sequence drafts nothing (each token's mask follows the one before).
    pub fn constrain(&mut self, constraint: Box<dyn TokenConstraint>) {
        self.constraint = Some(constraint);
        self.opts.draft = 0;
        self.drafts = DraftLength::new(0, DEFAULT_DRAFT_COST);
        self.draft = 0;
        self.proposal.clear();
    }

    /// Drafted tokens the next pass checks.
    pub fn drafted(&self) -> usize {
        self.draft
    }

    /// The next forward pass: its tokens at the positions after those held, and a row of
    /// logits for the last token held and each drafted one.
    pub fn pass(&self) -> Pass<'_> {
        Pass {
            start: self.held,
            tokens: &self.input,
            logits: self.rows(),
        }
    }

    /// Rows of logits the next pass gives: every one of the prompt's when its log-probabilities
    /// are wanted, else the last token's and each drafted one's.
    fn rows(&self) -> usize {
        match self.echo {
            Some(_) if self.held == 0 => self.input.len(),
            _ => 1 + self.draft,
        }
    }

    /// Takes the logits of [`Self::pass`]: keeps the draft's agreeing prefix and one token the
    /// sampler picks, hands each to `on_token` (false stops the sequence), forgets the drafted
    /// positions the model did not keep and drafts the next pass.
    pub fn take(
        &mut self,
        logits: &[f32],
        on_token: &mut dyn FnMut(u32) -> bool,
    ) -> Result<Taken, ModelError> {
        self.take_scored(logits, &mut |t, _| on_token(t))
    }

    /// [`Self::take`], each token handed to `on_token` with its log-probability where they
    /// were asked for ([`Self::want_logprobs`]).
    pub fn take_scored(
        &mut self,
        logits: &[f32],
        on_token: &mut dyn FnMut(u32, Option<TokenLogprob>) -> bool,
    ) -> Result<Taken, ModelError> {
        let rows = self.rows();
        if logits.len() != rows * self.vocab {
            return Err(ModelError::Config(format!(
                "a forward pass gave {} logits for {rows} rows of {}",
                logits.len(),
                self.vocab
            )));
        }
        let logits = match self.echo.take() {
            Some(top) if self.held == 0 => {
                // Row i follows token i: it scores token i + 1; the last row samples.
                let scored = (logits.chunks_exact(self.vocab))
                    .zip(&self.input[1..])
                    .map(|(row, &t)| token_logprob(row, t, top))
                    .collect();
                self.prompt_logprobs = Some(scored);
                &logits[(rows - 1) * self.vocab..]
            }
            _ => logits,
        };
        let drafted = &self.input[self.input.len() - self.draft..];
        let emit = match self.constraint.as_mut() {
            Some(c) => {
                // No drafts: one row, masked before it is sampled.
                let mut row = logits.to_vec();
                c.mask(&mut row).map_err(ModelError::Sampling)?;
                vec![self.sampler.sample(&row)]
            }
            None => speculate::accept(&mut self.sampler, logits, self.vocab, drafted),
        };
        let complete = match (self.constraint.as_mut(), emit.first()) {
            (Some(c), Some(&t)) if !self.opts.stop_ids.contains(&t) => {
                c.commit(t).map_err(ModelError::Sampling)?
            }
            _ => false,
        };
        let kept = emit.len() - 1;
        self.drafts.observe(&self.proposal, &emit);
        self.held += self.input.len() - (self.draft - kept);
        self.passes += 1;
        self.speculation.drafted += self.draft as u64;
        self.speculation.accepted += kept as u64;
        let mut taken = Taken {
            emitted: 0,
            drafted: self.draft,
            kept,
            stop: None,
        };
        self.draft = 0;
        self.input.clear();
        for (row, next) in emit.into_iter().enumerate() {
            if self.generated() >= self.opts.max_tokens {
                break;
            }
            if self.opts.stop_ids.contains(&next) {
                taken.stop = Some(StopReason::Stop);
                return Ok(taken);
            }
            self.text.push(next);
            taken.emitted += 1;
            let scored = self.logprobs.map(|top| {
                let row = &logits[row * self.vocab..(row + 1) * self.vocab];
                token_logprob(row, next, top)
            });
            if !on_token(next, scored) {
                taken.stop = Some(StopReason::Cancelled);
                return Ok(taken);
            }
        }
        if complete && taken.emitted > 0 {
            // The constraint's output is whole: nothing but its end may follow.
            taken.stop = Some(StopReason::Stop);
        } else if self.generated() >= self.opts.max_tokens {
            taken.stop = Some(StopReason::Length);
        } else if self.held >= self.max_seq {
            taken.stop = Some(StopReason::Context);
        } else {
            // The last token, then drafts that fit the context and the tokens still wanted.
            let room = (self.max_seq - self.held - 1)
                .min(self.opts.max_tokens - self.generated() - 1)
                .min(self.opts.draft);
            self.proposal = speculate::draft(&self.text, room);
            self.draft = self.drafts.length(self.proposal.len());
            self.input.extend(self.text.last().copied());
            self.input.extend_from_slice(&self.proposal[..self.draft]);
        }
        Ok(taken)
    }

    /// Starts again from nothing held: the whole text runs in the next pass, wherever that
    /// runs (what was held lives elsewhere now).
    pub fn restart(&mut self) {
        self.held = 0;
        self.draft = 0;
        self.proposal.clear();
        self.input.clone_from(&self.text);
    }

    /// Tells the sequence what a drafted row costs now, as a share of a pass of one token
    /// ([`speculate::DraftCost`]): its drafts are as long as pays at that cost.
    pub fn set_draft_cost(&mut self, cost: f64) {
        self.drafts.set_cost(cost);
    }

    /// Positions the model holds of the sequence.
    pub fn held(&self) -> usize {
        self.held
    }

    /// Tokens of the prompt.
    pub fn prompt_tokens(&self) -> usize {
        self.prompt_tokens
    }

    /// Tokens of its text so far: the prompt and those generated.
    pub fn text_len(&self) -> usize {
        self.text.len()
    }

    /// Tokens generated so far.
    pub fn generated(&self) -> usize {
        self.text.len() - self.prompt_tokens
    }

    /// The tokens generated.
    pub fn into_generated(mut self) -> Vec<u32> {
        self.text.split_off(self.prompt_tokens)
    }

    /// Forward passes whose logits were taken.
    pub fn passes(&self) -> usize {
        self.passes
    }

    /// How the drafts did.
    pub fn speculation(&self) -> SpecStats {
        self.speculation
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

    use super::*;
    use crate::model::SamplingParams;

    const VOCAB: usize = 8;

    fn cfg() -> LlamaConfig {
        LlamaConfig {
            vocab: VOCAB,
            max_seq: 12,
            ..LlamaConfig::smollm2_135m()
        }
    }

    /// Logits whose argmax is `next(token)` for each of the pass's last `rows` tokens.
    fn answer(pass: &Pass<'_>, next: impl Fn(u32) -> u32) -> Vec<f32> {
        let last = &pass.tokens[pass.tokens.len() - pass.logits..];
        let mut out = vec![0.0; last.len() * VOCAB];
        for (i, &t) in last.iter().enumerate() {
            out[i * VOCAB + next(t) as usize] = 1.0;
        }
        out
    }

    fn opts(max_tokens: usize, draft: usize, stop_ids: Vec<u32>) -> GenerateOptions {
        GenerateOptions {
            max_tokens,
            sampling: SamplingParams::default(),
            stop_ids,
            draft,
        }
    }

    #[test]
    fn a_sequence_drafts_from_its_text_keeps_what_agrees_and_forgets_the_rest() {
        // A model that counts 1, 2, 3, 1, 2, 3, …: after "1 2 3 1 2" the text's own "1 2 3"
        // drafts "3 1 2" and every drafted token is kept.
        let mut s = Sequence::new(vec![1, 2, 3, 1], opts(8, 4, vec![]), &cfg()).unwrap();
        // Drafted rows that cost nothing: every proposed token is drafted.
        s.set_draft_cost(0.0);
        let count = |t: u32| t % 3 + 1;
        let first = s.pass();
        assert_eq!(
            (first.start, first.tokens, first.logits),
            (0, &[1, 2, 3, 1][..], 1)
        );
        let logits = answer(&first, count);
        let mut out = Vec::new();
        let t = s
            .take(&logits, &mut |x| {
                out.push(x);
                true
            })
            .unwrap();
        assert_eq!((t.emitted, t.drafted, t.stop), (1, 0, None));
        // "… 1 2": the tail "1 2" occurred before, followed by "3 1 2".
        let p = s.pass();
        assert_eq!((p.start, p.tokens, p.logits), (4, &[2, 3, 1, 2][..], 4));
        let logits = answer(&p, count);
        let t = s
            .take(&logits, &mut |x| {
                out.push(x);
                true
            })
            .unwrap();
        assert_eq!((t.drafted, t.kept, t.emitted), (3, 3, 4));
        assert_eq!(s.held(), 8);
        // A model that disagrees with every draft: one token a pass, the drafts forgotten.
        let p = s.pass();
        let start = p.start;
        let logits = answer(&p, |_| 7);
        let t = s
            .take(&logits, &mut |x| {
                out.push(x);
                true
            })
            .unwrap();
        assert_eq!(t.kept, 0);
        assert_eq!(
            s.held(),
            start + 1,
            "only the last token's position is held"
        );
        assert_eq!(out, vec![2, 3, 1, 2, 3, 7]);
        assert_eq!(s.generated(), 6);
        assert_eq!(s.speculation().accepted, 3);
    }

    #[test]
    fn a_sequence_stops_at_its_length_a_stop_token_its_context_or_its_caller() {
        let cfg = cfg();
        let step = |s: &mut Sequence, next: u32, go: bool| {
            let logits = answer(&s.pass(), |_| next);
            s.take(&logits, &mut |_| go).unwrap()
        };
        let mut s = Sequence::new(vec![1], opts(2, 0, vec![]), &cfg).unwrap();
        assert_eq!(step(&mut s, 4, true).stop, None);
        assert_eq!(step(&mut s, 5, true).stop, Some(StopReason::Length));
        assert_eq!(s.into_generated(), vec![4, 5]);
        let mut s = Sequence::new(vec![1], opts(9, 0, vec![6]), &cfg).unwrap();
        let t = step(&mut s, 6, true);
        assert_eq!((t.stop, t.emitted), (Some(StopReason::Stop), 0));
        let mut s = Sequence::new(vec![1], opts(9, 0, vec![]), &cfg).unwrap();
        assert_eq!(step(&mut s, 4, false).stop, Some(StopReason::Cancelled));
        let mut s = Sequence::new(vec![1; 11], opts(9, 0, vec![]), &cfg).unwrap();
        assert_eq!(step(&mut s, 4, true).stop, None);
        assert_eq!(step(&mut s, 4, true).stop, Some(StopReason::Context));
        assert!(Sequence::new(vec![1; 13], opts(9, 0, vec![]), &cfg).is_err());
        // Logits of the wrong shape are an error, not a token.
        let mut s = Sequence::new(vec![1], opts(9, 0, vec![]), &cfg).unwrap();
        assert!(s.take(&[0.0; VOCAB + 1], &mut |_| true).is_err());
    }

    #[test]
    fn a_restarted_sequence_runs_its_whole_text_again() {
        let mut s = Sequence::new(vec![1, 2], opts(9, 0, vec![]), &cfg()).unwrap();
        let logits = answer(&s.pass(), |_| 3);
        s.take(&logits, &mut |_| true).unwrap();
        s.restart();
        let p = s.pass();
        assert_eq!((p.start, p.tokens, p.logits), (0, &[1, 2, 3][..], 1));
    }
}
