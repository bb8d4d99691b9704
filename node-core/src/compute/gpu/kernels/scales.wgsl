// Block scales of compact weights (prefixed to elem_i8.wgsl and elem_i16.wgsl): a chunk's
// buffer holds its rows × cols_w weight elements, then one f32 scale per row and 32-column
// block, four to an element. W_PER_BLOCK is the elements of one block.

// The scale of row `r` (of the chunk) over the block holding element `c`.
fn wscale(r: u32, c: u32) -> f32 {
    let i = r * (p.cols_w / W_PER_BLOCK) + c / W_PER_BLOCK;
    return bitcast<f32>(w[p.rows * p.cols_w + i / 4u][i % 4u]);
}
