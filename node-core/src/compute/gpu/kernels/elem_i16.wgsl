// Weight element for compact parity rows (i16): one vec4<u32> is eight columns, two to a u32
// (little-endian), a quarter of a 32-column block; scales.wgsl reads the block's scale.
alias WElem = vec4<u32>;
const X_PER_W: u32 = 2u;
const W_PER_BLOCK: u32 = 4u;

// The two signed halves of `v`, as f32.
fn unpack_i16(v: u32) -> vec2<f32> {
    return vec2<f32>(f32(bitcast<i32>(v << 16u) >> 16u), f32(bitcast<i32>(v) >> 16u));
}

// Columns [4h, 4h + 4) of element `c` of row `r`.
fn wcols(wv: WElem, h: u32, r: u32, c: u32) -> vec4<f32> {
    if h == 0u {
        return wscale(r, c) * vec4<f32>(unpack_i16(wv.x), unpack_i16(wv.y));
    }
    return wscale(r, c) * vec4<f32>(unpack_i16(wv.z), unpack_i16(wv.w));
}

// Element `c` of row `r` times the matching columns of x (x's token starts at vec4 `xb`),
// component-wise.
fn wdot(wv: WElem, xb: u32, c: u32, r: u32) -> vec4<f32> {
    let lo = vec4<f32>(unpack_i16(wv.x), unpack_i16(wv.y));
    let hi = vec4<f32>(unpack_i16(wv.z), unpack_i16(wv.w));
    return wscale(r, c) * (lo * x[xb + 2u * c] + hi * x[xb + 2u * c + 1u]);
}
