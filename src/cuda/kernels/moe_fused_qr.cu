/*
 * moe_fused_qr.cu: moe_fused_qr (LILY_CUDA_MOE=qr; built without a GPU in session 33, not yet
 * measured): moe_fused_q2 with the MoE's router computed in the same launch by thread-block
 * clusters, one launch fewer per MoE layer.
 *
 * Math: logits[r] = rr * sum_c Wr[r, c] xw[c] for r < R = E + 1 (the E experts' logits and the
 *   shared expert's gate logit), xw = x * normw, rr = 1 / sqrt(mean(x^2) + eps), computed as
 *   gemv_q2 computes the router in its own launch (the same staging, the same chunks per lane
 *   and trip, the same warp and block sums: the same bits where that launch has 4-warp blocks,
 *   the default); then moe_fused_q2 (moe_fused2.cu) on those logits.
 *
 * Why clusters: the router's own launch costs ~3.8 µs a layer for 0.56 MB (its wait, its staging
 *   and the MoE launch's wait behind it), and the earlier router-in-launch of moe_fused_q
 *   (LILY_CUDA_MOE_ROUTER=fused, every block a share of the rows, then a grid-wide meeting
 *   through global memory) measured 2.6% slower: the meeting cost what the launch did. Here each
 *   cluster of QR_CS = 8 blocks computes the whole router (a block R / 8 rows, about one row
 *   group a warp), every logit is stored into all 8 blocks' shared memory (st.shared::cluster),
 *   and one hardware cluster barrier later every block holds all of them: no global round trip
 *   between the router and the top-k. The router is read from HBM once and from the L2 once
 *   per cluster; a warp's first trip is loaded before the PDL wait, its next ones requested
 *   into the L2 there.
 *
 * Cluster barriers: every thread arrives (relaxed) at the start, so that the wait before the
 *   first remote store finds every block of the cluster running (a block's shared memory may
 *   only be written while it runs); after the stores, arrive.release + wait.acquire make them
 *   visible. No block touches another's shared memory after that, so blocks may exit freely.
 *
 * Geometry: grid G = QR_CS * C blocks of 512 threads (clusters of 8 along x), C at most the
 *   clusters the device can hold at once (the host asks the driver: the down projection's
 *   meeting needs every block resident); dynamic shared memory as moe_fused_q2's (the router's
 *   staging, H + H / EPV_r floats, uses the same space before the experts' staging). The host
 *   checks: experts 4-bit, router 4- or 8-bit of the experts' scale type, R <= 512.
 */
#define QR_CS 8

/* Cluster rank, barrier halves and a store into a cluster block's shared memory (sm_90; the
   host launches moe_fused_qr nowhere else; LILY_EMU: scripts/emu/shim.h's emulation). */
#if __CUDA_ARCH__ >= 900
#define QR_CL_DIMS __cluster_dims__(QR_CS, 1, 1)
#else
#define QR_CL_DIMS
#endif
__device__ __forceinline__ u32 cl_rank() {
#if __CUDA_ARCH__ >= 900
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
#elif defined(LILY_EMU)
    return emu_cl_rank();
#else
    return 0;
#endif
}
__device__ __forceinline__ void cl_arrive_relaxed() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cl_arrive() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#elif defined(LILY_EMU)
    emu_cl_wait();
#endif
}
/* *local in the shared memory of the cluster's block `rank` (the same offset) = v */
__device__ __forceinline__ void cl_store(float* local, u32 rank, float v) {
#if __CUDA_ARCH__ >= 900
    u32 a;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(smem_u32(local)), "r"(rank));
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(a), "f"(v) : "memory");
#elif defined(LILY_EMU)
    emu_cl_store(local, rank, v);
#endif
}

/* The router of moe_fused_qr: this block's rows (row group q of NR rows goes to cluster warp
   q mod (QR_CS * 16), cluster warp = warp * QR_CS + rank) into every cluster block's ls[0..R);
   cluster 0 also writes them to `logits` (global, for the host and the tests). Returns after
   the cluster barrier: ls holds all R logits. Calls the PDL wait. */
template <int RB, int TY>
__device__ __forceinline__ void qr_router(const u32* w, const u16* sc, const u16* bi, int group, int R, int H,
                                          const float* x, const float* normw, float eps, float* logits, float* xs,
                                          float* red, float* ls) {
    constexpr int EPV = 128 / RB, NR = 2, U = 2;
    const u32 rank = cl_rank();
    int lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    int n4 = H / EPV, ng = H / group, gsh = __ffs(group) - 1;
    int tpr = (n4 + 32 * U - 1) / (32 * U), ngroups = (R + NR - 1) / NR, gstride = QR_CS * nwarps;
    int q = (threadIdx.x >> 5) * QR_CS + (int)rank, t = 0;
    auto load = [&](GqTrip<NR, U>& tr, int qq, int tt) {
        int r0 = qq * NR, nv = min(NR, R - r0), i0 = tt * 32 * U + lane;
        if (nv == NR && (tt + 1) * 32 * U <= n4)
            gq_load<RB, NR, U, true>(tr, w, sc, bi, r0, NR, n4, ng, gsh, i0);
        else
            gq_load<RB, NR, U, false>(tr, w, sc, bi, r0, nv, n4, ng, gsh, i0);
    };
    cl_arrive_relaxed(); /* this block runs */
    GqTrip<NR, U> cur, nxt;
    if (q < ngroups) load(cur, q, 0);
    /* this warp's next four trips into the L2 (weights: before the wait) */
    for (int m = 1; m < 5; m++) {
        int n = m / tpr, tt = m - n * tpr, qq = q + n * gstride;
        if (qq >= ngroups) break;
        gq_prefetch<RB, NR, U>(w, sc, bi, qq * NR, min(NR, R - qq * NR), n4, ng, gsh, tt * 32 * U + lane);
    }
    pdl_wait();
    float* xsum = xs + H;
    float rr = gq_stage<EPV>(x, H, normw, eps, xs, xsum, red);
    cl_wait(); /* every block of the cluster runs: its ls may be written */
    float acc[NR] = {0.f, 0.f};
    while (q < ngroups) {
        int r0 = q * NR, nvalid = min(NR, R - r0);
        int q2 = q, t2 = t + 1;
        if (t2 == tpr) {
            q2 = q + gstride;
            t2 = 0;
        }
        if (q2 < ngroups) load(nxt, q2, t2);
        if (nvalid == NR && (t + 1) * 32 * U <= n4)
            gq_compute<RB, TY, NR, U, false, true>(cur, NR, n4, t * 32 * U + lane, xs, xsum, acc);
        else
            gq_compute<RB, TY, NR, U, false, false>(cur, nvalid, n4, t * 32 * U + lane, xs, xsum, acc);
        if (t + 1 == tpr) {
#pragma unroll
            for (int r = 0; r < NR; r++) {
                float a = warp_sum(acc[r]) * rr;
                acc[r] = 0.f;
                if (r < nvalid) {
                    if (lane < QR_CS) cl_store(ls + r0 + r, lane, a);
                    if (lane == 0 && blockIdx.x < QR_CS) logits[r0 + r] = a;
                }
            }
        }
        cur = nxt;
        q = q2;
        t = t2;
    }
    cl_arrive();
    cl_wait(); /* every logit in ls (the barrier is also this block's) */
}

extern "C" __global__ void QR_CL_DIMS __launch_bounds__(512, 1) moe_fused_qr(MoeFusedParams_fields) {
    extern __shared__ __align__(16) float xs[];
    __shared__ float red[33], wsel[65], ls[512]; /* ls: the router's logits (R <= 512) */
    __shared__ int chosen[65];
    TL_SCOPE("moe_fused_qr");
    u64* ts = trace ? trace + 16 * blockIdx.x : nullptr; /* stamp 1: the router done */
    trace_stamp(ts, 0);
    pdl_trigger();
    const u32* Wr = (const u32*)wr;
    const u16 *Sr = (const u16*)sr, *Br = (const u16*)br;
#define QR(RB, T) qr_router<RB, T>(Wr, Sr, Br, group_r, R, H, x, normw, eps, logits, xs, red, ls)
    if (ty == TY_BF16 && bits_r == 8) QR(8, TY_BF16);
    else if (ty == TY_BF16) QR(4, TY_BF16);
    else if (bits_r == 8) QR(8, TY_F16);
    else QR(4, TY_F16);
#undef QR
    trace_stamp(ts, 1);
#define MF2(T)                                                                                                        \
    mf2_body<4, T, false, true>(wg, sg, bg, wd, sd, bd, bits, group_g, group_d, ty, x, gu, inter, H, normw, eps, ls, \
                                E, K, renorm, ids_out, wts_out, ctr, bps, rank, wr, sr, br, bits_r, group_r, ty_r, R,  \
                                trace, fixed, acc, rblocks, xs, red, wsel, chosen, ls, ts)
    if (ty == TY_BF16) MF2(TY_BF16);
    else MF2(TY_F16);
#undef MF2
    trace_stamp(ts, 6);
}
