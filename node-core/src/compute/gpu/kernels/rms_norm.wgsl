// RMSNorm of one row: y = x / sqrt(mean(x²) + eps) · gain, by one workgroup (the leader's
// hidden state is one token of a few thousand values at most). Prefixed with reduce.wgsl.

struct Params {
    d: u32,        // values in the row
    eps_bits: u32, // eps as f32 bits
    goff: u32,     // first value of this layer's gain in `gain`
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
    _pad3: u32,
    _pad4: u32,
}

@group(0) @binding(0) var<storage, read> gain: array<f32>;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<uniform> p: Params;

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) li: u32) {
    var s = 0.0;
    for (var i = li; i < p.d; i += 256u) {
        let v = x[i];
        s += v * v;
    }
    let inv = inverseSqrt(reduce_sum(li, s) / f32(p.d) + bitcast<f32>(p.eps_bits));
    for (var i = li; i < p.d; i += 256u) {
        y[i] = x[i] * inv * gain[p.goff + i];
    }
}
