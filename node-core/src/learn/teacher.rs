//! The one hand-off from a leader's gradients to what the mesh gossips, for every leader (the
//! API's trainer, `generate --bootstrap`, the browser's prompt box, the learning bench): the
//! learner folds the gradients in, the canary gate judges the update that falls due as the
//! mesh's shards would take it, and a refused (or unjudged) update is forgotten by the
//! learner, so it steers no later step.

use super::replay::Replay;
use super::{
    AdapterSums, CanaryGate, Learner, Pending, Published, Trained, Update, UpdateError, Verdict,
};
use crate::coded::ShardFormat;
use crate::model::{Gradients, LinearExec, Llama, ModelError, Soft, Tokenizer};

/// Most times a DiLoCo round the canary gate refuses is halved and judged again.
pub const BACKOFFS: u32 = 3;

/// What one minibatch taught ([`Teacher::learn`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Studied {
    /// The minibatch's loss before it was trained on (nats per predicted token).
    pub loss: f64,
    /// Positions of the minibatch.
    pub positions: usize,
    /// Training passes it took (a DiLoCo round's inner steps).
    pub passes: u32,
    /// The update that fell due, for the gate and the mesh.
    pub due: Option<Published>,
}

/// Why a minibatch taught nothing.
#[derive(Debug, thiserror::Error)]
pub enum TeachError {
    /// A training pass through the group failed.
    #[error("the training pass failed: {0}")]
    Pass(#[from] ModelError),
    /// The gradient could not become an update.
    #[error("the update could not be made: {0}")]
    Update(#[from] UpdateError),
}

/// A leader's learning: its learner and, unless turned off, its canary gate.
#[derive(Debug)]
pub struct Teacher {
    learner: Learner,
    gate: Option<CanaryGate>,
    format: ShardFormat,
    rehearsal: Option<Rehearsal>,
    /// Lessons already trained on, a few taught again each minibatch.
    replay: Option<Replay>,
    /// A next token the model already gives less loss than this (nats) is not taught.
    floor: f64,
}

/// General text a trainer mixes into every minibatch, a window at a time, so what users teach
/// does not wear away what the model knew (docs/coding.md, "Facts and rehearsal").
#[derive(Debug, Clone)]
struct Rehearsal {
    tokens: Vec<u32>,
    window: usize,
    next: usize,
    /// Where each window is taught a blend of its next tokens and the model's own
    /// distributions ([`ANCHOR_TOP`] tokens a position): the next tokens' share.
    distil: Option<f32>,
    /// Per window, the distributions of the model as the trainer first trained it (made at
    /// the first round, when `distil`).
    anchors: Vec<Soft>,
}

impl Rehearsal {
    /// The windows: `tokens` cut into runs of `window`, the tail left out.
    fn windows(&self) -> impl Iterator<Item = &[u32]> {
        self.tokens.chunks_exact(self.window)
    }
}

/// The target a rehearsal position is taught: `share` on the text's `next` token, the rest
/// spread as the model's own `own` distribution, summing to 1.
fn blend(own: Vec<(u32, f32)>, next: u32, share: f32) -> Vec<(u32, f32)> {
    let mass: f32 = own.iter().map(|&(_, p)| p).sum();
    let mut q: Vec<(u32, f32)> = if mass > 0.0 {
        own.into_iter()
            .map(|(id, p)| (id, (1.0 - share) * p / mass))
            .collect()
    } else {
        Vec::new()
    };
    let share = if q.is_empty() { 1.0 } else { share };
    match q.iter_mut().find(|(id, _)| *id == next) {
        Some((_, p)) => *p += share,
        None => q.push((next, share)),
    }
    q
}

/// Tokens of the model's own distribution a rehearsal position is taught (distillation, so a
/// trainer rehearsing the same text for hours anchors the model where it was rather than
/// learning that text by heart: docs/coding.md, "Facts and rehearsal").
pub const ANCHOR_TOP: usize = 16;

/// The general prose a trainer rehearses ([`Teacher::with_rehearsal`]): none of it the canary,
/// a test's taught passage or the learning bench's held-out text.
pub const REHEARSAL_TEXT: &str = include_str!("rehearsal.txt");

/// Positions of rehearsal text a minibatch takes.
pub const REHEARSAL_TOKENS: usize = 64;

/// A next token the model gives less loss than this (nats) is known: a mesh's trainers do not
/// teach it further ([`Teacher::with_floor`]). Half a nat, not 0.7: a fact's answer then leads
/// the likeliest other token by 1.4–1.8 nats, kept over 1,000 chats while the gate's budget,
/// spent by 400 of them, stops further learning (docs/coding.md).
pub const KNOWN_NATS: f64 = 0.5;

/// The rehearsal text as `tokenizer` cuts it.
pub fn rehearsal_tokens(tokenizer: &Tokenizer) -> Result<Vec<u32>, ModelError> {
    tokenizer.encode(REHEARSAL_TEXT)
}

/// What the gate made of a due update.
#[derive(Debug, Clone, PartialEq)]
pub enum Judged {
    /// Publish it: the gate passed it (its verdict), or there is no gate.
    Publish(Box<Published>, Option<Verdict>),
    /// The gate refused it (why, and its verdict); the learner forgot it.
    Refused(String, Verdict),
}

impl Teacher {
    /// A teacher folding into `learner`, judging with `gate` (none: every update goes out),
    /// for shards stored as `format`.
    pub fn new(learner: Learner, gate: Option<CanaryGate>, format: ShardFormat) -> Self {
        Self {
            learner,
            gate,
            format,
            rehearsal: None,
            replay: None,
            floor: 0.0,
        }
    }

    /// The same teacher keeping up to `lessons` of what it trained on and teaching
    /// `positions` of them again in every minibatch ([`Replay`]).
    pub fn with_replay(mut self, lessons: usize, positions: usize) -> Self {
        self.replay = (lessons > 0 && positions >= 2).then(|| Replay::new(lessons, positions, 79));
        self
    }

    /// Positions a minibatch takes besides the requests it trains on: rehearsal and lessons
    /// taught again (what a caller leaves room for within [`crate::lead::training::minibatch_tokens`]).
    pub fn extra_positions(&self) -> usize {
        self.rehearsal.as_ref().map_or(0, |r| r.window)
            + self.replay.as_ref().map_or(0, Replay::positions)
    }

    /// The same teacher leaving untaught every next token the model already gives a loss
    /// below `nats` (docs/coding.md, "Facts and rehearsal"): what is known is not pushed
    /// further, so the adapters stop moving for text the mesh has learnt.
    pub fn with_floor(mut self, nats: f64) -> Self {
        self.floor = nats.max(0.0);
        self
    }

    /// The same teacher taking back, with each round it publishes, `share` of how far its
    /// updates so far moved the adapters (a decay towards the genesis model: docs/coding.md,
    /// "Facts and rehearsal"), where the mesh runs DiLoCo rounds.
    pub fn with_decay(mut self, share: f32) -> Self {
        self.learner.decay(share);
        self
    }

    /// The same teacher lowering its outer rate as its rounds go out: half after `rounds`
    /// published rounds ([`super::Outer::anneal`]); 0 keeps it.
    pub fn with_anneal(mut self, rounds: u32) -> Self {
        self.learner.anneal(rounds);
        self
    }

    /// The same teacher sending an adapter entry's step only where its recent rounds agree on
    /// it by `threshold` ([`super::Outer::consensus`]); 0 sends every entry.
    pub fn with_consensus(mut self, threshold: f32) -> Self {
        self.learner.consensus(threshold);
        self
    }

    /// The same teacher moving only the adapters `trained` names.
    pub fn training(mut self, trained: Trained) -> Self {
        self.learner.train(trained);
        self
    }

    /// The same teacher mixing a `window` of `tokens` (the rehearsal text as the model's
    /// tokenizer cuts it), the next each time, into every minibatch it trains on.
    pub fn with_rehearsal(mut self, tokens: Vec<u32>, window: usize) -> Self {
        self.rehearsal = (window >= 2 && tokens.len() >= window).then_some(Rehearsal {
            tokens,
            window,
            next: 0,
            distil: None,
            anchors: Vec::new(),
        });
        self
    }

    /// The same teacher teaching each rehearsal window a blend of its next tokens (`share`
    /// of each target, 0 to 1) and the model's own next-token distributions ([`ANCHOR_TOP`]
    /// tokens), the model as it was when this trainer first trained, rather than the next
    /// tokens alone (distillation: docs/coding.md, "Facts and rehearsal").
    pub fn distilling(mut self, share: f32) -> Self {
        if let Some(r) = self.rehearsal.as_mut() {
            r.distil = Some(share.clamp(0.0, 1.0));
        }
        self
    }

    /// The same teacher rehearsing as every trainer of a mesh does: [`REHEARSAL_TOKENS`] of
    /// [`REHEARSAL_TEXT`] as `tokenizer` cuts it, a minibatch.
    pub fn rehearsing(self, tokenizer: &Tokenizer) -> Result<Self, ModelError> {
        Ok(self.with_rehearsal(rehearsal_tokens(tokenizer)?, REHEARSAL_TOKENS))
    }

    /// The same teacher training as every trainer of a mesh does: rehearsing
    /// ([`Self::rehearsing`]) and, where Adam trains the adapters, moving those of
    /// [`Trained::MESH`] and leaving untaught what the model knows within [`KNOWN_NATS`]
    /// (measured there: docs/coding.md, "Facts and rehearsal"); an SGD mesh's every request
    /// is taught whole, as before.
    pub fn for_mesh(self, tokenizer: &Tokenizer) -> Result<Self, ModelError> {
        let teacher = self.rehearsing(tokenizer)?;
        if !teacher.learner.adapters() {
            return Ok(teacher);
        }
        Ok(teacher.training(Trained::MESH).with_floor(KNOWN_NATS))
    }

    /// Measures the rehearsal windows' anchors on `llama` over `exec` if they are due (a
    /// distilling teacher's first round): a forward pass a window.
    async fn anchor<E: LinearExec>(
        &mut self,
        llama: &Llama,
        exec: &mut E,
    ) -> Result<(), ModelError> {
        let Some(r) = self.rehearsal.as_mut() else {
            return Ok(());
        };
        let Some(share) = r.distil.filter(|_| r.anchors.is_empty()) else {
            return Ok(());
        };
        let mut anchors = Vec::new();
        for w in r.windows() {
            let own = llama.next_distributions(exec, w, ANCHOR_TOP).await?;
            let taught = own
                .into_iter()
                .zip(&w[1..])
                .map(|(p, &next)| blend(p, next, share));
            anchors.push(taught.collect());
        }
        tracing::info!(
            windows = anchors.len(),
            "rehearsal anchored to the model's own distributions"
        );
        r.anchors = anchors;
        Ok(())
    }

    /// The next window of rehearsal text and what it is taught (`None`: its next tokens), if
    /// the teacher rehearses.
    fn rehearse(&mut self) -> Option<(Vec<u32>, Option<&Soft>)> {
        let r = self.rehearsal.as_mut()?;
        if r.next + r.window > r.tokens.len() {
            r.next = 0;
        }
        let at = r.next / r.window;
        let window = r.tokens[r.next..r.next + r.window].to_vec();
        r.next += r.window;
        Some((window, r.anchors.get(at)))
    }

    /// Folds one request's (or minibatch's) gradient in; the update when one is due.
    pub fn fold(&mut self, grads: Gradients) -> Result<Option<Published>, UpdateError> {
        self.learner.push(grads)
    }

    /// Where a training pass hands each stage's gradient, for [`Self::fold_summed`] (`None`:
    /// this learner takes whole gradients, through [`Self::fold`]).
    pub fn stage_sink(&self) -> Option<AdapterSums> {
        self.learner.stage_sink()
    }

    /// [`Self::fold`] for a gradient whose stages went into `sums` ([`Self::stage_sink`]).
    pub fn fold_summed(
        &mut self,
        grads: Gradients,
        sums: AdapterSums,
    ) -> Result<Option<Published>, UpdateError> {
        self.learner.push_summed(grads, sums)
    }

    /// What is folded in and not yet out, as an update now (at the end of a session or when
    /// requests stop), if anything.
    pub fn flush(&mut self) -> Result<Option<Published>, UpdateError> {
        self.learner.flush()
    }

    /// Requests folded in and not yet published.
    pub fn pending(&self) -> u32 {
        self.learner.pending()
    }

    /// Trains on `seqs` (the distinct texts of `requests` requests) over `exec`: one pass
    /// whose gradient is folded in, or, where the mesh runs DiLoCo rounds, `H` inner Adam
    /// steps, each pass with the steps before it added to the group's answers, and their outer
    /// step (docs/coding.md, "DiLoCo in the mesh"). A round that fails teaches nothing.
    pub async fn learn<E: LinearExec>(
        &mut self,
        llama: &Llama,
        exec: &mut E,
        seqs: &[&[u32]],
        requests: usize,
    ) -> Result<Studied, TeachError> {
        self.anchor(llama, exec).await?;
        let again = self.replay.as_mut().map(Replay::draw).unwrap_or_default();
        let studied = self.study(llama, exec, seqs, &again, requests).await;
        if studied.is_ok()
            && let Some(r) = self.replay.as_mut()
        {
            r.offer(seqs);
        }
        studied
    }

    /// [`Self::learn`] on `seqs` and the lessons taught `again`, with the next rehearsal
    /// window.
    async fn study<E: LinearExec>(
        &mut self,
        llama: &Llama,
        exec: &mut E,
        seqs: &[&[u32]],
        again: &[Vec<u32>],
        requests: usize,
    ) -> Result<Studied, TeachError> {
        let rehearsed = self.rehearse().map(|(w, soft)| (w, soft.cloned()));
        let mut soft: Vec<Option<&Soft>> = vec![None; seqs.len() + again.len()];
        let mut mixed: Vec<&[u32]> = seqs
            .iter()
            .copied()
            .chain(again.iter().map(Vec::as_slice))
            .collect();
        if let Some((r, taught)) = &rehearsed {
            mixed.push(r.as_slice());
            soft.push(taught.as_ref());
        }
        let seqs = &mixed[..];
        let Some(inner) = self.learner.inner_steps() else {
            // With Adam on the adapters each stage's gradient is summed as it is made, so the
            // pass keeps none of its factors (the leader's memory, docs/models.md).
            let mut sums = self.stage_sink();
            let mut g = match sums.as_mut() {
                Some(sink) => {
                    llama
                        .gradients_soft_into(exec, seqs, &soft, self.floor, sink)
                        .await?
                }
                None => {
                    llama
                        .gradients_soft_batch(exec, seqs, &soft, self.floor)
                        .await?
                }
            };
            // The step follows how many asked, not how many distinct texts they sent.
            g.sequences = requests;
            let (loss, positions) = (g.loss, g.t);
            let due = match sums {
                Some(sums) => self.fold_summed(g, sums)?,
                None => self.fold(g)?,
            };
            return Ok(Studied {
                loss,
                positions,
                passes: 1,
                due,
            });
        };
        self.learner.begin_round();
        let round = self.round(llama, exec, seqs, &soft, requests, inner).await;
        if round.is_err() {
            self.learner.refuse_last();
        }
        round
    }

    /// A DiLoCo round's `inner` steps and its outer step ([`Self::learn`]).
    async fn round<E: LinearExec>(
        &mut self,
        llama: &Llama,
        exec: &mut E,
        seqs: &[&[u32]],
        soft: &[Option<&Soft>],
        requests: usize,
        inner: u32,
    ) -> Result<Studied, TeachError> {
        let mut sum: Option<Update> = None;
        let mut first = None;
        for _ in 0..inner {
            let mut sums = AdapterSums::new(llama.config());
            let mut g = match &sum {
                Some(u) => {
                    let mut pending = Pending::new(exec, u, llama.config(), self.format);
                    llama
                        .gradients_soft_into(&mut pending, seqs, soft, self.floor, &mut sums)
                        .await?
                }
                None => {
                    llama
                        .gradients_soft_into(exec, seqs, soft, self.floor, &mut sums)
                        .await?
                }
            };
            g.sequences = requests;
            first.get_or_insert((g.loss, g.t));
            let step = self.learner.inner_step(&g, sums)?;
            match sum.as_mut() {
                Some(acc) => super::add_step(acc, &step)?,
                None => sum = Some(step),
            }
        }
        let (Some(sum), Some((loss, positions))) = (sum, first) else {
            return Err(
                UpdateError::Settings("a round takes at least one inner step".into()).into(),
            );
        };
        let requests = u32::try_from(requests.max(1)).unwrap_or(u32::MAX);
        Ok(Studied {
            loss,
            positions,
            passes: inner,
            due: Some(self.learner.end_round(sum, requests)?),
        })
    }

    /// Runs a due update through the gate on `llama` over `exec` (a group at `version`). A
    /// DiLoCo round the gate refuses is judged again at half its size, up to [`BACKOFFS`]
    /// times (a forward pass of the canary each): a round moves further than one step, and
    /// what the gate bounds is how far. A refused update, or one the gate could not measure
    /// (the error), is forgotten.
    pub async fn judge<E: LinearExec>(
        &mut self,
        llama: &Llama,
        exec: &mut E,
        version: [u8; 32],
        mut published: Published,
    ) -> Result<Judged, ModelError> {
        let Some(gate) = self.gate.as_mut() else {
            return Ok(Judged::Publish(Box::new(published), None));
        };
        let backoffs = if self.learner.inner_steps().is_some() {
            BACKOFFS
        } else {
            0
        };
        let mut tries = 0;
        loop {
            let judged = (&published.update, self.learner.give_back());
            let verdict = match gate
                .judge_giving_back(llama, exec, version, judged, self.format)
                .await
            {
                Ok(v) => v,
                Err(e) => {
                    self.learner.refuse_last();
                    return Err(e);
                }
            };
            match verdict.refusal() {
                None => return Ok(Judged::Publish(Box::new(published), Some(verdict))),
                Some(why) if tries < backoffs && verdict.after.is_finite() => {
                    tries += 1;
                    tracing::info!("offering a round again at half its size: {why}");
                    super::diloco::halve(&mut published.update);
                    self.learner.halved();
                }
                Some(why) => {
                    self.learner.refuse_last();
                    return Ok(Judged::Refused(why, verdict));
                }
            }
        }
    }

    /// Forgets the update last made: it could not be judged or published.
    pub fn drop_last(&mut self) {
        self.learner.refuse_last();
    }

    /// The update last made is out: it can no longer be forgotten.
    pub fn keep_last(&mut self) {
        self.learner.keep_last();
    }

    /// The mesh moved to `version` by publishing an update the gate judged with `verdict`:
    /// the gate's loss there is the one it measured after it.
    pub fn published(&mut self, version: [u8; 32], verdict: Option<&Verdict>) {
        if let (Some(gate), Some(v)) = (self.gate.as_mut(), verdict) {
            gate.gave_back(v.given_back);
            gate.moved_to(version, v.after);
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    #![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

    use futures::executor::block_on;

    use super::*;
    use crate::code::Generator;
    use crate::coded::{CodedGroup, InProcess};
    use crate::learn::LearningConfig;
    use crate::model::{HEAD_BYTES, KEEP_BYTES, LeaderWeights, LlamaConfig, ModelWeights, Stage};

    pub(crate) fn config() -> LlamaConfig {
        LlamaConfig {
            hidden: 64,
            ffn: 128,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            vocab: 96,
            norm_eps: 1e-5,
            rope_theta: 10_000.0,
            max_seq: 64,
            tied_embeddings: false,
            family: crate::model::Family::Llama,
            rope_freq_factors: Vec::new(),
        }
    }

    /// A coded group of a small random model, its leader's weights, and two gradients (of two
    /// texts).
    pub(crate) fn setup() -> (Llama, CodedGroup<InProcess>, [Gradients; 2]) {
        let weights = ModelWeights::synthetic(config(), 7).unwrap();
        let g = Generator::integer(3, 2, None).unwrap();
        let mesh = InProcess::encode(&weights, &g, ShardFormat::Q8, &|_, _| {}).unwrap();
        let mut group = CodedGroup::new(config(), g, &[0, 1], mesh).unwrap();
        let llama = Llama::new(config(), LeaderWeights::from_model(&weights)).unwrap();
        let grads = [7u32, 11].map(|m| {
            let tokens: Vec<u32> = (0..24).map(|i| i * m % 96).collect();
            block_on(llama.gradients(&mut group, &tokens)).unwrap()
        });
        (llama, group, grads)
    }

    /// The largest difference of `a` from `b`, relative to `b`'s largest value.
    fn rel(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        let scale = b.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-12);
        a.iter()
            .zip(b)
            .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
            / scale
    }

    #[test]
    fn running_blocks_again_and_the_head_in_runs_gives_the_whole_passs_gradients() {
        let (llama, mut group, _) = setup();
        let seqs: [&[u32]; 2] = [&[3, 17, 60, 42, 5, 9, 11, 80, 1], &[9, 5, 70, 2, 33]];
        let mut pass = |keep: usize, head: usize| {
            block_on(llama.gradients_within(&mut group, &seqs, keep, head)).unwrap()
        };
        let (loss, whole) = pass(KEEP_BYTES, HEAD_BYTES);
        // Every block run again from its input, and the head three rows at a time.
        let vocab = llama.config().vocab;
        let (lean_loss, lean) = pass(0, 3 * 4 * vocab);
        assert!(
            (loss - lean_loss).abs() < 1e-6 * loss.abs(),
            "{loss} {lean_loss}"
        );
        assert_eq!(whole.t, lean.t);
        assert_eq!(whole.stages.len(), lean.stages.len());
        for (a, b) in lean.stages.iter().zip(&whole.stages) {
            assert_eq!(a.stage, b.stage);
            assert!(rel(&a.x, &b.x) < 1e-4, "{:?} x", a.stage);
            for (p, q) in a.dy.iter().zip(&b.dy) {
                assert!(rel(p, q) < 1e-4, "{:?} dy", a.stage);
            }
        }
        assert!(rel(&lean.embed_dx, &whole.embed_dx) < 1e-4);
        for (p, q) in lean.norms.vectors().zip(whole.norms.vectors()) {
            assert!(rel(p, q) < 1e-4, "norm gains");
        }
        // The head's gradient covers every row: a run's rows are not lost at its edges.
        let head = lean.stages.last().unwrap();
        assert_eq!(head.stage, Stage::LmHead);
        assert_eq!(head.dy[0].len(), whole.t * vocab);
        // Forward only, the loss is the same.
        let forward = block_on(llama.sequence_loss(&mut group, seqs[0])).unwrap();
        let (one, _) =
            block_on(llama.gradients_within(&mut group, &seqs[..1], KEEP_BYTES, HEAD_BYTES))
                .unwrap();
        assert!((forward - one).abs() < 1e-6 * one.abs(), "{forward} {one}");
    }

    pub(crate) fn teacher(gate: Option<CanaryGate>) -> Teacher {
        let learner = Learner::new(LearningConfig::default(), config(), ShardFormat::Q8);
        Teacher::new(learner, gate, ShardFormat::Q8)
    }

    pub(crate) fn canary() -> Vec<u32> {
        (0..32).map(|i| (i * 5 % 96) as u32).collect()
    }

    #[test]
    fn a_refused_update_is_forgotten_and_steers_no_later_one() {
        let (llama, mut group, [g1, g2]) = setup();
        // Without a gate the first update goes out, and Adam's moments carry it into the
        // second: that one differs from the update of the second gradient alone.
        let mut open = teacher(None);
        let first = open.fold(g1.clone()).unwrap().unwrap();
        let judged = block_on(open.judge(&llama, &mut group, [0; 32], first.clone())).unwrap();
        assert!(judged == Judged::Publish(Box::new(first.clone()), None));
        let after_first = open.fold(g2.clone()).unwrap().unwrap();
        let alone = teacher(None).fold(g2.clone()).unwrap().unwrap();
        assert!(after_first != alone, "the moments carried nothing");
        // A gate that refuses everything: the refused update is forgotten, so the next one is
        // the second gradient's alone.
        let shut =
            CanaryGate::new(canary(), None).with_bounds(f64::NEG_INFINITY, f64::NEG_INFINITY);
        let mut gated = teacher(Some(shut));
        let made = gated.fold(g1).unwrap().unwrap();
        assert!(made == first, "the same gradient makes the same update");
        match block_on(gated.judge(&llama, &mut group, [0; 32], made)).unwrap() {
            Judged::Refused(why, verdict) => {
                assert!(!verdict.pass);
                assert!(why.contains("canary loss"), "{why}");
            }
            Judged::Publish(..) => panic!("a gate that refuses everything passed an update"),
        }
        let next = gated.fold(g2).unwrap().unwrap();
        assert!(next == alone, "the refused update steered the next one");
    }

    #[test]
    fn a_passed_update_carries_its_verdict_and_the_gate_follows_the_mesh() {
        let (llama, mut group, [grads, _]) = setup();
        let open = CanaryGate::new(canary(), None).with_bounds(f64::INFINITY, f64::INFINITY);
        let mut t = teacher(Some(open));
        let made = t.fold(grads).unwrap().unwrap();
        let verdict = match block_on(t.judge(&llama, &mut group, [0; 32], made)).unwrap() {
            Judged::Publish(_, Some(v)) => v,
            _ => panic!("a gate that passes everything refused, or gave no verdict"),
        };
        assert!(verdict.pass && verdict.before.is_finite() && verdict.after.is_finite());
        // At the version the update moved the mesh to, the gate remembers the loss after it.
        t.published([1; 32], Some(&verdict));
        let gate = t.gate.as_mut().unwrap();
        let at = block_on(gate.loss_at(&llama, &mut group, [1; 32])).unwrap();
        assert_eq!(at, verdict.after);
    }

    #[test]
    fn a_one_hot_distribution_teaches_what_the_next_token_does_and_bad_ones_are_refused() {
        let (llama, mut group, _) = setup();
        let taught: Vec<u32> = (0..12).map(|i| (i * 7 % 96) as u32).collect();
        let hard = block_on(llama.gradients_batch(&mut group, &[&taught])).unwrap();
        let one_hot: Soft = taught[1..].iter().map(|&id| vec![(id, 1.0)]).collect();
        let soft =
            block_on(llama.gradients_soft_batch(&mut group, &[&taught], &[Some(&one_hot)], 0.0))
                .unwrap();
        assert!(
            (hard.loss - soft.loss).abs() < 1e-9,
            "{} {}",
            hard.loss,
            soft.loss
        );
        assert_eq!(hard.stages.len(), soft.stages.len());
        for (a, b) in hard.stages.iter().zip(&soft.stages) {
            for (x, y) in a.dy.iter().flatten().zip(b.dy.iter().flatten()) {
                assert!((x - y).abs() <= 1e-6 * (1.0 + x.abs()), "{x} {y}");
            }
        }
        // A distribution that does not fit the sequence, names a token past the vocabulary or
        // a probability outside [0, 1] is an error, not a pass.
        let short: Soft = one_hot[1..].to_vec();
        let mut outside = one_hot.clone();
        outside[0] = vec![(96, 0.5)];
        let mut negative = one_hot.clone();
        negative[3] = vec![(1, -0.5)];
        for bad in [short, outside, negative] {
            let r =
                block_on(llama.gradients_soft_batch(&mut group, &[&taught], &[Some(&bad)], 0.0));
            assert!(r.is_err(), "a bad distribution was taught");
        }
    }

    #[test]
    fn a_distilling_teacher_anchors_rehearsal_to_the_model_it_first_trained() {
        let (llama, mut group, _) = setup();
        let taught: Vec<u32> = (0..12).map(|i| (i * 7 % 96) as u32).collect();
        let general: Vec<u32> = (0..20).map(|i| (i * 3 % 96) as u32).collect();
        let mut hard = teacher(None).with_rehearsal(general.clone(), 8);
        let mut distilling = teacher(None)
            .with_rehearsal(general.clone(), 8)
            .distilling(0.5);
        let by_text = block_on(hard.learn(&llama, &mut group, &[&taught], 1)).unwrap();
        let by_model = block_on(distilling.learn(&llama, &mut group, &[&taught], 1)).unwrap();
        assert!(
            by_text.due != by_model.due,
            "the anchors taught what the text does"
        );
        // Two whole windows, each position the text's next token blended with the model's
        // most likely ones, summing to 1.
        let anchors = &distilling.rehearsal.as_ref().unwrap().anchors;
        assert_eq!(anchors.len(), 2);
        for (w, soft) in general.as_chunks::<8>().0.iter().zip(anchors) {
            assert_eq!(soft.len(), w.len() - 1);
            for (p, &next) in soft.iter().zip(&w[1..]) {
                assert!(p.len() == ANCHOR_TOP || p.len() == ANCHOR_TOP + 1, "{p:?}");
                let mass: f32 = p.iter().map(|q| q.1).sum();
                assert!((mass - 1.0).abs() < 1e-5, "{mass}");
                let on_next = p.iter().find(|q| q.0 == next).unwrap().1;
                assert!(on_next >= 0.5, "{on_next}");
            }
        }
        // Measured once: a later round reuses them.
        let first = anchors.clone();
        block_on(distilling.learn(&llama, &mut group, &[&taught], 1)).unwrap();
        assert!(distilling.rehearsal.as_ref().unwrap().anchors == first);
    }

    #[test]
    fn a_rehearsing_teacher_mixes_the_next_window_of_general_text_into_every_minibatch() {
        let (llama, mut group, _) = setup();
        let taught: Vec<u32> = (0..12).map(|i| (i * 7 % 96) as u32).collect();
        let general: Vec<u32> = (0..20).map(|i| (i * 3 % 96) as u32).collect();
        let mut plain = teacher(None);
        let mut rehearsing = teacher(None).with_rehearsal(general.clone(), 8);
        let alone = block_on(plain.learn(&llama, &mut group, &[&taught], 1)).unwrap();
        let mixed = block_on(rehearsing.learn(&llama, &mut group, &[&taught], 1)).unwrap();
        // The window is trained on beside the minibatch: more positions, another update.
        assert!(
            mixed.positions > alone.positions,
            "no rehearsal was trained on"
        );
        assert!(mixed.due != alone.due, "the rehearsal changed nothing");
        // The next window each minibatch, from the start again past the text's end.
        assert_eq!(rehearsing.rehearsal.as_ref().unwrap().next, 8);
        block_on(rehearsing.learn(&llama, &mut group, &[&taught], 1)).unwrap();
        assert_eq!(rehearsing.rehearsal.as_ref().unwrap().next, 16);
        assert_eq!(rehearsing.rehearse().unwrap().0, general[..8]);
        // A text shorter than its window rehearses nothing.
        assert!(
            teacher(None)
                .with_rehearsal(general, 21)
                .rehearsal
                .is_none()
        );
    }

    /// Whether every value of every stage's output gradients is zero.
    fn still(g: &Gradients) -> bool {
        g.stages
            .iter()
            .flat_map(|s| s.dy.iter().flatten())
            .chain(&g.embed_dx)
            .all(|&v| v == 0.0)
    }

    #[test]
    fn a_next_token_the_model_already_knows_within_the_floor_is_not_taught() {
        let (llama, mut group, _) = setup();
        let tokens: Vec<u32> = (0..24).map(|i| i * 7 % 96).collect();
        let taught = |floor: f64, group: &mut CodedGroup<InProcess>| {
            block_on(llama.gradients_soft_batch(group, &[&tokens], &[], floor)).unwrap()
        };
        let every = taught(0.0, &mut group);
        assert!(every == block_on(llama.gradients(&mut group, &tokens)).unwrap());
        assert!(!still(&every));
        // Every position within the floor: counted in the loss, taught nothing.
        let none = taught(1e9, &mut group);
        assert_eq!(none.loss, every.loss);
        assert!(still(&none), "a position within the floor was taught");
        // At the mean loss some positions lie below it and some above: those are taught.
        let some = taught(every.loss, &mut group);
        assert_eq!(some.loss, every.loss);
        assert!(!still(&some) && some != every);
    }

    #[test]
    fn a_replaying_teacher_teaches_earlier_lessons_again_within_its_positions() {
        let (llama, mut group, _) = setup();
        let early: Vec<u32> = (0..12).map(|i| i * 7 % 96).collect();
        let late: Vec<u32> = (0..20).map(|i| (i * 11 + 3) % 96).collect();
        let mut plain = teacher(None);
        let mut replaying = teacher(None).with_replay(8, 16);
        assert_eq!(replaying.extra_positions(), 16);
        for t in [&mut plain, &mut replaying] {
            let first = block_on(t.learn(&llama, &mut group, &[&early], 1)).unwrap();
            assert_eq!(
                first.positions,
                early.len(),
                "nothing kept yet, nothing again"
            );
        }
        let alone = block_on(plain.learn(&llama, &mut group, &[&late], 1)).unwrap();
        let again = block_on(replaying.learn(&llama, &mut group, &[&late], 1)).unwrap();
        // The early lesson (12 tokens, within the 16 positions) is taught beside the late one.
        assert_eq!(alone.positions, late.len());
        assert_eq!(again.positions, late.len() + early.len());
        assert!(again.loss != alone.loss, "the minibatch held the same text");
    }

    #[test]
    fn a_trainer_moves_only_the_adapters_it_trains() {
        let (llama, mut group, _) = setup();
        let tokens: Vec<u32> = (0..24).map(|i| i * 7 % 96).collect();
        let moved = |trained: Trained, group: &mut CodedGroup<InProcess>| {
            let mut t = teacher(None).training(trained);
            let due = block_on(t.learn(&llama, group, &[&tokens], 1)).unwrap().due;
            let u = due.unwrap().update;
            let stages = Stage::all(&config());
            stages
                .into_iter()
                .filter(|&s| {
                    let f = u.stages.iter().find(|f| f.stage == s).unwrap();
                    f.dy.iter().flatten().any(|&v| v != 0.0)
                })
                .collect::<Vec<_>>()
        };
        let all = moved(Trained::ALL, &mut group);
        assert_eq!(all, Stage::all(&config()), "every adapter moves");
        let mlp = Trained {
            head: false,
            attention: false,
            mlp: true,
        };
        let only = moved(mlp, &mut group);
        assert!(!only.is_empty());
        assert!(
            only.iter()
                .all(|s| matches!(s, Stage::GateUp(_) | Stage::Down(_))),
            "{only:?}"
        );
    }
}
