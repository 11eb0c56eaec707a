/*
 * gdn_chunk_tc.cu: gdn_chunk_scan on tensor cores. The same scan over 64-token chunks, the same
 * inputs (the scratch Wt, Qt, U, Mt, G of gdn_chunk_prep_tc below, which stores Wt, Qt and Mt
 * already rounded to TF32, and the normalized keys kn) and outputs (o before the gated norm, the
 * state S updated in place) as gdn_chunk.cu, with every product an
 * mma.sync m16n8k8 in TF32 (operands rounded to nearest by cvt.rna: 10 mantissa bits) with fp32
 * accumulation. The state itself stays fp32 in registers from the first chunk to the last; only
 * its copy used as a product operand is rounded. Used by the bf16 prefill (Precision::Bf16); the
 * exact mode keeps gdn_chunk_scan.
 *
 * Math per value head h and chunk (gdn_chunk.cu's header has the derivation), S [D_k, 32] the
 * block's slice of the state, C = 64 rows:
 *   1. P = W S and R = diag(e^gamma) Q S              [64 x D_k] x [D_k x 32] each
 *   2. V_new = U - P;  V2 = diag(e^{gamma_63 - gamma}) V_new   (exponents <= 0)
 *   3. O = R + M V_new  (M lower triangular: k runs to the row block's end)   [64 x 64] x [64 x 32]
 *   4. S' = e^{gamma_63} S + K^T V2                   [D_k x 64] x [64 x 32]
 *
 * Launch: grid (H_v, D_v / 32), block 256 (8 warps), one block per SM (dynamic shared memory
 * GDN_TC_SMEM = 167,936 bytes). Warp w, lane = 4 g + q (mma fragment coordinates: A rows g, g+8,
 * columns q, q+4; B rows q, q+4, column g; C rows g, g+8, columns 2q, 2q+1):
 *   step 1: warps 0-3 rows 16w.. of P (A = W from Wt), warps 4-7 rows 16(w-4).. of R (A from Qt);
 *     4 n-tiles of 8 columns each, D_k / 8 k-steps;
 *   step 2: warps 0-3 turn P into V_new and V2 in shared memory;
 *   step 3: warps 4-7 add M V_new to R and store O;
 *   step 4 (at the same time): warps 0-3 hold S (m-tiles w and w + 4 of D_k / 16) as accumulators
 *     and add K^T V2, then copy it (TF32-rounded) to shared memory for the next chunk's step 1.
 * Shared memory (fp32, rows padded so that every fragment load of a warp hits 32 banks):
 *   WQ  Wt [128][72], Qt [128][72]  (this chunk's, loaded during the previous chunk's steps 3-4)
 *   Ms  Mt [64][72], Ks kn rows [64][136]  (loaded during this chunk's steps 1-2)
 *   Ss  [128][40], Vs [64][40], V2s [64][40].
 *   Warps 0-3 fetch the next chunk's gammas and U rows into registers a chunk ahead.
 * Three block barriers per chunk. Requires D_k % 16 == 0, D_k <= 128, D_v % 32 == 0 (the host
 * runs the pair for D_k % 32 == 0, the prep kernel's requirement).
 * H200, Qwen3.6 shape, 4096 tokens: 313 us per layer (668 for gdn_chunk_scan); latency-bound
 * (docs/perf-log.md, session 23).
 */
#define GT_LDW 72
#define GT_LDK 136
#define GT_LDS 40

__device__ __forceinline__ u32 tf32_rna(float x) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}
__device__ __forceinline__ void mma_tf32(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void cp_async_wait0() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }

/* The TF32 bits of an operand: rounded here (RA) or already rounded where it was stored. */
template <bool RA> __device__ __forceinline__ u32 tf32_of(float x) { return RA ? tf32_rna(x) : __float_as_uint(x); }

/* c[nt] += A[m0.., k0..kend) B[k0..kend), 8 nt..) for 4 n-tiles: A stored transposed (At[k][m],
   row pitch lda; rounded here if RA), B already TF32 bits (Bs[k][n], pitch GT_LDS). */
template <bool RA>
__device__ __forceinline__ void gt_mma_rows(float (&c)[4][4], const float* At, int lda, int m0, int kend,
                                            const float* Bs, int g, int q) {
#pragma unroll 4
    for (int k0 = 0; k0 < kend; k0 += 8) {
        const float* a = At + (k0 + q) * lda + m0 + g;
        u32 a0 = tf32_of<RA>(a[0]), a1 = tf32_of<RA>(a[8]), a2 = tf32_of<RA>(a[4 * lda]),
            a3 = tf32_of<RA>(a[4 * lda + 8]);
        const u32* b = (const u32*)Bs + (k0 + q) * GT_LDS + g;
#pragma unroll
        for (int nt = 0; nt < 4; nt++) mma_tf32(c[nt], a0, a1, a2, a3, b[8 * nt], b[4 * GT_LDS + 8 * nt]);
    }
}

extern "C" __global__ void __launch_bounds__(256)
    gdn_chunk_scan_tc(GdnChunkScanParams_fields) {
    extern __shared__ __align__(16) float gt_sm[];
    float* Wts = gt_sm;                     /* [128][72] */
    float* Qts = Wts + 128 * GT_LDW;        /* [128][72] */
    float* Ms = Qts + 128 * GT_LDW;         /* [64][72] */
    float* Ks = Ms + 64 * GT_LDW;           /* [64][136] */
    float* Ss = Ks + 64 * GT_LDK;           /* [128][40] */
    float* Vs = Ss + 128 * GT_LDS;          /* [64][40] */
    float* V2s = Vs + 64 * GT_LDS;          /* [64][40] */
    int h = blockIdx.x, j0 = blockIdx.y * 32, tid = threadIdx.x;
    int w = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    int kh = h / (hv / hk);
    int nch = (T + GC - 1) / GC;
    long long tpad = (long long)nch * GC;
    auto load_wq = [&](int c) {
        const float* wsrc = Wt + ((long long)h * nch + c) * dk * GC;
        const float* qsrc = Qt + ((long long)h * nch + c) * dk * GC;
        int j = 4 * (tid & 15);
        for (int k = tid >> 4; k < dk; k += 16) {
            cp_async16((u32)__cvta_generic_to_shared(Wts + k * GT_LDW + j), wsrc + k * GC + j, 16);
            cp_async16((u32)__cvta_generic_to_shared(Qts + k * GT_LDW + j), qsrc + k * GC + j, 16);
        }
    };
    auto load_mk = [&](int c) {
        const float* msrc = Mt + ((long long)h * nch + c) * GC * GC;
        int j = 4 * (tid & 15);
        for (int s = tid >> 4; s < GC; s += 16)
            cp_async16((u32)__cvta_generic_to_shared(Ms + s * GT_LDW + j), msrc + s * GC + j, 16);
        /* kn rows: warp w takes rows w, w + 8, ..; rows past T are zero-filled (their V2 is zero
           too, but 0 x NaN is not) */
        for (int r = w; r < GC; r += 8) {
            int t = c * GC + r;
            const float* src = kn + ((long long)min(t, T - 1) * hk + kh) * dk;
            for (int j4 = 4 * lane; j4 < dk; j4 += 128)
                cp_async16((u32)__cvta_generic_to_shared(Ks + r * GT_LDK + j4), src + j4, t < T ? 16 : 0);
        }
    };
    /* the state slice: warps 0-3 own m-tiles w and w + 4 (rows 16 mt + g, + 8) */
    float st[2][4][4];
    float* Sh = S + (long long)h * dk * dv + j0;
    if (w < 4) {
#pragma unroll
        for (int mi = 0; mi < 2; mi++) {
            int m0 = 16 * (w + 4 * mi);
#pragma unroll
            for (int nt = 0; nt < 4; nt++) {
                int col = 8 * nt + 2 * q;
                float2 lo = m0 < dk ? *(const float2*)(Sh + (long long)(m0 + g) * dv + col) : make_float2(0.f, 0.f);
                float2 hi = m0 < dk ? *(const float2*)(Sh + (long long)(m0 + g + 8) * dv + col) : make_float2(0.f, 0.f);
                st[mi][nt][0] = lo.x;
                st[mi][nt][1] = lo.y;
                st[mi][nt][2] = hi.x;
                st[mi][nt][3] = hi.y;
                if (m0 < dk) {
                    *(uint2*)(Ss + (m0 + g) * GT_LDS + col) = make_uint2(tf32_rna(lo.x), tf32_rna(lo.y));
                    *(uint2*)(Ss + (m0 + g + 8) * GT_LDS + col) = make_uint2(tf32_rna(hi.x), tf32_rna(hi.y));
                }
            }
        }
    }
    load_wq(0);
    cp_async_commit();
    load_mk(0);
    cp_async_commit();

    int m0 = 16 * (w & 3); /* this warp's 16 rows of the chunk in steps 1-3 */
    /* warps 0-3: chunk c's gamma_63, gamma of their two rows and their U rows, a chunk ahead */
    float gn[3] = {0.f, 0.f, 0.f}, un[4][4] = {};
    auto load_gu = [&](int c) {
        if (w >= 4) return;
        const float* Gc = G + h * tpad + c * GC;
        gn[0] = Gc[GC - 1];
        gn[1] = Gc[m0 + g];
        gn[2] = Gc[m0 + g + 8];
        const float* Ur = U + (h * tpad + c * GC + m0 + g) * dv + j0 + 2 * q;
#pragma unroll
        for (int nt = 0; nt < 4; nt++) {
            float2 lo = *(const float2*)(Ur + 8 * nt), hi = *(const float2*)(Ur + 8 * dv + 8 * nt);
            un[nt][0] = lo.x;
            un[nt][1] = lo.y;
            un[nt][2] = hi.x;
            un[nt][3] = hi.y;
        }
    };
    load_gu(0);
    for (int c = 0; c < nch; c++) {
        int t0 = c * GC;
        /* this chunk's gammas and U rows arrived during the previous chunk; fetch the next's */
        float gC = gn[0], eC = expf(gC);
        float dec0 = expf(gC - gn[1]), dec1 = expf(gC - gn[2]); /* exponents <= 0 */
        float u[4][4];
#pragma unroll
        for (int nt = 0; nt < 4; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) u[nt][e] = un[nt][e];
        if (c + 1 < nch) load_gu(c + 1);
        cp_async_wait1(); /* this chunk's Wt, Qt (its Mt, K may still be in flight) */
        __syncthreads();  /* ... visible to all; Ss of the previous chunk's step 4 too */

        /* step 1: P (warps 0-3) or R (warps 4-7) */
        float acc[4][4];
#pragma unroll
        for (int nt = 0; nt < 4; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
        gt_mma_rows<false>(acc, w < 4 ? Wts : Qts, GT_LDW, m0, dk, Ss, g, q);

        /* step 2: V_new = U - P, V2 = dec V_new (operands of steps 3 and 4: rounded once here) */
        if (w < 4) {
#pragma unroll
            for (int nt = 0; nt < 4; nt++) {
                int col = 8 * nt + 2 * q;
                float v0 = u[nt][0] - acc[nt][0], v1 = u[nt][1] - acc[nt][1];
                float v2 = u[nt][2] - acc[nt][2], v3 = u[nt][3] - acc[nt][3];
                *(uint2*)(Vs + (m0 + g) * GT_LDS + col) = make_uint2(tf32_rna(v0), tf32_rna(v1));
                *(uint2*)(Vs + (m0 + g + 8) * GT_LDS + col) = make_uint2(tf32_rna(v2), tf32_rna(v3));
                *(uint2*)(V2s + (m0 + g) * GT_LDS + col) = make_uint2(tf32_rna(dec0 * v0), tf32_rna(dec0 * v1));
                *(uint2*)(V2s + (m0 + g + 8) * GT_LDS + col) = make_uint2(tf32_rna(dec1 * v2), tf32_rna(dec1 * v3));
            }
        }
        cp_async_wait0(); /* this chunk's Mt and K */
        __syncthreads();  /* Vs, V2s, Ms, Ks visible; Wt, Qt and Ss no longer read */
        if (c + 1 < nch) load_wq(c + 1);
        cp_async_commit();

        if (w >= 4) {
            /* step 3: O = R + M V_new, M_rs = 0 for s > r: k runs to this row block's end */
            gt_mma_rows<false>(acc, Ms, GT_LDW, m0, m0 + 16, Vs, g, q);
#pragma unroll
            for (int half = 0; half < 2; half++) {
                int t = t0 + m0 + g + 8 * half;
                if (t < T) {
                    float* orow = o + ((long long)t * hv + h) * dv + j0 + 2 * q;
#pragma unroll
                    for (int nt = 0; nt < 4; nt++)
                        *(float2*)(orow + 8 * nt) = make_float2(acc[nt][2 * half], acc[nt][2 * half + 1]);
                }
            }
        } else {
            /* step 4: S' = e^{gamma_63} S + K^T V2, then its rounded copy for the next step 1 */
#pragma unroll
            for (int mi = 0; mi < 2; mi++) {
                int s0 = 16 * (w + 4 * mi);
                if (s0 < dk) {
#pragma unroll
                    for (int nt = 0; nt < 4; nt++)
#pragma unroll
                        for (int e = 0; e < 4; e++) st[mi][nt][e] *= eC;
                    gt_mma_rows<true>(st[mi], Ks, GT_LDK, s0, GC, V2s, g, q);
#pragma unroll
                    for (int nt = 0; nt < 4; nt++) {
                        int col = 8 * nt + 2 * q;
                        *(uint2*)(Ss + (s0 + g) * GT_LDS + col) =
                            make_uint2(tf32_rna(st[mi][nt][0]), tf32_rna(st[mi][nt][1]));
                        *(uint2*)(Ss + (s0 + g + 8) * GT_LDS + col) =
                            make_uint2(tf32_rna(st[mi][nt][2]), tf32_rna(st[mi][nt][3]));
                    }
                }
            }
        }
        __syncthreads(); /* Ms, Ks, Vs, V2s consumed */
        if (c + 1 < nch) load_mk(c + 1);
        cp_async_commit();
    }
    if (w < 4) {
#pragma unroll
        for (int mi = 0; mi < 2; mi++) {
            int s0 = 16 * (w + 4 * mi);
            if (s0 < dk) {
#pragma unroll
                for (int nt = 0; nt < 4; nt++) {
                    int col = 8 * nt + 2 * q;
                    *(float2*)(Sh + (long long)(s0 + g) * dv + col) = make_float2(st[mi][nt][0], st[mi][nt][1]);
                    *(float2*)(Sh + (long long)(s0 + g + 8) * dv + col) = make_float2(st[mi][nt][2], st[mi][nt][3]);
                }
            }
        }
    }
}

/*
 * gdn_chunk_prep_tc: gdn_chunk_prep with its products on tensor cores (mma.sync m16n8k8 TF32,
 * fp32 accumulation), same inputs and outputs (Wt, Qt, U, Mt, G; gdn_chunk.cu's header), except
 * that Wt, Qt and Mt, only ever product operands of gdn_chunk_scan_tc, are stored rounded to TF32.
 *   grid (nch, H_v), block 256 (8 warps), dynamic shared memory GDN_PREP_TC_SMEM = 90,880 bytes
 *   (two blocks per SM): Ks, Qs [64][D_k + 4] (the chunk's normalized keys and queries, rows past
 *   T zero), As [64][68] (A), Ts [4][16][20] (the inverses of A's diagonal 16 x 16 blocks), the
 *   gammas and betas.
 *   1. warps 0-3: KK^T row block w (A_rs = beta_r (k_r.k_s) e^{gamma_r - gamma_s}, r > s) into As;
 *      warps 4-7: QK^T row block w - 4 (M_rs, r >= s) straight to Mt; n-tiles right of the
 *      diagonal block are skipped (all masked). Both read the row-major tiles (A rows g, g+8 and B
 *      columns g from rows of the same [64][D_k + 4] array: pitch = 4 mod 32 banks).
 *   2. 64 threads: T_ii = (I + A_ii)^-1 by forward substitution (fp32), i = 0..3.
 *   3. the WY solve [W | U] = (I + A)^-1 X, X = [diag(beta e^gamma) K | diag(beta) V], in row
 *      blocks of 16: Y_i = X_i - sum_{j<i} A_ij Z_j, Z_i = T_ii Y_i. The columns are independent,
 *      so warp w takes 8 columns per pass (64 per pass over D_k + D_v) and keeps its Z [64][8] in
 *      a private part of Qs (free once Qt is written): no block barrier inside the solve. The V
 *      rows of X are prefetched into the L2 at the start (they come from HBM at long prompts).
 * Requires D_k % 32 == 0, D_k <= 128, D_v % 32 == 0.
 */
#define GP_LDA 68
#define GP_LDT 20

extern "C" __global__ void __launch_bounds__(256, 2)
    gdn_chunk_prep_tc(GdnChunkPrepParams_fields) {
    extern __shared__ __align__(16) float gpt_sm[];
    int ldk = dk + 4;
    float* Ks = gpt_sm;             /* [64][D_k + 4] */
    float* Qs = Ks + GC * ldk;     /* [64][D_k + 4], then the warps' Z [64][8] (4096 floats) */
    float* As = Qs + max(GC * ldk, 4096); /* [64][68] */
    float* Ts = As + GC * GP_LDA;  /* [4][16][20] */
    float* gam = Ts + 4 * 16 * GP_LDT;
    float* bet = gam + GC;
    float* egam = bet + GC;
    int c = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    int w = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
    int nch = gridDim.x;
    int kh = h / (hv / hk);
    int t0 = c * GC, L = min(GC, T - t0);
    long long tpad = (long long)nch * GC, hc = (long long)h * nch + c;
    int dk4 = dk >> 2;
    for (int e = tid; e < GC * dk4; e += 256) {
        int r = e / dk4, j = 4 * (e - r * dk4);
        long long src = ((long long)(t0 + min(r, L - 1)) * hk + kh) * dk + j;
        cp_async16((u32)__cvta_generic_to_shared(Ks + r * ldk + j), kn + src, r < L ? 16 : 0);
        cp_async16((u32)__cvta_generic_to_shared(Qs + r * ldk + j), qn + src, r < L ? 16 : 0);
    }
    cp_async_commit();
    /* the chunk's V rows (read by the solve's X, long after) into the L2 now */
    for (int i = tid, lr = dv / 32; i < L * lr; i += 256) {
        int r = i / lr;
        asm volatile("prefetch.global.L2 [%0];" ::"l"(y + (long long)(t0 + r) * ldy + 2 * hk * dk + h * dv + 32 * (i - r * lr)));
    }
    gc_gammas(tid, t0, L, h, ldp, neg_a, aproj, dt_bias, bproj, gam, bet);
    cp_async_wait0();
    __syncthreads();
    if (tid < GC) {
        egam[tid] = expf(gam[tid]);
        G[h * tpad + t0 + tid] = gam[tid];
    }

    /* 1. KK^T (warps 0-3) or QK^T (warps 4-7), row block m0 = 16 (w & 3) */
    {
        int m0 = 16 * (w & 3), ntmax = 2 * (w & 3) + 1; /* n-tiles past the diagonal block: masked */
        const float* Ar = (w < 4 ? Ks : Qs) + (m0 + g) * ldk + q;
        float acc[8][4];
#pragma unroll
        for (int nt = 0; nt < 8; nt++) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll 2
        for (int k0 = 0; k0 < dk; k0 += 8) {
            u32 a0 = tf32_rna(Ar[k0]), a1 = tf32_rna(Ar[8 * ldk + k0]);
            u32 a2 = tf32_rna(Ar[k0 + 4]), a3 = tf32_rna(Ar[8 * ldk + k0 + 4]);
#pragma unroll
            for (int nt = 0; nt < 8; nt++) {
                if (nt > ntmax) continue;
                const float* b = Ks + (8 * nt + g) * ldk + k0 + q;
                mma_tf32(acc[nt], a0, a1, a2, a3, tf32_rna(b[0]), tf32_rna(b[4]));
            }
        }
        float* Mc = Mt + hc * GC * GC;
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int r = m0 + g + 8 * (e >> 1), s = 8 * nt + 2 * q + (e & 1);
                float dec = r >= s ? expf(gam[r] - gam[s]) : 0.f; /* masked before exp: exponent <= 0 */
                float v = nt > ntmax ? 0.f : acc[nt][e] * dec;
                if (w < 4) As[r * GP_LDA + s] = r > s ? bet[r] * v : 0.f;
                else Mc[s * GC + r] = __uint_as_float(tf32_rna(v)); /* Mt[s][r] = M_rs */
            }
    }
    __syncthreads(); /* As complete; Ks, Qs no longer read by the products */
    /* Qt: (e^gamma q) transposed, 4 rows of one column per thread, by warps 2-7 while warps 0-1
       form the T_ii below */
    for (int e = tid - 64; e < dk * 16; e += 192) {
        if (e < 0) break;
        int d = e >> 4, r = 4 * (e & 15);
        *(uint4*)(Qt + (hc * dk + d) * GC + r) =
            make_uint4(tf32_rna(egam[r] * Qs[r * ldk + d]), tf32_rna(egam[r + 1] * Qs[(r + 1) * ldk + d]),
                       tf32_rna(egam[r + 2] * Qs[(r + 2) * ldk + d]), tf32_rna(egam[r + 3] * Qs[(r + 3) * ldk + d]));
    }
    /* 2. T_ii = (I + A_ii)^-1, column col of block i per thread: t_r = [r == col] - sum_{col <= k < r} A_rk t_k */
    if (tid < 64) {
        int i = tid >> 4, col = tid & 15;
        const float* Ai = As + 16 * i * GP_LDA + 16 * i;
        float t[16];
#pragma unroll
        for (int r = 0; r < 16; r++) {
            float v = r == col ? 1.f : 0.f;
#pragma unroll
            for (int k = 0; k < r; k++) v -= k >= col ? Ai[r * GP_LDA + k] * t[k] : 0.f;
            t[r] = v;
            Ts[(i * 16 + r) * GP_LDT + col] = v;
        }
    }
    __syncthreads(); /* Ts written; Qs free (Qt written) */

    /* 3. the solve, 8 columns per warp and pass; Z [64][8] of warp w at Qs + 512 w */
    float* Zs = Qs + 512 * w;
    for (int col0 = 8 * w; col0 < dk + dv; col0 += 64) {
        bool isk = col0 < dk;
        /* X of the pass's 64 rows, loaded before the solve's dependent chain (16 loads in flight) */
        float xs[4][4];
#pragma unroll
        for (int i = 0; i < 4; i++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int r = 16 * i + g + 8 * (e >> 1), col = col0 + 2 * q + (e & 1);
                float x = 0.f;
                if (r < L)
                    x = isk ? bet[r] * egam[r] * Ks[r * ldk + col]
                            : bet[r] * y[(long long)(t0 + r) * ldy + 2 * hk * dk + h * dv + (col - dk)];
                xs[i][e] = x;
            }
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float acc[4] = {xs[i][0], xs[i][1], xs[i][2], xs[i][3]};
            for (int j = 0; j < i; j++)
#pragma unroll
                for (int kk = 0; kk < 16; kk += 8) {
                    const float* a = As + (16 * i + g) * GP_LDA + 16 * j + kk + q;
                    const float* b = Zs + (16 * j + kk + q) * 8 + g;
                    mma_tf32(acc, tf32_rna(-a[0]), tf32_rna(-a[8 * GP_LDA]), tf32_rna(-a[4]),
                             tf32_rna(-a[8 * GP_LDA + 4]), tf32_rna(b[0]), tf32_rna(b[32]));
                }
            /* Y_i into Z's rows 16 i.., then Z_i = T_ii Y_i over it */
            *(float2*)(Zs + (16 * i + g) * 8 + 2 * q) = make_float2(acc[0], acc[1]);
            *(float2*)(Zs + (16 * i + g + 8) * 8 + 2 * q) = make_float2(acc[2], acc[3]);
            __syncwarp();
            float z[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int kk = 0; kk < 16; kk += 8) {
                const float* a = Ts + (16 * i + g) * GP_LDT + kk + q;
                const float* b = Zs + (16 * i + kk + q) * 8 + g;
                mma_tf32(z, tf32_rna(a[0]), tf32_rna(a[8 * GP_LDT]), tf32_rna(a[4]), tf32_rna(a[8 * GP_LDT + 4]),
                         tf32_rna(b[0]), tf32_rna(b[32]));
            }
            __syncwarp();
            *(float2*)(Zs + (16 * i + g) * 8 + 2 * q) = make_float2(z[0], z[1]);
            *(float2*)(Zs + (16 * i + g + 8) * 8 + 2 * q) = make_float2(z[2], z[3]);
            __syncwarp();
        }
        if (isk) {
            /* Wt: column col0 + lane / 4, rows 16 (lane % 4) .. + 15 */
            int cl = lane >> 2, r0 = 16 * (lane & 3);
            float* dst = Wt + (hc * dk + col0 + cl) * GC + r0;
#pragma unroll
            for (int r4 = 0; r4 < 4; r4++) {
                const float* zz = Zs + (r0 + 4 * r4) * 8 + cl;
                *(uint4*)(dst + 4 * r4) = make_uint4(tf32_rna(zz[0]), tf32_rna(zz[8]), tf32_rna(zz[16]), tf32_rna(zz[24]));
            }
        } else {
            /* U: rows lane and lane + 32, 8 columns each */
#pragma unroll
            for (int rr = 0; rr < 2; rr++) {
                int r = lane + 32 * rr;
                float* dst = U + (h * tpad + t0 + r) * dv + (col0 - dk);
                *(float4*)dst = *(const float4*)(Zs + r * 8);
                *(float4*)(dst + 4) = *(const float4*)(Zs + r * 8 + 4);
            }
        }
        __syncwarp();
    }
}
