//! Measures decode error of each generator construction against an uncoded f32 product.
//!
//! `cargo run --release -p node-core --example code_error` prints a markdown table: for each
//! construction, k = 1..=8 and n = k..=2k, the worst condition number and the worst relative
//! error over every k-subset of nodes, the selected group's κ, and the uncoded f32 error.

use node_core::code::{Construction, Decoder, Generator, select_nodes, subsets};
use node_core::compute::matmul;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const OUT: usize = 576;
const IN: usize = 576;

fn rel_err(y: &[f32], exact: &[f64]) -> f64 {
    let num: f64 = y
        .iter()
        .zip(exact)
        .map(|(&a, &e)| (a as f64 - e).powi(2))
        .sum();
    let den: f64 = exact.iter().map(|e| e * e).sum();
    (num / den).sqrt()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut rng = ChaCha8Rng::seed_from_u64(2026);
    let w: Vec<f32> = (0..OUT * IN)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    let x: Vec<f32> = (0..IN).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let exact: Vec<f64> = (0..OUT)
        .map(|r| (0..IN).map(|c| w[r * IN + c] as f64 * x[c] as f64).sum())
        .collect();
    let mut plain = vec![0.0f32; OUT];
    matmul(&w, OUT, IN, &x, 1, &mut plain);
    println!(
        "W {OUT}×{IN}, entries U(−1, 1); uncoded f32 relative error {:.2e}\n",
        rel_err(&plain, &exact)
    );
    println!(
        "| construction | k | n | worst κ (all k-subsets) | worst rel. error | selected group κ | its rel. error |"
    );
    println!("|---|---|---|---|---|---|---|");
    for construction in [
        Construction::ComplexCauchy,
        Construction::RealCauchy,
        Construction::Gaussian { seed: 1 },
    ] {
        for k in 1..=8 {
            for n in k..=2 * k {
                let g = Generator::new(construction, n, k)?;
                let m = measure(&g, &w, &x, &exact)?;
                let name = match construction {
                    Construction::ComplexCauchy => "complex Cauchy",
                    Construction::RealCauchy => "real Cauchy",
                    Construction::Gaussian { .. } => "Gaussian",
                    Construction::Identity
                    | Construction::GrowingCauchy { .. }
                    | Construction::Integer { .. } => "other",
                };
                println!("| {name} | {k} | {n} | {m} |");
            }
        }
    }
    // The grown code: genesis rows on the roots of unity, later rows in the widest gaps, as
    // many as `Generator::growing` allows (every k of them within κ 900).
    println!(
        "\nGrown complex Cauchy (`Generator::growing`): genesis rows, then rows added on demand up to n_max.\n"
    );
    println!(
        "| k | genesis rows | n | n_max | worst κ (all k-subsets) | worst rel. error | selected group κ | its rel. error |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for (k, seeded) in [(2, 3), (3, 5), (4, 7), (5, 9), (6, 11), (8, 15)] {
        let full = Generator::growing(seeded, k, None)?;
        let n_max = full.n();
        let mut ns: Vec<usize> = [
            seeded,
            seeded + 1,
            seeded + 3,
            2 * seeded,
            16,
            24,
            32,
            48,
            n_max,
        ]
        .into_iter()
        .filter(|&n| n >= seeded && n <= n_max)
        .collect();
        ns.sort_unstable();
        ns.dedup();
        for n in ns {
            let g = Generator::growing(seeded, k, Some(n))?;
            let m = measure(&g, &w, &x, &exact)?;
            println!("| {k} | {seeded} | {n} | {n_max} | {m} |");
        }
    }
    Ok(())
}

/// Worst κ and error over every k-subset of `g`'s rows, and the selected group's.
struct Measured {
    worst_k: f64,
    worst_e: f64,
    sel_k: f64,
    sel_e: f64,
}

impl std::fmt::Display for Measured {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:.3e} | {:.2e} | {:.2} | {:.2e}",
            self.worst_k, self.worst_e, self.sel_k, self.sel_e
        )
    }
}

fn measure(
    g: &Generator,
    w: &[f32],
    x: &[f32],
    exact: &[f64],
) -> Result<Measured, Box<dyn std::error::Error>> {
    let (n, k) = (g.n(), g.k());
    let rows = g.shard_rows(OUT);
    let mut parts = Vec::with_capacity(n);
    for node in 0..n {
        let shard = g.encode_shard(node, w, OUT, IN)?;
        let mut z = vec![0.0f32; rows];
        matmul(&shard, rows, IN, x, 1, &mut z);
        parts.push(z);
    }
    let decode = |nodes: &[usize]| -> Option<f64> {
        let d = Decoder::new(g, nodes).ok()?;
        let refs: Vec<&[f32]> = nodes.iter().map(|&i| parts[i].as_slice()).collect();
        let mut y = vec![0.0f32; g.padded_rows(OUT)];
        d.decode(&refs, &mut y).ok()?;
        Some(rel_err(&y[..OUT], exact))
    };
    let (mut worst_k, mut worst_e) = (0.0f64, 0.0f64);
    for nodes in subsets(n, k) {
        worst_k = worst_k.max(g.condition_number(&nodes).unwrap_or(f64::INFINITY));
        worst_e = worst_e.max(decode(&nodes).unwrap_or(f64::INFINITY));
    }
    let all: Vec<usize> = (0..n).collect();
    let (sel_k, sel_e) = match select_nodes(g, &all) {
        Ok(s) => (
            s.condition_number,
            decode(&s.nodes).unwrap_or(f64::INFINITY),
        ),
        Err(_) => (f64::INFINITY, f64::INFINITY),
    };
    Ok(Measured {
        worst_k,
        worst_e,
        sel_k,
        sel_e,
    })
}
