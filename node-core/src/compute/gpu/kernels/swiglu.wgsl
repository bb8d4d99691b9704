// SwiGLU: act = silu(gate) · up, gate and up lying one after the other in `gu`.

struct Params {
    n: u32, // values of the gate (and of the up projection)
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
    _pad3: u32,
    _pad4: u32,
    _pad5: u32,
    _pad6: u32,
}

@group(0) @binding(0) var<storage, read> gu: array<f32>;
@group(0) @binding(1) var<storage, read_write> act: array<f32>;
@group(0) @binding(2) var<uniform> p: Params;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if i < p.n {
        let g = gu[i];
        act[i] = g / (1.0 + exp(-g)) * gu[p.n + i];
    }
}
