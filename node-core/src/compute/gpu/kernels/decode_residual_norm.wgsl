// Decodes a projection back to the hidden size from the k members' answers, adds it to the
// residual stream x, and writes the RMSNorm of the new x (with the next norm's gain) to h: one
// workgroup, as the hidden state is one token of a few thousand values at most. Prefixed with
// decoding.wgsl and reduce.wgsl.

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

@group(0) @binding(2) var<storage, read_write> x: array<f32>;
@group(0) @binding(3) var<storage, read> gain: array<f32>;
@group(0) @binding(4) var<storage, read_write> h: array<f32>;
@group(0) @binding(5) var<uniform> p: Params;

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) li: u32) {
    // A member's answer is this one matrix: m sub-blocks of l rows.
    let member = p.m * p.l;
    var s = 0.0;
    for (var o = li; o < p.d; o += 256u) {
        let v = x[o] + decoded(o, p.l, 0u, p.km, p.m, member);
        x[o] = v;
        s += v * v;
    }
    let inv = inverseSqrt(reduce_sum(li, s) / f32(p.d) + bitcast<f32>(p.eps_bits));
    for (var o = li; o < p.d; o += 256u) {
        h[o] = x[o] * inv * gain[p.goff + o];
    }
}
