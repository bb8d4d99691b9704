//! The weight code: generator matrices, shard encoding, decoding from any k answers, and the
//! choice of a well-conditioned group.
//!
//! A weight matrix `W` (`out × in`) is padded to `k·m` equal half-blocks of `L` rows. Node `i`
//! stores `m·L` rows: row `s·L + r` is `Σ_j G[i·m+s, j] · W[j·L + r]`. With the default complex
//! Cauchy code, `m = 2`: each complex generator entry `c` becomes the real rotation block
//! `[[Re c, −Im c], [Im c, Re c]]`, so storage and flops per node stay `1/k` of the matrix.

mod integer;

pub use integer::{INTEGER_MAX_K, STORED_MAX};

use nalgebra::DMatrix;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

/// Most nodes a generator may have.
pub const MAX_NODES: usize = 256;

/// Largest condition number accepted for a decoding group (beyond it f32 results are noise).
pub const MAX_CONDITION: f64 = 1e7;

/// Largest condition number of any k rows of a grown code: with f32 shard products the decode
/// error is about `1e-7 · κ`, so every group of live rows stays within 1e-4 (DESIGN.md).
pub const GROWTH_MAX_CONDITION: f64 = 900.0;

/// Most rows a grown code may reach, whatever its conditioning.
pub const GROWTH_MAX_ROWS: usize = 64;

/// Most k-subsets [`Generator::growing`] checks before it stops adding rows.
const GROWTH_SUBSET_BUDGET: u64 = 400_000;

/// Subsets searched exhaustively by [`select_nodes`] before it switches to greedy selection.
const EXHAUSTIVE_LIMIT: u64 = 20_000;

/// Errors of the code.
#[derive(Debug, thiserror::Error)]
pub enum CodeError {
    /// `k` and `n` out of range.
    #[error("invalid code parameters k = {k}, n = {n}: need 1 ≤ k ≤ n ≤ {MAX_NODES}")]
    Params {
        /// Data blocks.
        k: usize,
        /// Nodes.
        n: usize,
    },
    /// More genesis rows, or a larger k, than the integer code of compact shards has.
    #[error(
        "compact (q8) shards use the integer code, which has {rows} rows for k = {k} (and \
         none past k = {INTEGER_MAX_K}); {n} were asked for: use fewer nodes or f32 shards"
    )]
    IntegerRows {
        /// Data blocks.
        k: usize,
        /// Rows asked for.
        n: usize,
        /// Rows the code has for this k.
        rows: usize,
    },
    /// Parity rows asked of 4-bit (q4) shards, which have data rows only so far.
    #[error(
        "4-bit (q4) shards keep data rows only so far (issue 81): {n} rows for k = {k}; use \
         n = k, or q8 shards for parity rows"
    )]
    FourBitParity {
        /// Data blocks.
        k: usize,
        /// Rows asked for.
        n: usize,
    },
    /// A node index outside the generator.
    #[error("node {node} does not exist in a code of n = {n}")]
    NoSuchNode {
        /// The index.
        node: usize,
        /// Nodes in the code.
        n: usize,
    },
    /// A group that is not k distinct nodes.
    #[error("a decoding group needs {k} distinct nodes, got {got:?}")]
    Group {
        /// Required size.
        k: usize,
        /// What was given.
        got: Vec<usize>,
    },
    /// Too few nodes to choose a group from.
    #[error("only {available} nodes available, k = {k} needed")]
    TooFew {
        /// Available.
        available: usize,
        /// Required.
        k: usize,
    },
    /// The group's generator submatrix is (numerically) singular.
    #[error("group {nodes:?} is ill-conditioned (κ = {condition:.3e})")]
    IllConditioned {
        /// The group.
        nodes: Vec<usize>,
        /// Its condition number.
        condition: f64,
    },
    /// Slices of the wrong length.
    #[error("{what}: expected {expected} values, got {got}")]
    Length {
        /// Which argument.
        what: &'static str,
        /// Expected length.
        expected: usize,
        /// Actual length.
        got: usize,
    },
}

/// How a generator is built.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Construction {
    /// Complex Cauchy `1/(a_i − b_j)`: `a_i` the n-th roots of unity, `b_j` the k-th roots
    /// turned by half the finest grid step, in real rotation blocks. The default.
    ComplexCauchy,
    /// Real Cauchy `1/(a_i − b_j)` with `a_i = i + ½`, `b_j = −j − ½` (ill-conditioned fast).
    RealCauchy,
    /// Gaussian random entries from a seed.
    Gaussian {
        /// The seed.
        seed: u64,
    },
    /// The uncoded identity, n = k = 1.
    Identity,
    /// Complex Cauchy that can grow: rows `0..seeded` are [`Construction::ComplexCauchy`]'s
    /// for `seeded` rows, and each later row's point fills the widest gap left on the unit
    /// circle. The generator has room for every row the mesh may add ([`max_rows`]); the
    /// first `seeded` are encoded at genesis, the rest on demand.
    GrowingCauchy {
        /// Rows encoded at genesis.
        seeded: u32,
    },
    /// The integer code of compact shards: the k unit vectors, then parity rows of small
    /// integers, every k of them regular. Rows `0..seeded` are encoded at genesis, the rest on
    /// demand (docs/coding.md, "Compact shards").
    Integer {
        /// Rows encoded at genesis.
        seeded: u32,
    },
}

/// A generator matrix `G` of `n·m × k·m` real coefficients.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Generator {
    n: usize,
    k: usize,
    m: usize,
    construction: Construction,
    coeffs: Vec<f64>,
}

/// Greatest common divisor.
fn gcd(a: u128, b: u128) -> u128 {
    if b == 0 { a } else { gcd(b, a % b) }
}

/// The poles `b_j` of the complex Cauchy code for `seeded` rows, in turns: the k-th roots of
/// unity turned by half the finest grid step, so no row point meets a pole.
fn poles(seeded: usize, k: usize) -> Vec<f64> {
    let lcm = seeded / gcd(seeded as u128, k as u128) as usize * k;
    (0..k)
        .map(|j| j as f64 / k as f64 + 0.5 / lcm as f64)
        .collect()
}

/// The points `a_i` (in turns) of `n` rows of the complex Cauchy code seeded with `seeded`
/// rows: the `seeded`-th roots of unity, then one point at a time in the middle of the widest
/// gap between the points and poles placed so far (the lowest such gap on a tie).
fn row_points(seeded: usize, k: usize, n: usize) -> Vec<f64> {
    let mut points: Vec<f64> = (0..seeded.min(n))
        .map(|i| i as f64 / seeded as f64)
        .collect();
    let poles = poles(seeded, k);
    while points.len() < n {
        let mut taken: Vec<f64> = points.iter().chain(&poles).copied().collect();
        taken.sort_by(f64::total_cmp);
        let mut best = (0.0f64, 0.0f64);
        for (i, &start) in taken.iter().enumerate() {
            let end = taken.get(i + 1).copied().unwrap_or(taken[0] + 1.0);
            // A gap must be wider by more than rounding to win, so ties go to the lowest start.
            if end - start > best.1 + 1e-12 {
                best = (start, end - start);
            }
        }
        points.push((best.0 + best.1 / 2.0).rem_euclid(1.0));
    }
    points
}

/// Real rotation-block coefficients `1/(e^{2πi·a} − e^{2πi·b_j})` for each row point `a`.
fn complex_cauchy(points: &[f64], poles: &[f64]) -> Vec<f64> {
    let tau = std::f64::consts::TAU;
    let w = 2 * poles.len();
    let mut real = vec![0.0; 2 * points.len() * w];
    for (i, &pa) in points.iter().enumerate() {
        let a = tau * pa;
        for (j, &pb) in poles.iter().enumerate() {
            let b = tau * pb;
            let (re, im) = (a.cos() - b.cos(), a.sin() - b.sin());
            let d = re * re + im * im;
            let (cr, ci) = (re / d, -im / d);
            real[(2 * i) * w + 2 * j] = cr;
            real[(2 * i) * w + 2 * j + 1] = -ci;
            real[(2 * i + 1) * w + 2 * j] = ci;
            real[(2 * i + 1) * w + 2 * j + 1] = cr;
        }
    }
    real
}

impl Generator {
    /// Builds a generator of `n` nodes for `k` blocks.
    pub fn new(construction: Construction, n: usize, k: usize) -> Result<Self, CodeError> {
        if k == 0 || n < k || n > MAX_NODES {
            return Err(CodeError::Params { k, n });
        }
        let (m, mut coeffs) = match construction {
            Construction::Identity => {
                if n != 1 || k != 1 {
                    return Err(CodeError::Params { k, n });
                }
                (1, vec![1.0])
            }
            Construction::RealCauchy => {
                let c = (0..n)
                    .flat_map(|i| (0..k).map(move |j| 1.0 / ((i as f64 + 0.5) + (j as f64 + 0.5))))
                    .collect();
                (1, c)
            }
            Construction::Gaussian { seed } => {
                use rand::Rng;
                let mut rng = ChaCha8Rng::seed_from_u64(seed);
                let c = (0..n * k)
                    .map(|_| {
                        // Box–Muller from two uniforms.
                        let u: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
                        let v: f64 = rng.random();
                        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
                    })
                    .collect();
                (1, c)
            }
            Construction::ComplexCauchy => (2, complex_cauchy(&row_points(n, k, n), &poles(n, k))),
            Construction::GrowingCauchy { seeded } => {
                let seeded = seeded as usize;
                if seeded < k || seeded > n {
                    return Err(CodeError::Params { k, n: seeded });
                }
                (
                    2,
                    complex_cauchy(&row_points(seeded, k, n), &poles(seeded, k)),
                )
            }
            Construction::Integer { seeded } => {
                if k > INTEGER_MAX_K {
                    return Err(CodeError::Params { k, n });
                }
                return Self::of_integer_rows(&integer::integer_rows(k), seeded, n, k);
            }
        };
        // Unit-norm rows (for the complex code each real row has the complex row's norm).
        let width = k * m;
        for row in coeffs.chunks_exact_mut(width) {
            let norm = row.iter().map(|v| v * v).sum::<f64>().sqrt();
            if norm > 0.0 {
                row.iter_mut().for_each(|v| *v /= norm);
            }
        }
        Ok(Self {
            n,
            k,
            m,
            construction,
            coeffs,
        })
    }

    /// The default sound code: complex Cauchy on the unit circle (see docs/coding.md).
    pub fn cauchy(n: usize, k: usize) -> Result<Self, CodeError> {
        Self::new(Construction::ComplexCauchy, n, k)
    }

    /// A complex Cauchy code of `seeded` genesis rows with room to grow: as many rows
    /// (up to `cap` and [`GROWTH_MAX_ROWS`]) as keep every k of them within
    /// [`GROWTH_MAX_CONDITION`]. Rows past `seeded` are encoded when the mesh adds them.
    pub fn growing(seeded: usize, k: usize, cap: Option<usize>) -> Result<Self, CodeError> {
        let most = cap
            .unwrap_or(GROWTH_MAX_ROWS)
            .clamp(seeded, GROWTH_MAX_ROWS.max(seeded));
        let construction = Construction::GrowingCauchy {
            seeded: u32::try_from(seeded).map_err(|_| CodeError::Params { k, n: seeded })?,
        };
        let full = Self::new(construction, most, k)?;
        let mut rows = seeded;
        let mut checked = 0u64;
        while rows < most {
            // Every k-subset of rows + 1 rows that holds the new row.
            let cost = binomial(rows, k - 1);
            checked = checked.saturating_add(cost);
            if checked > GROWTH_SUBSET_BUDGET {
                break;
            }
            let mut worst = 0.0f64;
            for mut group in subsets(rows, k - 1) {
                group.push(rows);
                worst = worst.max(full.condition_number(&group)?);
            }
            if worst > GROWTH_MAX_CONDITION {
                break;
            }
            rows += 1;
        }
        Self::new(construction, rows, k)
    }

    /// The integer code of compact shards with `seeded` genesis rows, holding every row the
    /// mesh may add, up to `cap` (docs/coding.md, "Compact shards"). Refused for
    /// k > [`INTEGER_MAX_K`] and for more genesis rows than the code has.
    pub fn integer(seeded: usize, k: usize, cap: Option<usize>) -> Result<Self, CodeError> {
        let have = Self::integer_capacity(k);
        if k == 0 || seeded > have {
            return Err(CodeError::IntegerRows {
                k,
                n: seeded,
                rows: have,
            });
        }
        let rows = integer::integer_rows(k);
        let n = cap
            .unwrap_or(rows.len())
            .clamp(seeded, rows.len().max(seeded));
        let seeded = u32::try_from(seeded).map_err(|_| CodeError::Params { k, n: seeded })?;
        Self::of_integer_rows(&rows, seeded, n, k)
    }

    /// Rows the integer code of compact shards has for `k` (none past [`INTEGER_MAX_K`]): the
    /// most nodes a compact mesh can encode.
    pub fn integer_capacity(k: usize) -> usize {
        if k == 0 || k > INTEGER_MAX_K {
            return 0;
        }
        integer::integer_rows(k).len()
    }

    /// The first `n` of the integer code's `rows`, `seeded` of them encoded at genesis; kept
    /// as integers (normalising them would lose the integers).
    fn of_integer_rows(
        rows: &[Vec<i32>],
        seeded: u32,
        n: usize,
        k: usize,
    ) -> Result<Self, CodeError> {
        let genesis = seeded as usize;
        if genesis < k || genesis > n || n > rows.len() {
            return Err(CodeError::Params { k, n });
        }
        Ok(Self {
            n,
            k,
            m: 1,
            construction: Construction::Integer { seeded },
            coeffs: rows[..n].iter().flatten().map(|&c| f64::from(c)).collect(),
        })
    }

    /// For an integer code, the largest magnitude a quantised weight may take
    /// ([`STORED_MAX`]: an i8; a parity row stores its wider sums in an i16); `None` for codes
    /// with real coefficients.
    pub fn levels(&self) -> Option<i32> {
        match self.construction {
            Construction::Integer { .. } | Construction::Identity => Some(STORED_MAX),
            _ => None,
        }
    }

    /// Rows encoded at genesis: all `n` but for a growing code, whose later rows the mesh
    /// adds on demand.
    pub fn genesis_rows(&self) -> usize {
        match self.construction {
            Construction::GrowingCauchy { seeded } | Construction::Integer { seeded } => {
                seeded as usize
            }
            _ => self.n,
        }
    }

    /// The uncoded model: one node holding `W` itself.
    pub fn uncoded() -> Self {
        Self {
            n: 1,
            k: 1,
            m: 1,
            construction: Construction::Identity,
            coeffs: vec![1.0],
        }
    }

    /// Number of nodes.
    pub fn n(&self) -> usize {
        self.n
    }

    /// Number of blocks needed to decode.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Sub-blocks per node (`m`).
    pub fn sub_blocks(&self) -> usize {
        self.m
    }

    /// How it was built.
    pub fn construction(&self) -> Construction {
        self.construction
    }

    /// The `m × k·m` coefficients of one node, row-major.
    pub fn coeffs(&self, node: usize) -> &[f64] {
        let w = self.k * self.m * self.m;
        &self.coeffs[node * w..(node + 1) * w]
    }

    fn check_node(&self, node: usize) -> Result<(), CodeError> {
        if node < self.n {
            Ok(())
        } else {
            Err(CodeError::NoSuchNode { node, n: self.n })
        }
    }

    /// Rows of one half-block (`L`) for a matrix of `out` rows.
    pub fn block_len(&self, out: usize) -> usize {
        out.div_ceil(self.k * self.m)
    }

    /// `out` padded to a multiple of `k·m`.
    pub fn padded_rows(&self, out: usize) -> usize {
        self.block_len(out) * self.k * self.m
    }

    /// Rows of one node's shard (`m·L`).
    pub fn shard_rows(&self, out: usize) -> usize {
        self.block_len(out) * self.m
    }

    /// Node `node`'s shard of `w` (`out × inp`), accumulated in f64.
    pub fn encode_shard(
        &self,
        node: usize,
        w: &[f32],
        out: usize,
        inp: usize,
    ) -> Result<Vec<f32>, CodeError> {
        self.check_node(node)?;
        let expected = out.saturating_mul(inp);
        if w.len() != expected {
            return Err(CodeError::Length {
                what: "weight matrix",
                expected,
                got: w.len(),
            });
        }
        let l = self.block_len(out);
        let km = self.k * self.m;
        let coeffs = self.coeffs(node);
        let mut shard = vec![0.0f32; self.m * l * inp];
        let mut acc = vec![0.0f64; inp];
        for s in 0..self.m {
            let g = &coeffs[s * km..(s + 1) * km];
            for r in 0..l {
                acc.iter_mut().for_each(|a| *a = 0.0);
                for (j, &c) in g.iter().enumerate() {
                    let row = j * l + r;
                    if row >= out || c == 0.0 {
                        continue;
                    }
                    for (a, &v) in acc.iter_mut().zip(&w[row * inp..(row + 1) * inp]) {
                        *a += c * v as f64;
                    }
                }
                let dst = &mut shard[(s * l + r) * inp..(s * l + r + 1) * inp];
                for (d, &a) in dst.iter_mut().zip(&acc) {
                    *d = a as f32;
                }
            }
        }
        Ok(shard)
    }

    /// The `k·m × k·m` submatrix of a group of nodes (any count, for conditioning checks).
    fn submatrix(&self, nodes: &[usize]) -> Result<DMatrix<f64>, CodeError> {
        let km = self.k * self.m;
        let mut data = Vec::with_capacity(nodes.len() * self.m * km);
        for &node in nodes {
            self.check_node(node)?;
            data.extend_from_slice(self.coeffs(node));
        }
        Ok(DMatrix::from_row_slice(nodes.len() * self.m, km, &data))
    }

    /// 2-norm condition number of a group's generator rows.
    pub fn condition_number(&self, nodes: &[usize]) -> Result<f64, CodeError> {
        Ok(condition(&self.submatrix(nodes)?))
    }

    /// Coefficients that build node `target`'s shard from the shards of `sources` (k nodes):
    /// `m × k·m`, row-major, column `i·m + s'` weighing sub-block `s'` of `sources[i]`.
    pub fn reencode_coeffs(&self, target: usize, sources: &[usize]) -> Result<Vec<f64>, CodeError> {
        self.check_node(target)?;
        let decoder = Decoder::new(self, sources)?;
        let km = self.k * self.m;
        let g = self.coeffs(target);
        let mut out = vec![0.0f64; self.m * km];
        for s in 0..self.m {
            for (c, o) in out[s * km..(s + 1) * km].iter_mut().enumerate() {
                *o = (0..km)
                    .map(|j| g[s * km + j] * decoder.inverse[j * km + c])
                    .sum();
            }
        }
        Ok(out)
    }

    /// For an integer code, [`Self::reencode_coeffs`] exactly, as integers over one positive
    /// denominator: `(a, d)` with `a_j / d` the coefficient of `sources[j]` (Cramer's rule on
    /// the sources' rows); `None` for codes with real coefficients.
    pub fn reencode_integers(
        &self,
        target: usize,
        sources: &[usize],
    ) -> Result<Option<(Vec<i64>, i64)>, CodeError> {
        self.check_node(target)?;
        // Refuses a singular or malformed choice of sources as every decode does.
        Decoder::new(self, sources)?;
        if self.levels().is_none() || self.m != 1 {
            return Ok(None);
        }
        let row =
            |node: usize| -> Vec<i128> { self.coeffs(node).iter().map(|&c| c as i128).collect() };
        let rows: Vec<Vec<i128>> = sources.iter().map(|&s| row(s)).collect();
        let mut d = integer::determinant(rows.clone());
        let mut a: Vec<i128> = (0..rows.len())
            .map(|j| {
                let mut m = rows.clone();
                m[j] = row(target);
                integer::determinant(m)
            })
            .collect();
        if d < 0 {
            d = -d;
            a.iter_mut().for_each(|x| *x = -*x);
        }
        let common = a
            .iter()
            .fold(d.unsigned_abs(), |g, &x| gcd(g, x.unsigned_abs())) as i128;
        let narrow = |x: i128| {
            i64::try_from(x / common.max(1)).map_err(|_| CodeError::Params {
                k: self.k,
                n: self.n,
            })
        };
        let a = a.into_iter().map(narrow).collect::<Result<_, _>>()?;
        Ok(Some((a, narrow(d)?)))
    }

    /// A node's expected answer from decoded blocks `[j][c]` (`k·m·C`), written as `[s][c]`.
    pub fn predict_part(
        &self,
        node: usize,
        blocks: &[f32],
        out: &mut [f32],
    ) -> Result<(), CodeError> {
        self.check_node(node)?;
        let km = self.k * self.m;
        let c = out.len() / self.m;
        if out.len() != self.m * c || blocks.len() != km * c {
            return Err(CodeError::Length {
                what: "decoded blocks",
                expected: km * c,
                got: blocks.len(),
            });
        }
        let coeffs = self.coeffs(node);
        let mut acc = vec![0.0f64; c];
        for (s, dst) in out.chunks_exact_mut(c.max(1)).enumerate().take(self.m) {
            acc.iter_mut().for_each(|a| *a = 0.0);
            for (j, &g) in coeffs[s * km..(s + 1) * km].iter().enumerate() {
                for (a, &v) in acc.iter_mut().zip(&blocks[j * c..(j + 1) * c]) {
                    *a += g * v as f64;
                }
            }
            for (d, &a) in dst.iter_mut().zip(&acc) {
                *d = a as f32;
            }
        }
        Ok(())
    }
}

/// Ratio of the largest to the smallest singular value (∞ for a rank-deficient matrix).
fn condition(m: &DMatrix<f64>) -> f64 {
    let sv = m.clone().svd(false, false).singular_values;
    let max = sv.iter().copied().fold(0.0f64, f64::max);
    let min = sv.iter().copied().fold(f64::INFINITY, f64::min);
    if min > 0.0 && sv.len() == m.ncols().min(m.nrows()) && m.nrows() >= m.ncols() {
        max / min
    } else {
        f64::INFINITY
    }
}

/// Decodes the answers of one group of k nodes.
#[derive(Debug, Clone)]
pub struct Decoder {
    nodes: Vec<usize>,
    /// `k·m × k·m` inverse of the group's generator rows, row-major.
    inverse: Vec<f64>,
    km: usize,
    m: usize,
    condition: f64,
}

impl Decoder {
    /// A decoder for exactly k distinct nodes of `g`.
    pub fn new(g: &Generator, nodes: &[usize]) -> Result<Self, CodeError> {
        let mut sorted = nodes.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        if nodes.len() != g.k || sorted.len() != nodes.len() {
            return Err(CodeError::Group {
                k: g.k,
                got: nodes.to_vec(),
            });
        }
        let sub = g.submatrix(nodes)?;
        let condition = condition(&sub);
        let inverse = match (condition <= MAX_CONDITION)
            .then(|| sub.try_inverse())
            .flatten()
        {
            Some(inv) => inv,
            None => {
                return Err(CodeError::IllConditioned {
                    nodes: nodes.to_vec(),
                    condition,
                });
            }
        };
        let km = g.k * g.m;
        let inverse = (0..km)
            .flat_map(|r| (0..km).map(move |c| (r, c)))
            .map(|(r, c)| inverse[(r, c)])
            .collect();
        Ok(Self {
            nodes: nodes.to_vec(),
            inverse,
            km,
            m: g.m,
            condition,
        })
    }

    /// The group's nodes, in the order answers are expected.
    pub fn nodes(&self) -> &[usize] {
        &self.nodes
    }

    /// The `k·m × k·m` decoding coefficients, row-major: decoded block `j` is
    /// `Σ_q inverse[j][q] · answer q`, answer `q` being sub-block `q % m` of node `q / m`.
    pub fn inverse(&self) -> &[f64] {
        &self.inverse
    }

    /// Condition number of the group's generator rows.
    pub fn condition_number(&self) -> f64 {
        self.condition
    }

    /// The transpose of decoding, for backward passes: from `dy` (`[j][c]`, `k·m·c` values)
    /// the inputs `u_i = Σ_j H[j,i]·dy_j` each node multiplies by its shard's transpose, as
    /// `[s][c]` per node in `nodes()` order; then `Wᵀ·dy = Σ_i S_iᵀ·u_i`.
    pub fn transpose(&self, dy: &[f32]) -> Result<Vec<Vec<f32>>, CodeError> {
        let c = dy.len() / self.km;
        if dy.len() != self.km * c {
            return Err(CodeError::Length {
                what: "transpose input",
                expected: self.km * c,
                got: dy.len(),
            });
        }
        let mut out = vec![vec![0.0f32; self.m * c]; self.nodes.len()];
        let mut acc = vec![0.0f64; c];
        for q in 0..self.km {
            acc.iter_mut().for_each(|a| *a = 0.0);
            for j in 0..self.km {
                let h = self.inverse[j * self.km + q];
                for (a, &v) in acc.iter_mut().zip(&dy[j * c..(j + 1) * c]) {
                    *a += h * v as f64;
                }
            }
            let (idx, s) = (q / self.m, q % self.m);
            for (d, &a) in out[idx][s * c..(s + 1) * c].iter_mut().zip(&acc) {
                *d = a as f32;
            }
        }
        Ok(out)
    }

    /// Decodes `parts` (`[s][c]` per node, in `nodes()` order) into `out` (`[j][c]`).
    pub fn decode(&self, parts: &[&[f32]], out: &mut [f32]) -> Result<(), CodeError> {
        if parts.len() != self.nodes.len() {
            return Err(CodeError::Length {
                what: "answers",
                expected: self.nodes.len(),
                got: parts.len(),
            });
        }
        let c = out.len() / self.km;
        if out.len() != self.km * c {
            return Err(CodeError::Length {
                what: "decode output",
                expected: self.km * c,
                got: out.len(),
            });
        }
        if let Some(bad) = parts.iter().find(|p| p.len() != self.m * c) {
            return Err(CodeError::Length {
                what: "answer",
                expected: self.m * c,
                got: bad.len(),
            });
        }
        let part = |q: usize| {
            let (idx, s) = (q / self.m, q % self.m);
            &parts[idx][s * c..(s + 1) * c]
        };
        let mut acc = vec![0.0f64; c];
        for (j, dst) in out.chunks_exact_mut(c.max(1)).enumerate().take(self.km) {
            let coeffs = &self.inverse[j * self.km..(j + 1) * self.km];
            // A unit row of the inverse (a data row's own block): the answer as it came, which
            // is what the sum below gives, without k·m passes over it.
            let mut terms = coeffs.iter().enumerate().filter(|(_, h)| **h != 0.0);
            if let (Some((q, &1.0)), None) = (terms.next(), terms.next()) {
                dst.copy_from_slice(part(q));
                continue;
            }
            acc.iter_mut().for_each(|a| *a = 0.0);
            for (q, &h) in coeffs.iter().enumerate() {
                if h == 0.0 {
                    continue;
                }
                let src = part(q);
                for (a, &v) in acc.iter_mut().zip(src) {
                    *a += h * v as f64;
                }
            }
            for (d, &a) in dst.iter_mut().zip(&acc) {
                *d = a as f32;
            }
        }
        Ok(())
    }
}

/// A chosen decoding group.
#[derive(Debug, Clone, PartialEq)]
pub struct Selection {
    /// The k nodes.
    pub nodes: Vec<usize>,
    /// Their condition number.
    pub condition_number: f64,
}

/// Every k-subset of `0..n` in lexicographic order (none when `k > n`; one, empty, for k = 0).
pub fn subsets(n: usize, k: usize) -> Subsets {
    Subsets {
        n,
        next: (k <= n).then(|| (0..k).collect()),
    }
}

/// The iterator of [`subsets`].
#[derive(Debug, Clone)]
pub struct Subsets {
    n: usize,
    next: Option<Vec<usize>>,
}

impl Iterator for Subsets {
    type Item = Vec<usize>;

    fn next(&mut self) -> Option<Vec<usize>> {
        let current = self.next.take()?;
        let k = current.len();
        let mut idx = current.clone();
        if let Some(p) = (0..k).rev().find(|&p| idx[p] < self.n - k + p) {
            idx[p] += 1;
            for q in p + 1..k {
                idx[q] = idx[q - 1] + 1;
            }
            self.next = Some(idx);
        }
        Some(current)
    }
}

fn binomial(n: usize, k: usize) -> u64 {
    let mut r = 1u64;
    for i in 0..k.min(n - k) {
        r = r.saturating_mul((n - i) as u64) / (i as u64 + 1);
    }
    r
}

/// Picks the best-conditioned k of `available` nodes: every subset when few, else greedily.
pub fn select_nodes(g: &Generator, available: &[usize]) -> Result<Selection, CodeError> {
    let mut avail = available.to_vec();
    avail.sort_unstable();
    avail.dedup();
    for &n in &avail {
        g.check_node(n)?;
    }
    let k = g.k;
    if avail.len() < k {
        return Err(CodeError::TooFew {
            available: avail.len(),
            k,
        });
    }
    let mut best: Option<Selection> = None;
    let consider = |nodes: Vec<usize>, best: &mut Option<Selection>| -> Result<(), CodeError> {
        let kappa = g.condition_number(&nodes)?;
        if best.as_ref().is_none_or(|b| kappa < b.condition_number) {
            *best = Some(Selection {
                nodes,
                condition_number: kappa,
            });
        }
        Ok(())
    };
    if binomial(avail.len(), k) <= EXHAUSTIVE_LIMIT {
        for idx in subsets(avail.len(), k) {
            consider(idx.iter().map(|&i| avail[i]).collect(), &mut best)?;
        }
    } else {
        // Greedy volume growth (pivoted-QR-like): add the node whose rows keep the smallest
        // singular value of the chosen rows largest.
        let mut chosen: Vec<usize> = Vec::with_capacity(k);
        for _ in 0..k {
            let mut pick = None;
            let mut pick_score = f64::NEG_INFINITY;
            for &cand in avail.iter().filter(|n| !chosen.contains(n)) {
                let mut trial = chosen.clone();
                trial.push(cand);
                let sub = g.submatrix(&trial)?;
                let sv = sub.transpose().svd(false, false).singular_values;
                let score = sv.iter().copied().fold(f64::INFINITY, f64::min);
                if score > pick_score {
                    pick_score = score;
                    pick = Some(cand);
                }
            }
            if let Some(p) = pick {
                chosen.push(p);
            }
        }
        consider(chosen, &mut best)?;
    }
    match best {
        Some(b) if b.condition_number <= MAX_CONDITION => Ok(b),
        Some(b) => Err(CodeError::IllConditioned {
            nodes: b.nodes,
            condition: b.condition_number,
        }),
        None => Err(CodeError::TooFew {
            available: avail.len(),
            k,
        }),
    }
}

#[cfg(test)]
mod tests;
