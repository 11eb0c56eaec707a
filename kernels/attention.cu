/*
 * attention.cu: gated full attention for one new token over an fp32 KV cache.
 *
 * The position is read from device memory (pos_p[0]; L = pos + 1 cached positions) so that a
 * captured CUDA graph replays every decode step unchanged.
 *
 * attn_prep: grid (H_q + H_kv, T), block = head dim D threads (D <= 256, multiple of 32).
 *   Token t = blockIdx.y sits at position pos_p[0] + t; its inputs are at qg/k/v + t*ld and its
 *   query goes to q_out + t*H_q*D (decode: T = 1).
 *   Block b < H_q: q = qg[b, 0:D] (qg per head [q | gate] when gated, else [q]), RMSNorm with
 *   q_norm, partial NeoX RoPE on dims [0, R): for i < R/2, theta = pos * base^(-2i/R) (double),
 *   x[i] <- x[i] cos - x[i+R/2] sin, x[i+R/2] <- x[i+R/2] cos + x[i] sin. Writes q_out[b].
 *   Block H_q + h: k head h likewise with k_norm, written to kc[pos, h]; v copied to vc[pos, h].
 *   Caches kc, vc: [capacity, H_kv, D] fp32.
 *
 * attn_decode (flash-decoding): grid (H_q, S splits), block 256 = 8 warps. Query head h reads KV
 *   head h / (H_q/H_kv); split s covers positions [s*ceil(L/S), (s+1)*ceil(L/S)) ∩ [0, L).
 *   Warp w takes positions 8w..8w+7, then +64, ... < L (8 independent warp dot products per round;
 *   each lane holds D/32 <= 8 dims, coalesced), then one online-softmax update per round (running
 *   max m, sum l, output o).
 *   The 8 warps' (m, l, o) are merged through shared memory and written unnormalized as the split's
 *   partial: part[h, s] = (M_s, l_s = sum_w l_w e^{m_w - M_s}, o_s = sum_w o_w e^{m_w - M_s}) [D + 2].
 *   An empty split writes M = -inf. scale = 1/sqrt(D).
 *
 * attn_combine: grid (H_q), block 256: M = max_s M_s; out[h] = sum_s o_s e^{M_s - M} / sum_s l_s e^{M_s - M},
 *   times sigmoid(gate[h]) when gated.
 */
extern "C" __global__ void attn_prep(const float* qg, const float* kin, const float* vin, const float* qn,
                                     const float* kn, float* q_out, float* kc, float* vc, int nh, int hkv, int hd,
                                     int gated, int rot, const int* pos_p, double theta, float eps,
                                     long long ld) {
    pdl_begin();
    int pos = pos_p[0] + blockIdx.y;
    qg += blockIdx.y * ld;
    kin += blockIdx.y * ld;
    vin += blockIdx.y * ld;
    q_out += (long long)blockIdx.y * nh * hd;
    __shared__ float xs[256], sh[33];
    int b = blockIdx.x, j = threadIdx.x;
    bool isq = b < nh;
    int h = isq ? b : b - nh;
    const float* src = isq ? qg + (long long)h * hd * (gated ? 2 : 1) : kin + (long long)h * hd;
    const float* nw = isq ? qn : kn;
    float v = j < hd ? src[j] : 0.f;
    float ss = block_sum(v * v, sh);
    float r = 1.f / sqrtf(ss / (float)hd + eps);
    if (j < hd) xs[j] = v * (r * nw[j]);
    __syncthreads();
    float outv = j < hd ? xs[j] : 0.f;
    int half = rot / 2;
    if (j < rot) {
        int i = j < half ? j : j - half;
        double ang = (double)pos * pow(theta, -(2.0 * i) / (double)rot);
        float c = (float)cos(ang), s = (float)sin(ang);
        if (j < half) outv = xs[j] * c - xs[j + half] * s;
        else outv = xs[j] * c + xs[j - half] * s;
    }
    if (j < hd) {
        if (isq) q_out[(long long)h * hd + j] = outv;
        else {
            long long off = ((long long)pos * hkv + h) * hd + j;
            kc[off] = outv;
            vc[off] = vin[(long long)h * hd + j];
        }
    }
}

extern "C" __global__ void attn_decode(const float* q, const float* kc, const float* vc, float* part, int nh,
                                       int hkv, int hd, const int* pos_p, float scale) {
    pdl_begin();
    __shared__ float so[8][256];
    __shared__ float sm[8], sl[8];
    int L = pos_p[0] + 1;
    int h = blockIdx.x, split = blockIdx.y, S = gridDim.y;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int kvh = h / (nh / hkv);
    int nd = hd / 32;
    int chunk = (L + S - 1) / S;
    int lo = split * chunk, hi = min(L, lo + chunk);
    float qv[8], o[8];
    for (int i = 0; i < 8; i++) {
        qv[i] = i < nd ? q[(long long)h * hd + lane + 32 * i] : 0.f;
        o[i] = 0.f;
    }
    float m = -INFINITY, l = 0.f;
    /* Each warp takes 8 consecutive positions per round (rounds stride 64): the 8 dot products
       load independently, then one online-softmax update covers all 8. */
    for (int p0 = lo + warp * 8; p0 < hi; p0 += 64) {
        float d[8];
#pragma unroll
        for (int u = 0; u < 8; u++) {
            int p = p0 + u;
            float acc = 0.f;
            if (p < hi) {
                const float* kp = kc + ((long long)p * hkv + kvh) * hd;
#pragma unroll
                for (int i = 0; i < 8; i++)
                    if (i < nd) acc += qv[i] * kp[lane + 32 * i];
            }
            d[u] = acc;
        }
        float mx = m;
#pragma unroll
        for (int u = 0; u < 8; u++) {
            d[u] = p0 + u < hi ? warp_sum(d[u]) * scale : -INFINITY;
            mx = fmaxf(mx, d[u]);
        }
        float corr = expf(m - mx);
        l *= corr;
#pragma unroll
        for (int i = 0; i < 8; i++) o[i] *= corr;
#pragma unroll
        for (int u = 0; u < 8; u++) {
            int p = p0 + u;
            if (p < hi) {
                float pw = expf(d[u] - mx);
                l += pw;
                const float* vp = vc + ((long long)p * hkv + kvh) * hd;
#pragma unroll
                for (int i = 0; i < 8; i++)
                    if (i < nd) o[i] += pw * vp[lane + 32 * i];
            }
        }
        m = mx;
    }
    for (int i = 0; i < nd; i++) so[warp][lane + 32 * i] = o[i];
    if (lane == 0) {
        sm[warp] = m;
        sl[warp] = l;
    }
    __syncthreads();
    float M = -INFINITY;
    for (int w = 0; w < 8; w++) M = fmaxf(M, sm[w]);
    float* pp = part + ((long long)h * S + split) * (hd + 2);
    if (threadIdx.x == 0) {
        float Lsum = 0.f;
        for (int w = 0; w < 8; w++) Lsum += sm[w] == -INFINITY ? 0.f : sl[w] * expf(sm[w] - M);
        pp[0] = M;
        pp[1] = Lsum;
    }
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc = 0.f;
        for (int w = 0; w < 8; w++)
            if (sm[w] != -INFINITY) acc += so[w][d] * expf(sm[w] - M);
        pp[2 + d] = acc;
    }
}

extern "C" __global__ void attn_combine(const float* part, const float* qg, float* out, int nh, int hd, int S,
                                        int gated) {
    pdl_begin();
    int h = blockIdx.x;
    const float* ph = part + (long long)h * S * (hd + 2);
    float M = -INFINITY;
    for (int s = 0; s < S; s++) M = fmaxf(M, ph[s * (hd + 2)]);
    float den = 0.f;
    for (int s = 0; s < S; s++) {
        float ms = ph[s * (hd + 2)];
        if (ms != -INFINITY) den += ph[s * (hd + 2) + 1] * expf(ms - M);
    }
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float acc = 0.f;
        for (int s = 0; s < S; s++) {
            float ms = ph[s * (hd + 2)];
            if (ms != -INFINITY) acc += ph[s * (hd + 2) + 2 + d] * expf(ms - M);
        }
        float r = acc / den;
        if (gated) r *= sigmoid_f(qg[(long long)h * 2 * hd + hd + d]);
        out[(long long)h * hd + d] = r;
    }
}
