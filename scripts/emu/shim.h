// Host emulation of the CUDA pieces the decode kernels use: one std::thread per CUDA thread, the
// blocks of a grid run concurrently; __syncthreads a block barrier, warp shuffles and reductions
// through a per-warp exchange, grid_wait (the blocks' meeting) a grid barrier.
#pragma once
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <thread>
#include <type_traits>
#include <vector>
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static
#define __restrict__
struct float4 { float x, y, z, w; };
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
struct int2 { int x, y; };
struct ulonglong2 { unsigned long long x, y; };
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int2 make_int2(int a, int b) { return {a, b}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline uint2 make_uint2(unsigned a, unsigned b) { return {a, b}; }
struct Dim3 { unsigned x = 0, y = 0, z = 0; };
struct EmuWarp { std::barrier<>* bar; unsigned v[32]; };
struct EmuBlock { std::barrier<>* bar; std::barrier<>* rbar; EmuWarp warps[32]; };
inline thread_local Dim3 threadIdx, blockIdx;
inline thread_local EmuBlock* emu_blk;
inline Dim3 blockDim, gridDim;
inline std::barrier<>* emu_grid_bar;
inline void __syncthreads() { emu_blk->bar->arrive_and_wait(); }
inline void __syncwarp();
inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
inline EmuWarp& emu_warp() { return emu_blk->warps[threadIdx.x >> 5]; }
template <class T> inline T emu_xchg(T v, int src) {
    int lane = threadIdx.x & 31; EmuWarp& W = emu_warp();
    unsigned u; memcpy(&u, &v, 4); W.v[lane] = u; W.bar->arrive_and_wait();
    unsigned r = W.v[src & 31]; W.bar->arrive_and_wait(); T out; memcpy(&out, &r, 4); return out;
}
inline float __shfl_xor_sync(unsigned, float v, int o) { return emu_xchg(v, (threadIdx.x & 31) ^ o); }
inline int __shfl_xor_sync(unsigned, int v, int o) { return emu_xchg(v, (threadIdx.x & 31) ^ o); }
inline unsigned __shfl_xor_sync(unsigned, unsigned v, int o) { return emu_xchg(v, (threadIdx.x & 31) ^ o); }
inline unsigned long long __shfl_xor_sync(unsigned m, unsigned long long v, int o) {
    unsigned lo = __shfl_xor_sync(m, (unsigned)v, o), hi = __shfl_xor_sync(m, (unsigned)(v >> 32), o);
    return ((unsigned long long)hi << 32) | lo;
}
inline float __shfl_down_sync(unsigned, float v, int o) { int l = threadIdx.x & 31; return emu_xchg(v, l + o < 32 ? l + o : l); }
inline float __shfl_sync(unsigned, float v, int s) { return emu_xchg(v, s); }
inline int __shfl_sync(unsigned, int v, int s) { return emu_xchg(v, s); }
inline unsigned emu_reduce(unsigned v, bool mx) {
    int lane = threadIdx.x & 31; EmuWarp& W = emu_warp();
    W.v[lane] = v; W.bar->arrive_and_wait();
    unsigned r = W.v[0]; for (int i = 1; i < 32; i++) r = mx ? (W.v[i] > r ? W.v[i] : r) : (W.v[i] < r ? W.v[i] : r);
    W.bar->arrive_and_wait(); return r;
}
inline unsigned __reduce_max_sync(unsigned, unsigned v) { return emu_reduce(v, true); }
inline unsigned __reduce_min_sync(unsigned, unsigned v) { return emu_reduce(v, false); }
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    uint8_t b[8]; for (int i = 0; i < 4; i++) { b[i] = (x >> (8 * i)) & 0xFF; b[4 + i] = (y >> (8 * i)) & 0xFF; }
    unsigned r = 0; for (int i = 0; i < 4; i++) r |= (unsigned)b[(s >> (4 * i)) & 7] << (8 * i); return r;
}
inline int __dp4a(int a, int b, int c) {
    for (int i = 0; i < 4; i++) c += (int)(int8_t)((a >> (8 * i)) & 0xFF) * (int)(int8_t)((b >> (8 * i)) & 0xFF);
    return c;
}
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline int __ffs(int x) { return __builtin_ffs(x); }
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __ldcg(const T* p) { return *p; }
template <class T> inline void __stcg(T* p, T v) { *p = v; }
inline long long __float2ll_rn(float v) { return std::llrint(v); } /* round to nearest even: the default mode */
inline float f16_to_f32(unsigned short) { return NAN; }
inline unsigned long long global_ns() { return 0; }
inline uint4 ldg_stream(const uint4* p) { return *p; }
inline unsigned short ldg_u16_stream(const unsigned short* p) { return *p; } /* the L2 policy is a hint */
inline void pf_l2(const void*) {} /* an L2 prefetch: no effect on results */
/* Thread-block clusters (gdn_step_c4, LILY_EMU): emu_cluster blocks a cluster along x; the
   cluster barrier as the grid's (stronger: every block waits for all), a store into a cluster
   block's shared memory through each block's registered array (the one array written remotely). */
inline int emu_cluster = 1;
inline float* emu_cl_base[1024];
inline unsigned emu_cl_rank();
inline void emu_cl_wait();
inline void emu_cl_store(float* local, unsigned rank, float v) {
    int me = blockIdx.x;
    emu_cl_base[me - me % emu_cluster + rank][local - emu_cl_base[me]] = v;
}
inline void grid_wait(const unsigned long long*, unsigned long long) { emu_grid_bar->arrive_and_wait(); }
inline void grid_arrive_rel(unsigned long long*) { __syncthreads(); }
inline unsigned emu_cl_rank() { return blockIdx.x % emu_cluster; }
inline void emu_cl_wait() { emu_grid_bar->arrive_and_wait(); }
template <class T> inline T max(T a, T b) { return a > b ? a : b; }
template <class T> inline T min(T a, T b) { return a < b ? a : b; }
inline unsigned long long __cvta_generic_to_shared(const void* p) { return (unsigned long long)p; }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
/* integers atomically (last-arrival counters are raised by concurrent blocks) */
template <class T> inline T atomicAdd(T* p, T v) {
    if constexpr (std::is_integral_v<T>) return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
    T o = *p; *p += v; return o;
}
inline void cp_async16(unsigned, const void*, int) {}
// Runs f() as a grid of G blocks of T threads, all concurrently.
inline void emu_launch(int G, int T, const std::function<void()>& f) {
    gridDim.x = G; blockDim.x = T;
    std::barrier<> grid(G * T); emu_grid_bar = &grid;
    std::vector<EmuBlock> blocks(G);
    std::vector<std::barrier<>*> own;
    for (auto& b : blocks) { own.push_back(new std::barrier<>(T)); b.bar = own.back(); own.push_back(new std::barrier<>(T < 256 ? T : 256)); b.rbar = own.back(); for (int w = 0; w < T / 32; w++) { own.push_back(new std::barrier<>(32)); b.warps[w].bar = own.back(); } }
    std::vector<std::thread> ts;
    for (int b = 0; b < G; b++) for (int t = 0; t < T; t++) ts.emplace_back([&, b, t] { blockIdx.x = b; threadIdx.x = t; emu_blk = &blocks[b]; f(); });
    for (auto& t : ts) t.join();
    for (auto* p : own) delete p;
}
inline int __shfl_up_sync(unsigned, int v, int o) { int l = threadIdx.x & 31; return emu_xchg(v, l - o >= 0 ? l - o : l); }
inline float __shfl_up_sync(unsigned, float v, int o) { int l = threadIdx.x & 31; return emu_xchg(v, l - o >= 0 ? l - o : l); }
inline void __syncwarp() { emu_warp().bar->arrive_and_wait(); }
struct float2 { float x, y; };
inline float2 make_float2(float a, float b) { return {a, b}; }
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }
template <class T> inline T atomicExch(T* p, T v) { T o = *p; *p = v; return o; }
inline unsigned long long ld_relaxed_u64(const unsigned long long* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
/* attention_dec.cu's dec_fold: its mergers poll the counter (yielding: the blocks they wait for
   share the host's cores) */
inline unsigned long long ld_acquire_u64(const unsigned long long* p) {
    std::this_thread::yield();
    return __atomic_load_n(p, __ATOMIC_ACQUIRE);
}
inline void ctr_add_relaxed(unsigned long long* p) { __atomic_fetch_add(p, 1, __ATOMIC_RELAXED); }
inline unsigned long long __shfl_up_sync(unsigned m, unsigned long long v, int o) {
    int l = threadIdx.x & 31, s = l - o >= 0 ? l - o : l;
    unsigned lo = emu_xchg((unsigned)v, s), hi = emu_xchg((unsigned)(v >> 32), s);
    return ((unsigned long long)hi << 32) | lo;
}
inline unsigned __ballot_sync(unsigned, int p) {
    int lane = threadIdx.x & 31; EmuWarp& W = emu_warp();
    W.v[lane] = p != 0; W.bar->arrive_and_wait(); unsigned r = 0; for (int i = 0; i < 32; i++) r |= W.v[i] << i; W.bar->arrive_and_wait(); return r;
}
inline unsigned __match_any_sync(unsigned, unsigned v) {
    int lane = threadIdx.x & 31; EmuWarp& W = emu_warp();
    W.v[lane] = v; W.bar->arrive_and_wait(); unsigned r = 0; for (int i = 0; i < 32; i++) r |= (unsigned)(W.v[i] == v) << i; W.bar->arrive_and_wait(); return r;
}
inline unsigned __reduce_add_sync(unsigned, unsigned v) {
    int lane = threadIdx.x & 31; EmuWarp& W = emu_warp();
    W.v[lane] = v; W.bar->arrive_and_wait(); unsigned r = 0; for (int i = 0; i < 32; i++) r += W.v[i]; W.bar->arrive_and_wait(); return r;
}
/* moe_fused2.cu's routing warps' named barrier (256 threads of the block) */
inline void mf2_rbar() { emu_blk->rbar->arrive_and_wait(); }
/* pstep.cu: the consumer warps' named barrier (the emulated block is the consumers) */
inline void ps_cbar() { __syncthreads(); }
/* common.cuh's LL words (float | tag << 32): atomic accesses, the reader polls for the tag (the
   emulated blocks run at once, as on the device) */
inline void ll_store(float* y, int i, float v, unsigned tag) {
    __atomic_store_n((unsigned long long*)y + i, (unsigned long long)tag << 32 | __float_as_uint(v), __ATOMIC_RELEASE);
}
template <int N>
inline void ll_load(const unsigned long long* p, unsigned tag, float (&v)[N]) {
    for (int j = 0; j < N; j++) {
        unsigned long long w;
        while ((unsigned)((w = __atomic_load_n(p + j, __ATOMIC_ACQUIRE)) >> 32) != tag) std::this_thread::yield();
        v[j] = __uint_as_float((unsigned)w);
    }
}
/* gemv_route.cu's cp.async requests: plain copies (rt_copy_wait then has nothing to wait for) */
inline void rt_copy16(void* d, const void* s) { memcpy(d, s, 16); }
inline void rt_copy8(void* d, const void* s) { memcpy(d, s, 8); }
inline void rt_copy4(void* d, const void* s) { memcpy(d, s, 4); }
inline void rt_copy_wait() {}
