/*
 * linear.cu: weight products for MLX affine 4/8-bit and dense f32/f16/bf16 weights.
 *
 * Weight W [rows_total, cols] (PyTorch [out, in]). MLX affine: packed u32 [rows_total, cols*bits/32]
 * (element j of a word = (w >> bits*j) & mask, little-endian along the row), scales/biases
 * [rows_total, cols/group] of type `ty`; W[r, c] = s[r, c/g] * q[r, c] + b[r, c/g].
 * Dense: W row-major of type `ty`, bits = 0.
 *
 * linear_gemv: for every slot z (grid.y), e = ids ? ids[z] : 0 (read on the device: MoE experts
 *   need no host sync), y[z*rows + r] (+)= sum_c W[e*rows + r, c] * xn[c], xn = x[z*xstride + :],
 *   or, when normw is set, the fused RMSNorm xn[c] = x[c] * normw[c] * rsqrt(mean(x^2) + eps)
 *   (rms_norm's result up to rounding order).
 *   Quantized rows use the affine identity per 128-bit load (32 4-bit or 16 8-bit codes, always
 *   inside one group since group >= 32): s * sum(q x) + b * sum(x).
 *   Geometry: block 256 = 8 warps, each warp owns 4 consecutive output rows (GEMV_NR), grid
 *   (ceil(rows/32), slots). With the fused norm the block first stages xn in dynamic shared
 *   memory (cols floats, cols <= 8192, cols % 4 == 0); otherwise x is read from global memory. Lanes stride the rows in
 *   uint4 loads (16 B, a warp reads 512 contiguous bytes of each row per step), two steps' loads
 *   for all 4 rows issued together (8 x 16 B in flight per lane); the x chunk is read once per
 *   step for all 4 rows.
 *   Requires cols % 32 == 0 for quantized weights (true: cols is a multiple of the group) and
 *   x + z*xstride 16-byte aligned (x is read as float4). With xdiv > 1 slot z reads row z / xdiv.
 *   accumulate != 0 adds into y (residual connections).
 *
 * moe_down (decode): the routed experts' down projections, the shared expert's (as slot K when
 *   stacked with them), their weighted sum and the residual add, in one kernel:
 *   x[r] += sum_{k < S} w[k] * (W[ids[k]*rows + r, :] . h_k),  h_k[i] = silu(gu[2k, i]) * gu[2k+1, i]
 *   (gu [2S, I]: the gate/up GEMV output of the S slots). The block stages all h_k in shared
 *   memory (S*I <= 8192, I % 4 == 0). A warp owns two rows; lanes take the (row, slot, uint4) items in turn,
 *   four items' loads issued together. grid ceil(rows/16), block 256.
 *
 * embed_row: out[t, c] = W[row[t], c] dequantized (embedding gather; the token ids are read from
 *   device memory so a captured CUDA graph can replay it), grid (ceil(cols/256), tokens), block 256.
 *
 * Many-token products (prefill) are in gemm.cu.
 */
__device__ __forceinline__ float dequant_elem(const void* w, const void* sc, const void* bi, int bits, int group,
                                              int ty, long long r, int cols, int c) {
    if (bits == 0) return load_elem(w, r * cols + c, ty);
    int per = 32 / bits;
    long long wpr = (long long)cols / per;
    u32 word = ((const u32*)w)[r * wpr + c / per];
    u32 q = (word >> (bits * (c % per))) & ((1u << bits) - 1u);
    long long gi = r * (cols / group) + c / group;
    return load_elem(sc, gi, ty) * (float)q + load_elem(bi, gi, ty);
}

/* The affine dot of one 128-bit load of quantized codes with the x chunk at c0 (EPV values). */
template <int BITS>
__device__ __forceinline__ float quant_chunk(uint4 q4, const float* xr, float sx, float s, float b) {
    constexpr int PER = 32 / BITS;
    constexpr u32 MASK = (1u << BITS) - 1u;
    u32 words[4] = {q4.x, q4.y, q4.z, q4.w};
    float qx = 0.f;
#pragma unroll
    for (int k = 0; k < 4; k++)
#pragma unroll
        for (int j = 0; j < PER; j++) qx += (float)((words[k] >> (BITS * j)) & MASK) * xr[k * PER + j];
    return s * qx + b * sx;
}

/* Loads the EPV x values of chunk i (and their sum). */
template <int EPV>
__device__ __forceinline__ float x_chunk(const float* xs, int c0, float* xr) {
    const float4* xv = (const float4*)(xs + c0);
#pragma unroll
    for (int j = 0; j < EPV / 4; j++) {
        float4 x4 = xv[j];
        xr[4 * j] = x4.x;
        xr[4 * j + 1] = x4.y;
        xr[4 * j + 2] = x4.z;
        xr[4 * j + 3] = x4.w;
    }
    float sx = 0.f;
#pragma unroll
    for (int j = 0; j < EPV; j++) sx += xr[j];
    return sx;
}

/* One trip of the GEMV loop: the 128-bit loads of steps i0 and i0 + 32 for NR rows. */
template <int NR>
__device__ __forceinline__ void quant_trip_load(const u32* w, long long R0, int nvalid, long long wpr, int n4, int i0,
                                                uint4 (&q4)[2][NR]) {
#pragma unroll
    for (int r = 0; r < NR; r++) {
        if (r < nvalid) {
            const uint4* row = (const uint4*)(w + (R0 + r) * wpr);
            if (i0 < n4) q4[0][r] = row[i0];
            if (i0 + 32 < n4) q4[1][r] = row[i0 + 32];
        }
    }
}

template <int BITS, int NR>
__device__ __forceinline__ void quant_trip_dot(const uint4 (&q4)[2][NR], long long R0, int nvalid, int n4, int i0,
                                               const void* sc, const void* bi, int ng, int group, int ty,
                                               const float* xs, float* acc) {
    constexpr int EPV = 4 * (32 / BITS);
#pragma unroll
    for (int u = 0; u < 2; u++) {
        int i = i0 + 32 * u;
        if (i < n4) { /* a guard, not a break: the loop must unroll so q4 stays in registers */
            int c0 = i * EPV, gi = c0 / group;
            float xr[EPV];
            float sx = x_chunk<EPV>(xs, c0, xr);
#pragma unroll
            for (int r = 0; r < NR; r++) {
                if (r < nvalid) {
                    long long g = (R0 + r) * ng + gi;
                    acc[r] += quant_chunk<BITS>(q4[u][r], xr, sx, load_elem(sc, g, ty), load_elem(bi, g, ty));
                }
            }
        }
    }
}

/* Stages x (optionally RMS-normalized: x * normw * rsqrt(mean(x^2) + eps)) in shared memory, in
   passes of 4 float4 per thread (few registers: the caller holds its first weight loads). */
__device__ __forceinline__ const float* gemv_stage_x(const float* xg, int cols, const float* normw, float eps,
                                                     float* xsh, float* red) {
    int n4 = cols >> 2;
    const float4* x4 = (const float4*)xg;
    const float4* w4 = (const float4*)normw;
    float4* s4 = (float4*)xsh;
    float ss = 0.f;
    for (int base = threadIdx.x; base < n4; base += 4 * blockDim.x) {
        float4 v[4], nw[4];
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int i = base + j * blockDim.x;
            if (i < n4) {
                v[j] = x4[i];
                nw[j] = w4[i];
            }
        }
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int i = base + j * blockDim.x;
            if (i < n4) {
                ss += v[j].x * v[j].x + v[j].y * v[j].y + v[j].z * v[j].z + v[j].w * v[j].w;
                s4[i] = make_float4(v[j].x * nw[j].x, v[j].y * nw[j].y, v[j].z * nw[j].z, v[j].w * nw[j].w);
            }
        }
    }
    ss = block_sum(ss, red); /* synchronizes the block */
    float rr = 1.f / sqrtf(ss / (float)cols + eps);
    for (int i = threadIdx.x; i < n4; i += blockDim.x) { /* the thread's own entries */
        float4 o = s4[i];
        s4[i] = make_float4(o.x * rr, o.y * rr, o.z * rr, o.w * rr);
    }
    __syncthreads();
    return xsh;
}

#define GEMV_NR 4
#define GEMV_XMAX 8192
/* The first trip's weight loads are issued before x is staged, so the staging (and the fused
   norm) overlap the first memory round trip. */
template <int BITS>
__device__ __forceinline__ void gemv_body(const void* w, const void* sc, const void* bi, int group, int ty,
                                          const float* xg, float* y, int rows, int cols, long long R0, int r0,
                                          int nvalid, int accumulate, const float* normw, float eps, float* xsh,
                                          float* red) {
    int lane = threadIdx.x & 31;
    float acc[GEMV_NR];
#pragma unroll
    for (int r = 0; r < GEMV_NR; r++) acc[r] = 0.f;
    if (BITS == 0) {
        const float* xs = normw ? gemv_stage_x(xg, cols, normw, eps, xsh, red) : xg;
        if (nvalid == 0) return;
        for (int r = 0; r < nvalid; r++)
            for (int c = lane; c < cols; c += 32) acc[r] += load_elem(w, (R0 + r) * cols + c, ty) * xs[c];
    } else {
        long long wpr = (long long)cols * BITS / 32; /* u32 words per row */
        int n4 = (int)(wpr / 4), ng = cols / group;
        uint4 q4[2][GEMV_NR];
        quant_trip_load<GEMV_NR>((const u32*)w, R0, nvalid, wpr, n4, lane, q4);
        const float* xs = normw ? gemv_stage_x(xg, cols, normw, eps, xsh, red) : xg;
        if (nvalid == 0) return;
        quant_trip_dot<BITS == 0 ? 4 : BITS, GEMV_NR>(q4, R0, nvalid, n4, lane, sc, bi, ng, group, ty, xs, acc);
        for (int i0 = lane + 64; i0 < n4; i0 += 64) {
            quant_trip_load<GEMV_NR>((const u32*)w, R0, nvalid, wpr, n4, i0, q4);
            quant_trip_dot<BITS == 0 ? 4 : BITS, GEMV_NR>(q4, R0, nvalid, n4, i0, sc, bi, ng, group, ty, xs, acc);
        }
    }
#pragma unroll
    for (int r = 0; r < GEMV_NR; r++) {
        float a = warp_sum(acc[r]);
        if (lane == 0 && r < nvalid) {
            float* o = y + r0 + r;
            *o = accumulate ? *o + a : a;
        }
    }
}

extern "C" __global__ void __launch_bounds__(256, 2) linear_gemv(GemvParams_fields) {
    pdl_begin();
    extern __shared__ __align__(16) float xsh[]; /* cols floats (dynamic, 0 when cols > GEMV_XMAX) */
    __shared__ float red[33];
    int warp = threadIdx.x >> 5;
    int z = blockIdx.y;
    int r0 = (blockIdx.x * (blockDim.x >> 5) + warp) * GEMV_NR;
    int nvalid = r0 < rows ? min(GEMV_NR, rows - r0) : 0;
    long long R0 = (long long)(ids ? ids[z] : 0) * rows + min(r0, rows - 1);
    const float* xg = x + (long long)(z / xdiv) * xstride;
    float* yz = y + (long long)z * rows;
    if (bits == 4)
        gemv_body<4>(w, sc, bi, group, ty, xg, yz, rows, cols, R0, r0, nvalid, accumulate, normw, eps, xsh, red);
    else if (bits == 8)
        gemv_body<8>(w, sc, bi, group, ty, xg, yz, rows, cols, R0, r0, nvalid, accumulate, normw, eps, xsh, red);
    else
        gemv_body<0>(w, sc, bi, group, ty, xg, yz, rows, cols, R0, r0, nvalid, accumulate, normw, eps, xsh, red);
}

/* Two rows per warp (r0, r0 + 1): the items (row, slot, 128-bit load) are taken by the lanes in
   turn, four items' loads issued together. */
#define MOE_DOWN_NR 2
template <int BITS>
__device__ __forceinline__ void moe_down_rows(const u32* w, const void* sc, const void* bi, int group, int ty,
                                              const int* ids, const float* wts, int S, int rows, int r0, int nvalid,
                                              int cols, const float* hs, int lane, float* acc) {
    constexpr int EPV = 4 * (32 / BITS);
    long long wpr = (long long)cols * BITS / 32;
    int n4 = (int)(wpr / 4), ng = cols / group;
    int per_row = S * n4, items = nvalid * per_row;
    for (int i0 = lane; i0 < items; i0 += 128) {
        uint4 q4[4];
        long long rowi[4];
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int it = i0 + 32 * u;
            if (it < items) {
                int rr = it / per_row, rem = it - rr * per_row, k = rem / n4, i = rem - k * n4;
                rowi[u] = (long long)ids[k] * rows + r0 + rr;
                q4[u] = ((const uint4*)(w + rowi[u] * wpr))[i];
            }
        }
#pragma unroll
        for (int u = 0; u < 4; u++) {
            int it = i0 + 32 * u;
            if (it < items) {
                int rr = it / per_row, rem = it - rr * per_row, k = rem / n4, i = rem - k * n4;
                int c0 = i * EPV;
                float xr[EPV];
                float sx = x_chunk<EPV>(hs + k * cols, c0, xr);
                long long g = rowi[u] * ng + c0 / group;
                float v = wts[k] * quant_chunk<BITS>(q4[u], xr, sx, load_elem(sc, g, ty), load_elem(bi, g, ty));
                if (rr == 0) acc[0] += v;
                else acc[1] += v;
            }
        }
    }
}

extern "C" __global__ void moe_down(MoeDownParams_fields) {
    pdl_begin();
    extern __shared__ __align__(16) float hs[]; /* S*cols floats (dynamic) */
    {
        /* float4 items, all of a thread's loads (at most 8 gate + 8 up) issued in one round */
        int c4 = cols >> 2, n4 = S * c4;
        const float4* g4 = (const float4*)gu;
        float4 gv[8], uv[8];
#pragma unroll
        for (int j = 0; j < 8; j++) {
            int i = threadIdx.x + j * blockDim.x;
            if (i < n4) {
                int k = i / c4, c = i - k * c4;
                gv[j] = g4[(2 * k) * c4 + c];
                uv[j] = g4[(2 * k + 1) * c4 + c];
            }
        }
#pragma unroll
        for (int j = 0; j < 8; j++) {
            int i = threadIdx.x + j * blockDim.x;
            if (i < n4)
                ((float4*)hs)[i] = make_float4(silu_f(gv[j].x) * uv[j].x, silu_f(gv[j].y) * uv[j].y,
                                               silu_f(gv[j].z) * uv[j].z, silu_f(gv[j].w) * uv[j].w);
        }
    }
    __syncthreads();
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int r0 = (blockIdx.x * (blockDim.x >> 5) + warp) * MOE_DOWN_NR;
    if (r0 >= rows) return;
    int nvalid = min(MOE_DOWN_NR, rows - r0);
    float acc[MOE_DOWN_NR] = {0.f, 0.f};
    if (bits == 4)
        moe_down_rows<4>((const u32*)w, sc, bi, group, ty, ids, wts, S, rows, r0, nvalid, cols, hs, lane, acc);
    else if (bits == 8)
        moe_down_rows<8>((const u32*)w, sc, bi, group, ty, ids, wts, S, rows, r0, nvalid, cols, hs, lane, acc);
    else
        for (int rr = 0; rr < nvalid; rr++)
            for (int k = 0; k < S; k++) {
                long long R = (long long)ids[k] * rows + r0 + rr;
                float d = 0.f;
                for (int c = lane; c < cols; c += 32) d += load_elem(w, R * cols + c, ty) * hs[k * cols + c];
                acc[rr] += wts[k] * d;
            }
#pragma unroll
    for (int rr = 0; rr < MOE_DOWN_NR; rr++) {
        float a = warp_sum(acc[rr]);
        if (lane == 0 && rr < nvalid) x[r0 + rr] += a;
    }
}

extern "C" __global__ void embed_row(const EmbedParams p) {
    TL_SCOPE("embed_row");
    pdl_begin();
    int c = blockIdx.x * blockDim.x + threadIdx.x, cols = p.cols;
    if (c < cols)
        p.out[(long long)blockIdx.y * cols + c] =
            dequant_elem(p.w, p.sc, p.bi, p.bits, p.group, p.ty, p.row[blockIdx.y], cols, c);
}
