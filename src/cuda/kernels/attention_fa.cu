/*
 * attention_fa.cu: causal gated attention prefill over a bf16 KV cache, FlashAttention-2 style
 *   (the fast prefill mode's kernel when the cache is bf16 and D is 64, 128 or 256).
 *
 * Math (per query row r = t*G + gi, head h = kvh*G + gi, position qp = pos0 + t):
 *   s_j = (q_r . k_j) / sqrt(D) for j = 0..qp;  out_r = sum_j softmax(s)_j v_j, times sigmoid(gate)
 *   when gated (gate at qg[t*ldg + h*2D + D + d]). Online softmax in the log2 domain: scores are
 *   multiplied by scale*log2(e) and exponentiated with exp2f; running max m, sum l and output o per
 *   row in fp32; P is rounded to bf16 for the P V product (as the tensor-core path always did).
 *
 * Layouts: q [T, H_q, D] fp32 (normalized, rotated, written by attn_prep); caches [capacity, H_kv,
 *   D] bf16 (position p of KV head kvh at (p*H_kv + kvh)*D); out [T, H_q*D] fp32.
 *
 * Launch: grid (ceil(T*G / 128), H_kv), block 256 = 8 warps, dynamic shared memory
 *   (128 + 4*64) * D * 2 bytes (192 KB at D = 256). Block x (taken in reverse, so the rows with the
 *   most keys start first) owns query rows 128x .. 128x + 127 of KV head y: with G = 8 these are 16
 *   tokens times the 8 query heads that read the same K/V, so every staged key serves 128 rows.
 *   Warp w owns rows 16w .. 16w + 15 (one m16 tile); rows past T*G repeat the last row and are not
 *   written.
 *   Shared memory: Q [128][D], K [2][64][D], V [2][64][D], all bf16, each 16-byte chunk c of row i
 *   stored at chunk c ^ (i & 7), so the 8 row addresses of every ldmatrix phase hit 8 distinct
 *   bank groups. Q is converted from fp32 once; K/V tiles of 64 positions arrive by cp.async
 *   (16 bytes per copy, zero-filled past the last key), the next tile in flight while this one
 *   is computed (two buffers, one __syncthreads before and after each tile's compute).
 *   Per tile and warp: S = Q K^T (16 x 64: D/16 k-steps x 8 n-tiles of mma.sync m16n8k16, A and B
 *   by ldmatrix.x4), causal mask on the block's diagonal tiles only, the online-softmax update
 *   (row max over the quad's 4 lanes; the row sum stays per lane until the end), then O += P V
 *   (P from the S accumulators re-packed as A fragments, V by ldmatrix.x4.trans; D/8 n-tiles).
 *   Registers: O is D/2 floats per thread (128 at D = 256), S 32.
 * fp8 cache (attn_prefill_fa{D}_fp8; layout in attention.cu): K/V tiles arrive raw (64 x D bytes
 *   each and their rows' scales, double-buffered) and are widened once per tile by the whole block
 *   to fp16 (one cvt per pair, exact) into one K and V tile in the layout above, the scales copied
 *   beside them; the products run on fp16 mma (Q and P in fp16), each key's K scale applied to its
 *   column of S and its V scale folded into its P weight (the row sums l take the unscaled
 *   weights). Shared memory: fa_smem_fp8(D) = Q, one K/V pair, two raw stages, 2 x 64 scales
 *   (193 KB at D = 256); still two __syncthreads per tile (after the copy wait, after the
 *   widening).
 */
#define FA_BM 128
#define FA_BN 64

/* Two floats as a bf16 or (F16) fp16 pair, lo in the low half. */
template <bool F16> __device__ __forceinline__ u32 pack16(float lo, float hi) {
    if constexpr (F16) {
        u32 r;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    } else {
        return pack_bf16(lo, hi);
    }
}

/* Byte offset of 16-byte chunk c of row i in a swizzled [rows][D] bf16 array. */
template <int D> __device__ __forceinline__ u32 fa_off(int i, int c) {
    return (u32)(i * (D * 2) + ((c ^ (i & 7)) << 4));
}

/* The online-softmax update of this thread's two rows after a tile: mx (the running maxima folded
   with this lane's scores) reduced over the quad's 4 lanes, corr = exp2(m - mx), then m = mx and
   l *= corr. Every row sees key 0 in tile 0, so mx is finite from the first tile on. */
__device__ __forceinline__ void fa_rescale(float* mx, float* m, float* l, float* corr) {
#pragma unroll
    for (int i = 0; i < 2; i++) {
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
        mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
        corr[i] = exp2f(m[i] - mx[i]);
        m[i] = mx[i];
        l[i] *= corr[i];
    }
}

/* The end of a 128-row block (attention_fa.cu and attention_wg.cu): this thread's rows r and r + 8
   (r = r0 + 16 warp + g), their sums l over the quad's 4 lanes, out = o / l times sigmoid(gate)
   when gated; o[4n + 2i + c] is row r + 8i, column 8n + 2 t4 + c. Rows past T*G are not written. */
template <int D>
__device__ __forceinline__ void fa_store_rows(const float* o, float* l, int r, int nrows, int G, int kvh, int nh, int t4,
                                              float* out, const float* qg, long long ldg, int gated) {
#pragma unroll
    for (int i = 0; i < 2; i++) {
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
        l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
        int ri = r + 8 * i;
        if (ri >= nrows) continue;
        int t = ri / G, h = kvh * G + ri % G;
        float inv = 1.f / l[i];
        float* op = out + ((long long)t * nh + h) * D;
        const float* gp = qg + (long long)t * ldg + (long long)h * 2 * D + D;
#pragma unroll
        for (int n = 0; n < D / 8; n++) {
            int d = 8 * n + 2 * t4;
            float x0 = o[4 * n + 2 * i] * inv, x1 = o[4 * n + 2 * i + 1] * inv;
            if (gated) {
                x0 *= sigmoid_f(gp[d]);
                x1 *= sigmoid_f(gp[d + 1]);
            }
            *(float2*)(op + d) = make_float2(x0, x1);
        }
    }
}

template <int D, bool F8>
__device__ __forceinline__ void attn_fa_t(const float* q, const void* kc, const void* vc, const float* qg, long long ldg,
                                          float* out, int nh, int hkv, int T, const int* pos_p, float scale,
                                          int gated) {
    extern __shared__ __align__(128) unsigned char fa_sm[];
    const float scale_log2 = scale * 1.4426950408889634f; /* exp2(s * scale * log2 e) = exp(s * scale) */
    const int CH = D / 8; /* 16-byte chunks per row (bf16) */
    const u32 TILE = FA_BN * D * 2;
    constexpr u32 F8T = 2 * FA_BN * D + 2 * FA_BN * 4; /* fp8 stage: K, V rows, K, V scales */
    u32 sQ = (u32)__cvta_generic_to_shared(fa_sm);
    /* bf16: K [2][64][D] then V [2][64][D]; fp8: one K and V tile, then the two raw stages */
    u32 sK = sQ + FA_BM * D * 2, sV = sK + (F8 ? 1 : 2) * TILE, sF = sK + 2 * TILE;
    /* fp8: the widened tile's K scales [64] then V scales [64] */
    const float* sc8 = (const float*)(fa_sm + FA_BM * D * 2 + 2 * TILE + 2 * F8T);
    int pos0 = pos_p[0];
    int G = nh / hkv, kvh = blockIdx.y;
    int nrows = T * G;
    int r0 = (gridDim.x - 1 - blockIdx.x) * FA_BM;
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    int last_row = min(nrows - 1, r0 + FA_BM - 1);
    int kend = pos0 + last_row / G + 1;
    int ntiles = (kend + FA_BN - 1) / FA_BN;
    int diag0 = pos0 + r0 / G; /* tiles reaching past this key need the causal mask */
    const long long kstride = F8 ? f8_rs(hkv, D) : (long long)hkv * D * 2; /* bytes per position */
    const unsigned char* kb = (const unsigned char*)kc + (long long)kvh * D * (F8 ? 1 : 2);
    const unsigned char* vb = (const unsigned char*)vc + (long long)kvh * D * (F8 ? 1 : 2);
    const int sofs = hkv * D + 4 * kvh - kvh * D; /* fp8: a row's scale from its head's first byte */

    /* tile 0 in flight while Q is converted */
    auto load_tile = [&](int tile, int buf) {
        int k0 = tile * FA_BN;
        if constexpr (F8) {
            u32 st = sF + buf * F8T;
#pragma unroll 1 /* unrolled, its addresses pushed the D = 256 kernel past 255 registers */
            for (int it = 0; it < FA_BN * (D / 16) / 256; it++) {
                int e = tid + 256 * it;
                int j = e / (D / 16), c = e % (D / 16), p = k0 + j;
                bool ok = p < kend;
                long long off = (long long)(ok ? p : 0) * kstride + c * 16;
                cp_async16(st + j * D + c * 16, kb + off, ok ? 16 : 0);
                cp_async16(st + FA_BN * D + j * D + c * 16, vb + off, ok ? 16 : 0);
            }
            if (tid < 2 * FA_BN) {
                int j = tid & (FA_BN - 1), p = k0 + j;
                bool ok = p < kend;
                const unsigned char* src = (tid < FA_BN ? kb : vb) + (ok ? (long long)p * kstride + sofs : 0);
                cp_async4(st + 2 * FA_BN * D + 4 * tid, src, ok ? 4 : 0);
            }
        } else {
#pragma unroll
            for (int it = 0; it < FA_BN * CH / 256; it++) {
                int e = tid + 256 * it;
                int j = e / CH, c = e % CH, p = k0 + j;
                bool ok = p < kend;
                long long off = (long long)(ok ? p : 0) * kstride + c * 16;
                u32 so = buf * TILE + fa_off<D>(j, c);
                cp_async16(sK + so, kb + off, ok ? 16 : 0);
                cp_async16(sV + so, vb + off, ok ? 16 : 0);
            }
        }
    };
    /* fp8: stage buf widened into the bf16 K and V tiles (16-byte chunk c of row j becomes bf16
       chunks 2c and 2c + 1) */
    auto widen = [&](int buf) {
        const u32 st = sF + buf * F8T;
        if (tid < 2 * FA_BN) ((float*)sc8)[tid] = *(const float*)(fa_sm + (st - sQ) + 2 * FA_BN * D + 4 * tid);
#pragma unroll 4
        for (int e = tid; e < 2 * FA_BN * (D / 16); e += 256) {
            int kv = e >= FA_BN * (D / 16), ee = e - kv * FA_BN * (D / 16);
            int j = ee / (D / 16), c = ee % (D / 16);
            uint4 o[2];
            const unsigned char* sp = fa_sm + (st - sQ);
            f8x16_to_f16(*(const uint4*)(sp + kv * FA_BN * D + j * D + c * 16), o);
            u32 dst = (kv ? sV : sK);
            asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};\n" ::"r"(dst + fa_off<D>(j, 2 * c)), "r"(o[0].x),
                         "r"(o[0].y), "r"(o[0].z), "r"(o[0].w)
                         : "memory");
            asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};\n" ::"r"(dst + fa_off<D>(j, 2 * c + 1)), "r"(o[1].x),
                         "r"(o[1].y), "r"(o[1].z), "r"(o[1].w)
                         : "memory");
        }
    };
    load_tile(0, 0);
    cp_async_commit();
#pragma unroll 4
    for (int it = 0; it < FA_BM * CH / 256; it++) {
        int e = tid + 256 * it;
        int i = e / CH, c = e % CH;
        int r = min(r0 + i, nrows - 1);
        const float* src = q + ((long long)(r / G) * nh + kvh * G + r % G) * D + c * 8;
        float4 x0 = *(const float4*)src, x1 = *(const float4*)(src + 4);
        uint4 v = make_uint4(pack16<F8>(x0.x, x0.y), pack16<F8>(x0.z, x0.w), pack16<F8>(x1.x, x1.y),
                             pack16<F8>(x1.z, x1.w));
        u32 a = sQ + fa_off<D>(i, c);
        asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};\n" ::"r"(a), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                     : "memory");
    }

    /* this thread's two rows: g and g + 8 of the warp's tile */
    int qpos[2];
#pragma unroll
    for (int i = 0; i < 2; i++) qpos[i] = pos0 + min(r0 + 16 * warp + g + 8 * i, nrows - 1) / G;
    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; n++)
#pragma unroll
        for (int c = 0; c < 4; c++) o[n][c] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    /* ldmatrix lane addresses (see the header): Q rows lane%16, chunk +lane/16; K keys
       lane%8 + 8*(lane/16), chunk +(lane/8)%2; V keys lane%8 + 8*((lane/8)%2), chunk +lane/16 */
    int qrow = 16 * warp + (lane & 15), qch = lane >> 4;
    int krow = (lane & 7) + ((lane >> 4) << 3), kch = (lane >> 3) & 1;
    int vrow = (lane & 7) + (((lane >> 3) & 1) << 3), vch = lane >> 4;

    for (int tile = 0; tile < ntiles; tile++) {
        if (tile + 1 < ntiles) load_tile(tile + 1, (tile + 1) & 1);
        cp_async_commit();
        cp_async_wait1();
        __syncthreads();
        if constexpr (F8) {
            widen(tile & 1);
            __syncthreads();
        }
        u32 kt = sK + (F8 ? 0 : (tile & 1) * TILE), vt = sV + (F8 ? 0 : (tile & 1) * TILE);
        int k0 = tile * FA_BN;
        float s[8][4];
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int c = 0; c < 4; c++) s[n][c] = 0.f;
#pragma unroll
        for (int ks = 0; ks < D / 16; ks++) {
            u32 a0, a1, a2, a3;
            ldsm_x4_at(sQ + fa_off<D>(qrow, 2 * ks + qch), a0, a1, a2, a3);
#pragma unroll
            for (int np = 0; np < 4; np++) {
                u32 b0, b1, b2, b3;
                ldsm_x4_at(kt + fa_off<D>(16 * np + krow, 2 * ks + kch), b0, b1, b2, b3);
                mma16<F8>(s[2 * np], a0, a1, a2, a3, b0, b1);
                mma16<F8>(s[2 * np + 1], a0, a1, a2, a3, b2, b3);
            }
        }
        /* s[n][2i + c]: row g + 8i, key k0 + 8n + 2t4 + c */
        bool diag = k0 + FA_BN - 1 > diag0;
        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                int i = c >> 1;
                float v = s[n][c] * (F8 ? scale_log2 * sc8[8 * n + 2 * t4 + (c & 1)] : scale_log2);
                if (diag && k0 + 8 * n + 2 * t4 + (c & 1) > qpos[i]) v = -INFINITY;
                s[n][c] = v;
                mx[i] = fmaxf(mx[i], v);
            }
        float corr[2];
        fa_rescale(mx, m, l, corr);
#pragma unroll
        for (int n = 0; n < 8; n++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                float p = exp2f(s[n][c] - mx[c >> 1]);
                s[n][c] = p;
                l[c >> 1] += p;
            }
#pragma unroll
        for (int n = 0; n < D / 8; n++) {
            o[n][0] *= corr[0];
            o[n][1] *= corr[0];
            o[n][2] *= corr[1];
            o[n][3] *= corr[1];
        }
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            /* fp8: key k's weight times its V scale */
            float v0 = 1.f, v1 = 1.f, v2 = 1.f, v3 = 1.f;
            if constexpr (F8) {
                v0 = sc8[FA_BN + 16 * kk + 2 * t4];
                v1 = sc8[FA_BN + 16 * kk + 2 * t4 + 1];
                v2 = sc8[FA_BN + 16 * kk + 8 + 2 * t4];
                v3 = sc8[FA_BN + 16 * kk + 8 + 2 * t4 + 1];
            }
            u32 a0 = pack16<F8>(s[2 * kk][0] * v0, s[2 * kk][1] * v1);
            u32 a1 = pack16<F8>(s[2 * kk][2] * v0, s[2 * kk][3] * v1);
            u32 a2 = pack16<F8>(s[2 * kk + 1][0] * v2, s[2 * kk + 1][1] * v3);
            u32 a3 = pack16<F8>(s[2 * kk + 1][2] * v2, s[2 * kk + 1][3] * v3);
#pragma unroll
            for (int dp = 0; dp < D / 16; dp++) {
                u32 b0, b1, b2, b3;
                ldsm_x4_trans_at(vt + fa_off<D>(16 * kk + vrow, 2 * dp + vch), b0, b1, b2, b3);
                mma16<F8>(o[2 * dp], a0, a1, a2, a3, b0, b1);
                mma16<F8>(o[2 * dp + 1], a0, a1, a2, a3, b2, b3);
            }
        }
        /* bf16: the next load overwrites this tile's buffers. fp8: the next load's stage was
           widened before this tile's second barrier, and the next widening follows its first. */
        if constexpr (!F8) __syncthreads();
    }

    fa_store_rows<D>(&o[0][0], l, r0 + 16 * warp + g, nrows, G, kvh, nh, t4, out, qg, ldg, gated);
}

#define ATTN_FA(D)                                                                                                 \
    extern "C" __global__ void __launch_bounds__(256, 1)                                                           \
        attn_prefill_fa##D(AttnPrefillParams_fields) {                                                             \
        attn_fa_t<D, false>(q, kc, vc, qg, ldg, out, nh, hkv, T, pos_p, scale, gated);                             \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(256, 1)                                                           \
        attn_prefill_fa##D##_fp8(AttnPrefillParams_fields) {                                                       \
        attn_fa_t<D, true>(q, kc, vc, qg, ldg, out, nh, hkv, T, pos_p, scale, gated);                              \
    }
ATTN_FA(64)
ATTN_FA(128)
ATTN_FA(256)

