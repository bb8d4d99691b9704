use super::*;
use proptest::prelude::*;

fn random(n: usize, seed: u64) -> Vec<f32> {
    use rand::Rng;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// `W·x` in f64 (the exact reference) and in f32 (the uncoded computation).
fn products(w: &[f32], out: usize, inp: usize, x: &[f32]) -> (Vec<f64>, Vec<f32>) {
    let exact = (0..out)
        .map(|r| (0..inp).map(|c| w[r * inp + c] as f64 * x[c] as f64).sum())
        .collect();
    let mut f32s = vec![0.0f32; out];
    crate::compute::matmul(w, out, inp, x, 1, &mut f32s);
    (exact, f32s)
}

/// Encodes, multiplies each shard by `x` in f32, decodes from `nodes`, trims the padding.
fn coded_product(
    g: &Generator,
    w: &[f32],
    out: usize,
    inp: usize,
    x: &[f32],
    nodes: &[usize],
) -> Vec<f32> {
    let rows = g.shard_rows(out);
    let parts: Vec<Vec<f32>> = nodes
        .iter()
        .map(|&node| {
            let shard = g.encode_shard(node, w, out, inp).unwrap();
            let mut z = vec![0.0f32; rows];
            crate::compute::matmul(&shard, rows, inp, x, 1, &mut z);
            z
        })
        .collect();
    let refs: Vec<&[f32]> = parts.iter().map(Vec::as_slice).collect();
    let mut y = vec![0.0f32; g.padded_rows(out)];
    Decoder::new(g, nodes)
        .unwrap()
        .decode(&refs, &mut y)
        .unwrap();
    // With t = 1, block j of the decode is rows j·L .. (j+1)·L of W·x.
    y.truncate(out);
    y
}

#[test]
fn uncoded_decode_is_bit_exact() {
    let (out, inp) = (37, 29);
    let w = random(out * inp, 1);
    let x = random(inp, 2);
    let g = Generator::uncoded();
    let (_, plain) = products(&w, out, inp, &x);
    assert_eq!(coded_product(&g, &w, out, inp, &x, &[0]), plain);
}

#[test]
fn complex_cauchy_groups_are_well_conditioned() {
    // Measured (docs/coding.md): the worst group of k = 3 of n = 5 has κ ≈ 3.6.
    let g = Generator::cauchy(5, 3).unwrap();
    assert_eq!(g.sub_blocks(), 2);
    for a in 0..5 {
        for b in a + 1..5 {
            for c in b + 1..5 {
                let kappa = g.condition_number(&[a, b, c]).unwrap();
                assert!(kappa < 5.0, "κ of {:?} = {kappa}", [a, b, c]);
            }
        }
    }
    let sel = select_nodes(&g, &[0, 1, 2, 3, 4]).unwrap();
    assert_eq!(sel.nodes.len(), 3);
    assert!(sel.condition_number <= g.condition_number(&[0, 1, 2]).unwrap());
}

#[test]
fn predicted_parts_equal_the_answers() {
    let g = Generator::cauchy(6, 3).unwrap();
    let (out, inp) = (30, 8);
    let w = random(out * inp, 3);
    let x = random(inp, 4);
    let y = coded_product(&g, &w, out, inp, &x, &[0, 2, 4]);
    let mut blocks = y.clone();
    blocks.resize(g.padded_rows(out), 0.0);
    let shard = g.encode_shard(5, &w, out, inp).unwrap();
    let mut z = vec![0.0f32; g.shard_rows(out)];
    crate::compute::matmul(&shard, g.shard_rows(out), inp, &x, 1, &mut z);
    let mut predicted = vec![0.0f32; z.len()];
    g.predict_part(5, &blocks, &mut predicted).unwrap();
    for (p, a) in predicted.iter().zip(&z) {
        assert!((p - a).abs() < 1e-4, "{p} vs {a}");
    }
}

#[test]
fn bad_arguments_are_errors() {
    assert!(Generator::cauchy(2, 3).is_err());
    assert!(Generator::cauchy(3, 0).is_err());
    assert!(Generator::cauchy(MAX_NODES + 1, 2).is_err());
    let g = Generator::cauchy(5, 3).unwrap();
    assert!(Decoder::new(&g, &[0, 1]).is_err());
    assert!(Decoder::new(&g, &[0, 1, 1]).is_err());
    assert!(Decoder::new(&g, &[0, 1, 2, 3]).is_err());
    assert!(Decoder::new(&g, &[0, 1, 9]).is_err());
    assert!(g.encode_shard(0, &[1.0; 5], 2, 3).is_err());
    assert!(g.encode_shard(7, &[1.0; 6], 2, 3).is_err());
    let d = Decoder::new(&g, &[0, 1, 2]).unwrap();
    let part = vec![0.0f32; 4];
    let mut out = vec![0.0f32; 12];
    assert!(d.decode(&[&part, &part], &mut out).is_err());
    assert!(d.decode(&[&part, &part, &part[..3]], &mut out).is_err());
    assert!(select_nodes(&g, &[0, 1]).is_err());
}

#[test]
fn greedy_selection_finds_a_good_group_among_many() {
    let g = Generator::new(Construction::Gaussian { seed: 9 }, 64, 8).unwrap();
    let all: Vec<usize> = (0..64).collect();
    let sel = select_nodes(&g, &all).unwrap();
    assert_eq!(sel.nodes.len(), 8);
    // DESIGN.md: greedy selection over many spare rows keeps κ around 30 or below.
    assert!(sel.condition_number < 100.0, "κ = {}", sel.condition_number);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    /// decode(shard products) ≈ W·x within 1e-6·κ + 1e-6 relative (f64 truth). DESIGN.md
    /// measured ~1e-7·κ for the decode plus ~2e-7 for f32 products; 10× margin on both.
    #[test]
    fn any_k_of_n_decodes_within_the_conditioned_bound(
        k in 1usize..=8,
        extra in 0usize..=8,
        out in 1usize..70,
        inp in 1usize..40,
        seed in any::<u64>(),
        pick in any::<u64>(),
    ) {
        let n = k + extra.min(k);
        let g = Generator::cauchy(n, k).unwrap();
        let w = random(out * inp, seed);
        let x = random(inp, seed ^ 0xabcdef);
        // A random k-subset of the n nodes.
        let mut nodes: Vec<usize> = (0..n).collect();
        let mut state = pick;
        for i in (1..n).rev() {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            nodes.swap(i, (state >> 33) as usize % (i + 1));
        }
        nodes.truncate(k);
        let kappa = g.condition_number(&nodes).unwrap();
        let (exact, _) = products(&w, out, inp, &x);
        // Rounding error scales with Σ|w||x|, not with |W·x|, which cancellation can make
        // arbitrarily small (one output row of a few terms): measure against the former.
        let scale: f64 = (0..out)
            .map(|r| {
                let s: f64 = (0..inp).map(|c| (w[r * inp + c] as f64 * x[c] as f64).abs()).sum();
                s * s
            })
            .sum::<f64>()
            .sqrt();
        let y = coded_product(&g, &w, out, inp, &x, &nodes);
        let err = y
            .iter()
            .zip(&exact)
            .map(|(&a, &e)| (a as f64 - e).powi(2))
            .sum::<f64>()
            .sqrt()
            / scale;
        prop_assert!(err <= 1e-6 * kappa + 1e-6, "k={k} n={n} nodes={nodes:?} κ={kappa:.2} err={err:.3e}");
    }
}

#[test]
fn a_grown_code_keeps_its_genesis_rows_and_every_group_well_conditioned() {
    let (seeded, k) = (5, 3);
    let g = Generator::growing(seeded, k, None).unwrap();
    let plain = Generator::cauchy(seeded, k).unwrap();
    assert_eq!(g.genesis_rows(), seeded);
    assert_eq!(plain.genesis_rows(), seeded);
    assert!(g.n() > seeded, "the default code must have room to grow");
    for row in 0..seeded {
        assert_eq!(g.coeffs(row), plain.coeffs(row), "genesis row {row} moved");
    }
    // Every k of the n rows, not only the ones the selector would pick.
    let worst = subsets(g.n(), k)
        .map(|group| g.condition_number(&group).unwrap())
        .fold(0.0f64, f64::max);
    assert!(worst <= GROWTH_MAX_CONDITION, "worst κ {worst}");
    // A grown row decodes like a genesis row: a group of new rows only.
    let (out, inp) = (36, 20);
    let w = random(out * inp, 3);
    let x = random(inp, 4);
    let (exact, _) = products(&w, out, inp, &x);
    let nodes: Vec<usize> = (g.n() - k..g.n()).collect();
    let y = coded_product(&g, &w, out, inp, &x, &nodes);
    for (a, e) in y.iter().zip(&exact) {
        assert!((*a as f64 - e).abs() < 1e-4, "{a} vs {e}");
    }
}

#[test]
fn growth_stops_at_the_cap_and_the_prefix_is_stable() {
    let small = Generator::growing(5, 3, Some(7)).unwrap();
    let big = Generator::growing(5, 3, None).unwrap();
    assert_eq!(small.n(), 7);
    for row in 0..7 {
        assert_eq!(small.coeffs(row), big.coeffs(row), "row {row}");
    }
    assert_eq!(Generator::growing(5, 3, Some(2)).unwrap().n(), 5);
    assert!(Generator::growing(2, 3, None).is_err());
}

#[test]
fn integer_re_encoding_coefficients_are_the_real_ones_over_one_denominator() {
    for k in 2..=integer::INTEGER_MAX_K {
        let n = Generator::integer_capacity(k);
        let g = Generator::integer(n, k, None).unwrap();
        let mut checked = 0;
        for sources in subsets(n, k).take(40) {
            for target in (0..n).filter(|t| !sources.contains(t)) {
                let (a, d) = g.reencode_integers(target, &sources).unwrap().unwrap();
                assert!(d > 0);
                let real = g.reencode_coeffs(target, &sources).unwrap();
                for (&aj, &c) in a.iter().zip(&real) {
                    assert!((aj as f64 / d as f64 - c).abs() < 1e-9, "k = {k}");
                }
                checked += 1;
            }
        }
        assert!(checked > 0);
    }
    let real = Generator::growing(5, 3, Some(8)).unwrap();
    assert_eq!(real.reencode_integers(6, &[0, 1, 2]).unwrap(), None);
}
