/*
 * gemm_ws.cu: gemm_wg's product (same math, formats, k order, shared-memory layouts and
 *   dequantization; see gemm_wg.cu) as a warp-specialized, persistent kernel (sm_90a):
 *   Y[m, n] (+)= sum_k X[xr(m), k] * W[e*N + n, k], X the bf16 k-permuted copy from x_bf16_perm.
 *
 * Why: gemm_wg's eight warps each issue their share of the copies, wait for them, meet at a block
 *   barrier every k-tile and wait for their wgmmas before the next (latency-bound: 0.29
 *   instructions per scheduler-cycle, docs/perf-log.md). Here one producer warp keeps the stages
 *   full and the consumers only dequantize and issue wgmma, paced by mbarriers per stage; the
 *   blocks stay resident and walk the tile list, so a tile's epilogue overlaps the next tile's
 *   first copies.
 *
 * Launch: block 288 = consumer warpgroups 0 and 1 (threads 0..255: weight rows 64h .. 64h + 63 of
 *   the tile's 128, as gemm_wg's warpgroups) and producer warp 8; grid = min(tiles, SMs), one
 *   block per SM. Tile t (t = blockIdx.x, += gridDim.x) is weight block t % gx (gx = ceil(N/128))
 *   of row tile t / gx: rows BT*(t/gx) .. of a plain product, or entry t / gx of the moe_align
 *   tile list (tiles[0] of them, each at most BT rows of one expert). BT = 64 NB.
 * Stages (WS_STAGES(NB): 8 at NB = 1, 5 at NB = 2): X BT x 128 bf16 as core matrices (gemm_wg's
 *   layout), then W 128 rows x 64 bytes. Each stage has a "full" mbarrier (count 32: the
 *   producer lanes) and an "empty" one (count 256: every consumer thread after its wgmmas on the
 *   stage completed).
 *   Producer, k-tile i of its walk (stage i % S, use i / S): wait for "empty" of the previous use;
 *   W as 16 cp.async per lane (8 whole 64-byte rows per warp copy; per-lane cp.async.bulk was
 *   serialized through the uniform datapath, 2.4x slower than gemm_wg, perf log session 25); X as
 *   BT/2 cp.async per lane (gathered rows, zero-filled past the tile); one commit group per
 *   k-tile; then for k-tile i - LAG (LAG = S - 2): wait for that group, fence.proxy.async (its
 *   generic writes -> wgmma's reads) and arrive on its "full". LAG < S, so this never waits on
 *   itself; the last LAG are flushed at the end.
 *   Consumers, per tile: zero the accumulators; per k-tile wait for "full", dequantize the codes
 *   and issue the wgmmas exactly as gemm_wg (scales and biases from global one k-tile ahead),
 *   wait for the wgmmas, arrive on "empty"; then store the tile (accumulate or overwrite).
 * Bring-up guard: a wait that lasts ~4e9 cycles traps (a kernel error, not a hang).
 * Dynamic shared memory WS_STAGES(NB) * (BT*256 + 8192) bytes (192 KB at NB = 1, 200 KB at
 * NB = 2); the mbarriers are static. Requires K % 128 == 0; elsewhere than sm_90a the kernels
 * are empty and the host never launches them.
 */
#define WS_STAGES(NB) ((NB) == 1 ? 8 : 5)

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void ws_wait(u64* b, u32 parity) {
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
#endif

template <int NB>
__device__ __forceinline__ void gemm_ws_body(const void* w, const void* sc, const void* bi, int group, const u16* xb,
                                             const int* gather, int gdiv, float* y, long long ldy, int M, int N,
                                             int K, const int* tiles, int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int S = WS_STAGES(NB), LAG = S - 2, BT = 64 * NB, XB = BT * 256, STAGE = XB + 128 * 64;
    extern __shared__ __align__(128) unsigned char ws_sm[];
    __shared__ __align__(8) u64 full[S], empty[S];
    __shared__ int xri[BT];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const u32 s0 = (u32)__cvta_generic_to_shared(ws_sm);
    if (tid == 0) {
        for (int i = 0; i < S; i++) {
            mb_init(&full[i], 32);
            mb_init(&empty[i], 256);
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    const int gx = (N + 127) / 128;
    const int mt = tiles ? tiles[0] : (M + BT - 1) / BT;
    const int ntile = gx * mt, nk = K / 128;
    /* tile t: expert e, rows m0..m1 (of the grouped order), weight rows n0.. */
    auto tile_of = [&](int t, int& e, int& m0, int& m1, int& n0) {
        int r = t / gx;
        n0 = (t % gx) * 128;
        if (tiles) {
            e = tiles[1 + 3 * r];
            m0 = tiles[2 + 3 * r];
            m1 = tiles[3 + 3 * r];
        } else {
            e = 0;
            m0 = r * BT;
            m1 = min(M, m0 + BT);
        }
    };

    if (warp == 8) {
        /* producer: X copy j (j < BT/2) is 4 rows x one 64-column chunk: row 4(j >> 1) + xro, piece
           8(j & 1) + xqo, so each quarter-warp phase reads 4 rows' same two pieces, 4 whole 32-byte
           sectors (8 rows' same piece, as first written, fetched every sector twice; the shared
           writes meet 2-way bank conflicts instead); the 64 code bytes of W rows as below; all by
           cp.async */
        const int xqo = 2 * (lane >> 3) + (lane & 1), xro = (lane >> 1) & 3;
        int it = 0;
        for (int t = blockIdx.x; t < ntile; t += gridDim.x) {
            int e, m0, m1, n0;
            tile_of(t, e, m0, m1, n0);
            /* W: piece lane + 32i (i < 16) of the tile's 128 rows x 4 pieces: row (lane >> 2) + 8i,
               piece lane & 3, so a warp copy is 8 whole 64-byte runs */
            const unsigned char* wb = (const unsigned char*)w + (lane & 3) * 16;
            int wri[16]; /* weight rows (lane >> 2) + 8i, clamped to the last */
#pragma unroll
            for (int i = 0; i < 16; i++) wri[i] = e * N + min(n0 + (lane >> 2) + 8 * i, N - 1);
            /* the tile's source rows (-1 past it), in shared memory: BT/4 per lane in registers
               spilled at 128 rows (ptxas budgets 168 registers for the 288 threads) */
            __syncwarp();
            for (int i = lane; i < BT; i += 32) xri[i] = m0 + i < m1 ? gemm_xrow(gather, gdiv, m0 + i) : -1;
            __syncwarp();
            for (int kt = 0; kt < nk; kt++, it++) {
                int st = it % S;
                if (it >= S) ws_wait(&empty[st], ((it / S) - 1) & 1);
                u32 xs = s0 + st * STAGE;
#pragma unroll
                for (int i = 0; i < 16; i++)
                    cp_async16(s0 + st * STAGE + XB + (u32)(lane + 32 * i) * 16, wb + (long long)wri[i] * (K / 2) + kt * 64, 16);
#pragma unroll
                for (int j = 0; j < BT / 2; j++) {
                    int rg = j >> 1, r = 4 * rg + xro, q = 8 * (j & 1) + xqo;
                    u32 dst = xs + (u32)((q * (BT / 8) + (r >> 3)) * 128 + (r & 7) * 16);
                    int sr = xri[r];
                    cp_async16(dst, xb + (long long)max(sr, 0) * K + kt * 128 + q * 8, sr >= 0 ? 16 : 0);
                }
                cp_async_commit();
                if (it >= LAG) {
                    asm volatile("cp.async.wait_group %0;\n" ::"n"(LAG) : "memory");
                    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
                    mb_arrive(&full[(it - LAG) % S]);
                }
            }
        }
        asm volatile("cp.async.wait_group 0;\n" ::: "memory");
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        for (int i = max(0, it - LAG); i < it; i++) mb_arrive(&full[i % S]);
        return;
    }

    /* consumers: this thread's two weight rows (block-relative), as gemm_wg */
    const int rb0 = (warp >> 2) * 64 + (warp & 3) * 16 + g, rb1 = rb0 + 8;
    const int lg = __ffs(group) - 1;
    const u64 dbase = wg_desc(s0, BT / 8 * 128, 128);
    int it = 0;
    for (int t = blockIdx.x; t < ntile; t += gridDim.x) {
        int e, m0, m1, n0;
        tile_of(t, e, m0, m1, n0);
        long long wr0 = (long long)e * N + min(n0 + rb0, N - 1), wr1 = (long long)e * N + min(n0 + rb1, N - 1);
        long long so0 = wr0 * (K >> lg), so1 = wr1 * (K >> lg);
        auto load_sb = [&](int kt, u32 (&sb)[2][2][2]) { wg_load_sb(sc, bi, so0, so1, kt * 128, t4, lg, sb); };
        float acc[NB][32];
#pragma unroll
        for (int j = 0; j < NB; j++)
#pragma unroll
            for (int i = 0; i < 32; i++) acc[j][i] = 0.f;
        u32 sbA[2][2][2], sbB[2][2][2];
        load_sb(0, sbA);
        auto step = [&](int kt, const u32 (&sb)[2][2][2], u32 (&nsb)[2][2][2]) {
            int st = it % S;
            ws_wait(&full[st], (it / S) & 1);
            if (kt + 1 < nk) load_sb(kt + 1, nsb);
            wg_ktile<NB>(acc, ws_sm + st * STAGE + XB, rb0, rb1, t4, sb, dbase + (u32)((st * STAGE) >> 4));
            mb_arrive(&empty[st]);
            it++;
        };
        for (int kt = 0; kt < nk; kt += 2) {
            step(kt, sbA, sbB);
            if (kt + 1 < nk) step(kt + 1, sbB, sbA);
        }
        wg_store<NB>(acc, y, ldy, m0, m1, n0 + rb0, n0 + rb1, N, t4, accumulate);
    }
#endif
}

#define GEMM_WS(NAME, NB)                                                                                      \
    extern "C" __global__ void __launch_bounds__(288, 1) NAME(GemmParams_fields) {                             \
        GEMM_SHAPE;                                                                                            \
        gemm_ws_body<NB>(w, sc, bi, group, (const u16*)x, gather, gdiv, y, ldy, M, N, K, tiles, accumulate); \
    }
GEMM_WS(gemm_ws64, 1)
GEMM_WS(gemm_ws128, 2)
