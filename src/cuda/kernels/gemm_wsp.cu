/*
 * gemm_wsp.cu: gemm_wt's product (same math, k order, dequantization into wgmma's A registers and
 *   stores; see gemm_wt.cu and gemm_wg.cu) as a persistent, warp-specialized kernel, for plain
 *   products (no tile list, no split K) of MLX 4/8-bit codes (bf16 scales and biases, groups of a
 *   power of two from 32) and dense bf16 weights (BITS 4, 8, 16):
 *   Y[m, n] (+)= sum_k X[m, k] * W[n, k], X the bf16 k-permuted rows of x_bf16_perm's layout.
 *
 * Why: gemm_wt runs one tile per block and one block per SM at 128 and 256 rows, so every tile's
 *   pipeline fills from empty (the first copies' latency, nothing to multiply meanwhile) and its
 *   stores run with no copies in flight; its consumer threads also load their scales and biases
 *   from global memory and one of them issues the copies. Here a block stays for many tiles and
 *   producer warps copy the next tile's first k-tiles while the consumers store the last one;
 *   scales and biases reach shared memory with the codes.
 *
 * Launch: grid min(tiles, SMs) blocks of 384 threads (3 warpgroups), one per SM. Block b takes
 *   tiles t = b, b + G, .. (G = gridDim.x): weight rows n0 = 128 (t % gx), input rows
 *   m0 = BT (t / gx), gx = ceil(N / 128) (consecutive blocks share input rows, as in gemm_wt's
 *   grid). Warpgroup 0 drops to 40 registers (setmaxnreg): lane 0 of its warp 0 issues the
 *   copies, its warps 1..W (W = min(S, 3)) load the scales and biases, the rest leave. Warpgroups
 *   1 and 2 rise to 232 registers and are gemm_wt's two consumer warpgroups (weight rows
 *   64(wg - 1) .. + 63 of the tile, all BT input rows). Each (tile, k-tile) of the block is one
 *   step j of its sequence: stage j % S, phase parity (j / S) & 1.
 *
 * Shared memory (from a 1024-byte aligned base): S stages in gemm_wt's layout (X: two SW128 boxes
 *   of 64 columns x BT rows; W: [128 rows][16 BITS bytes]), then S scale slots of [128 rows][NGT]
 *   u32, NGT = 128 / group groups per k-tile (bf16 scale bits low, bias bits high; groups of
 *   32, 64 or 128).
 * Barriers per stage: full (count 1 + 32 for quantized weights: the copy thread arming it with
 *   the stage's bytes, then every lane of the stage's scale warp after its stores), empty (count
 *   8: lane 0 of each consumer warp once the warp's wgmmas on the stage completed).
 * Copy thread, per step: wait for empty (from step S on), arm full, issue the weight box and the
 *   two input boxes (the inputs after the programmatic-dependent wait, at the first step only).
 * Scale warps: warp w owns the stages st with st % W == w - 1; per step on them it loads the
 *   step's 128 x NGT pairs (a row's NGT scales as one load, its biases as another; rows past N
 *   clamped, never stored) before waiting for empty, then stores them to the slot and arrives.
 * Consumers, per tile: zero the accumulators; per k-tile wait for full, read the four scale/bias
 *   pairs of their rows and halves, dequantize half 0, issue its wgmmas, wait until one group is
 *   pending (the previous k-tile done: release its stage), half 1, wait until one is pending;
 *   after the last k-tile wait for all and release it, then store (wg_store).
 */
#define WSP_PRODUCER_REGS 40
#define WSP_CONSUMER_REGS 232

/* A producer scale warp (gemm_wsp): the steps j of the block's sequence on the stages it owns
   (j % S) % W == j0, W = min(S, 3) warps (static: step j is k-tile j % nk of the block's tile j / nk,
   tile blockIdx.x + (j / nk) G). Owning whole stages keeps each wait on empty one phase from the
   last this warp filled there (a warp taking every third step could run two phases ahead of a
   stage's barrier, where its parity test passes early: the 2-stage kernels trapped). Lane l loads
   rows l + 32i (i < 4) of the step's 128: NGT bf16 scales and NGT biases each as one load (NGT 1,
   2 or 4: 2, 4 or 8 bytes, aligned as the group offsets are multiples of NGT), then waits for the
   stage, stores them as u32 pairs [row][NGT] and arrives on full. */
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
template <int NGT>
struct WspVec {
    using T = uint2;
};
template <>
struct WspVec<1> {
    using T = u16;
};
template <>
struct WspVec<2> {
    using T = u32;
};
template <int NGT>
__device__ __forceinline__ u32 wsp_half(const typename WspVec<NGT>::T& v, int i) {
    if constexpr (NGT == 1) return v;
    else if constexpr (NGT == 2) return i ? v >> 16 : v & 0xFFFFu;
    else return ((i >> 1) ? v.y : v.x) >> (16 * (i & 1)) & 0xFFFFu;
}
template <int NGT, int S>
__device__ __forceinline__ void wsp_scales(const void* sc, const void* bi, u32* slots, u64* full, u64* empty, int j0,
                                           int gx, int ntiles, int nk, int N, long long gpr, int lane) {
    using V = typename WspVec<NGT>::T;
    const V *SV = (const V*)sc, *BV = (const V*)bi;
    const long long vpr = gpr / NGT; /* vectors per weight row */
    constexpr int W = S < 3 ? S : 3; /* scale warps: warp j0 + 1 owns the stages st with st % W == j0 */
    for (int j = 0;; j++) {
        const int st = j % S;
        if (st % W != j0) continue;
        const int t = blockIdx.x + (j / nk) * gridDim.x, kt = j % nk;
        if (t >= ntiles) return;
        const int n0 = (t % gx) * 128;
        V sv[4], bv[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const long long o = (long long)min(n0 + lane + 32 * i, N - 1) * vpr + kt;
            sv[i] = SV[o];
            bv[i] = BV[o];
        }
        if (j >= S) wt_wait(&empty[st], ((j / S) - 1) & 1);
        u32* slot = slots + st * 128 * NGT;
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int q = 0; q < NGT; q++)
                slot[(lane + 32 * i) * NGT + q] = wsp_half<NGT>(sv[i], q) | (wsp_half<NGT>(bv[i], q) << 16);
        mb_arrive(&full[st]);
    }
}
#endif

template <int NB, int BITS>
__device__ __forceinline__ void gemm_wsp_body(const void* sc, const void* bi, int group, const TmaMap* xm,
                                              const TmaMap* wm, float* y, long long ldy, int M, int N, int K,
                                              int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int S = WT_STAGES(NB, BITS), BT = 64 * NB, XC = BT * 128, CB = 16 * BITS, STAGE = 2 * XC + 128 * CB;
    extern __shared__ __align__(1024) unsigned char wsp_sm[];
    __shared__ __align__(8) u64 full[S], empty[S];
    pdl_trigger();
    const int tid = threadIdx.x, wgi = tid >> 7;
    const u32 raw = smem_u32(wsp_sm), s0 = (raw + 1023u) & ~1023u;
    unsigned char* sm = wsp_sm + (s0 - raw);
    const int lg = BITS == 16 ? 0 : __ffs(group) - 1, ngt = BITS == 16 ? 0 : 128 >> lg;
    u32* slots = (u32*)(sm + S * STAGE);
    const int gx = (N + 127) / 128, ntiles = gx * ((M + BT - 1) / BT), nk = K / 128;
    if (tid == 0) {
        for (int i = 0; i < S; i++) {
            mb_init(&full[i], BITS == 16 ? 1 : 33);
            mb_init(&empty[i], 8);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();

    if (wgi == 0) {
        asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(WSP_PRODUCER_REGS));
        const int pw = tid >> 5, lane = tid & 31;
        if (pw == 0) {
            /* lane 0: the copies of every step */
            if (lane != 0) return;
            int j = 0;
            for (int t = blockIdx.x; t < ntiles; t += gridDim.x) {
                const int n0 = (t % gx) * 128, m0 = (t / gx) * BT;
                for (int kt = 0; kt < nk; kt++, j++) {
                    const int st = j % S;
                    if (j >= S) wt_wait(&empty[st], ((j / S) - 1) & 1);
                    const u32 d = s0 + st * STAGE;
                    mb_expect(&full[st], STAGE);
                    tma_2d(d + 2 * XC, wm, kt * CB, n0, &full[st]);
                    if (j == 0) pdl_wait();
                    tma_2d(d, xm, kt * 128, m0, &full[st]);
                    tma_2d(d + XC, xm, kt * 128 + 64, m0, &full[st]);
                }
            }
            return;
        }
        if constexpr (BITS != 16) {
            /* warps 1..min(S, 3): the scale/bias pairs of the steps on their stages (up to three
               steps' loads in flight), each lane rows lane + 32i (i < 4), a row's NGT groups as one
               load per array, issued before the wait for the stage */
            if (pw - 1 >= (S < 3 ? S : 3)) return;
            if (ngt == 1) wsp_scales<1, S>(sc, bi, slots, full, empty, pw - 1, gx, ntiles, nk, N, K >> lg, lane);
            else if (ngt == 2) wsp_scales<2, S>(sc, bi, slots, full, empty, pw - 1, gx, ntiles, nk, N, K >> lg, lane);
            else if (ngt == 4) wsp_scales<4, S>(sc, bi, slots, full, empty, pw - 1, gx, ntiles, nk, N, K >> lg, lane);
        }
        return;
    }

    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(WSP_CONSUMER_REGS));
    const int ct = tid - 128, warp = ct >> 5, lane = ct & 31, g = lane >> 2, t4 = lane & 3;
    const int rb0 = (warp >> 2) * 64 + (warp & 3) * 16 + g, rb1 = rb0 + 8;
    pdl_wait(); /* before any store */
    float acc[NB][32];
    u32 a0[4][4], a1[4][4];
    int j = 0;
    for (int t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const int n0 = (t % gx) * 128, m0 = (t / gx) * BT;
#pragma unroll
        for (int jj = 0; jj < NB; jj++)
#pragma unroll
            for (int i = 0; i < 32; i++) acc[jj][i] = 0.f;
        for (int kt = 0; kt < nk; kt++, j++) {
            const int st = j % S;
            wt_wait(&full[st], (j / S) & 1);
            u32 sb[2][2][2] = {};
            if constexpr (BITS != 16) {
                const u32* slot = slots + st * 128 * ngt;
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int gi = (64 * h + 16 * t4) >> lg;
                    const u32 p0 = slot[rb0 * ngt + gi], p1 = slot[rb1 * ngt + gi];
                    sb[h][0][0] = p0 & 0xFFFFu;
                    sb[h][0][1] = p0 >> 16;
                    sb[h][1][0] = p1 & 0xFFFFu;
                    sb[h][1][1] = p1 >> 16;
                }
            }
            const unsigned char* cod = sm + st * STAGE + 2 * XC;
            wt_half<BITS>(a0, cod, rb0, rb1, 0, t4, sb);
            wt_mma_half<NB>(acc, a0, s0 + st * STAGE);
            wg_wait_pending<1>();
            if (kt > 0 && lane == 0) mb_arrive(&empty[(j - 1) % S]);
            wt_half<BITS>(a1, cod, rb0, rb1, 1, t4, sb);
            wt_mma_half<NB>(acc, a1, s0 + st * STAGE + XC);
            wg_wait_pending<1>();
        }
        wg_wait_pending<0>();
        if (lane == 0) mb_arrive(&empty[(j - 1) % S]);
#pragma unroll
        for (int jj = 0; jj < NB; jj++)
#pragma unroll
            for (int i = 0; i < 32; i++) asm volatile("" : "+f"(acc[jj][i])::"memory");
        wg_store<NB>(acc, y, ldy, m0, min(M, m0 + BT), n0 + rb0, n0 + rb1, N, t4, accumulate);
    }
#endif
}

#define GEMM_WSP(NAME, NB, BITS)                                                                          \
    extern "C" __global__ void __launch_bounds__(384, 1) NAME(GemmParams_fields) {                       \
        GEMM_SHAPE;                                                                                       \
        gemm_wsp_body<NB, BITS>(sc, bi, group, &xm, &wm, y, ldy, M, N, K, accumulate);                    \
    }
GEMM_WSP(gemm_wsp128, 2, 4)
GEMM_WSP(gemm_wsp256, 4, 4)
GEMM_WSP(gemm_wsp128_q8, 2, 8)
GEMM_WSP(gemm_wsp256_q8, 4, 8)
GEMM_WSP(gemm_wsp128_bf16, 2, 16)
GEMM_WSP(gemm_wsp256_bf16, 4, 16)
