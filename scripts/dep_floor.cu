// What one dependent step of a decode costs on this GPU before any of lily's work: a chain of
// STEPS steps, each reading the whole vector the step before wrote, run three ways.
//
// Step k (x_k: H floats; x_{k+1}[i] = x_k[H-1-i] + 1e-3 mean(x_k): each block's slice reads other
// blocks' values, and every block sums all of x_k in one fixed order, so all get the same mean):
//   graph  : one kernel a step, STEPS kernels captured into a CUDA graph in stream order.
//   pdl    : the same kernels with programmatic dependent launch (each kernel triggers its
//            dependents at entry and waits with griddepcontrol.wait before it reads x_k), as
//            lily's decode graph launches its kernels.
//   counter: one kernel of G co-resident blocks for all STEPS steps; a block starts step k when
//            a counter reaches k·G (thread 0 polls it with ld.acquire.gpu) and ends it with one
//            red.release.gpu.add (lily's persistent step and moe_fused_q2s's meeting work so).
// Each step can also stream NV 16-byte "weight" words a thread (a zeroed buffer, STEPS·G·T·NV·16
// bytes in all, each step its own slice): requested before the wait (graph: at entry; counter:
// before the poll), folded in after it. Time per step = (dependency floor) + (what the bytes add).
// "ahead D": a step also requests the weights of step k + D into the L2 (prefetch.global.L2, one
// per 128-byte line) before its wait, so D steps of bytes are in flight across the dependencies
// (the persistent-kernel argument: weights never wait for activations).
// Launch geometry: G blocks of T = 256 threads; the counter form needs all G resident at once
// (checked with the occupancy query).
// Output: "check" lines (each form's final vector against a double-precision CPU chain), then a
// table of µs per step. Build and run: nvcc -arch=sm_90a -O3 -o /tmp/dep_floor scripts/dep_floor.cu
#include <cuda_runtime.h>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "ck.cuh"

constexpr int H = 2048, T = 256, STEPS = 223, MAXNV = 12;
typedef unsigned long long u64;

__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

/* every block: the sum of all H values of x (thread t adds t, t+T, ... in order, then a fixed tree) */
__device__ __forceinline__ float block_total(const float* x, float* red) {
    float s = 0.f;
    for (int i = threadIdx.x; i < H; i += T) s += __ldcg(x + i);
    for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = s;
    __syncthreads();
    float t = 0.f;
    for (int w = 0; w < T / 32; w++) t += red[w];
    __syncthreads();
    return t;
}

/* this block's slice of x_{k+1}; `wx` is the xor of the step's weight words (always 0) */
__device__ __forceinline__ void write_slice(const float* x, float* y, float total, unsigned wx) {
    int per = (H + gridDim.x - 1) / gridDim.x, i0 = blockIdx.x * per;
    for (int i = i0 + threadIdx.x; i < min(H, i0 + per); i += T) {
        float v = __ldcg(x + (H - 1 - i)) + 1e-3f * (total / H);
        y[i] = wx ? v + 1.f : v;
    }
}

template <int NV>
__device__ __forceinline__ void load_w(const uint4* w, uint4 (&r)[MAXNV]) {
    long long base = ((long long)blockIdx.x * T + threadIdx.x) * NV;
#pragma unroll
    for (int j = 0; j < NV; j++) r[j] = __ldg(w + base + j);
}
template <int NV>
__device__ __forceinline__ unsigned fold_w(const uint4 (&r)[MAXNV]) {
    unsigned a = 0;
#pragma unroll
    for (int j = 0; j < NV; j++) a ^= r[j].x ^ r[j].y ^ r[j].z ^ r[j].w;
    return a;
}

/* this block's share of a step's weight slice `w` into the L2 */
template <int NV>
__device__ __forceinline__ void ahead_l2(const uint4* w) {
    const char* b = (const char*)(w + (long long)blockIdx.x * T * NV);
    for (int l = threadIdx.x; l < NV * T * 16 / 128; l += T) asm volatile("prefetch.global.L2 [%0];" ::"l"(b + 128 * l));
}

template <int NV, bool PDL>
__global__ void __launch_bounds__(T) step_kernel(const float* x, float* y, const uint4* w, const uint4* wa) {
    __shared__ float red[T / 32];
    uint4 r[MAXNV];
    if (PDL) pdl_trigger();
    load_w<NV>(w, r);
    if (NV && wa) ahead_l2<NV>(wa);
    if (PDL) pdl_wait();
    float total = block_total(x, red);
    write_slice(x, y, total, fold_w<NV>(r));
}

template <int NV>
__global__ void __launch_bounds__(T, 1) chain_kernel(float* buf, const uint4* w, u64* ctr, u64 base, int ahead) {
    __shared__ float red[T / 32];
    uint4 r[MAXNV];
    const long long slice = (long long)gridDim.x * T * NV;
    if (NV)
        for (int k = 0; k < ahead; k++) ahead_l2<NV>(w + k * slice);
    for (int k = 0; k < STEPS; k++) {
        load_w<NV>(w + k * slice, r);
        if (NV && ahead) ahead_l2<NV>(w + (k + ahead) * slice);
        if (threadIdx.x == 0) {
            u64 v, target = base + (u64)k * gridDim.x;
            do {
                asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(ctr) : "memory");
            } while (v < target);
        }
        __syncthreads();
        const float* x = buf + (k & 1) * H;
        float total = block_total(x, red);
        write_slice(x, buf + ((k + 1) & 1) * H, total, fold_w<NV>(r));
        __syncthreads();
        if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u64 [%0], 1;" ::"l"(ctr) : "memory");
    }
}

static std::vector<double> cpu_chain(const std::vector<float>& x0) {
    std::vector<double> x(x0.begin(), x0.end());
    for (int k = 0; k < STEPS; k++) {
        double s = 0;
        for (double v : x) s += v;
        std::vector<double> y(H);
        for (int i = 0; i < H; i++) y[i] = x[H - 1 - i] + 1e-3 * (s / H);
        x = y;
    }
    return x;
}

static int fails = 0;
static void check(const char* what, const std::vector<float>& got, const std::vector<double>& want) {
    double e = 0, n = 0;
    for (int i = 0; i < H; i++) e += (got[i] - want[i]) * (got[i] - want[i]), n += want[i] * want[i];
    double r = std::sqrt(e / n);
    printf("check %-28s rel. error %.2e%s\n", what, r, r < 1e-5 ? "" : "  FAIL");
    fails += !(r < 1e-5);
}

struct Ctx {
    float* buf;
    uint4* w;
    u64* ctr;
    cudaStream_t s;
    std::vector<float> x0;
};

template <int NV, bool PDL>
static cudaGraphExec_t capture(Ctx& c, int G, int ahead) {
    cudaGraph_t g;
    CK(cudaStreamBeginCapture(c.s, cudaStreamCaptureModeGlobal));
    for (int k = 0; k < STEPS; k++) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(G);
        cfg.blockDim = dim3(T);
        cfg.stream = c.s;
        cudaLaunchAttribute at[1];
        at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        at[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = at;
        cfg.numAttrs = PDL ? 1 : 0;
        const float* x = c.buf + (k & 1) * H;
        float* y = c.buf + ((k + 1) & 1) * H;
        const uint4* w = c.w + (long long)k * G * T * NV;
        const uint4* wa = ahead ? w + (long long)ahead * G * T * NV : nullptr;
        CK(cudaLaunchKernelEx(&cfg, step_kernel<NV, PDL>, x, y, w, wa));
    }
    CK(cudaStreamEndCapture(c.s, &g));
    cudaGraphExec_t e;
    CK(cudaGraphInstantiate(&e, g, 0));
    CK(cudaGraphDestroy(g));
    return e;
}

static u64 ctr_base = 0; /* what the counter holds before the next chain_kernel launch */

template <int NV>
static float run(Ctx& c, int ahead, int G, int reps, cudaGraphExec_t e) {
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    CK(cudaEventRecord(a, c.s));
    for (int r = 0; r < reps; r++) {
        if (!e) {
            chain_kernel<NV><<<G, T, 0, c.s>>>(c.buf, c.w, c.ctr, ctr_base, ahead);
            CK(cudaGetLastError());
            ctr_base += (u64)STEPS * G;
        } else {
            CK(cudaGraphLaunch(e, c.s));
        }
    }
    CK(cudaEventRecord(b, c.s));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    return ms * 1000.f / (reps * STEPS);
}

/* the forms: graph, pdl, pdl ahead 2, counter, counter ahead 1, 2, 3 */
constexpr int NF = 7;
static const char* form_names[NF] = {"graph", "pdl", "pdl ahead 2", "counter", "counter ahead 1", "counter ahead 2",
                                     "counter ahead 3"};

template <int NV>
static std::string measure(Ctx& c, int G, int sms) {
    std::vector<double> want = cpu_chain(c.x0);
    cudaGraphExec_t ge[3] = {capture<NV, false>(c, G, 0), capture<NV, true>(c, G, 0), capture<NV, true>(c, G, 2)};
    int occ = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, chain_kernel<NV>, T, 0));
    bool counter_ok = occ * sms >= G;
    std::string row;
    char cell[64];
    snprintf(cell, sizeof cell, "| %d | %d | %.2f |", G, NV, (double)G * T * NV * 16 / 1e6);
    row += cell;
    for (int f = 0; f < NF; f++) {
        cudaGraphExec_t e = f < 3 ? ge[f] : nullptr;
        int ahead = f == 2 ? 2 : f > 3 ? f - 3 : 0;
        if ((!e && !counter_ok) || (ahead && !NV)) {
            row += " |";
            continue;
        }
        /* one chain from x0 (buf[0]); STEPS is odd, so the result is in buf[1] */
        CK(cudaMemcpy(c.buf, c.x0.data(), 4 * H, cudaMemcpyHostToDevice));
        run<NV>(c, ahead, G, 1, e);
        std::vector<float> got(H);
        CK(cudaMemcpy(got.data(), c.buf + (STEPS & 1) * H, 4 * H, cudaMemcpyDeviceToHost));
        char what[64];
        snprintf(what, sizeof what, "%s G%d NV%d", form_names[f], G, NV);
        check(what, got, want);
        run<NV>(c, ahead, G, 5, e); /* warm */
        float best = 1e30f;
        for (int i = 0; i < 5; i++) best = fminf(best, run<NV>(c, ahead, G, 20, e));
        snprintf(cell, sizeof cell, " %.2f |", best);
        row += cell;
    }
    for (auto e : ge) CK(cudaGraphExecDestroy(e));
    return row + "\n";
}

int main() {
    cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    int sms = p.multiProcessorCount;
    printf("device: %s, %d SMs\n", p.name, sms);
    Ctx c;
    c.x0.resize(H);
    for (int i = 0; i < H; i++) c.x0[i] = (float)((i * 2654435761u) % 1000) / 1000.f - 0.5f;
    CK(cudaMalloc(&c.buf, 2 * 4 * H));
    size_t wbytes = (size_t)(STEPS + 4) * 2 * sms * T * MAXNV * 16; /* + the ahead forms' overrun */
    CK(cudaMalloc(&c.w, wbytes));
    CK(cudaMemset(c.w, 0, wbytes));
    CK(cudaMalloc(&c.ctr, 8));
    CK(cudaMemset(c.ctr, 0, 8));
    CK(cudaStreamCreateWithFlags(&c.s, cudaStreamNonBlocking));
    std::string table;
    for (int G : {sms, 2 * sms}) {
        table += measure<0>(c, G, sms);
        table += measure<4>(c, G, sms);
        table += measure<12>(c, G, sms);
    }
    printf("µs a step (best of 5 runs of 20 chains of %d steps):\n| blocks | words a thread | MB a step |", STEPS);
    for (auto n : form_names) printf(" %s |", n);
    printf("\n|---:|---:|---:|");
    for (int f = 0; f < NF; f++) printf("---:|");
    printf("\n%s", table.c_str());
    printf("dep_floor: %d failures\n", fails);
    return fails ? 1 : 0;
}
