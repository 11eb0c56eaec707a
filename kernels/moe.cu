/*
 * moe.cu: routing and combination for the MoE block (batch 1).
 *
 * moe_topk: logits [E] (E <= 1024) -> ids [K] (int), weights [K] (f32), all on the device.
 *   p_e = exp(l_e - max l); top-K by logit (ties: lower index), w_k = p_k / (renorm ? sum_topk p : sum_all p)
 *   (fp32 softmax, renormalized over the K chosen). grid 1, block 32 (one warp): K rounds of a
 *   warp argmax over a shared copy, the winner masked out each round. ids2 (nullable) gets
 *   [2e, 2e+1] per choice: the rows of expert e's gate and up in an interleaved gate/up stack.
 *
 * moe_combine: x[r] += sum_k w_k * ye[k, r] + g * ys[r], g = sigmoid(sg[0]) when sg, else 1
 *   (shared expert gate); ye [K, H] expert outputs, ys [H] shared expert output (ys may be null).
 *   grid ceil(H/256), block 256.
 */
extern "C" __global__ void moe_topk(const float* logits, int E, int K, int renorm, int* ids, float* wout,
                                    int* ids2) {
    __shared__ float ls[1024];
    __shared__ int chosen[64];
    int lane = threadIdx.x;
    float mx = -INFINITY;
    for (int e = lane; e < E; e += 32) {
        ls[e] = logits[e];
        mx = fmaxf(mx, ls[e]);
    }
    mx = warp_max(mx);
    float tot = 0.f;
    for (int e = lane; e < E; e += 32) tot += expf(ls[e] - mx);
    tot = warp_sum(tot);
    __syncwarp();
    for (int k = 0; k < K; k++) {
        float bv = -INFINITY;
        int bi = 0x7fffffff;
        for (int e = lane; e < E; e += 32) {
            float v = ls[e];
            if (v > bv || (v == bv && e < bi)) { bv = v; bi = e; }
        }
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        if (bi == 0x7fffffff) bi = 0;
        if (lane == 0) {
            chosen[k] = bi;
            ls[bi] = -INFINITY;
        }
        __syncwarp();
    }
    if (lane == 0) {
        float sel = 0.f;
        for (int k = 0; k < K; k++) sel += expf(logits[chosen[k]] - mx);
        float den = renorm ? sel : tot;
        for (int k = 0; k < K; k++) {
            ids[k] = chosen[k];
            wout[k] = expf(logits[chosen[k]] - mx) / den;
            if (ids2) {
                ids2[2 * k] = 2 * chosen[k];
                ids2[2 * k + 1] = 2 * chosen[k] + 1;
            }
        }
    }
}

extern "C" __global__ void moe_combine(float* x, const float* ye, const float* w, const float* ys, const float* sg,
                                       int H, int K) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= H) return;
    float acc = 0.f;
    if (ys) acc = (sg ? sigmoid_f(sg[0]) : 1.f) * ys[r];
    for (int k = 0; k < K; k++) acc += w[k] * ye[(long long)k * H + r];
    x[r] += acc;
}
