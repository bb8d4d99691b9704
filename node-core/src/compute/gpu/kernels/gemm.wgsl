// Shard product y = x · Wᵀ over a row-major matrix chunk for several tokens (GEMM: prefill),
// written straight into the member's answer layout
// [sub-block][matrix][token][local row]. Prefixed with a weight element's file (elem_*.wgsl),
// which defines the weight element WElem (X_PER_W vec4s of columns) and wcols, and with
// product_io.wgsl.
//
// A workgroup is 8 groups of 32 lanes; each group owns 4 rows and its lanes stride over the
// row's columns, keeping 4 × TOKENS accumulators. Lanes are then summed in workgroup memory.

override TOKENS: u32 = 4u;
const LANES: u32 = 32u;
const GROUPS: u32 = 8u;
const ROWS: u32 = 4u;

var<workgroup> red: array<vec4<f32>, 1024>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) li: u32) {
    let lane = li % LANES;
    let grp = li / LANES;
    let row_base = (wg.x * GROUPS + grp) * ROWS;
    let tok0 = wg.y * TOKENS;
    var acc = array<vec4<f32>, 4>(vec4<f32>(), vec4<f32>(), vec4<f32>(), vec4<f32>());
    var rows: array<u32, 4>;
    for (var r = 0u; r < ROWS; r++) {
        rows[r] = min(row_base + r, p.rows - 1u);
    }
    for (var c = lane; c < p.cols_w; c += LANES) {
        var xv: array<array<vec4<f32>, X_PER_W>, 4>;
        for (var j = 0u; j < TOKENS; j++) {
            let xi = min(tok0 + j, p.t - 1u) * p.x_stride4 + X_PER_W * c;
            for (var h = 0u; h < X_PER_W; h++) {
                xv[j][h] = x[xi + h];
            }
        }
        for (var r = 0u; r < ROWS; r++) {
            let wv = w[rows[r] * p.cols_w + c];
            for (var h = 0u; h < X_PER_W; h++) {
                let wc = wcols(wv, h, rows[r], c);
                for (var j = 0u; j < TOKENS; j++) {
                    acc[r][j] += dot(wc, xv[j][h]);
                }
            }
        }
    }
    for (var r = 0u; r < ROWS; r++) {
        red[(grp * ROWS + r) * LANES + lane] = acc[r];
    }
    workgroupBarrier();
    for (var s = LANES / 2u; s > 0u; s >>= 1u) {
        if lane < s {
            for (var r = 0u; r < ROWS; r++) {
                let i = (grp * ROWS + r) * LANES + lane;
                red[i] += red[i + s];
            }
        }
        workgroupBarrier();
    }
    let row = row_base + lane;
    if lane < ROWS && row < p.rows {
        let v = red[(grp * ROWS + lane) * LANES];
        let gr = p.row0 + row;
        let s = gr / p.block_len;
        let base = s * p.per_sub + p.off + (gr - s * p.block_len);
        for (var j = 0u; j < TOKENS; j++) {
            let tok = tok0 + j;
            if tok < p.t {
                y[base + tok * p.block_len] = v[j];
            }
        }
    }
}
