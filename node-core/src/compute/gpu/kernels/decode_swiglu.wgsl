// Decodes the gate and up projections from the k members' answers and applies SwiGLU:
// act = silu(gate) · up. Prefixed with decoding.wgsl; a member's answer is [gate, up]
// [sub-block][local row].

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

@group(0) @binding(2) var<storage, read_write> act: array<f32>;
@group(0) @binding(3) var<uniform> p: Params;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if i < p.n {
        let g = decoded(i, p.lg, 0u, p.km, p.m, p.member);
        act[i] = g / (1.0 + exp(-g)) * decoded(i, p.lu, p.m * p.lg, p.km, p.m, p.member);
    }
}
