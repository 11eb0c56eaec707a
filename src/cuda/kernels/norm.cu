/*
 * norm.cu: RMSNorm and small elementwise steps (fp32).
 *
 * rms_norm:  y[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * w      x, y: [rows, d], w: [d]
 *            grid (rows), block 256; one block per row, block_sum over d. y may alias x.
 * silu_mul:  h[i] = silu(g[i]) * u[i] for i < n                         grid ceil(n/256), block 256
 * silu_mul_pairs: h[k, i] = silu(gu[2k, i]) * gu[2k+1, i], i < n, k < pairs (fused gate/up GEMV
 *            output, gate and up of one expert side by side)     grid ceil(n*pairs/256), block 256
 * add:       x[i] += y[i]                                                grid ceil(n/256), block 256
 *
 * Each kernel here takes its arguments as one params struct (RmsNormParams, SiluMulParams,
 * SiluMulPairsParams, AddParams: declared from src/cuda/params.rs).
 */
extern "C" __global__ void rms_norm(const RmsNormParams p) {
    pdl_begin();
    const float *x = p.x, *w = p.w;
    float* y = p.y;
    int d = p.d;
    float eps = p.eps;
    __shared__ float sh[33];
    const float* xr = x + (long long)blockIdx.x * d;
    float* yr = y + (long long)blockIdx.x * d;
    float ss = 0.f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, sh);
    float r = 1.f / sqrtf(ss / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) yr[i] = xr[i] * (r * w[i]);
}

extern "C" __global__ void silu_mul(const SiluMulParams p) {
    pdl_begin();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < p.n) p.h[i] = silu_f(p.g[i]) * p.u[i];
}

extern "C" __global__ void silu_mul_pairs(const SiluMulPairsParams p) {
    pdl_begin();
    int n = p.n, i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n * p.pairs) return;
    int k = i / n, j = i - k * n;
    p.h[i] = silu_f(p.gu[(long long)(2 * k) * n + j]) * p.gu[(long long)(2 * k + 1) * n + j];
}

extern "C" __global__ void add_inplace(const AddParams p) {
    pdl_begin();
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < p.n) p.x[i] += p.y[i];
}
