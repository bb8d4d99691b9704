// Shard product y = x · Wᵀ for one token (GEMV: decode) over a row-major matrix chunk, written
// straight into the member's answer layout [sub-block][matrix][token][local row]. Prefixed with
// elem_f32.wgsl, elem_f16.wgsl, elem_i8.wgsl or elem_i16.wgsl (with scales.wgsl), which define
// the weight element WElem and wdot, and with
// product_io.wgsl. Several tokens are separate workgroup rows (grid y), each reading the
// weights again.
//
// Bandwidth comes from loads in flight: a workgroup is 8 groups of 32 lanes, each group owns
// 4 rows, and every lane issues 2 elements × 4 rows = 8 independent loads per step into 4
// separate vec4 accumulators (no arrays, so nothing spills to local memory). Lanes are summed
// in workgroup memory at the end.

const LANES: u32 = 32u;
const GROUPS: u32 = 8u;

var<workgroup> red: array<f32, 1024>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let lane = li % LANES;
    let grp = li / LANES;
    let row_base = (wg.x * GROUPS + grp) * 4u;
    let tok = wg.y;
    let last = p.rows - 1u;
    let r0 = min(row_base, last);
    let r1 = min(row_base + 1u, last);
    let r2 = min(row_base + 2u, last);
    let r3 = min(row_base + 3u, last);
    let w0 = r0 * p.cols_w;
    let w1 = r1 * p.cols_w;
    let w2 = r2 * p.cols_w;
    let w3 = r3 * p.cols_w;
    let xb = tok * p.x_stride4;
    var a0 = vec4<f32>();
    var a1 = vec4<f32>();
    var a2 = vec4<f32>();
    var a3 = vec4<f32>();
    var c = lane;
    for (; c + LANES < p.cols_w; c += 2u * LANES) {
        let d = c + LANES;
        let e0 = w[w0 + c];
        let e1 = w[w1 + c];
        let e2 = w[w2 + c];
        let e3 = w[w3 + c];
        let f0 = w[w0 + d];
        let f1 = w[w1 + d];
        let f2 = w[w2 + d];
        let f3 = w[w3 + d];
        a0 += wdot(e0, xb, c, r0) + wdot(f0, xb, d, r0);
        a1 += wdot(e1, xb, c, r1) + wdot(f1, xb, d, r1);
        a2 += wdot(e2, xb, c, r2) + wdot(f2, xb, d, r2);
        a3 += wdot(e3, xb, c, r3) + wdot(f3, xb, d, r3);
    }
    if c < p.cols_w {
        a0 += wdot(w[w0 + c], xb, c, r0);
        a1 += wdot(w[w1 + c], xb, c, r1);
        a2 += wdot(w[w2 + c], xb, c, r2);
        a3 += wdot(w[w3 + c], xb, c, r3);
    }
    let one = vec4<f32>(1.0);
    let base = grp * 128u + lane;
    red[base] = dot(a0, one);
    red[base + 32u] = dot(a1, one);
    red[base + 64u] = dot(a2, one);
    red[base + 96u] = dot(a3, one);
    workgroupBarrier();
    for (var s = LANES / 2u; s > 0u; s >>= 1u) {
        if lane < s {
            red[base] += red[base + s];
            red[base + 32u] += red[base + 32u + s];
            red[base + 64u] += red[base + 64u + s];
            red[base + 96u] += red[base + 96u + s];
        }
        workgroupBarrier();
    }
    let row = row_base + lane;
    if lane < 4u && row < p.rows {
        let gr = p.row0 + row;
        let s = gr / p.block_len;
        y[s * p.per_sub + p.off + tok * p.block_len + (gr - s * p.block_len)] =
            red[grp * 128u + lane * 32u];
    }
}
