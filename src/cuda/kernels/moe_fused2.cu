/*
 * moe_fused2.cu: moe_fused_q2, the decode MoE (batch 1) in one launch with a shorter chain than
 * moe_fused_q (gemv.cu). The decode default since session 32 (+6.3% decode on the H200;
 * `LILY_CUDA_MOE=q` for moe_fused_q), in its SHF form moe_fused_q2s since session 36 (+1.3%;
 * `LILY_CUDA_MOE=q2` for the plain order).
 *
 * Math (as moe_fused_q): slots s < S = K + 1 are the top-K routed experts of `logits` and the
 *   shared expert (stacked as expert E, weight sigmoid(logits[E])); xw = rms_norm(x) * normw;
 *   h[s, i] = w_s * silu(G_s[i] . xw) * (U_s[i] . xw) for i < inter (G_s, U_s: matrices 2 e_s and
 *   2 e_s + 1 of the interleaved gate/up stack); x[r] += sum_s D_{e_s}[r] . h[s] for r < H.
 *
 * What differs from moe_fused_q, each aimed at a step of its chain:
 *   - the top-K runs in warp 0 (route_topk, or with LILY_CUDA_ROUTE=reg route_topk_reg: one
 *     load round, five butterfly merges, but ~2,500 straight-line instructions, 40 KB of code
 *     run once a launch) while the other 15 warps stage xw (and the norm's partial sums);
 *   - a gate/up row group is the pair (G_s[i], U_s[i]) (gq_load with row stride inter), so the
 *     warp that finishes it writes h[s, i] itself: the down projection stages S * inter products
 *     instead of 2 S * inter values and their SiLUs;
 *   - the pairs are spread over every block of the grid (moe_fused_q leaves blocks idle when
 *     2 S does not divide the SMs).
 *   - the blocks' meeting (their own u64 ctr, raised by G per launch) takes no round trip at the
 *     arrival: the target comes from the counter as read after the PDL wait (the next multiple of
 *     G above it), the arrival is a
 *     release add (grid_arrive_rel).
 *   - moe_fused_q2s_given (GIVEN; the decode default since session 48, LILY_CUDA_MOE_ROUTER=tailk):
 *     the top-K already ran in gemv_q2_route's last block (gemv_route.cu), which left it in
 *     ids_out/wts_out; warp 0 reads it from there instead (its own entry point: as a runtime
 *     branch in moe_fused_q2s it spilled 32 bytes).
 *   - moe_fused_q2s_acc (ACC; LILY_CUDA_MOE_ROUTER=acc): gemv_q2_route_acc (gemv_route.cu) left
 *     the router's sums in fixed point, not the logits: `logits` points at them (u64 [E + 1],
 *     then the rblocks route blocks' sums of squares, f32, at float offset 2 (E + 1)), and warp 0
 *     of every block forms the logits as gemv_q2_route_fx's last block does (the same bits) and
 *     routes on them (mf2_route_acc; rblocks: the route's grid); block 0 publishes the routing
 *     in ids_out/wts_out and, past the blocks' meeting (each has read the sums before arriving),
 *     zeroes the accumulators for the next layer's route.
 *   - moe_fused_q2s_accb (ACC = 2; LILY_CUDA_MOE_TOPK=block): moe_fused_q2s_acc with the logits
 *     and the top-K by 8 warps (mf2_route_block: warps 0 and 9..15, the staging on 1..8) in two
 *     rounds of counting instead of warp 0's one-warp top-K (~1.7 µs beside busy warps, session
 *     41); the same picks and weight bits.
 *   Then, as moe_fused_q: the down rows' first loads are issued before the wait, and gq_body's
 *   moe_down body adds into x
 *   (accumulate = acc: 1 load-add-store, 2 an atomic add, LILY_CUDA_ACC_RED).
 *   Picks, weights and the products are computed in moe_fused_q's order, so the results are its
 *   own (tests/cuda_kernels.rs holds the ids and weights to its bits).
 *
 * SHF (moe_fused_q2s, LILY_CUDA_MOE=q2s): the shared expert's pairs first. A warp's pairs are
 *   the same grid-strided sequence q = w, w + W, ... (W = 16 G warps), each mapped to pair
 *   (q + K inter) mod S inter, so the first `inter` warps of the grid start on the shared
 *   expert's pairs (slot K, expert E of the stack: known before the top-k), and those warps load
 *   that pair's first trip into registers before the PDL wait, while the router still runs. Where
 *   S inter mod W <= inter, the warps with one pair more than the others (the first S inter mod W)
 *   are among them, so the longest chain after the top-k loses one HBM trip (Qwen3.6: 9 x 512
 *   pairs over 132 x 16 warps, the 384 with a third pair). Each pair's sum is the same wherever it is
 *   computed: q2's bits.
 *
 * Geometry: grid G <= SMs blocks of 512 threads (one per SM, all resident, G >= H / 16), the
 *   pairs grid-strided over the G * 16 warps; dynamic shared memory: max(H + H/EPV,
 *   S*inter + S*inter/EPV) floats. Requires E <= 512, K <= 16 and H / EPV <= 480 (the host
 *   checks), the router not fused.
 */

/* Warps 1..15 stage xw and the chunk sums like gq_stage (chunk ch by thread 32 + ch, one chunk
   each, nch <= 480), and leave each warp's sum of squares in red[warp - 1]: the same per-warp
   values gq_stage's block_sum would see, one warp later. */
template <int EPV>
__device__ __forceinline__ void mf2_stage(const float* xg, int cols, const float* normw, float* xs, float* xsum,
                                          float* red) {
    const int v = threadIdx.x >> 5;
    int nch = cols / EPV, ch = 32 * (v - 1) + (threadIdx.x & 31);
    float ss = 0.f;
    if constexpr (GQ_I8 && EPV == 32) { /* gemv.cu's int8 staging over warps 1..15 */
        ss = i8_stage(nch, xs, ch, blockDim.x - 32, [&](int c, int w, float (&v)[8]) {
            const float4* x4 = (const float4*)(xg + 32 * c + 8 * w);
            const float4* n4 = (const float4*)(normw + 32 * c + 8 * w);
            float4 a = x4[0], b = x4[1], na = n4[0], nb = n4[1];
            float r[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w}, q = 0.f;
            float nw[8] = {na.x, na.y, na.z, na.w, nb.x, nb.y, nb.z, nb.w};
#pragma unroll
            for (int j = 0; j < 8; j++) {
                q += r[j] * r[j];
                v[j] = r[j] * nw[j];
            }
            return q;
        });
    } else if (ch < nch) {
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
            float4 nw = n4[j];
            a = make_float4(a.x * nw.x, a.y * nw.y, a.z * nw.z, a.w * nw.w);
            o4[xswz(ch * (EPV / 4) + j)] = a;
            sum += (a.x + a.y) + (a.z + a.w);
        }
        xsum[ch] = sum;
    }
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) red[v - 1] = ss;
}

/* The gate/up pairs: group g = s * inter + i is rows (2 e_s) * inter + i and that + inter, read
   in trips of U = 2 chunks per lane like gq_body's walk (the next trip's loads in flight while
   one is computed); the finished pair writes h[g] = wk[s] * silu(gate) * up. (Session 36's q3,
   the pairs dealt warp-major and the third and fourth trips requested into the L2, measured
   −1.5% and was removed.) */
/* Trip tt of the pair whose gate row is r0 (its up row `inter` rows on) into tr: the guard-free
   load where the trip's chunks all exist. */
template <int BITS>
__device__ __forceinline__ void mf2_load(GqTrip<2, 2>& tr, const u32* w, const u16* sc, const u16* bi, long long r0,
                                         int n4, int ng, int gsh, int tt, int inter) {
    constexpr int NR = 2, U = 2;
    int i0 = tt * 32 * U + (threadIdx.x & 31);
    if ((tt + 1) * 32 * U <= n4)
        gq_load<BITS, NR, U, true, true>(tr, w, sc, bi, r0, NR, n4, ng, gsh, i0, inter);
    else
        gq_load<BITS, NR, U, false, true>(tr, w, sc, bi, r0, NR, n4, ng, gsh, i0, inter);
}

/* The trip mf2_pairs<SHF> loads before the PDL wait: the first trip of the warp's first pair when
   that pair is the shared expert's (q < inter: row 2E inter + q of the gate/up stack); returns
   whether it loaded. */
template <int BITS>
__device__ __forceinline__ bool mf2_shared_first(GqTrip<2, 2>& cur, const u32* w, const u16* sc, const u16* bi,
                                                 int group, int inter, int cols, int E) {
    constexpr int EPV = 128 / BITS;
    int q = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (q >= inter) return false;
    mf2_load<BITS>(cur, w, sc, bi, (long long)(2 * E) * inter + q, cols / EPV, cols / group, __ffs(group) - 1, 0, inter);
    return true;
}

template <int BITS, int TY, bool SHF = false>
__device__ __forceinline__ void mf2_pairs(const u32* w, const u16* sc, const u16* bi, int group, int inter, int cols,
                                          const int* ids, const float* wk, int S, const float* xs,
                                          const float* xsum, float rr, float* h, GqTrip<2, 2>& cur, bool pre) {
    constexpr int EPV = 128 / BITS, NR = 2, U = 2;
    int lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    int n4 = cols / EPV, ng = cols / group, gsh = __ffs(group) - 1;
    int tpr = (n4 + 32 * U - 1) / (32 * U), ngroups = S * inter, gstride = gridDim.x * nwarps;
    int g = blockIdx.x * nwarps + (threadIdx.x >> 5), t = 0;
    /* the pair at place gg of the warps' sequences (SHF: rotated by the routed slots' pairs) */
    const int rot = SHF ? (S - 1) * inter : 0;
    auto pair = [&](int gg) { return SHF ? (gg + rot < ngroups ? gg + rot : gg + rot - ngroups) : gg; };
    /* the row of the gate of the pair at place gg (its up row is `inter` rows on) */
    auto row = [&](int gg) {
        int pg = pair(gg), s = pg / inter;
        return (long long)(2 * ids[s]) * inter + (pg - s * inter);
    };
    GqTrip<NR, U> nxt;
    auto load = [&](GqTrip<NR, U>& tr, int gg, int tt) { mf2_load<BITS>(tr, w, sc, bi, row(gg), n4, ng, gsh, tt, inter); };
    if (g < ngroups && !pre) load(cur, g, 0);
    float acc[NR] = {0.f, 0.f};
    while (g < ngroups) {
        int g2 = g, t2 = t + 1;
        if (t2 == tpr) {
            g2 = g + gstride;
            t2 = 0;
        }
        if (g2 < ngroups) load(nxt, g2, t2);
        int i0 = t * 32 * U + lane;
        if ((t + 1) * 32 * U <= n4)
            gq_compute<BITS, TY, NR, U, false, true>(cur, NR, n4, i0, xs, xsum, acc);
        else
            gq_compute<BITS, TY, NR, U, false, false>(cur, NR, n4, i0, xs, xsum, acc);
        if (t + 1 == tpr) {
            float gv = warp_sum(acc[0]) * rr, uv = warp_sum(acc[1]) * rr;
            acc[0] = acc[1] = 0.f;
            int pg = pair(g);
            if (lane == 0) h[pg] = wk[pg / inter] * (silu_f(gv) * uv);
        }
        cur = nxt;
        g = g2;
        t = t2;
    }
}

/* The blocks' meeting without a round trip at the arrival: thread 0 reads the counter right after
   the PDL wait (every earlier launch on it has completed: nG, plus the arrivals of this launch's
   blocks that got there first, fewer than G since this block has not arrived) and waits for the
   next multiple of G, (n + 1)G (not base + G: a block placed late may read some arrivals);
   arriving is one release add that nobody waits for (the block's writes, ordered before it by
   the barrier, are visible to whoever sees the add). */
__device__ __forceinline__ u64 ld_relaxed_u64(const u64* p) {
    u64 v;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void grid_arrive_rel(u64* ctr) {
    __syncthreads();
    if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u64 [%0], 1;" ::"l"(ctr) : "memory");
}

/* ACC: the router's logits from gemv_q2_route_acc's sums into ls (rt_tail's arithmetic, so its
   bits: the R = E + 1 accumulators at 2^-32, times 1 / sqrt(mean of squares + eps), the route's
   G blocks' sums of squares added lane-strided then across the warp), then the top-K on them.
   Warp 0. */
__device__ __forceinline__ void mf2_route_acc(const u64* acc, int E, int H, int G, float eps, int mode, int K,
                                              int renorm, float* ls, int* chosen, float* wsel) {
    constexpr int N = 12; /* accumulators a lane loads a round: one round up to R = 384 */
    const int lane = threadIdx.x & 31, R = E + 1;
    const float* sq = (const float*)acc + 2 * R;
    RtSq sqv; /* loaded with the first round of sums, added after it */
    rt_sq_load(sqv, sq, G);
    float v[N];
    for (int j0 = 0; j0 < R; j0 += 32 * N) {
#pragma unroll
        for (int i = 0; i < N; i++) {
            int j = j0 + 32 * i + lane;
            v[i] = j < R ? rt_unfx(__ldcg(acc + j)) : 0.f;
        }
#pragma unroll
        for (int i = 0; i < N; i++)
            if (j0 + 32 * i + lane < R) ls[j0 + 32 * i + lane] = v[i];
    }
    const float rr = 1.f / sqrtf(warp_sum(rt_sq_add(sqv, sq, G)) / (float)H + eps);
    __syncwarp();
    for (int j = lane; j < R; j += 32) ls[j] *= rr;
    __syncwarp();
    route_warp_smem(mode, ls, E, K, renorm, chosen, wsel);
}

/* ACC_BLOCK (moe_fused_q2s_accb, LILY_CUDA_MOE_TOPK=block): mf2_route_acc's logits and picks by the
   block's 8 routing warps (0 and 9..15: warps 1..8 stage the input beside them) instead of warp 0
   alone, in fewer dependent steps. Routing thread rt < 256 forms logits rt and rt + 256 (< E) as
   mf2_route_acc does (the same bits: every warp adds the route blocks' sums of squares in its
   order) and their route_key words (distinct; larger = the higher logit, ties to the lower index,
   NaN as -inf); each warp ranks the 32 words of its segments (experts 32s .. 32s + 31, s = its
   index and that + 8) by counting the larger ones and keeps the K best of each as candidates;
   after a barrier of the 256, thread rt ranks candidate rt among the nseg K and the K best are the
   picks, in order; after another, warp 0 turns them into weights as route_topk_thresh does (the
   max = the first pick, the picks' exps added in pick order, or with !renorm route_topk's sum over
   all E): its picks and weight bits. Scratch in `sc` (shared, MF2_LS floats): the logits [512],
   the words [512] (u64), the candidates [16 K + 2], the picks [K], the picks' exps [32]. */
constexpr int MF2_LS = 512 + 2 * 512 + 2 * 258 + 2 * 16 + 32;
__device__ __forceinline__ void mf2_rbar() { asm volatile("bar.sync 1, 256;" ::: "memory"); }
__device__ __forceinline__ void mf2_route_block(const u64* acc, int E, int H, int G, float eps, int K, int renorm,
                                                float* sc, int* chosen, float* wsel) {
    const int lane = threadIdx.x & 31, rt = threadIdx.x < 32 ? threadIdx.x : threadIdx.x - 256, rw = rt >> 5;
    float* ls = sc;
    u64 *key = (u64*)(sc + 512), *cand = key + 512, *pick = cand + 258;
    float* s_e = (float*)(pick + 16);
    const float* sq = (const float*)acc + 2 * (E + 1);
    RtSq sqv; /* loaded with the sums, added after them */
    rt_sq_load(sqv, sq, G);
    const u64 a0 = rt < E ? __ldcg(acc + rt) : 0ull, a1 = rt + 256 < E ? __ldcg(acc + rt + 256) : 0ull;
    const u64 ag = rt == 0 ? __ldcg(acc + E) : 0ull;
    const float rr = 1.f / sqrtf(warp_sum(rt_sq_add(sqv, sq, G)) / (float)H + eps);
    const float l0 = rt_unfx(a0) * rr, l1 = rt_unfx(a1) * rr;
    const int nseg = (E + 31) >> 5, C = nseg * K;
    if (rt < E) ls[rt] = l0;
    if (rt + 256 < E) ls[rt + 256] = l1;
    /* the words of this thread's two experts, 0 past E within the last segment (below every word) */
    if (rt < 32 * nseg) key[rt] = rt < E ? route_key(l0, rt) : 0ull;
    if (rt + 256 < 32 * nseg) key[rt + 256] = rt + 256 < E ? route_key(l1, rt + 256) : 0ull;
    __syncwarp(); /* a warp's segments are its own lanes' words */
    for (int s = rw; s < nseg; s += 8) { /* warp-uniform */
        const u64* seg = key + 32 * s;
        const u64 mine = seg[lane];
        int r = 0;
#pragma unroll
        for (int m = 0; m < 32; m += 2) {
            ulonglong2 p = *(const ulonglong2*)(seg + m);
            r += (p.x > mine) + (p.y > mine);
        }
        /* the segment's K slots, each written once: its valid words by rank, zeros past them */
        if (mine != 0ull && r < K) cand[s * K + r] = mine;
        if (mine == 0ull && lane < K) cand[s * K + lane] = 0ull;
    }
    if (rt == 0) cand[C] = 0ull; /* the pair loads below read one past C when C is odd */
    mf2_rbar();
    if (rt < C) {
        const u64 mine = cand[rt];
        int r = 0;
        for (int m = 0; m < C; m += 2) {
            ulonglong2 p = *(const ulonglong2*)(cand + m);
            r += (p.x > mine) + (p.y > mine);
        }
        if (r < K && mine != 0ull) pick[r] = mine;
    }
    mf2_rbar();
    if (rw != 0) return;
    const float mx = route_key_value(pick[0]);
    float tot = 0.f;
    if (!renorm) { /* route_topk's order */
        for (int e = lane; e < E; e += 32) tot += expf(ls[e] - mx);
        tot = warp_sum(tot);
    }
    const u64 mine = lane < K ? pick[lane] : 0ull;
    const float ek = lane < K ? expf(route_key_value(mine) - mx) : 0.f;
    if (lane < K) s_e[lane] = ek;
    __syncwarp();
    float den = tot;
    if (renorm) {
        den = 0.f;
        for (int k = 0; k < K; k++) den += s_e[k];
    }
    if (lane < K) {
        chosen[lane] = (int)(0xffffffffu - (u32)mine);
        wsel[lane] = ek / den;
    }
    if (lane == 0) {
        chosen[K] = E;
        wsel[K] = sigmoid_f(rt_unfx(ag) * rr);
    }
    __syncwarp();
}

template <int BITS, int TY, bool SHF = false, bool GIVEN = false, int ACC = 0>
__device__ __forceinline__ void mf2_body(MoeFusedParams_fields, float* xs, float* red, float* wsel, int* chosen,
                                         float* ls, u64* ts) {
    constexpr int EPV = 128 / BITS;
    float* xsum = xs + H;
    GqTrip<2, 2> cur;
    bool pre = false;
    if (SHF) { /* the shared expert's first trip, then the wait the other forms' entry made */
        pre = mf2_shared_first<BITS>(cur, (const u32*)wg, (const u16*)sg, (const u16*)bg, group_g, inter, H, E);
        pdl_begin();
        trace_stamp(ts, 1);
    }
    u64 base = 0; /* thread 0's: the counter before this launch */
    if (threadIdx.x == 0) base = ld_relaxed_u64(ctr);
    if (ACC == 2) { /* routing warps 0 and 9..15 (then their staging, where H leaves them any), 1..8 stage */
        if (threadIdx.x < 32 || threadIdx.x >= 288)
            mf2_route_block((const u64*)logits, E, H, rblocks, eps, K, renorm, ls, chosen, wsel);
        if (threadIdx.x >= 32) mf2_stage<EPV>(x, H, normw, xs, xsum, red);
    } else if (threadIdx.x < 32) {
        if (GIVEN) { /* gemv_q2_route's last block routed (LILY_CUDA_MOE_ROUTER=tailk) */
            if (threadIdx.x <= K) {
                chosen[threadIdx.x] = ids_out[threadIdx.x];
                wsel[threadIdx.x] = wts_out[threadIdx.x];
            }
        } else if (ACC) { /* gemv_q2_route_acc's sums (LILY_CUDA_MOE_ROUTER=acc) */
            mf2_route_acc((const u64*)logits, E, H, rblocks, eps, rank, K, renorm, ls, chosen, wsel);
        } else {
            route_warp(rank, logits, E, K, renorm, 1, ls, chosen, wsel);
        }
    } else {
        mf2_stage<EPV>(x, H, normw, xs, xsum, red);
    }
    __syncthreads();
    /* gq_stage's block_sum over the 16 warps' sums (warp w's now in red[w - 1], warp 15's slot
       zero as in a 16-warp block whose last warp staged nothing) */
    float ss = (threadIdx.x & 31) < 15 ? red[threadIdx.x & 31] : 0.f;
    float rr = 1.f / sqrtf(warp_sum(ss) / (float)H + eps);
    if (GIVEN)
        trace_stamp(ts, 2);
    else
        moe_publish_route(fixed, E, K, chosen, wsel, ids_out, wts_out, ts);
    mf2_pairs<BITS, TY, SHF>((const u32*)wg, (const u16*)sg, (const u16*)bg, group_g, inter, H, chosen, wsel,
                                   K + 1, xs, xsum, rr, gu, cur, pre);
    trace_stamp(ts, 3);
    grid_arrive_rel(ctr);
    const u64 G = gridDim.x, target = (base / G + 1) * G; /* used by thread 0 alone (grid_wait) */
    const ConvEpi nc{0, 0, 0, 0, 1};
    gq_body<BITS, TY, MD_NR, MD_U, false, true>((const u32*)wd, (const u16*)sd, (const u16*)bd, group_d, gu, x, H,
                                                inter, 0, acc, nullptr, 0.f, xs, 0, chosen, K + 1, nc, blockIdx.x,
                                                gridDim.x, ctr, target, ts ? ts + 4 : nullptr);
    if (ACC && blockIdx.x == 0) /* past the meeting: every block's reads of the sums are done */
        for (int j = threadIdx.x; j <= E; j += blockDim.x) __stcg((u64*)logits + j, 0ull);
}

/* The entry points: moe_fused_q2 and moe_fused_q2s = moe_fused_q2 with the shared expert's pairs
   first (SHF; its body makes the PDL wait, after its first loads), and q2s's routing forms: the
   same grid, counter and result. */
#define MF2_KERNEL(NAME, SHF, GIVEN, ACC)                                                                              \
    extern "C" __global__ void __launch_bounds__(512, 1) NAME(MoeFusedParams_fields) {                                 \
        extern __shared__ __align__(16) float xs[];                                                                    \
        __shared__ float red[33], wsel[65];                                                                            \
        __shared__ __align__(16) float ls[MF2_LS]; /* the top-K's scratch (E <= 512) */                                \
        __shared__ int chosen[65];                                                                                     \
        TL_SCOPE(#NAME);                                                                                               \
        u64* ts = trace ? trace + 16 * blockIdx.x : nullptr; /* stamps as moe_fused_q's (no 8, 9) */                   \
        trace_stamp(ts, 0);                                                                                            \
        if (!SHF) {                                                                                                    \
            pdl_begin();                                                                                               \
            trace_stamp(ts, 1);                                                                                        \
        }                                                                                                              \
        if (bits == 4 && ty == TY_BF16) MF2(4, TY_BF16, SHF, GIVEN, ACC);                                              \
        else if (bits == 4) MF2(4, TY_F16, SHF, GIVEN, ACC);                                                           \
        else if (ty == TY_BF16) MF2(8, TY_BF16, SHF, GIVEN, ACC);                                                      \
        else MF2(8, TY_F16, SHF, GIVEN, ACC);                                                                          \
        trace_stamp(ts, 6);                                                                                            \
    }
#define MF2(B, T, SH, GV, AC) mf2_body<B, T, SH, GV, AC>(MoeFusedParams_names, xs, red, wsel, chosen, ls, ts)
MF2_KERNEL(moe_fused_q2, false, false, 0)
MF2_KERNEL(moe_fused_q2s, true, false, 0)
MF2_KERNEL(moe_fused_q2s_given, true, true, 0)
MF2_KERNEL(moe_fused_q2s_acc, true, false, 1)
MF2_KERNEL(moe_fused_q2s_accb, true, false, 2)
#undef MF2
#undef MF2_KERNEL
