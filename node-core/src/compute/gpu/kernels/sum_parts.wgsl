// y[i] += Σ_z parts[z·n + i]: adds the split partial sums of matmul_t.wgsl into the result.

struct Params {
    n: u32,     // vec4s in one part
    parts: u32, // number of parts
}

@group(0) @binding(0) var<storage, read> parts: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read_write> y: array<vec4<f32>>;
@group(0) @binding(2) var<uniform> p: Params;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x + gid.y * 65535u * 256u;
    if i >= p.n {
        return;
    }
    var acc = y[i];
    for (var z = 0u; z < p.parts; z++) {
        acc += parts[z * p.n + i];
    }
    y[i] = acc;
}
