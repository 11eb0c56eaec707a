/*
 * gemv.cu: the decode matrix-vector product for MLX affine 4/8-bit weights (scales and biases f16
 * or bf16, group a power of two >= 32), built to stream weights at HBM rate.
 *
 * Math (slot z = grid.y, e = ids ? ids[z] : 0, xz = x + (z / xdiv)*xstride; xdiv > 1 lets the
 *   batched decode's expert slots (token t, choice j) = t*xdiv + j read token t's row):
 *   y[z*rows + r] (+)= rr * sum_c W[e*rows + r, c] * xw[c],   xw = xz * normw (or xz),
 *   rr = rsqrt(mean(xz^2) + eps) with a norm (the fused RMSNorm), else 1.
 *   Per 128-bit load of codes (EPV = 32 4-bit or 16 8-bit values, inside one group):
 *   s * sum_j q_j xw_j + b * sum_j xw_j, the second sum precomputed per chunk at staging.
 *   Codes become floats without the quarter-rate integer conversion, by byte permutes (gq_dot):
 *   4-bit codes as 1/2 + q/32 (one permute and one FMA per code; the x/2 part is removed per
 *   chunk with the precomputed sum, costing about one bit),
 *   8-bit codes as 2^23 + q minus 2^23 (exact).
 *
 * Layouts: packed u32 [count*rows, cols*BITS/32] (code j of a word = bits [BITS*j, BITS*j+BITS)),
 *   scales/biases [count*rows, cols/group]; x f32 16-byte aligned, y f32 [slots, rows].
 *
 * Geometry: block 128 (4 warps, up to 4 blocks per SM) or 512 (16 warps, one block per SM: one
 *   staging per SM), grid (gx, slots), gx chosen by the host to fill the GPU once. The block stages xw and the chunk sums in dynamic shared memory
 *   (cols + cols/EPV floats, cols <= 8192, float4 slots swizzled against bank conflicts) once, then each warp walks row groups of NR rows,
 *   grid-strided. A row group is read in trips: per trip each lane loads chunks lane, lane + 32,
 *   ..., lane + 32(U-1) of every row of the group (U*NR 16-byte loads plus their scale/bias
 *   pairs; the GEMV uses U = 2, NR = 2); the
 *   next trip's loads are issued before the current trip is computed (register double buffer),
 *   so every warp keeps one trip of loads in flight while it computes. The first loads are issued
 *   before the staging (and, launched as a programmatic dependent, before waiting for the
 *   previous kernel: weights do not depend on it). After a row group's last trip, one warp
 *   reduction per row.
 */

template <int NR, int U>
struct GqTrip {
    uint4 q[U][NR];
    /* scale and bias bits as loaded: converted where used (joining or converting them at the
       load would make the warp wait for these loads there, a whole trip too early) */
    u32 s[U][NR], b[U][NR];
};

__device__ __forceinline__ uint4 ldg_stream(const uint4* p) {
    uint4 v;
#ifdef LILY_L2_EVICT_FIRST /* common.cuh: evict-first in L2 */
    asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p), "l"(l2_stream_pol()));
#else
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
#endif
    return v;
}

/* Shared-memory slot of x's float4 number f: f ^ ((f >> 3) & 7). Lane l reads chunk l (EPV
   floats = 128 or 64 B), so unswizzled the 8 lanes of a 128-bit access phase would all hit the
   same 4 banks (8-way conflict); XOR-ing the float4 index inside its 128-byte window with the
   chunk number spreads them over all 32 banks. */
__device__ __forceinline__ int xswz(int f) { return f ^ ((f >> 3) & 7); }

__device__ __forceinline__ float half_bits(u32 h, int ty) {
    return ty == TY_BF16 ? bf16_to_f32((u16)h) : f16_to_f32((u16)h);
}

/* FULL: every row of the group and every chunk of the trip exists (the common case: no guards,
   so the loads share one address and immediate offsets). RS: row r of the group is row R0 + r * rs
   (moe_fused_q2's pairs: a gate row and the up row `inter` rows after it), else R0 + r. */
template <int BITS, int NR, int U, bool FULL, bool RS = false>
__device__ __forceinline__ void gq_load(GqTrip<NR, U>& t, const u32* w, const u16* sc, const u16* bi, long long R0,
                                        int nvalid, int n4, int ng, int gsh, int i0, long long rs = 1) {
    constexpr int EPV = 128 / BITS;
    const uint4* wr = (const uint4*)w + R0 * n4 + i0;
    long long g0 = R0 * ng + ((i0 * EPV) >> gsh);
    const u16 *sr = sc + g0, *br = bi + g0;
    int gstep = (32 * EPV) >> gsh; /* groups from chunk i0 to chunk i0 + 32 */
#pragma unroll
    for (int r = 0; r < NR; r++) {
#pragma unroll
        for (int u = 0; u < U; u++) {
            if (FULL || (r < nvalid && i0 + 32 * u < n4)) {
                if (RS) {
                    t.q[u][r] = ldg_stream(wr + r * rs * n4 + 32 * u);
                    long long o = r * rs * ng + u * gstep;
                    t.s[u][r] = ldg_u16_stream(sr + o);
                    t.b[u][r] = ldg_u16_stream(br + o);
                } else {
                    t.q[u][r] = ldg_stream(wr + r * n4 + 32 * u);
                    int o = r * ng + u * gstep;
                    t.s[u][r] = ldg_u16_stream(sr + o);
                    t.b[u][r] = ldg_u16_stream(br + o);
                }
            }
        }
    }
}

/* moe_down's loads: virtual chunk c = k * n4 + i is chunk i of row R0 + r of expert ids[k]. */
template <int BITS, int NR, int U>
__device__ __forceinline__ void gq_load_moe(GqTrip<NR, U>& t, const u32* w, const u16* sc, const u16* bi, int R0,
                                            int nvalid, int n4, int nv, int ng, int gsh, int i0, const int* ids,
                                            int rows) {
    constexpr int EPV = 128 / BITS;
#pragma unroll
    for (int u = 0; u < U; u++) {
        int c = i0 + 32 * u;
        if (c < nv) {
            int k = c / n4, i = c - k * n4;
            long long R = (long long)ids[k] * rows + R0;
            const uint4* wr = (const uint4*)w + R * n4 + i;
            long long g0 = R * ng + ((i * EPV) >> gsh);
#pragma unroll
            for (int r = 0; r < NR; r++) {
                if (r < nvalid) {
                    t.q[u][r] = ldg_stream(wr + r * n4);
                    t.s[u][r] = ldg_u16_stream(sc + g0 + r * ng);
                    t.b[u][r] = ldg_u16_stream(bi + g0 + r * ng);
                }
            }
        }
    }
}

/* Chunk i's EPV x values from the swizzled staging into registers. */
template <int BITS>
__device__ __forceinline__ void gq_x(const float* xs, int i, float4 (&x4)[32 / BITS]) {
    constexpr int NF = 32 / BITS; /* float4 per chunk */
    const float4* s4 = (const float4*)xs;
#pragma unroll
    for (int j = 0; j < NF; j++) x4[j] = s4[xswz(i * NF + j)];
}

/* 4-bit: sum_j (1/2 + q_j/32) x_j over the 32 codes of one 128-bit load. The float 1/2 + q/32 is
   built by one byte permute: the byte q << 3 (a shift and a mask per word make all four) goes
   under the exponent byte 0x3F, giving the bit pattern 0x3F00_0000 | q << 19 = 2^-1 (1 + q/16).
   The caller removes the x_j/2 part with the chunk's precomputed sum (see gq_compute); as the
   code part is about as large as the constant part, that cancellation costs about one bit.
   8-bit: sum_j q_j x_j over 16 codes, each code 0x4B00_0000 | q = 2^23 + q minus 2^23. */
/* One 32-bit word of codes against its x values, accumulated into a (even codes) and b (odd
   codes). 4-bit: 8 codes, x[0..8) in xa, xb; code 2j is byte j of lo, code 2j+1 byte j of hi;
   selector 0x7j44 puts 0x3F in byte 3. 8-bit: 4 codes against xa. */
__device__ __forceinline__ void gq_word4(u32 w, float4 xa, float4 xb, float& a, float& b) {
    u32 lo = (w << 3) & 0x78787878u, hi = (w >> 1) & 0x78787878u;
    a = fmaf(__uint_as_float(__byte_perm(lo, 0x3F000000u, 0x7044)), xa.x, a);
    b = fmaf(__uint_as_float(__byte_perm(hi, 0x3F000000u, 0x7044)), xa.y, b);
    a = fmaf(__uint_as_float(__byte_perm(lo, 0x3F000000u, 0x7144)), xa.z, a);
    b = fmaf(__uint_as_float(__byte_perm(hi, 0x3F000000u, 0x7144)), xa.w, b);
    a = fmaf(__uint_as_float(__byte_perm(lo, 0x3F000000u, 0x7244)), xb.x, a);
    b = fmaf(__uint_as_float(__byte_perm(hi, 0x3F000000u, 0x7244)), xb.y, b);
    a = fmaf(__uint_as_float(__byte_perm(lo, 0x3F000000u, 0x7344)), xb.z, a);
    b = fmaf(__uint_as_float(__byte_perm(hi, 0x3F000000u, 0x7344)), xb.w, b);
}
__device__ __forceinline__ void gq_word8(u32 v, float4 xa, float& a, float& b) {
    const float M = 8388608.f;
    a += (__uint_as_float(__byte_perm(v, 0x4B000000u, 0x7440)) - M) * xa.x;
    b += (__uint_as_float(__byte_perm(v, 0x4B000000u, 0x7441)) - M) * xa.y;
    a += (__uint_as_float(__byte_perm(v, 0x4B000000u, 0x7442)) - M) * xa.z;
    b += (__uint_as_float(__byte_perm(v, 0x4B000000u, 0x7443)) - M) * xa.w;
}

template <int BITS>
__device__ __forceinline__ float gq_dot(uint4 q4, const float4 (&x4)[32 / BITS]) {
    u32 words[4] = {q4.x, q4.y, q4.z, q4.w};
    float a = 0.f, b = 0.f;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        if (BITS == 4)
            gq_word4(words[k], x4[2 * k], x4[2 * k + 1], a, b); /* x[8k .. 8k+7] */
        else
            gq_word8(words[k], x4[k], a, b);
    }
    return a + b;
}

/* The int8 staging (LILY_GEMV_I8) is in gemv_i8.cu. */
template <int BITS, int TY, int NR, int U, bool LOADONLY, bool FULL>
__device__ __forceinline__ void gq_compute(const GqTrip<NR, U>& t, int nvalid, int n4, int i0,
                                           const float* xs, const float* xsum, float* acc) {
    constexpr int EPV = 128 / BITS;
    if (LOADONLY) { /* timing experiment: consume the loads, no arithmetic */
#pragma unroll
        for (int u = 0; u < U; u++)
#pragma unroll
            for (int r = 0; r < NR; r++)
                acc[r] += __uint_as_float((t.q[u][r].x ^ t.q[u][r].y ^ t.q[u][r].z ^ t.q[u][r].w ^ t.s[u][r] ^ t.b[u][r]) & 0x3FFFFFu);
        return;
    }
    if constexpr (GQ_I8 && BITS == 4) { /* n4: the staging's chunks (see i8_stage_item) */
        const uint4* xs4 = (const uint4*)xs;
        const float *sxv = xs + 24 * n4, *xsm = sxv + n4;
#pragma unroll
        for (int u = 0; u < U; u++) {
            int i = i0 + 32 * u;
            if (FULL || i < n4) {
                uint4 X[6];
#pragma unroll
                for (int k = 0; k < 6; k++) X[k] = xs4[k * n4 + i];
                float sx = sxv[i] * (1.f / 254.f), sm = xsm[i];
#pragma unroll
                for (int r = 0; r < NR; r++) {
                    if (FULL || r < nvalid) {
                        float s = half_bits(t.s[u][r], TY), b = half_bits(t.b[u][r], TY);
                        float f = i8_dot(t.q[u][r], X);
                        acc[r] += (s * sx) * f + b * sm;
                    }
                }
            }
        }
        return;
    }
#pragma unroll
    for (int u = 0; u < U; u++) {
        int i = i0 + 32 * u;
        if (FULL || i < n4) {
            float sx = xsum[i];
            float4 x4[32 / BITS];
            gq_x<BITS>(xs, i, x4);
#pragma unroll
            for (int r = 0; r < NR; r++) {
                if (FULL || r < nvalid) {
                    float s = half_bits(t.s[u][r], TY), b = half_bits(t.b[u][r], TY);
                    float d = gq_dot<BITS>(t.q[u][r], x4);
                    if (BITS == 4) { /* s q.x + b sx with q.x = 32 d - 16 sx */
                        acc[r] += (32.f * s) * d + (b - 16.f * s) * sx;
                    } else {
                        acc[r] += s * d + b * sx;
                    }
                }
            }
        }
    }
}

/* Stages xw = x * normw (or x) and the per-chunk sums; returns rr (1 without a norm). */
template <int EPV>
__device__ __forceinline__ float gq_stage(const float* xg, int cols, const float* normw, float eps, float* xs,
                                          float* xsum, float* red) {
    int nch = cols / EPV;
    float ss = 0.f;
    if constexpr (GQ_I8 && EPV == 32) {
        ss = i8_stage(nch, xs, threadIdx.x, blockDim.x, [&](int c, int w, float (&v)[8]) {
            const float4* x4 = (const float4*)(xg + 32 * c + 8 * w);
            float4 a = x4[0], bq = x4[1];
            float r[8] = {a.x, a.y, a.z, a.w, bq.x, bq.y, bq.z, bq.w}, q = 0.f;
#pragma unroll
            for (int j = 0; j < 8; j++) q += r[j] * r[j];
            if (normw) {
                const float4* n4 = (const float4*)(normw + 32 * c + 8 * w);
                float4 na = n4[0], nb = n4[1];
                float nw[8] = {na.x, na.y, na.z, na.w, nb.x, nb.y, nb.z, nb.w};
#pragma unroll
                for (int j = 0; j < 8; j++) r[j] *= nw[j];
            }
#pragma unroll
            for (int j = 0; j < 8; j++) v[j] = r[j];
            return q;
        });
    } else
    for (int ch = threadIdx.x; ch < nch; ch += blockDim.x) {
        const float4* x4 = (const float4*)(xg + ch * EPV);
        const float4* n4 = (const float4*)(normw + ch * EPV);
        float4* o4 = (float4*)xs;
        float4 v[EPV / 4];
#pragma unroll
        for (int j = 0; j < EPV / 4; j++) v[j] = x4[j];
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < EPV / 4; j++) {
            float4 a = v[j];
            ss += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
            if (normw) {
                float4 nw = n4[j];
                a = make_float4(a.x * nw.x, a.y * nw.y, a.z * nw.z, a.w * nw.w);
            }
            o4[xswz(ch * (EPV / 4) + j)] = a;
            sum += (a.x + a.y) + (a.z + a.w);
        }
        xsum[ch] = sum;
    }
    if (!normw) {
        __syncthreads();
        return 1.f;
    }
    ss = block_sum(ss, red); /* synchronizes the block */
    return 1.f / sqrtf(ss / (float)cols + eps);
}

/* One int8 staging item of the experts' down input: v = wt * silu(g) * u for the 8 values from
   column c0 of slot k's gate and up rows (gu [S][2][cols], read through L2; moe_stage, pstep). */
__device__ __forceinline__ void swiglu_item8(const float* gu, int k, int cols, int c0, float wt, float (&v)[8]) {
    const float4* g4 = (const float4*)(gu + (long long)(2 * k) * cols + c0);
    const float4* u4 = (const float4*)(gu + (long long)(2 * k + 1) * cols + c0);
    float4 ga = __ldcg(g4), gb = __ldcg(g4 + 1), ua = __ldcg(u4), ub = __ldcg(u4 + 1);
    float g[8] = {ga.x, ga.y, ga.z, ga.w, gb.x, gb.y, gb.z, gb.w};
    float u[8] = {ua.x, ua.y, ua.z, ua.w, ub.x, ub.y, ub.z, ub.w};
#pragma unroll
    for (int j = 0; j < 8; j++) v[j] = wt * (silu_f(g[j]) * u[j]);
}

/* moe_down's staging: xs = wts[k] * silu(gu[2k]) * gu[2k+1] for the S slots back to back (xg = gu,
   wk = wts), swizzled, with the per-chunk sums. wk null: gu already holds those products, [S, cols]
   (moe_fused_q2's pairs wrote them), staged as they are. */
template <int EPV>
__device__ __forceinline__ float moe_stage(const float* gu, const float* wk, int S, int cols, float* xs, float* xsum) {
    int per = cols / EPV, nch = S * per;
    if constexpr (GQ_I8 && EPV == 32) {
        i8_stage(nch, xs, threadIdx.x, blockDim.x, [&](int c, int w, float (&v)[8]) {
            int k = c / per, c0 = (c - k * per) * 32 + 8 * w;
            if (!wk) {
                const float4* h4 = (const float4*)(gu + (long long)k * cols + c0);
                float4 a = __ldcg(h4), b = __ldcg(h4 + 1);
                float r[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
                for (int j = 0; j < 8; j++) v[j] = r[j];
                return 0.f;
            }
            swiglu_item8(gu, k, cols, c0, wk[k], v);
            return 0.f;
        });
        __syncthreads();
        return 1.f;
    }
    for (int ch = threadIdx.x; ch < nch; ch += blockDim.x) {
        int k = ch / per, c0 = (ch - k * per) * EPV;
        float sum = 0.f;
        if (!wk) {
            const float4* h4 = (const float4*)(gu + (long long)k * cols + c0);
#pragma unroll
            for (int j = 0; j < EPV / 4; j++) {
                float4 h = __ldcg(h4 + j); /* through L2: other blocks of the launch wrote them */
                ((float4*)xs)[xswz(ch * (EPV / 4) + j)] = h;
                sum += (h.x + h.y) + (h.z + h.w);
            }
            xsum[ch] = sum;
            continue;
        }
        const float4* g4 = (const float4*)(gu + (long long)(2 * k) * cols + c0);
        const float4* u4 = (const float4*)(gu + (long long)(2 * k + 1) * cols + c0);
        float w = wk[k];
#pragma unroll
        for (int j = 0; j < EPV / 4; j++) {
            /* L2 reads: in moe_fused_q other blocks of the same launch wrote gu */
            float4 g = __ldcg(g4 + j), u = __ldcg(u4 + j);
            float4 h = make_float4(w * (silu_f(g.x) * u.x), w * (silu_f(g.y) * u.y), w * (silu_f(g.z) * u.z),
                                   w * (silu_f(g.w) * u.w));
            ((float4*)xs)[xswz(ch * (EPV / 4) + j)] = h;
            sum += (h.x + h.y) + (h.z + h.w);
        }
        xsum[ch] = sum;
    }
    __syncthreads();
    return 1.f;
}

/* The row-group walk shared by the GEMV and moe_down (MOE: the input is S slots of `cols` staged
   by moe_stage from xg = gu and normw = wts; slot k's weights are expert ids[k]'s). */
/* The GDN input projection's conv epilogue (gemv_q2_conv): rows c < C of the output are the conv
   channels; their causal depthwise conv (K taps, K a power of two <= 16) runs where the row's dot
   product is finished, lanes K*r + j of the warp holding tap j of row r of the group. */
struct ConvEpi {
    float* state;   /* [K-1, C] raw past inputs */
    const float* w; /* [C, K], tap K-1 = the current token */
    float* y;       /* [C] silu(conv) */
    int C, K;
};

/* The blocks of one launch meeting on a u64 counter (moe_fused_q; every block
   resident, G = gridDim.x). grid_arrive: this block arrives (after all its threads' writes) and
   gets the target, the next multiple of G after its arrival (each meeting raises the counter by
   G, so it never needs resetting); grid_wait: the block waits until the counter reaches it. */
__device__ __forceinline__ u64 grid_arrive(u64* ctr, u64* s_target) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        u64 old = atomicAdd(ctr, 1ull);
        *s_target = (old / gridDim.x + 1) * gridDim.x;
    }
    __syncthreads();
    return *s_target;
}
__device__ __forceinline__ void grid_wait(const u64* ctr, u64 target) {
    if (threadIdx.x == 0) {
        u64 v;
        do {
            asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(ctr) : "memory");
        } while (v < target);
    }
    __syncthreads();
}

/* A warp requests its first trip before the PDL wait (weights only). Measured and dropped (H100,
   sessions 42-43): none there (−1.4%), two (−0.4% to −1%), the second right after the wait before
   the staging with two more into the L2 (−3.8%). */
/* YS (gemv_q2_route, gemv_route.cu): each finished row's new value also into ys[warp NR + r] (the
   host gives every warp at most one row group, so these are the block's rows in order). */
template <int BITS, int TY, int NR, int U, bool LOADONLY, bool MOE, bool CONV = false, bool YS = false>
__device__ __forceinline__ void gq_body(const u32* w, const u16* sc, const u16* bi, int group,
                                        const float* xg, float* y, int rows, int cols, long long E0, int accumulate,
                                        const float* normw, float eps, float* xs, float* red, const int* ids = 0,
                                        int S = 1, ConvEpi cv = ConvEpi{0, 0, 0, 0, 1}, int vbx = -1, int vgx = 0,
                                        const u64* spin = 0, u64 spin_target = 0, u64* ts = 0, float* ys = 0) {
    constexpr int EPV = 128 / BITS;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int n4 = cols / EPV, ng = cols / group, gsh = __ffs(group) - 1;
    int nv = S * n4;                 /* chunks per (virtual) row */
    int tpr = (nv + 32 * U - 1) / (32 * U); /* trips per row group */
    int ngroups = (rows + NR - 1) / NR;
    int nwarps = blockDim.x >> 5;
    /* a virtual grid (moe_fused_q runs two products in one launch) or the real one */
    if (vbx < 0) {
        vbx = blockIdx.x;
        vgx = gridDim.x;
    }
    int gstride = vgx * nwarps;
    int g = vbx * nwarps + warp, t = 0;
    GqTrip<NR, U> cur, nxt;
    /* conv epilogue: this lane's tap (row cr of the group, tap cj) weight and past input, loaded
       with the group's first trip (the state is this kernel's alone within a step) */
    const int cr = lane / cv.K, cj = lane - cr * cv.K;
    float cw_cur = 0.f, cs_cur = 0.f, cw_nxt = 0.f, cs_nxt = 0.f;
    auto conv_load = [&](int r0g, float& cwv, float& csv) {
        int row = r0g + cr;
        if (CONV && cr < NR && row < cv.C) {
            cwv = cv.w[(long long)row * cv.K + cj];
            csv = cj < cv.K - 1 ? cv.state[(long long)cj * cv.C + row] : 0.f;
        }
    };
    /* trip tt of row group gg into tr (and the group's conv tap with its first trip) */
    auto load_trip = [&](GqTrip<NR, U>& tr, float& cwv, float& csv, int gg, int tt) {
        int r = gg * NR, i0 = tt * 32 * U + lane;
        if (tt == 0) conv_load(r, cwv, csv);
        if (MOE)
            gq_load_moe<BITS, NR, U>(tr, w, sc, bi, r, min(NR, rows - r), n4, nv, ng, gsh, i0, ids, rows);
        else if (rows - r >= NR && (tt + 1) * 32 * U <= nv)
            gq_load<BITS, NR, U, true>(tr, w, sc, bi, E0 + r, NR, n4, ng, gsh, i0);
        else
            gq_load<BITS, NR, U, false>(tr, w, sc, bi, E0 + r, min(NR, rows - r), n4, ng, gsh, i0);
    };
    /* the trip after (gg, tt) in this warp's walk */
    auto next_trip = [&](int gg, int tt, int& g2, int& t2) {
        g2 = gg;
        t2 = tt + 1;
        if (t2 == tpr) {
            g2 = gg + gstride;
            t2 = 0;
        }
    };
    if (g < ngroups) load_trip(cur, cw_cur, cs_cur, g, 0);
    if (spin) { /* moe_fused_q: every block of the launch has done its first part */
        grid_wait(spin, spin_target);
    } else {
        if (!MOE) norm_pf(normw, cols);
        pdl_wait(); /* weights are read above, activations only from here on */
    }
    trace_stamp(ts, 0);
    float* xsum = xs + nv * EPV;
    float rr = MOE ? moe_stage<EPV>(xg, normw, S, cols, xs, xsum) : gq_stage<EPV>(xg, cols, normw, eps, xs, xsum, red);
    trace_stamp(ts, 1);
    float acc[NR];
#pragma unroll
    for (int r = 0; r < NR; r++) acc[r] = 0.f;
    while (g < ngroups) {
        int r0 = g * NR, nvalid = min(NR, rows - r0);
        int g2, t2;
        next_trip(g, t, g2, t2);
        if (g2 < ngroups) load_trip(nxt, cw_nxt, cs_nxt, g2, t2);
        if (nvalid == NR && (t + 1) * 32 * U <= nv)
            gq_compute<BITS, TY, NR, U, LOADONLY, true>(cur, NR, nv, t * 32 * U + lane, xs, xsum, acc);
        else
            gq_compute<BITS, TY, NR, U, LOADONLY, false>(cur, nvalid, nv, t * 32 * U + lane, xs, xsum, acc);
        if (t + 1 == tpr) {
            float mine = 0.f; /* row cr's finished value */
#pragma unroll
            for (int r = 0; r < NR; r++) {
                float a = warp_sum(acc[r]) * rr;
                acc[r] = 0.f;
                if (r == cr) mine = a;
                if (lane == 0 && r < nvalid) {
                    float* o = y + r0 + r;
                    if (accumulate == 2) {
                        atomicAdd(o, a); /* LILY_CUDA_ACC_RED: the row's only adder in this launch */
                    } else {
                        float v = accumulate ? *o + a : a;
                        *o = v;
                        if constexpr (YS) ys[warp * NR + r] = v;
                    }
                }
            }
            if (CONV) {
                /* X = [state; a] of row r0 + cr: y = silu(sum_j w_j X_j), state <- X[1..K) */
                int row = r0 + cr;
                bool act = cr < NR && cr < nvalid && row < cv.C;
                float xin = cj == cv.K - 1 ? mine : cs_cur;
                float v = act ? cw_cur * xin : 0.f;
                for (int o = 1; o < cv.K; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
                float nx = __shfl_down_sync(0xffffffffu, xin, 1);
                if (act && cj < cv.K - 1) cv.state[(long long)cj * cv.C + row] = nx;
                if (act && cj == 0) cv.y[row] = silu_f(v);
            }
            cw_cur = cw_nxt;
            cs_cur = cs_nxt;
        }
        cur = nxt;
        g = g2;
        t = t2;
    }
}

#define GQ_KERNEL(NAME, NR, LOADONLY)                                                                                            \
    extern "C" __global__ void __launch_bounds__(512) NAME(GemvParams_fields) {                                  \
        extern __shared__ __align__(16) float xs[]; /* cols + cols/EPV floats */                                  \
        __shared__ float red[33];                                                                                  \
        TL_SCOPE(#NAME);                                                                                           \
        int z = blockIdx.y;                                                                                        \
        pdl_trigger();                                                                                             \
        if (ids) pdl_wait(); /* the expert ids come from the previous kernel */                                    \
        long long E0 = (long long)(ids ? ids[z] : 0) * rows;                                                       \
        const float* xg = x + (long long)(z / xdiv) * xstride;                                                     \
        float* yz = y + (long long)z * rows;                                                                       \
        const u32* W = (const u32*)w;                                                                              \
        const u16 *S = (const u16*)sc, *B = (const u16*)bi;                                                        \
        if (bits == 4 && ty == TY_BF16)                                                                            \
            gq_body<4, TY_BF16, NR, 2, LOADONLY, false, false>(W, S, B, group, xg, yz, rows, cols, E0, accumulate, normw, eps, xs, red); \
        else if (bits == 4)                                                                                        \
            gq_body<4, TY_F16, NR, 2, LOADONLY, false, false>(W, S, B, group, xg, yz, rows, cols, E0, accumulate, normw, eps, xs, red); \
        else if (ty == TY_BF16)                                                                                    \
            gq_body<8, TY_BF16, NR, 2, LOADONLY, false, false>(W, S, B, group, xg, yz, rows, cols, E0, accumulate, normw, eps, xs, red); \
        else                                                                                                       \
            gq_body<8, TY_F16, NR, 2, LOADONLY, false, false>(W, S, B, group, xg, yz, rows, cols, E0, accumulate, normw, eps, xs, red); \
    }

GQ_KERNEL(gemv_q2, 2, false)
GQ_KERNEL(gemv_q_loadonly, 2, true)

/* gemv_q2_conv: gemv_q2 for one slot (the batch-1 GDN input projection, x RMS-normalized when
   normw is set) whose rows c < C then go through conv_step's causal conv + SiLU into cy, updating
   the conv state; saves the conv_step launch. Same result as gemv_q2 then conv_step. */
extern "C" __global__ void __launch_bounds__(512) gemv_q2_conv(GemvConvParams_fields) {
    extern __shared__ __align__(16) float xs[];
    __shared__ float red[33];
    TL_SCOPE("gemv_q2_conv");
    pdl_trigger();
    const u32* W = (const u32*)w;
    const u16 *S = (const u16*)sc, *B = (const u16*)bi;
    ConvEpi cv{cstate, cw, cy, C, K};
    if (bits == 4 && ty == TY_BF16)
        gq_body<4, TY_BF16, 2, 2, false, false, true>(W, S, B, group, x, y, rows, cols, 0, 0, normw, eps, xs, red, 0, 1, cv);
    else if (bits == 4)
        gq_body<4, TY_F16, 2, 2, false, false, true>(W, S, B, group, x, y, rows, cols, 0, 0, normw, eps, xs, red, 0, 1, cv);
    else if (ty == TY_BF16)
        gq_body<8, TY_BF16, 2, 2, false, false, true>(W, S, B, group, x, y, rows, cols, 0, 0, normw, eps, xs, red, 0, 1, cv);
    else
        gq_body<8, TY_F16, 2, 2, false, false, true>(W, S, B, group, x, y, rows, cols, 0, 0, normw, eps, xs, red, 0, 1, cv);
}

/* moe_down_q (decode): x[r] += sum_{k < S} wts[k] * (W[ids[k]*rows + r, :] . h_k),
   h_k = silu(gu[2k, :]) * gu[2k+1, :] (gu [2S, cols]: the gate/up GEMV's output), for MLX 4/8-bit
   experts (f16/bf16 scales, group a power of two). The block stages wts[k] * h_k for all slots
   (S*cols <= 8192 floats, swizzled like the GEMV's x) with per-chunk sums; a row's input is then
   the S slots back to back, chunk c = k*n4 + i read from expert ids[k]. Block 512 (16 warps
   share one staging, which computes S*cols SiLUs and reads 2*S*cols floats), grid at most one
   block per SM, grid-strided over rows: one row per warp with MD_U chunks per lane in flight. */
#define MD_NR 1 /* rows per warp */
#define MD_U 5  /* chunks per lane per trip: a whole row of 9 slots x 512 4-bit columns in flight */
extern "C" __global__ void __launch_bounds__(512, 1) moe_down_q(MoeDownParams_fields) {
    extern __shared__ __align__(16) float xs[]; /* S*cols + S*cols/EPV floats */
    TL_SCOPE("moe_down_q");
    pdl_begin();
    const u32* W = (const u32*)w;
    const u16 *Sc = (const u16*)sc, *B = (const u16*)bi;
    if (bits == 4 && ty == TY_BF16)
        gq_body<4, TY_BF16, MD_NR, MD_U, false, true>(W, Sc, B, group, gu, x, rows, cols, 0, 1, wts, 0.f, xs, 0, ids, S);
    else if (bits == 4)
        gq_body<4, TY_F16, MD_NR, MD_U, false, true>(W, Sc, B, group, gu, x, rows, cols, 0, 1, wts, 0.f, xs, 0, ids, S);
    else if (ty == TY_BF16)
        gq_body<8, TY_BF16, MD_NR, MD_U, false, true>(W, Sc, B, group, gu, x, rows, cols, 0, 1, wts, 0.f, xs, 0, ids, S);
    else
        gq_body<8, TY_F16, MD_NR, MD_U, false, true>(W, Sc, B, group, gu, x, rows, cols, 0, 1, wts, 0.f, xs, 0, ids, S);
}

/* gemv_q2_routed (decode MoE gate/up with the routing folded in): every block first runs the
   top-K of the router logits (route_topk in moe.cu: E routed experts, K chosen, the shared
   expert as slot K), then computes slot z = grid.y of the gate/up GEMV over the 2(K+1) matrices
   2*chosen[z/2] + z%2 of the interleaved gate/up stack (normalized input as gemv_q2).
   Block (0, 0) also writes ids/wts [K+1] for moe_down_q. Saves the separate top-K launch.
   rank 1: the top-K by the whole block (route_rank) instead of one warp (route_topk); 2: by one
   warp in registers (route_topk_reg, where it takes E and K). */
extern "C" __global__ void __launch_bounds__(512) gemv_q2_routed(GemvRoutedParams_fields) {
    extern __shared__ __align__(16) float xs[];
    __shared__ float red[33], ls[1024], wsel[65], rk[32 + 512];
    __shared__ int chosen[65];
    TL_SCOPE("gemv_q2_routed");
    pdl_begin();
    if (rank == 1) {
        route_rank<BarBlock>(logits, E, K, renorm, 1, blockDim.x, ls, rk, chosen, wsel);
    } else {
        if (threadIdx.x < 32) route_warp(rank, logits, E, K, renorm, 1, ls, chosen, wsel);
        __syncthreads();
    }
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x <= K) {
        ids_out[threadIdx.x] = chosen[threadIdx.x];
        wts_out[threadIdx.x] = wsel[threadIdx.x];
    }
    int z = blockIdx.y;
    long long E0 = (long long)(2 * chosen[z >> 1] + (z & 1)) * rows;
    float* yz = y + (long long)z * rows;
    const u32* W = (const u32*)w;
    const u16 *S = (const u16*)sc, *B = (const u16*)bi;
    if (bits == 4 && ty == TY_BF16)
        gq_body<4, TY_BF16, 2, 2, false, false>(W, S, B, group, x, yz, rows, cols, E0, 0, normw, eps, xs, red);
    else if (bits == 4)
        gq_body<4, TY_F16, 2, 2, false, false>(W, S, B, group, x, yz, rows, cols, E0, 0, normw, eps, xs, red);
    else if (ty == TY_BF16)
        gq_body<8, TY_BF16, 2, 2, false, false>(W, S, B, group, x, yz, rows, cols, E0, 0, normw, eps, xs, red);
    else
        gq_body<8, TY_F16, 2, 2, false, false>(W, S, B, group, x, yz, rows, cols, E0, 0, normw, eps, xs, red);
}

/* After the top-K of moe_fused_q / moe_fused_q2 (chosen / wsel in shared memory, visible to the
   block): LILY_CUDA_MOE_FIXED's substitute experts when `fixed` (a measurement switch: 1 experts
   0..K, else every (E/K)-th), the trace stamp 2, and block 0 writes the routing for the host. */
__device__ __forceinline__ void moe_publish_route(int fixed, int E, int K, int* chosen, const float* wsel,
                                                  int* ids_out, float* wts_out, u64* ts) {
    if (fixed) {
        if (threadIdx.x < K) chosen[threadIdx.x] = fixed == 1 ? threadIdx.x : threadIdx.x * (E / K);
        __syncthreads();
    }
    trace_stamp(ts, 2);
    if (blockIdx.x == 0 && threadIdx.x <= K) {
        ids_out[threadIdx.x] = chosen[threadIdx.x];
        wts_out[threadIdx.x] = wsel[threadIdx.x];
    }
}

/* moe_fused_q (decode MoE, batch 1): gemv_q2_routed and moe_down_q in one launch. Grid G >=
   bps * 2(K+1) blocks of 512 threads (one per SM, all resident: G <= SMs; G >= H/16 so that each
   warp has at most one down row). Every block runs the top-K (route_topk), then block
   b < bps * 2(K+1) computes the gate/up rows of slot b / bps with the virtual grid
   (b % bps, bps) into gu; then it arrives at the launch's counter (ctr: u64, zeroed once; launch n
   of a session raises it from nG to (n+1)G, so it never needs resetting), issues the loads of its
   first down-projection rows, waits until all G blocks have arrived, and runs moe_down_q's body on
   the virtual grid (b, G), reading the experts and weights from its own shared top-K. Same result
   as gemv_q2_routed + moe_down_q; saves one launch and its ramp per MoE layer.
   With router weights (wr not null; LILY_CUDA_MOE_ROUTER=fused): first the router's R rows
   (bits_r, group_r, ty_r; the same normalized input) over the whole grid into logits, then the
   blocks meet on ctr (as before the down projections: each meeting raises it by G) before the
   top-K reads them through L2. Saves the router's launch too. */
extern "C" __global__ void __launch_bounds__(512, 1)
    moe_fused_q(MoeFusedParams_fields) {
    extern __shared__ __align__(16) float xs[];
    __shared__ float red[33], ls[1024], wsel[65], rk[32 + 512];
    __shared__ int chosen[65];
    __shared__ u64 s_target;
    /* LILY_CUDA_MOE_TRACE=1: per block the global timer at points of the launch (16 slots) */
    TL_SCOPE("moe_fused_q");
    u64* ts = trace ? trace + 16 * blockIdx.x : nullptr;
    trace_stamp(ts, 0);
    pdl_begin();
    trace_stamp(ts, 1);
    if (wr) {
        const u32* Wr = (const u32*)wr;
        const u16 *Sr = (const u16*)sr, *Br = (const u16*)br;
#define MF_ROUTER(B, T) gq_body<B, T, 2, 2, false, false>(Wr, Sr, Br, group_r, x, logits, R, H, 0, 0, normw, eps, xs, red)
        if (bits_r == 4 && ty_r == TY_BF16) MF_ROUTER(4, TY_BF16);
        else if (bits_r == 4) MF_ROUTER(4, TY_F16);
        else if (ty_r == TY_BF16) MF_ROUTER(8, TY_BF16);
        else MF_ROUTER(8, TY_F16);
#undef MF_ROUTER
        grid_wait(ctr, grid_arrive(ctr, &s_target));
    }
    if (rank == 1) {
        route_rank<BarBlock>(logits, E, K, renorm, 1, 512, ls, rk, chosen, wsel);
    } else {
        if (threadIdx.x < 32) route_warp(rank, logits, E, K, renorm, 1, ls, chosen, wsel);
        __syncthreads();
    }
    moe_publish_route(fixed, E, K, chosen, wsel, ids_out, wts_out, ts);
    const int z = blockIdx.x / bps, bx = blockIdx.x - z * bps;
    const long long E0 = (long long)(2 * chosen[z >> 1] + (z & 1)) * inter;
    float* gz = gu + (long long)z * inter;
    const ConvEpi nc{0, 0, 0, 0, 1};
    const u32 *Wg = (const u32*)wg, *Wd = (const u32*)wd;
    const u16 *Sg = (const u16*)sg, *Bg = (const u16*)bg, *Sd = (const u16*)sd, *Bd = (const u16*)bd;
    u64* ts_up = ts ? ts + 8 : nullptr;
#define MF_UP(B, T) gq_body<B, T, 2, 2, false, false>(Wg, Sg, Bg, group_g, x, gz, inter, H, E0, 0, normw, eps, xs, red, 0, 1, nc, bx, bps, 0, 0, ts_up)
    if (z >= 2 * (K + 1)) {
        /* blocks beyond bps * 2(K+1) only take down-projection rows */
    } else if (bits == 4 && ty == TY_BF16) MF_UP(4, TY_BF16);
    else if (bits == 4) MF_UP(4, TY_F16);
    else if (ty == TY_BF16) MF_UP(8, TY_BF16);
    else MF_UP(8, TY_F16);
#undef MF_UP
    /* this block's gu rows are written (and its staging is free); the wait is in the down
       projection's body, after its first loads */
    trace_stamp(ts, 3);
    const u64 target = grid_arrive(ctr, &s_target);
    u64* ts_down = ts ? ts + 4 : nullptr;
#define MF_DOWN(B, T) gq_body<B, T, MD_NR, MD_U, false, true>(Wd, Sd, Bd, group_d, gu, x, H, inter, 0, acc, wsel, 0.f, xs, 0, chosen, K + 1, nc, blockIdx.x, gridDim.x, ctr, target, ts_down)
    if (bits == 4 && ty == TY_BF16) MF_DOWN(4, TY_BF16);
    else if (bits == 4) MF_DOWN(4, TY_F16);
    else if (ty == TY_BF16) MF_DOWN(8, TY_BF16);
    else MF_DOWN(8, TY_F16);
#undef MF_DOWN
    trace_stamp(ts, 6);
}
