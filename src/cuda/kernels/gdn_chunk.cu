/*
 * gdn_chunk.cu: the gated delta rule of a prefill in chunks of C = 64 tokens (WY / UT-transform
 * form, docs model-and-kernels.md section 2), the default replacement of gdn_prefill.cu's serial
 * gdn_scan (same inputs, same state and output layouts, fp32 throughout).
 *
 * Math, per value head h (key head kh = h / (H_v/H_k)) and chunk of rows r = 0..63 (token
 * t0 + r; padded rows past T get k = q = v = beta = 0 and g = 0), with g_t = neg_a softplus(a_t +
 * dt_bias) <= 0 (the log of the decay), beta = sigmoid(b), q, k = qn, kn of gdn_qk_prep (L2-normed,
 * q times 1/sqrt(D_k)), S the state at the chunk start [D_k, D_v]:
 *   gamma_r = g_0 + .. + g_r (within-chunk cumsum, non-increasing, so every exponent formed
 *     below, gamma_r - gamma_s with r >= s or gamma_63 - gamma_r, is <= 0; the mask is applied
 *     before exp; e^{-gamma} is never formed);
 *   A_rs = beta_r (k_r.k_s) e^{gamma_r - gamma_s} for r > s, else 0;  Tinv = (I + A)^-1;
 *   W = Tinv diag(beta e^gamma) K,  U = Tinv diag(beta) V  (forward substitution: W_r = x_r -
 *     sum_{s<r} A_rs W_s per column, no explicit Tinv);
 *   M_rs = (q_r.k_s) e^{gamma_r - gamma_s} for r >= s, else 0;
 *   V_new = U - W S;  O = diag(e^gamma) Q S + M V_new;
 *   S' = e^{gamma_63} S + K^T diag(e^{gamma_63 - gamma_r}) V_new.
 *
 * gdn_chunk_prep: everything that does not depend on S, parallel over (chunk, value head).
 *   grid (nch = ceil(T/64), H_v, ceil((D_k + D_v)/256)), block 256. KK^T and QK^T of the chunk by
 *   D_k slices of 32 through shared memory (thread (tx, ty) = (tid%16, tid/16) owns rows
 *   r = tx + 16i, columns s = ty + 16j, i, j < 4, and skips the pairs j > i, where r < s for every
 *   thread); A in shared [64][68]; then thread tid of z-block z takes
 *   column 256z + tid of [K | V] (D_k + D_v columns), holds its 64 rows in registers and runs the
 *   forward substitution (broadcast reads of A). z-block 0 also writes Mt, G and Qt.
 *   Writes the scratch (per value head; Tpad = 64 nch):
 *     Wt [H_v, nch, D_k, 64]  W transposed per chunk (column i of W is 64 contiguous floats);
 *     Qt [H_v, nch, D_k, 64]  (diag(e^gamma) Q) transposed per chunk;
 *     U  [H_v, Tpad, D_v];
 *     Mt [H_v, nch, 64, 64]   M transposed per chunk (Mt[s][r] = M_rs);
 *     G  [H_v, Tpad]          gamma (a padded row repeats the last real row's).
 *   (117 MB for T = 2048 with Qwen3.6's 32 value heads of 128 x 128.)
 *   Shared 37 KB. Requires D_k % 32 == 0, D_k <= 256 (Qt: one column per thread).
 *
 * gdn_chunk_scan: the chunks in order, parallel over (value head, 32-wide D_v slice).
 *   grid (H_v, D_v/32), block 256. The state slice S[:, j0..j0+32] lives in shared memory
 *   (Ss [D_k][32], loaded from and stored back to S [H_v, D_k, D_v]); V_new in Vn [64][32]. Per
 *   chunk a sequence of stages, each one 16 KB tile in `buf` (4096 floats, 4 float4 per thread,
 *   prefetched into registers one stage ahead, across chunk boundaries too):
 *     D_k/32 stages (Wt, Qt slices of 32 rows of D_k):  P = W S, R = diag(e^gamma) Q S;
 *       thread (tr, tc) = (tid/16, tid%16) owns rows 4tr..4tr+3 and columns 2tc, 2tc+1 of both;
 *       then Vn = U - P;
 *     1 stage (Mt): O = R + M Vn for the same rows and columns, stored to o [T, H_v, D_v];
 *       then Vn <- diag(e^{gamma_63 - gamma}) Vn in place;
 *     ceil(D_k/64) stages (kn rows t0..t0+63, 64 columns of D_k each): S' = e^{gamma_63} S + K^T Vn,
 *       thread owns rows 4tr..4tr+3 of the slice and columns 2tc, 2tc+1.
 *   Shared 40 KB. Requires D_k % 32 == 0, D_k <= 128, D_v % 32 == 0; o before the gated norm.
 *
 * H200, Qwen3.6 shape, T = 2048 (one 2048-token prefill chunk of one layer): gdn_chunk_prep about
 * 200 us, gdn_chunk_scan about 340 us (about 10.5 us per chunk: issue-bound at 8 warps per SM,
 * ncu: 0.53 instructions per scheduler-cycle, shared-memory pipe 66% busy), against 1470 us for
 * gdn_scan.
 */
#define GC 64

/* A 16-byte shared-memory load (NVVM splits some float4 dereferences into four loads). */
__device__ __forceinline__ float4 lds4(const float* p) {
    float4 v;
    asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"((u32)__cvta_generic_to_shared(p)));
    return v;
}

/* The chunk's gammas (within-chunk cumsum of g_t = neg_a softplus(a_t + dt_bias); rows past T
   have g = 0, so they repeat the last real row's) and betas (sigmoid(b); 0 past T) into shared
   gam[64], bet[64]: threads < 64 compute, a barrier, thread 0 sums in order as the CPU
   reference does. The caller syncs before reading gam. */
__device__ __forceinline__ void gc_gammas(int tid, int t0, int L, int h, long long ldp, const float* neg_a,
                                          const float* aproj, const float* dt_bias, const float* bproj,
                                          float* gam, float* bet) {
    if (tid < GC) {
        float gg = 0.f, bb = 0.f;
        if (tid < L) {
            long long row = (long long)(t0 + tid) * ldp + h;
            gg = neg_a[h] * softplus_f(aproj[row] + dt_bias[h]);
            bb = sigmoid_f(bproj[row]);
        }
        gam[tid] = gg;
        bet[tid] = bb;
    }
    __syncthreads();
    if (tid == 0) {
        float acc = 0.f;
        for (int r = 0; r < GC; r++) {
            acc += gam[r];
            gam[r] = acc;
        }
    }
}

extern "C" __global__ void __launch_bounds__(256)
    gdn_chunk_prep(GdnChunkPrepParams_fields) {
    __shared__ __align__(16) float Ks[GC][36], Qs[GC][36];
    __shared__ __align__(16) float As[GC][68];
    __shared__ float gam[GC], bet[GC], egam[GC];
    int c = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    int nch = gridDim.x;
    int kh = h / (hv / hk);
    int t0 = c * GC, L = min(GC, T - t0);
    long long tpad = (long long)nch * GC;
    gc_gammas(tid, t0, L, h, ldp, neg_a, aproj, dt_bias, bproj, gam, bet);
    /* KK^T and QK^T: a[i][j] = k_r.k_s, m[i][j] = q_r.k_s for r = tx + 16i, s = ty + 16j, only
       for j <= i (for j > i, r - s <= 15 - 16 < 0: masked for every thread; left at 0) */
    int tx = tid & 15, ty = tid >> 4;
    float a[4][4], m[4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) a[i][j] = m[i][j] = 0.f;
    for (int d0 = 0; d0 < dk; d0 += 32) {
        __syncthreads(); /* the previous slice is consumed (first pass: gam's cumsum is done) */
        for (int e = tid; e < GC * 32; e += 256) {
            int r = e >> 5, d = e & 31;
            bool ok = r < L;
            long long src = ((long long)(t0 + r) * hk + kh) * dk + d0 + d;
            Ks[r][d] = ok ? kn[src] : 0.f;
            Qs[r][d] = ok ? qn[src] : 0.f;
        }
        __syncthreads();
        /* 16-byte loads along d (row pitch 36: the 8 rows of a quarter warp hit distinct banks) */
#pragma unroll 1
        for (int d = 0; d < 32; d += 4) {
            float4 kr[4], qr[4], ks[4];
#pragma unroll
            for (int i = 0; i < 4; i++) {
                kr[i] = lds4(&Ks[tx + 16 * i][d]);
                qr[i] = lds4(&Qs[tx + 16 * i][d]);
                ks[i] = lds4(&Ks[ty + 16 * i][d]);
            }
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j <= i; j++) { /* j > i: r < s for every thread, all masked */
                    a[i][j] += kr[i].x * ks[j].x;
                    a[i][j] += kr[i].y * ks[j].y;
                    a[i][j] += kr[i].z * ks[j].z;
                    a[i][j] += kr[i].w * ks[j].w;
                    m[i][j] += qr[i].x * ks[j].x;
                    m[i][j] += qr[i].y * ks[j].y;
                    m[i][j] += qr[i].z * ks[j].z;
                    m[i][j] += qr[i].w * ks[j].w;
                }
        }
    }
    float* Mc = Mt + ((long long)h * nch + c) * GC * GC;
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int r = tx + 16 * i, s = ty + 16 * j;
            float dec = r >= s ? expf(gam[r] - gam[s]) : 0.f; /* masked before exp: exponent <= 0 */
            As[r][s] = r > s ? bet[r] * a[i][j] * dec : 0.f;
            if (blockIdx.z == 0) Mc[s * GC + r] = r >= s ? m[i][j] * dec : 0.f;
        }
    if (tid < GC) {
        egam[tid] = expf(gam[tid]);
        if (blockIdx.z == 0) G[h * tpad + t0 + tid] = gam[tid];
    }
    __syncthreads();
    /* forward substitution, one column of [K | V] per thread: w_r = x_r - sum_{s<r} A_rs w_s.
       (No loop around this fully unrolled body: ptxas then spills it; blockIdx.z picks the
       256-column group instead.) */
    if (int col = blockIdx.z * 256 + tid; col < dk + dv) {
        bool isk = col < dk;
        /* x_r = beta_r e^{gamma_r} k_r[col] (W) or beta_r v_r[col - D_k] (U) */
        const float* src = isk ? kn + ((long long)t0 * hk + kh) * dk + col
                               : y + (long long)t0 * ldy + 2 * hk * dk + h * dv + (col - dk);
        long long stride = isk ? (long long)hk * dk : ldy;
        float w[GC];
        /* rows past T: beta = 0 makes x = 0; they read row L-1 so the loads need no branch */
#pragma unroll
        for (int r = 0; r < GC; r++) w[r] = bet[r] * (isk ? egam[r] : 1.f) * src[min(r, L - 1) * stride];
#pragma unroll
        for (int r = 1; r < GC; r++) {
            float acc = w[r];
#pragma unroll
            for (int s4 = 0; s4 < (r + 3) / 4; s4++) {
                float4 av = lds4(&As[r][4 * s4]); /* broadcast */
                acc -= av.x * w[4 * s4];
                if (4 * s4 + 1 < r) acc -= av.y * w[4 * s4 + 1];
                if (4 * s4 + 2 < r) acc -= av.z * w[4 * s4 + 2];
                if (4 * s4 + 3 < r) acc -= av.w * w[4 * s4 + 3];
            }
            w[r] = acc;
        }
        if (isk) {
            float4* dst = (float4*)(Wt + (((long long)h * nch + c) * dk + col) * GC);
#pragma unroll
            for (int r4 = 0; r4 < GC / 4; r4++)
                dst[r4] = make_float4(w[4 * r4], w[4 * r4 + 1], w[4 * r4 + 2], w[4 * r4 + 3]);
        } else {
            float* dst = U + (h * tpad + t0) * dv + (col - dk);
#pragma unroll
            for (int r = 0; r < GC; r++) dst[(long long)r * dv] = w[r];
        }
    }
    /* Qt: (e^gamma q) transposed, one column of Q per thread */
    if (int col = tid; blockIdx.z == 0 && col < dk) {
        float4* dst = (float4*)(Qt + (((long long)h * nch + c) * dk + col) * GC);
        const float* src = qn + ((long long)t0 * hk + kh) * dk + col;
        long long stride = (long long)hk * dk;
#pragma unroll
        for (int r4 = 0; r4 < GC / 4; r4++) {
            float v[4];
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int r = 4 * r4 + e;
                v[e] = r < L ? egam[r] * src[r * stride] : 0.f;
            }
            dst[r4] = make_float4(v[0], v[1], v[2], v[3]);
        }
    }
}

extern "C" __global__ void __launch_bounds__(256)
    gdn_chunk_scan(GdnChunkScanParams_fields) {
    __shared__ __align__(16) float buf[4096];
    __shared__ __align__(16) float Ss[128 * 32];
    __shared__ __align__(16) float Vn[GC * 32];
    int h = blockIdx.x, j0 = blockIdx.y * 32, tid = threadIdx.x;
    int kh = h / (hv / hk);
    int nch = (T + GC - 1) / GC;
    long long tpad = (long long)nch * GC;
    int tr = tid >> 4, tc = tid & 15;
    int ns1 = dk / 32, ns3 = (dk + 63) / 64;
    float* Sh = S + (long long)h * dk * dv + j0;
    for (int e = tid; e < dk * 32; e += 256) Ss[e] = Sh[(long long)(e >> 5) * dv + (e & 31)];
    float4 pre[4];
    /* stage st of chunk c into pre: st < ns1 the Wt, Qt slices st; ns1 Mt; then kn slices */
    auto fetch = [&](int c, int st) {
        const float4 z4 = make_float4(0.f, 0.f, 0.f, 0.f);
        long long hc = (long long)h * nch + c;
#pragma unroll
        for (int mm = 0; mm < 4; mm++) {
            int f = tid + 256 * mm; /* float4 index in the 4096-float tile */
            if (st < ns1) {
                const float* src = f < 512 ? Wt + (hc * dk + st * 32) * GC + 4 * f
                                           : Qt + (hc * dk + st * 32) * GC + 4 * (f - 512);
                pre[mm] = *(const float4*)src;
            } else if (st == ns1) {
                pre[mm] = *(const float4*)(Mt + hc * GC * GC + 4 * f);
            } else {
                int r = f >> 4, i = 64 * (st - ns1 - 1) + 4 * (f & 15);
                long long t = (long long)c * GC + r;
                pre[mm] = t < T && i < dk ? *(const float4*)(kn + (t * hk + kh) * dk + i) : z4;
            }
        }
    };
    auto store = [&]() {
#pragma unroll
        for (int mm = 0; mm < 4; mm++) *(float4*)&buf[4 * (tid + 256 * mm)] = pre[mm];
    };
    fetch(0, 0);
    for (int c = 0; c < nch; c++) {
        int t0 = c * GC;
        const float* Gc = G + h * tpad + t0;
        float gC = Gc[GC - 1];
        float eC = expf(gC);
        float dec[4];
        float2 u[4];
#pragma unroll
        for (int a = 0; a < 4; a++) {
            dec[a] = expf(gC - Gc[4 * tr + a]); /* <= 0 exponent */
            u[a] = *(const float2*)(U + (h * tpad + t0 + 4 * tr + a) * dv + j0 + 2 * tc);
        }
        float p[4][2], q[4][2];
#pragma unroll
        for (int a = 0; a < 4; a++) p[a][0] = p[a][1] = q[a][0] = q[a][1] = 0.f;
        /* phase 1: P = W S, R = diag(e^gamma) Q S */
        for (int st = 0; st < ns1; st++) {
            __syncthreads(); /* buf, Ss and Vn are free (previous stage / chunk done) */
            store();
            __syncthreads();
            fetch(c, st + 1);
            const float* Ssl = Ss + st * 32 * 32;
#pragma unroll 8
            for (int ii = 0; ii < 32; ii++) {
                float4 w4 = *(const float4*)&buf[ii * GC + 4 * tr];
                float4 q4 = *(const float4*)&buf[2048 + ii * GC + 4 * tr];
                float2 s2 = *(const float2*)&Ssl[ii * 32 + 2 * tc];
                float wv[4] = {w4.x, w4.y, w4.z, w4.w}, qv[4] = {q4.x, q4.y, q4.z, q4.w};
#pragma unroll
                for (int a = 0; a < 4; a++) {
                    p[a][0] += wv[a] * s2.x;
                    p[a][1] += wv[a] * s2.y;
                    q[a][0] += qv[a] * s2.x;
                    q[a][1] += qv[a] * s2.y;
                }
            }
        }
#pragma unroll
        for (int a = 0; a < 4; a++)
            *(float2*)&Vn[(4 * tr + a) * 32 + 2 * tc] = make_float2(u[a].x - p[a][0], u[a].y - p[a][1]);
        /* phase 2: O = R + M V_new (M_rs = 0 for s > r, so s runs to this thread's last row) */
        __syncthreads();
        store();
        __syncthreads();
        fetch(c, ns1 + 1);
        for (int s = 0; s < 4 * tr + 4; s++) {
            float4 m4 = *(const float4*)&buf[s * GC + 4 * tr];
            float2 v2 = *(const float2*)&Vn[s * 32 + 2 * tc];
            float mv[4] = {m4.x, m4.y, m4.z, m4.w};
#pragma unroll
            for (int a = 0; a < 4; a++) {
                q[a][0] += mv[a] * v2.x;
                q[a][1] += mv[a] * v2.y;
            }
        }
#pragma unroll
        for (int a = 0; a < 4; a++) {
            int t = t0 + 4 * tr + a;
            if (t < T) *(float2*)(o + ((long long)t * hv + h) * dv + j0 + 2 * tc) = make_float2(q[a][0], q[a][1]);
        }
        /* phase 3: S' = e^{gamma_63} S + K^T diag(e^{gamma_63 - gamma}) V_new */
        for (int s3 = 0; s3 < ns3; s3++) {
            __syncthreads(); /* buf (M or the last K slice) and Vn (phase 2) are consumed */
            if (s3 == 0) {
#pragma unroll
                for (int a = 0; a < 4; a++) {
                    float2* v = (float2*)&Vn[(4 * tr + a) * 32 + 2 * tc];
                    float2 x = *v;
                    *v = make_float2(x.x * dec[a], x.y * dec[a]);
                }
            }
            store();
            __syncthreads();
            if (s3 + 1 < ns3)
                fetch(c, ns1 + 2 + s3);
            else if (c + 1 < nch)
                fetch(c + 1, 0);
            int i = 64 * s3 + 4 * tr;
            if (i < dk) {
                float acc[4][2];
#pragma unroll
                for (int a = 0; a < 4; a++) acc[a][0] = acc[a][1] = 0.f;
#pragma unroll 8
                for (int r = 0; r < GC; r++) {
                    float4 k4 = *(const float4*)&buf[r * GC + 4 * tr];
                    float2 v2 = *(const float2*)&Vn[r * 32 + 2 * tc];
                    float kv[4] = {k4.x, k4.y, k4.z, k4.w};
#pragma unroll
                    for (int a = 0; a < 4; a++) {
                        acc[a][0] += kv[a] * v2.x;
                        acc[a][1] += kv[a] * v2.y;
                    }
                }
#pragma unroll
                for (int a = 0; a < 4; a++) {
                    float2* sp = (float2*)&Ss[(i + a) * 32 + 2 * tc];
                    float2 sv = *sp;
                    *sp = make_float2(eC * sv.x + acc[a][0], eC * sv.y + acc[a][1]);
                }
            }
        }
    }
    __syncthreads();
    for (int e = tid; e < dk * 32; e += 256) Sh[(long long)(e >> 5) * dv + (e & 31)] = Ss[e];
}
