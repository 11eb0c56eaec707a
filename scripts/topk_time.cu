/*
 * topk_time.cu: how long the router's top-K takes on one warp (route_warp_smem, moe.cu: the
 * graph's moe_fused_q2s and the persistent step's ps_route; mode 4 redux2, mode 5 thresh), in SM
 * cycles (clock64), alone and beside 15 warps of FMA work as in the persistent step, after
 * checking each form's picks and weight bits against route_topk on random, tied, NaN and signed
 * zero logits. Not part of lily: appended by scripts/topk_time.sh to moe.cu and what it needs
 * from lily's kernel source, and compiled by nvcc on the GPU machine. Timing: one block of 32 or
 * 512 threads; warp 0 ranks E = 256 random logits (+ the shared gate) 200 times in shared
 * memory, each round depending on the last.
 */
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <vector>
/* block b: case b's logits (stride 520, E + 1 with the shared gate); out[b]: route_topk's ids and
   weight bits, then route_warp_smem(mode)'s, then route_warp(mode)'s, 3 x 2 x 64 words */
extern "C" __global__ void topk_check(const float* logits, const int* ek, int mode, u32* out) {
    __shared__ float ls[1024], lsm[520], wsel[65];
    __shared__ int chosen[65];
    const float* lg = logits + blockIdx.x * 520;
    int E = ek[4 * blockIdx.x], K = ek[4 * blockIdx.x + 1], renorm = ek[4 * blockIdx.x + 2];
    u32* o = out + blockIdx.x * 384;
    for (int i = threadIdx.x; i <= E; i += 32) lsm[i] = lg[i];
    __syncwarp();
    for (int f = 0; f < 3; f++) {
        if (f == 0) route_topk(lg, E, K, renorm, 1, ls, chosen, wsel);
        else if (f == 1) route_warp_smem(mode, lsm, E, K, renorm, chosen, wsel);
        else route_warp(mode, lg, E, K, renorm, 1, ls, chosen, wsel);
        for (int k = threadIdx.x; k <= K; k += 32) {
            o[f * 128 + k] = (u32)chosen[k];
            o[f * 128 + 64 + k] = __float_as_uint(wsel[k]);
        }
        __syncwarp();
        for (int k = threadIdx.x; k < 65; k += 32) { chosen[k] = -1; wsel[k] = -1.f; }
        __syncwarp();
    }
}
template <int MODE>
__global__ void topk_time(const float* logits, int E, int K, int reps, int busy, long long* cyc, int* out) {
    __shared__ float ls[520];
    __shared__ int chosen[65];
    __shared__ float wsel[65];
    for (int i = threadIdx.x; i <= E; i += blockDim.x) ls[i] = logits[i];
    __syncthreads();
    if (threadIdx.x < 32) {
        long long t0 = clock64();
        for (int r = 0; r < reps; r++) {
            if (MODE) route_warp_smem(MODE, ls, E, K, 1, chosen, wsel); /* MODE 0: the loop alone */
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
    /* the checks */
    srand(7);
    std::vector<float> lg;
    std::vector<int> ek;
    auto add = [&](int E, int K, int renorm, int kind) {
        size_t b = lg.size();
        lg.resize(b + 520, 0.f);
        for (int i = 0; i <= E; i++) {
            float v = (rand() % 20000) / 1000.f - 10.f;
            if (kind == 1) v = (float)(rand() % 4);        /* many ties: c > 32, the fallback */
            if (kind == 2) v = (float)(rand() % 64) * 0.25f; /* some ties at the threshold */
            if (kind == 3 && rand() % 5 == 0) v = NAN;
            if (kind == 4) v = (rand() % 3 == 0) ? -0.f : (rand() % 2 ? 0.f : -1.f);
            if (kind == 5) v = -INFINITY;
            if (kind == 6) v = (rand() % 2) ? NAN : -INFINITY;
            lg[b + i] = v;
        }
        ek.push_back(E); ek.push_back(K); ek.push_back(renorm); ek.push_back(kind);
    };
    int Es[][2] = {{256, 8}, {512, 10}, {128, 8}, {64, 8}, {16, 4}, {257, 32}, {33, 32}, {512, 32}};
    for (auto& ekp : Es) for (int kind = 0; kind < 7; kind++) for (int renorm = 0; renorm < 2; renorm++)
        for (int rep = 0; rep < (kind == 0 ? 20 : 4); rep++) add(ekp[0], ekp[1], renorm, kind);
    int n = (int)ek.size() / 4;
    float* dl; int* de; u32* dout;
    cudaMalloc(&dl, 4 * lg.size()); cudaMalloc(&de, 4 * ek.size()); cudaMalloc(&dout, 4 * 384 * n);
    cudaMemcpy(dl, lg.data(), 4 * lg.size(), cudaMemcpyHostToDevice);
    cudaMemcpy(de, ek.data(), 4 * ek.size(), cudaMemcpyHostToDevice);
    /* mode 4 (redux2) and 5 (thresh) against route_topk (NaN and all -inf cases aside: route_topk
       skips NaN where the register forms rank it as -inf, and repeats index 0 when all are -inf), and mode 5 against mode 4 on every case */
    std::vector<u32> h4(384 * n), h5(384 * n);
    int bad_total = 0;
    for (int mode : {4, 5}) {
        cudaMemset(dout, 0, 4 * 384 * n);
        topk_check<<<n, 32>>>(dl, de, mode, dout);
        cudaMemcpy(mode == 4 ? h4.data() : h5.data(), dout, 4 * 384 * n, cudaMemcpyDeviceToHost);
    }
    auto cmp = [&](const char* what, const std::vector<u32>& a, int fa, const std::vector<u32>& b, int fb, bool nan) {
        int bad = 0, cases = 0;
        for (int c = 0; c < n; c++) {
            int K = ek[4 * c + 1], kind = ek[4 * c + 3];
            if (!nan && kind >= 3 && kind != 4) continue; /* NaN, or -inf where route_topk repeats index 0 */
            cases++;
            for (int k = 0; k <= K; k++)
                for (int w = 0; w < 2; w++) {
                    u32 x = a[384 * c + fa * 128 + w * 64 + k], y = b[384 * c + fb * 128 + w * 64 + k];
                    if (x != y) {
                        if (bad < 5)
                            printf("  %s: case %d (E %d K %d renorm %d kind %d) slot %d %s: %08x vs %08x\n", what, c,
                                   ek[4 * c], K, ek[4 * c + 2], kind, k, w ? "weight" : "id", x, y);
                        bad++;
                    }
                }
        }
        printf("check %s: %d cases, %d mismatching words\n", what, cases, bad);
        bad_total += bad;
    };
    cmp("redux2 smem vs route_topk", h4, 1, h4, 0, false);
    cmp("redux2 global vs route_topk", h4, 2, h4, 0, false);
    cmp("thresh smem vs route_topk", h5, 1, h5, 0, false);
    cmp("thresh global vs route_topk", h5, 2, h5, 0, false);
    cmp("thresh smem vs redux2 smem", h5, 1, h4, 1, true);
    cmp("thresh global vs redux2 global", h5, 2, h4, 2, true);
    /* the timing */
    int E = 256, K = 8;
    float hl[257]; srand(1); for (int i = 0; i <= E; i++) hl[i] = (rand() % 20000) / 1000.f - 10.f;
    float* d; long long* c; int* o; cudaMalloc(&d, 4 * 257); cudaMalloc(&c, 8); cudaMalloc(&o, 4 * 64);
    cudaMemcpy(d, hl, 4 * 257, cudaMemcpyHostToDevice);
    int clk = 0; cudaDeviceGetAttribute(&clk, cudaDevAttrClockRate, 0);
    printf("| form | warp 0 ranks a top-%d of %d | cycles | us at %d MHz |\n|---|---|---:|---:|\n", K, E, clk / 1000);
    for (int mode : {0, 4, 5}) for (int threads : {32, 512}) for (int busy : {0, 200000}) {
        if (threads == 32 && busy) continue;
        auto kern = mode == 0 ? topk_time<0> : mode == 4 ? topk_time<4> : topk_time<5>;
        kern<<<1, threads>>>(d, E, K, 200, busy, c, o);
        long long cy; cudaMemcpy(&cy, c, 8, cudaMemcpyDeviceToHost);
        printf("| %s | %s | %lld | %.2f |\n", mode == 5 ? "thresh" : mode == 4 ? "redux2" : "(the loop alone)",
               threads == 32 ? "alone" : busy ? "beside 15 busy warps" : "beside 15 idle warps", cy, cy / (clk / 1e3));
    }
    printf("%s\n", cudaGetErrorString(cudaDeviceSynchronize()));
    return bad_total ? 1 : 0;
}
