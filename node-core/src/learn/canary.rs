//! The canary gate: before a leader publishes an update, it measures the loss of a small
//! held-out text the mesh ships, on the mesh as it is and as it would be after the update, and
//! refuses an update that raises it too far. A mesh that learns from anyone can be taught
//! anything; this keeps what one update (and a run of them from one leader) can do to text
//! nobody taught it within a bound (DESIGN.md §10).
//!
//! "As it would be" needs no node to change: [`Pending`] wraps the group's executor and adds
//! the update's own products (`−step·dYᵀ·(X·x)`) to every stage's answer, so the leader runs
//! the updated model through the group it already has.

use std::borrow::Cow;

use super::{StageFactors, Update, project_rows};
use crate::coded::ShardFormat;
use crate::model::{LinearExec, Llama, LlamaConfig, ModelError, Stage, Tokenizer};

/// The held-out text the gate measures (general English prose, none of it a test's taught
/// passage or the learning bench's held-out text).
pub const CANARY_TEXT: &str = include_str!("canary.txt");

/// Most canary tokens measured (one forward pass of this many positions per update).
pub const CANARY_TOKENS: usize = 128;

/// Most one update may raise the canary loss, in nats per token (a 1 % perplexity rise).
pub const MAX_CANARY_STEP: f64 = 0.01;

/// Most the canary loss may rise above the mesh's reference (the manifest's, measured at
/// genesis; a gate without one counts from the first loss it measured), in nats per token
/// (a 3 % perplexity rise), over all updates of every trainer. A trainer's gate also counts it
/// from the lowest loss it has measured since, so a canary that rehearsal brought down leaves
/// no more room for harm than the genesis model had; an update that does not raise the canary
/// is not refused for drift (else a floor set by one dip refuses every later round: learning
/// stopped after 28 updates at half the learning rate, docs/coding.md), within the reference's
/// bound.
pub const MAX_CANARY_DRIFT: f64 = 0.03;

/// The canary's tokens as `tokenizer` cuts them (the first [`CANARY_TOKENS`]).
pub fn canary_tokens(tokenizer: &Tokenizer) -> Result<Vec<u32>, ModelError> {
    let mut tokens = tokenizer.encode(CANARY_TEXT)?;
    tokens.truncate(CANARY_TOKENS);
    Ok(tokens)
}

/// The canary's loss on the model `llama` computes with over `exec`: the reference a mesh
/// fixes at genesis, which every gate counts the drift from.
pub async fn canary_reference<E: LinearExec>(
    llama: &Llama,
    exec: &mut E,
    tokenizer: &Tokenizer,
) -> Result<f64, ModelError> {
    llama.sequence_loss(exec, &canary_tokens(tokenizer)?).await
}

/// What the gate decided about one update.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Verdict {
    /// The canary loss before the update.
    pub before: f64,
    /// The canary loss with the update applied.
    pub after: f64,
    /// What drift is counted from: the mesh's reference loss, or without one the first
    /// canary loss this gate measured.
    pub baseline: f64,
    /// What this gate counted drift from: the lower of `baseline` and the lowest canary loss
    /// it measured since, raised by what the update's give-back costs the canary.
    pub floor: f64,
    /// How far the update's give-back alone (a decaying trainer's share of its earlier steps
    /// taken back: [`super::Outer::with_decay`]) raises the canary; 0 without one.
    pub given_back: f64,
    /// Whether the update may be published.
    pub pass: bool,
}

impl Verdict {
    /// The verdict as a trainer attaches it to the update it publishes.
    pub fn claim(&self) -> super::GateClaim {
        super::GateClaim {
            before: self.before,
            after: self.after,
            reference: self.baseline,
        }
    }

    /// Why the update was refused, for the log; `None` when it passed.
    pub fn refusal(&self) -> Option<String> {
        if self.pass {
            return None;
        }
        Some(format!(
            "the canary loss would go {:.4} → {:.4} nats (counted from {:.4}, the mesh's reference {:.4}; at most +{MAX_CANARY_STEP} an update, +{MAX_CANARY_DRIFT} in all)",
            self.before, self.after, self.floor, self.baseline
        ))
    }
}

/// A leader's canary gate: the canary's tokens, the first loss it measured, and the loss at
/// the version it last saw.
#[derive(Debug, Clone)]
pub struct CanaryGate {
    tokens: Vec<u32>,
    /// Most one update may raise the loss, and most it may rise in all.
    bounds: (f64, f64),
    baseline: Option<f64>,
    /// The lowest canary loss measured (or passed) at any version.
    lowest: Option<f64>,
    /// Verdicts whose canary losses before them the floor is the lowest of (0: every loss
    /// since the gate began).
    window: usize,
    /// The canary loss before each of the last `window` verdicts.
    recent: std::collections::VecDeque<f64>,
    at: Option<([u8; 32], f64)>,
}

impl CanaryGate {
    /// A gate over `tokens` (the canary text as the model's tokenizer cuts it; at most
    /// [`CANARY_TOKENS`] are used) counting drift from `reference` (the mesh's, from its
    /// manifest; `None`: from the first loss it measures).
    pub fn new(mut tokens: Vec<u32>, reference: Option<f64>) -> Self {
        tokens.truncate(CANARY_TOKENS);
        Self {
            tokens,
            bounds: (MAX_CANARY_STEP, MAX_CANARY_DRIFT),
            baseline: reference,
            lowest: None,
            window: 0,
            recent: std::collections::VecDeque::new(),
            at: None,
        }
    }

    /// The same gate counting drift from the lowest canary loss before its last `verdicts`
    /// verdicts rather than the lowest ever (0: ever): a canary held at its bound leaves room
    /// again once the low it is counted from is `verdicts` verdicts old, so learning goes on,
    /// the canary rising at most the drift bound a window (never past the mesh's reference).
    pub fn with_window(mut self, verdicts: usize) -> Self {
        self.window = verdicts;
        self
    }

    /// The same gate with other bounds (nats per token: one update's rise, the whole rise);
    /// infinite bounds measure without refusing.
    pub fn with_bounds(mut self, step: f64, drift: f64) -> Self {
        self.bounds = (step, drift);
        self
    }

    /// The canary loss at `version`: remembered from the last call at that version, else
    /// measured through `exec`.
    pub async fn loss_at<E: LinearExec>(
        &mut self,
        llama: &Llama,
        exec: &mut E,
        version: [u8; 32],
    ) -> Result<f64, ModelError> {
        if let Some((v, loss)) = self.at
            && v == version
        {
            return Ok(loss);
        }
        let loss = llama.sequence_loss(exec, &self.tokens).await?;
        self.baseline.get_or_insert(loss);
        self.seen(loss);
        self.at = Some((version, loss));
        Ok(loss)
    }

    /// The gate's verdict on `update`, as shards of `format` take it (`Update::taken_by`), for
    /// a group at `version`.
    pub async fn judge<E: LinearExec>(
        &mut self,
        llama: &Llama,
        exec: &mut E,
        version: [u8; 32],
        update: &Update,
        format: ShardFormat,
    ) -> Result<Verdict, ModelError> {
        self.judge_giving_back(llama, exec, version, (update, None), format)
            .await
    }

    /// [`Self::judge`] on an update part of which, `back`, takes back a share of the trainer's
    /// earlier steps ([`super::Outer::with_decay`]): moving towards the genesis model gives
    /// back some of what its steps gained on the canary too, so the drift is counted from the
    /// floor raised by what `back` alone costs the canary (another forward pass), and what the
    /// learning part may cost stays bounded as before.
    pub async fn judge_giving_back<E: LinearExec>(
        &mut self,
        llama: &Llama,
        exec: &mut E,
        version: [u8; 32],
        (update, back): (&Update, Option<&Update>),
        format: ShardFormat,
    ) -> Result<Verdict, ModelError> {
        let before = self.loss_at(llama, exec, version).await?;
        let after = self.loss_with(llama, exec, update, format).await?;
        let given_back = match back {
            Some(b) => (self.loss_with(llama, exec, b, format).await? - before).max(0.0),
            None => 0.0,
        };
        let baseline = self.baseline.unwrap_or(before);
        let low = if self.window == 0 {
            self.lowest
        } else {
            self.note(before);
            self.recent.iter().copied().reduce(f64::min)
        };
        let floor = low.map_or(baseline, |l| l.min(baseline));
        // Never past the mesh's reference: what holders bound stays the bound.
        let floor = (floor + given_back).min(baseline).max(floor);
        let drift = self.bounds.1;
        let within = after - floor <= drift || (after <= before && after - baseline <= drift);
        let pass = after.is_finite() && after - before <= self.bounds.0 && within;
        Ok(Verdict {
            before,
            after,
            baseline,
            floor,
            given_back,
            pass,
        })
    }

    /// The canary's loss on `llama` over `exec` with `update` added.
    async fn loss_with<E: LinearExec>(
        &self,
        llama: &Llama,
        exec: &mut E,
        update: &Update,
        format: ShardFormat,
    ) -> Result<f64, ModelError> {
        let mut norms = llama.norms().clone();
        update.apply_to_norms(&mut norms);
        let after_llama = Llama::new(llama.config().clone(), norms)?;
        let mut pending = Pending::new(exec, update, llama.config(), format);
        after_llama.sequence_loss(&mut pending, &self.tokens).await
    }

    /// The mesh took an update whose give-back cost the canary `given_back` nats
    /// ([`Verdict::given_back`]): the lowest loss this gate counts from rises by that much
    /// (never past the reference), so a decaying trainer is not refused for giving back what
    /// it gained.
    pub fn gave_back(&mut self, given_back: f64) {
        if given_back <= 0.0 {
            return;
        }
        for l in self.lowest.iter_mut().chain(self.recent.iter_mut()) {
            let top = self.baseline.unwrap_or(*l).max(*l);
            *l = (*l + given_back).min(top);
        }
    }

    /// Remembers the canary loss the mesh has at `version`, once an update that was judged
    /// to give `loss` took it there.
    pub fn moved_to(&mut self, version: [u8; 32], loss: f64) {
        self.seen(loss);
        self.at = Some((version, loss));
    }

    /// Remembers `loss` if it is the lowest measured.
    fn seen(&mut self, loss: f64) {
        if loss.is_finite() {
            self.lowest = Some(self.lowest.map_or(loss, |l| l.min(loss)));
        }
    }

    /// Adds `loss`, the canary before a verdict, to the last [`Self::with_window`] kept.
    fn note(&mut self, loss: f64) {
        if !loss.is_finite() {
            return;
        }
        self.recent.push_back(loss);
        while self.recent.len() > self.window {
            self.recent.pop_front();
        }
    }
}

/// An executor that answers as `inner` would after `update` is applied: each stage's product
/// gets the update's own `−step·dYᵀ·(X·x)` added, and each lookup row its change.
#[derive(Debug)]
pub struct Pending<'a, E> {
    inner: &'a mut E,
    update: &'a Update,
    cfg: &'a LlamaConfig,
    /// Whether shards take the update projected ([`Update::projected`]): each input factor is,
    /// a stage at a time, so the update is never copied whole.
    project: bool,
}

impl<'a, E> Pending<'a, E> {
    /// `inner` with `update` added on top, as shards of `format` take it.
    pub fn new(
        inner: &'a mut E,
        update: &'a Update,
        cfg: &'a LlamaConfig,
        format: ShardFormat,
    ) -> Self {
        Self {
            inner,
            update,
            cfg,
            project: Update::projects(format),
        }
    }

    fn factors(&self, stage: Stage) -> Option<&'a StageFactors> {
        self.update
            .stages
            .iter()
            .find(|f| f.stage == stage && f.rows > 0)
    }

    /// `x`'s `t` rows as the shards take them.
    fn taken(&self, x: &'a [f32], t: usize) -> Cow<'a, [f32]> {
        if !self.project {
            return Cow::Borrowed(x);
        }
        let mut x = x.to_vec();
        project_rows(&mut x, t);
        Cow::Owned(x)
    }
}

/// `a (t × w) · bᵀ (w × r)` for row-major `b` (`r × w`), in f32 with f64 sums: `t × r`.
fn times_t(a: &[f32], b: &[f32], t: usize, r: usize) -> Vec<f32> {
    let w = a.len().checked_div(t).unwrap_or(0);
    let mut out = vec![0.0f32; t * r];
    if w == 0 || b.len() != r * w {
        return out;
    }
    for (ar, or) in a.chunks_exact(w).zip(out.chunks_exact_mut(r)) {
        for (o, br) in or.iter_mut().zip(b.chunks_exact(w)) {
            *o = crate::compute::cpu::dot_f64(ar, br) as f32;
        }
    }
    out
}

/// `y (t × w) += c · p (t × r) · b (r × w)`.
fn add_times(y: &mut [f32], p: &[f32], b: &[f32], r: usize, c: f32) {
    let w = b.len().checked_div(r).unwrap_or(0);
    if w == 0 {
        return;
    }
    for (yr, pr) in y.chunks_exact_mut(w).zip(p.chunks_exact(r)) {
        for (&pv, br) in pr.iter().zip(b.chunks_exact(w)) {
            if pv != 0.0 {
                let s = c * pv;
                yr.iter_mut().zip(br).for_each(|(a, &v)| *a += s * v);
            }
        }
    }
}

impl<E: LinearExec> LinearExec for Pending<'_, E> {
    async fn linear(
        &mut self,
        stage: Stage,
        x: &[f32],
        t: usize,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let mut ys = self.inner.linear(stage, x, t).await?;
        if let Some(f) = self.factors(stage) {
            let rows = f.rows as usize;
            // (x · Xᵀ) · dY, per matrix.
            let p = times_t(x, &self.taken(&f.x, rows), t, rows);
            for (y, dy) in ys.iter_mut().zip(&f.dy) {
                add_times(y, &p, dy, rows, -self.update.step);
            }
        }
        Ok(ys)
    }

    async fn linear_t(
        &mut self,
        stage: Stage,
        dy: &[Vec<f32>],
        t: usize,
    ) -> Result<Vec<f32>, ModelError> {
        let mut dx = self.inner.linear_t(stage, dy, t).await?;
        if let Some(f) = self.factors(stage) {
            let rows = f.rows as usize;
            let fx = self.taken(&f.x, rows);
            for (g, fdy) in dy.iter().zip(&f.dy) {
                // (g · dYᵀ) · X.
                let p = times_t(g, fdy, t, rows);
                add_times(&mut dx, &p, &fx, rows, -self.update.step);
            }
        }
        Ok(dx)
    }

    async fn embed(&mut self, tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
        let mut e = self.inner.embed(tokens).await?;
        let d = self.cfg.hidden;
        let step = self.update.step;
        if self.cfg.tied_embeddings
            && let Some(f) = self.factors(Stage::LmHead)
            && let Some(dy) = f.dy.first()
        {
            let (rows, vocab) = (f.rows as usize, self.cfg.vocab);
            let fx = self.taken(&f.x, rows);
            for (&tok, row) in tokens.iter().zip(e.chunks_exact_mut(d)) {
                for i in 0..rows {
                    let c = dy.get(i * vocab + tok as usize).copied().unwrap_or(0.0);
                    if c != 0.0
                        && let Some(xr) = fx.get(i * d..(i + 1) * d)
                    {
                        row.iter_mut()
                            .zip(xr)
                            .for_each(|(a, &v)| *a -= step * c * v);
                    }
                }
            }
        }
        let lookups = self.update.embed_tokens.len();
        if lookups > 0 && self.update.embed_dx.len() == lookups * d {
            let embed_dx = self.taken(&self.update.embed_dx, lookups);
            for (&tok, row) in tokens.iter().zip(e.chunks_exact_mut(d)) {
                for (&u, dx) in self
                    .update
                    .embed_tokens
                    .iter()
                    .zip(embed_dx.chunks_exact(d))
                {
                    if u == tok {
                        row.iter_mut().zip(dx).for_each(|(a, &v)| *a -= step * v);
                    }
                }
            }
        }
        Ok(e)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

    use futures::executor::block_on;

    use super::*;
    use crate::coded::{CodedGroup, InProcess};
    use crate::learn::fixtures::{canary, setup, teacher};

    #[test]
    fn drift_counts_from_the_lowest_canary_loss_the_gate_has_seen() {
        let (llama, mut group, [grads, _]) = setup();
        let update = teacher(None).fold(grads).unwrap().unwrap().update;
        let now =
            block_on(CanaryGate::new(canary(), None).loss_at(&llama, &mut group, [0; 32])).unwrap();
        // A mesh whose reference is well above the canary now: the update is within its drift.
        let mut gate =
            CanaryGate::new(canary(), Some(now + 1.0)).with_bounds(f64::INFINITY, MAX_CANARY_DRIFT);
        let judge = |gate: &mut CanaryGate, group: &mut _, version| {
            block_on(gate.judge(&llama, group, version, &update, ShardFormat::Q8)).unwrap()
        };
        let v = judge(&mut gate, &mut group, [0; 32]);
        assert!(v.pass, "{:?}", v.refusal());
        assert_eq!((v.baseline, v.floor), (now + 1.0, now));
        // Once the gate saw the mesh a nat lower, the same change is far from that: refused,
        // while the claim still names the mesh's reference.
        gate.moved_to([1; 32], now - 1.0);
        let v = judge(&mut gate, &mut group, [1; 32]);
        assert!(!v.pass, "drift was counted from {}", v.floor);
        assert_eq!((v.baseline, v.floor), (now + 1.0, now - 1.0));
        assert!(v.refusal().unwrap().contains("counted from"));
    }

    /// An update of `grads` and the same update the other way: one raises the canary, the
    /// other lowers it.
    fn both_ways(grads: crate::model::Gradients) -> (Update, Update) {
        let update = teacher(None).fold(grads).unwrap().unwrap().update;
        let reversed = Update {
            step: -update.step,
            ..update.clone()
        };
        (update, reversed)
    }

    /// The fixture's model and group, its canary loss now, the one of an update both ways that
    /// raises the canary, and by how much.
    fn raising() -> (Llama, CodedGroup<InProcess>, f64, Update, f64) {
        let (llama, mut group, [grads, _]) = setup();
        let (update, reversed) = both_ways(grads);
        let now =
            block_on(CanaryGate::new(canary(), None).loss_at(&llama, &mut group, [0; 32])).unwrap();
        let mut probe = CanaryGate::new(canary(), None);
        let mut after = |u: &Update| {
            block_on(probe.judge(&llama, &mut group, [0; 32], u, ShardFormat::Q8))
                .unwrap()
                .after
        };
        let raising = if after(&update) > now {
            update
        } else {
            reversed
        };
        let rise = after(&raising) - now;
        assert!(rise > 0.0, "{rise}");
        (llama, group, now, raising, rise)
    }

    #[test]
    fn what_a_give_back_costs_the_canary_raises_the_floor_and_no_more() {
        let (llama, mut group, now, raising, rise) = raising();
        // The canary stood 0.02 nats lower once; drift may be 0.02 plus half the rise: as
        // learning, the update is refused.
        let mut gate = CanaryGate::new(canary(), Some(now + 0.5))
            .with_bounds(f64::INFINITY, 0.02 + rise / 2.0);
        gate.moved_to([1; 32], now - 0.02);
        gate.moved_to([2; 32], now);
        let mut judge = |gate: &mut CanaryGate, version, back: Option<&Update>| {
            let judged = (&raising, back);
            block_on(gate.judge_giving_back(&llama, &mut group, version, judged, ShardFormat::Q8))
                .unwrap()
        };
        let learnt = judge(&mut gate, [2; 32], None);
        assert!(!learnt.pass && learnt.given_back == 0.0, "{learnt:?}");
        // As a give-back (all of it takes back earlier steps), what it costs is not counted.
        let given = judge(&mut gate, [2; 32], Some(&raising));
        assert!(given.pass, "{given:?}");
        assert!((given.given_back - rise).abs() < 1e-9, "{given:?}");
        assert!(
            (given.floor - (now - 0.02 + rise)).abs() < 1e-9,
            "{given:?}"
        );
        // Taken: the floor stays raised by that much for the rounds after it.
        gate.gave_back(given.given_back);
        gate.moved_to([3; 32], given.after);
        let next = judge(&mut gate, [3; 32], None);
        assert!((next.floor - (now - 0.02 + rise)).abs() < 1e-9, "{next:?}");
        // Never past the mesh's reference.
        let mut near = CanaryGate::new(canary(), Some(now)).with_bounds(f64::INFINITY, 0.0);
        near.moved_to([1; 32], now - rise / 2.0);
        near.moved_to([2; 32], now);
        let capped = judge(&mut near, [2; 32], Some(&raising));
        assert_eq!(capped.floor, now, "{capped:?}");
        assert!(!capped.pass, "{capped:?}");
    }

    #[test]
    fn a_windowed_gate_leaves_room_again_once_its_low_is_a_window_old() {
        let (llama, mut group, now, raising, rise) = raising();
        // The canary once stood a nat lower; the drift bound is twice the rise. Counted from
        // the lowest ever, the rise is refused however often it is judged; counted over the
        // last three verdicts, it is refused until that low is three verdicts old.
        for window in [0, 3] {
            let mut gate = CanaryGate::new(canary(), Some(now + 2.0))
                .with_bounds(f64::INFINITY, 2.0 * rise)
                .with_window(window);
            gate.moved_to([1; 32], now - 1.0);
            let mut verdicts = vec![
                block_on(gate.judge(&llama, &mut group, [1; 32], &raising, ShardFormat::Q8))
                    .unwrap(),
            ];
            gate.moved_to([2; 32], now);
            for _ in 0..4 {
                verdicts.push(
                    block_on(gate.judge(&llama, &mut group, [2; 32], &raising, ShardFormat::Q8))
                        .unwrap(),
                );
            }
            let passed: Vec<bool> = verdicts.iter().map(|v| v.pass).collect();
            let floors: Vec<f64> = verdicts.iter().map(|v| v.floor).collect();
            if window == 0 {
                assert_eq!(passed, [false; 5], "{verdicts:?}");
                assert!(floors.iter().all(|&f| f == now - 1.0), "{floors:?}");
            } else {
                assert_eq!(passed, [false, false, false, true, true], "{verdicts:?}");
                assert_eq!(floors, [now - 1.0, now - 1.0, now - 1.0, now, now]);
            }
        }
    }

    #[test]
    fn an_update_that_lowers_the_canary_passes_however_far_the_floor_fell() {
        let (llama, mut group, [grads, _]) = setup();
        let (update, reversed) = both_ways(grads);
        let now =
            block_on(CanaryGate::new(canary(), None).loss_at(&llama, &mut group, [0; 32])).unwrap();
        // The canary once stood a nat lower than now, the mesh's reference half a nat higher:
        // every update that raises the canary is refused, one that lowers it is not.
        let mut gate = CanaryGate::new(canary(), Some(now + 0.5));
        gate.moved_to([1; 32], now - 1.0);
        gate.moved_to([2; 32], now);
        let mut judge = |u: &Update| {
            block_on(gate.judge(&llama, &mut group, [2; 32], u, ShardFormat::Q8)).unwrap()
        };
        let (a, b) = (judge(&update), judge(&reversed));
        assert_ne!(a.after <= now, b.after <= now, "{a:?} {b:?}");
        for v in [a, b] {
            assert_eq!((v.before, v.floor), (now, now - 1.0));
            assert!(v.after - v.before <= MAX_CANARY_STEP, "{v:?}");
            assert_eq!(v.pass, v.after <= v.before, "{v:?}");
        }
        // Never past the reference's bound: with the reference below the canary, neither.
        let mut strict = CanaryGate::new(canary(), Some(now - 1.0));
        for u in [&update, &reversed] {
            let v =
                block_on(strict.judge(&llama, &mut group, [2; 32], u, ShardFormat::Q8)).unwrap();
            assert!(!v.pass, "{v:?}");
        }
    }
}
