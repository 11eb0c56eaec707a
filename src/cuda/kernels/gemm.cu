/*
 * gemm.cu: weight products for many rows at once (prefill and routed MoE experts), reading MLX
 * affine 4/8-bit or dense f32/f16/bf16 weights and dequantizing on the fly.
 *
 *   Y[m, n] (+)= sum_k X[xr(m), k] * W[e*N + n, k]          m in a tile, n < N, k < K
 *
 * Weights as in linear.cu (packed u32 rows, scales/biases [rows, K/group], W = s*q + b).
 * Row map of the block y ("tile"):
 *   plain (tiles == 0): e = 0, m in [BM*y, min(M, BM*(y+1))), xr(m) = m;
 *   grouped (MoE, tiles from moe_align): tiles = [count, (e, m0, m1) x count]; block y < count
 *     covers m in [m0, m1) of expert e (blocks past count exit); xr(m) = gather[m] / gdiv when
 *     gather is set (the token of routed pair m), else m.
 * X rows have stride ldx, Y rows stride ldy (f32 elements). accumulate != 0 adds into Y.
 *
 * gemm_f32: the exact mode (fp32 FMAs, the whole-model tests against mlx-lm use it).
 *   Block 256 = 8 warps, tile BM = 8 rows m x 8 columns n: warp w owns n = 8*blockIdx.x + w and
 *   keeps 8 accumulators, lanes stride k, so each weight is decoded once per 8 rows.
 *   grid (ceil(N/8), tiles).
 *
 * gemm_bf16: tensor cores, mma.sync.m16n8k16 (bf16 inputs, fp32 accumulation). X is rounded to
 *   bf16 when staged; W is dequantized in fp32 (s*q + b) and rounded to bf16.
 *   Block 256 = 8 warps as 2 (m) x 4 (n); block tile BM x BN 128 x BK 64 with BM = 64
 *   (gemm_bf16: routed experts, short inputs) or 128 (gemm_bf16_m128: long plain products, each
 *   dequantized weight tile then serves twice the rows); warp tile BM/2 x 32 (BM/32 x 4 mma
 *   tiles, BM/2 fp32 accumulators per thread).
 *   Shared: Xs [BM][72] and Ws [128][72] bf16 (rows padded by 8 so the 8 row addresses of each
 *   ldmatrix phase, 144 bytes apart, hit distinct 16-byte bank groups).
 *   Staging: thread i loads X rows 64p + i/4, columns 16*(i%4).. (4 float4 per 64-row pass) and W
 *   row i/2, columns 32*(i%2).. (one uint4 of 4-bit codes, two of 8-bit, one scale/bias pair
 *   since group >= 32). The next k-step's global loads are issued into registers before the
 *   current step's mma (register double buffering, one shared buffer).
 *   Fragments by ldmatrix.x4 (PTX m16n8k16 .bf16 layouts): A reg j: row g + 8*(j&1),
 *   k 2t + 8*(j>>1); B reg j: n g, k 2t + 8j; C: rows g, g+8, columns 2t, 2t+1 (g = lane/4,
 *   t = lane%4). grid (ceil(N/128), tiles). Requires K % 32 == 0.
 */
struct GemmTile {
    int e, m0, m1;
};

__device__ __forceinline__ bool gemm_tile(const int* tiles, int M, int BM, GemmTile& t) {
    if (!tiles) {
        t.e = 0;
        t.m0 = blockIdx.y * BM;
        t.m1 = min(M, t.m0 + BM);
        return t.m0 < M;
    }
    if ((int)blockIdx.y >= tiles[0]) return false;
    const int* p = tiles + 1 + 3 * blockIdx.y;
    t.e = p[0];
    t.m0 = p[1];
    t.m1 = p[2];
    return true;
}

__device__ __forceinline__ long long gemm_xrow(const int* gather, int gdiv, int m) {
    return gather ? (long long)(gather[m] / gdiv) : (long long)m;
}

/* The product kernels take GemmParams_fields (src/cuda/params.rs): w, sc, bi, bits, group, ty,
   x, ldx, gather, gdiv, y, ldy, m, n, k, tiles, accumulate, kq, ksplit, part, tickets; the
   bodies name the shape M, N, K. */
#define GEMM_SHAPE const int M = m, N = n, K = k

#define GF_BM 8
extern "C" __global__ void gemm_f32(GemmParams_fields) {
    GEMM_SHAPE;
    GemmTile tl;
    if (!gemm_tile(tiles, M, GF_BM, tl)) return;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int on = blockIdx.x * 8 + warp; /* this warp's output column */
    if (on >= N) return;
    int nm = tl.m1 - tl.m0;
    const float* xr[GF_BM];
#pragma unroll
    for (int i = 0; i < GF_BM; i++) xr[i] = x + gemm_xrow(gather, gdiv, tl.m0 + min(i, nm - 1)) * ldx;
    long long row = (long long)tl.e * N + on;
    float acc[GF_BM];
#pragma unroll
    for (int i = 0; i < GF_BM; i++) acc[i] = 0.f;
    for (int c = lane; c < K; c += 32) {
        float wv = dequant_elem(w, sc, bi, bits, group, ty, row, K, c);
#pragma unroll
        for (int i = 0; i < GF_BM; i++)
            if (i < nm) acc[i] += wv * xr[i][c];
    }
#pragma unroll
    for (int i = 0; i < GF_BM; i++) {
        float a = warp_sum(acc[i]);
        if (lane == 0 && i < nm) {
            float* o = y + (long long)(tl.m0 + i) * ldy + on;
            *o = accumulate ? *o + a : a;
        }
    }
}

/* f32 -> bf16 bits, round to nearest even (inputs are finite). */
__device__ __forceinline__ u32 bf16_bits(float f) {
    u32 u = __float_as_uint(f);
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) { return bf16_bits(lo) | (bf16_bits(hi) << 16); }

#define TC_BN 128
#define TC_BK 64
#define TC_LD 72 /* bf16 per shared row */

__device__ __forceinline__ void ldsm_x4(u32& r0, u32& r1, u32& r2, u32& r3, const void* p) {
    u32 a = (u32)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(a));
}

/* The warp's MI x 4 mma tiles of C (rows r0 + 16*mi + g (+8) of the tile, columns c0 + 8*ni + 2t4
   (+1)) into Y rows below tl.m1 and columns below N, added when accumulate. */
template <int MI>
__device__ __forceinline__ void gemm_store(const float (&acc)[MI][4][4], const GemmTile& tl, int r0, int c0, int lane,
                                           float* y, long long ldy, int N, int accumulate) {
    int g = lane >> 2, t4 = lane & 3;
#pragma unroll
    for (int mi = 0; mi < MI; mi++)
#pragma unroll
        for (int ni = 0; ni < 4; ni++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int m = tl.m0 + r0 + mi * 16 + g + 8 * h;
                int n = c0 + ni * 8 + 2 * t4;
                if (m < tl.m1) {
                    float* o = y + (long long)m * ldy + n;
#pragma unroll
                    for (int c = 0; c < 2; c++)
                        if (n + c < N) o[c] = accumulate ? o[c] + acc[mi][ni][2 * h + c] : acc[mi][ni][2 * h + c];
                }
            }
}

/* MI m16 tiles per warp in m: block tile BM = 32*MI (2 warps in m) x 128 (4 warps in n). BITS is
   the weight format (4, 8, or 0 = dense), a template parameter so each instantiation holds only
   its own prefetch registers. */
template <int MI, int BITS>
__device__ __forceinline__ void gemm_bf16_body(const void* w, const void* sc, const void* bi, int group,
                                               int ty, const float* x, long long ldx, const int* gather, int gdiv,
                                               float* y, long long ldy, int M, int N, int K, const int* tiles,
                                               int accumulate, u16* Xs, u16* Ws) {
    constexpr int BM = 32 * MI, XP = BM / 64; /* X staging passes of 64 rows */
    GemmTile tl;
    if (!gemm_tile(tiles, M, BM, tl)) return;
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    int n0 = blockIdx.x * TC_BN;

    /* staging roles: X rows p*64 + tid/4, columns 16*(tid%4)..; W row tid/2, columns 32*(tid%2).. */
    int xrow = tid >> 2, xseg = (tid & 3) * 16;
    const float* xp[XP];
    bool xvalid[XP];
#pragma unroll
    for (int p = 0; p < XP; p++) {
        int m = tl.m0 + p * 64 + xrow;
        xvalid[p] = m < tl.m1;
        xp[p] = x + (xvalid[p] ? gemm_xrow(gather, gdiv, m) : 0) * ldx;
    }
    int wrow = tid >> 1, wseg = (tid & 1) * 32;
    bool wvalid = n0 + wrow < N;
    long long wr = (long long)tl.e * N + n0 + (wvalid ? wrow : 0);

    constexpr int bits = BITS;
    float4 xv[XP][4];
    uint4 qv[2];
    float ws = 0.f, wb = 0.f;
    float wd[BITS == 0 ? 32 : 1]; /* dense weights */

    auto load = [&](int k0) {
        int kx = k0 + xseg;
#pragma unroll
        for (int p = 0; p < XP; p++)
#pragma unroll
            for (int j = 0; j < 4; j++)
                xv[p][j] = (xvalid[p] && kx < K) ? ((const float4*)(xp[p] + kx))[j] : make_float4(0.f, 0.f, 0.f, 0.f);
        int kw = k0 + wseg;
        bool ok = wvalid && kw < K;
        if (bits == 4) {
            qv[0] = ok ? ((const uint4*)((const u32*)w + wr * (K / 8) + kw / 8))[0] : make_uint4(0, 0, 0, 0);
        } else if (bits == 8) {
            const uint4* q8 = (const uint4*)((const u32*)w + wr * (K / 4) + kw / 4);
            qv[0] = ok ? q8[0] : make_uint4(0, 0, 0, 0);
            qv[1] = ok ? q8[1] : make_uint4(0, 0, 0, 0);
        } else {
#pragma unroll
            for (int j = 0; j < 32; j++) wd[BITS == 0 ? j : 0] = ok ? load_elem(w, wr * K + kw + j, ty) : 0.f;
        }
        if (bits) {
            long long gi = wr * (K / group) + kw / group;
            ws = ok ? load_elem(sc, gi, ty) : 0.f;
            wb = ok ? load_elem(bi, gi, ty) : 0.f;
        }
    };
    auto store = [&]() {
#pragma unroll
        for (int p = 0; p < XP; p++) {
            u32 px[8];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                px[2 * j] = pack_bf16(xv[p][j].x, xv[p][j].y);
                px[2 * j + 1] = pack_bf16(xv[p][j].z, xv[p][j].w);
            }
            uint4* dx = (uint4*)(Xs + (p * 64 + xrow) * TC_LD + xseg);
            dx[0] = make_uint4(px[0], px[1], px[2], px[3]);
            dx[1] = make_uint4(px[4], px[5], px[6], px[7]);
        }
        float f[32];
        if (bits == 4) {
            u32 wd4[4] = {qv[0].x, qv[0].y, qv[0].z, qv[0].w};
#pragma unroll
            for (int j = 0; j < 32; j++) f[j] = ws * (float)((wd4[j >> 3] >> (4 * (j & 7))) & 15u) + wb;
        } else if (bits == 8) {
            u32 wd8[8] = {qv[0].x, qv[0].y, qv[0].z, qv[0].w, qv[1].x, qv[1].y, qv[1].z, qv[1].w};
#pragma unroll
            for (int j = 0; j < 32; j++) f[j] = ws * (float)((wd8[j >> 2] >> (8 * (j & 3))) & 255u) + wb;
        } else {
#pragma unroll
            for (int j = 0; j < 32; j++) f[j] = wd[BITS == 0 ? j : 0];
        }
        u32 pw[16];
#pragma unroll
        for (int j = 0; j < 16; j++) pw[j] = pack_bf16(f[2 * j], f[2 * j + 1]);
        uint4* dw = (uint4*)(Ws + wrow * TC_LD + wseg);
#pragma unroll
        for (int j = 0; j < 4; j++) dw[j] = make_uint4(pw[4 * j], pw[4 * j + 1], pw[4 * j + 2], pw[4 * j + 3]);
    };

    float acc[MI][4][4];
#pragma unroll
    for (int a = 0; a < MI; a++)
#pragma unroll
        for (int b = 0; b < 4; b++)
#pragma unroll
            for (int c = 0; c < 4; c++) acc[a][b][c] = 0.f;

    int wm = warp >> 2, wn = warp & 3, g = lane >> 2, t4 = lane & 3;
    /* ldmatrix row addresses: A (16 x 16 tile): lane l -> row l%16, k + 8*(l/16);
       B (two n8 tiles x k16): lane l -> n (l%8) + 8*(l/16), k + 8*((l/8)%2) */
    int a_row = lane & 15, a_k = (lane >> 4) * 8;
    int b_row = (lane & 7) + 8 * (lane >> 4), b_k = ((lane >> 3) & 1) * 8;
    int nk = (K + TC_BK - 1) / TC_BK;
    load(0);
    for (int kt = 0; kt < nk; kt++) {
        store();
        __syncthreads();
        if (kt + 1 < nk) load((kt + 1) * TC_BK);
#pragma unroll
        for (int ks = 0; ks < TC_BK / 16; ks++) {
            u32 af[MI][4], bf[4][2];
#pragma unroll
            for (int mi = 0; mi < MI; mi++)
                ldsm_x4(af[mi][0], af[mi][1], af[mi][2], af[mi][3],
                        Xs + (wm * 16 * MI + mi * 16 + a_row) * TC_LD + ks * 16 + a_k);
#pragma unroll
            for (int np = 0; np < 2; np++)
                ldsm_x4(bf[2 * np][0], bf[2 * np][1], bf[2 * np + 1][0], bf[2 * np + 1][1],
                        Ws + (wn * 32 + np * 16 + b_row) * TC_LD + ks * 16 + b_k);
#pragma unroll
            for (int mi = 0; mi < MI; mi++)
#pragma unroll
                for (int ni = 0; ni < 4; ni++)
                    asm volatile(
                        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                        "{%8,%9}, {%0,%1,%2,%3};\n"
                        : "+f"(acc[mi][ni][0]), "+f"(acc[mi][ni][1]), "+f"(acc[mi][ni][2]), "+f"(acc[mi][ni][3])
                        : "r"(af[mi][0]), "r"(af[mi][1]), "r"(af[mi][2]), "r"(af[mi][3]), "r"(bf[ni][0]),
                          "r"(bf[ni][1]));
        }
        __syncthreads();
    }
    gemm_store<MI>(acc, tl, wm * 16 * MI, n0 + wn * 32, lane, y, ldy, N, accumulate);
}

/* BM 64: routed experts (about 64 rows per expert in a 2048-token chunk) and short inputs. */
#define GEMM_BF16_DISPATCH(MI)                                                                                   \
    if (bits == 4)                                                                                               \
        gemm_bf16_body<MI, 4>(w, sc, bi, group, ty, x, ldx, gather, gdiv, y, ldy, M, N, K, tiles, accumulate, Xs, Ws); \
    else if (bits == 8)                                                                                          \
        gemm_bf16_body<MI, 8>(w, sc, bi, group, ty, x, ldx, gather, gdiv, y, ldy, M, N, K, tiles, accumulate, Xs, Ws); \
    else                                                                                                         \
        gemm_bf16_body<MI, 0>(w, sc, bi, group, ty, x, ldx, gather, gdiv, y, ldy, M, N, K, tiles, accumulate, Xs, Ws);

extern "C" __global__ void __launch_bounds__(256, 2) gemm_bf16(GemmParams_fields) {
    GEMM_SHAPE;
    __shared__ __align__(16) u16 Xs[64 * TC_LD];
    __shared__ __align__(16) u16 Ws[TC_BN * TC_LD];
    GEMM_BF16_DISPATCH(2)
}

/* BM 128: long plain products (each dequantized weight tile serves twice the rows). */
extern "C" __global__ void __launch_bounds__(256, 1) gemm_bf16_m128(GemmParams_fields) {
    GEMM_SHAPE;
    __shared__ __align__(16) u16 Xs[128 * TC_LD];
    __shared__ __align__(16) u16 Ws[TC_BN * TC_LD];
    GEMM_BF16_DISPATCH(4)
}
