//! DiLoCo's rounds in the mesh (docs/coding.md, "DiLoCo in the mesh"): a trainer takes `H`
//! inner Adam steps over each minibatch, each pass through its group with the steps before it
//! added ([`super::Pending`]), and publishes one outer step over their sum `Δ`: Nesterov
//! momentum `m ← μ·m + Δ`, the update `lr_out·(Δ + μ·m)`. Every inner step is an adapter step
//! (`ΔA·V` with the mesh's fixed `V`), so their sum and the outer step are one adapter step of
//! the same bytes, which every row applies as any other: the codeword survives, and no holder
//! keeps optimiser state. Several trainers' rounds are ordered by the version chain; each
//! trainer's momentum follows its own rounds.

use super::adam::{entry_per_dy, most_entry_move};
use super::{LearningConfig, Update, UpdateError, scale, wire};
use crate::coded::ShardFormat;

/// Per stage, per matrix, an adapter step's `dy` (`rank × out`).
type Steps = Vec<Vec<Vec<f32>>>;

/// A trainer's outer optimiser: Nesterov momentum over the sums of its rounds.
#[derive(Debug)]
pub struct Outer {
    cfg: LearningConfig,
    format: ShardFormat,
    /// The momentum `m` after the last round whose update went out.
    momentum: Option<Steps>,
    /// The momentum before the round whose update is not yet out or refused.
    before: Option<Option<Steps>>,
    /// Share of this trainer's adapter steps so far each published round takes back
    /// ([`Self::with_decay`]).
    decay: f32,
    /// The sum of this trainer's published updates' steps (`step·dy`): how far it moved the
    /// adapters.
    added: Option<Steps>,
    /// The last round's update as it may go out (halved as often as the gate halved it).
    last: Option<Update>,
    /// The part of it that takes back earlier steps, alone (for the gate).
    back: Option<Update>,
    /// Rounds after which the outer rate is half what it was at the first ([`Self::anneal`]);
    /// 0: never lowered.
    anneal: u32,
    /// Rounds of this trainer that went out.
    kept: u32,
    /// Least agreement an entry's rounds need for its step to go out ([`Self::consensus`]);
    /// 0: every entry goes.
    consensus: f32,
    /// Per entry, the kept rounds' steps and their sizes, each decaying by
    /// [`CONSENSUS_MEMORY`] a round: `(Σ βʲ·Δ, Σ βʲ·|Δ|)`.
    agreed: Option<(Steps, Steps)>,
    /// The same with the last round in, until it is kept or undone.
    agreeing: Option<(Steps, Steps)>,
}

/// How much of its past an entry's agreement keeps a round ([`Outer::consensus`]): about
/// the last ten rounds count.
pub const CONSENSUS_MEMORY: f32 = 0.9;

/// Adds an inner step to the sum of a round's steps: the same input factors (the adapters'
/// fixed projection), output factors added.
pub fn add_step(sum: &mut Update, step: &Update) -> Result<(), UpdateError> {
    if sum.stages.len() != step.stages.len() || sum.step != step.step {
        return Err(UpdateError::Shape(
            "inner steps of one round have the same stages and rate".into(),
        ));
    }
    for (a, b) in sum.stages.iter_mut().zip(&step.stages) {
        if a.stage != b.stage || a.rows != b.rows || a.x != b.x || a.dy.len() != b.dy.len() {
            return Err(UpdateError::Shape(format!(
                "{:?}: inner steps share the adapters' projection",
                a.stage
            )));
        }
        for (p, q) in a.dy.iter_mut().zip(&b.dy) {
            if p.len() != q.len() {
                return Err(UpdateError::Shape(format!("{:?}: factor sizes", a.stage)));
            }
            p.iter_mut().zip(q).for_each(|(x, &y)| *x += y);
        }
    }
    sum.t = sum.t.saturating_add(step.t);
    Ok(())
}

/// The same adapter step at half its size (rounded as it travels): what a trainer offers the
/// canary gate after it refused a round.
pub fn halve(u: &mut Update) {
    scale(u, 0.5);
    wire::round(u);
}

impl Outer {
    /// The outer optimiser of a mesh's settings, on shards of `format`.
    pub fn new(cfg: LearningConfig, format: ShardFormat) -> Self {
        Self {
            cfg,
            format,
            momentum: None,
            before: None,
            decay: 0.0,
            added: None,
            last: None,
            back: None,
            anneal: 0,
            kept: 0,
            consensus: 0.0,
            agreed: None,
            agreeing: None,
        }
    }

    /// Sends an entry's step only where this trainer's recent rounds agree on it: with
    /// `m = Σ βʲ·Δ` and `a = Σ βʲ·|Δ|` over the kept rounds and this one (β =
    /// [`CONSENSUS_MEMORY`]), the entry goes out only if `|m| ≥ threshold · a`. A direction the
    /// chats keep asking for (a fact, a style) agrees round after round (`|m| = a`); what
    /// varies from text to text (a name drawn at random) averages out, yet Adam steps it at
    /// full size, and those steps walk the adapters away from what they knew
    /// (docs/coding.md, "Facts and rehearsal"). A trainer's first round goes out whole.
    pub fn consensus(&mut self, threshold: f32) {
        self.consensus = threshold.clamp(0.0, 1.0);
    }

    /// Zeroes the entries of `sum` (a round's raw `Δ`) its rounds do not agree on
    /// ([`Self::consensus`]), keeping the agreement with this round in until it is kept.
    fn agree(&mut self, sum: &mut Update) {
        if self.consensus <= 0.0 {
            return;
        }
        let (mut m, mut a) = match self.agreed.clone() {
            Some((m, a)) if same_shape(&m, sum) => (m, a),
            _ => (zeros_like(sum), zeros_like(sum)),
        };
        let (beta, th) = (CONSENSUS_MEMORY, self.consensus);
        for ((ms, as_), f) in m.iter_mut().zip(&mut a).zip(&mut sum.stages) {
            for ((mv, av), dy) in ms.iter_mut().zip(as_.iter_mut()).zip(&mut f.dy) {
                for ((m, a), d) in mv.iter_mut().zip(av.iter_mut()).zip(dy.iter_mut()) {
                    *m = beta * *m + *d;
                    *a = beta * *a + d.abs();
                    if m.abs() < th * *a {
                        *d = 0.0;
                    }
                }
            }
        }
        self.agreeing = Some((m, a));
    }

    /// Lowers the outer rate as this trainer's rounds go out: round `t` (from 0) is taken at
    /// `lr_out / (1 + t / rounds)`, so the first rounds teach at the full rate and the
    /// adapters move about `rounds · ln(1 + t / rounds)` rounds' worth over `t` rounds, not `t`
    /// (docs/coding.md, "Facts and rehearsal"); 0 keeps the rate.
    pub fn anneal(&mut self, rounds: u32) {
        self.anneal = rounds;
    }

    /// The outer rate the next round is taken at ([`Self::anneal`]).
    pub fn rate(&self) -> f32 {
        let lr = self.cfg.outer_lr;
        if self.anneal == 0 {
            return lr;
        }
        lr / (1.0 + self.kept as f32 / self.anneal as f32)
    }

    /// The same optimiser taking back `share` (0 to 1) of how far its published updates moved
    /// the adapters with each round it publishes: a decay of its own steps towards the genesis
    /// model (docs/coding.md, "Facts and rehearsal"), so what the mesh learns is bounded however
    /// long it is used. The decay is part of the round's update, one adapter step like any
    /// other, so every row applies it alike and the codeword survives.
    pub fn with_decay(mut self, share: f32) -> Self {
        self.set_decay(share);
        self
    }

    /// Takes back `share` from now on ([`Self::with_decay`]).
    pub fn set_decay(&mut self, share: f32) {
        self.decay = share.clamp(0.0, 1.0);
    }

    /// The update a round publishes: the outer step over `sum` (its inner steps' sum), each
    /// adapter entry held within what holders accept ([`LearningConfig::adapter_reach`]) and
    /// rounded as it travels.
    pub fn step(&mut self, mut sum: Update) -> Update {
        self.agree(&mut sum);
        let (lr, mu) = (self.rate(), self.cfg.outer_momentum);
        self.before = Some(self.momentum.clone());
        if mu > 0.0 {
            let m = self.momentum.get_or_insert_with(|| zeros_like(&sum));
            for (ms, f) in m.iter_mut().zip(&mut sum.stages) {
                for (mv, dy) in ms.iter_mut().zip(&mut f.dy) {
                    for (m, d) in mv.iter_mut().zip(dy.iter_mut()) {
                        *m = mu * *m + *d;
                        *d += mu * *m;
                    }
                }
            }
        }
        let back = self.take_back(&sum);
        let mut alone = back.as_ref().map(|_| sum.clone());
        for (i, f) in sum.stages.iter_mut().enumerate() {
            let taken = back.as_ref().and_then(|b| b.get(i));
            if let Some(back) = taken {
                // In the step's units: `dy` is applied at `sum.step`, `added` already was.
                for (dy, b) in f.dy.iter_mut().zip(back) {
                    dy.iter_mut().zip(b).for_each(|(d, &b)| *d = lr * *d - b);
                }
            } else {
                f.dy.iter_mut().flatten().for_each(|d| *d *= lr);
            }
            let Some(cols) = f.x.len().checked_div(f.rows as usize) else {
                continue;
            };
            let rank = f.rows as usize;
            // The most holders accept, less room for the rounding to f16 (2⁻¹¹).
            let most = most_entry_move(self.cfg.lr, self.cfg.adapter_reach(), cols)
                / (f64::from(sum.step) * entry_per_dy(self.format, cols, rank))
                * (1.0 - 5e-4);
            let most = most as f32;
            for v in f.dy.iter_mut().flatten() {
                *v = v.clamp(-most, most);
            }
            if let Some(g) = alone.as_mut().and_then(|a| a.stages.get_mut(i)) {
                for (dy, b) in g.dy.iter_mut().zip(taken.into_iter().flatten()) {
                    dy.iter_mut()
                        .zip(b)
                        .for_each(|(d, &b)| *d = (-b).clamp(-most, most));
                }
            }
        }
        wire::round(&mut sum);
        if let Some(a) = alone.as_mut() {
            wire::round(a);
        }
        if self.decay > 0.0 {
            self.last = Some(sum.clone());
        }
        self.back = alone;
        sum
    }

    /// The part of the last round's update that takes back earlier steps, alone, as it may go
    /// out: what the canary gate weighs apart ([`super::CanaryGate::judge_giving_back`]).
    pub fn give_back(&self) -> Option<&Update> {
        self.back.as_ref()
    }

    /// Per stage, per matrix, what a round of `sum`'s shape takes back in its `dy`: `decay`
    /// of the steps added so far, in `sum.step`'s units; `None` when nothing is taken back.
    fn take_back(&self, sum: &Update) -> Option<Steps> {
        let added = self.added.as_ref().filter(|_| self.decay > 0.0)?;
        if sum.step <= 0.0 || !same_shape(added, sum) {
            return None;
        }
        let c = self.decay / sum.step;
        Some(
            added
                .iter()
                .map(|s| {
                    s.iter()
                        .map(|m| m.iter().map(|&a| c * a).collect())
                        .collect()
                })
                .collect(),
        )
    }

    /// The gate halved the last round's update ([`halve`]): what goes out is that.
    pub fn halved(&mut self) {
        if let Some(last) = self.last.as_mut() {
            halve(last);
        }
        if let Some(back) = self.back.as_mut() {
            halve(back);
        }
    }

    /// The last round's update went out: its momentum stays, and its steps are counted in
    /// how far this trainer moved the adapters.
    pub fn keep(&mut self) {
        self.before = None;
        self.back = None;
        self.kept = self.kept.saturating_add(1);
        if let Some(agreeing) = self.agreeing.take() {
            self.agreed = Some(agreeing);
        }
        let Some(last) = self.last.take() else {
            return;
        };
        let added = self.added.get_or_insert_with(|| zeros_like(&last));
        if !same_shape(added, &last) {
            return;
        }
        for (a, f) in added.iter_mut().zip(&last.stages) {
            for (am, dy) in a.iter_mut().zip(&f.dy) {
                am.iter_mut()
                    .zip(dy)
                    .for_each(|(a, &d)| *a += last.step * d);
            }
        }
    }

    /// The last round's update was refused or lost: the momentum is as before it.
    pub fn undo(&mut self) {
        self.agreeing = None;
        self.last = None;
        self.back = None;
        if let Some(m) = self.before.take() {
            self.momentum = m;
        }
    }
}

/// Steps of `u`'s stages and factor sizes, every entry zero.
fn zeros_like(u: &Update) -> Steps {
    (u.stages.iter())
        .map(|f| f.dy.iter().map(|d| vec![0.0; d.len()]).collect())
        .collect()
}

/// Whether `steps` has `u`'s stages and factor sizes.
fn same_shape(steps: &Steps, u: &Update) -> bool {
    steps.len() == u.stages.len()
        && steps.iter().zip(&u.stages).all(|(s, f)| {
            s.len() == f.dy.len() && s.iter().zip(&f.dy).all(|(a, d)| a.len() == d.len())
        })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

    use futures::executor::block_on;

    use super::*;
    use crate::coded::{CodedGroup, InProcess};
    use crate::learn::fixtures::{canary, setup};
    use crate::learn::{CanaryGate, Judged, Learner, Pending, Teacher};
    use crate::model::Llama;

    /// The text the rounds are taught.
    fn text() -> Vec<u32> {
        (0..24).map(|i| i * 7 % 96).collect()
    }

    fn teacher(cfg: LearningConfig, gate: Option<CanaryGate>) -> Teacher {
        let learner = Learner::new(cfg, crate::learn::fixtures::config(), ShardFormat::Q8);
        Teacher::new(learner, gate, ShardFormat::Q8)
    }

    fn rounds(h: u32, mu: f32) -> LearningConfig {
        LearningConfig {
            lr: 0.02,
            inner_steps: h,
            outer_momentum: mu,
            ..LearningConfig::default()
        }
    }

    /// The update `cfg`'s trainer publishes for one minibatch of the text.
    fn round(cfg: LearningConfig, llama: &Llama, group: &mut CodedGroup<InProcess>) -> Update {
        let mut t = teacher(cfg, None);
        let studied = block_on(t.learn(llama, group, &[&text()], 1)).unwrap();
        assert_eq!(studied.passes, cfg.inner_steps);
        studied.due.unwrap().update
    }

    /// The text's loss once `u` is applied.
    fn loss_after(llama: &Llama, group: &mut CodedGroup<InProcess>, u: &Update) -> f64 {
        let mut pending = Pending::new(group, u, llama.config(), ShardFormat::Q8);
        block_on(llama.sequence_loss(&mut pending, &text())).unwrap()
    }

    #[test]
    fn a_round_of_inner_steps_teaches_more_than_one_step_in_the_same_bytes() {
        let (llama, mut group, _) = setup();
        let before = block_on(llama.sequence_loss(&mut group, &text())).unwrap();
        let one = round(rounds(1, 0.0), &llama, &mut group);
        let four = round(rounds(4, 0.0), &llama, &mut group);
        let (after_one, after_four) = (
            loss_after(&llama, &mut group, &one),
            loss_after(&llama, &mut group, &four),
        );
        assert!(after_one < before, "one step: {before} → {after_one}");
        assert!(
            before - after_four > 2.0 * (before - after_one),
            "four inner steps: {before} → {after_four}, one: {after_one}"
        );
        // One adapter step's bytes, and within what the mesh's holders accept.
        let cfg = llama.config();
        assert_eq!(one.encode().len(), four.encode().len());
        four.validate_for(cfg, &rounds(4, 0.0), ShardFormat::Q8)
            .unwrap();
        // A holder of a mesh whose trainers take one step a round refuses eight: they move
        // adapter entries further than one minibatch's step may (four times its rate).
        let eight = round(rounds(8, 0.0), &llama, &mut group);
        eight
            .validate_for(cfg, &rounds(8, 0.0), ShardFormat::Q8)
            .unwrap();
        let refused = eight.validate_for(cfg, &rounds(1, 0.0), ShardFormat::Q8);
        assert!(
            matches!(refused, Err(UpdateError::Settings(ref why)) if why.contains("moves an adapter entry")),
            "{refused:?}"
        );
    }

    #[test]
    fn a_round_that_moves_only_the_mlp_sends_only_its_factors_and_teaches_the_same() {
        let (llama, mut group, _) = setup();
        let cfg = rounds(2, 0.0);
        let mut t = teacher(cfg, None).training(crate::learn::Trained::MESH);
        let studied = block_on(t.learn(&llama, &mut group, &[&text()], 1)).unwrap();
        let sent = studied.due.unwrap().update;
        for f in &sent.stages {
            let mlp = crate::learn::Trained::MESH.stage(f.stage);
            assert_eq!(f.rows > 0, mlp, "{:?} carries {} rows", f.stage, f.rows);
        }
        sent.validate_for(llama.config(), &cfg, ShardFormat::Q8)
            .unwrap();
        // The same step with the still stages' factors in: more bytes, the same teaching.
        let mut full = round(cfg, &llama, &mut group);
        for (f, g) in full.stages.iter_mut().zip(&sent.stages) {
            if g.rows == 0 {
                f.dy.iter_mut().flatten().for_each(|d| *d = 0.0);
            } else {
                f.dy.clone_from(&g.dy);
            }
        }
        assert!(sent.encode().len() * 3 < full.encode().len() * 2);
        let (a, b) = (
            loss_after(&llama, &mut group, &sent),
            loss_after(&llama, &mut group, &full),
        );
        assert!((a - b).abs() < 1e-9, "{a} against {b}");
        assert!(full.trimmed() == sent);
        // A row that takes it learns in the MLP's adapters alone: the others stay empty, so
        // they are neither stored nor added to a product.
        let member = &mut group.transport_mut().members_mut()[0];
        member.learn(|s| sent.apply_to_shards(s)).unwrap();
        let set = member.shards_mut();
        for f in &sent.stages {
            let Some(l) = f.stage.layer() else {
                continue;
            };
            for &i in f.stage.block_matrices() {
                let learnt = !set.blocks[l][i].adapter.is_empty();
                assert_eq!(learnt, f.rows > 0, "{:?}'s matrix {i}", f.stage);
            }
        }
        let head = set.lm_head.as_ref().unwrap_or(&set.embed);
        assert!(head.adapter.is_empty(), "the head did not move");
    }

    /// `u` with every factor entry zero: a round that learnt nothing.
    fn nothing(u: &Update) -> Update {
        let mut z = u.clone();
        z.stages
            .iter_mut()
            .for_each(|f| f.dy.iter_mut().flatten().for_each(|d| *d = 0.0));
        z
    }

    /// Every factor entry of `u` against `share` of `of`'s, within the f16 rounding.
    fn is_share_of(u: &Update, of: &Update, share: f32) {
        let mut moved = 0;
        for (a, b) in u.stages.iter().zip(&of.stages) {
            for (&x, &y) in a.dy.iter().flatten().zip(b.dy.iter().flatten()) {
                let want = share * y;
                assert!(
                    (x - want).abs() <= 2e-3 * want.abs() + 1e-7,
                    "{x} against {want}"
                );
                moved += usize::from(y != 0.0);
            }
        }
        assert!(moved > 0, "the first round moved nothing");
    }

    #[test]
    fn a_decaying_trainer_takes_back_a_share_of_its_own_published_steps() {
        let (llama, mut group, _) = setup();
        let cfg = rounds(2, 0.0);
        let sum = round(cfg, &llama, &mut group);
        let mut outer = Outer::new(cfg, ShardFormat::Q8).with_decay(0.25);
        let first = outer.step(sum.clone());
        outer.keep();
        // A round that learnt nothing takes back a quarter of the first: the adapters stand at
        // three quarters of where it moved them.
        let back = outer.step(nothing(&sum));
        is_share_of(&back, &first, -0.25);
        assert!(outer.give_back() == Some(&back), "all of it takes back");
        back.validate_for(llama.config(), &cfg, ShardFormat::Q8)
            .unwrap();
        // Refused, it moved nothing: the next round takes back the same.
        outer.undo();
        let again = outer.step(nothing(&sum));
        assert!(
            again == back,
            "a refused round counted in how far the adapters moved"
        );
        // Halved by the gate and out: the adapters stand at 1 − 1/8 of the first round, and
        // a quarter of that is taken back next.
        outer.halved();
        outer.keep();
        let third = outer.step(nothing(&sum));
        is_share_of(&third, &first, -0.25 * 0.875);
        // Without decay nothing is taken back.
        let mut plain = Outer::new(cfg, ShardFormat::Q8);
        plain.step(sum.clone());
        plain.keep();
        let still = plain.step(nothing(&sum));
        assert!(
            still
                .stages
                .iter()
                .all(|f| f.dy.iter().flatten().all(|&d| d == 0.0))
        );
    }

    #[test]
    fn an_annealed_trainer_halves_its_rate_over_its_published_rounds_not_its_refused_ones() {
        let (llama, mut group, _) = setup();
        let cfg = rounds(2, 0.0);
        let sum = round(cfg, &llama, &mut group);
        let mut outer = Outer::new(cfg, ShardFormat::Q8);
        outer.anneal(2);
        let first = outer.step(sum.clone());
        // Refused: the next round is still taken at the full rate.
        outer.undo();
        assert!(outer.step(sum.clone()) == first);
        outer.keep();
        // One round out of two: two thirds of the rate; two out: half.
        is_share_of(&outer.step(sum.clone()), &first, 2.0 / 3.0);
        outer.keep();
        is_share_of(&outer.step(sum.clone()), &first, 0.5);
        assert!((outer.rate() - cfg.outer_lr / 2.0).abs() < 1e-6);
        // Not annealed, the tenth round is taken as the first.
        let mut plain = Outer::new(cfg, ShardFormat::Q8);
        for _ in 0..10 {
            plain.step(sum.clone());
            plain.keep();
        }
        assert!(plain.step(sum.clone()) == first);
    }

    #[test]
    fn with_consensus_only_the_entries_its_rounds_agree_on_go_out() {
        let (llama, mut group, _) = setup();
        let cfg = rounds(2, 0.0);
        let sum = round(cfg, &llama, &mut group);
        let flipped = |u: &Update| {
            let mut f = u.clone();
            f.stages
                .iter_mut()
                .for_each(|s| s.dy.iter_mut().flatten().for_each(|d| *d = -*d));
            f
        };
        let mut outer = Outer::new(cfg, ShardFormat::Q8);
        outer.consensus(0.5);
        // The first round goes out whole.
        let first = outer.step(sum.clone());
        is_share_of(
            &first,
            &Outer::new(cfg, ShardFormat::Q8).step(sum.clone()),
            1.0,
        );
        // Refused, it counts for nothing: the opposite round is again a first.
        outer.undo();
        let mut fresh = Outer::new(cfg, ShardFormat::Q8);
        assert!(outer.step(flipped(&sum)) == fresh.step(flipped(&sum)));
        outer.keep();
        // Kept, a round that asks for the opposite of it disagrees everywhere: |m| = a / 19.
        let back = outer.step(sum.clone());
        assert!(
            back.stages
                .iter()
                .all(|f| f.dy.iter().flatten().all(|&d| d == 0.0))
        );
        outer.undo();
        // A round that asks for the same again agrees everywhere and goes out whole.
        let again = outer.step(flipped(&sum));
        is_share_of(&again, &fresh.step(flipped(&sum)), 1.0);
    }

    #[test]
    fn a_refused_round_is_forgotten_moments_and_momentum_alike() {
        let (llama, mut group, _) = setup();
        let cfg = rounds(3, 0.5);
        let shut =
            CanaryGate::new(canary(), None).with_bounds(f64::NEG_INFINITY, f64::NEG_INFINITY);
        let mut gated = teacher(cfg, Some(shut));
        for _ in 0..2 {
            let due = block_on(gated.learn(&llama, &mut group, &[&text()], 1))
                .unwrap()
                .due
                .unwrap();
            let judged = block_on(gated.judge(&llama, &mut group, [0; 32], due)).unwrap();
            assert!(
                matches!(judged, Judged::Refused(..)),
                "the gate refuses all"
            );
        }
        // Two refused rounds later, the next round is a fresh trainer's first.
        let mut open = teacher(cfg, None);
        let fresh = block_on(open.learn(&llama, &mut group, &[&text()], 1)).unwrap();
        let next = block_on(gated.learn(&llama, &mut group, &[&text()], 1)).unwrap();
        assert!(
            next.due == fresh.due,
            "a refused round steered the next one"
        );
        // Kept, the round steers the next through the moments and the momentum.
        open.keep_last();
        let after = block_on(open.learn(&llama, &mut group, &[&text()], 1)).unwrap();
        assert!(after.due != fresh.due);
    }

    #[test]
    fn the_outer_step_is_nesterov_over_a_trainers_rounds() {
        let (llama, mut group, _) = setup();
        let sum = round(rounds(1, 0.0), &llama, &mut group);
        let cfg = LearningConfig {
            outer_lr: 0.7,
            ..rounds(2, 0.5)
        };
        let mut outer = Outer::new(cfg, ShardFormat::Q8);
        // m = Δ, out = 0.7·(Δ + 0.5·Δ); then m = 1.5·Δ, out = 0.7·(Δ + 0.75·Δ).
        let first = outer.step(sum.clone());
        outer.keep();
        let second = outer.step(sum.clone());
        // Refused, the momentum is as before it: the same step again gives the same update.
        outer.undo();
        let again = outer.step(sum.clone());
        assert!(again == second);
        let entries = |u: &Update| -> Vec<f32> {
            u.stages
                .iter()
                .flat_map(|f| f.dy.iter().flatten().copied())
                .collect()
        };
        let (d, a, b) = (entries(&sum), entries(&first), entries(&second));
        let mut checked = 0;
        for ((&d, &a), &b) in d.iter().zip(&a).zip(&b) {
            if d.abs() > 1e-3 {
                assert!((a / d - 1.05).abs() < 2e-3, "{a} / {d}");
                assert!((b / d - 1.225).abs() < 2e-3, "{b} / {d}");
                checked += 1;
            }
        }
        assert!(checked > 100, "{checked} entries checked");
    }

    #[test]
    fn a_round_the_gate_refuses_is_offered_again_at_half_its_size() {
        let (llama, mut group, _) = setup();
        let cfg = rounds(4, 0.0);
        let full = round(cfg, &llama, &mut group);
        let mut half = full.clone();
        halve(&mut half);
        // The canary is the taught text backwards: what the round moves it by, each way.
        let canary: Vec<u32> = text().into_iter().rev().collect();
        let before = block_on(llama.sequence_loss(&mut group, &canary)).unwrap();
        let rise = |u: &Update, group: &mut CodedGroup<InProcess>| {
            let mut pending = Pending::new(group, u, llama.config(), ShardFormat::Q8);
            block_on(llama.sequence_loss(&mut pending, &canary)).unwrap() - before
        };
        let (r_full, r_half) = (rise(&full, &mut group), rise(&half, &mut group));
        eprintln!("the round moves the canary {r_full:+.5}, half of it {r_half:+.5}");
        assert!(
            r_full > r_half,
            "a round that helps its canary tests nothing"
        );
        // A gate whose bound lies between the two: the round goes out at half its size.
        let bound = (r_full + r_half) / 2.0;
        let gate = CanaryGate::new(canary.clone(), None).with_bounds(bound, f64::INFINITY);
        let mut t = teacher(cfg, Some(gate));
        let due = block_on(t.learn(&llama, &mut group, &[&text()], 1)).unwrap();
        let judged = block_on(t.judge(&llama, &mut group, [0; 32], due.due.unwrap())).unwrap();
        match judged {
            Judged::Publish(p, Some(v)) => {
                assert!(
                    p.update == half,
                    "the update offered again is the round halved"
                );
                assert!(v.pass && (v.after - v.before - r_half).abs() < 1e-9);
            }
            other => panic!("the halved round was not published: {other:?}"),
        }
        // One step a round (no rounds): refused outright, never halved.
        let gate = CanaryGate::new(canary, None).with_bounds(f64::NEG_INFINITY, f64::INFINITY);
        let mut single = teacher(rounds(1, 0.0), Some(gate));
        let due = block_on(single.learn(&llama, &mut group, &[&text()], 1)).unwrap();
        assert!(matches!(
            block_on(single.judge(&llama, &mut group, [0; 32], due.due.unwrap())).unwrap(),
            Judged::Refused(..)
        ));
    }
}
