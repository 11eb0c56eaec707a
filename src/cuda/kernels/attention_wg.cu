/*
 * attention_wg.cu: causal gated attention prefill over a bf16 KV cache on Hopper's warpgroup MMA
 *   (wgmma, sm_90a): attention_fa.cu's blocks and math with both products on wgmma.
 *
 * Math: as attention_fa.cu (scores in the log2 domain, online softmax in fp32, P rounded to bf16
 *   for P V, output times sigmoid(gate) when gated). Same inputs, outputs and AttnPrefillParams.
 *
 * Launch: grid (ceil(T*G / 128), H_kv), block 256 = 2 warpgroups, dynamic shared memory
 *   fa_smem(D) = (128 + 4*64) * D * 2 bytes (192 KB at D = 256). Block x (in reverse) owns query
 *   rows 128x .. 128x + 127 of KV head y (16 tokens x 8 heads at G = 8); warpgroup h owns rows
 *   64h .. 64h + 63, warp w of it the 16 rows 64h + 16w .. (the wgmma accumulator rows).
 *
 * Shared memory, every tile as wgmma "core matrices" (8 rows x 16 bytes, no swizzle): 16-byte
 *   chunk c (columns 8c .. 8c+7) of row i of a [64][D] tile at (c*8 + i/8)*128 + (i%8)*16.
 *   Q: two such [64][D] tiles (one per warpgroup); K and V: two buffers of one [64 keys][D] tile.
 *   - S = Q K^T, per warpgroup m64n64 over D/16 k-steps (both operands in shared memory, K-major:
 *     the k-neighbour core matrix LBO = 1024 bytes on, the next 8 rows SBO = 128 bytes on).
 *   - O += P V, per warpgroup 4 k-steps (16 keys) x D/64 m64n64 (P from registers: the S
 *     accumulators as bf16 pairs, which is exactly the A fragment layout; V read transposed by the
 *     instruction, tnsp-b, as an MN-major operand: the same bytes with LBO = 128 (next 8 keys) and
 *     SBO = 1024 (next 8 columns)).
 *   The accumulators s[4n + c] / o[4n + c] (n: 8-column group) hold row 16w + g + 8(c>>1), column
 *   8n + 2(lane%4) + (c&1), as mma.sync's, so the softmax is attention_fa.cu's.
 *   Copies: cp.async 16 bytes, lanes over 8 rows then 4 chunks (a warp fills four 128-byte runs:
 *   no bank conflicts), zero-filled past the last key; fence.proxy.async after each wait, before
 *   the barrier that lets wgmma read them.
 *
 * Two schedules (template PIPE):
 *   false (attn_prefill_wg*): per tile: wait for it, barrier, start the next tile's copies,
 *     S (wait), softmax, rescale O, O += P V (wait), barrier.
 *   true (attn_prefill_wgp*, FA3's intra-warpgroup overlap): K runs one tile ahead of V; per
 *     tile t: wait, barrier, start K(t+1) and V(t) copies, issue S(t) and then O += P(t-1) V(t-1),
 *     wait for S(t) only, softmax(t) while P V runs on the tensor cores, wait, rescale O, pack
 *     P(t); a last P V after the loop. K(t+1) overwrites K(t-1) and V(t) overwrites V(t-2), both
 *     finished by every warpgroup before the barrier.
 * Registers: O D/2 floats, S 32, P 16 (at D = 256 about 200 in all).
 * Elsewhere than sm_90a the kernels are empty and the host never launches them.
 */

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define AW_ACC32                                                                                                      \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, " \
    "%24, %25, %26, %27, %28, %29, %30, %31}"
#define AW_ACC32_OPS(d)                                                                                              \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),      \
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),      \
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),     \
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

/* d[64x64] (+)= A[64x16] * B[16x64], both from shared memory, K-major; accumulate = 0 overwrites d */
__device__ __forceinline__ void aw_mma_ss(float* d, u64 da, u64 db, int accumulate) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " AW_ACC32 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : AW_ACC32_OPS(d)
                 : "l"(da), "l"(db), "r"(accumulate));
}

/* d[64x64] += A[64x16] (registers) * B[16x64] (shared memory, MN-major: read transposed) */
__device__ __forceinline__ void aw_mma_rs_t(float* d, const u32* a, u64 db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " AW_ACC32
                 ", {%32, %33, %34, %35}, %36, p, 1, 1, 1;\n}\n"
                 : AW_ACC32_OPS(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

/* A descriptor from its low word (start, LBO) and SBO in bytes; no swizzle */
__device__ __forceinline__ u64 aw_desc(u32 lo, u32 sbo) { return (u64)lo | ((u64)(sbo >> 4) << 32); }

__device__ __forceinline__ void aw_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }
__device__ __forceinline__ void aw_fence_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
#endif

/* Byte offset of 16-byte chunk c of row i in a [64][D] core-matrix tile (see the header). */
__device__ __forceinline__ u32 aw_off(int i, int c) { return (u32)(((c * 8 + (i >> 3)) << 7) + ((i & 7) << 4)); }

template <int D, bool PIPE>
__device__ __forceinline__ void attn_wg_t(const float* q, const u16* kc, const u16* vc, const float* qg, long long ldg,
                                          float* out, int nh, int hkv, int T, const int* pos_p, float scale,
                                          int gated) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(128) unsigned char aw_sm[];
    const float scale_log2 = scale * 1.4426950408889634f;
    constexpr int CH = D / 8; /* 16-byte chunks per row */
    constexpr u32 TILE = 64 * D * 2;
    const u32 sQ = (u32)__cvta_generic_to_shared(aw_sm);
    const u32 sK = sQ + 2 * TILE, sV = sK + 2 * TILE;
    const int pos0 = pos_p[0];
    const int G = nh / hkv, kvh = blockIdx.y;
    const int nrows = T * G;
    const int r0 = (gridDim.x - 1 - blockIdx.x) * 128;
    const int tid = threadIdx.x, warp = tid >> 5, wg = tid >> 7, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const int last_row = min(nrows - 1, r0 + 127);
    const int kend = pos0 + last_row / G + 1;
    const int ntiles = (kend + 63) / 64;
    const int diag0 = pos0 + r0 / G; /* tiles reaching past this key need the causal mask */
    const long long kstride = (long long)hkv * D;
    const u16* kb = kc + (long long)kvh * D;
    const u16* vb = vc + (long long)kvh * D;

    /* one [64][D] tile of keys (or values) from position 64*tile into the buffer at dst: copy it
       of this thread is chunk c of key j0 + JS*it (few registers live across the loop) */
    constexpr int JS = 256 / CH;
    const int j0 = 8 * ((tid >> 3) / CH) + (tid & 7), c0 = (tid >> 3) % CH;
    const u32 soff = aw_off(j0, c0);
    auto load_kv = [&](u32 dst, const u16* src, int tile) {
        int lim = kend - 64 * tile - j0; /* copy it is in range when JS*it < lim */
        const u16* p = src + (long long)(64 * tile + j0) * kstride + c0 * 8;
#pragma unroll
        for (int it = 0; it < CH / 4; it++) {
            bool ok = JS * it < lim;
            cp_async16(dst + soff + JS * it * 16, ok ? p + (long long)JS * it * kstride : src, ok ? 16 : 0);
        }
    };
    /* Q as bf16, each warpgroup's 64 rows one tile; rows past T*G repeat the last row */
#pragma unroll 4
    for (int it = 0; it < CH / 2; it++) {
        int e = tid + 256 * it, rest = e >> 3;
        int i = 8 * (rest / CH) + (e & 7), c = rest % CH;
        int r = min(r0 + i, nrows - 1);
        const float* src = q + ((long long)(r / G) * nh + kvh * G + r % G) * D + c * 8;
        float4 x0 = *(const float4*)src, x1 = *(const float4*)(src + 4);
        u32 a = sQ + (i >> 6) * TILE + aw_off(i & 63, c);
        asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};\n" ::"r"(a), "r"(pack_bf16(x0.x, x0.y)),
                     "r"(pack_bf16(x0.z, x0.w)), "r"(pack_bf16(x1.x, x1.y)), "r"(pack_bf16(x1.z, x1.w))
                     : "memory");
    }

    /* this thread's two rows: g and g + 8 of its warp's 16 */
    int qpos[2];
#pragma unroll
    for (int i = 0; i < 2; i++) qpos[i] = pos0 + min(r0 + 16 * warp + g + 8 * i, nrows - 1) / G;
    float o[D / 2];
#pragma unroll
    for (int n = 0; n < D / 2; n++) o[n] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
    float s[32];
#pragma unroll
    for (int j = 0; j < 32; j++) s[j] = 0.f;
    u32 pa[4][4];
    /* descriptors' low words (start address and LBO, 16-byte units): this warpgroup's Q, k-step
       0; K and V buffer 0. The high words (SBO) are constants. */
    const u32 dq = ((sQ + wg * TILE) >> 4) | (64u << 16), dk = (sK >> 4) | (64u << 16), dv = (sV >> 4) | (8u << 16);

    auto scores = [&](int tile) { /* issue S = Q K^T of this tile (K in buffer tile & 1) */
        u32 kt = dk + (tile & 1) * (TILE >> 4);
#pragma unroll
        for (int ks = 0; ks < D / 16; ks++)
            aw_mma_ss(s, aw_desc(dq + ks * 128, 128), aw_desc(kt + ks * 128, 128), ks);
    };
    auto pv = [&](int tile) { /* issue O += P V of this tile (V in buffer tile & 1) */
        u32 vt = dv + (tile & 1) * (TILE >> 4);
#pragma unroll
        for (int kk = 0; kk < 4; kk++)
#pragma unroll
            for (int nb = 0; nb < D / 64; nb++) aw_mma_rs_t(o + 32 * nb, pa[kk], aw_desc(vt + kk * 16 + nb * 512, 1024));
    };
    /* mask, online-softmax update of m and l, s := exp2(s - m); returns the rescale factors */
    auto softmax = [&](int tile, float* corr) {
        int k0 = 64 * tile;
        bool diag = k0 + 63 > diag0;
        /* key k0 + 8(j>>2) + 2 t4 + (j&1) is masked for row i when 8(j>>2) + (j&1) > lim[i] */
        int lim[2] = {qpos[0] - k0 - 2 * t4, qpos[1] - k0 - 2 * t4};
        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int j = 0; j < 32; j++) {
            int i = (j >> 1) & 1;
            float v = s[j] * scale_log2;
            if (diag && 8 * (j >> 2) + (j & 1) > lim[i]) v = -INFINITY;
            s[j] = v;
            mx[i] = fmaxf(mx[i], v);
        }
        fa_rescale(mx, m, l, corr);
#pragma unroll
        for (int j = 0; j < 32; j++) {
            float p = exp2f(s[j] - mx[(j >> 1) & 1]);
            s[j] = p;
            l[(j >> 1) & 1] += p;
        }
    };
    auto rescale = [&](const float* corr) { /* skipped (same result) while no row max of the warp moved */
        if (!__any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f)) return;
#pragma unroll
        for (int j = 0; j < D / 2; j++) o[j] *= corr[(j >> 1) & 1];
    };
    /* P as the A fragments of the 4 k-steps: keys 16kk + 2t4 (+8), rows g (+8) */
    auto pack = [&]() {
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            pa[kk][0] = pack_bf16(s[8 * kk + 0], s[8 * kk + 1]);
            pa[kk][1] = pack_bf16(s[8 * kk + 2], s[8 * kk + 3]);
            pa[kk][2] = pack_bf16(s[8 * kk + 4], s[8 * kk + 5]);
            pa[kk][3] = pack_bf16(s[8 * kk + 6], s[8 * kk + 7]);
        }
    };
    float corr[2];

    if (!PIPE) {
        load_kv(sK, kb, 0);
        load_kv(sV, vb, 0);
        cp_async_commit();
        for (int tile = 0; tile < ntiles; tile++) {
            if (tile + 1 < ntiles) {
                load_kv(sK + ((tile + 1) & 1) * TILE, kb, tile + 1);
                load_kv(sV + ((tile + 1) & 1) * TILE, vb, tile + 1);
            }
            cp_async_commit();
            cp_async_wait1();
            aw_fence_async();
            __syncthreads();
            wg_fence();
            scores(tile);
            wg_commit();
            wg_wait0();
            softmax(tile, corr);
            rescale(corr);
            pack();
            wg_fence();
            pv(tile);
            wg_commit();
            wg_wait0();
            __syncthreads(); /* the next trip refills this tile's buffers */
        }
    } else {
        load_kv(sK, kb, 0);
        cp_async_commit();
        asm volatile("cp.async.wait_group 0;\n" ::: "memory");
        aw_fence_async();
        __syncthreads();
        if (ntiles > 1) load_kv(sK + TILE, kb, 1);
        load_kv(sV, vb, 0);
        cp_async_commit();
        wg_fence();
        scores(0);
        wg_commit();
        wg_wait0();
        softmax(0, corr);
        pack();
        for (int tile = 1; tile < ntiles; tile++) {
            asm volatile("cp.async.wait_group 0;\n" ::: "memory"); /* K(tile), V(tile - 1) */
            aw_fence_async();
            __syncthreads(); /* every warpgroup is done with K(tile - 1) and V(tile - 2) */
            if (tile + 1 < ntiles) load_kv(sK + ((tile + 1) & 1) * TILE, kb, tile + 1);
            load_kv(sV + (tile & 1) * TILE, vb, tile);
            cp_async_commit();
            wg_fence();
            scores(tile);
            wg_commit();
            pv(tile - 1);
            wg_commit();
            aw_wait1(); /* S(tile) done; P(tile - 1) V(tile - 1) may still run */
            softmax(tile, corr);
            wg_wait0();
            rescale(corr);
            pack();
        }
        asm volatile("cp.async.wait_group 0;\n" ::: "memory"); /* V(ntiles - 1) */
        aw_fence_async();
        __syncthreads();
        wg_fence();
        pv(ntiles - 1);
        wg_commit();
        wg_wait0();
    }

    fa_store_rows<D>(o, l, r0 + 16 * warp + g, nrows, G, kvh, nh, t4, out, qg, ldg, gated);
#endif
}

#define ATTN_WG(D)                                                                                          \
    extern "C" __global__ void __launch_bounds__(256, 1) attn_prefill_wg##D(AttnPrefillParams_fields) {    \
        attn_wg_t<D, false>(q, (const u16*)kc, (const u16*)vc, qg, ldg, out, nh, hkv, T, pos_p, scale, gated); \
    }                                                                                                       \
    extern "C" __global__ void __launch_bounds__(256, 1) attn_prefill_wgp##D(AttnPrefillParams_fields) {   \
        attn_wg_t<D, true>(q, (const u16*)kc, (const u16*)vc, qg, ldg, out, nh, hkv, T, pos_p, scale, gated);  \
    }
ATTN_WG(64)
ATTN_WG(128)
ATTN_WG(256)
