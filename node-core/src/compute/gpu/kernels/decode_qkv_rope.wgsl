// Decodes the new token's query, key and value from the k members' answers, applies RoPE to
// the query and key heads (adjacent pairs, GGML's normal layout) and appends the key and value
// to the layer's cache at the token's position. One invocation per query pair, key pair and
// value. Prefixed with decoding.wgsl; a member's answer is [q, k, v][sub-block][local row].

struct Params {
    heads: u32,
    kv_heads: u32,
    hd: u32,      // head dimension
    q_dim: u32,   // heads · hd
    kv_dim: u32,  // kv_heads · hd
    max_ctx: u32, // positions the cache holds; values start at max_ctx · kv_dim
    km: u32,      // k·m
    m: u32,       // sub-blocks per member
    member: u32,  // values of one member's answer
    lq: u32,      // sub-block rows of q, k and v
    lk: u32,
    lv: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
    _pad3: u32,
}

struct Step {
    pos: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(2) var<storage, read> table: array<vec2<f32>>; // [pos][pair]: (cos, sin)
@group(0) @binding(3) var<storage, read_write> q: array<f32>;
@group(0) @binding(4) var<storage, read_write> cache: array<f32>;
@group(0) @binding(5) var<uniform> p: Params;
@group(0) @binding(6) var<uniform> step: Step;

fn rotated(o: u32, l: u32, off: u32, pair: u32) -> vec2<f32> {
    let cs = table[step.pos * (p.hd / 2u) + pair];
    let a = decoded(o, l, off, p.km, p.m, p.member);
    let b = decoded(o + 1u, l, off, p.km, p.m, p.member);
    return vec2<f32>(a * cs.x - b * cs.y, a * cs.y + b * cs.x);
}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    let half = p.hd / 2u;
    let q_pairs = p.heads * half;
    let k_pairs = p.kv_heads * half;
    let off_k = p.m * p.lq;
    let off_v = off_k + p.m * p.lk;
    if i < q_pairs {
        let e = i % half;
        let o = (i / half) * p.hd + 2u * e;
        let r = rotated(o, p.lq, 0u, e);
        q[o] = r.x;
        q[o + 1u] = r.y;
    } else if i < q_pairs + k_pairs {
        let j = i - q_pairs;
        let e = j % half;
        let o = (j / half) * p.hd + 2u * e;
        let r = rotated(o, p.lk, off_k, e);
        let at = step.pos * p.kv_dim + o;
        cache[at] = r.x;
        cache[at + 1u] = r.y;
    } else if i < q_pairs + k_pairs + p.kv_dim {
        let v = i - q_pairs - k_pairs;
        cache[p.max_ctx * p.kv_dim + step.pos * p.kv_dim + v] = decoded(v, p.lv, off_v, p.km, p.m, p.member);
    }
}
