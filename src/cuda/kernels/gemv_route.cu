/*
 * gemv_route.cu: gemv_q2_route, the batch-1 decode out-projection (GDN out_proj, attention
 * o_proj) that also leaves the MoE router's logits, so the router needs no launch of its own
 * (the decode default since session 48, with the top-K: LILY_CUDA_MOE_ROUTER=tailk; =tail the
 * logits alone, =launch the router's own launch).
 *
 * Math: y[r] += sum_c W[r, c] o[c] for r < H (gemv_q2 with accumulate 1: y is the residual
 *   stream), then the router Wr (R rows: the routed experts' logits and the shared expert's gate,
 *   H columns) on rms_norm(y) * nw, in two stages:
 *   block b holds rows c0 = 32 b .. c0 + 31 of the new y (one row group of 2 rows a warp) and writes
 *     part[b P + j] = sum_{i<32} Wr[j, c0 + i] (nw y)[c0 + i]   for j < R,
 *     part[b P + R] = sum_{i<32} y[c0 + i]^2,                    P = R + 1;
 *   the last block to arrive adds the parts over b in order b = 0, 1, ...:
 *     logits[j] = rsqrt(sum_b part[b P + R] / H + eps) * sum_b part[b P + j].
 *   (The router GEMV's sums in another order.) Per block, with the affine codes q of Wr's row j
 *   (scale s, bias t of the group holding c0, group >= 32):
 *     sum_i (s q_i + t) v_i = s sum_i q_i v_i + t sum_i v_i,  v = nw y.
 *
 * Layouts: W, o, y as gemv_q2 (gemv.cu); Wr MLX affine 4 or 8 bits, packed u32 [R, H bits / 32],
 *   scales/biases (bf16 or f16) [R, H / group]; nw f32 [H]; part f32 [G, P]; logits f32 [R].
 *
 * Geometry: Wide, 512 threads, grid G = H / 32 <= SMs, so each warp has exactly one row group
 *   and block b's rows are c0 .. c0 + 31 (the host checks); R <= 512. Before the PDL wait thread
 *   j < R requests its row's 32 codes (bits words) and the aligned words holding their scale and
 *   bias (the arrays' last element, at an even index, is loaded alone), and threads 0-7 the
 *   block's 32 norm weights, into shared memory (cp.async: no registers held across the GEMV);
 *   they are waited for after it. Arrival: a u64 counter raised by one a block,
 *   G a launch (never reset: every launch on one counter has the same G), the block whose add
 *   makes it a multiple of G is the last; it reads the parts through the L2 after a fence.
 *   With ids (tailk) the last block's warp 0 then runs the MoE's top-K on those logits.
 *
 * Fixed-point sums (gemv_q2_route_fx, the default since session 50; LILY_CUDA_ROUTE_SUM=parts
 *   the form above): instead of writing its R logit parts, block b adds them to R int64
 *   accumulators, acc[j] += round(part * 2^32) (two's complement in u64: integer adds, so the
 *   sum's bits do not depend on the blocks' order, and replays are bit-identical), and writes
 *   only its sum of squares to sq[b]. The last block then
 *   reads R accumulators (one L2 round trip instead of G / 16), zeroes them for the next launch,
 *   and adds sq in a fixed order. Layout in part (as u64 [R] then f32 [G] at float offset 2 R;
 *   zeroed before the first launch, zero again after every launch). A part's magnitude is clamped
 *   to 2^23 (so G <= 256 sums cannot overflow); resolution 2^-32 (~2.3e-10) absolute.
 *
 * Sums left for the MoE (gemv_q2_route_acc, LILY_CUDA_MOE_ROUTER=acc): the fixed-point form
 *   without the last block. Every block adds its parts and writes its sum of squares as above,
 *   then leaves: no arrival (ctr unused), no tail. moe_fused_q2s_acc (moe_fused2.cu) forms the
 *   logits from part and routes in each of its blocks, and its block 0 zeroes the accumulators
 *   once its blocks have met (every block has read them by then).
 *
 * Blocks of 16 rows (gemv_q2_route16_fx, gemv_q2_route16_acc; LILY_CUDA_ROUTE_ROWS=16): one row a
 *   warp (gq_body with NR = 1), so the grid is G = H / 16 (Qwen3.6: 128 of the 132 SMs, where
 *   blocks of 32 rows leave half the SMs idle) and a block's parts cover 16 columns (RB below:
 *   the block's rows, 32 or 16).
 */

#define RT_MAXR 512

/* cp.async into shared memory: 16 bytes (codes, norm weights), 8 (a 16-row block's 4-bit
   codes) or the 4-byte word holding a scale or bias; waited for by rt_copy_wait. */
__device__ __forceinline__ void rt_copy16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"((u32)__cvta_generic_to_shared(dst)), "l"(src)
                 : "memory");
}
__device__ __forceinline__ void rt_copy8(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"((u32)__cvta_generic_to_shared(dst)), "l"(src)
                 : "memory");
}
__device__ __forceinline__ void rt_copy4(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"((u32)__cvta_generic_to_shared(dst)), "l"(src)
                 : "memory");
}
__device__ __forceinline__ void rt_copy_wait() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

/* The requests before the wait: rw[8 j ..] router row j's codes of columns c0 .. c0 + RB - 1,
   rsb[2 j], rsb[2 j + 1] the words holding its scale and bias, nws the norm weights. */
template <int RB>
__device__ __forceinline__ void rt_request(const u32* wr, const u16* sr, const u16* br, int bits, int group, int H,
                                           int R, const float* nw, u32* rw, u32* rsb, float* nws) {
    const int j = threadIdx.x, c0 = RB * blockIdx.x;
    if (j < R) {
        const u32* src = wr + (long long)j * (H * bits / 32) + c0 * bits / 32;
        if (RB * bits < 128) /* 16 columns of 4 bits: 8 bytes */
            rt_copy8(rw + 8 * j, src);
        else
            for (int q = 0; q < RB * bits / 128; q++) rt_copy16(rw + 8 * j + 4 * q, src + 4 * q);
        long long gi = (long long)j * (H / group) + c0 / group, n = (long long)R * (H / group);
        if ((gi & 1) || gi + 1 < n) { /* the aligned word holding it lies inside the array */
            rt_copy4(rsb + 2 * j, sr + (gi & ~1ll));
            rt_copy4(rsb + 2 * j + 1, br + (gi & ~1ll));
        } else { /* the array's last element, at an even index: alone */
            rsb[2 * j] = sr[gi];
            rsb[2 * j + 1] = br[gi];
        }
    }
    if (j < RB / 4) rt_copy16(nws + 4 * j, nw + c0 + 4 * j);
}

/* sum_i q_i v_i over the RB codes of one row (BITS bits each, code k of a word at bits BITS k) */
template <int BITS, int RB>
__device__ __forceinline__ float rt_dot(const u32* rw, const float* v) {
    constexpr int PER = 32 / BITS;
    float a = 0.f;
#pragma unroll
    for (int w = 0; w < RB * BITS / 32; w++) {
        u32 word = rw[w];
#pragma unroll
        for (int k = 0; k < PER; k++) a += (float)((word >> (BITS * k)) & ((1u << BITS) - 1)) * v[w * PER + k];
    }
    return a;
}

/* With ids set (LILY_CUDA_MOE_ROUTER=tailk): the last block also runs the MoE's top-K of the
   logits (route_warp_smem of `mode`, K routed experts, the shared expert as slot K) into ids and
   wts [K + 1], which moe_fused_q2s_given (moe_fused2.cu) then reads instead of routing. */
struct RtRoute {
    int* ids = 0;
    float* wts = 0;
    int K = 0, renorm = 0, mode = 0;
};

/* round(v 2^32) as a two's-complement u64, |v| clamped to 2^23 (a NaN part becomes -2^23, but
   the NaN in y that made it also makes the sum of squares, and so every logit, NaN) */
__device__ __forceinline__ u64 rt_fx(float v) {
    v = fminf(fmaxf(v, -8388608.f), 8388608.f);
    return (u64)__float2ll_rn(v * 4294967296.f);
}
/* a sum of rt_fx values back to float: its two's-complement value times 2^-32 (rt_tail's last
   block and moe_fused_q2s_acc's blocks, moe_fused2.cu, so both give the same logit bits) */
__device__ __forceinline__ float rt_unfx(u64 v) { return (float)((double)(long long)v * (1.0 / 4294967296.0)); }

/* The route blocks' sums of squares sq[0 .. G) as a lane's share of them (lane-strided, in block
   order; warp_sum of the lanes' shares then gives the total the last block's and the MoE's
   readers all use, the same bits), in two halves so that a caller can issue other loads between:
   rt_sq_load issues every load at once (a loop of loads and dependent adds made one L2 round trip
   per 32 blocks, four at G = 128; at once: +1.4-1.5% decode at 256 and 4K, session 53, H100),
   rt_sq_add adds them in order (the blocks past RT_SQN * 32, if any, loaded there one by one). */
constexpr int RT_SQN = 8;
struct RtSq {
    float v[RT_SQN];
};
__device__ __forceinline__ void rt_sq_load(RtSq& s, const float* sq, int G) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int i = 0; i < RT_SQN; i++) s.v[i] = lane + 32 * i < G ? __ldcg(sq + lane + 32 * i) : 0.f;
}
__device__ __forceinline__ float rt_sq_add(const RtSq& s, const float* sq, int G) {
    const int lane = threadIdx.x & 31;
    float q = 0.f;
#pragma unroll
    for (int i = 0; i < RT_SQN; i++)
        if (lane + 32 * i < G) q += s.v[i];
    for (int b = lane + 32 * RT_SQN; b < G; b += 32) q += __ldcg(sq + b);
    return q;
}

/* The forms of the router's sums: parts added by the last block (gemv_q2_route), fixed point
   added by the last block (_fx), fixed point left for the MoE (_acc). */
constexpr int RT_PARTS = 0, RT_FX = 1, RT_ACC = 2;

/* After the GEMV: the block's parts, its arrival, and in the last block the logits. ys: the
   block's RB new y values (gq_body<YS>); sm: RT_MAXR + 1 floats of scratch (the last block's
   sums; may alias rw, read before the arrival's barrier); tot: 2 floats; last: 1 int. SUM
   RT_ACC: no arrival, nothing after the parts. RB: the block's rows (32 or 16). */
template <int SUM, int RB = 32>
__device__ __forceinline__ void rt_tail(const u32* rw, const u32* rsb, const float* nws, int bits_r, int group_r,
                                        int ty_r, int R, int H, float eps, float* part, float* logits, u64* ctr,
                                        const float* ys, float* vs, float* tot, float* sm, int* last,
                                        RtRoute rt = RtRoute{}, int* chosen = 0, float* wsel = 0) {
    constexpr bool FX = SUM != RT_PARTS;
    rt_copy_wait();
    __syncthreads(); /* every warp's rows in ys, every thread's copies landed */
    const int t = threadIdx.x, c0 = RB * blockIdx.x, P = R + 1;
    if (t < 32) {
        float yv = t < RB ? ys[t] : 0.f, v = t < RB ? yv * nws[t] : 0.f;
        vs[t] = v;
        float sv = warp_sum(v), sq = warp_sum(yv * yv);
        if (t == 0) {
            tot[0] = sv;
            tot[1] = sq;
        }
    }
    __syncthreads();
    float* pb = part + (long long)blockIdx.x * P;
    if (t < R) {
        float d = bits_r == 4 ? rt_dot<4, RB>(rw + 8 * t, vs) : rt_dot<8, RB>(rw + 8 * t, vs);
        int half = (int)(((long long)t * (H / group_r) + c0 / group_r) & 1);
        float s = half_bits((rsb[2 * t] >> (16 * half)) & 0xFFFFu, ty_r);
        float b = half_bits((rsb[2 * t + 1] >> (16 * half)) & 0xFFFFu, ty_r);
        if (FX) atomicAdd((u64*)part + t, rt_fx(s * d + b * tot[0]));
        else pb[t] = s * d + b * tot[0];
    }
    if (t == 0) {
        if (FX) part[2 * R + blockIdx.x] = tot[1];
        else pb[R] = tot[1];
    }
    if (SUM == RT_ACC) return;
    __syncthreads();
    if (t == 0) {
        __threadfence();
        u64 old = atomicAdd(ctr, 1ull);
        *last = (old + 1) % gridDim.x == 0;
    }
    __syncthreads();
    if (!*last) return;
    __threadfence();
    const int G = gridDim.x;
    if (FX) {
        if (t < R) {
            u64* acc = (u64*)part + t;
            u64 v = __ldcg(acc);
            __stcg(acc, 0ull);
            sm[t] = rt_unfx(v);
        }
        if (t < 32) {
            RtSq sq;
            rt_sq_load(sq, part + 2 * R, G);
            float q = warp_sum(rt_sq_add(sq, part + 2 * R, G));
            if (t == 0) sm[R] = q;
        }
    } else if (t < P) {
        float a = 0.f;
        int b = 0;
        for (; b + 16 <= G; b += 16) {
            float v[16];
#pragma unroll
            for (int u = 0; u < 16; u++) v[u] = __ldcg(part + (long long)(b + u) * P + t);
#pragma unroll
            for (int u = 0; u < 16; u++) a += v[u];
        }
        for (; b < G; b++) a += __ldcg(part + (long long)b * P + t);
        sm[t] = a;
    }
    __syncthreads();
    if (t < R) {
        float v = sm[t] * (1.f / sqrtf(sm[R] / (float)H + eps));
        logits[t] = v;
        sm[t] = v; /* sm[R] stays: every thread has read it */
    }
    if (!rt.ids) return;
    __syncthreads();
    if (t < 32) { /* the MoE's top-K (moe.cu), its slot K the shared expert (logit E = R - 1) */
        route_warp_smem(rt.mode, sm, R - 1, rt.K, rt.renorm, chosen, wsel);
        if (t <= rt.K) {
            rt.ids[t] = chosen[t];
            rt.wts[t] = wsel[t];
        }
    }
}

#define RT_GEMV(B, T)                                                                                               \
    gq_body<B, T, RB / 16, 2, false, false, false, true>((const u32*)w, (const u16*)sc, (const u16*)bi,      \
                                                                group, x, y, rows, cols, 0, 1, nullptr, 0.f, xs,   \
                                                                red, 0, 1, ConvEpi{0, 0, 0, 0, 1}, -1, 0, 0, 0, 0, \
                                                                ys)
template <int SUM, int RB = 32>
__device__ __forceinline__ void gemv_q2_route_body(GemvRouteParams_fields) {
    extern __shared__ __align__(16) float xs[]; /* gq_body's staging: cols + cols/EPV floats */
    __shared__ float red[33], ys[32], vs[32], tot[2];
    __shared__ __align__(16) float nws[32];
    __shared__ __align__(16) u32 rw[RT_MAXR * 8]; /* 16 KB: the codes; then the last block's sums */
    __shared__ u32 rsb[RT_MAXR * 2];
    __shared__ int last;
    pdl_trigger();
    rt_request<RB>((const u32*)wr, (const u16*)sr, (const u16*)br, bits_r, group_r, rows, R, nw, rw, rsb, nws);
    if (bits == 4 && ty == TY_BF16) RT_GEMV(4, TY_BF16);
    else if (bits == 4) RT_GEMV(4, TY_F16);
    else if (ty == TY_BF16) RT_GEMV(8, TY_BF16);
    else RT_GEMV(8, TY_F16);
    rt_tail<SUM, RB>(rw, rsb, nws, bits_r, group_r, ty_r, R, rows, eps, part, logits, ctr, ys, vs, tot, (float*)rw,
                     &last, RtRoute{ids, wts, K, renorm, mode}, (int*)rsb, (float*)rsb + 128);
}
extern "C" __global__ void __launch_bounds__(512) gemv_q2_route(GemvRouteParams_fields) {
    TL_SCOPE("gemv_q2_route");
    gemv_q2_route_body<RT_PARTS>(GemvRouteParams_names);
}
extern "C" __global__ void __launch_bounds__(512) gemv_q2_route_fx(GemvRouteParams_fields) {
    TL_SCOPE("gemv_q2_route_fx");
    gemv_q2_route_body<RT_FX>(GemvRouteParams_names);
}
extern "C" __global__ void __launch_bounds__(512) gemv_q2_route_acc(GemvRouteParams_fields) {
    TL_SCOPE("gemv_q2_route_acc");
    gemv_q2_route_body<RT_ACC>(GemvRouteParams_names);
}
extern "C" __global__ void __launch_bounds__(512) gemv_q2_route16_fx(GemvRouteParams_fields) {
    TL_SCOPE("gemv_q2_route16_fx");
    gemv_q2_route_body<RT_FX, 16>(GemvRouteParams_names);
}
extern "C" __global__ void __launch_bounds__(512) gemv_q2_route16_acc(GemvRouteParams_fields) {
    TL_SCOPE("gemv_q2_route16_acc");
    gemv_q2_route_body<RT_ACC, 16>(GemvRouteParams_names);
}
#undef RT_GEMV
