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
 *   Geometry: block 256 = 8 warps, each warp owns 4 consecutive output rows (GEMV_NR), grid
 *   (ceil(rows/32), slots). Lanes stride the rows in uint4 loads (16 B, a warp reads 512
 *   contiguous bytes of each row per step); the x chunk is loaded once per step for all 4 rows.
 *   Requires cols % 32 == 0 for quantized weights (true: cols is a multiple of the group) and
 *   x + z*xstride 16-byte aligned (x is read as float4).
 *   accumulate != 0 adds into y (residual connections).
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

/* Affine dots of NR consecutive quantized rows with x, for this lane's share of 128-bit loads.
 * BITS is a compile-time constant so the unpacking unrolls into constant shifts. Each step loads
 * the x chunk (float4) once for all NR rows and issues the NR weight loads together. */
template <int BITS, int NR>
__device__ __forceinline__ void quant_rows_dot(const u32* w, long long R0, int nvalid, long long wpr, int n4,
                                               const void* sc, const void* bi, int ng, int group, int ty,
                                               const float* xs, int lane, float* acc) {
    constexpr int PER = 32 / BITS, EPV = 4 * PER;
    constexpr u32 MASK = (1u << BITS) - 1u;
    for (int i = lane; i < n4; i += 32) {
        int c0 = i * EPV;
        int gi = c0 / group;
        uint4 q4[NR];
#pragma unroll
        for (int r = 0; r < NR; r++)
            if (r < nvalid) q4[r] = ((const uint4*)(w + (R0 + r) * wpr))[i];
        float xr[EPV];
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
#pragma unroll
        for (int r = 0; r < NR; r++) {
            if (r < nvalid) {
                long long g = (R0 + r) * ng + gi;
                float s = load_elem(sc, g, ty), b = load_elem(bi, g, ty);
                u32 words[4] = {q4[r].x, q4[r].y, q4[r].z, q4[r].w};
                float qx = 0.f;
#pragma unroll
                for (int k = 0; k < 4; k++)
#pragma unroll
                    for (int j = 0; j < PER; j++) qx += (float)((words[k] >> (BITS * j)) & MASK) * xr[k * PER + j];
                acc[r] += s * qx + b * sx;
            }
        }
    }
}

#define GEMV_NR 4
extern "C" __global__ void linear_gemv(const void* w, const void* sc, const void* bi, int bits, int group, int ty,
                                       const float* x, long long xstride, float* y, int rows, int cols,
                                       const int* ids, int accumulate) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int r0 = (blockIdx.x * (blockDim.x >> 5) + warp) * GEMV_NR;
    if (r0 >= rows) return;
    int nvalid = min(GEMV_NR, rows - r0);
    int z = blockIdx.y;
    long long R0 = (long long)(ids ? ids[z] : 0) * rows + r0;
    const float* xs = x + (long long)z * xstride;
    float acc[GEMV_NR];
#pragma unroll
    for (int r = 0; r < GEMV_NR; r++) acc[r] = 0.f;
    if (bits == 0) {
        for (int r = 0; r < nvalid; r++)
            for (int c = lane; c < cols; c += 32) acc[r] += load_elem(w, (R0 + r) * cols + c, ty) * xs[c];
    } else {
        long long wpr = (long long)cols * bits / 32; /* u32 words per row */
        int n4 = (int)(wpr / 4);
        int ng = cols / group;
        if (bits == 4)
            quant_rows_dot<4, GEMV_NR>((const u32*)w, R0, nvalid, wpr, n4, sc, bi, ng, group, ty, xs, lane, acc);
        else
            quant_rows_dot<8, GEMV_NR>((const u32*)w, R0, nvalid, wpr, n4, sc, bi, ng, group, ty, xs, lane, acc);
    }
#pragma unroll
    for (int r = 0; r < GEMV_NR; r++) {
        float a = warp_sum(acc[r]);
        if (lane == 0 && r < nvalid) {
            float* o = y + (long long)z * rows + r0 + r;
            *o = accumulate ? *o + a : a;
        }
    }
}

extern "C" __global__ void embed_row(const void* w, const void* sc, const void* bi, int bits, int group, int ty,
                                     const int* row, int cols, float* out) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c < cols) out[(long long)blockIdx.y * cols + c] = dequant_elem(w, sc, bi, bits, group, ty, row[blockIdx.y], cols, c);
}
