// The inputs and outputs of gemv.wgsl and gemm.wgsl (prefixed to both, after the weight
// element): the chunk's weights, x, the answer y and the chunk's parameters.

struct Params {
    rows: u32,      // rows in this chunk
    cols_w: u32,    // weight elements per row (columns padded to a multiple of 8)
    t: u32,         // tokens
    block_len: u32, // rows of one sub-block (L)
    row0: u32,      // first row of this chunk in the whole matrix
    per_sub: u32,   // values of one sub-block of the answer
    off: u32,       // this matrix's offset inside a sub-block
    x_stride4: u32, // vec4s per token of x
}

@group(0) @binding(0) var<storage, read> w: array<WElem>;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<uniform> p: Params;
