//! Kernel bandwidths: memory copy and read, and GEMV of each weight width, read cold.

use std::hint::black_box;
use std::time::Duration;

use node_core::compute::{self, WeightElem};

use super::best_time;

/// Memory-copy bandwidth (bytes read per second) over a buffer far larger than the caches.
pub fn copy_bandwidth() -> f64 {
    let n = 64 << 20; // 256 MiB of f32
    let src = vec![1.0f32; n];
    let mut dst = vec![0.0f32; n];
    let t = best_time(Duration::from_secs(2), || {
        dst.copy_from_slice(black_box(&src));
        black_box(&dst);
    });
    (n * 4) as f64 / t.as_secs_f64()
}

/// Bytes per second the kernel threads read from memory (256 MiB summed, every thread its
/// share): the ceiling of a decode that only streams its weights.
pub fn read_bandwidth() -> f64 {
    let n: usize = 32 << 20; // 256 MiB of u64
    let src: Vec<u64> = (0..n as u64).collect();
    let chunk = n.div_ceil(compute::threads().max(1));
    let t = best_time(Duration::from_secs(2), || {
        let parts = compute::par::map(&src.chunks(chunk).collect::<Vec<_>>(), |c| {
            c.iter().fold(0u64, |a, &v| a.wrapping_add(v))
        });
        black_box(parts);
    });
    (n * 8) as f64 / t.as_secs_f64()
}

/// GEMV bandwidth (weight bytes read per second) of a `rows × cols` matrix of `W`, read cold:
/// calls rotate through copies that together exceed the caches, as a forward pass does.
pub fn gemv_bandwidth<W: WeightElem>(rows: usize, cols: usize, make: fn(f32) -> W) -> f64 {
    let bytes = rows * cols * std::mem::size_of::<W>();
    let copies = (256usize << 20).div_ceil(bytes).clamp(1, 256);
    let ws: Vec<Vec<W>> = (0..copies)
        .map(|c| {
            (0..rows * cols)
                .map(|i| make(((i + c) % 97) as f32 * 0.01))
                .collect()
        })
        .collect();
    let x = vec![0.5f32; cols];
    let mut y = vec![0.0f32; rows];
    let t = best_time(Duration::from_secs(1), || {
        for w in &ws {
            compute::matmul(black_box(w.as_slice()), rows, cols, &x, 1, &mut y);
            black_box(&y);
        }
    });
    (bytes * copies) as f64 / t.as_secs_f64()
}

/// GEMV bandwidth of a compact `rows × cols` matrix (i8 values, or i16 for a parity row's
/// when `wide`, and f16 scales per 32), read cold as in [`gemv_bandwidth`]; bytes counted are
/// values and scales.
pub fn gemv_q8_bandwidth(rows: usize, cols: usize, wide: bool) -> f64 {
    use node_core::coded::CodedInts;
    use node_core::compute::q8::{Q8Matrix, blocks_per_row, matmul_q8};
    let nb = blocks_per_row(cols);
    let bytes = rows * cols * if wide { 2 } else { 1 } + rows * nb * 2;
    let copies = (256usize << 20).div_ceil(bytes).clamp(1, 256);
    // Every copy has its own scales, so they are read cold too.
    let ws: Vec<(CodedInts, Vec<half::f16>)> = (0..copies)
        .map(|c| {
            let values = (0..rows * cols).map(move |i| ((i + c) % 97) as i16 - 48);
            let q = if wide {
                CodedInts::I16(std::sync::Arc::new(values.collect()))
            } else {
                CodedInts::I8(std::sync::Arc::new(values.map(|v| v as i8).collect()))
            };
            (q, vec![half::f16::from_f32(0.01); rows * nb])
        })
        .collect();
    let x = vec![0.5f32; cols];
    let mut y = vec![0.0f32; rows];
    let t = best_time(Duration::from_secs(1), || {
        for (q, scales) in &ws {
            let w = Q8Matrix {
                q: black_box(q).view(),
                scales,
                rows,
                cols,
            };
            matmul_q8(w, &x, 1, &mut y);
            black_box(&y);
        }
    });
    (bytes * copies) as f64 / t.as_secs_f64()
}

/// GEMV bandwidth of a `rows × cols` matrix of a 4-bit file's blocks (packed nibbles, an f16
/// scale and minimum per 32), read cold as in [`gemv_bandwidth`]; bytes counted are all three.
/// With `integer`, the input is quantised to 8 bits a value and the products are integers
/// (the quantising counted in the time).
pub fn gemv_q4_bandwidth(rows: usize, cols: usize, integer: bool) -> f64 {
    use node_core::compute::q4::{Q4_BLOCK, Q4Matrix, Q8Input, matmul_q4, matmul_q4_q8};
    let nb = rows * cols / Q4_BLOCK;
    let bytes = rows * cols / 2 + nb * 4;
    let copies = (256usize << 20).div_ceil(bytes).clamp(1, 256);
    type Blocks = (Vec<u8>, Vec<half::f16>, Vec<half::f16>);
    let ws: Vec<Blocks> = (0..copies)
        .map(|c| {
            let packed = (0..rows * cols / 2)
                .map(|i| ((i + c) % 251) as u8)
                .collect();
            (
                packed,
                vec![half::f16::from_f32(0.01); nb],
                vec![half::f16::from_f32(-0.08); nb],
            )
        })
        .collect();
    let x: Vec<f32> = (0..cols).map(|i| (i % 13) as f32 * 0.1 - 0.6).collect();
    let mut y = vec![0.0f32; rows];
    let mut input = Q8Input::default();
    let t = best_time(Duration::from_secs(1), || {
        for (packed, scales, mins) in &ws {
            let w = Q4Matrix::new(black_box(packed), scales, mins, rows, cols)
                .expect("the bench's blocks fit their shape");
            if integer {
                matmul_q4_q8(w, &x, 1, &mut y, &mut input);
            } else {
                matmul_q4(w, &x, 1, &mut y);
            }
            black_box(&y);
        }
    });
    (bytes * copies) as f64 / t.as_secs_f64()
}
