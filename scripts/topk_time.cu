/*
 * topk_time.cu: how long the router's top-K (route_warp_smem's redux2 form, moe.cu: the graph's
 * moe_fused_q2s and the persistent step's ps_route) takes on one warp, in SM cycles (clock64),
 * alone and beside 15 warps of FMA work as in the persistent step. Not part of lily: appended by
 * scripts/topk_time.sh to moe.cu and what it needs from lily's kernel source, and compiled by
 * nvcc on the GPU machine. Launch: one block of 32 or 512 threads; warp 0 ranks E = 256 random
 * logits (+ the shared gate) 200 times in shared memory, each round depending on the last.
 */
#include <cstdio>
#include <cstdlib>
extern "C" __global__ void topk_time(const float* logits, int E, int K, int reps, int busy, long long* cyc, int* out) {
    __shared__ float ls[520];
    __shared__ int chosen[65];
    __shared__ float wsel[65];
    for (int i = threadIdx.x; i <= E; i += blockDim.x) ls[i] = logits[i];
    __syncthreads();
    if (threadIdx.x < 32) {
        long long t0 = clock64();
        for (int r = 0; r < reps; r++) {
            route_warp_smem(4, ls, E, K, 1, chosen, wsel);
            if (threadIdx.x == 0) ls[r % E] += 0.f * wsel[0]; /* a dependency between reps */
            __syncwarp();
        }
        long long t1 = clock64();
        if (threadIdx.x == 0) { cyc[0] = (t1 - t0) / reps; for (int k = 0; k < K; k++) out[k] = chosen[k]; }
    } else if (busy) {
        float a = threadIdx.x, b = 1.0001f;
        for (int i = 0; i < busy; i++) { a = a * b + 0.5f; b = b * 0.99999f + 1e-6f; }
        if (a == 12345.f) out[60] = 1;
    }
}
int main() {
    int E = 256, K = 8;
    float h[257]; srand(1); for (int i = 0; i <= E; i++) h[i] = (rand() % 20000) / 1000.f - 10.f;
    float* d; long long* c; int* o; cudaMalloc(&d, 4 * 257); cudaMalloc(&c, 8); cudaMalloc(&o, 4 * 64);
    cudaMemcpy(d, h, 4 * 257, cudaMemcpyHostToDevice);
    int clk = 0; cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, 0);
    for (int threads : {32, 512}) for (int busy : {0, 200000}) {
        if (threads == 32 && busy) continue;
        topk_time<<<1, threads>>>(d, E, K, 200, busy, c, o);
        long long cy; int ch[8]; cudaMemcpy(&cy, c, 8, cudaMemcpyDeviceToHost); cudaMemcpy(ch, o, 32, cudaMemcpyDeviceToHost);
        printf("threads %d busy %d: %lld cycles per top-%d of %d (%.2f us at the max clock %d MHz); picks %d %d %d\n", threads, busy, cy, K, E, cy / (clk / 1e3), clk / 1000, ch[0], ch[1], ch[2]);
    }
    printf("%s\n", cudaGetErrorString(cudaDeviceSynchronize()));
}
