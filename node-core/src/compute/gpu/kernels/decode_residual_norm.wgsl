// Decodes a projection back to the hidden size from the k members' answers, adds it to the
// residual stream x, and writes the RMSNorm of the new x (with the next norm's gain) to h: one
// workgroup, as the hidden state is one token of a few thousand values at most. Output row
// o = j·L + r is Σ_a coef[j][a] · answer_a[r] (answer a: sub-block a % m of member a / m).

struct Params {
    d: u32,        // hidden size
    km: u32,       // k·m
    m: u32,        // sub-blocks per member
    l: u32,        // sub-block rows
    eps_bits: u32, // eps as f32 bits
    goff: u32,     // first value of the next norm's gain in `gain`
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<storage, read> coef: array<f32>;
@group(0) @binding(1) var<storage, read> ans: array<f32>;
@group(0) @binding(2) var<storage, read_write> x: array<f32>;
@group(0) @binding(3) var<storage, read> gain: array<f32>;
@group(0) @binding(4) var<storage, read_write> h: array<f32>;
@group(0) @binding(5) var<uniform> p: Params;

var<workgroup> red: array<f32, 256>;

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) li: u32) {
    // A member's answer is this one matrix: m sub-blocks of l rows.
    let member = p.m * p.l;
    var s = 0.0;
    for (var o = li; o < p.d; o += 256u) {
        let j = o / p.l;
        let r = o % p.l;
        var acc = 0.0;
        for (var a = 0u; a < p.km; a += 1u) {
            acc += coef[j * p.km + a] * ans[(a / p.m) * member + (a % p.m) * p.l + r];
        }
        let v = x[o] + acc;
        x[o] = v;
        s += v * v;
    }
    red[li] = s;
    workgroupBarrier();
    for (var w = 128u; w > 0u; w >>= 1u) {
        if li < w {
            red[li] += red[li + w];
        }
        workgroupBarrier();
    }
    let inv = inverseSqrt(red[0] / f32(p.d) + bitcast<f32>(p.eps_bits));
    for (var o = li; o < p.d; o += 256u) {
        h[o] = x[o] * inv * gain[p.goff + o];
    }
}
