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
 * attn_decode (flash-decoding, GQA-packed): grid (H_kv, S splits), block 32*G threads (G = H_q/H_kv
 *   <= 32 query heads share a KV head; warp w is query head kvh*G + w). Split s covers positions
 *   [s*c, (s+1)*c) ∩ [0, L), c = max(64, ceil(L/S) rounded up to 16): short contexts use few
 *   splits and the others exit at once. The block stages tiles of 16 cached K and V rows
 *   ([16][D] fp32 each, float4 loads) in shared memory once for all G warps, so each KV row
 *   leaves memory once per step instead of G times. Each warp computes its 16 dot products (lane
 *   holds dims lane + 32i, D/32 <= 8), 16 independent warp sums, then one online-softmax update
 *   (running max m, sum l, output o) per tile, and writes its split's partial unnormalized:
 *   part[h, s] = (m, l, o) [D + 2]; an empty split writes m = -inf. scale = 1/sqrt(D).
 *
 * attn_combine: grid (H_q), block 256: M = max_s M_s; out[h] = sum_s o_s e^{M_s - M} / sum_s l_s e^{M_s - M},
 *   times sigmoid(gate[h]) when gated.
 */
extern "C" __global__ void attn_prep(const float* qg, const float* kin, const float* vin, const float* qn,
                                     const float* kn, float* q_out, float* kc, float* vc, int nh, int hkv, int hd,
                                     int gated, int rot, const int* pos_p, double theta, float eps,
                                     long long ld) {
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
    __shared__ __align__(16) float Ks[16 * 256], Vs[16 * 256];
    int L = pos_p[0] + 1;
    int kvh = blockIdx.x, split = blockIdx.y, S = gridDim.y;
    int G = nh / hkv;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int h = kvh * G + warp;
    int nd = hd / 32, nd4 = hd / 4;
    /* at least 64 positions per split: short contexts use few splits, the rest exit empty */
    int chunk = max(64, (((L + S - 1) / S + 15) / 16) * 16);
    int lo = split * chunk, hi = min(L, lo + chunk);
    float qv[8], o[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        qv[i] = i < nd ? q[(long long)h * hd + lane + 32 * i] : 0.f;
        o[i] = 0.f;
    }
    float m = -INFINITY, l = 0.f;
    for (int p0 = lo; p0 < hi; p0 += 16) {
        __syncthreads();
        for (int e = threadIdx.x; e < 16 * nd4; e += blockDim.x) {
            int j = e / nd4, d = (e - j * nd4) * 4, p = p0 + j;
            float4 kv = make_float4(0.f, 0.f, 0.f, 0.f), vv = kv;
            if (p < hi) {
                long long off = ((long long)p * hkv + kvh) * hd + d;
                kv = *(const float4*)(kc + off);
                vv = *(const float4*)(vc + off);
            }
            *(float4*)(Ks + j * hd + d) = kv;
            *(float4*)(Vs + j * hd + d) = vv;
        }
        __syncthreads();
        float dd[16];
#pragma unroll
        for (int j = 0; j < 16; j++) {
            float acc = 0.f;
#pragma unroll
            for (int i = 0; i < 8; i++)
                if (i < nd) acc += qv[i] * Ks[j * hd + lane + 32 * i];
            dd[j] = acc;
        }
        float mx = m;
#pragma unroll
        for (int j = 0; j < 16; j++) {
            float sc = warp_sum(dd[j]) * scale;
            dd[j] = p0 + j < hi ? sc : -INFINITY;
            mx = fmaxf(mx, dd[j]);
        }
        float corr = expf(m - mx);
        l *= corr;
#pragma unroll
        for (int i = 0; i < 8; i++) o[i] *= corr;
#pragma unroll
        for (int j = 0; j < 16; j++) {
            if (p0 + j < hi) {
                float pw = expf(dd[j] - mx);
                l += pw;
#pragma unroll
                for (int i = 0; i < 8; i++)
                    if (i < nd) o[i] += pw * Vs[j * hd + lane + 32 * i];
            }
        }
        m = mx;
    }
    float* pp = part + ((long long)h * S + split) * (hd + 2);
    if (lane == 0) {
        pp[0] = m;
        pp[1] = l;
    }
    for (int i = 0; i < nd; i++) pp[2 + lane + 32 * i] = o[i];
}

extern "C" __global__ void attn_combine(const float* part, const float* qg, float* out, int nh, int hd, int S,
                                        int gated) {
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
