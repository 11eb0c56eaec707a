/*
 * gemm_wt.cu: gemm_wg's product (same math, k order, dequantization and output; see gemm_wg.cu)
 *   with its tiles brought in by the Tensor Memory Accelerator and its wgmmas kept in flight
 *   across k-tiles (sm_90a), for MLX 4-bit and 8-bit codes (bf16 scales and biases, groups of a
 *   power of two from 16) and dense bf16 weights (BITS 4, 8, 16):
 *   Y[m, n] (+)= sum_k X[m, k] * W[e*N + n, k], X the bf16 k-permuted rows of x_bf16_perm's
 *   layout, not gathered: plain products, and grouped products whose inputs are already in the
 *   tile list's row order (silu_mul_pairs_perm's, for the down projections).
 *
 * Why: ncu of gemm_wg (docs/perf-log.md, session 25) has the tensor pipe ~22% busy, the warps
 *   waiting on the load/store unit's queue behind their ten 16-byte cp.async per k-tile
 *   (long-scoreboard 31%, lg-throttle 12%) and at the block barrier of every k-tile (12%), and
 *   each k-tile's wgmmas drain before the next one's dequantization starts. Here one thread
 *   issues three TMA copies per k-tile (nothing per thread, no block barrier in the loop), and
 *   each warpgroup keeps one 64-column half of wgmmas in flight while it dequantizes the next.
 *
 * Shared memory (from a 1024-byte aligned base), per stage:
 *   X: chunk 0 then chunk 1 of the k-tile (64 columns each), each BT rows x 128 bytes in the
 *      128-byte swizzle, as TMA writes a box {64 columns, BT rows} of the map xm (bf16 [rows][K]).
 *      That is wgmma's K-major SW128 layout: 8-row atoms of 1024 bytes (SBO), the 16 columns of
 *      k-step s at byte 32s of a row (the descriptor's start moves by 32s; the swizzle is applied
 *      by the hardware on the address bits, so every atom must start 1024-aligned).
 *   W: the block's 128 weight rows x CB = 16 BITS bytes (the k-tile's 128 columns: 64 bytes of
 *      4-bit codes, 128 of 8-bit, 256 of bf16), a box {CB bytes, 128 rows} of wm (u8
 *      [E*N][K*BITS/8], no swizzle): row-major [128][CB] (gemm_wg's [128][64] at 4 bits). Rows
 *      past an expert's N (or past the stack: zero-filled) are read and never stored, as
 *      gemm_wg's clamped rows.
 *   A fragments (thread g = lane/4, t = lane%4 owns physical columns 16t..16t+15 of each 64-column
 *      half, gemm_wg's k order): 4 bits as gemm_wg (wg_dq_half); 8 bits: its 16 bytes of a row by
 *      one 16-byte load, each code q made exact in fp32 (the byte under the exponent of 2^23,
 *      minus 2^23), s*q + b by an fp32 fma, each pair rounded to bf16 by one cvt; bf16: its 32
 *      bytes by two 16-byte loads, the pairs of columns (c, c+4) gathered by byte permutes.
 *   Each stage has a "full" mbarrier, armed by the issuing thread with the stage's bytes (a box
 *   always completes its whole size, rows past the map included) and completed by the copies.
 *   A stage is refilled once both warpgroups' wgmmas on it completed: the first thread of each
 *   warpgroup adds one to the stage's release count, and the second to arrive issues the copies
 *   of the k-tile S on.
 *
 * Per k-tile kt (stage kt % S), each warpgroup: wait for "full"; load the next k-tile's scales
 *   and biases (global, as gemm_wg); dequantize half 0 into A buffer 0, fence, issue its 4 NB
 *   wgmmas, commit; wait until one group is pending (half 1 of kt - 1 complete: release its
 *   stage); dequantize half 1 into buffer 1, issue, commit; wait until one is pending (half 0 of
 *   kt complete: buffer 0 free again).
 *
 * Launch: as gemm_wg (block 256 = 2 warpgroups with gemm_wg's rows, grid (ceil(N/128), row tiles
 *   or tile list, ksplit), split K and the epilogue shared: wg_finish); the maps are in
 *   GemmParams (xm: box {64, BT}, SW128; wm: box {64, 128}), encoded by the host per launch.
 *   Dynamic shared memory WT_STAGES(NB, BITS) * (BT*256 + 128*CB) + 1024 bytes (the stage
 *   counts fill up to ~216 KB, or ~97 KB at NB = 1: two blocks per SM). Programmatic dependent
 *   launch as gemm_wg: codes and scales before pdl_wait(), inputs (and a tile list) after it.
 */
/* stages by tile height and weight bits: kernel_names.rs gemm_wt_smem mirrors this table */
#define WT_STAGES(NB, BITS)                                                                                   \
    ((NB) == 4 ? ((BITS) == 4 ? 3 : 2) : (NB) == 2 ? ((BITS) == 4 ? 5 : (BITS) == 8 ? 4 : 3)                  \
               : ((BITS) == 4 ? 4 : (BITS) == 8 ? 3 : 2))

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* A 2D box of `map` at coordinates (c0 innermost, c1) into shared memory at dst, completing on bar. */
__device__ __forceinline__ void tma_2d(u32 dst, const TmaMap* map, int c0, int c1, u64* bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::"r"(
            dst),
        "l"((unsigned long long)map), "r"(c0), "r"(c1), "r"(smem_u32(bar))
        : "memory");
}
/* K-major B descriptor in the 128-byte swizzle: start, LBO 16 (unused), SBO 1024, layout 1. */
__device__ __forceinline__ u64 wt_desc(u32 saddr) {
    return (u64)((saddr & 0x3FFFFu) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}
/* mb_wait with a bring-up guard: a wait that lasts ~4e9 cycles traps (a kernel error, not a hang). */
__device__ __forceinline__ void wt_wait(u64* b, u32 parity) {
    u32 a = smem_u32(b), done = 0;
    long long t0 = clock64();
    while (true) {
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, %3; selp.u32 %0, 1, 0, p; }"
            : "=r"(done)
            : "r"(a), "r"(parity), "n"(20000)
            : "memory");
        if (done) return;
        if (clock64() - t0 > 4000000000ll) __trap();
    }
}
template <int P>
__device__ __forceinline__ void wg_wait_pending() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(P) : "memory");
}

/* 8-bit code in byte k of w, exact in fp32: 2^23 + q with q under the exponent, minus 2^23 */
__device__ __forceinline__ float wt_q8(u32 w, int k) {
    return __uint_as_float(__byte_perm(w, 0x4B000000u, 0x7440 | k)) - 8388608.f;
}
/* bf16 pair (byte k of wa, byte k of wb) as s*q + b */
__device__ __forceinline__ u32 wt_dq8(u32 wa, u32 wb, int k, float s, float b) {
    float lo = fmaf(s, wt_q8(wa, k), b), hi = fmaf(s, wt_q8(wb, k), b);
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

/* The 4 NB wgmmas of one 64-column half (A registers a, the stage's X chunk at shared address xs:
   BT rows of 128 swizzled bytes), fenced before and committed as one group. */
template <int NB>
__device__ __forceinline__ void wt_mma_half(float (&acc)[NB][32], const u32 (&a)[4][4], u32 xs) {
    wg_fence();
#pragma unroll
    for (int s = 0; s < 4; s++)
#pragma unroll
        for (int j = 0; j < NB; j++) wgmma_m64n64(acc[j], a[s], wt_desc(xs + j * 64 * 128 + s * 32));
    wg_commit();
}

/* One 64-column half h of a k-tile as A registers (the layout of wg_dq_half): cod is the stage's
   [128][16 BITS] weight rows. */
template <int BITS>
__device__ __forceinline__ void wt_half(u32 (&a)[4][4], const unsigned char* cod, int rb0, int rb1, int h, int t4,
                                        const u32 (&sb)[2][2][2]) {
    if constexpr (BITS == 4) {
        wg_dq_half(a, cod, rb0, rb1, h, t4, sb);
    } else if constexpr (BITS == 8) {
        uint4 c0 = *(const uint4*)(cod + rb0 * 128 + h * 64 + t4 * 16);
        uint4 c1 = *(const uint4*)(cod + rb1 * 128 + h * 64 + t4 * 16);
        const u32 w0[4] = {c0.x, c0.y, c0.z, c0.w}, w1[4] = {c1.x, c1.y, c1.z, c1.w};
        float s0 = bf16_to_f32((u16)sb[h][0][0]), b0 = bf16_to_f32((u16)sb[h][0][1]);
        float s1 = bf16_to_f32((u16)sb[h][1][0]), b1 = bf16_to_f32((u16)sb[h][1][1]);
#pragma unroll
        for (int s = 0; s < 4; s++) {
            int wi = 2 * (s >> 1), k = 2 * (s & 1); /* columns 8(s>>1) + 2(s&1) + {0, 4} (+1) */
            a[s][0] = wt_dq8(w0[wi], w0[wi + 1], k, s0, b0);
            a[s][1] = wt_dq8(w1[wi], w1[wi + 1], k, s1, b1);
            a[s][2] = wt_dq8(w0[wi], w0[wi + 1], k + 1, s0, b0);
            a[s][3] = wt_dq8(w1[wi], w1[wi + 1], k + 1, s1, b1);
        }
    } else {
        const unsigned char* p0 = cod + rb0 * 256 + h * 128 + t4 * 32;
        const unsigned char* p1 = cod + rb1 * 256 + h * 128 + t4 * 32;
        uint4 x0 = *(const uint4*)p0, y0 = *(const uint4*)(p0 + 16);
        uint4 x1 = *(const uint4*)p1, y1 = *(const uint4*)(p1 + 16);
        const u32 w0[8] = {x0.x, x0.y, x0.z, x0.w, y0.x, y0.y, y0.z, y0.w};
        const u32 w1[8] = {x1.x, x1.y, x1.z, x1.w, y1.x, y1.y, y1.z, y1.w};
#pragma unroll
        for (int s = 0; s < 4; s++) {
            int j = 4 * (s >> 1) + (s & 1); /* word of columns 8(s>>1) + 2(s&1) (+1); +4 is j + 2 */
            a[s][0] = __byte_perm(w0[j], w0[j + 2], 0x5410);
            a[s][1] = __byte_perm(w1[j], w1[j + 2], 0x5410);
            a[s][2] = __byte_perm(w0[j], w0[j + 2], 0x7632);
            a[s][3] = __byte_perm(w1[j], w1[j + 2], 0x7632);
        }
    }
}
#endif

template <int NB, int BITS>
__device__ __forceinline__ void gemm_wt_body(const void* sc, const void* bi, int group, const TmaMap* xm,
                                             const TmaMap* wm, float* y, long long ldy, int M, int N, int K,
                                             const int* tiles, int accumulate, int ksplit, float* part,
                                             unsigned* tickets) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int S = WT_STAGES(NB, BITS), BT = 64 * NB, XC = BT * 128, CB = 16 * BITS, STAGE = 2 * XC + 128 * CB;
    extern __shared__ __align__(1024) unsigned char wt_sm[];
    __shared__ __align__(8) u64 full[S];
    __shared__ unsigned rel[S];
    pdl_trigger();
    if (tiles) pdl_wait();
    GemmTile tl;
    if (!gemm_tile(tiles, M, BT, tl)) {
        pdl_wait();
        return;
    }
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const int n0 = blockIdx.x * 128;
    const u32 raw = smem_u32(wt_sm), s0 = (raw + 1023u) & ~1023u;
    const unsigned char* sm = wt_sm + (s0 - raw);
    const int kb = (int)blockIdx.z * (K / 128) / ksplit, nk = ((int)blockIdx.z + 1) * (K / 128) / ksplit - kb;
    const int wrow = tl.e * N + n0;
    if (tid == 0) {
        for (int i = 0; i < S; i++) {
            mb_init(&full[i], 1);
            rel[i] = 0;
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    auto load_w = [&](int kt) { tma_2d(s0 + (kt % S) * STAGE + 2 * XC, wm, (kb + kt) * CB, wrow, &full[kt % S]); };
    auto load_x = [&](int kt) {
        u32 d = s0 + (kt % S) * STAGE;
        int c = (kb + kt) * 128;
        tma_2d(d, xm, c, tl.m0, &full[kt % S]);
        tma_2d(d + XC, xm, c + 64, tl.m0, &full[kt % S]);
    };
    if (tid == 0)
        for (int kt = 0; kt < min(S, nk); kt++) {
            mb_expect(&full[kt], STAGE);
            load_w(kt);
        }

    const int rb0 = (warp >> 2) * 64 + (warp & 3) * 16 + g, rb1 = rb0 + 8;
    const long long wr0 = (long long)tl.e * N + min(n0 + rb0, N - 1), wr1 = (long long)tl.e * N + min(n0 + rb1, N - 1);
    const int lg = BITS == 16 ? 0 : __ffs(group) - 1;
    const long long so0 = wr0 * (K >> lg), so1 = wr1 * (K >> lg);
    auto load_sb = [&](int kt, u32 (&sb)[2][2][2]) {
        if constexpr (BITS != 16) wg_load_sb(sc, bi, so0, so1, (kb + kt) * 128, t4, lg, sb);
    };
    u32 sbA[2][2][2] = {}, sbB[2][2][2] = {};
    load_sb(0, sbA);
    if (!tiles) pdl_wait();
    if (tid == 0)
        for (int kt = 0; kt < min(S, nk); kt++) load_x(kt);

    float acc[NB][32];
#pragma unroll
    for (int j = 0; j < NB; j++)
#pragma unroll
        for (int i = 0; i < 32; i++) acc[j][i] = 0.f;
    u32 a0[4][4], a1[4][4];
    const bool lead = (tid & 127) == 0;
    /* k-tile kt's wgmmas completed in this warpgroup: the second warpgroup to say so refills its stage */
    auto release = [&](int kt) {
        if (lead && kt + S < nk && (atomicAdd(&rel[kt % S], 1u) & 1u)) {
            mb_expect(&full[kt % S], STAGE);
            load_w(kt + S);
            load_x(kt + S);
        }
    };
    auto step = [&](int kt, const u32 (&sb)[2][2][2], u32 (&nsb)[2][2][2]) {
        const int st = kt % S;
        wt_wait(&full[st], (kt / S) & 1);
        if (kt + 1 < nk) load_sb(kt + 1, nsb);
        const unsigned char* cod = sm + st * STAGE + 2 * XC;
        wt_half<BITS>(a0, cod, rb0, rb1, 0, t4, sb);
        wt_mma_half<NB>(acc, a0, s0 + st * STAGE);
        wg_wait_pending<1>();
        if (kt > 0) release(kt - 1);
        wt_half<BITS>(a1, cod, rb0, rb1, 1, t4, sb);
        wt_mma_half<NB>(acc, a1, s0 + st * STAGE + XC);
        wg_wait_pending<1>();
    };
    for (int kt = 0; kt < nk; kt += 2) {
        step(kt, sbA, sbB);
        if (kt + 1 < nk) step(kt + 1, sbB, sbA);
    }
    wg_wait_pending<0>();
#pragma unroll
    for (int j = 0; j < NB; j++)
#pragma unroll
        for (int i = 0; i < 32; i++) asm volatile("" : "+f"(acc[j][i])::"memory");
    wg_finish<NB>(acc, y, ldy, M, N, tl.m0, tl.m1, n0 + rb0, n0 + rb1, t4, accumulate, ksplit, part, tickets);
#endif
}

#define GEMM_WT(NAME, NB, BITS, MINB)                                                                               \
    extern "C" __global__ void __launch_bounds__(256, MINB) NAME(GemmParams_fields) {                              \
        GEMM_SHAPE;                                                                                                 \
        gemm_wt_body<NB, BITS>(sc, bi, group, &xm, &wm, y, ldy, M, N, K, tiles, accumulate, ksplit, part, tickets); \
    }
GEMM_WT(gemm_wt64, 1, 4, 2)
GEMM_WT(gemm_wt128, 2, 4, 1)
GEMM_WT(gemm_wt256, 4, 4, 1)
GEMM_WT(gemm_wt64_q8, 1, 8, 2)
GEMM_WT(gemm_wt128_q8, 2, 8, 1)
GEMM_WT(gemm_wt256_q8, 4, 8, 1)
GEMM_WT(gemm_wt64_bf16, 1, 16, 2)
GEMM_WT(gemm_wt128_bf16, 2, 16, 1)
GEMM_WT(gemm_wt256_bf16, 4, 16, 1)
