/*
 * gemm_pipe.cu: the many-row weight product of gemm.cu (same math, row maps, tiles and
 *   arguments: Y[m, n] (+)= sum_k X[xr(m), k] * W[e*N + n, k], W = s*q + b from MLX 4-bit codes)
 *   with the inputs streamed through a cp.async pipeline and the weights dequantized straight into
 *   mma fragments. Numerics as gemm_bf16 up to the weight rounding: X rounded to bf16, s*q + b
 *   rounded to bf16 once (by a bf16x2 fma), mma.sync m16n8k16 with fp32 accumulation.
 *
 * k order: the dot product may visit k in any order as long as both operands use the same one.
 *   Within a 64-column k-tile, thread t4 = lane % 4 owns the physical columns 16*t4 .. 16*t4 + 15:
 *   its codes are two words (8 bytes, one load, inside one quantization group as group % 16 == 0).
 *   Word hw covers columns c = 16*t4 + 8*hw + 0..7 (nibble i = column c + i); k-step 2hw presents
 *   nibbles {0, 4, 1, 5} and k-step 2hw + 1 nibbles {2, 6, 3, 7} as the mma's logical
 *   k = {2t4, 2t4+1, 2t4+8, 2t4+9}, so each bf16x2 weight register is the nibble pair at bits 0-3
 *   and 16-19 of the word shifted by 4j (one AND-OR, then two bf16x2 FMAs: 128 + q exact, then
 *   s*q + b rounded once; scales and biases bf16), and the inputs of a word are two float4s.
 *
 * Launch: block 256 = 8 warps as 2 (m) x 4 (n), block tile BM = 32*MI rows x 128 weight rows,
 *   warp tile 16*MI x 32 (MI m16 tiles x 4 n8 tiles, 16*MI fp32 accumulators per thread).
 *   grid (ceil(N/128), tiles) as gemm_bf16 (MI = 2, BM 64: grouped experts and shorter inputs)
 *   and gemm_bf16_m128 (MI = 4, BM 128: plain products of many rows).
 *   Shared memory: 4 stages, each the k-tile's inputs X [BM][64] fp32 and the codes of the block's
 *   128 weight rows [128][32 bytes] (BM*1024 + 16384 bytes in all), filled by cp.async (16 bytes
 *   per copy; input rows past the tile zero-filled, weight rows past N clamped), so three k-tiles
 *   of weights are in flight from memory while one is computed. X's 16-byte chunk c of row r is at
 *   c ^ ((c >> 3) << 1) ^ (r & 1) so the 8 lanes of each float4 load phase (2 rows x 4 chunks)
 *   hit 8 distinct bank groups. One __syncthreads per k-tile: the copy into the stage read two
 *   tiles ago is issued after it. Each thread reads the 8 code bytes of its 4 weight rows
 *   (n0 + 32*wn + 8*ni + g) per k-tile from the stage, and their scale/bias (cached: a row's
 *   scales are contiguous) into registers one k-tile ahead (kept as loaded until used).
 *   Requires K % 64 == 0.
 */
#define GP_STAGES 4

__device__ __forceinline__ u32 gp_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
/* Two codes at bits 0-3 and 16-19 of c to bf16x2 s*q + b: 0x4300 | q is the bf16 128 + q, minus
   128 is exact, and the fma rounds s*q + b once. */
__device__ __forceinline__ u32 gp_dq2(u32 c, u32 s2, u32 b2) {
    u32 h = c | 0x43004300u, q, r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(q) : "r"(h), "r"(0x3f803f80u), "r"(0xc300c300u));
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(r) : "r"(q), "r"(s2), "r"(b2));
    return r;
}
__device__ __forceinline__ u32 gp_xoff(int r, int c) { return (u32)(r * 256 + ((c ^ ((c >> 3) << 1) ^ (r & 1)) << 4)); }

template <int MI>
__device__ __forceinline__ void gemm_pipe_body(const void* w, const void* sc, const void* bi, int group, int ty,
                                               const float* x, long long ldx, const int* gather, int gdiv, float* y,
                                               long long ldy, int M, int N, int K, const int* tiles, int accumulate) {
    constexpr int BM = 32 * MI, CPT = BM * 16 / 256; /* 16-byte X chunks per thread per stage */
    extern __shared__ __align__(128) unsigned char gp_sm[];
    GemmTile tl;
    if (!gemm_tile(tiles, M, BM, tl)) return;
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    int wm = warp >> 2, wn = warp & 3;
    int n0 = blockIdx.x * 128;
    u32 sX = (u32)__cvta_generic_to_shared(gp_sm);
    const u32 XB = BM * 256, STAGE = XB + 128 * 32; /* [BM][64] fp32 inputs, then [128][32 bytes] codes */

    /* X copy roles: chunk c = tid % 16 of rows tid/16 + 16*j */
    int xr[CPT]; /* input row of each copy, -1 past the tile (zero-filled) */
#pragma unroll
    for (int j = 0; j < CPT; j++) {
        int m = tl.m0 + tid / 16 + 16 * j;
        xr[j] = m < tl.m1 ? (int)gemm_xrow(gather, gdiv, m) : -1;
    }
    const float* xk = x + (tid & 15) * 4;
    auto load_x = [&](int kt, int st) {
#pragma unroll
        for (int j = 0; j < CPT; j++)
            cp_async16(sX + st * STAGE + gp_xoff(tid / 16 + 16 * j, tid & 15),
                       xk + (long long)max(xr[j], 0) * ldx + kt * 64, xr[j] < 0 ? 0 : 16);
    };

    /* W code copy: row tid/2 of the block's 128, 16-byte half tid%2 of its 32 bytes per k-tile */
    const u32* wsrc = (const u32*)w + ((long long)tl.e * N + min(n0 + tid / 2, N - 1)) * (K / 8) + (tid & 1) * 4;
    auto load_wc = [&](int kt, int st) { cp_async16(sX + st * STAGE + XB + tid * 16, wsrc + kt * 8, 16); };

    /* W rows of this thread (clamped: rows past N compute garbage that is never written) */
    long long wrow[4];
#pragma unroll
    for (int ni = 0; ni < 4; ni++) wrow[ni] = (long long)tl.e * N + min(n0 + wn * 32 + ni * 8 + g, N - 1);
    /* bf16 scale and bias of each row: the current k-tile's in both halves (cs, cb), the next
       one's as loaded (ns, nb: doubled only where they become current, so the warp does not
       wait for the load when it is issued) */
    u32 cs[4], cb[4], ns[4], nb[4];
    auto load_sb = [&](int kt, u32 (&s1)[4], u32 (&b1)[4]) {
        int k = kt * 64 + 16 * t4;
#pragma unroll
        for (int ni = 0; ni < 4; ni++) {
            long long gi = wrow[ni] * (K / group) + k / group;
            s1[ni] = ((const u16*)sc)[gi];
            b1[ni] = ((const u16*)bi)[gi];
        }
    };
    auto make_current = [&]() {
#pragma unroll
        for (int ni = 0; ni < 4; ni++) {
            cs[ni] = ns[ni] * 0x10001u;
            cb[ni] = nb[ni] * 0x10001u;
        }
    };

    float acc[MI][4][4];
#pragma unroll
    for (int a = 0; a < MI; a++)
#pragma unroll
        for (int b = 0; b < 4; b++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[a][b][c] = 0.f;

    int nk = K / 64;
#pragma unroll
    for (int st = 0; st < GP_STAGES - 1; st++) {
        if (st < nk) {
            load_x(st, st);
            load_wc(st, st);
        }
        cp_async_commit();
    }
    load_sb(0, ns, nb);
    make_current();
    for (int kt = 0; kt < nk; kt++) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(GP_STAGES - 2) : "memory");
        __syncthreads();
        if (kt + GP_STAGES - 1 < nk) {
            load_x(kt + GP_STAGES - 1, (kt + GP_STAGES - 1) % GP_STAGES);
            load_wc(kt + GP_STAGES - 1, (kt + GP_STAGES - 1) % GP_STAGES);
        }
        cp_async_commit();
        if (kt + 1 < nk) load_sb(kt + 1, ns, nb);
        const unsigned char* xs = gp_sm + (kt % GP_STAGES) * STAGE;
        u32 cw[4][2]; /* this thread's 16 codes of each of its rows */
#pragma unroll
        for (int ni = 0; ni < 4; ni++) {
            uint2 v = *(const uint2*)(xs + XB + (wn * 32 + ni * 8 + g) * 32 + t4 * 8);
            cw[ni][0] = v.x;
            cw[ni][1] = v.y;
        }
#pragma unroll
        for (int hw = 0; hw < 2; hw++) { /* code word hw: k-steps 2hw and 2hw + 1 */
            u32 bf[4][4];            /* nibble pairs (0,4) (1,5) | (2,6) (3,7) of the word, dequantized */
#pragma unroll
            for (int ni = 0; ni < 4; ni++) {
                u32 v = cw[ni][hw];
#pragma unroll
                for (int j = 0; j < 4; j++) bf[ni][j] = gp_dq2((v >> (4 * j)) & 0x000f000fu, cs[ni], cb[ni]);
            }
#pragma unroll
            for (int mi = 0; mi < MI; mi++) {
                int r = wm * 16 * MI + mi * 16 + g;
                /* this thread's columns 16*t4 + 8*hw + 0..3 (lo) and 4..7 (hi), rows g and g + 8 */
                float4 lo0 = *(const float4*)(xs + gp_xoff(r, 4 * t4 + 2 * hw));
                float4 hi0 = *(const float4*)(xs + gp_xoff(r, 4 * t4 + 2 * hw + 1));
                float4 lo1 = *(const float4*)(xs + gp_xoff(r + 8, 4 * t4 + 2 * hw));
                float4 hi1 = *(const float4*)(xs + gp_xoff(r + 8, 4 * t4 + 2 * hw + 1));
                u32 a0 = gp_bf16x2(lo0.x, hi0.x), a1 = gp_bf16x2(lo1.x, hi1.x);
                u32 a2 = gp_bf16x2(lo0.y, hi0.y), a3 = gp_bf16x2(lo1.y, hi1.y);
#pragma unroll
                for (int ni = 0; ni < 4; ni++) mma_bf16(acc[mi][ni], a0, a1, a2, a3, bf[ni][0], bf[ni][1]);
                a0 = gp_bf16x2(lo0.z, hi0.z), a1 = gp_bf16x2(lo1.z, hi1.z);
                a2 = gp_bf16x2(lo0.w, hi0.w), a3 = gp_bf16x2(lo1.w, hi1.w);
#pragma unroll
                for (int ni = 0; ni < 4; ni++) mma_bf16(acc[mi][ni], a0, a1, a2, a3, bf[ni][2], bf[ni][3]);
            }
        }
        make_current();
    }
    gemm_store<MI>(acc, tl, wm * 16 * MI, n0 + wn * 32, lane, y, ldy, N, accumulate);
}

#define GEMM_PIPE(NAME, MI, MINB)                                                                              \
    extern "C" __global__ void __launch_bounds__(256, MINB)                                                    \
        NAME(GemmParams_fields) {                                                                              \
        GEMM_SHAPE;                                                                                            \
        gemm_pipe_body<MI>(w, sc, bi, group, ty, x, ldx, gather, gdiv, y, ldy, M, N, K, tiles, accumulate);    \
    }
GEMM_PIPE(gemm_pipe64, 2, 1)
GEMM_PIPE(gemm_pipe128, 4, 1)
