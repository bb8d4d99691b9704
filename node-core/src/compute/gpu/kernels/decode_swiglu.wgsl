// Decodes the gate and up projections from the k members' answers and applies SwiGLU:
// act = silu(gate) · up. The answers lie member after member, each [gate, up][sub-block][local
// row]; output row o = j·L + r is Σ_a coef[j][a] · answer_a[r] (answer a: sub-block a % m of
// member a / m).

struct Params {
    n: u32,      // rows of the gate (and of the up projection)
    km: u32,     // k·m
    m: u32,      // sub-blocks per member
    member: u32, // values of one member's answer
    lg: u32,     // sub-block rows of the gate and of the up projection
    lu: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<storage, read> coef: array<f32>;
@group(0) @binding(1) var<storage, read> ans: array<f32>;
@group(0) @binding(2) var<storage, read_write> act: array<f32>;
@group(0) @binding(3) var<uniform> p: Params;

fn decoded(o: u32, l: u32, off: u32) -> f32 {
    let j = o / l;
    let r = o % l;
    var acc = 0.0;
    for (var a = 0u; a < p.km; a += 1u) {
        acc += coef[j * p.km + a] * ans[(a / p.m) * p.member + off + (a % p.m) * l + r];
    }
    return acc;
}

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if i < p.n {
        let g = decoded(i, p.lg, 0u);
        act[i] = g / (1.0 + exp(-g)) * decoded(i, p.lu, p.m * p.lg);
    }
}
