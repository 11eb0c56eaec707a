/*
 * moe_smem.cu: the decode MoE of one token (batch 1) with each block's whole weight share copied
 * into shared memory at once (moe_fused_sm; sm_90). Same math, staging, per-row chunk order and
 * reductions as moe_fused_q (gemv.cu), so the same result bit for bit:
 *   top-K of the router logits (the shared expert as slot K, S = K + 1 slots);
 *   gu[z, r] = rr * W_gu[(2 chosen[z/2] + z%2) I + r, :] . (x * normw)   (z < 2S, r < I, rr the RMSNorm);
 *   x[r] += sum_k wts[k] * W_d[chosen[k] H + r, :] . (silu(gu[2k]) * gu[2k+1])   (r < H).
 *
 * Why: moe_fused_q streams its weights through registers, two rows per warp per trip, so after the
 *   top-K each SM waits on several dependent rounds of HBM latency for the gate/up rows and one more
 *   for the down rows (~26 µs a layer for ~16 MB that need ~4 at HBM rate). Here thread 0 of every
 *   block issues, right after the top-K, one bulk copy (cp.async.bulk completing on an mbarrier) per
 *   contiguous range of the block's whole share, the down rows included (they depend only on the
 *   top-K), so the layer's weights are all requested within a few hundred ns and arrive at HBM rate
 *   while the block stages its input; the products then read shared memory.
 *
 * Shares: the gate/up product's 2S I virtual rows (v = z I + r) in runs of RG per block (block b:
 *   [b RG, (b+1) RG), a run split where it crosses a slot); the down product's H rows in runs of RD
 *   per block, each row for all S slots.
 * Shared memory (dynamic, 16-byte aligned pieces, in order):
 *   xs    staging: max(H + H/EPV, S I + S I/EPV) floats (the input and its chunk sums, as gq_stage
 *         and moe_stage write them);
 *   gq    [RG][H bits/8] bytes of codes, gs / gb [RG][H/group_g] u16 scales / biases;
 *   dq    [S][RD][I bits/8] bytes of codes, ds / db [S][RD][I/group_d] u16.
 *   The host checks that every row's bytes are a multiple of 16 and that the whole fits.
 * Geometry: grid G (all blocks resident, one per SM: the grid meets once on ctr between the two
 *   products, as moe_fused_q; each launch raises ctr by G), block 512 = 16 warps. Gate/up: warp w
 *   takes row pairs 2w, 2w + 32, ... of the block's run (U = 2 chunks per lane per trip); down: warp
 *   w takes rows w, w + 16, ... of its run (MD_U = 5 chunks per lane per trip, all S slots back to
 *   back as moe_down_q's virtual row).
 */

#if __CUDA_ARCH__ >= 900
/* Trip t's chunks (lane + 32u + 32 U t) of `nvalid` rows from shared memory: codes rows of n4
   chunks at q, scale/bias rows of ng at sc/bi; row r of the trip is row rows[r]. */
template <int BITS, int NR, int U>
__device__ __forceinline__ void ms_load(GqTrip<NR, U>& t, const uint4* q, const u16* sc, const u16* bi,
                                        const int (&rows)[NR], int nvalid, int n4, int ng, int gsh, int i0) {
    constexpr int EPV = 128 / BITS;
#pragma unroll
    for (int u = 0; u < U; u++) {
        int i = i0 + 32 * u;
#pragma unroll
        for (int r = 0; r < NR; r++) {
            if (r < nvalid && i < n4) {
                t.q[u][r] = q[rows[r] * n4 + i];
                int o = rows[r] * ng + ((i * EPV) >> gsh);
                t.s[u][r] = sc[o];
                t.b[u][r] = bi[o];
            }
        }
    }
}

/* The down product's trip: virtual chunk c = k n4 + i of row `row` is chunk i of slot k's copy of
   that row (shared row k RD + row). */
template <int BITS, int U>
__device__ __forceinline__ void ms_load_down(GqTrip<1, U>& t, const uint4* q, const u16* sc, const u16* bi, int row,
                                             int rd, int n4, int nv, int ng, int gsh, int i0) {
    constexpr int EPV = 128 / BITS;
#pragma unroll
    for (int u = 0; u < U; u++) {
        int c = i0 + 32 * u;
        if (c < nv) {
            int k = c / n4, i = c - k * n4, sr = k * rd + row;
            t.q[u][0] = q[sr * n4 + i];
            int o = sr * ng + ((i * EPV) >> gsh);
            t.s[u][0] = sc[o];
            t.b[u][0] = bi[o];
        }
    }
}

template <int BITS, int TY>
__device__ __forceinline__ void moe_smem_body(const MoeSmemParams p, unsigned char* smem, const int* chosen,
                                              const float* wsel, u64* bars, float* red, u64* s_target) {
    constexpr int EPV = 128 / BITS;
    const int S = p.K + 1, H = p.H, I = p.inter, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int rbg = H * BITS / 8, ngg = H / p.group_g, rbd = I * BITS / 8, ngd = I / p.group_d;
    const int xsf = max(H + H / EPV, S * I + S * I / EPV);
    auto up16 = [](long long b) { return (b + 15) & ~15ll; };
    float* xs = (float*)smem;
    unsigned char* gq = smem + up16(4ll * xsf);
    u16* gs = (u16*)(gq + (long long)p.rg * rbg);
    u16* gb = gs + p.rg * ngg;
    unsigned char* dq = (unsigned char*)(gb + p.rg * ngg);
    u16* ds = (u16*)(dq + (long long)S * p.rd * rbd);
    u16* db = ds + S * p.rd * ngd;
    const int V = 2 * S * I, v0 = blockIdx.x * p.rg, v1 = min(V, v0 + p.rg);
    const int r0 = blockIdx.x * p.rd, r1 = min(H, r0 + p.rd);
    if (threadIdx.x == 0) {
        /* the whole share, gate/up on bars[0], down on bars[1] (an empty share arrives at once) */
        if (v1 > v0) {
            mb_expect(&bars[0], (u32)(v1 - v0) * (rbg + 4 * ngg));
            for (int v = v0; v < v1;) {
                int z = v / I, r = v - z * I, n = min(v1 - v, I - r), l = v - v0;
                long long g = (long long)(2 * chosen[z >> 1] + (z & 1)) * I + r;
                bulk_g2s(gq + (long long)l * rbg, (const unsigned char*)p.wg + g * rbg, n * rbg, &bars[0]);
                bulk_g2s(gs + l * ngg, (const u16*)p.sg + g * ngg, 2 * n * ngg, &bars[0]);
                bulk_g2s(gb + l * ngg, (const u16*)p.bg + g * ngg, 2 * n * ngg, &bars[0]);
                v += n;
            }
        } else {
            mb_arrive(&bars[0]);
        }
        if (r1 > r0) {
            int n = r1 - r0;
            mb_expect(&bars[1], (u32)(S * n) * (rbd + 4 * ngd));
            for (int k = 0; k < S; k++) {
                long long g = (long long)chosen[k] * H + r0;
                int l = k * p.rd;
                bulk_g2s(dq + (long long)l * rbd, (const unsigned char*)p.wd + g * rbd, n * rbd, &bars[1]);
                bulk_g2s(ds + l * ngd, (const u16*)p.sd + g * ngd, 2 * n * ngd, &bars[1]);
                bulk_g2s(db + l * ngd, (const u16*)p.bd + g * ngd, 2 * n * ngd, &bars[1]);
            }
        } else {
            mb_arrive(&bars[1]);
        }
    }
    /* the input, RMS-normalized, while the copies fly */
    float* xsum = xs + H;
    float rr = gq_stage<EPV>(p.x, H, p.normw, p.eps, xs, xsum, red);
    mb_wait(&bars[0], 0);
    {
        const int n4 = H / EPV, gsh = __ffs(p.group_g) - 1, tpr = (n4 + 63) / 64;
        for (int l0 = 2 * warp; l0 < v1 - v0; l0 += 32) {
            int nvalid = min(2, v1 - v0 - l0);
            int rows[2] = {l0, l0 + 1};
            float acc[2] = {0.f, 0.f};
            for (int t = 0; t < tpr; t++) {
                GqTrip<2, 2> tr;
                int i0 = 64 * t + lane;
                ms_load<BITS, 2, 2>(tr, (const uint4*)gq, gs, gb, rows, nvalid, n4, ngg, gsh, i0);
                if (nvalid == 2 && 64 * (t + 1) <= n4)
                    gq_compute<BITS, TY, 2, 2, false, true>(tr, 2, n4, i0, xs, xsum, acc);
                else
                    gq_compute<BITS, TY, 2, 2, false, false>(tr, nvalid, n4, i0, xs, xsum, acc);
            }
#pragma unroll
            for (int r = 0; r < 2; r++) {
                float a = warp_sum(acc[r]) * rr;
                if (lane == 0 && r < nvalid) p.gu[v0 + l0 + r] = a;
            }
        }
    }
    /* every block's gate/up rows written, then the weighted SiLU products staged from L2 */
    grid_wait(p.ctr, grid_arrive(p.ctr, s_target));
    moe_stage<EPV>(p.gu, wsel, S, I, xs, xs + S * I);
    mb_wait(&bars[1], 0);
    {
        const int n4 = I / EPV, nv = S * n4, gsh = __ffs(p.group_d) - 1, tpr = (nv + 32 * MD_U - 1) / (32 * MD_U);
        const float* xsd = xs + S * I;
        for (int w = warp; w < r1 - r0; w += 16) {
            float acc[1] = {0.f};
            for (int t = 0; t < tpr; t++) {
                GqTrip<1, MD_U> tr;
                int i0 = 32 * MD_U * t + lane;
                ms_load_down<BITS, MD_U>(tr, (const uint4*)dq, ds, db, w, p.rd, n4, nv, ngd, gsh, i0);
                gq_compute<BITS, TY, 1, MD_U, false, false>(tr, 1, nv, i0, xs, xsd, acc);
            }
            float a = warp_sum(acc[0]);
            if (lane == 0) p.x[r0 + w] += a;
        }
    }
}
#endif

extern "C" __global__ void __launch_bounds__(512, 1) moe_fused_sm(MoeSmemParams p) {
#if __CUDA_ARCH__ >= 900
    extern __shared__ __align__(128) unsigned char smem[];
    __shared__ float red[33], ls[1024], wsel[65], rk[32 + 512];
    __shared__ int chosen[65];
    __shared__ u64 s_target;
    __shared__ __align__(8) u64 bars[2];
    if (threadIdx.x == 0) {
        mb_init(&bars[0], 1);
        mb_init(&bars[1], 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    pdl_begin(); /* the router's logits come from the previous kernel */
    if (p.rank) {
        route_rank<BarBlock>(p.logits, p.E, p.K, p.renorm, 1, 512, ls, rk, chosen, wsel);
    } else {
        if (threadIdx.x < 32) route_topk(p.logits, p.E, p.K, p.renorm, 1, ls, chosen, wsel);
        __syncthreads(); /* also publishes the mbarriers' init */
    }
    if (blockIdx.x == 0 && threadIdx.x <= p.K) {
        p.ids_out[threadIdx.x] = chosen[threadIdx.x];
        p.wts_out[threadIdx.x] = wsel[threadIdx.x];
    }
    if (p.bits == 4 && p.ty == TY_BF16) moe_smem_body<4, TY_BF16>(p, smem, chosen, wsel, bars, red, &s_target);
    else if (p.bits == 4) moe_smem_body<4, TY_F16>(p, smem, chosen, wsel, bars, red, &s_target);
    else if (p.ty == TY_BF16) moe_smem_body<8, TY_BF16>(p, smem, chosen, wsel, bars, red, &s_target);
    else moe_smem_body<8, TY_F16>(p, smem, chosen, wsel, bars, red, &s_target);
#endif
}
