/*
 * attention.cu: gated full attention for one new token over the KV cache.
 *
 * KV cache element type: every kernel that touches the cache exists twice, over an fp32 cache
 * (the names below) and over a bf16 one (the same name with `_bf16`: KV = u16, stored rounded to
 * nearest even, widened to fp32 on load). Scores, softmax and accumulation are fp32 either way.
 * An fp8 cache (`--kv-cache-dtype fp8`, KV = unsigned char) is written by attn_prep_fp8 and read
 * by the tensor-core kernels only (attn_decode_tc*_fp8, attn_prefill_fa*_fp8):
 *   position p of KV head h is D e4m3 bytes at p*RS + h*D, RS = f8_rs(H_kv, D) = H_kv*D + 16*ceil(H_kv/4)
 *   bytes per position, followed after the H_kv rows by their H_kv f32 scales (p*RS + H_kv*D + 4h);
 *   element = e4m3 value * scale. Per row (one position and head, K and V apart), scale =
 *   2^ceil(log2(amax/448)) (1 for an all-zero row): a power of two, so the row's largest value
 *   lands in e4m3's top binade, value times scale is exact in fp32 (the e4m3 value alone in
 *   fp16), and a row decoded and encoded again gives the same values (snapshots round-trip).
 *
 * The position is read from device memory (pos_p[0]; L = pos + 1 cached positions) so that a
 * captured CUDA graph replays every decode step unchanged.
 *
 * Batched decode (kvt not null, a device table [2R] of each row's K and V cache addresses): row
 * r (attn_prep: blockIdx.y; attn_decode*, attn_combine: blockIdx.z) is one token of its own
 * sequence at position pos_p[r] over its own cache; queries, partials and outputs are packed per
 * row (q + r*H_q*D, part + r*H_q*S*(D+2), out + r*H_q*D; attn_combine's gate rows at
 * qg + r*ldqg). Without the table every kernel is the one-sequence kernel above (grid.z = 1).
 *
 * attn_prep: grid (H_q + H_kv, T), block = head dim D threads (D <= 256, multiple of 32).
 *   Token t = blockIdx.y sits at position pos_p[0] + t; its inputs are at qg/k/v + t*ld and its
 *   query goes to q_out + t*H_q*D (decode: T = 1).
 *   Block b < H_q: q = qg[b, 0:D] (qg per head [q | gate] when gated, else [q]), RMSNorm with
 *   q_norm, partial NeoX RoPE on dims [0, R): for i < R/2, theta = pos * base^(-2i/R) (double),
 *   x[i] <- x[i] cos - x[i+R/2] sin, x[i+R/2] <- x[i+R/2] cos + x[i] sin. Writes q_out[b].
 *   Block H_q + h: k head h likewise with k_norm, written to kc[pos, h]; v copied to vc[pos, h].
 *   early != 0 (one sequence, no kvt; the decode step): the RoPE angle and the thread's norm
 *   weight are computed / loaded before the PDL wait (the position was written before the step
 *   began). The same bits.
 *   Caches kc, vc: [capacity, H_kv, D] of KV (fp32 or bf16).
 *
 * attn_decode (flash-decoding): grid (H_q, S splits), block 256 = 8 warps. Query head h reads KV
 *   head h / (H_q/H_kv); split s covers positions [s*ceil(L/S), (s+1)*ceil(L/S)) ∩ [0, L).
 *   Warp w takes positions 8w..8w+7, then +64, ... < L (8 independent warp dot products per round;
 *   each lane holds D/32 <= 8 dims, coalesced), then one online-softmax update per round (running
 *   max m, sum l, output o).
 *   The 8 warps' (m, l, o) are merged through shared memory and written unnormalized as the split's
 *   partial: part[h, s] = (M_s, l_s = sum_w l_w e^{m_w - M_s}, o_s = sum_w o_w e^{m_w - M_s}) [D + 2].
 *   An empty split writes M = -inf. scale = 1/sqrt(D).
 *
 * attn_combine: grid (H_q), block 1024, S <= 1024: M = max_s M_s; the weights e^{M_s - M} go to
 *   shared memory once; out[h] = sum_s o_s e^{M_s - M} / sum_s l_s e^{M_s - M}, times
 *   sigmoid(gate[h]) when gated. The sum over splits is spread over floor(1024/D) thread groups
 *   (group g takes splits g, g + groups, ..., four loads in flight per thread, an empty split's
 *   unwritten o_s selected away), then the groups' sums are added in shared memory: at 66 splits
 *   a thread waits on ~5 rounds of L2 loads instead of 66. Since session 36 every load (M_s and
 *   l_s by split, a group's first 20 o_s, the gate) is issued right after the wait, in one round
 *   (+0.85%; the rounds above were removed in session 54). attn_combine_ds (the
 *   default since session 41): grid (H_q, D/32, rows), block 256: each head's dims over D/32
 *   blocks (see its comment below).
 *
 * attn_decode_gqa{1,2,4,8} (GQA-packed flash-decoding; G = H_q/H_kv query heads per KV head, the
 *   suffix): grid (H_kv, S), block 256 = 8 warps, one block per (KV head, split), so each K/V row
 *   is read from memory once for all G query heads that share it. With L = pos + 1 positions,
 *   chunk = max(64, ceil(L/S)); split s covers [s*chunk, min(L, (s+1)*chunk)); a split past L
 *   writes M = -inf for its heads and exits (short contexts use few blocks; the grid is fixed
 *   when the graph is captured).
 *   Lane l holds dims l + 32i (i < D/32 <= 8) of the G prescaled queries and G output
 *   accumulators. A warp takes 4 consecutive positions per round (rounds stride 32 over the
 *   block), loads their K and V rows (coalesced 128 B per instruction), forms G partial dots per
 *   position and sums them over the warp by a reduce-scatter (log2 G halving steps exchange half
 *   of the values, then 5 - log2 G full steps): lane l ends with the score of head l >> (5 - log2 G).
 *   Each lane keeps that head's running max m and sum l; the G correction factors and weights are
 *   broadcast back by shuffles before the V update. The 8 warps merge through shared memory (max,
 *   then the rescaled sums added warp by warp in a fixed order, so replays are bit-identical)
 *   into the split's partial part[h, s] = (M_s, l_s, o_s), merged by attn_combine (one block per
 *   query head; a merge inside the last block of each KV head was tried: one SM per KV head
 *   reading all partials made it slower at 4K). Requires G in {1, 2, 4, 8}, D % 32 == 0,
 *   D <= 256. Over a bf16 cache a lane's rows stay packed (4 words: dims nd*lane..) and the next
 *   round's 2U rows are loaded before the current round is computed (register double buffer), so
 *   a warp always has a round of loads in flight.
 */

/* KV cache element loads and stores (fp32, or bf16 bits in a u16). */
__device__ __forceinline__ float kv_ld(const float* p) { return *p; }
__device__ __forceinline__ float kv_ld(const u16* p) { return bf16_to_f32(*p); }
__device__ __forceinline__ void kv_st(float* p, float v) { *p = v; }
__device__ __forceinline__ void kv_st(u16* p, float v) { *p = (u16)bf16_bits(v); }
/* Four consecutive elements (16-byte aligned for fp32, 8-byte for bf16). */
__device__ __forceinline__ float4 kv_ld4(const float* p) { return *(const float4*)p; }
__device__ __forceinline__ float4 kv_ld4(const u16* p) {
    uint2 u = *(const uint2*)p;
    return make_float4(__uint_as_float(u.x << 16), __uint_as_float(u.x & 0xffff0000u), __uint_as_float(u.y << 16),
                       __uint_as_float(u.y & 0xffff0000u));
}

/* The packed kernel's map of head dimensions to lanes (value i < nd = D/32 of a lane): an fp32
   cache is read with dims lane + 32i (each load instruction covers 128 contiguous bytes of a
   row), a bf16 one with dims nd*lane + i, so a lane reads its nd values in one 2*nd-byte load
   (16 B at D = 256; as 2-byte loads it ran at half the speed). The queries and outputs follow the
   same map. The per-head kernel keeps dims lane + 32i for both (short contexts; with the wide map
   it needed 96 registers instead of 55 and ran 40% slower at 4K). */
__device__ __forceinline__ int kv_dim(const float*, int lane, int i, int nd) { return lane + 32 * i; }
__device__ __forceinline__ int kv_dim(const u16*, int lane, int i, int nd) { return nd * lane + i; }
/* A lane's nd values of one cache row (row points at dim 0 of the head); zeros when !ok. */
__device__ __forceinline__ void kv_row(const float* row, int lane, int nd, bool ok, float (&o)[8]) {
#pragma unroll
    for (int i = 0; i < 8; i++) o[i] = ok && i < nd ? row[lane + 32 * i] : 0.f;
}
__device__ __forceinline__ void kv_row(const u16* row, int lane, int nd, bool ok, float (&o)[8]) {
    const u16* p = row + nd * lane;
    if (nd == 8 || nd == 4 || nd == 2) {
        u32 w[4] = {0u, 0u, 0u, 0u};
        if (ok) {
            if (nd == 8) {
                uint4 v = *(const uint4*)p;
                w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
            } else if (nd == 4) {
                uint2 v = *(const uint2*)p;
                w[0] = v.x; w[1] = v.y;
            } else {
                w[0] = *(const u32*)p;
            }
        }
#pragma unroll
        for (int j = 0; j < 4; j++) {
            o[2 * j] = __uint_as_float(w[j] << 16);
            o[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
        }
    } else {
#pragma unroll
        for (int i = 0; i < 8; i++) o[i] = ok && i < nd ? bf16_to_f32(p[i]) : 0.f;
    }
}

/* A lane's nd bf16 values of one cache row, packed two per word (zeros when !ok or past nd). */
__device__ __forceinline__ uint4 kv_raw(const u16* row, int lane, int nd, bool ok) {
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (!ok) return v;
    const u16* p = row + nd * lane;
    if (nd == 8) {
        v = *(const uint4*)p;
    } else if (nd == 4) {
        uint2 h = *(const uint2*)p;
        v.x = h.x;
        v.y = h.y;
    } else if (nd == 2) {
        v.x = *(const u32*)p;
    } else {
        u32 w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
        for (int i = 0; i < 8; i++)
            if (i < nd) w[i >> 1] |= (u32)p[i] << (16 * (i & 1));
        v = make_uint4(w[0], w[1], w[2], w[3]);
    }
    return v;
}
/* Value i (0..7) of a packed row. */
__device__ __forceinline__ float bf16_word(uint4 v, int i) {
    u32 w = (i >> 1) == 0 ? v.x : (i >> 1) == 1 ? v.y : (i >> 1) == 2 ? v.z : v.w;
    return __uint_as_float((i & 1) ? (w & 0xffff0000u) : (w << 16));
}
/* fp8 e4m3 cache rows (see the header). Conversions need sm_89 (the host refuses the fp8 cache
   on older devices; there they compile to zeros). */
__device__ __forceinline__ long long f8_rs(int hkv, int D) { return (long long)hkv * D + 16 * ((hkv + 3) / 4); }
/* The power-of-two scale of a row whose largest magnitude is amax. */
__device__ __forceinline__ float f8_scale(float amax) {
    if (!(amax > 0.f)) return 1.f;
    int e;
    float m = frexpf(amax / 448.f, &e); /* amax/448 = m 2^e, m in [0.5, 1) */
    return ldexpf(1.f, m == 0.5f ? e - 1 : e);
}
/* x (already divided by the row's scale) as e4m3, rounded to nearest even, saturated at 448. */
__device__ __forceinline__ unsigned char f8_encode(float x) {
#if __CUDA_ARCH__ >= 890
    unsigned short h;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(h) : "f"(0.f), "f"(x));
    return (unsigned char)(h & 0xff);
#else
    return 0;
#endif
}
template <typename KV> __device__ __forceinline__ constexpr bool bf16_cache() { return false; }
template <> __device__ __forceinline__ constexpr bool bf16_cache<u16>() { return true; }

/* One rotated RoPE element: x c - y s (first half) or x c + y s, each product rounded (no FMA
   contraction), so that every caller (attn_prep's forms) gives the same bits. */
__device__ __forceinline__ float rope_rot(float x, float y, float c, float s, bool first) {
    return first ? __fsub_rn(__fmul_rn(x, c), __fmul_rn(y, s)) : __fadd_rn(__fmul_rn(x, c), __fmul_rn(y, s));
}

/* RoPE's cos and sin for dim j < rot at position pos: angle pos * theta^(-2i / rot), i = j mod
   rot/2, in double precision, rounded to float (attn_prep's forms alike). */
__device__ __forceinline__ void rope_cs(int j, int rot, int pos, double theta, float& c, float& s) {
    const int half = rot / 2, i = j < half ? j : j - half;
    const double ang = (double)pos * pow(theta, -(2.0 * i) / (double)rot);
    c = (float)cos(ang);
    s = (float)sin(ang);
}

template <typename KV>
__device__ __forceinline__ void attn_prep_t(const float* qg, const float* kin, const float* vin, const float* qn,
                                            const float* kn, float* q_out, KV* kc, KV* vc, int nh, int hkv, int hd,
                                            int gated, int rot, const int* pos_p, double theta, float eps,
                                            long long ld, const unsigned long long* kvt, int early) {
    /* early (one sequence, no kvt): the position was written by the previous step's sampler or
       the host, complete before this step began (as attn_decode_tc's early form reads it), so the
       RoPE angle, which needs nothing else, is computed before the wait */
    const bool pre = early && !kvt;
    const int j = threadIdx.x;
    const float* nw = blockIdx.x < nh ? qn : kn; /* the block's norm weights */
    float rc = 1.f, rs = 0.f, nwj = 0.f;
    pdl_trigger();
    if (pre) { /* and this thread's norm weight (a weight: from HBM) */
        if (j < hd) nwj = nw[j];
        if (j < rot) rope_cs(j, rot, pos_p[0] + blockIdx.y, theta, rc, rs);
    }
    pdl_wait();
    int pos = kvt ? pos_p[blockIdx.y] : pos_p[0] + blockIdx.y;
    if (kvt) {
        kc = (KV*)kvt[2 * blockIdx.y];
        vc = (KV*)kvt[2 * blockIdx.y + 1];
    }
    qg += blockIdx.y * ld;
    kin += blockIdx.y * ld;
    vin += blockIdx.y * ld;
    q_out += (long long)blockIdx.y * nh * hd;
    __shared__ float xs[256], sh[33];
    int b = blockIdx.x;
    bool isq = b < nh;
    int h = isq ? b : b - nh;
    const float* src = isq ? qg + (long long)h * hd * (gated ? 2 : 1) : kin + (long long)h * hd;
    float v = j < hd ? src[j] : 0.f;
    float ss = block_sum(v * v, sh);
    float r = 1.f / sqrtf(ss / (float)hd + eps);
    if (j < hd) xs[j] = v * (r * (pre ? nwj : nw[j]));
    __syncthreads();
    float outv = j < hd ? xs[j] : 0.f;
    int half = rot / 2;
    if (j < rot) {
        if (!pre) rope_cs(j, rot, pos, theta, rc, rs);
        outv = j < half ? rope_rot(xs[j], xs[j + half], rc, rs, true) : rope_rot(xs[j], xs[j - half], rc, rs, false);
    }
    if constexpr (sizeof(KV) == 1) {
        /* fp8: each row (this position's head h, K and V apart) with its own power-of-two scale;
           every thread takes part in the block maxima (isq is the same for the whole block) */
        if (isq) {
            if (j < hd) q_out[(long long)h * hd + j] = outv;
        } else {
            float vv = j < hd ? vin[(long long)h * hd + j] : 0.f;
            float sk = f8_scale(block_max(j < hd ? fabsf(outv) : 0.f, sh));
            float sv = f8_scale(block_max(fabsf(vv), sh));
            long long row = (long long)pos * f8_rs(hkv, hd);
            unsigned char* kr = (unsigned char*)kc + row;
            unsigned char* vr = (unsigned char*)vc + row;
            if (j < hd) {
                kr[(long long)h * hd + j] = f8_encode(outv * (1.f / sk));
                vr[(long long)h * hd + j] = f8_encode(vv * (1.f / sv));
            }
            if (j == 0) {
                ((float*)(kr + (long long)hkv * hd))[h] = sk;
                ((float*)(vr + (long long)hkv * hd))[h] = sv;
            }
        }
        return;
    } else if (j < hd) {
        if (isq) q_out[(long long)h * hd + j] = outv;
        else {
            long long off = ((long long)pos * hkv + h) * hd + j;
            kv_st(kc + off, outv);
            kv_st(vc + off, vin[(long long)h * hd + j]);
        }
    }
}

#define ATTN_PREP(NAME, KV)                                                                                        \
    extern "C" __global__ void NAME(AttnPrepParams_fields) {                                                       \
        TL_SCOPE(#NAME);                                                                                           \
        attn_prep_t<KV>(qg, kin, vin, qn, kn, q_out, (KV*)kc, (KV*)vc, nh, hkv, hd, gated, rot, pos_p, theta, eps, \
                        ld, kvt, early);                                                                           \
    }
ATTN_PREP(attn_prep, float)
ATTN_PREP(attn_prep_bf16, u16)
ATTN_PREP(attn_prep_fp8, unsigned char)

template <typename KV>
__device__ __forceinline__ void attn_decode_t(const float* q, const KV* kc, const KV* vc, float* part, int nh,
                                              int hkv, int hd, const int* pos_p, float scale,
                                              const unsigned long long* kvt) {
    pdl_begin();
    __shared__ float so[8][256];
    __shared__ float sm[8], sl[8];
    if (kvt) {
        int r = blockIdx.z;
        kc = (const KV*)kvt[2 * r];
        vc = (const KV*)kvt[2 * r + 1];
        pos_p += r;
        q += (long long)r * nh * hd;
        part += (long long)r * nh * gridDim.y * (hd + 2);
    }
    int L = pos_p[0] + 1;
    int h = blockIdx.x, split = blockIdx.y, S = gridDim.y;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int kvh = h / (nh / hkv);
    int nd = hd / 32;
    int chunk = (L + S - 1) / S;
    int lo = split * chunk, hi = min(L, lo + chunk);
    float qv[8], o[8];
    for (int i = 0; i < 8; i++) {
        qv[i] = i < nd ? q[(long long)h * hd + lane + 32 * i] : 0.f;
        o[i] = 0.f;
    }
    float m = -INFINITY, l = 0.f;
    /* Each warp takes 8 consecutive positions per round (rounds stride 64): the 8 dot products
       load independently, then one online-softmax update covers all 8. */
    for (int p0 = lo + warp * 8; p0 < hi; p0 += 64) {
        float d[8];
#pragma unroll
        for (int u = 0; u < 8; u++) {
            int p = p0 + u;
            float acc = 0.f;
            if (p < hi) {
                const KV* kp = kc + ((long long)p * hkv + kvh) * hd;
#pragma unroll
                for (int i = 0; i < 8; i++)
                    if (i < nd) acc += qv[i] * kv_ld(kp + lane + 32 * i);
            }
            d[u] = acc;
        }
        float mx = m;
#pragma unroll
        for (int u = 0; u < 8; u++) {
            d[u] = p0 + u < hi ? warp_sum(d[u]) * scale : -INFINITY;
            mx = fmaxf(mx, d[u]);
        }
        float corr = expf(m - mx);
        l *= corr;
#pragma unroll
        for (int i = 0; i < 8; i++) o[i] *= corr;
#pragma unroll
        for (int u = 0; u < 8; u++) {
            int p = p0 + u;
            if (p < hi) {
                float pw = expf(d[u] - mx);
                l += pw;
                const KV* vp = vc + ((long long)p * hkv + kvh) * hd;
#pragma unroll
                for (int i = 0; i < 8; i++)
                    if (i < nd) o[i] += pw * kv_ld(vp + lane + 32 * i);
            }
        }
        m = mx;
    }
    for (int i = 0; i < nd; i++) so[warp][lane + 32 * i] = o[i];
    if (lane == 0) {
        sm[warp] = m;
        sl[warp] = l;
    }
    __syncthreads();
    float M = -INFINITY;
    for (int w = 0; w < 8; w++) M = fmaxf(M, sm[w]);
    float* pp = part + ((long long)h * S + split) * (hd + 2);
    if (threadIdx.x == 0) {
        float Lsum = 0.f;
        for (int w = 0; w < 8; w++) Lsum += sm[w] == -INFINITY ? 0.f : sl[w] * expf(sm[w] - M);
        pp[0] = M;
        pp[1] = Lsum;
    }
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc = 0.f;
        for (int w = 0; w < 8; w++)
            if (sm[w] != -INFINITY) acc += so[w][d] * expf(sm[w] - M);
        pp[2 + d] = acc;
    }
}

#define ATTN_DECODE(NAME, KV)                                                                                  \
    extern "C" __global__ void NAME(AttnDecodeParams_fields) {                                                 \
        TL_SCOPE(#NAME);                                                                                       \
        attn_decode_t<KV>(q, (const KV*)kc, (const KV*)vc, part, nh, hkv, hd, pos_p, scale, kvt);              \
    }
ATTN_DECODE(attn_decode, float)
ATTN_DECODE(attn_decode_bf16, u16)

/* attn_combine's body: every load of the merge is issued right after the wait, in one round:
   thread t's split M_t and l_t, the first COMBINE_REGS of its group's o_s values into registers,
   the gate; then the merge (session 36: +0.85% over waiting on an L2 round for the maxima, then
   ~S / (4 groups) / 4 rounds for o, the removed attn_combine_plain). */
#define COMBINE_REGS 20
__device__ __forceinline__ void attn_combine_body(AttnCombineParams_fields) {
    __shared__ float w[1024], red[33], accs[1024];
    int h = blockIdx.x;
    part += (long long)blockIdx.z * nh * S * (hd + 2);
    qg += blockIdx.z * ldqg;
    out += (long long)blockIdx.z * nh * hd;
    const float* ph = part + (long long)h * S * (hd + 2);
    int ng = blockDim.x / hd, grp = threadIdx.x / hd, d = threadIdx.x - grp * hd; /* hd <= 256 */
    float ov[COMBINE_REGS], mt = -INFINITY, lt = 0.f, gt = 0.f;
    if ((int)threadIdx.x < S) {
        mt = ph[(long long)threadIdx.x * (hd + 2)];
        lt = ph[(long long)threadIdx.x * (hd + 2) + 1];
    }
#pragma unroll
    for (int j = 0; j < COMBINE_REGS; j++) {
        int s = grp + j * ng;
        ov[j] = grp < ng && s < S ? ph[(long long)s * (hd + 2) + 2 + d] : 0.f;
    }
    if (gated && (int)threadIdx.x < hd) gt = qg[(long long)h * 2 * hd + hd + threadIdx.x];
    /* M = max_s M_s (NaN-free: M_s is finite or -inf), then the weights e^{M_s - M} in shared
       memory, each split's loads issued by its own thread */
    float mloc = warp_max(mt); /* S <= 1024 = the block: one split a thread */
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = mloc;
    __syncthreads();
    float M = -INFINITY;
    for (int i = 0; i < (int)(blockDim.x >> 5); i++) M = fmaxf(M, red[i]);
    float dl = 0.f;
    for (int s = threadIdx.x; s < S; s += blockDim.x) {
        float ms = mt;
        float e = ms == -INFINITY ? 0.f : expf(ms - M);
        w[s] = e;
        dl += e * lt;
    }
    float den = block_sum(dl, red); /* its barriers also publish w[] */
    float acc = 0.f;
    if (grp < ng) {
        int s = grp;
#pragma unroll
        for (int j = 0; j < COMBINE_REGS; j++, s += ng) {
            if (s < S) {
                float v = ov[j], ws = w[s];
                acc += ws != 0.f ? v * ws : 0.f;
            }
        }
#pragma unroll 4
        for (; s < S; s += ng) {
            float v = ph[(long long)s * (hd + 2) + 2 + d], ws = w[s];
            acc += ws != 0.f ? v * ws : 0.f;
        }
    }
    accs[threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.x < hd) {
        float a = 0.f;
        for (int g = 0; g < ng; g++) a += accs[g * hd + d];
        float r = a / den;
        if (gated) r *= sigmoid_f(gt);
        out[(long long)h * hd + d] = r;
    }
}

extern "C" __global__ void __launch_bounds__(1024) attn_combine(AttnCombineParams_fields) {
    TL_SCOPE("attn_combine");
    pdl_begin();
    attn_combine_body(part, qg, out, nh, hd, S, gated, ldqg);
}

/* attn_combine_ds (the default since session 41; LILY_CUDA_COMBINE=block: attn_combine): the same
   merge with each head's D dims split over D / 32 blocks of 256 threads (grid (H_q, D / 32, rows);
   D a multiple of 32, S <= 1024), so a head's merge runs on D / 32 SMs, not one (16 heads of 256:
   128 blocks instead of 16). Every block computes M and the weights e^{M_s - M} of all S splits
   (thread t: splits t, t + 256, ...) and den = sum_s l_s e^{M_s - M}; warp g sums its lanes' dims
   over the splits g, g + 8, ... (the first 16 of them loaded right after the wait, with the
   maxima and the gate), the 8 warps' sums are added in shared memory in warp order. The same
   arithmetic as attn_combine in another order of the sums. */
#define COMBINE_DS_REGS 16
extern "C" __global__ void __launch_bounds__(256) attn_combine_ds(AttnCombineParams_fields) {
    __shared__ float w[1024], red[33], accs[8 * 32];
    TL_SCOPE("attn_combine_ds");
    pdl_begin();
    const int h = blockIdx.x, lane = threadIdx.x & 31, grp = threadIdx.x >> 5, d = blockIdx.y * 32 + lane;
    part += (long long)blockIdx.z * nh * S * (hd + 2);
    qg += blockIdx.z * ldqg;
    out += (long long)blockIdx.z * nh * hd;
    const float* ph = part + (long long)h * S * (hd + 2);
    float mt[4], lt[4], ov[COMBINE_DS_REGS], gt = 0.f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int s = threadIdx.x + 256 * i;
        mt[i] = s < S ? ph[(long long)s * (hd + 2)] : -INFINITY;
        lt[i] = s < S ? ph[(long long)s * (hd + 2) + 1] : 0.f;
    }
#pragma unroll
    for (int j = 0; j < COMBINE_DS_REGS; j++) {
        int s = grp + 8 * j;
        ov[j] = s < S ? ph[(long long)s * (hd + 2) + 2 + d] : 0.f;
    }
    if (gated && grp == 0) gt = qg[(long long)h * 2 * hd + hd + d];
    /* M = max_s M_s (finite or -inf), the weights into shared memory, den */
    const float M = block_max(fmaxf(fmaxf(mt[0], mt[1]), fmaxf(mt[2], mt[3])), red);
    float dl = 0.f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int s = threadIdx.x + 256 * i;
        if (s < S) {
            float e = mt[i] == -INFINITY ? 0.f : expf(mt[i] - M);
            w[s] = e;
            dl += e * lt[i];
        }
    }
    const float den = block_sum(dl, red); /* its barriers also publish w[] */
    float acc = 0.f;
    int s = grp;
#pragma unroll
    for (int j = 0; j < COMBINE_DS_REGS; j++, s += 8) {
        if (s < S) {
            float ws = w[s];
            acc += ws != 0.f ? ov[j] * ws : 0.f;
        }
    }
#pragma unroll 4
    for (; s < S; s += 8) {
        float v = ph[(long long)s * (hd + 2) + 2 + d], ws = w[s];
        acc += ws != 0.f ? v * ws : 0.f;
    }
    accs[grp * 32 + lane] = acc;
    __syncthreads();
    if (grp == 0) {
        float a = 0.f;
#pragma unroll
        for (int g = 0; g < 8; g++) a += accs[g * 32 + lane];
        float r = a / den;
        if (gated) r *= sigmoid_f(gt);
        out[(long long)h * hd + d] = r;
    }
}

/* Sum G per-lane values over the warp, leaving in each lane the total of value lane >> (5 - LG). */
template <int LG>
__device__ __forceinline__ float reduce_scatter(float (&d)[1 << LG], int lane) {
#pragma unroll
    for (int j = 0; j < LG; j++) {
        const int half = (1 << LG) >> (j + 1), bit = 16 >> j;
        bool up = lane & bit;
#pragma unroll
        for (int t = 0; t < half; t++) {
            float send = up ? d[t] : d[t + half];
            float keep = up ? d[t + half] : d[t];
            d[t] = keep + __shfl_xor_sync(0xffffffffu, send, bit);
        }
    }
    float v = d[0];
#pragma unroll
    for (int o = 16 >> LG; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* One round of the packed decode kernel: U positions p0 .. p0 + U - 1 (those >= hi masked) of
   G query heads; kat(u, i) / vat(u, i) give value i of this lane's share of position u's K / V
   row. Scores by a reduce-scatter (lane l ends with head l >> (5 - LG)), one online-softmax update
   per round, then the V accumulation with the weights broadcast from the owning lanes. */
template <int LG, int U, typename KF, typename VF>
__device__ __forceinline__ void gqa_round(int p0, int hi, const float (&qv)[1 << LG][8], float (&o)[1 << LG][8],
                                          float& m, float& l, int lane, KF kat, VF vat) {
    constexpr int G = 1 << LG;
    float sc[U];
#pragma unroll
    for (int u = 0; u < U; u++) {
        float d[G];
#pragma unroll
        for (int g = 0; g < G; g++) {
            float a = 0.f;
#pragma unroll
            for (int i = 0; i < 8; i++) a += qv[g][i] * kat(u, i);
            d[g] = a;
        }
        float v = reduce_scatter<LG>(d, lane);
        sc[u] = p0 + u < hi ? v : -INFINITY;
    }
    float mx = m;
#pragma unroll
    for (int u = 0; u < U; u++) mx = fmaxf(mx, sc[u]);
    float corr = expf(m - mx), pw[U];
    l *= corr;
#pragma unroll
    for (int u = 0; u < U; u++) {
        pw[u] = expf(sc[u] - mx);
        l += pw[u];
    }
    m = mx;
#pragma unroll
    for (int g = 0; g < G; g++) {
        const int src = g << (5 - LG);
        float c = __shfl_sync(0xffffffffu, corr, src);
        float pg[U];
#pragma unroll
        for (int u = 0; u < U; u++) pg[u] = __shfl_sync(0xffffffffu, pw[u], src);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            float a = o[g][i] * c;
#pragma unroll
            for (int u = 0; u < U; u++) a += pg[u] * vat(u, i);
            o[g][i] = a;
        }
    }
}

/* The packed decode kernels' start (grid (H_kv, S, rows)): moves the pointers to row
   blockIdx.z's cache, position, queries and partials when batched (kvt), and gives the split's
   positions [lo, hi) (chunk = max(64, ceil(L/S))); false for an empty split, whose G heads'
   partials it marks M = -inf (merging as nothing). */
/* Split blockIdx.y's positions [lo, hi) of L (chunk = max(64, ceil(L/S))); false when empty. */
__device__ __forceinline__ bool split_range(int L, int& lo, int& hi) {
    const int chunk = max(64, (L + (int)gridDim.y - 1) / (int)gridDim.y);
    lo = blockIdx.y * chunk;
    hi = min(L, lo + chunk);
    return lo < L;
}
/* An empty split's G partials (of KV head blockIdx.x) marked M = -inf: they merge as nothing. */
__device__ __forceinline__ void mark_empty_split(float* part, int G, int hd) {
    if (threadIdx.x < G) part[((long long)(blockIdx.x * G + threadIdx.x) * gridDim.y + blockIdx.y) * (hd + 2)] = -INFINITY;
}
template <typename KV>
__device__ __forceinline__ bool gqa_split(const float*& q, const KV*& kc, const KV*& vc, float*& part,
                                          const int*& pos_p, const unsigned long long* kvt, int hkv, int G, int hd,
                                          int& lo, int& hi) {
    if (kvt) {
        int r = blockIdx.z;
        kc = (const KV*)kvt[2 * r];
        vc = (const KV*)kvt[2 * r + 1];
        pos_p += r;
        q += (long long)r * hkv * G * hd;
        part += (long long)r * hkv * G * gridDim.y * (hd + 2);
    }
    if (!split_range(pos_p[0] + 1, lo, hi)) {
        mark_empty_split(part, G, hd);
        return false;
    }
    return true;
}

template <int LG, typename KV>
__device__ __forceinline__ void attn_gqa(const float* q, const KV* kc, const KV* vc, float* part, int hkv,
                                         int hd, const int* pos_p, float scale, const unsigned long long* kvt) {
    constexpr int G = 1 << LG, U = 4;
    __shared__ float acc[G * 256];
    __shared__ float sm[8][G], sl[8][G];
    pdl_begin();
    int lo, hi;
    if (!gqa_split<KV>(q, kc, vc, part, pos_p, kvt, hkv, G, hd, lo, hi)) return;
    const int kvh = blockIdx.x, split = blockIdx.y, S = gridDim.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nd = hd / 32, me = lane >> (5 - LG);
    float qv[G][8], o[G][8];
#pragma unroll
    for (int g = 0; g < G; g++)
#pragma unroll
        for (int i = 0; i < 8; i++) {
            qv[g][i] = i < nd ? q[(long long)(kvh * G + g) * hd + kv_dim(kc, lane, i, nd)] * scale : 0.f;
            o[g][i] = 0.f;
        }
    float m = -INFINITY, l = 0.f;
    const long long rs = (long long)hkv * hd; /* cache row stride */
    if constexpr (bf16_cache<KV>()) {
        /* bf16: rows stay packed (4 words per lane) and the next round's rows are loaded before
           this round is computed, so every warp keeps a round of loads in flight. */
        uint4 kb[U], vb[U];
        int p0 = lo + warp * U;
#pragma unroll
        for (int u = 0; u < U; u++) {
            kb[u] = kv_raw(kc + (long long)(p0 + u) * rs + kvh * hd, lane, nd, p0 + u < hi);
            vb[u] = kv_raw(vc + (long long)(p0 + u) * rs + kvh * hd, lane, nd, p0 + u < hi);
        }
        for (; p0 < hi; p0 += 8 * U) {
            uint4 kn[U], vn[U];
            const int p1 = p0 + 8 * U;
#pragma unroll
            for (int u = 0; u < U; u++) {
                kn[u] = kv_raw(kc + (long long)(p1 + u) * rs + kvh * hd, lane, nd, p1 + u < hi);
                vn[u] = kv_raw(vc + (long long)(p1 + u) * rs + kvh * hd, lane, nd, p1 + u < hi);
            }
            gqa_round<LG, U>(p0, hi, qv, o, m, l, lane, [&](int u, int i) { return bf16_word(kb[u], i); },
                             [&](int u, int i) { return bf16_word(vb[u], i); });
#pragma unroll
            for (int u = 0; u < U; u++) {
                kb[u] = kn[u];
                vb[u] = vn[u];
            }
        }
    } else {
        for (int p0 = lo + warp * U; p0 < hi; p0 += 8 * U) {
            float kr[U][8], vr[U][8];
#pragma unroll
            for (int u = 0; u < U; u++) {
                bool ok = p0 + u < hi;
                kv_row(kc + (p0 + u) * rs + kvh * hd, lane, nd, ok, kr[u]);
                kv_row(vc + (p0 + u) * rs + kvh * hd, lane, nd, ok, vr[u]);
            }
            gqa_round<LG, U>(p0, hi, qv, o, m, l, lane, [&](int u, int i) { return kr[u][i]; },
                             [&](int u, int i) { return vr[u][i]; });
        }
    }
    /* Merge the 8 warps: block max per head, then rescaled sums added warp by warp in a fixed
       order (bit-identical results on every replay). */
    if ((lane & ((32 >> LG) - 1)) == 0) {
        sm[warp][me] = m;
        sl[warp][me] = l;
    }
    __syncthreads();
    float f[G];
#pragma unroll
    for (int g = 0; g < G; g++) {
        float M = -INFINITY;
        for (int w = 0; w < 8; w++) M = fmaxf(M, sm[w][g]);
        float mw = __shfl_sync(0xffffffffu, m, g << (5 - LG));
        f[g] = mw == -INFINITY ? 0.f : expf(mw - M);
    }
    for (int w = 0; w < 8; w++) {
        if (warp == w)
#pragma unroll
            for (int g = 0; g < G; g++)
#pragma unroll
                for (int i = 0; i < 8; i++)
                    if (i < nd) {
                        float* a = &acc[g * hd + kv_dim(kc, lane, i, nd)];
                        *a = (w == 0 ? 0.f : *a) + o[g][i] * f[g];
                    }
        __syncthreads();
    }
    for (int t = threadIdx.x; t < G * hd; t += blockDim.x) {
        int g = t / hd, dd = t - g * hd;
        float* pp = part + ((long long)(kvh * G + g) * S + split) * (hd + 2);
        pp[2 + dd] = acc[t];
        if (dd == 0) {
            float M = -INFINITY, Ls = 0.f;
            for (int w = 0; w < 8; w++) M = fmaxf(M, sm[w][g]);
            for (int w = 0; w < 8; w++)
                if (sm[w][g] != -INFINITY) Ls += sl[w][g] * expf(sm[w][g] - M);
            pp[0] = M;
            pp[1] = Ls;
        }
    }
}

#define ATTN_GQA(LG, NAME, KV)                                                                                \
    extern "C" __global__ void __launch_bounds__(256, 1) NAME(AttnGqaParams_fields) {                          \
        TL_SCOPE(#NAME);                                                                                      \
        attn_gqa<LG, KV>(q, (const KV*)kc, (const KV*)vc, part, hkv, hd, pos_p, scale, kvt);                     \
    }
ATTN_GQA(0, attn_decode_gqa1, float)
ATTN_GQA(1, attn_decode_gqa2, float)
ATTN_GQA(2, attn_decode_gqa4, float)
ATTN_GQA(3, attn_decode_gqa8, float)
ATTN_GQA(0, attn_decode_gqa1_bf16, u16)
ATTN_GQA(1, attn_decode_gqa2_bf16, u16)
ATTN_GQA(2, attn_decode_gqa4_bf16, u16)
ATTN_GQA(3, attn_decode_gqa8_bf16, u16)
