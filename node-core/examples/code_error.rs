//! Measures decode error of each generator construction against an uncoded f32 product.
//!
//! `cargo run --release -p node-core --example code_error` prints a markdown table: for each
//! construction, k = 1..=8 and n = k..=2k, the worst condition number and the worst relative
//! error over every k-subset of nodes, the selected group's κ, and the uncoded f32 error.

use node_core::code::{Construction, Decoder, Generator, select_nodes};
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

fn subsets(n: usize, k: usize, f: &mut dyn FnMut(&[usize])) {
    let mut idx: Vec<usize> = (0..k).collect();
    loop {
        f(&idx);
        let Some(p) = (0..k).rev().find(|&p| idx[p] < n - k + p) else {
            return;
        };
        idx[p] += 1;
        for q in p + 1..k {
            idx[q] = idx[q - 1] + 1;
        }
    }
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
                let rows = g.shard_rows(OUT);
                let mut parts = Vec::with_capacity(n);
                for node in 0..n {
                    let shard = g.encode_shard(node, &w, OUT, IN)?;
                    let mut z = vec![0.0f32; rows];
                    matmul(&shard, rows, IN, &x, 1, &mut z);
                    parts.push(z);
                }
                let decode = |nodes: &[usize]| -> Option<f64> {
                    let d = Decoder::new(&g, nodes).ok()?;
                    let refs: Vec<&[f32]> = nodes.iter().map(|&i| parts[i].as_slice()).collect();
                    let mut y = vec![0.0f32; g.padded_rows(OUT)];
                    d.decode(&refs, &mut y).ok()?;
                    Some(rel_err(&y[..OUT], &exact))
                };
                let (mut worst_k, mut worst_e) = (0.0f64, 0.0f64);
                subsets(n, k, &mut |nodes| {
                    worst_k = worst_k.max(g.condition_number(nodes).unwrap_or(f64::INFINITY));
                    worst_e = worst_e.max(decode(nodes).unwrap_or(f64::INFINITY));
                });
                let all: Vec<usize> = (0..n).collect();
                let (sel_k, sel_e) = match select_nodes(&g, &all) {
                    Ok(s) => (
                        s.condition_number,
                        decode(&s.nodes).unwrap_or(f64::INFINITY),
                    ),
                    Err(_) => (f64::INFINITY, f64::INFINITY),
                };
                let name = match construction {
                    Construction::ComplexCauchy => "complex Cauchy",
                    Construction::RealCauchy => "real Cauchy",
                    Construction::Gaussian { .. } => "Gaussian",
                    Construction::Identity => "identity",
                };
                println!(
                    "| {name} | {k} | {n} | {worst_k:.3e} | {worst_e:.2e} | {sel_k:.2} | {sel_e:.2e} |"
                );
            }
        }
    }
    Ok(())
}
