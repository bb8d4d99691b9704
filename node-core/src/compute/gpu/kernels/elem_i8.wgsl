// Weight element for compact data rows (i8): one vec4<u32> is sixteen columns, four to a u32
// (little-endian), half of a 32-column block; scales.wgsl reads the block's scale.
alias WElem = vec4<u32>;
const X_PER_W: u32 = 4u;
const W_PER_BLOCK: u32 = 2u;

// The four signed bytes of `v`, as f32.
fn unpack_i8(v: u32) -> vec4<f32> {
    let b = vec4<i32>(
        bitcast<i32>(v << 24u),
        bitcast<i32>(v << 16u),
        bitcast<i32>(v << 8u),
        bitcast<i32>(v),
    );
    return vec4<f32>(b >> vec4<u32>(24u));
}

// Columns [4h, 4h + 4) of element `c` of row `r`.
fn wcols(wv: WElem, h: u32, r: u32, c: u32) -> vec4<f32> {
    return wscale(r, c) * unpack_i8(wv[h]);
}

// Element `c` of row `r` times the matching columns of x (x's token starts at vec4 `xb`),
// component-wise.
fn wdot(wv: WElem, xb: u32, c: u32, r: u32) -> vec4<f32> {
    let i = xb + 4u * c;
    let a = unpack_i8(wv.x) * x[i] + unpack_i8(wv.y) * x[i + 1u] + unpack_i8(wv.z) * x[i + 2u]
        + unpack_i8(wv.w) * x[i + 3u];
    return wscale(r, c) * a;
}
