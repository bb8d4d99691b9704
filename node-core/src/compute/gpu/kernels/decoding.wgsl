// Decoding a coded group's answers (prefixed to the kernels that decode): the k·m × k·m
// coefficients and the answers, laid out member after member, each [matrix][sub-block][local
// row]. Output row o = j·L + r of a matrix is Σ_a coef[j][a] · answer_a[r], answer a being
// sub-block a % m of member a / m.

@group(0) @binding(0) var<storage, read> coef: array<f32>;
@group(0) @binding(1) var<storage, read> ans: array<f32>;

// Row o of the matrix whose sub-blocks have l rows and start at `off` in a member's answer of
// `member` values.
fn decoded(o: u32, l: u32, off: u32, km: u32, m: u32, member: u32) -> f32 {
    let j = o / l;
    let r = o % l;
    var acc = 0.0;
    for (var a = 0u; a < km; a += 1u) {
        acc += coef[j * km + a] * ans[(a / m) * member + off + (a % m) * l + r];
    }
    return acc;
}
