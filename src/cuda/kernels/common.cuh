/*
 * common.cuh: the prelude every lily kernel is compiled with (NVRTC, no system headers needed).
 *
 * - Element types of weights and scales are passed as a runtime code: 0 = f32, 1 = f16, 2 = bf16
 *   (bf16 -> f32 is a 16-bit shift; f16 -> f32 is one cvt instruction), so one kernel serves
 *   every checkpoint format without including cuda_bf16.h / cuda_fp16.h.
 * - Reductions: warp_sum / warp_max with shuffles; block_sum over up to 32 warps through a
 *   32-float shared scratch (every thread gets the total).
 * - Programmatic dependent launch (decode): kernels in src/cuda/mod.rs PDL_KERNELS may be launched
 *   before the previous kernel in the stream has finished. Each of them calls pdl_trigger() (lets
 *   the next kernel's blocks be scheduled as SMs free up) and pdl_wait() (blocks until the
 *   previous grid has completed and its writes are visible) before it reads or writes any
 *   activation; only reads of weights may come before pdl_wait(). pdl_begin() = both, first
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
/* Sum over the whole block (blockDim.x a multiple of 32); `sh` holds >= 33 floats. */
__device__ __forceinline__ float block_sum(float v, float* sh) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) sh[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float t = lane < nw ? sh[lane] : 0.f;
        t = warp_sum(t);
        if (lane == 0) sh[32] = t;
    }
    __syncthreads();
    return sh[32];
}
__device__ __forceinline__ float sigmoid_f(float x) { return 1.f / (1.f + expf(-x)); }
__device__ __forceinline__ float silu_f(float x) { return x / (1.f + expf(-x)); }
__device__ __forceinline__ float softplus_f(float x) { return x > 20.f ? x : log1pf(expf(x)); }
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
__device__ __forceinline__ void pdl_begin() {
    pdl_trigger();
    pdl_wait();
}
