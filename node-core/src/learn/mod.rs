//! Learning updates: one request's gradient as factors, clipped and scaled into an SGD step that
//! every node applies to its own shard (`δS_i = (Σ_j G[i,j]·dY_j)ᵀ·X`), so the shards stay one
//! codeword. Plain SGD, optionally with momentum and accumulation over several requests: all
//! linear, so the code survives them (DESIGN.md §1). Factors can be compressed to a low rank and
//! sent as f16 ([`Learner`]).

mod adam;
mod admit;
mod budget;
mod canary;
mod compress;
mod config;
mod diloco;
mod learner;
mod replay;
mod signed;
mod teacher;
mod wire;

pub use crate::update::{Precision, StageFactors, Update};
pub use adam::{
    AdapterAdam, AdapterSums, MAX_BATCH_SCALE, Trained, adapter_gradients, check_adapter_step,
    entry_per_dy,
};
pub use admit::{AdmitError, CertBody, Certificate, MAX_CERT_BYTES, MeshKey, Power};
pub use budget::{BUDGET_REFILL_PER_S, BUDGET_TOKENS, Budget, Budgets};
pub use canary::{
    CANARY_TEXT, CANARY_TOKENS, CanaryGate, MAX_CANARY_DRIFT, MAX_CANARY_STEP, Pending, Verdict,
    canary_reference, canary_tokens,
};
pub use compress::{LowRank, low_rank};
pub use config::{
    DEFAULT_ADAM_LR, DEFAULT_INNER_STEPS, DEFAULT_OUTER_LR, DEFAULT_OUTER_MOMENTUM, DEFAULT_RANK,
    DEFAULT_SGD_LR, DEFAULT_SGD_RANK, LearningConfig, MAX_ACCUMULATE, MAX_INNER_STEPS, Optimizer,
};
pub use diloco::{Outer, add_step};
pub use learner::{Learner, Published};
pub use replay::{REPLAY_LESSONS, REPLAY_TOKENS, Replay};
pub use signed::{GateClaim, Header, Signed, Signer, open, seal};
/// A small coded model, its gradients and teachers, for the tests of what leaders do with them.
#[cfg(test)]
pub(crate) use teacher::tests as fixtures;
pub use teacher::{
    ANCHOR_TOP, BACKOFFS, Judged, KNOWN_NATS, REHEARSAL_TEXT, REHEARSAL_TOKENS, Studied,
    TeachError, Teacher, rehearsal_tokens,
};

use crate::coded::{CodedError, Projection, Shard, ShardFormat, ShardSet, ShardValues};
use crate::compute::cpu::dot_f64;
use crate::model::{Gradients, LeaderWeights, LlamaConfig, ModelWeights, Stage, StageGrad};

/// A learning update that cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum UpdateError {
    /// Shapes do not match the model.
    #[error("update does not fit the model: {0}")]
    Shape(String),
    /// NaN or infinity in the update.
    #[error("update holds a non-finite value")]
    NotFinite,
    /// The step is larger than allowed.
    #[error("update step {step} with gradient norm {norm} exceeds the bound {bound}")]
    TooLarge {
        /// The step size.
        step: f32,
        /// The gradient's norm.
        norm: f64,
        /// The largest accepted `step · norm`.
        bound: f64,
    },
    /// The mesh does not learn, or the step breaks the mesh's learning rate and clipping.
    #[error("update refused by the mesh's learning settings: {0}")]
    Settings(String),
    /// The payload is not signed, or its signature does not hold.
    #[error("update signature: {0}")]
    Signature(String),
    /// Applying it to a shard failed.
    #[error("applying the update: {0}")]
    Apply(#[from] CodedError),
}

/// `Σ_dy ‖dYᵀ·X‖_F²` over the products that share the input `x`: `Σ_{a,b} ⟨x_a, x_b⟩·⟨dy_a,
/// dy_b⟩`, without forming `dYᵀ·X`; infinite when a shape does not fit `t` rows.
fn factors_norm_sq(x: &[f32], dys: &[Vec<f32>], t: usize) -> f64 {
    if t == 0 {
        return 0.0;
    }
    let inp = x.len() / t;
    if inp * t != x.len() || dys.iter().any(|dy| dy.len() % t != 0) {
        return f64::INFINITY;
    }
    // X's Gram matrix once for all the products that share it, and each Gram matrix's upper
    // triangle only (it is symmetric): the trainer measures factors of up to 256 positions.
    let gx = gram(x, t);
    dys.iter()
        .map(|dy| {
            let gy = gram(dy, t);
            let mut sum = 0.0;
            let mut at = 0;
            for a in 0..t {
                sum += gx[at] * gy[at];
                let off: f64 = gx[at + 1..at + t - a]
                    .iter()
                    .zip(&gy[at + 1..at + t - a])
                    .map(|(p, q)| p * q)
                    .sum();
                sum += 2.0 * off;
                at += t - a;
            }
            sum
        })
        .sum()
}

/// The upper triangle of `V·Vᵀ` for `t` rows `v` (row by row, the diagonal first), in f64.
fn gram(v: &[f32], t: usize) -> Vec<f64> {
    let w = v.len() / t;
    let mut g = Vec::with_capacity(t * (t + 1) / 2);
    for a in 0..t {
        let row = &v[a * w..(a + 1) * w];
        for b in a..t {
            g.push(dot_f64(row, &v[b * w..(b + 1) * w]));
        }
    }
    g
}

/// Most positions one request trains on, and most factor rows a stage of an update may carry
/// (validating costs `O(rows²)` per matrix).
pub const MAX_POSITIONS: usize = 256;

/// Most embedding-lookup rows an update may carry (requests folded together).
pub const MAX_LOOKUPS: usize = 16 * MAX_POSITIONS;

/// Most bytes a postcard length or small number takes (a varint of a `u32`).
const VARINT: u64 = 5;

/// The most bytes an update's wire form ([`Update::encode`]) takes on a mesh of `cfg` that
/// learns with `learning`: every stage's factors at the most rows the mesh's rules let it carry
/// (the adapters' rank with Adam, the mesh's rank or [`MAX_POSITIONS`] with SGD), the most
/// embedding lookups, the norm gains and every length prefix. Holders refuse a larger payload
/// before they read it.
pub fn max_update_bytes(cfg: &LlamaConfig, learning: &LearningConfig) -> u64 {
    let b: u64 = match learning.precision() {
        Precision::F16 => 2,
        Precision::F32 => 4,
    };
    let rows = |inp: usize| -> u64 {
        match learning.optimizer {
            Optimizer::AdamAdapters => crate::coded::adapter_rank(inp) as u64,
            Optimizer::Sgd if learning.rank > 0 => u64::from(learning.rank),
            Optimizer::Sgd => MAX_POSITIONS as u64,
        }
    };
    let stages: u64 = Stage::all(cfg)
        .iter()
        .map(|stage| {
            let shapes = stage.shapes(cfg);
            let inp = shapes.first().map_or(0, |s| s.1);
            let r = rows(inp);
            let outs: u64 = shapes
                .iter()
                .map(|&(out, _)| VARINT + r * out as u64 * b)
                .sum();
            // x: a tag, then an adapter step's projection by its width, or the values.
            let x = 1 + match learning.optimizer {
                Optimizer::AdamAdapters => VARINT,
                Optimizer::Sgd => VARINT + r * inp as u64 * b,
            };
            // The stage (a tag and its layer), the rows, x and the list of dy.
            1 + VARINT + VARINT + x + VARINT + outs
        })
        .sum();
    let lookups = match learning.optimizer {
        Optimizer::AdamAdapters => 0,
        Optimizer::Sgd => MAX_LOOKUPS as u64,
    };
    let embed = VARINT + lookups * VARINT + VARINT + lookups * cfg.hidden as u64 * b;
    let norms = postcard::to_allocvec(&LeaderWeights::zeros(cfg)).map_or(0, |v| v.len() as u64);
    // The format, the precision, the step and the positions, then the stages' count.
    1 + 1 + 4 + VARINT + VARINT + stages + embed + norms
}

/// Whether a stage's factors fit the model.
fn fits(f: &StageFactors, cfg: &LlamaConfig) -> bool {
    let shapes = f.stage.shapes(cfg);
    let rows = f.rows as usize;
    let inp = shapes.first().map_or(0, |s| s.1);
    rows <= MAX_POSITIONS
        && f.x.len() == rows * inp
        && f.dy.len() == shapes.len()
        && f.dy
            .iter()
            .zip(&shapes)
            .all(|(dy, &(out, _))| dy.len() == rows * out)
}

/// Replaces `x`'s `t` rows with their projections on the adapters' subspace, `X·Vᵀ·V / rank`
/// ([`Update::projected`]).
pub(crate) fn project_rows(x: &mut [f32], t: usize) {
    if t == 0 {
        return;
    }
    let proj = Projection::of(x.len() / t);
    let z = proj.down_update(x, t);
    x.fill(0.0);
    proj.up_add(&z, x);
}

/// What a request teaches the mesh: the last `window` positions of the text its caller sent
/// (its prompt), never the mesh's own completion. Training on its own greedy answers teaches a
/// model nothing it did not know and narrows it: measured, repeated chats raised the canary
/// loss until the gate refused every update (docs/coding.md, "Learning that learns").
pub fn taught(prompt: &[u32], window: usize) -> &[u32] {
    &prompt[prompt.len().saturating_sub(window)..]
}

/// How many of a request's last positions a leader trains on: up to the context and
/// [`MAX_POSITIONS`], and with exact factors (rank 0) as many as keep an update well inside
/// one message.
pub fn training_window(learning: &LearningConfig, model: &LlamaConfig) -> usize {
    let mut max = model.max_seq.min(MAX_POSITIONS);
    if learning.rank == 0 {
        // Exact f32 factors carry ~1.2 MB per position for SmolLM2.
        let fit = crate::protocol::MAX_MESSAGE_BYTES / 4 * 3 / bytes_per_position(model).max(1);
        max = max.min(fit.max(2));
    }
    max
}

/// Bytes an update carries per position of its sequence (f32 factors of every stage and the
/// embedding lookup), for sizing what to train on.
pub fn bytes_per_position(cfg: &LlamaConfig) -> usize {
    let floats: usize = Stage::all(cfg)
        .iter()
        .map(|s| {
            let shapes = s.shapes(cfg);
            shapes.first().map_or(0, |&(_, inp)| inp)
                + shapes.iter().map(|&(o, _)| o).sum::<usize>()
        })
        .sum::<usize>()
        + cfg.hidden;
    4 * floats + 4
}

/// Largest `step · ‖gradient‖` a node accepts from a peer, whatever its mesh's settings (an
/// Adam step at the default rate moves SmolLM2's weights by up to ~13 in Frobenius norm; the
/// mesh's own, tighter bound is [`Update::validate_for`]'s).
pub const MAX_STEP_NORM: f64 = 100.0;

impl Update {
    /// The SGD step of a gradient: learning rate `lr`, gradient clipped to norm `clip`.
    pub fn from_gradients(g: Gradients, lr: f32, clip: f32) -> Self {
        let mut u = Self {
            step: lr,
            t: g.t as u32,
            stages: g
                .stages
                .into_iter()
                .map(|StageGrad { stage, x, dy }| StageFactors {
                    stage,
                    rows: g.t as u32,
                    x,
                    dy,
                })
                .collect(),
            embed_tokens: g.tokens,
            embed_dx: g.embed_dx,
            norms: g.norms,
            precision: Precision::F32,
        };
        let norm = u.gradient_norm();
        if norm > clip as f64 && norm > 0.0 {
            u.step = (lr as f64 * clip as f64 / norm) as f32;
        }
        u
    }

    /// Frobenius norm of the whole gradient (tied embedding parts counted apart: a bound).
    pub fn gradient_norm(&self) -> f64 {
        let mut sq: f64 = self
            .stages
            .iter()
            .map(|f| factors_norm_sq(&f.x, &f.dy, f.rows as usize))
            .sum();
        sq += self
            .embed_dx
            .iter()
            .map(|&v| (v as f64).powi(2))
            .sum::<f64>();
        sq += self
            .norms
            .values()
            .map(|&v| (v as f64).powi(2))
            .sum::<f64>();
        sq.sqrt()
    }

    /// An id for the update: a hash of its contents.
    pub fn id(&self) -> u64 {
        Self::id_of(&self.encode())
    }

    /// The update's wire form (postcard; canonical, so its hash is the id).
    pub fn encode(&self) -> Vec<u8> {
        wire::encode(self)
    }

    /// Parses an update from untrusted bytes (shapes are checked by [`Update::validate`]).
    pub fn decode(bytes: &[u8]) -> Result<Self, UpdateError> {
        wire::decode(bytes)
    }

    /// The id of an update from its wire form, without decoding or re-encoding it.
    pub fn id_of(encoded: &[u8]) -> u64 {
        let h = blake3::hash(encoded);
        let mut id = [0u8; 8];
        id.copy_from_slice(&h.as_bytes()[..8]);
        u64::from_le_bytes(id)
    }

    /// Bytes its factors and the lookup's gradient take in memory (the norms' few are left out).
    pub fn held_bytes(&self) -> usize {
        let factors: usize = self
            .stages
            .iter()
            .map(|f| f.x.len() + f.dy.iter().map(Vec::len).sum::<usize>())
            .sum();
        4 * (factors + self.embed_dx.len() + self.embed_tokens.len())
    }

    /// Checks shapes, finiteness and the step bound before anything is applied.
    pub fn validate(&self, cfg: &LlamaConfig) -> Result<(), UpdateError> {
        self.validated_norm(cfg).map(|_| ())
    }

    /// [`Update::validate`], giving the gradient's norm it measured.
    fn validated_norm(&self, cfg: &LlamaConfig) -> Result<f64, UpdateError> {
        let shape = |m: String| Err(UpdateError::Shape(m));
        let expected = Stage::all(cfg);
        if self.stages.len() != expected.len()
            || self
                .stages
                .iter()
                .zip(&expected)
                .any(|(f, e)| f.stage != *e)
        {
            return shape("the stages are not the model's".into());
        }
        if let Some(f) = self.stages.iter().find(|f| !fits(f, cfg)) {
            return shape(format!("{:?} has the wrong factor shapes", f.stage));
        }
        let lookups = self.embed_tokens.len();
        if lookups > MAX_LOOKUPS
            || self.embed_dx.len() != lookups * cfg.hidden
            || self
                .embed_tokens
                .iter()
                .any(|&tok| tok as usize >= cfg.vocab)
        {
            return shape("the embedding gradient has the wrong shape".into());
        }
        if !self.norms.fits(cfg) {
            return shape("the norm gradients have the wrong shape".into());
        }
        let finite = self.step.is_finite()
            && self.stages.iter().all(|f| {
                f.x.iter()
                    .chain(f.dy.iter().flatten())
                    .all(|v| v.is_finite())
            })
            && self.embed_dx.iter().all(|v| v.is_finite());
        if !finite {
            return Err(UpdateError::NotFinite);
        }
        let norm = self.gradient_norm();
        if !norm.is_finite() {
            return Err(UpdateError::NotFinite);
        }
        if self.step < 0.0 || self.step as f64 * norm > MAX_STEP_NORM {
            return Err(UpdateError::TooLarge {
                step: self.step,
                norm,
                bound: MAX_STEP_NORM,
            });
        }
        Ok(norm)
    }

    /// [`Update::validate`], and the step within the mesh's settings: learning on, the step at
    /// most the learning rate, and with SGD the step's norm within
    /// [`LearningConfig::step_norm_bound`], with Adam an adapter step that moves no entry
    /// further than the rate allows on shards of `format` ([`check_adapter_step`]); the factors
    /// no finer than the mesh's precision.
    pub fn validate_for(
        &self,
        cfg: &LlamaConfig,
        learning: &LearningConfig,
        format: ShardFormat,
    ) -> Result<(), UpdateError> {
        let norm = self.validated_norm(cfg)?;
        if !learning.enabled {
            return Err(UpdateError::Settings("this mesh does not learn".into()));
        }
        let slack = 1.0 + 1e-3;
        if self.step as f64 > learning.lr as f64 * slack {
            return Err(UpdateError::Settings(format!(
                "step {} exceeds the learning rate {}",
                self.step, learning.lr
            )));
        }
        match learning.optimizer {
            Optimizer::Sgd => {
                let bound = learning.step_norm_bound();
                if self.step as f64 * norm > bound * slack {
                    return Err(UpdateError::Settings(format!(
                        "step {} × gradient norm {norm:.4} exceeds the mesh's bound {bound:.3e}",
                        self.step
                    )));
                }
            }
            Optimizer::AdamAdapters => {
                check_adapter_step(self, format, learning.lr, learning.adapter_reach())
                    .map_err(UpdateError::Settings)?;
            }
        }
        if learning.precision() != self.precision {
            return Err(UpdateError::Settings(format!(
                "the mesh sends {:?} factors, this update is {:?}",
                learning.precision(),
                self.precision
            )));
        }
        if learning.rank > 0
            && let Some(f) = self.stages.iter().find(|f| f.rows > learning.rank)
        {
            return Err(UpdateError::Settings(format!(
                "{:?} carries {} rows, more than the mesh's rank {}",
                f.stage, f.rows, learning.rank
            )));
        }
        Ok(())
    }

    /// The factors that update a coded matrix of the model, tied embedding included:
    /// for the embedding, the LM head's `(dlogits, h)` and the lookup's `(onehot, dx)`.
    fn embedding_rows(&self) -> impl Iterator<Item = (u32, &[f32])> {
        let d = self.embed_dx.len() / self.embed_tokens.len().max(1);
        self.embed_tokens
            .iter()
            .copied()
            .zip(self.embed_dx.chunks_exact(d.max(1)))
    }

    /// The same step without the factors of stages it does not move (every output factor
    /// zero): those stages carry no rows, so a trainer that moves only some adapters sends only
    /// their bytes, and every row takes the same step.
    pub fn trimmed(mut self) -> Self {
        for f in &mut self.stages {
            if f.rows > 0 && f.dy.iter().flatten().all(|&d| d == 0.0) {
                f.rows = 0;
                f.x.clear();
                f.dy.iter_mut().for_each(Vec::clear);
            }
        }
        self
    }

    /// The step compact shards take (docs/coding.md, "Learning on compact shards"): every input
    /// factor `X` replaced by `X·Vᵀ·V / rank`, which lies in the adapters' subspace, so that
    /// [`Self::apply_to_weights`] and the update probe see what their adapters learn.
    pub fn projected(mut self) -> Self {
        for f in &mut self.stages {
            project_rows(&mut f.x, f.rows as usize);
        }
        project_rows(&mut self.embed_dx, self.embed_tokens.len());
        self
    }

    /// The step shards in `format` take: [`Self::projected`] for compact shards, which learn
    /// in adapters; the step itself for f32 ones.
    pub fn taken_by(self, format: ShardFormat) -> Self {
        match Self::projects(format) {
            true => self.projected(),
            false => self,
        }
    }

    /// Whether shards in `format` take an update projected ([`Self::taken_by`]).
    pub fn projects(format: ShardFormat) -> bool {
        match format {
            ShardFormat::Q8 | ShardFormat::Q4 => true,
            ShardFormat::F32 | ShardFormat::F16 => false,
        }
    }

    /// Applies the step to uncoded weights (the reference every coded node must match).
    pub fn apply_to_weights(&self, w: &mut ModelWeights) -> Result<(), UpdateError> {
        self.validate(&w.cfg)?;
        for StageFactors {
            stage,
            rows,
            x,
            dy: dys,
        } in &self.stages
        {
            let t = *rows as usize;
            let mats: Vec<&mut crate::model::Matrix> = match stage.layer() {
                Some(l) => {
                    let b = &mut w.layers[l];
                    let all = [
                        &mut b.q,
                        &mut b.k,
                        &mut b.v,
                        &mut b.o,
                        &mut b.gate,
                        &mut b.up,
                        &mut b.down,
                    ];
                    let wanted = stage.block_matrices();
                    all.into_iter()
                        .enumerate()
                        .filter(|(i, _)| wanted.contains(i))
                        .map(|(_, m)| m)
                        .collect()
                }
                None => vec![w.lm_head.as_mut().unwrap_or(&mut w.embed)],
            };
            // Each value moves by one sum over the factors' rows, computed in f64 and rounded
            // once, as a shard's values do (`apply_factor`).
            let step = f64::from(self.step);
            for (m, dy) in mats.into_iter().zip(dys) {
                let mut delta = vec![0.0f64; m.cols];
                for r in 0..m.rows {
                    delta.iter_mut().for_each(|d| *d = 0.0);
                    for tok in 0..t {
                        let a = f64::from(dy[tok * m.rows + r]);
                        if a != 0.0 {
                            let xr = &x[tok * m.cols..(tok + 1) * m.cols];
                            delta
                                .iter_mut()
                                .zip(xr)
                                .for_each(|(d, &xv)| *d += a * f64::from(xv));
                        }
                    }
                    for (v, d) in m.data[r * m.cols..(r + 1) * m.cols].iter_mut().zip(&delta) {
                        *v = (f64::from(*v) - step * d) as f32;
                    }
                }
            }
        }
        let d = w.cfg.hidden;
        for (tok, dx) in self.embedding_rows() {
            let row = &mut w.embed.data[tok as usize * d..(tok as usize + 1) * d];
            row.iter_mut()
                .zip(dx)
                .for_each(|(v, &g)| *v -= self.step * g);
        }
        let n = &self.norms;
        for (l, layer) in w.layers.iter_mut().enumerate() {
            sub(&mut layer.attn_norm, &n.attn_norm[l], self.step);
            sub(&mut layer.ffn_norm, &n.ffn_norm[l], self.step);
            for (v, d) in [
                (&mut layer.qkv_bias, n.qkv_bias.get(l)),
                (&mut layer.q_norm, n.q_norm.get(l)),
                (&mut layer.k_norm, n.k_norm.get(l)),
            ] {
                if let Some(d) = d {
                    sub(v, d, self.step);
                }
            }
        }
        sub(&mut w.final_norm, &n.final_norm, self.step);
        Ok(())
    }

    /// Applies the step to the leader's replicated norm gains.
    pub fn apply_to_norms(&self, n: &mut LeaderWeights) {
        for (g, d) in n.vectors_mut().zip(self.norms.vectors()) {
            sub(g, d, self.step);
        }
    }

    /// Applies the step to one node's shards: `δS_i = (Σ_j G[i,j]·dY_j)ᵀ·X` per matrix.
    pub fn apply_to_shards(&self, s: &mut ShardSet) -> Result<(), UpdateError> {
        self.validate(&s.cfg)?;
        let g = s.generator.clone();
        let coeffs = g.coeffs(s.node).to_vec();
        let (m, km) = (g.sub_blocks(), g.k() * g.sub_blocks());
        for f in &self.stages {
            let (stage, x, t) = (f.stage, &f.x, f.rows as usize);
            let idx = stage.block_matrices();
            for (i, dy) in f.dy.iter().enumerate() {
                let shard = match stage.layer() {
                    Some(l) => &mut s.blocks[l][idx[i]],
                    None => s.lm_head.as_mut().unwrap_or(&mut s.embed),
                };
                apply_factor(shard, &coeffs, m, km, OutGrad::Dense(dy), x, t, self.step)?;
            }
        }
        // The embedding lookup: dY is one-hot rows, so only the tokens' blocks move.
        let t = self.embed_tokens.len();
        if t == 0 {
            return Ok(());
        }
        apply_factor(
            &mut s.embed,
            &coeffs,
            m,
            km,
            OutGrad::OneHot(&self.embed_tokens),
            &self.embed_dx,
            t,
            self.step,
        )?;
        Ok(())
    }
}

fn sub(v: &mut [f32], d: &[f32], step: f32) {
    v.iter_mut().zip(d).for_each(|(a, &b)| *a -= step * b);
}

/// A factor's output gradients `dY`, `t` rows: dense, or one-hot (the embedding's: each row
/// is its position's token).
#[derive(Clone, Copy)]
enum OutGrad<'a> {
    Dense(&'a [f32]),
    OneHot(&'a [u32]),
}

impl OutGrad<'_> {
    /// Whether it holds `t` rows of `out` values.
    fn fits(&self, t: usize, out: usize) -> bool {
        match *self {
            OutGrad::Dense(dy) => dy.len() == t * out,
            OutGrad::OneHot(tokens) => {
                tokens.len() == t && tokens.iter().all(|&x| (x as usize) < out)
            }
        }
    }
}

/// Rows of a sub-block whose coded output gradients are formed at once: `t × ROW_BLOCK` values
/// (a whole sub-block's would be `t × vocab / k` for the LM head: 0.5 GB at 1B and 1024 rows).
const ROW_BLOCK: usize = 64;

/// `S_s −= step · (Σ_j c[s][j]·dY_j)ᵀ·X` for every sub-block `s` of one shard: in its values
/// for f32 shards, in its adapter for compact ones (with `X·Vᵀ / rank` for `X`).
#[allow(clippy::too_many_arguments)]
fn apply_factor(
    shard: &mut Shard,
    coeffs: &[f64],
    m: usize,
    km: usize,
    dy: OutGrad<'_>,
    x: &[f32],
    t: usize,
    step: f32,
) -> Result<(), CodedError> {
    let (out, cols) = (shard.out, shard.cols);
    if !dy.fits(t, out) || x.len() != t * cols {
        return Err(CodedError::BadRequest(
            "update factors do not fit the shard".into(),
        ));
    }
    if t == 0 {
        // A stage the update does not move ([`Update::trimmed`]): an adapter that never moved
        // stays empty, neither stored nor added to a product.
        return Ok(());
    }
    let rows = Rows {
        out,
        l: shard.block_len,
        m,
        km,
    };
    match &mut shard.values {
        ShardValues::F32(values) => {
            let width = (cols, Layout::Rows);
            apply_coded(
                values,
                &mut shard.carry,
                width,
                rows,
                coeffs,
                dy,
                x,
                t,
                step,
            );
        }
        ShardValues::Q8(_) | ShardValues::Q4(_) => {
            let proj = Projection::of(cols);
            let z = proj.down_update(x, t);
            if shard.adapter.is_empty() {
                shard.adapter.a = vec![0.0; shard.adapter_len()];
            }
            let a = &mut shard.adapter;
            // An adapter's sub-block is stored in tiles of rows (`Adapter::a`).
            let width = (proj.rank(), Layout::Tiles);
            apply_coded(&mut a.a, &mut a.carry, width, rows, coeffs, dy, &z, t, step);
        }
        ShardValues::F16(_) => {
            return Err(CodedError::BadRequest(
                "f16 shards do not learn (f32 and compact shards do)".into(),
            ));
        }
    }
    Ok(())
}

/// How a sub-block's `l × width` values lie: row after row, or an adapter's tiles of rows
/// ([`crate::coded::tiled_at`]).
#[derive(Clone, Copy)]
enum Layout {
    Rows,
    Tiles,
}

/// The row layout of a coded matrix: `out` rows uncoded, `m` sub-blocks of `l` rows, each the
/// combination of `km` uncoded sub-blocks.
#[derive(Clone, Copy)]
struct Rows {
    out: usize,
    l: usize,
    m: usize,
    km: usize,
}

/// `V_s −= step · (Σ_j c[s][j]·dY_j)ᵀ·X` on coded values `V` of `width` columns. Each value
/// changes by one sum over the factors' rows, computed in f64 and added with its carry
/// (compensated summation), so a value is within one rounding of the exact sum of every update
/// it took, however many: the rows of the code stay one codeword.
#[allow(clippy::too_many_arguments)]
fn apply_coded(
    values: &mut [f32],
    carry: &mut Vec<f32>,
    (width, layout): (usize, Layout),
    Rows { out, l, m, km }: Rows,
    coeffs: &[f64],
    dy: OutGrad<'_>,
    x: &[f32],
    t: usize,
    step: f32,
) {
    if carry.len() != values.len() {
        *carry = vec![0.0; values.len()];
    }
    let step = f64::from(step);
    // The coded output gradient of each position for a block of a sub-block's rows:
    // `coded[tok·rows + r]`.
    let mut coded = vec![0.0f64; t * ROW_BLOCK.min(l)];
    let mut delta = vec![0.0f64; width];
    for s in 0..m {
        for first_row in (0..l).step_by(ROW_BLOCK) {
            let rows = ROW_BLOCK.min(l - first_row);
            let coded = &mut coded[..t * rows];
            coded.iter_mut().for_each(|c| *c = 0.0);
            for (tok, row) in coded.chunks_exact_mut(rows).enumerate() {
                for j in 0..km {
                    let c = coeffs[s * km + j];
                    let first = j * l + first_row;
                    match dy {
                        OutGrad::Dense(dy) => {
                            for (r, acc) in row.iter_mut().enumerate() {
                                if first + r < out {
                                    *acc += c * f64::from(dy[tok * out + first + r]);
                                }
                            }
                        }
                        OutGrad::OneHot(tokens) => {
                            let at = tokens[tok] as usize;
                            if (first..first + rows).contains(&at) && at < out {
                                row[at - first] += c;
                            }
                        }
                    }
                }
            }
            for r in 0..rows {
                delta.iter_mut().for_each(|d| *d = 0.0);
                let mut touched = false;
                for tok in 0..t {
                    let a = coded[tok * rows + r];
                    if a != 0.0 {
                        touched = true;
                        let xr = &x[tok * width..(tok + 1) * width];
                        delta
                            .iter_mut()
                            .zip(xr)
                            .for_each(|(d, &xv)| *d += a * f64::from(xv));
                    }
                }
                if !touched {
                    continue;
                }
                let r = first_row + r;
                for (col, d) in delta.iter().enumerate() {
                    let at = match layout {
                        Layout::Rows => (s * l + r) * width + col,
                        Layout::Tiles => s * l * width + crate::coded::tiled_at(l, width, r, col),
                    };
                    let (v, c) = (&mut values[at], &mut carry[at]);
                    let exact = f64::from(*v) + f64::from(*c) - step * d;
                    *v = exact as f32;
                    *c = (exact - f64::from(*v)) as f32;
                }
            }
        }
    }
}

/// Every factor and norm gradient times `c` (the output factors carry it).
pub(crate) fn scale(u: &mut Update, c: f32) {
    for f in &mut u.stages {
        f.dy.iter_mut().flatten().for_each(|v| *v *= c);
    }
    u.embed_dx.iter_mut().for_each(|v| *v *= c);
    u.norms.vectors_mut().flatten().for_each(|v| *v *= c);
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};

    use super::*;

    /// `Σ_dy ‖dYᵀ·X‖_F²`, forming each product.
    fn formed(x: &[f32], dys: &[Vec<f32>], t: usize) -> f64 {
        let inp = x.len() / t;
        dys.iter()
            .map(|dy| {
                let out = dy.len() / t;
                let mut sq = 0.0;
                for o in 0..out {
                    for i in 0..inp {
                        let v: f64 = (0..t)
                            .map(|a| dy[a * out + o] as f64 * x[a * inp + i] as f64)
                            .sum();
                        sq += v * v;
                    }
                }
                sq
            })
            .sum()
    }

    #[test]
    fn the_factors_norm_is_the_formed_products_norm() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let mut values =
            |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect() };
        // Widths with and without a tail beyond the eight-wide sums; one position and many.
        for (t, inp, outs) in [
            (1, 5, vec![3]),
            (7, 19, vec![8, 13]),
            (33, 64, vec![17, 9, 40]),
        ] {
            let x = values(t * inp);
            let dys: Vec<Vec<f32>> = outs.iter().map(|&o| values(t * o)).collect();
            let (got, want) = (factors_norm_sq(&x, &dys, t), formed(&x, &dys, t));
            assert!(
                (got - want).abs() <= 1e-12 * want,
                "t {t}: {got} against {want}"
            );
        }
        assert_eq!(
            factors_norm_sq(&[1.0; 6], &[vec![1.0; 3]], 4),
            f64::INFINITY
        );
        assert_eq!(factors_norm_sq(&[], &[vec![]], 0), 0.0);
    }
}
