//! Low-rank compression of a factored gradient `Dᵀ·X` (`D`: `p × out`, `X`: `p × in`) to the
//! best rank-`r` factors `D'ᵀ·X'` (Eckart–Young), computed in the `p × p` row space: two Gram
//! matrices, their eigendecompositions and the SVD of a small core. The result is again a pair of
//! factors, `D' = A·D` and `X' = B·X`, so every node applies it like any other update.

use nalgebra::{DMatrix, SymmetricEigen};

use crate::compute::par;

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
        m[a * w..(a + 1) * w]
            .iter()
            .zip(&m[b * w..(b + 1) * w])
            .map(|(&x, &y)| x as f64 * y as f64)
            .sum::<f64>()
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

/// The best rank-`rank` factors of `Σ_m dy_mᵀ·x` over a stage's matrices, which share `x`
/// (`rows × in`; each `dy_m` is `rows × out_m`). Factors with at most `rank` rows come back
/// as they are.
pub fn low_rank(x: &[f32], dys: &[Vec<f32>], rows: usize, rank: usize) -> LowRank {
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
    let Some(svd) = core.try_svd(true, true, f64::EPSILON, 0) else {
        return LowRank::empty(dys.len(), 0.0, total);
    };
    let (Some(u), Some(vt)) = (svd.u, svd.v_t) else {
        return LowRank::empty(dys.len(), 0.0, total);
    };
    let mut order: Vec<usize> = (0..svd.singular_values.len()).collect();
    order.sort_by(|&a, &b| svd.singular_values[b].total_cmp(&svd.singular_values[a]));
    order.retain(|&i| svd.singular_values[i] > 0.0);
    order.truncate(rank);
    let r = order.len();
    let kept_sq: f64 = order.iter().map(|&i| svd.singular_values[i].powi(2)).sum();
    // D' = √S·Uᵣᵀ·Λd^{-1/2}·Vdᵀ·D and X' = √S·Vᵣᵀ·Λx^{-1/2}·Vxᵀ·X.
    let mut ad = DMatrix::zeros(r, rows);
    let mut ax = DMatrix::zeros(r, rows);
    for (k, &i) in order.iter().enumerate() {
        let root = svd.singular_values[i].sqrt();
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
        let mut sv: Vec<f64> = want
            .clone()
            .svd(false, false)
            .singular_values
            .iter()
            .copied()
            .collect();
        sv.sort_by(|a, b| b.total_cmp(a));
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
    fn short_factors_and_zero_gradients_pass_through() {
        let x = vec![1.0f32; 2 * 3];
        let dys = vec![vec![0.5f32; 2 * 4]];
        assert_eq!(low_rank(&x, &dys, 2, 2).x, x);
        let zero = low_rank(&[0.0; 5 * 3], &[vec![0.0; 5 * 4]], 5, 2);
        assert_eq!(zero.rows, 0);
        assert!(zero.x.is_empty() && zero.dy[0].is_empty());
    }
}
