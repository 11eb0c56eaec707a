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

/* Two code words (16 codes) of a staged chunk against their halves of the chunk's parts H, M, L
   (words 2j and 2j + 1 of a load meet parts X[j], X[2 + j], X[4 + j]): exact int32 sums. */
__device__ __forceinline__ void i8_words2(u32 w0, u32 w1, uint4 H, uint4 M, uint4 L, int& ah, int& am, int& al) {
    u32 words[2] = {w0, w1};
#pragma unroll
    for (int w = 0; w < 2; w++) {
        int lo = (int)(words[w] & 0x0F0F0F0Fu), hi = (int)((words[w] >> 4) & 0x0F0F0F0Fu);
        bool o = w & 1;
        ah = __dp4a(lo, (int)(o ? H.z : H.x), ah);
        ah = __dp4a(hi, (int)(o ? H.w : H.y), ah);
        am = __dp4a(lo, (int)(o ? M.z : M.x), am);
        am = __dp4a(hi, (int)(o ? M.w : M.y), am);
        al = __dp4a(lo, (int)(o ? L.z : L.x), al);
        al = __dp4a(hi, (int)(o ? L.w : L.y), al);
    }
}
/* 254 sum(q h) + sum(q m) + sum(q l) / 254 of the parts' sums, which times sx / 254 is sum(q x). */
__device__ __forceinline__ float i8_join(int ah, int am, int al) {
    return (float)(ah * 254 + am) + (float)al * (1.f / 254.f);
}
/* One 128-bit load of 4-bit codes (the 32 codes of staged chunk i) against that chunk's parts,
   X[k] = xs4[k * nch + i] (k < 6) (gq_compute). */
__device__ __forceinline__ float i8_dot(uint4 q, const uint4 (&X)[6]) {
    int ah = 0, am = 0, al = 0;
    i8_words2(q.x, q.y, X[0], X[2], X[4], ah, am, al);
    i8_words2(q.z, q.w, X[1], X[3], X[5], ah, am, al);
    return i8_join(ah, am, al);
}

/* The i8 form of gq_stage's loop (and moe_stage's, mf2_stage's, pstep's): item it = 4 c + w of
   the nch * 4, over `nt` threads from `t0` (a multiple of 32: whole warps); get(c, w, v) fills the
   item's 8 weighted values and returns the sum of the raw values' squares (the norm's). TWO: two
   items a trip, both items' loads issued before either is quantized (the staging is on every
   product's path: one L2 latency, not one per item); pstep takes one (its registers are few and
   its inputs fit one trip). */
template <bool TWO = true, class Get>
__device__ __forceinline__ float i8_stage(int nch, float* xs, int t0, int nt, Get get) {
    float ss = 0.f;
    for (int b = 0; b < 4 * nch; b += (TWO ? 2 : 1) * nt) {
        int i0 = b + t0, i1 = i0 + nt;
        bool a0 = i0 < 4 * nch, a1 = TWO && i1 < 4 * nch;
        float v0[8], v1[8];
        if (a0) ss += get(i0 >> 2, i0 & 3, v0);
        if (a1) ss += get(i1 >> 2, i1 & 3, v1);
        i8_stage_item(v0, a0, i0 >> 2, i0 & 3, nch, xs);
        if (TWO && b + nt < 4 * nch) i8_stage_item(v1, a1, i1 >> 2, i1 & 3, nch, xs); /* block-uniform */
    }
    return ss;
}
