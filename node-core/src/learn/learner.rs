//! A leader's learning state: turns each request's gradient into what the mesh gossips.
//!
//! With the mesh's `rank = 0`, every request publishes its exact f32 factors. With `rank > 0`,
//! each stage's factors are compressed to that rank and sent as f16; requests can be accumulated
//! (`accumulate = H`: one update every H requests) with a linear outer momentum `β`
//! (`m ← β·m + Σ g`, the published update is `m`): PCP's DiLoCo, kept linear so the code
//! survives it.

use super::adam::{AdapterAdam, AdapterSums};
use super::diloco::Outer;
use super::{LearningConfig, Optimizer};
use super::{Precision, StageFactors, Update, UpdateError, compress, scale, wire};
use crate::coded::ShardFormat;
use crate::model::{Gradients, LlamaConfig, Stage};

/// An update ready to be gossiped.
#[derive(Debug, Clone, PartialEq)]
pub struct Published {
    /// The update.
    pub update: Update,
    /// Requests folded into it.
    pub requests: u32,
    /// Share of the gradient energy the compression kept, over the stages it cut (1: exact).
    pub kept: f64,
}

/// Folds requests' gradients into the updates a leader publishes.
#[derive(Debug)]
pub struct Learner {
    cfg: LearningConfig,
    model: LlamaConfig,
    pending: Option<Update>,
    /// Gradients folded in since the last update (what `accumulate` counts).
    requests: u32,
    /// Sequences those gradients were the means over.
    sequences: u32,
    momentum: Option<Update>,
    kept: (f64, f64),
    /// Adam's state, with [`Optimizer::AdamAdapters`].
    adam: Option<AdapterAdam>,
    /// Positions folded in since the last update.
    positions: u32,
    /// DiLoCo's outer optimiser, where the mesh runs rounds ([`LearningConfig::diloco`]).
    outer: Option<Outer>,
}

impl Learner {
    /// A learner for a mesh's settings and model, whose shards are stored as `format`.
    pub fn new(cfg: LearningConfig, model: LlamaConfig, format: ShardFormat) -> Self {
        let adam = (cfg.optimizer == Optimizer::AdamAdapters)
            .then(|| AdapterAdam::new(model.clone(), format, cfg.lr, cfg.precision()));
        let outer = (adam.is_some() && cfg.diloco()).then(|| Outer::new(cfg, format));
        Self {
            adam,
            outer,
            positions: 0,
            cfg,
            model,
            pending: None,
            requests: 0,
            sequences: 0,
            momentum: None,
            kept: (0.0, 0.0),
        }
    }

    /// Whether Adam trains the mesh's adapters ([`Optimizer::AdamAdapters`]).
    pub fn adapters(&self) -> bool {
        self.adam.is_some()
    }

    /// Trains only the adapters `trained` names, where Adam trains adapters.
    pub fn train(&mut self, trained: super::Trained) {
        if let Some(adam) = &mut self.adam {
            adam.train(trained);
        }
    }

    /// Where the mesh runs DiLoCo rounds, each published round takes back `share` of how far
    /// this learner's updates moved the adapters ([`Outer::with_decay`]).
    pub fn decay(&mut self, share: f32) {
        if let Some(outer) = &mut self.outer {
            outer.set_decay(share);
        }
    }

    /// Where the mesh runs DiLoCo rounds, the outer rate halves over `rounds` of this
    /// learner's published rounds, a third over twice that, … ([`Outer::anneal`]).
    pub fn anneal(&mut self, rounds: u32) {
        if let Some(outer) = &mut self.outer {
            outer.anneal(rounds);
        }
    }

    /// Where the mesh runs DiLoCo rounds, an adapter entry's step goes out only where this
    /// learner's recent rounds agree on it by `threshold` ([`Outer::consensus`]).
    pub fn consensus(&mut self, threshold: f32) {
        if let Some(outer) = &mut self.outer {
            outer.consensus(threshold);
        }
    }

    /// The part of the update just made that takes back earlier steps, alone
    /// ([`Outer::give_back`]).
    pub fn give_back(&self) -> Option<&Update> {
        self.outer.as_ref().and_then(Outer::give_back)
    }

    /// The gate halved the update just made: what may go out is that.
    pub fn halved(&mut self) {
        if let Some(outer) = &mut self.outer {
            outer.halved();
        }
    }

    /// Requests folded in and not yet published.
    pub fn pending(&self) -> u32 {
        self.requests
    }

    /// Forgets the update just published, where the optimizer keeps state (Adam's moments):
    /// the canary gate refused it, so it must not steer later steps. False where nothing
    /// could be forgotten.
    pub fn refuse_last(&mut self) -> bool {
        if let Some(outer) = &mut self.outer {
            outer.undo();
        }
        self.adam.as_mut().is_some_and(AdapterAdam::undo)
    }

    /// The update just published is out for good: the optimizer lets go of what
    /// [`Self::refuse_last`] would have needed.
    pub fn keep_last(&mut self) {
        if let Some(outer) = &mut self.outer {
            outer.keep();
        }
        if let Some(adam) = &mut self.adam {
            adam.keep();
        }
    }

    /// Inner steps a DiLoCo round takes over each minibatch; `None` where the mesh runs no
    /// rounds (each gradient goes through [`Self::push`] or [`Self::push_summed`]).
    pub fn inner_steps(&self) -> Option<u32> {
        (self.cfg.enabled && self.outer.is_some()).then_some(self.cfg.inner_steps.max(1))
    }

    /// Starts a DiLoCo round: until its update is out or refused, refusing goes back to here.
    pub fn begin_round(&mut self) {
        if let Some(adam) = &mut self.adam {
            adam.begin_round();
        }
    }

    /// One inner step of a round over a gradient whose stages went into `sums`: the adapter
    /// step, which the round's next pass adds to the group's answers.
    pub fn inner_step(&mut self, g: &Gradients, sums: AdapterSums) -> Result<Update, UpdateError> {
        let adam = self
            .adam
            .as_mut()
            .filter(|_| self.outer.is_some())
            .ok_or_else(|| UpdateError::Settings("this mesh runs no DiLoCo rounds".into()))?;
        adam.push_summed(g, sums);
        let t = u32::try_from(g.t).unwrap_or(u32::MAX);
        let sequences = u32::try_from(g.sequences.max(1)).unwrap_or(u32::MAX);
        adam.inner_step(t, sequences)
            .ok_or_else(|| UpdateError::Settings("an inner step took no gradient".into()))
    }

    /// The update a round publishes: the outer step over the sum of its inner steps, for
    /// `requests` requests, without the stages it does not move ([`Update::trimmed`]).
    pub fn end_round(&mut self, sum: Update, requests: u32) -> Result<Published, UpdateError> {
        let outer = self
            .outer
            .as_mut()
            .ok_or_else(|| UpdateError::Settings("this mesh runs no DiLoCo rounds".into()))?;
        Ok(Published {
            update: outer.step(sum).trimmed(),
            requests,
            kept: 1.0,
        })
    }

    /// Takes one request's gradient; returns an update when one is due.
    pub fn push(&mut self, g: Gradients) -> Result<Option<Published>, UpdateError> {
        if !self.cfg.enabled {
            return Ok(None);
        }
        if let Some(adam) = &mut self.adam {
            adam.push(&g);
            return self.counted(&g);
        }
        let sequences = u32::try_from(g.sequences.max(1)).unwrap_or(u32::MAX);
        let exact = Update::from_gradients(g, self.cfg.lr, self.cfg.clip);
        if self.cfg.rank == 0 {
            return Ok(Some(Published {
                update: exact,
                requests: sequences,
                kept: 1.0,
            }));
        }
        let mut u = self.fold(exact);
        if let Some(p) = self.pending.take() {
            u = concat(&p, &u)?;
        }
        self.compress(&mut u);
        self.pending = Some(u);
        self.requests += 1;
        self.sequences = self.sequences.saturating_add(sequences);
        if self.requests >= self.cfg.accumulate.max(1) {
            return self.flush();
        }
        Ok(None)
    }

    /// Where a training pass hands each stage's gradient as it makes it, for
    /// [`Self::push_summed`]: the adapters' sums with Adam on the adapters (`None` otherwise:
    /// SGD takes whole factors, through [`Self::push`]).
    pub fn stage_sink(&self) -> Option<AdapterSums> {
        (self.cfg.enabled && self.adam.is_some()).then(|| AdapterSums::new(&self.model))
    }

    /// [`Self::push`] for a gradient whose stages went into `sums` ([`Self::stage_sink`]).
    pub fn push_summed(
        &mut self,
        g: Gradients,
        sums: AdapterSums,
    ) -> Result<Option<Published>, UpdateError> {
        let Some(adam) = self.adam.as_mut().filter(|_| self.cfg.enabled) else {
            return Err(UpdateError::Settings(
                "only Adam on the adapters takes summed gradients".into(),
            ));
        };
        adam.push_summed(&g, sums);
        self.counted(&g)
    }

    /// Counts a gradient Adam took; the update when one is due.
    fn counted(&mut self, g: &Gradients) -> Result<Option<Published>, UpdateError> {
        let sequences = u32::try_from(g.sequences.max(1)).unwrap_or(u32::MAX);
        self.requests += 1;
        self.sequences = self.sequences.saturating_add(sequences);
        self.positions = self
            .positions
            .saturating_add(u32::try_from(g.t).unwrap_or(u32::MAX));
        if self.requests >= self.cfg.accumulate.max(1) {
            return self.flush();
        }
        Ok(None)
    }

    /// Publishes what is pending now (at the end of a session), if anything.
    pub fn flush(&mut self) -> Result<Option<Published>, UpdateError> {
        if let Some(adam) = &mut self.adam {
            let positions = std::mem::take(&mut self.positions);
            let Some(update) = adam.step(positions, self.sequences) else {
                return Ok(None);
            };
            self.requests = 0;
            return Ok(Some(Published {
                update,
                requests: std::mem::take(&mut self.sequences),
                kept: 1.0,
            }));
        }
        let Some(pending) = self.pending.take() else {
            return Ok(None);
        };
        let mut out = match self.momentum.take() {
            Some(m) if self.cfg.momentum > 0.0 => {
                let mut m = m;
                scale(&mut m, self.cfg.momentum);
                // The lookup rows of an untied embedding do not carry momentum (they would pile
                // up without bound); its stages and norms do.
                m.embed_tokens.clear();
                m.embed_dx.clear();
                concat(&m, &pending)?
            }
            _ => pending,
        };
        self.compress(&mut out);
        out.precision = Precision::F16;
        wire::round(&mut out);
        self.fit_bound(&mut out);
        if self.cfg.momentum > 0.0 {
            self.momentum = Some(out.clone());
        }
        self.requests = 0;
        let requests = std::mem::take(&mut self.sequences);
        let (kept, energy) = std::mem::take(&mut self.kept);
        Ok(Some(Published {
            update: out,
            requests,
            kept: if energy > 0.0 { kept / energy } else { 1.0 },
        }))
    }

    /// The request's clipping folded into its factors (the step is then the learning rate), and
    /// a tied embedding's lookup rows moved into the LM head stage (the same matrix).
    fn fold(&self, mut u: Update) -> Update {
        if self.cfg.lr > 0.0 {
            let c = u.step / self.cfg.lr;
            scale(&mut u, c);
            u.step = self.cfg.lr;
        }
        if self.model.tied_embeddings
            && let Some(head) = u.stages.iter_mut().find(|f| f.stage == Stage::LmHead)
        {
            let (vocab, d) = (self.model.vocab, self.model.hidden);
            for (i, &tok) in u.embed_tokens.iter().enumerate() {
                let mut onehot = vec![0.0f32; vocab];
                onehot[tok as usize % vocab] = 1.0;
                head.x.extend_from_slice(&u.embed_dx[i * d..(i + 1) * d]);
                if let Some(dy) = head.dy.first_mut() {
                    dy.extend_from_slice(&onehot);
                }
                head.rows += 1;
            }
            u.embed_tokens.clear();
            u.embed_dx.clear();
        }
        u
    }

    /// Scales the update down when what nodes will measure of it exceeds the mesh's bound:
    /// clipping bounds each request's gradient, but a tied embedding's lookup rows moved into
    /// the LM head (the same matrix, where they can add up) and the f16 rounding can carry the
    /// published factors past `lr · clip`, and every node would refuse the update.
    fn fit_bound(&self, u: &mut Update) {
        let bound = self.cfg.step_norm_bound();
        let total = u.step as f64 * u.gradient_norm();
        // Room below the nodes' slack (1e-3) for rounding the scaled factors again.
        let target = bound * (1.0 - 1e-3);
        if total > target {
            scale(u, (target / total) as f32);
            wire::round(u);
        }
    }

    /// Every stage cut to the mesh's rank.
    fn compress(&mut self, u: &mut Update) {
        let rank = self.cfg.rank as usize;
        for f in u.stages.iter_mut().filter(|f| f.rows as usize > rank) {
            let lr = compress::low_rank(&f.x, &f.dy, f.rows as usize, rank);
            if lr.energy > 0.0 {
                self.kept.0 += lr.kept * lr.energy;
                self.kept.1 += lr.energy;
            }
            f.rows = lr.rows as u32;
            f.x = lr.x;
            f.dy = lr.dy;
        }
    }
}

/// The sum of two updates with the same step: their factor rows side by side.
fn concat(a: &Update, b: &Update) -> Result<Update, UpdateError> {
    if a.step != b.step || a.stages.len() != b.stages.len() {
        return Err(UpdateError::Shape(
            "only updates of one model and step add up".into(),
        ));
    }
    let stages = a
        .stages
        .iter()
        .zip(&b.stages)
        .map(|(p, q)| {
            if p.stage != q.stage || p.dy.len() != q.dy.len() {
                return Err(UpdateError::Shape("the stages differ".into()));
            }
            Ok(StageFactors {
                stage: p.stage,
                rows: p.rows + q.rows,
                x: [p.x.as_slice(), &q.x].concat(),
                dy: p
                    .dy
                    .iter()
                    .zip(&q.dy)
                    .map(|(u, v)| [u.as_slice(), v].concat())
                    .collect(),
            })
        })
        .collect::<Result<_, _>>()?;
    let add = |u: &[f32], v: &[f32]| u.iter().zip(v).map(|(x, y)| x + y).collect::<Vec<f32>>();
    Ok(Update {
        step: a.step,
        t: a.t + b.t,
        stages,
        embed_tokens: [a.embed_tokens.as_slice(), &b.embed_tokens].concat(),
        embed_dx: [a.embed_dx.as_slice(), &b.embed_dx].concat(),
        norms: {
            let mut sum = a.norms.clone();
            for (u, v) in sum.vectors_mut().zip(b.norms.vectors()) {
                *u = add(u, v);
            }
            sum
        },
        precision: a.precision,
    })
}
