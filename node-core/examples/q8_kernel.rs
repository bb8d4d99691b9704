//! The compact (q8) product's speed on one thread, from memory (a row stack past any cache):
//! what a member's decode reads each token. Prints a Markdown table (docs/perf.md).
//!
//! `CODEDMESH_THREADS=1 cargo run --release -p node-core --example q8_kernel`

use node_core::compute::q8::{Ints, Q8_BLOCK, Q8Matrix, matmul_q8};

/// Rows and columns of one matrix (Llama-3.2-1B's FFN shape, four of them), and how many
/// matrices are read in turn (320 M values, beyond any cache).
const ROWS: usize = 8192 * 4;
const COLS: usize = 2048;
const MATRICES: usize = 5;

fn main() {
    let i8s: Vec<Vec<i8>> = (0..MATRICES)
        .map(|m| {
            (0..ROWS * COLS)
                .map(|i| ((i * 7 + m) % 255) as i8 - 127)
                .collect()
        })
        .collect();
    let i16s: Vec<Vec<i16>> = i8s
        .iter()
        .map(|m| m.iter().map(|&v| i16::from(v) * 3).collect())
        .collect();
    let scales: Vec<half::f16> = (0..ROWS * COLS / Q8_BLOCK)
        .map(|i| half::f16::from_f32(0.01 + (i % 7) as f32 * 1e-3))
        .collect();
    println!("| values | inputs | ns a block of 32 | GB/s (best of 3) |");
    println!("|---|---|---|---|");
    for wide in [false, true] {
        for t in [1usize, 2, 4] {
            let x: Vec<f32> = (0..t * COLS).map(|i| (i as f32 * 0.37).sin()).collect();
            let mut y = vec![0.0f32; t * ROWS];
            let mut best = f64::INFINITY;
            for _ in 0..3 {
                let start = std::time::Instant::now();
                for m in 0..MATRICES {
                    let q = if wide {
                        Ints::I16(&i16s[m])
                    } else {
                        Ints::I8(&i8s[m])
                    };
                    let w = Q8Matrix {
                        q,
                        scales: &scales,
                        rows: ROWS,
                        cols: COLS,
                    };
                    matmul_q8(w, &x, t, &mut y);
                }
                best = best.min(start.elapsed().as_secs_f64());
            }
            let blocks = (MATRICES * ROWS * COLS / Q8_BLOCK) as f64;
            let bytes = blocks * (if wide { 64.0 } else { 32.0 } + 2.0);
            println!(
                "| {} | {t} | {:.2} | {:.2} |",
                if wide { "i16" } else { "i8" },
                best * 1e9 / blocks,
                bytes / best / 1e9
            );
        }
    }
}
