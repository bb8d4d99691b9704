// Decodes one matrix of a stage from the k members' answers (the LM head's logits): output
// row o = j·L + r is Σ_a coef[j][a] · answer_a[r], where answer a is sub-block a % m of member
// a / m. The answers lie member after member, each [matrix][sub-block][local row].

struct Params {
    out: u32,     // rows of the matrix
    l: u32,       // rows of one sub-block (L)
    km: u32,      // k·m: decoded blocks and answers
    m: u32,       // sub-blocks per member
    member: u32,  // values of one member's answer
    mat_off: u32, // this matrix's first value inside a member's answer
    dst_off: u32, // first value written in dst
    _pad0: u32,
}

@group(0) @binding(0) var<storage, read> coef: array<f32>;
@group(0) @binding(1) var<storage, read> ans: array<f32>;
@group(0) @binding(2) var<storage, read_write> dst: array<f32>;
@group(0) @binding(3) var<uniform> p: Params;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let o = gid.x;
    if o >= p.out {
        return;
    }
    let j = o / p.l;
    let r = o % p.l;
    var acc = 0.0;
    for (var a = 0u; a < p.km; a += 1u) {
        acc += coef[j * p.km + a] * ans[(a / p.m) * p.member + p.mat_off + (a % p.m) * p.l + r];
    }
    dst[p.dst_off + o] = acc;
}
