/*
 * gdn.cu: one decode step of a Gated DeltaNet layer (fp32 state), after the input projections.
 *
 * conv_step: causal depthwise conv1d (K taps) with carried state, then SiLU, for one token.
 *   x [C] = qkv projection; state [K-1, C] raw past inputs; w [C, K] (tap K-1 = current token).
 *   y[c] = silu(sum_j w[c, j] * X[j, c]) with X = [state; x]; then state <- last K-1 rows of X.
 *   grid ceil(C/256), block 256, one thread per channel.
 *
 * Batched decode (both kernels): grid.y = rows of several sequences, row r = blockIdx.y reads its
 *   inputs at r * ld (x / y, b, a, z, out: f32 elements) and, when the table `states` is not null,
 *   updates its own sequence's state states[r] (a device address) instead of `state` / S. One
 *   sequence: grid.y 1, strides 0, states null.
 *
 * gdn_step: per value head h (key head kh = h / (H_v/H_k)), from y = [q | k | v] ([H_k*D_k | H_k*D_k | H_v*D_v]):
 *   q <- q / sqrt(|q|^2 + 1e-6) / sqrt(D_k);  k <- k / sqrt(|k|^2 + 1e-6)
 *   beta = sigmoid(b[h]);  alpha = exp(neg_a[h] * softplus(a[h] + dt_bias[h]))
 *   S <- alpha S;  delta = beta (v - S^T k);  S <- S + k delta^T;  o = S^T q     (S [D_k, D_v], fp32)
 *   o <- w * o * rsqrt(mean(o^2) + eps) * silu(z[h])                           (gated RMSNorm)
 *   State S: [H_v, D_k, D_v] (key-major, same as the CPU State). Output o: [H_v, D_v].
 *   grid (H_v), block D_v threads (multiple of 32, <= 1024); thread j owns column j of S and walks
 *   its D_k entries twice (u = S^T k, then the update and o) in unrolled chunks of 32 rows,
 *   coalesced across the block.
 *   Shared: q, k [D_k] (D_k <= 256).
 *
 * gdn_step_par: the same step with the column walks split over row parts: block (D_v/32) x P warps
 *   (P = ceil(D_k/32) <= 32*32/D_v), warp w owns the 32 columns 32*(w mod CG).. (CG = D_v/32) of
 *   rows 32*(w div CG)..+31; each thread loads its 32 state entries once (all loads issued before
 *   the q/k norms), keeps them in registers for both passes, and the per-part partial sums of
 *   S^T k and S^T q are added through shared memory. Same math and state layout as gdn_step.
 */
extern "C" __global__ void conv_step(ConvStepParams_fields) {
    pdl_begin();
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    x += blockIdx.y * ldx;
    y += blockIdx.y * ldy;
    if (states) state = (float*)states[blockIdx.y];
    if (c >= C) return;
    float acc = 0.f;
    for (int j = 0; j < K; j++) {
        float v = j < K - 1 ? state[(long long)j * C + c] : x[c];
        acc += w[(long long)c * K + j] * v;
    }
    y[c] = silu_f(acc);
    for (int j = 0; j < K - 2; j++) state[(long long)j * C + c] = state[(long long)(j + 1) * C + c];
    if (K >= 2) state[(long long)(K - 2) * C + c] = x[c];
}

/* The step's shared prologue: head kh's raw q and k into qs, ks [D_k] (block-strided), their
   scales rq = 1/sqrt(D_k) / sqrt(|q|^2 + 1e-6) and rk = 1 / sqrt(|k|^2 + 1e-6), and the gates
   beta = sigmoid(b[h]), alpha = exp(neg_a[h] softplus(a[h] + dt_bias[h])). */
__device__ __forceinline__ void gdn_prologue(const float* y, const float* bproj, const float* aproj,
                                             const float* dt_bias, const float* neg_a, int h, int kh, int kd, int dk,
                                             float* qs, float* ks, float* sh, float* rq, float* rk, float* beta,
                                             float* alpha) {
    float sq = 0.f, sk = 0.f;
    for (int i = threadIdx.x; i < dk; i += blockDim.x) {
        float q = y[kh * dk + i], k = y[kd + kh * dk + i];
        qs[i] = q;
        ks[i] = k;
        sq += q * q;
        sk += k * k;
    }
    sq = block_sum(sq, sh);
    sk = block_sum(sk, sh);
    *rq = (1.f / sqrtf((float)dk)) / sqrtf(sq + 1e-6f);
    *rk = 1.f / sqrtf(sk + 1e-6f);
    *beta = sigmoid_f(bproj[h]);
    *alpha = expf(neg_a[h] * softplus_f(aproj[h] + dt_bias[h]));
}

extern "C" __global__ void gdn_step(GdnStepParams_fields) {
    pdl_begin();
    __shared__ float qs[256], ks[256], sh[33];
    int h = blockIdx.x, j = threadIdx.x;
    y += blockIdx.y * ldy;
    bproj += blockIdx.y * ldp;
    aproj += blockIdx.y * ldp;
    z += blockIdx.y * ldp;
    out += blockIdx.y * ldo;
    if (states) S = (float*)states[blockIdx.y];
    int kh = h / (hv / hk);
    int kd = hk * dk;
    float rq, rk, beta, alpha;
    gdn_prologue(y, bproj, aproj, dt_bias, neg_a, h, kh, kd, dk, qs, ks, sh, &rq, &rk, &beta, &alpha);
    for (int i = j; i < dk; i += blockDim.x) {
        qs[i] *= rq;
        ks[i] *= rk;
    }
    __syncthreads();
    float* Sh = S + (long long)h * dk * dv;
    float o = 0.f;
    if (j < dv) {
        /* Rows are visited in chunks of 32 with the loads unrolled, so 32 independent loads are in
           flight per thread instead of one dependent load per row. */
        float u = 0.f;
        for (int i0 = 0; i0 < dk; i0 += 32) {
            float sv[32];
#pragma unroll
            for (int ii = 0; ii < 32; ii++) sv[ii] = i0 + ii < dk ? Sh[(i0 + ii) * dv + j] : 0.f;
#pragma unroll
            for (int ii = 0; ii < 32; ii++)
                if (i0 + ii < dk) u += (alpha * sv[ii]) * ks[i0 + ii];
        }
        float delta = beta * (y[2 * kd + h * dv + j] - u);
        for (int i0 = 0; i0 < dk; i0 += 32) {
            float sv[32];
#pragma unroll
            for (int ii = 0; ii < 32; ii++) sv[ii] = i0 + ii < dk ? Sh[(i0 + ii) * dv + j] : 0.f;
#pragma unroll
            for (int ii = 0; ii < 32; ii++) {
                if (i0 + ii < dk) {
                    float s = alpha * sv[ii] + ks[i0 + ii] * delta;
                    Sh[(i0 + ii) * dv + j] = s;
                    o += s * qs[i0 + ii];
                }
            }
        }
    }
    float ss = block_sum(j < dv ? o * o : 0.f, sh);
    if (j < dv) {
        float r = 1.f / sqrtf(ss / (float)dv + eps);
        out[h * dv + j] = o * r * normw[j] * silu_f(z[h * dv + j]);
    }
}

/* EARLY (gdn_step_par_e, the default; LILY_CUDA_GDN_STEP=par for gdn_step_par): every input of
   the step is loaded in one round right after the wait (q, k, v, z, b, a; normw, dt_bias and
   neg_a, weights, before it), and the two norms' sums reduced together, instead of four
   dependent round trips (q and k, then b and a after their block sums, v after the first partial
   sums, z at the end behind the state stores). The same arithmetic in the same order. */
template <bool ROWS, bool EARLY = false>
__device__ __forceinline__ void gdn_step_par_body(const float* y, const float* bproj, const float* aproj, const float* z,
                                                  const float* dt_bias, const float* neg_a, const float* normw, float* S,
                                                  float* out, int hk, int hv, int dk, int dv, float eps,
                                                  const unsigned long long* states, long long ldy, long long ldp,
                                                  long long ldo, int h) {
    static_assert(!(ROWS && EARLY), "the early loads read one sequence's rows");
    __shared__ float qs[256], ks[256], sh[33];
    __shared__ float part[1024]; /* [P][D_v] partial sums */
    int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    /* Row offsets are applied where each input is read (kernel parameters stay in the constant
       bank instead of 64-bit registers live across the kernel: this block is at 64 registers).
       The table is written before the step graph is captured, so it may be read before the wait. */
    if (ROWS) S = (float*)states[blockIdx.y];
    int cg = dv >> 5, p = warp / cg, j = (warp - p * cg) * 32 + lane;
    int nparts = blockDim.x / dv;
    int kh = h / (hv / hk), kd = hk * dk;
    float* Sh = S + (long long)h * dk * dv;
    float sv[32];
    float nwj = 0.f, dtb = 0.f, na = 0.f;
    if (EARLY) { /* weights: before the wait */
        if (p == 0) nwj = normw[j];
        dtb = dt_bias[h];
        na = neg_a[h];
    }
    pdl_trigger();
    /* The state is this kernel's alone within a step (written by this layer's previous step, long
       complete), so its loads may precede the wait for the previous kernel. */
#pragma unroll
    for (int ii = 0; ii < 32; ii++) {
        int i = p * 32 + ii;
        sv[ii] = i < dk ? Sh[(long long)i * dv + j] : 0.f;
    }
    pdl_wait();
    float rq, rk, beta, alpha, vj = 0.f, zj = 0.f;
    if (EARLY) {
        float q = 0.f, k = 0.f;
        if (tid < dk) {
            q = y[kh * dk + tid];
            k = y[kd + kh * dk + tid];
        }
        vj = y[2 * kd + h * dv + j];
        if (p == 0) zj = z[h * dv + j];
        float b = bproj[h], a = aproj[h];
        if (tid < dk) {
            qs[tid] = q;
            ks[tid] = k;
        }
        /* block_sum(q^2) and block_sum(k^2) as gdn_prologue's, in one pass */
        float sq = warp_sum(tid < dk ? q * q : 0.f), sk = warp_sum(tid < dk ? k * k : 0.f);
        if (lane == 0) {
            part[warp] = sq;
            part[32 + warp] = sk;
        }
        __syncthreads();
        int nw = blockDim.x >> 5;
        sq = warp_sum(lane < nw ? part[lane] : 0.f);
        sk = warp_sum(lane < nw ? part[32 + lane] : 0.f);
        rq = (1.f / sqrtf((float)dk)) / sqrtf(sq + 1e-6f);
        rk = 1.f / sqrtf(sk + 1e-6f);
        beta = sigmoid_f(b);
        alpha = expf(na * softplus_f(a + dtb));
        __syncthreads(); /* part is reused below */
    } else {
        gdn_prologue(y + (ROWS ? blockIdx.y * ldy : 0), bproj + (ROWS ? blockIdx.y * ldp : 0),
                     aproj + (ROWS ? blockIdx.y * ldp : 0), dt_bias, neg_a, h, kh, kd, dk, qs, ks, sh, &rq, &rk, &beta,
                     &alpha);
    }
    float u = 0.f;
#pragma unroll
    for (int ii = 0; ii < 32; ii++) {
        int i = p * 32 + ii;
        if (i < dk) u += (alpha * sv[ii]) * (ks[i] * rk);
    }
    part[p * dv + j] = u;
    __syncthreads();
    u = 0.f;
    for (int pp = 0; pp < nparts; pp++) u += part[pp * dv + j];
    float delta = beta * ((EARLY ? vj : y[(ROWS ? blockIdx.y * ldy : 0) + 2 * kd + h * dv + j]) - u);
    float o = 0.f;
#pragma unroll
    for (int ii = 0; ii < 32; ii++) {
        int i = p * 32 + ii;
        if (i < dk) {
            float s = alpha * sv[ii] + (ks[i] * rk) * delta;
            Sh[(long long)i * dv + j] = s;
            o += s * (qs[i] * rq);
        }
    }
    __syncthreads(); /* every thread has read its u partials */
    part[p * dv + j] = o;
    __syncthreads();
    o = 0.f;
    for (int pp = 0; pp < nparts; pp++) o += part[pp * dv + j];
    float ss = block_sum(p == 0 ? o * o : 0.f, sh);
    if (p == 0) {
        float r = 1.f / sqrtf(ss / (float)dv + eps);
        float nw = EARLY ? nwj : normw[j], zz = EARLY ? zj : z[(ROWS ? blockIdx.y * ldp : 0) + h * dv + j];
        out[(ROWS ? blockIdx.y * ldo : 0) + h * dv + j] = o * r * nw * silu_f(zz);
    }
}

/* One sequence (up to 1024 threads: 64 registers). */
extern "C" __global__ void __launch_bounds__(1024) gdn_step_par(GdnStepParParams_fields) {
    TL_SCOPE("gdn_step_par");
    gdn_step_par_body<false>(y, bproj, aproj, z, dt_bias, neg_a, normw, S, out, hk, hv, dk, dv, eps, nullptr, 0, 0, 0,
                             blockIdx.x);
}

/* gdn_step_par with its inputs loaded in one round (EARLY above; the decode default). */
extern "C" __global__ void __launch_bounds__(1024) gdn_step_par_e(GdnStepParParams_fields) {
    TL_SCOPE("gdn_step_par_e");
    gdn_step_par_body<false, true>(y, bproj, aproj, z, dt_bias, neg_a, normw, S, out, hk, hv, dk, dv, eps, nullptr, 0, 0,
                                   0, blockIdx.x);
}

/* The batched decode's rows (grid.y), each on its own state (at most 512 threads, so the row
   offsets and the table fit in registers beside the 32 state entries per thread). */
extern "C" __global__ void __launch_bounds__(512) gdn_step_par_rows(GdnStepParRowsParams_fields) {
    gdn_step_par_body<true>(y, bproj, aproj, z, dt_bias, neg_a, normw, nullptr, out, hk, hv, dk, dv, eps, states, ldy,
                            ldp, ldo, blockIdx.x);
}
