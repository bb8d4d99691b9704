//! Adam on the coded adapters: the optimizer that makes a mesh learn what it is shown.
//!
//! Every coded matrix serves `W + A·V`, where `V` (`rank × cols`, entries ±1, the same on every
//! node: [`Projection`]) is fixed and `A` (`out × rank`) learns, as LoRA learns with a frozen
//! down-projection. The gradient of `A` follows from the factors the backward pass already
//! keeps: `∂L/∂A = dYᵀ·(X·Vᵀ)`, `out × rank` a matrix. The leader keeps Adam's two moments of
//! every adapter entry (13 MB for SmolLM2) and publishes the step `ΔA` as an ordinary factor
//! update whose input factor is `V` itself: `ΔW = ΔA·V`. That is linear in what every node
//! applies, so the rows stay one codeword; Adam's non-linearity lives in the leader's state,
//! never in a shard (DESIGN.md §1, §10).
//!
//! Each entry moves by at most `lr / √cols` a request (Adam's direction clamped to ±1): `lr` is
//! the step in units of `V`'s rows scaled to unit length. A minibatch of `m` requests steps
//! `√m` times as far, up to [`MAX_BATCH_SCALE`] times, and that is what holders check
//! ([`super::Update::validate_for`]).

use super::{Precision, StageFactors, Update, wire};
use crate::coded::{Projection, ShardFormat};
use crate::compute::par;
use crate::model::{Gradients, LeaderWeights, LlamaConfig, Stage, StageGrad, StageSink};

/// Adam's decay of the first moment.
pub const BETA1: f64 = 0.9;
/// Adam's decay of the second moment.
pub const BETA2: f64 = 0.999;
/// Adam's floor under the second moment's root.
pub const EPSILON: f64 = 1e-10;

/// Most a minibatch's step is scaled: a step over `m` requests moves `√m` times as far as one
/// request's (the usual rule for Adam's rate against its batch size), up to this many times;
/// holders accept adapter entries moved by up to this many times the rate.
pub const MAX_BATCH_SCALE: f64 = 4.0;

/// One stage's adapter gradients: per matrix, `out × rank` row-major.
type StageGrads = Vec<Vec<f32>>;

/// Adam's moments of one stage's adapters.
#[derive(Debug, Clone)]
struct Moments {
    stage: Stage,
    cols: usize,
    rank: usize,
    /// Per matrix, the first moment, `out × rank`.
    m: Vec<Vec<f32>>,
    /// Per matrix, the second moment.
    v: Vec<Vec<f32>>,
}

/// A leader's Adam state over every adapter of the model, and the gradients it has summed
/// since its last step.
#[derive(Debug)]
pub struct AdapterAdam {
    model: LlamaConfig,
    format: ShardFormat,
    lr: f32,
    precision: Precision,
    stages: Vec<Moments>,
    steps: u32,
    /// Gradients summed since the last step, and how many.
    pending: Option<(Vec<StageGrads>, u32)>,
    /// The last step's gradients and their scale, until its update is out or refused: the
    /// moments take them then ([`Self::keep`]), so refusing a step costs no copy of them.
    unsettled: Option<(Vec<StageGrads>, f64)>,
    /// The moments and steps before a DiLoCo round ([`Self::begin_round`]), until its update
    /// is out or refused.
    round: Option<(Vec<Moments>, u32)>,
    /// Which adapters are trained.
    trained: Trained,
}

/// Which parts of the model a trainer's adapters move.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Trained {
    /// The LM head (the tied embedding when tied).
    pub head: bool,
    /// Attention's projections (query, key, value and output).
    pub attention: bool,
    /// The SwiGLU projections (gate, up and down).
    pub mlp: bool,
}

impl Trained {
    /// Every adapter.
    pub const ALL: Self = Self {
        head: true,
        attention: true,
        mlp: true,
    };

    /// The adapters a mesh's trainers move: the SwiGLU projections alone. Attention's and the
    /// LM head's adapters, moved by chats, wore away other kinds of text (attention's alone
    /// raised code's perplexity 35 % over 100 chats) and taught facts little (docs/coding.md,
    /// "Facts and rehearsal").
    pub const MESH: Self = Self {
        head: false,
        attention: false,
        mlp: true,
    };

    /// Whether `stage`'s adapters move.
    pub fn stage(&self, stage: Stage) -> bool {
        match stage {
            Stage::LmHead => self.head,
            Stage::Qkv(_) | Stage::AttnOut(_) => self.attention,
            Stage::GateUp(_) | Stage::Down(_) => self.mlp,
        }
    }
}

/// How much one `dy` value of a published adapter step moves its entry of `A`, per unit of
/// the update's step, on shards of `format` (docs/coding.md): f32 shards add `dyᵀ·V` to their
/// values, compact ones `dyᵀ·(V·Vᵀ/rank) = (cols/rank)·dyᵀ` to their adapters.
pub fn entry_per_dy(format: ShardFormat, cols: usize, rank: usize) -> f64 {
    match format {
        ShardFormat::Q8 | ShardFormat::Q4 => cols as f64 / rank as f64,
        ShardFormat::F32 | ShardFormat::F16 => 1.0,
    }
}

/// Every stage's adapter gradient `dYᵀ·(X·Vᵀ)`, and, for a tied embedding, the lookup rows'
/// `dx·Vᵀ` added to the LM head's rows of their tokens (one matrix). An untied embedding's
/// lookup does not learn.
pub fn adapter_gradients(g: &Gradients, model: &LlamaConfig) -> Vec<StageGrads> {
    let mut out = par::map(&g.stages, |s| stage_gradient(s, model));
    add_lookups(&mut out, g.stages.iter().map(|s| s.stage), g, model);
    out
}

/// One stage's adapter gradients `dYᵀ·(X·Vᵀ)`, per matrix `out × rank` (zeros where a factor
/// does not fit the model).
fn stage_gradient(s: &StageGrad, model: &LlamaConfig) -> StageGrads {
    let shapes = s.stage.shapes(model);
    let cols = shapes.first().map_or(0, |&(_, c)| c);
    let t = s.x.len().checked_div(cols).unwrap_or(0);
    let proj = Projection::of(cols);
    let r = proj.rank();
    let z = proj.down(&s.x, t);
    s.dy.iter()
        .zip(&shapes)
        .map(|(dy, &(rows, _))| {
            let mut ga = vec![0.0f32; rows * r];
            if dy.len() != t * rows {
                return ga;
            }
            for (dyr, zr) in dy.chunks_exact(rows).zip(z.chunks_exact(r)) {
                for (&a, gr) in dyr.iter().zip(ga.chunks_exact_mut(r)) {
                    if a != 0.0 {
                        gr.iter_mut().zip(zr).for_each(|(gv, &zv)| *gv += a * zv);
                    }
                }
            }
            ga
        })
        .collect()
}

/// A tied embedding's lookup rows `dx·Vᵀ` added to the LM head's adapter gradient among
/// `sums` (one per stage of `stages`).
fn add_lookups(
    sums: &mut [StageGrads],
    mut stages: impl Iterator<Item = Stage>,
    g: &Gradients,
    model: &LlamaConfig,
) {
    let d = model.hidden;
    if !model.tied_embeddings || g.tokens.is_empty() || g.embed_dx.len() != g.tokens.len() * d {
        return;
    }
    let Some(head) = stages
        .position(|s| s == Stage::LmHead)
        .and_then(|i| sums.get_mut(i))
        .and_then(|m| m.first_mut())
    else {
        return;
    };
    let proj = Projection::of(d);
    let r = proj.rank();
    let z = proj.down(&g.embed_dx, g.tokens.len());
    for (&tok, zr) in g.tokens.iter().zip(z.chunks_exact(r)) {
        if let Some(row) = head.get_mut(tok as usize * r..(tok as usize + 1) * r) {
            row.iter_mut().zip(zr).for_each(|(a, &b)| *a += b);
        }
    }
}

/// A stage's columns, adapter rank, and a zero `out × rank` per matrix.
fn zeros(stage: Stage, model: &LlamaConfig) -> (usize, usize, StageGrads) {
    let shapes = stage.shapes(model);
    let cols = shapes.first().map_or(0, |&(_, c)| c);
    let rank = crate::coded::adapter_rank(cols);
    let zero = shapes
        .iter()
        .map(|&(o, _)| vec![0.0f32; o * rank])
        .collect();
    (cols, rank, zero)
}

/// Every adapter's gradient, summed as a backward pass hands over each stage's
/// ([`StageSink`]): a training pass then keeps none of its factors, only these sums (`out ×
/// rank` per matrix).
#[derive(Debug)]
pub struct AdapterSums {
    model: LlamaConfig,
    stages: Vec<Stage>,
    sums: Vec<StageGrads>,
}

impl AdapterSums {
    /// Zero sums for every adapter of `model`.
    pub fn new(model: &LlamaConfig) -> Self {
        let stages = Stage::all(model);
        let sums = stages.iter().map(|&s| zeros(s, model).2).collect();
        Self {
            model: model.clone(),
            stages,
            sums,
        }
    }

    /// The sums with the lookup rows of `g` (the pass's gradients) added: what the step takes.
    fn finish(mut self, g: &Gradients) -> Vec<StageGrads> {
        add_lookups(&mut self.sums, self.stages.iter().copied(), g, &self.model);
        self.sums
    }
}

impl StageSink for AdapterSums {
    fn take(&mut self, g: StageGrad) {
        let Some(i) = self.stages.iter().position(|&s| s == g.stage) else {
            return;
        };
        let grads = stage_gradient(&g, &self.model);
        for (a, b) in self.sums[i].iter_mut().zip(&grads) {
            a.iter_mut().zip(b).for_each(|(x, &y)| *x += y);
        }
    }
}

impl AdapterAdam {
    /// Fresh moments for every adapter of `model`, stepping at `lr` on a mesh of `format`.
    pub fn new(model: LlamaConfig, format: ShardFormat, lr: f32, precision: Precision) -> Self {
        let stages = Stage::all(&model)
            .into_iter()
            .map(|stage| {
                let (cols, rank, m) = zeros(stage, &model);
                Moments {
                    stage,
                    cols,
                    rank,
                    v: m.clone(),
                    m,
                }
            })
            .collect();
        Self {
            model,
            format,
            lr,
            precision,
            stages,
            steps: 0,
            pending: None,
            unsettled: None,
            round: None,
            trained: Trained::ALL,
        }
    }

    /// Trains only the adapters `trained` names; the rest stay where they are (set before the
    /// first step: the moments of an adapter not trained are not kept).
    pub fn train(&mut self, trained: Trained) {
        self.trained = trained;
    }

    /// Starts a DiLoCo round: what came before is kept, and the moments as they are now are
    /// what [`Self::undo`] goes back to until the round's update is out or refused.
    pub fn begin_round(&mut self) {
        self.keep();
        self.round = Some((self.stages.clone(), self.steps));
    }

    /// One inner step of a round ([`Self::step`]) whose gradients the moments take at once:
    /// the next inner step follows it.
    pub fn inner_step(&mut self, t: u32, sequences: u32) -> Option<Update> {
        let u = self.step(t, sequences)?;
        self.absorb();
        Some(u)
    }

    /// Forgets the last step, as if its gradients had never come (an update the canary gate
    /// refused must not steer the next ones through the moments); false when there is none.
    pub fn undo(&mut self) -> bool {
        if let Some((stages, steps)) = self.round.take() {
            self.unsettled = None;
            self.pending = None;
            self.stages = stages;
            self.steps = steps;
            return true;
        }
        let undone = self.unsettled.take().is_some();
        if undone {
            self.steps -= 1;
        }
        undone
    }

    /// Keeps the last step (or round) for good (its update is out): its gradients go into the
    /// moments. A step also keeps the one before it, if neither was said.
    pub fn keep(&mut self) {
        self.round = None;
        self.absorb();
    }

    /// The last step's gradients into the moments.
    fn absorb(&mut self) {
        let Some((grads, scale)) = self.unsettled.take() else {
            return;
        };
        // A stage that is not trained never reads its moments: they are not kept.
        let trained = self.trained;
        let stages = self.stages.iter_mut().zip(grads);
        for (mo, ga) in stages.filter(|(mo, _)| trained.stage(mo.stage)) {
            for ((m, v), g) in mo.m.iter_mut().zip(mo.v.iter_mut()).zip(&ga) {
                for ((m, v), &g) in m.iter_mut().zip(v.iter_mut()).zip(g) {
                    let (mv, vv) = moved(*m, *v, f64::from(g) * scale);
                    *m = mv as f32;
                    *v = vv as f32;
                }
            }
        }
    }

    /// Steps taken so far.
    pub fn steps(&self) -> u32 {
        self.steps
    }

    /// Gradients summed and not yet stepped on.
    pub fn pending(&self) -> u32 {
        self.pending.as_ref().map_or(0, |p| p.1)
    }

    /// Adds one gradient to what the next step takes.
    pub fn push(&mut self, g: &Gradients) {
        self.add(adapter_gradients(g, &self.model));
    }

    /// [`Self::push`] for a gradient whose stages went into `sums` as they were made.
    pub fn push_summed(&mut self, g: &Gradients, sums: AdapterSums) {
        self.add(sums.finish(g));
    }

    /// Adds one gradient's adapter gradients to what the next step takes.
    fn add(&mut self, grads: Vec<StageGrads>) {
        match &mut self.pending {
            Some((sum, n)) => {
                for (a, b) in sum.iter_mut().flatten().zip(grads.iter().flatten()) {
                    a.iter_mut().zip(b).for_each(|(x, &y)| *x += y);
                }
                *n += 1;
            }
            None => self.pending = Some((grads, 1)),
        }
    }

    /// One Adam step on the mean of the pending gradients, over `t` positions of `sequences`
    /// requests (the step moves `√sequences` times as far, at most [`MAX_BATCH_SCALE`]), as
    /// the update every node applies; `None` when nothing is pending.
    pub fn step(&mut self, t: u32, sequences: u32) -> Option<Update> {
        let (grads, n) = self.pending.take()?;
        self.absorb();
        let batch = f64::from(sequences.max(1)).sqrt().min(MAX_BATCH_SCALE);
        self.steps += 1;
        let scale = 1.0 / f64::from(n.max(1));
        let (c1, c2) = (
            1.0 - BETA1.powi(self.steps as i32),
            1.0 - BETA2.powi(self.steps as i32),
        );
        let format = self.format;
        // Elementwise over ~1.6 M entries for SmolLM2: milliseconds, on one thread.
        let stages = self
            .stages
            .iter()
            .zip(&grads)
            .map(|(mo, ga)| {
                let proj = Projection::of(mo.cols);
                // dy = direction / √cols, in the units the format takes (`entry_per_dy`).
                let unit =
                    batch / ((mo.cols as f64).sqrt() * entry_per_dy(format, mo.cols, mo.rank));
                let dy = mo
                    .m
                    .iter()
                    .zip(&mo.v)
                    .zip(ga)
                    .map(|((m, v), g)| {
                        let out = g.len() / mo.rank.max(1);
                        let mut dy = vec![0.0f32; mo.rank * out];
                        if !self.trained.stage(mo.stage) {
                            return dy;
                        }
                        for (e, &gv) in g.iter().enumerate() {
                            let (mv, vv) = moved(m[e], v[e], f64::from(gv) * scale);
                            let dir = ((mv / c1) / ((vv / c2).sqrt() + EPSILON)).clamp(-1.0, 1.0);
                            let (o, i) = (e / mo.rank, e % mo.rank);
                            dy[i * out + o] = (dir * unit) as f32;
                        }
                        dy
                    })
                    .collect();
                StageFactors {
                    stage: mo.stage,
                    rows: mo.rank as u32,
                    x: proj.matrix().to_vec(),
                    dy,
                }
            })
            .collect();
        let mut u = Update {
            step: self.lr,
            t,
            stages,
            embed_tokens: Vec::new(),
            embed_dx: Vec::new(),
            norms: LeaderWeights::zeros(&self.model),
            precision: self.precision,
        };
        wire::round(&mut u);
        self.unsettled = Some((grads, scale));
        Some(u)
    }
}

/// Adam's moments `(m, v)` after a gradient value `g`, in f64.
fn moved(m: f32, v: f32, g: f64) -> (f64, f64) {
    (
        BETA1 * f64::from(m) + (1.0 - BETA1) * g,
        BETA2 * f64::from(v) + (1.0 - BETA2) * g * g,
    )
}

/// The most a published adapter update may move one entry of a stage with `cols` columns, on a
/// mesh whose rate is `lr` and whose rounds reach `reach` steps
/// ([`super::LearningConfig::adapter_reach`]): `reach · MAX_BATCH_SCALE · lr / √cols`.
pub(super) fn most_entry_move(lr: f32, reach: f64, cols: usize) -> f64 {
    f64::from(lr) * MAX_BATCH_SCALE * reach / (cols as f64).sqrt()
}

/// Whether `u` is an adapter step within the bound `lr` sets on a mesh of `format`: every
/// stage's input factor is its projection `V`, no adapter entry moves by more than
/// `reach · MAX_BATCH_SCALE · lr / √cols` (a minibatch's step, times what a DiLoCo round may
/// add up to: [`super::LearningConfig::adapter_reach`]), and neither the lookup rows nor the
/// norm gains move.
pub fn check_adapter_step(
    u: &Update,
    format: ShardFormat,
    lr: f32,
    reach: f64,
) -> Result<(), String> {
    if !u.embed_tokens.is_empty() || !u.embed_dx.is_empty() {
        return Err("an adapter step carries no lookup rows".into());
    }
    if u.norms.values().any(|&v| v != 0.0) {
        return Err("an adapter step leaves the norm gains as they are".into());
    }
    let slack = 1.0 + 1e-3;
    for f in &u.stages {
        let cols = if f.rows == 0 {
            continue;
        } else {
            f.x.len() / f.rows as usize
        };
        let proj = Projection::of(cols);
        if f.rows as usize != proj.rank() || f.x != proj.matrix() {
            return Err(format!(
                "{:?}'s input factor is not the adapters' projection",
                f.stage
            ));
        }
        let most = most_entry_move(lr, reach, cols);
        let per = f64::from(u.step) * entry_per_dy(format, cols, proj.rank());
        let largest = f.dy.iter().flatten().fold(0.0f32, |a, &v| a.max(v.abs()));
        if f64::from(largest) * per > most * slack {
            return Err(format!(
                "{:?} moves an adapter entry by {:.3e}, more than the mesh's {most:.3e}",
                f.stage,
                f64::from(largest) * per
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

    use futures::executor::block_on;

    use super::*;

    #[test]
    fn summing_each_stage_as_it_is_made_gives_the_whole_gradients_adapter_gradients() {
        let (llama, mut group, [whole, _]) = crate::learn::fixtures::setup();
        let model = llama.config().clone();
        // The text the fixture's first gradient is of.
        let tokens: Vec<u32> = (0..24).map(|i| i * 7 % 96).collect();
        let mut sums = AdapterSums::new(&model);
        let summed = block_on(llama.gradients_into(&mut group, &[&tokens], &mut sums)).unwrap();
        assert!(summed.stages.is_empty(), "the sink took every stage");
        assert_eq!(summed.t, whole.t);
        let (got, want) = (sums.finish(&summed), adapter_gradients(&whole, &model));
        assert_eq!(got.len(), Stage::all(&model).len());
        let mut largest = 0.0f32;
        for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
            assert_eq!(g.len(), w.len());
            for (a, b) in g.iter().zip(w) {
                assert!((a - b).abs() <= 1e-5 * b.abs().max(1e-3), "{a} vs {b}");
                largest = largest.max(b.abs());
            }
        }
        assert!(largest > 0.0, "the gradients are not all zero");
    }
}
