// RoPE on the new token's query and key heads (adjacent pairs, GGML's normal layout), then
// the rotated key and the value appended to the layer's cache at the token's position.
// One invocation per query pair, key pair and value.

struct Params {
    heads: u32,
    kv_heads: u32,
    hd: u32,      // head dimension
    q_dim: u32,   // heads · hd: the key starts here in qkv
    kv_dim: u32,  // kv_heads · hd
    max_ctx: u32, // positions the cache holds; values start at max_ctx · kv_dim
    _pad0: u32,
    _pad1: u32,
}

struct Step {
    pos: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<storage, read> table: array<vec2<f32>>; // [pos][pair]: (cos, sin)
@group(0) @binding(1) var<storage, read_write> qkv: array<f32>;
@group(0) @binding(2) var<storage, read_write> cache: array<f32>;
@group(0) @binding(3) var<uniform> p: Params;
@group(0) @binding(4) var<uniform> step: Step;

fn rotate(at: u32, pair: u32) -> vec2<f32> {
    let cs = table[step.pos * (p.hd / 2u) + pair];
    let a = qkv[at];
    let b = qkv[at + 1u];
    let r = vec2<f32>(a * cs.x - b * cs.y, a * cs.y + b * cs.x);
    qkv[at] = r.x;
    qkv[at + 1u] = r.y;
    return r;
}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    let half = p.hd / 2u;
    let q_pairs = p.heads * half;
    let k_pairs = p.kv_heads * half;
    if i < q_pairs {
        let head = i / half;
        let e = i % half;
        rotate(head * p.hd + 2u * e, e);
    } else if i < q_pairs + k_pairs {
        let j = i - q_pairs;
        let head = j / half;
        let e = j % half;
        let r = rotate(p.q_dim + head * p.hd + 2u * e, e);
        let at = step.pos * p.kv_dim + head * p.hd + 2u * e;
        cache[at] = r.x;
        cache[at + 1u] = r.y;
    } else if i < q_pairs + k_pairs + p.kv_dim {
        let v = i - q_pairs - k_pairs;
        cache[p.max_ctx * p.kv_dim + step.pos * p.kv_dim + v] = qkv[p.q_dim + p.kv_dim + v];
    }
}
