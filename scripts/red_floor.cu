// What it costs to add every block's 2,048 outputs into one vector with integer atomics, the
// step a meeting-free decode MoE would take (perf log, session 50: the down projection split over
// the intermediate dimension, each unit of work adding its H = 2,048 partial outputs into
// fixed-point accumulators, so no block waits for another).
//
// Each form is one kernel launched STEPS times in a stream (no PDL), timed with events; µs per
// launch, the best of REPS runs. U units of work = U blocks of T = 512 threads; unit b adds
// v(b, i) for i < H (thread t: i = t, t + T, ...):
//   empty  : the launch alone (the units write nothing).
//   red64  : red.global.add.u64 of round(v 2^32) into acc[H] (deterministic: integer adds).
//   red64 + fold: then the last unit to arrive (a u64 counter, fence, atomic add) reads acc, adds
//            acc 2^-32 into x[H] and zeroes acc for the next launch (what the MoE would do last).
//   redf32 : red.global.add.f32 into x (for scale only: float adds in arrival order are not
//            bit-reproducible, so lily cannot use them).
//   parts  : unit b stores its H values into parts[b][H]; the last unit adds the U parts of each
//            output in unit order into x (the deterministic form without atomics: one block
//            reads U·H floats).
// v(b, i) = ((7 b + 3 i) mod 13 − 6) / 1024: exact in float and in 32.32 fixed point, so every
// form's x after the runs is compared exactly against the CPU's sum.
// Build and run: nvcc -arch=sm_90a -O3 -o /tmp/red_floor scripts/red_floor.cu
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "ck.cuh"

constexpr int H = 2048, T = 512, STEPS = 200, REPS = 5;
typedef unsigned long long u64;

__host__ __device__ inline float val(int b, int i) { return (float)((7 * b + 3 * i) % 13 - 6) * (1.f / 1024.f); }

enum Form { EMPTY, RED64, RED64_FOLD, REDF32, PARTS };

/* The last of the grid's blocks to arrive on ctr (raised by gridDim.x a launch, never reset). */
__device__ __forceinline__ bool last_block(u64* ctr, int* flag) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        u64 old = atomicAdd(ctr, 1ull);
        *flag = (old + 1) % gridDim.x == 0;
    }
    __syncthreads();
    if (*flag) __threadfence();
    return *flag;
}

template <int F>
__global__ void __launch_bounds__(T) unit(u64* acc, float* x, float* parts, u64* ctr) {
    __shared__ int flag;
    const int b = blockIdx.x;
    for (int i = threadIdx.x; F != EMPTY && i < H; i += T) {
        float v = val(b, i);
        if (F == RED64 || F == RED64_FOLD) atomicAdd(acc + i, (u64)__float2ll_rn(v * 4294967296.f));
        if (F == REDF32) atomicAdd(x + i, v);
        if (F == PARTS) parts[(long long)b * H + i] = v;
    }
    if (F == EMPTY || F == RED64 || F == REDF32) return;
    if (!last_block(ctr, &flag)) return;
    for (int i = threadIdx.x; i < H; i += T) {
        if (F == RED64_FOLD) {
            long long a = (long long)__ldcg(acc + i);
            __stcg(acc + i, 0ull);
            x[i] += (float)((double)a * (1.0 / 4294967296.0));
        } else {
            float s = 0.f;
            for (int u = 0; u < (int)gridDim.x; u++) s += __ldcg(parts + (long long)u * H + i);
            x[i] += s;
        }
    }
}

template <int F>
static double run(int units, u64* acc, float* x, float* parts, u64* ctr, int launches) {
    cudaEvent_t a, z;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&z));
    CK(cudaEventRecord(a));
    for (int s = 0; s < launches; s++) unit<F><<<units, T>>>(acc, x, parts, ctr);
    CK(cudaEventRecord(z));
    CK(cudaEventSynchronize(z));
    CK(cudaGetLastError());
    float ms = 0.f;
    CK(cudaEventElapsedTime(&ms, a, z));
    return 1000.0 * ms / launches;
}

int main() {
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const int maxu = 288;
    u64 *acc, *ctr;
    float *x, *parts;
    CK(cudaMalloc(&acc, H * 8));
    CK(cudaMalloc(&ctr, 8));
    CK(cudaMalloc(&x, H * 4));
    CK(cudaMalloc(&parts, (size_t)maxu * H * 4));
    const char* names[] = {"empty", "red64", "red64 + fold", "redf32", "parts + fold"};
    char rows[3][160];
    int nrows = 0;
    bool ok = true;
    for (int units : {72, 144, 288}) {
        double best[5];
        for (int f = 0; f < 5; f++) best[f] = 1e9;
        for (int r = 0; r < REPS; r++) {
            for (int f = 0; f < 5; f++) {
                CK(cudaMemset(acc, 0, H * 8));
                CK(cudaMemset(ctr, 0, 8));
                CK(cudaMemset(x, 0, H * 4));
                double us = 0;
                if (f == EMPTY) us = run<EMPTY>(units, acc, x, parts, ctr, STEPS);
                if (f == RED64) us = run<RED64>(units, acc, x, parts, ctr, STEPS);
                if (f == RED64_FOLD) us = run<RED64_FOLD>(units, acc, x, parts, ctr, STEPS);
                if (f == REDF32) us = run<REDF32>(units, acc, x, parts, ctr, STEPS);
                if (f == PARTS) us = run<PARTS>(units, acc, x, parts, ctr, STEPS);
                CK(cudaDeviceSynchronize());
                best[f] = us < best[f] ? us : best[f];
                if (r == 0 && (f == RED64_FOLD || f == PARTS || f == REDF32)) {
                    /* x = STEPS times the sum over units (small integers / 1024: exact) */
                    std::vector<float> got(H);
                    std::vector<u64> left(H);
                    CK(cudaMemcpy(got.data(), x, H * 4, cudaMemcpyDeviceToHost));
                    CK(cudaMemcpy(left.data(), acc, H * 8, cudaMemcpyDeviceToHost));
                    int bad = 0;
                    for (int i = 0; i < H; i++) {
                        double want = 0;
                        for (int b = 0; b < units; b++) want += val(b, i);
                        want *= STEPS;
                        bad += got[i] != (float)want || (f == RED64_FOLD && left[i] != 0);
                    }
                    printf("check %s, %d units: %d of %d outputs differ from the CPU's sum\n", names[f], units, bad, H);
                    ok &= bad == 0;
                }
            }
        }
        snprintf(rows[nrows++], sizeof rows[0], "| %d | %.2f | %.2f | %.2f | %.2f | %.2f |", units, best[0], best[1],
                 best[2], best[3], best[4]);
    }
    printf("| units (blocks of %d) | %s | %s | %s | %s | %s |\n|---:|---:|---:|---:|---:|---:|\n", T, names[0],
           names[1], names[2], names[3], names[4]);
    for (int r = 0; r < nrows; r++) printf("%s\n", rows[r]);
    printf("(%d SMs; µs a launch, best of %d runs of %d launches in one stream)\n", sms, REPS, STEPS);
    return ok ? 0 : 1;
}
