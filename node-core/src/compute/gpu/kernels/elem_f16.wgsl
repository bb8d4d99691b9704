// Weight element for f16 shards: one vec4<u32> is eight columns, two halves per u32 (portable:
// unpack2x16float needs no shader-f16 feature and reads at the same bandwidth).
alias WElem = vec4<u32>;
const X_PER_W: u32 = 2u;

// Columns [4h, 4h + 4) of a weight element (element `c` of row `r`: unused here, the
// compact elements read their block's scale).
fn wcols(wv: WElem, h: u32, r: u32, c: u32) -> vec4<f32> {
    if h == 0u {
        return vec4<f32>(unpack2x16float(wv.x), unpack2x16float(wv.y));
    }
    return vec4<f32>(unpack2x16float(wv.z), unpack2x16float(wv.w));
}

// Element `c` of a weight row times the matching columns of x (x's token starts at vec4 `xb`),
// component-wise.
fn wdot(wv: WElem, xb: u32, c: u32, r: u32) -> vec4<f32> {
    let lo = vec4<f32>(unpack2x16float(wv.x), unpack2x16float(wv.y));
    let hi = vec4<f32>(unpack2x16float(wv.z), unpack2x16float(wv.w));
    return lo * x[xb + 2u * c] + hi * x[xb + 2u * c + 1u];
}
