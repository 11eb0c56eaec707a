/*
 * linear.cu: weight products for MLX affine 4/8-bit and dense f32/f16/bf16 weights.
 *
 * Weight W [rows_total, cols] (PyTorch [out, in]). MLX affine: packed u32 [rows_total, cols*bits/32]
 * (element j of a word = (w >> bits*j) & mask, little-endian along the row), scales/biases
 * [rows_total, cols/group] of type `ty`; W[r, c] = s[r, c/g] * q[r, c] + b[r, c/g].
 * Dense: W row-major of type `ty`, bits = 0.
 *
 * linear_gemv: for every slot z (grid.y), e = ids ? ids[z] : 0 (read on the device: MoE experts
 *   need no host sync), y[z*rows + r] (+)= sum_c W[e*rows + r, c] * x[z*xstride + c].
 *   Quantized rows use the affine identity per 128-bit load (32 4-bit or 16 8-bit codes, always
 *   inside one group since group >= 32): s * sum(q x) + b * sum(x).
 *   Geometry: block 256 = 8 warps, one warp per output row, grid (ceil(rows/8), slots). Lanes
 *   stride the row in uint4 loads (16 B), so a warp reads 512 contiguous bytes per step.
 *   Requires cols % 32 == 0 for quantized weights (true: cols is a multiple of the group) and
 *   x + z*xstride 16-byte aligned (x is read as float4).
 *   accumulate != 0 adds into y (residual connections).
 *
 * linear_gemm: the same product for T tokens (prefill), x [T, cols], y [T, rows] (+)=.
 *   Simple tiled version for correctness: block 256 = 8 warps, 8 rows x 8 tokens per block;
 *   each warp owns one row and keeps 8 token accumulators, so each weight element is decoded
 *   once per 8 tokens. grid (ceil(rows/8), ceil(T/8)).
 *
 * embed_row: out[c] = W[row[0], c] dequantized (embedding gather; the token id is read from device
 *   memory so a captured CUDA graph can replay it), grid ceil(cols/256), block 256.
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

/* Affine dot of one quantized row with x, for this lane's share of 128-bit loads. BITS is a
 * compile-time constant so the unpacking unrolls into constant shifts; x is read as float4. */
template <int BITS>
__device__ __forceinline__ float quant_row_dot(const uint4* wr, int n4, const void* sc, const void* bi,
                                               long long sbase, int group, int ty, const float* xs, int lane) {
    constexpr int PER = 32 / BITS, EPV = 4 * PER;
    constexpr u32 MASK = (1u << BITS) - 1u;
    float acc = 0.f;
    for (int i = lane; i < n4; i += 32) {
        uint4 q4 = wr[i];
        int c0 = i * EPV;
        int gi = c0 / group;
        float s = load_elem(sc, sbase + gi, ty), b = load_elem(bi, sbase + gi, ty);
        u32 words[4] = {q4.x, q4.y, q4.z, q4.w};
        const float4* xv = (const float4*)(xs + c0);
        float qx = 0.f, sx = 0.f;
#pragma unroll
        for (int k = 0; k < 4; k++) {
#pragma unroll
            for (int j = 0; j < PER; j += 4) {
                float4 x4 = xv[(k * PER + j) / 4];
                u32 w = words[k] >> (BITS * j);
                qx += (float)(w & MASK) * x4.x;
                qx += (float)((w >> BITS) & MASK) * x4.y;
                qx += (float)((w >> (2 * BITS)) & MASK) * x4.z;
                qx += (float)((w >> (3 * BITS)) & MASK) * x4.w;
                sx += (x4.x + x4.y) + (x4.z + x4.w);
            }
        }
        acc += s * qx + b * sx;
    }
    return acc;
}

extern "C" __global__ void linear_gemv(const void* w, const void* sc, const void* bi, int bits, int group, int ty,
                                       const float* x, long long xstride, float* y, int rows, int cols,
                                       const int* ids, int accumulate) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int r = blockIdx.x * (blockDim.x >> 5) + warp;
    if (r >= rows) return;
    int z = blockIdx.y;
    long long R = (long long)(ids ? ids[z] : 0) * rows + r;
    const float* xs = x + (long long)z * xstride;
    float acc = 0.f;
    if (bits == 0) {
        for (int c = lane; c < cols; c += 32) acc += load_elem(w, R * cols + c, ty) * xs[c];
    } else {
        long long wpr = (long long)cols * bits / 32; /* u32 words per row */
        const uint4* wr = (const uint4*)((const u32*)w + R * wpr);
        int n4 = (int)(wpr / 4);
        long long sbase = R * (cols / group);
        acc = bits == 4 ? quant_row_dot<4>(wr, n4, sc, bi, sbase, group, ty, xs, lane)
                        : quant_row_dot<8>(wr, n4, sc, bi, sbase, group, ty, xs, lane);
    }
    acc = warp_sum(acc);
    if (lane == 0) {
        float* o = y + (long long)z * rows + r;
        *o = accumulate ? *o + acc : acc;
    }
}

#define GEMM_TT 8
extern "C" __global__ void linear_gemm(const void* w, const void* sc, const void* bi, int bits, int group, int ty,
                                       const float* x, float* y, int rows, int cols, int T, int accumulate) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int r = blockIdx.x * (blockDim.x >> 5) + warp;
    int t0 = blockIdx.y * GEMM_TT;
    if (r >= rows) return;
    int nt = min(GEMM_TT, T - t0);
    float acc[GEMM_TT];
#pragma unroll
    for (int t = 0; t < GEMM_TT; t++) acc[t] = 0.f;
    for (int c = lane; c < cols; c += 32) {
        float wv = dequant_elem(w, sc, bi, bits, group, ty, r, cols, c);
#pragma unroll
        for (int t = 0; t < GEMM_TT; t++)
            if (t < nt) acc[t] += wv * x[(long long)(t0 + t) * cols + c];
    }
#pragma unroll
    for (int t = 0; t < GEMM_TT; t++) {
        float a = warp_sum(acc[t]);
        if (lane == 0 && t < nt) {
            float* o = y + (long long)(t0 + t) * rows + r;
            *o = accumulate ? *o + a : a;
        }
    }
}

extern "C" __global__ void embed_row(const void* w, const void* sc, const void* bi, int bits, int group, int ty,
                                     const int* row, int cols, float* out) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c < cols) out[c] = dequant_elem(w, sc, bi, bits, group, ty, row[0], cols, c);
}
