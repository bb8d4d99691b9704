// Decodes one matrix of a stage from the k members' answers (the LM head's logits). Prefixed
// with decoding.wgsl.

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

@group(0) @binding(2) var<storage, read_write> dst: array<f32>;
@group(0) @binding(3) var<uniform> p: Params;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let o = gid.x;
    if o >= p.out {
        return;
    }
    dst[p.dst_off + o] = decoded(o, p.l, p.mat_off, p.km, p.m, p.member);
}
