/*
 * gemm_wg.cu: the many-row 4-bit weight product on Hopper's warpgroup MMA (wgmma, sm_90a):
 *   Y[m, n] (+)= sum_k X[xr(m), k] * W[e*N + n, k], W = s*q + b from MLX 4-bit codes (bf16 scales
 *   and biases, groups of a power of two from 16 columns), same row maps and tiles as gemm.cu.
 *
 * Why: gemm_pipe issues one mma.sync per 16x8x16 and each warp dequantizes its own copy of the
 *   weights it multiplies and converts its own inputs (12.6 instructions per mma, one block per
 *   SM, tensor pipe 14-23% busy). Here the weights sit on wgmma's M side, dequantized once per
 *   block straight into the A registers, and one wgmma.m64n64k16 covers 64 input rows with its
 *   B operand read by the hardware from shared memory (fewer instructions per multiply-add;
 *   measured against gemm_pipe in docs/perf-log.md, session 22).
 *
 * Inputs: `x_bf16_perm` first writes X as bf16 rows of K (ld K) with each 64-column chunk in
 *   the wgmma k order below, so the pipeline copies 16-byte pieces straight into the B layout;
 *   the kernels take GemmParams with `x` pointing at that bf16 copy (`ldx` unused: its stride is K).
 *
 * k order (as gemm_skinny/gemm_pipe): in a 64-column chunk thread (g = lane/4, t = lane%4) owns
 *   physical columns 16t .. 16t+15 of its weight rows (8 bytes of codes); in k-step s (0..3) its
 *   A slots {2t, 2t+1} hold physical columns 16t + 8(s>>1) + 2(s&1) + {0, 4}, i.e. the nibble pair
 *   (2(s&1), 2(s&1)+4) of code word s>>1, and slots {2t+8, 2t+9} the same columns + 1 (nibbles
 *   (2(s&1)+1, 2(s&1)+5)). So logical k = 16s + kl of a chunk (kl < 16) is physical column
 *   16((kl&7)>>1) + 8(s>>1) + 2(s&1) + 4(kl&1) + (kl>>3), and in the permuted X the 16-byte piece
 *   q = 2s + (kl>>3) of a chunk holds kl&7 = 0..7 of that k-step half.
 *
 * Shared memory, per stage (WG_STAGES, cp.async, one k-tile of 128 columns = two 64-column
 * chunks each):
 *   X: BT x 128 bf16 as wgmma "core matrices" (8 rows x 16 bytes, no swizzle): piece q (0..15;
 *      chunk q/8, its piece q%8) of input row r at ((q * BT/8) + r/8) * 128 + (r%8) * 16. For
 *      k-step s (0..7) and input rows 64j.., the B descriptor starts at piece 2s, row group 8j; the
 *      K-neighbour core matrix (piece 2s+1) is LBO = BT/8 * 128 bytes on, the next 8 rows
 *      SBO = 128 bytes on.
 *   W: the block's 128 weight rows x 64 bytes of codes.
 *
 * Launch: block 256 = 2 warpgroups; warpgroup h owns weight rows n0 + 64h .. +63 (warp w of it
 *   rows 16w + g and 16w + g + 8, the A fragment rows), all BT = 64*NB input rows of the tile
 *   (NB m64n64 accumulators of 32 floats per thread). grid (ceil(N/128), tiles) as gemm_pipe64
 *   (NB = 1; grouped experts and plain products under LILY_CUDA_WG128_FROM = 1024 rows),
 *   (ceil(N/128), ceil(M/128)) (NB = 2, also grouped experts' 128-row tiles), or
 *   (ceil(N/128), ceil(M/256)) (NB = 4, gemm_wg256: plain products from LILY_CUDA_WG256_FROM
 *   rows, off by default until measured; 216 KB of shared memory, each weight dequantized once
 *   per 256 input rows). Per k-tile: wait for its stage, one barrier, refill the stage used one k-tile ago
 *   (its wgmmas are complete: each warpgroup waits for its own before the barrier); per 64-column
 *   half dequantize 4 k-steps x 4 A registers and issue its 4*NB wgmmas (the second half's
 *   dequantization overlaps the first half's wgmmas); commit, wait. The scales and biases are
 *   loaded one k-tile ahead into two register sets (two k-tiles per loop trip) and converted
 *   where used. Dynamic shared memory
 *   WG_STAGES * (BT*256 + 8192) bytes. A plain product whose grid would leave SMs idle splits its
 *   k-tiles over ksplit blocks (grid.z), summed as in gemm_skinny (part, tickets: in order,
 *   deterministic). Requires K % 128 == 0 and an sm_90a build (elsewhere the
 *   kernels are empty and the host never launches them).
 *
 * Both kernels here may be launched as programmatic dependents (kernel_names.rs PDL_KERNELS):
 *   x_bf16_perm waits first; gemm_wg fetches its first stages' codes and scales, then waits
 *   before it touches the inputs (a grouped product waits first: its tile list is an input).
 */
#define WG_STAGES 3

/* x_bf16_perm: xb[r, 64c + 8q + i] = bf16(x[xr(r), 64c + physical(s = q>>1, kl = 8(q&1) + i)]) for
   r < rows, xr(r) = gather[r] / gdiv (or r without gather: the grouped products' gathered rows
   written out in tile order for gemm_wt); one thread per 16-byte piece. */
/* The layout, for every kernel that writes gemm_wg's input: 16-byte piece q of a row holds, from
   physical column xperm_col(q), elements 2j = +16j and 2j + 1 = +16j + 4 (j < 4); xperm_piece
   packs them from v(offset), rounded to bf16. */
__device__ __forceinline__ int xperm_col(int q) {
    int qq = q & 7, s = qq >> 1;
    return (q >> 3) * 64 + 8 * (s >> 1) + 2 * (s & 1) + (qq & 1);
}
template <class F>
__device__ __forceinline__ uint4 xperm_piece(F v) {
    return make_uint4(gp_bf16x2(v(0), v(4)), gp_bf16x2(v(16), v(20)), gp_bf16x2(v(32), v(36)),
                      gp_bf16x2(v(48), v(52)));
}

extern "C" __global__ void x_bf16_perm(XPermParams p) {
    pdl_begin();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    int per = p.k / 8;
    if (i >= (long long)p.rows * per) return;
    long long row = i / per;
    int q = (int)(i % per);
    const float* xr = p.x + gemm_xrow(p.gather, p.gdiv, (int)row) * p.ldx + xperm_col(q);
    *(uint4*)(p.xb + row * p.k + q * 8) = xperm_piece([&](int o) { return xr[o]; });
}

/* silu_mul_pairs_perm: h[k, :] = silu(gu[2k, :]) * gu[2k+1, :] (gate/up rows side by side, width
   n a multiple of 64) written as x_bf16_perm would write it (the same f32 product, rounded once):
   the down projection's input without the f32 round trip. One thread per 16-byte piece. */
extern "C" __global__ void silu_mul_pairs_perm(const SiluMulPairsPermParams p) {
    pdl_begin();
    int n = p.n, per = n / 8;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)per * p.pairs) return;
    long long k = i / per;
    int q = (int)(i - k * per);
    const float* g = p.gu + k * 2 * n + xperm_col(q);
    const float* u = g + n;
    *(uint4*)(p.xb + k * n + q * 8) = xperm_piece([&](int o) { return silu_f(g[o]) * u[o]; });
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wg_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }

/* One bf16x2 A register: the nibbles at bits sh..sh+3 and sh+16..sh+19 of code word w as
   s*q + b (128 + q by one LOP3 into a bf16 with exponent 2^7, minus 128 exact, then the fma
   rounds once). */
__device__ __forceinline__ u32 wg_dq(u32 w, int sh, u32 s2, u32 b2) {
    u32 c = lop3_and_or(sh ? w >> sh : w, 0x000F000Fu, 0x43004300u), q, r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(q) : "r"(c), "r"(0x3f803f80u), "r"(0xc300c300u));
    asm("fma.rn.bf16x2 %0, %1, %2, %3;\n" : "=r"(r) : "r"(q), "r"(s2), "r"(b2));
    return r;
}

/* Shared-memory matrix descriptor, no swizzle: start address, LBO and SBO in 16-byte units. */
__device__ __forceinline__ u64 wg_desc(u32 saddr, u32 lbo, u32 sbo) {
    return (u64)((saddr & 0x3FFFFu) >> 4) | ((u64)(lbo >> 4) << 16) | ((u64)(sbo >> 4) << 32);
}

/* d[64x64] += A[64x16] (registers, bf16) * B[16x64] (shared, K-major, descriptor) */
__device__ __forceinline__ void wgmma_m64n64(float* d, const u32* a, u64 desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

/* bf16 scale and bias of a thread's two weight rows (so0, so1: their first group's index) for
   both 64-column halves of the k-tile at column k0: sb[h][r][0] scale, [1] bias of half h, row
   rb0 (r = 0) or rb1, one u16 load each. Groups are 2^lg columns. (One load per row and array of
   all the k-tile's groups measured 2% slower at 4K, session 26.) */
__device__ __forceinline__ void wg_load_sb(const void* sc, const void* bi, long long so0, long long so1, int k0, int t4,
                                           int lg, u32 (&sb)[2][2][2]) {
    const u16* ar[2] = {(const u16*)sc, (const u16*)bi};
    const long long so[2] = {so0, so1};
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int kg = (k0 + 64 * h + 16 * t4) >> lg;
#pragma unroll
        for (int r = 0; r < 2; r++)
#pragma unroll
            for (int a = 0; a < 2; a++) sb[h][r][a] = ar[a][so[r] + kg];
    }
}

/* One 64-column half h of a k-tile: the codes of rows rb0 and rb1 (cod: the stage's [128][64
   bytes]) dequantized into 4 k-steps x 4 A registers. */
__device__ __forceinline__ void wg_dq_half(u32 (&a)[4][4], const unsigned char* cod, int rb0, int rb1, int h, int t4,
                                           const u32 (&sb)[2][2][2]) {
    uint2 c0 = *(const uint2*)(cod + rb0 * 64 + h * 32 + t4 * 8);
    uint2 c1 = *(const uint2*)(cod + rb1 * 64 + h * 32 + t4 * 8);
    u32 s0v = sb[h][0][0] * 0x10001u, b0v = sb[h][0][1] * 0x10001u;
    u32 s1v = sb[h][1][0] * 0x10001u, b1v = sb[h][1][1] * 0x10001u;
#pragma unroll
    for (int s = 0; s < 4; s++) {
        u32 w0 = (s >> 1) ? c0.y : c0.x, w1 = (s >> 1) ? c1.y : c1.x;
        int sh = 8 * (s & 1);
        a[s][0] = wg_dq(w0, sh, s0v, b0v);
        a[s][1] = wg_dq(w1, sh, s1v, b1v);
        a[s][2] = wg_dq(w0, sh + 4, s0v, b0v);
        a[s][3] = wg_dq(w1, sh + 4, s1v, b1v);
    }
}

/* One k-tile of a warpgroup: per 64-column half, dequantize (wg_dq_half), then issue its 4*NB
   wgmmas on the inputs at descriptor dk (the stage's BT rows); commit and wait for all of them. */
template <int NB>
__device__ __forceinline__ void wg_ktile(float (&acc)[NB][32], const unsigned char* cod, int rb0, int rb1, int t4,
                                         const u32 (&sb)[2][2][2], u64 dk) {
    constexpr int BT = 64 * NB;
    u32 a[2][4][4];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        wg_dq_half(a[h], cod, rb0, rb1, h, t4, sb);
        wg_fence();
#pragma unroll
        for (int s = 0; s < 4; s++)
#pragma unroll
            for (int j = 0; j < NB; j++)
                wgmma_m64n64(acc[j], a[h][s], dk + (u32)(((2 * (4 * h + s) * (BT / 8) + 8 * j) * 128) >> 4));
    }
    wg_commit();
    wg_wait0();
}

/* acc[j][4i + v] is weight row nA (v < 2) or nB, input row m0 + 64j + 8i + 2t4 + (v & 1): stored
   to dst[m, n] (added to it when `add`) for m < m1, n < N. */
template <int NB>
__device__ __forceinline__ void wg_store(const float (&acc)[NB][32], float* dst, long long ldd, int m0, int m1, int nA,
                                         int nB, int N, int t4, bool add) {
#pragma unroll
    for (int j = 0; j < NB; j++)
#pragma unroll
        for (int i = 0; i < 8; i++)
#pragma unroll
            for (int v = 0; v < 4; v++) {
                int m = m0 + 64 * j + 8 * i + 2 * t4 + (v & 1), n = v < 2 ? nA : nB;
                if (m < m1 && n < N) {
                    float* p = dst + (long long)m * ldd + n;
                    *p = add ? *p + acc[j][4 * i + v] : acc[j][4 * i + v];
                }
            }
}

/* The tile's end (gemm_wg, gemm_wt): acc[j][4i + v] is weight row nA (v < 2) or nB, input row
   m0 + 64j + 8i + 2t4 + (v & 1). Without split K stored to y (added when `accumulate`); split K:
   the sums go to part[z][m][n], and the last of the ksplit blocks of this tile to take its ticket
   adds the parts in order z = 0..ksplit-1 into y (deterministic) and re-arms the ticket. */
template <int NB>
__device__ __forceinline__ void wg_finish(const float (&acc)[NB][32], float* y, long long ldy, int M, int N, int m0,
                                          int m1, int nA, int nB, int t4, int accumulate, int ksplit, float* part,
                                          unsigned* tickets) {
    float* dst = ksplit > 1 ? part + (long long)blockIdx.z * M * N : y;
    long long ldd = ksplit > 1 ? N : ldy;
    wg_store<NB>(acc, dst, ldd, m0, m1, nA, nB, N, t4, accumulate && ksplit == 1);
    if (ksplit == 1) return;
    __threadfence();
    __syncthreads();
    __shared__ unsigned last;
    unsigned* tk = tickets + blockIdx.y * gridDim.x + blockIdx.x;
    if (threadIdx.x == 0) {
        last = atomicAdd(tk, 1u) == (unsigned)ksplit - 1;
        if (last) *tk = 0;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
#pragma unroll
    for (int j = 0; j < NB; j++)
#pragma unroll
        for (int i = 0; i < 8; i++)
#pragma unroll
            for (int v = 0; v < 4; v++) {
                int m = m0 + 64 * j + 8 * i + 2 * t4 + (v & 1), n = v < 2 ? nA : nB;
                if (m < m1 && n < N) {
                    float t = 0.f;
                    for (int z = 0; z < ksplit; z++) t += __ldcg(part + ((long long)z * M + m) * N + n);
                    float* p = y + (long long)m * ldy + n;
                    *p = accumulate ? *p + t : t;
                }
            }
}
#endif

template <int NB>
__device__ __forceinline__ void gemm_wg_body(const void* w, const void* sc, const void* bi, int group, const u16* xb,
                                             const int* gather, int gdiv, float* y, long long ldy, int M, int N,
                                             int K, const int* tiles, int accumulate, int ksplit, float* part,
                                             unsigned* tickets) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int S = WG_STAGES, BT = 64 * NB, XB = BT * 256, STAGE = XB + 128 * 64, XC = BT * 16 / 256;
    extern __shared__ __align__(128) unsigned char wg_sm[];
    /* programmatic dependent launch: weights (codes, scales) are read before pdl_wait(), the
       inputs (and a grouped product's tile list and row map) after it */
    pdl_trigger();
    if (tiles) pdl_wait();
    GemmTile tl;
    if (!gemm_tile(tiles, M, BT, tl)) {
        pdl_wait();
        return;
    }
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
    int n0 = blockIdx.x * 128;
    u32 s0 = (u32)__cvta_generic_to_shared(wg_sm);
    /* this block's k-tiles: all, or part blockIdx.z of ksplit (plain products only) */
    int kb = (int)blockIdx.z * (K / 128) / ksplit, nk = ((int)blockIdx.z + 1) * (K / 128) / ksplit - kb;

    /* input copies: piece ci = tid + 256j is row xr0 + 16j, piece xq: row (ci & 7) + 8(ci >> 7),
       piece (ci >> 3) & 15, so a warp's 32 copies fill 4 whole core matrices (conflict-free) from
       64-byte runs of 8 rows; the 8 lanes of each quarter-warp phase then read 8 rows' same piece,
       8 sectors for 128 bytes (every input sector fetched twice; reading whole sectors per phase
       instead costs 2-way bank conflicts on the shared-memory side and measured 1.3% slower at 4K,
       session 26). Up to 128-row tiles the copies' addresses are kept in registers; the 256-row
       tiles (LEAN, plain products only: rows are not gathered) compute them per copy (the
       registers hold the accumulators). */
    constexpr bool LEAN = NB > 2;
    const int xr0 = (tid & 7) + 8 * (tid >> 7), xq = (tid >> 3) & 15;
    const u32 xd0 = (u32)((xq * (BT / 8) + (xr0 >> 3)) * 128 + (xr0 & 7) * 16); /* + 256j */
    const u16* xsrc[LEAN ? 1 : XC];
    int xbytes[LEAN ? 1 : XC];
    if constexpr (!LEAN) {
#pragma unroll
        for (int j = 0; j < XC; j++) {
            int m = tl.m0 + xr0 + 16 * j;
            bool ok = m < tl.m1;
            xsrc[j] = xb + (ok ? gemm_xrow(gather, gdiv, m) : 0) * (long long)K + xq * 8;
            xbytes[j] = ok ? 16 : 0;
        }
    }
    /* code copies: pieces tid and tid + 256 of the block's 128 rows x 4 16-byte pieces per k-tile
       (row p/4, piece p%4), so a warp copy is 8 whole 64-byte runs (two pieces of one sector per
       thread fetched each sector twice) */
    const unsigned char* wsrc[2];
#pragma unroll
    for (int j = 0; j < 2; j++)
        wsrc[j] = (const unsigned char*)w + ((long long)tl.e * N + min(n0 + (tid >> 2) + 64 * j, N - 1)) * (K / 2) +
                  (tid & 3) * 16;
    auto load_x = [&](int kt, int st) {
        u32 base = s0 + st * STAGE + xd0;
#pragma unroll
        for (int j = 0; j < XC; j++) {
            if constexpr (LEAN) {
                int m = tl.m0 + xr0 + 16 * j;
                bool ok = m < tl.m1;
                const u16* src = xb + (ok ? m : 0) * (long long)K + xq * 8; /* plain products: no gather */
                cp_async16(base + 256 * j, src + (kb + kt) * 128, ok ? 16 : 0);
            } else {
                cp_async16(base + 256 * j, xsrc[j] + (kb + kt) * 128, xbytes[j]);
            }
        }
    };
    auto load_w = [&](int kt, int st) {
        u32 base = s0 + st * STAGE + XB + tid * 16;
        cp_async16(base, wsrc[0] + (kb + kt) * 64, 16);
        cp_async16(base + 4096, wsrc[1] + (kb + kt) * 64, 16);
    };

    /* this thread's two weight rows (block-relative) and their global rows (clamped past N: they
       compute values that are never stored) */
    int rb0 = (warp >> 2) * 64 + (warp & 3) * 16 + g, rb1 = rb0 + 8;
    long long wr0 = (long long)tl.e * N + min(n0 + rb0, N - 1), wr1 = (long long)tl.e * N + min(n0 + rb1, N - 1);
    /* bf16 scale and bias of both rows for both 64-column halves of a k-tile, as loaded:
       sb[h][r][0] scale, [1] bias of half h, row rb0 (r = 0) or rb1. Two sets: the loop runs two
       k-tiles per trip, each loading the next k-tile's set while using its own (converted where
       used, so no instruction waits for a load issued in the same k-tile). */
    int lg = __ffs(group) - 1; /* group is a power of two (no division in the loop) */
    long long so0 = wr0 * (K >> lg), so1 = wr1 * (K >> lg);
    auto load_sb = [&](int kt, u32 (&sb)[2][2][2]) { wg_load_sb(sc, bi, so0, so1, (kb + kt) * 128, t4, lg, sb); };

    float acc[NB][32];
#pragma unroll
    for (int j = 0; j < NB; j++)
#pragma unroll
        for (int i = 0; i < 32; i++) acc[j][i] = 0.f;

    /* the first stages' codes and scales, then (plain products: after the wait) their inputs;
       cp.async group st holds stage st's inputs and, in group 0, every prologue stage's codes */
    u32 sbA[2][2][2], sbB[2][2][2];
#pragma unroll
    for (int st = 0; st < S - 1; st++)
        if (st < nk) load_w(st, st);
    load_sb(0, sbA);
    if (!tiles) pdl_wait();
#pragma unroll
    for (int st = 0; st < S - 1; st++) {
        if (st < nk) load_x(st, st);
        cp_async_commit();
    }
    /* the B descriptor of stage 0, piece 0, rows 0..: a k-step's and stage's start is this plus
       their byte offset / 16 (the start field, 14 bits, holds every shared address) */
    const u64 dbase = wg_desc(s0, BT / 8 * 128, 128);
    auto step = [&](int kt, const u32 (&sb)[2][2][2], u32 (&nsb)[2][2][2]) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(S - 2) : "memory");
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); /* cp.async writes -> wgmma reads */
        __syncthreads();
        /* the stage read one k-tile ago: every warpgroup waited for its wgmmas before the barrier */
        if (kt + S - 1 < nk) {
            load_x(kt + S - 1, (kt + S - 1) % S);
            load_w(kt + S - 1, (kt + S - 1) % S);
        }
        cp_async_commit();
        if (kt + 1 < nk) load_sb(kt + 1, nsb);
        u64 dk = dbase + (u32)(((kt % S) * STAGE) >> 4); /* this stage's B descriptor (start field) */
        wg_ktile<NB>(acc, wg_sm + (kt % S) * STAGE + XB, rb0, rb1, t4, sb, dk);
    };
    for (int kt = 0; kt < nk; kt += 2) {
        step(kt, sbA, sbB);
        if (kt + 1 < nk) step(kt + 1, sbB, sbA);
    }

    wg_finish<NB>(acc, y, ldy, M, N, tl.m0, tl.m1, n0 + rb0, n0 + rb1, t4, accumulate, ksplit, part, tickets);
#endif
}

#define GEMM_WG(NAME, NB, MINB)                                                                               \
    extern "C" __global__ void __launch_bounds__(256, MINB) NAME(GemmParams_fields) {                        \
        GEMM_SHAPE;                                                                                           \
        gemm_wg_body<NB>(w, sc, bi, group, (const u16*)x, gather, gdiv, y, ldy, M, N, K, tiles, accumulate,   \
                         ksplit, part, tickets);                                                              \
    }
GEMM_WG(gemm_wg64, 1, 2)
GEMM_WG(gemm_wg128, 2, 1)
GEMM_WG(gemm_wg256, 4, 1)
