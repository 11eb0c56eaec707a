/*
 * pstep.cu: the persistent decode step (batch 1, MLX 4/8-bit weights): one resident block per SM
 * walks a table of phases built once per session (src/cuda/pstep.rs writes the same PsPhase
 * layout), so the step's weights stream into shared memory ahead of the activations they meet.
 * This file: the table's layout, the synchronization helpers, the input staging and the GDN
 * state task; pstep_run.cu: the producer, the consumers' chunks, the router and the kernel.
 *
 * Phases (every dimension from the table):
 *   PS_GEMV      y[r] (+)= rr * sum_c W[r, c] xw[c] for the block's rows; the input transform xf:
 *                PX_PLAIN xw = x; PX_RMS xw = x * normw, rr = rsqrt(mean(x^2) + eps);
 *                PX_GATED (GDN out-projection) xw[c] = o[c] * rsqrt(mean_head(o^2) + eps) *
 *                normw[c % dv] * silu(z[c]) over heads of dv. Rows r < conv_c also run the GDN
 *                conv epilogue: cy[r] = silu(sum_j cw[r, j] X_j), X = [state[0..K-1, r]; y[r]],
 *                then state <- X[1..K] (the row's owner is the only reader of that state column).
 *   PS_GDN       the Gated DeltaNet state step, task (h, part) = 32 value columns of head h
 *                (rows, conv_c: the input projection's row count and conv channels):
 *                q, k of key head h / (hv / hk) from cy, l2-normalized (q also / sqrt(dk));
 *                beta = sigmoid(b[h]), alpha = exp(neg_a[h] softplus(a[h] + dt_bias[h]));
 *                per column j: uk = S[:, j].k, uq = S[:, j].q, delta = beta (v_j - alpha uk),
 *                o_j = alpha uq + delta (k.q), S[:, j] <- alpha S[:, j] + k delta  (fp32 S
 *                [hv, dk, dv]); o pre-norm (the out-projection's PX_GATED finishes it).
 *   PS_MOE_GU    top-K of the router logits (+ the shared expert as slot K, gate sigmoid(l[E])),
 *                then gate and up rows of the K + 1 chosen experts: y[(k*2 + m)*rows + r] for
 *                matrix 2 ids[k] + m of the interleaved gate/up stack, input PX_RMS.
 *   PS_MOE_DOWN  x[r] += sum_k w_k sum_c D[ids[k]][r, c] silu(g_k[c]) u_k[c].
 *
 * Schedule and synchronization: grid = one block per SM (all co-resident: the shared memory
 *   admits one), 16 consumer warps + 1 producer warp. Phase p's rows are split evenly over the
 *   blocks; the producer cuts the block's share into chunks that fit a slot of a ring of NS
 *   shared-memory slots and issues each chunk's codes, scales and biases as cp.async.bulk copies
 *   completing on the slot's "full" mbarrier, running ahead over later phases as slots free up
 *   (a phase's weights do not depend on its inputs; only the expert phases wait for the router:
 *   consumer warp 0 ranks the router logits right after the router's counter (ps_route, the
 *   graph's redux2 top-k from moe.cu) and completes the "route" mbarrier the producer waits on,
 *   while warps 1-15 stage the gate/up's input).
 *   Consumers take slots in order. A block finishing its share of phase i adds 1 to one u64
 *   counter and sets its done flag flags[i][block] = this launch's number ep (ctr[2] + 1), both
 *   behind one release fence. A phase that reads a whole vector (every GEMV: its input, its norm)
 *   waits, before its first chunk, for counter >= i * nblocks (acquire). A GDN state task waits
 *   instead only for the flags of the blocks whose input-projection shares hold its rows
 *   (ps_gdn_wait: q and k of its key head, its value columns, its b and a): a per-tile
 *   dependency, not a phase barrier. The MoE's router logits and gate/up (unless LILY_PSTEP_LL=0)
 *   are LL words (PS_LL_OUT, ll_store) that the next phase polls word by word (PS_LL_IN): no
 *   counter wait, and no fence at the end of the writing phase.
 *   The counter test stays exact: a block signals its phases in order and phase i (a counter
 *   phase) only after passing its wait, so until some block passes it every block has signalled
 *   at most phases 0 .. i - 1, and the counter reaching i * nblocks means each one has signalled
 *   them all (a GDN phase skipping the wait does not change that). The last block out
 *   resets the counter and the ticket and counts the launch in ctr[2]. Activations are read
 *   through L2 (ld.cg): other SMs wrote them.
 *   Inside a phase the warps do not meet: each takes its rows of a chunk and arrives on the
 *   slot's "empty" mbarrier (count = the 16 warps); a block barrier only opens a phase (its
 *   descriptor is copied to shared memory, its input staged) and closes it (the counter add).
 *   trace (nullable, LILY_PSTEP_TRACE=1): per (phase, block) PS_TW u32 of global-timer readings (ns):
 *   [0] the block starts the phase (after its wait), [1] signals it done, [2] the producer issued
 *   the phase's first copies, [3] the consumers saw its first slot full, [4] / [5] the producer
 *   passed the router wait / warp 0's top-k (expert phases), [6] the consumers' total wait for full
 *   slots in the phase, [7] the producer's total wait for empty slots in the phase, [8] the
 *   consumers staged the phase's input.
 *   dbg: measurement switches (LILY_PSTEP_DEBUG, the PS_DBG_* bits below): fixed experts (wrong
 *   outputs; shows what reading scattered experts costs) and the synchronization's forms.
 *
 * Slot layout of a chunk of n rows from m matrices (m = 1, or K + 1 experts for the down
 *   projection): codes [m][n][cols*bits/8 B], scales [m][n][cols/group] u16, biases likewise; the
 *   host guarantees 16-byte rows of scales (cols/group a multiple of 8).
 */
#define PS_GEMV 0
#define PS_GDN 1
#define PS_MOE_GU 2
#define PS_MOE_DOWN 3

#define PX_PLAIN 0
#define PX_RMS 1
#define PX_GATED 2

#define PS_LL_OUT 1 /* y is written as LL words */
#define PS_LL_IN 2  /* the input is the previous phase's LL words: polled, no counter wait */

#define PS_OTAG_WORD 20 /* PsPhase's otag in u32 words (pstep.rs asserts the offset) */

#define PS_FIRST 1
#define PS_LAST 2
#define PS_END 4

#define PS_WARPS 16
#define PS_GDN_RPW 8 /* state rows per thread: dk <= PS_GDN_RPW * PS_WARPS */
#define PS_THREADS (32 * PS_WARPS)
#define PS_TW 12 /* u32 per (phase, block) of the trace */

struct PsPhase {
    int kind, xf, rows, cols;
    int group, ty, accumulate, conv_c;
    int conv_k, hk, hv, dk;
    int dv, nexp, topk, renorm;
    float eps;
    int bits;   /* 4 or 8 */
    int same_x; /* the input is the previous phase's, unchanged: a block that staged it keeps it */
    int ll;     /* PS_LL_OUT | PS_LL_IN */
    u32 otag;   /* 0 in the table; in sm.cur, the tag of this phase's LL outputs (word PS_OTAG_WORD) */
    u64 w, s, b; /* codes, scales, biases */
    u64 x, y;
    u64 normw;
    u64 aux[6];
};

struct PsHdr {
    int rel, flags, row0, n;
};

/* Shared memory: header ring, mbarriers, routing, reductions, the staged input, the slot ring. */
struct PsShared {
    PsHdr hdr[8];
    u64 full[8], empty[8];
    u64 route;   /* the consumers' top-K is in chosen / wsel (one completion per expert phase) */
    u32 ep;      /* this launch's done-flag value: ctr[2] + 1 */
    u32 cwait;   /* trace: thread 0's wait for full slots in the current phase */
    PsPhase cur; /* the consumers' current phase (read from here, not from global memory) */
    int chosen[64];
    float wsel[64];
    float ls[1024];
    float red[2 * PS_WARPS * 32];
    float hs[256];
    float qs[256], ks[256];
};

/* src/cuda/model/pstep.rs writes the table in this layout (it asserts the same size). */
static_assert(sizeof(PsPhase) == 184, "PsPhase changed: update struct PsPhase in pstep.rs");
/* src/cuda/model/pstep.rs sizes the dynamic shared memory with this (SHARED_FIXED). */
static_assert((sizeof(PsShared) + 127) / 128 * 128 == 12288, "PsShared changed: update SHARED_FIXED in pstep.rs");

__device__ __forceinline__ void ps_cbar() { asm volatile("bar.sync 1, %0;" ::"n"(PS_THREADS) : "memory"); }


__device__ __forceinline__ u64 ps_load_relaxed(const u64* p) {
    u64 v;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
/* Nanoseconds (low 32 bits of the global timer), for LILY_PSTEP_TRACE. */
__device__ __forceinline__ u32 ps_now() {
    u64 t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return (u32)t;
}
/* Measurement switches (dbg, LILY_PSTEP_DEBUG) of the synchronization, for A/Bs on the GPU. */
#define PS_DBG_FIXED 1   /* every token routed to experts 0..K-1 (wrong outputs) */
#define PS_DBG_FENCES 2  /* a phase's end as before session 38: threadfence, red.release, st.release */
#define PS_DBG_LDACQ 4   /* a wait ends with an ld.acquire of what it polled, not an acquire fence */
#define PS_DBG_SPIN 8    /* polls without __nanosleep */

/* After relaxed polls saw what a wait needs: an acquire fence, or (PS_DBG_LDACQ) one acquire load
   of the polled word (the blocks' adds form a release sequence, so it synchronizes with them all,
   and it costs no wait for this thread's own outstanding stores). */
__device__ __forceinline__ void ps_acquire(const void* p, int dbg) {
    if (dbg & PS_DBG_LDACQ) {
        u32 v;
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    } else {
        asm volatile("fence.acq_rel.gpu;" ::: "memory");
    }
}
/* LL words (NCCL's "low latency" protocol): a float and its writer's tag in one 8-byte word,
   written and read whole (single-copy atomic), so a reader polls the data itself: no fence behind
   the writes, no counter between. Tag of phase rel of launch ep: ep << 10 | rel (never 0; the
   host keeps a launch under 1024 phases; a word is only ever compared against the tag of its
   next write, so the wrap after 2^22 launches is harmless). */
__device__ __forceinline__ u32 ps_tag(u32 ep, int rel) { return ep << 10 | (u32)rel; }
/* ll_store / ll_load8: common.cuh. */
/* The n floats of the LL words p[0..n) into ls once each carries `tag`, one word per consumer
   thread at a time; visible to the consumers after their next barrier. */
__device__ void ps_ll_block(const u64* p, int n, u32 tag, float* ls) {
    for (int i = threadIdx.x; i < n; i += PS_THREADS) {
        u64 w;
        for (;;) {
            asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(w) : "l"(p + i) : "memory");
            if ((u32)(w >> 32) == tag) break;
            __nanosleep(32);
        }
        ls[i] = __uint_as_float((u32)w);
    }
}

/* Thread 0 spins (relaxed loads) until *ctr >= target, then one acquire fence: the blocks'
   release adds happen-before what follows; the caller's block barrier passes that on. (Acquire
   loads in the loop would invalidate the SM's L1 on every poll.) */
__device__ __forceinline__ void ps_wait_ctr(const u64* ctr, u64 target, int dbg) {
    if (threadIdx.x == 0) {
        while (ps_load_relaxed(ctr) < target)
            if (!(dbg & PS_DBG_SPIN)) __nanosleep(32);
        ps_acquire(ctr, dbg);
    }
}

/* Rows of phase p for block b of nb: [lo, hi) of `total`. */
__device__ __forceinline__ void ps_share(int total, int b, int nb, int& lo, int& hi) {
    lo = (int)((long long)total * b / nb);
    hi = (int)((long long)total * (b + 1) / nb);
}

/* ---- consumers: staging of the phase input into xs (swizzled, with per-32 chunk sums) ---- */

/* rsqrt(mean(x^2) + eps) from every consumer thread's part ss of sum(x^2); all of them call it. */
__device__ __forceinline__ float ps_rms(float ss, int n, float eps, float* red) {
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
    ps_cbar();
    float t = 0.f;
    for (int w = 0; w < PS_WARPS; w++) t += red[w];
    ps_cbar(); /* red is reused */
    return 1.f / sqrtf(t / (float)n + eps);
}

/* The int8 staging (gemv_i8.cu's layout over n / 32 chunks, for 4-bit phases in the LILY_GEMV_I8
   build) of xw = x * normw (or x) by the consumer threads t0 .. t0 + nt - 1 (whole warps); returns
   this thread's part of sum(x^2). */
__device__ __forceinline__ float ps_stage_x_i8(const float* x, const float* normw, int n, float* xs, int t0, int nt) {
    return i8_stage<false>(n / 32, xs, t0, nt, [&](int c, int w, float (&v)[8]) {
        const float4* x4 = (const float4*)(x + 32 * c + 8 * w);
        float4 a = __ldcg(x4), b = __ldcg(x4 + 1);
        float r[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w}, q = 0.f;
#pragma unroll
        for (int j = 0; j < 8; j++) q += r[j] * r[j];
        if (normw) {
            const float4* n4 = (const float4*)(normw + 32 * c + 8 * w);
            float4 na = __ldg(n4), nb = __ldg(n4 + 1);
            float nw[8] = {na.x, na.y, na.z, na.w, nb.x, nb.y, nb.z, nb.w};
#pragma unroll
            for (int j = 0; j < 8; j++) r[j] *= nw[j];
        }
#pragma unroll
        for (int j = 0; j < 8; j++) v[j] = r[j];
        return q;
    });
}

/* PX_PLAIN / PX_RMS (n = cols), as floats or (i8) as int8 parts. Returns rr. */
__device__ float ps_stage_x(const float* x, const float* normw, int n, float eps, float* xs, float* xsum,
                            float* red, bool i8) {
    int tid = threadIdx.x, nch = i8 ? 0 : n / 32;
    float ss = i8 ? ps_stage_x_i8(x, normw, n, xs, tid, PS_THREADS) : 0.f;
    for (int ch = tid; ch < nch; ch += PS_THREADS) {
        const float4* x4 = (const float4*)(x + ch * 32);
        float4 v[8];
#pragma unroll
        for (int j = 0; j < 8; j++) v[j] = __ldcg(x4 + j);
        float sum[2] = {0.f, 0.f};
#pragma unroll
        for (int j = 0; j < 8; j++) {
            float4 a = v[j];
            ss += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
            if (normw) {
                float4 nw = __ldg((const float4*)(normw + ch * 32) + j);
                a = make_float4(a.x * nw.x, a.y * nw.y, a.z * nw.z, a.w * nw.w);
            }
            ((float4*)xs)[xswz(ch * 8 + j)] = a;
            sum[j >> 2] += (a.x + a.y) + (a.z + a.w);
        }
        xsum[2 * ch] = sum[0];
        xsum[2 * ch + 1] = sum[1];
    }
    if (!normw) {
        ps_cbar();
        return 1.f;
    }
    return ps_rms(ss, n, eps, red);
}

/* PX_GATED: o [hv*dv] normalized per head, times normw[c % dv] and silu(z[c]). i8 (the int8
   build; dv / 8 divides 32, which the host checks): one L2 round, not two: staging item (chunk c,
   word w) = 8 values is lane it % 32's, so a head's dv / 8 items sit in adjacent lanes of one
   warp, which add their o^2 by shuffles before quantizing; no block barrier in between. */
__device__ void ps_stage_gated(const float* o, const float* z, const float* normw, int hv, int dv, float eps,
                               float* xs, float* xsum, float* hs, bool i8) {
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (i8) {
        int items = hv * dv / 8, lph = dv / 8;
        for (int it = tid; it - lane < items; it += PS_THREADS) { /* warp-uniform trips */
            bool act = it < items;
            int c = it >> 2, w = it & 3, c0 = 32 * c + 8 * w;
            float p[8], ss = 0.f; /* o * normw * silu(z), the head's norm applied after the sum */
            if (act) {
                const float4 *o4 = (const float4*)(o + c0), *z4 = (const float4*)(z + c0);
                const float4* n4 = (const float4*)(normw + c0 % dv);
                float4 a0 = __ldcg(o4), a1 = __ldcg(o4 + 1), g0 = __ldcg(z4), g1 = __ldcg(z4 + 1);
                float4 n0 = __ldg(n4), n1 = __ldg(n4 + 1);
                float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
                float g[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
                float nw[8] = {n0.x, n0.y, n0.z, n0.w, n1.x, n1.y, n1.z, n1.w};
#pragma unroll
                for (int j = 0; j < 8; j++) p[j] = a[j] * nw[j] * silu_f(g[j]), ss += a[j] * a[j];
            }
            for (int m = 1; m < lph; m <<= 1) ss += __shfl_xor_sync(0xffffffffu, ss, m);
            float r = 1.f / sqrtf(ss / (float)dv + eps), v[8];
#pragma unroll
            for (int j = 0; j < 8; j++) v[j] = act ? p[j] * r : 0.f;
            i8_stage_item(v, act, c, w, hv * dv / 32, xs);
        }
        ps_cbar();
        return;
    }
    for (int h = warp; h < hv; h += PS_WARPS) {
        float ss = 0.f;
        for (int c = lane; c < dv; c += 32) {
            float v = __ldcg(o + h * dv + c);
            ss += v * v;
        }
        ss = warp_sum(ss);
        if (lane == 0) hs[h] = 1.f / sqrtf(ss / (float)dv + eps);
    }
    ps_cbar();
    int nch = hv * dv / 32;
    for (int ch = tid; ch < nch; ch += PS_THREADS) {
        int c0 = ch * 32, h = c0 / dv;
        float r = hs[h], sum[2] = {0.f, 0.f};
#pragma unroll
        for (int j = 0; j < 8; j++) {
            float4 a = __ldcg((const float4*)(o + c0) + j), g = __ldcg((const float4*)(z + c0) + j);
            float4 nw = __ldg((const float4*)(normw + (c0 % dv)) + j);
            a = make_float4(a.x * r * nw.x * silu_f(g.x), a.y * r * nw.y * silu_f(g.y), a.z * r * nw.z * silu_f(g.z),
                            a.w * r * nw.w * silu_f(g.w));
            ((float4*)xs)[xswz(ch * 8 + j)] = a;
            sum[j >> 2] += (a.x + a.y) + (a.z + a.w);
        }
        xsum[2 * ch] = sum[0];
        xsum[2 * ch + 1] = sum[1];
    }
    ps_cbar();
}

/* 8 values of slot k's w_k silu(g_k) u_k from column c0: from floats, or (tag != 0) from LL words
   once the gate/up phase wrote them. */
__device__ __forceinline__ void ps_swiglu8(const float* gu, u32 tag, int k, int inter, int c0, float wt,
                                          float (&v)[8]) {
    if (!tag) {
        swiglu_item8(gu, k, inter, c0, wt, v);
        return;
    }
    float g[8], u[8];
    ll_load8((const u64*)gu + (long long)(2 * k) * inter + c0, tag, g);
    ll_load8((const u64*)gu + (long long)(2 * k + 1) * inter + c0, tag, u);
#pragma unroll
    for (int j = 0; j < 8; j++) v[j] = wt * (silu_f(g[j]) * u[j]);
}

/* MoE down input: slot k's w_k silu(g_k) u_k back to back (gu [S][2][inter], floats or, tag != 0,
   LL words; i8: as int8 parts). */
__device__ void ps_stage_moe(const float* gu, u32 tag, const float* wsel, int S, int inter, float* xs, float* xsum,
                             bool i8) {
    int per = inter / 32, nch = S * per;
    if (i8) {
        i8_stage<false>(nch, xs, threadIdx.x, PS_THREADS, [&](int c, int w, float (&v)[8]) {
            int k = c / per;
            ps_swiglu8(gu, tag, k, inter, (c - k * per) * 32 + 8 * w, wsel[k], v);
            return 0.f;
        });
        ps_cbar();
        return;
    }
    for (int ch = threadIdx.x; ch < nch; ch += PS_THREADS) {
        int k = ch / per, c0 = (ch - k * per) * 32;
        float sum[2] = {0.f, 0.f};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            float v[8];
            ps_swiglu8(gu, tag, k, inter, c0 + 8 * j, wsel[k], v);
            float4 h0 = make_float4(v[0], v[1], v[2], v[3]), h1 = make_float4(v[4], v[5], v[6], v[7]);
            ((float4*)xs)[xswz(ch * 8 + 2 * j)] = h0;
            ((float4*)xs)[xswz(ch * 8 + 2 * j + 1)] = h1;
            sum[j >> 1] += (h0.x + h0.y) + (h0.z + h0.w); /* per 16 columns, as before */
            sum[j >> 1] += (h1.x + h1.y) + (h1.z + h1.w);
        }
        xsum[2 * ch] = sum[0];
        xsum[2 * ch + 1] = sum[1];
    }
    ps_cbar();
}

/* Rows ra and ra + 16 (when two) of the chunk against the staged input: nm matrices' slices in
   the slot (n rows each; n4 16-byte chunks of EPV = 128 / BITS codes per matrix row; chunk i of the
   virtual row is matrix i / n4's chunk i % n4). Each lane's x values are read from shared memory
   once for both rows (shared-memory bandwidth, not HBM, bounds one row per pass). xsum holds the
   staged input's sums per 16 columns. 4-bit codes in the LILY_GEMV_I8 build: xs holds the input
   as int8 parts over the nv chunks (gemv_i8.cu), each chunk's 6 words read once for both rows. */
template <int BITS, int TY>
__device__ __forceinline__ void ps_rows_dot(const unsigned char* slot, int n, int nm, int ra, bool two, int n4, int ng,
                                            int gsh, const float* xs, const float* xsum, float& oa, float& ob) {
    constexpr int EPV = 128 / BITS;
    const uint4* codes = (const uint4*)slot;
    const u16* sc = (const u16*)(slot + (long long)nm * n * n4 * 16);
    const u16* bi = sc + (long long)nm * n * ng;
    const float4* s4 = (const float4*)xs;
    int lane = threadIdx.x & 31, nv = nm * n4, rb = two ? ra + 16 : ra;
    float acca = 0.f, accb = 0.f;
    for (int i = lane; i < nv; i += 32) {
        int k = nm == 1 ? 0 : i / n4, ii = i - k * n4;
        int ma = k * n + ra, mb = k * n + rb, gsub = (ii * EPV) >> gsh;
        uint4 qa = codes[(long long)ma * n4 + ii], qb = codes[(long long)mb * n4 + ii];
        float sa = half_bits(sc[ma * ng + gsub], TY), ba = half_bits(bi[ma * ng + gsub], TY);
        float sb = half_bits(sc[mb * ng + gsub], TY), bb = half_bits(bi[mb * ng + gsub], TY);
        if constexpr (GQ_I8 && BITS == 4) {
            const uint4* xs4 = (const uint4*)xs;
            const float *sxv = xs + 24 * nv, *xsm = sxv + nv;
            int ah = 0, am = 0, al = 0, bh = 0, bm = 0, bl = 0;
            /* the parts in two halves (words 0-1, then 2-3): 12 registers of x, not 24 */
            uint4 H = xs4[i], M = xs4[2 * nv + i], L = xs4[4 * nv + i];
            i8_words2(qa.x, qa.y, H, M, L, ah, am, al);
            i8_words2(qb.x, qb.y, H, M, L, bh, bm, bl);
            H = xs4[nv + i], M = xs4[3 * nv + i], L = xs4[5 * nv + i];
            i8_words2(qa.z, qa.w, H, M, L, ah, am, al);
            i8_words2(qb.z, qb.w, H, M, L, bh, bm, bl);
            float sx = sxv[i] * (1.f / 254.f), sm = xsm[i];
            acca += (sa * sx) * i8_join(ah, am, al) + ba * sm;
            accb += (sb * sx) * i8_join(bh, bm, bl) + bb * sm;
        } else {
            float sx = BITS == 4 ? xsum[2 * i] + xsum[2 * i + 1] : xsum[i];
            u32 wa[4] = {qa.x, qa.y, qa.z, qa.w}, wb[4] = {qb.x, qb.y, qb.z, qb.w};
            float da = 0.f, db = 0.f, ea = 0.f, eb = 0.f;
            if (BITS == 4) { /* as gq_dot, x read per word and shared by the two rows */
#pragma unroll
                for (int w = 0; w < 4; w++) {
                    float4 xa = s4[xswz(i * 8 + 2 * w)], xb = s4[xswz(i * 8 + 2 * w + 1)];
                    gq_word4(wa[w], xa, xb, da, ea);
                    gq_word4(wb[w], xa, xb, db, eb);
                }
                /* s q.x + b sx with q.x = 32 d - 16 sx */
                acca += (32.f * sa) * (da + ea) + (ba - 16.f * sa) * sx;
                accb += (32.f * sb) * (db + eb) + (bb - 16.f * sb) * sx;
            } else {
#pragma unroll
                for (int w = 0; w < 4; w++) {
                    float4 x = s4[xswz(i * 4 + w)];
                    gq_word8(wa[w], x, da, ea);
                    gq_word8(wb[w], x, db, eb);
                }
                acca += sa * (da + ea) + ba * sx;
                accb += sb * (db + eb) + bb * sx;
            }
        }
    }
    oa = warp_sum(acca);
    ob = two ? warp_sum(accb) : 0.f;
}

/* The block whose share of a phase of `total` rows holds row r (ps_share's inverse). */
__device__ __forceinline__ int ps_owner(int r, int total, int nb) {
    return (int)(((long long)(r + 1) * nb + total - 1) / total) - 1;
}

/* Task (h, columns c0..) of the GDN state step waits for the blocks whose shares of the input
   projection (P.rows rows, the previous phase; done flags fprev[block] == ep) hold what it reads:
   the q and k rows of key head kh, its value columns, its b and a rows. Lane j of warp 0 polls
   range j's owners (relaxed loads, then an acquire fence); the block barrier passes it on. */
__device__ void ps_gdn_wait(const PsPhase& P, const u32* fprev, u32 ep, int h, int kh, int c0, int dbg) {
    if (threadIdx.x < 5) {
        int j = threadIdx.x, vd = P.hv * P.dv, r0, n;
        if (j == 0) r0 = kh * P.dk, n = P.dk;
        else if (j == 1) r0 = (P.hk + kh) * P.dk, n = P.dk;
        else if (j == 2) r0 = 2 * P.hk * P.dk + h * P.dv + c0, n = min(32, P.dv - c0);
        else r0 = P.conv_c + vd + (j == 3 ? 0 : P.hv) + h, n = 1;
        int b1 = ps_owner(r0 + n - 1, P.rows, gridDim.x);
        for (int b = ps_owner(r0, P.rows, gridDim.x); b <= b1; b++) {
            u32 v;
            for (;;) {
                asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(fprev + b) : "memory");
                if (v == ep) break;
                if (!(dbg & PS_DBG_SPIN)) __nanosleep(32);
            }
            if (dbg & PS_DBG_LDACQ) ps_acquire(fprev + b, dbg); /* each owner's own release */
        }
        if (!(dbg & PS_DBG_LDACQ)) ps_acquire(fprev, dbg);
    }
    ps_cbar();
}

/* The GDN state step for this block's tasks; each waits only for its own inputs (ps_gdn_wait),
   not for the whole input projection. */
__device__ void ps_gdn(const PsPhase& P, float* red, float* qs, float* ks, const u32* fprev, u32 ep, u32* tstart,
                       int dbg) {
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int hk = P.hk, hv = P.hv, dk = P.dk, dv = P.dv;
    int parts = (dv + 31) / 32, ntask = hv * parts, rpw = dk / PS_WARPS;
    const float* cy = (const float*)P.x;
    const float *braw = (const float*)P.aux[0], *araw = (const float*)P.aux[1];
    const float *dtb = (const float*)P.aux[2], *nega = (const float*)P.aux[3];
    float* S = (float*)P.aux[4];
    float* out = (float*)P.y;
    for (int t = blockIdx.x; t < ntask; t += gridDim.x) {
        int h = t / parts, part = t - h * parts, kh = h / (hv / hk);
        int c = part * 32 + lane, i0 = warp * rpw;
        bool valid = c < dv;
        float* Sp = S + (long long)h * dk * dv + (long long)i0 * dv + c; /* row i0 + j at Sp[j * dv] */
        float sreg[PS_GDN_RPW];
#pragma unroll
        for (int j = 0; j < PS_GDN_RPW; j++)
            if (j < rpw && valid) sreg[j] = __ldcg(Sp + j * dv);
        ps_gdn_wait(P, fprev, ep, h, kh, part * 32, dbg); /* the state (this head's own) is read before */
        if (tstart && tid == 0) *tstart = ps_now(), tstart = 0;
        float sq = 0.f, sk = 0.f, sqk = 0.f;
        for (int i = tid; i < dk; i += PS_THREADS) {
            float q = __ldcg(cy + kh * dk + i), k = __ldcg(cy + hk * dk + kh * dk + i);
            qs[i] = q;
            ks[i] = k;
            sq += q * q;
            sk += k * k;
            sqk += q * k;
        }
        sq = warp_sum(sq);
        sk = warp_sum(sk);
        sqk = warp_sum(sqk);
        if (lane == 0) {
            red[warp] = sq;
            red[PS_WARPS + warp] = sk;
            red[2 * PS_WARPS + warp] = sqk;
        }
        float v = valid ? __ldcg(cy + 2 * hk * dk + h * dv + c) : 0.f;
        float beta = sigmoid_f(__ldcg(braw + h));
        float alpha = expf(__ldg(nega + h) * softplus_f(__ldcg(araw + h) + __ldg(dtb + h)));
        ps_cbar();
        float tq = 0.f, tk = 0.f, tqk = 0.f;
        for (int w = 0; w < PS_WARPS; w++) {
            tq += red[w];
            tk += red[PS_WARPS + w];
            tqk += red[2 * PS_WARPS + w];
        }
        float rq = (1.f / sqrtf((float)dk)) / sqrtf(tq + 1e-6f), rk = 1.f / sqrtf(tk + 1e-6f);
        float uk = 0.f, uq = 0.f;
#pragma unroll
        for (int j = 0; j < PS_GDN_RPW; j++)
            if (j < rpw) {
                uk += sreg[j] * ks[i0 + j];
                uq += sreg[j] * qs[i0 + j];
            }
        ps_cbar(); /* the sums above are read; red is reused */
        red[warp * 32 + lane] = uk * rk;
        red[PS_WARPS * 32 + warp * 32 + lane] = uq * rq;
        ps_cbar();
        float UK = 0.f, UQ = 0.f;
        for (int w = 0; w < PS_WARPS; w++) {
            UK += red[w * 32 + lane];
            UQ += red[PS_WARPS * 32 + w * 32 + lane];
        }
        float delta = beta * (v - alpha * UK);
        if (warp == 0 && valid) out[h * dv + c] = alpha * UQ + delta * (tqk * rq * rk);
        if (valid) {
            float kd = rk * delta;
#pragma unroll
            for (int j = 0; j < PS_GDN_RPW; j++)
                if (j < rpw) Sp[j * dv] = alpha * sreg[j] + ks[i0 + j] * kd;
        }
        ps_cbar(); /* qs, ks, red are reused by the next task */
    }
}
