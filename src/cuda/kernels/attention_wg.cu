/*
 * attention_wg.cu: causal gated attention prefill over a bf16 KV cache on Hopper's warpgroup MMA
 *   (wgmma) with its K/V tiles copied by the TMA (sm_90a): attention_fa.cu's blocks and math.
 *
 * Math: as attention_fa.cu (scores in the log2 domain, online softmax in fp32, P rounded to bf16
 *   for P V, output times sigmoid(gate) when gated). Same inputs and outputs; AttnPrefillParams
 *   with the TMA maps km / vm of the K and V caches (bf16 [positions][H_kv * D], boxes of 64
 *   columns x 64 keys, 128-byte swizzle), built by the host over the caches' whole allocation.
 *
 * Launch: grid (ceil(T*G / 128), H_kv), block 256 = 2 warpgroups, dynamic shared memory
 *   fa_smem(D) + 1024 (193 KB at D = 256). Block x (in reverse) owns query rows 128x .. 128x + 127
 *   of KV head y (16 tokens x 8 heads at G = 8); warpgroup h owns rows 64h .. 64h + 63, warp w of
 *   it the 16 rows 64h + 16w .. (the wgmma accumulator rows; s[4n + c] / o[4n + c] hold row
 *   16w + g + 8(c>>1), column 8n + 2(lane%4) + (c&1), as mma.sync's, so the softmax and the
 *   epilogue are attention_fa.cu's).
 *
 * Shared memory from a 1024-byte aligned base: Q [2 warpgroups][64 rows][D], then K [2 buffers][64
 *   keys][D], then V likewise, every [64][D] tile as D/64 chunks of [64 rows][128 bytes] in the
 *   128-byte swizzle (16-byte unit u of row i at u ^ (i % 8)): what TMA writes for one box, and
 *   wgmma's SW128 layouts. Q is converted to bf16 by the threads into the same layout.
 *   - S = Q K^T, per warpgroup m64n64 over D/16 k-steps: both operands K-major SW128 (k-step ks:
 *     chunk ks/4, start + 32 (ks % 4) bytes, SBO 1024 = the next 8 rows).
 *   - O += P V: P from registers (the S accumulators as bf16 pairs: the A fragment layout), V as
 *     the MN-major SW128 operand (tnsp-b): per 16-key step kk and 64-column chunk nb one m64n64k16
 *     at chunk nb, start + 2048 kk, the 8-key groups 1024 bytes apart (given as both LBO and SBO:
 *     an m64n64 step spans one swizzle atom across N, so only the K stride is read, whichever
 *     field the hardware takes it from).
 *   - Per buffer a "full" mbarrier for K and one for V (armed with the tile's bytes by the issuing
 *     thread), and a release count: the second warpgroup done with a buffer (S(t) complete for K,
 *     P(t) V(t) for V) issues the copy of the tile two on into it. No block barrier in the loop.
 *   - Keys past the last query's position (kend) read whatever the cache holds there (rows past
 *     the allocation read as zeros): their scores are masked to -inf, and their V rows (last tile
 *     only) are zeroed in shared memory before the last P V, so garbage (NaN) never reaches O.
 * Schedule per warpgroup (FA3's intra-warpgroup overlap): S(0), softmax(0); for t >= 1: issue
 *   S(t), then P(t-1) V(t-1); wait for S(t); softmax(t) while P V runs; wait; rescale O, pack P(t);
 *   a last P V after the loop.
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

__device__ __forceinline__ void aw_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }
__device__ __forceinline__ void aw_fence_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
#endif

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
/* SW128 descriptor: start, LBO (bytes), SBO 1024, layout type 1 */
__device__ __forceinline__ u64 at_desc(u32 saddr, u32 lbo) {
    return (u64)((saddr & 0x3FFFFu) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}
#endif

template <int D>
__device__ __forceinline__ void attn_wt_t(const float* q, const TmaMap* km, const TmaMap* vm, const float* qg,
                                          long long ldg, float* out, int nh, int hkv, int T, const int* pos_p,
                                          float scale, int gated) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    extern __shared__ __align__(1024) unsigned char at_sm[];
    __shared__ __align__(8) u64 kfull[2], vfull[2];
    __shared__ unsigned krel[2], vrel[2];
    constexpr int NC = D / 64;       /* 64-column chunks per row */
    constexpr u32 TILE = 64 * D * 2; /* one [64][D] tile */
    const u32 raw = smem_u32(at_sm), sQ = (raw + 1023u) & ~1023u;
    const u32 sK = sQ + 2 * TILE, sV = sK + 2 * TILE;
    const float scale_log2 = scale * 1.4426950408889634f;
    const int pos0 = pos_p[0];
    const int G = nh / hkv, kvh = blockIdx.y;
    const int nrows = T * G;
    const int r0 = (gridDim.x - 1 - blockIdx.x) * 128;
    const int tid = threadIdx.x, warp = tid >> 5, wg = tid >> 7, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    const int last_row = min(nrows - 1, r0 + 127);
    const int kend = pos0 + last_row / G + 1;
    const int ntiles = (kend + 63) / 64;
    const int diag0 = pos0 + r0 / G;
    if (tid == 0) {
        for (int i = 0; i < 2; i++) {
            mb_init(&kfull[i], 1);
            mb_init(&vfull[i], 1);
            krel[i] = vrel[i] = 0;
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    auto load_k = [&](int tile) {
        u64* b = &kfull[tile & 1];
        mb_expect(b, TILE);
#pragma unroll
        for (int c = 0; c < NC; c++) tma_2d(sK + (tile & 1) * TILE + c * 8192, km, kvh * D + 64 * c, 64 * tile, b);
    };
    auto load_v = [&](int tile) {
        u64* b = &vfull[tile & 1];
        mb_expect(b, TILE);
#pragma unroll
        for (int c = 0; c < NC; c++) tma_2d(sV + (tile & 1) * TILE + c * 8192, vm, kvh * D + 64 * c, 64 * tile, b);
    };
    if (tid == 0) {
        load_k(0);
        load_v(0);
        if (ntiles > 1) {
            load_k(1);
            load_v(1);
        }
    }
    /* Q as bf16 in the swizzled layout; rows past T*G repeat the last row */
#pragma unroll 4
    for (int it = 0; it < D / 16; it++) {
        int e = tid + 256 * it, i = e / (D / 8), c = e % (D / 8), ii = i & 63;
        int r = min(r0 + i, nrows - 1);
        const float* src = q + ((long long)(r / G) * nh + kvh * G + r % G) * D + c * 8;
        float4 x0 = *(const float4*)src, x1 = *(const float4*)(src + 4);
        u32 a = sQ + (i >> 6) * TILE + (c >> 3) * 8192 + ii * 128 + (((c & 7) ^ (ii & 7)) << 4);
        asm volatile("st.shared.v4.u32 [%0], {%1,%2,%3,%4};\n" ::"r"(a), "r"(pack_bf16(x0.x, x0.y)),
                     "r"(pack_bf16(x0.z, x0.w)), "r"(pack_bf16(x1.x, x1.y)), "r"(pack_bf16(x1.z, x1.w))
                     : "memory");
    }
    aw_fence_async();
    __syncthreads();

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
    const u32 qw = sQ + wg * TILE;
    const bool lead = (tid & 127) == 0;
    auto scores = [&](int tile) {
        u32 kt = sK + (tile & 1) * TILE;
#pragma unroll
        for (int ks = 0; ks < D / 16; ks++) {
            u32 off = (ks >> 2) * 8192 + (ks & 3) * 32;
            aw_mma_ss(s, at_desc(qw + off, 16), at_desc(kt + off, 16), ks);
        }
    };
    auto pv = [&](int tile) {
        u32 vt = sV + (tile & 1) * TILE;
#pragma unroll
        for (int kk = 0; kk < 4; kk++)
#pragma unroll
            for (int nb = 0; nb < NC; nb++) aw_mma_rs_t(o + 32 * nb, pa[kk], at_desc(vt + nb * 8192 + kk * 2048, 1024));
    };
    /* this warpgroup is done with K(tile) / V(tile): the second to say so loads tile + 2 there */
    auto rel_k = [&](int tile) {
        if (lead && tile + 2 < ntiles && (atomicAdd(&krel[tile & 1], 1u) & 1u)) load_k(tile + 2);
    };
    auto rel_v = [&](int tile) {
        if (lead && tile + 2 < ntiles && (atomicAdd(&vrel[tile & 1], 1u) & 1u)) load_v(tile + 2);
    };
    auto softmax = [&](int tile, float* corr) {
        int k0 = 64 * tile;
        bool diag = k0 + 63 > diag0;
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
    auto rescale = [&](const float* corr) {
        if (!__any_sync(0xffffffffu, corr[0] != 1.f || corr[1] != 1.f)) return;
#pragma unroll
        for (int j = 0; j < D / 2; j++) o[j] *= corr[(j >> 1) & 1];
    };
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

    wt_wait(&kfull[0], 0);
    wg_fence();
    scores(0);
    wg_commit();
    wg_wait0();
    rel_k(0);
    softmax(0, corr);
    pack();
    for (int tile = 1; tile < ntiles; tile++) {
        wt_wait(&kfull[tile & 1], (tile >> 1) & 1);
        wg_fence();
        scores(tile);
        wg_commit();
        wt_wait(&vfull[(tile - 1) & 1], ((tile - 1) >> 1) & 1);
        pv(tile - 1);
        wg_commit();
        aw_wait1(); /* S(tile) done; P(tile - 1) V(tile - 1) may still run */
        rel_k(tile);
        softmax(tile, corr);
        wg_wait0();
        rel_v(tile - 1);
        rescale(corr);
        pack();
    }
    const int lt = ntiles - 1;
    wt_wait(&vfull[lt & 1], (lt >> 1) & 1);
    /* the last tile's V rows of keys >= kend (unwritten cache rows) to zero, by this warpgroup */
    const int j0 = kend - 64 * lt;
    if (j0 < 64) {
        const u32 vt = sV + (lt & 1) * TILE;
        for (int u = tid & 127; u < (64 - j0) * NC * 8; u += 128) {
            int row = j0 + u / (NC * 8), c = (u / 8) % NC, x = u % 8;
            asm volatile("st.shared.v4.u32 [%0], {%1,%1,%1,%1};\n" ::"r"(vt + c * 8192 + row * 128 + x * 16), "r"(0)
                         : "memory");
        }
        aw_fence_async();
        asm volatile("bar.sync %0, 128;\n" ::"r"(1 + wg) : "memory");
    }
    wg_fence();
    pv(lt);
    wg_commit();
    wg_wait0();

    fa_store_rows<D>(o, l, r0 + 16 * warp + g, nrows, G, kvh, nh, t4, out, qg, ldg, gated);
#endif
}

#define ATTN_WG(D)                                                                                       \
    extern "C" __global__ void __launch_bounds__(256, 1) attn_prefill_wg##D(AttnPrefillParams_fields) { \
        attn_wt_t<D>(q, &km, &vm, qg, ldg, out, nh, hkv, T, pos_p, scale, gated);                       \
    }
ATTN_WG(64)
ATTN_WG(128)
ATTN_WG(256)
