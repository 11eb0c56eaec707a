/*
 * moe.cu: routing and combination for the MoE block (batch 1).
 *
 * moe_topk: for each token t = blockIdx.x: logits + t*lstride [E] (E <= 1024) -> ids + t*K (int),
 *   weights + t*K (f32), all on the device.
 *   p_e = exp(l_e - max l); top-K by logit (ties: lower index), w_k = p_k / (renorm ? sum_topk p : sum_all p)
 *   (fp32 softmax, renormalized over the K chosen). grid 1, block 32 (one warp): K rounds of a
 *   warp argmax over a shared copy, the winner masked out each round. ids2 (nullable, decode
 *   only) gets [2e, 2e+1] per choice: expert e's gate and up in an interleaved gate/up stack.
 *   shared != 0 (the shared expert stacked as expert E): one more slot K with id E, weight
 *   sigmoid(logits[E]) (the shared-expert gate logit follows the E router logits) and ids2
 *   [2E, 2E+1]; token t's slots then start at t*(K+1).
 *   grid (T), block 32.
 *
 * moe_align (prefill): P = T*K routed pairs i (pair i = token i/K, choice i%K, expert ids[i]) are
 *   grouped by expert for the grouped GEMM: cnt[e] by shared atomics, an exclusive scan off[e],
 *   perm[off[e] + rank] = i and inv[i] = its slot (the rank within an expert comes from an
 *   atomic, so the order inside a segment varies run to run; every row is computed on its own,
 *   so results do not). tiles = [count, (e, m0, m1) x count] with tiles of at most bm rows that
 *   never span two experts (count <= P/bm + E); thread e owns expert e (one block scan of the
 *   counts and tile counts gives its offset and first tile). grid 1, block 1024 (exactly), E <= 1024.
 *
 * moe_combine_rows (prefill): x[t, r] += sum_k w[t, k] ye[inv[t*K + k], r] + sigmoid(sg[t*sgs]) ys[t, r]
 *   (inv null: the pairs in token order, row t*K + k; the batched decode's).
 *   grid (ceil(H/256), T), block 256.
 *
 * moe_combine: x[r] += sum_k w_k * ye[k, r] + g * ys[r], g = sigmoid(sg[0]) when sg, else 1
 *   (shared expert gate); ye [K, H] expert outputs, ys [H] shared expert output (ys may be null).
 *   grid ceil(H/256), block 256.
 */
/* The top-K routing of one token, run by one warp (lane = threadIdx.x & 31): ls (shared, E
   floats) is scratch; chosen[0..K) and wsel[0..K) (shared) get the experts and their weights, and
   with `shared` chosen[K] = E, wsel[K] = sigmoid(logits[E]). Visible to the warp on return. */
__device__ __forceinline__ void route_topk(const float* logits, int E, int K, int renorm, int shared, float* ls,
                                           int* chosen, float* wsel) {
    int lane = threadIdx.x & 31;
    float mx = -INFINITY;
    for (int e = lane; e < E; e += 32) {
        ls[e] = __ldcg(logits + e); /* through L2: in pstep other SMs wrote the logits */
        mx = fmaxf(mx, ls[e]);
    }
    mx = warp_max(mx);
    float tot = 0.f;
    for (int e = lane; e < E; e += 32) tot += expf(ls[e] - mx);
    tot = warp_sum(tot);
    __syncwarp();
    for (int k = 0; k < K; k++) {
        float bv = -INFINITY;
        int bi = 0x7fffffff;
        for (int e = lane; e < E; e += 32) {
            float v = ls[e];
            if (v > bv || (v == bv && e < bi)) { bv = v; bi = e; }
        }
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        if (bi == 0x7fffffff) bi = 0;
        if (lane == 0) {
            chosen[k] = bi;
            wsel[k] = bv; /* the chosen logit, turned into its weight below */
            ls[bi] = -INFINITY;
        }
        __syncwarp();
    }
    if (lane == 0) {
        float sel = 0.f;
        for (int k = 0; k < K; k++) sel += expf(wsel[k] - mx);
        float den = renorm ? sel : tot;
        for (int k = 0; k < K; k++) wsel[k] = expf(wsel[k] - mx) / den;
        if (shared) {
            chosen[K] = E;
            wsel[K] = sigmoid_f(__ldcg(logits + E));
        }
    }
    __syncwarp();
}

/* route_topk with the warp's work in registers (moe_fused_q2): lane l holds logits l + 32j
   (j < VPL, E <= 32 VPL), loaded at once; each lane keeps its L best as sorted 64-bit keys (the
   logit's bits made orderable, NaN as -inf and -0 as +0, above ~index so that ties go to the
   lower index), then five butterfly rounds merge partner lanes' lists (the top L of two sorted
   lists: c_i = max(a_i, b_{L-1-i}), a bitonic sequence, then log2 L compare-exchange stages), so
   every lane ends with the same top L, of which the first K (K <= L) are the picks. The max, the
   softmax sum and the weights are computed in route_topk's order, so picks and weights are its
   own bit for bit (except for NaN logits, which rank as -inf as in route_rank). Writes chosen /
   wsel (shared) like route_topk; visible to the warp on return. */
__device__ __forceinline__ u64 route_key(float v, int e) {
    v = v != v ? -INFINITY : (v == 0.f ? 0.f : v);
    u32 u = __float_as_uint(v);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((u64)u << 32) | (u64)(0xffffffffu - (u32)e);
}
__device__ __forceinline__ float route_key_value(u64 k) {
    u32 u = (u32)(k >> 32);
    u = (u & 0x80000000u) ? (u & 0x7fffffffu) : ~u;
    return __uint_as_float(u);
}
/* The register top-k forms' loads: lane l's logits l + 32j (j < VPL) and the shared expert's
   gate logit (lane 0) in one round. SMEM: the logits are in shared memory (the MoE's and
   the route launch's routing, the persistent step), else global (read through L2). */
template <int VPL, bool SMEM = false>
__device__ __forceinline__ void route_regs_load(const float* logits, int E, int shared, float (&v)[VPL], float& gate) {
    int lane = threadIdx.x & 31;
    auto ld = [&](int i) { return SMEM ? logits[i] : __ldcg(logits + i); };
    gate = shared && lane == 0 ? ld(E) : 0.f;
#pragma unroll
    for (int j = 0; j < VPL; j++) v[j] = lane + 32 * j < E ? ld(lane + 32 * j) : 0.f;
}
/* The max over lane l's logits l + 32j < E and the warp, and (need_tot) the softmax sum in
   route_topk's order. */
template <int VPL>
__device__ __forceinline__ void route_regs_mxtot(const float (&v)[VPL], int E, float& mx, float& tot, bool need_tot) {
    int lane = threadIdx.x & 31;
    mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < VPL; j++)
        if (lane + 32 * j < E) mx = fmaxf(mx, v[j]);
    mx = warp_max(mx);
    tot = 0.f;
    if (!need_tot) return; /* the weights renormalized over the picks: the sum over all unused */
#pragma unroll
    for (int j = 0; j < VPL; j++)
        if (lane + 32 * j < E) tot += expf(v[j] - mx);
    tot = warp_sum(tot);
}
/* The register top-k forms' prologue: route_regs_load, then route_regs_mxtot. */
template <int VPL, bool SMEM = false>
__device__ __forceinline__ void route_regs_softmax(const float* logits, int E, int shared, float (&v)[VPL], float& gate,
                                                   float& mx, float& tot, bool need_tot = true) {
    route_regs_load<VPL, SMEM>(logits, E, shared, v, gate);
    route_regs_mxtot<VPL>(v, E, mx, tot, need_tot);
}
template <int VPL, int L>
__device__ __forceinline__ void route_topk_reg(const float* logits, int E, int K, int renorm, int shared, int* chosen,
                                               float* wsel) {
    int lane = threadIdx.x & 31;
    float gate, v[VPL], mx, tot;
    route_regs_softmax<VPL>(logits, E, shared, v, gate, mx, tot);
    u64 key[L];
#pragma unroll
    for (int i = 0; i < L; i++) key[i] = 0; /* below every real key */
#pragma unroll
    for (int j = 0; j < VPL; j++) {
        if (lane + 32 * j < E) { /* insertion into the descending list */
            u64 c = route_key(v[j], lane + 32 * j);
#pragma unroll
            for (int i = 0; i < L; i++) {
                u64 a = key[i];
                bool up = c > a;
                key[i] = up ? c : a;
                c = up ? a : c;
            }
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        u64 b[L];
#pragma unroll
        for (int i = 0; i < L; i++) b[i] = __shfl_xor_sync(0xffffffffu, key[i], o);
#pragma unroll
        for (int i = 0; i < L; i++) key[i] = key[i] > b[L - 1 - i] ? key[i] : b[L - 1 - i];
#pragma unroll
        for (int st = L / 2; st > 0; st >>= 1)
#pragma unroll
            for (int i = 0; i < L; i++)
                if ((i & st) == 0 && key[i] < key[i + st]) {
                    u64 t = key[i];
                    key[i] = key[i + st];
                    key[i + st] = t;
                }
    }
    /* route_topk's weights: sel summed over k in order, then each weight */
    float sel = 0.f;
#pragma unroll
    for (int i = 0; i < L; i++)
        if (i < K) sel += expf(route_key_value(key[i]) - mx);
    float den = renorm ? sel : tot;
#pragma unroll
    for (int i = 0; i < L; i++)
        if (i < K && lane == i) {
            chosen[i] = (int)(0xffffffffu - (u32)key[i]);
            wsel[i] = expf(route_key_value(key[i]) - mx) / den;
        }
    if (shared && lane == 0) {
        chosen[K] = E;
        wsel[K] = sigmoid_f(gate);
    }
    __syncwarp();
}

/* route_topk with the logits in registers (lane l holds l + 32j, j < VPL, E <= 32 VPL, loaded in
   one round with the shared expert's gate logit) and each of the K rounds' winner found by two
   warp reductions (redux.sync: the largest order key, then the lowest index holding it), not by
   five dependent shuffle-and-compare levels over a shared copy; ~100 instructions of code in a
   loop (route_topk_reg's merges are ~2,500 run once). Keys as route_key's upper half (NaN as
   -inf, -0 as +0; 0 = taken or past E). The max, the softmax sum and the weights in route_topk's
   order: its picks and weights bit for bit (NaN logits aside, ranked as -inf).
   PW (LILY_CUDA_ROUTE=redux2, K <= 32): the weights by the lanes, not by lane 0 alone: lane k
   keeps pick k and takes its exp, the denominator is added up over shuffles in route_topk's
   order, each lane divides its own (one exp and one division deep instead of 2K exps and K
   divisions one after another); and with `renorm` the softmax sum over all E, which only the
   unrenormalized weights use, is not computed. The same bits. SMEM: as route_regs_softmax's. */
template <int VPL, bool PW = false, bool SMEM = false>
__device__ __forceinline__ void route_topk_redux(const float* logits, int E, int K, int renorm, int shared,
                                                 int* chosen, float* wsel) {
    int lane = threadIdx.x & 31;
    float gate, v[VPL], mx, tot;
    route_regs_softmax<VPL, SMEM>(logits, E, shared, v, gate, mx, tot, !PW || !renorm);
    u32 key[VPL];
#pragma unroll
    for (int j = 0; j < VPL; j++) key[j] = lane + 32 * j < E ? (u32)(route_key(v[j], 0) >> 32) : 0u;
    u32 mine_m = 0, mine_i = 0; /* PW: pick number `lane`'s key and expert */
    for (int k = 0; k < K; k++) {
        u32 lm = 0;
#pragma unroll
        for (int j = 0; j < VPL; j++) lm = max(lm, key[j]);
        u32 m = __reduce_max_sync(0xffffffffu, lm);
        u32 li = 0xffffffffu;
#pragma unroll
        for (int j = VPL - 1; j >= 0; j--)
            if (key[j] == m) li = lane + 32 * j; /* this lane's lowest index holding m */
        u32 bi = __reduce_min_sync(0xffffffffu, li);
#pragma unroll
        for (int j = 0; j < VPL; j++)
            if (lane + 32 * j == (int)bi) key[j] = 0u;
        if (PW) {
            if (lane == k) {
                mine_m = m;
                mine_i = bi;
            }
        } else if (lane == 0) {
            chosen[k] = (int)bi;
            wsel[k] = route_key_value((u64)m << 32); /* the chosen logit, made a weight below */
        }
    }
    if (PW) {
        float ek = lane < K ? expf(route_key_value((u64)mine_m << 32) - mx) : 0.f;
        float sel = 0.f;
        for (int k = 0; k < K; k++) sel += __shfl_sync(0xffffffffu, ek, k); /* route_topk's order */
        float den = renorm ? sel : tot;
        if (lane < K) {
            chosen[lane] = (int)mine_i;
            wsel[lane] = ek / den;
        }
        if (shared && lane == 0) {
            chosen[K] = E;
            wsel[K] = sigmoid_f(gate);
        }
        __syncwarp();
        return;
    }
    __syncwarp();
    if (lane == 0) { /* route_topk's weights */
        float sel = 0.f;
        for (int k = 0; k < K; k++) sel += expf(wsel[k] - mx);
        float den = renorm ? sel : tot;
        for (int k = 0; k < K; k++) wsel[k] = expf(wsel[k] - mx) / den;
        if (shared) {
            chosen[K] = E;
            wsel[K] = sigmoid_f(gate);
        }
    }
    __syncwarp();
}

/* route_topk_redux<PW> out of line: route_topk_thresh's fallback, kept out of its callers' code. */
template <int VPL, bool SMEM>
__device__ __noinline__ void route_topk_redux_call(const float* logits, int E, int K, int renorm, int shared, int* chosen,
                                                   float* wsel) {
    route_topk_redux<VPL, true, SMEM>(logits, E, K, renorm, shared, chosen, wsel);
}

/* route_topk_redux's picks and weights without its K dependent rounds (LILY_CUDA_ROUTE=thresh,
   K <= 32, E <= 32 VPL), in fewer instructions: one warp issues this alone, so its time is about
   its instruction count times the dependent-issue latency (scripts/topk_time.sh).
   Order keys as route_key (NaN as -inf by fmaxf, -0 as +0 by adding +0; 0 = past E), lane l's
   largest lm_l. The K-th largest of the 32 lm is a lower bound L of the K-th largest key (the K
   lanes at or above it hold K distinct keys >= L), so every pick is among the c keys >= L (c ~ K
   to 2K on real logits). One pass over a shared copy of the lm counts each lane's lanes above
   (L = the least lm with fewer than K above); ballots over the per-lane counts give each lane its
   offset; the c candidates are written compactly as route_key's 64-bit (key, index) words, which
   are distinct and order as route_topk picks, and lane i ranks candidate i by counting the larger
   words (slots past c hold 0). Lane r < K holds pick r; its exp is summed over the picks in pick
   order through shared memory and each lane divides its own, as route_topk_redux<PW>, with the
   max = the first pick's key: the same bits. c > 32 (many equal logits): route_topk_redux<PW>.
   Scratch: 96 words of static shared memory, so one warp of a block at a time. */
template <int VPL, bool SMEM = false>
__device__ __forceinline__ void route_topk_thresh(const float* logits, int E, int K, int renorm, int shared,
                                                  int* chosen, float* wsel) {
    __shared__ __align__(16) u64 s_pk[32];
    __shared__ __align__(16) u32 s_lm[32];
    const int lane = threadIdx.x & 31;
    float gate, v[VPL];
    route_regs_load<VPL, SMEM>(logits, E, shared, v, gate);
    u32 key[VPL], lm = 0;
#pragma unroll
    for (int j = 0; j < VPL; j++) {
        u32 u = __float_as_uint(fmaxf(v[j], -INFINITY) + 0.f);
        u ^= (u32)((int)u >> 31) | 0x80000000u;
        key[j] = lane + 32 * j < E ? u : 0u;
        lm = max(lm, key[j]);
    }
    const u32 h = lm >> 1; /* L from 31-bit keys: a lower bound still, and (h - q) >> 31 = (q > h) */
    s_lm[lane] = h;
    __syncwarp();
    u32 above[4] = {0, 0, 0, 0};
#pragma unroll
    for (int m = 0; m < 32; m += 4) {
        uint4 q = *(const uint4*)(s_lm + m);
        above[0] += (h - q.x) >> 31;
        above[1] += (h - q.y) >> 31;
        above[2] += (h - q.z) >> 31;
        above[3] += (h - q.w) >> 31;
    }
    const u32 L = __reduce_min_sync(0xffffffffu, above[0] + above[1] + above[2] + above[3] < (u32)K ? h : 0xffffffffu) << 1;
    const u32 top = __reduce_max_sync(0xffffffffu, lm);
    u32 cm = 0; /* this lane's candidates, bit j */
#pragma unroll
    for (int j = 0; j < VPL; j++) cm |= (u32)(key[j] >= L) << j;
    const int cnt = __popc(cm);
    const u32 lt = (1u << lane) - 1u;
    int c = 0, off = 0;
#pragma unroll
    for (int b = 0; b < (VPL > 8 ? 5 : 4); b++) {
        u32 bb = __ballot_sync(0xffffffffu, (cnt >> b) & 1);
        c += __popc(bb) << b;
        off += __popc(bb & lt) << b;
    }
    if (c > 32) { /* warp-uniform */
        route_topk_redux_call<VPL, SMEM>(logits, E, K, renorm, shared, chosen, wsel);
        return;
    }
    float mx, tot = 0.f;
    if (renorm) {
        mx = route_key_value((u64)top << 32);
    } else { /* the sum over all E and its max, route_regs_softmax's */
        route_regs_mxtot<VPL>(v, E, mx, tot, true);
    }
    if (lane >= c) s_pk[lane] = 0ull; /* below every candidate */
#pragma unroll
    for (int j = 0; j < VPL; j++)
        if ((cm >> j) & 1)
            s_pk[off + __popc(cm & ((1u << j) - 1u))] = ((u64)key[j] << 32) | (u64)(0xffffffffu - (u32)(lane + 32 * j));
    __syncwarp();
    const u64 mine = s_pk[lane];
    int r = 0;
#pragma unroll 1
    for (int m = 0; m < c; m += 4) { /* slots m..m+3 < 32: those past c hold 0 */
        ulonglong2 a = *(const ulonglong2*)(s_pk + m), b = *(const ulonglong2*)(s_pk + m + 2);
        r += (a.x > mine) + (a.y > mine) + (b.x > mine) + (b.y > mine);
    }
    const bool pick = r < K; /* lanes >= c hold 0, below all c >= K candidates */
    const float ek = pick ? expf(route_key_value(mine) - mx) : 0.f;
    float* s_e = (float*)s_lm; /* s_lm's reads are behind the reductions above */
    if (pick) s_e[r] = ek;
    __syncwarp();
    float den = tot;
    if (renorm) {
        den = 0.f;
#pragma unroll 1
        for (int k = 0; k < K; k += 4) { /* route_topk's order; s_e[K..] may be stale: not added */
            float4 q = *(const float4*)(s_e + k);
            den += q.x;
            if (k + 1 < K) den += q.y;
            if (k + 2 < K) den += q.z;
            if (k + 3 < K) den += q.w;
        }
    }
    if (pick) {
        chosen[r] = (int)(0xffffffffu - (u32)mine);
        wsel[r] = ek / den;
    }
    if (shared && lane == 0) {
        chosen[K] = E;
        wsel[K] = sigmoid_f(gate);
    }
    __syncwarp();
}

/* The top-K of one warp by LILY_CUDA_ROUTE's form (`mode`: 5 thresh, 4 redux2 (redux with the
   weights by the lanes), 3 redux, 2 reg; where they take E and K), else route_topk. */
__device__ __forceinline__ void route_warp(int mode, const float* logits, int E, int K, int renorm, int shared,
                                          float* ls, int* chosen, float* wsel) {
    if (mode == 5 && E <= 256 && K <= 32)
        route_topk_thresh<8>(logits, E, K, renorm, shared, chosen, wsel);
    else if (mode == 5 && E <= 512 && K <= 32)
        route_topk_thresh<16>(logits, E, K, renorm, shared, chosen, wsel);
    else if ((mode == 4 || mode == 5) && E <= 256 && K <= 32)
        route_topk_redux<8, true>(logits, E, K, renorm, shared, chosen, wsel);
    else if ((mode == 4 || mode == 5) && E <= 512 && K <= 32)
        route_topk_redux<16, true>(logits, E, K, renorm, shared, chosen, wsel);
    else if (mode >= 3 && E <= 256)
        route_topk_redux<8>(logits, E, K, renorm, shared, chosen, wsel);
    else if (mode >= 3 && E <= 512)
        route_topk_redux<16>(logits, E, K, renorm, shared, chosen, wsel);
    else if (mode == 2 && E <= 256 && K <= 8)
        route_topk_reg<8, 8>(logits, E, K, renorm, shared, chosen, wsel);
    else if (mode == 2 && E <= 512 && K <= 16)
        route_topk_reg<16, 16>(logits, E, K, renorm, shared, chosen, wsel);
    else
        route_topk(logits, E, K, renorm, shared, ls, chosen, wsel);
}

/* The top-K of one warp from logits in shared memory (the persistent step and others; E <=
   512, the shared expert as slot K): route_topk_thresh in mode 5, else route_topk_redux, with the
   weights by the lanes in mode 4 (redux2). */
__device__ __forceinline__ void route_warp_smem(int mode, const float* ls, int E, int K, int renorm, int* chosen,
                                               float* wsel) {
    if (mode == 5 && K <= 32 && E <= 256)
        route_topk_thresh<8, true>(ls, E, K, renorm, 1, chosen, wsel);
    else if (mode == 5 && K <= 32)
        route_topk_thresh<16, true>(ls, E, K, renorm, 1, chosen, wsel);
    else if (mode >= 4 && K <= 32 && E <= 256)
        route_topk_redux<8, true, true>(ls, E, K, renorm, 1, chosen, wsel);
    else if (mode >= 4 && K <= 32)
        route_topk_redux<16, true, true>(ls, E, K, renorm, 1, chosen, wsel);
    else if (E <= 256)
        route_topk_redux<8, false, true>(ls, E, K, renorm, 1, chosen, wsel);
    else
        route_topk_redux<16, false, true>(ls, E, K, renorm, 1, chosen, wsel);
}

/* The same routing by a whole block of nt threads (nt a multiple of 32, at most 1024) meeting at
   Bar::sync() (every one of them calls this): logit e's rank is the number of logits above it or
   equal at a lower index (NaN counts as -inf), so the ranks are distinct and rank k < K is
   route_topk's k-th pick (same experts, same weights up to the order of the softmax sum when not
   renormalized). With E small the counting of one logit is split over up to 8 threads. A warp
   alone runs route_topk's K dependent rounds of shuffles (latency-bound, several µs); here every
   thread does one pass over E values in shared memory. scratch: 32 + nt floats (shared). On
   return chosen / wsel are visible to the block. */
struct BarBlock {
    __device__ static void sync() { __syncthreads(); }
};
template <class Bar>
__device__ void route_rank(const float* logits, int E, int K, int renorm, int shared, int nt, float* ls, float* scratch,
                           int* chosen, float* wsel) {
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = nt >> 5;
    float gate = shared && tid == 0 ? __ldcg(logits + E) : 0.f; /* issued with the others */
    float mx = -INFINITY;
    for (int e = tid; e < E; e += nt) {
        float v = __ldcg(logits + e);
        v = v != v ? -INFINITY : v;
        ls[e] = v;
        mx = fmaxf(mx, v);
    }
    mx = warp_max(mx);
    if (lane == 0) scratch[warp] = mx;
    Bar::sync();
    mx = scratch[0];
    for (int w = 1; w < nw; w++) mx = fmaxf(mx, scratch[w]);
    int parts = max(1, min(8, nt / E)), span = (E + parts - 1) / parts;
    int* cnt = (int*)scratch + 32; /* [parts][E] partial ranks (E * parts <= nt when parts > 1) */
    float tsum = 0.f;
    for (int t = tid; t < E * parts; t += nt) {
        int e = t % E, part = t / E, j0 = part * span, j1 = min(E, j0 + span);
        float v = ls[e];
        int rank = 0;
#pragma unroll 4
        for (int j = j0; j < j1; j++) {
            float u = ls[j];
            rank += (u > v) | ((u == v) & (j < e));
        }
        if (parts == 1) {
            if (rank < K) chosen[rank] = e, wsel[rank] = v;
        } else {
            cnt[t] = rank;
        }
        if (part == 0) tsum += expf(v - mx);
    }
    tsum = warp_sum(tsum);
    Bar::sync(); /* mx is read, the partial ranks are written */
    if (lane == 0) scratch[warp] = tsum;
    if (parts > 1)
        for (int e = tid; e < E; e += nt) {
            int rank = 0;
            for (int q = 0; q < parts; q++) rank += cnt[q * E + e];
            if (rank < K) chosen[rank] = e, wsel[rank] = ls[e];
        }
    Bar::sync();
    if (tid == 0) {
        float tot = 0.f, sel = 0.f;
        for (int w = 0; w < nw; w++) tot += scratch[w];
        for (int k = 0; k < K; k++) sel += expf(wsel[k] - mx);
        float den = renorm ? sel : tot;
        for (int k = 0; k < K; k++) wsel[k] = expf(wsel[k] - mx) / den;
        if (shared) {
            chosen[K] = E;
            wsel[K] = sigmoid_f(gate);
        }
    }
    Bar::sync();
}

extern "C" __global__ void moe_topk(MoeTopkParams_fields) {
    pdl_begin();
    __shared__ float ls[1024];
    __shared__ int chosen[65];
    __shared__ float wsel[65];
    int n = K + (shared ? 1 : 0); /* slots per token */
    logits += blockIdx.x * lstride;
    ids += blockIdx.x * n;
    wout += blockIdx.x * n;
    if (ids2) ids2 += blockIdx.x * 2 * n;
    route_topk(logits, E, K, renorm, shared, ls, chosen, wsel);
    for (int k = threadIdx.x; k < n; k += 32) {
        ids[k] = chosen[k];
        wout[k] = wsel[k];
        if (ids2) {
            ids2[2 * k] = 2 * chosen[k];
            ids2[2 * k + 1] = 2 * chosen[k] + 1;
        }
    }
}

extern "C" __global__ void moe_combine(MoeCombineParams_fields) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= H) return;
    float acc = 0.f;
    if (ys) acc = (sg ? sigmoid_f(sg[0]) : 1.f) * ys[r];
    for (int k = 0; k < K; k++) acc += w[k] * ye[(long long)k * H + r];
    x[r] += acc;
}

/* Exclusive block scan of (a, b) over the 1024 threads (32 warps); returns both and the totals. */
__device__ __forceinline__ int2 scan2_1024(int a, int b, int2* total) {
    __shared__ int2 wsum[32];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    int ia = a, ib = b;
    for (int o = 1; o < 32; o <<= 1) {
        int ua = __shfl_up_sync(0xffffffffu, ia, o), ub = __shfl_up_sync(0xffffffffu, ib, o);
        if (lane >= o) {
            ia += ua;
            ib += ub;
        }
    }
    if (lane == 31) wsum[w] = make_int2(ia, ib);
    __syncthreads();
    if (w == 0) {
        int2 v = wsum[lane];
        int sa = v.x, sb = v.y;
        for (int o = 1; o < 32; o <<= 1) {
            int ua = __shfl_up_sync(0xffffffffu, sa, o), ub = __shfl_up_sync(0xffffffffu, sb, o);
            if (lane >= o) {
                sa += ua;
                sb += ub;
            }
        }
        wsum[lane] = make_int2(sa - v.x, sb - v.y); /* exclusive prefix of the warps */
        if (lane == 31) *total = make_int2(sa, sb);
    }
    __syncthreads();
    int2 base = wsum[w];
    return make_int2(base.x + ia - a, base.y + ib - b);
}

/* Thread e (block 1024 >= E) owns expert e: its count, its offset and its tiles come from one
   block scan of (count, tile count), so no thread walks the experts serially. */
extern "C" __global__ void moe_align(MoeAlignParams_fields) {
    __shared__ int cnt[1024], off[1024], cur[1024];
    __shared__ int2 total;
    int e = threadIdx.x;
    cnt[e] = 0;
    cur[e] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < P; i += blockDim.x) atomicAdd(&cnt[ids[i]], 1);
    __syncthreads();
    int c = e < E ? cnt[e] : 0;
    int2 ex = scan2_1024(c, (c + bm - 1) / bm, &total);
    off[e] = ex.x;
    for (int j = 0, m0 = ex.x; m0 < ex.x + c; j++, m0 += bm) {
        int t = ex.y + j;
        tiles[1 + 3 * t] = e;
        tiles[2 + 3 * t] = m0;
        tiles[3 + 3 * t] = min(ex.x + c, m0 + bm);
    }
    __syncthreads();
    if (threadIdx.x == 0) tiles[0] = total.y;
    for (int i = threadIdx.x; i < P; i += blockDim.x) {
        int x = ids[i];
        int p = off[x] + atomicAdd(&cur[x], 1);
        perm[p] = i;
        inv[i] = p;
    }
}

extern "C" __global__ void moe_combine_rows(MoeCombineRowsParams_fields) {
    int r = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y;
    if (r >= H) return;
    float acc = 0.f;
    if (ys) acc = (sg ? sigmoid_f(sg[t * sgs]) : 1.f) * ys[(long long)t * H + r];
    for (int k = 0; k < K; k++) acc += w[t * K + k] * ye[(long long)(inv ? inv[t * K + k] : t * K + k) * H + r];
    x[(long long)t * H + r] += acc;
}
