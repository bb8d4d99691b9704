// Transpose product y (t × cols) += u · W over a row-major matrix chunk, where u is read from
// the member's answer layout [sub-block][matrix][token][local row] (the backward pass of step
// 3). Prefixed with a weight element's file (elem_*.wgsl).
//
// Each invocation owns one weight element's columns for TOKENS tokens of one split of the
// rows; splits write separate partial sums (part z of y), which sum_parts.wgsl adds up.

struct Params {
    rows: u32,      // rows in this chunk
    cols_w: u32,    // weight elements per row
    t: u32,         // tokens
    block_len: u32, // rows of one sub-block (L)
    row0: u32,      // first row of this chunk in the whole matrix
    per_sub: u32,   // values of one sub-block of u
    off: u32,       // this matrix's offset inside a sub-block
    rows_per_split: u32,
}

override TOKENS: u32 = 1u;

@group(0) @binding(0) var<storage, read> w: array<WElem>;
@group(0) @binding(1) var<storage, read> x: array<f32>; // u, named x like every kernel's input
@group(0) @binding(2) var<storage, read_write> y: array<vec4<f32>>;
@group(0) @binding(3) var<uniform> p: Params;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let c = gid.x;
    if c >= p.cols_w {
        return;
    }
    let tok0 = gid.y * TOKENS;
    let first = gid.z * p.rows_per_split;
    let last = min(first + p.rows_per_split, p.rows);
    var acc: array<array<vec4<f32>, X_PER_W>, 4>;
    for (var lr = first; lr < last; lr++) {
        let gr = p.row0 + lr;
        let s = gr / p.block_len;
        let base = s * p.per_sub + p.off + (gr - s * p.block_len);
        let wv = w[lr * p.cols_w + c];
        for (var j = 0u; j < TOKENS; j++) {
            let a = x[base + min(tok0 + j, p.t - 1u) * p.block_len];
            for (var h = 0u; h < X_PER_W; h++) {
                acc[j][h] += a * wcols(wv, h, lr, c);
            }
        }
    }
    let stride = p.cols_w * X_PER_W;
    let part = gid.z * p.t * stride;
    for (var j = 0u; j < TOKENS; j++) {
        let tok = tok0 + j;
        if tok < p.t {
            for (var h = 0u; h < X_PER_W; h++) {
                y[part + tok * stride + X_PER_W * c + h] = acc[j][h];
            }
        }
    }
}
