// gemv.wgsl for matrices of few rows (a member's shards of a large model: q, o and down hold
// a k-th of a layer's rows): one row a workgroup instead of 32, so the GPU's multiprocessors
// all get work. Prefixed like gemv.wgsl with the weight element and product_io.wgsl.
//
// Every lane strides the row's elements 256 apart with 4 independent loads in flight into 4
// accumulators; the 256 lanes are summed in workgroup memory at the end.

const LANES: u32 = 256u;

var<workgroup> red: array<f32, 256>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let row = wg.x;
    let tok = wg.y;
    let r = min(row, p.rows - 1u);
    let w0 = r * p.cols_w;
    let xb = tok * p.x_stride4;
    var a0 = vec4<f32>();
    var a1 = vec4<f32>();
    var a2 = vec4<f32>();
    var a3 = vec4<f32>();
    var c = li;
    for (; c + 3u * LANES < p.cols_w; c += 4u * LANES) {
        let c1 = c + LANES;
        let c2 = c + 2u * LANES;
        let c3 = c + 3u * LANES;
        let e0 = w[w0 + c];
        let e1 = w[w0 + c1];
        let e2 = w[w0 + c2];
        let e3 = w[w0 + c3];
        a0 += wdot(e0, xb, c, r);
        a1 += wdot(e1, xb, c1, r);
        a2 += wdot(e2, xb, c2, r);
        a3 += wdot(e3, xb, c3, r);
    }
    for (; c < p.cols_w; c += LANES) {
        a0 += wdot(w[w0 + c], xb, c, r);
    }
    red[li] = dot((a0 + a1) + (a2 + a3), vec4<f32>(1.0));
    workgroupBarrier();
    for (var s = LANES / 2u; s > 0u; s >>= 1u) {
        if li < s {
            red[li] += red[li + s];
        }
        workgroupBarrier();
    }
    if li == 0u && row < p.rows {
        let gr = p.row0 + row;
        let s = gr / p.block_len;
        y[s * p.per_sub + p.off + tok * p.block_len + (gr - s * p.block_len)] = red[0];
    }
}
