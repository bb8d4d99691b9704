//! Low-rank compression of a factored gradient `Dᵀ·X` (`D`: `p × out`, `X`: `p × in`) to
//! rank-`r` factors `D'ᵀ·X'`. Up to [`RANDOMIZED_MIN_ROWS`] rows it is the best approximation
//! (Eckart–Young), computed in the `p × p` row space: two Gram matrices, their
//! eigendecompositions and the SVD of a small core. Longer factors (a minibatch of requests)
//! go through a randomized range finder with power iterations (Halko, Martinsson and Tropp),
//! whose cost grows linearly with `p` instead of as `p²` and `p³`. Either way the result is
//! again a pair of factors, so every node applies it like any other update.

use nalgebra::{DMatrix, SymmetricEigen};

use crate::compute::{cpu::dot_f64, par};

/// A compressed stage: its factors and how much of the gradient they keep.
#[derive(Debug, Clone, PartialEq)]
pub struct LowRank {
    /// Rows kept.
    pub rows: usize,
    /// The input factor, `rows × in`.
    pub x: Vec<f32>,
    /// Per matrix, the output factor, `rows × out`.
    pub dy: Vec<Vec<f32>>,
    /// `‖D'ᵀX'‖² / ‖DᵀX‖²`: the share of the gradient's energy kept (1 when nothing was cut).
    pub kept: f64,
    /// `‖DᵀX‖²` before compression (0 when nothing was cut: not computed).
    pub energy: f64,
}

impl LowRank {
    /// No rows: a zero update for `matrices` matrices.
    fn empty(matrices: usize, kept: f64, energy: f64) -> Self {
        Self {
            rows: 0,
            x: Vec::new(),
            dy: vec![Vec::new(); matrices],
            kept,
            energy,
        }
    }
}

/// `M·Mᵀ` of a row-major `p × w` matrix, in f64.
fn gram(m: &[f32], p: usize) -> DMatrix<f64> {
    let w = m.len().checked_div(p).unwrap_or(0);
    let pairs: Vec<(usize, usize)> = (0..p).flat_map(|a| (a..p).map(move |b| (a, b))).collect();
    let dots = par::map(&pairs, |&(a, b)| {
        dot_f64(&m[a * w..(a + 1) * w], &m[b * w..(b + 1) * w])
    });
    let mut g = DMatrix::zeros(p, p);
    for (&(a, b), d) in pairs.iter().zip(dots) {
        g[(a, b)] = d;
        g[(b, a)] = d;
    }
    g
}

/// `Λ^{±1/2}·Vᵀ` restricted to the eigenvalues above the noise floor, and `Λ^{1/2}` of them.
fn row_basis(g: DMatrix<f64>) -> (DMatrix<f64>, Vec<f64>) {
    let p = g.nrows();
    let eig = SymmetricEigen::new(g);
    let max = eig.eigenvalues.iter().copied().fold(0.0f64, f64::max);
    // Gram matrices in f64 of f32 data: eigenvalues below ~1e-12 of the largest are noise.
    let floor = max * 1e-12;
    let keep: Vec<usize> = (0..p)
        .filter(|&i| eig.eigenvalues[i] > floor && eig.eigenvalues[i] > 0.0)
        .collect();
    let mut vt = DMatrix::zeros(keep.len(), p);
    let mut sqrt = Vec::with_capacity(keep.len());
    for (r, &i) in keep.iter().enumerate() {
        let s = eig.eigenvalues[i].sqrt();
        sqrt.push(s);
        for c in 0..p {
            vt[(r, c)] = eig.eigenvectors[(c, i)];
        }
    }
    (vt, sqrt)
}

/// `A·M` for a small `r × p` matrix `A` and a row-major `p × w` matrix `M`, as f32 rows.
fn combine(a: &DMatrix<f64>, m: &[f32], w: usize) -> Vec<f32> {
    let rows: Vec<usize> = (0..a.nrows()).collect();
    par::map(&rows, |&r| {
        let mut acc = vec![0.0f64; w];
        for (j, row) in m.chunks_exact(w.max(1)).enumerate() {
            let c = a[(r, j)];
            if c != 0.0 {
                acc.iter_mut()
                    .zip(row)
                    .for_each(|(s, &v)| *s += c * v as f64);
            }
        }
        acc.into_iter().map(|v| v as f32).collect::<Vec<f32>>()
    })
    .concat()
}

/// Factors with more rows than this are compressed with the randomized range finder.
pub const RANDOMIZED_MIN_ROWS: usize = 64;

/// Extra directions the randomized range finder samples beyond the rank.
const OVERSAMPLE: usize = 8;

/// Power iterations of the randomized range finder (each sharpens the captured subspace).
const POWER_ITERATIONS: usize = 2;

/// Rank-`rank` factors of `Σ_m dy_mᵀ·x` over a stage's matrices, which share `x` (`rows × in`;
/// each `dy_m` is `rows × out_m`): the best ones up to [`RANDOMIZED_MIN_ROWS`] rows, a
/// randomized near-best beyond. Factors with at most `rank` rows come back as they are.
pub fn low_rank(x: &[f32], dys: &[Vec<f32>], rows: usize, rank: usize) -> LowRank {
    if rows > RANDOMIZED_MIN_ROWS && rows > rank {
        return low_rank_randomized(x, dys, rows, rank);
    }
    low_rank_exact(x, dys, rows, rank)
}

/// `a · b` (`m × n`) for row-major `a` (`m × k`, or stored `k × m` when `a_transposed`) and
/// row-major `b` (`k × n`).
fn gemm(a: &[f32], a_transposed: bool, b: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    use crate::compute::cpu::{View, sgemm};
    let mut c = vec![0.0f32; m * n];
    let a = if a_transposed {
        View::transposed(a, m)
    } else {
        View::rows(a, k)
    };
    sgemm(m, k, n, a, View::rows(b, n), &mut c, n);
    c
}

/// Makes the `s` columns of a row-major `n × s` matrix orthonormal (modified Gram–Schmidt in
/// f64, twice for stability); a column that vanishes becomes zero.
fn orthonormalize(m: &mut [f32], n: usize, s: usize) {
    let mut cols: Vec<Vec<f64>> = (0..s)
        .map(|j| (0..n).map(|i| m[i * s + j] as f64).collect())
        .collect();
    for j in 0..s {
        for _ in 0..2 {
            for p in 0..j {
                let dot: f64 = cols[j].iter().zip(&cols[p]).map(|(a, b)| a * b).sum();
                let (before, rest) = cols.split_at_mut(j);
                rest[0]
                    .iter_mut()
                    .zip(&before[p])
                    .for_each(|(a, b)| *a -= dot * b);
            }
        }
        let norm = cols[j].iter().map(|v| v * v).sum::<f64>().sqrt();
        let inv = if norm > 1e-30 { 1.0 / norm } else { 0.0 };
        cols[j].iter_mut().for_each(|v| *v *= inv);
    }
    for (j, col) in cols.iter().enumerate() {
        for (i, v) in col.iter().enumerate() {
            m[i * s + j] = *v as f32;
        }
    }
}

/// `‖Dᵀ·X‖²` from the Gram matrices `X·Xᵀ` and `D·Dᵀ` (`rows × rows`, through SGEMM).
fn energy(x: &[f32], d: &[f32], rows: usize, inp: usize, out: usize) -> f64 {
    let transpose = |m: &[f32], w: usize| -> Vec<f32> {
        let mut t = vec![0.0f32; m.len()];
        for r in 0..rows {
            for c in 0..w {
                t[c * rows + r] = m[r * w + c];
            }
        }
        t
    };
    let gx = gemm(x, false, &transpose(x, inp), rows, inp, rows);
    let gd = gemm(d, false, &transpose(d, out), rows, out, rows);
    gx.iter().zip(&gd).map(|(&a, &b)| a as f64 * b as f64).sum()
}

/// The SVD of a small matrix with its `rank` largest non-zero singular directions picked out.
struct Top {
    u: DMatrix<f64>,
    vt: DMatrix<f64>,
    sigma: nalgebra::DVector<f64>,
    /// Indices of the kept singular values, largest first.
    order: Vec<usize>,
    /// Sum of the kept singular values squared.
    kept_sq: f64,
}

/// [`Top`] of `m`, or `None` when its SVD does not converge.
fn top(m: DMatrix<f64>, rank: usize) -> Option<Top> {
    let svd = m.try_svd(true, true, f64::EPSILON, 0)?;
    let (u, vt) = (svd.u?, svd.v_t?);
    let sigma = svd.singular_values;
    let mut order: Vec<usize> = (0..sigma.len()).collect();
    order.sort_by(|&a, &b| sigma[b].total_cmp(&sigma[a]));
    order.retain(|&i| sigma[i] > 0.0);
    order.truncate(rank);
    let kept_sq = order.iter().map(|&i| sigma[i].powi(2)).sum();
    Some(Top {
        u,
        vt,
        sigma,
        order,
        kept_sq,
    })
}

/// [`low_rank`] for long factors: a randomized range finder with power iterations on the
/// column space of `Dᵀ·X`, then the SVD of its small projection.
fn low_rank_randomized(x: &[f32], dys: &[Vec<f32>], rows: usize, rank: usize) -> LowRank {
    use rand::{Rng, SeedableRng};
    let inp = x.len() / rows;
    let outs: Vec<usize> = dys.iter().map(|d| d.len() / rows).collect();
    let out: usize = outs.iter().sum();
    // D = [dy_0 | dy_1 | …], rows × out.
    let mut d = Vec::with_capacity(rows * out);
    for r in 0..rows {
        for (dy, &w) in dys.iter().zip(&outs) {
            d.extend_from_slice(&dy[r * w..(r + 1) * w]);
        }
    }
    let s = (rank + OVERSAMPLE).min(inp).min(out).min(rows);
    if s == 0 {
        return LowRank::empty(dys.len(), 1.0, 0.0);
    }
    // A fixed seed: the leader's compression is reproducible.
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0x636f_6465_646d_6573);
    let omega: Vec<f32> = (0..inp * s)
        .map(|_| if rng.random::<bool>() { 1.0 } else { -1.0 })
        .collect();
    // Y = Dᵀ·X·Ω (out × s), sharpened by power iterations Y ← (Dᵀ·X)(Xᵀ·D)·Y.
    let mut y = gemm(
        &d,
        true,
        &gemm(x, false, &omega, rows, inp, s),
        out,
        rows,
        s,
    );
    for _ in 0..POWER_ITERATIONS {
        orthonormalize(&mut y, out, s);
        let mut v = gemm(x, true, &gemm(&d, false, &y, rows, out, s), inp, rows, s);
        orthonormalize(&mut v, inp, s);
        y = gemm(&d, true, &gemm(x, false, &v, rows, inp, s), out, rows, s);
    }
    orthonormalize(&mut y, out, s);
    // B = Qᵀ·Dᵀ·X = (D·Q)ᵀ·X, s × in; Dᵀ·X ≈ Q·B.
    let dq = gemm(&d, false, &y, rows, out, s);
    let b = gemm(&dq, true, x, s, rows, inp);
    let total = energy(x, &d, rows, inp, out);
    let bm = DMatrix::from_fn(s, inp, |i, j| b[i * inp + j] as f64);
    let Some(Top {
        u,
        vt,
        sigma,
        order,
        kept_sq,
    }) = top(bm, rank)
    else {
        return LowRank::empty(dys.len(), 0.0, total);
    };
    let r = order.len();
    if r == 0 {
        return LowRank::empty(dys.len(), 1.0, total);
    }
    // Term k: √σ·(Q·u_k) as the output factor's row, √σ·v_kᵀ as the input factor's row.
    let mut new_x = vec![0.0f32; r * inp];
    let mut new_d = vec![0.0f64; r * out];
    for (k, &i) in order.iter().enumerate() {
        let root = sigma[i].sqrt();
        for c in 0..inp {
            new_x[k * inp + c] = (root * vt[(i, c)]) as f32;
        }
        for o in 0..out {
            let q: f64 = (0..s).map(|j| y[o * s + j] as f64 * u[(j, i)]).sum();
            new_d[k * out + o] = root * q;
        }
    }
    let mut new_dy: Vec<Vec<f32>> = Vec::with_capacity(dys.len());
    let mut first = 0;
    for &w in &outs {
        let mut m = Vec::with_capacity(r * w);
        for k in 0..r {
            m.extend(
                new_d[k * out + first..k * out + first + w]
                    .iter()
                    .map(|&v| v as f32),
            );
        }
        new_dy.push(m);
        first += w;
    }
    balance(&mut new_x, &mut new_dy, r);
    LowRank {
        rows: r,
        x: new_x,
        dy: new_dy,
        kept: if total > 0.0 {
            (kept_sq / total).min(1.0)
        } else {
            1.0
        },
        energy: total,
    }
}

/// [`low_rank`] by the exact row-space method: the best rank-`rank` factors.
fn low_rank_exact(x: &[f32], dys: &[Vec<f32>], rows: usize, rank: usize) -> LowRank {
    if rows <= rank || rows == 0 {
        return LowRank {
            rows,
            x: x.to_vec(),
            dy: dys.to_vec(),
            kept: 1.0,
            energy: 0.0,
        };
    }
    let inp = x.len() / rows;
    let outs: Vec<usize> = dys.iter().map(|d| d.len() / rows).collect();
    // The stacked output factor D = [dy_0 | dy_1 | …] has Gram Σ_m dy_m·dy_mᵀ.
    let gx = gram(x, rows);
    let mut gd = DMatrix::zeros(rows, rows);
    for dy in dys {
        gd += gram(dy, rows);
    }
    // X = Vxᵀᵀ·Λx^{1/2}·Qxᵀ with orthonormal Qx; likewise D. Then DᵀX = Qd·C·Qxᵀ with the
    // core C = Λd^{1/2}·Vdᵀ·Vx·Λx^{1/2}.
    let (vxt, sx) = row_basis(gx);
    let (vdt, sd) = row_basis(gd);
    if sx.is_empty() || sd.is_empty() {
        // A zero gradient: nothing to send.
        return LowRank::empty(dys.len(), 1.0, 0.0);
    }
    let mut core = &vdt * vxt.transpose();
    for (i, s) in sd.iter().enumerate() {
        core.row_mut(i).scale_mut(*s);
    }
    for (j, s) in sx.iter().enumerate() {
        core.column_mut(j).scale_mut(*s);
    }
    let total: f64 = core.iter().map(|v| v * v).sum();
    let Some(Top {
        u,
        vt,
        sigma,
        order,
        kept_sq,
    }) = top(core, rank)
    else {
        return LowRank::empty(dys.len(), 0.0, total);
    };
    let r = order.len();
    // D' = √S·Uᵣᵀ·Λd^{-1/2}·Vdᵀ·D and X' = √S·Vᵣᵀ·Λx^{-1/2}·Vxᵀ·X.
    let mut ad = DMatrix::zeros(r, rows);
    let mut ax = DMatrix::zeros(r, rows);
    for (k, &i) in order.iter().enumerate() {
        let root = sigma[i].sqrt();
        for (q, s) in sd.iter().enumerate() {
            let c = root * u[(q, i)] / s;
            for j in 0..rows {
                ad[(k, j)] += c * vdt[(q, j)];
            }
        }
        for (q, s) in sx.iter().enumerate() {
            let c = root * vt[(i, q)] / s;
            for j in 0..rows {
                ax[(k, j)] += c * vxt[(q, j)];
            }
        }
    }
    let mut new_x = combine(&ax, x, inp);
    let mut new_dy: Vec<Vec<f32>> = dys
        .iter()
        .zip(&outs)
        .map(|(dy, &w)| combine(&ad, dy, w))
        .collect();
    balance(&mut new_x, &mut new_dy, r);
    LowRank {
        rows: r,
        x: new_x,
        dy: new_dy,
        kept: if total > 0.0 { kept_sq / total } else { 1.0 },
        energy: total,
    }
}

/// Rescales each rank-one term `dy_kᵀ·x_k` so both sides have the same largest magnitude (the
/// product is unchanged; f16 then keeps the most precision on both).
fn balance(x: &mut [f32], dys: &mut [Vec<f32>], rows: usize) {
    if rows == 0 {
        return;
    }
    let inp = x.len() / rows;
    for k in 0..rows {
        let xr = &mut x[k * inp..(k + 1) * inp];
        let mx = xr.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let md = dys
            .iter()
            .map(|d| {
                let w = d.len() / rows;
                d[k * w..(k + 1) * w]
                    .iter()
                    .fold(0.0f32, |m, v| m.max(v.abs()))
            })
            .fold(0.0f32, f32::max);
        if mx <= 0.0 || md <= 0.0 {
            continue;
        }
        let c = (md as f64 / mx as f64).sqrt() as f32;
        xr.iter_mut().for_each(|v| *v *= c);
        for d in dys.iter_mut() {
            let w = d.len() / rows;
            d[k * w..(k + 1) * w].iter_mut().for_each(|v| *v /= c);
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a test: a failed unwrap is a failed test

    use super::*;
    use rand::{Rng, SeedableRng};

    fn random(rng: &mut rand_chacha::ChaCha8Rng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    /// `Σ_m dy_mᵀ·x` stacked over the matrices: `(Σ out) × in`, in f64.
    fn dense(x: &[f32], dys: &[Vec<f32>], rows: usize) -> DMatrix<f64> {
        let inp = x.len() / rows.max(1);
        let outs: usize = dys.iter().map(|d| d.len() / rows.max(1)).sum();
        let mut g = DMatrix::zeros(outs, inp);
        let mut first = 0;
        for dy in dys {
            let w = dy.len() / rows.max(1);
            for r in 0..rows {
                for o in 0..w {
                    for i in 0..inp {
                        g[(first + o, i)] += dy[r * w + o] as f64 * x[r * inp + i] as f64;
                    }
                }
            }
            first += w;
        }
        g
    }

    /// Singular values of `m`, largest first.
    fn singular_values(m: &DMatrix<f64>) -> Vec<f64> {
        let mut sv: Vec<f64> = m
            .clone()
            .svd(false, false)
            .singular_values
            .iter()
            .copied()
            .collect();
        sv.sort_by(|a, b| b.total_cmp(a));
        sv
    }

    /// Rows that are combinations of `rank` random rows: a gradient of that rank.
    fn of_rank(rng: &mut rand_chacha::ChaCha8Rng, rows: usize, w: usize, basis: usize) -> Vec<f32> {
        let base = random(rng, basis * w);
        let mix = random(rng, rows * basis);
        let mut out = vec![0.0f32; rows * w];
        for r in 0..rows {
            for b in 0..basis {
                for c in 0..w {
                    out[r * w + c] += mix[r * basis + b] * base[b * w + c];
                }
            }
        }
        out
    }

    #[test]
    fn a_gradient_of_low_rank_is_kept_exactly() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
        let rows = 12;
        let x = of_rank(&mut rng, rows, 20, 3);
        let dys = vec![random(&mut rng, rows * 7), random(&mut rng, rows * 5)];
        let c = low_rank(&x, &dys, rows, 3);
        assert_eq!(c.rows, 3);
        assert!((c.kept - 1.0).abs() < 1e-9, "kept {}", c.kept);
        let (want, got) = (dense(&x, &dys, rows), dense(&c.x, &c.dy, c.rows));
        let err = (&want - &got).norm() / want.norm();
        assert!(err < 1e-5, "relative error {err:.2e}");
    }

    #[test]
    fn truncation_is_the_best_rank_r_approximation() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(2);
        let rows = 10;
        let x = random(&mut rng, rows * 16);
        let dys = vec![random(&mut rng, rows * 9)];
        let want = dense(&x, &dys, rows);
        let sv = singular_values(&want);
        for rank in [1, 4, 7] {
            let c = low_rank(&x, &dys, rows, rank);
            assert_eq!(c.rows, rank);
            let err = (&want - dense(&c.x, &c.dy, c.rows)).norm();
            // Eckart–Young: the error of the best rank-r approximation.
            let best = sv[rank..].iter().map(|s| s * s).sum::<f64>().sqrt();
            assert!(
                (err - best).abs() < 1e-5 * want.norm(),
                "rank {rank}: {err} vs {best}"
            );
            let kept = sv[..rank].iter().map(|s| s * s).sum::<f64>() / want.norm_squared();
            assert!((c.kept - kept).abs() < 1e-6, "kept {} vs {kept}", c.kept);
        }
    }

    #[test]
    fn long_factors_get_a_near_best_approximation_in_linear_time() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
        let rows = 200;
        // A decaying spectrum, as gradients have: a strong rank-6 part plus weak noise.
        let mut x = of_rank(&mut rng, rows, 40, 6);
        let noise = random(&mut rng, rows * 40);
        x.iter_mut().zip(&noise).for_each(|(a, n)| *a += 0.05 * n);
        let dys = vec![random(&mut rng, rows * 30), random(&mut rng, rows * 25)];
        let want = dense(&x, &dys, rows);
        let sv = singular_values(&want);
        for rank in [2, 6, 8] {
            let c = low_rank(&x, &dys, rows, rank);
            assert_eq!(c.rows, rank);
            let err = (&want - dense(&c.x, &c.dy, c.rows)).norm();
            let best = sv[rank..].iter().map(|s| s * s).sum::<f64>().sqrt();
            assert!(
                err <= best * 1.02 + 1e-4 * want.norm(),
                "rank {rank}: error {err} against the best {best}"
            );
            let kept = sv[..rank].iter().map(|s| s * s).sum::<f64>() / want.norm_squared();
            assert!(
                (c.kept - kept).abs() < 1e-3 && c.kept <= 1.0,
                "kept {} vs the best {kept}",
                c.kept
            );
            assert!((c.energy - want.norm_squared()).abs() < 1e-4 * want.norm_squared());
        }
    }

    #[test]
    fn short_factors_and_zero_gradients_pass_through() {
        let x = vec![1.0f32; 2 * 3];
        let dys = vec![vec![0.5f32; 2 * 4]];
        assert_eq!(low_rank(&x, &dys, 2, 2).x, x);
        let zero = low_rank(&[0.0; 5 * 3], &[vec![0.0; 5 * 4]], 5, 2);
        assert_eq!(zero.rows, 0);
        assert!(zero.x.is_empty() && zero.dy[0].is_empty());
    }
}
