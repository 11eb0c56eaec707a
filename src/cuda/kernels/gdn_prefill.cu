/*
 * gdn_prefill.cu: a Gated DeltaNet layer over T tokens at once (prefill), after the input
 * projections, with the same math as gdn.cu's one-token kernels and the same state layouts.
 *
 * conv_prefill: causal depthwise conv1d (K <= 8 taps) + SiLU over T tokens with carried state.
 *   x [T, ldx] (channel c at x[t*ldx + c]); state [K-1, C]; w [C, K]; y [T, C].
 *   y[t, c] = silu(sum_j w[c, j] X[t + j, c]) with X = [state; x] (taps summed in order j).
 *   One thread per channel and run of CONV_TT = 16 tokens, the taps and the last K-1 rows in
 *   registers (each x element read once per run, plus K-1 rows of overlap), loads coalesced
 *   across channels. grid (ceil(C/256), ceil(T/16)), block 256. The state is not touched here.
 * conv_state: state <- last K-1 rows of X, after conv_prefill (one thread per channel, rows in
 *   increasing order, so the in-place shift for T < K-1 reads rows not yet overwritten).
 *   grid ceil(C/256), block 256.
 *
 * gdn_qk_prep: per (token t, key head kh): q, k = y[t, q/k of kh]; L2-normalize both (eps 1e-6
 *   inside the sqrt), q also times 1/sqrt(D_k); writes qn, kn [T, H_k, D_k] and kq[t, kh] = qn.kn.
 *   grid (H_k, T), block 128.
 *
 * gdn_scan: the gated delta rule for T tokens, state S [H_v, D_k, D_v] in fp32 registers.
 *   Column j of S evolves on its own: with g = exp(neg_a softplus(a + dt_bias)), beta = sigmoid(b),
 *     u = g S_j.k,  d_j = beta (v_j - u),  o_j = g S_j.q + d_j (k.q),  S_j <- g S_j + d_j k,
 *   which is S <- gS; d = beta(v - S^T k); S <- S + k d^T; o = S^T q of gdn_step, expanded.
 *   A warp owns 8 columns of one head; lane l holds rows l, l+32, ... (D_k/32 <= 8 of them) of
 *   those columns (64 registers at D_k = 128). Per token the 16 partial dots (S_j.k, S_j.q for
 *   8 columns) are summed over the warp by recursive halving (8+4+2+1+1 shuffles; lane l ends
 *   with total number l>>1: 0..7 are S_j.k, 8..15 are S_j.q), then 8 shuffles broadcast the d_j.
 *   The next token's inputs are loaded before the current token's arithmetic.
 *   o [T, H_v, D_v] (before the gated norm). grid (H_v, ceil(D_v/32)), block 128 (4 warps).
 *   Requires D_k % 32 == 0, D_k <= 256, D_v % 8 == 0.
 *
 * gdn_out_norm: o[t, h, :] <- w * o * rsqrt(mean(o^2) + eps) * silu(z[t, h, :]) in place
 *   (z at z[t*ldz + h*D_v + j]). grid (T*H_v), block D_v (multiple of 32, <= 1024). With xb
 *   (D_v a multiple of 64; the default, LILY_CUDA_GDN_NORM_PERM=0: none): the same values rounded
 *   to bf16 into row t of xb [T, H_v*D_v] in x_bf16_perm's layout (the out-projection's gemm_wg input; o untouched),
 *   threads q < D_v/8 writing the head's 16-byte pieces from shared memory.
 */
#define CONV_TT 16
extern "C" __global__ void conv_prefill(ConvPrefillParams_fields) {
    int c = blockIdx.x * blockDim.x + threadIdx.x, t0 = blockIdx.y * CONV_TT;
    if (c >= C) return;
    /* taps and the window of the K - 1 rows before t in registers (static indices only) */
    float wk[8], win[7];
#pragma unroll
    for (int j = 0; j < 8; j++) wk[j] = j < K ? w[(long long)c * K + j] : 0.f;
#pragma unroll
    for (int j = 0; j < 7; j++) {
        int r = t0 + j - (K - 1); /* row of x, or of the state when negative */
        win[j] = j >= K - 1 ? 0.f : r >= 0 ? x[(long long)r * ldx + c] : state[(long long)(K - 1 + r) * C + c];
    }
    int tend = min(T, t0 + CONV_TT);
#pragma unroll 4
    for (int t = t0; t < tend; t++) {
        float xt = x[(long long)t * ldx + c];
        float acc = 0.f;
#pragma unroll
        for (int j = 0; j < 7; j++)
            if (j < K - 1) acc += wk[j] * win[j];
#pragma unroll
        for (int j = 0; j < 8; j++)
            if (j == K - 1) acc += wk[j] * xt;
#pragma unroll
        for (int j = 0; j < 7; j++) win[j] = j == K - 2 ? xt : j < K - 2 ? win[j + 1] : win[j];
        y[(long long)t * C + c] = silu_f(acc);
    }
}

extern "C" __global__ void conv_state(ConvStateParams_fields) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    for (int j = 0; j < K - 1; j++) {
        int r = T + j - (K - 1); /* X row T + j of [state; x] */
        state[(long long)j * C + c] = r >= 0 ? x[(long long)r * ldx + c] : state[(long long)(j + T) * C + c];
    }
}

extern "C" __global__ void gdn_qk_prep(GdnQkPrepParams_fields) {
    __shared__ float sh[33];
    int kh = blockIdx.x, t = blockIdx.y;
    const float* q = y + (long long)t * ldy + kh * dk;
    const float* k = y + (long long)t * ldy + hk * dk + kh * dk;
    float sq = 0.f, sk = 0.f;
    for (int i = threadIdx.x; i < dk; i += blockDim.x) {
        sq += q[i] * q[i];
        sk += k[i] * k[i];
    }
    sq = block_sum(sq, sh);
    sk = block_sum(sk, sh);
    float rq = (1.f / sqrtf((float)dk)) / sqrtf(sq + 1e-6f);
    float rk = 1.f / sqrtf(sk + 1e-6f);
    long long o = ((long long)t * hk + kh) * dk;
    float d = 0.f;
    for (int i = threadIdx.x; i < dk; i += blockDim.x) {
        float a = q[i] * rq, b = k[i] * rk;
        qn[o + i] = a;
        kn[o + i] = b;
        d += a * b;
    }
    d = block_sum(d, sh);
    if (threadIdx.x == 0) kq[(long long)t * hk + kh] = d;
}

extern "C" __global__ void gdn_scan(GdnScanParams_fields) {
    const unsigned FULL = 0xffffffffu;
    int h = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int j0 = (blockIdx.y * 4 + warp) * 8;
    if (j0 >= dv) return;
    int kh = h / (hv / hk);
    int R = dk / 32;
    int mycol = (lane >> 1) & 7; /* the column whose v this lane needs (lanes 0..15) */
    float* Sh = S + (long long)h * dk * dv;
    float s[8][8];
#pragma unroll
    for (int r = 0; r < 8; r++)
#pragma unroll
        for (int c = 0; c < 8; c++) s[r][c] = r < R ? Sh[(long long)(lane + 32 * r) * dv + j0 + c] : 0.f;
    float dtb = dt_bias[h], na = neg_a[h];
    const float* vbase = y + 2 * hk * dk + h * dv + j0 + mycol;
    /* inputs of token t (cur) and t+1 (nxt) */
    float ck[8], cq[8], cv = 0.f, ca = 0.f, cb = 0.f, ckq = 0.f;
    float nk[8], nq[8], nv = 0.f, nav = 0.f, nb = 0.f, nkq = 0.f;
    auto fetch = [&](int t, float* kk, float* qq, float& v, float& a, float& b, float& d) {
        const float* kp = kn + ((long long)t * hk + kh) * dk + lane;
        const float* qp = qn + ((long long)t * hk + kh) * dk + lane;
#pragma unroll
        for (int r = 0; r < 8; r++) {
            kk[r] = r < R ? kp[32 * r] : 0.f;
            qq[r] = r < R ? qp[32 * r] : 0.f;
        }
        v = vbase[(long long)t * ldy];
        a = aproj[(long long)t * ldp + h];
        b = bproj[(long long)t * ldp + h];
        d = kq[(long long)t * hk + kh];
    };
    if (T > 0) fetch(0, ck, cq, cv, ca, cb, ckq);
    for (int t = 0; t < T; t++) {
        if (t + 1 < T) fetch(t + 1, nk, nq, nv, nav, nb, nkq);
        float g = expf(na * softplus_f(ca + dtb));
        float beta = sigmoid_f(cb);
        float v[16];
#pragma unroll
        for (int c = 0; c < 8; c++) {
            float pk = 0.f, pq = 0.f;
#pragma unroll
            for (int r = 0; r < 8; r++) {
                pk += s[r][c] * ck[r];
                pq += s[r][c] * cq[r];
            }
            v[c] = pk;
            v[8 + c] = pq;
        }
        /* recursive halving: after the step with offset m, a lane keeps the half of its values
           selected by its bit m */
#pragma unroll
        for (int i = 0; i < 8; i++) {
            bool up = lane & 16;
            float send = up ? v[i] : v[i + 8], keep = up ? v[i + 8] : v[i];
            v[i] = keep + __shfl_xor_sync(FULL, send, 16);
        }
#pragma unroll
        for (int i = 0; i < 4; i++) {
            bool up = lane & 8;
            float send = up ? v[i] : v[i + 4], keep = up ? v[i + 4] : v[i];
            v[i] = keep + __shfl_xor_sync(FULL, send, 8);
        }
#pragma unroll
        for (int i = 0; i < 2; i++) {
            bool up = lane & 4;
            float send = up ? v[i] : v[i + 2], keep = up ? v[i + 2] : v[i];
            v[i] = keep + __shfl_xor_sync(FULL, send, 4);
        }
        {
            bool up = lane & 2;
            float send = up ? v[0] : v[1], keep = up ? v[1] : v[0];
            v[0] = keep + __shfl_xor_sync(FULL, send, 2);
        }
        float tot = v[0] + __shfl_xor_sync(FULL, v[0], 1);
        /* lanes 0..15: tot = S_j.k for column (lane>>1); lanes 16..31: S_j.q for column ((lane-16)>>1) */
        float d = beta * (cv - g * tot);
        float dj[8];
#pragma unroll
        for (int c = 0; c < 8; c++) dj[c] = __shfl_sync(FULL, d, 2 * c);
        float dmine = __shfl_sync(FULL, d, (lane & 15) & ~1);
        if (lane >= 16 && !(lane & 1)) {
            int c = (lane - 16) >> 1;
            if (j0 + c < dv) o[((long long)t * hv + h) * dv + j0 + c] = g * tot + dmine * ckq;
        }
#pragma unroll
        for (int r = 0; r < 8; r++)
#pragma unroll
            for (int c = 0; c < 8; c++) s[r][c] = g * s[r][c] + ck[r] * dj[c];
        if (t + 1 < T) {
#pragma unroll
            for (int r = 0; r < 8; r++) {
                ck[r] = nk[r];
                cq[r] = nq[r];
            }
            cv = nv;
            ca = nav;
            cb = nb;
            ckq = nkq;
        }
    }
#pragma unroll
    for (int r = 0; r < 8; r++)
        if (r < R)
#pragma unroll
            for (int c = 0; c < 8; c++) Sh[(long long)(lane + 32 * r) * dv + j0 + c] = s[r][c];
}

extern "C" __global__ void gdn_out_norm(GdnOutNormParams_fields) {
    __shared__ float sh[33], sv[1024];
    int row = blockIdx.x, j = threadIdx.x;
    int t = row / hv, h = row - t * hv;
    float val = j < dv ? o[(long long)row * dv + j] : 0.f;
    float ss = block_sum(val * val, sh);
    float v = 0.f;
    if (j < dv) {
        float r = 1.f / sqrtf(ss / (float)dv + eps);
        v = val * r * w[j] * silu_f(z[(long long)t * ldz + h * dv + j]);
        if (!xb) o[(long long)row * dv + j] = v;
    }
    if (!xb) return;
    sv[j] = v;
    __syncthreads();
    if (j >= dv / 8) return;
    /* global piece Q of row t; its 64-column chunk lies inside head h (D_v % 64 == 0) */
    int Q = h * (dv / 8) + j, loc = xperm_col(Q) - h * dv;
    *(uint4*)(xb + (long long)t * hv * dv + Q * 8) = xperm_piece([&](int o) { return sv[loc + o]; });
}
