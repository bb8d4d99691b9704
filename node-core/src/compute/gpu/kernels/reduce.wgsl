// Workgroup reductions over 256 invocations (prefixed to the kernels that reduce). Each call
// ends with a barrier, so `red` can be reused at once.

var<workgroup> red: array<f32, 256>;

fn reduce_sum(li: u32, v: f32) -> f32 {
    red[li] = v;
    workgroupBarrier();
    for (var w = 128u; w > 0u; w >>= 1u) {
        if li < w {
            red[li] += red[li + w];
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

fn reduce_max(li: u32, v: f32) -> f32 {
    red[li] = v;
    workgroupBarrier();
    for (var w = 128u; w > 0u; w >>= 1u) {
        if li < w {
            red[li] = max(red[li], red[li + w]);
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}
