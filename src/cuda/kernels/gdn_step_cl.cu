/*
 * gdn_step_cl.cu: gdn_step_c4 (the decode default since session 41, +2.3% at 4K on an H100;
 * LILY_CUDA_GDN_STEP=e: gdn_step_par_e): the decode GDN state step of
 * gdn_step_par_e with each value head on a cluster of 4 blocks instead of one block, so the
 * step's 32 heads (Qwen3.6) occupy 128 SMs instead of 32: each block loads and stores a quarter
 * of its head's state (16 KB each way) and each thread issues a quarter of the instructions
 * (session 41's ncu: gdn_step_par_e ran ~1,600 instructions a warp over ~6 µs on 32 SMs).
 *
 * Math (as gdn_step): per value head h (key head kh = h / (H_v / H_k)): q, k l2-normalized (q
 *   also by 1/sqrt(D_k)), beta = sigmoid(b[h]), alpha = exp(neg_a[h] softplus(a[h] + dt_bias[h])),
 *   S <- alpha S, u = S^T k, delta = beta (v - u), S <- S + k delta^T, o = S^T q,
 *   out = o rsqrt(mean(o^2) + eps) normw silu(z).
 *
 * Layouts: y = [q (H_k D_k) | k (H_k D_k) | v (H_v D_v)]; z [H_v D_v]; b, a [H_v]; state
 *   [H_v, D_k, D_v] key-major (gdn_step's); out [H_v D_v].
 *
 * Geometry (D_v = 128, D_k <= 128; the host checks): grid 4 H_v blocks of 512 threads, clusters
 *   of 4 along x, cluster h = value head h; block rank c owns columns j = 32c + lane, warp w rows
 *   8w .. 8w + 7 (those < D_k), 8 state entries a thread in registers for both passes. u and o
 *   are summed over the 16 warps through shared memory (warp order); the gated norm's sum of
 *   squares over the head's 4 blocks through one cluster exchange (each block's partial stored
 *   into all 4 blocks' ssq[c], ranks added in order: the same value in each block).
 *   The state loads precede the PDL wait (the state is this kernel's alone within a step).
 *   Shared: qs, ks [128], part [16][32], red [64], ssq [4] (GSC_SMEM floats, passed in so that
 *   scripts/emu.sh can run the body with the cluster's 4 blocks concurrent).
 */
/* Cluster rank, barrier halves and a store into a cluster block's shared memory (sm_90; the
   host launches the cluster kernels nowhere else; LILY_EMU: scripts/emu/shim.h's emulation). */
__device__ __forceinline__ u32 cl_rank() {
#if __CUDA_ARCH__ >= 900
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
#elif defined(LILY_EMU)
    return emu_cl_rank();
#else
    return 0;
#endif
}
__device__ __forceinline__ void cl_arrive_relaxed() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cl_arrive() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#elif defined(LILY_EMU)
    emu_cl_wait();
#endif
}
/* *local in the shared memory of the cluster's block `rank` (the same offset) = v */
__device__ __forceinline__ void cl_store(float* local, u32 rank, float v) {
#if __CUDA_ARCH__ >= 900
    u32 a;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(smem_u32(local)), "r"(rank));
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(a), "f"(v) : "memory");
#elif defined(LILY_EMU)
    emu_cl_store(local, rank, v);
#endif
}

#define GSC_CS 4
constexpr int GSC_SMEM = 128 + 128 + 16 * 32 + 64 + 4;
#if __CUDA_ARCH__ >= 900
#define GSC_CL_DIMS __cluster_dims__(GSC_CS, 1, 1)
#else
#define GSC_CL_DIMS
#endif

__device__ __forceinline__ void gdn_step_c4_body(const float* y, const float* bproj, const float* aproj, const float* z,
                                                 const float* dt_bias, const float* neg_a, const float* normw, float* S,
                                                 float* out, int hk, int hv, int dk, int dv, float eps, float* sm) {
    float *qs = sm, *ks = sm + 128, *part = sm + 256, *red = part + 16 * 32, *ssq = red + 64;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int rank = (int)cl_rank(), h = blockIdx.x / GSC_CS, j = 32 * rank + lane;
    const int kh = h / (hv / hk), kd = hk * dk;
    float* Sh = S + (long long)h * dk * dv;
    cl_arrive_relaxed(); /* this block runs: the others may store into its ssq after their wait */
    const float nwj = normw[j], dtb = dt_bias[h], na = neg_a[h];
    pdl_trigger();
    float sv[8];
#pragma unroll
    for (int ii = 0; ii < 8; ii++) {
        int i = 8 * warp + ii;
        sv[ii] = i < dk ? Sh[(long long)i * dv + j] : 0.f;
    }
    pdl_wait();
    float q = 0.f, k = 0.f;
    if (tid < dk) {
        q = y[kh * dk + tid];
        k = y[kd + kh * dk + tid];
    }
    const float vj = y[2 * kd + h * dv + j], zj = z[h * dv + j], b = bproj[h], a = aproj[h];
    if (tid < dk) {
        qs[tid] = q;
        ks[tid] = k;
    }
    /* the two norms' sums over D_k (warps 0..3 hold them), reduced together */
    float sq = warp_sum(q * q), sk = warp_sum(k * k);
    if (lane == 0) {
        red[warp] = sq;
        red[32 + warp] = sk;
    }
    __syncthreads();
    sq = warp_sum(lane < 16 ? red[lane] : 0.f);
    sk = warp_sum(lane < 16 ? red[32 + lane] : 0.f);
    const float rq = (1.f / sqrtf((float)dk)) / sqrtf(sq + 1e-6f), rk = 1.f / sqrtf(sk + 1e-6f);
    const float beta = sigmoid_f(b), alpha = expf(na * softplus_f(a + dtb));
    float u = 0.f;
#pragma unroll
    for (int ii = 0; ii < 8; ii++) {
        int i = 8 * warp + ii;
        if (i < dk) u += (alpha * sv[ii]) * (ks[i] * rk);
    }
    part[warp * 32 + lane] = u;
    __syncthreads();
    u = 0.f;
#pragma unroll
    for (int w = 0; w < 16; w++) u += part[w * 32 + lane];
    const float delta = beta * (vj - u);
    float o = 0.f;
#pragma unroll
    for (int ii = 0; ii < 8; ii++) {
        int i = 8 * warp + ii;
        if (i < dk) {
            float s = alpha * sv[ii] + (ks[i] * rk) * delta;
            Sh[(long long)i * dv + j] = s;
            o += s * (qs[i] * rq);
        }
    }
    __syncthreads(); /* every thread has read its u partials */
    part[warp * 32 + lane] = o;
    __syncthreads();
    o = 0.f;
#pragma unroll
    for (int w = 0; w < 16; w++) o += part[w * 32 + lane];
    /* the gated norm's sum of squares: this block's 32 columns, then the head's 4 blocks */
    float ss = warp_sum(o * o);
    cl_wait(); /* every block of the cluster runs */
    if (warp == 0 && lane < GSC_CS) cl_store(ssq + rank, lane, ss);
    cl_arrive();
    cl_wait();
    ss = ((ssq[0] + ssq[1]) + ssq[2]) + ssq[3];
    if (warp == 0) out[h * dv + j] = o * (1.f / sqrtf(ss / (float)dv + eps)) * nwj * silu_f(zj);
}

extern "C" __global__ void GSC_CL_DIMS __launch_bounds__(512, 1) gdn_step_c4(GdnStepParParams_fields) {
    __shared__ __align__(16) float sm[GSC_SMEM];
    TL_SCOPE("gdn_step_c4");
    gdn_step_c4_body(y, bproj, aproj, z, dt_bias, neg_a, normw, S, out, hk, hv, dk, dv, eps, sm);
}
