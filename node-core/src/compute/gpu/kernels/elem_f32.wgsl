// Weight element for f32 shards: one vec4<f32> is four columns.
alias WElem = vec4<f32>;
const X_PER_W: u32 = 1u;

// Columns [4h, 4h + 4) of a weight element (element `c` of row `r`: unused here, the
// compact elements read their block's scale).
fn wcols(wv: WElem, h: u32, r: u32, c: u32) -> vec4<f32> {
    return wv;
}

// Element `c` of a weight row times the matching columns of x (x's token starts at vec4 `xb`),
// component-wise.
fn wdot(wv: WElem, xb: u32, c: u32, r: u32) -> vec4<f32> {
    return wv * x[xb + c];
}
