/*
 * attention_dec.cu: long-context decode attention on tensor cores, for 8 query heads per KV head
 * over a bf16 cache (attn_decode_tc{64,128,256}: attn_decode_gqa8_bf16's arguments, grid and
 * partials, so attn_combine merges either).
 *
 * Math, per KV head h and split s (positions [lo, hi)), for its G = 8 query heads g:
 *   s2[g, p] = q_g . k_p * scale * log2(e) (base-2 logits), running max m and sum l per head,
 *   o[g] = sum_p 2^(s2 - m) v_p; written as part[h*8 + g, s] = (m * ln 2, l, o[0..D)).
 *   The products are transposed so that the 8 heads are the mma's N = 8 (nothing padded):
 *     S^T (16 keys x 8 heads) = K tile (16 x D) . Q^T (D x 8)    A: K rows by ldmatrix, B: Q in registers
 *     O^T (D x 8) += V tile^T (D x 16) . P^T (16 keys x 8)       A: V by ldmatrix.trans, B: P via shared
 *   Q and P are each split into bf16 hi + lo parts (two mma each) so that the products keep about
 *   16 mantissa bits, as the fp32-FMA kernel does with its fp32 query; K and V are exact in bf16.
 *   Accumulation in fp32 (mma), softmax in fp32.
 * Layouts: kc, vc [capacity, H_kv, D] bf16; q [H_q, D] fp32 (after norm and RoPE); part
 *   [H_q, S, D + 2] fp32; batched rows (kvt) as in attention.cu.
 * Geometry: grid (H_kv, S, rows), block 128 = 4 warps; split s covers chunk = max(64, ceil(L/S))
 *   positions, warp w the 16-key tiles w, w + 4, ... of it. Each warp streams its tiles through
 *   its own DT_NST-stage ring of K and V tiles (cp.async, 16 x D bf16 each; a row's 16-byte
 *   chunk c stored at c ^ (row & 7), so the ldmatrix reads of 8 rows hit 8 different bank
 *   groups). Dynamic shared memory: attn_dec_smem(D, false) bytes. The 4 warps merge through shared
 *   memory in a fixed order (bit-identical replays).
 * Early form (early != 0, one sequence over a bf16 cache; LILY_CUDA_ATTN_EARLY=1): the first
 *   DT_NST - 1 tiles of each warp are requested before pdl_wait, so the cache streams in while
 *   attn_prep (and what runs before it) finishes. Positions < pos were written by earlier steps
 *   and pos by the previous step's sampler (or the host), complete before this step's graph
 *   starts (without graphs: before the first MoE launch between them, whose blocks fill every
 *   SM until their own wait returns), as gdn_step_par's early state loads assume; but row pos
 *   is attn_prep's: it is left out of those
 *   copies (zero-filled) and its warp stores it into the stage from the L2 after the wait, before
 *   the stage is read. Nothing is written before the wait. The same values as the plain form.
 * Fold form (attn_decode_tc{D}_fold, AttnDecFoldParams; LILY_CUDA_COMBINE=fold): attn_combine's
 *   merge in this launch's tail (dec_fold), one dependency fewer a layer. One sequence, a bf16
 *   cache and a grid resident at once (H_kv * S <= SMs: the host checks), since the mergers wait
 *   for the other blocks of their KV head. Arrival: after its partial (or its empty mark) a
 *   block adds 1 to its KV head's u64 counter ctr[kvh], a fence before (its partial is visible
 *   to whoever sees the add). The counter holds (epoch << 32) + this launch's arrivals: the block
 *   that read S - 1 arrivals is the last and moves the epoch (adds 2^32 - S), so launches of any
 *   S share it without a reset (launches on it are ordered by their PDL waits). The last
 *   NM = min(S, SL) blocks to arrive merge the KV head's G * D outputs in SL = G * D / 32 slices
 *   of 32 dims of one head (merger m = arrival - (S - NM): slices m, m + NM, ...); each but the
 *   last waits (thread 0 polling, then acquire) for the epoch to move. A slice is attn_combine's
 *   arithmetic: M = max_s M_s, w_s = e^{M_s - M} (0 for an empty split), den = sum_s l_s w_s,
 *   out = sum_s w_s o_s / den * sigmoid(gate); warp w sums splits w, w + 4, ..., then the 4
 *   warps' sums are added in warp order (bit-identical replays).
 * fp8 cache (attn_decode_tc{D}_fp8; layout in attention.cu): the ring (2 stages) holds the raw
 *   tiles (16 x D bytes each, unswizzled) and their rows' 16 scales (4-byte cp.async). Before the
 *   scores the warp widens the K tile's e4m3 values to fp16 (one cvt per pair, exact) into one
 *   tile in the layout above, and before the output the V tile over it. The products run on fp16
 *   mma: Q and P split into fp16 hi + lo, each key's K scale applied to its row of S^T after the
 *   product, its V scale folded into its P weight (the running sum l takes the unscaled
 *   weights). A block takes attn_dec_smem(D, true) = 102 KB at D = 256, so two share an SM (the
 *   plan gives fp8 up to twice the splits). Measured: widening with the scale into bf16 (6
 *   instructions a pair) made the kernel slower than the bf16 one at 128K; this form matches it
 *   while reading half the bytes (it is bound by its per-tile work, not by memory).
 */
#define DT_NST 3
#define DT_PS 24 /* row stride (u16) of a warp's P buffer [8 heads][16 keys]: conflict-free reads */

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}


/* (hi, lo) bf16 pair of x: hi = bf16(x), lo = bf16(x - hi). */
__device__ __forceinline__ void split_bf16(float x, u32& hi, u32& lo) {
    hi = bf16_bits(x);
    lo = bf16_bits(x - bf16_to_f32((u16)hi));
}
/* The same in fp16 (F16) or bf16. */
template <bool F16> __device__ __forceinline__ void split16(float x, u32& hi, u32& lo) {
    if constexpr (F16) {
        unsigned short h, l;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
        float hf;
        asm("cvt.f32.f16 %0, %1;" : "=f"(hf) : "h"(h));
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(l) : "f"(x - hf));
        hi = h;
        lo = l;
    } else {
        split_bf16(x, hi, lo);
    }
}
/* mma.sync m16n8k16 on fp16 (F16) or bf16 inputs, fp32 accumulation. */
template <bool F16>
__device__ __forceinline__ void mma16(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    if constexpr (F16) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    } else {
        mma_bf16(c, a0, a1, a2, a3, b0, b1);
    }
}
/* 16 e4m3 values as 16 fp16 (exact; sm_89+, else zeros): o[0] the first 8, o[1] the rest. */
__device__ __forceinline__ void f8x16_to_f16(uint4 v, uint4 (&o)[2]) {
    u32 w[4] = {v.x, v.y, v.z, v.w}, r[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
#if __CUDA_ARCH__ >= 890
        unsigned short pair = (unsigned short)(w[i >> 1] >> (16 * (i & 1)));
        asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r[i]) : "h"(pair));
#else
        r[i] = 0u;
#endif
    }
    o[0] = make_uint4(r[0], r[1], r[2], r[3]);
    o[1] = make_uint4(r[4], r[5], r[6], r[7]);
}

/* Byte size of one fp8 ring stage of a warp: K and V tiles [16][D] bytes, then 2 x 16 f32 scales. */
template <int D> __device__ __forceinline__ constexpr int dt_f8_stage() { return 2 * 16 * D + 128; }

__device__ __forceinline__ void cp_async4(u32 dst, const void* src, int bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

/* The fold form's outputs (see the header): the gate rows (per head [q | gate], stride 2D), the
   merged output [H_q, D] and the KV heads' arrival counters. */
struct DecFold {
    const float* qg;
    float* out;
    int gated;
    u64* ctr;
};
#define FOLD_REGS 20 /* a warp's first splits' o values loaded in one round */
__device__ __forceinline__ u64 ld_acquire_u64(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
/* The tail of block (kvh, any split) of S splits: arrive, and merge where it is among the last;
   sm: 4,640 bytes of the block's shared memory (free by now). */
template <int D>
__device__ __forceinline__ void dec_fold(const float* part, const DecFold& f, int kvh, int S, float* sm) {
    constexpr int G = 8, SL = G * D / 32;
    const int NM = min(S, SL);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float* w = sm;           /* [S <= 1024] the splits' weights */
    float* red = w + 1024;   /* [4] maxima, [4] sums */
    float* accs = red + 8;   /* [4][32] the warps' sums */
    u64* tk = (u64*)(accs + 128);
    __syncthreads(); /* the block's partial is stored and its shared memory free */
    if (threadIdx.x == 0) {
        u64* c = f.ctr + kvh;
        __threadfence();
        const u64 old = atomicAdd((unsigned long long*)c, 1ull);
        if ((u32)old == (u32)(S - 1)) { /* the last: every other partial is visible */
            atomicAdd((unsigned long long*)c, (1ull << 32) - (u64)S);
            __threadfence();
        } else if ((int)(u32)old >= S - NM) { /* a merger: wait for the last */
            while ((ld_acquire_u64(c) >> 32) == (old >> 32)) {
            }
        }
        *tk = old;
    }
    __syncthreads();
    const int m = (int)(u32)*tk - (S - NM);
    if (m < 0) return;
    for (int sl = m; sl < SL; sl += NM) {
        const int g = sl / (D / 32), d = (sl - g * (D / 32)) * 32 + lane, h = kvh * G + g;
        const float* ph = part + (long long)h * S * (D + 2);
        float mt[8], lt[8], ov[FOLD_REGS], gt = 0.f;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int s = threadIdx.x + 128 * i;
            mt[i] = s < S ? __ldcg(ph + (long long)s * (D + 2)) : -INFINITY;
            lt[i] = s < S ? __ldcg(ph + (long long)s * (D + 2) + 1) : 0.f;
        }
#pragma unroll
        for (int j = 0; j < FOLD_REGS; j++) {
            const int s = warp + 4 * j;
            ov[j] = s < S ? __ldcg(ph + (long long)s * (D + 2) + 2 + d) : 0.f;
        }
        if (f.gated && warp == 0) gt = f.qg[(long long)h * 2 * D + D + d];
        float mx = -INFINITY;
#pragma unroll
        for (int i = 0; i < 8; i++) mx = fmaxf(mx, mt[i]);
        mx = warp_max(mx);
        if (lane == 0) red[warp] = mx;
        __syncthreads();
        const float M = fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3]));
        float dl = 0.f;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            const int s = threadIdx.x + 128 * i;
            if (s < S) {
                const float e = mt[i] == -INFINITY ? 0.f : expf(mt[i] - M);
                w[s] = e;
                dl += e != 0.f ? e * lt[i] : 0.f;
            }
        }
        dl = warp_sum(dl);
        if (lane == 0) red[4 + warp] = dl;
        __syncthreads(); /* also publishes w[] */
        const float den = (red[4] + red[5]) + (red[6] + red[7]);
        float acc = 0.f;
        int s = warp;
#pragma unroll
        for (int j = 0; j < FOLD_REGS; j++, s += 4) {
            if (s < S) {
                const float ws = w[s];
                acc += ws != 0.f ? ov[j] * ws : 0.f;
            }
        }
        for (; s < S; s += 4) {
            const float v = __ldcg(ph + (long long)s * (D + 2) + 2 + d), ws = w[s];
            acc += ws != 0.f ? v * ws : 0.f;
        }
        accs[warp * 32 + lane] = acc;
        __syncthreads();
        if (warp == 0) {
            float r = ((accs[lane] + accs[32 + lane]) + accs[64 + lane] + accs[96 + lane]) / den;
            if (f.gated) r *= sigmoid_f(gt);
            f.out[(long long)h * D + d] = r;
        }
        __syncthreads(); /* w, red and accs are the next slice's */
    }
}

template <int D, bool F8>
__device__ __forceinline__ void attn_dec_tc(const float* q, const void* kc_, const void* vc_, float* part, int hkv,
                                            const int* pos_p, float scale, const unsigned long long* kvt,
                                            int early_, const DecFold* fo = nullptr) {
    constexpr int G = 8, KT = 16, CH = D / 8, TILE = KT * D, NK = D / 16, F8ST = dt_f8_stage<D>();
    extern __shared__ __align__(16) unsigned char dsm[];
    /* early (one sequence, bf16 cache): the first NST - 1 tiles are requested before pdl_wait:
       positions < pos were written by earlier steps (pos itself by the previous step's sampler),
       so only row pos (attn_prep's, this step) is left out and read after the wait; nothing is
       written before it */
    const bool early = early_ && !F8 && !kvt;
    pdl_trigger();
    if (!early) pdl_wait();
    int lo, hi, newest = -1; /* early: row pos, read after the wait */
    const unsigned char *kc = (const unsigned char*)kc_, *vc = (const unsigned char*)vc_; /* bytes */
    if (early) {
        newest = pos_p[0];
        if (!split_range(newest + 1, lo, hi)) { /* empty: its partials marked after the wait */
            pdl_wait();
            mark_empty_split(part, G, D);
            if (fo) dec_fold<D>(part, *fo, blockIdx.x, gridDim.y, (float*)dsm);
            return;
        }
    } else if (!gqa_split<unsigned char>(q, kc, vc, part, pos_p, kvt, hkv, G, D, lo, hi)) {
        if (fo) dec_fold<D>(part, *fo, blockIdx.x, gridDim.y, (float*)dsm); /* one sequence: part is the launch's own */
        return;                         /* attention.cu */
    }
    const int kvh = blockIdx.x, split = blockIdx.y, S = gridDim.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    /* per warp: bf16 ring of DT_NST (K, V) tile pairs, or for fp8 one fp16 tile (K, then V) and a
       raw ring of 2 stages (102 KB a block at D = 256: two blocks per SM) */
    constexpr int NST = F8 ? 2 : DT_NST;
    constexpr int WARP_BYTES = F8 ? TILE * 2 + NST * F8ST : NST * 2 * TILE * 2;
    u16* ring = (u16*)(dsm + warp * WARP_BYTES);
    unsigned char* f8ring = dsm + warp * WARP_BYTES + TILE * 2; /* fp8: after the fp16 tile */
    u16* pb = (u16*)(dsm + 4 * WARP_BYTES) + warp * 2 * G * DT_PS; /* P hi, then P lo */
    const long long rs = F8 ? f8_rs(hkv, D) : (long long)hkv * D * 2; /* bytes per position */
    const unsigned char* kb = kc + (long long)kvh * D * (F8 ? 1 : 2);
    const unsigned char* vb = vc + (long long)kvh * D * (F8 ? 1 : 2);
    const long long so8 = (long long)hkv * D + 4 * kvh; /* fp8: this head's scale in a position's row */
    const int ntiles = (hi - lo + KT - 1) / KT;
    const int mine = ntiles > warp ? (ntiles - warp + 3) / 4 : 0; /* tiles warp, warp + 4, ... */

    /* Copies this warp's j-th tile into stage j % DT_NST (zeros past hi); always commits a group. */
    auto load = [&](int j) {
        if (F8 && j < mine) {
            const int key0 = lo + (warp + 4 * j) * KT;
            unsigned char* st = f8ring + (j % NST) * F8ST;
#pragma unroll 4
            for (int i = lane; i < KT * (D / 16); i += 32) {
                const int row = i / (D / 16), c = i - row * (D / 16), key = key0 + row;
                const bool ok = key < hi;
                const long long off = ok ? (long long)key * rs + c * 16 : 0;
                /* no L2 hint here: with the evict-first policy (cp_async16_stream) ptxas 13.0.88
                   addressed these copies through a uniform register it never set (desc[UR1] in
                   attn_decode_tc64_fp8): an illegal instruction on the H200 */
                cp_async16(smem_u32(st + row * D + c * 16), kb + off, ok ? 16 : 0);
                cp_async16(smem_u32(st + TILE + row * D + c * 16), vb + off, ok ? 16 : 0);
            }
            if (lane < 2 * KT) {
                const int row = lane & 15, key = key0 + row;
                const bool ok = key < hi;
                const unsigned char* src = (lane < KT ? kc : vc) + (ok ? (long long)key * rs + so8 : 0);
                cp_async4(smem_u32(st + 2 * TILE + 4 * lane), src, ok ? 4 : 0);
            }
        } else if (!F8 && j < mine) {
            const int key0 = lo + (warp + 4 * j) * KT;
            u16* kt = ring + (j % NST) * 2 * TILE;
#pragma unroll 4
            for (int i = lane; i < KT * CH; i += 32) {
                const int row = i / CH, c = i - row * CH, key = key0 + row;
                const bool ok = key < hi && key != newest;
                const long long off = ok ? (long long)key * rs + c * 16 : 0;
                const int so = row * D + ((c ^ (row & 7)) << 3);
                cp_async16_stream(smem_u32(kt + so), kb + off, ok ? 16 : 0);
                cp_async16_stream(smem_u32(kt + TILE + so), vb + off, ok ? 16 : 0);
            }
        }
        cp_async_commit();
    };
#pragma unroll
    for (int j = 0; j < NST - 1; j++) load(j);
    if (early) pdl_wait();

    /* Q^T as B fragments (k = dim, n = head = lane / 4), prescaled, split into hi and lo. */
    u32 qh[NK][2], ql[NK][2];
    {
        const float* qr = q + (long long)(kvh * G + (lane >> 2)) * D;
        const float qs = scale * 1.4426950408889634f;
#pragma unroll
        for (int ks = 0; ks < NK; ks++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                const int k = ks * 16 + 2 * (lane & 3) + 8 * h;
                u32 h0, l0, h1, l1;
                split16<F8>(qr[k] * qs, h0, l0);
                split16<F8>(qr[k + 1] * qs, h1, l1);
                qh[ks][h] = h0 | (h1 << 16);
                ql[ks][h] = l0 | (l1 << 16);
            }
    }
    float oacc[NK][4]; /* O^T: (dim 16 mt + lane/4 (+8 for c >= 2), head 2 (lane & 3) + (c & 1)) */
#pragma unroll
    for (int mt = 0; mt < NK; mt++) oacc[mt][0] = oacc[mt][1] = oacc[mt][2] = oacc[mt][3] = 0.f;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}; /* heads 2 (lane & 3) + j; l per thread */

    for (int j = 0; j < mine; j++) {
        load(j + NST - 1);
        cp_async_wait<NST - 1>();
        __syncwarp();
        /* fp8: this stage's raw K and V tiles, then their row scales (K 0..15, V 16..31) */
        const unsigned char* st8 = f8ring + (j % NST) * F8ST;
        const float* sc8 = (const float*)(st8 + 2 * TILE);
        /* fp8: the raw tile kv (0 K, 1 V) widened into the fp16 tile (its previous readers are
           past a __syncwarp): 16-byte chunk c of row r becomes chunks 2c, 2c + 1 */
        auto widen = [&](int kv) {
#pragma unroll 4
            for (int i = lane; i < KT * (D / 16); i += 32) {
                const int row = i / (D / 16), c = i - row * (D / 16);
                uint4 o[2];
                f8x16_to_f16(*(const uint4*)(st8 + kv * TILE + row * D + c * 16), o);
                u16* dst = ring + row * D;
                *(uint4*)(dst + (((2 * c) ^ (row & 7)) << 3)) = o[0];
                *(uint4*)(dst + (((2 * c + 1) ^ (row & 7)) << 3)) = o[1];
            }
            __syncwarp();
        };
        if constexpr (F8) widen(0);
        const u16* kt = ring + (F8 ? 0 : (j % NST) * 2 * TILE);
        const u16* vt = F8 ? ring : kt + TILE;
        if (!F8 && early) {
            /* early: row pos (left out of the copies, so zeros in the stage by now) from the cache
               that attn_prep wrote before the wait, through the L2 */
            const int row = newest - (lo + (warp + 4 * j) * KT);
            if (row >= 0 && row < KT) {
                const int so = row * D + ((lane ^ (row & 7)) << 3);
                if (lane < CH) {
                    const long long off = (long long)newest * rs + lane * 16;
                    *(uint4*)(ring + (j % NST) * 2 * TILE + so) = __ldcg((const uint4*)(kb + off));
                    *(uint4*)(ring + (j % NST) * 2 * TILE + TILE + so) = __ldcg((const uint4*)(vb + off));
                }
                __syncwarp();
            }
        }
        /* S^T = K . Q^T */
        float s[4] = {0.f, 0.f, 0.f, 0.f};
        {
            const int row = (lane & 7) + ((lane >> 3) & 1) * 8, ch = lane >> 4;
#pragma unroll
            for (int ks = 0; ks < NK; ks++) {
                u32 a0, a1, a2, a3;
                ldsm_x4_at(smem_u32(kt + row * D + (((2 * ks + ch) ^ (row & 7)) << 3)), a0, a1, a2, a3);
                mma16<F8>(s, a0, a1, a2, a3, qh[ks][0], qh[ks][1]);
                mma16<F8>(s, a0, a1, a2, a3, ql[ks][0], ql[ks][1]);
            }
        }
        const int key0 = lo + (warp + 4 * j) * KT, r = lane >> 2;
        float vs0 = 1.f, vs1 = 1.f; /* fp8: the V scales of keys r and r + 8 */
        if constexpr (F8) {
            const float k0s = sc8[r], k1s = sc8[r + 8];
            s[0] *= k0s;
            s[1] *= k0s;
            s[2] *= k1s;
            s[3] *= k1s;
            vs0 = sc8[KT + r];
            vs1 = sc8[KT + r + 8];
        }
        if (key0 + r >= hi) s[0] = s[1] = -INFINITY;
        if (key0 + r + 8 >= hi) s[2] = s[3] = -INFINITY;
        /* online softmax per head (the max over the tile's 16 keys: lanes sharing lane & 3) */
        float corr[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float t = fmaxf(s[h], s[2 + h]);
            t = fmaxf(t, __shfl_xor_sync(0xffffffffu, t, 4));
            t = fmaxf(t, __shfl_xor_sync(0xffffffffu, t, 8));
            t = fmaxf(t, __shfl_xor_sync(0xffffffffu, t, 16));
            const float mn = fmaxf(m[h], t); /* finite: every tile has a key < hi */
            corr[h] = exp2f(m[h] - mn);
            const float p0 = exp2f(s[h] - mn), p1 = exp2f(s[2 + h] - mn);
            l[h] = l[h] * corr[h] + (p0 + p1);
            m[h] = mn;
            const int head = 2 * (lane & 3) + h;
            u32 h0, l0, h1, l1;
            split16<F8>(p0 * vs0, h0, l0);
            split16<F8>(p1 * vs1, h1, l1);
            pb[head * DT_PS + r] = (u16)h0;
            pb[head * DT_PS + r + 8] = (u16)h1;
            pb[G * DT_PS + head * DT_PS + r] = (u16)l0;
            pb[G * DT_PS + head * DT_PS + r + 8] = (u16)l1;
        }
        __syncwarp();
        if constexpr (F8) widen(1); /* V over K (every lane's K reads came before the barrier) */
        /* P^T as B fragments: (k = key 2 (lane & 3) + {0, 1} (+8), n = head lane / 4) */
        const u32* pw = (const u32*)pb;
        const int bo = (lane >> 2) * (DT_PS / 2) + (lane & 3);
        const u32 ph0 = pw[bo], ph1 = pw[bo + 4];
        const u32 pl0 = pw[G * DT_PS / 2 + bo], pl1 = pw[G * DT_PS / 2 + bo + 4];
        /* O^T = O^T * corr + V^T . P^T */
        {
            const int row = (lane & 7) + (lane >> 4) * 8, ch = (lane >> 3) & 1;
#pragma unroll
            for (int mt = 0; mt < NK; mt++) {
                oacc[mt][0] *= corr[0];
                oacc[mt][1] *= corr[1];
                oacc[mt][2] *= corr[0];
                oacc[mt][3] *= corr[1];
                u32 a0, a1, a2, a3;
                ldsm_x4_trans_at(smem_u32(vt + row * D + (((2 * mt + ch) ^ (row & 7)) << 3)), a0, a1, a2, a3);
                mma16<F8>(oacc[mt], a0, a1, a2, a3, ph0, ph1);
                mma16<F8>(oacc[mt], a0, a1, a2, a3, pl0, pl1);
            }
        }
        __syncwarp(); /* every lane has read this tile and the P buffer before they are reused */
    }
    cp_async_wait<0>();
#pragma unroll
    for (int h = 0; h < 2; h++) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 4);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 8);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 16);
    }
    /* Merge the 4 warps (the rings are free once every warp is here): each warp stores its O^T
       scaled to the block's maxima into its own [G][D + 4] buffer (the 4 extra floats a row put
       the lanes' 4 heads on different banks), then every thread adds the 4 warps' values of its
       outputs in warp order. One barrier for the products instead of one a warp (session 46's
       ncu samples: the 4 rounds of one busy warp and three at the barrier were 35% of the
       kernel's warp time). */
    __syncthreads();
    constexpr int AS = D + 4;        /* row stride of a warp's buffer */
    float* acc = (float*)dsm;        /* [4][8][AS] */
    float* sm = acc + 4 * G * AS;    /* [4][8] base-2 maxima */
    float* sl = sm + 4 * G;          /* [4][8] sums */
    if (lane < 4) {
        sm[warp * G + 2 * lane] = m[0];
        sm[warp * G + 2 * lane + 1] = m[1];
        sl[warp * G + 2 * lane] = l[0];
        sl[warp * G + 2 * lane + 1] = l[1];
    }
    __syncthreads();
    float f[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int head = 2 * (lane & 3) + h;
        float M = -INFINITY;
        for (int w = 0; w < 4; w++) M = fmaxf(M, sm[w * G + head]);
        f[h] = m[h] == -INFINITY ? 0.f : exp2f(m[h] - M);
    }
    {
        float* mine = acc + warp * G * AS;
#pragma unroll
        for (int mt = 0; mt < NK; mt++)
#pragma unroll
            for (int c = 0; c < 4; c++) {
                const int dim = 16 * mt + (lane >> 2) + 8 * (c >> 1), head = 2 * (lane & 3) + (c & 1);
                mine[head * AS + dim] = oacc[mt][c] * f[c & 1];
            }
    }
    __syncthreads();
    /* two outputs a thread a pass (part's rows are D + 2 floats: 8-byte aligned, as the buffers) */
    for (int t = 2 * threadIdx.x; t < G * D; t += 2 * blockDim.x) {
        const int g = t / D, dd = t - g * D;
        float2 v = *(const float2*)&acc[g * AS + dd];
#pragma unroll
        for (int w = 1; w < 4; w++) {
            const float2 u = *(const float2*)&acc[(w * G + g) * AS + dd];
            v.x += u.x;
            v.y += u.y;
        }
        float* pp = part + ((long long)(kvh * G + g) * S + split) * (D + 2);
        *(float2*)(pp + 2 + dd) = v;
        if (dd == 0) {
            float M = -INFINITY, Ls = 0.f;
            for (int w = 0; w < 4; w++) M = fmaxf(M, sm[w * G + g]);
            for (int w = 0; w < 4; w++)
                if (sm[w * G + g] != -INFINITY) Ls += sl[w * G + g] * exp2f(sm[w * G + g] - M);
            *(float2*)pp = make_float2(M * 0.6931471805599453f, Ls);
        }
    }
    if (fo) dec_fold<D>(part, *fo, blockIdx.x, gridDim.y, (float*)dsm);
}

#define ATTN_DEC_TC(D)                                                                                          \
    extern "C" __global__ void __launch_bounds__(128, 1)                                                        \
        attn_decode_tc##D(AttnGqaParams_fields) {                                                               \
        TL_SCOPE("attn_decode_tc" #D);                                                                          \
        attn_dec_tc<D, false>(q, kc, vc, part, hkv, pos_p, scale, kvt, early);                                         \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(128, 1)                                                        \
        attn_decode_tc##D##_fp8(AttnGqaParams_fields) {                                                         \
        TL_SCOPE("attn_decode_tc" #D "_fp8");                                                                   \
        attn_dec_tc<D, true>(q, kc, vc, part, hkv, pos_p, scale, kvt, early);                                          \
    }
ATTN_DEC_TC(64)
ATTN_DEC_TC(128)
ATTN_DEC_TC(256)

#define ATTN_DEC_TC_FOLD(D)                                                                                     \
    extern "C" __global__ void __launch_bounds__(128, 1) attn_decode_tc##D##_fold(AttnDecFoldParams_fields) {  \
        TL_SCOPE("attn_decode_tc" #D "_fold");                                                                 \
        const DecFold fo{qg, out, gated, ctr};                                                                  \
        attn_dec_tc<D, false>(q, kc, vc, part, hkv, pos_p, scale, nullptr, early, &fo);                \
    }
ATTN_DEC_TC_FOLD(64)
ATTN_DEC_TC_FOLD(128)
ATTN_DEC_TC_FOLD(256)
