// Causal grouped-query attention of the new token over the cache, one workgroup per query
// head: scores, softmax and the weighted sum of values. Scores go through a scratch buffer, so
// the context is not bounded by workgroup memory. Prefixed with reduce.wgsl.

struct Params {
    heads: u32,
    kv_heads: u32,
    hd: u32,         // head dimension, dividing 256
    q_dim: u32,
    kv_dim: u32,
    max_ctx: u32,
    scale_bits: u32, // 1/sqrt(hd) as f32 bits
    _pad0: u32,
}

struct Step {
    pos: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<storage, read> cache: array<f32>;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@group(0) @binding(3) var<storage, read_write> scores: array<f32>;
@group(0) @binding(4) var<uniform> p: Params;
@group(0) @binding(5) var<uniform> step: Step;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let h = wg.x;
    let kvh = h / (p.heads / p.kv_heads);
    let n = step.pos + 1u;
    let q0 = h * p.hd;
    let k0 = kvh * p.hd;
    let s0 = h * p.max_ctx;
    let scale = bitcast<f32>(p.scale_bits);
    var mx = -3.0e38;
    for (var t = li; t < n; t += 256u) {
        var s = 0.0;
        for (var d = 0u; d < p.hd; d += 1u) {
            s += q[q0 + d] * cache[t * p.kv_dim + k0 + d];
        }
        s *= scale;
        scores[s0 + t] = s;
        mx = max(mx, s);
    }
    let top = reduce_max(li, mx);
    var sum = 0.0;
    for (var t = li; t < n; t += 256u) {
        let e = exp(scores[s0 + t] - top);
        scores[s0 + t] = e;
        sum += e;
    }
    let total = reduce_sum(li, sum);
    storageBarrier();
    // Each value column d is summed by 256 / hd invocations over interleaved positions.
    let parts = 256u / p.hd;
    let d = li % p.hd;
    let part = li / p.hd;
    let v0 = p.max_ctx * p.kv_dim + k0 + d;
    var acc = 0.0;
    for (var t = part; t < n; t += parts) {
        acc += scores[s0 + t] * cache[v0 + t * p.kv_dim];
    }
    red[li] = acc;
    workgroupBarrier();
    if part == 0u {
        var o = 0.0;
        for (var q = 0u; q < parts; q += 1u) {
            o += red[q * p.hd + d];
        }
        out[q0 + d] = o / total;
    }
}
