/*
 * gdn_fused_cl.cu: gdn_in_step_cl (LILY_CUDA_GDN=cl; built without a GPU in session 33, not yet
 * measured): a GDN layer's input projection + causal conv (gemv_q2_conv) and its state step
 * (gdn_step_par_e) in one launch, each key head's work on one cluster of 8 blocks, so the
 * projection's outputs reach the state step through distributed shared memory instead of a
 * kernel boundary (one launch fewer per GDN layer).
 *
 * Math (as gemv_q2_conv then gdn_step): p = rr * W xw (xw = x * normw, rr = 1 / sqrt(mean(x^2) +
 *   eps)) over the rows [q | k | v | z | b | a] of the fused projection; the q, k, v rows (c < C)
 *   through the causal conv of K taps + SiLU with the carried conv state; then per value head h
 *   (key head h / 2): q, k l2-normalized (q also by 1/sqrt(D_k)), beta = sigmoid(b[h]), alpha =
 *   exp(neg_a[h] softplus(a[h] + dt_bias[h])), S <- alpha S, u = S^T k, delta = beta (v - u),
 *   S <- S + k delta^T, o = S^T q, out = o rsqrt(mean(o^2) + eps2) gnorm silu(z).
 *
 * Layouts: the projection's rows as gemv_q2_conv's (q: kh*D_k.., k: H_k*D_k + kh*D_k.., v: 2H_k*D_k
 *   + h*D_v.., z: C + h*D_v.., b: C + H_v*D_v + h, a: that + H_v); state [H_v, D_k, D_v] key-major
 *   (gdn_step's); out [H_v * D_v].
 *
 * Geometry (Qwen3.6's shape only, the host checks: D_k = D_v = 128, two value heads per key
 *   head): grid 8 H_k blocks of 512 threads, clusters of 8 along x, cluster kh = key head kh.
 *   The cluster's 772 rows (q 128, k 128, v 256, z 256, b 2, a 2; every segment even, so a row
 *   pair never straddles two) go in pairs to the cluster's 128 warps (pair g to warp g mod 128,
 *   cluster warp = warp * 8 + rank), read in trips like gemv_q2 (the third and fourth requested
 *   into the L2 with the first two); each finished row (after its conv) is stored into all 8
 *   blocks' `pv` (st.shared::cluster), one cluster barrier. Then block rank c takes value head
 *   2 kh + c / 4, columns 32 (c % 4) .. + 31: warp w rows 8w .. 8w + 7 of those columns (the
 *   state slice, 16 KB, requested into the L2 at the start, loaded after the barrier); u and o
 *   summed over the 16 warps through shared memory; the gated norm's sum of squares over the
 *   head's 4 blocks through a second cluster exchange and barrier (ranks added in order: the same
 *   value in each).
 *   Shared: the GEMV's staging (cols + cols/EPV floats, dynamic), pv[772], part[16][32], ssq[4],
 *   ov[256].
 *
 * With wo (LILY_CUDA_GDN=clo) also the output projection x += W_o out (W_o [Hr, H_v D_v], 4- or
 *   8-bit, the projection's scale type, groups dividing 256), split-K over the clusters: see
 *   gcl_out_part and the tail of gcl_body; gpart [H_k, Hr] parts, octr 8 u64 counters.
 */
#define GCL_ROWS 772

/* The cluster's row pair g (local rows 2g, 2g + 1) -> the projection's first global row. */
__device__ __forceinline__ int gcl_row(int l, int kh, int hk, int hv) {
    const int dk = 128, dv = 128, C = 2 * hk * dk + hv * dv;
    if (l < 128) return kh * dk + l;                           /* q */
    if (l < 256) return hk * dk + kh * dk + (l - 128);         /* k */
    if (l < 512) return 2 * hk * dk + 2 * kh * dv + (l - 256); /* v of heads 2kh, 2kh + 1 */
    if (l < 768) return C + 2 * kh * dv + (l - 512);           /* z */
    if (l < 770) return C + hv * dv + 2 * kh + (l - 768);      /* b */
    return C + hv * dv + hv + 2 * kh + (l - 770);              /* a */
}

/* The output projection's split-K part (wo set: LILY_CUDA_GDN=clo): block `rank` of cluster kh
   computes rows [rank * RB, + RB) (RB = Hr / 8) of W_o[:, 256 kh .. + 256] . ov (ov: the
   cluster's two heads' 256 outputs, in shared memory) into gpart[kh][row]: a row's 256 / EPV
   chunks over as many lanes (one 128-bit load each), RPS rows a warp at a time, every pass's loads
   issued before any is used (the block's slice was requested into the L2 at the start). */
template <int BO, int TY>
__device__ __forceinline__ void gcl_out_part(const u32* wo, const u16* so, const u16* bo, int group_o, int ocols,
                                             int Hr, const float* ov, float* gpart, int kh, int rank) {
    constexpr int EPV = 128 / BO, NCH = 256 / EPV, RPS = 32 / NCH, NP = 4;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int RB = Hr / 8, n4f = ocols / EPV, ng = ocols / group_o, sr = lane / NCH, ci = lane % NCH;
    const int gi = (kh * 256 + ci * EPV) / group_o; /* this lane's scale group within a row */
    for (int r0 = warp * RPS; r0 < RB; r0 += NP * nw * RPS) {
        uint4 q[NP];
        u32 s[NP], b[NP];
#pragma unroll
        for (int p = 0; p < NP; p++) {
            int r = r0 + p * nw * RPS + sr;
            if (r < RB) {
                long long R = (long long)rank * RB + r;
                q[p] = ldg_stream((const uint4*)wo + R * n4f + kh * NCH + ci);
                s[p] = ldg_u16_stream(so + R * ng + gi);
                b[p] = ldg_u16_stream(bo + R * ng + gi);
            }
        }
#pragma unroll
        for (int p = 0; p < NP; p++) {
            int r = r0 + p * nw * RPS + sr;
            u32 words[4] = {q[p].x, q[p].y, q[p].z, q[p].w};
            float d = 0.f, sx = 0.f;
#pragma unroll
            for (int w = 0; w < 4; w++)
#pragma unroll
                for (int k = 0; k < 32 / BO; k++) {
                    float xv = ov[ci * EPV + w * (32 / BO) + k];
                    d += (float)((words[w] >> (BO * k)) & ((1u << BO) - 1)) * xv;
                    sx += xv;
                }
            float a = r < RB ? half_bits(s[p], TY) * d + half_bits(b[p], TY) * sx : 0.f;
            for (int o = NCH / 2; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
            if (ci == 0 && r < RB) gpart[(long long)kh * Hr + (long long)rank * RB + r] = a;
        }
    }
}

/* The block's slice of W_o into the L2 (before the wait: weights), as gcl_out_part reads it. */
template <int BO>
__device__ __forceinline__ void gcl_out_prefetch(const u32* wo, const u16* so, const u16* bo, int group_o, int ocols,
                                                 int Hr, int kh, int rank) {
    constexpr int EPV = 128 / BO, NCH = 256 / EPV, RPS = 32 / NCH;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    const int RB = Hr / 8, n4f = ocols / EPV, ng = ocols / group_o, sr = lane / NCH, ci = lane % NCH;
    const int gi = (kh * 256 + ci * EPV) / group_o;
    for (int r = warp * RPS + sr; r < RB; r += nw * RPS) {
        long long R = (long long)rank * RB + r;
        pf_l2((const uint4*)wo + R * n4f + kh * NCH + ci);
        if (ci * EPV % group_o == 0) {
            pf_l2(so + R * ng + gi);
            pf_l2(bo + R * ng + gi);
        }
    }
}

template <int BITS, int TY>
__device__ __forceinline__ void gcl_body(GdnInStepParams_fields, float* xs, float* red, float* pv, float* part,
                                         float* ssq, float* ov, int* last) {
    constexpr int EPV = 128 / BITS, NR = 2, U = 2, CS = 8, dk = 128, dv = 128;
    const int rank = (int)cl_rank(), kh = blockIdx.x / CS;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const u32* W = (const u32*)w;
    const u16 *Sc = (const u16*)sc, *Bi = (const u16*)bi;
    const int n4 = cols / EPV, ng = cols / group, gsh = __ffs(group) - 1;
    const int tpr = (n4 + 32 * U - 1) / (32 * U), ngroups = GCL_ROWS / NR, gstride = CS * nwarps;
    const int h = 2 * kh + rank / 4, j = 32 * (rank % 4) + lane; /* the state step's head, column */
    float* Sh = S + (long long)h * dk * dv;
    cl_arrive_relaxed(); /* this block runs */
    /* the state slice into the L2 (this kernel's alone: before the wait), and the output
       projection's slice (weights) */
    if (threadIdx.x < dk) pf_l2(Sh + (long long)threadIdx.x * dv + 32 * (rank % 4));
    if (wo && bits_o == 4) gcl_out_prefetch<4>((const u32*)wo, (const u16*)so, (const u16*)bo, group_o, hv * dv, Hr, kh, rank);
    if (wo && bits_o == 8) gcl_out_prefetch<8>((const u32*)wo, (const u16*)so, (const u16*)bo, group_o, hv * dv, Hr, kh, rank);
    int g = warp * CS + rank, t = 0;
    auto load = [&](GqTrip<NR, U>& tr, int gg, int tt) {
        long long R = gcl_row(2 * gg, kh, hk, hv);
        int i0 = tt * 32 * U + lane;
        if ((tt + 1) * 32 * U <= n4)
            gq_load<BITS, NR, U, true>(tr, W, Sc, Bi, R, NR, n4, ng, gsh, i0);
        else
            gq_load<BITS, NR, U, false>(tr, W, Sc, Bi, R, NR, n4, ng, gsh, i0);
    };
    /* conv taps: lanes K r + jt hold tap jt of row r of the pair (gemv_q2_conv's epilogue); a
       pair's tap weight and past input are loaded with its first trip (the conv state is this
       kernel's alone within a step) */
    const int cr = lane / K, cj = lane - cr * K;
    float cw_cur = 0.f, cs_cur = 0.f, cw_nxt = 0.f, cs_nxt = 0.f;
    auto conv_load = [&](int gg, float& cwv, float& csv) {
        int row = gcl_row(2 * gg, kh, hk, hv) + cr;
        if (cr < NR && row < C) {
            cwv = cw[(long long)row * K + cj];
            csv = cj < K - 1 ? cstate[(long long)cj * C + row] : 0.f;
        }
    };
    GqTrip<NR, U> cur, nxt;
    int g1 = tpr == 1 ? g + gstride : g, t1 = tpr == 1 ? 0 : 1;
    if (g < ngroups) {
        load(cur, g, 0);
        conv_load(g, cw_cur, cs_cur);
    }
    if (g < ngroups && g1 < ngroups) {
        load(nxt, g1, t1);
        if (t1 == 0) conv_load(g1, cw_nxt, cs_nxt);
    }
    for (int m = 2; m < 4; m++) { /* trips 2 and 3 into the L2 */
        int n = m / tpr, tt = m - n * tpr, gg = g + n * gstride;
        if (gg >= ngroups) break;
        gq_prefetch<BITS, NR, U>(W, Sc, Bi, gcl_row(2 * gg, kh, hk, hv), NR, n4, ng, gsh, tt * 32 * U + lane);
    }
    pdl_wait();
    float* xsum = xs + cols;
    const float rr = gq_stage<EPV>(x, cols, normw, eps, xs, xsum, red);
    cl_wait(); /* every block of the cluster runs: its pv may be written */
    float acc[NR] = {0.f, 0.f};
    bool first = true;
    while (g < ngroups) {
        int g2 = g, t2 = t + 1;
        if (t2 == tpr) {
            g2 = g + gstride;
            t2 = 0;
        }
        if (g2 < ngroups && !first) {
            load(nxt, g2, t2);
            if (t2 == 0) conv_load(g2, cw_nxt, cs_nxt);
        }
        first = false;
        int i0 = t * 32 * U + lane;
        if ((t + 1) * 32 * U <= n4)
            gq_compute<BITS, TY, NR, U, false, true>(cur, NR, n4, i0, xs, xsum, acc);
        else
            gq_compute<BITS, TY, NR, U, false, false>(cur, NR, n4, i0, xs, xsum, acc);
        if (t + 1 == tpr) {
            const int row0 = gcl_row(2 * g, kh, hk, hv);
            float mine = 0.f, val[NR];
#pragma unroll
            for (int r = 0; r < NR; r++) {
                val[r] = warp_sum(acc[r]) * rr;
                acc[r] = 0.f;
                if (r == cr) mine = val[r];
            }
            if (row0 < C) { /* q, k, v rows: X = [state; p], y = silu(sum_j w_j X_j), state <- X[1..K) */
                int row = row0 + cr;
                bool act = cr < NR;
                float xin = cj == K - 1 ? mine : cs_cur;
                float v = act ? cw_cur * xin : 0.f;
                for (int o = 1; o < K; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
                float nx = __shfl_down_sync(0xffffffffu, xin, 1);
                if (act && cj < K - 1) cstate[(long long)cj * C + row] = nx;
#pragma unroll
                for (int r = 0; r < NR; r++) val[r] = silu_f(__shfl_sync(0xffffffffu, v, r * K));
            }
#pragma unroll
            for (int r = 0; r < NR; r++)
                if (lane < CS) cl_store(pv + 2 * g + r, lane, val[r]);
            cw_cur = cw_nxt;
            cs_cur = cs_nxt;
        }
        cur = nxt;
        g = g2;
        t = t2;
    }
    cl_arrive();
    cl_wait(); /* pv holds the cluster's 772 outputs */

    /* the state step: head h, column j, rows 8 warp .. + 7 */
    const int hl = rank / 4; /* the head within the cluster */
    float sq = 0.f, sk = 0.f; /* every warp: the norms of q and k */
#pragma unroll
    for (int i = lane; i < dk; i += 32) {
        float qv = pv[i], kv = pv[128 + i];
        sq += qv * qv;
        sk += kv * kv;
    }
    sq = warp_sum(sq);
    sk = warp_sum(sk);
    const float rq = (1.f / sqrtf((float)dk)) / sqrtf(sq + 1e-6f), rk = 1.f / sqrtf(sk + 1e-6f);
    const float beta = sigmoid_f(pv[768 + hl]);
    const float alpha = expf(neg_a[h] * softplus_f(pv[770 + hl] + dt_bias[h]));
    const float vj = pv[256 + 128 * hl + j], zj = pv[512 + 128 * hl + j];
    float sv[8];
#pragma unroll
    for (int r = 0; r < 8; r++) sv[r] = Sh[(long long)(8 * warp + r) * dv + j];
    float u = 0.f;
#pragma unroll
    for (int r = 0; r < 8; r++) u += (alpha * sv[r]) * (pv[128 + 8 * warp + r] * rk);
    part[warp * 32 + lane] = u;
    __syncthreads();
    u = 0.f;
    for (int p = 0; p < 16; p++) u += part[p * 32 + lane];
    const float delta = beta * (vj - u);
    float o = 0.f;
#pragma unroll
    for (int r = 0; r < 8; r++) {
        int i = 8 * warp + r;
        float s = alpha * sv[r] + (pv[128 + i] * rk) * delta;
        Sh[(long long)i * dv + j] = s;
        o += s * (pv[i] * rq);
    }
    __syncthreads(); /* every thread has read its u partials */
    part[warp * 32 + lane] = o;
    __syncthreads();
    o = 0.f;
    for (int p = 0; p < 16; p++) o += part[p * 32 + lane];
    /* the gated norm's sum of squares: this block's 32 columns, then the head's 4 blocks */
    float ss = warp_sum(o * o);
    if (warp == 0 && lane < 4) cl_store(ssq + rank % 4, 4 * hl + lane, ss);
    cl_arrive();
    cl_wait();
    ss = ((ssq[0] + ssq[1]) + ssq[2]) + ssq[3];
    const float outj = o * (1.f / sqrtf(ss / (float)dv + geps)) * gnorm[j] * silu_f(zj);
    if (warp == 0) out[h * dv + j] = outj;
    if (!wo) return;
    /* LILY_CUDA_GDN=clo: the output projection x += W_o out, split over the key heads: the
       cluster's 256 outputs into every block's ov, this block's rows of its split into gpart,
       and the last of the H_k blocks of each row range (a u64 counter per range, raised by H_k
       every launch) adds the H_k parts into x in key-head order (the same sums whichever block
       is last). Every block of the launch has staged x before any range is added: the last
       arrival of range r implies one block of every cluster past its first cluster barrier. */
    if (warp == 0)
        for (int p = 0; p < CS; p++) cl_store(ov + 128 * hl + j, p, outj);
    cl_arrive();
    cl_wait();
    if (bits_o == 4)
        gcl_out_part<4, TY>((const u32*)wo, (const u16*)so, (const u16*)bo, group_o, hv * dv, Hr, ov, gpart, kh, rank);
    else
        gcl_out_part<8, TY>((const u32*)wo, (const u16*)so, (const u16*)bo, group_o, hv * dv, Hr, ov, gpart, kh, rank);
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        unsigned long long old = atomicAdd(octr + rank, 1ull);
        *last = old % (unsigned long long)hk == (unsigned long long)(hk - 1);
    }
    __syncthreads();
    if (*last) {
        __threadfence();
        const int RB = Hr / 8;
        for (int r = threadIdx.x; r < RB; r += blockDim.x) {
            long long R = (long long)rank * RB + r;
            float a = __ldcg(x + R);
            for (int k = 0; k < hk; k++) a += __ldcg(gpart + (long long)k * Hr + R);
            x[R] = a;
        }
    }
}

extern "C" __global__ void QR_CL_DIMS __launch_bounds__(512, 1) gdn_in_step_cl(GdnInStepParams_fields) {
    extern __shared__ __align__(16) float xs[];
    __shared__ float red[33], pv[GCL_ROWS], part[16 * 32], ssq[4], ov[256];
    __shared__ int last;
    TL_SCOPE("gdn_in_step_cl");
    pdl_trigger();
#define GCL(B, T)                                                                                                     \
    gcl_body<B, T>(w, sc, bi, bits, group, ty, x, cols, normw, eps, cstate, cw, C, K, dt_bias, neg_a, gnorm, geps, S, \
                   out, hk, hv, wo, so, bo, bits_o, group_o, Hr, gpart, octr, xs, red, pv, part, ssq, ov, &last)
    if (bits == 4 && ty == TY_BF16) GCL(4, TY_BF16);
    else if (bits == 4) GCL(4, TY_F16);
    else if (ty == TY_BF16) GCL(8, TY_BF16);
    else GCL(8, TY_F16);
#undef GCL
}
