// dst = src, vec4 at a time with a grid stride: the bandwidth reference of the benchmark.

@group(0) @binding(0) var<storage, read> src: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read_write> dst: array<vec4<f32>>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nw: vec3<u32>) {
    let n = arrayLength(&src);
    let stride = nw.x * 256u;
    for (var i = gid.x; i < n; i += stride) {
        dst[i] = src[i];
    }
}
