/*
 * common.cuh: the prelude every lily kernel is compiled with (NVRTC, no system headers needed).
 *
 * - Element types of weights and scales are passed as a runtime code: 0 = f32, 1 = f16, 2 = bf16
 *   (bf16 -> f32 is a 16-bit shift; f16 -> f32 is one cvt instruction), so one kernel serves
 *   every checkpoint format without including cuda_bf16.h / cuda_fp16.h.
 * - Reductions: warp_sum / warp_max with shuffles; block_sum / block_max over up to 32 warps
 *   through a 33-float shared scratch (every thread gets the result).
 * - Programmatic dependent launch (decode): the kernels for which is_pdl() holds
 *   (src/cuda/kernel_names.rs) may be launched before the previous kernel in the stream has
 *   finished. Each of them calls pdl_trigger() (lets the next kernel's blocks be scheduled as
 *   SMs free up) and pdl_wait() (blocks until the previous grid has completed and its writes
 *   are visible) before it reads or writes any activation; only reads of weights may come before pdl_wait(). pdl_begin() = both, first
 *   thing. Every such kernel waits before it exits, so completion stays transitive. Without the
 *   launch attribute both instructions return at once.
 * - All activations are fp32; accurate expf/sqrtf (no fast math), so results track the CPU
 *   reference up to summation order.
 */
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

#define TY_F32 0
#define TY_F16 1
#define TY_BF16 2

__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }
__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
/* Element i of a buffer of type `ty`. */
__device__ __forceinline__ float load_elem(const void* p, long long i, int ty) {
    if (ty == TY_F32) return ((const float*)p)[i];
    u16 h = ((const u16*)p)[i];
    return ty == TY_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
}
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
/* Sum (or with MAX the maximum) over the whole block (blockDim.x a multiple of 32); `sh` holds
   >= 33 floats. */
template <bool MAX> __device__ __forceinline__ float block_reduce(float v, float* sh) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = MAX ? warp_max(v) : warp_sum(v);
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float t = lane < nw ? sh[lane] : (MAX ? -INFINITY : 0.f);
        t = MAX ? warp_max(t) : warp_sum(t);
        if (lane == 0) sh[32] = t;
    }
    __syncthreads();
    return sh[32];
}
__device__ __forceinline__ float block_sum(float v, float* sh) { return block_reduce<false>(v, sh); }
__device__ __forceinline__ float block_max(float v, float* sh) { return block_reduce<true>(v, sh); }
__device__ __forceinline__ float sigmoid_f(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float silu_f(float x) { return x / (1.f + expf(-x)); }
__device__ __forceinline__ float softplus_f(float x) { return x > 20.f ? x : log1pf(expf(x)); }
__device__ __forceinline__ u64 global_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}

/* The step timeline (LILY_CUDA_TIMELINE=1, a measurement build: the host compiles the kernels
   with LILY_TIMELINE defined and points lily_tl_buf at a buffer of lily_tl_cap records). A kernel
   opening with TL_SCOPE("name") appends, when its block's thread 0 returns, one record of four
   u64: the global timer (ns) at the block's entry and at its return, the launch's %gridid, and
   fnv1a32(name) << 32 | smid << 24 | linear block index. */
#ifdef LILY_TIMELINE
__device__ u64* lily_tl_buf;
__device__ unsigned lily_tl_n, lily_tl_cap;
__host__ __device__ constexpr u32 tl_hash(const char* s) {
    u32 h = 0x811c9dc5u;
    for (; *s; s++) h = (h ^ (u32)(unsigned char)*s) * 0x01000193u;
    return h;
}
struct TlScope { /* three registers held through the kernel: the entry time's low word, buf */
    u32 tag, t0;
    u64* buf;
    __device__ TlScope(u32 tag_) : tag(tag_) {
        if (threadIdx.x == 0) {
            t0 = (u32)global_ns();
            buf = lily_tl_buf; /* loaded now, used at the return */
        }
    }
    __device__ ~TlScope() {
        if (threadIdx.x == 0 && buf) {
            u64 t1 = global_ns(), grid;
            u32 sm;
            asm volatile("mov.u32 %0, %smid;" : "=r"(sm));
            asm volatile("mov.u64 %0, %gridid;" : "=l"(grid));
            u32 b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
            /* the entry: t1's high word with t0's low one, one wrap back if that is after t1 */
            u64 e = (t1 & ~0xffffffffull) | t0;
            if (e > t1) e -= 1ull << 32;
            unsigned i = atomicAdd(&lily_tl_n, 1u);
            if (i < lily_tl_cap) {
                u64* r = buf + 4ull * i;
                r[0] = e;
                r[1] = t1;
                r[2] = grid;
                r[3] = ((u64)tag << 32) | ((u64)(sm & 0xff) << 24) | (b & 0xffffff);
            }
        }
    }
};
#define TL_SCOPE(name)                     \
    constexpr u32 tl_tag_ = tl_hash(name); \
    TlScope tl_scope_(tl_tag_)
#else
#define TL_SCOPE(name)
#endif

__device__ __forceinline__ void pdl_trigger() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
/* Timing traces (measurement switches): thread 0 writes the global timer (ns) to ts[i]. */
__device__ __forceinline__ void trace_stamp(u64* ts, int i) {
    if (ts && threadIdx.x == 0) ts[i] = global_ns();
}
/* Requests the 128-byte line holding p into the L2 (no register, no wait): a later load of it
   finds it there instead of in HBM (norm_pf below). */
__device__ __forceinline__ void pf_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }
/* LILY_NORM_PF (the default; LILY_CUDA_NORM_PF=0 builds without it): a fused RMSNorm's weights
   (n floats, a weight: last read a step ago, so in HBM) requested into the L2 before the PDL
   wait, one 128-byte line a thread, so the staging's loads after the wait, issued beside the
   input's from the L2, do not wait on HBM. */
__device__ __forceinline__ void norm_pf(const float* w, int n) {
#ifdef LILY_NORM_PF
    if (w)
        for (int l = threadIdx.x; l < n / 32; l += blockDim.x) pf_l2(w + 32 * l);
#endif
}
/* LL words (NCCL's "low latency" protocol; pstep): a float and its writer's
   tag in one 8-byte word, written and read whole (single-copy atomic), so a reader polls the
   data itself: no fence behind the writes, no counter between. A tag is never 0, so zeroed
   words are never taken for written ones. */
__device__ __forceinline__ void ll_store(float* y, int i, float v, u32 tag) {
    u64 w = (u64)tag << 32 | __float_as_uint(v);
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"((u64*)y + i), "l"(w) : "memory");
}
__device__ __forceinline__ void ll_ld2(const u64* p, u64& a, u64& b) {
    asm volatile("ld.relaxed.gpu.global.v2.u64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(p) : "memory");
}
/* N (even) floats from the LL words p[0..N) (16-byte aligned) once each carries `tag`. */
template <int N>
__device__ __forceinline__ void ll_load(const u64* p, u32 tag, float (&v)[N]) {
    u64 w[N];
    for (;;) {
        bool ok = true;
#pragma unroll
        for (int j = 0; j < N / 2; j++) ll_ld2(p + 2 * j, w[2 * j], w[2 * j + 1]);
#pragma unroll
        for (int j = 0; j < N; j++) ok &= (u32)(w[j] >> 32) == tag;
        if (ok) break;
        __nanosleep(32);
    }
#pragma unroll
    for (int j = 0; j < N; j++) v[j] = __uint_as_float((u32)w[j]);
}
__device__ __forceinline__ void ll_load8(const u64* p, u32 tag, float (&v)[8]) { ll_load<8>(p, tag, v); }
__device__ __forceinline__ void pdl_begin() {
    pdl_trigger();
    pdl_wait();
}
__device__ __forceinline__ u32 smem_u32(const void* p) { return (u32)__cvta_generic_to_shared(p); }
/* mbarriers (sm_90: pstep.cu, gemm_wt.cu): init, wait for a phase's parity, arrive, arrive with
   an expected transaction byte count, and a bulk global -> shared copy completing on one. */
#if __CUDA_ARCH__ >= 900
__device__ __forceinline__ void mb_init(u64* b, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(b)), "r"(count) : "memory");
}
/* The waiting threads are suspended (up to the hint, 20 µs, per try) instead of spinning, so a
   block's waiting consumers leave the issue slots to its producer. */
__device__ __forceinline__ void mb_wait(u64* b, u32 parity) {
    u32 a = smem_u32(b), done = 0;
    while (!done) {
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, %3; selp.u32 %0, 1, 0, p; }"
            : "=r"(done)
            : "r"(a), "r"(parity), "n"(20000)
            : "memory");
    }
}
__device__ __forceinline__ void mb_arrive(u64* b) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(b)) : "memory");
}
__device__ __forceinline__ void mb_expect(u64* b, u32 tx) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(b)), "r"(tx) : "memory");
}
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, u32 bytes, u64* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     smem_u32(dst)),
                 "l"(src), "r"(bytes), "r"(smem_u32(bar))
                 : "memory");
}
#endif
/* The decode step's streams: with LILY_L2_EVICT_FIRST (the default kernel source;
   LILY_CUDA_L2_HINT=none builds without it) the weight codes, their scales and biases and the decode
   attention's K/V tiles are loaded with an L2 evict-first policy, so that ~1.9 GB a token passing
   through the 50 MB L2 do not push out what every layer reuses (the kernels' code, the activations,
   the meeting counters). A cache hint: the loaded values, and so the results, are the same. */
#ifdef LILY_L2_EVICT_FIRST
__device__ __forceinline__ u64 l2_stream_pol() {
    u64 p;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p)); /* at each load: no register held */
    return p;
}
#endif
/* A 16-bit weight-side value (a scale or bias) of a stream, through the read-only path. */
__device__ __forceinline__ u16 ldg_u16_stream(const u16* p) {
#ifdef LILY_L2_EVICT_FIRST
    unsigned short v;
    asm("ld.global.nc.L2::cache_hint.u16 %0, [%1], %2;" : "=h"(v) : "l"(p), "l"(l2_stream_pol()));
    return v;
#else
    return __ldg(p);
#endif
}
/* cp.async (16 bytes; `bytes` < 16 zero-fills the rest), ldmatrix at a shared-space address, and
   mma.sync m16n8k16 bf16 -> fp32 (c += A B), shared by the tensor-core kernels. */
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
/* cp_async16 for a stream read once (the decode attention's K/V tiles): evict-first in L2 under
   LILY_L2_EVICT_FIRST. */
__device__ __forceinline__ void cp_async16_stream(u32 dst, const void* src, int bytes) {
#ifdef LILY_L2_EVICT_FIRST
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src), "r"(bytes),
                 "l"(l2_stream_pol())
                 : "memory");
#else
    cp_async16(dst, src, bytes);
#endif
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait1() { asm volatile("cp.async.wait_group 1;\n" ::: "memory"); }
__device__ __forceinline__ void ldsm_x4_at(u32 a, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(a));
}
__device__ __forceinline__ void ldsm_x4_trans_at(u32 a, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(a));
}
__device__ __forceinline__ void mma_bf16(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
