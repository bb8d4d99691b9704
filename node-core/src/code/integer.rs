//! The integer code behind compact shards (docs/coding.md, "Compact shards").
//!
//! Rows are the k unit vectors followed by parity rows of small nonzero integers, chosen so
//! that every k rows are linearly independent (checked exactly, in integers). Weights are
//! quantised to integers in `±STORED_MAX` with one scale per group of values shared by the k
//! blocks, so every coded value `Σ_j g_j · q_j` is an integer: the weights' own i8 in a unit
//! row, and a sum of magnitude at most `‖g‖₁ · STORED_MAX` (an i16) in a parity row. The shards
//! stay an exact codeword.

/// Largest magnitude of a stored compact value (an i8).
pub const STORED_MAX: i32 = 127;

/// Largest k an integer code is built for (its parity rows' entries grow with k).
pub const INTEGER_MAX_K: usize = 5;

/// Most rows an integer code has.
const MAX_ROWS: usize = 64;

/// The rows of the integer code for `k` blocks.
///
/// Parity rows are taken in order of L1 norm (then largest entry, then entries): each is kept
/// when every k-subset of the rows so far that holds it is nonsingular. The search stops at
/// the first L1 norm that yields two parity rows (one detects, two locate a wrong member), and
/// keeps every row of that norm that fits, so the mesh can grow into them.
pub(crate) fn integer_rows(k: usize) -> Vec<Vec<i32>> {
    if k == 1 {
        return vec![vec![1]; MAX_ROWS];
    }
    let mut rows: Vec<Vec<i32>> = (0..k)
        .map(|i| (0..k).map(|j| i32::from(i == j)).collect())
        .collect();
    let mut norm = k as i32;
    loop {
        for v in candidates(k, norm) {
            if rows.len() >= MAX_ROWS {
                break;
            }
            if every_subset_with_is_regular(&rows, &v, k) {
                rows.push(v);
            }
        }
        if rows.len() >= k + 2 {
            return rows;
        }
        norm += 1;
    }
}

/// Vectors of `k` nonzero integers with L1 norm `norm` and a positive first entry, in order of
/// largest entry, then of entry magnitudes, then of entries.
fn candidates(k: usize, norm: i32) -> Vec<Vec<i32>> {
    fn magnitudes(k: usize, left: i32, cur: &mut Vec<i32>, out: &mut Vec<Vec<i32>>) {
        if cur.len() == k {
            if left == 0 {
                out.push(cur.clone());
            }
            return;
        }
        let rest = (k - cur.len() - 1) as i32;
        for m in 1..=(left - rest) {
            cur.push(m);
            magnitudes(k, left - m, cur, out);
            cur.pop();
        }
    }
    let mut mags = Vec::new();
    magnitudes(k, norm, &mut Vec::with_capacity(k), &mut mags);
    let mut out = Vec::new();
    for m in mags {
        for signs in 0..(1u32 << (k - 1)) {
            let v: Vec<i32> = m
                .iter()
                .enumerate()
                .map(|(i, &a)| {
                    if i > 0 && signs >> (i - 1) & 1 == 1 {
                        -a
                    } else {
                        a
                    }
                })
                .collect();
            out.push(v);
        }
    }
    out.sort_by(|a, b| {
        let key = |v: &Vec<i32>| {
            (
                v.iter().map(|x| x.abs()).max(),
                v.iter().map(|x| x.abs()).collect::<Vec<_>>(),
            )
        };
        key(a).cmp(&key(b)).then_with(|| a.cmp(b))
    });
    out
}

/// Whether every k-subset of `rows ∪ {v}` that holds `v` is nonsingular.
fn every_subset_with_is_regular(rows: &[Vec<i32>], v: &[i32], k: usize) -> bool {
    super::subsets(rows.len(), k - 1).all(|group| {
        let mut m: Vec<Vec<i128>> = group
            .iter()
            .map(|&i| rows[i].iter().map(|&x| i128::from(x)).collect())
            .collect();
        m.push(v.iter().map(|&x| i128::from(x)).collect());
        determinant(m) != 0
    })
}

/// Exact determinant of a small integer matrix (Bareiss' fraction-free elimination).
pub(super) fn determinant(mut m: Vec<Vec<i128>>) -> i128 {
    let n = m.len();
    let mut sign = 1;
    let mut prev = 1i128;
    for p in 0..n {
        if m[p][p] == 0 {
            match (p + 1..n).find(|&r| m[r][p] != 0) {
                Some(r) => {
                    m.swap(p, r);
                    sign = -sign;
                }
                None => return 0,
            }
        }
        for i in p + 1..n {
            for j in p + 1..n {
                m[i][j] = (m[i][j] * m[p][p] - m[i][p] * m[p][j]) / prev;
            }
        }
        prev = m[p][p];
    }
    sign * m[n - 1][n - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The largest L1 norm of the rows.
    fn l1_norm(rows: &[Vec<i32>]) -> i32 {
        rows.iter()
            .map(|r| r.iter().map(|x| x.abs()).sum())
            .max()
            .unwrap_or(0)
    }

    #[test]
    fn determinant_matches_known_values() {
        assert_eq!(determinant(vec![vec![2, 0], vec![0, 3]]), 6);
        assert_eq!(determinant(vec![vec![0, 1], vec![1, 0]]), -1);
        assert_eq!(
            determinant(vec![vec![1, 1, 1], vec![1, 2, 3], vec![1, 4, 9]]),
            2
        );
        assert_eq!(determinant(vec![vec![1, 2], vec![2, 4]]), 0);
    }

    #[test]
    fn every_k_rows_of_each_integer_code_are_regular_and_fit_an_i16() {
        for k in 1..=INTEGER_MAX_K {
            let rows = integer_rows(k);
            assert!(rows.len() >= k + 2, "k = {k}: {} rows", rows.len());
            let norm = l1_norm(&rows);
            assert!(
                norm * STORED_MAX <= i32::from(i16::MAX),
                "k = {k}: L1 norm {norm}"
            );
            assert!(rows.iter().all(|r| r.len() == k));
            if k > 1 {
                for group in super::super::subsets(rows.len(), k) {
                    let m = group
                        .iter()
                        .map(|&i| rows[i].iter().map(|&x| i128::from(x)).collect())
                        .collect();
                    assert_ne!(determinant(m), 0, "k = {k}: rows {group:?} are singular");
                }
            }
        }
    }

    #[test]
    fn the_default_code_has_the_rows_docs_coding_names() {
        let rows = integer_rows(3);
        assert_eq!(l1_norm(&rows), 4);
        assert_eq!(rows[3], vec![1, -1, -1]);
        assert_eq!(rows.len(), 7);
    }
}
