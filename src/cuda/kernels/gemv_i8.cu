/*
 * gemv_i8.cu: the int8 staging of the 4-bit decode products (gemv.cu; the default kernel build).
 */
/* LILY_GEMV_I8 (the default kernel build since session 32, +14% decode on the H200;
   LILY_CUDA_GEMV_I8=0 builds the float form): a 4-bit product's
   input is staged per 32-value chunk as three int8 parts of t = x / sx, sx = max|x| / 127:
   h = rint(t), m = rint((t - h) 254), l = rint(((t - h) 254 - m) 254), so that
   x = sx (h + m/254 + l/254^2) within ~1.2e-7 of the chunk's max |x|, and the products run on
   dp4a with exact int32 sums: per chunk and row, A = 254 sum(q h) + sum(q m) (|A| < 2^24, exact
   in fp32), L = sum(q l), sum(q x) = sx/254 (A + L/254). About 1.5 instructions a code instead
   of 3.4 (the byte-permute path); the rounding is that of the parts, not of the float sums.
   Layout over the staging's nch chunks: uint4 slot k = 2p + (w >> 1) of chunk c at
   xs4[k * nch + c] (part p, code word w of the chunk, int32 (w & 1) * 2 + lohi, whose byte i is
   element 8w + 2i + lohi: lohi 0 the word's even codes, its low nibbles), then sx[nch] and the
   chunk sums xsum[nch] as floats: 26 floats a chunk (the float staging takes 33).
   Staging work item: (chunk c, word w) = 8 values, the 4 words of a chunk in 4 adjacent lanes. */
#ifdef LILY_GEMV_I8
constexpr bool GQ_I8 = true;
#else
constexpr bool GQ_I8 = false;
#endif

/* The low bytes of four floats that hold small integers in the form v + 1.5 * 2^23. */
__device__ __forceinline__ u32 i8_pack(float a, float b, float c, float d) {
    u32 ab = __byte_perm(__float_as_uint(a), __float_as_uint(b), 0x0040);
    u32 cd = __byte_perm(__float_as_uint(c), __float_as_uint(d), 0x0040);
    return __byte_perm(ab, cd, 0x5410);
}

/* One staging item: v = the 8 (weighted) values of word w of chunk c. Every lane of the warp
   calls it (quad shuffles); `act` false for lanes past the end (v ignored). */
__device__ __forceinline__ void i8_stage_item(const float (&v)[8], bool act, int c, int w, int nch, float* xs) {
    float m = 0.f, sum = 0.f;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        m = fmaxf(m, act ? fabsf(v[j]) : 0.f);
        sum += act ? v[j] : 0.f;
    }
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 1));
    m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 2));
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    if (!act) return;
    const float M = 12582912.f; /* 1.5 * 2^23: v + M holds rint(v) in its low mantissa bits */
    float inv = m > 0.f ? 127.f / m : 0.f;
    float ph[8], pm[8], pl[8];
#pragma unroll
    for (int j = 0; j < 8; j++) {
        float t = v[j] * inv;
        ph[j] = t + M;
        float r1 = (t - (ph[j] - M)) * 254.f;
        pm[j] = r1 + M;
        float r2 = (r1 - (pm[j] - M)) * 254.f;
        pl[j] = r2 + M;
    }
    uint4* xs4 = (uint4*)xs;
    const float* P[3] = {ph, pm, pl};
#pragma unroll
    for (int p = 0; p < 3; p++) {
        const float* q = P[p];
        uint2 pr = make_uint2(i8_pack(q[0], q[2], q[4], q[6]), i8_pack(q[1], q[3], q[5], q[7]));
        ((uint2*)&xs4[(2 * p + (w >> 1)) * nch + c])[w & 1] = pr;
    }
    if (w == 0) {
        float* sxv = xs + 24 * nch;
        sxv[c] = m * (1.f / 127.f);
        sxv[nch + c] = sum;
    }
}

/* The i8 form of gq_stage's loop (and moe_stage's, mf2_stage's): item it = 4 c + w of the
   nch * 4, over `nt` threads from `t0` (a multiple of 32: whole warps); get(c, w, v) fills the
   item's 8 weighted values and returns the sum of the raw values' squares (the norm's). */
template <class Get>
__device__ __forceinline__ float i8_stage(int nch, float* xs, int t0, int nt, Get get) {
    float ss = 0.f;
    /* two items a trip, both items' loads issued before either is quantized (the staging is on
       every product's path: one L2 latency, not one per item) */
    for (int b = 0; b < 4 * nch; b += 2 * nt) {
        int i0 = b + t0, i1 = i0 + nt;
        bool a0 = i0 < 4 * nch, a1 = i1 < 4 * nch;
        float v0[8], v1[8];
        if (a0) ss += get(i0 >> 2, i0 & 3, v0);
        if (a1) ss += get(i1 >> 2, i1 & 3, v1);
        i8_stage_item(v0, a0, i0 >> 2, i0 & 3, nch, xs);
        if (b + nt < 4 * nch) i8_stage_item(v1, a1, i1 >> 2, i1 & 3, nch, xs); /* block-uniform */
    }
    return ss;
}

