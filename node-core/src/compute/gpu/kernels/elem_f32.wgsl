// Weight element for f32 shards: one vec4<f32> is four columns.
alias WElem = vec4<f32>;
const X_PER_W: u32 = 1u;

// Columns [4h, 4h + 4) of a weight element.
fn wcols(wv: WElem, h: u32) -> vec4<f32> {
    return wv;
}
