/*
 * gemm_skinny.cu: weight products for few rows per matrix (the batched decode step's projections
 * and experts, the routed experts of short prompts), with the weights on the tensor cores' M side
 * and the rows ("tokens") on the N side, so each weight is read from HBM and dequantized once per
 * block whatever the number of tokens, and the multiply-adds run as mma.
 *
 *   Y[m, n] (+)= sum_k X[xr(m), k] * W[e*N + n, k]
 *
 * Same contract as gemm.cu. Plain (tiles == 0): block x covers row tile x / ceil(M/TN) and rows
 * m in [TN*(x % ceil(M/TN)), +TN) (TN = 8·NT, the kernel's template width), so the blocks that
 * share a weight tile run next to each other and meet in L2. Grouped: the moe_align tile list
 * as in gemm.cu (xr(m) = gather[m] / gdiv); a tile's rows run in sub-tiles of TN, each over all K.
 *
 * Weights: MLX affine 4-bit or 8-bit (W = s*q + b per group of `group` columns, group a power of
 * two from 16), or dense bf16 (ty 2). Requires K % 64 == 0, X rows 16-byte aligned.
 *
 * Math: mma.sync.m16n8k16 bf16 x bf16 -> fp32. Sixteen weight rows are the A tile (m16), eight
 * tokens the B tile (n8). The k order inside each 64-column chunk is permuted identically for A
 * and B (a dot product does not care), so that thread (g = lane/4, t = lane%4) owns physical
 * columns 16t .. 16t+15 of its rows g and g+8 (one 8-byte load of 4-bit codes per row) and, in k
 * step s (0..3), its fragment slots {2t, 2t+1} hold columns 16t + 8(s>>1) + 2(s&1) + {0, 4} and
 * slots {2t+8, 2t+9} the same + 1. The 4-bit codes of such a pair sit at nibbles a and a+4 of one
 * word, so (w >> 4a) & 0x000F000F | 0x43004300 is the bf16 pair (128+q_a, 128+q_{a+4}); one
 * bf16x2 FMA removes the 128 (exact) and one more gives bf16(s*q + b) with a single rounding.
 * 8-bit codes go through fp32 (exact) and one cvt.rn.bf16x2; bf16 weights are paired by PRMT.
 *
 * X staging: the sub-tile's TN x K inputs, rounded to bf16, in shared memory in fragment order:
 * uint4 slot ((c*NT + j)*2 + h)*32 + (4*(n%8) + t) holds, for token n = 8j + n%8 and columns
 * k0 = 64c + 16t + 8h, the pairs (x[k0+e], x[k0+e+4]) for e = 0..3: one conflict-free 16-byte
 * shared load per thread, token tile and half chunk. Only the sub-tile's real tokens are staged:
 * token n's column of the B tile meets only column n of the output, which is not written back
 * for n >= the real count, so stale shared memory there is harmless.
 *
 * Launch: block 256 threads = 8 warps as 8/kq row groups (32 rows each: two m16 tiles) x kq
 * parts of K (kq = 1, 2 or 4 contiguous ranges of 64-column chunks); block tile bn = 256/kq
 * weight rows. Each warp keeps D chunks of weight codes and scales in flight in registers (a
 * ring refilled as each chunk is used; 4-bit scales and biases stay raw 16-bit values until
 * their chunk is used, since converting them at the load would wait for it there). D for
 * 4-bit codes: 2 at NT = 1 (gemm_skinny8_q4w: three blocks per SM within 80 registers), 1 at
 * NT = 2 (a second chunk spills at 128 registers), 3 at NT = 4 (one block per SM, about 220
 * registers, since its 128 KB of staged inputs at K = 2048 allow no second one); 8-bit: 2 at
 * NT = 1, else 1; bf16: 1. The kq K-part partials are added in
 * a fixed order through shared memory (deterministic).
 * A plain product whose grid would leave most SMs idle also splits K over ksplit blocks
 * (grid.y): each stages and reads only its range of chunks, writes its sums to part[s][m][n],
 * and the last of the ksplit blocks of a (row tile, sub-tile) to take a ticket (tickets[x],
 * zero between launches) adds the parts in order s = 0..ksplit-1 into y: deterministic.
 * grid (ceil(N/bn) * ceil(M/TN), ksplit) plain, (ceil(N/bn), tiles) grouped. Dynamic shared memory
 * max(TN*K*2, 256*(TN+1)*4) bytes.
 */

__device__ __forceinline__ u32 bf16x2_f32(float lo, float hi) {
    u32 d;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
    return d;
}
__device__ __forceinline__ u32 fma_bf16x2(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 d;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
    return d;
}
__device__ __forceinline__ void mma_bf16(float* c, const u32* a, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* (a & b) | c in one LOP3 (the compiler emits an AND and an OR for the two constants) */
__device__ __forceinline__ u32 lop3_and_or(u32 a, u32 b, u32 c) {
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

/* Code words per row and chunk of one thread (16 columns), and the ring depth. */
template <int BITS, int NT, int MINB>
struct SkFmt {
    static constexpr int QW = BITS == 4 ? 2 : BITS == 8 ? 4 : 8;
    static constexpr int D = BITS == 4 ? (MINB == 1 ? 3 : NT == 1 ? 2 : 1) : BITS == 8 && NT == 1 ? 2 : 1;
};

/* The bf16 pair of weights (columns base+r, base+r+4) of one row for k step s, r in {0, 1}. */
template <int BITS, bool LOP>
__device__ __forceinline__ u32 sk_pair(const u32* q, int s, int r, u32 sp, u32 bp, float sf, float bf) {
    if (BITS == 4) {
        u32 w = q[s >> 1];
        int a = 2 * (s & 1) + r;
        /* one LOP3 where registers allow its two constants (not at three blocks per SM) */
        u32 code = LOP ? lop3_and_or(w >> (4 * a), 0x000F000Fu, 0x43004300u)
                       : ((w >> (4 * a)) & 0x000F000Fu) | 0x43004300u;
        u32 qv = fma_bf16x2(code, 0x3F803F80u, 0xC300C300u); /* code*1 - 128 = q, exact */
        return fma_bf16x2(qv, sp, bp);
    } else if (BITS == 8) {
        int b = 2 * (s & 1) + r;
        u32 w0 = q[2 * (s >> 1)], w1 = q[2 * (s >> 1) + 1];
        float q0 = __uint_as_float(prmt(w0, 0x4B000000u, 0x7440u + b)) - 8388608.f;
        float q1 = __uint_as_float(prmt(w1, 0x4B000000u, 0x7440u + b)) - 8388608.f;
        return bf16x2_f32(fmaf(sf, q0, bf), fmaf(sf, q1, bf));
    } else {
        int wi = 4 * (s >> 1) + (s & 1);
        return prmt(q[wi], q[wi + 2], r ? 0x7632u : 0x5410u);
    }
}

template <int NT, int BITS, int MINB>
__device__ __forceinline__ void gemm_skinny_body(const void* w, const void* sc, const void* bi, int group, int ty,
                                                 const float* x, long long ldx, const int* gather, int gdiv,
                                                 float* y, long long ldy, int M, int N, int K, const int* tiles,
                                                 int accumulate, int kq, int ksplit, float* part,
                                                 unsigned* tickets, uint4* xs) {
    constexpr int TN = 8 * NT, QW = SkFmt<BITS, NT, MINB>::QW, D = SkFmt<BITS, NT, MINB>::D;
    GemmTile tl;
    /* plain products: one block per (row tile, sub-tile of TN rows), the sub-tiles of a row tile
       adjacent in launch order (they share its weights through L2); grouped: (row tile, tile) */
    int bx = blockIdx.x;
    pdl_trigger();
    if (!tiles) {
        int gy = (M + TN - 1) / TN;
        bx = blockIdx.x / gy;
        tl.e = 0;
        tl.m0 = (blockIdx.x - bx * gy) * TN;
        tl.m1 = min(M, tl.m0 + TN);
    } else {
        pdl_wait(); /* the tile list is an activation */
        if (!gemm_tile(tiles, M, 64, tl)) return;
    }
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    int nrh = 8 / kq, bn = 32 * nrh; /* row groups of 32 rows; block tile bn rows */
    int rh = warp % nrh, ks = warp / nrh;
    int n0 = bx * bn;
    /* this block's part (blockIdx.y of ksplit, plain products only) and this warp's part (of kq)
       of the K chunks */
    int nch = K >> 6, sp = tiles ? 0 : blockIdx.y;
    int b_beg = sp * nch / ksplit, b_len = (sp + 1) * nch / ksplit - b_beg;
    int c_beg = b_beg + ks * b_len / kq, c_end = b_beg + (ks + 1) * b_len / kq;
    int words = BITS == 4 ? K / 8 : BITS == 8 ? K / 4 : K / 2;

    /* this thread's 4 weight rows: n0 + 32 rh + 16 mi + g + 8 h (mi, h in {0, 1}; clamped into
       the matrix); their code pointers and scale indices at the warp's first chunk, so a chunk's
       loads cost one add each (the group is a power of two: gsh = log2(group)) */
    int wbase = n0 + 32 * rh + g, gsh = BITS ? __ffs(group) - 1 : 0, col0 = 64 * c_beg + 16 * t;
    /* row indices in 32 bits: code words and scales of a matrix stack below 2^32 elements */
    unsigned wr[2][2];
#pragma unroll
    for (int mi = 0; mi < 2; mi++)
#pragma unroll
        for (int h = 0; h < 2; h++) wr[mi][h] = (unsigned)tl.e * N + min(wbase + 16 * mi + 8 * h, N - 1);
    unsigned kg = K >> gsh;

    u32 qr[D][2][2][QW];
    /* the scale and bias as loaded (raw bits, converted where used: a conversion next to the
       load would make the warp wait for it there, and the ring would not hide its latency) */
    u32 sr[D][2][2], br[D][2][2];
    auto load = [&](int slot, int c) {
        int cc = col0 + 64 * (c - c_beg), gc = cc >> gsh, wc = cc * QW / 16;
#pragma unroll
        for (int mi = 0; mi < 2; mi++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const u32* p = (const u32*)w + (wr[mi][h] * (unsigned)words + wc);
                if (QW == 2) {
                    uint2 v = *(const uint2*)p;
                    qr[slot][mi][h][0] = v.x;
                    qr[slot][mi][h][QW > 1 ? 1 : 0] = v.y;
                } else {
#pragma unroll
                    for (int u = 0; u < QW / 4; u++) {
                        uint4 v = ((const uint4*)p)[u];
                        qr[slot][mi][h][4 * u] = v.x;
                        qr[slot][mi][h][4 * u + 1] = v.y;
                        qr[slot][mi][h][4 * u + 2] = v.z;
                        qr[slot][mi][h][4 * u + 3] = v.w;
                    }
                }
                unsigned gi = wr[mi][h] * kg + gc;
                if (BITS == 4 && ty != TY_BF16) {
                    /* f16/f32 scales: rounded to bf16 here (this load waits; bf16 ones do not) */
                    sr[slot][mi][h] = bf16x2_f32(load_elem(sc, gi, ty), 0.f) & 0xFFFFu;
                    br[slot][mi][h] = bf16x2_f32(load_elem(bi, gi, ty), 0.f) & 0xFFFFu;
                } else if (BITS == 4) {
                    sr[slot][mi][h] = ((const u16*)sc)[gi];
                    br[slot][mi][h] = ((const u16*)bi)[gi];
                } else if (BITS == 8) {
                    /* fp32 here (the registers of 8-bit codes leave no room for raw pairs) */
                    sr[slot][mi][h] = __float_as_uint(load_elem(sc, gi, ty));
                    br[slot][mi][h] = __float_as_uint(load_elem(bi, gi, ty));
                }
            }
    };

    /* The ring's first D chunks do not depend on the inputs: they are requested before the
       staging (and, for a plain product, before waiting on the previous kernel), so their DRAM
       latency overlaps it. */
    auto prime = [&]() {
#pragma unroll
        for (int i = 0; i < D; i++)
            if (c_beg + i < c_end) load(i, c_beg + i);
    };
    prime();
    if (!tiles) pdl_wait();
    /* each token's input row offset, read once per sub-tile */
    __shared__ long long sk_row[TN];
    int kb8 = b_len * 8, kbase = 64 * b_beg;
    for (int mb = tl.m0; mb < tl.m1; mb += TN) {
        int ntok = min(TN, tl.m1 - mb);
        if (mb != tl.m0) prime();
        /* stage the sub-tile's inputs (the previous sub-tile's reduction is done with xs; its
           staging, the last reader of sk_row, is behind the barrier before that reduction).
           Only the ntok real tokens: a token's column of the MMA's B tile meets only its own
           column of the output, so what the others hold is never read back. */
        if (tid < ntok) sk_row[tid] = gemm_xrow(gather, gdiv, mb + tid) * ldx;
        __syncthreads();
        /* tokens per pass, their loads issued before any conversion (one at NT = 1: the 128
           registers are full there, and routed experts rarely have more than two tokens) */
        constexpr int SU = NT == 1 ? 1 : 2;
        for (int k8 = tid; k8 < kb8; k8 += 256) {
            int k0 = kbase + 8 * k8;
            int c = k0 >> 6, tt = (k0 >> 4) & 3, hh = (k0 >> 3) & 1;
            for (int nb = 0; nb < ntok; nb += SU) {
                float4 a[SU], b[SU];
#pragma unroll
                for (int i = 0; i < SU; i++)
                    if (nb + i < ntok) {
                        const float4* xp = (const float4*)(x + sk_row[nb + i] + k0);
                        a[i] = xp[0];
                        b[i] = xp[1];
                    }
#pragma unroll
                for (int i = 0; i < SU; i++) {
                    int n = nb + i;
                    if (n < ntok)
                        xs[((c * NT + (n >> 3)) * 2 + hh) * 32 + 4 * (n & 7) + tt] =
                            make_uint4(bf16x2_f32(a[i].x, b[i].x), bf16x2_f32(a[i].y, b[i].y),
                                       bf16x2_f32(a[i].z, b[i].z), bf16x2_f32(a[i].w, b[i].w));
                }
            }
        }
        __syncthreads();

        float acc[2][NT][4];
#pragma unroll
        for (int mi = 0; mi < 2; mi++)
#pragma unroll
            for (int j = 0; j < NT; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc[mi][j][e] = 0.f;

        for (int cb = c_beg; cb < c_end; cb += D) {
#pragma unroll
            for (int i = 0; i < D; i++) {
                int c = cb + i;
                if (c < c_end) {
                    /* 4-bit: scale and bias as bf16 pairs (what the bf16x2 FMAs take); 8-bit: fp32 */
                    u32 sp[2][2] = {{0, 0}, {0, 0}}, bp[2][2] = {{0, 0}, {0, 0}};
                    float sf[2][2] = {{0, 0}, {0, 0}}, bf[2][2] = {{0, 0}, {0, 0}};
#pragma unroll
                    for (int mi = 0; mi < 2; mi++)
#pragma unroll
                        for (int h = 0; h < 2; h++) {
                            u32 rs = sr[i][mi][h], rb = br[i][mi][h];
                            if (BITS == 4) {
                                sp[mi][h] = prmt(rs, 0, 0x1010u);
                                bp[mi][h] = prmt(rb, 0, 0x1010u);
                            } else if (BITS == 8) {
                                sf[mi][h] = __uint_as_float(rs);
                                bf[mi][h] = __uint_as_float(rb);
                            }
                        }
#pragma unroll
                    for (int hh = 0; hh < 2; hh++) {
                        uint4 xv[NT];
#pragma unroll
                        for (int j = 0; j < NT; j++) xv[j] = xs[((c * NT + j) * 2 + hh) * 32 + lane];
#pragma unroll
                        for (int s1 = 0; s1 < 2; s1++) {
                            int s = 2 * hh + s1;
                            u32 af[2][4];
#pragma unroll
                            for (int mi = 0; mi < 2; mi++)
#pragma unroll
                                for (int h = 0; h < 2; h++)
#pragma unroll
                                    for (int r = 0; r < 2; r++)
                                        af[mi][h + 2 * r] = sk_pair<BITS, (MINB <= 2)>(
                                            qr[i][mi][h], s, r, sp[mi][h], bp[mi][h], sf[mi][h], bf[mi][h]);
#pragma unroll
                            for (int j = 0; j < NT; j++) {
                                u32 b0 = s1 ? xv[j].z : xv[j].x, b1 = s1 ? xv[j].w : xv[j].y;
#pragma unroll
                                for (int mi = 0; mi < 2; mi++) mma_bf16(acc[mi][j], af[mi], b0, b1);
                            }
                        }
                    }
                    if (c + D < c_end) load(i, c + D);
                }
            }
        }

        /* the kq parts of K, added in order; thread tid < bn owns output row n0 + tid */
        __syncthreads();
        float* red = (float*)xs;
        constexpr int RS = TN + 1;
#pragma unroll
        for (int mi = 0; mi < 2; mi++)
#pragma unroll
            for (int j = 0; j < NT; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    int rr = 32 * rh + 16 * mi + g + 8 * (e >> 1), col = 8 * j + 2 * t + (e & 1);
                    red[(ks * bn + rr) * RS + col] = acc[mi][j][e];
                }
        __syncthreads();
        int rr = tid, n = n0 + rr;
        bool mine = rr < bn && n < N;
        auto sum = [&](int col) {
            float v = red[rr * RS + col];
            for (int q = 1; q < kq; q++) v += red[(q * bn + rr) * RS + col];
            return v;
        };
        if (ksplit == 1) {
            if (mine)
                for (int col = 0; col < ntok; col++) {
                    float* o = y + (long long)(mb + col) * ldy + n;
                    float v = sum(col);
                    *o = accumulate ? *o + v : v;
                }
            continue;
        }
        /* split K over blocks: this block's sums go to part[sp][m][n]; the last of the ksplit
           blocks of this (row tile, sub-tile) to arrive adds the ksplit parts in order into y
           (deterministic) and re-arms the ticket for the next launch */
        if (mine)
            for (int col = 0; col < ntok; col++) part[((long long)sp * M + mb + col) * N + n] = sum(col);
        __threadfence();
        __syncthreads();
        __shared__ unsigned last;
        unsigned* tk = tickets + blockIdx.x;
        if (tid == 0) {
            last = atomicAdd(tk, 1u) == (unsigned)ksplit - 1;
            if (last) *tk = 0;
        }
        __syncthreads();
        if (last) {
            __threadfence();
            if (mine)
                for (int col = 0; col < ntok; col++) {
                    float v = 0.f;
                    for (int q = 0; q < ksplit; q++) v += __ldcg(part + ((long long)q * M + mb + col) * N + n);
                    float* o = y + (long long)(mb + col) * ldy + n;
                    *o = accumulate ? *o + v : v;
                }
        }
    }
}

/* One kernel per (tokens per pass, weight format): the three formats' bodies in one function
   would share one register allocation (and spill at the 128-register bound). */
#define GEMM_SKINNY(NAME, NT, BITS, MINB)                                                                   \
    extern "C" __global__ void __launch_bounds__(256, MINB)                                                 \
        NAME(GemmParams_fields) {                                                                           \
        extern __shared__ uint4 sk_smem[];                                                                  \
        gemm_skinny_body<NT, BITS, MINB>(w, sc, bi, group, ty, x, ldx, gather, gdiv, y, ldy, m, n, k, tiles, \
                                         accumulate, kq, ksplit, part, tickets, sk_smem);                   \
    }

GEMM_SKINNY(gemm_skinny8_q4, 1, 4, 2)
GEMM_SKINNY(gemm_skinny16_q4, 2, 4, 2)
GEMM_SKINNY(gemm_skinny32_q4, 4, 4, 1)
GEMM_SKINNY(gemm_skinny8_q8, 1, 8, 2)
GEMM_SKINNY(gemm_skinny16_q8, 2, 8, 2)
GEMM_SKINNY(gemm_skinny32_q8, 4, 8, 1)
GEMM_SKINNY(gemm_skinny8_q4w, 1, 4, 3)
GEMM_SKINNY(gemm_skinny8_bf16, 1, 0, 2)
GEMM_SKINNY(gemm_skinny16_bf16, 2, 0, 2)
GEMM_SKINNY(gemm_skinny32_bf16, 4, 0, 1)
